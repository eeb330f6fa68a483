//! Harness for crab's integration tests: drives a real containerd through the `ctr` CLI so that every
//! scenario can run under `io.containerd.runc.v2` (the reference) and `io.containerd.crab.v2` and the
//! observable results can be compared.
//!
//! Environment:
//! - `CRAB_CTRD_SOCK`: containerd's socket (default `/run/crab-dev/containerd.sock`)
//! - `CRAB_NS`: containerd namespace (default `crab`)
//! - `CRAB_TEST_RUNTIMES`: comma-separated runtimes, `runc`, `crab` or full names (default both)
//! - `CRAB_TEST_IMAGE`: image the scenarios run (default `crab.local/busybox:latest`)
//! - `CRAB_CTRD_CONTROL`: script taking `start`/`stop` for the disruptive tests
//!   (default `scripts/containerd` of this repository)

pub mod api;
pub mod container;
pub mod cri;
pub mod daemon;
pub mod env;
pub mod events;
pub mod host;
pub mod matrix;
pub mod pty;
pub mod remote;
pub mod sandbox;

use std::time::Duration;

pub use container::{Container, TaskInfo};
pub use crab_containerd::{Ctr, CtrError, CtrOutput};
pub use env::{Runtime, TestEnv};
pub use events::{Event, EventStream};
pub use matrix::{across_runtimes, require_same};
pub use pty::PtySession;

/// Everything that can make a scenario fail.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(transparent)]
    Ctr(#[from] CtrError),
    #[error("expectation failed: {0}")]
    Expectation(String),
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot parse {what}: {detail}")]
    Parse { what: String, detail: String },
}

pub type Outcome<T> = Result<T, HarnessError>;

impl HarnessError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        HarnessError::Io { context: context.into(), source }
    }
}

/// Fails the scenario (returns `Err(HarnessError::Expectation)`) when the condition is false, so that
/// the other runtime's run still completes and both results are reported together.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::HarnessError::Expectation(format!($($msg)+)));
        }
    };
}

/// `ensure!` for equality, printing both sides.
#[macro_export]
macro_rules! ensure_eq {
    ($left:expr, $right:expr, $($msg:tt)+) => {{
        let (left, right) = (&$left, &$right);
        if left != right {
            return Err($crate::HarnessError::Expectation(format!(
                "{}: left = {:?}, right = {:?}",
                format!($($msg)+),
                left,
                right
            )));
        }
    }};
}

/// Polls `probe` every 50 ms until it yields `Some`, or fails after `timeout`. Probe errors are
/// remembered and reported if the deadline passes, since they usually explain why nothing came.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> Outcome<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Outcome<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match probe().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last_error = Some(error),
        }
        if tokio::time::Instant::now() >= deadline {
            let what = match last_error {
                Some(error) => format!("{what} (last error: {error})"),
                None => what.to_string(),
            };
            return Err(HarnessError::Timeout { what, after: timeout });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
