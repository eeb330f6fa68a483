//! Recovery policies: what is saved after each turn and how a sandbox comes
//! back after its processes were killed. A new policy implements
//! [`RecoveryPolicy`] and gets a [`PolicyKind`] variant.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use async_trait::async_trait;
use serde::Serialize;
use tracing::info;

use super::ReplayError;
use super::archive::ArchiveWriter;
use super::fault::FaultKind;
use super::node::{NodeA, NodeB, Registry};
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

    /// Why `fault` has nothing of this policy's sandbox to strike, if so: crabd serves the crab
    /// shim's checkpoints, and a shim that saves nothing never starts it or talks to it (it sets
    /// up its engine, crabd's client, only for a sandbox it checkpoints). Killing crabd under
    /// a baseline would be a fault-free run again, so none is made.
    pub fn untouched_by(self, fault: FaultKind) -> Option<&'static str> {
        (fault == FaultKind::KillCrabd && self.shim_policy() == "off")
            .then_some("its shim saves nothing and never starts or uses crabd")
    }

    pub fn build(self, launch: Launch) -> Box<dyn RecoveryPolicy> {
        match self {
            PolicyKind::Off | PolicyKind::ChatOnly => Box::new(FreshSandbox { launch, kind: self, on_node_b: false }),
            PolicyKind::EveryTurn => Box::new(EveryTurn::new(launch)),
            PolicyKind::Crab => Box::new(CrabPolicy::new(launch)),
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
    /// Where the sandbox comes back after node-loss.
    pub node_b: Option<NodeB>,
    /// The registry of a run that will lose its node (node B's, where crab's shim pushes too):
    /// every-turn pushes its checkpoint images there instead of writing archives.
    pub registry: Option<Registry>,
}

impl Launch {
    pub async fn fresh(&self) -> Result<Sandbox, ReplayError> {
        Ok(Sandbox::create(&self.ctr, &self.container_id, &self.spec).await?)
    }

    /// A new sandbox from the base image on node B, whose shims read node B's own config.
    async fn fresh_on_node_b(&self) -> Result<Sandbox, ReplayError> {
        let node_b = self.node_b()?;
        Ok(Sandbox::create(&node_b.ctr, &self.container_id, &self.spec_on_node_b()).await?)
    }

    fn node_b(&self) -> Result<&NodeB, ReplayError> {
        self.node_b.as_ref().ok_or_else(|| ReplayError::Policy("node-loss without a node B".into()))
    }

    /// The sandbox's spec on node B: node A's own crab config went with node A.
    pub fn spec_on_node_b(&self) -> SandboxSpec {
        SandboxSpec { runtime_config: None, ..self.spec.clone() }
    }
}

/// Where every-turn's copy of a checkpoint off the node went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffNode {
    /// An OCI archive in a directory of the replay's (`--checkpoint-dir`).
    Archive,
    /// `ctr images push` to the run's registry (node-loss runs).
    Registry,
}

/// What saving after one turn cost.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TurnCost {
    /// Time the agent waits before its next turn can start.
    pub blocking_s: f64,
    /// Everything the checkpoint wrote.
    pub bytes: u64,
    /// What went off the node: every-turn's archive, or what its push sent to the registry (the
    /// blobs the registry lacked), both part of `bytes`; for crab in node-loss runs what its
    /// shim pushed for the turn ([`SelfPushed`], filled in by the runner), not part of `bytes`.
    pub exported_bytes: u64,
    /// Where `exported_bytes` went.
    pub exported_to: Option<OffNode>,
    /// The runtime's class of the turn (clean, fs, proc), where it records one.
    pub class: Option<&'static str>,
    /// When the checkpoint was durable, for a runtime that saves by itself from the turn's end
    /// (crab's shim records it): the runner waits for what the turn left running before it asks
    /// (see [`crate::settle`]), and the agent's wait is counted from the turn's end, not from then.
    #[serde(skip)]
    pub durable_at: Option<std::time::SystemTime>,
}

