//! File system deltas: capturing the current state of changed paths under a root, and applying
//! recorded (or base) states back onto a root.
//!
//! Every path is resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` for its parent
//! and `O_NOFOLLOW`/`AT_SYMLINK_NOFOLLOW` for its last component: a symlink anywhere in a parent
//! component is refused, and the last component is recorded or replaced as itself.

use rustix::fs::OFlags;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use tracing::warn;

use super::error::{CheckpointError, IoContext, Result};
use super::manifest::{Extent, FsEntry, FsNode, Meta};
use super::path::{Bytes, RelPath};
use super::store::{BlobStore, Digest, WriteBatch};
use super::sys::{self, cstr, file_type};
use std::io::Read;

/// A path an agent turn touched, as reported by the inspector (absolute inside the container).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedPath {
    pub path: Vec<u8>,
    /// The path did not exist before the turn: a directory here is captured with its whole
    /// content instead of its metadata only.
    pub created: bool,
}

impl ChangedPath {
    pub fn modified(path: impl AsRef<[u8]>) -> Self {
        ChangedPath { path: path.as_ref().to_vec(), created: false }
    }

    pub fn created(path: impl AsRef<[u8]>) -> Self {
        ChangedPath { path: path.as_ref().to_vec(), created: true }
    }
}

/// A directory tree the store reads from or writes to, anchored by an `O_PATH` fd so that
/// later renames of its host path do not redirect us.
pub(crate) struct Root {
    fd: OwnedFd,
    path: PathBuf,
}

/// The parent directory of a path and its last component, ready for `*at` calls.
struct Slot {
    parent: OwnedFd,
    name: CString,
}

impl Root {
    /// A root the caller opened itself (e.g. a container's mount reached through a
    /// kernel-checked handle, see [`super::mounts`]); `path` only names it in errors.
    pub(crate) fn from_fd(fd: OwnedFd, path: PathBuf) -> Root {
        Root { fd, path }
    }

    pub(crate) fn open(path: &Path) -> Result<Root> {
        let fd = sys::open_dir_path(path).io_ctx("open root", path)?;
        Ok(Root { fd, path: path.to_owned() })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn host_path(&self, rel: &RelPath) -> PathBuf {
        self.path.join(String::from_utf8_lossy(rel.as_bytes()).as_ref())
    }

    /// Resolves the parent of `rel` beneath the root. `None` when a parent component does not
    /// exist or is not a directory (so `rel` cannot exist either).
    fn slot(&self, rel: &RelPath) -> Result<Option<Slot>> {
        let (parent, name) = match rel.split_last() {
            Some((parent, name)) => (parent, name),
            None => (&[][..], &b"."[..]),
        };
        let parent_c = cstr(if parent.is_empty() { b"." } else { parent }).io_ctx("resolve", self.host_path(rel))?;
        match sys::openat_beneath(self.fd.as_fd(), &parent_c, OFlags::PATH | OFlags::DIRECTORY) {
            Ok(parent) => Ok(Some(Slot { parent, name: cstr(name).io_ctx("resolve", self.host_path(rel))? })),
            Err(e) => match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENOTDIR) => Ok(None),
                Some(libc::ELOOP) => Err(CheckpointError::OutsideRoot {
                    path: rel.to_string(),
                    reason: format!("a parent component is a symlink (under {})", self.path.display()),
                }),
                Some(libc::EXDEV) => Err(CheckpointError::OutsideRoot {
                    path: rel.to_string(),
                    reason: format!("resolution leaves {}", self.path.display()),
                }),
                _ => Err(e).io_ctx("resolve parent of", self.host_path(rel)),
            },
        }
    }

    pub(crate) fn is_dir(&self, rel: &RelPath) -> Result<bool> {
        let Some(slot) = self.slot(rel)? else {
            return Ok(false);
        };
        let st = sys::fstatat_opt(slot.parent.as_fd(), &slot.name).io_ctx("stat", self.host_path(rel))?;
        Ok(st.is_some_and(|st| file_type(&st) == libc::S_IFDIR))
    }

    fn require_slot(&self, rel: &RelPath) -> Result<Slot> {
        self.slot(rel)?.ok_or_else(|| CheckpointError::Io {
            op: "resolve parent of",
            path: self.host_path(rel),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        })
    }
}

fn meta_of(st: &sys::Stat, xattrs: BTreeMap<String, Bytes>) -> Meta {
    Meta {
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime_sec: st.st_mtime,
        mtime_nsec: st.st_mtime_nsec as u32,
        xattrs,
    }
}

pub(crate) fn read_xattrs(fd: BorrowedFd<'_>, path: &Path) -> Result<BTreeMap<String, Bytes>> {
    let mut out = BTreeMap::new();
    for name in sys::list_xattrs(fd).io_ctx("listxattr", path)? {
        let Ok(text) = String::from_utf8(name.clone()) else {
            warn!(path = %path.display(), name = %String::from_utf8_lossy(&name), "skipping xattr with a non-UTF-8 name");
            continue;
        };
        let value = sys::get_xattr(fd, &cstr(&name).io_ctx("getxattr", path)?).io_ctx("getxattr", path)?;
        out.insert(text, Bytes(value));
    }
    Ok(out)
}

/// Records the current state of `changes` under `root`, storing file contents in `batch`.
/// Returns entries sorted by path, parents before children. `links_in` is where the other
/// names of a hard-linked file are looked for (the rootfs's writable layer, its overlay upper
/// directory, which mirrors the rootfs's paths); `None`: under `root` itself.
pub(crate) fn capture(
    root: &Path,
    links_in: Option<&Path>,
    changes: &[ChangedPath],
    batch: &mut WriteBatch<'_>,
) -> Result<Vec<FsEntry>> {
    let scope = links_in.map(Root::open).transpose()?;
    capture_root(&Root::open(root)?, scope.as_ref(), changes, batch)
}

