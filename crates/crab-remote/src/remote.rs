//! Push and pull of checkpoints through an OCI registry (the `oci-client` crate).
//!
//! **Push** ([`Remote::push_turn`]): the objects a turn needs (every blob and chunk its
//! restore reads) are looked up in the [`RemoteIndex`] (what earlier pushes to this registry
//! packed); the new ones are packed ([`crate::pack`]; objects of at least
//! [`RemoteConfig::loose_min`] bytes become blobs of their own). The manifest lists every pack
//! (with its index) and blob the turn needs, not only the new ones, so the registry's garbage
//! collector keeps all of them while the tag lives. Each of these blobs the repository lacks
//! is uploaded (HEAD first; a blob another repository of the registry holds is mounted, not
//! sent again), and the manifest goes last: the registry refuses a manifest whose blobs it
//! does not hold, and crab never PUTs one before its blobs, so a tag never names missing data.
//!
//! **Pull** ([`Remote::pull_turn`]): the manifest (its artifact type checked), the turn
//! manifest and the pack indexes are fetched and verified; then only the packs holding an
//! object the caller lacks. Every blob is read into memory up to its descriptor's size, hashed,
//! and refused unless it matches; objects come out of packs verified one by one. Nothing
//! unverified reaches the caller.
//!
//! Every request is bounded ([`RemoteConfig::request_timeout`] plus the time its bytes take at
//! [`RemoteConfig::min_bytes_per_sec`]) and transient failures are retried with exponential
//! backoff ([`RetryPolicy`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt as _;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::manifest::{OCI_IMAGE_MEDIA_TYPE, OciDescriptor};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use tracing::{debug, warn};

use crate::artifact::{self, Checkpoint, Layer};
use crate::auth::Credentials;
use crate::digest::Digest;
use crate::error::{Ctx, RemoteError, Result};
use crate::pack::{self, ChunkIndex, Pack, PackIndex, Packer};

/// Exponential backoff for transient failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all (1: no retry).
    pub attempts: u32,
    pub first_delay: Duration,
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts: 5, first_delay: Duration::from_millis(200), max_delay: Duration::from_secs(5) }
    }
}

impl RetryPolicy {
    /// The pause before try `attempt + 1` (attempt counts from 1): doubling from
    /// `first_delay`, at most `max_delay`, the upper half jittered so that many pushers
    /// retrying one registry spread out.
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = self.first_delay.saturating_mul(1 << attempt.saturating_sub(1).min(20)).min(self.max_delay);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let half = base / 2;
        half + Duration::from_nanos(u64::from(nanos) % (half.as_nanos() as u64).max(1))
    }
}

/// How crab reaches its registry (`[remote]` in crab.toml).
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// `host[:port][/path]`: repositories are `<prefix>/<namespace>/<sandbox>`.
    pub prefix: String,
    /// Plain HTTP (a registry on loopback or a trusted network); HTTPS otherwise.
    pub plain_http: bool,
    /// A PEM file of CA certificates trusted besides the system's.
    pub ca_file: Option<PathBuf>,
    pub credentials: Credentials,
    pub connect_timeout: Duration,
    /// Bound of one request, plus `bytes / min_bytes_per_sec` for requests carrying bytes.
    pub request_timeout: Duration,
    pub min_bytes_per_sec: u64,
    pub retry: RetryPolicy,
    pub pack_target: usize,
    /// Objects of at least this many bytes are blobs of their own, not packed.
    pub loose_min: usize,
    pub zstd_level: i32,
}

impl RemoteConfig {
    pub fn new(prefix: impl Into<String>) -> Self {
        RemoteConfig {
            prefix: prefix.into(),
            plain_http: false,
            ca_file: None,
            credentials: Credentials::DockerConfig(None),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            min_bytes_per_sec: 1 << 20,
            retry: RetryPolicy::default(),
            pack_target: pack::DEFAULT_PACK_TARGET,
            loose_min: 1 << 20,
            zstd_level: pack::DEFAULT_ZSTD_LEVEL,
        }
    }
}

/// Reads objects out of the local store, by digest (blocking; called off the async threads).
pub trait ObjectSource: Send + Sync {
    fn read(&self, digest: &Digest) -> std::io::Result<Vec<u8>>;
}

/// Receives pulled objects, each verified against its digest.
pub trait ObjectSink {
    /// True when the local store already holds the object: a pack of such objects only is not
    /// pulled.
    /// `len` is the object's size, which tells a store where to look.
    fn has(&self, digest: &Digest, len: u64) -> bool;
    /// Stores an object whose bytes the remote has checked against `digest`.
    fn put(&mut self, digest: Digest, data: &[u8]) -> std::io::Result<()>;
}

/// What packing a push's new objects gives: the packs, the objects stored loose (too large
/// to pack), and the bytes of both.
type Packed = (Vec<Pack>, Vec<(Digest, Vec<u8>)>, u64);

/// Blobs a pull fetches ahead of the one it unpacks and stores.
const PULL_AHEAD: usize = 3;

/// A blob a pull fetches after the manifests: a pack's index or a push's indexes, a pack
/// holding objects the store lacks (with the entries of those objects), or a loose object.
enum PullJob {
    /// An index blob: the one the manifest pairs with `pack`, or (`None`) an indexes blob.
    Index {
        digest: Digest,
        size: u64,
        pack: Option<Digest>,
    },
    Pack(PackIndex, Vec<pack::PackEntry>),
    Blob(Digest, u64),
}

/// What a job of [`Remote::fetch_ahead`] brings, and the size of the blob fetched.
struct Fetched {
    content: FetchedContent,
    blob_bytes: u64,
}

enum FetchedContent {
    /// An index blob's bytes, with what [`PullJob::Index`] named.
    Index { digest: Digest, pack: Option<Digest>, bytes: Bytes },
    /// The objects a pack or loose blob holds that the store lacked, each checked against its
    /// digest. A pack's raw objects are slices of the fetched pack, not copies.
    Objects(Vec<(Digest, Bytes)>),
}

type FetchAhead = tokio::task::JoinHandle<Result<Fetched>>;

/// Waits for a job [`Remote::fetch_ahead`] runs, the wait counted as the pull's fetch time (the
/// hashing and unpacking ran in its task, beside this one's writes).
async fn ahead(times: &mut PullTimes, fetch: FetchAhead, reference: &str) -> Result<Fetched> {
    let clock = Instant::now();
    let fetched = fetch.await.map_err(|e| RemoteError::Protocol {
        reference: reference.to_owned(),
        what: "fetch".into(),
        message: format!("the task fetching a blob failed: {e}"),
    })?;
    let fetched = fetched?;
    times.fetch += clock.elapsed();
    times.blobs += 1;
    times.bytes += fetched.blob_bytes;
    Ok(fetched)
}

