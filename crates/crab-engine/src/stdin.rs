//! Turns of a long-lived shell or interpreter fed through its stdin.
//!
//! A stdin turn starts when the shim forwards bytes to a session's stdin and
//! ends when the session has consumed them and done all the work they asked
//! for: it is blocked reading its stdin again, nothing is left in its stdin,
//! and no thread of the container is runnable or in uninterruptible sleep,
//! on two samples in a row. Everything is read from the kernel's view of the
//! processes, never from the bytes themselves: the detector does not know or
//! care what language the session speaks.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Called by the shim's stdin copy with the number of bytes it is about to
/// forward; the copy waits for the returned future before writing them, so a
/// turn is open before the session can react.
pub type StdinObserver = Arc<dyn Fn(usize) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum StdinError {
    #[error("session process {pid}: reading {what}: {source}")]
    Proc { pid: u32, what: String, source: io::Error },
    #[error("container cgroup {dir}: {source}")]
    Cgroup { dir: PathBuf, source: io::Error },
    #[error("session process {pid}: malformed {what}: {text:?}")]
    Malformed { pid: u32, what: &'static str, text: String },
}

/// The system call a thread is in, as `/proc/<pid>/syscall` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyscallState {
    /// On a CPU, or runnable: not in a system call we can name.
    Running,
    /// Blocked, but not in a system call (e.g. stopped by a signal).
    NotInSyscall,
    Blocked {
        nr: i64,
        args: [u64; 6],
    },
}

/// The scheduler state of a thread (the letter of `/proc/<tid>/stat`).
pub type ThreadState = char;

/// What the detector reads of the system. The real one is [`ProcFs`]; unit
/// tests give scripted answers.
pub trait ProcReader: Send + Sync {
    fn syscall(&self, pid: u32) -> Result<SyscallState, StdinError>;
    /// The descriptor of the first `struct pollfd` at `addr` in `pid`'s memory.
    fn first_poll_fd(&self, pid: u32, addr: u64) -> Result<i32, StdinError>;
    /// Bytes waiting in `pid`'s stdin (0 for stdin that is no pipe or terminal).
    fn stdin_queued(&self, pid: u32) -> Result<usize, StdinError>;
    /// Every thread id in the cgroup.
    fn cgroup_threads(&self, cgroup_dir: &Path) -> Result<Vec<u32>, StdinError>;
    /// None when the thread is gone.
    fn thread_state(&self, tid: u32) -> Option<ThreadState>;
}

/// Whether a thread blocked in `call` is waiting for its stdin (fd 0) to
/// become readable. `poll_fd` reads the descriptor a one-entry poll waits on.
pub fn waits_on_stdin(call: &SyscallState, poll_fd: impl FnOnce(u64) -> Option<i32>) -> bool {
    let SyscallState::Blocked { nr, args } = *call else { return false };
    if nr == libc::SYS_read || nr == libc::SYS_readv {
        return args[0] == 0;
    }
    // With nfds = 1 the only descriptor select can watch is 0.
    if nr == libc::SYS_pselect6 || is_select(nr) {
        return args[0] == 1;
    }
    if nr == libc::SYS_ppoll || is_poll(nr) {
        return args[1] == 1 && poll_fd(args[0]) == Some(0);
    }
    false
}

#[cfg(target_arch = "x86_64")]
fn is_select(nr: i64) -> bool {
    nr == libc::SYS_select
}

#[cfg(not(target_arch = "x86_64"))]
fn is_select(_nr: i64) -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn is_poll(nr: i64) -> bool {
    nr == libc::SYS_poll
}

#[cfg(not(target_arch = "x86_64"))]
fn is_poll(_nr: i64) -> bool {
    false
}

/// Threads in these states are doing work the turn asked for (or the kernel
/// is doing it for them): the turn has not ended while one exists.
fn is_busy(state: ThreadState) -> bool {
    matches!(state, 'R' | 'D')
}