/// [`capture`] under a root the caller opened.
pub(crate) fn capture_root(
    root: &Root,
    links_in: Option<&Root>,
    changes: &[ChangedPath],
    batch: &mut WriteBatch<'_>,
) -> Result<Vec<FsEntry>> {
    let mut wanted: BTreeMap<RelPath, bool> = BTreeMap::new();
    for change in changes {
        *wanted.entry(RelPath::parse(&change.path)?).or_default() |= change.created;
    }
    let mut capturer = Capturer { root, batch, links: HashMap::new(), out: Vec::new() };
    // Paths below a whiteout or a recursively captured directory are already described.
    let mut covering: HashSet<RelPath> = HashSet::new();
    for (rel, created) in wanted {
        if rel.ancestors().any(|a| covering.contains(&a)) {
            continue;
        }
        let recursive = created && !rel.is_root();
        let before = capturer.out.len();
        match root.slot(&rel)? {
            Some(slot) => capturer.capture_at(slot.parent.as_fd(), &slot.name, rel.clone(), recursive)?,
            None => capturer.out.push(FsEntry { path: rel.clone(), node: FsNode::Whiteout }),
        }
        if capturer.out[before].node.replaces_subtree() {
            covering.insert(rel);
        }
    }
    // A file with more names than this delta holds was written through one of them: every
    // name must be recorded with it, or a restore gives the others the old content (or none
    // of them the link).
    let missing: Vec<(u64, u64)> =
        capturer.links.iter().filter(|(_, g)| (g.names.len() as u64) < g.nlink).map(|(k, _)| *k).collect();
    if !missing.is_empty() {
        let captured: HashSet<RelPath> = capturer.out.iter().map(|e| e.path.clone()).collect();
        for rel in other_names(root, links_in, &capturer.links, &missing)? {
            if captured.contains(&rel) || rel.ancestors().any(|a| covering.contains(&a)) {
                continue;
            }
            if let Some(slot) = root.slot(&rel)? {
                capturer.capture_at(slot.parent.as_fd(), &slot.name, rel, false)?;
            }
        }
    }
    let Capturer { links, mut out, .. } = capturer;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    relink_groups(&mut out, links.values().map(|g| g.names.as_slice()));
    Ok(out)
}

/// Makes each group of names of one inode a [`FsNode::File`] at its first path (in the order
/// entries are applied) and [`FsNode::Hardlink`]s to it at the others, so a restore writes the
/// content once, then links. `entries` are sorted by path.
pub(crate) fn relink_groups<'g>(entries: &mut [FsEntry], groups: impl Iterator<Item = &'g [RelPath]>) {
    for names in groups {
        let Some(leader) = names.iter().min() else { continue };
        for name in names {
            let Ok(at) = entries.binary_search_by(|e| e.path.cmp(name)) else { continue };
            let node = std::mem::replace(&mut entries[at].node, FsNode::Whiteout);
            entries[at].node = match node {
                FsNode::File { meta, blob, size, extents } | FsNode::Hardlink { meta, blob, size, extents, .. } => {
                    if name == leader {
                        FsNode::File { meta, blob, size, extents }
                    } else {
                        FsNode::Hardlink { meta, link_to: leader.clone(), blob, size, extents }
                    }
                }
                other => other,
            };
        }
    }
}

/// Most entries looked at while searching for the other names of hard-linked files: past it the
/// capture fails (and the turn is carried) rather than record a link group incompletely.
const MAX_LINK_SEARCH: u64 = 1_000_000;

/// The paths (relative to `root`) of the names of the `missing` inodes under `links_in` (or
/// `root`) that the delta does not hold yet. The search stays on the inode's file system and is
/// made through descriptors, each directory opened once without following a link; a name found
/// is captured afterwards through `root` like any other path, as what it is then.
fn other_names(
    root: &Root,
    links_in: Option<&Root>,
    groups: &HashMap<(u64, u64), LinkGroup>,
    missing: &[(u64, u64)],
) -> Result<Vec<RelPath>> {
    let scope = links_in.unwrap_or(root);
    // The inode's identity where the search goes: the same one when that is the root itself,
    // otherwise what the writable layer holds at a name already seen.
    let mut wanted: HashSet<(u64, u64)> = HashSet::new();
    for key in missing {
        if links_in.is_none() {
            wanted.insert(*key);
            continue;
        }
        let Some(name) = groups[key].names.first() else { continue };
        let Some(slot) = scope.slot(name)? else { continue };
        let host = scope.host_path(name);
        if let Some(st) = sys::fstatat_opt(slot.parent.as_fd(), &slot.name).io_ctx("stat", &host)?
            && file_type(&st) == libc::S_IFREG
            && st.st_nlink > 1
        {
            wanted.insert((st.st_dev, st.st_ino));
        }
    }
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let top = sys::openat_beneath(scope.fd(), c".", OFlags::RDONLY | OFlags::DIRECTORY).io_ctx("open", scope.path())?;
    let dev = sys::fstat(top.as_fd()).io_ctx("stat", scope.path())?.st_dev;
    let mut search = LinkSearch { scope, wanted, dev, seen: 0, found: Vec::new() };
    search.dir(top, RelPath::root(), 0)?;
    Ok(search.found)
}

struct LinkSearch<'s> {
    scope: &'s Root,
    wanted: HashSet<(u64, u64)>,
    /// The file system searched: links never cross one.
    dev: u64,
    seen: u64,
    found: Vec<RelPath>,
}

