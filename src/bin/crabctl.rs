//! `crabctl`: crab's command line. Each subcommand is a thin adapter from
//! arguments to a library function.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "crabctl", about = "Crab's command line", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay agent turn traces in containerd sandboxes, with a fault and recovery, under recovery policies.
    Replay(crab::replay::cli::ReplayArgs),
    #[command(flatten)]
    Checkpoint(crab::ctl::cli::CheckpointCommand),
    /// The node engine (crabd): status, eviction marks.
    Node(crab::node::cli::NodeArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    crab::logging::init_stderr();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => crab::replay::cli::run(args).await,
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
