//! The spawner's wire protocol: frames of a 4-byte big-endian length and a
//! JSON object that carries the protocol version in `v`. File descriptors
//! travel as SCM_RIGHTS on the first byte of the frame that lists them in
//! `fds`, in that order.
//!
//! The shim sends [`Request`]s; the spawner answers each with one reply
//! [`Message`] (in order), and sends [`Message::Exit`] events in between
//! whenever a session's process ends.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub const VERSION: u32 = 1;
/// No legitimate frame comes near this; a larger length means a corrupt stream.
pub const MAX_FRAME_BYTES: usize = 1 << 20;
pub const LENGTH_BYTES: usize = 4;
/// The most descriptors one message carries (stdin, stdout, stderr, pidfd).
pub const MAX_FDS: usize = 4;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// The first frame of a connection to a spawner that holds a key: the key, in hex.
    Auth { key: String },
    /// Start a process in the container.
    Spawn(SpawnRequest),
    /// Drop the spawner's copy of the session's stdin writer (CloseIO).
    CloseStdin { exec_id: String },
    /// Send the session's descriptors and a pidfd again.
    Attach { exec_id: String },
    /// The shim has read the session's host pid from the pidfd of a spawn or
    /// attach reply. Until then the spawner leaves the process unreaped when
    /// it exits: a reaped pid reads as -1 through a pidfd, so an exec that
    /// exits at once would have no pid for the shim.
    Release { exec_id: String },
    /// The sessions alive (or exited and not yet reported).
    List,
    /// The spawner replies, then closes this connection (before a dump).
    Detach,
}

/// How many bytes a [`SpawnerKey`] has.
pub const KEY_BYTES: usize = 32;

/// The secret by which the spawner knows the shim. The kernel's account of a peer
/// (`SO_PEERCRED`) only says that a connection comes from outside the container's pid
/// namespace, where every process reads as pid 0: any root process there that can reach
/// `/proc/<init>/root` (a process of a hostPID pod, say) would pass for the shim. The key is
/// what only the shim has: it makes one for each container it creates and hands it to
/// crab-init on a pipe the runtime passes the init as descriptor [`crate::KEY_FD`]; crab-init
/// reads it before the entrypoint exists, and the spawner keeps it in memory only (it is not
/// dumpable). Every connection proves it in its first frame ([`Request::Auth`]). It never
/// enters the container's files or environment; with a checkpoint it is kept beside the
/// images, root's alone, so the shim that restores the spawner knows it.
#[derive(Clone, PartialEq, Eq)]
pub struct SpawnerKey([u8; KEY_BYTES]);

impl SpawnerKey {
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A key from its lower-case hex form; None for anything else.
    pub fn parse_hex(text: &str) -> Option<Self> {
        let text = text.as_bytes();
        if text.len() != 2 * KEY_BYTES {
            return None;
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut bytes = [0u8; KEY_BYTES];
        for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
            *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(Self(bytes))
    }

    /// Whether `claimed` (hex, from a peer) is this key, in time that does not depend on where
    /// they first differ.
    pub fn matches(&self, claimed: &str) -> bool {
        let Some(other) = Self::parse_hex(claimed) else { return false };
        self.0.iter().zip(other.0.iter()).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
    }
}

impl std::fmt::Debug for SpawnerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpawnerKey(..)")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpawnRequest {
    pub exec_id: String,
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default = "root_dir")]
    pub cwd: String,
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
    #[serde(default)]
    pub additional_gids: Vec<u32>,
    #[serde(default)]
    pub umask: Option<u32>,
    #[serde(default)]
    pub terminal: bool,
    #[serde(default)]
    pub console_size: Option<ConsoleSize>,
    /// Which streams the shim copies; the others are /dev/null (no terminal).
    #[serde(default)]
    pub stdin: bool,
    #[serde(default)]
    pub stdout: bool,
    #[serde(default)]
    pub stderr: bool,
}

