//! Replays each trace: fault-free reference runs and one run per policy with the fault,
//! each in its own container. The first policy runs fill the time the reference runs are
//! spaced apart; every run is judged once the reference is whole.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, info, warn};

use super::ReplayError;
use super::fault::{FaultKind, FaultTurn};
use super::fingerprint::Fingerprint;
use super::injector::{Daemons, FaultInjector};
use super::node::{NodeA, NodeB};
use super::oracle::{Reference, ReferenceRun, TurnResult};
use super::policy::{
    Launch, OffNode, PolicyKind, Recovery, RecoveryMethod, RecoveryPolicy, SelfPushed, StoreCheck, TurnCost, discard,
};
use super::report::{
    DelaySummary, FaultReport, NotRun, PolicyRun, ReferenceSummary, Replication, StateChanges, TraceReport, TurnReport,
};
use super::sandbox::{ExecResult, Sandbox, SandboxSpec, remove_container, remove_image};
use super::settle;
use super::shell::ReplayMode;
use super::trace::Trace;
use crab_containerd::Ctr;

#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub traces: Vec<PathBuf>,
    pub policies: Vec<PolicyKind>,
    /// Each fault gets its own run of every policy; the reference runs are shared.
    pub faults: Vec<FaultKind>,
    pub fault_turn: FaultTurn,
    /// Multiplies the recorded think times; 0 replays back to back.
    pub think_scale: f64,
    pub runtime: String,
    /// Fault-free runs to compare against; with 2, what differs between them is ignored.
    /// 0: the runs are not judged (fault `none` only), and no run looks at the sandbox
    /// between turns.
    pub ref_runs: u8,
    /// Least time between the starts of two reference runs: output that
    /// prints the clock in a form the normaliser does not know (minutes in
    /// `ps`) then differs between them and the turn counts as nondeterministic.
    pub ref_spacing: Duration,
    pub ctr: Ctr,
    /// How faults reach containerd and crabd.
    pub daemons: Daemons,
    /// Where policies keep checkpoints outside containerd (every-turn's archives).
    pub checkpoint_dir: PathBuf,
    /// Package sources the sandboxes install from without a network (`scripts/lib/packages.sh`),
    /// a host directory they see read-only at [`SANDBOX_PACKAGES`]; None: no package source.
    pub packages: Option<PathBuf>,
    /// How the trace's commands reach the sandbox (each its own exec, one
    /// shell's stdin, or a tmux session).
    pub mode: ReplayMode,
}

/// Where a sandbox sees [`ReplayOptions::packages`]: the images point pip and apt there.
pub const SANDBOX_PACKAGES: &str = "/opt/crab-packages";

/// Most fault-free reference runs of a trace. Each is a whole run of the trace, spaced
/// `--ref-spacing` after the one before.
pub const MAX_REFERENCE_RUNS: u8 = 4;

/// Replays every trace; all traces are parsed and checked before any runs.
/// One report per trace and fault, in that order.
pub async fn replay(options: &ReplayOptions) -> Result<Vec<TraceReport>, ReplayError> {
    if options.policies.is_empty() {
        return Err(ReplayError::Options("no policy given".to_string()));
    }
    if options.faults.is_empty() {
        return Err(ReplayError::Options("no fault given (use none for fault-free runs)".to_string()));
    }
    let injector = FaultInjector::new(options.ctr.clone(), options.daemons.clone());
    for fault in &options.faults {
        injector.check(*fault).map_err(|source| ReplayError::Fault { fault: *fault, source })?;
    }
    if options.ref_runs > MAX_REFERENCE_RUNS {
        return Err(ReplayError::Options(format!(
            "--ref-runs must be 0 to {MAX_REFERENCE_RUNS}, not {}",
            options.ref_runs
        )));
    }
    if options.ref_runs == 0 && options.faults.iter().any(|fault| *fault != FaultKind::None) {
        return Err(ReplayError::Options(
            "--ref-runs 0 runs no reference, so it goes only with --fault none: a recovery is judged against \
             the reference runs"
                .to_string(),
        ));
    }
    if !options.think_scale.is_finite() || options.think_scale < 0.0 {
        return Err(ReplayError::Options(format!("--think-scale must be >= 0, not {}", options.think_scale)));
    }
    let mut planned = Vec::new();
    for file in &options.traces {
        let trace = Trace::load(file)?;
        // One turn for every fault of the trace, so their results line up.
        let fault_turn = options.fault_turn.resolve(&trace.header.trace, trace.header.turns);
        if let Some(turn) = fault_turn
            && !(1..=trace.header.turns).contains(&turn)
        {
            return Err(ReplayError::FaultTurnOutOfRange { file: file.clone(), turn, turns: trace.header.turns });
        }
        planned.push((file, trace, fault_turn));
    }
    // containerd is asked only once every trace is known good: a bad trace is named as such
    // even where containerd is down.
    for (file, trace, _) in &planned {
        let image = trace.header.image.reference();
        if options.ctr.image_digest(&image).await?.is_none() {
            let file = file.to_path_buf();
            return Err(ReplayError::ImageMissing { file, image, hint: trace.header.image.build_hint() });
        }
    }
    sweep_leftovers(&options.ctr).await?;
    if let Some(node_b) = &options.daemons.node_b {
        // Node B holds the sandboxes node-loss recovered there (named the same way). It is needed
        // only by node-loss runs, so one that does not answer yet is left for a later replay.
        if let Err(error) = sweep_leftovers(&node_b.ctr).await {
            warn!(%error, "node B: what replays that are gone left there is not removed");
        }
    }
    let mut reports = Vec::new();
    for (index, (_, trace, fault_turn)) in planned.iter().enumerate() {
        info!(trace = %trace.header.trace, number = index + 1, of = planned.len(), "progress: trace");
        reports.extend(replay_trace(options, &injector, trace, *fault_turn).await?);
    }
    Ok(reports)
}

