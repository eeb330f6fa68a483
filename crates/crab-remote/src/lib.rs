//! Crab's remote tier: checkpoints leave the node through an OCI registry.
//!
//! - [`pack`]: many small objects (4 KiB page chunks) grouped into zstd-compressed pack blobs
//!   of a few MiB, with an index from object digest to (pack, offset, length).
//! - [`artifact`]: the OCI artifact crab pushes per checkpointed turn (ARTIFACT.md).
//! - [`remote`]: push and pull through a registry, every digest verified, every request
//!   bounded and retried with backoff when the failure is transient.
//! - [`auth`]: credentials from a Docker client config.
//! - [`queue`]: the persistent push queue (a journal of pending pushes, idempotent steps).
//!
//! - [`chain`]: a sandbox's chain of crab's store pushed and pulled turn by turn.
//!
//! The registry side knows nothing of crab's store: objects go in through [`ObjectSource`] and
//! come back through [`ObjectSink`]; [`chain`] implements both over `crab-store`.

pub mod artifact;
pub mod auth;
pub mod chain;
pub mod digest;
pub mod error;
pub mod pack;
pub mod queue;
pub mod remote;

pub use auth::Credentials;
pub use digest::Digest;
pub use error::{RemoteError, Result};
pub use queue::{PushQueue, QueuedPush};
pub use remote::{
    ObjectSink, ObjectSource, PullReport, PushReport, Remote, RemoteConfig, RemoteIndex, RetryPolicy, TurnPush,
};
