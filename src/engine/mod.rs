//! The checkpoint engine of one sandbox: it follows turns, asks the inspector
//! what each did, and checkpoints exactly that at the turn's end.
//!
//! A turn opens when its first exec starts and closes when its last exec
//! exits. Closing hands the turn to a background job (classify, capture,
//! commit) and returns at once, so the exit reaches the agent without delay.
//! The next turn's first exec waits for that job: only a turn that arrives
//! before the previous checkpoint is durable sees any delay (the agent's LLM
//! wait normally hides it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::sync::Mutex;

use crate::checkpoint::{ChangedPath, CheckpointStore, TurnInput};
use crate::inspector::{
    ClassifyOptions, Effect, EffectKind, Inspector, TurnClass, TurnEffects, classify, monotonic_now_ns,
};
use crate::runtime::{CheckpointOptions, OciRuntime};
use crate::turns::{Policy, RecordedClass, SandboxPolicy, TurnLog, TurnRecord, unix_ms};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Log(#[from] crate::turns::TurnLogError),
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    #[error("{0}")]
    Other(String),
}

/// Where a sandbox's effects come from: the inspector loaded in this
/// process, or the node's inspector served by crabd.
#[async_trait::async_trait]
pub trait EffectSource: Send + Sync {
    async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), String>;
    /// Effects of `container` up to `until_ns` (CLOCK_MONOTONIC), and records lost meanwhile.
    async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, String>;
    async fn unwatch(&self, container: &str) -> Result<(), String>;
}

#[async_trait::async_trait]
impl EffectSource for Inspector {
    async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), String> {
        let watched = crate::inspector::WatchedContainer {
            id: container.into(),
            root_pid: Some(root_pid),
            rootfs: Some(format!("/proc/{root_pid}/root").into()),
        };
        Inspector::watch(self, cgroup_id, watched).map_err(|e| e.to_string())
    }

    async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, String> {
        Inspector::drain(self, container, until_ns).await.map_err(|e| e.to_string())
    }

    async fn unwatch(&self, container: &str) -> Result<(), String> {
        Inspector::unwatch(self, container).await.map(drop).map_err(|e| e.to_string())
    }
}

/// The node's commit bandwidth (crabd's token bucket): a commit asks for its
/// bytes first. It always returns; when the node cannot grant in time the
/// commit goes ahead (the gate logs it).
#[async_trait::async_trait]
pub trait CommitGate: Send + Sync {
    async fn acquire(&self, sandbox: &str, bytes: u64, kind: crate::node::CommitKind, turn: u64);
}

/// Shared by every sandbox of one shim.
pub struct EngineContext {
    pub store: Arc<CheckpointStore>,
    /// None when BPF is unavailable: then every turn is treated as a process
    /// turn, which is correct, only more expensive.
    pub inspector: Option<Arc<dyn EffectSource>>,
    /// None: commits do not wait for bandwidth.
    pub commit_gate: Option<Arc<dyn CommitGate>>,
    pub state_dir: PathBuf,
}

struct OpenTurn {
    turn: u64,
    exec_id: String,
    started: SystemTime,
    running_execs: usize,
    /// The container's processes when the turn opened: one of them ending is
    /// a change of process state.
    processes_before: Option<std::collections::HashSet<u32>>,
}

struct State {
    next_turn: u64,
    open: Option<OpenTurn>,
    /// The checkpoint job of the last closed turn; the next turn waits for it.
    pending: Option<tokio::task::JoinHandle<()>>,
}

pub struct SandboxEngine {
    container: String,
    policy: SandboxPolicy,
    ctx: Arc<EngineContext>,
    runtime: OciRuntime,
    init_pid: u32,
    work_dir: PathBuf,
    log: TurnLog,
    state: Mutex<State>,
}

