//! A container managed by the shim: its bundle, rootfs, init and exec
//! processes, driven through the OCI runtime.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::ShimError;
use super::cgroup::Cgroup;
use super::io::{IoOwner, ParentEnds, ProcessIo, StdioUris};
use super::process::{Process, Status};
use crab_engine::shell::ShellState;
use crab_runtime::spawner::{SpawnerClient, SpawnerError};
use crab_runtime::{CheckpointOptions, DumpDeadline, Exit, LaunchOptions, OciRuntime, Reaper, RuntimeError};

/// The engine context of a sandbox being set up in the background (crabd's
/// connection, or the inspector's BPF programs when there is no crabd).
pub type EngineLoad = tokio::task::JoinHandle<Result<Arc<crab_engine::EngineContext>, ShimError>>;

/// How a started process's exit will be learned.
pub type ExitFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Exit> + Send>>;

/// How long after the init starts the spawner may take to listen.
const SPAWNER_CONNECT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);
/// Rounds (each up to the patience above, or 50 ms while the container is
/// paused) to get the spawner back after a dump.
const SPAWNER_RECONNECT_ATTEMPTS: usize = 600;

/// Settings fixed at Create.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    pub id: String,
    pub namespace: String,
    pub bundle: PathBuf,
    /// A checkpoint image directory to restore from at Start.
    pub restore_from: Option<PathBuf>,
    /// The directory is crab's own (made from the store at Create): removed once restored.
    pub restore_images_owned: bool,
    pub no_pivot: bool,
    pub no_new_keyring: bool,
    pub io_uid: u32,
    pub io_gid: u32,
    /// crab-init to put in front of the entrypoint when enabled and usable; else why not.
    pub init_binary: Result<PathBuf, String>,
    /// The bound on any dump of this container (`[checkpoint] dump_timeout_ms`).
    pub dump_timeout: std::time::Duration,
    /// Shell sessions the restore brings back from older process images, and the state to
    /// bring each to when it is re-attached (see `crab_engine::shell`).
    pub restore_shells: Vec<crab_store::ShellRestore>,
}

type Execs = Arc<Mutex<HashMap<String, Arc<Process>>>>;

/// The container's spawner, when crab-init runs in it.
struct SpawnerSlot {
    client: Arc<SpawnerClient>,
    /// [`crab_runtime::init::process_identity`] of the init: execs that
    /// differ (another user, capabilities...) go through the runtime.
    init_identity: serde_json::Value,
    /// One connect at a time; also orders the adoption of restored sessions
    /// before any Exec can look for them. Held across a dump and a pause, so
    /// no connection (a lazy one for an Exec, a reconnect after the previous
    /// dump) lands while CRIU or the freezer has the container.
    connecting: Arc<tokio::sync::Mutex<()>>,
    /// Restored from a checkpoint: list the sessions once connected.
    adopt: std::sync::atomic::AtomicBool,
}

pub struct Container {
    pub config: ContainerConfig,
    pub runtime: OciRuntime,
    reaper: Reaper,
    pub init: Arc<Process>,
    execs: Execs,
    spawner: std::sync::OnceLock<Arc<SpawnerSlot>>,
    /// Why the container has no spawner (set at Create when it has none).
    no_spawner: std::sync::OnceLock<String>,
    cgroup: Mutex<Option<Cgroup>>,
    /// Policy kept from Create until a restored init's pid is known at Start,
    /// with the engine context being set up meanwhile (None: policy off).
    pub pending_policy: Mutex<Option<(crab_store::turns::SandboxPolicy, Option<EngineLoad>)>>,
    /// A restored container's tmpfs content, written once the runtime restored it at Start.
    pub pending_mounts: Mutex<Option<super::service::PendingMounts>>,
    /// Set once the init's pid is known, when the sandbox is checkpointed.
    engine: std::sync::OnceLock<Arc<crab_engine::SandboxEngine>>,
    /// Whether the engine question is settled: `Some(Ok)` once the engine is
    /// attached (or the sandbox has none), `Some(Err)` when attaching failed.
    /// A restored container attaches after Start has replied; until then
    /// execs, marks and Delete wait here, so no turn runs unrecorded.
    engine_settled: tokio::sync::watch::Sender<Option<Result<(), String>>>,
    /// Serialises verbs that change the container as a whole (start, pause,
    /// resume, checkpoint, delete). Exec, kill and queries do not take it.
    lifecycle: tokio::sync::Mutex<()>,
    /// The spec names crab's CRIU config (set at Create).
    criu_config_ours: AtomicBool,
}

impl Container {
    pub fn new(config: ContainerConfig, runtime: OciRuntime, reaper: Reaper, init_uris: StdioUris) -> Arc<Self> {
        Arc::new(Self {
            config,
            runtime,
            reaper,
            init: Process::new("", init_uris, None),
            execs: Default::default(),
            spawner: std::sync::OnceLock::new(),
            no_spawner: std::sync::OnceLock::new(),
            cgroup: Mutex::new(None),
            engine: std::sync::OnceLock::new(),
            pending_policy: Mutex::new(None),
            pending_mounts: Mutex::new(None),
            engine_settled: tokio::sync::watch::channel(Some(Ok(()))).0,
            lifecycle: tokio::sync::Mutex::new(()),
            criu_config_ours: AtomicBool::new(false),
        })
    }

    pub fn engine(&self) -> Option<&Arc<crab_engine::SandboxEngine>> {
        self.engine.get()
    }

