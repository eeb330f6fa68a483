//! A container managed by the shim: its bundle, rootfs, init and exec
//! processes, driven through the OCI runtime.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::ShimError;
use super::cgroup::Cgroup;
use super::io::{IoOwner, ProcessIo, StdioUris};
use super::process::{Process, Status};
use crate::runtime::{CheckpointOptions, LaunchOptions, OciRuntime, Reaper};

/// Settings fixed at Create.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    pub id: String,
    pub namespace: String,
    pub bundle: PathBuf,
    /// A checkpoint image directory to restore from at Start.
    pub restore_from: Option<PathBuf>,
    pub no_pivot: bool,
    pub no_new_keyring: bool,
    pub io_uid: u32,
    pub io_gid: u32,
}

pub struct Container {
    pub config: ContainerConfig,
    pub runtime: OciRuntime,
    reaper: Reaper,
    pub init: Arc<Process>,
    execs: Mutex<HashMap<String, Arc<Process>>>,
    cgroup: Mutex<Option<Cgroup>>,
    /// Policy kept from Create until a restored init's pid is known at Start.
    pub pending_policy: Mutex<Option<(crate::turns::SandboxPolicy, Option<Arc<crate::engine::EngineContext>>)>>,
    /// Set once the init's pid is known, when the sandbox is checkpointed.
    engine: std::sync::OnceLock<Arc<crate::engine::SandboxEngine>>,
    /// Serialises verbs that change the container as a whole (start, pause,
    /// resume, checkpoint, delete). Exec, kill and queries do not take it.
    lifecycle: tokio::sync::Mutex<()>,
}

impl Container {
    pub fn new(config: ContainerConfig, runtime: OciRuntime, reaper: Reaper, init_uris: StdioUris) -> Arc<Self> {
        Arc::new(Self {
            config,
            runtime,
            reaper,
            init: Process::new("", init_uris, None),
            execs: Mutex::new(HashMap::new()),
            cgroup: Mutex::new(None),
            engine: std::sync::OnceLock::new(),
            pending_policy: Mutex::new(None),
            lifecycle: tokio::sync::Mutex::new(()),
        })
    }

    pub fn engine(&self) -> Option<&Arc<crate::engine::SandboxEngine>> {
        self.engine.get()
    }

    pub fn set_engine(&self, engine: Arc<crate::engine::SandboxEngine>) {
        let _ = self.engine.set(engine);
    }

    pub fn id(&self) -> &str {
        &self.config.id
    }

    /// The shim's own files for this container, inside its bundle.
    pub fn work_dir(&self) -> PathBuf {
        self.config.bundle.join("crab")
    }

