//! Checkpoints taken by the crab shim, brought back through containerd:
//! recover after the sandbox's processes or its shim are killed, rollback in
//! place and by restore, forks that diverge, and a corrupted blob refused.
//! Runs against the private containerd (`scripts/containerd`, or
//! CRAB_CTRD_SOCK / CRAB_NS) with `crab.local/busybox:latest`.

use std::time::Duration;

use crab_containerd::Ctr;
use crab_store::turns::{RecordedClass, TurnRecord};
use crabctl::Ctl;

const IMAGE: &str = "crab.local/busybox:latest";
/// Has python3, for processes that hold sockets and locks.
const TERMINAL_IMAGE: &str = "crab.local/terminal:latest";

fn state_dir() -> std::path::PathBuf {
    std::env::var_os("CRAB_STATE_DIR").map(Into::into).unwrap_or_else(|| crab_store::DEFAULT_STATE_DIR.into())
}

/// A sandbox on the crab runtime, removed with everything it stored on drop.
struct Sandbox {
    ctr: Ctr,
    id: String,
    execs: u32,
    extra: Vec<String>,
    /// The checkpoint store its shim writes to.
    state: std::path::PathBuf,
}

impl Sandbox {
    async fn start(name: &str) -> Sandbox {
        Self::start_with(name, &[]).await
    }

    /// Starts with extra `ctr run` flags (annotations).
    async fn start_with(name: &str, flags: &[&str]) -> Sandbox {
        Self::start_in(name, flags, state_dir()).await
    }

    /// Starts with extra `ctr run` flags whose crab config puts the store at `state`.
    async fn start_in(name: &str, flags: &[&str], state: std::path::PathBuf) -> Sandbox {
        Self::start_image(name, IMAGE, flags, state).await
    }

    async fn start_image(name: &str, image: &str, flags: &[&str], state: std::path::PathBuf) -> Sandbox {
        let id = format!("{name}-{}", std::process::id());
        let ctr = Ctr::from_env();
        // crab's runtime, over `$CRAB_TEST_CRAB_BINARY` when set, unless the test brings a
        // crab config of its own.
        let leg = crab_integration::env::Runtime::parse("crab").expect("crab runtime").run_flags();
        let mut args = vec!["run", "-d"];
        if flags.contains(&"--runtime-config-path") {
            args.extend_from_slice(&["--runtime", "io.containerd.crab.v2"]);
        } else {
            args.extend(leg.iter().map(String::as_str));
        }
        args.extend_from_slice(flags);
        args.extend_from_slice(&[image, &id, "sleep", "3600"]);
        ctr.run(&args)
            .await
            .unwrap_or_else(|e| panic!("starting {id} (is the private containerd up with the busybox image?): {e}"));
        Sandbox { ctr, id, execs: 0, extra: Vec::new(), state }
    }

    /// Runs one turn; returns its stdout.
    async fn turn(&mut self, script: &str) -> String {
        self.execs += 1;
        let exec_id = format!("t{}", self.execs);
        let out = self.ctr.run(&["tasks", "exec", "--exec-id", &exec_id, &self.id, "sh", "-c", script]).await;
        out.unwrap_or_else(|e| panic!("turn {script:?} in {}: {e}", self.id)).stdout_text()
    }

