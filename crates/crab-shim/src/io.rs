//! Standard streams of container processes.
//!
//! containerd names each stream by a URI: a fifo path (bare or `fifo://`),
//! `file://` (append to a host file), `binary://` (a logging program reads the
//! streams), or nothing (null). The container never sees those: it gets pipe
//! ends (so CRIU can dump it), or a pseudo-terminal whose master the runtime
//! hands over through a console socket, and the shim copies between them.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::fcntl::OFlag;
use tokio::io::unix::AsyncFd;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crab_engine::shell::Marks;
use crab_runtime::{ProcessStdio, Reaper};

use crate::tap::Tap;

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("stdio {uri:?}: unsupported scheme (expected a fifo path, file://, binary:// or empty)")]
    Scheme { uri: String },
    #[error("stdio {what}: {source}")]
    Os { what: String, source: io::Error },
    #[error("logging binary {path} exited before it was ready (status {status})")]
    LoggerFailed { path: String, status: i32 },
}

fn os(what: impl Into<String>) -> impl FnOnce(io::Error) -> IoError {
    let what = what.into();
    move |source| IoError::Os { what, source }
}

/// The stream URIs of one process, as containerd sent them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StdioUris {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Target {
    Null,
    Fifo(PathBuf),
    File(PathBuf),
    Binary { path: String, args: Vec<(String, String)> },
}

fn parse_uri(uri: &str) -> Result<Target, IoError> {
    if uri.is_empty() {
        return Ok(Target::Null);
    }
    let Some((scheme, rest)) = uri.split_once("://") else {
        return Ok(Target::Fifo(uri.into()));
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    match scheme {
        "fifo" => Ok(Target::Fifo(path.into())),
        "file" => Ok(Target::File(path.into())),
        "binary" => {
            let args = query
                .split('&')
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect();
            Ok(Target::Binary { path: percent_decode(path), args })
        }
        _ => Err(IoError::Scheme { uri: uri.into() }),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A non-blocking descriptor driven by tokio: a pipe end, a fifo or a pty master.
struct AsyncRaw(AsyncFd<OwnedFd>);

impl AsyncRaw {
    fn new(fd: OwnedFd) -> io::Result<Self> {
        set_nonblocking(fd.as_raw_fd())?;
        // SAFETY: the AsyncFd owns `fd`, so the descriptor stays open and the same until it is dropped.
        Ok(Self(unsafe { AsyncFd::register(fd) }?))
    }

    /// Reads some bytes; 0 means end of stream. A pty master reports the
    /// slave's last close as EIO, which is end of stream too.
    async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.0.readable().await?;
            match guard.try_io(|fd| {
                // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call's duration.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
            }) {
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(result) => return result,
                Err(_would_block) => continue,
            }
        }
    }

    async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let mut guard = self.0.writable().await?;
            match guard.try_io(|fd| {
                // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the call's duration.
                let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
                if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
            }) {
                Ok(Ok(n)) => buf = &buf[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL take and return integers; `fd` is a descriptor the caller owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(io::Error::from)
}

fn dev_null(write: bool) -> io::Result<OwnedFd> {
    Ok(std::fs::OpenOptions::new().read(!write).write(write).open("/dev/null")?.into())
}

/// How long an output copy waits for the client to open its end of a fifo
/// before it writes anyway (into the fifo's buffer, as the client may come later).
const FIFO_READER_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Checks that an output fifo exists, so a bad path fails the call that named it.
fn check_output_fifo(path: &Path) -> Result<(), IoError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).map_err(os(format!("open fifo {}", path.display())))?;
    if !meta.file_type().is_fifo() {
        let source = io::Error::new(io::ErrorKind::InvalidInput, "not a fifo");
        return Err(IoError::Os { what: format!("open fifo {}", path.display()), source });
    }
    Ok(())
}

/// Opens an output fifo for the copy once the client reads it. Bytes written
/// into a fifo that no reader has opened yet are discarded when the last
/// writer closes it: a process that exits within milliseconds (an exec
/// through crab-init) would lose its output if the client, whose open runs
/// concurrently with its Start call, has not opened its side yet. A
/// non-blocking write-only open succeeds only once a reader exists, so it is
/// tried until then (bounded). Then the shim opens a read side of its own: it
/// keeps the fifo usable while containerd is down, so a container keeps
/// running (and its output keeps flowing) across a containerd restart.
async fn open_output_fifo(path: &Path) -> Result<FifoSink, IoError> {
    let what = || format!("open fifo {}", path.display());
    let deadline = tokio::time::Instant::now() + FIFO_READER_WAIT;
    let mut pause = std::time::Duration::from_micros(200);
    let (writer, client_reads): (OwnedFd, bool) = loop {
        match std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(path) {
            Ok(file) => break (file.into(), true),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(20));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                tracing::debug!(fifo = %path.display(), "no reader on the output fifo yet: writing into its buffer");
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(path)
                    .map_err(os(what()))?;
                break (file.into(), false);
            }
            Err(e) => return Err(os(what())(e)),
        }
    };
    let keep_reader =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(os(what()))?;
    Ok(FifoSink {
        writer: AsyncRaw::new(writer).map_err(os("register fifo"))?,
        _keep_reader: keep_reader.into(),
        client_reads,
    })
}

