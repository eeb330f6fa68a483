//! `crab::replay` against the real containerd of `scripts/containerd` (or
//! CRAB_CTRD_SOCK / CRAB_NS) with the `crab.local/terminal:latest` image:
//! a short trace that leaves a file and a background process behind, killed
//! after turn 2, under each recovery policy and each runtime of
//! CRAB_TEST_RUNTIMES (runc, crab or full names; default both).

use std::io::Write;
use std::path::PathBuf;

use crab::containerd::ctr::Ctr;
use crab::replay::report::PolicyRun;
use crab::replay::{FaultKind, FaultTurn, PolicyKind, ReplayError, ReplayOptions, replay};

const TRACE: &str = r#"{"trace": "replay-itest", "source": "crab tests", "mode": "exec", "workdir": "/app", "image": "terminal", "turns": 4}
{"turn": 1, "think_s": 0.5, "cmd": "mkdir -p data && echo hello > data/a.txt && chmod 600 data/a.txt", "timeout_s": 30}
{"turn": 2, "think_s": 0.5, "cmd": "nohup sleep 4321 >/dev/null 2>&1 & echo started", "timeout_s": 30}
{"turn": 3, "think_s": 0.5, "cmd": "cat data/a.txt && pgrep -xc sleep", "timeout_s": 30}
{"turn": 4, "think_s": 0.5, "cmd": "echo more >> data/a.txt && wc -c data/a.txt", "timeout_s": 30}
"#;

fn trace_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new()
        .suffix(".jsonl")
        .tempfile()
        .unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

fn runtimes() -> Vec<String> {
    let listed = std::env::var("CRAB_TEST_RUNTIMES").unwrap_or_else(|_| "runc,crab".to_string());
    listed
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| match name {
            "runc" => "io.containerd.runc.v2".to_string(),
            "crab" => "io.containerd.crab.v2".to_string(),
            full => full.to_string(),
        })
        .collect()
}

fn options(traces: Vec<PathBuf>, runtime: &str) -> ReplayOptions {
    ReplayOptions {
        traces,
        policies: vec![PolicyKind::EveryTurn, PolicyKind::ChatOnly, PolicyKind::Off],
        fault: FaultKind::KillProcesses,
        fault_turn: FaultTurn::Fixed(2),
        think_scale: 0.0,
        runtime: runtime.to_string(),
        ref_runs: 2,
        ctr: Ctr::from_env(),
    }
}

fn run_of(runs: &[PolicyRun], policy: PolicyKind) -> &PolicyRun {
    runs.iter().find(|run| run.policy == policy).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_restores_exactly_and_chat_only_loses_files_and_processes() {
    let file = trace_file(TRACE);
    for runtime in runtimes() {
        let reports = replay(&options(vec![file.path().to_path_buf()], &runtime))
            .await
            .unwrap_or_else(|error| panic!("replay under {runtime}: {error}"));
        let report = &reports[0];
        assert_eq!((report.turns, report.fault_turn), (4, Some(2)));
        assert_eq!(report.reference.runs, 2);
        assert!(
            report.reference.nondeterministic_turns.is_empty(),
            "{runtime}: {:?}",
            report.reference
        );

        let every_turn = run_of(&report.runs, PolicyKind::EveryTurn);
        let verdict = &every_turn.fault.as_ref().unwrap().verdict.as_ref().unwrap();
        assert_eq!(
            every_turn.recovered_correctly,
            Some(true),
            "{runtime}: every-turn {verdict:?}"
        );
        assert!(
            verdict.state_equal && verdict.turns_compared == [3, 4],
            "{runtime}: {verdict:?}"
        );
        assert_eq!(
            (every_turn.checkpoints, every_turn.checkpoint_failures),
            (4, 0)
        );
        assert!(every_turn.checkpoint_bytes > 0);
        assert!(
            every_turn
                .turns
                .iter()
                .all(|turn| turn.agent_visible_delay_s > 0.0)
        );
        // The restored `sleep 4321` is still there on turn 3: pid 1's sleep plus it.
        assert_eq!(every_turn.turns[2].rc, Some(0));

        let chat_only = run_of(&report.runs, PolicyKind::ChatOnly);
        let verdict = &chat_only.fault.as_ref().unwrap().verdict.as_ref().unwrap();
        assert_eq!(
            chat_only.recovered_correctly,
            Some(false),
            "{runtime}: chat-only {verdict:?}"
        );
        let keys: Vec<&str> = verdict
            .state_differences
            .iter()
            .map(|d| d.key.as_str())
            .collect();
        assert!(
            keys.contains(&"file:/app/data/a.txt"),
            "{runtime}: {keys:?}"
        );
        assert!(keys.contains(&"process:sleep 4321"), "{runtime}: {keys:?}");
        assert!(verdict.rc_mismatches.contains(&3), "{runtime}: {verdict:?}");
        assert_eq!((chat_only.checkpoints, chat_only.checkpoint_bytes), (0, 0));

        let off = run_of(&report.runs, PolicyKind::Off);
        let verdict = &off.fault.as_ref().unwrap().verdict.as_ref().unwrap();
        assert_eq!(off.recovered_correctly, Some(false));
        assert!(!verdict.recovery_possible);
    }
}

#[tokio::test]
async fn a_bad_trace_fails_before_any_sandbox_with_file_line_and_field() {
    let good = trace_file(TRACE);
    let bad = trace_file(&TRACE.replace(
        r#""turn": 3, "think_s": 0.5, "cmd""#,
        r#""turn": 3, "think_s": 0.5, "command""#,
    ));
    // The good trace comes first: nothing may run before every trace is checked.
    let error = replay(&options(
        vec![good.path().to_path_buf(), bad.path().to_path_buf()],
        "io.containerd.runc.v2",
    ))
    .await
    .unwrap_err();
    assert!(matches!(error, ReplayError::Trace(_)), "{error:?}");
    assert_eq!(
        error.to_string(),
        format!("{}:4: missing field `cmd`", bad.path().display())
    );
}

#[tokio::test]
async fn a_fault_turn_past_the_end_is_rejected() {
    let file = trace_file(TRACE);
    let mut options = options(vec![file.path().to_path_buf()], "io.containerd.runc.v2");
    options.fault_turn = FaultTurn::Fixed(5);
    let error = replay(&options).await.unwrap_err();
    assert!(
        error
            .to_string()
            .ends_with("fault turn 5 is outside the trace (turns 1..=4)"),
        "{error}"
    );
}
