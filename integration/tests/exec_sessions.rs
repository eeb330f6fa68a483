//! Exec sessions started by crab-init's spawner inside the container (issues 2 and 4): they belong
//! to the container's own process tree, so a CRIU checkpoint takes them, and a restored session is
//! re-attached by its exec id with its memory and stdio. Task API behaviour stays runc's.
//!
//! The checkpoint scenarios run under crab only: under io.containerd.runc.v2 an exec's parent is
//! the shim, outside the container, and `runc checkpoint` leaves it out of the dump.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crab_integration::api::{TaskCheckpoint, checkpoint_task};
use crab_integration::env::CRAB_RUNTIME;
use crab_integration::{Container, HarnessError, Outcome, Runtime, across_runtimes, ensure, ensure_eq};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

const SHORT: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(120);
/// Held in a shell variable of the session: a dump without the session is far smaller.
const BIG_BYTES: u64 = 50 * 1024 * 1024;

fn crab() -> Runtime {
    Runtime::parse(CRAB_RUNTIME).expect("crab runtime name")
}

/// `ctr task exec --exec-id ID CONTAINER sh` with its stdin and stdout held by the test: the
/// persistent shell agent frameworks keep.
struct ShellSession {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl ShellSession {
    fn open(container: &Container, exec_id: &str) -> Outcome<ShellSession> {
        let args = container.ctr().full_args(["task", "exec", "--exec-id", exec_id, container.id(), "sh"]);
        let mut child = tokio::process::Command::new("ctr")
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| HarnessError::io("spawning ctr task exec", e))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        Ok(ShellSession { child, stdin, lines: BufReader::new(stdout).lines() })
    }

    async fn send(&mut self, line: &str) -> Outcome<()> {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| HarnessError::io("writing to the session", e))?;
        self.stdin.flush().await.map_err(|e| HarnessError::io("flushing the session", e))
    }

    /// The next output line that starts with `prefix`.
    async fn line_starting(&mut self, prefix: &str, timeout: Duration) -> Outcome<String> {
        let wait = async {
            while let Some(line) =
                self.lines.next_line().await.map_err(|e| HarnessError::io("reading the session", e))?
            {
                if line.starts_with(prefix) {
                    return Ok(line);
                }
            }
            Err(HarnessError::Expectation(format!("session output ended before a line starting with {prefix:?}")))
        };
        tokio::time::timeout(timeout, wait).await.map_err(|_| HarnessError::Timeout {
            what: format!("a session line starting with {prefix:?}"),
            after: timeout,
        })?
    }

    async fn exit(mut self) -> Outcome<Option<i32>> {
        self.send("exit 0").await?;
        let status = tokio::time::timeout(SHORT, self.child.wait())
            .await
            .map_err(|_| HarnessError::Timeout { what: "the session to exit".into(), after: SHORT })?
            .map_err(|e| HarnessError::io("waiting for ctr task exec", e))?;
        Ok(status.code())
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                    _ => e.metadata().map(|m| m.len()).unwrap_or(0),
                })
                .sum()
        })
        .unwrap_or(0)
}

