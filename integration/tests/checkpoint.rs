//! Checkpoint/restore through containerd with CRIU, under every runtime of CRAB_TEST_RUNTIMES.
//!
//! containerd 1.6's `ctr` offers `ctr container checkpoint [--task] [--rw] [--image]` (to an image),
//! `ctr container restore [--live] [--rw]`, and `ctr task checkpoint [--exit] [--image-path] [--work-path]`
//! (CRIU files in a directory, no restore counterpart in `ctr`). A checkpoint leaves the task running
//! unless `--exit` is given, so "leave running" is the default here. `ctr task checkpoint` forwards
//! `--image-path` and `--exit` only to runtimes named io.containerd.runc.*, so that call goes through
//! the Tasks API with runc's checkpoint options, as `ctr` sends them to runc.v2. containerd 1.6 itself
//! honours the image path only for io.containerd.runc.*: for other runtimes it also commits the
//! checkpoint to its content store (the harness deletes that copy), which fails while an earlier
//! checkpoint image of the same container holds its spec (see the TTY test).
//!
//! What io.containerd.runc.v2 itself cannot do, and is therefore not asserted:
//! - restoring a container that has a TTY: `ctr container restore --live` of a `-t` container fails
//!   with "cannot allocate tty if runc will detach without setting console socket" (the runc shim
//!   does not pass a console socket to `runc restore`), and leaves a CREATED task behind. Only the
//!   checkpoint of a TTY container is tested.

use std::path::Path;
use std::time::Duration;

use crab_integration::api::{TaskCheckpoint, checkpoint_task};
use crab_integration::{
    Container, EventStream, HarnessError, Outcome, PtySession, across_runtimes, ensure, ensure_eq, wait_until,
};

const SHORT: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(60);

/// Counts only after an exec hands it a token through `/go`, and keeps the token in shell memory.
/// A restored process that continues the count with the token proves its memory came back: a fresh
/// start would wait for `/go` forever (the file is gone from the checkpointed rootfs).
/// `/state` is replaced by a rename, never truncated in place, so that no reader (on the host, by
/// exec, or in a checkpointed rw layer frozen mid-write) can find it empty.
const TOKEN_COUNTER: &str = "while [ ! -f /go ]; do sleep 0.05; done; token=$(cat /go); rm /go; i=0; \
     while :; do i=$((i+1)); echo \"$token $i\" > /state.new; mv /state.new /state; echo tick $i; \
     sleep 0.05; done";

/// `(token, count)` from the counter's `/state`, read through the task's root on the host so that
/// reading needs no exec.
fn read_state(root_pid: u32) -> Option<(String, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{root_pid}/root/state")).ok()?;
    let (token, count) = text.trim().split_once(' ')?;
    Some((token.to_string(), count.parse().ok()?))
}

async fn count_at_least(container: &Container, minimum: u64) -> Outcome<(String, u64)> {
    let pid = container.init_pid().await?;
    wait_until(&format!("the counter of {} to reach {minimum}", container.id()), LONG, || async {
        match read_state(pid) {
            Some(state) => Ok(Some(state).filter(|(_, count)| *count >= minimum)),
            // Said on a time-out: what the counter was waiting for.
            None => {
                let exists = |path: String| if std::path::Path::new(&path).exists() { "present" } else { "absent" };
                let log = container.read_log();
                let tail: String = log.chars().rev().take(200).collect::<Vec<_>>().into_iter().rev().collect();
                Err(HarnessError::Expectation(format!(
                    "no /state: /proc/{pid} {}, /go {}, log ends {tail:?}",
                    exists(format!("/proc/{pid}")),
                    exists(format!("/proc/{pid}/root/go"))
                )))
            }
        }
    })
    .await
}

async fn start_token_counter(container: &Container, token: &str) -> Outcome<()> {
    container.start(&["sh", "-c", TOKEN_COUNTER]).await?;
    container.exec_ok("hand-token", &["sh", "-c", &format!("echo {token} > /go")]).await?;
    Ok(())
}

async fn image_exists(container: &Container, reference: &str) -> Outcome<bool> {
    let images = container.ctr().invoke(["image", "ls", "-q"]).success().await?;
    Ok(images.stdout.lines().any(|line| line.trim() == reference))
}

