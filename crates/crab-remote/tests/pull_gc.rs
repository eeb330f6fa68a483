//! A pull into crab's checkpoint store racing the store's GC (`crabctl gc` run meanwhile): the
//! pull's objects are written before any manifest or head names them, so GC must wait for the
//! pull instead of collecting them. Real stores on both sides and a real docker-registry
//! between them (scripts/registry); needs root.

mod common;

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use common::Registry;
use crab_remote::chain::{ChainSandbox, PushLog, pull_chain, push_chain};
use crab_remote::{Remote, RemoteIndex};
use crab_store::{ChangedPath, CheckpointStore, RetentionPolicy, TurnInput};

const KEY: &str = "default/box";

/// Writes `content` at `rel` (absolute in the sandbox) under `root`.
fn write(root: &Path, rel: &str, content: &[u8]) {
    let path = root.join(rel.trim_start_matches('/'));
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

/// Bytes that neither dedup nor compress away, from a seed.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// True when /proc/locks shows an exclusive flock request waiting on the file with inode `ino`
/// (a GC blocked on the store's lock).
fn exclusive_waiter_on(ino: u64) -> bool {
    let locks = fs::read_to_string("/proc/locks").unwrap_or_default();
    let suffix = format!(":{ino}");
    locks.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "<n>: -> FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> 0 EOF"
        fields.len() >= 7
            && fields[1] == "->"
            && fields[2] == "FLOCK"
            && fields[4] == "WRITE"
            && fields[6].ends_with(&suffix)
    })
}

/// How the GC started at the failpoint was found before the pull went on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GcSeen {
    /// Waiting for the store's lock: the pull holds it.
    Blocked,
    /// Already done: it ran over the pull's unreferenced objects.
    Finished,
}

/// Turn 1 (small files, packed, and one over 64 KiB, a blob file of its own) and turn 2 (new
/// files of both kinds) committed on node A and pushed; node B pulls turn 2, whose parent comes
/// from turn 1's tag. At the failpoint after the first batch is written and before its manifest
/// is imported, a GC of B's store starts on another thread. The pull must finish with every
/// object of the chain present and verified; the GC must have waited for it, and finish after.
#[test]
fn gc_during_a_pull_waits_and_the_pulled_chain_is_whole() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(false);
    let tmp = tempfile::tempdir().unwrap();
    let (state_a, state_b, live) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("live"));
    let mut files: HashMap<&str, Vec<u8>> = HashMap::new();
    files.insert("/app/small1", noise(1, 3000));
    files.insert("/app/small2", noise(2, 9000));
    files.insert("/app/large", noise(3, 300 << 10));
    files.insert("/data/small3", noise(4, 5000));
    files.insert("/data/large2", noise(5, 200 << 10));
    let store_a = Arc::new(CheckpointStore::open(&state_a).unwrap());
    for (turn, paths) in
        [(1, &["/app/small1", "/app/small2", "/app/large"][..]), (2, &["/data/small3", "/data/large2"])]
    {
        for p in paths {
            write(&live, p, &files[p]);
        }
        let changed: Vec<ChangedPath> = paths.iter().map(ChangedPath::created).collect();
        store_a
            .commit_turn(&TurnInput { container: KEY, turn, rootfs: Some(&live), changed: &changed, criu_images: None })
            .unwrap();
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let cfg = registry.config();
    let sandbox =
        ChainSandbox { namespace: "default".into(), sandbox: "box".into(), key: KEY.into(), image: None, spec: None };
    let mut log = PushLog::load(&tmp.path().join("pushed"), "default", "box").unwrap();
    let pushed = runtime
        .block_on(async {
            let remote = Remote::new(cfg.clone())?;
            push_chain(&remote, &mut RemoteIndex::in_memory(), store_a.clone(), &sandbox, &mut log, None).await
        })
        .unwrap();
    assert_eq!(pushed.pushed.len(), 2, "{pushed:?}");

    let store_b = Arc::new(CheckpointStore::open(&state_b).unwrap());
    let lock_ino = fs::metadata(state_b.join("lock")).unwrap().ino();
    let scenario = fail::FailScenario::setup();
    let hits = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<Option<GcSeen>>> = Arc::default();
    let (gc_tx, gc_rx) = mpsc::channel();
    let gc_done = Arc::new(AtomicUsize::new(0));
    {
        let (hits, seen, gc_done, state_b) = (hits.clone(), seen.clone(), gc_done.clone(), state_b.clone());
        let gc_tx = Mutex::new(Some(gc_tx));
        fail::cfg_callback("pull-chain-before-import", move || {
            if hits.fetch_add(1, Ordering::SeqCst) > 0 {
                return;
            }
            // `crabctl gc` as another process would: its own store handle, its own lock file.
            let (tx, done, state) = (gc_tx.lock().unwrap().take().unwrap(), gc_done.clone(), state_b.clone());
            std::thread::spawn(move || {
                let report = CheckpointStore::open(&state).and_then(|s| s.gc(&RetentionPolicy { keep_last: 1 }));
                done.store(1, Ordering::SeqCst);
                let _ = tx.send(report);
            });
            // Until GC is either done or seen waiting for the lock (bounded: a GC that does
            // neither in this time is reported as neither, and the assertion below fails).
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if gc_done.load(Ordering::SeqCst) == 1 {
                    *seen.lock().unwrap() = Some(GcSeen::Finished);
                    return;
                }
                if exclusive_waiter_on(lock_ino) {
                    *seen.lock().unwrap() = Some(GcSeen::Blocked);
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .unwrap();
    }
    // The pull on a thread of its own, so that a pull stuck behind the lock fails the test
    // instead of hanging it.
    let (pull_tx, pull_rx) = mpsc::channel();
    {
        let (store, cfg) = (store_b.clone(), cfg.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let pulled = runtime.block_on(async {
                let remote = Remote::new(cfg)?;
                pull_chain(&remote, "default", "box", 2, &store, KEY, None).await
            });
            let _ = pull_tx.send(pulled);
        });
    }
    let pulled = pull_rx.recv_timeout(Duration::from_secs(120)).expect("the pull did not finish within 120 s");
    let gc = gc_rx.recv_timeout(Duration::from_secs(120));
    scenario.teardown();
    let pulled = pulled.unwrap_or_else(|e| panic!("pull with a GC started in its middle: {e}"));
    assert_eq!(hits.load(Ordering::SeqCst), 1, "the failpoint ran once (one batch before the first import)");
    assert_eq!(*seen.lock().unwrap(), Some(GcSeen::Blocked), "GC waited for the pull's lock");
    let gc = gc.expect("GC did not finish within 120 s of the pull").expect("GC after the pull");
    assert_eq!(pulled.head.map(|h| h.turn), Some(2));

    // GC ran over the pulled chain (turn 1 folded below the window), and turn 2 is whole:
    // every blob verified, the rootfs materialized byte for byte.
    assert!(gc.manifests_removed >= 1, "{gc:?}");
    let report = store_b.verify(KEY, 2).unwrap();
    assert_eq!(report.blobs, files.len() as u64, "{report:?}");
    let target: PathBuf = tmp.path().join("restored");
    // The base the sandbox started from had the directories.
    for dir in ["app", "data"] {
        fs::create_dir_all(target.join(dir)).unwrap();
    }
    store_b.materialize(KEY, 2, &target).unwrap();
    for (path, content) in &files {
        let restored = fs::read(target.join(path.trim_start_matches('/'))).unwrap();
        assert!(restored == *content, "{path} restored with other bytes");
    }
}
