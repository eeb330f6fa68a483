//! The containerd shim v2: `containerd-shim-crab-v2`, a drop-in for
//! `io.containerd.runc.v2`.
//!
//! - [`bootstrap`]: the binary's actions (`start`, `delete`, serve, `-v`, `-info`).
//! - [`service`]: the Task API over containers.
//! - [`container`], [`process`]: lifecycle of a container and its processes.
//! - [`io`]: stdio plumbing (fifos, files, logging binaries, TTYs).
//! - [`cgroup`]: metrics and OOM notifications.
//! - [`events`]: task events to containerd, across its restarts.
//! - The option messages containerd attaches to requests are decoded by
//!   [`crab_config::runtime_options`] (crabctl reads them too).

pub mod bootstrap;
pub mod cgroup;
pub mod container;
pub mod cri;
pub mod events;
pub mod io;
pub mod process;
pub mod remote;
pub mod service;
mod tap;

use containerd_shim_protos::ttrpc;

use crab_config::ConfigError;
use crab_config::runtime_options::OptionsError;
use crab_engine::TurnRequestError;
use crab_runtime::RuntimeError;

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
    /// Runtime options containerd sent that cannot be used.
    #[error("invalid argument: {0}")]
    Options(#[from] OptionsError),
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
            // The runtime knows no such container (a task whose restore failed at Start has none):
            // NotFound is what lets `ctr task delete -f` and CRI's removal go on to Delete.
            ShimError::NotFound(_) | ShimError::Runtime(RuntimeError::NoContainer { .. }) => ttrpc::Code::NOT_FOUND,
            ShimError::AlreadyExists(_) => ttrpc::Code::ALREADY_EXISTS,
            ShimError::FailedPrecondition(_) | ShimError::Runtime(RuntimeError::Missing { .. }) => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            ShimError::InvalidArgument(_)
            | ShimError::Config(_)
            | ShimError::Options(_)
            | ShimError::Runtime(RuntimeError::Unsupported(_)) => ttrpc::Code::INVALID_ARGUMENT,
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

impl From<TurnRequestError> for ShimError {
    fn from(e: TurnRequestError) -> Self {
        match e {
            TurnRequestError::Invalid(_) => Self::InvalidArgument(e.to_string()),
            TurnRequestError::NoEngine(_) => Self::FailedPrecondition(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_requests_map_to_the_codes_containerd_expects() {
        let bad = crab_store::turns::TurnRequest::parse("undo").unwrap_err();
        let invalid: ShimError = TurnRequestError::Invalid(bad).into();
        assert_eq!(invalid.code(), ttrpc::Code::INVALID_ARGUMENT);
        assert!(invalid.to_string().contains("io.crab.turn"), "{invalid}");
        let no_engine: ShimError = TurnRequestError::NoEngine("c1".into()).into();
        assert_eq!(no_engine.code(), ttrpc::Code::FAILED_PRECONDITION);
    }
}
