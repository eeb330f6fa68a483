//! Entry point of `containerd-shim-crab-v2`: the actions containerd invokes.
//!
//! - `start`: find or spawn the shim serving this container's group (one
//!   per pod, keyed by the `io.kubernetes.cri.sandbox-id` annotation), print
//!   its ttrpc address.
//! - `delete`: clean up after a shim that died: delete the container from the
//!   runtime, unmount its rootfs, report it killed.
//! - no action: serve the Task API on `-socket` until Shutdown.
//! - run by CRIU as its action script (`CRTOOLS_SCRIPT_ACTION` set): see
//!   [`crab_runtime::criu`].
//!
//! containerd 1.6 and 1.7 speak task API v2 and read `start`'s output as a
//! bare address; containerd 2 speaks v3. The shim answers both service names.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use containerd_shim::Flags;
use containerd_shim_protos::protobuf::Message;
use containerd_shim_protos::shim_async::{Task, create_task};
use containerd_shim_protos::ttrpc::r#async::Server;
use tokio_util::sync::CancellationToken;

use super::service::{EventSink, TaskService};
use crab_config::Config;
use crab_runtime::{OciRuntime, Reaper};

const SANDBOX_ID_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";
/// Written into the bundle at serve time so `delete` can find the runtime
/// state of a container whose shim is gone.
pub const RUNTIME_RECORD: &str = "crab-runtime.json";

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("arguments: {0}")]
    Args(String),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Other(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BootstrapError {
    let what = what.into();
    move |source| BootstrapError::Io { what, source }
}

/// Runs the binary; never returns.
pub fn main(runtime_id: &str) -> ! {
    // Run by CRIU as its action script during a restore (see runtime::criu).
    if let Ok(action) = std::env::var(crab_runtime::criu::ACTION_ENV) {
        std::process::exit(crab_runtime::criu::run_action(&action));
    }
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let code = match containerd_shim::parse(&args) {
        Ok(flags) => match run(runtime_id, flags) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{runtime_id}: {e}");
                1
            }
        },
        Err(e) => {
            eprintln!("{runtime_id}: {e}");
            1
        }
    };
    std::process::exit(code)
}

