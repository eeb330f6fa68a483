//! The stdin and tmux replay modes against the real containerd of
//! `scripts/containerd` with the crab runtime and `crab.local/terminal:latest`:
//! a three-turn trace that leaves state in the shell itself (a working
//! directory and an exported variable), killed after turn 2 under the crab
//! policy and every-turn. The shell's state shows in turn 3's output, so the
//! oracle tells a shell that came back (crab re-attaches the restored
//! session) from one that was restarted (every-turn cannot re-attach).

use std::io::Write;
use std::path::PathBuf;

use crab_containerd::Ctr;
use crab_replay::report::PolicyRun;
use crab_replay::{Daemons, FaultKind, FaultTurn, PolicyKind, ReplayMode, ReplayOptions, replay};

const TRACE: &str = r#"{"trace": "modes-itest", "source": "crab tests", "mode": "exec", "workdir": "/app", "image": "terminal", "turns": 3}
{"turn": 1, "think_s": 0.1, "cmd": "mkdir -p /app/sub && cd /app/sub && export CRAB_V=kept && echo one > f1 && printf 'no newline'", "timeout_s": 30}
{"turn": 2, "think_s": 0.1, "cmd": "echo \"v=$CRAB_V\"; pwd; echo warn >&2; (exit 3)", "timeout_s": 30}
{"turn": 3, "think_s": 0.1, "cmd": "echo \"v=$CRAB_V\"; pwd; cat f1", "timeout_s": 30}
"#;

fn trace_file() -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    file.write_all(TRACE.as_bytes()).unwrap();
    file
}

fn options(trace: PathBuf, mode: ReplayMode) -> ReplayOptions {
    ReplayOptions {
        traces: vec![trace],
        policies: vec![PolicyKind::Crab, PolicyKind::EveryTurn],
        faults: vec![FaultKind::KillProcesses],
        fault_turn: FaultTurn::Fixed(2),
        think_scale: 0.0,
        runtime: "io.containerd.crab.v2".to_string(),
        ref_runs: 1,
        ref_spacing: std::time::Duration::ZERO,
        ctr: Ctr::from_env(),
        daemons: Daemons::from_env(),
        checkpoint_dir: std::env::var_os("CRAB_REPLAY_CHECKPOINT_DIR")
            .map_or_else(|| crab_replay::cli::DEFAULT_CHECKPOINT_DIR.into(), PathBuf::from),
        packages: None,
        mode,
    }
}

fn run_of(runs: &[PolicyRun], policy: PolicyKind) -> &PolicyRun {
    runs.iter().find(|run| run.policy == policy).unwrap()
}

fn sha(text: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_mode_keeps_one_shell_and_crab_reattaches_it_after_a_kill() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let file = trace_file();
    let reports = replay(&options(file.path().to_path_buf(), ReplayMode::Stdin)).await.unwrap();
    let report = &reports[0];
    assert_eq!(report.mode, ReplayMode::Stdin);
    let crab = run_of(&report.runs, PolicyKind::Crab);
    // The sentinel gave each command's status and both streams, whole.
    let rcs: Vec<Option<i32>> = crab.turns.iter().map(|turn| turn.rc).collect();
    assert_eq!(rcs, [Some(0), Some(3), Some(0)], "{crab:#?}");
    assert_eq!(crab.turns[0].stdout_sha256, sha("no newline"));
    assert_eq!(crab.turns[1].stdout_sha256, sha("v=kept\n/app/sub\n"), "turn 2 ran in turn 1's shell");
    assert_eq!(crab.turns[1].stderr_sha256, sha("warn\n"));
    // The turns were the shell's stdin turns, each with its record.
    assert!(crab.turns.iter().all(|turn| turn.checkpoint_class.is_some()), "{:?}", crab.turns);
    let fault = crab.fault.as_ref().unwrap();
    let verdict = fault.verdict.as_ref().unwrap_or_else(|| panic!("crab: recovery failed: {:?}", fault.error));
    assert_eq!(crab.recovered_correctly, Some(true), "crab: {verdict:?} {fault:?}");
    assert_eq!(crab.turns[2].stdout_sha256, sha("v=kept\n/app/sub\none\n"), "the re-attached shell kept its state");
    // every-turn restores the container but cannot give the agent its shell
    // back: a new one has neither the directory nor the variable, and the
    // oracle says so.
    // Its new shell has an exec id of its own: the restored one, which the
    // runtime holds under the old id, is not handed to it.
    let every_turn = run_of(&report.runs, PolicyKind::EveryTurn);
    let rcs: Vec<Option<i32>> = every_turn.turns.iter().map(|turn| turn.rc).collect();
    assert_eq!(rcs, [Some(0), Some(3), Some(1)], "{every_turn:#?}");
    assert_eq!(
        every_turn.turns[2].stdout_sha256,
        sha("v=\n/app\n"),
        "a new shell, in the workdir, without the variable"
    );
    assert_eq!(every_turn.recovered_correctly, Some(false), "{:?}", every_turn.fault);
}

