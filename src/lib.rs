//! Crab: a semantics-aware checkpoint/restore runtime for agent sandboxes.
//!
//! The library holds every part of the product; the binaries in `src/bin` are
//! thin entry points over it.
//!
//! - [`shim`]: the containerd shim v2 Task service over an OCI runtime.
//! - [`runtime`]: the OCI runtime command-line client (runc or crun).
//! - [`config`]: crab's own configuration file.
//! - [`inspector`]: eBPF view of what each turn did to the OS.
//! - [`checkpoint`]: the content-addressed checkpoint store.
//! - [`turns`]: sandbox annotations and the per-turn records.
//! - [`containerd`]: the `ctr` client the tools use to reach containerd.
//! - [`ctl`]: what `crabctl` does with checkpoints (recover, rollback, fork, ...).
//! - [`engine`]: per-sandbox checkpoint engine (turns → inspector → store).

pub mod checkpoint;
pub mod config;
pub mod containerd;
pub mod ctl;
pub mod engine;
pub mod inspector;
pub mod logging;
pub mod node;
pub mod replay;
pub mod runtime;
pub mod shim;
pub mod turns;

#[cfg(test)]
mod parser_properties;
