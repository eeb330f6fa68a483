//! Transparent recovery under CRI, per sandbox shape of the dev traces: a crab container of a
//! pod runs turns as kubelet's clients run them (ExecSync, a streaming exec with stdin), is
//! SIGKILLed once a turn's checkpoint is written, and kubelet's replacement (same pod sandbox,
//! name and config, attempt + 1) must come back in the state the replay oracle
//! (`crab_replay::fingerprint`) saw before the kill: every file of its mount tree, every
//! process (command line, cwd, parent, descriptors) and every listener, with no difference
//! after the oracle's own normalisation (pids, inode numbers and times left out). Shapes: the
//! code-repair image with file edits and compiled files, the terminal image with a background
//! process, an open shell session, a listening server; and a container killed while a
//! checkpoint is being taken, which must come back as at the turn before, as its origin record
//! says. Each prints the replacement's Create-to-running time against a plain container
//! start in the same pod, with where the restore's time went (the shim's log).

use std::path::Path;
use std::time::{Duration, Instant};

use crab_integration::cri::{Pod, PodShape, ensure_image, with_pod};
use crab_integration::{HarnessError, Outcome, ensure, ensure_eq, wait_until};
use crab_replay::fingerprint::{Fingerprint, ReadCache, Scope};
use crab_store::turns::{RecordedClass, TurnLog, TurnRecord, TurnSource};
use futures::FutureExt;
use futures::future::LocalBoxFuture;
use k8s_cri::v1::ContainerState;

const WAIT: Duration = Duration::from_secs(60);
/// Each scenario's bound: image import on a first run, two containers, a restore.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(240);
const TERMINAL: &str = "crab.local/terminal:latest";
const CODE_REPAIR: &str = "crab.local/code-repair-marshmallow-3.0.0:latest";
const CODE_REPAIR_BUILD: [&str; 3] = ["code-repair", "marshmallow", "3.0.0"];
const SLEEP: [&str; 2] = ["sleep", "infinity"];

use crab_integration::cri::{crab_handler, crab_state_dir as state_dir, crab_store as store, store_key as key};

fn expectation(e: impl std::fmt::Display) -> HarnessError {
    HarnessError::Expectation(e.to_string())
}

fn turn_log(id: &str) -> Outcome<TurnLog> {
    TurnLog::open(&state_dir()?, &key(id)).map_err(expectation)
}

/// Waits until the container's turn log holds a record `pick` accepts and no turn is in
/// flight (nothing open, no checkpoint being written); returns that record.
async fn settled_record(id: &str, what: &str, pick: impl Fn(&TurnRecord) -> bool) -> Outcome<TurnRecord> {
    let log = turn_log(id)?;
    wait_until(&format!("{what} of {id}, settled"), WAIT, || async {
        let records = log.read().map_err(expectation)?;
        Ok(records.into_iter().find(|r| pick(r)).filter(|_| !log.is_busy()))
    })
    .await
}

/// Waits for the record of turn `turn`, with nothing in flight after it.
async fn turn_record(id: &str, turn: u64) -> Outcome<TurnRecord> {
    settled_record(id, &format!("the record of turn {turn}"), |r| r.turn == turn).await
}

/// The container as the replay oracle sees it from the host: its init from CRI's verbose
/// status, the scope from the runtime spec CRI made for it (what `crab_replay::sandbox`
/// reads from containerd), no ignores of our own.
async fn fingerprint(pod: &Pod, id: &str) -> Outcome<Fingerprint> {
    let info = pod.container_info(id).await?;
    let init = pod.init_pid(id).await?;
    let spec = info.get("runtimeSpec").ok_or_else(|| expectation(format!("no runtimeSpec for {id}: {info}")))?;
    let spec = serde_json::to_vec(spec).map_err(expectation)?;
    let mounts = crab_store::SandboxMounts::from_spec(&spec).map_err(expectation)?;
    let scope = Scope::new(&mounts, &[]).map_err(expectation)?;
    // A container just started shows its init as `runc init` until it execs its command.
    wait_until(&format!("init {init} of {id} to exec"), WAIT, || async {
        let cmdline = std::fs::read(format!("/proc/{init}/cmdline"))
            .map_err(|e| HarnessError::io(format!("/proc/{init}/cmdline"), e))?;
        Ok((cmdline != b"runc\0init\0").then_some(()))
    })
    .await?;
    tokio::task::spawn_blocking(move || Fingerprint::capture(init, &scope, &mut ReadCache::default()))
        .await
        .map_err(|e| expectation(format!("fingerprint thread: {e}")))?
        .map_err(|e| expectation(format!("fingerprint of {id}: {e}")))
}

