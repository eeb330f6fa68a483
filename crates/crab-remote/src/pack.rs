//! Packs: many small content-addressed objects (4 KiB page chunks, chunk lists, small files) in
//! one blob of a few MiB, each object compressed on its own (zstd) so any one can be read back
//! without the others, and an index from object digest to (pack, offset, length), as restic and
//! rustic keep theirs.
//!
//! A pack travels with its index, a second small blob: a reader that already holds some
//! objects learns from the indexes alone which packs it still needs. Both formats are binary,
//! little-endian, versioned, and parsed as untrusted input (they come back from a registry):
//!
//! ```text
//! pack:  "CRABPACK" | version u8 (1) | 7 zero bytes | object frames, back to back
//! index: "CRABPIDX" | version u8 (1) | 3 zero bytes | count u32 | pack digest [32] | pack length u64
//!        | count entries of 45 bytes: digest [32] | offset u32 | stored length u32 | raw length u32 | codec u8
//! indexes: "CRABPIDS" | version u8 (1) | 3 zero bytes | count u32 | count indexes, back to back
//! ```
//!
//! The indexes of the packs one push made travel as one blob (the last form): a reader pays one
//! request for them, not one per pack. Each index in it is self-delimiting (its header says how
//! many entries follow) and checked as one on its own.
//!
//! An index is accepted only if its entries tile the pack exactly (sorted by offset, from the
//! end of the header to the pack's end, no gap, no overlap), every codec is known, a raw entry
//! is as long stored as raw, and no digest repeats. Reading an object decompresses at most its
//! recorded raw length and hands the bytes back only if they hash to the object's digest, so
//! neither a corrupt pack nor a lying index can yield other bytes than the ones named.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use crate::digest::Digest;

pub const PACK_MAGIC: &[u8; 8] = b"CRABPACK";
pub const INDEX_MAGIC: &[u8; 8] = b"CRABPIDX";
pub const INDEXES_MAGIC: &[u8; 8] = b"CRABPIDS";
pub const FORMAT_VERSION: u8 = 1;
pub const PACK_HEADER_LEN: usize = 16;
const INDEX_HEADER_LEN: usize = 16 + 32 + 8;
const ENTRY_LEN: usize = 45;
const INDEXES_HEADER_LEN: usize = 16;

/// Packs are closed once their stored bytes reach this: a few MiB, large enough that a 64 MiB
/// process is a handful of registry blobs, small enough that a reader who lacks one chunk of a
/// pack does not pull much else with it.
pub const DEFAULT_PACK_TARGET: usize = 4 << 20;

/// Largest object a pack holds. Larger ones belong in a blob of their own.
pub const MAX_OBJECT_BYTES: usize = 16 << 20;

/// Largest pack a reader accepts: a full pack plus one maximal object.
pub const MAX_PACK_BYTES: u64 = (DEFAULT_PACK_TARGET + MAX_OBJECT_BYTES + PACK_HEADER_LEN) as u64;

/// Most packs whose indexes travel in one indexes blob: a push of more packs writes several.
/// 256 packs of 4 MiB (1 GiB of objects) have indexes of about 12 MiB.
pub const MAX_PACKS_PER_INDEXES: usize = 256;

/// Largest indexes blob a reader accepts: [`MAX_PACKS_PER_INDEXES`] full indexes of packs of
/// 4 KiB objects, with room to spare.
pub const MAX_INDEXES_BYTES: u64 = 64 << 20;

/// zstd level for objects: 3 is zstd's default, the best ratio per CPU second for page data.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("object {expected} does not hash to its name: its bytes hash to {actual}")]
    DigestMismatch { expected: Digest, actual: Digest },
    #[error("object {digest} has {len} bytes, more than a pack holds ({MAX_OBJECT_BYTES})")]
    ObjectTooLarge { digest: Digest, len: usize },
    #[error("pack index is malformed: {0}")]
    BadIndex(String),
    #[error("pack {pack} is malformed: {reason}")]
    BadPack { pack: Digest, reason: String },
    #[error("object {digest} in pack {pack} is corrupt: {reason}")]
    CorruptObject { pack: Digest, digest: Digest, reason: String },
    #[error("zstd: {0}")]
    Zstd(#[source] std::io::Error),
}

pub type Result<T, E = PackError> = std::result::Result<T, E>;

/// How an object's bytes are stored in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Codec {
    /// As they are: zstd would not have made them smaller.
    Raw = 0,
    /// One zstd frame.
    Zstd = 1,
}

