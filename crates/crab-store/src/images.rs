//! CRIU image directories. Memory pages (`pages-*.img`) are cut into 4 KiB chunks, each a blob,
//! so a dump of a process whose memory did not change stores almost nothing new even though
//! CRIU (without soft-dirty tracking) writes every page again. Other image files are small and
//! are stored whole.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::error::{CheckpointError, IoContext, Result};
use super::manifest::{ImageContent, ImageFile, ImageSet, valid_image_name};
use super::store::{BlobStore, Digest, OpenPacks, WriteBatch};
use super::sys;

pub const CHUNK_SIZE: usize = 4096;

fn is_page_image(name: &str) -> bool {
    name.starts_with("pages-") && name.ends_with(".img")
}

fn bad_dir(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::BadImageDir { path: path.to_owned(), reason: reason.into() }
}

/// Stores every file of a CRIU image directory; the directory must be flat and hold regular
/// files only (what `criu dump` writes).
pub(crate) fn store_images(dir: &Path, batch: &mut WriteBatch<'_>) -> Result<ImageSet> {
    let mut files = Vec::new();
    for dirent in fs::read_dir(dir).io_ctx("read dir", dir)? {
        let dirent = dirent.io_ctx("read dir", dir)?;
        let path = dirent.path();
        let name =
            dirent.file_name().into_string().map_err(|n| bad_dir(dir, format!("file name {n:?} is not UTF-8")))?;
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
        files.push(ImageFile { name, mode: meta.mode() & 0o7777, size, content });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(ImageSet { files })
}

fn store_chunked(file: &mut File, path: &Path, batch: &mut WriteBatch<'_>) -> Result<(u64, ImageContent)> {
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
    Ok((size, ImageContent::Chunked { chunk_size: CHUNK_SIZE as u32, chunks, chunk_list }))
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

/// What [`restore_images`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoredImages {
    pub files: u64,
    pub bytes: u64,
    /// Chunks of the page images.
    pub chunks: u64,
    /// Chunk blobs read and hashed: fewer than `chunks` when pages repeat (zero pages).
    pub chunks_read: u64,
    /// The files came from the kept assembled copy (verified against the manifest and
    /// linked), not from the chunks.
    pub assembled: bool,
}

/// Chunks per unit of work: large enough that a worker writes in big runs, small enough
/// that a 64 MiB page image spreads over every worker.
const CHUNKS_PER_JOB: usize = 1024;

/// Bytes gathered before one positioned write.
const WRITE_RUN: usize = 256 * CHUNK_SIZE;

/// One image file being recreated.
struct Target<'a> {
    image: &'a ImageFile,
    path: PathBuf,
    file: File,
    /// For page images: the verified chunk list and the chunk size.
    chunks: Option<(Vec<u8>, u64)>,
}

/// A unit of reassembly work: a whole small image, or a run of chunks of a page image.
#[derive(Clone, Copy)]
enum Job {
    Whole { target: usize },
    Chunks { target: usize, first: usize, count: usize },
}

/// Recreates an image set as the directory `dest` (which must not exist, or be empty), byte
/// for byte. Every blob is hashed before its bytes are written. The files are written into a
/// sibling directory renamed to `dest` once all of them are complete, so `dest` never holds a
/// partial image set: a failed restore leaves no `dest` behind.
pub(crate) fn restore_images(set: &ImageSet, blobs: &BlobStore, dest: &Path) -> Result<RestoredImages> {
    let Some(name) = dest.file_name() else {
        return Err(bad_dir(dest, "not a directory name"));
    };
    let mut partial_name = name.to_owned();
    partial_name.push(".partial");
    let partial = dest.with_file_name(partial_name);
    match fs::remove_dir_all(&partial) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).io_ctx("remove", &partial),
    }
    sys::create_private_dir_all(&partial).io_ctx("create", &partial)?;
    let written = write_image_files(set, blobs, &partial)
        .and_then(|restored| fs::rename(&partial, dest).io_ctx("rename", dest).map(|()| restored));
    if written.is_err() {
        let _ = fs::remove_dir_all(&partial);
    }
    written
}

