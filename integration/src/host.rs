//! What the host sees of a container: processes, cgroup directories, mounts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::{HarnessError, Outcome};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// True if `pid` exists and is not a zombie (a zombie has finished running, only its entry is left).
pub fn process_running(pid: u32) -> bool {
    crab_sys::proc_stat::read(pid).is_ok_and(|stat| crab_sys::proc_stat::state(&stat) != Some('Z'))
}

pub fn parent_pid(pid: u32) -> Outcome<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| HarnessError::io(format!("reading /proc/{pid}/status"), e))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("PPid:"))
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| HarnessError::Parse { what: format!("/proc/{pid}/status"), detail: "no PPid line".into() })
}

/// The argument vector of a process, empty if it is gone.
pub fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
        })
        .unwrap_or_default()
}

pub fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|entries| entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// Long-running shim daemons serving container `id` in `namespace`. Every shim v2 is started by
/// containerd with `-namespace NS -id ID -address ADDR`; the short-lived `start`/`delete` invocations
/// carry an extra action word and are not the daemon.
pub fn shim_daemons(namespace: &str, id: &str) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| {
            let argv = cmdline(*pid);
            let is_shim = argv.first().is_some_and(|arg0| {
                Path::new(arg0).file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("containerd-shim"))
            });
            let flag = |name: &str| argv.windows(2).find(|w| w[0] == name).map(|w| w[1].as_str());
            let action = argv.last().map(String::as_str);
            is_shim
                && flag("-id") == Some(id)
                && flag("-namespace") == Some(namespace)
                && !matches!(action, Some("start") | Some("delete"))
                && process_running(*pid)
        })
        .collect()
}

/// Lines of this process's mountinfo that belong to container `id`: a path component equal to the id
/// (e.g. `.../io.containerd.runtime.v2.task/crab/<id>/rootfs`), so that `x-1` does not match `x-10`.
pub fn mounts_of(id: &str) -> Outcome<Vec<String>> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| HarnessError::io("reading /proc/self/mountinfo", e))?;
    let component_inner = format!("/{id}/");
    let component_end = format!("/{id}");
    Ok(mountinfo
        .lines()
        .filter(|line| {
            line.split_whitespace().any(|field| field.contains(&component_inner) || field.ends_with(&component_end))
        })
        .map(str::to_string)
        .collect())
}

/// The pid of the process listening on the unix socket `path` (found through the socket's inode).
pub fn unix_listener_pid(path: &Path) -> Outcome<u32> {
    let table = std::fs::read_to_string("/proc/net/unix").map_err(|e| HarnessError::io("reading /proc/net/unix", e))?;
    let wanted = path.display().to_string();
    // Columns: Num RefCount Protocol Flags Type St Inode Path; flag 00010000 is __SO_ACCEPTCON (listening).
    let inodes: BTreeSet<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 8 && fields[7] == wanted && fields[3] == "00010000").then(|| fields[6].to_string())
        })
        .collect();
    if inodes.is_empty() {
        return Err(HarnessError::Expectation(format!("nothing listens on {wanted}")));
    }
    for pid in all_pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let target = target.display().to_string();
                if let Some(inode) = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']'))
                    && inodes.contains(inode)
                {
                    return Ok(pid);
                }
            }
        }
    }
    Err(HarnessError::Expectation(format!("no process holds the listening socket {wanted}")))
}

/// Where a process's cgroups are, for both the hybrid layout (v1 controllers plus v2 at
/// `/sys/fs/cgroup/unified`) and pure cgroup v2 (`/sys/fs/cgroup`).
#[derive(Debug, Clone)]
pub struct ProcessCgroups {
    /// `(controllers, path)` from `/proc/<pid>/cgroup`; controllers are empty for the v2 line.
    entries: Vec<(String, String)>,
}

