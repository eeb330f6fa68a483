//! Finding the cgroup v2 id (what `bpf_get_current_cgroup_id()` returns) of a process.

use std::os::unix::fs::{DirEntryExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::mounts::{MountTable, MountsError};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} has no cgroup v2 (0::) line")]
    NoUnifiedLine { path: PathBuf },
    #[error("no cgroup2 file system is mounted")]
    NoCgroup2Mount,
    #[error(transparent)]
    Mounts(#[from] MountsError),
}

/// Where the cgroup v2 hierarchy is mounted: `/sys/fs/cgroup` on pure v2
/// hosts, `/sys/fs/cgroup/unified` on hybrid ones.
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let table = MountTable::of_pid(std::process::id())?;
    table
        .entries()
        .iter()
        .find(|e| e.fs_type == "cgroup2")
        .map(|e| e.mount_point.clone())
        .ok_or(CgroupError::NoCgroup2Mount)
}

/// The cgroup v2 path of `pid`, relative to the v2 root (the `0::` line).
pub fn cgroup2_path_of_pid(pid: u32) -> Result<PathBuf, CgroupError> {
    let path = PathBuf::from(format!("/proc/{pid}/cgroup"));
    let text = std::fs::read_to_string(&path).map_err(|source| CgroupError::Read { path: path.clone(), source })?;
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(|p| PathBuf::from(p.trim_start_matches('/')))
        .ok_or(CgroupError::NoUnifiedLine { path })
}

/// The cgroup v2 id of a cgroup directory: its inode number.
pub fn cgroup_id_of_dir(dir: &Path) -> Result<u64, CgroupError> {
    std::fs::metadata(dir).map(|m| m.ino()).map_err(|source| CgroupError::Read { path: dir.to_path_buf(), source })
}

/// The cgroup v2 id of the cgroup `pid` is in.
pub fn cgroup_id_of_pid(pid: u32) -> Result<u64, CgroupError> {
    let dir = cgroup2_mount()?.join(cgroup2_path_of_pid(pid)?);
    cgroup_id_of_dir(&dir)
}

/// Directories a search for a cgroup's level looks at before it gives up.
const LEVEL_SEARCH_LIMIT: usize = 100_000;

/// The level of cgroup `cgroup_id` below the cgroup v2 root (the root is level 0), as
/// `bpf_get_current_ancestor_cgroup_id` counts: through `/proc/<pid>/cgroup` when `pid` is in
/// that very cgroup, else by a bounded search of the hierarchy. None when it cannot be told.
pub fn cgroup_level(cgroup_id: u64, pid: Option<u32>) -> Option<u32> {
    let mount = cgroup2_mount().ok()?;
    if let Some(path) = pid.and_then(|pid| cgroup2_path_of_pid(pid).ok())
        && cgroup_id_of_dir(&mount.join(&path)).ok() == Some(cgroup_id)
    {
        return u32::try_from(path.components().count()).ok();
    }
    if cgroup_id_of_dir(&mount).ok() == Some(cgroup_id) {
        return Some(0);
    }
    let mut budget = LEVEL_SEARCH_LIMIT;
    search_level(&mount, cgroup_id, 1, &mut budget)
}

/// Depth-first search below `dir` (whose children are at `level`) for the directory whose inode
/// is `cgroup_id`. cgroup file systems hold no symbolic links; none is followed anyway.
fn search_level(dir: &Path, cgroup_id: u64, level: u32, budget: &mut usize) -> Option<u32> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if entry.ino() == cgroup_id {
            return Some(level);
        }
        children.push(entry.path());
    }
    for child in children {
        *budget = budget.checked_sub(1)?;
        if let Some(found) = search_level(&child, cgroup_id, level + 1, budget) {
            return Some(found);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cgroup_id_is_the_v2_directory_inode() {
        let mount = cgroup2_mount().unwrap();
        let dir = mount.join(cgroup2_path_of_pid(std::process::id()).unwrap());
        assert!(dir.join("cgroup.procs").exists(), "{} is not a cgroup v2 directory", dir.display());
        assert_eq!(cgroup_id_of_pid(std::process::id()).unwrap(), cgroup_id_of_dir(&dir).unwrap());
    }

    #[test]
    fn missing_process_is_an_error_naming_the_file() {
        let err = cgroup_id_of_pid(u32::MAX).unwrap_err();
        assert!(err.to_string().contains(&format!("/proc/{}/cgroup", u32::MAX)), "{err}");
    }

    #[test]
    fn level_is_the_depth_below_the_root_found_with_or_without_a_pid() {
        let mount = cgroup2_mount().unwrap();
        let own = cgroup2_path_of_pid(std::process::id()).unwrap();
        let id = cgroup_id_of_pid(std::process::id()).unwrap();
        let depth = own.components().count() as u32;
        assert_eq!(cgroup_level(id, Some(std::process::id())), Some(depth));
        assert_eq!(cgroup_level(id, None), Some(depth), "found by searching");
        // A pid in another cgroup is no help, but the search still finds it.
        let parent = mount.join(&own).parent().unwrap().to_path_buf();
        if parent.starts_with(&mount) && parent != mount {
            assert_eq!(cgroup_level(cgroup_id_of_dir(&parent).unwrap(), Some(std::process::id())), Some(depth - 1));
        }
        assert_eq!(cgroup_level(cgroup_id_of_dir(&mount).unwrap(), None), Some(0));
        assert_eq!(cgroup_level(u64::MAX, None), None, "no such cgroup");
    }
}
