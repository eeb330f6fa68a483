//! Local packs: the small blobs of one write batch (a CRIU dump's 4 KiB page chunks, a turn's
//! small files) written one after another into a single file, `packs/<id>.pack`, instead of a
//! file each. A 64 MiB process is one file and one fsync instead of 16,384 of each.
//!
//! Where each blob of a pack is, is in the pack's table beside it (see [`super::index`]). A
//! store written before tables named each packed blob by a symbolic link in the blob tree whose
//! target is never followed but read, `<pack id>+<offset>+<length>` ([`PackRef::parse`]); such
//! links are still read, and GC moves their blobs into indexed packs.
//!
//! Order of publication (see [`super::store::WriteBatch`]): a pack and its table are fsynced,
//! renamed into `packs/` (the pack first) and `packs/` fsynced before the batch's commit
//! returns, so no manifest names a blob whose pack a crash could lose. A reader uses a table only
//! beside its pack. GC removes a pack's table before the pack, and publishes a rewritten pack
//! with its table before it removes the old.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;

use sha2::{Digest as _, Sha256};

use super::error::{IoContext, Result};
use super::store::Digest;

/// Blobs up to this size go into packs; larger ones stay files of their own, which restores
/// copy in the kernel (`copy_file_range`) and which are few.
pub(crate) const PACKED_MAX: usize = 64 * 1024;

/// A pack is closed and another begun once it holds this many bytes: GC rewrites a pack whose
/// blobs are mostly dead, and a bounded pack bounds that work.
pub(crate) const PACK_LIMIT: u64 = 32 << 20;

/// Where a packed blob's bytes are: the target of its link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PackRef {
    pub id: PackId,
    pub offset: u64,
    pub len: u64,
}

/// A pack's name: the first 8 bytes of the SHA-256 of its index (each blob's digest, offset
/// and length in order), so a pack with the same blobs at the same places has the same name and
/// the same content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PackId(pub [u8; 8]);

impl PackId {
    pub fn file_name(&self) -> String {
        format!("{}.pack", hex::encode(self.0))
    }

    /// The id of a file name `<16 hex>.pack`; None for any other name.
    pub fn from_file_name(name: &str) -> Option<PackId> {
        let hex = name.strip_suffix(".pack")?;
        if hex.len() != 16 || hex.bytes().any(|b| b.is_ascii_uppercase()) {
            return None;
        }
        let mut id = [0u8; 8];
        hex::decode_to_slice(hex, &mut id).ok()?;
        Some(PackId(id))
    }
}

impl PackRef {
    /// The link target naming this place (as stores before pack tables wrote it).
    #[cfg(test)]
    pub fn to_link(self) -> String {
        format!("{}+{}+{}", hex::encode(self.id.0), self.offset, self.len)
    }

    /// Parses a link target; None unless it is exactly what [`to_link`](Self::to_link) writes
    /// (the store is root's alone, but a target is data, never a path to follow).
    pub fn parse(target: &[u8]) -> Option<PackRef> {
        let text = std::str::from_utf8(target).ok()?;
        let mut parts = text.split('+');
        let (id, offset, len) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let number = |s: &str| -> Option<u64> {
            if s.is_empty()
                || s.len() > 12
                || !s.bytes().all(|b| b.is_ascii_digit())
                || (s.len() > 1 && s.starts_with('0'))
            {
                return None;
            }
            s.parse().ok()
        };
        let id = PackId::from_file_name(&format!("{id}.pack"))?;
        let (offset, len) = (number(offset)?, number(len)?);
        (len <= PACKED_MAX as u64).then_some(PackRef { id, offset, len })
    }
}

/// A pack whose blobs are all written: its tmp file, its name, and each blob's place.
pub(crate) struct ClosedPack {
    pub tmp: PathBuf,
    pub id: PackId,
    pub places: Vec<(Digest, PackRef)>,
}

/// Bytes a pack gathers in memory before they are written: a dump appends thousands of 4 KiB
/// chunks, and a write each would cost more than the copy.
const WRITE_RUN: usize = 1 << 20;

/// The largest single write into a pack. The page cache keeps what one write brings as folios
/// up to its size (ext4 on this kernel: up to 1 MiB and more), and writeback moves whole
/// folios: a paced write-back of one chunk of the node's bucket would take the rest of a large
/// folio to the disk with it, ungranted. Writes of 16 KiB keep folios no larger than the
/// bucket's smallest sensible chunk (the co-location test's bucket has 32 KiB), at 4,096 writes
/// for a 64 MiB dump instead of 16,384.
const WRITE_PIECE: usize = 16 << 10;

