//! The shim's side of crabd: the node's inspector as an [`EffectSource`] and
//! its bandwidth as a [`CommitGate`].
//!
//! The client keeps one control connection for watch/drain/unwatch and opens
//! one connection per acquire (an acquire may wait, and closing its
//! connection withdraws it). When crabd goes away the next request
//! reconnects, starting crabd again if its socket is gone. A crabd with a new
//! instance id has forgotten every watch and every effect not yet drained:
//! the client watches its containers again and the next drain of each reports
//! at least one lost record, so that turn escalates instead of looking clean.
//!
//! No wait on crabd is unbounded: a request on the control connection (with
//! the reconnect and the watches it may take) ends within `timeout`, an
//! acquire within `max_wait`; a crabd that stops answering costs a turn that
//! bound, and the turn says why (escalated, or written without a grant). A
//! crabd of another build (another [`protocol::compat_identity`]) is never
//! used: the hello fails with [`NodeError::Incompatible`], naming both.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::UnixStream;

use super::NodeError;
use super::bucket::{CommitKind, DEFAULT_CHUNK_BYTES};
use super::protocol::{self, MAX_REPLY_BYTES, PROTOCOL_VERSION, ProtocolError, Reply, Request, compat_identity};
use crab_inspector::{Effect, TurnEffects};

#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub socket: PathBuf,
    /// Start crabd when its socket is absent or refuses connections.
    pub spawn: bool,
    /// The crabd to start; None: `crabd` beside this executable, else on PATH.
    pub crabd_binary: Option<PathBuf>,
    /// Arguments for a started crabd beyond `--socket` (the bucket settings).
    pub crabd_args: Vec<String>,
    /// Bound on each request to crabd: connecting, hello, reconnecting with
    /// its watches, and the reply.
    pub timeout: Duration,
    /// How long a started crabd may take to load the inspector and listen.
    pub spawn_wait: Duration,
    /// Longest an acquire waits before the commit goes ahead anyway.
    pub max_wait: Duration,
}

impl ClientOptions {
    pub fn from_config(config: &crab_config::NodeConfig) -> Self {
        Self {
            socket: config.socket.clone(),
            spawn: config.spawn,
            crabd_binary: None,
            crabd_args: vec![
                "--rate-mib-per-s".into(),
                config.rate_mib_per_s.to_string(),
                "--burst-mib".into(),
                config.burst_mib.to_string(),
                "--aging-ms".into(),
                config.aging_ms.to_string(),
            ],
            timeout: Duration::from_millis(config.timeout_ms),
            spawn_wait: Duration::from_secs(10),
            max_wait: Duration::from_millis(config.max_wait_ms),
        }
    }
}

/// How long a started crabd may leave the socket absent or refusing before
/// another is started (it loads the inspector in well under a second, more
/// under load: the one that holds the lock makes later ones exit at once).
const RESPAWN_AFTER: Duration = Duration::from_millis(1000);

/// A greeted connection to one crabd instance.
struct Connection {
    stream: UnixStream,
    instance: String,
    /// The largest draw it grants at once, when it says.
    chunk_bytes: Option<u64>,
}

