//! Which sandbox something in the store belongs to, and where the store keeps it.
//!
//! containerd scopes container ids by namespace: two namespaces (two tenants) may each run a
//! container `t2`. Everything crab keeps per sandbox is therefore keyed by the containerd
//! namespace *and* the id ([`SandboxKey`]), with the namespace as a directory level of its own:
//!
//! - `containers/<namespace>/<id>/HEAD`: where the sandbox's chain ends;
//! - `turns/<namespace>/<id>.jsonl` (and `<id>.busy`): its turn log;
//! - `sandboxes/<namespace>/<id>.json`: its saved OCI spec (for `crabctl recover` after a node loss);
//! - `full/<namespace>/<id>/`: the `every-turn` baseline's copies;
//! - `assembled/<namespace>/<id>/`: kept CRIU images (an accelerator).
//!
//! A chain a new container of the same namespace and id replaced is *retired*, not deleted: all
//! of the above move to `<id>@<generation>` (1, 2, ...), which GC's retention drops once newer
//! checkpoints of that id fill its window. `@` is in no container id, so no container can
//! name (or overwrite) a retired chain by its id.
//!
//! As a string a key is `<namespace>/<id>[@<generation>]`; without `<namespace>/` it is in
//! [`DEFAULT_NAMESPACE`] (crabctl's default, where stores of the layout before namespaces are
//! migrated to, see [`migrate_legacy_layout`]).

use std::fmt;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::error::{IoContext, Result};
use super::sys;

/// The namespace of a key written without one, crabctl's default (`CRAB_NS`), and the one a
/// store of the layout without namespaces is migrated to.
pub const DEFAULT_NAMESPACE: &str = "crab";
/// containerd's own bound on namespace names.
pub const MAX_NAMESPACE_LEN: usize = 76;
pub const MAX_ID_LEN: usize = 128;

/// A key that cannot name anything in the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("invalid containerd namespace {namespace:?}: {reason}")]
    Namespace { namespace: String, reason: String },
    #[error("invalid container id {0:?}: use 1-128 characters of [A-Za-z0-9_.-], not starting with '.'")]
    Id(String),
    #[error("invalid chain generation {0:?}: expected <id>@<n>, n a number from 1 without leading zeros")]
    Generation(String),
}

/// A sandbox's chain, turn log, saved spec and watch: containerd namespace, container id, and
/// the generation of a retired chain (None: the id's current one).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxKey {
    namespace: String,
    id: String,
    generation: Option<u32>,
}

/// Checks a containerd namespace name as containerd does (letters and digits, runs of them
/// joined by single `.`, `_` or `-`, at most 76 characters), so that it is one safe path
/// component: never empty, never `.` or `..`, never holding `/`.
pub fn validate_namespace(namespace: &str) -> std::result::Result<(), KeyError> {
    let bad = |reason: String| Err(KeyError::Namespace { namespace: namespace.to_owned(), reason });
    if namespace.is_empty() {
        return bad("it is empty".into());
    }
    if namespace.len() > MAX_NAMESPACE_LEN {
        return bad(format!("it is {} bytes long, more than {MAX_NAMESPACE_LEN}", namespace.len()));
    }
    if namespace.contains('/') {
        return bad("it contains '/'".into());
    }
    if namespace.contains("..") {
        return bad("it contains '..'".into());
    }
    if let Some(c) = namespace.chars().find(|c| !c.is_ascii_alphanumeric() && !matches!(c, '.' | '_' | '-')) {
        return bad(format!("it contains {c:?}; only [A-Za-z0-9._-] are allowed"));
    }
    let separator = |b: u8| matches!(b, b'.' | b'_' | b'-');
    let bytes = namespace.as_bytes();
    if separator(bytes[0])
        || separator(bytes[bytes.len() - 1])
        || bytes.windows(2).any(|w| separator(w[0]) && separator(w[1]))
    {
        return bad("it must start and end with a letter or digit, with single '.', '_' or '-' between them".into());
    }
    Ok(())
}

/// Checks a container id: one safe path component (containerd's ids are a subset).
pub fn validate_id(id: &str) -> std::result::Result<(), KeyError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok { Ok(()) } else { Err(KeyError::Id(id.to_owned())) }
}

