//! Garbage collection: keep the last K checkpoints of every container's chain (forks walk into
//! the chain they were forked from, so what they reference is kept through them), fold what lies
//! below the window into a snapshot, then delete unreferenced manifests, snapshots and blobs.
//! Chains retired because a new container reused their id (`<id>@<n>`, see
//! [`CheckpointStore::retire`]) share the id's window, after the current chain and newest first:
//! one left without a checkpoint in it is removed with its turn log and saved spec.
//!
//! Crash safety: snapshots are published before anything is deleted, and only unreferenced
//! files are deleted, so stopping at any point leaves every head restorable; the next run
//! finishes the job. GC holds the store lock exclusively, so no commit is between deduplicating
//! against a blob and referencing it.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::Path;

use tracing::info;

use super::chain::CheckpointStore;
use super::error::{CheckpointError, IoContext, Result};
use super::images;
use super::key::{self, SandboxKey};
use super::manifest::{ImageSet, MANIFEST_VERSION, Snapshot, direct_blobs, seal};
use super::store::{Digest, Durability, publish_file};
use super::sys;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Checkpoints kept per container, counted back from its head (at least 1).
    pub keep_last: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests_removed: u64,
    pub snapshots_written: u64,
    pub snapshots_removed: u64,
    pub blobs_removed: u64,
    pub bytes_freed: u64,
    pub tmp_files_removed: u64,
    /// Kept CRIU image directories of checkpoints no longer live.
    pub assembled_removed: u64,
    /// Retired chains (`<id>@<n>`) past the retention window, removed with their turn logs.
    pub retired_removed: u64,
}

/// Digest-named files in a directory (`<hex><suffix>`), with their paths; other names are
/// left alone.
fn digest_files(dir: &Path, prefix: &str, suffix: &str) -> Result<Vec<(Digest, std::path::PathBuf)>> {
    let mut out = Vec::new();
    for dirent in fs::read_dir(dir).io_ctx("read dir", dir)? {
        let dirent = dirent.io_ctx("read dir", dir)?;
        let Ok(name) = dirent.file_name().into_string() else {
            continue;
        };
        let Some(hex) = name.strip_suffix(suffix) else {
            continue;
        };
        if let Ok(digest) = format!("{prefix}{hex}").parse::<Digest>() {
            out.push((digest, dirent.path()));
        }
    }
    Ok(out)
}

