//! Which fault strikes, and after which turn.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    None,
    /// SIGKILL every process of the sandbox after the turn (and its checkpoint, if any) finished.
    KillProcesses,
    /// SIGKILL the sandbox's shim; containerd reports the task exited.
    KillShim,
    /// SIGKILL containerd and start it again; shims and tasks keep running.
    RestartContainerd,
    /// SIGKILL crabd, the node engine the crab shims share; the shims go on without it.
    KillCrabd,
    /// The sandbox's processes and shim die and containerd forgets the
    /// container and its snapshot (and the checkpoint images in its content
    /// store); only what lies outside containerd, crab's store, is left.
    ContainerdStateLoss,
    /// Node A is gone: the sandbox's processes and shim, crabd and containerd
    /// are killed, containerd forgets the sandbox, and the directories of the
    /// sandbox's node (crab's store, kept images, runc root) are deleted.
    /// Recovery happens on node B (a second containerd and crab on this
    /// machine) from what left node A before the fault: the registry.
    NodeLoss,
}

impl FaultKind {
    pub const ALL: [FaultKind; 7] = [
        FaultKind::None,
        FaultKind::KillProcesses,
        FaultKind::KillShim,
        FaultKind::RestartContainerd,
        FaultKind::KillCrabd,
        FaultKind::ContainerdStateLoss,
        FaultKind::NodeLoss,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::None => "none",
            FaultKind::KillProcesses => "kill-processes",
            FaultKind::KillShim => "kill-shim",
            FaultKind::RestartContainerd => "restart-containerd",
            FaultKind::KillCrabd => "kill-crabd",
            FaultKind::ContainerdStateLoss => "containerd-state-loss",
            FaultKind::NodeLoss => "node-loss",
        }
    }

    /// Whether the fault wipes what containerd stores for the sandbox,
    /// checkpoint images in its content store included.
    pub fn loses_containerd_state(self) -> bool {
        matches!(self, FaultKind::ContainerdStateLoss | FaultKind::NodeLoss)
    }

    /// Whether the sandbox comes back on node B, with nothing of node A.
    pub fn moves_to_node_b(self) -> bool {
        self == FaultKind::NodeLoss
    }

    /// Whether the fault strikes only the run's own sandbox and shim, not a daemon every run
    /// uses (containerd, crabd, the node): a run with it may go between two reference runs.
    pub fn strikes_only_its_sandbox(self) -> bool {
        matches!(self, FaultKind::None | FaultKind::KillProcesses | FaultKind::KillShim)
    }

    /// Whether the fault strikes the checkpoint pipeline rather than the
    /// sandbox, so a correct run also needs every later checkpoint complete.
    pub fn strikes_checkpointing(self) -> bool {
        self == FaultKind::KillCrabd
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "unknown fault {0:?} (expected one of: none, kill-processes, kill-shim, restart-containerd, kill-crabd, containerd-state-loss, node-loss)"
)]
pub struct UnknownFault(pub String);

impl FromStr for FaultKind {
    type Err = UnknownFault;

    fn from_str(text: &str) -> Result<FaultKind, UnknownFault> {
        FaultKind::ALL.into_iter().find(|kind| kind.name() == text).ok_or_else(|| UnknownFault(text.to_string()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTurn {
    /// After this 1-based turn.
    Fixed(u32),
    /// A turn drawn from the seed and the trace name, so each trace of a
    /// batch gets its own turn and a rerun with the same seed the same one.
    Random(u64),
    /// The middle of the trace.
    Middle,
    /// The last turn: every turn runs on the first node (a replication figure looks at each).
    Last,
}

impl FaultTurn {
    /// The turn after which the fault strikes, `None` for an empty trace.
    pub fn resolve(self, trace_name: &str, turns: u32) -> Option<u32> {
        if turns == 0 {
            return None;
        }
        Some(match self {
            FaultTurn::Fixed(turn) => turn,
            FaultTurn::Random(seed) => (splitmix64(seed ^ fnv1a(trace_name.as_bytes())) % u64::from(turns)) as u32 + 1,
            FaultTurn::Middle => turns.div_ceil(2),
            FaultTurn::Last => turns,
        })
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_turn_is_in_range_and_reproducible() {
        for seed in 0..200 {
            let turn = FaultTurn::Random(seed).resolve("trace-a", 7).unwrap();
            assert!((1..=7).contains(&turn));
            assert_eq!(FaultTurn::Random(seed).resolve("trace-a", 7), Some(turn));
        }
        let spread: std::collections::BTreeSet<u32> =
            (0..200).map(|seed| FaultTurn::Random(seed).resolve("trace-a", 7).unwrap()).collect();
        assert_eq!(spread.len(), 7, "every turn is reachable");
    }

    #[test]
    fn middle_and_fixed() {
        assert_eq!(FaultTurn::Middle.resolve("t", 12), Some(6));
        assert_eq!(FaultTurn::Middle.resolve("t", 1), Some(1));
        assert_eq!(FaultTurn::Fixed(3).resolve("t", 12), Some(3));
        assert_eq!(FaultTurn::Last.resolve("t", 12), Some(12));
        assert_eq!(FaultTurn::Last.resolve("t", 0), None);
        assert_eq!(FaultTurn::Middle.resolve("t", 0), None);
    }

    #[test]
    fn fault_names_round_trip_and_unknown_ones_are_named() {
        for kind in FaultKind::ALL {
            assert_eq!(kind.name().parse::<FaultKind>().unwrap(), kind);
            assert_eq!(kind.to_string(), kind.name());
        }
        let error = "reboot".parse::<FaultKind>().unwrap_err().to_string();
        assert!(error.contains("\"reboot\"") && error.contains("node-loss"), "{error}");
    }

    #[test]
    fn only_the_state_losses_take_containerd_state_and_only_kill_crabd_needs_later_checkpoints() {
        let lossy: Vec<FaultKind> = FaultKind::ALL.into_iter().filter(|k| k.loses_containerd_state()).collect();
        assert_eq!(lossy, [FaultKind::ContainerdStateLoss, FaultKind::NodeLoss]);
        let moved: Vec<FaultKind> = FaultKind::ALL.into_iter().filter(|k| k.moves_to_node_b()).collect();
        assert_eq!(moved, [FaultKind::NodeLoss]);
        let pipeline: Vec<FaultKind> = FaultKind::ALL.into_iter().filter(|k| k.strikes_checkpointing()).collect();
        assert_eq!(pipeline, [FaultKind::KillCrabd]);
    }
}
