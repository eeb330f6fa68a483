//! Which processes that existed before a turn ran during it.
//!
//! A process from an earlier turn (a server, a background job) that got CPU
//! while the turn went on may have changed its memory (it answered a request,
//! it advanced), which only a dump brings back. The inspector sees syscalls,
//! not computation, so the shim compares each process's CPU time at the
//! turn's start and end instead: the process CPU clock of every process of
//! the container's cgroup, read from userspace (a few reads per process, and
//! only the container's processes).
//!
//! No threshold: a process blocked without a timeout (`sleep`, a server in
//! `accept`/`epoll_wait(-1)`, nginx, tmux) gains exactly 0 ns, measured over
//! seconds. A process that polls on a timer is not idle: Python's
//! `http.server` wakes every 0.5 s (about 90 us of CPU each time), and a turn
//! that spans one of those wake-ups is a process turn; when unsure, proc.
//!
//! CRIU's dumps run code inside every process of the container (freezing it,
//! the parasite), which is crab's doing, not the workload's: the engine
//! measures each dump and [`DumpCharges`] takes it off again.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use crab_inspector::ProcessRan;

#[derive(Debug, thiserror::Error)]
pub enum CpuTimeError {
    #[error("listing the processes of cgroup {dir}: {source}")]
    Cgroup { dir: PathBuf, source: io::Error },
}

/// One process as a snapshot saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessCpu {
    /// When the process started (clock ticks since boot): a pid reused by a
    /// new process is a different process.
    pub start_ticks: u64,
    pub comm: String,
    /// CPU time of all its threads, the ones that ended included.
    pub cpu_ns: u64,
}

/// What the snapshots read of the system. The real one is [`ProcCpuClock`];
/// unit tests give made-up numbers.
pub trait CpuReader: Send + Sync {
    /// The processes of the cgroup (host pids).
    fn cgroup_processes(&self, cgroup_dir: &Path) -> Result<Vec<u32>, CpuTimeError>;
    /// None when the process is gone.
    fn process(&self, pid: u32) -> Option<ProcessCpu>;
}

/// CPU time the runtime caused in each process (CRIU dumps), by (pid, start).
#[derive(Debug, Default, Clone)]
pub struct DumpCharges(HashMap<(u32, u64), u64>);

impl DumpCharges {
    /// Charges to the runtime what each process ran between two snapshots
    /// taken just before and just after a dump.
    pub fn add_dump(&mut self, before: &CpuSnapshot, after: &CpuSnapshot) {
        for (pid, old) in &before.0 {
            if let Some(new) = after.0.get(pid).filter(|new| new.start_ticks == old.start_ticks) {
                *self.0.entry((*pid, old.start_ticks)).or_default() += new.cpu_ns.saturating_sub(old.cpu_ns);
            }
        }
    }

    fn of(&self, pid: u32, process: &ProcessCpu) -> u64 {
        self.0.get(&(pid, process.start_ticks)).copied().unwrap_or(0)
    }

    /// Forgets processes that are gone (after a snapshot of the live ones).
    pub fn retain_live(&mut self, live: &CpuSnapshot) {
        self.0.retain(|(pid, start), _| live.0.get(pid).is_some_and(|p| p.start_ticks == *start));
    }
}

/// CPU time of each process of a container at one moment.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CpuSnapshot(HashMap<u32, ProcessCpu>);

impl CpuSnapshot {
    /// Every process of the cgroup except `excluded` (the runtime's own helpers).
    pub fn take(
        reader: &dyn CpuReader,
        cgroup_dir: &Path,
        excluded: &std::collections::HashSet<u32>,
    ) -> Result<Self, CpuTimeError> {
        let processes = reader
            .cgroup_processes(cgroup_dir)?
            .into_iter()
            .filter(|pid| !excluded.contains(pid))
            .filter_map(|pid| reader.process(pid).map(|p| (pid, p)))
            .collect();
        Ok(Self(processes))
    }