impl LinkSearch<'_> {
    fn dir(&mut self, dir: OwnedFd, rel: RelPath, depth: usize) -> Result<()> {
        let host = self.scope.host_path(&rel);
        if depth >= MAX_LINK_DEPTH {
            return Err(CheckpointError::InvalidRequest(format!(
                "{} is more than {MAX_LINK_DEPTH} directories deep (looking for the names of a hard-linked file)",
                host.display()
            )));
        }
        for name in sys::read_dir_names(dir.as_fd()).io_ctx("readdir", &host)? {
            self.seen += 1;
            if self.seen > MAX_LINK_SEARCH {
                return Err(CheckpointError::InvalidRequest(format!(
                    "more than {MAX_LINK_SEARCH} entries under {} while looking for the names of a hard-linked file",
                    self.scope.path().display()
                )));
            }
            let name_c = cstr(&name).io_ctx("readdir", &host)?;
            let Some(st) = sys::fstatat_opt(dir.as_fd(), &name_c).io_ctx("stat", &host)? else { continue };
            if st.st_dev != self.dev {
                continue;
            }
            match file_type(&st) {
                libc::S_IFREG if st.st_nlink > 1 && self.wanted.contains(&(st.st_dev, st.st_ino)) => {
                    self.found.push(rel.join(&name));
                }
                libc::S_IFDIR => {
                    // O_NOFOLLOW: a directory swapped for a link since the stat is not entered;
                    // what was opened is checked to be a directory of this file system.
                    let child = match sys::openat(dir.as_fd(), &name_c, OFlags::RDONLY | OFlags::DIRECTORY, 0) {
                        Ok(fd) => fd,
                        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR)) => {
                            continue;
                        }
                        Err(e) => return Err(e).io_ctx("open", host.join(String::from_utf8_lossy(&name).as_ref())),
                    };
                    let cst = sys::fstat(child.as_fd()).io_ctx("stat", &host)?;
                    if file_type(&cst) == libc::S_IFDIR && cst.st_dev == self.dev {
                        self.dir(child, rel.join(&name), depth + 1)?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// How deep the search for a hard-linked file's names goes (each level holds a descriptor).
const MAX_LINK_DEPTH: usize = 512;

struct Capturer<'r, 'b, 'a> {
    root: &'r Root,
    batch: &'b mut WriteBatch<'a>,
    /// Every multiply-linked inode seen in this delta: its first content and all its names.
    links: HashMap<(u64, u64), LinkGroup>,
    out: Vec<FsEntry>,
}

impl Capturer<'_, '_, '_> {
    fn capture_at(&mut self, dir: BorrowedFd<'_>, name: &CStr, rel: RelPath, recursive: bool) -> Result<()> {
        let host = self.root.host_path(&rel);
        fail::fail_point!("fsdelta-capture-open");
        // The entry is opened once, as itself (O_PATH, no link followed, no device opened), and
        // everything after is decided and read on that handle: a name the container swaps
        // meanwhile changes nothing we do.
        let Some(entry) = sys::open_entry_opt(dir, name).io_ctx("open", &host)? else {
            self.out.push(FsEntry { path: rel, node: FsNode::Whiteout });
            return Ok(());
        };
        let st = sys::fstat(entry.as_fd()).io_ctx("stat", &host)?;
        fail::fail_point!("fsdelta-capture-read");
        let node = match file_type(&st) {
            libc::S_IFREG => {
                let file = File::from(sys::reopen(entry.as_fd(), OFlags::RDONLY).io_ctx("open", &host)?);
                let meta = meta_of(&st, read_xattrs(file.as_fd(), &host)?);
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1
                    && let Some(first) = self.links.get_mut(&key)
                {
                    first.names.push(rel.clone());
                    let node = FsNode::Hardlink {
                        meta,
                        link_to: first.names[0].clone(),
                        blob: first.blob,
                        size: first.size,
                        extents: first.extents.clone(),
                    };
                    self.out.push(FsEntry { path: rel, node });
                    return Ok(());
                }
                let (blob, size, extents) = read_content(self.batch, &file, &st, &host)?;
                if st.st_nlink > 1 {
                    let group = LinkGroup {
                        names: vec![rel.clone()],
                        nlink: st.st_nlink,
                        blob,
                        size,
                        extents: extents.clone(),
                    };
                    self.links.insert(key, group);
                }
                FsNode::File { meta, blob, size, extents }
            }
            libc::S_IFDIR => {
                let fd = sys::reopen(entry.as_fd(), OFlags::RDONLY | OFlags::DIRECTORY).io_ctx("open", &host)?;
                let meta = meta_of(&st, read_xattrs(fd.as_fd(), &host)?);
                self.out.push(FsEntry { path: rel.clone(), node: FsNode::Dir { meta, complete: recursive } });
                if recursive {
                    // Children are resolved from this open directory, never by path again.
                    for child in sys::read_dir_names(fd.as_fd()).io_ctx("readdir", &host)? {
                        let child_c = cstr(&child).io_ctx("readdir", &host)?;
                        self.capture_at(fd.as_fd(), &child_c, rel.join(&child), true)?;
                    }
                }
                return Ok(());
            }
            libc::S_IFLNK => {
                let target = sys::readlink_entry(entry.as_fd()).io_ctx("readlink", &host)?;
                FsNode::Symlink { meta: meta_of(&st, BTreeMap::new()), target: Bytes(target) }
            }
            // Device nodes, fifos and sockets are metadata: never opened, never read.
            other => FsNode::Special { meta: meta_of(&st, BTreeMap::new()), file_type: other, rdev: st.st_rdev },
        };
        self.out.push(FsEntry { path: rel, node });
        Ok(())
    }
}

/// A multiply-linked inode seen in this delta: its names in capture order, its link count and
/// its content as stored with the first name.
struct LinkGroup {
    names: Vec<RelPath>,
    nlink: u64,
    blob: Digest,
    size: u64,
    extents: Option<Vec<Extent>>,
}

/// Most data ranges one sparse file is recorded with. A file cut into more (a container can
/// make millions of 4 KiB islands) has its closest ranges merged, the holes between them
/// stored as zeros: the manifest stays small, and no byte of data is lost.
const MAX_EXTENTS: usize = 4096;

/// Stores a regular file's content; returns its blob, size and, for a sparse file, its data
/// ranges. A file whose allocated blocks cover less than its size may have holes: only its
/// data ranges (`SEEK_DATA`/`SEEK_HOLE`) are read and stored back to back, so a 1 TiB file of
/// holes costs nothing. Nothing is read past the size seen at open: a file the container
/// keeps appending to cannot keep the capture reading.
fn read_content(
    batch: &mut WriteBatch<'_>,
    file: &File,
    st: &sys::Stat,
    host: &Path,
) -> Result<(Digest, u64, Option<Vec<Extent>>)> {
    let size = st.st_size.max(0) as u64;
    let allocated = (st.st_blocks.max(0) as u64).saturating_mul(512);
    if allocated >= size {
        let (blob, read) = batch.put_reader(&mut file.take(size), host)?;
        return Ok((blob, read, None));
    }
    let extents = data_extents(file, size).io_ctx("seek", host)?;
    let mut reader = ExtentReader { file, extents: &extents, next: 0, at: extents.first().map_or(0, Extent::offset) };
    let (blob, _) = batch.put_reader(&mut reader, host)?;
    Ok((blob, size, Some(extents)))
}

/// The data ranges of `file` below `size`, at most [`MAX_EXTENTS`] of them.
pub(crate) fn data_extents(file: &File, size: u64) -> std::io::Result<Vec<Extent>> {
    let mut extents: Vec<Extent> = Vec::new();
    let mut gap = 0u64;
    let mut at = 0u64;
    while at < size {
        let Some(data) = sys::seek_data(file, at)? else {
            break;
        };
        if data >= size {
            break;
        }
        let end = sys::seek_hole(file, data)?.min(size);
        match extents.last_mut() {
            Some(last) if data - last.end() <= gap => last.1 = end - last.0,
            _ => extents.push(Extent(data, end - data)),
        }
        if extents.len() > MAX_EXTENTS {
            gap = (gap * 2).max(4096);
            extents = merge_extents(&extents, gap);
        }
        at = end;
    }
    Ok(extents)
}

/// Merges ranges whose gap is at most `gap` bytes.
fn merge_extents(extents: &[Extent], gap: u64) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::with_capacity(extents.len());
    for e in extents {
        match out.last_mut() {
            Some(last) if e.offset() - last.end() <= gap => last.1 = e.end() - last.0,
            _ => out.push(*e),
        }
    }
    out
}

