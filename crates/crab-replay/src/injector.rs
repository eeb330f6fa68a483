//! The faults themselves, struck on the host: the sandbox's processes, its
//! shim, containerd, crabd, or all containerd knows of the sandbox.
//!
//! Daemons are found by what they serve (the process listening on their
//! socket) and shims by the container they run (the parent of its init), so
//! a fault never hits another instance's daemon or another container's shim.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::Command;
use tracing::{info, warn};

use super::fault::FaultKind;
use super::node::{NodeA, NodeB};
use super::sandbox::{Sandbox, SandboxError, remove_container};
use crab_containerd::{Ctr, CtrError};
use crab_sys::proc_stat;

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error(transparent)]
    Ctr(#[from] CtrError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error("reading {path}: {source}")]
    Proc {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no process listens on {socket} (is {daemon} running?)")]
    NoListener { daemon: &'static str, socket: PathBuf },
    #[error("container {container} has no running task to find its shim by")]
    NoTask { container: String },
    #[error(
        "container {container}: the parent of its init (pid {init}) is pid {parent} ({command:?}), not its containerd shim"
    )]
    NotItsShim { container: String, init: u32, parent: u32, command: String },
    #[error("cannot send SIGKILL to {what} (pid {pid}): {source}")]
    Kill {
        what: String,
        pid: u32,
        #[source]
        source: nix::Error,
    },
    #[error("{what} (pid {pid}) still runs {after:?} after SIGKILL")]
    Survived { what: String, pid: u32, after: Duration },
    #[error(
        "restart-containerd needs the command that starts containerd again (--containerd-start or CRAB_CTRD_START_CMD)"
    )]
    NoStartCommand,
    #[error("containerd start command `{command}` failed ({status}): {stderr}")]
    StartFailed { command: String, status: String, stderr: String },
    #[error("containerd at {socket} does not answer {after:?} after `{command}`")]
    NotAnswering { socket: PathBuf, command: String, after: Duration },
    #[error("containerd still reports the task of {container} as {status} {after:?} after the fault")]
    TaskStillRunning { container: String, status: String, after: Duration },
    #[error("containerd still knows container {container} after node loss")]
    StillKnown { container: String },
    #[error(
        "node-loss needs node B (--node-b-socket and --node-b-config, or CRAB_REPLAY_NODE_B_SOCK and CRAB_REPLAY_NODE_B_CONFIG) and the command that starts node A's containerd again (--containerd-start); containerd-state-loss is the fault that stays on one node"
    )]
    NoNodeB,
    #[error("deleting node A's {path}: {source}")]
    Delete {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How the replay reaches the daemons its faults strike.
#[derive(Debug, Clone, Default)]
pub struct Daemons {
    /// Shell command (`sh -c`) that starts the killed containerd again, with
    /// the same socket and state (`scripts/containerd start` for the private one).
    pub containerd_start: Option<String>,
    /// crabd's socket: `node.socket` of crab's configuration.
    pub crabd_socket: PathBuf,
    /// Where node-loss brings the sandbox back.
    pub node_b: Option<NodeB>,
}

impl Daemons {
    /// The start command from `CRAB_CTRD_START_CMD` and crabd's socket from
    /// crab's configuration (`CRAB_CONFIG`, else /etc/crab/crab.toml, else the default).
    pub fn from_env() -> Daemons {
        let containerd_start = std::env::var("CRAB_CTRD_START_CMD").ok().filter(|c| !c.trim().is_empty());
        let crabd_socket = crab_config::Config::load(None)
            .map(|config| config.node.socket)
            .unwrap_or_else(|_| crab_config::DEFAULT_NODE_SOCKET.into());
        Daemons { containerd_start, crabd_socket, node_b: None }
    }
}

/// What a fault did.
#[derive(Debug, Clone)]
pub struct Injected {
    /// For the report: which process got which signal, how long a restart took.
    pub detail: String,
    /// containerd still reports the sandbox's task running: nothing is lost
    /// and the policy has nothing to recover.
    pub task_running: bool,
}

/// How long containerd may take to notice a dead shim or a killed init.
const SETTLE: Duration = Duration::from_secs(30);
/// How long a SIGKILLed process may take to go away.
const DEATH: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);

pub struct FaultInjector {
    ctr: Ctr,
    daemons: Daemons,
}

impl FaultInjector {
    pub fn new(ctr: Ctr, daemons: Daemons) -> FaultInjector {
        FaultInjector { ctr, daemons }
    }

