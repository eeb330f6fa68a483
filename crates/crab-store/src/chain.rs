//! The checkpoint store proper: per-container chains of manifests over the blob store.
//!
//! Layout under the state directory:
//! - `blobs/<2 hex>/<62 hex>`: content-addressed blobs ([`BlobStore`]): a file each for blobs over
//!   64 KiB, a link to a place in a pack for the smaller ones;
//! - `packs/<16 hex>.pack`: the small blobs of one write batch, one after another
//!   ([`super::pack`]);
//! - `manifests/<sha256>.json`: sealed manifests, named by the hash of their body;
//! - `snapshots/<sha256>.json`: a folded chain prefix ending at that manifest (written by GC);
//! - `containers/<namespace>/<id>/HEAD`: the container's current checkpoint, updated last
//!   (per-sandbox paths are keyed by containerd namespace and id, see [`super::key`]);
//! - `assembled/<namespace>/<id>/<sha256>/`: the CRIU image files of container `<id>`'s newest published
//!   process checkpoint (manifest `<sha256>`), hard links to the files CRIU wrote, so that a
//!   restore can check them against the manifest and link them instead of reassembling every
//!   chunk. Only an accelerator: never flushed by itself, never trusted unchecked, replaced by
//!   the chunks when it fails the check, lost with a reboot. `assembled` may be a symbolic link
//!   to a directory on another file system ([`KeptImages`]: tmpfs under /run, so that neither
//!   the dump nor its kept copy is ever written to disk); the engine's dumps are written beside
//!   it (`assembled/<namespace>/<id>/.dump-<turn>`, [`CheckpointStore::dump_path`]) so that a link, not a
//!   copy, keeps them;
//! - `tmp/`: files being written; `lock`: shared by writers, exclusive for GC;
//! - `layout`: says the per-sandbox paths have the namespace level ([`super::key::migrate_legacy_layout`]).
//!
//! Every `container` argument below is a sandbox key, `[<namespace>/]<id>[@<generation>]`
//! ([`SandboxKey`]); the shim always names the namespace.
//!
//! A manifest names its parent by hash, so a chain is immutable once written; forks are heads
//! of other containers pointing into the same chain.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::error::{CheckpointError, IoContext, Result};
use super::fsdelta::{self, Applier, ApplyStats, ChangedPath, Root};
use super::images::{self, RestoredImages};
use super::key::{self, SandboxKey};
use super::manifest::{
    FsEntry, FsNode, ImageSet, MANIFEST_VERSION, Manifest, ParentRef, ShellState, Snapshot, TurnClass, direct_blobs,
    seal, unseal,
};
use super::mounts::{self, ContainerMount};
use super::path::RelPath;
use super::quota::{ChainUsage, QuotaCheck};
use super::store::{BlobStore, Digest, Durability, PendingBlobs, Traffic, Unlimited, WriteTokens, publish_file};
use super::sys;

pub const DEFAULT_STATE_DIR: &str = "/var/lib/crab";

/// Where a container's chain currently ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub manifest: Digest,
    pub turn: u64,
}

/// One turn to checkpoint. The class follows from the inputs: no changes and no images is a
/// clean turn, changes only an fs turn, images a proc turn.
#[derive(Debug, Clone, Copy)]
pub struct TurnInput<'a> {
    pub container: &'a str,
    pub turn: u64,
    /// The container's root as seen from the host (e.g. `/proc/<pid>/root`); needed when
    /// `changed` is not empty.
    pub rootfs: Option<&'a Path>,
    pub changed: &'a [ChangedPath],
    /// A directory written by `criu dump`.
    pub criu_images: Option<&'a Path>,
}

/// A shell session a restore brings back through its process images, and what to bring it to
/// afterwards: the state the images hold (`base`, None when the images' turn listed none) and
/// the newest listed at or below the restored turn (the same as `base` when that is the
/// images' turn).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellRestore {
    pub base: Option<ShellState>,
    pub target: ShellState,
    pub target_turn: u64,
    pub images_turn: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitReport {
    pub id: Digest,
    pub turn: u64,
    pub class: TurnClass,
    pub fs_entries: usize,
    /// Blob traffic of this turn: logical bytes captured versus new bytes written.
    pub traffic: Traffic,
    pub manifest_bytes: u64,
}

/// A turn captured but not yet written out (see [`CheckpointStore::stage_turn`]). It holds the
/// store's shared lock, so GC leaves its tmp blobs alone until it is published or dropped.
pub struct StagedTurn {
    container: String,
    turn: u64,
    class: TurnClass,
    fs_delta: Vec<FsEntry>,
    blobs: PendingBlobs,
    criu_images: Option<PathBuf>,
    /// Bytes the sandbox's chain may reference with this checkpoint (None: no bound).
    quota: Option<u64>,
    shells: Vec<ShellState>,
    next_pid: Option<u32>,
    _lock: File,
}

/// The store's shared lock, held by a writer that puts blobs and manifests into the store
/// outside [`CheckpointStore::stage_turn`] (a pull from the remote tier, which writes its
/// objects, then manifests, then the head). GC takes the lock exclusively and collects every
/// blob, pack, tmp file and manifest no head names, which is all of such a writer's work until
/// its head is set: while this is held GC waits, as it does for a staged turn. Released on drop.
pub struct WriterLock {
    _lock: File,
}

impl StagedTurn {
    /// Bounds the bytes the sandbox's chain may reference once this checkpoint is published
    /// (see [`CheckpointStore::chain_bytes`]); over it, [`CheckpointStore::publish`] refuses
    /// the checkpoint with [`CheckpointError::OverQuota`] before anything of it is written.
    pub fn set_quota(&mut self, quota_bytes: Option<u64>) {
        self.quota = quota_bytes;
    }

    /// The shell states this checkpoint lists (see [`Manifest::shells`]). A turn that changed
    /// no file still needs a manifest for them: it is published as a file-system turn.
    pub fn set_shells(&mut self, shells: Vec<ShellState>) {
        if !shells.is_empty() && self.class == TurnClass::Clean {
            self.class = TurnClass::Fs;
        }
        self.shells = shells;
    }

    /// The container's pid cursor after this turn (see [`Manifest::next_pid`]).
    pub fn set_next_pid(&mut self, next_pid: Option<u32>) {
        self.next_pid = next_pid;
    }

    pub fn turn(&self) -> u64 {
        self.turn
    }

    pub fn class(&self) -> TurnClass {
        self.class
    }

    /// New blob bytes captured so far (CRIU images not counted: they are chunked at write-out).
    pub fn staged_bytes(&self) -> u64 {
        self.blobs.new_bytes()
    }

    pub fn criu_images(&self) -> Option<&Path> {
        self.criu_images.as_deref()
    }

    /// An upper bound of what the write-out writes, for bandwidth accounting: the staged blobs
    /// plus every CRIU image byte (chunk dedup only shows at write-out).
    pub fn estimated_write_bytes(&self) -> u64 {
        let images = self.criu_images.as_deref().map_or(0, |dir| {
            fs::read_dir(dir).into_iter().flatten().filter_map(|d| d.ok()?.metadata().ok()).map(|m| m.len()).sum()
        });
        self.staged_bytes() + images
    }
}

/// A summary of one checkpoint in a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub id: Digest,
    pub turn: u64,
    pub class: TurnClass,
    pub created_unix_ms: u64,
    pub fs_entries: usize,
    pub has_images: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct RollbackRequest<'a> {
    pub container: &'a str,
    pub to_turn: u64,
    /// The live root to put back (e.g. `/proc/<pid>/root` of the paused container).
    pub root: &'a Path,
    /// The image rootfs the container started from; needed for paths the chain never recorded
    /// before `to_turn`.
    pub base: Option<&'a Path>,
    /// Paths changed since the head checkpoint that no checkpoint recorded.
    pub uncommitted: &'a [ChangedPath],
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackReport {
    pub from_turn: u64,
    pub to_turn: u64,
    /// Distinct paths changed after `to_turn`.
    pub changed_paths: usize,
    pub stats: ApplyStats,
    pub head: Head,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub manifests: u64,
    pub blobs: u64,
    pub bytes: u64,
}

/// A resolved chain, newest link first.
pub(crate) struct Chain {
    pub(crate) links: Vec<(Digest, Arc<Manifest>)>,
    /// The folded state of the oldest link, when GC dropped its ancestors.
    pub(crate) snapshot: Option<Arc<Snapshot>>,
}

/// The process images a turn restores from: the turn that dumped them, the set, and the
/// manifest holding it with its digest (None when the set comes from a snapshot).
pub(crate) type ImagesSource<'a> = (u64, &'a ImageSet, Option<(&'a Digest, &'a Manifest)>);

impl Chain {
    fn index_of(&self, container: &str, turn: u64) -> Result<usize> {
        self.links
            .iter()
            .position(|(_, m)| m.turn == turn)
            .ok_or_else(|| CheckpointError::NoSuchTurn { container: container.to_owned(), turn })
    }

    /// The state of every path ever recorded, as of link `index`: snapshot (if any) plus the
    /// deltas from the oldest link up to `index`, later entries replacing earlier ones.
    pub(crate) fn fold(&self, index: usize) -> BTreeMap<RelPath, FsEntry> {
        let mut state = BTreeMap::new();
        // Which delta each path's entry comes from (the snapshot is delta 0): the names of one
        // inode are recorded together, in one delta.
        let mut origin: HashMap<RelPath, usize> = HashMap::new();
        let mut oldest = self.links.len();
        if let Some(snapshot) = &self.snapshot {
            for entry in &snapshot.entries {
                fold_entry(&mut state, entry);
                origin.insert(entry.path.clone(), 0);
            }
            oldest -= 1;
        }
        for (delta, (_, manifest)) in self.links[index..oldest].iter().rev().enumerate() {
            for entry in &manifest.fs_delta {
                fold_entry(&mut state, entry);
                origin.insert(entry.path.clone(), delta + 1);
            }
        }
        regroup_links(&mut state, &origin);
        state
    }

