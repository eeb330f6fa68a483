//! `crab-replay`: agent turn traces replayed in containerd sandboxes, with a fault and a
//! recovery, under recovery policies (the evaluation's harness; `scripts/eval` runs it).
//! Kept out of `crabctl`: it kills containerd, shims and crabd on purpose.

use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "crab-replay",
    about = "Replay agent turn traces in containerd sandboxes, with a fault and recovery, under recovery policies",
    version
)]
struct Cli {
    #[command(flatten)]
    args: crab_replay::cli::ReplayArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    crab_config::logging::init_stderr();
    match crab_replay::cli::run(Cli::parse().args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("crab-replay: {error}");
            ExitCode::FAILURE
        }
    }
}
