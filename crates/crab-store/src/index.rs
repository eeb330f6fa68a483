//! The pack index: where each packed blob is, in table files beside the packs.
//!
//! Every pack `packs/<id>.pack` has its table `packs/<id>.idx`: the digest, offset and length
//! of each blob in it, sorted by digest. From time to time the tables of many packs are merged
//! into one, `packs/index-<generation>-<hash>.midx`, so that a lookup is a binary search in the
//! merged table and in the few tables published since. Tables are mapped, not read: the page
//! cache holds one copy of them however many shims look blobs up, where a map in each process's
//! memory would cost every shim the whole node's index.
//!
//! A pack's own table is the truth about that pack; a merged table is only a faster way to read
//! many, used only while every pack it covers still has its table in the same listing of
//! `packs/` (GC, which removes packs, writes a new merged table after). A table whose pack is
//! not in that listing is ignored: a crash between the two renames of a publish leaves one, and
//! GC removes it.
//!
//! Before tables, a packed blob's name was a link `blobs/<2 hex>/<62 hex>` whose target named
//! its place: one inode and one fan-out directory fsync per chunk, the largest part of a turn's
//! write-out (264 links and 160-odd directory fsyncs in a tmux turn) and of a pull (17,508 links
//! for one sandbox). Such links are still read after a miss here, and GC moves their blobs into
//! indexed packs.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use sha2::{Digest as _, Sha256};

use super::error::{CheckpointError, IoContext, Result};
use super::pack::{PACK_LIMIT, PACKED_MAX, PackId, PackRef};
use super::store::Digest;
use super::sys;

const MAGIC: &[u8; 8] = b"CRABIDX1";
const HEADER: usize = 16;
const PACK_ID: usize = 8;
/// digest (32), pack slot (u32), offset (u32), length (u32), all little-endian.
const ENTRY: usize = 44;
const TRAILER: usize = 32;

/// Tables published since the newest merged one, past which the next refresh merges them: a
/// lookup of a blob that is not stored searches every one of them.
const MERGE_AT: usize = 32;

pub(crate) const TABLE_SUFFIX: &str = ".idx";
const MERGED_PREFIX: &str = "index-";
const MERGED_SUFFIX: &str = ".midx";

/// One place of a blob in a table being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub digest: Digest,
    pub at: PackRef,
}

