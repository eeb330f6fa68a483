//! The remote tier from the command line: `crabctl push` sends a sandbox's chain to the
//! registry of `[remote]` in crab.toml; `crabctl recover --from` and `crabctl fork --from`
//! bring one back on another node (only the objects its store lacks, every digest verified),
//! then restore through containerd as a local recover or fork does.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crab_remote::chain::{self, ChainSandbox, PushLog};
use crab_remote::{Credentials, Remote, RemoteIndex};
use serde::Serialize;

use crate::{Ctl, CtlError, RestoreReport, Result};

/// `<state_dir>/remote`: what this node knows of the registry (pack indexes, blob records)
/// and, per sandbox, which turns it holds.
pub fn remote_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("remote")
}

fn push_logs_dir(state_dir: &Path) -> PathBuf {
    remote_dir(state_dir).join("pushed")
}

/// A connection to the registry of `[remote]`, under `prefix` (default: the configured one).
pub fn connect(prefix: Option<&str>) -> Result<Remote> {
    let config = crab_config::Config::load(None)?;
    let settings = &config.remote;
    let prefix = match prefix {
        Some(p) => p.to_owned(),
        None if settings.enabled() => settings.prefix.clone(),
        None => {
            return Err(CtlError::Invalid(
                "no registry is configured: set [remote] prefix in crab.toml ($CRAB_CONFIG)".into(),
            ));
        }
    };
    let mut cfg = crab_remote::RemoteConfig::new(prefix);
    cfg.plain_http = settings.plain_http;
    cfg.ca_file = (!settings.ca_file.as_os_str().is_empty()).then(|| settings.ca_file.clone());
    cfg.credentials = Credentials::DockerConfig(
        (!settings.credentials_file.as_os_str().is_empty()).then(|| settings.credentials_file.clone()),
    );
    Ok(Remote::new(cfg)?)
}

#[derive(Debug, Serialize)]
pub struct PushedRow {
    pub turn: u64,
    pub reference: String,
    pub new_objects: u64,
    pub bytes_uploaded: u64,
    pub blobs_uploaded: u64,
    pub blobs_mounted: u64,
    pub blobs_present: u64,
}

