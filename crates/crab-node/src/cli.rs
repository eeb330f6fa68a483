//! `crabctl node`: what the node's crabd is doing, and eviction marks.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::NodeError;

#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(subcommand)]
    action: Option<NodeAction>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// crabd's socket (default: node.socket of the crab config, else /run/crab/crabd.sock).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum NodeAction {
    /// Watched containers; per sandbox the commits waiting for bandwidth, lag, bytes, rate (the default).
    Status,
    /// Mark a sandbox for eviction: its commits go before others (aged ones excepted).
    Evict {
        sandbox: String,
        /// Remove the mark instead.
        #[arg(long)]
        clear: bool,
    },
}

pub async fn run(args: NodeArgs) -> Result<(), NodeError> {
    let socket = match args.socket {
        Some(socket) => socket,
        None => crab_config::Config::load(None).map(|c| c.node.socket).unwrap_or_else(|_| super::DEFAULT_SOCKET.into()),
    };
    match args.action.unwrap_or(NodeAction::Status) {
        NodeAction::Status => {
            let status = super::status_report(&socket).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&status).expect("status serializes"));
            } else {
                print!("{}", super::render_status(&status));
            }
        }
        NodeAction::Evict { sandbox, clear } => {
            super::set_eviction(&socket, &sandbox, !clear).await?;
            if args.json {
                println!("{}", serde_json::json!({ "sandbox": sandbox, "evicting": !clear }));
            } else {
                println!("{sandbox}: {}", if clear { "eviction mark cleared" } else { "marked for eviction" });
            }
        }
    }
    Ok(())
}
