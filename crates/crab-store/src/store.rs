//! Content-addressed blob store: `blobs/<2 hex>/<62 hex>` under the state directory. A blob of
//! up to 64 KiB (a page chunk, a small file) lives in a pack with the other small blobs of its
//! batch, and its name is a link to its place there ([`super::pack`]); a larger one is a file of
//! its own.
//!
//! A blob name is visible only once its content is durable: tmp file → fsync → rename → fsync
//! dir. A [`WriteBatch`] holds one turn's blobs as tmp files (small ones appended to a tmp
//! pack) and publishes them together: writeback of all started, then an fsync each (one
//! journal commit, the rest find it done), the renames, the links to packed blobs once their
//! packs' names are durable, an fsync of each fan-out directory touched. Never a flush of the
//! whole file system, which would write other sandboxes' data too (see
//! [`WriteBatch::commit_paced`]).

use rustix::fs::OFlags;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use super::error::{CheckpointError, IoContext, Result};
use super::index::{self, PackIndex};
use super::pack::{PACK_LIMIT, PACKED_MAX, PackBuilder, PackId, PackRef};
use super::sys;

/// Files up to this size are hashed in memory before anything is written, so a duplicate costs
/// no write at all; larger ones are hashed while being streamed into a tmp file.
const IN_MEMORY_LIMIT: usize = 1 << 20;

/// A SHA-256 content digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub fn of(data: &[u8]) -> Self {
        Digest(Sha256::digest(data).into())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.to_hex())
    }
}

impl FromStr for Digest {
    type Err = CheckpointError;

    fn from_str(s: &str) -> Result<Self> {
        let invalid = || CheckpointError::InvalidDigest(s.to_owned());
        if s.len() != 64 || s.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(invalid());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| invalid())?;
        Ok(Digest(out))
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Paces a write-out: its new bytes are drawn in chunks, each chunk's bytes reaching the disk
/// before the next draw, so the disk sees the granted rate (the node's token bucket) instead of
/// a whole checkpoint at once. Called from the store's blocking code.
pub trait WriteTokens {
    /// Largest draw; None: no limit, nothing to pace.
    fn chunk_bytes(&self) -> Option<u64>;
    /// Returns once `bytes` more may go to the disk. An error stops the write-out: nothing of
    /// it is published.
    fn draw(&mut self, bytes: u64) -> Result<()>;
}

/// No pacing: the kernel writes back when the final flush asks.
pub struct Unlimited;

impl WriteTokens for Unlimited {
    fn chunk_bytes(&self) -> Option<u64> {
        None
    }

    fn draw(&mut self, _bytes: u64) -> Result<()> {
        Ok(())
    }
}

/// Checkpoint traffic since the store was opened: what callers asked to store versus what
/// actually reached the disk as new blobs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub logical_bytes: u64,
    pub written_bytes: u64,
    pub blobs_written: u64,
    pub blobs_deduplicated: u64,
}

impl std::ops::AddAssign<&Traffic> for Traffic {
    fn add_assign(&mut self, other: &Traffic) {
        self.logical_bytes += other.logical_bytes;
        self.written_bytes += other.written_bytes;
        self.blobs_written += other.blobs_written;
        self.blobs_deduplicated += other.blobs_deduplicated;
    }
}

#[derive(Default)]
struct TrafficCounters {
    logical_bytes: AtomicU64,
    written_bytes: AtomicU64,
    blobs_written: AtomicU64,
    blobs_deduplicated: AtomicU64,
}

/// Where a blob's bytes are on disk (for tools and tests that look at the store's files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlobLocation {
    /// A file of its own, `blobs/<2 hex>/<62 hex>`.
    File(PathBuf),
    /// `len` bytes at `offset` of the pack file `pack`.
    Packed { pack: PathBuf, offset: u64, len: u64 },
}

/// A blob opened for reading.
enum Opened {
    Loose { file: File, path: PathBuf },
    Packed { file: File, path: PathBuf, at: PackRef },
}

/// Pack files a reader keeps open while it reads many chunks (a restore's worker); dropped
/// with the reader, so a pack GC removed is not kept on the disk by a long-lived process.
#[derive(Default)]
pub(crate) struct OpenPacks {
    files: HashMap<PackId, (File, PathBuf)>,
}

/// More packs than this open at once in one reader: all are closed and opened again as needed
/// (a restore reads a chain's packs, a few per turn).
const OPEN_PACKS_MAX: usize = 64;

pub struct BlobStore {
    blobs: PathBuf,
    /// `blobs/` as an `O_PATH` anchor: restores open tens of thousands of chunks, and a lookup
    /// relative to it skips walking the state directory's path every time.
    blobs_fd: OwnedFd,
    packs: PathBuf,
    packs_fd: OwnedFd,
    /// Where each packed blob is (see [`super::index`]).
    index: PackIndex,
    tmp: PathBuf,
    traffic: TrafficCounters,
    tmp_seq: AtomicU64,
}

