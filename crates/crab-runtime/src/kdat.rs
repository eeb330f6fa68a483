//! A place for CRIU's kernel-facts cache that works on every node.
//!
//! Each CRIU run first probes the kernel for what it can do (memory tracking,
//! namespaces, socket options, ...): 31-56 ms of every dump and every restore
//! of a small sandbox on this project's machines. CRIU keeps the result in a
//! cache file and reads it back on the next run, but writes it only on a
//! tmpfs, so that a reboot (maybe into another kernel) drops it. Its default
//! place is `/run`, which is a tmpfs on most nodes and is not on some (the
//! virtual machines this project's CI runs on have `/run` on the root disk):
//! there CRIU probes the kernel on every run.
//!
//! crab's own CRIU build (scripts/install-deps) puts the cache in [`KDAT_DIR`]
//! instead, and the runtime makes sure that directory is a tmpfs before it
//! runs CRIU: on a node whose `/run` is one it already is and nothing is done;
//! elsewhere a small tmpfs is mounted there once, and stays for the next
//! shims. A CRIU built with the default place is unaffected either way.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::fcntl::{Flock, FlockArg};
use nix::mount::MsFlags;
use nix::sys::statfs::{TMPFS_MAGIC, statfs};

/// Where crab's CRIU keeps its kernel-facts cache (its build's `RUNDIR`;
/// scripts/install-deps builds it with the same path).
pub const KDAT_DIR: &str = "/run/crab/criu";

/// What [`ensure_tmpfs`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdatDir {
    /// The directory was already on a tmpfs (the usual node, or an earlier shim's mount).
    WasTmpfs,
    /// A tmpfs was mounted on it now.
    Mounted,
}

/// Makes `dir` a directory on a tmpfs, mounting a small one there if it is not.
/// Concurrent callers (several shims start at once) are serialised on a lock of
/// `dir`'s parent, and each looks again under the lock, so tmpfs mounts are
/// never stacked.
pub fn ensure_tmpfs(dir: &Path) -> std::io::Result<KdatDir> {
    if is_tmpfs(dir) {
        return Ok(KdatDir::WasTmpfs);
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent)?;
    // The lock is on the parent (a host directory of crab's), which a mount on `dir`
    // does not hide: every caller locks the same inode.
    let parent_dir = std::fs::File::open(parent)?;
    let _locked = Flock::lock(parent_dir, FlockArg::LockExclusive).map_err(|(_, e)| std::io::Error::from(e))?;
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // Made now, on its parent's file system: on a node whose /run is a tmpfs, done.
    if is_tmpfs(dir) {
        return Ok(KdatDir::WasTmpfs);
    }
    fail::fail_point!("kdat-before-mount");
    // The cache is a few KiB; CRIU writes it as a temporary file and renames it.
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=1m,mode=0700"),
    )
    .map_err(std::io::Error::from)?;
    Ok(KdatDir::Mounted)
}

/// [`ensure_tmpfs`] on [`KDAT_DIR`] before a CRIU run. It costs a `statfs` once the
/// directory is a tmpfs; failing is not an error of the dump or restore (CRIU then
/// probes the kernel each time, as before), and is logged once per process.
pub(crate) fn prepare_for_criu() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    match ensure_tmpfs(Path::new(KDAT_DIR)) {
        Ok(KdatDir::WasTmpfs) => {}
        Ok(KdatDir::Mounted) => tracing::info!(dir = KDAT_DIR, "mounted a tmpfs for CRIU's kernel-facts cache"),
        Err(error) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(dir = KDAT_DIR, %error, "no tmpfs for CRIU's kernel-facts cache: CRIU probes the kernel on every run");
            }
        }
    }
}

fn is_tmpfs(dir: &Path) -> bool {
    statfs(dir).is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unmounts what the test mounted, also when an assertion fails first.
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            while nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
        }
    }

    fn mounts_at(dir: &Path) -> usize {
        let dir = dir.to_str().unwrap();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(dir))
            .count()
    }

    /// A scratch directory off any tmpfs, under /var/tmp (on the root disk here): a tmpfs
    /// parent would make the first call a no-op, and the test says so rather than pass for
    /// nothing.
    fn scratch_off_tmpfs() -> Option<tempfile::TempDir> {
        let base = tempfile::tempdir_in("/var/tmp").unwrap();
        if is_tmpfs(base.path()) {
            eprintln!("skipped: /var/tmp is a tmpfs on this machine");
            return None;
        }
        Some(base)
    }

    #[test]
    fn a_directory_off_tmpfs_gets_one_tmpfs_and_keeps_it() {
        crab_sys::skip_unless_root!("mounting a tmpfs");
        let Some(base) = scratch_off_tmpfs() else { return };
        let dir = base.path().join("run/criu");
        let _unmount = Unmount(dir.clone());
        assert_eq!(ensure_tmpfs(&dir).unwrap(), KdatDir::Mounted);
        assert!(is_tmpfs(&dir));
        // Again, and from threads at once: nothing is stacked on top.
        let calls: Vec<_> = (0..4)
            .map(|_| {
                let dir = dir.clone();
                std::thread::spawn(move || ensure_tmpfs(&dir).unwrap())
            })
            .collect();
        for call in calls {
            assert_eq!(call.join().unwrap(), KdatDir::WasTmpfs);
        }
        assert_eq!(mounts_at(&dir), 1);
    }

    #[test]
    fn a_directory_made_on_a_tmpfs_is_left_as_it_is() {
        crab_sys::skip_unless_root!("mounting a tmpfs");
        let base = tempfile::tempdir_in("/var/tmp").unwrap();
        let parent = base.path().join("run");
        std::fs::create_dir(&parent).unwrap();
        let _unmount = Unmount(parent.clone());
        nix::mount::mount(Some("tmpfs"), &parent, Some("tmpfs"), MsFlags::empty(), Some("size=64k")).unwrap();
        let dir = parent.join("crab/criu");
        assert_eq!(ensure_tmpfs(&dir).unwrap(), KdatDir::WasTmpfs);
        assert!(dir.is_dir());
        assert_eq!(mounts_at(&dir), 0);
    }

    #[test]
    fn concurrent_first_calls_mount_once() {
        crab_sys::skip_unless_root!("mounting a tmpfs");
        let Some(base) = scratch_off_tmpfs() else { return };
        let dir = base.path().join("criu");
        let _unmount = Unmount(dir.clone());
        // Every caller past its first look before the first mount is in place.
        fail::cfg("kdat-before-mount", "sleep(100)").unwrap();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(6));
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let (dir, barrier) = (dir.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    ensure_tmpfs(&dir).unwrap()
                })
            })
            .collect();
        let results: Vec<_> = calls.into_iter().map(|c| c.join().unwrap()).collect();
        fail::remove("kdat-before-mount");
        assert_eq!(results.iter().filter(|r| **r == KdatDir::Mounted).count(), 1, "{results:?}");
        assert_eq!(mounts_at(&dir), 1);
    }
}
