//! The remote tier from the command line: `crabctl push` sends a sandbox's chain to the
//! registry of `[remote]` in crab.toml; `crabctl recover --from` and `crabctl fork --from`
//! bring one back on another node (only the objects its store lacks, every digest verified),
//! then restore through containerd as a local recover or fork does.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crab_remote::chain::{self, ChainSandbox, PushLog};
use crab_remote::remote::PullBreakdown;
use crab_remote::{Credentials, Remote, RemoteIndex};
use serde::Serialize;

use crab_store::turns::TurnLog;

use crate::{Ctl, CtlError, RestoreReport, Result};

/// `<state_dir>/remote`: what this node knows of the registry (pack indexes, blob records)
/// and, per sandbox, which turns it holds.
pub fn remote_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("remote")
}

fn push_logs_dir(state_dir: &Path) -> PathBuf {
    remote_dir(state_dir).join("pushed")
}

/// What this node pulled of a sandbox from the registry: `<state_dir>/remote/pulled/<namespace>/<sandbox>.json`
/// (keyed as the push logs are), written once a pull moved the chain's head.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct PulledRecord {
    /// The reference pulled (`<registry>/<repository>:turn-N`).
    pub reference: String,
    /// The turn the chain's head is at after the pull.
    pub turn: u64,
    /// The image the artifact names: what a fork or recover of the chain runs when neither
    /// `--image` nor containerd names one.
    pub image: Option<String>,
}

fn pulled_path(state_dir: &Path, namespace: &str, sandbox: &str) -> PathBuf {
    PushLog::path_in(&remote_dir(state_dir).join("pulled"), namespace, sandbox)
}

/// How long a pull waits for another pull of the same sandbox on this node to finish.
const PULL_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Holds `<state_dir>/remote/pulling/<namespace>/<sandbox>.lock` (flock, exclusive) while a
/// pull of the sandbox checks what the store holds and pulls the rest: concurrent pulls of one
/// source on one node run one after the other, and the later ones find the first's chain.
/// Released when dropped (the lock goes with the descriptor, also when the process dies).
async fn lock_pull(state_dir: &Path, namespace: &str, sandbox: &str) -> Result<std::fs::File> {
    let path = PushLog::path_in(&remote_dir(state_dir).join("pulling"), namespace, sandbox).with_extension("lock");
    let io = |what: &str, e: std::io::Error| CtlError::Invalid(format!("{what} {}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("create the directory of", e))?;
    }
    let file =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(|e| io("open", e))?;
    let deadline = Instant::now() + PULL_LOCK_TIMEOUT;
    loop {
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(file),
            Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => tokio::time::sleep(POLL).await,
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(CtlError::Invalid(format!(
                    "another pull of {namespace}/{sandbox} on this node held {} for {} s: try again once it is done",
                    path.display(),
                    PULL_LOCK_TIMEOUT.as_secs()
                )));
            }
            Err(e) => return Err(io("lock", e.into())),
        }
    }
}

impl PulledRecord {
    /// The record of `sandbox`, when this node pulled it (an unreadable one counts as none).
    pub fn load(state_dir: &Path, namespace: &str, sandbox: &str) -> Option<Self> {
        let bytes = std::fs::read(pulled_path(state_dir, namespace, sandbox)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn save(&self, state_dir: &Path, namespace: &str, sandbox: &str) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).expect("a pulled record always serializes");
        crab_store::write_file_durably(&pulled_path(state_dir, namespace, sandbox), &bytes)?;
        Ok(())
    }
}

/// A connection to the registry of `[remote]`, under `prefix` (default: the configured one).
pub fn connect(prefix: Option<&str>) -> Result<Remote> {
    let config = crab_config::Config::load(None)?;
    let settings = &config.remote;
    let prefix = match prefix {
        Some(p) => p.to_owned(),
        None if settings.enabled() => settings.prefix.clone(),
        None => {
            return Err(CtlError::Invalid(
                "no registry is configured: set [remote] prefix in crab.toml ($CRAB_CONFIG)".into(),
            ));
        }
    };
    let mut cfg = crab_remote::RemoteConfig::new(prefix);
    cfg.plain_http = settings.plain_http;
    cfg.ca_file = (!settings.ca_file.as_os_str().is_empty()).then(|| settings.ca_file.clone());
    cfg.credentials = Credentials::DockerConfig(
        (!settings.credentials_file.as_os_str().is_empty()).then(|| settings.credentials_file.clone()),
    );
    Ok(Remote::new(cfg)?)
}

