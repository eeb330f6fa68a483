//! Thin, fd-relative wrappers over the Linux calls the store needs and std does not offer
//! (openat2, *at calls with AT_SYMLINK_NOFOLLOW, fd xattrs, copy_file_range, syncfs), made
//! through rustix. Each wrapper fixes the flags that make the call safe against a sandbox
//! that swaps names under us (never follow a link, close on exec), so call sites cannot forget
//! them, and turns rustix's errno into `std::io::Error` for the store's error context.
//!
//! Every path argument here is a single component or a path already validated by [`super::path`],
//! so none of them contains a NUL byte.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, Dev, FileType, FlockOperation, Mode, OFlags, ResolveFlags, SeekFrom, Timespec, Timestamps};
use rustix::io::Errno;

pub(crate) use rustix::fs::Stat;

pub(crate) fn cstr(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn mode(bits: u32) -> Mode {
    Mode::from_raw_mode(bits & 0o7777)
}

/// Opens a directory on the host as an `O_PATH` anchor for the `*at` calls.
pub(crate) fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(path, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?)
}

/// `openat2` that refuses to leave `dir` and refuses every symlink on the way: `..` and absolute
/// symlinks fail with EXDEV, any symlink component with ELOOP.
pub(crate) fn openat_beneath(dir: BorrowedFd<'_>, rel: &CStr, flags: OFlags) -> io::Result<OwnedFd> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    Ok(rustix::fs::openat2(dir, rel, flags | OFlags::CLOEXEC, Mode::empty(), resolve)?)
}

/// `openat` of a single component, never following a symlink there.
pub(crate) fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: OFlags, mode_bits: u32) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(dir, name, flags | OFlags::NOFOLLOW | OFlags::CLOEXEC, mode(mode_bits))?)
}

/// Opens the entry `name` in `dir` itself, as an `O_PATH` handle: a symlink is not followed
/// (the handle is the link), and a device node, fifo or socket is not opened (no driver or
/// peer is reached). What the entry is gets decided on this handle ([`fstat`]), and whatever
/// is done to it afterwards goes through it, so a container that swaps the name between two
/// calls cannot redirect us.
pub(crate) fn open_entry(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    openat(dir, name, OFlags::PATH, 0)
}

