//! The shim's side of crab-init's spawner: one connection per container, over
//! which exec sessions are started, re-attached and listed, and their exits
//! arrive as events. The protocol is in [`crab_init::protocol`].

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crab_init::protocol::{self, FdRole, FrameError, Message, Request, SessionInfo, SpawnRequest, SpawnerKey};
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

#[derive(Debug, thiserror::Error)]
pub enum SpawnerError {
    #[error("spawner socket {path}: {source}")]
    Connect { path: PathBuf, source: std::io::Error },
    /// The socket's path in the container did not lead to a socket beneath its root.
    #[error("spawner socket {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    /// Something else in the container listens where the spawner should: it is never talked to.
    #[error("spawner socket {path} is served by pid {peer}, not by crab-init's spawner: {reason}")]
    Impostor { path: PathBuf, peer: i32, reason: String },
    #[error("spawner connection: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("spawner is not connected")]
    NotConnected,
    #[error("spawner closed the connection")]
    Closed,
    #[error("spawner did not answer within {0:?}")]
    Timeout(Duration),
    /// The spawner refused or failed the request; its message says why.
    #[error("{0}")]
    Refused(String),
    #[error("spawner sent {got} where {expected} was expected")]
    Unexpected { got: String, expected: &'static str },
    #[error("spawner message lists {listed} descriptors but carried {carried}")]
    MissingFds { listed: usize, carried: usize },
    #[error("exec {exec_id}: no pid behind the spawner's pidfd")]
    NoPid { exec_id: String },
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Generous: a connection given up before the hello stays in the spawner's
/// backlog until it runs again, and a loaded host can be slow to schedule it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// A session's descriptors as the shim holds them.
pub struct SessionFds {
    pub info: SessionInfo,
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    pub console: Option<OwnedFd>,
    pub pidfd: OwnedFd,
    /// The process's pid on the host, read from the pidfd.
    pub pid: u32,
}

struct Received {
    message: Message,
    fds: Vec<OwnedFd>,
}

struct Link {
    stream: Arc<UnixStream>,
    replies: mpsc::UnboundedReceiver<Received>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

#[derive(Default)]
struct Events {
    waiters: HashMap<String, oneshot::Sender<i32>>,
    /// Exits that came before anyone asked (raw wait status).
    early: HashMap<String, i32>,
}

pub struct SpawnerClient {
    /// Device and inode of the crab-init build bound into the container: the spawner runs it.
    binary: Option<(u64, u64)>,
    /// The key the spawner was given (see [`SpawnerKey`]); None for a spawner restored from a
    /// checkpoint taken before keys, which asks for none.
    key: Mutex<Option<SpawnerKey>>,
    link: tokio::sync::Mutex<Option<Link>>,
    events: Arc<Mutex<Events>>,
    host_pid: Mutex<Option<u32>>,
    /// Sessions found after a restore, not yet re-attached by an Exec.
    restored: Mutex<HashMap<String, SessionInfo>>,
    /// Set while detached on purpose (a dump): exits are queued, not lost.
    suspended: std::sync::atomic::AtomicBool,
}

impl SpawnerClient {
    /// `binary` is the crab-init file bound into the container.
    pub fn new(binary: &Path) -> Arc<Self> {
        use std::os::unix::fs::MetadataExt;
        Arc::new(Self {
            binary: std::fs::metadata(binary).ok().map(|m| (m.dev(), m.ino())),
            key: Mutex::new(None),
            link: Default::default(),
            events: Default::default(),
            host_pid: Mutex::new(None),
            restored: Default::default(),
            suspended: Default::default(),
        })
    }

    /// The key this container's spawner holds: made for it at Create, or the one its checkpoint
    /// recorded when it is restored.
    pub fn set_key(&self, key: Option<SpawnerKey>) {
        *self.key.lock().expect("spawner lock") = key;
    }

    pub fn key(&self) -> Option<SpawnerKey> {
        self.key.lock().expect("spawner lock").clone()
    }

    /// The spawner's pid on the host, once connected.
    pub fn host_pid(&self) -> Option<u32> {
        *self.host_pid.lock().expect("spawner lock")
    }

    pub fn is_suspended(&self) -> bool {
        self.suspended.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connects, retrying for up to `patience` (the spawner binds its socket
    /// just after the container's init starts). `init_pid` is the container's init on the
    /// host: only it, or its child running crab-init, may be listening (see [`verify_peer`]).
    pub async fn connect(&self, patience: Duration, init_pid: u32) -> Result<(), SpawnerError> {
        let socket = PathBuf::from(format!("/proc/{init_pid}/root{}", crab_init::SOCKET_PATH));
        let deadline = tokio::time::Instant::now() + patience;
        let stream = loop {
            match connect_socket_entry(init_pid).await {
                Ok(stream) => break stream,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(match e {
                        Unreachable::Io(source) => SpawnerError::Connect { path: socket, source },
                        Unreachable::Path(reason) => SpawnerError::Open { path: socket, reason },
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let peer = peer_pid(&stream).map_err(|source| SpawnerError::Connect { path: socket.clone(), source })?;
        if let Err(reason) = verify_peer(peer, init_pid, self.binary) {
            return Err(SpawnerError::Impostor { path: socket, peer, reason });
        }
        // Only now, with the listener known to be crab-init's: the key proves this is the shim.
        if let Some(key) = self.key() {
            let auth = protocol::encode(&Request::Auth { key: key.to_hex() });
            tokio::time::timeout(REQUEST_TIMEOUT, write_all(&stream, &auth))
                .await
                .map_err(|_| SpawnerError::Timeout(REQUEST_TIMEOUT))??;
        }
        let stream = Arc::new(stream);
        let (tx, mut replies) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_loop(stream.clone(), tx, self.events.clone()));
        let hello = tokio::time::timeout(HELLO_TIMEOUT, replies.recv()).await;
        let Ok(Some(hello)) = hello else {
            reader.abort();
            return Err(SpawnerError::Closed);
        };
        match hello.message {
            Message::Hello { .. } => {
                let pid = hello.fds.first().and_then(pidfd_pid);
                *self.host_pid.lock().expect("spawner lock") = pid;
            }
            Message::Error { message } => return Err(SpawnerError::Refused(message)),
            other => return Err(SpawnerError::Unexpected { got: format!("{other:?}"), expected: "hello" }),
        }
        *self.link.lock().await = Some(Link { stream, replies, reader });
        self.suspended.store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    pub async fn is_connected(&self) -> bool {
        self.link.lock().await.as_ref().is_some_and(|l| !l.reader.is_finished())
    }

    async fn request(&self, request: &Request) -> Result<Received, SpawnerError> {
        let mut guard = self.link.lock().await;
        let link = guard.as_mut().ok_or(SpawnerError::NotConnected)?;
        let exchange = async {
            write_all(&link.stream, &protocol::encode(request)).await?;
            let received = link.replies.recv().await.ok_or(SpawnerError::Closed)?;
            if let Message::Error { message } = received.message {
                return Err(SpawnerError::Refused(message));
            }
            Ok(received)
        };
        // A frozen container (paused) cannot answer; nothing may wait on it forever.
        let result = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .unwrap_or(Err(SpawnerError::Timeout(REQUEST_TIMEOUT)));
        if matches!(result, Err(SpawnerError::Closed | SpawnerError::Io(_) | SpawnerError::Timeout(_))) {
            *guard = None;
        }
        result
    }

    /// Registers for the exit of `exec_id` (before it is spawned or attached,
    /// so no exit can slip by); the receiver yields the raw wait status.
    pub fn exit_of(&self, exec_id: &str) -> oneshot::Receiver<i32> {
        let (tx, rx) = oneshot::channel();
        let mut events = self.events.lock().expect("spawner lock");
        match events.early.remove(exec_id) {
            Some(status) => {
                let _ = tx.send(status);
            }
            None => {
                events.waiters.insert(exec_id.to_string(), tx);
            }
        }
        rx
    }

    pub async fn spawn(&self, request: SpawnRequest) -> Result<SessionFds, SpawnerError> {
        let received = self.request(&Request::Spawn(request)).await?;
        self.take_session(received).await
    }

    /// Reads the host pid behind the reply's pidfd, then lets the spawner
    /// reap the process (it holds an exited one until this release).
    async fn take_session(&self, received: Received) -> Result<SessionFds, SpawnerError> {
        let exec_id = match &received.message {
            Message::Session { session, .. } => Some(session.exec_id.clone()),
            _ => None,
        };
        let session = session_fds(received);
        let Some(exec_id) = exec_id else { return session };
        let released = self.request(&Request::Release { exec_id }).await;
        let session = session?;
        released?;
        Ok(session)
    }

    /// Takes over a session that was restored, if `exec_id` names one with these args.
    pub async fn attach_restored(&self, exec_id: &str, args: &[String]) -> Option<Result<SessionFds, SpawnerError>> {
        let matches = self.restored.lock().expect("spawner lock").get(exec_id).is_some_and(|s| s.args == args);
        if !matches {
            return None;
        }
        self.restored.lock().expect("spawner lock").remove(exec_id);
        let attached = match self.request(&Request::Attach { exec_id: exec_id.into() }).await {
            Ok(received) => self.take_session(received).await,
            Err(e) => Err(e),
        };
        Some(attached)
    }

    pub async fn close_stdin(&self, exec_id: &str) -> Result<(), SpawnerError> {
        self.request(&Request::CloseStdin { exec_id: exec_id.into() }).await.map(drop)
    }

    pub async fn list(&self) -> Result<Vec<SessionInfo>, SpawnerError> {
        match self.request(&Request::List).await?.message {
            Message::Sessions { sessions } => Ok(sessions),
            other => Err(SpawnerError::Unexpected { got: format!("{other:?}"), expected: "sessions" }),
        }
    }

    /// Lists the sessions the spawner has (after a restore) and keeps the
    /// live ones for an Exec to re-attach by id.
    pub async fn adopt_sessions(&self) -> Result<usize, SpawnerError> {
        let sessions = self.list().await?;
        let mut restored = self.restored.lock().expect("spawner lock");
        for s in sessions.into_iter().filter(|s| !s.exited) {
            restored.insert(s.exec_id.clone(), s);
        }
        Ok(restored.len())
    }

    /// Closes the connection on the spawner's side first (a dump must not see
    /// a socket connected to the shim); exits are queued until [`Self::connect`].
    pub async fn detach(&self) -> Result<(), SpawnerError> {
        self.suspended.store(true, std::sync::atomic::Ordering::SeqCst);
        let done = self.request(&Request::Detach).await;
        let link = self.link.lock().await.take();
        if let Some(mut link) = link {
            // The spawner's close ends the reader: then the dump sees no connection.
            // (A JoinHandle that has completed must not be awaited again.)
            match tokio::time::timeout(Duration::from_secs(2), &mut link.reader).await {
                Ok(_) => drop(link),
                Err(_) => close_link(link).await,
            }
        }
        done.map(drop)
    }

    /// Closes the connection from this side only, for when the spawner
    /// cannot answer (its container is frozen). Its socket is left with a
    /// closed peer, which a dump takes as such; exits are queued meanwhile.
    pub async fn disconnect(&self) {
        self.suspended.store(true, std::sync::atomic::Ordering::SeqCst);
        let link = self.link.lock().await.take();
        if let Some(link) = link {
            close_link(link).await;
        }
    }

    /// Ends a suspension that will not be followed by a reconnect.
    pub fn resume_without_connection(&self) {
        self.suspended.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Closes the socket now, not whenever the aborted reader is dropped: the
/// reader holds a reference to it.
async fn close_link(mut link: Link) {
    link.reader.abort();
    let _ = (&mut link.reader).await;
    drop(link);
}

fn session_fds(received: Received) -> Result<SessionFds, SpawnerError> {
    let Message::Session { session, fds: roles } = received.message else {
        return Err(SpawnerError::Unexpected { got: format!("{:?}", received.message), expected: "session" });
    };
    if roles.len() != received.fds.len() {
        return Err(SpawnerError::MissingFds { listed: roles.len(), carried: received.fds.len() });
    }
    let (mut stdin, mut stdout, mut stderr, mut console, mut pidfd) = (None, None, None, None, None);
    for (role, fd) in roles.into_iter().zip(received.fds) {
        let slot = match role {
            FdRole::Stdin => &mut stdin,
            FdRole::Stdout => &mut stdout,
            FdRole::Stderr => &mut stderr,
            FdRole::Console => &mut console,
            FdRole::Pidfd => &mut pidfd,
        };
        *slot = Some(fd);
    }
    let pidfd = pidfd.ok_or(SpawnerError::MissingFds { listed: 0, carried: 0 })?;
    let pid = pidfd_pid(&pidfd).ok_or_else(|| SpawnerError::NoPid { exec_id: session.exec_id.clone() })?;
    Ok(SessionFds { info: session, stdin, stdout, stderr, console, pidfd, pid })
}

/// The host pid behind a pidfd (its `Pid:` line in fdinfo).
pub fn pidfd_pid(pidfd: &OwnedFd) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd())).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse::<i64>().ok())
        .and_then(|p| u32::try_from(p).ok())
}

/// A new spawner key, from the kernel's random source.
pub fn new_key() -> std::io::Result<SpawnerKey> {
    let mut bytes = [0u8; protocol::KEY_BYTES];
    let mut filled = 0;
    while filled < bytes.len() {
        // SAFETY: getrandom writes at most the given length into our buffer.
        let n = unsafe { libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0) };
        match n {
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => filled += n as usize,
        }
    }
    Ok(SpawnerKey::from_bytes(bytes))
}

/// Sends `signal` through a pidfd: it cannot hit a recycled pid.
pub fn pidfd_signal(pidfd: &OwnedFd, signal: i32) -> std::io::Result<()> {
    // SAFETY: the syscall takes a descriptor, a signal number and no siginfo.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), signal, std::ptr::null::<u8>(), 0) };
    if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Waits until the process behind `pidfd` has ended.
pub async fn pidfd_exited(pidfd: &OwnedFd) -> std::io::Result<()> {
    let dup = pidfd.try_clone()?;
    // SAFETY: the AsyncFd owns `dup`, so the descriptor outlives its registration.
    let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(dup, Interest::READABLE)? };
    let _ready = fd.readable().await?;
    Ok(())
}

/// Why the spawner's socket could not be reached (yet).
enum Unreachable {
    Io(std::io::Error),
    /// The path does not lead to a socket beneath the container's root.
    Path(String),
}

/// Connects to the spawner's socket, [`crab_init::SOCKET_PATH`] in the container whose init is
/// `init_pid`. Everything there is the container's: the path is resolved once beneath the
/// container's root (through a pidfd of its init, so a recycled pid leads nowhere) without
/// following any symlink or leaving the root, the entry is opened as itself and checked to be a
/// socket, and connected to through that handle's procfs name (which also keeps the address
/// under sun_path's 108 bytes).
async fn connect_socket_entry(init_pid: u32) -> Result<UnixStream, Unreachable> {
    use nix::sys::stat::{SFlag, fstat};
    let root = crab_store::ContainerRoot::new(init_pid).map_err(Unreachable::Io)?;
    let path =
        crab_store::RelPath::parse(crab_init::SOCKET_PATH.as_bytes()).map_err(|e| Unreachable::Path(e.to_string()))?;
    let entry = root.open_path(&path).map_err(|e| match e {
        crab_store::CheckpointError::Io { source, .. } => Unreachable::Io(source),
        other => Unreachable::Path(other.to_string()),
    })?;
    let mode = fstat(&entry).map_err(|e| Unreachable::Io(e.into()))?.st_mode;
    let kind = SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits());
    if kind != SFlag::S_IFSOCK {
        return Err(Unreachable::Path(format!("{} is not a socket ({kind:?})", crab_init::SOCKET_PATH)));
    }
    UnixStream::connect(format!("/proc/self/fd/{}", entry.as_raw_fd())).await.map_err(Unreachable::Io)
}

/// The process that listens at the other end, by the kernel's account (`SO_PEERCRED`: the
/// process that called listen()).
fn peer_pid(stream: &UnixStream) -> std::io::Result<i32> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    Ok(getsockopt(stream, PeerCredentials)?.pid())
}

/// Whether `peer`, the listener behind the spawner's socket, is crab-init's spawner. crab-init
/// listens as the container's init before it forks the spawner and execs the entrypoint, so a
/// fresh container's listener is `init_pid`; a restored one was listened on again by the
/// spawner itself, a child of the init running the crab-init build the container binds
/// (`binary`). Any other process of the container that binds a socket there (an agent's code,
/// root in its container) is refused. What this cannot tell apart: the init itself, should
/// the entrypoint re-exec into other code and listen there.
pub(crate) fn verify_peer(peer: i32, init_pid: u32, binary: Option<(u64, u64)>) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if peer <= 0 {
        return Err("the kernel names no process".into());
    }
    if peer as u32 == init_pid {
        return Ok(());
    }
    let stat = crab_sys::proc_stat::read(peer as u32).map_err(|e| format!("/proc/{peer}/stat: {e}"))?;
    let ppid = crab_sys::proc_stat::parent(&stat).ok_or_else(|| format!("/proc/{peer}/stat is unreadable"))?;
    if ppid != init_pid {
        return Err(format!("its parent is {ppid}, not the container's init {init_pid}"));
    }
    let exe = std::fs::metadata(format!("/proc/{peer}/exe")).map_err(|e| format!("/proc/{peer}/exe: {e}"))?;
    match binary {
        Some(binary) if (exe.dev(), exe.ino()) == binary => Ok(()),
        Some(_) => Err("it does not run the crab-init build the container binds".into()),
        None => Err("the container's crab-init build is unknown".into()),
    }
}

async fn write_all(stream: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One recvmsg: bytes into `buf`, descriptors onto `fds`.
fn receive(
    stream: &UnixStream,
    buf: &mut Vec<u8>,
    fds: &mut std::collections::VecDeque<OwnedFd>,
) -> std::io::Result<usize> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut chunk = [0u8; 16 * 1024];
    let mut cmsg = nix::cmsg_space!([RawFd; protocol::MAX_FDS]);
    let (n, received) = {
        let mut iov = [std::io::IoSliceMut::new(&mut chunk)];
        let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(std::io::Error::from)?;
        let mut received = Vec::new();
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel installed these descriptors for us.
                received.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        (msg.bytes, received)
    };
    buf.extend_from_slice(&chunk[..n]);
    fds.extend(received);
    Ok(n)
}

async fn read_loop(stream: Arc<UnixStream>, replies: mpsc::UnboundedSender<Received>, events: Arc<Mutex<Events>>) {
    let mut buf = Vec::new();
    let mut fds = std::collections::VecDeque::new();
    loop {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_io(Interest::READABLE, || receive(&stream, &mut buf, &mut fds)) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::warn!(error = %e, "spawner connection read failed");
                return;
            }
        }
        loop {
            let (message, used) = match protocol::split_frame(&buf) {
                Ok(Some((payload, used))) => (protocol::decode::<Message>(payload), used),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "spawner stream corrupt; dropping the connection");
                    return;
                }
            };
            buf.drain(..used);
            let message = match message {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "unreadable spawner message skipped");
                    continue;
                }
            };
            if let Message::Exit { exec_id, wait_status } = &message {
                let mut events = events.lock().expect("spawner lock");
                match events.waiters.remove(exec_id) {
                    Some(tx) => {
                        let _ = tx.send(*wait_status);
                    }
                    None => {
                        events.early.insert(exec_id.clone(), *wait_status);
                    }
                }
                continue;
            }
            let count = message.fds().len().min(fds.len());
            let carried = fds.drain(..count).collect();
            if replies.send(Received { message, fds: carried }).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::process::{Child, Command};

    use super::verify_peer;

    fn sleeper() -> Child {
        Command::new("sleep").arg("30").spawn().expect("spawn sleep")
    }

    fn binary_of(pid: u32) -> (u64, u64) {
        let md = std::fs::metadata(format!("/proc/{pid}/exe")).unwrap();
        (md.dev(), md.ino())
    }

    #[test]
    fn only_the_init_or_its_child_running_crab_init_may_listen() {
        // The test process plays the container's init, a child of it the spawner.
        let init = std::process::id();
        let mut child = sleeper();
        let peer = child.id() as i32;
        let spawner_build = binary_of(child.id());
        assert_eq!(verify_peer(init as i32, init, None), Ok(()), "the init itself");
        assert_eq!(verify_peer(peer, init, Some(spawner_build)), Ok(()), "the init's child running the build");
        let other_build = binary_of(init);
        let wrong_binary = verify_peer(peer, init, Some(other_build)).unwrap_err();
        assert!(wrong_binary.contains("crab-init build"), "{wrong_binary}");
        let not_a_child = verify_peer(peer, 1, Some(spawner_build)).unwrap_err();
        assert!(not_a_child.contains("not the container's init 1"), "{not_a_child}");
        assert!(verify_peer(0, init, Some(spawner_build)).is_err(), "no process");
        let _ = child.kill();
        let _ = child.wait();
        assert!(verify_peer(peer, init, Some(spawner_build)).is_err(), "a process that is gone");
    }
}