impl Codec {
    fn from_u8(b: u8) -> Option<Self> {
        match b {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Zstd),
            _ => None,
        }
    }
}

/// Where one object sits in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackEntry {
    pub digest: Digest,
    pub offset: u32,
    pub stored_len: u32,
    pub raw_len: u32,
    pub codec: Codec,
}

impl PackEntry {
    fn range(&self) -> std::ops::Range<usize> {
        self.offset as usize..self.offset as usize + self.stored_len as usize
    }
}

/// The index of one pack: the objects it holds, in pack order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackIndex {
    pub pack: Digest,
    pub pack_len: u64,
    pub entries: Vec<PackEntry>,
}

impl PackIndex {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(INDEX_HEADER_LEN + self.entries.len() * ENTRY_LEN);
        out.extend_from_slice(INDEX_MAGIC);
        out.push(FORMAT_VERSION);
        out.extend_from_slice(&[0; 3]);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.pack.0);
        out.extend_from_slice(&self.pack_len.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.digest.0);
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.stored_len.to_le_bytes());
            out.extend_from_slice(&e.raw_len.to_le_bytes());
            out.push(e.codec as u8);
        }
        out
    }

    /// Parses and checks an index (see the module's rules).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| PackError::BadIndex(reason);
        if bytes.len() < INDEX_HEADER_LEN || &bytes[..8] != INDEX_MAGIC {
            return Err(bad("no CRABPIDX header".into()));
        }
        if bytes[8] != FORMAT_VERSION {
            return Err(bad(format!("format version {} (this build reads {FORMAT_VERSION})", bytes[8])));
        }
        let count = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
        let pack = Digest(bytes[16..48].try_into().expect("32 bytes"));
        let pack_len = u64::from_le_bytes(bytes[48..56].try_into().expect("8 bytes"));
        let body = &bytes[INDEX_HEADER_LEN..];
        if body.len() != count.saturating_mul(ENTRY_LEN) {
            return Err(bad(format!("{count} entries need {} bytes, it has {}", count * ENTRY_LEN, body.len())));
        }
        if pack_len > MAX_PACK_BYTES {
            return Err(bad(format!("pack length {pack_len} is over the limit of {MAX_PACK_BYTES}")));
        }
        let mut entries = Vec::with_capacity(count);
        let mut seen = HashSet::with_capacity(count);
        let mut next = PACK_HEADER_LEN as u64;
        for raw in body.chunks_exact(ENTRY_LEN) {
            let u32_at = |at: usize| u32::from_le_bytes(raw[at..at + 4].try_into().expect("4 bytes"));
            let entry = PackEntry {
                digest: Digest(raw[..32].try_into().expect("32 bytes")),
                offset: u32_at(32),
                stored_len: u32_at(36),
                raw_len: u32_at(40),
                codec: Codec::from_u8(raw[44]).ok_or_else(|| bad(format!("unknown codec {}", raw[44])))?,
            };
            let at = entries.len();
            if u64::from(entry.offset) != next {
                return Err(bad(format!("entry {at} starts at {}, expected {next}", entry.offset)));
            }
            if entry.raw_len as usize > MAX_OBJECT_BYTES {
                return Err(bad(format!("entry {at} has {} raw bytes", entry.raw_len)));
            }
            if entry.codec == Codec::Raw && entry.stored_len != entry.raw_len {
                return Err(bad(format!("raw entry {at} is {} bytes stored, {} raw", entry.stored_len, entry.raw_len)));
            }
            if !seen.insert(entry.digest) {
                return Err(bad(format!("object {} is listed twice", entry.digest)));
            }
            next += u64::from(entry.stored_len);
            entries.push(entry);
        }
        if next != pack_len {
            return Err(bad(format!("entries end at {next}, the pack at {pack_len}")));
        }
        Ok(PackIndex { pack, pack_len, entries })
    }

    /// The bytes [`encode`](Self::encode) writes.
    pub fn encoded_len(&self) -> usize {
        INDEX_HEADER_LEN + self.entries.len() * ENTRY_LEN
    }

    /// How a push's packs are grouped into indexes blobs, given each pack's index length: in
    /// order, at most [`MAX_PACKS_PER_INDEXES`] a blob and no blob over [`MAX_INDEXES_BYTES`]
    /// (a reader refuses a larger one; one index alone is always smaller). Returns the number
    /// of packs in each group.
    pub fn groups_for_indexes(index_lens: impl IntoIterator<Item = usize>) -> Vec<usize> {
        let mut groups: Vec<usize> = Vec::new();
        let mut bytes = 0u64;
        for len in index_lens {
            let len = len as u64;
            match groups.last_mut() {
                Some(n) if *n < MAX_PACKS_PER_INDEXES && bytes + len <= MAX_INDEXES_BYTES => {
                    *n += 1;
                    bytes += len;
                }
                _ => {
                    groups.push(1);
                    bytes = INDEXES_HEADER_LEN as u64 + len;
                }
            }
        }
        groups
    }

    /// The indexes of several packs as one blob (see the module's formats).
    pub fn encode_many(indexes: &[PackIndex]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(INDEXES_MAGIC);
        out.push(FORMAT_VERSION);
        out.extend_from_slice(&[0; 3]);
        out.extend_from_slice(&(indexes.len() as u32).to_le_bytes());
        for index in indexes {
            out.extend_from_slice(&index.encode());
        }
        out
    }

    /// Parses and checks an indexes blob: each index as [`decode`](Self::decode) checks one, no
    /// pack twice, nothing after the last.
    pub fn decode_many(bytes: &[u8]) -> Result<Vec<Self>> {
        let bad = |reason: String| PackError::BadIndex(reason);
        if bytes.len() < 16 || &bytes[..8] != INDEXES_MAGIC {
            return Err(bad("no CRABPIDS header".into()));
        }
        if bytes[8] != FORMAT_VERSION {
            return Err(bad(format!("indexes format version {} (this build reads {FORMAT_VERSION})", bytes[8])));
        }
        if bytes.len() as u64 > MAX_INDEXES_BYTES {
            return Err(bad(format!("{} bytes of indexes, over the limit of {MAX_INDEXES_BYTES}", bytes.len())));
        }
        let count = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
        if count > MAX_PACKS_PER_INDEXES {
            return Err(bad(format!("{count} indexes, over the limit of {MAX_PACKS_PER_INDEXES}")));
        }
        let mut indexes = Vec::with_capacity(count);
        let mut packs = HashSet::with_capacity(count);
        let mut rest = &bytes[16..];
        for at in 0..count {
            if rest.len() < INDEX_HEADER_LEN {
                return Err(bad(format!("index {at} of {count} is cut off")));
            }
            let entries = u32::from_le_bytes(rest[12..16].try_into().expect("4 bytes")) as u64;
            let len = (INDEX_HEADER_LEN as u64).saturating_add(entries.saturating_mul(ENTRY_LEN as u64));
            if len > rest.len() as u64 {
                return Err(bad(format!("index {at} of {count} is cut off")));
            }
            let (one, after) = rest.split_at(len as usize);
            let index = Self::decode(one).map_err(|e| bad(format!("index {at} of {count}: {e}")))?;
            if !packs.insert(index.pack) {
                return Err(bad(format!("pack {} is indexed twice", index.pack)));
            }
            indexes.push(index);
            rest = after;
        }
        if !rest.is_empty() {
            return Err(bad(format!("{} bytes after the last of {count} indexes", rest.len())));
        }
        Ok(indexes)
    }

    /// Raw (uncompressed) bytes of every object in the pack.
    pub fn raw_bytes(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.raw_len)).sum()
    }

    /// Checks that `pack` is the pack this index describes: its digest, length and header.
    pub fn check_pack(&self, pack: &[u8]) -> Result<()> {
        let bad = |reason: String| PackError::BadPack { pack: self.pack, reason };
        let actual = Digest::of(pack);
        if actual != self.pack {
            return Err(bad(format!("its bytes hash to {actual}")));
        }
        if pack.len() as u64 != self.pack_len {
            return Err(bad(format!("{} bytes, its index says {}", pack.len(), self.pack_len)));
        }
        check_header(self.pack, pack)
    }

    /// [`check_pack`](Self::check_pack) for bytes fetched by this index's pack digest and
    /// already checked against it (a registry pull hashes every blob it fetches): the length
    /// and header only.
    pub fn check_fetched_pack(&self, pack: &[u8]) -> Result<()> {
        if pack.len() as u64 != self.pack_len {
            return Err(PackError::BadPack {
                pack: self.pack,
                reason: format!("{} bytes, its index says {}", pack.len(), self.pack_len),
            });
        }
        check_header(self.pack, pack)
    }
}