    /// Fails early, before any sandbox runs, when `kind` cannot be struck here.
    pub fn check(&self, kind: FaultKind) -> Result<(), InjectError> {
        match kind {
            FaultKind::RestartContainerd if self.daemons.containerd_start.is_none() => Err(InjectError::NoStartCommand),
            FaultKind::NodeLoss if self.daemons.node_b.is_none() || self.daemons.containerd_start.is_none() => {
                Err(InjectError::NoNodeB)
            }
            _ => Ok(()),
        }
    }

    pub async fn inject(&self, kind: FaultKind, sandbox: &Sandbox) -> Result<Injected, InjectError> {
        let container = sandbox.id();
        let injected = match kind {
            FaultKind::None => Injected { detail: "no fault".into(), task_running: true },
            FaultKind::KillProcesses => {
                sandbox.kill_all().await?;
                self.wait_task_down(container).await?;
                Injected { detail: "SIGKILL to every process of the container".into(), task_running: false }
            }
            FaultKind::KillShim => {
                let shim = self.shim_of(container).await?;
                let bundle = bundle_of(shim, container)?;
                kill_and_wait(shim, "the container's shim").await?;
                self.wait_task_gone(container, &bundle).await?;
                Injected { detail: format!("SIGKILL to its shim (pid {shim})"), task_running: false }
            }
            FaultKind::RestartContainerd => self.restart_containerd(container).await?,
            FaultKind::KillCrabd => {
                let socket = self.daemons.crabd_socket.display();
                let detail = match listener_pid("crabd", &self.daemons.crabd_socket) {
                    Ok(crabd) => {
                        kill_and_wait(crabd, "crabd").await?;
                        format!("SIGKILL to crabd (pid {crabd}, {socket})")
                    }
                    // Sandboxes whose shim saves nothing never start crabd: the fault has nothing to hit.
                    Err(InjectError::NoListener { .. }) => format!("no crabd listened on {socket}: nothing to kill"),
                    Err(error) => return Err(error),
                };
                Injected { detail, task_running: self.task_status(container).await?.is_some_and(|s| s == "RUNNING") }
            }
            FaultKind::ContainerdStateLoss => self.forget_container(container).await?,
            FaultKind::NodeLoss => self.lose_node(sandbox).await?,
        };
        info!(container, fault = %kind, detail = %injected.detail, task_running = injected.task_running, "fault injected");
        Ok(injected)
    }

    /// Kills what ran (processes, then shim) and makes containerd forget the
    /// container and its rw snapshot, as a replacement node's containerd
    /// would not know it. What lies outside containerd (crab's store) stays.
    async fn forget_container(&self, container: &str) -> Result<Injected, InjectError> {
        let shim = self.shim_of(container).await?;
        let bundle = bundle_of(shim, container)?;
        self.ctr.run(&["tasks", "kill", "--all", "--signal", "SIGKILL", container]).await?;
        kill_and_wait(shim, "the container's shim").await?;
        self.wait_task_gone(container, &bundle).await?;
        remove_container(&self.ctr, container).await?;
        if self.ctr.run(&["containers", "info", container]).await.is_ok() {
            return Err(InjectError::StillKnown { container: container.into() });
        }
        Ok(Injected {
            detail: format!(
                "SIGKILL to the container's processes and its shim (pid {shim}); container and snapshot deleted from containerd"
            ),
            task_running: false,
        })
    }

