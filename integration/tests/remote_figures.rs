//! The registry tier's figures (issue 16), each printed as one line with its ratio against a
//! baseline measured in the same run. A measurement, not a check: `#[ignore]`d, so CI does not
//! run it; it asserts only what makes a figure meaningless when false (the memory came back,
//! every fork runs).
//!
//! ```sh
//! cargo test --release -p crab-integration --test remote_figures -- --ignored --nocapture
//! ```
//!
//! 1. Recover of a sandbox whose python3 process holds 64 MiB of written memory: on node B
//!    from the registry, against recover on node A from its own store.
//! 2. Fan-out: 16 forks of one turn on node B from the registry (the first pulls, the other
//!    15 at once find the chain in B's store), against one fork of that turn on node A from
//!    its store; and the bytes pulled against the bytes the turn's push sent (one copy).
//!    2b: the same with all 16 started at once, from a source B's store does not hold yet.
//! 3. Drain of 16 sandboxes on node A (`crabctl drain --deadline 90s`, a namespace of its
//!    own), against `crabctl migrate` of one such sandbox.
//!
//! The nodes and the registry are `crab_integration::remote`'s (as `tests/remote.rs`'s); the
//! sandboxes of figures 1 and 2 run `crab.local/terminal:latest` (python3), imported from the
//! image cache into both nodes by `scripts/build-images terminal`.

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use crab_integration::remote::{Node, NodeB, Registry, env_or, node_a, node_b, text, wait_for, write_config};

const TERMINAL: &str = "crab.local/terminal:latest";
const FORKS: usize = 16;
const DRAINED: usize = 16;

/// Starts a python3 process that holds 64 MiB of random bytes, writes their sha256 to
/// /data/sum (and again to /data/now on SIGUSR1), its pid to /data/pid; returns once the
/// memory is written, so the turn this exec ends captures it.
const HOLD_64_MIB: &str = r#"mkdir -p /data && python3 -c '
import hashlib, os, signal, time
b = bytearray(64 << 20)
b[:] = os.urandom(64 << 20)
def say(path):
    open(path + ".tmp", "w").write(hashlib.sha256(b).hexdigest())
    os.rename(path + ".tmp", path)
signal.signal(signal.SIGUSR1, lambda *_: say("/data/now"))
open("/data/pid", "w").write(str(os.getpid()))
say("/data/sum")
while True:
    time.sleep(3600)
' >/dev/null 2>&1 &
while [ ! -s /data/sum ]; do sleep 0.1; done"#;

/// The sha256 of the python process's 64 MiB now, and the one it wrote when it filled them.
fn memory_sums(node: &Node, id: &str) -> (String, String) {
    let out = node.exec(
        id,
        "rm -f /data/now; kill -USR1 $(cat /data/pid); i=0; while [ ! -s /data/now ] && [ $i -lt 100 ]; do \
         i=$((i+1)); sleep 0.1; done; cat /data/now; echo; cat /data/sum",
    );
    let mut lines = out.lines().map(str::trim).filter(|l| !l.is_empty());
    let now = lines.next().unwrap_or_default().to_owned();
    let then = lines.next().unwrap_or_default().to_owned();
    (now, then)
}

fn assert_memory_back(node: &Node, id: &str) {
    let (now, then) = memory_sums(node, id);
    assert!(
        now.len() == 64 && now == then,
        "node {}: {id}'s 64 MiB did not come back: now {now:?}, then {then:?}",
        node.name
    );
}

fn has_checkpoint(node: &Node, id: &str, turn: u64) -> bool {
    let out = node.crabctl(&["checkpoints", id, "--json"]);
    out.status.success()
        && serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .is_ok_and(|v| v.as_array().unwrap().iter().any(|c| c["turn"] == turn))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn json_of(child: Child, what: &str) -> Result<serde_json::Value, String> {
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        return Err(format!("{what}: {}", text(&out)));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("{what}: no JSON ({e}): {}", text(&out)))
}

/// What one fan-out on node B came to.
struct FanOut {
    /// Until every fork ran (or the last failed).
    took: Duration,
    /// The first fork, alone (staggered), else zero.
    first: Duration,
    running: usize,
    pulls: usize,
    pulled: u64,
    failed: Vec<String>,
}