fn check_header(digest: Digest, pack: &[u8]) -> Result<()> {
    if pack.len() < PACK_HEADER_LEN || &pack[..8] != PACK_MAGIC || pack[8] != FORMAT_VERSION {
        return Err(PackError::BadPack { pack: digest, reason: "no CRABPACK version 1 header".into() });
    }
    Ok(())
}

/// A finished pack: its bytes (the blob) and its index.
#[derive(Debug, Clone)]
pub struct Pack {
    pub bytes: Vec<u8>,
    pub index: PackIndex,
}

impl Pack {
    pub fn digest(&self) -> Digest {
        self.index.pack
    }
}

/// Reads objects out of packs, verifying each; keeps one zstd decoder for all of them (a decoder
/// per 4 KiB object would cost more than the decoding).
pub struct ObjectReader {
    decoder: zstd::bulk::Decompressor<'static>,
}

impl ObjectReader {
    pub fn new() -> Result<Self> {
        Ok(ObjectReader { decoder: zstd::bulk::Decompressor::new().map_err(PackError::Zstd)? })
    }

    /// Reads one object out of a pack's bytes, verifying it against its digest.
    pub fn read(&mut self, pack: &Digest, pack_bytes: &[u8], entry: &PackEntry) -> Result<Vec<u8>> {
        let stored = Self::stored(pack, pack_bytes, entry)?;
        self.read_stored(pack, stored, entry)
    }

