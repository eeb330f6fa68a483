//! The per-sandbox checkpoint quota: the bytes a sandbox's chain references in the store, each
//! blob counted once however many of its checkpoints (or image chunks) share it. A blob shared
//! with another sandbox's chain counts for both: each chain would need it alone.
//!
//! The measure is the chain as [`CheckpointStore::walk`] sees it, history included: a file
//! written and deleted still costs what its checkpoint stored until GC's retention folds the
//! checkpoint away. A checkpoint that would take the chain over its quota is not published
//! (its tmp blobs are dropped, the head stays), so the bytes that put the sandbox over never
//! count; the turn's changes stay unpublished and later turns take them in as they are then
//! (a deleted file becomes a whiteout), so a sandbox that deletes the data is checkpointed again.

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::chain::{CheckpointStore, Head};
use super::error::Result;
use super::images;
use super::manifest::{FsEntry, ImageSet, direct_blobs};
use super::store::{Digest, WriteBatch};

const MIB: f64 = (1u64 << 20) as f64;

/// Why a checkpoint was refused: it would have taken its sandbox's chain over its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverQuota {
    /// Bytes the chain would reference with the refused checkpoint.
    pub used_bytes: u64,
    /// The sandbox's quota in bytes.
    pub quota_bytes: u64,
    /// Bytes the chain references without it (what its last checkpoint holds).
    pub held_bytes: u64,
}

impl fmt::Display for OverQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "over quota: used {:.1} MiB of {:.1} MiB (the chain holds {:.1} MiB, this checkpoint adds {:.1} MiB)",
            self.used_bytes as f64 / MIB,
            self.quota_bytes as f64 / MIB,
            self.held_bytes as f64 / MIB,
            self.used_bytes.saturating_sub(self.held_bytes) as f64 / MIB,
        )
    }
}

/// The blobs a chain references and their bytes together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ChainUsage {
    blobs: HashSet<Digest>,
    bytes: u64,
}

impl ChainUsage {
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Counts `blob` of `len` bytes unless the chain references it already.
    fn add(&mut self, blob: Digest, len: impl FnOnce() -> u64) {
        if self.blobs.insert(blob) {
            self.bytes = self.bytes.saturating_add(len());
        }
    }
}

/// What checking a staged checkpoint against its quota decided.
pub(crate) enum QuotaCheck {
    /// Within the quota: the chain's usage once the checkpoint is published.
    Fits(ChainUsage),
    Over(OverQuota),
}

impl CheckpointStore {
    /// Bytes `container`'s chain references in the store, each blob once: what its quota
    /// (`io.crab.max-sandbox-mib`) bounds. 0 for a sandbox without checkpoints.
    pub fn chain_bytes(&self, container: &str) -> Result<u64> {
        Ok(self.fresh_usage(container, self.head(container)?)?.bytes())
    }

    /// The usage of the chain ending at `head`, walked now (manifests GC removed since they
    /// were cached are read again, so a fold shows).
    fn fresh_usage(&self, container: &str, head: Option<Head>) -> Result<ChainUsage> {
        let mut usage = ChainUsage::default();
        let Some(head) = head else { return Ok(usage) };
        let chain = self.walk(container, head.manifest)?;
        let gone: Vec<Digest> =
            chain.links.iter().map(|(id, _)| *id).filter(|id| !self.manifest_path(id).exists()).collect();
        let chain = if gone.is_empty() {
            chain
        } else {
            gone.iter().for_each(|id| self.forget_cached(id));
            self.walk(container, head.manifest)?
        };
        let mut blobs = HashSet::new();
        for (_, manifest) in &chain.links {
            blobs.extend(direct_blobs(&manifest.fs_delta, manifest.images.as_ref()).copied());
            if let Some(set) = &manifest.images {
                images::referenced_blobs(set, self.blobs(), &mut blobs)?;
            }
        }
        if let Some(snapshot) = &chain.snapshot {
            let set = snapshot.images.as_ref().map(|(_, set)| set);
            blobs.extend(direct_blobs(&snapshot.entries, set).copied());
            if let Some(set) = set {
                images::referenced_blobs(set, self.blobs(), &mut blobs)?;
            }
        }
        for blob in blobs {
            // A missing blob breaks the chain, which verify reports; it holds no bytes.
            usage.add(blob, || self.blobs().size_of(&blob).ok().flatten().unwrap_or(0));
        }
        Ok(usage)
    }

