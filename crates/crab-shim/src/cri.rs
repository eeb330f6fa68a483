//! Containers of Kubernetes pods: which logical container a new one is, so that kubelet's
//! replacement of a dead container (same pod sandbox, same container name, attempt + 1, a new
//! id) starts from its predecessor's latest checkpoint.
//!
//! What is trusted, and why:
//! - The CRI plugin sets `io.kubernetes.cri.container-type`, `io.kubernetes.cri.sandbox-id`
//!   and `io.kubernetes.cri.container-name` on every container it creates. A runtime entry
//!   that passes `io.kubernetes.*` through from the pod (`pod_annotations`), or a client
//!   other than CRI, could name another pod; so the sandbox id alone is not believed, and a
//!   container that fails the check below is neither restored nor recorded as the pod's.
//! - Kernel-checked: the pod sandbox the annotation names must be a container this shim runs
//!   (one shim serves a pod), running, and every namespace the new container's spec joins by
//!   path (network, IPC, UTS, and PID for a pod-wide PID namespace) must be the very namespace
//!   (device and inode of the nsfs file) that sandbox's init is in, with at least one such
//!   namespace. A container created in pod B cannot pass as pod A's.
//! - The container name is only compared within that pod: every container of a pod comes
//!   from the same pod spec, so one may stand for another of its own pod, never of another.
//! - The pod's Kubernetes namespace (`io.kubernetes.cri.sandbox-namespace`, which CRI sets
//!   from the pod's metadata) is taken from a container that passed the check above, and only
//!   bounds `io.crab.restore-from`: a pod restores only from chains the shim recorded for pods
//!   of the same Kubernetes namespace (see [`restore_allowed`]).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::ShimError;

const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
const CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";

/// The namespaces a pod's containers share with the pod sandbox, as the spec names them and
/// as `/proc/<pid>/ns/` does.
const POD_NAMESPACES: [(&str, &str); 4] = [("network", "net"), ("ipc", "ipc"), ("uts", "uts"), ("pid", "pid")];

/// What CRI says a new container is: a workload container of a pod sandbox, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodContainer {
    pub sandbox_id: String,
    pub name: String,
    /// The pod's Kubernetes namespace, when CRI named it.
    pub kube_namespace: Option<String>,
    /// `(spec type, path)` of every namespace the spec joins by path.
    joined: Vec<(String, String)>,
}

#[derive(serde::Deserialize)]
struct Spec {
    #[serde(default)]
    annotations: HashMap<String, String>,
    #[serde(default)]
    linux: Option<Linux>,
}

#[derive(serde::Deserialize)]
struct Linux {
    #[serde(default)]
    namespaces: Vec<Namespace>,
}

#[derive(serde::Deserialize)]
struct Namespace {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: Option<String>,
}

impl PodContainer {
    /// From the bundle's spec: None for anything but a CRI workload container (a pod sandbox
    /// itself, a container of `ctr` or another client).
    pub fn from_bundle(bundle: &Path) -> Result<Option<Self>, ShimError> {
        let path = bundle.join("config.json");
        let bytes = std::fs::read(&path).map_err(|e| ShimError::io(&path, e))?;
        let spec: Spec = serde_json::from_slice(&bytes)
            .map_err(|e| ShimError::InvalidArgument(format!("{}: {e}", path.display())))?;
        Ok(Self::from_spec(spec))
    }

    fn from_spec(spec: Spec) -> Option<Self> {
        let a = &spec.annotations;
        if a.get(CONTAINER_TYPE).map(String::as_str) != Some("container") {
            return None;
        }
        let (sandbox_id, name) = (a.get(SANDBOX_ID)?.clone(), a.get(CONTAINER_NAME)?.clone());
        let kube_namespace = a.get(SANDBOX_NAMESPACE).filter(|ns| !ns.is_empty()).cloned();
        let joined = spec
            .linux
            .map(|l| l.namespaces)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|ns| Some((ns.kind, ns.path.filter(|p| !p.is_empty())?)))
            .collect();
        Some(Self { sandbox_id, name, kube_namespace, joined })
    }

    /// Checks on the kernel's word that this container is created in the pod whose sandbox's
    /// init is `sandbox_pid`: each namespace the spec joins by path is that init's. Err says
    /// why not.
    pub fn check_in_sandbox(&self, sandbox_pid: u32) -> Result<(), String> {
        let mut compared = 0;
        for (kind, path) in &self.joined {
            let Some((_, proc_name)) = POD_NAMESPACES.iter().find(|(spec, _)| spec == kind) else { continue };
            let id = |p: &Path| std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
            let joined = id(Path::new(path)).map_err(|e| format!("{kind} namespace {path}: {e}"))?;
            let sandbox_ns = format!("/proc/{sandbox_pid}/ns/{proc_name}");
            let sandbox = id(Path::new(&sandbox_ns)).map_err(|e| format!("{sandbox_ns}: {e}"))?;
            if joined != sandbox {
                return Err(format!(
                    "its {kind} namespace ({path}) is not that of pod sandbox {}'s init (pid {sandbox_pid})",
                    self.sandbox_id
                ));
            }
            compared += 1;
        }
        if compared == 0 {
            return Err(format!("it joins no namespace of pod sandbox {} (a host-namespace pod)", self.sandbox_id));
        }
        Ok(())
    }
}