    /// Runs a command in this sandbox (it is a turn too) or in another one.
    async fn exec_in(&mut self, id: &str, script: &str) -> String {
        if id == self.id {
            self.execs += 1;
        }
        let exec_id =
            format!("q{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
        self.ctr
            .run(&["tasks", "exec", "--exec-id", &exec_id, id, "sh", "-c", script])
            .await
            .unwrap_or_else(|e| panic!("{script:?} in {id}: {e}"))
            .stdout_text()
    }

    /// Waits until the shim recorded every exec so far as a turn and returns them.
    async fn settled(&self) -> Vec<TurnRecord> {
        self.turns(self.execs as usize).await
    }

    /// Waits until the chain holds a durable checkpoint of `turn`. A turn that ends while an
    /// earlier one's write-out is still running carries that turn's paths (never cleaner than
    /// the store): a test that expects a later turn to be clean waits for this first.
    async fn published(&self, turn: u64) {
        let ctl = self.ctl();
        for _ in 0..1200 {
            if ctl.checkpoints(&self.id).unwrap().iter().any(|c| c.turn >= turn && c.superseded_by.is_none()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{}: no checkpoint of turn {turn} after 30 s: {:?}", self.id, ctl.checkpoints(&self.id).unwrap());
    }

    /// Waits until the shim recorded `n` turns and returns them.
    async fn turns(&self, n: usize) -> Vec<TurnRecord> {
        let ctl = self.ctl();
        for _ in 0..400 {
            let turns = ctl.turns(&self.id).unwrap();
            if turns.len() >= n {
                return turns;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{}: fewer than {n} turn records after 10 s: {:?}", self.id, ctl.turns(&self.id).unwrap());
    }

    async fn kill_processes(&self) {
        self.ctr.run(&["tasks", "kill", "--all", "--signal", "SIGKILL", &self.id]).await.unwrap();
        for _ in 0..100 {
            let out = self.ctr.run(&["tasks", "ls"]).await.unwrap().stdout_text();
            if out.lines().any(|l| l.starts_with(&format!("{} ", self.id)) && l.contains("STOPPED")) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} did not stop", self.id);
    }

    fn ctl(&self) -> Ctl {
        Ctl::open(&self.state, self.ctr.clone()).unwrap()
    }

    /// How CRIU locked the network for the dump behind `turn`'s checkpoint, as its images
    /// record it (a restore does the same).
    fn dump_network_lock(&self, turn: u64) -> NetworkLockRecorded {
        let dest = tempfile::tempdir().unwrap();
        let images = dest.path().join("images");
        self.ctl()
            .store
            .restore_images(&self.ctl().key(&self.id).unwrap(), turn, &images)
            .unwrap()
            .expect("a process checkpoint");
        let inventory = std::fs::read(images.join("inventory.img")).unwrap();
        match recorded_network_lock(&inventory) {
            Some(0) => NetworkLockRecorded::Iptables,
            Some(2) => NetworkLockRecorded::Skip,
            other => panic!("inventory.img of {} turn {turn}: network_lock_method {other:?}", self.id),
        }
    }
}

#[derive(Debug, PartialEq)]
enum NetworkLockRecorded {
    Iptables,
    Skip,
}

/// Field 11 (network_lock_method) of the inventory_entry in a CRIU inventory.img: its magic,
/// the entry's length, then the protobuf message. CRIU's values: 0 iptables, 1 nftables, 2 skip.
fn recorded_network_lock(inventory: &[u8]) -> Option<u64> {
    let len = u32::from_le_bytes(inventory.get(4..8)?.try_into().ok()?) as usize;
    let entry = inventory.get(8..8 + len)?;
    let mut at = 0;
    let varint = |at: &mut usize| -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *entry.get(*at)?;
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    };
    while at < entry.len() {
        let key = varint(&mut at)?;
        match key & 7 {
            0 => {
                let value = varint(&mut at)?;
                if key >> 3 == 11 {
                    return Some(value);
                }
            }
            1 => at += 8,
            2 => at += varint(&mut at)? as usize,
            5 => at += 4,
            _ => return None,
        }
    }
    None
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let ctr = self.ctr.clone();
        let ids: Vec<String> = std::iter::once(self.id.clone()).chain(self.extra.drain(..)).collect();
        let state = self.state.clone();
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                for id in &ids {
                    ctr.force_remove(id).await;
                    let key = format!("{}/{id}", ctr.namespace());
                    let _ = crab_store::CheckpointStore::open(&state).and_then(|s| s.remove_container(&key));
                    let _ = crab_store::turns::TurnLog::open(&state, &key).map(|l| l.reset());
                    let _ = crab_store::remove_full_checkpoints(&state, &key);
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// A crab config of a test's own in `dir`: its store at `dir/state`, no crabd (the shim
/// loads its own inspector), and `runtime` lines put under `[runtime]`. Returns the store
/// and the config file.
fn own_config(dir: &std::path::Path, runtime: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    own_config_with(dir, runtime, "")
}

/// [`own_config`] with more `[checkpoint]` keys.
fn own_config_with(dir: &std::path::Path, runtime: &str, checkpoint: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let state = dir.join("state");
    let config = dir.join("crab.toml");
    // The crun leg (`$CRAB_TEST_CRAB_BINARY`) covers these sandboxes too.
    let binary = match std::env::var(crab_integration::env::CRAB_BINARY_ENV) {
        Ok(binary) if !binary.trim().is_empty() && !runtime.contains("binary =") => format!("binary = {binary:?}\n"),
        _ => String::new(),
    };
    let runtime = format!("{binary}{runtime}");
    std::fs::write(
        &config,
        format!(
            "[runtime]\n{runtime}[checkpoint]\n{checkpoint}state_dir = \"{}\"\n[node]\nsocket = \"{}\"\nspawn = false\n",
            state.display(),
            dir.join("no-crabd.sock").display()
        ),
    )
    .unwrap();
    (state, config)
}

/// Content, mode and type of every file under /data, one line each.
const FINGERPRINT: &str = "cd /data && find . | sort | while read f; do stat -c '%n %a %F %s' \"$f\"; [ -f \"$f\" ] && md5sum \"$f\"; [ -L \"$f\" ] && readlink \"$f\"; done; true";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_turns_come_back_exactly_after_the_processes_die() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-fs").await;
    sb.turn("mkdir -p /data/sub && echo one > /data/a && echo two > /data/sub/b && chmod 640 /data/a").await;
    sb.turn("ln -s sub/b /data/link && rm /data/sub/b && echo three > /data/sub/c && mv /data/a /data/a2").await;
    sb.published(2).await;
    sb.turn("ls /data >/dev/null").await;
    let turns = sb.turns(3).await;
    let classes: Vec<_> = turns.iter().map(|t| t.class).collect();
    assert_eq!(classes, vec![RecordedClass::Fs, RecordedClass::Fs, RecordedClass::Clean], "{turns:#?}");
    let before = sb.exec_in(&sb.id.clone(), FINGERPRINT).await;

    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(2), "the clean turn 3 points at turn 2's checkpoint");
    let after = sb.exec_in(&sb.id.clone(), FINGERPRINT).await;
    assert_eq!(before, after);
    assert!(after.contains("./a2 640"), "{after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_process_continues_from_its_value_after_recover() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-proc").await;
    // The secret lives only in the shell's memory; the file shows it is still there. It is
    // replaced by a rename, so a read never sees it half written.
    sb.turn("mkdir -p /data; (s=secret-$$; i=0; while :; do i=$((i+1)); echo \"$s $i\" > /data/c.tmp && mv /data/c.tmp /data/counter; sleep 0.1; done) >/dev/null 2>&1 &").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    sb.turn("cat /data/counter").await;
    let turns = sb.turns(2).await;
    assert_eq!(turns[0].class, RecordedClass::Proc, "{:?}", turns[0].reasons);
    let at_checkpoint = sb.exec_in(&sb.id.clone(), "cat /data/counter").await;
    let (secret, count) = at_checkpoint.trim().split_once(' ').unwrap();
    let count: u64 = count.parse().unwrap();

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = sb.exec_in(&sb.id.clone(), "cat /data/counter").await;
    let (secret_after, count_after) = later.trim().split_once(' ').unwrap();
    assert_eq!(secret_after, secret, "the shell's memory came back");
    let count_after: u64 = count_after.parse().unwrap();
    assert!(count_after > 3, "the counter runs again: {later}");
    // It continues from the checkpointed value instead of starting over (a
    // restart would be near 1..5 after 0.5 s).
    assert!(count_after + 10 >= count, "counter went from {count} back to {count_after}");
    // Execs go through the restored spawner: the shim knows its key, kept beside the images.
    let parent = sb.exec_in(&sb.id.clone(), "cat /proc/$PPID/comm").await;
    assert_eq!(parent.trim(), "crab-spawner", "the parent of an exec after recover");
    // No TCP connection was dumped: neither the dump nor the restore locked the network
    // (iptables-restore at lock and unlock, about 90 ms of each dump here).
    assert_eq!(sb.dump_network_lock(turns[0].turn), NetworkLockRecorded::Skip);
}

/// The pid namespace's next pid is sandbox state: a process started after a recovery gets the
/// pid it got without the fault (a server's pid shows in `ss -p`, `$!`, its pid file). CRIU
/// restores every pid but not the namespace's cursor, which then starts from the lowest free pid.
/// Turns after the dump move it on: a file turn (its manifest keeps where its forks left it) and
/// clean turns (their records do), so a recovery of either sets the cursor past their forks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_sandbox_hands_out_the_pids_it_would_have() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-nextpid").await;
    // Pids used up before and after a process that outlives the turn (the turn dumps).
    sb.turn(
        "for i in $(seq 20); do /bin/true; done; sleep 100000 >/dev/null 2>&1 & for i in $(seq 20); do /bin/true; done",
    )
    .await;
    let turns = sb.settled().await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{turns:?}");
    // A file turn after the dump uses up more; its last child's pid is the newest one.
    let last = sb.turn("for i in $(seq 30); do /bin/true; done; echo x > /f; /bin/true & echo $!; wait").await;
    let last: u32 = last.trim().parse().unwrap_or_else(|e| panic!("the last child's pid: {last:?}: {e}"));
    let turns = sb.settled().await;
    assert_eq!((turns[1].class, turns[1].next_pid), (RecordedClass::Fs, Some(last + 1)), "{turns:?}");
    // Builtins only: no pid of the namespace is used to look (pid 1 is the entrypoint's sleep).
    let find_sleeper = "for p in /proc/[0-9]*; do read c < $p/comm 2>/dev/null; [ \"$c\" = sleep ] && [ ${p#/proc/} != 1 ] && echo ${p#/proc/}; done; true";

    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(2));
    // The turn's one fork (the exec's shell) gets the pid after the file turn's last.
    let again: u32 = sb.exec_in(&sb.id.clone(), "sh -c 'echo $$'").await.trim().parse().unwrap();
    assert_eq!(again, last + 1, "the recovered namespace's next pid, from the file turn's manifest");

    // Clean turns (each forks its shell) move it on too, with no checkpoint of their own.
    let sleeper = sb.exec_in(&sb.id.clone(), find_sleeper).await;
    let sleeper_pid: u32 = sleeper.trim().parse().unwrap_or_else(|e| panic!("one sleeper: {sleeper:?}: {e}"));
    assert!(last > sleeper_pid + 10, "pids after the sleeper were used: {last}, {sleeper}");
    let first: u32 = sb.exec_in(&sb.id.clone(), "sh -c 'echo $$'").await.trim().parse().unwrap();
    assert!(first > again, "{first} after {again}");
    let turns = sb.settled().await;
    let newest = turns.last().unwrap();
    assert_eq!(
        (newest.class, newest.checkpoint_turn, newest.next_pid),
        (RecordedClass::Clean, Some(2), Some(first + 1))
    );
    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(2));
    let after_clean: u32 = sb.exec_in(&sb.id.clone(), "sh -c 'echo $$'").await.trim().parse().unwrap();
    assert_eq!(after_clean, first + 1, "the recovered namespace's next pid, from the clean turns' records");
    assert_eq!(sb.exec_in(&sb.id.clone(), find_sleeper).await, sleeper, "the sleeper came back with its pid");
}

/// A process that dropped root (as a server's workers do) is in the checkpoint and comes back
/// as the same user. Reading another user's rlimits needs CAP_SYS_RESOURCE, which this host
/// withholds from root: the dump reads them from /proc instead (scripts/patches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_of_another_user_is_checkpointed_and_comes_back() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-user").await;
    sb.turn("mkdir -p /data && chmod 777 /data; su -s /bin/sh -c 'i=0; while :; do i=$((i+1)); echo \"$(id -u) $i\" > /data/u.tmp && mv /data/u.tmp /data/u; sleep 0.1; done' nobody >/dev/null 2>&1 &").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    sb.turn("cat /data/u").await;
    let turns = sb.turns(2).await;
    assert_eq!(turns[0].class, RecordedClass::Proc, "{:?}", turns[0].reasons);
    assert_eq!(turns[0].checkpoint_turn, Some(1), "turn 1 has its own checkpoint: {:?}", turns[0].reasons);
    let before = sb.exec_in(&sb.id.clone(), "cat /data/u").await;
    let (uid, count) = before.trim().split_once(' ').unwrap();
    assert_eq!(uid, "65534", "{before}");
    let count: u64 = count.parse().unwrap();

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = sb.exec_in(&sb.id.clone(), "cat /data/u; ps -o user,args | grep -c '^nobody.*while'").await;
    let mut lines = after.lines();
    let (uid_after, count_after) = lines.next().unwrap().split_once(' ').unwrap();
    assert_eq!(uid_after, "65534", "{after}");
    assert!(
        count_after.parse::<u64>().unwrap() + 10 >= count,
        "the loop continues from its value: {before} then {after}"
    );
    // Its `$(id -u)` forks a subshell with the same command line now and then: one or two.
    let loops: u32 = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    assert!(loops >= 1, "the loop runs as nobody after the restore: {after}");
}

/// A process holding both ends of an established loopback TCP connection and a POSIX lock:
/// the dump takes them (`--tcp-established`, `--file-locks`), and so must the restore, or CRIU
/// refuses the images. After recover the connection still carries data and the lock is held.
const PEER: &str = r#"
import fcntl, os, socket, time
lock = open("/data/lock", "w")
fcntl.lockf(lock, fcntl.LOCK_EX)
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 7070))
server.listen(1)
client = socket.create_connection(("127.0.0.1", 7070))
conn, _ = server.accept()
open("/data/ready", "w").write("ready")
while True:
    if os.path.exists("/data/ping"):
        message = open("/data/ping").read().strip()
        os.remove("/data/ping")
        client.sendall(message.encode())
        answer = conn.recv(100).decode()
        open("/data/pong.tmp", "w").write(f"{answer} over the connection of pid {os.getpid()}")
        os.rename("/data/pong.tmp", "/data/pong")
    time.sleep(0.05)
"#;

/// Waits (up to 5 s) for a file in the sandbox and prints it.
const AWAIT_PONG: &str = "for i in $(seq 100); do [ -f /data/pong ] && break; sleep 0.05; done; cat /data/pong";

