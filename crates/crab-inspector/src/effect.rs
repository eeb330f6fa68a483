//! What a watched container did to the OS, as decoded from the BPF records.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// A path an effect touched, absolute inside the container's root.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct EffectPath {
    /// Absolute path as seen by the process (its root is the container's root).
    /// When `resolved` is false this is the best guess: possibly relative or cut short.
    #[serde(with = "crate::wire_path")]
    pub path: PathBuf,
    /// False when the kernel could not walk the directory the path is relative
    /// to, or the string was cut short or unreadable. Such effects must escalate.
    pub resolved: bool,
    /// File system type of the mount the path is on (`overlay`, `tmpfs`, ...),
    /// from the container's mount table when it was known.
    pub fs_type: Option<String>,
}

impl EffectPath {
    pub fn resolved(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into(), resolved: true, fs_type: None }
    }
}

impl fmt::Display for EffectPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if !self.resolved {
            write!(f, " (unresolved)")?;
        }
        Ok(())
    }
}

/// A socket address from bind/listen/connect.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum SockAddr {
    Inet(SocketAddr),
    /// A named AF_UNIX socket (a file).
    Unix(EffectPath),
    /// An abstract AF_UNIX name (no file).
    UnixAbstract(String),
    /// An address the kernel side did not capture (e.g. listen on an AF_UNIX socket).
    Other {
        family: u16,
    },
}

impl SockAddr {
    /// True for addresses that leave this machine's loopback.
    pub fn is_external(&self) -> bool {
        match self {
            SockAddr::Inet(addr) => !is_local_ip(addr.ip()),
            _ => false,
        }
    }
}

fn is_local_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_unspecified(),
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback() || v4.is_unspecified())
        }
    }
}

impl fmt::Display for SockAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SockAddr::Inet(addr) => write!(f, "{addr}"),
            SockAddr::Unix(path) => write!(f, "unix:{path}"),
            SockAddr::UnixAbstract(name) => write!(f, "unix:@{name}"),
            SockAddr::Other { family } => write!(f, "family {family}"),
        }
    }
}

/// How a process changed a file it already had open (mirrors `enum write_via`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteVia {
    /// write, pwrite64, writev, pwritev, pwritev2.
    Write,
    Fallocate,
    Sendfile,
    Splice,
    CopyFileRange,
    /// A `MAP_SHARED` mapping of a file open for writing: later stores change
    /// the file without any syscall.
    SharedMapping,
    Msync,
    /// A shared mapping from an earlier turn whose process ran in this one:
    /// it may have stored through it (added by the reader, not the kernel).
    EarlierSharedMapping,
}

impl WriteVia {
    pub(crate) fn from_raw(raw: u64) -> Option<Self> {
        Some(match raw {
            1 => WriteVia::Write,
            2 => WriteVia::Fallocate,
            3 => WriteVia::Sendfile,
            4 => WriteVia::Splice,
            5 => WriteVia::CopyFileRange,
            6 => WriteVia::SharedMapping,
            7 => WriteVia::Msync,
            _ => return None,
        })
    }

    /// Short name of the operation, for logs and reasons.
    pub fn name(self) -> &'static str {
        match self {
            WriteVia::Write => "write",
            WriteVia::Fallocate => "fallocate",
            WriteVia::Sendfile => "sendfile",
            WriteVia::Splice => "splice",
            WriteVia::CopyFileRange => "copy_file_range",
            WriteVia::SharedMapping => "shared mmap",
            WriteVia::Msync => "msync",
            WriteVia::EarlierSharedMapping => "shared mmap of an earlier turn",
        }
    }

    /// True for a mapping, which stays writable after the call.
    pub fn is_mapping(self) -> bool {
        matches!(self, WriteVia::SharedMapping | WriteVia::EarlierSharedMapping)
    }
}