impl Connection {
    async fn open(socket: &Path, timeout: Duration) -> Result<Self, NodeError> {
        let attempt = async {
            let mut stream = UnixStream::connect(socket)
                .await
                .map_err(|source| NodeError::Connect { path: socket.into(), source })?;
            let hello = Request::Hello { version: PROTOCOL_VERSION, identity: Some(compat_identity()) };
            protocol::write_message(&mut stream, &hello).await?;
            let reply = protocol::read_message(&mut stream, MAX_REPLY_BYTES).await?;
            check_hello(socket, reply).map(|(instance, chunk_bytes)| Self { stream, instance, chunk_bytes })
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .map_err(|_| NodeError::Timeout { path: socket.into(), after_ms: timeout.as_millis() as u64 })?
    }

    /// Sends `request` and reads its replies: one, or for a drain every
    /// `effects` frame up to the last.
    async fn exchange(&mut self, request: &Request) -> Result<Vec<Reply>, NodeError> {
        protocol::write_message(&mut self.stream, request).await?;
        let mut replies = Vec::new();
        loop {
            let reply: Reply = protocol::read_message(&mut self.stream, MAX_REPLY_BYTES).await?;
            let more = matches!(reply, Reply::Effects { more: true, .. });
            replies.push(reply);
            if !more {
                return Ok(replies);
            }
        }
    }
}

/// What crabd's answer to this build's hello says: its instance and chunk
/// when it is of this build's identity, else why not.
fn check_hello(socket: &Path, reply: Reply) -> Result<(String, Option<u64>), NodeError> {
    let incompatible = |pid: String, theirs: String| NodeError::Incompatible {
        path: socket.into(),
        pid,
        ours: compat_identity(),
        theirs,
    };
    match reply {
        Reply::Hello { identity, instance, pid, chunk_bytes, version } => {
            if protocol::compatible(identity.as_deref()) {
                Ok((instance, chunk_bytes))
            } else {
                let theirs =
                    identity.unwrap_or_else(|| format!("none (protocol {version}, a build older than identities)"));
                Err(incompatible(format!("pid {pid}"), theirs))
            }
        }
        Reply::Unsupported { supported, identity } => Err(incompatible(
            "it refused this build's hello".into(),
            identity.unwrap_or_else(|| format!("none (protocol {supported:?})")),
        )),
        // A crabd older than identities does not know the hello's identity field.
        Reply::Error { message } if message.starts_with("malformed message") => Err(incompatible(
            format!("it refused this build's hello: {message}"),
            "none (a build older than identities)".into(),
        )),
        Reply::Error { message } => Err(NodeError::Remote(message)),
        other => Err(NodeError::UnexpectedReply { request: "hello", got: other.name().into() }),
    }
}

/// Bound on a one-shot request (`crabctl node`).
const ONE_SHOT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to `socket` without starting crabd, sends one request and returns its reply.
pub async fn one_shot(socket: &Path, request: Request) -> Result<Reply, NodeError> {
    let mut connection = Connection::open(socket, ONE_SHOT_TIMEOUT).await?;
    let mut replies = tokio::time::timeout(ONE_SHOT_TIMEOUT, connection.exchange(&request))
        .await
        .map_err(|_| NodeError::Timeout { path: socket.into(), after_ms: ONE_SHOT_TIMEOUT.as_millis() as u64 })??;
    match replies.pop() {
        Some(Reply::Error { message }) => Err(NodeError::Remote(message)),
        Some(reply) => Ok(reply),
        None => Err(ProtocolError::Closed.into()),
    }
}

#[derive(Clone, Copy)]
struct WatchArgs {
    cgroup_id: u64,
    root_pid: u32,
}

struct Control {
    connection: Option<Connection>,
    /// The crabd instance the watches were last sent to.
    instance: Option<String>,
}

pub struct NodeClient {
    options: ClientOptions,
    control: tokio::sync::Mutex<Control>,
    watches: Mutex<HashMap<String, WatchArgs>>,
    /// Watches crabd may not have taken (the request failed): sent again on
    /// the next connection, whichever crabd instance it reaches.
    unconfirmed: Mutex<HashSet<String>>,
    /// Containers whose records may have been lost (crabd restarted, or a
    /// drain broke off): their next drain reports a lost record.
    gaps: Mutex<HashSet<String>>,
    /// The largest draw the crabd last talked to grants at once.
    chunk_bytes: AtomicU64,
    /// The identity of the last crabd of another build met, logged once.
    incompatible_seen: Mutex<Option<String>>,
    /// Until then acquires go ahead at once: crabd granted nothing within
    /// `max_wait` a moment ago, and each write-out would wait that long again.
    ungated_until: Mutex<Option<(Instant, String)>>,
}

impl NodeClient {
    /// Connects to crabd, starting it if allowed and needed.
    pub async fn connect(options: ClientOptions) -> Result<Self, NodeError> {
        let client = Self {
            options,
            control: tokio::sync::Mutex::new(Control { connection: None, instance: None }),
            watches: Mutex::new(HashMap::new()),
            unconfirmed: Mutex::new(HashSet::new()),
            gaps: Mutex::new(HashSet::new()),
            chunk_bytes: AtomicU64::new(DEFAULT_CHUNK_BYTES),
            incompatible_seen: Mutex::new(None),
            ungated_until: Mutex::new(None),
        };
        {
            let mut control = client.control.lock().await;
            let connection = client.reconnect(&mut control).await?;
            control.connection = Some(connection);
        }
        Ok(client)
    }