/// Succeeds (prints "free") only if nobody holds the lock.
const TRY_LOCK: &str = "python3 -c 'import fcntl; f = open(\"/data/lock\", \"w\"); fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB); print(\"free\")' 2>&1 | tail -1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_tcp_connection_and_a_file_lock_come_back() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start_image("rs-tcp", TERMINAL_IMAGE, &[], state_dir()).await;
    sb.turn(&format!("mkdir -p /data && cat > /data/peer.py <<'EOF'\n{PEER}\nEOF\npython3 /data/peer.py >/data/peer.log 2>&1 &\nfor i in $(seq 100); do [ -f /data/ready ] && break; sleep 0.05; done")).await;
    sb.turn(&("echo before > /data/ping; ".to_string() + AWAIT_PONG)).await;
    let turns = sb.turns(2).await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{:?}", turns[0]);
    let before = sb.exec_in(&sb.id.clone(), "cat /data/pong; rm /data/pong").await;
    assert!(before.starts_with("before over the connection"), "{before}");
    assert!(
        sb.exec_in(&sb.id.clone(), TRY_LOCK).await.contains("Resource temporarily unavailable"),
        "the peer holds the lock"
    );
    let settled = sb.settled().await;
    let last = settled.last().unwrap();
    assert!(last.checkpoint_turn.is_some(), "{settled:?}");

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    let after = sb.exec_in(&sb.id.clone(), &("echo after > /data/ping; ".to_string() + AWAIT_PONG)).await;
    let pid = before.trim().rsplit(' ').next().unwrap();
    assert_eq!(
        after.trim(),
        format!("after over the connection of pid {pid}"),
        "the restored peer answers over its connection"
    );
    let lock = sb.exec_in(&sb.id.clone(), TRY_LOCK).await;
    assert!(lock.contains("Resource temporarily unavailable"), "the restored peer holds its lock again: {lock}");
    // A connection was dumped: the network was locked around the dump and the restore.
    assert_eq!(sb.dump_network_lock(turns[0].turn), NetworkLockRecorded::Iptables);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_puts_back_files_in_place_and_processes_by_restore() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-rb").await;
    sb.turn("mkdir -p /data && for i in 1 2 3 4 5 6 7 8 9 10; do echo v1-$i > /data/f$i; done").await;
    let v1 = sb.exec_in(&sb.id.clone(), FINGERPRINT).await;
    sb.turn("for i in 1 2 3 4 5 6 7 8 9 10; do echo v2-$i > /data/f$i; done; rm /data/f3; echo x > /data/new").await;
    // No waiting here: rollback itself waits for the turn's checkpoint.
    let report = sb.ctl().rollback(&sb.id, 1).await.unwrap();
    assert_eq!(report.mode, "in-place");
    assert_eq!(sb.exec_in(&sb.id.clone(), FINGERPRINT).await, v1);
    // The sandbox keeps working and checkpointing after the rollback.
    sb.turn("echo v3 > /data/f1").await;
    sb.turn("sleep 600 >/dev/null 2>&1 &").await;
    let turns = sb.settled().await;
    assert_eq!(turns.last().unwrap().class, RecordedClass::Proc);
    // Back past a process turn: the container is recreated from the checkpoint.
    let fs_turn = turns[turns.len() - 2].turn;
    let report = sb.ctl().rollback(&sb.id, fs_turn).await.unwrap();
    assert_eq!(report.mode, "restore");
    let ps = sb.exec_in(&sb.id.clone(), "ps").await;
    assert!(!ps.contains("sleep 600"), "the later process is gone: {ps}");
    assert_eq!(sb.exec_in(&sb.id.clone(), "cat /data/f1").await, "v3\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_forks_of_one_turn_diverge() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-fork").await;
    sb.turn("mkdir -p /data && echo base > /data/shared").await;
    sb.turn("echo later > /data/later").await;
    sb.settled().await;
    let ctl = sb.ctl();
    let forks: Vec<String> = (0..4).map(|i| format!("{}-f{i}", sb.id)).collect();
    sb.extra.extend(forks.iter().cloned());
    for fork in &forks {
        ctl.fork(&sb.id, 1, fork).await.unwrap();
    }
    for (i, fork) in forks.iter().enumerate() {
        sb.exec_in(fork, &format!("echo fork-{i} > /data/own")).await;
    }
    for (i, fork) in forks.iter().enumerate() {
        let view = sb.exec_in(fork, "cat /data/shared /data/own; ls /data").await;
        assert_eq!(view, format!("base\nfork-{i}\nown\nshared\n"), "fork {fork}");
    }
    assert_eq!(sb.exec_in(&sb.id.clone(), "ls /data").await, "later\nshared\n", "the source is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_after_the_shim_is_killed() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-shim").await;
    sb.turn("mkdir -p /data && echo precious > /data/p && chmod 600 /data/p").await;
    sb.settled().await;
    let before = sb.exec_in(&sb.id.clone(), FINGERPRINT).await;
    let pid = sb.ctr.run(&["tasks", "ls"]).await.unwrap().stdout_text();
    let task_pid: u32 = pid
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{} ", sb.id)).and_then(|r| r.split_whitespace().next()?.parse().ok()))
        .unwrap();
    let status = std::fs::read_to_string(format!("/proc/{task_pid}/status")).unwrap();
    let shim: i32 = status.lines().find_map(|l| l.strip_prefix("PPid:")).unwrap().trim().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim), nix::sys::signal::Signal::SIGKILL).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(sb.exec_in(&sb.id.clone(), FINGERPRINT).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_refused_with_its_name() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-bad").await;
    let token = format!("unique-{}-{:?}", std::process::id(), std::time::SystemTime::now());
    sb.turn(&format!("mkdir -p /data && echo '{token}' > /data/only-here")).await;
    sb.settled().await;
    let ctl = sb.ctl();
    assert!(ctl.verify(Some(&sb.id)).unwrap()[0].ok);
    // The blob holding this file's content is ours alone: corrupt it.
    let digest = crab_store::Digest::of(format!("{token}\n").as_bytes());
    // Where its bytes are: its own file, or its place in a pack (flipped in place there).
    match ctl.store.blobs().location(&digest).unwrap() {
        crab_store::BlobLocation::File(path) => std::fs::write(&path, b"garbage").unwrap(),
        crab_store::BlobLocation::Packed { pack, offset, .. } => {
            use std::os::unix::fs::{FileExt, PermissionsExt};
            std::fs::set_permissions(&pack, std::fs::Permissions::from_mode(0o600)).unwrap();
            let file = std::fs::OpenOptions::new().read(true).write(true).open(&pack).unwrap();
            let mut first = [0u8; 1];
            file.read_exact_at(&mut first, offset).unwrap();
            file.write_all_at(&[first[0] ^ 0xff], offset).unwrap();
        }
    }
    let rows = ctl.verify(Some(&sb.id)).unwrap();
    assert!(!rows[0].ok);
    let error = rows[0].error.clone().unwrap();
    assert!(error.contains(&digest.to_hex()[..12]), "{error}");
    let fork = format!("{}-f", sb.id);
    sb.extra.push(fork.clone());
    let refused = ctl.fork(&sb.id, 1, &fork).await;
    assert!(refused.is_err(), "a fork from a corrupted checkpoint must fail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_writes_the_whole_checkpoint_again_without_dedup() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start_with("rs-every", &["--annotation", "io.crab.policy=every-turn"]).await;
    sb.turn("mkdir -p /data && head -c 300000 /dev/urandom > /data/blob").await;
    sb.turn("true").await;
    let turns = sb.settled().await;
    for t in &turns {
        assert_eq!((t.class, t.checkpoint_turn), (RecordedClass::Proc, Some(t.turn)), "{t:?}");
    }
    // Turn 2 changed nothing, yet writes as much as turn 1: the same dump and rootfs diff again.
    let (first, second) = (turns[0].bytes_written, turns[1].bytes_written);
    assert!(first > 300_000, "{turns:?}");
    assert!(second.abs_diff(first) < first / 5, "turn 1 wrote {first} B, turn 2 {second} B");
    let full = state_dir().join("full").join(sb.ctr.namespace()).join(&sb.id);
    let latest = full.join("turn-2");
    assert!(latest.join("criu/inventory.img").is_file(), "a plain CRIU image directory");
    assert!(!full.join("turn-1").exists(), "only the newest is kept");
    // Read before the next exec: its own checkpoint replaces this one.
    let copied =
        std::process::Command::new("sh").arg("-c").arg("md5sum < rw/data/blob").current_dir(&latest).output().unwrap();
    let in_container = sb.exec_in(&sb.id.clone(), "md5sum < /data/blob").await;
    assert_eq!(String::from_utf8_lossy(&copied.stdout), in_container, "the rootfs diff holds the file");
    // Nothing went through the deduplicating store.
    assert_eq!(sb.ctl().store.head(&sb.ctl().key(&sb.id).unwrap()).unwrap(), None);
}

/// A sandbox run with its own crab config (`--runtime-config-path`) keeps it when crabctl
/// recreates it: the restored shim must read the same store, not the default one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_keeps_the_sandboxs_own_config_path() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (state, config) = own_config(dir.path(), "");
    let mut sb = Sandbox::start_in("rs-cfg", &["--runtime-config-path", config.to_str().unwrap()], state.clone()).await;
    sb.turn("mkdir -p /data && echo kept > /data/k").await;
    let turns = sb.settled().await;
    assert_eq!(turns[0].class, RecordedClass::Fs, "{turns:?}");
    assert!(
        sb.ctl().store.head(&sb.ctl().key(&sb.id).unwrap()).unwrap().is_some(),
        "the checkpoint is in the sandbox's own store"
    );

    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(1));
    assert_eq!(sb.exec_in(&sb.id.clone(), "cat /data/k").await, "kept\n");
    // The recreated sandbox goes on checkpointing into the same store.
    sb.turn("echo more > /data/m").await;
    let turns = sb.settled().await;
    assert_eq!(turns.last().unwrap().checkpoint_turn, Some(turns.last().unwrap().turn), "{turns:?}");
}