/// A pack being filled in the store's tmp directory.
pub(crate) struct PackBuilder {
    pub tmp: PathBuf,
    file: File,
    /// Bytes in `file`; those appended after them wait in `run`.
    written: u64,
    run: Vec<u8>,
    entries: Vec<(Digest, u64, u64)>,
}

impl PackBuilder {
    pub fn create(tmp: PathBuf) -> Result<PackBuilder> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            // Read-only once published, and root's alone: packs are sandboxes' files and memory.
            .mode(0o400)
            .open(&tmp)
            .io_ctx("create", &tmp)?;
        Ok(PackBuilder { tmp, file, written: 0, run: Vec::with_capacity(WRITE_RUN), entries: Vec::new() })
    }

    /// Appends a blob; returns its offset.
    pub fn append(&mut self, digest: Digest, data: &[u8]) -> Result<u64> {
        let offset = self.len();
        self.run.extend_from_slice(data);
        self.entries.push((digest, offset, data.len() as u64));
        if self.run.len() >= WRITE_RUN {
            self.write_run()?;
        }
        Ok(offset)
    }

    fn write_run(&mut self) -> Result<()> {
        for piece in self.run.chunks(WRITE_PIECE) {
            self.file.write_all_at(piece, self.written).io_ctx("write", &self.tmp)?;
            self.written += piece.len() as u64;
        }
        self.run.clear();
        Ok(())
    }

    pub fn len(&self) -> u64 {
        self.written + self.run.len() as u64
    }

    /// Bytes appended earlier (unverified: the caller hashes them). A blob is written whole, so
    /// it is either all in the file or all still in memory.
    pub fn read_at(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        if offset >= self.written {
            let from = (offset - self.written) as usize;
            return Ok(self.run[from..from + len as usize].to_vec());
        }
        let mut data = vec![0u8; len as usize];
        File::open(&self.tmp).and_then(|f| f.read_exact_at(&mut data, offset)).io_ctx("read", &self.tmp)?;
        Ok(data)
    }

    /// Closes the pack: its id, and where each of its blobs is.
    pub fn finish(mut self) -> Result<ClosedPack> {
        self.write_run()?;
        let mut hasher = Sha256::new();
        for (digest, offset, len) in &self.entries {
            hasher.update(digest.0);
            hasher.update(offset.to_le_bytes());
            hasher.update(len.to_le_bytes());
        }
        let hash: [u8; 32] = hasher.finalize().into();
        let id = PackId(hash[..8].try_into().expect("8 of 32 bytes"));
        let places =
            self.entries.into_iter().map(|(digest, offset, len)| (digest, PackRef { id, offset, len })).collect();
        Ok(ClosedPack { tmp: self.tmp, id, places })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn a_link_target_round_trips_and_nothing_else_parses() {
        let place = PackRef { id: PackId(*b"\x01\x23\x45\x67\x89\xab\xcd\xef"), offset: 40960, len: 4096 };
        let link = place.to_link();
        assert_eq!(link, "0123456789abcdef+40960+4096");
        assert!(link.len() < 60, "fits in the inode");
        assert_eq!(PackRef::parse(link.as_bytes()), Some(place));
        for bad in [
            "",
            "0123456789abcdef+1",
            "0123456789abcdef+1+2+3",
            "0123456789ABCDEF+0+1",
            "0123456789abcde+0+1",
            "0123456789abcdef+-1+1",
            "0123456789abcdef+01+1",
            "0123456789abcdef+0+65537",
            "../../etc/passwd",
            "0123456789abcdef+0+ 1",
        ] {
            assert_eq!(PackRef::parse(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(PackId::from_file_name("0123456789abcdef.pack"), Some(place.id));
        assert_eq!(PackId::from_file_name("0123456789abcdef.pack.tmp"), None);
    }

    #[test]
    fn the_same_blobs_at_the_same_places_make_the_same_pack() {
        let dir = tempfile::tempdir().unwrap();
        let build = |name: &str, blobs: &[&[u8]]| {
            let mut pack = PackBuilder::create(dir.path().join(name)).unwrap();
            for blob in blobs {
                pack.append(Digest::of(blob), blob).unwrap();
            }
            pack.finish().unwrap()
        };
        let a = build("a", &[b"one", b"two"]);
        let b = build("b", &[b"one", b"two"]);
        let c = build("c", &[b"two", b"one"]);
        assert_eq!(a.id, b.id);
        assert_ne!(a.id, c.id);
        assert_eq!(a.places[1].1, PackRef { id: a.id, offset: 3, len: 3 });
        assert_eq!(fs::read(&a.tmp).unwrap(), b"onetwo");
    }
}