    pub fn socket(&self) -> &Path {
        &self.options.socket
    }

    /// The instance id of the crabd last talked to.
    pub async fn instance(&self) -> Option<String> {
        self.control.lock().await.instance.clone()
    }

    /// A new control connection; a crabd that restarted meanwhile is given
    /// every watch again, the same one those it may have missed. The caller
    /// bounds it (an unfinished reconnect leaves the watches to the next).
    async fn reconnect(&self, control: &mut Control) -> Result<Connection, NodeError> {
        let mut connection = self.open_or_spawn().await.inspect_err(|e| self.note_incompatible(e))?;
        self.note_chunk(&connection);
        let restarted = control.instance.as_deref() != Some(connection.instance.as_str());
        let again: Vec<String> = if restarted {
            let all: Vec<String> = self.watches.lock().expect("watches lock").keys().cloned().collect();
            if control.instance.is_some() {
                tracing::warn!(instance = %connection.instance, containers = all.len(),
                    "crabd restarted: watching again; records of the meantime are lost");
            }
            all
        } else {
            self.unconfirmed.lock().expect("unconfirmed lock").iter().cloned().collect()
        };
        for container in again {
            let Some(watch) = self.watches.lock().expect("watches lock").get(&container).copied() else { continue };
            // Records from before the watch are gone.
            self.gaps.lock().expect("gaps lock").insert(container.clone());
            let request =
                Request::Watch { container: container.clone(), cgroup_id: watch.cgroup_id, root_pid: watch.root_pid };
            match connection.exchange(&request).await?.pop() {
                Some(Reply::Ok) => {
                    self.unconfirmed.lock().expect("unconfirmed lock").remove(&container);
                }
                other => {
                    tracing::error!(%container, reply = ?other.map(|r| r.name()), "crabd did not watch the container again")
                }
            }
        }
        control.instance = Some(connection.instance.clone());
        Ok(connection)
    }

    /// Logs a crabd of another build once per identity: every request fails
    /// against it the same way.
    fn note_incompatible(&self, error: &NodeError) {
        if let NodeError::Incompatible { theirs, .. } = error {
            let mut seen = self.incompatible_seen.lock().expect("incompatible lock");
            if seen.as_deref() != Some(theirs.as_str()) {
                tracing::error!(%error, "crabd of another build: this shim goes on without it");
                *seen = Some(theirs.clone());
            }
        }
    }

    fn note_chunk(&self, connection: &Connection) {
        let chunk = connection.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES).max(1);
        self.chunk_bytes.store(chunk, Ordering::Relaxed);
    }