    /// The same snapshot with the runtime's charges taken off each process's time.
    pub fn without(mut self, charges: &DumpCharges) -> Self {
        for (pid, process) in &mut self.0 {
            process.cpu_ns = process.cpu_ns.saturating_sub(charges.of(*pid, process));
        }
        self
    }

    /// The processes it saw.
    pub fn pids(&self) -> std::collections::HashSet<u32> {
        self.0.keys().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The processes of `before` still alive (the same process) in `after` whose
/// CPU time grew, by pid. A process only in `after` started during the turn:
/// its own class comes from the inspector.
pub fn ran_between(before: &CpuSnapshot, after: &CpuSnapshot) -> Vec<ProcessRan> {
    let mut ran: Vec<ProcessRan> = before
        .0
        .iter()
        .filter_map(|(pid, old)| {
            let new = after.0.get(pid).filter(|new| new.start_ticks == old.start_ticks)?;
            let cpu_ns = new.cpu_ns.checked_sub(old.cpu_ns).filter(|ns| *ns > 0)?;
            Some(ProcessRan { pid: *pid, comm: new.comm.clone(), cpu_ns })
        })
        .collect();
    ran.sort_by_key(|p| p.pid);
    ran
}

/// The processes' CPU clocks (`clock_getcpuclockid`) and `/proc/<pid>/stat`.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcCpuClock;

fn process_cpu_ns(pid: u32) -> Option<u64> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock_getcpuclockid writes one clockid_t into `clock`, which we own.
    if unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) } != 0 {
        return None;
    }
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `now`, which we own.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return None;
    }
    Some(now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64)
}