    pub fn set_engine(&self, engine: Arc<crab_engine::SandboxEngine>) {
        let _ = self.engine.set(engine);
    }

    /// The engine will be attached later (a restore, after Start replied):
    /// [`Self::settled_engine`] waits until [`Self::engine_settled`].
    pub fn engine_pending(&self) {
        self.engine_settled.send_replace(None);
    }

    /// The engine is attached, or failed to attach (`Err` with the reason).
    pub fn engine_settled(&self, outcome: Result<(), String>) {
        self.engine_settled.send_replace(Some(outcome));
    }

    /// The engine once its attach is settled; an error when it failed, so
    /// that no turn runs unrecorded in a sandbox that asked for checkpoints.
    pub async fn settled_engine(&self) -> Result<Option<&Arc<crab_engine::SandboxEngine>>, ShimError> {
        let mut settled = self.engine_settled.subscribe();
        let outcome = settled.wait_for(Option::is_some).await.map(|o| o.clone()).ok().flatten();
        match outcome {
            Some(Err(e)) => Err(ShimError::FailedPrecondition(format!(
                "container {}: checkpoint engine not attached after the restore: {e}",
                self.id()
            ))),
            _ => Ok(self.engine()),
        }
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

    /// Puts crab-init in front of the entrypoint (a restore needs the same
    /// mounts as the dump had, so restoring creates do it too).
    fn install_init(&self) -> Result<(), ShimError> {
        let init = match &self.config.init_binary {
            Ok(init) => init,
            Err(reason) => {
                let _ = self.no_spawner.set(reason.clone());
                return Ok(());
            }
        };
        let restoring = self.config.restore_from.is_some();
        match crab_runtime::init::install(&self.config.bundle, init, !restoring) {
            Ok(Some(installed)) => {
                let client = SpawnerClient::new(init);
                client.set_key(self.spawner_key()?);
                let slot = Arc::new(SpawnerSlot {
                    client: client.clone(),
                    init_identity: installed.identity,
                    connecting: Default::default(),
                    adopt: restoring.into(),
                });
                self.runtime.add_dump_hooks(Arc::new(QuiesceForDump {
                    slot: slot.clone(),
                    execs: self.execs.clone(),
                    init: self.init.clone(),
                    init_digest: crab_runtime::init::pinned_digest(init).map(String::from),
                    no_connect: Default::default(),
                }));
                let _ = self.spawner.set(slot);
                Ok(())
            }
            Ok(None) => {
                tracing::info!(container = %self.id(), "no tmpfs at /dev in the spec: execs go through the runtime");
                let _ =
                    self.no_spawner.set("no crab-init spawner: the spec has no tmpfs at /dev for /dev/.crab".into());
                Ok(())
            }
            Err(crab_runtime::init::InitError::Entrypoint(message)) => Err(RuntimeError::Failed {
                binary: self.runtime.binary_name(),
                verb: "create".into(),
                status: 1,
                message,
            }
            .into()),
            Err(e) => {
                tracing::warn!(container = %self.id(), error = %e, "crab-init not installed: execs go through the runtime");
                let _ =
                    self.no_spawner.set(format!("no crab-init spawner: crab-init not installed in the bundle: {e}"));
                Ok(())
            }
        }
    }

    /// The key of the container's spawner: the one its checkpoint recorded when it is restored
    /// (None for images from before keys), else a new one.
    fn spawner_key(&self) -> Result<Option<crab_init::protocol::SpawnerKey>, ShimError> {
        match &self.config.restore_from {
            Some(images) => crab_runtime::init::key_for_images(images).map_err(|e| {
                ShimError::InvalidArgument(format!("container {}: the checkpoint's spawner key: {e}", self.id()))
            }),
            None => crab_runtime::spawner::new_key().map(Some).map_err(|e| ShimError::io(Path::new("getrandom"), e)),
        }
    }

    /// Connects to the spawner unless connected (once the init runs). Why
    /// not when the container has no spawner or it does not answer.
    async fn spawner(&self) -> Result<Arc<SpawnerClient>, String> {
        let Some(slot) = self.spawner.get() else { return Err(self.no_spawner_reason()) };
        let _connecting = slot.connecting.lock().await;
        if slot.client.is_connected().await {
            return Ok(slot.client.clone());
        }
        let status = self.init.status();
        if !matches!(status, Status::Running | Status::Paused) {
            return Err(format!("the container's init is {status:?}, its spawner unreachable"));
        }
        if let Err(e) = slot.client.connect(SPAWNER_CONNECT_PATIENCE, self.init.pid()).await {
            tracing::warn!(container = %self.id(), error = %e, "spawner unavailable: execs go through the runtime");
            return Err(format!("spawner unavailable: {e}"));
        }
        self.runtime.set_helper_pid(slot.client.host_pid().unwrap_or(0));
        if slot.adopt.swap(false, std::sync::atomic::Ordering::SeqCst) {
            match slot.client.adopt_sessions().await {
                Ok(n) => tracing::info!(container = %self.id(), sessions = n, "restored exec sessions await re-attach"),
                Err(e) => tracing::warn!(container = %self.id(), error = %e, "restored exec sessions not listed"),
            }
        }
        Ok(slot.client.clone())
    }

    fn no_spawner_reason(&self) -> String {
        self.no_spawner.get().cloned().unwrap_or_else(|| "the container has no crab-init spawner".into())
    }

    /// The init runs: connect to its spawner in the background, so the first
    /// Exec finds it ready.
    pub fn spawner_started(self: &Arc<Self>) {
        if self.spawner.get().is_none() {
            return;
        }
        let container = self.clone();
        tokio::spawn(async move {
            let _ = container.spawner().await;
        });
    }

    /// Whether the container has no pid namespace of its own (it joins one, as hostPID does):
    /// the kernel then kills nothing of it when its init exits. Read from the bundle's spec; an
    /// unreadable spec counts as shared (the kill-all it leads to is harmless for a container
    /// whose namespace went with its init).
    pub fn shares_pid_namespace(&self) -> bool {
        let spec = std::fs::read(self.config.bundle.join("config.json"))
            .ok()
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok());
        !spec.is_some_and(|spec| own_pid_namespace(&spec))
    }

