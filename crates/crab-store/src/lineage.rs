//! Where a chain came from, and which container of a Kubernetes pod is the current one.
//!
//! - `containers/<namespace>/<id>/ORIGIN`: the chain and turn a container was restored from
//!   (a fork, a `io.crab.restore-from` restore, or a kubelet replacement). It sits beside the
//!   head, so it moves with it when the id's chain is retired and goes with it when removed.
//!   The new head points into the origin's chain, so GC keeps what the restored turn
//!   references for as long as the new chain has it in its window.
//! - `pods/<namespace>/<pod sandbox id>/<container name>`: the id of the latest container of
//!   that name in that pod sandbox whose sandbox crab checkpoints. When kubelet replaces a dead
//!   container (same pod sandbox and name, attempt + 1, a new id), the shim finds the
//!   predecessor's chain here. Both parts come from CRI's own annotations, checked by the shim
//!   (see crab-shim's `cri` module) before they are used.
//! - `owners/<namespace>/<id>`: the Kubernetes pod a container of a pod belongs to (its
//!   Kubernetes namespace, pod sandbox and name), recorded when the shim created it. A pod may
//!   restore (`io.crab.restore-from`) only from chains of pods in its own Kubernetes namespace:
//!   under CRI every pod of the node is in one containerd namespace (`k8s.io`), so the
//!   containerd namespace alone does not keep one Kubernetes tenant from another's state.

use std::fs;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::chain::{CheckpointStore, sandbox_key};
use super::error::{CheckpointError, IoContext, Result};
use super::key::{self, SandboxKey};
use super::store::{Durability, publish_file};
use super::sys;

/// Why a chain starts from another's checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OriginReason {
    /// `io.crab.restore-from` (crabctl fork, recover, rollback by restore).
    RestoreFrom,
    /// kubelet replaced a dead container of the same pod sandbox and name.
    KubeletReplacement,
}

impl std::fmt::Display for OriginReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            OriginReason::RestoreFrom => "io.crab.restore-from",
            OriginReason::KubeletReplacement => "kubelet replacement",
        })
    }
}

/// The checkpoint a container's chain starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The source chain's key, `<namespace>/<id>[@<generation>]`.
    pub source: String,
    pub turn: u64,
    pub reason: OriginReason,
    /// For a kubelet replacement: the pod sandbox and the container's name in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_sandbox: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    pub at_unix_ms: u64,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "restored from {}:{} ({}", self.source, self.turn, self.reason)?;
        if let (Some(pod), Some(name)) = (&self.pod_sandbox, &self.container_name) {
            write!(f, " of container {name:?} in pod sandbox {pod}")?;
        }
        f.write_str(")")
    }
}

/// The Kubernetes pod a container belongs to, as CRI's annotations said when the shim, having
/// checked them against the kernel (see crab-shim's `cri` module), created it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodOwner {
    /// The pod's Kubernetes namespace (`io.kubernetes.cri.sandbox-namespace`).
    pub kube_namespace: String,
    pub pod_sandbox: String,
    pub container_name: String,
}

/// A pod sandbox id or container name as one path component of the index (CRI's sandbox ids
/// are 64 hex digits, Kubernetes container names DNS labels; anything else is refused).
fn component<'a>(what: &str, value: &'a str) -> Result<&'a str> {
    key::validate_id(value)
        .map(|_| value)
        .map_err(|_| CheckpointError::InvalidRequest(format!("{what} {value:?} is not a safe path component")))
}

impl CheckpointStore {
    fn origin_path(&self, key: &SandboxKey) -> PathBuf {
        self.state_dir().join("containers").join(key.rel_path()).join("ORIGIN")
    }

    /// Records where `container`'s chain (which must have a head: [`Self::fork`] sets it)
    /// starts from.
    pub fn set_origin(&self, container: &str, origin: &Origin) -> Result<()> {
        let key = sandbox_key(container)?;
        sandbox_key(&origin.source)?;
        if self.head(container)?.is_none() {
            return Err(CheckpointError::NoSuchContainer(container.to_owned()));
        }
        let bytes = serde_json::to_vec(origin).map_err(|source| CheckpointError::Json { what: "ORIGIN", source })?;
        publish_file(&self.blobs().tmp_path("origin"), &self.origin_path(&key), &bytes, Durability::Flushed)
    }

