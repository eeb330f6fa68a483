//! The aggregation behind `scripts/eval` (scripts/lib/eval_report.py) on a
//! small synthetic evaluation: two traces under four policies and two fault
//! kinds, a fault-free batch at real think times, failed traces (one of them
//! reported since by a batch like the one it failed in), and
//! crab's turn classes for one trace.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn repo_root() -> PathBuf {
    crate_dir().join("../..")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn run_report(out: &Path) -> std::process::Output {
    Command::new("python3").arg(repo_root().join("scripts/lib/eval_report.py")).arg(out).output().expect("python3 runs")
}

fn close(value: &Value, expected: f64) -> bool {
    value.as_f64().is_some_and(|actual| (actual - expected).abs() < 1e-9)
}

#[test]
fn aggregates_the_synthetic_matrix() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&crate_dir().join("tests/fixtures/eval"), dir.path());
    let output = run_report(dir.path());
    assert!(output.status.success(), "eval_report.py failed: {}", String::from_utf8_lossy(&output.stderr));

    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    // Traces a and b; a under kill-processes, restart-containerd and fault-free
    // at real think times (raw/realtime/), b under kill-processes and node-loss.
    assert_eq!(summary["traces"], 2);
    assert_eq!(summary["reports"], 5);
    // c failed; b failed once too, in an earlier batch like the one that reported it since; a
    // failed in a stdin batch, and its exec reports do not stand for that.
    let failed: Vec<&str> =
        summary["failed_traces"].as_array().unwrap().iter().map(|f| f["trace"].as_str().unwrap()).collect();
    assert_eq!(failed, ["c", "a"]);
    assert_eq!(summary["failures_retried"][0]["trace"], "b");
    let policies = &summary["policies"];
    assert_eq!(policies.as_object().unwrap().len(), 4);

    // Correctness per policy and fault kind; fault-free reports do not count.
    let correctness = &summary["correctness"];
    assert!(close(&correctness["crab"]["kill-processes"]["pct"], 50.0));
    assert_eq!(correctness["crab"]["kill-processes"]["failed"][0], "b");
    assert!(close(&correctness["crab"]["node-loss"]["pct"], 100.0));
    assert!(close(&correctness["every-turn"]["kill-processes"]["pct"], 100.0));
    assert!(close(&correctness["every-turn"]["node-loss"]["pct"], 0.0));
    assert!(correctness["crab"].get("none").is_none());
    assert!(close(&correctness["off"]["restart-containerd"]["pct"], 100.0));
    // The headline counts the state-destroying faults only; restart-containerd is an availability check.
    assert_eq!((policies["crab"]["correct"].as_u64(), policies["crab"]["faulted"].as_u64()), (Some(2), Some(3)));
    assert_eq!(
        (policies["off"]["availability_correct"].as_u64(), policies["off"]["availability_faulted"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(close(&policies["off"]["correct_pct"], 0.0));

    // Bytes against every-turn's in the same reports: crab's fault-free run
    // has no every-turn beside it and stays out of the ratio. Crab's node-loss
    // run of b wrote 300 B but its chain references 450 B: it is charged 450;
    // its kill-processes run has no verified chain and is charged what it wrote.
    assert_eq!(policies["every-turn"]["checkpoint_bytes"], 8000);
    assert_eq!(policies["crab"]["checkpoint_bytes"], 900);
    assert_eq!(policies["crab"]["charged_bytes"], 1050);
    assert_eq!(policies["crab"]["referenced_bytes"], 450);
    assert_eq!(policies["crab"]["runs_without_store_check"], 1);
    assert!(close(&policies["crab"]["bytes_vs_every_turn"], 950.0 / 8000.0));
    assert!(close(&policies["every-turn"]["bytes_vs_every_turn"], 1.0));
    assert!(close(&policies["crab"]["bytes_vs_every_turn_in_containerd"], 950.0 / 4000.0));
    assert_eq!(policies["every-turn"]["checkpoint_exported_bytes"], 4000);
    // Of those, what every-turn pushed to the registry in b's node-loss run; the rest is archives.
    assert_eq!(policies["every-turn"]["checkpoint_pushed_bytes"], 1500);
    assert_eq!(policies["every-turn"]["checkpoint_archived_bytes"], 2500);
    // crab's shim pushed 120 B in b's node-loss run (turn 1, on node A; turn 2 ran on node B,
    // which pushes nothing): not part of what it wrote, and beside every-turn's pushes.
    assert_eq!(policies["crab"]["checkpoint_pushed_bytes"], 120);
    assert_eq!(policies["crab"]["checkpoint_archived_bytes"], 0);
    let pushed = &summary["node_loss_pushed"];
    assert_eq!(pushed["runs"], 1);
    assert_eq!((pushed["crab_bytes"].as_u64(), pushed["every_turn_bytes"].as_u64()), (Some(120), Some(1500)));
    assert!(close(&pushed["crab_vs_every_turn"], 120.0 / 1500.0));
    // Up to the fault turn both pushed from node A: crab 120 B, every-turn 1000 B (turn 1).
    let node_a = &pushed["up_to_fault_turn"];
    assert_eq!((node_a["turns"].as_u64(), node_a["crab_bytes"].as_u64()), (Some(1), Some(120)));
    assert_eq!(node_a["every_turn_bytes"], 1000);
    assert!(close(&node_a["crab_vs_every_turn"], 0.12));
    assert_eq!(
        pushed["notes"][0],
        "b: crab: turn 2 ran on node B, whose crab config has no auto_push: nothing pushed from there"
    );

    // Run time against off in the same report, fault-free and faulted apart.
    let run_time = &summary["run_time_vs_off"];
    assert!(close(&run_time["fault-free x1"]["crab"]["vs_off"], 100.5 / 100.0));
    assert!(close(&run_time["faulted x0"]["every-turn"]["vs_off"], 80.0 / 60.0));
    assert_eq!(run_time["faulted x0"]["crab"]["runs"], 4);

    // Nearest-rank percentiles of crab's per-turn delays 0.1, 0.3, 0.1, 0.3, 0.2, 0.4, 0.2, 0.4, 0, 0.
    assert!(close(&policies["crab"]["delay_p50_s"], 0.2));
    assert!(close(&policies["crab"]["delay_p99_s"], 0.4));
    assert_eq!(policies["crab"]["turns"], 10);

    let classes = &summary["classes"];
    assert_eq!(classes["turns"], 4);
    assert!(close(&classes["pct"]["clean"], 50.0));
    assert!(close(&classes["pct"]["fs"], 25.0));
    assert!(close(&classes["pct"]["proc"], 25.0));
    assert_eq!(classes["bytes"], 400);

    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    // Policies appear in the tables from least to most protection.
    let rows: Vec<usize> = ["| off |", "| chat-only |", "| every-turn |", "| crab |"]
        .iter()
        .map(|row| report.find(row).unwrap_or_else(|| panic!("no row {row} in {report}")))
        .collect();
    assert!(rows.windows(2).all(|pair| pair[0] < pair[1]), "{report}");
    assert!(report.contains("| policy | kill-processes | node-loss | state-destroying faults |"), "{report}");
    assert!(report.contains("| crab | 50% (1/2) | 100% (1/1) | **67%** (2/3) |"), "{report}");
    assert!(report.contains("| policy | restart-containerd | availability faults |"), "{report}");
    assert!(report.contains("| off | 100% (1/1) | **100%** (1/1) |"), "{report}");
    assert!(
        report.contains(
            "| crab | 67% (2/3) | 100% (1/1) | 10 (0) | 900 B | 1.0 KiB | 120 B pushed | 0.119x | 0.237x | 0.200 s | 0.400 s | 0.400 s |"
        ),
        "{report}"
    );
    // every-turn's bytes include its copy off the node (half of them in the fixture): archives,
    // and in b's node-loss run what it pushed to the registry, shown apart.
    assert!(
        report.contains(
            "| every-turn | 67% (2/3) | 100% (1/1) | 8 (0) | 7.8 KiB | 7.8 KiB | 2.4 KiB + 1.5 KiB pushed | 1.000x | 2.000x |"
        ),
        "{report}"
    );
    assert!(report.contains("## Pushed to the registry in node-loss runs"), "{report}");
    assert!(
        report.contains("| all turns | 1 | 120 B | 1.5 KiB | 0.080x |")
            && report.contains("| up to the fault turn (node A) | 1 | 120 B | 1000 B | 0.120x |"),
        "{report}"
    );
    assert!(report.contains("- b: crab: turn 2 ran on node B, whose crab config has no auto_push"), "{report}");
    assert!(report.contains("| fault-free x1 | crab | 100.5 s | 100.0 s | 1.005x | 1 |"), "{report}");
    assert!(report.contains("| checkpoint traffic | up to 87% less checkpoint traffic than every-turn | 88.1% less than every-turn (0.119x); 0.237x its writes into containerd alone |"), "{report}");
    assert!(
        report.contains(
            "| recovery correctness | chat-only 8% -> crab 100% | chat-only 33% -> crab 67% (state-destroying faults) |"
        ),
        "{report}"
    );
    assert!(
        report
            .contains("| run time | within 1.9% of fault-free run time | +0.5% vs off (fault-free, think times x1) |"),
        "{report}"
    );
    assert!(report.contains("`c`: image crab.local/missing not found"), "{report}");
    for plot in ["bytes", "run_time", "correctness", "classes"] {
        let svg = std::fs::read_to_string(dir.path().join(format!("plots/{plot}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("<rect"), "plots/{plot}.svg: {svg}");
    }
}

/// One trace under kill-shim whose verdicts name normalised and differing
/// turns, as `crab-replay --json-out` writes them.
const ORACLE_REPORT: &str = r#"[{"trace": "t", "file": "t.jsonl", "image": "terminal", "runtime": "io.containerd.crab.v2",
  "turns": 4, "fault": "kill-shim", "fault_turn": 1, "think_scale": 0.05,
  "reference": {"runs": 2, "run_time_s": 8.0, "nondeterministic_turns": [4], "normalised_turns": [2],
                "turns_with_wall_clock": [2, 3], "unsettled_turns": [3], "final_state": null,
                "state_changes": {"turns_seen": 4, "turns_changed": [1, 2, 4], "files_outside_old_scope": [2],
                                  "processes_or_sockets": [2, 4]}},
  "runs": [
    {"policy": "crab", "recovered_correctly": true, "checkpoints": 4, "checkpoint_failures": 0,
     "checkpoint_bytes": 10, "run_time_s": 4.0, "agent_delay": {"total_s": 0, "mean_s": 0, "median_s": 0, "max_s": 0},
     "turns": [],
     "fault": {"kind": "kill-shim", "turn": 1, "verdict": {"turns_compared": [2, 3], "turns_excluded": [4],
       "turns_normalised_wall_clock": [2], "turns_normalised_stderr_order": [3], "rc_mismatches": [],
       "output_mismatches": [], "output_differences": []}}},
    {"policy": "chat-only", "recovered_correctly": false, "checkpoints": 0, "checkpoint_failures": 0,
     "checkpoint_bytes": 0, "run_time_s": 4.0, "agent_delay": {"total_s": 0, "mean_s": 0, "median_s": 0, "max_s": 0},
     "turns": [],
     "fault": {"kind": "kill-shim", "turn": 1, "verdict": {"turns_compared": [2, 3], "turns_excluded": [4],
       "turns_normalised_wall_clock": [2], "turns_normalised_stderr_order": [], "rc_mismatches": [3],
       "output_mismatches": [3], "output_differences": [{"turn": 3, "stream": "stdout", "line": 1,
       "expected": "hello", "got": ""}], "states_compared": [2], "states_excluded": [4], "states_unsettled": [3],
       "state_mismatches": [2],
       "later_state_differences": [{"key": "file:/app/data/a.txt", "detail": "missing"}]}}}
  ]}]
"#;

#[test]
fn reports_what_the_oracle_compared_normalised_and_found() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("raw/oracle")).unwrap();
    std::fs::write(dir.path().join("raw/oracle/t.json"), ORACLE_REPORT).unwrap();
    std::fs::create_dir_all(dir.path().join("meta")).unwrap();
    std::fs::write(dir.path().join("meta/oracle.json"), r#"{"reference spacing (s)": "61"}"#).unwrap();
    let output = run_report(dir.path());
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));

    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    let crab = &summary["oracle"]["policies"]["crab"];
    assert_eq!(
        (
            &crab["turns_compared"],
            &crab["turns_excluded"],
            &crab["normalised_wall_clock"],
            &crab["normalised_stderr_order"]
        ),
        (&Value::from(2), &Value::from(1), &Value::from(1), &Value::from(1))
    );
    assert_eq!(summary["oracle"]["traces"]["t"]["normalised_turns"], serde_json::json!([2]));
    // Turn 2 changed a file outside the old scope and a process, turn 4 a process: 2 turns.
    assert_eq!(
        summary["oracle"]["state_changes"],
        serde_json::json!({"traces": 1, "traces_without": 0, "turns_seen": 4, "turns_changed": 3,
                           "files_outside_old_scope": 1, "processes_or_sockets": 2, "unseen_by_old_oracle": 2})
    );
    // Only incorrect runs list where their output differed.
    let differences = summary["oracle"]["output_differences"].as_array().unwrap();
    assert_eq!(differences.len(), 1);
    assert_eq!((&differences[0]["policy"], &differences[0]["turn"]), (&Value::from("chat-only"), &Value::from(3)));

    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    // The crab run's report predates the later states: none counted.
    assert!(report.contains("| crab | 1 | 2 | 1 | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 0 |"), "{report}");
    // chat-only's state after turn 3 was looked at unsettled (a process left running still busy).
    assert!(report.contains("| chat-only | 1 | 2 | 1 | 1 | 0 | 0 | 1 | 1 | 1 | 1 | 1 | 1 |"), "{report}");
    assert!(report.contains("| t | 4 | 4 | 2, 3 | 2 | 3 |"), "{report}");
    assert!(report.contains("at least 61 s apart"), "{report}");
    assert!(
        report.contains("of 4 turns, 3 changed it; 1 changed files outside the working directory")
            && report.contains("connections: 2 turns changed state that an oracle"),
        "{report}"
    );
    assert!(
        report.contains("- chat-only / kill-shim / `t` turn 3 stdout line 1: expected `hello`, got ``"),
        "{report}"
    );
    assert!(report.contains("- chat-only / kill-shim / `t` after turn 2: `file:/app/data/a.txt`: missing"), "{report}");
}

