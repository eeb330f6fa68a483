//! One process of a container (its init, or an exec) and its lifecycle.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::watch;

use super::io::{ProcessIo, StdioUris};
use crab_runtime::Exit;

/// Lifecycle of a process, as containerd's Task API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Created,
    Running,
    Paused,
    Stopped,
}

#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pub status: Status,
    pub pid: u32,
    pub exit: Option<Exit>,
}

pub struct Process {
    /// Empty for the container's init process.
    pub exec_id: String,
    pub uris: StdioUris,
    /// The OCI `Process` of an exec, as JSON.
    pub spec: Option<Vec<u8>>,
    state: Mutex<Snapshot>,
    exited: watch::Sender<Option<Exit>>,
    io: Mutex<Option<Arc<ProcessIo>>>,
    /// Set for an exec the spawner started: signals go through it, so they
    /// cannot reach a process that reused the pid.
    pidfd: Mutex<Option<Arc<std::os::fd::OwnedFd>>>,
}

impl Process {
    pub fn new(exec_id: impl Into<String>, uris: StdioUris, spec: Option<Vec<u8>>) -> Arc<Self> {
        Arc::new(Self {
            exec_id: exec_id.into(),
            uris,
            spec,
            state: Mutex::new(Snapshot { status: Status::Created, pid: 0, exit: None }),
            exited: watch::channel(None).0,
            io: Mutex::new(None),
            pidfd: Mutex::new(None),
        })
    }

    pub fn set_pidfd(&self, pidfd: Arc<std::os::fd::OwnedFd>) {
        *self.pidfd.lock().expect("process lock") = Some(pidfd);
    }

    pub fn pidfd(&self) -> Option<Arc<std::os::fd::OwnedFd>> {
        self.pidfd.lock().expect("process lock").clone()
    }

    pub fn snapshot(&self) -> Snapshot {
        *self.state.lock().expect("process lock")
    }

    pub fn pid(&self) -> u32 {
        self.snapshot().pid
    }

    pub fn status(&self) -> Status {
        self.snapshot().status
    }

    pub fn set_io(&self, io: Arc<ProcessIo>) {
        *self.io.lock().expect("process lock") = Some(io);
    }

    pub fn io(&self) -> Option<Arc<ProcessIo>> {
        self.io.lock().expect("process lock").clone()
    }

    pub fn set_running(&self, pid: u32) {
        let mut s = self.state.lock().expect("process lock");
        // An exit can be reaped before the start path records the pid.
        if s.status != Status::Stopped {
            s.status = Status::Running;
        }
        s.pid = pid;
    }

    pub fn set_pid(&self, pid: u32) {
        self.state.lock().expect("process lock").pid = pid;
    }

    pub fn set_paused(&self, paused: bool) {
        let mut s = self.state.lock().expect("process lock");
        match (s.status, paused) {
            (Status::Running, true) => s.status = Status::Paused,
            (Status::Paused, false) => s.status = Status::Running,
            _ => {}
        }
    }

    /// Records the exit; the first one wins.
    pub fn set_exited(&self, exit: Exit) -> bool {
        {
            let mut s = self.state.lock().expect("process lock");
            if s.exit.is_some() {
                return false;
            }
            s.status = Status::Stopped;
            s.exit = Some(exit);
        }
        self.exited.send_replace(Some(exit));
        true
    }

    /// A process that never started is stopped with no exit status when it
    /// is deleted; containerd's Wait must still return.
    pub fn set_stopped_unstarted(&self) {
        self.set_exited(Exit { pid: 0, status: 0, at: SystemTime::now() });
    }

    pub async fn wait(&self) -> Exit {
        let mut rx = self.exited.subscribe();
        loop {
            if let Some(exit) = *rx.borrow_and_update() {
                return exit;
            }
            if rx.changed().await.is_err() {
                // The sender lives as long as self; unreachable in practice.
                return Exit { pid: 0, status: 255, at: SystemTime::now() };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wait_returns_the_first_exit_to_every_waiter() {
        let p = Process::new("e1", StdioUris::default(), None);
        p.set_running(10);
        let p2 = p.clone();
        let waiter = tokio::spawn(async move { p2.wait().await.status });
        let exit = Exit { pid: 10, status: 3, at: SystemTime::now() };
        assert!(p.set_exited(exit));
        assert!(!p.set_exited(Exit { status: 9, ..exit }));
        assert_eq!(waiter.await.unwrap(), 3);
        assert_eq!(p.wait().await.status, 3);
        assert_eq!(p.status(), Status::Stopped);
    }

    #[test]
    fn exit_reaped_before_start_returns_stays_stopped() {
        let p = Process::new("", StdioUris::default(), None);
        p.set_exited(Exit { pid: 5, status: 0, at: SystemTime::now() });
        p.set_running(5);
        assert_eq!(p.status(), Status::Stopped);
        assert_eq!(p.pid(), 5);
    }

    #[test]
    fn pause_only_applies_to_running() {
        let p = Process::new("", StdioUris::default(), None);
        p.set_paused(true);
        assert_eq!(p.status(), Status::Created);
        p.set_running(1);
        p.set_paused(true);
        assert_eq!(p.status(), Status::Paused);
        p.set_paused(false);
        assert_eq!(p.status(), Status::Running);
    }
}
