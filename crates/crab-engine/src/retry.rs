//! Bounded retries of a failed process dump. Under load the cgroup v1 freezer sometimes
//! fails to freeze a sandbox (`unable to freeze`) although nothing is wrong with it: the
//! same dump a moment later succeeds. A dump is tried a bounded number of times, with a
//! growing pause between attempts, before the turn's checkpoint is given up and carried
//! into the next turn; the cause of every failed attempt is kept for the turn record.

use std::future::Future;
use std::time::Duration;

/// How often, and with what pauses, an operation is tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all (at least one is made).
    pub attempts: u32,
    /// Pause after the first failure; each later pause doubles it.
    pub first_pause: Duration,
}

/// A process dump: three attempts, 250 ms then 500 ms apart. The next turn waits for
/// this (it waits for the capture), so the bound stays well under a second of pauses.
pub const DUMP_RETRIES: RetryPolicy = RetryPolicy { attempts: 3, first_pause: Duration::from_millis(250) };

impl RetryPolicy {
    /// The pause after failed attempt `attempt` (1-based).
    pub fn pause_after(&self, attempt: u32) -> Duration {
        self.first_pause.saturating_mul(1 << attempt.saturating_sub(1).min(16))
    }
}

/// Runs `attempt(n)` for n = 1, 2, ... until it succeeds, `policy.attempts` were made, or
/// an attempt fails in a way `retryable` says another would not cure (a dump abandoned at its
/// deadline), pausing between attempts. The cause of each failed attempt is pushed onto
/// `failures` (also of the last one, which is returned as well).
pub async fn with_retries<T, E, R, F, Fut>(
    policy: &RetryPolicy,
    failures: &mut Vec<String>,
    retryable: R,
    mut attempt: F,
) -> Result<T, E>
where
    E: std::fmt::Display,
    R: Fn(&E) -> bool,
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let attempts = policy.attempts.max(1);
    let mut n = 1;
    loop {
        match attempt(n).await {
            Ok(value) => return Ok(value),
            Err(e) => {
                failures.push(e.to_string());
                if n >= attempts || !retryable(&e) {
                    return Err(e);
                }
                tokio::time::sleep(policy.pause_after(n)).await;
                n += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A dump double that fails its first `failing` attempts and records when each was made.
    struct RecordingDump {
        failing: u32,
        calls: Arc<Mutex<Vec<(u32, tokio::time::Instant)>>>,
    }

    impl RecordingDump {
        fn new(failing: u32) -> Self {
            Self { failing, calls: Default::default() }
        }

        fn attempt(&self, n: u32) -> impl Future<Output = Result<&'static str, String>> + use<> {
            let (failing, calls) = (self.failing, Arc::clone(&self.calls));
            async move {
                calls.lock().unwrap().push((n, tokio::time::Instant::now()));
                if n <= failing {
                    Err(format!("runc checkpoint failed: unable to freeze (attempt {n})"))
                } else {
                    Ok("dumped")
                }
            }
        }

        fn attempts(&self) -> Vec<u32> {
            self.calls.lock().unwrap().iter().map(|(n, _)| *n).collect()
        }

        fn pauses(&self) -> Vec<Duration> {
            self.calls.lock().unwrap().windows(2).map(|w| w[1].1 - w[0].1).collect()
        }
    }

    fn any(_: &String) -> bool {
        true
    }

    /// DUMP_RETRIES' shape with short pauses: the tests run in real time.
    const QUICK: RetryPolicy = RetryPolicy { attempts: 3, first_pause: Duration::from_millis(20) };

    #[test]
    fn dump_pauses_double_from_a_quarter_second() {
        assert_eq!(DUMP_RETRIES.attempts, 3);
        assert_eq!(DUMP_RETRIES.pause_after(1), Duration::from_millis(250));
        assert_eq!(DUMP_RETRIES.pause_after(2), Duration::from_millis(500));
    }

    #[tokio::test]
    async fn a_dump_that_succeeds_at_once_is_tried_once_and_records_nothing() {
        let dump = RecordingDump::new(0);
        let mut failures = Vec::new();
        assert_eq!(with_retries(&QUICK, &mut failures, any, |n| dump.attempt(n)).await, Ok("dumped"));
        assert_eq!(dump.attempts(), vec![1]);
        assert!(failures.is_empty(), "{failures:?}");
    }

    #[tokio::test]
    async fn a_transient_freeze_failure_is_retried_after_growing_pauses_and_each_cause_kept() {
        let dump = RecordingDump::new(2);
        let mut failures = Vec::new();
        assert_eq!(with_retries(&QUICK, &mut failures, any, |n| dump.attempt(n)).await, Ok("dumped"));
        assert_eq!(dump.attempts(), vec![1, 2, 3]);
        let pauses = dump.pauses();
        assert!(pauses[0] >= QUICK.pause_after(1) && pauses[1] >= QUICK.pause_after(2), "{pauses:?}");
        assert_eq!(
            failures,
            vec![
                "runc checkpoint failed: unable to freeze (attempt 1)",
                "runc checkpoint failed: unable to freeze (attempt 2)"
            ]
        );
    }

    #[tokio::test]
    async fn a_dump_that_keeps_failing_stops_at_the_bound_with_the_last_error() {
        let dump = RecordingDump::new(u32::MAX);
        let mut failures = Vec::new();
        let result = with_retries(&QUICK, &mut failures, any, |n| dump.attempt(n)).await;
        assert_eq!(result, Err("runc checkpoint failed: unable to freeze (attempt 3)".to_string()));
        assert_eq!(dump.attempts(), vec![1, 2, 3], "bounded: three attempts, no more");
        assert_eq!(failures.len(), 3);
        let one = RetryPolicy { attempts: 0, first_pause: Duration::from_secs(1) };
        let dump = RecordingDump::new(u32::MAX);
        assert!(with_retries(&one, &mut Vec::new(), any, |n| dump.attempt(n)).await.is_err());
        assert_eq!(dump.attempts(), vec![1], "at least one attempt, however the policy is set");
    }

    /// A dump abandoned at its deadline is not tried again in its turn: the turn is given up
    /// at once (no pause), with that one cause on record.
    #[tokio::test]
    async fn a_timed_out_dump_is_not_retried() {
        let timed_out = |e: &String| !e.contains("timed out");
        let calls = Arc::new(Mutex::new(0));
        let mut failures = Vec::new();
        let started = tokio::time::Instant::now();
        let slow = RetryPolicy { attempts: 3, first_pause: Duration::from_secs(30) };
        let result: Result<(), String> = with_retries(&slow, &mut failures, timed_out, |n| {
            let calls = Arc::clone(&calls);
            async move {
                *calls.lock().unwrap() += 1;
                Err(format!("runc checkpoint: dump timed out after 500 ms, abandoned (attempt {n})"))
            }
        })
        .await;
        assert_eq!(result.unwrap_err(), "runc checkpoint: dump timed out after 500 ms, abandoned (attempt 1)");
        assert_eq!(*calls.lock().unwrap(), 1);
        assert_eq!(failures.len(), 1);
        assert!(started.elapsed() < Duration::from_secs(5), "no pause after it: {:?}", started.elapsed());

        // A freeze failure first is still retried; the timeout after it ends the turn's tries.
        let mut failures = Vec::new();
        let result: Result<(), String> = with_retries(&QUICK, &mut failures, timed_out, |n| async move {
            Err(if n == 1 { "unable to freeze".to_string() } else { format!("dump timed out (attempt {n})") })
        })
        .await;
        assert_eq!(result.unwrap_err(), "dump timed out (attempt 2)");
        assert_eq!(failures, ["unable to freeze", "dump timed out (attempt 2)"]);
    }
}
