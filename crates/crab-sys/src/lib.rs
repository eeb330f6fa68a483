//! System calls crab's crates share that no library offers in the form they need, each
//! with why it is sound. The lowest crate of the workspace: it depends on nothing of crab.

pub mod proc_stat;

/// A pidfd of `pid`. The caller must know `pid` is the process it means now (a child it
/// has not reaped, a container's init the runtime just named); the pidfd keeps meaning that
/// process even after its number is reused.
pub fn pidfd_open(pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0 as libc::c_uint) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Marks every descriptor from `first` up close-on-exec, so that a child started by a
/// long-lived process (the shim's server, crabd) inherits nothing but what it was handed
/// below `first`. Meant for `pre_exec`: only async-signal-safe system calls, no allocation.
/// Marking (not closing) keeps std's own exec-error pipe working until the exec.
pub fn close_on_exec_from(first: u32) {
    // SAFETY: close_range(2) and fcntl(2) act on this process's descriptor table only.
    unsafe {
        if libc::close_range(first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC as libc::c_int) == 0 {
            return;
        }
        // Kernels before 5.11: every descriptor up to the soft limit, one by one.
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        let last = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur.min(1 << 20) as libc::c_int
        } else {
            4096
        };
        for fd in first as libc::c_int..last {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
}

/// Whether this process runs as root, as the tests of containerd, CRIU, BPF, cgroups and
/// mounts need. When it does not, prints that the running test is skipped and why, and
/// returns false, so that `cargo test` works for a developer without root. Under CI (`CI`
/// set) it panics instead: CI runs every test as root, and a skip there would hide one.
pub fn root_or_skip(needs: &str) -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return true;
    }
    let thread = std::thread::current();
    // libtest names each test's thread after the test.
    let test = thread.name().unwrap_or("this test");
    assert!(
        std::env::var_os("CI").is_none(),
        "{test} needs root ({needs}) and runs as uid {euid}: CI must run every test as root"
    );
    eprintln!("skipped: {test} needs root ({needs}); running as uid {euid}");
    false
}

/// Returns from the calling test, after saying so, unless it runs as root
/// ([`root_or_skip`]): `crab_sys::skip_unless_root!("containerd and CRIU");`.
#[macro_export]
macro_rules! skip_unless_root {
    ($needs:expr) => {
        if !$crate::root_or_skip($needs) {
            return;
        }
    };
}

/// Bytes of `file` the page cache holds dirty or under writeback: what has not reached the
/// disk yet. Through cachestat(2) (Linux 6.5), which counts pages without touching them; a
/// kernel without it answers `ENOSYS`.
pub fn unwritten_bytes(file: &std::fs::File) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    /// `SYS_cachestat`, the same number on every architecture (the unified syscall table).
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    // A length of 0 means to the end of the file.
    let range = Range { off: 0, len: 0 };
    let mut stat = Stat::default();
    // SAFETY: cachestat reads `range` and writes `stat`, both #[repr(C)] as the kernel lays
    // them out and alive for the call; the descriptor is borrowed from `file` for the call.
    let rc =
        unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), &range as *const Range, &mut stat as *mut Stat, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    Ok((stat.nr_dirty + stat.nr_writeback) * page)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    #[test]
    fn written_bytes_are_unwritten_until_synced() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = std::fs::File::create(dir.path().join("f")).unwrap();
        file.write_all(&[7u8; 64 << 10]).unwrap();
        // Dirty now: the kernel's flusher writes back pages only after they are 30 s old.
        assert_eq!(super::unwritten_bytes(&file).unwrap(), 64 << 10);
        file.sync_all().unwrap();
        assert_eq!(super::unwritten_bytes(&file).unwrap(), 0);
    }
}