    /// [`images_at`](Self::images_at), with the manifest holding the set (None when the set
    /// comes from a snapshot).
    pub(crate) fn images_source_at(&self, index: usize) -> Option<ImagesSource<'_>> {
        for (id, manifest) in &self.links[index..] {
            if let Some(set) = &manifest.images {
                return Some((manifest.turn, set, Some((id, manifest.as_ref()))));
            }
        }
        self.snapshot.as_ref().and_then(|s| s.images.as_ref().map(|(turn, set)| (*turn, set, None)))
    }

    /// What a restore of link `index` must tell each shell session its process images hold
    /// (see [`ShellRestore`]). Empty without images: then no shell comes back at all.
    pub(crate) fn shells_at(&self, index: usize) -> Vec<ShellRestore> {
        let Some((images_turn, _)) = self.images_at(index) else { return Vec::new() };
        let listed = self.links[index..].iter().flat_map(|(_, m)| m.shells.iter().map(move |s| (m.turn, s)));
        let folded = self.snapshot.iter().flat_map(|s| s.shells.iter().map(|(turn, shell)| (*turn, shell)));
        // Newest first: the first listing of a session is its target.
        let mut targets: Vec<(u64, &ShellState)> = Vec::new();
        let mut bases: HashMap<&str, &ShellState> = HashMap::new();
        for (turn, shell) in listed.chain(folded) {
            if turn < images_turn {
                break;
            }
            if !targets.iter().any(|(_, t)| t.exec_id == shell.exec_id) {
                targets.push((turn, shell));
            }
            if turn == images_turn {
                bases.entry(shell.exec_id.as_str()).or_insert(shell);
            }
        }
        targets
            .into_iter()
            .map(|(turn, target)| {
                let base = bases.get(target.exec_id.as_str()).copied();
                // A listing relative to the images' own is completed from it; one relative to
                // another turn's (whose dump never became these images) cannot be brought back.
                match base.and_then(|b| Some((b, target.completed(b, images_turn)?))) {
                    Some((base, whole)) => {
                        ShellRestore { base: Some(base.clone()), target: whole, target_turn: turn, images_turn }
                    }
                    None => ShellRestore { base: None, target: target.clone(), target_turn: turn, images_turn },
                }
            })
            .collect()
    }

    /// The pid cursor a restore of link `index` sets when a turn after its images' moved it
    /// (see [`Manifest::next_pid`]): the newest such turn's. None leaves the cursor the dump
    /// recorded beside the images, or none without images.
    pub(crate) fn next_pid_at(&self, index: usize) -> Option<u32> {
        let (images_turn, _) = self.images_at(index)?;
        let listed = self.links[index..].iter().map(|(_, m)| (m.turn, m.next_pid));
        let folded = self.snapshot.iter().map(|s| (s.turn, s.next_pid));
        listed.chain(folded).take_while(|(turn, _)| *turn > images_turn).find_map(|(_, next)| next)
    }

    /// Every listing a restore of link `index` may need (see [`shells_at`](Self::shells_at)),
    /// with its turn: what a snapshot at `index` keeps.
    pub(crate) fn shell_listings_at(&self, index: usize) -> Vec<(u64, ShellState)> {
        let Some((images_turn, _)) = self.images_at(index) else { return Vec::new() };
        let listed = self.links[index..].iter().flat_map(|(_, m)| m.shells.iter().map(move |s| (m.turn, s)));
        let folded = self.snapshot.iter().flat_map(|s| s.shells.iter().map(|(turn, shell)| (*turn, shell)));
        let mut kept: Vec<(u64, ShellState)> = Vec::new();
        for (turn, shell) in listed.chain(folded) {
            if turn < images_turn {
                break;
            }
            let newest = !kept.iter().any(|(_, k)| k.exec_id == shell.exec_id);
            if newest || turn == images_turn {
                kept.push((turn, shell.clone()));
            }
        }
        kept
    }

    /// The newest image set at or below link `index`, with its turn.
    pub(crate) fn images_at(&self, index: usize) -> Option<(u64, &ImageSet)> {
        for (_, manifest) in &self.links[index..] {
            if let Some(set) = &manifest.images {
                return Some((manifest.turn, set));
            }
        }
        self.snapshot.as_ref().and_then(|s| s.images.as_ref().map(|(turn, set)| (*turn, set)))
    }
}

fn fold_entry(state: &mut BTreeMap<RelPath, FsEntry>, entry: &FsEntry) {
    let mut entry = entry.clone();
    // A directory recorded where something else was, or where a directory was removed, was
    // recreated: its content is only what the deltas say from here on.
    if let (FsNode::Dir { complete, .. }, Some(old)) = (&mut entry.node, state.get(&entry.path)) {
        *complete |= old.node.replaces_subtree();
    }
    if entry.node.replaces_subtree() {
        let (lo, hi) = entry.path.descendant_bounds();
        let doomed: Vec<RelPath> = state.range(lo..hi).map(|(k, _)| k.clone()).collect();
        for key in doomed {
            state.remove(&key);
        }
    }
    state.insert(entry.path.clone(), entry);
}

/// Makes every group of hard links in a folded state whole again. A group is the names one delta
/// recorded for one inode: its first name a file, the others links to it. A later delta may
/// have removed or replaced some of them, the first one included; the names left are still
/// one inode, so the first of them becomes the file and the others link to it. A link whose
/// first name now holds another delta's entry never links to that newer file.
fn regroup_links(state: &mut BTreeMap<RelPath, FsEntry>, origin: &HashMap<RelPath, usize>) {
    let mut groups: BTreeMap<(usize, RelPath), Vec<RelPath>> = BTreeMap::new();
    for (path, entry) in state.iter() {
        if let FsNode::Hardlink { link_to, .. } = &entry.node {
            let from = origin.get(path).copied().unwrap_or(0);
            groups.entry((from, link_to.clone())).or_default().push(path.clone());
        }
    }
    let mut regrouped: Vec<Vec<RelPath>> = Vec::new();
    for ((from, link_to), mut names) in groups {
        let leader_here = matches!(state.get(&link_to), Some(FsEntry { node: FsNode::File { .. }, .. }))
            && origin.get(&link_to).copied().unwrap_or(0) == from;
        if leader_here {
            if names.iter().all(|n| *n > link_to) {
                continue;
            }
            names.push(link_to);
        }
        regrouped.push(names);
    }
    if regrouped.is_empty() {
        return;
    }
    let mut entries: Vec<FsEntry> = std::mem::take(state).into_values().collect();
    fsdelta::relink_groups(&mut entries, regrouped.iter().map(Vec::as_slice));
    state.extend(entries.into_iter().map(|e| (e.path.clone(), e)));
}

/// The other names, in `state`, of the hard-linked files among `paths` (a file and every link
/// to it are one group).
fn link_partners<'p>(state: &BTreeMap<RelPath, FsEntry>, paths: impl Iterator<Item = &'p RelPath>) -> Vec<RelPath> {
    let mut members: HashMap<&RelPath, Vec<&RelPath>> = HashMap::new();
    for (path, entry) in state {
        if let FsNode::Hardlink { link_to, .. } = &entry.node {
            members.entry(link_to).or_default().push(path);
        }
    }
    let mut out = Vec::new();
    for path in paths {
        let leader = match state.get(path).map(|e| &e.node) {
            Some(FsNode::Hardlink { link_to, .. }) => link_to,
            Some(FsNode::File { .. }) => path,
            _ => continue,
        };
        let Some(names) = members.get(leader) else { continue };
        out.push(leader.clone());
        out.extend(names.iter().map(|n| (*n).clone()));
    }
    out
}

/// What a path was at the rollback target.
enum PastState<'f> {
    Recorded(&'f FsEntry),
    Absent,
    /// Never recorded: as in the base image.
    Base,
}

fn past_state<'f>(fold: &'f BTreeMap<RelPath, FsEntry>, rel: &RelPath) -> PastState<'f> {
    if let Some(entry) = fold.get(rel) {
        return match entry.node {
            FsNode::Whiteout => PastState::Absent,
            _ => PastState::Recorded(entry),
        };
    }
    for ancestor in rel.ancestors() {
        if fold.get(&ancestor).is_some_and(|e| e.node.replaces_subtree()) {
            return PastState::Absent;
        }
    }
    PastState::Base
}

pub struct CheckpointStore {
    state_dir: PathBuf,
    blobs: BlobStore,
    manifests: PathBuf,
    snapshots: PathBuf,
    containers: PathBuf,
    assembled: PathBuf,
    /// Most bytes all kept image copies of this store may hold together.
    kept_max_bytes: u64,
    cache: Mutex<HashMap<Digest, Arc<Manifest>>>,
    /// Per sandbox key: the usage of its chain at the head manifest it was counted for (see
    /// [`super::quota`]), so a checkpoint under a quota costs a walk of what it adds only.
    usage: Mutex<HashMap<String, (Digest, ChainUsage)>>,
}

/// Where a store keeps the newest CRIU images of each container assembled, and how much of
/// them. The copy is worth keeping only where it costs no write of its own: on the file
/// system the dumps are written to, which should be a tmpfs (the dump is then never written
/// to disk at all; only the chunks the store lacks are). On tmpfs the copies are memory, hence
/// the bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptImages {
    /// The directory (`None`: `assembled/` inside the state directory).
    pub dir: Option<PathBuf>,
    /// Bound on the bytes of all kept copies together; a dump that does not fit is not kept.
    pub max_bytes: u64,
}

impl Default for KeptImages {
    fn default() -> Self {
        Self { dir: None, max_bytes: u64::MAX }
    }
}

/// The sandbox a `container` argument names (see [`SandboxKey::parse`]).
pub(crate) fn sandbox_key(container: &str) -> Result<SandboxKey> {
    Ok(SandboxKey::parse(container)?)
}

/// Draws `bytes` from `tokens` in pieces of at most its chunk (nothing to draw when it paces nothing).
fn draw_in_chunks(tokens: &mut dyn WriteTokens, bytes: u64) -> Result<()> {
    let Some(chunk) = tokens.chunk_bytes() else { return Ok(()) };
    let mut left = bytes;
    while left > 0 {
        let piece = left.min(chunk.max(1));
        tokens.draw(piece)?;
        left -= piece;
    }
    Ok(())
}

fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The file in a store's directory under `kept_images_dir` that names the store's state
/// directory: how any store's GC tells a directory whose store is gone (a deleted state
/// directory, a test's temporary store) from a live one, since the names are hashes.
pub(crate) const KEPT_OWNER_FILE: &str = ".state-dir";

/// Writes [`KEPT_OWNER_FILE`] into `target` unless it names `state_dir` already; through a
/// rename, so that a GC never reads half a path and takes a live store's copies for orphans.
/// The temporary name is per call, not per process: a shim opens its store from several
/// tasks at once. Best effort: without the file a GC only leaves the directory alone, so a
/// failure is logged and the open goes on.
fn record_kept_owner(target: &Path, state_dir: &Path) {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let owner = target.join(KEPT_OWNER_FILE);
    let named = state_dir.as_os_str().as_encoded_bytes();
    if fs::read(&owner).is_ok_and(|bytes| bytes == named) {
        return;
    }
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = target.join(format!("{KEPT_OWNER_FILE}.{}-{n}.tmp", std::process::id()));
    if let Err(e) = fs::write(&tmp, named).and_then(|()| fs::rename(&tmp, &owner)) {
        let _ = fs::remove_file(&tmp);
        warn!(file = %owner.display(), error = %e, "could not name the store in its kept images directory");
    }
}

impl CheckpointStore {
    /// Opens (creating if needed) a store under `state_dir`. Kept image copies stay wherever
    /// the store's `assembled` entry points (see [`open_with`](Self::open_with)).
    pub fn open(state_dir: impl AsRef<Path>) -> Result<Self> {
        let state_dir = state_dir.as_ref().to_owned();
        sys::create_private_dir_all(&state_dir).io_ctx("create", &state_dir)?;
        // A store made by an older build (0755): nothing below is anyone else's business.
        let mode = fs::metadata(&state_dir).io_ctx("stat", &state_dir)?.permissions().mode();
        if mode & 0o077 != 0 {
            fs::set_permissions(&state_dir, fs::Permissions::from_mode(mode & 0o7700)).io_ctx("chmod", &state_dir)?;
        }
        let blobs = BlobStore::open(&state_dir)?;
        let manifests = state_dir.join("manifests");
        let snapshots = state_dir.join("snapshots");
        let containers = state_dir.join("containers");
        let assembled = state_dir.join("assembled");
        match fs::read_link(&assembled) {
            // Kept elsewhere; that directory may be gone (a tmpfs after a reboot): recreate it.
            Ok(target) => sys::create_private_dir_all(&target).io_ctx("create", &target)?,
            Err(_) if !assembled.is_dir() => sys::create_private_dir_all(&assembled).io_ctx("create", &assembled)?,
            Err(_) => {}
        }
        key::migrate_legacy_layout(&state_dir, &state_dir.join("lock"), &assembled)?;
        for dir in [&manifests, &snapshots, &containers] {
            if !dir.is_dir() {
                sys::create_private_dir_all(dir).io_ctx("create", dir)?;
                sys::fsync_dir(&state_dir).io_ctx("fsync", &state_dir)?;
            }
        }
        Ok(CheckpointStore {
            state_dir,
            blobs,
            manifests,
            snapshots,
            containers,
            assembled,
            kept_max_bytes: u64::MAX,
            cache: Mutex::new(HashMap::new()),
            usage: Mutex::new(HashMap::new()),
        })
    }