/// Reads a file's data ranges back to back. A range the file no longer covers (it shrank
/// since) reads as zeros, so the stored blob always matches the recorded ranges.
struct ExtentReader<'f> {
    file: &'f File,
    extents: &'f [Extent],
    next: usize,
    at: u64,
}

impl std::io::Read for ExtentReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Some(extent) = self.extents.get(self.next) else {
            return Ok(0);
        };
        let want = (extent.end() - self.at).min(buf.len() as u64) as usize;
        let n = match std::os::unix::fs::FileExt::read_at(self.file, &mut buf[..want], self.at)? {
            0 => {
                buf[..want].fill(0);
                want
            }
            n => n,
        };
        self.at += n as u64;
        if self.at >= extent.end() {
            self.next += 1;
            self.at = self.extents.get(self.next).map_or(0, Extent::offset);
        }
        Ok(n)
    }
}

/// Where the content of a regular file comes from when it is written back.
enum Content<'x> {
    /// A stored blob: the whole file, or with `extents` a sparse file's data ranges.
    Blob {
        digest: &'x Digest,
        size: u64,
        extents: Option<&'x [Extent]>,
    },
    Host(File, u64),
}

/// Counters of one restore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub files_written: u64,
    pub bytes_written: u64,
    pub dirs_set: u64,
    pub links_made: u64,
    pub paths_removed: u64,
}

/// Writes recorded states onto a root. Blob contents are verified before the first change is
/// made ([`Applier::prefetch`]), so a corrupt store never leaves a half-restored tree.
pub(crate) struct Applier<'a> {
    root: &'a Root,
    blobs: &'a BlobStore,
    prefetched: HashMap<Digest, Vec<u8>>,
    /// Files this restore wrote (or linked): their content and their inode.
    written: HashMap<RelPath, (Digest, (u64, u64))>,
    /// Names of a hard-linked file applied before the name they link to was written (or when
    /// it never is, as after a removal of that name): the first one gets a copy and the others
    /// link to it; [`finish`](Self::finish) links them all to that name once it is written.
    stand_ins: HashMap<(RelPath, Digest), RelPath>,
    unlinked: Vec<(RelPath, RelPath, Digest)>,
    /// Directory mtimes change as their children are written, so they are set last.
    dir_times: Vec<(RelPath, (i64, u32))>,
    pub(crate) stats: ApplyStats,
}

/// Verified content kept in memory for the apply phase; above this, blobs are verified now and
/// re-verified while copied.
const PREFETCH_BUDGET: usize = 64 << 20;

impl<'a> Applier<'a> {
    pub(crate) fn new(root: &'a Root, blobs: &'a BlobStore) -> Self {
        Applier {
            root,
            blobs,
            prefetched: HashMap::new(),
            written: HashMap::new(),
            stand_ins: HashMap::new(),
            unlinked: Vec::new(),
            dir_times: Vec::new(),
            stats: ApplyStats::default(),
        }
    }

