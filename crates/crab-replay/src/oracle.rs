//! The correctness oracle: a recovered run is correct when the sandbox right
//! after recovery looks like the fault-free reference at that turn, the
//! remaining turns give the reference's exit codes and outputs, and the
//! sandbox after each of them looks like the reference's after the same turn
//! (a state the recovery got wrong that no later turn prints still shows).
//!
//! With two reference runs, what differs between them is nondeterministic:
//! such turns are not compared, and such fingerprint entries are masked. A file
//! whose name alone differs between them (`tempfile`, `mktemp`) is not masked: a
//! judged run must have a file like it under a name of its own (see
//! [`pair_generated_names`]).
//!
//! Outputs are compared with their wall-clock stamps normalised, and stderr
//! also without its line order (see [`super::normalize`]); the verdict names
//! the turns that matched only that way, so the leniency stays visible.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use serde::Serialize;

use super::fingerprint::{Difference, FileEntry, Files, Fingerprint};
use super::normalize;

/// What the agent saw of one turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnResult {
    pub turn: u32,
    pub rc: Option<i32>,
    pub timed_out: bool,
    pub stdout_sha256: String,
    pub stderr_sha256: String,
    /// The output with its wall-clock stamps replaced.
    #[serde(skip)]
    pub stdout: String,
    #[serde(skip)]
    pub stderr: String,
    /// How many stamps were replaced in stdout and stderr together.
    pub wall_clock_stamps: usize,
    /// stdin mode: the shell's state as the command found it (empty in the other modes).
    #[serde(skip)]
    pub shell: String,
    /// A process the turns left running was still busy when the sandbox was looked at after
    /// this turn (see [`crate::settle`]): the state then depends on the run's pace.
    pub unsettled: bool,
}

impl TurnResult {
    pub fn new(turn: u32, rc: Option<i32>, timed_out: bool, stdout: &[u8], stderr: &[u8]) -> TurnResult {
        let (stdout_text, stderr_text) = (normalize::wall_clock(stdout), normalize::wall_clock(stderr));
        TurnResult {
            turn,
            rc,
            timed_out,
            stdout_sha256: sha256_hex(stdout),
            stderr_sha256: sha256_hex(stderr),
            wall_clock_stamps: stdout_text.stamps + stderr_text.stamps,
            stdout: stdout_text.text,
            stderr: stderr_text.text,
            shell: String::new(),
            unsettled: false,
        }
    }

    /// With the shell's state as the command found it (stdin mode).
    pub fn with_shell(self, shell: String) -> TurnResult {
        TurnResult { shell, ..self }
    }

    /// Whether the sandbox had settled when it was looked at after the turn.
    pub fn with_settled(self, settled: bool) -> TurnResult {
        TurnResult { unsettled: !settled, ..self }
    }

    fn same_exit(&self, other: &TurnResult) -> bool {
        (self.rc, self.timed_out) == (other.rc, other.timed_out)
    }

    /// How this turn's output compares with `other`'s.
    pub fn output_match(&self, other: &TurnResult) -> OutputMatch {
        if self.shell != other.shell {
            OutputMatch::Differs
        } else if (&self.stdout_sha256, &self.stderr_sha256) == (&other.stdout_sha256, &other.stderr_sha256) {
            OutputMatch::Exact
        } else if self.stdout != other.stdout {
            let apt_order = |text: &str| normalize::apt_progress_in_any_order(text);
            let stderr_any = |text: &str| {
                let mut lines = apt_order(text);
                lines.sort_unstable();
                lines
            };
            if apt_order(&self.stdout) == apt_order(&other.stdout)
                && stderr_any(&self.stderr) == stderr_any(&other.stderr)
            {
                OutputMatch::AptProgressOrder
            } else {
                OutputMatch::Differs
            }
        } else if self.stderr == other.stderr {
            OutputMatch::WallClock
        } else if normalize::lines_in_any_order(&self.stderr) == normalize::lines_in_any_order(&other.stderr) {
            OutputMatch::StderrOrder
        } else {
            OutputMatch::Differs
        }
    }

