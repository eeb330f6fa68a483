//! The sandbox's mounts, as its OCI spec declares them, and the container's own mounts reached
//! from the host.
//!
//! A container path is on the mount with the longest destination that is a prefix of it (the
//! rootfs when none is). What that means for a checkpoint:
//! - the rootfs and every tmpfs the spec mounts (`/dev`, `/dev/shm`, `/run`, ...) are the
//!   sandbox's state: checkpointed and restored exactly. A tmpfs is not on the host rootfs, so
//!   it is read and written through the container's own mount ([`ContainerRoot`]), never
//!   through the bundle's rootfs directory (where the path does not exist, or is the image's
//!   file hidden under the tmpfs);
//! - crab's own binds (crab-init's directory and binary) and kernel file systems (proc, sysfs,
//!   cgroup, devpts) are not state a turn can change;
//! - every other mount (a bind mount, mqueue, an overlay crab did not set up) is external:
//!   a change there is reported in the turn record, not checkpointed, and never restored.

use rustix::fs::OFlags;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, IoContext, Result};
use super::fsdelta::Root;
use super::path::RelPath;
use super::sys;

/// What a mount of the spec is to the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountKind {
    /// A tmpfs: the sandbox's state, empty when the container starts.
    Tmpfs,
    /// One of crab's own binds (crab-init): not the sandbox's state.
    Crab,
    /// proc, sysfs, cgroup, devpts: the kernel's, not files a turn writes.
    Kernel,
    /// Anything else (bind mounts, mqueue, ...): state crab does not own.
    External,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecMount {
    pub destination: RelPath,
    pub kind: MountKind,
    /// The spec's `type` (or `bind` for a bind mount given only by its options).
    pub fs_type: String,
    /// Mounted read-only (`ro` in its options): nothing in the sandbox can change it.
    pub read_only: bool,
}

/// The mounts of a sandbox's spec, in spec order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxMounts {
    mounts: Vec<SpecMount>,
}

impl SandboxMounts {
    /// Reads the `mounts` of an OCI spec (config.json). A mount whose destination cannot be a
    /// container path is an error: guessing would misplace state.
    pub fn from_spec(bytes: &[u8]) -> std::result::Result<Self, String> {
        #[derive(serde::Deserialize)]
        struct Spec {
            #[serde(default)]
            mounts: Vec<Mount>,
        }
        #[derive(serde::Deserialize)]
        struct Mount {
            destination: String,
            #[serde(default, rename = "type")]
            fs_type: Option<String>,
            #[serde(default)]
            options: Vec<String>,
        }
        let spec: Spec = serde_json::from_slice(bytes).map_err(|e| format!("OCI spec: {e}"))?;
        let mut mounts = Vec::new();
        for m in spec.mounts {
            let destination = RelPath::parse(m.destination.as_bytes())
                .map_err(|e| format!("mount destination {:?}: {e}", m.destination))?;
            let bind = m.options.iter().any(|o| o == "bind" || o == "rbind");
            let fs_type = match m.fs_type.as_deref() {
                Some(t) if !t.is_empty() && !bind => t.to_string(),
                _ if bind => "bind".to_string(),
                Some(t) => t.to_string(),
                None => String::new(),
            };
            let crab_own = [crab_init::MOUNT_DIR, crab_init::INIT_PATH]
                .iter()
                .any(|own| RelPath::parse(own.as_bytes()).is_ok_and(|own| own == destination));
            let kind = if crab_own {
                MountKind::Crab
            } else {
                match fs_type.as_str() {
                    "tmpfs" => MountKind::Tmpfs,
                    "proc" | "sysfs" | "cgroup" | "cgroup2" | "devpts" => MountKind::Kernel,
                    _ => MountKind::External,
                }
            };
            let read_only = m.options.iter().any(|o| o == "ro");
            mounts.push(SpecMount { destination, kind, fs_type, read_only });
        }
        Ok(Self { mounts })
    }