    /// The spawner's host pid: the runtime's own helper, hidden from Pids and Stats.
    pub fn spawner_pid(&self) -> Option<u32> {
        self.spawner.get().and_then(|slot| slot.client.host_pid())
    }

    /// Creates the init process (runtime `create`), unless it will be restored at Start.
    pub async fn create(&self) -> Result<u32, ShimError> {
        let dir = self.work_dir();
        tokio::fs::create_dir_all(&dir).await.map_err(|e| ShimError::io(&dir, e))?;
        self.install_init()?;
        self.name_criu_config();
        self.runtime.add_dump_hooks(Arc::new(PidNamespaceForDump {
            init: self.init.clone(),
            reaper: self.reaper.clone(),
            next: Default::default(),
        }));
        if self.config.restore_from.is_some() {
            return Ok(0);
        }
        let (io, launch) = ProcessIo::prepare(&self.init.uris, &self.owner(), &self.work_dir(), &self.reaper).await?;
        self.init.set_io(io.clone());
        let pid_file = self.work_dir().join("init.pid");
        let console_path = launch.console.as_ref().map(|c| c.path().to_path_buf());
        let master = launch.console.map(|c| tokio::spawn(c.receive_master()));
        let mut stdio = launch.stdio;
        stdio.preserved = match self.spawner.get().and_then(|slot| slot.client.key()) {
            Some(key) => Some(key_pipe(&key).map_err(|e| ShimError::io(Path::new("spawner key pipe"), e))?),
            None => None,
        };
        let opts = LaunchOptions {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.config.no_pivot,
            no_new_keyring: self.config.no_new_keyring,
            stdio,
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
        let (io, launch) = ProcessIo::prepare(&self.init.uris, &self.owner(), &self.work_dir(), &self.reaper).await?;
        self.init.set_io(io.clone());
        let pid_file = self.work_dir().join("init.pid");
        let console_path = launch.console.as_ref().map(|c| c.path().to_path_buf());
        let master = launch.console.map(|c| tokio::spawn(c.receive_master()));
        let opts = CheckpointOptions {
            image_path: image.to_path_buf(),
            work_path: Some(self.work_dir().join("restore-work")),
            // Restored processes keep their session: a TTY job must come back as one.
            shell_job: self.init.uris.terminal,
            // What the engine's dumps take (established TCP connections, file locks, and
            // sockets to peers outside the container) CRIU restores only when asked to; for
            // images without them the flags change nothing.
            tcp_established: true,
            ext_unix_sockets: true,
            file_locks: true,
            // A restore that hangs fails Start at the bound a dump has (nothing to thaw).
            deadline: Some(DumpDeadline { after: self.config.dump_timeout, thaw_pid: None }),
            ..Default::default()
        };
        let launch_opts = LaunchOptions {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.config.no_pivot,
            no_new_keyring: self.config.no_new_keyring,
            stdio: launch.stdio,
        };
        // CRIU forks for every action of the script (seven per restore, each a copy of its
        // page tables, about 50 ms for a 64 MiB process): only a restore of established TCP
        // connections, which CRIU dumps as tcp-stream images, needs it.
        // Read before the restore: the images may go with it.
        let next_pid = crab_runtime::pidns::recorded_in_images(image);
        let action_script = has_tcp_streams(image) && self.criu_action_script(true);
        let restored = self.runtime.restore(&self.config.id, &self.config.bundle, &opts, launch_opts).await;
        if action_script {
            self.criu_action_script(false);
        }
        if self.config.restore_images_owned {
            // Links to the kept copy or reassembled files, on the kept copies' file system (a
            // tmpfs): CRIU is done with them either way.
            let _ = tokio::fs::remove_dir_all(image).await;
        }
        finish_console(&io, master, restored.is_ok()).await?;
        restored?;
        let pid = read_pid(&pid_file).await?;
        self.set_next_pid(pid, next_pid).await;
        // Up already when the shim was CRIU's action script; else (a spec with a CRIU config
        // of its own) a restored server becomes reachable from here on.
        if let Err(e) = loopback_up(pid).await {
            tracing::warn!(container = %self.config.id, error = %e, "loopback of the restored container left down");
        }
        self.init.set_running(pid);
        *self.cgroup.lock().expect("cgroup lock") = Cgroup::of_pid(pid).ok();
        Ok(pid)
    }

    /// Gives the restored container's pid namespace the next pid its dump recorded
    /// ([`crab_runtime::pidns`]): CRIU restores every pid, not the namespace's cursor. The
    /// restored processes run already; one that forks before this (within milliseconds)
    /// gets a pid from the bottom of the free ones.
    async fn set_next_pid(&self, pid: u32, recorded: Result<Option<u32>, String>) {
        let next = match recorded {
            Ok(Some(next)) => next,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(container = %self.config.id, error = %e, "the restored pid namespace hands out the lowest free pids");
                return;
            }
        };
        // The runtime just named `pid` as the restored init, which only this shim reaps.
        let set = match crab_runtime::pidns::pidfd_open(pid) {
            Ok(init) => crab_runtime::pidns::set_next_pid(&self.reaper, &init, next).await,
            Err(e) => Err(e),
        };
        match set {
            Ok(()) => tracing::debug!(container = %self.config.id, next, "pid namespace's next pid set"),
            Err(e) => {
                tracing::warn!(container = %self.config.id, next, error = %e, "the restored pid namespace hands out the lowest free pids")
            }
        }
    }