/// The bytes of a table: `CRABIDX1`, the number of packs and of entries (u32 each), the pack
/// ids in increasing order, the entries in increasing digest order (one per digest), and the
/// SHA-256 of everything before it. `packs` are the packs the table covers: every entry's, and
/// for a merged table also those whose blobs all have a place in another (it covers them all
/// the same, so their own tables are not read again).
pub(crate) fn encode(packs: &BTreeSet<PackId>, entries: &[Entry]) -> Result<Vec<u8>> {
    let mut entries = entries.to_vec();
    entries.sort_unstable_by(|a, b| a.digest.0.cmp(&b.digest.0).then(a.at.id.cmp(&b.at.id)));
    entries.dedup_by(|later, first| later.digest == first.digest);
    if let Some(e) = entries.iter().find(|e| !packs.contains(&e.at.id)) {
        return Err(CheckpointError::InvalidRequest(format!(
            "blob {} is in a pack the table does not cover",
            e.digest
        )));
    }
    let packs: Vec<PackId> = packs.iter().copied().collect();
    let slot_of: BTreeMap<PackId, u32> = packs.iter().enumerate().map(|(i, id)| (*id, i as u32)).collect();
    let mut out = Vec::with_capacity(HEADER + packs.len() * PACK_ID + entries.len() * ENTRY + TRAILER);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(packs.len() as u32).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for id in &packs {
        out.extend_from_slice(&id.0);
    }
    for Entry { digest, at } in &entries {
        let (offset, len) = match (u32::try_from(at.offset), u32::try_from(at.len)) {
            (Ok(offset), Ok(len)) if at.offset + at.len <= PACK_LIMIT + PACKED_MAX as u64 => (offset, len),
            _ => {
                return Err(CheckpointError::InvalidRequest(format!(
                    "blob {digest} at {}+{} is past the end any pack can have",
                    at.offset, at.len
                )));
            }
        };
        out.extend_from_slice(&digest.0);
        out.extend_from_slice(&slot_of[&at.id].to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
    let sum: [u8; 32] = Sha256::digest(&out).into();
    out.extend_from_slice(&sum);
    Ok(out)
}

/// A table file, mapped and checked whole.
pub(crate) struct Table {
    map: memmap2::Mmap,
    packs: usize,
    entries: usize,
}

fn bad(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::BadPackIndex { path: path.to_owned(), reason: reason.into() }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

impl Table {
    /// Maps and checks the table at `path`: its size, checksum, order and every entry's bounds,
    /// so that lookups in it need no check of their own.
    pub fn open(path: &Path) -> Result<Table> {
        let file = File::open(path).io_ctx("open", path)?;
        let size = file.metadata().io_ctx("stat", path)?.len();
        if size < (HEADER + TRAILER) as u64 {
            return Err(bad(path, format!("{size} bytes is shorter than any table")));
        }
        // SAFETY: the mapping is read-only and private to this process. Tables are written under
        // a temporary name, fsynced and renamed into `packs/` (root's alone, 0400 files): a
        // published table is never written again, only unlinked, which leaves a mapping intact.
        // Only a truncation by hand could fault a read, as it would for any mapped file.
        let map = unsafe { memmap2::Mmap::map(&file) }.io_ctx("mmap", path)?;
        Self::check(map, path)
    }

    fn check(map: memmap2::Mmap, path: &Path) -> Result<Table> {
        let bytes = &map[..];
        if &bytes[..8] != MAGIC {
            return Err(bad(path, "not a crab pack index (wrong magic)"));
        }
        let (packs, entries) = (u32_at(bytes, 8) as usize, u32_at(bytes, 12) as usize);
        let want = HEADER as u64 + (packs * PACK_ID) as u64 + (entries * ENTRY) as u64 + TRAILER as u64;
        if bytes.len() as u64 != want {
            return Err(bad(
                path,
                format!("{} bytes, but {packs} packs and {entries} entries take {want}", bytes.len()),
            ));
        }
        let body = bytes.len() - TRAILER;
        let sum: [u8; 32] = Sha256::digest(&bytes[..body]).into();
        if sum[..] != bytes[body..] {
            return Err(bad(path, "checksum does not match its content"));
        }
        let table = Table { map, packs, entries };
        for i in 1..packs {
            if table.pack(i - 1).0 >= table.pack(i).0 {
                return Err(bad(path, "pack ids out of order"));
            }
        }
        for i in 0..entries {
            let (digest, slot, offset, len) = table.raw(i);
            if slot as usize >= packs {
                return Err(bad(path, format!("entry {i} names pack slot {slot} of {packs}")));
            }
            if len as usize > PACKED_MAX || offset as u64 + len as u64 > PACK_LIMIT + PACKED_MAX as u64 {
                return Err(bad(path, format!("entry {i} at {offset}+{len} is past the end any pack can have")));
            }
            if i > 0 && table.raw(i - 1).0 >= digest {
                return Err(bad(path, "entries out of order"));
            }
        }
        Ok(table)
    }

    fn pack(&self, slot: usize) -> PackId {
        let at = HEADER + slot * PACK_ID;
        PackId(self.map[at..at + PACK_ID].try_into().expect("8 bytes"))
    }

    fn raw(&self, i: usize) -> (&[u8], u32, u32, u32) {
        let at = HEADER + self.packs * PACK_ID + i * ENTRY;
        let e = &self.map[at..at + ENTRY];
        (&e[..32], u32_at(e, 32), u32_at(e, 36), u32_at(e, 40))
    }

    fn entry(&self, i: usize) -> Entry {
        let (digest, slot, offset, len) = self.raw(i);
        Entry {
            digest: Digest(digest.try_into().expect("32 bytes")),
            at: PackRef { id: self.pack(slot as usize), offset: offset as u64, len: len as u64 },
        }
    }

    pub fn find(&self, digest: &Digest) -> Option<PackRef> {
        let (mut lo, mut hi) = (0, self.entries);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.raw(mid).0.cmp(&digest.0[..]) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.entry(mid).at),
            }
        }
        None
    }

    pub fn packs(&self) -> impl Iterator<Item = PackId> + '_ {
        (0..self.packs).map(|slot| self.pack(slot))
    }

    pub fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        (0..self.entries).map(|i| self.entry(i))
    }
}