/// The pack jobs an index blob fetched by a pull asks for, and how many of the packs it
/// describes the sink holds whole (not fetched). A pack's own index must describe the pack (digest
/// and size) the manifest paired it with; an indexes blob may describe packs this manifest does
/// not list (a turn reads only some of an earlier push's packs), which are passed over, and must
/// give the manifest's size for those it does. A pack an earlier index described is not fetched
/// again.
fn pack_jobs(
    reference: &str,
    digest: Digest,
    pack: Option<Digest>,
    bytes: &[u8],
    pack_sizes: &HashMap<Digest, u64>,
    described: &mut HashSet<Digest>,
    sink: &(dyn ObjectSink + Send),
) -> Result<(Vec<PullJob>, u64)> {
    let malformed = |source| RemoteError::Pack { reference: reference.to_owned(), source };
    let indexes = match pack {
        Some(_) => vec![PackIndex::decode(bytes).map_err(malformed)?],
        None => PackIndex::decode_many(bytes).map_err(malformed)?,
    };
    let (mut jobs, mut skipped) = (Vec::new(), 0);
    for index in indexes {
        let listed = pack_sizes.get(&index.pack);
        let wrong = match pack {
            Some(pack) => index.pack != pack || listed != Some(&index.pack_len),
            None => listed.is_some_and(|size| *size != index.pack_len),
        };
        if wrong {
            return Err(RemoteError::BadManifest {
                reference: reference.to_owned(),
                what: format!("pack index {digest}"),
                reason: match (pack, listed) {
                    (Some(pack), _) => format!(
                        "it describes pack {} of {} bytes, the manifest pack {pack}",
                        index.pack, index.pack_len
                    ),
                    (None, listed) => format!(
                        "it describes pack {} of {} bytes, the manifest {} bytes",
                        index.pack,
                        index.pack_len,
                        listed.copied().unwrap_or_default()
                    ),
                },
            });
        }
        if listed.is_none() || !described.insert(index.pack) {
            continue;
        }
        let wanted: Vec<_> = index.entries.iter().filter(|e| !sink.has(&e.digest, e.raw_len.into())).copied().collect();
        if wanted.is_empty() {
            skipped += 1;
        } else {
            jobs.push(PullJob::Pack(index, wanted));
        }
    }
    Ok((jobs, skipped))
}

/// One checkpointed turn to push.
#[derive(Debug, Clone)]
pub struct TurnPush {
    pub namespace: String,
    pub sandbox: String,
    pub turn: u64,
    pub parent_turn: Option<u64>,
    /// Crab's turn manifest, as the store wrote it: the artifact's config blob.
    pub turn_manifest: Vec<u8>,
    /// Every object a restore of this turn reads (the chain's blobs, chunk lists and chunks),
    /// in a stable order: packing follows it, so the same push gives the same packs again.
    pub objects: Vec<Digest>,
    /// RFC 3339 time of the checkpoint, for the manifest's `org.opencontainers.image.created`.
    pub created: String,
    /// Further annotations of the manifest (the sandbox's image, its spec's digest).
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushReport {
    pub reference: String,
    pub manifest_digest: String,
    /// Objects not in any pack or blob pushed before.
    pub new_objects: u64,
    pub new_object_bytes: u64,
    pub packs_created: u64,
    pub blobs_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Blobs another repository held, mounted without sending their bytes.
    pub blobs_mounted: u64,
    /// Blobs the repository already held.
    pub blobs_present: u64,
    pub manifest_bytes: u64,
}

#[derive(Debug, Clone)]
pub struct PullReport {
    pub reference: String,
    pub manifest_digest: String,
    pub checkpoint: Checkpoint,
    /// Crab's turn manifest (the config blob), verified.
    pub turn_manifest: Vec<u8>,
    pub objects_received: u64,
    pub blobs_pulled: u64,
    pub bytes_pulled: u64,
    /// Packs not pulled: the sink held every object in them.
    pub packs_skipped: u64,
    /// Where the pull's time went (the store's flush is the caller's: [`PullTimes::store_flush`]).
    pub times: PullTimes,
}

/// Where a pull's wall time went, phase by phase: an `Instant` around each phase of each blob
/// and object, summed. Cheap (two clock reads per object).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PullTimes {
    /// Waiting for blobs (manifest, turn manifest, pack indexes, packs, loose blobs): the
    /// registry's requests and transfers, the hashing of each blob as it arrives, and the
    /// unpacking and hashing of the objects they bring (in tasks of their own, a few blobs
    /// ahead), as far as the pull waited for them.
    pub fetch: Duration,
    /// Handing objects to the sink: the local store's packs and tmp files (not hashed again:
    /// the pull checked each against its digest).
    pub store_write: Duration,
    /// Making them durable and visible: the store batch's commit (fsyncs, renames).
    pub store_flush: Duration,
    /// Blobs fetched (manifests included) and their bytes.
    pub blobs: u64,
    pub bytes: u64,
    /// Objects handed to the sink and their bytes.
    pub objects_written: u64,
    pub object_bytes_written: u64,
}

impl PullTimes {
    pub fn add(&mut self, other: &PullTimes) {
        self.fetch += other.fetch;
        self.store_write += other.store_write;
        self.store_flush += other.store_flush;
        self.blobs += other.blobs;
        self.bytes += other.bytes;
        self.objects_written += other.objects_written;
        self.object_bytes_written += other.object_bytes_written;
    }

    /// The phases in milliseconds, with what of `total` (the whole pull's wall time) none of
    /// them covers: connecting, the manifests' imports, and the store's walk of the chain
    /// before its head moves (it reads and verifies every blob the chain references again).
    pub fn breakdown(&self, total: Duration) -> PullBreakdown {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let phases = self.fetch + self.store_write + self.store_flush;
        PullBreakdown {
            fetch_ms: ms(self.fetch),
            store_write_ms: ms(self.store_write),
            store_flush_ms: ms(self.store_flush),
            other_ms: ms(total.saturating_sub(phases)),
            blobs: self.blobs,
            bytes_fetched: self.bytes,
            objects_written: self.objects_written,
            object_bytes_written: self.object_bytes_written,
        }
    }
}

/// [`PullTimes`] as reported (`crabctl ... --json`: `pull.breakdown`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PullBreakdown {
    pub fetch_ms: f64,
    pub store_write_ms: f64,
    pub store_flush_ms: f64,
    /// The rest of the pull's wall time (see [`PullTimes::breakdown`]).
    pub other_ms: f64,
    pub blobs: u64,
    pub bytes_fetched: u64,
    pub objects_written: u64,
    pub object_bytes_written: u64,
}

/// What this node knows the registry holds: the indexes of the packs it pushed (or pulled) and
/// which repositories hold which blobs. Only an accelerator: the registry is the truth (a blob
/// the record says is there is checked by the registry itself when the manifest is PUT, and a
/// lost record costs HEAD requests, not data). Kept in a directory: `indexes/<hex>` (the indexes
/// blob of one push, named by its digest), `packs/<hex>` (a pack's own index blob, as builds
/// before the indexes blobs pushed them) and `blobs.json` (blob → repositories, loose objects).
#[derive(Debug, Default)]
pub struct RemoteIndex {
    dir: Option<PathBuf>,
    chunks: ChunkIndex,
    /// Pack digest → the blob its index travels in.
    index_blobs: HashMap<Digest, IndexBlob>,
    state: IndexState,
}

/// The registry blob a pack's index is in.
#[derive(Debug, Clone)]
struct IndexBlob {
    digest: Digest,
    /// Shared by every pack it describes and handed to a push without a copy.
    bytes: Bytes,
    /// An indexes blob, with the indexes of the other packs of its push; else the pack's own.
    shared: bool,
}

