//! A sandbox on the crab runtime for turn-level tests: a container from any image whose execs are
//! turns, the shim's record of each turn, and the host's own view of what a turn changed (files under
//! the container's root, live processes in its cgroup and the CPU time each used) to hold those
//! records against.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::container::Container;
use crate::env::{CRAB_RUNTIME, Runtime, TestEnv};
use crate::host::{self, ProcessCgroups};
use crate::{HarnessError, Outcome, wait_until};
use crab_containerd::CtrOutput;

/// The agent image: python3, git, pip, tmux, nginx, curl (`scripts/build-images terminal`).
pub const TERMINAL_IMAGE: &str = "crab.local/terminal:latest";

/// Where the shim keeps its turn logs unless `CRAB_STATE_DIR` says otherwise.
const DEFAULT_STATE_DIR: &str = "/var/lib/crab";
/// The private containerd's directory (its log holds the shims' output) unless `CRAB_CTRD_DIR` says otherwise.
const DEFAULT_CTRD_DIR: &str = "/run/crab-dev";
/// A proc turn's CRIU dump takes about a second; a loaded machine may need many more.
const RECORD_TIMEOUT: Duration = Duration::from_secs(60);

/// How much of the sandbox a turn changed, as the shim's turn records name it. Ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TurnClass {
    Clean,
    Fs,
    Proc,
}

impl TurnClass {
    pub const ALL: [TurnClass; 3] = [TurnClass::Clean, TurnClass::Fs, TurnClass::Proc];

    pub fn parse(text: &str) -> Option<TurnClass> {
        match text {
            "clean" => Some(TurnClass::Clean),
            "fs" => Some(TurnClass::Fs),
            "proc" => Some(TurnClass::Proc),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TurnClass::Clean => "clean",
            TurnClass::Fs => "fs",
            TurnClass::Proc => "proc",
        }
    }
}

impl fmt::Display for TurnClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// What the shim said about one turn.
#[derive(Debug, Clone)]
pub struct TurnVerdict {
    pub turn: u64,
    pub class: TurnClass,
    pub escalated: bool,
    pub reasons: Vec<String>,
    /// The shim wrote no record because the turn's checkpoint failed. The engine only runs CRIU for
    /// a proc turn, so a failed CRIU dump still tells the class; `error` is the shim's message.
    pub checkpoint_failed: Option<String>,
}

/// A running container on the crab runtime, its init a `sleep infinity` that leaves every change
/// to the turns. Dropping it removes the container (the `Container` guard).
pub struct Sandbox {
    container: Container,
    init_pid: u32,
    cgroup_dir: PathBuf,
    /// Paths (inside the container) whose changes do not count: the `io.crab.ignore` annotation.
    ignored: Vec<PathBuf>,
    turn_log: PathBuf,
    shim_log: PathBuf,
    /// Where the shim log was when the sandbox started: only later lines can be about it.
    shim_log_start: u64,
    turns: u64,
}