/// Writes every file of `set` into the empty directory `dest`. Page images are reassembled by
/// several threads, each writing its own runs of chunks at their offsets.
fn write_image_files(set: &ImageSet, blobs: &BlobStore, dest: &Path) -> Result<RestoredImages> {
    let mut targets = Vec::with_capacity(set.files.len());
    for image in &set.files {
        targets.push(open_target(image, blobs, dest)?);
    }
    let mut jobs = Vec::new();
    // Page images first: they are the long jobs, the small whole files fill in around them.
    for (index, target) in targets.iter().enumerate() {
        if let Some((list, _)) = &target.chunks {
            let chunks = list.len() / 32;
            for first in (0..chunks).step_by(CHUNKS_PER_JOB) {
                let count = CHUNKS_PER_JOB.min(chunks - first);
                jobs.push(Job::Chunks { target: index, first, count });
            }
        }
    }
    for (index, target) in targets.iter().enumerate() {
        if target.chunks.is_none() {
            jobs.push(Job::Whole { target: index });
        }
    }
    let repeated = repeated_chunks(&targets);
    let chunks_read = AtomicU64::new(0);
    /// One thread's reassembly state: its chunk cache, buffers, and chunk blobs read.
    struct Io {
        cache: HashMap<Digest, Vec<u8>>,
        packs: OpenPacks,
        scratch: Vec<u8>,
        run: Vec<u8>,
        read: u64,
    }
    run_jobs(
        &jobs,
        || Io {
            cache: HashMap::new(),
            packs: OpenPacks::default(),
            scratch: Vec::new(),
            run: Vec::with_capacity(WRITE_RUN),
            read: 0,
        },
        |io, job| match *job {
            Job::Whole { target } => {
                let t = &targets[target];
                let ImageContent::Whole { blob } = &t.image.content else {
                    unreachable!("whole jobs are made for whole images")
                };
                blobs.copy_verified(blob, &t.file, &t.path).and_then(|written| check_size(t, written, dest))
            }
            Job::Chunks { target, first, count } => write_chunks(
                &targets[target],
                first,
                count,
                ChunkIo {
                    blobs,
                    repeated: &repeated,
                    cache: &mut io.cache,
                    packs: &mut io.packs,
                    scratch: &mut io.scratch,
                    run: &mut io.run,
                },
                dest,
            )
            .map(|n| io.read += n),
        },
        |io| {
            chunks_read.fetch_add(io.read, Ordering::Relaxed);
        },
    )?;

    let mut restored = RestoredImages { chunks_read: chunks_read.into_inner(), ..Default::default() };
    for target in &targets {
        fs::set_permissions(&target.path, fs::Permissions::from_mode(target.image.mode))
            .io_ctx("chmod", &target.path)?;
        restored.files += 1;
        restored.bytes += target.image.size;
        restored.chunks += target.chunks.as_ref().map_or(0, |(list, _)| list.len() as u64 / 32);
    }
    Ok(restored)
}

/// Creates one image file, sized already for page images, and loads its verified chunk list.
fn open_target<'a>(image: &'a ImageFile, blobs: &BlobStore, dest: &Path) -> Result<Target<'a>> {
    if !valid_image_name(&image.name) {
        return Err(bad_dir(dest, format!("image name {:?} is not a plain file name", image.name)));
    }
    let chunks = match &image.content {
        ImageContent::Whole { .. } => None,
        ImageContent::Chunked { chunk_list, chunks, chunk_size } => {
            let list = blobs.read(chunk_list)?;
            if list.len() as u64 != chunks * 32 {
                return Err(bad_dir(
                    dest,
                    format!("chunk list of {} has {} bytes for {chunks} chunks", image.name, list.len()),
                ));
            }
            let chunk_size = u64::from(*chunk_size);
            // Every chunk but the last is full: offsets follow from the index alone.
            let fits = match *chunks {
                0 => image.size == 0,
                n => chunk_size > 0 && image.size > (n - 1) * chunk_size && image.size <= n * chunk_size,
            };
            if !fits {
                return Err(bad_dir(
                    dest,
                    format!(
                        "{} has {} bytes, which {chunks} chunks of {chunk_size} bytes cannot hold",
                        image.name, image.size
                    ),
                ));
            }
            Some((list, chunk_size))
        }
    };
    let path = dest.join(&image.name);
    let file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).io_ctx("create", &path)?;
    if chunks.is_some() {
        file.set_len(image.size).io_ctx("truncate", &path)?;
    }
    Ok(Target { image, path, file, chunks })
}

