//! crabd: the node's inspector and commit bandwidth, served on a Unix socket.
//!
//! Only root may talk to it: the socket's directory is 0700, the socket 0600,
//! and each connection's peer credentials (SO_PEERCRED) must say uid 0. One
//! crabd serves a socket: a lock file next to it makes a second one exit
//! quietly, which is what several shims starting crabd at once rely on.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, mpsc, oneshot};

use super::NodeError;
use super::bucket::{BucketConfig, CommitRequest, Decision, Outcome, Scheduler, Ticket};
use super::protocol::{
    self, MAX_REQUEST_BYTES, NodeStatus, PROTOCOL_VERSION, ProtocolError, Reply, Request, WatchedStatus,
};
use crab_inspector::{Inspector, InspectorConfig, WatchedContainer};

/// How often watches of containers whose init is gone are dropped (a shim
/// that died never says unwatch).
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub socket: PathBuf,
    pub bucket: BucketConfig,
    pub ring_buffer_bytes: u32,
    /// Bound on each container's effects between two drains.
    pub max_effects_bytes: usize,
}

/// What crabd remembers of a watch, to answer a repeated watch and to notice
/// a container whose init is gone.
#[derive(Clone)]
struct Watch {
    cgroup_id: u64,
    root_pid: u32,
    /// The init's start time (field 22 of /proc/pid/stat): a reused pid differs.
    root_start: Option<u64>,
}

struct Node {
    inspector: Inspector,
    bandwidth: Bandwidth,
    watches: Mutex<HashMap<String, Watch>>,
    instance: String,
    started: Instant,
}

/// Runs crabd until SIGTERM or SIGINT. Returns at once (Ok) when another
/// crabd already serves the socket.
pub async fn run(options: ServerOptions) -> Result<(), NodeError> {
    let dir = options.socket.parent().unwrap_or(Path::new("/")).to_path_buf();
    prepare_private_dir(&dir)?;
    let lock_path = options.socket.with_extension("lock");
    let Some(_lock) = take_lock(&lock_path)? else {
        tracing::info!(socket = %options.socket.display(), "another crabd serves this socket; exiting");
        return Ok(());
    };
    let inspector = Inspector::start(InspectorConfig {
        ring_buffer_bytes: options.ring_buffer_bytes,
        max_effects_bytes: options.max_effects_bytes,
        ..Default::default()
    })
    .await?;
    let node = Arc::new(Node {
        inspector,
        bandwidth: Bandwidth::start(options.bucket.clone()),
        watches: Mutex::new(HashMap::new()),
        instance: format!("{}-{}", std::process::id(), crab_inspector::monotonic_now_ns()),
        started: Instant::now(),
    });
    let listener = bind_private(&options.socket)?;
    tracing::info!(socket = %options.socket.display(), instance = %node.instance, identity = %protocol::compat_identity(),
        rate = options.bucket.rate_bytes_per_s, burst = options.bucket.burst_bytes, "crabd serving");
    tokio::spawn(sweep_dead_watches(node.clone()));
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|source| NodeError::Io { what: "installing the SIGTERM handler", path: "-".into(), source })?;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(serve_connection(node.clone(), stream));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = terminate.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    tracing::info!("crabd stopping");
    let _ = std::fs::remove_file(&options.socket);
    Ok(())
}

/// Creates `dir` 0700 or tightens an existing one to 0700.
fn prepare_private_dir(dir: &Path) -> Result<(), NodeError> {
    let io = |what, source| NodeError::Io { what, path: dir.to_path_buf(), source };
    match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(source) => return Err(io("creating crabd's directory", source)),
    }
    let meta = std::fs::metadata(dir).map_err(|e| io("crabd's directory", e))?;
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(dir = %dir.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "tightening to 0700");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| io("chmod 0700", e))?;
    }
    Ok(())
}

/// An exclusive, non-blocking flock; None when another process holds it.
fn take_lock(path: &Path) -> Result<Option<std::fs::File>, NodeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| NodeError::Io { what: "opening the lock file", path: path.into(), source })?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Ok(None);
        }
        return Err(NodeError::Io { what: "locking", path: path.into(), source: error });
    }
    Ok(Some(file))
}

/// Binds `socket` readable and writable by root only, replacing a stale one
/// (the lock says no live crabd owns it).
fn bind_private(socket: &Path) -> Result<UnixListener, NodeError> {
    let io = |what, source| NodeError::Io { what, path: socket.to_path_buf(), source };
    match std::fs::remove_file(socket) {
        Ok(()) => tracing::info!(socket = %socket.display(), "removed a stale socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing a stale socket", e)),
    }
    // The socket must never exist with looser permissions, not even briefly.
    // SAFETY: umask only changes this process's file creation mask.
    let previous = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(socket);
    // SAFETY: as above; the mask is put back as it was.
    unsafe { libc::umask(previous) };
    let listener = bound.map_err(|e| io("binding", e))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(|e| io("chmod 0600", e))?;
    Ok(listener)
}