    /// Opens the store and keeps image copies as `kept` says. A directory of its own under
    /// `kept.dir` (named after the state directory, so stores sharing `kept.dir` stay apart)
    /// becomes the target of the store's `assembled` link; copies kept before in another place
    /// are dropped (they are only an accelerator).
    pub fn open_with(state_dir: impl AsRef<Path>, kept: &KeptImages) -> Result<Self> {
        let mut store = Self::open(state_dir)?;
        store.kept_max_bytes = kept.max_bytes;
        if let Some(dir) = &kept.dir {
            let absolute = fs::canonicalize(&store.state_dir).io_ctx("resolve", &store.state_dir)?;
            let key = Digest::of(absolute.as_os_str().as_encoded_bytes()).to_hex();
            let target = dir.join(&key[..16]);
            sys::create_private_dir_all(&target).io_ctx("create", &target)?;
            // Sandboxes' memory: root's alone, as the store is.
            {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(&target, fs::Permissions::from_mode(0o700)).io_ctx("chmod", &target)?;
            }
            record_kept_owner(&target, &absolute);
            if fs::read_link(&store.assembled).ok().as_deref() != Some(target.as_path()) {
                // Replaced by a rename, so that a concurrent open sees the old entry or the new
                // link, never neither.
                // Named per call, not per process: a shim opens its store from several tasks at
                // once, and a shared name let one open remove or move another's link.
                static OPENS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = OPENS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let link = store.state_dir.join(format!(".assembled-{}-{n}", std::process::id()));
                let _ = fs::remove_file(&link);
                std::os::unix::fs::symlink(&target, &link).io_ctx("symlink", &link)?;
                // A plain `open` that finds no `assembled` (in the window between moving a
                // directory aside and renaming the link in) makes it a directory again, and the
                // rename of a link over a directory fails ("Is a directory"): then the new
                // directory is moved aside too, a bounded number of times.
                let mut attempts = 0;
                loop {
                    attempts += 1;
                    if fs::symlink_metadata(&store.assembled).is_ok_and(|m| m.is_dir()) {
                        // Moved aside by a rename before it is removed: a concurrent open may put
                        // its link there meanwhile, and removing the path in place then failed
                        // ("Not a directory") halfway. What is moved aside (the directory, or that
                        // link) is removed; gone already (another open moved it) is as good.
                        let aside =
                            store.state_dir.join(format!(".assembled-old-{}-{n}-{attempts}", std::process::id()));
                        match fs::rename(&store.assembled, &aside) {
                            Ok(()) => {
                                let removed = if fs::symlink_metadata(&aside).is_ok_and(|m| m.is_dir()) {
                                    fs::remove_dir_all(&aside)
                                } else {
                                    fs::remove_file(&aside)
                                };
                                removed.io_ctx("remove", &aside)?;
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                            Err(e) => return Err(e).io_ctx("move aside", &store.assembled),
                        }
                    }
                    fail::fail_point!("assembled-moved-aside");
                    match fs::rename(&link, &store.assembled) {
                        Ok(()) => break,
                        Err(e) if e.raw_os_error() == Some(libc::EISDIR) && attempts < 4 => continue,
                        Err(e) => {
                            let _ = fs::remove_file(&link);
                            // A concurrent open that put the same link in place first is as good.
                            if fs::read_link(&store.assembled).ok().as_deref() != Some(target.as_path()) {
                                return Err(e).io_ctx("rename", &store.assembled);
                            }
                            break;
                        }
                    }
                }
                sys::fsync_dir(&store.state_dir).io_ctx("fsync", &store.state_dir)?;
            }
        }
        Ok(store)
    }

    /// Where the engine has CRIU write the dump of `container`'s `turn`: beside the kept
    /// copies, on their file system, so that keeping it is a hard link. Hidden from the kept
    /// copies' clean-up and GC by its leading dot, as [`restore_path`](Self::restore_path) is.
    pub fn dump_path(&self, container: &str, turn: u64) -> Result<PathBuf> {
        let owner = self.assembled.join(sandbox_key(container)?.rel_path());
        sys::create_private_dir_all(&owner).io_ctx("create", &owner)?;
        Ok(owner.join(format!(".dump-{turn}")))
    }

    /// Where the CRIU images that restore `container` are put together: beside the kept
    /// copies, so that a kept copy is hard-linked (CRIU opens images after it has entered the
    /// container's mount namespace, where a symbolic link to a host path leads nowhere).
    pub fn restore_path(&self, container: &str) -> Result<PathBuf> {
        let owner = self.assembled.join(sandbox_key(container)?.rel_path());
        sys::create_private_dir_all(&owner).io_ctx("create", &owner)?;
        Ok(owner.join(".restore"))
    }

    /// Removes dumps and restore images of `container` that a dead shim left behind (none is
    /// in flight when its engine starts: a restore's images are gone before its engine attaches).
    pub fn remove_stale_dumps(&self, container: &str) {
        let Ok(key) = sandbox_key(container) else { return };
        let Ok(entries) = fs::read_dir(self.assembled.join(key.rel_path())) else { return };
        for entry in entries.flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with('.')) {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Where the image files of `container`'s process checkpoint `manifest` are kept.
    /// None when `container` is no valid key (a manifest of an older build names it so).
    pub(crate) fn assembled_path(&self, container: &str, manifest: &Digest) -> Option<PathBuf> {
        Some(self.assembled.join(sandbox_key(container).ok()?.rel_path()).join(manifest.to_hex()))
    }

    pub(crate) fn assembled_dir(&self) -> &Path {
        &self.assembled
    }

    /// Keeps the image files of the process checkpoint just published as `id`, in place of
    /// the container's previous ones. A failure costs only speed at the next restore.
    fn keep_assembled(&self, container: &str, id: &Digest, set: &ImageSet, dump_dir: &Path) {
        let Some(dest) = self.assembled_path(container, id) else { return };
        let Some(dir) = dest.parent().map(Path::to_owned) else { return };
        // The container's previous copy goes first: it is superseded, and its bytes must not
        // count against the new one.
        if let Ok(entries) = fs::read_dir(&dir) {
            for entry in entries.flatten() {
                // Dot entries are a dump or a restore in flight, not kept copies.
                let in_flight = entry.file_name().to_str().is_some_and(|n| n.starts_with('.'));
                if entry.path() != dest && !in_flight {
                    let _ = fs::remove_dir_all(entry.path());
                }
            }
        }
        let size = set.bytes();
        let others = self.kept_bytes();
        if others.saturating_add(size) > self.kept_max_bytes {
            debug!(container, id = %id, size, others, max = self.kept_max_bytes,
                "CRIU images not kept: over the bound on kept copies (the next restore reassembles them)");
            return;
        }
        let kept = sys::create_private_dir_all(&dir)
            .io_ctx("create", &dir)
            .and_then(|()| images::keep_assembled(set, dump_dir, &dest));
        match kept {
            Ok(true) => debug!(container, id = %id, size, "CRIU images kept assembled"),
            Ok(false) => debug!(container, id = %id, dump = %dump_dir.display(),
                "CRIU images not kept: the dump is on another file system than the kept copies (a copy would cost a full write)"),
            Err(e) => {
                tracing::warn!(container, id = %id, error = %e, "CRIU images not kept assembled: the next restore reassembles them")
            }
        }
    }

    /// Bytes of every kept image copy of this store (dumps in flight not counted), as each
    /// copy recorded them when it was kept: one small read per copy.
    fn kept_bytes(&self) -> u64 {
        let Ok(namespaces) = fs::read_dir(&self.assembled) else { return 0 };
        namespaces
            .flatten()
            .filter_map(|namespace| fs::read_dir(namespace.path()).ok())
            .flat_map(|owners| owners.flatten())
            .filter_map(|owner| fs::read_dir(owner.path()).ok())
            .flat_map(|sets| sets.flatten())
            .filter(|set| set.file_name().to_str().is_some_and(|n| !n.starts_with('.')))
            .map(|set| images::kept_copy_bytes(&set.path()))
            .sum()
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    pub fn blobs(&self) -> &BlobStore {
        &self.blobs
    }

    /// Writers share the lock; GC takes it exclusively so it never deletes a blob that a
    /// commit has deduplicated against but not yet referenced from a published manifest.
    pub(crate) fn lock(&self, exclusive: bool) -> Result<File> {
        let path = self.state_dir.join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .io_ctx("open", &path)?;
        sys::flock(&file, exclusive).io_ctx("flock", &path)?;
        Ok(file)
    }

    /// Takes the store's shared lock for a writer that holds it across its own sequence of
    /// writes (see [`WriterLock`]); blocks while GC runs. The store's calls made under it take
    /// the shared lock again, which flock grants at once even with GC waiting: shared locks
    /// are not queued behind a waiting exclusive one.
    pub fn writer_lock(&self) -> Result<WriterLock> {
        Ok(WriterLock { _lock: self.lock(false)? })
    }

    pub(crate) fn manifest_path(&self, id: &Digest) -> PathBuf {
        self.manifests.join(format!("{id}.json"))
    }

    pub(crate) fn snapshot_path(&self, id: &Digest) -> PathBuf {
        self.snapshots.join(format!("{id}.json"))
    }

    pub(crate) fn manifests_dir(&self) -> &Path {
        &self.manifests
    }

    pub(crate) fn snapshots_dir(&self) -> &Path {
        &self.snapshots
    }

    fn head_path(&self, key: &SandboxKey) -> PathBuf {
        self.containers.join(key.rel_path()).join("HEAD")
    }

    /// The kept usage of `container`'s chain, taken out, if it was counted at `head`.
    pub(crate) fn take_cached_usage(&self, container: &str, head: &Digest) -> Option<ChainUsage> {
        let mut kept = self.usage.lock().expect("usage cache poisoned");
        match kept.remove(container) {
            Some((at, usage)) if at == *head => Some(usage),
            _ => None,
        }
    }

    pub(crate) fn cache_usage(&self, container: &str, head: Digest, usage: ChainUsage) {
        self.usage.lock().expect("usage cache poisoned").insert(container.to_owned(), (head, usage));
    }

    pub(crate) fn forget_cached(&self, id: &Digest) {
        self.cache.lock().expect("manifest cache poisoned").remove(id);
    }

    /// Loads and verifies a manifest by id; `None` when it is not stored.
    pub(crate) fn load_manifest(&self, id: &Digest) -> Result<Option<Arc<Manifest>>> {
        if let Some(m) = self.cache.lock().expect("manifest cache poisoned").get(id) {
            return Ok(Some(Arc::clone(m)));
        }
        let path = self.manifest_path(id);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).io_ctx("read", path),
        };
        let (_, manifest): (_, Manifest) = unseal(&bytes, &path, Some(id))?;
        let manifest = Arc::new(manifest);
        self.cache.lock().expect("manifest cache poisoned").insert(*id, Arc::clone(&manifest));
        Ok(Some(manifest))
    }

    /// A stored manifest by id, verified; `None` when it is not stored.
    pub fn manifest(&self, id: &Digest) -> Result<Option<Arc<Manifest>>> {
        self.load_manifest(id)
    }

    pub(crate) fn load_snapshot(&self, id: &Digest) -> Result<Option<Snapshot>> {
        let path = self.snapshot_path(id);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).io_ctx("read", path),
        };
        let (_, snapshot): (_, Snapshot) = unseal(&bytes, &path, None)?;
        if snapshot.at != *id {
            return Err(CheckpointError::CorruptManifest {
                path,
                reason: format!("snapshot is of manifest {}, file is named for {id}", snapshot.at),
            });
        }
        Ok(Some(snapshot))
    }

    pub fn head(&self, container: &str) -> Result<Option<Head>> {
        let path = self.head_path(&sandbox_key(container)?);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| CheckpointError::CorruptManifest { path, reason: format!("bad HEAD: {e}") }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).io_ctx("read", path),
        }
    }

    pub(crate) fn set_head(&self, container: &str, head: &Head, durability: Durability) -> Result<()> {
        let key = sandbox_key(container)?;
        let dir = self.containers.join(key.rel_path());
        if !dir.is_dir() {
            let namespace = self.containers.join(key.namespace());
            let new_namespace = !namespace.is_dir();
            sys::create_private_dir_all(&dir).io_ctx("create", &dir)?;
            sys::fsync_dir(&namespace).io_ctx("fsync", &namespace)?;
            if new_namespace {
                sys::fsync_dir(&self.containers).io_ctx("fsync", &self.containers)?;
            }
        }
        let bytes = serde_json::to_vec(head).map_err(|source| CheckpointError::Json { what: "HEAD", source })?;
        publish_file(&self.blobs.tmp_path("head"), &self.head_path(&key), &bytes, durability)
    }

    /// Keys (`<namespace>/<id>[@<generation>]`) of every chain that has a head, sorted, of all
    /// namespaces.
    pub fn containers(&self) -> Result<Vec<String>> {
        Ok(self.sandbox_keys()?.iter().map(ToString::to_string).collect())
    }

    /// [`containers`](Self::containers) as keys.
    pub fn sandbox_keys(&self) -> Result<Vec<SandboxKey>> {
        let mut keys = key::keys_under(&self.containers, "")?;
        keys.retain(|k| self.head_path(k).is_file());
        Ok(keys)
    }

    /// Keys of `namespace`'s chains that have a head (current and retired), sorted.
    pub fn namespace_keys(&self, namespace: &str) -> Result<Vec<SandboxKey>> {
        key::validate_namespace(namespace)?;
        let mut keys = self.sandbox_keys()?;
        keys.retain(|k| k.namespace() == namespace);
        Ok(keys)
    }

    /// Retires whatever the current chain of `container` left (head, turn log, saved spec,
    /// baseline copies) as the next generation `<id>@<n>`, so that a new container that
    /// reuses the id starts afresh without deleting it; GC's retention drops it later. Kept
    /// CRIU image copies of it go (only an accelerator). Returns the retired key, None when
    /// there was nothing.
    pub fn retire(&self, container: &str) -> Result<Option<SandboxKey>> {
        let current = sandbox_key(container)?.current();
        let _lock = self.lock(false)?;
        let state_dir = &self.state_dir;
        let head_dir = self.containers.join(current.rel_path());
        let log = key::turn_log_path(state_dir, &current);
        let spec = key::saved_spec_path(state_dir, &current);
        let full = key::full_checkpoints_dir(state_dir, &current);
        let _ = fs::remove_file(log.with_extension("busy"));
        let _ = fs::remove_dir_all(self.assembled.join(current.rel_path()));
        if ![&head_dir, &log, &spec, &full].iter().any(|p| p.exists()) {
            return Ok(None);
        }
        let generation = self.generations_of(&current)?.last().map_or(1, |g| g + 1);
        let retired = current.retired(generation);
        let moves = [
            (head_dir, self.containers.join(retired.rel_path())),
            (log, key::turn_log_path(state_dir, &retired)),
            (spec, key::saved_spec_path(state_dir, &retired)),
            (full, key::full_checkpoints_dir(state_dir, &retired)),
        ];
        for (from, to) in &moves {
            match fs::rename(from, to) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).io_ctx("rename", to),
            }
            if let Some(dir) = to.parent() {
                sys::fsync_dir(dir).io_ctx("fsync", dir)?;
            }
        }
        info!(container = %current, retired = %retired, "a new container reuses the id: its old chain is retired, not deleted");
        Ok(Some(retired))
    }

    /// The generations the id of `current` has retired so far, ascending.
    fn generations_of(&self, current: &SandboxKey) -> Result<Vec<u32>> {
        let mut generations = Vec::new();
        for (dir, suffix) in [
            (self.containers.clone(), ""),
            (self.state_dir.join("turns"), ".jsonl"),
            (self.state_dir.join("sandboxes"), ".json"),
            (self.state_dir.join("full"), ""),
        ] {
            for key in key::keys_under(&dir, suffix)? {
                if key.current() == *current
                    && let Some(generation) = key.generation()
                {
                    generations.push(generation);
                }
            }
        }
        generations.sort_unstable();
        generations.dedup();
        Ok(generations)
    }

    /// Removes everything of a retired chain's key (GC, once its retention window is past).
    pub(crate) fn remove_retired(&self, retired: &SandboxKey) -> Result<()> {
        if retired.generation().is_none() {
            return Err(CheckpointError::InvalidRequest(format!("{retired} is no retired chain")));
        }
        self.remove_chain(retired)
    }

    /// Removes a chain's head, baseline copies, turn log, saved spec and removal marker (its
    /// manifests and blobs go with GC's sweep once nothing references them).
    pub(crate) fn remove_chain(&self, retired: &SandboxKey) -> Result<()> {
        let state_dir = &self.state_dir;
        for dir in [self.containers.join(retired.rel_path()), key::full_checkpoints_dir(state_dir, retired)] {
            match fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).io_ctx("remove", dir),
                _ => {}
            }
        }
        for file in [
            key::turn_log_path(state_dir, retired),
            key::saved_spec_path(state_dir, retired),
            key::removed_marker_path(state_dir, retired),
        ] {
            match fs::remove_file(&file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).io_ctx("remove", file),
                _ => {}
            }
        }
        Ok(())
    }

    /// Walks a chain from `from` to its root, verifying every manifest and every parent link.
    pub(crate) fn walk(&self, container: &str, from: Digest) -> Result<Chain> {
        let broken = |missing: String| CheckpointError::BrokenChain { container: container.to_owned(), missing };
        let mut links: Vec<(Digest, Arc<Manifest>)> = Vec::new();
        let mut next = Some(from);
        while let Some(id) = next {
            let Some(manifest) = self.load_manifest(&id)? else {
                let Some((child_id, child)) = links.last() else {
                    return Err(broken(format!("head manifest {id} is missing")));
                };
                if let Some(snapshot) = self.load_snapshot(child_id)? {
                    return Ok(Chain { links, snapshot: Some(Arc::new(snapshot)) });
                }
                return Err(broken(format!(
                    "manifest {id} (turn {}), parent of turn {}, is missing and no snapshot covers it",
                    child.parent.map(|p| p.turn).unwrap_or_default(),
                    child.turn
                )));
            };
            if let Some((_, child)) = links.last()
                && (manifest.turn >= child.turn || child.parent.map(|p| p.turn) != Some(manifest.turn))
            {
                return Err(broken(format!(
                    "manifest {id} has turn {}, its child turn {} expects its parent at turn {:?}",
                    manifest.turn,
                    child.turn,
                    child.parent.map(|p| p.turn)
                )));
            }
            next = manifest.parent.map(|p| p.manifest);
            links.push((id, manifest));
        }
        Ok(Chain { links, snapshot: None })
    }

    pub(crate) fn chain(&self, container: &str) -> Result<(Head, Chain)> {
        let head = self.head(container)?.ok_or_else(|| CheckpointError::NoSuchContainer(container.to_owned()))?;
        let chain = self.walk(container, head.manifest)?;
        Ok((head, chain))
    }

    /// Checkpoints one turn: stores its blobs, publishes its manifest, then moves the head.
    /// A crash before the head moves leaves the previous head in place and only garbage behind.
    /// Turns of one container must be committed one at a time.
    pub fn commit_turn(&self, input: &TurnInput<'_>) -> Result<CommitReport> {
        let staged = self.stage_turn(input)?;
        self.publish(staged)
    }

    /// The capture half of [`commit_turn`](Self::commit_turn): what must be consistent with the
    /// turn's end. The changed files are read into tmp blobs (hashed, not flushed); CRIU images
    /// stay in their dump directory, which must outlive the [`StagedTurn`]. Nothing is visible
    /// until [`publish`](Self::publish); dropping the staged turn removes what it wrote.
    pub fn stage_turn(&self, input: &TurnInput<'_>) -> Result<StagedTurn> {
        self.stage_turn_in(input, &[], None)
    }

    /// [`stage_turn`](Self::stage_turn), with the changed paths under `mounts` (mounts of the
    /// running container, such as its tmpfs at `/dev/shm` or `/run`) read through those
    /// mounts, each path on the mount with the longest destination above it; the rest through
    /// `input.rootfs`. `rootfs_upper` is the rootfs's writable layer (its overlay upper
    /// directory): where the other names of a hard-linked file the turn wrote are looked for
    /// (`None`: in `input.rootfs` itself, which for a container's merged root means its whole
    /// image).
    pub fn stage_turn_in(
        &self,
        input: &TurnInput<'_>,
        mounts: &[ContainerMount],
        rootfs_upper: Option<&Path>,
    ) -> Result<StagedTurn> {
        let key = sandbox_key(input.container)?;
        let lock = self.lock(false)?;
        if let Some(head) = self.head(input.container)?
            && input.turn <= head.turn
        {
            return Err(CheckpointError::TurnNotAfterHead {
                container: input.container.to_owned(),
                turn: input.turn,
                head: head.turn,
            });
        }
        let class = match (input.criu_images.is_some(), input.changed.is_empty()) {
            (true, _) => TurnClass::Proc,
            (false, false) => TurnClass::Fs,
            (false, true) => TurnClass::Clean,
        };
        let mut batch = self.blobs.batch();
        let fs_delta = match (input.rootfs, input.changed.is_empty()) {
            (_, true) => Vec::new(),
            (Some(rootfs), false) => capture_split(rootfs, rootfs_upper, input.changed, mounts, &mut batch)?,
            (None, false) => {
                return Err(CheckpointError::InvalidRequest("changed paths given without a rootfs".into()));
            }
        };
        Ok(StagedTurn {
            container: key.to_string(),
            turn: input.turn,
            class,
            fs_delta,
            blobs: batch.set_aside(),
            criu_images: input.criu_images.map(Path::to_owned),
            quota: None,
            shells: Vec::new(),
            next_pid: None,
            _lock: lock,
        })
    }

    /// The write-out half of [`commit_turn`](Self::commit_turn): stores the CRIU images, makes
    /// every blob durable, publishes the manifest, then moves the head. The parent is the head
    /// at this moment, so write-outs of one container must run in turn order.
    pub fn publish(&self, staged: StagedTurn) -> Result<CommitReport> {
        self.publish_paced(staged, &mut Unlimited)
    }

    /// [`publish`](Self::publish) with the new blob bytes and then the manifest drawn from
    /// `tokens` chunk by chunk as they go to the disk (only HEAD, under 100 bytes, is not drawn).
    pub fn publish_paced(&self, staged: StagedTurn, tokens: &mut dyn WriteTokens) -> Result<CommitReport> {
        let StagedTurn { container, turn, class, fs_delta, blobs, criu_images, quota, shells, next_pid, _lock } =
            staged;
        let parent = self.head(&container)?;
        if let Some(head) = &parent {
            if turn <= head.turn {
                return Err(CheckpointError::TurnNotAfterHead { container, turn, head: head.turn });
            }
            if self.load_manifest(&head.manifest)?.is_none() {
                return Err(CheckpointError::BrokenChain {
                    container,
                    missing: format!("head manifest {} is missing", head.manifest),
                });
            }
        }
        let mut batch = self.blobs.resume(blobs);
        let images = criu_images.as_deref().map(|dir| images::store_images(dir, &mut batch)).transpose()?;
        // Before the first flush or token draw: a refused checkpoint costs the disk nothing
        // more, and dropping the batch removes its tmp blobs.
        let usage = match quota {
            None => None,
            Some(quota) => match self.check_quota(&container, parent, &fs_delta, images.as_ref(), &batch, quota)? {
                QuotaCheck::Fits(usage) => Some(usage),
                QuotaCheck::Over(over) => {
                    info!(container = %container, turn, %over, "checkpoint refused: over the sandbox's quota");
                    return Err(CheckpointError::OverQuota { container, over });
                }
            },
        };
        let traffic = batch.commit_paced(tokens)?;

        let manifest = Manifest {
            version: MANIFEST_VERSION,
            container: container.clone(),
            turn,
            class,
            parent: parent.map(|h| ParentRef { manifest: h.manifest, turn: h.turn }),
            created_unix_ms: now_unix_ms(),
            fs_delta,
            images,
            shells,
            next_pid,
        };
        let (id, bytes) = seal(&manifest, "manifest")?;
        // A process turn's manifest lists every chunk of its images (tens of KiB): it is
        // checkpoint bytes like the blobs.
        draw_in_chunks(tokens, bytes.len() as u64)?;
        publish_file(&self.blobs.tmp_path("manifest"), &self.manifest_path(&id), &bytes, Durability::Flushed)?;
        #[cfg(test)]
        if tests_hooks::crash_before_head() {
            return Err(CheckpointError::InvalidRequest("simulated crash before HEAD".into()));
        }
        self.set_head(&container, &Head { manifest: id, turn }, Durability::Flushed)?;
        if let Some(usage) = usage {
            self.cache_usage(&container, id, usage);
        }
        if let (Some(set), Some(dir)) = (&manifest.images, &criu_images) {
            self.keep_assembled(&container, &id, set, dir);
        }
        let report = CommitReport {
            id,
            turn,
            class,
            fs_entries: manifest.fs_delta.len(),
            traffic,
            manifest_bytes: bytes.len() as u64,
        };
        self.cache.lock().expect("manifest cache poisoned").insert(id, Arc::new(manifest));
        info!(container = %container, turn, ?class, id = %id,
              new_bytes = traffic.written_bytes, logical_bytes = traffic.logical_bytes, "checkpoint committed");
        Ok(report)
    }

    /// The checkpoints of a container's chain, newest first.
    pub fn history(&self, container: &str) -> Result<Vec<CheckpointInfo>> {
        let (_, chain) = self.chain(container)?;
        Ok(chain
            .links
            .iter()
            .map(|(id, m)| CheckpointInfo {
                id: *id,
                turn: m.turn,
                class: m.class,
                created_unix_ms: m.created_unix_ms,
                fs_entries: m.fs_delta.len(),
                has_images: m.images.is_some(),
            })
            .collect())
    }

    pub fn manifest_at(&self, container: &str, turn: u64) -> Result<(Digest, Arc<Manifest>)> {
        let (_, chain) = self.chain(container)?;
        let index = chain.index_of(container, turn)?;
        let (id, manifest) = &chain.links[index];
        Ok((*id, Arc::clone(manifest)))
    }

    /// Writes "the rootfs as at `turn`" onto `target`, which must already hold the base the
    /// container started from (a fresh copy of the image rootfs, or an empty overlay upper
    /// over it). Every blob is verified before the first write.
    pub fn materialize(&self, container: &str, turn: u64, target: &Path) -> Result<ApplyStats> {
        self.materialize_rootfs(container, turn, target, &[])
    }

    /// [`materialize`](Self::materialize) of every path except those at or below `skip`: the
    /// destinations of the new container's mounts, which hide the rootfs there (their
    /// content goes into the mounts once they exist, [`materialize_mounts`](Self::materialize_mounts)).
    pub fn materialize_rootfs(
        &self,
        container: &str,
        turn: u64,
        target: &Path,
        skip: &[RelPath],
    ) -> Result<ApplyStats> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        let mut state = chain.fold(chain.index_of(container, turn)?);
        state.retain(|path, _| !skip.iter().any(|d| d == path || d.is_ancestor_of(path)));
        let root = Root::open(target)?;
        let mut applier = Applier::new(&root, &self.blobs);
        applier.prefetch(state.values().filter_map(|e| e.node.blob()))?;
        for entry in state.values() {
            applier.apply(entry, true)?;
        }
        applier.finish()
    }

    /// Writes the paths under each of `mounts` (a new container's tmpfs mounts, empty or as
    /// CRIU restored them) as they were at `turn`. With `since`, only the paths some checkpoint
    /// after turn `since` changed (CRIU restored the mounts as at `since`); without, all.
    /// A mount's root directory is set, never replaced.
    pub fn materialize_mounts(
        &self,
        container: &str,
        turn: u64,
        mounts: &[ContainerMount],
        since: Option<u64>,
    ) -> Result<ApplyStats> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        let index = chain.index_of(container, turn)?;
        let state = chain.fold(index);
        let touched: Option<std::collections::BTreeSet<RelPath>> = since.map(|since| {
            let mut touched: std::collections::BTreeSet<RelPath> = chain.links[index..]
                .iter()
                .filter(|(_, m)| m.turn > since)
                .flat_map(|(_, m)| m.fs_delta.iter().map(|e| e.path.clone()))
                .collect();
            touched.extend(link_partners(&state, touched.iter()));
            touched
        });
        let mut total = ApplyStats::default();
        for mount in mounts {
            let dest = &mount.destination;
            // A path is on the mount with the longest destination above it (/dev/shm, not /dev).
            let on_mount = |p: &RelPath| {
                mounts
                    .iter()
                    .map(|m| &m.destination)
                    .filter(|d| *d == p || d.is_ancestor_of(p))
                    .max_by_key(|d| d.as_bytes().len())
                    == Some(dest)
            };
            let mut entries: Vec<FsEntry> = Vec::new();
            let mut push = |entry: &FsEntry| -> Result<()> {
                let path = RelPath::parse(mounts::below(dest, &entry.path))?;
                let node = match &entry.node {
                    // A link's first name is on the same mount (links do not cross mounts).
                    FsNode::Hardlink { meta, link_to, blob, size, extents } => match on_mount(link_to) {
                        true => FsNode::Hardlink {
                            meta: meta.clone(),
                            link_to: RelPath::parse(mounts::below(dest, link_to))?,
                            blob: *blob,
                            size: *size,
                            extents: extents.clone(),
                        },
                        false => {
                            FsNode::File { meta: meta.clone(), blob: *blob, size: *size, extents: extents.clone() }
                        }
                    },
                    other => other.clone(),
                };
                if path.is_root() && !node.is_dir() {
                    return Ok(());
                }
                entries.push(FsEntry { path, node });
                Ok(())
            };
            match &touched {
                None => {
                    for entry in state.values().filter(|e| on_mount(&e.path)) {
                        push(entry)?;
                    }
                }
                Some(touched) => {
                    for path in touched.iter().filter(|p| on_mount(p)) {
                        match state.get(path) {
                            Some(entry) => push(entry)?,
                            // Under a directory replaced or removed later: gone at `turn`.
                            None => push(&FsEntry { path: path.clone(), node: FsNode::Whiteout })?,
                        }
                    }
                }
            }
            if entries.is_empty() {
                continue;
            }
            let mut applier = Applier::new(&mount.root, &self.blobs);
            applier.prefetch(entries.iter().filter_map(|e| e.node.blob()))?;
            for entry in &entries {
                applier.apply(entry, !entry.path.is_root())?;
            }
            let stats = applier.finish()?;
            total.files_written += stats.files_written;
            total.bytes_written += stats.bytes_written;
            total.dirs_set += stats.dirs_set;
            total.links_made += stats.links_made;
            total.paths_removed += stats.paths_removed;
        }
        Ok(total)
    }

    /// Puts back, in the live root, exactly the paths changed after `to_turn`, then moves the
    /// head to `to_turn`. Only the changed paths are touched; nothing is re-hashed on the live
    /// side.
    pub fn rollback_in_place(&self, req: &RollbackRequest<'_>) -> Result<RollbackReport> {
        self.rollback_in_place_with(req, &[])
    }

    /// [`rollback_in_place`](Self::rollback_in_place) where the paths below each of
    /// `empty_base` (the container's tmpfs mounts) started empty: a path never recorded there
    /// before the target did not exist then, whatever the image holds at that place. The
    /// mount points themselves are left as the runtime made them.
    pub fn rollback_in_place_with(&self, req: &RollbackRequest<'_>, empty_base: &[RelPath]) -> Result<RollbackReport> {
        let _lock = self.lock(false)?;
        let (head, chain) = self.chain(req.container)?;
        let target = chain.index_of(req.container, req.to_turn)?;

        // Paths changed after the target, and whether a change there replaced a whole subtree.
        let mut changed: BTreeMap<RelPath, Change> = BTreeMap::new();
        for (_, manifest) in &chain.links[..target] {
            for entry in &manifest.fs_delta {
                changed.entry(entry.path.clone()).or_default().replaced |= entry.node.replaces_subtree();
            }
        }
        for extra in req.uncommitted {
            let path = RelPath::parse(&extra.path)?;
            let recorded = changed.contains_key(&path);
            let change = changed.entry(path).or_default();
            change.replaced |= extra.created;
            // Created since the head and untouched by the turns being undone: absent back then too.
            change.absent_at_target |= extra.created && !recorded;
        }

        let past = chain.fold(target);
        // A name of a hard-linked file is put back with all its other names, or it would come
        // back as a file of its own.
        for name in link_partners(&past, changed.keys()) {
            changed.entry(name).or_default();
        }
        // A mount point never recorded is the runtime's: nothing to put back, and it cannot
        // be removed or replaced while mounted.
        changed.retain(|path, _| !empty_base.contains(path) || past.contains_key(path));
        let root = Root::open(req.root)?;
        let base = req.base.map(Root::open).transpose()?;
        let empty_based = |p: &RelPath| empty_base.iter().any(|d| d.is_ancestor_of(p));
        let empty = if changed.keys().any(empty_based) {
            let dir = self.blobs.tmp_path("empty-base");
            fs::create_dir(&dir).io_ctx("create", &dir)?;
            let root = Root::open(&dir);
            let _ = fs::remove_dir(&dir);
            Some(root?)
        } else {
            None
        };
        let plan = plan_rollback(&past, &changed, &root, &|p| base.is_some() || empty_based(p), req.to_turn)?;

        let mut applier = Applier::new(&root, &self.blobs);
        applier.prefetch(plan.iter().flat_map(|step| step.blobs(&past)))?;
        for step in &plan {
            let base = if empty_based(step.path()) { empty.as_ref() } else { base.as_ref() };
            step.run(&mut applier, &past, base)?;
        }
        let stats = applier.finish()?;

        // The live root was just rewritten without flushing (it dies with the host anyway), so
        // flushing the head would buy no consistency; the next commit flushes it with its own.
        let new_head = Head { manifest: chain.links[target].0, turn: req.to_turn };
        self.set_head(req.container, &new_head, Durability::AtomicOnly)?;
        debug!(
            container = req.container,
            from = head.turn,
            to = req.to_turn,
            paths = changed.len(),
            "rolled back in place"
        );
        Ok(RollbackReport {
            from_turn: head.turn,
            to_turn: req.to_turn,
            changed_paths: changed.len(),
            stats,
            head: new_head,
        })
    }

    /// Recreates the CRIU image directory in effect at `turn` (the newest proc turn at or below
    /// it) into `dest`. Returns the turn whose images were restored, `None` if there are none.
    pub fn restore_images(&self, container: &str, turn: u64, dest: &Path) -> Result<Option<u64>> {
        Ok(self.restore_images_report(container, turn, dest)?.map(|(images_turn, _)| images_turn))
    }

    /// The shell sessions a restore of `turn` brings back through process images, with the
    /// state to bring each to (see [`ShellRestore`]).
    pub fn shell_restores(&self, container: &str, turn: u64) -> Result<Vec<ShellRestore>> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        Ok(chain.shells_at(chain.index_of(container, turn)?))
    }

    /// The pid cursor a restore of `turn` sets when a file-system turn after its images moved
    /// it (see [`Manifest::next_pid`]); None: the one the dump recorded beside its images.
    pub fn restore_next_pid(&self, container: &str, turn: u64) -> Result<Option<u32>> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        Ok(chain.next_pid_at(chain.index_of(container, turn)?))
    }

    /// [`restore_images`](Self::restore_images), also saying what was written.
    pub fn restore_images_report(
        &self,
        container: &str,
        turn: u64,
        dest: &Path,
    ) -> Result<Option<(u64, RestoredImages)>> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        let Some((images_turn, set, source)) = chain.images_source_at(chain.index_of(container, turn)?) else {
            return Ok(None);
        };
        let clock = std::time::Instant::now();
        if let Some((id, manifest)) = source
            && let Some(kept) = self.assembled_path(&manifest.container, id)
        {
            // Only a hard link serves (see images::restore_assembled): from another file
            // system the chunks restore, and the copy stays for a restore that can link it.
            let same_fs = |a: &Path, b: &Path| {
                use std::os::unix::fs::MetadataExt;
                matches!((fs::metadata(a), fs::metadata(b)), (Ok(a), Ok(b)) if a.dev() == b.dev())
            };
            let linkable = dest.parent().is_some_and(|parent| same_fs(&kept, parent));
            if kept.is_dir() && !linkable {
                debug!(container, turn = images_turn, dest = %dest.display(),
                    "kept CRIU images are on another file system than the restore: reassembling them");
            }
            if kept.is_dir() && linkable {
                match images::restore_assembled(set, &self.blobs, &kept, dest) {
                    Ok(restored) => {
                        debug!(
                            container,
                            turn = images_turn,
                            files = restored.files,
                            bytes = restored.bytes,
                            chunks = restored.chunks,
                            ms = clock.elapsed().as_secs_f64() * 1e3,
                            "CRIU images linked from the kept copy and verified"
                        );
                        return Ok(Some((images_turn, restored)));
                    }
                    Err(e) => {
                        // Not trusted again: the chunks are the checkpoint.
                        tracing::warn!(container, turn = images_turn, error = %e,
                            "kept CRIU images refused: reassembling them from the chunks");
                        let _ = fs::remove_dir_all(&kept);
                    }
                }
            }
        }
        let restored = images::restore_images(set, &self.blobs, dest)?;
        debug!(
            container,
            turn = images_turn,
            files = restored.files,
            bytes = restored.bytes,
            chunks = restored.chunks,
            chunks_read = restored.chunks_read,
            ms = clock.elapsed().as_secs_f64() * 1e3,
            "CRIU images reassembled and verified"
        );
        Ok(Some((images_turn, restored)))
    }

    /// Starts container `new` from `source`'s checkpoint at `turn`. Nothing is copied: the new
    /// head points into the shared chain, and GC keeps what it references.
    pub fn fork(&self, source: &str, turn: u64, new: &str) -> Result<Head> {
        sandbox_key(new)?;
        let _lock = self.lock(false)?;
        if self.head(new)?.is_some() {
            return Err(CheckpointError::InvalidRequest(format!("container {new:?} already has checkpoints")));
        }
        let (_, chain) = self.chain(source)?;
        let index = chain.index_of(source, turn)?;
        let head = Head { manifest: chain.links[index].0, turn };
        self.set_head(new, &head, Durability::Flushed)?;
        Ok(head)
    }

    /// Moves a container's head back to its checkpoint at `turn` (a restore of
    /// processes to an older turn): later checkpoints drop out of its chain,
    /// and GC reclaims what only they referenced.
    pub fn rewind(&self, container: &str, turn: u64) -> Result<Head> {
        sandbox_key(container)?;
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        let index = chain.index_of(container, turn)?;
        let head = Head { manifest: chain.links[index].0, turn };
        self.set_head(container, &head, Durability::Flushed)?;
        Ok(head)
    }

    /// Forgets a container's head; GC then reclaims whatever only it referenced.
    pub fn remove_container(&self, container: &str) -> Result<()> {
        let key = sandbox_key(container)?;
        let _ = fs::remove_dir_all(self.assembled.join(key.rel_path()));
        if key.generation().is_none() {
            self.remove_owner(&key)?;
        }
        let dir = self.containers.join(key.rel_path());
        match fs::remove_dir_all(&dir) {
            Ok(()) => {
                let namespace = self.containers.join(key.namespace());
                sys::fsync_dir(&namespace).io_ctx("fsync", &namespace)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).io_ctx("remove", dir),
        }
    }

    /// Re-reads and hashes every manifest and blob `turn` depends on.
    pub fn verify(&self, container: &str, turn: u64) -> Result<VerifyReport> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        let index = chain.index_of(container, turn)?;
        let mut report = VerifyReport::default();
        let mut blobs = HashSet::new();
        for (_, manifest) in &chain.links[index..] {
            report.manifests += 1;
            blobs.extend(direct_blobs(&manifest.fs_delta, manifest.images.as_ref()).copied());
            if let Some(set) = &manifest.images {
                images::referenced_blobs(set, &self.blobs, &mut blobs)?;
            }
        }
        if let Some(snapshot) = &chain.snapshot {
            let images = snapshot.images.as_ref().map(|(_, set)| set);
            blobs.extend(direct_blobs(&snapshot.entries, images).copied());
            if let Some(set) = images {
                images::referenced_blobs(set, &self.blobs, &mut blobs)?;
            }
        }
        for blob in &blobs {
            report.bytes += self.blobs.verify(blob)?;
            report.blobs += 1;
        }
        Ok(report)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Change {
    replaced: bool,
    absent_at_target: bool,
}