/// A process that holds a deleted file open (a temporary file, a library `pip install -U`
/// replaced under a running interpreter) makes it a "ghost" that every dump must carry; CRIU
/// refuses ghosts over 1 MiB by default and fails the whole dump. The shim's CRIU config
/// raises the limit: the checkpoint is taken, and after recover the process reads the same
/// bytes through its descriptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_file_held_open_is_checkpointed_and_comes_back() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-ghost").await;
    sb.turn("mkdir -p /data && head -c 4000000 /dev/urandom > /data/big && md5sum < /data/big > /data/sum && (exec 3</data/big; rm /data/big; exec sleep 100000) >/dev/null 2>&1 &").await;
    let turns = sb.settled().await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{:?}", turns[0]);
    // The process's descriptor, read from the host side.
    let held = "for p in /proc/[0-9]*; do [ \"$(cat $p/cmdline | tr '\\0' ' ')\" = 'sleep 100000 ' ] && md5sum < $p/fd/3; done";

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    let after = sb.exec_in(&sb.id.clone(), &format!("cat /data/sum; {held}; ls /data")).await;
    let lines: Vec<&str> = after.lines().collect();
    assert_eq!(lines.len(), 3, "{after}");
    assert_eq!(lines[0], lines[1], "the restored process reads the deleted file's bytes: {after}");
    assert_eq!(lines[2], "sum", "the file stays deleted: {after}");
}

/// Without crabd the shim loads BPF programs of its own, and a restore does not wait for that:
/// the engine attaches behind Start's reply. The first exec after the restore waits for it
/// instead, so its turn is recorded, classified from what the inspector saw, and checkpointed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_turn_after_a_restore_without_crabd_is_recorded() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (state, config) = own_config(dir.path(), "");
    let mut sb =
        Sandbox::start_in("rs-first", &["--runtime-config-path", config.to_str().unwrap()], state.clone()).await;
    sb.turn("sleep 100000 >/dev/null 2>&1 &").await;
    let turns = sb.settled().await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{turns:?}");

    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(1));
    // At once, while the restored shim may still be loading its inspector.
    sb.turn("mkdir -p /data && echo first > /data/first").await;
    let turns = sb.settled().await;
    let first = turns.last().unwrap();
    assert_eq!((first.turn, first.checkpoint_turn), (2, Some(2)), "{turns:?}");
    assert_ne!(first.class, RecordedClass::Clean, "the inspector missed the turn's write: {turns:?}");
    let (_, manifest) = sb.ctl().store.manifest_at(&sb.ctl().key(&sb.id).unwrap(), 2).unwrap();
    assert!(
        manifest.fs_delta.iter().any(|e| e.path.to_string() == "/data/first"),
        "turn 2's checkpoint holds its file: {:?}",
        manifest.fs_delta.iter().map(|e| e.path.to_string()).collect::<Vec<_>>()
    );
}

/// A new crab-init installed while sandboxes run (renamed over the old one, as an installer
/// does) must not break their checkpoints. Each container binds a copy of the build it started
/// with, pinned by sha256 under the store's `init/`; every dump names that build, and a restore
/// binds it again. Without the pin, CRIU met a replaced (deleted) binary under the dumped init
/// and the restore failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_survive_an_upgrade_of_crab_init() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("crab-init");
    std::fs::copy(crab_config::DEFAULT_INIT, &init)
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/test installs crab-init)", crab_config::DEFAULT_INIT));
    let (state, config) = own_config(dir.path(), &format!("init = \"{}\"\n", init.display()));
    let md5 = |bytes: &[u8]| {
        let out = std::process::Command::new("md5sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().unwrap().write_all(bytes)?;
                child.wait_with_output()
            });
        String::from_utf8(out.unwrap().stdout).unwrap().split_whitespace().next().unwrap().to_string()
    };
    let started_with = md5(&std::fs::read(&init).unwrap());

    let mut sb =
        Sandbox::start_in("rs-upgrade", &["--runtime-config-path", config.to_str().unwrap()], state.clone()).await;
    sb.turn("mkdir -p /data; (i=0; while :; do i=$((i+1)); echo $i > /data/c.tmp && mv /data/c.tmp /data/c; sleep 0.1; done) >/dev/null 2>&1 &").await;
    let turns = sb.settled().await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{turns:?}");

    let staged = dir.path().join("crab-init.new");
    let mut upgraded = std::fs::read(&init).unwrap();
    upgraded.extend_from_slice(b"another build");
    std::fs::write(&staged, &upgraded).unwrap();
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&staged, &init).unwrap();
    // Dumped after the upgrade.
    sb.turn("sleep 100000 >/dev/null 2>&1 &").await;
    let turns = sb.settled().await;
    assert_eq!((turns[1].class, turns[1].checkpoint_turn), (RecordedClass::Proc, Some(2)), "{turns:?}");
    let counted = sb.exec_in(&sb.id.clone(), "cat /data/c").await;

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    let sleeping =
        "for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline)\" = 'sleep 100000 ' ] && echo sleeping; done; true";
    let after = sb.exec_in(&sb.id.clone(), &format!("md5sum < /dev/.crab/init; {sleeping}")).await;
    let lines: Vec<&str> = after.lines().collect();
    assert_eq!(lines.len(), 2, "{after}");
    assert_eq!(
        lines[0].split_whitespace().next(),
        Some(started_with.as_str()),
        "the restore binds the build the dump ran"
    );
    assert_eq!(lines[1], "sleeping", "turn 2's process is back: {after}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let count: u64 = sb.exec_in(&sb.id.clone(), "cat /data/c").await.trim().parse().unwrap();
    let before: u64 = counted.trim().parse().unwrap();
    assert!(count >= before, "the counter continues from its checkpointed value: {before} then {count}");
    let pins: Vec<_> = std::fs::read_dir(state.join("init")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(pins.len(), 1, "only the build in use is pinned: {pins:?}");
}

/// Descriptors of `pid` above stdio: (number, what it is, close-on-exec).
fn descriptors_above_stdio(pid: u32) -> Vec<(u32, String, bool)> {
    let mut fds = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let Ok(fd) = entry.unwrap().file_name().to_string_lossy().parse::<u32>() else { continue };
        if fd <= 2 {
            continue;
        }
        // A descriptor may close between the listing and these reads.
        let Ok(target) = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")) else { continue };
        let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")) else { continue };
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
            .unwrap();
        fds.push((fd, target.to_string_lossy().into_owned(), flags & libc::O_CLOEXEC as u32 != 0));
    }
    fds
}

/// Inodes of the unix sockets bound at `path` (the listener and its accepted connections).
fn unix_socket_inodes(path: &str) -> Vec<u64> {
    std::fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields.len() >= 8 && fields[7] == path).then(|| fields[6].parse().unwrap())
        })
        .collect()
}

/// What is wrong with `pid`'s descriptors: one it did not open itself (inherited: only
/// those lacking close-on-exec survive an exec), or one on the sockets `forbidden`.
fn descriptor_faults(pid: u32, forbidden: &[u64]) -> Vec<String> {
    descriptors_above_stdio(pid)
        .into_iter()
        .filter(|(_, target, cloexec)| !cloexec || forbidden.iter().any(|i| *target == format!("socket:[{i}]")))
        .map(|(fd, target, cloexec)| {
            format!("fd {fd} -> {target}{}", if cloexec { "" } else { " (not close-on-exec)" })
        })
        .collect()
}

/// The `-socket` address a running shim serves, as a path.
fn shim_socket(shim: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{shim}/cmdline")).unwrap();
    let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let address = args
        .iter()
        .skip_while(|a| *a != "-socket")
        .nth(1)
        .unwrap_or_else(|| panic!("shim {shim}: no -socket in {args:?}"));
    address.strip_prefix("unix://").unwrap_or(address).to_string()
}

async fn task_pid(sb: &Sandbox) -> u32 {
    task_pid_of(sb, &sb.id).await
}

fn parent_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("PPid:")).unwrap().trim().parse().unwrap()
}

/// A sandbox whose shim started a crabd of its own: on drop the sandbox goes first (its shim
/// would start crabd again), then that crabd is SIGTERMed.
struct WithCrabd {
    sandbox: Option<Sandbox>,
    crabd: u32,
}

impl WithCrabd {
    fn sb(&mut self) -> &mut Sandbox {
        self.sandbox.as_mut().expect("the sandbox until drop")
    }
}

impl Drop for WithCrabd {
    fn drop(&mut self) {
        drop(self.sandbox.take());
        if self.crabd > 0 {
            // SAFETY: kill(2) of the crabd this test's sandbox started (0 would be our process group).
            unsafe { libc::kill(self.crabd as i32, libc::SIGTERM) };
        }
    }
}