impl IndexBlob {
    fn new(bytes: Vec<u8>, shared: bool) -> Self {
        IndexBlob { digest: Digest::of(&bytes), bytes: Bytes::from(bytes), shared }
    }

    /// Its layer in a manifest that lists `pack`.
    fn layer(&self, pack: Digest) -> Layer {
        let size = self.bytes.len() as u64;
        if self.shared {
            Layer::PackIndexes { digest: self.digest, size }
        } else {
            Layer::PackIndex { digest: self.digest, size, pack }
        }
    }
}

#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct IndexState {
    /// Blob → repositories known to hold it.
    repos: BTreeMap<Digest, BTreeSet<String>>,
    /// Objects pushed as blobs of their own (the blob digest is the object digest) → size.
    loose: BTreeMap<Digest, u64>,
}

impl RemoteIndex {
    /// An index kept only in memory.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Loads (or starts) the index kept in `dir`. Pack indexes that fail to parse are skipped:
    /// the registry still has the packs, and HEAD finds them again.
    pub fn open(dir: &Path) -> Result<Self> {
        fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RemoteError + 'a {
            move |source| RemoteError::Io { path: path.to_owned(), what, source }
        }
        let (packs, shared) = (dir.join("packs"), dir.join("indexes"));
        for dir in [&packs, &shared] {
            std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        }
        let mut index = RemoteIndex { dir: Some(dir.to_owned()), ..Default::default() };
        for entry in std::fs::read_dir(&packs).map_err(io("read dir", &packs))? {
            let path = entry.map_err(io("read dir", &packs))?.path();
            let Ok(bytes) = std::fs::read(&path) else { continue };
            match PackIndex::decode(&bytes) {
                Ok(pi) if path.file_name().is_some_and(|n| n == pi.pack.to_hex().as_str()) => {
                    index.index_blobs.insert(pi.pack, IndexBlob::new(bytes, false));
                    index.chunks.insert(pi);
                }
                _ => warn!(path = %path.display(), "skipping an unreadable pack index"),
            }
        }
        for entry in std::fs::read_dir(&shared).map_err(io("read dir", &shared))? {
            let path = entry.map_err(io("read dir", &shared))?.path();
            let Ok(bytes) = std::fs::read(&path) else { continue };
            let blob = IndexBlob::new(bytes, true);
            match PackIndex::decode_many(&blob.bytes) {
                Ok(indexes) if path.file_name().is_some_and(|n| n == blob.digest.to_hex().as_str()) => {
                    for pi in indexes {
                        index.index_blobs.insert(pi.pack, blob.clone());
                        index.chunks.insert(pi);
                    }
                }
                _ => warn!(path = %path.display(), "skipping an unreadable indexes blob"),
            }
        }
        let state = dir.join("blobs.json");
        match std::fs::read(&state) {
            Ok(bytes) => index.state = serde_json::from_slice(&bytes).unwrap_or_default(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("read", &state)(e)),
        }
        Ok(index)
    }

    /// Records the packs one push made, whose indexes travel in `blob` (their indexes blob).
    fn add_packs(&mut self, indexes: Vec<PackIndex>, blob: Vec<u8>) -> Result<()> {
        let blob = IndexBlob::new(blob, true);
        if let Some(dir) = &self.dir {
            let path = dir.join("indexes").join(blob.digest.to_hex());
            if !path.exists() {
                write_atomic(&path, &blob.bytes)?;
            }
        }
        for pi in indexes {
            self.index_blobs.insert(pi.pack, blob.clone());
            self.chunks.insert(pi);
        }
        Ok(())
    }

    /// Forgets a pack the registry lost. A pack whose index shares a blob with others takes
    /// them with it: the record keeps whole indexes blobs only, and forgetting costs HEAD
    /// requests and packing again, never data.
    fn forget_pack(&mut self, pack: &Digest) {
        let Some(blob) = self.index_blobs.get(pack).cloned() else {
            self.chunks.remove_pack(pack);
            self.state.repos.remove(pack);
            return;
        };
        let packs: Vec<Digest> = if blob.shared {
            self.index_blobs.iter().filter(|(_, b)| b.digest == blob.digest).map(|(p, _)| *p).collect()
        } else {
            vec![*pack]
        };
        for pack in &packs {
            self.chunks.remove_pack(pack);
            self.index_blobs.remove(pack);
            self.state.repos.remove(pack);
        }
        self.state.repos.remove(&blob.digest);
        if let Some(dir) = &self.dir {
            let path = if blob.shared {
                dir.join("indexes").join(blob.digest.to_hex())
            } else {
                dir.join("packs").join(pack.to_hex())
            };
            let _ = std::fs::remove_file(path);
        }
    }

    fn repo_has(&self, blob: &Digest, repo: &str) -> bool {
        self.state.repos.get(blob).is_some_and(|r| r.contains(repo))
    }

    fn record(&mut self, blob: Digest, repo: &str) {
        self.state.repos.entry(blob).or_default().insert(repo.to_owned());
    }

    fn forget_repo(&mut self, repo: &str) {
        for repos in self.state.repos.values_mut() {
            repos.remove(repo);
        }
    }

    /// A repository other than `repo` known to hold `blob`.
    fn other_repo(&self, blob: &Digest, repo: &str) -> Option<String> {
        self.state.repos.get(blob)?.iter().find(|r| *r != repo).cloned()
    }

    /// Writes the blob records (pack indexes are written as they come).
    pub fn save(&self) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let bytes = serde_json::to_vec(&self.state).expect("the index state always serializes");
        write_atomic(&dir.join("blobs.json"), &bytes)
    }

    /// Objects held in packs this index knows.
    pub fn packed_objects(&self) -> usize {
        self.chunks.len()
    }
}

/// tmp file, fsync, rename, fsync of the directory: the name shows only durable content.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    let io = |what| move |source| RemoteError::Io { path: path.to_owned(), what, source };
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut file = std::fs::File::create(&tmp).map_err(io("create"))?;
    file.write_all(bytes).map_err(io("write"))?;
    file.sync_all().map_err(io("fsync"))?;
    std::fs::rename(&tmp, path).map_err(io("rename"))?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io("fsync dir"))?;
    }
    Ok(())
}

/// A blob the push may have to upload, with its bytes when this push has them.
struct PlannedBlob {
    digest: Digest,
    bytes: Option<bytes::Bytes>,
    what: String,
}

/// Everything a push sends, decided before the first request.
struct Plan {
    blobs: Vec<PlannedBlob>,
    manifest: Vec<u8>,
    /// Each indexes blob of the push, with the indexes in it.
    new_packs: Vec<(Vec<PackIndex>, Vec<u8>)>,
    new_loose: Vec<(Digest, u64)>,
    new_objects: u64,
    new_object_bytes: u64,
}

/// A connection to one registry under a reference prefix.
#[derive(Clone)]
pub struct Remote {
    cfg: RemoteConfig,
    client: Client,
    auth: RegistryAuth,
    registry: String,
    prefix_path: String,
}

