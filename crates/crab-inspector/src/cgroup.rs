//! Finding the cgroup v2 id (what `bpf_get_current_cgroup_id()` returns) of a process.

use std::os::unix::fs::MetadataExt;
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
}