fn root_dir() -> String {
    "/".into()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleSize {
    pub height: u16,
    pub width: u16,
}

/// What each descriptor of a message is, from the shim's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FdRole {
    /// Writer into the process's stdin.
    Stdin,
    /// Reader of its stdout.
    Stdout,
    /// Reader of its stderr.
    Stderr,
    /// The pty master of a terminal session.
    Console,
    /// A pidfd of the process (or of the spawner in [`Message::Hello`]).
    Pidfd,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub exec_id: String,
    pub args: Vec<String>,
    /// The pid in the container's pid namespace.
    pub pid: i32,
    pub terminal: bool,
    /// Set once the process ended (its exit event is still to be delivered).
    #[serde(default)]
    pub exited: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Message {
    /// First message of an accepted connection, with a pidfd of the spawner.
    Hello { pid: i32, fds: Vec<FdRole> },
    /// Reply to spawn and attach: the session's descriptors follow.
    Session { session: SessionInfo, fds: Vec<FdRole> },
    /// Reply to list.
    Sessions { sessions: Vec<SessionInfo> },
    /// Reply to close-stdin, release and detach.
    Done,
    /// Reply to a request that failed; `message` says why.
    Error { message: String },
    /// Event: a session's process ended with this raw wait status.
    Exit { exec_id: String, wait_status: i32 },
}

impl Message {
    /// The descriptors this message carries, in order.
    pub fn fds(&self) -> &[FdRole] {
        match self {
            Message::Hello { fds, .. } | Message::Session { fds, .. } => fds,
            _ => &[],
        }
    }

    /// Events arrive between replies; everything else answers a request.
    pub fn is_event(&self) -> bool {
        matches!(self, Message::Exit { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The length prefix exceeds [`MAX_FRAME_BYTES`].
    TooLarge { len: usize, max: usize },
    /// The payload is not a JSON object of the expected shape.
    Json { detail: String },
    /// The object has no numeric `v` field.
    NoVersion,
    /// The peer speaks another protocol version.
    Version { got: u64, expected: u32 },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLarge { len, max } => {
                write!(f, "spawner frame length {len} exceeds the limit of {max} bytes")
            }
            FrameError::Json { detail } => write!(f, "spawner frame is not a valid message: {detail}"),
            FrameError::NoVersion => write!(f, "spawner frame has no protocol version field \"v\""),
            FrameError::Version { got, expected } => {
                write!(f, "spawner frame has protocol version {got}, this side speaks {expected}")
            }
        }
    }
}

impl std::error::Error for FrameError {}

/// One frame: length prefix, then `{"v": VERSION, ...message}`.
pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    let mut value = serde_json::to_value(message).expect("protocol messages serialize");
    if let serde_json::Value::Object(map) = &mut value {
        map.insert("v".into(), VERSION.into());
    }
    let body = serde_json::to_vec(&value).expect("protocol messages serialize");
    let mut frame = Vec::with_capacity(LENGTH_BYTES + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// The payload of the first complete frame in `buf` and the bytes it takes,
/// or None while the frame is incomplete.
pub fn split_frame(buf: &[u8]) -> Result<Option<(&[u8], usize)>, FrameError> {
    let Some(prefix) = buf.get(..LENGTH_BYTES) else { return Ok(None) };
    let len = u32::from_be_bytes(prefix.try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len, max: MAX_FRAME_BYTES });
    }
    Ok(buf.get(LENGTH_BYTES..LENGTH_BYTES + len).map(|payload| (payload, LENGTH_BYTES + len)))
}

/// Decodes a payload after checking its version.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    let value: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| FrameError::Json { detail: e.to_string() })?;
    match value.get("v").and_then(serde_json::Value::as_u64) {
        None => return Err(FrameError::NoVersion),
        Some(v) if v != u64::from(VERSION) => return Err(FrameError::Version { got: v, expected: VERSION }),
        Some(_) => {}
    }
    serde_json::from_value(value).map_err(|e| FrameError::Json { detail: e.to_string() })
}

/// Who may talk to the spawner: the shim, root, which is the parent of the container's init (the
/// runtime leaves the init to the shim, its child subreaper). `shim` is that parent's pid as the
/// spawner's pid namespace sees it (see [`parent_of_init`]): 0 when the container has a pid
/// namespace of its own (or shares its pod's), where every process outside it reads as 0; the
/// shim's host pid in a hostPID container, where the container's processes have host pids too.
/// A process of the container, even root, is never the init's parent, so it could otherwise
/// start processes behind the shim's back.
pub fn authorize_peer(pid: i32, uid: u32, shim: i32) -> Result<(), String> {
    if pid != shim {
        return Err(if shim == 0 {
            format!("connection refused: peer pid {pid} is inside the container (only the shim may use the spawner)")
        } else {
            format!(
                "connection refused: peer pid {pid} is not the shim (only pid {shim}, the parent of the container's \
                 init, may use the spawner)"
            )
        });
    }
    if uid != 0 {
        return Err(format!("connection refused: peer uid {uid} is not root"));
    }
    Ok(())
}

