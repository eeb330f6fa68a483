//! Checkpoints leave the node: a sandbox on node A is pushed to a real registry (Debian's
//! docker-registry, `scripts/registry`), node A's store and kept images are deleted, and node
//! B, a second containerd with its own crab configuration, store, runc root and kept images,
//! recovers it from the registry: its files and a process's memory come back. Also what must
//! fail clearly at this layer (a sandbox the registry does not hold, the registry down) and
//! what must then still be there.
//!
//! The nodes and the registry are `crab_integration::remote`'s: node A the environment's
//! containerd, node B a second one started here (per test) and stopped at the end when this
//! test started it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crab_integration::env::crab_binary;
use crab_integration::remote::{
    IMAGE, Node, NodeB, Registry, env_or, node_a, node_b, repo_root, text, wait_for, write_config,
};

/// The counter's secret (only in the shell's memory) and its count, from `/data/counter`.
fn counter(out: &str) -> (String, u64) {
    let (secret, count) = out.trim().split_once(' ').unwrap_or_else(|| panic!("no counter in {out:?}"));
    (secret.to_owned(), count.parse().unwrap())
}

#[test]
fn a_sandbox_pushed_from_node_a_recovers_on_node_b_after_node_a_is_gone() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let registry = Registry::start();
    let base = crab_config::Config::load(None).expect("the environment's crab config ($CRAB_CONFIG)");
    let ctrd_dir = env_or("CRAB_CTRD_DIR", "/run/crab-dev");
    let namespace = env_or("CRAB_NS", "crab");
    let scratch = PathBuf::from(format!("{}-remote-test", base.checkpoint.state_dir.display()));
    let _ = std::fs::remove_dir_all(&scratch);
    let remote = crab_config::RemoteConfig { prefix: registry.prefix(), plain_http: true, ..Default::default() };

    // Node A: the environment's containerd, this sandbox's store and kept images its own. Its
    // shim pushes nothing by itself (no [remote] in the config it reads): `crabctl push`,
    // with the registry in its own config, does.
    let mut a_config = base.clone();
    a_config.checkpoint.state_dir = scratch.join("a-store");
    a_config.checkpoint.kept_images_dir = PathBuf::from(format!("{ctrd_dir}/remote-test-a-kept"));
    let a_shim_config = scratch.join("a-shim.toml");
    write_config(&a_shim_config, &a_config);
    a_config.remote = remote;
    let a = node_a(&a_config, &namespace, &scratch);

    // Node B: a second containerd, runc root, store, kept images and crabd socket. The
    // registry is named by the reference B recovers from; B's shims push nothing.
    let (b, _node_b) = node_b(&base, &ctrd_dir, "recover", &namespace, &scratch);

    // A sandbox on A: an fs turn, then a proc turn whose process keeps a secret in memory.
    let id = format!("remote-{}", std::process::id());
    a.remove(&id);
    b.remove(&id);
    a.run_sandbox(&id, &a_shim_config);
    a.exec(&id, "mkdir -p /data && echo one > /data/a");
    a.exec(&id, "(s=secret-$$; i=0; while :; do i=$((i+1)); echo \"$s $i\" > /data/c.tmp && mv /data/c.tmp /data/counter; sleep 0.1; done) >/dev/null 2>&1 &");
    wait_for("turn 2's checkpoint on A", Duration::from_secs(60), || {
        a.crabctl_json(&["checkpoints", &id]).as_array().unwrap().iter().any(|c| c["turn"] == 2)
    });
    let turns = a.crabctl_json(&["turns", &id]);
    let classes: Vec<_> = turns.as_array().unwrap().iter().map(|t| t["class"].as_str().unwrap().to_owned()).collect();
    assert_eq!(classes, ["fs", "proc"], "{turns:#}");
    assert!(turns.as_array().unwrap().iter().all(|t| t.get("off_node").is_none()), "never pushed: no lag column");

    // The registry is down: the push fails naming the reference, nothing is recorded as off
    // the node, and it goes through once the registry is back.
    registry.run("stop");
    let down = a.crabctl(&["push", &id]);
    let reference = format!("{}/{namespace}/{id}", registry.prefix());
    assert!(
        !down.status.success() && text(&down).contains(&reference) && text(&down).contains("cannot be reached"),
        "{}",
        text(&down)
    );
    let turns = a.crabctl_json(&["turns", &id]);
    assert!(turns.as_array().unwrap().iter().all(|t| t.get("off_node").is_none()), "{turns:#}");
    registry.run("start");
    let pushed = a.crabctl_json(&["push", &id]);
    assert_eq!(pushed["pushed"].as_array().unwrap().len(), 2, "{pushed:#}");
    assert_eq!(pushed["head_turn"], 2);
    let turns = a.crabctl_json(&["turns", &id]);
    assert!(
        turns.as_array().unwrap().iter().all(|t| t["off_node"] == true),
        "every checkpointed turn is off the node: {turns:#}"
    );
    let again = a.crabctl_json(&["push", &id]);
    assert_eq!(
        (again["pushed"].as_array().unwrap().len(), again["bytes_uploaded"].as_u64()),
        (0, Some(0)),
        "{again:#}"
    );
    println!(
        "push: {} bytes sent for {} bytes the turns wrote to the local store (ratio {:.3})",
        pushed["bytes_uploaded"],
        pushed["local_bytes_written"],
        pushed["bytes_uploaded"].as_f64().unwrap() / pushed["local_bytes_written"].as_f64().unwrap().max(1.0)
    );

    // Recover on A from its own store, as the baseline of recover on B.
    let before_a = counter(&a.exec(&id, "cat /data/counter")).0;
    a.ctr_ok(&["tasks", "kill", "--all", "--signal", "SIGKILL", &id]);
    let clock = Instant::now();
    let local = a.crabctl(&["recover", &id]);
    let on_a = clock.elapsed();
    assert!(local.status.success(), "{}", text(&local));
    let (secret_a, _) = counter(&a.exec(&id, "sleep 0.3; cat /data/counter"));
    assert_eq!(secret_a, before_a, "recover on A brings the shell's memory back");

    // Node A is gone: its sandbox, store and kept images.
    a.remove(&id);
    std::fs::remove_dir_all(&a.state).unwrap();
    let _ = std::fs::remove_dir_all(&a_config.checkpoint.kept_images_dir);

    // A sandbox the registry does not hold: a clear error naming the reference, nothing made.
    let missing = format!("{}/{namespace}/no-such-{id}:turn-1", registry.prefix());
    let out = b.crabctl(&["recover", &format!("no-such-{id}"), "--from", &missing]);
    assert!(
        !out.status.success() && text(&out).contains(&missing) && text(&out).contains("not in the registry"),
        "{}",
        text(&out)
    );
    // The registry down on B: the error names the reference; B's store holds no chain for it.
    registry.run("stop");
    let out = b.crabctl(&["recover", &id, "--from", &reference]);
    assert!(
        !out.status.success() && text(&out).contains(&reference) && text(&out).contains("cannot be reached"),
        "{}",
        text(&out)
    );
    let heads = scratch.join("b-store/containers").join(&namespace).join(&id).join("HEAD");
    assert!(!heads.exists(), "a failed pull leaves no head");
    registry.run("start");

    // Recover on B from the registry: the files and the process's memory come back.
    let clock = Instant::now();
    let recovered = b.crabctl_json(&["recover", &id, "--from", &reference]);
    let on_b = clock.elapsed();
    assert_eq!(recovered["checkpoint_turn"], 2, "{recovered:#}");
    assert!(recovered["pull"]["bytes_pulled"].as_u64().unwrap() > 0, "{recovered:#}");
    assert_eq!(b.exec(&id, "cat /data/a").trim(), "one");
    let (secret_b, count_b) = counter(&b.exec(&id, "sleep 0.5; cat /data/counter"));
    assert_eq!(secret_b, before_a, "the shell's memory came back on B");
    assert!(count_b > 1, "the counter runs on B");
    println!(
        "recover on B from the registry {:.0} ms ({} bytes pulled), on A from its store {:.0} ms: ratio {:.2}",
        on_b.as_secs_f64() * 1e3,
        recovered["pull"]["bytes_pulled"],
        on_a.as_secs_f64() * 1e3,
        on_b.as_secs_f64() / on_a.as_secs_f64()
    );

    // A second recover --from refuses to pull over the chain B now holds; the sandbox runs on.
    let out = b.crabctl(&["recover", &id, "--from", &reference]);
    assert!(!out.status.success() && text(&out).contains("already has a chain"), "{}", text(&out));
    // A fork of turn 1 on B: the store holds that turn, nothing is pulled.
    let fork = format!("{id}-fork");
    b.remove(&fork);
    let forked = b.crabctl_json(&["fork", &id, "--turn", "1", "--as", &fork, "--from", &reference]);
    assert!(forked["pull"].is_null(), "{forked:#}");
    assert_eq!(b.exec(&fork, "cat /data/a; ls /data").trim(), "one\na");
    assert_eq!(counter(&b.exec(&id, "cat /data/counter")).0, before_a, "the recovered sandbox runs on");

    b.remove(&fork);
    b.remove(&id);
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The push log's record of a sandbox: the turns the registry holds and the bytes each sent.
fn pushed_turns(state: &Path, namespace: &str, id: &str) -> Vec<(u64, u64)> {
    let path = state.join("remote/pushed").join(namespace).join(format!("{id}.json"));
    let Ok(bytes) = std::fs::read(&path) else { return Vec::new() };
    let log: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    log["turns"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(turn, t)| (turn.parse().unwrap(), t["bytes_uploaded"].as_u64().unwrap()))
        .collect()
}

