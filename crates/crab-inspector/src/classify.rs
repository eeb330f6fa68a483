//! What kind of checkpoint a turn needs, from the effects it had.
//!
//! Pure logic: the caller cuts effects at turn boundaries (by `Effect::time_ns`)
//! and passes the turn's lost-record count.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use super::effect::{Effect, EffectKind, SockAddr};

/// How much of the sandbox a turn changed. Ordered: each class includes the ones before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TurnClass {
    /// Nothing outside the ignored paths changed.
    Clean,
    /// Files changed; no process state outlives the turn.
    Fs,
    /// Process, socket or mount state outlives the turn (or the inspector lost sight).
    Proc,
}

/// Why a turn got its class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    FileChanged {
        op: &'static str,
        path: PathBuf,
    },
    /// A file effect whose path the kernel could not resolve: it may be anywhere.
    UnresolvedPath {
        op: &'static str,
        path: PathBuf,
    },
    /// A process started in the turn was still running at its end.
    ProcessSurvives {
        pid: u32,
        comm: String,
    },
    /// A process that was running before the turn ended during it.
    ProcessEnded {
        pid: u32,
    },
    Listening {
        pid: u32,
        addr: String,
    },
    MountChanged {
        op: &'static str,
        target: PathBuf,
    },
    /// Records the kernel could not deliver: the turn may have done anything.
    LostEvents {
        count: u64,
    },
    ExternalConnect {
        pid: u32,
        addr: String,
    },
    /// A process that was running before the turn and still is got CPU time
    /// during it: its memory may have changed (a server answered, a job advanced).
    ProcessRan(ProcessRan),
    /// The processes' CPU times could not be read: any of them may have run.
    CpuTimesUnknown,
    /// io_uring or Linux AIO: the kernel did I/O for the process that the
    /// inspector cannot see, so any file may have changed.
    AsyncIo {
        pid: u32,
        call: &'static str,
    },
}

/// A process from before a turn, alive at its end, that ran during it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessRan {
    pub pid: u32,
    pub comm: String,
    /// CPU time it used during the turn.
    pub cpu_ns: u64,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::FileChanged { op, path } => write!(f, "{op} {}", path.display()),
            Reason::UnresolvedPath { op, path } => {
                write!(f, "{op} on unresolved path {}", path.display())
            }
            Reason::ProcessSurvives { pid, comm } => {
                write!(f, "process {pid} ({comm}) outlives the turn")
            }
            Reason::ProcessEnded { pid } => write!(f, "process {pid} from before the turn ended"),
            Reason::Listening { pid, addr } => write!(f, "process {pid} listens on {addr}"),
            Reason::MountChanged { op, target } => write!(f, "{op} {}", target.display()),
            Reason::LostEvents { count } => write!(f, "{count} inspector records lost"),
            Reason::ExternalConnect { pid, addr } => write!(f, "process {pid} connected to {addr}"),
            Reason::ProcessRan(ProcessRan { pid, comm, cpu_ns }) => {
                write!(f, "process {pid} ({comm}) from before the turn ran {:.3} ms", *cpu_ns as f64 / 1e6)
            }
            Reason::CpuTimesUnknown => {
                write!(f, "CPU times of the processes unreadable: any may have run")
            }
            Reason::AsyncIo { pid, call } => {
                write!(f, "process {pid} used {call}: files it changed through it are not seen")
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    pub class: TurnClass,
    /// The turn talked to something outside this machine: replaying it is not hermetic.
    pub external: bool,
    /// The class was raised because the inspector could not see everything
    /// (lost records, unresolved paths): the truth may be cleaner.
    pub escalated: bool,
    pub reasons: Vec<Reason>,
}

/// Writes under these never count: kernel interfaces and character devices.
pub const DEFAULT_IGNORED_PREFIXES: &[&str] = &[
    "/proc",
    "/sys",
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
];

/// What runc's init process calls itself (`runc:[2:INIT]`) between entering
/// the container and exec'ing the process it starts there.
const RUNTIME_INIT_COMM_PREFIX: &str = "runc:[";