fn run(runtime_id: &str, flags: Flags) -> Result<(), BootstrapError> {
    if flags.version {
        println!("{}:\n  Version:  {}\n  Runtime:  {runtime_id}", binary_name(), env!("CARGO_PKG_VERSION"));
        return Ok(());
    }
    if flags.info {
        let info = containerd_shim_protos::types::introspection::RuntimeInfo {
            name: runtime_id.into(),
            version: Some(containerd_shim_protos::types::introspection::RuntimeVersion {
                version: env!("CARGO_PKG_VERSION").into(),
                ..Default::default()
            })
            .into(),
            ..Default::default()
        };
        let bytes = info.write_to_bytes().map_err(|e| BootstrapError::Other(e.to_string()))?;
        std::io::stdout().write_all(&bytes).map_err(io_err("write runtime info"))?;
        return Ok(());
    }
    // A subreaper adopts the container processes runc leaves behind; it must be
    // set before any child exists.
    if flags.action.is_empty() {
        set_subreaper()?;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(io_err("tokio runtime"))?;
    let result = rt.block_on(async move {
        match flags.action.as_str() {
            "start" => start(&flags).await,
            "delete" => delete(&flags).await,
            "" => serve(&flags).await,
            other => Err(BootstrapError::Args(format!("unknown action {other:?}"))),
        }
    });
    // Copy tasks of processes that are gone may still wait on their fifos:
    // nothing they could do matters once the server is down.
    rt.shutdown_background();
    result
}

fn binary_name() -> String {
    std::env::args()
        .next()
        .and_then(|a| Path::new(&a).file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

fn set_subreaper() -> Result<(), BootstrapError> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer and changes only this process's attributes.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(BootstrapError::Io {
            what: "PR_SET_CHILD_SUBREAPER".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn bundle_dir(flags: &Flags) -> PathBuf {
    if flags.bundle.is_empty() { std::env::current_dir().unwrap_or_default() } else { PathBuf::from(&flags.bundle) }
}

/// The shim group of this container: its pod sandbox, else itself.
fn grouping(bundle: &Path, id: &str) -> String {
    let spec: Option<serde_json::Value> =
        std::fs::read(bundle.join("config.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    spec.as_ref()
        .and_then(|s| s.get("annotations"))
        .and_then(|a| a.get(SANDBOX_ID_ANNOTATION))
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .unwrap_or(id)
        .to_string()
}

fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

/// Bound on the liveness check's connect: a socket whose owner does not accept may
/// still take a connection into its backlog, but a full backlog must not hold `start`.
const LIVENESS_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether a live shim of ours serves `address`. A socket that merely answers is not
/// enough: any process holding the listening socket (a crabd that inherited it from the
/// shim that started it was seen) accepts connections into its backlog and never
/// replies, and containerd's Create would wait on it forever. The kernel-recorded owner
/// of the listener (SO_PEERCRED: the process that last called listen() on it, the server
/// itself, see [`spawn_server`]) must be a running process of this very binary.
///
/// A listener whose recorded owner is gone (a shim started by an older build, which left
/// listen() to `start`; or a process that inherited the listener of a dead shim) proves
/// nothing by itself: it is live only if it answers a Task API request within a bound.
async fn live_shim_at(address: &str) -> bool {
    let path = socket_path(address);
    let stream = match tokio::time::timeout(LIVENESS_CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path)).await {
        Ok(Ok(stream)) => stream,
        _ => return false,
    };
    let Some(pid) = stream.peer_cred().ok().and_then(|cred| cred.pid()) else {
        return false;
    };
    drop(stream);
    match (executable_name(&format!("/proc/{pid}/exe")), executable_name("/proc/self/exe")) {
        (Some(owner), Some(own)) => owner == own,
        // The owner is gone: only an answer shows that a shim still serves the socket.
        (None, Some(_)) => answers_task_api(path).await,
        _ => false,
    }
}

/// Bound on the Task API probe of a socket whose owner is gone.
const LIVENESS_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Whether a Task API server answers at `path` (a reply of any status) within the bound.
async fn answers_task_api(path: &str) -> bool {
    use containerd_shim_protos::shim_async::{Client, TaskClient};
    use containerd_shim_protos::ttrpc;
    let client = match tokio::time::timeout(LIVENESS_PROBE_TIMEOUT, Client::connect(&format!("unix://{path}"))).await {
        Ok(Ok(client)) => client,
        _ => return false,
    };
    let tasks = TaskClient::new(client);
    let ctx = ttrpc::context::with_timeout(LIVENESS_PROBE_TIMEOUT.as_nanos() as i64);
    let request = containerd_shim_protos::api::ConnectRequest::default();
    matches!(
        tokio::time::timeout(LIVENESS_PROBE_TIMEOUT, tasks.connect(ctx, &request)).await,
        Ok(Ok(_)) | Ok(Err(ttrpc::Error::RpcStatus(_)))
    )
}

/// The file name of the executable behind a `/proc/<pid>/exe` link, without the
/// " (deleted)" the kernel appends once the binary was replaced (a re-staged shim).
fn executable_name(link: &str) -> Option<std::ffi::OsString> {
    let target = std::fs::read_link(link).ok()?;
    let name = target.file_name()?.to_string_lossy().into_owned();
    Some(name.strip_suffix(" (deleted)").unwrap_or(&name).into())
}

/// The server inherits its listening socket at this descriptor, bound by
/// `start`: containerd can connect as soon as `start` prints the address.
const LISTENER_FD: i32 = 3;
/// How long an exiting shim waits for its last events to reach containerd.
const EVENTS_FLUSH_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(2);
const LISTENER_FD_ENV: &str = "CRAB_SHIM_LISTENER_FD";

async fn start(flags: &Flags) -> Result<(), BootstrapError> {
    let bundle = bundle_dir(flags);
    let group = grouping(&bundle, &flags.id);
    let address = containerd_shim::socket_address(&flags.address, &flags.namespace, &group);
    // A live shim for the group (another container of the same pod) serves this one too.
    if !live_shim_at(&address).await {
        let path = socket_path(&address);
        if let Some(dir) = Path::new(path).parent() {
            std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        }
        let _ = std::fs::remove_file(path);
        let listener = std::os::unix::net::UnixListener::bind(path).map_err(io_err(format!("bind {path}")))?;
        spawn_server(flags, &address, listener)?;
    }
    std::fs::write(bundle.join("address"), &address).map_err(io_err("write address file"))?;
    // containerd 1.6 reads the whole output as the address: nothing else may be printed.
    let mut out = std::io::stdout();
    out.write_all(address.as_bytes()).map_err(io_err("write address"))?;
    out.flush().map_err(io_err("flush address"))
}

fn spawn_server(
    flags: &Flags,
    address: &str,
    listener: std::os::unix::net::UnixListener,
) -> Result<(), BootstrapError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(io_err("current executable"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["-namespace", &flags.namespace, "-id", &flags.id, "-address", &flags.address, "-socket", address]);
    if flags.debug {
        cmd.arg("-debug");
    }
    cmd.env(LISTENER_FD_ENV, LISTENER_FD.to_string());
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    let fd = listener.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and makes only
    // async-signal-safe system calls on descriptors; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            // Its own session: the shim must outlive containerd and ignore its signals.
            libc::setsid();
            // The server inherits the listener at LISTENER_FD and nothing else: dup2 clears
            // close-on-exec on the copy (dup2 of a descriptor onto itself does not, hence
            // the explicit F_SETFD), every other descriptor above stdio is closed by exec.
            if fd != LISTENER_FD && libc::dup2(fd, LISTENER_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::fcntl(LISTENER_FD, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            crab_sys::close_on_exec_from(LISTENER_FD as u32 + 1);
            // listen() again from this process (the server after exec): the kernel records the
            // caller as the listener's owner, which the liveness check of `start` reads.
            if libc::listen(LISTENER_FD, libc::SOMAXCONN) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // The child is deliberately not waited for: it is the long-lived server
    // and is re-parented when this `start` process exits.
    cmd.spawn().map_err(io_err("spawn shim server"))?;
    Ok(())
}

/// The listening socket: inherited from `start`, or bound here when the
/// server was started by hand.
fn server_listener(path: &str) -> Result<std::os::unix::net::UnixListener, BootstrapError> {
    use std::os::fd::FromRawFd;
    if std::env::var(LISTENER_FD_ENV).ok().as_deref() == Some(&LISTENER_FD.to_string()) {
        // SAFETY: `start` placed a listening socket at this descriptor for us alone.
        let listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(LISTENER_FD) };
        // SAFETY: the shim's server calls this before it starts any thread of its own, so no
        // other thread reads the environment while it changes.
        unsafe { std::env::remove_var(LISTENER_FD_ENV) };
        // Inherited without close-on-exec: nothing this shim starts (runc, crabd, CRIU)
        // may keep the shim's socket open after the shim is gone.
        nix::fcntl::fcntl(&listener, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC)).map_err(|e| {
            BootstrapError::Io { what: "close-on-exec on the inherited listener".into(), source: e.into() }
        })?;
        return Ok(listener);
    }
    if let Some(dir) = Path::new(path).parent() {
        std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    }
    let _ = std::fs::remove_file(path);
    std::os::unix::net::UnixListener::bind(path).map_err(io_err(format!("bind {path}")))
}

fn init_logging(debug: bool, level: &str) {
    use tracing_subscriber::EnvFilter;
    // containerd reads shim logs from the `log` fifo in the bundle.
    let log = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open("log").ok();
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(if debug { "debug" } else { level }));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_target(false);
    match log {
        Some(f) => {
            let writer = std::sync::Mutex::new(f);
            let _ = builder.with_writer(writer).try_init();
        }
        None => {
            let _ = builder.with_writer(std::io::stderr).try_init();
        }
    }
}

async fn serve(flags: &Flags) -> Result<(), BootstrapError> {
    if flags.socket.is_empty() {
        return Err(BootstrapError::Args("-socket is required to serve".into()));
    }
    let config = Config::load(None).unwrap_or_default();
    init_logging(flags.debug, &config.log.level);
    let reaper = Reaper::default();
    reaper.start().map_err(io_err("SIGCHLD handler"))?;

    let events_address = std::env::var("TTRPC_ADDRESS").ok().filter(|a| !a.is_empty());
    if events_address.is_none() {
        tracing::error!("TTRPC_ADDRESS is not set: events will not reach containerd");
    }
    let shutdown = CancellationToken::new();
    let events = EventSink::new(events_address, &flags.namespace);
    let path = socket_path(&flags.socket).to_string();
    let service: Arc<dyn Task + Send + Sync> =
        Arc::new(TaskService::new(&flags.namespace, events.clone(), reaper, shutdown.clone(), PathBuf::from(&path)));

    let listener = server_listener(&path)?;
    listener.set_nonblocking(true).map_err(io_err("listener"))?;
    let listener = containerd_shim_protos::ttrpc::r#async::transport::Listener::try_from(listener)
        .map_err(|e| BootstrapError::Other(format!("listen on {path}: {e}")))?;
    let mut services = create_task(service.clone());
    // Same messages, two service names: v2 for containerd 1.x, v3 for 2.x.
    if let Some(v3) = create_task(service).remove("containerd.task.v3.Task") {
        services.insert("containerd.task.v2.Task".into(), v3);
    }
    let mut server = Server::new().add_listener(listener).register_service(services);
    server.start().await.map_err(|e| BootstrapError::Other(format!("serve {path}: {e}")))?;
    tracing::info!(socket = %path, pid = std::process::id(), "serving");

    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(io_err("SIGTERM handler"))?;
    tokio::select! {
        // The Shutdown request unlinked the socket before it was answered.
        _ = shutdown.cancelled() => {}
        _ = sigterm.recv() => {
            tracing::info!("SIGTERM");
            let _ = std::fs::remove_file(&path);
        }
    }
    // Not unlinked again after this wait: by then a new shim of the same group may
    // serve a socket of the same name.
    let _ = server.shutdown().await;
    events.flush(EVENTS_FLUSH_AT_EXIT).await;
    Ok(())
}

/// Records which runtime serves the container, for `delete` after a shim crash.
pub fn write_runtime_record(bundle: &Path, runtime: &OciRuntime) -> std::io::Result<()> {
    let record = serde_json::json!({ "binary": runtime.binary(), "root": runtime.root() });
    std::fs::write(bundle.join(RUNTIME_RECORD), record.to_string())
}

async fn delete(flags: &Flags) -> Result<(), BootstrapError> {
    let bundle = bundle_dir(flags);
    let record: Option<serde_json::Value> =
        std::fs::read(bundle.join(RUNTIME_RECORD)).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let config = Config::load(None).unwrap_or_default();
    let field = |k: &str| record.as_ref().and_then(|r| r.get(k)).and_then(|v| v.as_str()).map(PathBuf::from);
    let binary = field("binary").unwrap_or(config.runtime.binary);
    let root = field("root").unwrap_or_else(|| config.runtime.root.join(&flags.namespace));
    let reaper = Reaper::default();
    reaper.start().map_err(io_err("SIGCHLD handler"))?;
    let runtime = OciRuntime::new(binary, root, config.runtime.systemd_cgroup, reaper);
    // Kill whatever is left, then delete; both may fail if the container is gone.
    let _ = runtime.kill(&flags.id, libc::SIGKILL as u32, true).await;
    if let Err(e) = runtime.delete(&flags.id, true).await
        && !e.is_no_container()
    {
        eprintln!("{}: runtime delete {}: {e}", binary_name(), flags.id);
    }
    super::container::unmount_rootfs(&bundle);
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let response = containerd_shim_protos::api::DeleteResponse {
        pid: 0,
        exit_status: 128 + libc::SIGKILL as u32,
        exited_at: Some(containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp {
            seconds: now.as_secs() as i64,
            nanos: now.subsec_nanos() as i32,
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    let bytes = response.write_to_bytes().map_err(|e| BootstrapError::Other(e.to_string()))?;
    std::io::stdout().write_all(&bytes).map_err(io_err("write delete response"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener bound and listened on by a process that then exits, held by its child that
    /// never accepts: the leak of issue 18 (crabd holding a dead shim's socket). Returns the
    /// holder's pid.
    fn listener_held_by_an_orphan(path: &Path) -> u32 {
        let script = "import os, socket, sys, time\n\
            s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n\
            pid = os.fork()\n\
            if pid:\n    print(pid, flush=True); os._exit(0)\n\
            null = os.open('/dev/null', os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2); time.sleep(60)\n";
        let out = std::process::Command::new("python3").args(["-c", script]).arg(path).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    #[tokio::test]
    async fn a_socket_held_by_anything_but_a_live_shim_is_not_a_live_shim() {
        let dir = tempfile::tempdir().unwrap();
        // Bound and listened on by this very binary (as the server does): live.
        let own = dir.path().join("own.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&own).unwrap();
        assert!(live_shim_at(own.to_str().unwrap()).await);
        // No socket, or nobody listening: not live.
        assert!(!live_shim_at(dir.path().join("absent.sock").to_str().unwrap()).await);
        // Another live program listening: not live, at once.
        let other = dir.path().join("other.sock");
        let mut python = std::process::Command::new("python3")
            .args(["-c", "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); print(flush=True); time.sleep(60)"])
            .arg(&other)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(python.stdout.take().unwrap()), &mut String::new())
            .unwrap();
        let started = std::time::Instant::now();
        assert!(!live_shim_at(other.to_str().unwrap()).await, "python3 is no shim");
        assert!(started.elapsed() < LIVENESS_PROBE_TIMEOUT, "decided by the owner, without a probe");
        let _ = python.kill();
        let _ = python.wait();
        // Its owner gone, held by a process that accepts nothing: not live, within the probe's bound.
        let orphaned = dir.path().join("orphaned.sock");
        let holder = listener_held_by_an_orphan(&orphaned);
        let started = std::time::Instant::now();
        let live = live_shim_at(orphaned.to_str().unwrap()).await;
        let took = started.elapsed();
        // SAFETY: kill(2) of the holder this test started.
        unsafe { libc::kill(holder as i32, libc::SIGKILL) };
        assert!(!live, "a listener whose owner is gone and that never answers");
        assert!(took < LIVENESS_PROBE_TIMEOUT * 3, "took {took:?}");
    }

    #[test]
    fn pods_share_one_shim() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"annotations":{"io.kubernetes.cri.sandbox-id":"pod-1"}}"#)
            .unwrap();
        assert_eq!(grouping(dir.path(), "ctr-a"), "pod-1");
        std::fs::write(dir.path().join("config.json"), r#"{"annotations":{}}"#).unwrap();
        assert_eq!(grouping(dir.path(), "ctr-a"), "ctr-a");
    }
}
