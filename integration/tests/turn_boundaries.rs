//! Turn boundaries other than exec lifecycles, through the real shim: stdin turns of a long-lived
//! shell or interpreter (modes `stdin` and `auto`), and explicit marks (`crabctl turn ID mark`).
//!
//! A session is a `ctr task exec` whose stdin the test keeps open and feeds one command at a
//! time. Each command ends by printing the container's clock (`@@DONE <ns>`), the last thing it
//! does before the session reads its stdin again; the turn record's end time minus that stamp is how
//! long the shim took to see the turn was over. The test requires every turn with the right source
//! and class, and every detection within `DETECTION_BOUND`, and prints the latencies.
//!
//! `stdin_detection_cost` (ignored: a measurement, about three minutes) times the detection of
//! quick and slower commands and the shim's CPU time while a session waits for input and while it
//! runs a quiet command for a minute.
//!
//! ```sh
//! cargo test -p crab-integration --test turn_boundaries -- --nocapture --test-threads=1
//! cargo test -p crab-integration --test turn_boundaries -- --ignored --nocapture stdin_detection_cost
//! ```

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crab_integration::sandbox::{Sandbox, TERMINAL_IMAGE, TurnClass};
use crab_integration::{HarnessError, Outcome, TestEnv, ensure, ensure_eq, wait_until};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use TurnClass::{Clean, Fs, Proc};

/// The detector samples every 5 ms for the first 50 ms after input (then backs off to 100 ms) and
/// wants two idle samples in a row: ~10 ms by design for the quick commands used here; the turn's
/// end is stamped in whole milliseconds. This bound holds on an idle machine; see
/// [`detection_bound_ms`] for a loaded one.
const DETECTION_BOUND_MS: f64 = 50.0;

/// On a loaded machine every step between the session's last write and the shim's confirming sample
/// waits for a CPU (the session's exit to its prompt, the detector's timer, its /proc reads): the
/// bound grows with the run queue per core (1-minute load average / cores), never below the base.
fn detection_bound_ms() -> i64 {
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|l| l.parse::<f64>().ok()))
        .unwrap_or(0.0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    (DETECTION_BOUND_MS * (load / cores).max(1.0)).round() as i64
}
/// Records arrive once the turn's checkpoint is durable (a CRIU dump for a proc turn).
const RECORD_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a session gets to come up and wait for input before the first command.
const SESSION_START: Duration = Duration::from_millis(1500);

/// One line the test writes to a session and what its turn must be.
struct Command {
    line: &'static str,
    class: TurnClass,
}

fn command(class: TurnClass, line: &'static str) -> Command {
    Command { line, class }
}

/// `echo hi` clean, a file write fs, a background process proc, a read-only tool clean, a removal fs.
fn shell_commands() -> Vec<Command> {
    vec![
        command(Clean, "echo hi"),
        command(Fs, "echo x > /app/f"),
        command(Proc, "sleep 300 > /dev/null 2>&1 &"),
        command(Clean, "ls -la /app /etc > /dev/null"),
        command(Fs, "rm /app/f"),
    ]
}

fn python_commands() -> Vec<Command> {
    vec![
        command(Clean, "print('hi')"),
        command(Fs, "open('/app/p', 'w').write('x')"),
        command(Proc, "import subprocess; child = subprocess.Popen(['sleep', '300'])"),
        command(Clean, "x = sum(range(1000))"),
        command(Fs, "os.remove('/app/p')"),
    ]
}

/// A turn record as the shim wrote it.
#[derive(Debug, Clone)]
struct Record {
    turn: u64,
    source: String,
    class: TurnClass,
    ended_unix_ms: i64,
    reasons: Vec<String>,
    /// Shells asked at the turn's end: (ms, answer bytes, listed).
    shells: Vec<(f64, u64, bool)>,
}

/// The containerd namespace of the sandboxes: their turn logs are under `turns/<namespace>/`.
fn namespace() -> String {
    std::env::var("CRAB_NS").unwrap_or_else(|_| "crab".into())
}

fn state_dir() -> PathBuf {
    std::env::var_os("CRAB_STATE_DIR").map_or_else(|| "/var/lib/crab".into(), Into::into)
}