    /// The mounts of the spec at `path` (a bundle's config.json, or the spec the shim saved).
    pub fn from_spec_file(path: &Path) -> std::result::Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_spec(&bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The mount `path` (an absolute container path) is on: the longest destination that is
    /// `path` or one of its ancestors, the later one when two are equal (it hides the first).
    /// None: the rootfs.
    pub fn mount_of(&self, path: &[u8]) -> Option<&SpecMount> {
        let rel = RelPath::parse(path).ok()?;
        self.mount_of_rel(&rel)
    }

    pub fn mount_of_rel(&self, rel: &RelPath) -> Option<&SpecMount> {
        self.mounts
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.destination.is_root() && (m.destination == *rel || m.destination.is_ancestor_of(rel)))
            .max_by_key(|(order, m)| (m.destination.as_bytes().len(), *order))
            .map(|(_, m)| m)
    }

    /// Destinations of the tmpfs mounts that are still visible as tmpfs (not covered by a
    /// later mount at the same place).
    pub fn tmpfs(&self) -> Vec<RelPath> {
        let mut out: Vec<RelPath> = self
            .mounts
            .iter()
            .filter(|m| m.kind == MountKind::Tmpfs)
            .filter(|m| self.mount_of_rel(&m.destination).is_some_and(|top| top.kind == MountKind::Tmpfs))
            .map(|m| m.destination.clone())
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The mounts, in spec order.
    pub fn mounts(&self) -> &[SpecMount] {
        &self.mounts
    }

    /// Every destination (what the bundle's rootfs directory does not hold at run time).
    pub fn destinations(&self) -> Vec<RelPath> {
        self.mounts.iter().map(|m| m.destination.clone()).filter(|d| !d.is_root()).collect()
    }
}

/// `path` re-rooted at `mount` (a strict or equal descendant of it), as an absolute path.
pub(crate) fn below(mount: &RelPath, path: &RelPath) -> Vec<u8> {
    let rest = &path.as_bytes()[mount.as_bytes().len()..];
    let mut out = Vec::with_capacity(rest.len() + 1);
    out.push(b'/');
    out.extend_from_slice(rest.strip_prefix(b"/").unwrap_or(rest));
    out
}

/// `rel` (relative to `mount`) as a path of the container root.
pub(crate) fn above(mount: &RelPath, rel: &RelPath) -> Result<RelPath> {
    let mut raw = Vec::with_capacity(mount.as_bytes().len() + rel.as_bytes().len() + 2);
    raw.push(b'/');
    raw.extend_from_slice(mount.as_bytes());
    raw.push(b'/');
    raw.extend_from_slice(rel.as_bytes());
    RelPath::parse(raw)
}

/// The root of a running container, reached through its init's `/proc/<pid>/root`. The init
/// is held by a pidfd taken while it was known to be the container's: every open checks that
/// it still lives, so a recycled pid can never lead into another process's root.
pub struct ContainerRoot {
    pid: u32,
    pidfd: OwnedFd,
}

impl ContainerRoot {
    /// `pid` must be the container's init now (the caller just learned it from the runtime).
    pub fn new(pid: u32) -> std::io::Result<Self> {
        Ok(Self { pid, pidfd: crab_sys::pidfd_open(pid)? })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn alive(&self) -> bool {
        // SAFETY: signal 0 only checks that the process behind the pidfd exists.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                0 as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0 as libc::c_uint,
            )
        };
        ret == 0
    }

    /// The container's root directory, opened while the init lives.
    fn open_root(&self) -> Result<OwnedFd> {
        let proc_root = PathBuf::from(format!("/proc/{}/root", self.pid));
        // The magic link itself is followed (that is how the container's root is reached);
        // nothing below it is.
        let root = sys::open_dir_path(&proc_root).io_ctx("open the container root", &proc_root)?;
        // Opened while the process behind the pidfd lives: /proc/<pid> was that process, since
        // a pid is only reused after its process is gone.
        if !self.alive() {
            return Err(CheckpointError::Io {
                op: "open the container root",
                path: proc_root,
                source: std::io::Error::other(format!(
                    "pid {} is no longer the container's init (it exited)",
                    self.pid
                )),
            });
        }
        Ok(root)
    }

