//! Manifests (one per turn) and snapshots (a folded chain prefix written by GC), and the sealed
//! JSON envelope both are stored in: `{"sha256": <hex of body bytes>, "body": <body>}`.
//! The hash covers the exact body bytes on disk, so verification needs no canonical re-encoding.

use std::collections::BTreeMap;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::error::{CheckpointError, Result};
use super::path::{Bytes, RelPath};
use super::store::Digest;

pub const MANIFEST_VERSION: u32 = 1;

/// What a turn changed, as classified by the inspector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnClass {
    /// Nothing changed: the checkpoint only points at its parent.
    Clean,
    /// Files changed: an fs delta.
    Fs,
    /// Processes changed: a CRIU image set plus an fs delta.
    Proc,
}

/// Ownership, permissions, times and extended attributes of a file system node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// Permission bits including setuid/setgid/sticky (`mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, Bytes>,
}

impl Meta {
    pub(crate) fn mtime(&self) -> (i64, u32) {
        (self.mtime_sec, self.mtime_nsec)
    }
}

/// A range of a sparse file that holds data: `(offset, length)` in bytes, stored as a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent(pub u64, pub u64);

impl Extent {
    pub fn offset(&self) -> u64 {
        self.0
    }

    pub fn len(&self) -> u64 {
        self.1
    }

    pub fn end(&self) -> u64 {
        self.0.saturating_add(self.1)
    }
}

/// The state of one path after a turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FsNode {
    /// A regular file of `size` bytes. Without `extents` the blob is its whole content; with
    /// them (a sparse file) the blob holds only those byte ranges, back to back, and the rest
    /// of the file is holes.
    File {
        meta: Meta,
        blob: Digest,
        size: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        extents: Option<Vec<Extent>>,
    },
    /// `complete`: the directory was (re)created, and the entries below it in the same delta are
    /// its whole content. Otherwise only its own metadata changed.
    Dir {
        meta: Meta,
        #[serde(default)]
        complete: bool,
    },
    Symlink {
        meta: Meta,
        target: Bytes,
    },
    /// Another name of a file captured earlier in the same delta. The content is recorded too, so
    /// a restore can fall back to a copy when the link source is gone.
    Hardlink {
        meta: Meta,
        link_to: RelPath,
        blob: Digest,
        size: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        extents: Option<Vec<Extent>>,
    },
    /// FIFO, socket or device node: `meta.mode` keeps the permission bits, `file_type` the
    /// `S_IFMT` bits.
    Special {
        meta: Meta,
        file_type: u32,
        rdev: u64,
    },
    /// The path does not exist.
    Whiteout,
}

impl FsNode {
    pub fn meta(&self) -> Option<&Meta> {
        match self {
            FsNode::File { meta, .. }
            | FsNode::Dir { meta, .. }
            | FsNode::Symlink { meta, .. }
            | FsNode::Hardlink { meta, .. }
            | FsNode::Special { meta, .. } => Some(meta),
            FsNode::Whiteout => None,
        }
    }

    pub fn blob(&self) -> Option<&Digest> {
        match self {
            FsNode::File { blob, .. } | FsNode::Hardlink { blob, .. } => Some(blob),
            _ => None,
        }
    }

    /// True when applying this node replaces whatever subtree was at its path.
    pub(crate) fn replaces_subtree(&self) -> bool {
        !matches!(self, FsNode::Dir { complete: false, .. })
    }

