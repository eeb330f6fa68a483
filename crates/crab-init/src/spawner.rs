//! The spawner: a single-threaded poll loop over its listening socket, the
//! shim's connection and a signalfd for SIGCHLD.
//!
//! One shim connection is served at a time (a newer authorized one replaces
//! it). Exit events wait in a queue while no shim is connected, so a detach
//! around a dump, a restore or a shim restart loses none.

use std::collections::VecDeque;
use std::ffi::CString;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crab_init::protocol::{self, FdRole, Message, Request, SpawnerKey};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

use crate::session::{self, Session};

/// A shim that stops reading for this long is dropped rather than wedging the spawner.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a new connection has to send its key. The shim sends it right after connecting;
/// a peer that sends nothing holds the spawner no longer than this.
const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// The key's frame is small; a longer one is not a key.
const AUTH_FRAME_MAX: usize = 256;
const READ_CHUNK: usize = 64 * 1024;

fn os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Binds and listens on `path` (replacing a stale socket file), root-only.
pub fn listen(path: &str) -> std::io::Result<OwnedFd> {
    let c_path = CString::new(path).map_err(std::io::Error::other)?;
    // SAFETY: plain socket calls with checked results; the address is built in place.
    unsafe {
        // Non-blocking: a backlog is drained until empty (see `drain_backlog`).
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
        if fd < 0 {
            return Err(os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_bytes();
        if bytes.len() >= addr.sun_path.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket path too long"));
        }
        for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
            *dst = *src as libc::c_char;
        }
        libc::unlink(c_path.as_ptr());
        let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
        if libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) != 0 {
            return Err(os_error());
        }
        libc::chmod(c_path.as_ptr(), 0o600);
        if libc::listen(fd.as_raw_fd(), 16) != 0 {
            return Err(os_error());
        }
        Ok(fd)
    }
}

struct Client {
    socket: OwnedFd,
    inbox: Vec<u8>,
}

struct Spawner {
    listener: OwnedFd,
    /// What every connection must prove first; None for a crab-init given no key (started by
    /// a shim from before keys), which knows the shim by its credentials alone.
    key: Option<SpawnerKey>,
    signals: SignalFd,
    client: Option<Client>,
    sessions: Vec<Session>,
    /// Exec ids whose exit is still to be reported, oldest first.
    exited: VecDeque<String>,
}

/// The spawner's life; it ends only when the container's pid namespace does.
pub fn run(listener: OwnedFd, key: Option<SpawnerKey>) -> ! {
    // SAFETY: detaching from the init's session and stdio before anything else.
    unsafe {
        libc::setsid();
        if let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
            for target in 0..3 {
                libc::dup2(null.as_raw_fd(), target);
            }
        }
        // The runtime's `kill --all` and terminal hang-ups are meant for the
        // workload; the spawner leaves with the pid namespace (SIGKILL).
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::prctl(libc::PR_SET_NAME, c"crab-spawner".as_ptr());
        // Not dumpable: the container's processes run as the same user (root, often) and
        // could otherwise ptrace the spawner or write its memory through /proc and answer the
        // shim in its name. Only a holder of CAP_SYS_PTRACE (CRIU on the host) gets in. The
        // sessions it starts exec at once, which makes them dumpable again.
        libc::prctl(libc::PR_SET_DUMPABLE, 0);
    }
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    if mask.thread_block().is_err() {
        std::process::exit(1);
    }
    let Ok(signals) = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC) else {
        std::process::exit(1);
    };
    let mut spawner = Spawner { listener, key, signals, client: None, sessions: Vec::new(), exited: VecDeque::new() };
    loop {
        spawner.poll_once();
    }
}