    /// Node A is gone: the sandbox's processes and shim, then crabd and containerd, die; the
    /// sandbox's store, kept images and runc root (its own crab config's, see
    /// [`crate::node::NodeA`]) are deleted. containerd is started again as the node's
    /// replacement would be: with the images a node pulls, without the sandbox (its container
    /// and snapshot are deleted). Recovery is node B's.
    async fn lose_node(&self, sandbox: &Sandbox) -> Result<Injected, InjectError> {
        let container = sandbox.id();
        let command = self.daemons.containerd_start.clone().ok_or(InjectError::NoNodeB)?;
        let forgotten = self.forget_container(container).await?;
        let mut killed = Vec::new();
        match listener_pid("crabd", &self.daemons.crabd_socket) {
            Ok(crabd) => {
                kill_and_wait(crabd, "crabd").await?;
                killed.push(format!("crabd (pid {crabd})"));
            }
            Err(InjectError::NoListener { .. }) => {}
            Err(error) => return Err(error),
        }
        let containerd = listener_pid("containerd", self.ctr.socket())?;
        kill_and_wait(containerd, "containerd").await?;
        killed.push(format!("containerd (pid {containerd})"));
        let mut deleted = Vec::new();
        if let Some(config) = &sandbox.spec().runtime_config {
            let node_a = NodeA::load(config).map_err(|error| InjectError::Delete {
                path: config.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, error.to_string()),
            })?;
            for dir in node_a.directories() {
                match std::fs::remove_dir_all(dir) {
                    Ok(()) => deleted.push(dir.display().to_string()),
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => return Err(InjectError::Delete { path: dir.to_path_buf(), source }),
                }
            }
        }
        let restart_s = self.start_containerd(&command).await?;
        if self.ctr.run(&["containers", "info", container]).await.is_ok() {
            return Err(InjectError::StillKnown { container: container.into() });
        }
        let deleted = if deleted.is_empty() { "nothing of crab's".to_string() } else { deleted.join(", ") };
        Ok(Injected {
            detail: format!(
                "node A lost: {}; then SIGKILL to {}; deleted {deleted}; containerd started again in {restart_s:.2} s without the sandbox",
                forgotten.detail,
                killed.join(", ")
            ),
            task_running: false,
        })
    }

    /// Runs `command` and waits until containerd answers; returns the seconds it took.
    async fn start_containerd(&self, command: &str) -> Result<f64, InjectError> {
        let socket = self.ctr.socket().to_path_buf();
        let started = Instant::now();
        let output =
            Command::new("sh").arg("-c").arg(command).stdin(std::process::Stdio::null()).output().await.map_err(
                |e| InjectError::StartFailed {
                    command: command.to_string(),
                    status: "not started".into(),
                    stderr: e.to_string(),
                },
            )?;
        // What counts is containerd serving again: a start script can give up
        // on a daemon that comes up after all (seen under heavy load).
        while self.ctr.run(&["version"]).await.is_err() {
            if started.elapsed() > SETTLE {
                if !output.status.success() {
                    return Err(InjectError::StartFailed {
                        command: command.to_string(),
                        status: output.status.to_string(),
                        stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
                    });
                }
                return Err(InjectError::NotAnswering { socket, command: command.to_string(), after: SETTLE });
            }
            tokio::time::sleep(POLL).await;
        }
        if !output.status.success() {
            warn!(%command, status = %output.status, "the start command failed, yet containerd answers");
        }
        Ok(started.elapsed().as_secs_f64())
    }

    async fn restart_containerd(&self, container: &str) -> Result<Injected, InjectError> {
        let command = self.daemons.containerd_start.clone().ok_or(InjectError::NoStartCommand)?;
        let containerd = listener_pid("containerd", self.ctr.socket())?;
        kill_and_wait(containerd, "containerd").await?;
        let restart_s = self.start_containerd(&command).await?;
        let status = self.task_status(container).await?;
        Ok(Injected {
            detail: format!(
                "SIGKILL to containerd (pid {containerd}), started again in {restart_s:.2} s; task {}",
                status.as_deref().unwrap_or("gone")
            ),
            task_running: status.is_some_and(|s| s == "RUNNING"),
        })
    }

    /// The shim serving `container`: the parent of the task's init, since
    /// the shim is the subreaper its runtime leaves the init with.
    async fn shim_of(&self, container: &str) -> Result<u32, InjectError> {
        let listing = self.ctr.run(&["tasks", "ls"]).await?.stdout_text();
        let (init, _) =
            task_entry(&listing, container).ok_or_else(|| InjectError::NoTask { container: container.into() })?;
        let stat_path = proc_stat::path(init);
        let stat = proc_stat::read(init).map_err(|source| InjectError::Proc { path: stat_path.clone(), source })?;
        let parent = proc_stat::parent(&stat).ok_or_else(|| InjectError::Proc {
            path: stat_path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "no parent pid in it"),
        })?;
        let cmdline = std::fs::read(format!("/proc/{parent}/cmdline")).unwrap_or_default();
        if !is_shim_of(&cmdline, container) {
            return Err(InjectError::NotItsShim {
                container: container.into(),
                init,
                parent,
                command: String::from_utf8_lossy(&cmdline).replace('\0', " ").trim().to_string(),
            });
        }
        Ok(parent)
    }

    /// The task's status as `ctr tasks ls` shows it, `None` when it has none.
    async fn task_status(&self, container: &str) -> Result<Option<String>, InjectError> {
        let listing = self.ctr.run(&["tasks", "ls"]).await?.stdout_text();
        Ok(task_entry(&listing, container).map(|(_, status)| status))
    }

    /// Waits until containerd no longer reports the task running.
    async fn wait_task_down(&self, container: &str) -> Result<(), InjectError> {
        self.wait_task(container, |status| !matches!(status, Some("RUNNING" | "PAUSING"))).await
    }

    /// Waits until containerd dropped the task of a dead shim: until then a
    /// new task under the same id is refused ("already exists"). `tasks ls`
    /// (and `tasks ps`) stop showing the task as soon as its shim stops
    /// answering, but containerd lets it go only after running the shim's
    /// `delete` (seconds under load), and it removes the task's `bundle`
    /// directory right before it does: so the bundle's disappearance is
    /// what is waited for.
    async fn wait_task_gone(&self, container: &str, bundle: &Path) -> Result<(), InjectError> {
        self.wait_task(container, |status| status.is_none()).await?;
        let started = Instant::now();
        while bundle.exists() {
            if started.elapsed() > SETTLE {
                return Err(InjectError::TaskStillRunning {
                    container: container.into(),
                    status: format!("not yet released (its bundle {} is still there)", bundle.display()),
                    after: SETTLE,
                });
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    async fn wait_task(&self, container: &str, settled: impl Fn(Option<&str>) -> bool) -> Result<(), InjectError> {
        let started = Instant::now();
        loop {
            let status = self.task_status(container).await?;
            if settled(status.as_deref()) {
                return Ok(());
            }
            if started.elapsed() > SETTLE {
                let status = status.unwrap_or_else(|| "gone".into());
                return Err(InjectError::TaskStillRunning { container: container.into(), status, after: SETTLE });
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// The task's bundle directory: containerd starts each shim in it, and it
/// is named after the container.
fn bundle_of(shim: u32, container: &str) -> Result<PathBuf, InjectError> {
    let cwd = PathBuf::from(format!("/proc/{shim}/cwd"));
    let bundle = std::fs::read_link(&cwd).map_err(|source| InjectError::Proc { path: cwd.clone(), source })?;
    if bundle.file_name().is_none_or(|name| name != container) {
        return Err(InjectError::Proc {
            path: cwd,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the shim runs in {}, not in a bundle named {container}", bundle.display()),
            ),
        });
    }
    Ok(bundle)
}

fn read_proc(path: &Path) -> Result<String, InjectError> {
    std::fs::read_to_string(path).map_err(|source| InjectError::Proc { path: path.to_path_buf(), source })
}

/// SIGKILLs `pid` and waits until it is gone (or a zombie nobody reaped yet).
async fn kill_and_wait(pid: u32, what: &str) -> Result<(), InjectError> {
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).map_err(|source| InjectError::Kill {
        what: what.into(),
        pid,
        source,
    })?;
    let started = Instant::now();
    while is_alive(pid) {
        if started.elapsed() > DEATH {
            return Err(InjectError::Survived { what: what.into(), pid, after: DEATH });
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(())
}

fn is_alive(pid: u32) -> bool {
    proc_stat::read(pid).is_ok_and(|stat| proc_stat::state(&stat).is_some_and(|state| state != 'Z' && state != 'X'))
}

/// The pid of the process that listens on the Unix socket `socket` (a daemon by what it
/// serves: its command line may not name the socket).
pub fn listener_pid(daemon: &'static str, socket: &Path) -> Result<u32, InjectError> {
    let no_listener = || InjectError::NoListener { daemon, socket: socket.to_path_buf() };
    let table = read_proc(Path::new("/proc/net/unix"))?;
    let inodes = listening_inodes(&table, socket);
    if inodes.is_empty() {
        return Err(no_listener());
    }
    let processes = std::fs::read_dir("/proc").map_err(|source| InjectError::Proc { path: "/proc".into(), source })?;
    for entry in processes.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        // Processes come and go while we look: an unreadable one is not ours.
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else { continue };
            if target.to_str().and_then(socket_inode).is_some_and(|inode| inodes.contains(&inode)) {
                return Ok(pid);
            }
        }
    }
    Err(no_listener())
}

/// Inodes of the listening sockets bound to `path` in a `/proc/net/unix` table.
pub fn listening_inodes(table: &str, path: &Path) -> Vec<u64> {
    const ACCEPTING: u32 = 0x0001_0000;
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode Path
            let columns: Vec<&str> = line.split_whitespace().collect();
            let flags = u32::from_str_radix(columns.get(3)?, 16).ok()?;
            let inode = columns.get(6)?.parse().ok()?;
            let bound = columns.get(7).map(Path::new)?;
            (flags & ACCEPTING != 0 && bound == path).then_some(inode)
        })
        .collect()
}

/// The inode of an fd link such as `socket:[12345]`.
pub fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// Whether a NUL-separated command line is a containerd shim serving
/// `container` (`containerd-shim-<runtime> ... -id <container> ...`).
pub fn is_shim_of(cmdline: &[u8], container: &str) -> bool {
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
    let Some(program) = args.first() else { return false };
    let name = program.rsplit(|b| *b == b'/').next().unwrap_or(program);
    name.starts_with(b"containerd-shim")
        && args.windows(2).any(|pair| pair[0] == b"-id" && pair[1] == container.as_bytes())
}

/// The init pid and status of `container` in a `ctr tasks ls` listing.
pub fn task_entry(listing: &str, container: &str) -> Option<(u32, String)> {
    listing.lines().skip(1).find_map(|line| {
        let mut columns = line.split_whitespace();
        (columns.next()? == container).then_some(())?;
        let pid = columns.next()?.parse().ok()?;
        Some((pid, columns.next()?.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_is_the_shims_working_directory_named_after_the_container() {
        // This test process stands in for a shim: its working directory is the "bundle".
        let cwd = std::env::current_dir().unwrap();
        let name = cwd.file_name().unwrap().to_str().unwrap().to_string();
        assert_eq!(bundle_of(std::process::id(), &name).unwrap(), cwd);
        let error = bundle_of(std::process::id(), "another-container").unwrap_err().to_string();
        assert!(error.contains("not in a bundle named another-container"), "{error}");
    }

    const UNIX_TABLE: &str = "Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 41230 /run/crab-a/containerd.sock
0000000000000000: 00000003 00000000 00000000 0001 03 41240 /run/crab-a/containerd.sock
0000000000000000: 00000002 00000000 00010000 0001 01 41250 /run/crab-b/containerd.sock
0000000000000000: 00000002 00000000 00010000 0001 01 41260 @/containerd-shim/abc.sock
0000000000000000: 00000003 00000000 00000000 0001 03 41270
";

    #[test]
    fn only_the_listener_on_exactly_that_path_counts() {
        assert_eq!(listening_inodes(UNIX_TABLE, Path::new("/run/crab-a/containerd.sock")), [41230]);
        assert_eq!(listening_inodes(UNIX_TABLE, Path::new("/run/crab-b/containerd.sock")), [41250]);
        assert!(listening_inodes(UNIX_TABLE, Path::new("/run/crab-a")).is_empty());
        assert!(listening_inodes(UNIX_TABLE, Path::new("/run/crab-c/containerd.sock")).is_empty());
    }

    #[test]
    fn socket_links_give_inodes() {
        assert_eq!(socket_inode("socket:[41230]"), Some(41230));
        assert_eq!(socket_inode("pipe:[41230]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
        assert_eq!(socket_inode("socket:[x]"), None);
    }

    #[test]
    fn a_shim_is_recognised_by_program_and_container() {
        let shim = b"/usr/bin/containerd-shim-runc-v2\0-namespace\0crab\0-id\0sbx-1\0-address\0/run/c.sock\0";
        assert!(is_shim_of(shim, "sbx-1"));
        assert!(!is_shim_of(shim, "sbx-10"), "another container's shim");
        let crab = b"/work/t/release/containerd-shim-crab-v2\0-namespace\0crab\0-id\0sbx-2\0";
        assert!(is_shim_of(crab, "sbx-2"));
        assert!(!is_shim_of(b"/usr/bin/bash\0-id\0sbx-1\0", "sbx-1"), "not a shim");
        assert!(!is_shim_of(b"", "sbx-1"));
    }

    #[test]
    fn task_listing() {
        let listing = "TASK          PID      STATUS\nsbx-1         31337    RUNNING\nsbx-10        4        STOPPED\n";
        assert_eq!(task_entry(listing, "sbx-1"), Some((31337, "RUNNING".to_string())));
        assert_eq!(task_entry(listing, "sbx-10"), Some((4, "STOPPED".to_string())));
        assert_eq!(task_entry(listing, "sbx"), None);
        assert_eq!(task_entry("TASK PID STATUS\n", "sbx-1"), None);
    }

    #[test]
    fn restart_without_a_start_command_is_refused_up_front() {
        let injector = FaultInjector::new(Ctr::new("/nonexistent.sock", "crab"), Daemons::default());
        let error = injector.check(FaultKind::RestartContainerd).unwrap_err().to_string();
        assert!(error.contains("--containerd-start") && error.contains("CRAB_CTRD_START_CMD"), "{error}");
        assert!(injector.check(FaultKind::KillShim).is_ok());
    }
}
