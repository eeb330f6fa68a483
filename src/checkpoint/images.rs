//! CRIU image directories. Memory pages (`pages-*.img`) are cut into 4 KiB chunks, each a blob,
//! so a dump of a process whose memory did not change stores almost nothing new even though
//! CRIU (without soft-dirty tracking) writes every page again. Other image files are small and
//! are stored whole.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::error::{CheckpointError, IoContext, Result};
use super::manifest::{ImageContent, ImageFile, ImageSet, valid_image_name};
use super::store::{BlobStore, Digest, WriteBatch};

pub const CHUNK_SIZE: usize = 4096;

fn is_page_image(name: &str) -> bool {
    name.starts_with("pages-") && name.ends_with(".img")
}

fn bad_dir(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::BadImageDir {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Stores every file of a CRIU image directory; the directory must be flat and hold regular
/// files only (what `criu dump` writes).
pub(crate) fn store_images(dir: &Path, batch: &mut WriteBatch<'_>) -> Result<ImageSet> {
    let mut files = Vec::new();
    for dirent in fs::read_dir(dir).io_ctx("read dir", dir)? {
        let dirent = dirent.io_ctx("read dir", dir)?;
        let path = dirent.path();
        let name = dirent
            .file_name()
            .into_string()
            .map_err(|n| bad_dir(dir, format!("file name {n:?} is not UTF-8")))?;
        let meta = fs::symlink_metadata(&path).io_ctx("stat", &path)?;
        if !meta.file_type().is_file() {
            return Err(bad_dir(dir, format!("{name} is not a regular file")));
        }
        let mut file = File::open(&path).io_ctx("open", &path)?;
        let (size, content) = if is_page_image(&name) {
            store_chunked(&mut file, &path, batch)?
        } else {
            let (blob, size) = batch.put_reader(&mut file, &path)?;
            (size, ImageContent::Whole { blob })
        };
        files.push(ImageFile {
            name,
            mode: meta.mode() & 0o7777,
            size,
            content,
        });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(ImageSet { files })
}

fn store_chunked(
    file: &mut File,
    path: &Path,
    batch: &mut WriteBatch<'_>,
) -> Result<(u64, ImageContent)> {
    let mut list = Vec::new();
    let mut buf = vec![0u8; 256 * CHUNK_SIZE];
    let mut size = 0u64;
    loop {
        let filled = read_full(file, &mut buf).io_ctx("read", path)?;
        if filled == 0 {
            break;
        }
        for chunk in buf[..filled].chunks(CHUNK_SIZE) {
            list.extend_from_slice(&batch.put_bytes(chunk)?.0);
        }
        size += filled as u64;
        if filled < buf.len() {
            break;
        }
    }
    let chunks = (list.len() / 32) as u64;
    let chunk_list = batch.put_bytes(&list)?;
    Ok((
        size,
        ImageContent::Chunked {
            chunk_size: CHUNK_SIZE as u32,
            chunks,
            chunk_list,
        },
    ))
}

fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// Recreates an image set into `dest` (created if missing; it must not already hold any of the
/// files), byte for byte.
pub(crate) fn restore_images(set: &ImageSet, blobs: &BlobStore, dest: &Path) -> Result<u64> {
    fs::create_dir_all(dest).io_ctx("create", dest)?;
    let mut total = 0;
    for image in &set.files {
        if !valid_image_name(&image.name) {
            return Err(bad_dir(
                dest,
                format!("image name {:?} is not a plain file name", image.name),
            ));
        }
        let path = dest.join(&image.name);
        let mut out = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .io_ctx("create", &path)?;
        let written = match &image.content {
            ImageContent::Whole { blob } => blobs.copy_verified(blob, &mut out, &path)?,
            ImageContent::Chunked {
                chunk_list, chunks, ..
            } => {
                let list = blobs.read(chunk_list)?;
                if list.len() as u64 != chunks * 32 {
                    return Err(bad_dir(
                        dest,
                        format!(
                            "chunk list of {} has {} bytes for {chunks} chunks",
                            image.name,
                            list.len()
                        ),
                    ));
                }
                let mut pending = Vec::with_capacity(256 * CHUNK_SIZE);
                let mut written = 0u64;
                for digest in list.chunks_exact(32) {
                    let digest = Digest(digest.try_into().expect("chunks_exact yields 32 bytes"));
                    pending.extend_from_slice(&blobs.read(&digest)?);
                    if pending.len() >= 256 * CHUNK_SIZE {
                        out.write_all(&pending).io_ctx("write", &path)?;
                        written += pending.len() as u64;
                        pending.clear();
                    }
                }
                out.write_all(&pending).io_ctx("write", &path)?;
                written + pending.len() as u64
            }
        };
        if written != image.size {
            return Err(bad_dir(
                dest,
                format!(
                    "{} restored to {written} bytes, manifest says {}",
                    image.name, image.size
                ),
            ));
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(image.mode))
            .io_ctx("chmod", &path)?;
        total += written;
    }
    Ok(total)
}

/// Every blob behind an image set, chunks included (for GC).
pub(crate) fn referenced_blobs(
    set: &ImageSet,
    blobs: &BlobStore,
    out: &mut std::collections::HashSet<Digest>,
) -> Result<()> {
    for image in &set.files {
        match &image.content {
            ImageContent::Whole { blob } => {
                out.insert(*blob);
            }
            ImageContent::Chunked { chunk_list, .. } => {
                out.insert(*chunk_list);
                if let Ok(list) = blobs.read(chunk_list) {
                    for digest in list.chunks_exact(32) {
                        out.insert(Digest(
                            digest.try_into().expect("chunks_exact yields 32 bytes"),
                        ));
                    }
                } else {
                    // An unreadable chunk list already breaks this checkpoint; keeping its
                    // chunks would not repair it, and dropping them cannot hurt another one.
                    tracing::warn!(chunk_list = %chunk_list, "chunk list unreadable during GC");
                }
            }
        }
    }
    Ok(())
}