    /// The CRIU config file the spec names (see [`crab_runtime::criu`]).
    fn criu_config_path(&self) -> PathBuf {
        self.config.bundle.join(crab_runtime::criu::CONFIG_IN_BUNDLE)
    }

    /// Names crab's CRIU config in the spec, for every later dump and restore. Without it
    /// dumps keep CRIU's 1 MiB ghost limit and restored loopback TCP connections fail.
    fn name_criu_config(&self) {
        match crab_runtime::criu::name_config(&self.config.bundle, &self.criu_config_path()) {
            Ok(true) => {
                self.criu_config_ours.store(true, Ordering::Relaxed);
                self.runtime.add_dump_hooks(Arc::new(NetworkLockForDump {
                    config: self.criu_config_path(),
                    init: self.init.clone(),
                }));
            }
            Ok(false) => {
                tracing::info!(container = %self.id(), "the spec names a CRIU config of its own: crab's ghost limit and restore action script are not used")
            }
            Err(e) => {
                tracing::warn!(container = %self.id(), error = %e, "crab's CRIU config not named: deleted files over 1 MiB fail dumps, restored loopback TCP connections fail")
            }
        }
    }

    /// Makes this binary CRIU's action script (`on`) for a restore, or stops it being one
    /// (a dump needs none). Returns whether it is one now.
    fn criu_action_script(&self, on: bool) -> bool {
        if !self.criu_config_ours.load(Ordering::Relaxed) {
            return false;
        }
        let exe = if on {
            match std::env::current_exe() {
                Ok(exe) => Some(exe),
                Err(e) => {
                    tracing::warn!(container = %self.id(), error = %e, "no CRIU action script: restored loopback TCP connections will fail");
                    return false;
                }
            }
        } else {
            None
        };
        let lock = crab_runtime::criu::NetworkLock::Lock;
        match crab_runtime::criu::write_config(&self.criu_config_path(), exe.as_deref(), lock) {
            Ok(()) => on,
            Err(e) => {
                tracing::warn!(container = %self.id(), error = %e, "CRIU config not rewritten");
                false
            }
        }
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

    /// Starts an exec: through the spawner when the container has one and
    /// the exec runs as the init does, else through the runtime's `exec`
    /// (logged, and said in [`StartedExec::through_runtime`]).
    pub async fn start_exec(&self, process: &Arc<Process>) -> Result<StartedExec, ShimError> {
        if process.status() != Status::Created {
            return Err(ShimError::FailedPrecondition(format!("exec {} already started", process.exec_id)));
        }
        let spec: serde_json::Value = serde_json::from_slice(process.spec.as_deref().unwrap_or_default())
            .map_err(|e| ShimError::InvalidArgument(format!("exec {} process spec: {e}", process.exec_id)))?;
        let reason = match self.spawner.get() {
            Some(slot) => {
                let identity = crab_runtime::init::process_identity(&spec);
                if identity != slot.init_identity {
                    identity_mismatch(&identity, &slot.init_identity)
                } else {
                    match self.spawner().await {
                        Ok(spawner) => return self.start_exec_in_spawner(&spawner, process, &spec).await,
                        Err(reason) => reason,
                    }
                }
            }
            None => self.no_spawner_reason(),
        };
        // Never silent: the exec's processes are outside the container's tree, so outside every dump.
        tracing::warn!(container = %self.id(), exec = %process.exec_id, %reason,
            "exec started by the runtime, not crab-init's spawner: it is left out of checkpoints");
        let pid = self.start_exec_with_runtime(process).await?;
        Ok(StartedExec {
            pid,
            exit: Box::pin(self.reaper.wait_for(pid)),
            through_runtime: Some(reason),
            restored_shell: None,
        })
    }

    async fn start_exec_in_spawner(
        &self,
        spawner: &Arc<SpawnerClient>,
        process: &Arc<Process>,
        spec: &serde_json::Value,
    ) -> Result<StartedExec, ShimError> {
        let exec_id = &process.exec_id;
        let request = spawn_request(exec_id, spec, &process.uris)?;
        let exit = spawner.exit_of(exec_id);
        let (session, restored) = match spawner.attach_restored(exec_id, &request.args).await {
            Some(attached) => {
                tracing::info!(container = %self.id(), exec = %exec_id, "re-attached a restored exec session");
                (attached, true)
            }
            None => (spawner.spawn(request).await, false),
        };
        let session = session.map_err(|e| match e {
            // The process could not start: the same error the runtime gives.
            SpawnerError::Refused(message) => ShimError::Runtime(RuntimeError::Failed {
                binary: self.runtime.binary_name(),
                verb: "exec".into(),
                status: 1,
                message,
            }),
            e => ShimError::Other(format!("exec {exec_id} through the spawner: {e}")),
        })?;
        let pid = session.pid;
        let ends = ParentEnds {
            stdin: session.stdin,
            stdout: session.stdout,
            stderr: session.stderr,
            console: session.console,
        };
        let shell_restore = self.config.restore_shells.iter().find(|r| restored && r.target.exec_id == *exec_id);
        let io = ProcessIo::from_parent_ends(&process.uris, &self.owner(), ends, &self.reaper, shell_restore.is_some())
            .await?;
        process.set_io(io.clone());
        let restored_shell = match shell_restore {
            Some(restore) => {
                let base = self.bring_shell_forward(restore, pid, &io).await;
                io.open_input();
                base
            }
            None => None,
        };
        let pidfd = Arc::new(session.pidfd);
        process.set_pidfd(pidfd.clone());
        process.set_running(pid);
        if !process.uris.stdin.is_empty() && !process.uris.terminal {
            // The spawner holds a writer too: the process sees end of file
            // only once both are closed.
            let (spawner, exec_id, closed) = (spawner.clone(), exec_id.clone(), io.stdin_closed());
            tokio::spawn(async move {
                closed.await;
                if let Err(e) = spawner.close_stdin(&exec_id).await {
                    tracing::debug!(exec = %exec_id, error = %e, "spawner's stdin copy not closed");
                }
            });
        }
        let spawner = spawner.clone();
        let exit = async move {
            let status = spawned_exit_status(exit, &pidfd, &spawner).await;
            Exit { pid, status, at: std::time::SystemTime::now() }
        };
        Ok(StartedExec { pid, exit: Box::pin(exit), through_runtime: None, restored_shell })
    }

    /// A restored shell session is as its process images hold it: when a later turn of it
    /// needed no dump, it is written the input that brings it to that turn's state, before
    /// any of the client's. Returns what the images hold, which the engine goes on from
    /// (None: the session dumps at its next turn).
    async fn bring_shell_forward(
        &self,
        restore: &crab_store::ShellRestore,
        pid: u32,
        io: &Arc<ProcessIo>,
    ) -> Option<(ShellState, u64)> {
        let exec_id = restore.target.exec_id.as_str();
        let Some(base) = &restore.base else {
            tracing::warn!(container = %self.id(), exec = exec_id, turn = restore.target_turn,
                images_turn = restore.images_turn,
                "restored shell session is at its process images' turn: that turn listed no state of it");
            return None;
        };
        if restore.target_turn == restore.images_turn {
            // The images hold the turn's own state.
            return Some((base.clone(), restore.images_turn));
        }
        let marks = crab_engine::shell::Marks::new(crab_engine::shell::nonce());
        let line = crab_engine::shell::restore_line(base, &restore.target, &marks);
        let clock = std::time::Instant::now();
        let ask = io.ask(line.into_bytes(), marks, crab_engine::shell::ASK_TIMEOUT);
        // Charged to crab: the re-attach's turn does not count the shell as having run.
        let asked = match self.engine() {
            Some(engine) => engine.crab_input(pid, ask).await,
            None => ask.await,
        };
        match asked {
            Ok(_) => {
                tracing::info!(container = %self.id(), exec = exec_id, turn = restore.target_turn,
                    images_turn = restore.images_turn, ms = clock.elapsed().as_secs_f64() * 1e3,
                    "restored shell session brought to its turn's state");
                Some((base.clone(), restore.images_turn))
            }
            Err(e) => {
                tracing::warn!(container = %self.id(), exec = exec_id, turn = restore.target_turn, error = %e,
                    "restored shell session not brought to its turn's state");
                None
            }
        }
    }

    async fn start_exec_with_runtime(&self, process: &Arc<Process>) -> Result<u32, ShimError> {
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
            return match self.runtime.kill(&self.config.id, signal, all).await {
                Err(e) if e.is_no_container() && snap.pid == 0 => {
                    // Created, never started: a restore that failed at Start leaves no runtime
                    // container, so there is nothing to signal. It is stopped from now on, so a
                    // Wait returns (a forced delete kills, then waits for the exit) and Delete
                    // goes on.
                    process.set_stopped_unstarted();
                    Err(ShimError::NotFound(format!("container {} has no process: it never started", self.config.id)))
                }
                killed => Ok(killed?),
            };
        }
        if snap.pid == 0 {
            return Err(ShimError::FailedPrecondition(format!("exec {} is not started", process.exec_id)));
        }
        if let Some(pidfd) = process.pidfd() {
            return crab_runtime::spawner::pidfd_signal(&pidfd, signal as i32).map_err(|e| match e.raw_os_error() {
                Some(libc::ESRCH) => ShimError::NotFound(format!("process {} already finished", describe(process))),
                Some(libc::EINVAL) => ShimError::InvalidArgument(format!("signal {signal}")),
                _ => ShimError::Other(format!("kill {}: {e}", snap.pid)),
            });
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
        // An attach still under way would watch a deleted container.
        let engine = self.settled_engine().await.ok().flatten();
        // The last turn's checkpoint reads the container's root: let it finish.
        if let Some(engine) = engine {
            engine.settle().await;
        }
        let _guard = self.lifecycle.lock().await;
        if matches!(self.init.status(), Status::Running | Status::Paused) {
            return Err(ShimError::FailedPrecondition(format!("container {} is still running", self.id())));
        }
        match self.runtime.delete(&self.config.id, true).await {
            Ok(()) => {}
            // Never created (restore pending) or already gone: nothing to delete.
            Err(e) if e.is_no_container() => {}
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
        // A frozen spawner cannot let go of the shim's connection, and a
        // dump of the paused container (containerd's checkpoint) would find
        // it: let go before the freeze. Exits are queued meanwhile.
        // The slot's `connecting` is taken under the runtime's lock, as a dump's
        // hooks take it (QuiesceForDump): taken before it, a turn's dump starting
        // meanwhile held the runtime's lock and waited for `connecting` while this
        // waited for the runtime's lock, and Pause (containerd's checkpoint) hung.
        let detach = async {
            match self.spawner.get() {
                Some(slot) => {
                    let guard = slot.connecting.clone().lock_owned().await;
                    detach_spawner(slot).await;
                    Some(guard)
                }
                None => None,
            }
        };
        let (no_connect, paused) = self.runtime.pause_after(&self.config.id, detach).await;
        if paused.is_ok() {
            // Before the lock goes: a reconnect that sees Running would
            // connect to a frozen spawner and leave its attempt in the backlog.
            self.init.set_paused(true);
        }
        drop(no_connect);
        if let Some(slot) = self.spawner.get()
            && slot.client.is_suspended()
        {
            reconnect_when_running(slot.clone(), self.init.clone());
        }
        Ok(paused?)
    }

    pub async fn resume(&self) -> Result<(), ShimError> {
        let _guard = self.lifecycle.lock().await;
        self.runtime.resume(&self.config.id).await?;
        self.init.set_paused(false);
        Ok(())
    }

    /// containerd's own Checkpoint: bounded as a turn's dump is (`dump_timeout_ms`), so a CRIU
    /// that hangs fails the call instead of holding containerd and the task's lifecycle lock.
    pub async fn checkpoint(&self, opts: &CheckpointOptions) -> Result<(), ShimError> {
        let _guard = self.lifecycle.lock().await;
        // containerd pauses the task around `ctr c checkpoint --task`: an abandoned dump
        // leaves it paused, for containerd to resume.
        let thaw_pid = match self.init.status() {
            Status::Running => Some(self.init.pid()),
            Status::Paused => None,
            _ => return Err(ShimError::FailedPrecondition(format!("container {} is not running", self.id()))),
        };
        let deadline = DumpDeadline { after: self.config.dump_timeout, thaw_pid };
        let opts = CheckpointOptions { deadline: Some(deadline), ..opts.clone() };
        Ok(self.runtime.checkpoint(&self.config.id, &opts).await?)
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
        let spawner = self.spawner_pid();
        Ok(pids
            .into_iter()
            .filter(|pid| Some(*pid) != spawner)
            .map(|pid| (pid, execs.iter().find(|e| e.pid() == pid).map(|e| e.exec_id.clone())))
            .collect())
    }
}

/// Whether an OCI spec gives the container a new pid namespace (a `pid` entry without a path).
fn own_pid_namespace(spec: &serde_json::Value) -> bool {
    spec.pointer("/linux/namespaces").and_then(serde_json::Value::as_array).is_some_and(|namespaces| {
        namespaces.iter().any(|ns| {
            ns.get("type").and_then(serde_json::Value::as_str) == Some("pid")
                && ns.get("path").and_then(serde_json::Value::as_str).is_none_or(str::is_empty)
        })
    })
}

/// An exec that started.
pub struct StartedExec {
    pub pid: u32,
    pub exit: ExitFuture,
    /// Why the OCI runtime started it rather than crab-init's spawner (None: the spawner did).
    pub through_runtime: Option<String>,
    /// A restored shell session brought to its turn's state: what its process images hold of
    /// it, and their turn (see `crab_engine::SandboxEngine::stdin_session`).
    pub restored_shell: Option<(ShellState, u64)>,
}

/// Why an exec whose [`crab_runtime::init::process_identity`] is `exec` cannot be started by the
/// spawner of an init whose identity is `init`: the parts that differ.
fn identity_mismatch(exec: &serde_json::Value, init: &serde_json::Value) -> String {
    let differ: Vec<&str> = ["user", "capabilities", "apparmorProfile", "selinuxLabel", "noNewPrivileges"]
        .into_iter()
        .filter(|key| exec.get(key) != init.get(key))
        .collect();
    format!(
        "the exec differs from the init in {} (the spawner starts execs with the init's credentials)",
        differ.join(", ")
    )
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

/// Whether a CRIU image directory holds established TCP connections.
fn has_tcp_streams(images: &Path) -> bool {
    std::fs::read_dir(images).is_ok_and(|entries| {
        entries.flatten().any(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("tcp-stream-")))
    })
}

/// Sets `lo` up in the network namespace of `pid`, if it is down.
async fn loopback_up(pid: u32) -> std::io::Result<()> {
    tokio::task::spawn_blocking(move || crab_runtime::criu::loopback_up(pid))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
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

/// The spawner's request for an exec's OCI process spec.
fn spawn_request(
    exec_id: &str,
    spec: &serde_json::Value,
    uris: &StdioUris,
) -> Result<crab_init::protocol::SpawnRequest, ShimError> {
    let strings = |key: &str| -> Vec<String> {
        spec.get(key)
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_str).map(String::from).collect())
            .unwrap_or_default()
    };
    let args = strings("args");
    if args.is_empty() {
        return Err(ShimError::InvalidArgument(format!("exec {exec_id}: process spec has no args")));
    }
    let user = spec.get("user");
    let number = |key: &str| user.and_then(|u| u.get(key)).and_then(serde_json::Value::as_u64);
    let console_size = spec.get("consoleSize").and_then(|c| {
        Some(crab_init::protocol::ConsoleSize {
            height: c.get("height")?.as_u64()? as u16,
            width: c.get("width")?.as_u64()? as u16,
        })
    });
    Ok(crab_init::protocol::SpawnRequest {
        exec_id: exec_id.to_string(),
        args,
        env: strings("env"),
        cwd: spec.get("cwd").and_then(serde_json::Value::as_str).unwrap_or("/").to_string(),
        uid: number("uid").unwrap_or(0) as u32,
        gid: number("gid").unwrap_or(0) as u32,
        additional_gids: user
            .and_then(|u| u.get("additionalGids"))
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(|g| g.as_u64().map(|g| g as u32)).collect())
            .unwrap_or_default(),
        umask: number("umask").map(|m| m as u32),
        terminal: uris.terminal,
        console_size,
        stdin: !uris.stdin.is_empty(),
        stdout: !uris.stdout.is_empty(),
        stderr: !uris.stderr.is_empty(),
    })
}