impl SandboxEngine {
    /// Starts following `container` (its init is `init_pid`). A `fresh`
    /// container starts a new chain; otherwise (restored from its own
    /// checkpoint) the turn numbering and chain continue.
    pub async fn new(
        container: &str,
        policy: SandboxPolicy,
        ctx: Arc<EngineContext>,
        runtime: OciRuntime,
        init_pid: u32,
        work_dir: PathBuf,
        fresh: bool,
    ) -> Result<Arc<Self>, EngineError> {
        let log = TurnLog::open(&ctx.state_dir, container)?;
        // A mark left by a shim that died mid-turn: nothing is in flight now.
        log.mark_busy(false);
        if fresh {
            // A new container that reuses an id: the old chain is history, not its past.
            if ctx.store.head(container)?.is_some() {
                ctx.store.remove_container(container)?;
            }
            log.reset()?;
            // Kept for `crabctl recover` after a node loss, when containerd no longer knows the sandbox.
            if let Some(bundle) = work_dir.parent() {
                let saved = sandbox_spec_path(&ctx.state_dir, container);
                if let Some(dir) = saved.parent() {
                    let _ = std::fs::create_dir_all(dir);
                }
                if let Err(e) = std::fs::copy(bundle.join("config.json"), &saved) {
                    tracing::warn!(container, error = %e, "sandbox spec not saved for recovery");
                }
            }
        }
        let head = ctx.store.head(container)?;
        let last_turn = log.read()?.last().map(|r| r.turn).max(head.map(|h| h.turn)).unwrap_or(0);
        if let (Some(inspector), Policy::Crab) = (&ctx.inspector, policy.policy) {
            match crate::inspector::cgroup_id_of_pid(init_pid) {
                Ok(cgroup) => {
                    if let Err(e) = inspector.watch(container, cgroup, init_pid).await {
                        tracing::error!(container, error = %e, "inspector cannot watch: every turn will be checkpointed in full");
                    }
                }
                Err(e) => tracing::error!(container, error = %e, "no cgroup v2 id: every turn will be checkpointed in full"),
            }
        }
        Ok(Arc::new(Self {
            container: container.into(),
            policy,
            ctx,
            runtime,
            init_pid,
            work_dir,
            log,
            state: Mutex::new(State {
                next_turn: last_turn + 1,
                open: None,
                pending: None,
            }),
        }))
    }

    /// The init has started: what it did to get going belongs to no turn
    /// (restoring turn 0 means starting the container from its image).
    pub async fn container_started(&self) {
        let Some(inspector) = &self.ctx.inspector else { return };
        match inspector.drain(&self.container, monotonic_now_ns()).await {
            Ok(start) => tracing::debug!(container = %self.container, effects = start.effects.len(), "start-up effects set aside"),
            Err(e) => tracing::debug!(container = %self.container, error = %e, "no start-up effects"),
        }
    }

    pub fn policy(&self) -> &SandboxPolicy {
        &self.policy
    }

    /// An exec starts: it opens a turn or joins the open one. Returns how long
    /// it waited for the previous turn's checkpoint (agent-visible delay).
    pub async fn exec_started(&self, exec_id: &str) -> std::time::Duration {
        let waited = Instant::now();
        // The job takes the state lock to finish: wait for it without holding the lock.
        let pending = self.state.lock().await.pending.take();
        if let Some(pending) = pending {
            let _ = pending.await;
        }
        let delay = waited.elapsed();
        let mut state = self.state.lock().await;
        match &mut state.open {
            Some(open) => open.running_execs += 1,
            None => {
                let turn = state.next_turn;
                state.next_turn += 1;
                self.log.mark_busy(true);
                state.open = Some(OpenTurn {
                    turn,
                    exec_id: exec_id.into(),
                    started: SystemTime::now(),
                    running_execs: 1,
                    processes_before: container_processes(self.init_pid),
                });
            }
        }
        delay
    }

