//! One container of one scenario under one runtime: a unique id, helpers for what scenarios do to it,
//! and a guard that removes its task, container, snapshot, checkpoint images and scratch files on drop.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::env::{Runtime, TestEnv};
use crate::host::{self, ProcessCgroups};
use crate::{HarnessError, Outcome, wait_until};
use crab_containerd::{Ctr, CtrOutput};

/// Timeout of every cleanup command run from `Drop`.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(15);

static NEXT_SUFFIX: AtomicU32 = AtomicU32::new(0);

/// A row of `ctr task ls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    pub pid: u32,
    pub status: String,
}

pub struct Container {
    ctr: Ctr,
    id: String,
    runtime: Runtime,
    image: String,
    scratch: PathBuf,
    /// Checkpoint images this container's scenario created, removed on drop.
    images: Mutex<Vec<String>>,
}

impl Container {
    /// A fresh, not yet created container for `scenario` under `runtime`. The id carries the
    /// scenario, the runtime, this test process and a counter, so parallel tests never collide and a
    /// leftover can be traced back to its test.
    pub fn new(runtime: &Runtime, scenario: &str) -> Container {
        let env = TestEnv::get();
        let scenario: String =
            scenario.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).take(40).collect();
        let id = format!(
            "{scenario}-{}-{}-{}",
            runtime.short(),
            std::process::id(),
            NEXT_SUFFIX.fetch_add(1, Ordering::Relaxed)
        );
        let scratch = env.scratch_root.join(&id);
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).unwrap_or_else(|e| panic!("cannot create {}: {e}", scratch.display()));
        Container {
            ctr: env.ctr(),
            id,
            runtime: runtime.clone(),
            image: env.image.clone(),
            scratch,
            images: Mutex::default(),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    pub fn ctr(&self) -> &Ctr {
        &self.ctr
    }

    pub fn image(&self) -> &str {
        &self.image
    }

    /// A directory private to this container, removed on drop.
    pub fn scratch_dir(&self) -> &PathBuf {
        &self.scratch
    }

    /// Where `start` sends the task's stdout and stderr (the shim writes it: `--log-uri file://`).
    pub fn log_path(&self) -> PathBuf {
        self.scratch.join("stdio.log")
    }

    pub fn read_log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `run --runtime R <flags> IMAGE ID <cmd>`.
    pub fn run_args(&self, flags: &[&str], cmd: &[&str]) -> Vec<String> {
        let mut args = vec!["run".to_string()];
        args.extend(self.runtime.run_flags());
        args.extend(flags.iter().map(|f| f.to_string()));
        args.push(self.image.clone());
        args.push(self.id.clone());
        args.extend(cmd.iter().map(|c| c.to_string()));
        args
    }

    /// `ctr run --rm` in the foreground: returns when the task exited, with `ctr`'s exit code being
    /// the task's. The status is not checked: the exit code is what such scenarios look at.
    pub async fn run_to_exit(&self, cmd: &[&str], stdin: Option<&[u8]>) -> Outcome<CtrOutput> {
        let mut invocation = self.ctr.invoke(self.run_args(&["--rm"], cmd));
        if let Some(bytes) = stdin {
            let (ctr, id) = (self.ctr.clone(), self.id.clone());
            invocation = invocation.stdin(bytes.to_vec()).close_stdin_after(async move {
                // RUNNING is reported after `ctr` has set up its stdin closer (it starts the task after).
                let _ = wait_until("the task to be started", Duration::from_secs(20), || async {
                    Ok(task_of(&ctr, &id).await?.filter(|task| task.status != "CREATED"))
                })
                .await;
            });
        }
        Ok(invocation.output().await?)
    }

    /// `ctr run -d` with stdio going to `log_path()`; returns once the task is running.
    pub async fn start(&self, cmd: &[&str]) -> Outcome<TaskInfo> {
        self.start_with(&[], cmd).await
    }

    pub async fn start_with(&self, extra_flags: &[&str], cmd: &[&str]) -> Outcome<TaskInfo> {
        let log_uri = format!("file://{}", self.log_path().display());
        let mut flags = vec!["-d", "--log-uri", log_uri.as_str()];
        flags.extend_from_slice(extra_flags);
        self.ctr.invoke(self.run_args(&flags, cmd)).success().await?;
        self.wait_status("RUNNING", Duration::from_secs(20)).await
    }

    /// This container's row of `ctr task ls`, `None` if it has no task.
    pub async fn task(&self) -> Outcome<Option<TaskInfo>> {
        task_of(&self.ctr, &self.id).await
    }

    pub async fn wait_status(&self, status: &str, timeout: Duration) -> Outcome<TaskInfo> {
        wait_until(&format!("task {} to be {status}", self.id), timeout, || async {
            Ok(self.task().await?.filter(|task| task.status == status))
        })
        .await
    }

    pub async fn wait_no_task(&self, timeout: Duration) -> Outcome<()> {
        wait_until(&format!("task {} to disappear from `ctr task ls`", self.id), timeout, || async {
            Ok(self.task().await?.is_none().then_some(()))
        })
        .await
    }

    pub async fn init_pid(&self) -> Outcome<u32> {
        match self.task().await? {
            Some(task) if task.pid > 0 => Ok(task.pid),
            other => Err(HarnessError::Expectation(format!("container {} has no running init: {other:?}", self.id))),
        }
    }

    /// `ctr task exec --exec-id ID`, whatever its exit status.
    pub async fn exec(&self, exec_id: &str, cmd: &[&str]) -> Outcome<CtrOutput> {
        let mut args = vec!["task", "exec", "--exec-id", exec_id, self.id.as_str()];
        args.extend_from_slice(cmd);
        Ok(self.ctr.invoke(args).output().await?)
    }

    /// Runs `cmd` as an exec and returns its stdout, requiring exit code 0.
    pub async fn exec_ok(&self, exec_id: &str, cmd: &[&str]) -> Outcome<String> {
        let output = self.exec(exec_id, cmd).await?;
        if output.code() != Some(0) {
            return Err(HarnessError::Expectation(format!(
                "`{}` exited with {:?}: {}",
                output.command,
                output.code(),
                output.stderr.trim()
            )));
        }
        Ok(output.stdout)
    }

    /// Runs a read-only `cmd` that prints something, as [`exec_ok`](Self::exec_ok). Under
    /// containerd's own runc shim (1.6) an exec that exits at once sometimes loses its whole
    /// output (the shim publishes the exit before the client has read the fifo): there, and
    /// only there, an empty answer is asked for again, twice at most. crab's shim must answer
    /// the first time (it waits for the reader; see `crates/crab-shim/src/io.rs`).
    pub async fn exec_output(&self, exec_id: &str, cmd: &[&str]) -> Outcome<String> {
        let mut out = self.exec_ok(exec_id, cmd).await?;
        if self.runtime.name() == crate::env::RUNC_RUNTIME {
            for retry in 1..=2 {
                if !out.is_empty() {
                    break;
                }
                out = self.exec_ok(&format!("{exec_id}-again{retry}"), cmd).await?;
            }
        }
        Ok(out)
    }

    pub async fn kill(&self, signal: &str, all: bool) -> Outcome<()> {
        let mut args = vec!["task", "kill", "--signal", signal];
        if all {
            args.push("--all");
        }
        args.push(&self.id);
        self.ctr.invoke(args).success().await?;
        Ok(())
    }

    pub async fn delete_task(&self) -> Outcome<CtrOutput> {
        Ok(self.ctr.invoke(["task", "delete", self.id.as_str()]).success().await?)
    }

    pub async fn delete_container(&self) -> Outcome<()> {
        self.ctr.invoke(["container", "delete", self.id.as_str()]).success().await?;
        Ok(())
    }

    /// The pid of the shim daemon serving this container; exactly one must exist.
    pub fn shim_pid(&self) -> Outcome<u32> {
        match host::shim_daemons(self.ctr.namespace(), &self.id).as_slice() {
            [pid] => Ok(*pid),
            pids => {
                Err(HarnessError::Expectation(format!("expected one shim for container {}, found {pids:?}", self.id)))
            }
        }
    }

    /// The cgroups of the task's init process.
    pub async fn cgroups(&self) -> Outcome<ProcessCgroups> {
        ProcessCgroups::of_pid(self.init_pid().await?)
    }

    pub fn mounts(&self) -> Outcome<Vec<String>> {
        host::mounts_of(&self.id)
    }

    /// Pids listed by `ctr task ps`.
    pub async fn pids(&self) -> Outcome<Vec<u32>> {
        let listing = self.ctr.invoke(["task", "ps", self.id.as_str()]).success().await?;
        listing
            .stdout
            .lines()
            .skip(1)
            .filter_map(|line| line.split_whitespace().next())
            .map(|pid| {
                pid.parse()
                    .map_err(|_| HarnessError::Parse { what: "ctr task ps".into(), detail: format!("pid {pid:?}") })
            })
            .collect()
    }

    /// An image reference for a checkpoint of this container, removed on drop.
    pub fn checkpoint_ref(&self, tag: &str) -> String {
        let reference = format!("crab.local/checkpoint/{}:{tag}", self.id);
        self.images.lock().unwrap().push(reference.clone());
        reference
    }

    /// SIGKILLs the shim daemons serving this container and returns their pids.
    fn kill_shims(&self) -> Vec<u32> {
        let shims = host::shim_daemons(self.ctr.namespace(), &self.id);
        for shim in &shims {
            let _ = kill(Pid::from_raw(*shim as i32), Signal::SIGKILL);
        }
        shims
    }

    /// Removes everything this container may have left, ignoring what is already gone. Runs blocking
    /// `ctr` calls because `Drop` cannot await; each has a timeout so a wedged shim cannot hang the
    /// suite, and a shim that does not let its task be deleted is SIGKILLed (containerd then cleans
    /// up after it) before the container is deleted.
    fn cleanup(&self) {
        let id = self.id.as_str();
        let ctr = |args: &[&str]| self.ctr.blocking(args.iter().copied(), CLEANUP_TIMEOUT);
        let _ = ctr(&["task", "kill", "--all", "--signal", "SIGKILL", id]);
        let deleted = ctr(&["task", "delete", "--force", id]);
        let task_left = ctr(&["task", "ls", "-q"]).is_ok_and(|list| list.stdout.lines().any(|l| l.trim() == id));
        if deleted.is_err() || task_left {
            self.kill_shims();
            std::thread::sleep(Duration::from_millis(500));
            let _ = ctr(&["task", "delete", "--force", id]);
        }
        let _ = ctr(&["container", "delete", id]);
        let _ = ctr(&["snapshot", "rm", id]);
        // A shim must exit once its container is deleted; one that does not would pile up over runs.
        let lingering = self.kill_shims();
        if !lingering.is_empty() {
            eprintln!("cleanup of {id}: shim(s) {lingering:?} outlived the container and were killed");
        }
        // `ctr task checkpoint` without a usable image path stores an image named after the container.
        let default_checkpoints = format!("containerd.io/checkpoint/{id}:");
        let listed = ctr(&["image", "ls", "-q"]).map(|list| list.stdout).unwrap_or_default();
        let mut images: Vec<String> = self.images.lock().unwrap().drain(..).collect();
        images.extend(listed.lines().filter(|l| l.starts_with(&default_checkpoints)).map(str::to_string));
        for image in images {
            let _ = ctr(&["image", "rm", image.as_str()]);
        }
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

async fn task_of(ctr: &Ctr, id: &str) -> Outcome<Option<TaskInfo>> {
    let listing = ctr.invoke(["task", "ls"]).timeout(Duration::from_secs(20)).success().await?;
    for line in listing.stdout.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() == 3 && fields[0] == id {
            let pid = fields[1].parse().map_err(|_| HarnessError::Parse {
                what: "ctr task ls".into(),
                detail: format!("pid column of {line:?}"),
            })?;
            return Ok(Some(TaskInfo { pid, status: fields[2].to_string() }));
        }
    }
    Ok(None)
}

impl Drop for Container {
    fn drop(&mut self) {
        self.cleanup();
    }
}