/// A shim that started crabd (`[node] spawn = true`) and is then SIGKILLed with its sandbox
/// must not leave its ttrpc socket open in crabd: containerd's next start for the same shim
/// address found it answering (crabd held the listener, accepting nothing), took the dead
/// shim for a live one and its Create waited forever. crabd holds no descriptor it did not
/// open itself, and recover finishes within its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_does_not_hang_when_the_killed_shim_had_started_crabd() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (state, config, crabd_socket) =
        (dir.path().join("state"), dir.path().join("crab.toml"), dir.path().join("node/crabd.sock"));
    std::fs::write(
        &config,
        format!(
            "[runtime]\nroot = \"{}\"\n[checkpoint]\nstate_dir = \"{}\"\nkept_images_dir = \"{}\"\n[node]\nsocket = \"{}\"\nspawn = true\n",
            dir.path().join("runc").display(),
            state.display(),
            dir.path().join("kept").display(),
            crabd_socket.display()
        ),
    )
    .unwrap();
    let sb = Sandbox::start_in("rs-crabd", &["--runtime-config-path", config.to_str().unwrap()], state).await;
    let mut guard = WithCrabd { sandbox: Some(sb), crabd: 0 };
    let sb = guard.sb();
    sb.turn("mkdir -p /data && echo kept > /data/k").await;
    let turns = sb.settled().await;
    assert_eq!(turns[0].class, RecordedClass::Fs, "{turns:?}");
    let crabd = crab_node::status_report(&crabd_socket).await.expect("the shim started crabd on its own socket").pid;
    guard.crabd = crabd;
    let sb = guard.sb();
    let init = task_pid(sb).await;
    let shim = parent_of(init);
    let socket = shim_socket(shim);
    let shim_sockets = unix_socket_inodes(&socket);
    assert!(!shim_sockets.is_empty(), "no socket bound at {socket}");
    let faults_before_kill = descriptor_faults(crabd, &shim_sockets);

    for pid in [shim, init] {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    for _ in 0..400 {
        if !std::path::Path::new(&format!("/proc/{shim}")).exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(!std::path::Path::new(&format!("/proc/{shim}")).exists(), "shim {shim} still there 10 s after SIGKILL");

    // A recover takes seconds; bounded well below ctr's own 120 s.
    let recovered = tokio::time::timeout(Duration::from_secs(60), sb.ctl().recover(&sb.id, None)).await;
    let report = match recovered {
        Ok(report) => report.unwrap(),
        Err(_) => panic!(
            "recover of {} did not finish within 60 s; crabd {crabd} held {faults_before_kill:?} of the killed shim's socket {socket} ({shim_sockets:?})",
            sb.id
        ),
    };
    assert_eq!(report.checkpoint_turn, Some(1));
    assert_eq!(sb.exec_in(&sb.id.clone(), "cat /data/k").await, "kept\n");
    assert_eq!(faults_before_kill, Vec::<String>::new(), "crabd {crabd} while the first shim ran ({socket})");
    // The recreated sandbox's shim uses the same crabd, which holds neither shim's socket.
    let new_shim = parent_of(task_pid(sb).await);
    assert_ne!(new_shim, shim);
    let new_sockets = unix_socket_inodes(&shim_socket(new_shim));
    let forbidden: Vec<u64> = shim_sockets.iter().chain(&new_sockets).copied().collect();
    assert_eq!(crab_node::status_report(&crabd_socket).await.unwrap().pid, crabd, "crabd was not restarted");
    assert_eq!(descriptor_faults(crabd, &forbidden), Vec::<String>::new(), "crabd {crabd} after the recover");
    assert_eq!(descriptor_faults(new_shim, &[]), Vec::<String>::new(), "the recreated shim {new_shim}");
}

/// runc, except that `checkpoint` fails as a freeze under load does ("unable to freeze" in
/// runc's JSON log, exit 1) while the count in `fails` is above zero; each failure takes one.
fn freeze_failing_runc(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let runc = ["/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file())
        .expect("runc installed");
    let fails = dir.join("fails");
    std::fs::write(&fails, "0").unwrap();
    let wrapper = dir.join("runc-failing-freeze");
    std::fs::write(
        &wrapper,
        format!(
            r#"#!/bin/sh
log=; prev=; verb=
for a in "$@"; do
  [ "$prev" = --log ] && log=$a
  [ "$a" = checkpoint ] && verb=checkpoint
  prev=$a
done
if [ "$verb" = checkpoint ]; then
  n=$(cat {fails})
  if [ "$n" -gt 0 ]; then
    echo $((n - 1)) > {fails}
    echo '{{"level":"error","msg":"unable to freeze","time":"2026-01-01T00:00:00Z"}}' >> "$log"
    exit 1
  fi
fi
exec {runc} "$@"
"#,
            fails = fails.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    (wrapper, fails)
}

/// A dump whose freeze fails is tried again (bounded) before the turn's checkpoint is given
/// up: two failures then a success checkpoint the turn; three failures carry its processes
/// into the next turn's dump. Every failed attempt's cause is in the turn record and in
/// `crabctl turns`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_freeze_is_retried_and_each_cause_recorded() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (wrapper, fails) = freeze_failing_runc(dir.path());
    let (state, config) = own_config(dir.path(), &format!("binary = \"{}\"\n", wrapper.display()));
    let mut sb =
        Sandbox::start_in("rs-freeze", &["--runtime-config-path", config.to_str().unwrap()], state.clone()).await;

    std::fs::write(&fails, "2").unwrap();
    sb.turn("sleep 1001 >/dev/null 2>&1 &").await;
    let turns = sb.turns(1).await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{turns:#?}");
    assert_eq!(turns[0].dump_failures.len(), 2, "{turns:#?}");
    assert!(turns[0].dump_failures.iter().all(|f| f.contains("unable to freeze")), "{turns:#?}");

    // More failures than attempts: not checkpointed, carried into the next turn's dump.
    std::fs::write(&fails, "3").unwrap();
    sb.turn("sleep 1002 >/dev/null 2>&1 &").await;
    let turns = sb.turns(2).await;
    assert_eq!((turns[1].class, turns[1].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{turns:#?}");
    assert_eq!(turns[1].dump_failures.len(), 3, "{turns:#?}");
    assert!(
        turns[1].reasons.iter().any(|r| r.starts_with("checkpoint failed") && r.contains("unable to freeze")),
        "{turns:#?}"
    );
    assert_eq!(std::fs::read_to_string(&fails).unwrap().trim(), "0", "three attempts, no more");
    sb.turn("true").await;
    let turns = sb.turns(3).await;
    assert_eq!(turns[2].checkpoint_turn, Some(3), "{turns:#?}");
    assert!(turns[2].dump_failures.is_empty(), "{turns:#?}");

    let table = std::process::Command::new(crab_integration::env::crab_binary("crabctl"))
        .args(["turns", &sb.id])
        .env("CRAB_STATE_DIR", &state)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("dump attempt 1 failed: ") && table.contains("dump attempt 3 failed: "), "{table}");

    // Turn 3's dump holds what turn 2 started.
    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(3));
    let ps = sb.exec_in(&sb.id.clone(), "ps -o args").await;
    assert!(ps.contains("sleep 1001") && ps.contains("sleep 1002"), "{ps}");
}

/// A CRIU config (named by the sandbox's `org.criu.config` annotation, which crab leaves to the
/// user) whose action script hangs a dump while `hang` exists: at `network-lock`, when CRIU has
/// frozen the sandbox's cgroup and seized every process, it writes its pid to `reached` and
/// sleeps, deaf to SIGALRM (so only CRIU's own timeout path, or the kill, ends the dump).
fn hanging_criu(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let (hang, reached, script, conf) =
        (dir.join("hang"), dir.join("reached"), dir.join("criu-action.sh"), dir.join("criu-hang.conf"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = network-lock ] && [ -e {hang} ] || exit 0\ntrap '' ALRM\necho $$ > {reached}\nexec sleep 600\n",
            hang = hang.display(),
            reached = reached.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(&conf, format!("action-script {}\n", script.display())).unwrap();
    (hang, reached, conf)
}

/// A process of the sandbox, as the host sees it: whether it is frozen or traced, and whether
/// a CRIU parasite (compel's memfd) is still mapped into it.
fn leftovers_of_a_dump(pid: u32) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return found };
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).unwrap_or("").trim().to_string();
    if field("TracerPid:") != "0" {
        found.push(format!("{pid} traced by {}", field("TracerPid:")));
    }
    let state = field("State:");
    if state.starts_with('t') || state.starts_with('T') || state.starts_with('D') {
        found.push(format!("{pid} in state {state}"));
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    if maps.contains("CRIUMFD") {
        found.push(format!("{pid} maps CRIU's parasite"));
    }
    found
}

fn freezer_state(pid: u32) -> String {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let file = match crab_runtime::freezer::freezer_of(&cgroups, &mountinfo).unwrap() {
        crab_runtime::freezer::Freezer::V1(f) | crab_runtime::freezer::Freezer::V2(f) => f,
    };
    std::fs::read_to_string(file).unwrap().trim().to_string()
}

/// containerd's own checkpoint (`ctr container checkpoint --task`, which pauses the task around
/// it) is bounded as a turn's dump is: a CRIU that hangs is abandoned at `dump_timeout_ms`, the
/// call fails naming the timeout, containerd resumes the task, and the sandbox keeps working.
/// Without the bound the call waited as long as CRIU did, holding the container's lifecycle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_containerd_checkpoint_fails_at_the_dump_timeout() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (hang, reached, criu_conf) = hanging_criu(dir.path());
    let (state, config) = own_config_with(dir.path(), "", "dump_timeout_ms = 2000\n");
    let annotation = format!("org.criu.config={}", criu_conf.display());
    let flags = [
        "--runtime-config-path",
        config.to_str().unwrap(),
        "--annotation",
        &annotation,
        "--annotation",
        "io.crab.policy=off",
    ];
    let mut sb = Sandbox::start_in("rs-hung-api", &flags, state).await;
    sb.turn("echo before > /tmp/before").await;

    std::fs::write(&hang, "").unwrap();
    let id = sb.id.clone();
    let reference = format!("crab.local/checkpoint/{id}:hung");
    let args: Vec<String> =
        ["container", "checkpoint", "--task", id.as_str(), reference.as_str()].iter().map(|a| a.to_string()).collect();
    let started = std::time::Instant::now();
    let out = sb.ctr.run_raw(&args, Duration::from_secs(40)).await;
    let waited = started.elapsed();
    std::fs::remove_file(&hang).unwrap();
    // The abandoned dump's action script is gone with CRIU; when a build without the bound
    // still hangs, ending the script lets CRIU finish, so the failure below is reported
    // instead of the clean-up waiting out its sleep.
    let script = std::fs::read_to_string(&reached).expect("CRIU never reached its network lock: the dump did not hang");
    let _ = std::process::Command::new("kill").args(["-9", script.trim()]).status();
    let out = out.expect("ctr ran");
    assert!(
        !out.timed_out && waited < Duration::from_secs(30),
        "the checkpoint returned after {waited:?}, not at its 2 s bound"
    );
    assert_ne!(out.code, Some(0), "a checkpoint whose CRIU hangs cannot succeed: {out:?}");
    let stderr = out.stderr_text();
    assert!(stderr.contains("timed out after 2000 ms"), "the error names the timeout: {stderr}");

    // Resumed by containerd, not traced, and working.
    let after = sb.exec_in(&id, "cat /tmp/before; echo after").await;
    assert_eq!(after, "before\nafter\n");
    let init = task_pid(&sb).await;
    assert_eq!(freezer_state(init), "THAWED");
    assert_eq!(leftovers_of_a_dump(init), Vec::<String>::new());
}

/// A CRIU dump that hangs (an action script that sleeps while CRIU holds the sandbox frozen)
/// is abandoned at `dump_timeout_ms`: the next exec returns promptly, the sandbox is thawed and
/// left as it was (its processes run, none traced or holding a parasite), the partial images
/// are gone, the turn is recorded as not checkpointed because the dump timed out (not retried),
/// and its processes are carried into the next turn, whose dump restores normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_dump_is_abandoned_and_the_sandbox_keeps_working() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (hang, reached, criu_conf) = hanging_criu(dir.path());
    let (state, config) = own_config_with(dir.path(), "", "dump_timeout_ms = 2000\n");
    let annotation = format!("org.criu.config={}", criu_conf.display());
    let flags = ["--runtime-config-path", config.to_str().unwrap(), "--annotation", &annotation];
    let mut sb = Sandbox::start_in("rs-hung", &flags, state.clone()).await;
    let init = task_pid(&sb).await;

    std::fs::write(&hang, "").unwrap();
    // A process turn: a ticker that keeps counting (busybox's date has no sub-second format,
    // so a count, not the time, shows it runs within half a second).
    // Written aside and renamed: a reader never sees the file truncated and not yet written
    // (the dump may seize the ticker between the two and hold it there for seconds).
    sb.turn("(n=0; while :; do n=$((n+1)); echo $n > /tmp/tick.new; mv /tmp/tick.new /tmp/tick; sleep 0.1; done) >/dev/null 2>&1 &")
        .await;
    let script = {
        let mut waited = 0;
        loop {
            if let Ok(pid) = std::fs::read_to_string(&reached).map(|p| p.trim().parse::<u32>().unwrap()) {
                break pid;
            }
            waited += 1;
            assert!(waited < 400, "the dump never reached network-lock: {:#?}", sb.ctl().turns(&sb.id).unwrap());
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };
    // CRIU holds the sandbox while its script sleeps: it froze the cgroup, seized every
    // process with ptrace and thawed the cgroup again, so the processes are stopped under
    // CRIU's trace (the freezer itself reads THAWED then).
    let tracer = std::fs::read_to_string(format!("/proc/{init}/status")).unwrap_or_default();
    assert!(
        tracer.lines().any(|l| l.starts_with("TracerPid:") && l.split_whitespace().nth(1) != Some("0")),
        "the init is not under CRIU's trace while the dump hangs: {tracer}"
    );
    // Later dumps do not hang; the one under way stays hung.
    std::fs::remove_file(&hang).unwrap();

    let started = std::time::Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(30), sb.turn("cat /tmp/tick"))
        .await
        .expect("the exec after a hung dump returns (it waited for the dump without bound)");
    let waited = started.elapsed();
    assert!(!out.trim().is_empty(), "{out:?}");
    assert!(waited < Duration::from_secs(10), "the exec after the hung dump took {waited:?}");

    // Thawed, and as it was: the ticker runs, nothing is traced or holds a parasite.
    assert_eq!(freezer_state(init), "THAWED");
    let first = sb.exec_in(&sb.id.clone(), "cat /tmp/tick").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = sb.exec_in(&sb.id.clone(), "cat /tmp/tick").await;
    assert_ne!(first, second, "the ticker stopped");
    let ps = sb.ctr.run(&["tasks", "ps", &sb.id]).await.unwrap().stdout_text();
    let pids: Vec<u32> = ps.lines().skip(1).filter_map(|l| l.split_whitespace().next()?.parse().ok()).collect();
    // The init and the ticker's subshell; the ticker's own child (mv, sleep) only most of the
    // time: between two of them, or frozen there by the next turn's dump, it has none. (The
    // spawner is the runtime's and not listed.)
    assert!(pids.len() >= 2 && pids.contains(&init), "the init and the ticker: {ps}");
    // A leftover of CRIU stays (a tracer, a stop, the parasite); a process of the ticker may
    // pass through D for a moment under load (its writes), so only what lasts 2 s counts.
    let mut leftovers: Vec<String> = pids.iter().flat_map(|p| leftovers_of_a_dump(*p)).collect();
    for _ in 0..20 {
        if leftovers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        leftovers = pids.iter().flat_map(|p| leftovers_of_a_dump(*p)).collect();
    }
    assert_eq!(leftovers, Vec::<String>::new(), "still there after 2 s");
    assert!(
        !std::path::Path::new(&format!("/proc/{script}")).exists()
            || std::fs::read_to_string(format!("/proc/{script}/stat")).unwrap_or_default().contains(") Z"),
        "CRIU's action script {script} outlived the abandoned dump"
    );

    // Turn 1: not checkpointed, because the dump timed out, tried once; turn 2 carries it.
    let turns = sb.turns(2).await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, None), "{turns:#?}");
    assert_eq!(turns[0].dump_failures.len(), 1, "a timed-out dump is not retried: {turns:#?}");
    assert!(
        turns[0]
            .reasons
            .iter()
            .any(|r| r.starts_with("checkpoint failed") && r.contains("dump timed out after 2000 ms")),
        "{turns:#?}"
    );
    let key = sb.ctl().key(&sb.id).unwrap();
    let partial = sb.ctl().store.dump_path(&key, 1).unwrap();
    assert!(!partial.exists(), "{} left behind", partial.display());
    // Turn 2 dumps the processes (the ticker runs through it, and turn 1's are carried).
    assert_eq!(turns[1].class, RecordedClass::Proc, "{turns:#?}");
    sb.published(2).await;
    let turns = sb.turns(2).await;
    assert_eq!(turns[1].checkpoint_turn, Some(2), "{turns:#?}");

    let table = std::process::Command::new(crab_integration::env::crab_binary("crabctl"))
        .args(["turns", &sb.id])
        .env("CRAB_STATE_DIR", &state)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("dump timed out after 2000 ms"), "{table}");

    // Turn 2's dump holds the ticker turn 1 started: it comes back and ticks.
    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert!(report.checkpoint_turn >= Some(2), "{report:?}");
    let before = sb.exec_in(&sb.id.clone(), "cat /tmp/tick").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = sb.exec_in(&sb.id.clone(), "cat /tmp/tick").await;
    assert_ne!(before, after, "the restored ticker does not run");
}

