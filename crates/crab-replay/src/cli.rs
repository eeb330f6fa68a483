//! `crab-replay`: arguments to [`ReplayOptions`], reports to stdout.

use std::path::PathBuf;

use clap::Args;

use super::{Daemons, FaultKind, FaultTurn, PolicyKind, ReplayMode, ReplayOptions, report};
use crab_containerd::Ctr;

/// every-turn's archives unless `--checkpoint-dir` says otherwise.
pub const DEFAULT_CHECKPOINT_DIR: &str = "/var/lib/crab-replay/checkpoints";

#[derive(Args)]
pub struct ReplayArgs {
    /// Trace files (JSONL: a header line, then one line per turn).
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Recovery policies to compare, comma-separated or repeated: off, chat-only, every-turn, crab.
    #[arg(long, value_delimiter = ',', default_value = "every-turn")]
    policy: Vec<PolicyKind>,
    /// Faults injected after the fault turn, comma-separated or repeated: none, kill-processes,
    /// kill-shim, restart-containerd, kill-crabd, node-loss. Each fault gets its own policy runs;
    /// the fault-free reference runs are shared.
    #[arg(long, value_delimiter = ',', default_value = "kill-processes")]
    fault: Vec<FaultKind>,
    /// Inject the fault after this turn (default: the middle turn).
    #[arg(long, conflicts_with = "fault_random")]
    fault_turn: Option<u32>,
    /// Draw the fault turn from this seed (and the trace name).
    #[arg(long)]
    fault_random: Option<u64>,
    /// Scale of the recorded think times: 0 replays back to back, 1 waits in real time.
    #[arg(long, default_value_t = 0.0)]
    think_scale: f64,
    /// containerd runtime of the sandboxes.
    #[arg(long, default_value = "io.containerd.crab.v2")]
    runtime: String,
    /// Fault-free reference runs: 2 finds and excludes nondeterministic turns and files.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    ref_runs: u8,
    /// Least seconds between the starts of the two reference runs, so that
    /// output showing the time of day differs between them (and is excluded)
    /// even where the normaliser does not replace it.
    #[arg(long, default_value_t = 61.0)]
    ref_spacing: f64,
    /// Shell command that starts containerd again after restart-containerd killed it
    /// (for the private one: `scripts/containerd start` with the same CRAB_CTRD_* environment).
    #[arg(long, env = "CRAB_CTRD_START_CMD", value_name = "CMD")]
    containerd_start: Option<String>,
    /// Where every-turn keeps its checkpoint archives, outside containerd's
    /// state (node loss spares them); one subdirectory per sandbox, removed
    /// after its run.
    #[arg(long, env = "CRAB_REPLAY_CHECKPOINT_DIR", value_name = "DIR", default_value = DEFAULT_CHECKPOINT_DIR)]
    checkpoint_dir: PathBuf,
    /// Package sources the sandboxes see read-only at /opt/crab-packages, where their images
    /// point pip and apt (scripts/build-images downloads them to $CRAB_CACHE/packages); empty:
    /// none, `pip install` and `apt-get install` fail as without a network.
    #[arg(long, env = "CRAB_REPLAY_PACKAGES", value_name = "DIR")]
    packages: Option<PathBuf>,
    /// How each command reaches the sandbox: exec (each its own `bash -c` exec), stdin (one
    /// `bash` exec session fed through its stdin), tmux (typed into a tmux session in the
    /// sandbox, whose image must have tmux).
    #[arg(long, value_enum, default_value_t = ReplayMode::Exec)]
    mode: ReplayMode,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
}

fn dedup<T: PartialEq>(items: Vec<T>) -> Vec<T> {
    let mut unique = Vec::new();
    for item in items {
        if !unique.contains(&item) {
            unique.push(item);
        }
    }
    unique
}

pub async fn run(args: ReplayArgs) -> Result<(), Box<dyn std::error::Error>> {
    let fault_turn = match (args.fault_turn, args.fault_random) {
        (Some(turn), _) => FaultTurn::Fixed(turn),
        (None, Some(seed)) => FaultTurn::Random(seed),
        (None, None) => FaultTurn::Middle,
    };
    let mut daemons = Daemons::from_env();
    daemons.containerd_start = args.containerd_start.filter(|command| !command.trim().is_empty());
    let options = ReplayOptions {
        traces: args.traces,
        policies: dedup(args.policy),
        faults: dedup(args.fault),
        fault_turn,
        think_scale: args.think_scale,
        runtime: args.runtime,
        ref_runs: args.ref_runs,
        ref_spacing: std::time::Duration::try_from_secs_f64(args.ref_spacing)
            .map_err(|_| format!("--ref-spacing must be a number of seconds >= 0, not {}", args.ref_spacing))?,
        ctr: Ctr::from_env(),
        daemons,
        checkpoint_dir: args.checkpoint_dir,
        packages: args.packages.filter(|dir| !dir.as_os_str().is_empty()),
        mode: args.mode,
    };
    let reports = super::replay(&options).await?;
    let json = serde_json::to_string_pretty(&reports)?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, format!("{json}\n"))
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", report::render(&reports));
    }
    Ok(())
}