impl BlobStore {
    /// Opens (creating if needed) the blob tree under `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Self> {
        let blobs = state_dir.join("blobs");
        let tmp = state_dir.join("tmp");
        sys::create_private_dir_all(&tmp).io_ctx("create", &tmp)?;
        // Fan-out directories are made once up front so blob writes never have to create and
        // fsync a parent directory.
        if !blobs.join("ff").is_dir() {
            for i in 0..=255u8 {
                let dir = blobs.join(format!("{i:02x}"));
                sys::create_private_dir_all(&dir).io_ctx("create", &dir)?;
            }
            sys::fsync_dir(&blobs).io_ctx("fsync", &blobs)?;
            sys::fsync_dir(state_dir).io_ctx("fsync", state_dir)?;
        }
        let packs = state_dir.join("packs");
        if !packs.is_dir() {
            sys::create_private_dir_all(&packs).io_ctx("create", &packs)?;
            sys::fsync_dir(state_dir).io_ctx("fsync", state_dir)?;
        }
        let blobs_fd = sys::open_dir_path(&blobs).io_ctx("open", &blobs)?;
        let packs_fd = sys::open_dir_path(&packs).io_ctx("open", &packs)?;
        Ok(BlobStore {
            blobs,
            blobs_fd,
            index: PackIndex::new(packs.clone(), tmp.clone()),
            packs,
            packs_fd,
            tmp,
            traffic: TrafficCounters::default(),
            tmp_seq: AtomicU64::new(0),
        })
    }

    /// The blob's name: a file of its own (or, in a store written before pack tables, a link
    /// to its place in a pack). A packed blob has no name of its own.
    pub fn path_of(&self, digest: &Digest) -> PathBuf {
        let hex = digest.to_hex();
        self.blobs.join(&hex[..2]).join(&hex[2..])
    }

    pub(crate) fn packs_dir(&self) -> &Path {
        &self.packs
    }

    pub(crate) fn pack_path(&self, id: PackId) -> PathBuf {
        self.packs.join(id.file_name())
    }

    /// The pack's table: where each of its blobs is.
    pub(crate) fn table_path(&self, id: PackId) -> PathBuf {
        self.packs.join(index::table_name(id))
    }

    /// Writes the table of a closed pack to a tmp file (unsynced: published with its pack);
    /// returns the tmp file and its size.
    pub(crate) fn write_table(&self, id: PackId, places: &[(Digest, PackRef)]) -> Result<(PathBuf, u64)> {
        let entries: Vec<index::Entry> = places.iter().map(|&(digest, at)| index::Entry { digest, at }).collect();
        let bytes = index::encode(&std::collections::BTreeSet::from([id]), &entries)?;
        let (tmp, ()) = self.write_tmp(|f, tmp| f.write_all(&bytes).io_ctx("write", tmp))?;
        Ok((tmp, bytes.len() as u64))
    }

    /// The blob's name relative to `blobs/`.
    fn rel_name(digest: &Digest) -> std::ffi::CString {
        let hex = digest.to_hex();
        sys::cstr(format!("{}/{}", &hex[..2], &hex[2..]).as_bytes()).expect("hex has no NUL")
    }

    /// Where a stored blob is: Some(place in a pack), or None for a file of its own. The pack
    /// index first; then the blob's name; and when neither has it, the index again after
    /// listing the packs published since this process last looked.
    pub(crate) fn pack_ref(&self, digest: &Digest) -> Result<Option<PackRef>> {
        if let Some(at) = self.index.find(digest)? {
            return Ok(Some(at));
        }
        match self.tree_ref(digest) {
            Err(CheckpointError::MissingBlob { digest: hex, path }) => {
                self.index.refresh()?;
                match self.index.find(digest)? {
                    Some(at) => Ok(Some(at)),
                    None => Err(CheckpointError::MissingBlob { digest: hex, path }),
                }
            }
            found => found,
        }
    }

    /// Writes a merged pack table of every indexed pack (GC, once it has removed packs).
    pub(crate) fn rebuild_index(&self) -> Result<()> {
        self.index.rebuild()
    }

    /// Where the blob's name says its bytes are: Some(place in a pack) for a link (written
    /// before pack tables), None for a file of its own. A name that is neither a file nor a
    /// well-formed link is an error.
    pub(crate) fn tree_ref(&self, digest: &Digest) -> Result<Option<PackRef>> {
        match sys::readlinkat(self.blobs_fd.as_fd(), &Self::rel_name(digest)) {
            Ok(target) => match PackRef::parse(&target) {
                Some(at) => Ok(Some(at)),
                None => Err(CheckpointError::BadPackLink {
                    path: self.path_of(digest),
                    target: String::from_utf8_lossy(&target).into_owned(),
                }),
            },
            // Not a link: a file of its own.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(CheckpointError::MissingBlob { digest: digest.to_hex(), path: self.path_of(digest) })
            }
            Err(e) => Err(e).io_ctx("readlink", self.path_of(digest)),
        }
    }

    /// Where a stored blob's bytes are now (the packs listed again: for tools and tests, which
    /// may look after another process moved it).
    pub fn location(&self, digest: &Digest) -> Result<BlobLocation> {
        self.index.refresh()?;
        Ok(match self.pack_ref(digest)? {
            Some(at) => BlobLocation::Packed { pack: self.pack_path(at.id), offset: at.offset, len: at.len },
            None => BlobLocation::File(self.path_of(digest)),
        })
    }

    /// The size of a stored blob; None when the store does not have it.
    pub fn size_of(&self, digest: &Digest) -> Result<Option<u64>> {
        match self.pack_ref(digest) {
            Ok(Some(at)) => Ok(Some(at.len)),
            Ok(None) => {
                let path = self.path_of(digest);
                match fs::symlink_metadata(&path) {
                    Ok(meta) => Ok(Some(meta.len())),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(e).io_ctx("stat", path),
                }
            }
            Err(CheckpointError::MissingBlob { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn open_pack(&self, id: PackId) -> std::io::Result<File> {
        let name = sys::cstr(id.file_name().as_bytes()).expect("hex has no NUL");
        sys::openat(self.packs_fd.as_fd(), &name, OFlags::RDONLY | OFlags::NOATIME, 0).map(File::from)
    }

    pub(crate) fn blobs_dir(&self) -> &Path {
        &self.blobs
    }

    pub(crate) fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    /// True when the store has the blob, as far as this process last listed the packs.
    pub fn contains(&self, digest: &Digest) -> bool {
        matches!(self.index.find(digest), Ok(Some(_))) || fs::symlink_metadata(self.path_of(digest)).is_ok()
    }

    /// [`contains`](Self::contains) for a blob of `len` bytes, looked for only where a blob of
    /// that size is written: a small one in the pack index (no `stat` for one that is not
    /// stored; one a store before pack tables named by a link is not found, and stored again),
    /// a large one by its name. What a batch's deduplication does.
    pub fn contains_sized(&self, digest: &Digest, len: u64) -> bool {
        if len as usize <= PACKED_MAX {
            matches!(self.index.find(digest), Ok(Some(_)))
        } else {
            fs::symlink_metadata(self.path_of(digest)).is_ok()
        }
    }

    pub fn traffic(&self) -> Traffic {
        let c = &self.traffic;
        Traffic {
            logical_bytes: c.logical_bytes.load(Ordering::Relaxed),
            written_bytes: c.written_bytes.load(Ordering::Relaxed),
            blobs_written: c.blobs_written.load(Ordering::Relaxed),
            blobs_deduplicated: c.blobs_deduplicated.load(Ordering::Relaxed),
        }
    }

    fn record(&self, t: &Traffic) {
        let c = &self.traffic;
        c.logical_bytes.fetch_add(t.logical_bytes, Ordering::Relaxed);
        c.written_bytes.fetch_add(t.written_bytes, Ordering::Relaxed);
        c.blobs_written.fetch_add(t.blobs_written, Ordering::Relaxed);
        c.blobs_deduplicated.fetch_add(t.blobs_deduplicated, Ordering::Relaxed);
    }

    pub(crate) fn tmp_path(&self, what: &str) -> PathBuf {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        self.tmp.join(format!("{what}-{}-{seq}", std::process::id()))
    }

    /// A batch of new blobs, deduplicated against every blob stored when it begins (and those
    /// this process stores meanwhile).
    pub fn batch(&self) -> WriteBatch<'_> {
        self.resume(PendingBlobs::default())
    }

    /// Continues a batch set aside with [`WriteBatch::set_aside`].
    pub(crate) fn resume(&self, blobs: PendingBlobs) -> WriteBatch<'_> {
        // A blob another process stored since and missed here is only stored twice.
        if let Err(e) = self.index.refresh() {
            tracing::warn!(error = %e, "pack index not refreshed: this batch may store blobs the store has");
        }
        WriteBatch { store: self, blobs }
    }

    /// Creates a tmp file for a new blob and fills it through `fill`; the file is removed when
    /// anything fails, so a full disk leaves no half blob behind.
    fn write_tmp<T>(&self, fill: impl FnOnce(&mut File, &Path) -> Result<T>) -> Result<(PathBuf, T)> {
        let tmp = self.tmp_path("blob");
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            // Read-only, and root's alone: blobs are sandboxes' files and memory.
            .mode(0o400)
            .open(&tmp)
            .io_ctx("create", &tmp)?;
        match fill(&mut file, &tmp) {
            Ok(value) => Ok((tmp, value)),
            Err(e) => {
                drop(file);
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Stores one blob durably on its own.
    pub fn put(&self, data: &[u8]) -> Result<Digest> {
        let mut batch = self.batch();
        let digest = batch.put_bytes(data)?;
        batch.commit()?;
        Ok(digest)
    }

    fn open_blob(&self, digest: &Digest) -> Result<Opened> {
        // Twice at most: GC may rewrite a pack (and publish its new table) between the lookup and
        // the open.
        for retry in [false, true] {
            let Some(at) = self.pack_ref(digest)? else {
                let (file, path) = self.open_loose(digest)?;
                return Ok(Opened::Loose { file, path });
            };
            let path = self.pack_path(at.id);
            fail::fail_point!("blobs-open-pack");
            match self.open_pack(at.id) {
                Ok(file) => return Ok(Opened::Packed { file, path, at }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !retry => {
                    self.index.refresh()?;
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::MissingBlob { digest: digest.to_hex(), path });
                }
                Err(e) => return Err(e).io_ctx("open", path),
            }
        }
        unreachable!("the second pass returns")
    }

    /// Opens a blob that is a file of its own.
    fn open_loose(&self, digest: &Digest) -> Result<(File, PathBuf)> {
        let path = self.path_of(digest);
        // O_NOATIME: the first read of a freshly written blob would otherwise dirty its inode
        // (relatime). O_NOFOLLOW: the name was a file a moment ago; a link is never followed.
        let flags = OFlags::RDONLY | OFlags::NOATIME | OFlags::NOFOLLOW;
        match sys::openat(self.blobs_fd.as_fd(), &Self::rel_name(digest), flags, 0) {
            Ok(fd) => Ok((File::from(fd), path)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(CheckpointError::MissingBlob { digest: digest.to_hex(), path })
            }
            Err(e) => Err(e).io_ctx("open", path),
        }
    }

    /// Reads a packed blob's bytes and checks them against its name.
    fn read_packed(digest: &Digest, file: &File, path: &Path, at: PackRef) -> Result<Vec<u8>> {
        let mut data = vec![0u8; at.len as usize];
        file.read_exact_at(&mut data, at.offset).io_ctx("read", path)?;
        let actual: [u8; 32] = Sha256::digest(&data).into();
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path.to_owned(), actual));
        }
        Ok(data)
    }

    fn corrupt(digest: &Digest, path: PathBuf, actual: [u8; 32]) -> CheckpointError {
        CheckpointError::CorruptBlob { digest: digest.to_hex(), path, actual: hex::encode(actual) }
    }

    /// Reads a whole blob, refusing it unless it hashes to its name.
    pub fn read(&self, digest: &Digest) -> Result<Vec<u8>> {
        let (mut file, path) = match self.open_blob(digest)? {
            Opened::Loose { file, path } => (file, path),
            Opened::Packed { file, path, at } => return Self::read_packed(digest, &file, &path, at),
        };
        let mut data = Vec::new();
        file.read_to_end(&mut data).io_ctx("read", &path)?;
        let actual: [u8; 32] = Sha256::digest(&data).into();
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path, actual));
        }
        Ok(data)
    }

    /// Reads a small blob (a page chunk) into `buf` with a single `read` and verifies it;
    /// returns its length. `buf` should be one byte longer than the blob is expected to be, so
    /// a longer blob shows as one. A regular file yields all it has up to the buffer's size in
    /// one read; whatever does come back is hashed, so a short read could only cause a refusal,
    /// never let other bytes through. This skips `read_to_end`'s stat, seek and EOF probe,
    /// which cost more than the read itself for a 4 KiB chunk.
    /// A packed chunk is read from a pack file `open` keeps open, with one positioned read.
    pub(crate) fn read_small_into(&self, digest: &Digest, buf: &mut [u8], open: &mut OpenPacks) -> Result<usize> {
        // Twice at most, as in open_blob: GC may have moved the blob to a rewritten pack.
        for retry in [false, true] {
            let Some(at) = self.pack_ref(digest)? else { break };
            match self.read_small_packed(digest, buf, open, at) {
                Err(CheckpointError::MissingBlob { .. }) if !retry => {
                    self.index.refresh()?;
                    continue;
                }
                done => return done,
            }
        }
        let (mut file, path) = self.open_loose(digest)?;
        let n = file.read(buf).io_ctx("read", &path)?;
        let actual: [u8; 32] = Sha256::digest(&buf[..n]).into();
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path, actual));
        }
        Ok(n)
    }

    fn read_small_packed(&self, digest: &Digest, buf: &mut [u8], open: &mut OpenPacks, at: PackRef) -> Result<usize> {
        if !open.files.contains_key(&at.id) {
            let path = self.pack_path(at.id);
            fail::fail_point!("blobs-open-pack");
            let file = match self.open_pack(at.id) {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::MissingBlob { digest: digest.to_hex(), path });
                }
                Err(e) => return Err(e).io_ctx("open", path),
            };
            if open.files.len() >= OPEN_PACKS_MAX {
                open.files.clear();
            }
            open.files.insert(at.id, (file, path));
        }
        let (file, path) = &open.files[&at.id];
        // A blob longer than the buffer reads as the buffer's worth, which cannot hash right:
        // the caller sized the buffer one byte over what it expects.
        let n = (at.len as usize).min(buf.len());
        file.read_exact_at(&mut buf[..n], at.offset).io_ctx("read", path)?;
        let actual: [u8; 32] = Sha256::digest(&buf[..n]).into();
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path.clone(), actual));
        }
        Ok(n)
    }

    /// Hashes a blob without keeping it; returns its size.
    pub fn verify(&self, digest: &Digest) -> Result<u64> {
        let (mut file, path) = match self.open_blob(digest)? {
            Opened::Loose { file, path } => (file, path),
            Opened::Packed { file, path, at } => {
                return Self::read_packed(digest, &file, &path, at).map(|data| data.len() as u64);
            }
        };
        let (actual, size) = hash_reader(&mut file).io_ctx("read", &path)?;
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path, actual));
        }
        Ok(size)
    }

    /// Writes a blob's content into `dst` at its current offset. Small blobs are verified in
    /// memory before the first byte reaches `dst`; large ones are verified in a first pass and
    /// then copied in the kernel, so `dst` never receives unverified content.
    pub fn copy_verified(&self, digest: &Digest, dst: &File, dst_path: &Path) -> Result<u64> {
        let (mut file, path) = match self.open_blob(digest)? {
            Opened::Loose { file, path } => (file, path),
            Opened::Packed { file, path, at } => {
                let data = Self::read_packed(digest, &file, &path, at)?;
                let mut dst = dst;
                dst.write_all(&data).io_ctx("write", dst_path)?;
                return Ok(data.len() as u64);
            }
        };
        let len = file.metadata().io_ctx("stat", &path)?.len();
        if len as usize <= IN_MEMORY_LIMIT {
            let mut data = Vec::with_capacity(len as usize);
            file.read_to_end(&mut data).io_ctx("read", &path)?;
            let actual: [u8; 32] = Sha256::digest(&data).into();
            if actual != digest.0 {
                return Err(Self::corrupt(digest, path, actual));
            }
            let mut dst = dst;
            dst.write_all(&data).io_ctx("write", dst_path)?;
            return Ok(len);
        }
        let (actual, size) = hash_reader(&mut file).io_ctx("read", &path)?;
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path, actual));
        }
        sys::copy_file_range_all(&file, dst, size).io_ctx("copy_file_range", dst_path)?;
        Ok(size)
    }
}