async fn replay_trace(
    options: &ReplayOptions,
    injector: &FaultInjector,
    trace: &Trace,
    fault_turn: Option<u32>,
) -> Result<Vec<TraceReport>, ReplayError> {
    let image = trace.header.image.reference();
    let started = Instant::now();
    // Every policy run of the trace, in the order of the reports.
    let plans: Vec<(FaultKind, Plan)> =
        options.faults.iter().map(|fault| (*fault, plan(&options.policies, *fault))).collect();
    let policy_runs: Vec<(FaultKind, PolicyKind)> =
        plans.iter().flat_map(|(fault, plan)| plan.runs.iter().map(move |policy| (*fault, *policy))).collect();
    let runs_total = usize::from(options.ref_runs) + policy_runs.len();
    let mut runs_done = 0;
    let strike_of =
        |fault: FaultKind| (fault != FaultKind::None).then_some(fault_turn).flatten().map(|turn| (fault, turn));
    let run_policy = |index: usize, runs_done: usize| {
        let (fault, policy) = policy_runs[index];
        async move {
            let fault_turn = strike_of(fault).map(|(_, turn)| turn);
            info!(trace = %trace.header.trace, run = runs_done, of = runs_total, policy = %policy, %fault, fault_turn, "progress: policy run");
            let mut launch = launch(options, trace, policy, policy.name());
            if fault.moves_to_node_b() {
                launch.registry = options.daemons.node_b.as_ref().map(NodeB::registry);
                launch = on_node_a_of_its_own(launch, options)?;
            }
            run_guarded(trace, &launch, policy.build(launch.clone()), strike_of(fault), false, options, injector).await
        }
    };
    // Outcomes of policy runs made while the reference runs were spaced apart, judged once the
    // reference is whole: at most this many, as each holds a look at the sandbox per turn, and
    // only runs whose fault leaves the daemons the next reference run uses alone.
    const RUNS_WHILE_SPACING: usize = 3;
    let mut early: Vec<RunOutcome> = Vec::new();
    let mut reference_runs = Vec::new();
    let mut reference_time = Duration::ZERO;
    let mut state_changes = StateChanges::default();
    for index in 0..options.ref_runs {
        if index > 0 {
            // The time until the next reference run may start goes to the policy runs: the
            // spacing is only a least time between the starts of two reference runs.
            let spaced = started + options.ref_spacing * u32::from(index);
            while Instant::now() < spaced
                && early.len() < RUNS_WHILE_SPACING
                && policy_runs.get(early.len()).is_some_and(|(fault, _)| fault.strikes_only_its_sandbox())
            {
                runs_done += 1;
                early.push(run_policy(early.len(), runs_done).await?);
            }
            if let Some(wait) = spaced.checked_duration_since(Instant::now()) {
                info!(trace = %trace.header.trace, wait_s = wait.as_secs_f64(), "spacing the reference runs apart");
                tokio::time::sleep(wait).await;
            }
        }
        runs_done += 1;
        info!(trace = %trace.header.trace, run = runs_done, of = runs_total, "progress: reference run (fault-free, no checkpoints)");
        let launch = launch(options, trace, PolicyKind::Off, "ref");
        let run_started = Instant::now();
        let outcome =
            run_guarded(trace, &launch, PolicyKind::Off.build(launch.clone()), None, true, options, injector).await?;
        reference_time += run_started.elapsed();
        if reference_runs.is_empty() {
            state_changes = StateChanges::of(outcome.initial.as_ref(), &outcome.fingerprints, &trace.header.workdir);
        }
        reference_runs.push(ReferenceRun { results: outcome.results(), fingerprints: outcome.fingerprints });
    }
    // No reference runs: nothing is judged (the options allow it only without a fault).
    let reference = (!reference_runs.is_empty())
        .then(|| Reference::new(reference_runs))
        .transpose()
        .map_err(|source| ReplayError::Oracle { file: trace.file.clone(), source })?;

    let reference_summary = match &reference {
        Some(reference) => ReferenceSummary {
            runs: reference.runs(),
            run_time_s: reference_time.as_secs_f64(),
            policy_runs_while_spaced: early.len(),
            nondeterministic_turns: reference.nondeterministic_turns().into_iter().collect(),
            normalised_turns: reference.normalised_turns().into_iter().collect(),
            turns_with_wall_clock: reference.turns_with_wall_clock().into_iter().collect(),
            unsettled_turns: reference.unsettled_turns().into_iter().collect(),
            final_state: reference.fingerprint(trace.header.turns).map(Fingerprint::digest),
            state_changes,
        },
        None => ReferenceSummary::default(),
    };

    let mut reports = Vec::new();
    let mut early = early.into_iter();
    let mut index = 0;
    for (fault, plan) in plans {
        let strike = strike_of(fault);
        let mut runs = Vec::new();
        for policy in &plan.runs {
            let outcome = match early.next() {
                Some(outcome) => outcome,
                None => {
                    runs_done += 1;
                    run_policy(index, runs_done).await?
                }
            };
            index += 1;
            if plan.off_from_chat_only && *policy == PolicyKind::ChatOnly {
                runs.push(policy_report(PolicyKind::Off, reference.as_ref(), &outcome, &trace.file)?);
            }
            runs.push(policy_report(*policy, reference.as_ref(), &outcome, &trace.file)?);
        }
        reports.push(TraceReport {
            trace: trace.header.trace.clone(),
            file: trace.file.clone(),
            image: image.clone(),
            runtime: options.runtime.clone(),
            mode: options.mode,
            turns: trace.header.turns,
            fault,
            fault_turn: strike.map(|(_, turn)| turn),
            think_scale: options.think_scale,
            reference: reference_summary.clone(),
            runs,
            not_run: plan.not_run,
        });
    }
    Ok(reports)
}

