//! What a container's root file system is unpacked from: an image's layers, named by their
//! chain ID, which is the key containerd's snapshotters give the image's top layer. Pure logic
//! over the image's JSON documents (index, manifest, config); [`crate::grpc`] reads them from
//! containerd's content store.

use sha2::{Digest, Sha256};

/// The JSON documents are small; a larger one is not an image document.
pub const MAX_DOCUMENT_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {image}: {what} {digest}: {problem}")]
    Document { image: String, what: &'static str, digest: String, problem: String },
    #[error("image {image}: its index lists no manifest for {os}/{arch} (it has: {listed})")]
    NoPlatform { image: String, os: String, arch: String, listed: String },
}

/// What one of an image's documents is, by its media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentKind {
    /// An OCI index or a Docker manifest list: one manifest per platform.
    Index,
    Manifest,
}

impl DocumentKind {
    /// None for a media type that is neither.
    pub fn of(media_type: &str) -> Option<DocumentKind> {
        match media_type {
            "application/vnd.oci.image.index.v1+json" | "application/vnd.docker.distribution.manifest.list.v2+json" => {
                Some(DocumentKind::Index)
            }
            "application/vnd.oci.image.manifest.v1+json" | "application/vnd.docker.distribution.manifest.v2+json" => {
                Some(DocumentKind::Manifest)
            }
            _ => None,
        }
    }
}

/// This host's platform as OCI names it (`linux`, `amd64`).
pub fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    ("linux", arch)
}

fn parse(image: &str, what: &'static str, digest: &str, bytes: &[u8]) -> Result<serde_json::Value, ImageError> {
    serde_json::from_slice(bytes).map_err(|e| ImageError::Document {
        image: image.into(),
        what,
        digest: digest.into(),
        problem: format!("not JSON: {e}"),
    })
}

fn bad(image: &str, what: &'static str, digest: &str, problem: impl Into<String>) -> ImageError {
    ImageError::Document { image: image.into(), what, digest: digest.into(), problem: problem.into() }
}

/// The manifest an index lists for `os`/`arch`: (media type, digest). An index with a single
/// manifest that names no platform is taken as that manifest.
pub fn pick_manifest(
    image: &str,
    digest: &str,
    index: &[u8],
    (os, arch): (&str, &str),
) -> Result<(String, String), ImageError> {
    let index = parse(image, "index", digest, index)?;
    let manifests = index
        .get("manifests")
        .and_then(|m| m.as_array())
        .ok_or_else(|| bad(image, "index", digest, "has no \"manifests\" list"))?;
    let entry = |m: &serde_json::Value| -> Option<(String, String)> {
        Some((m.get("mediaType")?.as_str()?.to_string(), m.get("digest")?.as_str()?.to_string()))
    };
    let platform = |m: &serde_json::Value| -> Option<(String, String)> {
        let p = m.get("platform")?;
        Some((p.get("os")?.as_str()?.to_string(), p.get("architecture")?.as_str()?.to_string()))
    };
    if let Some(found) = manifests.iter().find(|m| platform(m).is_some_and(|(o, a)| o == os && a == arch)) {
        return entry(found).ok_or_else(|| bad(image, "index", digest, "an entry lacks its mediaType or digest"));
    }
    if let [only] = manifests.as_slice()
        && platform(only).is_none()
    {
        return entry(only).ok_or_else(|| bad(image, "index", digest, "an entry lacks its mediaType or digest"));
    }
    let listed: Vec<String> = manifests.iter().filter_map(platform).map(|(o, a)| format!("{o}/{a}")).collect();
    Err(ImageError::NoPlatform { image: image.into(), os: os.into(), arch: arch.into(), listed: listed.join(", ") })
}

/// The digest of a manifest's config.
pub fn config_digest(image: &str, digest: &str, manifest: &[u8]) -> Result<String, ImageError> {
    let manifest = parse(image, "manifest", digest, manifest)?;
    manifest
        .pointer("/config/digest")
        .and_then(|d| d.as_str())
        .map(str::to_string)
        .ok_or_else(|| bad(image, "manifest", digest, "names no config digest"))
}

