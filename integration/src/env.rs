//! Which containerd, namespace, image and runtimes the tests use, read once from the environment and
//! checked up front so that an unreachable containerd fails every test with one clear message.

use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use crab_containerd::Ctr;

pub use crab_containerd::ctr::{DEFAULT_NAMESPACE, DEFAULT_SOCKET};
pub const DEFAULT_IMAGE: &str = "crab.local/busybox:latest";
pub const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
pub const CRAB_RUNTIME: &str = "io.containerd.crab.v2";

/// Selects the OCI runtime crab's shim drives in every crab run that does not name one
/// (`crab-crun` does): `crun` runs the crab leg of every test over crun.
pub const CRAB_BINARY_ENV: &str = "CRAB_TEST_CRAB_BINARY";

/// A containerd runtime name such as `io.containerd.runc.v2`, and for crab the OCI runtime its
/// shim drives when that is not the configured one (runc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    name: String,
    /// `crun`: crab over crun, through a crab config of its own (`--runtime-config-path`).
    oci_binary: Option<String>,
}

impl Runtime {
    /// Accepts the aliases `runc`, `crab` and `crab-crun` (crab over crun) or any full
    /// `io.containerd.<name>.<version>` name. Crab runs use `$CRAB_TEST_CRAB_BINARY` when set.
    pub fn parse(text: &str) -> Result<Runtime, String> {
        let crab_binary = std::env::var(CRAB_BINARY_ENV).ok().filter(|b| !b.trim().is_empty());
        let name = match text.trim() {
            "runc" => RUNC_RUNTIME.to_string(),
            "crab" => CRAB_RUNTIME.to_string(),
            "crab-crun" => return Ok(Runtime { name: CRAB_RUNTIME.to_string(), oci_binary: Some("crun".into()) }),
            full if full.split('.').count() >= 3 && full.chars().all(|c| c.is_ascii_alphanumeric() || c == '.') => {
                full.to_string()
            }
            other => {
                return Err(format!(
                    "unknown runtime {other:?} in CRAB_TEST_RUNTIMES: use runc, crab, crab-crun or a full name such as {RUNC_RUNTIME}"
                ));
            }
        };
        let oci_binary = if name == CRAB_RUNTIME { crab_binary } else { None };
        Ok(Runtime { name, oci_binary })
    }

    /// The OCI runtime binary crab's shim is told to use, when not the configured one.
    pub fn oci_binary(&self) -> Option<&str> {
        self.oci_binary.as_deref()
    }