impl BlobStore {
    /// Writes a blob's content into the byte ranges `extents` of `dst`, in order (a sparse
    /// file's data, see [`FsNode::File`](super::manifest::FsNode::File)). The blob is verified
    /// in a first pass, so `dst` never receives unverified content; it must be exactly as long
    /// as the ranges together.
    pub(crate) fn copy_verified_to_extents(
        &self,
        digest: &Digest,
        dst: &File,
        extents: &[super::manifest::Extent],
        dst_path: &Path,
    ) -> Result<u64> {
        let wanted: u64 = extents.iter().map(|e| e.len()).sum();
        let (mut file, path) = match self.open_blob(digest)? {
            Opened::Loose { file, path } => (file, path),
            Opened::Packed { file, path, at } => {
                let data = Self::read_packed(digest, &file, &path, at)?;
                write_to_extents(&data, dst, extents, dst_path)?;
                return Ok(data.len() as u64);
            }
        };
        let (actual, size) = hash_reader(&mut file).io_ctx("read", &path)?;
        if actual != digest.0 {
            return Err(Self::corrupt(digest, path, actual));
        }
        if wanted != size {
            return Err(CheckpointError::BadExtents {
                path: dst_path.to_owned(),
                reason: format!("its extents hold {wanted} bytes, its blob {size}"),
            });
        }
        let mut from = 0;
        for extent in extents {
            sys::copy_file_range_at(&file, from, dst, extent.offset(), extent.len())
                .io_ctx("copy_file_range", dst_path)?;
            from += extent.len();
        }
        Ok(size)
    }
}