#[derive(Debug, Serialize)]
pub struct PushedRow {
    pub turn: u64,
    pub reference: String,
    pub new_objects: u64,
    pub bytes_uploaded: u64,
    pub blobs_uploaded: u64,
    pub blobs_mounted: u64,
    pub blobs_present: u64,
}

#[derive(Debug, Serialize)]
pub struct PushSummary {
    pub container: String,
    pub repository: String,
    pub head_turn: u64,
    pub pushed: Vec<PushedRow>,
    /// Turns the registry held already.
    pub already: Vec<u64>,
    /// Bytes sent (blobs and manifests) by this push.
    pub bytes_uploaded: u64,
    /// Bytes the sandbox's turns wrote to the local store (its turn log), for comparison.
    pub local_bytes_written: u64,
    pub elapsed_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct PullSummary {
    pub reference: String,
    pub manifests_pulled: u64,
    pub blobs_pulled: u64,
    pub bytes_pulled: u64,
    pub objects_received: u64,
    pub packs_skipped: u64,
    pub elapsed_ms: f64,
    /// Where `elapsed_ms` went: fetching (each blob hashed as it arrives, a pack's objects taken out
    /// and hashed in the fetch's task), the store's writes and flushes.
    pub breakdown: PullBreakdown,
}

#[derive(Debug, Serialize)]
pub struct RemoteRestoreReport {
    #[serde(flatten)]
    pub restore: RestoreReport,
    /// None when the local store held the chain already.
    pub pull: Option<PullSummary>,
    pub total_ms: f64,
}

impl Ctl {
    /// What of `container`'s chain this node pushed to the registry (an empty log when it never
    /// pushed): `<state_dir>/remote/pushed/<namespace>/<container>.json`, where the shim's
    /// queue and `crabctl push` record each turn the registry accepted.
    pub fn push_log(&self, container: &str) -> Result<PushLog> {
        Ok(PushLog::load(&push_logs_dir(&self.state_dir), self.ctr.namespace(), container)?)
    }

    /// The turns of `container` the registry holds (by the push log; empty when never pushed).
    pub fn pushed_turns(&self, container: &str) -> Result<Option<std::collections::BTreeSet<u64>>> {
        let path = PushLog::path_in(&push_logs_dir(&self.state_dir), self.ctr.namespace(), container);
        if !path.is_file() {
            return Ok(None);
        }
        Ok(Some(self.push_log(container)?.turns.keys().copied().collect()))
    }

    /// Pushes every checkpointed turn of `container` the registry lacks.
    pub async fn push(&self, container: &str) -> Result<PushSummary> {
        self.push_to(container, None).await
    }

