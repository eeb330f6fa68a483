//! Tenants are separate (issue 14, findings 4 and 5): two containerd namespaces that each run a
//! container of the same id keep their own chain, turn log and crabd watch, and
//! `io.crab.restore-from` names only a chain of the new container's own namespace.
//! Runs against the private containerd (`scripts/containerd`, or CRAB_CTRD_SOCK / CRAB_NS) with
//! `crab.local/busybox:latest`; the second namespace is `<CRAB_NS>-b`. What the shims stored is
//! read with `crabctl` (the staged one in CRAB_SHIM_DIR when there is one, as the shims are).

use std::time::{Duration, Instant};

use crab_containerd::Ctr;

const IMAGE: &str = "crab.local/busybox:latest";

fn crabctl() -> std::path::PathBuf {
    crab_integration::env::crab_binary("crabctl")
}

/// `crabctl <args> --json` in namespace `ns`.
fn crabctl_json(ns: &str, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(crabctl()).args(args).arg("--json").env("CRAB_NS", ns).output().unwrap();
    assert!(out.status.success(), "crabctl {args:?} in {ns}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The turn records of `id` in namespace `ns`: (turn, exec id, class, checkpoint turn).
fn turns(ns: &str, id: &str) -> Vec<(u64, String, String, Option<u64>)> {
    let rows = crabctl_json(ns, &["turns", id]);
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["turn"].as_u64().unwrap(),
                r["exec_id"].as_str().unwrap_or_default().to_string(),
                r["class"].as_str().unwrap_or_default().to_string(),
                r["checkpoint_turn"].as_u64(),
            )
        })
        .collect()
}

