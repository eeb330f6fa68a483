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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::info;

use super::chain::{CheckpointStore, KEPT_OWNER_FILE};
use super::error::{CheckpointError, IoContext, Result};
use super::images;
use super::index::{self, Table};
use super::key::{self, SandboxKey};
use super::manifest::{ImageSet, MANIFEST_VERSION, Snapshot, direct_blobs, seal};
use super::pack::{ClosedPack, PackBuilder, PackId, PackRef};
use super::store::{Digest, Durability, publish_file, publish_written};
use super::sys;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Checkpoints kept per container, counted back from its head (at least 1).
    pub keep_last: usize,
}

/// What containerd says exists, so that GC drops the chains of containers it removed (CRI's
/// RemoveContainer, a pod's deletion, `ctr c rm`). A chain is dropped, with its turn log, saved
/// spec, retired generations, pod owner record, emptied kept-image directory and (for a pod
/// sandbox) the record of the pod's current containers, once `keep_removed` has passed since a
/// GC first found its container gone (the time is kept in the store, `removed/<namespace>/<id>`); a container
/// that is back (an id created again) clears the mark. Manifests and blobs a fork or a
/// restored replacement still references stay: they are live through that chain.
#[derive(Debug, Clone)]
pub struct ContainerCensus {
    /// Each namespace containerd has, with the ids of its containers. Chains of a namespace it
    /// does not list are not judged: the store may be shared with another containerd.
    pub namespaces: BTreeMap<String, HashSet<String>>,
    /// How long a removed container's chain is kept after a GC first found it gone.
    pub keep_removed: Duration,
    /// When containerd was asked.
    pub now: SystemTime,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests_removed: u64,
    pub snapshots_written: u64,
    pub snapshots_removed: u64,
    pub blobs_removed: u64,
    pub bytes_freed: u64,
    pub tmp_files_removed: u64,
    /// Packs none of whose blobs is live any more, removed.
    pub packs_removed: u64,
    /// Packs mostly dead, rewritten with their live blobs alone.
    pub packs_rewritten: u64,
    /// Kept CRIU image directories of checkpoints no longer live.
    pub assembled_removed: u64,
    /// Other stores' directories under the kept images directory whose state directory is
    /// gone, removed with their copies (on a tmpfs they are memory nobody would free).
    pub orphaned_kept_removed: u64,
    /// Retired chains (`<id>@<n>`) past the retention window, removed with their turn logs.
    pub retired_removed: u64,
    /// Sandboxes whose container containerd no longer has, first found gone by this GC.
    pub removed_marked: u64,
    /// Sandboxes whose container was removed more than `keep_removed` ago: every chain of
    /// the id dropped, with turn logs and saved specs.
    pub removed_dropped: u64,
}

/// A pack up to this size is rewritten as soon as any of its blobs is dead: a turn's pack of
/// small files costs little to copy, and a dead blob in it would otherwise stay found (and
/// counted) until most of the pack is dead.
const REWRITE_ANY_DEAD_UNDER: u64 = 1 << 20;

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