async fn remove_task_and_container(container: &Container) -> Outcome<()> {
    container.kill("SIGKILL", true).await?;
    container.wait_status("STOPPED", SHORT).await?;
    container.delete_task().await?;
    container.delete_container().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_with_pipes_leaves_running_then_restores_with_memory_and_rw_layer() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("checkpoint --task --rw, restore --live --rw", |runtime| async move {
        let original = Container::new(&runtime, "ckpt");
        let token = format!("token-{}", original.id());
        start_token_counter(&original, &token).await?;
        original.exec_ok("marker", &["sh", "-c", "echo written-before-checkpoint > /marker"]).await?;
        let (_, before) = count_at_least(&original, 10).await?;

        let reference = original.checkpoint_ref("live");
        original
            .ctr()
            .invoke(["container", "checkpoint", "--task", "--rw", original.id(), reference.as_str()])
            .timeout(LONG)
            .success()
            .await?;
        ensure!(image_exists(&original, &reference).await?, "checkpoint image {reference} was not created");

        // Leave-running: the same task goes on counting, and its piped stdout still reaches the log.
        let task = original.task().await?;
        ensure_eq!(task.as_ref().map(|t| t.status.as_str()), Some("RUNNING"), "status after checkpoint");
        let (_, after_checkpoint) = count_at_least(&original, before + 1).await?;
        let log_len = original.read_log().len();
        wait_until("the original's output to keep flowing after the checkpoint", SHORT, || async {
            Ok((original.read_log().len() > log_len).then_some(()))
        })
        .await?;
        remove_task_and_container(&original).await?;

        let restored = Container::new(&runtime, "ckpt-restored");
        restored
            .ctr()
            .invoke(["container", "restore", "--live", "--rw", restored.id(), reference.as_str()])
            .timeout(LONG)
            .success()
            .await?;
        restored.wait_status("RUNNING", SHORT).await?;
        let state = restored.exec_ok("after-restore", &["cat", "/state"]).await?;
        let (restored_token, restored_count) = state
            .trim()
            .split_once(' ')
            .and_then(|(t, c)| Some((t.to_string(), c.parse::<u64>().ok()?)))
            .ok_or_else(|| HarnessError::Parse { what: "/state after restore".into(), detail: state.clone() })?;
        ensure_eq!(restored_token, token, "token after restore");
        ensure!(restored_count >= before, "restored count {restored_count} is below the pre-checkpoint {before}");
        count_at_least(&restored, restored_count + 5).await?;
        let marker = restored.exec_ok("marker", &["cat", "/marker"]).await?;
        ensure_eq!(marker.trim(), "written-before-checkpoint", "rw layer file after restore");

        let listing = restored.ctr().invoke(["container", "ls"]).success().await?;
        let restored_runtime = listing
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(restored.id()))
            .and_then(|l| l.split_whitespace().last().map(str::to_string));
        ensure_eq!(restored_runtime.as_deref(), Some(runtime.name()), "runtime of the restored container");
        remove_task_and_container(&restored).await?;
        Ok(("running after checkpoint", after_checkpoint > before, "memory, rw layer and runtime restored"))
    })
    .await;
}

/// `ctr task checkpoint --image-path DIR [--exit]`, sent with runc's checkpoint options under every
/// runtime. `ctr` itself forwards these flags only when the runtime is named io.containerd.runc.v1/v2
/// and silently drops them otherwise (see `crab_integration::api`): it would then store an image
/// named after the container instead, whatever runtime serves it.
async fn checkpoint_to_dir(container: &Container, dir: &Path, exit: bool) -> Outcome<()> {
    let request = TaskCheckpoint { image_path: dir.display().to_string(), exit };
    checkpoint_task(container.ctr(), container.id(), &request, LONG).await
}