#[derive(Debug, Serialize)]
pub struct PushSummary {
    pub container: String,
    pub repository: String,
    pub head_turn: u64,
    pub pushed: Vec<PushedRow>,
    /// Turns the registry held already.
    pub already: Vec<u64>,
    /// Bytes sent (blobs and manifests) by this push.
    pub bytes_uploaded: u64,
    /// Bytes the sandbox's turns wrote to the local store (its turn log), for comparison.
    pub local_bytes_written: u64,
    pub elapsed_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct PullSummary {
    pub reference: String,
    pub manifests_pulled: u64,
    pub blobs_pulled: u64,
    pub bytes_pulled: u64,
    pub objects_received: u64,
    pub packs_skipped: u64,
    pub elapsed_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct RemoteRestoreReport {
    #[serde(flatten)]
    pub restore: RestoreReport,
    /// None when the local store held the chain already.
    pub pull: Option<PullSummary>,
    pub total_ms: f64,
}

impl Ctl {
    fn push_log(&self, container: &str) -> Result<PushLog> {
        Ok(PushLog::load(&push_logs_dir(&self.state_dir), self.ctr.namespace(), container)?)
    }

    /// The turns of `container` the registry holds (by the push log; empty when never pushed).
    pub fn pushed_turns(&self, container: &str) -> Result<Option<std::collections::BTreeSet<u64>>> {
        let path = PushLog::path_in(&push_logs_dir(&self.state_dir), self.ctr.namespace(), container);
        if !path.is_file() {
            return Ok(None);
        }
        Ok(Some(self.push_log(container)?.turns.keys().copied().collect()))
    }

    /// Pushes every checkpointed turn of `container` the registry lacks.
    pub async fn push(&self, container: &str) -> Result<PushSummary> {
        let clock = Instant::now();
        let remote = connect(None)?;
        let key = self.key(container)?;
        let image = self.sandbox_info(container, None).await.ok().map(|info| info.image);
        let spec_path = crab_store::saved_spec_path_of(&self.state_dir, &key)?;
        let spec = std::fs::read(&spec_path).ok();
        let sandbox = ChainSandbox {
            namespace: self.ctr.namespace().to_owned(),
            sandbox: container.to_owned(),
            key,
            image,
            spec,
        };
        let mut index = RemoteIndex::open(&remote_dir(&self.state_dir).join("index"))?;
        let mut log = self.push_log(container)?;
        let report = chain::push_chain(&remote, &mut index, self.store.clone(), &sandbox, &mut log, None).await?;
        // The shim's queued pushes of these turns are done now (a sandbox gone from this node
        // leaves its entries behind; a push from here clears them).
        let queue = crab_remote::PushQueue::open(&remote_dir(&self.state_dir).join("queue"))?;
        for entry in queue.pending()? {
            if entry.namespace == sandbox.namespace && entry.sandbox == container && entry.turn <= report.head_turn {
                queue.complete(&entry)?;
            }
        }
        let local_bytes_written = self.turns(container).map(|t| t.iter().map(|r| r.bytes_written).sum()).unwrap_or(0);
        Ok(PushSummary {
            container: container.to_owned(),
            repository: format!("{}/{}", remote.registry(), remote.repository(&sandbox.namespace, container)),
            head_turn: report.head_turn,
            bytes_uploaded: report.bytes_uploaded(),
            pushed: report
                .pushed
                .iter()
                .map(|(turn, r)| PushedRow {
                    turn: *turn,
                    reference: r.reference.clone(),
                    new_objects: r.new_objects,
                    bytes_uploaded: r.bytes_uploaded + r.manifest_bytes,
                    blobs_uploaded: r.blobs_uploaded,
                    blobs_mounted: r.blobs_mounted,
                    blobs_present: r.blobs_present,
                })
                .collect(),
            already: report.already,
            local_bytes_written,
            elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Pulls `reference` (its turn, or the newest; `turn` must agree with the tag when both
    /// are given) into the local store as the chain of `container`. Returns the turn, the
    /// image the artifact names, and what the pull moved. Refused before anything is pulled
    /// when `container` already has a chain here.
    async fn pull(
        &self,
        container: &str,
        reference: &str,
        turn: Option<u64>,
    ) -> Result<(u64, Option<String>, PullSummary)> {
        let clock = Instant::now();
        let (prefix, namespace, sandbox, tagged) = chain::parse_reference(reference)?;
        let turn = match (tagged, turn) {
            (Some(a), Some(b)) if a != b => {
                return Err(CtlError::Invalid(format!("{reference} is turn {a}, but --turn {b} was asked for")));
            }
            (Some(t), _) | (None, Some(t)) => Some(t),
            (None, None) => None,
        };
        let key = self.key(container)?;
        if let Some(head) = self.store.head(&key)? {
            return Err(CtlError::Invalid(format!(
                "{container:?} already has a chain in {} (head turn {}): nothing is pulled over it; \
                 recover it without --from, or pull into another name",
                self.state_dir.display(),
                head.turn
            )));
        }
        let remote = connect(Some(&prefix))?;
        let turn =
            match turn {
                Some(t) => t,
                None => *remote.list_turns(&namespace, &sandbox).await?.last().ok_or_else(|| {
                    CtlError::Invalid(format!("{reference}: the repository holds no checkpointed turn"))
                })?,
            };
        let store = self.store.clone();
        let report = chain::pull_chain(&remote, &namespace, &sandbox, turn, &store, &key).await?;
        if let Some(spec) = &report.spec {
            let path = crab_store::saved_spec_path_of(&self.state_dir, &key)?;
            if !path.exists() {
                write_file(&path, spec)?;
            }
        }
        Ok((
            turn,
            report.image.clone(),
            PullSummary {
                reference: report.reference,
                manifests_pulled: report.manifests_pulled,
                blobs_pulled: report.blobs_pulled,
                bytes_pulled: report.bytes_pulled,
                objects_received: report.objects_received,
                packs_skipped: report.packs_skipped,
                elapsed_ms: clock.elapsed().as_secs_f64() * 1e3,
            },
        ))
    }

    /// `recover --from`: the sandbox's chain from the registry, then a recover as after a node loss.
    pub async fn recover_from(
        &self,
        container: &str,
        reference: &str,
        image: Option<&str>,
    ) -> Result<RemoteRestoreReport> {
        let clock = Instant::now();
        let (_, pulled_image, pull) = self.pull(container, reference, None).await?;
        let image = image.map(str::to_owned).or(pulled_image).ok_or_else(|| {
            CtlError::Invalid(format!("{reference} names no image: give the sandbox's image with --image"))
        })?;
        let restore = self.recover(container, Some(&image)).await?;
        Ok(RemoteRestoreReport { restore, pull: Some(pull), total_ms: clock.elapsed().as_secs_f64() * 1e3 })
    }

    /// `fork --from`: `source`'s chain from the registry (unless the local store holds turn
    /// `turn` of it already), then a fork as today.
    pub async fn fork_from(
        &self,
        source: &str,
        turn: u64,
        new: &str,
        reference: &str,
        image: Option<&str>,
    ) -> Result<RemoteRestoreReport> {
        let clock = Instant::now();
        let held = self.store.history(&self.key(source)?).is_ok_and(|h| h.iter().any(|c| c.turn == turn));
        let (pull, pulled_image) = if held {
            (None, None)
        } else {
            let (_, image, pull) = self.pull(source, reference, Some(turn)).await?;
            (Some(pull), image)
        };
        let image = image.map(str::to_owned).or(pulled_image);
        let restore = self.fork_with_image(source, turn, new, image.as_deref()).await?;
        Ok(RemoteRestoreReport { restore, pull, total_ms: clock.elapsed().as_secs_f64() * 1e3 })
    }
}

/// Writes a small file durably (tmp, fsync, rename, fsync of the directory), 0600.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |e: std::io::Error| CtlError::Invalid(format!("{}: {e}", path.display()));
    let dir = path.parent().ok_or_else(|| CtlError::Invalid(format!("{}: no directory", path.display())))?;
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut file =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(io)?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)
}
