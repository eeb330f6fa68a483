//! A hostile sandbox (issue 14): agent code is root in its container and attacks what crab
//! does on the host on its behalf. Each scenario runs under crab, against real containerd, runc
//! and crab-init; the file-system races of capture and rollback are forced with failpoints in
//! the library's own tests (`checkpoint::fsdelta::races`).

use std::time::Duration;

use crab_integration::env::CRAB_RUNTIME;
use crab_integration::{Container, Outcome, Runtime, ensure, ensure_eq};

const SHORT: Duration = Duration::from_secs(20);

fn crab() -> Runtime {
    Runtime::parse(CRAB_RUNTIME).expect("crab runtime name")
}

async fn remove(container: &Container) {
    let _ = container.kill("SIGKILL", true).await;
    let _ = container.wait_status("STOPPED", SHORT).await;
    let _ = container.delete_task().await;
    let _ = container.delete_container().await;
}

/// The container replaces the spawner's socket with a symlink to a socket of the host, then
/// waits for the shim to reconnect (after a pause). The shim must never connect to the host's
/// socket: it opens the entry without following links and refuses anything but a socket. Execs
/// go on working through the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_at_the_spawner_socket_never_leads_the_shim_to_a_host_socket() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "hostile-spawner-link");
    container.start(&["sleep", "100000"]).await.expect("start");
    let host_socket = std::path::PathBuf::from(format!("/tmp/crab-hostile-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&host_socket);
    let listener = tokio::net::UnixListener::bind(&host_socket).expect("bind the host socket");
    let result: Outcome<()> = async {
        // Connected to the genuine spawner first.
        let first = container.exec_ok("first", &["echo", "first"]).await?;
        ensure_eq!(first.trim(), "first", "exec through the spawner");
        let swap = format!("rm /dev/.crab/sock && ln -s {} /dev/.crab/sock && echo swapped", host_socket.display());
        let swapped = container.exec_ok("swap", &["sh", "-c", &swap]).await?;
        ensure_eq!(swapped.trim(), "swapped", "the container's swap");
        // A pause lets go of the spawner; the resume reconnects.
        container.ctr().invoke(["task", "pause", container.id()]).timeout(SHORT).success().await?;
        container.ctr().invoke(["task", "resume", container.id()]).timeout(SHORT).success().await?;
        let accepted = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await;
        ensure!(accepted.is_err(), "the shim connected to the host socket the container's symlink named");
        let after = container.exec_ok("after", &["echo", "after"]).await?;
        ensure_eq!(after.trim(), "after", "exec after the swap");
        Ok(())
    }
    .await;
    remove(&container).await;
    let _ = std::fs::remove_file(&host_socket);
    result.expect("symlinked spawner socket");
}

/// Issue 14 finding 6: `/dev/.crab` was a writable bind of a host directory, so what the container
/// wrote there landed on the host's disk outside every quota. It is a tmpfs of the container's own
/// now, bounded in bytes: 20 MB written there fail (and are charged to the container, in
/// memory), nothing of the host is behind it, and the spawner still answers through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spawner_directory_is_a_small_tmpfs_of_the_containers_own() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "hostile-spawner-fill");
    container.start(&["sleep", "100000"]).await.expect("start");
    let result: Outcome<()> = async {
        let fill = "dd if=/dev/zero of=/dev/.crab/fill bs=1M count=20 2>/dev/null; echo status=$?; \
                    wc -c < /dev/.crab/fill; rm -f /dev/.crab/fill";
        let out = container.exec_ok("fill", &["sh", "-c", fill]).await?;
        let mut lines = out.lines();
        ensure!(lines.next() != Some("status=0"), "20 MB written into /dev/.crab: {out}");
        let written: u64 = lines.next().and_then(|n| n.trim().parse().ok()).unwrap_or(u64::MAX);
        ensure!(written <= 64 * 1024, "{written} bytes written into /dev/.crab: not bounded to 64 KiB");
        // The kernel's account, from the host: /dev/.crab is a tmpfs (no host directory as its
        // root), mounted with its bounds.
        let pid = container.init_pid().await?;
        let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .map_err(|e| crab_integration::HarnessError::io("reading the init's mountinfo", e))?;
        let line = mountinfo
            .lines()
            .find(|l| l.split_whitespace().nth(4) == Some("/dev/.crab"))
            .ok_or_else(|| crab_integration::HarnessError::Expectation(format!("no /dev/.crab mount:\n{mountinfo}")))?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let separator = fields.iter().position(|f| *f == "-").unwrap_or(fields.len());
        ensure_eq!(fields.get(separator + 1).copied(), Some("tmpfs"), "file system of /dev/.crab ({line})");
        ensure_eq!(fields[3], "/", "root of the /dev/.crab mount: a host directory? ({line})");
        ensure!(line.contains("size=64k"), "the /dev/.crab tmpfs is not bounded: {line}");
        // The spawner still serves the shim through its socket there.
        let parent = container.exec_ok("after-fill", &["sh", "-c", "cat /proc/$PPID/comm"]).await?;
        ensure_eq!(parent.trim(), "crab-spawner", "the exec's parent after the fill");
        Ok(())
    }
    .await;
    remove(&container).await;
    result.expect("bounded /dev/.crab");
}