/// What a policy's runtime pushed to the registry by itself, in the background (crab's shim with
/// `[remote] auto_push`), per turn of the replay: it is not known when the turn's [`TurnCost`] is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SelfPushed {
    /// The bytes pushed for each turn the policy ran on a node that pushes (0 for a turn nothing
    /// was pushed for, such as one that changed nothing).
    pub turns: BTreeMap<u32, u64>,
    /// The turns the figures leave out and why (turns on a node that pushes nothing).
    pub note: Option<String>,
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

    /// Node A is about to be lost: waits (bounded) until what the policy saved of `sandbox` is
    /// off the node, as every other fault strikes once the turn's checkpoint is durable. Says
    /// what it waited for.
    async fn before_node_loss(&mut self, _sandbox: &Sandbox) -> Result<Option<String>, ReplayError> {
        Ok(None)
    }

    /// Node A is gone: from now on the policy works on node B.
    fn move_to_node_b(&mut self);

    /// Whether everything the policy saved of `sandbox` is off the node now; None when the
    /// policy does not push its checkpoints anywhere.
    async fn off_node(&mut self, _sandbox: &Sandbox) -> Result<Option<bool>, ReplayError> {
        Ok(None)
    }

    /// What the policy's runtime pushed to the registry by itself so far (see [`SelfPushed`]);
    /// None when it pushes nothing by itself. The runner asks at the end of the run, before
    /// [`RecoveryPolicy::cleanup`]; what a lost node pushed is read before it is lost.
    async fn self_pushed(&mut self) -> Result<Option<SelfPushed>, ReplayError> {
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
    on_node_b: bool,
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
        let sandbox = if self.on_node_b { self.launch.fresh_on_node_b().await? } else { self.launch.fresh().await? };
        Ok(Recovery { sandbox, method: RecoveryMethod::BaseImage, possible: self.kind != PolicyKind::Off })
    }

    fn move_to_node_b(&mut self) {
        self.on_node_b = true;
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        Ok(())
    }
}

/// What users of containerd have today: a full checkpoint after every turn,
/// kept off the node. `ctr c checkpoint` writes it into containerd's content
/// store (what a restore on this node uses). In a run with a registry (one that
/// will lose its node) the checkpoint image is named for the registry and
/// `ctr images push`ed there, as crab's shim pushes its turns; after node loss
/// node B fetches the newest with `ctr content fetch` and restores from it.
/// Otherwise the checkpoint's own blobs go into an archive in a directory of
/// the replay's own (what a user of spot machines keeps on durable storage,
/// `ctr images export` less the base image), and after the loss of
/// containerd's state `ctr images import` brings it back.
struct EveryTurn {
    launch: Launch,
    /// The containerd the sandbox runs on: node A's, node B's after node-loss.
    ctr: Ctr,
    /// The newest checkpoint image in containerd, unless lost with it.
    image: Option<(u32, String)>,
    /// The newest checkpoint archive outside containerd.
    archive: Option<(u32, PathBuf)>,
    /// The newest checkpoint image pushed to the registry.
    pushed: Option<(u32, String)>,
}

impl EveryTurn {
    fn new(launch: Launch) -> EveryTurn {
        EveryTurn { ctr: launch.ctr.clone(), launch, image: None, archive: None, pushed: None }
    }

