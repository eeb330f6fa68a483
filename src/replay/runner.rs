//! Replays each trace: fault-free reference run(s) first, then one run per
//! policy with the fault, each in its own container.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::ReplayError;
use crate::containerd::ctr::Ctr;
use super::fault::{FaultKind, FaultTurn};
use super::fingerprint::Fingerprint;
use super::oracle::{Reference, ReferenceRun, TurnResult};
use super::policy::{Launch, PolicyKind, RecoveryMethod, RecoveryPolicy, TurnCost, discard};
use super::report::{
    DelaySummary, FaultReport, PolicyRun, ReferenceSummary, TraceReport, TurnReport,
};
use super::sandbox::{ExecResult, SandboxSpec};
use super::trace::Trace;

#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub traces: Vec<PathBuf>,
    pub policies: Vec<PolicyKind>,
    pub fault: FaultKind,
    pub fault_turn: FaultTurn,
    /// Multiplies the recorded think times; 0 replays back to back.
    pub think_scale: f64,
    pub runtime: String,
    /// Fault-free runs to compare against; with 2, what differs between them is ignored.
    pub ref_runs: u8,
    pub ctr: Ctr,
}

/// Replays every trace; all traces are parsed and checked before any runs.
pub async fn replay(options: &ReplayOptions) -> Result<Vec<TraceReport>, ReplayError> {
    if options.policies.is_empty() {
        return Err(ReplayError::Options("no policy given".to_string()));
    }
    if !(1..=2).contains(&options.ref_runs) {
        return Err(ReplayError::Options(format!(
            "--ref-runs must be 1 or 2, not {}",
            options.ref_runs
        )));
    }
    if !options.think_scale.is_finite() || options.think_scale < 0.0 {
        return Err(ReplayError::Options(format!(
            "--think-scale must be >= 0, not {}",
            options.think_scale
        )));
    }
    let mut planned = Vec::new();
    for file in &options.traces {
        let trace = Trace::load(file)?;
        let fault_turn = match options.fault {
            FaultKind::None => None,
            FaultKind::KillProcesses => options
                .fault_turn
                .resolve(&trace.header.trace, trace.header.turns),
        };
        if let Some(turn) = fault_turn
            && !(1..=trace.header.turns).contains(&turn)
        {
            return Err(ReplayError::FaultTurnOutOfRange {
                file: file.clone(),
                turn,
                turns: trace.header.turns,
            });
        }
        let image = trace.header.image.reference();
        if options.ctr.image_digest(&image).await?.is_none() {
            return Err(ReplayError::ImageMissing {
                file: file.clone(),
                image,
                hint: trace.header.image.build_hint(),
            });
        }
        planned.push((trace, fault_turn));
    }
    let mut reports = Vec::new();
    for (trace, fault_turn) in &planned {
        reports.push(replay_trace(options, trace, *fault_turn).await?);
    }
    Ok(reports)
}

async fn replay_trace(
    options: &ReplayOptions,
    trace: &Trace,
    fault_turn: Option<u32>,
) -> Result<TraceReport, ReplayError> {
    let image = trace.header.image.reference();
    let started = Instant::now();
    let mut reference_runs = Vec::new();
    for index in 0..options.ref_runs {
        info!(trace = %trace.header.trace, run = index + 1, "reference run (fault-free, no checkpoints)");
        let launch = launch(options, trace, PolicyKind::Off, "ref");
        let outcome = run_guarded(
            trace,
            &launch,
            PolicyKind::Off.build(launch.clone()),
            None,
            options,
            true,
        )
        .await?;
        reference_runs.push(ReferenceRun {
            results: outcome.results(),
            fingerprints: outcome.fingerprints,
        });
    }
    let reference_time = started.elapsed();
    let reference = Reference::new(reference_runs).map_err(|source| ReplayError::Oracle {
        file: trace.file.clone(),
        source,
    })?;

    let mut runs = Vec::new();
    for policy in &options.policies {
        info!(trace = %trace.header.trace, policy = %policy, fault_turn, "policy run");
        let launch = launch(options, trace, *policy, policy.name());
        let outcome = run_guarded(
            trace,
            &launch,
            policy.build(launch.clone()),
            fault_turn,
            options,
            false,
        )
        .await?;
        runs.push(policy_report(
            *policy,
            options,
            &reference,
            outcome,
            &trace.file,
        )?);
    }
    Ok(TraceReport {
        trace: trace.header.trace.clone(),
        file: trace.file.clone(),
        image,
        runtime: options.runtime.clone(),
        turns: trace.header.turns,
        fault: options.fault,
        fault_turn,
        reference: ReferenceSummary {
            runs: reference.runs(),
            run_time_s: reference_time.as_secs_f64(),
            nondeterministic_turns: reference.nondeterministic_turns().into_iter().collect(),
            final_state: reference
                .fingerprint(trace.header.turns)
                .map(Fingerprint::digest),
        },
        runs,
    })
}