#[derive(Debug, Clone, Default)]
pub struct ClassifyOptions {
    /// Paths (and everything under them) whose changes do not count, in
    /// addition to [`DEFAULT_IGNORED_PREFIXES`].
    pub ignored_prefixes: Vec<PathBuf>,
    /// Records lost during the turn (see `Inspector::take_lost_events`).
    pub lost_events: u64,
    /// Processes running in the container when the turn started, when the
    /// caller knows them: one of them ending is a process-state change.
    /// Without it, a process that exits without a fork or exec in the turn's
    /// effects is taken to be one from before.
    pub processes_before: Option<HashSet<u32>>,
    /// Processes from before the turn, alive at its end, that got CPU time
    /// during it (the caller compares their CPU clocks).
    pub processes_ran: Vec<ProcessRan>,
    /// The caller could not read the CPU clocks: a process may have run unseen.
    pub cpu_times_unknown: bool,
}

pub fn classify(effects: &[Effect], options: &ClassifyOptions) -> Classification {
    let mut verdict = Verdict::default();
    if options.lost_events > 0 {
        verdict.escalate(TurnClass::Proc, Reason::LostEvents { count: options.lost_events });
    }
    classify_files(effects, options, &mut verdict);
    classify_processes(effects, options, &mut verdict);
    for effect in effects {
        match &effect.kind {
            EffectKind::Connect { addr } if addr.is_external() => {
                verdict.external = true;
                verdict.reasons.push(Reason::ExternalConnect { pid: effect.pid, addr: addr.to_string() });
            }
            // Whatever the kernel did for it is file work (io_uring and AIO
            // cannot start processes or mount): escalate to fs, like a
            // change at an unresolved path.
            EffectKind::AsyncIo { call, .. } => {
                verdict.escalate(TurnClass::Fs, Reason::AsyncIo { pid: effect.pid, call: call.name() })
            }
            kind if kind.is_mount_change() => {
                let target = kind.paths().first().map(|p| p.path.clone()).unwrap_or_default();
                verdict.raise(TurnClass::Proc, Reason::MountChanged { op: kind.name(), target });
            }
            _ => {}
        }
    }
    verdict.into_classification()
}

fn classify_files(effects: &[Effect], options: &ClassifyOptions, verdict: &mut Verdict) {
    let ignored: Vec<&Path> = DEFAULT_IGNORED_PREFIXES
        .iter()
        .map(Path::new)
        .chain(options.ignored_prefixes.iter().map(PathBuf::as_path))
        .collect();
    // One reason per (op, path): a build writing a file 1000 times is one change.
    let mut seen = BTreeSet::new();
    for effect in effects {
        for path in effect.kind.changed_paths() {
            if !path.resolved {
                let reason = Reason::UnresolvedPath { op: effect.kind.name(), path: path.path.clone() };
                verdict.escalate(TurnClass::Fs, reason);
            } else if !ignored.iter().any(|prefix| path.path.starts_with(prefix))
                && seen.insert((effect.kind.name(), path.path.clone()))
            {
                let reason = Reason::FileChanged { op: effect.kind.name(), path: path.path.clone() };
                verdict.raise(TurnClass::Fs, reason);
            }
        }
    }
}

