//! Client for an OCI runtime's command line (runc, or crun which speaks nearly the
//! same dialect: [`dialect`] holds every difference), including the checkpoint and
//! restore verbs.
//!
//! Every invocation goes through [`OciRuntime::run`], which spawns the binary
//! with a plain `std::process::Command` and waits for it through the shim's
//! [`Reaper`]: the shim is a child subreaper that reaps every child with
//! `waitpid(-1)`, so a second waiter (tokio's own child handling) would race it
//! and lose exit statuses.

pub mod criu;
pub mod dialect;
pub mod freezer;
pub mod init;
pub mod kdat;
pub mod pidns;
mod reaper;
pub mod spawner;

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::AsyncReadExt;

pub use dialect::Dialect;
pub use reaper::{Exit, Reaper};

/// Errors of one runtime invocation.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("OCI runtime binary {path} not found: {source}")]
    Missing { path: PathBuf, source: std::io::Error },
    #[error("spawning {binary} {verb}: {source}")]
    Spawn { binary: String, verb: String, source: std::io::Error },
    /// The runtime ran and failed; `message` is the last error line of its log.
    #[error("{binary} {verb} failed ({status}): {message}")]
    Failed { binary: String, verb: String, status: i32, message: String },
    /// The runtime knows no container of this id (runc and crun word it differently).
    #[error("{binary} {verb}: container {id} does not exist ({message})")]
    NoContainer { binary: String, verb: String, id: String, message: String },
    /// A directory the runtime needs before it runs could not be made.
    #[error("preparing {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A flag this runtime does not have was asked for.
    #[error(transparent)]
    Unsupported(#[from] dialect::Unsupported),
    #[error("{binary} {verb}: unreadable output: {detail}")]
    Output { binary: String, verb: String, detail: String },
    /// Past its deadline the invocation was abandoned; `abandoned` says how it ended.
    #[error("{binary} {verb}: {} timed out after {after_ms} ms, abandoned: {abandoned}", what_timed_out(.verb))]
    TimedOut { binary: String, verb: String, after_ms: u64, abandoned: String },
    /// The runtime's pause returned, but the container's freezer never read frozen.
    #[error("pause of {id}: {detail}")]
    Freeze { id: String, detail: String },
}

impl RuntimeError {
    /// An invocation abandoned at its deadline: trying it again at once would hang as long.
    pub fn is_timeout(&self) -> bool {
        matches!(self, RuntimeError::TimedOut { .. })
    }

    /// The runtime said the container does not exist.
    pub fn is_no_container(&self) -> bool {
        matches!(self, RuntimeError::NoContainer { .. })
    }
}

/// A bound on one CRIU run, a dump or a restore: past `after` it is abandoned, and after a dump
/// the cgroup of `thaw_pid` (a process of the sandbox, its init) is thawed unless it was frozen
/// before the dump began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DumpDeadline {
    pub after: Duration,
    /// None: the sandbox was frozen before the dump (containerd pauses a task around its own
    /// checkpoint) and is left to whoever froze it.
    pub thaw_pid: Option<u32>,
}

/// How long an abandoned dump's CRIU gets to stop by itself on SIGALRM (its own timeout
/// path: it cures its parasite from every process, releases them and thaws the cgroup)
/// before it and the runtime are killed.
pub const ABANDON_GRACE: Duration = Duration::from_secs(2);
/// How long a pause that returns early (crun's) may take to freeze the container: runc's own
/// pause retries for about as long before it gives up.
const PAUSE_FREEZE_BOUND: Duration = Duration::from_secs(2);
/// The bound on a runtime verb that starts no process in the container (state, start, pause,
/// resume, kill, delete, update, ps): each takes milliseconds, and runc's own retries of a
/// freeze give up within seconds; one that has not ended by then is stuck (on a cgroup file, a
/// kernel wait) and is abandoned as a hung dump is, so the shim's verbs never wait for ever.
/// create and exec are not bounded here: the OCI hooks they run bound themselves (their
/// `timeout`), and the processes they start must not share a process group with the runtime.
const VERB_BOUND: Duration = Duration::from_secs(60);
/// How long the killed runtime's exit is waited for (it comes at once).
const KILLED_EXIT_WAIT: Duration = Duration::from_secs(5);

pub type Result<T> = std::result::Result<T, RuntimeError>;

/// What a verb that timed out was doing, as its error names it ("dump timed out" is what turn
/// records and their readers know).
fn what_timed_out(verb: &str) -> &str {
    match verb {
        "checkpoint" => "dump",
        "restore" => "restore",
        _ => "the runtime",
    }
}

/// How the runtime is invoked: binary, state root and global flags.
///
/// The shim makes one per container and hands clones to whoever drives that
/// container (the Task API, the checkpoint engine). Clones share one lock that
/// runs the verbs changing the container's frozen/dumped state one at a time:
/// runc does not lock between its own invocations, and a `pause`, `resume`
/// or `kill --all` (which freezes and thaws the cgroup) landing in the middle
/// of a CRIU dump fails it or the dump ("container not running"). Locks of the
/// caller's are taken after that one, never before: a dump's hooks take them
/// under it (see [`OciRuntime::pause_after`]).
#[derive(Debug, Clone)]
pub struct OciRuntime {
    binary: PathBuf,
    dialect: Dialect,
    root: PathBuf,
    systemd_cgroup: bool,
    reaper: Reaper,
    exclusive: std::sync::Arc<tokio::sync::Mutex<()>>,
    dump_hooks: std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<dyn DumpHooks>>>>,
    /// Host pid of the runtime's own process inside the container (crab-init's
    /// spawner): it is not the workload's, whatever it does.
    helper_pid: std::sync::Arc<std::sync::atomic::AtomicU32>,
    /// The bound on a verb that starts no process in the container ([`VERB_BOUND`]).
    verb_bound: Duration,
}

