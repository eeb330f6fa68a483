//! Recovery policies: what is saved after each turn and how a sandbox comes
//! back after its processes were killed. A new policy implements
//! [`RecoveryPolicy`] and gets a [`PolicyKind`] variant.

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use async_trait::async_trait;
use serde::Serialize;
use tracing::info;

use super::ReplayError;
use super::ctr::Ctr;
use super::sandbox::{Sandbox, SandboxSpec, remove_container, remove_image};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Nothing is saved; a killed sandbox is lost.
    Off,
    /// Only the chat history survives: recovery is a fresh sandbox from the base image.
    ChatOnly,
    /// `ctr c checkpoint --task --rw` after every turn, `ctr c restore` on failure.
    EveryTurn,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Off, PolicyKind::ChatOnly, PolicyKind::EveryTurn];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Off => "off",
            PolicyKind::ChatOnly => "chat-only",
            PolicyKind::EveryTurn => "every-turn",
        }
    }

    /// What the crab shim itself should save for this policy's sandboxes
    /// (its `io.crab.policy` annotation; other runtimes ignore it). The
    /// baselines work through `ctr` alone, so the shim saves nothing.
    pub fn shim_policy(self) -> &'static str {
        match self {
            PolicyKind::Off | PolicyKind::ChatOnly | PolicyKind::EveryTurn => "off",
        }
    }

    pub fn build(self, launch: Launch) -> Box<dyn RecoveryPolicy> {
        match self {
            PolicyKind::Off => Box::new(FreshSandbox { launch, kind: self }),
            PolicyKind::ChatOnly => Box::new(FreshSandbox { launch, kind: self }),
            PolicyKind::EveryTurn => Box::new(EveryTurn { launch, last: None }),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown policy {0:?} (expected one of: off, chat-only, every-turn)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<PolicyKind, UnknownPolicy> {
        PolicyKind::ALL
            .into_iter()
            .find(|kind| kind.name() == text)
            .ok_or_else(|| UnknownPolicy(text.to_string()))
    }
}

/// Everything a policy needs to (re)create the sandbox it looks after.
#[derive(Debug, Clone)]
pub struct Launch {
    pub ctr: Ctr,
    pub container_id: String,
    pub spec: SandboxSpec,
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
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "method", rename_all = "kebab-case")]
pub enum RecoveryMethod {
    /// Processes and files restored from the checkpoint taken after `turn`.
    Checkpoint { turn: u32 },
    /// A new sandbox from the base image; the agent keeps only its history.
    BaseImage,
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

    async fn after_turn(
        &mut self,
        _sandbox: &Sandbox,
        _turn: u32,
    ) -> Result<TurnCost, ReplayError> {
        Ok(TurnCost::default())
    }

    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError> {
        dead.remove().await?;
        let sandbox = self.launch.fresh().await?;
        Ok(Recovery {
            sandbox,
            method: RecoveryMethod::BaseImage,
            possible: self.kind != PolicyKind::Off,
        })
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        Ok(())
    }
}

/// What users of containerd have today: a full checkpoint after every turn.
struct EveryTurn {
    launch: Launch,
    last: Option<(u32, String)>,
}

impl EveryTurn {
    fn reference(&self, turn: u32) -> String {
        format!("crab.local/replay/{}:turn-{turn}", self.launch.container_id)
    }
}

#[async_trait]
impl RecoveryPolicy for EveryTurn {
    fn kind(&self) -> PolicyKind {
        PolicyKind::EveryTurn
    }

    async fn after_turn(&mut self, sandbox: &Sandbox, turn: u32) -> Result<TurnCost, ReplayError> {
        // containerd 1.6 silently drops the task part of a checkpoint whose spec
        // blob already exists, so the previous checkpoint goes first (only the
        // latest is ever restored). Not counted as agent-visible: it could run
        // any time before the next checkpoint.
        if let Some((_, previous)) = self.last.take() {
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
        let blocking_s = started.elapsed().as_secs_f64();
        info!(
            container = sandbox.id(),
            turn,
            bytes = image.bytes,
            seconds = blocking_s,
            "checkpoint"
        );
        self.last = Some((turn, reference));
        Ok(TurnCost {
            blocking_s,
            bytes: image.bytes,
        })
    }

    async fn recover(&mut self, dead: Sandbox) -> Result<Recovery, ReplayError> {
        dead.remove().await?;
        let Some((turn, reference)) = self.last.clone() else {
            // Killed before the first checkpoint: the base image is all there is.
            let sandbox = self.launch.fresh().await?;
            return Ok(Recovery {
                sandbox,
                method: RecoveryMethod::BaseImage,
                possible: true,
            });
        };
        let sandbox = Sandbox::restore(
            &self.launch.ctr,
            &self.launch.container_id,
            &self.launch.spec,
            &reference,
        )
        .await?;
        Ok(Recovery {
            sandbox,
            method: RecoveryMethod::Checkpoint { turn },
            possible: true,
        })
    }

    async fn cleanup(&mut self) -> Result<(), ReplayError> {
        if let Some((_, reference)) = self.last.take() {
            remove_image(&self.launch.ctr, &reference).await?;
        }
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
        let error = "crab".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(error.contains("unknown policy \"crab\""), "{error}");
    }
}
