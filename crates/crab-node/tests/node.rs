//! crabd as real processes: protocol robustness, root-only access, the
//! shim-side client across a crabd restart, on-demand start, and the bucket
//! in real time. Needs root, BPF and cgroup v2 (each crabd loads the inspector).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crab_inspector::{EffectKind, cgroup_id_of_dir, cgroup2_mount, monotonic_now_ns};
use crab_node::protocol::{self, Reply, Request};
use crab_node::{ClientOptions, CommitKind, NodeClient, NodeError, PROTOCOL_VERSION, compat_identity};

const CRABD: &str = env!("CARGO_BIN_EXE_crabd");

/// A crabd serving a socket in a fresh private directory; killed on drop.
struct Crabd {
    child: Option<Child>,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Crabd {
    fn start(name: &str, extra: &[&str]) -> Self {
        let dir = tempfile::Builder::new().prefix(&format!("crabd-test-{name}-")).tempdir().unwrap();
        // Open to all, so that crabd's own directory is what keeps others out.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = dir.path().join("run/crabd.sock");
        let mut crabd = Self { child: None, socket, _dir: dir };
        crabd.restart(extra);
        crabd
    }

    /// Starts crabd (again) on the same socket and waits until it answers.
    fn restart(&mut self, extra: &[&str]) {
        let child = Command::new(CRABD)
            .args(["--config", "/dev/null", "--ring-buffer-mib", "4", "--socket"])
            .arg(&self.socket)
            .args(extra)
            .stdin(Stdio::null())
            .spawn()
            .expect("crabd starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while hello(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "crabd did not answer on {}", self.socket.display());
            assert!(self.child.as_mut().unwrap().try_wait().unwrap().is_none(), "crabd exited");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn assert_alive(&mut self) {
        assert!(self.child.as_mut().unwrap().try_wait().unwrap().is_none(), "crabd died");
        let status = status(&self.socket);
        assert_eq!(status.pid, self.pid(), "the same crabd answers");
    }
}

impl Drop for Crabd {
    fn drop(&mut self) {
        self.kill();
    }
}

fn frame(message: &impl serde::Serialize) -> Vec<u8> {
    protocol::encode(message).unwrap()
}

/// Reads one reply frame; None at end of stream.
fn read_reply(stream: &mut UnixStream) -> Option<Reply> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(header) as usize];
    stream.read_exact(&mut body).unwrap();
    Some(serde_json::from_slice(&body).unwrap())
}

fn connect(socket: &Path) -> UnixStream {
    let stream = UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
}

fn this_builds_hello() -> Request {
    Request::Hello { version: PROTOCOL_VERSION, identity: Some(compat_identity()) }
}

fn hello(socket: &Path) -> std::io::Result<UnixStream> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(&frame(&this_builds_hello()))?;
    match read_reply(&mut stream) {
        Some(Reply::Hello { version, .. }) if version == PROTOCOL_VERSION => Ok(stream),
        other => Err(std::io::Error::other(format!("hello answered {other:?}"))),
    }
}

fn status(socket: &Path) -> crab_node::NodeStatus {
    let mut stream = hello(socket).unwrap();
    stream.write_all(&frame(&Request::Status)).unwrap();
    match read_reply(&mut stream) {
        Some(Reply::Status(status)) => *status,
        other => panic!("status answered {other:?}"),
    }
}

/// Sends raw bytes on a fresh connection; returns the replies up to the end of stream.
fn replies_to(socket: &Path, bytes: &[u8], then_close_write: bool) -> Vec<Reply> {
    let mut stream = connect(socket);
    stream.write_all(bytes).unwrap();
    if then_close_write {
        stream.shutdown(std::net::Shutdown::Write).unwrap();
    }
    std::iter::from_fn(|| read_reply(&mut stream)).collect()
}

fn error_message(replies: &[Reply]) -> &str {
    match replies {
        [Reply::Error { message }] => message,
        other => panic!("expected one error reply and a closed connection, got {other:?}"),
    }
}

