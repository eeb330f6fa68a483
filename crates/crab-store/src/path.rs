//! Container paths as the store keeps them: normalised, relative to the container root, never
//! escaping it. Paths arrive from effects and manifests, both untrusted, so every one goes through
//! [`RelPath::parse`].

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::{CheckpointError, Result};

/// A normalised path inside a container root: no leading `/`, no empty, `.` or `..` components,
/// no NUL byte. The root itself is the empty path.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RelPath(Vec<u8>);

impl RelPath {
    pub fn root() -> Self {
        RelPath(Vec::new())
    }

    /// Normalises an absolute container path. `..` may only cancel a component before it: a `..`
    /// that would climb above the root is refused rather than clamped, because it means the
    /// producer of the path is confused or hostile.
    pub fn parse(raw: impl AsRef<[u8]>) -> Result<Self> {
        let raw = raw.as_ref();
        let shown = || String::from_utf8_lossy(raw).into_owned();
        if raw.first() != Some(&b'/') {
            return Err(CheckpointError::UnsafePath { path: shown(), reason: "not an absolute path" });
        }
        if raw.contains(&0) {
            return Err(CheckpointError::UnsafePath { path: shown(), reason: "contains a NUL byte" });
        }
        let mut parts: Vec<&[u8]> = Vec::new();
        for part in raw.split(|b| *b == b'/') {
            match part {
                b"" | b"." => {}
                b".." => {
                    if parts.pop().is_none() {
                        return Err(CheckpointError::UnsafePath { path: shown(), reason: "'..' escapes the root" });
                    }
                }
                _ => parts.push(part),
            }
        }
        Ok(RelPath(parts.join(&b'/')))
    }

    /// A single directory entry name, as read from the file system.
    pub(crate) fn join(&self, name: &[u8]) -> RelPath {
        debug_assert!(!name.is_empty() && !name.contains(&b'/') && name != b"." && name != b"..");
        if self.0.is_empty() {
            return RelPath(name.to_vec());
        }
        let mut joined = Vec::with_capacity(self.0.len() + 1 + name.len());
        joined.extend_from_slice(&self.0);
        joined.push(b'/');
        joined.extend_from_slice(name);
        RelPath(joined)
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The parent directory (relative, possibly the root) and the last component.
    /// `None` for the root itself.
    pub(crate) fn split_last(&self) -> Option<(&[u8], &[u8])> {
        if self.0.is_empty() {
            return None;
        }
        Some(match self.0.iter().rposition(|b| *b == b'/') {
            Some(i) => (&self.0[..i], &self.0[i + 1..]),
            None => (&[][..], &self.0[..]),
        })
    }

    /// True when `self` is a strict ancestor of `other`.
    pub fn is_ancestor_of(&self, other: &RelPath) -> bool {
        if self.0.is_empty() {
            return !other.0.is_empty();
        }
        other.0.len() > self.0.len() && other.0.starts_with(&self.0) && other.0[self.0.len()] == b'/'
    }

    /// Strict ancestors, nearest first, ending with the root.
    pub(crate) fn ancestors(&self) -> impl Iterator<Item = RelPath> + '_ {
        let mut cut = Some(self.0.len());
        std::iter::from_fn(move || {
            let end = cut?;
            if end == 0 {
                cut = None;
                return None;
            }
            let parent_end = self.0[..end].iter().rposition(|b| *b == b'/').unwrap_or(0);
            cut = Some(parent_end);
            Some(RelPath(self.0[..parent_end].to_vec()))
        })
    }

    /// The smallest and the first-past-the-end keys of all strict descendants in byte order,
    /// for range queries over sorted maps (`'0'` is the byte after `'/'`).
    pub(crate) fn descendant_bounds(&self) -> (RelPath, RelPath) {
        if self.0.is_empty() {
            return (RelPath(vec![0]), RelPath(vec![0xff; 4097]));
        }
        let mut lo = self.0.clone();
        lo.push(b'/');
        let mut hi = self.0.clone();
        hi.push(b'0');
        (RelPath(lo), RelPath(hi))
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/{}", String::from_utf8_lossy(&self.0))
    }
}

impl fmt::Debug for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// File names are bytes; JSON strings are UTF-8. Text stays readable, anything else is hex.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum TextOrHex {
    Text(String),
    Hex { hex: String },
}

impl TextOrHex {
    pub(crate) fn encode(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(s) => TextOrHex::Text(s.to_owned()),
            Err(_) => TextOrHex::Hex { hex: hex::encode(bytes) },
        }
    }

    pub(crate) fn decode<E: serde::de::Error>(self) -> Result<Vec<u8>, E> {
        match self {
            TextOrHex::Text(s) => Ok(s.into_bytes()),
            TextOrHex::Hex { hex } => hex::decode(hex).map_err(E::custom),
        }
    }
}

impl Serialize for RelPath {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut abs = Vec::with_capacity(self.0.len() + 1);
        abs.push(b'/');
        abs.extend_from_slice(&self.0);
        TextOrHex::encode(&abs).serialize(s)
    }
}

impl<'de> Deserialize<'de> for RelPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = TextOrHex::deserialize(d)?.decode()?;
        let parsed = RelPath::parse(&raw).map_err(serde::de::Error::custom)?;
        // A manifest holds normalised paths only; anything else was not written by this store.
        if raw.len() != parsed.0.len() + 1 {
            return Err(serde::de::Error::custom(format!("path {parsed} is not in normal form")));
        }
        Ok(parsed)
    }
}

/// Bytes such as symlink targets or xattr values, serialised like [`TextOrHex`].
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        TextOrHex::encode(&self.0).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Bytes(TextOrHex::deserialize(d)?.decode()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_and_refuses_escapes() {
        assert_eq!(RelPath::parse("/a//b/./c/").unwrap().as_bytes(), b"a/b/c");
        assert_eq!(RelPath::parse("/a/x/../b").unwrap().as_bytes(), b"a/b");
        assert!(RelPath::parse("/").unwrap().is_root());
        for bad in ["/../etc/passwd", "/a/../../etc", "relative/path", ""] {
            assert!(matches!(RelPath::parse(bad), Err(CheckpointError::UnsafePath { .. })), "{bad}");
        }
        assert!(RelPath::parse(b"/a\0b").is_err());
    }

    #[test]
    fn ancestry() {
        let a = RelPath::parse("/a").unwrap();
        let ab = RelPath::parse("/a/b").unwrap();
        let a_b = RelPath::parse("/a.b").unwrap();
        assert!(a.is_ancestor_of(&ab));
        assert!(!a.is_ancestor_of(&a_b));
        assert!(!a.is_ancestor_of(&a));
        assert!(RelPath::root().is_ancestor_of(&a));
        let ancestors: Vec<String> = RelPath::parse("/x/y/z").unwrap().ancestors().map(|p| p.to_string()).collect();
        assert_eq!(ancestors, ["/x/y", "/x", "/"]);
        let (lo, hi) = a.descendant_bounds();
        assert!(lo <= ab && ab < hi && !(lo <= a_b && a_b < hi));
    }

    #[test]
    fn serde_round_trip_and_refusal() {
        let p = RelPath::parse(b"/dir/\xffname").unwrap();
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<RelPath>(&json).unwrap(), p);
        assert!(serde_json::from_str::<RelPath>("\"/a/../../etc\"").is_err());
        assert!(serde_json::from_str::<RelPath>("\"/a/./b\"").is_err());
    }
}