async fn remove(container: &Container) -> Outcome<()> {
    container.kill("SIGKILL", true).await?;
    container.wait_status("STOPPED", SHORT).await?;
    container.delete_task().await?;
    container.delete_container().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_session_is_in_the_checkpoint_and_reattaches_after_restore() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let original = Container::new(&runtime, "session");
    original.start(&["sleep", "100000"]).await.expect("start");
    let result = async {
        let mut shell = ShellSession::open(&original, "shell")?;
        // 50 MiB of shell memory and a secret, both only in the session process.
        shell.send(&format!("big=$(printf '%{BIG_BYTES}s' x); secret=s3cr3t-$$; echo ready ${{#big}}")).await?;
        let ready = shell.line_starting("ready", LONG).await?;
        ensure_eq!(ready, format!("ready {BIG_BYTES}"), "session set-up");
        shell.send("echo before $secret").await?;
        let secret = shell.line_starting("before", SHORT).await?.trim_start_matches("before ").to_string();

        // containerd's task checkpoint (paused, leave running): the dump holds the session's memory.
        let dump = original.scratch_dir().join("dump");
        let checkpointed = checkpoint_task(
            original.ctr(),
            original.id(),
            &TaskCheckpoint { image_path: dump.display().to_string(), exit: false },
            LONG,
        )
        .await;
        if let Err(e) = checkpointed {
            // CRIU's own account of the failure is the useful part.
            let log = std::fs::read_to_string(dump.join("dump.log")).unwrap_or_default();
            let errors: Vec<&str> = log.lines().filter(|l| l.contains("Error") || l.contains("rror (")).collect();
            return Err(HarnessError::Expectation(format!("{e}\nCRIU errors:\n{}", errors.join("\n"))));
        }
        let dumped = dir_bytes(&dump);
        ensure!(dumped >= BIG_BYTES, "dump is {dumped} bytes: the session's {BIG_BYTES}-byte variable is missing");
        // The original session keeps working after the checkpoint.
        shell.send("echo still $secret").await?;
        ensure_eq!(
            shell.line_starting("still", SHORT).await?,
            format!("still {secret}"),
            "session after the checkpoint"
        );

        let reference = original.checkpoint_ref("session");
        original
            .ctr()
            .invoke(["container", "checkpoint", "--task", "--rw", original.id(), reference.as_str()])
            .timeout(LONG)
            .success()
            .await?;
        drop(shell);
        remove(&original).await?;

        let restored = Container::new(&runtime, "session-restored");
        restored
            .ctr()
            .invoke(["container", "restore", "--live", "--rw", restored.id(), reference.as_str()])
            .timeout(LONG)
            .success()
            .await?;
        restored.wait_status("RUNNING", SHORT).await?;
        let outcome = async {
            // Same exec id and args: the restored shell is re-attached, not started afresh.
            let mut shell = ShellSession::open(&restored, "shell")?;
            shell.send("echo answer $secret ${#big}").await?;
            let answer = shell.line_starting("answer", SHORT).await?;
            ensure_eq!(answer, format!("answer {secret} {BIG_BYTES}"), "restored session's memory");
            ensure_eq!(shell.exit().await?, Some(0), "exit status of the restored session");
            // A new exec id still starts a new process.
            let fresh = restored.exec_ok("fresh", &["sh", "-c", "echo fresh $secret."]).await?;
            ensure_eq!(fresh.trim(), "fresh .", "a new exec shares no shell state");
            Ok(dumped)
        }
        .await;
        remove(&restored).await?;
        outcome
    }
    .await;
    if result.is_err() {
        let _ = remove(&original).await;
    }
    let dumped = result.expect("session checkpoint and restore");
    eprintln!("task checkpoint with a 50 MiB exec session: {dumped} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_sessions_are_children_of_the_containers_tree() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "session-tree");
    container.start(&["sleep", "100000"]).await.expect("start");
    let result = async {
        // Under runc the exec's parent is the shim, outside the pid namespace: PPid reads 0.
        let status = container.exec_ok("tree", &["sh", "-c", "grep PPid /proc/$$/status"]).await?;
        let ppid: u32 = status.split_whitespace().last().and_then(|p| p.parse().ok()).unwrap_or(0);
        ensure!(ppid > 1, "exec's parent pid inside the container is {ppid}: not started in the container's tree");
        // The spawner is the runtime's helper: Pids lists the init only, as under runc.
        let pids = container.pids().await?;
        ensure_eq!(pids.len(), 1, "pids of a container with no exec running: {pids:?}");
        Ok(())
    }
    .await;
    remove(&container).await.expect("remove");
    result.expect("exec in the container's tree");
}

/// runc's default capabilities, as `ctr run` grants them: dropping each is dropping ALL (ctr takes
/// no `ALL`).
const DEFAULT_CAPS: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// The parent of the exec's shell, as the container sees it: `crab-spawner` when the spawner
/// started it inside the container's tree (what a CRIU dump takes), nothing under `runc exec`
/// (the parent is the shim, outside the pid namespace).
const PARENT_COMM: &str = "cat /proc/$PPID/comm 2>/dev/null || echo outside";

/// Issue 15: a pod that drops ALL capabilities (the "restricted" Pod Security Standard) still
/// lists its groups in every exec spec (containerd fills `additionalGids`). The spawner, holding
/// no capability, must not call setgroups() for groups it already has: the exec runs, started by
/// the spawner in the container's tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_go_through_the_spawner_with_all_capabilities_dropped() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "session-cap-drop");
    let flags: Vec<&str> = DEFAULT_CAPS.iter().flat_map(|cap| ["--cap-drop", *cap]).collect();
    container.start_with(&flags, &["sleep", "100000"]).await.expect("start");
    let result = async {
        let probe = format!("grep -E '^(CapEff|Groups)' /proc/self/status; {PARENT_COMM}");
        let out = container.exec_ok("cap-drop", &["sh", "-c", &probe]).await?;
        ensure!(out.contains("CapEff:\t0000000000000000"), "the exec holds capabilities: {out}");
        ensure!(out.contains("Groups:\t0"), "the exec's groups are not the spec's: {out}");
        ensure_eq!(out.lines().last().unwrap_or_default(), "crab-spawner", "the exec's parent ({out})");
        Ok(())
    }
    .await;
    remove(&container).await.expect("remove");
    result.expect("exec with capabilities dropped");
}