    fn owner(&self) -> IoOwner<'_> {
        IoOwner {
            namespace: &self.config.namespace,
            container_id: &self.config.id,
            uid: self.config.io_uid,
            gid: self.config.io_gid,
        }
    }

    pub fn process(&self, exec_id: &str) -> Result<Arc<Process>, ShimError> {
        if exec_id.is_empty() {
            return Ok(self.init.clone());
        }
        self.execs
            .lock()
            .expect("execs lock")
            .get(exec_id)
            .cloned()
            .ok_or_else(|| ShimError::NotFound(format!("exec {exec_id} of container {}", self.config.id)))
    }

    pub fn execs(&self) -> Vec<Arc<Process>> {
        self.execs.lock().expect("execs lock").values().cloned().collect()
    }

    pub fn cgroup(&self) -> Option<Cgroup> {
        self.cgroup.lock().expect("cgroup lock").clone()
    }

    /// Creates the init process (runtime `create`), unless it will be restored at Start.
    pub async fn create(&self) -> Result<u32, ShimError> {
        let dir = self.work_dir();
        tokio::fs::create_dir_all(&dir).await.map_err(|e| ShimError::io(&dir, e))?;
        if self.config.restore_from.is_some() {
            return Ok(0);
        }
        let (io, launch) =
            ProcessIo::prepare(&self.init.uris, &self.owner(), &self.work_dir(), &self.reaper).await?;
        self.init.set_io(io.clone());
        let pid_file = self.work_dir().join("init.pid");
        let console_path = launch.console.as_ref().map(|c| c.path().to_path_buf());
        let master = launch.console.map(|c| tokio::spawn(c.receive_master()));
        let opts = LaunchOptions {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.config.no_pivot,
            no_new_keyring: self.config.no_new_keyring,
            stdio: launch.stdio,
        };
        let created = self.runtime.create(&self.config.id, &self.config.bundle, opts).await;
        finish_console(&io, master, created.is_ok()).await?;
        created?;
        let pid = read_pid(&pid_file).await?;
        // Created is not Running: containerd reports CREATED until Start.
        self.init.set_pid(pid);
        *self.cgroup.lock().expect("cgroup lock") = Cgroup::of_pid(pid).ok();
        Ok(pid)
    }

    /// Starts the init process, or restores it from the checkpoint given at Create.
    pub async fn start(&self) -> Result<u32, ShimError> {
        let _guard = self.lifecycle.lock().await;
        if let Some(image) = &self.config.restore_from {
            return self.restore(image).await;
        }
        if self.init.status() != Status::Created {
            return Err(ShimError::FailedPrecondition(format!("container {} is not in created state", self.id())));
        }
        self.runtime.start(&self.config.id).await?;
        let pid = self.init.pid();
        self.init.set_running(pid);
        Ok(pid)
    }

    async fn restore(&self, image: &Path) -> Result<u32, ShimError> {
        let (io, launch) =
            ProcessIo::prepare(&self.init.uris, &self.owner(), &self.work_dir(), &self.reaper).await?;
        self.init.set_io(io.clone());
        let pid_file = self.work_dir().join("init.pid");
        let console_path = launch.console.as_ref().map(|c| c.path().to_path_buf());
        let master = launch.console.map(|c| tokio::spawn(c.receive_master()));
        let opts = CheckpointOptions {
            image_path: image.to_path_buf(),
            work_path: Some(self.work_dir().join("restore-work")),
            // Restored processes keep their session: a TTY job must come back as one.
            shell_job: self.init.uris.terminal,
            ..Default::default()
        };
        let launch_opts = LaunchOptions {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.config.no_pivot,
            no_new_keyring: self.config.no_new_keyring,
            stdio: launch.stdio,
        };
        let restored = self.runtime.restore(&self.config.id, &self.config.bundle, &opts, launch_opts).await;
        finish_console(&io, master, restored.is_ok()).await?;
        restored?;
        let pid = read_pid(&pid_file).await?;
        // CRIU 4.1 brings the container's loopback back down on this kernel
        // (runc's own restore does the same): a restored server would not be
        // reachable even from inside its sandbox.
        if let Err(e) = loopback_up(pid).await {
            tracing::warn!(container = %self.config.id, error = %e, "loopback of the restored container left down");
        }
        self.init.set_running(pid);
        *self.cgroup.lock().expect("cgroup lock") = Cgroup::of_pid(pid).ok();
        Ok(pid)
    }

    pub fn add_exec(&self, exec_id: &str, uris: StdioUris, spec: Vec<u8>) -> Result<(), ShimError> {
        let mut execs = self.execs.lock().expect("execs lock");
        if execs.contains_key(exec_id) {
            return Err(ShimError::AlreadyExists(format!("exec {exec_id} of container {}", self.id())));
        }
        if self.init.status() == Status::Stopped {
            return Err(ShimError::FailedPrecondition(format!("container {} is stopped", self.id())));
        }
        execs.insert(exec_id.to_string(), Process::new(exec_id, uris, Some(spec)));
        Ok(())
    }

    pub async fn start_exec(&self, process: &Arc<Process>) -> Result<u32, ShimError> {
        if process.status() != Status::Created {
            return Err(ShimError::FailedPrecondition(format!("exec {} already started", process.exec_id)));
        }
        let dir = self.work_dir();
        let spec_path = dir.join(format!("exec-{}.json", process.exec_id));
        tokio::fs::create_dir_all(&dir).await.map_err(|e| ShimError::io(&dir, e))?;
        tokio::fs::write(&spec_path, process.spec.as_deref().unwrap_or_default())
            .await
            .map_err(|e| ShimError::io(&spec_path, e))?;
        let (io, launch) = ProcessIo::prepare(&process.uris, &self.owner(), &dir, &self.reaper).await?;
        process.set_io(io.clone());
        let pid_file = dir.join(format!("exec-{}.pid", process.exec_id));
        let console_path = launch.console.as_ref().map(|c| c.path().to_path_buf());
        let master = launch.console.map(|c| tokio::spawn(c.receive_master()));
        let opts = LaunchOptions {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: false,
            no_new_keyring: false,
            stdio: launch.stdio,
        };
        let started = self.runtime.exec(&self.config.id, &spec_path, opts).await;
        let _ = tokio::fs::remove_file(&spec_path).await;
        finish_console(&io, master, started.is_ok()).await?;
        started?;
        let pid = read_pid(&pid_file).await?;
        process.set_running(pid);
        Ok(pid)
    }

    pub async fn kill(&self, process: &Process, signal: u32, all: bool) -> Result<(), ShimError> {
        let snap = process.snapshot();
        if snap.status == Status::Stopped {
            return Err(ShimError::NotFound(format!("process {} already finished", describe(process))));
        }
        if process.exec_id.is_empty() {
            return Ok(self.runtime.kill(&self.config.id, signal, all).await?);
        }
        if snap.pid == 0 {
            return Err(ShimError::FailedPrecondition(format!("exec {} is not started", process.exec_id)));
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(snap.pid as i32),
            nix::sys::signal::Signal::try_from(signal as i32)
                .map_err(|_| ShimError::InvalidArgument(format!("signal {signal}")))?,
        )
        .map_err(|e| match e {
            nix::errno::Errno::ESRCH => ShimError::NotFound(format!("process {} already finished", describe(process))),
            e => ShimError::Other(format!("kill {}: {e}", snap.pid)),
        })
    }

    /// Removes an exec that has finished or never started.
    pub fn delete_exec(&self, exec_id: &str) -> Result<Arc<Process>, ShimError> {
        let mut execs = self.execs.lock().expect("execs lock");
        let process = execs
            .get(exec_id)
            .cloned()
            .ok_or_else(|| ShimError::NotFound(format!("exec {exec_id} of container {}", self.id())))?;
        if matches!(process.status(), Status::Running | Status::Paused) {
            return Err(ShimError::FailedPrecondition(format!("exec {exec_id} is still running")));
        }
        execs.remove(exec_id);
        if let Some(io) = process.io() {
            io.shutdown();
        }
        process.set_stopped_unstarted();
        Ok(process)
    }

    /// Deletes the container from the runtime and unmounts its rootfs.
    pub async fn delete(&self) -> Result<(), ShimError> {
        // The last turn's checkpoint reads the container's root: let it finish.
        if let Some(engine) = self.engine() {
            engine.settle().await;
        }
        let _guard = self.lifecycle.lock().await;
        if matches!(self.init.status(), Status::Running | Status::Paused) {
            return Err(ShimError::FailedPrecondition(format!("container {} is still running", self.id())));
        }
        match self.runtime.delete(&self.config.id, true).await {
            Ok(()) => {}
            // Never created (restore pending) or already gone: nothing to delete.
            Err(e) if e.to_string().contains("does not exist") || e.to_string().contains("not found") => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(io) = self.init.io() {
            io.shutdown();
        }
        self.init.set_stopped_unstarted();
        unmount_rootfs(&self.config.bundle);
        let _ = tokio::fs::remove_dir_all(self.work_dir()).await;
        Ok(())
    }

    pub async fn pause(&self) -> Result<(), ShimError> {
        let _guard = self.lifecycle.lock().await;
        self.runtime.pause(&self.config.id).await?;
        self.init.set_paused(true);
        Ok(())
    }

    pub async fn resume(&self) -> Result<(), ShimError> {
        let _guard = self.lifecycle.lock().await;
        self.runtime.resume(&self.config.id).await?;
        self.init.set_paused(false);
        Ok(())
    }

    pub async fn checkpoint(&self, opts: &CheckpointOptions) -> Result<(), ShimError> {
        let _guard = self.lifecycle.lock().await;
        // containerd pauses the task around `ctr c checkpoint --task`.
        if !matches!(self.init.status(), Status::Running | Status::Paused) {
            return Err(ShimError::FailedPrecondition(format!("container {} is not running", self.id())));
        }
        Ok(self.runtime.checkpoint(&self.config.id, opts).await?)
    }

    pub async fn update(&self, resources_json: &[u8]) -> Result<(), ShimError> {
        let dir = self.work_dir();
        tokio::fs::create_dir_all(&dir).await.map_err(|e| ShimError::io(&dir, e))?;
        let path = dir.join("resources.json");
        tokio::fs::write(&path, resources_json).await.map_err(|e| ShimError::io(&path, e))?;
        let result = self.runtime.update(&self.config.id, &path).await;
        let _ = tokio::fs::remove_file(&path).await;
        Ok(result?)
    }

    /// Host pids of all the container's processes, with the exec each belongs to.
    pub async fn pids(&self) -> Result<Vec<(u32, Option<String>)>, ShimError> {
        let pids = self.runtime.ps(&self.config.id).await?;
        let execs = self.execs();
        Ok(pids
            .into_iter()
            .map(|pid| (pid, execs.iter().find(|e| e.pid() == pid).map(|e| e.exec_id.clone())))
            .collect())
    }
}

