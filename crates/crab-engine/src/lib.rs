//! The checkpoint engine of one sandbox: it follows turns, asks the inspector
//! what each did, and checkpoints exactly that at the turn's end.
//!
//! Turns come from three sources (the sandbox's `io.crab.turns` mode picks
//! which count):
//! - execs: a turn opens when its first exec starts and closes when its last
//!   exec exits (`exec`, `auto`);
//! - stdin sessions: a long-lived exec fed through its stdin; a burst of
//!   input opens a turn, which closes when the session waits for input again
//!   with nothing left running (`stdin`, `auto`; see [`crate::stdin`]).
//!   In `auto` an exec becomes a session when it first waits for input while
//!   alive: its exec turn closes then;
//! - explicit marks: end the open turn and begin the next (every mode; the
//!   only source in `explicit`).
//!
//! At a turn's start and end the engine reads the CPU clocks of the
//! container's processes (see [`crate::cpu`]): one from before the
//! turn that ran during it makes it a process turn.
//!
//! A turn closes while execs or sessions still hold it only by a mark, and
//! then the next turn inherits them. Closing hands the turn to a background
//! job (classify, capture, commit) and returns at once, so the exit reaches
//! the agent without delay. A job captures first (the changed files read into
//! the store's staging area, the CRIU dump), then writes out (hashing, blob
//! writes, fsync, bandwidth) after the previous job's write-out, in turn
//! order. The next exec or stdin burst that opens a turn waits only for the
//! capture (see [`crate::pipeline::TurnPipeline`]); the write-out runs in
//! the agent's LLM wait.

mod blocking;
pub mod cpu;
mod host;
pub mod pipeline;
#[cfg(test)]
mod policy_tests;
mod retry;
pub mod shell;
mod sources;
pub mod stdin;