impl CpuReader for ProcCpuClock {
    fn cgroup_processes(&self, cgroup_dir: &Path) -> Result<Vec<u32>, CpuTimeError> {
        let text = std::fs::read_to_string(cgroup_dir.join("cgroup.procs"))
            .map_err(|source| CpuTimeError::Cgroup { dir: cgroup_dir.into(), source })?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    fn process(&self, pid: u32) -> Option<ProcessCpu> {
        let stat = crab_sys::proc_stat::read(pid).ok()?;
        let start_ticks = crab_sys::proc_stat::start_time(&stat)?;
        let comm = String::from_utf8_lossy(crab_sys::proc_stat::name(&stat)?).into_owned();
        let cpu_ns = process_cpu_ns(pid)?;
        Some(ProcessCpu { start_ticks, comm, cpu_ns })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Made-up processes: pid -> (start, comm, cpu ns).
    #[derive(Default)]
    struct FakeClock(Mutex<HashMap<u32, ProcessCpu>>);

    impl FakeClock {
        fn set(&self, pid: u32, start_ticks: u64, comm: &str, cpu_ns: u64) {
            self.0.lock().unwrap().insert(pid, ProcessCpu { start_ticks, comm: comm.into(), cpu_ns });
        }
        fn gone(&self, pid: u32) {
            self.0.lock().unwrap().remove(&pid);
        }
        fn snap(&self, excluded: &[u32]) -> CpuSnapshot {
            CpuSnapshot::take(self, Path::new("/cg"), &excluded.iter().copied().collect()).unwrap()
        }
    }

    impl CpuReader for FakeClock {
        fn cgroup_processes(&self, _dir: &Path) -> Result<Vec<u32>, CpuTimeError> {
            // One listed process is gone before it is read, as in a real race.
            Ok(self.0.lock().unwrap().keys().copied().chain([999]).collect())
        }
        fn process(&self, pid: u32) -> Option<ProcessCpu> {
            self.0.lock().unwrap().get(&pid).cloned()
        }
    }

    fn ran(pid: u32, comm: &str, cpu_ns: u64) -> ProcessRan {
        ProcessRan { pid, comm: comm.into(), cpu_ns }
    }

    #[test]
    fn only_processes_from_before_that_gained_cpu_ran() {
        let clock = FakeClock::default();
        clock.set(1, 100, "sleep", 5_000);
        clock.set(20, 300, "python3", 1_000_000);
        clock.set(30, 400, "nginx", 2_000);
        clock.set(40, 500, "old", 7);
        let before = clock.snap(&[]);
        clock.set(20, 300, "python3", 1_000_001); // a single nanosecond still counts
        clock.set(30, 400, "nginx", 2_000); // idle
        clock.gone(40); // ended: the inspector reports it
        clock.set(50, 600, "curl", 9_000_000); // started in the turn
        let after = clock.snap(&[]);
        assert_eq!(ran_between(&before, &after), vec![ran(20, "python3", 1)]);
    }

    #[test]
    fn a_reused_pid_is_another_process() {
        let clock = FakeClock::default();
        clock.set(7, 100, "job", 10);
        let before = clock.snap(&[]);
        clock.set(7, 101, "new", 1_000);
        assert!(ran_between(&before, &clock.snap(&[])).is_empty());
    }

    #[test]
    fn helpers_are_left_out() {
        let clock = FakeClock::default();
        clock.set(3, 1, "crab-init", 10);
        clock.set(4, 1, "server", 10);
        let before = clock.snap(&[3]);
        assert_eq!(before.len(), 1);
        clock.set(3, 1, "crab-init", 99);
        clock.set(4, 1, "server", 99);
        assert_eq!(ran_between(&before, &clock.snap(&[3])), vec![ran(4, "server", 89)]);
    }

    #[test]
    fn dump_time_is_not_the_workload_running() {
        let clock = FakeClock::default();
        let mut charges = DumpCharges::default();
        clock.set(1, 1, "sleep", 100);
        clock.set(2, 2, "server", 100);
        let turn_start = clock.snap(&[]).without(&charges);
        // A dump of the previous turn runs in every process while this turn is open.
        let dump_start = clock.snap(&[]);
        clock.set(1, 1, "sleep", 150);
        clock.set(2, 2, "server", 170);
        charges.add_dump(&dump_start, &clock.snap(&[]));
        // Then only the server works.
        clock.set(2, 2, "server", 200);
        let turn_end = clock.snap(&[]).without(&charges);
        assert_eq!(ran_between(&turn_start, &turn_end), vec![ran(2, "server", 30)]);
        // Charges follow the process, not the pid.
        clock.set(1, 9, "sleep", 40);
        let reused = clock.snap(&[]).without(&charges);
        assert_eq!(reused.0[&1].cpu_ns, 40);
        charges.retain_live(&reused);
        assert_eq!(charges.0.len(), 1);
    }

    #[test]
    fn real_clock_sees_a_child_run_and_an_idle_one_not() {
        use std::process::Command;
        let busy = Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap();
        let idle = Command::new("sleep").arg("30").spawn().unwrap();
        let (busy_pid, idle_pid) = (busy.id(), idle.id());
        let read = |pid| ProcCpuClock.process(pid).expect("child is alive");
        // `sleep` runs while it starts (exec, loader); wait until it blocks.
        let mut i0 = read(idle_pid);
        for _ in 0..100 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let again = read(idle_pid);
            if again.cpu_ns == i0.cpu_ns {
                break;
            }
            i0 = again;
        }
        let b0 = read(busy_pid);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let (b1, i1) = (read(busy_pid), read(idle_pid));
        for mut child in [busy, idle] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        assert_eq!((b0.comm.as_str(), i0.comm.as_str()), ("sh", "sleep"));
        assert!(b1.cpu_ns > b0.cpu_ns + 10_000_000, "a busy loop ran {} ns", b1.cpu_ns - b0.cpu_ns);
        assert_eq!(i1.cpu_ns, i0.cpu_ns, "sleep ran");
        assert_eq!(b1.start_ticks, b0.start_ticks);
    }
}