impl SandboxKey {
    /// The current chain of container `id` in containerd namespace `namespace`.
    pub fn new(namespace: &str, id: &str) -> std::result::Result<Self, KeyError> {
        validate_namespace(namespace)?;
        validate_id(id)?;
        Ok(Self { namespace: namespace.to_owned(), id: id.to_owned(), generation: None })
    }

    /// Parses `[<namespace>/]<id>[@<generation>]`; without a namespace, `default_namespace`.
    pub fn parse_in(default_namespace: &str, text: &str) -> std::result::Result<Self, KeyError> {
        match text.split_once('/') {
            Some((namespace, name)) => Self::from_name(namespace, name),
            None => Self::from_name(default_namespace, text),
        }
    }

    /// The key of `<id>[@<generation>]` (no namespace in it: a `/` is an invalid id) in `namespace`.
    pub fn from_name(namespace: &str, name: &str) -> std::result::Result<Self, KeyError> {
        let (id, generation) = match name.split_once('@') {
            Some((id, generation)) => {
                let valid = !generation.starts_with('0') && generation.bytes().all(|b| b.is_ascii_digit());
                let number = generation.parse::<u32>().ok().filter(|_| valid);
                (id, Some(number.ok_or_else(|| KeyError::Generation(name.to_owned()))?))
            }
            None => (name, None),
        };
        let key = Self::new(namespace, id)?;
        Ok(Self { generation, ..key })
    }

    /// Parses `[<namespace>/]<id>[@<generation>]`, without a namespace in [`DEFAULT_NAMESPACE`].
    pub fn parse(text: &str) -> std::result::Result<Self, KeyError> {
        Self::parse_in(DEFAULT_NAMESPACE, text)
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The generation of a retired chain; None for the id's current one.
    pub fn generation(&self) -> Option<u32> {
        self.generation
    }

    /// The same id's chain retired as `generation`.
    pub fn retired(&self, generation: u32) -> Self {
        Self { generation: Some(generation.max(1)), ..self.clone() }
    }

    /// The id's current chain.
    pub fn current(&self) -> Self {
        Self { generation: None, ..self.clone() }
    }

    /// The name inside the namespace's directories: `<id>` or `<id>@<generation>`.
    pub fn name(&self) -> String {
        match self.generation {
            Some(generation) => format!("{}@{generation}", self.id),
            None => self.id.clone(),
        }
    }

    /// `<namespace>/<name>`: two components, both validated.
    pub fn rel_path(&self) -> PathBuf {
        Path::new(&self.namespace).join(self.name())
    }
}

impl fmt::Display for SandboxKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name())
    }
}

impl std::str::FromStr for SandboxKey {
    type Err = KeyError;

    fn from_str(text: &str) -> std::result::Result<Self, KeyError> {
        Self::parse(text)
    }
}

/// `turns/<namespace>/<name>.jsonl`.
pub fn turn_log_path(state_dir: &Path, key: &SandboxKey) -> PathBuf {
    state_dir.join("turns").join(&key.namespace).join(format!("{}.jsonl", key.name()))
}

/// `sandboxes/<namespace>/<name>.json`.
pub fn saved_spec_path(state_dir: &Path, key: &SandboxKey) -> PathBuf {
    state_dir.join("sandboxes").join(&key.namespace).join(format!("{}.json", key.name()))
}

/// [`saved_spec_path`] of the sandbox whose key reads `key` (`<namespace>/<id>`).
pub fn saved_spec_path_of(state_dir: &Path, key: &str) -> Result<PathBuf> {
    Ok(saved_spec_path(state_dir, &SandboxKey::parse(key)?))
}

/// `removed/<namespace>/<name>`: when a GC first saw that containerd no longer has the
/// container (unix seconds), see [`crate::ContainerCensus`].
pub fn removed_marker_path(state_dir: &Path, key: &SandboxKey) -> PathBuf {
    state_dir.join("removed").join(key.rel_path())
}

/// `full/<namespace>/<name>`.
pub fn full_checkpoints_dir(state_dir: &Path, key: &SandboxKey) -> PathBuf {
    state_dir.join("full").join(key.rel_path())
}