    /// The first line where this output differs from `expected`'s (after
    /// normalising), for the report.
    fn difference_from(&self, expected: &TurnResult) -> Option<OutputDifference> {
        let (stream, got, wanted) = if self.shell != expected.shell {
            ("shell state", &self.shell, &expected.shell)
        } else if self.stdout != expected.stdout {
            ("stdout", &self.stdout, &expected.stdout)
        } else {
            ("stderr", &self.stderr, &expected.stderr)
        };
        let (line, expected_line, got_line) = normalize::first_difference(wanted, got, 160)?;
        Some(OutputDifference { turn: self.turn, stream, line, expected: expected_line, got: got_line })
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// How two outputs of the same turn compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputMatch {
    /// Byte for byte.
    Exact,
    /// Equal once wall-clock stamps are replaced.
    WallClock,
    /// Equal once wall-clock stamps are replaced and stderr's lines are
    /// taken in any order.
    StderrOrder,
    /// Equal once wall-clock stamps are replaced, apt's progress lines taken in any order
    /// within each block of them, and stderr's lines in any order.
    AptProgressOrder,
    Differs,
}

/// Where a compared turn's output first differs from the reference's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutputDifference {
    pub turn: u32,
    pub stream: &'static str,
    /// 1-based line number in the normalised output.
    pub line: usize,
    pub expected: String,
    pub got: String,
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

/// How many differences of the first later state that differs a verdict keeps.
pub const LATER_DIFFERENCES_SHOWN: usize = 20;

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
    /// Files of the reference at the fault turn whose names differ from run to run, each
    /// matched with a file of this run under another name (see [`pair_generated_names`]).
    pub generated_names_paired: usize,
    pub turns_compared: Vec<u32>,
    /// Turns after the fault whose results differ between reference runs.
    pub turns_excluded: Vec<u32>,
    /// Compared turns whose output matched only with wall-clock stamps replaced.
    pub turns_normalised_wall_clock: Vec<u32>,
    /// Compared turns whose output matched only with stderr's lines in any order.
    pub turns_normalised_stderr_order: Vec<u32>,
    /// Compared turns whose output matched only with apt's progress lines in any order.
    pub turns_normalised_apt_progress: Vec<u32>,
    pub rc_mismatches: Vec<u32>,
    pub output_mismatches: Vec<u32>,
    /// The first differing line of each output mismatch.
    pub output_differences: Vec<OutputDifference>,
    /// Turns after the fault whose state (taken after the turn) was compared with the reference's.
    pub states_compared: Vec<u32>,
    /// Turns after the fault whose state was not compared: from the first nondeterministic one
    /// on, the state carries what that turn left, and the reference runs show only some of what
    /// it can leave (an install cut off by its timeout, a rate limit on a knife edge).
    pub states_excluded: Vec<u32>,
    /// Turns after the fault whose state was not compared because a process the turns left
    /// running was still busy when it was looked at, in the reference or in this run: what that
    /// process had written by then depends on the run's pace (see [`crate::settle`]).
    pub states_unsettled: Vec<u32>,
    /// Those whose state differed (entries that differ between reference runs masked).
    pub state_mismatches: Vec<u32>,
    /// The differences of the first of them, at most [`LATER_DIFFERENCES_SHOWN`].
    pub later_state_differences: Vec<Difference>,
    /// False when the policy had no way to recover, whatever the state looked like.
    pub recovery_possible: bool,
    pub correct: bool,
}