/// One look at a session and its container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub waiting_on_stdin: bool,
    pub stdin_queued: usize,
    /// Threads of the container that are runnable or in uninterruptible sleep.
    pub busy: Vec<(u32, ThreadState)>,
    /// The session's forwarded-bytes counter when the sample was taken.
    pub forwarded: u64,
}

impl Sample {
    pub fn is_idle(&self) -> bool {
        self.waiting_on_stdin && self.stdin_queued == 0 && self.busy.is_empty()
    }

    /// The session waits for input with nothing queued, whatever else runs.
    pub fn session_waits(&self) -> bool {
        self.waiting_on_stdin && self.stdin_queued == 0
    }
}

/// Takes one sample. The cheap, most telling check comes first: a session not
/// blocked on its stdin is busy, and nothing else is read.
pub fn take_sample(reader: &dyn ProcReader, pid: u32, cgroup_dir: &Path, forwarded: u64) -> Result<Sample, StdinError> {
    let call = reader.syscall(pid)?;
    let waiting_on_stdin = waits_on_stdin(&call, |addr| reader.first_poll_fd(pid, addr).ok());
    let mut sample = Sample { waiting_on_stdin, stdin_queued: 0, busy: Vec::new(), forwarded };
    if !waiting_on_stdin {
        return Ok(sample);
    }
    sample.stdin_queued = reader.stdin_queued(pid)?;
    if sample.stdin_queued > 0 {
        return Ok(sample);
    }
    sample.busy = busy_threads(reader, cgroup_dir)?;
    Ok(sample)
}

/// Threads of the cgroup that are runnable or in uninterruptible sleep.
pub fn busy_threads(reader: &dyn ProcReader, cgroup_dir: &Path) -> Result<Vec<(u32, ThreadState)>, StdinError> {
    Ok(reader
        .cgroup_threads(cgroup_dir)?
        .into_iter()
        .filter_map(|tid| reader.thread_state(tid).filter(|s| is_busy(*s)).map(|s| (tid, s)))
        .collect())
}

#[derive(Debug, Clone)]
pub struct DetectorConfig {
    /// Time between samples right after input arrived, and before the sample
    /// that confirms an idle-looking one.
    pub interval: Duration,
    /// How long after input the detector samples every `interval`; after
    /// that the interval doubles per sample up to `max_interval`, so that a
    /// session busy with a long command costs next to nothing.
    pub fast_for: Duration,
    /// The longest time between samples: bounds how late a long command's end is seen.
    pub max_interval: Duration,
    /// Idle samples in a row that end a turn.
    pub idle_samples: u32,
    /// A session that waits for input this long ends its turn even though
    /// other processes keep running: a background job that never sleeps
    /// (a busy server, `yes > /dev/null &`) must not hold turns open forever.
    pub background_grace: Duration,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(5),
            fast_for: Duration::from_millis(50),
            max_interval: Duration::from_millis(100),
            idle_samples: 2,
            background_grace: Duration::from_secs(1),
        }
    }
}

/// When the detector samples: every `interval` for `fast_for` after input
/// (most commands are over by then), then backing off by doubling up to
/// `max_interval`. An idle-looking sample is confirmed after `interval`
/// whatever the back-off, so a turn's end is seen at most one slow interval
/// plus one fast one after it came.
#[derive(Debug)]
pub struct SampleSchedule {
    config: DetectorConfig,
    /// The clock reading (any monotonic origin) of the last input.
    input_at: Duration,
    backoff: Duration,
}

impl SampleSchedule {
    pub fn new(config: DetectorConfig, now: Duration) -> Self {
        let backoff = config.interval;
        Self { config, input_at: now, backoff }
    }

    /// Input arrived at `now`: sample fast again.
    pub fn input(&mut self, now: Duration) {
        self.input_at = now;
        self.backoff = self.config.interval;
    }

