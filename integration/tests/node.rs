//! One crabd per node, end to end: two sandboxes on io.containerd.crab.v2
//! have their turns classified through crabd, and the BPF programs are loaded
//! by crabd alone, not by either shim.
//!
//! Needs the private containerd (`scripts/containerd start`) with the crab
//! shim and `crabd` side by side in its shim directory (`cargo build --release`).

use std::path::Path;
use std::time::Duration;

use crab_integration::{Container, HarnessError, Outcome, Runtime, ensure, ensure_eq, wait_until};

/// The tests here share the node's crabd and one kills it: they run one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A program of crabd's inspector (the `sched_process_exec` handler): its
/// syscall programs have been reorganised, this one has kept its name.
const MARKER_PROGRAM: &str = "on_exec";

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
    let text = std::fs::read_to_string(state_dir().join("turns").join(format!("{id}.jsonl"))).unwrap_or_default();
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
    let _alone = ONE_AT_A_TIME.lock().await;
    let runtime = Runtime::parse("crab").unwrap();
    let first = Container::new(&runtime, "node-a");
    let second = Container::new(&runtime, "node-b");
    let outcome = async {
        let (a, b) = tokio::join!(run_turns(&first), run_turns(&second));
        a?;
        b?;
        // crabd answers on the socket of the crab config (CRAB_CONFIG, else the default).
        let crabd = node_status()?["pid"].as_u64().unwrap_or(0) as u32;
        let programs = program_ids(MARKER_PROGRAM)?;
        let holders = holders(&programs);
        ensure_eq!(comm(crabd), "crabd", "the process answering `crabctl node`");
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

/// crabd's view as `crabctl node --json` prints it (the crab config of
/// `CRAB_CONFIG` names the socket).
fn node_status() -> Outcome<serde_json::Value> {
    let output = std::process::Command::new(crabctl())
        .args(["node", "--json"])
        .output()
        .map_err(|e| HarnessError::io("running crabctl node", e))?;
    ensure!(output.status.success(), "crabctl node: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout)
        .map_err(|e| HarnessError::Parse { what: "crabctl node --json".into(), detail: e.to_string() })
}

/// `crabctl` beside the shim containerd starts (`CRAB_SHIM_DIR`), else on PATH.
fn crabctl() -> std::path::PathBuf {
    std::env::var_os("CRAB_SHIM_DIR")
        .map(|dir| Path::new(&dir).join("crabctl"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| "crabctl".into())
}

fn state_dir() -> std::path::PathBuf {
    std::env::var_os("CRAB_STATE_DIR").map_or_else(|| "/var/lib/crab".into(), Into::into)
}

/// Every complete record of a sandbox's turn log: (turn, class, checkpoint turn, reasons).
fn turn_records(id: &str) -> Vec<(u64, String, Option<u64>, Vec<String>)> {
    let path = state_dir().join("turns").join(format!("{id}.jsonl"));
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rsplit_once('\n').map_or("", |(lines, _)| lines);
    complete
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|r| {
            let reasons = r["reasons"].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_string)).collect();
            Some((r["turn"].as_u64()?, r["class"].as_str()?.to_string(), r["checkpoint_turn"].as_u64(), reasons))
        })
        .collect()
}

/// Bytes in the checkpoint store now (blobs, manifests, tmp files of commits
/// under way): what checkpoints have written, measured on disk, not counted by
/// crabd. Each file counts once by its inode: a blob renamed from tmp/ into
/// blobs/ while the walk is between the two would otherwise count twice.
/// (A shim's /proc/PID/io would also count its reaped children: the agent's
/// own exec processes and CRIU.)
fn store_bytes(dir: &Path) -> u64 {
    fn walk(dir: &Path, seen: &mut std::collections::HashSet<u64>) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
        entries
            .flatten()
            .map(|entry| match entry.file_type() {
                Ok(kind) if kind.is_dir() => walk(&entry.path(), seen),
                Ok(kind) if kind.is_file() => entry.metadata().map_or(0, |m| if seen.insert(m.ino()) { m.len() } else { 0 }),
                _ => 0,
            })
            .sum()
    }
    walk(dir, &mut std::collections::HashSet::new())
}