static NEXT_CONTAINER: AtomicU64 = AtomicU64::new(1);

fn launch(options: &ReplayOptions, trace: &Trace, policy: PolicyKind, role: &str) -> Launch {
    let sequence = NEXT_CONTAINER.fetch_add(1, Ordering::Relaxed);
    Launch {
        ctr: options.ctr.clone(),
        container_id: format!("replay-{}-{sequence}-{role}", std::process::id()),
        spec: SandboxSpec {
            image: trace.header.image.reference(),
            runtime: options.runtime.clone(),
            workdir: trace.header.workdir.clone(),
            annotations: vec![(
                crate::turns::ANNOTATION_POLICY.to_string(),
                policy.shim_policy().to_string(),
            )],
        },
    }
}

/// One turn as it happened in a run.
struct TurnOutcome {
    turn: u32,
    exec: ExecResult,
    checkpoint_s: f64,
    checkpoint_bytes: u64,
    checkpoint_error: Option<String>,
}

struct FaultOutcome {
    turn: u32,
    recovery_s: f64,
    /// A failed recovery ends the run: it is the policy's result, not the replay's error.
    result: Result<Recovered, String>,
}

struct Recovered {
    method: RecoveryMethod,
    possible: bool,
    state_after: Fingerprint,
}

struct RunOutcome {
    turns: Vec<TurnOutcome>,
    /// After every turn when requested (reference runs), else empty.
    fingerprints: Vec<Fingerprint>,
    fault: Option<FaultOutcome>,
    run_time: Duration,
}

impl RunOutcome {
    fn results(&self) -> Vec<TurnResult> {
        self.turns.iter().map(turn_result).collect()
    }
}

fn turn_result(turn: &TurnOutcome) -> TurnResult {
    TurnResult {
        turn: turn.turn,
        rc: turn.exec.rc,
        timed_out: turn.exec.timed_out,
        stdout_sha256: turn.exec.stdout_sha256.clone(),
        stderr_sha256: turn.exec.stderr_sha256.clone(),
    }
}

/// Runs the trace, then removes the container and the policy's images
/// whether the run succeeded or not.
async fn run_guarded(
    trace: &Trace,
    launch: &Launch,
    mut policy: Box<dyn RecoveryPolicy>,
    fault_turn: Option<u32>,
    options: &ReplayOptions,
    fingerprint_every_turn: bool,
) -> Result<RunOutcome, ReplayError> {
    let outcome = run(
        trace,
        launch,
        policy.as_mut(),
        fault_turn,
        options,
        fingerprint_every_turn,
    )
    .await;
    let cleaned = async {
        policy.cleanup().await?;
        discard(launch).await
    }
    .await;
    match (outcome, cleaned) {
        (Ok(outcome), Ok(())) => Ok(outcome),
        (Ok(_), Err(error)) => Err(error),
        (Err(error), cleaned) => {
            if let Err(cleanup_error) = cleaned {
                warn!(container = %launch.container_id, error = %cleanup_error, "cleanup after a failed run");
            }
            Err(error)
        }
    }
}