/// A call that hands I/O to the kernel to do later, where the inspector cannot
/// see it (mirrors `enum async_io_call`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AsyncIoCall {
    IoUringSetup,
    IoUringEnter,
    IoUringRegister,
    /// Linux AIO.
    IoSubmit,
    /// A submission-polling io_uring ring set up in an earlier turn whose
    /// process ran in this one: it can submit I/O with no syscall at all
    /// (added by the reader, not the kernel).
    EarlierPollingRing,
}

impl AsyncIoCall {
    pub(crate) fn from_raw(raw: u64) -> Option<Self> {
        Some(match raw {
            1 => AsyncIoCall::IoUringSetup,
            2 => AsyncIoCall::IoUringEnter,
            3 => AsyncIoCall::IoUringRegister,
            4 => AsyncIoCall::IoSubmit,
            _ => return None,
        })
    }

    /// The value the kernel keys its dedup entries with (`enum async_io_call`).
    pub(crate) fn raw(self) -> u64 {
        match self {
            AsyncIoCall::IoUringSetup => 1,
            AsyncIoCall::IoUringEnter => 2,
            AsyncIoCall::IoUringRegister => 3,
            AsyncIoCall::IoSubmit => 4,
            AsyncIoCall::EarlierPollingRing => 0,
        }
    }

    /// The syscall, for logs and reasons.
    pub fn name(self) -> &'static str {
        match self {
            AsyncIoCall::IoUringSetup => "io_uring_setup",
            AsyncIoCall::IoUringEnter => "io_uring_enter",
            AsyncIoCall::IoUringRegister => "io_uring_register",
            AsyncIoCall::IoSubmit => "io_submit",
            AsyncIoCall::EarlierPollingRing => "io_uring (polling ring of an earlier turn)",
        }
    }
}

/// A pid as the innermost pid namespace of its process numbers it.
///
/// A pid namespace hands out the pid after the last one it handed out, so the newest fork's
/// number in a container's namespace is that namespace's cursor: CRIU restores every pid but
/// not the cursor, and a restore sets it from these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct NamespacePid {
    pub pid: u32,
    /// How deep the namespace is (the host's is 0, a container's usually 1): a namespace
    /// nested inside the container numbers its processes apart.
    pub depth: u32,
}

/// One thing a process in a watched container did.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Effect {
    /// CLOCK_MONOTONIC nanoseconds when the syscall returned (see [`super::monotonic_now_ns`]).
    pub time_ns: u64,
    /// Process (thread group) id, in the host pid namespace.
    pub pid: u32,
    /// Thread id, in the host pid namespace.
    pub tid: u32,
    pub comm: String,
    /// The syscall's return value (always a success: failed calls are not effects).
    pub result: i64,
    pub kind: EffectKind,
}