fn classify_processes(effects: &[Effect], options: &ClassifyOptions, verdict: &mut Verdict) {
    let exited: HashSet<u32> =
        effects.iter().filter(|e| matches!(e.kind, EffectKind::Exit { .. })).map(|e| e.pid).collect();
    // A process is new when the turn forked it, or exec'd in it (the turn's
    // own command enters the container by exec, its fork happens outside).
    let mut started: Vec<(u32, String)> = Vec::new();
    for effect in effects {
        let pid = match effect.kind {
            EffectKind::Fork { child, .. } => child,
            EffectKind::Exec { .. } => effect.pid,
            _ => continue,
        };
        match started.iter_mut().find(|(p, _)| *p == pid) {
            // Keep the latest name: after exec it says what the process runs.
            Some(entry) => entry.1 = effect.comm.clone(),
            None => started.push((pid, effect.comm.clone())),
        }
    }
    // Without the caller's list, a process that ends without having started
    // in this turn was running before it (an earlier turn's daemon): every
    // process of the turn's own command appears by a fork or an exec first.
    // The one exception is the runtime's init helper when the exec it was to
    // do failed (no such binary): it entered the container only to run it.
    let failed_exec_helpers: HashSet<u32> = effects
        .iter()
        .filter(|e| matches!(e.kind, EffectKind::Exit { .. }) && e.comm.starts_with(RUNTIME_INIT_COMM_PREFIX))
        .map(|e| e.pid)
        .collect();
    let mut ended: Vec<u32> = exited
        .iter()
        .copied()
        .filter(|pid| match &options.processes_before {
            Some(before) => before.contains(pid),
            None => !started.iter().any(|(p, _)| p == pid) && !failed_exec_helpers.contains(pid),
        })
        .collect();
    ended.sort_unstable();
    for (pid, comm) in started.into_iter().filter(|(pid, _)| !exited.contains(pid)) {
        verdict.raise(TurnClass::Proc, Reason::ProcessSurvives { pid, comm });
    }
    for pid in ended {
        verdict.raise(TurnClass::Proc, Reason::ProcessEnded { pid });
    }
    for ran in &options.processes_ran {
        verdict.raise(TurnClass::Proc, Reason::ProcessRan(ran.clone()));
    }
    if options.cpu_times_unknown {
        verdict.escalate(TurnClass::Proc, Reason::CpuTimesUnknown);
    }
    for effect in effects {
        if let EffectKind::Listen { addr, .. } = &effect.kind
            && !exited.contains(&effect.pid)
        {
            let addr = match addr {
                SockAddr::Other { .. } => "a socket".to_string(),
                other => other.to_string(),
            };
            verdict.raise(TurnClass::Proc, Reason::Listening { pid: effect.pid, addr });
        }
    }
}

#[derive(Default)]
struct Verdict {
    class: Option<TurnClass>,
    external: bool,
    escalated: bool,
    reasons: Vec<Reason>,
}

impl Verdict {
    fn raise(&mut self, class: TurnClass, reason: Reason) {
        self.class = self.class.max(Some(class));
        self.reasons.push(reason);
    }

    fn escalate(&mut self, class: TurnClass, reason: Reason) {
        self.escalated = true;
        self.raise(class, reason);
    }