/// Writes `data` into the byte ranges `extents` of `dst`, in order; they must hold exactly its
/// length.
pub(crate) fn write_to_extents(
    data: &[u8],
    dst: &File,
    extents: &[super::manifest::Extent],
    dst_path: &Path,
) -> Result<()> {
    let wanted: u64 = extents.iter().map(|e| e.len()).sum();
    if wanted != data.len() as u64 {
        return Err(CheckpointError::BadExtents {
            path: dst_path.to_owned(),
            reason: format!("its extents hold {wanted} bytes, its blob {}", data.len()),
        });
    }
    let mut from = 0usize;
    for extent in extents {
        let piece = &data[from..from + extent.len() as usize];
        dst.write_all_at(piece, extent.offset()).io_ctx("write", dst_path)?;
        from += piece.len();
    }
    Ok(())
}

fn hash_reader(r: &mut impl Read) -> std::io::Result<([u8; 32], u64)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok((hasher.finalize().into(), total));
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
}

/// Blobs written to tmp files but not yet visible: the state of a [`WriteBatch`], owned so that
/// a captured turn can wait for its write-out without borrowing the store. Dropping it removes
/// its tmp files.
#[derive(Default)]
pub(crate) struct PendingBlobs {
    /// Files to publish, as (tmp, final path): blobs of their own and closed packs.
    pending: Vec<(PathBuf, PathBuf)>,
    /// The pack small blobs are appended to now.
    filling: Option<PackBuilder>,
    /// The tmp file of each pack of this batch, closed or filling, in order.
    pack_tmps: Vec<PathBuf>,
    /// The closed packs, published with their tables.
    closed_packs: Vec<PackId>,
    seen: HashSet<Digest>,
    /// The place and size of each queued blob (the quota counts them before they are
    /// published).
    queued: HashMap<Digest, (Queued, u64)>,
    traffic: Traffic,
}

/// Where a queued blob waits.
#[derive(Clone, Copy)]
enum Queued {
    /// `pending[index]`.
    Own(usize),
    /// At `offset` of the pack `pack_tmps[pack]`.
    Packed { pack: usize, offset: u64 },
}

impl PendingBlobs {
    /// Bytes that publishing these blobs will write.
    pub(crate) fn new_bytes(&self) -> u64 {
        self.traffic.written_bytes
    }
}

impl Drop for PendingBlobs {
    fn drop(&mut self) {
        for (tmp, _) in self.pending.drain(..) {
            let _ = fs::remove_file(tmp);
        }
        if let Some(pack) = self.filling.take() {
            let _ = fs::remove_file(&pack.tmp);
        }
    }
}

/// Blobs of one turn, written to tmp files and made visible together by [`WriteBatch::commit`].
/// Dropping an uncommitted batch removes its tmp files.
pub struct WriteBatch<'a> {
    store: &'a BlobStore,
    blobs: PendingBlobs,
}