#[test]
fn a_rerun_batch_replaces_the_reports_it_reran_and_only_those() {
    let dir = tempfile::tempdir().unwrap();
    let write = |path: &str, text: &str| {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    // The first batch judged crab incorrect under kill-shim; its rerun of
    // kill-shim judged it correct. The first batch's node-loss report stays.
    let incorrect = ORACLE_REPORT.replace(r#""recovered_correctly": true"#, r#""recovered_correctly": false"#);
    let node_loss = ORACLE_REPORT.replace("kill-shim", "node-loss");
    write("raw/first/t.json", &format!("[{}, {}]", strip_list(&incorrect), strip_list(&node_loss)));
    write("raw/rerun/t.json", ORACLE_REPORT);
    write("meta/first.json", r#"{"faults": "kill-shim,node-loss"}"#);
    write("meta/rerun.json", r#"{"faults": "kill-shim", "replaces": "first"}"#);
    let output = run_report(dir.path());
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["reports"], 2);
    assert_eq!(summary["correctness"]["crab"]["kill-shim"]["correct"], 1);
    assert_eq!(summary["correctness"]["crab"]["kill-shim"]["faulted"], 1);
    assert_eq!(summary["correctness"]["crab"]["node-loss"]["faulted"], 1);
    assert_eq!(
        summary["replaced_reports"],
        serde_json::json!([{"batch": "first", "trace": "t", "fault": "kill-shim", "by": "rerun"}])
    );
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("1 kill-shim report(s) of batch `first` replaced by batch `rerun`"), "{report}");

    // Replacing a batch that does not exist is a mistake worth stopping for.
    write("meta/rerun.json", r#"{"faults": "kill-shim", "replaces": "frist"}"#);
    let output = run_report(dir.path());
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("replaces batch frist"), "{stderr}");
}

/// The one report inside a JSON list.
fn strip_list(list: &str) -> &str {
    let list = list.trim();
    &list[1..list.len() - 1]
}

#[test]
fn missing_raw_results_are_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let output = run_report(dir.path());
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("raw") && stderr.contains("no such directory"), "{stderr}");
}

