//! Thin, fd-relative wrappers over the Linux calls the store needs and std does not offer
//! (openat2, *at calls with AT_SYMLINK_NOFOLLOW, fd xattrs, copy_file_range, syncfs).
//!
//! Every path argument here is a single component or a path already validated by [`super::path`],
//! so none of them contains a NUL byte.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub(crate) fn cstr(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(ret) }
}

fn check_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(ret as usize) }
}

/// Opens a directory on the host as an `O_PATH` anchor for the `*at` calls.
pub(crate) fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    let c = cstr(path.as_os_str().as_bytes())?;
    let fd = check(unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) })?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `openat2` that refuses to leave `dir` and refuses every symlink on the way: `..` and absolute
/// symlinks fail with EXDEV, any symlink component with ELOOP.
pub(crate) fn openat_beneath(dir: BorrowedFd<'_>, rel: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // open_how is non-exhaustive (the kernel may grow it); unset fields must be zero.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    let ret = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

/// `openat` of a single component, never following a symlink there.
pub(crate) fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let fd = check(unsafe {
        libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC, mode as libc::c_uint)
    })?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens the entry `name` in `dir` itself, as an `O_PATH` handle: a symlink is not followed
/// (the handle is the link), and a device node, fifo or socket is not opened (no driver or
/// peer is reached). What the entry is gets decided on this handle ([`fstat`]), and whatever
/// is done to it afterwards goes through it, so a container that swaps the name between two
/// calls cannot redirect us.
pub(crate) fn open_entry(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    openat(dir, name, libc::O_PATH, 0)
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

/// Opens the inode an `O_PATH` handle holds for I/O (`flags`: `O_RDONLY`, `O_WRONLY`,
/// `O_DIRECTORY`...). The caller has checked what the handle is with [`fstat`]: only regular
/// files and directories are reopened, never a device node, fifo or socket.
pub(crate) fn reopen(fd: BorrowedFd<'_>, flags: libc::c_int) -> io::Result<OwnedFd> {
    let path = proc_fd_path(fd);
    // No O_NOFOLLOW: the procfs entry is a magic link and must be followed to reach the inode.
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    let raw = check(unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOCTTY) })?;
    // SAFETY: `raw` was just returned by open(2) and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// chmod of the inode an `O_PATH` handle holds (`fchmod` refuses `O_PATH` handles). A symlink
/// handle is refused by the caller: Linux cannot change a link's mode.
pub(crate) fn chmod_entry(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    let path = proc_fd_path(fd);
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    check(unsafe { libc::chmod(path.as_ptr(), mode as libc::mode_t) }).map(drop)
}

/// chown of the inode an `O_PATH` handle holds (the entry itself, a symlink included).
pub(crate) fn chown_entry(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: the empty string is NUL-terminated and static; AT_EMPTY_PATH makes the call act
    // on `fd` itself.
    check(unsafe {
        libc::fchownat(fd.as_raw_fd(), c"".as_ptr(), uid, gid, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW)
    })
    .map(drop)
}

/// The target of a symlink held by an `O_PATH` handle.
pub(crate) fn readlink_entry(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    readlinkat(fd, c"")
}

pub(crate) fn fstatat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    check(unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

/// Like [`fstatat`] but a missing entry is `None` rather than an error.
pub(crate) fn fstatat_opt(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<libc::stat>> {
    match fstatat(dir, name) {
        Ok(st) => Ok(Some(st)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

pub(crate) fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

pub(crate) fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode as libc::mode_t) }).map(drop)
}

pub(crate) fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, is_dir: bool) -> io::Result<()> {
    let flags = if is_dir { libc::AT_REMOVEDIR } else { 0 };
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

pub(crate) fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    check(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) }).map(drop)
}

pub(crate) fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    let n =
        check_size(unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
    buf.truncate(n);
    Ok(buf)
}

pub(crate) fn linkat(old_dir: BorrowedFd<'_>, old: &CStr, new_dir: BorrowedFd<'_>, new: &CStr) -> io::Result<()> {
    check(unsafe { libc::linkat(old_dir.as_raw_fd(), old.as_ptr(), new_dir.as_raw_fd(), new.as_ptr(), 0) }).map(drop)
}

pub(crate) fn mknodat(dir: BorrowedFd<'_>, name: &CStr, mode: u32, rdev: u64) -> io::Result<()> {
    check(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), mode as libc::mode_t, rdev as libc::dev_t) }).map(drop)
}

pub(crate) fn fchown(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    check(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) }).map(drop)
}

pub(crate) fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) }).map(drop)
}

fn timespecs(mtime: (i64, u32)) -> [libc::timespec; 2] {
    let mtime = libc::timespec { tv_sec: mtime.0, tv_nsec: mtime.1 as _ };
    // atime is not part of a checkpoint: leave it as the kernel has it.
    let atime = libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT };
    [atime, mtime]
}

pub(crate) fn futimens(fd: BorrowedFd<'_>, mtime: (i64, u32)) -> io::Result<()> {
    let ts = timespecs(mtime);
    check(unsafe { libc::futimens(fd.as_raw_fd(), ts.as_ptr()) }).map(drop)
}

