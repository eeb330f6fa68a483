//! Crab's checkpoint artifact in an OCI registry (see ARTIFACT.md beside Cargo.toml): one
//! repository per sandbox, `<prefix>/<namespace>/<sandbox>`, one image manifest per
//! checkpointed turn tagged `turn-<N>`, with crab's own artifact and media types.

use std::collections::BTreeMap;

use oci_client::manifest::{OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest};

use crate::digest::Digest;
use crate::error::{RemoteError, Result};

/// `artifactType` of the checkpoint manifests this build writes: its packs' indexes travel in
/// [`PACK_INDEXES_MEDIA_TYPE`] blobs, one per push.
pub const ARTIFACT_TYPE: &str = "application/vnd.crab.checkpoint.v2";
/// `artifactType` of the manifests of earlier builds, still read: one index blob per pack.
pub const ARTIFACT_TYPE_V1: &str = "application/vnd.crab.checkpoint.v1";
/// The config blob: crab's turn manifest, the bytes the store wrote (its sealed JSON).
pub const TURN_MEDIA_TYPE: &str = "application/vnd.crab.checkpoint.turn.v1+json";
/// A pack of objects (see [`crate::pack`]).
pub const PACK_MEDIA_TYPE: &str = "application/vnd.crab.checkpoint.pack.v1";
/// The index of one pack; its descriptor names the pack in [`ANNOTATION_PACK`].
pub const PACK_INDEX_MEDIA_TYPE: &str = "application/vnd.crab.checkpoint.pack-index.v1";
/// The indexes of the packs one push made (see [`crate::pack`]); the packs they describe are
/// named inside, so a reader learns which packs they cover only once it has read them.
pub const PACK_INDEXES_MEDIA_TYPE: &str = "application/vnd.crab.checkpoint.pack-indexes.v1";
/// One object stored as it is (a large file of an fs delta): its OCI digest is the object's
/// digest in crab's store.
pub const BLOB_MEDIA_TYPE: &str = "application/vnd.crab.checkpoint.blob.v1";

pub const ANNOTATION_PACK: &str = "io.crab.pack";
pub const ANNOTATION_NAMESPACE: &str = "io.crab.namespace";
pub const ANNOTATION_SANDBOX: &str = "io.crab.sandbox";
pub const ANNOTATION_TURN: &str = "io.crab.turn";
pub const ANNOTATION_PARENT_TURN: &str = "io.crab.parent-turn";
pub const ANNOTATION_CREATED: &str = "org.opencontainers.image.created";
/// The image the sandbox runs (as containerd names it), for a restore on a node where
/// containerd never knew the sandbox.
pub const ANNOTATION_IMAGE: &str = "io.crab.image";
/// The digest of the sandbox's saved OCI runtime spec, one of the turn's objects.
pub const ANNOTATION_SPEC: &str = "io.crab.spec";

/// Annotations the artifact itself sets; every other one is carried in [`Checkpoint::extra`].
const OWN_ANNOTATIONS: [&str; 5] =
    [ANNOTATION_NAMESPACE, ANNOTATION_SANDBOX, ANNOTATION_TURN, ANNOTATION_PARENT_TURN, ANNOTATION_CREATED];
/// Bound on the bytes of the extra annotations of one manifest.
pub const MAX_EXTRA_ANNOTATION_BYTES: usize = 16 << 10;

/// The largest manifest accepted from a registry (distribution's own limit is 4 MiB).
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// The largest turn manifest (config blob) accepted.
pub const MAX_TURN_MANIFEST_BYTES: u64 = 64 << 20;

/// `turn-<N>`, the tag of a turn's manifest.
pub fn turn_tag(turn: u64) -> String {
    format!("turn-{turn}")
}