/// Digests that occur more than once among the chunks: only these are worth keeping in
/// memory once verified.
fn repeated_chunks(targets: &[Target<'_>]) -> HashSet<Digest> {
    let mut seen = HashSet::new();
    let mut repeated = HashSet::new();
    for (list, _) in targets.iter().filter_map(|t| t.chunks.as_ref()) {
        for digest in list.chunks_exact(32) {
            let digest = Digest(digest.try_into().expect("chunks_exact yields 32 bytes"));
            if !seen.insert(digest) {
                repeated.insert(digest);
            }
        }
    }
    repeated
}

fn check_size(target: &Target<'_>, written: u64, dest: &Path) -> Result<()> {
    if written != target.image.size {
        return Err(bad_dir(
            dest,
            format!("{} restored to {written} bytes, manifest says {}", target.image.name, target.image.size),
        ));
    }
    Ok(())
}

/// A worker's buffers and what it shares with the others.
struct ChunkIo<'w> {
    blobs: &'w BlobStore,
    repeated: &'w HashSet<Digest>,
    /// Repeated chunks this worker already verified in this restore.
    cache: &'w mut HashMap<Digest, Vec<u8>>,
    /// Pack files this worker has open.
    packs: &'w mut OpenPacks,
    scratch: &'w mut Vec<u8>,
    run: &'w mut Vec<u8>,
}

/// Verifies chunks `first..first + count` of a page image and writes them at their offset.
/// Returns how many chunk blobs were read.
fn write_chunks(target: &Target<'_>, first: usize, count: usize, io: ChunkIo<'_>, dest: &Path) -> Result<u64> {
    let (list, chunk_size) = target.chunks.as_ref().expect("chunk jobs are made for page images");
    let chunk_size = *chunk_size;
    let last = (list.len() / 32) as u64 - 1;
    let mut offset = first as u64 * chunk_size;
    let mut read = 0;
    io.run.clear();
    for (k, digest) in list[first * 32..(first + count) * 32].chunks_exact(32).enumerate() {
        let index = (first + k) as u64;
        let digest = Digest(digest.try_into().expect("chunks_exact yields 32 bytes"));
        let data: &[u8] = match io.cache.get(&digest) {
            Some(data) => data,
            None => {
                io.scratch.resize(chunk_size as usize + 1, 0);
                let n = io.blobs.read_small_into(&digest, io.scratch, io.packs)?;
                read += 1;
                if io.repeated.contains(&digest) {
                    io.cache.insert(digest, io.scratch[..n].to_vec());
                }
                &io.scratch[..n]
            }
        };
        let expected = if index == last { target.image.size - last * chunk_size } else { chunk_size };
        if data.len() as u64 != expected {
            return Err(bad_dir(
                dest,
                format!(
                    "chunk {index} of {} ({digest}) has {} bytes, expected {expected}",
                    target.image.name,
                    data.len()
                ),
            ));
        }
        io.run.extend_from_slice(data);
        if io.run.len() >= WRITE_RUN {
            target.file.write_all_at(io.run, offset).io_ctx("write", &target.path)?;
            offset += io.run.len() as u64;
            io.run.clear();
        }
    }
    target.file.write_all_at(io.run, offset).io_ctx("write", &target.path)?;
    io.run.clear();
    Ok(read)
}