/// `off` and `chat-only` run the same sandbox: nothing saved, and after a fault that ends it
/// a fresh one from the base image (see [`FreshSandbox`](super::policy)). They differ only in
/// whether that counts as a recovery, so with both asked for, only chat-only runs and off's
/// report is its run judged as off.
fn shares_off_with_chat_only(policies: &[PolicyKind]) -> bool {
    policies.contains(&PolicyKind::Off) && policies.contains(&PolicyKind::ChatOnly)
}

/// The runs one fault of a trace gets.
#[derive(Debug, PartialEq)]
struct Plan {
    /// The policies run, in the order asked.
    runs: Vec<PolicyKind>,
    /// off's report is made from chat-only's run (see [`shares_off_with_chat_only`]).
    off_from_chat_only: bool,
    /// The policies the fault has nothing to strike in, left out.
    not_run: Vec<NotRun>,
}

fn plan(policies: &[PolicyKind], fault: FaultKind) -> Plan {
    let (untouched, struck): (Vec<PolicyKind>, Vec<PolicyKind>) =
        policies.iter().partition(|policy| policy.untouched_by(fault).is_some());
    let off_from_chat_only = shares_off_with_chat_only(&struck);
    Plan {
        runs: struck.into_iter().filter(|policy| !(off_from_chat_only && *policy == PolicyKind::Off)).collect(),
        off_from_chat_only,
        not_run: untouched
            .into_iter()
            .map(|policy| NotRun { policy, why: policy.untouched_by(fault).unwrap_or_default().to_string() })
            .collect(),
    }
}

static NEXT_CONTAINER: AtomicU64 = AtomicU64::new(1);

/// The pid of the replay that named a container `replay-<pid>-<n>-<role>` (see [`launch`]), or
/// an image after one (every-turn's checkpoints: `.../replay-<pid>-<n>-<role>:turn-N`).
fn replay_pid(name: &str) -> Option<u32> {
    name.match_indices("replay-").find_map(|(at, _)| {
        let mut parts = name[at + "replay-".len()..].splitn(3, '-');
        let pid = parts.next()?.parse().ok()?;
        parts.next()?.parse::<u64>().ok()?;
        parts.next().filter(|role| !role.is_empty())?;
        Some(pid)
    })
}

/// Removes what replays that are gone left in containerd: their sandboxes, and every-turn's
/// checkpoint images, which would spoil later runs (containerd stores a checkpoint without its
/// task part when one of its blobs is still held by another image). Only names whose replay
/// pid no longer exists are touched: a replay still running, a test's included, keeps its own.
async fn sweep_leftovers(ctr: &Ctr) -> Result<(), ReplayError> {
    let gone = |name: &str| replay_pid(name).is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
    let containers = ctr.run(&["containers", "ls", "-q"]).await?.stdout_text();
    for id in containers.lines().map(str::trim).filter(|id| gone(id)) {
        warn!(container = id, "removing a sandbox a replay that is gone left behind");
        remove_container(ctr, id).await?;
    }
    let images = ctr.run(&["images", "ls", "-q"]).await?.stdout_text();
    for reference in images.lines().map(str::trim).filter(|reference| gone(reference)) {
        warn!(image = reference, "removing a checkpoint image a replay that is gone left behind");
        remove_image(ctr, reference).await?;
    }
    Ok(())
}

/// A crab sandbox that will lose its node gets node A's directories of its own (its crab
/// config names them; the fault deletes them) and pushes its turns to node B's registry.
fn on_node_a_of_its_own(mut launch: Launch, options: &ReplayOptions) -> Result<Launch, ReplayError> {
    let Some(node_b) = &options.daemons.node_b else { return Ok(launch) };
    if options.runtime != crabctl::CRAB_RUNTIME {
        return Ok(launch);
    }
    let base = crab_config::Config::load(None)
        .map_err(|error| ReplayError::Options(format!("node A's crab config: {error}")))?;
    let dir = options.checkpoint_dir.join("node-a").join(&launch.container_id);
    let node_a = NodeA::prepare(&dir, &base, node_b)?;
    launch.spec.runtime_config = Some(node_a.config_path);
    Ok(launch)
}