    /// Decodes an object from its stored bytes alone (read from `entry.offset` of its pack)
    /// and verifies it.
    pub fn read_stored(&mut self, pack: &Digest, stored: &[u8], entry: &PackEntry) -> Result<Vec<u8>> {
        Ok(self.decode(pack, stored, entry)?.into_owned())
    }

    /// [`read`](Self::read) out of a shared pack buffer: an object stored raw is handed back as
    /// a slice of it rather than a copy (a pack of random pages is all raw objects).
    pub fn read_shared(&mut self, pack: &Digest, pack_bytes: &bytes::Bytes, entry: &PackEntry) -> Result<bytes::Bytes> {
        let stored = Self::stored(pack, pack_bytes, entry)?;
        Ok(match self.decode(pack, stored, entry)? {
            Cow::Borrowed(_) => pack_bytes.slice(entry.range()),
            Cow::Owned(data) => bytes::Bytes::from(data),
        })
    }

    fn stored<'a>(pack: &Digest, pack_bytes: &'a [u8], entry: &PackEntry) -> Result<&'a [u8]> {
        pack_bytes.get(entry.range()).ok_or_else(|| PackError::CorruptObject {
            pack: *pack,
            digest: entry.digest,
            reason: format!("bytes {:?} are beyond the pack's {} bytes", entry.range(), pack_bytes.len()),
        })
    }

    /// The object's bytes, verified against its digest: borrowed from `stored` when it is raw.
    fn decode<'a>(&mut self, pack: &Digest, stored: &'a [u8], entry: &PackEntry) -> Result<Cow<'a, [u8]>> {
        let corrupt = |reason: String| PackError::CorruptObject { pack: *pack, digest: entry.digest, reason };
        if stored.len() != entry.stored_len as usize {
            return Err(corrupt(format!("{} stored bytes, the index says {}", stored.len(), entry.stored_len)));
        }
        let data = match entry.codec {
            Codec::Raw => Cow::Borrowed(stored),
            Codec::Zstd => {
                // Bounded by the recorded length: a frame that inflates to more is refused, not
                // followed into memory.
                let data = self
                    .decoder
                    .decompress(stored, entry.raw_len as usize)
                    .map_err(|e| corrupt(format!("zstd frame does not decode: {e}")))?;
                if data.len() != entry.raw_len as usize {
                    return Err(corrupt(format!("decodes to {} bytes, the index says {}", data.len(), entry.raw_len)));
                }
                Cow::Owned(data)
            }
        };
        let actual = Digest::of(&data);
        if actual != entry.digest {
            return Err(corrupt(format!("its bytes hash to {actual}")));
        }
        Ok(data)
    }
}

/// Reads one object out of a pack's bytes, verifying it (a one-off [`ObjectReader`]).
pub fn read_object(pack: &Digest, pack_bytes: &[u8], entry: &PackEntry) -> Result<Vec<u8>> {
    ObjectReader::new()?.read(pack, pack_bytes, entry)
}

/// Decodes an object from its stored bytes and verifies it (a one-off [`ObjectReader`]).
pub fn read_stored(pack: &Digest, stored: &[u8], entry: &PackEntry) -> Result<Vec<u8>> {
    ObjectReader::new()?.read_stored(pack, stored, entry)
}