impl WriteBatch<'_> {
    /// True when the digest is already stored or queued here; counts the dedup. Looked up as
    /// [`BlobStore::contains_sized`] does (a small blob that a store written before pack tables
    /// named by a link is stored again, until GC moves it into an indexed pack).
    fn known(&mut self, digest: &Digest, len: u64) -> bool {
        self.blobs.traffic.logical_bytes += len;
        if self.blobs.seen.contains(digest) || self.store.contains_sized(digest, len) {
            self.blobs.traffic.blobs_deduplicated += 1;
            return true;
        }
        false
    }

    fn count_new(&mut self, digest: Digest, queued: Queued, len: u64) {
        let blobs = &mut self.blobs;
        blobs.seen.insert(digest);
        blobs.queued.insert(digest, (queued, len));
        blobs.traffic.written_bytes += len;
        blobs.traffic.blobs_written += 1;
    }

    fn queue(&mut self, digest: Digest, tmp: PathBuf, len: u64) {
        self.blobs.pending.push((tmp, self.store.path_of(&digest)));
        self.count_new(digest, Queued::Own(self.blobs.pending.len() - 1), len);
    }

    /// Appends a small blob to the batch's pack, beginning a new pack when it is full.
    fn queue_packed(&mut self, digest: Digest, data: &[u8]) -> Result<()> {
        let full = self.blobs.filling.as_ref().is_some_and(|pack| pack.len() + data.len() as u64 > PACK_LIMIT);
        if full {
            self.close_pack()?;
        }
        if self.blobs.filling.is_none() {
            let tmp = self.store.tmp_path("pack");
            self.blobs.filling = Some(PackBuilder::create(tmp.clone())?);
            self.blobs.pack_tmps.push(tmp);
        }
        let offset = self.blobs.filling.as_mut().expect("a pack is filling").append(digest, data)?;
        let pack = self.blobs.pack_tmps.len() - 1;
        self.count_new(digest, Queued::Packed { pack, offset }, data.len() as u64);
        Ok(())
    }

    /// Closes the filling pack: it is published with the batch's files, its table after it.
    fn close_pack(&mut self) -> Result<()> {
        let Some(pack) = self.blobs.filling.take() else { return Ok(()) };
        let tmp = pack.tmp.clone();
        let closed = match pack.finish() {
            Ok(closed) => closed,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        self.blobs.pending.push((closed.tmp, self.store.pack_path(closed.id)));
        let (table, table_len) = self.store.write_table(closed.id, &closed.places)?;
        self.blobs.pending.push((table, self.store.table_path(closed.id)));
        // Bytes the disk takes like the blobs' (the quota and the node's bucket count them).
        self.blobs.traffic.written_bytes += table_len;
        self.blobs.closed_packs.push(closed.id);
        Ok(())
    }

    /// True when this batch stores the blob from bytes it was handed and hashed itself (a
    /// blob it found stored already, or being stored by another batch, is not its own).
    pub fn wrote(&self, digest: &Digest) -> bool {
        self.blobs.queued.contains_key(digest)
    }

    /// The size of a blob queued in this batch (None: not queued here).
    pub(crate) fn queued_len(&self, digest: &Digest) -> Option<u64> {
        self.blobs.queued.get(digest).map(|&(_, len)| len)
    }

    /// Reads a blob queued in this batch or already stored, verified against its name.
    pub(crate) fn read(&self, digest: &Digest) -> Result<Vec<u8>> {
        let Some(&(queued, len)) = self.blobs.queued.get(digest) else { return self.store.read(digest) };
        let (tmp, data) = match queued {
            Queued::Own(index) => {
                let tmp = &self.blobs.pending[index].0;
                (tmp, fs::read(tmp).io_ctx("read", tmp)?)
            }
            Queued::Packed { pack, offset } => {
                let tmp = &self.blobs.pack_tmps[pack];
                let data = match &self.blobs.filling {
                    Some(filling) if pack + 1 == self.blobs.pack_tmps.len() => filling.read_at(offset, len)?,
                    _ => {
                        let mut data = vec![0u8; len as usize];
                        File::open(tmp).and_then(|f| f.read_exact_at(&mut data, offset)).io_ctx("read", tmp)?;
                        data
                    }
                };
                (tmp, data)
            }
        };
        let actual: [u8; 32] = Sha256::digest(&data).into();
        if actual != digest.0 {
            return Err(BlobStore::corrupt(digest, tmp.clone(), actual));
        }
        Ok(data)
    }

    /// Keeps what was written so far, unflushed, for [`BlobStore::resume`].
    pub(crate) fn set_aside(self) -> PendingBlobs {
        self.blobs
    }

    pub fn put_bytes(&mut self, data: &[u8]) -> Result<Digest> {
        let digest = Digest::of(data);
        self.put_verified(digest, data)?;
        Ok(digest)
    }

    /// Stores bytes the caller has just hashed to `digest` (a registry pull checks every object
    /// it unpacks against its name), without hashing them again. Every read hashes what it
    /// returns, so a wrong digest here could only make reads of that name refuse the blob,
    /// never hand out other bytes under it.
    pub fn put_verified(&mut self, digest: Digest, data: &[u8]) -> Result<()> {
        debug_assert_eq!(Digest::of(data), digest, "put_verified given bytes of another digest");
        if self.known(&digest, data.len() as u64) {
            return Ok(());
        }
        if data.len() <= PACKED_MAX {
            return self.queue_packed(digest, data);
        }
        let (tmp, ()) = self.store.write_tmp(|f, tmp| f.write_all(data).io_ctx("write", tmp))?;
        self.queue(digest, tmp, data.len() as u64);
        Ok(())
    }

    /// Stores what `src` yields until EOF; returns the digest and size of exactly the bytes
    /// read, so a file changing under us still gets a self-consistent blob.
    pub fn put_reader(&mut self, src: &mut impl Read, src_path: &Path) -> Result<(Digest, u64)> {
        let mut head = Vec::with_capacity(64 * 1024);
        src.take(IN_MEMORY_LIMIT as u64 + 1).read_to_end(&mut head).io_ctx("read", src_path)?;
        if head.len() <= IN_MEMORY_LIMIT {
            let digest = self.put_bytes(&head)?;
            return Ok((digest, head.len() as u64));
        }
        let (tmp, (digest, total)) = self.store.write_tmp(|out, tmp| {
            let mut hasher = Sha256::new();
            hasher.update(&head);
            out.write_all(&head).io_ctx("write", tmp)?;
            let mut total = head.len() as u64;
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                let n = src.read(&mut buf).io_ctx("read", src_path)?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n]).io_ctx("write", tmp)?;
                total += n as u64;
            }
            Ok((Digest(hasher.finalize().into()), total))
        })?;
        if self.known(&digest, total) {
            fs::remove_file(&tmp).io_ctx("remove", &tmp)?;
        } else {
            self.queue(digest, tmp, total);
        }
        Ok((digest, total))
    }

    /// Makes every queued blob durable and visible; returns this batch's traffic.
    pub fn commit(self) -> Result<Traffic> {
        self.commit_paced(&mut Unlimited)
    }

    /// Like [`commit`](Self::commit), with the new bytes written back chunk by chunk as
    /// `tokens` grants them; the flushes after that find them on disk already.
    pub fn commit_paced(mut self, tokens: &mut dyn WriteTokens) -> Result<Traffic> {
        self.close_pack()?;
        if let Some(chunk) = tokens.chunk_bytes() {
            self.write_back_paced(chunk.max(1), tokens)?;
        }
        self.flush()?;
        self.blobs.pending.clear();
        self.blobs.pack_tmps.clear();
        self.blobs.closed_packs.clear();
        self.blobs.queued.clear();
        self.store.record(&self.blobs.traffic);
        Ok(self.blobs.traffic)
    }

    /// Draws the pending blobs' bytes `chunk` at a time (many small blobs share a draw, a large
    /// one takes several) and writes each chunk back before drawing the next.
    fn write_back_paced(&self, chunk: u64, tokens: &mut dyn WriteTokens) -> Result<()> {
        // (blob index, offset, length) ranges paid by the current draw.
        let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
        let mut drawn = 0u64;
        let pending = &self.blobs.pending;
        let mut write_back = |ranges: &mut Vec<(usize, u64, u64)>, bytes: u64| -> Result<()> {
            tokens.draw(bytes)?;
            // All of the chunk's writes are queued first, then waited for: the disk gets them
            // together instead of one small file at a time.
            for wait in [false, true] {
                for &(index, offset, len) in ranges.iter() {
                    let tmp = &pending[index].0;
                    let file = File::open(tmp).io_ctx("open", tmp)?;
                    sys::write_back_range(&file, offset, len, wait).io_ctx("sync_file_range", tmp)?;
                }
            }
            ranges.clear();
            Ok(())
        };
        for (index, (tmp, _)) in pending.iter().enumerate() {
            let len = fs::metadata(tmp).io_ctx("stat", tmp)?.len();
            let mut offset = 0;
            while offset < len {
                let piece = (len - offset).min(chunk - drawn);
                ranges.push((index, offset, piece));
                offset += piece;
                drawn += piece;
                if drawn == chunk {
                    write_back(&mut ranges, drawn)?;
                    drawn = 0;
                }
            }
        }
        if drawn > 0 {
            write_back(&mut ranges, drawn)?;
        }
        Ok(())
    }

    /// Makes this batch's blobs durable and visible, and nobody else's data: starts writeback of
    /// every file (nothing left to write for those the paced write-back wrote), fsyncs each (the
    /// first fsync commits the journal transaction that holds every file's allocation, so the
    /// others find it committed), renames them into place (each pack before its table, which a
    /// reader only uses beside its pack) and fsyncs the directories they are in: `packs/` and
    /// the fan-out directories of the large blobs.
    ///
    /// Never `syncfs`, however many blobs (a CRIU dump is thousands of page chunks): it writes
    /// back every dirty page of the file system, which on a node is the other sandboxes'
    /// write-outs still queued for the bucket (they would reach the disk without their grant)
    /// and whatever the tenants' own writes to their rootfs left dirty (one tenant's gigabytes
    /// would stall everyone's commits).
    fn flush(&self) -> Result<()> {
        publish_written(&self.blobs.pending)?;
        // This process finds its own blobs from now on without listing the packs again.
        for &id in &self.blobs.closed_packs {
            self.store.index.add(id, &self.store.table_path(id));
        }
        Ok(())
    }
}