    pub(crate) fn prefetch<'d>(&mut self, digests: impl IntoIterator<Item = &'d Digest>) -> Result<()> {
        let mut budget = PREFETCH_BUDGET;
        let mut verified = HashSet::new();
        for digest in digests {
            if self.prefetched.contains_key(digest) || !verified.insert(*digest) {
                continue;
            }
            let size = self.blobs.size_of(digest)?.unwrap_or(0) as usize;
            if size <= budget {
                let data = self.blobs.read(digest)?;
                budget -= data.len();
                self.prefetched.insert(*digest, data);
            } else {
                self.blobs.verify(digest)?;
            }
        }
        Ok(())
    }

    /// Applies one entry. With `wipe_complete`, a complete directory replaces whatever subtree
    /// is there (full materialisation); without it, only the directory itself is set (rollback
    /// handles the children one by one).
    pub(crate) fn apply(&mut self, entry: &FsEntry, wipe_complete: bool) -> Result<()> {
        let rel = &entry.path;
        if rel.is_root() && !matches!(entry.node, FsNode::Dir { .. }) {
            return Err(CheckpointError::UnsafePath { path: "/".into(), reason: "the root can only be a directory" });
        }
        let slot = match (&entry.node, self.root.slot(rel)?) {
            (_, Some(slot)) => slot,
            (FsNode::Whiteout, None) => return Ok(()),
            (_, None) => self.root.require_slot(rel)?,
        };
        let existing = self.stat(&slot, rel)?;
        match &entry.node {
            FsNode::Whiteout => {
                if let Some(st) = existing {
                    self.remove(&slot, rel, &st)?;
                }
            }
            FsNode::Dir { meta, complete } => {
                let keep =
                    existing.as_ref().is_some_and(|st| file_type(st) == libc::S_IFDIR) && !(*complete && wipe_complete);
                self.make_dir(&slot, rel, existing.filter(|_| !keep), meta)?;
            }
            FsNode::File { meta, blob, size, extents } => {
                let content = Content::Blob { digest: blob, size: *size, extents: extents.as_deref() };
                self.write_file(&slot, rel, existing, content, meta)?
            }
            FsNode::Hardlink { meta, link_to, blob, size, extents } => {
                if self.try_link(&slot, rel, link_to, blob)? {
                    return Ok(());
                }
                self.unlinked.push((rel.clone(), link_to.clone(), *blob));
                let key = (link_to.clone(), *blob);
                if let Some(stand_in) = self.stand_ins.get(&key).cloned()
                    && self.try_link(&slot, rel, &stand_in, blob)?
                {
                    return Ok(());
                }
                let existing = self.stat(&slot, rel)?;
                let content = Content::Blob { digest: blob, size: *size, extents: extents.as_deref() };
                self.write_file(&slot, rel, existing, content, meta)?;
                self.stand_ins.insert(key, rel.clone());
            }
            FsNode::Symlink { meta, target } => self.make_symlink(&slot, rel, existing, &target.0, meta)?,
            FsNode::Special { meta, file_type, rdev } => {
                self.make_special(&slot, rel, existing, *file_type, *rdev, meta)?
            }
        }
        Ok(())
    }

    /// Makes `rel` under our root what it is under `base` (a read-only image rootfs), down the
    /// whole subtree with `recursive`. A path missing in the base is removed.
    pub(crate) fn copy_from_base(&mut self, base: &Root, rel: &RelPath, recursive: bool) -> Result<()> {
        let host = base.host_path(rel);
        let base_st = match base.slot(rel)? {
            Some(bslot) => {
                sys::fstatat_opt(bslot.parent.as_fd(), &bslot.name).io_ctx("stat", &host)?.map(|st| (bslot, st))
            }
            None => None,
        };
        let Some((bslot, bst)) = base_st else {
            return self.apply(&FsEntry { path: rel.clone(), node: FsNode::Whiteout }, false);
        };
        let slot = self.root.require_slot(rel)?;
        let existing = self.stat(&slot, rel)?;
        match file_type(&bst) {
            libc::S_IFREG => {
                let fd = sys::openat(bslot.parent.as_fd(), &bslot.name, OFlags::RDONLY, 0).io_ctx("open", &host)?;
                let meta = meta_of(&bst, read_xattrs(fd.as_fd(), &host)?);
                let size = bst.st_size as u64;
                self.write_file(&slot, rel, existing, Content::Host(File::from(fd), size), &meta)?;
            }
            libc::S_IFDIR => {
                let fd = sys::openat(bslot.parent.as_fd(), &bslot.name, OFlags::RDONLY | OFlags::DIRECTORY, 0)
                    .io_ctx("open", &host)?;
                let meta = meta_of(&bst, read_xattrs(fd.as_fd(), &host)?);
                let is_dir = existing.as_ref().is_some_and(|st| file_type(st) == libc::S_IFDIR);
                self.make_dir(&slot, rel, existing.filter(|_| !is_dir), &meta)?;
                if recursive {
                    for child in sys::read_dir_names(fd.as_fd()).io_ctx("readdir", &host)? {
                        self.copy_from_base(base, &rel.join(&child), true)?;
                    }
                }
            }
            libc::S_IFLNK => {
                let target = sys::readlinkat(bslot.parent.as_fd(), &bslot.name).io_ctx("readlink", &host)?;
                self.make_symlink(&slot, rel, existing, &target, &meta_of(&bst, BTreeMap::new()))?;
            }
            other => {
                self.make_special(&slot, rel, existing, other, bst.st_rdev, &meta_of(&bst, BTreeMap::new()))?;
            }
        }
        Ok(())
    }

    /// Removes `rel` and everything below it, if present.
    pub(crate) fn remove_path(&mut self, rel: &RelPath) -> Result<()> {
        self.apply(&FsEntry { path: rel.clone(), node: FsNode::Whiteout }, false)
    }

    /// Sets the deferred directory mtimes, deepest first.
    pub(crate) fn finish(mut self) -> Result<ApplyStats> {
        // Names written before the name they link to: linked to it now that it is written.
        for (rel, link_to, blob) in std::mem::take(&mut self.unlinked) {
            let (Some(&(leader_blob, leader)), Some(&(_, own))) = (self.written.get(&link_to), self.written.get(&rel))
            else {
                continue;
            };
            if leader_blob != blob || own == leader {
                continue;
            }
            let Some(slot) = self.root.slot(&rel)? else { continue };
            self.try_link(&slot, &rel, &link_to, &blob)?;
        }
        self.dir_times.sort_by(|a, b| b.0.cmp(&a.0));
        for (rel, mtime) in std::mem::take(&mut self.dir_times) {
            if let Some(slot) = self.root.slot(&rel)? {
                sys::lutimensat(slot.parent.as_fd(), &slot.name, mtime)
                    .io_ctx("utimensat", self.root.host_path(&rel))?;
            }
        }
        Ok(self.stats)
    }

    fn stat(&self, slot: &Slot, rel: &RelPath) -> Result<Option<sys::Stat>> {
        sys::fstatat_opt(slot.parent.as_fd(), &slot.name).io_ctx("stat", self.root.host_path(rel))
    }

    fn remove(&mut self, slot: &Slot, rel: &RelPath, st: &sys::Stat) -> Result<()> {
        let host = self.root.host_path(rel);
        if file_type(st) == libc::S_IFDIR {
            remove_tree(slot.parent.as_fd(), &slot.name, &host)?;
        } else {
            sys::unlinkat(slot.parent.as_fd(), &slot.name, false).io_ctx("unlink", &host)?;
        }
        self.written.remove(rel);
        self.stats.paths_removed += 1;
        Ok(())
    }

    /// Opens what is at the slot now as an `O_PATH` handle and its stat; `None` when nothing is.
    fn open_current(&self, slot: &Slot, host: &Path) -> Result<Option<(OwnedFd, sys::Stat)>> {
        let Some(fd) = sys::open_entry_opt(slot.parent.as_fd(), &slot.name).io_ctx("open", host)? else {
            return Ok(None);
        };
        let st = sys::fstat(fd.as_fd()).io_ctx("stat", host)?;
        Ok(Some((fd, st)))
    }

    /// Removes whatever is at the slot now, if anything.
    fn remove_current(&mut self, slot: &Slot, rel: &RelPath) -> Result<()> {
        match self.stat(slot, rel)? {
            Some(st) => self.remove(slot, rel, &st),
            None => Ok(()),
        }
    }

    fn write_file(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<sys::Stat>,
        content: Content<'_>,
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        fail::fail_point!("fsdelta-write-open");
        // Rewriting in place keeps the inode (open fds, bind mounts) unless other names share
        // it. What was decided on `existing` is checked again on the handle actually opened:
        // the container may have put a device node or a link there since.
        let mut file = None;
        let mut current = None;
        if existing.as_ref().is_some_and(|st| file_type(st) == libc::S_IFREG && st.st_nlink == 1)
            && let Some((fd, st)) = self.open_current(slot, &host)?
        {
            let decided = existing.as_ref().is_some_and(|e| same_inode(e, &st));
            if decided && file_type(&st) == libc::S_IFREG && st.st_nlink == 1 {
                file = Some(File::from(sys::reopen(fd.as_fd(), OFlags::WRONLY).io_ctx("open", &host)?));
            }
            current = Some(st);
        }
        let in_place = file.is_some();
        let mut file = match file {
            Some(file) => file,
            None => self.create_file(slot, rel, &host)?,
        };
        let old_size = current.as_ref().filter(|_| in_place).map(|st| st.st_size as u64);
        let bytes = match &content {
            Content::Blob { digest, size, extents: Some(extents) } => {
                // Holes must read as zeros: the old bytes go first.
                if old_size.is_some_and(|old| old > 0) {
                    file.set_len(0).io_ctx("truncate", &host)?;
                }
                self.write_extents(digest, &file, extents, &host)?;
                file.set_len(*size).io_ctx("truncate", &host)?;
                *size
            }
            Content::Blob { digest, .. } => match self.prefetched.get(*digest) {
                Some(data) => {
                    file.write_all(data).io_ctx("write", &host)?;
                    data.len() as u64
                }
                None => self.blobs.copy_verified(digest, &file, &host)?,
            },
            Content::Host(src, size) => {
                sys::copy_file_range_all(src, &file, *size).io_ctx("copy_file_range", &host)?;
                *size
            }
        };
        // No O_TRUNC above: ext4 treats truncate-to-zero-then-write as a file replacement and
        // flushes it on close (auto_da_alloc), costing milliseconds per file. Overwrite, then
        // cut to size; growing needs no truncate, and truncating is the one call here that
        // waits for the journal, so only shrink when needed.
        if old_size.is_some_and(|old| old > bytes) {
            file.set_len(bytes).io_ctx("truncate", &host)?;
        }
        set_meta(file.as_fd(), meta, &host, current.as_ref().filter(|_| in_place))?;
        sys::futimens(file.as_fd(), meta.mtime()).io_ctx("futimens", &host)?;
        if let Content::Blob { digest, .. } = content {
            let st = sys::fstat(file.as_fd()).io_ctx("stat", &host)?;
            self.written.insert(rel.clone(), (*digest, (st.st_dev, st.st_ino)));
        }
        self.stats.files_written += 1;
        self.stats.bytes_written += bytes;
        Ok(())
    }

    /// Creates a new, empty regular file at the slot (whatever is there goes first).
    /// `O_CREAT|O_EXCL` never opens an existing name, a link or a device node included.
    fn create_file(&mut self, slot: &Slot, rel: &RelPath, host: &Path) -> Result<File> {
        for _ in 0..RACE_ATTEMPTS {
            self.remove_current(slot, rel)?;
            let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL;
            match sys::openat(slot.parent.as_fd(), &slot.name, flags, 0o600) {
                Ok(fd) => return Ok(File::from(fd)),
                // Something was put there again since the removal.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                Err(e) => return Err(e).io_ctx("create", host),
            }
        }
        Err(kept_changing(host, "created"))
    }

    /// Writes a sparse file's stored data ranges into `file`.
    fn write_extents(&self, digest: &Digest, file: &File, extents: &[Extent], host: &Path) -> Result<()> {
        let mut last_end = 0;
        for e in extents {
            if e.offset() < last_end || e.end() < e.offset() {
                return Err(CheckpointError::BadExtents {
                    path: host.to_owned(),
                    reason: format!("range {e:?} overlaps the one before or wraps around"),
                });
            }
            last_end = e.end();
        }
        let Some(data) = self.prefetched.get(digest) else {
            self.blobs.copy_verified_to_extents(digest, file, extents, host)?;
            return Ok(());
        };
        super::store::write_to_extents(data, file, extents, host)
    }

    /// Links `rel` to `link_to` when that path was written with the same content in this
    /// restore; otherwise the caller writes a copy. The link is made to the inode this restore
    /// wrote, through a handle checked to hold it: whatever the container put at `link_to`
    /// meanwhile is never linked.
    fn try_link(&mut self, slot: &Slot, rel: &RelPath, link_to: &RelPath, blob: &Digest) -> Result<bool> {
        let Some(&(written, inode)) = self.written.get(link_to) else {
            return Ok(false);
        };
        if written != *blob {
            return Ok(false);
        }
        let Some(src) = self.root.slot(link_to)? else {
            return Ok(false);
        };
        let src_host = self.root.host_path(link_to);
        let Some(fd) = sys::open_entry_opt(src.parent.as_fd(), &src.name).io_ctx("open", &src_host)? else {
            return Ok(false);
        };
        let st = sys::fstat(fd.as_fd()).io_ctx("stat", &src_host)?;
        if file_type(&st) != libc::S_IFREG || (st.st_dev, st.st_ino) != inode {
            return Ok(false);
        }
        let host = self.root.host_path(rel);
        for _ in 0..RACE_ATTEMPTS {
            match self.stat(slot, rel)? {
                Some(now) if same_inode(&now, &st) => break,
                Some(now) => self.remove(slot, rel, &now)?,
                None => {}
            }
            match sys::link_entry(fd.as_fd(), slot.parent.as_fd(), &slot.name) {
                Ok(()) => break,
                // Something was put there again since the removal.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                Err(e) => return Err(e).io_ctx("link", &host),
            }
        }
        let now = self.stat(slot, rel)?;
        if !now.as_ref().is_some_and(|now| same_inode(now, &st)) {
            return Err(kept_changing(&host, "linked"));
        }
        self.written.insert(rel.clone(), (*blob, inode));
        self.stats.links_made += 1;
        Ok(true)
    }

    /// Creates the directory unless `replace` is `None` and one is there; `replace` holds the
    /// non-directory (or wiped directory) that must go first.
    fn make_dir(&mut self, slot: &Slot, rel: &RelPath, replace: Option<sys::Stat>, meta: &Meta) -> Result<()> {
        let host = self.root.host_path(rel);
        if let Some(st) = replace {
            self.remove(slot, rel, &st)?;
        }
        for _ in 0..RACE_ATTEMPTS {
            if self.stat(slot, rel)?.is_none() {
                match sys::mkdirat(slot.parent.as_fd(), &slot.name, 0o700) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(e).io_ctx("mkdir", &host),
                }
            }
            fail::fail_point!("fsdelta-apply-meta");
            // The metadata goes on through a handle of what is there now, and only if that is
            // a directory: never through a name the container may have replaced.
            let Some((fd, st)) = self.open_current(slot, &host)? else {
                continue;
            };
            if file_type(&st) != libc::S_IFDIR {
                self.remove(slot, rel, &st)?;
                continue;
            }
            let dir = sys::reopen(fd.as_fd(), OFlags::RDONLY | OFlags::DIRECTORY).io_ctx("open", &host)?;
            set_meta(dir.as_fd(), meta, &host, Some(&st))?;
            self.dir_times.push((rel.clone(), meta.mtime()));
            self.stats.dirs_set += 1;
            return Ok(());
        }
        Err(kept_changing(&host, "made a directory"))
    }

    fn make_symlink(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<sys::Stat>,
        target: &[u8],
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        let target_c = cstr(target).io_ctx("symlink", &host)?;
        let mut existing = existing;
        for _ in 0..RACE_ATTEMPTS {
            let same = match &existing {
                Some(st) if file_type(st) == libc::S_IFLNK => {
                    sys::readlinkat(slot.parent.as_fd(), &slot.name).io_ctx("readlink", &host)? == target
                }
                _ => false,
            };
            if !same {
                if let Some(st) = existing {
                    self.remove(slot, rel, &st)?;
                }
                match sys::symlinkat(&target_c, slot.parent.as_fd(), &slot.name) {
                    Ok(()) => self.stats.files_written += 1,
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                        existing = self.stat(slot, rel)?;
                        continue;
                    }
                    Err(e) => return Err(e).io_ctx("symlink", &host),
                }
            }
            fail::fail_point!("fsdelta-apply-meta");
            // Owner through a handle of the link itself, once it is checked to be our link.
            let Some((fd, st)) = self.open_current(slot, &host)? else {
                existing = None;
                continue;
            };
            if file_type(&st) != libc::S_IFLNK || sys::readlink_entry(fd.as_fd()).io_ctx("readlink", &host)? != target {
                existing = Some(st);
                continue;
            }
            sys::chown_entry(fd.as_fd(), meta.uid, meta.gid).io_ctx("lchown", &host)?;
            // By name, never following: at worst it sets the time of an entry the container
            // swapped in since, inside its own rootfs.
            return sys::lutimensat(slot.parent.as_fd(), &slot.name, meta.mtime()).io_ctx("utimensat", &host);
        }
        Err(kept_changing(&host, "made a symlink"))
    }

    fn make_special(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<sys::Stat>,
        kind: u32,
        rdev: u64,
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        if let Some(st) = existing {
            self.remove(slot, rel, &st)?;
        }
        for _ in 0..RACE_ATTEMPTS {
            match sys::mknodat(slot.parent.as_fd(), &slot.name, kind | 0o600, rdev) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    self.remove_current(slot, rel)?;
                    continue;
                }
                Err(e) => return Err(e).io_ctx("mknod", &host),
            }
            fail::fail_point!("fsdelta-special-meta");
            // Owner, mode and time through a handle of the node just made, checked to be it:
            // a name the container replaced with a link must not carry our chmod to the host.
            // The node itself is never opened.
            let Some((fd, st)) = self.open_current(slot, &host)? else {
                continue;
            };
            if file_type(&st) != kind || st.st_rdev != rdev {
                self.remove(slot, rel, &st)?;
                continue;
            }
            sys::chown_entry(fd.as_fd(), meta.uid, meta.gid).io_ctx("lchown", &host)?;
            // chown clears setuid/setgid, so the mode goes on after it.
            sys::chmod_entry(fd.as_fd(), meta.mode).io_ctx("chmod", &host)?;
            sys::utimens_entry(fd.as_fd(), meta.mtime()).io_ctx("utimensat", &host)?;
            self.stats.files_written += 1;
            return Ok(());
        }
        Err(kept_changing(&host, "made a special file"))
    }
}

