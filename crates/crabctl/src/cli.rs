//! `crabctl` subcommands over checkpoints, defined here so the binary only
//! dispatches. Every command takes `--json`.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use serde::Serialize;

use super::{Ctl, Result};
use crab_containerd::Ctr;
use crab_store::RetentionPolicy;

#[derive(Args, Debug)]
pub struct Common {
    /// crab's state directory (the checkpoint store). Default: `[checkpoint] state_dir` of the
    /// crab config the shims read ($CRAB_CONFIG, else /etc/crab/crab.toml, else /var/lib/crab).
    #[arg(long, env = "CRAB_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// containerd's socket. Default: $CRAB_CTRD_SOCK, else $CONTAINERD_ADDRESS (as ctr and
    /// nerdctl read it), else /run/containerd/containerd.sock.
    #[arg(long, short = 'a')]
    pub address: Option<PathBuf>,
    /// The containerd namespace of the sandbox (its chain and turn log are that namespace's).
    /// Default: $CRAB_NS, else $CONTAINERD_NAMESPACE (as ctr and nerdctl read it), else `default`.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// containerd's own default socket, where crabctl looks when nothing names another.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// The namespace `ctr` and nerdctl use when none is named.
pub const CONTAINERD_NAMESPACE: &str = "default";

/// The first of: the flag's value, then each variable of `vars` that is set and not empty
/// (crab's own first: a test or script that points crab at one containerd may inherit
/// `CONTAINERD_*` naming another), then `default`.
fn flag_env_or(flag: Option<String>, vars: &[&str], env: impl Fn(&str) -> Option<String>, default: &str) -> String {
    flag.or_else(|| vars.iter().find_map(|var| env(var).filter(|value| !value.is_empty())))
        .unwrap_or_else(|| default.to_string())
}

impl Common {
    /// The containerd socket crabctl asks (see `--address`).
    pub fn address(&self) -> PathBuf {
        let flag = self.address.as_ref().map(|p| p.display().to_string());
        let env = |var: &str| std::env::var(var).ok();
        flag_env_or(flag, &["CRAB_CTRD_SOCK", "CONTAINERD_ADDRESS"], env, CONTAINERD_SOCKET).into()
    }

    /// The containerd namespace crabctl acts in (see `--namespace`).
    pub fn namespace(&self) -> String {
        let env = |var: &str| std::env::var(var).ok();
        flag_env_or(self.namespace.clone(), &["CRAB_NS", "CONTAINERD_NAMESPACE"], env, CONTAINERD_NAMESPACE)
    }