fn launch(options: &ReplayOptions, trace: &Trace, policy: PolicyKind, role: &str) -> Launch {
    let sequence = NEXT_CONTAINER.fetch_add(1, Ordering::Relaxed);
    Launch {
        ctr: options.ctr.clone(),
        container_id: format!("replay-{}-{sequence}-{role}", std::process::id()),
        checkpoint_dir: options.checkpoint_dir.clone(),
        node_b: options.daemons.node_b.clone(),
        registry: None,
        spec: SandboxSpec {
            image: trace.header.image.reference(),
            runtime: options.runtime.clone(),
            workdir: trace.header.workdir.clone(),
            annotations: vec![(crab_store::turns::ANNOTATION_POLICY.to_string(), policy.shim_policy().to_string())],
            ignore: trace.header.ignore.clone(),
            read_only_binds: options.packages.iter().map(|dir| (dir.clone(), SANDBOX_PACKAGES.to_string())).collect(),
            mode: options.mode,
            runtime_config: None,
        },
    }
}

/// One turn as it happened in a run.
struct TurnOutcome {
    turn: u32,
    exec: ExecResult,
    /// The exec's result as the oracle compares it.
    result: TurnResult,
    checkpoint_s: f64,
    checkpoint_bytes: u64,
    checkpoint_exported_bytes: u64,
    checkpoint_exported_to: Option<OffNode>,
    checkpoint_class: Option<String>,
    checkpoint_error: Option<String>,
    /// How long the run waited for what the turn left running (see [`settle`]).
    settle_s: f64,
    /// How long the agent waited for the policy beyond its think time.
    agent_visible_delay_s: f64,
    /// Whether what the policy saved was off the node when the next turn started (policies that
    /// push only).
    off_node_before_next: Option<bool>,
}

struct FaultOutcome {
    kind: FaultKind,
    turn: u32,
    /// What the injector did, and what the policy lost with containerd's state.
    detail: String,
    lost: Option<String>,
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
    /// The sandbox before its first turn, where the run was asked to look (the reference
    /// runs, all alike; the first one's tells what each turn changed).
    initial: Option<Fingerprint>,
    /// The sandbox after each turn, one per entry of `turns`.
    fingerprints: Vec<Fingerprint>,
    fault: Option<FaultOutcome>,
    run_time: Duration,
    /// The policy's own check of its store after the run, where it has one.
    store: Option<StoreCheck>,
    /// What the policy's own push figures leave out (see [`SelfPushed::note`]).
    pushed_note: Option<String>,
}

impl RunOutcome {
    fn results(&self) -> Vec<TurnResult> {
        self.turns.iter().map(|turn| turn.result.clone()).collect()
    }

    /// What the policy's runtime pushed by itself becomes each turn's copy off the node.
    fn add_self_pushed(&mut self, pushed: SelfPushed) {
        for turn in &mut self.turns {
            if let Some(bytes) = pushed.turns.get(&turn.turn) {
                turn.checkpoint_exported_bytes = *bytes;
                turn.checkpoint_exported_to = Some(OffNode::Registry);
            }
        }
        self.pushed_note = pushed.note;
    }
}