/// The name of a pack's own table.
pub(crate) fn table_name(id: PackId) -> String {
    format!("{}{TABLE_SUFFIX}", hex::encode(id.0))
}

/// What a listing of `packs/` shows.
#[derive(Default)]
pub(crate) struct Listing {
    /// Packs with their own table: the indexed packs.
    pub indexed: BTreeSet<PackId>,
    /// Packs without a table: older packs, whose blobs' names are links, or a crash's leftover.
    pub unindexed: BTreeSet<PackId>,
    /// Tables whose pack is not there.
    pub orphan_tables: Vec<PackId>,
    /// Merged tables, newest generation first.
    pub merged: Vec<(u64, String)>,
}

pub(crate) fn list(packs_dir: &Path) -> Result<Listing> {
    let (mut packs, mut tables) = (BTreeSet::new(), BTreeSet::new());
    let mut listing = Listing::default();
    for dirent in fs::read_dir(packs_dir).io_ctx("read dir", packs_dir)? {
        let dirent = dirent.io_ctx("read dir", packs_dir)?;
        let Ok(name) = dirent.file_name().into_string() else { continue };
        if let Some(id) = PackId::from_file_name(&name) {
            packs.insert(id);
        } else if let Some(id) =
            name.strip_suffix(TABLE_SUFFIX).and_then(|hex| PackId::from_file_name(&format!("{hex}.pack")))
        {
            tables.insert(id);
        } else if let Some(generation) = merged_generation(&name) {
            listing.merged.push((generation, name));
        }
    }
    listing.merged.sort_by(|a, b| b.cmp(a));
    listing.orphan_tables = tables.difference(&packs).copied().collect();
    listing.indexed = packs.intersection(&tables).copied().collect();
    listing.unindexed = packs.difference(&tables).copied().collect();
    Ok(listing)
}

/// The generation of a merged table's name `index-<16 hex>-<16 hex>.midx`.
fn merged_generation(name: &str) -> Option<u64> {
    let rest = name.strip_prefix(MERGED_PREFIX)?.strip_suffix(MERGED_SUFFIX)?;
    let (generation, hash) = rest.split_once('-')?;
    let lower_hex = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    (lower_hex(generation) && lower_hex(hash)).then(|| u64::from_str_radix(generation, 16).ok()).flatten()
}

/// The tables one process reads.
#[derive(Default)]
struct Tables {
    refreshed: bool,
    /// The merged table in use, by name, and the packs it covers.
    merged: Option<(String, Table, HashSet<PackId>)>,
    /// Tables of indexed packs the merged one does not cover.
    own: BTreeMap<PackId, Table>,
}

impl Tables {
    fn find(&self, digest: &Digest) -> Option<PackRef> {
        if let Some(at) = self.merged.as_ref().and_then(|(_, table, _)| table.find(digest)) {
            return Some(at);
        }
        self.own.values().find_map(|table| table.find(digest))
    }
}

/// The index of a store's packs, as this process last listed them.
pub(crate) struct PackIndex {
    dir: PathBuf,
    /// The store's tmp directory, where a merged table is written (GC empties it).
    tmp: PathBuf,
    tables: RwLock<Tables>,
}

