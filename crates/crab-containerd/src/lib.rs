//! How crab's tools (`crabctl`, `crab-replay`) and its integration tests talk to containerd:
//! [`ctr`], the `ctr` command line against one socket and namespace, as a containerd user
//! has it at hand (so the replay's baselines measure what users do), every call bounded and
//! every error naming the command line; and [`grpc`], containerd's API: what crabctl asks and
//! creates (containers from a kept spec, over the image's layers that [`image`] names), and what
//! `ctr` cannot send (a Task Update carrying crab's turn marks).

pub mod ctr;
pub mod grpc;
pub mod image;

pub use ctr::{Ctr, CtrError, CtrOutput, RawOutput};