/// Keeps the image files of a published checkpoint, as CRIU wrote them in `dump_dir`, as the
/// directory `dest` (which must not exist), by hard links: nothing is copied or flushed, and
/// the copy is only ever used after [`restore_assembled`] has checked it against the manifest
/// again. Returns false, keeping nothing, when `dump_dir` is on another file system: a copy
/// would cost a write of the whole image set per process checkpoint, the traffic the chunk
/// store exists to avoid (on one file system the store's `syncfs` flushes the dump anyway).
pub(crate) fn keep_assembled(set: &ImageSet, dump_dir: &Path, dest: &Path) -> Result<bool> {
    let partial = partial_of(dest)?;
    remove_if_present(&partial)?;
    sys::create_private_dir_all(&partial).io_ctx("create", &partial)?;
    let kept = (|| {
        for image in &set.files {
            if !valid_image_name(&image.name) {
                return Err(bad_dir(dump_dir, format!("image name {:?} is not a plain file name", image.name)));
            }
            let (from, to) = (dump_dir.join(&image.name), partial.join(&image.name));
            match fs::hard_link(&from, &to) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EXDEV) => return Ok(false),
                Err(e) => return Err(e).io_ctx("link", &to),
            }
        }
        let marker = partial.join(KEPT_BYTES_FILE);
        fs::write(&marker, set.bytes().to_string()).io_ctx("write", &marker)?;
        fs::rename(&partial, dest).io_ctx("rename", dest)?;
        Ok(true)
    })();
    if !matches!(kept, Ok(true)) {
        let _ = fs::remove_dir_all(&partial);
    }
    kept
}

/// Beside a kept copy's image files, the bytes they hold, in decimal: the bound on kept copies
/// sums one small file per copy instead of a stat of every image file of every copy on the
/// node at every publish. Restores link only the manifest's names, so it never reaches CRIU.
const KEPT_BYTES_FILE: &str = ".bytes";