/// What must happen around every CRIU dump of the container, whoever asks
/// for it (containerd's Checkpoint or the turn engine): the spawner's
/// connection to the shim would be an external socket CRIU refuses.
#[async_trait::async_trait]
pub trait DumpHooks: Send + Sync + std::fmt::Debug {
    /// What the debug log calls the hook when it says how long each took.
    fn name(&self) -> &'static str {
        let full = std::any::type_name::<Self>();
        full.rsplit("::").next().unwrap_or(full)
    }
    async fn before_dump(&self);
    /// `dumped_to` is the image directory when the dump succeeded.
    async fn after_dump(&self, dumped_to: Option<&Path>);
}

/// The container process's standard streams, as the runtime sees them, and a descriptor it
/// inherits besides.
#[derive(Debug, Default)]
pub struct ProcessStdio {
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    /// Handed to the container's init as descriptor [`PRESERVED_FD`] (`--preserve-fds 1`):
    /// the pipe that brings crab-init its spawner's key. `create` only.
    pub preserved: Option<OwnedFd>,
}

/// Where the runtime puts the first descriptor it preserves for the init: right after stdio.
pub const PRESERVED_FD: RawFd = 3;
const _: () = assert!(PRESERVED_FD == crab_init::KEY_FD, "crab-init reads its key where the runtime puts it");

/// Options shared by `create`, `exec` and `restore`.
#[derive(Debug)]
pub struct LaunchOptions<'a> {
    pub pid_file: &'a Path,
    pub console_socket: Option<&'a Path>,
    pub no_pivot: bool,
    pub no_new_keyring: bool,
    pub stdio: ProcessStdio,
}

/// What `runc checkpoint` is asked to do.
#[derive(Debug, Default, Clone)]
pub struct CheckpointOptions {
    pub image_path: PathBuf,
    pub work_path: Option<PathBuf>,
    pub parent_path: Option<PathBuf>,
    pub leave_running: bool,
    pub tcp_established: bool,
    pub ext_unix_sockets: bool,
    pub shell_job: bool,
    pub file_locks: bool,
    pub empty_namespaces: Vec<String>,
    pub manage_cgroups_mode: Option<String>,
    /// None: the dump may take as long as it takes (containerd's own restore path and tests).
    pub deadline: Option<DumpDeadline>,
}

/// `runc state` output, the fields the shim uses.
#[derive(Debug, Deserialize)]
pub struct ContainerState {
    pub id: String,
    pub pid: u32,
    pub status: String,
    #[serde(default)]
    pub bundle: String,
}

impl OciRuntime {
    pub fn new(binary: impl Into<PathBuf>, root: impl Into<PathBuf>, systemd_cgroup: bool, reaper: Reaper) -> Self {
        let binary = binary.into();
        Self {
            dialect: Dialect::of(&binary),
            binary,
            root: root.into(),
            systemd_cgroup,
            reaper,
            exclusive: Default::default(),
            dump_hooks: Default::default(),
            helper_pid: Default::default(),
            verb_bound: VERB_BOUND,
        }
    }

    /// Another bound on the verbs that start no process in the container than [`VERB_BOUND`].
    pub fn with_verb_bound(mut self, bound: Duration) -> Self {
        self.verb_bound = bound;
        self
    }

    /// Shared by every clone: the container sets them once its spawner is up.
    /// Adds hooks run around every dump: `before_dump` in the order added, `after_dump` in
    /// the reverse order.
    pub fn add_dump_hooks(&self, hooks: std::sync::Arc<dyn DumpHooks>) {
        self.dump_hooks.lock().expect("dump hooks lock").push(hooks);
    }

    /// Records the spawner's host pid (it changes with a restore); 0 for none.
    pub fn set_helper_pid(&self, pid: u32) {
        self.helper_pid.store(pid, std::sync::atomic::Ordering::SeqCst);
    }

    /// The runtime's own processes in the container, to leave out of what a turn did.
    pub fn helper_pids(&self) -> std::collections::HashSet<u32> {
        let pid = self.helper_pid.load(std::sync::atomic::Ordering::SeqCst);
        (pid != 0).then_some(pid).into_iter().collect()
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Fails with a message naming the path when the runtime binary is absent,
    /// so a misconfigured host is reported at Create rather than as a spawn error.
    pub fn check_binary(&self) -> Result<PathBuf> {
        which(&self.binary).map_err(|source| RuntimeError::Missing { path: self.binary.clone(), source })
    }

    fn log_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.log"))
    }

    pub async fn create(&self, id: &str, bundle: &Path, opts: LaunchOptions<'_>) -> Result<()> {
        let mut args: Vec<OsString> = vec!["create".into(), "--bundle".into(), bundle.into()];
        push_launch_args(&mut args, &opts);
        args.push(id.into());
        self.run(id, &args, opts.stdio).await.map(drop)
    }

    pub async fn start(&self, id: &str) -> Result<()> {
        self.run_verb(id, &["start".into(), id.into()]).await.map(drop)
    }

    /// Starts an extra process described by `process_json` (an OCI `Process`).
    pub async fn exec(&self, id: &str, process_json: &Path, opts: LaunchOptions<'_>) -> Result<()> {
        let mut args: Vec<OsString> = vec!["exec".into(), "--detach".into(), "--process".into(), process_json.into()];
        args.push("--pid-file".into());
        args.push(opts.pid_file.into());
        if let Some(socket) = opts.console_socket {
            args.push("--console-socket".into());
            args.push(socket.into());
        }
        args.push(id.into());
        self.run(id, &args, opts.stdio).await.map(drop)
    }