impl PackIndex {
    pub fn new(dir: PathBuf, tmp: PathBuf) -> PackIndex {
        PackIndex { dir, tmp, tables: RwLock::new(Tables::default()) }
    }

    /// Where the index says the blob is, as last refreshed (listed first if never yet).
    pub fn find(&self, digest: &Digest) -> Result<Option<PackRef>> {
        {
            let tables = self.tables.read().expect("pack index lock");
            if tables.refreshed {
                return Ok(tables.find(digest));
            }
        }
        self.refresh()?;
        Ok(self.tables.read().expect("pack index lock").find(digest))
    }

    /// Maps the table of a pack this process just published.
    pub fn add(&self, id: PackId, path: &Path) {
        let mut tables = self.tables.write().expect("pack index lock");
        if !tables.refreshed || tables.own.contains_key(&id) {
            // The first lookup lists the packs, this one with them.
            return;
        }
        match Table::open(path) {
            Ok(table) => {
                tables.own.insert(id, table);
            }
            Err(e) => tracing::warn!(error = %e, "pack index table not used"),
        }
    }

    /// Lists `packs/` again and maps the tables published since; merges them when they are
    /// many. Tables of packs that are gone are dropped.
    pub fn refresh(&self) -> Result<()> {
        let listing = list(&self.dir)?;
        let mut tables = self.tables.write().expect("pack index lock");
        self.adopt(&mut tables, &listing);
        if tables.own.len() > MERGE_AT
            && let Err(e) = self.merge(&mut tables, &listing, false)
        {
            // Only lookups are slower until the next merge (a GC may have emptied the tmp
            // directory under this one).
            tracing::warn!(error = %e, "pack index tables not merged");
        }
        Ok(())
    }

    /// Writes a merged table of every indexed pack now and removes the older merged tables;
    /// GC calls it after it removed or rewrote packs, so no process keeps using a merged
    /// table that names them.
    pub fn rebuild(&self) -> Result<()> {
        let listing = list(&self.dir)?;
        let mut tables = self.tables.write().expect("pack index lock");
        self.adopt(&mut tables, &listing);
        self.merge(&mut tables, &listing, true)
    }

