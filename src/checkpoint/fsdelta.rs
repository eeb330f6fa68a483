//! File system deltas: capturing the current state of changed paths under a root, and applying
//! recorded (or base) states back onto a root.
//!
//! Every path is resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` for its parent
//! and `O_NOFOLLOW`/`AT_SYMLINK_NOFOLLOW` for its last component: a symlink anywhere in a parent
//! component is refused, and the last component is recorded or replaced as itself.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use tracing::warn;

use super::error::{CheckpointError, IoContext, Result};
use super::manifest::{FsEntry, FsNode, Meta};
use super::path::{Bytes, RelPath};
use super::store::{BlobStore, Digest, WriteBatch};
use super::sys::{self, cstr, file_type};

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
        ChangedPath {
            path: path.as_ref().to_vec(),
            created: false,
        }
    }

    pub fn created(path: impl AsRef<[u8]>) -> Self {
        ChangedPath {
            path: path.as_ref().to_vec(),
            created: true,
        }
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
        Ok(Root {
            fd,
            path: path.to_owned(),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn host_path(&self, rel: &RelPath) -> PathBuf {
        self.path
            .join(String::from_utf8_lossy(rel.as_bytes()).as_ref())
    }

    /// Resolves the parent of `rel` beneath the root. `None` when a parent component does not
    /// exist or is not a directory (so `rel` cannot exist either).
    fn slot(&self, rel: &RelPath) -> Result<Option<Slot>> {
        let (parent, name) = match rel.split_last() {
            Some((parent, name)) => (parent, name),
            None => (&[][..], &b"."[..]),
        };
        let parent_c = cstr(if parent.is_empty() { b"." } else { parent })
            .io_ctx("resolve", self.host_path(rel))?;
        match sys::openat_beneath(self.fd.as_fd(), &parent_c, libc::O_PATH | libc::O_DIRECTORY) {
            Ok(parent) => Ok(Some(Slot {
                parent,
                name: cstr(name).io_ctx("resolve", self.host_path(rel))?,
            })),
            Err(e) => match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENOTDIR) => Ok(None),
                Some(libc::ELOOP) => Err(CheckpointError::OutsideRoot {
                    path: rel.to_string(),
                    reason: format!(
                        "a parent component is a symlink (under {})",
                        self.path.display()
                    ),
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
        let st = sys::fstatat_opt(slot.parent.as_fd(), &slot.name)
            .io_ctx("stat", self.host_path(rel))?;
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

fn meta_of(st: &libc::stat, xattrs: BTreeMap<String, Bytes>) -> Meta {
    Meta {
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime_sec: st.st_mtime,
        mtime_nsec: st.st_mtime_nsec as u32,
        xattrs,
    }
}

fn read_xattrs(fd: BorrowedFd<'_>, path: &Path) -> Result<BTreeMap<String, Bytes>> {
    let mut out = BTreeMap::new();
    for name in sys::list_xattrs(fd).io_ctx("listxattr", path)? {
        let Ok(text) = String::from_utf8(name.clone()) else {
            warn!(path = %path.display(), name = %String::from_utf8_lossy(&name), "skipping xattr with a non-UTF-8 name");
            continue;
        };
        let value =
            sys::get_xattr(fd, &cstr(&name).io_ctx("getxattr", path)?).io_ctx("getxattr", path)?;
        out.insert(text, Bytes(value));
    }
    Ok(out)
}

/// Records the current state of `changes` under `root`, storing file contents in `batch`.
/// Returns entries sorted by path, parents before children.
pub(crate) fn capture(
    root: &Path,
    changes: &[ChangedPath],
    batch: &mut WriteBatch<'_>,
) -> Result<Vec<FsEntry>> {
    capture_root(&Root::open(root)?, changes, batch)
}

/// [`capture`] under a root the caller opened.
pub(crate) fn capture_root(
    root: &Root,
    changes: &[ChangedPath],
    batch: &mut WriteBatch<'_>,
) -> Result<Vec<FsEntry>> {
    let mut wanted: BTreeMap<RelPath, bool> = BTreeMap::new();
    for change in changes {
        *wanted.entry(RelPath::parse(&change.path)?).or_default() |= change.created;
    }
    let mut capturer = Capturer {
        root,
        batch,
        links: HashMap::new(),
        out: Vec::new(),
    };
    // Paths below a whiteout or a recursively captured directory are already described.
    let mut covering: HashSet<RelPath> = HashSet::new();
    for (rel, created) in wanted {
        if rel.ancestors().any(|a| covering.contains(&a)) {
            continue;
        }
        let recursive = created && !rel.is_root();
        let before = capturer.out.len();
        match root.slot(&rel)? {
            Some(slot) => {
                capturer.capture_at(slot.parent.as_fd(), &slot.name, rel.clone(), recursive)?
            }
            None => capturer.out.push(FsEntry {
                path: rel.clone(),
                node: FsNode::Whiteout,
            }),
        }
        if capturer.out[before].node.replaces_subtree() {
            covering.insert(rel);
        }
    }
    let mut out = capturer.out;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

struct Capturer<'r, 'b, 'a> {
    root: &'r Root,
    batch: &'b mut WriteBatch<'a>,
    /// First path and content of every multiply-linked inode seen in this delta.
    links: HashMap<(u64, u64), (RelPath, Digest, u64)>,
    out: Vec<FsEntry>,
}

impl Capturer<'_, '_, '_> {
    fn capture_at(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &CStr,
        rel: RelPath,
        recursive: bool,
    ) -> Result<()> {
        let host = self.root.host_path(&rel);
        let Some(st) = sys::fstatat_opt(dir, name).io_ctx("stat", &host)? else {
            self.out.push(FsEntry {
                path: rel,
                node: FsNode::Whiteout,
            });
            return Ok(());
        };
        let node = match file_type(&st) {
            libc::S_IFREG => {
                let fd = match sys::openat(dir, name, libc::O_RDONLY | libc::O_NONBLOCK, 0) {
                    Ok(fd) => fd,
                    // Replaced by a symlink or removed between stat and open: record what is there now.
                    Err(e)
                        if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOENT)) =>
                    {
                        return self.capture_at(dir, name, rel, recursive);
                    }
                    Err(e) => return Err(e).io_ctx("open", &host),
                };
                let st = sys::fstat(fd.as_fd()).io_ctx("stat", &host)?;
                let meta = meta_of(&st, read_xattrs(fd.as_fd(), &host)?);
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1
                    && let Some((first, blob, size)) = self.links.get(&key)
                {
                    let node = FsNode::Hardlink {
                        meta,
                        link_to: first.clone(),
                        blob: *blob,
                        size: *size,
                    };
                    self.out.push(FsEntry { path: rel, node });
                    return Ok(());
                }
                let (blob, size) = self.batch.put_reader(&mut File::from(fd), &host)?;
                if st.st_nlink > 1 {
                    self.links.insert(key, (rel.clone(), blob, size));
                }
                FsNode::File { meta, blob, size }
            }
            libc::S_IFDIR => {
                let fd = sys::openat(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
                    .io_ctx("open", &host)?;
                let meta = meta_of(&st, read_xattrs(fd.as_fd(), &host)?);
                self.out.push(FsEntry {
                    path: rel.clone(),
                    node: FsNode::Dir {
                        meta,
                        complete: recursive,
                    },
                });
                if recursive {
                    for child in sys::read_dir_names(fd.as_fd()).io_ctx("readdir", &host)? {
                        let child_c = cstr(&child).io_ctx("readdir", &host)?;
                        self.capture_at(fd.as_fd(), &child_c, rel.join(&child), true)?;
                    }
                }
                return Ok(());
            }
            libc::S_IFLNK => {
                let target = sys::readlinkat(dir, name).io_ctx("readlink", &host)?;
                FsNode::Symlink {
                    meta: meta_of(&st, BTreeMap::new()),
                    target: Bytes(target),
                }
            }
            other => FsNode::Special {
                meta: meta_of(&st, BTreeMap::new()),
                file_type: other,
                rdev: st.st_rdev,
            },
        };
        self.out.push(FsEntry { path: rel, node });
        Ok(())
    }
}

/// Where the content of a regular file comes from when it is written back.
enum Content<'x> {
    Blob(&'x Digest),
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
    written: HashMap<RelPath, Digest>,
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
            dir_times: Vec::new(),
            stats: ApplyStats::default(),
        }
    }

    pub(crate) fn prefetch<'d>(
        &mut self,
        digests: impl IntoIterator<Item = &'d Digest>,
    ) -> Result<()> {
        let mut budget = PREFETCH_BUDGET;
        let mut verified = HashSet::new();
        for digest in digests {
            if self.prefetched.contains_key(digest) || !verified.insert(*digest) {
                continue;
            }
            let size = std::fs::metadata(self.blobs.path_of(digest))
                .map(|m| m.len() as usize)
                .unwrap_or(0);
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
            return Err(CheckpointError::UnsafePath {
                path: "/".into(),
                reason: "the root can only be a directory",
            });
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
                let keep = existing
                    .as_ref()
                    .is_some_and(|st| file_type(st) == libc::S_IFDIR)
                    && !(*complete && wipe_complete);
                self.make_dir(&slot, rel, existing.filter(|_| !keep), meta)?;
            }
            FsNode::File { meta, blob, .. } => {
                self.write_file(&slot, rel, existing, Content::Blob(blob), meta)?
            }
            FsNode::Hardlink {
                meta,
                link_to,
                blob,
                ..
            } => {
                if !self.try_link(&slot, rel, existing.as_ref(), link_to, blob)? {
                    let existing = self.stat(&slot, rel)?;
                    self.write_file(&slot, rel, existing, Content::Blob(blob), meta)?;
                }
            }
            FsNode::Symlink { meta, target } => {
                self.make_symlink(&slot, rel, existing, &target.0, meta)?
            }
            FsNode::Special {
                meta,
                file_type,
                rdev,
            } => self.make_special(&slot, rel, existing, *file_type, *rdev, meta)?,
        }
        Ok(())
    }

    /// Makes `rel` under our root what it is under `base` (a read-only image rootfs), down the
    /// whole subtree with `recursive`. A path missing in the base is removed.
    pub(crate) fn copy_from_base(
        &mut self,
        base: &Root,
        rel: &RelPath,
        recursive: bool,
    ) -> Result<()> {
        let host = base.host_path(rel);
        let base_st = match base.slot(rel)? {
            Some(bslot) => sys::fstatat_opt(bslot.parent.as_fd(), &bslot.name)
                .io_ctx("stat", &host)?
                .map(|st| (bslot, st)),
            None => None,
        };
        let Some((bslot, bst)) = base_st else {
            return self.apply(
                &FsEntry {
                    path: rel.clone(),
                    node: FsNode::Whiteout,
                },
                false,
            );
        };
        let slot = self.root.require_slot(rel)?;
        let existing = self.stat(&slot, rel)?;
        match file_type(&bst) {
            libc::S_IFREG => {
                let fd = sys::openat(bslot.parent.as_fd(), &bslot.name, libc::O_RDONLY, 0)
                    .io_ctx("open", &host)?;
                let meta = meta_of(&bst, read_xattrs(fd.as_fd(), &host)?);
                let size = bst.st_size as u64;
                self.write_file(
                    &slot,
                    rel,
                    existing,
                    Content::Host(File::from(fd), size),
                    &meta,
                )?;
            }
            libc::S_IFDIR => {
                let fd = sys::openat(
                    bslot.parent.as_fd(),
                    &bslot.name,
                    libc::O_RDONLY | libc::O_DIRECTORY,
                    0,
                )
                .io_ctx("open", &host)?;
                let meta = meta_of(&bst, read_xattrs(fd.as_fd(), &host)?);
                let is_dir = existing
                    .as_ref()
                    .is_some_and(|st| file_type(st) == libc::S_IFDIR);
                self.make_dir(&slot, rel, existing.filter(|_| !is_dir), &meta)?;
                if recursive {
                    for child in sys::read_dir_names(fd.as_fd()).io_ctx("readdir", &host)? {
                        self.copy_from_base(base, &rel.join(&child), true)?;
                    }
                }
            }
            libc::S_IFLNK => {
                let target =
                    sys::readlinkat(bslot.parent.as_fd(), &bslot.name).io_ctx("readlink", &host)?;
                self.make_symlink(
                    &slot,
                    rel,
                    existing,
                    &target,
                    &meta_of(&bst, BTreeMap::new()),
                )?;
            }
            other => {
                self.make_special(
                    &slot,
                    rel,
                    existing,
                    other,
                    bst.st_rdev,
                    &meta_of(&bst, BTreeMap::new()),
                )?;
            }
        }
        Ok(())
    }

    /// Removes `rel` and everything below it, if present.
    pub(crate) fn remove_path(&mut self, rel: &RelPath) -> Result<()> {
        self.apply(
            &FsEntry {
                path: rel.clone(),
                node: FsNode::Whiteout,
            },
            false,
        )
    }

    /// Sets the deferred directory mtimes, deepest first.
    pub(crate) fn finish(mut self) -> Result<ApplyStats> {
        self.dir_times.sort_by(|a, b| b.0.cmp(&a.0));
        for (rel, mtime) in std::mem::take(&mut self.dir_times) {
            if let Some(slot) = self.root.slot(&rel)? {
                sys::lutimensat(slot.parent.as_fd(), &slot.name, mtime)
                    .io_ctx("utimensat", self.root.host_path(&rel))?;
            }
        }
        Ok(self.stats)
    }

    fn stat(&self, slot: &Slot, rel: &RelPath) -> Result<Option<libc::stat>> {
        sys::fstatat_opt(slot.parent.as_fd(), &slot.name).io_ctx("stat", self.root.host_path(rel))
    }

    fn remove(&mut self, slot: &Slot, rel: &RelPath, st: &libc::stat) -> Result<()> {
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

    fn write_file(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<libc::stat>,
        content: Content<'_>,
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        // Rewriting in place keeps the inode (open fds, bind mounts) unless other names share it.
        let in_place = existing
            .as_ref()
            .is_some_and(|st| file_type(st) == libc::S_IFREG && st.st_nlink == 1);
        if !in_place && let Some(st) = existing {
            self.remove(slot, rel, &st)?;
        }
        // No O_TRUNC: ext4 treats truncate-to-zero-then-write as a file replacement and flushes
        // it on close (auto_da_alloc), costing milliseconds per file. Overwrite, then cut to size.
        let flags = if in_place {
            libc::O_WRONLY
        } else {
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL
        };
        let mut file = File::from(
            sys::openat(slot.parent.as_fd(), &slot.name, flags, 0o600).io_ctx("open", &host)?,
        );
        let bytes = match &content {
            Content::Blob(digest) => match self.prefetched.get(*digest) {
                Some(data) => {
                    file.write_all(data).io_ctx("write", &host)?;
                    data.len() as u64
                }
                None => self.blobs.copy_verified(digest, &mut file, &host)?,
            },
            Content::Host(src, size) => {
                sys::copy_file_range_all(src, &file, *size).io_ctx("copy_file_range", &host)?;
                *size
            }
        };
        // Growing needs no truncate, and truncating is the one call here that waits for the
        // journal (ordered data of a committing transaction), so only shrink when needed.
        if existing
            .as_ref()
            .is_some_and(|st| in_place && st.st_size as u64 > bytes)
        {
            file.set_len(bytes).io_ctx("truncate", &host)?;
        }
        set_meta(
            file.as_fd(),
            meta,
            &host,
            existing.as_ref().filter(|_| in_place),
        )?;
        sys::futimens(file.as_fd(), meta.mtime()).io_ctx("futimens", &host)?;
        if let Content::Blob(digest) = content {
            self.written.insert(rel.clone(), *digest);
        }
        self.stats.files_written += 1;
        self.stats.bytes_written += bytes;
        Ok(())
    }

    /// Links `rel` to `link_to` when that path was written with the same content in this
    /// restore; otherwise the caller writes a copy.
    fn try_link(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<&libc::stat>,
        link_to: &RelPath,
        blob: &Digest,
    ) -> Result<bool> {
        if self.written.get(link_to) != Some(blob) {
            return Ok(false);
        }
        let Some(src) = self.root.slot(link_to)? else {
            return Ok(false);
        };
        if let Some(st) = existing {
            self.remove(slot, rel, st)?;
        }
        sys::linkat(
            src.parent.as_fd(),
            &src.name,
            slot.parent.as_fd(),
            &slot.name,
        )
        .io_ctx("link", self.root.host_path(rel))?;
        self.stats.links_made += 1;
        Ok(true)
    }

    /// Creates the directory unless `replace` is `None` and one is there; `replace` holds the
    /// non-directory (or wiped directory) that must go first.
    fn make_dir(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        replace: Option<libc::stat>,
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        if let Some(st) = replace {
            self.remove(slot, rel, &st)?;
        }
        let current = self.stat(slot, rel)?;
        if current.is_none() {
            sys::mkdirat(slot.parent.as_fd(), &slot.name, 0o700).io_ctx("mkdir", &host)?;
        }
        let fd = sys::openat(
            slot.parent.as_fd(),
            &slot.name,
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        )
        .io_ctx("open", &host)?;
        set_meta(fd.as_fd(), meta, &host, current.as_ref())?;
        self.dir_times.push((rel.clone(), meta.mtime()));
        self.stats.dirs_set += 1;
        Ok(())
    }

    fn make_symlink(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<libc::stat>,
        target: &[u8],
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        let same = match &existing {
            Some(st) if file_type(st) == libc::S_IFLNK => {
                sys::readlinkat(slot.parent.as_fd(), &slot.name).io_ctx("readlink", &host)?
                    == target
            }
            _ => false,
        };
        if !same {
            if let Some(st) = existing {
                self.remove(slot, rel, &st)?;
            }
            let target_c = cstr(target).io_ctx("symlink", &host)?;
            sys::symlinkat(&target_c, slot.parent.as_fd(), &slot.name).io_ctx("symlink", &host)?;
            self.stats.files_written += 1;
        }
        sys::lchownat(slot.parent.as_fd(), &slot.name, meta.uid, meta.gid)
            .io_ctx("lchown", &host)?;
        sys::lutimensat(slot.parent.as_fd(), &slot.name, meta.mtime()).io_ctx("utimensat", &host)
    }

    fn make_special(
        &mut self,
        slot: &Slot,
        rel: &RelPath,
        existing: Option<libc::stat>,
        kind: u32,
        rdev: u64,
        meta: &Meta,
    ) -> Result<()> {
        let host = self.root.host_path(rel);
        if let Some(st) = existing {
            self.remove(slot, rel, &st)?;
        }
        sys::mknodat(slot.parent.as_fd(), &slot.name, kind | 0o600, rdev).io_ctx("mknod", &host)?;
        sys::lchownat(slot.parent.as_fd(), &slot.name, meta.uid, meta.gid)
            .io_ctx("lchown", &host)?;
        // chown clears setuid/setgid, so the mode goes on after it.
        sys::fchmodat(slot.parent.as_fd(), &slot.name, meta.mode).io_ctx("chmod", &host)?;
        sys::lutimensat(slot.parent.as_fd(), &slot.name, meta.mtime())
            .io_ctx("utimensat", &host)?;
        self.stats.files_written += 1;
        Ok(())
    }
}

/// Owner, mode and xattrs of an open file or directory (mtime is the caller's, set last).
/// `current` is the node's stat when it existed before: every inode update waits for the
/// journal on a busy ext4, so what already matches is left alone.
fn set_meta(
    fd: BorrowedFd<'_>,
    meta: &Meta,
    host: &Path,
    current: Option<&libc::stat>,
) -> Result<()> {
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
        match std::str::from_utf8(&name)
            .ok()
            .and_then(|n| meta.xattrs.get(n))
        {
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
    let dir =
        sys::openat(parent, name, libc::O_RDONLY | libc::O_DIRECTORY, 0).io_ctx("open", host)?;
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
