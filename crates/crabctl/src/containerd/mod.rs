//! Talking to containerd: the `ctr` command line against a chosen socket and
//! namespace, shared by `crabctl` (restores, forks) and the replay; its gRPC
//! API for what `ctr` cannot send (turn marks).

pub mod ctr;
pub mod grpc;
