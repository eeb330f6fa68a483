//! `crabctl config --json` prints the configuration the shims read (the file named by
//! `--config`, else $CRAB_CONFIG), every key present with its default filled in, under the
//! file's own table and key names; a bad file fails and names the file and the key.

use std::path::Path;
use std::process::{Command, Output};

fn config(args: &[&str], env: Option<&Path>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_crabctl"));
    cmd.arg("config").args(args).env_remove("CRAB_CONFIG");
    if let Some(path) = env {
        cmd.env("CRAB_CONFIG", path);
    }
    cmd.output().expect("running crabctl")
}

fn json(output: &Output) -> serde_json::Value {
    assert!(output.status.success(), "crabctl config failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("JSON")
}

#[test]
fn config_json_is_the_file_with_defaults_filled_in() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("crab.toml");
    std::fs::write(&file, "[node]\nsocket = \"/run/c-x/crabd.sock\"\nrate_mib_per_s = 50\n").unwrap();

    let c = json(&config(&["--json", "--config", file.to_str().unwrap()], None));
    assert_eq!(c["node"]["socket"], "/run/c-x/crabd.sock", "{c}");
    assert_eq!(c["node"]["rate_mib_per_s"], 50, "{c}");
    // Keys the file leaves out carry crab's defaults, under the file's table and key names.
    assert_eq!(c["node"]["burst_mib"], 64, "{c}");
    assert_eq!(c["checkpoint"]["state_dir"], "/var/lib/crab", "{c}");
    assert_eq!(c["checkpoint"]["policy"], "crab", "{c}");
    assert_eq!(c["checkpoint"]["restore_from_namespaces"], serde_json::json!([]), "{c}");
    assert_eq!(c["runtime"]["binary"], "runc", "{c}");
    assert_eq!(c["runtime"]["systemd_cgroup"], false, "{c}");
    assert_eq!(c["log"]["level"], "info", "{c}");

    // Without --json: the same configuration as a crab.toml, which reads back as it.
    let toml = config(&["--config", file.to_str().unwrap()], None);
    assert!(toml.status.success(), "{}", String::from_utf8_lossy(&toml.stderr));
    let written = dir.path().join("written.toml");
    std::fs::write(&written, &toml.stdout).unwrap();
    assert_eq!(json(&config(&["--json", "--config", written.to_str().unwrap()], None)), c);
}

#[test]
fn config_json_reads_the_file_named_by_crab_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("crab.toml");
    std::fs::write(&file, format!("[checkpoint]\nstate_dir = \"{}\"\n", dir.path().join("state").display())).unwrap();
    let c = json(&config(&["--json"], Some(&file)));
    assert_eq!(c["checkpoint"]["state_dir"], dir.path().join("state").to_str().unwrap(), "{c}");

    // --config wins over the environment.
    let other = dir.path().join("other.toml");
    std::fs::write(&other, "[log]\nlevel = \"debug\"\n").unwrap();
    let c = json(&config(&["--json", "--config", other.to_str().unwrap()], Some(&file)));
    assert_eq!(
        (c["log"]["level"].as_str(), c["checkpoint"]["state_dir"].as_str()),
        (Some("debug"), Some("/var/lib/crab"))
    );

    // A file named explicitly must exist: the shims would not fall back to the defaults either.
    let missing = dir.path().join("missing.toml");
    let out = config(&["--json"], Some(&missing));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(missing.to_str().unwrap()), "{stderr}");
}

#[test]
fn config_json_names_the_file_and_key_of_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("crab.toml");
    for (body, key) in [
        ("[node]\nrate_mib_per_s = 0\n", "node.rate_mib_per_s"),
        ("[checkpoint]\nstat_dir = \"/x\"\n", "stat_dir"),
        ("[runtime]\nroot = \"relative\"\n", "runtime.root"),
    ] {
        std::fs::write(&file, body).unwrap();
        let out = config(&["--json"], Some(&file));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{body}: a bad config must fail");
        assert!(out.stdout.is_empty(), "{body}: nothing on stdout for a script to read");
        assert!(stderr.contains(file.to_str().unwrap()) && stderr.contains(key), "{body}: {stderr}");
    }
}
