//! How crab is configured: its own configuration file (TOML), the runtime options containerd
//! hands the shim ([`runtime_options`]), and the logging of the command-line binaries
//! ([`logging`]).
//!
//! Every key has a default, so an empty or absent file is a valid
//! configuration. The documented default file is `shim-config/crab.toml`.
//! Unknown keys are errors: a typo must not silently fall back to a default.

pub mod logging;
pub mod runtime_options;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where the shim looks when containerd passes no `ConfigPath`.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/crab/crab.toml";
/// Environment variable naming the config file when no path is given.
pub const CONFIG_ENV: &str = "CRAB_CONFIG";
/// crabd's socket unless `[node] socket` names another.
pub const DEFAULT_NODE_SOCKET: &str = "/run/crab/crabd.sock";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading crab config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("crab config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("crab config as TOML: {0}")]
    Serialize(#[from] toml::ser::Error),
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub runtime: RuntimeConfig,
    pub checkpoint: CheckpointConfig,
    pub log: LogConfig,
    pub node: NodeConfig,
    pub remote: RemoteConfig,
}

/// The remote tier: checkpoints pushed to an OCI registry (crab-remote's ARTIFACT.md), so a
/// sandbox can be recovered or forked on another node. Off by default.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// `host[:port][/path]`: each sandbox's turns go to `<prefix>/<namespace>/<sandbox>`,
    /// tagged `turn-<N>`. Empty: no remote tier (`crabctl push` and `--from` say so).
    pub prefix: String,
    /// Plain HTTP instead of HTTPS (a registry on loopback or a trusted network only).
    pub plain_http: bool,
    /// A Docker client config (`config.json`) holding the registry's credentials. Empty:
    /// `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`, else anonymous.
    pub credentials_file: PathBuf,
    /// A PEM file of CA certificates trusted for the registry besides the system's. Empty:
    /// the system's only.
    pub ca_file: PathBuf,
    /// The shim pushes each checkpointed turn by itself (crab-remote's persistent queue, paced
    /// by crabd's bucket). Off by default; `crabctl push` and `crabctl drain` push on demand.
    pub auto_push: bool,
    /// How long `crabctl drain` and `crabctl migrate` may take when no `--deadline` is given
    /// (the node's shutdown: `crab-drain.service` runs the drain as the node stops). A spot
    /// node gets about two minutes' notice; the default leaves a margin for the rest of the
    /// shutdown.
    pub drain_deadline_ms: u64,
}

/// [`RemoteConfig::drain_deadline_ms`] unless crab.toml says otherwise.
pub const DEFAULT_DRAIN_DEADLINE_MS: u64 = 90_000;

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            plain_http: false,
            credentials_file: PathBuf::new(),
            ca_file: PathBuf::new(),
            auto_push: false,
            drain_deadline_ms: DEFAULT_DRAIN_DEADLINE_MS,
        }
    }
}