    pub(crate) fn is_dir(&self) -> bool {
        matches!(self, FsNode::Dir { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEntry {
    pub path: RelPath,
    #[serde(flatten)]
    pub node: FsNode,
}

/// How one CRIU image file is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "storage", rename_all = "snake_case")]
pub enum ImageContent {
    Whole {
        blob: Digest,
    },
    /// Fixed-size chunks; `chunk_list` is a blob holding the 32-byte digests of the chunks in
    /// order, so an unchanged page file costs no manifest bytes either.
    Chunked {
        chunk_size: u32,
        chunks: u64,
        chunk_list: Digest,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageFile {
    pub name: String,
    pub mode: u32,
    pub size: u64,
    #[serde(flatten)]
    pub content: ImageContent,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSet {
    pub files: Vec<ImageFile>,
}

impl ImageSet {
    /// The bytes of the image files together: what an assembled copy of the set takes.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    /// The container that wrote this checkpoint (forks share it).
    pub container: String,
    pub turn: u64,
    pub class: TurnClass,
    pub parent: Option<ParentRef>,
    pub created_unix_ms: u64,
    #[serde(default)]
    pub fs_delta: Vec<FsEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<ImageSet>,
    /// The state of each shell session crab could ask at this turn's end (see [`ShellState`]):
    /// on a process turn, what its images hold; on a later turn, what to bring those images'
    /// shells to. Listed only where it changed since the session's last listing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shells: Vec<ShellState>,
    /// The pid the container's next process gets after this turn, as the inspector saw the
    /// turn's forks numbered in the container's pid namespace (None when it saw none). CRIU
    /// restores every pid but not that cursor, and only a process dump reads it (it is beside
    /// its images): a restore of a later file-system turn sets it from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_pid: Option<u32>,
}

/// Variables bash keeps itself (dynamic, or mirrors of other state, or the pid of its parent,
/// which is the order processes happened to start in): a shell state neither compares nor
/// restores them.
pub const BASH_OWN_VARIABLES: &[&str] = &[
    "_",
    "BASH_ALIASES",
    "BASH_ARGC",
    "BASH_ARGV",
    "BASH_ARGV0",
    "BASH_CMDS",
    "BASH_COMMAND",
    "BASH_LINENO",
    "BASH_SOURCE",
    "BASH_SUBSHELL",
    "BASHOPTS",
    "BASHPID",
    "COMP_WORDBREAKS",
    "DIRSTACK",
    "EPOCHREALTIME",
    "EPOCHSECONDS",
    "FUNCNAME",
    "GROUPS",
    "HISTCMD",
    "LINENO",
    "PIPESTATUS",
    "PPID",
    "RANDOM",
    "SECONDS",
    "SHELLOPTS",
    "SRANDOM",
];

/// The name a `declare -p` line declares (`declare -ax NAME=...` → `NAME`).
pub fn declared_name(declaration: &str) -> &str {
    let rest = declaration.strip_prefix("declare ").unwrap_or(declaration);
    let rest = rest.split_once(' ').map_or("", |(_, name)| name);
    rest.split('=').next().unwrap_or(rest)
}

/// What a `bash` session fed through its stdin keeps in its memory beyond its process image's
/// files: the answers of its own builtins at its prompt, asked by the shim between two inputs.
/// The store keeps it as data; crab-engine's `shell` module asks for it and turns two of them
/// into the input that brings one to the other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShellState {
    /// The exec whose process the shell is (a restored session is re-attached by it).
    pub exec_id: String,
    /// `$?` at the prompt.
    pub status: i32,
    /// `$_` at the prompt.
    pub last_arg: String,
    /// `$PWD`.
    pub cwd: String,
    /// `$-`.
    pub flags: String,
    /// `set +o`: every option, as commands that set it.
    pub set_options: String,
    /// `shopt -p`.
    pub shopt: String,
    /// `declare -p`, one declaration each, without the variables bash keeps itself (see the
    /// engine's list) and without crab's own.
    pub variables: Vec<String>,
    /// `declare -f`.
    pub functions: String,
    /// `alias -p`.
    pub aliases: String,
    /// `trap -p`.
    pub traps: String,
    /// `dirs -l -p`.
    pub dirs: String,
    /// `umask`.
    pub umask: String,
    /// `jobs -l`.
    pub jobs: String,
    /// `ulimit -S -a` then `ulimit -H -a`: the shell's own resource limits.
    #[serde(default)]
    pub limits: String,
    /// `enable -n`: builtins it disabled.
    #[serde(default)]
    pub disabled: String,
    /// A listing made relative to the same session's listing of turn `base_turn` (its process
    /// checkpoint): the fields named in `inherited` are left out here, and are that listing's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_turn: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inherited: Vec<String>,
}

/// The fields of a [`ShellState`] a listing may leave to its base's: those that seldom change
/// from turn to turn and make up most of an answer.
const INHERITABLE: &[&str] = &[
    "flags",
    "set_options",
    "shopt",
    "variables",
    "functions",
    "aliases",
    "traps",
    "dirs",
    "umask",
    "limits",
    "disabled",
];

impl ShellState {
    fn field(&mut self, name: &str) -> Option<FieldMut<'_>> {
        Some(match name {
            "flags" => FieldMut::Text(&mut self.flags),
            "set_options" => FieldMut::Text(&mut self.set_options),
            "shopt" => FieldMut::Text(&mut self.shopt),
            "variables" => FieldMut::Lines(&mut self.variables),
            "functions" => FieldMut::Text(&mut self.functions),
            "aliases" => FieldMut::Text(&mut self.aliases),
            "traps" => FieldMut::Text(&mut self.traps),
            "dirs" => FieldMut::Text(&mut self.dirs),
            "umask" => FieldMut::Text(&mut self.umask),
            "limits" => FieldMut::Text(&mut self.limits),
            "disabled" => FieldMut::Text(&mut self.disabled),
            _ => return None,
        })
    }

    /// This state as a listing relative to `base`, the listing of turn `base_turn`: what equals
    /// the base's is left out (see [`ShellState::inherited`]).
    pub fn relative_to(&self, base: &ShellState, base_turn: u64) -> ShellState {
        let mut listing = ShellState { base_turn: Some(base_turn), inherited: Vec::new(), ..self.clone() };
        let mut base = base.clone();
        for name in INHERITABLE {
            let (Some(own), Some(theirs)) = (listing.field(name), base.field(name)) else { continue };
            if own.same_as(&theirs) {
                own.clear();
                listing.inherited.push(name.to_string());
            }
        }
        listing
    }

    /// The whole state of a listing made by [`relative_to`](Self::relative_to), given the
    /// listing of its base turn (None when `base` is not that listing, or itself relative).
    pub fn completed(&self, base: &ShellState, base_turn: u64) -> Option<ShellState> {
        if self.base_turn.is_none() {
            return Some(self.clone());
        }
        if self.base_turn != Some(base_turn) || base.base_turn.is_some() || base.exec_id != self.exec_id {
            return None;
        }
        let mut whole = ShellState { base_turn: None, inherited: Vec::new(), ..self.clone() };
        let mut base = base.clone();
        for name in &self.inherited {
            let (Some(own), Some(theirs)) = (whole.field(name), base.field(name)) else { return None };
            own.take_from(theirs);
        }
        Some(whole)
    }
}

enum FieldMut<'a> {
    Text(&'a mut String),
    Lines(&'a mut Vec<String>),
}

impl FieldMut<'_> {
    fn same_as(&self, other: &FieldMut<'_>) -> bool {
        match (self, other) {
            (FieldMut::Text(a), FieldMut::Text(b)) => a == b,
            (FieldMut::Lines(a), FieldMut::Lines(b)) => a == b,
            _ => false,
        }
    }

    fn clear(self) {
        match self {
            FieldMut::Text(t) => t.clear(),
            FieldMut::Lines(l) => l.clear(),
        }
    }

    fn take_from(self, other: FieldMut<'_>) {
        match (self, other) {
            (FieldMut::Text(a), FieldMut::Text(b)) => *a = std::mem::take(b),
            (FieldMut::Lines(a), FieldMut::Lines(b)) => *a = std::mem::take(b),
            _ => {}
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentRef {
    pub manifest: Digest,
    pub turn: u64,
}

/// The folded state of a chain up to and including manifest `at`: what GC leaves behind when it
/// drops the manifests below the retention window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub version: u32,
    pub at: Digest,
    pub turn: u64,
    pub entries: Vec<FsEntry>,
    /// The newest image set at or below `at`, with the turn that wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<(u64, ImageSet)>,
    /// The shell states a restore at `at` needs, with the turn that listed each: those of
    /// the images' turn and the newest of each session.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shells: Vec<(u64, ShellState)>,
    /// The newest [`Manifest::next_pid`] at or below `at` and above the images' turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_pid: Option<u32>,
}

/// Every blob a list of entries and an image set reference, except the chunks behind chunk lists.
pub(crate) fn direct_blobs<'a>(
    entries: &'a [FsEntry],
    images: Option<&'a ImageSet>,
) -> impl Iterator<Item = &'a Digest> + 'a {
    let entry_blobs = entries.iter().filter_map(|e| e.node.blob());
    let image_blobs = images.into_iter().flat_map(|set| set.files.iter()).map(|f| match &f.content {
        ImageContent::Whole { blob } => blob,
        ImageContent::Chunked { chunk_list, .. } => chunk_list,
    });
    entry_blobs.chain(image_blobs)
}

#[derive(Serialize)]
struct SealOut<'a> {
    sha256: Digest,
    body: &'a RawValue,
}

#[derive(Deserialize)]
struct SealIn<'a> {
    sha256: Digest,
    #[serde(borrow)]
    body: &'a RawValue,
}

/// Encodes `body` in a sealed envelope; returns the body digest (the object's id) and the bytes.
pub(crate) fn seal<T: Serialize>(body: &T, what: &'static str) -> Result<(Digest, Vec<u8>)> {
    let json = |source| CheckpointError::Json { what, source };
    let raw = serde_json::value::to_raw_value(body).map_err(json)?;
    let sha256 = Digest::of(raw.get().as_bytes());
    let bytes = serde_json::to_vec(&SealOut { sha256, body: &raw }).map_err(json)?;
    Ok((sha256, bytes))
}

/// Verifies and decodes a sealed envelope read from `path`. When `expected` is given the body
/// must also hash to it (the id the reader followed to get here).
pub(crate) fn unseal<T: DeserializeOwned>(bytes: &[u8], path: &Path, expected: Option<&Digest>) -> Result<(Digest, T)> {
    let corrupt = |reason: String| CheckpointError::CorruptManifest { path: path.to_owned(), reason };
    let sealed: SealIn<'_> =
        serde_json::from_slice(bytes).map_err(|e| corrupt(format!("not a sealed envelope: {e}")))?;
    let actual = Digest::of(sealed.body.get().as_bytes());
    if actual != sealed.sha256 {
        return Err(corrupt(format!("body hashes to {actual}, envelope says {}", sealed.sha256)));
    }
    if let Some(expected) = expected
        && actual != *expected
    {
        return Err(corrupt(format!("body hashes to {actual}, expected {expected}")));
    }
    #[derive(Deserialize)]
    struct Versioned {
        version: u32,
    }
    let v: Versioned = serde_json::from_str(sealed.body.get()).map_err(|e| corrupt(format!("no version: {e}")))?;
    if v.version != MANIFEST_VERSION {
        return Err(CheckpointError::UnsupportedManifestVersion {
            path: path.to_owned(),
            found: v.version,
            supported: MANIFEST_VERSION,
        });
    }
    let body = serde_json::from_str(sealed.body.get()).map_err(|e| corrupt(e.to_string()))?;
    Ok((actual, body))
}

/// Image file names are single plain components: they are joined to a restore directory.
pub(crate) fn valid_image_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let meta = Meta { mode: 0o644, uid: 1, gid: 2, mtime_sec: 3, mtime_nsec: 4, xattrs: BTreeMap::new() };
        Manifest {
            version: MANIFEST_VERSION,
            container: "c1".into(),
            turn: 2,
            class: TurnClass::Fs,
            parent: Some(ParentRef { manifest: Digest::of(b"p"), turn: 1 }),
            created_unix_ms: 5,
            fs_delta: vec![
                FsEntry {
                    path: RelPath::parse("/a").unwrap(),
                    node: FsNode::File { meta: meta.clone(), blob: Digest::of(b"x"), size: 1, extents: None },
                },
                FsEntry { path: RelPath::parse("/b").unwrap(), node: FsNode::Whiteout },
                FsEntry {
                    path: RelPath::parse("/c").unwrap(),
                    node: FsNode::Symlink { meta, target: Bytes(b"/etc/\xff".to_vec()) },
                },
            ],
            images: None,
            shells: Vec::new(),
            next_pid: Some(54),
        }
    }

    #[test]
    fn seal_round_trip_and_tamper_detection() {
        let m = sample();
        let (id, bytes) = seal(&m, "manifest").unwrap();
        let (id2, back): (Digest, Manifest) = unseal(&bytes, Path::new("m.json"), Some(&id)).unwrap();
        assert_eq!((id2, &back), (id, &m));

        let tampered = String::from_utf8(bytes.clone()).unwrap().replace("\"turn\":2", "\"turn\":9");
        let err = unseal::<Manifest>(tampered.as_bytes(), Path::new("m.json"), None).unwrap_err();
        assert!(matches!(err, CheckpointError::CorruptManifest { .. }), "{err}");
        let other = Digest::of(b"other");
        assert!(unseal::<Manifest>(&bytes, Path::new("m.json"), Some(&other)).is_err());
    }

    #[test]
    fn newer_version_is_refused() {
        let mut m = sample();
        m.version = MANIFEST_VERSION + 1;
        let (_, bytes) = seal(&m, "manifest").unwrap();
        let err = unseal::<Manifest>(&bytes, Path::new("m.json"), None).unwrap_err();
        assert!(matches!(err, CheckpointError::UnsupportedManifestVersion { found: 2, .. }), "{err}");
    }

    #[test]
    fn escaping_path_in_manifest_is_refused() {
        let (_, bytes) = seal(&sample(), "manifest").unwrap();
        let evil = String::from_utf8(bytes).unwrap();
        let body_start = evil.find("\"body\":").unwrap() + 7;
        let body = &evil[body_start..evil.len() - 1];
        let evil_body = body.replace("\"/b\"", "\"/../../etc/shadow\"");
        let resealed = format!("{{\"sha256\":\"{}\",\"body\":{evil_body}}}", Digest::of(evil_body.as_bytes()));
        let err = unseal::<Manifest>(resealed.as_bytes(), Path::new("m.json"), None).unwrap_err();
        assert!(err.to_string().contains("escapes the root"), "{err}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]

    /// One changed byte anywhere in a sealed manifest is refused, or (where JSON does not care,
    /// such as white space between envelope fields) reads back the very same manifest.
    #[test]
    fn a_tampered_manifest_is_refused_or_unchanged(flip in proptest::prelude::any::<proptest::sample::Index>(), xor in 1u8..=255) {
        let manifest = sample();
        let (digest, mut bytes) = seal(&manifest, "manifest").expect("seal");
        let at = flip.index(bytes.len());
        bytes[at] ^= xor;
        match unseal::<Manifest>(&bytes, Path::new("m"), Some(&digest)) {
            Ok((d, read)) => {
                proptest::prop_assert_eq!(d, digest);
                proptest::prop_assert_eq!(read, manifest);
            }
            Err(e) => proptest::prop_assert!(!e.to_string().is_empty()),
        }
    }

    }
}