impl Sandbox {
    /// Starts `image` under the crab runtime with `annotations` (`io.crab.*`) and extra `ctr run`
    /// flags (mounts). `io.crab.ignore` is also what the host view leaves out.
    pub async fn start(
        scenario: &str,
        image: &str,
        annotations: &[(&str, &str)],
        run_flags: &[&str],
    ) -> Outcome<Sandbox> {
        let env = TestEnv::get();
        require_image(image)?;
        let runtime = Runtime::parse(CRAB_RUNTIME).map_err(HarnessError::Expectation)?;
        let container = Container::new(&runtime, scenario);
        let shim_log = std::env::var_os("CRAB_CTRD_DIR")
            .map_or_else(|| PathBuf::from(DEFAULT_CTRD_DIR), PathBuf::from)
            .join("containerd.log");
        let shim_log_start = std::fs::metadata(&shim_log).map(|m| m.len()).unwrap_or(0);
        let log_uri = format!("file://{}", container.log_path().display());
        let mut args: Vec<String> = vec!["run".into(), "-d".into()];
        // A test's own crab config (`--runtime-config-path` in its flags) wins over the leg's.
        if run_flags.contains(&"--runtime-config-path") {
            args.extend(["--runtime".to_string(), CRAB_RUNTIME.to_string()]);
        } else {
            args.extend(runtime.run_flags());
        }
        args.extend(["--log-uri".to_string(), log_uri.clone()]);
        for (key, value) in annotations {
            args.push("--annotation".into());
            args.push(format!("{key}={value}"));
        }
        args.extend(run_flags.iter().map(|f| f.to_string()));
        args.extend([image, container.id(), "sleep", "infinity"].map(str::to_string));
        env.ctr().invoke(args).success().await?;
        let task = container.wait_status("RUNNING", Duration::from_secs(20)).await?;
        let cgroup_dir = ProcessCgroups::of_pid(task.pid)?.v2_dir().ok_or_else(|| {
            HarnessError::Expectation(format!("init {} of {} has no cgroup v2", task.pid, container.id()))
        })?;
        let ignored = annotations
            .iter()
            .filter(|(key, _)| *key == "io.crab.ignore")
            .flat_map(|(_, value)| value.split([',', ':']))
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
        let state_dir =
            std::env::var_os("CRAB_STATE_DIR").map_or_else(|| PathBuf::from(DEFAULT_STATE_DIR), PathBuf::from);
        Ok(Sandbox {
            // Turn logs are kept per containerd namespace.
            turn_log: state_dir.join("turns").join(env.ctr().namespace()).join(format!("{}.jsonl", container.id())),
            container,
            init_pid: task.pid,
            cgroup_dir,
            ignored,
            shim_log,
            shim_log_start,
            turns: 0,
        })
    }

    pub fn id(&self) -> &str {
        self.container.id()
    }

    /// The container's init (host pid namespace): `/proc/<pid>/root` is its root.
    pub fn init_pid(&self) -> u32 {
        self.init_pid
    }

    /// Runs `script` with `bash -c` in `/app` as one exec (one turn); returns its output and turn
    /// number. The turn's record may still be on its way: see [`Sandbox::verdict`].
    pub async fn exec(&mut self, script: &str) -> Outcome<(CtrOutput, u64)> {
        self.exec_argv(&["bash", "-c", script]).await
    }

    /// Runs `argv` as one exec (one turn) in `/app`, without a shell.
    pub async fn exec_argv(&mut self, argv: &[&str]) -> Outcome<(CtrOutput, u64)> {
        self.turns += 1;
        let exec_id = format!("turn-{}", self.turns);
        let mut args = vec!["task", "exec", "--exec-id", &exec_id, "--cwd", "/app", self.container.id()];
        args.extend_from_slice(argv);
        let output = self.container.ctr().invoke(args).output().await?;
        Ok((output, self.turns))
    }

    /// The shim's verdict on `turn`, waiting for its record (written once its checkpoint is done).
    pub async fn verdict(&self, turn: u64) -> Outcome<TurnVerdict> {
        wait_until(
            &format!("the turn record of {} turn {turn} in {}", self.id(), self.turn_log.display()),
            RECORD_TIMEOUT,
            || async {
                if let Some(verdict) = self.recorded(turn)? {
                    return Ok(Some(verdict));
                }
                Ok(self.failed_checkpoint(turn).map(|error| TurnVerdict {
                    turn,
                    class: TurnClass::Proc,
                    escalated: false,
                    reasons: Vec::new(),
                    checkpoint_failed: Some(error),
                }))
            },
        )
        .await
    }

