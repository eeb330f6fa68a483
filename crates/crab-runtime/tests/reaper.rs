//! The reaper against real child processes. Its own test binary: the reaper
//! calls waitpid(-1) and would steal the children of tests running beside it.

use std::time::Duration;

use crab_runtime::Reaper;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

// The children are reaped by the reaper under test, not by their `Child` handles.
#[allow(clippy::zombie_processes)]
#[tokio::test]
async fn real_children_are_reaped_with_their_status() {
    let reaper = Reaper::default();
    reaper.start().unwrap();
    let child = std::process::Command::new("sh").args(["-c", "exit 7"]).spawn().unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), reaper.wait_for(child.id())).await.unwrap();
    assert_eq!(exit.status, 7);

    let child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), reaper.wait_for(pid)).await.unwrap();
    assert_eq!(exit.status, 128 + 9);
}