    /// Makes `tables` what `listing` shows: the newest merged table that covers only indexed
    /// packs, and the own tables of the indexed packs it does not cover.
    fn adopt(&self, tables: &mut Tables, listing: &Listing) {
        let current = tables.merged.as_ref().map(|(name, _, _)| name.clone());
        let mut chosen = None;
        for (_, name) in &listing.merged {
            if Some(name) == current.as_ref() {
                chosen = tables.merged.take();
            } else {
                let path = self.dir.join(name);
                match Table::open(&path) {
                    Ok(table) => {
                        let covers = table.packs().collect();
                        chosen = Some((name.clone(), table, covers));
                    }
                    // Removed meanwhile by a newer merge, or unreadable: the own tables serve.
                    Err(CheckpointError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => tracing::warn!(error = %e, "merged pack index not used"),
                }
            }
            match &chosen {
                Some((_, _, covers)) if covers.iter().all(|id| listing.indexed.contains(id)) => break,
                _ => chosen = None,
            }
        }
        tables.merged = chosen;
        let covered = tables.merged.as_ref().map(|(_, _, covers)| covers);
        let wanted = |id: &PackId| listing.indexed.contains(id) && covered.is_none_or(|c| !c.contains(id));
        tables.own.retain(|id, _| wanted(id));
        for id in listing.indexed.iter().filter(|id| wanted(id)) {
            if tables.own.contains_key(id) {
                continue;
            }
            let path = self.dir.join(table_name(*id));
            match Table::open(&path) {
                Ok(table) => {
                    tables.own.insert(*id, table);
                }
                // GC removed the pack since the listing: its blobs are not live.
                Err(CheckpointError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                // Its blobs read as missing (never as other bytes), and a batch stores them again.
                Err(e) => tracing::warn!(error = %e, "pack index table not used"),
            }
        }
        tables.refreshed = true;
    }

    /// Merges the merged table and the own tables into a new merged table. Unless `wait`, it is
    /// left to whoever merges at the moment.
    fn merge(&self, tables: &mut Tables, listing: &Listing, wait: bool) -> Result<()> {
        let dir = File::open(&self.dir).io_ctx("open", &self.dir)?;
        match rustix::fs::flock(
            dir.as_fd(),
            if wait {
                rustix::fs::FlockOperation::LockExclusive
            } else {
                rustix::fs::FlockOperation::NonBlockingLockExclusive
            },
        ) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Ok(()),
            Err(e) => return Err(std::io::Error::from(e)).io_ctx("flock", &self.dir),
        }
        let mut entries: Vec<Entry> = Vec::new();
        let mut packs = BTreeSet::new();
        if let Some((_, table, covers)) = &tables.merged {
            entries.extend(table.entries());
            packs.extend(covers);
        }
        for (id, table) in &tables.own {
            entries.extend(table.entries());
            packs.insert(*id);
        }
        let generation = listing.merged.first().map_or(0, |(generation, _)| generation + 1);
        let bytes = encode(&packs, &entries)?;
        let hash = Sha256::digest(&bytes);
        let name = format!("{MERGED_PREFIX}{generation:016x}-{}{MERGED_SUFFIX}", hex::encode(&hash[..8]));
        let path = self.dir.join(&name);
        let tmp = self.tmp.join(format!("{name}-{}", std::process::id()));
        let written = (|| {
            let mut file =
                fs::OpenOptions::new().write(true).create_new(true).mode(0o400).open(&tmp).io_ctx("create", &tmp)?;
            file.write_all(&bytes).io_ctx("write", &tmp)?;
            file.sync_all().io_ctx("fsync", &tmp)?;
            fs::rename(&tmp, &path).io_ctx("rename", &path)?;
            sys::fsync_dir(&self.dir).io_ctx("fsync", &self.dir)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        for (_, older) in &listing.merged {
            let _ = fs::remove_file(self.dir.join(older));
        }
        let table = Table::open(&path)?;
        let covers: HashSet<PackId> = table.packs().collect();
        tables.own.retain(|id, _| !covers.contains(id));
        tables.merged = Some((name, table, covers));
        tracing::debug!(merged = %path.display(), blobs = entries.len(), "pack index tables merged");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(n: u8, pack: u8, offset: u64) -> Entry {
        Entry { digest: Digest::of(&[n]), at: PackRef { id: PackId([pack; 8]), offset, len: 4096 } }
    }

    fn write(dir: &Path, name: &str, entries: &[Entry]) -> PathBuf {
        let path = dir.join(name);
        let packs = entries.iter().map(|e| e.at.id).collect();
        fs::write(&path, encode(&packs, entries).unwrap()).unwrap();
        path
    }

    fn open_index(dir: &Path) -> PackIndex {
        PackIndex::new(dir.to_owned(), dir.to_owned())
    }

    proptest! {
        #[test]
        fn a_table_finds_every_blob_it_holds_and_no_other(
            blobs in proptest::collection::btree_map(any::<[u8; 32]>(), (0u8..4, 0u64..8000), 0..300),
            absent in proptest::collection::vec(any::<[u8; 32]>(), 0..50),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let entries: Vec<Entry> = blobs.iter().map(|(d, (pack, chunk))| Entry {
                digest: Digest(*d),
                at: PackRef { id: PackId([*pack; 8]), offset: chunk * 4096, len: 4096 },
            }).collect();
            let table = Table::open(&write(dir.path(), "t.idx", &entries)).unwrap();
            for e in &entries {
                prop_assert_eq!(table.find(&e.digest), Some(e.at));
            }
            for d in absent.iter().filter(|d| !blobs.contains_key(*d)) {
                prop_assert_eq!(table.find(&Digest(*d)), None);
            }
            prop_assert_eq!(table.entries().collect::<Vec<_>>(), entries);
        }
    }

    #[test]
    fn a_damaged_table_is_refused_naming_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let one = BTreeSet::from([PackId([1; 8])]);
        let good = encode(&one, &[entry(1, 1, 0), entry(2, 1, 4096)]).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..good.len() - 1].to_vec(), "take"),
            (
                {
                    let mut b = good.clone();
                    b[HEADER + PACK_ID + 40] ^= 1;
                    b
                },
                "checksum",
            ),
            (
                {
                    let mut b = good.clone();
                    b[0] = b'X';
                    b
                },
                "magic",
            ),
            (b"short".to_vec(), "shorter"),
        ];
        for (bytes, says) in cases {
            let path = dir.path().join("bad.idx");
            fs::write(&path, &bytes).unwrap();
            let err = Table::open(&path).err().expect("refused").to_string();
            assert!(err.contains(says) && err.contains("bad.idx"), "{err}");
        }
        // An entry past any pack's end, with a checksum that matches: refused by the bounds.
        let far = Entry {
            digest: Digest::of(b"x"),
            at: PackRef { id: PackId([1; 8]), offset: PACK_LIMIT + 64 * 1024, len: 4096 },
        };
        assert!(encode(&one, &[far]).is_err());
        assert!(encode(&BTreeSet::new(), &[entry(1, 1, 0)]).is_err(), "an entry in a pack not covered");
    }