/// CRIU image files every dump of a process tree has.
fn has_criu_images(dir: &Path) -> Outcome<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| HarnessError::io(format!("listing {}", dir.display()), e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    for required in ["inventory.img", "pstree.img"] {
        ensure!(names.iter().any(|n| n == required), "{} lacks {required}: {names:?}", dir.display());
    }
    ensure!(names.iter().any(|n| n.starts_with("core-")), "{} has no core-*.img: {names:?}", dir.display());
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_checkpoint_to_image_path_then_with_exit() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("task checkpoint --image-path [--exit]", |runtime| async move {
        let container = Container::new(&runtime, "ckpt-path");
        let events = EventStream::start(container.ctr()).await?;
        start_token_counter(&container, "path").await?;
        let (_, before) = count_at_least(&container, 5).await?;

        let live_dir = container.scratch_dir().join("live");
        checkpoint_to_dir(&container, &live_dir, false).await?;
        has_criu_images(&live_dir)?;
        ensure_eq!(container.task().await?.map(|t| t.status), Some("RUNNING".to_string()), "status after checkpoint");
        count_at_least(&container, before + 5).await?;

        let exit_dir = container.scratch_dir().join("exit");
        checkpoint_to_dir(&container, &exit_dir, true).await?;
        has_criu_images(&exit_dir)?;
        container.wait_status("STOPPED", SHORT).await?;
        let exit = events.wait_init_exit(container.id(), SHORT).await?;
        container.delete_task().await?;
        Ok(("running after plain checkpoint", "stopped after --exit", exit.u64_field("exit_status")))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_of_a_tty_container() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("checkpoint with a TTY", |runtime| async move {
        let container = Container::new(&runtime, "ckpt-tty");
        // `ctr run -t` insists on a console even when detaching.
        let mut launcher = PtySession::spawn(
            container.ctr(),
            container.run_args(
                &["-d", "-t"],
                &["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /state; sleep 0.05; done"],
            ),
            24,
            80,
        )?;
        let launched = launcher.wait_exit(LONG).await?;
        ensure!(launched.success(), "`ctr run -d -t` failed: {:?}", launcher.screen());
        container.wait_status("RUNNING", SHORT).await?;
        let tty = container.exec_ok("tty", &["sh", "-c", "readlink /proc/1/fd/0"]).await?;
        ensure_eq!(tty.trim(), "/dev/pts/0", "init's stdin");

        let reference = container.checkpoint_ref("tty");
        container
            .ctr()
            .invoke(["container", "checkpoint", "--task", "--rw", container.id(), reference.as_str()])
            .timeout(LONG)
            .success()
            .await?;
        ensure!(image_exists(&container, &reference).await?, "checkpoint image {reference} was not created");
        // containerd 1.6 honours an image path only for runtimes named io.containerd.runc.*: for any
        // other it also stores the checkpoint and the container's spec in its content store, and
        // fails with "already exists" while an earlier checkpoint image still holds that spec. Drop
        // the image (and, synchronously, its content) first; runc.v2 does the same steps.
        container.ctr().invoke(["image", "rm", "--sync", reference.as_str()]).timeout(LONG).success().await?;
        let dir = container.scratch_dir().join("tty-images");
        checkpoint_to_dir(&container, &dir, false).await?;
        has_criu_images(&dir)?;
        ensure_eq!(container.task().await?.map(|t| t.status), Some("RUNNING".to_string()), "status after checkpoints");
        // Restore of a TTY container is not asserted: runc.v2 cannot do it (see the module comment).
        remove_task_and_container(&container).await?;
        Ok("tty container checkpointed and left running")
    })
    .await;
}

/// CRIU probes the kernel at the start of every run unless it finds its cache of the result, which
/// it keeps only on a tmpfs (crab_runtime::kdat): crab's shim makes crab's CRIU cache directory one,
/// so a second dump reads the facts the first one found. The same dump archives its empty tmpfs
/// mounts without tar (scripts/patches). crab only (over `$CRAB_TEST_CRAB_BINARY`
/// in the crun leg): runc.v2 leaves CRIU as it finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crabs_criu_reads_cached_kernel_facts_and_archives_empty_tmpfs_itself() {
    crab_sys::skip_unless_root!("containerd, crab and CRIU");
    let runtime = crab_integration::env::Runtime::parse("crab").expect("the crab runtime");
    let run = async {
        let container = Container::new(&runtime, "ckpt-kdat");
        start_token_counter(&container, "kdat").await?;
        count_at_least(&container, 2).await?;
        let kdat_dir = Path::new(crab_runtime::kdat::KDAT_DIR);
        checkpoint_to_dir(&container, &container.scratch_dir().join("first"), false).await?;
        let fs =
            nix::sys::statfs::statfs(kdat_dir).map_err(|e| HarnessError::io("statfs of CRIU's cache", e.into()))?;
        ensure_eq!(fs.filesystem_type(), nix::sys::statfs::TMPFS_MAGIC, "file system of {}", kdat_dir.display());
        let cache = kdat_dir.join("criu.kdat");
        ensure!(cache.is_file(), "no {} after a dump", cache.display());

        let second = container.scratch_dir().join("second");
        checkpoint_to_dir(&container, &second, false).await?;
        let log = std::fs::read_to_string(second.join("dump.log"))
            .map_err(|e| HarnessError::io(format!("reading {}/dump.log", second.display()), e))?;
        let loaded = format!("Loaded kdat cache from {}", cache.display());
        ensure!(log.contains(&loaded), "the second dump's log lacks {loaded:?}");
        // And crab's CRIU archives an empty tmpfs itself (scripts/patches): the spec's /dev/shm
        // is one here, and so are runc's masked paths.
        ensure!(
            log.contains("tmpfs ./dev/shm is empty: archived without tar"),
            "the dump ran tar for the empty /dev/shm"
        );
        remove_task_and_container(&container).await?;
        Ok("second dump read the cache")
    };
    let outcome = match tokio::time::timeout(LONG * 2, run).await {
        Ok(outcome) => outcome,
        Err(_) => Err(HarnessError::Timeout { what: "kernel facts scenario".into(), after: LONG * 2 }),
    };
    crab_integration::matrix::require_same("kernel facts cached between CRIU runs", vec![(&runtime, outcome)]);
}
