//! Checkpoint store figures on this machine: in-place rollback of 10 and 100 changed files,
//! fs delta capture (a whole fs-turn commit, flushes included), and the bytes a second CRIU dump
//! of an unchanged process adds. Prints percentiles and ratios; asserts nothing about time.
//!
//! `cargo bench --bench checkpoint_store [-- rollback|capture|criu]` (as root; the CRIU part is
//! skipped without criu). `CRAB_BENCH_DIR=/dev/shm` measures on tmpfs instead of the temp
//! dir's file system; `ROLLBACK_GAP_MS=N` waits N ms between a commit and the rollback timed
//! after it (think time, during which the kernel starts writing back the live files).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crab_store::{ChangedPath, CheckpointStore, RollbackRequest, TurnInput};

const BASE_FILES: usize = 1000;

/// Image reassemblies timed per target file system (page cache warm, as right after a dump).
const RESTORE_ROUNDS: usize = 7;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index]
}

fn report(label: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{label:<44} n={:<4} p50={:>8.3} ms  p99={:>8.3} ms  max={:>8.3} ms",
        samples.len(),
        ms(percentile(&samples, 0.50)),
        ms(percentile(&samples, 0.99)),
        ms(*samples.last().unwrap())
    );
}

/// User plus system CPU time of this process so far: on a shared machine a figure that other
/// tenants' load does not inflate.
fn cpu_time() -> Duration {
    // SAFETY: all-zero bytes are a valid `rusage` (plain integers).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    assert_eq!(rc, 0, "getrusage: {}", std::io::Error::last_os_error());
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Deterministic file content that differs per (file, version).
fn content(file: usize, version: usize, len: usize) -> Vec<u8> {
    let mut x = (file as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (version as u64 + 7);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn file_rel(i: usize) -> String {
    format!("/app/src/pkg{}/mod{i}.py", i % 20)
}

struct Fixture {
    _tmp: tempfile::TempDir,
    base: PathBuf,
    live: PathBuf,
    store: CheckpointStore,
}

/// `CRAB_BENCH_DIR` picks the file system to measure on (default: the system temp dir).
fn bench_tempdir() -> tempfile::TempDir {
    match std::env::var_os("CRAB_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir().unwrap(),
    }
}

fn fixture() -> Fixture {
    let tmp = bench_tempdir();
    let (base, live) = (tmp.path().join("base"), tmp.path().join("live"));
    for root in [&base, &live] {
        for i in 0..BASE_FILES {
            let path = root.join(file_rel(i).trim_start_matches('/'));
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content(i, 0, 2048 + (i * 37) % 8192)).unwrap();
        }
    }
    let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
    Fixture { _tmp: tmp, base, live, store }
}

fn edit(live: &Path, files: usize, version: usize) -> Vec<ChangedPath> {
    (0..files)
        .map(|i| {
            let file = (i * 7) % BASE_FILES;
            let rel = file_rel(file);
            fs::write(live.join(rel.trim_start_matches('/')), content(file, version, 2048 + (version * 131) % 8192))
                .unwrap();
            ChangedPath::modified(rel)
        })
        .collect()
}

fn commit(fx: &Fixture, turn: u64, changed: &[ChangedPath]) -> crab_store::CommitReport {
    fx.store
        .commit_turn(&TurnInput { container: "bench", turn, rootfs: Some(&fx.live), changed, criu_images: None })
        .unwrap()
}

/// Each round: the agent edits `files` files in a turn, the turn is committed, and the
/// container is rolled back in place to the turn before.
fn bench_rollback(files: usize, rounds: usize) {
    let fx = fixture();
    commit(&fx, 0, &[]);
    let first = edit(&fx.live, files, 1);
    commit(&fx, 1, &first);
    let mut samples = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let changed = edit(&fx.live, files, round + 2);
        commit(&fx, 2, &changed);
        if let Some(ms) = std::env::var("ROLLBACK_GAP_MS").ok().and_then(|v| v.parse().ok()) {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let start = Instant::now();
        let report = fx
            .store
            .rollback_in_place(&RollbackRequest {
                container: "bench",
                to_turn: 1,
                root: &fx.live,
                base: Some(&fx.base),
                uncommitted: &[],
            })
            .unwrap();
        samples.push(start.elapsed());
        assert_eq!(report.stats.files_written as usize, files);
    }
    // The rolled-back tree really is turn 1.
    let probe = file_rel(0);
    assert_eq!(fs::read(fx.live.join(probe.trim_start_matches('/'))).unwrap(), content(0, 1, 2048 + 131));
    report(&format!("rollback in place, {files} changed files"), samples);
}

fn bench_capture(files: usize, turns: usize) {
    let fx = fixture();
    commit(&fx, 0, &[]);
    let mut samples = Vec::with_capacity(turns);
    let (mut logical, mut written) = (0u64, 0u64);
    for turn in 1..=turns {
        let changed = edit(&fx.live, files, turn);
        let start = Instant::now();
        let report = commit(&fx, turn as u64, &changed);
        samples.push(start.elapsed());
        logical += report.traffic.logical_bytes;
        written += report.traffic.written_bytes + report.manifest_bytes;
    }
    report(&format!("fs turn commit (capture+flush), {files} files"), samples);
    println!("{:<44} logical={logical} B written(blobs+manifests)={written} B", "");
}

fn bench_clean_turn(turns: usize) {
    let fx = fixture();
    let mut samples = Vec::with_capacity(turns);
    for turn in 0..turns {
        let start = Instant::now();
        commit(&fx, turn as u64, &[]);
        samples.push(start.elapsed());
    }
    report("clean turn commit", samples);
}

fn criu_available() -> bool {
    Command::new("criu")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn bench_second_dump() {
    if !criu_available() {
        println!("second CRIU dump: skipped, criu not found");
        return;
    }
    let tmp = bench_tempdir();
    let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
    let script = "import os, time\nx = bytearray(os.urandom(64 << 20))\nprint('ready', flush=True)\ntime.sleep(600)\n";
    let mut child = Command::new("setsid")
        .args(["python3", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    let pid = child.id().to_string();
    let mut reports = Vec::new();
    for turn in 1..=2u64 {
        let dir = tmp.path().join(format!("dump{turn}"));
        fs::create_dir_all(&dir).unwrap();
        let status = Command::new("criu")
            .args(["dump", "--leave-running", "-o", "dump.log", "-t", &pid, "-D"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(status.success(), "criu dump failed, see {}", dir.join("dump.log").display());
        let start = Instant::now();
        let report = store
            .commit_turn(&TurnInput { container: "proc", turn, rootfs: None, changed: &[], criu_images: Some(&dir) })
            .unwrap();
        reports.push((report, start.elapsed()));
    }
    let _ = child.kill();
    let _ = child.wait();
    let shm = tempfile::tempdir_in("/dev/shm").ok();
    let (mut on_store_fs, mut on_store_fs_cpu) = (Vec::new(), Vec::new());
    let (mut on_tmpfs, mut on_tmpfs_cpu) = (Vec::new(), Vec::new());
    for round in 0..RESTORE_ROUNDS {
        let timed = |parent: &Path, wall: &mut Vec<Duration>, cpu: &mut Vec<Duration>| {
            let dir = parent.join(format!("restored{round}"));
            let (start, cpu_start) = (Instant::now(), cpu_time());
            store.restore_images("proc", 2, &dir).unwrap();
            wall.push(start.elapsed());
            cpu.push(cpu_time() - cpu_start);
            fs::remove_dir_all(&dir).unwrap();
        };
        timed(tmp.path(), &mut on_store_fs, &mut on_store_fs_cpu);
        if let Some(shm) = &shm {
            timed(shm.path(), &mut on_tmpfs, &mut on_tmpfs_cpu);
        }
    }
    for (report, took) in &reports {
        let t = report.traffic;
        println!(
            "CRIU dump turn {}: logical={} B new blob bytes={} B (+{} B manifest) ratio={:.4} store time={:.1} ms",
            report.turn,
            t.logical_bytes,
            t.written_bytes,
            report.manifest_bytes,
            (t.written_bytes + report.manifest_bytes) as f64 / t.logical_bytes as f64,
            took.as_secs_f64() * 1e3
        );
    }
    report("CRIU image reassembly (64 MiB), same fs", on_store_fs);
    report("  CPU time of it (all threads)", on_store_fs_cpu);
    if !on_tmpfs.is_empty() {
        report("CRIU image reassembly (64 MiB), into tmpfs", on_tmpfs);
        report("  CPU time of it (all threads)", on_tmpfs_cpu);
    }
}

fn main() {
    let dir = std::env::var("CRAB_BENCH_DIR").unwrap_or_else(|_| std::env::temp_dir().display().to_string());
    println!("checkpoint store bench on {dir}");
    // `cargo bench --bench checkpoint_store -- rollback` runs only the parts whose name matches.
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));
    if wanted("rollback") {
        bench_rollback(10, 300);
        bench_rollback(100, 100);
    }
    if wanted("capture") {
        bench_capture(10, 100);
        bench_capture(100, 30);
        bench_clean_turn(50);
    }
    if wanted("criu") {
        bench_second_dump();
    }
}