/// Runs the trace, then removes the container and the policy's images
/// whether the run succeeded or not.
async fn run_guarded(
    trace: &Trace,
    launch: &Launch,
    mut policy: Box<dyn RecoveryPolicy>,
    strike: Option<(FaultKind, u32)>,
    first_look: bool,
    options: &ReplayOptions,
    injector: &FaultInjector,
) -> Result<RunOutcome, ReplayError> {
    let mut outcome = run(trace, launch, policy.as_mut(), strike, first_look, options, injector).await;
    if let Ok(outcome) = &mut outcome {
        outcome.store = policy.check_store(&launch.container_id).await;
        // Before the clean-up, which deletes node A's directory (and with it its push log).
        match policy.self_pushed().await {
            Ok(Some(pushed)) => outcome.add_self_pushed(pushed),
            Ok(None) => {}
            Err(error) => {
                warn!(container = %launch.container_id, %error, "what the policy pushed by itself");
                outcome.pushed_note = Some(format!("its pushed bytes could not be read: {error}"));
            }
        }
    }
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
    strike: Option<(FaultKind, u32)>,
    first_look: bool,
    options: &ReplayOptions,
    injector: &FaultInjector,
) -> Result<RunOutcome, ReplayError> {
    let started = Instant::now();
    let mut sandbox = launch.fresh().await?;
    let mut turns: Vec<TurnOutcome> = Vec::new();
    let mut tmux_servers = super::shell::TmuxServers::default();
    let mut fingerprints = Vec::new();
    let judged = options.ref_runs > 0;
    let initial = if judged && first_look { Some(sandbox.fingerprint().await?) } else { None };
    let mut fault = None;
    let think = |index: usize| {
        let seconds = trace.turns.get(index).map_or(0.0, |turn| turn.think_s * options.think_scale);
        Duration::from_secs_f64(seconds)
    };
    tokio::time::sleep(think(0)).await;
    for (index, turn) in trace.turns.iter().enumerate() {
        // The agent's next turn starts now: how far the policy's replication got by then.
        if let Some(previous) = turns.last_mut() {
            previous.off_node_before_next = policy.off_node(&sandbox).await?;
        }
        let exec = sandbox.exec(&turn.cmd, Duration::from_secs_f64(turn.timeout_s)).await?;
        let turn_ended = SystemTime::now();
        // What the turn left running gets the time the agent gave it before the next turn
        // (within bounds), in every run alike, before anything saves or looks.
        let settle_bound = settle::bound(trace.turns.get(index + 1).map(|next| next.think_s));
        let settled = sandbox.settle(settle_bound).await;
        // The policy saves while the agent thinks about its next turn; the
        // agent waits only for what outlasts its thinking.
        let next_think = think(index + 1);
        let saving = Instant::now();
        let (saved, ()) = tokio::join!(
            async {
                let saved = policy.after_turn(&sandbox, turn.turn).await;
                (saved, saving.elapsed())
            },
            tokio::time::sleep(next_think.saturating_sub(settled.waited))
        );
        let (saved, save_time) = saved;
        // A save the runner starts (every-turn) would start at the turn's end for a real agent;
        // one the runtime makes by itself (crab's shim) did, and says when it was durable.
        let save_time = match saved.as_ref().ok().and_then(|cost| cost.durable_at) {
            Some(durable) => durable.duration_since(turn_ended).unwrap_or_default(),
            None => save_time,
        };
        let agent_visible_delay_s = save_time.saturating_sub(next_think).as_secs_f64();
        // A failed checkpoint is the policy's result (CRIU cannot dump every
        // sandbox): the run goes on without it, and a later recovery has only
        // what was saved before.
        let (cost, checkpoint_error) = match saved {
            Ok(cost) => (cost, None),
            Err(error) => {
                warn!(container = sandbox.id(), turn = turn.turn, %error, "checkpoint failed");
                (TurnCost { blocking_s: save_time.as_secs_f64(), ..TurnCost::default() }, Some(error.to_string()))
            }
        };
        let (rc, exec_s, checkpoint_s) = (exec.rc, exec.duration.as_secs_f64(), cost.blocking_s);
        turns.push(TurnOutcome {
            turn: turn.turn,
            result: TurnResult::new(turn.turn, exec.rc, exec.timed_out, &exec.stdout, &exec.stderr)
                .with_shell(tmux_servers.identify(&exec.shell))
                .with_settled(settled.settled),
            settle_s: settled.waited.as_secs_f64(),
            exec,
            checkpoint_s: cost.blocking_s,
            checkpoint_bytes: cost.bytes,
            checkpoint_exported_bytes: cost.exported_bytes,
            checkpoint_exported_to: cost.exported_to,
            checkpoint_class: cost.class.map(str::to_string),
            checkpoint_error,
            agent_visible_delay_s,
            off_node_before_next: None,
        });
        // Every run, not only the reference runs, looks at the sandbox after
        // every turn: the oracle compares the states after the fault's later
        // turns, and the look takes time the agent's next turn waits for. A
        // turn whose output depends on the time since the last one (requests
        // against a rate limit) then sees the same spacing in all runs. Runs
        // that nothing judges (no reference) take no look at all.
        let looking = Instant::now();
        if judged {
            fingerprints.push(sandbox.fingerprint().await?);
        }
        let look_s = looking.elapsed().as_secs_f64();
        let (settle_s, settled) = (settled.waited.as_secs_f64(), settled.settled);
        info!(container = sandbox.id(), turn = turn.turn, ?rc, exec_s, settle_s, settled, checkpoint_s, look_s, "turn");
        if let Some((kind, fault_turn)) = strike
            && fault_turn == turn.turn
        {
            let (recovered, outcome) =
                strike_and_recover(kind, turn.turn, sandbox, policy, injector, settle_bound).await?;
            let failed = outcome.result.is_err();
            fault = Some(outcome);
            match recovered {
                Some(recovered) if !failed => sandbox = recovered,
                _ => break,
            }
        }
    }
    Ok(RunOutcome { turns, initial, fingerprints, fault, run_time: started.elapsed(), store: None, pushed_note: None })
}