    /// Where `container`'s chain starts from; None for a chain that began with the container.
    pub fn origin(&self, container: &str) -> Result<Option<Origin>> {
        let path = self.origin_path(&sandbox_key(container)?);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| CheckpointError::CorruptManifest { path, reason: format!("bad ORIGIN: {e}") }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).io_ctx("read", path),
        }
    }

    fn owner_path(&self, key: &SandboxKey) -> PathBuf {
        self.state_dir().join("owners").join(key.namespace()).join(key.id())
    }

    /// Records which Kubernetes pod `container` (a key; a retired generation is its id's) is
    /// a container of.
    pub fn set_owner(&self, container: &str, owner: &PodOwner) -> Result<()> {
        let path = self.owner_path(&sandbox_key(container)?);
        if let Some(dir) = path.parent() {
            sys::create_private_dir_all(dir).io_ctx("create", dir)?;
        }
        let bytes = serde_json::to_vec(owner).map_err(|source| CheckpointError::Json { what: "owner", source })?;
        publish_file(&self.blobs().tmp_path("owner"), &path, &bytes, Durability::Flushed)
    }

    /// The Kubernetes pod `container` was recorded in; None for a container no shim created
    /// as a pod's (one of `ctr`, crabctl, or from before owners were recorded).
    pub fn owner(&self, container: &str) -> Result<Option<PodOwner>> {
        let path = self.owner_path(&sandbox_key(container)?);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| CheckpointError::CorruptManifest { path, reason: format!("bad owner record: {e}") }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).io_ctx("read", path),
        }
    }

    /// Drops `container`'s owner record (with its chain: [`Self::remove_container`]).
    pub(crate) fn remove_owner(&self, key: &SandboxKey) -> Result<()> {
        let path = self.owner_path(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).io_ctx("remove", path),
        }
    }

    /// Drops what the store recorded for pod sandbox `key` (its current container of each
    /// name), once containerd no longer has the pod sandbox (GC); nothing to do for a key that
    /// is no pod sandbox.
    pub(crate) fn remove_pod_members(&self, key: &SandboxKey) -> Result<()> {
        let dir = self.state_dir().join("pods").join(key.namespace()).join(key.id());
        match fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).io_ctx("remove", dir),
        }
    }

    fn pod_member_path(&self, namespace: &str, pod_sandbox: &str, name: &str) -> Result<PathBuf> {
        key::validate_namespace(namespace)?;
        Ok(self
            .state_dir()
            .join("pods")
            .join(namespace)
            .join(component("pod sandbox id", pod_sandbox)?)
            .join(component("container name", name)?))
    }

    /// Records `id` as the current container named `name` in pod sandbox `pod_sandbox`.
    pub fn set_pod_member(&self, namespace: &str, pod_sandbox: &str, name: &str, id: &str) -> Result<()> {
        SandboxKey::new(namespace, id)?;
        let path = self.pod_member_path(namespace, pod_sandbox, name)?;
        if let Some(dir) = path.parent() {
            sys::create_private_dir_all(dir).io_ctx("create", dir)?;
        }
        publish_file(&self.blobs().tmp_path("pod"), &path, id.as_bytes(), Durability::Flushed)
    }

    /// The id recorded as the current container named `name` in pod sandbox `pod_sandbox`.
    pub fn pod_member(&self, namespace: &str, pod_sandbox: &str, name: &str) -> Result<Option<String>> {
        let path = self.pod_member_path(namespace, pod_sandbox, name)?;
        match fs::read_to_string(&path) {
            Ok(id) => {
                key::validate_id(&id).map_err(|_| CheckpointError::CorruptManifest {
                    path: path.clone(),
                    reason: format!("{id:?} is no container id"),
                })?;
                Ok(Some(id))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).io_ctx("read", path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_members_are_per_namespace_pod_and_name() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path()).unwrap();
        assert_eq!(store.pod_member("k8s.io", "abc123", "main").unwrap(), None);
        store.set_pod_member("k8s.io", "abc123", "main", "c1").unwrap();
        store.set_pod_member("k8s.io", "abc123", "main", "c2").unwrap();
        store.set_pod_member("k8s.io", "abc123", "side", "c3").unwrap();
        assert_eq!(store.pod_member("k8s.io", "abc123", "main").unwrap().as_deref(), Some("c2"));
        assert_eq!(store.pod_member("other", "abc123", "main").unwrap(), None);
        assert_eq!(store.pod_member("k8s.io", "def456", "main").unwrap(), None);
        for (pod, name) in [("..", "main"), ("abc123", "../x"), ("a/b", "main"), ("abc123", "")] {
            let err = store.set_pod_member("k8s.io", pod, name, "c4").unwrap_err();
            assert!(err.to_string().contains("not a safe path component"), "{pod:?} {name:?}: {err}");
        }
    }

    #[test]
    fn owners_are_per_namespace_and_id_and_go_with_the_chain() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path()).unwrap();
        let owner =
            PodOwner { kube_namespace: "team-a".into(), pod_sandbox: "abc123".into(), container_name: "main".into() };
        assert_eq!(store.owner("k8s.io/c1").unwrap(), None);
        store.set_owner("k8s.io/c1", &owner).unwrap();
        assert_eq!(store.owner("k8s.io/c1").unwrap().as_ref(), Some(&owner));
        // A retired generation of the id is the same container's.
        assert_eq!(store.owner("k8s.io/c1@2").unwrap().as_ref(), Some(&owner));
        assert_eq!(store.owner("other/c1").unwrap(), None);
        assert!(store.owner("k8s.io/../c1").is_err());
        store.remove_container("k8s.io/c1").unwrap();
        assert_eq!(store.owner("k8s.io/c1").unwrap(), None);
    }

    #[test]
    fn an_origin_needs_a_head_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path()).unwrap();
        let origin = Origin {
            source: "k8s.io/old".into(),
            turn: 3,
            reason: OriginReason::KubeletReplacement,
            pod_sandbox: Some("abc123".into()),
            container_name: Some("main".into()),
            at_unix_ms: 1,
        };
        assert!(matches!(store.set_origin("k8s.io/new", &origin), Err(CheckpointError::NoSuchContainer(_))));
        assert_eq!(store.origin("k8s.io/new").unwrap(), None);
        assert_eq!(
            origin.to_string(),
            "restored from k8s.io/old:3 (kubelet replacement of container \"main\" in pod sandbox abc123)"
        );
    }
}