    /// [`Ctl::push`] to the registry prefix `to` (default: the configured one).
    pub async fn push_to(&self, container: &str, to: Option<&str>) -> Result<PushSummary> {
        let clock = Instant::now();
        let remote = connect(to)?;
        let key = self.key(container)?;
        let image = self.sandbox_info(container, None).await.ok().map(|info| info.image);
        let spec_path = crab_store::saved_spec_path_of(&self.state_dir, &key)?;
        let spec = std::fs::read(&spec_path).ok();
        let sandbox = ChainSandbox {
            namespace: self.ctr.namespace().to_owned(),
            sandbox: container.to_owned(),
            key,
            image,
            spec,
        };
        let mut index = RemoteIndex::open(&remote_dir(&self.state_dir).join("index"))?;
        let mut log = self.push_log(container)?;
        let report = chain::push_chain(&remote, &mut index, self.store.clone(), &sandbox, &mut log, None).await?;
        // The shim's queued pushes of these turns are done now (a sandbox gone from this node
        // leaves its entries behind; a push from here clears them).
        let queue = crab_remote::PushQueue::open(&remote_dir(&self.state_dir).join("queue"))?;
        for entry in queue.pending()? {
            if entry.namespace == sandbox.namespace && entry.sandbox == container && entry.turn <= report.head_turn {
                queue.complete(&entry)?;
            }
        }
        let local_bytes_written = self.turns(container).map(|t| t.iter().map(|r| r.bytes_written).sum()).unwrap_or(0);
        Ok(PushSummary {
            container: container.to_owned(),
            repository: format!("{}/{}", remote.registry(), remote.repository(&sandbox.namespace, container)),
            head_turn: report.head_turn,
            bytes_uploaded: report.bytes_uploaded(),
            pushed: report
                .pushed
                .iter()
                .map(|(turn, r)| PushedRow {
                    turn: *turn,
                    reference: r.reference.clone(),
                    new_objects: r.new_objects,
                    bytes_uploaded: r.bytes_uploaded + r.manifest_bytes,
                    blobs_uploaded: r.blobs_uploaded,
                    blobs_mounted: r.blobs_mounted,
                    blobs_present: r.blobs_present,
                })
                .collect(),
            already: report.already,
            local_bytes_written,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Pulls `reference` (its turn, or the newest; `turn` must agree with the tag when both
    /// are given) into the local store as the chain of `container`. Returns the turn, the
    /// image the artifact names, and what the pull moved. When `container` already has a chain
    /// here, refused before anything is pulled, unless `extend`: a local chain that is a prefix
    /// of the registry's (every turn of it is the registry's, by manifest) is extended with
    /// the later turns (only what the store lacks is pulled); one that diverged is refused.
    async fn pull(
        &self,
        container: &str,
        reference: &str,
        turn: Option<u64>,
        extend: bool,
    ) -> Result<(u64, Option<String>, PullSummary)> {
        let clock = Instant::now();
        let (prefix, namespace, sandbox, tagged) = chain::parse_reference(reference)?;
        let turn = match (tagged, turn) {
            (Some(a), Some(b)) if a != b => {
                return Err(CtlError::Invalid(format!("{reference} is turn {a}, but --turn {b} was asked for")));
            }
            (Some(t), _) | (None, Some(t)) => Some(t),
            (None, None) => None,
        };
        let key = self.key(container)?;
        let over = self.store.head(&key)?;
        if let Some(head) = over
            && !extend
        {
            return Err(CtlError::Invalid(format!(
                "{container:?} already has a chain in {} (head turn {}): nothing is pulled over it; \
                 recover it without --from, or pull into another name",
                self.state_dir.display(),
                head.turn
            )));
        }
        let remote = connect(Some(&prefix))?;
        let listed = match (turn, over) {
            (Some(_), None) => Vec::new(),
            _ => remote.list_turns(&namespace, &sandbox).await?,
        };
        let turn = match turn {
            Some(t) => t,
            None => *listed
                .last()
                .ok_or_else(|| CtlError::Invalid(format!("{reference}: the repository holds no checkpointed turn")))?,
        };
        if let Some(head) = over {
            // Only a prefix of the registry's chain is extended: every local turn must be one the
            // registry has (the store checks each manifest against the pulled chain's links), and
            // the turn asked for must come after them.
            let local: Vec<u64> = self.store.history(&key)?.iter().map(|c| c.turn).collect();
            let foreign: Vec<u64> = local.iter().copied().filter(|t| !listed.contains(t)).collect();
            if !foreign.is_empty() || head.turn >= turn {
                let why = if foreign.is_empty() {
                    format!("it lacks turn {turn} but holds turns up to {}", head.turn)
                } else {
                    format!("the registry does not have its turns {foreign:?}")
                };
                return Err(CtlError::Invalid(format!(
                    "{container:?} already has a chain in {} (head turn {}) that has diverged from {reference}: \
                     {why}; nothing is pulled over it, pull into another name",
                    self.state_dir.display(),
                    head.turn
                )));
            }
        }
        let store = self.store.clone();
        let report = chain::pull_chain(&remote, &namespace, &sandbox, turn, &store, &key, over).await?;
        if let Some(spec) = &report.spec {
            let path = crab_store::saved_spec_path_of(&self.state_dir, &key)?;
            if !path.exists() {
                crab_store::write_file_durably(&path, spec)?;
            }
        }
        // The image beside the chain: a later fork or recover that pulls nothing still has it.
        let namespace = self.ctr.namespace();
        let kept = PulledRecord::load(&self.state_dir, namespace, container).and_then(|r| r.image);
        PulledRecord { reference: report.reference.clone(), turn, image: report.image.clone().or(kept) }.save(
            &self.state_dir,
            namespace,
            container,
        )?;
        Ok((
            turn,
            report.image.clone(),
            PullSummary {
                reference: report.reference,
                manifests_pulled: report.manifests_pulled,
                blobs_pulled: report.blobs_pulled,
                bytes_pulled: report.bytes_pulled,
                objects_received: report.objects_received,
                packs_skipped: report.packs_skipped,
                elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
                breakdown: report.times.breakdown(clock.elapsed()),
            },
        ))
    }

    /// The image the artifact named when `container`'s chain was pulled to this node.
    fn pulled_image(&self, container: &str) -> Option<String> {
        PulledRecord::load(&self.state_dir, self.ctr.namespace(), container).and_then(|r| r.image)
    }

    /// `recover --from`: the sandbox's chain from the registry, then a recover as after a node loss.
    pub async fn recover_from(
        &self,
        container: &str,
        reference: &str,
        image: Option<&str>,
    ) -> Result<RemoteRestoreReport> {
        let clock = Instant::now();
        let lock = lock_pull(&self.state_dir, self.ctr.namespace(), container).await?;
        let (_, pulled_image, pull) = self.pull(container, reference, None, false).await?;
        drop(lock);
        let image =
            image.map(str::to_owned).or(pulled_image).or_else(|| self.pulled_image(container)).ok_or_else(|| {
                CtlError::Invalid(format!("{reference} names no image: give the sandbox's image with --image"))
            })?;
        let restore = self.recover(container, Some(&image)).await?;
        Ok(RemoteRestoreReport { restore, pull: Some(pull), total_ms: clock.elapsed().as_secs_f64() * 1e3 })
    }

    /// `fork --from`: `source`'s chain from the registry (unless the local store holds turn
    /// `turn` of it already; a local chain that is a prefix of the registry's is extended up to
    /// `turn`), then a fork as today.
    pub async fn fork_from(
        &self,
        source: &str,
        turn: u64,
        new: &str,
        reference: &str,
        image: Option<&str>,
    ) -> Result<RemoteRestoreReport> {
        let clock = Instant::now();
        // The check and the pull under the sandbox's pull lock: a concurrent fork of the same
        // source waits, then finds the turn held.
        let lock = lock_pull(&self.state_dir, self.ctr.namespace(), source).await?;
        let held = self.store.history(&self.key(source)?).is_ok_and(|h| h.iter().any(|c| c.turn == turn));
        let (pull, pulled_image) = if held {
            (None, None)
        } else {
            let (_, image, pull) = self.pull(source, reference, Some(turn), true).await?;
            (Some(pull), image)
        };
        drop(lock);
        // The image: --image, else the pull's, else the one kept beside a chain pulled earlier
        // (containerd on this node need not know the source), else containerd's.
        let image = image.map(str::to_owned).or(pulled_image).or_else(|| self.pulled_image(source));
        let restore = self.fork_with_image(source, turn, new, image.as_deref()).await?;
        Ok(RemoteRestoreReport { restore, pull, total_ms: clock.elapsed().as_secs_f64() * 1e3 })
    }
}

/// What `crabctl migrate` did for one sandbox (and `crabctl drain` for each).
#[derive(Debug, Serialize)]
pub struct MigrateReport {
    pub container: String,
    pub namespace: String,
    /// The sandbox's newest turn on this node (0: none yet).
    pub newest_turn: u64,
    /// The turn the final mark ended (None: no turn was open, or the mark failed: see `notes`).
    pub final_mark: Option<u64>,
    /// The newest turn whose state is in the registry: its checkpoint, or a clean turn after
    /// it (nothing changed since). None: nothing of the sandbox is off the node.
    pub safe_turn: Option<u64>,
    /// `<registry>/<repository>:turn-N` of the newest checkpoint in the registry.
    pub reference: Option<String>,
    /// The command that restores the sandbox on another node.
    pub restore_command: Option<String>,
    pub turns_pushed: Vec<u64>,
    pub bytes_uploaded: u64,
    /// Why the newest turn is not the safe one, what was skipped.
    pub notes: Vec<String>,
    /// Set when the sandbox is not (entirely) off the node: why.
    pub error: Option<String>,
    pub elapsed_ms: f64,
}

/// What `crabctl drain` did: every crab sandbox of the namespaces, highest value first.
#[derive(Debug, Serialize)]
pub struct DrainReport {
    /// The namespaces drained: the one asked for, or every one containerd has.
    pub namespaces: Vec<String>,
    pub deadline_ms: f64,
    pub sandboxes: Vec<MigrateReport>,
    pub bytes_uploaded: u64,
    pub elapsed_ms: f64,
}

impl DrainReport {
    /// True when every sandbox's newest turn is off the node.
    pub fn complete(&self) -> bool {
        self.sandboxes.iter().all(|s| s.error.is_none() && s.safe_turn == Some(s.newest_turn))
    }
}

/// How often a wait for a turn to settle or a push lock looks again.
const POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// `--deadline` when given, else `[remote] drain_deadline_ms` of the crab config.
pub fn deadline_or_configured(flag: Option<&str>) -> Result<std::time::Duration> {
    match flag {
        Some(text) => parse_deadline(text),
        None => Ok(std::time::Duration::from_millis(crab_config::Config::load(None)?.remote.drain_deadline_ms)),
    }
}

/// `90s`, `2m`, `1500ms`, or plain seconds.
pub fn parse_deadline(text: &str) -> Result<std::time::Duration> {
    let text = text.trim();
    let bad = || CtlError::Invalid(format!("deadline {text:?}: give it as 90s, 2m, 1500ms or seconds"));
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    if !(value.is_finite() && value > 0.0) {
        return Err(bad());
    }
    Ok(std::time::Duration::from_secs_f64(value * scale))
}

impl Ctl {
    /// The crab sandboxes containerd has in this namespace, with whether their task runs.
    async fn crab_sandboxes(&self) -> Result<Vec<(String, bool)>> {
        let containerd = &self.containerd;
        let asked = |e: crab_containerd::grpc::GrpcError| CtlError::Containerd(e.to_string());
        let running: std::collections::HashSet<String> = containerd
            .task_states()
            .await
            .map_err(asked)?
            .into_iter()
            .filter(|t| t.is_running())
            .map(|t| t.container)
            .collect();
        Ok(containerd
            .containers()
            .await
            .map_err(asked)?
            .into_iter()
            .filter(|(_, runtime)| runtime == crate::CRAB_RUNTIME)
            .map(|(id, _)| {
                let runs = running.contains(&id);
                (id, runs)
            })
            .collect())
    }

    /// Turns of `container` not yet off the node: checkpointed turns the push log lacks, plus
    /// one when its newest turn changed something no checkpoint holds (drain's order).
    fn outstanding(&self, container: &str) -> u64 {
        let key = match self.key(container) {
            Ok(key) => key,
            Err(_) => return 0,
        };
        let pushed = self.pushed_turns(container).ok().flatten().unwrap_or_default();
        let history = self.store.history(&key).unwrap_or_default();
        let unpushed = history.iter().filter(|c| !pushed.contains(&c.turn)).count() as u64;
        let head = history.iter().map(|c| c.turn).max().unwrap_or(0);
        let uncaptured = self
            .turns(container)
            .unwrap_or_default()
            .iter()
            .any(|t| t.turn > head && t.class != crab_store::turns::RecordedClass::Clean);
        unpushed + u64::from(uncaptured)
    }

    /// `crabctl migrate`: ends the sandbox's open turn (its final checkpoint, through the
    /// shim's mark), waits for its checkpoint, pushes every turn the registry lacks, and says
    /// which turn is safely off the node and how to restore it elsewhere. Bounded by
    /// `deadline`. Nothing local is removed: the sandbox runs on and its store keeps the chain.
    pub async fn migrate(&self, container: &str, to: Option<&str>, deadline: Instant) -> Result<MigrateReport> {
        let clock = Instant::now();
        let key = self.key(container)?;
        let namespace = self.ctr.namespace().to_owned();
        let known =
            self.containerd.container(container).await.map_err(|e| CtlError::Containerd(e.to_string()))?.is_some();
        let log = TurnLog::open(&self.state_dir, &key)?;
        if !known && self.store.head(&key)?.is_none() {
            return Err(CtlError::Invalid(format!(
                "no sandbox {container:?} in namespace {namespace}: containerd ({}) does not know it and {} holds no \
                 checkpoint of it",
                self.ctr.socket().display(),
                self.state_dir.display()
            )));
        }
        // The registry first: a wrong or missing prefix fails before the sandbox is touched.
        let remote = connect(to)?;
        let repository = format!("{}/{}", remote.registry(), remote.repository(&namespace, container));
        let past = |what: &str| {
            CtlError::Invalid(format!("{container}: the deadline passed {what}; nothing local was removed"))
        };
        let mut notes = Vec::new();
        let mut final_mark = None;
        if known {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.mark_turn(container)).await {
                Ok(Ok(mark)) => final_mark = mark.ended.map(|t| t.turn),
                Ok(Err(e)) => notes.push(format!("no final checkpoint: {e}")),
                Err(_) => return Err(past("while its final checkpoint was taken")),
            }
        }
        while log.is_busy() {
            if Instant::now() >= deadline {
                return Err(past("while a turn in flight was checkpointed"));
            }
            tokio::time::sleep(POLL).await;
        }
        if self.store.head(&key)?.is_none() {
            return Err(CtlError::Invalid(format!(
                "{container}: {} holds no checkpoint of it (its shim writes another store, or its policy is off): \
                 nothing to push",
                self.state_dir.display()
            )));
        }
        // One pusher per sandbox: the shim's own (auto_push) finishes its pass first.
        let queue = crab_remote::PushQueue::open(&remote_dir(&self.state_dir).join("queue"))?;
        let _lock = loop {
            if let Some(lock) = queue.try_lock(&namespace, container)? {
                break lock;
            }
            if Instant::now() >= deadline {
                return Err(past("waiting for the shim's push of it to finish"));
            }
            tokio::time::sleep(POLL).await;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let pushed = match tokio::time::timeout(left, self.push_to(container, to)).await {
            Ok(pushed) => pushed?,
            Err(_) => return Err(past(&format!("while pushing to {repository}"))),
        };
        let turns = self.turns(container)?;
        let newest_turn = turns.last().map_or(0, |t| t.turn);
        let head = pushed.head_turn;
        // The clean turns after the head changed nothing: its checkpoint is their state.
        let mut safe = (head > 0).then_some(head);
        for t in turns.iter().filter(|t| t.turn > head) {
            if t.class != crab_store::turns::RecordedClass::Clean {
                notes.push(format!(
                    "turn {} ({}) is not in a checkpoint{}",
                    t.turn,
                    format!("{:?}", t.class).to_lowercase(),
                    if t.dump_failures.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", t.dump_failures.join("; "))
                    }
                ));
                break;
            }
            safe = Some(t.turn);
        }
        let reference = (head > 0).then(|| format!("{repository}:turn-{head}"));
        let restore_command =
            reference.as_ref().map(|r| format!("crabctl recover {container} --namespace {namespace} --from {r}"));
        Ok(MigrateReport {
            container: container.to_owned(),
            namespace,
            newest_turn,
            final_mark,
            safe_turn: safe,
            reference,
            restore_command,
            turns_pushed: pushed.pushed.iter().map(|p| p.turn).collect(),
            bytes_uploaded: pushed.bytes_uploaded,
            notes,
            error: None,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// `crabctl drain`: [`Ctl::migrate`] for every crab sandbox containerd has in this
    /// namespace (`all_namespaces`: in every namespace), most outstanding turns first, all
    /// within `deadline`. A sandbox that fails (or whose turn never came) gets a row saying why
    /// and which turn the registry holds.
    pub async fn drain(
        &self,
        to: Option<&str>,
        deadline: std::time::Duration,
        all_namespaces: bool,
    ) -> Result<DrainReport> {
        let clock = Instant::now();
        let end = clock + deadline;
        connect(to)?;
        let asked = |e: crab_containerd::grpc::GrpcError| CtlError::Containerd(e.to_string());
        let namespaces = if all_namespaces {
            let mut all = self.containerd.namespaces().await.map_err(asked)?;
            all.sort();
            all
        } else {
            vec![self.ctr.namespace().to_owned()]
        };
        // One Ctl per namespace (the store is the node's, shared); a namespace crab cannot key
        // holds no crab sandbox (its shims would have refused it).
        let mut ctls = Vec::new();
        for namespace in &namespaces {
            if crab_store::validate_namespace(namespace).is_ok() {
                ctls.push(self.in_namespace(namespace));
            }
        }
        let mut order: Vec<(u64, bool, usize, String)> = Vec::new();
        for (n, ctl) in ctls.iter().enumerate() {
            for (id, running) in ctl.crab_sandboxes().await? {
                order.push((ctl.outstanding(&id), running, n, id));
            }
        }
        // Highest value first: most turns not yet off the node, a running one before a stopped
        // one (it may hold an uncaptured turn).
        order.sort_by(|a, b| (b.0, b.1).cmp(&(a.0, a.1)).then_with(|| (a.2, &a.3).cmp(&(b.2, &b.3))));
        let mut rows = Vec::new();
        for (_, _, n, id) in order {
            let ctl = &ctls[n];
            let started = Instant::now();
            let row = if started >= end {
                Err(CtlError::Invalid(format!("{id}: the deadline passed before its turn came; nothing was pushed")))
            } else {
                ctl.migrate(&id, to, end).await
            };
            rows.push(row.unwrap_or_else(|e| {
                // What the registry holds of it all the same (an earlier push, or part of this one).
                let pushed = ctl.pushed_turns(&id).ok().flatten().unwrap_or_default();
                MigrateReport {
                    container: id.clone(),
                    namespace: ctl.ctr.namespace().to_owned(),
                    newest_turn: ctl.turns(&id).ok().and_then(|t| t.last().map(|t| t.turn)).unwrap_or(0),
                    final_mark: None,
                    safe_turn: pushed.last().copied(),
                    reference: None,
                    restore_command: None,
                    turns_pushed: Vec::new(),
                    bytes_uploaded: 0,
                    notes: Vec::new(),
                    error: Some(e.to_string()),
                    elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
                }
            }));
        }
        Ok(DrainReport {
            namespaces,
            deadline_ms: deadline.as_secs_f64() * 1e3,
            bytes_uploaded: rows.iter().map(|r| r.bytes_uploaded).sum(),
            sandboxes: rows,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }
}

/// One line per sandbox: the turn safely off the node and how to restore it, or why not.
pub fn migrate_line(r: &MigrateReport) -> String {
    let who = format!("{}/{}", r.namespace, r.container);
    let mut out = match (&r.error, r.safe_turn) {
        (Some(e), Some(safe)) => {
            format!("{who}: NOT off the node: {e} (the registry holds up to turn {safe} of {})\n", r.newest_turn)
        }
        (Some(e), None) => format!("{who}: NOT off the node: {e} (the registry holds none of it)\n"),
        (None, Some(safe)) => format!(
            "{who}: turn {safe} of {} is off the node ({} turns pushed, {} bytes) in {:.0} ms\n",
            r.newest_turn,
            r.turns_pushed.len(),
            r.bytes_uploaded,
            r.elapsed_ms
        ),
        (None, None) => format!("{who}: no checkpointed turn to push (newest turn {})\n", r.newest_turn),
    };
    for note in &r.notes {
        out += &format!("  note: {note}\n");
    }
    if let Some(command) = &r.restore_command {
        out += &format!("  restore elsewhere: {command}\n");
    }
    out
}