    /// The `ctr run` flags that select this runtime: `--runtime NAME`, and for crab over another
    /// OCI runtime `--runtime-config-path` of a crab config that names it.
    pub fn run_flags(&self) -> Vec<String> {
        let mut flags = vec!["--runtime".to_string(), self.name.clone()];
        if let Some(binary) = &self.oci_binary {
            flags.push("--runtime-config-path".into());
            flags.push(crab_config_for(binary).display().to_string());
        }
        flags
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `runc` for `io.containerd.runc.v2`, the OCI binary's name for crab over another
    /// (`crun`): short enough to go into container ids.
    pub fn short(&self) -> &str {
        if let Some(binary) = &self.oci_binary {
            return binary.rsplit('/').next().unwrap_or(binary);
        }
        let parts: Vec<&str> = self.name.split('.').collect();
        parts[parts.len() - 2]
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.oci_binary {
            Some(binary) => write!(f, "{} over {binary}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// The crab config the shims read (`$CRAB_CONFIG`, else `/etc/crab/crab.toml`, else none)
/// with `[runtime] binary` set to `binary`, written once per test process under the temp dir.
pub fn crab_config_for(binary: &str) -> PathBuf {
    static WRITTEN: OnceLock<std::sync::Mutex<std::collections::HashMap<String, PathBuf>>> = OnceLock::new();
    let mut written = WRITTEN.get_or_init(Default::default).lock().expect("crab configs lock");
    if let Some(path) = written.get(binary) {
        return path.clone();
    }
    let base_path = std::env::var_os("CRAB_CONFIG").map(PathBuf::from).unwrap_or_else(|| "/etc/crab/crab.toml".into());
    let base = std::fs::read_to_string(&base_path).unwrap_or_default();
    let dir = std::env::temp_dir().join("crab-integration");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    let safe: String = binary.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let path = dir.join(format!("crab-over-{safe}-{}.toml", std::process::id()));
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, with_runtime_binary(&base, binary))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    written.insert(binary.to_string(), path.clone());
    path
}

/// `config` (crab.toml text) with `[runtime] binary = "binary"`, replacing a binary it names.
fn with_runtime_binary(config: &str, binary: &str) -> String {
    let line = format!("binary = {binary:?}");
    let mut out = Vec::new();
    let mut section = String::new();
    let mut placed = false;
    for l in config.lines() {
        let t = l.trim();
        if t.starts_with('[') {
            section = t.to_string();
        }
        if section == "[runtime]" && t.split('=').next().map(str::trim) == Some("binary") {
            continue;
        }
        out.push(l.to_string());
        if t == "[runtime]" && !placed {
            out.push(line.clone());
            placed = true;
        }
    }
    if !placed {
        // Before any other table, so the key cannot land in one.
        out.insert(0, format!("[runtime]\n{line}"));
    }
    out.join("\n") + "\n"
}

#[derive(Debug)]
pub struct TestEnv {
    pub socket: PathBuf,
    pub namespace: String,
    pub image: String,
    pub runtimes: Vec<Runtime>,
    /// Script with `start`/`stop` subcommands that controls the shared containerd.
    pub control_script: PathBuf,
    /// Per-container scratch files (stdio logs, checkpoint directories) live below this.
    pub scratch_root: PathBuf,
}

/// The check's result, failure included, so that an unreachable containerd costs one dial timeout
/// per test binary rather than one per test.
static ENV: OnceLock<Result<TestEnv, String>> = OnceLock::new();

impl TestEnv {
    /// The checked environment. Panics, with what to do about it, if containerd is unreachable or the
    /// image is missing: a test that cannot reach containerd must fail, not pass vacuously.
    pub fn get() -> &'static TestEnv {
        match ENV.get_or_init(|| TestEnv::from_process_env().and_then(|env| env.check().map(|()| env))) {
            Ok(env) => env,
            Err(message) => panic!("integration environment not usable: {message}"),
        }
    }

    fn from_process_env() -> Result<TestEnv, String> {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
        let runtimes = var("CRAB_TEST_RUNTIMES", "runc,crab")
            .split(',')
            .filter(|part| !part.trim().is_empty())
            .map(Runtime::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if runtimes.is_empty() {
            return Err("CRAB_TEST_RUNTIMES names no runtime".to_string());
        }
        let repo_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let control_script = std::env::var_os("CRAB_CTRD_CONTROL")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo_root.join("scripts/containerd"));
        Ok(TestEnv {
            socket: PathBuf::from(var("CRAB_CTRD_SOCK", DEFAULT_SOCKET)),
            namespace: var("CRAB_NS", DEFAULT_NAMESPACE),
            image: var("CRAB_TEST_IMAGE", DEFAULT_IMAGE),
            runtimes,
            control_script,
            scratch_root: std::env::temp_dir().join("crab-integration"),
        })
    }

    fn check(&self) -> Result<(), String> {
        let ctr = self.ctr();
        let version = ctr
            .blocking(["version"], Duration::from_secs(15))
            .map_err(|e| format!("containerd is not reachable at {}: {e}", self.socket.display()))?;
        if !version.status.success() {
            return Err(format!(
                "containerd is not reachable at {} (set CRAB_CTRD_SOCK, or start it with `scripts/containerd start`): {}",
                self.socket.display(),
                version.stderr.trim()
            ));
        }
        let images = ctr
            .blocking(["images", "ls", "-q"], Duration::from_secs(15))
            .map_err(|e| format!("cannot list images: {e}"))?;
        if !images.stdout.lines().any(|line| line.trim() == self.image) {
            return Err(format!(
                "image {} is not in namespace {} of {} (build it with `scripts/build-images busybox`)",
                self.image,
                self.namespace,
                self.socket.display()
            ));
        }
        std::fs::create_dir_all(&self.scratch_root)
            .map_err(|e| format!("cannot create {}: {e}", self.scratch_root.display()))
    }

    pub fn ctr(&self) -> Ctr {
        Ctr::new(&self.socket, &self.namespace)
    }
}

/// A binary of crab's (`crabctl`, `crabd`, ...) as the tests' containerd runs it: from
/// `$CRAB_SHIM_DIR` (where `scripts/test` stages them), else the target directory's
/// `crab-bin/` or `release/`. Panics naming where it looked: the tests cannot run without it.
pub fn crab_binary(name: &str) -> PathBuf {
    let repo_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root.join("target"));
    let candidates: Vec<PathBuf> = std::env::var_os("CRAB_SHIM_DIR")
        .map(|dir| PathBuf::from(dir).join(name))
        .into_iter()
        .chain([target.join("crab-bin").join(name), target.join("release").join(name)])
        .collect();
    candidates.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| {
        panic!("{name} not found (looked at {candidates:?}): build it (cargo build --release --workspace)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_and_full_names_parse() {
        assert_eq!(Runtime::parse("runc").unwrap().name(), RUNC_RUNTIME);
        assert_eq!(Runtime::parse(" crab ").unwrap().name(), CRAB_RUNTIME);
        assert_eq!(Runtime::parse("io.containerd.runsc.v1").unwrap().short(), "runsc");
        assert_eq!(Runtime::parse("crab").unwrap().short(), "crab");
    }

    #[test]
    fn crab_over_crun_names_crun_in_its_config() {
        let crun = Runtime::parse("crab-crun").unwrap();
        assert_eq!((crun.name(), crun.short(), crun.oci_binary()), (CRAB_RUNTIME, "crun", Some("crun")));
        assert_eq!(crun.to_string(), "io.containerd.crab.v2 over crun");
        let base = "[runtime]\nroot = \"/r\"\nbinary = \"runc\"\n[node]\nbinary = \"x\"\n";
        assert_eq!(
            with_runtime_binary(base, "crun"),
            "[runtime]\nbinary = \"crun\"\nroot = \"/r\"\n[node]\nbinary = \"x\"\n"
        );
        assert_eq!(
            with_runtime_binary("[node]\nspawn = false", "crun"),
            "[runtime]\nbinary = \"crun\"\n[node]\nspawn = false\n"
        );
        assert_eq!(with_runtime_binary("", "crun"), "[runtime]\nbinary = \"crun\"\n");
    }

    #[test]
    fn unknown_runtime_is_rejected_with_its_name() {
        let error = Runtime::parse("kata").unwrap_err();
        assert!(error.contains("\"kata\""), "{error}");
    }
}
