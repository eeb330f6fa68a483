//! Decoding of the ring buffer records laid out by `bpf/inspector.h`.

use std::ffi::OsStr;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::effect::{AsyncIoCall, Effect, EffectKind, EffectPath, NamespacePid, SockAddr, WriteVia};

// Mirrors `enum record_kind`.
const KIND_OPEN: u32 = 1;
const KIND_TRUNCATE: u32 = 2;
const KIND_UNLINK: u32 = 3;
const KIND_RENAME: u32 = 4;
const KIND_MKDIR: u32 = 5;
const KIND_RMDIR: u32 = 6;
const KIND_LINK: u32 = 7;
const KIND_SYMLINK: u32 = 8;
const KIND_CHMOD: u32 = 9;
const KIND_CHOWN: u32 = 10;
const KIND_SETXATTR: u32 = 11;
const KIND_REMOVEXATTR: u32 = 12;
const KIND_MKNOD: u32 = 13;
const KIND_UTIMES: u32 = 14;
const KIND_WRITE: u32 = 15;
const KIND_ASYNC_IO: u32 = 16;

/// io_uring_setup's flag for a ring whose submission queue a kernel thread polls.
const IORING_SETUP_SQPOLL: u64 = 1 << 1;
const KIND_BIND: u32 = 32;
const KIND_LISTEN: u32 = 33;
const KIND_CONNECT: u32 = 34;
const KIND_MOUNT: u32 = 48;
const KIND_UMOUNT: u32 = 49;
const KIND_MOVE_MOUNT: u32 = 50;
const KIND_FORK: u32 = 64;
const KIND_EXEC: u32 = 65;
const KIND_EXIT: u32 = 66;

// Mirrors the PATH_* flags.
const PATH_PRESENT: u32 = 0x1;
const PATH_VERBATIM: u32 = 0x2;
const PATH_UNRESOLVED: u32 = 0x4;
const PATH_TRUNCATED: u32 = 0x8;
const PATH_FAULT: u32 = 0x10;
const PATH_OUTSIDE_ROOT: u32 = 0x20;
const PATH_ABSTRACT: u32 = 0x40;
const PATH_INCOMPLETE: u32 = PATH_UNRESOLVED | PATH_TRUNCATED | PATH_FAULT | PATH_OUTSIDE_ROOT;

// Offsets in `struct record_header` and `struct path_ref`, checked at compile time against
// the types the BPF skeleton generates from the object's BTF (see `layout.rs`).
pub(crate) const HEADER_LEN: usize = 152;
pub(crate) const OFF_KIND: usize = 0;
pub(crate) const OFF_PID: usize = 8;
pub(crate) const OFF_TID: usize = 12;
pub(crate) const OFF_CGROUP: usize = 16;
pub(crate) const OFF_TS: usize = 24;
pub(crate) const OFF_RET: usize = 32;
pub(crate) const OFF_ARG: usize = 40;
pub(crate) const OFF_COMM: usize = 64;
pub(crate) const OFF_PATH: usize = 80;
pub(crate) const PATH_REF_LEN: usize = 16;
/// In `struct path_ref`: base_off, base_len, user_off, user_len are consecutive u16s, then flags.
pub(crate) const PATH_REF_FLAGS: usize = 8;
pub(crate) const OFF_EXTRA: usize = 112;
pub(crate) const EXTRA_LEN: usize = 32;

const AF_UNIX: u16 = 1;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const AT_REMOVEDIR: u64 = 0x200;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("record of {len} bytes is shorter than its {HEADER_LEN}-byte header")]
    Short { len: usize },
    #[error("record kind {kind} is unknown")]
    UnknownKind { kind: u32 },
    #[error("write record names an unknown way of writing ({via})")]
    UnknownWriteVia { via: u64 },
    #[error("asynchronous I/O record names an unknown call ({call})")]
    UnknownAsyncIoCall { call: u64 },
    #[error("path {index} of a {kind} record points outside the record's data ({start}..{end} of {len})")]
    PathOutOfBounds { kind: u32, index: usize, start: usize, end: usize, len: usize },
}