/// A kill-crabd report in which every policy ran (as the batches before the baselines were left
/// out of kill-crabd did) and one in which only crab ran and the baselines are listed as not run.
fn kill_crabd_report(trace: &str, baselines_ran: bool) -> String {
    let run = |policy: &str| {
        serde_json::json!({"policy": policy, "recovered_correctly": true, "checkpoints": 2, "checkpoint_failures": 0,
            "checkpoint_bytes": 100, "run_time_s": 5.0, "turns": [{"turn": 1, "agent_visible_delay_s": 0.5}],
            "fault": {"kind": "kill-crabd", "turn": 1}})
    };
    let baselines = ["off", "chat-only", "every-turn"];
    let runs: Vec<Value> = if baselines_ran {
        baselines.iter().chain(&["crab"]).map(|policy| run(policy)).collect()
    } else {
        vec![run("crab")]
    };
    let not_run: Vec<Value> = if baselines_ran {
        Vec::new()
    } else {
        baselines.iter().map(|policy| serde_json::json!({"policy": policy, "why": "its shim saves nothing"})).collect()
    };
    serde_json::json!([{"trace": trace, "file": format!("{trace}.jsonl"), "image": "terminal",
        "runtime": "io.containerd.crab.v2", "turns": 2, "fault": "kill-crabd", "fault_turn": 1, "think_scale": 0.0,
        "reference": {"runs": 2, "run_time_s": 8.0, "nondeterministic_turns": [], "final_state": null},
        "runs": runs, "not_run": not_run}])
    .to_string()
}