impl Reference {
    pub fn new(runs: Vec<ReferenceRun>) -> Result<Reference, OracleError> {
        let first = runs.first().ok_or(OracleError::NoReference)?;
        for run in &runs[1..] {
            if run.results.len() != first.results.len() || run.fingerprints.len() != first.fingerprints.len() {
                return Err(OracleError::RunLengthMismatch(first.results.len(), run.results.len()));
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
        self.primary().fingerprints.get(turn.checked_sub(1)? as usize)
    }

    /// Turns whose agent-visible result differs between reference runs,
    /// normalised as the oracle compares.
    pub fn nondeterministic_turns(&self) -> BTreeSet<u32> {
        self.turns_between_runs(|a, b| !a.same_exit(b) || a.output_match(b) == OutputMatch::Differs)
    }

    /// Turns whose outputs differ between reference runs byte for byte but
    /// not once normalised: without normalising, they would be excluded.
    pub fn normalised_turns(&self) -> BTreeSet<u32> {
        self.turns_between_runs(|a, b| {
            a.same_exit(b)
                && matches!(
                    a.output_match(b),
                    OutputMatch::WallClock | OutputMatch::StderrOrder | OutputMatch::AptProgressOrder
                )
        })
    }

    /// Turns after which a reference run was looked at unsettled.
    pub fn unsettled_turns(&self) -> BTreeSet<u32> {
        self.runs.iter().flat_map(|run| run.results.iter().filter(|result| result.unsettled)).map(|r| r.turn).collect()
    }

    /// Turns whose reference output holds wall-clock stamps.
    pub fn turns_with_wall_clock(&self) -> BTreeSet<u32> {
        self.primary().results.iter().filter(|result| result.wall_clock_stamps > 0).map(|result| result.turn).collect()
    }

    fn turns_between_runs(&self, differs: impl Fn(&TurnResult, &TurnResult) -> bool) -> BTreeSet<u32> {
        let primary = &self.primary().results;
        self.runs[1..]
            .iter()
            .flat_map(|run| run.results.iter().zip(primary).filter(|(a, b)| differs(a, b)).map(|(a, _)| a.turn))
            .collect()
    }

    /// What of the state after `turn` is compared how: the entries that differ between
    /// reference runs, and the primary run's files whose names alone do.
    fn masks(&self, turn: u32) -> Masks {
        let index = (turn - 1) as usize;
        let primary = &self.primary().fingerprints[index];
        let mut volatile = BTreeSet::new();
        let mut generated = BTreeSet::new();
        for run in &self.runs[1..] {
            let other = &run.fingerprints[index];
            let paired = pair_generated_names(&other.files, &primary.files, |_| true, |_| false).keys;
            volatile.extend(other.diff(primary).into_iter().map(|d| d.key).filter(|key| !paired.contains(key)));
            generated.extend(paired.into_iter().filter_map(|key| {
                let path = key.strip_prefix("file:")?;
                primary.files.get_key_value(path).map(|(path, _)| path.clone())
            }));
        }
        // A name another run shows as nondeterministic in some other way stays masked.
        generated.retain(|path| !volatile.contains(&format!("file:{path}")));
        Masks { volatile, generated }
    }

    /// How `state`, after `turn`, differs from the reference's, what differs between
    /// reference runs left out and files with generated names paired off.
    fn differences(&self, turn: u32, state: &Fingerprint, reference_state: &Fingerprint) -> Compared {
        let masks = self.masks(turn);
        let paired = pair_generated_names(
            &state.files,
            &reference_state.files,
            |path| masks.generated.contains(path),
            |path| masks.volatile.contains(&format!("file:{path}")),
        );
        let differences = state
            .diff(reference_state)
            .into_iter()
            .filter(|d| !masks.volatile.contains(&d.key) && !paired.keys.contains(&d.key))
            .map(|mut d| {
                let generated = d.key.strip_prefix("file:").is_some_and(|path| masks.generated.contains(path));
                if generated && d.detail == "missing" {
                    d.detail.push_str(" (its name differs from run to run; no file of this run is like it)");
                }
                d
            })
            .collect();
        Compared { differences, masked: masks.volatile.len(), paired: paired.equal }
    }

    /// Judges a run that was killed after `fault_turn` and recovered into
    /// `recovered`; `later` are its results for the turns after the fault,
    /// each with the state it left (None where the run took no fingerprint).
    pub fn judge(
        &self,
        fault_turn: u32,
        recovered: &Fingerprint,
        later: &[(TurnResult, Option<&Fingerprint>)],
        recovery_possible: bool,
    ) -> Result<Verdict, OracleError> {
        let turns = self.primary().results.len();
        let reference_state =
            self.fingerprint(fault_turn).ok_or(OracleError::NoSuchTurn { turn: fault_turn, turns })?;
        let Compared { differences: state_differences, masked, paired } =
            self.differences(fault_turn, recovered, reference_state);
        let nondeterministic = self.nondeterministic_turns();
        let unsettled = self.unsettled_turns();
        let mut verdict = Verdict {
            fault_turn,
            state_equal: state_differences.is_empty(),
            state_differences,
            masked_entries: masked,
            generated_names_paired: paired,
            turns_compared: Vec::new(),
            turns_excluded: Vec::new(),
            turns_normalised_wall_clock: Vec::new(),
            turns_normalised_stderr_order: Vec::new(),
            turns_normalised_apt_progress: Vec::new(),
            rc_mismatches: Vec::new(),
            output_mismatches: Vec::new(),
            output_differences: Vec::new(),
            states_compared: Vec::new(),
            states_excluded: Vec::new(),
            states_unsettled: Vec::new(),
            state_mismatches: Vec::new(),
            later_state_differences: Vec::new(),
            recovery_possible,
            correct: false,
        };
        let mut after_nondeterministic = false;
        for (result, state) in later {
            after_nondeterministic |= nondeterministic.contains(&result.turn);
            if after_nondeterministic && state.is_some() {
                verdict.states_excluded.push(result.turn);
            } else if state.is_some() && (result.unsettled || unsettled.contains(&result.turn)) {
                verdict.states_unsettled.push(result.turn);
            } else if let Some(state) = state {
                let reference_state =
                    self.fingerprint(result.turn).ok_or(OracleError::NoSuchTurn { turn: result.turn, turns })?;
                let differences = self.differences(result.turn, state, reference_state).differences;
                verdict.states_compared.push(result.turn);
                if !differences.is_empty() {
                    if verdict.state_mismatches.is_empty() {
                        verdict.later_state_differences =
                            differences.into_iter().take(LATER_DIFFERENCES_SHOWN).collect();
                    }
                    verdict.state_mismatches.push(result.turn);
                }
            }
            let expected = self
                .primary()
                .results
                .get((result.turn as usize).wrapping_sub(1))
                .ok_or(OracleError::NoSuchTurn { turn: result.turn, turns })?;
            if nondeterministic.contains(&result.turn) {
                verdict.turns_excluded.push(result.turn);
                continue;
            }
            verdict.turns_compared.push(result.turn);
            if !result.same_exit(expected) {
                verdict.rc_mismatches.push(result.turn);
            }
            match result.output_match(expected) {
                OutputMatch::Exact => {}
                OutputMatch::WallClock => verdict.turns_normalised_wall_clock.push(result.turn),
                OutputMatch::StderrOrder => verdict.turns_normalised_stderr_order.push(result.turn),
                OutputMatch::AptProgressOrder => verdict.turns_normalised_apt_progress.push(result.turn),
                OutputMatch::Differs => {
                    verdict.output_mismatches.push(result.turn);
                    verdict.output_differences.extend(result.difference_from(expected));
                }
            }
        }
        verdict.correct = recovery_possible
            && verdict.state_equal
            && verdict.state_mismatches.is_empty()
            && verdict.rc_mismatches.is_empty()
            && verdict.output_mismatches.is_empty();
        Ok(verdict)
    }
}

/// How the state after a turn is compared with the reference's (see [`Reference::masks`]).
struct Masks {
    /// Fingerprint keys that differ between reference runs: not compared.
    volatile: BTreeSet<String>,
    /// Paths of the primary reference run's files whose names alone differ between
    /// reference runs: a judged run must have a file like each under a name of its own.
    generated: BTreeSet<Arc<str>>,
}

struct Compared {
    differences: Vec<Difference>,
    /// How many entries were left out as differing between reference runs.
    masked: usize,
    /// How many files with generated names were paired off.
    paired: usize,
}

/// What a file with a generated name keeps from run to run: its directory and the length of
/// its name (`tempfile` and `mktemp` fill a fixed number of random characters into a fixed
/// template, and the random part may be what follows the last dot, as in `mktemp`'s default
/// `tmp.XXXXXXXXXX`).
fn name_shape(path: &str) -> (&str, usize) {
    let (directory, name) = path.rsplit_once('/').unwrap_or(("", path));
    (directory, name.len())
}

/// Files of `actual` that stand for files of `expected` it lacks: the fingerprint keys of both
/// files of each pair, and how many pairs are equal files.
struct Pairs {
    keys: BTreeSet<String>,
    equal: usize,
}

/// Pairs files of `expected` that `actual` lacks with files of `actual` that `expected` lacks, of
/// the same [`name_shape`], each file at most once. First a file `required` or `optional` admits
/// pairs with one equal in everything the fingerprint records but its name (contents, mode,
/// owner, xattrs): the same file under a name generated afresh (an agent's script that leaves
/// `/tmp/tmpXXXXXXXX.dcm` behind leaves it under other names in every run). Then a file
/// `optional` admits, one the reference runs disagree on by name and more (a log named by pid),
/// takes in any file of that shape left over: the run's own, which the reference cannot judge.
fn pair_generated_names<'a>(
    actual: &'a Files,
    expected: &'a Files,
    required: impl Fn(&str) -> bool,
    optional: impl Fn(&str) -> bool,
) -> Pairs {
    /// A file `actual` lacks, and whether it is only optional.
    type Lacking<'a> = (&'a str, &'a FileEntry, bool);
    let mut lacking: HashMap<(&'a str, usize), Vec<Lacking<'a>>> = HashMap::new();
    for (path, entry) in expected.iter().filter(|(path, _)| !actual.contains_key(*path)) {
        let only_optional = !required(path);
        if !only_optional || optional(path) {
            lacking.entry(name_shape(path)).or_default().push((path, entry, only_optional));
        }
    }
    let mut pairs = Pairs { keys: BTreeSet::new(), equal: 0 };
    if lacking.is_empty() {
        return pairs;
    }
    let mut left_over = Vec::new();
    for (path, entry) in actual.iter().filter(|(path, _)| !expected.contains_key(*path)) {
        let Some(candidates) = lacking.get_mut(&name_shape(path)) else { continue };
        match candidates.iter().position(|(_, candidate, _)| *candidate == &**entry) {
            Some(index) => {
                let (missing, _, _) = candidates.remove(index);
                pairs.keys.extend([format!("file:{missing}"), format!("file:{path}")]);
                pairs.equal += 1;
            }
            None => left_over.push(path),
        }
    }
    for path in left_over {
        let Some(candidates) = lacking.get_mut(&name_shape(path)) else { continue };
        if let Some(index) = candidates.iter().position(|(_, _, only_optional)| *only_optional) {
            let (missing, _, _) = candidates.remove(index);
            pairs.keys.extend([format!("file:{missing}"), format!("file:{path}")]);
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(turn: u32, rc: i32, stdout: &str) -> TurnResult {
        TurnResult::new(turn, Some(rc), false, stdout.as_bytes(), b"")
    }

    fn result_with_stderr(turn: u32, stdout: &str, stderr: &str) -> TurnResult {
        TurnResult::new(turn, Some(0), false, stdout.as_bytes(), stderr.as_bytes())
    }

    /// A fingerprint of files given as `F kind mode owner size path`.
    fn state(records: &[&str]) -> Fingerprint {
        let mut fingerprint = Fingerprint::default();
        for record in records {
            let fields: Vec<&str> = record.splitn(6, ' ').collect();
            let kind = fields[1].chars().next().unwrap();
            let entry = crate::fingerprint::FileEntry {
                kind,
                mode: fields[2].into(),
                owner: fields[3].into(),
                size: (kind == 'f').then(|| fields[4].parse().unwrap()),
                link_target: None,
                sha256: None,
                xattrs: Default::default(),
                hard_link: None,
                data_ranges: None,
                rdev: None,
            };
            fingerprint.files.insert(fields[5].into(), entry.into());
        }
        fingerprint
    }

    fn run(outputs: [&str; 3], states: [&[&str]; 3]) -> ReferenceRun {
        ReferenceRun {
            results: outputs.iter().enumerate().map(|(i, out)| result(i as u32 + 1, 0, out)).collect(),
            fingerprints: states.iter().map(|records| state(records)).collect(),
        }
    }

    const EMPTY: &[&str] = &["F d 0755 0:0 4096 /app"];
    const WITH_FILE: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 2 /app/x"];

    #[test]
    fn exact_recovery_is_correct() {
        let reference = Reference::new(vec![run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE])]).unwrap();
        let verdict = reference.judge(2, &state(WITH_FILE), &[(result(3, 0, "c"), None)], true).unwrap();
        assert!(verdict.correct);
        assert_eq!(verdict.turns_compared, [3]);
    }

    #[test]
    fn lost_file_is_incorrect_and_named() {
        let reference = Reference::new(vec![run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE])]).unwrap();
        let verdict = reference.judge(2, &state(EMPTY), &[(result(3, 0, "c"), None)], true).unwrap();
        assert!(!verdict.correct);
        assert_eq!(verdict.state_differences[0].key, "file:/app/x");
    }