/// Reads every object of a checked pack, verifying each.
pub fn read_all(pack_bytes: &[u8], index: &PackIndex) -> Result<Vec<(Digest, Vec<u8>)>> {
    index.check_pack(pack_bytes)?;
    let mut reader = ObjectReader::new()?;
    index.entries.iter().map(|e| Ok((e.digest, reader.read(&index.pack, pack_bytes, e)?))).collect()
}

/// Groups objects into packs. Objects are compressed one by one as they come; a pack is closed
/// when its stored bytes reach the target. Packing is deterministic: the same objects in the
/// same order give the same packs (same digests), which is what makes a push that died halfway
/// resumable by asking the registry which blobs it already has.
pub struct Packer {
    target: usize,
    compressor: zstd::bulk::Compressor<'static>,
    bytes: Vec<u8>,
    entries: Vec<PackEntry>,
    /// Objects already in this packer's packs (closed or open): added twice, stored once.
    seen: HashSet<Digest>,
    done: Vec<Pack>,
}

impl Packer {
    pub fn new(target: usize, level: i32) -> Result<Self> {
        let compressor = zstd::bulk::Compressor::new(level).map_err(PackError::Zstd)?;
        Ok(Packer {
            target: target.max(1),
            compressor,
            bytes: Vec::new(),
            entries: Vec::new(),
            seen: HashSet::new(),
            done: Vec::new(),
        })
    }

    /// Adds one object, refusing it unless `data` hashes to `digest`. Returns false when it was
    /// already added.
    pub fn add(&mut self, digest: Digest, data: &[u8]) -> Result<bool> {
        if data.len() > MAX_OBJECT_BYTES {
            return Err(PackError::ObjectTooLarge { digest, len: data.len() });
        }
        let actual = Digest::of(data);
        if actual != digest {
            return Err(PackError::DigestMismatch { expected: digest, actual });
        }
        if !self.seen.insert(digest) {
            return Ok(false);
        }
        let compressed = self.compressor.compress(data).map_err(PackError::Zstd)?;
        let (codec, stored) =
            if compressed.len() < data.len() { (Codec::Zstd, &compressed[..]) } else { (Codec::Raw, data) };
        if self.bytes.is_empty() {
            self.bytes.extend_from_slice(PACK_MAGIC);
            self.bytes.push(FORMAT_VERSION);
            self.bytes.extend_from_slice(&[0; 7]);
        }
        self.entries.push(PackEntry {
            digest,
            offset: self.bytes.len() as u32,
            stored_len: stored.len() as u32,
            raw_len: data.len() as u32,
            codec,
        });
        self.bytes.extend_from_slice(stored);
        if self.bytes.len() >= self.target {
            self.close();
        }
        Ok(true)
    }

    fn close(&mut self) {
        if self.entries.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut self.bytes);
        let index = PackIndex {
            pack: Digest::of(&bytes),
            pack_len: bytes.len() as u64,
            entries: std::mem::take(&mut self.entries),
        };
        self.done.push(Pack { bytes, index });
    }

    /// Packs closed so far (the open one stays open).
    pub fn take_closed(&mut self) -> Vec<Pack> {
        std::mem::take(&mut self.done)
    }

    /// Closes the open pack and returns every pack not taken yet.
    pub fn finish(mut self) -> Vec<Pack> {
        self.close();
        self.done
    }
}

/// Where an object is: its pack and its entry there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub pack: Digest,
    pub entry: PackEntry,
}

/// Object digest → location, over any number of packs: what a writer consults to store only
/// objects that are in no pack yet (chunk-level dedup across turns and sandboxes).
#[derive(Debug, Clone, Default)]
pub struct ChunkIndex {
    objects: HashMap<Digest, Location>,
    packs: HashMap<Digest, PackIndex>,
}

impl ChunkIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a pack's objects; an object already indexed keeps its first location.
    pub fn insert(&mut self, index: PackIndex) {
        for entry in &index.entries {
            self.objects.entry(entry.digest).or_insert(Location { pack: index.pack, entry: *entry });
        }
        self.packs.insert(index.pack, index);
    }

    /// Forgets a pack (it turned out to be gone); its objects move to another pack that holds
    /// them, if any.
    pub fn remove_pack(&mut self, pack: &Digest) {
        let Some(gone) = self.packs.remove(pack) else { return };
        for entry in &gone.entries {
            self.objects.remove(&entry.digest);
        }
        for index in self.packs.values() {
            for entry in &index.entries {
                if gone.entries.iter().any(|g| g.digest == entry.digest) {
                    self.objects.entry(entry.digest).or_insert(Location { pack: index.pack, entry: *entry });
                }
            }
        }
    }

    pub fn get(&self, digest: &Digest) -> Option<&Location> {
        self.objects.get(digest)
    }

    pub fn contains(&self, digest: &Digest) -> bool {
        self.objects.contains_key(digest)
    }

    pub fn pack(&self, pack: &Digest) -> Option<&PackIndex> {
        self.packs.get(pack)
    }

    pub fn packs(&self) -> impl Iterator<Item = &PackIndex> {
        self.packs.values()
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }
}

