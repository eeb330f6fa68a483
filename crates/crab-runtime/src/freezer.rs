//! Thawing a sandbox's freezer cgroup after an abandoned dump. CRIU freezes the cgroup itself
//! (runc hands it the freezer's path) and thaws it when it ends, also on its error paths; a CRIU
//! killed while the tasks are frozen leaves them frozen, so the shim thaws them. The cgroup is
//! found from a process of the sandbox (`/proc/<pid>/cgroup`) and the host's cgroup mounts
//! (`/proc/self/mountinfo`): the v1 freezer controller when it is mounted, else cgroup v2.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FreezerError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("no freezer for pid {pid}: {detail}")]
    NotFound { pid: u32, detail: String },
    #[error("{path} still reads {state:?} after thawing")]
    StillFrozen { path: PathBuf, state: String },
    #[error("{path} reads {state:?}, not frozen, {after:?} after the pause")]
    NotFrozen { path: PathBuf, state: String, after: std::time::Duration },
}

/// Which freezer a cgroup has, and the file that thaws it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Freezer {
    /// cgroup v1: `freezer.state`, THAWED or FREEZING or FROZEN.
    V1(PathBuf),
    /// cgroup v2: `cgroup.freeze`, 0 or 1.
    V2(PathBuf),
}

impl Freezer {
    fn file(&self) -> &Path {
        match self {
            Freezer::V1(p) | Freezer::V2(p) => p,
        }
    }

    fn thawed_value(&self) -> &'static str {
        match self {
            Freezer::V1(_) => "THAWED",
            Freezer::V2(_) => "0",
        }
    }
}

fn read(path: PathBuf) -> Result<String, FreezerError> {
    std::fs::read_to_string(&path).map_err(|source| FreezerError::Io { path, source })
}

/// The freezer of the cgroup holding `pid`.
fn freezer_of_pid(pid: u32) -> Result<Freezer, FreezerError> {
    let cgroups = read(PathBuf::from(format!("/proc/{pid}/cgroup")))?;
    let mountinfo = read(PathBuf::from("/proc/self/mountinfo"))?;
    freezer_of(&cgroups, &mountinfo).map_err(|detail| FreezerError::NotFound { pid, detail })
}

/// Thaws the cgroup holding `pid` (whether or not it is frozen) and checks that it reads thawed.
pub fn thaw(pid: u32) -> Result<Freezer, FreezerError> {
    let freezer = freezer_of_pid(pid)?;
    let file = freezer.file().to_path_buf();
    std::fs::write(&file, freezer.thawed_value()).map_err(|source| FreezerError::Io { path: file.clone(), source })?;
    let state = read(file.clone())?;
    if state.trim() != freezer.thawed_value() {
        return Err(FreezerError::StillFrozen { path: file, state: state.trim().to_string() });
    }
    Ok(freezer)
}

/// Whether the cgroup holding `pid` was asked to freeze (by a pause): FREEZING or FROZEN on a v1
/// freezer, `cgroup.freeze` 1 on cgroup v2.
pub fn is_frozen(pid: u32) -> Result<bool, FreezerError> {
    let freezer = freezer_of_pid(pid)?;
    Ok(read(freezer.file().to_path_buf())?.trim() != freezer.thawed_value())
}