impl CheckpointStore {
    pub fn gc(&self, policy: &RetentionPolicy) -> Result<GcReport> {
        if policy.keep_last == 0 {
            return Err(CheckpointError::InvalidRequest("retention must keep at least one checkpoint".into()));
        }
        let _lock = self.lock(true)?;
        let mut report = GcReport::default();
        let mut live_manifests = HashSet::new();
        let mut live_snapshots = HashSet::new();
        let mut live_blobs = HashSet::new();

        // Each id's current chain, then the chains it retired, newest first.
        let mut by_id: BTreeMap<SandboxKey, Vec<SandboxKey>> = BTreeMap::new();
        for key in self.sandbox_keys()? {
            by_id.entry(key.current()).or_default().push(key);
        }
        let mut windows = Vec::new();
        for (_, mut generations) in by_id {
            generations.sort_by_key(|k| std::cmp::Reverse(k.generation().map_or(u64::MAX, u64::from)));
            let mut budget = policy.keep_last;
            for key in generations {
                if budget == 0 && key.generation().is_some() {
                    self.remove_retired(&key)?;
                    info!(chain = %key, "retired chain past the retention window removed");
                    report.retired_removed += 1;
                    continue;
                }
                let (_, chain) = self.chain(&key.to_string())?;
                let keep = chain.links.len().min(budget.max(1));
                budget = budget.saturating_sub(keep);
                windows.push((chain, keep));
            }
        }
        // Turn logs and specs of retired ids that never had a checkpoint: nothing to keep.
        for (dir, suffix) in [(self.state_dir().join("turns"), ".jsonl"), (self.state_dir().join("sandboxes"), ".json")]
        {
            for retired in key::keys_under(&dir, suffix)? {
                if retired.generation().is_some() && self.head(&retired.to_string())?.is_none() {
                    self.remove_retired(&retired)?;
                    report.retired_removed += 1;
                }
            }
        }

        for (chain, keep) in windows {
            for (id, manifest) in &chain.links[..keep] {
                live_manifests.insert(*id);
                self.collect_blobs(
                    direct_blobs(&manifest.fs_delta, manifest.images.as_ref()),
                    manifest.images.as_ref(),
                    &mut live_blobs,
                )?;
            }
            let oldest = keep - 1;
            let below_window = oldest + 1 < chain.links.len() || chain.snapshot.is_some();
            if !below_window {
                continue;
            }
            let (oldest_id, oldest_manifest) = &chain.links[oldest];
            let snapshot = match self.load_snapshot(oldest_id)? {
                Some(existing) => existing,
                None => {
                    let snapshot = Snapshot {
                        version: MANIFEST_VERSION,
                        at: *oldest_id,
                        turn: oldest_manifest.turn,
                        entries: chain.fold(oldest).into_values().collect(),
                        images: chain.images_at(oldest).map(|(turn, set)| (turn, set.clone())),
                    };
                    let (_, bytes) = seal(&snapshot, "snapshot")?;
                    publish_file(
                        &self.blobs().tmp_path("snapshot"),
                        &self.snapshot_path(oldest_id),
                        &bytes,
                        Durability::Flushed,
                    )?;
                    report.snapshots_written += 1;
                    snapshot
                }
            };
            live_snapshots.insert(*oldest_id);
            let images = snapshot.images.as_ref().map(|(_, set)| set);
            self.collect_blobs(direct_blobs(&snapshot.entries, images), images, &mut live_blobs)?;
        }

        for (id, path) in digest_files(self.manifests_dir(), "", ".json")? {
            if !live_manifests.contains(&id) {
                fs::remove_file(&path).io_ctx("remove", &path)?;
                self.forget_cached(&id);
                report.manifests_removed += 1;
            }
        }
        for (id, path) in digest_files(self.snapshots_dir(), "", ".json")? {
            if !live_snapshots.contains(&id) {
                fs::remove_file(&path).io_ctx("remove", &path)?;
                report.snapshots_removed += 1;
            }
        }
        // Kept image files of checkpoints that are gone, or of containers without a head.
        let heads: HashSet<SandboxKey> = self.sandbox_keys()?.into_iter().collect();
        let namespaces = fs::read_dir(self.assembled_dir()).into_iter().flatten().flatten();
        for namespace in namespaces {
            let ns = namespace.file_name().into_string().unwrap_or_default();
            for owner in fs::read_dir(namespace.path()).into_iter().flatten().flatten() {
                let has_head = owner
                    .file_name()
                    .to_str()
                    .and_then(|name| SandboxKey::from_name(&ns, name).ok())
                    .is_some_and(|k| heads.contains(&k));
                for (id, path) in digest_files(&owner.path(), "", "").unwrap_or_default() {
                    if !has_head || !live_manifests.contains(&id) {
                        let _ = fs::remove_dir_all(&path);
                        report.assembled_removed += 1;
                    }
                }
            }
        }
        let tmp = self.blobs().tmp_dir();
        for dirent in fs::read_dir(tmp).io_ctx("read dir", tmp)? {
            let path = dirent.io_ctx("read dir", tmp)?.path();
            fs::remove_file(&path).io_ctx("remove", &path)?;
            report.tmp_files_removed += 1;
        }
        for fan in 0..=255u8 {
            let prefix = format!("{fan:02x}");
            let dir = self.blobs().blobs_dir().join(&prefix);
            for (digest, path) in digest_files(&dir, &prefix, "")? {
                if !live_blobs.contains(&digest) {
                    let size = fs::symlink_metadata(&path).map(|m| m.len()).unwrap_or(0);
                    fs::remove_file(&path).io_ctx("remove", &path)?;
                    report.blobs_removed += 1;
                    report.bytes_freed += size;
                }
            }
        }
        for dir in [self.manifests_dir(), self.snapshots_dir()] {
            sys::fsync_dir(dir).io_ctx("fsync", dir)?;
        }
        info!(?report, keep_last = policy.keep_last, "checkpoint GC done");
        Ok(report)
    }

    fn collect_blobs<'a>(
        &self,
        direct: impl Iterator<Item = &'a Digest>,
        images: Option<&ImageSet>,
        live: &mut HashSet<Digest>,
    ) -> Result<()> {
        live.extend(direct.copied());
        if let Some(set) = images {
            images::referenced_blobs(set, self.blobs(), live)?;
        }
        Ok(())
    }
}