/// With `[remote]` in the shim's config, each checkpointed turn leaves the node by itself,
/// through the persistent queue, with no `crabctl push`: `crabctl turns` shows the lag going
/// to zero. With the registry down the turns stay queued (and the sandbox's turns go on); once
/// it is back they are pushed. A second sandbox doing the same work sends a fraction of the
/// first's bytes (the packs its files share are mounted from the first's repository).
#[test]
fn checkpointed_turns_leave_the_node_by_themselves_and_resume_when_the_registry_returns() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let registry = Registry::start();
    let base = crab_config::Config::load(None).expect("the environment's crab config ($CRAB_CONFIG)");
    let ctrd_dir = env_or("CRAB_CTRD_DIR", "/run/crab-dev");
    let namespace = env_or("CRAB_NS", "crab");
    let scratch = PathBuf::from(format!("{}-remote-auto-test", base.checkpoint.state_dir.display()));
    let _ = std::fs::remove_dir_all(&scratch);
    let mut config = base.clone();
    config.checkpoint.state_dir = scratch.join("store");
    config.checkpoint.kept_images_dir = PathBuf::from(format!("{ctrd_dir}/remote-auto-test-kept"));
    config.remote = crab_config::RemoteConfig {
        prefix: registry.prefix(),
        plain_http: true,
        auto_push: true,
        ..Default::default()
    };
    let a = node_a(&config, &namespace, &scratch);
    let off_node = |id: &str| -> Vec<Option<bool>> {
        a.crabctl_json(&["turns", id])
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.get("off_node").and_then(|v| v.as_bool()))
            .collect()
    };

    // The same work in two sandboxes: a 2 MB file (the same bytes) and a process.
    const WORK: [&str; 2] = [
        "mkdir -p /data && yes crab-remote-tier | head -c 2000000 > /data/big",
        "(i=0; while :; do i=$((i+1)); sleep 0.2; done) >/dev/null 2>&1 &",
    ];
    let start_with_work = |id: &str| {
        a.run_sandbox(id, &a.config);
        for script in WORK {
            a.exec(id, script);
        }
    };
    let first = format!("remote-auto-{}", std::process::id());
    let second = format!("{first}-2");
    for id in [&first, &second] {
        a.remove(id);
    }
    start_with_work(&first);
    wait_for("both turns of the first sandbox in the registry", Duration::from_secs(60), || {
        off_node(&first) == [Some(true), Some(true)]
    });
    let queue = scratch.join("store/remote/queue");
    wait_for("the queue emptied", Duration::from_secs(10), || {
        std::fs::read_dir(&queue)
            .unwrap()
            .filter_map(|e| e.ok())
            .all(|e| e.path().extension().is_none_or(|x| x != "json"))
    });

    // The registry goes down: the next turn is checkpointed as ever, and waits in the queue.
    registry.run("stop");
    a.exec(&first, "echo three > /data/three");
    wait_for("turn 3 checkpointed", Duration::from_secs(60), || {
        off_node(&first).len() == 3 && off_node(&first)[2].is_some()
    });
    assert_eq!(off_node(&first), [Some(true), Some(true), Some(false)], "turn 3 is on this node only");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(off_node(&first)[2], Some(false), "not pushed while the registry is down");
    let queued: Vec<_> = std::fs::read_dir(&queue).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
    assert!(queued.iter().any(|n| n.to_string_lossy().ends_with(&format!("{:020}.json", 3))), "{queued:?}");
    registry.run("start");
    wait_for("turn 3 pushed once the registry is back", Duration::from_secs(60), || off_node(&first)[2] == Some(true));

    // A second sandbox doing the same work.
    start_with_work(&second);
    wait_for("both turns of the second sandbox in the registry", Duration::from_secs(60), || {
        off_node(&second) == [Some(true), Some(true)]
    });
    let bytes = |id: &str| -> u64 {
        pushed_turns(&a.state, &namespace, id).iter().filter(|(t, _)| *t <= 2).map(|(_, b)| b).sum()
    };
    let (one, two) = (bytes(&first), bytes(&second));
    println!(
        "push: the second identical sandbox sent {two} bytes for turns 1-2, the first {one}: ratio {:.3}",
        two as f64 / one as f64
    );
    assert!(two * 4 < one, "the second sandbox's shared file is not sent again: {two} vs {one}");

    for id in [&first, &second] {
        a.remove(id);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_dir_all(&config.checkpoint.kept_images_dir);
}