/// The exit status of a spawned exec: the spawner's report, or, when the
/// process ended and no report comes (the spawner died with the pid
/// namespace, which the kernel ends with SIGKILL), 128 + SIGKILL.
async fn spawned_exit_status(
    mut report: tokio::sync::oneshot::Receiver<i32>,
    pidfd: &std::os::fd::OwnedFd,
    spawner: &SpawnerClient,
) -> i32 {
    const KILLED: i32 = 128 + libc::SIGKILL;
    tokio::select! {
        reported = &mut report => return reported.map(crab_init::exit_status).unwrap_or(KILLED),
        _ = crab_runtime::spawner::pidfd_exited(pidfd) => {}
    }
    loop {
        match tokio::time::timeout(std::time::Duration::from_secs(2), &mut report).await {
            Ok(reported) => return reported.map(crab_init::exit_status).unwrap_or(KILLED),
            // Detached for a dump: the report is queued in the spawner.
            Err(_) if spawner.is_suspended() => continue,
            Err(_) => return KILLED,
        }
    }
}

/// The read end of a pipe that holds `key` and nothing more (its write end closed), for
/// crab-init to read as its first act.
fn key_pipe(key: &crab_init::protocol::SpawnerKey) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::io::Write;
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // 32 bytes fit a pipe's buffer: the write never waits for a reader.
    std::fs::File::from(write).write_all(key.as_bytes())?;
    Ok(read)
}

