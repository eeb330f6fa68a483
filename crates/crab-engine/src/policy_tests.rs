//! The checkpoint policies end to end without root: a recording host (a temporary directory
//! for the container's root, scripted CPU times, dumps written as small image files), a
//! scripted effect source in place of the inspector, and a real store in a temporary
//! directory. What a turn's record says and what the store holds afterwards are checked
//! together.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crab_inspector::{Effect, EffectKind, EffectPath, TurnEffects};
use crab_runtime::CheckpointOptions;
use crab_store::turns::{Policy, RecordedClass, SandboxPolicy, TurnRecord, TurnsMode};
use crab_store::{ChangedPath, CheckpointStore, ContainerRoot, SandboxKey};

use crate::cpu::{CpuReader, CpuTimeError, ProcessCpu};
use crate::stdin::{ProcReader, StdinError, SyscallState, ThreadState};
use crate::{ChainStart, EffectSource, EffectSourceError, EngineContext, HostError, SandboxEngine, SandboxHost};

/// The pid the scripted effects and CPU times use for the workload (never the init's).
const WORKER: u32 = 4242;

/// A host whose container root is a plain directory and whose dumps are recorded.
pub(crate) struct RecordingHost {
    rootfs: PathBuf,
    /// CPU time of each process of the container, as the test sets it.
    cpu: Mutex<HashMap<u32, u64>>,
    /// Every dump asked for, in order.
    pub(crate) dumps: Mutex<Vec<CheckpointOptions>>,
    /// Dumps fail (as a freeze that fails under load).
    pub(crate) failing_dumps: std::sync::atomic::AtomicBool,
}

impl RecordingHost {
    pub(crate) fn new(rootfs: PathBuf) -> Self {
        std::fs::create_dir_all(&rootfs).unwrap();
        Self {
            rootfs,
            cpu: Mutex::default(),
            dumps: Mutex::default(),
            failing_dumps: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Process `pid` of the container has run `cpu_ns` in all.
    fn set_cpu(&self, pid: u32, cpu_ns: u64) {
        self.cpu.lock().unwrap().insert(pid, cpu_ns);
    }

    fn dump_count(&self) -> usize {
        self.dumps.lock().unwrap().len()
    }
}

impl CpuReader for RecordingHost {
    fn cgroup_processes(&self, _cgroup_dir: &Path) -> Result<Vec<u32>, CpuTimeError> {
        Ok(self.cpu.lock().unwrap().keys().copied().collect())
    }

    fn process(&self, pid: u32) -> Option<ProcessCpu> {
        let cpu_ns = *self.cpu.lock().unwrap().get(&pid)?;
        Some(ProcessCpu { start_ticks: 1, comm: "python3".into(), cpu_ns })
    }
}

/// No thread of the container is ever busy (the engine's quiet waits return at once).
impl ProcReader for RecordingHost {
    fn syscall(&self, _pid: u32) -> Result<SyscallState, StdinError> {
        Ok(SyscallState::NotInSyscall)
    }

    fn first_poll_fd(&self, _pid: u32, _addr: u64) -> Result<i32, StdinError> {
        Ok(-1)
    }

    fn stdin_queued(&self, _pid: u32) -> Result<usize, StdinError> {
        Ok(0)
    }

    fn cgroup_threads(&self, _cgroup_dir: &Path) -> Result<Vec<u32>, StdinError> {
        Ok(Vec::new())
    }

    fn thread_state(&self, _tid: u32) -> Option<ThreadState> {
        None
    }
}

#[async_trait::async_trait]
impl SandboxHost for RecordingHost {
    fn init_pid(&self) -> u32 {
        1
    }

    fn pid_namespace_depth(&self) -> Option<u32> {
        Some(1)
    }

    fn rootfs(&self) -> PathBuf {
        self.rootfs.clone()
    }

    fn container_root(&self) -> Option<Arc<ContainerRoot>> {
        None
    }

    fn cgroup_id(&self) -> Result<u64, HostError> {
        Ok(7)
    }

    fn cgroup_dir(&self) -> Option<PathBuf> {
        Some(self.rootfs.clone())
    }

    fn helper_pids(&self) -> HashSet<u32> {
        HashSet::new()
    }

    fn cpu(&self) -> &dyn CpuReader {
        self
    }

    fn procs(&self) -> &dyn ProcReader {
        self
    }

    async fn dump(&self, options: &CheckpointOptions) -> Result<(), HostError> {
        self.dumps.lock().unwrap().push(options.clone());
        if self.failing_dumps.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(HostError::Runtime(crab_runtime::RuntimeError::Failed {
                binary: "runc".into(),
                verb: "checkpoint".into(),
                status: 1,
                message: "unable to freeze (scripted)".into(),
            }));
        }
        std::fs::create_dir_all(&options.image_path).unwrap();
        std::fs::write(options.image_path.join("pages-1.img"), vec![7u8; 64 << 10]).unwrap();
        std::fs::write(options.image_path.join("inventory.img"), b"inventory").unwrap();
        Ok(())
    }

    async fn rootfs_diff(&self) -> Result<Vec<ChangedPath>, HostError> {
        use std::os::unix::ffi::OsStrExt;
        let mut out = Vec::new();
        let mut dirs = vec![self.rootfs.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                let rel = Path::new("/").join(path.strip_prefix(&self.rootfs).unwrap());
                out.push(ChangedPath::modified(rel.as_os_str().as_bytes()));
                if path.is_dir() {
                    dirs.push(path);
                }
            }
        }
        Ok(out)
    }