fn records(container: &str) -> Outcome<Vec<Record>> {
    let path = state_dir().join("turns").join(namespace()).join(format!("{container}.jsonl"));
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(HarnessError::io(format!("reading {}", path.display()), e)),
    };
    let complete = text.rsplit_once('\n').map_or("", |(lines, _)| lines);
    complete
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let parse_error =
                |detail: &str| HarnessError::Parse { what: format!("turn record {line:?}"), detail: detail.into() };
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| parse_error(&e.to_string()))?;
            Ok(Record {
                turn: v["turn"].as_u64().ok_or_else(|| parse_error("no turn"))?,
                source: v["source"].as_str().unwrap_or("(none)").to_string(),
                class: v["class"].as_str().and_then(TurnClass::parse).ok_or_else(|| parse_error("no class"))?,
                ended_unix_ms: v["ended_unix_ms"].as_i64().ok_or_else(|| parse_error("no end"))?,
                reasons: v["reasons"]
                    .as_array()
                    .map(|r| r.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
                    .unwrap_or_default(),
                shells: v["shells"]
                    .as_array()
                    .map(|shells| {
                        shells
                            .iter()
                            .map(|s| {
                                let ms = s["ms"].as_f64().unwrap_or(-1.0);
                                (ms, s["answer_bytes"].as_u64().unwrap_or(0), s["listed"].as_bool() == Some(true))
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            })
        })
        .collect()
}

async fn record(container: &str, turn: u64) -> Outcome<Record> {
    wait_until(&format!("turn record {turn} of {container}"), RECORD_TIMEOUT, || async {
        Ok(records(container)?.into_iter().find(|r| r.turn == turn))
    })
    .await
}

/// A long-lived exec fed through its stdin, its output read line by line.
struct Session {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Session {
    async fn start(sandbox: &Sandbox, exec_id: &str, argv: &[&str]) -> Outcome<Session> {
        let env = TestEnv::get();
        let mut args = vec!["task", "exec", "--exec-id", exec_id, "--cwd", "/app", sandbox.id()];
        args.extend_from_slice(argv);
        let mut child = tokio::process::Command::new("ctr")
            .args(env.ctr().full_args(args))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| HarnessError::io("starting ctr task exec", e))?;
        let stdin = child.stdin.take().expect("piped");
        let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        Ok(Session { child, stdin, lines })
    }

    /// Sends `line` followed by a statement that prints the clock; returns the stamp (unix ms).
    async fn run(&mut self, line: &str, stamp: &str) -> Outcome<i64> {
        self.run_within(line, stamp, Duration::from_secs(30)).await
    }

    async fn run_within(&mut self, line: &str, stamp: &str, deadline: Duration) -> Outcome<i64> {
        let text = format!("{line}\n{stamp}\n");
        self.stdin.write_all(text.as_bytes()).await.map_err(|e| HarnessError::io("writing to the session", e))?;
        self.stdin.flush().await.map_err(|e| HarnessError::io("writing to the session", e))?;
        loop {
            let next = tokio::time::timeout(deadline, self.lines.next_line())
                .await
                .map_err(|_| HarnessError::Timeout {
                    what: format!("the session's answer to {line:?}"),
                    after: deadline,
                })?
                .map_err(|e| HarnessError::io("reading the session", e))?;
            let Some(out) = next else {
                return Err(HarnessError::Expectation(format!("the session ended before answering {line:?}")));
            };
            if let Some(ns) = out.trim().strip_prefix("@@DONE ") {
                let ns: i64 =
                    ns.trim().parse().map_err(|_| HarnessError::Parse { what: "stamp".into(), detail: out.clone() })?;
                return Ok(ns / 1_000_000);
            }
        }
    }

    async fn close(mut self) -> Outcome<()> {
        drop(self.stdin);
        let _ = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await;
        Ok(())
    }
}

const SHELL_STAMP: &str = "echo \"@@DONE $(date +%s%N)\"";
const PYTHON_STAMP: &str = "print('@@DONE', time.time_ns())";

/// Feeds each command to a session and checks turns `first_turn..` against them; returns the
/// detection latencies (record end minus the session's last stamp), in ms.
async fn feed(
    sandbox: &Sandbox,
    session: &mut Session,
    stamp: &str,
    commands: &[Command],
    first_turn: u64,
    classes: &[TurnClass],
) -> Outcome<Vec<i64>> {
    let mut latencies = Vec::new();
    for (i, cmd) in commands.iter().enumerate() {
        let turn = first_turn + i as u64;
        let done_ms = session.run(cmd.line, stamp).await?;
        let rec = record(sandbox.id(), turn).await?;
        let latency = rec.ended_unix_ms - done_ms;
        println!(
            "  turn {turn:>2} {:<6} {:<5} {:>4} ms  {:<60} {}",
            rec.source,
            rec.class.name(),
            latency,
            cmd.line,
            rec.reasons.join("; ")
        );
        ensure_eq!(rec.source.as_str(), "stdin", "source of turn {turn} ({})", cmd.line);
        // The session ran the command, so its memory changed: a stdin turn is a process turn
        // unless the session is a shell whose answer stands for that memory. What the command
        // did besides must still show in the reasons.
        ensure_eq!(rec.class, classes[i], "class of turn {turn} ({}), reasons {:?}", cmd.line, rec.reasons);
        ensure!(
            rec.reasons.first().is_some_and(|r| r.contains("ran its input")),
            "turn {turn} ({}) does not name the session as the reason, reasons {:?}",
            cmd.line,
            rec.reasons
        );
        let own = &rec.reasons[1..];
        let own_class = match cmd.class {
            Clean => own.is_empty(),
            Fs => !own.is_empty() && own.iter().all(|r| r.contains("/app/")),
            Proc => own.iter().any(|r| r.contains("sleep")),
        };
        ensure!(
            own_class,
            "turn {turn} ({}) should have {} effects of its own, reasons {:?}",
            cmd.line,
            cmd.class.name(),
            own
        );
        ensure!(
            latency >= 0,
            "turn {turn} ended ({} ms) before its command printed its stamp ({done_ms} ms)",
            rec.ended_unix_ms
        );
        let bound = detection_bound_ms();
        ensure!(
            latency <= bound,
            "turn {turn} ({}) was seen over after {latency} ms (bound {bound} ms at this load)",
            cmd.line
        );
        latencies.push(latency);
        // The agent's think time: the turn stays over while nothing comes.
        tokio::time::sleep(Duration::from_millis(300)).await;
        ensure!(
            records(sandbox.id())?.iter().all(|r| r.turn <= turn),
            "a turn was recorded while the session waited for input"
        );
    }
    Ok(latencies)
}

fn summary(name: &str, latencies: &[i64]) {
    let mut sorted = latencies.to_vec();
    sorted.sort_unstable();
    if let (Some(min), Some(max)) = (sorted.first(), sorted.last()) {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!(
            "{name}: detection latency over {} turns: min {min} ms, median {} ms, max {max} ms (load {})",
            sorted.len(),
            sorted[sorted.len() / 2],
            load.split_whitespace().next().unwrap_or("?")
        );
    }
}

async fn stdin_mode_turns(
    argv: &[&str],
    stamp: &str,
    commands: Vec<Command>,
    setup: Option<&str>,
    classes: &[TurnClass],
) -> Outcome<(Vec<i64>, Vec<Record>)> {
    let name = format!("stdin-{}", argv[0]);
    let sandbox = Sandbox::start(&name, TERMINAL_IMAGE, &[("io.crab.turns", "stdin")], &[]).await?;
    let mut session = Session::start(&sandbox, "session", argv).await?;
    tokio::time::sleep(SESSION_START).await;
    if let Some(setup) = setup {
        session.run(setup, stamp).await?;
        // Setting up is a turn of its own.
        record(sandbox.id(), 1).await?;
    }
    let first = if setup.is_some() { 2 } else { 1 };
    let latencies = feed(&sandbox, &mut session, stamp, &commands, first, classes).await?;
    let all = records(sandbox.id())?;
    ensure_eq!(
        all.len() as u64,
        first - 1 + commands.len() as u64,
        "turns recorded (start-up makes none in stdin mode)"
    );
    session.close().await?;
    Ok((latencies, all))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_fed_through_stdin_makes_one_turn_per_command() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    // `sh` is no shell crab asks: every turn dumps it.
    let (latencies, _) = stdin_mode_turns(&["sh"], SHELL_STAMP, shell_commands(), None, &[Proc; 5]).await.unwrap();
    summary("sh, stdin mode", &latencies);
}

/// `bash` is asked for its state at each turn's end: a turn needs no dump once a process
/// checkpoint holds an answer of it, until it knows a job (its job table is process state).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_fed_through_stdin_dumps_only_what_its_answer_cannot_stand_for() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let commands = vec![
        command(Clean, "echo hi"),
        command(Clean, "cd /app; X=1"),
        command(Fs, "echo x > /app/f"),
        command(Clean, "read -r line < /etc/hostname"),
        command(Proc, "sleep 300 > /dev/null 2>&1 &"),
        command(Clean, "ls /app > /dev/null"),
    ];
    // The first turn dumps (no checkpoint holds an answer yet); the sleep's turn dumps, and
    // while bash knows the job every turn does.
    let classes = [Proc, Fs, Fs, Fs, Proc, Proc];
    let (latencies, records) = stdin_mode_turns(&["bash"], SHELL_STAMP, commands, None, &classes).await.unwrap();
    summary("bash, stdin mode", &latencies);
    let first_reasons: Vec<&str> = records.iter().filter_map(|r| r.reasons.first()).map(String::as_str).collect();
    assert!(first_reasons[0].contains("no process checkpoint holds"), "{first_reasons:?}");
    assert!(first_reasons[1].contains("a shell at its prompt"), "{first_reasons:?}");
    assert!(first_reasons[4].contains("it knows jobs"), "{first_reasons:?}");
    for record in &records {
        assert_eq!(record.shells.len(), 1, "turn {}: one shell asked: {:?}", record.turn, record.shells);
        let (ms, bytes, listed) = record.shells[0];
        assert!(bytes > 0, "turn {}: an answer", record.turn);
        println!("  turn {} asked in {ms:.2} ms, {bytes} bytes of answer, listed {listed}", record.turn);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_fed_through_stdin_makes_one_turn_per_statement() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let (latencies, _) = stdin_mode_turns(
        &["python3", "-u", "-i", "-q"],
        PYTHON_STAMP,
        python_commands(),
        Some("import os, time"),
        &[Proc; 5],
    )
    .await
    .unwrap();
    summary("python3 -i, stdin mode", &latencies);
}

/// `auto`: the session's start-up is an exec turn (a new live process), closed when it first waits
/// for input; each command after is a stdin turn; a short exec beside it is an exec turn; the
/// session's exit ends nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_turns_a_session_into_stdin_turns() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let run = async {
        let mut sandbox = Sandbox::start("auto-session", TERMINAL_IMAGE, &[("io.crab.turns", "auto")], &[]).await?;
        let mut session = Session::start(&sandbox, "session", &["bash"]).await?;
        let start = record(sandbox.id(), 1).await?;
        ensure_eq!(start.source.as_str(), "exec", "the session's start-up turn");
        ensure_eq!(start.class, Proc, "the session's start-up turn (a new live shell), reasons {:?}", start.reasons);
        // bash: asked at the start-up turn's dump, so its first commands need none.
        let latencies = feed(&sandbox, &mut session, SHELL_STAMP, &shell_commands()[..3], 2, &[Fs, Fs, Proc]).await?;
        let (out, _) = sandbox.exec("echo beside > /app/beside").await?;
        ensure!(out.status.success(), "exec beside the session: {}", out.stderr);
        let beside = record(sandbox.id(), 5).await?;
        ensure_eq!((beside.source.as_str(), beside.class), ("exec", Fs), "an exec beside the session");
        session.close().await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        ensure_eq!(records(sandbox.id())?.len(), 5, "the session's exit after its last turn makes no turn");
        Ok::<_, HarnessError>(latencies)
    };
    summary("bash, auto mode", &run.await.unwrap());
}