/// Content, mode and type of every file on the sandbox's tmpfs mounts (what the tests put
/// there) and under /data, one line each.
const TMPFS_FINGERPRINT: &str = "for d in /dev/shm /run/crab /dev/crab-dev /data; do [ -e $d ] || { echo \"$d absent\"; continue; }; cd $d && find . | sort | while read f; do stat -c \"$d/%n %a %F %s\" \"$f\"; [ -f \"$f\" ] && md5sum \"$f\"; [ -L \"$f\" ] && readlink \"$f\"; done; done; true";

/// The spec containerd gives a `ctr run` container: tmpfs at /dev and /dev/shm, and at /run.
async fn assert_spec_mounts_tmpfs(sb: &Sandbox) {
    let spec = sb.ctr.run(&["containers", "info", &sb.id]).await.unwrap().stdout_text();
    let info: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let tmpfs: Vec<&str> = info["Spec"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["type"] == "tmpfs")
        .filter_map(|m| m["destination"].as_str())
        .collect();
    for dest in ["/dev", "/dev/shm", "/run"] {
        assert!(tmpfs.contains(&dest), "containerd's spec mounts a tmpfs at {dest}: {tmpfs:?}");
    }
}

/// Writes to the sandbox's tmpfs mounts (/dev/shm, /run, /dev itself) in fs turns come back
/// with content and mode after the processes die, and a rollback in place to a turn before
/// them removes them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tmpfs_writes_of_fs_turns_come_back_and_roll_back() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-tmpfs-fs").await;
    assert_spec_mounts_tmpfs(&sb).await;
    sb.turn("mkdir -p /data && echo base > /data/base").await;
    // Turn 2 reads only: the state of turn 1 (its checkpoint may carry turn 1's paths when
    // turn 1's write-out was not durable yet).
    let at_turn1 = sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await;
    sb.turn("echo shm-one > /dev/shm/crab_shm.txt && chmod 640 /dev/shm/crab_shm.txt && mkdir -p /run/crab/sub && echo run-one > /run/crab/sub/f && chmod 600 /run/crab/sub/f && mkdir /dev/crab-dev && echo dev > /dev/crab-dev/x").await;
    sb.turn("echo two >> /dev/shm/crab_shm.txt && rm /run/crab/sub/f && echo g > /run/crab/g && ln /run/crab/g /run/crab/g2 && ln -s g /run/crab/sym").await;
    let turns = sb.turns(4).await;
    let classes: Vec<_> = turns.iter().map(|t| t.class).collect();
    assert_eq!([classes[0], classes[2], classes[3]], [RecordedClass::Fs; 3], "{turns:#?}");
    assert_ne!(classes[1], RecordedClass::Proc, "{turns:#?}");
    assert!(
        turns[2].reasons.iter().any(|r| r.contains("/dev/shm/crab_shm.txt")),
        "the inspector sees the write to /dev/shm: {:?}",
        turns[2].reasons
    );
    assert!(turns[2].reasons.iter().any(|r| r.contains("/run/crab")), "and to /run: {:?}", turns[2].reasons);
    let before = sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await;
    assert!(before.contains("/dev/shm/./crab_shm.txt 640 regular file 12"), "{before}");
    assert!(before.contains("/run/crab/./g2 644 regular file 2") && before.contains("/dev/crab-dev/./x"), "{before}");

    sb.kill_processes().await;
    let report = sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(report.checkpoint_turn, Some(4));
    let after = sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await;
    assert_eq!(after, before, "the tmpfs mounts come back exactly");

    // Back to turn 2, before anything was written to the tmpfs mounts: in place.
    let report = sb.ctl().rollback(&sb.id, 2).await.unwrap();
    assert_eq!(report.mode, "in-place");
    assert_eq!(sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await, at_turn1);
}