    /// An exec exited: the turn closes when it was the last one running, and
    /// its checkpoint starts in the background.
    pub async fn exec_exited(self: &Arc<Self>) {
        let end_ns = monotonic_now_ns();
        let ended = SystemTime::now();
        let mut state = self.state.lock().await;
        let Some(open) = &mut state.open else { return };
        open.running_execs = open.running_execs.saturating_sub(1);
        if open.running_execs > 0 {
            return;
        }
        let open = state.open.take().expect("checked above");
        let engine = self.clone();
        state.pending = Some(tokio::spawn(async move {
            let record = match engine.checkpoint_turn(&open, end_ns, ended).await {
                Ok(record) => record,
                Err((mut record, e)) => {
                    tracing::error!(container = %engine.container, turn = open.turn, error = %e, "turn checkpoint failed");
                    // The turn still happened: keep its class and why, and say
                    // that its state is only as recent as the previous checkpoint.
                    record.reasons.push(format!("checkpoint failed: {e}"));
                    record.checkpoint_turn = engine.ctx.store.head(&engine.container).ok().flatten().map(|h| h.turn);
                    record
                }
            };
            if let Err(e) = engine.log.append(&record) {
                tracing::error!(container = %engine.container, turn = record.turn, error = %e, "turn record not written");
            }
            // Settled unless the next turn opened meanwhile (it holds the mark then).
            let state = engine.state.lock().await;
            if state.open.is_none() {
                engine.log.mark_busy(false);
            }
        }));
    }

    /// Waits for the last turn's checkpoint and stops watching (the container is being deleted).
    pub async fn settle(&self) {
        let pending = self.state.lock().await.pending.take();
        if let Some(p) = pending {
            let _ = p.await;
        }
        if let Some(inspector) = &self.ctx.inspector {
            let _ = inspector.unwatch(&self.container).await;
        }
    }

    /// Classifies and checkpoints one closed turn. On failure the record made
    /// so far comes back with the error.
    async fn checkpoint_turn(
        &self,
        open: &OpenTurn,
        end_ns: u64,
        ended: SystemTime,
    ) -> Result<TurnRecord, (TurnRecord, EngineError)> {
        let clock = Instant::now();
        // Read, not cached: a rollback may have moved the head since the last turn.
        let previous = self.ctx.store.head(&self.container).ok().flatten().map(|h| h.turn);
        let mut record = TurnRecord {
            turn: open.turn,
            exec_id: Some(open.exec_id.clone()),
            started_unix_ms: unix_ms(open.started),
            ended_unix_ms: unix_ms(ended),
            class: RecordedClass::Proc,
            external: false,
            escalated: false,
            reasons: Vec::new(),
            checkpoint_turn: previous,
            bytes_written: 0,
            capture_ms: 0.0,
            checkpoint_ms: 0.0,
            policy: self.policy.policy,
        };
        let (class, changed) = match self.policy.policy {
            Policy::Off => {
                record.class = RecordedClass::Clean;
                record.reasons.push("policy off: not inspected".into());
                return Ok(record);
            }
            Policy::EveryTurn => {
                record.reasons.push("policy every-turn: full checkpoint".into());
                (TurnClass::Proc, Vec::new())
            }
            Policy::Crab => self.inspect(end_ns, open, &mut record).await,
        };
        record.class = match class {
            TurnClass::Clean => RecordedClass::Clean,
            TurnClass::Fs => RecordedClass::Fs,
            TurnClass::Proc => RecordedClass::Proc,
        };
        if class == TurnClass::Clean {
            // Nothing recovery needs changed: the previous checkpoint stands for this turn.
            record.checkpoint_ms = clock.elapsed().as_secs_f64() * 1e3;
            return Ok(record);
        }
        let images = if class == TurnClass::Proc {
            let dir = self.work_dir.join(format!("dump-{}", open.turn));
            let _ = tokio::fs::remove_dir_all(&dir).await;
            let capture = Instant::now();
            let dumped = self
                .runtime
                .checkpoint(
                    &self.container,
                    &CheckpointOptions {
                        image_path: dir.clone(),
                        work_path: Some(self.work_dir.join(format!("dump-{}-work", open.turn))),
                        leave_running: true,
                        tcp_established: true,
                        ext_unix_sockets: true,
                        file_locks: true,
                        ..Default::default()
                    },
                )
                .await;
            record.capture_ms = capture.elapsed().as_secs_f64() * 1e3;
            if let Err(e) = dumped {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                return Err((record, e.into()));
            }
            Some(dir)
        } else {
            None
        };
        let rootfs = PathBuf::from(format!("/proc/{}/root", self.init_pid));
        if let Some(gate) = &self.ctx.commit_gate {
            let bytes = crate::node::estimate_commit_bytes(&rootfs, &changed, images.as_deref()).await;
            let kind = if images.is_some() { crate::node::CommitKind::Proc } else { crate::node::CommitKind::Fs };
            gate.acquire(&self.container, bytes, kind, open.turn).await;
        }
        let container = self.container.clone();
        let turn = open.turn;
        let images_for_commit = images.clone();
        let report = self
            .ctx
            .store
            .run_blocking(move |store| {
                store.commit_turn(&TurnInput {
                    container: &container,
                    turn,
                    rootfs: Some(&rootfs),
                    changed: &changed,
                    criu_images: images_for_commit.as_deref(),
                })
            })
            .await;
        if let Some(dir) = &images {
            let _ = tokio::fs::remove_dir_all(dir).await;
            let _ = tokio::fs::remove_dir_all(self.work_dir.join(format!("dump-{turn}-work"))).await;
        }
        let report = match report {
            Ok(r) => r,
            Err(e) => return Err((record, e.into())),
        };
        record.checkpoint_turn = Some(turn);
        record.bytes_written = report.traffic.written_bytes + report.manifest_bytes;
        record.checkpoint_ms = clock.elapsed().as_secs_f64() * 1e3;
        tracing::info!(container = %self.container, turn, class = ?record.class, bytes = record.bytes_written,
            ms = record.checkpoint_ms, "turn checkpointed");
        Ok(record)
    }

