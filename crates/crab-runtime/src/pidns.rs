//! The pid a container's next process gets: state of the sandbox that CRIU does not keep.
//!
//! A pid namespace hands out pids after the last one it handed out (its `ns_last_pid`),
//! skipping those in use. CRIU restores every process with its own pid (`clone3` with
//! `set_tid`, which leaves that cursor alone), so a restored namespace hands out the lowest
//! free pids again: a server started after a recovery got pid 25 where the fault-free run's
//! got 54, and `ss -p`, `$!` and pid files print it. Each dump therefore records the next
//! pid beside its images ([`NEXT_PID_FILE`]), and each restore sets it again.
//!
//! `ns_last_pid` reads and writes the cursor of the namespace of the process that calls read
//! or write (`task_active_pid_ns(current)`), whichever procfs it opened, and only a process
//! created in a namespace is in it. So both directions fork a child into the namespace
//! (from a thread that entered it with `setns(pidfd, CLONE_NEWPID)`, which only decides
//! where that thread's children are born, and which ends with the call, so no other work
//! ever forks from it). The child is itself the namespace's newest process: to read, it
//! takes its own pid as the next one and sets the cursor back to just before itself, so
//! once it is reaped the namespace hands that pid out next, exactly as if nobody had looked.
//! Writing needs `CAP_SYS_ADMIN` (or `CAP_CHECKPOINT_RESTORE`) over the namespace's user
//! namespace: the shim has it, the container's own root does not.
//!
//! A container that shares the shim's pid namespace (a host-pid pod) is refused: its
//! cursor is the node's.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::Reaper;

/// Beside a dump's images: the pid the container's next process would have got, in decimal.
pub const NEXT_PID_FILE: &str = "crab-pid-ns-next";

const NS_LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";

pub use crab_sys::pidfd_open;

/// The pid the next process in `init`'s pid namespace gets, found without changing it.
pub async fn next_pid(reaper: &Reaper, init: &OwnedFd) -> std::io::Result<u32> {
    let (child, pid_in_ns) = in_namespace(init, None).await?;
    // Until the child is reaped its pid is taken, and the namespace's next process would skip it.
    reaper.wait_for(child).await;
    Ok(pid_in_ns)
}

/// Makes `next` the pid the next process in `init`'s pid namespace gets (the lowest free pid
/// from `next` on, as the kernel counts).
pub async fn set_next_pid(reaper: &Reaper, init: &OwnedFd, next: u32) -> std::io::Result<()> {
    if next < 2 {
        return Err(std::io::Error::other(format!("next pid {next}: pid 1 is the namespace's init")));
    }
    let (child, _) = in_namespace(init, Some(next - 1)).await?;
    reaper.wait_for(child).await;
    Ok(())
}

/// Records `next` beside a dump's images, replacing what was there. A new file renamed over
/// the old one: a restore's images are links to the kept copy, which a write would change.
pub fn record_in_images(images: &Path, next: u32) -> std::io::Result<()> {
    let tmp = images.join(format!(".{NEXT_PID_FILE}.tmp"));
    std::fs::write(&tmp, format!("{next}\n"))?;
    std::fs::rename(&tmp, images.join(NEXT_PID_FILE))
}