impl Spawner {
    fn poll_once(&mut self) {
        let mut fds = vec![
            libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.signals.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        if let Some(client) = &self.client {
            fds.push(libc::pollfd { fd: client.socket.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        // SAFETY: a valid array of pollfd.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            return;
        }
        if fds[1].revents != 0 {
            self.reap();
        }
        if fds.get(2).is_some_and(|f| f.revents != 0) {
            self.read_client();
        }
        if fds[0].revents != 0 {
            self.accept();
        }
        self.flush_exits();
    }

    /// Takes one pending connection; false once the backlog is empty.
    fn accept(&mut self) -> bool {
        // SAFETY: accept4 on our listener; the result is owned at once.
        let fd = unsafe {
            libc::accept4(self.listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
        };
        if fd < 0 {
            return false;
        }
        // SAFETY: `fd` was just returned by accept4 and is owned by nobody else.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        set_timeout(&socket, libc::SO_SNDTIMEO, SEND_TIMEOUT);
        // SAFETY: all-zero bytes are a valid `ucred` (plain integers).
        let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: SO_PEERCRED fills a ucred.
        let got = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        let authorized = if got != 0 {
            Err(format!("connection refused: peer credentials unreadable: {}", os_error()))
        } else {
            protocol::parent_of_init(
                // SAFETY: getppid has no preconditions.
                || unsafe { libc::getppid() },
                |pid| crab_sys::proc_stat::read(pid as u32),
            )
            .and_then(|shim| protocol::authorize_peer(cred.pid, cred.uid, shim))
            .and_then(|()| match &self.key {
                Some(key) => authenticate(&socket, key),
                None => Ok(()),
            })
        };
        if let Err(message) = authorized {
            let _ = send(&socket, &Message::Error { message }, &[]);
            return true;
        }
        let pidfd = pidfd_open(std::process::id() as libc::pid_t);
        let (roles, fds): (Vec<FdRole>, Vec<BorrowedFd>) = match &pidfd {
            Some(fd) => (vec![FdRole::Pidfd], vec![fd.as_fd()]),
            None => (Vec::new(), Vec::new()),
        };
        let hello = Message::Hello { pid: std::process::id() as libc::pid_t, fds: roles };
        // A shim that gave up waiting (this spawner was frozen or slow) has
        // closed its end: such a connection must not replace a live one.
        if send(&socket, &hello, &fds).is_ok() {
            // A newer shim (after a restart or a restore) takes over.
            self.drop_client();
            self.client = Some(Client { socket, inbox: Vec::new() });
        }
        true
    }

    /// Closes connections the shim abandoned in the backlog: CRIU cannot dump
    /// a listening socket with a closed connection in flight.
    fn drain_backlog(&mut self) {
        while self.client.is_none() && self.accept() {}
        // A live connection that came meanwhile is the shim's again: nothing
        // dumps while the shim is connected, as it detaches first.
    }

    fn read_client(&mut self) {
        let Some(client) = &mut self.client else { return };
        let mut chunk = vec![0u8; READ_CHUNK];
        // SAFETY: reading into our buffer; poll said the socket is readable.
        let n = unsafe { libc::read(client.socket.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
        if n <= 0 {
            self.drop_client();
            return;
        }
        client.inbox.extend_from_slice(&chunk[..n as usize]);
        loop {
            let Some(client) = &mut self.client else { return };
            let (request, used) = match protocol::split_frame(&client.inbox) {
                Ok(None) => return,
                Ok(Some((payload, used))) => (protocol::decode::<Request>(payload), used),
                Err(e) => {
                    // The stream has lost its framing: nothing after this can be trusted.
                    self.reply(&Message::Error { message: e.to_string() }, &[]);
                    self.drop_client();
                    return;
                }
            };
            client.inbox.drain(..used);
            match request {
                Ok(request) => self.handle(request),
                Err(e) => self.reply(&Message::Error { message: e.to_string() }, &[]),
            }
        }
    }

    fn handle(&mut self, request: Request) {
        match request {
            Request::Spawn(req) => {
                if self.sessions.iter().any(|s| s.info.exec_id == req.exec_id) {
                    let message = format!("exec {} already exists", req.exec_id);
                    return self.reply(&Message::Error { message }, &[]);
                }
                match session::spawn(&req) {
                    Ok(session) => {
                        self.sessions.push(session);
                        self.send_session(self.sessions.len() - 1);
                    }
                    Err(message) => self.reply(&Message::Error { message }, &[]),
                }
            }
            Request::Attach { exec_id } => match self.find(&exec_id) {
                Some(i) if self.sessions[i].exit.is_none() => self.send_session(i),
                Some(_) => self.reply(&Message::Error { message: format!("exec {exec_id} has exited") }, &[]),
                None => self.reply(&Message::Error { message: format!("no exec session {exec_id}") }, &[]),
            },
            Request::Release { exec_id } => match self.find(&exec_id) {
                Some(i) => {
                    self.sessions[i].held = false;
                    self.reap_sessions();
                    self.reply(&Message::Done, &[]);
                }
                None => self.reply(&Message::Error { message: format!("no exec session {exec_id}") }, &[]),
            },
            Request::CloseStdin { exec_id } => match self.find(&exec_id) {
                Some(i) => {
                    self.sessions[i].close_stdin();
                    self.reply(&Message::Done, &[]);
                }
                None => self.reply(&Message::Error { message: format!("no exec session {exec_id}") }, &[]),
            },
            Request::List => {
                let sessions = self.sessions.iter().map(|s| s.info.clone()).collect();
                self.reply(&Message::Sessions { sessions }, &[]);
            }
            Request::Auth { .. } => {
                self.reply(&Message::Error { message: "this connection has proven its key already".into() }, &[])
            }
            Request::Detach => {
                self.reply(&Message::Done, &[]);
                self.drop_client();
                self.drain_backlog();
            }
        }
    }

    fn find(&self, exec_id: &str) -> Option<usize> {
        self.sessions.iter().position(|s| s.info.exec_id == exec_id)
    }

    /// Sends a session's descriptors and a fresh pidfd, which is closed here
    /// once sent: the spawner keeps no pidfds (nothing extra in a dump).
    fn send_session(&mut self, index: usize) {
        let session = &self.sessions[index];
        let Some(pidfd) = pidfd_open(session.info.pid) else {
            let message = format!("exec {}: pidfd_open: {}", session.info.exec_id, os_error());
            return self.reply(&Message::Error { message }, &[]);
        };
        let mut entries = session.fds();
        entries.push((FdRole::Pidfd, pidfd.as_fd()));
        let (roles, fds): (Vec<FdRole>, Vec<BorrowedFd>) = entries.into_iter().unzip();
        let message = Message::Session { session: session.info.clone(), fds: roles };
        let Some(client) = &self.client else { return };
        match send(&client.socket, &message, &fds) {
            Ok(()) => self.sessions[index].held = true,
            Err(_) => self.drop_client(),
        }
    }

    fn reply(&mut self, message: &Message, fds: &[BorrowedFd]) {
        let Some(client) = &self.client else { return };
        if send(&client.socket, message, fds).is_err() {
            self.drop_client();
        }
    }

    fn reap(&mut self) {
        while let Ok(Some(_)) = self.signals.read_signal() {}
        self.reap_sessions();
    }

    /// Reaps each ended session the shim is not holding. Only sessions are
    /// the spawner's children, so waiting pid by pid misses nothing, and a
    /// held zombie cannot stand in the way of the others.
    fn reap_sessions(&mut self) {
        for session in self.sessions.iter_mut().filter(|s| s.exit.is_none() && !s.held) {
            let mut status = 0;
            // SAFETY: non-blocking wait for one child of ours.
            if unsafe { libc::waitpid(session.info.pid, &mut status, libc::WNOHANG) } == session.info.pid {
                session.exit = Some(status);
                session.info.exited = true;
                self.exited.push_back(session.info.exec_id.clone());
            }
        }
    }

    /// Forgets the shim's connection; what it held is released with it (a
    /// new shim re-attaches and holds again).
    fn drop_client(&mut self) {
        self.client = None;
        for session in &mut self.sessions {
            session.held = false;
        }
        self.reap_sessions();
    }

    /// Reports exits to the connected shim; a reported session is forgotten
    /// (its descriptors closed).
    fn flush_exits(&mut self) {
        while let Some(exec_id) = self.exited.front().cloned() {
            let Some(client) = &self.client else { return };
            let Some(index) = self.find(&exec_id) else {
                self.exited.pop_front();
                continue;
            };
            let wait_status = self.sessions[index].exit.unwrap_or(0);
            if send(&client.socket, &Message::Exit { exec_id, wait_status }, &[]).is_err() {
                self.drop_client();
                return;
            }
            self.exited.pop_front();
            self.sessions.remove(index);
        }
    }
}

fn pidfd_open(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: the syscall returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative result is a new descriptor owned by nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn set_timeout(socket: &OwnedFd, option: libc::c_int, timeout: Duration) {
    let tv = libc::timeval { tv_sec: timeout.as_secs() as libc::time_t, tv_usec: 0 };
    // SAFETY: SO_SNDTIMEO and SO_RCVTIMEO take a timeval.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
    }
}

/// Reads a new connection's first frame, which must be [`Request::Auth`] with `key`. Waits
/// [`AUTH_TIMEOUT`] at most (the socket blocks: poll said nothing about it yet).
fn authenticate(socket: &OwnedFd, key: &SpawnerKey) -> Result<(), String> {
    set_timeout(socket, libc::SO_RCVTIMEO, AUTH_TIMEOUT);
    let refused = |why: String| format!("connection refused: {why}");
    let mut prefix = [0u8; protocol::LENGTH_BYTES];
    read_exact(socket, &mut prefix).map_err(|e| refused(format!("no spawner key within {AUTH_TIMEOUT:?}: {e}")))?;
    let len = u32::from_be_bytes(prefix) as usize;
    if len > AUTH_FRAME_MAX {
        return Err(refused(format!("a first frame of {len} bytes is no spawner key")));
    }
    let mut payload = vec![0u8; len];
    read_exact(socket, &mut payload).map_err(|e| refused(format!("no spawner key within {AUTH_TIMEOUT:?}: {e}")))?;
    set_timeout(socket, libc::SO_RCVTIMEO, Duration::ZERO);
    match protocol::decode::<Request>(&payload) {
        Ok(Request::Auth { key: claimed }) if key.matches(&claimed) => Ok(()),
        Ok(Request::Auth { .. }) => Err(refused("wrong spawner key".into())),
        Ok(_) => Err(refused("the first frame must prove the spawner key (auth); only the shim has it".into())),
        Err(e) => Err(refused(e.to_string())),
    }
}

fn read_exact(socket: &OwnedFd, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: reading into the rest of our buffer.
        let n = unsafe { libc::read(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        match n {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n if n < 0 => {
                let e = os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => buf = &mut buf[n as usize..],
        }
    }
    Ok(())
}

/// Sends one frame; the descriptors ride on its first bytes.
fn send(socket: &OwnedFd, message: &Message, fds: &[BorrowedFd]) -> std::io::Result<()> {
    let frame = protocol::encode(message);
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let mut sent = 0;
    while sent < frame.len() {
        let iov = [IoSlice::new(&frame[sent..])];
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() { &rights } else { &[] };
        match sendmsg::<()>(socket.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