    fn recorded(&self, turn: u64) -> Outcome<Option<TurnVerdict>> {
        let text = match std::fs::read_to_string(&self.turn_log) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(HarnessError::io(format!("reading {}", self.turn_log.display()), e));
            }
        };
        // Only whole lines: the shim may be appending the last one.
        let complete = text.rsplit_once('\n').map_or("", |(lines, _)| lines);
        for line in complete.lines().filter(|l| !l.trim().is_empty()) {
            let parse_error = |detail: String| HarnessError::Parse { what: format!("turn record {line:?}"), detail };
            let record: serde_json::Value = serde_json::from_str(line).map_err(|e| parse_error(e.to_string()))?;
            if record["turn"].as_u64() != Some(turn) {
                continue;
            }
            let class = record["class"]
                .as_str()
                .and_then(TurnClass::parse)
                .ok_or_else(|| parse_error("no known class".into()))?;
            let reasons = record["reasons"]
                .as_array()
                .map(|r| r.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
                .unwrap_or_default();
            return Ok(Some(TurnVerdict {
                turn,
                class,
                escalated: record["escalated"].as_bool().unwrap_or(false),
                reasons,
                checkpoint_failed: None,
            }));
        }
        Ok(None)
    }

    /// The shim's error line for `turn` when it logged that the turn's CRIU dump failed.
    fn failed_checkpoint(&self, turn: u64) -> Option<String> {
        let mut log = std::fs::File::open(&self.shim_log).ok()?;
        log.seek(SeekFrom::Start(self.shim_log_start)).ok()?;
        let mut tail = Vec::new();
        log.read_to_end(&mut tail).ok()?;
        let tail = String::from_utf8_lossy(&tail);
        let needle = format!("container={} turn={turn} ", self.id());
        tail.lines()
            .find(|line| line.contains("turn checkpoint failed") && line.contains(&needle))
            .filter(|line| line.contains("runc checkpoint failed"))
            .map(|line| line.split_once("error=").map_or(line, |(_, e)| e).to_string())
    }

    /// What the host sees of the sandbox now: every file under its root (outside kernel
    /// interfaces, devices and ignored paths), its live processes and their CPU times.
    pub fn observe(&self) -> Outcome<HostView> {
        // CPU times first: right after a turn, before the shim's checkpoint of it (a CRIU dump
        // runs code in every process) has had long to start.
        let cpu = self.process_cpu_times()?;
        let root = PathBuf::from(format!("/proc/{}/root", self.init_pid));
        let mut files = BTreeMap::new();
        walk(&root, Path::new("/"), &self.ignored, &mut files)?;
        let procs = std::fs::read_to_string(self.cgroup_dir.join("cgroup.procs"))
            .map_err(|e| HarnessError::io(format!("reading {}/cgroup.procs", self.cgroup_dir.display()), e))?;
        let pids: BTreeSet<u32> =
            procs.lines().filter_map(|l| l.trim().parse().ok()).filter(|pid| host::process_running(*pid)).collect();
        Ok(HostView { files, pids, cpu })
    }

    fn process_cpu_times(&self) -> Outcome<BTreeMap<u32, (u64, u64)>> {
        let procs = std::fs::read_to_string(self.cgroup_dir.join("cgroup.procs"))
            .map_err(|e| HarnessError::io(format!("reading {}/cgroup.procs", self.cgroup_dir.display()), e))?;
        Ok(procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter_map(|pid| Some((pid, process_cpu(pid)?)))
            .collect())
    }
}

fn require_image(image: &str) -> Outcome<()> {
    let listed = TestEnv::get().ctr().blocking(["images", "ls", "-q"], Duration::from_secs(15))?;
    if listed.stdout.lines().any(|l| l.trim() == image) {
        Ok(())
    } else {
        Err(HarnessError::Expectation(format!(
            "image {image} is missing (build it with `scripts/build-images terminal`)"
        )))
    }
}

/// Metadata that changes whenever a file's content, attributes, links or (for a directory) entries
/// change; access times are left out since reading is not a change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileState {
    ino: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    link_target: Option<PathBuf>,
}

/// A process's start time (clock ticks since boot, field 22 of `/proc/PID/stat`: a reused pid is
/// another process) and the CPU time of all its threads, ended ones included (its CPU clock).
fn process_cpu(pid: u32) -> Option<(u64, u64)> {
    let start = crab_sys::proc_stat::start_time(&crab_sys::proc_stat::read(pid).ok()?)?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: both calls write one value into a local we own.
    let cpu = unsafe {
        if libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) != 0 {
            return None;
        }
        let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        if libc::clock_gettime(clock, &mut now) != 0 {
            return None;
        }
        now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
    };
    Some((start, cpu))
}

