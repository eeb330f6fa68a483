//! What `crabctl` does with checkpoints: list turns and checkpoints, verify,
//! collect garbage, and bring sandboxes back (recover, rollback, fork).
//!
//! Restores go through containerd: a restored or forked sandbox is a normal
//! container on the crab runtime, created with the `io.crab.restore-from`
//! annotation; its shim writes the rootfs as at the turn and restores the
//! processes from the newest process checkpoint at or before it.

pub mod cli;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::checkpoint::{CheckpointStore, RollbackRequest};
use crate::containerd::ctr::Ctr;
use crate::turns::{ANNOTATION_RESTORE_FROM, RecordedClass, TurnLog, TurnRecord};

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error(transparent)]
    Store(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Log(#[from] crate::turns::TurnLogError),
    #[error("containerd: {0}")]
    Containerd(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CtlError>;

pub const CRAB_RUNTIME: &str = "io.containerd.crab.v2";

/// How long rollback and fork wait for a turn in flight to be checkpointed.
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The state directory and the containerd a command works against.
pub struct Ctl {
    pub state_dir: PathBuf,
    pub store: Arc<CheckpointStore>,
    pub ctr: Ctr,
}

#[derive(Debug, Serialize)]
pub struct CheckpointRow {
    pub turn: u64,
    pub class: String,
    pub id: String,
    pub created_unix_ms: u64,
    pub fs_entries: usize,
    pub has_images: bool,
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

/// How a container was run, to run it again.
#[derive(Debug, Clone)]
struct SandboxInfo {
    /// The sandbox's own `io.crab.*` annotations (policy, turns, ignore), carried over.
    annotations: Vec<(String, String)>,
    image: String,
    args: Vec<String>,
    cwd: Option<String>,
    env: Vec<String>,
}

impl Ctl {
    pub fn open(state_dir: &Path, ctr: Ctr) -> Result<Self> {
        Ok(Self { state_dir: state_dir.into(), store: Arc::new(CheckpointStore::open(state_dir)?), ctr })
    }

    pub fn turns(&self, container: &str) -> Result<Vec<TurnRecord>> {
        Ok(TurnLog::open(&self.state_dir, container)?.read()?)
    }

    /// Ends the sandbox's current turn and begins the next: a Task Update
    /// through containerd carrying `io.crab.turn=mark`. Returns once the
    /// ended turn is checkpointed.
    pub async fn mark_turn(&self, container: &str) -> Result<MarkReport> {
        let log = TurnLog::open(&self.state_dir, container)?;
        let last_before = log.read()?.last().map(|r| r.turn).unwrap_or(0);
        let started = Instant::now();
        crate::containerd::grpc::Containerd::new(self.ctr.socket(), self.ctr.namespace())
            .turn_request(container, crate::turns::TurnRequest::Mark)
            .await
            .map_err(|e| CtlError::Containerd(e.to_string()))?;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        let ended = log
            .read()?
            .into_iter()
            .filter(|r| r.turn > last_before && r.source == crate::turns::TurnSource::Mark)
            .last();
        Ok(MarkReport { container: container.into(), ended, elapsed_ms })
    }

    pub fn checkpoints(&self, container: &str) -> Result<Vec<CheckpointRow>> {
        Ok(self
            .store
            .history(container)?
            .into_iter()
            .map(|c| CheckpointRow {
                turn: c.turn,
                class: format!("{:?}", c.class).to_lowercase(),
                id: c.id.to_hex(),
                created_unix_ms: c.created_unix_ms,
                fs_entries: c.fs_entries,
                has_images: c.has_images,
            })
            .collect())
    }

    /// Verifies every blob of each container's chain (all containers when none is named).
    pub fn verify(&self, container: Option<&str>) -> Result<Vec<VerifyRow>> {
        let names = match container {
            Some(c) => vec![c.to_string()],
            None => self.store.containers()?,
        };
        Ok(names
            .into_iter()
            .map(|name| {
                let head = self.store.head(&name);
                let result = head.as_ref().map_err(|e| e.to_string()).and_then(|h| match h {
                    Some(h) => self.store.verify(&name, h.turn).map(|r| (Some(h.turn), r)).map_err(|e| e.to_string()),
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
        let history = self.store.history(container)?;
        let newest = history.iter().map(|c| c.turn).filter(|t| *t <= turn).max();
        let turns = self.turns(container)?;
        if !turns.is_empty() && !turns.iter().any(|r| r.turn == turn) && newest != Some(turn) {
            return Err(CtlError::Invalid(format!("container {container:?} has no turn {turn}")));
        }
        Ok(newest)
    }

    async fn sandbox_info(&self, container: &str, image_override: Option<&str>) -> Result<SandboxInfo> {
        #[derive(serde::Deserialize)]
        struct Process {
            #[serde(default)]
            args: Vec<String>,
            cwd: Option<String>,
            #[serde(default)]
            env: Vec<String>,
        }
        #[derive(serde::Deserialize)]
        struct Spec {
            process: Option<Process>,
            #[serde(default)]
            annotations: std::collections::HashMap<String, String>,
        }
        #[derive(serde::Deserialize)]
        struct Info {
            #[serde(rename = "Image")]
            image: String,
            #[serde(rename = "Spec")]
            spec: Option<Spec>,
        }
        let from_containerd = self.ctr.run(&["containers", "info", container]).await;
        let (image, spec) = match from_containerd {
            Ok(out) => {
                let info: Info = serde_json::from_str(&out.stdout_text())
                    .map_err(|e| CtlError::Containerd(format!("container info of {container}: {e}")))?;
                (image_override.map(str::to_string).unwrap_or(info.image), info.spec)
            }
            Err(_) => {
                // Node loss: containerd forgot the sandbox. The shim kept its spec.
                let image = image_override.ok_or_else(|| {
                    CtlError::Invalid(format!("containerd does not know {container:?}: name its image with --image"))
                })?;
                let path = crate::engine::sandbox_spec_path(&self.state_dir, container);
                let bytes = std::fs::read(&path)
                    .map_err(|e| CtlError::Invalid(format!("no saved spec for {container:?} at {}: {e}", path.display())))?;
                let spec: Spec = serde_json::from_slice(&bytes)
                    .map_err(|e| CtlError::Invalid(format!("saved spec {}: {e}", path.display())))?;
                (image.to_string(), Some(spec))
            }
        };
        let annotations = spec
            .as_ref()
            .map(|s| {
                let mut a: Vec<_> = s
                    .annotations
                    .iter()
                    .filter(|(k, _)| k.starts_with("io.crab.") && k.as_str() != ANNOTATION_RESTORE_FROM)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                a.sort();
                a
            })
            .unwrap_or_default();
        let process = spec.and_then(|s| s.process);
        Ok(SandboxInfo {
            annotations,
            image,
            args: process.as_ref().map(|p| p.args.clone()).unwrap_or_default(),
            cwd: process.as_ref().and_then(|p| p.cwd.clone()),
            env: process.map(|p| p.env).unwrap_or_default(),
        })
    }

    /// Removes the container from containerd, whatever state it is in.
    async fn remove_from_containerd(&self, container: &str) {
        let _ = self.ctr.run(&["tasks", "kill", "--signal", "SIGKILL", container]).await;
        for _ in 0..50 {
            if self.ctr.run(&["tasks", "delete", "--force", container]).await.is_ok() {
                break;
            }
            match self.ctr.run(&["tasks", "ls", "-q"]).await {
                Ok(out) if !out.stdout_text().lines().any(|l| l.trim() == container) => break,
                _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
        let _ = self.ctr.run(&["containers", "delete", container]).await;
    }

    /// Creates `new` on the crab runtime from `source`'s state at `turn`.
    async fn run_restored(&self, info: &SandboxInfo, source: &str, turn: u64, new: &str) -> Result<()> {
        let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--runtime".into(), CRAB_RUNTIME.into()];
        if turn > 0 {
            args.push("--annotation".into());
            args.push(format!("{ANNOTATION_RESTORE_FROM}={source}:{turn}"));
        }
        for (k, v) in &info.annotations {
            args.push("--annotation".into());
            args.push(format!("{k}={v}"));
        }
        if let Some(cwd) = &info.cwd {
            args.push("--cwd".into());
            args.push(cwd.clone());
        }
        for e in &info.env {
            args.push("--env".into());
            args.push(e.clone());
        }
        args.push(info.image.clone());
        args.push(new.into());
        args.extend(info.args.iter().cloned());
        self.ctr.run(&args).await.map_err(|e| CtlError::Containerd(e.to_string()))?;
        Ok(())
    }

    /// Waits until no turn of `container` is in flight: its last checkpoint
    /// is written, so the chain says everything the sandbox did.
    async fn settle(&self, container: &str) -> Result<()> {
        let log = TurnLog::open(&self.state_dir, container)?;
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
        let clock = Instant::now();
        self.settle(source).await?;
        let checkpoint = self.checkpoint_at_or_before(source, turn)?;
        let info = self.sandbox_info(source, None).await?;
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
        let head = self.store.head(container)?;
        let last_turn = self.turns(container)?.last().map(|r| r.turn).max(head.map(|h| h.turn)).unwrap_or(0);
        let info = self.sandbox_info(container, image).await?;
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
            let store = self.store.clone();
            let c = container.to_string();
            let report = store
                .run_blocking(move |store| {
                    store.rollback_in_place(&RollbackRequest {
                        container: &c,
                        to_turn,
                        root: &root,
                        base: base.as_deref(),
                        uncommitted: &[],
                    })
                })
                .await?;
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
        if let Some(t) = checkpoint {
            self.store.rewind(container, t)?;
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

    async fn task_pid(&self, container: &str) -> Result<Option<u32>> {
        let out = self.ctr.run(&["tasks", "ls"]).await.map_err(|e| CtlError::Containerd(e.to_string()))?;
        Ok(out.stdout_text().lines().skip(1).find_map(|l| {
            let mut cols = l.split_whitespace();
            (cols.next()? == container).then(|| cols.next()?.parse().ok()).flatten()
        }))
    }
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