/// Spot drain: three sandboxes on node A (in a namespace of their own, so the drain sees only
/// them), `crabctl drain` pushes each one's turns, most outstanding first, and prints per
/// sandbox the turn off the node and the command that restores it; node A is then gone and
/// node B restores one of them with that command: its files and a process's memory. Before
/// that, what must fail clearly: an unknown sandbox, the registry down, a deadline that
/// leaves no time; each leaves the local chains as they were.
#[test]
fn a_drained_node_s_sandboxes_recover_on_node_b_with_the_printed_command() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let registry = Registry::start();
    let base = crab_config::Config::load(None).expect("the environment's crab config ($CRAB_CONFIG)");
    let ctrd_dir = env_or("CRAB_CTRD_DIR", "/run/crab-dev");
    let namespace = format!("{}-drain", env_or("CRAB_NS", "crab"));
    let scratch = PathBuf::from(format!("{}-remote-drain-test", base.checkpoint.state_dir.display()));
    let _ = std::fs::remove_dir_all(&scratch);
    let mut a_config = base.clone();
    a_config.checkpoint.state_dir = scratch.join("a-store");
    a_config.checkpoint.kept_images_dir = PathBuf::from(format!("{ctrd_dir}/remote-drain-test-a-kept"));
    a_config.remote = crab_config::RemoteConfig { prefix: registry.prefix(), plain_http: true, ..Default::default() };
    let a = node_a(&a_config, &namespace, &scratch);
    let (b, node_b) = node_b(&base, &ctrd_dir, "drain", &namespace, &scratch);
    // The namespace's image on A (node B imported it when it started).
    let out = NodeB::script(&[("CRAB_NS".into(), namespace.clone())], &["scripts/build-images", "busybox"]);
    assert!(out.status.success(), "importing busybox into node A's namespace {namespace}: {}", text(&out));

    // The namespace is this test's: what an earlier run left there goes.
    for node in [&a, &b] {
        for id in node.ctr_ok(&["containers", "ls", "-q"]).lines().filter(|l| !l.trim().is_empty()) {
            node.remove(id.trim());
        }
    }
    let pid = std::process::id();
    let (two, one, proc_) = (format!("drain-two-{pid}"), format!("drain-one-{pid}"), format!("drain-proc-{pid}"));
    for id in [&two, &one, &proc_] {
        a.remove(id);
        b.remove(id);
        a.run_sandbox(id, &a.config);
    }
    a.exec(&two, "mkdir -p /data && echo one > /data/a");
    a.exec(&two, "echo two > /data/b");
    a.exec(&one, "mkdir -p /data && echo only > /data/a");
    a.exec(&proc_, "mkdir -p /data && (s=secret-$$; i=0; while :; do i=$((i+1)); echo \"$s $i\" > /data/c.tmp && mv /data/c.tmp /data/counter; sleep 0.1; done) >/dev/null 2>&1 &");
    for (id, turns) in [(&two, 2), (&one, 1), (&proc_, 1)] {
        wait_for("the sandboxes' checkpoints on A", Duration::from_secs(60), || {
            let out = a.crabctl(&["checkpoints", id, "--json"]);
            out.status.success()
                && serde_json::from_slice::<serde_json::Value>(&out.stdout)
                    .is_ok_and(|v| v.as_array().unwrap().iter().any(|c| c["turn"] == turns))
        });
    }
    let chains_before: Vec<_> = [&two, &one, &proc_].iter().map(|id| a.crabctl_json(&["checkpoints", id])).collect();

    // An unknown sandbox: named in the error.
    let out = a.crabctl(&["migrate", &format!("no-such-{pid}")]);
    assert!(!out.status.success() && text(&out).contains(&format!("no sandbox \"no-such-{pid}\"")), "{}", text(&out));
    // The registry down: every sandbox's row says why, naming its reference; nothing is off
    // the node, nothing local is lost.
    registry.run("stop");
    let out = a.crabctl(&["drain", "--deadline", "60s"]);
    assert!(!out.status.success(), "{}", text(&out));
    for id in [&two, &one, &proc_] {
        let reference = format!("{}/{namespace}/{id}", registry.prefix());
        assert!(text(&out).contains(&format!("{id}: NOT off the node")), "{}", text(&out));
        assert!(text(&out).contains(&reference) && text(&out).contains("cannot be reached"), "{}", text(&out));
    }
    // A deadline that leaves no time: said per sandbox.
    registry.run("start");
    let out = a.crabctl(&["drain", "--deadline", "1ms"]);
    assert!(!out.status.success() && text(&out).contains("the deadline passed"), "{}", text(&out));
    let chains_after: Vec<_> = [&two, &one, &proc_].iter().map(|id| a.crabctl_json(&["checkpoints", id])).collect();
    assert_eq!(chains_before, chains_after, "the failed drains changed no local chain");

    // The drain: most outstanding turns first, each sandbox's newest turn off the node.
    let clock = Instant::now();
    let drained = a.crabctl_json(&["drain", "--deadline", "90s"]);
    let took = clock.elapsed();
    let rows = drained["sandboxes"].as_array().unwrap();
    let order: Vec<&str> = rows.iter().map(|r| r["container"].as_str().unwrap()).collect();
    assert_eq!(order.len(), 3, "{drained:#}");
    assert_eq!(order[0], two, "the sandbox with two turns outstanding goes first: {drained:#}");
    for row in rows {
        assert!(row["error"].is_null(), "{drained:#}");
        assert_eq!(row["safe_turn"], row["newest_turn"], "{drained:#}");
    }
    println!("drain: 3 sandboxes in {:.0} ms, {} bytes pushed", took.as_secs_f64() * 1e3, drained["bytes_uploaded"]);
    // Migrating one again pushes nothing new and prints the same restore line.
    let again = a.crabctl_json(&["migrate", &proc_]);
    assert_eq!((again["turns_pushed"].as_array().unwrap().len(), again["bytes_uploaded"].as_u64()), (0, Some(0)));
    let row = rows.iter().find(|r| r["container"] == proc_.as_str()).unwrap();
    assert_eq!(again["restore_command"], row["restore_command"]);

    // Node A is gone; B restores the process sandbox with the printed command.
    let before = counter(&a.exec(&proc_, "cat /data/counter")).0;
    for id in [&two, &one, &proc_] {
        a.remove(id);
    }
    std::fs::remove_dir_all(&a.state).unwrap();
    let _ = std::fs::remove_dir_all(&a_config.checkpoint.kept_images_dir);
    let command: Vec<String> = row["restore_command"].as_str().unwrap().split_whitespace().map(str::to_owned).collect();
    assert_eq!(command[..2], ["crabctl".to_owned(), "recover".to_owned()], "{command:?}");
    let args: Vec<&str> = command[1..].iter().map(String::as_str).collect();
    let out = b.crabctl(&args);
    assert!(out.status.success(), "{}", text(&out));
    let (secret, count) = counter(&b.exec(&proc_, "sleep 0.5; cat /data/counter"));
    assert_eq!(secret, before, "the shell's memory came back on B");
    assert!(count > 1, "the counter runs on B");

    // Node B shuts down in turn: crab-drain.service's ExecStop, run as systemd would (the node's
    // crab config and containerd's socket in the environment, no namespace, no deadline), takes
    // the crab sandboxes of every namespace off the node within the configured deadline, and
    // leaves a runc container alone.
    let other_ns = format!("{namespace}-other");
    let other = Node { namespace: other_ns.clone(), ..b.clone() };
    let mut env = node_b.env.clone();
    env.retain(|(k, _)| k != "CRAB_NS" && k != "CONTAINERD_NAMESPACE");
    env.push(("CRAB_NS".into(), other_ns.clone()));
    let out = NodeB::script(&env, &["scripts/build-images", "busybox"]);
    assert!(out.status.success(), "importing busybox into node B's namespace {other_ns}: {}", text(&out));
    // The namespace is this test's: what an earlier run left there goes.
    for id in other.ctr_ok(&["containers", "ls", "-q"]).lines().filter(|l| !l.trim().is_empty()) {
        other.remove(id.trim());
    }
    let (sandbox, plain) = (format!("drain-other-{pid}"), format!("drain-runc-{pid}"));
    other.run_sandbox(&sandbox, &b.config);
    other.ctr_ok(&["run", "-d", "--runtime", "io.containerd.runc.v2", IMAGE, &plain, "sleep", "3600"]);
    other.exec(&sandbox, "mkdir -p /data && echo other > /data/a");
    wait_for("the other namespace's checkpoint on B", Duration::from_secs(60), || {
        let out = other.crabctl(&["checkpoints", &sandbox, "--json"]);
        out.status.success()
            && serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .is_ok_and(|v| v.as_array().unwrap().iter().any(|c| c["turn"] == 1))
    });
    let mut b_config = crab_config::Config::load(Some(&b.config)).expect("node B's config");
    b_config.remote.prefix = format!("{}-b", registry.prefix());
    b_config.remote.drain_deadline_ms = 75_000;
    write_config(&b.config, &b_config);
    let unit = std::fs::read_to_string(repo_root().join("shim-config/crab-drain.service")).unwrap();
    let exec_stop = unit.lines().find_map(|l| l.strip_prefix("ExecStop=")).expect("the unit's ExecStop");
    let argv: Vec<&str> = exec_stop.split_whitespace().collect();
    assert_eq!(argv[0], "/usr/local/bin/crabctl", "{exec_stop}");
    let out = Command::new(crab_binary("crabctl"))
        .args(&argv[1..])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CRAB_CONFIG", &b.config)
        .env("CONTAINERD_ADDRESS", &b.socket)
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{exec_stop}: {said}");
    for (ns, id) in [(&namespace, &proc_), (&other_ns, &sandbox)] {
        assert!(said.contains(&format!("{ns}/{id}: turn ")) && said.contains("is off the node"), "{said}");
        assert!(
            said.contains(&format!(
                "crabctl recover {id} --namespace {ns} --from {}-b/{ns}/{id}:turn-",
                registry.prefix()
            )),
            "{said}"
        );
    }
    assert!(!said.contains(&plain), "a runc container is no crab sandbox: {said}");
    assert!(said.contains("drained 2 sandboxes of namespaces") && said.contains("(deadline 75000 ms)"), "{said}");

    other.remove(&sandbox);
    other.remove(&plain);
    b.remove(&proc_);
    let _ = std::fs::remove_dir_all(&scratch);
}

