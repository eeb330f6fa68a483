//! A checkpoint that does not fit on the disk: the crab shim's state directory is a small
//! loop-mounted ext4 file system, nearly filled by a ballast file, and a turn writes more than
//! is left. The failed checkpoint must leave the previous one whole and usable, say why it
//! failed, and lose nothing the turn did once space is back.
//!
//! Real parts: the private containerd (`scripts/containerd`, or CRAB_CTRD_SOCK / CRAB_NS) with
//! `crab.local/busybox:latest`, runc, CRIU, the kernel's BPF; run as root.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crab_containerd::Ctr;
use crab_store::turns::{RecordedClass, TurnLog, TurnRecord};
use crab_store::{CheckpointStore, Head};

const IMAGE: &str = "crab.local/busybox:latest";
const RUNTIME: &str = "io.containerd.crab.v2";
/// The state file system: big enough for the store's skeleton and small turns.
const FS_MIB: u64 = 32;
/// What the ballast leaves free: less than the 6 MiB file a turn writes.
const LEFT_FREE: u64 = 1536 << 10;

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A loop-mounted ext4 file system holding a shim configuration and its state directory.
struct SmallDisk {
    dir: PathBuf,
    state: PathBuf,
    config: PathBuf,
}

impl SmallDisk {
    fn new(name: &str) -> SmallDisk {
        let dir = std::env::temp_dir().join(format!("crab-{name}-{}", std::process::id()));
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let image = dir.join("fs.img");
        let file = std::fs::File::create(&image).unwrap();
        file.set_len(FS_MIB << 20).unwrap();
        run("mkfs.ext4", &["-q", "-F", "-m", "0", image.to_str().unwrap()]);
        run("mount", &["-o", "loop", image.to_str().unwrap(), state.to_str().unwrap()]);
        let config = dir.join("crab.toml");
        // Its own crabd socket, never started: this shim loads an inspector of its own and
        // shares nothing with other shims on the machine.
        std::fs::write(
            &config,
            format!(
                "[checkpoint]\nstate_dir = {:?}\npolicy = \"crab\"\n[node]\nsocket = {:?}\nspawn = false\n",
                state.display().to_string(),
                dir.join("no-crabd.sock").display().to_string()
            ),
        )
        .unwrap();
        SmallDisk { dir, state, config }
    }

    fn available(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.state).unwrap();
        st.blocks_available() as u64 * st.fragment_size() as u64
    }

    fn ballast(&self) -> PathBuf {
        self.state.join("ballast")
    }

    /// Fills the file system until only `LEFT_FREE` bytes are left.
    fn fill(&self) {
        let size = self.available() - LEFT_FREE;
        let file = std::fs::File::create(self.ballast()).unwrap();
        nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, size as i64).unwrap();
        file.sync_all().unwrap();
        assert!(self.available() <= LEFT_FREE + (64 << 10), "{} bytes still free", self.available());
    }

    fn free(&self) {
        std::fs::remove_file(self.ballast()).unwrap();
    }

    fn store(&self) -> CheckpointStore {
        CheckpointStore::open(&self.state).unwrap()
    }

    fn turns(&self, id: &str) -> Vec<TurnRecord> {
        TurnLog::open(&self.state, id).unwrap().read().unwrap()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.state).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A busybox sandbox on the crab runtime whose shim uses `disk`'s configuration.
struct Sandbox<'d> {
    ctr: Ctr,
    id: String,
    disk: &'d SmallDisk,
    execs: usize,
}

impl<'d> Sandbox<'d> {
    /// The store key of the sandbox: its chain and turn log are its namespace's.
    fn key(&self) -> String {
        format!("{}/{}", self.ctr.namespace(), self.id)
    }