/// Python run by root in a container: connects to the spawner's socket, asks it to list its
/// sessions and prints the frames it got back as a JSON array.
const SPAWNER_PROBE: &str = r#"
import json, socket, struct
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("/dev/.crab/sock")
body = json.dumps({"v": 1, "op": "list"}).encode()
try:
    s.sendall(struct.pack(">I", len(body)) + body)
except OSError:
    pass
data = b""
while True:
    try:
        chunk = s.recv(65536)
    except ConnectionResetError:
        # The spawner closed with our request unread: a reset after its reply.
        break
    if not chunk:
        break
    data += chunk
frames = []
while len(data) >= 4:
    (n,) = struct.unpack(">I", data[:4])
    frames.append(json.loads(data[4:4 + n]))
    data = data[4 + n:]
print(json.dumps(frames))
"#;

/// What the spawner answered `SPAWNER_PROBE` with: exactly one frame, an error; its message.
async fn spawner_refusal(container: &Container) -> Outcome<String> {
    let out = container.exec_ok("probe", &["python3", "-c", SPAWNER_PROBE]).await?;
    let frames: Vec<serde_json::Value> = serde_json::from_str(out.trim())
        .map_err(|e| HarnessError::Parse { what: "spawner frames".into(), detail: format!("{e}: {out}") })?;
    ensure_eq!(frames.len(), 1, "frames the spawner sent before closing: {frames:?}");
    ensure_eq!(frames[0]["kind"], "error", "reply to a container process");
    Ok(frames[0]["message"].as_str().unwrap_or_default().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawner_refuses_connections_from_inside_the_container() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "spawner-refuses");
    let image = "crab.local/terminal:latest";
    container
        .ctr()
        .invoke(
            ["run".to_string(), "-d".to_string()]
                .into_iter()
                .chain(runtime.run_flags())
                .chain([image, container.id(), "sleep", "100000"].map(str::to_string)),
        )
        .success()
        .await
        .expect("start the terminal image");
    container.wait_status("RUNNING", SHORT).await.expect("running");
    let result = async {
        // Root inside the container asks the spawner to list its sessions.
        let message = spawner_refusal(&container).await?;
        ensure!(
            message.contains("connection refused") && message.contains("inside the container"),
            "refusal: {message}"
        );
        Ok(())
    }
    .await;
    remove(&container).await.expect("remove");
    result.expect("refusal");
}