/// Seconds since the epoch of `time` (0 before it).
fn unix_secs(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

impl CheckpointStore {
    /// Collects by the retention window only: containers containerd removed keep their chains.
    pub fn gc(&self, policy: &RetentionPolicy) -> Result<GcReport> {
        self.gc_with(policy, None)
    }

    /// [`Self::gc`], and with a census of containerd's containers, drops the chains of those
    /// removed longer than its `keep_removed` ago.
    pub fn gc_with(&self, policy: &RetentionPolicy, census: Option<&ContainerCensus>) -> Result<GcReport> {
        if policy.keep_last == 0 {
            return Err(CheckpointError::InvalidRequest("retention must keep at least one checkpoint".into()));
        }
        let _lock = self.lock(true)?;
        let mut report = GcReport::default();
        let removed = match census {
            Some(census) => self.judge_removed(census, &mut report)?,
            None => HashSet::new(),
        };
        let mut dropped = HashSet::new();
        let mut live_manifests = HashSet::new();
        let mut live_snapshots = HashSet::new();
        let mut live_blobs = HashSet::new();

        // Each id's current chain, then the chains it retired, newest first.
        let mut by_id: BTreeMap<SandboxKey, Vec<SandboxKey>> = BTreeMap::new();
        for key in self.sandbox_keys()? {
            by_id.entry(key.current()).or_default().push(key);
        }
        let mut windows = Vec::new();
        for (id, mut generations) in by_id {
            if removed.contains(&id) {
                for key in &generations {
                    self.remove_chain(key)?;
                }
                info!(sandbox = %id, chains = generations.len(), "chains of a container removed from containerd dropped");
                dropped.insert(id);
                continue;
            }
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
                if removed.contains(&retired.current()) {
                    // A removed container that never had a checkpoint: only its log and spec.
                    self.remove_chain(&retired)?;
                    dropped.insert(retired.current());
                } else if retired.generation().is_some() && self.head(&retired.to_string())?.is_none() {
                    self.remove_retired(&retired)?;
                    report.retired_removed += 1;
                }
            }
        }
        // The records kept per container id beside its chains: its pod owner and, for a pod
        // sandbox, its current container of each name. Nothing reads them once containerd has
        // removed the container (or the pod), so they go with it.
        for id in &removed {
            // Also the removal mark of an id known only by these records.
            self.remove_chain(id)?;
            self.remove_owner(id)?;
            self.remove_pod_members(id)?;
            dropped.insert(id.clone());
        }
        report.removed_dropped = dropped.len() as u64;

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
                        shells: chain.shell_listings_at(oldest),
                        next_pid: chain.next_pid_at(oldest),
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
                if !has_head {
                    // Its directory too, now empty (left alone when it is not).
                    let _ = fs::remove_dir(owner.path());
                }
            }
        }
        report.orphaned_kept_removed = self.remove_orphaned_kept_dirs();
        let tmp = self.blobs().tmp_dir();
        for dirent in fs::read_dir(tmp).io_ctx("read dir", tmp)? {
            let path = dirent.io_ctx("read dir", tmp)?.path();
            fs::remove_file(&path).io_ctx("remove", &path)?;
            report.tmp_files_removed += 1;
        }
        // Blob names no live checkpoint uses go: large blobs' files, and the links of packed
        // blobs a store written before pack tables has (a live one says its pack holds a live
        // blob).
        let mut live_packed: HashMap<PackId, Vec<(Digest, PackRef)>> = HashMap::new();
        let mut touched = Vec::new();
        for fan in 0..=255u8 {
            let prefix = format!("{fan:02x}");
            let dir = self.blobs().blobs_dir().join(&prefix);
            let mut removed_here = false;
            for (digest, path) in digest_files(&dir, &prefix, "")? {
                let packed = match self.blobs().tree_ref(&digest) {
                    Ok(packed) => packed,
                    // A link naming no place in a pack holds nothing: a live one stays (its
                    // checkpoint's restore names it), a dead one goes.
                    Err(CheckpointError::BadPackLink { .. }) => None,
                    Err(CheckpointError::MissingBlob { .. }) => continue,
                    Err(e) => return Err(e),
                };
                if live_blobs.contains(&digest) {
                    if let Some(at) = packed {
                        live_packed.entry(at.id).or_default().push((digest, at));
                    }
                    continue;
                }
                // A packed blob's bytes are freed with its pack, below.
                let size = if packed.is_some() { 0 } else { fs::symlink_metadata(&path).map(|m| m.len()).unwrap_or(0) };
                fs::remove_file(&path).io_ctx("remove", &path)?;
                report.blobs_removed += 1;
                report.bytes_freed += size;
                removed_here = true;
            }
            if removed_here {
                touched.push(dir);
            }
        }
        // The removed links are durable before any pack they pointed into goes: a crash must
        // not bring back a name whose bytes are gone.
        for dir in &touched {
            sys::fsync_dir(dir).io_ctx("fsync", dir)?;
        }
        self.collect_packs(&live_blobs, live_packed, &mut report)?;
        for dir in [self.manifests_dir(), self.snapshots_dir()] {
            sys::fsync_dir(dir).io_ctx("fsync", dir)?;
        }
        info!(?report, keep_last = policy.keep_last, "checkpoint GC done");
        Ok(report)
    }

    /// Removes each pack with no live blob and rewrites each whose live blobs are under half
    /// its bytes, a small one with any dead blob, or one that has no table yet (its blobs' names
    /// are links). A rewrite publishes
    /// the new pack and its table durably, then removes the links that named the old one,
    /// then the old pack's table and the old pack, so a reader finds each blob in the old pack
    /// or the new, both whole. A blob that does not hash to its name leaves its pack as it is:
    /// a rewrite must not launder it. Last, a merged table of the packs that stay replaces the
    /// older ones, which may name packs removed here.
    fn collect_packs(
        &self,
        live_blobs: &HashSet<Digest>,
        mut live: HashMap<PackId, Vec<(Digest, PackRef)>>,
        report: &mut GcReport,
    ) -> Result<()> {
        let packs_dir = self.blobs().packs_dir();
        // Listed before anything changes: a pack this pass writes is not judged.
        let listing = index::list(packs_dir)?;
        let mut dead: HashMap<PackId, u64> = HashMap::new();
        let mut unreadable = HashSet::new();
        for &id in &listing.indexed {
            let path = self.blobs().table_path(id);
            match Table::open(&path) {
                Ok(table) => {
                    for e in table.entries() {
                        if live_blobs.contains(&e.digest) {
                            live.entry(id).or_default().push((e.digest, e.at));
                        } else {
                            *dead.entry(id).or_default() += 1;
                        }
                    }
                }
                Err(e) => {
                    // Its live blobs read as missing; removing the pack would make that final.
                    tracing::warn!(error = %e, "pack left alone: its table is unusable");
                    unreadable.insert(id);
                }
            }
        }
        let mut removed = false;
        for &id in &listing.orphan_tables {
            let path = self.blobs().table_path(id);
            fs::remove_file(&path).io_ctx("remove", &path)?;
            removed = true;
        }
        for (&id, indexed) in
            listing.indexed.iter().map(|id| (id, true)).chain(listing.unindexed.iter().map(|id| (id, false)))
        {
            if unreadable.contains(&id) {
                continue;
            }
            let path = self.blobs().pack_path(id);
            let size = fs::symlink_metadata(&path).map(|m| m.len()).io_ctx("stat", &path)?;
            let blobs = live.get(&id).map(Vec::as_slice).unwrap_or_default();
            let live_bytes: u64 = blobs.iter().map(|(_, at)| at.len).sum();
            let dead_blobs = dead.get(&id).copied().unwrap_or(0);
            if blobs.is_empty() {
                if indexed {
                    let table = self.blobs().table_path(id);
                    fs::remove_file(&table).io_ctx("remove", &table)?;
                }
                fs::remove_file(&path).io_ctx("remove", &path)?;
                report.packs_removed += 1;
                report.blobs_removed += dead_blobs;
                report.bytes_freed += size;
                removed = true;
            } else if (!indexed || live_bytes * 2 < size || (dead_blobs > 0 && size <= REWRITE_ANY_DEAD_UNDER))
                && let Some(new_size) = self.rewrite_pack(id, indexed, blobs)?
            {
                report.packs_rewritten += 1;
                report.blobs_removed += dead_blobs;
                report.bytes_freed += size.saturating_sub(new_size);
                removed = true;
            }
        }
        if removed {
            sys::fsync_dir(packs_dir).io_ctx("fsync", packs_dir)?;
        }
        self.blobs().rebuild_index()
    }

    /// Copies `blobs` (each verified) out of the pack `old` into a new pack with its table,
    /// removes the links that named them in `old` (a pack without a table) and then `old`;
    /// returns the new pack's size, or None (nothing changed) when a blob does not hash to its
    /// name.
    fn rewrite_pack(&self, old: PackId, indexed: bool, blobs: &[(Digest, PackRef)]) -> Result<Option<u64>> {
        let old_path = self.blobs().pack_path(old);
        let source = fs::File::open(&old_path).io_ctx("open", &old_path)?;
        let mut blobs = blobs.to_vec();
        blobs.sort_by_key(|(_, at)| at.offset);
        blobs.dedup_by_key(|(digest, _)| *digest);
        let mut pack = PackBuilder::create(self.blobs().tmp_path("pack"))?;
        let tmp = pack.tmp.clone();
        let copied = (|| {
            for (digest, at) in &blobs {
                let mut data = vec![0u8; at.len as usize];
                std::os::unix::fs::FileExt::read_exact_at(&source, &mut data, at.offset).io_ctx("read", &old_path)?;
                if Digest::of(&data) != *digest {
                    tracing::warn!(blob = %digest, pack = %old_path.display(), "blob does not hash to its name: its pack is not rewritten");
                    return Ok(false);
                }
                pack.append(*digest, &data)?;
            }
            Ok(true)
        })();
        if !matches!(copied, Ok(true)) {
            let _ = fs::remove_file(&tmp);
            return copied.map(|_| None);
        }
        let ClosedPack { tmp, id, places } = match pack.finish() {
            Ok(done) => done,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        // Every blob of a pack without a table is live, in its order: the same pack, which only
        // needs its table.
        let same = id == old;
        if same {
            fs::remove_file(&tmp).io_ctx("remove", &tmp)?;
        }
        let (table_tmp, _) = self.blobs().write_table(id, &places)?;
        let mut files = vec![(table_tmp.clone(), self.blobs().table_path(id))];
        if !same {
            files.insert(0, (tmp.clone(), self.blobs().pack_path(id)));
        }
        if let Err(e) = publish_written(&files) {
            let _ = fs::remove_file(&tmp);
            let _ = fs::remove_file(&table_tmp);
            return Err(e);
        }
        if !indexed {
            let mut dirs = BTreeSet::new();
            for (digest, _) in &blobs {
                let name = self.blobs().path_of(digest);
                match fs::remove_file(&name) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).io_ctx("remove", &name),
                }
                dirs.insert(name.parent().expect("blob paths have a fan-out parent").to_owned());
            }
            for dir in &dirs {
                sys::fsync_dir(dir).io_ctx("fsync", dir)?;
            }
        }
        let new_path = self.blobs().pack_path(id);
        let new_size = fs::symlink_metadata(&new_path).io_ctx("stat", &new_path)?.len();
        if !same {
            if indexed {
                let table = self.blobs().table_path(old);
                fs::remove_file(&table).io_ctx("remove", &table)?;
            }
            fs::remove_file(&old_path).io_ctx("remove", &old_path)?;
        }
        Ok(Some(new_size))
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