/// A decoded record: the watched cgroup it belongs to and the effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub cgroup_id: u64,
    pub effect: Effect,
    /// For an open of a regular file for writing: the inode's kernel address,
    /// under which the kernel dedups the writes through the new descriptor.
    pub opened_inode: Option<u64>,
    /// For an exit: no thread of the process is left.
    pub process_gone: bool,
}

/// Tells the file system type of the mount an absolute container path is on.
pub trait FsTypeLookup {
    fn fs_type(&self, path: &Path) -> Option<String>;
}

/// For callers without a mount table.
pub struct NoFsTypes;

impl FsTypeLookup for NoFsTypes {
    fn fs_type(&self, _path: &Path) -> Option<String> {
        None
    }
}

/// Reads the watched cgroup id of a record without decoding the rest.
pub fn record_cgroup(bytes: &[u8]) -> Result<u64, RecordError> {
    if bytes.len() < HEADER_LEN {
        return Err(RecordError::Short { len: bytes.len() });
    }
    Ok(u64_at(bytes, OFF_CGROUP))
}

/// For a record that only says paths changed (no process, socket, mount or
/// write-tracking meaning), its time; None for any other record. Reads the
/// header only: what a reader that no longer keeps file details needs.
pub fn path_only_time(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < HEADER_LEN {
        return None;
    }
    let path_only = match u32_at(bytes, OFF_KIND) {
        // An open the kernel took as the record of later writes through its
        // descriptor feeds the write tracking: decoded.
        KIND_OPEN => u64_at(bytes, OFF_ARG + 16) == 0,
        KIND_TRUNCATE | KIND_UNLINK | KIND_RENAME | KIND_MKDIR | KIND_RMDIR | KIND_LINK | KIND_SYMLINK | KIND_CHMOD
        | KIND_CHOWN | KIND_SETXATTR | KIND_REMOVEXATTR | KIND_MKNOD | KIND_UTIMES => true,
        _ => false,
    };
    path_only.then(|| u64_at(bytes, OFF_TS))
}

pub fn decode(bytes: &[u8], mounts: &dyn FsTypeLookup) -> Result<Record, RecordError> {
    if bytes.len() < HEADER_LEN {
        return Err(RecordError::Short { len: bytes.len() });
    }
    let raw = RawRecord { bytes, data: &bytes[HEADER_LEN..], kind: u32_at(bytes, OFF_KIND), mounts };
    let kind = raw.effect_kind()?;
    let comm = &bytes[OFF_COMM..OFF_COMM + 16];
    let opened_inode = (raw.kind == KIND_OPEN && raw.arg(2) != 0).then(|| raw.arg(2));
    Ok(Record {
        cgroup_id: u64_at(bytes, OFF_CGROUP),
        opened_inode,
        process_gone: raw.kind == KIND_EXIT && raw.arg(1) != 0,
        effect: Effect {
            time_ns: u64_at(bytes, OFF_TS),
            pid: u32_at(bytes, OFF_PID),
            tid: u32_at(bytes, OFF_TID),
            comm: String::from_utf8_lossy(until_nul(comm)).into_owned(),
            result: u64_at(bytes, OFF_RET) as i64,
            kind,
        },
    })
}

struct RawRecord<'a> {
    bytes: &'a [u8],
    data: &'a [u8],
    kind: u32,
    mounts: &'a dyn FsTypeLookup,
}

/// The two halves of a path as captured in the kernel.
struct RawPath<'a> {
    flags: u32,
    /// Components from the leaf up, each NUL-terminated.
    base: &'a [u8],
    /// The string the process passed, without its NUL.
    user: &'a [u8],
}

impl<'a> RawRecord<'a> {
    fn arg(&self, i: usize) -> u64 {
        u64_at(self.bytes, OFF_ARG + 8 * i)
    }

