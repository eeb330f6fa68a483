//! A fingerprint of what an agent can observe in its sandbox: the files under
//! the workdir, `/tmp` and `/root` (type, mode, owner, size, content hash,
//! link target), the live processes' command lines and the listening TCP
//! sockets. Two sandboxes with equal fingerprints look the same to the next turn.
//!
//! It is computed by a small bash script exec'd inside the container, so it
//! sees the container's own mount, pid and network namespaces.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

/// Prints NUL-terminated records: `P cmdline`, `L file local_address`,
/// `F type mode uid:gid size path` (followed by `T target` for symlinks) and
/// sha256sum's `HEX  path` for regular files. Processes are listed first,
/// while the script has no children of its own; the script itself is skipped.
pub const SCRIPT: &str = r#"set -u
self=$$
# A sandbox that was just started or recovered shows its init as `runc init`
# until the runtime lets it exec its command (a while, under load): that is
# not a state of the sandbox, so wait for it, for at most 5 s.
for ((wait = 0; wait < 100; wait++)); do
  init=()
  mapfile -d '' -t init < /proc/1/cmdline 2>/dev/null || break
  [ "${init[*]}" = "runc init" ] || break
  sleep 0.05
done
for dir in /proc/[0-9]*; do
  [ "${dir#/proc/}" = "$self" ] && continue
  args=()
  mapfile -d '' -t args < "$dir/cmdline" 2>/dev/null || continue
  [ ${#args[@]} -gt 0 ] && printf 'P %s\0' "${args[*]}"
done
for table in /proc/net/tcp /proc/net/tcp6; do
  [ -r "$table" ] || continue
  while read -r _ local _ state _; do
    [ "$state" = 0A ] && printf 'L %s %s\0' "${table##*/}" "$local"
  done < "$table"
done
roots=()
for root in "$@"; do [ -d "$root" ] && roots+=("$root"); done
[ ${#roots[@]} -gt 0 ] || exit 0
find "${roots[@]}" -xdev \( -type l -printf 'F l %#m %U:%G %s %p\0T %l\0' \) -o -printf 'F %y %#m %U:%G %s %p\0'
find "${roots[@]}" -xdev -type f -print0 | xargs -0 -r sha256sum -z -- 2>/dev/null
exit 0
"#;

#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    #[error("fingerprint record {index}: {problem} ({record:?})")]
    BadRecord { index: usize, problem: &'static str, record: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileEntry {
    /// find's `%y`: f, d, l, p, s, c, b.
    pub kind: char,
    pub mode: String,
    pub owner: String,
    /// Regular files and symlinks only: a directory's size depends on its history on ext4, not on its entries.
    pub size: Option<u64>,
    pub link_target: Option<String>,
    pub sha256: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Fingerprint {
    pub files: BTreeMap<String, FileEntry>,
    /// Command line -> number of processes running it.
    pub processes: BTreeMap<String, usize>,
    /// `tcp 0100007F:1F90` style entries of listening sockets.
    pub listeners: BTreeSet<String>,
}

/// One way two fingerprints differ. `key` is stable across runs, so keys that
/// differ between two fault-free runs can be masked as nondeterministic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub key: String,
    pub detail: String,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.detail)
    }
}

impl Fingerprint {
    /// The file roots the script should walk: the workdir, `/tmp`, `/root`,
    /// without duplicates or roots nested in another root.
    pub fn roots(workdir: &str) -> Vec<String> {
        let mut roots: Vec<String> = Vec::new();
        for candidate in [workdir, "/tmp", "/root"] {
            let candidate = candidate.trim_end_matches('/');
            let candidate = if candidate.is_empty() { "/" } else { candidate };
            let covered = roots.iter().any(|root| is_within(candidate, root));
            if !covered {
                roots.retain(|root| !is_within(root, candidate));
                roots.push(candidate.to_string());
            }
        }
        roots
    }

    pub fn parse(output: &[u8]) -> Result<Fingerprint, FingerprintError> {
        let mut fingerprint = Fingerprint::default();
        let mut hashes: BTreeMap<String, String> = BTreeMap::new();
        let mut last_link: Option<String> = None;
        let records = output.split(|byte| *byte == 0).filter(|record| !record.is_empty());
        for (index, record) in records.enumerate() {
            let text = String::from_utf8_lossy(record).into_owned();
            let bad = |problem| FingerprintError::BadRecord { index, problem, record: text.clone() };
            if let Some(cmdline) = text.strip_prefix("P ") {
                *fingerprint.processes.entry(cmdline.to_string()).or_default() += 1;
            } else if let Some(listener) = text.strip_prefix("L ") {
                fingerprint.listeners.insert(listener.to_string());
            } else if let Some(target) = text.strip_prefix("T ") {
                let path = last_link.take().ok_or_else(|| bad("link target without a symlink before it"))?;
                if let Some(entry) = fingerprint.files.get_mut(&path) {
                    entry.link_target = Some(target.to_string());
                }
            } else if let Some(rest) = text.strip_prefix("F ") {
                let mut fields = rest.splitn(5, ' ');
                let kind = fields.next().and_then(|k| k.chars().next()).ok_or_else(|| bad("no file type"))?;
                let mode = fields.next().ok_or_else(|| bad("no mode"))?.to_string();
                let owner = fields.next().ok_or_else(|| bad("no owner"))?.to_string();
                let size: u64 = fields.next().and_then(|s| s.parse().ok()).ok_or_else(|| bad("no size"))?;
                let path = fields.next().ok_or_else(|| bad("no path"))?.to_string();
                let size = matches!(kind, 'f' | 'l').then_some(size);
                if kind == 'l' {
                    last_link = Some(path.clone());
                }
                fingerprint.files.insert(path, FileEntry { kind, mode, owner, size, link_target: None, sha256: None });
            } else if is_sha256_line(&text) {
                hashes.insert(text[66..].to_string(), text[..64].to_string());
            } else {
                return Err(bad("unknown record type"));
            }
        }
        for (path, hash) in hashes {
            if let Some(entry) = fingerprint.files.get_mut(&path) {
                entry.sha256 = Some(hash);
            }
        }
        Ok(fingerprint)
    }

    /// A short stable digest of the whole fingerprint, for reports.
    pub fn digest(&self) -> String {
        let canonical = serde_json::to_vec(self).expect("a fingerprint serializes");
        hex::encode(&Sha256::digest(&canonical)[..8])
    }

    /// How `self` differs from `reference`, in key order.
    pub fn diff(&self, reference: &Fingerprint) -> Vec<Difference> {
        let mut differences = Vec::new();
        for (path, expected) in &reference.files {
            let key = format!("file:{path}");
            match self.files.get(path) {
                None => differences.push(Difference { key, detail: "missing".to_string() }),
                Some(actual) if actual != expected => {
                    differences.push(Difference { key, detail: describe_change(actual, expected) })
                }
                Some(_) => {}
            }
        }
        for path in self.files.keys().filter(|path| !reference.files.contains_key(*path)) {
            differences.push(Difference { key: format!("file:{path}"), detail: "unexpected".to_string() });
        }
        let commands: BTreeSet<&String> = self.processes.keys().chain(reference.processes.keys()).collect();
        for command in commands {
            let actual = self.processes.get(command).copied().unwrap_or(0);
            let expected = reference.processes.get(command).copied().unwrap_or(0);
            if actual != expected {
                differences.push(Difference {
                    key: format!("process:{command}"),
                    detail: format!("{actual} running, expected {expected}"),
                });
            }
        }
        for listener in reference.listeners.difference(&self.listeners) {
            differences.push(Difference { key: format!("listen:{listener}"), detail: "not listening".to_string() });
        }
        for listener in self.listeners.difference(&reference.listeners) {
            differences.push(Difference { key: format!("listen:{listener}"), detail: "unexpected".to_string() });
        }
        differences
    }
}

fn is_within(path: &str, root: &str) -> bool {
    root == "/" || path == root || path.strip_prefix(root).is_some_and(|rest| rest.starts_with('/'))
}

fn is_sha256_line(text: &str) -> bool {
    text.len() > 66 && text.as_bytes()[..64].iter().all(u8::is_ascii_hexdigit) && &text[64..66] == "  "
}

fn describe_change(actual: &FileEntry, expected: &FileEntry) -> String {
    fn field<T: fmt::Display + PartialEq>(name: &str, actual: T, expected: T) -> Option<String> {
        (actual != expected).then(|| format!("{name} {actual} (expected {expected})"))
    }
    let size = |entry: &FileEntry| entry.size.map_or("-".to_string(), |size| size.to_string());
    let target = |entry: &FileEntry| format!("{:?}", entry.link_target.as_deref().unwrap_or(""));
    [
        field("type", actual.kind, expected.kind),
        field("mode", &actual.mode, &expected.mode),
        field("owner", &actual.owner, &expected.owner),
        field("size", size(actual), size(expected)),
        field("link target", target(actual), target(expected)),
        (actual.sha256 != expected.sha256).then(|| "content differs".to_string()),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const HASH_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn records(items: &[String]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for item in items {
            bytes.extend_from_slice(item.as_bytes());
            bytes.push(0);
        }
        bytes
    }

    fn sample(hash: &str) -> Vec<u8> {
        records(&[
            "P sleep infinity".to_string(),
            "P nginx: worker process".to_string(),
            "P nginx: worker process".to_string(),
            "L tcp 00000000:1F90".to_string(),
            "F d 0755 0:0 4096 /app".to_string(),
            "F f 0644 0:0 3 /app/with space.txt".to_string(),
            "F l 0777 0:0 4 /app/link".to_string(),
            "T with space.txt".to_string(),
            format!("{hash}  /app/with space.txt"),
        ])
    }

    #[test]
    fn parses_every_record_type() {
        let fingerprint = Fingerprint::parse(&sample(HASH_A)).unwrap();
        assert_eq!(fingerprint.processes.get("nginx: worker process"), Some(&2));
        assert_eq!(fingerprint.processes.get("sleep infinity"), Some(&1));
        assert!(fingerprint.listeners.contains("tcp 00000000:1F90"));
        let file = &fingerprint.files["/app/with space.txt"];
        assert_eq!((file.kind, file.size, file.sha256.as_deref()), ('f', Some(3), Some(HASH_A)));
        assert_eq!(fingerprint.files["/app/link"].link_target.as_deref(), Some("with space.txt"));
        assert_eq!(fingerprint.files["/app"].size, None, "directory sizes are history, not state");
    }

    #[test]
    fn equal_states_have_no_differences_and_equal_digests() {
        let a = Fingerprint::parse(&sample(HASH_A)).unwrap();
        let b = Fingerprint::parse(&sample(HASH_A)).unwrap();
        assert!(a.diff(&b).is_empty());
        assert_eq!(a.digest(), b.digest());
    }

    #[test]
    fn content_change_missing_file_process_and_listener_are_reported() {
        let reference = Fingerprint::parse(&sample(HASH_A)).unwrap();
        let changed = Fingerprint::parse(&sample(HASH_B)).unwrap();
        let differences = changed.diff(&reference);
        assert_eq!(differences.len(), 1);
        assert_eq!(differences[0].key, "file:/app/with space.txt");
        assert_eq!(differences[0].detail, "content differs");
        let mut resized = changed.clone();
        let entry = resized.files.get_mut("/app/with space.txt").unwrap();
        (entry.size, entry.mode) = (Some(5), "0600".to_string());
        assert_eq!(
            resized.diff(&reference)[0].detail,
            "mode 0600 (expected 0644), size 5 (expected 3), content differs"
        );
        assert_ne!(changed.digest(), reference.digest());

        let fresh = Fingerprint::parse(&records(&[
            "P sleep infinity".to_string(),
            "F d 0755 0:0 4096 /app".to_string(),
            "F f 0644 0:0 1 /app/new".to_string(),
        ]))
        .unwrap();
        let keys: Vec<String> = fresh.diff(&reference).into_iter().map(|d| d.key).collect();
        assert_eq!(
            keys,
            [
                "file:/app/link",
                "file:/app/with space.txt",
                "file:/app/new",
                "process:nginx: worker process",
                "listen:tcp 00000000:1F90",
            ]
        );
    }

    #[test]
    fn unknown_records_are_errors() {
        let error = Fingerprint::parse(&records(&["X what".to_string()])).unwrap_err();
        assert!(error.to_string().contains("unknown record type"));
    }

    #[test]
    fn roots_are_deduplicated_and_nested_roots_dropped() {
        assert_eq!(Fingerprint::roots("/app"), ["/app", "/tmp", "/root"]);
        assert_eq!(Fingerprint::roots("/tmp/work"), ["/tmp", "/root"]);
        assert_eq!(Fingerprint::roots("/root/"), ["/root", "/tmp"]);
        assert_eq!(Fingerprint::roots("/"), ["/"]);
    }
}