impl CheckpointStore {
    /// Removes the directories beside this store's own under the kept images directory whose
    /// [`KEPT_OWNER_FILE`] names a state directory that no longer exists; returns how many.
    /// One without that file (made before stores named themselves there), or whose store still
    /// exists, is left alone. Copies are only an accelerator: a store that comes back at that
    /// path reassembles its restores from its chunks. Best effort: what cannot be read or
    /// removed is left for the next GC.
    fn remove_orphaned_kept_dirs(&self) -> u64 {
        let Ok(own) = fs::read_link(self.assembled_dir()) else { return 0 };
        let Some(kept_dir) = own.parent() else { return 0 };
        let mut removed = 0;
        for dirent in fs::read_dir(kept_dir).into_iter().flatten().flatten() {
            let dir = dirent.path();
            if dir == own || !dirent.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(owner) = fs::read(dir.join(KEPT_OWNER_FILE)) else { continue };
            let state_dir = Path::new(std::ffi::OsStr::from_bytes(&owner));
            if state_dir.is_absolute()
                && fs::symlink_metadata(state_dir).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
                && fs::remove_dir_all(&dir).is_ok()
            {
                info!(dir = %dir.display(), state_dir = %state_dir.display(), "removed the kept image copies of a store that is gone");
                removed += 1;
            }
        }
        removed
    }
}

