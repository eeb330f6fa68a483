//! Recovery policies: what is saved after each turn and how a sandbox comes
//! back after its processes were killed. A new policy implements
//! [`RecoveryPolicy`] and gets a [`PolicyKind`] variant.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use async_trait::async_trait;
use serde::Serialize;
use tracing::info;

use super::ReplayError;
use super::archive::ArchiveWriter;
use super::sandbox::{CheckpointImage, Sandbox, SandboxSpec, remove_container, remove_image};
use crab_containerd::Ctr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Nothing is saved; a killed sandbox is lost.
    Off,
    /// Only the chat history survives: recovery is a fresh sandbox from the base image.
    ChatOnly,
    /// `ctr c checkpoint --task --rw` after every turn, `ctr c restore` on failure.
    EveryTurn,
    /// The crab shim checkpoints what each turn changed; `crabctl recover` on failure.
    Crab,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] = [PolicyKind::Off, PolicyKind::ChatOnly, PolicyKind::EveryTurn, PolicyKind::Crab];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Off => "off",
            PolicyKind::ChatOnly => "chat-only",
            PolicyKind::EveryTurn => "every-turn",
            PolicyKind::Crab => "crab",
        }
    }

    /// What the crab shim itself should save for this policy's sandboxes
    /// (its `io.crab.policy` annotation; other runtimes ignore it). The
    /// baselines work through `ctr` alone, so the shim saves nothing.
    pub fn shim_policy(self) -> &'static str {
        match self {
            PolicyKind::Off | PolicyKind::ChatOnly | PolicyKind::EveryTurn => "off",
            PolicyKind::Crab => "crab",
        }
    }

    pub fn build(self, launch: Launch) -> Box<dyn RecoveryPolicy> {
        match self {
            PolicyKind::Off => Box::new(FreshSandbox { launch, kind: self }),
            PolicyKind::ChatOnly => Box::new(FreshSandbox { launch, kind: self }),
            PolicyKind::EveryTurn => Box::new(EveryTurn::new(launch)),
            PolicyKind::Crab => Box::new(CrabPolicy { launch }),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown policy {0:?} (expected one of: off, chat-only, every-turn, crab)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<PolicyKind, UnknownPolicy> {
        PolicyKind::ALL.into_iter().find(|kind| kind.name() == text).ok_or_else(|| UnknownPolicy(text.to_string()))
    }
}

/// Everything a policy needs to (re)create the sandbox it looks after.
#[derive(Debug, Clone)]
pub struct Launch {
    pub ctr: Ctr,
    pub container_id: String,
    pub spec: SandboxSpec,
    /// Where a policy keeps what it saves outside containerd (every-turn's
    /// archives), one subdirectory per container.
    pub checkpoint_dir: PathBuf,
}

impl Launch {
    pub async fn fresh(&self) -> Result<Sandbox, ReplayError> {
        Ok(Sandbox::create(&self.ctr, &self.container_id, &self.spec).await?)
    }
}

/// What saving after one turn cost.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TurnCost {
    /// Time the agent waits before its next turn can start.
    pub blocking_s: f64,
    /// Everything the checkpoint wrote.
    pub bytes: u64,
    /// Of `bytes`, what went outside containerd (every-turn's archive).
    pub exported_bytes: u64,
    /// The runtime's class of the turn (clean, fs, proc), where it records one.
    pub class: Option<&'static str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "method", rename_all = "kebab-case")]
pub enum RecoveryMethod {
    /// Processes and files restored from the checkpoint taken after `turn`.
    Checkpoint { turn: u32 },
    /// A new sandbox from the base image; the agent keeps only its history.
    BaseImage,
    /// The sandbox survived the fault (its task kept running): nothing to do.
    NotNeeded,
}

/// `crabctl verify` of a sandbox's checkpoint chain at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct StoreCheck {
    pub ok: bool,
    pub head_turn: Option<u64>,
    pub manifests: u64,
    pub blobs: u64,
    pub bytes: u64,
    pub error: Option<String>,
}

impl StoreCheck {
    fn failed(error: String) -> StoreCheck {
        StoreCheck { ok: false, head_turn: None, manifests: 0, blobs: 0, bytes: 0, error: Some(error) }
    }
}

pub struct Recovery {
    pub sandbox: Sandbox,
    pub method: RecoveryMethod,
    /// False when the policy cannot recover at all and the run is lost
    /// whatever the new sandbox happens to contain.
    pub possible: bool,
}

