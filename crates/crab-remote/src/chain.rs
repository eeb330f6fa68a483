//! A sandbox's chain in crab's checkpoint store, pushed to and pulled from a registry turn by
//! turn: the seam between [`crate::remote`] and `crab-store`.
//!
//! **Push** ([`push_chain`]): every link of the chain not yet recorded as pushed, oldest first,
//! as tag `turn-N`, whose objects are the union of the links up to N (the whole closure, so the
//! tag alone restores turn N and the registry's GC keeps all of it). Each push is recorded in
//! the sandbox's [`PushLog`] once the registry accepted the manifest: the record is what
//! `crabctl turns` shows as off the node.
//!
//! **Pull** ([`pull_chain`]): turn N's tag brings every object of its restore that the local
//! store lacks (verified by [`Remote::pull_turn`], written through one store batch, flushed
//! before any manifest is written); then its turn manifest and each parent's (their tags bring
//! only the manifests: every pack is already held), each checked against the parent id the
//! child names; the head last, once the store has walked the chain and verified every blob.
//! The store's writer lock is held throughout, so a GC of the store waits for the head.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crab_store::{CheckpointStore, Head, WriteBatch, WriterLock};
use serde::{Deserialize, Serialize};

use crate::artifact::{self, ANNOTATION_IMAGE, ANNOTATION_SPEC, path_component};
use crate::digest::Digest;
use crate::error::{RemoteError, Result};
use crate::remote::{ObjectSink, ObjectSource, PullTimes, PushReport, Remote, RemoteIndex, TurnPush, write_atomic};

/// Paces a push: called (on a blocking thread) with the bytes of each object read out of the
/// store for packing, before they go on; may block until they may.
pub trait Pacer: Send + Sync {
    fn draw(&self, bytes: u64);
}

/// Objects out of the local store (verified as they are read), plus a few held in memory
/// (the sandbox's spec).
pub struct StoreSource {
    store: Arc<CheckpointStore>,
    extra: HashMap<Digest, Vec<u8>>,
    pacer: Option<Arc<dyn Pacer>>,
}

impl ObjectSource for StoreSource {
    fn read(&self, digest: &Digest) -> std::io::Result<Vec<u8>> {
        if let Some(data) = self.extra.get(digest) {
            return Ok(data.clone());
        }
        let data = self.store.blobs().read(&crab_store::Digest(digest.0)).map_err(std::io::Error::other)?;
        if let Some(pacer) = &self.pacer {
            pacer.draw(data.len() as u64);
        }
        Ok(data)
    }
}

/// Pulled objects into the local store, through one batch (flushed by [`StoreSink::commit`]).
/// Made under the store's [`WriterLock`], which must be held until a head names what it wrote:
/// GC collects the batch's tmp files, and blobs no head names, the moment it may run.
pub struct StoreSink<'a> {
    store: &'a CheckpointStore,
    batch: WriteBatch<'a>,
    held: HashSet<Digest>,
    /// The objects this sink's batch stored from the bytes it hashed (not those it found
    /// stored): what [`CheckpointStore::import_head_over`] need not read back.
    hashed: HashSet<crab_store::Digest>,
    pub bytes_written: u64,
    _writing: &'a WriterLock,
}

impl<'a> StoreSink<'a> {
    pub fn new(store: &'a CheckpointStore, writing: &'a WriterLock) -> Self {
        StoreSink {
            store,
            batch: store.blobs().batch(),
            held: HashSet::new(),
            hashed: HashSet::new(),
            bytes_written: 0,
            _writing: writing,
        }
    }

    /// Makes every object put so far durable; returns those the batch stored from bytes it
    /// hashed itself.
    pub fn commit(self) -> std::result::Result<HashSet<crab_store::Digest>, crab_store::CheckpointError> {
        self.batch.commit()?;
        Ok(self.hashed)
    }
}