impl CheckpointStore {
    /// Marks the sandboxes whose container the census lacks (when first found gone) and clears
    /// the mark of those it has; returns the ids (current keys) gone for `keep_removed` or more.
    fn judge_removed(&self, census: &ContainerCensus, report: &mut GcReport) -> Result<HashSet<SandboxKey>> {
        let state_dir = self.state_dir();
        let mut ids: BTreeSet<SandboxKey> = self.sandbox_keys()?.iter().map(SandboxKey::current).collect();
        for (dir, suffix) in [
            (state_dir.join("turns"), ".jsonl"),
            (state_dir.join("sandboxes"), ".json"),
            (state_dir.join("owners"), ""),
            (state_dir.join("pods"), ""),
        ] {
            ids.extend(key::keys_under(&dir, suffix)?.iter().map(SandboxKey::current));
        }
        let now = unix_secs(census.now);
        let mut expired = HashSet::new();
        for id in ids {
            let Some(live) = census.namespaces.get(id.namespace()) else { continue };
            let marker = key::removed_marker_path(state_dir, &id);
            if live.contains(id.id()) {
                match fs::remove_file(&marker) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).io_ctx("remove", &marker),
                    _ => {}
                }
                continue;
            }
            // A mark that does not read as a time is taken as made now: that only delays a drop.
            let since = match fs::read_to_string(&marker) {
                Ok(text) => text.trim().parse::<u64>().ok(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(e).io_ctx("read", &marker),
            };
            let since = match since {
                Some(since) => since,
                None => {
                    if let Some(dir) = marker.parent() {
                        sys::create_private_dir_all(dir).io_ctx("create dir", dir)?;
                    }
                    let tmp = self.blobs().tmp_path("removed");
                    publish_file(&tmp, &marker, now.to_string().as_bytes(), Durability::Flushed)?;
                    info!(sandbox = %id, "containerd no longer has this container: its chain is dropped after the retention for removed containers");
                    report.removed_marked += 1;
                    now
                }
            };
            if now.saturating_sub(since) >= census.keep_removed.as_secs() {
                expired.insert(id);
            }
        }
        Ok(expired)
    }
}