#[cfg(test)]
impl Effect {
    /// An effect of `sh` with pid `pid` (its own thread) at time 0, for unit tests.
    pub(crate) fn of_shell(pid: u32, kind: EffectKind) -> Self {
        Self { time_ns: 0, pid, tid: pid, comm: "sh".into(), result: 0, kind }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectKind {
    /// open/openat/openat2/creat with a write, create or truncate flag.
    Open {
        path: EffectPath,
        flags: u64,
        mode: u32,
    },
    Truncate {
        path: EffectPath,
    },
    Unlink {
        path: EffectPath,
    },
    Rmdir {
        path: EffectPath,
    },
    Rename {
        from: EffectPath,
        to: EffectPath,
        flags: u64,
    },
    Mkdir {
        path: EffectPath,
        mode: u32,
    },
    /// A hard link `path` to `existing`.
    Link {
        path: EffectPath,
        existing: EffectPath,
    },
    /// A symlink at `path` whose content is `target` (kept verbatim).
    Symlink {
        path: EffectPath,
        #[serde(with = "crate::wire_path")]
        target: PathBuf,
    },
    Chmod {
        path: EffectPath,
        mode: u32,
    },
    /// `None` means "left unchanged" (-1 in the call).
    Chown {
        path: EffectPath,
        uid: Option<u32>,
        gid: Option<u32>,
    },
    SetXattr {
        path: EffectPath,
        name: String,
    },
    RemoveXattr {
        path: EffectPath,
        name: String,
    },
    Mknod {
        path: EffectPath,
        mode: u32,
        dev: u64,
    },
    Utimes {
        path: EffectPath,
    },
    /// Data written to a regular file through a descriptor the process already
    /// had (possibly from an earlier turn), or a shared mapping of it. The
    /// kernel reports the first such write per process and file in a turn.
    Write {
        path: EffectPath,
        via: WriteVia,
        /// Identity of the file while it is open (its inode's kernel address).
        inode_key: u64,
        /// The file's inode number.
        ino: u64,
    },
    /// io_uring or Linux AIO: the process had the kernel do I/O the
    /// inspector cannot see (files written, renamed, removed: any of them).
    AsyncIo {
        call: AsyncIoCall,
        /// The ring polls its submission queue (`IORING_SETUP_SQPOLL`): the
        /// process can submit later with no syscall.
        polling_ring: bool,
    },
    Bind {
        addr: SockAddr,
    },
    Listen {
        addr: SockAddr,
        backlog: i32,
    },
    Connect {
        addr: SockAddr,
    },
    Mount {
        target: EffectPath,
        source: String,
        fs_type: String,
        flags: u64,
    },
    Unmount {
        target: EffectPath,
        flags: u64,
    },
    MoveMount {
        to: EffectPath,
        from: EffectPath,
    },
    /// A new process `child` (not a thread) forked by `pid`.
    Fork {
        child: u32,
        /// The child's pid in its own pid namespace (None from an inspector that did not
        /// read it): the newest one is that namespace's cursor (see [`NamespacePid`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        in_namespace: Option<NamespacePid>,
    },
    /// `pid` executed `path` (the resolved executable); `filename` is as passed to execve.
    Exec {
        path: EffectPath,
        filename: String,
    },
    /// `pid` exited; `status` is the wait status (exit code << 8 | signal).
    Exit {
        status: i32,
    },
}

impl EffectKind {
    /// Short name of the operation, for logs and reasons.
    pub fn name(&self) -> &'static str {
        match self {
            EffectKind::Open { .. } => "open",
            EffectKind::Truncate { .. } => "truncate",
            EffectKind::Unlink { .. } => "unlink",
            EffectKind::Rmdir { .. } => "rmdir",
            EffectKind::Rename { .. } => "rename",
            EffectKind::Mkdir { .. } => "mkdir",
            EffectKind::Link { .. } => "link",
            EffectKind::Symlink { .. } => "symlink",
            EffectKind::Chmod { .. } => "chmod",
            EffectKind::Chown { .. } => "chown",
            EffectKind::SetXattr { .. } => "setxattr",
            EffectKind::RemoveXattr { .. } => "removexattr",
            EffectKind::Mknod { .. } => "mknod",
            EffectKind::Utimes { .. } => "utimes",
            EffectKind::Write { via, .. } => via.name(),
            EffectKind::AsyncIo { call, .. } => call.name(),
            EffectKind::Bind { .. } => "bind",
            EffectKind::Listen { .. } => "listen",
            EffectKind::Connect { .. } => "connect",
            EffectKind::Mount { .. } => "mount",
            EffectKind::Unmount { .. } => "umount",
            EffectKind::MoveMount { .. } => "move_mount",
            EffectKind::Fork { .. } => "fork",
            EffectKind::Exec { .. } => "exec",
            EffectKind::Exit { .. } => "exit",
        }
    }

    /// Paths whose content, metadata or existence this effect changed.
    pub fn changed_paths(&self) -> Vec<&EffectPath> {
        match self {
            EffectKind::Open { path, .. }
            | EffectKind::Truncate { path }
            | EffectKind::Unlink { path }
            | EffectKind::Rmdir { path }
            | EffectKind::Mkdir { path, .. }
            | EffectKind::Link { path, .. }
            | EffectKind::Symlink { path, .. }
            | EffectKind::Chmod { path, .. }
            | EffectKind::Chown { path, .. }
            | EffectKind::SetXattr { path, .. }
            | EffectKind::RemoveXattr { path, .. }
            | EffectKind::Mknod { path, .. }
            | EffectKind::Utimes { path }
            | EffectKind::Write { path, .. } => vec![path],
            EffectKind::Rename { from, to, .. } => vec![from, to],
            EffectKind::Bind { addr: SockAddr::Unix(path) } => vec![path],
            _ => Vec::new(),
        }
    }

    /// Every path the effect names, changed or not.
    pub fn paths(&self) -> Vec<&EffectPath> {
        match self {
            EffectKind::Open { path, .. }
            | EffectKind::Truncate { path }
            | EffectKind::Unlink { path }
            | EffectKind::Rmdir { path }
            | EffectKind::Mkdir { path, .. }
            | EffectKind::Symlink { path, .. }
            | EffectKind::Chmod { path, .. }
            | EffectKind::Chown { path, .. }
            | EffectKind::SetXattr { path, .. }
            | EffectKind::RemoveXattr { path, .. }
            | EffectKind::Mknod { path, .. }
            | EffectKind::Utimes { path }
            | EffectKind::Write { path, .. }
            | EffectKind::Exec { path, .. } => vec![path],
            EffectKind::Rename { from, to, .. } => vec![from, to],
            EffectKind::Link { path, existing } => vec![path, existing],
            EffectKind::Bind { addr: SockAddr::Unix(path) } | EffectKind::Connect { addr: SockAddr::Unix(path) } => {
                vec![path]
            }
            EffectKind::Mount { target, .. } | EffectKind::Unmount { target, .. } => vec![target],
            EffectKind::MoveMount { to, from } => vec![to, from],
            _ => Vec::new(),
        }
    }

    /// True when the effect changes the mount table.
    pub fn is_mount_change(&self) -> bool {
        matches!(self, EffectKind::Mount { .. } | EffectKind::Unmount { .. } | EffectKind::MoveMount { .. })
    }
}

impl Effect {
    /// True when some path of this effect could not be resolved.
    pub fn has_unresolved_path(&self) -> bool {
        self.kind.paths().iter().any(|p| !p.resolved)
    }

