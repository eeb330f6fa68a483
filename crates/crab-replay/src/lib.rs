//! Trace replay: runs recorded agent turns against a real sandbox through
//! containerd, kills the sandbox at a chosen turn, recovers it the way a
//! policy can, and checks the recovery against fault-free reference runs.
//!
//! - [`trace`]: parsing and validation of the JSONL turn traces.
//! - [`sandbox`]: a container driven with `ctr` (create, exec, checkpoint, restore).
//! - [`fingerprint`]: what the next turn can observe of a sandbox; [`settle`]: waiting for
//!   what a turn left running before the sandbox is saved and looked at.
//! - [`policy`]: recovery policies (`off`, `chat-only`, `every-turn`, `crab`);
//!   [`archive`]: every-turn's checkpoints kept outside containerd (runs
//!   without a registry; with one it pushes them, see [`node::Registry`]).
//! - [`fault`]: which fault strikes after which turn; [`injector`]: striking it
//!   (processes, shim, containerd, crabd, containerd's state, the node);
//!   [`node`]: node A and node B of a node loss.
//! - [`oracle`]: the correctness verdict against the reference; [`normalize`]:
//!   wall-clock stamps and stderr order, which the oracle does not judge.
//! - [`shell`]: replay modes: each command its own exec, one shell fed
//!   through its stdin, or a tmux session typed into (sentinel protocol).
//! - [`runner`]: one trace under each policy; [`report`]: tables and JSON.
//! - [`cli`]: `crabctl replay`.

pub mod archive;
pub mod cli;
pub mod fault;
pub mod fingerprint;
pub mod injector;
pub mod node;
pub mod normalize;
pub mod oracle;
pub mod policy;
pub mod report;
pub mod runner;
pub mod sandbox;
pub mod settle;
pub mod shell;
pub mod trace;

use std::path::PathBuf;

pub use fault::{FaultKind, FaultTurn};
pub use injector::Daemons;
pub use policy::PolicyKind;
pub use report::TraceReport;
pub use runner::{ReplayOptions, replay};
pub use shell::ReplayMode;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    #[error(transparent)]
    Sandbox(#[from] sandbox::SandboxError),
    #[error(transparent)]
    Ctr(#[from] crab_containerd::CtrError),
    #[error("{file}: oracle: {source}")]
    Oracle {
        file: PathBuf,
        #[source]
        source: oracle::OracleError,
    },
    #[error("{file}: image {image} is not in containerd (build it with `{hint}`)")]
    ImageMissing { file: PathBuf, image: String, hint: String },
    #[error("{file}: fault turn {turn} is outside the trace (turns 1..={turns})")]
    FaultTurnOutOfRange { file: PathBuf, turn: u32, turns: u32 },
    #[error("fault {fault}: {source}")]
    Fault {
        fault: FaultKind,
        #[source]
        source: injector::InjectError,
    },
    #[error("crab policy: {0}")]
    Policy(String),
    #[error("invalid options: {0}")]
    Options(String),
}