/// What the reading half hands to the connection's task.
type Incoming = Result<Request, ProtocolError>;

async fn serve_connection(node: Arc<Node>, stream: UnixStream) {
    let (read_half, mut writer) = stream.into_split();
    let peer = read_half.as_ref().peer_cred();
    match peer.as_ref().map(|c| c.uid()) {
        Ok(0) => {}
        Ok(uid) => {
            tracing::warn!(uid, pid = ?peer.as_ref().ok().and_then(|c| c.pid()), "refused a non-root peer");
            let reply = Reply::error(format!("peer uid {uid} refused: crabd serves root only"));
            let _ = protocol::write_message(&mut writer, &reply).await;
            return;
        }
        Err(error) => {
            tracing::warn!(%error, "no peer credentials: connection refused");
            return;
        }
    }
    let (incoming_tx, mut incoming) = mpsc::channel::<Incoming>(4);
    // A reader task of its own, so that a waiting acquire still notices a
    // cancel or a closed connection (reading a frame is not cancel-safe).
    tokio::spawn(async move {
        let mut read_half = read_half;
        loop {
            let message = protocol::read_message::<_, Request>(&mut read_half, MAX_REQUEST_BYTES).await;
            let failed = message.is_err();
            if incoming_tx.send(message).await.is_err() || failed {
                return;
            }
        }
    });
    let mut greeted = false;
    while let Some(message) = incoming.recv().await {
        let request = match message {
            Ok(request) => request,
            Err(ProtocolError::Closed) => return,
            Err(error) => {
                tracing::warn!(%error, "bad frame: closing the connection");
                let _ = protocol::write_message(&mut writer, &Reply::error(&error)).await;
                let _ = writer.shutdown().await;
                return;
            }
        };
        let replies = match (greeted, request) {
            (false, Request::Hello { version, identity })
                if version == PROTOCOL_VERSION && protocol::compatible(identity.as_deref()) =>
            {
                greeted = true;
                vec![Reply::Hello {
                    version: PROTOCOL_VERSION,
                    identity: Some(protocol::compat_identity()),
                    instance: node.instance.clone(),
                    pid: std::process::id(),
                    chunk_bytes: Some(node.bandwidth.chunk_bytes()),
                }]
            }
            (false, Request::Hello { version, identity }) => {
                // A shim of another build: it reads the refusal and goes on without crabd.
                tracing::warn!(version, client_identity = identity.as_deref().unwrap_or("none (older than identities)"),
                    crabd_identity = %protocol::compat_identity(), "refused a client of another build");
                let reply = Reply::Unsupported {
                    supported: vec![PROTOCOL_VERSION],
                    identity: Some(protocol::compat_identity()),
                };
                let _ = protocol::write_message(&mut writer, &reply).await;
                return;
            }
            (false, other) => {
                let reply = Reply::error(format!("{} before hello: say hello{{version}} first", other.name()));
                let _ = protocol::write_message(&mut writer, &reply).await;
                return;
            }
            (true, Request::Acquire { sandbox, bytes, kind, turn, supersedable }) => {
                let request = CommitRequest { sandbox, bytes, kind, turn, supersedable };
                match acquire_while_listening(&node, request, &mut incoming).await {
                    Some(reply) => vec![reply],
                    None => return,
                }
            }
            (true, request) => node.handle(request).await,
        };
        for reply in replies {
            if let Err(error) = protocol::write_message(&mut writer, &reply).await {
                tracing::debug!(%error, "client went away");
                return;
            }
        }
    }
}

/// Waits for a grant while watching the connection: a `cancel` withdraws the
/// request, a closed connection too (then None: nobody to answer).
async fn acquire_while_listening(
    node: &Node,
    request: CommitRequest,
    incoming: &mut mpsc::Receiver<Incoming>,
) -> Option<Reply> {
    let (sandbox, bytes, turn) = (request.sandbox.clone(), request.bytes, request.turn);
    let decision = node.bandwidth.acquire(request);
    tokio::pin!(decision);
    loop {
        tokio::select! {
            decision = &mut decision => {
                let waited_ms = decision.waited.as_secs_f64() * 1e3;
                return Some(match decision.outcome {
                    Outcome::Granted => {
                        tracing::debug!(%sandbox, turn, bytes, waited_ms, "bandwidth granted");
                        Reply::Granted { waited_ms }
                    }
                    Outcome::Superseded { by_turn } => {
                        tracing::info!(%sandbox, turn, by_turn, bytes, waited_ms, "waiting commit superseded");
                        Reply::Superseded { by_turn, waited_ms }
                    }
                });
            }
            message = incoming.recv() => match message {
                Some(Ok(Request::Cancel)) => return Some(Reply::Cancelled),
                Some(Ok(other)) => {
                    // Answering now would interleave with the grant: refuse and go on waiting.
                    tracing::warn!(request = other.name(), "request while an acquire waits: ignored");
                }
                Some(Err(_)) | None => return None,
            },
        }
    }
}