    fn into_classification(self) -> Classification {
        Classification {
            class: self.class.unwrap_or(TurnClass::Clean),
            external: self.external,
            escalated: self.escalated,
            reasons: self.reasons,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effect::EffectPath;

    fn effect(pid: u32, kind: EffectKind) -> Effect {
        Effect::of_shell(pid, kind)
    }

    fn open(path: &str) -> EffectKind {
        EffectKind::Open { path: EffectPath::resolved(path), flags: 0o101, mode: 0o644 }
    }

    fn classify_plain(effects: &[Effect]) -> Classification {
        classify(effects, &ClassifyOptions::default())
    }

    #[test]
    fn no_effects_is_clean() {
        let c = classify_plain(&[]);
        assert_eq!((c.class, c.external, c.escalated), (TurnClass::Clean, false, false));
        assert!(c.reasons.is_empty());
    }

    #[test]
    fn file_writes_are_fs_even_on_tmpfs() {
        let mut tmpfs_path = EffectPath::resolved("/tmp/x");
        tmpfs_path.fs_type = Some("tmpfs".into());
        let effects = [effect(1, EffectKind::Mkdir { path: tmpfs_path, mode: 0o755 })];
        let c = classify_plain(&effects);
        assert_eq!(c.class, TurnClass::Fs);
        assert_eq!(c.reasons, vec![Reason::FileChanged { op: "mkdir", path: "/tmp/x".into() }]);
    }

    #[test]
    fn kernel_and_device_writes_are_ignored() {
        let effects: Vec<Effect> =
            ["/dev/null", "/proc/self/oom_score_adj", "/sys/fs/cgroup/x", "/dev/pts/0", "/dev/tty"]
                .into_iter()
                .map(|p| effect(1, open(p)))
                .collect();
        assert_eq!(classify_plain(&effects).class, TurnClass::Clean);
    }

    #[test]
    fn ignored_prefix_matches_whole_components() {
        let options = ClassifyOptions { ignored_prefixes: vec!["/root/.cache".into()], ..Default::default() };
        let cached = classify(&[effect(1, open("/root/.cache/pip/x"))], &options);
        assert_eq!(cached.class, TurnClass::Clean);
        let sibling = classify(&[effect(1, open("/root/.cachex"))], &options);
        assert_eq!(sibling.class, TurnClass::Fs);
        let devnull_like = classify_plain(&[effect(1, open("/dev/nullish"))]);
        assert_eq!(devnull_like.class, TurnClass::Fs);
    }

    #[test]
    fn rename_counts_both_ends() {
        let kind = EffectKind::Rename {
            from: EffectPath::resolved("/proc/ignored"),
            to: EffectPath::resolved("/w/f"),
            flags: 0,
        };
        let c = classify_plain(&[effect(1, kind)]);
        assert_eq!(c.reasons, vec![Reason::FileChanged { op: "rename", path: "/w/f".into() }]);
    }

    #[test]
    fn repeated_writes_give_one_reason() {
        let c = classify_plain(&[effect(1, open("/w/f")), effect(1, open("/w/f"))]);
        assert_eq!(c.reasons.len(), 1);
    }

    #[test]
    fn unresolved_path_escalates_even_if_it_looks_ignored() {
        let path = EffectPath { path: "/proc/x".into(), resolved: false, fs_type: None };
        let c = classify_plain(&[effect(1, EffectKind::Unlink { path })]);
        assert_eq!((c.class, c.escalated), (TurnClass::Fs, true));
        assert!(matches!(c.reasons[0], Reason::UnresolvedPath { op: "unlink", .. }));
    }

    #[test]
    fn lost_events_escalate_to_proc() {
        let options = ClassifyOptions { lost_events: 3, ..Default::default() };
        let c = classify(&[], &options);
        assert_eq!((c.class, c.escalated), (TurnClass::Proc, true));
        assert_eq!(c.reasons, vec![Reason::LostEvents { count: 3 }]);
    }

    #[test]
    fn exited_children_are_clean_survivors_are_proc() {
        let finished = [
            effect(10, EffectKind::Exec { path: EffectPath::resolved("/bin/bash"), filename: "/bin/bash".into() }),
            effect(10, EffectKind::Fork { child: 11, in_namespace: None }),
            effect(11, EffectKind::Exit { status: 0 }),
            effect(10, EffectKind::Exit { status: 0 }),
        ];
        assert_eq!(classify_plain(&finished).class, TurnClass::Clean);

        let mut background = finished.to_vec();
        background.push(effect(10, EffectKind::Fork { child: 12, in_namespace: None }));
        let c = classify_plain(&background);
        assert_eq!(c.class, TurnClass::Proc);
        assert_eq!(c.reasons, vec![Reason::ProcessSurvives { pid: 12, comm: "sh".into() }]);
    }

    #[test]
    fn ending_a_process_from_before_is_proc() {
        let effects = [effect(5, EffectKind::Exit { status: 9 })];
        // Not started in the turn: it was running before (a daemon killed by `pkill`).
        assert_eq!(classify_plain(&effects).reasons, vec![Reason::ProcessEnded { pid: 5 }]);
        let known = ClassifyOptions { processes_before: Some(HashSet::from([5])), ..Default::default() };
        assert_eq!(classify(&effects, &known).reasons, vec![Reason::ProcessEnded { pid: 5 }]);
        // A caller's list that does not hold it overrides the inference.
        let unknown = ClassifyOptions { processes_before: Some(HashSet::new()), ..Default::default() };
        assert_eq!(classify(&effects, &unknown).class, TurnClass::Clean);
    }

    #[test]
    fn a_process_from_before_that_ran_is_proc() {
        let ran = ProcessRan { pid: 40, comm: "python3".into(), cpu_ns: 1_250_000 };
        let options = ClassifyOptions { processes_ran: vec![ran.clone()], ..Default::default() };
        let c = classify(&[], &options);
        assert_eq!((c.class, c.escalated), (TurnClass::Proc, false));
        assert_eq!(c.reasons, vec![Reason::ProcessRan(ran)]);
        assert_eq!(c.reasons[0].to_string(), "process 40 (python3) from before the turn ran 1.250 ms");
        let unknown = ClassifyOptions { cpu_times_unknown: true, ..Default::default() };
        let c = classify(&[], &unknown);
        assert_eq!((c.class, c.escalated), (TurnClass::Proc, true));
    }

    #[test]
    fn a_runtime_init_whose_exec_failed_is_not_from_before() {
        let failed = Effect { comm: "runc:[2:INIT]".into(), ..effect(12, EffectKind::Exit { status: 255 << 8 }) };
        assert_eq!(classify_plain(&[failed]).class, TurnClass::Clean);
    }

    #[test]
    fn a_child_forked_and_killed_in_the_turn_is_not_from_before() {
        let effects = [
            effect(10, EffectKind::Exec { path: EffectPath::resolved("/bin/bash"), filename: "/bin/bash".into() }),
            effect(10, EffectKind::Fork { child: 11, in_namespace: None }),
            effect(11, EffectKind::Exit { status: 9 }),
            effect(10, EffectKind::Exit { status: 0 }),
        ];
        assert_eq!(classify_plain(&effects).class, TurnClass::Clean);
    }

    #[test]
    fn listening_socket_of_a_live_process_is_proc() {
        let addr = SockAddr::Inet("0.0.0.0:8000".parse().unwrap());
        let listen = effect(7, EffectKind::Listen { addr, backlog: 5 });
        let c = classify_plain(std::slice::from_ref(&listen));
        assert_eq!(c.class, TurnClass::Proc);
        assert!(matches!(&c.reasons[0], Reason::Listening { pid: 7, addr } if addr == "0.0.0.0:8000"));

        let fork = effect(1, EffectKind::Fork { child: 7, in_namespace: None });
        let closed = classify_plain(&[fork, listen, effect(7, EffectKind::Exit { status: 0 })]);
        assert_eq!(closed.class, TurnClass::Clean);
    }

    #[test]
    fn mounts_are_proc() {
        let kind = EffectKind::Mount {
            target: EffectPath::resolved("/mnt"),
            source: "none".into(),
            fs_type: "tmpfs".into(),
            flags: 0,
        };
        assert_eq!(classify_plain(&[effect(1, kind)]).class, TurnClass::Proc);
    }

    #[test]
    fn only_non_loopback_connects_are_external() {
        let connect = |addr: &str| effect(1, EffectKind::Connect { addr: SockAddr::Inet(addr.parse().unwrap()) });
        let local = classify_plain(&[connect("127.0.0.53:53"), connect("[::1]:80"), connect("[::ffff:127.0.0.1]:1")]);
        assert!(!local.external);
        assert_eq!(local.class, TurnClass::Clean);
        let unix = effect(1, EffectKind::Connect { addr: SockAddr::Unix(EffectPath::resolved("/run/s")) });
        assert!(!classify_plain(&[unix]).external);
        let remote = classify_plain(&[connect("93.184.216.34:443")]);
        assert!(remote.external);
        assert_eq!(remote.class, TurnClass::Clean);
    }

    #[test]
    fn asynchronous_io_escalates_naming_the_call() {
        use crate::effect::AsyncIoCall;
        for call in [
            AsyncIoCall::IoUringSetup,
            AsyncIoCall::IoUringEnter,
            AsyncIoCall::IoUringRegister,
            AsyncIoCall::IoSubmit,
            AsyncIoCall::EarlierPollingRing,
        ] {
            let kind = EffectKind::AsyncIo { call, polling_ring: false };
            let c = classify_plain(&[effect(4, kind)]);
            assert_eq!((c.class, c.escalated), (TurnClass::Fs, true));
            assert_eq!(c.reasons, vec![Reason::AsyncIo { pid: 4, call: call.name() }]);
            assert!(c.reasons[0].to_string().contains(call.name()));
        }
    }

    #[test]
    fn unix_socket_bind_creates_a_file() {
        let kind = EffectKind::Bind { addr: SockAddr::Unix(EffectPath::resolved("/w/s.sock")) };
        assert_eq!(classify_plain(&[effect(1, kind)]).class, TurnClass::Fs);
    }
}
