//! A process's mount table from `/proc/<pid>/mountinfo`, to tell which file
//! system (overlay, tmpfs, ...) a container path is on.

use std::path::{Path, PathBuf};

use super::record::FsTypeLookup;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    /// Where it is mounted, as seen from the process's root.
    pub mount_point: PathBuf,
    pub fs_type: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountTable {
    /// In mountinfo order: a later mount on the same point hides an earlier one.
    entries: Vec<MountEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum MountsError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("mountinfo line {line} is malformed: {text:?}")]
    Malformed { line: usize, text: String },
}

impl MountTable {
    pub fn of_pid(pid: u32) -> Result<Self, MountsError> {
        let path = PathBuf::from(format!("/proc/{pid}/mountinfo"));
        let text = std::fs::read_to_string(&path).map_err(|source| MountsError::Read { path, source })?;
        Self::parse(&text)
    }

    /// Parses mountinfo(5): `id parent major:minor root mount_point options [optional...] - fstype source super_options`.
    pub fn parse(text: &str) -> Result<Self, MountsError> {
        let mut entries = Vec::new();
        for (index, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let malformed = || MountsError::Malformed { line: index + 1, text: line.to_string() };
            let fields: Vec<&str> = line.split(' ').collect();
            let separator = fields.iter().position(|f| *f == "-").ok_or_else(malformed)?;
            if separator < 6 || fields.len() < separator + 2 {
                return Err(malformed());
            }
            entries.push(MountEntry {
                mount_id: fields[0].parse().map_err(|_| malformed())?,
                mount_point: PathBuf::from(unescape_octal(fields[4])),
                fs_type: fields[separator + 1].to_string(),
            });
        }
        Ok(Self { entries })
    }

    /// The mount `path` is on: the deepest mount point containing it, the latest when stacked.
    pub fn mount_of(&self, path: &Path) -> Option<&MountEntry> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| path.starts_with(&e.mount_point))
            .max_by_key(|(order, e)| (e.mount_point.components().count(), *order))
            .map(|(_, e)| e)
    }

    pub fn entries(&self) -> &[MountEntry] {
        &self.entries
    }
}

impl FsTypeLookup for MountTable {
    fn fs_type(&self, path: &Path) -> Option<String> {
        self.mount_of(path).map(|e| e.fs_type.clone())
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal =
            bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(digits) => {
                out.push(digits.iter().fold(0u8, |acc, d| acc.wrapping_mul(8) + (d - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
612 540 0:61 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
613 612 0:63 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
614 612 0:64 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
615 614 0:65 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666
620 612 0:70 / /tmp rw,relatime shared:5 master:1 - tmpfs tmpfs rw
621 612 0:71 / /my\\040dir rw - tmpfs tmpfs rw
622 620 0:72 / /tmp rw - ext4 /dev/vda rw
";

    #[test]
    fn deepest_and_latest_mount_wins() {
        let table = MountTable::parse(SAMPLE).unwrap();
        assert_eq!(table.fs_type(Path::new("/etc/passwd")).as_deref(), Some("overlay"));
        assert_eq!(table.fs_type(Path::new("/dev/pts/0")).as_deref(), Some("devpts"));
        assert_eq!(table.fs_type(Path::new("/dev/null")).as_deref(), Some("tmpfs"));
        assert_eq!(table.mount_of(Path::new("/tmp/x")).unwrap().mount_id, 622);
        assert_eq!(table.fs_type(Path::new("/my dir/f")).as_deref(), Some("tmpfs"));
        // "/tmpfoo" is not under "/tmp".
        assert_eq!(table.fs_type(Path::new("/tmpfoo")).as_deref(), Some("overlay"));
    }

    #[test]
    fn malformed_line_is_named() {
        let err = MountTable::parse("1 2 3\n").unwrap_err();
        assert!(matches!(err, MountsError::Malformed { line: 1, .. }), "{err}");
    }

    #[test]
    fn own_mountinfo_parses() {
        let table = MountTable::of_pid(std::process::id()).unwrap();
        assert!(table.mount_of(Path::new("/")).is_some());
    }
}
