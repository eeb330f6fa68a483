//! One crabd per node, end to end: two sandboxes on io.containerd.crab.v2
//! have their turns classified through crabd, and the BPF programs are loaded
//! by crabd alone, not by either shim.
//!
//! Needs the private containerd (`scripts/containerd start`) with the crab
//! shim and `crabd` side by side in its shim directory (`cargo build --release`).

use std::path::Path;
use std::time::Duration;

use crab_integration::{Container, HarnessError, Outcome, Runtime, ensure, ensure_eq, wait_until};

/// The program crabd's inspector attaches to every syscall entry.
const MARKER_PROGRAM: &str = "on_sys_enter";
/// The default crab state dir (the private containerd passes no crab config).
const TURNS_DIR: &str = "/var/lib/crab/turns";
const CRABD_SOCKET: &str = "/run/crab/crabd.sock";

/// Ids of the loaded BPF programs named `name`, from `bpftool prog list`.
fn program_ids(name: &str) -> Outcome<Vec<u64>> {
    let output = std::process::Command::new("bpftool")
        .args(["prog", "list", "--json"])
        .output()
        .map_err(|e| HarnessError::io("running bpftool", e))?;
    let list: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| HarnessError::Parse { what: "bpftool output".into(), detail: e.to_string() })?;
    Ok(list
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"] == name)
        .filter_map(|p| p["id"].as_u64())
        .collect())
}

/// The BPF program ids a process holds open (its fdinfo says `prog_id:`).
fn programs_held_by(pid: u32) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return Vec::new() };
    fds.flatten()
        .filter_map(|fd| std::fs::read_to_string(fd.path()).ok())
        .filter_map(|info| info.lines().find_map(|l| l.strip_prefix("prog_id:")).and_then(|v| v.trim().parse().ok()))
        .collect()
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

/// Every process holding one of `programs`, with how many distinct ones it
/// holds (a loaded program shows up in several descriptors: program, link).
fn holders(programs: &[u64]) -> Vec<(u32, String, usize)> {
    crab_integration::host::all_pids()
        .into_iter()
        .filter_map(|pid| {
            let mut ids = programs_held_by(pid);
            ids.retain(|id| programs.contains(id));
            ids.sort_unstable();
            ids.dedup();
            let held = ids.len();
            (held > 0).then(|| (pid, comm(pid), held))
        })
        .collect()
}

/// The classes in a sandbox's turn log, in turn order.
fn turn_classes(id: &str) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(Path::new(TURNS_DIR).join(format!("{id}.jsonl"))).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|r| Some((r["turn"].as_u64()?, r["class"].as_str()?.to_string())))
        .collect()
}

/// Waits for turn `turn` of `container` in its turn log and checks its class.
async fn expect_class(container: &Container, turn: u64, class: &str) -> Outcome<()> {
    let (_, got) = wait_until(&format!("turn {turn} of {} in the turn log", container.id()), Duration::from_secs(30), || async {
        Ok(turn_classes(container.id()).into_iter().find(|(t, _)| *t == turn))
    })
    .await?;
    ensure_eq!(got.as_str(), class, "class of turn {turn} of {}", container.id());
    Ok(())
}

async fn run_turns(container: &Container) -> Outcome<()> {
    container.start(&["sh", "-c", "sleep 600"]).await?;
    // Turn 1 only settles the container: under load, records of its start-up
    // were seen to land in the first turn ("process (exe) outlives the turn").
    container.exec_ok("settle", &["true"]).await?;
    wait_until("turn 1 in the turn log", Duration::from_secs(30), || async {
        Ok(turn_classes(container.id()).into_iter().find(|(t, _)| *t == 1))
    })
    .await?;
    container.exec_ok("write", &["sh", "-c", "echo from-a-turn > /turn-file"]).await?;
    expect_class(container, 2, "fs").await?;
    container.exec_ok("read", &["cat", "/turn-file"]).await?;
    expect_class(container, 3, "clean").await
}

async fn remove(container: &Container) {
    let _ = container.kill("SIGKILL", true).await;
    let _ = container.wait_status("STOPPED", Duration::from_secs(10)).await;
    let _ = container.delete_task().await;
    let _ = container.delete_container().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sandboxes_share_one_crabd_and_one_set_of_bpf_programs() {
    let runtime = Runtime::parse("crab").unwrap();
    let first = Container::new(&runtime, "node-a");
    let second = Container::new(&runtime, "node-b");
    let outcome = async {
        let (a, b) = tokio::join!(run_turns(&first), run_turns(&second));
        a?;
        b?;
        ensure!(Path::new(CRABD_SOCKET).exists(), "{CRABD_SOCKET} exists once a crab sandbox ran");

        let programs = program_ids(MARKER_PROGRAM)?;
        let holders = holders(&programs);
        let crabd = crab_integration::host::unix_listener_pid(Path::new(CRABD_SOCKET))?;
        ensure_eq!(comm(crabd), "crabd", "the process serving {CRABD_SOCKET}");
        let held = holders.iter().find(|(pid, _, _)| *pid == crabd).map_or(0, |h| h.2);
        ensure_eq!(held, 1, "copies of {MARKER_PROGRAM} the node's crabd holds (all holders: {holders:?})");
        for container in [&first, &second] {
            let shim = container.shim_pid()?;
            let held = programs_held_by(shim);
            ensure!(held.is_empty(), "the shim of {} (pid {shim}) holds BPF programs {held:?}", container.id());
        }
        // Other holders can only be crabds of other sockets (tests) or shims
        // of older builds still running on this host.
        for (pid, comm, _) in &holders {
            ensure!(comm == "crabd" || comm.starts_with("containerd-shim"), "unexpected holder {pid} ({comm})");
        }
        eprintln!("BPF holders of {MARKER_PROGRAM}: {holders:?}");
        Ok::<(), HarnessError>(())
    }
    .await;
    remove(&first).await;
    remove(&second).await;
    if let Err(e) = outcome {
        panic!("{e}");
    }
}