#[async_trait]
pub trait RecoveryPolicy: Send {
    fn kind(&self) -> PolicyKind;

    /// Runs after `turn` finished in `sandbox`, before the agent's next turn.
    async fn after_turn(&mut self, sandbox: &Sandbox, turn: u32) -> Result<TurnCost, ReplayError>;

    /// Brings the sandbox back after its processes were killed; `dead` is the killed one.
    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError>;

    /// The node lost containerd's state: whatever the policy kept in
    /// containerd is gone. Says what was lost, if anything.
    async fn lose_containerd_state(&mut self) -> Result<Option<String>, ReplayError> {
        Ok(None)
    }

    /// Checks what the policy stored for `container` is complete and intact,
    /// where it keeps a store of its own to check.
    async fn check_store(&mut self, _container: &str) -> Option<StoreCheck> {
        None
    }

    /// Frees what the policy stored (checkpoint images).
    async fn cleanup(&mut self) -> Result<(), ReplayError>;
}

/// `off` and `chat-only`: nothing saved, recovery from the base image.
struct FreshSandbox {
    launch: Launch,
    kind: PolicyKind,
}

#[async_trait]
impl RecoveryPolicy for FreshSandbox {
    fn kind(&self) -> PolicyKind {
        self.kind
    }

    async fn after_turn(&mut self, _sandbox: &Sandbox, _turn: u32) -> Result<TurnCost, ReplayError> {
        Ok(TurnCost::default())
    }

    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError> {
        dead.remove().await?;
        let sandbox = self.launch.fresh().await?;
        Ok(Recovery { sandbox, method: RecoveryMethod::BaseImage, possible: self.kind != PolicyKind::Off })
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        Ok(())
    }
}

/// What users of containerd have today: a full checkpoint after every turn,
/// kept off the node. `ctr c checkpoint` writes it into containerd's content
/// store (what a restore on this node uses); the checkpoint's own blobs then
/// go into an archive in a directory of the replay's own (what a user of
/// spot machines keeps on durable storage, `ctr images export` less the base
/// image), and after node loss `ctr images import` brings it back.
struct EveryTurn {
    launch: Launch,
    /// The newest checkpoint image in containerd, unless lost with it.
    image: Option<(u32, String)>,
    /// The newest checkpoint archive outside containerd.
    archive: Option<(u32, PathBuf)>,
}

impl EveryTurn {
    fn new(launch: Launch) -> EveryTurn {
        EveryTurn { launch, image: None, archive: None }
    }

    fn reference(&self, turn: u32) -> String {
        format!("crab.local/replay/{}:turn-{turn}", self.launch.container_id)
    }

    /// This sandbox's archives: one directory per container.
    fn archive_dir(&self) -> PathBuf {
        self.launch.checkpoint_dir.join(&self.launch.container_id)
    }

    /// Copies the checkpoint's blobs out of containerd into `turn-N.tar`.
    async fn export(&self, turn: u32, image: &CheckpointImage) -> Result<(PathBuf, u64), ReplayError> {
        let directory = self.archive_dir();
        let failed =
            |problem: String| ReplayError::Policy(format!("every-turn export of {}: {problem}", image.reference));
        std::fs::create_dir_all(&directory).map_err(|error| failed(format!("{}: {error}", directory.display())))?;
        let path = directory.join(format!("turn-{turn}.tar"));
        let mut archive =
            ArchiveWriter::create(&path, &image.reference, &image.index).map_err(|e| failed(e.to_string()))?;
        for blob in &image.blobs {
            let data = self.launch.ctr.run(&["content", "get", &blob.digest]).await?.stdout;
            archive.add(blob, &data).map_err(|e| failed(e.to_string()))?;
        }
        let bytes = archive.finish().map_err(|e| failed(e.to_string()))?;
        Ok((path, bytes))
    }
}

#[async_trait]
impl RecoveryPolicy for EveryTurn {
    fn kind(&self) -> PolicyKind {
        PolicyKind::EveryTurn
    }