    fn rootfs_diff_dir(&self) -> Result<PathBuf, HostError> {
        Ok(self.rootfs.clone())
    }
}

/// Effects the test scripts, handed out by the next drain.
#[derive(Default)]
struct ScriptedEffects {
    pending: Mutex<TurnEffects>,
}

impl ScriptedEffects {
    fn push(&self, kind: EffectKind) {
        self.push_as(WORKER, kind);
    }

    fn push_as(&self, pid: u32, kind: EffectKind) {
        let time_ns = crab_inspector::monotonic_now_ns();
        let effect = Effect { time_ns, pid, tid: pid, comm: "sh".into(), result: 0, kind };
        self.pending.lock().unwrap().effects.push(effect);
    }

    /// The workload forks `child` (`in_namespace` in the namespace `depth` deep), which exits.
    fn fork_and_exit(&self, child: u32, in_namespace: u32, depth: u32) {
        let in_namespace = Some(crab_inspector::NamespacePid { pid: in_namespace, depth });
        self.push(EffectKind::Fork { child, in_namespace });
        self.push_as(child, EffectKind::Exit { status: 0 });
    }

    fn lose(&self, records: u64) {
        self.pending.lock().unwrap().lost_events += records;
    }
}

#[async_trait::async_trait]
impl EffectSource for ScriptedEffects {
    async fn watch(&self, _container: &str, _cgroup_id: u64, _root_pid: u32) -> Result<(), EffectSourceError> {
        Ok(())
    }

    async fn drain(&self, _container: &str, _until_ns: u64) -> Result<TurnEffects, EffectSourceError> {
        Ok(std::mem::take(&mut *self.pending.lock().unwrap()))
    }

    async fn unwatch(&self, _container: &str) -> Result<(), EffectSourceError> {
        Ok(())
    }
}

struct Sandbox {
    _dir: tempfile::TempDir,
    engine: Arc<SandboxEngine>,
    host: Arc<RecordingHost>,
    effects: Arc<ScriptedEffects>,
    store: Arc<CheckpointStore>,
    key: String,
    turns: u32,
}