/// The parent of the container's init, which is the spawner's parent (crab-init forks the
/// spawner and then execs the entrypoint in place), as this pid namespace sees it: the pid
/// [`authorize_peer`] lets in. The init is pid 1 of a pid namespace of its own: its parent is
/// outside and reads as 0. Otherwise (hostPID) it is read from `/proc/<init>/stat`, and the init
/// must still be the spawner's parent afterwards, so the pid read was the live init's (a parent
/// changes only when the old one exits; a dead init's pid is never trusted).
pub fn parent_of_init(
    getppid: impl Fn() -> i32,
    read_stat: impl Fn(i32) -> std::io::Result<Vec<u8>>,
) -> Result<i32, String> {
    let init = getppid();
    if init == 1 {
        return Ok(0);
    }
    let stat = read_stat(init).map_err(|e| format!("connection refused: /proc/{init}/stat of the init: {e}"))?;
    let parent = crab_sys::proc_stat::parent(&stat)
        .and_then(|parent| i32::try_from(parent).ok())
        .ok_or_else(|| format!("connection refused: /proc/{init}/stat of the init is unreadable"))?;
    if getppid() != init {
        return Err("connection refused: the container's init exited".into());
    }
    Ok(parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<T: Serialize + DeserializeOwned>(message: &T) -> T {
        let frame = encode(message);
        let (payload, used) = split_frame(&frame).unwrap().unwrap();
        assert_eq!(used, frame.len());
        decode(payload).unwrap()
    }

    #[test]
    fn a_key_matches_only_its_own_hex() {
        let mut bytes = [0u8; KEY_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 37) as u8);
        let key = SpawnerKey::from_bytes(bytes);
        let hex = key.to_hex();
        assert_eq!(SpawnerKey::parse_hex(&hex), Some(key.clone()));
        assert!(key.matches(&hex));
        let mut other = bytes;
        other[KEY_BYTES - 1] ^= 1;
        assert!(!key.matches(&SpawnerKey::from_bytes(other).to_hex()), "last bit differs");
        for wrong in ["", &hex[2..], &format!("{hex}00"), &hex.to_uppercase(), &hex.replace(&hex[..1], "g")] {
            assert!(!key.matches(wrong), "{wrong:?}");
        }
        assert_eq!(format!("{key:?}"), "SpawnerKey(..)", "a key never reaches a log");
    }

    #[test]
    fn requests_and_messages_round_trip() {
        let spawn = Request::Spawn(SpawnRequest {
            exec_id: "e1".into(),
            args: vec!["sh".into(), "-c".into(), "echo hi".into()],
            env: vec!["PATH=/bin".into()],
            cwd: "/app".into(),
            uid: 1000,
            gid: 1000,
            additional_gids: vec![10],
            umask: Some(0o22),
            terminal: true,
            console_size: Some(ConsoleSize { height: 24, width: 80 }),
            stdin: true,
            stdout: true,
            stderr: false,
        });
        assert_eq!(roundtrip(&spawn), spawn);
        for request in [
            Request::Auth { key: "ab".repeat(KEY_BYTES) },
            Request::List,
            Request::Detach,
            Request::Attach { exec_id: "x".into() },
            Request::Release { exec_id: "x".into() },
        ] {
            assert_eq!(roundtrip(&request), request);
        }
        let session = Message::Session {
            session: SessionInfo {
                exec_id: "e1".into(),
                args: vec!["sh".into()],
                pid: 7,
                terminal: false,
                exited: false,
            },
            fds: vec![FdRole::Stdin, FdRole::Stdout, FdRole::Pidfd],
        };
        assert_eq!(roundtrip(&session), session);
        assert_eq!(session.fds().len(), 3);
        let exit = Message::Exit { exec_id: "e1".into(), wait_status: 256 };
        assert!(roundtrip(&exit).is_event());
    }

    #[test]
    fn wire_format_is_length_prefixed_versioned_json() {
        let frame = encode(&Request::List);
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4);
        let value: serde_json::Value = serde_json::from_slice(&frame[4..]).unwrap();
        assert_eq!(value["op"], "list");
        assert_eq!(value["v"], VERSION);
    }

    #[test]
    fn incomplete_frames_wait_for_more_bytes() {
        let frame = encode(&Request::Detach);
        assert_eq!(split_frame(&frame[..2]).unwrap(), None);
        assert_eq!(split_frame(&frame[..frame.len() - 1]).unwrap(), None);
        let mut two = frame.clone();
        two.extend_from_slice(&frame);
        let (_, used) = split_frame(&two).unwrap().unwrap();
        assert_eq!(used, frame.len());
    }

    #[test]
    fn oversized_length_is_refused_with_its_size() {
        let mut frame = ((MAX_FRAME_BYTES + 1) as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(b"{}");
        let err = split_frame(&frame).unwrap_err();
        assert_eq!(err, FrameError::TooLarge { len: MAX_FRAME_BYTES + 1, max: MAX_FRAME_BYTES });
        assert!(err.to_string().contains(&(MAX_FRAME_BYTES + 1).to_string()), "{err}");
    }

    #[test]
    fn bad_payloads_name_what_is_wrong() {
        let err = decode::<Request>(b"not json").unwrap_err();
        assert!(matches!(err, FrameError::Json { .. }), "{err}");
        let err = decode::<Request>(br#"{"op":"list"}"#).unwrap_err();
        assert_eq!(err, FrameError::NoVersion);
        assert!(err.to_string().contains("\"v\""), "{err}");
        let err = decode::<Request>(br#"{"v":99,"op":"list"}"#).unwrap_err();
        assert_eq!(err, FrameError::Version { got: 99, expected: VERSION });
        let err = decode::<Request>(br#"{"v":1,"op":"format-disk"}"#).unwrap_err();
        assert!(err.to_string().contains("format-disk"), "{err}");
        let err = decode::<Request>(br#"{"v":1,"op":"spawn","exec_id":"e"}"#).unwrap_err();
        assert!(err.to_string().contains("args"), "{err}");
    }

    #[test]
    fn only_root_outside_the_container_is_authorized() {
        assert!(authorize_peer(0, 0, 0).is_ok());
        let err = authorize_peer(12, 0, 0).unwrap_err();
        assert!(err.contains("pid 12") && err.contains("inside the container"), "{err}");
        assert!(authorize_peer(0, 1000, 0).unwrap_err().contains("uid 1000"));
    }

    /// hostPID: the container's processes have host pids; only the init's parent (the shim) is let
    /// in, never a process of the container or one of another container (which reads as 0 too
    /// only where the container has a pid namespace of its own).
    #[test]
    fn with_the_host_pid_namespace_only_the_parent_of_the_init_is_authorized() {
        assert!(authorize_peer(4000, 0, 4000).is_ok());
        let err = authorize_peer(4321, 0, 4000).unwrap_err();
        assert!(err.contains("pid 4321") && err.contains("not the shim") && err.contains("4000"), "{err}");
        assert!(authorize_peer(0, 0, 4000).is_err(), "a peer outside the host's pid namespace");
        assert!(authorize_peer(4000, 1000, 4000).unwrap_err().contains("uid 1000"));
    }

    #[test]
    fn the_parent_of_the_init_is_read_while_the_init_lives() {
        use std::cell::Cell;
        let stat = |_: i32| Ok(b"77 (sh) S 4000 77 77 0 -1".to_vec());
        assert_eq!(parent_of_init(|| 1, |_| panic!("pid 1's parent is outside: nothing to read")), Ok(0));
        assert_eq!(parent_of_init(|| 77, stat), Ok(4000));
        let odd = |_: i32| Ok(b"77 (a) b (c) S 4000 77".to_vec());
        assert_eq!(parent_of_init(|| 77, odd), Ok(4000), "a command with spaces and parentheses");
        // The init is the container's entrypoint, named as the tenant likes.
        let not_utf8 = |_: i32| Ok(b"77 (\xff\xfe) S 4000 77".to_vec());
        assert_eq!(parent_of_init(|| 77, not_utf8), Ok(4000), "a command that is not UTF-8");
        // The init exits while its stat is read: the spawner is reparented.
        let calls = Cell::new(0);
        let reparented = || {
            calls.set(calls.get() + 1);
            if calls.get() == 1 { 77 } else { 4000 }
        };
        assert!(parent_of_init(reparented, stat).unwrap_err().contains("exited"));
        assert!(
            parent_of_init(|| 77, |_| Err(std::io::Error::other("no /proc"))).unwrap_err().contains("/proc/77/stat")
        );
        assert!(parent_of_init(|| 77, |_| Ok(b"garbage".to_vec())).is_err());
    }
}