/// `crabctl turn ID mark` beside the shim containerd starts (`CRAB_SHIM_DIR`), else on PATH.
fn crabctl() -> PathBuf {
    std::env::var_os("CRAB_SHIM_DIR")
        .map(|dir| Path::new(&dir).join("crabctl"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| "crabctl".into())
}

async fn mark(container: &str) -> Outcome<serde_json::Value> {
    let output = tokio::process::Command::new(crabctl())
        .args(["turn", container, "mark", "--json"])
        .output()
        .await
        .map_err(|e| HarnessError::io("running crabctl turn mark", e))?;
    ensure!(output.status.success(), "crabctl turn {container} mark: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout)
        .map_err(|e| HarnessError::Parse { what: "crabctl turn mark --json".into(), detail: e.to_string() })
}

/// A raw Task Update with `io.crab.turn=<value>`, as any containerd client can send it.
async fn send_turn_annotation(container: &str, value: &str) -> Result<(), crab_containerd::grpc::GrpcError> {
    let env = TestEnv::get();
    crab_containerd::grpc::Containerd::new(&env.socket, &env.namespace).send_turn_annotation(container, value).await
}

/// `explicit`: execs make no turns; each mark ends the open turn (checkpointed before the call
/// returns) and begins the next; a bad mark value is refused naming the annotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_marks_bound_turns() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let run = async {
        let mut sandbox =
            Sandbox::start("explicit-marks", TERMINAL_IMAGE, &[("io.crab.turns", "explicit")], &[]).await?;
        for (script, class) in [
            ("echo a > /app/a && echo b > /app/b", Fs),
            ("nohup sleep 300 > /dev/null 2>&1 &", Proc),
            ("cat /app/a > /dev/null", Clean),
        ] {
            let (out, _) = sandbox.exec(script).await?;
            ensure!(out.status.success(), "{script}: {}", out.stderr);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let turns_before = records(sandbox.id())?.len();
            let reply = mark(sandbox.id()).await?;
            let ended = &reply["ended"];
            let turn = ended["turn"].as_u64().unwrap_or(0);
            println!(
                "  mark after {script:<40} -> turn {turn} {} ({:.0} ms)",
                ended["class"],
                reply["elapsed_ms"].as_f64().unwrap_or(0.0)
            );
            ensure_eq!(turn, turns_before as u64 + 1, "the turn the mark ended");
            // The reply comes once the turn is recorded (checkpointed).
            let rec = records(sandbox.id())?.into_iter().find(|r| r.turn == turn);
            let rec = rec
                .ok_or_else(|| HarnessError::Expectation(format!("turn {turn} not recorded when the mark returned")))?;
            ensure_eq!(
                (rec.source.as_str(), rec.class),
                ("mark", class),
                "turn {turn} after {script}, reasons {:?}",
                rec.reasons
            );
        }
        let refused = send_turn_annotation(sandbox.id(), "rollback").await;
        let Err(crab_containerd::grpc::GrpcError::Call { code, message, .. }) = refused else {
            return Err(HarnessError::Expectation(format!("io.crab.turn=rollback: {refused:?}")));
        };
        ensure_eq!(code, containerd_client::tonic::Code::InvalidArgument, "code for a bad mark ({message})");
        ensure!(message.contains("io.crab.turn") && message.contains("rollback"), "message: {message}");
        Ok::<_, HarnessError>(())
    };
    run.await.unwrap();
}