/// Sets the mtime of the inode an `O_PATH` handle holds (not a symlink: the caller uses
/// [`lutimensat`] for those).
pub(crate) fn utimens_entry(fd: BorrowedFd<'_>, mtime: (i64, u32)) -> io::Result<()> {
    let ts = timespecs(mtime);
    let path = proc_fd_path(fd);
    // SAFETY: `path` is NUL-terminated and `ts` holds the two timespecs utimensat reads; both
    // outlive the call.
    check(unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), ts.as_ptr(), 0) }).map(drop)
}

pub(crate) fn lutimensat(dir: BorrowedFd<'_>, name: &CStr, mtime: (i64, u32)) -> io::Result<()> {
    let ts = timespecs(mtime);
    check(unsafe { libc::utimensat(dir.as_raw_fd(), name.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) }).map(drop)
}

pub(crate) fn list_xattrs(fd: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; 1024];
    loop {
        let ret = unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        match check_size(ret) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf.split(|b| *b == 0).filter(|s| !s.is_empty()).map(<[u8]>::to_vec).collect());
            }
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) => buf.resize(buf.len() * 4, 0),
            Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        }
    }
}

pub(crate) fn get_xattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        let ret = unsafe { libc::fgetxattr(fd.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        match check_size(ret) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) => buf.resize(buf.len() * 4, 0),
            Err(e) => return Err(e),
        }
    }
}

pub(crate) fn set_xattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    check(unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) }).map(drop)
}

pub(crate) fn remove_xattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    check(unsafe { libc::fremovexattr(fd.as_raw_fd(), name.as_ptr()) }).map(drop)
}

/// Names in a directory, without `.` and `..`, sorted so captures and copies are deterministic.
pub(crate) fn read_dir_names(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    // fdopendir takes ownership of its fd, so hand it a duplicate opened for reading.
    let dup = openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = std::os::fd::IntoRawFd::into_raw_fd(dup);
    let stream = unsafe { libc::fdopendir(raw) };
    if stream.is_null() {
        let err = io::Error::last_os_error();
        unsafe { libc::close(raw) };
        return Err(err);
    }
    let mut names = Vec::new();
    let result = loop {
        unsafe { *libc::__errno_location() = 0 };
        let ent = unsafe { libc::readdir64(stream) };
        if ent.is_null() {
            let errno = unsafe { *libc::__errno_location() };
            break if errno == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(errno)) };
        }
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    };
    unsafe { libc::closedir(stream) };
    result.map(|()| {
        names.sort_unstable();
        names
    })
}

/// Copies `len` bytes from the start of `src` to the current offset of `dst` in the kernel.
pub(crate) fn copy_file_range_all(src: &File, dst: &File, len: u64) -> io::Result<()> {
    let mut off_in: libc::loff_t = 0;
    let mut left = len;
    while left > 0 {
        let chunk = left.min(1 << 30) as usize;
        let n = unsafe {
            libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), std::ptr::null_mut(), chunk, 0)
        };
        let n = check_size(n)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source shorter than expected"));
        }
        left -= n as u64;
    }
    Ok(())
}

/// The offset of the first data at or after `from` (`SEEK_DATA`); `None` past the last data.
pub(crate) fn seek_data(file: &File, from: u64) -> io::Result<Option<u64>> {
    seek(file, from, libc::SEEK_DATA)
}

/// The offset of the first hole at or after `from` (`SEEK_HOLE`; the end of the file counts
/// as one).
pub(crate) fn seek_hole(file: &File, from: u64) -> io::Result<u64> {
    Ok(seek(file, from, libc::SEEK_HOLE)?.unwrap_or(from))
}

fn seek(file: &File, from: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek on a descriptor `file` keeps open; no memory is passed.
    let ret = unsafe { libc::lseek64(file.as_raw_fd(), from as libc::off64_t, whence) };
    if ret < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) };
    }
    Ok(Some(ret as u64))
}

/// Copies `len` bytes from `src` at `off_in` to `dst` at `off_out` in the kernel; neither
/// file's offset moves.
pub(crate) fn copy_file_range_at(src: &File, off_in: u64, dst: &File, off_out: u64, len: u64) -> io::Result<()> {
    let mut off_in = off_in as libc::loff_t;
    let mut off_out = off_out as libc::loff_t;
    let mut left = len;
    while left > 0 {
        let chunk = left.min(1 << 30) as usize;
        // SAFETY: both descriptors are open for the call's duration and both offsets are
        // valid, exclusively borrowed loff_t values the kernel advances.
        let n = check_size(unsafe {
            libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), &mut off_out, chunk, 0)
        })?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source shorter than expected"));
        }
        left -= n as u64;
    }
    Ok(())
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
    check(unsafe { libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, flags) }).map(drop)
}

/// Starts writeback of a whole file without waiting for it.
pub(crate) fn start_writeback(file: &File) -> io::Result<()> {
    check(unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) }).map(drop)
}

pub(crate) fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    check(unsafe { libc::syncfs(fd.as_raw_fd()) }).map(drop)
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
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH };
    loop {
        match check(unsafe { libc::flock(file.as_raw_fd(), op) }) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other.map(drop),
        }
    }
}

pub(crate) fn file_type(st: &libc::stat) -> u32 {
    st.st_mode & libc::S_IFMT
}