impl ObjectSink for StoreSink<'_> {
    fn has(&self, digest: &Digest, len: u64) -> bool {
        self.held.contains(digest) || self.store.blobs().contains_sized(&crab_store::Digest(digest.0), len)
    }

    fn put(&mut self, digest: Digest, data: &[u8]) -> std::io::Result<()> {
        // The remote hashed these bytes to `digest` as it unpacked them: not hashed again.
        let stored = crab_store::Digest(digest.0);
        self.batch.put_verified(stored, data).map_err(std::io::Error::other)?;
        self.bytes_written += data.len() as u64;
        self.held.insert(digest);
        if self.batch.wrote(&stored) {
            self.hashed.insert(stored);
        }
        Ok(())
    }
}

/// One turn the registry accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushedTurn {
    /// The store's manifest id of the turn (a rewound and re-checkpointed turn has another).
    pub manifest_id: String,
    pub manifest_digest: String,
    pub bytes_uploaded: u64,
    pub pushed_unix_ms: u64,
}

/// What of one sandbox's chain is in the registry: `<dir>/<namespace>/<sandbox>.json` (as
/// repository path components), written atomically after each accepted turn.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PushLog {
    /// `<registry>/<repository>`, where the turns went.
    pub repository: String,
    pub turns: BTreeMap<u64, PushedTurn>,
    #[serde(skip)]
    path: PathBuf,
}

impl PushLog {
    pub fn path_in(dir: &Path, namespace: &str, sandbox: &str) -> PathBuf {
        dir.join(path_component(namespace)).join(format!("{}.json", path_component(sandbox)))
    }

    /// The log of a sandbox (empty when it never pushed).
    pub fn load(dir: &Path, namespace: &str, sandbox: &str) -> Result<Self> {
        let path = Self::path_in(dir, namespace, sandbox);
        let mut log: PushLog = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| RemoteError::Io {
                path: path.clone(),
                what: "parse",
                source: std::io::Error::other(e),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => PushLog::default(),
            Err(source) => return Err(RemoteError::Io { path, what: "read", source }),
        };
        log.path = path;
        Ok(log)
    }

    /// True when `turn`, as the manifest `manifest_id` holds it, is in the registry.
    pub fn has(&self, turn: u64, manifest_id: &str) -> bool {
        self.turns.get(&turn).is_some_and(|t| t.manifest_id == manifest_id)
    }

    fn record(&mut self, repository: &str, turn: u64, pushed: PushedTurn) -> Result<()> {
        if self.repository != repository {
            // Another registry or prefix: what went to the old one is not off the node there.
            self.turns.clear();
            self.repository = repository.to_owned();
        }
        self.turns.insert(turn, pushed);
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| RemoteError::Io {
                path: dir.to_owned(),
                what: "create",
                source,
            })?;
        }
        write_atomic(&self.path, &serde_json::to_vec(self).expect("a push log always serializes"))
    }
}

/// The sandbox a push is of.
#[derive(Debug, Clone)]
pub struct ChainSandbox {
    pub namespace: String,
    /// The container id (the repository's last component).
    pub sandbox: String,
    /// The store key of its chain (`<namespace>/<id>`).
    pub key: String,
    /// The image containerd runs it from, when known.
    pub image: Option<String>,
    /// Its saved OCI runtime spec, when the store has one.
    pub spec: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Default)]
pub struct ChainPushReport {
    pub pushed: Vec<(u64, PushReport)>,
    /// Turns the log says the registry holds already.
    pub already: Vec<u64>,
    /// The chain's newest turn.
    pub head_turn: u64,
}

impl ChainPushReport {
    pub fn bytes_uploaded(&self) -> u64 {
        self.pushed.iter().map(|(_, r)| r.bytes_uploaded + r.manifest_bytes).sum()
    }
}

fn store_error(reference: &str, e: crab_store::CheckpointError) -> RemoteError {
    RemoteError::Store { reference: reference.to_owned(), reason: e.to_string() }
}