    fn extra(&self) -> &'a [u8] {
        &self.bytes[OFF_EXTRA..OFF_EXTRA + EXTRA_LEN]
    }

    fn extra_string(&self) -> String {
        String::from_utf8_lossy(until_nul(self.extra())).into_owned()
    }

    fn raw_path(&self, index: usize) -> Result<RawPath<'a>, RecordError> {
        let at = OFF_PATH + index * PATH_REF_LEN;
        let field = |i: usize| u16_at(self.bytes, at + 2 * i) as usize;
        let slice = |start: usize, len: usize| {
            self.data.get(start..start + len).ok_or(RecordError::PathOutOfBounds {
                kind: self.kind,
                index,
                start,
                end: start + len,
                len: self.data.len(),
            })
        };
        let base = slice(field(0), field(1))?;
        let user = slice(field(2), field(3))?;
        Ok(RawPath { flags: u32_at(self.bytes, at + PATH_REF_FLAGS), base, user: until_nul(user) })
    }

    /// A path argument joined with the directory it was relative to.
    fn path(&self, index: usize) -> Result<EffectPath, RecordError> {
        let raw = self.raw_path(index)?;
        let (path, resolved) = if raw.flags & PATH_PRESENT == 0 {
            (PathBuf::new(), false)
        } else {
            join_captured(raw.base, raw.user, raw.flags)
        };
        let fs_type = if resolved { self.mounts.fs_type(&path) } else { None };
        Ok(EffectPath { path, resolved, fs_type })
    }

    /// A string kept as the process gave it (symlink target, mount source, execve filename).
    fn verbatim(&self, index: usize) -> Result<PathBuf, RecordError> {
        Ok(PathBuf::from(OsStr::from_bytes(self.raw_path(index)?.user)))
    }

    fn sockaddr(&self) -> Result<SockAddr, RecordError> {
        let extra = self.extra();
        let family = u16::from_ne_bytes([extra[0], extra[1]]);
        let port = u16::from_be_bytes([extra[2], extra[3]]);
        Ok(match family {
            AF_INET => {
                let ip = Ipv4Addr::new(extra[4], extra[5], extra[6], extra[7]);
                SockAddr::Inet(SocketAddr::V4(SocketAddrV4::new(ip, port)))
            }
            AF_INET6 => {
                let octets: [u8; 16] = extra[8..24].try_into().expect("16-byte slice");
                SockAddr::Inet(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(octets), port, 0, 0)))
            }
            AF_UNIX if self.raw_path(0)?.flags & PATH_PRESENT == 0 => SockAddr::Other { family },
            AF_UNIX if self.raw_path(0)?.flags & PATH_ABSTRACT != 0 => {
                SockAddr::UnixAbstract(String::from_utf8_lossy(self.raw_path(0)?.user).into_owned())
            }
            AF_UNIX => SockAddr::Unix(self.path(0)?),
            family => SockAddr::Other { family },
        })
    }

    fn effect_kind(&self) -> Result<EffectKind, RecordError> {
        let mode = self.arg(1) as u32;
        Ok(match self.kind {
            KIND_OPEN => EffectKind::Open { path: self.path(0)?, flags: self.arg(0), mode },
            KIND_TRUNCATE => EffectKind::Truncate { path: self.path(0)? },
            KIND_UNLINK if self.arg(0) & AT_REMOVEDIR != 0 => EffectKind::Rmdir { path: self.path(0)? },
            KIND_UNLINK => EffectKind::Unlink { path: self.path(0)? },
            KIND_RMDIR => EffectKind::Rmdir { path: self.path(0)? },
            KIND_RENAME => EffectKind::Rename { from: self.path(0)?, to: self.path(1)?, flags: self.arg(0) },
            KIND_MKDIR => EffectKind::Mkdir { path: self.path(0)?, mode: self.arg(0) as u32 },
            KIND_LINK => EffectKind::Link { path: self.path(0)?, existing: self.path(1)? },
            KIND_SYMLINK => EffectKind::Symlink { path: self.path(0)?, target: self.verbatim(1)? },
            KIND_CHMOD => EffectKind::Chmod { path: self.path(0)?, mode: self.arg(0) as u32 },
            KIND_CHOWN => EffectKind::Chown { path: self.path(0)?, uid: id_arg(self.arg(0)), gid: id_arg(self.arg(1)) },
            KIND_SETXATTR => EffectKind::SetXattr { path: self.path(0)?, name: self.extra_string() },
            KIND_REMOVEXATTR => EffectKind::RemoveXattr { path: self.path(0)?, name: self.extra_string() },
            KIND_MKNOD => EffectKind::Mknod { path: self.path(0)?, mode: self.arg(0) as u32, dev: self.arg(1) },
            KIND_UTIMES => EffectKind::Utimes { path: self.path(0)? },
            KIND_WRITE => EffectKind::Write {
                path: self.path(0)?,
                via: WriteVia::from_raw(self.arg(0)).ok_or(RecordError::UnknownWriteVia { via: self.arg(0) })?,
                inode_key: self.arg(1),
                ino: self.arg(2),
            },
            KIND_ASYNC_IO => EffectKind::AsyncIo {
                call: AsyncIoCall::from_raw(self.arg(0))
                    .ok_or(RecordError::UnknownAsyncIoCall { call: self.arg(0) })?,
                polling_ring: self.arg(1) & IORING_SETUP_SQPOLL != 0,
            },
            KIND_BIND => EffectKind::Bind { addr: self.sockaddr()? },
            KIND_LISTEN => EffectKind::Listen { addr: self.sockaddr()?, backlog: self.arg(0) as i32 },
            KIND_CONNECT => EffectKind::Connect { addr: self.sockaddr()? },
            KIND_MOUNT => EffectKind::Mount {
                target: self.path(0)?,
                source: self.verbatim(1)?.to_string_lossy().into_owned(),
                fs_type: self.extra_string(),
                flags: self.arg(0),
            },
            KIND_UMOUNT => EffectKind::Unmount { target: self.path(0)?, flags: self.arg(0) },
            KIND_MOVE_MOUNT => EffectKind::MoveMount { to: self.path(0)?, from: self.path(1)? },
            KIND_FORK => EffectKind::Fork {
                child: self.arg(0) as u32,
                // 0 is no process's pid: the program could not read the child's.
                in_namespace: (self.arg(1) != 0)
                    .then(|| NamespacePid { pid: self.arg(1) as u32, depth: self.arg(2) as u32 }),
            },
            KIND_EXEC => {
                EffectKind::Exec { path: self.path(0)?, filename: self.verbatim(1)?.to_string_lossy().into_owned() }
            }
            KIND_EXIT => EffectKind::Exit { status: self.arg(0) as i32 },
            kind => return Err(RecordError::UnknownKind { kind }),
        })
    }
}