    async fn open_or_spawn(&self) -> Result<Connection, NodeError> {
        let socket = &self.options.socket;
        match Connection::open(socket, self.options.timeout).await {
            Ok(connection) => return Ok(connection),
            Err(NodeError::Connect { source, .. })
                if self.options.spawn
                    && matches!(
                        source.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
            {
                tracing::info!(socket = %socket.display(), error = %source, "crabd not running: starting it");
            }
            Err(e) => return Err(e),
        }
        spawn_crabd(&self.options)?;
        let deadline = Instant::now() + self.options.spawn_wait;
        let mut spawned = Instant::now();
        loop {
            match Connection::open(socket, self.options.timeout).await {
                Ok(connection) => return Ok(connection),
                Err(e) if Instant::now() >= deadline => return Err(e),
                // The crabd started exits at once when it finds the lock held, and a crabd
                // that was just killed holds it while the kernel tears it down (its BPF
                // programs and links): seen for a second under load, with every shim's
                // crabd gone and nobody serving. Start another while nobody listens.
                Err(NodeError::Connect { source, .. })
                    if spawned.elapsed() >= RESPAWN_AFTER
                        && matches!(
                            source.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    spawn_crabd(&self.options)?;
                    spawned = Instant::now();
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// One request on the control connection, reconnecting once if it broke;
    /// over within `timeout` whatever crabd does (waiting for the connection
    /// another request holds included).
    async fn call(&self, request: Request) -> Result<Vec<Reply>, NodeError> {
        let bound = self.options.timeout;
        match tokio::time::timeout(bound, self.call_unbounded(&request)).await {
            Ok(result) => result,
            Err(_) => {
                // The exchange was cut off: its connection went with it (see call_unbounded).
                let error =
                    NodeError::Timeout { path: self.options.socket.clone(), after_ms: bound.as_millis() as u64 };
                tracing::warn!(request = request.name(), %error, "crabd did not answer in time");
                self.after_failed(&request);
                Err(error)
            }
        }
    }

    /// What a failed request leaves to do: a drain crabd may have taken the
    /// effects of is a gap; a watch it may not have taken is sent again.
    fn after_failed(&self, request: &Request) {
        match request {
            Request::Drain { container, .. } => {
                self.gaps.lock().expect("gaps lock").insert(container.clone());
            }
            Request::Watch { container, .. } => {
                self.gaps.lock().expect("gaps lock").insert(container.clone());
                self.unconfirmed.lock().expect("unconfirmed lock").insert(container.clone());
            }
            _ => {}
        }
    }

    async fn call_unbounded(&self, request: &Request) -> Result<Vec<Reply>, NodeError> {
        let mut control = self.control.lock().await;
        let mut last_error = None;
        for _ in 0..2 {
            // Out of `control` while in use: an exchange cut off by the bound
            // drops its connection, half-read replies and all.
            let mut connection = match control.connection.take() {
                Some(connection) => connection,
                None => self.reconnect(&mut control).await.inspect_err(|_| self.after_failed(request))?,
            };
            let error = match connection.exchange(request).await {
                Ok(replies) => {
                    control.connection = Some(connection);
                    return match replies.last() {
                        Some(Reply::Error { message }) => Err(NodeError::Remote(message.clone())),
                        _ => Ok(replies),
                    };
                }
                Err(e) => e,
            };
            tracing::warn!(request = request.name(), %error, "crabd connection lost: reconnecting");
            self.after_failed(request);
            last_error = Some(error);
        }
        Err(last_error.expect("every attempt failed"))
    }

    /// Waits for the bandwidth to commit `bytes`; Err when crabd cannot be
    /// reached or answers something else than a grant.
    pub async fn acquire_bandwidth(
        &self,
        sandbox: &str,
        bytes: u64,
        kind: CommitKind,
        turn: u64,
    ) -> Result<f64, NodeError> {
        let request = Request::Acquire { sandbox: sandbox.into(), bytes, kind, turn, supersedable: false };
        match self.acquire_request(request).await? {
            Acquired::Granted { waited_ms } => Ok(waited_ms),
            Acquired::Superseded { .. } => {
                Err(NodeError::UnexpectedReply { request: "acquire", got: "superseded (not asked for)".into() })
            }
            Acquired::Ungated { .. } => unreachable!("acquire_request grants, supersedes or fails"),
        }
    }

    /// Like [`Self::acquire_bandwidth`] for a process checkpoint the caller
    /// may drop: a newer supersedable process checkpoint of `sandbox` ends
    /// this wait with [`Acquired::Superseded`]. The caller promises that the
    /// newer commit covers every path this one would have written.
    pub async fn acquire_supersedable(&self, sandbox: &str, bytes: u64, turn: u64) -> Result<Acquired, NodeError> {
        self.acquire_request(Request::Acquire {
            sandbox: sandbox.into(),
            bytes,
            kind: CommitKind::Proc,
            turn,
            supersedable: true,
        })
        .await
    }

    /// One acquire on a connection of its own (dropping the future closes it,
    /// which withdraws the request). When crabd dies while the request waits,
    /// it is asked again of the crabd that replaces it, started if need be.
    async fn acquire_request(&self, request: Request) -> Result<Acquired, NodeError> {
        // A crabd killed a moment ago can still hold its listening socket
        // while it exits (a connect then lands in its backlog and is reset):
        // a few spaced attempts reach the one that replaces it.
        const ATTEMPTS: u32 = 5;
        let mut last_error = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(100 * u64::from(attempt))).await;
            }
            let outcome = async {
                let mut connection = self.open_or_spawn().await.inspect_err(|e| self.note_incompatible(e))?;
                self.note_chunk(&connection);
                connection.exchange(&request).await
            }
            .await;
            let error = match outcome.map(|mut replies| replies.pop()) {
                Ok(Some(Reply::Granted { waited_ms })) => return Ok(Acquired::Granted { waited_ms }),
                Ok(Some(Reply::Superseded { by_turn, waited_ms })) => {
                    return Ok(Acquired::Superseded { by_turn, waited_ms });
                }
                Ok(Some(Reply::Error { message })) => return Err(NodeError::Remote(message)),
                Ok(other) => {
                    return Err(NodeError::UnexpectedReply {
                        request: "acquire",
                        got: other.map_or("nothing", |r| r.name()).into(),
                    });
                }
                // Another build's crabd answers the same way every time.
                Err(error @ NodeError::Incompatible { .. }) => return Err(error),
                Err(error) => error,
            };
            tracing::warn!(attempt, %error, "acquire: crabd connection lost");
            last_error = Some(error);
        }
        Err(last_error.expect("every attempt failed"))
    }
}

/// How an acquire ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Acquired {
    Granted {
        waited_ms: f64,
    },
    /// Dropped for the newer commit of turn `by_turn`: do not write this one.
    Superseded {
        by_turn: u64,
        waited_ms: f64,
    },
    /// No grant within the bound, or crabd unavailable: the bytes go ahead
    /// anyway, and `reason` says why (the write-out stops asking).
    Ungated {
        waited_ms: f64,
        reason: String,
    },
}

/// The shim's side of crabd's inspector and bucket: what the engine asks of the node.
impl NodeClient {
    /// Watches the container of sandbox `container` (its cgroup, its init) until [`Self::unwatch`];
    /// remembered, so a reconnect to a restarted crabd watches it again.
    pub async fn watch(&self, container: &str, cgroup_id: u64, root_pid: u32) -> Result<(), NodeError> {
        // Remembered first: if crabd is away now, the reconnect watches it.
        self.watches.lock().expect("watches lock").insert(container.into(), WatchArgs { cgroup_id, root_pid });
        let request = Request::Watch { container: container.into(), cgroup_id, root_pid };
        match self.call(request).await {
            Ok(_) => {
                self.unconfirmed.lock().expect("unconfirmed lock").remove(container);
                Ok(())
            }
            Err(e) => {
                // A refusal (not a lost connection) is as good as not watched either.
                self.unconfirmed.lock().expect("unconfirmed lock").insert(container.into());
                self.gaps.lock().expect("gaps lock").insert(container.into());
                Err(e)
            }
        }
    }

