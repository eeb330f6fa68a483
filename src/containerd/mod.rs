//! Talking to containerd: the `ctr` command line against a chosen socket and
//! namespace, shared by `crabctl` (restores, forks) and the replay.

pub mod ctr;