/// Around a CRIU dump: the spawner closes its connection to the shim (an
/// external socket CRIU refuses), and output copies hold still so what the
/// dump takes from a pipe is not also delivered; afterwards both resume.
#[derive(Clone)]
struct QuiesceForDump {
    slot: Arc<SpawnerSlot>,
    execs: Execs,
    init: Arc<Process>,
    /// The pinned crab-init build the container runs, recorded with every dump.
    init_digest: Option<String>,
    /// The slot's `connecting` lock from before the dump to after it.
    no_connect: Arc<std::sync::Mutex<Option<tokio::sync::OwnedMutexGuard<()>>>>,
}

impl std::fmt::Debug for QuiesceForDump {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QuiesceForDump")
    }
}

impl QuiesceForDump {
    fn hold_output(&self, held: bool) {
        let execs: Vec<_> = self.execs.lock().expect("execs lock").values().cloned().collect();
        for io in execs.iter().filter(|p| p.pidfd().is_some()).filter_map(|p| p.io()) {
            io.hold_output(held);
        }
    }
}

#[async_trait::async_trait]
impl crab_runtime::DumpHooks for QuiesceForDump {
    async fn before_dump(&self) {
        self.hold_output(true);
        let guard = self.slot.connecting.clone().lock_owned().await;
        // A paused container's spawner let go at Pause already.
        detach_spawner(&self.slot).await;
        *self.no_connect.lock().expect("dump guard lock") = Some(guard);
    }

