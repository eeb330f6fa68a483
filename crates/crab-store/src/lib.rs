//! The checkpoint store: content-addressed blobs, per-turn manifests chained per sandbox,
//! file system deltas, chunked CRIU images, in-place rollback, forks and GC, and the turn log
//! of each sandbox ([`turns`]).
//!
//! A plain library over a state directory (default [`DEFAULT_STATE_DIR`]): no async runtime,
//! no BPF. Every call blocks on file I/O, so async callers run it on their runtime's blocking
//! pool (the engine's `blocking` helper).

mod baseline;
mod chain;
mod error;
mod fsdelta;
mod gc;
mod images;
mod index;
mod key;
mod lineage;
mod manifest;
mod mounts;
mod pack;
mod path;
mod quota;
mod store;
mod sys;
mod transfer;
pub mod turns;

pub use baseline::{FullCheckpoint, overlay_upperdir, remove_full_checkpoints, write_full_checkpoint};
pub use chain::{
    CheckpointInfo, CheckpointStore, CommitReport, DEFAULT_STATE_DIR, Head, KeptImages, RollbackReport,
    RollbackRequest, ShellRestore, StagedTurn, TurnInput, VerifyReport, WriterLock,
};
pub use error::{CheckpointError, Result};
pub use fsdelta::{ApplyStats, ChangedPath};
pub use gc::{ContainerCensus, GcReport, RetentionPolicy};
pub use images::{CHUNK_SIZE, RestoredImages};
pub use key::{
    DEFAULT_NAMESPACE, KeyError, SandboxKey, full_checkpoints_dir, removed_marker_path, saved_spec_path,
    saved_spec_path_of, turn_log_path, validate_id, validate_namespace,
};
pub use lineage::{Origin, OriginReason, PodOwner};
pub use manifest::{
    BASH_OWN_VARIABLES, FsEntry, FsNode, ImageContent, ImageFile, ImageSet, MANIFEST_VERSION, Manifest, Meta,
    ParentRef, ShellState, Snapshot, TurnClass, declared_name,
};
pub use mounts::{ContainerMount, ContainerRoot, MountKind, SandboxMounts, SpecMount, WalkEntry, rootfs_diff_paths};
pub use path::{Bytes, RelPath};
pub use quota::OverQuota;
pub use store::{BlobLocation, BlobStore, Digest, Traffic, Unlimited, WriteBatch, WriteTokens, write_file_durably};
pub use transfer::ExportedTurn;
