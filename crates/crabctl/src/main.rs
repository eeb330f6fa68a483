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
    #[command(flatten)]
    Checkpoint(crabctl::cli::CheckpointCommand),
    /// The node engine (crabd): status, eviction marks.
    Node(crab_node::cli::NodeArgs),
    /// The effective crab configuration (the file the shims read, defaults filled in).
    Config(crabctl::cli::ConfigArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    crab_config::logging::init_stderr();
    let cli = Cli::parse();
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        Command::Checkpoint(command) => command.run().await.map_err(Into::into),
        Command::Node(args) => crab_node::cli::run(args).await.map_err(Into::into),
        Command::Config(args) => args.run().map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("crabctl: {error}");
            ExitCode::FAILURE
        }
    }
}
