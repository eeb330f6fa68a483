//! How many bytes a turn's commit will write, asked for before the commit.
//!
//! A file-system delta writes about the size of the files it changed (a
//! created directory with all it holds); a process checkpoint about the size
//! of its CRIU images. Paths come from the container's effects, so they are
//! resolved inside the container's root and never followed out of it.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::checkpoint::ChangedPath;

/// Stops a walk of a huge created tree: the estimate only orders and paces
/// commits, it need not be exact.
const MAX_ENTRIES: usize = 200_000;

/// Sum of the sizes of `changed` under `rootfs` (created directories whole),
/// plus the size of `criu_images` when given. Unreadable paths count zero.
pub async fn estimate_commit_bytes(rootfs: &Path, changed: &[ChangedPath], criu_images: Option<&Path>) -> u64 {
    let rootfs = rootfs.to_path_buf();
    let changed: Vec<ChangedPath> = changed.to_vec();
    let images = criu_images.map(Path::to_path_buf);
    tokio::task::spawn_blocking(move || {
        let mut budget = MAX_ENTRIES;
        let fs = changed_bytes(&rootfs, &changed, &mut budget);
        let criu = images.map_or(0, |dir| host_tree_bytes(&dir, &mut budget));
        fs + criu
    })
    .await
    .unwrap_or(0)
}

fn changed_bytes(rootfs: &Path, changed: &[ChangedPath], budget: &mut usize) -> u64 {
    let Ok(root) = open(libc::AT_FDCWD, rootfs.as_os_str().as_bytes(), libc::O_PATH | libc::O_DIRECTORY, false) else {
        return 0;
    };
    changed
        .iter()
        .map(|c| {
            let rel = c.path.strip_prefix(b"/").unwrap_or(&c.path);
            if rel.is_empty() {
                return 0;
            }
            let Ok(fd) = open(root.as_raw_fd(), rel, libc::O_PATH | libc::O_NOFOLLOW, true) else { return 0 };
            match fstat(&fd) {
                Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR && c.created => container_tree_bytes(&fd, budget),
                Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => st.st_size as u64,
                _ => 0,
            }
        })
        .sum()
}

/// Size of the regular files under a directory of the container held as
/// `dir`: each level is opened by a single name with O_NOFOLLOW, so a
/// directory swapped for a symlink meanwhile is not followed out.
fn container_tree_bytes(dir: &OwnedFd, budget: &mut usize) -> u64 {
    let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd())) else { return 0 };
    let mut total = 0;
    for entry in entries.flatten() {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        let name = entry.file_name();
        let Ok(fd) = open(dir.as_raw_fd(), name.as_bytes(), libc::O_PATH | libc::O_NOFOLLOW, false) else { continue };
        match fstat(&fd) {
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => total += container_tree_bytes(&fd, budget),
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => total += st.st_size as u64,
            _ => {}
        }
    }
    total
}

fn host_tree_bytes(dir: &Path, budget: &mut usize) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut total = 0;
    for entry in entries.flatten() {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            total += host_tree_bytes(&entry.path(), budget);
        } else if kind.is_file() {
            total += entry.metadata().map_or(0, |m| m.len());
        }
    }
    total
}

/// openat2, with the path resolved inside `dir` when `in_root` (absolute
/// symlinks and `..` stay in the container's root).
fn open(dir: i32, path: &[u8], flags: i32, in_root: bool) -> std::io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: open_how is plain data; unset fields must be zero.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = if in_root { libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS } else { 0 };
    // SAFETY: valid C string and open_how for the duration of the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat2, dir, c.as_ptr(), &how as *const libc::open_how, std::mem::size_of::<libc::open_how>())
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn fstat(fd: &OwnedFd) -> Option<libc::stat> {
    // SAFETY: fstat writes into the stat we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0).then_some(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sizes_changed_files_created_trees_and_images_without_leaving_the_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("app/new/sub")).unwrap();
        std::fs::write(r.join("app/a.txt"), vec![0u8; 1000]).unwrap();
        std::fs::write(r.join("app/new/x"), vec![0u8; 300]).unwrap();
        std::fs::write(r.join("app/new/sub/y"), vec![0u8; 200]).unwrap();
        // A symlink pointing at a host file: it must count as the link, not the target.
        std::os::unix::fs::symlink("/etc/passwd", r.join("app/evil")).unwrap();
        std::os::unix::fs::symlink("/", r.join("app/up")).unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("big"), vec![0u8; 5000]).unwrap();
        let images = tempfile::tempdir().unwrap();
        std::fs::write(images.path().join("pages-1.img"), vec![0u8; 4096]).unwrap();

        let changed = vec![
            ChangedPath::modified("/app/a.txt"),
            ChangedPath::created("/app/new"),
            ChangedPath::modified("/app/evil"),
            ChangedPath::modified("/app/missing"),
            // Through the in-root symlink "/" to the host: resolves inside the root.
            ChangedPath::modified(format!("/app/up{}/big", outside.path().display())),
            ChangedPath::modified(format!("/../../..{}/big", outside.path().display())),
        ];
        assert_eq!(estimate_commit_bytes(r, &changed, None).await, 1500);
        assert_eq!(estimate_commit_bytes(r, &changed, Some(images.path())).await, 1500 + 4096);
    }
}