/// A mark in `exec` mode ends a running exec's turn and begins the next, which the exec still
/// holds until it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_splits_a_running_exec_turn() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let run = async {
        let mut sandbox = Sandbox::start("exec-mark", TERMINAL_IMAGE, &[("io.crab.turns", "exec")], &[]).await?;
        let id = sandbox.id().to_string();
        let marker = async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            mark(&id).await
        };
        let (exec, reply) = tokio::join!(sandbox.exec("echo one > /app/one; sleep 3; echo two > /app/two"), marker);
        ensure!(exec?.0.status.success(), "the long exec failed");
        let reply = reply?;
        ensure_eq!(reply["ended"]["turn"].as_u64(), Some(1), "the mark ended the exec's first part");
        let first = record(&id, 1).await?;
        let second = record(&id, 2).await?;
        // The exec's shell and its sleep are alive at the mark: process state.
        ensure_eq!((first.source.as_str(), first.class), ("mark", Proc), "first part, reasons {:?}", first.reasons);
        ensure!(
            first.reasons.iter().any(|r| r.contains("/app/one"))
                && !first.reasons.iter().any(|r| r.contains("/app/two")),
            "first part: {:?}",
            first.reasons
        );
        // They end in the second part, which the exec's exit closes.
        ensure_eq!((second.source.as_str(), second.class), ("exec", Proc), "second part, reasons {:?}", second.reasons);
        ensure!(second.reasons.iter().any(|r| r.contains("/app/two")), "second part: {:?}", second.reasons);
        Ok::<_, HarnessError>(())
    };
    run.await.unwrap();
}

