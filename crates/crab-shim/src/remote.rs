//! The remote tier in the shim: each turn checkpointed here is queued for the registry of
//! `[remote]` (crab-remote's persistent [`PushQueue`], in `<state_dir>/remote/queue`), and a
//! background task of this shim pushes its sandboxes' queued turns in think time.
//!
//! - A turn is never delayed: queuing is a small file written by a blocking task after the
//!   turn's checkpoint is durable; the push runs in its own task.
//! - Paced: every object read out of the store for a push draws from crabd's token bucket as
//!   the `push` class (after every checkpoint, see crab-node's bucket), or, without crabd, from
//!   a bucket of this shim at `[node] rate_mib_per_s`.
//! - Restarts: the queue is files; a shim that starts (or restores) a sandbox pushes whatever
//!   that sandbox left queued. An flock per sandbox keeps two shims (an old one still exiting
//!   and its successor) from pushing the same sandbox at once.
//! - Failures: the entry stays with a backoff (crab-remote's queue); the next pass retries.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crab_engine::{CommitGate, Replicator};
use crab_remote::chain::{self, ChainSandbox, Pacer, PushLog};
use crab_remote::{Credentials, PushQueue, Remote, RemoteIndex};
use crab_store::{CheckpointStore, SandboxKey};
use tokio::sync::Notify;

/// How often queued pushes are looked at without a new checkpoint (a deferred one's backoff
/// ends, or a registry comes back).
const IDLE_PASS: Duration = Duration::from_secs(2);

pub struct RemotePusher {
    remote: Remote,
    store: Arc<CheckpointStore>,
    state_dir: PathBuf,
    queue: PushQueue,
    gate: Option<Arc<dyn CommitGate>>,
    rate_bytes_per_s: f64,
    /// The sandboxes this shim pushes for: key → the sandbox's names.
    sandboxes: Mutex<HashMap<String, SandboxKey>>,
    wake: Arc<Notify>,
}

fn remote_dir(state_dir: &std::path::Path) -> PathBuf {
    state_dir.join("remote")
}

impl RemotePusher {
    /// The shim's pusher, when `[remote]` names a registry; starts its background task.
    pub fn start(
        config: &crab_config::Config,
        store: Arc<CheckpointStore>,
        gate: Option<Arc<dyn CommitGate>>,
    ) -> Option<Arc<Self>> {
        let settings = &config.remote;
        if !settings.enabled() || !settings.auto_push {
            return None;
        }
        let mut cfg = crab_remote::RemoteConfig::new(settings.prefix.clone());
        cfg.plain_http = settings.plain_http;
        cfg.ca_file = (!settings.ca_file.as_os_str().is_empty()).then(|| settings.ca_file.clone());
        cfg.credentials = Credentials::DockerConfig(
            (!settings.credentials_file.as_os_str().is_empty()).then(|| settings.credentials_file.clone()),
        );
        let state_dir = config.checkpoint.state_dir.clone();
        let built =
            Remote::new(cfg).and_then(|remote| Ok((remote, PushQueue::open(&remote_dir(&state_dir).join("queue"))?)));
        let (remote, queue) = match built {
            Ok(parts) => parts,
            Err(e) => {
                tracing::error!(error = %e, "[remote] is configured but unusable: checkpoints stay on this node");
                return None;
            }
        };
        let pusher = Arc::new(RemotePusher {
            remote,
            store,
            state_dir,
            queue,
            gate,
            rate_bytes_per_s: config.node.rate_mib_per_s as f64 * (1u64 << 20) as f64,
            sandboxes: Mutex::new(HashMap::new()),
            wake: Arc::new(Notify::new()),
        });
        let weak = Arc::downgrade(&pusher);
        tokio::spawn(async move {
            loop {
                let Some(pusher) = weak.upgrade() else { return };
                let _ = tokio::time::timeout(IDLE_PASS, pusher.wake.notified()).await;
                pusher.pass().await;
            }
        });
        Some(pusher)
    }