    #[test]
    fn a_later_exit_code_or_output_mismatch_is_incorrect() {
        let reference = Reference::new(vec![run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE])]).unwrap();
        let rc = reference.judge(2, &state(WITH_FILE), &[(result(3, 1, "c"), None)], true).unwrap();
        assert_eq!((rc.correct, rc.rc_mismatches.as_slice()), (false, &[3][..]));
        let output = reference.judge(2, &state(WITH_FILE), &[(result(3, 0, "other"), None)], true).unwrap();
        assert_eq!((output.correct, output.output_mismatches.as_slice()), (false, &[3][..]));
    }

    #[test]
    fn a_later_state_that_differs_is_incorrect_even_when_no_output_shows_it() {
        // Turn 3 writes /app/y and prints nothing: after a recovery that lost
        // what turn 2 left elsewhere, its output still matches.
        const WITH_BOTH: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 2 /app/x", "F f 0644 0:0 1 /app/y"];
        const ONLY_Y: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 1 /app/y"];
        let reference = Reference::new(vec![run(["a", "b", ""], [EMPTY, WITH_FILE, WITH_BOTH])]).unwrap();
        let (after_3, lost_after_3) = (state(WITH_BOTH), state(ONLY_Y));
        let exact = reference.judge(2, &state(WITH_FILE), &[(result(3, 0, ""), Some(&after_3))], true).unwrap();
        assert!(exact.correct, "{exact:?}");
        assert_eq!(exact.states_compared, [3]);
        // The state right after recovery is equal here; turn 3's is not (say a
        // restored process rewrote the file differently).
        let verdict = reference.judge(2, &state(WITH_FILE), &[(result(3, 0, ""), Some(&lost_after_3))], true).unwrap();
        assert!(verdict.state_equal && verdict.output_mismatches.is_empty(), "{verdict:?}");
        assert!(!verdict.correct);
        assert_eq!(verdict.state_mismatches, [3]);
        assert_eq!(verdict.later_state_differences[0].key, "file:/app/x");
    }

    #[test]
    fn a_later_state_masks_what_differs_between_reference_runs_after_that_turn() {
        const LOG_1: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 10 /app/log"];
        const LOG_2: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 11 /app/log"];
        let first = run(["a", "b", "c"], [EMPTY, EMPTY, LOG_1]);
        let second = run(["a", "b", "c"], [EMPTY, EMPTY, LOG_2]);
        let reference = Reference::new(vec![first, second]).unwrap();
        const LOG_3: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 12 /app/log"];
        let after_3 = state(LOG_3);
        let verdict = reference.judge(2, &state(EMPTY), &[(result(3, 0, "c"), Some(&after_3))], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!(verdict.states_compared, [3]);
        // Only that entry is masked.
        const LOG_AND_MORE: &[&str] =
            &["F d 0755 0:0 4096 /app", "F f 0644 0:0 12 /app/log", "F f 0644 0:0 1 /app/stray"];
        let after_3 = state(LOG_AND_MORE);
        let verdict = reference.judge(2, &state(EMPTY), &[(result(3, 0, "c"), Some(&after_3))], true).unwrap();
        assert_eq!(verdict.state_mismatches, [3]);
    }

    #[test]
    fn later_states_from_the_first_nondeterministic_turn_on_are_not_compared() {
        // Turn 3's output differs between the reference runs (an install its timeout cut
        // off at another point); what it left differs from run to run beyond what the two
        // reference runs show, and so does the state after turn 4.
        const PART_1: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 1 /app/a"];
        const PART_2: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 1 /app/a", "F f 0644 0:0 1 /app/b"];
        let runs = |out: &str, after: &'static [&'static str]| ReferenceRun {
            results: vec![result(1, 0, "a"), result(2, 0, "b"), result(3, 1, out), result(4, 0, "d")],
            fingerprints: vec![state(EMPTY), state(EMPTY), state(after), state(after)],
        };
        let reference = Reference::new(vec![runs("cut at a", PART_1), runs("cut at b", PART_2)]).unwrap();
        const PART_3: &[&str] = &["F d 0755 0:0 4096 /app"];
        let (after_2, after_3) = (state(EMPTY), state(PART_3));
        let later = [
            (result(2, 0, "b"), Some(&after_2)),
            (result(3, 1, "cut before a"), Some(&after_3)),
            (result(4, 0, "d"), Some(&after_3)),
        ];
        let verdict = reference.judge(1, &state(EMPTY), &later, true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!((verdict.states_compared.as_slice(), verdict.states_excluded.as_slice()), (&[2][..], &[3, 4][..]));
        // Before that turn a state is still compared.
        let lost = state(&["F d 0755 0:0 4096 /elsewhere"]);
        let later = [(result(2, 0, "b"), Some(&lost))];
        assert_eq!(reference.judge(1, &state(EMPTY), &later, true).unwrap().state_mismatches, [2]);
    }

    #[test]
    fn a_state_looked_at_unsettled_is_not_compared_and_the_others_still_are() {
        // Turn 2 timed out and left its process collecting tests: the reference looked at
        // the sandbox after turn 3 while it was still busy, the run after turn 4.
        const PARTIAL: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 1 /app/a.pyc"];
        const FURTHER: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 1 /app/a.pyc", "F f 0644 0:0 1 /app/b.pyc"];
        let mut reference = ReferenceRun {
            results: (1..=5).map(|turn| result(turn, 0, "out")).collect(),
            fingerprints: vec![state(EMPTY), state(EMPTY), state(PARTIAL), state(FURTHER), state(FURTHER)],
        };
        reference.results[2] = reference.results[2].clone().with_settled(false);
        let reference = Reference::new(vec![reference]).unwrap();
        assert_eq!(reference.unsettled_turns(), BTreeSet::from([3]));
        let (further, lost) = (state(FURTHER), state(EMPTY));
        let later = [
            (result(3, 0, "out"), Some(&further)),
            (result(4, 0, "out").with_settled(false), Some(&further)),
            (result(5, 0, "out"), Some(&further)),
        ];
        let verdict = reference.judge(2, &state(EMPTY), &later, true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!((verdict.states_unsettled.as_slice(), verdict.states_compared.as_slice()), (&[3, 4][..], &[5][..]));
        // A settled state that lost what the process wrote is still caught.
        let later = [(result(3, 0, "out"), Some(&further)), (result(5, 0, "out"), Some(&lost))];
        assert_eq!(reference.judge(2, &state(EMPTY), &later, true).unwrap().state_mismatches, [5]);
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
        const STAMP_1: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 2 /app/x", "F f 0644 0:0 10 /tmp/stamp"];
        const STAMP_2: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 2 /app/x", "F f 0644 0:0 11 /tmp/stamp"];
        let first = run(["a", "b", "date 1"], [EMPTY, STAMP_1, STAMP_1]);
        let second = run(["a", "b", "date 2"], [EMPTY, STAMP_2, STAMP_2]);
        let reference = Reference::new(vec![first, second]).unwrap();
        assert_eq!(reference.nondeterministic_turns(), BTreeSet::from([3]));
        const STAMP_3: &[&str] = &["F d 0755 0:0 4096 /app", "F f 0644 0:0 2 /app/x", "F f 0644 0:0 12 /tmp/stamp"];
        let verdict = reference.judge(2, &state(STAMP_3), &[(result(3, 0, "date 3"), None)], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!(verdict.masked_entries, 1);
        assert_eq!(verdict.turns_excluded, [3]);
        // Masking covers only what varied: losing the stable file is still caught.
        let lost = reference.judge(2, &state(&["F d 0755 0:0 4096 /app"]), &[], true).unwrap();
        assert!(!lost.correct);
    }

    #[test]
    fn wall_clock_output_matches_and_is_named() {
        // `ls -la` after turn 2 in the reference, and a minute later after a recovery.
        let listing = |time: &str| format!("total 8\ndrwxr-xr-x 1 root root 4096 Nov 29 {time} .\n");
        let mut first = run(["a", "b", "c"], [EMPTY, WITH_FILE, WITH_FILE]);
        first.results[2] = result(3, 0, &listing("19:11"));
        let mut second = first.clone();
        second.results[2] = result(3, 0, &listing("19:12"));
        let reference = Reference::new(vec![first, second]).unwrap();
        assert!(reference.nondeterministic_turns().is_empty());
        assert_eq!(reference.normalised_turns(), BTreeSet::from([3]));
        assert_eq!(reference.turns_with_wall_clock(), BTreeSet::from([3]));
        let verdict = reference.judge(2, &state(WITH_FILE), &[(result(3, 0, &listing("20:40")), None)], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!(
            (verdict.turns_compared.as_slice(), verdict.turns_normalised_wall_clock.as_slice()),
            (&[3][..], &[3][..])
        );
        // Normalising hides the time, not the rest of the line.
        let lost = reference.judge(2, &state(WITH_FILE), &[(result(3, 0, "total 0\n"), None)], true).unwrap();
        assert!(!lost.correct);
        assert_eq!(lost.output_mismatches, [3]);
        assert_eq!(
            lost.output_differences,
            [OutputDifference {
                turn: 3,
                stream: "stdout",
                line: 1,
                expected: "total 8".to_string(),
                got: "total 0".to_string()
            }]
        );
    }

    #[test]
    fn a_shell_that_came_back_in_another_state_is_a_mismatch_even_with_equal_output() {
        let reference = Reference::new(vec![ReferenceRun {
            results: vec![result(1, 0, "a"), result(2, 0, "b").with_shell("/app\ndeclare -- X=\"1\"\n".into())],
            fingerprints: vec![state(EMPTY), state(EMPTY)],
        }])
        .unwrap();
        let lost = result(2, 0, "b").with_shell("/app\n".into());
        let verdict = reference.judge(1, &state(EMPTY), &[(lost, None)], true).unwrap();
        assert!(!verdict.correct);
        assert_eq!(verdict.output_mismatches, [2]);
        assert_eq!(verdict.output_differences[0].stream, "shell state");
        assert_eq!(verdict.output_differences[0].expected, "declare -- X=\"1\"");
        let kept = result(2, 0, "b").with_shell("/app\ndeclare -- X=\"1\"\n".into());
        assert!(reference.judge(1, &state(EMPTY), &[(kept, None)], true).unwrap().correct);
    }

    #[test]
    fn stderr_lines_in_another_order_match_but_stdout_order_counts() {
        let expected = result_with_stderr(1, "one\ntwo\n", "grep: usage\nbash: not found\n");
        let raced = result_with_stderr(1, "one\ntwo\n", "bash: not found\ngrep: usage\n");
        assert_eq!(raced.output_match(&expected), OutputMatch::StderrOrder);
        let swapped = result_with_stderr(1, "two\none\n", "grep: usage\nbash: not found\n");
        assert_eq!(swapped.output_match(&expected), OutputMatch::Differs);
        let missing = result_with_stderr(1, "one\ntwo\n", "grep: usage\n");
        assert_eq!(missing.output_match(&expected), OutputMatch::Differs);
        assert_eq!(expected.clone().output_match(&expected), OutputMatch::Exact);
    }

    #[test]
    fn a_stderr_race_between_reference_runs_is_not_nondeterminism() {
        let first = ReferenceRun {
            results: vec![result(1, 0, "a"), result_with_stderr(2, "", "x: failed\ny: failed\n")],
            fingerprints: vec![state(EMPTY), state(EMPTY)],
        };
        let mut second = first.clone();
        second.results[1] = result_with_stderr(2, "", "y: failed\nx: failed\n");
        let reference = Reference::new(vec![first, second]).unwrap();
        assert!(reference.nondeterministic_turns().is_empty());
        assert_eq!(reference.normalised_turns(), BTreeSet::from([2]));
        let verdict = reference
            .judge(1, &state(EMPTY), &[(result_with_stderr(2, "", "y: failed\nx: failed\n"), None)], true)
            .unwrap();
        assert!(verdict.correct);
        assert_eq!(verdict.turns_normalised_stderr_order, [2]);
    }

    #[test]
    fn fault_turn_outside_the_trace_is_an_error() {
        let reference = Reference::new(vec![run(["a", "b", "c"], [EMPTY, EMPTY, EMPTY])]).unwrap();
        assert!(matches!(reference.judge(4, &state(EMPTY), &[], true), Err(OracleError::NoSuchTurn { .. })));
        assert!(matches!(reference.judge(0, &state(EMPTY), &[], true), Err(OracleError::NoSuchTurn { .. })));
    }

    /// Two reference runs whose turn 2 left two files under names of its own each time (what
    /// pydicom-1413's scripts left: `tempfile` names, one file empty and one of 132 bytes).
    fn generated_names_reference() -> Reference {
        const RUN_1: &[&str] =
            &["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 132 /tmp/tmpaaaa.dcm", "F f 0600 0:0 0 /tmp/tmpbbbb.dcm"];
        const RUN_2: &[&str] =
            &["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 132 /tmp/tmpcccc.dcm", "F f 0600 0:0 0 /tmp/tmpdddd.dcm"];
        let first = run(["a", "b", "c"], [EMPTY, RUN_1, RUN_1]);
        let second = run(["a", "b", "c"], [EMPTY, RUN_2, RUN_2]);
        Reference::new(vec![first, second]).unwrap()
    }

    #[test]
    fn files_with_generated_names_pair_with_files_like_them_under_other_names() {
        let reference = generated_names_reference();
        const JUDGED: &[&str] =
            &["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 0 /tmp/tmpeeee.dcm", "F f 0600 0:0 132 /tmp/tmpffff.dcm"];
        let after_3 = state(JUDGED);
        let verdict = reference.judge(2, &state(JUDGED), &[(result(3, 0, "c"), Some(&after_3))], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!((verdict.generated_names_paired, verdict.masked_entries), (2, 0), "{verdict:?}");
        assert_eq!(verdict.states_compared, [3]);
    }

    #[test]
    fn a_file_with_a_generated_name_that_nothing_takes_the_place_of_is_lost() {
        let reference = generated_names_reference();
        // The empty one is gone (masked as nondeterministic before names were paired).
        let lost = state(&["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 132 /tmp/tmpeeee.dcm"]);
        let verdict = reference.judge(2, &lost, &[(result(3, 0, "c"), None)], true).unwrap();
        assert!(!verdict.correct, "{verdict:?}");
        assert_eq!(verdict.state_differences.len(), 1, "{verdict:?}");
        assert_eq!(verdict.state_differences[0].key, "file:/tmp/tmpbbbb.dcm");
        assert!(verdict.state_differences[0].detail.contains("name differs from run to run"), "{verdict:?}");
        // One with other contents does not take its place, nor does a third.
        let other_size =
            state(&["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 132 /tmp/tmpeeee.dcm", "F f 0600 0:0 5 /tmp/tmpffff.dcm"]);
        let verdict = reference.judge(2, &other_size, &[(result(3, 0, "c"), None)], true).unwrap();
        let keys: Vec<&str> = verdict.state_differences.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["file:/tmp/tmpbbbb.dcm", "file:/tmp/tmpffff.dcm"], "{verdict:?}");
        let third = state(&[
            "F d 0755 0:0 4096 /tmp",
            "F f 0600 0:0 132 /tmp/tmpeeee.dcm",
            "F f 0600 0:0 0 /tmp/tmpffff.dcm",
            "F f 0600 0:0 0 /tmp/tmpgggg.dcm",
        ]);
        let verdict = reference.judge(2, &third, &[(result(3, 0, "c"), None)], true).unwrap();
        assert_eq!((verdict.correct, verdict.state_differences.len()), (false, 1), "{verdict:?}");
        assert_eq!(verdict.generated_names_paired, 2);
    }

    #[test]
    fn names_pair_only_in_the_same_directory_with_the_same_length() {
        let reference = generated_names_reference();
        for stray in ["/app/tmpeeee.dcm", "/tmp/tmpeeeee.dcm", "/tmp/tmpeee.dcm"] {
            let judged = state(&[
                "F d 0755 0:0 4096 /tmp",
                "F f 0600 0:0 132 /tmp/tmpffff.dcm",
                &format!("F f 0600 0:0 0 {stray}"),
            ]);
            let verdict = reference.judge(2, &judged, &[], true).unwrap();
            let keys: Vec<&str> = verdict.state_differences.iter().map(|d| d.key.as_str()).collect();
            assert_eq!(keys, ["file:/tmp/tmpbbbb.dcm".to_string(), format!("file:{stray}")], "{stray}");
        }
    }

    #[test]
    fn names_that_differ_between_reference_runs_with_their_files_stay_masked() {
        // Two logs under run-specific names with other contents: not the same file renamed,
        // so both stay nondeterministic, as any entry that differs between reference runs.
        let first = run(["a", "b", "c"], [EMPTY, &["F d 0755 0:0 4096 /app", "F f 0644 0:0 10 /app/1.log"], EMPTY]);
        let second = run(["a", "b", "c"], [EMPTY, &["F d 0755 0:0 4096 /app", "F f 0644 0:0 11 /app/2.log"], EMPTY]);
        let reference = Reference::new(vec![first, second]).unwrap();
        let verdict = reference.judge(2, &state(EMPTY), &[], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!((verdict.masked_entries, verdict.generated_names_paired), (2, 0));
    }

    #[test]
    fn a_run_of_its_own_where_the_reference_runs_disagree_by_name_and_more_is_not_judged() {
        // Logs named by pid, their contents the run's own: the reference cannot judge them,
        // one to one, but one more is one more.
        let first = run(["a", "b", "c"], [EMPTY, &["F d 0755 0:0 4096 /app", "F f 0644 0:0 10 /app/1.log"], EMPTY]);
        let second = run(["a", "b", "c"], [EMPTY, &["F d 0755 0:0 4096 /app", "F f 0644 0:0 11 /app/2.log"], EMPTY]);
        let reference = Reference::new(vec![first, second]).unwrap();
        let own = state(&["F d 0755 0:0 4096 /app", "F f 0644 0:0 12 /app/3.log"]);
        let verdict = reference.judge(2, &own, &[], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!(verdict.generated_names_paired, 0);
        let two = state(&["F d 0755 0:0 4096 /app", "F f 0644 0:0 12 /app/3.log", "F f 0644 0:0 13 /app/4.log"]);
        let verdict = reference.judge(2, &two, &[], true).unwrap();
        let keys: Vec<&str> = verdict.state_differences.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["file:/app/4.log"], "{verdict:?}");
    }

    #[test]
    fn reference_runs_that_left_unequal_numbers_of_a_generated_file_judge_either_number_right() {
        // The primary run left two equal files, the other one: one pairs (generated), the other
        // differs between the runs (masked), and a run like either reference run is correct.
        const TWO: &[&str] = &["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 0 /tmp/tmpaaaa", "F f 0600 0:0 0 /tmp/tmpbbbb"];
        const ONE: &[&str] = &["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 0 /tmp/tmpcccc"];
        let reference =
            Reference::new(vec![run(["a", "b", "c"], [EMPTY, TWO, TWO]), run(["a", "b", "c"], [EMPTY, ONE, ONE])])
                .unwrap();
        let like_primary =
            state(&["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 0 /tmp/tmpdddd", "F f 0600 0:0 0 /tmp/tmpeeee"]);
        let verdict = reference.judge(2, &like_primary, &[], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        let like_other = state(&["F d 0755 0:0 4096 /tmp", "F f 0600 0:0 0 /tmp/tmpdddd"]);
        let verdict = reference.judge(2, &like_other, &[], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        let none = state(&["F d 0755 0:0 4096 /tmp"]);
        assert!(!reference.judge(2, &none, &[], true).unwrap().correct);
    }

    #[test]
    fn apt_progress_lines_match_in_any_order_within_their_block_and_nothing_else_does() {
        // raman-fitting 08-13's `apt update && apt install ...` against the sandbox's file
        // repository and the image's unreachable mirror: two runs, two orders.
        let one = "Get:1 file:/opt/crab-packages/debian ./ InRelease\nIgn:1 file:/opt/crab-packages/debian ./ InRelease\n\
                   Get:2 file:/opt/crab-packages/debian ./ Release [1,500 B]\nIgn:3 http://mirror.invalid/debian bookworm InRelease\n\
                   Get:4 file:/opt/crab-packages/debian ./ Packages\nReading package lists...\nDone\n";
        let other = "Ign:1 http://mirror.invalid/debian bookworm InRelease\nGet:2 file:/opt/crab-packages/debian ./ InRelease\n\
                     Ign:2 file:/opt/crab-packages/debian ./ InRelease\nGet:3 file:/opt/crab-packages/debian ./ Release [1,500 B]\n\
                     Get:4 file:/opt/crab-packages/debian ./ Packages\nReading package lists...\nDone\n";
        let (a, b) = (result(2, 0, one), result(2, 0, other));
        assert_eq!(b.output_match(&a), OutputMatch::AptProgressOrder);
        // Lines of a block that are not apt's, or progress lines across another line, keep their order.
        let swapped_plain = one.replace("Reading package lists...\nDone", "Done\nReading package lists...");
        assert_eq!(result(2, 0, &swapped_plain).output_match(&a), OutputMatch::Differs);
        let lost = one.replace("Get:4 file:/opt/crab-packages/debian ./ Packages\n", "");
        assert_eq!(result(2, 0, &lost).output_match(&a), OutputMatch::Differs);
        let moved = format!("{}Get:4 file:/opt/crab-packages/debian ./ Packages\n", lost);
        assert_eq!(result(2, 0, &moved).output_match(&a), OutputMatch::Differs);
        // Judged that way, and named.
        let first = ReferenceRun {
            results: vec![result(1, 0, "a"), a.clone()],
            fingerprints: vec![state(EMPTY), state(EMPTY)],
        };
        let reference = Reference::new(vec![first]).unwrap();
        let verdict = reference.judge(1, &state(EMPTY), &[(b, None)], true).unwrap();
        assert!(verdict.correct, "{verdict:?}");
        assert_eq!(verdict.turns_normalised_apt_progress, [2]);
    }
}