/// The spawner answers the shim for the container: a process of the container, root like it,
/// must not be able to ptrace it or read or write its memory. It is not dumpable, so the
/// kernel refuses the container (no CAP_SYS_PTRACE) what it would allow between processes of
/// the same user; /proc/<pid>/environ takes the same check as ptrace's read access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_cannot_trace_the_spawner() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "hostile-spawner-ptrace");
    container.start(&["sleep", "100000"]).await.expect("start");
    let probe = "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = crab-spawner ] || continue; \
                 echo spawner; cat $p/environ >/dev/null 2>&1 && echo readable; done; true";
    let result: Outcome<()> = async {
        let seen = container.exec_ok("probe", &["sh", "-c", probe]).await?;
        ensure!(seen.contains("spawner"), "no crab-spawner process in the container: {seen:?}");
        ensure!(!seen.contains("readable"), "the container read the spawner's environment: {seen:?}");
        Ok(())
    }
    .await;
    remove(&container).await;
    result.expect("spawner not traceable");
}

/// What a process outside the container gets from the spawner when it reaches its socket through
/// `/proc/<init>/root` and sends `first` as its first frame: every frame it is sent before the
/// spawner closes (or 15 s pass).
fn outsider_exchange(init_pid: u32, first: &[u8]) -> Outcome<Vec<serde_json::Value>> {
    use std::io::{Read, Write};
    let io = |what: &str| {
        let what = what.to_string();
        move |e| crab_integration::HarnessError::io(&what, e)
    };
    let path = format!("/proc/{init_pid}/root{}", crab_init::SOCKET_PATH);
    let mut stream = std::os::unix::net::UnixStream::connect(&path).map_err(io("connect to the spawner"))?;
    stream.set_read_timeout(Some(Duration::from_secs(15))).map_err(io("read timeout"))?;
    stream.write_all(first).map_err(io("first frame"))?;
    let mut data = Vec::new();
    // Until the spawner hangs up; a spawner that let us in would keep the connection open.
    let _ = stream.read_to_end(&mut data);
    let mut frames = Vec::new();
    let mut rest = data.as_slice();
    while let Ok(Some((payload, used))) = crab_init::protocol::split_frame(rest) {
        frames.push(serde_json::from_slice(payload).map_err(|e| crab_integration::HarnessError::Parse {
            what: "spawner frame".into(),
            detail: e.to_string(),
        })?);
        rest = &rest[used..];
    }
    Ok(frames)
}

/// Issue 14: seen from the container's pid namespace, every process outside it is pid 0, the shim
/// and any other root process that can reach `/proc/<init>/root` (one of a hostPID pod, say)
/// alike, so the kernel's credentials cannot tell them apart. The spawner lets a connection in
/// only when its first frame proves the key the shim gave crab-init at Create. This test is such
/// a process: root on the host, it asks the spawner for its sessions, first plainly, then with a
/// key of its own making. It gets a refusal each time, and the shim keeps its spawner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_process_outside_the_container_that_reaches_the_spawner_is_refused() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "hostile-spawner-outsider");
    container.start(&["sleep", "100000"]).await.expect("start");
    let result: Outcome<()> = async {
        let parent = container.exec_ok("before", &["sh", "-c", "cat /proc/$PPID/comm"]).await?;
        ensure_eq!(parent.trim(), "crab-spawner", "the exec's parent before the outsider");
        let pid = container.init_pid().await?;
        let guessed = crab_init::protocol::SpawnerKey::from_bytes([0x5a; crab_init::protocol::KEY_BYTES]);
        let attempts = [
            ("no key", crab_init::protocol::encode(&crab_init::protocol::Request::List)),
            (
                "a guessed key",
                crab_init::protocol::encode(&crab_init::protocol::Request::Auth { key: guessed.to_hex() }),
            ),
        ];
        for (how, first) in attempts {
            let frames = tokio::task::spawn_blocking(move || outsider_exchange(pid, &first))
                .await
                .map_err(|e| crab_integration::HarnessError::Expectation(e.to_string()))??;
            ensure!(
                frames.len() == 1 && frames[0]["kind"] == "error",
                "the spawner answered an outsider with {how} with {frames:?}, not one refusal"
            );
            let message = frames[0]["message"].as_str().unwrap_or_default();
            ensure!(message.contains("connection refused") && message.contains("key"), "refusal ({how}): {message}");
        }
        let parent = container.exec_ok("after", &["sh", "-c", "cat /proc/$PPID/comm"]).await?;
        ensure_eq!(parent.trim(), "crab-spawner", "the exec's parent after the outsider");
        Ok(())
    }
    .await;
    remove(&container).await;
    result.expect("outsider refused");
}