/// Packs the objects of `objects` that `index` does not hold yet: chunk-level dedup against an
/// existing index. Returns the new packs (their indexes are not inserted: the caller does that
/// once they are durable or pushed).
pub fn pack_new<'a>(
    index: &ChunkIndex,
    objects: impl IntoIterator<Item = (Digest, &'a [u8])>,
    target: usize,
    level: i32,
) -> Result<Vec<Pack>> {
    let mut packer = Packer::new(target, level)?;
    for (digest, data) in objects {
        if !index.contains(&digest) {
            packer.add(digest, data)?;
        }
    }
    Ok(packer.finish())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn page(seed: u32, compressible: bool) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..4096)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if compressible && i % 4 != 0 { 0 } else { x as u8 }
            })
            .collect()
    }

    fn objects(n: u32) -> Vec<(Digest, Vec<u8>)> {
        (0..n).map(|i| page(i, i % 2 == 0)).map(|p| (Digest::of(&p), p)).collect()
    }

    /// The indexes of a push's packs as one blob: round trip, and every way a registry's copy
    /// can be wrong is refused with what is wrong.
    #[test]
    fn indexes_travel_as_one_blob_and_a_bad_one_is_named() {
        let objs = objects(120);
        let packs = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), 128 << 10, 3).unwrap();
        assert!(packs.len() >= 3);
        let indexes: Vec<PackIndex> = packs.iter().map(|p| p.index.clone()).collect();
        let blob = PackIndex::encode_many(&indexes);
        assert_eq!(PackIndex::decode_many(&blob).unwrap(), indexes);
        assert_eq!(PackIndex::decode_many(&PackIndex::encode_many(&[])).unwrap(), []);

        let refused = |bytes: &[u8]| PackIndex::decode_many(bytes).unwrap_err().to_string();
        assert!(refused(&indexes[0].encode()).contains("no CRABPIDS header"));
        let mut version = blob.clone();
        version[8] = 2;
        assert!(refused(&version).contains("indexes format version 2"));
        // A count past what follows, a cut-off index, bytes left over.
        let mut more = blob.clone();
        more[12..16].copy_from_slice(&(indexes.len() as u32 + 1).to_le_bytes());
        assert!(refused(&more).contains(&format!("index {} of {} is cut off", indexes.len(), indexes.len() + 1)));
        assert!(refused(&blob[..blob.len() - 1]).contains("cut off"));
        let mut trailing = blob.clone();
        trailing.push(0);
        assert!(refused(&trailing).contains("1 bytes after the last"));
        // One index that does not tile its pack, named by its place.
        let mut broken = indexes.clone();
        broken[1].pack_len += 1;
        assert!(refused(&PackIndex::encode_many(&broken)).contains("index 1 of"));
        // The same pack twice.
        let twice = PackIndex::encode_many(&[indexes[0].clone(), indexes[0].clone()]);
        assert!(refused(&twice).contains("indexed twice"));
        let mut huge = PackIndex::encode_many(&[]);
        huge[12..16].copy_from_slice(&(MAX_PACKS_PER_INDEXES as u32 + 1).to_le_bytes());
        assert!(refused(&huge).contains("over the limit"));
    }

    /// A push of many packs whose indexes are large (compressible objects: many entries per
    /// pack) is split so that no indexes blob is one a reader refuses.
    #[test]
    fn indexes_blobs_stay_under_what_a_reader_accepts() {
        let max = MAX_INDEXES_BYTES as usize;
        assert_eq!(PackIndex::groups_for_indexes([]), Vec::<usize>::new());
        assert_eq!(PackIndex::groups_for_indexes([100; 600]), [256, 256, 88]);
        // 1 MiB indexes: 63 fit with the header, not 64.
        assert_eq!(PackIndex::groups_for_indexes([1 << 20; 130]), [63, 63, 4]);
        assert_eq!(PackIndex::groups_for_indexes([max - 16, 1, max - 16]), [1, 1, 1]);
        for group in PackIndex::groups_for_indexes([300_000; 1000]) {
            assert!(16 + group * 300_000 <= max, "{group}");
        }
        let index = PackIndex { pack: Digest::of(b"p"), pack_len: 16, entries: Vec::new() };
        assert_eq!(index.encoded_len(), index.encode().len());
    }

    #[test]
    fn packs_round_trip_and_close_at_the_target() {
        let objs = objects(300);
        let packs = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), 256 << 10, 3).unwrap();
        assert!(packs.len() > 1, "300 pages of 4 KiB at a 256 KiB target make several packs");
        let mut back = HashMap::new();
        for pack in &packs {
            let index = PackIndex::decode(&pack.index.encode()).unwrap();
            assert_eq!(index, pack.index);
            // Every pack but the last was closed once it reached the target, not long after.
            assert!(pack.bytes.len() < (256 << 10) + 4096 + PACK_HEADER_LEN);
            back.extend(read_all(&pack.bytes, &index).unwrap());
        }
        assert_eq!(back.len(), objs.len());
        for (d, b) in &objs {
            assert_eq!(&back[d], b);
        }
        // Compressible pages were compressed, random ones kept raw.
        let codecs: HashSet<Codec> = packs.iter().flat_map(|p| p.index.entries.iter().map(|e| e.codec)).collect();
        assert_eq!(codecs, HashSet::from([Codec::Raw, Codec::Zstd]));
    }

    #[test]
    fn shared_reads_hand_out_raw_objects_as_slices_of_the_pack_and_verify_every_object() {
        let objs = objects(8);
        let pack = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), 1 << 20, 3).unwrap().remove(0);
        let shared = bytes::Bytes::from(pack.bytes.clone());
        let within = |b: &bytes::Bytes| shared.as_ptr_range().contains(&b.as_ptr());
        let mut reader = ObjectReader::new().unwrap();
        for ((digest, data), entry) in objs.iter().zip(&pack.index.entries) {
            assert_eq!(entry.digest, *digest);
            let read = reader.read_shared(&pack.index.pack, &shared, entry).unwrap();
            assert_eq!(&read[..], &data[..]);
            assert_eq!(within(&read), entry.codec == Codec::Raw, "{:?} object", entry.codec);
        }
        // A raw object whose bytes changed is refused like a compressed one.
        let raw = pack.index.entries.iter().find(|e| e.codec == Codec::Raw).unwrap();
        let mut bytes = pack.bytes.clone();
        bytes[raw.range().start] ^= 1;
        let err = reader.read_shared(&pack.index.pack, &bytes::Bytes::from(bytes), raw).unwrap_err();
        assert!(err.to_string().contains("hash to"), "{err}");
    }

    #[test]
    fn dedup_against_an_index_and_within_a_packer() {
        let objs = objects(10);
        let first = pack_new(&ChunkIndex::new(), objs[..6].iter().map(|(d, b)| (*d, &b[..])), 1 << 20, 3).unwrap();
        let mut index = ChunkIndex::new();
        for p in first {
            index.insert(p.index);
        }
        // Objects 0..6 are known; 6..10 are new, and 7 comes twice.
        let second: Vec<_> = objs.iter().chain(std::iter::once(&objs[7])).map(|(d, b)| (*d, &b[..])).collect();
        let packs = pack_new(&index, second, 1 << 20, 3).unwrap();
        let stored: Vec<Digest> = packs.iter().flat_map(|p| p.index.entries.iter().map(|e| e.digest)).collect();
        assert_eq!(stored, objs[6..].iter().map(|(d, _)| *d).collect::<Vec<_>>());
    }

    #[test]
    fn packing_is_deterministic() {
        let objs = objects(40);
        let a = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), 64 << 10, 3).unwrap();
        let b = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), 64 << 10, 3).unwrap();
        assert_eq!(a.iter().map(Pack::digest).collect::<Vec<_>>(), b.iter().map(Pack::digest).collect::<Vec<_>>());
    }

    #[test]
    fn an_object_that_does_not_match_its_name_is_refused() {
        let mut packer = Packer::new(1 << 20, 3).unwrap();
        let err = packer.add(Digest::of(b"a"), b"b").unwrap_err();
        assert!(matches!(err, PackError::DigestMismatch { .. }), "{err}");
        assert!(packer.finish().is_empty());
    }

    #[test]
    fn removing_a_pack_moves_objects_to_another_that_holds_them() {
        let objs = objects(4);
        let a = pack_new(&ChunkIndex::new(), objs[..3].iter().map(|(d, b)| (*d, &b[..])), 1 << 20, 3).unwrap();
        let b = pack_new(&ChunkIndex::new(), objs[2..].iter().map(|(d, b)| (*d, &b[..])), 1 << 20, 3).unwrap();
        let (a, b) = (a[0].index.clone(), b[0].index.clone());
        let mut index = ChunkIndex::new();
        index.insert(a.clone());
        index.insert(b.clone());
        assert_eq!(index.get(&objs[2].0).unwrap().pack, a.pack);
        index.remove_pack(&a.pack);
        assert!(!index.contains(&objs[0].0));
        assert_eq!(index.get(&objs[2].0).unwrap().pack, b.pack);
        assert_eq!(index.get(&objs[3].0).unwrap().pack, b.pack);
    }

    #[test]
    fn a_bomb_frame_is_refused_at_its_recorded_length() {
        // A frame of 1 MiB of zeros claiming 4 KiB raw: decoding stops at 4 KiB and fails.
        let zeros = vec![0u8; 1 << 20];
        let frame = zstd::bulk::compress(&zeros, 3).unwrap();
        let entry = PackEntry {
            digest: Digest::of(&zeros[..4096]),
            offset: 0,
            stored_len: frame.len() as u32,
            raw_len: 4096,
            codec: Codec::Zstd,
        };
        let err = read_stored(&Digest::of(b"p"), &frame, &entry).unwrap_err();
        assert!(matches!(err, PackError::CorruptObject { .. }), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..Default::default() })]

        /// Any objects round-trip through packs of any target size.
        #[test]
        fn any_objects_round_trip(
            blobs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..3000), 0..24),
            target in 1usize..20_000,
        ) {
            let objs: Vec<(Digest, Vec<u8>)> = blobs.into_iter().map(|b| (Digest::of(&b), b)).collect();
            let packs = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), target, 3).unwrap();
            let mut back = HashMap::new();
            for pack in &packs {
                let index = PackIndex::decode(&pack.index.encode()).unwrap();
                back.extend(read_all(&pack.bytes, &index).unwrap());
            }
            for (d, b) in &objs {
                prop_assert_eq!(&back[d], b);
            }
        }

        /// One changed byte anywhere in a pack or its index: the index is refused, the pack is
        /// refused, or every object read is exactly the object named: never other bytes.
        #[test]
        fn a_flipped_byte_never_yields_other_bytes(
            in_index in any::<bool>(),
            at in any::<proptest::sample::Index>(),
            xor in 1u8..=255,
        ) {
            let objs = objects(12);
            let packs = pack_new(&ChunkIndex::new(), objs.iter().map(|(d, b)| (*d, &b[..])), 1 << 20, 3).unwrap();
            let pack = &packs[0];
            let (mut bytes, mut index_bytes) = (pack.bytes.clone(), pack.index.encode());
            if in_index {
                let i = at.index(index_bytes.len());
                index_bytes[i] ^= xor;
            } else {
                let i = at.index(bytes.len());
                bytes[i] ^= xor;
            }
            let Ok(index) = PackIndex::decode(&index_bytes) else { return Ok(()) };
            let originals: HashMap<Digest, &Vec<u8>> = objs.iter().map(|(d, b)| (*d, b)).collect();
            // Object by object, without the whole-pack check: each read stands on its own.
            for entry in &index.entries {
                if let Ok(data) = read_object(&index.pack, &bytes, entry) {
                    prop_assert_eq!(Digest::of(&data), entry.digest);
                    if let Some(orig) = originals.get(&entry.digest) {
                        prop_assert_eq!(&&data, orig);
                    }
                }
            }
            if !in_index {
                prop_assert!(read_all(&bytes, &index).is_err());
            }
        }

        /// Arbitrary bytes never make the index parser panic, and whatever it accepts tiles a
        /// pack exactly.
        #[test]
        fn index_parser_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let mut input = INDEX_MAGIC.to_vec();
            input.extend_from_slice(&bytes);
            if let Ok(index) = PackIndex::decode(&input) {
                let end = index.entries.iter().map(|e| u64::from(e.offset) + u64::from(e.stored_len)).max();
                prop_assert_eq!(end.unwrap_or(PACK_HEADER_LEN as u64), index.pack_len);
            }
        }
    }
}
