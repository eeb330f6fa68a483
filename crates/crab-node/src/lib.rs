//! The node engine: one `crabd` per host owns the eBPF inspector and the
//! commit bandwidth, and every shim talks to it over a Unix socket.
//!
//! Loading the inspector once per node instead of once per shim keeps the
//! per-syscall cost of the BPF programs (paid by every process on the host)
//! and their memory constant in the number of sandboxes. The token bucket
//! keeps checkpoint writes of many sandboxes from saturating the disk.
//!
//! - [`protocol`]: the framed, versioned messages on the socket.
//! - [`bucket`]: the token bucket and the order in which waiting commits go.
//! - [`server`]: crabd itself (`src/main.rs` is its entry point).
//! - [`client`]: the shim's side: drains of a sandbox's effects and grants of
//!   commit bandwidth over the socket, starting crabd on demand.
//! - [`cli`]: `crabctl node` (status, eviction marks).

pub mod bucket;
pub mod cli;
pub mod client;
pub mod protocol;
pub mod server;

use std::path::{Path, PathBuf};

pub use bucket::{BucketConfig, CommitKind, DEFAULT_CHUNK_BYTES};
pub use client::{Acquired, ClientOptions, NodeClient};
pub use protocol::{NodeStatus, PROTOCOL_VERSION, compat_identity};

/// Where crabd listens unless configured otherwise. The directory is root's
/// alone (0700) and no container mounts it.
pub use crab_config::DEFAULT_NODE_SOCKET as DEFAULT_SOCKET;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("crabd socket {path}: {source}")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("crabd at {path} did not answer within {after_ms} ms")]
    Timeout { path: PathBuf, after_ms: u64 },
    #[error("crabd protocol: {0}")]
    Protocol(#[from] protocol::ProtocolError),
    /// A crabd of another build: its records or messages may mean something else.
    #[error(
        "crabd at {path} ({pid}) is of another build: its identity is {theirs}, this build's is {ours} \
         (the wire format or the BPF record layout differ); not using it"
    )]
    Incompatible { path: PathBuf, pid: String, ours: String, theirs: String },
    #[error("crabd: {0}")]
    Remote(String),
    #[error("crabd answered {got} to {request}")]
    UnexpectedReply { request: &'static str, got: String },
    #[error("starting crabd ({binary}): {message}")]
    Spawn { binary: PathBuf, message: String },
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("loading the node's inspector: {0}")]
    Inspector(#[from] crab_inspector::InspectorError),
}

/// Asks the crabd at `socket` for its state: watched containers, and per
/// sandbox the commits waiting for bandwidth and how late they are.
pub async fn status_report(socket: &Path) -> Result<NodeStatus, NodeError> {
    client::one_shot(socket, protocol::Request::Status).await.and_then(|reply| match reply {
        protocol::Reply::Status(status) => Ok(*status),
        other => Err(NodeError::UnexpectedReply { request: "status", got: other.name().into() }),
    })
}

/// Marks `sandbox` for eviction (its commits go first) or clears the mark.
pub async fn set_eviction(socket: &Path, sandbox: &str, evicting: bool) -> Result<(), NodeError> {
    let request = protocol::Request::Evict { sandbox: sandbox.into(), evicting };
    match client::one_shot(socket, request).await? {
        protocol::Reply::Ok => Ok(()),
        other => Err(NodeError::UnexpectedReply { request: "evict", got: other.name().into() }),
    }
}

/// Renders a status report for people (`crabctl node`).
pub fn render_status(status: &NodeStatus) -> String {
    use std::fmt::Write;
    const MIB: f64 = (1 << 20) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "crabd pid {} (protocol {}, identity {}, up {:.0} s): bucket {:.1} MiB/s, burst {:.1} MiB, chunk {:.1} MiB, {:.1} MiB available",
        status.pid,
        status.version,
        status.identity,
        status.uptime_s,
        status.bucket.rate_bytes_per_s / MIB,
        status.bucket.burst_bytes as f64 / MIB,
        status.bucket.chunk_bytes as f64 / MIB,
        status.bucket.tokens / MIB,
    );
    let _ = writeln!(
        out,
        "granted {:.1} MiB, longest wait {:.0} ms, superseded commits {}",
        status.bucket.granted_bytes as f64 / MIB,
        status.bucket.max_lag_ms,
        status.bucket.superseded,
    );
    let _ = writeln!(out, "watched containers: {}", status.watched.len());
    for w in &status.watched {
        let _ = writeln!(
            out,
            "  {:<40} cgroup {:<8} pid {:<8} lost {}",
            w.container, w.cgroup_id, w.root_pid, w.lost_events
        );
    }
    let _ = writeln!(
        out,
        "{:<40} {:>7} {:>12} {:>9} {:>10} {:>12} {:>10} {:>10} {:>5}",
        "SANDBOX", "WAITING", "WAITING_MIB", "LAG_MS", "MAX_LAG_MS", "GRANTED_MIB", "MIB/S_10S", "SUPERSEDED", "EVICT"
    );
    for s in &status.bucket.sandboxes {
        let _ = writeln!(
            out,
            "{:<40} {:>7} {:>12.1} {:>9.0} {:>10.0} {:>12.1} {:>10.2} {:>10} {:>5}",
            s.sandbox,
            s.waiting,
            s.waiting_bytes as f64 / MIB,
            s.lag_ms,
            s.max_lag_ms,
            s.granted_bytes as f64 / MIB,
            s.recent_rate_bytes_per_s / MIB,
            s.superseded,
            if s.evicting { "yes" } else { "" },
        );
    }
    out
}