/// chown's "leave unchanged" is -1 in a 32-bit id.
fn id_arg(raw: u64) -> Option<u32> {
    let id = raw as u32;
    (id != u32::MAX).then_some(id)
}

/// Joins the kernel-walked base (leaf-first components) and the user string
/// into an absolute path, and says whether it is trustworthy.
fn join_captured(base: &[u8], user: &[u8], flags: u32) -> (PathBuf, bool) {
    let mut resolved = flags & PATH_INCOMPLETE == 0;
    if flags & PATH_VERBATIM != 0 {
        return (PathBuf::from(OsStr::from_bytes(user)), resolved);
    }
    let mut path = PathBuf::from("/");
    if !user.starts_with(b"/") {
        let components: Vec<&[u8]> = base.split(|b| *b == 0).filter(|c| !c.is_empty()).collect();
        for component in components.iter().rev() {
            path.push(OsStr::from_bytes(component));
        }
    }
    path.push(OsStr::from_bytes(user));
    let normalized = normalize(&path);
    if !normalized.is_absolute() {
        resolved = false;
    }
    (normalized, resolved)
}

/// Removes `.` and empty components and applies `..` lexically (never above `/`).
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(name) => out.push(name),
        }
    }
    out
}

fn until_nul(bytes: &[u8]) -> &[u8] {
    match bytes.iter().position(|b| *b == 0) {
        Some(end) => &bytes[..end],
        None => bytes,
    }
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes(bytes[at..at + 2].try_into().expect("2-byte slice"))
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("4-byte slice"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("8-byte slice"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds records the way the BPF side lays them out.
    struct RecordBuilder {
        header: Vec<u8>,
        data: Vec<u8>,
    }

    impl RecordBuilder {
        fn new(kind: u32) -> Self {
            let mut header = vec![0u8; HEADER_LEN];
            header[OFF_KIND..OFF_KIND + 4].copy_from_slice(&kind.to_ne_bytes());
            header[OFF_PID..OFF_PID + 4].copy_from_slice(&42u32.to_ne_bytes());
            header[OFF_TID..OFF_TID + 4].copy_from_slice(&43u32.to_ne_bytes());
            header[OFF_CGROUP..OFF_CGROUP + 8].copy_from_slice(&7u64.to_ne_bytes());
            header[OFF_TS..OFF_TS + 8].copy_from_slice(&1000u64.to_ne_bytes());
            header[OFF_COMM..OFF_COMM + 3].copy_from_slice(b"sh\0");
            Self { header, data: Vec::new() }
        }

        fn arg(mut self, i: usize, value: u64) -> Self {
            self.header[OFF_ARG + 8 * i..OFF_ARG + 8 * i + 8].copy_from_slice(&value.to_ne_bytes());
            self
        }

        /// `base_dirs` is root-first, as a person writes it; stored leaf-first.
        fn path(mut self, index: usize, base_dirs: &[&str], user: &str, flags: u32) -> Self {
            let base_off = self.data.len();
            for dir in base_dirs.iter().rev() {
                self.data.extend_from_slice(dir.as_bytes());
                self.data.push(0);
            }
            let base_len = self.data.len() - base_off;
            let user_off = self.data.len();
            self.data.extend_from_slice(user.as_bytes());
            self.data.push(0);
            let at = OFF_PATH + index * PATH_REF_LEN;
            for (i, value) in [base_off, base_len, user_off, user.len() + 1].into_iter().enumerate() {
                self.header[at + 2 * i..at + 2 * i + 2].copy_from_slice(&(value as u16).to_ne_bytes());
            }
            self.header[at + 8..at + 12].copy_from_slice(&(flags | PATH_PRESENT).to_ne_bytes());
            self
        }

        fn extra(mut self, bytes: &[u8]) -> Self {
            self.header[OFF_EXTRA..OFF_EXTRA + bytes.len()].copy_from_slice(bytes);
            self
        }

        fn bytes(self) -> Vec<u8> {
            let mut out = self.header;
            out.extend_from_slice(&self.data);
            out
        }
    }

    #[test]
    fn only_records_of_changed_paths_may_be_skipped_undecoded() {
        let skippable = RecordBuilder::new(KIND_RENAME).path(0, &[], "/a", 0).path(1, &[], "/b", 0).bytes();
        assert_eq!(path_only_time(&skippable), Some(1000));
        let plain_open = RecordBuilder::new(KIND_OPEN).arg(0, 0o101).path(0, &[], "/f", 0).bytes();
        assert_eq!(path_only_time(&plain_open), Some(1000));
        // An open that starts the write tracking of its descriptor, writes,
        // processes, sockets and mounts are always decoded.
        let tracked_open =
            RecordBuilder::new(KIND_OPEN).arg(0, 0o101).arg(2, 0xffff_8880_0000_1000).path(0, &[], "/f", 0).bytes();
        assert_eq!(path_only_time(&tracked_open), None);
        for kind in [
            KIND_WRITE,
            KIND_ASYNC_IO,
            KIND_FORK,
            KIND_EXEC,
            KIND_EXIT,
            KIND_BIND,
            KIND_LISTEN,
            KIND_CONNECT,
            KIND_MOUNT,
            KIND_UMOUNT,
            KIND_MOVE_MOUNT,
        ] {
            assert_eq!(path_only_time(&RecordBuilder::new(kind).bytes()), None, "kind {kind}");
        }
        assert_eq!(path_only_time(&[0u8; 10]), None);
        // Everything skippable is a file effect, cut with the file details.
        for kind in [
            KIND_TRUNCATE,
            KIND_UNLINK,
            KIND_RENAME,
            KIND_MKDIR,
            KIND_RMDIR,
            KIND_LINK,
            KIND_SYMLINK,
            KIND_CHMOD,
            KIND_CHOWN,
            KIND_SETXATTR,
            KIND_REMOVEXATTR,
            KIND_MKNOD,
            KIND_UTIMES,
            KIND_OPEN,
        ] {
            let bytes = RecordBuilder::new(kind).path(0, &[], "/a", 0).path(1, &[], "/b", 0).bytes();
            assert!(path_only_time(&bytes).is_some(), "kind {kind}");
            assert!(crate::buffer::is_file_effect(&kind_of(&bytes)), "kind {kind}");
        }
    }

    fn kind_of(bytes: &[u8]) -> EffectKind {
        decode(bytes, &NoFsTypes).unwrap().effect.kind
    }

    #[test]
    fn relative_path_joins_walked_base() {
        let bytes = RecordBuilder::new(KIND_OPEN).arg(0, 0o101).path(0, &["tmp", "x"], "./d/../f", 0).bytes();
        let record = decode(&bytes, &NoFsTypes).unwrap();
        assert_eq!(record.cgroup_id, 7);
        assert_eq!(record.opened_inode, None);
        assert_eq!(record.effect.pid, 42);
        assert_eq!(record.effect.comm, "sh");
        assert_eq!(
            record.effect.kind,
            EffectKind::Open { path: EffectPath::resolved("/tmp/x/f"), flags: 0o101, mode: 0 }
        );
    }

    #[test]
    fn absolute_user_path_ignores_base() {
        let bytes = RecordBuilder::new(KIND_MKDIR).path(0, &["ignored"], "/a//b/", 0).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Mkdir { path: EffectPath::resolved("/a/b"), mode: 0 });
    }

    #[test]
    fn fd_only_path_is_the_base() {
        let bytes = RecordBuilder::new(KIND_CHMOD).arg(0, 0o600).path(0, &["srv", "f"], "", 0).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Chmod { path: EffectPath::resolved("/srv/f"), mode: 0o600 });
    }

    #[test]
    fn unresolved_flag_marks_the_path() {
        let bytes = RecordBuilder::new(KIND_UNLINK).path(0, &["a"], "f", PATH_UNRESOLVED).bytes();
        let EffectKind::Unlink { path } = kind_of(&bytes) else { panic!("not an unlink") };
        assert!(!path.resolved);
    }

    #[test]
    fn write_through_a_descriptor_names_the_file() {
        let bytes = RecordBuilder::new(KIND_WRITE)
            .arg(0, 6)
            .arg(1, 0xffff_8880_1234_5678)
            .arg(2, 77)
            .path(0, &["var", "log", "nginx", "access.log"], "", 0)
            .bytes();
        assert_eq!(
            kind_of(&bytes),
            EffectKind::Write {
                path: EffectPath::resolved("/var/log/nginx/access.log"),
                via: WriteVia::SharedMapping,
                inode_key: 0xffff_8880_1234_5678,
                ino: 77,
            }
        );
        let unknown = RecordBuilder::new(KIND_WRITE).arg(0, 99).path(0, &["f"], "", 0).bytes();
        assert_eq!(decode(&unknown, &NoFsTypes), Err(RecordError::UnknownWriteVia { via: 99 }));
    }

    #[test]
    fn asynchronous_io_names_the_call_and_a_polling_ring() {
        let setup = RecordBuilder::new(KIND_ASYNC_IO).arg(0, 1).arg(1, IORING_SETUP_SQPOLL | 1).bytes();
        assert_eq!(kind_of(&setup), EffectKind::AsyncIo { call: AsyncIoCall::IoUringSetup, polling_ring: true });
        let submit = RecordBuilder::new(KIND_ASYNC_IO).arg(0, 4).bytes();
        assert_eq!(kind_of(&submit), EffectKind::AsyncIo { call: AsyncIoCall::IoSubmit, polling_ring: false });
        let unknown = RecordBuilder::new(KIND_ASYNC_IO).arg(0, 0).bytes();
        assert_eq!(decode(&unknown, &NoFsTypes), Err(RecordError::UnknownAsyncIoCall { call: 0 }));
    }

    #[test]
    fn unlinkat_removedir_is_rmdir() {
        let bytes = RecordBuilder::new(KIND_UNLINK).arg(0, AT_REMOVEDIR).path(0, &[], "/d", 0).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Rmdir { path: EffectPath::resolved("/d") });
    }

    #[test]
    fn symlink_target_stays_verbatim() {
        let bytes =
            RecordBuilder::new(KIND_SYMLINK).path(0, &["w"], "l", 0).path(1, &[], "../d", PATH_VERBATIM).bytes();
        assert_eq!(
            kind_of(&bytes),
            EffectKind::Symlink { path: EffectPath::resolved("/w/l"), target: PathBuf::from("../d") }
        );
    }

    #[test]
    fn chown_minus_one_means_unchanged() {
        let bytes = RecordBuilder::new(KIND_CHOWN).arg(0, u32::MAX as u64).arg(1, 5).path(0, &[], "/f", 0).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Chown { path: EffectPath::resolved("/f"), uid: None, gid: Some(5) });
    }

    #[test]
    fn inet_addresses_decode() {
        let mut v4 = vec![0u8; 16];
        v4[0..2].copy_from_slice(&AF_INET.to_ne_bytes());
        v4[2..4].copy_from_slice(&8080u16.to_be_bytes());
        v4[4..8].copy_from_slice(&[10, 1, 2, 3]);
        let bytes = RecordBuilder::new(KIND_CONNECT).extra(&v4).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Connect { addr: SockAddr::Inet("10.1.2.3:8080".parse().unwrap()) });

        let mut v6 = vec![0u8; 28];
        v6[0..2].copy_from_slice(&AF_INET6.to_ne_bytes());
        v6[2..4].copy_from_slice(&443u16.to_be_bytes());
        v6[8..24].copy_from_slice(&Ipv6Addr::LOCALHOST.octets());
        let bytes = RecordBuilder::new(KIND_BIND).extra(&v6).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Bind { addr: SockAddr::Inet("[::1]:443".parse().unwrap()) });
    }

    #[test]
    fn unix_socket_path_resolves_against_cwd() {
        let bytes = RecordBuilder::new(KIND_BIND).extra(&AF_UNIX.to_ne_bytes()).path(0, &["run"], "s.sock", 0).bytes();
        assert_eq!(kind_of(&bytes), EffectKind::Bind { addr: SockAddr::Unix(EffectPath::resolved("/run/s.sock")) });
    }

    #[test]
    fn a_fork_names_the_child_in_both_namespaces_when_it_could_read_both() {
        let bytes = RecordBuilder::new(KIND_FORK).arg(0, 4711).arg(1, 23).arg(2, 1).bytes();
        let in_namespace = Some(NamespacePid { pid: 23, depth: 1 });
        assert_eq!(kind_of(&bytes), EffectKind::Fork { child: 4711, in_namespace });
        // The program leaves 0 where it could not read the child's pid.
        let unread = RecordBuilder::new(KIND_FORK).arg(0, 4711).bytes();
        assert_eq!(kind_of(&unread), EffectKind::Fork { child: 4711, in_namespace: None });
    }

    #[test]
    fn bad_records_are_errors() {
        assert_eq!(decode(&[0u8; 10], &NoFsTypes), Err(RecordError::Short { len: 10 }));
        assert_eq!(decode(&RecordBuilder::new(999).bytes(), &NoFsTypes), Err(RecordError::UnknownKind { kind: 999 }));
        let mut bytes = RecordBuilder::new(KIND_UNLINK).path(0, &[], "/f", 0).bytes();
        bytes.truncate(HEADER_LEN + 1);
        assert!(matches!(decode(&bytes, &NoFsTypes), Err(RecordError::PathOutOfBounds { .. })));
    }

    #[test]
    fn normalize_stays_under_root() {
        assert_eq!(normalize(Path::new("/../../etc/./x/..")), PathBuf::from("/etc"));
    }
}