    /// `path` in the container, opened once beneath the container's root without following
    /// any symlink (the last component included), magic link or `..` out of it.
    fn open_beneath(&self, path: &RelPath, flags: OFlags, op: &'static str) -> Result<OwnedFd> {
        let root = self.open_root()?;
        if path.is_root() {
            return Ok(root);
        }
        let shown = PathBuf::from(format!("/proc/{}/root{path}", self.pid));
        let rel = sys::cstr(path.as_bytes()).io_ctx(op, &shown)?;
        match sys::openat_beneath(root.as_fd(), &rel, flags) {
            Ok(fd) => Ok(fd),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::EXDEV)) => {
                Err(CheckpointError::OutsideRoot {
                    path: path.to_string(),
                    reason: format!("it is reached through a symlink or leaves /proc/{}/root", self.pid),
                })
            }
            Err(e) => Err(e).io_ctx(op, &shown),
        }
    }

    /// The mount at `destination` in the container, opened once beneath the container's root
    /// without following any symlink, magic link or `..` out of it.
    pub fn open_mount(&self, destination: &RelPath) -> Result<ContainerMount> {
        let shown = PathBuf::from(format!("/proc/{}/root{destination}", self.pid));
        let fd = self.open_beneath(destination, OFlags::PATH | OFlags::DIRECTORY, "open mount")?;
        Ok(ContainerMount { destination: destination.clone(), root: Root::from_fd(fd, shown) })
    }

    /// An `O_PATH` handle on `path` in the container (the entry itself: a symlink there is
    /// refused, a socket or device is not opened). What it is must be checked on the handle.
    pub fn open_path(&self, path: &RelPath) -> Result<OwnedFd> {
        self.open_beneath(path, OFlags::PATH, "open")
    }
}

/// A mount of a running container, open for captures and restores of the paths below it.
pub struct ContainerMount {
    pub(crate) destination: RelPath,
    pub(crate) root: Root,
}

impl ContainerMount {
    pub fn destination(&self) -> &RelPath {
        &self.destination
    }

