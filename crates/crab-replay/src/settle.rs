//! Letting what a turn left running settle before the sandbox is saved and looked at.
//!
//! A turn can leave processes behind: a command stopped at its timeout leaves its
//! children (the SIGKILL reaches the exec's shell, and `pytest ... | tail` goes on
//! collecting), and `cmd &` leaves its job. What such a process has written by the time
//! the sandbox is checkpointed and looked at depends on how long after the turn that is,
//! and the policies take different times there (every-turn's dump about a second, crab's a
//! few milliseconds): a look that raced the process would count a difference of pace as
//! state lost or gained. A replay runs the turns back to back, while the agent it replays
//! gave such a process its think time before the next turn.
//!
//! So after every turn, in every run alike, the replay waits while the sandbox has a
//! process that is running, using CPU, or coming and going, up to that think time (within
//! [`MIN_WAIT`] and [`MAX_WAIT`]). It waits too while a process that a turn's timeout
//! abandoned sleeps on a timer (`nanosleep`): it will go on by itself, as pydicom-1256's
//! `pytest` did, asleep between retries of a download while it collected tests, and wrote
//! two more `.pyc` files whenever a run was slow enough to let it. A turn whose processes
//! were still busy, or whose abandoned ones still slept on a timer, at that bound is
//! *unsettled*, and the oracle does not compare the state after it.
//!
//! Not covered: a job the agent started with `&` that wakes on a timer to write a little
//! (under [`IDLE_CPU`] per [`WINDOW`]) looks settled, as does a process in `poll` with a
//! timeout (every server is); the two reference runs are what catches such state.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::fingerprint::{FingerprintError, pids_of_sandbox};
use crab_sys::proc_stat;

/// How long the sandbox must stay quiet to count as settled.
pub const WINDOW: Duration = Duration::from_millis(100);
/// CPU time the sandbox's processes may use in a [`WINDOW`] and still be quiet.
pub const IDLE_CPU: Duration = Duration::from_millis(2);
/// The least a turn's processes are waited for, whatever the recorded think time (traces
/// without think times record 0): enough for one [`WINDOW`] to show an idle process idle.
pub const MIN_WAIT: Duration = Duration::from_secs(1);
/// The most: a process that keeps working for minutes (a training run in the background)
/// would otherwise make each turn wait the agent's whole think time.
pub const MAX_WAIT: Duration = Duration::from_secs(10);

/// How long to wait at most after a turn, given the agent's recorded think time before the
/// next one (`None` after the last turn: the session ended there, and whatever checks its
/// result, a task's tests, comes right after).
pub fn bound(next_think_s: Option<f64>) -> Duration {
    match next_think_s {
        Some(seconds) if seconds.is_finite() && seconds > 0.0 => {
            Duration::from_secs_f64(seconds.min(MAX_WAIT.as_secs_f64())).max(MIN_WAIT)
        }
        _ => MIN_WAIT,
    }
}

/// The sandbox's live processes at one moment: CPU time used so far per pid, and whether
/// any was running (or in uninterruptible I/O) right then. Zombies are left out: they run
/// nothing, and their parent reaps them at its own pace.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Activity {
    pub cpu_ns: BTreeMap<u32, u64>,
    pub running: bool,
    /// The processes asleep in `nanosleep` or `clock_nanosleep`.
    pub on_timer: BTreeSet<u32>,
}

impl Activity {
    /// Reads `/proc/<pid>/stat` (state) and `/proc/<pid>/schedstat` (CPU time, in ns) of
    /// each process in `init`'s pid namespace. A process that exits meanwhile is not there.
    pub fn sample(init: u32) -> Result<Activity, FingerprintError> {
        let mut activity = Activity::default();
        for pid in pids_of_sandbox(init)? {
            let Ok(stat) = proc_stat::read(pid) else { continue };
            let Some(state) = proc_stat::state(&stat) else { continue };
            if state == 'Z' || state == 'X' {
                continue;
            }
            let Ok(schedstat) = std::fs::read_to_string(format!("/proc/{pid}/schedstat")) else { continue };
            let Some(cpu_ns) = schedstat.split_whitespace().next().and_then(|ns| ns.parse().ok()) else { continue };
            activity.running |= state == 'R' || state == 'D';
            activity.cpu_ns.insert(pid, cpu_ns);
            let syscall = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
            if syscall.split_whitespace().next().is_some_and(|number| TIMED_SLEEPS.contains(&number)) {
                activity.on_timer.insert(pid);
            }
        }
        Ok(activity)
    }

