//! Which containerd, namespace, image and runtimes the tests use, read once from the environment and
//! checked up front so that an unreachable containerd fails every test with one clear message.

use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use crate::ctr::Ctr;

pub const DEFAULT_SOCKET: &str = "/run/crab-dev/containerd.sock";
pub const DEFAULT_NAMESPACE: &str = "crab";
pub const DEFAULT_IMAGE: &str = "crab.local/busybox:latest";
pub const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
pub const CRAB_RUNTIME: &str = "io.containerd.crab.v2";

/// A containerd runtime name such as `io.containerd.runc.v2`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    name: String,
}

impl Runtime {
    /// Accepts the aliases `runc` and `crab` or any full `io.containerd.<name>.<version>` name.
    pub fn parse(text: &str) -> Result<Runtime, String> {
        let name = match text.trim() {
            "runc" => RUNC_RUNTIME.to_string(),
            "crab" => CRAB_RUNTIME.to_string(),
            full if full.split('.').count() >= 3 && full.chars().all(|c| c.is_ascii_alphanumeric() || c == '.') => {
                full.to_string()
            }
            other => {
                return Err(format!(
                    "unknown runtime {other:?} in CRAB_TEST_RUNTIMES: use runc, crab or a full name such as {RUNC_RUNTIME}"
                ));
            }
        };
        Ok(Runtime { name })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `runc` for `io.containerd.runc.v2`: short enough to go into container ids.
    pub fn short(&self) -> &str {
        let parts: Vec<&str> = self.name.split('.').collect();
        parts[parts.len() - 2]
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
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
    fn unknown_runtime_is_rejected_with_its_name() {
        let error = Runtime::parse("kata").unwrap_err();
        assert!(error.contains("\"kata\""), "{error}");
    }
}
