//! `crabctl`: crab's command line. Each subcommand is a thin adapter from
//! arguments to a library function.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use crab::containerd::ctr::Ctr;
use crab::replay::{self, FaultKind, FaultTurn, PolicyKind, ReplayOptions};

#[derive(Parser)]
#[command(name = "crabctl", about = "Crab's command line", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay agent turn traces in containerd sandboxes, with a fault and recovery, under recovery policies.
    Replay(ReplayArgs),
    #[command(flatten)]
    Checkpoint(crab::ctl::cli::CheckpointCommand),
    /// The node engine (crabd): status, eviction marks.
    Node(crab::node::cli::NodeArgs),
}

#[derive(Args)]
struct ReplayArgs {
    /// Trace files (JSONL: a header line, then one line per turn).
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Recovery policies to compare, comma-separated or repeated: off, chat-only, every-turn.
    #[arg(long, value_delimiter = ',', default_value = "every-turn")]
    policy: Vec<PolicyKind>,
    /// The fault injected after the fault turn.
    #[arg(long, default_value = "kill-processes")]
    fault: FaultKind,
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
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
}

async fn replay_command(args: ReplayArgs) -> Result<(), Box<dyn std::error::Error>> {
    let fault_turn = match (args.fault_turn, args.fault_random) {
        (Some(turn), _) => FaultTurn::Fixed(turn),
        (None, Some(seed)) => FaultTurn::Random(seed),
        (None, None) => FaultTurn::Middle,
    };
    let mut policies = Vec::new();
    for policy in args.policy {
        if !policies.contains(&policy) {
            policies.push(policy);
        }
    }
    let options = ReplayOptions {
        traces: args.traces,
        policies,
        fault: args.fault,
        fault_turn,
        think_scale: args.think_scale,
        runtime: args.runtime,
        ref_runs: args.ref_runs,
        ctr: Ctr::from_env(),
    };
    let reports = replay::replay(&options).await?;
    let json = serde_json::to_string_pretty(&reports)?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, format!("{json}\n"))
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", replay::report::render(&reports));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    crab::logging::init_stderr();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay_command(args).await,
        Command::Checkpoint(command) => command.run().await.map_err(Into::into),
        Command::Node(args) => crab::node::cli::run(args).await.map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("crabctl: {error}");
            ExitCode::FAILURE
        }
    }
}