#[test]
fn bad_frames_get_an_error_and_a_closed_connection_and_crabd_stays_up() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    let mut crabd = Crabd::start("frames", &[]);
    let socket = crabd.socket.clone();

    // Bytes that are not JSON, in a well-formed frame.
    let mut garbage = 5u32.to_be_bytes().to_vec();
    garbage.extend_from_slice(b"\x01\xff{[x");
    assert!(error_message(&replies_to(&socket, &garbage, false)).contains("malformed"));
    crabd.assert_alive();

    // Text where a frame should be: "GET " read as a length is over a gigabyte.
    let message = error_message(&replies_to(&socket, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", false)).to_string();
    assert!(message.contains("exceeds the limit"), "{message}");
    crabd.assert_alive();

    // A length just over the limit, then the body: refused without reading it.
    let mut oversized = (protocol::MAX_REQUEST_BYTES + 1).to_be_bytes().to_vec();
    oversized.extend(std::iter::repeat_n(b' ', 4096));
    assert!(error_message(&replies_to(&socket, &oversized, false)).contains("exceeds the limit"));
    crabd.assert_alive();

    // JSON that is not a request.
    let unknown = frame(&serde_json::json!({"op": "format_disk"}));
    assert!(error_message(&replies_to(&socket, &unknown, false)).contains("malformed"));
    crabd.assert_alive();

    // A frame cut short by the peer closing.
    let mut cut = 100u32.to_be_bytes().to_vec();
    cut.extend_from_slice(b"{\"op\":");
    let _ = replies_to(&socket, &cut, true);
    crabd.assert_alive();

    // An unknown version: told what is supported, then closed.
    let replies =
        replies_to(&socket, &frame(&Request::Hello { version: 99, identity: Some(compat_identity()) }), false);
    assert_eq!(
        replies,
        vec![Reply::Unsupported { supported: vec![PROTOCOL_VERSION], identity: Some(compat_identity()) }]
    );
    crabd.assert_alive();

    // This version with another build's identity (another BPF record layout), or none: the same.
    let other_build = format!("v{PROTOCOL_VERSION}+00000000deadbeef");
    for identity in [Some(other_build), None] {
        let replies = replies_to(&socket, &frame(&Request::Hello { version: PROTOCOL_VERSION, identity }), false);
        assert_eq!(
            replies,
            vec![Reply::Unsupported { supported: vec![PROTOCOL_VERSION], identity: Some(compat_identity()) }]
        );
        crabd.assert_alive();
    }

    // Anything before hello.
    assert!(error_message(&replies_to(&socket, &frame(&Request::Status), false)).contains("before hello"));
    crabd.assert_alive();

    // After hello, a request for an unknown container is an error but the connection stays.
    let mut stream = hello(&socket).unwrap();
    stream.write_all(&frame(&Request::Drain { container: "nobody".into(), until_ns: 1 })).unwrap();
    assert!(matches!(read_reply(&mut stream), Some(Reply::Error { message }) if message.contains("not watched")));
    stream.write_all(&frame(&Request::Status)).unwrap();
    assert!(matches!(read_reply(&mut stream), Some(Reply::Status(_))));
}

#[test]
fn socket_and_directory_are_root_only() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    let crabd = Crabd::start("modes", &[]);
    let socket_mode = std::fs::metadata(&crabd.socket).unwrap().permissions().mode() & 0o777;
    let dir_mode = std::fs::metadata(crabd.socket.parent().unwrap()).unwrap().permissions().mode() & 0o777;
    assert_eq!((socket_mode, dir_mode), (0o600, 0o700));
}

/// How a forked child became nobody before it connected.
#[derive(Clone, Copy)]
enum Nobody {
    /// setresuid(65534, 65534, 65534): all of it.
    Fully,
    /// Effective uid nobody but file-system uid root: passes the file
    /// permissions, so only crabd's SO_PEERCRED check can refuse it.
    EffectiveOnly,
}

const NOBODY: libc::uid_t = 65534;

/// Forks a child that becomes nobody, connects to `socket`, says hello and
/// reads what comes back. Returns (connect errno or 0, reply bytes).
fn connect_as_nobody(socket: &Path, how: Nobody) -> (i32, Vec<u8>) {
    use std::os::unix::ffi::OsStrExt;
    let path = socket.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    assert!(path.len() < addr.sun_path.len());
    for (dst, src) in addr.sun_path.iter_mut().zip(path) {
        *dst = *src as libc::c_char;
    }
    let hello = frame(&this_builds_hello());
    let mut pipe = [0; 2];
    // SAFETY: pipe writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the child only makes raw system calls on data prepared before the fork, then _exits.
    // SAFETY: the child only makes raw system calls and _exits (no allocation, no locks).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: raw system calls on plain values and a sockaddr on this stack: they change
        // this (the only) thread, no library bookkeeping, then _exit.
        unsafe {
            let ok = match how {
                Nobody::Fully => libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY) == 0,
                Nobody::EffectiveOnly => {
                    libc::syscall(libc::SYS_setresuid, -1i32 as libc::uid_t, NOBODY, -1i32 as libc::uid_t) == 0 && {
                        libc::syscall(libc::SYS_setfsuid, 0);
                        libc::syscall(libc::SYS_setfsuid, -1i32) == 0
                    }
                }
            };
            if !ok || libc::geteuid() != NOBODY {
                libc::_exit(100);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            let rc = libc::connect(
                fd,
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            );
            if rc != 0 {
                libc::_exit(*libc::__errno_location());
            }
            libc::write(fd, hello.as_ptr().cast(), hello.len());
            let mut buf = [0u8; 4096];
            loop {
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                if n <= 0 {
                    break;
                }
                libc::write(pipe[1], buf.as_ptr().cast(), n as usize);
            }
            libc::_exit(0);
        }
    }
    // SAFETY: the write end is ours and nothing else holds it.
    unsafe { libc::close(pipe[1]) };
    // SAFETY: the read end is ours alone.
    let mut reader = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(pipe[0]) };
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes).unwrap();
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    let code = libc::WEXITSTATUS(status);
    assert_ne!(code, 100, "the child could not become nobody");
    (code, bytes)
}