/// A client's output fifo, with the shim's own read side held open.
struct FifoSink {
    writer: AsyncRaw,
    _keep_reader: OwnedFd,
    /// The client had opened the fifo when the copy began.
    client_reads: bool,
}

/// How long a finished copy waits for the client to read what it wrote.
const FIFO_CLIENT_READ_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl FifoSink {
    /// Waits until the client has read everything written (bounded). The exit
    /// is published after this: `ctr` cancels its fifo reads when it sees the
    /// exit, and a reader whose open had not yet returned to it loses what
    /// was still in the fifo. An exec through crab-init can exit within two
    /// milliseconds of its start, long before a loaded client gets there.
    async fn wait_read_by_client(&self) {
        if !self.client_reads {
            return;
        }
        let deadline = tokio::time::Instant::now() + FIFO_CLIENT_READ_WAIT;
        let mut pause = std::time::Duration::from_micros(200);
        loop {
            let mut queued: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int: the bytes in the fifo's buffer.
            let r = unsafe { libc::ioctl(self.writer.0.get_ref().as_raw_fd(), libc::FIONREAD, &mut queued) };
            if r < 0 || queued == 0 || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
        }
    }
}

/// The copy destination of one output stream.
enum Sink {
    /// Opened by the copy itself, once the client reads (see [`open_output_fifo`]).
    PendingFifo(PathBuf),
    Fifo(FifoSink),
    File(std::fs::File),
}

impl Sink {
    async fn open(target: &Target) -> Result<Option<Sink>, IoError> {
        match target {
            Target::File(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(os(format!("create {}", dir.display())))?;
                }
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(os(format!("open {}", path.display())))?;
                Ok(Some(Sink::File(f)))
            }
            Target::Fifo(path) => {
                check_output_fifo(path)?;
                Ok(Some(Sink::PendingFifo(path.clone())))
            }
            Target::Null | Target::Binary { .. } => Ok(None),
        }
    }

    /// Waits for what the copy needs before its first write.
    async fn connect(&mut self) {
        if let Sink::PendingFifo(path) = self {
            match open_output_fifo(path).await {
                Ok(fifo) => *self = Sink::Fifo(fifo),
                Err(e) => tracing::warn!(error = %e, "stdio copy: output dropped"),
            }
        }
    }

    /// After the last write: waits for what the copy's end needs before the exit is published.
    async fn finish(&self) {
        if let Sink::Fifo(fifo) = self {
            fifo.wait_read_by_client().await;
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            Sink::PendingFifo(_) => Ok(()),
            Sink::Fifo(fifo) => fifo.writer.write_all(buf).await,
            Sink::File(f) => {
                use std::io::Write;
                f.write_all(buf)
            }
        }
    }
}

/// While true, output copies hold still (a CRIU dump is reading the pipes).
type Hold = tokio::sync::watch::Receiver<bool>;

/// Where an asker puts a [`Tap`] for an output copy, and what the copy owes the client when
/// an asker gave up on one.
#[derive(Default)]
struct TapSlot {
    tap: Option<Tap>,
    released: Vec<u8>,
}

type SharedTap = Arc<std::sync::Mutex<TapSlot>>;