/// Whether a container that CRI's annotations say is a pod's (`claimed`; `verified`: the
/// same, when it passed [`PodContainer::check_in_sandbox`]) may restore from a chain whose
/// recorded pod is `source` (None: the shim recorded it as no pod's container). Err says why
/// not, naming what the refusal rests on.
///
/// Under CRI every pod of the node is in containerd namespace `k8s.io`, so the containerd
/// namespace rule that keeps `ctr` tenants apart does not keep Kubernetes tenants apart: the
/// Kubernetes namespace does. A container that is not a pod's (`ctr`, crabctl: clients with
/// containerd's socket, the operator's) is bound by the containerd namespace rule alone.
pub fn restore_allowed(
    claimed: Option<&PodContainer>,
    verified: Option<&PodContainer>,
    source_key: &str,
    source: Option<&crab_store::PodOwner>,
) -> Result<(), String> {
    let Some(claimed) = claimed else { return Ok(()) };
    let Some(pod) = verified else {
        return Err(format!(
            "its annotations make it container {:?} of pod sandbox {}, which the kernel does not confirm, so              its pod, and the Kubernetes namespace it may restore from, are unknown",
            claimed.name, claimed.sandbox_id
        ));
    };
    let Some(namespace) = &pod.kube_namespace else {
        return Err(format!("CRI named no Kubernetes namespace for its pod ({SANDBOX_NAMESPACE})"));
    };
    match source {
        None => Err(format!(
            "chain {source_key} is not recorded as a container of a Kubernetes pod, and a pod restores only              from chains of pods in its own Kubernetes namespace ({namespace:?})"
        )),
        Some(owner) if owner.kube_namespace != *namespace => Err(format!(
            "chain {source_key} is a container of a pod in Kubernetes namespace {:?}, this pod is in {namespace:?},              and a pod restores only from chains of pods in its own Kubernetes namespace",
            owner.kube_namespace
        )),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> Spec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn only_cri_workload_containers_are_pod_containers() {
        let ann = |t: &str| {
            format!(
                r#"{{"annotations":{{"io.kubernetes.cri.container-type":"{t}","io.kubernetes.cri.sandbox-id":"pod1",
                "io.kubernetes.cri.container-name":"main"}},"linux":{{"namespaces":[{{"type":"ipc","path":"/proc/1/ns/ipc"}},
                {{"type":"mount"}}]}}}}"#
            )
        };
        let c = PodContainer::from_spec(spec(&ann("container"))).unwrap();
        assert_eq!((c.sandbox_id.as_str(), c.name.as_str()), ("pod1", "main"));
        assert_eq!(c.joined, vec![("ipc".to_string(), "/proc/1/ns/ipc".to_string())]);
        assert_eq!(c.kube_namespace, None);
        assert_eq!(PodContainer::from_spec(spec(&ann("sandbox"))), None);
        assert_eq!(PodContainer::from_spec(spec(r#"{"annotations":{}}"#)), None);
    }

    #[test]
    fn the_kernel_decides_which_pod_a_container_is_in() {
        let me = std::process::id();
        let own = |path: String| PodContainer {
            sandbox_id: "pod1".into(),
            name: "main".into(),
            kube_namespace: None,
            joined: vec![("ipc".into(), path), ("mount".into(), "/proc/1/ns/mnt".into())],
        };
        // The namespace this process is in is this process's: the check passes.
        own(format!("/proc/{me}/ns/ipc")).check_in_sandbox(me).unwrap();
        // A namespace of another type at that path is not the sandbox's.
        let err = own(format!("/proc/{me}/ns/uts")).check_in_sandbox(me).unwrap_err();
        assert!(err.contains("ipc namespace") && err.contains("pod1"), "{err}");
        let none =
            PodContainer { sandbox_id: "pod1".into(), name: "main".into(), kube_namespace: None, joined: vec![] };
        assert!(none.check_in_sandbox(me).unwrap_err().contains("joins no namespace"));
    }

    #[test]
    fn a_pod_restores_only_from_its_own_kubernetes_namespace() {
        let pod = |ns: Option<&str>| PodContainer {
            sandbox_id: "pod1".into(),
            name: "main".into(),
            kube_namespace: ns.map(String::from),
            joined: vec![],
        };
        let owner = |ns: &str| crab_store::PodOwner {
            kube_namespace: ns.into(),
            pod_sandbox: "pod0".into(),
            container_name: "main".into(),
        };
        let (a, b) = (pod(Some("team-a")), pod(Some("team-b")));
        // Not a pod's container: the containerd namespace rule alone applies.
        restore_allowed(None, None, "k8s.io/c0", None).unwrap();
        restore_allowed(Some(&a), Some(&a), "k8s.io/c0", Some(&owner("team-a"))).unwrap();
        let err = restore_allowed(Some(&b), Some(&b), "k8s.io/c0", Some(&owner("team-a"))).unwrap_err();
        assert!(err.contains("\"team-a\"") && err.contains("\"team-b\"") && err.contains("k8s.io/c0"), "{err}");
        let err = restore_allowed(Some(&a), Some(&a), "k8s.io/c0", None).unwrap_err();
        assert!(err.contains("not recorded as a container of a Kubernetes pod"), "{err}");
        let err = restore_allowed(Some(&a), None, "k8s.io/c0", Some(&owner("team-a"))).unwrap_err();
        assert!(err.contains("kernel does not confirm"), "{err}");
        let unnamed = pod(None);
        let err = restore_allowed(Some(&unnamed), Some(&unnamed), "k8s.io/c0", Some(&owner("team-a"))).unwrap_err();
        assert!(err.contains(SANDBOX_NAMESPACE), "{err}");
    }
}