    /// The effects of `container` up to `until_ns` (CLOCK_MONOTONIC), and the records lost meanwhile
    /// (at least one when crabd may have missed some: it was away, or refused the watch).
    pub async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, NodeError> {
        let replies = self.call(Request::Drain { container: container.into(), until_ns }).await?;
        let mut effects: Vec<Effect> = Vec::new();
        let mut lost_events = 0;
        let mut overflow = None;
        for reply in replies {
            match reply {
                Reply::Effects { effects: part, lost_events: lost, overflow: cut, .. } => {
                    effects.extend(part);
                    lost_events += lost;
                    overflow = overflow.or(cut);
                }
                other => return Err(NodeError::UnexpectedReply { request: "drain", got: other.name().into() }),
            }
        }
        if self.gaps.lock().expect("gaps lock").remove(container) {
            lost_events = lost_events.max(1);
        }
        Ok(TurnEffects { effects, lost_events, overflow })
    }

    pub async fn unwatch(&self, container: &str) -> Result<(), NodeError> {
        self.watches.lock().expect("watches lock").remove(container);
        self.unconfirmed.lock().expect("unconfirmed lock").remove(container);
        self.gaps.lock().expect("gaps lock").remove(container);
        self.call(Request::Unwatch { container: container.into() }).await.map(drop)
    }

    /// Largest draw crabd grants at once (its hello names it).
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes.load(Ordering::Relaxed)
    }