/// RFC 3339 (UTC, milliseconds) of a Unix time in milliseconds.
pub fn rfc3339(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        unix_ms % 1000
    )
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Pushes every turn of the sandbox's chain the log does not hold yet; see the module's
/// description. Stops at the first failure (later turns need the earlier ones' tags only for a
/// restore of those, but a chain is pushed in order so the lag is one contiguous tail).
pub async fn push_chain(
    remote: &Remote,
    index: &mut RemoteIndex,
    store: Arc<CheckpointStore>,
    sandbox: &ChainSandbox,
    log: &mut PushLog,
    pacer: Option<Arc<dyn Pacer>>,
) -> Result<ChainPushReport> {
    let repository = format!("{}/{}", remote.registry(), remote.repository(&sandbox.namespace, &sandbox.sandbox));
    let exported = {
        let (store, key) = (store.clone(), sandbox.key.clone());
        tokio::task::spawn_blocking(move || store.export_chain(&key))
            .await
            .map_err(|e| RemoteError::Protocol {
                reference: repository.clone(),
                what: "export".into(),
                message: e.to_string(),
            })?
            .map_err(|e| store_error(&repository, e))?
    };
    let mut extra = HashMap::new();
    let mut annotations = BTreeMap::new();
    let mut leading = Vec::new();
    if let Some(image) = &sandbox.image {
        annotations.insert(ANNOTATION_IMAGE.to_owned(), image.clone());
    }
    if let Some(spec) = &sandbox.spec {
        let digest = Digest::of(spec);
        annotations.insert(ANNOTATION_SPEC.to_owned(), digest.to_oci());
        extra.insert(digest, spec.clone());
        leading.push(digest);
    }
    let source: Arc<dyn ObjectSource> = Arc::new(StoreSource { store, extra, pacer });
    let mut report = ChainPushReport { head_turn: exported.last().map_or(0, |t| t.turn), ..Default::default() };
    let mut objects = leading;
    if log.repository != repository {
        log.turns.clear();
    }
    for turn in &exported {
        objects.extend(turn.objects.iter().map(|d| Digest(d.0)));
        let id = turn.manifest_id.to_hex();
        if log.has(turn.turn, &id) {
            report.already.push(turn.turn);
            continue;
        }
        let push = TurnPush {
            namespace: sandbox.namespace.clone(),
            sandbox: sandbox.sandbox.clone(),
            turn: turn.turn,
            parent_turn: turn.parent_turn,
            turn_manifest: turn.sealed.clone(),
            objects: objects.clone(),
            created: rfc3339(turn.created_unix_ms),
            annotations: annotations.clone(),
        };
        let pushed = remote.push_turn(index, &push, source.clone()).await?;
        log.record(
            &repository,
            turn.turn,
            PushedTurn {
                manifest_id: id,
                manifest_digest: pushed.manifest_digest.clone(),
                bytes_uploaded: pushed.bytes_uploaded + pushed.manifest_bytes,
                pushed_unix_ms: now_ms(),
            },
        )?;
        report.pushed.push((turn.turn, pushed));
    }
    Ok(report)
}