/// Detection latencies by percentile: (p50, p99, max) in ms.
fn percentiles(latencies: &[i64]) -> (i64, i64, i64) {
    let mut sorted = latencies.to_vec();
    sorted.sort_unstable();
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), *sorted.last().expect("latencies"))
}

/// User plus system CPU time of `pid` in ms (`/proc/PID/stat` fields 14 and 15, in clock ticks).
fn cpu_ms(pid: u32) -> Outcome<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| HarnessError::io(format!("reading /proc/{pid}/stat"), e))?;
    let fields: Vec<&str> = stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // Fields 14 and 15 counted from 1; the slice starts at field 3.
    Ok((ticks(14 - 3) + ticks(15 - 3)) as f64 * 1000.0 / hz)
}

/// The stdin detector's cost: detection latency (p50/p99 over 40 quick commands and 30 that take
/// 0.3 s) and the shim's CPU time over 60 s while a session waits at its prompt, and while it runs
/// a quiet 60 s command (the detector samples all that time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn stdin_detection_cost() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let run = async {
        let sandbox = Sandbox::start("stdin-cost", TERMINAL_IMAGE, &[("io.crab.turns", "stdin")], &[]).await?;
        let mut session = Session::start(&sandbox, "session", &["sh"]).await?;
        tokio::time::sleep(SESSION_START).await;
        let mut turn = 0;
        for (name, line, count) in [("quick (true)", "true", 40), ("0.3 s (sleep 0.3)", "sleep 0.3", 30)] {
            let mut latencies = Vec::new();
            for _ in 0..count {
                turn += 1;
                let done_ms = session.run(line, SHELL_STAMP).await?;
                let rec = record(sandbox.id(), turn).await?;
                latencies.push(rec.ended_unix_ms - done_ms);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let (p50, p99, max) = percentiles(&latencies);
            println!("detection latency, {name}, {count} turns: p50 {p50} ms, p99 {p99} ms, max {max} ms");
        }
        let env = TestEnv::get();
        let shims = crab_integration::host::shim_daemons(&env.namespace, sandbox.id());
        let shim =
            *shims.first().ok_or_else(|| HarnessError::Expectation(format!("no shim serves {}", sandbox.id())))?;
        let minute = Duration::from_secs(60);
        let before = cpu_ms(shim)?;
        tokio::time::sleep(minute).await;
        let waiting = cpu_ms(shim)? - before;
        println!("shim CPU while the session waits for input for 60 s: {waiting:.0} ms");
        // The middle 60 s of a 62 s command: its turn's start and end (and checkpoint) fall outside.
        let quiet = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = cpu_ms(shim)?;
            tokio::time::sleep(minute).await;
            Ok::<_, HarnessError>(cpu_ms(shim)? - before)
        };
        let (ran, running) = tokio::join!(session.run_within("sleep 62", SHELL_STAMP, Duration::from_secs(90)), quiet);
        ran?;
        println!("shim CPU while the session runs a quiet command, 60 s: {:.0} ms", running?);
        session.close().await?;
        Ok::<_, HarnessError>(())
    };
    run.await.unwrap();
}