/// The turn a tag names, if it is a turn tag.
pub fn parse_turn_tag(tag: &str) -> Option<u64> {
    let n = tag.strip_prefix("turn-")?;
    if n.is_empty() || (n.len() > 1 && n.starts_with('0')) || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// A containerd namespace or id as one component of a repository path. OCI allows only
/// `[a-z0-9]+([._]|__|-+)[a-z0-9]+...` there; containerd allows upper case too. A name that is
/// already valid stays as it is; any other becomes `x--` and the hex of its bytes. containerd
/// names never hold `--` (their separators are single), so the two forms cannot meet.
pub fn path_component(name: &str) -> String {
    if valid_component(name) { name.to_owned() } else { format!("x--{}", hex::encode(name.as_bytes())) }
}

/// The name a repository path component stands for (the inverse of [`path_component`]).
pub fn name_of_component(component: &str) -> Option<String> {
    match component.strip_prefix("x--") {
        Some(hex) => String::from_utf8(hex::decode(hex).ok()?).ok().filter(|n| !valid_component(n)),
        None => valid_component(component).then(|| component.to_owned()),
    }
}

fn valid_component(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            i += 1;
            continue;
        }
        // A separator run: '.', '_', '__', or any number of '-'.
        let start = i;
        while i < b.len() && matches!(b[i], b'.' | b'_' | b'-') {
            i += 1;
        }
        let sep = &s[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || (!sep.is_empty() && sep.bytes().all(|c| c == b'-'));
        if !ok {
            return false;
        }
    }
    true
}

/// A sandbox's repository: `<prefix>/<namespace>/<sandbox>`.
pub fn repository(prefix_path: &str, namespace: &str, sandbox: &str) -> String {
    let mut repo = String::new();
    if !prefix_path.is_empty() {
        repo.push_str(prefix_path);
        repo.push('/');
    }
    repo.push_str(&path_component(namespace));
    repo.push('/');
    repo.push_str(&path_component(sandbox));
    repo
}

/// One blob of a checkpoint manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layer {
    Pack { digest: Digest, size: u64 },
    PackIndex { digest: Digest, size: u64, pack: Digest },
    PackIndexes { digest: Digest, size: u64 },
    Blob { digest: Digest, size: u64 },
}

impl Layer {
    pub fn digest(&self) -> Digest {
        match self {
            Layer::Pack { digest, .. }
            | Layer::PackIndex { digest, .. }
            | Layer::PackIndexes { digest, .. }
            | Layer::Blob { digest, .. } => *digest,
        }
    }

    pub fn size(&self) -> u64 {
        match self {
            Layer::Pack { size, .. }
            | Layer::PackIndex { size, .. }
            | Layer::PackIndexes { size, .. }
            | Layer::Blob { size, .. } => *size,
        }
    }

    pub fn media_type(&self) -> &'static str {
        match self {
            Layer::Pack { .. } => PACK_MEDIA_TYPE,
            Layer::PackIndex { .. } => PACK_INDEX_MEDIA_TYPE,
            Layer::PackIndexes { .. } => PACK_INDEXES_MEDIA_TYPE,
            Layer::Blob { .. } => BLOB_MEDIA_TYPE,
        }
    }

    fn descriptor(&self) -> OciDescriptor {
        let annotations = match self {
            Layer::PackIndex { pack, .. } => Some(BTreeMap::from([(ANNOTATION_PACK.to_owned(), pack.to_oci())])),
            _ => None,
        };
        OciDescriptor {
            media_type: self.media_type().to_owned(),
            digest: self.digest().to_oci(),
            size: self.size() as i64,
            urls: None,
            annotations,
            artifact_type: None,
        }
    }
}