    /// Whether the sandbox was quiet from `earlier` to `self`: the same processes, none
    /// running now, and together under [`IDLE_CPU`] of CPU between the two.
    pub fn quiet_since(&self, earlier: &Activity) -> bool {
        if self.running || !self.cpu_ns.keys().eq(earlier.cpu_ns.keys()) {
            return false;
        }
        let used: u64 =
            self.cpu_ns.iter().map(|(pid, ns)| ns.saturating_sub(earlier.cpu_ns.get(pid).copied().unwrap_or(0))).sum();
        used < IDLE_CPU.as_nanos() as u64
    }
}

/// What settling after one turn came to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settled {
    pub waited: Duration,
    /// false: something was still busy at the bound (the turn is unsettled).
    pub settled: bool,
}

/// `nanosleep` and `clock_nanosleep`, as `/proc/<pid>/syscall` numbers them on this
/// architecture.
#[cfg(target_arch = "x86_64")]
const TIMED_SLEEPS: [&str; 2] = ["35", "230"];
#[cfg(target_arch = "aarch64")]
const TIMED_SLEEPS: [&str; 2] = ["101", "115"];

/// The processes of one sandbox last seen quiet: while a look finds only those (and none
/// running), there is nothing to wait for, so the many turns that leave nothing behind
/// cost two reads of `/proc` and no [`WINDOW`]. And those a turn's timeout abandoned.
#[derive(Debug, Default)]
pub struct Settling {
    quiet: BTreeSet<u32>,
    abandoned: BTreeSet<u32>,
}

impl Settling {
    /// `pids` were left running by a turn stopped at its timeout.
    pub fn abandon(&mut self, pids: impl IntoIterator<Item = u32>) {
        self.abandoned.extend(pids);
    }

    /// Whether a process a timeout abandoned is asleep on a timer in `activity`.
    fn abandoned_on_timer(&self, activity: &Activity) -> bool {
        self.abandoned.iter().any(|pid| activity.on_timer.contains(pid))
    }