/// One step of an in-place rollback, decided before anything is written.
enum Step<'f> {
    Remove(RelPath),
    Apply(&'f FsEntry),
    FromBase(RelPath),
    /// Rebuild a whole directory: from its recorded entry or the base, then every recorded
    /// entry below it.
    Rebuild {
        path: RelPath,
        recorded: Option<&'f FsEntry>,
    },
}

impl<'f> Step<'f> {
    fn path(&self) -> &RelPath {
        match self {
            Step::Remove(path) | Step::FromBase(path) | Step::Rebuild { path, .. } => path,
            Step::Apply(entry) => &entry.path,
        }
    }

    fn blobs(&self, past: &'f BTreeMap<RelPath, FsEntry>) -> Vec<&'f Digest> {
        match self {
            Step::Apply(entry) => entry.node.blob().into_iter().collect(),
            Step::Rebuild { path, .. } => {
                let (lo, hi) = path.descendant_bounds();
                past.range(lo..hi).filter_map(|(_, e)| e.node.blob()).collect()
            }
            Step::Remove(_) | Step::FromBase(_) => Vec::new(),
        }
    }

    fn run(&self, applier: &mut Applier<'_>, past: &BTreeMap<RelPath, FsEntry>, base: Option<&Root>) -> Result<()> {
        match self {
            Step::Remove(path) => applier.remove_path(path),
            Step::Apply(entry) => applier.apply(entry, false),
            Step::FromBase(path) => applier.copy_from_base(base.expect("planned with a base"), path, false),
            Step::Rebuild { path, recorded } => {
                applier.remove_path(path)?;
                match recorded {
                    Some(entry @ FsEntry { node: FsNode::Dir { complete: true, .. }, .. }) => {
                        applier.apply(entry, true)?
                    }
                    _ => {
                        applier.copy_from_base(base.expect("planned with a base"), path, true)?;
                        if let Some(entry) = recorded {
                            applier.apply(entry, false)?;
                        }
                    }
                }
                let (lo, hi) = path.descendant_bounds();
                for (_, entry) in past.range(lo..hi) {
                    applier.apply(entry, true)?;
                }
                Ok(())
            }
        }
    }
}

fn plan_rollback<'f>(
    past: &'f BTreeMap<RelPath, FsEntry>,
    changed: &BTreeMap<RelPath, Change>,
    root: &Root,
    have_base: &dyn Fn(&RelPath) -> bool,
    to_turn: u64,
) -> Result<Vec<Step<'f>>> {
    let need_base = |path: &RelPath| {
        if have_base(path) {
            Ok(())
        } else {
            Err(CheckpointError::NoBaseState { path: path.to_string(), turn: to_turn })
        }
    };
    let mut plan = Vec::new();
    let mut covered: HashSet<RelPath> = HashSet::new();
    for (path, change) in changed {
        if path.ancestors().any(|a| covered.contains(&a)) {
            continue;
        }
        let replaced = change.replaced;
        let step = match past_state(past, path) {
            PastState::Absent => Step::Remove(path.clone()),
            PastState::Base if change.absent_at_target => Step::Remove(path.clone()),
            PastState::Recorded(entry) if entry.node.is_dir() && (replaced || !root.is_dir(path)?) => {
                if !matches!(entry.node, FsNode::Dir { complete: true, .. }) {
                    need_base(path)?;
                }
                Step::Rebuild { path: path.clone(), recorded: Some(entry) }
            }
            PastState::Recorded(entry) => Step::Apply(entry),
            PastState::Base => {
                need_base(path)?;
                if replaced || !root.is_dir(path)? {
                    Step::Rebuild { path: path.clone(), recorded: None }
                } else {
                    Step::FromBase(path.clone())
                }
            }
        };
        if matches!(step, Step::Remove(_) | Step::Rebuild { .. }) {
            covered.insert(path.clone());
        }
        plan.push(step);
    }
    Ok(plan)
}