    /// Every path on this mount (below its root), as absolute container paths: what an
    /// escalated turn captures when the inspector could not name the changes.
    pub fn all_paths(&self, limit: usize) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        self.walk(&mut |_| false, &mut |entry| {
            if entry.path().len() == self.destination.as_bytes().len() + 1 {
                return Ok(()); // the mount's own root
            }
            out.push(entry.path().to_vec());
            if out.len() > limit {
                return Err(CheckpointError::InvalidRequest(format!(
                    "mount {} holds more than {limit} paths",
                    self.destination
                )));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Visits the mount's root and every entry below it, parents before children and
    /// siblings in name order, crossing into the mounts below it (the container's own mount
    /// tree, as its processes see it). Each entry is opened once as itself (`O_PATH`, no
    /// symlink followed, no device, fifo or socket opened) and everything `visit` learns is
    /// read through that handle, so a container that swaps names meanwhile cannot redirect
    /// the walk; an entry that vanished between the listing and the open is skipped.
    /// `prune` gets each absolute container path before it is opened: true leaves it (and
    /// everything below it) out.
    pub fn walk(
        &self,
        prune: &mut dyn FnMut(&[u8]) -> bool,
        visit: &mut dyn FnMut(&WalkEntry<'_>) -> Result<()>,
    ) -> Result<()> {
        let start = sys::openat_beneath(self.root.fd(), c".", OFlags::PATH | OFlags::DIRECTORY)
            .io_ctx("open", self.root.path())?;
        let mut path = b"/".to_vec();
        path.extend_from_slice(self.destination.as_bytes());
        self.walk_entry(start, path, 0, prune, visit)
    }

    fn walk_entry(
        &self,
        entry: OwnedFd,
        path: Vec<u8>,
        depth: usize,
        prune: &mut dyn FnMut(&[u8]) -> bool,
        visit: &mut dyn FnMut(&WalkEntry<'_>) -> Result<()>,
    ) -> Result<()> {
        let shown = || self.root.path().join(String::from_utf8_lossy(&path).trim_start_matches('/'));
        let stat = sys::fstat(entry.as_fd()).io_ctx("stat", shown())?;
        // Directories are reopened for reading (names, xattrs), regular files only when
        // `visit` asks for their content or xattrs; nothing else ever is.
        let opened = match sys::file_type(&stat) {
            libc::S_IFDIR => {
                Some(sys::reopen(entry.as_fd(), OFlags::RDONLY | OFlags::DIRECTORY).io_ctx("open", shown())?)
            }
            _ => None,
        };
        let walked = WalkEntry {
            path: &path,
            shown: shown(),
            handle: entry.as_fd(),
            opened_dir: opened.as_ref(),
            opened_file: std::cell::OnceCell::new(),
            stat,
        };
        visit(&walked)?;
        let is_dir = walked.file_type() == libc::S_IFDIR;
        drop(walked);
        let Some(dir) = opened.filter(|_| is_dir) else { return Ok(()) };
        if depth >= MAX_WALK_DEPTH {
            // Each level holds a descriptor and a stack frame: a container cannot make us run out.
            return Err(CheckpointError::InvalidRequest(format!(
                "{} is more than {MAX_WALK_DEPTH} directories deep",
                String::from_utf8_lossy(&path)
            )));
        }
        for name in sys::read_dir_names(dir.as_fd()).io_ctx("readdir", shown())? {
            let mut child = path.clone();
            if child.len() > 1 {
                child.push(b'/');
            }
            child.extend_from_slice(&name);
            if prune(&child) {
                continue;
            }
            let name_c = sys::cstr(&name).io_ctx("readdir", shown())?;
            if let Some(fd) = sys::open_entry_opt(dir.as_fd(), &name_c).io_ctx("open", shown())? {
                self.walk_entry(fd, child, depth + 1, prune, visit)?;
            }
        }
        Ok(())
    }
}

/// Every path of a container's rootfs diff (the overlay upper directory of the root of
/// `pid`), as absolute container paths; a whiteout is listed too (it is a path that is gone).
/// The directory is a host path, but the container writes below it: it is walked as a mount
/// is ([`ContainerMount::walk`]: through descriptors, never following a link).
pub fn rootfs_diff_paths(pid: u32, limit: usize) -> Result<Vec<Vec<u8>>> {
    let upper = crate::baseline::overlay_upperdir(pid)?;
    let fd = sys::open_dir_path(&upper).io_ctx("open the rootfs diff", &upper)?;
    ContainerMount { destination: RelPath::root(), root: Root::from_fd(fd, upper) }.all_paths(limit)
}

/// How deep [`ContainerMount::walk`] goes before it gives up with an error.
const MAX_WALK_DEPTH: usize = 512;

/// One entry met by [`ContainerMount::walk`], read only through the handle the walk opened.
pub struct WalkEntry<'a> {
    path: &'a [u8],
    shown: PathBuf,
    handle: std::os::fd::BorrowedFd<'a>,
    /// A directory, reopened for reading.
    opened_dir: Option<&'a OwnedFd>,
    /// A regular file, reopened for reading the first time its content or xattrs are asked
    /// for: a walk that needs neither (a listing, a fingerprint of unchanged files) opens
    /// each file once, as a handle.
    opened_file: std::cell::OnceCell<OwnedFd>,
    stat: sys::Stat,
}

impl WalkEntry<'_> {
    /// The absolute path in the container.
    pub fn path(&self) -> &[u8] {
        self.path
    }

    /// `S_IFREG`, `S_IFDIR`, `S_IFLNK`, ...
    pub fn file_type(&self) -> u32 {
        sys::file_type(&self.stat)
    }

    /// Permission bits with setuid, setgid and sticky.
    pub fn mode(&self) -> u32 {
        self.stat.st_mode & 0o7777
    }

    pub fn owner(&self) -> (u32, u32) {
        (self.stat.st_uid, self.stat.st_gid)
    }

    pub fn size(&self) -> u64 {
        self.stat.st_size.max(0) as u64
    }

    pub fn links(&self) -> u64 {
        self.stat.st_nlink
    }

    /// The inode's identity (device, inode number): equal for the names of one hard-linked file.
    pub fn inode(&self) -> (u64, u64) {
        (self.stat.st_dev, self.stat.st_ino)
    }

    /// The device number of a device node.
    pub fn rdev(&self) -> u64 {
        self.stat.st_rdev
    }

    /// Last change of the inode, in nanoseconds: no system call a container makes sets it back.
    pub fn changed_ns(&self) -> i128 {
        self.stat.st_ctime as i128 * 1_000_000_000 + self.stat.st_ctime_nsec as i128
    }

    /// Last modification of the content, in nanoseconds.
    pub fn modified_ns(&self) -> i128 {
        self.stat.st_mtime as i128 * 1_000_000_000 + self.stat.st_mtime_nsec as i128
    }

    /// A symlink's target, as stored.
    pub fn link_target(&self) -> Result<Option<Vec<u8>>> {
        if self.file_type() != libc::S_IFLNK {
            return Ok(None);
        }
        sys::readlink_entry(self.handle).io_ctx("readlink", &self.shown).map(Some)
    }

    /// A regular file or directory open for reading; `None` for any other entry.
    fn opened(&self) -> Result<Option<std::os::fd::BorrowedFd<'_>>> {
        match self.file_type() {
            libc::S_IFDIR => Ok(self.opened_dir.map(|fd| fd.as_fd())),
            libc::S_IFREG => {
                if let Some(fd) = self.opened_file.get() {
                    return Ok(Some(fd.as_fd()));
                }
                // The handle is the inode the walk checked: reopening it reaches nothing else.
                let fd = sys::reopen(self.handle, OFlags::RDONLY).io_ctx("open", &self.shown)?;
                Ok(Some(self.opened_file.get_or_init(|| fd).as_fd()))
            }
            _ => Ok(None),
        }
    }

    /// Extended attributes of a regular file or directory (what a checkpoint records).
    pub fn xattrs(&self) -> Result<std::collections::BTreeMap<String, super::path::Bytes>> {
        match self.opened()? {
            Some(fd) => super::fsdelta::read_xattrs(fd, &self.shown),
            None => Ok(Default::default()),
        }
    }

    /// A regular file's content, open for reading.
    pub fn file(&self) -> Result<Option<std::fs::File>> {
        if self.file_type() != libc::S_IFREG {
            return Ok(None);
        }
        match self.opened()? {
            Some(fd) => Ok(Some(std::fs::File::from(fd.try_clone_to_owned().io_ctx("dup", &self.shown)?))),
            None => Ok(None),
        }
    }

    /// When a file's or directory's inode last changed as far as the kernel tells (device,
    /// inode, size, modification and change time): equal keys mean the same content, xattrs and
    /// holes (no system call a container makes sets a change time back).
    pub fn content_key(&self) -> (u64, u64, u64, i128, i128) {
        let (dev, ino) = self.inode();
        (dev, ino, self.size(), self.modified_ns(), self.changed_ns())
    }

    /// Whether the file has fewer blocks allocated than its size: it may have holes, and
    /// [`data_ranges`](Self::data_ranges) reads them.
    fn may_have_holes(&self) -> bool {
        self.file_type() == libc::S_IFREG && (self.stat.st_blocks.max(0) as u64).saturating_mul(512) < self.size()
    }

    /// For a regular file with fewer blocks allocated than its size (it may have holes), its
    /// data ranges `(offset, length)` (`SEEK_DATA`/`SEEK_HOLE`, closest ranges merged past
    /// 4096 of them); `None` for any other entry.
    pub fn data_ranges(&self) -> Result<Option<Vec<(u64, u64)>>> {
        if !self.may_have_holes() {
            return Ok(None);
        }
        let Some(file) = self.file()? else { return Ok(None) };
        let extents = super::fsdelta::data_extents(&file, self.size()).io_ctx("seek", &self.shown)?;
        Ok(Some(extents.iter().map(|e| (e.0, e.1)).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = r#"{"mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs"},
        {"destination": "/run", "type": "tmpfs", "source": "tmpfs"},
        {"destination": "/data/shared/", "type": "bind", "source": "/srv/x", "options": ["rbind"]},
        {"destination": "/etc/hosts", "source": "/etc/hosts", "options": ["bind", "ro"]},
        {"destination": "/dev/.crab", "type": "tmpfs", "source": "tmpfs", "options": ["size=64k"]},
        {"destination": "/dev/.crab/init", "type": "bind", "source": "/pins/x", "options": ["bind", "ro"]}
    ]}"#;

    fn kind(mounts: &SandboxMounts, path: &str) -> Option<(MountKind, String)> {
        mounts.mount_of(path.as_bytes()).map(|m| (m.kind, m.destination.to_string()))
    }

    #[test]
    fn the_longest_destination_prefix_names_the_mount() {
        let m = SandboxMounts::from_spec(SPEC.as_bytes()).unwrap();
        assert_eq!(kind(&m, "/dev/shm/x"), Some((MountKind::Tmpfs, "/dev/shm".into())));
        assert_eq!(kind(&m, "/dev/shm"), Some((MountKind::Tmpfs, "/dev/shm".into())));
        assert_eq!(kind(&m, "/dev/shmx"), Some((MountKind::Tmpfs, "/dev".into())), "a prefix of bytes is not a parent");
        assert_eq!(kind(&m, "/dev/foo"), Some((MountKind::Tmpfs, "/dev".into())));
        assert_eq!(kind(&m, "/dev/pts/0"), Some((MountKind::Kernel, "/dev/pts".into())));
        assert_eq!(kind(&m, "/dev/mqueue/q"), Some((MountKind::External, "/dev/mqueue".into())));
        assert_eq!(kind(&m, "/run/a/b"), Some((MountKind::Tmpfs, "/run".into())));
        assert_eq!(kind(&m, "/data/shared/f"), Some((MountKind::External, "/data/shared".into())));
        assert_eq!(
            kind(&m, "/etc/hosts"),
            Some((MountKind::External, "/etc/hosts".into())),
            "a bind given by its options"
        );
        assert_eq!(kind(&m, "/dev/.crab/sock"), Some((MountKind::Crab, "/dev/.crab".into())));
        assert_eq!(kind(&m, "/dev/.crab/init"), Some((MountKind::Crab, "/dev/.crab/init".into())));
        assert_eq!(kind(&m, "/data/own"), None, "the rootfs");
        assert_eq!(kind(&m, "/runner"), None);
        assert_eq!(
            m.tmpfs(),
            vec![RelPath::parse("/dev").unwrap(), RelPath::parse("/dev/shm").unwrap(), RelPath::parse("/run").unwrap()]
        );
    }

    #[test]
    fn a_later_mount_on_the_same_destination_hides_the_earlier() {
        let spec = r#"{"mounts": [{"destination": "/run", "type": "tmpfs"}, {"destination": "/run", "type": "bind", "source": "/x", "options": ["rbind"]}]}"#;
        let m = SandboxMounts::from_spec(spec.as_bytes()).unwrap();
        assert_eq!(kind(&m, "/run/f"), Some((MountKind::External, "/run".into())));
        assert!(m.tmpfs().is_empty());
    }

    #[test]
    fn a_destination_that_escapes_is_refused() {
        let spec = r#"{"mounts": [{"destination": "/../etc", "type": "tmpfs"}]}"#;
        assert!(SandboxMounts::from_spec(spec.as_bytes()).unwrap_err().contains("/../etc"));
    }

    #[test]
    fn paths_move_between_the_container_root_and_a_mount() {
        let shm = RelPath::parse("/dev/shm").unwrap();
        assert_eq!(below(&shm, &RelPath::parse("/dev/shm/a/b").unwrap()), b"/a/b");
        assert_eq!(below(&shm, &shm), b"/");
        assert_eq!(above(&shm, &RelPath::parse("/a/b").unwrap()).unwrap(), RelPath::parse("/dev/shm/a/b").unwrap());
        assert_eq!(above(&shm, &RelPath::root()).unwrap(), shm);
    }
}
