//! What the engine asks of the node: where a sandbox's effects come from ([`EffectSource`]) and
//! the commit bandwidth its write-outs draw ([`CommitGate`]). Both are served by crabd through
//! [`NodeClient`], or, without crabd, effects come from an [`Inspector`] loaded in the shim and
//! commits are not paced. Unit tests put scripted sources and gates in their place.

use crab_inspector::{Inspector, InspectorError, TurnEffects, WatchedContainer};
use crab_node::{Acquired, CommitKind, NodeClient, NodeError};

/// Why an effect source could not watch, drain or unwatch a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum EffectSourceError {
    #[error(transparent)]
    Inspector(#[from] InspectorError),
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// Where a sandbox's effects come from: the inspector loaded in this process, or the node's
/// inspector served by crabd.
#[async_trait::async_trait]
pub trait EffectSource: Send + Sync {
    async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), EffectSourceError>;
    /// Effects of `container` up to `until_ns` (CLOCK_MONOTONIC), and records lost meanwhile.
    async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, EffectSourceError>;
    async fn unwatch(&self, container: &str) -> Result<(), EffectSourceError>;
}

#[async_trait::async_trait]
impl EffectSource for Inspector {
    async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), EffectSourceError> {
        let watched = WatchedContainer {
            id: container.into(),
            root_pid: Some(root_pid),
            rootfs: Some(format!("/proc/{root_pid}/root").into()),
        };
        Ok(Inspector::watch(self, cgroup_id, watched).await?)
    }

    async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, EffectSourceError> {
        Ok(Inspector::drain(self, container, until_ns).await?)
    }

    async fn unwatch(&self, container: &str) -> Result<(), EffectSourceError> {
        Ok(Inspector::unwatch(self, container).await.map(drop)?)
    }
}

#[async_trait::async_trait]
impl EffectSource for NodeClient {
    async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), EffectSourceError> {
        Ok(NodeClient::watch(self, container, cgroup_id, root_pid).await?)
    }

    async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, EffectSourceError> {
        Ok(NodeClient::drain(self, container, until_ns).await?)
    }

    async fn unwatch(&self, container: &str) -> Result<(), EffectSourceError> {
        Ok(NodeClient::unwatch(self, container).await?)
    }
}

/// The node's commit bandwidth (crabd's token bucket): a write-out draws its bytes chunk by
/// chunk as it writes them (see [`crate::pipeline::TurnSlot::write_out`]). A draw always
/// returns; when the node cannot grant in time the bytes go ahead (the gate logs it).
#[async_trait::async_trait]
pub trait CommitGate: Send + Sync {
    /// Largest draw the node grants at once.
    fn chunk_bytes(&self) -> u64;
    /// Waits until `bytes` more of turn `turn`'s write-out may go to disk. A `supersedable`
    /// process checkpoint may hear instead that a newer one replaces it.
    async fn acquire(&self, sandbox: &str, bytes: u64, kind: CommitKind, turn: u64, supersedable: bool) -> Acquired;
    /// Turn `turn` of `sandbox` holds a full process capture: waiting process write-outs of
    /// its earlier turns may be dropped.
    async fn process_captured(&self, sandbox: &str, turn: u64);
}

#[async_trait::async_trait]
impl CommitGate for NodeClient {
    fn chunk_bytes(&self) -> u64 {
        NodeClient::chunk_bytes(self)
    }

    async fn acquire(&self, sandbox: &str, bytes: u64, kind: CommitKind, turn: u64, supersedable: bool) -> Acquired {
        NodeClient::acquire(self, sandbox, bytes, kind, turn, supersedable).await
    }

    async fn process_captured(&self, sandbox: &str, turn: u64) {
        NodeClient::process_captured(self, sandbox, turn).await
    }
}

/// Where checkpointed turns go once they are durable here: the remote tier (the shim's push
/// queue to a registry). Both calls return at once: the push itself runs in the background,
/// in think time, and never holds a turn.
pub trait Replicator: Send + Sync {
    /// The sandbox's engine started: pushes it left queued (a shim or crabd restarted) resume.
    fn started(&self, key: &str);
    /// Turn `turn` of the sandbox has a durable checkpoint of its own.
    fn checkpointed(&self, key: &str, turn: u64);
}