fn describe(process: &Process) -> String {
    if process.exec_id.is_empty() { "init".into() } else { format!("exec {}", process.exec_id) }
}

/// Connects the pty master the runtime sent, or gives up waiting for it when
/// the launch failed (the runtime never connected).
async fn finish_console(
    io: &Arc<ProcessIo>,
    master: Option<tokio::task::JoinHandle<Result<std::os::fd::OwnedFd, super::io::IoError>>>,
    launched: bool,
) -> Result<(), ShimError> {
    let Some(master) = master else { return Ok(()) };
    if !launched {
        master.abort();
        return Ok(());
    }
    let fd = master.await.map_err(|e| ShimError::Other(format!("console: {e}")))??;
    io.attach_console(fd)?;
    Ok(())
}

async fn read_pid(path: &Path) -> Result<u32, ShimError> {
    let text = tokio::fs::read_to_string(path).await.map_err(|e| ShimError::io(path, e))?;
    text.trim().parse().map_err(|_| ShimError::Other(format!("pid file {} holds {:?}", path.display(), text)))
}

/// Sets `lo` up in the network namespace of `pid`, if it is down. The work
/// runs on a thread of its own, which is the only thread that enters the
/// namespace.
async fn loopback_up(pid: u32) -> std::io::Result<()> {
    tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || -> std::io::Result<()> {
            use std::os::fd::AsRawFd;
            let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
            if sock < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(sock) };
            let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
            for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
                *dst = *src as libc::c_char;
            }
            if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let flags = unsafe { req.ifr_ifru.ifru_flags };
            if flags & libc::IFF_UP as libc::c_short == 0 {
                req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
                if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("loopback thread panicked")))
    })
    .await
    .unwrap_or_else(|e| Err(std::io::Error::other(e)))
}

pub fn unmount_rootfs(bundle: &Path) {
    let rootfs = bundle.join("rootfs");
    // Lazily detach everything stacked there; a busy mount still goes away
    // from the namespace, and its last user releases it.
    for _ in 0..16 {
        if nix::mount::umount2(&rootfs, nix::mount::MntFlags::MNT_DETACH).is_err() {
            break;
        }
    }
}