#[cfg(test)]
pub(crate) mod tests_hooks {
    use std::cell::Cell;

    thread_local! {
        static CRASH_BEFORE_HEAD: Cell<bool> = const { Cell::new(false) };
    }

    pub(crate) fn set_crash_before_head(on: bool) {
        CRASH_BEFORE_HEAD.with(|c| c.set(on));
    }

    pub(crate) fn crash_before_head() -> bool {
        CRASH_BEFORE_HEAD.with(|c| c.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, data: &[u8]) {
        fs::write(dir.join(name), data).unwrap();
    }

    /// A commit that dies after its manifest is published but before HEAD moves leaves the old
    /// head in place; the half checkpoint never shows up and the next commit chains from the
    /// old head.
    #[test]
    fn crash_before_head_leaves_previous_checkpoint_visible() {
        let tmp = tempfile::tempdir().unwrap();
        let rootfs = tmp.path().join("root");
        fs::create_dir_all(&rootfs).unwrap();
        let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
        write(&rootfs, "f", b"one");
        let changed = [ChangedPath::created("/f")];
        let input =
            |turn| TurnInput { container: "c", turn, rootfs: Some(&rootfs), changed: &changed, criu_images: None };
        let first = store.commit_turn(&input(1)).unwrap();

        write(&rootfs, "f", b"two");
        tests_hooks::set_crash_before_head(true);
        let crashed = store.commit_turn(&input(2));
        tests_hooks::set_crash_before_head(false);
        assert!(crashed.is_err());

        let reopened = CheckpointStore::open(tmp.path().join("state")).unwrap();
        assert_eq!(reopened.head("c").unwrap(), Some(Head { manifest: first.id, turn: 1 }));
        assert_eq!(reopened.history("c").unwrap().len(), 1);
        assert!(matches!(reopened.manifest_at("c", 2), Err(CheckpointError::NoSuchTurn { turn: 2, .. })));

        // Manifests carry their creation time in ms: a retry within the crashed commit's
        // millisecond would make the very same manifest, leaving no orphan to collect.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let retried = reopened.commit_turn(&input(2)).unwrap();
        let (_, manifest) = reopened.manifest_at("c", 2).unwrap();
        assert_eq!(manifest.parent, Some(ParentRef { manifest: first.id, turn: 1 }));
        assert_eq!(retried.traffic.written_bytes, 0, "the crashed commit's blob is reused");
        let gc = reopened.gc(&crate::RetentionPolicy { keep_last: 10 }).unwrap();
        assert_eq!(gc.manifests_removed, 1, "the orphan manifest of the crashed commit is collected");
    }

    fn commit_file(store: &CheckpointStore, rootfs: &Path, container: &str, turn: u64, data: &[u8]) -> CommitReport {
        write(rootfs, "f", data);
        let changed = [ChangedPath::created("/f")];
        store
            .commit_turn(&TurnInput { container, turn, rootfs: Some(rootfs), changed: &changed, criu_images: None })
            .unwrap()
    }

    /// Two namespaces' containers of one id have a chain each: one's commits, retirement or
    /// removal never touch the other's.
    #[test]
    fn namespaces_keep_chains_of_one_id_apart() {
        let tmp = tempfile::tempdir().unwrap();
        let rootfs = tmp.path().join("root");
        fs::create_dir_all(&rootfs).unwrap();
        let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
        let a = commit_file(&store, &rootfs, "tenant-a/t2", 1, b"a1");
        commit_file(&store, &rootfs, "tenant-a/t2", 2, b"a2");
        commit_file(&store, &rootfs, "tenant-b/t2", 1, b"b1");
        assert_eq!(store.history("tenant-a/t2").unwrap().len(), 2);
        assert_eq!(store.history("tenant-b/t2").unwrap().len(), 1);
        assert!(tmp.path().join("state/containers/tenant-a/t2/HEAD").is_file());
        assert!(tmp.path().join("state/containers/tenant-b/t2/HEAD").is_file());
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(tmp.path().join("state/containers/tenant-a")).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "a namespace's directory is root's alone");
        }
        assert_eq!(store.containers().unwrap(), ["tenant-a/t2", "tenant-b/t2"]);
        assert_eq!(store.manifest_at("tenant-a/t2", 1).unwrap().1.container, "tenant-a/t2");

