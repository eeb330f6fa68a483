//! A chain leaving the store and arriving in another one (the remote tier, `crab-remote`).
//!
//! **Out** ([`CheckpointStore::export_chain`]): every link of a sandbox's chain, oldest first,
//! with the exact bytes of its sealed manifest and the objects the link adds (its blobs, chunk
//! lists, and the chunks those lists name), in a stable order, so that the objects of turn N's
//! restore are the union of the links up to N.
//!
//! **In** ([`CheckpointStore::import_manifest`], [`CheckpointStore::import_head`]): the blobs
//! are written first (through a [`super::WriteBatch`], by whoever pulls them), then each sealed
//! manifest (checked against its own hash before it is written), and the head last, only once
//! the whole chain walks and every blob it references is present and has been hashed to its name
//! (by the batch that wrote it during the import, or read back here). A
//! pull cut short thus leaves blobs and manifests no head names (GC's to collect), never a
//! head over a partial chain. The puller holds [`CheckpointStore::writer_lock`] from its first
//! blob to the head: GC would collect a blob or manifest no head names yet.

use std::collections::HashSet;
use std::fs;
use std::path::Path;

use super::chain::{CheckpointStore, Head};
use super::error::{CheckpointError, IoContext, Result};
use super::images;
use super::manifest::{Manifest, direct_blobs, unseal};
use super::store::{Digest, Durability, publish_file};

/// One link of a chain, as it leaves the store.
#[derive(Debug, Clone)]
pub struct ExportedTurn {
    pub turn: u64,
    pub parent_turn: Option<u64>,
    /// The manifest's id (the hash of its sealed body).
    pub manifest_id: Digest,
    /// The manifest file's exact bytes (the sealed envelope).
    pub sealed: Vec<u8>,
    pub created_unix_ms: u64,
    /// The objects this link adds: blobs of its fs delta, its image files and chunk lists, the
    /// chunks those name; each once, in the order met.
    pub objects: Vec<Digest>,
}

impl CheckpointStore {
    /// Every link of `container`'s chain, oldest first. A chain GC folded into a snapshot has
    /// lost its oldest manifests; it cannot be exported whole and is refused, naming why.
    pub fn export_chain(&self, container: &str) -> Result<Vec<ExportedTurn>> {
        let _lock = self.lock(false)?;
        let (_, chain) = self.chain(container)?;
        if chain.snapshot.is_some() {
            return Err(CheckpointError::InvalidRequest(format!(
                "the chain of {container:?} was folded by gc (its oldest turns are a snapshot): it cannot leave the node turn by turn"
            )));
        }
        let mut out = Vec::with_capacity(chain.links.len());
        let mut seen = HashSet::new();
        for (id, manifest) in chain.links.iter().rev() {
            let path = self.manifest_path(id);
            let sealed = fs::read(&path).io_ctx("read", &path)?;
            let mut objects = Vec::new();
            let mut add = |d: Digest, objects: &mut Vec<Digest>| {
                if seen.insert(d) {
                    objects.push(d);
                }
            };
            for blob in direct_blobs(&manifest.fs_delta, manifest.images.as_ref()) {
                add(*blob, &mut objects);
            }
            if let Some(set) = &manifest.images {
                for digest in images::chunks_in_order(set, self.blobs())? {
                    add(digest, &mut objects);
                }
            }
            out.push(ExportedTurn {
                turn: manifest.turn,
                parent_turn: manifest.parent.map(|p| p.turn),
                manifest_id: *id,
                sealed,
                created_unix_ms: manifest.created_unix_ms,
                objects,
            });
        }
        Ok(out)
    }

    /// Checks a sealed manifest that came from elsewhere and stores it durably under its id
    /// (a manifest already stored is left as it is). Returns its id and content.
    pub fn import_manifest(&self, sealed: &[u8]) -> Result<(Digest, Manifest)> {
        let (id, manifest): (Digest, Manifest) = unseal(sealed, Path::new("<imported manifest>"), None)?;
        let path = self.manifest_path(&id);
        if !path.is_file() {
            publish_file(&self.blobs().tmp_path("manifest"), &path, sealed, Durability::Flushed)?;
        }
        Ok((id, manifest))
    }

    /// Points `container`'s head at an imported chain, once the chain walks from `head` to its
    /// root and every blob it references is present and verified. Refused when `container`
    /// already has a different head: an import never replaces a local chain.
    pub fn import_head(&self, container: &str, head: Head) -> Result<()> {
        self.import_head_over(container, head, None, &HashSet::new())
    }

    /// [`CheckpointStore::import_head`], except that a chain whose head is `over` is extended
    /// (not refused) when the imported chain holds `over` as one of its links, at its turn: the
    /// local chain is then a prefix of the imported one. Any other existing head is refused.
    ///
    /// `hashed` names blobs the importer wrote itself, under the writer lock it still holds,
    /// through [`WriteBatch`](super::WriteBatch)es that hashed the very bytes they stored
    /// ([`WriteBatch::wrote`](super::WriteBatch::wrote)): those are only checked present, not
    /// read back and hashed a second time (a 64 MiB process is 16,384 chunks: reading them back
    /// was most of a pull's time after its writes). Every other blob the chain references (one
    /// the store held before, or one another writer stored meanwhile) is read and hashed here.
    /// A restore hashes every blob again as it reassembles the images, so no byte that changed
    /// on disk since reaches a sandbox either way.
    pub fn import_head_over(
        &self,
        container: &str,
        head: Head,
        over: Option<Head>,
        hashed: &HashSet<Digest>,
    ) -> Result<()> {
        let _lock = self.lock(false)?;
        let existing = self.head(container)?;
        if let Some(existing) = existing {
            if existing == head {
                return Ok(());
            }
            if over != Some(existing) {
                return Err(CheckpointError::InvalidRequest(format!(
                    "{container:?} already has a chain here (head turn {}, manifest {}); it is not replaced by an imported one",
                    existing.turn, existing.manifest
                )));
            }
        }
        let chain = self.walk(container, head.manifest)?;
        if let Some(existing) = existing
            && !chain.links.iter().any(|(id, m)| *id == existing.manifest && m.turn == existing.turn)
        {
            return Err(CheckpointError::InvalidRequest(format!(
                "{container:?} has diverged from the imported chain: its head (turn {}, manifest {}) is not a link of \
                 the chain of turn {} (manifest {}); it is not replaced",
                existing.turn, existing.manifest, head.turn, head.manifest
            )));
        }
        let (_, newest) = chain.links.first().expect("a walked chain has its head");
        if newest.turn != head.turn {
            return Err(CheckpointError::InvalidRequest(format!(
                "manifest {} is turn {}, not turn {}",
                head.manifest, newest.turn, head.turn
            )));
        }
        if chain.snapshot.is_some() {
            return Err(CheckpointError::BrokenChain {
                container: container.to_owned(),
                missing: "the imported chain does not reach its root".into(),
            });
        }
        let mut blobs = HashSet::new();
        for (_, manifest) in &chain.links {
            blobs.extend(direct_blobs(&manifest.fs_delta, manifest.images.as_ref()).copied());
            if let Some(set) = &manifest.images {
                images::referenced_blobs(set, self.blobs(), &mut blobs)?;
            }
        }
        for blob in &blobs {
            if !hashed.contains(blob) {
                self.blobs().verify(blob)?;
            } else if !self.blobs().contains(blob) {
                return Err(CheckpointError::MissingBlob { digest: blob.to_hex(), path: self.blobs().path_of(blob) });
            }
        }
        self.set_head(container, &head, Durability::Flushed)
    }
}
