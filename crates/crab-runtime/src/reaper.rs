//! The shim's single reaper of child processes.
//!
//! The shim is a child subreaper: container processes whose parent (runc)
//! exits are re-parented to it, and it must reap them to learn their exit
//! status. Exactly one place calls `waitpid`, here. Waiters ask for a pid
//! after they learn it; an exit reaped before anyone asked is parked until
//! someone does, so spawning and then registering cannot miss an exit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::sync::oneshot;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub pid: u32,
    /// The exit code, or 128 + the signal number for a killed process.
    pub status: i32,
    pub at: SystemTime,
}

#[derive(Default)]
struct Table {
    waiters: HashMap<u32, Vec<oneshot::Sender<Exit>>>,
    unclaimed: HashMap<u32, (Exit, Instant)>,
}

/// Cheap to clone; all clones share one table.
#[derive(Clone, Default)]
pub struct Reaper {
    table: Arc<Mutex<Table>>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reaper")
    }
}

/// Unclaimed exits are mostly runc's own helper processes nobody waits for;
/// keep them long enough for any late waiter, but do not grow without bound.
const UNCLAIMED_KEEP: Duration = Duration::from_secs(600);
const UNCLAIMED_PRUNE_AT: usize = 4096;

impl Reaper {
    /// Starts reaping on SIGCHLD. Must be called once, from the tokio runtime,
    /// after the process became a subreaper.
    pub fn start(&self) -> std::io::Result<()> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = self.clone();
        tokio::spawn(async move {
            // Reap once up front: a child may have exited before the handler existed.
            loop {
                reaper.reap_all();
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok(())
    }

    /// Waits for `pid` to exit. The pid must be a child (or re-parented
    /// descendant) of this process.
    pub fn wait_for(&self, pid: u32) -> impl std::future::Future<Output = Exit> + Send + 'static {
        let rx = {
            let mut table = self.table.lock().expect("reaper table poisoned");
            match table.unclaimed.remove(&pid) {
                Some((exit, _)) => Err(exit),
                None => {
                    let (tx, rx) = oneshot::channel();
                    table.waiters.entry(pid).or_default().push(tx);
                    Ok(rx)
                }
            }
        };
        async move {
            match rx {
                Err(exit) => exit,
                // The sender lives in the table until the exit is delivered;
                // it is only dropped if the process ends without an exit, which
                // cannot happen, so a closed channel means shutdown.
                Ok(rx) => rx.await.unwrap_or(Exit { pid, status: 255, at: SystemTime::now() }),
            }
        }
    }

    /// Whether someone is waiting for `pid` (used to tell a container process
    /// from an unrelated child).
    pub fn is_awaited(&self, pid: u32) -> bool {
        self.table.lock().expect("reaper table poisoned").waiters.contains_key(&pid)
    }

    fn reap_all(&self) {
        loop {
            let exit = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => {
                    Exit { pid: pid.as_raw() as u32, status: code, at: SystemTime::now() }
                }
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    Exit { pid: pid.as_raw() as u32, status: 128 + sig as i32, at: SystemTime::now() }
                }
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                Ok(_) => continue,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "waitpid failed");
                    return;
                }
            };
            self.deliver(exit);
        }
    }

    fn deliver(&self, exit: Exit) {
        let mut table = self.table.lock().expect("reaper table poisoned");
        match table.waiters.remove(&exit.pid) {
            Some(waiters) => {
                for tx in waiters {
                    let _ = tx.send(exit);
                }
            }
            None => {
                if table.unclaimed.len() >= UNCLAIMED_PRUNE_AT {
                    table.unclaimed.retain(|_, (_, at)| at.elapsed() < UNCLAIMED_KEEP);
                }
                table.unclaimed.insert(exit.pid, (exit, Instant::now()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_before_wait_is_parked_for_the_waiter() {
        let reaper = Reaper::default();
        let exit = Exit { pid: 4242, status: 3, at: SystemTime::now() };
        reaper.deliver(exit);
        let got = tokio::runtime::Runtime::new().unwrap().block_on(reaper.wait_for(4242));
        assert_eq!(got, exit);
        assert!(!reaper.is_awaited(4242));
    }

    #[tokio::test]
    async fn every_waiter_of_a_pid_gets_the_exit() {
        let reaper = Reaper::default();
        let a = reaper.wait_for(77);
        let b = reaper.wait_for(77);
        assert!(reaper.is_awaited(77));
        reaper.deliver(Exit { pid: 77, status: 137, at: SystemTime::now() });
        assert_eq!(a.await.status, 137);
        assert_eq!(b.await.status, 137);
    }
}