/// Every key with a directory or file under `dir/<namespace>/` whose name, less `suffix`, is a
/// key name; entries that are no key are left out.
pub(crate) fn keys_under(dir: &Path, suffix: &str) -> Result<Vec<SandboxKey>> {
    let mut keys = Vec::new();
    let namespaces = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(keys),
        Err(e) => return Err(e).io_ctx("read dir", dir),
    };
    for namespace in namespaces {
        let namespace = namespace.io_ctx("read dir", dir)?;
        let Ok(ns) = namespace.file_name().into_string() else { continue };
        if validate_namespace(&ns).is_err() || !namespace.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let ns_dir = namespace.path();
        for entry in fs::read_dir(&ns_dir).io_ctx("read dir", &ns_dir)? {
            let entry = entry.io_ctx("read dir", &ns_dir)?;
            let Ok(name) = entry.file_name().into_string() else { continue };
            let Some(name) = name.strip_suffix(suffix) else { continue };
            if name.contains('/') {
                continue;
            }
            if let Ok(key) = SandboxKey::from_name(&ns, name) {
                keys.push(key);
            }
        }
    }
    keys.sort();
    Ok(keys)
}

/// Name of the file that says the store has the namespaced layout.
const LAYOUT_FILE: &str = "layout";
const LAYOUT: &str = "namespaced 2\n";

/// Whether `entry` of per-sandbox directory `dir` is one of the layout before namespaces: a
/// chain's directory holding its HEAD, a turn log or spec file, a baseline directory holding
/// `turn-<n>` copies. A namespace's directory is none of these.
fn is_legacy_entry(dir: &str, entry: &Path) -> bool {
    let is_file = fs::symlink_metadata(entry).is_ok_and(|m| m.is_file());
    match dir {
        "containers" => fs::symlink_metadata(entry.join("HEAD")).is_ok_and(|m| m.is_file()),
        "turns" | "sandboxes" => is_file,
        "full" => fs::read_dir(entry).into_iter().flatten().flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("turn-") || name.starts_with(".turn-")
        }),
        _ => false,
    }
}

