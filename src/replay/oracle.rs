//! The correctness oracle: a recovered run is correct when the sandbox right
//! after recovery looks like the fault-free reference at that turn, and the
//! remaining turns give the reference's exit codes and outputs.
//!
//! With two reference runs, what differs between them is nondeterministic:
//! such turns are not compared, and such fingerprint entries are masked.

use std::collections::BTreeSet;

use serde::Serialize;

use super::fingerprint::{Difference, Fingerprint};

/// What the agent saw of one turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnResult {
    pub turn: u32,
    pub rc: Option<i32>,
    pub timed_out: bool,
    pub stdout_sha256: String,
    pub stderr_sha256: String,
}

/// A fault-free run: one result and one fingerprint per turn.
#[derive(Debug, Clone)]
pub struct ReferenceRun {
    pub results: Vec<TurnResult>,
    pub fingerprints: Vec<Fingerprint>,
}

#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    #[error("no reference run")]
    NoReference,
    #[error("reference runs disagree on the number of turns ({0} vs {1})")]
    RunLengthMismatch(usize, usize),
    #[error("turn {turn} is not in the reference (it has {turns} turns)")]
    NoSuchTurn { turn: u32, turns: usize },
}

#[derive(Debug, Clone)]
pub struct Reference {
    runs: Vec<ReferenceRun>,
}

/// The oracle's judgement of one recovered run.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub fault_turn: u32,
    pub state_equal: bool,
    /// Differences from the reference right after recovery (masked entries left out).
    pub state_differences: Vec<Difference>,
    /// Entries that differ between reference runs themselves at the fault turn.
    pub masked_entries: usize,
    pub turns_compared: Vec<u32>,
    /// Turns after the fault whose results differ between reference runs.
    pub turns_excluded: Vec<u32>,
    pub rc_mismatches: Vec<u32>,
    pub output_mismatches: Vec<u32>,
    /// False when the policy had no way to recover, whatever the state looked like.
    pub recovery_possible: bool,
    pub correct: bool,
}

impl Reference {
    pub fn new(runs: Vec<ReferenceRun>) -> Result<Reference, OracleError> {
        let first = runs.first().ok_or(OracleError::NoReference)?;
        for run in &runs[1..] {
            if run.results.len() != first.results.len()
                || run.fingerprints.len() != first.fingerprints.len()
            {
                return Err(OracleError::RunLengthMismatch(
                    first.results.len(),
                    run.results.len(),
                ));
            }
        }
        Ok(Reference { runs })
    }

    fn primary(&self) -> &ReferenceRun {
        &self.runs[0]
    }

    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    pub fn fingerprint(&self, turn: u32) -> Option<&Fingerprint> {
        self.primary()
            .fingerprints
            .get(turn.checked_sub(1)? as usize)
    }

    /// Turns whose agent-visible result differs between reference runs.
    pub fn nondeterministic_turns(&self) -> BTreeSet<u32> {
        let primary = &self.primary().results;
        self.runs[1..]
            .iter()
            .flat_map(|run| {
                run.results
                    .iter()
                    .zip(primary)
                    .filter(|(a, b)| a != b)
                    .map(|(a, _)| a.turn)
            })
            .collect()
    }

    /// Fingerprint keys that differ between reference runs after `turn`.
    pub fn volatile_keys(&self, turn: u32) -> BTreeSet<String> {
        let index = (turn - 1) as usize;
        let primary = &self.primary().fingerprints[index];
        self.runs[1..]
            .iter()
            .flat_map(|run| run.fingerprints[index].diff(primary))
            .map(|d| d.key)
            .collect()
    }

