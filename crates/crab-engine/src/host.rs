//! What the engine asks of the machine its sandbox runs on: the container's root and rootfs
//! diff, its cgroup, the CPU and thread readers, and the process dump. [`ContainerHost`] is the
//! real one (the OCI runtime, `/proc` and the cgroup v2 file system); the engine's unit tests
//! put a recording double in its place, so the checkpoint policy runs end to end without root,
//! containers or CRIU.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use crab_runtime::{CheckpointOptions, OciRuntime, RuntimeError};
use crab_store::{ChangedPath, ContainerRoot};

use crate::cpu::{CpuReader, ProcCpuClock};
use crate::stdin::{ProcFs, ProcReader};

/// Why the host could not answer.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Store(#[from] crab_store::CheckpointError),
    #[error("cgroup of the container: {0}")]
    Cgroup(#[from] crab_inspector::CgroupError),
    #[error("{what} task: {source}")]
    Task { what: &'static str, source: tokio::task::JoinError },
}

/// Bound on the paths an escalated turn takes from the rootfs diff (a diff beyond it is an
/// error, and the turn is carried, rather than a walk without end).
const ROOTFS_DIFF_LIMIT: usize = 4 << 20;

/// The machine side of one sandbox, as the engine uses it.
#[async_trait::async_trait]
pub trait SandboxHost: Send + Sync {
    /// The container's init, as a host pid.
    fn init_pid(&self) -> u32;
    /// How deep the container's pid namespace is (0: the host's; None: unknown), to tell
    /// its forks from those of a namespace nested in it (see [`crab_inspector::NamespacePid`]).
    fn pid_namespace_depth(&self) -> Option<u32>;
    /// Where the host reaches the container's root file system (captures read below it
    /// through descriptors, never following links).
    fn rootfs(&self) -> PathBuf;
    /// The container's init held by a pidfd, to reach its own mounts (None: unavailable; a
    /// change on a tmpfs mount then cannot be captured and the turn is carried).
    fn container_root(&self) -> Option<Arc<ContainerRoot>>;
    /// The container's cgroup v2 id, for the inspector's watch.
    fn cgroup_id(&self) -> Result<u64, HostError>;
    /// The container's cgroup v2 directory (None: not found).
    fn cgroup_dir(&self) -> Option<PathBuf>;
    /// The runtime's own processes in the container (crab-init's spawner): left out of what a
    /// turn did.
    fn helper_pids(&self) -> HashSet<u32>;
    /// CPU times of the container's processes.
    fn cpu(&self) -> &dyn CpuReader;
    /// Thread states and system calls of the container's processes.
    fn procs(&self) -> &dyn ProcReader;
    /// Dumps the container's processes (leaving them running) as `options` say.
    async fn dump(&self, options: &CheckpointOptions) -> Result<(), HostError>;
    /// Every path of the container's rootfs diff, as changed paths of its root: what an
    /// escalated turn captures.
    async fn rootfs_diff(&self) -> Result<Vec<ChangedPath>, HostError>;
    /// The directory holding the rootfs diff whole (the every-turn baseline copies it).
    fn rootfs_diff_dir(&self) -> Result<PathBuf, HostError>;
}

/// A container run by the OCI runtime on this machine.
pub struct ContainerHost {
    runtime: OciRuntime,
    /// The container id, as the runtime knows it.
    id: String,
    init_pid: u32,
    container_root: Option<Arc<ContainerRoot>>,
    cgroup_dir: Option<PathBuf>,
    pid_namespace_depth: Option<u32>,
}

impl ContainerHost {
    /// `init_pid` must be the container's init now (the caller just learned it from the
    /// runtime): it is held by a pidfd from here on.
    pub fn new(runtime: OciRuntime, id: &str, init_pid: u32) -> Self {
        let container_root = match ContainerRoot::new(init_pid) {
            Ok(root) => Some(Arc::new(root)),
            Err(e) => {
                tracing::error!(container = id, pid = init_pid, error = %e,
                    "no pidfd of the init: changes on its tmpfs mounts cannot be checkpointed");
                None
            }
        };
        let cgroup_dir = crab_inspector::cgroup2_path_of_pid(init_pid)
            .ok()
            .and_then(|relative| Some(crab_inspector::cgroup2_mount().ok()?.join(relative)));
        // Read while the caller knows the pid is the init's (it is a namespace's: the depth
        // of a pid's namespace never changes).
        let pid_namespace_depth = std::fs::read_to_string(format!("/proc/{init_pid}/status"))
            .ok()
            .and_then(|status| pid_namespace_depth(&status));
        Self { runtime, id: id.into(), init_pid, container_root, cgroup_dir, pid_namespace_depth }
    }
}

/// How deep a process's pid namespace is, from its `/proc/<pid>/status`: its `NSpid` line
/// has its pid in every namespace from the host's down to its own.
pub fn pid_namespace_depth(status: &str) -> Option<u32> {
    let pids = status.lines().find_map(|line| line.strip_prefix("NSpid:"))?.split_whitespace().count();
    u32::try_from(pids).ok()?.checked_sub(1)
}

#[async_trait::async_trait]
impl SandboxHost for ContainerHost {
    fn init_pid(&self) -> u32 {
        self.init_pid
    }

    fn pid_namespace_depth(&self) -> Option<u32> {
        self.pid_namespace_depth
    }

    fn rootfs(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.init_pid))
    }

    fn container_root(&self) -> Option<Arc<ContainerRoot>> {
        self.container_root.clone()
    }

    fn cgroup_id(&self) -> Result<u64, HostError> {
        Ok(crab_inspector::cgroup_id_of_pid(self.init_pid)?)
    }

    fn cgroup_dir(&self) -> Option<PathBuf> {
        self.cgroup_dir.clone()
    }

    fn helper_pids(&self) -> HashSet<u32> {
        self.runtime.helper_pids()
    }

    fn cpu(&self) -> &dyn CpuReader {
        &ProcCpuClock
    }

    fn procs(&self) -> &dyn ProcReader {
        &ProcFs
    }

    async fn dump(&self, options: &CheckpointOptions) -> Result<(), HostError> {
        Ok(self.runtime.checkpoint(&self.id, options).await?)
    }

    async fn rootfs_diff(&self) -> Result<Vec<ChangedPath>, HostError> {
        let pid = self.init_pid;
        let paths = tokio::task::spawn_blocking(move || crab_store::rootfs_diff_paths(pid, ROOTFS_DIFF_LIMIT))
            .await
            .map_err(|source| HostError::Task { what: "rootfs diff", source })??;
        Ok(paths.into_iter().map(ChangedPath::modified).collect())
    }

    fn rootfs_diff_dir(&self) -> Result<PathBuf, HostError> {
        Ok(crab_store::overlay_upperdir(self.init_pid)?)
    }
}