    /// True when the effect changed something at or under `prefix`.
    pub fn changes_under(&self, prefix: &Path) -> bool {
        self.kind.changed_paths().iter().any(|p| p.path.starts_with(prefix))
    }
}

impl fmt::Display for Effect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} pid {} ({}): ", self.kind.name(), self.pid, self.comm)?;
        match &self.kind {
            EffectKind::Rename { from, to, .. } => write!(f, "{from} -> {to}"),
            EffectKind::Link { path, existing } => write!(f, "{path} => {existing}"),
            EffectKind::Symlink { path, target } => write!(f, "{path} -> {}", target.display()),
            EffectKind::Bind { addr } | EffectKind::Connect { addr } | EffectKind::Listen { addr, .. } => {
                write!(f, "{addr}")
            }
            EffectKind::Mount { target, source, fs_type, .. } => {
                write!(f, "{source} ({fs_type}) on {target}")
            }
            EffectKind::MoveMount { to, from } => write!(f, "{from} -> {to}"),
            EffectKind::Fork { child, in_namespace: None } => write!(f, "child {child}"),
            EffectKind::Fork { child, in_namespace: Some(ns) } => {
                write!(f, "child {child} ({} at depth {})", ns.pid, ns.depth)
            }
            EffectKind::Exec { path, .. } => write!(f, "{path}"),
            EffectKind::Exit { status } => write!(f, "status {status:#x}"),
            other => match other.changed_paths().first() {
                Some(path) => write!(f, "{path}"),
                None => Ok(()),
            },
        }
    }
}