/// The bytes of one read the client gets, once an asker's tap (if any) took its answer out.
fn through_tap<'a>(tap: Option<&SharedTap>, read: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
    let Some(slot) = tap else { return read.into() };
    let mut slot = slot.lock().expect("tap lock");
    let mut out = std::mem::take(&mut slot.released);
    match slot.tap.as_mut() {
        None if out.is_empty() => return read.into(),
        None => out.extend_from_slice(read),
        Some(tap) => {
            let routed = tap.route(read);
            out.extend(routed.forward);
            if routed.finished {
                slot.tap = None;
            }
        }
    }
    out.into()
}

async fn copy_out(source: AsyncRaw, mut sinks: Vec<Sink>, mut hold: Hold, tap: Option<SharedTap>) {
    for sink in &mut sinks {
        sink.connect().await;
    }
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        // Wait for data first and for the hold to lift second: a read must
        // not race the dump that copies what is in the pipe.
        if source.0.readable().await.is_err() {
            break;
        }
        if hold.wait_for(|held| !held).await.is_err() {
            break;
        }
        match source.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                let out = through_tap(tap.as_ref(), &buf[..n]);
                for sink in &mut sinks {
                    if let Err(e) = sink.write_all(&out).await {
                        tracing::warn!(error = %e, "stdio copy: write failed");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "stdio copy: read failed");
                break;
            }
        }
    }
    for sink in &sinks {
        sink.finish().await;
    }
}

/// The writer into the container's stdin, shared by the copy task and CloseIO.
type StdinWriter = Arc<Mutex<Option<AsyncRaw>>>;
/// Set once the turn engine follows the process as a stdin session.
type StdinObserverSlot = Arc<std::sync::OnceLock<crab_engine::stdin::StdinObserver>>;

async fn copy_stdin(
    fifo: PathBuf,
    writer: StdinWriter,
    observer: StdinObserverSlot,
    mut open: tokio::sync::watch::Receiver<bool>,
) {
    // A restored shell is brought to its turn's state before the client's first byte.
    if open.wait_for(|open| *open).await.is_err() {
        return;
    }
    // Non-blocking read-only open returns at once. Before any writer came, the
    // fifo is never readable (the kernel reports hang-up only for writers that
    // came after our open and left), so waiting for readiness waits for the
    // client; a read of 0 after that is the client's close, delivered to the
    // container as end of file.
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo);
    let source = match opened.map(OwnedFd::from).and_then(AsyncRaw::new) {
        Ok(raw) => raw,
        Err(e) => return tracing::warn!(error = %e, fifo = %fifo.display(), "stdin: open fifo"),
    };
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = match source.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(observe) = observer.get() {
            observe(n).await;
        }
        let guard = writer.lock().await;
        let Some(w) = guard.as_ref() else { return };
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    writer.lock().await.take();
}

/// A session's streams as the engine asks its shell through them (see `crab_engine::shell`).
pub struct SessionShell(pub Arc<ProcessIo>);

impl SessionShell {
    /// None unless the shim copies all three streams over pipes it made.
    pub fn new(io: Arc<ProcessIo>) -> Option<Self> {
        (io.pipes.get().is_some() && io.taps.get().is_some()).then_some(SessionShell(io))
    }
}

impl crab_engine::shell::ShellChannel for SessionShell {
    fn stdio(&self) -> [(u64, u64); 3] {
        *self.0.pipes.get().expect("checked at new")
    }

    fn ask(&self, input: Vec<u8>, marks: Marks, timeout: std::time::Duration) -> crab_engine::shell::AskFuture<'_> {
        Box::pin(self.0.ask(input, marks, timeout))
    }
}

/// A listening socket on which the runtime sends a new pty's master.
pub struct ConsoleSocket {
    path: PathBuf,
    listener: tokio::net::UnixListener,
}

