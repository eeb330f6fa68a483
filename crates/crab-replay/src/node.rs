//! The two nodes of a `node-loss` fault.
//!
//! Node A is the replay's own containerd. For a run that will lose it, a crab
//! sandbox gets a crab config of its own ([`NodeA`]): its store, kept images
//! and runc root in one directory of the run, which the fault deletes, and
//! `[remote]` with the registry of node B's config, so the shim pushes each
//! checkpointed turn off the node by itself. Node B ([`NodeB`]) is a second
//! containerd and crab on this machine with directories of its own: the
//! sandbox comes back there from what left node A before the fault.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crab_containerd::Ctr;
use tokio::process::Command;

use super::ReplayError;

/// How long one crabctl call on node B may take (a pull and a restore of a large sandbox).
const CRABCTL_TIMEOUT: Duration = Duration::from_secs(300);

/// Node B: a second containerd and crab configuration on this machine.
#[derive(Debug, Clone)]
pub struct NodeB {
    /// B's containerd, in the replay's namespace.
    pub ctr: Ctr,
    /// B's crab config: its store, kept images, runc root and crabd socket, and in `[remote]`
    /// the registry both nodes use.
    pub config_path: PathBuf,
    pub config: crab_config::Config,
    /// The crabctl binary, run with B's config and containerd for B's side of a recovery.
    pub crabctl: PathBuf,
}

impl NodeB {
    /// Node B of containerd socket `socket` in `namespace`, with the crab config at `config_path`,
    /// which must name a registry (`[remote] prefix`).
    pub fn new(socket: &Path, namespace: &str, config_path: &Path, crabctl: &Path) -> Result<NodeB, ReplayError> {
        let config = crab_config::Config::load(Some(config_path))
            .map_err(|error| ReplayError::Options(format!("node B's crab config: {error}")))?;
        if !config.remote.enabled() {
            return Err(ReplayError::Options(format!(
                "node B's crab config {} names no registry: node-loss recovers from one ([remote] prefix)",
                config_path.display()
            )));
        }
        if !crabctl.is_file() {
            return Err(ReplayError::Options(format!(
                "{} not found: node-loss runs crabctl on node B (--crabctl or CRAB_CTL)",
                crabctl.display()
            )));
        }
        Ok(NodeB {
            ctr: Ctr::new(socket, namespace.to_owned()),
            config_path: config_path.to_path_buf(),
            config,
            crabctl: crabctl.to_path_buf(),
        })
    }

    /// Where the sandbox's turns are in the registry: `<prefix>/<namespace>/<container>`.
    pub fn repository(&self, container: &str) -> String {
        format!("{}/{}/{container}", self.config.remote.prefix.trim_end_matches('/'), self.ctr.namespace())
    }

    /// Runs `crabctl <args> --json` on node B and returns its report.
    pub async fn crabctl(&self, args: &[&str]) -> Result<serde_json::Value, ReplayError> {
        let mut command = Command::new(&self.crabctl);
        command
            .args(args)
            .arg("--address")
            .arg(self.ctr.socket())
            .arg("--namespace")
            .arg(self.ctr.namespace())
            .arg("--json")
            // B's config names B's store; nothing of node A's environment may redirect it.
            .env("CRAB_CONFIG", &self.config_path)
            .env_remove("CRAB_STATE_DIR")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let shown = format!("crabctl {} (node B)", args.join(" "));
        let output = tokio::time::timeout(CRABCTL_TIMEOUT, command.output())
            .await
            .map_err(|_| ReplayError::Policy(format!("{shown}: no answer within {CRABCTL_TIMEOUT:?}")))?
            .map_err(|error| ReplayError::Policy(format!("{shown}: {error}")))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(ReplayError::Policy(format!("{shown}: {}: {}", output.status, stderr.trim())));
        }
        serde_json::from_slice(&output.stdout)
            .map_err(|error| ReplayError::Policy(format!("{shown}: its report is not JSON: {error}")))
    }
}

/// Node A's side of one sandbox that will lose its node: a crab config of its own.
#[derive(Debug, Clone)]
pub struct NodeA {
    /// The run's directory: the config, and the store, kept images and runc root it names.
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub config: crab_config::Config,
}

impl NodeA {
    /// Writes `<dir>/crab.toml`: `base` with the store, kept images and runc root under `dir`,
    /// and node B's registry settings, the shim pushing every checkpointed turn by itself.
    pub fn prepare(dir: &Path, base: &crab_config::Config, node_b: &NodeB) -> Result<NodeA, ReplayError> {
        let failed = |error: String| ReplayError::Options(format!("node A's config in {}: {error}", dir.display()));
        let mut config = base.clone();
        config.checkpoint.state_dir = dir.join("store");
        config.checkpoint.kept_images_dir = dir.join("kept-images");
        config.runtime.root = dir.join("runc");
        config.remote = crab_config::RemoteConfig { auto_push: true, ..node_b.config.remote.clone() };
        std::fs::create_dir_all(dir).map_err(|error| failed(error.to_string()))?;
        let config_path = dir.join("crab.toml");
        let text = config.to_toml().map_err(|error| failed(error.to_string()))?;
        std::fs::write(&config_path, text).map_err(|error| failed(error.to_string()))?;
        Ok(NodeA { dir: dir.to_path_buf(), config_path, config })
    }

    /// Reads back the node A of a sandbox created with `config_path` (see [`NodeA::prepare`]).
    pub fn load(config_path: &Path) -> Result<NodeA, ReplayError> {
        let config = crab_config::Config::load(Some(config_path))
            .map_err(|error| ReplayError::Options(format!("node A's crab config: {error}")))?;
        let dir = config_path.parent().unwrap_or(Path::new("/")).to_path_buf();
        Ok(NodeA { dir, config_path: config_path.to_path_buf(), config })
    }

    /// What the loss of the node deletes: the sandbox's store, kept images and runc root.
    pub fn directories(&self) -> [&Path; 3] {
        [&self.config.checkpoint.state_dir, &self.config.checkpoint.kept_images_dir, &self.config.runtime.root]
    }
}