/// The next pid a dump recorded beside its images; None for images without one (taken
/// before this was recorded, or by a shim that could not read it).
pub fn recorded_in_images(images: &Path) -> Result<Option<u32>, String> {
    let path = images.join(NEXT_PID_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    match text.trim().parse::<u32>() {
        Ok(next) if (2..=i32::MAX as u32).contains(&next) => Ok(Some(next)),
        _ => Err(format!("{}: {:?} is not a pid above 1", path.display(), text.trim())),
    }
}

/// Forks a child into `init`'s pid namespace that sets the namespace's last pid to `last`,
/// or, for None, to the one before its own. Returns the child's host pid (the caller's reaper
/// reaps it) and its pid in the namespace, once the child has done its write.
async fn in_namespace(init: &OwnedFd, last: Option<u32>) -> std::io::Result<(u32, u32)> {
    let init = init.try_clone()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    // A thread of its own, never one of tokio's pools: after setns every child it forks is
    // born in the container's namespace, and the thread ends with this call.
    std::thread::Builder::new().name("crab-pidns".into()).spawn(move || {
        let _ = tx.send(fork_into(&init, last));
    })?;
    rx.await.unwrap_or_else(|_| Err(std::io::Error::other("the pid namespace thread ended without an answer")))
}

fn fork_into(init: &OwnedFd, last: Option<u32>) -> std::io::Result<(u32, u32)> {
    // SAFETY: setns with a pidfd and CLONE_NEWPID changes only the namespace this thread's
    // children are born in; the thread forks once and ends.
    if unsafe { libc::setns(init.as_raw_fd(), libc::CLONE_NEWPID) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let ours = std::fs::metadata("/proc/self/ns/pid")?.ino();
    let theirs = std::fs::metadata("/proc/thread-self/ns/pid_for_children")?.ino();
    if ours == theirs {
        return Err(std::io::Error::other("the container shares this process's pid namespace"));
    }
    // Opened here, written by the child: the kernel takes the namespace of the writer.
    let sysctl = std::fs::OpenOptions::new().write(true).open(NS_LAST_PID)?;
    let (mut report_rx, report_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map(|(r, w)| (std::fs::File::from(r), w))
        .map_err(std::io::Error::from)?;
    // The decimal text is made before the fork where it can be: after it, the child of a
    // multi-threaded process may only make async-signal-safe calls (no allocation).
    // SAFETY: the child calls only getpid, write and _exit (async-signal-safe) on descriptors
    // that stay open in it, and formats into a stack buffer.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if child == 0 {
        // SAFETY: see above; nothing here allocates, locks or unwinds.
        unsafe {
            let me = libc::getpid() as u32;
            let mut text = [0u8; 12];
            let len = decimal(last.unwrap_or(me - 1), &mut text);
            let written = libc::write(sysctl.as_raw_fd(), text.as_ptr().cast(), len);
            let errno = if written == len as isize { 0 } else { *libc::__errno_location() };
            let mut report = [0u8; 8];
            report[..4].copy_from_slice(&me.to_ne_bytes());
            report[4..].copy_from_slice(&errno.to_ne_bytes());
            libc::write(report_tx.as_raw_fd(), report.as_ptr().cast(), report.len());
            libc::_exit(0);
        }
    }
    drop(report_tx);
    drop(sysctl);
    let mut report = [0u8; 8];
    let read = report_rx.read_exact(&mut report);
    let child = child as u32;
    read.map_err(|e| std::io::Error::other(format!("child {child} in the pid namespace did not report: {e}")))?;
    let pid_in_ns = u32::from_ne_bytes(report[..4].try_into().expect("4 bytes"));
    let errno = i32::from_ne_bytes(report[4..].try_into().expect("4 bytes"));
    if errno != 0 {
        let source = std::io::Error::from_raw_os_error(errno);
        return Err(std::io::Error::new(
            source.kind(),
            format!("{NS_LAST_PID} in the container's namespace: {source}"),
        ));
    }
    Ok((child, pid_in_ns))
}

/// Writes `n` in decimal at the start of `out`; returns its length. No allocation (it runs
/// in a forked child).
fn decimal(mut n: u32, out: &mut [u8; 12]) -> usize {
    let mut digits = [0u8; 10];
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        out[i] = digits[len - 1 - i];
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_are_written_without_allocating() {
        let mut out = [0u8; 12];
        for n in [0u32, 7, 10, 54, 4_194_303, u32::MAX] {
            let len = decimal(n, &mut out);
            assert_eq!(std::str::from_utf8(&out[..len]).unwrap(), n.to_string());
        }
    }

    #[test]
    fn a_recorded_next_pid_is_read_back_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(recorded_in_images(dir.path()), Ok(None));
        record_in_images(dir.path(), 54).unwrap();
        assert_eq!(recorded_in_images(dir.path()), Ok(Some(54)));
        for bad in ["1", "0", "-3", "abc", "99999999999", ""] {
            std::fs::write(dir.path().join(NEXT_PID_FILE), bad).unwrap();
            let err = recorded_in_images(dir.path()).unwrap_err();
            assert!(err.contains(NEXT_PID_FILE) && err.contains("not a pid"), "{bad}: {err}");
        }
    }

    /// A restore's images are links to the kept copy: a later turn's cursor replaces the file
    /// in the restore's directory and leaves the kept one as its dump wrote it.
    #[test]
    fn a_newer_next_pid_replaces_a_linked_file_without_writing_through_it() {
        let (kept, restore) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        record_in_images(kept.path(), 20).unwrap();
        std::fs::hard_link(kept.path().join(NEXT_PID_FILE), restore.path().join(NEXT_PID_FILE)).unwrap();
        record_in_images(restore.path(), 48).unwrap();
        assert_eq!(recorded_in_images(restore.path()), Ok(Some(48)));
        assert_eq!(recorded_in_images(kept.path()), Ok(Some(20)));
        let names: Vec<_> = std::fs::read_dir(restore.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [NEXT_PID_FILE], "no temporary file left");
    }

    /// The pid a new process in `init`'s pid namespace gets, as that namespace numbers it
    /// (nsenter forks into it; the reaper, which reaps every child, waits for it).
    #[allow(clippy::zombie_processes, reason = "the reaper reaps every child of this process")]
    async fn new_process_in_namespace_of(reaper: &Reaper, init: u32) -> u32 {
        let mut child = std::process::Command::new("nsenter")
            .args(["-t", &init.to_string(), "-p", "--", "sh", "-c", "echo $$"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let exit = reaper.wait_for(child.id());
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert_eq!(exit.await.status, 0, "nsenter: {out}");
        out.trim().parse().unwrap()
    }

    #[tokio::test]
    #[allow(clippy::zombie_processes, reason = "the reaper reaps every child of this process")]
    async fn the_next_pid_of_a_namespace_is_read_without_moving_it_and_set() {
        crab_sys::skip_unless_root!("a pid namespace of its own");
        let reaper = Reaper::default();
        reaper.start().unwrap();
        // `unshare --fork` makes sleep the namespace's init (pid 1).
        let mut unshare = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "sleep", "60"])
            .spawn()
            .unwrap();
        let init = (0..100)
            .find_map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(20));
                let children =
                    std::fs::read_to_string(format!("/proc/{}/task/{}/children", unshare.id(), unshare.id()));
                children.ok()?.split_whitespace().next()?.parse::<u32>().ok()
            })
            .expect("unshare's child");
        let fd = pidfd_open(init).unwrap();
        let first = next_pid(&reaper, &fd).await.unwrap();
        assert_eq!(next_pid(&reaper, &fd).await.unwrap(), first, "reading moved the namespace's next pid");
        assert_eq!(new_process_in_namespace_of(&reaper, init).await, first, "the next process got another pid");
        set_next_pid(&reaper, &fd, 300).await.unwrap();
        assert_eq!(next_pid(&reaper, &fd).await.unwrap(), 300);
        assert_eq!(new_process_in_namespace_of(&reaper, init).await, 300);
        assert_eq!(new_process_in_namespace_of(&reaper, init).await, 301);
        let _ = unshare.kill();

        let me = pidfd_open(std::process::id()).unwrap();
        let err = next_pid(&reaper, &me).await.unwrap_err();
        assert!(err.to_string().contains("shares this process's pid namespace"), "{err}");
    }
}