#[test]
fn non_root_peers_are_refused_and_crabd_stays_up() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    let mut crabd = Crabd::start("peers", &[]);
    // Fully nobody: the 0700 directory already stops it.
    let (errno, _) = connect_as_nobody(&crabd.socket, Nobody::Fully);
    assert_eq!(errno, libc::EACCES, "connect as nobody");
    crabd.assert_alive();

    // Past the file permissions, SO_PEERCRED says uid 65534: one error reply, then closed.
    let (errno, bytes) = connect_as_nobody(&crabd.socket, Nobody::EffectiveOnly);
    assert_eq!(errno, 0, "the connect itself succeeds");
    assert!(bytes.len() > 4, "a reply came back: {bytes:?}");
    let len = u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize;
    assert_eq!(bytes.len(), 4 + len, "exactly one frame, then the connection closed");
    match serde_json::from_slice::<Reply>(&bytes[4..]).unwrap() {
        Reply::Error { message } => assert!(message.contains("uid 65534"), "{message}"),
        other => panic!("non-root peer got {other:?}"),
    }
    crabd.assert_alive();
}

/// A cgroup v2 directory for processes that stand for a container.
struct TestCgroup {
    dir: PathBuf,
    id: u64,
}

impl TestCgroup {
    fn new(name: &str) -> Self {
        let dir = cgroup2_mount().unwrap().join(format!("crab-node-test-{}-{name}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        let id = cgroup_id_of_dir(&dir).unwrap();
        Self { dir, id }
    }

    /// Starts `sh -c script` held at a `read` until it is in the cgroup, so
    /// that everything the script does happens inside it.
    fn spawn(&self, script: &str) -> Child {
        let mut child =
            Command::new("/bin/sh").args(["-c", &format!("read go; {script}")]).stdin(Stdio::piped()).spawn().unwrap();
        std::fs::write(self.dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
        child
    }

    fn run(&self, script: &str) {
        let status = self.spawn(script).wait().unwrap();
        assert!(status.success(), "{script}: {status}");
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::remove_dir(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn client_options(socket: &Path) -> ClientOptions {
    ClientOptions {
        socket: socket.to_path_buf(),
        spawn: false,
        crabd_binary: Some(CRABD.into()),
        crabd_args: vec!["--config".into(), "/dev/null".into(), "--ring-buffer-mib".into(), "4".into()],
        timeout: Duration::from_secs(5),
        spawn_wait: Duration::from_secs(20),
        max_wait: Duration::from_secs(5),
    }
}

fn opened(effects: &[crab_inspector::Effect], path: &Path) -> bool {
    effects.iter().any(|e| matches!(&e.kind, EffectKind::Open { path: p, .. } if p.path == path))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reconnects_across_a_crabd_restart_and_reports_the_gap() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    let mut crabd = Crabd::start("restart", &[]);
    let scratch = tempfile::tempdir().unwrap();
    let cgroup = TestCgroup::new("restart");
    let mut init = cgroup.spawn("sleep 600");
    let client = NodeClient::connect(client_options(&crabd.socket)).await.unwrap();
    let first_instance = client.instance().await.unwrap();
    client.watch("sandbox-r", cgroup.id, init.id()).await.unwrap();

    let before = scratch.path().join("before");
    cgroup.run(&format!("echo 1 > {}", before.display()));
    let turn = client.drain("sandbox-r", monotonic_now_ns()).await.unwrap();
    assert!(opened(&turn.effects, &before), "the write is seen through crabd: {:?}", turn.effects);
    assert_eq!(turn.lost_events, 0);

    // crabd dies; the container goes on writing; a new crabd comes up.
    crabd.kill();
    let during = scratch.path().join("during");
    cgroup.run(&format!("echo 2 > {}", during.display()));
    crabd.restart(&[]);

    let turn = client.drain("sandbox-r", monotonic_now_ns()).await.expect("the client reconnects");
    assert!(turn.lost_events >= 1, "a turn across the restart must report lost records: {turn:?}");
    assert!(!opened(&turn.effects, &during), "the new crabd cannot have seen it");
    assert_ne!(client.instance().await.unwrap(), first_instance);
    let status = status(&crabd.socket);
    assert_eq!(
        status.watched.iter().map(|w| w.container.as_str()).collect::<Vec<_>>(),
        vec!["sandbox-r"],
        "the watch was sent again"
    );

    // After the gap, turns are seen again and clean of losses.
    let after = scratch.path().join("after");
    cgroup.run(&format!("echo 3 > {}", after.display()));
    let turn = client.drain("sandbox-r", monotonic_now_ns()).await.unwrap();
    assert!(opened(&turn.effects, &after), "{:?}", turn.effects);
    assert_eq!(turn.lost_events, 0);

    client.unwatch("sandbox-r").await.unwrap();
    assert!(status_watched(&crabd.socket).is_empty());
    let _ = init.kill();
    let _ = init.wait();
}

fn status_watched(socket: &Path) -> Vec<String> {
    status(socket).watched.into_iter().map(|w| w.container).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_client_starts_crabd_and_concurrent_starts_leave_one() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    let dir = tempfile::Builder::new().prefix("crabd-test-spawn-").tempdir().unwrap();
    let socket = dir.path().join("run/crabd.sock");
    let mut options = client_options(&socket);
    options.spawn = true;
    // Three shims find no crabd at the same moment.
    let (a, b, c) = tokio::join!(
        NodeClient::connect(options.clone()),
        NodeClient::connect(options.clone()),
        NodeClient::connect(options.clone())
    );
    let instances = [a.unwrap().instance().await, b.unwrap().instance().await, c.unwrap().instance().await];
    assert!(instances.iter().all(|i| i.is_some() && *i == instances[0]), "one crabd for all: {instances:?}");
    let status = status(&socket);
    let crabds: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(socket.to_str().unwrap()))
        })
        .collect();
    assert_eq!(crabds, vec![status.pid], "exactly one crabd serves the socket");
    // It runs in a session of its own, so it outlives the shim that started it.
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", status.pid)).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    assert_eq!(fields[3], status.pid.to_string(), "crabd leads its session");
    // SAFETY: a crabd this test started.
    unsafe { libc::kill(status.pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while socket.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!socket.exists(), "crabd removes its socket on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_draws_chunks_supersedes_cancels_and_a_missing_crabd_does_not_block() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    let crabd = Crabd::start("bucket", &["--rate-mib-per-s", "4", "--burst-mib", "1"]);
    let client = NodeClient::connect(client_options(&crabd.socket)).await.unwrap();
    const MIB: u64 = 1 << 20;

    let waited = client.acquire_bandwidth("a", MIB, CommitKind::Fs, 1).await.unwrap();
    assert!(waited < 100.0, "a full bucket grants at once, waited {waited} ms");
    let started = Instant::now();
    let waited = client.acquire_bandwidth("a", MIB, CommitKind::Fs, 2).await.unwrap();
    let elapsed = started.elapsed().as_secs_f64() * 1e3;
    // 1 MiB at 4 MiB/s is 250 ms.
    assert!((200.0..600.0).contains(&elapsed) && waited >= 200.0, "second MiB after {elapsed} ms (crabd: {waited})");

    // A dump bigger than the burst is paid in 1 MiB chunks (the burst caps
    // the chunk): 8 MiB at 4 MiB/s take about 2 s, and the bucket is never in debt.
    let dump_started = Instant::now();
    let mut dumper = hello(&crabd.socket).unwrap();
    let dump = Request::Acquire {
        sandbox: "dumper".into(),
        bytes: 8 * MIB,
        kind: CommitKind::Proc,
        turn: 1,
        supersedable: false,
    };
    dumper.write_all(&frame(&dump)).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    let partway = status(&crabd.socket);
    let d = partway.bucket.sandboxes.iter().find(|s| s.sandbox == "dumper").expect("the dump is listed");
    assert_eq!(d.waiting, 1, "{d:?}");
    assert!(d.waiting_bytes < 8 * MIB && d.granted_chunks >= 1, "chunks are paid as tokens accrue: {d:?}");
    assert!(partway.bucket.tokens >= -1.0, "no debt: {}", partway.bucket.tokens);
    assert_eq!(partway.bucket.chunk_bytes, MIB);

    // A small delta of another sandbox goes between two chunks of the dump.
    let started = Instant::now();
    client.acquire_bandwidth("b", MIB / 2, CommitKind::Fs, 1).await.unwrap();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_millis(800), "delta waited {elapsed:?} behind the dump");

    // A waiting process checkpoint is superseded by a newer one of the same
    // sandbox when both may be dropped; the newer one is granted.
    let mut older = hello(&crabd.socket).unwrap();
    let old_dump =
        Request::Acquire { sandbox: "s".into(), bytes: MIB, kind: CommitKind::Proc, turn: 4, supersedable: true };
    older.write_all(&frame(&old_dump)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let newer = {
        let client = NodeClient::connect(client_options(&crabd.socket)).await.unwrap();
        tokio::spawn(async move { client.acquire_supersedable("s", MIB, 5).await })
    };
    match read_reply(&mut older) {
        Some(Reply::Superseded { by_turn, waited_ms }) => {
            assert!(by_turn == 5 && waited_ms >= 50.0, "{by_turn} {waited_ms}")
        }
        other => panic!("the older dump got {other:?}"),
    }
    let s = status(&crabd.socket).bucket.sandboxes.into_iter().find(|s| s.sandbox == "s").unwrap();
    assert_eq!((s.superseded, s.superseded_bytes, s.waiting), (1, MIB, 1), "{s:?}");

    // A newer process capture reported on the control connection supersedes
    // a waiting draw of an earlier turn of that sandbox.
    let mut draw = hello(&crabd.socket).unwrap();
    let old_draw =
        Request::Acquire { sandbox: "p".into(), bytes: MIB, kind: CommitKind::Proc, turn: 7, supersedable: true };
    draw.write_all(&frame(&old_draw)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    client.process_captured("p", 8).await;
    match read_reply(&mut draw) {
        Some(Reply::Superseded { by_turn: 8, .. }) => {}
        other => panic!("the draw of turn 7 got {other:?}"),
    }
    // The client draws in the chunk its crabd names (the burst caps it here).
    assert_eq!(client.chunk_bytes(), MIB);

    // An explicit cancel while waiting.
    let mut stream = hello(&crabd.socket).unwrap();
    let acquire =
        Request::Acquire { sandbox: "c".into(), bytes: MIB, kind: CommitKind::Proc, turn: 1, supersedable: false };
    stream.write_all(&frame(&acquire)).unwrap();
    // A waiting request shows up in the status with its lag.
    std::thread::sleep(Duration::from_millis(300));
    let waiting = status(&crabd.socket);
    let c = waiting.bucket.sandboxes.iter().find(|s| s.sandbox == "c").expect("c is listed");
    assert_eq!((c.waiting, c.waiting_bytes, c.oldest_waiting_turn), (1, MIB, Some(1)));
    assert!(c.lag_ms >= 250.0 && c.max_lag_ms >= c.lag_ms, "lag {} max {}", c.lag_ms, c.max_lag_ms);
    stream.write_all(&frame(&Request::Cancel)).unwrap();
    assert_eq!(read_reply(&mut stream), Some(Reply::Cancelled));

    // The dump and the newer checkpoint are granted in the end, at the bucket's pace.
    assert!(matches!(read_reply(&mut dumper), Some(Reply::Granted { .. })));
    let dump_took = dump_started.elapsed().as_secs_f64();
    assert!(dump_took >= 1.5, "8 MiB at 4 MiB/s with 1 MiB in the bucket granted after {dump_took} s");
    match newer.await.unwrap().unwrap() {
        crab_node::Acquired::Granted { .. } => {}
        other => panic!("the newer dump got {other:?}"),
    }

    // A closed connection withdraws too.
    let mut stream = hello(&crabd.socket).unwrap();
    stream.write_all(&frame(&acquire)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(status(&crabd.socket).bucket.sandboxes.iter().map(|s| s.waiting).sum::<u64>(), 1);
    drop(stream);
    std::thread::sleep(Duration::from_millis(100));
    let after = status(&crabd.socket);
    assert_eq!(after.bucket.sandboxes.iter().map(|s| s.waiting).sum::<u64>(), 0, "{after:?}");
    assert_eq!(after.bucket.superseded, 2);
    assert!(after.bucket.max_lag_ms >= dump_took * 1e3 - 100.0, "node max lag {} ms", after.bucket.max_lag_ms);

    // Eviction marks show in the status.
    crab_node::set_eviction(&crabd.socket, "c", true).await.unwrap();
    let status_now = crab_node::status_report(&crabd.socket).await.unwrap();
    assert!(status_now.bucket.sandboxes.iter().any(|s| s.sandbox == "c" && s.evicting));
    let text = crab_node::render_status(&status_now);
    assert!(text.contains("SANDBOX") && text.contains("yes") && text.contains("SUPERSEDED"), "{text}");

    // With crabd gone, a commit goes ahead at once instead of waiting, and says why.
    drop(crabd);
    let started = Instant::now();
    let acquired = client.acquire("a", 10 * MIB, CommitKind::Fs, 3, false).await;
    assert!(
        matches!(&acquired, crab_node::Acquired::Ungated { reason, .. } if reason.contains("crabd unavailable")),
        "{acquired:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_waiting_when_crabd_is_killed_is_granted_by_the_crabd_started_again() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    const MIB: u64 = 1 << 20;
    let mut crabd = Crabd::start("acquire-restart", &["--rate-mib-per-s", "1", "--burst-mib", "1"]);
    let socket = crabd.socket.clone();
    let options = ClientOptions { spawn: true, ..client_options(&socket) };
    let client = std::sync::Arc::new(NodeClient::connect(options).await.unwrap());
    client.acquire_bandwidth("a", MIB, CommitKind::Fs, 1).await.unwrap();
    // 2 MiB at 1 MiB/s from an empty bucket: about 2 s, far longer than the kill below.
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { client.acquire_bandwidth("a", 2 * MIB, CommitKind::Proc, 2).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let old_pid = crabd.pid();
    // SIGKILL: no clean-up, the socket file stays behind and refuses connections.
    crabd.kill();
    let granted = tokio::time::timeout(Duration::from_secs(20), waiting).await.expect("the acquire ends").unwrap();
    let waited_ms = granted.expect("granted by the new crabd");
    let new = status(&socket);
    let _guard = scopeguard(new.pid);
    assert_ne!(new.pid, old_pid, "a new crabd serves the socket");
    let a = new.bucket.sandboxes.iter().find(|s| s.sandbox == "a").expect("the commit went through the new crabd");
    assert_eq!((a.granted_bytes, a.granted_requests), (2 * MIB, 1), "{a:?} (waited {waited_ms} ms there)");
}

/// Kills the crabd of `pid` (one a test caused to start) on drop.
fn scopeguard(pid: u32) -> impl Drop {
    struct KillOnDrop(u32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            // SAFETY: kill(2) on a pid this test's client started.
            unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
        }
    }
    KillOnDrop(pid)
}

/// Benchmark, not run by default (`cargo test --release --test node -- --ignored --nocapture`):
/// 16 sandboxes commit turns (think, then write and fsync the turn's bytes)
/// with and without crabd's bucket. Prints the highest aggregate write rate
/// over 1 s windows and the turn latency percentiles of both runs. The offered
/// load averages about 115 MiB/s; CRAB_BENCH_RATE_MIB and CRAB_BENCH_BURST_MIB
/// set the bucket (default 160 and 32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: takes about a minute and prints figures"]
async fn bench_sixteen_sandboxes_with_and_without_the_bucket() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    const MIB: u64 = 1 << 20;
    let setting = |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (rate_mib, burst_mib) = (setting("CRAB_BENCH_RATE_MIB", 160), setting("CRAB_BENCH_BURST_MIB", 32));
    let crabd =
        Crabd::start("bench", &["--rate-mib-per-s", &rate_mib.to_string(), "--burst-mib", &burst_mib.to_string()]);
    let client = std::sync::Arc::new(NodeClient::connect(client_options(&crabd.socket)).await.unwrap());
    let scratch = tempfile::Builder::new().prefix("crabd-bench-").tempdir_in("/var/tmp").unwrap();
    for paced in [false, true] {
        let started = Instant::now();
        let mut tasks = Vec::new();
        for sandbox in 0..16u64 {
            let client = client.clone();
            let dir = scratch.path().join(format!("{paced}-{sandbox}"));
            std::fs::create_dir_all(&dir).unwrap();
            tasks.push(tokio::spawn(async move {
                let mut seed = 0x2545F4914F6CDD1Du64 ^ (sandbox + 1).wrapping_mul(0x9e3779b97f4a7c15);
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let mut samples = Vec::new();
                for turn in 1..=24u64 {
                    tokio::time::sleep(Duration::from_millis(200 + next() % 600)).await;
                    let (kind, bytes) = if next() % 5 == 0 {
                        (CommitKind::Proc, 8 * MIB + next() % (16 * MIB))
                    } else {
                        (CommitKind::Fs, 64 * 1024 + next() % (2 * MIB))
                    };
                    let turn_started = Instant::now();
                    if paced {
                        client.acquire_bandwidth(&format!("bench-{sandbox}"), bytes, kind, turn).await.unwrap();
                    }
                    let path = dir.join(format!("turn-{turn}"));
                    tokio::task::spawn_blocking(move || {
                        let mut file = std::fs::File::create(&path).unwrap();
                        file.write_all(&vec![0x5a; bytes as usize]).unwrap();
                        file.sync_all().unwrap();
                        std::fs::remove_file(&path).unwrap();
                    })
                    .await
                    .unwrap();
                    samples.push((turn_started.elapsed(), Instant::now(), bytes));
                }
                samples
            }));
        }
        let mut latencies = Vec::new();
        let mut writes = Vec::new();
        for task in tasks {
            for (latency, done, bytes) in task.await.unwrap() {
                latencies.push(latency);
                writes.push(((done - started).as_secs_f64(), bytes));
            }
        }
        latencies.sort();
        writes.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total: u64 = writes.iter().map(|w| w.1).sum();
        let span = writes.last().unwrap().0;
        // Bytes finished within any 1 s window, per second.
        let mut peak = 0f64;
        for (i, (start, _)) in writes.iter().enumerate() {
            let in_window: u64 = writes[i..].iter().take_while(|w| w.0 < start + 1.0).map(|w| w.1).sum();
            peak = peak.max(in_window as f64);
        }
        let pct = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e3;
        println!(
            "{}: {} turns, {:.0} MiB in {:.1} s ({:.1} MiB/s mean), peak 1 s window {:.1} MiB/s, turn latency p50 {:.0} ms p99 {:.0} ms max {:.0} ms",
            if paced { format!("bucket {rate_mib} MiB/s burst {burst_mib} MiB") } else { "no bucket".to_string() },
            latencies.len(),
            total as f64 / MIB as f64,
            span,
            total as f64 / MIB as f64 / span,
            peak / MIB as f64,
            pct(0.5),
            pct(0.99),
            pct(1.0),
        );
        if paced {
            // Grants in any 1 s window: burst + rate, plus one commit's excess over the burst.
            let bound = (burst_mib + rate_mib) as f64 * MIB as f64 + 16.0 * MIB as f64;
            assert!(peak <= bound, "peak {:.1} MiB/s above the bucket's bound", peak / MIB as f64);
        }
    }
}

/// A stand-in crabd that answers every hello with `reply` (for peers of other builds: a real
/// crabd of this build always announces this build's identity). Returns the socket and how
/// many hellos it answered.
fn fake_crabd(dir: &Path, reply: Reply) -> (PathBuf, std::sync::Arc<std::sync::atomic::AtomicU32>) {
    let socket = dir.join("fake.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counter = answered.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut header = [0u8; 4];
            if stream.read_exact(&mut header).is_err() {
                continue;
            }
            let mut body = vec![0u8; u32::from_be_bytes(header) as usize];
            if stream.read_exact(&mut body).is_ok() && serde_json::from_slice::<Request>(&body).is_ok() {
                // Counted before answering: the client may be done as soon as it reads the reply.
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = stream.write_all(&frame(&reply));
            }
        }
    });
    (socket, answered)
}

/// A crabd announcing another build's identity (another BPF record layout or wire format) is
/// refused with an error that names both identities, at once and without starting another
/// crabd; so is one too old to announce any, and one that refuses this build's hello. Against
/// it a commit goes ahead without a grant, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crabd_of_another_identity_is_refused_with_both_identities_named() {
    let ours = compat_identity();
    let other = format!("v{PROTOCOL_VERSION}+00000000deadbeef");
    let hello_of = |identity: Option<String>| Reply::Hello {
        version: PROTOCOL_VERSION,
        identity,
        instance: "other-build".into(),
        pid: 4242,
        chunk_bytes: Some(1 << 20),
    };
    let cases = [
        (hello_of(Some(other.clone())), other.clone()),
        (hello_of(None), "none (protocol 2, a build older than identities)".to_string()),
        (Reply::Unsupported { supported: vec![PROTOCOL_VERSION], identity: Some(other.clone()) }, other.clone()),
        // A crabd of protocol 1 rejects the unknown identity field of this hello.
        (
            Reply::Error { message: "malformed message: unknown field `identity`, expected `version`".into() },
            "none (a build older than identities)".to_string(),
        ),
    ];
    for (reply, theirs) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (socket, answered) = fake_crabd(dir.path(), reply.clone());
        // Allowed to start crabd: a crabd that answers is not absent, so none is started.
        let options = ClientOptions { spawn: true, ..client_options(&socket) };
        let started = Instant::now();
        let error = match NodeClient::connect(options).await {
            Err(error) => error,
            Ok(_) => panic!("connected to a crabd answering {reply:?}"),
        };
        assert!(started.elapsed() < Duration::from_secs(2), "refused after {:?}", started.elapsed());
        match &error {
            NodeError::Incompatible { ours: o, theirs: t, .. } => assert_eq!((o, t), (&ours, &theirs)),
            other => panic!("{reply:?} gave {other:?}"),
        }
        let message = error.to_string();
        assert!(message.contains(&ours) && message.contains(&theirs) && message.contains("another build"), "{message}");
        assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 1, "one hello, no retries");
        assert!(socket.exists(), "the socket is the fake's, not replaced by a started crabd");
        // crabctl node says the same.
        let status = crab_node::status_report(&socket).await.unwrap_err().to_string();
        assert!(status.contains(&ours) && status.contains(&theirs), "{status}");
    }
}

/// A crabd that stops answering (SIGSTOP) mid-run: every request of the client still ends
/// within its bound (watch and drain within `timeout`, an acquire within `max_wait`, going
/// ahead ungranted), the drain cut off is reported as a gap, and once crabd answers again the
/// client uses it again and watches what it could not watch meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_crabd_costs_each_request_its_bound_and_nothing_hangs() {
    crab_sys::skip_unless_root!("crabd's root-only socket and directory");
    const MIB: u64 = 1 << 20;
    let crabd = Crabd::start("stopped", &["--rate-mib-per-s", "64", "--burst-mib", "8"]);
    let cgroup = TestCgroup::new("stopped");
    let mut init = cgroup.spawn("sleep 600");
    let late = TestCgroup::new("stopped-late");
    let mut late_init = late.spawn("sleep 600");
    let timeout = Duration::from_millis(800);
    let max_wait = Duration::from_millis(1500);
    let options = ClientOptions { timeout, max_wait, ..client_options(&crabd.socket) };
    let client = NodeClient::connect(options).await.unwrap();
    client.watch("sandbox-s", cgroup.id, init.id()).await.unwrap();
    let scratch = tempfile::tempdir().unwrap();
    cgroup.run(&format!("echo 1 > {}", scratch.path().join("before").display()));
    assert_eq!(client.drain("sandbox-s", monotonic_now_ns()).await.unwrap().lost_events, 0);

    // SAFETY: kill(2) of the crabd this test started.
    assert_eq!(unsafe { libc::kill(crabd.pid() as i32, libc::SIGSTOP) }, 0);
    let resume = ScopedSigcont(crabd.pid());
    wait_until_stopped(crabd.pid());
    let slack = Duration::from_millis(500);
    let started = Instant::now();
    let drained = client.drain("sandbox-s", monotonic_now_ns()).await;
    assert!(started.elapsed() < timeout + slack, "drain took {:?}", started.elapsed());
    let error = drained.unwrap_err();
    assert!(error.to_string().contains("did not answer within 800 ms"), "{error}");
    let started = Instant::now();
    assert!(client.watch("sandbox-late", late.id, late_init.id()).await.is_err());
    assert!(started.elapsed() < timeout + slack, "watch took {:?}", started.elapsed());
    let started = Instant::now();
    let acquired = client.acquire("sandbox-s", MIB, CommitKind::Fs, 2, false).await;
    assert!(started.elapsed() < max_wait + slack, "acquire took {:?}", started.elapsed());
    assert!(
        matches!(&acquired, crab_node::Acquired::Ungated { reason, .. } if reason.contains("max_wait")),
        "{acquired:?}"
    );
    // The next write-out does not wait the bound again.
    let started = Instant::now();
    let acquired = client.acquire("sandbox-s", MIB, CommitKind::Fs, 3, false).await;
    assert!(started.elapsed() < Duration::from_millis(100), "second acquire took {:?}", started.elapsed());
    assert!(
        matches!(&acquired, crab_node::Acquired::Ungated { reason, .. } if reason.contains("not asked again")),
        "{acquired:?}"
    );
    let ungated_since = Instant::now();
    let started = Instant::now();
    client.process_captured("sandbox-s", 2).await;
    assert!(started.elapsed() < timeout + slack, "process_captured took {:?}", started.elapsed());

    // crabd answers again: the same instance, so no restart, but the drain cut off may have
    // taken effects (a gap), and the watch that timed out is sent again.
    drop(resume);
    let after = scratch.path().join("after");
    cgroup.run(&format!("echo 3 > {}", after.display()));
    let turn = client.drain("sandbox-s", monotonic_now_ns()).await.expect("crabd answers again");
    assert!(turn.lost_events >= 1, "the drain cut off is a gap: {turn:?}");
    assert!(opened(&turn.effects, &after), "{:?}", turn.effects);
    let mut watched = status_watched(&crabd.socket);
    watched.sort();
    assert_eq!(watched, vec!["sandbox-late", "sandbox-s"], "the watch that timed out was sent again");
    let late_turn = client.drain("sandbox-late", monotonic_now_ns()).await.unwrap();
    assert!(late_turn.lost_events >= 1, "records before the late watch are lost: {late_turn:?}");
    let turn = client.drain("sandbox-s", monotonic_now_ns()).await.unwrap();
    assert_eq!(turn.lost_events, 0, "{turn:?}");
    // Once the bound has passed, commits ask crabd again.
    tokio::time::sleep(max_wait.saturating_sub(ungated_since.elapsed())).await;
    let acquired = client.acquire("sandbox-s", MIB, CommitKind::Fs, 4, false).await;
    assert!(matches!(acquired, crab_node::Acquired::Granted { .. }), "{acquired:?}");
    for child in [&mut init, &mut late_init] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Continues a stopped process on drop (a failed assertion must not leave crabd stopped).
/// kill(2) only queues SIGSTOP: a thread busy in user space answers one more request before
/// it stops. Waits until every thread of `pid` shows state T.
fn wait_until_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let states: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("stat")).ok())
            .map(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest[..1].to_string()).unwrap_or_default())
            .collect();
        if !states.is_empty() && states.iter().all(|state| state == "T") {
            return;
        }
        assert!(Instant::now() < deadline, "crabd {pid} not stopped: thread states {states:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct ScopedSigcont(u32);

impl Drop for ScopedSigcont {
    fn drop(&mut self) {
        // SAFETY: kill(2) of the crabd this test stopped.
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}
