//! The aggregation behind `scripts/eval` (scripts/lib/eval_report.py) on a
//! small synthetic evaluation: two traces under four policies, one failed
//! trace, and crab's turn classes for one trace.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
    Command::new("python3")
        .arg(repo_root().join("scripts/lib/eval_report.py"))
        .arg(out)
        .output()
        .expect("python3 runs")
}

fn close(value: &Value, expected: f64) -> bool {
    value
        .as_f64()
        .is_some_and(|actual| (actual - expected).abs() < 1e-9)
}

#[test]
fn aggregates_the_synthetic_matrix() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&repo_root().join("tests/fixtures/eval"), dir.path());
    let output = run_report(dir.path());
    assert!(
        output.status.success(),
        "eval_report.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );

    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["traces"], 2);
    assert_eq!(summary["failed_traces"][0]["trace"], "c");
    let policies = &summary["policies"];
    assert_eq!(policies.as_object().unwrap().len(), 4);

    assert!(close(&policies["off"]["correct_pct"], 0.0));
    assert!(close(&policies["chat-only"]["correct_pct"], 50.0));
    assert!(close(&policies["every-turn"]["correct_pct"], 100.0));
    assert_eq!(
        (
            policies["crab"]["correct"].as_u64(),
            policies["crab"]["faulted"].as_u64()
        ),
        (Some(1), Some(2))
    );

    assert_eq!(policies["every-turn"]["checkpoint_bytes"], 4000);
    assert_eq!(policies["crab"]["checkpoint_bytes"], 400);
    assert!(close(&policies["crab"]["bytes_vs_every_turn"], 0.1));
    assert!(close(&policies["every-turn"]["bytes_vs_every_turn"], 1.0));

    // Baseline: one reference run per trace (2 runs of 20 s and of 40 s) = 10 s + 20 s.
    assert!(close(&policies["crab"]["baseline_s"], 30.0));
    assert!(close(
        &policies["crab"]["run_time_vs_fault_free"],
        31.0 / 30.0
    ));
    assert!(close(
        &policies["every-turn"]["run_time_vs_fault_free"],
        40.0 / 30.0
    ));

    // Nearest-rank percentiles of crab's per-turn delays 0.1, 0.3, 0.2, 0.4.
    assert!(close(&policies["crab"]["delay_p50_s"], 0.2));
    assert!(close(&policies["crab"]["delay_p99_s"], 0.4));
    assert_eq!(policies["crab"]["turns"], 4);

    let classes = &summary["classes"];
    assert_eq!(classes["turns"], 4);
    assert!(close(&classes["pct"]["clean"], 50.0));
    assert!(close(&classes["pct"]["fs"], 25.0));
    assert!(close(&classes["pct"]["proc"], 25.0));
    assert_eq!(classes["bytes"], 400);

    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    // Policies appear in the table from least to most protection.
    let rows: Vec<usize> = ["| off |", "| chat-only |", "| every-turn |", "| crab |"]
        .iter()
        .map(|row| {
            report
                .find(row)
                .unwrap_or_else(|| panic!("no row {row} in {report}"))
        })
        .collect();
    assert!(rows.windows(2).all(|pair| pair[0] < pair[1]), "{report}");
    assert!(
        report
            .contains("| crab | 50% (1/2) | 4 (0) | 400 B | 10.0% | 1.033x | 0.200 s | 0.400 s |"),
        "{report}"
    );
    assert!(report.contains("| checkpoint traffic | up to 87% less checkpoint traffic than every-turn | 90.0% less than every-turn |"), "{report}");
    assert!(
        report.contains("`c`: image crab.local/missing not found"),
        "{report}"
    );
    for plot in ["bytes", "run_time", "correctness", "classes"] {
        let svg = std::fs::read_to_string(dir.path().join(format!("plots/{plot}.svg"))).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("<rect"),
            "plots/{plot}.svg: {svg}"
        );
    }
}

#[test]
fn missing_raw_results_are_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let output = run_report(dir.path());
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("raw") && stderr.contains("no such directory"),
        "{stderr}"
    );
}
