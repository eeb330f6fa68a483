//! The containerd shim v2: `containerd-shim-crab-v2`, a drop-in for
//! `io.containerd.runc.v2`.
//!
//! - [`bootstrap`]: the binary's actions (`start`, `delete`, serve, `-v`, `-info`).
//! - [`service`]: the Task API over containers.
//! - [`container`], [`process`]: lifecycle of a container and its processes.
//! - [`io`]: stdio plumbing (fifos, files, logging binaries, TTYs).
//! - [`cgroup`]: metrics and OOM notifications.
//! - [`events`]: task events to containerd, across its restarts.
//! - [`options`]: the option messages containerd attaches to requests.

pub mod bootstrap;
pub mod cgroup;
pub mod container;
pub mod events;
pub mod io;
pub mod options;
pub mod process;
pub mod service;

use containerd_shim_protos::ttrpc;

use crate::config::ConfigError;
use crate::runtime::RuntimeError;

/// Errors of the Task API, each mapped to the ttrpc code containerd expects.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Io(#[from] io::IoError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {source}")]
    Os { path: String, source: std::io::Error },
    #[error("{0}")]
    Other(String),
}

impl ShimError {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        ShimError::Os { path: path.display().to_string(), source }
    }

    pub fn code(&self) -> ttrpc::Code {
        match self {
            ShimError::NotFound(_) => ttrpc::Code::NOT_FOUND,
            ShimError::AlreadyExists(_) => ttrpc::Code::ALREADY_EXISTS,
            ShimError::FailedPrecondition(_) | ShimError::Runtime(RuntimeError::Missing { .. }) => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            ShimError::InvalidArgument(_) | ShimError::Config(_) => ttrpc::Code::INVALID_ARGUMENT,
            ShimError::Runtime(_) | ShimError::Io(_) | ShimError::Os { .. } | ShimError::Other(_) => {
                ttrpc::Code::UNKNOWN
            }
        }
    }
}

impl From<ShimError> for ttrpc::Error {
    fn from(e: ShimError) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}