async fn run(
    trace: &Trace,
    launch: &Launch,
    policy: &mut dyn RecoveryPolicy,
    fault_turn: Option<u32>,
    options: &ReplayOptions,
    fingerprint_every_turn: bool,
) -> Result<RunOutcome, ReplayError> {
    let started = Instant::now();
    let mut sandbox = launch.fresh().await?;
    let mut turns = Vec::new();
    let mut fingerprints = Vec::new();
    let mut fault = None;
    for turn in &trace.turns {
        if options.think_scale > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(turn.think_s * options.think_scale)).await;
        }
        let exec = sandbox
            .exec(&turn.cmd, Duration::from_secs_f64(turn.timeout_s))
            .await?;
        let saving = Instant::now();
        // A failed checkpoint is the policy's result (CRIU cannot dump every
        // sandbox): the run goes on without it, and a later recovery has only
        // what was saved before.
        let (cost, checkpoint_error) = match policy.after_turn(&sandbox, turn.turn).await {
            Ok(cost) => (cost, None),
            Err(error) => {
                warn!(container = sandbox.id(), turn = turn.turn, %error, "checkpoint failed");
                (
                    TurnCost {
                        blocking_s: saving.elapsed().as_secs_f64(),
                        bytes: 0,
                    },
                    Some(error.to_string()),
                )
            }
        };
        info!(
            container = sandbox.id(),
            turn = turn.turn,
            rc = ?exec.rc,
            exec_s = exec.duration.as_secs_f64(),
            checkpoint_s = cost.blocking_s,
            "turn"
        );
        turns.push(TurnOutcome {
            turn: turn.turn,
            exec,
            checkpoint_s: cost.blocking_s,
            checkpoint_bytes: cost.bytes,
            checkpoint_error,
        });
        if fingerprint_every_turn {
            fingerprints.push(sandbox.fingerprint().await?);
        }
        if fault_turn == Some(turn.turn) {
            sandbox.kill_all().await?;
            let recovering = Instant::now();
            let recovery = policy.recover(sandbox).await;
            let recovery_s = recovering.elapsed().as_secs_f64();
            match recovery {
                Ok(recovery) => {
                    sandbox = recovery.sandbox;
                    info!(container = sandbox.id(), turn = turn.turn, method = ?recovery.method, recovery_s, "recovered");
                    let state_after = sandbox.fingerprint().await?;
                    let recovered = Recovered {
                        method: recovery.method,
                        possible: recovery.possible,
                        state_after,
                    };
                    fault = Some(FaultOutcome {
                        turn: turn.turn,
                        recovery_s,
                        result: Ok(recovered),
                    });
                }
                Err(error) => {
                    warn!(container = %launch.container_id, turn = turn.turn, %error, "recovery failed");
                    fault = Some(FaultOutcome {
                        turn: turn.turn,
                        recovery_s,
                        result: Err(error.to_string()),
                    });
                    break;
                }
            }
        }
    }
    Ok(RunOutcome {
        turns,
        fingerprints,
        fault,
        run_time: started.elapsed(),
    })
}

fn policy_report(
    policy: PolicyKind,
    options: &ReplayOptions,
    reference: &Reference,
    outcome: RunOutcome,
    file: &std::path::Path,
) -> Result<PolicyRun, ReplayError> {
    let fault = match &outcome.fault {
        None => None,
        Some(fault) => {
            let later: Vec<TurnResult> = outcome
                .turns
                .iter()
                .filter(|turn| turn.turn > fault.turn)
                .map(turn_result)
                .collect();
            let mut report = FaultReport {
                kind: options.fault,
                turn: fault.turn,
                recovery: None,
                recovery_s: fault.recovery_s,
                error: None,
                state_after: None,
                reference_state: reference.fingerprint(fault.turn).map(Fingerprint::digest),
                verdict: None,
            };
            match &fault.result {
                Ok(recovered) => {
                    let verdict = reference
                        .judge(
                            fault.turn,
                            &recovered.state_after,
                            &later,
                            recovered.possible,
                        )
                        .map_err(|source| ReplayError::Oracle {
                            file: file.to_path_buf(),
                            source,
                        })?;
                    report.recovery = Some(recovered.method.clone());
                    report.state_after = Some(recovered.state_after.digest());
                    report.verdict = Some(verdict);
                }
                Err(error) => report.error = Some(error.clone()),
            }
            Some(report)
        }
    };
    let turns: Vec<TurnReport> = outcome
        .turns
        .iter()
        .map(|turn| TurnReport {
            turn: turn.turn,
            rc: turn.exec.rc,
            timed_out: turn.exec.timed_out,
            exec_s: turn.exec.duration.as_secs_f64(),
            checkpoint_s: turn.checkpoint_s,
            checkpoint_bytes: turn.checkpoint_bytes,
            agent_visible_delay_s: turn.checkpoint_s,
            checkpoint_error: turn.checkpoint_error.clone(),
            stdout_sha256: turn.exec.stdout_sha256.clone(),
            stderr_sha256: turn.exec.stderr_sha256.clone(),
        })
        .collect();
    Ok(PolicyRun {
        policy,
        recovered_correctly: fault.as_ref().map(|fault| {
            fault
                .verdict
                .as_ref()
                .is_some_and(|verdict| verdict.correct)
        }),
        checkpoints: turns
            .iter()
            .filter(|turn| turn.checkpoint_bytes > 0)
            .count() as u32,
        checkpoint_failures: turns
            .iter()
            .filter(|turn| turn.checkpoint_error.is_some())
            .count() as u32,
        checkpoint_bytes: turns.iter().map(|turn| turn.checkpoint_bytes).sum(),
        run_time_s: outcome.run_time.as_secs_f64(),
        agent_delay: DelaySummary::of(turns.iter().map(|turn| turn.agent_visible_delay_s)),
        fault,
        turns,
    })
}