    pub async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        let mut args: Vec<OsString> = vec!["kill".into()];
        if all {
            args.push("--all".into());
        }
        args.push(id.into());
        args.push(signal.to_string().into());
        let _exclusive = self.exclusive.lock().await;
        self.run_verb(id, &args).await.map(drop)
    }

    pub async fn delete(&self, id: &str, force: bool) -> Result<()> {
        let mut args: Vec<OsString> = vec!["delete".into()];
        if force {
            args.push("--force".into());
        }
        args.push(id.into());
        let _exclusive = self.exclusive.lock().await;
        let deleted = self.run_verb(id, &args).await.map(drop);
        if deleted.is_ok() || deleted.as_ref().is_err_and(RuntimeError::is_no_container) {
            // The container is gone, and so is every use of its log (its errors were read out
            // as they came): one per container ever run on the node would pile up otherwise.
            // A CRIU log kept after a failure stays, for whoever reads the error naming it.
            if let Err(e) = std::fs::remove_file(self.log_path(id))
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::debug!(container = id, error = %e, "runtime log not removed");
            }
        }
        deleted
    }

    pub async fn state(&self, id: &str) -> Result<ContainerState> {
        let out = self.run_verb(id, &["state".into(), id.into()]).await?;
        serde_json::from_slice(&out).map_err(|e| self.output_error("state", e))
    }

    /// Host pids of every process in the container.
    pub async fn ps(&self, id: &str) -> Result<Vec<u32>> {
        let out = self.run_verb(id, &["ps".into(), "--format".into(), "json".into(), id.into()]).await?;
        // runc prints `null` for an empty list.
        let pids: Option<Vec<u32>> = serde_json::from_slice(&out).map_err(|e| self.output_error("ps", e))?;
        Ok(pids.unwrap_or_default())
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        self.pause_after(id, async {}).await.1
    }

    /// Pauses the container once `prepare` has run, both under the lock of the verbs that freeze
    /// or dump it; `prepare`'s output (a guard it took) is handed back with the pause's result.
    ///
    /// What `prepare` locks is thereby always taken after that lock, as a dump's
    /// [`DumpHooks::before_dump`] takes it: a caller that took its own lock first and then paused
    /// would wait for a dump that waits for its lock in a hook, for ever.
    pub async fn pause_after<T>(&self, id: &str, prepare: impl std::future::Future<Output = T>) -> (T, Result<()>) {
        let _exclusive = self.exclusive.lock().await;
        let prepared = prepare.await;
        let mut paused = self.run_verb(id, &["pause".into(), id.into()]).await.map(drop);
        if let Err(RuntimeError::TimedOut { abandoned, .. }) = &mut paused {
            // Whatever the abandoned pause froze is thawed: the container runs on as it was.
            let thawed = match self.state(id).await {
                Ok(state) => thaw_abandoned(state.pid, "container").await,
                Err(e) => format!("the container was not thawed, its state is unknown: {e}"),
            };
            abandoned.push_str(&format!(", {thawed}"));
        }
        if paused.is_ok() && !self.dialect.pause_returns_frozen() {
            paused = self.wait_frozen(id).await;
        }
        (prepared, paused)
    }

    /// After a pause that returns before the freezer reads frozen (crun's): waits for it.
    async fn wait_frozen(&self, id: &str) -> Result<()> {
        let pid = self.state(id).await?.pid;
        let waited = tokio::task::spawn_blocking(move || freezer::wait_frozen(pid, PAUSE_FREEZE_BOUND)).await;
        let waited = waited.map_err(|e| e.to_string()).and_then(|frozen| frozen.map_err(|e| e.to_string()));
        waited.map(drop).map_err(|detail| RuntimeError::Freeze { id: id.to_string(), detail })
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        let _exclusive = self.exclusive.lock().await;
        self.run_verb(id, &["resume".into(), id.into()]).await.map(drop)
    }

    /// Applies `resources_json` (an OCI `LinuxResources`) to the running container.
    pub async fn update(&self, id: &str, resources_json: &Path) -> Result<()> {
        let args: Vec<OsString> = vec!["update".into(), "--resources".into(), resources_json.into(), id.into()];
        let _exclusive = self.exclusive.lock().await;
        self.run_verb(id, &args).await.map(drop)
    }

    pub async fn checkpoint(&self, id: &str, opts: &CheckpointOptions) -> Result<()> {
        let args = self.dialect.checkpoint_args(id, opts)?;
        self.create_dirs(opts)?;
        kdat::prepare_for_criu();
        let env = self.dialect.state_spec(&self.root, id).and_then(|spec| self.dialect.criu_env(&spec));
        let asked = std::time::Instant::now();
        let _exclusive = self.exclusive.lock().await;
        let locked = std::time::Instant::now();
        // A sandbox frozen before the dump (paused, by containerd or its user) was frozen by
        // someone else, who will thaw it: an abandoned dump leaves it so. Read under the lock
        // that pausing takes, so no pause slips in between.
        let deadline = opts.deadline.map(|d| match d.thaw_pid {
            Some(pid) if freezer::is_frozen(pid).unwrap_or(false) => DumpDeadline { thaw_pid: None, ..d },
            _ => d,
        });
        let hooks = self.dump_hooks.lock().expect("dump hooks lock").clone();
        let mut each_hook = Vec::with_capacity(hooks.len());
        for hook in &hooks {
            let started = std::time::Instant::now();
            hook.before_dump().await;
            each_hook.push((hook.name(), started.elapsed()));
        }
        let hooked = std::time::Instant::now();
        let bound = deadline.map(|d| (d.after, ABANDON_GRACE));
        let mut dumped = self.run_bounded(id, &args, ProcessStdio::default(), bound, env).await.map(drop);
        let ran = std::time::Instant::now();
        if let (Err(RuntimeError::TimedOut { abandoned, .. }), Some(deadline)) = (&mut dumped, deadline) {
            // Whatever CRIU did before it stopped, the sandbox is left running as it was.
            let thawed = match deadline.thaw_pid {
                Some(pid) => thaw_abandoned(pid, "sandbox").await,
                None => "sandbox left paused as it was".to_string(),
            };
            abandoned.push_str(&format!(", {thawed}"));
            tracing::warn!(container = id, error = %dumped.as_ref().unwrap_err(), "dump abandoned");
        }
        for hook in hooks.iter().rev() {
            hook.after_dump(dumped.is_ok().then_some(opts.image_path.as_path())).await;
        }
        if dumped.is_ok() && tracing::enabled!(tracing::Level::DEBUG) {
            // Where a dump's time went (scripts/lib/dump_breakdown.py): the runtime's wall beside
            // CRIU's own log, kept until the next dump (the work directory goes with the turn).
            let ms = |a: std::time::Instant, b: std::time::Instant| (b - a).as_secs_f64() * 1e3;
            let kept = keep_last_dump_files(&self.root, id, opts.work_path.as_deref().unwrap_or(&opts.image_path));
            tracing::debug!(container = id, dump_step = "runtime", lock_ms = ms(asked, locked),
                hooks_before_ms = ms(locked, hooked),
                each_hook_before = %each_hook.iter().map(|(name, took)| format!("{name}={:.1}", took.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(","),
                runtime_ms = ms(hooked, ran),
                hooks_after_ms = ms(ran, std::time::Instant::now()),
                criu_log = %kept.as_deref().map(Path::display).map(|d| d.to_string()).unwrap_or_default(),
                "dump taken");
        }
        dumped.map_err(|e| {
            self.with_criu_error(id, e, opts.work_path.as_deref().unwrap_or(&opts.image_path).join("dump.log"))
        })
    }

    /// Restores a container from `opts.image_path` and leaves it running.
    pub async fn restore(
        &self,
        id: &str,
        bundle: &Path,
        opts: &CheckpointOptions,
        launch: LaunchOptions<'_>,
    ) -> Result<()> {
        let args = self.dialect.restore_args(id, bundle, opts, &launch)?;
        self.create_dirs(opts)?;
        kdat::prepare_for_criu();
        let env = self.dialect.criu_env(&bundle.join("config.json"));
        let _exclusive = self.exclusive.lock().await;
        // Bounded like a dump: a CRIU that hangs must not hold the container's verbs (a kill
        // waits for this lock) for ever.
        let bound = opts.deadline.map(|d| (d.after, ABANDON_GRACE));
        let restored = self.run_bounded(id, &args, launch.stdio, bound, env).await.map(drop);
        restored.map_err(|e| {
            self.with_criu_error(id, e, opts.work_path.as_deref().unwrap_or(&opts.image_path).join("restore.log"))
        })
    }

    /// What this runtime needs in place before a checkpoint or restore (host paths the
    /// shim and engine chose, none inside the container).
    fn create_dirs(&self, opts: &CheckpointOptions) -> Result<()> {
        for dir in self.dialect.dirs_to_create(opts) {
            std::fs::create_dir_all(dir).map_err(|source| RuntimeError::Io { path: dir.to_path_buf(), source })?;
        }
        Ok(())
    }

    /// runc reports only "criu failed" and the log's name, and the caller may
    /// remove the directory holding it: the message gets CRIU's own last
    /// error line, and the whole log is kept beside the runtime's own log.
    /// Adds CRIU's own words to a failed or abandoned run: for a failure the error line of its
    /// log, for a run abandoned at its deadline the log's last line (where CRIU was when it
    /// stopped); the log is kept beside the runtime's state either way, as the work directory
    /// goes with the next checkpoint.
    fn with_criu_error(&self, id: &str, error: RuntimeError, log: PathBuf) -> RuntimeError {
        let verb = match &error {
            RuntimeError::Failed { verb, .. } | RuntimeError::TimedOut { verb, .. } => verb.clone(),
            _ => return error,
        };
        let Ok(text) = std::fs::read_to_string(&log) else { return error };
        let kept = self.root.join(format!("{id}.criu-{verb}.log"));
        let kept = match std::fs::write(&kept, &text) {
            Ok(()) => format!(" (log kept at {})", kept.display()),
            Err(_) => String::new(),
        };
        match error {
            RuntimeError::Failed { binary, verb, status, message } => {
                let cause = criu_cause(&text);
                RuntimeError::Failed { binary, verb, status, message: format!("{message}; criu: {cause}{kept}") }
            }
            RuntimeError::TimedOut { binary, verb, after_ms, abandoned } => {
                let last = text.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or("(empty)");
                let abandoned = format!("{abandoned}; criu's last line: {last}{kept}");
                RuntimeError::TimedOut { binary, verb, after_ms, abandoned }
            }
            other => other,
        }
    }

    fn output_error(&self, verb: &str, e: impl std::fmt::Display) -> RuntimeError {
        RuntimeError::Output { binary: self.binary_name(), verb: verb.into(), detail: e.to_string() }
    }

    pub fn binary_name(&self) -> String {
        self.binary.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// Runs a verb that starts no process in the container (state, start, pause, kill...),
    /// abandoned past [`Self::with_verb_bound`]'s bound.
    async fn run_verb(&self, id: &str, args: &[OsString]) -> Result<Vec<u8>> {
        self.run_bounded(id, args, ProcessStdio::default(), Some((self.verb_bound, ABANDON_GRACE)), None).await
    }

    /// Runs one runtime verb and returns its stdout.
    async fn run(&self, id: &str, args: &[OsString], stdio: ProcessStdio) -> Result<Vec<u8>> {
        self.run_bounded(id, args, stdio, None, None).await
    }

    /// [`run`](Self::run), abandoned past `bound.0`: the runtime runs in a process group of its
    /// own, which its children (CRIU, CRIU's action scripts) share; at the deadline the group
    /// gets SIGALRM, on which CRIU takes its own timeout path and undoes what it did to the
    /// processes, and runc does nothing; whatever is left of the group after `bound.1` is
    /// killed. Never by name: the group is the one this call made.
    async fn run_bounded(
        &self,
        id: &str,
        args: &[OsString],
        stdio: ProcessStdio,
        bound: Option<(Duration, Duration)>,
        env: Option<(&str, PathBuf)>,
    ) -> Result<Vec<u8>> {
        let verb = args.first().map(|a| a.to_string_lossy().into_owned()).unwrap_or_default();
        let log = self.log_path(id);
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.arg("--root").arg(&self.root).arg("--log").arg(&log).arg("--log-format").arg("json");
        if self.systemd_cgroup {
            cmd.arg("--systemd-cgroup");
        }
        cmd.args(args);
        if let Some((name, value)) = env {
            cmd.env(name, value);
        }
        cmd.stdin(stdio.stdin.map(Stdio::from).unwrap_or_else(Stdio::null));
        // Detached create/exec/restore hand these to the container process;
        // otherwise the runtime's own stdout is read back.
        cmd.stdout(stdio.stdout.map(Stdio::from).unwrap_or_else(Stdio::piped));
        cmd.stderr(stdio.stderr.map(Stdio::from).unwrap_or_else(Stdio::piped));

        if bound.is_some() {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        // Kept open here until the child has spawned (it is dropped at the end of this call).
        let preserved = stdio.preserved;
        if let Some(fd) = &preserved {
            let raw = fd.as_raw_fd();
            // SAFETY: the closure runs in the child between fork and exec and calls only
            // dup2 and fcntl, which are async-signal-safe, on `raw`, which is open in the
            // parent until `spawn` has returned. std closes its own exec-error pipe's read end
            // in the child before this runs, and its write end is never the lowest free
            // descriptor, so PRESERVED_FD overwrites nothing std still uses.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || inherit_as(raw, PRESERVED_FD));
            }
        }

        tracing::debug!(binary = %self.binary.display(), ?args, "oci runtime");
        let spawn_error = |source| RuntimeError::Spawn { binary: self.binary_name(), verb: verb.clone(), source };
        // Keep the reaper lock-free of our pid until it is known: the reaper
        // parks unclaimed exits, so registering after spawn cannot miss one.
        let mut child = cmd.spawn().map_err(spawn_error)?;
        let pid = child.id();
        let exit = self.reaper.wait_for(pid);
        let stdout = tokio::spawn(read_all(child.stdout.take()));
        let stderr = tokio::spawn(read_all(child.stderr.take()));
        // std's Child is never waited on: the reaper reaps it. Dropping it does
        // not wait or kill.
        drop(child);
        let exit = match bound {
            None => exit.await,
            Some((after, grace)) => {
                tokio::pin!(exit);
                match tokio::time::timeout(after, &mut exit).await {
                    Ok(exit) => exit,
                    Err(_) => {
                        let abandoned = abandon_group(pid, exit, grace).await;
                        // Pipes a survivor might hold must not hold this call.
                        stdout.abort();
                        stderr.abort();
                        let after_ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
                        return Err(RuntimeError::TimedOut { binary: self.binary_name(), verb, after_ms, abandoned });
                    }
                }
            }
        };
        let stdout = stdout.await.unwrap_or_default();
        let stderr = stderr.await.unwrap_or_default();
        if exit.status != 0 {
            let message = last_error_line(&log)
                .await
                .or_else(|| last_line(&stderr))
                .unwrap_or_else(|| format!("exit status {}", exit.status));
            if self.dialect.says_no_container(&self.root, id, &message) {
                return Err(RuntimeError::NoContainer { binary: self.binary_name(), verb, id: id.into(), message });
            }
            return Err(RuntimeError::Failed { binary: self.binary_name(), verb, status: exit.status, message });
        }
        Ok(stdout)
    }
}

/// Thaws the cgroup of `pid` after an abandoned verb left it frozen; says how it went, naming
/// the frozen thing `what`.
async fn thaw_abandoned(pid: u32, what: &str) -> String {
    let thawed = tokio::task::spawn_blocking(move || freezer::thaw(pid)).await;
    match thawed.map_err(|e| e.to_string()).and_then(|t| t.map_err(|e| e.to_string())) {
        Ok(_) => format!("{what} thawed"),
        Err(e) => format!("thawing the {what} failed: {e}"),
    }
}

/// Makes `fd` descriptor `target` of this process, inherited across exec.
fn inherit_as(fd: RawFd, target: RawFd) -> std::io::Result<()> {
    // SAFETY: plain descriptor calls; dup2 gives `target` without close-on-exec, and when `fd`
    // already is `target` the flag is cleared in place (dup2 would leave it).
    let done = unsafe { if fd == target { libc::fcntl(target, libc::F_SETFD, 0) } else { libc::dup2(fd, target) } };
    if done < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Ends process group `pgid` (led by the runtime process `pgid`, whose exit `exit` is): SIGALRM
/// first, SIGKILL after `grace` if the leader has not exited, and SIGKILL again once it has,
/// for members it left behind. Says how it ended.
async fn abandon_group(pgid: u32, exit: impl std::future::Future<Output = Exit>, grace: Duration) -> String {
    use nix::sys::signal::{Signal, killpg};
    let group = nix::unistd::Pid::from_raw(pgid as i32);
    tokio::pin!(exit);
    let _ = killpg(group, Signal::SIGALRM);
    let how = match tokio::time::timeout(grace, &mut exit).await {
        Ok(exit) => format!("stopped on SIGALRM (exit status {})", exit.status),
        Err(_) => {
            let _ = killpg(group, Signal::SIGKILL);
            match tokio::time::timeout(KILLED_EXIT_WAIT, &mut exit).await {
                Ok(_) => format!("killed (no exit {} ms after SIGALRM)", grace.as_millis()),
                Err(_) => format!("killed, and no exit {} ms later", KILLED_EXIT_WAIT.as_millis()),
            }
        }
    };
    // The group outlives its leader while a member lives (its id is not reused meanwhile):
    // CRIU's action scripts, or CRIU itself when the runtime went first.
    let _ = killpg(group, Signal::SIGKILL);
    how
}

fn push_launch_args(args: &mut Vec<OsString>, opts: &LaunchOptions<'_>) {
    if opts.stdio.preserved.is_some() {
        args.push("--preserve-fds".into());
        args.push("1".into());
    }
    args.push("--pid-file".into());
    args.push(opts.pid_file.into());
    if let Some(socket) = opts.console_socket {
        args.push("--console-socket".into());
        args.push(socket.into());
    }
    if opts.no_pivot {
        args.push("--no-pivot".into());
    }
    if opts.no_new_keyring {
        args.push("--no-new-keyring".into());
    }
}

async fn read_all(pipe: Option<impl std::io::Read + std::os::fd::AsRawFd + Into<OwnedFd>>) -> Vec<u8> {
    let Some(pipe) = pipe else { return Vec::new() };
    let fd: OwnedFd = pipe.into();
    let mut file = tokio::fs::File::from(std::fs::File::from(fd));
    let mut buf = Vec::new();
    // A read error leaves what was read so far; the exit status decides success.
    let _ = file.read_to_end(&mut buf).await;
    buf
}

fn last_line(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes).lines().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_string())
}

/// The last `"level":"error"` message of a JSON runtime log.
async fn last_error_line(log: &Path) -> Option<String> {
    #[derive(Deserialize)]
    struct Entry {
        level: Option<String>,
        msg: Option<String>,
    }
    let text = tokio::fs::read_to_string(log).await.ok()?;
    text.lines().rev().find_map(|line| {
        let entry: Entry = serde_json::from_str(line).ok()?;
        (entry.level.as_deref() == Some("error")).then_some(entry.msg).flatten()
    })
}

/// Resolves `binary` against PATH unless it is already a path.
fn which(binary: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let is_exec = |p: &Path| p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false);
    if binary.components().count() > 1 {
        return if is_exec(binary) {
            Ok(binary.to_path_buf())
        } else {
            Err(std::io::Error::new(std::io::ErrorKind::NotFound, "no executable at this path"))
        };
    }
    let path = std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|p| is_exec(p))
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "not on PATH"))
}