/// A proc turn's tmpfs state comes back with its processes (CRIU restores the mounts as at
/// the dump), and an fs turn after it is put on top; rolling back in place to the proc turn
/// undoes that fs turn on the tmpfs mounts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tmpfs_writes_of_a_proc_turn_and_a_later_fs_turn_come_back() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start("rs-tmpfs-proc").await;
    sb.turn("mkdir -p /data /run/crab && echo p > /dev/shm/p && chmod 604 /dev/shm/p && echo r > /run/crab/r && (sleep 600 >/dev/null 2>&1 &)").await;
    let turns = sb.turns(1).await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{:?}", turns[0]);
    // Turn 2 reads only: the state of turn 1 (its checkpoint may carry turn 1's).
    let at_proc = sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await;
    sb.turn("echo later > /dev/shm/later && rm /run/crab/r && echo more >> /dev/shm/p").await;
    let turns = sb.turns(3).await;
    assert_eq!(turns[2].class, RecordedClass::Fs, "{:?}", turns[2]);
    let before = sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await;
    assert!(
        before.contains("/dev/shm/./later")
            && before.contains("/dev/shm/./p 604 regular file 7")
            && !before.contains("/run/crab/./r "),
        "{before}"
    );

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    let after = sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await;
    assert_eq!(after, before, "CRIU's tmpfs of turn 1 and turn 3's changes on top");
    let ps = sb.exec_in(&sb.id.clone(), "ps").await;
    assert!(ps.contains("sleep 600"), "the process came back: {ps}");

    let report = sb.ctl().rollback(&sb.id, 2).await.unwrap();
    assert_eq!(report.mode, "in-place");
    assert_eq!(sb.exec_in(&sb.id.clone(), TMPFS_FINGERPRINT).await, at_proc, "back to the proc turn's tmpfs state");
}

/// An empty tmpfs keeps its root's mode, owner and time through a process dump: crab's CRIU
/// archives an empty tmpfs itself instead of running tar (scripts/patches), and must store
/// what tar stored. Both roots here are empty at the dump, one changed, one as mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_tmpfs_comes_back_with_its_roots_mode_owner_and_time() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    const ROOTS: &str = "stat -c '%n %a %u %g %Y %h' /dev/shm /run; ls -A /dev/shm /run";
    let mut sb = Sandbox::start("rs-tmpfs-empty").await;
    sb.turn(
        "chmod 1730 /dev/shm && chown 12:34 /dev/shm && touch -d @1700000000 /dev/shm && (sleep 600 >/dev/null 2>&1 &)",
    )
    .await;
    let turns = sb.turns(1).await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{:?}", turns[0]);
    let before = sb.exec_in(&sb.id.clone(), ROOTS).await;
    assert!(before.contains("/dev/shm 1730 12 34 1700000000 2"), "{before}");

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    let after = sb.exec_in(&sb.id.clone(), ROOTS).await;
    assert_eq!(after, before, "the empty tmpfs roots as they were at the dump");
    let ps = sb.exec_in(&sb.id.clone(), "ps").await;
    assert!(ps.contains("sleep 600"), "the process came back: {ps}");
}

/// A write on a bind mount crab does not own is external state: the turn record says so and
/// names the path, nothing of it is checkpointed, and a recover still succeeds (leaving the
/// host directory as it is, mounted again from the kept spec; see the README).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_on_a_foreign_bind_mount_is_recorded_as_external_and_recover_succeeds() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let shared = tempfile::tempdir().unwrap();
    let mount = format!("type=bind,src={},dst=/shared,options=rbind:rw", shared.path().display());
    let mut sb = Sandbox::start_with("rs-bind", &["--mount", &mount]).await;
    sb.turn("echo host > /shared/f && mkdir -p /data && echo own > /data/own").await;
    let turns = sb.turns(1).await;
    assert_eq!(turns[0].class, RecordedClass::Fs, "{:?}", turns[0]);
    assert!(turns[0].external, "{:?}", turns[0]);
    assert!(
        turns[0].reasons.iter().any(|r| r.contains("external state: /shared/f") && r.contains("/shared")),
        "{:?}",
        turns[0].reasons
    );
    let key = sb.ctl().key(&sb.id).unwrap();
    let head = sb.ctl().store.head(&key).unwrap().expect("turn 1 checkpointed");
    let (_, manifest) = sb.ctl().store.manifest_at(&key, head.turn).unwrap();
    let paths: Vec<String> = manifest.fs_delta.iter().map(|e| e.path.to_string()).collect();
    assert!(paths.iter().all(|p| !p.starts_with("/shared")) && paths.contains(&"/data/own".to_string()), "{paths:?}");

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(sb.exec_in(&sb.id.clone(), "cat /data/own").await, "own\n");
    assert_eq!(std::fs::read_to_string(shared.path().join("f")).unwrap(), "host\n", "the host's file is left alone");
    assert_eq!(sb.exec_in(&sb.id.clone(), "cat /shared/f").await, "host\n", "the bind mount is back");
}

/// What `ctr run` was given beyond image, command and environment (a bind mount, a capability
/// dropped, a memory limit, a label) is in the spec containerd keeps, and a recovered sandbox
/// and a fork keep all of it: crabctl creates them from that spec, not from the image. Each
/// fork gets a cgroup of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_and_fork_keep_the_whole_spec() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let host = tempfile::tempdir().unwrap();
    std::fs::write(host.path().join("marker"), "from the host\n").unwrap();
    let mount = format!("type=bind,src={},dst=/host,options=rbind:ro", host.path().display());
    let flags = [
        "--mount",
        &mount,
        "--cap-drop",
        "CAP_NET_RAW",
        "--memory-limit",
        "268435456",
        "--label",
        "io.crab.test=kept",
        "--env",
        "KEEP=kept",
    ];
    let mut sb = Sandbox::start_with("rs-spec", &flags).await;
    // A process turn: recover and fork restore processes (CRIU) as well as files.
    sb.turn("mkdir -p /data && echo v1 > /data/f && (sleep 3600 &) && echo ok").await;
    let turns = sb.settled().await;
    assert_eq!(turns[0].class, RecordedClass::Proc, "{:?}", turns[0]);
    const VIEW: &str =
        "cat /host/marker /data/f; grep CapBnd /proc/1/status; echo \"$KEEP\"; ps -o args | grep -c '^sleep 3600'";
    let id = sb.id.clone();
    let before = sb.exec_in(&id, VIEW).await;
    assert!(before.starts_with("from the host\nv1\nCapBnd:") && before.ends_with("\nkept\n2\n"), "{before}");
    let containerd = crab_containerd::grpc::Containerd::new(sb.ctr.socket(), sb.ctr.namespace());
    let label = |id: String| {
        let containerd = &containerd;
        async move {
            let record = containerd.container(&id).await.unwrap().unwrap_or_else(|| panic!("{id} is gone"));
            record.labels.get("io.crab.test").cloned()
        }
    };

    sb.kill_processes().await;
    sb.ctl().recover(&sb.id, None).await.unwrap();
    assert_eq!(sb.exec_in(&id, VIEW).await, before, "the recovered sandbox");
    assert_eq!(label(id.clone()).await.as_deref(), Some("kept"), "label of the recovered sandbox");
    // The recovered sandbox is checkpointed again, processes and all (CRIU dumps what it
    // restored: no descriptor of the host's in it).
    sb.turn("echo v2 > /data/f && (sleep 3601 &) && echo ok").await;
    let turns = sb.settled().await;
    let last = turns.last().unwrap();
    assert_eq!((last.class, last.checkpoint_turn), (RecordedClass::Proc, Some(last.turn)), "{last:?}");

    let fork = format!("{}-f", sb.id);
    sb.extra.push(fork.clone());
    sb.ctl().fork(&sb.id, 1, &fork).await.unwrap();
    assert_eq!(sb.exec_in(&fork, VIEW).await, before, "the fork");
    assert_eq!(label(fork.clone()).await.as_deref(), Some("kept"), "label of the fork");
    // Each in a memory cgroup of its own, with the limit (cgroup v1 here, read from the host).
    let memory = |pid: u32| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let path = text.lines().find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_string())).unwrap();
        let limit = std::fs::read_to_string(format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"));
        (path, limit.map(|l| l.trim().to_string()).unwrap_or_else(|e| e.to_string()))
    };
    let source = memory(task_pid(&sb).await);
    let forked = memory(task_pid_of(&sb, &fork).await);
    assert!(source.0.ends_with(&format!("/{id}")) && forked.0.ends_with(&format!("/{fork}")), "{source:?} {forked:?}");
    assert_eq!((source.1.as_str(), forked.1.as_str()), ("268435456", "268435456"), "memory limits");
}