impl Remote {
    pub fn new(cfg: RemoteConfig) -> Result<Self> {
        let (registry, prefix_path) = match cfg.prefix.split_once('/') {
            Some((r, p)) => (r.to_owned(), p.trim_end_matches('/').to_owned()),
            None => (cfg.prefix.clone(), String::new()),
        };
        if registry.is_empty() || !registry.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b)) {
            return Err(RemoteError::InvalidReference {
                reference: cfg.prefix.clone(),
                reason: "the prefix must start with a registry host[:port]".into(),
            });
        }
        let mut extra_root_certificates = Vec::new();
        if let Some(ca) = &cfg.ca_file {
            let data = std::fs::read(ca).map_err(|e| RemoteError::Tls { path: ca.clone(), reason: e.to_string() })?;
            if !data.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
                return Err(RemoteError::Tls { path: ca.clone(), reason: "holds no PEM certificate".into() });
            }
            extra_root_certificates.push(Certificate { encoding: CertificateEncoding::Pem, data });
        }
        // reqwest is built without a bundled TLS provider; ring is installed as the process's
        // provider. A provider the process installed already (another crate's) is kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client_config = ClientConfig {
            protocol: if cfg.plain_http { ClientProtocol::Http } else { ClientProtocol::Https },
            extra_root_certificates,
            // One PUT per blob instead of POST, PATCHes and PUT: packs are a few MiB.
            use_monolithic_push: true,
            platform_resolver: None,
            connect_timeout: Some(cfg.connect_timeout),
            read_timeout: Some(cfg.request_timeout),
            ..Default::default()
        };
        let client = Client::try_from(client_config).map_err(|e| RemoteError::Tls {
            path: cfg.ca_file.clone().unwrap_or_default(),
            reason: format!("cannot build the HTTP client: {e}"),
        })?;
        let auth = cfg.credentials.resolve(&registry)?;
        Ok(Remote { cfg, client, auth, registry, prefix_path })
    }

    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// `<prefix>/<namespace>/<sandbox>`.
    pub fn repository(&self, namespace: &str, sandbox: &str) -> String {
        artifact::repository(&self.prefix_path, namespace, sandbox)
    }

    /// `<registry>/<repository>:turn-<N>`, the reference printed to users and named in errors.
    pub fn reference(&self, namespace: &str, sandbox: &str, turn: u64) -> String {
        format!("{}/{}:{}", self.registry, self.repository(namespace, sandbox), artifact::turn_tag(turn))
    }

    fn oci_reference(&self, repo: &str, tag: &str) -> Reference {
        Reference::with_tag(self.registry.clone(), repo.to_owned(), tag.to_owned())
    }

    fn ctx<'a>(&'a self, reference: &'a str, what: &'a str, credentials: &'a str) -> Ctx<'a> {
        Ctx { reference, registry: &self.registry, what, credentials }
    }

    /// Runs one request under its time bound, retrying transient failures.
    async fn request<T, F, Fut>(&self, reference: &str, what: &str, bytes: u64, mut call: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = std::result::Result<T, oci_client::errors::OciDistributionError>>,
    {
        let bound =
            self.cfg.request_timeout + Duration::from_secs_f64(bytes as f64 / self.cfg.min_bytes_per_sec.max(1) as f64);
        let credentials = self.cfg.credentials.describe();
        let mut attempt = 1;
        loop {
            let outcome = match tokio::time::timeout(bound, call()).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(e)) => self.ctx(reference, what, &credentials).oci(e),
                Err(_) => RemoteError::Timeout { reference: reference.to_owned(), what: what.to_owned(), after: bound },
            };
            let outcome = match outcome {
                RemoteError::Timeout { reference, what, after } if after.is_zero() => {
                    RemoteError::Timeout { reference, what, after: self.cfg.request_timeout }
                }
                other => other,
            };
            if !outcome.is_transient() || attempt >= self.cfg.retry.attempts {
                return Err(outcome);
            }
            let delay = self.cfg.retry.delay(attempt);
            debug!(%reference, what, attempt, ?delay, error = %outcome, "retrying");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// Pushes one turn; see the module's description. `index` is updated (and saved) with
    /// what the registry now holds.
    pub async fn push_turn(
        &self,
        index: &mut RemoteIndex,
        push: &TurnPush,
        source: Arc<dyn ObjectSource>,
    ) -> Result<PushReport> {
        let repo = self.repository(&push.namespace, &push.sandbox);
        let tag = artifact::turn_tag(push.turn);
        let reference = format!("{}/{repo}:{tag}", self.registry);
        let oci_ref = self.oci_reference(&repo, &tag);
        self.client.store_auth_if_needed(&self.registry, &self.auth).await;
        let mut report = PushReport { reference: reference.clone(), ..Default::default() };
        // Two rounds at most: a pack the record names but the registry lost is forgotten and
        // its objects packed again in the second.
        for round in 0..2 {
            let plan = self.plan(index, push, &reference, source.clone()).await?;
            report.new_objects = plan.new_objects;
            report.new_object_bytes = plan.new_object_bytes;
            report.packs_created = plan.new_packs.iter().map(|(indexes, _)| indexes.len() as u64).sum();
            let mut lost = Vec::new();
            for blob in &plan.blobs {
                if index.repo_has(&blob.digest, &repo) {
                    continue;
                }
                let digest = blob.digest.to_oci();
                let what = format!("HEAD of {}", blob.what);
                if self.request(&reference, &what, 0, || self.client.blob_exists(&oci_ref, &digest)).await? {
                    report.blobs_present += 1;
                    index.record(blob.digest, &repo);
                    continue;
                }
                if let Some(from) = index.other_repo(&blob.digest, &repo) {
                    let from_ref = self.oci_reference(&from, "latest");
                    let what = format!("mount of {} from {from}", blob.what);
                    let mounted = self
                        .request(&reference, &what, 0, || self.client.mount_blob(&oci_ref, &from_ref, &digest))
                        .await;
                    // A registry may answer a mount with an upload session instead (202): the
                    // blob is then not there, and HEAD says so.
                    if mounted.is_ok()
                        && self.request(&reference, &what, 0, || self.client.blob_exists(&oci_ref, &digest)).await?
                    {
                        report.blobs_mounted += 1;
                        index.record(blob.digest, &repo);
                        continue;
                    }
                }
                match &blob.bytes {
                    Some(bytes) => {
                        let what = format!("upload of {}", blob.what);
                        self.request(&reference, &what, bytes.len() as u64, || {
                            self.client.push_blob(&oci_ref, bytes.clone(), &digest)
                        })
                        .await?;
                        report.blobs_uploaded += 1;
                        report.bytes_uploaded += bytes.len() as u64;
                        index.record(blob.digest, &repo);
                    }
                    None => lost.push(blob.digest),
                }
            }
            if !lost.is_empty() {
                if round == 1 {
                    return Err(RemoteError::Protocol {
                        reference,
                        what: "push".into(),
                        message: format!("{} blobs vanished from the registry during the push", lost.len()),
                    });
                }
                warn!(%reference, lost = lost.len(), "packs this node pushed are gone from the registry; packing their objects again");
                for pack in &lost {
                    index.forget_pack(pack);
                    if index.state.loose.remove(pack).is_some() {
                        index.state.repos.remove(pack);
                    }
                }
                continue;
            }
            // New packs are recorded only now that they are in the registry: a pusher killed
            // during the uploads packs the same objects into the same packs again next time,
            // and HEAD finds those it had sent.
            for (indexes, blob) in plan.new_packs {
                index.add_packs(indexes, blob)?;
            }
            for (digest, size) in &plan.new_loose {
                index.state.loose.insert(*digest, *size);
            }
            // Last: the manifest, once every blob it names is in the repository.
            let content_type = reqwest::header::HeaderValue::from_static(OCI_IMAGE_MEDIA_TYPE);
            let manifest = bytes::Bytes::from(plan.manifest);
            let put = self
                .request(&reference, "manifest upload", manifest.len() as u64, || {
                    self.client.push_manifest_raw(&oci_ref, manifest.clone(), content_type.clone())
                })
                .await;
            match put {
                Ok(_) => {
                    report.manifest_bytes = manifest.len() as u64;
                    report.manifest_digest = Digest::of(&manifest).to_oci();
                    index.save()?;
                    return Ok(report);
                }
                // The record said the repository held a blob it does not (deleted, GC'd): the
                // registry refused the manifest; ask it blob by blob in the second round.
                Err(RemoteError::NotFound { .. }) if round == 0 => {
                    warn!(%reference, "the registry lacks blobs this node thought it held; checking each");
                    index.forget_repo(&repo);
                }
                Err(e) => {
                    index.save()?;
                    return Err(e);
                }
            }
        }
        unreachable!("the second round returns")
    }

    /// Packs the new objects (off the async threads) and lays out the manifest.
    async fn plan(
        &self,
        index: &RemoteIndex,
        push: &TurnPush,
        reference: &str,
        source: Arc<dyn ObjectSource>,
    ) -> Result<Plan> {
        let mut wanted_packs = BTreeSet::new();
        let mut wanted_loose = Vec::new();
        let mut new = Vec::new();
        let mut seen = HashSet::new();
        for digest in &push.objects {
            if !seen.insert(*digest) {
                continue;
            }
            if let Some(location) = index.chunks.get(digest) {
                wanted_packs.insert(location.pack);
            } else if let Some(size) = index.state.loose.get(digest) {
                wanted_loose.push((*digest, *size));
            } else {
                new.push(*digest);
            }
        }
        let (cfg_target, level, loose_min) = (self.cfg.pack_target, self.cfg.zstd_level, self.cfg.loose_min);
        let reference_owned = reference.to_owned();
        let (packs, loose, new_bytes) = tokio::task::spawn_blocking(move || -> Result<Packed> {
            let mut packer = Packer::new(cfg_target, level)
                .map_err(|source| RemoteError::Pack { reference: reference_owned.clone(), source })?;
            let mut loose = Vec::new();
            let mut bytes = 0u64;
            for digest in new {
                let data = source.read(&digest).map_err(|e| RemoteError::Source {
                    reference: reference_owned.clone(),
                    digest,
                    reason: e.to_string(),
                })?;
                bytes += data.len() as u64;
                if data.len() >= loose_min {
                    let actual = Digest::of(&data);
                    if actual != digest {
                        return Err(RemoteError::Source {
                            reference: reference_owned.clone(),
                            digest,
                            reason: format!("its bytes hash to {actual}"),
                        });
                    }
                    loose.push((digest, data));
                } else {
                    packer
                        .add(digest, &data)
                        .map_err(|source| RemoteError::Pack { reference: reference_owned.clone(), source })?;
                }
            }
            Ok((packer.finish(), loose, bytes))
        })
        .await
        .map_err(|e| RemoteError::Protocol {
            reference: reference.to_owned(),
            what: "packing".into(),
            message: e.to_string(),
        })??;

        let new_objects = packs.iter().map(|p| p.index.entries.len() as u64).sum::<u64>() + loose.len() as u64;
        let mut blobs = Vec::new();
        let mut layers = Vec::new();
        let mut new_packs = Vec::new();
        // Packs pushed before: each with the blob its index travels in, listed once however
        // many of its packs the turn reads.
        let mut index_blobs_listed = HashSet::new();
        for pack in &wanted_packs {
            let size = index.chunks.pack(pack).map_or(0, |p| p.pack_len);
            let blob = index.index_blobs.get(pack).cloned().expect("every indexed pack has its index blob");
            layers.push(Layer::Pack { digest: *pack, size });
            blobs.push(PlannedBlob { digest: *pack, bytes: None, what: format!("pack {pack}") });
            if index_blobs_listed.insert(blob.digest) {
                layers.push(blob.layer(*pack));
                blobs.push(PlannedBlob {
                    digest: blob.digest,
                    bytes: Some(blob.bytes.clone()),
                    what: if blob.shared {
                        format!("indexes {}", blob.digest)
                    } else {
                        format!("index of pack {pack}")
                    },
                });
            }
        }
        // This push's packs, their indexes in one blob (a few for a push of more packs, or larger
        // indexes, than one blob a reader accepts holds): a pull pays one request for them.
        let groups = PackIndex::groups_for_indexes(packs.iter().map(|p| p.index.encoded_len()));
        let mut packs = packs.into_iter();
        for n in groups {
            let group: Vec<Pack> = packs.by_ref().take(n).collect();
            let indexes: Vec<PackIndex> = group.iter().map(|p| p.index.clone()).collect();
            let indexes_blob = PackIndex::encode_many(&indexes);
            let digest = Digest::of(&indexes_blob);
            for pack in group {
                let (pack_digest, size) = (pack.digest(), pack.bytes.len() as u64);
                layers.push(Layer::Pack { digest: pack_digest, size });
                blobs.push(PlannedBlob {
                    digest: pack_digest,
                    bytes: Some(bytes::Bytes::from(pack.bytes)),
                    what: format!("pack {pack_digest}"),
                });
            }
            layers.push(Layer::PackIndexes { digest, size: indexes_blob.len() as u64 });
            blobs.push(PlannedBlob {
                digest,
                bytes: Some(bytes::Bytes::from(indexes_blob.clone())),
                what: format!("indexes of {} packs", indexes.len()),
            });
            new_packs.push((indexes, indexes_blob));
        }
        let mut new_loose = Vec::new();
        for (digest, size) in wanted_loose {
            layers.push(Layer::Blob { digest, size });
            blobs.push(PlannedBlob { digest, bytes: None, what: format!("blob {digest}") });
        }
        for (digest, data) in loose {
            layers.push(Layer::Blob { digest, size: data.len() as u64 });
            new_loose.push((digest, data.len() as u64));
            blobs.push(PlannedBlob { digest, bytes: Some(bytes::Bytes::from(data)), what: format!("blob {digest}") });
        }
        let turn_manifest = Digest::of(&push.turn_manifest);
        blobs.push(PlannedBlob {
            digest: turn_manifest,
            bytes: Some(bytes::Bytes::from(push.turn_manifest.clone())),
            what: "turn manifest".into(),
        });
        let checkpoint = Checkpoint {
            namespace: push.namespace.clone(),
            sandbox: push.sandbox.clone(),
            turn: push.turn,
            parent_turn: push.parent_turn,
            created: push.created.clone(),
            turn_manifest,
            turn_manifest_size: push.turn_manifest.len() as u64,
            layers,
            extra: push.annotations.clone(),
        };
        Ok(Plan {
            blobs,
            manifest: checkpoint.encode(),
            new_packs,
            new_loose,
            new_objects,
            new_object_bytes: new_bytes,
        })
    }

    /// Fetches one blob whole, refusing it unless it is exactly `size` bytes hashing to `digest`.
    ///
    /// The bytes are hashed once, as they arrive: oci-client's blob stream hashes what it yields
    /// and checks the digest it was asked for at the end of the stream, failing the stream
    /// otherwise (`a_corrupt_blob_in_the_registry_is_refused` flips a byte of a pack in a real
    /// registry's storage). Only a refused blob is hashed again, for the error's actual digest.
    async fn fetch_blob(
        &self,
        oci_ref: &Reference,
        reference: &str,
        digest: Digest,
        size: u64,
        media_type: &str,
        what: &str,
    ) -> Result<Bytes> {
        let descriptor = OciDescriptor {
            media_type: media_type.to_owned(),
            digest: digest.to_oci(),
            size: size as i64,
            urls: None,
            annotations: None,
            artifact_type: None,
        };
        let credentials = self.cfg.credentials.describe();
        let ctx = self.ctx(reference, what, &credentials);
        let bound =
            self.cfg.request_timeout + Duration::from_secs_f64(size as f64 / self.cfg.min_bytes_per_sec.max(1) as f64);
        let mut attempt = 1;
        loop {
            let fetched = tokio::time::timeout(bound, async {
                let mut stream = self.client.pull_blob_stream(oci_ref, &descriptor).await.map_err(|e| ctx.oci(e))?;
                let mut data = Vec::with_capacity(size.min(pack::MAX_PACK_BYTES) as usize);
                let mut refused = false;
                while let Some(piece) = stream.next().await {
                    let piece = match piece {
                        Ok(p) => p,
                        // The stream's digest check, after it yielded every byte.
                        Err(e) if e.to_string().contains("digest") => {
                            refused = true;
                            break;
                        }
                        Err(e) => {
                            return Err(RemoteError::Unreachable {
                                reference: reference.to_owned(),
                                registry: self.registry.clone(),
                                reason: format!("{what}: {e}"),
                            });
                        }
                    };
                    if data.len() as u64 + piece.len() as u64 > size {
                        return Err(RemoteError::BlobTooLong {
                            reference: reference.to_owned(),
                            digest,
                            expected: size,
                        });
                    }
                    data.extend_from_slice(&piece);
                }
                Ok((data, refused))
            })
            .await;
            let error = match fetched {
                Ok(Ok((data, refused))) => {
                    if refused || data.len() as u64 != size {
                        return Err(RemoteError::DigestMismatch {
                            reference: reference.to_owned(),
                            digest,
                            actual: format!("{} ({} bytes)", Digest::of(&data), data.len()),
                        });
                    }
                    return Ok(Bytes::from(data));
                }
                Ok(Err(e)) => e,
                Err(_) => RemoteError::Timeout { reference: reference.to_owned(), what: what.to_owned(), after: bound },
            };
            if !error.is_transient() || attempt >= self.cfg.retry.attempts {
                return Err(error);
            }
            tokio::time::sleep(self.cfg.retry.delay(attempt)).await;
            attempt += 1;
        }
    }

    /// Starts a pull's job in a task of its own: the blob fetched and checked against its
    /// digest ([`fetch_blob`](Self::fetch_blob)), and a pack's wanted objects taken out of it,
    /// each decompressed and checked against its own digest.
    fn fetch_ahead(&self, oci_ref: &Reference, reference: &str, job: PullJob) -> FetchAhead {
        let (remote, oci_ref, reference) = (self.clone(), oci_ref.clone(), reference.to_owned());
        tokio::spawn(async move {
            let fetch = |digest, size, media_type, what| {
                remote.fetch_blob(&oci_ref, &reference, digest, size, media_type, what)
            };
            match job {
                PullJob::Index { digest, size, pack } => {
                    let bytes = match pack {
                        Some(_) => fetch(digest, size, artifact::PACK_INDEX_MEDIA_TYPE, "pack index").await?,
                        None => fetch(digest, size, artifact::PACK_INDEXES_MEDIA_TYPE, "pack indexes").await?,
                    };
                    Ok(Fetched {
                        blob_bytes: bytes.len() as u64,
                        content: FetchedContent::Index { digest, pack, bytes },
                    })
                }
                PullJob::Blob(digest, size) => {
                    let data = fetch(digest, size, artifact::BLOB_MEDIA_TYPE, "blob").await?;
                    Ok(Fetched {
                        blob_bytes: data.len() as u64,
                        content: FetchedContent::Objects(vec![(digest, data)]),
                    })
                }
                PullJob::Pack(index, wanted) => {
                    let data = fetch(index.pack, index.pack_len, artifact::PACK_MEDIA_TYPE, "pack").await?;
                    let bad = |source| RemoteError::Pack { reference: reference.clone(), source };
                    // The fetch checked the pack's digest, which the index names: only its
                    // header is left to check.
                    index.check_fetched_pack(&data).map_err(bad)?;
                    let mut reader = pack::ObjectReader::new().map_err(bad)?;
                    let objects = wanted
                        .iter()
                        .map(|entry| Ok((entry.digest, reader.read_shared(&index.pack, &data, entry).map_err(bad)?)))
                        .collect::<Result<Vec<_>>>()?;
                    Ok(Fetched { blob_bytes: data.len() as u64, content: FetchedContent::Objects(objects) })
                }
            }
        })
    }

    /// Pulls turn `turn` of a sandbox; see the module's description.
    pub async fn pull_turn(
        &self,
        namespace: &str,
        sandbox: &str,
        turn: u64,
        sink: &mut (dyn ObjectSink + Send),
    ) -> Result<PullReport> {
        let repo = self.repository(namespace, sandbox);
        let tag = artifact::turn_tag(turn);
        let reference = format!("{}/{repo}:{tag}", self.registry);
        let oci_ref = self.oci_reference(&repo, &tag);
        let mut times = PullTimes::default();
        let clock = Instant::now();
        let (manifest_bytes, manifest_digest) = self
            .request(&reference, "manifest", 0, || {
                self.client.pull_manifest_raw(&oci_ref, &self.auth, &[OCI_IMAGE_MEDIA_TYPE])
            })
            .await?;
        times.fetch += clock.elapsed();
        times.blobs += 1;
        times.bytes += manifest_bytes.len() as u64;
        if manifest_bytes.len() > artifact::MAX_MANIFEST_BYTES {
            return Err(RemoteError::BadManifest {
                reference,
                what: "manifest".into(),
                reason: format!("{} bytes", manifest_bytes.len()),
            });
        }
        let checkpoint = Checkpoint::decode(&manifest_bytes, &reference)?;
        let mut report = PullReport {
            reference: reference.clone(),
            manifest_digest,
            checkpoint: checkpoint.clone(),
            turn_manifest: Vec::new(),
            objects_received: 0,
            blobs_pulled: 0,
            bytes_pulled: manifest_bytes.len() as u64,
            packs_skipped: 0,
            times: PullTimes::default(),
        };
        // A blob fetched and verified, its time in `times`.
        async fn timed(times: &mut PullTimes, fetched: impl Future<Output = Result<Bytes>>) -> Result<Vec<u8>> {
            let clock = Instant::now();
            let data = fetched.await?;
            times.fetch += clock.elapsed();
            times.blobs += 1;
            times.bytes += data.len() as u64;
            Ok(data.into())
        }
        let turn_manifest = timed(
            &mut times,
            self.fetch_blob(
                &oci_ref,
                &reference,
                checkpoint.turn_manifest,
                checkpoint.turn_manifest_size,
                artifact::TURN_MEDIA_TYPE,
                "turn manifest",
            ),
        )
        .await?;
        report.blobs_pulled += 1;
        report.bytes_pulled += turn_manifest.len() as u64;
        report.turn_manifest = turn_manifest;
        let pack_sizes: HashMap<Digest, u64> = checkpoint
            .layers
            .iter()
            .filter_map(|l| match l {
                Layer::Pack { digest, size } => Some((*digest, *size)),
                _ => None,
            })
            .collect();
        // One pipeline of blobs, each fetched in a task of its own up to PULL_AHEAD ahead of the
        // one being stored, and taken in order: the index blobs, each pack that holds objects
        // the store lacks started as soon as its index is read (ahead of the indexes still to
        // fetch), then the loose blobs. The registry's reads and transfers overlap this task's
        // writes, and the indexes' round trips (a registry spends about as long on a 50 KB
        // index as on a 4 MiB pack) overlap the packs' transfers instead of preceding them.
        let mut index_layers = checkpoint.layers.iter().filter_map(|l| match l {
            Layer::PackIndex { digest, size, pack } => Some((*digest, *size, Some(*pack))),
            Layer::PackIndexes { digest, size } => Some((*digest, *size, None)),
            _ => None,
        });
        // Packs an index read so far described: each is fetched once, and every pack of the
        // manifest must be one of them.
        let mut described = HashSet::new();
        let mut loose = checkpoint.layers.iter().filter_map(|l| match l {
            Layer::Blob { digest, size } => Some((*digest, *size)),
            _ => None,
        });
        // Packs whose index has been read, waiting for a place in the pipeline.
        let mut packs = VecDeque::new();
        // In flight, in order.
        let mut fetching: VecDeque<FetchAhead> = VecDeque::new();
        loop {
            while fetching.len() < PULL_AHEAD {
                let job = if let Some(job) = packs.pop_front() {
                    job
                } else if let Some((digest, size, pack)) = index_layers.next() {
                    PullJob::Index { digest, size, pack }
                } else if let Some((digest, size)) = loose.by_ref().find(|(d, size)| !sink.has(d, *size)) {
                    PullJob::Blob(digest, size)
                } else {
                    break;
                };
                fetching.push_back(self.fetch_ahead(&oci_ref, &reference, job));
            }
            let Some(fetch) = fetching.pop_front() else { break };
            let fetched = ahead(&mut times, fetch, &reference).await?;
            report.blobs_pulled += 1;
            report.bytes_pulled += fetched.blob_bytes;
            let objects = match fetched.content {
                FetchedContent::Objects(objects) => objects,
                FetchedContent::Index { digest, pack, bytes } => {
                    let (jobs, skipped) =
                        pack_jobs(&reference, digest, pack, &bytes, &pack_sizes, &mut described, sink)?;
                    packs.extend(jobs);
                    report.packs_skipped += skipped;
                    continue;
                }
            };
            for (digest, object) in objects {
                // An object an earlier pack of this pull brought is not stored twice.
                if sink.has(&digest, object.len() as u64) {
                    continue;
                }
                self.put(sink, &reference, digest, &object, &mut times)?;
                report.objects_received += 1;
            }
        }
        if let Some(pack) = pack_sizes.keys().find(|pack| !described.contains(*pack)) {
            return Err(RemoteError::BadManifest {
                reference,
                what: format!("pack {pack}"),
                reason: "no index the manifest lists describes it".into(),
            });
        }
        report.times = times;
        Ok(report)
    }

    fn put(
        &self,
        sink: &mut (dyn ObjectSink + Send),
        reference: &str,
        digest: Digest,
        data: &[u8],
        times: &mut PullTimes,
    ) -> Result<()> {
        let clock = Instant::now();
        let len = data.len() as u64;
        sink.put(digest, data).map_err(|e| RemoteError::Source {
            reference: reference.to_owned(),
            digest,
            reason: format!("storing it failed: {e}"),
        })?;
        times.store_write += clock.elapsed();
        times.objects_written += 1;
        times.object_bytes_written += len;
        Ok(())
    }

    /// The checkpointed turns of a sandbox in the registry, ascending.
    pub async fn list_turns(&self, namespace: &str, sandbox: &str) -> Result<Vec<u64>> {
        let repo = self.repository(namespace, sandbox);
        let reference = format!("{}/{repo}", self.registry);
        let oci_ref = self.oci_reference(&repo, "latest");
        let tags =
            self.request(&reference, "tag list", 0, || self.client.list_tags(&oci_ref, &self.auth, None, None)).await?;
        let mut turns: Vec<u64> = tags.tags.iter().filter_map(|t| artifact::parse_turn_tag(t)).collect();
        turns.sort_unstable();
        Ok(turns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// One pull's times: `fetch`, then 4 and 5 ms; 3 blobs of 300 bytes, 7 objects of 700.
    fn sample(fetch: Duration) -> PullTimes {
        PullTimes {
            fetch,
            store_write: ms(4),
            store_flush: ms(5),
            blobs: 3,
            bytes: 300,
            objects_written: 7,
            object_bytes_written: 700,
        }
    }

    /// A store that holds some objects, for the pull's choice of packs.
    struct Holding(HashSet<Digest>);

    impl ObjectSink for Holding {
        fn has(&self, digest: &Digest, _len: u64) -> bool {
            self.0.contains(digest)
        }
        fn put(&mut self, digest: Digest, _data: &[u8]) -> std::io::Result<()> {
            self.0.insert(digest);
            Ok(())
        }
    }

    /// Two packs of three 4 KiB objects each, the objects of the first first.
    fn two_packs() -> (Vec<Vec<u8>>, Vec<Pack>) {
        let objects: Vec<Vec<u8>> = (0u8..6).map(|i| vec![i; 4096]).collect();
        let mut packs = Vec::new();
        for three in objects.chunks(3) {
            let mut packer = pack::Packer::new(1 << 20, pack::DEFAULT_ZSTD_LEVEL).unwrap();
            for data in three {
                packer.add(Digest::of(data), data).unwrap();
            }
            packs.extend(packer.finish());
        }
        (objects, packs)
    }

    fn wanted(jobs: &[PullJob]) -> Vec<(Digest, Vec<Digest>)> {
        jobs.iter()
            .map(|job| match job {
                PullJob::Pack(index, entries) => (index.pack, entries.iter().map(|e| e.digest).collect()),
                _ => panic!("not a pack job"),
            })
            .collect()
    }

    #[test]
    fn a_pack_is_fetched_for_the_objects_the_store_lacks_and_only_as_its_manifest_says() {
        let (objects, packs) = two_packs();
        let (pack, digest_of) = (&packs[0], |i: usize| Digest::of(&objects[i]));
        let (index, pack_digest) = (pack.index.encode(), pack.digest());
        let index_digest = Digest::of(&index);
        let sizes = HashMap::from([(pack_digest, pack.bytes.len() as u64)]);
        let reference = "registry.test/crab/ns/sb:turn-1";
        let jobs = |store: &Holding, sizes: &HashMap<Digest, u64>, pack: Digest| {
            pack_jobs(reference, index_digest, Some(pack), &index, sizes, &mut HashSet::new(), store)
        };

        let mut store = Holding(HashSet::from([digest_of(1)]));
        let (found, skipped) = jobs(&store, &sizes, pack_digest).unwrap();
        assert_eq!((wanted(&found), skipped), (vec![(pack_digest, vec![digest_of(0), digest_of(2)])], 0));

        store.0.extend(objects.iter().map(|data| Digest::of(data)));
        let (found, skipped) = jobs(&store, &sizes, pack_digest).unwrap();
        assert_eq!((found.len(), skipped), (0, 1));

        // An index the manifest pairs with another pack, or with another size of this one.
        let other = Digest::of(b"another pack");
        let other_sizes = HashMap::from([(other, pack.bytes.len() as u64)]);
        let error = jobs(&store, &other_sizes, other).err().unwrap();
        assert!(matches!(error, RemoteError::BadManifest { .. }), "{error}");
        assert!(error.to_string().contains(&format!("the manifest pack {other}")), "{error}");
        let short = HashMap::from([(pack_digest, pack.bytes.len() as u64 - 1)]);
        let error = jobs(&store, &short, pack_digest).err().unwrap();
        assert!(error.to_string().contains(&format!("pack index {index_digest}")), "{error}");
    }

    /// A push's indexes blob: only the packs the manifest lists are fetched (a turn may read
    /// some of an earlier push's packs), at the manifest's size, and each pack once.
    #[test]
    fn an_indexes_blob_asks_for_the_packs_the_manifest_lists() {
        let (objects, packs) = two_packs();
        assert_eq!(packs.len(), 2);
        let indexes: Vec<PackIndex> = packs.iter().map(|p| p.index.clone()).collect();
        let blob = PackIndex::encode_many(&indexes);
        let blob_digest = Digest::of(&blob);
        let reference = "registry.test/crab/ns/sb:turn-2";
        let store = Holding(HashSet::from([Digest::of(&objects[0])]));
        let (first, second) = (packs[0].digest(), packs[1].digest());
        let jobs = |sizes: &HashMap<Digest, u64>, described: &mut HashSet<Digest>| {
            pack_jobs(reference, blob_digest, None, &blob, sizes, described, &store)
        };

        // The manifest lists the second pack only.
        let sizes = HashMap::from([(second, packs[1].bytes.len() as u64)]);
        let mut described = HashSet::new();
        let (found, skipped) = jobs(&sizes, &mut described).unwrap();
        let second_objects: Vec<Digest> = objects[3..].iter().map(|o| Digest::of(o)).collect();
        assert_eq!((wanted(&found), skipped), (vec![(second, second_objects)], 0));
        assert_eq!(described, HashSet::from([second]));
        // Described already (by an earlier index of the manifest): not asked for again.
        let (found, skipped) = jobs(&sizes, &mut described).unwrap();
        assert_eq!((found.len(), skipped), (0, 0));

        // Both packs listed, the first at a size its index does not give.
        let sizes = HashMap::from([(first, packs[0].bytes.len() as u64 + 1), (second, packs[1].bytes.len() as u64)]);
        let error = jobs(&sizes, &mut HashSet::new()).err().unwrap();
        assert!(error.to_string().contains(&format!("it describes pack {first} of")), "{error}");
        // Not an indexes blob at all.
        let error = pack_jobs(reference, blob_digest, None, &indexes[0].encode(), &sizes, &mut HashSet::new(), &store)
            .err()
            .unwrap();
        assert!(matches!(error, RemoteError::Pack { .. }), "{error}");
    }

    /// The record of what the registry holds reads both forms of index blob a node may have
    /// kept, and forgets a lost pack with the others whose indexes share its blob.
    #[test]
    fn the_remote_index_keeps_both_forms_and_forgets_an_indexes_blob_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (objects, packs) = two_packs();
        let mut third = pack::Packer::new(1 << 20, pack::DEFAULT_ZSTD_LEVEL).unwrap();
        let data = vec![9u8; 4096];
        third.add(Digest::of(&data), &data).unwrap();
        let [own]: [Pack; 1] = third.finish().try_into().ok().unwrap();
        // A pack index as builds before the indexes blobs kept it, and one indexes blob.
        std::fs::create_dir_all(dir.path().join("packs")).unwrap();
        std::fs::write(dir.path().join("packs").join(own.digest().to_hex()), own.index.encode()).unwrap();
        let mut index = RemoteIndex::open(dir.path()).unwrap();
        index
            .add_packs(
                packs.iter().map(|p| p.index.clone()).collect(),
                PackIndex::encode_many(&packs.iter().map(|p| p.index.clone()).collect::<Vec<_>>()),
            )
            .unwrap();

        let index = RemoteIndex::open(dir.path()).unwrap();
        for data in objects.iter().chain([&data]) {
            assert!(index.chunks.contains(&Digest::of(data)));
        }
        let blob = index.index_blobs[&packs[0].digest()].clone();
        assert!(blob.shared && blob.digest == index.index_blobs[&packs[1].digest()].digest);
        assert_eq!(
            blob.layer(packs[0].digest()),
            Layer::PackIndexes { digest: blob.digest, size: blob.bytes.len() as u64 }
        );
        let own_blob = &index.index_blobs[&own.digest()];
        assert!(!own_blob.shared);
        assert!(matches!(own_blob.layer(own.digest()), Layer::PackIndex { pack, .. } if pack == own.digest()));

        let mut index = index;
        let shared = blob.digest;
        index.forget_pack(&packs[1].digest());
        assert!(index.chunks.get(&Digest::of(&objects[0])).is_none(), "the other pack of the blob goes too");
        assert!(index.chunks.contains(&Digest::of(&data)));
        assert!(!dir.path().join("indexes").join(shared.to_hex()).exists());
        let index = RemoteIndex::open(dir.path()).unwrap();
        assert!(!index.chunks.contains(&Digest::of(&objects[4])) && index.chunks.contains(&Digest::of(&data)));
    }

    #[test]
    fn pull_times_sum_phase_by_phase() {
        let one = sample(ms(10));
        let mut sum = PullTimes::default();
        sum.add(&one);
        sum.add(&PullTimes { fetch: ms(1), blobs: 1, bytes: 1, ..Default::default() });
        assert_eq!(sum, PullTimes { fetch: ms(11), blobs: 4, bytes: 301, ..one });
    }

    #[test]
    fn a_breakdown_is_in_milliseconds_and_the_rest_is_other() {
        let t = sample(Duration::from_micros(1500));
        let b = t.breakdown(ms(20));
        assert_eq!(
            b,
            PullBreakdown {
                fetch_ms: 1.5,
                store_write_ms: 4.0,
                store_flush_ms: 5.0,
                other_ms: 9.5,
                blobs: 3,
                bytes_fetched: 300,
                objects_written: 7,
                object_bytes_written: 700,
            }
        );
        // Phases that overlap (blobs fetched while others are unpacked) can sum past the
        // wall time: nothing is left over, never a negative rest.
        assert_eq!(t.breakdown(ms(10)).other_ms, 0.0);
        let json = serde_json::to_value(b).unwrap();
        assert_eq!(json["store_flush_ms"], 5.0);
        assert_eq!(json["objects_written"], 7);
    }
}
