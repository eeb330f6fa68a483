//! Stopping and restarting the shared containerd, for the disruptive tests only (they live in their
//! own test binary, and cargo runs test binaries one after the other).

use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::env::TestEnv;
use crate::host;
use crate::{HarnessError, Outcome, wait_until};

const START_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Containerd {
    env: &'static TestEnv,
}

impl Containerd {
    pub fn new(env: &'static TestEnv) -> Outcome<Containerd> {
        if !env.control_script.is_file() {
            return Err(HarnessError::Expectation(format!(
                "cannot restart containerd: control script {} does not exist (set CRAB_CTRD_CONTROL)",
                env.control_script.display()
            )));
        }
        Ok(Containerd { env })
    }

    pub fn pid(&self) -> Outcome<u32> {
        host::unix_listener_pid(&self.env.socket)
    }

    /// SIGKILLs containerd (no chance to clean up, like a crash) and waits until it is gone.
    pub async fn kill(&self) -> Outcome<u32> {
        let pid = self.pid()?;
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL)
            .map_err(|e| HarnessError::io(format!("killing containerd pid {pid}"), e.into()))?;
        wait_until(&format!("containerd pid {pid} to die"), Duration::from_secs(10), || async {
            Ok((!host::process_running(pid)).then_some(()))
        })
        .await?;
        Ok(pid)
    }

    /// Runs `<control script> start` and waits until `ctr version` answers.
    pub async fn start(&self) -> Outcome<()> {
        let script = self.env.control_script.display().to_string();
        let output = tokio::time::timeout(
            START_TIMEOUT,
            tokio::process::Command::new(&script).arg("start").kill_on_drop(true).output(),
        )
        .await
        .map_err(|_| HarnessError::Timeout { what: format!("`{script} start`"), after: START_TIMEOUT })?
        .map_err(|e| HarnessError::io(format!("running `{script} start`"), e))?;
        if !output.status.success() {
            return Err(HarnessError::Expectation(format!(
                "`{script} start` exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        let ctr = self.env.ctr();
        wait_until("containerd to answer after start", START_TIMEOUT, || async {
            Ok(ctr.invoke(["version"]).timeout(Duration::from_secs(5)).success().await.ok().map(|_| ()))
        })
        .await
    }

    fn answers(&self) -> bool {
        self.env.ctr().blocking(["version"], Duration::from_secs(5)).is_ok_and(|o| o.status.success())
    }
}

/// Restarts containerd on drop if it does not answer, so a disruptive test that fails half-way does
/// not leave the rest of the suite without a containerd.
pub struct RestartGuard<'a>(pub &'a Containerd);

impl Drop for RestartGuard<'_> {
    fn drop(&mut self) {
        if self.0.answers() {
            return;
        }
        let status = std::process::Command::new(&self.0.env.control_script).arg("start").status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("could not restart containerd with {}: {status:?}", self.0.env.control_script.display());
        }
    }
}