/// Publishes files written aside, `(tmp, destination)` each: starts writeback of every file,
/// fsyncs each, renames them into place in the order given (a pack before its table, which a
/// reader only uses beside its pack) and fsyncs the directories they land in. A batch's commit
/// and GC's rewritten packs are published this way.
pub(crate) fn publish_written(files: &[(PathBuf, PathBuf)]) -> Result<()> {
    // Opened once per pass rather than held: a batch of many large blobs would exceed the
    // shim's descriptor limit.
    for (tmp, _) in files {
        sys::start_writeback(&File::open(tmp).io_ctx("open", tmp)?).io_ctx("sync_file_range", tmp)?;
    }
    let tmps: Vec<&Path> = files.iter().map(|(tmp, _)| tmp.as_path()).collect();
    fsync_all(&tmps, |tmp| File::open(tmp)?.sync_all())?;
    let mut dirs = std::collections::BTreeSet::new();
    for (tmp, dst) in files {
        fs::rename(tmp, dst).io_ctx("rename", dst)?;
        dirs.insert(dst.parent().expect("published files have a parent").to_owned());
    }
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    fsync_all(&dirs, sys::fsync_dir)
}

/// Batches of more files than this are fsynced (or linked) by [`FILE_THREADS`] threads at once.
const PARALLEL_FROM: usize = 64;
const FILE_THREADS: usize = 8;

/// `fsync` of each path. A file whose data is already on disk still costs its fsync a flush of
/// the disk's cache (ext4 asks for one when the journal has nothing to commit), one after
/// another; fsyncs that arrive together share one flush (the block layer merges them), so a
/// large batch is spread over a few threads.
fn fsync_all(paths: &[&Path], fsync: impl Fn(&Path) -> std::io::Result<()> + Sync) -> Result<()> {
    in_parallel(paths, |path| fsync(path).io_ctx("fsync", path))
}

/// `work` on each item, over [`FILE_THREADS`] threads for a large batch: file system calls that
/// wait on the disk or the journal (an fsync, a new inode) overlap instead of queueing.
fn in_parallel<T: Sync>(items: &[T], work: impl Fn(&T) -> Result<()> + Sync) -> Result<()> {
    if items.len() <= PARALLEL_FROM {
        return items.iter().try_for_each(work);
    }
    let share = items.len().div_ceil(FILE_THREADS);
    std::thread::scope(|scope| {
        let workers: Vec<_> =
            items.chunks(share).map(|chunk| scope.spawn(|| chunk.iter().try_for_each(&work))).collect();
        workers.into_iter().try_for_each(|w| w.join().expect("a file thread does not panic"))
    })
}

/// Whether a published file must survive a power loss once `publish_file` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// tmp file, fsync, rename, fsync of the directory.
    Flushed,
    /// tmp file and rename only: readers see the old or the new content, never a mix, but a
    /// power loss may bring back the old one (ext4 flushes the data of a file renamed over
    /// another before the rename commits, so no empty file appears).
    AtomicOnly,
}

/// Replaces `path` with `bytes` atomically and durably (written aside, fsynced, renamed, its
/// directory fsynced), root's alone (0600); the directory is made when missing. For a small
/// file of crab's own outside the store (a saved spec that `crabctl` brings from a registry).
pub fn write_file_durably(path: &Path, bytes: &[u8]) -> Result<()> {
    static UNIQUE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("/"));
    sys::create_private_dir_all(dir).io_ctx("create", dir)?;
    let n = UNIQUE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp-{}-{n}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    publish_file(&tmp, path, bytes, Durability::Flushed)
}

