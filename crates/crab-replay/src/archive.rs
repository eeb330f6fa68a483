//! OCI image layout archives (the tar that `ctr images import` reads) of a
//! checkpoint image's own blobs: how the every-turn baseline keeps each
//! checkpoint off containerd's state in a run without a registry (a run that
//! will lose its node pushes the image to node B's registry instead).
//!
//! What `ctr images export` writes, less the base image: a checkpoint index
//! names its base image by reference and descriptor, and a replacement node
//! has that image (it pulls it like any other) before it restores anything;
//! a push to a registry that holds the base image transfers the same blobs.
//! An archive is written to a `.partial` file, synced and renamed, so a
//! crash leaves either the whole archive or none.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("blob {digest}: containerd gave {got} bytes with sha256:{got_hex}, expected {size} bytes")]
    BlobMismatch { digest: String, size: u64, got: u64, got_hex: String },
    #[error("blob {digest}: {size} bytes do not fit a tar entry (at most 8 GiB - 1)")]
    TooLarge { digest: String, size: u64 },
    #[error("digest {0:?} is not sha256:<64 hex digits>")]
    BadDigest(String),
}

/// A content descriptor as OCI index files carry them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
}

/// containerd's annotation that names the image an index entry becomes on import.
const IMAGE_NAME_ANNOTATION: &str = "io.containerd.image.name";
const OCI_LAYOUT: &[u8] = br#"{"imageLayoutVersion":"1.0.0"}"#;
/// Largest size the 11 octal digits of a ustar size field hold.
const TAR_MAX_SIZE: u64 = 0o77777777777;

/// An archive being written: [`ArchiveWriter::create`], [`ArchiveWriter::add`]
/// for each blob (the index among them), [`ArchiveWriter::finish`]. Dropped
/// unfinished, it removes what it wrote.
pub struct ArchiveWriter {
    path: PathBuf,
    partial: PathBuf,
    tar: Option<BufWriter<File>>,
    written: u64,
}

impl ArchiveWriter {
    /// Starts an archive at `path` that imports as image `reference`
    /// pointing at `index` (the checkpoint's index blob).
    pub fn create(path: &Path, reference: &str, index: &Descriptor) -> Result<ArchiveWriter, ArchiveError> {
        let partial = path.with_extension("partial");
        let file = File::create(&partial).map_err(|source| ArchiveError::Io { path: partial.clone(), source })?;
        let mut writer =
            ArchiveWriter { path: path.to_path_buf(), partial, tar: Some(BufWriter::new(file)), written: 0 };
        writer.entry("oci-layout", OCI_LAYOUT)?;
        let layout_index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": index.media_type,
                "digest": index.digest,
                "size": index.size,
                "annotations": { IMAGE_NAME_ANNOTATION: reference },
            }],
        });
        writer.entry("index.json", layout_index.to_string().as_bytes())?;
        Ok(writer)
    }

    /// Adds one blob, checked against its descriptor first.
    pub fn add(&mut self, descriptor: &Descriptor, data: &[u8]) -> Result<(), ArchiveError> {
        check_blob(descriptor, data)?;
        let hex = &descriptor.digest["sha256:".len()..];
        self.entry(&format!("blobs/sha256/{hex}"), data)
    }

    /// Ends the tar, syncs it and publishes it under its name. Returns the
    /// bytes written, the archive's size.
    pub fn finish(mut self) -> Result<u64, ArchiveError> {
        let tar = self.tar.take().expect("an unfinished archive has its file");
        let published = self.publish(tar);
        if published.is_err() {
            let _ = std::fs::remove_file(&self.partial);
        }
        published
    }

    fn publish(&mut self, mut tar: BufWriter<File>) -> Result<u64, ArchiveError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ArchiveError::Io { path, source }
        };
        // The end of a tar: two zero blocks.
        tar.write_all(&[0u8; 1024]).map_err(io(&self.partial))?;
        self.written += 1024;
        let file = tar.into_inner().map_err(|error| io(&self.partial)(error.into_error()))?;
        file.sync_all().map_err(io(&self.partial))?;
        drop(file);
        std::fs::rename(&self.partial, &self.path).map_err(io(&self.path))?;
        let directory = self.path.parent().unwrap_or(Path::new("."));
        File::open(directory).and_then(|dir| dir.sync_all()).map_err(io(directory))?;
        Ok(self.written)
    }

    fn entry(&mut self, name: &str, data: &[u8]) -> Result<(), ArchiveError> {
        let tar = self.tar.as_mut().expect("an unfinished archive has its file");
        self.written +=
            tar_entry(tar, name, data).map_err(|source| ArchiveError::Io { path: self.partial.clone(), source })?;
        Ok(())
    }
}