impl RemoteConfig {
    /// Whether a registry is configured.
    pub fn enabled(&self) -> bool {
        !self.prefix.is_empty()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// The OCI runtime binary: `runc` or `crun`, a name on PATH or a path.
    pub binary: PathBuf,
    /// The runtime's state directory; the namespace is appended.
    pub root: PathBuf,
    /// Pass `--systemd-cgroup` to the runtime.
    pub systemd_cgroup: bool,
    /// crab-init, a static binary run in front of each container's
    /// entrypoint so exec sessions are children of the container's own
    /// process tree (and in its checkpoints). Empty: execs go through the
    /// runtime's `exec`, which checkpoints leave out.
    pub init: PathBuf,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Root of crab's checkpoint store.
    pub state_dir: PathBuf,
    /// Policy of sandboxes without an `io.crab.policy` annotation:
    /// `crab`, `every-turn` or `off`.
    pub policy: String,
    /// Where CRIU dumps are written and the newest one of each container
    /// stays assembled for a fast restore. Meant for a tmpfs: a dump written
    /// there never reaches the disk (the store writes only the chunks it
    /// lacks). Empty: inside `state_dir`.
    pub kept_images_dir: PathBuf,
    /// Bound on all kept image copies together, MiB (on tmpfs they are
    /// memory). A dump that does not fit is not kept: its restore
    /// reassembles it from the store's chunks. 0 keeps none.
    pub kept_images_max_mib: u64,
    /// containerd namespaces whose chains `io.crab.restore-from` may name from a
    /// container of another namespace (`"*"`: any). A container may always restore
    /// from chains of its own namespace; by default from no other.
    pub restore_from_namespaces: Vec<String>,
    /// Bound on one CRIU dump of a turn, milliseconds: past it the dump is abandoned (CRIU
    /// and its runtime killed, the sandbox thawed as it was), the turn is recorded as not
    /// checkpointed and its changes are carried into the next turn's checkpoint. Restores
    /// (`io.crab.restore-from`, recover, fork) have the same bound.
    pub dump_timeout_ms: u64,
    /// Bound on the bytes each sandbox's chain references in the store, MiB (0: none). A
    /// turn whose checkpoint would go over it is recorded as over quota, not checkpointed.
    pub max_sandbox_mib: u64,
    /// Whether a sandbox's `io.crab.max-sandbox-mib` annotation may raise `max_sandbox_mib`
    /// (it may always lower it). Off: a tenant sets its own annotations.
    pub allow_sandbox_quota_raise: bool,
    /// How long `crabctl gc` keeps the chain of a container containerd removed (CRI's
    /// RemoveContainer, a pod's deletion, `ctr c rm`), seconds from the GC that first found it
    /// gone; 0 drops it at that GC.
    pub keep_removed_s: u64,
}

impl CheckpointConfig {
    /// [`Self::dump_timeout_ms`] as a duration.
    pub fn dump_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.dump_timeout_ms)
    }

    /// The store's settings for kept image copies.
    pub fn kept_images(&self) -> crab_store::KeptImages {
        crab_store::KeptImages {
            dir: (!self.kept_images_dir.as_os_str().is_empty()).then(|| self.kept_images_dir.clone()),
            max_bytes: self.kept_images_max_mib.saturating_mul(1 << 20),
        }
    }

    /// Whether a container of namespace `into` may be created from a chain of namespace `from`.
    pub fn restore_allowed(&self, from: &str, into: &str) -> bool {
        from == into || self.restore_from_namespaces.iter().any(|allowed| allowed == "*" || allowed == from)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `error`, `warn`, `info`, `debug` or `trace`.
    pub level: String,
}

/// The node engine, crabd: one per host, shared by every shim.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// crabd's socket; its directory is made root-only (0700).
    pub socket: PathBuf,
    /// Start crabd on demand (beside the shim binary, else on PATH) when its
    /// socket is absent; without crabd a shim loads an inspector of its own.
    pub spawn: bool,
    /// Commit bandwidth of the whole node (token bucket rate), MiB/s.
    pub rate_mib_per_s: u64,
    /// Bytes the bucket may grant at once after a quiet spell, MiB.
    pub burst_mib: u64,
    /// A commit waiting this long goes before every fresher one.
    pub aging_ms: u64,
    /// Longest a write-out waits for a grant before it goes ahead anyway.
    pub max_wait_ms: u64,
    /// Bound on each request to crabd (connect, reconnect with the watches,
    /// watch, drain, unwatch): a turn whose drain timed out is checkpointed in full.
    pub timeout_ms: u64,
    /// Bound on the effects the inspector (crabd's, or a shim's own) holds
    /// per sandbox between two turn ends, KiB. Repeats of an effect cost
    /// nothing; beyond the bound the turn's details are cut and it is
    /// checkpointed in full, its record says so.
    pub max_effects_kib_per_sandbox: u64,
}

impl NodeConfig {
    /// [`Self::max_effects_kib_per_sandbox`] in bytes.
    pub fn max_effects_bytes(&self) -> usize {
        usize::try_from(self.max_effects_kib_per_sandbox.saturating_mul(1 << 10)).unwrap_or(usize::MAX)
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            socket: crate::DEFAULT_NODE_SOCKET.into(),
            spawn: true,
            rate_mib_per_s: 200,
            burst_mib: 64,
            aging_ms: 2_000,
            max_wait_ms: 30_000,
            timeout_ms: 5_000,
            max_effects_kib_per_sandbox: 8 << 10,
        }
    }
}

/// Where `scripts/lib/common.sh` (install_crab_init) puts the static crab-init.
pub const DEFAULT_INIT: &str = "/usr/local/lib/crab/crab-init";

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self { binary: "runc".into(), root: "/run/crab/runc".into(), systemd_cgroup: false, init: DEFAULT_INIT.into() }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            state_dir: "/var/lib/crab".into(),
            policy: "crab".into(),
            kept_images_dir: "/run/crab/kept-images".into(),
            kept_images_max_mib: 2048,
            restore_from_namespaces: Vec::new(),
            dump_timeout_ms: 60_000,
            max_sandbox_mib: crab_store::turns::DEFAULT_MAX_SANDBOX_MIB,
            allow_sandbox_quota_raise: false,
            keep_removed_s: 86_400,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { level: "info".into() }
    }
}