    /// Classifies the turn from the inspector's effects; fills the record's
    /// reasons. Without an inspector the turn is a process turn.
    async fn inspect(&self, end_ns: u64, open: &OpenTurn, record: &mut TurnRecord) -> (TurnClass, Vec<ChangedPath>) {
        let Some(inspector) = &self.ctx.inspector else {
            record.escalated = true;
            record.reasons.push("inspector unavailable".into());
            return (TurnClass::Proc, Vec::new());
        };
        let effects = match inspector.drain(&self.container, end_ns).await {
            Ok(e) => e,
            Err(e) => {
                record.escalated = true;
                record.reasons.push(format!("inspector: {e}"));
                return (TurnClass::Proc, Vec::new());
            }
        };
        // The init's own execve races the end of Start (runc start returns
        // before the init execs the entrypoint): it is the container coming
        // up, which turn 0 (the image) stands for, not something a turn did.
        let init_pid = self.init_pid;
        let effects = TurnEffects {
            effects: effects
                .effects
                .into_iter()
                .filter(|e| !(e.pid == init_pid && matches!(e.kind, EffectKind::Exec { .. })))
                .collect(),
            lost_events: effects.lost_events,
        };
        let verdict = classify(
            &effects.effects,
            &ClassifyOptions {
                ignored_prefixes: self.policy.ignore.clone(),
                lost_events: effects.lost_events,
                processes_before: open.processes_before.clone(),
            },
        );
        record.external = verdict.external;
        record.escalated = verdict.escalated;
        record.reasons = verdict.reasons.iter().take(32).map(|r| r.to_string()).collect();
        if verdict.reasons.len() > 32 {
            record.reasons.push(format!("... and {} more", verdict.reasons.len() - 32));
        }
        let changed = changed_paths(&effects.effects, &self.policy.ignore);
        (verdict.class, changed)
    }
}