/// The oracle's verdict: no difference, else each one listed.
fn same_state(what: &str, after: &Fingerprint, before: &Fingerprint) -> Outcome<()> {
    let differences = after.diff(before);
    let listed: Vec<String> = differences.iter().map(ToString::to_string).collect();
    ensure!(
        differences.is_empty(),
        "{what}: the oracle finds {} differences:\n  {}",
        listed.len(),
        listed.join("\n  ")
    );
    Ok(())
}

/// SIGKILLs the container's init on the host (a crash, an OOM kill); returns its exit code
/// once CRI sees it exited.
async fn crash(pod: &Pod, id: &str) -> Outcome<i32> {
    pod.crash(id, WAIT).await
}

fn kill(pid: u32) -> Outcome<()> {
    // SAFETY: kill(2) with a pid CRI reported for this running container; no memory involved.
    if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
        return Err(expectation(format!("kill -9 {pid}: {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

async fn exec_ok(pod: &Pod, id: &str, script: &str) -> Outcome<String> {
    let (stdout, stderr, code) = pod.exec(id, &["bash", "-c", script], 60).await?;
    ensure_eq!(code, 0, "exit code of {script:?} (stdout {stdout:?}, stderr {stderr:?})");
    Ok(stdout)
}

/// A shim log line's `key=value` fields (quotes dropped).
fn fields(line: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for word in line.split_whitespace() {
        if let Some((k, v)) = word.split_once('=')
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            out.push((k.to_string(), v.trim_matches('"').to_string()));
        }
    }
    out
}

/// Where a restore's time went, from the shim's `restore_step` lines in the CRI containerd's
/// log (as `scripts/lib/restore_breakdown.py` reads them).
#[derive(Debug, Default)]
struct Breakdown {
    /// The shim's Create until the rootfs and images were ready (store work and mount).
    prepare_ms: f64,
    rootfs_ms: f64,
    images_ms: f64,
    image_bytes: f64,
    /// The checkpoint holds processes (else the replacement's processes start from its image
    /// on the restored files, and runc creates it as any other container).
    processes: bool,
    /// runc restore (CRIU) within the shim's Start.
    runtime_restore_ms: f64,
}

async fn breakdown(id: &str) -> Outcome<Breakdown> {
    let log = crab_integration::cri::socket().parent().unwrap_or(Path::new("/")).join("containerd.log");
    wait_until(&format!("the restore steps of {id} in {}", log.display()), WAIT, || async {
        let text = std::fs::read_to_string(&log).map_err(|e| HarnessError::io(log.display().to_string(), e))?;
        let mut found = Breakdown::default();
        let (mut store, mut prepared, mut restored) = (false, false, false);
        for line in text.lines().filter(|l| l.contains(id) && l.contains("restore_step=")) {
            let fields = fields(line);
            let get = |name: &str| fields.iter().find(|(k, _)| k == name).and_then(|(_, v)| v.parse::<f64>().ok());
            let container = fields.iter().find(|(k, _)| k == "container").map(|(_, v)| v.as_str());
            if !container.is_some_and(|c| c == id || c.ends_with(&format!("/{id}"))) {
                continue;
            }
            match fields.iter().find(|(k, _)| k == "restore_step").map(|(_, v)| v.as_str()) {
                Some("store") => {
                    found.rootfs_ms = get("rootfs_ms").unwrap_or_default();
                    found.images_ms = get("images_ms").unwrap_or_default();
                    found.image_bytes = get("image_bytes").unwrap_or_default();
                    found.processes = fields.iter().any(|(k, v)| k == "images_turn" && v != "None");
                    store = true;
                }
                Some("prepared") => {
                    found.prepare_ms = get("prepare_ms").unwrap_or_default();
                    prepared = true;
                }
                Some("restored") => {
                    found.runtime_restore_ms = get("runtime_restore_ms").unwrap_or_default();
                    restored = true;
                }
                _ => {}
            }
        }
        Ok((store && prepared && (restored || !found.processes)).then_some(found))
    })
    .await
}

/// One shape: what runs in the container before the kill, and what is checked on the
/// restored replacement beyond the oracle.
struct Shape {
    scenario: &'static str,
    image: &'static str,
    build: &'static [&'static str],
    /// What the fingerprint before the kill must hold, so the oracle compares the shape's
    /// state and not an empty one: `file:PATH`, `process:` a command line's start, `listen:`
    /// a listener as the fingerprint writes it.
    holds: &'static [&'static str],
    /// Runs the turns on the first container; returns the record of the last one, settled.
    turns: for<'a> fn(&'a Pod, &'a str) -> LocalBoxFuture<'a, Outcome<TurnRecord>>,
    /// Checks the restored replacement with new execs, after the oracle compared it.
    alive: for<'a> fn(&'a Pod, &'a str) -> LocalBoxFuture<'a, Outcome<()>>,
}

/// The whole scenario of one shape: turns, fingerprint, SIGKILL, kubelet's replacement,
/// fingerprint again; the oracle must find no difference, the replacement's origin must name
/// the last turn's checkpoint, and the shape's own liveness checks must pass. Prints the
/// timing line.
async fn recovers(shape: Shape) {
    crab_sys::skip_unless_root!("containerd with its CRI plugin, runc and CRIU");
    let Some(handler) = crab_handler() else {
        eprintln!("CRAB_TEST_RUNTIMES leaves out crab: nothing to test");
        return;
    };
    let scenario = shape.scenario;
    let run = async move {
        ensure_image(shape.image, shape.build).await?;
        with_pod(scenario, handler, PodShape::default(), |pod| {
            async move {
                let first = pod.create_attempt_of(shape.image, "main", 0, &SLEEP, &[]).await?;
                pod.start(&first).await?;
                let record = (shape.turns)(pod, &first).await?;
                ensure_eq!(record.checkpoint_turn, Some(record.turn), "checkpoint of the last turn: {record:?}");
                let head = store()?.head(&key(&first)).map_err(expectation)?.map(|h| h.turn);
                ensure_eq!(head, Some(record.turn), "the chain's head");
                let before = fingerprint(pod, &first).await?;
                for entry in shape.holds {
                    ensure!(holds(&before, entry), "the fingerprint before the kill lacks {entry}: {before:?}");
                }
                ensure_eq!(crash(pod, &first).await?, 137, "exit code of the killed container");

                let clock = Instant::now();
                let second = pod.create_attempt_of(shape.image, "main", 1, &SLEEP, &[]).await?;
                pod.start(&second).await?;
                let restored_ms = clock.elapsed().as_secs_f64() * 1e3;
                ensure_eq!(pod.state(&second).await?, ContainerState::ContainerRunning, "replacement state");
                let after = fingerprint(pod, &second).await?;
                same_state(
                    &format!("{scenario}: the replacement against the container before the kill"),
                    &after,
                    &before,
                )?;
                check_origin(&second, &first, record.turn)?;
                (shape.alive)(pod, &second).await?;
                report_timing(pod, scenario, shape.image, &second, restored_ms).await
            }
            .boxed_local()
        })
        .await
    };
    match tokio::time::timeout(SCENARIO_TIMEOUT, run).await {
        Ok(outcome) => outcome.unwrap_or_else(|e| panic!("{scenario}: {e}")),
        Err(_) => panic!("{scenario}: timed out after {SCENARIO_TIMEOUT:?}"),
    }
}

/// Whether `fingerprint` has `entry` (see [`Shape::holds`]).
fn holds(fingerprint: &Fingerprint, entry: &str) -> bool {
    match entry.split_once(':') {
        Some(("file", path)) => fingerprint.files.contains_key(path),
        Some(("process", start)) => fingerprint.processes.keys().any(|command| command.starts_with(start)),
        Some(("listen", listener)) => fingerprint.listeners.contains(listener),
        _ => false,
    }
}

/// The store says the replacement continues `first`'s chain from `turn`, as kubelet's
/// replacement in this pod.
fn check_origin(second: &str, first: &str, turn: u64) -> Outcome<()> {
    let origin = store()?.origin(&key(second)).map_err(expectation)?;
    let origin = origin.ok_or_else(|| expectation(format!("the replacement {second} records no origin")))?;
    ensure_eq!(origin.source, key(first), "origin chain");
    ensure_eq!(origin.turn, turn, "origin turn");
    ensure_eq!(origin.reason, crab_store::OriginReason::KubeletReplacement, "origin reason");
    Ok(())
}

/// A plain container start of the same image in the same pod, and the line with both times
/// and where the restore's went.
async fn report_timing(pod: &Pod, scenario: &str, image: &str, restored: &str, restored_ms: f64) -> Outcome<()> {
    let clock = Instant::now();
    let plain = pod.create_attempt_of(image, "plain", 0, &SLEEP, &[]).await?;
    pod.start(&plain).await?;
    let plain_ms = clock.elapsed().as_secs_f64() * 1e3;
    let parts = breakdown(restored).await?;
    let rest = restored_ms - parts.prepare_ms - parts.runtime_restore_ms;
    eprintln!(
        "{scenario}: replacement Create->running restored {restored_ms:.0} ms, plain start {plain_ms:.0} ms, \
         ratio {:.1}; restored = shim prepare {:.0} ms (rootfs {:.0} ms, CRIU images {:.0} ms, {:.1} MiB) \
         + {} + the rest {rest:.0} ms (CRI, containerd, shim start{})",
        restored_ms / plain_ms.max(1.0),
        parts.prepare_ms,
        parts.rootfs_ms,
        parts.images_ms,
        parts.image_bytes / (1 << 20) as f64,
        if parts.processes {
            format!("runc restore (CRIU) {:.0} ms", parts.runtime_restore_ms)
        } else {
            "no process images (a files-only chain: the processes start from the image)".to_string()
        },
        if parts.processes { "" } else { ", runc create and start" },
    );
    Ok(())
}

// ---- code-repair: file edits, compiled files, a commit -----------------------------------

/// An agent's repair in /testbed (the sdist of marshmallow 3.0.0, installed editable): a patch
/// to a module, the import that compiles it, byte-compiled files, a test run and a commit.
fn code_repair_turns<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<TurnRecord>> {
    async move {
        let patch = "cd /testbed && \
            sed -i 's/^__version__ = .*/__version__ = \"3.0.0+crab\"/' src/marshmallow/__init__.py && \
            git diff --stat && python -c 'import marshmallow; print(marshmallow.__version__)'";
        let out = exec_ok(pod, id, patch).await?;
        ensure!(out.ends_with("3.0.0+crab\n"), "the patched module: {out:?}");
        turn_record(id, 1).await?;
        let compile = "cd /testbed && python -m compileall -q src && \
            python -m pytest -q -x tests/test_utils.py >/tmp/pytest.out 2>&1; \
            tail -1 /tmp/pytest.out && \
            git -c user.name=agent -c user.email=agent@localhost commit -qam 'fix version' && \
            git log --oneline | wc -l";
        let out = exec_ok(pod, id, compile).await?;
        ensure!(out.contains(" passed") && out.ends_with("\n2\n"), "the test run and the commit: {out:?}");
        turn_record(id, 2).await
    }
    .boxed_local()
}

fn code_repair_alive<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<()>> {
    async move {
        let out = exec_ok(pod, id, "cd /testbed && git log -1 --format=%s && git status --porcelain | wc -l").await?;
        ensure_eq!(out, "fix version\n0\n", "the commit and a clean tree in the replacement");
        Ok(())
    }
    .boxed_local()
}

#[tokio::test]
async fn code_repair_edits_are_restored() {
    recovers(Shape {
        scenario: "code-repair",
        image: CODE_REPAIR,
        build: &CODE_REPAIR_BUILD,
        holds: &[
            "file:/testbed/src/marshmallow/__pycache__/fields.cpython-311.pyc",
            "file:/testbed/.pytest_cache/v/cache/nodeids",
        ],
        turns: code_repair_turns,
        alive: code_repair_alive,
    })
    .await;
}

// ---- terminal: a background process an exec turn started ---------------------------------

/// A worker in /app/work started in the background by an exec turn, holding a log file open
/// and a table in memory; the turn ends once it is ready.
/// (Only the background command is sent to the background: a list before its `&` would be
/// a subshell holding the exec's output open, and ExecSync would wait for it, under runc too.)
const WORKER: &str = "mkdir -p /app/work && cd /app/work || exit 1; \
    nohup python3 -c 'import time\n\
squares = {i: i * i for i in range(100000)}\n\
log = open(\"worker.log\", \"a\")\n\
log.write(\"ready %d\\n\" % squares[999]); log.flush()\n\
time.sleep(10**6)' >/dev/null 2>&1 </dev/null & \
    until grep -q ready /app/work/worker.log 2>/dev/null; do sleep 0.05; done; echo started";

fn background_turns<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<TurnRecord>> {
    async move {
        exec_ok(pod, id, "cd /app && git init -q repo && echo 'print(1)' > repo/main.py").await?;
        turn_record(id, 1).await?;
        ensure_eq!(exec_ok(pod, id, WORKER).await?, "started\n", "the worker's turn");
        let record = turn_record(id, 2).await?;
        ensure_eq!(record.class, RecordedClass::Proc, "class of the turn that started the worker: {record:?}");
        Ok(record)
    }
    .boxed_local()
}

fn background_alive<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<()>> {
    async move {
        let out = exec_ok(pod, id, "pgrep -f '^python3 -c import time' | wc -l; cat /app/work/worker.log").await?;
        ensure_eq!(out, "1\nready 998001\n", "the worker in the replacement");
        Ok(())
    }
    .boxed_local()
}

#[tokio::test]
async fn terminal_background_process_is_restored() {
    recovers(Shape {
        scenario: "background",
        image: TERMINAL,
        build: &["terminal"],
        holds: &["file:/app/work/worker.log", "process:python3 -c import time"],
        turns: background_turns,
        alive: background_alive,
    })
    .await;
}

// ---- terminal: a listening server -----------------------------------------------------------

const SERVER: &str = "mkdir -p /app/site && echo hello-crab > /app/site/index.html && cd /app/site || exit 1; \
    nohup python3 -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1 </dev/null & \
    until curl -sf http://127.0.0.1:8000/index.html >/dev/null; do sleep 0.05; done; echo serving";

fn server_turns<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<TurnRecord>> {
    async move {
        ensure_eq!(exec_ok(pod, id, SERVER).await?, "serving\n", "the server's turn");
        let record = turn_record(id, 1).await?;
        ensure_eq!(record.class, RecordedClass::Proc, "class of the turn that started the server: {record:?}");
        Ok(record)
    }
    .boxed_local()
}

fn server_alive<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<()>> {
    async move {
        let out = exec_ok(pod, id, "curl -sf --max-time 10 http://127.0.0.1:8000/index.html").await?;
        ensure_eq!(out, "hello-crab\n", "the restored server's answer");
        Ok(())
    }
    .boxed_local()
}

#[tokio::test]
async fn listening_server_is_restored() {
    recovers(Shape {
        scenario: "server",
        image: TERMINAL,
        build: &["terminal"],
        holds: &["process:python3 -m http.server 8000", "listen:tcp 00000000:1F40"],
        turns: server_turns,
        alive: server_alive,
    })
    .await;
}

// ---- terminal: a shell session kept open through a streaming exec with stdin --------------

/// The agent's shell: reads a line at a time and runs it, as agent frameworks' persistent
/// shells do. (A plain `bash` reading commands from a pipe runs a trap only once its next
/// line arrives; its `read` builtin runs it at once.)
const SHELL: [&str; 3] = [
    "bash",
    "-c",
    "while :; do IFS= read -r line; rc=$?; [ $rc -gt 128 ] && continue; [ $rc -ne 0 ] && exit; eval \"$line\"; done",
];

/// What the agent types into its shell: a directory change and a variable, which live only in
/// the shell, and a trap through which a later exec asks the shell for them.
const SESSION_INPUT: &str = "cd /app && mkdir -p proj && cd proj && X=crab-$((6 * 7)) && \
    trap 'echo \"$X $PWD\" > /app/probe' USR1 && echo ready-1\n";

fn session_turns<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<TurnRecord>> {
    async move {
        let mut session = pod.exec_session(id, &SHELL).await?;
        let sent = crab_store::turns::unix_ms(std::time::SystemTime::now());
        session.send(SESSION_INPUT.as_bytes()).await?;
        session.read_until("ready-1\n", WAIT).await?;
        // The input is a turn of its own, or joins the session's start-up turn when it comes
        // before the shell first waited for input: either way the turn that ran it ends after it.
        let record = settled_record(id, "the record of the turn that ran the shell's input", |r| {
            r.ended_unix_ms >= sent && matches!(r.source, TurnSource::Stdin | TurnSource::Exec)
        })
        .await?;
        // The session stays open (its socket held) until after the kill.
        std::mem::forget(session);
        Ok(record)
    }
    .boxed_local()
}

fn session_alive<'a>(pod: &'a Pod, id: &'a str) -> LocalBoxFuture<'a, Outcome<()>> {
    async move {
        let ask = "pid=$(pgrep -f '^bash -c while'); test -n \"$pid\" && kill -USR1 $pid && \
            for i in $(seq 100); do test -s /app/probe && break; sleep 0.05; done; cat /app/probe";
        let out = exec_ok(pod, id, ask).await?;
        ensure_eq!(out, "crab-42 /app/proj\n", "the restored shell's variable and directory");
        Ok(())
    }
    .boxed_local()
}

#[tokio::test]
async fn exec_session_shell_is_restored() {
    recovers(Shape {
        scenario: "session",
        image: TERMINAL,
        build: &["terminal"],
        holds: &["file:/app/proj", "process:bash -c while"],
        turns: session_turns,
        alive: session_alive,
    })
    .await;
}

// ---- a kill while a turn's checkpoint is being taken --------------------------------------

/// MiB the hog keeps in memory: every page touched, so CRIU dumps them all and a dump lasts
/// long enough (hundreds of ms) for a kill to land inside it once it is seen to begin. One
/// byte per page: the store's chunks dedupe them, so writing the checkpoint stays cheap.
const HOG_MIB: usize = 256;

fn hog_script() -> String {
    format!(
        "cd /app || exit 1; nohup python3 -c 'import time\n\
b = bytearray({HOG_MIB} << 20)\n\
for i in range(0, len(b), 4096): b[i] = 1\n\
open(\"/app/hog.ready\", \"w\").write(\"ready\")\n\
time.sleep(10**6)' >/dev/null 2>&1 </dev/null & \
         until test -s /app/hog.ready; do sleep 0.05; done; echo hogging"
    )
}

/// The host pid of the container's process whose command line starts with `prefix` (NUL
/// separated), found among the processes of its init's pid namespace.
fn host_pid_of(init: u32, prefix: &[u8]) -> Outcome<u32> {
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let want = ns(&init.to_string()).ok_or_else(|| expectation(format!("no pid namespace of init {init}")))?;
    let entries = std::fs::read_dir("/proc").map_err(|e| HarnessError::io("/proc", e))?;
    let found: Vec<u32> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| ns(&pid.to_string()).as_ref() == Some(&want))
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(prefix)))
        .collect();
    match found.as_slice() {
        [pid] => Ok(*pid),
        other => Err(expectation(format!("{} processes of {:?} in the container: {other:?}", other.len(), prefix))),
    }
}

