//! crabd's wire protocol.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of JSON.
//! The client speaks first, always with `hello{version, identity}`; crabd answers
//! `hello{version, identity, instance, pid}` or `unsupported{supported, identity}` and closes.
//! The identity ([`compat_identity`]) names the wire format and the BPF record layout of the
//! build: a shim and a crabd talk only when theirs are equal, and each side checks (a crabd
//! older than identities refuses the field; its hello carries none).
//! Then each request gets exactly one reply, except `drain`, whose effects
//! come in as many `effects` frames as needed (`more: true` on all but the
//! last), and `acquire`, which may wait: while it waits the client may send
//! `cancel` (reply `cancelled`) or close the connection.
//!
//! A write-out acquires its bytes chunk by chunk as it writes them, each
//! acquire at most the `chunk_bytes` crabd names in its hello (absent from
//! older crabds: then [`super::DEFAULT_CHUNK_BYTES`]). `process_captured`
//! tells crabd that a sandbox has a newer full process capture, which
//! supersedes its waiting process write-outs of earlier turns.
//!
//! A frame longer than the limit, a frame that is not a request, or a peer
//! that is not root gets an `error` reply and the connection is closed.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crab_inspector::{Effect, Overflow};

/// The version this build speaks. Bump it for any incompatible change of the messages; a
/// change of the records, the effects or these messages changes [`compat_identity`] by itself.
pub const PROTOCOL_VERSION: u32 = 2;

/// What a shim and a crabd must share to talk: the protocol version, the digest of the record
/// layout and the effects ([`crab_inspector::RECORD_DIGEST`]), and the digest of this file's
/// messages, `v<version>+<records>.<messages>`.
pub fn compat_identity() -> String {
    static IDENTITY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    IDENTITY
        .get_or_init(|| {
            let messages = crab_inspector::source_digest(&[("protocol.rs", include_str!("protocol.rs"))]);
            format!("v{PROTOCOL_VERSION}+{}.{messages}", crab_inspector::RECORD_DIGEST)
        })
        .clone()
}

/// Whether a peer's hello names this build's identity (None: a peer too old to name one).
pub fn compatible(theirs: Option<&str>) -> bool {
    theirs == Some(compat_identity().as_str())
}

/// What a commit writes: it decides the commit's place in crabd's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommitKind {
    /// A file-system delta.
    Fs,
    /// A process checkpoint (CRIU images, plus the file-system delta).
    Proc,
    /// A push of checkpointed turns to the registry (the remote tier): the objects it reads
    /// out of the store. Goes after every checkpoint, however long it waited: a checkpoint
    /// is what a later push sends.
    Push,
}

/// Largest request crabd reads: requests are small; anything bigger is a
/// confused or hostile peer.
pub const MAX_REQUEST_BYTES: u32 = 64 << 10;
/// Largest reply a client reads (drains are cut into frames well below it).
pub const MAX_REPLY_BYTES: u32 = 16 << 20;
/// crabd cuts a drain's effects into frames of about this many bytes.
pub const EFFECTS_FRAME_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: u32, max: u32 },
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("connection closed")]
    Closed,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// `identity`: the client's [`compat_identity`] (absent from clients older than identities).
    Hello {
        version: u32,
        #[serde(default)]
        identity: Option<String>,
    },
    /// Start recording `container`, whose processes live in cgroup v2 `cgroup_id`.
    Watch {
        container: String,
        cgroup_id: u64,
        root_pid: u32,
    },
    /// Take the effects of `container` up to `until_ns` (CLOCK_MONOTONIC).
    Drain {
        container: String,
        until_ns: u64,
    },
    Unwatch {
        container: String,
    },
    /// Wait for bandwidth to commit `bytes` of `sandbox`'s turn `turn`; crabd
    /// draws them from the bucket in chunks and answers once all are paid.
    /// `supersedable`: a newer supersedable process checkpoint of the same
    /// sandbox may replace this one (answer `superseded`); absent means false.
    Acquire {
        sandbox: String,
        bytes: u64,
        kind: CommitKind,
        turn: u64,
        #[serde(default)]
        supersedable: bool,
    },
    /// Withdraw the acquire this connection is waiting for.
    Cancel,
    /// Turn `turn` of `sandbox` has a full process capture (a CRIU dump)
    /// whose file-system delta holds every path of the sandbox's unwritten
    /// earlier turns: its waiting supersedable acquires of earlier turns are
    /// answered `superseded`, now or as soon as they would have to wait.
    ProcessCaptured {
        sandbox: String,
        turn: u64,
    },
    /// Mark (or unmark) a sandbox for eviction: its commits go first.
    Evict {
        sandbox: String,
        evicting: bool,
    },
    Status,
}