/// The chain ID of a config's layers (`rootfs.diff_ids`): the snapshot key of the image's top
/// layer, once unpacked.
pub fn chain_id_of_config(image: &str, digest: &str, config: &[u8]) -> Result<String, ImageError> {
    let config = parse(image, "config", digest, config)?;
    let diff_ids: Vec<&str> = config
        .pointer("/rootfs/diff_ids")
        .and_then(|d| d.as_array())
        .ok_or_else(|| bad(image, "config", digest, "has no rootfs.diff_ids"))?
        .iter()
        .map(|d| d.as_str().ok_or_else(|| bad(image, "config", digest, "a diff_id is not a string")))
        .collect::<Result<_, _>>()?;
    chain_id(&diff_ids).ok_or_else(|| bad(image, "config", digest, "has no layers"))
}

/// The OCI chain ID of layers given bottom first: the first layer's diff ID, then
/// `sha256(parent + " " + diff_id)` for each layer above it. None for no layers.
pub fn chain_id(diff_ids: &[&str]) -> Option<String> {
    let (first, rest) = diff_ids.split_first()?;
    Some(rest.iter().fold(first.to_string(), |parent, diff_id| {
        let hash = Sha256::digest(format!("{parent} {diff_id}").as_bytes());
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    #[test]
    fn a_chain_id_is_the_first_diff_id_then_a_hash_over_each_parent_and_layer() {
        assert_eq!(chain_id(&[]), None);
        assert_eq!(chain_id(&[A]).as_deref(), Some(A));
        // sha256 of "<A> <B>", computed apart from this code (Python's hashlib).
        assert_eq!(
            chain_id(&[A, B]).as_deref(),
            Some("sha256:ccd722928bd92476ba1745586fed6e45a102504185ad88cd89e01ff116fd146c")
        );
    }

    #[test]
    fn the_index_entry_of_the_host_platform_is_chosen_else_a_lone_one() {
        let index = br#"{"manifests":[
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:arm","platform":{"os":"linux","architecture":"arm64"}},
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:amd","platform":{"os":"linux","architecture":"amd64"}}]}"#;
        let got = pick_manifest("img", "sha256:i", index, ("linux", "amd64")).unwrap();
        assert_eq!(got.1, "sha256:amd");
        let err = pick_manifest("img", "sha256:i", index, ("linux", "s390x")).unwrap_err().to_string();
        assert!(err.contains("linux/s390x") && err.contains("linux/arm64, linux/amd64"), "{err}");
        let lone = br#"{"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:x"}]}"#;
        assert_eq!(pick_manifest("img", "sha256:i", lone, ("linux", "amd64")).unwrap().1, "sha256:x");
        let err = pick_manifest("img", "sha256:i", b"{}", ("linux", "amd64")).unwrap_err().to_string();
        assert!(err.contains("index sha256:i") && err.contains("manifests"), "{err}");
    }

    #[test]
    fn a_config_without_layers_or_a_manifest_without_config_is_named() {
        let err = chain_id_of_config("img", "sha256:c", br#"{"rootfs":{"diff_ids":[]}}"#).unwrap_err().to_string();
        assert!(err.contains("config sha256:c") && err.contains("no layers"), "{err}");
        let got = chain_id_of_config("img", "sha256:c", format!(r#"{{"rootfs":{{"diff_ids":["{A}"]}}}}"#).as_bytes());
        assert_eq!(got.unwrap(), A);
        let err = config_digest("img", "sha256:m", b"{\"layers\":[]}").unwrap_err().to_string();
        assert!(err.contains("manifest sha256:m") && err.contains("config digest"), "{err}");
        assert_eq!(
            DocumentKind::of("application/vnd.docker.distribution.manifest.v2+json"),
            Some(DocumentKind::Manifest)
        );
        assert_eq!(DocumentKind::of("text/plain"), None);
    }
}