    async fn after_turn(&mut self, sandbox: &Sandbox, turn: u32) -> Result<TurnCost, ReplayError> {
        // containerd 1.6 silently drops the task part of a checkpoint whose spec
        // blob already exists, so the previous image goes first (only the latest
        // is ever restored; its archive stays until this turn's is durable).
        // Not counted as agent-visible: it could run any time before the next
        // checkpoint.
        if let Some((_, previous)) = self.image.take() {
            remove_image(&self.launch.ctr, &previous).await?;
        }
        let reference = self.reference(turn);
        let started = Instant::now();
        let image = match sandbox.checkpoint(&reference).await {
            Ok(image) => image,
            Err(error) => {
                // An incomplete image must not be restored later, nor left behind.
                remove_image(&self.launch.ctr, &reference).await?;
                return Err(error.into());
            }
        };
        self.image = Some((turn, reference));
        let (archive, exported_bytes) = self.export(turn, &image).await?;
        if let Some((_, previous)) = self.archive.replace((turn, archive)) {
            remove_archive(&previous)?;
        }
        let blocking_s = started.elapsed().as_secs_f64();
        info!(container = sandbox.id(), turn, bytes = image.bytes, exported_bytes, seconds = blocking_s, "checkpoint");
        Ok(TurnCost { blocking_s, bytes: image.bytes + exported_bytes, exported_bytes, class: None })
    }

    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError> {
        // The restored container holds the processes of the dead one's execs
        // (a stdin-mode shell among them) under their exec ids: the agent's
        // next exec must not reuse one, or it would be handed that process.
        let execs_made = dead.execs_made();
        dead.remove().await?;
        let (ctr, id, spec) = (&self.launch.ctr, &self.launch.container_id, &self.launch.spec);
        let sandbox = match (self.image.clone(), self.archive.clone()) {
            (Some((turn, reference)), _) => Some((turn, Sandbox::restore(ctr, id, spec, &reference).await?)),
            // containerd lost the image (node loss) or never stored this
            // turn's (a failed checkpoint): the archive of the newest turn
            // saved is what a replacement node has.
            (None, Some((turn, archive))) => {
                let reference = self.reference(turn);
                let sandbox = Sandbox::restore_from_archive(ctr, id, spec, &reference, &archive).await?;
                info!(container = id.as_str(), turn, archive = %archive.display(), "restored from the exported checkpoint");
                self.image = Some((turn, reference));
                Some((turn, sandbox))
            }
            (None, None) => None,
        };
        Ok(match sandbox {
            Some((turn, sandbox)) => Recovery {
                sandbox: sandbox.with_exec_ids_after(execs_made),
                method: RecoveryMethod::Checkpoint { turn },
                possible: true,
            },
            // Killed before the first checkpoint: the base image is all there is.
            None => Recovery { sandbox: self.launch.fresh().await?, method: RecoveryMethod::BaseImage, possible: true },
        })
    }

    /// `ctr c checkpoint` keeps the image in containerd's content store, which
    /// goes with the node: the image is removed as the fault's part. The
    /// archive outside containerd stays.
    async fn lose_containerd_state(&mut self) -> Result<Option<String>, ReplayError> {
        let Some((turn, reference)) = self.image.take() else { return Ok(None) };
        remove_image(&self.launch.ctr, &reference).await?;
        let kept = match &self.archive {
            Some((kept, _)) => format!("; its archive of turn {kept} outside containerd remains"),
            None => "; no archive outside containerd".to_string(),
        };
        Ok(Some(format!("checkpoint image of turn {turn} lost with containerd's content store{kept}")))
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        if let Some((_, reference)) = self.image.take() {
            remove_image(&self.launch.ctr, &reference).await?;
        }
        if let Some((_, archive)) = self.archive.take() {
            remove_archive(&archive)?;
        }
        // Whatever else a failed export left there is this sandbox's too.
        let directory = self.archive_dir();
        match std::fs::remove_dir_all(&directory) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(ReplayError::Policy(format!("removing {}: {error}", directory.display()))),
        }
    }
}

fn remove_archive(path: &Path) -> Result<(), ReplayError> {
    std::fs::remove_file(path).map_err(|error| ReplayError::Policy(format!("removing {}: {error}", path.display())))
}

/// crab: the shim checkpoints each turn by itself (nothing, an fs delta, or a
/// CRIU dump, as the inspector saw the turn) while the agent thinks.
struct CrabPolicy {
    launch: Launch,
}

/// How long a turn's checkpoint may take before the replay gives up on it.
const CRAB_CHECKPOINT_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl CrabPolicy {
    fn ctl(&self) -> Result<crabctl::Ctl, ReplayError> {
        crabctl::Ctl::open(&crab_state_dir(), self.launch.ctr.clone()).map_err(|e| ReplayError::Policy(e.to_string()))
    }
}

