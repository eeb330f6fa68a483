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

/// The spawner answers the shim for the container: a process of the container, root like it,
/// must not be able to ptrace it or read or write its memory. It is not dumpable, so the
/// kernel refuses the container (no CAP_SYS_PTRACE) what it would allow between processes of
/// the same user; /proc/<pid>/environ takes the same check as ptrace's read access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_cannot_trace_the_spawner() {
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
