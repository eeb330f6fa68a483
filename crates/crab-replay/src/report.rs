//! What a replay found, as JSON (`--json`) or as tables for people.

use std::fmt::Write;
use std::path::PathBuf;

use serde::Serialize;

use super::fault::FaultKind;
use super::fingerprint::Fingerprint;
use super::oracle::Verdict;
use super::policy::{OffNode, PolicyKind, RecoveryMethod, StoreCheck};
use crab_store::RelPath;

#[derive(Debug, Clone, Serialize)]
pub struct TraceReport {
    pub trace: String,
    pub file: PathBuf,
    pub image: String,
    pub runtime: String,
    /// How the commands reached the sandbox: exec, stdin or tmux.
    pub mode: crate::shell::ReplayMode,
    pub turns: u32,
    pub fault: FaultKind,
    pub fault_turn: Option<u32>,
    /// The factor the recorded think times were replayed at.
    pub think_scale: f64,
    pub reference: ReferenceSummary,
    pub runs: Vec<PolicyRun>,
    /// The policies asked for that were not run under this fault, and why.
    pub not_run: Vec<NotRun>,
}

/// A policy left out of a fault's runs because the fault has nothing of its sandbox to strike
/// (see [`PolicyKind::untouched_by`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NotRun {
    pub policy: PolicyKind,
    pub why: String,
}

/// The fault-free runs a batch's policy runs are judged against; all zero and empty when it
/// has none (`--ref-runs 0`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReferenceSummary {
    pub runs: usize,
    /// Wall time of the reference runs themselves, fingerprints after every turn included.
    pub run_time_s: f64,
    /// Policy runs made in the time the reference runs were spaced apart (judged after them).
    pub policy_runs_while_spaced: usize,
    pub nondeterministic_turns: Vec<u32>,
    /// Turns whose outputs differed between reference runs only in wall-clock
    /// stamps or stderr line order: compared (normalised), not excluded.
    pub normalised_turns: Vec<u32>,
    /// Turns whose output holds wall-clock stamps (compared with them replaced).
    pub turns_with_wall_clock: Vec<u32>,
    /// Turns after which a reference run's sandbox had not settled when it was looked at (a
    /// process left running was still busy): the states after them are not compared.
    pub unsettled_turns: Vec<u32>,
    /// Fingerprint digest after the last turn.
    pub final_state: Option<String>,
    /// What each turn of the first reference run changed.
    pub state_changes: StateChanges,
}

/// The turns of a run that changed the sandbox's state (its fingerprint after the turn differs
/// from before it), and of those the ones whose change the replay's first oracle could not
/// see: it fingerprinted only the files under the working directory, `/tmp` and `/root`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StateChanges {
    /// Turns looked at: all of the run's, once its state before the first turn is known.
    pub turns_seen: u32,
    pub turns_changed: Vec<u32>,
    /// A file outside the working directory, `/tmp` and `/root` changed.
    pub files_outside_old_scope: Vec<u32>,
    /// A process, listening socket or connection changed.
    pub processes_or_sockets: Vec<u32>,
}