    async fn after_dump(&self, dumped_to: Option<&Path>) {
        if let (Some(images), Some(digest)) = (dumped_to, &self.init_digest)
            && let Err(e) = crab_runtime::init::record_in_images(images, digest)
        {
            tracing::warn!(error = %e, "the dump does not say which crab-init it holds: a restore after an upgrade of crab-init fails");
        }
        if let (Some(images), Some(key)) = (dumped_to, self.slot.client.key())
            && let Err(e) = crab_runtime::init::record_key_in_images(images, &key)
        {
            tracing::warn!(error = %e, "the dump keeps no spawner key: a restore of it runs execs through the runtime");
        }
        self.no_connect.lock().expect("dump guard lock").take();
        self.hold_output(false);
        if self.slot.client.is_suspended() {
            reconnect_when_running(self.slot.clone(), self.init.clone());
        }
    }
}

/// Chooses, just before each dump, whether CRIU locks the container's network:
/// only a namespace with TCP connections needs it (`runtime::criu`).
struct NetworkLockForDump {
    config: PathBuf,
    init: Arc<Process>,
}

impl std::fmt::Debug for NetworkLockForDump {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetworkLockForDump").field("config", &self.config).finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl crab_runtime::DumpHooks for NetworkLockForDump {
    async fn before_dump(&self) {
        use crab_runtime::criu;
        let pid = self.init.pid();
        let lock = if pid == 0 { criu::NetworkLock::Lock } else { criu::network_lock_for(pid) };
        tracing::debug!(pid, ?lock, "network lock of the dump");
        if let Err(e) = criu::write_config(&self.config, None, lock) {
            tracing::warn!(error = %e, "CRIU config not rewritten before the dump");
        }
    }