/// Like [`open_entry`], but a missing entry is `None` rather than an error.
pub(crate) fn open_entry_opt(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<OwnedFd>> {
    match open_entry(dir, name) {
        Ok(fd) => Ok(Some(fd)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The procfs name of one of our descriptors. Opening or changing it acts on the inode the
/// descriptor holds, whatever name that inode has now.
fn proc_fd_path(fd: BorrowedFd<'_>) -> CString {
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("digits have no NUL")
}

/// Opens the inode an `O_PATH` handle holds for I/O (`flags`: `RDONLY`, `WRONLY`,
/// `DIRECTORY`...). The caller has checked what the handle is with [`fstat`]: only regular
/// files and directories are reopened, never a device node, fifo or socket.
pub(crate) fn reopen(fd: BorrowedFd<'_>, flags: OFlags) -> io::Result<OwnedFd> {
    // No O_NOFOLLOW: the procfs entry is a magic link and must be followed to reach the inode.
    Ok(rustix::fs::open(proc_fd_path(fd).as_c_str(), flags | OFlags::CLOEXEC | OFlags::NOCTTY, Mode::empty())?)
}

/// chmod of the inode an `O_PATH` handle holds (`fchmod` refuses `O_PATH` handles). A symlink
/// handle is refused by the caller: Linux cannot change a link's mode.
pub(crate) fn chmod_entry(fd: BorrowedFd<'_>, mode_bits: u32) -> io::Result<()> {
    Ok(rustix::fs::chmod(proc_fd_path(fd).as_c_str(), mode(mode_bits))?)
}

fn owner(uid: u32, gid: u32) -> (Option<rustix::fs::Uid>, Option<rustix::fs::Gid>) {
    (Some(rustix::fs::Uid::from_raw(uid)), Some(rustix::fs::Gid::from_raw(gid)))
}

/// chown of the inode an `O_PATH` handle holds (the entry itself, a symlink included).
pub(crate) fn chown_entry(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    let (uid, gid) = owner(uid, gid);
    // AT_EMPTY_PATH: the call acts on `fd` itself.
    Ok(rustix::fs::chownat(fd, c"", uid, gid, AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW)?)
}

/// The target of a symlink held by an `O_PATH` handle.
pub(crate) fn readlink_entry(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    readlinkat(fd, c"")
}

pub(crate) fn fstatat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Stat> {
    Ok(rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)?)
}

/// Like [`fstatat`] but a missing entry is `None` rather than an error.
pub(crate) fn fstatat_opt(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<Stat>> {
    match fstatat(dir, name) {
        Ok(st) => Ok(Some(st)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

pub(crate) fn fstat(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    Ok(rustix::fs::fstat(fd)?)
}

pub(crate) fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode_bits: u32) -> io::Result<()> {
    Ok(rustix::fs::mkdirat(dir, name, mode(mode_bits))?)
}

pub(crate) fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, is_dir: bool) -> io::Result<()> {
    let flags = if is_dir { AtFlags::REMOVEDIR } else { AtFlags::empty() };
    Ok(rustix::fs::unlinkat(dir, name, flags)?)
}

pub(crate) fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    Ok(rustix::fs::symlinkat(target, dir, name)?)
}

pub(crate) fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    Ok(rustix::fs::readlinkat(dir, name, Vec::new())?.into_bytes())
}

/// Gives the inode an `O_PATH` handle holds the new name `new` in `new_dir` (AT_EMPTY_PATH:
/// the handle itself is linked, whatever name it has now; needs CAP_DAC_READ_SEARCH).
pub(crate) fn link_entry(fd: BorrowedFd<'_>, new_dir: BorrowedFd<'_>, new: &CStr) -> io::Result<()> {
    Ok(rustix::fs::linkat(fd, c"", new_dir, new, AtFlags::EMPTY_PATH)?)
}

/// Makes a device node, fifo or socket entry; `mode_bits` holds the type (`S_IF*`) and the
/// permission bits, as `mknod(2)` takes them.
pub(crate) fn mknodat(dir: BorrowedFd<'_>, name: &CStr, mode_bits: u32, rdev: u64) -> io::Result<()> {
    let kind = FileType::from_raw_mode(mode_bits);
    Ok(rustix::fs::mknodat(dir, name, kind, mode(mode_bits), rdev as Dev)?)
}

pub(crate) fn fchown(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    let (uid, gid) = owner(uid, gid);
    Ok(rustix::fs::fchown(fd, uid, gid)?)
}

pub(crate) fn fchmod(fd: BorrowedFd<'_>, mode_bits: u32) -> io::Result<()> {
    Ok(rustix::fs::fchmod(fd, mode(mode_bits))?)
}

fn timestamps(mtime: (i64, u32)) -> Timestamps {
    Timestamps {
        // atime is not part of a checkpoint: leave it as the kernel has it.
        last_access: Timespec { tv_sec: 0, tv_nsec: rustix::fs::UTIME_OMIT },
        last_modification: Timespec { tv_sec: mtime.0, tv_nsec: mtime.1.into() },
    }
}

pub(crate) fn futimens(fd: BorrowedFd<'_>, mtime: (i64, u32)) -> io::Result<()> {
    Ok(rustix::fs::futimens(fd, &timestamps(mtime))?)
}

/// Sets the mtime of the inode an `O_PATH` handle holds (not a symlink: the caller uses
/// [`lutimensat`] for those).
pub(crate) fn utimens_entry(fd: BorrowedFd<'_>, mtime: (i64, u32)) -> io::Result<()> {
    Ok(rustix::fs::utimensat(rustix::fs::CWD, proc_fd_path(fd).as_c_str(), &timestamps(mtime), AtFlags::empty())?)
}

pub(crate) fn lutimensat(dir: BorrowedFd<'_>, name: &CStr, mtime: (i64, u32)) -> io::Result<()> {
    Ok(rustix::fs::utimensat(dir, name, &timestamps(mtime), AtFlags::SYMLINK_NOFOLLOW)?)
}

/// Calls `read` with a growing buffer until the value fits (ERANGE means "larger buffer").
fn read_growing(start: usize, mut read: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; start];
    loop {
        match read(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(Errno::RANGE) => buf.resize(buf.len() * 4, 0),
            Err(e) => return Err(e.into()),
        }
    }
}

pub(crate) fn list_xattrs(fd: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    match read_growing(1024, |buf| rustix::fs::flistxattr(fd, buf)) {
        Ok(list) => Ok(list.split(|b| *b == 0).filter(|s| !s.is_empty()).map(<[u8]>::to_vec).collect()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

pub(crate) fn get_xattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    read_growing(256, |buf| rustix::fs::fgetxattr(fd, name, buf))
}

pub(crate) fn set_xattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    Ok(rustix::fs::fsetxattr(fd, name, value, rustix::fs::XattrFlags::empty())?)
}

pub(crate) fn remove_xattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    Ok(rustix::fs::fremovexattr(fd, name)?)
}

/// Names in a directory, without `.` and `..`, sorted so captures and copies are deterministic.
pub(crate) fn read_dir_names(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    // Dir reads through a descriptor of its own, opened for reading from `dir`.
    let mut stream = rustix::fs::Dir::read_from(dir)?;
    let mut names = Vec::new();
    while let Some(entry) = stream.read() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    names.sort_unstable();
    Ok(names)
}

/// Copies `len` bytes from the start of `src` to the current offset of `dst` in the kernel.
pub(crate) fn copy_file_range_all(src: &File, dst: &File, len: u64) -> io::Result<()> {
    let mut off_in = 0u64;
    let mut left = len;
    while left > 0 {
        let chunk = left.min(1 << 30) as usize;
        let n = rustix::fs::copy_file_range(src, Some(&mut off_in), dst, None, chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source shorter than expected"));
        }
        left -= n as u64;
    }
    Ok(())
}

/// The offset of the first data at or after `from` (`SEEK_DATA`); `None` past the last data.
pub(crate) fn seek_data(file: &File, from: u64) -> io::Result<Option<u64>> {
    seek(file, SeekFrom::Data(from))
}

/// The offset of the first hole at or after `from` (`SEEK_HOLE`; the end of the file counts
/// as one).
pub(crate) fn seek_hole(file: &File, from: u64) -> io::Result<u64> {
    Ok(seek(file, SeekFrom::Hole(from))?.unwrap_or(from))
}

fn seek(file: &File, to: SeekFrom) -> io::Result<Option<u64>> {
    match rustix::fs::seek(file, to) {
        Ok(offset) => Ok(Some(offset)),
        Err(Errno::NXIO) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Copies `len` bytes from `src` at `off_in` to `dst` at `off_out` in the kernel; neither
/// file's offset moves.
pub(crate) fn copy_file_range_at(src: &File, off_in: u64, dst: &File, off_out: u64, len: u64) -> io::Result<()> {
    let (mut off_in, mut off_out) = (off_in, off_out);
    let mut left = len;
    while left > 0 {
        let chunk = left.min(1 << 30) as usize;
        let n = rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source shorter than expected"));
        }
        left -= n as u64;
    }
    Ok(())
}

/// `sync_file_range(2)`, which rustix does not offer.
fn sync_file_range(file: &File, offset: u64, len: u64, flags: libc::c_uint) -> io::Result<()> {
    // SAFETY: the call takes a descriptor `file` keeps open and plain integers; no memory.
    let ret = unsafe { libc::sync_file_range(file.as_fd().as_raw_fd(), offset as i64, len as i64, flags) };
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Starts writing `len` bytes at `offset` of a file back to the disk, or (`wait`) writes them
/// and waits until they are written. No metadata, no cache flush: a later fsync or syncfs still
/// makes them durable.
pub(crate) fn write_back_range(file: &File, offset: u64, len: u64, wait: bool) -> io::Result<()> {
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    sync_file_range(file, offset, len, flags)
}

/// Starts writeback of a whole file without waiting for it.
pub(crate) fn start_writeback(file: &File) -> io::Result<()> {
    sync_file_range(file, 0, 0, libc::SYNC_FILE_RANGE_WRITE)
}

pub(crate) fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    Ok(rustix::fs::syncfs(fd)?)
}

pub(crate) fn fsync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// `mkdir -p` whose new directories are root's alone (0700): the store holds sandboxes' files,
/// environment and memory, which no other host user may read.
pub(crate) fn create_private_dir_all(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path)
}

pub(crate) fn flock(file: &File, exclusive: bool) -> io::Result<()> {
    let op = if exclusive { FlockOperation::LockExclusive } else { FlockOperation::LockShared };
    loop {
        match rustix::fs::flock(file, op) {
            Err(Errno::INTR) => continue,
            other => return Ok(other?),
        }
    }
}

/// The file type bits (`S_IFMT`) of a stat, to compare with `libc::S_IF*`.
pub(crate) fn file_type(st: &Stat) -> u32 {
    st.st_mode & libc::S_IFMT
}