    /// The store the shims of this host write to, unless told otherwise.
    pub fn state_dir(&self) -> Result<PathBuf> {
        match &self.state_dir {
            Some(dir) => Ok(dir.clone()),
            None => crab_config::Config::load(None)
                .map(|config| config.checkpoint.state_dir)
                .map_err(|e| super::CtlError::Invalid(format!("{e} (or give --state-dir)"))),
        }
    }
}

/// `crabctl config`: the configuration the shims of this host read, with every default filled
/// in, so that scripts ask crab for a setting (`crabctl config --json | jq -r .node.socket`)
/// instead of parsing crab.toml and repeating its defaults.
#[derive(Args, Debug)]
pub struct ConfigArgs {
    /// The config file. Default: $CRAB_CONFIG, else /etc/crab/crab.toml (absent: the defaults),
    /// as the shims find it when containerd passes them no `ConfigPath`.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print JSON (the file's tables and keys) instead of TOML.
    #[arg(long)]
    pub json: bool,
}

impl ConfigArgs {
    pub fn run(&self) -> Result<()> {
        let config = crab_config::Config::load(self.config.as_deref())?;
        if self.json {
            print(true, &config, |_| String::new());
        } else {
            print!("{}", config.to_toml()?);
        }
        Ok(())
    }
}

#[derive(Subcommand, Debug)]
pub enum CheckpointCommand {
    /// The turns of a sandbox: class, reasons, checkpoint, bytes.
    Turns {
        container: String,
        #[command(flatten)]
        common: Common,
    },
    /// The checkpoints of a sandbox's chain, newest first.
    Checkpoints {
        container: String,
        #[command(flatten)]
        common: Common,
    },
    /// Verifies every blob of a sandbox's chain (or of all chains).
    Verify {
        container: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Drops old checkpoints and unreferenced blobs, of every namespace (blobs are shared);
    /// a retired chain (`<id>@<n>`, left by a new container that reused its id) goes once
    /// newer checkpoints of its id fill the window.
    ///
    /// It also asks containerd (CRAB_CTRD_SOCK, else CONTAINERD_ADDRESS) which containers it
    /// has: the chains of those it removed are dropped `--keep-removed` seconds after the first
    /// GC that found them gone. Only namespaces that containerd has are judged; when it does
    /// not answer, those chains are left alone and the report says why.
    Gc {
        /// Checkpoints kept per sandbox.
        #[arg(long, default_value_t = 16)]
        keep: usize,
        /// Seconds a removed container's chain is kept. Default: `[checkpoint] keep_removed_s`.
        #[arg(long)]
        keep_removed: Option<u64>,
        /// Do not ask containerd: collect by `--keep` only.
        #[arg(long)]
        no_containerd: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Brings a crashed sandbox back from its latest checkpoint.
    Recover {
        container: String,
        /// The sandbox's image, when containerd no longer knows the sandbox (node loss).
        #[arg(long)]
        image: Option<String>,
        /// Recover on this node from a registry: `<registry>/<prefix>/<namespace>/<sandbox>[:turn-N]`
        /// (default: the newest turn there), as `crabctl push` printed it. Pulls only what the
        /// local store lacks; the sandbox must have no chain here yet.
        #[arg(long)]
        from: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Pushes every checkpointed turn of a sandbox the registry of `[remote]` lacks, as
    /// `turn-N` tags of `<prefix>/<namespace>/<sandbox>`.
    Push {
        container: String,
        #[command(flatten)]
        common: Common,
    },
    /// Moves a sandbox off this node: ends its open turn (the final checkpoint), pushes every
    /// turn the registry lacks, and prints the `crabctl recover --from` line that restores it on
    /// another node. The sandbox keeps running here; nothing local is removed.
    Migrate {
        container: String,
        /// Registry prefix (`<registry>/<path>`); default: `[remote] prefix` of crab.toml.
        #[arg(long)]
        to: Option<String>,
        /// Give up (saying what is not off the node) after this long: 90s, 2m, 1500ms.
        /// Default: `[remote] drain_deadline_ms` of crab.toml (90s).
        #[arg(long)]
        deadline: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Spot drain: `migrate` for every crab sandbox containerd has in the namespace (or in
    /// all of them), most turns not yet off the node first, all within the deadline; prints
    /// per sandbox the turn safely off the node or why not. Exits non-zero unless every
    /// sandbox's newest turn is.
    Drain {
        /// The whole drain's bound: 90s, 2m, 1500ms. Default: `[remote] drain_deadline_ms` of
        /// crab.toml (90s).
        #[arg(long)]
        deadline: Option<String>,
        /// Every namespace of containerd, not just `--namespace`'s: the node's drain as it
        /// shuts down (`shim-config/crab-drain.service`).
        #[arg(long, short = 'A')]
        all_namespaces: bool,
        /// Registry prefix; default: `[remote] prefix` of crab.toml.
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Puts a sandbox back to turn N, in place.
    Rollback {
        container: String,
        #[arg(long)]
        turn: u64,
        #[command(flatten)]
        common: Common,
    },
    /// Acts on a sandbox's turns: `mark` ends the current turn (it is
    /// checkpointed) and begins the next.
    Turn {
        container: String,
        action: TurnAction,
        #[command(flatten)]
        common: Common,
    },
    /// Starts a new sandbox from another's turn N; the source keeps running.
    Fork {
        container: String,
        #[arg(long)]
        turn: u64,
        /// Id of the new sandbox.
        #[arg(long = "as")]
        new_id: String,
        /// Fork on this node from a registry: the source's repository
        /// `<registry>/<prefix>/<namespace>/<sandbox>` (`:turn-N` optional, it must be `--turn`).
        /// Its chain is pulled under the source's name unless the local store has that turn.
        #[arg(long)]
        from: Option<String>,
        /// The source's image, when the registry's artifact names none.
        #[arg(long)]
        image: Option<String>,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum TurnAction {
    /// End the current turn and begin the next.
    Mark,
}

fn print<T: Serialize>(json: bool, value: &T, table: impl FnOnce(&T) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(value).expect("serialisable"));
    } else {
        print!("{}", table(value));
    }
}

impl CheckpointCommand {
    fn common(&self) -> &Common {
        match self {
            Self::Turns { common, .. }
            | Self::Checkpoints { common, .. }
            | Self::Verify { common, .. }
            | Self::Gc { common, .. }
            | Self::Recover { common, .. }
            | Self::Push { common, .. }
            | Self::Migrate { common, .. }
            | Self::Drain { common, .. }
            | Self::Rollback { common, .. }
            | Self::Turn { common, .. }
            | Self::Fork { common, .. } => common,
        }
    }

    pub async fn run(self) -> Result<()> {
        let common = self.common();
        let json = common.json;
        let namespace = common.namespace();
        crab_store::validate_namespace(&namespace)?;
        let ctr = Ctr::new(common.address(), namespace);
        let ctl = Ctl::open(&common.state_dir()?, ctr)?;
        match &self {
            Self::Turns { container, .. } => print(json, &turn_rows(&ctl, container)?, |turns| {
                // A chain that starts from another's checkpoint (a fork, a kubelet replacement).
                let mut out = match ctl.origin(container) {
                    Ok(Some(origin)) => format!("{origin}\n"),
                    Ok(None) => String::new(),
                    Err(e) => format!("origin unknown: {e}\n"),
                };
                out += &format!(
                    "{:>5} {:<6} {:<6} {:>3} {:>10} {:>9} {:>10} {:>8}  {}\n",
                    "turn", "source", "class", "ext", "ckpt", "bytes", "ckpt ms", "off-node", "reasons"
                );
                let lag = turns.iter().filter(|t| t.off_node == Some(false)).count();
                for row in turns {
                    let t = &row.record;
                    out += &format!(
                        "{:>5} {:<6} {:<6} {:>3} {:>10} {:>9} {:>10.1} {:>8}  {}\n",
                        t.turn,
                        t.source,
                        format!("{:?}", t.class).to_lowercase(),
                        if t.external { "yes" } else { "" },
                        t.checkpoint_turn.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                        t.bytes_written,
                        t.checkpoint_ms,
                        match row.off_node {
                            Some(true) => "yes",
                            Some(false) => "no",
                            None => "",
                        },
                        turn_reasons(t)
                    );
                }
                if turns.iter().any(|t| t.off_node.is_some()) {
                    out += &format!("replication lag: {lag} checkpointed turns not yet in the registry\n");
                }
                out
            }),
            Self::Checkpoints { container, .. } => print(json, &ctl.checkpoints(container)?, |rows| {
                let mut out = format!("{:>5} {:<10} {:>8} {:<6} {}\n", "turn", "class", "entries", "images", "id");
                for r in rows {
                    let id = match r.superseded_by {
                        Some(by) => format!("-> turn {by} (dropped before it was written)"),
                        None => r.id[..16].to_string(),
                    };
                    out += &format!(
                        "{:>5} {:<10} {:>8} {:<6} {}\n",
                        r.turn,
                        r.class,
                        r.fs_entries,
                        if r.has_images { "yes" } else { "" },
                        id
                    );
                }
                out
            }),
            Self::Verify { container, .. } => {
                let rows = ctl.verify(container.as_deref())?;
                let failed = rows.iter().any(|r| !r.ok);
                print(json, &rows, |rows| {
                    rows.iter()
                        .map(|r| match &r.error {
                            None => format!(
                                "{}: ok (head turn {}, {} manifests, {} blobs, {} bytes)\n",
                                r.container,
                                r.head_turn.unwrap_or(0),
                                r.manifests,
                                r.blobs,
                                r.bytes
                            ),
                            Some(e) => format!("{}: BROKEN: {e}\n", r.container),
                        })
                        .collect()
                });
                if failed {
                    return Err(super::CtlError::Invalid("verification failed".into()));
                }
            }
            Self::Gc { keep, keep_removed, no_containerd, .. } => {
                let store = ctl.store.clone();
                let keep = (*keep).max(1);
                let keep_removed = match keep_removed {
                    Some(secs) => *secs,
                    None => crab_config::Config::load(None)?.checkpoint.keep_removed_s,
                };
                let (census, containerd) = if *no_containerd {
                    (None, "not asked (--no-containerd)".to_string())
                } else {
                    match ctl.container_census(std::time::Duration::from_secs(keep_removed)).await {
                        Ok(census) => (Some(census), format!("asked at {}", ctl.ctr.socket().display())),
                        Err(e) => {
                            let why = format!("did not answer, removed containers' chains left alone: {e}");
                            tracing::warn!("{why}");
                            (None, why)
                        }
                    }
                };
                let report = tokio::task::block_in_place(move || {
                    store.gc_with(&RetentionPolicy { keep_last: keep }, census.as_ref())
                })?;
                #[derive(Serialize)]
                struct Gc {
                    manifests_removed: u64,
                    blobs_removed: u64,
                    packs_removed: u64,
                    packs_rewritten: u64,
                    bytes_freed: u64,
                    snapshots_written: u64,
                    tmp_files_removed: u64,
                    retired_removed: u64,
                    removed_marked: u64,
                    removed_dropped: u64,
                    orphaned_kept_removed: u64,
                    containerd: String,
                }
                let gc = Gc {
                    manifests_removed: report.manifests_removed,
                    blobs_removed: report.blobs_removed,
                    packs_removed: report.packs_removed,
                    packs_rewritten: report.packs_rewritten,
                    bytes_freed: report.bytes_freed,
                    snapshots_written: report.snapshots_written,
                    tmp_files_removed: report.tmp_files_removed,
                    retired_removed: report.retired_removed,
                    removed_marked: report.removed_marked,
                    removed_dropped: report.removed_dropped,
                    orphaned_kept_removed: report.orphaned_kept_removed,
                    containerd,
                };
                print(json, &gc, |g| {
                    format!(
                        "removed {} manifests, {} blobs, {} packs ({} rewritten; {} bytes), {} tmp files, {} retired chains; {} snapshots written\n\
                         containers removed from containerd: {} newly found, {} sandboxes dropped (containerd {})\n\
                         kept image copies of stores that are gone: {} removed\n",
                        g.manifests_removed,
                        g.blobs_removed,
                        g.packs_removed,
                        g.packs_rewritten,
                        g.bytes_freed,
                        g.tmp_files_removed,
                        g.retired_removed,
                        g.snapshots_written,
                        g.removed_marked,
                        g.removed_dropped,
                        g.containerd,
                        g.orphaned_kept_removed
                    )
                });
            }
            Self::Recover { container, image, from: None, .. } => {
                let r = ctl.recover(container, image.as_deref()).await?;
                print(json, &r, restore_line);
            }
            Self::Recover { container, image, from: Some(from), .. } => {
                let r = ctl.recover_from(container, from, image.as_deref()).await?;
                print(json, &r, remote_restore_line);
            }
            Self::Push { container, .. } => {
                let r = ctl.push(container).await?;
                print(json, &r, |r| {
                    let mut out = String::new();
                    for p in &r.pushed {
                        out += &format!(
                            "{}: {} new objects, {} bytes sent, {} blobs mounted, {} present\n",
                            p.reference, p.new_objects, p.bytes_uploaded, p.blobs_mounted, p.blobs_present
                        );
                    }
                    out += &format!(
                        "{}: {} turns pushed, {} there already, head turn {} in {}:turn-{} ({} bytes sent; the turns wrote {} locally) in {:.1} ms\n",
                        r.container,
                        r.pushed.len(),
                        r.already.len(),
                        r.head_turn,
                        r.repository,
                        r.head_turn,
                        r.bytes_uploaded,
                        r.local_bytes_written,
                        r.elapsed_ms
                    );
                    out
                });
            }
            Self::Migrate { container, to, deadline, .. } => {
                let end = std::time::Instant::now() + crate::remote::deadline_or_configured(deadline.as_deref())?;
                let r = ctl.migrate(container, to.as_deref(), end).await?;
                print(json, &r, crate::remote::migrate_line);
            }
            Self::Drain { deadline, to, all_namespaces, .. } => {
                let deadline = crate::remote::deadline_or_configured(deadline.as_deref())?;
                let r = ctl.drain(to.as_deref(), deadline, *all_namespaces).await?;
                print(json, &r, |r| {
                    let mut out: String = r.sandboxes.iter().map(crate::remote::migrate_line).collect();
                    out += &format!(
                        "drained {} sandboxes of {} in {:.0} ms (deadline {:.0} ms), {} bytes sent\n",
                        r.sandboxes.len(),
                        match &r.namespaces[..] {
                            [one] => format!("namespace {one}"),
                            all => format!("namespaces {}", all.join(", ")),
                        },
                        r.elapsed_ms,
                        r.deadline_ms,
                        r.bytes_uploaded
                    );
                    out
                });
                if !r.complete() {
                    return Err(super::CtlError::Invalid(
                        "not every sandbox's newest turn is off the node (see above)".into(),
                    ));
                }
            }
            Self::Rollback { container, turn, .. } => {
                let r = ctl.rollback(container, *turn).await?;
                print(json, &r, restore_line);
            }
            Self::Turn { container, action: TurnAction::Mark, .. } => {
                let r = ctl.mark_turn(container).await?;
                print(json, &r, |r| match &r.ended {
                    Some(t) => format!(
                        "{}: turn {} ended ({}, checkpoint {}) in {:.1} ms\n",
                        r.container,
                        t.turn,
                        format!("{:?}", t.class).to_lowercase(),
                        t.checkpoint_turn.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                        r.elapsed_ms
                    ),
                    None => format!("{}: no turn was open\n", r.container),
                });
            }
            Self::Fork { container, turn, new_id, from: None, .. } => {
                let r = ctl.fork(container, *turn, new_id).await?;
                print(json, &r, restore_line);
            }
            Self::Fork { container, turn, new_id, from: Some(from), image, .. } => {
                let r = ctl.fork_from(container, *turn, new_id, from, image.as_deref()).await?;
                print(json, &r, remote_restore_line);
            }
        }
        Ok(())
    }
}

/// A turn's reasons column: its reasons (which say what a restore of it lacks when an exec went
/// through the runtime), then why each failed dump attempt failed.
fn turn_reasons(t: &crab_store::turns::TurnRecord) -> String {
    let attempts =
        t.dump_failures.iter().enumerate().map(|(i, cause)| format!("dump attempt {} failed: {cause}", i + 1));
    // The engine says it in the reasons; a record that lists a runtime exec without saying so still shows it.
    let runtime_execs = t.runtime_execs.iter().map(ToString::to_string).filter(|said| !t.reasons.contains(said));
    let shells = t.shells.iter().map(|s| {
        let listed = if s.listed { ", listed" } else { "" };
        let unvouched = s.unvouched.as_deref().map(|why| format!(", cannot vouch: {why}")).unwrap_or_default();
        format!("shell {} asked: {:.1} ms, {} bytes of answer{listed}{unvouched}", s.exec_id, s.ms, s.answer_bytes)
    });
    t.reasons.iter().cloned().chain(runtime_execs).chain(attempts).chain(shells).collect::<Vec<_>>().join("; ")
}

/// A turn with whether its checkpoint is in the registry (`None`: the turn has no checkpoint
/// of its own, or the sandbox was never pushed).
#[derive(Serialize)]
struct TurnRow {
    #[serde(flatten)]
    record: crab_store::turns::TurnRecord,
    #[serde(skip_serializing_if = "Option::is_none")]
    off_node: Option<bool>,
}

fn turn_rows(ctl: &Ctl, container: &str) -> Result<Vec<TurnRow>> {
    let pushed = ctl.pushed_turns(container)?;
    Ok(ctl
        .turns(container)?
        .into_iter()
        .map(|record| {
            let own = record.checkpoint_turn == Some(record.turn);
            let off_node = pushed.as_ref().filter(|_| own).map(|p| p.contains(&record.turn));
            TurnRow { record, off_node }
        })
        .collect())
}

fn remote_restore_line(r: &crate::remote::RemoteRestoreReport) -> String {
    let pull = match &r.pull {
        Some(p) => format!(
            "pulled {} ({} manifests, {} blobs, {} bytes, {} objects, {} packs held already) in {:.1} ms; ",
            p.reference,
            p.manifests_pulled,
            p.blobs_pulled,
            p.bytes_pulled,
            p.objects_received,
            p.packs_skipped,
            p.elapsed_ms
        ),
        None => "the local store held the chain; ".into(),
    };
    format!("{pull}{}", restore_line(&r.restore))
}

fn restore_line(r: &super::RestoreReport) -> String {
    format!(
        "{}: {} from {} at turn {} (checkpoint {}){} in {:.1} ms\n",
        r.container,
        r.mode,
        r.from,
        r.turn,
        r.checkpoint_turn.map(|t| t.to_string()).unwrap_or_else(|| "none: image".into()),
        r.changed_paths.map(|n| format!(", {n} paths")).unwrap_or_default(),
        r.elapsed_ms
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_then_crabs_variable_then_containerds_then_the_default() {
        let env = |set: &'static [(&'static str, &'static str)]| {
            move |var: &str| set.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string())
        };
        let vars = ["CRAB_NS", "CONTAINERD_NAMESPACE"];
        let both = env(&[("CRAB_NS", "crab"), ("CONTAINERD_NAMESPACE", "k8s.io")]);
        assert_eq!(flag_env_or(Some("a".into()), &vars, both, "default"), "a");
        assert_eq!(flag_env_or(None, &vars, both, "default"), "crab");
        let containerds = env(&[("CONTAINERD_NAMESPACE", "k8s.io")]);
        assert_eq!(flag_env_or(None, &vars, containerds, "default"), "k8s.io");
        let empty = env(&[("CRAB_NS", ""), ("CONTAINERD_NAMESPACE", "k8s.io")]);
        assert_eq!(flag_env_or(None, &vars, empty, "default"), "k8s.io", "an empty variable is unset");
        assert_eq!(flag_env_or(None, &vars, env(&[]), "default"), "default");
    }
}