pub use blocking::on_store;
pub use host::{ContainerHost, HostError, SandboxHost};
pub use retry::{DUMP_RETRIES, RetryPolicy, with_retries};
pub use sources::{CommitGate, EffectSource, EffectSourceError, Replicator};

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::sync::{Mutex, Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::cpu::{CpuSnapshot, DumpCharges, ran_between};
use crate::pipeline::{TurnPipeline, TurnSlot};
use crate::shell::{ShellChannel, ShellState};
use crate::stdin::{DetectorConfig, ForwardedBytes, IdleKind, IdleReport, StdinObserver, busy_threads};
use crab_inspector::{
    ClassifyOptions, Effect, EffectKind, ProcessRan, TurnClass, TurnEffects, classify, monotonic_now_ns,
};
use crab_runtime::{CheckpointOptions, DumpDeadline};
use crab_store::turns::{
    Policy, RecordedClass, RuntimeExec, SandboxPolicy, ShellAsked, TurnLog, TurnRecord, TurnSource, TurnsMode, unix_ms,
};
use crab_store::{ChangedPath, CheckpointStore, MountKind, SandboxMounts, TurnInput};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] crab_store::CheckpointError),
    #[error(transparent)]
    Log(#[from] crab_store::turns::TurnLogError),
    #[error(transparent)]
    Runtime(#[from] crab_runtime::RuntimeError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("{0}")]
    Other(String),
}

#[derive(Debug, thiserror::Error)]
pub enum TurnRequestError {
    #[error(transparent)]
    Invalid(#[from] crab_store::turns::AnnotationError),
    #[error("container {0} follows no turns (checkpoint policy off)")]
    NoEngine(String),
}

/// A Task Update carrying [`crab_store::turns::ANNOTATION_TURN`]: returns the turn
/// a mark ended (None when none was open), once it is checkpointed.
pub async fn turn_request(
    container: &str,
    engine: Option<&Arc<SandboxEngine>>,
    value: &str,
) -> Result<Option<u64>, TurnRequestError> {
    let request = crab_store::turns::TurnRequest::parse(value)?;
    let engine = engine.ok_or_else(|| TurnRequestError::NoEngine(container.into()))?;
    match request {
        crab_store::turns::TurnRequest::Mark => {
            let ended = engine.mark().await;
            tracing::info!(container, turn = ?ended, "turn mark");
            Ok(ended)
        }
    }
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
    /// Bound on one CRIU dump (`[checkpoint] dump_timeout_ms`): past it the dump is abandoned
    /// and the turn carried into the next.
    pub dump_timeout: std::time::Duration,
    /// None: checkpoints stay on this node (no `[remote]` registry).
    pub replicator: Option<Arc<dyn Replicator>>,
}

struct OpenTurn {
    turn: u64,
    source: TurnSource,
    /// The exec that opened it, or the session whose input did.
    exec_id: Option<String>,
    started: SystemTime,
    running_execs: usize,
    /// The container's processes when the turn opened: one of them ending is
    /// a change of process state.
    processes_before: Option<std::collections::HashSet<u32>>,
    /// Their CPU times then (None: unreadable).
    cpu_before: Option<CpuSnapshot>,
    /// Set when the turn closes: those of them alive at its end that ran
    /// meanwhile (None: the CPU times could not be read).
    processes_ran: Option<Vec<ProcessRan>>,
    /// Execs the runtime started (not the spawner) that ran in this turn; `running` is set
    /// when the turn closes.
    runtime_execs: Vec<RuntimeExec>,
}

/// A long-lived exec whose stdin the client feeds.
struct Session {
    pid: u32,
    /// Still starting up: it has not waited for input yet.
    starting: bool,
    /// Working on input it was sent: it holds the open turn.
    busy: bool,
    forwarded: Arc<ForwardedBytes>,
    /// Wakes the session's detector when input arrives.
    wake: Arc<Notify>,
    stop: CancellationToken,
    /// A bash session crab can ask for its state (see [`shell`]).
    shell: Option<AskableShell>,
}

/// A session's shell channel and what crab knows of its state.
#[derive(Clone)]
struct AskableShell {
    channel: Arc<dyn ShellChannel>,
    memory: Arc<std::sync::Mutex<ShellMemory>>,
}

#[derive(Default)]
struct ShellMemory {
    /// What the session's newest process checkpoint holds of it (None: that checkpoint has no
    /// answer it could vouch for, so every turn of the session dumps).
    base: Option<ShellState>,
    /// The turn whose checkpoint listed `base`.
    base_turn: Option<u64>,
    /// The newest state listed in a checkpoint.
    listed: Option<ShellState>,
    /// Asking failed once, or could be seen (`-x`, `-v`): the session is not asked again.
    given_up: Option<String>,
}

struct State {
    next_turn: u64,
    open: Option<OpenTurn>,
    /// Checkpoint jobs in turn order; a new turn waits for the last one's capture only.
    pipeline: TurnPipeline,
    /// Checkpoint jobs started so far (compare with `SandboxEngine::jobs_done`).
    jobs_started: u64,
    sessions: HashMap<String, Session>,
    /// Execs the runtime started that have not exited: every turn they run in lists them.
    runtime_execs: Vec<RuntimeExec>,
}

impl State {
    /// Whether anything still holds the open turn.
    fn held(&self) -> bool {
        self.open.as_ref().is_some_and(|o| o.running_execs > 0) || self.sessions.values().any(|s| s.busy)
    }
}

/// How a sandbox's chain begins when its engine starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainStart {
    /// A new container: whatever a container of the same namespace and id left is retired
    /// (kept until GC's retention drops it), and a new chain begins.
    New,
    /// Created from another chain (a fork): its head was set up at Create, where whatever the
    /// id had before was retired; numbering continues from the fork's turn.
    Forked,
    /// Restored from its own chain (recover, rollback by restore): chain and log continue.
    Continued,
}

pub struct SandboxEngine {
    /// The container id, as the OCI runtime knows it.
    container: String,
    /// `<namespace>/<id>`: the sandbox's chain, turn log, watch and bandwidth account.
    key: String,
    policy: SandboxPolicy,
    ctx: Arc<EngineContext>,
    /// The container's init, root, cgroup and dumps.
    host: Arc<dyn SandboxHost>,
    /// The mounts of the sandbox's spec: which changed paths are on a tmpfs (captured
    /// through the container's mount), which are external state.
    mounts: SandboxMounts,
    /// CPU time crab's dumps made the container's processes spend.
    dump_charges: std::sync::Mutex<DumpCharges>,
    work_dir: PathBuf,
    log: TurnLog,
    state: Mutex<State>,
    /// Checkpoint jobs finished, in order.
    jobs_done: watch::Sender<u64>,
    /// Stops every session detector (the container is going away).
    stop: CancellationToken,
}

impl SandboxEngine {
    /// Starts following the container of sandbox `key` (reached through
    /// `host`); `start` says whether its chain is new or continues.
    pub async fn new(
        key: &crab_store::SandboxKey,
        policy: SandboxPolicy,
        ctx: Arc<EngineContext>,
        host: Arc<dyn SandboxHost>,
        work_dir: PathBuf,
        start: ChainStart,
    ) -> Result<Arc<Self>, EngineError> {
        let (container, key) = (key.id(), key.to_string());
        if start == ChainStart::New {
            // A new container that reuses the id in this namespace: the old chain is
            // history, not its past; it is kept aside, not deleted.
            ctx.store.retire(&key)?;
        }
        let log = TurnLog::open(&ctx.state_dir, &key)?;
        // A mark left by a shim that died mid-turn: nothing is in flight now.
        log.mark_busy(false);
        if start != ChainStart::Continued {
            // Kept for `crabctl recover` after a node loss, when containerd no longer knows the sandbox.
            if let Some(bundle) = work_dir.parent() {
                let saved = crab_store::saved_spec_path_of(&ctx.state_dir, &key)?;
                if let Some(dir) = saved.parent() {
                    use std::os::unix::fs::DirBuilderExt;
                    let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir);
                }
                // The spec holds the sandbox's environment: root's alone, as the store is.
                let copied = std::fs::copy(bundle.join("config.json"), &saved).and_then(|_| {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&saved, std::fs::Permissions::from_mode(0o600))
                });
                if let Err(e) = copied {
                    tracing::warn!(container, error = %e, "sandbox spec not saved for recovery");
                }
            }
        }
        ctx.store.remove_stale_dumps(&key);
        if let Some(replicator) = &ctx.replicator {
            replicator.started(&key);
        }
        let mounts = sandbox_mounts(&ctx.state_dir, &key, &work_dir);
        let head = ctx.store.head(&key)?;
        let last_turn = log.read()?.last().map(|r| r.turn).max(head.map(|h| h.turn)).unwrap_or(0);
        if let (Some(inspector), Policy::Crab) = (&ctx.inspector, policy.policy) {
            match host.cgroup_id() {
                Ok(cgroup) => {
                    if let Err(e) = inspector.watch(&key, cgroup, host.init_pid()).await {
                        tracing::error!(container, error = %e, "inspector cannot watch: every turn will be checkpointed in full");
                    }
                }
                Err(e) => {
                    tracing::error!(container, error = %e, "no cgroup v2 id: every turn will be checkpointed in full")
                }
            }
        }
        Ok(Arc::new(Self {
            container: container.into(),
            key,
            policy,
            ctx,
            host,
            mounts,
            dump_charges: Default::default(),
            work_dir,
            log,
            state: Mutex::new(State {
                next_turn: last_turn + 1,
                open: None,
                pipeline: TurnPipeline::new(),
                jobs_started: 0,
                sessions: HashMap::new(),
                runtime_execs: Vec::new(),
            }),
            jobs_done: watch::channel(0).0,
            stop: CancellationToken::new(),
        }))
    }

    /// The init has started: what it did to get going belongs to no turn
    /// (restoring turn 0 means starting the container from its image). In
    /// `explicit` mode the first turn begins now.
    pub async fn container_started(&self) {
        if self.policy.policy == Policy::Crab {
            self.wait_until_quiet(&Default::default(), "start-up").await;
        }
        self.set_aside_effects("start-up").await;
        if self.policy.turns == TurnsMode::Explicit {
            let mut state = self.state.lock().await;
            if state.open.is_none() {
                self.open_turn(&mut state, TurnSource::Mark, None, 0);
            }
        }
    }

    /// Drains the inspector's effects so far into no turn.
    async fn set_aside_effects(&self, what: &str) {
        let Some(inspector) = &self.ctx.inspector else { return };
        match inspector.drain(&self.key, monotonic_now_ns()).await {
            Ok(set) => {
                tracing::debug!(container = %self.container, what, effects = set.effects.len(), "effects set aside")
            }
            Err(e) => tracing::debug!(container = %self.container, what, error = %e, "no effects to set aside"),
        }
    }

    pub fn policy(&self) -> &SandboxPolicy {
        &self.policy
    }

    /// Whether execs make turns in this sandbox.
    fn execs_make_turns(&self) -> bool {
        matches!(self.policy.turns, TurnsMode::Auto | TurnsMode::Exec)
    }

    /// Opens the next turn. The caller holds the state lock.
    fn open_turn(&self, state: &mut State, source: TurnSource, exec_id: Option<&str>, running_execs: usize) {
        let turn = state.next_turn;
        state.next_turn += 1;
        self.log.mark_busy(true);
        tracing::debug!(container = %self.container, turn, %source, exec = ?exec_id, "turn opened");
        let cpu_before = self.cpu_snapshot().map(|s| s.without(&self.dump_charges.lock().expect("dump charges lock")));
        state.open = Some(OpenTurn {
            turn,
            source,
            exec_id: exec_id.map(str::to_string),
            started: SystemTime::now(),
            running_execs,
            processes_before: cpu_before.as_ref().map(CpuSnapshot::pids),
            cpu_before,
            processes_ran: None,
            runtime_execs: state.runtime_execs.clone(),
        });
    }

    /// The CPU times of the container's processes now, crab-init's spawner
    /// left out (it runs for the runtime, not the workload).
    fn cpu_snapshot(&self) -> Option<CpuSnapshot> {
        let dir = self.host.cgroup_dir()?;
        CpuSnapshot::take(self.host.cpu(), &dir, &self.host.helper_pids())
            .inspect_err(|e| tracing::warn!(container = %self.container, error = %e, "no CPU times: the turn counts as a process turn"))
            .ok()
    }

    /// Threads of the container that are runnable or in uninterruptible sleep (none when unreadable).
    fn busy_threads(&self) -> std::collections::HashSet<u32> {
        let Some(dir) = self.host.cgroup_dir() else { return Default::default() };
        busy_threads(self.host.procs(), &dir)
            .map(|busy| busy.into_iter().map(|(tid, _)| tid).collect())
            .unwrap_or_default()
    }

    /// Waits (boundedly) until no thread but those of `busy_before` is
    /// runnable, so that what crab set off is over before a turn measures
    /// CPU times: after a dump, CRIU has thawed the container and each process
    /// runs a little once the scheduler gets to it (leaving the freezer,
    /// restarting its system call; seen 20 ms after runc returned on a loaded
    /// machine); after Start, the init is still exec'ing its program.
    async fn wait_until_quiet(&self, busy_before: &std::collections::HashSet<u32>, what: &str) {
        const QUIET_LIMIT: std::time::Duration = std::time::Duration::from_millis(200);
        let started = Instant::now();
        while started.elapsed() < QUIET_LIMIT {
            if self.busy_threads().is_subset(busy_before) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        tracing::debug!(container = %self.container, what, "threads still busy: their run counts in the next turn");
    }

    /// Waits until every checkpoint job started so far is done.
    async fn wait_for_checkpoints(&self) -> std::time::Duration {
        let waited = Instant::now();
        let target = self.state.lock().await.jobs_started;
        let mut done = self.jobs_done.subscribe();
        let _ = done.wait_for(|d| *d >= target).await;
        waited.elapsed()
    }

    /// Waits until the last closed turn is captured; its write-out may still run.
    async fn wait_for_capture(&self, exec_id: &str) -> std::time::Duration {
        let waited = Instant::now();
        let captured = self.state.lock().await.pipeline.capture_wait();
        captured.await;
        let waited = waited.elapsed();
        tracing::debug!(container = %self.container, exec = exec_id, waited_us = waited.as_micros() as u64, "turn start waited for the previous capture");
        waited
    }

    /// An exec starts: it opens a turn or joins the open one. Returns how long
    /// it waited for the previous turn's checkpoint (agent-visible delay).
    pub async fn exec_started(&self, exec_id: &str) -> std::time::Duration {
        if !self.execs_make_turns() {
            return std::time::Duration::ZERO;
        }
        let delay = self.wait_for_capture(exec_id).await;
        let mut state = self.state.lock().await;
        match &mut state.open {
            Some(open) => open.running_execs += 1,
            None => self.open_turn(&mut state, TurnSource::Exec, Some(exec_id), 1),
        }
        delay
    }

    /// An exec the OCI runtime started rather than crab-init's spawner (`reason` says why): its
    /// processes are outside the container's process tree, which is what a dump takes. The open
    /// turn, and every turn until it exits, lists it in its record (see [`RuntimeExec`]).
    pub async fn exec_through_runtime(&self, exec_id: &str, reason: &str) {
        let exec = RuntimeExec { exec_id: exec_id.into(), reason: reason.into(), running: true };
        let mut state = self.state.lock().await;
        if !state.runtime_execs.iter().any(|e| e.exec_id == exec_id) {
            state.runtime_execs.push(exec.clone());
        }
        if let Some(open) = &mut state.open
            && !open.runtime_execs.iter().any(|e| e.exec_id == exec_id)
        {
            open.runtime_execs.push(exec);
        }
    }

    /// An exec exited (or failed to start): the turn closes when nothing
    /// holds it any more, and its checkpoint starts in the background.
    pub async fn exec_exited(self: &Arc<Self>, exec_id: &str) {
        let mut state = self.state.lock().await;
        state.runtime_execs.retain(|e| e.exec_id != exec_id);
        let session = state.sessions.remove(exec_id);
        if let Some(session) = &session {
            session.stop.cancel();
        }
        // A session past its start-up stopped counting as a running exec then.
        let counted = session.as_ref().is_none_or(|s| s.starting) && self.execs_make_turns();
        if counted && let Some(open) = &mut state.open {
            open.running_execs = open.running_execs.saturating_sub(1);
        }
        if state.open.is_some() && !state.held() && self.policy.turns != TurnsMode::Explicit {
            self.close_turn(&mut state, monotonic_now_ns(), SystemTime::now(), None);
        }
    }

    /// Ends the open turn now and begins the next, which inherits whatever
    /// still holds it (in `explicit` mode a turn is always open). Returns the
    /// turn it ended, once that turn's checkpoint is durable; None when no
    /// turn was open.
    pub async fn mark(self: &Arc<Self>) -> Option<u64> {
        let closed = {
            let mut state = self.state.lock().await;
            let open = state.open.as_ref()?;
            let (turn, source, exec_id, running) = (open.turn, open.source, open.exec_id.clone(), open.running_execs);
            self.close_turn(&mut state, monotonic_now_ns(), SystemTime::now(), Some(TurnSource::Mark));
            if self.policy.turns == TurnsMode::Explicit {
                self.open_turn(&mut state, TurnSource::Mark, None, 0);
            } else if running > 0 || state.sessions.values().any(|s| s.busy) {
                self.open_turn(&mut state, source, exec_id.as_deref(), running);
            }
            turn
        };
        self.wait_for_checkpoints().await;
        Some(closed)
    }

    /// Hands the open turn to a checkpoint job that runs after the previous
    /// one. The caller holds the state lock.
    fn close_turn(self: &Arc<Self>, state: &mut State, end_ns: u64, ended: SystemTime, closed_by: Option<TurnSource>) {
        let Some(mut open) = state.open.take() else { return };
        if let Some(source) = closed_by {
            open.source = source;
        }
        // Whether each runtime exec outlived the turn: then no checkpoint of it holds its processes.
        for exec in &mut open.runtime_execs {
            exec.running = state.runtime_execs.iter().any(|e| e.exec_id == exec.exec_id);
        }
        let cpu_after = self.cpu_snapshot().map(|s| s.without(&self.dump_charges.lock().expect("dump charges lock")));
        // A stdin turn's session ran its input: that is its own reason (see `inspect`).
        let session_pid = match (open.source, &open.exec_id) {
            (TurnSource::Stdin, Some(id)) => state.sessions.get(id).map(|s| s.pid),
            _ => None,
        };
        open.processes_ran = match (&open.cpu_before, &cpu_after) {
            (Some(before), Some(after)) => {
                Some(ran_between(before, after).into_iter().filter(|p| Some(p.pid) != session_pid).collect())
            }
            _ => None,
        };
        state.jobs_started += 1;
        let job = state.jobs_started;
        let mut slot = state.pipeline.begin(open.turn);
        let engine = self.clone();
        state.pipeline.set_job(tokio::spawn(async move {
            // Counted even if the job panics, so waiters are never stranded.
            let _done = JobDone(engine.jobs_done.clone());
            let record = engine.record_turn(&open, end_ns, ended, &mut slot).await;
            if let Err(e) = engine.log.append(&record) {
                tracing::error!(container = %engine.container, turn = record.turn, error = %e, "turn record not written");
            }
            // Settled unless a later turn is open or closing (it holds the mark then).
            let state = engine.state.lock().await;
            if state.open.is_none() && state.jobs_started == job {
                engine.log.mark_busy(false);
            }
        }));
    }

    /// Checkpoints a closed turn and returns its record, also when the checkpoint failed.
    /// It captures at once; its write-out runs after the previous turn's.
    async fn record_turn(&self, open: &OpenTurn, end_ns: u64, ended: SystemTime, slot: &mut TurnSlot) -> TurnRecord {
        let outcome = self.checkpoint_turn(open, end_ns, ended, slot).await;
        // Records go in turn order, and the head read below includes the previous turn's checkpoint.
        slot.previous_written().await;
        let head = self.ctx.store.head(&self.key).ok().flatten().map(|h| h.turn);
        let mut record = self.record_outcome(open, outcome, head, slot);
        // What a restore of this turn cannot bring back, in words (`runtime_execs` has it as data).
        record.reasons.extend(open.runtime_execs.iter().map(RuntimeExec::to_string));
        record
    }

    fn record_outcome(
        &self,
        open: &OpenTurn,
        outcome: Result<TurnRecord, (TurnRecord, EngineError)>,
        head: Option<u64>,
        slot: &mut TurnSlot,
    ) -> TurnRecord {
        match outcome {
            // A superseded turn has no checkpoint of its own, and the head does not hold it either.
            Ok(record) if record.checkpoint_turn.is_some() || record.superseded_by.is_some() => record,
            // Clean (or not checkpointed by policy): the head stands for it.
            Ok(record) => TurnRecord { checkpoint_turn: head, ..record },
            Err((mut record, e)) => {
                // Over quota is not a fault: the sandbox holds more than its quota allows. Its
                // changes stay unpublished: later turns try again with them as they are then.
                let over_quota = match &e {
                    EngineError::Store(crab_store::CheckpointError::OverQuota { over, .. }) => Some(*over),
                    _ => None,
                };
                if record.class == RecordedClass::Proc {
                    slot.processes_lost();
                }
                // The turn still happened: keep its class and why, and say
                // that its state is only as recent as the previous checkpoint.
                match over_quota {
                    Some(over) => {
                        tracing::warn!(container = %self.container, turn = open.turn, error = %e, "turn not checkpointed");
                        let recoverable = match head {
                            Some(turn) => format!("turn {turn} is its last recoverable turn"),
                            None => "no turn is recoverable: a restore starts from the image".into(),
                        };
                        record.reasons.push(format!("checkpoint not written, {over}; {recoverable}"));
                        record.over_quota = Some(over);
                    }
                    None => {
                        tracing::error!(container = %self.container, turn = open.turn, error = %e, "turn checkpoint failed");
                        record.reasons.push(format!("checkpoint failed: {e}"));
                    }
                }
                record.checkpoint_turn = head;
                record
            }
        }
    }

    /// A started exec whose stdin the client feeds: follows it as a session
    /// (`auto` and `stdin` modes). Returns the hook for the shim's stdin copy. `shell`: the
    /// session is `bash` reading commands from its stdin and the shim can ask it (see
    /// [`shell`]), with what its process checkpoint holds, and that checkpoint's turn, when it
    /// was restored.
    pub async fn stdin_session(
        self: &Arc<Self>,
        exec_id: &str,
        pid: u32,
        shell: Option<shell::AskableSession>,
    ) -> Option<StdinObserver> {
        if !matches!(self.policy.turns, TurnsMode::Auto | TurnsMode::Stdin) {
            return None;
        }
        let cgroup_dir = match self.host.cgroup_dir() {
            Some(dir) => dir,
            None => {
                tracing::warn!(container = %self.container, exec = exec_id, "no cgroup v2 directory: stdin turns off for this exec");
                return None;
            }
        };
        let session = Session {
            pid,
            starting: true,
            busy: false,
            forwarded: Arc::default(),
            wake: Arc::default(),
            stop: self.stop.child_token(),
            shell: shell.map(|shell::AskableSession { channel, restored: base }| AskableShell {
                channel,
                memory: Arc::new(std::sync::Mutex::new(ShellMemory {
                    base_turn: base.as_ref().map(|(_, turn)| *turn),
                    base: base.map(|(state, _)| state),
                    ..Default::default()
                })),
            }),
        };
        let (forwarded, wake, stop) = (session.forwarded.clone(), session.wake.clone(), session.stop.clone());
        self.state.lock().await.sessions.insert(exec_id.to_string(), session);
        let engine = self.clone();
        let id = exec_id.to_string();
        tokio::spawn(async move { engine.follow_session(id, pid, cgroup_dir, forwarded, wake, stop).await });
        let engine = self.clone();
        let id = exec_id.to_string();
        Some(Arc::new(move |bytes| {
            let (engine, id) = (engine.clone(), id.clone());
            Box::pin(async move { engine.stdin_burst(&id, bytes).await })
        }))
    }

    /// Input for a session is about to be forwarded: it opens a turn (after
    /// the previous checkpoint) or joins the open one.
    async fn stdin_burst(&self, exec_id: &str, bytes: usize) {
        if self.state.lock().await.open.is_none() {
            let waited = self.wait_for_capture(exec_id).await;
            if waited > std::time::Duration::from_millis(1) {
                tracing::info!(container = %self.container, exec = exec_id, waited_ms = waited.as_secs_f64() * 1e3,
                    "input waited for the previous turn's checkpoint");
            }
        }
        let mut state = self.state.lock().await;
        let Some(session) = state.sessions.get_mut(exec_id) else { return };
        session.forwarded.add(bytes);
        session.busy = true;
        session.wake.notify_one();
        if state.open.is_none() {
            self.open_turn(&mut state, TurnSource::Stdin, Some(exec_id), 0);
        }
    }

    /// The detector of one session: whenever the session has work (start-up,
    /// or input), sample until it is idle.
    async fn follow_session(
        self: Arc<Self>,
        exec_id: String,
        pid: u32,
        cgroup_dir: PathBuf,
        forwarded: Arc<ForwardedBytes>,
        wake: Arc<Notify>,
        stop: CancellationToken,
    ) {
        let config = DetectorConfig::default();
        loop {
            let active = match self.state.lock().await.sessions.get(&exec_id) {
                Some(s) => s.starting || s.busy,
                None => return,
            };
            if !active {
                tokio::select! {
                    _ = wake.notified() => continue,
                    _ = stop.cancelled() => return,
                }
            }
            let idle = tokio::select! {
                idle = crate::stdin::wait_until_idle(self.host.procs(), pid, &cgroup_dir, forwarded.counter(), &config) => idle,
                _ = stop.cancelled() => return,
            };
            match idle {
                Ok(report) => self.session_idle(&exec_id, report).await,
                Err(e) => {
                    // Gone (its exit closes its turn), or /proc unreadable: only exits bound its turns now.
                    tracing::debug!(container = %self.container, exec = %exec_id, error = %e, "session detector stopped");
                    return;
                }
            }
        }
    }

    /// A session waits for input with nothing running: the turn it held closes
    /// (unless new input came meanwhile, or something else holds it).
    async fn session_idle(self: &Arc<Self>, exec_id: &str, report: IdleReport) {
        let ended = SystemTime::now();
        let mut state = self.state.lock().await;
        let Some(session) = state.sessions.get_mut(exec_id) else { return };
        if session.forwarded.get() != report.forwarded {
            return;
        }
        let was_starting = std::mem::replace(&mut session.starting, false);
        session.busy = false;
        let execs_make_turns = self.execs_make_turns();
        if was_starting
            && execs_make_turns
            && let Some(open) = &mut state.open
        {
            open.running_execs = open.running_execs.saturating_sub(1);
        }
        tracing::info!(container = %self.container, exec = exec_id, starting = was_starting, samples = report.samples,
            background_busy = report.kind == IdleKind::BackgroundBusy, "session waits for input");
        if state.open.is_some() && !state.held() {
            self.close_turn(&mut state, report.confirmed_ns, ended, None);
        } else if was_starting && state.open.is_none() {
            drop(state);
            // `stdin` mode: a session coming up is not a turn.
            self.set_aside_effects("session start-up").await;
        }
    }

    /// Waits for the last turn's checkpoint and stops watching (the container
    /// is being deleted). A turn still open (explicit mode) is dropped: the
    /// container is gone and there is nothing left to checkpoint.
    pub async fn settle(&self) {
        self.stop.cancel();
        self.wait_for_checkpoints().await;
        if let Some(open) = self.state.lock().await.open.take() {
            tracing::debug!(container = %self.container, turn = open.turn, "open turn dropped with the container");
        }
        if let Some(inspector) = &self.ctx.inspector {
            let _ = inspector.unwatch(&self.key).await;
        }
    }

    /// Classifies and checkpoints one closed turn. On failure the record made
    /// so far comes back with the error.
    async fn checkpoint_turn(
        &self,
        open: &OpenTurn,
        end_ns: u64,
        ended: SystemTime,
        slot: &mut TurnSlot,
    ) -> Result<TurnRecord, (TurnRecord, EngineError)> {
        let clock = Instant::now();
        let mut record = TurnRecord {
            turn: open.turn,
            exec_id: open.exec_id.clone(),
            source: open.source,
            started_unix_ms: unix_ms(open.started),
            ended_unix_ms: unix_ms(ended),
            class: RecordedClass::Proc,
            external: false,
            escalated: false,
            reasons: Vec::new(),
            // Set by record_turn from the head once the previous turn is written, unless checkpointed here.
            checkpoint_turn: None,
            superseded_by: None,
            bytes_written: 0,
            capture_ms: 0.0,
            dump_ms: None,
            checkpoint_ms: 0.0,
            policy: self.policy.policy,
            dump_failures: Vec::new(),
            over_quota: None,
            runtime_execs: open.runtime_execs.clone(),
            shells: Vec::new(),
            next_pid: None,
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
        let (class, mut changed) = carry_unpublished(slot, class, changed, &mut record.reasons);
        // Shell states this turn's checkpoint lists; a session's turn dumps unless its answer
        // stands for its memory (see `shell_turn`).
        let (class, shells) = match self.policy.policy {
            Policy::Crab => self.shell_turn(open, class, &mut record).await,
            _ => (class, Vec::new()),
        };
        // A shell state that changed needs a checkpoint even when no file did.
        let class = if class == TurnClass::Clean && !shells.is_empty() { TurnClass::Fs } else { class };
        if record.escalated && class != TurnClass::Clean {
            // The inspector could not see every change (lost events, async
            // I/O, an unresolved path): take every path the rootfs diff holds.
            match self.host.rootfs_diff().await.map_err(EngineError::from) {
                Ok(all) => {
                    record
                        .reasons
                        .push(format!("escalated: the fs delta takes all {} paths of the rootfs diff", all.len()));
                    changed.extend(all);
                }
                Err(e) => return Err((record, e)),
            }
            // The tmpfs mounts have no diff to read: everything on them is taken.
            match self.tmpfs_paths().await {
                Ok(all) => {
                    record
                        .reasons
                        .push(format!("escalated: the fs delta takes all {} paths of the tmpfs mounts", all.len()));
                    changed.extend(all);
                }
                Err(e) => return Err((record, e)),
            }
        }
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
            // Beside the kept copies, so that keeping this dump is a link, not a copy.
            let dir = match self.ctx.store.dump_path(&self.key, open.turn) {
                Ok(dir) => dir,
                Err(e) => return Err((record, e.into())),
            };
            let capture = Instant::now();
            let cpu_before_dump = self.cpu_snapshot();
            let busy_before_dump = self.busy_threads();
            let work_path = self.work_dir.join(format!("dump-{}-work", open.turn));
            // A failed freeze under load is transient: the dump is tried again (bounded) before
            // the turn's checkpoint is given up; every failed attempt's cause goes on record.
            // A dump that timed out is not: it was abandoned, and another would likely hang as
            // long while the next turn waits.
            let retry_unless_timed_out = |e: &HostError| !matches!(e, HostError::Runtime(r) if r.is_timeout());
            let deadline = DumpDeadline { after: self.ctx.dump_timeout, thaw_pid: Some(self.host.init_pid()) };
            let dumped = with_retries(&DUMP_RETRIES, &mut record.dump_failures, retry_unless_timed_out, |attempt| {
                let (dir, work_path) = (dir.clone(), work_path.clone());
                async move {
                    // Whatever a failed attempt left is not a dump.
                    let _ = tokio::fs::remove_dir_all(&dir).await;
                    let _ = tokio::fs::remove_dir_all(&work_path).await;
                    if attempt > 1 {
                        tracing::warn!(container = %self.container, turn = open.turn, attempt, "dump failed: trying again");
                    }
                    let options = CheckpointOptions {
                        image_path: dir,
                        work_path: Some(work_path),
                        leave_running: true,
                        tcp_established: true,
                        ext_unix_sockets: true,
                        file_locks: true,
                        deadline: Some(deadline),
                        ..Default::default()
                    };
                    self.host.dump(&options).await
                }
            })
            .await;
            record.capture_ms = capture.elapsed().as_secs_f64() * 1e3;
            record.dump_ms = Some(record.capture_ms);
            // The dump ran CRIU's code in every process; the turns around it did not.
            self.wait_until_quiet(&busy_before_dump, "after the dump").await;
            if let (Some(before), Some(after)) = (&cpu_before_dump, self.cpu_snapshot()) {
                let mut charges = self.dump_charges.lock().expect("dump charges lock");
                charges.add_dump(before, &after);
                charges.retain_live(&after);
            }
            if let Err(e) = dumped {
                // What a failed or abandoned dump wrote is no checkpoint (its log is kept
                // beside the runtime's, see OciRuntime::checkpoint).
                let _ = tokio::fs::remove_dir_all(&dir).await;
                let _ = tokio::fs::remove_dir_all(&work_path).await;
                return Err((record, e.into()));
            }
            Some(dir)
        } else {
            None
        };
        if let (Policy::EveryTurn, Some(dir)) = (self.policy.policy, &images) {
            let written = self.write_full_checkpoint(open.turn, dir).await;
            let _ = tokio::fs::remove_dir_all(dir).await;
            let _ = tokio::fs::remove_dir_all(self.work_dir.join(format!("dump-{}-work", open.turn))).await;
            let full = match written {
                Ok(full) => full,
                Err(e) => return Err((record, e)),
            };
            record.checkpoint_turn = Some(open.turn);
            record.bytes_written = full.bytes_written;
            record.checkpoint_ms = clock.elapsed().as_secs_f64() * 1e3;
            return Ok(record);
        }
        let rootfs = self.host.rootfs();
        let (container, turn, images_for_stage) = (self.key.clone(), open.turn, images.clone());
        slot.capturing(&changed);
        let staging = Instant::now();
        let tmpfs = self.mounts.tmpfs();
        let container_root = self.host.container_root();
        let quota = self.policy.quota_bytes();
        let next_pid = record.next_pid;
        // Where the other names of a hard-linked file are looked for: the rootfs's own writable
        // layer, not the whole image (None when the rootfs is no overlay: then the rootfs).
        let upper = if changed.is_empty() { None } else { self.host.rootfs_diff_dir().ok() };
        let staged = crate::blocking::on_store(&self.ctx.store, move |store| {
            // Only the mounts this turn changed are opened.
            let mut mounts = Vec::new();
            for dest in tmpfs.iter().filter(|d| changed.iter().any(|c| on_mount(d, &c.path))) {
                let root = container_root.as_ref().ok_or_else(|| {
                    crab_store::CheckpointError::InvalidRequest(format!(
                        "a change on the tmpfs at {dest}, and no pidfd of the container's init to reach it"
                    ))
                })?;
                mounts.push(root.open_mount(dest)?);
            }
            let mut staged = store.stage_turn_in(
                &TurnInput {
                    container: &container,
                    turn,
                    rootfs: Some(&rootfs),
                    changed: &changed,
                    criu_images: images_for_stage.as_deref(),
                },
                &mounts,
                upper.as_deref(),
            )?;
            staged.set_quota(quota);
            staged.set_shells(shells);
            staged.set_next_pid(next_pid);
            Ok(staged)
        })
        .await;
        record.capture_ms += staging.elapsed().as_secs_f64() * 1e3;
        // The turn's state is captured: the next turn may run while this one is written out
        // (and before crabd hears of the capture: a crabd that does not answer costs the
        // next turn nothing).
        slot.captured();
        if images.is_some() && staged.is_ok() {
            slot.process_captured(self.ctx.commit_gate.as_deref(), &self.key).await;
        }
        slot.previous_written().await;
        let report = match staged {
            Ok(staged) => slot.write_out(&self.ctx.store, self.ctx.commit_gate.clone(), &self.key, staged).await,
            Err(e) => Err(e),
        };
        if let Some(dir) = &images {
            let _ = tokio::fs::remove_dir_all(dir).await;
            let _ = tokio::fs::remove_dir_all(self.work_dir.join(format!("dump-{turn}-work"))).await;
        }
        let report = match report {
            Ok(crate::pipeline::WrittenOut::Published { report, ungated }) => {
                if let Some(reason) = ungated {
                    record.reasons.push(format!("written without the node's bandwidth grant: {reason}"));
                }
                report
            }
            Ok(crate::pipeline::WrittenOut::Superseded { by_turn }) => {
                record.superseded_by = Some(by_turn);
                record.reasons.push(format!(
                    "checkpoint superseded by turn {by_turn} while it waited for write bandwidth (turn {by_turn} holds its changes and a newer process dump)"
                ));
                record.checkpoint_ms = clock.elapsed().as_secs_f64() * 1e3;
                return Ok(record);
            }
            Err(e) => return Err((record, e.into())),
        };
        record.checkpoint_turn = Some(turn);
        record.bytes_written = report.traffic.written_bytes + report.manifest_bytes;
        record.checkpoint_ms = clock.elapsed().as_secs_f64() * 1e3;
        if let Some(replicator) = &self.ctx.replicator {
            replicator.checkpointed(&self.key, turn);
        }
        tracing::info!(container = %self.container, turn, class = ?record.class, bytes = record.bytes_written,
            ms = record.checkpoint_ms, "turn checkpointed");
        Ok(record)
    }

    /// Every path on the container's tmpfs mounts (escalated turns).
    async fn tmpfs_paths(&self) -> Result<Vec<ChangedPath>, EngineError> {
        let mounts = self.mounts.clone();
        let tmpfs = mounts.tmpfs();
        let root = self.host.container_root();
        let ignore = self.policy.ignore.clone();
        tokio::task::spawn_blocking(move || -> Result<Vec<ChangedPath>, EngineError> {
            let mut out = Vec::new();
            if tmpfs.is_empty() {
                return Ok(out);
            }
            let root = root.ok_or_else(|| {
                EngineError::Other("no pidfd of the container's init to reach its tmpfs mounts".into())
            })?;
            for dest in &tmpfs {
                let mount = root.open_mount(dest)?;
                for path in mount.all_paths(1 << 20)? {
                    // A nested mount's paths belong to it (a tmpfs is walked on its own).
                    let deeper = mounts.mount_of(&path).is_none_or(|m| m.destination != *dest);
                    let ignored = {
                        use std::os::unix::ffi::OsStrExt;
                        let p = Path::new(std::ffi::OsStr::from_bytes(&path));
                        crab_inspector::DEFAULT_IGNORED_PREFIXES.iter().any(|i| p.starts_with(i))
                            || ignore.iter().any(|i| p.starts_with(i))
                            || p.starts_with(crab_init::MOUNT_DIR)
                    };
                    if !deeper && !ignored {
                        out.push(ChangedPath::modified(path));
                    }
                }
            }
            Ok(out)
        })
        .await
        .map_err(|e| EngineError::Other(format!("tmpfs walk task: {e}")))?
    }

    /// The `every-turn` baseline: the dump plus the whole rootfs diff, written again without
    /// dedup while the next turn waits, as a plain containerd checkpoint would be.
    async fn write_full_checkpoint(&self, turn: u64, dump: &Path) -> Result<crab_store::FullCheckpoint, EngineError> {
        let diff = self.host.rootfs_diff_dir()?;
        let (state_dir, container, dump) = (self.ctx.store.state_dir().to_owned(), self.key.clone(), dump.to_owned());
        tokio::task::spawn_blocking(move || {
            crab_store::write_full_checkpoint(&state_dir, &container, turn, &dump, &diff)
        })
        .await
        .map_err(|e| EngineError::Other(format!("every-turn checkpoint task: {e}")))?
        .map_err(EngineError::from)
    }

    /// The shells of a closed turn. A session that ran input changed its own memory (variables,
    /// cwd, functions) in ways no syscall shows: the turn dumps it, unless it is a shell whose
    /// answer stands for that memory and which a restore can bring there from its newest
    /// process checkpoint. A turn that dumps asks every shell first: what each answers is what
    /// the dump holds of it. Returns the class and the states to list.
    async fn shell_turn(
        &self,
        open: &OpenTurn,
        mut class: TurnClass,
        record: &mut TurnRecord,
    ) -> (TurnClass, Vec<ShellState>) {
        let session_turn = match (open.source, &open.exec_id) {
            (TurnSource::Stdin, Some(id)) => Some(id.clone()),
            _ => None,
        };
        let askable: Vec<(String, u32, AskableShell)> = {
            let state = self.state.lock().await;
            state
                .sessions
                .iter()
                .filter_map(|(id, s)| Some((id.clone(), s.pid, s.shell.clone()?)))
                .filter(|(_, _, shell)| shell.memory.lock().expect("shell memory").given_up.is_none())
                .collect()
        };
        let mut answers: HashMap<String, ShellState> = HashMap::new();
        if let Some(id) = &session_turn {
            let cheap = match askable.iter().find(|(a, _, _)| a == id) {
                None => Err("not a shell crab asks".to_string()),
                Some((_, pid, shell)) => match self.ask_shell(id, *pid, shell, record).await {
                    Err(why) => Err(why),
                    Ok(state) => {
                        let base = shell.memory.lock().expect("shell memory").base.clone();
                        let cheap = shell::cheap_from(base.as_ref(), &state);
                        answers.insert(id.clone(), state);
                        cheap
                    }
                },
            };
            match cheap {
                Ok(()) => record.reasons.insert(
                    0,
                    format!("session {id} ran its input: a shell at its prompt, its state answered (no process dump)"),
                ),
                Err(why) => {
                    class = TurnClass::Proc;
                    record
                        .reasons
                        .insert(0, format!("session {id} ran its input: its memory is process state ({why})"));
                }
            }
        }
        let mut listed = Vec::new();
        if class == TurnClass::Proc {
            for (id, pid, shell) in &askable {
                if !answers.contains_key(id)
                    && let Ok(state) = self.ask_shell(id, *pid, shell, record).await
                {
                    answers.insert(id.clone(), state);
                }
            }
            for (id, _, shell) in &askable {
                let vouched = answers.remove(id).filter(|s| shell::unvouched(s).is_none());
                let mut memory = shell.memory.lock().expect("shell memory");
                memory.base = vouched.clone();
                memory.base_turn = Some(open.turn);
                if let Some(state) = vouched {
                    memory.listed = Some(state.clone());
                    listed.push(state);
                }
            }
        } else if let Some((id, state)) = answers.into_iter().next()
            && let Some((_, _, shell)) = askable.iter().find(|(a, _, _)| *a == id)
        {
            let mut memory = shell.memory.lock().expect("shell memory");
            if memory.listed.as_ref() != Some(&state) {
                memory.listed = Some(state.clone());
                // Only what differs from the process checkpoint's listing (a restore completes it).
                listed.push(match (&memory.base, memory.base_turn) {
                    (Some(base), Some(turn)) => state.relative_to(base, turn),
                    _ => state,
                });
            }
        }
        for asked in &mut record.shells {
            asked.listed = listed.iter().any(|s| s.exec_id == asked.exec_id);
        }
        (class, listed)
    }

    /// Runs `input`, crab's own input to the shell session `pid` (a question, or a restored
    /// shell's way to its turn), and waits (bounded) until the shell is back at its prompt:
    /// what it made the container's processes run is charged to crab, as a dump's is, so the
    /// turn around it does not count the shell as having run.
    pub async fn crab_input<T>(&self, pid: u32, input: impl std::future::Future<Output = T>) -> T {
        let before = self.cpu_snapshot();
        let out = input.await;
        for _ in 0..100 {
            let at_prompt = matches!(self.host.procs().syscall(pid),
                Ok(crate::stdin::SyscallState::Blocked { nr, args }) if nr == libc::SYS_read && args[0] == 0);
            if at_prompt {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        if let (Some(before), Some(after)) = (before, self.cpu_snapshot()) {
            let mut charges = self.dump_charges.lock().expect("dump charges lock");
            charges.add_dump(&before, &after);
            charges.retain_live(&after);
        }
        out
    }

    /// Asks one session for its state (see [`shell`]), after checking it is at its prompt; the
    /// asking goes on record. A session that could not be asked harmlessly is not asked again.
    async fn ask_shell(
        &self,
        exec_id: &str,
        pid: u32,
        shell: &AskableShell,
        record: &mut TurnRecord,
    ) -> Result<ShellState, String> {
        let call = self.host.procs().syscall(pid).map_err(|e| e.to_string())?;
        let pids = self
            .host
            .cgroup_dir()
            .and_then(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect::<Vec<u32>>());
        let Some(pids) = pids else { return Err("the container's cgroup is unreadable".into()) };
        if let Some(why) = shell::not_at_prompt(pid, &call, shell.channel.stdio(), &pids) {
            return Err(why);
        }
        let marks = shell::Marks::new(shell::nonce());
        let clock = Instant::now();
        let answer =
            shell.channel.ask(shell::capture_line(&marks).into_bytes(), marks.clone(), shell::ASK_TIMEOUT).await;
        let ms = clock.elapsed().as_secs_f64() * 1e3;
        let answer_bytes = answer.as_ref().map_or(0, |a| a.len() as u64);
        let parsed = answer.and_then(|a| shell::parse_answer(exec_id, &a, &marks).map_err(|e| e.to_string()));
        let unvouched = match &parsed {
            Ok(state) => shell::unvouched(state),
            Err(e) => Some(e.clone()),
        };
        // Not asked again: a question that failed may have left part of itself in the session,
        // and with -x or -v the shell prints the question itself.
        let seen = parsed.as_ref().is_ok_and(|s| s.flags.contains('x') || s.flags.contains('v'));
        if parsed.is_err() || seen {
            let why = unvouched.clone().unwrap_or_default();
            tracing::warn!(container = %self.container, exec = exec_id, %why, "shell session not asked again");
            shell.memory.lock().expect("shell memory").given_up = Some(why);
        }
        record.shells.push(ShellAsked { exec_id: exec_id.to_string(), ms, answer_bytes, listed: false, unvouched });
        parsed
    }

    /// Classifies the turn from the inspector's effects; fills the record's
    /// reasons. Without an inspector the turn is a process turn.
    async fn inspect(&self, end_ns: u64, open: &OpenTurn, record: &mut TurnRecord) -> (TurnClass, Vec<ChangedPath>) {
        let Some(inspector) = &self.ctx.inspector else {
            record.escalated = true;
            record.reasons.push("inspector unavailable".into());
            return (TurnClass::Proc, Vec::new());
        };
        let effects = match inspector.drain(&self.key, end_ns).await {
            Ok(e) => e,
            Err(e) => {
                record.escalated = true;
                record.reasons.push(format!("inspector: {e}"));
                return (TurnClass::Proc, Vec::new());
            }
        };
        // Every fork moves the cursor, the runtime's helpers' too.
        record.next_pid = self.host.pid_namespace_depth().and_then(|depth| next_pid_after(&effects.effects, depth));
        let effects = turn_effects(effects, self.host.init_pid(), &self.host.helper_pids(), &self.work_dir);
        let verdict = classify(
            &effects.effects,
            &ClassifyOptions {
                ignored_prefixes: self.policy.ignore.clone(),
                lost_events: effects.lost_events,
                processes_before: open.processes_before.clone(),
                cpu_times_unknown: open.processes_ran.is_none(),
                processes_ran: open.processes_ran.clone().unwrap_or_default(),
            },
        );
        record.external = verdict.external;
        record.escalated = verdict.escalated;
        record.reasons = verdict.reasons.iter().take(32).map(|r| r.to_string()).collect();
        if verdict.reasons.len() > 32 {
            record.reasons.push(format!("... and {} more", verdict.reasons.len() - 32));
        }
        let mut class = verdict.class;
        if let Some(overflow) = effects.overflow {
            // The effects kept are only part of the turn's: every file effect
            // beyond the bound is gone (the whole rootfs diff stands for them,
            // see checkpoint_turn), and when process effects were cut too the
            // process state is unknown.
            record.escalated = true;
            record.reasons.insert(0, overflow.to_string());
            class = class.max(if overflow.processes_cut { TurnClass::Proc } else { TurnClass::Fs });
        }
        let changed = changed_paths(&effects.effects, &self.policy.ignore);
        let (changed, external) = split_by_mount(changed, &self.mounts);
        if !external.is_empty() {
            // Never cleaner than the truth: the turn changed state, crab only cannot keep it.
            record.external = true;
            class = class.max(TurnClass::Fs);
            for (path, mount) in external.iter().take(8) {
                record.reasons.push(format!(
                    "external state: {} is on the {} mount at {}, which crab does not own: not checkpointed",
                    String::from_utf8_lossy(path),
                    mount.fs_type,
                    mount.destination
                ));
            }
            if external.len() > 8 {
                record.reasons.push(format!("... and {} more paths of external state", external.len() - 8));
            }
        }
        (class, changed)
    }
}

/// Marks one finished checkpoint job when dropped.
struct JobDone(watch::Sender<u64>);

impl Drop for JobDone {
    fn drop(&mut self) {
        self.0.send_modify(|done| *done += 1);
    }
}

/// Adds to a turn what earlier turns changed but no durable checkpoint holds (their checkpoint
/// failed or is still being written), raising its class when that needs more.
fn carry_unpublished(
    slot: &TurnSlot,
    mut class: TurnClass,
    mut changed: Vec<ChangedPath>,
    reasons: &mut Vec<String>,
) -> (TurnClass, Vec<ChangedPath>) {
    let carried = slot.carried();
    if let Some(turn) = carried.processes_of
        && class != TurnClass::Proc
    {
        reasons.push(format!("processes of turn {turn} are not checkpointed: dumping them"));
        class = TurnClass::Proc;
    }
    if !carried.paths.is_empty() && class == TurnClass::Clean {
        reasons.push(format!("{} paths of earlier turns are not checkpointed", carried.paths.len()));
        class = TurnClass::Fs;
    }
    changed.extend(carried.paths);
    (class, changed)
}

/// The mounts of the sandbox's spec: the bundle's config.json (what the runtime mounted), else
/// the copy saved for recovery. Without either every path is taken for the rootfs's.
fn sandbox_mounts(state_dir: &Path, container: &str, work_dir: &Path) -> SandboxMounts {
    let bundle_spec = work_dir.parent().map(|b| b.join("config.json"));
    let from_bundle = match &bundle_spec {
        Some(path) => SandboxMounts::from_spec_file(path),
        None => Err("no bundle".into()),
    };
    from_bundle
        .or_else(|e| {
            tracing::warn!(container, error = %e, "spec mounts not read from the bundle: using the saved spec");
            crab_store::saved_spec_path_of(state_dir, container)
                .map_err(|e| e.to_string())
                .and_then(|saved| SandboxMounts::from_spec_file(&saved))
        })
        .unwrap_or_else(|e| {
            tracing::error!(container, error = %e, "spec mounts unknown: tmpfs and bind mounts are taken for the rootfs");
            SandboxMounts::default()
        })
}

/// Whether the absolute container path `path` is at or below the mount at `dest`.
fn on_mount(dest: &crab_store::RelPath, path: &[u8]) -> bool {
    crab_store::RelPath::parse(path).is_ok_and(|p| *dest == p || dest.is_ancestor_of(&p))
}

/// Splits a turn's changed paths into those crab checkpoints (rootfs and tmpfs mounts) and
/// those on mounts it does not own (external state, with their mount). Paths on crab's own and
/// the kernel's mounts are neither.
fn split_by_mount(
    changed: Vec<ChangedPath>,
    mounts: &SandboxMounts,
) -> (Vec<ChangedPath>, Vec<(Vec<u8>, crab_store::SpecMount)>) {
    let mut kept = Vec::new();
    let mut external = Vec::new();
    for change in changed {
        match mounts.mount_of(&change.path) {
            None => kept.push(change),
            Some(m) => match m.kind {
                MountKind::Tmpfs => kept.push(change),
                MountKind::External => external.push((change.path, m.clone())),
                MountKind::Crab | MountKind::Kernel => {}
            },
        }
    }
    (kept, external)
}

/// The pid the container's next process gets after `effects`: the one after the highest the
/// effects' forks were given in the container's pid namespace (`depth` deep; a namespace nested
/// in it numbers apart), None when the inspector numbered no fork there. The highest, not the
/// last recorded: two forks on two CPUs may be recorded out of their pids' order. (A namespace
/// whose pids wrapped around within the turn gets a cursor past the pids before the wrap.)
pub fn next_pid_after(effects: &[Effect], depth: u32) -> Option<u32> {
    effects
        .iter()
        .filter_map(|e| match e.kind {
            EffectKind::Fork { in_namespace: Some(ns), .. } if ns.depth == depth => Some(ns.pid),
            _ => None,
        })
        .max()
        .map(|pid| pid.saturating_add(1))
}

/// The effects of a turn that the turn's own work made: left out are the container coming up
/// (the init before it execs the entrypoint, which races the end of Start, and the forks that
/// made the init and the runtime's helpers: turn 0, the image, stands for them), what the
/// runtime's helpers did (crab-init's spawner runs for the runtime, not the workload), and what
/// the previous turn's dump did (CRIU's parasite runs inside the container's processes and
/// writes its log to the engine's work directory, a host path).
pub fn turn_effects(
    effects: TurnEffects,
    init_pid: u32,
    helpers: &std::collections::HashSet<u32>,
    work_dir: &Path,
) -> TurnEffects {
    let by_checkpoint = |e: &Effect| {
        let paths = e.kind.paths();
        !paths.is_empty() && paths.iter().all(|p| !p.resolved && p.path.starts_with(work_dir))
    };
    let init_exec_ns = effects
        .effects
        .iter()
        .filter(|e| e.pid == init_pid && matches!(e.kind, EffectKind::Exec { .. }))
        .map(|e| e.time_ns)
        .max();
    let start_up = |e: &Effect| {
        (e.pid == init_pid && init_exec_ns.is_some_and(|exec| e.time_ns <= exec))
            || matches!(e.kind, EffectKind::Fork { child, .. } if child == init_pid || helpers.contains(&child))
    };
    TurnEffects {
        effects: effects
            .effects
            .into_iter()
            .filter(|e| !start_up(e))
            .filter(|e| !by_checkpoint(e))
            .filter(|e| !helpers.contains(&e.pid))
            .collect(),
        lost_events: effects.lost_events,
        overflow: effects.overflow,
    }
}

/// The distinct paths a turn changed, outside ignored prefixes. A path is
/// "created" when the turn made it (so a new directory is captured whole).
pub fn changed_paths(effects: &[Effect], ignore: &[PathBuf]) -> Vec<ChangedPath> {
    const O_CREAT: u64 = libc::O_CREAT as u64;
    let ignored = |p: &Path| {
        crab_inspector::DEFAULT_IGNORED_PREFIXES.iter().any(|i| p.starts_with(i))
            || ignore.iter().any(|i| p.starts_with(i))
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
    use crate::stdin::IdleKind;
    use crab_inspector::EffectPath;

    /// An engine with checkpointing off (records, no inspector, no runtime
    /// calls): what is left is the turn bookkeeping of each mode.
    async fn engine(dir: &Path, turns: TurnsMode) -> Arc<SandboxEngine> {
        let ctx = Arc::new(EngineContext {
            store: Arc::new(CheckpointStore::open(dir.join("state")).unwrap()),
            inspector: None,
            commit_gate: None,
            state_dir: dir.join("state"),
            dump_timeout: std::time::Duration::from_secs(60),
            replicator: None,
        });
        let host = Arc::new(crate::policy_tests::RecordingHost::new(dir.join("rootfs")));
        let policy = SandboxPolicy { turns, policy: Policy::Off, ..Default::default() };
        let key = crab_store::SandboxKey::new("ns", "c1").unwrap();
        SandboxEngine::new(&key, policy, ctx, host, dir.join("bundle/crab"), ChainStart::New).await.unwrap()
    }

    /// Settles the jobs and returns (turn, source, exec id) of every record.
    async fn turns(engine: &SandboxEngine) -> Vec<(u64, TurnSource, Option<String>)> {
        engine.wait_for_checkpoints().await;
        engine.log.read().unwrap().into_iter().map(|r| (r.turn, r.source, r.exec_id)).collect()
    }

    /// A session as `stdin_session` registers it, without its detector (the tests play it).
    async fn add_session(engine: &SandboxEngine, exec_id: &str) {
        let session = Session {
            pid: 0,
            starting: true,
            busy: false,
            forwarded: Arc::default(),
            wake: Arc::default(),
            stop: CancellationToken::new(),
            shell: None,
        };
        engine.state.lock().await.sessions.insert(exec_id.into(), session);
    }

    fn idle(forwarded: u64) -> IdleReport {
        IdleReport { kind: IdleKind::Quiet, confirmed_ns: monotonic_now_ns(), forwarded, samples: 2 }
    }

    fn exec(id: &str) -> Option<String> {
        Some(id.into())
    }

    #[tokio::test]
    async fn exec_turns_span_overlapping_execs() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path(), TurnsMode::Exec).await;
        e.exec_started("a").await;
        e.exec_started("b").await;
        e.exec_exited("a").await;
        assert!(turns(&e).await.is_empty(), "b still runs");
        e.exec_exited("b").await;
        e.exec_started("c").await;
        e.exec_exited("c").await;
        assert_eq!(turns(&e).await, vec![(1, TurnSource::Exec, exec("a")), (2, TurnSource::Exec, exec("c"))]);
        assert!(!e.log.is_busy());
    }

    #[tokio::test]
    async fn a_mark_splits_the_open_turn_and_the_rest_stays_held() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path(), TurnsMode::Exec).await;
        assert_eq!(e.mark().await, None, "no turn open: nothing to end");
        e.exec_started("a").await;
        assert_eq!(e.mark().await, Some(1));
        assert!(e.log.is_busy(), "a still holds turn 2");
        e.exec_exited("a").await;
        assert_eq!(turns(&e).await, vec![(1, TurnSource::Mark, exec("a")), (2, TurnSource::Exec, exec("a"))]);
    }

    #[tokio::test]
    async fn explicit_mode_turns_are_only_marks() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path(), TurnsMode::Explicit).await;
        e.container_started().await;
        assert_eq!(e.exec_started("a").await, std::time::Duration::ZERO);
        e.exec_exited("a").await;
        assert!(turns(&e).await.is_empty(), "execs bound nothing");
        assert_eq!(e.mark().await, Some(1));
        assert_eq!(e.mark().await, Some(2));
        assert_eq!(turns(&e).await, vec![(1, TurnSource::Mark, None), (2, TurnSource::Mark, None)]);
        assert!(e.log.is_busy(), "turn 3 is open");
    }

    #[tokio::test]
    async fn stdin_mode_turns_are_bursts_and_start_up_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path(), TurnsMode::Stdin).await;
        e.exec_started("s").await;
        add_session(&e, "s").await;
        e.session_idle("s", idle(0)).await;
        assert!(turns(&e).await.is_empty(), "the session coming up is no turn");
        e.stdin_burst("s", 8).await;
        e.session_idle("s", idle(8)).await;
        e.stdin_burst("s", 4).await;
        e.exec_exited("s").await;
        assert_eq!(turns(&e).await, vec![(1, TurnSource::Stdin, exec("s")), (2, TurnSource::Stdin, exec("s"))]);
    }

    #[tokio::test]
    async fn auto_mode_session_start_is_an_exec_turn_then_bursts() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path(), TurnsMode::Auto).await;
        e.exec_started("s").await;
        add_session(&e, "s").await;
        e.session_idle("s", idle(0)).await;
        assert_eq!(turns(&e).await, vec![(1, TurnSource::Exec, exec("s"))]);
        e.stdin_burst("s", 5).await;
        // Idle samples taken before more input came: not the end of the burst.
        e.stdin_burst("s", 5).await;
        e.session_idle("s", idle(5)).await;
        assert_eq!(turns(&e).await.len(), 1, "a stale idle report ends nothing");
        e.session_idle("s", idle(10)).await;
        // A short exec beside the session, while the session works on a burst: one turn for both.
        e.stdin_burst("s", 1).await;
        e.exec_started("x").await;
        e.exec_exited("x").await;
        assert_eq!(turns(&e).await.len(), 2, "the session's burst still holds turn 3");
        e.session_idle("s", idle(11)).await;
        // Exiting idle closes nothing; exiting mid-burst closes the burst's turn.
        e.stdin_burst("s", 1).await;
        e.exec_exited("s").await;
        assert_eq!(
            turns(&e).await,
            vec![
                (1, TurnSource::Exec, exec("s")),
                (2, TurnSource::Stdin, exec("s")),
                (3, TurnSource::Stdin, exec("s")),
                (4, TurnSource::Stdin, exec("s")),
            ]
        );
    }

    #[tokio::test]
    async fn bad_turn_requests_name_the_annotation() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path(), TurnsMode::Exec).await;
        let err = turn_request("c1", Some(&e), "undo").await.unwrap_err();
        assert!(matches!(err, TurnRequestError::Invalid(_)));
        assert!(err.to_string().contains("io.crab.turn") && err.to_string().contains("undo"), "{err}");
        let err = turn_request("c1", None, "mark").await.unwrap_err();
        assert!(matches!(err, TurnRequestError::NoEngine(_)), "{err}");
    }

    fn effect(kind: EffectKind) -> Effect {
        Effect { time_ns: 1, pid: 10, tid: 10, comm: "sh".into(), result: 0, kind }
    }

    #[test]
    fn changed_paths_mark_created_and_skip_ignored() {
        let effects = vec![
            effect(EffectKind::Open {
                path: EffectPath::resolved("/app/new.txt"),
                flags: libc::O_CREAT as u64 | 1,
                mode: 0o644,
            }),
            effect(EffectKind::Open { path: EffectPath::resolved("/app/old.txt"), flags: 1, mode: 0 }),
            effect(EffectKind::Mkdir { path: EffectPath::resolved("/app/dir"), mode: 0o755 }),
            effect(EffectKind::Rename {
                from: EffectPath::resolved("/app/a"),
                to: EffectPath::resolved("/app/b"),
                flags: 0,
            }),
            effect(EffectKind::Open {
                path: EffectPath::resolved("/root/.cache/pip/x"),
                flags: libc::O_CREAT as u64,
                mode: 0,
            }),
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
