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