/// Where the crab shims keep their store: `CRAB_STATE_DIR` as for the other
/// crabctl commands, else the state dir of crab's configuration (`CRAB_CONFIG`).
fn crab_state_dir() -> std::path::PathBuf {
    std::env::var_os("CRAB_STATE_DIR").map(Into::into).unwrap_or_else(|| {
        crab_config::Config::load(None)
            .map(|config| config.checkpoint.state_dir)
            .unwrap_or_else(|_| crab_store::DEFAULT_STATE_DIR.into())
    })
}

#[async_trait]
impl RecoveryPolicy for CrabPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Crab
    }

    /// Waits for the shim's record of the turn. The fault model is the same as
    /// every-turn's (the crash comes once the turn's checkpoint is durable);
    /// the cost reported is the checkpoint's whole duration, which is what an
    /// agent coming back with no think time at all would wait.
    async fn after_turn(&mut self, sandbox: &Sandbox, _turn: u32) -> Result<TurnCost, ReplayError> {
        // The exec id the turn's record carries, and how many turns it made:
        // a stdin session makes one per command written to it.
        let Some((exec_id, turns)) = sandbox.last_turn_exec() else { return Ok(TurnCost::default()) };
        // The turn log of the sandbox in the replay's containerd namespace.
        let key = self.ctl()?.key(sandbox.id()).map_err(|e| ReplayError::Policy(e.to_string()))?;
        let log = crab_store::turns::TurnLog::open(&crab_state_dir(), &key)
            .map_err(|e| ReplayError::Policy(e.to_string()))?;
        let deadline = Instant::now() + CRAB_CHECKPOINT_WAIT;
        loop {
            // Matched by exec id, which the replay never reuses in a sandbox: a
            // sandbox recovered from the base image starts a new turn log.
            let records = log.read().map_err(|e| ReplayError::Policy(e.to_string()))?;
            let of_exec = || records.iter().filter(|r| r.exec_id.as_deref() == Some(exec_id.as_str()));
            if of_exec().count() as u64 >= turns
                && let Some(record) = of_exec().next_back()
            {
                return Ok(TurnCost {
                    blocking_s: record.checkpoint_ms / 1e3,
                    bytes: record.bytes_written,
                    exported_bytes: 0,
                    class: Some(match record.class {
                        crab_store::turns::RecordedClass::Clean => "clean",
                        crab_store::turns::RecordedClass::Fs => "fs",
                        crab_store::turns::RecordedClass::Proc => "proc",
                    }),
                });
            }
            if Instant::now() > deadline {
                return Err(ReplayError::Policy(format!(
                    "no turn record for exec {exec_id} of {} after {:?}",
                    sandbox.id(),
                    CRAB_CHECKPOINT_WAIT
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError> {
        let ctl = self.ctl()?;
        let report = ctl
            .recover(dead.id(), Some(&self.launch.spec.image))
            .await
            .map_err(|e| ReplayError::Policy(e.to_string()))?;
        info!(container = dead.id(), checkpoint = ?report.checkpoint_turn, ms = report.elapsed_ms, "crab recovered");
        let sandbox = Sandbox::attach(&dead);
        let method = match report.checkpoint_turn {
            Some(turn) => RecoveryMethod::Checkpoint { turn: turn as u32 },
            None => RecoveryMethod::BaseImage,
        };
        Ok(Recovery { sandbox, method, possible: true })
    }

    async fn check_store(&mut self, container: &str) -> Option<StoreCheck> {
        let verified =
            self.ctl().and_then(|ctl| ctl.verify(Some(container)).map_err(|e| ReplayError::Policy(e.to_string())));
        Some(match verified.map(|rows| rows.into_iter().next()) {
            Ok(Some(row)) => StoreCheck {
                ok: row.ok,
                head_turn: row.head_turn,
                manifests: row.manifests,
                blobs: row.blobs,
                bytes: row.bytes,
                error: row.error,
            },
            Ok(None) => StoreCheck::failed(format!("no checkpoint chain for {container}")),
            Err(error) => StoreCheck::failed(error.to_string()),
        })
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        // The chain stays for inspection (`crabctl turns`); `crabctl gc` reclaims it.
        Ok(())
    }
}

/// Removes a policy run's container whatever happened to it.
pub async fn discard(launch: &Launch) -> Result<(), ReplayError> {
    Ok(remove_container(&launch.ctr, &launch.container_id).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>().unwrap(), kind);
        }
        let error = "crib".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(error.contains("unknown policy \"crib\""), "{error}");
    }
}