impl ConsoleSocket {
    pub fn new(dir: &Path) -> Result<Self, IoError> {
        std::fs::create_dir_all(dir).map_err(os(format!("create {}", dir.display())))?;
        let path = dir.join(format!("console-{}-{}.sock", std::process::id(), unique()));
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).map_err(os(format!("bind {}", path.display())))?;
        Ok(Self { path, listener })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Receives the master sent with SCM_RIGHTS.
    pub async fn receive_master(self) -> Result<OwnedFd, IoError> {
        use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
        let (stream, _) = self.listener.accept().await.map_err(os("console socket accept"))?;
        let stream = stream.into_std().map_err(os("console socket"))?;
        stream.set_nonblocking(false).map_err(os("console socket"))?;
        let fd = tokio::task::spawn_blocking(move || -> io::Result<OwnedFd> {
            let mut buf = [0u8; 4096];
            let mut iov = [io::IoSliceMut::new(&mut buf)];
            let mut cmsg = nix::cmsg_space!([RawFd; 1]);
            let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(io::Error::from)?;
            for c in msg.cmsgs().map_err(io::Error::from)? {
                if let ControlMessageOwned::ScmRights(fds) = c
                    && let Some(&fd) = fds.first()
                {
                    // SAFETY: SCM_RIGHTS installed this descriptor in our table for us alone.
                    return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
            Err(io::Error::new(io::ErrorKind::InvalidData, "no file descriptor in console message"))
        })
        .await
        .map_err(|e| IoError::Os { what: "console receive".into(), source: io::Error::other(e) })?
        .map_err(os("console receive"))?;
        Ok(fd)
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The shim's side of one process's streams, alive while the process is.
pub struct ProcessIo {
    stdin: StdinWriter,
    console: std::sync::Mutex<Option<OwnedFd>>,
    /// Output copies end when every writer of the pipe is gone; `drain` waits for them.
    outputs: std::sync::Mutex<Vec<JoinHandle<()>>>,
    /// Stdin copies end only when the client closes its end.
    inputs: std::sync::Mutex<Vec<JoinHandle<()>>>,
    uris: StdioUris,
    stdin_observer: StdinObserverSlot,
    /// Fires when the process's stdin is closed (client EOF or CloseIO), for
    /// whoever holds another writer (the spawner keeps one).
    stdin_closed: tokio_util::sync::CancellationToken,
    hold: tokio::sync::watch::Sender<bool>,
    /// Taps of the stdout and stderr copies, when the shim copies both (see [`ProcessIo::ask`]).
    taps: std::sync::OnceLock<[SharedTap; 2]>,
    /// Device and inode of the stdin, stdout and stderr pipes, when all three are pipes.
    pipes: std::sync::OnceLock<[(u64, u64); 3]>,
    /// False while the client's input waits (see [`ProcessIo::open_input`]).
    input_open: tokio::sync::watch::Sender<bool>,
}

/// The shim's ends of a process's streams when someone else made them (the
/// spawner): writer of stdin, readers of stdout and stderr, or a pty master.
#[derive(Default)]
pub struct ParentEnds {
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    pub console: Option<OwnedFd>,
}

/// What the runtime needs to launch the process with these streams.
pub struct LaunchIo {
    pub stdio: ProcessStdio,
    pub console: Option<ConsoleSocket>,
}

/// Identity passed to `binary://` loggers.
pub struct IoOwner<'a> {
    pub namespace: &'a str,
    pub container_id: &'a str,
    pub uid: u32,
    pub gid: u32,
}

impl ProcessIo {
    fn new(uris: &StdioUris) -> Arc<ProcessIo> {
        Arc::new(ProcessIo {
            stdin: Arc::new(Mutex::new(None)),
            console: std::sync::Mutex::new(None),
            outputs: std::sync::Mutex::new(Vec::new()),
            inputs: std::sync::Mutex::new(Vec::new()),
            uris: uris.clone(),
            stdin_observer: Default::default(),
            stdin_closed: Default::default(),
            hold: tokio::sync::watch::channel(false).0,
            taps: std::sync::OnceLock::new(),
            pipes: std::sync::OnceLock::new(),
            input_open: tokio::sync::watch::channel(true).0,
        })
    }

    /// Prepares pipes (or a console socket) and starts copying output.
    pub async fn prepare(
        uris: &StdioUris,
        owner: &IoOwner<'_>,
        console_dir: &Path,
        reaper: &Reaper,
    ) -> Result<(Arc<ProcessIo>, LaunchIo), IoError> {
        let io = Self::new(uris);
        let stdin_t = parse_uri(&uris.stdin)?;
        // Checked here, so a bad URI fails the call that named it.
        parse_uri(&uris.stdout)?;
        parse_uri(&uris.stderr)?;

        if uris.terminal {
            // The container gets the pty slave; the runtime hands us the master.
            let console = ConsoleSocket::new(console_dir)?;
            let launch = LaunchIo {
                stdio: ProcessStdio {
                    stdin: Some(dev_null(false).map_err(os("/dev/null"))?),
                    stdout: Some(dev_null(true).map_err(os("/dev/null"))?),
                    stderr: Some(dev_null(true).map_err(os("/dev/null"))?),
                    preserved: None,
                },
                console: Some(console),
            };
            return Ok((io, launch));
        }

        let mut stdio = ProcessStdio::default();
        let mut ends = ParentEnds::default();
        // A null stream is a pipe too, not the host's /dev/null: a process holding the host's
        // /dev/null cannot be dumped ("Can't lookup mount"). runc reopens the container's own
        // /dev/null for a created init, but CRIU gives a restored process the very descriptors
        // it is handed, and such a container could never be checkpointed again.
        stdio.stdin = Some(match &stdin_t {
            Target::Null => {
                // Nobody writes it: its write end is closed here, so a read sees end of file.
                let (r, _closed) = pipe().map_err(os("stdin pipe"))?;
                chown_fd(&r, owner.uid, owner.gid)?;
                r
            }
            Target::Fifo(_) => {
                let (r, w) = pipe().map_err(os("stdin pipe"))?;
                chown_fd(&r, owner.uid, owner.gid)?;
                ends.stdin = Some(w);
                r
            }
            other => return Err(IoError::Scheme { uri: format!("{other:?} for stdin") }),
        });
        // Every output is a pipe; a null one's is read and dropped by its copy (no sink).
        for (slot, end) in [(&mut stdio.stdout, &mut ends.stdout), (&mut stdio.stderr, &mut ends.stderr)] {
            let (r, w) = pipe().map_err(os("output pipe"))?;
            chown_fd(&w, owner.uid, owner.gid)?;
            *slot = Some(w);
            *end = Some(r);
        }
        io.connect_pipes(ends, owner, reaper).await?;
        Ok((io, LaunchIo { stdio, console: None }))
    }

    /// Copies between the client's streams and ends made elsewhere (the
    /// spawner's session): the counterpart of [`Self::prepare`]. With `input_held` the
    /// client's input waits for [`Self::open_input`].
    pub async fn from_parent_ends(
        uris: &StdioUris,
        owner: &IoOwner<'_>,
        mut ends: ParentEnds,
        reaper: &Reaper,
        input_held: bool,
    ) -> Result<Arc<ProcessIo>, IoError> {
        let io = Self::new(uris);
        if input_held {
            io.input_open.send_replace(false);
        }
        if let Some(master) = ends.console.take() {
            io.attach_console(master)?;
            return Ok(io);
        }
        for end in [&ends.stdin, &ends.stdout, &ends.stderr].into_iter().flatten() {
            chown_fd(end, owner.uid, owner.gid)?;
        }
        io.connect_pipes(ends, owner, reaper).await?;
        Ok(io)
    }

    /// Starts the copies over pipe ends: stdin from its fifo, outputs to
    /// their sinks or to one logging binary.
    async fn connect_pipes(
        self: &Arc<Self>,
        ends: ParentEnds,
        owner: &IoOwner<'_>,
        reaper: &Reaper,
    ) -> Result<(), IoError> {
        let stdin_t = parse_uri(&self.uris.stdin)?;
        let stdout_t = parse_uri(&self.uris.stdout)?;
        let stderr_t = parse_uri(&self.uris.stderr)?;
        if let (Some(i), Some(o), Some(e)) = (&ends.stdin, &ends.stdout, &ends.stderr) {
            let inode = |fd: &OwnedFd| nix::sys::stat::fstat(fd).map(|st| (st.st_dev, st.st_ino));
            if let (Ok(i), Ok(o), Ok(e)) = (inode(i), inode(o), inode(e)) {
                let _ = self.pipes.set([i, o, e]);
            }
        }
        if let (Target::Fifo(path), Some(writer)) = (&stdin_t, ends.stdin) {
            *self.stdin.lock().await = Some(AsyncRaw::new(writer).map_err(os("stdin pipe"))?);
            self.spawn_stdin_copy(path.clone());
        }
        let logger_needed = matches!(stdout_t, Target::Binary { .. }) || matches!(stderr_t, Target::Binary { .. });
        // A session can be asked only when the shim copies both its outputs.
        let taps = (!logger_needed && ends.stdout.is_some() && ends.stderr.is_some())
            .then(|| self.taps.get_or_init(Default::default).clone());
        let mut logger_fds: Vec<OwnedFd> = Vec::new();
        for (i, (target, end)) in [(&stdout_t, ends.stdout), (&stderr_t, ends.stderr)].into_iter().enumerate() {
            let Some(reader) = end else { continue };
            if logger_needed {
                logger_fds.push(reader);
            } else {
                let sink = Sink::open(target).await?.into_iter().collect();
                let source = AsyncRaw::new(reader).map_err(os("output pipe"))?;
                let tap = taps.as_ref().map(|t| t[i].clone());
                self.spawn_output(copy_out(source, sink, self.hold.subscribe(), tap));
            }
        }
        if logger_needed {
            let Target::Binary { path, args } =
                (if matches!(stdout_t, Target::Binary { .. }) { &stdout_t } else { &stderr_t })
            else {
                unreachable!()
            };
            start_logger(path, args, owner, logger_fds, reaper).await?;
        }
        Ok(())
    }

    fn spawn_stdin_copy(&self, fifo: PathBuf) {
        let (stdin, observer, closed) = (self.stdin.clone(), self.stdin_observer.clone(), self.stdin_closed.clone());
        let open = self.input_open.subscribe();
        self.spawn_input(async move {
            copy_stdin(fifo, stdin, observer, open).await;
            closed.cancel();
        });
    }

    /// Lets the client's input through (held by `from_parent_ends` until now).
    pub fn open_input(&self) {
        self.input_open.send_replace(true);
    }

    /// Resolves once stdin is closed by the client or by CloseIO.
    pub fn stdin_closed(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.stdin_closed.clone().cancelled_owned()
    }

    /// Holds output copying still (true) or lets it go on (false).
    pub fn hold_output(&self, held: bool) {
        self.hold.send_replace(held);
    }

    fn spawn_output(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.outputs.lock().expect("io lock").push(tokio::spawn(task));
    }

    fn spawn_input(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.inputs.lock().expect("io lock").push(tokio::spawn(task));
    }

    /// Connects a received pty master to the process's streams.
    pub fn attach_console(self: &Arc<Self>, master: OwnedFd) -> Result<(), IoError> {
        let for_resize = master.try_clone().map_err(os("dup pty master"))?;
        let reader = AsyncRaw::new(master.try_clone().map_err(os("dup pty master"))?).map_err(os("pty master"))?;
        *self.console.lock().expect("io lock") = Some(for_resize);
        let uris = self.uris.clone();
        let hold = self.hold.subscribe();
        let io = self.clone();
        io.spawn_output(async move {
            let sink = match Sink::open(&parse_uri(&uris.stdout).unwrap_or(Target::Null)).await {
                Ok(s) => s.into_iter().collect(),
                Err(e) => return tracing::warn!(error = %e, "console output"),
            };
            copy_out(reader, sink, hold, None).await;
        });
        if let Ok(Target::Fifo(path)) = parse_uri(&self.uris.stdin) {
            let writer = AsyncRaw::new(master).map_err(os("pty master"))?;
            let (stdin, observer, closed) =
                (self.stdin.clone(), self.stdin_observer.clone(), self.stdin_closed.clone());
            let open = self.input_open.subscribe();
            self.spawn_input(async move {
                *stdin.lock().await = Some(writer);
                copy_stdin(path, stdin, observer, open).await;
                closed.cancel();
            });
        }
        Ok(())
    }

    pub fn resize(&self, width: u32, height: u32) -> Result<(), IoError> {
        let guard = self.console.lock().expect("io lock");
        let Some(master) = guard.as_ref() else {
            return Err(IoError::Os {
                what: "resize".into(),
                source: io::Error::new(io::ErrorKind::Unsupported, "process has no terminal"),
            });
        };
        let ws = libc::winsize { ws_row: height as u16, ws_col: width as u16, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: TIOCSWINSZ reads one winsize, which `ws` is, for the call's duration.
        if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
            return Err(IoError::Os { what: "TIOCSWINSZ".into(), source: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Tells `observer` of every chunk of input before it is forwarded (stdin turns).
    pub fn observe_stdin(&self, observer: crab_engine::stdin::StdinObserver) {
        let _ = self.stdin_observer.set(observer);
    }

    /// Writes `input` to the process's stdin while both its outputs are tapped for the answer
    /// between `marks` (see `crab_engine::shell`): what it prints on stdout comes back, what
    /// it prints on either from the begin mark through the end mark never reaches the client,
    /// and the client's input waits meanwhile.
    pub async fn ask(&self, input: Vec<u8>, marks: Marks, timeout: std::time::Duration) -> Result<Vec<u8>, String> {
        let Some(taps) = self.taps.get() else {
            return Err("the shim does not copy both of the session's outputs".into());
        };
        let writer = self.stdin.lock().await;
        let Some(stdin) = writer.as_ref() else { return Err("the session's stdin is closed".into()) };
        let mut answers = Vec::new();
        for slot in taps {
            let (tap, answer) = Tap::new(marks.begin(), marks.end(), crab_engine::shell::MAX_ANSWER);
            let mut slot = slot.lock().expect("tap lock");
            if slot.tap.is_some() {
                return Err("another answer is being read".into());
            }
            slot.tap = Some(tap);
            answers.push(answer);
        }
        let asked = tokio::time::timeout(timeout, async {
            stdin.write_all(&input).await.map_err(|e| format!("writing to its stdin: {e}"))?;
            let mut answers = answers.into_iter();
            let stdout = answers.next().expect("stdout").await.map_err(|_| "its stdout closed".to_string())?;
            answers.next().expect("stderr").await.map_err(|_| "its stderr closed".to_string())?;
            Ok(stdout)
        })
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")));
        if asked.is_err() {
            // Whatever a tap held goes on to the client with the copy's next read.
            for slot in taps {
                let mut slot = slot.lock().expect("tap lock");
                if let Some(tap) = slot.tap.take() {
                    let held = tap.release();
                    slot.released.extend(held);
                }
            }
        }
        drop(writer);
        asked
    }

    /// Closes the process's stdin (CloseIO): it reads end of file.
    pub async fn close_stdin(&self) {
        self.stdin.lock().await.take();
        self.stdin_closed.cancel();
    }

    /// Waits until output copying finished (the process and all holders of
    /// its output pipes are gone), bounded so a leaked pipe cannot wedge us.
    pub async fn drain(&self, timeout: std::time::Duration) {
        let mut handles: Vec<_> = std::mem::take(&mut *self.outputs.lock().expect("io lock"));
        let all = async {
            for h in handles.iter_mut() {
                let _ = h.await;
            }
        };
        let _ = tokio::time::timeout(timeout, all).await;
        // A copy still running (a background child holds the pipe) stays
        // registered, so Delete can stop it and close the client's fifo.
        handles.retain(|h| !h.is_finished());
        self.outputs.lock().expect("io lock").extend(handles);
    }

    /// Stops all copying (Delete): nothing of this process is read any more.
    pub fn shutdown(&self) {
        for list in [&self.outputs, &self.inputs] {
            for h in list.lock().expect("io lock").drain(..) {
                h.abort();
            }
        }
        self.console.lock().expect("io lock").take();
    }
}

fn chown_fd(fd: &OwnedFd, uid: u32, gid: u32) -> Result<(), IoError> {
    if uid == 0 && gid == 0 {
        return Ok(());
    }
    nix::unistd::fchown(fd, Some(uid.into()), Some(gid.into()))
        .map_err(|e| IoError::Os { what: "chown stdio pipe".into(), source: e.into() })
}

/// Starts a `binary://` logger: it reads stdout on fd 3 and stderr on fd 4,
/// and closes fd 5 once it is ready.
async fn start_logger(
    path: &str,
    args: &[(String, String)],
    owner: &IoOwner<'_>,
    fds: Vec<OwnedFd>,
    reaper: &Reaper,
) -> Result<(), IoError> {
    use std::os::unix::process::CommandExt;
    let (ready_r, ready_w) = pipe().map_err(os("logger ready pipe"))?;
    let mut cmd = std::process::Command::new(path);
    for (k, v) in args {
        cmd.arg(k);
        if !v.is_empty() {
            cmd.arg(v);
        }
    }
    cmd.env("CONTAINER_ID", owner.container_id).env("CONTAINER_NAMESPACE", owner.namespace);
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).chain([ready_w.as_raw_fd()]).collect();
    // SAFETY: the closure runs in the forked child before exec and only calls dup2, fcntl and
    // close, which are async-signal-safe, on descriptors copied in as integers.
    unsafe {
        cmd.pre_exec(move || {
            // Place the inherited descriptors at 3, 4, 5 without clobbering
            // each other: dup everything high first, then down.
            let high: Vec<RawFd> = raw.iter().map(|&fd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100)).collect();
            for (i, fd) in high.iter().enumerate() {
                if *fd < 0 || libc::dup2(*fd, 3 + i as RawFd) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(os(format!("start logging binary {path}")))?;
    let exit = reaper.wait_for(child.id());
    drop(ready_w);
    drop(fds);
    // Ready when the logger closes its end (read returns 0), or failed when it exits first.
    let ready = tokio::task::spawn_blocking(move || {
        let mut f = std::fs::File::from(ready_r);
        let mut b = [0u8; 1];
        std::io::Read::read(&mut f, &mut b)
    });
    tokio::select! {
        _ = ready => Ok(()),
        exit = exit => Err(IoError::LoggerFailed { path: path.into(), status: exit.status }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_to_targets() {
        assert_eq!(parse_uri("").unwrap(), Target::Null);
        assert_eq!(parse_uri("/run/x/stdout").unwrap(), Target::Fifo("/run/x/stdout".into()));
        assert_eq!(parse_uri("fifo:///run/x/o").unwrap(), Target::Fifo("/run/x/o".into()));
        assert_eq!(parse_uri("file:///var/log/c.log").unwrap(), Target::File("/var/log/c.log".into()));
        assert_eq!(
            parse_uri("binary:///usr/bin/logger?id=a%20b&flag").unwrap(),
            Target::Binary {
                path: "/usr/bin/logger".into(),
                args: vec![("id".into(), "a b".into()), ("flag".into(), "".into())]
            }
        );
        let err = parse_uri("http://x/y").unwrap_err();
        assert!(err.to_string().contains("http://x/y"), "{err}");
    }

    /// A process that wrote and exited before the client opened its fifo (an
    /// exec through crab-init can take two milliseconds) still has its output
    /// delivered: the copy waits for the reader instead of writing into a fifo
    /// whose buffer is dropped at its last close.
    #[tokio::test]
    async fn output_reaches_a_fifo_reader_that_opens_late() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdout");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let uris = StdioUris { stdout: fifo.display().to_string(), ..Default::default() };
        let owner = IoOwner { namespace: "ns", container_id: "c", uid: 0, gid: 0 };
        let (io, launch) = ProcessIo::prepare(&uris, &owner, dir.path(), &Reaper::default()).await.unwrap();
        let mut out = std::fs::File::from(launch.stdio.stdout.unwrap());
        std::io::Write::write_all(&mut out, b"early bytes\n").unwrap();
        drop((out, launch.stdio.stdin, launch.stdio.stderr));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
        };
        io.drain(std::time::Duration::from_secs(5)).await;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(reader.join().unwrap()));
        let got = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the fifo reader got end of file");
        assert_eq!(got, "early bytes\n");
    }

    #[test]
    fn a_missing_output_fifo_is_an_error_naming_it() {
        let err = check_output_fifo(Path::new("/nonexistent/crab/stdout")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/crab/stdout"), "{err}");
    }

    #[tokio::test]
    async fn file_uri_receives_process_output() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("out/c.log");
        let uris = StdioUris { stdout: format!("file://{}", log.display()), ..Default::default() };
        let owner = IoOwner { namespace: "ns", container_id: "c", uid: 0, gid: 0 };
        let (io, launch) = ProcessIo::prepare(&uris, &owner, dir.path(), &Reaper::default()).await.unwrap();
        // Play the container: write to the stdout end we were given.
        let stdout = launch.stdio.stdout.unwrap();
        let mut f = std::fs::File::from(stdout);
        std::io::Write::write_all(&mut f, b"hello\n").unwrap();
        drop(f);
        drop(launch.stdio.stdin);
        drop(launch.stdio.stderr);
        io.drain(std::time::Duration::from_secs(5)).await;
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "hello\n");
    }
}
