//! The two nodes of a `node-loss` fault.
//!
//! Node A is the replay's own containerd. For a run that will lose it, a crab
//! sandbox gets a crab config of its own ([`NodeA`]): its store, kept images
//! and runc root in one directory of the run, which the fault deletes, and
//! `[remote]` with the registry of node B's config, so the shim pushes each
//! checkpointed turn off the node by itself. Node B ([`NodeB`]) is a second
//! containerd and crab on this machine with directories of its own: the
//! sandbox comes back there from what left node A before the fault. The
//! every-turn baseline of such a run pushes its checkpoint images to the same
//! registry ([`Registry`]) with `ctr images push`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crab_containerd::Ctr;
use tokio::process::Command;

use super::ReplayError;
use super::archive::Descriptor;

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

    /// The registry both nodes use, as `ctr` reaches it.
    pub fn registry(&self) -> Registry {
        Registry::of(&self.config.remote)
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

/// A registry as a containerd user reaches it with `ctr images push` and `ctr content fetch`:
/// crab's `[remote]` settings (prefix, plain HTTP, CA file), the same registry crab's shims push to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registry {
    /// `host[:port][/path]`.
    pub prefix: String,
    pub plain_http: bool,
    /// A PEM file of CA certificates trusted for the registry besides the system's.
    pub ca_file: Option<PathBuf>,
    /// A Docker credentials file crab's config names: `ctr` takes none (only `--user`), so a
    /// push with one is refused rather than tried anonymously.
    pub credentials_file: Option<PathBuf>,
}

/// The manifest media types a registry is asked for by digest (distribution answers a request
/// whose Accept header lacks an OCI manifest's or index's type with "manifest unknown").
const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
     application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.docker.distribution.manifest.v2+json";

/// How long one question to the registry may take.
const REGISTRY_TIMEOUT_S: &str = "30";

impl Registry {
    pub fn of(remote: &crab_config::RemoteConfig) -> Registry {
        let path = |path: &Path| (!path.as_os_str().is_empty()).then(|| path.to_path_buf());
        Registry {
            prefix: remote.prefix.trim_end_matches('/').to_owned(),
            plain_http: remote.plain_http,
            ca_file: path(&remote.ca_file),
            credentials_file: path(&remote.credentials_file),
        }
    }

    /// `host[:port]` of the prefix.
    pub fn host(&self) -> &str {
        self.prefix.split_once('/').map_or(&self.prefix, |(host, _)| host)
    }

    /// The repository (its name on the registry, without the host) of every-turn's checkpoint
    /// images of `container`: `<prefix path>/every-turn/<container>`.
    pub fn every_turn_repository(&self, container: &str) -> String {
        match self.prefix.split_once('/') {
            Some((_, path)) if !path.is_empty() => format!("{path}/every-turn/{container}"),
            _ => format!("every-turn/{container}"),
        }
    }

    /// The image reference of every-turn's checkpoint of `container` after `turn`.
    pub fn every_turn_reference(&self, container: &str, turn: u32) -> String {
        format!("{}/{}:turn-{turn}", self.host(), self.every_turn_repository(container))
    }

    /// The flags `ctr images push` and `ctr content fetch` take to reach the registry.
    pub fn ctr_flags(&self) -> Result<Vec<String>, ReplayError> {
        if let Some(credentials) = &self.credentials_file {
            return Err(ReplayError::Policy(format!(
                "every-turn pushes with `ctr images push`, which reads no Docker credentials file ({}): \
                 use a registry without authentication",
                credentials.display()
            )));
        }
        let mut flags = Vec::new();
        if self.plain_http {
            flags.push("--plain-http".to_owned());
        }
        if let Some(ca) = &self.ca_file {
            flags.extend(["--tlscacert".to_owned(), ca.display().to_string()]);
        }
        Ok(flags)
    }

    /// Whether `repository` of the registry holds `descriptor`: `HEAD /v2/<repository>/blobs/<digest>`,
    /// or `.../manifests/<digest>` for a manifest or index, which distribution keeps apart from
    /// the repository's blobs. These are the questions containerd's pusher asks before it
    /// uploads a descriptor.
    pub async fn holds(&self, repository: &str, descriptor: &Descriptor) -> Result<bool, ReplayError> {
        let kind = if crate::sandbox::is_manifest_type(&descriptor.media_type) { "manifests" } else { "blobs" };
        self.head(&format!("{repository}/{kind}/{}", descriptor.digest)).await
    }

    /// Whether `repository` of the registry has tag `tag`: how containerd's pusher asks for the
    /// image it pushes (by its reference's tag, not its digest).
    pub async fn has_tag(&self, repository: &str, tag: &str) -> Result<bool, ReplayError> {
        self.head(&format!("{repository}/manifests/{tag}")).await
    }

    /// `HEAD /v2/<path>`: true on 200, false on 404.
    async fn head(&self, path: &str) -> Result<bool, ReplayError> {
        let scheme = if self.plain_http { "http" } else { "https" };
        let url = format!("{scheme}://{}/v2/{path}", self.host());
        let mut command = Command::new("curl");
        command
            .args(["--silent", "--show-error", "--head", "--output", "/dev/null", "--write-out", "%{http_code}"])
            .args(["--max-time", REGISTRY_TIMEOUT_S, "--header", &format!("Accept: {MANIFEST_ACCEPT}")]);
        if let Some(ca) = &self.ca_file {
            command.arg("--cacert").arg(ca);
        }
        let output = command
            .arg(&url)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|error| ReplayError::Policy(format!("HEAD {url}: curl: {error}")))?;
        match String::from_utf8_lossy(&output.stdout).trim() {
            "200" => Ok(true),
            "404" => Ok(false),
            code => Err(ReplayError::Policy(format!(
                "HEAD {url}: HTTP {code}: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(prefix: &str) -> Registry {
        Registry::of(&crab_config::RemoteConfig { prefix: prefix.into(), plain_http: true, ..Default::default() })
    }

    #[test]
    fn every_turn_pushes_beside_crabs_repositories_under_the_same_prefix() {
        let registry = plain("127.0.0.1:5000/crab/");
        assert_eq!(registry.host(), "127.0.0.1:5000");
        assert_eq!(registry.every_turn_repository("sb-1"), "crab/every-turn/sb-1");
        assert_eq!(registry.every_turn_reference("sb-1", 3), "127.0.0.1:5000/crab/every-turn/sb-1:turn-3");
        assert_eq!(registry.ctr_flags().unwrap(), ["--plain-http"]);
        let bare = plain("registry.test:443");
        assert_eq!(bare.host(), "registry.test:443");
        assert_eq!(bare.every_turn_reference("sb", 1), "registry.test:443/every-turn/sb:turn-1");
    }

    #[test]
    fn a_tls_registry_takes_its_ca_and_one_with_credentials_is_refused() {
        let mut remote = crab_config::RemoteConfig {
            prefix: "127.0.0.1:5001/crab".into(),
            ca_file: "/tmp/ca.crt".into(),
            ..Default::default()
        };
        assert_eq!(Registry::of(&remote).ctr_flags().unwrap(), ["--tlscacert", "/tmp/ca.crt"]);
        remote.credentials_file = "/tmp/docker-config.json".into();
        let error = Registry::of(&remote).ctr_flags().unwrap_err().to_string();
        assert!(error.contains("reads no Docker credentials file (/tmp/docker-config.json)"), "{error}");
    }
}