    async fn start(name: &str, disk: &'d SmallDisk) -> Sandbox<'d> {
        let sb = Sandbox { ctr: Ctr::from_env(), id: format!("{name}-{}", std::process::id()), disk, execs: 0 };
        sb.run_task(None).await;
        sb
    }

    /// Creates the container; `restore_from` names a checkpoint turn of its own to start from.
    async fn run_task(&self, restore_from: Option<u64>) {
        let mut args = vec!["run".to_string(), "-d".into(), "--runtime".into(), RUNTIME.into()];
        args.push("--runtime-config-path".into());
        args.push(self.disk.config.display().to_string());
        if let Some(turn) = restore_from {
            args.push("--annotation".into());
            args.push(format!("{}={}:{turn}", crab_store::turns::ANNOTATION_RESTORE_FROM, self.id));
        }
        args.extend([IMAGE.into(), self.id.clone(), "sleep".into(), "3600".into()]);
        self.ctr.run(&args).await.unwrap_or_else(|e| {
            panic!("starting {} (is the private containerd up with the busybox image?): {e}", self.id)
        });
    }

    async fn turn(&mut self, script: &str) -> String {
        self.execs += 1;
        let exec_id = format!("t{}", self.execs);
        let out = self.ctr.run(&["tasks", "exec", "--exec-id", &exec_id, &self.id, "sh", "-c", script]).await;
        out.unwrap_or_else(|e| panic!("turn {script:?} in {}: {e}", self.id)).stdout_text()
    }

    /// Waits until `n` turns are recorded.
    async fn turns(&self, n: usize) -> Vec<TurnRecord> {
        for _ in 0..800 {
            let turns = self.disk.turns(&self.key());
            if turns.len() >= n {
                return turns;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{}: fewer than {n} turn records after 20 s: {:?}", self.id, self.disk.turns(&self.key()));
    }

    /// What `crabctl recover` does after a crash: the processes die, the container is created
    /// again from its newest checkpoint (with this shim configuration).
    async fn crash_and_recover(&mut self) {
        self.remove().await;
        let head = self.disk.store().head(&self.key()).unwrap().expect("a checkpoint to recover from");
        self.run_task(Some(head.turn)).await;
    }

    async fn remove(&self) {
        let _ = self.ctr.run(&["tasks", "kill", "--all", "--signal", "SIGKILL", &self.id]).await;
        for _ in 0..100 {
            if self.ctr.run(&["tasks", "delete", "--force", &self.id]).await.is_ok() {
                break;
            }
            let listed = self.ctr.run(&["tasks", "ls", "-q"]).await.map(|o| o.stdout_text());
            if !listed.map(|l| l.lines().any(|l| l == self.id)).unwrap_or(false) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.ctr.run(&["containers", "delete", &self.id]).await;
    }
}

impl Drop for Sandbox<'_> {
    fn drop(&mut self) {
        let (ctr, id) = (self.ctr.clone(), self.id.clone());
        let cleanup = std::thread::spawn(move || {
            tokio::runtime::Runtime::new().unwrap().block_on(async {
                let _ = ctr.run(&["tasks", "kill", "--all", "--signal", "SIGKILL", &id]).await;
                for _ in 0..40 {
                    if ctr.run(&["tasks", "delete", "--force", &id]).await.is_ok() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let _ = ctr.run(&["containers", "delete", &id]).await;
            })
        });
        let _ = cleanup.join();
    }
}

fn tmp_files(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join("tmp"))
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// The failed turn's record names the failure and points at the previous checkpoint.
fn assert_failed_turn(record: &TurnRecord, previous: u64) {
    let reasons = record.reasons.join("; ");
    assert!(reasons.contains("checkpoint failed"), "{record:?}");
    assert!(reasons.contains("No space left on device"), "the error names the cause: {reasons}");
    assert!(reasons.contains("/state/"), "the error names the file that did not fit: {reasons}");
    assert_eq!(record.checkpoint_turn, Some(previous), "{record:?}");
    assert_eq!(record.bytes_written, 0, "{record:?}");
}

const BIG: &str = "dd if=/dev/urandom of=/data/big bs=1M count=6 2>/dev/null";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_does_not_fit_leaves_the_previous_one_whole() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let disk = SmallDisk::new("df-prev");
    let mut sb = Sandbox::start("df-prev", &disk).await;
    sb.turn("mkdir -p /data && echo one > /data/a").await;
    let first = sb.turns(1).await;
    assert_eq!((first[0].class, first[0].checkpoint_turn), (RecordedClass::Fs, Some(1)), "{first:?}");
    let store = disk.store();
    let head_before: Head = store.head(&sb.key()).unwrap().unwrap();

    disk.fill();
    sb.turn(&format!("{BIG} && echo two > /data/a")).await;
    let turns = sb.turns(2).await;
    assert_eq!(turns[1].class, RecordedClass::Fs);
    assert_failed_turn(&turns[1], 1);
    assert_eq!(store.head(&sb.key()).unwrap(), Some(head_before), "HEAD still names turn 1");
    assert_eq!(store.history(&sb.key()).unwrap().len(), 1);
    let verified = store.verify(&sb.key(), 1).unwrap();
    assert!(verified.blobs >= 1, "{verified:?}");
    assert_eq!(tmp_files(&disk.state), Vec::<String>::new(), "no half-written blob is left behind");

    // Recover from turn 1 while the disk is still full: it only reads.
    sb.crash_and_recover().await;
    assert_eq!(sb.turn("cat /data/a; ls /data").await, "one\na\n", "the sandbox is as at turn 1");

    disk.free();
    sb.turn("echo three > /data/c").await;
    let turns = sb.turns(4).await;
    let last = turns.last().unwrap();
    assert_eq!((last.class, last.checkpoint_turn), (RecordedClass::Fs, Some(last.turn)), "{last:?}");
    assert!(last.bytes_written > 0);
    assert_eq!(store.head(&sb.key()).unwrap().map(|h| h.turn), Some(last.turn));
    store.verify(&sb.key(), last.turn).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_failed_checkpoint_missed_goes_into_the_next_one() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let disk = SmallDisk::new("df-carry");
    let mut sb = Sandbox::start("df-carry", &disk).await;
    sb.turn("mkdir -p /data && echo one > /data/a").await;
    sb.turns(1).await;

    disk.fill();
    // A process turn too: its dump fits (it is not on the small disk), its write-out does not.
    sb.turn(&format!("{BIG} && echo two > /data/a && tail -f /dev/null >/dev/null 2>&1 &")).await;
    let turns = sb.turns(2).await;
    assert_eq!(turns[1].class, RecordedClass::Proc, "{:?}", turns[1]);
    assert_failed_turn(&turns[1], 1);
    let big_md5 = sb.turn("md5sum /data/big").await;
    // Still full: this turn takes turn 2's changes in, and fails the same way.
    let turns = sb.turns(3).await;
    assert_failed_turn(&turns[2], 1);
    assert!(turns[2].reasons.iter().any(|r| r.contains("processes of turn 2")), "{:?}", turns[2]);

    disk.free();
    sb.turn("echo three > /data/c").await;
    let turns = sb.turns(4).await;
    let last = turns.last().unwrap();
    assert_eq!(last.checkpoint_turn, Some(last.turn), "{last:?}");
    // The process of turn 2 is in no checkpoint yet: this file-only turn dumps it.
    assert_eq!(last.class, RecordedClass::Proc, "{last:?}");
    assert!(last.reasons.iter().any(|r| r.contains("processes of turn 2")), "{:?}", last.reasons);
    let (_, manifest) = disk.store().manifest_at(&sb.key(), last.turn).unwrap();
    let paths: Vec<String> = manifest.fs_delta.iter().map(|e| e.path.to_string()).collect();
    assert!(paths.iter().any(|p| p == "/data/big"), "turn 2's file is carried: {paths:?}");

    sb.crash_and_recover().await;
    assert_eq!(sb.turn("md5sum /data/big").await, big_md5);
    assert_eq!(sb.turn("cat /data/a /data/c").await, "two\nthree\n");
    let ps = sb.turn("ps").await;
    assert!(ps.contains("tail -f /dev/null"), "turn 2's process came back: {ps}");
}