impl Sandbox {
    async fn new(policy: Policy) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let store = Arc::new(CheckpointStore::open(&state_dir).unwrap());
        let effects = Arc::new(ScriptedEffects::default());
        let ctx = Arc::new(EngineContext {
            store: store.clone(),
            inspector: Some(effects.clone()),
            commit_gate: None,
            state_dir,
            dump_timeout: std::time::Duration::from_secs(60),
            replicator: None,
        });
        let host = Arc::new(RecordingHost::new(dir.path().join("rootfs")));
        let policy = SandboxPolicy { turns: TurnsMode::Exec, policy, ..Default::default() };
        let key = SandboxKey::new("ns", "agent").unwrap();
        let engine =
            SandboxEngine::new(&key, policy, ctx, host.clone(), dir.path().join("bundle/crab"), ChainStart::New)
                .await
                .unwrap();
        engine.container_started().await;
        Self { _dir: dir, engine, host, effects, store, key: key.to_string(), turns: 0 }
    }

    /// Writes `content` at `path` of the container's root, as the workload's `open(O_CREAT)`.
    fn write(&self, path: &str, content: &str) {
        let host_path = self.host.rootfs.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(host_path.parent().unwrap()).unwrap();
        std::fs::write(&host_path, content).unwrap();
        self.effects.push(EffectKind::Open {
            path: EffectPath::resolved(path),
            flags: (libc::O_CREAT | libc::O_WRONLY) as u64,
            mode: 0o644,
        });
    }

    /// Runs one exec turn: `during` acts as the workload; returns the turn's record once it
    /// is checkpointed.
    async fn turn(&mut self, during: impl FnOnce(&Self)) -> TurnRecord {
        self.turns += 1;
        let exec = format!("exec-{}", self.turns);
        self.engine.exec_started(&exec).await;
        during(self);
        self.engine.exec_exited(&exec).await;
        self.engine.wait_for_checkpoints().await;
        let log = crab_store::turns::TurnLog::open(self.store.state_dir(), &self.key).unwrap();
        log.read().unwrap().pop().expect("the turn was recorded")
    }

    fn files_at(&self, turn: u64) -> PathBuf {
        let target = self._dir.path().join(format!("materialized-{turn}"));
        // The base the container started from: its image has /work (the turns only write files there).
        std::fs::create_dir_all(target.join("work")).unwrap();
        self.store.materialize(&self.key, turn, &target).unwrap();
        target
    }
}

#[tokio::test]
async fn a_file_turn_stores_the_file_and_dumps_nothing() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    let record = sandbox.turn(|s| s.write("/work/notes.txt", "turn one")).await;
    assert_eq!(record.class, RecordedClass::Fs, "{record:?}");
    assert_eq!(record.checkpoint_turn, Some(1), "{record:?}");
    assert_eq!(sandbox.host.dump_count(), 0, "a file turn must not dump processes");
    let files = sandbox.files_at(1);
    assert_eq!(std::fs::read_to_string(files.join("work/notes.txt")).unwrap(), "turn one");
}

#[tokio::test]
async fn a_clean_turn_writes_nothing_and_points_at_the_last_checkpoint() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    sandbox.turn(|s| s.write("/work/a", "a")).await;
    let record = sandbox.turn(|_| {}).await;
    assert_eq!(record.class, RecordedClass::Clean, "{record:?}");
    assert_eq!(record.checkpoint_turn, Some(1), "the previous checkpoint stands for a clean turn");
    assert_eq!(record.bytes_written, 0);
    assert_eq!(sandbox.store.head(&sandbox.key).unwrap().map(|h| h.turn), Some(1));
    assert_eq!(sandbox.host.dump_count(), 0);
}

#[tokio::test]
async fn a_process_that_ran_makes_a_process_turn_with_one_dump() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    sandbox.host.set_cpu(WORKER, 1_000_000);
    // A turn opens with the worker's time read; it runs during the turn.
    let record = sandbox.turn(|s| s.host.set_cpu(WORKER, 9_000_000)).await;
    assert_eq!(record.class, RecordedClass::Proc, "{record:?}");
    assert_eq!(record.checkpoint_turn, Some(1), "{record:?}");
    let dumps = sandbox.host.dumps.lock().unwrap().clone();
    assert_eq!(dumps.len(), 1);
    assert!(dumps[0].leave_running, "the sandbox keeps running after its dump");
    let images = sandbox._dir.path().join("images");
    assert!(sandbox.store.restore_images(&sandbox.key, 1, &images).unwrap().is_some());
    assert_eq!(std::fs::read(images.join("pages-1.img")).unwrap(), vec![7u8; 64 << 10]);
}

#[tokio::test]
async fn lost_events_escalate_to_the_whole_rootfs_diff() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    let record = sandbox
        .turn(|s| {
            // Two files changed; the inspector saw one and lost records.
            s.write("/work/seen", "seen");
            std::fs::write(s.host.rootfs.join("work/unseen"), "unseen").unwrap();
            s.effects.lose(3);
        })
        .await;
    assert!(record.escalated, "{record:?}");
    assert!(record.reasons.iter().any(|r| r.contains("rootfs diff")), "{:?}", record.reasons);
    let files = sandbox.files_at(record.checkpoint_turn.unwrap());
    assert_eq!(std::fs::read_to_string(files.join("work/unseen")).unwrap(), "unseen");
}