/// Waits (10 s at most) until `id` in `ns` has `n` turn records.
async fn wait_turns(ns: &str, id: &str, n: usize) -> Vec<(u64, String, String, Option<u64>)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let records = turns(ns, id);
        if records.len() >= n || Instant::now() > deadline {
            return records;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Containers of this test in two namespaces, removed on drop.
struct Tenants {
    a: Ctr,
    b: Ctr,
    started: Vec<(Ctr, String)>,
}

impl Tenants {
    async fn new() -> Tenants {
        let a = Ctr::from_env();
        let b = Ctr::new(a.socket(), format!("{}-b", a.namespace()));
        // Images are per namespace: the second one gets the first one's busybox.
        let listed = b.run(&["images", "ls", "-q"]).await.unwrap().stdout_text();
        if !listed.lines().any(|l| l.trim() == IMAGE) {
            let dir = tempfile::tempdir().unwrap();
            let tar = dir.path().join("busybox.tar");
            let tar = tar.to_str().unwrap();
            a.run(&["images", "export", tar, IMAGE]).await.expect("busybox in the first namespace");
            b.run(&["images", "import", tar]).await.unwrap();
        }
        Tenants { a, b, started: Vec::new() }
    }

    async fn run(&mut self, in_b: bool, id: &str, flags: &[&str]) -> Result<(), String> {
        let ctr = if in_b { self.b.clone() } else { self.a.clone() };
        self.started.push((ctr.clone(), id.to_string()));
        let mut args = vec!["run", "-d", "--runtime", "io.containerd.crab.v2"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&[IMAGE, id, "sleep", "3600"]);
        ctr.run(&args).await.map(drop).map_err(|e| e.to_string())
    }

    async fn exec(&self, in_b: bool, id: &str, exec_id: &str, script: &str) -> String {
        let ctr = if in_b { &self.b } else { &self.a };
        ctr.run(&["tasks", "exec", "--exec-id", exec_id, id, "sh", "-c", script])
            .await
            .unwrap_or_else(|e| panic!("{script:?} in {}/{id}: {e}", ctr.namespace()))
            .stdout_text()
    }
}

impl Drop for Tenants {
    fn drop(&mut self) {
        let started = std::mem::take(&mut self.started);
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                for (ctr, id) in &started {
                    ctr.force_remove(id).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// Finding 4: `ctr -n other run ... t2` while `crab/t2` runs deleted crab/t2's chain, reset
/// its log and moved crabd's watch. Each namespace's container keeps its own; the first one's
/// next file-writing turn is still seen (fs) and checkpointed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_running_one_id_keep_their_own_chains_logs_and_watches() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut t = Tenants::new().await;
    let (ns_a, ns_b) = (t.a.namespace().to_string(), t.b.namespace().to_string());
    let id = format!("tn-same-{}", std::process::id());
    t.run(false, &id, &[]).await.unwrap();
    t.exec(false, &id, "a1", "echo one > /a1").await;
    let a = wait_turns(&ns_a, &id, 1).await;
    assert_eq!(a, [(1, "a1".into(), "fs".into(), Some(1))], "{ns_a}/{id} before the other tenant came");

    t.run(true, &id, &[]).await.unwrap();
    t.exec(true, &id, "b1", "echo bee > /b1").await;
    let b = wait_turns(&ns_b, &id, 1).await;
    assert_eq!(b, [(1, "b1".into(), "fs".into(), Some(1))], "{ns_b}/{id}");

    // The first tenant's log and chain are as they were ...
    assert_eq!(turns(&ns_a, &id), a, "{ns_a}/{id}'s turn log after {ns_b}/{id} started and ran a turn");
    // ... and its next file-writing turn is still watched and checkpointed.
    t.exec(false, &id, "a2", "echo two > /a2").await;
    let a = wait_turns(&ns_a, &id, 2).await;
    assert_eq!(
        a,
        [(1, "a1".into(), "fs".into(), Some(1)), (2, "a2".into(), "fs".into(), Some(2))],
        "{ns_a}/{id}'s turns after the other tenant's"
    );
    let checkpoints = crabctl_json(&ns_a, &["checkpoints", &id]);
    let chain: Vec<u64> = checkpoints.as_array().unwrap().iter().filter_map(|c| c["turn"].as_u64()).collect();
    assert_eq!(chain, [2, 1], "{ns_a}/{id}'s chain: {checkpoints}");
    let verified = crabctl_json(&ns_a, &["verify", &id]);
    assert_eq!(verified[0]["ok"], true, "{verified}");
    assert_eq!(verified[0]["head_turn"], 2, "{verified}");
    let checkpoints = crabctl_json(&ns_b, &["checkpoints", &id]);
    assert_eq!(checkpoints.as_array().unwrap().len(), 1, "{ns_b}/{id}'s chain: {checkpoints}");
}

/// Finding 5: `io.crab.restore-from` restored any sandbox into any other, across namespaces.
/// A container of another namespace can name neither the victim's id (that is its own
/// namespace's chain) nor `<namespace>/<id>` (refused at Create, naming the annotation);
/// within one namespace it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_from_reaches_only_chains_of_the_own_namespace() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut t = Tenants::new().await;
    let ns_a = t.a.namespace().to_string();
    let pid = std::process::id();
    let victim = format!("tn-victim-{pid}");
    t.run(false, &victim, &[]).await.unwrap();
    t.exec(false, &victim, "s1", "echo secret-of-a > /secret").await;
    assert_eq!(wait_turns(&ns_a, &victim, 1).await, [(1, "s1".into(), "fs".into(), Some(1))]);

    let by_id = format!("io.crab.restore-from={victim}:1");
    let thief = format!("tn-thief-{pid}");
    let stolen = t.run(true, &thief, &["--annotation", &by_id]).await;
    if stolen.is_ok() {
        let seen = t.exec(true, &thief, "x", "cat /secret 2>&1; true").await;
        panic!(
            "a container of namespace {} was created from {ns_a}/{victim}'s chain by its id; it reads: {seen}",
            t.b.namespace()
        );
    }

    let qualified = format!("io.crab.restore-from={ns_a}/{victim}:1");
    let thief2 = format!("tn-thief2-{pid}");
    let refused = t
        .run(true, &thief2, &["--annotation", &qualified])
        .await
        .expect_err("restore across namespaces must be refused");
    assert!(
        refused.contains("io.crab.restore-from")
            && refused.contains("restore_from_namespaces")
            && refused.contains(&ns_a),
        "the error names the annotation and why: {refused}"
    );

    let fork = format!("tn-fork-{pid}");
    t.run(false, &fork, &["--annotation", &by_id]).await.expect("a restore within the namespace works");
    assert_eq!(t.exec(false, &fork, "f1", "cat /secret").await, "secret-of-a\n");
}