/// Strikes the fault after `turn`, then lets the policy bring the sandbox
/// back, unless it survived. A recovery that fails, or whose sandbox cannot
/// even be looked at, is the policy's result; a fault that cannot be struck
/// is the replay's error.
async fn strike_and_recover(
    kind: FaultKind,
    turn: u32,
    sandbox: Sandbox,
    policy: &mut dyn RecoveryPolicy,
    injector: &FaultInjector,
    settle_bound: Duration,
) -> Result<(Option<Sandbox>, FaultOutcome), ReplayError> {
    let waited = if kind.moves_to_node_b() { policy.before_node_loss(&sandbox).await? } else { None };
    let mut injected =
        injector.inject(kind, &sandbox).await.map_err(|source| ReplayError::Fault { fault: kind, source })?;
    if let Some(waited) = waited {
        injected.detail = format!("{waited}; {}", injected.detail);
    }
    let lost = if kind.loses_containerd_state() { policy.lose_containerd_state().await? } else { None };
    if kind.moves_to_node_b() {
        policy.move_to_node_b();
    }
    let recovering = Instant::now();
    let recovery = if injected.task_running {
        Ok(Recovery { sandbox, method: RecoveryMethod::NotNeeded, possible: true })
    } else {
        policy.recover(sandbox).await
    };
    let mut outcome = FaultOutcome {
        kind,
        turn,
        detail: injected.detail,
        lost,
        recovery_s: recovering.elapsed().as_secs_f64(),
        result: Err(String::new()),
    };
    let mut recovery = match recovery {
        Ok(recovery) => recovery,
        Err(error) => {
            warn!(turn, %kind, %error, "recovery failed");
            outcome.result = Err(error.to_string());
            return Ok((None, outcome));
        }
    };
    // stdin mode: the agent's shell is re-attached where the runtime restored
    // it and holds it by exec id (crab, from a process checkpoint), else
    // restarted; the oracle then judges the shell the agent goes on with.
    let reattach = (policy.kind() == PolicyKind::Crab && matches!(recovery.method, RecoveryMethod::Checkpoint { .. }))
        || recovery.method == RecoveryMethod::NotNeeded;
    if recovery.sandbox.mode() == ReplayMode::Stdin
        && let Err(error) = recovery.sandbox.resume_shell(reattach).await
    {
        outcome.result = Err(format!("the shell session after recovery ({:?}): {error}", recovery.method));
        return Ok((Some(recovery.sandbox), outcome));
    }
    info!(container = recovery.sandbox.id(), turn, %kind, method = ?recovery.method, recovery_s = outcome.recovery_s, "recovered");
    // A process restored mid-work (a writer a process checkpoint caught) gets the same time
    // to settle as after the turn itself, so the state is compared with the reference's at
    // the same point of that work.
    let settled = recovery.sandbox.settle(settle_bound).await;
    debug!(
        container = recovery.sandbox.id(),
        settle_s = settled.waited.as_secs_f64(),
        settled = settled.settled,
        "settled after recovery"
    );
    outcome.result = match recovery.sandbox.fingerprint().await {
        Ok(state_after) => Ok(Recovered { method: recovery.method, possible: recovery.possible, state_after }),
        Err(error) => Err(format!("the sandbox after recovery ({:?}) does not answer: {error}", recovery.method)),
    };
    Ok((Some(recovery.sandbox), outcome))
}

