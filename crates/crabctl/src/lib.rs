//! What `crabctl` does with checkpoints: list turns and checkpoints, verify,
//! collect garbage, and bring sandboxes back (recover, rollback, fork); and its
//! client of containerd ([`containerd`]), which `crab-replay` shares.
//!
//! Restores go through containerd: a restored or forked sandbox is a normal
//! container on the crab runtime, created with the `io.crab.restore-from`
//! annotation; its shim writes the rootfs as at the turn and restores the
//! processes from the newest process checkpoint at or before it.

pub mod cli;
pub mod remote;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crab_containerd::Ctr;
use crab_store::turns::{ANNOTATION_RESTORE_FROM, RecordedClass, TurnLog, TurnRecord};
use crab_store::{CheckpointStore, RollbackRequest, SandboxKey};

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error(transparent)]
    Store(#[from] crab_store::CheckpointError),
    #[error(transparent)]
    Log(#[from] crab_store::turns::TurnLogError),
    #[error("containerd: {0}")]
    Containerd(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Key(#[from] crab_store::KeyError),
    #[error(transparent)]
    Config(#[from] crab_config::ConfigError),
    #[error(transparent)]
    Remote(#[from] crab_remote::RemoteError),
    /// A command that would recreate a pod's container outside its pod.
    #[error(
        "{what} of {container:?} refused: it is container {:?} of pod sandbox {} in Kubernetes namespace {:?} (CRI), \
         and crabctl would recreate it outside its pod, without the pod's namespaces, mounts and cgroup. {advice}",
        .pod.container_name, .pod.pod_sandbox, .pod.kube_namespace
    )]
    OutsidePod { what: &'static str, container: String, pod: Box<crab_store::PodOwner>, advice: &'static str },
}

/// What to do instead of a restore of a pod's container by crabctl.
const RESTART_IN_POD: &str = "Let kubelet restart it (kill its task, or let it crash): crab restores its latest \
     checkpoint into the replacement, in the pod (io.crab.restore=auto, the default).";
const FORK_IN_POD: &str = "Fork it in a pod: a container of a new pod (same Kubernetes namespace) with the \
     annotation io.crab.restore-from=k8s.io/<id>:<turn>, which the CRI runtime entry must let through.";

pub type Result<T> = std::result::Result<T, CtlError>;

pub const CRAB_RUNTIME: &str = "io.containerd.crab.v2";

/// How long rollback and fork wait for a turn in flight to be checkpointed.
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The state directory and the containerd (socket and namespace) a command works against.
/// Sandboxes are named by container id (or `<id>@<n>` for a retired chain) in the namespace
/// of `ctr`; their chains and turn logs are that namespace's.
pub struct Ctl {
    pub state_dir: PathBuf,
    pub store: Arc<CheckpointStore>,
    pub ctr: Ctr,
    /// containerd's API on `ctr`'s socket and namespace, one connection for the command.
    containerd: crab_containerd::grpc::Containerd,
}

#[derive(Debug, Serialize)]
pub struct CheckpointRow {
    pub turn: u64,
    pub class: String,
    pub id: String,
    pub created_unix_ms: u64,
    pub fs_entries: usize,
    pub has_images: bool,
    /// A turn whose checkpoint was dropped for the newer one of this turn (no id then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub superseded_by: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct VerifyRow {
    pub container: String,
    pub head_turn: Option<u64>,
    pub ok: bool,
    pub manifests: u64,
    pub blobs: u64,
    pub bytes: u64,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct RestoreReport {
    pub container: String,
    pub from: String,
    pub turn: u64,
    /// The checkpoint the state came from (the newest at or before `turn`), none for turn 0.
    pub checkpoint_turn: Option<u64>,
    /// `in-place` (files put back in the running container) or `restore` (container recreated).
    pub mode: String,
    pub changed_paths: Option<usize>,
    pub elapsed_ms: f64,
}

/// What an explicit turn mark ended.
#[derive(Debug, Serialize)]
pub struct MarkReport {
    pub container: String,
    /// The turn the mark ended (None when the sandbox had no turn open).
    pub ended: Option<TurnRecord>,
    /// From the request until the ended turn was checkpointed.
    pub elapsed_ms: f64,
}

/// What a sandbox is recreated from: everything containerd (or, once containerd forgot it,
/// the shim's saved copy) keeps of how it was created.
struct SandboxInfo {
    image: String,
    /// Its OCI spec as its client made it: process (args, env, cwd, user, capabilities),
    /// mounts, resources, namespaces and annotations.
    spec: serde_json::Value,
    /// Its runtime options (crab's `ConfigPath`), as containerd holds them (type URL, bytes), so
    /// the restored shim reads the same config and store.
    runtime_options: Option<(String, Vec<u8>)>,
    labels: std::collections::HashMap<String, String>,
    snapshotter: String,
    /// The pod it is a container of, by the annotations CRI sets on every pod container.
    pod: Option<crab_store::PodOwner>,
}

impl Ctl {
    pub fn open(state_dir: &Path, ctr: Ctr) -> Result<Self> {
        let containerd = crab_containerd::grpc::Containerd::new(ctr.socket(), ctr.namespace());
        Ok(Self { state_dir: state_dir.into(), store: Arc::new(CheckpointStore::open(state_dir)?), ctr, containerd })
    }

    /// This Ctl for another namespace of the same containerd and store.
    pub fn in_namespace(&self, namespace: &str) -> Self {
        let ctr = Ctr::new(self.ctr.socket(), namespace.to_owned());
        let containerd = crab_containerd::grpc::Containerd::new(ctr.socket(), ctr.namespace());
        Self { state_dir: self.state_dir.clone(), store: Arc::clone(&self.store), ctr, containerd }
    }

    /// The store key of `container` (an id, or `<id>@<n>`) in this Ctl's namespace.
    pub fn key(&self, container: &str) -> Result<String> {
        if container.contains('/') {
            return Err(CtlError::Invalid(format!(
                "{container:?}: name the sandbox by its container id and its namespace with --namespace (or CRAB_NS)"
            )));
        }
        Ok(SandboxKey::from_name(self.ctr.namespace(), container)?.to_string())
    }

    /// What the containerd of this Ctl's socket has: its namespaces with their container ids,
    /// for GC to drop the chains of removed containers (`ctr namespaces ls`, `ctr containers ls`,
    /// each bounded by the admin timeout).
    pub async fn container_census(&self, keep_removed: std::time::Duration) -> Result<crab_store::ContainerCensus> {
        let now = std::time::SystemTime::now();
        let socket = self.ctr.socket();
        let asked = |e: crab_containerd::grpc::GrpcError| CtlError::Containerd(e.to_string());
        let namespaces = crab_containerd::grpc::Containerd::new(socket, "default").namespaces().await.map_err(asked)?;
        let mut census = std::collections::BTreeMap::new();
        for namespace in namespaces {
            let containers =
                crab_containerd::grpc::Containerd::new(socket, namespace.as_str()).containers().await.map_err(asked)?;
            census.insert(namespace, containers.into_iter().map(|(id, _runtime)| id).collect());
        }
        Ok(crab_store::ContainerCensus { namespaces: census, keep_removed, now })
    }

    /// The checkpoint `container`'s chain starts from (a fork, a kubelet replacement), if any.
    pub fn origin(&self, container: &str) -> Result<Option<crab_store::Origin>> {
        Ok(self.store.origin(&self.key(container)?)?)
    }

    pub fn turns(&self, container: &str) -> Result<Vec<TurnRecord>> {
        Ok(TurnLog::open(&self.state_dir, &self.key(container)?)?.read()?)
    }

    /// Ends the sandbox's current turn and begins the next: a Task Update
    /// through containerd carrying `io.crab.turn=mark`. Returns once the
    /// ended turn is checkpointed.
    pub async fn mark_turn(&self, container: &str) -> Result<MarkReport> {
        let log = TurnLog::open(&self.state_dir, &self.key(container)?)?;
        let last_before = log.read()?.last().map(|r| r.turn).unwrap_or(0);
        let started = Instant::now();
        self.containerd
            .turn_request(container, crab_store::turns::TurnRequest::Mark)
            .await
            .map_err(|e| CtlError::Containerd(e.to_string()))?;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        let ended =
            log.read()?.into_iter().rfind(|r| r.turn > last_before && r.source == crab_store::turns::TurnSource::Mark);
        Ok(MarkReport { container: container.into(), ended, elapsed_ms })
    }

    /// The chain's checkpoints and the turns whose checkpoint a newer one superseded, newest first.
    pub fn checkpoints(&self, container: &str) -> Result<Vec<CheckpointRow>> {
        let mut rows: Vec<CheckpointRow> = self
            .store
            .history(&self.key(container)?)?
            .into_iter()
            .map(|c| CheckpointRow {
                turn: c.turn,
                class: format!("{:?}", c.class).to_lowercase(),
                id: c.id.to_hex(),
                created_unix_ms: c.created_unix_ms,
                fs_entries: c.fs_entries,
                has_images: c.has_images,
                superseded_by: None,
            })
            .collect();
        rows.extend(self.turns(container)?.into_iter().filter_map(|r| {
            Some(CheckpointRow {
                superseded_by: Some(r.superseded_by?),
                turn: r.turn,
                class: "superseded".into(),
                id: String::new(),
                created_unix_ms: r.ended_unix_ms,
                fs_entries: 0,
                has_images: false,
            })
        }));
        rows.sort_by_key(|row| std::cmp::Reverse(row.turn));
        Ok(rows)
    }

    /// Verifies every blob of each container's chain (all chains of the namespace, retired
    /// ones too, when none is named).
    pub fn verify(&self, container: Option<&str>) -> Result<Vec<VerifyRow>> {
        let names = match container {
            Some(c) => vec![(c.to_string(), self.key(c)?)],
            None => self
                .store
                .namespace_keys(self.ctr.namespace())?
                .into_iter()
                .map(|k| (k.name(), k.to_string()))
                .collect(),
        };
        Ok(names
            .into_iter()
            .map(|(name, key)| {
                let head = self.store.head(&key);
                let result = head.as_ref().map_err(|e| e.to_string()).and_then(|h| match h {
                    Some(h) => self.store.verify(&key, h.turn).map(|r| (Some(h.turn), r)).map_err(|e| e.to_string()),
                    None => Err(format!("container {name:?} has no checkpoints")),
                });
                match result {
                    Ok((head_turn, r)) => VerifyRow {
                        container: name,
                        head_turn,
                        ok: true,
                        manifests: r.manifests,
                        blobs: r.blobs,
                        bytes: r.bytes,
                        error: None,
                    },
                    Err(e) => VerifyRow {
                        container: name,
                        head_turn: None,
                        ok: false,
                        manifests: 0,
                        blobs: 0,
                        bytes: 0,
                        error: Some(e),
                    },
                }
            })
            .collect())
    }

    /// The newest checkpoint at or before `turn` (clean turns have none of their own).
    fn checkpoint_at_or_before(&self, container: &str, turn: u64) -> Result<Option<u64>> {
        if turn == 0 {
            return Ok(None);
        }
        let history = self.store.history(&self.key(container)?)?;
        let newest = history.iter().map(|c| c.turn).filter(|t| *t <= turn).max();
        let turns = self.turns(container)?;
        if let Some(by) = turns.iter().find(|r| r.turn == turn).and_then(|r| r.superseded_by) {
            let before = newest.map_or("0 (the image)".to_string(), |t| t.to_string());
            return Err(CtlError::Invalid(format!(
                "turn {turn} of {container:?} cannot be restored: its checkpoint was superseded by turn {by}'s \
                 while it waited for write bandwidth, so no checkpoint holds turn {turn} itself; \
                 use turn {by} or turn {before} or earlier"
            )));
        }
        if !turns.is_empty() && !turns.iter().any(|r| r.turn == turn) && newest != Some(turn) {
            return Err(CtlError::Invalid(format!("container {container:?} has no turn {turn}")));
        }
        Ok(newest)
    }

    async fn sandbox_info(&self, container: &str, image_override: Option<&str>) -> Result<SandboxInfo> {
        let from_containerd =
            self.containerd.container(container).await.map_err(|e| CtlError::Containerd(e.to_string()))?;
        let info = match from_containerd {
            Some(record) => {
                let bytes = record
                    .spec
                    .ok_or_else(|| CtlError::Containerd(format!("containerd keeps no spec for {container:?}")))?;
                let spec = serde_json::from_slice(&bytes)
                    .map_err(|e| CtlError::Containerd(format!("the spec of {container}: {e}")))?;
                SandboxInfo {
                    image: image_override.map(str::to_string).unwrap_or(record.image),
                    spec,
                    runtime_options: record.runtime_options,
                    labels: record.labels,
                    snapshotter: if record.snapshotter.is_empty() {
                        crab_containerd::grpc::DEFAULT_SNAPSHOTTER.into()
                    } else {
                        record.snapshotter
                    },
                    pod: None,
                }
            }
            None => {
                // Node loss: containerd forgot the sandbox. The shim kept its spec.
                let image = image_override.ok_or_else(|| {
                    CtlError::Invalid(format!("containerd does not know {container:?}: name its image with --image"))
                })?;
                let path = crab_store::saved_spec_path_of(&self.state_dir, &self.key(container)?)?;
                let bytes = std::fs::read(&path).map_err(|e| {
                    CtlError::Invalid(format!("no saved spec for {container:?} at {}: {e}", path.display()))
                })?;
                let spec = serde_json::from_slice(&bytes)
                    .map_err(|e| CtlError::Invalid(format!("saved spec {}: {e}", path.display())))?;
                // containerd's record of the runtime options is gone with it; the config
                // crabctl itself was pointed at is the best guess.
                let config_path = std::env::var(crab_config::CONFIG_ENV).ok().filter(|p| !p.is_empty());
                SandboxInfo {
                    image: image.to_string(),
                    spec,
                    runtime_options: config_path
                        .map(|p| crab_config::runtime_options::runtime_options_with_config_path(&p)),
                    labels: Default::default(),
                    snapshotter: crab_containerd::grpc::DEFAULT_SNAPSHOTTER.into(),
                    pod: None,
                }
            }
        };
        let annotations: std::collections::HashMap<String, String> =
            info.spec.get("annotations").and_then(|a| serde_json::from_value(a.clone()).ok()).unwrap_or_default();
        Ok(SandboxInfo { pod: pod_of_annotations(&annotations), ..info })
    }

    /// Refuses `what` (a command that recreates `container` through containerd) for a container
    /// of a Kubernetes pod: the shim's record of its pod (made for a container the kernel placed
    /// in it), else CRI's annotations in its spec.
    fn refuse_pod_container(
        &self,
        what: &'static str,
        container: &str,
        info: &SandboxInfo,
        advice: &'static str,
    ) -> Result<()> {
        let pod = match self.store.owner(&self.key(container)?)? {
            Some(owner) => Some(owner),
            None => info.pod.clone(),
        };
        match pod {
            Some(pod) => Err(CtlError::OutsidePod { what, container: container.into(), pod: Box::new(pod), advice }),
            None => Ok(()),
        }
    }

    /// Removes the container from containerd, whatever state it is in. Each call is bounded,
    /// and so is the wait for the killed task to stop.
    async fn remove_from_containerd(&self, container: &str) {
        let containerd = &self.containerd;
        let _ = containerd.kill_all(container).await;
        for _ in 0..50 {
            if containerd.delete_task(container).await.is_ok() {
                break;
            }
            match containerd.task(container).await {
                Ok(None) => break,
                _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
        let _ = containerd.delete_container(container).await;
    }

    /// Creates `new` on the crab runtime from `source`'s state at `turn`, with `source`'s whole
    /// spec, runtime options and labels, through containerd's API.
    async fn run_restored(&self, info: &SandboxInfo, source: &str, turn: u64, new: &str) -> Result<()> {
        let spec = restored_spec(&info.spec, source, turn, new)?;
        let container = crab_containerd::grpc::NewContainer {
            id: new.into(),
            image: info.image.clone(),
            runtime: CRAB_RUNTIME.into(),
            runtime_options: info.runtime_options.clone(),
            spec: serde_json::to_vec(&spec).map_err(|e| CtlError::Invalid(format!("the spec of {new}: {e}")))?,
            labels: info.labels.clone(),
            snapshotter: info.snapshotter.clone(),
        };
        self.containerd.run_detached(&container).await.map_err(|e| CtlError::Containerd(e.to_string()))?;
        Ok(())
    }

    /// Waits until no turn of `container` is in flight: its last checkpoint
    /// is written, so the chain says everything the sandbox did.
    async fn settle(&self, container: &str) -> Result<()> {
        let log = TurnLog::open(&self.state_dir, &self.key(container)?)?;
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        while log.is_busy() {
            if Instant::now() > deadline {
                return Err(CtlError::Invalid(format!(
                    "container {container:?} still has a turn in flight after {SETTLE_TIMEOUT:?} (a command still running?)"
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Starts `new` from `source` as it was at `turn`; `source` keeps running.
    pub async fn fork(&self, source: &str, turn: u64, new: &str) -> Result<RestoreReport> {
        self.fork_with_image(source, turn, new, None).await
    }

    /// [`fork`](Self::fork), from `image` when containerd does not know `source` (its chain
    /// came from another node).
    pub async fn fork_with_image(
        &self,
        source: &str,
        turn: u64,
        new: &str,
        image: Option<&str>,
    ) -> Result<RestoreReport> {
        let clock = Instant::now();
        self.settle(source).await?;
        let checkpoint = self.checkpoint_at_or_before(source, turn)?;
        let info = self.sandbox_info(source, image).await?;
        self.refuse_pod_container("fork", source, &info, FORK_IN_POD)?;
        self.run_restored(&info, source, checkpoint.unwrap_or(0), new).await?;
        Ok(RestoreReport {
            container: new.into(),
            from: source.into(),
            turn,
            checkpoint_turn: checkpoint,
            mode: "restore".into(),
            changed_paths: None,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Brings a sandbox back from its latest checkpoint after a crash (its
    /// processes, its shim, containerd, or the node's containerd state lost).
    pub async fn recover(&self, container: &str, image: Option<&str>) -> Result<RestoreReport> {
        let clock = Instant::now();
        let head = self.store.head(&self.key(container)?)?;
        let last_turn = self.turns(container)?.last().map(|r| r.turn).max(head.map(|h| h.turn)).unwrap_or(0);
        let info = self.sandbox_info(container, image).await?;
        self.refuse_pod_container("recover", container, &info, RESTART_IN_POD)?;
        self.remove_from_containerd(container).await;
        self.run_restored(&info, container, head.map(|h| h.turn).unwrap_or(0), container).await?;
        Ok(RestoreReport {
            container: container.into(),
            from: container.into(),
            turn: last_turn,
            checkpoint_turn: head.map(|h| h.turn),
            mode: "restore".into(),
            changed_paths: None,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Puts `container` back to `turn`. When every later turn changed only
    /// files, exactly those paths are put back in the running container;
    /// otherwise the container is recreated from the checkpoint.
    pub async fn rollback(&self, container: &str, turn: u64) -> Result<RestoreReport> {
        let clock = Instant::now();
        self.settle(container).await?;
        let turns = self.turns(container)?;
        let checkpoint = self.checkpoint_at_or_before(container, turn)?;
        let later_proc = turns.iter().any(|r| r.turn > turn && r.class == RecordedClass::Proc);
        if !later_proc && let Some(pid) = self.task_pid(container).await? {
            let root = PathBuf::from(format!("/proc/{pid}/root"));
            let base = overlay_lowerdir(pid);
            let to_turn = checkpoint.unwrap_or(0);
            // The sandbox's tmpfs mounts started empty, whatever the image holds below them.
            let spec = crab_store::saved_spec_path_of(&self.state_dir, &self.key(container)?)?;
            let tmpfs = match crab_store::SandboxMounts::from_spec_file(&spec) {
                Ok(mounts) => mounts.tmpfs(),
                Err(e) => {
                    tracing::warn!(container, error = %e, "the sandbox's mounts are unknown: paths on its tmpfs mounts are put back from the image's");
                    Vec::new()
                }
            };
            let store = self.store.clone();
            let c = self.key(container)?;
            // The store blocks on file I/O: off the runtime's worker, which other tasks may need.
            let report = tokio::task::block_in_place(move || {
                store.rollback_in_place_with(
                    &RollbackRequest { container: &c, to_turn, root: &root, base: base.as_deref(), uncommitted: &[] },
                    &tmpfs,
                )
            })?;
            return Ok(RestoreReport {
                container: container.into(),
                from: container.into(),
                turn,
                checkpoint_turn: checkpoint,
                mode: "in-place".into(),
                changed_paths: Some(report.changed_paths),
                elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
            });
        }
        let info = self.sandbox_info(container, None).await?;
        // In place (files only, the task running) acts on the pod's own container; this does not.
        self.refuse_pod_container("rollback by restore", container, &info, RESTART_IN_POD)?;
        if let Some(t) = checkpoint {
            self.store.rewind(&self.key(container)?, t)?;
        }
        self.remove_from_containerd(container).await;
        self.run_restored(&info, container, checkpoint.unwrap_or(0), container).await?;
        Ok(RestoreReport {
            container: container.into(),
            from: container.into(),
            turn,
            checkpoint_turn: checkpoint,
            mode: "restore".into(),
            changed_paths: None,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// The host pid of `container`'s init while its processes exist (running or paused).
    async fn task_pid(&self, container: &str) -> Result<Option<u32>> {
        let task = self.containerd.task(container).await.map_err(|e| CtlError::Containerd(e.to_string()))?;
        Ok(task.filter(|t| t.is_alive()).map(|t| t.pid))
    }
}

/// The spec of `new`, restored from `source` at `turn` (0: its image, nothing to restore): the
/// kept spec, with `io.crab.restore-from` naming the checkpoint, its cgroup named after `new`
/// where the source's named `source`, and no terminal (a detached restore has no client to
/// hold one; the old `ctr run -d` gave none either).
fn restored_spec(spec: &serde_json::Value, source: &str, turn: u64, new: &str) -> Result<serde_json::Value> {
    let mut spec = spec.clone();
    let object =
        spec.as_object_mut().ok_or_else(|| CtlError::Invalid(format!("the spec of {source} is not an object")))?;
    let annotations = object.entry("annotations").or_insert_with(|| serde_json::json!({}));
    let annotations = annotations
        .as_object_mut()
        .ok_or_else(|| CtlError::Invalid(format!("the annotations of {source}'s spec are not an object")))?;
    annotations.remove(ANNOTATION_RESTORE_FROM);
    // The source's shim named crab's CRIU config of the source's bundle in the spec it saved;
    // the new container's shim names its own. Left in, it would name a file of another bundle
    // (or of another node), and the shim would take it for the user's own config and restore
    // without its action script: a loopback TCP connection could not come back.
    let crabs = crab_runtime::criu::CONFIG_ANNOTATION;
    if annotations.get(crabs).and_then(|v| v.as_str()).is_some_and(|p| crab_runtime::criu::is_crab_config_of(p, source))
    {
        annotations.remove(crabs);
    }
    if turn > 0 {
        annotations.insert(ANNOTATION_RESTORE_FROM.into(), format!("{source}:{turn}").into());
    }
    if let Some(terminal) = spec.pointer_mut("/process/terminal") {
        *terminal = false.into();
    }
    if new != source
        && let Some(path) = spec.pointer_mut("/linux/cgroupsPath")
        && let Some(old) = path.as_str().filter(|p| !p.is_empty())
    {
        *path = renamed_cgroup(old, source, new)
            .ok_or_else(|| {
                CtlError::Invalid(format!(
                    "cannot place {new}'s cgroup: {source}'s cgroupsPath {old:?} does not end in its id, and two \
                     containers must not share one"
                ))
            })?
            .into();
    }
    Ok(spec)
}

/// `path` with its last element, `source`, replaced by `new`: `/ns/source` (cgroupfs) or
/// `slice:prefix:source` (systemd).
fn renamed_cgroup(path: &str, source: &str, new: &str) -> Option<String> {
    if let Some(parent) = path.strip_suffix(source).filter(|p| p.ends_with('/')) {
        return Some(format!("{parent}{new}"));
    }
    let (head, name) = path.rsplit_once(':')?;
    (name == source && !path.starts_with('/')).then(|| format!("{head}:{new}"))
}

/// The pod a container's spec says it belongs to: CRI sets these annotations on every container
/// of a pod (a pod's sandbox container included).
fn pod_of_annotations(annotations: &std::collections::HashMap<String, String>) -> Option<crab_store::PodOwner> {
    let get = |key: &str| annotations.get(key).filter(|v| !v.is_empty()).cloned();
    let pod_sandbox = get("io.kubernetes.cri.sandbox-id")?;
    Some(crab_store::PodOwner {
        kube_namespace: get("io.kubernetes.cri.sandbox-namespace").unwrap_or_default(),
        container_name: get("io.kubernetes.cri.container-name").unwrap_or_else(|| "(the pod sandbox)".into()),
        pod_sandbox,
    })
}

/// The image layer a container's overlay root starts from: the base of an
/// in-place rollback for paths no checkpoint recorded. Only a single lower
/// layer can serve as a plain directory.
fn overlay_lowerdir(pid: u32) -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok()?;
    let root = mountinfo.lines().find(|l| l.split_whitespace().nth(4) == Some("/"))?;
    let opts = root.rsplit(" - ").next()?;
    let lower = opts.split(',').find_map(|o| o.strip_prefix("lowerdir="))?;
    (!lower.contains(':')).then(|| PathBuf::from(lower))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_spec_keeps_the_source_s_and_names_the_checkpoint_and_its_own_cgroup() {
        let source = serde_json::json!({
            "process": {"terminal": true, "user": {"uid": 65534, "gid": 65534}, "args": ["sleep", "1"],
                        "capabilities": {"bounding": ["CAP_KILL"]}},
            "mounts": [{"destination": "/data", "type": "bind", "source": "/srv/data", "options": ["rbind", "ro"]}],
            "annotations": {"io.crab.policy": "crab", "io.crab.restore-from": "old:3"},
            "linux": {"cgroupsPath": "/crab/src", "resources": {"memory": {"limit": 268435456}}}
        });
        let spec = restored_spec(&source, "src", 4, "src-f1").unwrap();
        assert_eq!(spec["annotations"]["io.crab.restore-from"], "src:4");
        assert_eq!(spec["annotations"]["io.crab.policy"], "crab");
        assert_eq!(spec["linux"]["cgroupsPath"], "/crab/src-f1");
        assert_eq!(spec["process"]["terminal"], false);
        for kept in ["/process/user", "/process/args", "/process/capabilities", "/mounts", "/linux/resources"] {
            assert_eq!(spec.pointer(kept), source.pointer(kept), "{kept}");
        }
        // Recover: the same id keeps its cgroup; turn 0 restores nothing.
        let spec = restored_spec(&source, "src", 0, "src").unwrap();
        assert_eq!(spec["linux"]["cgroupsPath"], "/crab/src");
        assert!(spec["annotations"].get("io.crab.restore-from").is_none(), "{spec}");
        // A cgroup the id cannot be found in is refused for a fork, naming it.
        let custom = serde_json::json!({"linux": {"cgroupsPath": "/tenants/a"}});
        let err = restored_spec(&custom, "src", 1, "f").unwrap_err().to_string();
        assert!(err.contains("\"/tenants/a\"") && err.contains("f's cgroup"), "{err}");
        assert_eq!(renamed_cgroup("system.slice:crab:src", "src", "f").as_deref(), Some("system.slice:crab:f"));
        assert_eq!(renamed_cgroup("/a/xsrc", "src", "f"), None);
    }

    #[test]
    fn a_restored_spec_drops_crab_s_criu_config_of_the_source_s_bundle_and_keeps_the_user_s() {
        let saved = serde_json::json!({"annotations": {
            "org.criu.config": "/run/containerd/io.containerd.runtime.v2.task/ns/src/crab/criu.conf"}});
        for (id, turn) in [("src", 2), ("src-f1", 2)] {
            let spec = restored_spec(&saved, "src", turn, id).unwrap();
            assert!(spec["annotations"].get("org.criu.config").is_none(), "{id}: {spec}");
        }
        let users = serde_json::json!({"annotations": {"org.criu.config": "/etc/criu/src.conf"}});
        let spec = restored_spec(&users, "src", 2, "src").unwrap();
        assert_eq!(spec["annotations"]["org.criu.config"], "/etc/criu/src.conf");
    }
}