    /// The wait after a sample taken at `now`; `looked_idle`: that sample looked idle.
    pub fn next_wait(&mut self, now: Duration, looked_idle: bool) -> Duration {
        if looked_idle || now.saturating_sub(self.input_at) < self.config.fast_for {
            return self.config.interval;
        }
        self.backoff = (self.backoff * 2).min(self.config.max_interval.max(self.config.interval));
        self.backoff
    }
}

/// Why a turn was found over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleKind {
    /// Session waiting, nothing runnable.
    Quiet,
    /// Session waiting for the grace period while background work went on.
    BackgroundBusy,
}

/// Decides a turn's end from successive samples (pure: the clock comes in).
#[derive(Debug)]
pub struct IdleDetector {
    config: DetectorConfig,
    idle_run: u32,
    /// The forwarded-bytes count of the samples so far: when it moves, a new burst began.
    seen_forwarded: Option<u64>,
    waiting_since: Option<Duration>,
}

impl IdleDetector {
    pub fn new(config: DetectorConfig) -> Self {
        Self { config, idle_run: 0, seen_forwarded: None, waiting_since: None }
    }

    /// Feeds the sample taken at `now` (any monotonic origin); returns when the turn is over.
    pub fn observe(&mut self, sample: &Sample, now: Duration) -> Option<IdleKind> {
        if self.seen_forwarded != Some(sample.forwarded) {
            self.idle_run = 0;
            self.waiting_since = None;
            self.seen_forwarded = Some(sample.forwarded);
        }
        self.idle_run = if sample.is_idle() { self.idle_run + 1 } else { 0 };
        if self.idle_run >= self.config.idle_samples {
            return Some(IdleKind::Quiet);
        }
        if !sample.session_waits() {
            self.waiting_since = None;
            return None;
        }
        let since = *self.waiting_since.get_or_insert(now);
        (now.saturating_sub(since) >= self.config.background_grace).then_some(IdleKind::BackgroundBusy)
    }
}

/// The end of a stdin turn as the detector saw it.
#[derive(Debug, Clone, Copy)]
pub struct IdleReport {
    pub kind: IdleKind,
    /// CLOCK_MONOTONIC of the sample that confirmed it: every effect of the turn came before.
    pub confirmed_ns: u64,
    /// The forwarded-bytes count the idle samples saw: a burst after it is not part of this turn.
    pub forwarded: u64,
    pub samples: u32,
}

/// Samples until the session is idle. Errors (the session is gone) end the wait.
pub async fn wait_until_idle(
    reader: &dyn ProcReader,
    pid: u32,
    cgroup_dir: &Path,
    forwarded: &AtomicU64,
    config: &DetectorConfig,
) -> Result<IdleReport, StdinError> {
    let mut detector = IdleDetector::new(config.clone());
    let origin = std::time::Instant::now();
    let mut schedule = SampleSchedule::new(config.clone(), Duration::ZERO);
    let mut wait = config.interval;
    let mut seen_forwarded = forwarded.load(Ordering::SeqCst);
    let mut samples = 0;
    loop {
        tokio::time::sleep(wait).await;
        let count = forwarded.load(Ordering::SeqCst);
        let sample = take_sample(reader, pid, cgroup_dir, count)?;
        samples += 1;
        let now = origin.elapsed();
        if let Some(kind) = detector.observe(&sample, now) {
            let confirmed_ns = crab_inspector::monotonic_now_ns();
            return Ok(IdleReport { kind, confirmed_ns, forwarded: count, samples });
        }
        if count != seen_forwarded {
            seen_forwarded = count;
            schedule.input(now);
        }
        wait = schedule.next_wait(now, sample.is_idle());
    }
}

/// The detector's view through `/proc` and the cgroup v2 file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcFs;

fn proc_error(pid: u32, what: impl Into<String>) -> impl FnOnce(io::Error) -> StdinError {
    let what = what.into();
    move |source| StdinError::Proc { pid, what, source }
}