impl Drop for ArchiveWriter {
    fn drop(&mut self) {
        if self.tar.take().is_some() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

/// The content containerd handed out must be the blob the index names.
pub fn check_blob(descriptor: &Descriptor, data: &[u8]) -> Result<(), ArchiveError> {
    let hex = descriptor
        .digest
        .strip_prefix("sha256:")
        .filter(|hex| hex.len() == 64)
        .ok_or_else(|| ArchiveError::BadDigest(descriptor.digest.clone()))?;
    let got_hex = hex::encode(Sha256::digest(data));
    if data.len() as u64 != descriptor.size || got_hex != hex {
        return Err(ArchiveError::BlobMismatch {
            digest: descriptor.digest.clone(),
            size: descriptor.size,
            got: data.len() as u64,
            got_hex,
        });
    }
    if descriptor.size > TAR_MAX_SIZE {
        return Err(ArchiveError::TooLarge { digest: descriptor.digest.clone(), size: descriptor.size });
    }
    Ok(())
}

/// One regular file in ustar format: header, content, padding to 512 bytes.
fn tar_entry(out: &mut impl Write, name: &str, data: &[u8]) -> std::io::Result<u64> {
    let mut header = [0u8; 512];
    assert!(name.len() < 100, "tar entry names here are short: {name}");
    header[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut header[100..108], 0o644);
    octal(&mut header[108..116], 0);
    octal(&mut header[116..124], 0);
    octal(&mut header[124..136], data.len() as u64);
    octal(&mut header[136..148], 0);
    header[156] = b'0';
    header[257..263].copy_from_slice(b"ustar\0");
    header[263..265].copy_from_slice(b"00");
    // The checksum is taken with its own field as spaces.
    header[148..156].fill(b' ');
    let checksum: u32 = header.iter().map(|&b| u32::from(b)).sum();
    octal(&mut header[148..155], u64::from(checksum));
    out.write_all(&header)?;
    out.write_all(data)?;
    let padding = (512 - data.len() % 512) % 512;
    out.write_all(&[0u8; 512][..padding])?;
    Ok((512 + data.len() + padding) as u64)
}

/// Zero-padded octal filling all of `field` but its last byte, a NUL.
fn octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    field[..digits].copy_from_slice(text.as_bytes());
    field[digits] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(data: &[u8], media_type: &str) -> (Descriptor, Vec<u8>) {
        let descriptor = Descriptor {
            media_type: media_type.into(),
            digest: format!("sha256:{}", hex::encode(Sha256::digest(data))),
            size: data.len() as u64,
        };
        (descriptor, data.to_vec())
    }

    #[test]
    fn an_archive_unpacks_with_tar_into_an_oci_layout() {
        let dir = tempfile::tempdir().unwrap();
        let index = blob(br#"{"schemaVersion":2,"manifests":[]}"#, "application/vnd.oci.image.index.v1+json");
        let layer = blob(&vec![7u8; 1500], "application/vnd.containerd.container.criu.checkpoint.criu.tar");
        let path = dir.path().join("turn-3.tar");
        let mut archive = ArchiveWriter::create(&path, "crab.local/replay/x:turn-3", &index.0).unwrap();
        archive.add(&index.0, &index.1).unwrap();
        archive.add(&layer.0, &layer.1).unwrap();
        let written = archive.finish().unwrap();
        assert_eq!(written, std::fs::metadata(&path).unwrap().len());
        assert!(!path.with_extension("partial").exists());

        let unpacked = dir.path().join("unpacked");
        std::fs::create_dir(&unpacked).unwrap();
        let status = std::process::Command::new("tar").arg("-xf").arg(&path).arg("-C").arg(&unpacked).status().unwrap();
        assert!(status.success());
        let hex = layer.0.digest.strip_prefix("sha256:").unwrap();
        assert_eq!(std::fs::read(unpacked.join("blobs/sha256").join(hex)).unwrap(), layer.1);
        assert_eq!(std::fs::read(unpacked.join("oci-layout")).unwrap(), OCI_LAYOUT);
        let layout: serde_json::Value =
            serde_json::from_slice(&std::fs::read(unpacked.join("index.json")).unwrap()).unwrap();
        assert_eq!(layout["manifests"][0]["digest"], index.0.digest.as_str());
        assert_eq!(layout["manifests"][0]["annotations"][IMAGE_NAME_ANNOTATION], "crab.local/replay/x:turn-3");
    }

    #[test]
    fn a_blob_that_is_not_what_the_index_says_leaves_no_archive() {
        let dir = tempfile::tempdir().unwrap();
        let index = blob(b"{}", "application/vnd.oci.image.index.v1+json");
        let (mut descriptor, data) =
            blob(b"criu images", "application/vnd.containerd.container.criu.checkpoint.criu.tar");
        descriptor.size += 1;
        let path = dir.path().join("turn-1.tar");
        let mut archive = ArchiveWriter::create(&path, "r", &index.0).unwrap();
        archive.add(&index.0, &index.1).unwrap();
        let error = archive.add(&descriptor, &data).unwrap_err();
        assert!(error.to_string().contains("containerd gave 11 bytes"), "{error}");
        assert!(path.with_extension("partial").exists());
        drop(archive);
        assert!(!path.exists() && !path.with_extension("partial").exists());
    }
}