/// How often a restore step is redone when the container replaced the path in between; past
/// that the restore fails (the container is attacking it) and says so.
const RACE_ATTEMPTS: u32 = 8;

fn kept_changing(host: &Path, op: &'static str) -> CheckpointError {
    CheckpointError::KeptChanging { path: host.to_owned(), op, attempts: RACE_ATTEMPTS }
}

fn same_inode(a: &sys::Stat, b: &sys::Stat) -> bool {
    (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
}

/// Owner, mode and xattrs of an open file or directory (mtime is the caller's, set last).
/// `current` is the node's stat when it existed before: every inode update waits for the
/// journal on a busy ext4, so what already matches is left alone.
fn set_meta(fd: BorrowedFd<'_>, meta: &Meta, host: &Path, current: Option<&sys::Stat>) -> Result<()> {
    let owner_ok = current.is_some_and(|st| st.st_uid == meta.uid && st.st_gid == meta.gid);
    if !owner_ok {
        sys::fchown(fd, meta.uid, meta.gid).io_ctx("chown", host)?;
    }
    // chown clears setuid/setgid, so the mode goes on after it.
    let mode_ok = owner_ok && current.is_some_and(|st| st.st_mode & 0o7777 == meta.mode);
    if !mode_ok {
        sys::fchmod(fd, meta.mode).io_ctx("chmod", host)?;
    }
    let mut present = HashSet::new();
    for name in sys::list_xattrs(fd).io_ctx("listxattr", host)? {
        let name_c = cstr(&name).io_ctx("removexattr", host)?;
        match std::str::from_utf8(&name).ok().and_then(|n| meta.xattrs.get(n)) {
            Some(wanted) if sys::get_xattr(fd, &name_c).io_ctx("getxattr", host)? == wanted.0 => {
                present.insert(name);
            }
            Some(_) => {}
            None => sys::remove_xattr(fd, &name_c).io_ctx("removexattr", host)?,
        }
    }
    for (name, value) in &meta.xattrs {
        if !present.contains(name.as_bytes()) {
            let name_c = cstr(name.as_bytes()).io_ctx("setxattr", host)?;
            sys::set_xattr(fd, &name_c, &value.0).io_ctx("setxattr", host)?;
        }
    }
    Ok(())
}

fn remove_tree(parent: BorrowedFd<'_>, name: &CStr, host: &Path) -> Result<()> {
    let dir = sys::openat(parent, name, OFlags::RDONLY | OFlags::DIRECTORY, 0).io_ctx("open", host)?;
    for child in sys::read_dir_names(dir.as_fd()).io_ctx("readdir", host)? {
        let child_c = cstr(&child).io_ctx("readdir", host)?;
        let child_host = host.join(String::from_utf8_lossy(&child).as_ref());
        let st = sys::fstatat(dir.as_fd(), &child_c).io_ctx("stat", &child_host)?;
        if file_type(&st) == libc::S_IFDIR {
            remove_tree(dir.as_fd(), &child_c, &child_host)?;
        } else {
            sys::unlinkat(dir.as_fd(), &child_c, false).io_ctx("unlink", &child_host)?;
        }
    }
    sys::unlinkat(parent, name, true).io_ctx("rmdir", host)
}

#[cfg(test)]
#[path = "fsdelta_races.rs"]
mod races;