/// Parses `/proc/<pid>/syscall`: "running", "-1 sp pc", or "nr a0 .. a5 sp pc" (args in hex).
pub fn parse_syscall(pid: u32, text: &str) -> Result<SyscallState, StdinError> {
    let malformed = || StdinError::Malformed { pid, what: "syscall", text: text.into() };
    let mut fields = text.split_whitespace();
    let first = fields.next().ok_or_else(malformed)?;
    if first == "running" {
        return Ok(SyscallState::Running);
    }
    let nr: i64 = first.parse().map_err(|_| malformed())?;
    if nr < 0 {
        return Ok(SyscallState::NotInSyscall);
    }
    let mut args = [0u64; 6];
    for arg in &mut args {
        let field = fields.next().ok_or_else(malformed)?;
        *arg = u64::from_str_radix(field.trim_start_matches("0x"), 16).map_err(|_| malformed())?;
    }
    Ok(SyscallState::Blocked { nr, args })
}

impl ProcReader for ProcFs {
    fn syscall(&self, pid: u32) -> Result<SyscallState, StdinError> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/syscall")).map_err(proc_error(pid, "syscall"))?;
        parse_syscall(pid, &text)
    }

    fn first_poll_fd(&self, pid: u32, addr: u64) -> Result<i32, StdinError> {
        use std::os::unix::fs::FileExt;
        let mem = std::fs::File::open(format!("/proc/{pid}/mem")).map_err(proc_error(pid, "mem"))?;
        let mut fd = [0u8; 4];
        mem.read_exact_at(&mut fd, addr).map_err(proc_error(pid, "pollfd"))?;
        Ok(i32::from_ne_bytes(fd))
    }

    fn stdin_queued(&self, pid: u32) -> Result<usize, StdinError> {
        use std::os::unix::fs::OpenOptionsExt;
        // Reopening the session's own stdin works for a pipe and a terminal
        // alike, however the shim came by its end.
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(format!("/proc/{pid}/fd/0"));
        let fd: OwnedFd = match opened {
            Ok(f) => f.into(),
            // No stdin at all: nothing can be queued in it.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(proc_error(pid, "stdin")(e)),
        };
        let mut queued: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into `queued`, which we own.
        if unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut queued) } < 0 {
            let e = io::Error::last_os_error();
            // /dev/null and regular files hold no queue.
            if matches!(e.raw_os_error(), Some(libc::ENOTTY) | Some(libc::EINVAL)) {
                return Ok(0);
            }
            return Err(proc_error(pid, "stdin FIONREAD")(e));
        }
        Ok(queued.max(0) as usize)
    }

    fn cgroup_threads(&self, cgroup_dir: &Path) -> Result<Vec<u32>, StdinError> {
        let path = cgroup_dir.join("cgroup.threads");
        let text =
            std::fs::read_to_string(&path).map_err(|source| StdinError::Cgroup { dir: cgroup_dir.into(), source })?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    fn thread_state(&self, tid: u32) -> Option<ThreadState> {
        crab_sys::proc_stat::state(&crab_sys::proc_stat::read(tid).ok()?)
    }
}

/// A byte counter shared by a session's stdin observer and its detector.
#[derive(Debug, Default)]
pub struct ForwardedBytes(AtomicU64);