    /// The checkpoint image's name: in the registry's every-turn repository of the container
    /// when the run has one, else a local name.
    fn reference(&self, turn: u32) -> String {
        match &self.launch.registry {
            Some(registry) => registry.every_turn_reference(&self.launch.container_id, turn),
            None => format!("crab.local/replay/{}:turn-{turn}", self.launch.container_id),
        }
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
            let data = self.ctr.run(&["content", "get", &blob.digest]).await?.stdout;
            archive.add(blob, &data).map_err(|e| failed(e.to_string()))?;
        }
        let bytes = archive.finish().map_err(|e| failed(e.to_string()))?;
        Ok((path, bytes))
    }

    /// The bytes a push of `image` will send: the sizes of the descriptors of its push set the
    /// registry's repository lacks. containerd's pusher asks the same (HEAD of each blob, or
    /// manifest, in the target repository; of the image itself by its tag, new every turn) and
    /// uploads exactly those, each whole, in one request body of its size; what the repository
    /// has is skipped (seen with `ctr images push --http-dump`). It would mount a blob
    /// from another repository instead of sending it only for content labelled as pulled from
    /// this registry, which a checkpoint never is (a node B that fetched one pushes to the
    /// same repository, which has those blobs). So the base image's layers, where the index
    /// lists them, count on the repository's first push, and an unchanged blob (the runtime
    /// options, an rw layer no turn changed) costs nothing after. Registry storage would not
    /// do: it deduplicates across repositories, which a push without mounts does not.
    async fn bytes_to_push(&self, registry: &Registry, image: &CheckpointImage) -> Result<u64, ReplayError> {
        let repository = registry.every_turn_repository(&self.launch.container_id);
        let tag = image.reference.rsplit_once(':').map_or("", |(_, tag)| tag);
        let mut lacking = 0;
        for descriptor in image.push_set(&self.ctr).await? {
            let held = if descriptor.digest == image.index.digest {
                registry.has_tag(&repository, tag).await?
            } else {
                registry.holds(&repository, &descriptor).await?
            };
            if !held {
                lacking += descriptor.size;
            }
        }
        Ok(lacking)
    }

    /// `ctr images push` of the checkpoint image (named for the registry); returns the bytes it
    /// sent and how long the push took.
    async fn push(&self, registry: &Registry, image: &CheckpointImage) -> Result<(u64, f64), ReplayError> {
        let flags = registry.ctr_flags()?;
        let bytes = self.bytes_to_push(registry, image).await?;
        let started = Instant::now();
        let mut args = vec!["images".to_owned(), "push".to_owned()];
        args.extend(flags);
        args.push(image.reference.clone());
        self.ctr.run(&args).await?;
        Ok((bytes, started.elapsed().as_secs_f64()))
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
            remove_image(&self.ctr, &previous).await?;
        }
        let reference = self.reference(turn);
        let started = Instant::now();
        let image = match sandbox.checkpoint(&reference).await {
            Ok(image) => image,
            Err(error) => {
                // An incomplete image must not be restored later, nor left behind.
                remove_image(&self.ctr, &reference).await?;
                return Err(error.into());
            }
        };
        self.image = Some((turn, reference.clone()));
        let checkpoint_s = started.elapsed().as_secs_f64();
        // The push (or the export) is part of the turn's cost: the turn is not off the node
        // before it is done. Asking the registry what it lacks is the measurement's, not counted.
        let (exported_bytes, exported_s, exported_to) = match self.launch.registry.clone() {
            Some(registry) => {
                let (bytes, seconds) = self.push(&registry, &image).await?;
                self.pushed = Some((turn, reference));
                (bytes, seconds, OffNode::Registry)
            }
            None => {
                let exporting = Instant::now();
                let (archive, bytes) = self.export(turn, &image).await?;
                if let Some((_, previous)) = self.archive.replace((turn, archive)) {
                    remove_archive(&previous)?;
                }
                (bytes, exporting.elapsed().as_secs_f64(), OffNode::Archive)
            }
        };
        let blocking_s = checkpoint_s + exported_s;
        info!(
            container = sandbox.id(),
            turn,
            bytes = image.bytes,
            exported_bytes,
            ?exported_to,
            seconds = blocking_s,
            "checkpoint"
        );
        Ok(TurnCost {
            blocking_s,
            bytes: image.bytes + exported_bytes,
            exported_bytes,
            exported_to: Some(exported_to),
            class: None,
            durable_at: None,
        })
    }

    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError> {
        // The restored container holds the processes of the dead one's execs
        // (a stdin-mode shell among them) under their exec ids: the agent's
        // next exec must not reuse one, or it would be handed that process.
        let execs_made = dead.execs_made();
        dead.remove().await?;
        let on_node_b = self.ctr.socket() != self.launch.ctr.socket();
        let spec = if on_node_b { self.launch.spec_on_node_b() } else { self.launch.spec.clone() };
        let (ctr, id, spec) = (&self.ctr, &self.launch.container_id, &spec);
        let sandbox = match (self.image.clone(), self.pushed.clone(), self.archive.clone()) {
            (Some((turn, reference)), _, _) => Some((turn, Sandbox::restore(ctr, id, spec, &reference).await?)),
            // containerd lost the image (node loss) or never stored this turn's (a failed
            // checkpoint): the newest turn in the registry is what a replacement node has.
            (None, Some((turn, reference)), _) => {
                let flags = self.launch.registry.as_ref().map(Registry::ctr_flags).transpose()?.unwrap_or_default();
                let sandbox = Sandbox::restore_from_registry(ctr, id, spec, &reference, &flags).await?;
                info!(
                    container = id.as_str(),
                    turn, reference, "restored from the checkpoint image fetched from the registry"
                );
                self.image = Some((turn, reference));
                Some((turn, sandbox))
            }
            // The same for a run without a registry: the archive of the newest turn saved.
            (None, None, Some((turn, archive))) => {
                let reference = self.reference(turn);
                let sandbox = Sandbox::restore_from_archive(ctr, id, spec, &reference, &archive).await?;
                info!(container = id.as_str(), turn, archive = %archive.display(), "restored from the exported checkpoint");
                self.image = Some((turn, reference));
                Some((turn, sandbox))
            }
            (None, None, None) => None,
        };
        Ok(match sandbox {
            Some((turn, sandbox)) => Recovery {
                sandbox: sandbox.with_exec_ids_after(execs_made),
                method: RecoveryMethod::Checkpoint { turn },
                possible: true,
            },
            // Killed before the first checkpoint: the base image is all there is.
            None => Recovery {
                sandbox: Sandbox::create(ctr, id, spec).await?,
                method: RecoveryMethod::BaseImage,
                possible: true,
            },
        })
    }

    /// `ctr c checkpoint` keeps the image in containerd's content store, which
    /// goes with the node: the image is removed as the fault's part. The
    /// archive outside containerd, or the image pushed to the registry, stays.
    async fn lose_containerd_state(&mut self) -> Result<Option<String>, ReplayError> {
        let Some((turn, reference)) = self.image.take() else { return Ok(None) };
        remove_image(&self.ctr, &reference).await?;
        let kept = match (&self.pushed, &self.archive, &self.launch.registry) {
            (Some((kept, pushed)), _, _) => format!("; its push of turn {kept} to {pushed} remains"),
            (None, _, Some(_)) => "; nothing pushed to the registry".to_string(),
            (None, Some((kept, _)), None) => format!("; its archive of turn {kept} outside containerd remains"),
            (None, None, None) => "; no archive outside containerd".to_string(),
        };
        Ok(Some(format!("checkpoint image of turn {turn} lost with containerd's content store{kept}")))
    }

    /// Each turn's push ends before the next turn starts: the newest checkpoint is in the
    /// registry already when node A is lost.
    async fn before_node_loss(&mut self, _sandbox: &Sandbox) -> Result<Option<String>, ReplayError> {
        Ok(match (&self.pushed, &self.launch.registry) {
            (Some((turn, reference)), _) => Some(format!("checkpoint of turn {turn} in the registry as {reference}")),
            (None, Some(_)) => Some("no checkpoint in the registry before node A was lost".into()),
            (None, None) => None,
        })
    }

    /// What left the node (the image in the registry, or the archive on storage that outlives
    /// the node, the replay's own directory) comes back into node B's containerd, and the
    /// sandbox is restored from there.
    fn move_to_node_b(&mut self) {
        if let Some(node_b) = &self.launch.node_b {
            self.ctr = node_b.ctr.clone();
        }
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        if let Some((_, reference)) = self.image.take() {
            remove_image(&self.ctr, &reference).await?;
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
    /// The node the sandbox runs on: its containerd and crab's store there.
    ctr: Ctr,
    state_dir: PathBuf,
    on_node_b: bool,
    /// The newest turn in the registry when node A was lost (None: nothing was pushed).
    pushed_turn: Option<u64>,
    /// Whether node A's shim pushes each checkpointed turn (a run that will lose its node).
    node_a_pushes: bool,
    /// The replay's turns, by the node they ran on.
    turns_on_node_a: Vec<u32>,
    turns_on_node_b: Vec<u32>,
    /// Node A's push log (bytes uploaded per turn), read before the node was lost.
    node_a_pushed: Option<BTreeMap<u64, u64>>,
    /// Turns of the stdin session whose records are in a log this node does not have: node B
    /// starts a turn log of its own, and a session it re-attached after a node loss counts on
    /// from the turns it made on node A.
    session_turns_elsewhere: u64,
}

/// How long a turn's checkpoint may take before the replay gives up on it.
const CRAB_CHECKPOINT_WAIT: std::time::Duration = std::time::Duration::from_secs(120);
/// How long node A's shim may take to get the newest checkpoint into the registry before the
/// node is lost anyway (the recovery then starts from an older turn, and the report says so).
const CRAB_PUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl CrabPolicy {
    fn new(launch: Launch) -> CrabPolicy {
        // A run that will lose its node has a store of its own (node A's config); else the
        // shims' store of the environment's config.
        let node_a = launch.spec.runtime_config.as_deref().and_then(|config| NodeA::load(config).ok());
        let node_a_pushes = node_a.as_ref().is_some_and(|node_a| node_a.config.remote.auto_push);
        let state_dir = node_a.map(|node_a| node_a.config.checkpoint.state_dir).unwrap_or_else(crab_state_dir);
        CrabPolicy {
            ctr: launch.ctr.clone(),
            state_dir,
            launch,
            on_node_b: false,
            pushed_turn: None,
            node_a_pushes,
            turns_on_node_a: Vec::new(),
            turns_on_node_b: Vec::new(),
            node_a_pushed: None,
            session_turns_elsewhere: 0,
        }
    }

    /// How many turn records of `exec_id` the log of `container` on this node holds.
    fn records_of(&self, container: &str, exec_id: &str) -> Result<u64, ReplayError> {
        let key = self.ctl()?.key(container).map_err(|e| ReplayError::Policy(e.to_string()))?;
        let log =
            crab_store::turns::TurnLog::open(&self.state_dir, &key).map_err(|e| ReplayError::Policy(e.to_string()))?;
        let records = log.read().map_err(|e| ReplayError::Policy(e.to_string()))?;
        Ok(records.iter().filter(|r| r.exec_id.as_deref() == Some(exec_id)).count() as u64)
    }

    /// The bytes this node's shim uploaded for each turn of `container` it pushed: the
    /// `bytes_uploaded` of each turn of its push log.
    fn pushed_bytes(&self, container: &str) -> Result<BTreeMap<u64, u64>, ReplayError> {
        let log: crab_remote::chain::PushLog =
            self.ctl()?.push_log(container).map_err(|e| ReplayError::Policy(e.to_string()))?;
        Ok(log.turns.iter().map(|(turn, pushed)| (*turn, pushed.bytes_uploaded)).collect())
    }

    fn ctl(&self) -> Result<crabctl::Ctl, ReplayError> {
        crabctl::Ctl::open(&self.state_dir, self.ctr.clone()).map_err(|e| ReplayError::Policy(e.to_string()))
    }

    /// The turn of `container`'s newest checkpoint on this node, and the turns of it the
    /// registry holds (by the push log; none when never pushed).
    fn replication(&self, container: &str) -> Result<(Option<u64>, std::collections::BTreeSet<u64>), ReplayError> {
        let failed = |e: crabctl::CtlError| ReplayError::Policy(e.to_string());
        let ctl = self.ctl()?;
        let store =
            crab_store::CheckpointStore::open(&self.state_dir).map_err(|e| ReplayError::Policy(e.to_string()))?;
        let head = store.head(&ctl.key(container).map_err(failed)?).map_err(|e| ReplayError::Policy(e.to_string()))?;
        Ok((head.map(|head| head.turn), ctl.pushed_turns(container).map_err(failed)?.unwrap_or_default()))
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
    async fn after_turn(&mut self, sandbox: &Sandbox, turn: u32) -> Result<TurnCost, ReplayError> {
        if self.on_node_b { &mut self.turns_on_node_b } else { &mut self.turns_on_node_a }.push(turn);
        // The exec id the turn's record carries, and how many turns it made:
        // a stdin session makes one per command written to it.
        let Some((exec_id, turns)) = sandbox.last_turn_exec() else { return Ok(TurnCost::default()) };
        // The turn log of the sandbox in the replay's containerd namespace.
        let key = self.ctl()?.key(sandbox.id()).map_err(|e| ReplayError::Policy(e.to_string()))?;
        let log =
            crab_store::turns::TurnLog::open(&self.state_dir, &key).map_err(|e| ReplayError::Policy(e.to_string()))?;
        let deadline = Instant::now() + CRAB_CHECKPOINT_WAIT;
        loop {
            // Matched by exec id, which the replay never reuses in a sandbox: a
            // sandbox recovered from the base image starts a new turn log.
            let records = log.read().map_err(|e| ReplayError::Policy(e.to_string()))?;
            let of_exec = || records.iter().filter(|r| r.exec_id.as_deref() == Some(exec_id.as_str()));
            if of_exec().count() as u64 + self.session_turns_elsewhere >= turns
                && let Some(record) = of_exec().next_back()
            {
                let durable_ms = record.ended_unix_ms as f64 + record.checkpoint_ms;
                return Ok(TurnCost {
                    blocking_s: record.checkpoint_ms / 1e3,
                    bytes: record.bytes_written,
                    exported_bytes: 0,
                    exported_to: None,
                    durable_at: Some(
                        std::time::UNIX_EPOCH + std::time::Duration::from_secs_f64(durable_ms.max(0.0) / 1e3),
                    ),
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
        let (checkpoint_turn, sandbox) = if self.on_node_b && self.pushed_turn.is_none() {
            // No turn had changed anything before node A was lost (every one clean): the
            // base image is the sandbox's state, on node B as anywhere.
            dead.remove().await?;
            let sandbox = self.launch.fresh_on_node_b().await?;
            (None, sandbox)
        } else if self.on_node_b {
            // Node B has nothing of the sandbox: crabctl there pulls its chain from the
            // registry (every digest verified) and restores through B's containerd.
            let node_b = self.launch.node_b()?;
            let repository = node_b.repository(dead.id());
            let image = self.launch.spec.image.clone();
            let report = node_b.crabctl(&["recover", dead.id(), "--from", &repository, "--image", &image]).await?;
            info!(container = dead.id(), from = %repository, report = %report, "crab recovered on node B");
            // A stdin session node B re-attaches goes on counting its turns from node A's,
            // whose records stayed in node A's log.
            if dead.mode() == super::shell::ReplayMode::Stdin
                && let Some((exec_id, turns)) = dead.last_turn_exec()
            {
                self.session_turns_elsewhere = turns.saturating_sub(self.records_of(dead.id(), &exec_id)?);
            }
            (report["checkpoint_turn"].as_u64(), Sandbox::attach_on(&node_b.ctr, &dead))
        } else {
            let report = self
                .ctl()?
                .recover(dead.id(), Some(&self.launch.spec.image))
                .await
                .map_err(|e| ReplayError::Policy(e.to_string()))?;
            info!(container = dead.id(), checkpoint = ?report.checkpoint_turn, ms = report.elapsed_ms, "crab recovered");
            (report.checkpoint_turn, Sandbox::attach(&dead))
        };
        let method = match checkpoint_turn {
            Some(turn) => RecoveryMethod::Checkpoint { turn: turn as u32 },
            None => RecoveryMethod::BaseImage,
        };
        Ok(Recovery { sandbox, method, possible: true })
    }

    /// The shim pushes each checkpointed turn by itself (node A's `[remote] auto_push`): waits
    /// until the registry holds the newest checkpoint of the chain.
    async fn before_node_loss(&mut self, sandbox: &Sandbox) -> Result<Option<String>, ReplayError> {
        let started = Instant::now();
        loop {
            let (head, pushed) = self.replication(sandbox.id())?;
            let Some(head) = head else { return Ok(Some("no checkpoint to push before node A was lost".into())) };
            self.pushed_turn = pushed.last().copied();
            if pushed.contains(&head) || started.elapsed() > CRAB_PUSH_WAIT {
                // What node A's shim pushed, read while the node is still there (the fault
                // deletes its store and the push log in it).
                self.node_a_pushed = Some(self.pushed_bytes(sandbox.id())?);
            }
            if pushed.contains(&head) {
                let waited = started.elapsed().as_secs_f64();
                return Ok(Some(format!("checkpoint of turn {head} in the registry {waited:.2} s after it was asked")));
            }
            if started.elapsed() > CRAB_PUSH_WAIT {
                return Ok(Some(format!(
                    "checkpoint of turn {head} not in the registry after {CRAB_PUSH_WAIT:?}: node A lost anyway"
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Node A's shim pushes (a run that will lose its node): the newest checkpoint is in the
    /// registry, or there is none yet.
    async fn off_node(&mut self, sandbox: &Sandbox) -> Result<Option<bool>, ReplayError> {
        if self.on_node_b || self.launch.spec.runtime_config.is_none() {
            return Ok(None);
        }
        let (head, pushed) = self.replication(sandbox.id())?;
        Ok(Some(head.is_none_or(|head| pushed.contains(&head))))
    }

    fn move_to_node_b(&mut self) {
        if let Some(node_b) = &self.launch.node_b {
            self.ctr = node_b.ctr.clone();
            self.state_dir = node_b.config.checkpoint.state_dir.clone();
            self.on_node_b = true;
        }
    }

    /// Per turn on node A, the bytes its shim uploaded for the turn (its push log); on node B
    /// likewise where B's config pushes, else the note says nothing was pushed from there.
    async fn self_pushed(&mut self) -> Result<Option<SelfPushed>, ReplayError> {
        if !self.node_a_pushes {
            return Ok(None);
        }
        let container = self.launch.container_id.clone();
        let node_a = match (&self.node_a_pushed, self.on_node_b) {
            (Some(pushed), _) => pushed.clone(),
            (None, false) => self.pushed_bytes(&container)?,
            (None, true) => BTreeMap::new(),
        };
        let mut turns: BTreeMap<u32, u64> = self
            .turns_on_node_a
            .iter()
            .map(|turn| (*turn, node_a.get(&u64::from(*turn)).copied().unwrap_or(0)))
            .collect();
        let (Some(first), Some(last)) = (self.turns_on_node_b.first(), self.turns_on_node_b.last()) else {
            return Ok(Some(SelfPushed { turns, note: None }));
        };
        let span = if first == last { format!("turn {first}") } else { format!("turns {first}-{last}") };
        let node_b = self.launch.node_b()?;
        let note = if node_b.config.remote.auto_push {
            let node_b_pushed = self.pushed_bytes(&container)?;
            let mut any = false;
            for turn in &self.turns_on_node_b {
                if let Some(bytes) = node_b_pushed.get(&u64::from(*turn)) {
                    turns.insert(*turn, *bytes);
                    any = true;
                }
            }
            (!any).then(|| format!("{span} ran on node B, whose shim had pushed none of them by the end of the run"))
        } else {
            Some(format!("{span} ran on node B, whose crab config has no auto_push: nothing pushed from there"))
        };
        Ok(Some(SelfPushed { turns, note }))
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

/// Removes a policy run's container whatever happened to it, on node B too, and node A's
/// directory of the run.
pub async fn discard(launch: &Launch) -> Result<(), ReplayError> {
    remove_container(&launch.ctr, &launch.container_id).await?;
    if let Some(node_b) = &launch.node_b {
        remove_container(&node_b.ctr, &launch.container_id).await?;
    }
    if let Some(config) = &launch.spec.runtime_config
        && let Some(dir) = config.parent()
    {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(ReplayError::Policy(format!("removing {}: {error}", dir.display()))),
        }
    }
    Ok(())
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