/// A container whose restore fails at Start (its checkpoint's processes held a bind mount the
/// new container lacks, which CRIU refuses) is left created, with no process and no runtime
/// container: `ctr task delete -f` removes it (the shim's kill answers NotFound, which lets
/// containerd go on to Delete; it answered Unknown, and the task could not be removed), and its
/// shim goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_restore_failed_at_start_is_removed_by_delete_force() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let host = tempfile::tempdir().unwrap();
    let mount = format!("type=bind,src={},dst=/host,options=rbind:ro", host.path().display());
    let mut sb = Sandbox::start_with("rs-nostart", &["--mount", &mount]).await;
    sb.turn("(sleep 3600 &) && echo ok").await;
    let turns = sb.settled().await;
    assert_eq!((turns[0].class, turns[0].checkpoint_turn), (RecordedClass::Proc, Some(1)), "{:?}", turns[0]);

    let failed = format!("{}-r", sb.id);
    sb.extra.push(failed.clone());
    let restore_from = format!("io.crab.restore-from={}:1", sb.id);
    let leg = crab_integration::env::Runtime::parse("crab").expect("crab runtime").run_flags();
    let mut args: Vec<&str> = vec!["run", "-d"];
    args.extend(leg.iter().map(String::as_str));
    args.extend_from_slice(&["--annotation", &restore_from, IMAGE, &failed, "sleep", "3600"]);
    let run = sb.ctr.run(&args).await;
    assert!(run.is_err(), "the restore without the bind mount started: {run:?}");
    let tasks = sb.ctr.run(&["tasks", "ls"]).await.unwrap().stdout_text();
    assert!(tasks.lines().any(|l| l.starts_with(&format!("{failed} ")) && l.contains("CREATED")), "{tasks}");

    let deleted = sb.ctr.run(&["tasks", "delete", "--force", &failed]).await;
    assert!(deleted.is_ok(), "ctr task delete --force of the task left created: {deleted:?}");
    let tasks = sb.ctr.run(&["tasks", "ls"]).await.unwrap().stdout_text();
    assert!(!tasks.lines().any(|l| l.starts_with(&format!("{failed} "))), "{tasks}");
    sb.ctr.run(&["containers", "delete", &failed]).await.unwrap();
    // Its shim exits once its last task is deleted.
    for _ in 0..100 {
        if crab_integration::host::shim_daemons(sb.ctr.namespace(), &failed).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the shim of {failed} is still running 5 s after its task and container were deleted");
}

/// The init pid of container `id` of the sandbox's containerd namespace.
async fn task_pid_of(sb: &Sandbox, id: &str) -> u32 {
    let tasks = sb.ctr.run(&["tasks", "ls"]).await.unwrap().stdout_text();
    tasks
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{id} ")).and_then(|r| r.split_whitespace().next()?.parse().ok()))
        .unwrap_or_else(|| panic!("{id} has no task: {tasks}"))
}

/// A sandbox whose quota (`io.crab.max-sandbox-mib`) is smaller than what it writes: the turn
/// over it is recorded with why and the last recoverable turn (also in `crabctl turns`), its
/// checkpoint is not written, the sandbox is checkpointed again once it deletes the data, and
/// a restore of the turn before gives back that turn's files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_over_the_sandboxs_quota_is_recorded_and_the_earlier_turn_restores() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut sb = Sandbox::start_with("rs-quota", &["--annotation", "io.crab.max-sandbox-mib=1"]).await;
    sb.turn("mkdir -p /data && echo one > /data/a && head -c 300000 /dev/urandom > /data/small").await;
    // A turn's record is written once its checkpoint is.
    sb.settled().await;
    let v1 = sb.exec_in(&sb.id.clone(), FINGERPRINT).await;
    sb.turn("head -c 2000000 /dev/urandom > /data/big && echo two > /data/a").await;
    let turns = sb.settled().await;
    let over =
        turns.iter().find(|t| t.over_quota.is_some()).unwrap_or_else(|| panic!("no turn over quota: {turns:#?}"));
    assert_eq!((over.class, over.checkpoint_turn), (RecordedClass::Fs, Some(1)), "{over:#?}");
    let q = over.over_quota.unwrap();
    assert_eq!(q.quota_bytes, 1 << 20, "{over:#?}");
    assert!(q.used_bytes > 2_000_000 && q.held_bytes < 1 << 20, "{over:#?}");
    assert!(
        over.reasons
            .iter()
            .any(|r| r.contains("over quota: used ") && r.contains("turn 1 is its last recoverable turn")),
        "{over:#?}"
    );
    assert_eq!(sb.ctl().store.head(&sb.ctl().key(&sb.id).unwrap()).unwrap().map(|h| h.turn), Some(1));

    let table = std::process::Command::new(crab_integration::env::crab_binary("crabctl"))
        .args(["turns", &sb.id])
        .env("CRAB_STATE_DIR", &sb.state)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("over quota: used ") && table.contains("turn 1 is its last recoverable turn"), "{table}");

    // The data is gone again: the next turn (which takes the refused turn's paths in) fits.
    sb.turn("rm /data/big").await;
    let turns = sb.settled().await;
    let last = turns.last().unwrap();
    assert_eq!((last.over_quota, last.checkpoint_turn), (None, Some(last.turn)), "{turns:#?}");

    // Turn 1 restored into a new container: exactly its files.
    let fork = format!("{}-at1", sb.id);
    sb.extra.push(fork.clone());
    sb.ctl().fork(&sb.id, 1, &fork).await.unwrap();
    assert_eq!(sb.exec_in(&fork, FINGERPRINT).await, v1);
}

/// `crabctl gc --json` against the store at `state` (and the test's containerd).
fn crabctl_gc(state: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(crab_integration::env::crab_binary("crabctl"))
        .arg("gc")
        .args(args)
        .arg("--json")
        .env("CRAB_STATE_DIR", state)
        .output()
        .unwrap();
    assert!(out.status.success(), "crabctl gc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Checkpoints of a container containerd removed (CRI's RemoveContainer, `ctr c rm`) do not
/// stay forever: `crabctl gc` asks containerd which containers it has, keeps a removed one's
/// chain for `--keep-removed` seconds from the GC that first found it gone, then drops it with
/// its turn log and saved spec; a running sandbox's chain is left alone. The last GC is the
/// node's own, `shim-config/crab-gc.service` (which crab-gc.timer runs) as systemd runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_drops_a_removed_container_s_chain_after_its_retention_and_keeps_a_running_one() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let dir = tempfile::tempdir().unwrap();
    let (state, config) = own_config_with(dir.path(), "", "keep_removed_s = 0\n");
    let flags = ["--runtime-config-path", config.to_str().unwrap()];
    let mut gone = Sandbox::start_in("rs-gc-gone", &flags, state.clone()).await;
    gone.turn("echo gone > /g").await;
    gone.settled().await;
    let mut live = Sandbox::start_in("rs-gc-live", &flags, state.clone()).await;
    live.turn("echo live > /l").await;
    live.settled().await;
    let ctl = live.ctl();
    let (gone_key, live_key) = (ctl.key(&gone.id).unwrap(), ctl.key(&live.id).unwrap());
    assert!(ctl.store.head(&gone_key).unwrap().is_some());

    // Still there: nothing is judged gone.
    let report = crabctl_gc(&state, &["--keep-removed", "0"]);
    assert_eq!((report["removed_marked"].as_u64(), report["removed_dropped"].as_u64()), (Some(0), Some(0)), "{report}");

    gone.ctr.force_remove(&gone.id).await;
    let report = crabctl_gc(&state, &["--keep-removed", "3600"]);
    assert_eq!((report["removed_marked"].as_u64(), report["removed_dropped"].as_u64()), (Some(1), Some(0)), "{report}");
    assert!(ctl.store.head(&gone_key).unwrap().is_some(), "kept within the retention");

    // Without containerd's word nothing is dropped.
    let report = crabctl_gc(&state, &["--keep-removed", "0", "--no-containerd"]);
    assert_eq!(report["removed_dropped"].as_u64(), Some(0), "{report}");

    // The unit's command with what systemd gives it: the node's config (here the test's, with
    // keep_removed_s = 0), containerd's socket, no namespace, no state dir of its own.
    let unit =
        std::fs::read_to_string(crab_integration::remote::repo_root().join("shim-config/crab-gc.service")).unwrap();
    let exec_start = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("the unit's ExecStart");
    let argv: Vec<&str> = exec_start.split_whitespace().collect();
    assert_eq!(argv[..2], ["/usr/local/bin/crabctl", "gc"], "{exec_start}");
    let out = std::process::Command::new(crab_integration::env::crab_binary("crabctl"))
        .args(&argv[1..])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CRAB_CONFIG", &config)
        .env("CONTAINERD_ADDRESS", &crab_integration::env::TestEnv::get().socket)
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{exec_start}: {said}");
    let socket = crab_integration::env::TestEnv::get().socket.display().to_string();
    assert!(said.contains(&format!("0 newly found, 1 sandboxes dropped (containerd asked at {socket})")), "{said}");
    let blobs_removed: u64 = said
        .split_once(" manifests, ")
        .and_then(|(_, rest)| rest.split_once(" blobs"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no blob count in {said}"));
    assert!(blobs_removed >= 1, "its blobs were swept: {said}");
    assert_eq!(ctl.store.head(&gone_key).unwrap(), None, "the removed container's chain is gone");
    let gone_key = crab_store::SandboxKey::parse(&gone_key).unwrap();
    assert!(!crab_store::turn_log_path(&state, &gone_key).exists(), "its turn log too");
    assert!(!crab_store::saved_spec_path(&state, &gone_key).exists(), "its saved spec too");
    ctl.store.verify(&live_key, 1).unwrap();
    assert_eq!(live.exec_in(&live.id.clone(), "cat /l").await, "live\n");
}