#[tokio::test]
async fn a_failed_dump_is_retried_recorded_and_carried_into_the_next_turn() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    sandbox.host.set_cpu(WORKER, 1);
    sandbox.host.failing_dumps.store(true, std::sync::atomic::Ordering::SeqCst);
    let failed = sandbox.turn(|s| s.host.set_cpu(WORKER, 5_000_000)).await;
    assert_eq!(failed.class, RecordedClass::Proc);
    assert_eq!(failed.checkpoint_turn, None, "nothing holds the turn: {failed:?}");
    assert_eq!(failed.dump_failures.len() as u32, crate::DUMP_RETRIES.attempts, "{failed:?}");
    assert!(failed.reasons.iter().any(|r| r.contains("checkpoint failed")), "{:?}", failed.reasons);

    // The next turn only writes a file, but the processes of the failed one are not saved yet.
    sandbox.host.failing_dumps.store(false, std::sync::atomic::Ordering::SeqCst);
    let dumps_before = sandbox.host.dump_count();
    let next = sandbox.turn(|s| s.write("/work/after", "x")).await;
    assert_eq!(next.class, RecordedClass::Proc, "{next:?}");
    assert!(next.reasons.iter().any(|r| r.contains("processes of turn 1")), "{:?}", next.reasons);
    assert_eq!(sandbox.host.dump_count(), dumps_before + 1);
    assert_eq!(next.checkpoint_turn, Some(2));
}

#[tokio::test]
async fn every_turn_dumps_and_copies_the_whole_diff_each_turn() {
    let mut sandbox = Sandbox::new(Policy::EveryTurn).await;
    let first = sandbox.turn(|s| s.write("/work/a", "a")).await;
    let second = sandbox.turn(|_| {}).await;
    for record in [&first, &second] {
        assert_eq!(record.class, RecordedClass::Proc, "{record:?}");
        assert!(record.bytes_written >= 64 << 10, "the dump is written again every turn: {record:?}");
    }
    assert_eq!(sandbox.host.dump_count(), 2);
}

#[tokio::test]
async fn policy_off_never_dumps_or_stores() {
    let mut sandbox = Sandbox::new(Policy::Off).await;
    sandbox.host.set_cpu(WORKER, 1);
    let record = sandbox
        .turn(|s| {
            s.write("/work/a", "a");
            s.host.set_cpu(WORKER, 5_000_000);
        })
        .await;
    assert_eq!(record.class, RecordedClass::Clean);
    assert_eq!(sandbox.host.dump_count(), 0);
    assert_eq!(sandbox.store.head(&sandbox.key).unwrap(), None);
}

/// Each turn's record says where its forks left the container's pid cursor (a namespace
/// nested in the container's numbers apart), clean turns' too; a file turn's manifest keeps
/// it, for a restore of that turn from the process turn before it.
#[tokio::test]
async fn turns_record_where_their_forks_left_the_pid_cursor() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    sandbox.host.set_cpu(WORKER, 1_000_000);
    let dumped = sandbox
        .turn(|s| {
            s.host.set_cpu(WORKER, 9_000_000);
            s.effects.fork_and_exit(5001, 5, 1);
        })
        .await;
    assert_eq!((dumped.class, dumped.next_pid), (RecordedClass::Proc, Some(6)), "{dumped:?}");
    let files = sandbox
        .turn(|s| {
            s.effects.fork_and_exit(5002, 12, 1);
            s.effects.fork_and_exit(5003, 11, 1);
            // In a pid namespace the workload made inside the container: not its cursor.
            s.effects.fork_and_exit(5004, 40, 2);
            s.write("/work/a", "a");
        })
        .await;
    assert_eq!((files.class, files.next_pid), (RecordedClass::Fs, Some(13)), "{files:?}");
    assert_eq!(sandbox.store.restore_next_pid(&sandbox.key, 2).unwrap(), Some(13));
    let clean = sandbox.turn(|s| s.effects.fork_and_exit(5005, 20, 1)).await;
    assert_eq!((clean.class, clean.next_pid), (RecordedClass::Clean, Some(21)), "{clean:?}");
    let quiet = sandbox.turn(|_| {}).await;
    assert_eq!((quiet.class, quiet.next_pid), (RecordedClass::Clean, None), "{quiet:?}");
}

fn effect(pid: u32, time_ns: u64, kind: EffectKind) -> Effect {
    Effect { time_ns, pid, tid: pid, comm: "x".into(), result: 0, kind }
}