    /// Judges a run that was killed after `fault_turn` and recovered into
    /// `recovered`; `later` are its results for the turns after the fault.
    pub fn judge(
        &self,
        fault_turn: u32,
        recovered: &Fingerprint,
        later: &[TurnResult],
        recovery_possible: bool,
    ) -> Result<Verdict, OracleError> {
        let turns = self.primary().results.len();
        let reference_state = self
            .fingerprint(fault_turn)
            .ok_or(OracleError::NoSuchTurn {
                turn: fault_turn,
                turns,
            })?;
        let volatile = self.volatile_keys(fault_turn);
        let state_differences: Vec<Difference> = recovered
            .diff(reference_state)
            .into_iter()
            .filter(|d| !volatile.contains(&d.key))
            .collect();
        let nondeterministic = self.nondeterministic_turns();
        let mut verdict = Verdict {
            fault_turn,
            state_equal: state_differences.is_empty(),
            state_differences,
            masked_entries: volatile.len(),
            turns_compared: Vec::new(),
            turns_excluded: Vec::new(),
            rc_mismatches: Vec::new(),
            output_mismatches: Vec::new(),
            recovery_possible,
            correct: false,
        };
        for result in later {
            let expected = self
                .primary()
                .results
                .get((result.turn as usize).wrapping_sub(1))
                .ok_or(OracleError::NoSuchTurn {
                    turn: result.turn,
                    turns,
                })?;
            if nondeterministic.contains(&result.turn) {
                verdict.turns_excluded.push(result.turn);
                continue;
            }
            verdict.turns_compared.push(result.turn);
            if (result.rc, result.timed_out) != (expected.rc, expected.timed_out) {
                verdict.rc_mismatches.push(result.turn);
            }
            if (&result.stdout_sha256, &result.stderr_sha256)
                != (&expected.stdout_sha256, &expected.stderr_sha256)
            {
                verdict.output_mismatches.push(result.turn);
            }
        }
        verdict.correct = recovery_possible
            && verdict.state_equal
            && verdict.rc_mismatches.is_empty()
            && verdict.output_mismatches.is_empty();
        Ok(verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(turn: u32, rc: i32, stdout: &str) -> TurnResult {
        TurnResult {
            turn,
            rc: Some(rc),
            timed_out: false,
            stdout_sha256: stdout.to_string(),
            stderr_sha256: String::new(),
        }
    }

    fn state(records: &[&str]) -> Fingerprint {
        let mut bytes = Vec::new();
        for record in records {
            bytes.extend_from_slice(record.as_bytes());
            bytes.push(0);
        }
        Fingerprint::parse(&bytes).unwrap()
    }

    fn run(outputs: [&str; 3], states: [&[&str]; 3]) -> ReferenceRun {
        ReferenceRun {
            results: outputs
                .iter()
                .enumerate()
                .map(|(i, out)| result(i as u32 + 1, 0, out))
                .collect(),
            fingerprints: states.iter().map(|records| state(records)).collect(),
        }
    }

    const EMPTY: &[&str] = &["F d 0755 0:0 4096 /app"];
    const WITH_FILE: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 2 /app/x"];

    #[test]
    fn exact_recovery_is_correct() {
        let reference =
            Reference::new(vec![run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE])]).unwrap();
        let verdict = reference
            .judge(2, &state(WITH_FILE), &[result(3, 0, "c")], true)
            .unwrap();
        assert!(verdict.correct);
        assert_eq!(verdict.turns_compared, [3]);
    }

    #[test]
    fn lost_file_is_incorrect_and_named() {
        let reference =
            Reference::new(vec![run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE])]).unwrap();
        let verdict = reference
            .judge(2, &state(EMPTY), &[result(3, 0, "c")], true)
            .unwrap();
        assert!(!verdict.correct);
        assert_eq!(verdict.state_differences[0].key, "file:/app/x");
    }

    #[test]
    fn a_later_exit_code_or_output_mismatch_is_incorrect() {
        let reference =
            Reference::new(vec![run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE])]).unwrap();
        let rc = reference
            .judge(2, &state(WITH_FILE), &[result(3, 1, "c")], true)
            .unwrap();
        assert_eq!((rc.correct, rc.rc_mismatches.as_slice()), (false, &[3][..]));
        let output = reference
            .judge(2, &state(WITH_FILE), &[result(3, 0, "other")], true)
            .unwrap();
        assert_eq!(
            (output.correct, output.output_mismatches.as_slice()),
            (false, &[3][..])
        );
    }

    #[test]
    fn impossible_recovery_is_never_correct() {
        let reference = Reference::new(vec![run(["a", "b", "c"], [EMPTY, EMPTY, EMPTY])]).unwrap();
        let verdict = reference.judge(1, &state(EMPTY), &[], false).unwrap();
        assert!(verdict.state_equal);
        assert!(!verdict.correct);
    }

    #[test]
    fn nondeterminism_between_reference_runs_is_excluded() {
        const STAMP_1: &[&str] = &[
            "F d 0755 0:0 4096 /app",
            "F f 0644 0:0 2 /app/x",
            "F f 0644 0:0 10 /tmp/stamp",
        ];
        const STAMP_2: &[&str] = &[
            "F d 0755 0:0 4096 /app",
            "F f 0644 0:0 2 /app/x",
            "F f 0644 0:0 11 /tmp/stamp",
        ];
        let first = run(["a", "b", "date 1"], [EMPTY, STAMP_1, STAMP_1]);
        let second = run(["a", "b", "date 2"], [EMPTY, STAMP_2, STAMP_2]);
        let reference = Reference::new(vec![first, second]).unwrap();
        assert_eq!(reference.nondeterministic_turns(), BTreeSet::from([3]));
        const STAMP_3: &[&str] = &[
            "F d 0755 0:0 4096 /app",
            "F f 0644 0:0 2 /app/x",
            "F f 0644 0:0 12 /tmp/stamp",
        ];
        let verdict = reference
            .judge(2, &state(STAMP_3), &[result(3, 0, "date 3")], true)
            .unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!(verdict.masked_entries, 1);
        assert_eq!(verdict.turns_excluded, [3]);
        // Masking covers only what varied: losing the stable file is still caught.
        let lost = reference
            .judge(2, &state(&["F d 0755 0:0 4096 /app"]), &[], true)
            .unwrap();
        assert!(!lost.correct);
    }

    #[test]
    fn fault_turn_outside_the_trace_is_an_error() {
        let reference = Reference::new(vec![run(["a", "b", "c"], [EMPTY, EMPTY, EMPTY])]).unwrap();
        assert!(matches!(
            reference.judge(4, &state(EMPTY), &[], true),
            Err(OracleError::NoSuchTurn { .. })
        ));
        assert!(matches!(
            reference.judge(0, &state(EMPTY), &[], true),
            Err(OracleError::NoSuchTurn { .. })
        ));
    }
}