/// kill-crabd strikes nothing of the baselines: they are not counted under it, whether a batch
/// ran them (before the rule) or not, and the report says n/a and why.
#[test]
fn the_baselines_are_not_counted_under_kill_crabd_in_old_or_new_batches() {
    let dir = tempfile::tempdir().unwrap();
    for (batch, trace, baselines_ran) in [("old", "t", true), ("new", "u", false)] {
        std::fs::create_dir_all(dir.path().join("raw").join(batch)).unwrap();
        std::fs::write(dir.path().join(format!("raw/{batch}/{trace}.json")), kill_crabd_report(trace, baselines_ran))
            .unwrap();
    }
    let output = run_report(dir.path());
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    let correctness = summary["correctness"].as_object().unwrap();
    assert_eq!(correctness.keys().collect::<Vec<_>>(), ["crab"], "{correctness:?}");
    assert_eq!(correctness["crab"]["kill-crabd"]["faulted"], 2);
    for policy in ["off", "chat-only", "every-turn"] {
        assert!(summary["not_run"]["kill-crabd"][policy].as_str().unwrap().contains("never start or use crabd"));
        assert!(summary["policies"].get(policy).is_none(), "{policy} counted: {}", summary["policies"]);
    }
    assert_eq!(summary["policies"]["crab"]["availability_faulted"], 2);
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("| every-turn | n/a | n/a |"), "{report}");
    assert!(report.contains("| crab | 100% (2/2) | **100%** (2/2) |"), "{report}");
    assert!(
        report.contains("n/a: kill-crabd is not run for off, chat-only, every-turn: their shims save nothing"),
        "{report}"
    );
}