/// Turn 2 changes only the shell's own state (and one file): a shell turn, which crab
/// checkpoints without a dump; the fault after it makes recovery bring that state back onto
/// turn 1's process images.
const SHELL_TRACE: &str = r#"{"trace": "shell-turns-itest", "source": "crab tests", "mode": "exec", "workdir": "/app", "image": "terminal", "turns": 3}
{"turn": 1, "think_s": 0.1, "cmd": "mkdir -p /app/sub && export A=1", "timeout_s": 30}
{"turn": 2, "think_s": 0.1, "cmd": "cd /app/sub; B='two words'; f() { echo \"f:$A:$B\"; }; alias hi='echo hi'; umask 027; set -o pipefail; echo made > m", "timeout_s": 30}
{"turn": 3, "think_s": 0.1, "cmd": "pwd; echo \"A=$A B=$B\"; f; alias; umask; [[ -o pipefail ]] && echo pipefail-on; cat m", "timeout_s": 30}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_mode_shell_turns_skip_the_dump_and_recovery_brings_the_shell_state_back() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let mut file = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    file.write_all(SHELL_TRACE.as_bytes()).unwrap();
    let options =
        ReplayOptions { policies: vec![PolicyKind::Crab], ..options(file.path().to_path_buf(), ReplayMode::Stdin) };
    let reports = replay(&options).await.unwrap();
    let crab = run_of(&reports[0].runs, PolicyKind::Crab);
    let classes: Vec<Option<&str>> = crab.turns.iter().map(|turn| turn.checkpoint_class.as_deref()).collect();
    // Turn 1 dumps the shell (no process checkpoint held an answer of it yet); turn 2 changed
    // only files and the shell's own state.
    assert_eq!(classes[..2], [Some("proc"), Some("fs")], "{crab:#?}");
    let fault = crab.fault.as_ref().unwrap();
    assert!(fault.verdict.is_some(), "crab: recovery failed: {:?}", fault.error);
    assert_eq!(crab.recovered_correctly, Some(true), "crab: {fault:?}");
    assert_eq!(
        crab.turns[2].stdout_sha256,
        sha("/app/sub\nA=1 B=two words\nf:1:two words\nalias hi='echo hi'\n0027\npipefail-on\nmade\n"),
        "the recovered shell has turn 2's state, not turn 1's: {:?}",
        crab.turns[2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tmux_mode_types_into_one_session_and_reads_its_pane() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let file = trace_file();
    let reports = replay(&options(file.path().to_path_buf(), ReplayMode::Tmux)).await.unwrap();
    let report = &reports[0];
    assert_eq!(report.mode, ReplayMode::Tmux);
    let crab = run_of(&report.runs, PolicyKind::Crab);
    let rcs: Vec<Option<i32>> = crab.turns.iter().map(|turn| turn.rc).collect();
    assert_eq!(rcs, [Some(0), Some(3), Some(0)]);
    assert_eq!(crab.turns[0].stdout_sha256, sha("no newline"));
    // A terminal shows stderr among stdout.
    assert_eq!(crab.turns[1].stdout_sha256, sha("v=kept\n/app/sub\nwarn\n"), "turn 2 ran in turn 1's shell");
    let fault = crab.fault.as_ref().unwrap();
    let verdict = fault.verdict.as_ref().unwrap_or_else(|| panic!("crab: recovery failed: {:?}", fault.error));
    assert_eq!(crab.recovered_correctly, Some(true), "crab: {verdict:?} {fault:?}");
    assert_eq!(crab.turns[2].stdout_sha256, sha("v=kept\n/app/sub\none\n"));
    // The tmux server and its shell are processes: every-turn restores them too.
    let every_turn = run_of(&report.runs, PolicyKind::EveryTurn);
    assert_eq!(every_turn.recovered_correctly, Some(true), "{:?}", every_turn.fault);
}

/// The density benchmark's runs: no reference run, nothing judged, and so no look at the
/// sandbox between turns; the policy's turns and checkpoints happen as in a judged run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unjudged_run_replays_only_the_policy_runs() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let file = trace_file();
    let mut options = options(file.path().to_path_buf(), ReplayMode::Tmux);
    options.ref_runs = 0;
    options.policies = vec![PolicyKind::Crab];
    options.faults = vec![FaultKind::None];
    let reports = replay(&options).await.unwrap();
    let report = &reports[0];
    assert_eq!(report.reference.runs, 0, "no reference run");
    assert_eq!(report.reference.final_state, None);
    assert_eq!(report.runs.len(), 1);
    let crab = run_of(&report.runs, PolicyKind::Crab);
    assert_eq!(crab.recovered_correctly, None, "nothing judged");
    let rcs: Vec<Option<i32>> = crab.turns.iter().map(|turn| turn.rc).collect();
    assert_eq!(rcs, [Some(0), Some(3), Some(0)]);
    assert_eq!(crab.turns[2].stdout_sha256, sha("v=kept\n/app/sub\none\n"), "one session throughout");
    assert!(crab.turns.iter().all(|turn| turn.checkpoint_class.is_some()), "every turn recorded: {:?}", crab.turns);
    let text = crab_replay::report::render(&reports);
    assert!(text.contains("reference: none (--ref-runs 0), nothing judged"), "{text}");

    // A fault needs the reference runs that judge its recovery.
    options.faults = vec![FaultKind::KillProcesses];
    let error = replay(&options).await.unwrap_err().to_string();
    assert!(error.contains("--ref-runs 0") && error.contains("--fault none"), "{error}");
}