    /// One pass: every sandbox of this shim with a due entry is pushed.
    async fn pass(&self) {
        let sandboxes: Vec<SandboxKey> = self.sandboxes.lock().expect("pusher poisoned").values().cloned().collect();
        for key in sandboxes {
            let _lock = match self.queue.try_lock(key.namespace(), &key.name()) {
                Ok(Some(lock)) => lock,
                // Another pusher of this sandbox (a shim on its way out, a crabctl push).
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(sandbox = %key, error = %e, "push lock not taken; trying later");
                    continue;
                }
            };
            let sandbox = ChainSandbox {
                namespace: key.namespace().to_owned(),
                sandbox: key.name(),
                key: key.to_string(),
                image: None,
                spec: crab_store::saved_spec_path_of(&self.state_dir, &key.to_string())
                    .ok()
                    .and_then(|p| std::fs::read(p).ok()),
            };
            let pacer: Arc<dyn Pacer> = Arc::new(BucketPacer::new(
                self.gate.clone(),
                tokio::runtime::Handle::current(),
                key.to_string(),
                self.rate_bytes_per_s,
            ));
            let outcome = async {
                let mut index = RemoteIndex::open(&remote_dir(&self.state_dir).join("index"))?;
                let mut log =
                    PushLog::load(&remote_dir(&self.state_dir).join("pushed"), &sandbox.namespace, &sandbox.sandbox)?;
                chain::run_queue_for(
                    &self.remote,
                    &mut index,
                    self.store.clone(),
                    &self.queue,
                    &sandbox,
                    &mut log,
                    Some(pacer),
                )
                .await
            }
            .await;
            match outcome {
                Ok(Some(report)) if !report.pushed.is_empty() => tracing::info!(
                    sandbox = %key,
                    turns = ?report.pushed.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
                    bytes = report.bytes_uploaded(),
                    "checkpointed turns pushed to the registry"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(sandbox = %key, error = %e, "push to the registry failed; it stays queued"),
            }
        }
    }
}

impl Replicator for RemotePusher {
    fn started(&self, key: &str) {
        if let Ok(parsed) = SandboxKey::parse(key) {
            self.sandboxes.lock().expect("pusher poisoned").insert(key.to_owned(), parsed);
            self.wake.notify_one();
        }
    }

    fn checkpointed(&self, key: &str, turn: u64) {
        let Ok(parsed) = SandboxKey::parse(key) else { return };
        self.sandboxes.lock().expect("pusher poisoned").insert(key.to_owned(), parsed.clone());
        let dir = remote_dir(&self.state_dir).join("queue");
        let (namespace, name, key) = (parsed.namespace().to_owned(), parsed.name(), key.to_owned());
        let wake = self.wake.clone();
        // Written (and flushed) off the async threads and without waiting for it: the turn
        // goes on; the pass it wakes reads it.
        let enqueue = move || match PushQueue::open(&dir).and_then(|q| q.enqueue(&namespace, &name, turn)) {
            Ok(_) => wake.notify_one(),
            Err(e) => tracing::warn!(sandbox = key, turn, error = %e, "turn not queued for the registry"),
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(enqueue)),
            Err(_) => enqueue(),
        }
    }
}

/// Draws a push's bytes from crabd's bucket (class `push`), a chunk at a time; without crabd,
/// from a local bucket at the node's rate.
struct BucketPacer {
    gate: Option<Arc<dyn CommitGate>>,
    runtime: tokio::runtime::Handle,
    sandbox: String,
    rate_bytes_per_s: f64,
    state: Mutex<PacerState>,
}

struct PacerState {
    /// Bytes read but not yet drawn.
    owed: u64,
    /// Local bucket: when the bytes drawn so far are paid for.
    paid_until: Instant,
}

impl BucketPacer {
    fn new(gate: Option<Arc<dyn CommitGate>>, runtime: tokio::runtime::Handle, sandbox: String, rate: f64) -> Self {
        BucketPacer {
            gate,
            runtime,
            sandbox,
            rate_bytes_per_s: rate.max(1.0),
            state: Mutex::new(PacerState { owed: 0, paid_until: Instant::now() }),
        }
    }
}

impl Pacer for BucketPacer {
    fn draw(&self, bytes: u64) {
        let chunk = self.gate.as_ref().map_or(1 << 20, |g| g.chunk_bytes().max(1));
        let mut state = self.state.lock().expect("pacer poisoned");
        state.owed += bytes;
        while state.owed >= chunk {
            state.owed -= chunk;
            match &self.gate {
                Some(gate) => {
                    // Called on a blocking thread of the push (never on the runtime's workers).
                    let _ = self.runtime.block_on(gate.acquire(
                        &self.sandbox,
                        chunk,
                        crab_node::CommitKind::Push,
                        0,
                        false,
                    ));
                }
                None => {
                    let now = Instant::now();
                    let start = state.paid_until.max(now);
                    state.paid_until = start + Duration::from_secs_f64(chunk as f64 / self.rate_bytes_per_s);
                    if start > now {
                        std::thread::sleep(start - now);
                    }
                }
            }
        }
    }
}