/// Largest `checkpoint.dump_timeout_ms`: a day.
pub const MAX_DUMP_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

const LOG_LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

impl Config {
    /// Parses a config file body; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Invalid { path: path.to_path_buf(), message: e.to_string() })?;
        config.validate(path)?;
        Ok(config)
    }

    /// Loads `path`. The default path may be absent; an explicit one may not.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        // CRAB_CONFIG: one containerd's shims (they inherit its environment) and the tools
        // beside them share a config without ConfigPath in every container's runtime options.
        let from_env = std::env::var_os(CONFIG_ENV).filter(|p| !p.is_empty()).map(PathBuf::from);
        let (path, explicit) = match path.map(Path::to_path_buf).or(from_env) {
            Some(p) => (p, true),
            None => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path),
            Err(e) if !explicit && e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }

    /// The configuration as a crab.toml with every key written out.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        Ok(toml::to_string(self)?)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid { path: path.to_path_buf(), message };
        if self.runtime.binary.as_os_str().is_empty() {
            return Err(invalid("runtime.binary: must not be empty".into()));
        }
        for (key, dir) in [("runtime.root", &self.runtime.root), ("checkpoint.state_dir", &self.checkpoint.state_dir)] {
            if !dir.is_absolute() {
                return Err(invalid(format!("{key}: {} is not an absolute path", dir.display())));
            }
        }
        let kept = &self.checkpoint.kept_images_dir;
        if !kept.as_os_str().is_empty() && !kept.is_absolute() {
            return Err(invalid(format!(
                "checkpoint.kept_images_dir: {} is not an absolute path (\"\" keeps them in state_dir)",
                kept.display()
            )));
        }
        if !self.runtime.init.as_os_str().is_empty() && !self.runtime.init.is_absolute() {
            return Err(invalid(format!(
                "runtime.init: {} is not an absolute path (\"\" disables crab-init)",
                self.runtime.init.display()
            )));
        }
        for namespace in &self.checkpoint.restore_from_namespaces {
            if namespace != "*"
                && let Err(e) = crab_store::validate_namespace(namespace)
            {
                return Err(invalid(format!("checkpoint.restore_from_namespaces: {e} (or \"*\" for any)")));
            }
        }
        if self.checkpoint.max_sandbox_mib > crab_store::turns::MAX_SANDBOX_MIB_LIMIT {
            return Err(invalid(format!(
                "checkpoint.max_sandbox_mib: {} is more than {} (0: no bound)",
                self.checkpoint.max_sandbox_mib,
                crab_store::turns::MAX_SANDBOX_MIB_LIMIT
            )));
        }
        if crab_store::turns::parse_policy(&self.checkpoint.policy).is_none() {
            return Err(invalid(format!(
                "checkpoint.policy: {:?} is not one of crab, every-turn, off",
                self.checkpoint.policy
            )));
        }
        // Zero would abandon every dump; beyond a day it is no bound the next exec could wait for.
        if !(1..=MAX_DUMP_TIMEOUT_MS).contains(&self.checkpoint.dump_timeout_ms) {
            return Err(invalid(format!(
                "checkpoint.dump_timeout_ms: {} is not between 1 and {MAX_DUMP_TIMEOUT_MS} (milliseconds)",
                self.checkpoint.dump_timeout_ms
            )));
        }
        if !self.node.socket.is_absolute() {
            return Err(invalid(format!("node.socket: {} is not an absolute path", self.node.socket.display())));
        }
        for (key, value) in [
            ("node.rate_mib_per_s", self.node.rate_mib_per_s),
            ("node.burst_mib", self.node.burst_mib),
            ("node.timeout_ms", self.node.timeout_ms),
            ("node.max_effects_kib_per_sandbox", self.node.max_effects_kib_per_sandbox),
            ("remote.drain_deadline_ms", self.remote.drain_deadline_ms),
        ] {
            if value == 0 {
                return Err(invalid(format!("{key}: must be at least 1")));
            }
        }
        // Bytes are counted in u64 and rates in f64: keep far from either limit.
        if self.node.rate_mib_per_s > 1 << 30 || self.node.burst_mib > 1 << 30 {
            return Err(invalid("node.rate_mib_per_s and node.burst_mib: at most 2^30".into()));
        }
        for (key, file) in
            [("remote.credentials_file", &self.remote.credentials_file), ("remote.ca_file", &self.remote.ca_file)]
        {
            if !file.as_os_str().is_empty() && !file.is_absolute() {
                return Err(invalid(format!("{key}: {} is not an absolute path (\"\": the default)", file.display())));
            }
        }
        let prefix = &self.remote.prefix;
        if !prefix.is_empty() {
            let host = prefix.split('/').next().unwrap_or_default();
            if host.is_empty()
                || prefix.contains("://")
                || prefix.ends_with('/')
                || prefix.contains("//")
                || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
            {
                return Err(invalid(format!(
                    "remote.prefix: {prefix:?} is not host[:port][/path] (e.g. \"registry.example:5000/crab\", no scheme)"
                )));
            }
        }
        if !LOG_LEVELS.contains(&self.log.level.as_str()) {
            return Err(invalid(format!("log.level: {:?} is not one of {}", self.log.level, LOG_LEVELS.join(", "))));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(Config::parse("", Path::new("x.toml")).unwrap(), Config::default());
    }

    #[test]
    fn shipped_default_file_parses_to_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shim-config/crab.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(Config::parse(&text, &path).unwrap(), Config::default());
    }

    /// What `crabctl config` prints reads back as the same configuration: the serialized
    /// field names are the file's keys.
    #[test]
    fn written_out_config_parses_to_itself() {
        let text =
            "[node]\nrate_mib_per_s = 50\n[checkpoint]\nrestore_from_namespaces = [\"a\"]\nkept_images_dir = \"\"\n";
        let config = Config::parse(text, Path::new("c.toml")).unwrap();
        let written = config.to_toml().unwrap();
        assert_eq!(Config::parse(&written, Path::new("written.toml")).unwrap(), config, "{written}");
        assert_eq!(Config::parse(&Config::default().to_toml().unwrap(), Path::new("d")).unwrap(), Config::default());
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let err = Config::parse("[runtime]\nbinray = \"crun\"\n", Path::new("/etc/crab/crab.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/etc/crab/crab.toml") && msg.contains("binray"), "{msg}");

        let err = Config::parse("[checkpoint]\nstate_dir = \"rel/dir\"\n", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("checkpoint.state_dir"), "{err}");

        let err = Config::parse("[log]\nlevel = \"loud\"\n", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("log.level"), "{err}");
    }

    #[test]
    fn restores_across_namespaces_only_where_allowed() {
        let c = Config::default();
        assert!(c.checkpoint.restore_allowed("a", "a"));
        assert!(!c.checkpoint.restore_allowed("a", "b"), "no other namespace by default");
        let c = Config::parse("[checkpoint]\nrestore_from_namespaces = [\"shared\"]\n", Path::new("c.toml")).unwrap();
        assert!(c.checkpoint.restore_allowed("shared", "b"));
        assert!(!c.checkpoint.restore_allowed("a", "b"));
        let c = Config::parse("[checkpoint]\nrestore_from_namespaces = [\"*\"]\n", Path::new("c.toml")).unwrap();
        assert!(c.checkpoint.restore_allowed("a", "b"));
        let err =
            Config::parse("[checkpoint]\nrestore_from_namespaces = [\"../x\"]\n", Path::new("c.toml")).unwrap_err();
        assert!(
            err.to_string().contains("checkpoint.restore_from_namespaces") && err.to_string().contains("../x"),
            "{err}"
        );
    }

    #[test]
    fn the_sandbox_quota_is_validated_naming_its_key() {
        let c = Config::default();
        assert_eq!((c.checkpoint.max_sandbox_mib, c.checkpoint.allow_sandbox_quota_raise), (10240, false));
        let c = Config::parse("[checkpoint]\nmax_sandbox_mib = 0\nallow_sandbox_quota_raise = true\n", Path::new("c"))
            .unwrap();
        assert_eq!((c.checkpoint.max_sandbox_mib, c.checkpoint.allow_sandbox_quota_raise), (0, true));
        for bad in ["max_sandbox_mib = 17592186044416", "max_sandbox_mib = -1", "max_sandbox_mib = \"1G\""] {
            let err = Config::parse(&format!("[checkpoint]\n{bad}\n"), Path::new("/etc/crab/crab.toml")).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("/etc/crab/crab.toml") && msg.contains("max_sandbox_mib"), "{bad}: {msg}");
        }
    }

    #[test]
    fn explicit_missing_file_is_an_error_default_is_not() {
        assert!(Config::load(Some(Path::new("/nonexistent/crab.toml"))).is_err());
    }

    #[test]
    fn the_drain_deadline_defaults_to_90_s_and_must_be_some_time() {
        assert_eq!(Config::parse("", Path::new("c.toml")).unwrap().remote.drain_deadline_ms, 90_000);
        let c = Config::parse("[remote]\ndrain_deadline_ms = 45000\n", Path::new("c.toml")).unwrap();
        assert_eq!(c.remote.drain_deadline_ms, 45_000);
        let err = Config::parse("[remote]\ndrain_deadline_ms = 0\n", Path::new("/etc/crab/crab.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/etc/crab/crab.toml") && msg.contains("remote.drain_deadline_ms"), "{msg}");
    }

    #[test]
    fn node_table_is_validated_with_file_and_key() {
        let c = Config::parse("[node]\nrate_mib_per_s = 50\nburst_mib = 8\n", Path::new("c.toml")).unwrap();
        assert_eq!((c.node.rate_mib_per_s, c.node.burst_mib, c.node.aging_ms), (50, 8, 2_000));
        let err = Config::parse("[node]\nrate_mib_per_s = 0\n", Path::new("/etc/crab/crab.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/etc/crab/crab.toml") && msg.contains("node.rate_mib_per_s"), "{msg}");
        let err = Config::parse("[node]\nsocket = \"crabd.sock\"\n", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("node.socket"), "{err}");
        let err = Config::parse("[node]\nburst = 1\n", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("burst"), "{err}");
    }

    #[test]
    fn init_is_an_absolute_path_or_disabled() {
        let c = Config::parse("[runtime]\ninit = \"\"\n", Path::new("c.toml")).unwrap();
        assert!(c.runtime.init.as_os_str().is_empty());
        let err = Config::parse("[runtime]\ninit = \"crab-init\"\n", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("runtime.init"), "{err}");
    }

    #[test]
    fn kept_images_dir_is_absolute_or_empty() {
        let err = Config::parse("[checkpoint]\nkept_images_dir = \"run/kept\"\n", Path::new("/etc/crab/crab.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("checkpoint.kept_images_dir"), "{err}");
        let inside =
            Config::parse("[checkpoint]\nkept_images_dir = \"\"\nkept_images_max_mib = 3\n", Path::new("c")).unwrap();
        assert_eq!(inside.checkpoint.kept_images(), crab_store::KeptImages { dir: None, max_bytes: 3 << 20 });
    }

    #[test]
    fn dump_timeout_is_bounded_and_named_in_errors() {
        assert_eq!(Config::default().checkpoint.dump_timeout(), std::time::Duration::from_secs(60));
        let c = Config::parse("[checkpoint]\ndump_timeout_ms = 250\n", Path::new("c.toml")).unwrap();
        assert_eq!(c.checkpoint.dump_timeout(), std::time::Duration::from_millis(250));
        for bad in ["0", "86400001"] {
            let err =
                Config::parse(&format!("[checkpoint]\ndump_timeout_ms = {bad}\n"), Path::new("/etc/crab/crab.toml"))
                    .unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("/etc/crab/crab.toml") && msg.contains("checkpoint.dump_timeout_ms") && msg.contains(bad),
                "{msg}"
            );
        }
        let err = Config::parse("[checkpoint]\ndump_timeout_ms = -5\n", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("dump_timeout_ms"), "{err}");
    }

    #[test]
    fn the_remote_tier_is_off_by_default_and_validated() {
        assert!(!Config::default().remote.enabled());
        let c = Config::parse(
            "[remote]\nprefix = \"127.0.0.1:5000/crab\"\nplain_http = true\nca_file = \"/etc/crab/ca.pem\"\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert!(c.remote.enabled() && c.remote.plain_http);
        assert_eq!(c.remote.ca_file, PathBuf::from("/etc/crab/ca.pem"));
        for bad in [
            "prefix = \"https://reg/crab\"",
            "prefix = \"reg/crab/\"",
            "prefix = \"/crab\"",
            "credentials_file = \"config.json\"",
            "ca_file = \"ca.pem\"",
            "registry = \"x\"",
        ] {
            let err = Config::parse(&format!("[remote]\n{bad}\n"), Path::new("/etc/crab/crab.toml")).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("/etc/crab/crab.toml") && (msg.contains("remote.") || msg.contains("registry")),
                "{bad}: {msg}"
            );
        }
    }

    #[test]
    fn crun_is_selectable() {
        let c = Config::parse("[runtime]\nbinary = \"crun\"\n", Path::new("c.toml")).unwrap();
        assert_eq!(c.runtime.binary, PathBuf::from("crun"));
    }
}