    #[test]
    fn a_merged_table_is_used_only_while_every_pack_it_covers_is_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let packs = dir.path();
        for pack in [1u8, 2] {
            fs::write(packs.join(PackId([pack; 8]).file_name()), b"").unwrap();
            write(packs, &table_name(PackId([pack; 8])), &[entry(pack, pack, 0)]);
        }
        let index = open_index(packs);
        index.rebuild().unwrap();
        assert!(index.tables.read().unwrap().own.is_empty(), "all merged");
        assert_eq!(index.find(&Digest::of(&[2])).unwrap(), Some(entry(2, 2, 0).at));
        // Pack 2 goes (as GC removes a pack: its table, then the pack) without a new merged
        // table: a fresh reader must not find its blob through the merged table.
        fs::remove_file(packs.join(table_name(PackId([2; 8])))).unwrap();
        fs::remove_file(packs.join(PackId([2; 8]).file_name())).unwrap();
        let fresh = open_index(packs);
        assert_eq!(fresh.find(&Digest::of(&[2])).unwrap(), None);
        assert_eq!(fresh.find(&Digest::of(&[1])).unwrap(), Some(entry(1, 1, 0).at));
        assert!(fresh.tables.read().unwrap().merged.is_none());
        index.refresh().unwrap();
        assert_eq!(index.find(&Digest::of(&[2])).unwrap(), None, "a refresh drops it too");
    }

    #[test]
    fn many_tables_are_merged_into_one_and_older_merged_tables_go() {
        let dir = tempfile::tempdir().unwrap();
        let packs = dir.path();
        let index = open_index(packs);
        for round in 0..3u8 {
            for pack in 0..=MERGE_AT as u8 {
                let id = round * 100 + pack;
                fs::write(packs.join(PackId([id; 8]).file_name()), b"").unwrap();
                write(packs, &table_name(PackId([id; 8])), &[entry(id, id, 0)]);
            }
            index.refresh().unwrap();
            let merged: Vec<_> = list(packs).unwrap().merged;
            assert_eq!(merged.len(), 1, "{merged:?}");
            assert_eq!(merged[0].0, round as u64);
            assert!(index.tables.read().unwrap().own.is_empty());
        }
        for id in (0..3u8).flat_map(|r| (0..=MERGE_AT as u8).map(move |p| r * 100 + p)) {
            assert_eq!(index.find(&Digest::of(&[id])).unwrap(), Some(entry(id, id, 0).at), "{id}");
        }
    }
}