/// The turn of a sandbox at step `turn`: every fourth leaves a process behind
/// (a proc turn: CRIU dump), the others write 2 MiB of fresh random bytes (fs).
fn turn_script(turn: u64) -> String {
    if turn % 4 == 3 {
        format!("sleep 1000 >/dev/null 2>&1 & echo started-{turn}")
    } else {
        format!("head -c 2097152 /dev/urandom > /app/data-{turn}.bin")
    }
}

const KILL_SANDBOXES: usize = 4;
const KILL_TURNS: u64 = 12;
/// crabd is killed once this many turns are recorded over all sandboxes.
const KILL_AT_RECORDS: usize = KILL_SANDBOXES * 5;
/// Grant-to-write slack in the rate bound: a commit writes after its grant.
const GRANT_TO_WRITE_S: f64 = 0.5;

/// Several sandboxes commit turns while crabd is SIGKILLed: the shims start
/// it again, every turn gets its record and a checkpoint, every chain
/// verifies, the new crabd grants the later commits, and until the kill the
/// shims' measured write rate stays within the bucket's rate and burst.
///
/// Kills the crabd of the crab config in `CRAB_CONFIG` (default /run/crab/crabd.sock):
/// give this containerd a config of its own on a shared host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crabd_killed_mid_run_loses_no_turn_and_publishes_nothing_half_written() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use crab_integration::sandbox::{Sandbox, TERMINAL_IMAGE};
    let mut sandboxes = Vec::new();
    for i in 0..KILL_SANDBOXES {
        sandboxes.push(Sandbox::start(&format!("node-kill-{i}"), TERMINAL_IMAGE, &[("io.crab.policy", "crab")], &[]).await.unwrap());
    }
    let ids: Vec<String> = sandboxes.iter().map(|s| s.id().to_string()).collect();
    let outcome = async {
        let before = node_status()?;
        let old_pid = before["pid"].as_u64().unwrap_or(0);
        let rate = before["bucket"]["rate_bytes_per_s"].as_f64().unwrap_or(0.0);
        let burst = before["bucket"]["burst_bytes"].as_f64().unwrap_or(0.0);
        ensure!(old_pid > 0 && rate > 0.0, "crabd status: {before}");

        // The baseline before any turn runs (a walk of a large store takes seconds).
        let started = std::time::Instant::now();
        let mut samples: Vec<(f64, u64)> = vec![(0.0, store_bytes(&state_dir()))];
        let runs = sandboxes.into_iter().map(|mut sandbox| {
            tokio::spawn(async move {
                for turn in 1..=KILL_TURNS {
                    let (output, n) = sandbox.exec(&turn_script(turn)).await?;
                    ensure_eq!(n, turn, "turn number of {}", sandbox.id());
                    ensure!(output.status.success(), "turn {turn} of {}: {output:?}", sandbox.id());
                    // The next turn starts once this one is recorded: each sandbox
                    // has at most one commit in flight, as with an agent.
                    sandbox.verdict(turn).await?;
                }
                Ok::<Sandbox, HarnessError>(sandbox)
            })
        });
        let runs: Vec<_> = runs.collect();

        // Sample the shims' writes until the kill, which comes as soon as
        // enough turns are recorded (checked before each sample).
        loop {
            let recorded: usize = ids.iter().map(|id| turn_records(id).len()).sum();
            if recorded >= KILL_AT_RECORDS {
                break;
            }
            ensure!(started.elapsed() < Duration::from_secs(300), "only {recorded} turns recorded after 300 s");
            samples.push((started.elapsed().as_secs_f64(), store_bytes(&state_dir())));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        samples.push((started.elapsed().as_secs_f64(), store_bytes(&state_dir())));
        // SAFETY: kill(2) of the node's crabd, which this test is about.
        ensure!(unsafe { libc::kill(old_pid as i32, libc::SIGKILL) } == 0, "SIGKILL crabd {old_pid}");
        eprintln!("SIGKILLed crabd {old_pid} after {:.1} s", started.elapsed().as_secs_f64());

        let mut finished = Vec::new();
        for run in runs {
            finished.push(run.await.map_err(|e| HarnessError::Expectation(format!("sandbox task: {e}")))??);
        }

        // Measured, not counted by crabd: bytes the store grew by in any window
        // between two samples before the kill (a commit writes after its grant).
        let mut worst = 0f64;
        for (i, (t0, b0)) in samples.iter().enumerate() {
            for (t1, b1) in &samples[i + 1..] {
                let allowed = rate * (t1 - t0 + GRANT_TO_WRITE_S) + burst;
                worst = worst.max(b1.saturating_sub(*b0) as f64 - allowed);
            }
        }
        let total = samples.last().map_or(0, |s| s.1) - samples[0].1;
        let span = samples.last().map_or(0.0, |s| s.0);
        eprintln!(
            "before the kill: {:.1} MiB in {span:.1} s ({:.2} MiB/s mean) against {:.1} MiB/s + {:.1} MiB burst; worst excess {:.2} MiB",
            total as f64 / 1048576.0,
            total as f64 / 1048576.0 / span.max(1e-9),
            rate / 1048576.0,
            burst / 1048576.0,
            worst / 1048576.0,
        );
        ensure!(worst <= 1048576.0, "measured writes exceeded the bucket by {:.2} MiB", worst / 1048576.0);

        // Every turn has exactly one record and its own checkpoint.
        for id in &ids {
            let records = turn_records(id);
            let turns: Vec<u64> = records.iter().map(|r| r.0).collect();
            ensure_eq!(turns, (1..=KILL_TURNS).collect::<Vec<_>>(), "turns recorded for {id}");
            for (turn, class, checkpoint, reasons) in &records {
                ensure!(!reasons.iter().any(|r| r.starts_with("checkpoint failed")), "{id} turn {turn}: {reasons:?}");
                ensure!(class != "clean", "{id} turn {turn} changed files but was recorded clean");
                ensure_eq!(*checkpoint, Some(*turn), "checkpoint of {id} turn {turn} ({class})");
            }
            let verify = std::process::Command::new(crabctl())
                .args(["verify", id.as_str(), "--state-dir"])
                .arg(state_dir())
                .output()
                .map_err(|e| HarnessError::io("running crabctl verify", e))?;
            ensure!(
                verify.status.success(),
                "crabctl verify {id}: {}{}",
                String::from_utf8_lossy(&verify.stdout),
                String::from_utf8_lossy(&verify.stderr)
            );
        }

        // A new crabd serves the socket, and the commits after the kill went through it.
        let after = node_status()?;
        let new_pid = after["pid"].as_u64().unwrap_or(0);
        ensure!(new_pid != 0 && new_pid != old_pid, "crabd after the kill: pid {new_pid} (was {old_pid})");
        ensure_eq!(comm(new_pid as u32), "crabd", "the process serving crabd's socket");
        let sandboxes_seen = after["bucket"]["sandboxes"].as_array().cloned().unwrap_or_default();
        for id in &ids {
            let granted = sandboxes_seen
                .iter()
                .find(|s| s["sandbox"] == id.as_str())
                .and_then(|s| s["granted_requests"].as_u64())
                .unwrap_or(0);
            ensure!(granted >= 1, "no commit of {id} went through the new crabd: {after}");
        }
        drop(finished);
        Ok::<(), HarnessError>(())
    }
    .await;
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

/// A crabd of the config's socket with a bucket of its own, started by a
/// test in place of the running one; stopped (SIGTERM) when dropped, after
/// which the shims start the configured one again on demand.
struct TinyCrabd {
    child: std::process::Child,
}

impl TinyCrabd {
    async fn replace_running(rate_kib: u64, burst_kib: u64) -> Outcome<TinyCrabd> {
        // No crabd may be running yet (none started since containerd came up).
        let old = node_status().ok().and_then(|s| s["pid"].as_u64()).unwrap_or(0) as i32;
        if old > 0 {
            // SAFETY: kill(2) of the node's crabd, which this test replaces.
            unsafe { libc::kill(old, libc::SIGTERM) };
            wait_until("the old crabd to exit", Duration::from_secs(10), || async {
                Ok((!Path::new(&format!("/proc/{old}")).exists()).then_some(()))
            })
            .await?;
        }
        let binary = crabctl().with_file_name("crabd");
        let log = std::fs::File::create(std::env::temp_dir().join("crab-tiny-crabd.log"))
            .map_err(|e| HarnessError::io("creating the tiny crabd's log", e))?;
        // crabd reads the socket from CRAB_CONFIG, which this process shares with containerd.
        let child = std::process::Command::new(&binary)
            .args(["--rate-kib-per-s", &rate_kib.to_string(), "--burst-kib", &burst_kib.to_string()])
            .stdout(log.try_clone().map_err(|e| HarnessError::io("log", e))?)
            .stderr(log)
            .spawn()
            .map_err(|e| HarnessError::io(format!("starting {}", binary.display()), e))?;
        let pid = u64::from(child.id());
        let tiny = TinyCrabd { child };
        wait_until("the tiny crabd to answer", Duration::from_secs(20), || async {
            Ok(node_status().ok().filter(|s| s["pid"].as_u64() == Some(pid)).map(drop))
        })
        .await?;
        Ok(tiny)
    }
}

impl Drop for TinyCrabd {
    fn drop(&mut self) {
        // SAFETY: kill(2) of the crabd this test started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Every turn record of a sandbox as JSON.
fn records(id: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(state_dir().join("turns").join(format!("{id}.jsonl"))).unwrap_or_default();
    let complete = text.rsplit_once('\n').map_or("", |(lines, _)| lines);
    complete.lines().filter_map(|line| serde_json::from_str(line).ok()).collect()
}

fn run_crabctl(args: &[&str]) -> Outcome<std::process::Output> {
    std::process::Command::new(crabctl())
        .args(args)
        .arg("--state-dir")
        .arg(state_dir())
        .output()
        .map_err(|e| HarnessError::io(format!("running crabctl {args:?}"), e))
}

/// What recovery must bring back: each turn's file and each turn's process.
const FINGERPRINT: &str = "cat /app/turn-*; ps -eo args | grep -c '^sleep 100[0-9]'";

const SUPERSEDE_TURNS: u64 = 5;

/// A bucket of a few dozen KiB/s makes each process checkpoint wait while
/// the next turn runs and dumps: waiting checkpoints are superseded, their
/// turns say by which turn (and refuse a rollback), and recover brings the
/// newest state back exactly: every turn's file, the superseded ones'
/// included, and every turn's process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_process_checkpoints_are_superseded_and_recover_restores_the_newest_state() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use crab_integration::sandbox::{Sandbox, TERMINAL_IMAGE};
    let outcome = async {
        let _tiny = TinyCrabd::replace_running(32, 64).await?;
        let mut sandbox = Sandbox::start("node-supersede", TERMINAL_IMAGE, &[("io.crab.policy", "crab")], &[]).await?;
        let id = sandbox.id().to_string();
        // Back to back, as an agent that does not think: each exec starts once
        // the previous turn is captured, while its write-out still waits.
        for turn in 1..=SUPERSEDE_TURNS {
            let script = format!("sleep 100{turn} >/dev/null 2>&1 & echo written-in-turn-{turn} > /app/turn-{turn}");
            let (output, n) = sandbox.exec(&script).await?;
            ensure!(output.status.success() && n == turn, "turn {turn} of {id}: {output:?}");
        }
        // Writing the last checkpoint at 32 KiB/s takes a while.
        wait_until("every turn's record", Duration::from_secs(240), || async {
            Ok((records(&id).len() as u64 >= SUPERSEDE_TURNS).then_some(()))
        })
        .await?;
        let records = records(&id);
        let mut superseded = Vec::new();
        for r in &records {
            let turn = r["turn"].as_u64().unwrap_or(0);
            ensure_eq!(r["class"].as_str(), Some("proc"), "class of turn {turn}: {r}");
            match r["superseded_by"].as_u64() {
                Some(by) => {
                    ensure!(by > turn && by <= SUPERSEDE_TURNS, "turn {turn} superseded by {by}");
                    ensure!(r["checkpoint_turn"].is_null(), "a superseded turn has no checkpoint: {r}");
                    superseded.push((turn, by));
                }
                None => ensure_eq!(r["checkpoint_turn"].as_u64(), Some(turn), "checkpoint of turn {turn}: {r}"),
            }
        }
        eprintln!("superseded (turn, by): {superseded:?}");
        ensure!(!superseded.is_empty(), "no checkpoint was superseded: {records:?}");
        let last = records.last().expect("records");
        ensure!(last["superseded_by"].is_null(), "the last turn is never superseded: {last}");

        // crabd counted them; `crabctl checkpoints` shows them pointing at the newer turn.
        let status = node_status()?;
        let counted = status["bucket"]["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["sandbox"] == id.as_str())
            .and_then(|s| s["superseded"].as_u64())
            .unwrap_or(0);
        ensure!(counted >= superseded.len() as u64, "crabd counted {counted} superseded commits of {id}: {status}");
        let listed = run_crabctl(&["checkpoints", &id, "--json"])?;
        let rows: serde_json::Value = serde_json::from_slice(&listed.stdout)
            .map_err(|e| HarnessError::Parse { what: "crabctl checkpoints --json".into(), detail: e.to_string() })?;
        for (turn, by) in &superseded {
            let row = rows.as_array().into_iter().flatten().find(|r| r["turn"].as_u64() == Some(*turn));
            ensure!(
                row.is_some_and(|r| r["superseded_by"].as_u64() == Some(*by) && r["class"] == "superseded"),
                "checkpoints row of turn {turn}: {rows}"
            );
        }
        let text = run_crabctl(&["checkpoints", &id])?;
        ensure!(String::from_utf8_lossy(&text.stdout).contains(&format!("-> turn {}", superseded[0].1)), "{text:?}");
        let (turn, by) = superseded[0];
        let refused = run_crabctl(&["rollback", &id, "--turn", &turn.to_string()])?;
        let message = String::from_utf8_lossy(&refused.stderr);
        ensure!(!refused.status.success() && message.contains(&format!("superseded by turn {by}")), "rollback to {turn}: {message}");

        // The newest state, recovered after the processes are killed.
        let (before, _) = sandbox.exec(FINGERPRINT).await?;
        let before = before.stdout;
        ensure!(before.contains(&format!("written-in-turn-{turn}")) && before.trim_end().ends_with(&SUPERSEDE_TURNS.to_string()), "{before}");
        let ctr = crab_integration::TestEnv::get().ctr();
        ctr.invoke(["tasks", "kill", "--all", "--signal", "SIGKILL", id.as_str()]).success().await?;
        wait_until("the killed sandbox to stop", Duration::from_secs(20), || async {
            let out = ctr.invoke(["tasks", "ls"]).output().await?.stdout;
            Ok(out.lines().any(|l| l.starts_with(&format!("{id} ")) && l.contains("STOPPED")).then_some(()))
        })
        .await?;
        let recovered = run_crabctl(&["recover", &id])?;
        ensure!(recovered.status.success(), "crabctl recover: {}", String::from_utf8_lossy(&recovered.stderr));
        let (after, _) = sandbox.exec(FINGERPRINT).await?;
        ensure_eq!(after.stdout, before, "the sandbox after recover");
        Ok::<(), HarnessError>(())
    }
    .await;
    if let Err(e) = outcome {
        panic!("{e}");
    }
}