/// What a failed CRIU run's log says went wrong: its first error line, where the failure
/// began, and its last one when that differs (the errors that follow the first are mostly
/// its consequences: a restore that failed closes cgroupd's socket, and cgroupd's "recv req
/// error" is then the log's last error, which named only the symptom). CRIU's closing
/// "Dumping FAILED." / "Restoring FAILED." lines are no cause.
fn criu_cause(log: &str) -> String {
    // From "Error (", without the line's time stamp and pid.
    let mut errors =
        log.lines().filter_map(|l| l.find("Error (").map(|at| l[at..].trim())).filter(|l| !l.contains("FAILED."));
    match (errors.next(), errors.next_back()) {
        (None, _) => "no error line".to_string(),
        (Some(first), None) => first.to_string(),
        (Some(first), Some(last)) => format!("{first} (its last error: {last})"),
    }
}

/// Copies what a successful dump's CRIU left in its work directory, its log (`dump.log`) and
/// its figures (`stats-dump`, written where CRIU runs, not with the images), beside the
/// runtime's state as `<root>/<id>.criu-checkpoint-last.<name>`, each replacing the previous
/// dump's, for the dump breakdown of scripts/bench-checkpoint. Returns the kept log, None
/// when there is none.
fn keep_last_dump_files(root: &Path, id: &str, work: &Path) -> Option<PathBuf> {
    let mut kept_log = None;
    for name in ["dump.log", "stats-dump"] {
        let kept = root.join(format!("{id}.criu-checkpoint-last.{name}"));
        let tmp = root.join(format!(".{id}.criu-checkpoint-last.{name}.tmp"));
        if std::fs::copy(work.join(name), &tmp).is_err() || std::fs::rename(&tmp, &kept).is_err() {
            let _ = std::fs::remove_file(&tmp);
            continue;
        }
        if name == "dump.log" {
            kept_log = Some(kept);
        }
    }
    kept_log
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dump breakdown reads the newest successful dump's CRIU log and stats after the
    /// turn, when the work directory holding them is gone: each dump's copies replace the
    /// ones before, and a dump without them keeps nothing (no temporary file left either).
    #[test]
    fn the_last_dump_log_and_stats_are_kept_once_per_container() {
        let dir = tempfile::tempdir().unwrap();
        let (root, work) = (dir.path().join("root"), dir.path().join("work"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        for (log, stats) in [("(00.010) first dump\n", "s1"), ("(00.020) second dump\n", "s2")] {
            std::fs::write(work.join("dump.log"), log).unwrap();
            std::fs::write(work.join("stats-dump"), stats).unwrap();
            let kept = keep_last_dump_files(&root, "c1", &work).expect("kept");
            assert_eq!(kept, root.join("c1.criu-checkpoint-last.dump.log"));
            assert_eq!(std::fs::read_to_string(&kept).unwrap(), log);
            let stats_kept = root.join("c1.criu-checkpoint-last.stats-dump");
            assert_eq!(std::fs::read_to_string(stats_kept).unwrap(), stats);
        }
        assert_eq!(keep_last_dump_files(&root, "c2", &dir.path().join("no-work")), None);
        let mut names: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["c1.criu-checkpoint-last.dump.log", "c1.criu-checkpoint-last.stats-dump"]);
    }

    #[test]
    fn last_line_skips_blank_lines() {
        assert_eq!(last_line(b"first\nsecond\n\n  \n").as_deref(), Some("second"));
        assert_eq!(last_line(b""), None);
    }

    #[tokio::test]
    async fn last_error_line_picks_the_last_error_entry() {
        let dir = std::env::temp_dir().join(format!("crab-rt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("x.log");
        std::fs::write(
            &log,
            concat!(
                "{\"level\":\"error\",\"msg\":\"first failure\"}\n",
                "{\"level\":\"warning\",\"msg\":\"noise\"}\n",
                "{\"level\":\"error\",\"msg\":\"container_linux.go: exec failed: no such file\"}\n",
                "{\"level\":\"info\",\"msg\":\"after\"}\n",
            ),
        )
        .unwrap();
        assert_eq!(last_error_line(&log).await.as_deref(), Some("container_linux.go: exec failed: no such file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A stand-in runtime (a shell script given `--root ... checkpoint ...`) that starts a child
    /// in its group, writes the child's pid, and hangs.
    fn hanging_runtime(dir: &Path, ignore_alarm: bool) -> (OciRuntime, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join(if ignore_alarm { "hangs-hard" } else { "hangs" });
        let child = dir.join(format!("{}.child", script.display()));
        let trap = if ignore_alarm { "trap '' ALRM\n" } else { "" };
        std::fs::write(&script, format!("#!/bin/sh\n{trap}sleep 30 &\necho $! > {}\nwait\n", child.display())).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let reaper = Reaper::default();
        reaper.start().unwrap();
        (OciRuntime::new(&script, dir.join("root"), false, reaper), child)
    }

    /// A stand-in runtime that logs one line for every verb and exits with `status`.
    fn logging_runtime(dir: &Path, status: i32) -> OciRuntime {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join(format!("exits-{status}"));
        // Its arguments: --root ROOT --log LOG --log-format json VERB ...
        std::fs::write(
            &script,
            format!("#!/bin/sh\necho '{{\"level\":\"info\",\"msg\":\"hi\"}}' >> \"$4\"\nexit {status}\n"),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let reaper = Reaper::default();
        reaper.start().unwrap();
        OciRuntime::new(&script, dir.join("root"), false, reaper)
    }

    #[tokio::test]
    async fn a_deleted_container_leaves_no_runtime_log_and_a_failed_delete_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        let runtime = logging_runtime(dir.path(), 0);
        runtime.state("c1").await.unwrap_err();
        let log = dir.path().join("root/c1.log");
        assert!(log.exists(), "the stand-in logs where the runtime is told to");
        runtime.delete("c1", true).await.unwrap();
        assert!(!log.exists(), "the log of a deleted container is left behind");

        let failing = logging_runtime(dir.path(), 1);
        failing.delete("c2", true).await.unwrap_err();
        assert!(dir.path().join("root/c2.log").exists(), "the log of a container whose delete failed is gone");
    }

    fn gone(pid: u32) -> bool {
        // Absent, or a zombie its new parent has not reaped yet.
        crab_sys::proc_stat::read(pid).map_or(true, |stat| crab_sys::proc_stat::state(&stat) == Some('Z'))
    }

    async fn bounded_run(runtime: &OciRuntime, grace: Duration) -> (RuntimeError, Duration) {
        let started = std::time::Instant::now();
        let args: Vec<OsString> = vec!["checkpoint".into(), "c1".into()];
        let bound = Some((Duration::from_millis(300), grace));
        let result = tokio::time::timeout(
            Duration::from_secs(20),
            runtime.run_bounded("c1", &args, ProcessStdio::default(), bound, None),
        )
        .await
        .expect("a bounded run returns");
        (result.unwrap_err(), started.elapsed())
    }

    async fn wait_gone(pid: u32) -> bool {
        for _ in 0..100 {
            if gone(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    #[tokio::test]
    async fn a_run_past_its_deadline_stops_on_sigalrm_with_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let (runtime, child) = hanging_runtime(dir.path(), false);
        let (err, took) = bounded_run(&runtime, Duration::from_secs(10)).await;
        assert!(err.is_timeout(), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("checkpoint: dump timed out after 300 ms") && text.contains("stopped on SIGALRM"),
            "{text}"
        );
        assert!(took < Duration::from_secs(5), "did not wait for the grace: {took:?}");
        let child: u32 = std::fs::read_to_string(&child).unwrap().trim().parse().unwrap();
        assert!(wait_gone(child).await, "the runtime's child {child} outlived the abandoned run");
    }

    #[tokio::test]
    async fn a_run_that_ignores_sigalrm_is_killed_after_the_grace() {
        let dir = tempfile::tempdir().unwrap();
        let (runtime, child) = hanging_runtime(dir.path(), true);
        let grace = Duration::from_millis(400);
        let (err, took) = bounded_run(&runtime, grace).await;
        let text = err.to_string();
        assert!(err.is_timeout() && text.contains("killed (no exit 400 ms after SIGALRM)"), "{text}");
        assert!(took >= Duration::from_millis(700) && took < Duration::from_secs(5), "{took:?}");
        let child: u32 = std::fs::read_to_string(&child).unwrap().trim().parse().unwrap();
        assert!(wait_gone(child).await, "the runtime's child {child} outlived the abandoned run");
    }

    #[tokio::test]
    async fn an_unbounded_run_is_not_cut() {
        let dir = tempfile::tempdir().unwrap();
        let reaper = Reaper::default();
        reaper.start().unwrap();
        let runtime = OciRuntime::new("/bin/echo", dir.path(), false, reaper);
        let out = runtime.run("c1", &["state".into()], ProcessStdio::default()).await.unwrap();
        assert!(String::from_utf8_lossy(&out).trim_end().ends_with("state"), "{out:?}");
    }

    /// A dump hook that holds `lock` from before the dump to after it, as the shim's holds the
    /// spawner slot's `connecting`.
    #[derive(Debug)]
    struct HoldsLock {
        lock: std::sync::Arc<tokio::sync::Mutex<()>>,
        held: std::sync::Mutex<Option<tokio::sync::OwnedMutexGuard<()>>>,
    }

    #[async_trait::async_trait]
    impl DumpHooks for HoldsLock {
        async fn before_dump(&self) {
            let guard = self.lock.clone().lock_owned().await;
            *self.held.lock().unwrap() = Some(guard);
        }

        async fn after_dump(&self, _dumped_to: Option<&Path>) {
            self.held.lock().unwrap().take();
        }
    }

    /// A Pause that takes the lock a dump's hook takes (the shim's Pause detaching the spawner)
    /// and a dump starting while it holds it both finish: the lock is taken under the runtime's,
    /// as the hook takes it. Taken before it (lock, then `pause`), the dump held the runtime's
    /// lock and waited in its hook while the Pause waited for the runtime's lock, for ever
    /// (containerd's checkpoint of a session, issue 19).
    #[tokio::test]
    async fn a_pause_and_a_dump_that_take_the_same_lock_both_finish() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("runtime-ok");
        std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let reaper = Reaper::default();
        reaper.start().unwrap();
        let runtime = OciRuntime::new(&script, dir.path().join("root"), false, reaper);
        let connecting = std::sync::Arc::new(tokio::sync::Mutex::new(()));
        runtime.add_dump_hooks(std::sync::Arc::new(HoldsLock { lock: connecting.clone(), held: Default::default() }));

        let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
        let pausing = {
            let (runtime, connecting) = (runtime.clone(), connecting.clone());
            tokio::spawn(async move {
                let prepare = async move {
                    let guard = connecting.lock_owned().await;
                    let _ = locked_tx.send(());
                    // The dump starts while the lock is held, before the pause runs.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    guard
                };
                let (guard, paused) = runtime.pause_after("c1", prepare).await;
                drop(guard);
                paused
            })
        };
        locked_rx.await.unwrap();
        let dumping = {
            let runtime = runtime.clone();
            let image_path = dir.path().join("images");
            tokio::spawn(async move {
                runtime
                    .checkpoint("c1", &CheckpointOptions { image_path, leave_running: true, ..Default::default() })
                    .await
            })
        };
        let both = async { (pausing.await.unwrap(), dumping.await.unwrap()) };
        let (paused, dumped) =
            tokio::time::timeout(Duration::from_secs(10), both).await.expect("the pause and the dump both finish");
        paused.expect("pause");
        dumped.expect("dump");
    }

    /// A failed restore's message names where the failure began, not only the cascade after it.
    #[test]
    fn a_failed_criu_run_is_named_by_its_first_error_and_its_last() {
        let restore = "(00.101) 1: Restoring FS\n\
            (00.120) 7: Error (criu/files-reg.c:2101): Can't open file tmp/x on restore: No such file or directory\n\
            (00.121) 7: Error (criu/files.c:1234): Unable to open fd=3 id=0x11\n\
            (00.130) Error (criu/cgroup.c:1998): cg: cgroupd: recv req error: No such file or directory\n\
            (00.131) Error (criu/cr-restore.c:2480): Restoring FAILED.\n";
        let named = criu_cause(restore);
        assert!(named.starts_with("Error (criu/files-reg.c:2101): Can't open file tmp/x"), "{named}");
        assert!(
            named.ends_with(
                "(its last error: Error (criu/cgroup.c:1998): cg: cgroupd: recv req error: No such file or directory)"
            ),
            "{named}"
        );
        let dump = "(00.2) Error (criu/parasite.c:12): can't seize\n(00.3) Error (criu/cr-dump.c:2): Dumping FAILED.\n";
        assert_eq!(criu_cause(dump), "Error (criu/parasite.c:12): can't seize");
        assert_eq!(criu_cause("(00.1) Dumping finished successfully\n"), "no error line");
    }

    /// A dump abandoned at its deadline names CRIU's last log line (where it hung) and keeps
    /// the log, which the next checkpoint's work directory would replace.
    #[tokio::test]
    async fn an_abandoned_dump_names_criu_s_last_line_and_keeps_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let (runtime, _child) = hanging_runtime(dir.path(), false);
        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        // The runtime's state directory, where a shim's runtime keeps its containers.
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        let log = "(00.001) Dumping processes\n(00.002) Running network-lock-scripts\n\n";
        std::fs::write(work.join("dump.log"), log).unwrap();
        let opts = CheckpointOptions {
            image_path: dir.path().join("images"),
            work_path: Some(work),
            deadline: Some(DumpDeadline { after: Duration::from_millis(300), thaw_pid: None }),
            ..Default::default()
        };
        let err = tokio::time::timeout(Duration::from_secs(20), runtime.checkpoint("c1", &opts))
            .await
            .expect("an abandoned dump returns")
            .unwrap_err();
        let text = err.to_string();
        assert!(err.is_timeout(), "{text}");
        assert!(text.contains("criu's last line: (00.002) Running network-lock-scripts"), "{text}");
        let kept = dir.path().join("root/c1.criu-checkpoint.log");
        assert!(text.contains(&kept.display().to_string()), "{text}");
        assert_eq!(std::fs::read_to_string(kept).unwrap(), log);
    }

    /// A pause whose runtime hangs (stuck on a cgroup file) is abandoned at the verb bound, so
    /// the shim's Pause, and every verb waiting for the lock it holds, returns.
    #[tokio::test]
    async fn a_hung_pause_is_abandoned_at_the_verb_bound() {
        let dir = tempfile::tempdir().unwrap();
        let (runtime, _child) = hanging_runtime(dir.path(), false);
        let runtime = std::sync::Arc::new(runtime.with_verb_bound(Duration::from_millis(300)));
        let pausing = {
            let runtime = runtime.clone();
            tokio::spawn(async move { runtime.pause("c1").await })
        };
        // Waits for the lock the pause holds, then hangs as well: bounded too.
        let resuming = {
            let runtime = runtime.clone();
            tokio::spawn(async move { runtime.resume("c1").await })
        };
        let both = async { (pausing.await.unwrap(), resuming.await.unwrap()) };
        let (paused, resumed) = tokio::time::timeout(Duration::from_secs(20), both).await.expect("both return");
        let text = paused.unwrap_err().to_string();
        assert!(text.contains("pause: the runtime timed out after 300 ms"), "{text}");
        // The fake runtime's `state` hangs too: nothing says which cgroup to thaw.
        assert!(text.contains("the container was not thawed, its state is unknown"), "{text}");
        assert!(resumed.unwrap_err().is_timeout());
    }

    #[test]
    fn which_names_missing_binaries() {
        assert!(which(Path::new("sh")).is_ok());
        assert!(which(Path::new("/nonexistent/runc")).is_err());
        assert!(which(Path::new("crab-no-such-runtime")).is_err());
    }
}