/// The bytes of the kept copy in `dir`: what [`keep_assembled`] recorded, or for a copy kept
/// by a build before the record (or whose record does not read as a number), the sum of its
/// files' sizes.
pub(crate) fn kept_copy_bytes(dir: &Path) -> u64 {
    if let Ok(text) = fs::read_to_string(dir.join(KEPT_BYTES_FILE))
        && let Ok(bytes) = text.trim().parse()
    {
        return bytes;
    }
    fs::read_dir(dir)
        .map(|files| files.flatten().filter_map(|f| f.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// Recreates an image set as the directory `dest` from a copy kept by [`keep_assembled`] in
/// `kept`: every file is checked against the manifest (type, size, and the sha256 of the whole
/// blob or of each chunk, compared with the verified chunk list) and hard-linked into `dest`,
/// so nothing is copied. On any mismatch nothing is left at `dest` and the error names the
/// file; the caller then reassembles from the chunks. Like [`restore_images`], `dest` appears
/// only complete.
pub(crate) fn restore_assembled(set: &ImageSet, blobs: &BlobStore, kept: &Path, dest: &Path) -> Result<RestoredImages> {
    let partial = partial_of(dest)?;
    remove_if_present(&partial)?;
    let kept = fs::canonicalize(kept).io_ctx("resolve", kept)?;
    sys::create_private_dir_all(&partial).io_ctx("create", &partial)?;
    let restored = link_verified(set, blobs, &kept, &partial)
        .and_then(|restored| fs::rename(&partial, dest).io_ctx("rename", dest).map(|()| restored));
    if restored.is_err() {
        let _ = fs::remove_dir_all(&partial);
    }
    restored
}

/// `<dest>.partial`, where a directory is filled before it is renamed to `dest`.
fn partial_of(dest: &Path) -> Result<PathBuf> {
    let Some(name) = dest.file_name() else {
        return Err(bad_dir(dest, "not a directory name"));
    };
    let mut partial_name = name.to_owned();
    partial_name.push(".partial");
    Ok(dest.with_file_name(partial_name))
}

fn remove_if_present(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).io_ctx("remove", dir),
    }
}

/// Bytes hashed per read while checking a kept page image.
const VERIFY_RUN: usize = 256 * CHUNK_SIZE;

/// Links every file of `set` from `kept` into `dest` and checks the linked files against the
/// manifest, several threads hashing runs of chunks.
fn link_verified(set: &ImageSet, blobs: &BlobStore, kept: &Path, dest: &Path) -> Result<RestoredImages> {
    let refused = |name: &str, reason: String| bad_dir(kept, format!("kept copy of {name} refused: {reason}"));
    let mut targets = Vec::with_capacity(set.files.len());
    for image in &set.files {
        if !valid_image_name(&image.name) {
            return Err(bad_dir(kept, format!("image name {:?} is not a plain file name", image.name)));
        }
        let (from, path) = (kept.join(&image.name), dest.join(&image.name));
        // A hard link, so that what is checked below is what CRIU reads through `dest`. Not a
        // symbolic one when `dest` is on another file system: CRIU opens images from inside
        // the container's mount namespace, where the link's target is not the host's file.
        match fs::hard_link(&from, &path) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                return Err(refused(
                    &image.name,
                    format!("{} is on another file system than the kept copy", dest.display()),
                ));
            }
            Err(e) => return Err(e).io_ctx("link", &path),
        }
        let file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path).io_ctx("open", &path)?;
        let meta = file.metadata().io_ctx("stat", &path)?;
        if !meta.file_type().is_file() {
            return Err(refused(&image.name, "not a regular file".into()));
        }
        if meta.len() != image.size {
            return Err(refused(&image.name, format!("{} bytes, manifest says {}", meta.len(), image.size)));
        }
        let chunks = match &image.content {
            ImageContent::Whole { .. } => None,
            ImageContent::Chunked { chunk_list, chunks, chunk_size } => {
                let list = blobs.read(chunk_list)?;
                let chunk_size = u64::from(*chunk_size);
                let fits = match *chunks {
                    0 => image.size == 0,
                    n => chunk_size > 0 && image.size > (n - 1) * chunk_size && image.size <= n * chunk_size,
                };
                if list.len() as u64 != chunks * 32 || !fits {
                    return Err(bad_dir(
                        kept,
                        format!(
                            "{}: chunk list of {} bytes does not describe {} bytes in {chunks} chunks",
                            image.name,
                            list.len(),
                            image.size
                        ),
                    ));
                }
                Some((list, chunk_size))
            }
        };
        targets.push(Target { image, path, file, chunks });
    }
    let mut jobs = Vec::new();
    for (index, target) in targets.iter().enumerate() {
        match &target.chunks {
            Some((list, _)) => {
                let chunks = list.len() / 32;
                for first in (0..chunks).step_by(CHUNKS_PER_JOB) {
                    jobs.push(Job::Chunks { target: index, first, count: CHUNKS_PER_JOB.min(chunks - first) });
                }
            }
            None => jobs.push(Job::Whole { target: index }),
        }
    }
    run_jobs(
        &jobs,
        || vec![0u8; VERIFY_RUN],
        |buf, job| match *job {
            Job::Whole { target } => {
                let t = &targets[target];
                let ImageContent::Whole { blob } = &t.image.content else {
                    unreachable!("whole jobs are made for whole images")
                };
                let mut file = &t.file;
                hash_reader_into(&mut file, buf).io_ctx("read", &t.path).and_then(|(actual, size)| {
                    if actual != blob.0 || size != t.image.size {
                        Err(refused(&t.image.name, format!("content is not blob {blob}")))
                    } else {
                        Ok(())
                    }
                })
            }
            Job::Chunks { target, first, count } => {
                check_chunks(&targets[target], first, count, buf).map_err(|e| match e {
                    ChunkCheck::Io(e) => e,
                    ChunkCheck::Mismatch(reason) => refused(&targets[target].image.name, reason),
                })
            }
        },
        drop,
    )?;
    let mut restored = RestoredImages { assembled: true, ..Default::default() };
    for target in &targets {
        if target.file.metadata().io_ctx("stat", &target.path)?.mode() & 0o7777 != target.image.mode {
            fs::set_permissions(&target.path, fs::Permissions::from_mode(target.image.mode))
                .io_ctx("chmod", &target.path)?;
        }
        restored.files += 1;
        restored.bytes += target.image.size;
        restored.chunks += target.chunks.as_ref().map_or(0, |(list, _)| list.len() as u64 / 32);
    }
    Ok(restored)
}

/// Runs `work` over `jobs` from up to four threads, each with state of its own from `state`
/// (handed to `done` when the thread stops). The first error stops the other threads and is
/// returned.
fn run_jobs<J: Sync, S>(
    jobs: &[J],
    state: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, &J) -> Result<()> + Sync,
    done: impl Fn(S) + Sync,
) -> Result<()> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4).min(jobs.len().max(1));
    let next_job = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let worker = || -> Result<()> {
        let mut own = state();
        let result = loop {
            if failed.load(Ordering::Relaxed) {
                break Ok(());
            }
            let Some(job) = jobs.get(next_job.fetch_add(1, Ordering::Relaxed)) else {
                break Ok(());
            };
            if let Err(e) = work(&mut own, job) {
                failed.store(true, Ordering::Relaxed);
                break Err(e);
            }
        };
        done(own);
        result
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> = (1..workers).map(|_| scope.spawn(worker)).collect();
        let mut results = vec![worker()];
        results.extend(handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))));
        results.into_iter().collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}