impl Node {
    async fn handle(&self, request: Request) -> Vec<Reply> {
        let reply = match request {
            Request::Hello { .. } => Reply::error("hello twice"),
            Request::Watch { container, cgroup_id, root_pid } => {
                match self.watch(&container, cgroup_id, root_pid).await {
                    Ok(()) => Reply::Ok,
                    Err(e) => Reply::error(e),
                }
            }
            Request::Drain { container, until_ns } => match self.inspector.drain(&container, until_ns).await {
                Ok(turn) => return protocol::effect_frames(turn.effects, turn.lost_events, turn.overflow),
                Err(e) => Reply::error(e),
            },
            Request::Unwatch { container } => {
                self.watches.lock().expect("watches lock").remove(&container);
                self.bandwidth.forget(&container);
                match self.inspector.unwatch(&container).await {
                    Ok(_) => Reply::Ok,
                    Err(e) => Reply::error(e),
                }
            }
            Request::ProcessCaptured { sandbox, turn } => {
                let dropped = self.bandwidth.supersede(&sandbox, turn);
                tracing::debug!(%sandbox, turn, dropped, "newer process capture reported");
                Reply::Ok
            }
            Request::Evict { sandbox, evicting } => {
                self.bandwidth.set_evicting(&sandbox, evicting);
                Reply::Ok
            }
            Request::Status => Reply::Status(Box::new(self.status())),
            Request::Acquire { .. } => unreachable!("served by acquire_while_listening"),
            Request::Cancel => Reply::error("cancel: no acquire is waiting"),
        };
        vec![reply]
    }

    /// Watching again what is already watched is fine (a shim reconnecting to
    /// the same crabd); a container id seen under another cgroup is a new
    /// container that reuses the id, and replaces the old watch.
    async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), NodeError> {
        let existing = self.watches.lock().expect("watches lock").get(container).cloned();
        if let Some(existing) = existing {
            if existing.cgroup_id == cgroup_id {
                return Ok(());
            }
            tracing::info!(
                container,
                old = existing.cgroup_id,
                new = cgroup_id,
                "container id reused: replacing its watch"
            );
            let _ = self.inspector.unwatch(container).await;
        }
        let watched = WatchedContainer {
            id: container.into(),
            root_pid: Some(root_pid),
            rootfs: Some(format!("/proc/{root_pid}/root").into()),
        };
        self.inspector.watch(cgroup_id, watched).await?;
        let watch = Watch { cgroup_id, root_pid, root_start: process_start_time(root_pid) };
        self.watches.lock().expect("watches lock").insert(container.into(), watch);
        Ok(())
    }

    fn status(&self) -> NodeStatus {
        let mut watched: Vec<WatchedStatus> = self
            .watches
            .lock()
            .expect("watches lock")
            .iter()
            .map(|(container, w)| WatchedStatus {
                container: container.clone(),
                cgroup_id: w.cgroup_id,
                root_pid: w.root_pid,
                lost_events: self.inspector.lost_events(container).unwrap_or(0),
            })
            .collect();
        watched.sort_by(|a, b| a.container.cmp(&b.container));
        NodeStatus {
            version: PROTOCOL_VERSION,
            identity: protocol::compat_identity(),
            pid: std::process::id(),
            instance: self.instance.clone(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            watched,
            bucket: self.bandwidth.status(),
        }
    }
}

/// The start time of a container's init, whose name is the tenant's to choose: read as text, a
/// name that is not UTF-8 made it look gone, and the next sweep dropped its watch.
fn process_start_time(pid: u32) -> Option<u64> {
    crab_sys::proc_stat::start_time(&crab_sys::proc_stat::read(pid).ok()?)
}