/// What a checkpoint manifest says, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub namespace: String,
    pub sandbox: String,
    pub turn: u64,
    pub parent_turn: Option<u64>,
    pub created: String,
    pub turn_manifest: Digest,
    pub turn_manifest_size: u64,
    pub layers: Vec<Layer>,
    /// Further annotations of the manifest ([`ANNOTATION_IMAGE`], [`ANNOTATION_SPEC`], ...).
    pub extra: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The manifest's bytes, as pushed (serde_json of the OCI struct: one encoding, one digest).
    pub fn encode(&self) -> Vec<u8> {
        let mut annotations = self.extra.clone();
        annotations.extend([
            (ANNOTATION_NAMESPACE.to_owned(), self.namespace.clone()),
            (ANNOTATION_SANDBOX.to_owned(), self.sandbox.clone()),
            (ANNOTATION_TURN.to_owned(), self.turn.to_string()),
            (ANNOTATION_CREATED.to_owned(), self.created.clone()),
        ]);
        if let Some(parent) = self.parent_turn {
            annotations.insert(ANNOTATION_PARENT_TURN.to_owned(), parent.to_string());
        }
        let manifest = OciImageManifest {
            schema_version: 2,
            media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_owned()),
            config: OciDescriptor {
                media_type: TURN_MEDIA_TYPE.to_owned(),
                digest: self.turn_manifest.to_oci(),
                size: self.turn_manifest_size as i64,
                urls: None,
                annotations: None,
                artifact_type: None,
            },
            layers: self.layers.iter().map(Layer::descriptor).collect(),
            subject: None,
            artifact_type: Some(ARTIFACT_TYPE.to_owned()),
            annotations: Some(annotations),
        };
        serde_json::to_vec(&manifest).expect("an OCI manifest always serializes")
    }

    /// Parses a manifest pulled for `reference`, refusing anything that is not a crab
    /// checkpoint of this format.
    pub fn decode(bytes: &[u8], reference: &str) -> Result<Self> {
        let bad = |reason: String| RemoteError::BadManifest {
            reference: reference.to_owned(),
            what: "manifest".into(),
            reason,
        };
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Probe {
            #[serde(default)]
            media_type: Option<String>,
            #[serde(default)]
            artifact_type: Option<String>,
            #[serde(default)]
            config: Option<ProbeConfig>,
        }
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct ProbeConfig {
            media_type: String,
        }
        let probe: Probe = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        // The artifact type first: an image or another tool's artifact under a crab tag is
        // named as such, not as a parse error.
        let found = probe.artifact_type.or(probe.config.map(|c| c.media_type)).unwrap_or_default();
        if found != ARTIFACT_TYPE && found != ARTIFACT_TYPE_V1 {
            return Err(RemoteError::WrongArtifactType {
                reference: reference.to_owned(),
                found,
                expected: ARTIFACT_TYPE,
            });
        }
        if probe.media_type.as_deref() != Some(OCI_IMAGE_MEDIA_TYPE) {
            return Err(bad(format!("media type {:?}, expected {OCI_IMAGE_MEDIA_TYPE}", probe.media_type)));
        }
        let manifest: OciImageManifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if manifest.config.media_type != TURN_MEDIA_TYPE {
            return Err(bad(format!("config media type {:?}, expected {TURN_MEDIA_TYPE}", manifest.config.media_type)));
        }
        let size = |d: &OciDescriptor| u64::try_from(d.size).map_err(|_| bad(format!("negative size of {}", d.digest)));
        let digest = |d: &OciDescriptor| Digest::from_oci(&d.digest).map_err(|e| bad(e.to_string()));
        let annotations = manifest.annotations.clone().unwrap_or_default();
        let annotation = |key: &str| annotations.get(key).cloned().ok_or_else(|| bad(format!("no {key} annotation")));
        let turn =
            annotation(ANNOTATION_TURN)?.parse().map_err(|_| bad(format!("{ANNOTATION_TURN} is not a number")))?;
        let parent_turn = match annotations.get(ANNOTATION_PARENT_TURN) {
            Some(p) => Some(p.parse().map_err(|_| bad(format!("{ANNOTATION_PARENT_TURN} is not a number")))?),
            None => None,
        };
        let turn_manifest_size = size(&manifest.config)?;
        if turn_manifest_size > MAX_TURN_MANIFEST_BYTES {
            return Err(bad(format!("turn manifest of {turn_manifest_size} bytes")));
        }
        let mut layers = Vec::with_capacity(manifest.layers.len());
        for d in &manifest.layers {
            let (digest, size) = (digest(d)?, size(d)?);
            // A pull buffers a pack or an index whole before its digest is checked: no reader
            // accepts one larger than these, so none is fetched.
            let limit = match d.media_type.as_str() {
                PACK_MEDIA_TYPE => Some(crate::pack::MAX_PACK_BYTES),
                PACK_INDEX_MEDIA_TYPE | PACK_INDEXES_MEDIA_TYPE => Some(crate::pack::MAX_INDEXES_BYTES),
                _ => None,
            };
            if let Some(limit) = limit.filter(|limit| size > *limit) {
                return Err(bad(format!(
                    "layer {digest} ({}) has {size} bytes, over the limit of {limit}",
                    d.media_type
                )));
            }
            layers.push(match d.media_type.as_str() {
                PACK_MEDIA_TYPE => Layer::Pack { digest, size },
                PACK_INDEX_MEDIA_TYPE => {
                    let pack = d
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(ANNOTATION_PACK))
                        .ok_or_else(|| bad(format!("pack index {digest} names no pack")))?;
                    Layer::PackIndex { digest, size, pack: Digest::from_oci(pack).map_err(|e| bad(e.to_string()))? }
                }
                PACK_INDEXES_MEDIA_TYPE if found == ARTIFACT_TYPE => Layer::PackIndexes { digest, size },
                BLOB_MEDIA_TYPE => Layer::Blob { digest, size },
                other => return Err(bad(format!("layer {digest} has media type {other:?}"))),
            });
        }
        // Every index comes with its pack, and every pack with its index: its own layer, or
        // (which a pull checks once it has read them) one of the indexes blobs.
        let packs_may_share_indexes = layers.iter().any(|l| matches!(l, Layer::PackIndexes { .. }));
        for layer in &layers {
            if let Layer::PackIndex { pack, digest, .. } = layer
                && !layers.iter().any(|l| matches!(l, Layer::Pack { digest: d, .. } if d == pack))
            {
                return Err(bad(format!("pack index {digest} names pack {pack}, which is not a layer")));
            }
            if let Layer::Pack { digest, .. } = layer
                && !packs_may_share_indexes
                && !layers.iter().any(|l| matches!(l, Layer::PackIndex { pack, .. } if pack == digest))
            {
                return Err(bad(format!("pack {digest} has no index layer")));
            }
        }
        let extra: BTreeMap<String, String> = annotations
            .iter()
            .filter(|(k, _)| !OWN_ANNOTATIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if extra.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() > MAX_EXTRA_ANNOTATION_BYTES {
            return Err(bad(format!("annotations of more than {MAX_EXTRA_ANNOTATION_BYTES} bytes")));
        }
        Ok(Checkpoint {
            extra,
            namespace: annotation(ANNOTATION_NAMESPACE)?,
            sandbox: annotation(ANNOTATION_SANDBOX)?,
            turn,
            parent_turn,
            created: annotation(ANNOTATION_CREATED)?,
            turn_manifest: digest(&manifest.config)?,
            turn_manifest_size,
            layers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        let pack = Digest::of(b"pack");
        Checkpoint {
            namespace: "k8s.io".into(),
            sandbox: "Sandbox_1".into(),
            turn: 7,
            parent_turn: Some(6),
            created: "2025-01-01T00:00:00Z".into(),
            turn_manifest: Digest::of(b"turn"),
            turn_manifest_size: 4,
            layers: vec![
                Layer::Pack { digest: pack, size: 10 },
                Layer::PackIndex { digest: Digest::of(b"idx"), size: 5, pack },
                Layer::Blob { digest: Digest::of(b"big"), size: 3 },
            ],
            extra: BTreeMap::from([(ANNOTATION_IMAGE.to_owned(), "crab.local/busybox:latest".to_owned())]),
        }
    }

    #[test]
    fn manifest_round_trips() {
        let c = sample();
        assert_eq!(Checkpoint::decode(&c.encode(), "r").unwrap(), c);
        let json: serde_json::Value = serde_json::from_slice(&c.encode()).unwrap();
        assert_eq!(json["artifactType"], ARTIFACT_TYPE);
        assert_eq!(json["config"]["mediaType"], TURN_MEDIA_TYPE);
    }

    #[test]
    fn another_artifact_type_is_named() {
        let image = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
            "config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:00","size":2},"layers":[]}"#;
        let err = Checkpoint::decode(image, "reg/ns/sb:turn-1").unwrap_err();
        assert!(
            matches!(err, RemoteError::WrongArtifactType { ref found, .. } if found == "application/vnd.oci.image.config.v1+json"),
            "{err}"
        );
        assert!(err.to_string().contains("reg/ns/sb:turn-1"), "{err}");
    }

    #[test]
    fn indexes_blobs_are_read_from_this_format_only_and_the_first_is_still_read() {
        let mut c = sample();
        c.layers.push(Layer::PackIndexes { digest: Digest::of(b"indexes"), size: 9 });
        assert_eq!(Checkpoint::decode(&c.encode(), "r").unwrap(), c);
        // A manifest of the first format (one index per pack) is read as it was written...
        let v1 = String::from_utf8(sample().encode()).unwrap().replace(ARTIFACT_TYPE, ARTIFACT_TYPE_V1);
        assert_eq!(Checkpoint::decode(v1.as_bytes(), "r").unwrap(), sample());
        // ...and holds no indexes blob.
        let mixed = String::from_utf8(c.encode()).unwrap().replace(ARTIFACT_TYPE, ARTIFACT_TYPE_V1);
        let err = Checkpoint::decode(mixed.as_bytes(), "r").unwrap_err();
        assert!(err.to_string().contains(PACK_INDEXES_MEDIA_TYPE), "{err}");
        // A pack whose index is in an indexes blob has no layer of its own.
        c.layers.remove(1);
        assert_eq!(Checkpoint::decode(&c.encode(), "r").unwrap(), c);
    }

    #[test]
    fn a_pack_or_index_larger_than_any_reader_accepts_is_refused_before_its_fetch() {
        for (layer, limit) in [
            (Layer::Pack { digest: Digest::of(b"p"), size: 0 }, crate::pack::MAX_PACK_BYTES),
            (Layer::PackIndexes { digest: Digest::of(b"i"), size: 0 }, crate::pack::MAX_INDEXES_BYTES),
        ] {
            let mut c = sample();
            // An indexes blob, which may describe the pack.
            c.layers.push(Layer::PackIndexes { digest: Digest::of(b"small"), size: 100 });
            c.layers.push(layer.clone());
            let last = c.layers.len() - 1;
            let oversize = |size| match &layer {
                Layer::Pack { digest, .. } => Layer::Pack { digest: *digest, size },
                Layer::PackIndexes { digest, .. } => Layer::PackIndexes { digest: *digest, size },
                _ => unreachable!(),
            };
            c.layers[last] = oversize(limit);
            assert!(Checkpoint::decode(&c.encode(), "r").is_ok());
            c.layers[last] = oversize(limit + 1);
            let err = Checkpoint::decode(&c.encode(), "r").unwrap_err();
            assert!(err.to_string().contains(&format!("over the limit of {limit}")), "{err}");
        }
    }

    #[test]
    fn a_pack_without_its_index_is_refused() {
        let mut c = sample();
        c.layers.remove(1);
        let err = Checkpoint::decode(&c.encode(), "r").unwrap_err();
        assert!(err.to_string().contains("has no index layer"), "{err}");
    }

    #[test]
    fn names_become_valid_path_components() {
        assert_eq!(path_component("sandbox-1"), "sandbox-1");
        assert_eq!(path_component("k8s.io"), "k8s.io");
        assert_eq!(path_component("Sandbox_1"), "x--53616e64626f785f31");
        assert!(valid_component(&path_component("a..b")));
        assert!(!valid_component("a..b") && !valid_component("-a") && !valid_component("a_-b"));
        assert!(valid_component("a__b") && valid_component("a---b"));
        assert_eq!(repository("crab", "default", "box"), "crab/default/box");
        assert_eq!(repository("", "default", "box"), "default/box");
        for name in ["sandbox-1", "Sandbox_1", "a..b", "k8s.io"] {
            assert_eq!(name_of_component(&path_component(name)).as_deref(), Some(name));
        }
        assert_eq!(name_of_component("x--626f78"), None, "box has one form only");
        assert_eq!(name_of_component("-a"), None);
    }

    #[test]
    fn turn_tags() {
        assert_eq!(parse_turn_tag(&turn_tag(12)), Some(12));
        assert_eq!(parse_turn_tag("turn-012"), None);
        assert_eq!(parse_turn_tag("turn-"), None);
        assert_eq!(parse_turn_tag("latest"), None);
    }
}