/// The host's view of a sandbox at one moment.
pub struct HostView {
    files: BTreeMap<PathBuf, FileState>,
    pids: BTreeSet<u32>,
    /// pid -> (start, CPU ns).
    cpu: BTreeMap<u32, (u64, u64)>,
}

impl HostView {
    /// Processes of `before` still alive (the same process) that got CPU time since, as
    /// `pid +N us`. Such a process may have changed its memory; but the shim's checkpoint of a turn
    /// (a CRIU dump) also runs code in every process, so this is evidence of a run, not proof that
    /// the workload ran.
    pub fn processes_ran_since(&self, before: &HostView) -> Vec<String> {
        before
            .cpu
            .iter()
            .filter_map(|(pid, (start, old))| {
                let (now_start, now) = self.cpu.get(pid)?;
                (now_start == start && now > old).then(|| format!("{pid} +{} us", (now - old) / 1000))
            })
            .collect()
    }

    /// The class of what changed between `before` and `self`, and the first few changes.
    pub fn changes_since(&self, before: &HostView) -> (TurnClass, Vec<String>) {
        let mut changes = Vec::new();
        let started: Vec<u32> = self.pids.difference(&before.pids).copied().collect();
        let ended: Vec<u32> = before.pids.difference(&self.pids).copied().collect();
        if !started.is_empty() {
            changes.push(format!("processes started {started:?}"));
        }
        if !ended.is_empty() {
            changes.push(format!("processes ended {ended:?}"));
        }
        let class_from_procs = !changes.is_empty();
        for (path, state) in &self.files {
            match before.files.get(path) {
                None => changes.push(format!("new {}", path.display())),
                Some(old) if old != state => changes.push(format!("changed {}", path.display())),
                Some(_) => {}
            }
        }
        for path in before.files.keys().filter(|p| !self.files.contains_key(*p)) {
            changes.push(format!("removed {}", path.display()));
        }
        let class = if class_from_procs {
            TurnClass::Proc
        } else if changes.is_empty() {
            TurnClass::Clean
        } else {
            TurnClass::Fs
        };
        changes.truncate(6);
        (class, changes)
    }
}

/// Paths under `/` that are not the sandbox's files: kernel interfaces and device nodes. `/dev/shm`
/// is a tmpfs of files the sandbox's programs share, so it counts.
fn skipped(inner: &Path, ignored: &[PathBuf]) -> bool {
    let kernel = ["/proc", "/sys"].iter().any(|p| inner.starts_with(p));
    let device = inner.starts_with("/dev") && inner != Path::new("/dev") && !inner.starts_with("/dev/shm");
    kernel || device || ignored.iter().any(|p| inner.starts_with(p))
}

fn walk(root: &Path, inner: &Path, ignored: &[PathBuf], files: &mut BTreeMap<PathBuf, FileState>) -> Outcome<()> {
    let host_path = root.join(inner.strip_prefix("/").unwrap_or(inner));
    let meta = match std::fs::symlink_metadata(&host_path) {
        Ok(meta) => meta,
        // Removed while we walked: a change the next view shows.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(HarnessError::io(format!("stat {}", host_path.display()), e)),
    };
    let link_target = meta.file_type().is_symlink().then(|| std::fs::read_link(&host_path).ok()).flatten();
    files.insert(
        inner.to_path_buf(),
        FileState {
            ino: meta.ino(),
            mode: meta.mode(),
            uid: meta.uid(),
            gid: meta.gid(),
            nlink: meta.nlink(),
            size: if meta.is_dir() { 0 } else { meta.size() },
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            link_target,
        },
    );
    if !meta.is_dir() {
        return Ok(());
    }
    let entries = match std::fs::read_dir(&host_path) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(HarnessError::io(format!("listing {}", host_path.display()), e));
        }
    };
    for entry in entries {
        let entry = entry.map_err(|e| HarnessError::io(format!("listing {}", host_path.display()), e))?;
        let child = inner.join(entry.file_name());
        if !skipped(&child, ignored) {
            walk(root, &child, ignored, files)?;
        }
    }
    Ok(())
}