/// Replaces `dst` with `data` atomically. Used for manifests, snapshots and heads.
pub(crate) fn publish_file(tmp: &Path, dst: &Path, data: &[u8], durability: Durability) -> Result<()> {
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp).io_ctx("create", tmp)?;
    let written = f.write_all(data).and_then(|()| match durability {
        Durability::Flushed => f.sync_all(),
        Durability::AtomicOnly => Ok(()),
    });
    if let Err(e) = written {
        let _ = fs::remove_file(tmp);
        return Err(e).io_ctx("write", tmp);
    }
    drop(f);
    fs::rename(tmp, dst).io_ctx("rename", dst)?;
    if durability == Durability::Flushed {
        let dir = dst.parent().unwrap_or(Path::new("/"));
        sys::fsync_dir(dir).io_ctx("fsync", dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_durable_write_replaces_the_file_whole_and_for_root_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("specs/ns/sb.json");
        write_file_durably(&path, b"first").unwrap();
        write_file_durably(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
        let left: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("sb.json")], "nothing written aside is left");
    }

    /// What a commit writes back is its own blobs, never another write-out's: the node's bucket
    /// paces each sandbox's write-out chunk by chunk, and a commit that flushed the whole file
    /// system (as one of a CRIU dump's thousands of chunks once did, with `syncfs`) sent every
    /// other sandbox's queued, ungranted bytes to the disk at once.
    #[test]
    fn a_commit_writes_back_its_own_blobs_and_no_other_write_outs() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let unwritten = |path: &Path| crab_sys::unwritten_bytes(&File::open(path).unwrap()).unwrap();
        let mut seen_clean = Vec::new();
        // Our commit flushing the other write-out cleans it every time; something outside this
        // test (another process's sync) might once, in the few ms between the two looks.
        for attempt in 0..3u8 {
            // Another sandbox's write-out, written to its tmp file and waiting for its grant.
            let mut waiting = store.batch();
            waiting.put_bytes(&[attempt; 1 << 20]).unwrap();
            let waiting_tmp = waiting.blobs.pending[0].0.clone();
            // This turn: a CRIU dump's page chunks, committed.
            let mut turn = store.batch();
            for i in 0..1000u32 {
                let mut chunk = vec![attempt; 4096];
                chunk[..4].copy_from_slice(&i.to_le_bytes());
                turn.put_bytes(&chunk).unwrap();
            }
            let chunks: Vec<Digest> = turn.blobs.queued.keys().copied().collect();
            let before = unwritten(&waiting_tmp);
            turn.commit().unwrap();
            for chunk in chunks.iter().step_by(97) {
                let BlobLocation::Packed { pack, .. } = store.location(chunk).unwrap() else {
                    panic!("a page chunk is packed")
                };
                assert_eq!(unwritten(&pack), 0, "{} is published durable", pack.display());
            }
            let after = unwritten(&waiting_tmp);
            if before == 1 << 20 && after == before {
                return;
            }
            seen_clean.push((before, after));
        }
        panic!(
            "the waiting write-out's 1 MiB reached the disk with the turn's commit (unwritten before, after): {seen_clean:?}"
        );
    }

    #[test]
    fn a_large_batch_is_fsynced_whole_and_a_failure_names_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..300).map(|i| dir.path().join(format!("f{i}"))).collect();
        for path in &paths {
            fs::write(path, b"x").unwrap();
        }
        let done = std::sync::Mutex::new(HashSet::new());
        let all: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
        fsync_all(&all, |path| {
            done.lock().unwrap().insert(path.to_owned());
            File::open(path)?.sync_all()
        })
        .unwrap();
        assert_eq!(done.into_inner().unwrap().len(), 300, "every path fsynced");
        let missing = dir.path().join("gone");
        let mut with_gap = all.clone();
        with_gap.insert(217, &missing);
        let err = fsync_all(&with_gap, |path| File::open(path)?.sync_all()).unwrap_err();
        assert!(matches!(&err, CheckpointError::Io { op: "fsync", path, .. } if *path == missing), "{err}");
    }

    #[test]
    fn identical_content_is_written_once_and_verified_on_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let a = store.put(b"hello").unwrap();
        let b = store.put(b"hello").unwrap();
        assert_eq!(a, b);
        let t = store.traffic();
        // Written: the blob and its pack's table (a header, one 44-byte entry and a checksum).
        assert_eq!((t.logical_bytes, t.written_bytes, t.blobs_written, t.blobs_deduplicated), (10, 5 + 100, 1, 1));
        assert_eq!(store.read(&a).unwrap(), b"hello");
        assert_eq!(a.to_hex(), "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
    }

    /// Overwrites `len` bytes where a blob's are (its file, or its place in its pack).
    fn tamper(store: &BlobStore, digest: &Digest) -> PathBuf {
        let (path, offset) = match store.location(digest).unwrap() {
            BlobLocation::File(path) => (path, 0),
            BlobLocation::Packed { pack, offset, .. } => (pack, offset),
        };
        fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let file = OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let mut first = [0u8; 1];
        file.read_exact_at(&mut first, offset).unwrap();
        file.write_all_at(&[first[0] ^ 1], offset).unwrap();
        path
    }

    #[test]
    fn corrupt_blob_is_refused_naming_digest_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let small = store.put(b"precious").unwrap();
        let large = store.put(&vec![7u8; PACKED_MAX + 1]).unwrap();
        assert!(matches!(store.location(&small).unwrap(), BlobLocation::Packed { .. }));
        assert_eq!(store.location(&large).unwrap(), BlobLocation::File(store.path_of(&large)));
        for d in [small, large] {
            let path = tamper(&store, &d);
            let err = store.read(&d).unwrap_err().to_string();
            assert!(err.contains(&d.to_hex()) && err.contains(&path.display().to_string()), "{err}");
            assert!(matches!(store.verify(&d), Err(CheckpointError::CorruptBlob { .. })));
            let mut buf = vec![0u8; PACKED_MAX + 2];
            let err = store.read_small_into(&d, &mut buf, &mut OpenPacks::default()).unwrap_err();
            assert!(matches!(err, CheckpointError::CorruptBlob { .. }), "{err}");
        }
    }

    /// A dump's page chunks go into one pack file with its table, none with a name of its own
    /// in the blob tree, and another store over the same directory (another process) finds and
    /// reads them.
    #[test]
    fn small_blobs_of_a_batch_share_one_pack_that_every_opener_reads() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let chunks: Vec<Vec<u8>> = (0..3000u32).map(|i| [i.to_le_bytes().as_slice(), &[9u8; 4092]].concat()).collect();
        let mut batch = store.batch();
        let digests: Vec<Digest> = chunks.iter().map(|c| batch.put_bytes(c).unwrap()).collect();
        // Readable from the batch before it is published: from the tmp pack, and from what it
        // still holds in memory.
        assert_eq!(batch.read(&digests[1234]).unwrap(), chunks[1234]);
        assert_eq!(batch.read(&digests[2999]).unwrap(), chunks[2999]);
        assert!(!store.contains(&digests[0]), "nothing is visible before the commit");
        let traffic = batch.commit().unwrap();
        let packs = pack_files(dir.path());
        let table = fs::metadata(packs[0].with_extension("idx")).unwrap().len();
        assert_eq!(table, 16 + 8 + 3000 * 44 + 32, "44 bytes a chunk");
        assert_eq!((traffic.blobs_written, traffic.written_bytes), (3000, 3000 * 4096 + table));
        assert_eq!(packs.len(), 1, "{packs:?}");
        assert_eq!(fs::metadata(&packs[0]).unwrap().len(), 3000 * 4096);
        assert!(packs[0].with_extension("idx").is_file(), "the pack's table is beside it");
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0, "no tmp file left");
        let names: usize =
            fs::read_dir(store.blobs_dir()).unwrap().map(|d| fs::read_dir(d.unwrap().path()).unwrap().count()).sum();
        assert_eq!(names, 0, "a packed blob has no name of its own");

        let other = BlobStore::open(dir.path()).unwrap();
        let mut open = OpenPacks::default();
        let mut buf = vec![0u8; 4097];
        for (digest, chunk) in digests.iter().zip(&chunks).step_by(7) {
            assert!(other.contains(digest));
            assert_eq!(other.size_of(digest).unwrap(), Some(4096));
            assert_eq!(other.read(digest).unwrap(), *chunk);
            let n = other.read_small_into(digest, &mut buf, &mut open).unwrap();
            assert_eq!(&buf[..n], chunk.as_slice());
            assert_eq!(
                other.location(digest).unwrap(),
                BlobLocation::Packed {
                    pack: packs[0].clone(),
                    offset: 4096 * (chunks.iter().position(|c| c == chunk).unwrap() as u64),
                    len: 4096
                }
            );
        }
        assert_eq!(other.verify(&digests[0]).unwrap(), 4096);
        // A second batch with the same chunks writes nothing.
        let mut again = other.batch();
        for chunk in &chunks {
            again.put_bytes(chunk).unwrap();
        }
        let traffic = again.commit().unwrap();
        assert_eq!((traffic.blobs_written, traffic.blobs_deduplicated), (0, 3000));
        assert_eq!(pack_files(dir.path()).len(), 1);
    }

    fn pack_files(state_dir: &Path) -> Vec<PathBuf> {
        let mut packs: Vec<PathBuf> = fs::read_dir(state_dir.join("packs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pack"))
            .collect();
        packs.sort();
        packs
    }

    /// A pack closes at PACK_LIMIT and the next begins; a batch dropped before its commit
    /// leaves neither packs nor links.
    #[test]
    fn a_full_pack_closes_and_a_dropped_batch_leaves_no_pack() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let blob = |i: u32| [i.to_le_bytes().as_slice(), &[1u8; PACKED_MAX - 4]].concat();
        let per_pack = (PACK_LIMIT / PACKED_MAX as u64) as u32;
        let mut dropped = store.batch();
        let d = dropped.put_bytes(&blob(u32::MAX)).unwrap();
        drop(dropped);
        assert!(!store.contains(&d));
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
        let mut batch = store.batch();
        let digests: Vec<Digest> = (0..per_pack + 1).map(|i| batch.put_bytes(&blob(i)).unwrap()).collect();
        batch.commit().unwrap();
        assert_eq!(pack_files(dir.path()).len(), 2);
        assert_eq!(store.read(&digests[per_pack as usize]).unwrap(), blob(per_pack));
    }

    /// GC's rewrite of a pack between a reader's lookup of a chunk and its open of the pack: the
    /// reader lists the packs again and reads the chunk from the new one.
    #[test]
    fn a_chunk_read_racing_a_pack_rewrite_is_read_from_the_new_pack() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let chunk = vec![3u8; 4096];
        let digest = store.put(&chunk).unwrap();
        let scenario = fail::FailScenario::setup();
        let moved = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (counter, root) = (moved.clone(), dir.path().to_owned());
        fail::cfg_callback("blobs-open-pack", move || {
            if counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
                return;
            }
            // What GC's rewrite does: the bytes in a new pack with its table, then the old
            // pack's table and the old pack gone.
            let store = BlobStore::open(&root).unwrap();
            let at = store.pack_ref(&digest).unwrap().unwrap();
            let new = PackRef { id: PackId([9; 8]), ..at };
            fs::copy(store.pack_path(at.id), store.pack_path(new.id)).unwrap();
            let (table, _) = store.write_table(new.id, &[(digest, new)]).unwrap();
            fs::rename(table, store.table_path(new.id)).unwrap();
            fs::remove_file(store.table_path(at.id)).unwrap();
            fs::remove_file(store.pack_path(at.id)).unwrap();
        })
        .unwrap();
        let mut buf = vec![0u8; 4097];
        let read = store.read_small_into(&digest, &mut buf, &mut OpenPacks::default());
        scenario.teardown();
        assert!(moved.load(std::sync::atomic::Ordering::SeqCst) >= 2, "looked once, then again");
        assert_eq!(&buf[..read.unwrap()], chunk.as_slice());
    }

    /// A store written before pack tables: a packed blob's name is a link to its place, its
    /// pack has no table. It is read through the link; a batch does not find it (it stores a
    /// second copy, which GC's move of the old pack into an indexed one leaves as a duplicate).
    #[test]
    fn a_blob_named_by_a_link_in_an_older_store_is_read_through_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let chunk = vec![5u8; 4096];
        let digest = Digest::of(&chunk);
        let mut pack = PackBuilder::create(store.tmp_path("pack")).unwrap();
        pack.append(Digest::of(b"before"), b"before").unwrap();
        pack.append(digest, &chunk).unwrap();
        let closed = pack.finish().unwrap();
        fs::rename(&closed.tmp, store.pack_path(closed.id)).unwrap();
        std::os::unix::fs::symlink(closed.places[1].1.to_link(), store.path_of(&digest)).unwrap();

        let reader = BlobStore::open(dir.path()).unwrap();
        assert_eq!(reader.read(&digest).unwrap(), chunk);
        let mut buf = vec![0u8; 4097];
        assert_eq!(reader.read_small_into(&digest, &mut buf, &mut OpenPacks::default()).unwrap(), 4096);
        assert_eq!(reader.size_of(&digest).unwrap(), Some(4096));
        assert!(reader.contains(&digest));
        let mut batch = reader.batch();
        batch.put_bytes(&chunk).unwrap();
        assert_eq!(batch.commit().unwrap().blobs_written, 1);
        assert_eq!(reader.read(&digest).unwrap(), chunk);
    }

    /// A link naming no place in a pack is refused by name, never followed.
    #[test]
    fn a_link_that_names_no_pack_place_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let digest = Digest::of(b"anything");
        std::os::unix::fs::symlink("/etc/passwd", store.path_of(&digest)).unwrap();
        let err = store.read(&digest).unwrap_err();
        assert!(matches!(&err, CheckpointError::BadPackLink { target, .. } if target == "/etc/passwd"), "{err}");
    }

    #[test]
    fn large_reader_streams_and_dedups() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let data: Vec<u8> = (0..3 * IN_MEMORY_LIMIT).map(|i| (i * 7 % 251) as u8).collect();
        let mut batch = store.batch();
        let (d1, n1) = batch.put_reader(&mut &data[..], Path::new("mem")).unwrap();
        let (d2, _) = batch.put_reader(&mut &data[..], Path::new("mem")).unwrap();
        let t = batch.commit().unwrap();
        assert_eq!((d1, n1 as usize), (d2, data.len()));
        assert_eq!(t.written_bytes as usize, data.len());
        assert_eq!(store.read(&d1).unwrap(), data);
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
    }

    #[test]
    fn dropped_batch_leaves_nothing_visible() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let mut batch = store.batch();
        let d = batch.put_bytes(b"never committed").unwrap();
        drop(batch);
        assert!(!store.contains(&d));
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
    }

    #[test]
    fn digest_parsing_is_strict() {
        assert!("AB".parse::<Digest>().is_err());
        assert!("2CF24DBA5FB0A30E26E83B2AC5B9E29E1B161E5C1FA7425E73043362938B9824".parse::<Digest>().is_err());
        let d: Digest = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824".parse().unwrap();
        assert_eq!(d, Digest::of(b"hello"));
    }
}