    /// Waits until `bytes` more of turn `turn`'s write-out may go to disk; always returns (past
    /// `node.max_wait_ms`, or without crabd, the bytes go ahead [`Acquired::Ungated`]). A
    /// `supersedable` process checkpoint may hear instead that a newer one replaces it.
    pub async fn acquire(
        &self,
        sandbox: &str,
        bytes: u64,
        kind: CommitKind,
        turn: u64,
        supersedable: bool,
    ) -> Acquired {
        let started = Instant::now();
        let request = Request::Acquire { sandbox: sandbox.into(), bytes, kind, turn, supersedable };
        let waited_ms = || started.elapsed().as_secs_f64() * 1e3;
        let recent_expiry =
            self.ungated_until.lock().expect("ungated lock").clone().filter(|(until, _)| Instant::now() < *until);
        if let Some((_, reason)) = recent_expiry {
            return Acquired::Ungated { waited_ms: 0.0, reason: format!("{reason} (a moment ago: not asked again)") };
        }
        match tokio::time::timeout(self.options.max_wait, self.acquire_request(request)).await {
            Ok(Ok(acquired)) => {
                tracing::debug!(sandbox, turn, bytes, ?acquired, "commit bandwidth answered");
                *self.ungated_until.lock().expect("ungated lock") = None;
                acquired
            }
            Ok(Err(error)) => {
                tracing::warn!(sandbox, turn, bytes, %error, waited_ms = waited_ms(), "crabd unavailable: writing without a bandwidth grant");
                Acquired::Ungated { waited_ms: waited_ms(), reason: format!("crabd unavailable: {error}") }
            }
            Err(_) => {
                let max_wait_ms = self.options.max_wait.as_millis() as u64;
                tracing::warn!(sandbox, turn, bytes, max_wait_ms, "no bandwidth grant in time: writing anyway");
                let reason = format!(
                    "no grant from crabd at {} within node.max_wait_ms = {max_wait_ms}",
                    self.options.socket.display()
                );
                // A crabd that stopped answering would cost every write-out the whole bound:
                // for as long again the next ones go ahead at once (a grant to an acquire
                // already under way ends that early).
                *self.ungated_until.lock().expect("ungated lock") =
                    Some((Instant::now() + self.options.max_wait, reason.clone()));
                Acquired::Ungated { waited_ms: waited_ms(), reason }
            }
        }
    }

    /// Turn `turn` of `sandbox` holds a full process capture: its waiting process write-outs of
    /// earlier turns may be dropped.
    pub async fn process_captured(&self, sandbox: &str, turn: u64) {
        // Only an optimisation: without it the older write-out is written in full.
        if let Err(error) = self.call(Request::ProcessCaptured { sandbox: sandbox.into(), turn }).await {
            tracing::warn!(sandbox, turn, %error, "crabd did not hear of the newer process capture");
        }
    }
}

/// The crabd to start: the configured one, else `crabd` beside this
/// executable (where the shim is installed), else the first on PATH.
fn crabd_binary(options: &ClientOptions) -> Option<PathBuf> {
    if let Some(binary) = &options.crabd_binary {
        return Some(binary.clone());
    }
    let beside = std::env::current_exe().ok().map(|exe| exe.with_file_name("crabd"));
    if let Some(beside) = beside.filter(|p| p.is_file()) {
        return Some(beside);
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|dir| dir.join("crabd")).find(|p| p.is_file()))
}

/// Starts crabd in a session of its own with stdio detached (its log goes
/// next to the socket), so it outlives the shim that started it.
fn spawn_crabd(options: &ClientOptions) -> Result<(), NodeError> {
    let binary = crabd_binary(options).ok_or_else(|| NodeError::Spawn {
        binary: "crabd".into(),
        message: "not found beside this executable nor on PATH".into(),
    })?;
    let spawn_error = |message: String| NodeError::Spawn { binary: binary.clone(), message };
    let dir = options.socket.parent().unwrap_or(Path::new("/"));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| spawn_error(format!("creating {}: {e}", dir.display())))?;
    let log_path = options.socket.with_extension("log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| spawn_error(format!("opening {}: {e}", log_path.display())))?;
    let mut command = std::process::Command::new(&binary);
    command
        .arg("--socket")
        .arg(&options.socket)
        .args(&options.crabd_args)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(|e| spawn_error(e.to_string()))?)
        .stderr(log);
    // SAFETY: setsid and close_on_exec_from are async-signal-safe and touch no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // crabd outlives the shim that starts it: it must hold none of the shim's
            // descriptors (its ttrpc listener above all, or containerd takes a dead shim's
            // socket for a live one), only stdio to /dev/null and its log.
            crab_sys::close_on_exec_from(3);
            Ok(())
        });
    }
    // Not waited for here: the shim's reaper (it is a subreaper) or init reaps it.
    let child = command.spawn().map_err(|e| spawn_error(e.to_string()))?;
    tracing::info!(binary = %binary.display(), pid = child.id(), socket = %options.socket.display(), log = %log_path.display(), "started crabd");
    Ok(())
}