/// The pid tracing `pid` (CRIU, once a dump has seized it), 0 for none.
fn tracer_of(pid: u32) -> Outcome<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| HarnessError::io(format!("/proc/{pid}/status"), e))?;
    let tracer = status.lines().find_map(|line| line.strip_prefix("TracerPid:")).map(str::trim);
    tracer.and_then(|t| t.parse().ok()).ok_or_else(|| expectation(format!("no TracerPid in /proc/{pid}/status")))
}

/// A container killed while the checkpoint of its turn 2 is being taken (CRIU has seized its
/// processes: the dump is under way) comes back as at turn 1: the oracle finds the
/// replacement equal to the container after turn 1, the store's origin record of the
/// replacement names turn 1, and the record of turn 2 says its checkpoint failed and that
/// turn 1 holds its state. The kill is made to land in the dump, not left to timing: the
/// dump of a container holding 256 MiB lasts hundreds of ms, and the kill follows within a
/// millisecond or two of CRIU seizing the hog (its TracerPid), before the dump can finish.
#[tokio::test]
async fn killed_during_a_capture_comes_back_at_the_turn_before() {
    crab_sys::skip_unless_root!("containerd with its CRI plugin, runc and CRIU");
    let Some(handler) = crab_handler() else {
        eprintln!("CRAB_TEST_RUNTIMES leaves out crab: nothing to test");
        return;
    };
    let run = async move {
        ensure_image(TERMINAL, &["terminal"]).await?;
        with_pod("capture", handler, PodShape::default(), |pod| {
            async move {
                let first = pod.create_attempt_of(TERMINAL, "main", 0, &SLEEP, &[]).await?;
                pod.start(&first).await?;
                ensure_eq!(exec_ok(pod, &first, &hog_script()).await?, "hogging\n", "the hog's turn");
                let record = turn_record(&first, 1).await?;
                ensure_eq!(record.checkpoint_turn, Some(1), "checkpoint of the hog's turn: {record:?}");
                let turn1 = fingerprint(pod, &first).await?;
                let hog = host_pid_of(pod.init_pid(&first).await?, b"python3\0-c\0import time")?;

                // Turn 2 starts a process: a process turn, whose checkpoint dumps the hog too.
                let turn2 = "echo two > /app/two; sleep 100000 >/dev/null 2>&1 </dev/null &";
                exec_ok(pod, &first, turn2).await?;
                let log = turn_log(&first)?;
                let init = pod.init_pid(&first).await?;
                // Polled every millisecond (wait_until's 50 ms would miss short dumps).
                let deadline = Instant::now() + WAIT;
                let seized = loop {
                    if tracer_of(hog)? != 0 {
                        break Instant::now();
                    }
                    if let Some(done) = log.read().map_err(expectation)?.into_iter().find(|r| r.turn == 2) {
                        return Err(expectation(format!(
                            "turn 2's checkpoint ended before its dump was seen: {done:?}"
                        )));
                    }
                    ensure!(Instant::now() < deadline, "CRIU did not seize the hog for turn 2's dump within {WAIT:?}");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                };
                kill(init)?;
                let after_seize_ms = seized.elapsed().as_secs_f64() * 1e3;
                ensure_eq!(pod.wait_exited(&first, WAIT).await?, 137, "exit code of the killed container");

                let second = pod.create_attempt_of(TERMINAL, "main", 1, &SLEEP, &[]).await?;
                pod.start(&second).await?;
                let restored = fingerprint(pod, &second).await?;
                same_state(
                    "the replacement of a container killed in turn 2's dump, against turn 1",
                    &restored,
                    &turn1,
                )?;
                check_origin(&second, &first, 1)?;
                let record = turn_record(&first, 2).await?;
                ensure_eq!(record.checkpoint_turn, Some(1), "the killed turn's record names turn 1: {record:?}");
                ensure!(
                    record.reasons.iter().any(|r| r.starts_with("checkpoint failed")),
                    "the killed turn's record says its checkpoint failed: {record:?}"
                );
                let head = store()?.head(&key(&first)).map_err(expectation)?.map(|h| h.turn);
                ensure_eq!(head, Some(1), "the killed container's head");
                eprintln!(
                    "capture: killed {after_seize_ms:.1} ms after CRIU seized the hog; turn 2: {:?}",
                    record.dump_failures
                );
                Ok(())
            }
            .boxed_local()
        })
        .await
    };
    match tokio::time::timeout(SCENARIO_TIMEOUT, run).await {
        Ok(outcome) => outcome.unwrap_or_else(|e| panic!("killed during a capture: {e}")),
        Err(_) => panic!("killed during a capture: timed out after {SCENARIO_TIMEOUT:?}"),
    }
}
