//! `crabctl` finds the store the shims of its host write to: `[checkpoint] state_dir` of the
//! crab config they read ($CRAB_CONFIG), unless `--state-dir` or $CRAB_STATE_DIR names one;
//! a bad config file is named. No containerd needed: `turns` only reads the store.

use std::path::Path;
use std::process::{Command, Output};

use crab_store::turns::{Policy, RecordedClass, RuntimeExec, TurnLog, TurnRecord, TurnSource};

fn record(turn: u64) -> TurnRecord {
    TurnRecord {
        turn,
        exec_id: Some(format!("e{turn}")),
        source: TurnSource::Exec,
        started_unix_ms: 1,
        ended_unix_ms: 2,
        class: RecordedClass::Fs,
        external: false,
        escalated: false,
        reasons: vec!["open /app/x".into()],
        checkpoint_turn: Some(turn),
        superseded_by: None,
        bytes_written: 10,
        capture_ms: 0.1,
        dump_ms: None,
        checkpoint_ms: 0.2,
        policy: Policy::Crab,
        dump_failures: Vec::new(),
        over_quota: None,
        runtime_execs: Vec::new(),
        shells: Vec::new(),
        next_pid: None,
    }
}

fn turns(config: Option<&Path>, state_env: Option<&Path>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_crabctl"));
    cmd.args(["turns", "sb", "--json"])
        .env_remove("CRAB_STATE_DIR")
        .env_remove("CRAB_CONFIG")
        .env_remove("CRAB_NS")
        .env_remove("CONTAINERD_NAMESPACE");
    if let Some(config) = config {
        cmd.env("CRAB_CONFIG", config);
    }
    if let Some(state) = state_env {
        cmd.env("CRAB_STATE_DIR", state);
    }
    cmd.output().expect("running crabctl")
}

fn turn_numbers(output: &Output) -> Vec<u64> {
    assert!(output.status.success(), "crabctl failed: {}", String::from_utf8_lossy(&output.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    rows.as_array().expect("an array").iter().filter_map(|r| r["turn"].as_u64()).collect()
}

#[test]
fn crabctl_reads_the_store_named_by_the_shims_config() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    TurnLog::open(&state, "default/sb").unwrap().append(&record(1)).unwrap();
    TurnLog::open(&state, "default/sb").unwrap().append(&record(2)).unwrap();
    let config = dir.path().join("crab.toml");
    std::fs::write(&config, format!("[checkpoint]\nstate_dir = \"{}\"\n", state.display())).unwrap();

    assert_eq!(turn_numbers(&turns(Some(&config), None)), vec![1, 2], "the config's store");
    let other = dir.path().join("other");
    assert_eq!(turn_numbers(&turns(Some(&config), Some(&other))), Vec::<u64>::new(), "CRAB_STATE_DIR wins");

    std::fs::write(&config, "[checkpoint]\nstat_dir = \"/x\"\n").unwrap();
    let bad = turns(Some(&config), None);
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success(), "a bad config must fail");
    assert!(stderr.contains(&config.display().to_string()) && stderr.contains("stat_dir"), "{stderr}");
}

/// Turn logs are kept per containerd namespace: crabctl reads the one of `--namespace`, else
/// `CRAB_NS`, else `CONTAINERD_NAMESPACE`, else containerd's `default`, and never another
/// namespace's log of the same id.
#[test]
fn crabctl_reads_the_turn_log_of_its_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    TurnLog::open(&state, "default/sb").unwrap().append(&record(1)).unwrap();
    TurnLog::open(&state, "tenant-b/sb").unwrap().append(&record(7)).unwrap();
    let run_with = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_crabctl"));
        cmd.args(["turns", "sb", "--json"]).args(args).env("CRAB_STATE_DIR", &state);
        cmd.env_remove("CRAB_NS").env_remove("CONTAINERD_NAMESPACE").envs(env.iter().copied());
        cmd.output().expect("running crabctl")
    };
    let run = |args: &[&str], ns_env: Option<&str>| run_with(args, ns_env.map(|ns| ("CRAB_NS", ns)).as_slice());
    assert_eq!(turn_numbers(&run(&[], None)), vec![1], "the default namespace's log");
    assert_eq!(turn_numbers(&run(&["--namespace", "tenant-b"], None)), vec![7]);
    assert_eq!(turn_numbers(&run(&[], Some("tenant-b"))), vec![7], "CRAB_NS");
    // What ctr and nerdctl read, so crabctl finds a sandbox of a real containerd (CRI's k8s.io).
    assert_eq!(turn_numbers(&run_with(&[], &[("CONTAINERD_NAMESPACE", "tenant-b")])), vec![7], "CONTAINERD_NAMESPACE");
    let both = [("CRAB_NS", "default"), ("CONTAINERD_NAMESPACE", "tenant-b")];
    assert_eq!(turn_numbers(&run_with(&[], &both)), vec![1], "CRAB_NS before CONTAINERD_NAMESPACE");
    assert_eq!(turn_numbers(&run(&["-n", "tenant-c"], None)), Vec::<u64>::new(), "no log in tenant-c");
    let bad = run(&["--namespace", "../tenant-b"], None);
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && stderr.contains("namespace") && stderr.contains("../tenant-b"), "{stderr}");
    assert!(
        std::fs::read_dir(state.join("turns")).unwrap().all(|e| e.unwrap().path().is_dir()),
        "namespaces are directories"
    );
}

/// An exec the runtime ran (not crab-init's spawner) is named in `crabctl turns`, as text and as
/// JSON, with why and what a restore of the turn lacks.
#[test]
fn turns_name_execs_that_went_through_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let log = TurnLog::open(&state, "default/sb").unwrap();
    log.append(&record(1)).unwrap();
    let session = RuntimeExec { exec_id: "shell".into(), reason: "spawner unavailable: refused".into(), running: true };
    log.append(&TurnRecord { runtime_execs: vec![session.clone()], ..record(2) }).unwrap();
    let run = |json: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_crabctl"));
        cmd.args(["turns", "sb"])
            .env("CRAB_STATE_DIR", &state)
            .env_remove("CRAB_CONFIG")
            .env_remove("CRAB_NS")
            .env_remove("CONTAINERD_NAMESPACE");
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("running crabctl");
        assert!(out.status.success(), "crabctl failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(false);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(!lines[1].contains("runtime"), "turn 1 had no runtime exec: {text}");
    assert!(
        lines[2].contains("exec shell runs through the runtime (spawner unavailable: refused)")
            && lines[2].contains("not restorable"),
        "{text}"
    );
    let rows: serde_json::Value = serde_json::from_str(&run(true)).unwrap();
    assert!(rows[0].get("runtime_execs").is_none(), "{rows}");
    assert_eq!(
        rows[1]["runtime_execs"],
        serde_json::json!([{"exec_id": "shell", "reason": "spawner unavailable: refused", "running": true}])
    );
}
