//! `crab-replay`: arguments to [`ReplayOptions`], reports to stdout.

use std::path::PathBuf;

use clap::Args;

use super::node::NodeB;
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
    /// kill-shim, restart-containerd, kill-crabd, containerd-state-loss, node-loss. Each fault
    /// gets its own policy runs; the fault-free reference runs are shared. node-loss needs node
    /// B (--node-b-socket, --node-b-config).
    #[arg(long, value_delimiter = ',', default_value = "kill-processes")]
    fault: Vec<FaultKind>,
    /// Inject the fault after this turn (default: the middle turn).
    #[arg(long, conflicts_with_all = ["fault_random", "fault_last"])]
    fault_turn: Option<u32>,
    /// Draw the fault turn from this seed (and the trace name).
    #[arg(long, conflicts_with = "fault_last")]
    fault_random: Option<u64>,
    /// Inject the fault after each trace's last turn (every turn runs before it).
    #[arg(long)]
    fault_last: bool,
    /// Scale of the recorded think times: 0 replays back to back, 1 waits in real time.
    #[arg(long, default_value_t = 0.0)]
    think_scale: f64,
    /// containerd runtime of the sandboxes.
    #[arg(long, default_value = "io.containerd.crab.v2")]
    runtime: String,
    /// Fault-free reference runs: 2 or more find and exclude nondeterministic turns and files
    /// (a turn whose output depends on timing may agree in two runs by chance). 0, with
    /// `--fault none` only: no reference and no oracle, the policies' costs alone (a benchmark's
    /// runs, which the sandbox walks of the oracle after every turn would load).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=crate::runner::MAX_REFERENCE_RUNS as i64))]
    ref_runs: u8,
    /// Least seconds between the starts of two reference runs, so that
    /// output showing the time of day differs between them (and is excluded)
    /// even where the normaliser does not replace it. The first policy runs
    /// (up to 3) use that time.
    #[arg(long, default_value_t = 61.0)]
    ref_spacing: f64,
    /// Shell command that starts containerd again after restart-containerd killed it
    /// (for the private one: `scripts/containerd start` with the same CRAB_CTRD_* environment).
    #[arg(long, env = "CRAB_CTRD_START_CMD", value_name = "CMD")]
    containerd_start: Option<String>,
    /// Where every-turn keeps its checkpoint archives, outside containerd's
    /// state, in runs without a registry (in node-loss runs it pushes to node
    /// B's registry instead); one subdirectory per sandbox, removed after its run.
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
    /// node-loss: node B's containerd socket (a second containerd on this machine, with the
    /// images of the traces); the sandbox comes back there.
    #[arg(long, env = "CRAB_REPLAY_NODE_B_SOCK", value_name = "SOCKET", requires = "node_b_config")]
    node_b_socket: Option<PathBuf>,
    /// node-loss: node B's crab config (its own store, kept images, runc root and crabd
    /// socket); its `[remote]` names the registry node A's sandboxes push to.
    #[arg(long, env = "CRAB_REPLAY_NODE_B_CONFIG", value_name = "FILE", requires = "node_b_socket")]
    node_b_config: Option<PathBuf>,
    /// The crabctl run on node B (default: the one beside crab-replay).
    #[arg(long, env = "CRAB_CTL", value_name = "FILE")]
    crabctl: Option<PathBuf>,
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

impl ReplayArgs {
    /// After which turn the fault strikes (the three flags exclude each other).
    fn fault_turn(&self) -> FaultTurn {
        match (self.fault_turn, self.fault_random, self.fault_last) {
            (Some(turn), _, _) => FaultTurn::Fixed(turn),
            (None, Some(seed), _) => FaultTurn::Random(seed),
            (None, None, true) => FaultTurn::Last,
            (None, None, false) => FaultTurn::Middle,
        }
    }
}

pub async fn run(args: ReplayArgs) -> Result<(), Box<dyn std::error::Error>> {
    let fault_turn = args.fault_turn();
    let mut daemons = Daemons::from_env();
    daemons.containerd_start = args.containerd_start.filter(|command| !command.trim().is_empty());
    let ctr = Ctr::from_env();
    if let (Some(socket), Some(config)) = (&args.node_b_socket, &args.node_b_config) {
        let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|dir| dir.join("crabctl")));
        let crabctl = args.crabctl.or(beside).ok_or("no crabctl for node B: give --crabctl")?;
        daemons.node_b = Some(NodeB::new(socket, ctr.namespace(), config, &crabctl)?);
    }
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
        ctr,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ReplayArgs,
    }

    fn fault_turn(flags: &[&str]) -> Result<FaultTurn, clap::Error> {
        Cli::try_parse_from([&["crab-replay", "t.jsonl"], flags].concat()).map(|cli| cli.args.fault_turn())
    }

    #[test]
    fn the_fault_turn_is_the_middle_a_fixed_one_a_drawn_one_or_the_last() {
        assert_eq!(fault_turn(&[]).unwrap(), FaultTurn::Middle);
        assert_eq!(fault_turn(&["--fault-turn", "3"]).unwrap(), FaultTurn::Fixed(3));
        assert_eq!(fault_turn(&["--fault-random", "7"]).unwrap(), FaultTurn::Random(7));
        assert_eq!(fault_turn(&["--fault-last"]).unwrap(), FaultTurn::Last);
        for both in [["--fault-last", "--fault-turn=3"], ["--fault-last", "--fault-random=7"]] {
            let error = fault_turn(&both).unwrap_err();
            assert_eq!(error.kind(), clap::error::ErrorKind::ArgumentConflict, "{both:?}: {error}");
        }
    }
}