    async fn after_dump(&self, _dumped_to: Option<&Path>) {}
}

/// Records with every dump the pid the container's next process would get
/// ([`crab_runtime::pidns`]), read just before the dump.
struct PidNamespaceForDump {
    init: Arc<Process>,
    reaper: Reaper,
    next: Mutex<Option<u32>>,
}

impl std::fmt::Debug for PidNamespaceForDump {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PidNamespaceForDump")
    }
}

#[async_trait::async_trait]
impl crab_runtime::DumpHooks for PidNamespaceForDump {
    async fn before_dump(&self) {
        use crab_runtime::pidns;
        *self.next.lock().expect("next pid lock") = None;
        let pid = self.init.pid();
        if pid == 0 {
            return;
        }
        // The pidfd is the init's if the init still has that pid after it was opened: only
        // this shim reaps the init, so its pid is not reused before the shim has seen it exit.
        let Ok(init) = pidns::pidfd_open(pid) else { return };
        if self.init.pid() != pid || self.init.status() == Status::Stopped {
            return;
        }
        match pidns::next_pid(&self.reaper, &init).await {
            Ok(next) => *self.next.lock().expect("next pid lock") = Some(next),
            Err(e) => {
                tracing::warn!(pid, error = %e, "the dump does not record the next pid: a restore of it hands out the lowest free pids")
            }
        }
    }

    async fn after_dump(&self, dumped_to: Option<&Path>) {
        let next = self.next.lock().expect("next pid lock").take();
        if let (Some(images), Some(next)) = (dumped_to, next)
            && let Err(e) = crab_runtime::pidns::record_in_images(images, next)
        {
            tracing::warn!(error = %e, "the dump does not record the next pid: a restore of it hands out the lowest free pids");
        }
    }
}

/// Has the spawner close its connection to the shim (it must be running to).
/// The caller holds `slot.connecting` until the dump or freeze is over.
async fn detach_spawner(slot: &SpawnerSlot) {
    if !slot.client.is_connected().await {
        return;
    }
    if let Err(e) = slot.client.detach().await {
        tracing::warn!(error = %e, "spawner detach failed; hanging up");
        slot.client.disconnect().await;
    }
}

/// Reconnects to the spawner in the background once the container runs
/// again (a frozen one cannot say hello).
fn reconnect_when_running(slot: Arc<SpawnerSlot>, init: Arc<Process>) {
    {
        tokio::spawn(async move {
            // Bounded: a spawner that never answers again must not keep
            // exits waiting (they then fall back to the pidfd).
            for _ in 0..SPAWNER_RECONNECT_ATTEMPTS {
                // The state is read under the lock: Pause and dumps hold it
                // while they freeze or detach.
                let connecting = slot.connecting.lock().await;
                match init.status() {
                    Status::Stopped => break,
                    Status::Paused | Status::Created => {
                        drop(connecting);
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                    Status::Running => {}
                }
                if slot.client.is_connected().await {
                    return;
                }
                match slot.client.connect(SPAWNER_CONNECT_PATIENCE, init.pid()).await {
                    Ok(()) => return,
                    Err(e) => tracing::debug!(error = %e, "spawner not back yet after the dump"),
                }
                drop(connecting);
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            tracing::info!("spawner not back after the dump (the container stopped, or the spawner is gone)");
            slot.client.resume_without_connection();
        });
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{identity_mismatch, own_pid_namespace};

    #[test]
    fn a_pid_namespace_with_a_path_or_none_at_all_is_shared() {
        assert!(own_pid_namespace(&json!({"linux": {"namespaces": [{"type": "mount"}, {"type": "pid"}]}})));
        assert!(own_pid_namespace(&json!({"linux": {"namespaces": [{"type": "pid", "path": ""}]}})));
        assert!(!own_pid_namespace(&json!({"linux": {"namespaces": [{"type": "pid", "path": "/proc/1/ns/pid"}]}})));
        assert!(!own_pid_namespace(&json!({"linux": {"namespaces": [{"type": "network"}]}})), "hostPID");
        assert!(!own_pid_namespace(&json!({})));
    }

    #[test]
    fn an_identity_mismatch_names_what_differs() {
        let init = crab_runtime::init::process_identity(&json!({"user": {"uid": 0, "gid": 0}}));
        let exec = crab_runtime::init::process_identity(&json!({"user": {"uid": 1000, "gid": 0}}));
        let reason = identity_mismatch(&exec, &init);
        assert!(reason.contains("user") && !reason.contains("capabilities"), "{reason}");
        let exec = crab_runtime::init::process_identity(
            &json!({"user": {"uid": 0, "gid": 0}, "capabilities": {"bounding": []}, "noNewPrivileges": true}),
        );
        let reason = identity_mismatch(&exec, &init);
        assert!(reason.contains("capabilities, noNewPrivileges") && !reason.contains("user"), "{reason}");
    }
}