impl FanOut {
    fn print(&self, figure: &str, how: &str, one_on_a: Duration, pushed: u64) {
        let n = self.running + self.failed.len();
        println!(
            "figure {figure}, fan-out ({how}): {n} forks of one turn (64 MiB python3) on B from the registry, {} \
             running in {:.0} ms{}, one fork on A from its store {:.0} ms: ratio {:.2} ({:.2} per fork); {} of {n} \
             forks pulled, {} bytes in all against {pushed} bytes pushed: ratio {:.3}",
            self.running,
            ms(self.took),
            if self.first.is_zero() {
                String::new()
            } else {
                format!(" (the first, which pulled, in {:.0} ms)", ms(self.first))
            },
            ms(one_on_a),
            self.took.as_secs_f64() / one_on_a.as_secs_f64(),
            self.took.as_secs_f64() / n as f64 / one_on_a.as_secs_f64(),
            self.pulls,
            self.pulled,
            self.pulled as f64 / pushed as f64,
        );
        for e in &self.failed {
            println!("  a fork failed: {}", e.trim());
        }
    }
}

/// Forks turn 1 of `source` (pushed as `reference`) on `b` as each of `forks`, all at once, or
/// (`staggered`) the first alone and then the others at once. Each names the image: a fork
/// that pulls nothing takes it from containerd's record of the source, which B does not have
/// (without --image those fail: "containerd does not know").
fn fan_out(b: &Node, source: &str, reference: &str, forks: &[String], staggered: bool) -> FanOut {
    let spawn = |new: &str| {
        b.crabctl_command(&[
            "fork", source, "--turn", "1", "--as", new, "--from", reference, "--image", TERMINAL, "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
    };
    let clock = Instant::now();
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    let mut rest = forks;
    let mut first = Duration::ZERO;
    if staggered {
        match json_of(spawn(&forks[0]), &forks[0]) {
            Ok(report) => reports.push(report),
            Err(e) => failed.push(e),
        }
        first = clock.elapsed();
        rest = &forks[1..];
    }
    let children: Vec<_> = rest.iter().map(|id| (id, spawn(id))).collect();
    for (id, child) in children {
        match json_of(child, id) {
            Ok(report) => reports.push(report),
            Err(e) => failed.push(e),
        }
    }
    let running = || {
        let tasks = b.ctr_ok(&["tasks", "ls"]);
        forks.iter().filter(|id| tasks.lines().any(|l| l.starts_with(id.as_str()) && l.contains("RUNNING"))).count()
    };
    if failed.is_empty() {
        wait_for("all forks running on B", Duration::from_secs(60), || running() == forks.len());
    }
    let took = clock.elapsed();
    let pulls: Vec<&serde_json::Value> = reports.iter().map(|r| &r["pull"]).filter(|p| !p.is_null()).collect();
    FanOut {
        took,
        first,
        running: running(),
        pulls: pulls.len(),
        pulled: pulls.iter().map(|p| p["bytes_pulled"].as_u64().unwrap()).sum(),
        failed,
    }
}

/// Runs `scripts/build-images IMAGE` with `env` added (a node, a namespace).
fn import(env: &[(String, String)], image: &str, into: &str) {
    let out = NodeB::script(env, &["scripts/build-images", image]);
    assert!(out.status.success(), "importing {image} into {into}: {}", text(&out));
}

#[test]
#[ignore = "a measurement (issue 16): run with --ignored --nocapture"]
fn registry_tier_figures() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let registry = Registry::start();
    let base = crab_config::Config::load(None).expect("the environment's crab config ($CRAB_CONFIG)");
    let ctrd_dir = env_or("CRAB_CTRD_DIR", "/run/crab-dev");
    let namespace = env_or("CRAB_NS", "crab");
    let scratch = PathBuf::from(format!("{}-remote-figures", base.checkpoint.state_dir.display()));
    let _ = std::fs::remove_dir_all(&scratch);
    let remote = crab_config::RemoteConfig { prefix: registry.prefix(), plain_http: true, ..Default::default() };

    // Node A: the environment's containerd, the sandboxes' store and kept images their own.
    let mut a_config = base.clone();
    a_config.checkpoint.state_dir = scratch.join("a-store");
    a_config.checkpoint.kept_images_dir = PathBuf::from(format!("{ctrd_dir}/remote-figures-a-kept"));
    let a_shim_config = scratch.join("a-shim.toml");
    write_config(&a_shim_config, &a_config);
    a_config.remote = remote;
    let a = node_a(&a_config, &namespace, &scratch);
    let (b, node_b) = node_b(&base, &ctrd_dir, "figures", &namespace, &scratch);
    import(&[("CRAB_NS".into(), namespace.clone())], "terminal", "node A");
    import(&node_b.env, "terminal", "node B");

    let pid = std::process::id();
    let (mem, fan, fan2) = (format!("fig-mem-{pid}"), format!("fig-fan-{pid}"), format!("fig-fan2-{pid}"));
    let forks: Vec<String> = (0..FORKS).map(|i| format!("fig-fork-{pid}-{i}")).collect();
    let base_fork = format!("fig-fork-{pid}-on-a");
    for id in [&mem, &fan, &fan2, &base_fork] {
        a.remove(id);
    }
    for id in [&mem, &fan, &fan2].into_iter().chain(&forks) {
        b.remove(id);
    }

    // Three sandboxes on A, each one turn: python3 holding 64 MiB. All pushed.
    let sources = [&mem, &fan, &fan2];
    for id in sources {
        a.run_sandbox_of(TERMINAL, id, &a_shim_config);
        a.exec(id, HOLD_64_MIB);
    }
    let mut pushed_bytes = Vec::new();
    for id in sources {
        wait_for("turn 1's checkpoint on A", Duration::from_secs(120), || has_checkpoint(&a, id, 1));
        let turns = a.crabctl_json(&["turns", id]);
        assert_eq!(turns[0]["class"], "proc", "{turns:#}");
        let pushed = a.crabctl_json(&["push", id]);
        assert_eq!(pushed["head_turn"], 1, "{pushed:#}");
        pushed_bytes.push(pushed["bytes_uploaded"].as_u64().unwrap());
    }
    let reference = |id: &str| format!("{}/{namespace}/{id}:turn-1", registry.prefix());

    // 1. Recover on A from its store (the baseline), then on B from the registry.
    a.ctr_ok(&["tasks", "kill", "--all", "--signal", "SIGKILL", &mem]);
    let clock = Instant::now();
    let on_a_report = a.crabctl_json(&["recover", &mem]);
    let on_a = clock.elapsed();
    assert_memory_back(&a, &mem);
    a.remove(&mem);
    let clock = Instant::now();
    let on_b_report = b.crabctl_json(&["recover", &mem, "--from", &reference(&mem)]);
    let on_b = clock.elapsed();
    assert_memory_back(&b, &mem);
    let pull = &on_b_report["pull"];
    println!(
        "figure 1, recover of a sandbox holding 64 MiB (python3): on B from the registry {:.0} ms, on A from its \
         store {:.0} ms: ratio {:.2}; B pulled {} bytes in {} blobs (the push sent {}); B's time: pull {:.0} ms, \
         restore {:.0} ms (A's restore {:.0} ms), crabctl total {:.0} ms",
        ms(on_b),
        ms(on_a),
        on_b.as_secs_f64() / on_a.as_secs_f64(),
        pull["bytes_pulled"],
        pull["blobs_pulled"],
        pushed_bytes[0],
        pull["elapsed_ms"].as_f64().unwrap_or(f64::NAN),
        on_b_report["elapsed_ms"].as_f64().unwrap_or(f64::NAN),
        on_a_report["elapsed_ms"].as_f64().unwrap_or(f64::NAN),
        on_b_report["total_ms"].as_f64().unwrap_or(f64::NAN),
    );
    let phases = &pull["breakdown"];
    println!(
        "figure 1, B's pull: fetch {:.0} ms, store writes {:.0} ms, store flush \
         {:.0} ms, other {:.0} ms; {} blobs, {} bytes fetched, {} objects ({} bytes) written",
        phases["fetch_ms"].as_f64().unwrap_or(f64::NAN),
        phases["store_write_ms"].as_f64().unwrap_or(f64::NAN),
        phases["store_flush_ms"].as_f64().unwrap_or(f64::NAN),
        phases["other_ms"].as_f64().unwrap_or(f64::NAN),
        phases["blobs"],
        phases["bytes_fetched"],
        phases["objects_written"],
        phases["object_bytes_written"],
    );
    a.remove(&mem);
    b.remove(&mem);

    // 2. Fan-out. Baseline: one fork of the turn on A from its store.
    let clock = Instant::now();
    a.crabctl_json(&["fork", &fan, "--turn", "1", "--as", &base_fork]);
    let one_on_a = clock.elapsed();
    assert_memory_back(&a, &base_fork);
    a.remove(&base_fork);
    a.remove(&fan);
    a.remove(&fan2);
    // On B: the first fork pulls; the other 15 start at once and find the chain in B's store.
    let staggered = fan_out(&b, &fan, &reference(&fan), &forks, true);
    staggered.print("2", "the first pulled, then 15 at once", one_on_a, pushed_bytes[1]);
    assert!(staggered.failed.is_empty(), "{} of {FORKS} forks failed", staggered.failed.len());
    assert_memory_back(&b, &forks[FORKS - 1]);
    for id in &forks {
        b.remove(id);
    }
    // The same with all 16 started at once, from a source B's store does not hold yet.
    let at_once = fan_out(&b, &fan2, &reference(&fan2), &forks, false);
    at_once.print("2b", "all 16 at once", one_on_a, pushed_bytes[2]);
    for id in &forks {
        b.remove(id);
    }

    // 3. Drain of 16 sandboxes on A, in a namespace of their own (the drain sees only them).
    // Each holds two turns (a 1 MiB file, then a looping shell) when the drain starts.
    // Baseline: `crabctl migrate` of one such sandbox, in another namespace.
    let drain_ns = format!("{namespace}-figures-drain");
    let one_ns = format!("{namespace}-figures-one");
    let in_ns = |ns: &str| Node { namespace: ns.to_owned(), ..a.clone() };
    let (drain_a, one_a) = (in_ns(&drain_ns), in_ns(&one_ns));
    for node in [&drain_a, &one_a] {
        import(&[("CRAB_NS".into(), node.namespace.clone())], "busybox", &format!("node A's {}", node.namespace));
        // The namespace is this test's: what an earlier run left there goes.
        for id in node.ctr_ok(&["containers", "ls", "-q"]).lines().filter(|l| !l.trim().is_empty()) {
            node.remove(id.trim());
        }
    }
    let drained: Vec<String> = (0..DRAINED).map(|i| format!("fig-drain-{pid}-{i}")).collect();
    let single = format!("fig-migrate-{pid}");
    let work = |node: &Node, id: &str| {
        node.run_sandbox(id, &a.config);
        node.exec(id, "mkdir -p /data && head -c 1048576 /dev/urandom > /data/r");
        node.exec(id, "(i=0; while :; do i=$((i+1)); sleep 0.2; done) >/dev/null 2>&1 &");
    };
    work(&one_a, &single);
    for id in &drained {
        work(&drain_a, id);
    }
    for (node, id) in std::iter::once((&one_a, &single)).chain(drained.iter().map(|id| (&drain_a, id))) {
        wait_for("turn 2's checkpoint on A", Duration::from_secs(120), || has_checkpoint(node, id, 2));
    }
    let clock = Instant::now();
    let migrated = one_a.crabctl_json(&["migrate", &single]);
    let one_migrate = clock.elapsed();
    assert!(migrated["error"].is_null(), "{migrated:#}");
    let clock = Instant::now();
    let out = drain_a.crabctl(&["drain", "--deadline", "90s", "--json"]);
    let took = clock.elapsed();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("crabctl drain printed no JSON ({e}): {}", text(&out)));
    let rows = report["sandboxes"].as_array().unwrap();
    let off: Vec<&serde_json::Value> =
        rows.iter().filter(|r| r["error"].is_null() && r["safe_turn"] == r["newest_turn"]).collect();
    println!(
        "figure 3, drain: {} of {} sandboxes' last captured turn off node A in {:.0} ms (deadline 90000 ms: {:.2} of \
         it), {} bytes pushed; one sandbox's migrate {:.0} ms: ratio {:.2} ({:.2} per sandbox)",
        off.len(),
        rows.len(),
        ms(took),
        took.as_secs_f64() / 90.0,
        report["bytes_uploaded"],
        ms(one_migrate),
        took.as_secs_f64() / one_migrate.as_secs_f64(),
        took.as_secs_f64() / rows.len().max(1) as f64 / one_migrate.as_secs_f64(),
    );
    for row in rows.iter().filter(|r| !(r["error"].is_null() && r["safe_turn"] == r["newest_turn"])) {
        println!(
            "  not off the node: {}: newest turn {}, safe turn {}, error {}, notes {}",
            row["container"], row["newest_turn"], row["safe_turn"], row["error"], row["notes"]
        );
    }
    assert_eq!(rows.len(), DRAINED, "{report:#}");

    for id in &drained {
        drain_a.remove(id);
    }
    one_a.remove(&single);
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_dir_all(&a_config.checkpoint.kept_images_dir);
}