/// Host pids in the cgroup v2 group of `init_pid`, or None when it cannot be read.
fn container_processes(init_pid: u32) -> Option<std::collections::HashSet<u32>> {
    let dir = crate::inspector::cgroup2_path_of_pid(init_pid).ok()?;
    let text = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
    Some(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// Where the shim keeps a copy of a sandbox's OCI spec (the id was validated by the turn log).
pub fn sandbox_spec_path(state_dir: &Path, container: &str) -> PathBuf {
    state_dir.join("sandboxes").join(format!("{container}.json"))
}

/// The distinct paths a turn changed, outside ignored prefixes. A path is
/// "created" when the turn made it (so a new directory is captured whole).
pub fn changed_paths(effects: &[Effect], ignore: &[PathBuf]) -> Vec<ChangedPath> {
    const O_CREAT: u64 = libc::O_CREAT as u64;
    let ignored = |p: &Path| {
        crate::inspector::DEFAULT_IGNORED_PREFIXES.iter().any(|i| p.starts_with(i)) || ignore.iter().any(|i| p.starts_with(i))
    };
    let mut created = BTreeSet::new();
    let mut modified = BTreeSet::new();
    for effect in effects {
        let made: Vec<&Path> = match &effect.kind {
            EffectKind::Mkdir { path, .. } | EffectKind::Symlink { path, .. } | EffectKind::Mknod { path, .. } => {
                vec![&path.path]
            }
            EffectKind::Link { path, .. } => vec![&path.path],
            EffectKind::Rename { to, .. } => vec![&to.path],
            EffectKind::Open { path, flags, .. } if flags & O_CREAT != 0 => vec![&path.path],
            _ => Vec::new(),
        };
        for p in made {
            created.insert(p.to_path_buf());
        }
        for p in effect.kind.changed_paths() {
            if p.resolved && p.path.is_absolute() {
                modified.insert(p.path.clone());
            }
        }
    }
    modified
        .into_iter()
        .filter(|p| !ignored(p))
        .map(|p| {
            use std::os::unix::ffi::OsStrExt;
            let bytes = p.as_os_str().as_bytes();
            if created.contains(&p) { ChangedPath::created(bytes) } else { ChangedPath::modified(bytes) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspector::EffectPath;

    fn effect(kind: EffectKind) -> Effect {
        Effect { time_ns: 1, pid: 10, tid: 10, comm: "sh".into(), result: 0, kind }
    }

    #[test]
    fn changed_paths_mark_created_and_skip_ignored() {
        let effects = vec![
            effect(EffectKind::Open { path: EffectPath::resolved("/app/new.txt"), flags: libc::O_CREAT as u64 | 1, mode: 0o644 }),
            effect(EffectKind::Open { path: EffectPath::resolved("/app/old.txt"), flags: 1, mode: 0 }),
            effect(EffectKind::Mkdir { path: EffectPath::resolved("/app/dir"), mode: 0o755 }),
            effect(EffectKind::Rename { from: EffectPath::resolved("/app/a"), to: EffectPath::resolved("/app/b"), flags: 0 }),
            effect(EffectKind::Open { path: EffectPath::resolved("/root/.cache/pip/x"), flags: libc::O_CREAT as u64, mode: 0 }),
            effect(EffectKind::Open { path: EffectPath::resolved("/dev/null"), flags: 1, mode: 0 }),
        ];
        let got = changed_paths(&effects, &[PathBuf::from("/root/.cache")]);
        let view: Vec<(String, bool)> =
            got.iter().map(|c| (String::from_utf8(c.path.clone()).unwrap(), c.created)).collect();
        assert_eq!(
            view,
            vec![
                ("/app/a".into(), false),
                ("/app/b".into(), true),
                ("/app/dir".into(), true),
                ("/app/new.txt".into(), true),
                ("/app/old.txt".into(), false),
            ]
        );
    }
}