impl Request {
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Watch { .. } => "watch",
            Request::Drain { .. } => "drain",
            Request::Unwatch { .. } => "unwatch",
            Request::Acquire { .. } => "acquire",
            Request::Cancel => "cancel",
            Request::ProcessCaptured { .. } => "process_captured",
            Request::Evict { .. } => "evict",
            Request::Status => "status",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// `instance` changes whenever crabd restarts: a client that sees a new
    /// one knows its watches and the effects recorded so far are gone.
    /// `chunk_bytes`: the largest acquire it grants as one draw. `identity`: crabd's
    /// [`compat_identity`] (absent from crabds older than identities).
    Hello {
        version: u32,
        #[serde(default)]
        identity: Option<String>,
        instance: String,
        pid: u32,
        #[serde(default)]
        chunk_bytes: Option<u64>,
    },
    /// The client's version or identity is not crabd's (`identity`: crabd's).
    Unsupported {
        supported: Vec<u32>,
        #[serde(default)]
        identity: Option<String>,
    },
    Ok,
    /// `overflow` (on the last frame): the container's effect buffer cut the
    /// turn's details (absent from older crabds).
    Effects {
        effects: Vec<Effect>,
        lost_events: u64,
        more: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        overflow: Option<Overflow>,
    },
    Granted {
        waited_ms: f64,
    },
    /// The commit was dropped for the newer one of turn `by_turn`: do not write it.
    Superseded {
        by_turn: u64,
        waited_ms: f64,
    },
    Cancelled,
    Status(Box<NodeStatus>),
    Error {
        message: String,
    },
}