/// Issue 15: in the host's pid namespace (a hostPID pod) every process has a host pid, the shim's
/// too, so the spawner cannot know the shim by a pid of 0. It lets in the parent of the
/// container's init (the shim, the runtime's subreaper), which no process of the container is:
/// execs go through the spawner, inside the container's process tree, and root in the container
/// is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_host_pid_namespace_execs_go_through_the_spawner_and_the_container_is_refused() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "spawner-host-pid");
    let image = "crab.local/terminal:latest";
    // The test's own pid namespace is the host's here; /proc/1 may be closed to us (a sandboxed
    // machine's pid 1 is not always ours to inspect), the test process never is.
    let host_pid_ns = format!("pid:/proc/{}/ns/pid", std::process::id());
    let args = ["run".to_string(), "-d".to_string()]
        .into_iter()
        .chain(runtime.run_flags())
        .chain(["--with-ns", &host_pid_ns, image, container.id(), "sleep", "100000"].map(str::to_string));
    container.ctr().invoke(args).success().await.expect("start");
    container.wait_status("RUNNING", SHORT).await.expect("running");
    let result = async {
        let pid_ns = container.exec_ok("pid-ns", &["readlink", "/proc/self/ns/pid"]).await?;
        let host = std::fs::read_link("/proc/self/ns/pid").map_err(|e| HarnessError::io("host pid ns", e))?;
        ensure_eq!(pid_ns.trim(), host.display().to_string(), "the container's pid namespace");
        let parent = container.exec_ok("parent", &["sh", "-c", PARENT_COMM]).await?;
        ensure_eq!(parent.trim(), "crab-spawner", "the parent of an exec in the host's pid namespace");
        let message = spawner_refusal(&container).await?;
        ensure!(message.contains("connection refused") && message.contains("not the shim"), "refusal: {message}");
        // The shim is still served after the refusal.
        let again = container.exec_ok("parent-again", &["sh", "-c", PARENT_COMM]).await?;
        ensure_eq!(again.trim(), "crab-spawner", "the parent of an exec after the refusal");
        Ok(())
    }
    .await;
    remove(&container).await.expect("remove");
    result.expect("host pid namespace");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_binaries_fail_exec_and_create_as_under_runc() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("missing binary in exec and as entrypoint", |runtime| async move {
        let container = Container::new(&runtime, "missing-bin");
        container.start(&["sleep", "100000"]).await?;
        let exec = container.exec("missing", &["crab-no-such-binary"]).await;
        let _ = remove(&container).await;
        let exec = exec?;
        let expected = "exec: \"crab-no-such-binary\": executable file not found in $PATH";
        let exec_observed = (exec.code() != Some(0), exec.stderr.contains(expected));

        let entry = Container::new(&runtime, "missing-entry");
        let run = entry.run_to_exit(&["crab-no-such-binary"], None).await?;
        let _ = entry.delete_container().await;
        let create_observed = (
            run.code() != Some(0),
            run.stderr.contains("unable to start container process") && run.stderr.contains(expected),
        );
        ensure!(exec_observed == (true, true), "exec of a missing binary: {}", exec.stderr);
        ensure!(create_observed == (true, true), "missing entrypoint: {}", run.stderr);
        Ok((exec_observed, create_observed))
    })
    .await;
}

/// The records of `container`'s turns so far (the shim appends one per turn once it is checkpointed).
fn turn_records(container: &Container) -> Outcome<Vec<crab_store::turns::TurnRecord>> {
    let state = std::env::var_os("CRAB_STATE_DIR").map_or_else(|| "/var/lib/crab".into(), std::path::PathBuf::from);
    let key = format!("{}/{}", container.ctr().namespace(), container.id());
    crab_store::turns::TurnLog::open(&state, &key)
        .and_then(|log| log.read())
        .map_err(|e| HarnessError::Expectation(format!("turn log of {key}: {e}")))
}