impl ForwardedBytes {
    pub fn add(&self, n: usize) -> u64 {
        self.0.fetch_add(n as u64, Ordering::SeqCst) + n as u64
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    pub fn counter(&self) -> &AtomicU64 {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    const READ_STDIN: SyscallState = SyscallState::Blocked { nr: libc::SYS_read, args: [0, 0x1000, 128, 0, 0, 0] };

    /// Scripted /proc: each call to `syscall` pops the next state of the session.
    #[derive(Default)]
    struct FakeProc {
        syscalls: Mutex<Vec<SyscallState>>,
        queued: Mutex<usize>,
        threads: Mutex<HashMap<u32, ThreadState>>,
        poll_fds: HashMap<u64, i32>,
    }

    impl FakeProc {
        fn session_then(states: &[SyscallState]) -> Self {
            let mut v = states.to_vec();
            v.reverse();
            Self { syscalls: Mutex::new(v), ..Default::default() }
        }
    }

    impl ProcReader for FakeProc {
        fn syscall(&self, pid: u32) -> Result<SyscallState, StdinError> {
            let mut s = self.syscalls.lock().unwrap();
            if s.len() > 1 {
                Ok(s.pop().unwrap())
            } else {
                s.last().copied().ok_or(StdinError::Malformed { pid, what: "syscall", text: String::new() })
            }
        }
        fn first_poll_fd(&self, pid: u32, addr: u64) -> Result<i32, StdinError> {
            self.poll_fds.get(&addr).copied().ok_or(StdinError::Malformed { pid, what: "pollfd", text: String::new() })
        }
        fn stdin_queued(&self, _pid: u32) -> Result<usize, StdinError> {
            Ok(*self.queued.lock().unwrap())
        }
        fn cgroup_threads(&self, _dir: &Path) -> Result<Vec<u32>, StdinError> {
            Ok(self.threads.lock().unwrap().keys().copied().collect())
        }
        fn thread_state(&self, tid: u32) -> Option<ThreadState> {
            self.threads.lock().unwrap().get(&tid).copied()
        }
    }

    fn blocked(nr: i64, args: [u64; 6]) -> SyscallState {
        SyscallState::Blocked { nr, args }
    }

    #[test]
    fn only_waits_for_fd_zero_count_as_reading_stdin() {
        let no_poll = |_| None;
        assert!(waits_on_stdin(&READ_STDIN, no_poll));
        assert!(!waits_on_stdin(&blocked(libc::SYS_read, [3, 0, 0, 0, 0, 0]), no_poll));
        assert!(waits_on_stdin(&blocked(libc::SYS_readv, [0, 0, 0, 0, 0, 0]), no_poll));
        assert!(waits_on_stdin(&blocked(libc::SYS_pselect6, [1, 0, 0, 0, 0, 0]), no_poll));
        assert!(!waits_on_stdin(&blocked(libc::SYS_pselect6, [5, 0, 0, 0, 0, 0]), no_poll));
        assert!(waits_on_stdin(&blocked(libc::SYS_ppoll, [0x77, 1, 0, 0, 0, 0]), |a| (a == 0x77).then_some(0)));
        assert!(!waits_on_stdin(&blocked(libc::SYS_ppoll, [0x77, 1, 0, 0, 0, 0]), |_| Some(4)));
        assert!(!waits_on_stdin(&blocked(libc::SYS_ppoll, [0x77, 2, 0, 0, 0, 0]), |_| Some(0)));
        assert!(!waits_on_stdin(&blocked(libc::SYS_wait4, [u64::MAX, 0, 0, 0, 0, 0]), no_poll));
        assert!(!waits_on_stdin(&SyscallState::Running, no_poll));
        assert!(!waits_on_stdin(&SyscallState::NotInSyscall, no_poll));
    }

    #[test]
    fn syscall_texts_parse() {
        assert_eq!(parse_syscall(1, "running\n").unwrap(), SyscallState::Running);
        assert_eq!(parse_syscall(1, "-1 0x7ffc 0x7f00\n").unwrap(), SyscallState::NotInSyscall);
        assert_eq!(
            parse_syscall(1, "0 0x0 0x55d0 0x2000 0x0 0x0 0x0 0x7ffc 0x7f12\n").unwrap(),
            blocked(0, [0, 0x55d0, 0x2000, 0, 0, 0])
        );
        let err = parse_syscall(7, "0 0x0 zz").unwrap_err().to_string();
        assert!(err.contains("syscall") && err.contains('7'), "{err}");
    }

    fn sample(waiting: bool, queued: usize, busy: usize, forwarded: u64) -> Sample {
        Sample {
            waiting_on_stdin: waiting,
            stdin_queued: queued,
            busy: (0..busy as u32).map(|t| (t, 'R')).collect(),
            forwarded,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_turn_ends_after_two_idle_samples_in_a_row() {
        let mut d = IdleDetector::new(DetectorConfig::default());
        assert_eq!(d.observe(&sample(false, 0, 1, 10), ms(5)), None);
        assert_eq!(d.observe(&sample(true, 0, 0, 10), ms(10)), None);
        assert_eq!(d.observe(&sample(true, 0, 1, 10), ms(15)), None, "a runnable thread breaks the run");
        assert_eq!(d.observe(&sample(true, 0, 0, 10), ms(20)), None);
        assert_eq!(d.observe(&sample(true, 0, 0, 10), ms(25)), Some(IdleKind::Quiet));
    }

    #[test]
    fn queued_input_or_new_bytes_keep_the_turn_open() {
        let mut d = IdleDetector::new(DetectorConfig::default());
        // Blocked in read() with bytes still queued: the session was not woken yet.
        assert_eq!(d.observe(&sample(true, 12, 0, 10), ms(5)), None);
        assert_eq!(d.observe(&sample(true, 12, 0, 10), ms(10)), None);
        assert_eq!(d.observe(&sample(true, 0, 0, 10), ms(15)), None);
        // More bytes were forwarded between two idle-looking samples: a new burst.
        assert_eq!(d.observe(&sample(true, 0, 0, 20), ms(20)), None);
        assert_eq!(d.observe(&sample(true, 0, 0, 20), ms(25)), Some(IdleKind::Quiet));
    }

    #[test]
    fn a_busy_background_job_ends_the_turn_after_the_grace() {
        let config = DetectorConfig { background_grace: ms(100), ..Default::default() };
        let mut d = IdleDetector::new(config);
        for t in (5..100).step_by(5) {
            assert_eq!(d.observe(&sample(true, 0, 1, 3), ms(t)), None, "at {t} ms");
        }
        assert_eq!(d.observe(&sample(true, 0, 1, 3), ms(105)), Some(IdleKind::BackgroundBusy));
        // The session leaving its read (a new command) restarts the grace.
        let mut d = IdleDetector::new(DetectorConfig { background_grace: ms(100), ..Default::default() });
        assert_eq!(d.observe(&sample(true, 0, 1, 3), ms(5)), None);
        assert_eq!(d.observe(&sample(false, 0, 1, 3), ms(60)), None);
        assert_eq!(d.observe(&sample(true, 0, 1, 3), ms(110)), None);
        assert_eq!(d.observe(&sample(true, 0, 1, 3), ms(215)), Some(IdleKind::BackgroundBusy));
    }

    #[test]
    fn sampling_backs_off_after_the_fast_phase_and_speeds_up_on_input() {
        let mut schedule = SampleSchedule::new(DetectorConfig::default(), ms(0));
        let mut now = ms(0);
        let mut waits = Vec::new();
        for _ in 0..16 {
            let wait = schedule.next_wait(now, false);
            waits.push(wait.as_millis() as u64);
            now += wait;
        }
        assert_eq!(waits, [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 10, 20, 40, 80, 100, 100]);
        // An idle-looking sample is confirmed fast, without losing the back-off.
        assert_eq!(schedule.next_wait(now, true), ms(5));
        assert_eq!(schedule.next_wait(now, false), ms(100));
        schedule.input(now);
        assert_eq!(schedule.next_wait(now + ms(49), false), ms(5));
        assert_eq!(schedule.next_wait(now + ms(50), false), ms(10));
    }

    #[tokio::test]
    async fn a_long_command_is_sampled_ever_more_rarely() {
        // Working for 40 samples, then back at its prompt.
        let mut states = vec![blocked(libc::SYS_wait4, [0; 6]); 40];
        states.push(READ_STDIN);
        let fake = FakeProc::session_then(&states);
        let forwarded = AtomicU64::new(1);
        let config = DetectorConfig { interval: ms(1), fast_for: ms(10), max_interval: ms(20), ..Default::default() };
        let started = std::time::Instant::now();
        let report = wait_until_idle(&fake, 1, Path::new("/x"), &forwarded, &config).await.unwrap();
        assert_eq!(report.samples, 42);
        // At least ~10 fast samples, then 2, 4, 8, 16 and 20 ms waits for the rest.
        assert!(started.elapsed() >= ms(10 + 2 + 4 + 8 + 16 + 20 * 25), "took {:?}", started.elapsed());
    }

    #[test]
    fn samples_read_only_what_they_need() {
        let fake = FakeProc::session_then(&[blocked(libc::SYS_wait4, [0; 6])]);
        fake.threads.lock().unwrap().insert(9, 'R');
        let s = take_sample(&fake, 1, Path::new("/x"), 0).unwrap();
        assert!(!s.waiting_on_stdin && s.busy.is_empty(), "busy threads are not read for a session at work: {s:?}");
        let fake = FakeProc::session_then(&[READ_STDIN]);
        fake.threads.lock().unwrap().extend([(9, 'R'), (10, 'S'), (11, 'D'), (12, 'Z')]);
        let mut s = take_sample(&fake, 1, Path::new("/x"), 0).unwrap();
        s.busy.sort();
        assert_eq!(s.busy, vec![(9, 'R'), (11, 'D')]);
    }

    #[tokio::test]
    async fn waiting_ends_when_the_session_is_back_at_its_prompt() {
        // Working (wait4 on a child), then reading stdin while a child still runs, then quiet.
        let fake =
            FakeProc::session_then(&[blocked(libc::SYS_wait4, [0; 6]), blocked(libc::SYS_wait4, [0; 6]), READ_STDIN]);
        fake.threads.lock().unwrap().insert(50, 'R');
        let forwarded = AtomicU64::new(7);
        let config = DetectorConfig { interval: ms(1), ..Default::default() };
        let wait = wait_until_idle(&fake, 1, Path::new("/x"), &forwarded, &config);
        tokio::pin!(wait);
        // Still busy: the detector must not give up on its own.
        assert!(tokio::time::timeout(ms(30), &mut wait).await.is_err());
        fake.threads.lock().unwrap().insert(50, 'S');
        let report = tokio::time::timeout(ms(500), wait).await.expect("idle is found").unwrap();
        assert_eq!(report.kind, IdleKind::Quiet);
        assert_eq!(report.forwarded, 7);
    }

    #[test]
    fn real_proc_sees_a_child_blocked_on_its_stdin_pipe() {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let mut child = Command::new("cat").stdin(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
        let pid = child.id();
        let reader = ProcFs;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let waits = |r: &ProcFs| waits_on_stdin(&r.syscall(pid).unwrap(), |a| r.first_poll_fd(pid, a).ok());
        while !waits(&reader) {
            assert!(std::time::Instant::now() < deadline, "cat never blocked on its stdin");
            std::thread::sleep(ms(2));
        }
        assert_eq!(reader.stdin_queued(pid).unwrap(), 0);
        // Stop cat so the bytes stay queued, then look.
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGSTOP).unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"hello\n").unwrap();
        assert_eq!(reader.stdin_queued(pid).unwrap(), 6);
        // The stop takes effect once cat has left its read to take the signal.
        while reader.thread_state(pid) != Some('T') {
            assert!(std::time::Instant::now() < deadline, "cat never showed as stopped");
            std::thread::sleep(ms(2));
        }
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGCONT).unwrap();
        drop(stdin);
        child.wait().unwrap();
    }
}
