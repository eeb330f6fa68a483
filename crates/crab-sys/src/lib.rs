//! System calls crab's crates share that no library offers in the form they need, each
//! with why it is sound. The lowest crate of the workspace: it depends on nothing of crab.

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