        assert!(store.retire("tenant-b/t2").unwrap().is_some());
        store.remove_container("tenant-b/t2").unwrap();
        assert_eq!(store.head("tenant-a/t2").unwrap().map(|h| h.turn), Some(2));
        assert_eq!(store.manifest_at("tenant-a/t2", 1).unwrap().0, a.id);
        // A bare id is the default namespace's, never another's.
        assert_eq!(store.head("t2").unwrap(), None);
        assert!(matches!(store.head("../t2"), Err(CheckpointError::InvalidKey(_))));
    }

    /// The chains of a container containerd removed stay for the retention the census names,
    /// counted from the GC that first found it gone; a fork of it keeps what it references;
    /// namespaces containerd does not list, and containers it still has, are left alone.
    #[test]
    fn a_removed_container_s_chain_goes_after_its_retention_and_its_fork_keeps_what_it_needs() {
        use std::collections::{BTreeMap, HashSet};
        use std::time::{Duration, SystemTime};

        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let rootfs = tmp.path().join("root");
        fs::create_dir_all(&rootfs).unwrap();
        let store = CheckpointStore::open(&state).unwrap();
        commit_file(&store, &rootfs, "ns/gone", 1, b"gone1");
        commit_file(&store, &rootfs, "ns/gone", 2, b"gone2");
        store.retire("ns/gone").unwrap();
        commit_file(&store, &rootfs, "ns/gone", 1, b"gone-again");
        commit_file(&store, &rootfs, "ns/live", 1, b"live1");
        commit_file(&store, &rootfs, "other/gone", 1, b"other1");
        store.fork("ns/gone", 1, "ns/fork").unwrap();
        for (dir, name) in [("turns/ns", "gone.jsonl"), ("sandboxes/ns", "gone.json"), ("turns/ns", "logonly.jsonl")] {
            fs::create_dir_all(state.join(dir)).unwrap();
            fs::write(state.join(dir).join(name), b"{}").unwrap();
        }

        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        // containerd lists namespace `ns` only: `live` and the fork run, `gone` and `logonly` are
        // removed; namespace `other` is not containerd's to judge.
        let census = |now: SystemTime| crate::ContainerCensus {
            namespaces: BTreeMap::from([("ns".to_string(), HashSet::from(["live".to_string(), "fork".to_string()]))]),
            keep_removed: Duration::from_secs(3600),
            now,
        };
        let policy = crate::RetentionPolicy { keep_last: 16 };
        let first = store.gc_with(&policy, Some(&census(t0))).unwrap();
        assert_eq!((first.removed_marked, first.removed_dropped), (2, 0), "{first:?}");
        assert!(state.join("removed/ns/gone").is_file() && state.join("removed/ns/logonly").is_file());
        assert!(store.head("ns/gone").unwrap().is_some(), "kept within the retention");

        // Seen again before the hour is up: the first sighting's time counts, not this one's.
        let again = store.gc_with(&policy, Some(&census(t0 + Duration::from_secs(3599)))).unwrap();
        assert_eq!((again.removed_marked, again.removed_dropped), (0, 0), "{again:?}");

        let past = store.gc_with(&policy, Some(&census(t0 + Duration::from_secs(3600)))).unwrap();
        assert_eq!(past.removed_dropped, 2, "gone (both generations) and logonly: {past:?}");
        assert_eq!(store.head("ns/gone").unwrap(), None);
        assert_eq!(store.head("ns/gone@1").unwrap(), None, "the retired generation goes with its id");
        for path in ["turns/ns/gone.jsonl", "sandboxes/ns/gone.json", "turns/ns/logonly.jsonl", "removed/ns/gone"] {
            assert!(!state.join(path).exists(), "{path} left behind");
        }
        let mut left = store.containers().unwrap();
        left.sort();
        assert_eq!(left, ["ns/fork", "ns/live", "other/gone"]);
        store.verify("ns/fork", 1).unwrap();
        store.verify("other/gone", 1).unwrap();

        // A container that is back clears its mark.
        fs::create_dir_all(state.join("removed/ns")).unwrap();
        fs::write(state.join("removed/ns/live"), b"5").unwrap();
        store.gc_with(&policy, Some(&census(t0 + Duration::from_secs(7200)))).unwrap();
        assert!(!state.join("removed/ns/live").exists());
        assert!(store.head("ns/live").unwrap().is_some());
    }

    /// A removed pod leaves nothing in the store once GC drops it (here at once, keep_removed 0):
    /// besides its containers' chains, turn logs and specs, their pod owner records, the pod
    /// sandbox's record of its current containers and the containers' kept-image directories
    /// go, also for an id the store knows only by such a record. A live pod's stay.
    #[test]
    fn a_removed_pod_leaves_no_records_behind() {
        use std::collections::{BTreeMap, HashSet};
        use std::time::{Duration, SystemTime};

        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let rootfs = tmp.path().join("root");
        fs::create_dir_all(&rootfs).unwrap();
        let store = CheckpointStore::open(&state).unwrap();
        let owner = |pod: &str| crate::PodOwner {
            kube_namespace: "team-a".into(),
            pod_sandbox: pod.into(),
            container_name: "main".into(),
        };
        for (pod, container) in [("gonepod", "gone"), ("livepod", "live")] {
            commit_file(&store, &rootfs, &format!("k8s.io/{container}"), 1, container.as_bytes());
            store.set_owner(&format!("k8s.io/{container}"), &owner(pod)).unwrap();
            store.set_pod_member("k8s.io", pod, "main", container).unwrap();
            fs::create_dir_all(store.assembled_dir().join("k8s.io").join(container)).unwrap();
        }
        // Known only by its owner record, and a pod known only by its members' record.
        store.set_owner("k8s.io/ownedonly", &owner("gonepod")).unwrap();
        store.set_pod_member("k8s.io", "podonly", "main", "gone").unwrap();

        let census = crate::ContainerCensus {
            namespaces: BTreeMap::from([(
                "k8s.io".to_string(),
                HashSet::from(["live".to_string(), "livepod".to_string()]),
            )]),
            keep_removed: Duration::ZERO,
            now: SystemTime::now(),
        };
        let report = store.gc_with(&crate::RetentionPolicy { keep_last: 16 }, Some(&census)).unwrap();
        assert_eq!(report.removed_dropped, 4, "gone, gonepod, ownedonly, podonly: {report:?}");
        assert_eq!(store.owner("k8s.io/gone").unwrap(), None);
        assert_eq!(store.owner("k8s.io/ownedonly").unwrap(), None);
        assert_eq!(store.pod_member("k8s.io", "gonepod", "main").unwrap(), None);
        for path in ["pods/k8s.io/gonepod", "pods/k8s.io/podonly", "removed/k8s.io"] {
            let left: Vec<_> = fs::read_dir(state.join(path)).into_iter().flatten().flatten().collect();
            assert!(left.is_empty(), "{path}: {left:?}");
        }
        assert!(!state.join("pods/k8s.io/gonepod").exists() && !state.join("pods/k8s.io/podonly").exists());
        assert!(!store.assembled_dir().join("k8s.io/gone").exists(), "the removed container's kept-image directory");

        assert_eq!(store.owner("k8s.io/live").unwrap(), Some(owner("livepod")));
        assert_eq!(store.pod_member("k8s.io", "livepod", "main").unwrap().as_deref(), Some("live"));
        assert!(store.assembled_dir().join("k8s.io/live").is_dir());
        assert_eq!(store.containers().unwrap(), ["k8s.io/live"]);
    }

    /// A new container that reuses an id retires the old chain with its turn log and spec;
    /// GC drops it only once newer checkpoints of the id fill the retention window.
    #[test]
    fn a_reused_id_retires_the_old_chain_until_retention_drops_it() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let rootfs = tmp.path().join("root");
        fs::create_dir_all(&rootfs).unwrap();
        let store = CheckpointStore::open(&state).unwrap();
        commit_file(&store, &rootfs, "ns/t2", 1, b"old1");
        let old = commit_file(&store, &rootfs, "ns/t2", 2, b"old2");
        fs::create_dir_all(state.join("turns/ns")).unwrap();
        fs::write(state.join("turns/ns/t2.jsonl"), b"old log\n").unwrap();
        fs::write(state.join("turns/ns/t2.busy"), b"").unwrap();
        fs::create_dir_all(state.join("sandboxes/ns")).unwrap();
        fs::write(state.join("sandboxes/ns/t2.json"), b"{}").unwrap();

        let retired = store.retire("ns/t2").unwrap().unwrap();
        assert_eq!(retired.to_string(), "ns/t2@1");
        assert_eq!(store.head("ns/t2").unwrap(), None, "the new container starts afresh");
        assert_eq!(store.head("ns/t2@1").unwrap().map(|h| h.manifest), Some(old.id));
        assert_eq!(fs::read(state.join("turns/ns/t2@1.jsonl")).unwrap(), b"old log\n");
        assert!(state.join("sandboxes/ns/t2@1.json").is_file());
        assert!(!state.join("turns/ns/t2.jsonl").exists() && !state.join("turns/ns/t2.busy").exists());
        assert_eq!(store.retire("ns/t2").unwrap(), None, "nothing left to retire");

        // The new container's chain: one checkpoint. With 3 kept per id, the retired chain
        // still has 2 in the window and stays whole.
        commit_file(&store, &rootfs, "ns/t2", 1, b"new1");
        let gc = store.gc(&crate::RetentionPolicy { keep_last: 3 }).unwrap();
        assert_eq!(gc.retired_removed, 0);
        assert_eq!(store.history("ns/t2@1").unwrap().len(), 2);
        store.verify("ns/t2@1", 2).unwrap();

        // A second reuse retires generation 2; three checkpoints of the current chain then
        // fill the window, and both retired chains go.
        store.retire("ns/t2").unwrap();
        commit_file(&store, &rootfs, "ns/t2", 1, b"newer1");
        commit_file(&store, &rootfs, "ns/t2", 2, b"newer2");
        commit_file(&store, &rootfs, "ns/t2", 3, b"newer3");
        let gc = store.gc(&crate::RetentionPolicy { keep_last: 3 }).unwrap();
        assert_eq!(gc.retired_removed, 2, "both retired generations are past the window");
        assert_eq!(store.containers().unwrap(), ["ns/t2"]);
        assert!(!state.join("turns/ns/t2@1.jsonl").exists() && !state.join("sandboxes/ns/t2@1.json").exists());
        assert!(gc.manifests_removed >= 3, "{gc:?}");
    }

    #[test]
    fn fold_marks_recreated_directories_complete_and_drops_their_old_children() {
        let meta = super::super::manifest::Meta {
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime_sec: 0,
            mtime_nsec: 0,
            xattrs: Default::default(),
        };
        let p = |s: &str| RelPath::parse(s).unwrap();
        let mut state = BTreeMap::new();
        let file = FsNode::File { meta: meta.clone(), blob: Digest::of(b"x"), size: 1, extents: None };
        fold_entry(&mut state, &FsEntry { path: p("/d"), node: FsNode::Dir { meta: meta.clone(), complete: true } });
        fold_entry(&mut state, &FsEntry { path: p("/d/old"), node: file.clone() });
        fold_entry(&mut state, &FsEntry { path: p("/d"), node: FsNode::Whiteout });
        assert_eq!(state.len(), 1);
        fold_entry(&mut state, &FsEntry { path: p("/d"), node: FsNode::Dir { meta: meta.clone(), complete: false } });
        assert!(matches!(state[&p("/d")].node, FsNode::Dir { complete: true, .. }));
        fold_entry(&mut state, &FsEntry { path: p("/d.x"), node: file });
        fold_entry(&mut state, &FsEntry { path: p("/d"), node: FsNode::Whiteout });
        assert!(state.contains_key(&p("/d.x")), "a sibling sharing the prefix survives");
    }

    /// Paths on a mount of the container are captured through that mount, left out of the
    /// rootfs a restore writes, and written into the new mount instead; with `since`, only
    /// what later turns changed. The "mount" here is a directory reached through this
    /// process's own /proc/<pid>/root, as the engine reaches a container's.
    #[test]
    fn paths_on_a_mount_go_through_the_mount() {
        use crate::mounts::ContainerRoot;
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
        let rootfs = tmp.path().join("root");
        fs::create_dir_all(rootfs.join("data")).unwrap();
        write(&rootfs, "data/x", b"on the rootfs");
        let mount_dir = tmp.path().join("shm");
        fs::create_dir(&mount_dir).unwrap();
        write(&mount_dir, "a", b"on the mount");
        let dest = RelPath::parse(mount_dir.as_os_str().as_encoded_bytes()).unwrap();
        let me = ContainerRoot::new(std::process::id()).unwrap();
        let abs = |rel: &str| format!("{dest}/{rel}").into_bytes();
        // The rootfs directory has no such path: only the mount can give it.
        let changed = vec![ChangedPath::created(abs("a")), ChangedPath::created("/data")];
        let input = TurnInput { container: "c", turn: 1, rootfs: Some(&rootfs), changed: &changed, criu_images: None };
        let staged = store.stage_turn_in(&input, &[me.open_mount(&dest).unwrap()], None).unwrap();
        store.publish(staged).unwrap();
        write(&mount_dir, "a", b"changed later");
        write(&mount_dir, "b", b"new");
        let changed = vec![ChangedPath::modified(abs("a")), ChangedPath::created(abs("b"))];
        let input = TurnInput { container: "c", turn: 2, rootfs: Some(&rootfs), changed: &changed, criu_images: None };
        let staged = store.stage_turn_in(&input, &[me.open_mount(&dest).unwrap()], None).unwrap();
        store.publish(staged).unwrap();

        let target = tmp.path().join("target");
        fs::create_dir(&target).unwrap();
        store.materialize_rootfs("c", 2, &target, std::slice::from_ref(&dest)).unwrap();
        assert_eq!(fs::read(target.join("data/x")).unwrap(), b"on the rootfs");
        assert_eq!(fs::read_dir(&target).unwrap().count(), 1, "nothing of the mount on the rootfs");

        // A new, empty mount gets the whole state.
        fs::remove_dir_all(&mount_dir).unwrap();
        fs::create_dir(&mount_dir).unwrap();
        store.materialize_mounts("c", 2, &[me.open_mount(&dest).unwrap()], None).unwrap();
        assert_eq!(fs::read(mount_dir.join("a")).unwrap(), b"changed later");
        assert_eq!(fs::read(mount_dir.join("b")).unwrap(), b"new");

        // As CRIU left it at turn 1: only turn 2's paths are written.
        fs::remove_dir_all(&mount_dir).unwrap();
        fs::create_dir(&mount_dir).unwrap();
        write(&mount_dir, "untouched-since-1", b"criu");
        write(&mount_dir, "a", b"as at 1");
        let stats = store.materialize_mounts("c", 2, &[me.open_mount(&dest).unwrap()], Some(1)).unwrap();
        assert_eq!(stats.files_written, 2, "{stats:?}");
        assert_eq!(fs::read(mount_dir.join("a")).unwrap(), b"changed later");
        assert_eq!(fs::read(mount_dir.join("untouched-since-1")).unwrap(), b"criu");
    }

    /// A rollback in place treats paths below a tmpfs as absent before they were recorded,
    /// even where the base image has a file at that path (hidden under the mount).
    #[test]
    fn rollback_below_a_tmpfs_removes_what_the_image_has_there() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
        let root = tmp.path().join("root");
        let base = tmp.path().join("base");
        fs::create_dir_all(root.join("run")).unwrap();
        fs::create_dir_all(base.join("run")).unwrap();
        write(&base, "run/f", b"the image's, hidden by the tmpfs");
        write(&root, "keep", b"1");
        let commit = |turn: u64, changed: &[ChangedPath]| {
            store
                .commit_turn(&TurnInput { container: "c", turn, rootfs: Some(&root), changed, criu_images: None })
                .unwrap();
        };
        commit(1, &[ChangedPath::created("/keep")]);
        write(&root, "run/f", b"written in the tmpfs");
        commit(2, &[ChangedPath::created("/run/f")]);
        let req = RollbackRequest { container: "c", to_turn: 1, root: &root, base: Some(&base), uncommitted: &[] };
        store.rollback_in_place_with(&req, &[RelPath::parse("/run").unwrap()]).unwrap();
        assert!(!root.join("run/f").exists(), "absent at turn 1, not the image's copy");
        assert!(root.join("run").is_dir(), "the mount point stays");
    }
}