impl Reply {
    pub fn name(&self) -> &'static str {
        match self {
            Reply::Hello { .. } => "hello",
            Reply::Unsupported { .. } => "unsupported",
            Reply::Ok => "ok",
            Reply::Effects { .. } => "effects",
            Reply::Granted { .. } => "granted",
            Reply::Superseded { .. } => "superseded",
            Reply::Cancelled => "cancelled",
            Reply::Status(_) => "status",
            Reply::Error { .. } => "error",
        }
    }

    pub fn error(message: impl std::fmt::Display) -> Self {
        Reply::Error { message: message.to_string() }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub version: u32,
    /// crabd's [`compat_identity`].
    #[serde(default)]
    pub identity: String,
    pub pid: u32,
    pub instance: String,
    pub uptime_s: f64,
    pub watched: Vec<WatchedStatus>,
    pub bucket: BucketStatus,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchedStatus {
    pub container: String,
    pub cgroup_id: u64,
    pub root_pid: u32,
    /// Records lost since the container was watched.
    pub lost_events: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketStatus {
    pub rate_bytes_per_s: f64,
    pub burst_bytes: u64,
    /// Largest draw of one commit at a time.
    pub chunk_bytes: u64,
    pub aging_ms: u64,
    /// Bytes available now.
    pub tokens: f64,
    /// Longest any commit has waited since crabd started (sandboxes gone included).
    pub max_lag_ms: f64,
    /// Commits dropped for a newer one since crabd started.
    pub superseded: u64,
    /// Bytes granted since crabd started.
    pub granted_bytes: u64,
    pub sandboxes: Vec<SandboxStatus>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxStatus {
    pub sandbox: String,
    /// Commits waiting for bandwidth.
    pub waiting: u64,
    pub waiting_bytes: u64,
    /// How long the oldest waiting commit has waited (0: none waits).
    pub lag_ms: f64,
    /// The turn of that commit.
    pub oldest_waiting_turn: Option<u64>,
    /// Longest wait of any commit of this sandbox, waiting ones included.
    pub max_lag_ms: f64,
    pub granted_bytes: u64,
    /// Fully granted commits.
    pub granted_requests: u64,
    /// Chunks drawn (a commit draws one or more).
    pub granted_chunks: u64,
    /// Commits dropped for a newer one of the same sandbox, and their unpaid bytes.
    pub superseded: u64,
    pub superseded_bytes: u64,
    /// Bytes granted over the last 10 s, per second.
    pub recent_rate_bytes_per_s: f64,
    pub evicting: bool,
}

/// Reads one frame of at most `max` bytes; `Closed` on a clean end of stream
/// before the frame started.
pub async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R, max: u32) -> Result<Vec<u8>, ProtocolError> {
    let mut header = [0u8; 4];
    match reader.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ProtocolError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(header);
    if len > max {
        return Err(ProtocolError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len as usize];
    reader.read_exact(&mut body).await?;
    Ok(body)
}

pub async fn read_message<R, T>(reader: &mut R, max: u32) -> Result<T, ProtocolError>
where
    R: AsyncRead + Unpin,
    T: for<'de> Deserialize<'de>,
{
    let body = read_frame(reader, max).await?;
    Ok(serde_json::from_slice(&body)?)
}

pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, ProtocolError> {
    let body = serde_json::to_vec(message)?;
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

pub async fn write_message<W, T>(writer: &mut W, message: &T) -> Result<(), ProtocolError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    writer.write_all(&encode(message)?).await?;
    writer.flush().await?;
    Ok(())
}

/// Cuts effects into replies of about [`EFFECTS_FRAME_BYTES`] each; the last
/// carries the lost count, the overflow and `more: false`. No effects still make one reply.
pub fn effect_frames(effects: Vec<Effect>, lost_events: u64, overflow: Option<Overflow>) -> Vec<Reply> {
    let mut frames = Vec::new();
    let mut chunk = Vec::new();
    let mut chunk_bytes = 0;
    for effect in effects {
        // Paths dominate an effect's size; this overestimates the JSON a little.
        chunk_bytes += 128 + effect.kind.paths().iter().map(|p| p.path.as_os_str().len() * 2).sum::<usize>();
        chunk.push(effect);
        if chunk_bytes >= EFFECTS_FRAME_BYTES {
            frames.push(Reply::Effects {
                effects: std::mem::take(&mut chunk),
                lost_events: 0,
                more: true,
                overflow: None,
            });
            chunk_bytes = 0;
        }
    }
    frames.push(Reply::Effects { effects: chunk, lost_events, more: false, overflow });
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_inspector::{EffectKind, EffectPath, SockAddr};
    use std::os::unix::ffi::OsStringExt;

    fn effect(kind: EffectKind) -> Effect {
        Effect { time_ns: 7, pid: 1, tid: 2, comm: "sh".into(), result: 0, kind }
    }

    #[test]
    fn effects_round_trip_including_non_utf8_paths() {
        let odd = std::path::PathBuf::from(std::ffi::OsString::from_vec(b"/app/\xff\xfe.bin".to_vec()));
        let effects = vec![
            effect(EffectKind::Open {
                path: EffectPath { path: odd.clone(), resolved: true, fs_type: Some("overlay".into()) },
                flags: 65,
                mode: 0o644,
            }),
            effect(EffectKind::Symlink { path: EffectPath::resolved("/app/l"), target: odd }),
            effect(EffectKind::Connect { addr: SockAddr::Inet("10.0.0.1:443".parse().unwrap()) }),
            effect(EffectKind::Exit { status: 256 }),
        ];
        let reply = Reply::Effects { effects: effects.clone(), lost_events: 3, more: false, overflow: None };
        let frame = encode(&reply).unwrap();
        let back: Reply = serde_json::from_slice(&frame[4..]).unwrap();
        assert_eq!(back, reply);
        let overflow = Some(Overflow { events: 1_500_000, bytes: 12 << 30, processes_cut: true });
        let reply = Reply::Effects { effects, lost_events: 0, more: false, overflow };
        let back: Reply = serde_json::from_slice(&encode(&reply).unwrap()[4..]).unwrap();
        assert_eq!(back, reply);
    }

    #[test]
    fn requests_are_tagged_by_op_and_reject_unknown_fields() {
        let text = r#"{"op":"acquire","sandbox":"s","bytes":10,"kind":"proc","turn":3}"#;
        let req: Request = serde_json::from_str(text).unwrap();
        assert_eq!(
            req,
            Request::Acquire { sandbox: "s".into(), bytes: 10, kind: CommitKind::Proc, turn: 3, supersedable: false }
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"drain","container":"c","until_ns":1,"x":1}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
        // A client of this version may mark a process checkpoint supersedable.
        let text = r#"{"op":"acquire","sandbox":"s","bytes":10,"kind":"proc","turn":3,"supersedable":true}"#;
        assert!(matches!(serde_json::from_str(text).unwrap(), Request::Acquire { supersedable: true, .. }));
        let reply = Reply::Superseded { by_turn: 4, waited_ms: 1.5 };
        assert_eq!(serde_json::from_slice::<Reply>(&encode(&reply).unwrap()[4..]).unwrap(), reply);
        let text = r#"{"op":"process_captured","sandbox":"s","turn":5}"#;
        assert_eq!(
            serde_json::from_str::<Request>(text).unwrap(),
            Request::ProcessCaptured { sandbox: "s".into(), turn: 5 }
        );
        // The hello of a crabd that does not name its chunk still parses.
        let old_hello = r#"{"reply":"hello","version":1,"instance":"i","pid":7}"#;
        assert!(matches!(
            serde_json::from_str(old_hello).unwrap(),
            Reply::Hello { chunk_bytes: None, identity: None, .. }
        ));
    }

    #[test]
    fn the_identity_names_the_version_and_both_digests_and_only_it_is_compatible() {
        let ours = compat_identity();
        let (version, digests) = ours.split_once('+').unwrap();
        assert_eq!(version, format!("v{PROTOCOL_VERSION}"));
        let (records, messages) = digests.split_once('.').unwrap();
        assert_eq!(records, crab_inspector::RECORD_DIGEST);
        for digest in [records, messages] {
            assert_eq!(digest.len(), 16, "{ours}");
            assert!(digest.chars().all(|c| c.is_ascii_hexdigit()), "{ours}");
        }
        assert!(compatible(Some(&ours)));
        assert!(!compatible(None), "a peer that names no identity is of an older build");
        let other_records = format!("v{PROTOCOL_VERSION}+0000000000000000.{messages}");
        assert!(!compatible(Some(&other_records)), "another record layout");
        let other_messages = format!("v{PROTOCOL_VERSION}+{records}.0000000000000000");
        assert!(!compatible(Some(&other_messages)), "other messages");
        assert!(!compatible(Some(&format!("v{}+{digests}", PROTOCOL_VERSION + 1))), "another protocol version");
        // Hellos carry it both ways; a hello of a client older than identities still parses.
        let hello = Request::Hello { version: PROTOCOL_VERSION, identity: Some(ours.clone()) };
        assert_eq!(serde_json::from_slice::<Request>(&encode(&hello).unwrap()[4..]).unwrap(), hello);
        let old = r#"{"op":"hello","version":1}"#;
        assert_eq!(serde_json::from_str::<Request>(old).unwrap(), Request::Hello { version: 1, identity: None });
        let refused = r#"{"reply":"unsupported","supported":[1]}"#;
        assert_eq!(
            serde_json::from_str::<Reply>(refused).unwrap(),
            Reply::Unsupported { supported: vec![1], identity: None }
        );
    }

    #[test]
    fn large_drains_are_cut_into_bounded_frames() {
        let long = format!("/app/{}", "x".repeat(3000));
        let effects: Vec<_> = (0..2000)
            .map(|_| effect(EffectKind::Open { path: EffectPath::resolved(&long), flags: 1, mode: 0 }))
            .collect();
        let overflow = Some(Overflow { events: 9, bytes: 900, processes_cut: false });
        let frames = effect_frames(effects, 5, overflow);
        assert!(frames.len() > 1);
        let mut total = 0;
        for (i, frame) in frames.iter().enumerate() {
            let bytes = encode(frame).unwrap().len();
            assert!(bytes < MAX_REPLY_BYTES as usize / 4, "frame {i} is {bytes} bytes");
            let Reply::Effects { effects, lost_events, more, overflow: cut } = frame else { panic!() };
            total += effects.len();
            assert_eq!(*more, i + 1 < frames.len());
            assert_eq!(*lost_events, if *more { 0 } else { 5 });
            assert_eq!(*cut, if *more { None } else { overflow });
        }
        assert_eq!(total, 2000);
    }

    #[tokio::test]
    async fn oversized_frames_are_refused_before_reading_them() {
        let mut data: &[u8] = &[0xff, 0xff, 0xff, 0xff, b'{'];
        match read_frame(&mut data, MAX_REQUEST_BYTES).await {
            Err(ProtocolError::TooLarge { len, max }) => assert_eq!((len, max), (u32::MAX, MAX_REQUEST_BYTES)),
            other => panic!("{other:?}"),
        }
        let mut empty: &[u8] = &[];
        assert!(matches!(read_frame(&mut empty, 10).await, Err(ProtocolError::Closed)));
    }
}
