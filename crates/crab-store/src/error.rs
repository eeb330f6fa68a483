//! Errors of the checkpoint store.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while writing, reading, restoring or collecting checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("blob {digest} at {path} is corrupt: its content hashes to {actual}")]
    CorruptBlob { digest: String, path: PathBuf, actual: String },

    #[error("blob {digest} is missing (expected at {path})")]
    MissingBlob { digest: String, path: PathBuf },

    /// A blob's name is a link that does not name a place in a pack.
    #[error("blob link {path} names no place in a pack: {target:?}")]
    BadPackLink { path: PathBuf, target: String },

    /// A pack table that cannot be read as one: its blobs are not found through it.
    #[error("pack index {path} is unusable: {reason}")]
    BadPackIndex { path: PathBuf, reason: String },

    #[error("invalid digest {0:?}: expected 64 lowercase hex characters")]
    InvalidDigest(String),

    #[error("manifest {path} is corrupt: {reason}")]
    CorruptManifest { path: PathBuf, reason: String },

    #[error("manifest {path} has version {found}, this build reads version {supported}")]
    UnsupportedManifestVersion { path: PathBuf, found: u32, supported: u32 },

    #[error("broken chain of container {container:?}: {missing}")]
    BrokenChain { container: String, missing: String },

    #[error("container {container:?} has no checkpoint at turn {turn}")]
    NoSuchTurn { container: String, turn: u64 },

    #[error("container {0:?} has no checkpoints")]
    NoSuchContainer(String),

    #[error(transparent)]
    InvalidKey(#[from] super::key::KeyError),

    #[error("turn {turn} of container {container:?} must be greater than its head turn {head}")]
    TurnNotAfterHead { container: String, turn: u64, head: u64 },

    #[error("path {path:?} is not allowed: {reason}")]
    UnsafePath { path: String, reason: &'static str },

    #[error("path {path:?} cannot be resolved inside the root: {reason}")]
    OutsideRoot { path: String, reason: String },

    #[error("no base state for {path:?}: it was never checkpointed before turn {turn} and no base rootfs was given")]
    NoBaseState { path: String, turn: u64 },

    #[error("sparse file {path}: {reason}")]
    BadExtents { path: PathBuf, reason: String },

    /// A path was replaced again and again between two steps of a restore: a process in the
    /// container is racing it. Nothing outside the container was touched.
    #[error(
        "{path} was replaced {attempts} times while it was being {op}; a process in the container races the restore"
    )]
    KeptChanging { path: PathBuf, op: &'static str, attempts: u32 },

    #[error("CRIU image directory {path}: {reason}")]
    BadImageDir { path: PathBuf, reason: String },

    #[error("JSON encoding of {what}: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },

    #[error("invalid request: {0}")]
    InvalidRequest(String),

    #[error("blocking task of the checkpoint store failed: {0}")]
    Join(String),

    /// The checkpoint would take the sandbox's chain over its quota: nothing of it was
    /// published, the head (the sandbox's last recoverable checkpoint) stays.
    #[error("checkpoint of {container} not written, {over}")]
    OverQuota { container: String, over: super::quota::OverQuota },

    /// The write-out's token source refused further bytes (e.g. a newer checkpoint superseded
    /// it); nothing of the write-out was published.
    #[error("write-out stopped: {0}")]
    WriteOutStopped(String),
}

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// Attaches the operation and path to an `io::Error`, so every I/O failure says what it was doing where.
pub(crate) trait IoContext<T> {
    fn io_ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn io_ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| CheckpointError::Io { op, path: path.into(), source })
    }
}