#[test]
fn turn_effects_leave_out_start_up_helpers_and_the_dump() {
    let (init, helper, worker) = (100, 200, 300);
    let work_dir = Path::new("/run/containerd/bundle/crab");
    let open = |p: &str, resolved: bool| EffectKind::Open {
        path: EffectPath { path: p.into(), resolved, fs_type: None },
        flags: libc::O_CREAT as u64,
        mode: 0o644,
    };
    let exec = EffectKind::Exec { path: EffectPath::resolved("/bin/sh"), filename: "/bin/sh".into() };
    let effects = TurnEffects {
        effects: vec![
            effect(init, 1, open("/dev/.crab/sock", true)),
            effect(init, 2, exec.clone()),
            effect(init, 3, open("/app/after-exec", true)),
            effect(1, 4, EffectKind::Fork { child: helper, in_namespace: None }),
            effect(helper, 5, open("/tmp/helper", true)),
            effect(worker, 6, open("/run/containerd/bundle/crab/dump.log", false)),
            effect(worker, 7, open("/app/work", true)),
        ],
        lost_events: 2,
        overflow: None,
    };
    let helpers = HashSet::from([helper]);
    let kept = crate::turn_effects(effects, init, &helpers, work_dir);
    let kept_times: Vec<u64> = kept.effects.iter().map(|e| e.time_ns).collect();
    assert_eq!(kept_times, vec![3, 7], "{kept:#?}");
    assert_eq!(kept.lost_events, 2, "lost records are never dropped");
}

/// Issue 15: an exec the runtime started (not the spawner) is named in the record of every turn
/// it runs in, with why, and whether it outlived the turn (then no checkpoint holds it); once it
/// exits, later turns no longer list it.
#[tokio::test]
async fn execs_through_the_runtime_are_in_the_records_of_the_turns_they_ran_in() {
    let mut sandbox = Sandbox::new(Policy::Crab).await;
    let engine = sandbox.engine.clone();
    // A short exec the runtime ran: it ends within its own turn.
    let record = {
        engine.exec_started("short").await;
        engine.exec_through_runtime("short", "the exec's user differ").await;
        sandbox.write("/work/a", "a");
        engine.exec_exited("short").await;
        engine.wait_for_checkpoints().await;
        let log = crab_store::turns::TurnLog::open(sandbox.store.state_dir(), &sandbox.key).unwrap();
        log.read().unwrap().pop().unwrap()
    };
    let short = crab_store::turns::RuntimeExec {
        exec_id: "short".into(),
        reason: "the exec's user differ".into(),
        running: false,
    };
    assert_eq!(record.runtime_execs, vec![short.clone()], "{record:?}");
    assert!(record.reasons.contains(&short.to_string()), "{record:?}");
    assert!(record.reasons.iter().any(|r| r.contains("ended within the turn")), "{record:?}");

    // A session the runtime started, still running when the next turns end.
    engine.exec_started("session").await;
    engine.exec_through_runtime("session", "spawner unavailable").await;
    engine.mark().await;
    let marked = {
        let log = crab_store::turns::TurnLog::open(sandbox.store.state_dir(), &sandbox.key).unwrap();
        log.read().unwrap().pop().unwrap()
    };
    assert_eq!(marked.runtime_execs.len(), 1, "{marked:?}");
    assert!(marked.runtime_execs[0].running, "{marked:?}");
    assert!(marked.reasons.iter().any(|r| r.contains("exec session is not restorable")), "{marked:?}");
    // The mark opened the next turn, which the session holds: it lists the session from its start.
    engine.exec_exited("session").await;
    engine.wait_for_checkpoints().await;
    let ended = {
        let log = crab_store::turns::TurnLog::open(sandbox.store.state_dir(), &sandbox.key).unwrap();
        log.read().unwrap().pop().unwrap()
    };
    assert_eq!(ended.turn, marked.turn + 1, "{ended:?}");
    assert_eq!(
        ended.runtime_execs.iter().map(|e| (e.exec_id.as_str(), e.running)).collect::<Vec<_>>(),
        [("session", false)]
    );
    let after = sandbox.turn(|s| s.write("/work/b", "b")).await;
    assert!(after.runtime_execs.is_empty(), "the session is gone: {after:?}");
    assert!(after.reasons.iter().all(|r| !r.contains("runtime")), "{after:?}");
}