fn policy_report(
    policy: PolicyKind,
    reference: Option<&Reference>,
    outcome: &RunOutcome,
    file: &std::path::Path,
) -> Result<PolicyRun, ReplayError> {
    let fault = match &outcome.fault {
        None => None,
        Some(fault) => {
            let reference = reference.ok_or_else(|| {
                ReplayError::Options(format!("{}: a fault struck a run without reference runs", file.display()))
            })?;
            let later: Vec<(TurnResult, Option<&Fingerprint>)> = outcome
                .turns
                .iter()
                .zip(outcome.fingerprints.iter().map(Some).chain(std::iter::repeat(None)))
                .filter(|(turn, _)| turn.turn > fault.turn)
                .map(|(turn, state)| (turn.result.clone(), state))
                .collect();
            let mut report = FaultReport {
                kind: fault.kind,
                turn: fault.turn,
                detail: fault.detail.clone(),
                lost: fault.lost.clone(),
                recovery: None,
                recovery_s: fault.recovery_s,
                error: None,
                state_after: None,
                reference_state: reference.fingerprint(fault.turn).map(Fingerprint::digest),
                verdict: None,
                later_checkpoint_failures: 0,
            };
            match &fault.result {
                Ok(recovered) => {
                    let possible = recovery_possible(policy, recovered);
                    let verdict = reference
                        .judge(fault.turn, &recovered.state_after, &later, possible)
                        .map_err(|source| ReplayError::Oracle { file: file.to_path_buf(), source })?;
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
            checkpoint_exported_bytes: turn.checkpoint_exported_bytes,
            checkpoint_exported_to: turn.checkpoint_exported_to,
            checkpoint_class: turn.checkpoint_class.clone(),
            agent_visible_delay_s: turn.agent_visible_delay_s,
            off_node_before_next_turn: turn.off_node_before_next,
            settle_s: turn.settle_s,
            settled: !turn.result.unsettled,
            checkpoint_error: turn.checkpoint_error.clone(),
            stdout_sha256: turn.result.stdout_sha256.clone(),
            stderr_sha256: turn.result.stderr_sha256.clone(),
            wall_clock_stamps: turn.result.wall_clock_stamps,
        })
        .collect();
    let fault = fault.map(|mut fault| {
        fault.later_checkpoint_failures =
            turns.iter().filter(|turn| turn.turn > fault.turn && turn.checkpoint_error.is_some()).count() as u32;
        fault
    });
    Ok(PolicyRun {
        policy,
        recovered_correctly: fault.as_ref().map(|fault| recovered_correctly(fault, outcome.store.as_ref())),
        store: outcome.store.clone(),
        pushed_note: outcome.pushed_note.clone(),
        checkpoints: turns.iter().filter(|turn| turn.checkpoint_bytes > 0).count() as u32,
        checkpoint_failures: turns.iter().filter(|turn| turn.checkpoint_error.is_some()).count() as u32,
        checkpoint_bytes: turns.iter().map(|turn| turn.checkpoint_bytes).sum(),
        checkpoint_exported_bytes: turns.iter().map(|turn| turn.checkpoint_exported_bytes).sum(),
        checkpoint_exported_to: turns.iter().find_map(|turn| turn.checkpoint_exported_to),
        checkpoint_charged_bytes: charged_bytes(
            turns.iter().map(|turn| turn.checkpoint_bytes).sum(),
            outcome.store.as_ref(),
        ),
        run_time_s: outcome.run_time.as_secs_f64(),
        agent_delay: DelaySummary::of(turns.iter().map(|turn| turn.agent_visible_delay_s)),
        replication: Replication::of(turns.iter().filter_map(|turn| turn.off_node_before_next_turn)),
        fault,
        turns,
    })
}

/// Whether the policy could have recovered the sandbox: `off` saves nothing, so a sandbox
/// it had to bring back (not one that kept running through the fault) is lost, whatever the
/// fresh one it runs on later does; the others say so themselves.
fn recovery_possible(policy: PolicyKind, recovered: &Recovered) -> bool {
    recovered.possible && !(policy == PolicyKind::Off && recovered.method != RecoveryMethod::NotNeeded)
}

/// What a run is charged for its checkpoints: what it wrote, or everything its chain
/// references when its store holds more for it (written by another run of the batch and
/// deduplicated against).
fn charged_bytes(written: u64, store: Option<&StoreCheck>) -> u64 {
    written.max(store.map_or(0, |store| store.bytes))
}

/// The oracle's verdict, and for a fault that strikes the checkpoint
/// pipeline also that every later checkpoint was taken and the store verifies.
fn recovered_correctly(fault: &FaultReport, store: Option<&StoreCheck>) -> bool {
    let state_and_turns = fault.verdict.as_ref().is_some_and(|verdict| verdict.correct);
    let checkpoints_complete = !fault.kind.strikes_checkpointing()
        || (fault.later_checkpoint_failures == 0 && store.is_none_or(|store| store.ok));
    state_and_turns && checkpoints_complete
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oracle::Verdict;

    fn fault(kind: FaultKind, correct: bool, later_checkpoint_failures: u32) -> FaultReport {
        FaultReport {
            kind,
            turn: 2,
            detail: String::new(),
            lost: None,
            recovery: Some(RecoveryMethod::NotNeeded),
            recovery_s: 0.0,
            error: None,
            state_after: None,
            reference_state: None,
            verdict: Some(Verdict {
                fault_turn: 2,
                state_equal: correct,
                state_differences: Vec::new(),
                masked_entries: 0,
                generated_names_paired: 0,
                turns_compared: vec![3],
                turns_excluded: Vec::new(),
                turns_normalised_wall_clock: Vec::new(),
                turns_normalised_stderr_order: Vec::new(),
                turns_normalised_apt_progress: Vec::new(),
                rc_mismatches: Vec::new(),
                output_mismatches: Vec::new(),
                output_differences: Vec::new(),
                states_compared: vec![3],
                states_excluded: Vec::new(),
                states_unsettled: Vec::new(),
                state_mismatches: Vec::new(),
                later_state_differences: Vec::new(),
                recovery_possible: true,
                correct,
            }),
            later_checkpoint_failures,
        }
    }

    fn store(ok: bool) -> StoreCheck {
        StoreCheck { ok, head_turn: Some(4), manifests: 4, blobs: 9, bytes: 100, error: None }
    }

    #[test]
    fn the_verdict_decides_for_faults_that_strike_the_sandbox() {
        assert!(recovered_correctly(&fault(FaultKind::KillShim, true, 0), None));
        assert!(!recovered_correctly(&fault(FaultKind::KillShim, false, 0), Some(&store(true))));
        // A checkpoint failing later is not the recovery's fault here.
        assert!(recovered_correctly(&fault(FaultKind::RestartContainerd, true, 1), Some(&store(false))));
    }

    #[test]
    fn after_kill_crabd_later_checkpoints_and_the_store_must_be_complete() {
        assert!(recovered_correctly(&fault(FaultKind::KillCrabd, true, 0), Some(&store(true))));
        assert!(!recovered_correctly(&fault(FaultKind::KillCrabd, true, 1), Some(&store(true))));
        assert!(!recovered_correctly(&fault(FaultKind::KillCrabd, true, 0), Some(&store(false))));
        // Baselines keep no store of their own to verify.
        assert!(recovered_correctly(&fault(FaultKind::KillCrabd, true, 0), None));
        assert!(!recovered_correctly(&fault(FaultKind::KillCrabd, false, 0), Some(&store(true))));
    }

    #[test]
    fn a_run_is_charged_what_its_chain_references_when_that_is_more() {
        assert_eq!(charged_bytes(40, Some(&store(true))), 100, "deduplicated against another run's blobs");
        assert_eq!(charged_bytes(400, Some(&store(true))), 400);
        assert_eq!(charged_bytes(40, None), 40, "no store of its own");
    }

    /// One turn of a run, as the oracle sees it.
    fn turn(turn: u32, stdout: &[u8]) -> TurnOutcome {
        let exec = ExecResult {
            rc: Some(0),
            timed_out: false,
            duration: Duration::from_millis(10),
            stdout: stdout.to_vec(),
            stderr: Vec::new(),
            shell: String::new(),
        };
        TurnOutcome {
            turn,
            result: TurnResult::new(turn, exec.rc, false, &exec.stdout, &exec.stderr),
            exec,
            settle_s: 0.0,
            checkpoint_s: 0.0,
            checkpoint_bytes: 0,
            checkpoint_exported_bytes: 0,
            checkpoint_exported_to: None,
            checkpoint_class: None,
            checkpoint_error: None,
            agent_visible_delay_s: 0.0,
            off_node_before_next: None,
        }
    }

    #[test]
    fn a_replay_s_pid_is_read_from_its_container_and_image_names() {
        assert_eq!(replay_pid("replay-16867-4-every-turn"), Some(16867));
        assert_eq!(replay_pid("crab.local/replay/replay-16867-4-every-turn:turn-44"), Some(16867));
        assert_eq!(replay_pid("127.0.0.1:5000/every-turn/replay-9-12-crab:turn-3"), Some(9));
        for other in ["replay-16867", "replay-x-4-crab", "replay-1-2-", "crab.local/terminal:latest", "my-replay-app"] {
            assert_eq!(replay_pid(other), None, "{other}");
        }
    }

    /// kill-crabd has nothing to strike in a sandbox whose shim saves nothing: the baselines get
    /// no run under it (each would be a fault-free run again), crab does; every other fault
    /// runs every policy, off through chat-only's run.
    #[test]
    fn kill_crabd_runs_only_the_policies_whose_shim_uses_crabd() {
        use PolicyKind::{ChatOnly, Crab, EveryTurn, Off};
        let why = "its shim saves nothing and never starts or uses crabd";
        let not_run = |policies: &[PolicyKind]| -> Vec<NotRun> {
            policies.iter().map(|policy| NotRun { policy: *policy, why: why.to_string() }).collect()
        };
        assert_eq!(
            plan(&PolicyKind::ALL, FaultKind::KillCrabd),
            Plan { runs: vec![Crab], off_from_chat_only: false, not_run: not_run(&[Off, ChatOnly, EveryTurn]) }
        );
        assert_eq!(
            plan(&[Off, Crab], FaultKind::KillCrabd),
            Plan { runs: vec![Crab], off_from_chat_only: false, not_run: not_run(&[Off]) }
        );
        for fault in FaultKind::ALL.into_iter().filter(|fault| *fault != FaultKind::KillCrabd) {
            assert_eq!(
                plan(&PolicyKind::ALL, fault),
                Plan { runs: vec![ChatOnly, EveryTurn, Crab], off_from_chat_only: true, not_run: Vec::new() },
                "{fault}"
            );
            assert_eq!(
                plan(&[Off, EveryTurn], fault),
                Plan { runs: vec![Off, EveryTurn], off_from_chat_only: false, not_run: Vec::new() },
                "{fault}"
            );
        }
    }

    /// off's report from chat-only's run: the same sandbox judged as lost where it had to be
    /// brought back, and as chat-only's where it kept running.
    #[test]
    fn off_is_chat_only_s_run_judged_as_lost_where_it_had_to_recover() {
        assert!(shares_off_with_chat_only(&PolicyKind::ALL));
        assert!(!shares_off_with_chat_only(&[PolicyKind::Off, PolicyKind::Crab]));
        assert!(!shares_off_with_chat_only(&[PolicyKind::ChatOnly, PolicyKind::EveryTurn]));

        // A trace whose second turn needs nothing the first left: a fresh sandbox gets it right.
        let reference_run = || ReferenceRun {
            results: vec![turn(1, b"").result, turn(2, b"ok").result],
            fingerprints: vec![Fingerprint::default(), Fingerprint::default()],
        };
        let reference = Reference::new(vec![reference_run(), reference_run()]).unwrap();
        let file = std::path::Path::new("trace.jsonl");
        for (kind, method, off_correct) in [
            (FaultKind::KillProcesses, RecoveryMethod::BaseImage, false),
            (FaultKind::NodeLoss, RecoveryMethod::BaseImage, false),
            (FaultKind::RestartContainerd, RecoveryMethod::NotNeeded, true),
        ] {
            let outcome = RunOutcome {
                turns: vec![turn(1, b""), turn(2, b"ok")],
                initial: None,
                fingerprints: vec![Fingerprint::default(), Fingerprint::default()],
                fault: Some(FaultOutcome {
                    kind,
                    turn: 1,
                    detail: String::new(),
                    lost: None,
                    recovery_s: 0.1,
                    result: Ok(Recovered {
                        method: method.clone(),
                        possible: true,
                        state_after: Fingerprint::default(),
                    }),
                }),
                run_time: Duration::from_secs(1),
                store: None,
                pushed_note: None,
            };
            let chat_only = policy_report(PolicyKind::ChatOnly, Some(&reference), &outcome, file).unwrap();
            let off = policy_report(PolicyKind::Off, Some(&reference), &outcome, file).unwrap();
            assert_eq!(chat_only.recovered_correctly, Some(true), "{kind}");
            assert_eq!(off.recovered_correctly, Some(off_correct), "{kind}");
            assert_eq!(off.policy, PolicyKind::Off);
            assert_eq!(off.fault.unwrap().verdict.unwrap().recovery_possible, off_correct, "{kind}");
        }
    }

    #[test]
    fn a_failed_recovery_is_never_correct() {
        let mut failed = fault(FaultKind::NodeLoss, true, 0);
        failed.verdict = None;
        failed.error = Some("no checkpoint".into());
        assert!(!recovered_correctly(&failed, None));
    }
}