/// Runs the push queue's entries of one sandbox: its chain is pushed up to its head (every
/// turn the log lacks; entries of one sandbox coalesce into one push), then each entry of a
/// turn at or below the head is completed. A failure defers every due entry of the sandbox
/// (backoff) and is returned. `Ok(None)`: nothing of the sandbox was due.
pub async fn run_queue_for(
    remote: &Remote,
    index: &mut RemoteIndex,
    store: Arc<CheckpointStore>,
    queue: &crate::queue::PushQueue,
    sandbox: &ChainSandbox,
    log: &mut PushLog,
    pacer: Option<Arc<dyn Pacer>>,
) -> Result<Option<ChainPushReport>> {
    let now = now_ms();
    let mine: Vec<_> = queue
        .pending()?
        .into_iter()
        .filter(|e| e.namespace == sandbox.namespace && e.sandbox == sandbox.sandbox)
        .collect();
    if !mine.iter().any(|e| e.not_before_unix_ms <= now) {
        return Ok(None);
    }
    match push_chain(remote, index, store, sandbox, log, pacer).await {
        Ok(report) => {
            for entry in mine.iter().filter(|e| e.turn <= report.head_turn) {
                queue.complete(entry)?;
            }
            Ok(Some(report))
        }
        Err(e) => {
            for entry in mine.iter().filter(|e| e.not_before_unix_ms <= now) {
                queue.defer(entry, &e)?;
            }
            Err(e)
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct ChainPullReport {
    pub reference: String,
    pub head: Option<Head>,
    /// Tags read (the turn's and each ancestor's).
    pub manifests_pulled: u64,
    pub blobs_pulled: u64,
    pub bytes_pulled: u64,
    pub objects_received: u64,
    pub object_bytes_written: u64,
    pub packs_skipped: u64,
    /// Where the pull's time went, every turn's summed (the store's flushes included).
    pub times: PullTimes,
    /// [`ANNOTATION_IMAGE`] of the turn's manifest.
    pub image: Option<String>,
    /// The sandbox's saved spec ([`ANNOTATION_SPEC`]), verified.
    pub spec: Option<Vec<u8>>,
}

/// Pulls turn `turn` of `namespace/sandbox` from the registry into the local store as the
/// chain of `key`; see the module's description. Nothing local is replaced: a key that
/// already has another chain is refused by the store before its head would move, except a
/// chain whose head is `over` that the pulled chain extends (its head is one of the pulled
/// chain's links; only the objects and manifests the store lacks are pulled).
pub async fn pull_chain(
    remote: &Remote,
    namespace: &str,
    sandbox: &str,
    turn: u64,
    store: &CheckpointStore,
    key: &str,
    over: Option<Head>,
) -> Result<ChainPullReport> {
    let reference = remote.reference(namespace, sandbox, turn);
    let mut report = ChainPullReport { reference: reference.clone(), ..Default::default() };
    // Held from the first object written to the head set, network waits included, as a local
    // checkpoint holds it from capture to publish: until the head names them, the pulled
    // objects and manifests are what GC collects (tmp files, blobs and manifests no head
    // names), and `has` skips objects only because the store holds them now. A GC started
    // meanwhile waits for the pull; the pull waits for a GC already running.
    let writing = store.writer_lock().map_err(|e| store_error(&reference, e))?;
    let mut sink = StoreSink::new(store, &writing);
    let first = remote.pull_turn(namespace, sandbox, turn, &mut sink).await?;
    let written = sink.bytes_written;
    let clock = Instant::now();
    let mut hashed = sink.commit().map_err(|e| store_error(&reference, e))?;
    report.times.store_flush += clock.elapsed();
    report.object_bytes_written = written;
    // Between the turn's objects written and its manifest imported: where a GC that ran
    // unheld would find them unreferenced (tests pause here and collect).
    fail::fail_point!("pull-chain-before-import");
    let add = |report: &mut ChainPullReport, p: &crate::remote::PullReport| {
        report.manifests_pulled += 1;
        report.blobs_pulled += p.blobs_pulled;
        report.bytes_pulled += p.bytes_pulled;
        report.objects_received += p.objects_received;
        report.packs_skipped += p.packs_skipped;
        report.times.add(&p.times);
    };
    add(&mut report, &first);
    report.image = first.checkpoint.extra.get(ANNOTATION_IMAGE).cloned();
    if let Some(spec) = first.checkpoint.extra.get(ANNOTATION_SPEC) {
        let digest = Digest::from_oci(spec).map_err(|e| RemoteError::BadManifest {
            reference: reference.clone(),
            what: ANNOTATION_SPEC.into(),
            reason: e.to_string(),
        })?;
        let spec = store.blobs().read(&crab_store::Digest(digest.0)).map_err(|e| RemoteError::BadManifest {
            reference: reference.clone(),
            what: ANNOTATION_SPEC.into(),
            reason: format!("the spec {digest} is not among the turn's objects: {e}"),
        })?;
        report.spec = Some(spec);
    }
    let (head_id, manifest) = store.import_manifest(&first.turn_manifest).map_err(|e| store_error(&reference, e))?;
    if manifest.turn != turn {
        return Err(RemoteError::BadManifest {
            reference,
            what: "turn manifest".into(),
            reason: format!("it is turn {}", manifest.turn),
        });
    }
    let mut parent = manifest.parent;
    while let Some(p) = parent {
        if let Some(m) = store.manifest(&p.manifest).map_err(|e| store_error(&reference, e))? {
            parent = m.parent;
            continue;
        }
        let parent_ref = remote.reference(namespace, sandbox, p.turn);
        let mut sink = StoreSink::new(store, &writing);
        let pulled = remote.pull_turn(namespace, sandbox, p.turn, &mut sink).await?;
        let clock = Instant::now();
        hashed.extend(sink.commit().map_err(|e| store_error(&parent_ref, e))?);
        report.times.store_flush += clock.elapsed();
        add(&mut report, &pulled);
        let (id, m) = store.import_manifest(&pulled.turn_manifest).map_err(|e| store_error(&parent_ref, e))?;
        if id != p.manifest {
            return Err(RemoteError::BadManifest {
                reference: parent_ref,
                what: "turn manifest".into(),
                reason: format!("it is manifest {id}, the child turn names {} as its parent", p.manifest),
            });
        }
        parent = m.parent;
    }
    let head = Head { manifest: head_id, turn };
    store.import_head_over(key, head, over, &hashed).map_err(|e| store_error(&reference, e))?;
    report.head = Some(head);
    Ok(report)
}

/// Parses `<registry>/<prefix...>/<namespace>/<sandbox>[:turn-N]` into the prefix
/// (`<registry>/<prefix...>`), namespace, sandbox and turn (None: the newest).
pub fn parse_reference(reference: &str) -> Result<(String, String, String, Option<u64>)> {
    let bad = |reason: &str| RemoteError::InvalidReference { reference: reference.to_owned(), reason: reason.into() };
    let (path, tag) = match reference.rsplit_once(':') {
        Some((path, tag)) if !tag.contains('/') => (path, Some(tag)),
        _ => (reference, None),
    };
    let turn = match tag {
        Some(tag) => Some(artifact::parse_turn_tag(tag).ok_or_else(|| bad("its tag is not turn-<N>"))?),
        None => None,
    };
    let mut parts: Vec<&str> = path.split('/').collect();
    if parts.len() < 3 || parts.iter().any(|p| p.is_empty()) {
        return Err(bad("expected <registry>/[<prefix>/]<namespace>/<sandbox>[:turn-<N>]"));
    }
    let sandbox = parts.pop().expect("three parts");
    let namespace = parts.pop().expect("two parts");
    let name = |c: &str| {
        artifact::name_of_component(c).ok_or_else(|| bad(&format!("{c:?} is not a repository path component")))
    };
    Ok((parts.join("/"), name(namespace)?, name(sandbox)?, turn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_735_689_599_000), "2024-12-31T23:59:59.000Z");
    }

    #[test]
    fn references_parse_into_their_parts() {
        let (prefix, ns, sb, turn) = parse_reference("127.0.0.1:5000/crab/default/box:turn-3").unwrap();
        assert_eq!(
            (prefix.as_str(), ns.as_str(), sb.as_str(), turn),
            ("127.0.0.1:5000/crab", "default", "box", Some(3))
        );
        let (prefix, ns, sb, turn) = parse_reference("reg:5000/ns/x--426f78").unwrap();
        assert_eq!((prefix.as_str(), ns.as_str(), sb.as_str(), turn), ("reg:5000", "ns", "Box", None));
        for bad in ["box", "reg/box", "reg/ns/box:latest", "reg//ns/box", "reg/ns/x--zz"] {
            let err = parse_reference(bad).unwrap_err();
            assert!(err.to_string().contains(bad), "{bad}: {err}");
        }
    }

    #[test]
    fn a_push_log_forgets_turns_of_another_repository() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = PushLog::load(dir.path(), "default", "Box").unwrap();
        let t =
            PushedTurn { manifest_id: "a".into(), manifest_digest: "d".into(), bytes_uploaded: 1, pushed_unix_ms: 2 };
        log.record("reg/crab/default/x--426f78", 1, t.clone()).unwrap();
        let mut log = PushLog::load(dir.path(), "default", "Box").unwrap();
        assert!(log.has(1, "a") && !log.has(1, "b") && !log.has(2, "a"));
        log.record("other/crab/default/x--426f78", 2, t).unwrap();
        let log = PushLog::load(dir.path(), "default", "Box").unwrap();
        assert_eq!(log.turns.keys().copied().collect::<Vec<_>>(), vec![2]);
    }
}