/// Moves a store of the layout before namespaces (`containers/<id>`, `turns/<id>.jsonl`,
/// `sandboxes/<id>.json`, `full/<id>`) to namespace [`DEFAULT_NAMESPACE`], once. Which
/// namespace an old chain's container lived in was never recorded; crabctl's default is where
/// the tools look first. Kept CRIU image copies of the old layout are dropped (they are only an
/// accelerator: the next restore reassembles the chunks). Idempotent and crash-safe: each old
/// entry moves by one rename, and the layout file is written once all have moved. Takes `lock`
/// (the store's lock file) exclusively.
pub(crate) fn migrate_legacy_layout(state_dir: &Path, lock: &Path, assembled: &Path) -> Result<()> {
    let marker = state_dir.join(LAYOUT_FILE);
    if marker.is_file() {
        return Ok(());
    }
    let lock_file =
        OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(lock).io_ctx("open", lock)?;
    sys::flock(&lock_file, true).io_ctx("flock", lock)?;
    if marker.is_file() {
        return Ok(());
    }
    let mut moved = 0usize;
    for name in ["containers", "turns", "sandboxes", "full"] {
        let dir = state_dir.join(name);
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        let aside = dir.join(format!(".legacy-{DEFAULT_NAMESPACE}"));
        let legacy: Vec<PathBuf> =
            entries.flatten().map(|e| e.path()).filter(|p| *p != aside && is_legacy_entry(name, p)).collect();
        let target = dir.join(DEFAULT_NAMESPACE);
        for from in legacy {
            let Some(entry_name) = from.file_name().map(|n| n.to_owned()) else { continue };
            if from == target {
                // An old container named like the namespace: out of the way first (moved below).
                fs::rename(&from, &aside).io_ctx("rename", &aside)?;
                continue;
            }
            sys::create_private_dir_all(&target).io_ctx("create", &target)?;
            let to = target.join(&entry_name);
            if to.exists() {
                tracing::warn!(from = %from.display(), to = %to.display(),
                    "store layout migration: the target exists, the old entry stays where it is");
                continue;
            }
            fs::rename(&from, &to).io_ctx("rename", &to)?;
            moved += 1;
        }
        // An old container named like the namespace, set aside above or by a run that stopped there.
        if aside.exists() && !target.join(DEFAULT_NAMESPACE).exists() {
            sys::create_private_dir_all(&target).io_ctx("create", &target)?;
            let to = target.join(DEFAULT_NAMESPACE);
            fs::rename(&aside, &to).io_ctx("rename", &to)?;
            moved += 1;
        }
        if target.is_dir() {
            sys::fsync_dir(&target).io_ctx("fsync", &target)?;
            sys::fsync_dir(&dir).io_ctx("fsync", &dir)?;
        }
    }
    if moved > 0 {
        if let Ok(entries) = fs::read_dir(assembled) {
            for entry in entries.flatten() {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        tracing::info!(state_dir = %state_dir.display(), moved, namespace = DEFAULT_NAMESPACE,
            "checkpoint store migrated to the namespaced layout");
    }
    let tmp = state_dir.join(format!(".{LAYOUT_FILE}.tmp"));
    let _ = fs::remove_file(&tmp);
    super::store::publish_file(&tmp, &marker, LAYOUT.as_bytes(), super::store::Durability::Flushed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_with_and_without_namespace_and_generation() {
        let key = SandboxKey::parse("t2").unwrap();
        assert_eq!((key.namespace(), key.id(), key.generation()), (DEFAULT_NAMESPACE, "t2", None));
        assert_eq!(key.to_string(), "crab/t2");
        let key = SandboxKey::parse("k8s.io/abc-1.x_y@3").unwrap();
        assert_eq!((key.namespace(), key.id(), key.generation()), ("k8s.io", "abc-1.x_y", Some(3)));
        assert_eq!(key.rel_path(), Path::new("k8s.io/abc-1.x_y@3"));
        assert_eq!(key.to_string().parse::<SandboxKey>().unwrap(), key, "a key's string parses back to it");
        assert_eq!(SandboxKey::parse_in("other", "t2").unwrap().to_string(), "other/t2");
        assert_eq!(key.current().name(), "abc-1.x_y");
        assert_eq!(key.current().retired(4).name(), "abc-1.x_y@4");
    }

    #[test]
    fn namespaces_are_one_safe_component() {
        for (ns, says) in [
            ("", "empty"),
            ("..", "'..'"),
            ("a..b", "'..'"),
            (".", "start and end"),
            ("a/b", "'/'"),
            ("-a", "start and end"),
            ("a-", "start and end"),
            ("a--b", "start and end"),
            ("a b", "' '"),
            ("a\0b", "'\\0'"),
            ("ümlaut", "'ü'"),
        ] {
            let err = validate_namespace(ns).unwrap_err().to_string();
            assert!(err.contains(&format!("{ns:?}")) && err.contains(says), "{ns:?}: {err}");
        }
        let long = "a".repeat(MAX_NAMESPACE_LEN + 1);
        assert!(validate_namespace(&long).unwrap_err().to_string().contains("more than 76"));
        for ns in ["crab", "k8s.io", "a", "A-1_b.c", &"a".repeat(MAX_NAMESPACE_LEN)] {
            validate_namespace(ns).unwrap();
        }
    }

    #[test]
    fn bad_keys_are_refused_with_what_is_wrong() {
        assert!(matches!(SandboxKey::parse("../x"), Err(KeyError::Namespace { .. })));
        assert!(matches!(SandboxKey::parse("a/b/c"), Err(KeyError::Id(id)) if id == "b/c"));
        assert!(matches!(SandboxKey::parse("ns/.."), Err(KeyError::Id(_))));
        assert!(matches!(SandboxKey::parse("ns/"), Err(KeyError::Id(_))));
        assert!(matches!(SandboxKey::parse("/t2"), Err(KeyError::Namespace { .. })));
        assert!(matches!(SandboxKey::parse(&"x".repeat(MAX_ID_LEN + 1)), Err(KeyError::Id(_))));
        for generation in ["t@", "t@0", "t@01", "t@-1", "t@1x", "t@99999999999", "t@1@2"] {
            assert!(matches!(SandboxKey::parse(generation), Err(KeyError::Generation(_))), "{generation}");
        }
        assert!(SandboxKey::new("ns", "a@1").is_err(), "an id never names a retired chain");
        assert!(matches!(SandboxKey::from_name("a", "b/c"), Err(KeyError::Id(_))), "a name never names a namespace");
        assert_eq!(SandboxKey::from_name("a", "c@2").unwrap().to_string(), "a/c@2");
    }

    #[test]
    fn paths_put_the_namespace_first_and_stay_apart() {
        let state = Path::new("/s");
        let a = SandboxKey::new("a", "t2").unwrap();
        let b = SandboxKey::new("b", "t2").unwrap();
        assert_eq!(turn_log_path(state, &a), Path::new("/s/turns/a/t2.jsonl"));
        assert_eq!(saved_spec_path(state, &b), Path::new("/s/sandboxes/b/t2.json"));
        assert_eq!(full_checkpoints_dir(state, &a.retired(2)), Path::new("/s/full/a/t2@2"));
        assert_ne!(turn_log_path(state, &a), turn_log_path(state, &b));
    }

    #[test]
    fn keys_under_lists_every_namespace_and_skips_what_is_no_key() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        for p in ["a/t1.jsonl", "a/t1@2.jsonl", "b/t1.jsonl", "b/notes.txt", "bad..ns/t.jsonl", "a/t@0.jsonl"] {
            fs::create_dir_all(dir.join(p).parent().unwrap()).unwrap();
            fs::write(dir.join(p), b"").unwrap();
        }
        fs::write(dir.join("stray.jsonl"), b"").unwrap();
        let keys: Vec<String> = keys_under(dir, ".jsonl").unwrap().iter().map(ToString::to_string).collect();
        assert_eq!(keys, ["a/t1", "a/t1@2", "b/t1"]);
    }

    #[test]
    fn a_store_without_namespaces_moves_to_the_default_namespace_once() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path();
        let write = |p: &str, data: &[u8]| {
            fs::create_dir_all(state.join(p).parent().unwrap()).unwrap();
            fs::write(state.join(p), data).unwrap();
        };
        write("containers/t2/HEAD", b"head");
        write("turns/t2.jsonl", b"log");
        write("sandboxes/t2.json", b"spec");
        write("full/t2/turn-1/x", b"full");
        write("assembled/t2/abc/pages.img", b"kept");
        let (lock, assembled) = (state.join("lock"), state.join("assembled"));
        migrate_legacy_layout(state, &lock, &assembled).unwrap();
        let read = |p: &str| fs::read(state.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
        assert_eq!(read("containers/crab/t2/HEAD"), b"head");
        assert_eq!(read("turns/crab/t2.jsonl"), b"log");
        assert_eq!(read("sandboxes/crab/t2.json"), b"spec");
        assert_eq!(read("full/crab/t2/turn-1/x"), b"full");
        assert!(!state.join("assembled/t2").exists(), "old kept copies are dropped");
        assert!(state.join("layout").is_file());
        // Once migrated, a namespace dir is never taken for an old entry again.
        migrate_legacy_layout(state, &lock, &assembled).unwrap();
        assert_eq!(read("containers/crab/t2/HEAD"), b"head");

        // A run that stopped half way, and entries of the new layout written before the
        // store was first opened: only old entries move, an old container named like the
        // namespace too.
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path();
        fs::create_dir_all(state.join("turns/crab")).unwrap();
        fs::write(state.join("turns/crab/t2.jsonl"), b"log2").unwrap();
        fs::write(state.join("turns/t3.jsonl"), b"log3").unwrap();
        fs::create_dir_all(state.join("containers/crab")).unwrap();
        fs::write(state.join("containers/crab/HEAD"), b"crab's head").unwrap();
        migrate_legacy_layout(state, &state.join("lock"), &state.join("assembled")).unwrap();
        assert_eq!(fs::read(state.join("turns/crab/t3.jsonl")).unwrap(), b"log3");
        assert_eq!(fs::read(state.join("turns/crab/t2.jsonl")).unwrap(), b"log2");
        assert!(!state.join("turns/crab/crab").exists());
        assert_eq!(fs::read(state.join("containers/crab/crab/HEAD")).unwrap(), b"crab's head");
    }
}