    /// Checks a staged checkpoint (its delta and images, its new blobs still in `batch`)
    /// against `quota` bytes for the chain ending at `head`. The usage of the chain is kept
    /// between checkpoints (it grows by what each one adds); a refusal is decided on a fresh
    /// walk only, so a GC since cannot make a sandbox look fuller than it is.
    pub(crate) fn check_quota(
        &self,
        container: &str,
        head: Option<Head>,
        fs_delta: &[FsEntry],
        images: Option<&ImageSet>,
        batch: &WriteBatch<'_>,
        quota: u64,
    ) -> Result<QuotaCheck> {
        let mut new = HashSet::new();
        new.extend(direct_blobs(fs_delta, images).copied());
        if let Some(set) = images {
            images::referenced_blobs_read(set, &|digest| batch.read(digest), &mut new)?;
        }
        let len_of = |blob: &Digest| {
            batch.queued_len(blob).unwrap_or_else(|| self.blobs().size_of(blob).ok().flatten().unwrap_or(0))
        };
        let cached = head.and_then(|head| self.take_cached_usage(container, &head.manifest));
        let from_cache = cached.is_some();
        let mut usage = match cached {
            Some(usage) => usage,
            None => self.fresh_usage(container, head)?,
        };
        let with = |usage: &ChainUsage| {
            let mut grown = usage.clone();
            for blob in &new {
                grown.add(*blob, || len_of(blob));
            }
            grown
        };
        let mut grown = with(&usage);
        if grown.bytes() > quota && from_cache {
            usage = self.fresh_usage(container, head)?;
            grown = with(&usage);
        }
        if grown.bytes() > quota {
            let over = OverQuota { used_bytes: grown.bytes(), quota_bytes: quota, held_bytes: usage.bytes() };
            if let Some(head) = head {
                self.cache_usage(container, head.manifest, usage);
            }
            return Ok(QuotaCheck::Over(over));
        }
        Ok(QuotaCheck::Fits(grown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::TurnInput;
    use crate::error::CheckpointError;
    use crate::fsdelta::ChangedPath;

    const KIB: u64 = 1 << 10;

    fn store() -> (tempfile::TempDir, CheckpointStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path().join("state")).unwrap();
        std::fs::create_dir(dir.path().join("root")).unwrap();
        (dir, store)
    }

    /// Writes `files` (name, bytes) into the root and checkpoints them as `turn` under `quota`.
    fn turn(
        dir: &tempfile::TempDir,
        store: &CheckpointStore,
        turn: u64,
        files: &[(&str, Vec<u8>)],
        quota: Option<u64>,
    ) -> Result<crate::CommitReport> {
        let root = dir.path().join("root");
        let mut changed = Vec::new();
        for (name, data) in files {
            std::fs::write(root.join(name), data).unwrap();
            changed.push(ChangedPath::modified(format!("/{name}")));
        }
        let input = TurnInput { container: "q/c", turn, rootfs: Some(&root), changed: &changed, criu_images: None };
        let mut staged = store.stage_turn(&input)?;
        staged.set_quota(quota);
        store.publish(staged)
    }

    fn bytes(seed: u8, len: u64) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn a_blob_counts_once_however_many_turns_reference_it() {
        let (dir, store) = store();
        assert_eq!(store.chain_bytes("q/c").unwrap(), 0);
        turn(&dir, &store, 1, &[("a", bytes(1, 100 * KIB)), ("b", bytes(1, 100 * KIB))], None).unwrap();
        // Two files, one content: one blob.
        assert_eq!(store.chain_bytes("q/c").unwrap(), 100 * KIB);
        turn(&dir, &store, 2, &[("c", bytes(1, 100 * KIB)), ("d", bytes(2, 50 * KIB))], None).unwrap();
        assert_eq!(store.chain_bytes("q/c").unwrap(), 150 * KIB);
        // Overwritten: history still references the old content.
        turn(&dir, &store, 3, &[("a", bytes(3, 10 * KIB))], None).unwrap();
        assert_eq!(store.chain_bytes("q/c").unwrap(), 160 * KIB);
    }

    #[test]
    fn an_over_quota_checkpoint_is_refused_and_leaves_nothing() {
        let (dir, store) = store();
        let quota = Some(200 * KIB);
        turn(&dir, &store, 1, &[("a", bytes(1, 150 * KIB))], quota).unwrap();
        let blobs_before = count_files(&store.state_dir().join("blobs"));
        let err = turn(&dir, &store, 2, &[("big", bytes(2, 100 * KIB))], quota).unwrap_err();
        let CheckpointError::OverQuota { container, over } = &err else { panic!("{err}") };
        assert_eq!(container, "q/c");
        assert_eq!(*over, OverQuota { used_bytes: 250 * KIB, quota_bytes: 200 * KIB, held_bytes: 150 * KIB });
        let msg = err.to_string();
        assert!(msg.contains("over quota: used 0.2 MiB of 0.2 MiB"), "{msg}");
        // Nothing published, nothing left in tmp; the head and its restore are untouched.
        assert_eq!(store.head("q/c").unwrap().unwrap().turn, 1);
        assert_eq!(count_files(&store.state_dir().join("blobs")), blobs_before);
        assert_eq!(count_files(&store.state_dir().join("tmp")), 0);
        store.verify("q/c", 1).unwrap();
        // Content the chain already references costs nothing more: a copy of it fits.
        turn(&dir, &store, 3, &[("a2", bytes(1, 150 * KIB))], quota).unwrap();
        // Deleted (smaller) data fits again.
        turn(&dir, &store, 4, &[("big", bytes(4, 40 * KIB))], quota).unwrap();
        assert_eq!(store.chain_bytes("q/c").unwrap(), 190 * KIB);
    }

    #[test]
    fn the_kept_usage_follows_the_head_and_gc() {
        let (dir, store) = store();
        let quota = Some(300 * KIB);
        turn(&dir, &store, 1, &[("a", bytes(1, 200 * KIB))], quota).unwrap();
        turn(&dir, &store, 2, &[("a", bytes(2, 60 * KIB))], quota).unwrap();
        assert!(matches!(
            turn(&dir, &store, 3, &[("b", bytes(3, 60 * KIB))], quota),
            Err(CheckpointError::OverQuota { .. })
        ));
        // GC (here in the same process, as crabctl's in another) folds turn 1's content away.
        store.gc(&crate::RetentionPolicy { keep_last: 1 }).unwrap();
        assert_eq!(store.chain_bytes("q/c").unwrap(), 60 * KIB);
        turn(&dir, &store, 4, &[("b", bytes(3, 60 * KIB))], quota).unwrap();
        // Back to turn 2 (a rollback): the usage is the chain's at its new head.
        store.rewind("q/c", 2).unwrap();
        turn(&dir, &store, 5, &[("c", bytes(5, 230 * KIB))], quota).unwrap();
        assert_eq!(store.chain_bytes("q/c").unwrap(), 290 * KIB);
    }

    #[test]
    fn without_a_quota_anything_goes_and_a_zero_quota_nothing_new() {
        let (dir, store) = store();
        turn(&dir, &store, 1, &[("a", bytes(1, 300 * KIB))], None).unwrap();
        assert!(matches!(
            turn(&dir, &store, 2, &[("b", bytes(2, 300 * KIB))], Some(0)),
            Err(CheckpointError::OverQuota { .. })
        ));
        turn(&dir, &store, 3, &[("b", bytes(2, 300 * KIB))], None).unwrap();
    }

    fn count_files(dir: &std::path::Path) -> usize {
        walk(dir).len()
    }

    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() { out.extend(walk(&path)) } else { out.push(path) }
        }
        out
    }
}