async fn sweep_dead_watches(node: Arc<Node>) {
    let mut ticker = tokio::time::interval(SWEEP_INTERVAL);
    loop {
        ticker.tick().await;
        let dead: Vec<String> = node
            .watches
            .lock()
            .expect("watches lock")
            .iter()
            .filter(|(_, w)| w.root_start.is_none() || process_start_time(w.root_pid) != w.root_start)
            .map(|(c, _)| c.clone())
            .collect();
        for container in dead {
            tracing::info!(%container, "its init is gone and nobody unwatched it: dropping the watch");
            node.watches.lock().expect("watches lock").remove(&container);
            node.bandwidth.forget(&container);
            let _ = node.inspector.unwatch(&container).await;
        }
    }
}

/// The token bucket in real time: a driver task grants requests as tokens
/// accrue and wakes the waiters.
struct Bandwidth {
    shared: Arc<BandwidthShared>,
}

struct BandwidthShared {
    state: Mutex<BandwidthState>,
    changed: Notify,
}

struct BandwidthState {
    scheduler: Scheduler,
    waiters: HashMap<Ticket, oneshot::Sender<Decision>>,
}

/// Withdraws a request whose waiter gave up (dropped future).
struct PendingGrant {
    shared: Arc<BandwidthShared>,
    ticket: Ticket,
}

impl Drop for PendingGrant {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock().expect("bandwidth lock");
        state.waiters.remove(&self.ticket);
        if state.scheduler.cancel(self.ticket) {
            self.shared.changed.notify_one();
        }
    }
}

impl Bandwidth {
    fn start(config: BucketConfig) -> Self {
        let shared = Arc::new(BandwidthShared {
            state: Mutex::new(BandwidthState {
                scheduler: Scheduler::new(config, Instant::now()),
                waiters: HashMap::new(),
            }),
            changed: Notify::new(),
        });
        tokio::spawn(drive(shared.clone()));
        Self { shared }
    }

    /// Resolves when `request` may write its bytes, or is superseded.
    fn acquire(&self, request: CommitRequest) -> impl std::future::Future<Output = Decision> + use<> {
        let (tx, rx) = oneshot::channel();
        let ticket = {
            let mut state = self.shared.state.lock().expect("bandwidth lock");
            let ticket = state.scheduler.enqueue(request, Instant::now());
            state.waiters.insert(ticket, tx);
            ticket
        };
        self.shared.changed.notify_one();
        let guard = PendingGrant { shared: self.shared.clone(), ticket };
        async move {
            // The driver never drops a waiter it has not answered.
            let decision = rx.await.unwrap_or(Decision { ticket, waited: Duration::ZERO, outcome: Outcome::Granted });
            drop(guard);
            decision
        }
    }

    fn set_evicting(&self, sandbox: &str, evicting: bool) {
        self.shared.state.lock().expect("bandwidth lock").scheduler.set_evicting(sandbox, evicting);
        self.shared.changed.notify_one();
    }

    fn supersede(&self, sandbox: &str, turn: u64) -> usize {
        let dropped =
            self.shared.state.lock().expect("bandwidth lock").scheduler.supersede(sandbox, turn, Instant::now());
        // The driver answers the dropped waiters at its next poll.
        self.shared.changed.notify_one();
        dropped
    }

    fn chunk_bytes(&self) -> u64 {
        self.shared.state.lock().expect("bandwidth lock").scheduler.config().chunk()
    }

    fn forget(&self, sandbox: &str) {
        self.shared.state.lock().expect("bandwidth lock").scheduler.forget(sandbox);
    }

    fn status(&self) -> protocol::BucketStatus {
        self.shared.state.lock().expect("bandwidth lock").scheduler.status(Instant::now())
    }
}

async fn drive(shared: Arc<BandwidthShared>) {
    loop {
        let next = {
            let mut state = shared.state.lock().expect("bandwidth lock");
            let (decisions, next) = state.scheduler.poll(Instant::now());
            for decision in decisions {
                if let Some(waiter) = state.waiters.remove(&decision.ticket) {
                    let _ = waiter.send(decision);
                }
            }
            next
        };
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {}
                    _ = shared.changed.notified() => {}
                }
            }
            None => shared.changed.notified().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container's init runs the tenant's entrypoint and is named as the tenant likes, by
    /// `prctl`, `/proc/self/comm` or the file it executed: crabd keeps telling it alive.
    #[test]
    fn the_start_time_of_a_process_named_in_bytes_that_are_not_utf8_is_read() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join(std::ffi::OsStr::from_bytes(b"\xff\xfe-init"));
        std::os::unix::fs::symlink("/bin/sleep", &link).unwrap();
        let mut child = std::process::Command::new(&link).arg("30").spawn().unwrap();
        let started = process_start_time(child.id());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(started.is_some(), "crabd would drop the watch of a live sandbox");
    }
}