impl ProcessCgroups {
    pub fn of_pid(pid: u32) -> Outcome<ProcessCgroups> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map_err(|e| HarnessError::io(format!("reading /proc/{pid}/cgroup"), e))?;
        let entries = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.splitn(3, ':');
                let _hierarchy = parts.next()?;
                Some((parts.next()?.to_string(), parts.next()?.to_string()))
            })
            .collect();
        Ok(ProcessCgroups { entries })
    }

    pub fn pure_v2() -> bool {
        Path::new(CGROUP_ROOT).join("cgroup.controllers").exists()
    }

    /// The v2 directory: `/sys/fs/cgroup/<path>` on pure v2, `/sys/fs/cgroup/unified/<path>` on hybrid.
    pub fn v2_dir(&self) -> Option<PathBuf> {
        let (_, path) = self.entries.iter().find(|(controllers, _)| controllers.is_empty())?;
        let base = if Self::pure_v2() { PathBuf::from(CGROUP_ROOT) } else { Path::new(CGROUP_ROOT).join("unified") };
        Some(join_cgroup(&base, path))
    }

    /// The v1 directory of `controller` (hybrid hosts only).
    pub fn v1_dir(&self, controller: &str) -> Option<PathBuf> {
        self.entries.iter().find_map(|(controllers, path)| {
            controllers.split(',').any(|c| c == controller).then(|| {
                let mount = Path::new(CGROUP_ROOT).join(controller);
                let mount = if mount.exists() { mount } else { Path::new(CGROUP_ROOT).join(controllers) };
                join_cgroup(&mount, path)
            })
        })
    }

    /// Every existing cgroup directory of the process, across hierarchies.
    pub fn existing_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = BTreeSet::new();
        for (controllers, _) in &self.entries {
            let dir = if controllers.is_empty() {
                self.v2_dir()
            } else if let Some(named) = controllers.strip_prefix("name=") {
                self.v1_dir(controllers).or_else(|| self.v1_dir(named))
            } else {
                controllers.split(',').next().and_then(|first| self.v1_dir(first))
            };
            if let Some(dir) = dir.filter(|d| d.is_dir()) {
                dirs.insert(dir);
            }
        }
        dirs.into_iter().collect()
    }

    /// The memory limit in bytes (`u64::MAX` for "max"): `memory.max` on v2, `memory.limit_in_bytes`
    /// on the v1 memory controller.
    pub fn memory_limit(&self) -> Outcome<u64> {
        let file = if Self::pure_v2() {
            self.v2_dir().map(|d| d.join("memory.max"))
        } else {
            self.v1_dir("memory").map(|d| d.join("memory.limit_in_bytes"))
        }
        .ok_or_else(|| HarnessError::Expectation("process has no memory cgroup".into()))?;
        let text =
            std::fs::read_to_string(&file).map_err(|e| HarnessError::io(format!("reading {}", file.display()), e))?;
        match text.trim() {
            "max" => Ok(u64::MAX),
            value => value.parse().map_err(|_| HarnessError::Parse {
                what: file.display().to_string(),
                detail: format!("{value:?} is not a number"),
            }),
        }
    }

    /// The freezer's view: `FROZEN`/`THAWED` (v1 `freezer.state`) or `1`/`0` (v2 `cgroup.freeze`).
    pub fn frozen(&self) -> Outcome<bool> {
        if !Self::pure_v2()
            && let Some(dir) = self.v1_dir("freezer")
        {
            let file = dir.join("freezer.state");
            let text = std::fs::read_to_string(&file)
                .map_err(|e| HarnessError::io(format!("reading {}", file.display()), e))?;
            return Ok(text.trim() == "FROZEN");
        }
        let file = self
            .v2_dir()
            .map(|d| d.join("cgroup.freeze"))
            .ok_or_else(|| HarnessError::Expectation("process has no freezer cgroup".into()))?;
        let text =
            std::fs::read_to_string(&file).map_err(|e| HarnessError::io(format!("reading {}", file.display()), e))?;
        Ok(text.trim() == "1")
    }
}

fn join_cgroup(base: &Path, path: &str) -> PathBuf {
    base.join(path.trim_start_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_running_and_has_a_parent() {
        let me = std::process::id();
        assert!(process_running(me));
        assert!(parent_pid(me).unwrap() > 0);
    }

    #[test]
    fn own_cgroups_exist() {
        let cgroups = ProcessCgroups::of_pid(std::process::id()).unwrap();
        assert!(!cgroups.existing_dirs().is_empty());
    }
}