/// The record of the turn `exec_id` made, once written.
async fn record_of(container: &Container, exec_id: &str) -> Outcome<crab_store::turns::TurnRecord> {
    crab_integration::wait_until(&format!("the turn record of exec {exec_id}"), LONG, || async {
        Ok(turn_records(container)?.into_iter().find(|r| r.exec_id.as_deref() == Some(exec_id)))
    })
    .await
}

/// Issue 15: an exec that crab-init's spawner does not start (here: another user than the init's,
/// which the spawner never takes) is started by `runc exec`, outside the container's process tree
/// and so outside every dump. That is never silent: the record of its turn lists it with why, and
/// for an exec that outlives its turn (a session), that a restore does not bring it back; an exec
/// the spawner started lists nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_through_the_runtime_are_recorded_in_their_turns() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let runtime = crab();
    let container = Container::new(&runtime, "runtime-exec");
    container.start(&["sleep", "100000"]).await.expect("start");
    let result = async {
        let spawned = container.exec_ok("spawned", &["sh", "-c", PARENT_COMM]).await?;
        ensure_eq!(spawned.trim(), "crab-spawner", "the parent of an exec as the init's user");
        let record = record_of(&container, "spawned").await?;
        ensure!(record.runtime_execs.is_empty(), "an exec of the spawner's listed as the runtime's: {record:?}");

        let exec = |id: &'static str, detach: bool, cmd: &'static [&'static str]| {
            let mut args = vec!["task", "exec", "--exec-id", id, "--user", "1000"];
            if detach {
                args.push("--detach");
            }
            args.push(container.id());
            args.extend_from_slice(cmd);
            container.ctr().invoke(args).output()
        };
        let other_user = exec("other-user", false, &["sh", "-c", PARENT_COMM]).await?;
        ensure_eq!(other_user.stdout.trim(), "outside", "the parent of an exec as another user ({other_user:?})");
        let record = record_of(&container, "other-user").await?;
        ensure_eq!(record.runtime_execs.len(), 1, "runtime execs of {record:?}");
        let listed = &record.runtime_execs[0];
        ensure!(
            listed.exec_id == "other-user" && listed.reason.contains("user") && !listed.running,
            "the runtime exec as recorded: {listed:?}"
        );
        ensure!(record.reasons.contains(&listed.to_string()), "the reasons do not say it: {record:?}");

        // A session the runtime started and that outlives its turn (a mark ends the turn).
        let session = exec("runtime-session", true, &["sleep", "1000"]).await?;
        ensure_eq!(session.code(), Some(0), "detached exec ({session:?})");
        let marked = tokio::process::Command::new(crab_integration::env::crab_binary("crabctl"))
            .args(["turn", container.id(), "mark", "--json"])
            .output()
            .await
            .map_err(|e| HarnessError::io("crabctl turn mark", e))?;
        ensure!(marked.status.success(), "crabctl turn mark: {}", String::from_utf8_lossy(&marked.stderr));
        let record = record_of(&container, "runtime-session").await?;
        let listed = record.runtime_execs.iter().find(|e| e.exec_id == "runtime-session");
        ensure!(listed.is_some_and(|e| e.running), "the session's turn: {record:?}");
        ensure!(
            record.reasons.iter().any(|r| r.contains("runtime-session") && r.contains("not restorable")),
            "the record does not say the session is not restorable: {record:?}"
        );
        container
            .ctr()
            .invoke(["task", "kill", "--exec-id", "runtime-session", "--signal", "SIGKILL", container.id()])
            .success()
            .await?;
        Ok(())
    }
    .await;
    remove(&container).await.expect("remove");
    result.expect("runtime execs recorded");
}