/// The fs delta of `changed`: paths on one of `mounts` (the longest destination above them)
/// read through that mount, the others through `rootfs`; sorted by path.
fn capture_split(
    rootfs: &Path,
    rootfs_upper: Option<&Path>,
    changed: &[ChangedPath],
    mounts: &[ContainerMount],
    batch: &mut super::store::WriteBatch<'_>,
) -> Result<Vec<FsEntry>> {
    let mut on_root = Vec::new();
    let mut on_mount: Vec<Vec<ChangedPath>> = vec![Vec::new(); mounts.len()];
    for change in changed {
        let rel = RelPath::parse(&change.path)?;
        let mount = mounts
            .iter()
            .enumerate()
            .filter(|(_, m)| m.destination == rel || m.destination.is_ancestor_of(&rel))
            .max_by_key(|(_, m)| m.destination.as_bytes().len());
        match mount {
            Some((i, m)) => on_mount[i].push(ChangedPath {
                path: mounts::below(&m.destination, &rel),
                // The mount's root was there before any turn.
                created: change.created && rel != m.destination,
            }),
            None => on_root.push(change.clone()),
        }
    }
    let mut out =
        if on_root.is_empty() { Vec::new() } else { fsdelta::capture(rootfs, rootfs_upper, &on_root, batch)? };
    for (mount, changes) in mounts.iter().zip(on_mount) {
        if changes.is_empty() {
            continue;
        }
        for mut entry in fsdelta::capture_root(&mount.root, None, &changes, batch)? {
            entry.path = mounts::above(&mount.destination, &entry.path)?;
            if let FsNode::Hardlink { link_to, .. } = &mut entry.node {
                *link_to = mounts::above(&mount.destination, link_to)?;
            }
            out.push(entry);
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