    /// Waits, up to `bound`, for the sandbox of `init` to be quiet; `sample` is
    /// [`Activity::sample`] (a seam for the tests). A sandbox that cannot be sampled (its
    /// init is gone) has nothing left to wait for: the look after it says what happened.
    pub async fn settle(
        &mut self,
        bound: Duration,
        mut sample: impl FnMut() -> Result<Activity, FingerprintError>,
    ) -> Settled {
        let started = Instant::now();
        let settled = |settled: bool| Settled { waited: started.elapsed(), settled };
        let Ok(mut last) = sample() else { return settled(true) };
        self.abandoned.retain(|pid| last.cpu_ns.contains_key(pid));
        if !last.running && last.cpu_ns.keys().all(|pid| self.quiet.contains(pid)) && !self.abandoned_on_timer(&last) {
            return settled(true);
        }
        while started.elapsed() + WINDOW <= bound {
            tokio::time::sleep(WINDOW).await;
            let Ok(next) = sample() else { return settled(true) };
            self.abandoned.retain(|pid| next.cpu_ns.contains_key(pid));
            if next.quiet_since(&last) && !self.abandoned_on_timer(&next) {
                self.quiet = next.cpu_ns.keys().copied().collect();
                return settled(true);
            }
            last = next;
        }
        settled(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activity(running: bool, cpu: &[(u32, u64)]) -> Activity {
        Activity { cpu_ns: cpu.iter().copied().collect(), running, on_timer: BTreeSet::new() }
    }

    #[test]
    fn quiet_means_the_same_processes_none_running_and_almost_no_cpu() {
        let before = activity(false, &[(1, 5_000_000), (40, 900_000_000)]);
        assert!(activity(false, &[(1, 5_000_000), (40, 901_000_000)]).quiet_since(&before));
        // Busy: 50 ms of CPU in the window.
        assert!(!activity(false, &[(1, 5_000_000), (40, 950_000_000)]).quiet_since(&before));
        // Running right now.
        assert!(!activity(true, &[(1, 5_000_000), (40, 900_000_000)]).quiet_since(&before));
        // A process came (a loop that forks `sleep`) or went.
        assert!(!activity(false, &[(1, 5_000_000), (40, 900_000_000), (41, 0)]).quiet_since(&before));
        assert!(!activity(false, &[(1, 5_000_000)]).quiet_since(&before));
    }

    #[test]
    fn the_wait_is_the_agent_s_think_time_within_its_bounds() {
        assert_eq!(bound(Some(5.68)), Duration::from_secs_f64(5.68));
        assert_eq!(bound(Some(0.0)), MIN_WAIT);
        assert_eq!(bound(Some(0.2)), MIN_WAIT);
        assert_eq!(bound(Some(300.0)), MAX_WAIT);
        assert_eq!(bound(Some(f64::NAN)), MIN_WAIT);
        assert_eq!(bound(None), MIN_WAIT);
    }

    /// Replays a list of samples, then the last one for ever.
    fn samples(list: Vec<Activity>) -> impl FnMut() -> Result<Activity, FingerprintError> {
        let mut index = 0;
        move || {
            let sample = list[index.min(list.len() - 1)].clone();
            index += 1;
            Ok(sample)
        }
    }

    #[tokio::test]
    async fn a_busy_process_is_waited_for_until_it_is_quiet_and_then_known_quiet() {
        let mut settling = Settling::default();
        let busy = |ns| activity(false, &[(1, 0), (40, ns)]);
        let settled =
            settling.settle(Duration::from_secs(5), samples(vec![busy(0), busy(90_000_000), busy(180_000_000)])).await;
        assert!(settled.settled);
        assert!(settled.waited >= 2 * WINDOW, "{:?}", settled.waited);
        // The same quiet processes after the next turn: no window at all.
        let settled = settling.settle(Duration::from_secs(5), samples(vec![busy(180_000_000)])).await;
        assert!(settled.settled && settled.waited < WINDOW, "{settled:?}");
        // A new one is sampled again.
        let settled = settling
            .settle(Duration::from_secs(5), samples(vec![activity(false, &[(1, 0), (40, 180_000_000), (50, 0)])]))
            .await;
        assert!(settled.settled && settled.waited >= WINDOW, "{settled:?}");
    }

    #[tokio::test]
    async fn an_abandoned_process_asleep_on_a_timer_is_waited_for_and_others_are_not() {
        let asleep =
            |pids: &[u32]| Activity { on_timer: pids.iter().copied().collect(), ..activity(false, &[(1, 0), (40, 0)]) };
        // A job the agent started (`sleep 4321 &`) sleeps on a timer: quiet.
        let mut settling = Settling::default();
        assert!(settling.settle(Duration::from_secs(1), samples(vec![asleep(&[40])])).await.settled);
        // The same process abandoned by a timeout: waited for until the bound...
        settling.abandon([40]);
        let settled = settling.settle(3 * WINDOW, samples(vec![asleep(&[40])])).await;
        assert!(!settled.settled && settled.waited >= 2 * WINDOW, "{settled:?}");
        // ...or until it woke and went quiet.
        let settled =
            settling.settle(Duration::from_secs(5), samples(vec![asleep(&[40]), asleep(&[40]), asleep(&[])])).await;
        assert!(settled.settled && settled.waited >= 2 * WINDOW, "{settled:?}");
        // Once it is gone it is forgotten, and a new process with its pid is not abandoned.
        let gone = activity(false, &[(1, 0)]);
        assert!(settling.settle(Duration::from_secs(1), samples(vec![gone])).await.settled);
        let settled = settling.settle(Duration::from_secs(1), samples(vec![asleep(&[40])])).await;
        assert!(settled.settled && settled.waited < Duration::from_secs(1), "{settled:?}");
    }

    #[tokio::test]
    async fn a_process_still_busy_at_the_bound_leaves_the_turn_unsettled() {
        let mut settling = Settling::default();
        let mut ns = 0;
        let settled = settling
            .settle(Duration::from_secs(1), move || {
                ns += 80_000_000;
                Ok(activity(true, &[(1, 0), (40, ns)]))
            })
            .await;
        assert!(!settled.settled);
        assert!(settled.waited >= Duration::from_secs(1) - WINDOW, "{:?}", settled.waited);
        // Still unknown as quiet: the next turn samples it again.
        let settled = settling.settle(2 * WINDOW, samples(vec![activity(false, &[(1, 0), (40, 0)])])).await;
        assert!(settled.settled && settled.waited >= WINDOW, "{settled:?}");
    }
}
