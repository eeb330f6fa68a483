//! `crabd`: the node engine. One per host: it owns the inspector's BPF
//! programs and the commit bandwidth shared by every crab shim, and serves
//! them on a root-only Unix socket (see `crab::node`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use crab_config::Config;
use crab_node::BucketConfig;
use crab_node::server::{ServerOptions, run};

#[derive(Parser)]
#[command(name = "crabd", about = "Crab's node engine: the node's inspector and commit bandwidth", version)]
struct Cli {
    /// crab's configuration file (its [node] table); default /etc/crab/crab.toml when present.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Socket to serve (overrides node.socket).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Commit bandwidth of the node in MiB/s (overrides node.rate_mib_per_s).
    #[arg(long, conflicts_with = "rate_kib_per_s")]
    rate_mib_per_s: Option<u64>,
    /// Token bucket burst in MiB (overrides node.burst_mib).
    #[arg(long, conflicts_with = "burst_kib")]
    burst_mib: Option<u64>,
    /// Commit bandwidth in KiB/s, for buckets below 1 MiB/s (tests, contention benchmarks).
    #[arg(long)]
    rate_kib_per_s: Option<u64>,
    /// Token bucket burst in KiB (the largest draw is capped at it).
    #[arg(long)]
    burst_kib: Option<u64>,
    /// Age after which a waiting commit goes first (overrides node.aging_ms).
    #[arg(long)]
    aging_ms: Option<u64>,
    /// Size of the inspector's BPF ring buffer in MiB (a power of two).
    #[arg(long, default_value_t = 16)]
    ring_buffer_mib: u32,
}

#[tokio::main]
async fn main() -> ExitCode {
    crab_config::logging::init_stderr();
    let cli = Cli::parse();
    let mut node = match Config::load(cli.config.as_deref()) {
        Ok(config) => config.node,
        Err(error) => {
            eprintln!("crabd: {error}");
            return ExitCode::FAILURE;
        }
    };
    node.socket = cli.socket.unwrap_or(node.socket);
    node.rate_mib_per_s = cli.rate_mib_per_s.unwrap_or(node.rate_mib_per_s);
    node.burst_mib = cli.burst_mib.unwrap_or(node.burst_mib);
    node.aging_ms = cli.aging_ms.unwrap_or(node.aging_ms);
    let mut bucket = BucketConfig::from_node_config(&node);
    if let Some(kib) = cli.rate_kib_per_s {
        bucket.rate_bytes_per_s = (kib << 10) as f64;
    }
    if let Some(kib) = cli.burst_kib {
        bucket.burst_bytes = kib << 10;
    }
    if bucket.rate_bytes_per_s < 1.0 || bucket.burst_bytes == 0 || !cli.ring_buffer_mib.is_power_of_two() {
        eprintln!("crabd: the rate and the burst must be at least 1 (MiB or KiB), --ring-buffer-mib a power of two");
        return ExitCode::FAILURE;
    }
    let options = ServerOptions {
        socket: node.socket.clone(),
        bucket,
        ring_buffer_bytes: cli.ring_buffer_mib << 20,
        max_effects_bytes: node.max_effects_bytes(),
    };
    match run(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "crabd failed");
            eprintln!("crabd: {error}");
            ExitCode::FAILURE
        }
    }
}