/// Waits until the cgroup holding `pid` reads frozen, for at most `within`. A v1 freezer
/// reads FREEZING until every task has stopped, and may stay there when a task was busy at the
/// write: FROZEN is written again each round, as runc's pause does. On cgroup v2 the state is
/// `frozen 1` in `cgroup.events` (`cgroup.freeze` reads back what was asked at once).
pub fn wait_frozen(pid: u32, within: std::time::Duration) -> Result<Freezer, FreezerError> {
    let freezer = freezer_of_pid(pid)?;
    let started = std::time::Instant::now();
    loop {
        let (path, state) = match &freezer {
            Freezer::V1(file) => (file.clone(), read(file.clone())?.trim().to_string()),
            Freezer::V2(file) => {
                let events = file.with_file_name("cgroup.events");
                let text = read(events.clone())?;
                (events, text.lines().find(|l| l.starts_with("frozen ")).unwrap_or("").to_string())
            }
        };
        if state == "FROZEN" || state == "frozen 1" {
            return Ok(freezer);
        }
        if started.elapsed() >= within {
            return Err(FreezerError::NotFrozen { path, state, after: within });
        }
        if let Freezer::V1(file) = &freezer {
            std::fs::write(file, "FROZEN").map_err(|source| FreezerError::Io { path: file.clone(), source })?;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The freezer file of the cgroup described by `cgroups` (a `/proc/<pid>/cgroup`), with the
/// cgroup file systems of `mountinfo` (a `/proc/self/mountinfo`).
pub fn freezer_of(cgroups: &str, mountinfo: &str) -> Result<Freezer, String> {
    // Lines are `hierarchy-id:controllers:path`; the path may itself hold colons.
    let entries: Vec<(&str, &str)> = cgroups
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            Some((controllers, path))
        })
        .collect();
    let v1 = entries.iter().find(|(controllers, _)| controllers.split(',').any(|c| c == "freezer"));
    let v2 = entries.iter().find(|(controllers, _)| controllers.is_empty());
    let mounts: Vec<Mount> = mountinfo.lines().filter_map(Mount::parse).collect();
    if let Some((_, path)) = v1 {
        let mount = mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.options.split(',').any(|o| o == "freezer"))
            .ok_or("the freezer controller is not mounted")?;
        return Ok(Freezer::V1(mount.locate(path)?.join("freezer.state")));
    }
    if let Some((_, path)) = v2 {
        let mount = mounts.iter().find(|m| m.fstype == "cgroup2").ok_or("cgroup2 is not mounted")?;
        return Ok(Freezer::V2(mount.locate(path)?.join("cgroup.freeze")));
    }
    Err("in no freezer cgroup".into())
}

/// A line of mountinfo: `id parent major:minor root mountpoint options [tags] - fstype source super-options`.
struct Mount<'a> {
    root: &'a str,
    point: &'a str,
    fstype: &'a str,
    options: &'a str,
}

impl<'a> Mount<'a> {
    fn parse(line: &'a str) -> Option<Self> {
        let (before, after) = line.split_once(" - ")?;
        let fields: Vec<&str> = before.split(' ').collect();
        let mut after = after.split(' ');
        let (fstype, _source, options) = (after.next()?, after.next()?, after.next()?);
        Some(Mount { root: fields.get(3)?, point: fields.get(4)?, fstype, options })
    }

    /// Where cgroup `path` (as the kernel names it) is under this mount.
    fn locate(&self, path: &str) -> Result<PathBuf, String> {
        let inside = Path::new(path)
            .strip_prefix(self.root)
            .map_err(|_| format!("cgroup {path} is not under the root {} of the mount at {}", self.root, self.point))?;
        if inside.components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
            return Err(format!("cgroup {path} is not a plain path"));
        }
        Ok(Path::new(&unescape(self.point)).join(inside))
    }
}

/// mountinfo writes space, tab, newline and backslash as octal escapes.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4).and_then(|d| u8::from_str_radix(d, 8).ok());
        match code {
            Some(byte) => {
                out.push(byte as char);
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTS: &str = "\
25 30 0:23 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
31 25 0:29 / /sys/fs/cgroup/freezer rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,freezer
32 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,cpu,cpuacct
";

    #[test]
    fn v1_freezer_wins_on_a_hybrid_host() {
        let cgroups = "12:freezer:/default/sb-1\n4:cpu,cpuacct:/default/sb-1\n0::/default/sb-1\n";
        assert_eq!(
            freezer_of(cgroups, HYBRID_MOUNTS).unwrap(),
            Freezer::V1("/sys/fs/cgroup/freezer/default/sb-1/freezer.state".into())
        );
    }

    #[test]
    fn v2_only_and_escaped_mount_points() {
        let mounts = "30 1 0:26 / /sys/fs/cgroup\\040x rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            freezer_of("0::/system.slice/crab:sb\n", mounts).unwrap(),
            Freezer::V2("/sys/fs/cgroup x/system.slice/crab:sb/cgroup.freeze".into())
        );
    }

    #[test]
    fn a_mount_of_a_sub_tree_and_what_cannot_be_found() {
        let mounts = "31 25 0:29 /outer /cg/freezer rw - cgroup cgroup rw,freezer\n";
        assert_eq!(
            freezer_of("3:freezer:/outer/sb\n", mounts).unwrap(),
            Freezer::V1("/cg/freezer/sb/freezer.state".into())
        );
        assert!(freezer_of("3:freezer:/elsewhere/sb\n", mounts).unwrap_err().contains("not under the root"));
        assert!(freezer_of("3:freezer:/outer/../x\n", mounts).unwrap_err().contains("not a plain path"));
        assert!(freezer_of("3:freezer:/sb\n", "").unwrap_err().contains("not mounted"));
        assert!(freezer_of("", HYBRID_MOUNTS).unwrap_err().contains("no freezer"));
    }
}