/// Node A with a sandbox whose turns 1 (`/data/a`) and 2 (`/data/b`) are pushed, node B (its
/// own, `tag`) that knows nothing of it: the sandbox's id, reference (no turn) and the nodes.
struct Pushed {
    id: String,
    reference: String,
    a: Node,
    b: Node,
    _node_b: NodeB,
    _registry: Registry,
    scratch: PathBuf,
}

impl Drop for Pushed {
    fn drop(&mut self) {
        self.a.remove(&self.id);
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

/// True once `node`'s store holds a checkpoint of `id`'s turn `turn` (none yet: false).
fn has_checkpoint(node: &Node, id: &str, turn: u64) -> bool {
    let out = node.crabctl(&["checkpoints", id, "--json"]);
    out.status.success()
        && serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .is_ok_and(|v| v.as_array().is_some_and(|a| a.iter().any(|c| c["turn"] == turn)))
}

fn pushed_two_turns(tag: &str) -> Pushed {
    let registry = Registry::start();
    let base = crab_config::Config::load(None).expect("the environment's crab config ($CRAB_CONFIG)");
    let ctrd_dir = env_or("CRAB_CTRD_DIR", "/run/crab-dev");
    let namespace = env_or("CRAB_NS", "crab");
    let scratch = PathBuf::from(format!("{}-remote-{tag}", base.checkpoint.state_dir.display()));
    let _ = std::fs::remove_dir_all(&scratch);
    let mut a_config = base.clone();
    a_config.checkpoint.state_dir = scratch.join("a-store");
    a_config.checkpoint.kept_images_dir = PathBuf::from(format!("{ctrd_dir}/remote-{tag}-a-kept"));
    let a_shim_config = scratch.join("a-shim.toml");
    write_config(&a_shim_config, &a_config);
    a_config.remote = crab_config::RemoteConfig { prefix: registry.prefix(), plain_http: true, ..Default::default() };
    let a = node_a(&a_config, &namespace, &scratch);
    let (b, node_b) = node_b(&base, &ctrd_dir, tag, &namespace, &scratch);
    let id = format!("{tag}-{}", std::process::id());
    a.remove(&id);
    a.run_sandbox(&id, &a_shim_config);
    a.exec(&id, "mkdir -p /data && echo one > /data/a");
    a.exec(&id, "echo two > /data/b");
    wait_for("turn 2's checkpoint on A", Duration::from_secs(60), || has_checkpoint(&a, &id, 2));
    let pushed = a.crabctl_json(&["push", &id]);
    assert_eq!(pushed["head_turn"], 2, "{pushed:#}");
    let reference = format!("{}/{namespace}/{id}", registry.prefix());
    Pushed { id, reference, a, b, _node_b: node_b, _registry: registry, scratch }
}

#[test]
fn a_second_fork_of_a_pulled_turn_on_node_b_finds_the_image_the_pull_named() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let p = pushed_two_turns("fork-image");
    let (first, second) = (format!("{}-f1", p.id), format!("{}-f2", p.id));
    // The first fork pulls turn 1; the artifact names the image, containerd on B never ran the source.
    let forked = p.b.crabctl_json(&["fork", &p.id, "--turn", "1", "--as", &first, "--from", &p.reference]);
    assert!(forked["pull"]["bytes_pulled"].as_u64().unwrap() > 0, "{forked:#}");
    assert_eq!(p.b.exec(&first, "cat /data/a; ls /data").trim(), "one\na");
    // The second finds turn 1 in B's store, pulls nothing, and still knows the image.
    let forked = p.b.crabctl_json(&["fork", &p.id, "--turn", "1", "--as", &second, "--from", &p.reference]);
    assert!(forked["pull"].is_null(), "{forked:#}");
    assert_eq!(p.b.exec(&second, "cat /data/a; ls /data").trim(), "one\na");
    p.b.remove(&first);
    p.b.remove(&second);
}

#[test]
fn a_fork_of_a_later_turn_on_node_b_extends_the_chain_an_earlier_fork_pulled() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let p = pushed_two_turns("fork-extend");
    let (first, second) = (format!("{}-f1", p.id), format!("{}-f2", p.id));
    let one = p.b.crabctl_json(&["fork", &p.id, "--turn", "1", "--as", &first, "--from", &p.reference]);
    assert!(one["pull"]["bytes_pulled"].as_u64().unwrap() > 0, "{one:#}");
    // Turn 2 on top of the pulled turn 1: only what turn 1 lacks comes (its objects, the manifest).
    let two = p.b.crabctl_json(&["fork", &p.id, "--turn", "2", "--as", &second, "--from", &p.reference]);
    let (first_bytes, more) = (one["pull"]["bytes_pulled"].as_u64().unwrap(), &two["pull"]);
    assert!(more["manifests_pulled"] == 1 && more["bytes_pulled"].as_u64().unwrap() > 0, "{two:#}");
    assert!(more["bytes_pulled"].as_u64().unwrap() < first_bytes, "turn 1's objects are not pulled again: {two:#}");
    assert_eq!(p.b.exec(&second, "cat /data/a /data/b").trim(), "one\ntwo");
    // A chain of another sandbox (three turns of its own) is no extension of this one: the
    // store finds B's turn 2 is not its link and refuses; B's chain stays at turn 2.
    let other = format!("{}-other", p.id);
    p.a.remove(&other);
    p.a.run_sandbox(&other, &p.scratch.join("a-shim.toml"));
    for (n, script) in ["mkdir -p /data && echo x > /data/x", "echo y > /data/y", "echo z > /data/z"].iter().enumerate()
    {
        p.a.exec(&other, script);
        wait_for("the other sandbox's turn", Duration::from_secs(60), || has_checkpoint(&p.a, &other, n as u64 + 1));
    }
    p.a.crabctl_json(&["push", &other]);
    let other_ref = p.reference.replace(&p.id, &other);
    let third = format!("{}-f3", p.id);
    let out = p.b.crabctl(&["fork", &p.id, "--turn", "3", "--as", &third, "--from", &other_ref]);
    assert!(!out.status.success() && text(&out).contains("diverged"), "{}", text(&out));
    p.a.remove(&other);
    let heads = p.b.crabctl_json(&["checkpoints", &p.id]);
    let turns: Vec<_> = heads.as_array().unwrap().iter().map(|c| c["turn"].as_u64().unwrap()).collect();
    assert!(turns.contains(&1) && turns.contains(&2), "{heads:#}");
    p.b.remove(&first);
    p.b.remove(&second);
}

#[test]
fn concurrent_forks_of_one_source_on_node_b_pull_its_chain_once() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let p = pushed_two_turns("fork-once");
    let forks: Vec<String> = (0..4).map(|i| format!("{}-f{i}", p.id)).collect();
    let outs: Vec<serde_json::Value> = std::thread::scope(|s| {
        let running: Vec<_> = forks
            .iter()
            .map(|new| {
                let (b, id, reference) = (&p.b, &p.id, &p.reference);
                s.spawn(move || b.crabctl_json(&["fork", id, "--turn", "2", "--as", new, "--from", reference]))
            })
            .collect();
        running.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let pulls = outs.iter().filter(|o| !o["pull"].is_null()).count();
    assert_eq!(pulls, 1, "one fork pulls, the others find its chain: {outs:#?}");
    for new in &forks {
        assert_eq!(p.b.exec(new, "cat /data/a /data/b").trim(), "one\ntwo");
        p.b.remove(new);
    }
}