impl StateChanges {
    /// From the states before the first turn (`initial`) and after each turn (`after[i]`:
    /// turn i + 1). Without the state before the first turn, the first turn is not looked at.
    pub fn of(initial: Option<&Fingerprint>, after: &[Fingerprint], workdir: &str) -> StateChanges {
        let old_scope: Vec<RelPath> =
            [workdir, "/tmp", "/root"].iter().filter_map(|dir| RelPath::parse(dir.as_bytes()).ok()).collect();
        // As the fingerprint's own scope reads a path: the directory itself or anything below it.
        let inside_old_scope = |path: &str| {
            RelPath::parse(path.as_bytes())
                .is_ok_and(|rel| old_scope.iter().any(|dir| *dir == rel || dir.is_ancestor_of(&rel)))
        };
        let states: Vec<&Fingerprint> = initial.into_iter().chain(after).collect();
        let first_turn = if initial.is_some() { 1 } else { 2 };
        let mut changes = StateChanges::default();
        for (turn, pair) in (first_turn..).zip(states.windows(2)) {
            changes.turns_seen += 1;
            let differences = pair[1].diff(pair[0]);
            if differences.is_empty() {
                continue;
            }
            changes.turns_changed.push(turn);
            let file_outside =
                differences.iter().any(|d| d.key.strip_prefix("file:").is_some_and(|path| !inside_old_scope(path)));
            if file_outside {
                changes.files_outside_old_scope.push(turn);
            }
            if differences.iter().any(|d| !d.key.starts_with("file:")) {
                changes.processes_or_sockets.push(turn);
            }
        }
        changes
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PolicyRun {
    pub policy: PolicyKind,
    /// `None` when no fault was injected.
    pub recovered_correctly: Option<bool>,
    pub fault: Option<FaultReport>,
    pub checkpoints: u32,
    pub checkpoint_failures: u32,
    /// Sum over all checkpoints of the bytes each one stored.
    pub checkpoint_bytes: u64,
    /// What went off the node: every-turn's archives, or what its pushes sent to the registry
    /// (node-loss runs), both part of `checkpoint_bytes`; crab's in node-loss runs: what its
    /// shim pushed to the registry (the push log's `bytes_uploaded`), not part of them.
    pub checkpoint_exported_bytes: u64,
    /// Where `checkpoint_exported_bytes` went (None: nothing went off the node this way).
    pub checkpoint_exported_to: Option<OffNode>,
    /// What crab's pushed bytes leave out: turns on node B, whose config does not push.
    pub pushed_note: Option<String>,
    /// What the run is charged for its checkpoints: `checkpoint_bytes`, or for a policy with a
    /// store of its own (crab, whose store deduplicates across every sandbox of a batch, so a
    /// run may write almost nothing for a turn another run stored) everything its chain
    /// references (`store.bytes`) when that is more.
    pub checkpoint_charged_bytes: u64,
    /// The policy's own check of its checkpoint store after the run (crab: `crabctl verify`).
    pub store: Option<StoreCheck>,
    pub run_time_s: f64,
    pub agent_delay: DelaySummary,
    /// For a policy that pushes its checkpoints off the node: how many turns had everything
    /// saved so far off the node when the next turn started.
    pub replication: Option<Replication>,
    pub turns: Vec<TurnReport>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Replication {
    /// Turns followed by another turn on the same node, whose replication was looked at.
    pub turns: u32,
    /// Of those, the turns whose saved state was all off the node when the next one started.
    pub off_node_in_time: u32,
}

impl Replication {
    /// `None` when no turn was looked at (the policy does not push).
    pub fn of(off_node: impl Iterator<Item = bool>) -> Option<Replication> {
        let (turns, in_time) = off_node.fold((0, 0), |(n, k), off| (n + 1, k + u32::from(off)));
        (turns > 0).then_some(Replication { turns, off_node_in_time: in_time })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FaultReport {
    pub kind: FaultKind,
    pub turn: u32,
    /// What the fault did (which process got SIGKILL, how long a restart took).
    pub detail: String,
    /// What the policy had kept in containerd and lost with it (node loss).
    pub lost: Option<String>,
    /// `None` when the recovery failed (see `error`); the run ends there.
    pub recovery: Option<RecoveryMethod>,
    pub recovery_s: f64,
    pub error: Option<String>,
    /// Fingerprint digests right after recovery and in the reference after the fault turn.
    pub state_after: Option<String>,
    pub reference_state: Option<String>,
    pub verdict: Option<Verdict>,
    /// Turns after the fault whose checkpoint failed.
    pub later_checkpoint_failures: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct TurnReport {
    pub turn: u32,
    pub rc: Option<i32>,
    pub timed_out: bool,
    pub exec_s: f64,
    pub checkpoint_s: f64,
    pub checkpoint_bytes: u64,
    /// What went off the node: every-turn's archive, or what its push sent to the registry (of
    /// `checkpoint_bytes`); crab's: what its shim pushed for the turn (not of `checkpoint_bytes`).
    pub checkpoint_exported_bytes: u64,
    /// Where `checkpoint_exported_bytes` went.
    pub checkpoint_exported_to: Option<OffNode>,
    /// How the runtime classed the turn (crab: clean, fs, proc), where it says.
    pub checkpoint_class: Option<String>,
    /// What the agent waited for the policy before its next turn: the part
    /// of the checkpoint that outlasted the (scaled) think time before it.
    pub agent_visible_delay_s: f64,
    /// Whether everything the policy had saved was off the node when the next turn started
    /// (None: the policy does not push, or no turn followed on this node).
    pub off_node_before_next_turn: Option<bool>,
    /// How long the run waited after the turn for the processes it left running (see
    /// [`crate::settle`]), and whether they were quiet by then.
    pub settle_s: f64,
    pub settled: bool,
    /// Why the policy could not save after this turn.
    pub checkpoint_error: Option<String>,
    pub stdout_sha256: String,
    pub stderr_sha256: String,
    /// Wall-clock stamps the oracle replaced in this turn's output.
    pub wall_clock_stamps: usize,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct DelaySummary {
    pub total_s: f64,
    pub mean_s: f64,
    pub median_s: f64,
    pub max_s: f64,
}

impl DelaySummary {
    pub fn of(delays: impl Iterator<Item = f64>) -> DelaySummary {
        let mut delays: Vec<f64> = delays.collect();
        if delays.is_empty() {
            return DelaySummary::default();
        }
        delays.sort_by(f64::total_cmp);
        let total_s: f64 = delays.iter().sum();
        let middle = delays.len() / 2;
        let median_s = if delays.len() % 2 == 1 { delays[middle] } else { (delays[middle - 1] + delays[middle]) / 2.0 };
        DelaySummary { total_s, mean_s: total_s / delays.len() as f64, median_s, max_s: delays[delays.len() - 1] }
    }
}

pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

fn rc_text(rc: Option<i32>, timed_out: bool) -> String {
    match (rc, timed_out) {
        (_, true) => "T/O".to_string(),
        (Some(rc), false) => rc.to_string(),
        (None, false) => "?".to_string(),
    }
}

fn verdict_text(run: &PolicyRun) -> (String, String, String) {
    let Some(fault) = &run.fault else {
        return ("-".to_string(), "-".to_string(), "-".to_string());
    };
    let Some(verdict) = &fault.verdict else {
        return ("NO (failed)".to_string(), "-".to_string(), "not run".to_string());
    };
    let recovered = match (run.recovered_correctly, verdict.recovery_possible) {
        (_, false) => "NO (impossible)".to_string(),
        (Some(true), _) => "yes".to_string(),
        _ => "NO".to_string(),
    };
    let state = if verdict.state_equal {
        "equal".to_string()
    } else {
        match verdict.state_differences.len() {
            1 => "1 difference".to_string(),
            count => format!("{count} differences"),
        }
    };
    let compared = verdict.turns_compared.len();
    let later = if compared == 0 {
        "none after fault".to_string()
    } else {
        format!(
            "rc {}/{compared}, out {}/{compared}",
            compared - verdict.rc_mismatches.len(),
            compared - verdict.output_mismatches.len()
        )
    };
    (recovered, state, later)
}

/// The summary table, the differences that made a recovery incorrect, and
/// the per-turn delays, for each trace.
pub fn render(reports: &[TraceReport]) -> String {
    let mut out = String::new();
    for report in reports {
        render_trace(&mut out, report);
    }
    out
}

fn render_trace(out: &mut String, report: &TraceReport) {
    let fault = match report.fault_turn {
        Some(turn) => format!("fault {} after turn {turn}", report.fault),
        None => "no fault".to_string(),
    };
    let _ = writeln!(
        out,
        "trace {} ({} turns, {}, runtime {}, mode {}), {fault}",
        report.trace, report.turns, report.image, report.runtime, report.mode
    );
    let nondeterministic = if report.reference.nondeterministic_turns.is_empty() {
        "none".to_string()
    } else {
        format!("{:?}", report.reference.nondeterministic_turns)
    };
    if report.reference.runs == 0 {
        let _ = writeln!(out, "reference: none (--ref-runs 0), nothing judged");
    } else {
        let _ = writeln!(
            out,
            "reference: {} fault-free run(s) in {:.1} s, nondeterministic turns: {nondeterministic}",
            report.reference.runs, report.reference.run_time_s
        );
    }
    if !report.reference.turns_with_wall_clock.is_empty() || !report.reference.normalised_turns.is_empty() {
        let _ = writeln!(
            out,
            "outputs compared with wall-clock stamps replaced (turns {:?} print the clock); turns {:?} differed \
             between reference runs only in stamps or stderr line order",
            report.reference.turns_with_wall_clock, report.reference.normalised_turns
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<11} {:<16} {:<15} {:<20} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "policy",
        "recovered",
        "state",
        "later turns",
        "ckpts",
        "written",
        "charged",
        "off node",
        "delay mean",
        "delay max",
        "recovery",
        "run time"
    );
    for run in &report.runs {
        let (recovered, state, later) = verdict_text(run);
        let recovery = run.fault.as_ref().map_or("-".to_string(), |fault| format!("{:.2} s", fault.recovery_s));
        let _ = writeln!(
            out,
            "{:<11} {:<16} {:<15} {:<20} {:>5} {:>10} {:>10} {:>10} {:>8.2} s {:>8.2} s {:>9} {:>7.1} s",
            run.policy.name(),
            recovered,
            state,
            later,
            run.checkpoints,
            human_bytes(run.checkpoint_bytes),
            human_bytes(run.checkpoint_charged_bytes),
            human_bytes(run.checkpoint_exported_bytes),
            run.agent_delay.mean_s,
            run.agent_delay.max_s,
            recovery,
            run.run_time_s
        );
    }
    for not_run in &report.not_run {
        let _ = writeln!(out, "{:<11} not run under {}: {}", not_run.policy.name(), report.fault, not_run.why);
    }
    for run in &report.runs {
        let classes: Vec<&str> = run.turns.iter().filter_map(|turn| turn.checkpoint_class.as_deref()).collect();
        if !classes.is_empty() {
            let count = |class: &str| classes.iter().filter(|c| **c == class).count();
            let _ = writeln!(
                out,
                "{}: turns classed clean {}, fs {}, proc {}",
                run.policy.name(),
                count("clean"),
                count("fs"),
                count("proc")
            );
        }
    }
    for run in &report.runs {
        let how = match (run.checkpoint_exported_to, run.policy) {
            (Some(OffNode::Registry), PolicyKind::Crab) => {
                "pushed to the registry by its shim (`[remote] auto_push`): per turn the bytes its push log records \
                 as uploaded (the packs and pack indexes of the chunks the registry lacked, the turn manifest and \
                 the OCI manifest), not part of `written`"
            }
            (Some(OffNode::Registry), _) => {
                "pushed to the registry with `ctr images push` (what the pushes sent: the blobs the registry \
                 lacked), part of `written`"
            }
            (Some(OffNode::Archive), _) => {
                "written to archives outside containerd (--checkpoint-dir), part of `written`"
            }
            (None, _) => continue,
        };
        let _ = writeln!(out, "{}: off node: {how}", run.policy.name());
        if let Some(note) = &run.pushed_note {
            let _ = writeln!(out, "{}: {note}", run.policy.name());
        }
    }
    let pushed = |policy: PolicyKind| {
        report.runs.iter().find(|run| run.policy == policy && run.checkpoint_exported_to == Some(OffNode::Registry))
    };
    if let (Some(crab), Some(every_turn)) = (pushed(PolicyKind::Crab), pushed(PolicyKind::EveryTurn)) {
        let upto = |run: &PolicyRun, last: u32| -> u64 {
            run.turns.iter().filter(|turn| turn.turn <= last).map(|turn| turn.checkpoint_exported_bytes).sum()
        };
        let ratio = |crab: u64, every_turn: u64| match every_turn {
            0 => "-".to_string(),
            _ => format!("{:.3}x", crab as f64 / every_turn as f64),
        };
        let (c, e) = (crab.checkpoint_exported_bytes, every_turn.checkpoint_exported_bytes);
        let _ = write!(
            out,
            "pushed to the registry: crab {}, every-turn {} (crab / every-turn {})",
            human_bytes(c),
            human_bytes(e),
            ratio(c, e)
        );
        if let Some(fault) = crab.fault.as_ref() {
            let (c, e) = (upto(crab, fault.turn), upto(every_turn, fault.turn));
            let _ = write!(
                out,
                "; turns up to the fault turn {} (both from node A): crab {}, every-turn {} ({})",
                fault.turn,
                human_bytes(c),
                human_bytes(e),
                ratio(c, e)
            );
        }
        let _ = writeln!(out);
    }
    for run in &report.runs {
        if let Some(replication) = run.replication {
            let _ = writeln!(
                out,
                "{}: off the node when the next turn started: {} of {} turns",
                run.policy.name(),
                replication.off_node_in_time,
                replication.turns
            );
        }
    }
    for run in &report.runs {
        let failed: Vec<&TurnReport> = run.turns.iter().filter(|turn| turn.checkpoint_error.is_some()).collect();
        if let Some(first) = failed.first() {
            let turns: Vec<u32> = failed.iter().map(|turn| turn.turn).collect();
            let _ = writeln!(out);
            let _ = writeln!(out, "{}: checkpoint failed after turns {turns:?}", run.policy.name());
            let _ = writeln!(out, "  first error: {}", first.checkpoint_error.as_deref().unwrap_or_default());
        }
    }
    for run in &report.runs {
        let Some(fault) = &run.fault else { continue };
        if let Some(error) = &fault.error {
            let _ = writeln!(out);
            let _ = writeln!(out, "{}: recovery failed, the run stopped there: {error}", run.policy.name());
            continue;
        }
        let (Some(verdict), Some(recovery)) = (&fault.verdict, &fault.recovery) else {
            continue;
        };
        if run.recovered_correctly == Some(true) {
            continue;
        }
        let _ = writeln!(out);
        let method = match recovery {
            RecoveryMethod::Checkpoint { turn } => {
                format!("restored the checkpoint of turn {turn}")
            }
            RecoveryMethod::BaseImage => "started a fresh sandbox from the base image".to_string(),
            RecoveryMethod::NotNeeded => "found the sandbox still running".to_string(),
        };
        let _ = writeln!(out, "{}: {method}; why it is not a correct recovery:", run.policy.name());
        if !verdict.recovery_possible {
            let _ = writeln!(out, "  the policy keeps no state, so the run cannot continue");
        }
        const SHOWN: usize = 8;
        for difference in verdict.state_differences.iter().take(SHOWN) {
            let _ = writeln!(out, "  {difference}");
        }
        if verdict.state_differences.len() > SHOWN {
            let _ = writeln!(out, "  ... and {} more differences", verdict.state_differences.len() - SHOWN);
        }
        if !verdict.rc_mismatches.is_empty() {
            let _ = writeln!(out, "  exit codes differ from the reference on turns {:?}", verdict.rc_mismatches);
        }
        if !verdict.output_mismatches.is_empty() {
            let _ = writeln!(out, "  outputs differ from the reference on turns {:?}", verdict.output_mismatches);
            for difference in verdict.output_differences.iter().take(SHOWN) {
                let _ = writeln!(
                    out,
                    "    turn {} {} line {}: expected {:?}, got {:?}",
                    difference.turn, difference.stream, difference.line, difference.expected, difference.got
                );
            }
        }
        if fault.kind.strikes_checkpointing() && fault.later_checkpoint_failures > 0 {
            let _ = writeln!(out, "  {} checkpoints after the fault failed", fault.later_checkpoint_failures);
        }
        if let Some(store) = run.store.as_ref().filter(|store| !store.ok) {
            let _ = writeln!(out, "  the checkpoint store does not verify: {}", store.error.as_deref().unwrap_or("?"));
        }
    }
    let mut faulted = report.runs.iter().filter_map(|run| Some((run, run.fault.as_ref()?))).peekable();
    if faulted.peek().is_some() {
        let _ = writeln!(out);
        let _ = writeln!(out, "what the fault did, and what each policy had left:");
        for (run, fault) in faulted {
            let lost = fault.lost.as_deref().map(|lost| format!("; {lost}")).unwrap_or_default();
            let store = run.store.as_ref().map_or(String::new(), |store| match (store.ok, store.head_turn) {
                (true, head) => {
                    format!("; store verifies (head turn {})", head.map_or("-".to_string(), |t| t.to_string()))
                }
                (false, _) => format!("; store does NOT verify: {}", store.error.as_deref().unwrap_or("?")),
            });
            let _ = writeln!(out, "  {:<11} {}{lost}{store}", run.policy.name(), fault.detail);
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "per turn: exit code, exec time, agent-visible delay added by the policy (checkpoint)");
    let _ = write!(out, "{:>4}", "turn");
    for run in &report.runs {
        let _ = write!(out, " | {:^26}", run.policy.name());
    }
    let _ = writeln!(out);
    for index in 0..report.turns as usize {
        let _ = write!(out, "{:>4}", index + 1);
        for run in &report.runs {
            match run.turns.get(index) {
                Some(turn) => {
                    let marker =
                        if run.fault.as_ref().is_some_and(|fault| fault.turn == turn.turn) { "!" } else { " " };
                    let _ = write!(
                        out,
                        " | {:>4}{marker} {:>7.2} s {:>+8.2} s",
                        rc_text(turn.rc, turn.timed_out),
                        turn.exec_s,
                        turn.agent_visible_delay_s
                    );
                }
                None => {
                    let _ = write!(out, " | {:^26}", "-");
                }
            }
        }
        let _ = writeln!(out);
    }
    if report.fault_turn.is_some() {
        let _ = writeln!(out, "(! = the sandbox was killed after this turn and recovered)");
    }
    let _ = writeln!(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_file(base: &Fingerprint, path: &str, sha256: &str) -> Fingerprint {
        let mut state = base.clone();
        let entry = crate::fingerprint::FileEntry {
            kind: 'f',
            mode: "644".into(),
            owner: "0:0".into(),
            size: Some(1),
            link_target: None,
            sha256: Some(sha256.into()),
            xattrs: Default::default(),
            hard_link: None,
            data_ranges: None,
            rdev: None,
        };
        state.files.insert(path.into(), entry.into());
        state
    }

    #[test]
    fn state_changes_tell_the_turns_the_old_scope_could_not_see() {
        let initial = with_file(&Fingerprint::default(), "/testbed/a.py", "1");
        // 1: the workdir; 2: nothing; 3: /etc; 4: a process; 5: /tmp and /rootless (not /root);
        // 6: /root itself and /testbedx (not the workdir).
        let t1 = with_file(&initial, "/testbed/a.py", "2");
        let t2 = t1.clone();
        let t3 = with_file(&t2, "/etc/hosts", "1");
        let mut t4 = t3.clone();
        let sleep = crate::fingerprint::ProcessEntry { cwd: "/".into(), parent: "(outside)".into(), fds: Vec::new() };
        t4.processes.insert("sleep 9".into(), vec![sleep]);
        let t5 = with_file(&with_file(&t4, "/tmp/x", "1"), "/rootless", "1");
        let t6 = with_file(&with_file(&t5, "/root/.bashrc", "1"), "/testbedx/y", "1");
        let after = [t1, t2, t3, t4, t5, t6];

        let changes = StateChanges::of(Some(&initial), &after, "/testbed/");
        assert_eq!(changes.turns_seen, 6);
        assert_eq!(changes.turns_changed, [1, 3, 4, 5, 6]);
        assert_eq!(changes.files_outside_old_scope, [3, 5, 6]);
        assert_eq!(changes.processes_or_sockets, [4]);

        // Without the state before the first turn, the first is not looked at.
        let changes = StateChanges::of(None, &after, "/testbed");
        assert_eq!(changes.turns_seen, 5);
        assert_eq!(changes.turns_changed, [3, 4, 5, 6]);
        assert_eq!(StateChanges::of(None, &[], "/testbed"), StateChanges::default());
    }

    #[test]
    fn delay_summary() {
        let summary = DelaySummary::of([3.0, 1.0, 2.0, 10.0].into_iter());
        assert_eq!((summary.total_s, summary.mean_s, summary.median_s, summary.max_s), (16.0, 4.0, 2.5, 10.0));
        assert_eq!(DelaySummary::of(std::iter::empty()).max_s, 0.0);
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * 1024 * 1024 / 2), "1.5 MiB");
    }
}