enum ChunkCheck {
    Io(CheckpointError),
    Mismatch(String),
}

/// Hashes chunks `first..first + count` of a kept page image and compares each with its entry
/// in the chunk list.
fn check_chunks(
    target: &Target<'_>,
    first: usize,
    count: usize,
    buf: &mut [u8],
) -> std::result::Result<(), ChunkCheck> {
    let (list, chunk_size) = target.chunks.as_ref().expect("chunk jobs are made for page images");
    let chunk_size = *chunk_size as usize;
    let start = first as u64 * chunk_size as u64;
    let end = ((first + count) as u64 * chunk_size as u64).min(target.image.size);
    let per_read = (buf.len() / chunk_size).max(1) * chunk_size;
    let mut offset = start;
    let mut index = first;
    while offset < end {
        let len = per_read.min((end - offset) as usize);
        let run = &mut buf[..len];
        target.file.read_exact_at(run, offset).io_ctx("read", &target.path).map_err(ChunkCheck::Io)?;
        for chunk in run.chunks(chunk_size) {
            let expected = &list[index * 32..index * 32 + 32];
            if Digest::of(chunk).0 != expected {
                return Err(ChunkCheck::Mismatch(format!("chunk {index} is not {}", hex::encode(expected))));
            }
            index += 1;
        }
        offset += len as u64;
    }
    Ok(())
}

fn hash_reader_into(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<([u8; 32], u64)> {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    let mut size = 0u64;
    loop {
        match r.read(buf)? {
            0 => return Ok((hasher.finalize().into(), size)),
            n => {
                hasher.update(&buf[..n]);
                size += n as u64;
            }
        }
    }
}

/// Every blob behind an image set, chunks included (for GC).
pub(crate) fn referenced_blobs(set: &ImageSet, blobs: &BlobStore, out: &mut HashSet<Digest>) -> Result<()> {
    referenced_blobs_read(set, &|digest| blobs.read(digest), out)
}

/// The chunks the chunk lists of `set` name, in the lists' order (repeats kept: the caller
/// dedups). A chunk list that cannot be read is an error: exporting a broken checkpoint
/// would only move the break elsewhere.
pub(crate) fn chunks_in_order(set: &ImageSet, blobs: &BlobStore) -> Result<Vec<Digest>> {
    let mut out = Vec::new();
    for image in &set.files {
        if let ImageContent::Chunked { chunk_list, .. } = &image.content {
            let list = blobs.read(chunk_list)?;
            out.extend(list.chunks_exact(32).map(|d| Digest(d.try_into().expect("chunks_exact yields 32 bytes"))));
        }
    }
    Ok(out)
}

/// [`referenced_blobs`], the chunk lists read through `read` (a batch not yet published holds them).
pub(crate) fn referenced_blobs_read(
    set: &ImageSet,
    read: &dyn Fn(&Digest) -> Result<Vec<u8>>,
    out: &mut HashSet<Digest>,
) -> Result<()> {
    for image in &set.files {
        match &image.content {
            ImageContent::Whole { blob } => {
                out.insert(*blob);
            }
            ImageContent::Chunked { chunk_list, .. } => {
                out.insert(*chunk_list);
                if let Ok(list) = read(chunk_list) {
                    for digest in list.chunks_exact(32) {
                        out.insert(Digest(digest.try_into().expect("chunks_exact yields 32 bytes")));
                    }
                } else {
                    // An unreadable chunk list already breaks this checkpoint; keeping its
                    // chunks would not repair it, and dropping them cannot hurt another one.
                    tracing::warn!(chunk_list = %chunk_list, "chunk list unreadable: its chunks are not counted as referenced");
                }
            }
        }
    }
    Ok(())
}
