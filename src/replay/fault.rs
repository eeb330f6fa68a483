//! Which fault strikes, and after which turn.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    None,
    /// SIGKILL every process of the sandbox after the turn (and its checkpoint, if any) finished.
    KillProcesses,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::None => "none",
            FaultKind::KillProcesses => "kill-processes",
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown fault {0:?} (expected kill-processes or none)")]
pub struct UnknownFault(pub String);

impl FromStr for FaultKind {
    type Err = UnknownFault;

    fn from_str(text: &str) -> Result<FaultKind, UnknownFault> {
        [FaultKind::None, FaultKind::KillProcesses]
            .into_iter()
            .find(|kind| kind.name() == text)
            .ok_or_else(|| UnknownFault(text.to_string()))
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
}

impl FaultTurn {
    /// The turn after which the fault strikes, `None` for an empty trace.
    pub fn resolve(self, trace_name: &str, turns: u32) -> Option<u32> {
        if turns == 0 {
            return None;
        }
        Some(match self {
            FaultTurn::Fixed(turn) => turn,
            FaultTurn::Random(seed) => {
                (splitmix64(seed ^ fnv1a(trace_name.as_bytes())) % u64::from(turns)) as u32 + 1
            }
            FaultTurn::Middle => turns.div_ceil(2),
        })
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
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
        let spread: std::collections::BTreeSet<u32> = (0..200)
            .map(|seed| FaultTurn::Random(seed).resolve("trace-a", 7).unwrap())
            .collect();
        assert_eq!(spread.len(), 7, "every turn is reachable");
    }

    #[test]
    fn middle_and_fixed() {
        assert_eq!(FaultTurn::Middle.resolve("t", 12), Some(6));
        assert_eq!(FaultTurn::Middle.resolve("t", 1), Some(1));
        assert_eq!(FaultTurn::Fixed(3).resolve("t", 12), Some(3));
        assert_eq!(FaultTurn::Middle.resolve("t", 0), None);
    }

    #[test]
    fn fault_names_parse() {
        assert_eq!(
            "kill-processes".parse::<FaultKind>().unwrap(),
            FaultKind::KillProcesses
        );
        assert!("reboot".parse::<FaultKind>().is_err());
    }
}
