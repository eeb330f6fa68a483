//! Turns: what a sandbox asks of crab (annotations), and the record of each
//! turn (its class, why, and which checkpoint holds its state).

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub const ANNOTATION_TURNS: &str = "io.crab.turns";
pub const ANNOTATION_POLICY: &str = "io.crab.policy";
pub const ANNOTATION_IGNORE: &str = "io.crab.ignore";
/// `[<namespace>/]<container>[@<generation>]:<turn>`: create this container from a checkpoint
/// (fork, recover). Without a namespace: a chain of the new container's own containerd namespace;
/// another namespace's only where crab.toml's `[checkpoint] restore_from_namespaces` allows it.
pub const ANNOTATION_RESTORE_FROM: &str = "io.crab.restore-from";
/// The sandbox's checkpoint quota, MiB its chain may reference in the store (0: no bound).
/// It may lower crab.toml's `[checkpoint] max_sandbox_mib`; raise it only where the operator
/// set `allow_sandbox_quota_raise` (a tenant sets its own annotations).
pub const ANNOTATION_MAX_SANDBOX_MIB: &str = "io.crab.max-sandbox-mib";
/// crab.toml's default `[checkpoint] max_sandbox_mib`: 10 GiB.
pub const DEFAULT_MAX_SANDBOX_MIB: u64 = 10 << 10;
/// The largest quota in MiB whose byte count fits in a u64.
pub const MAX_SANDBOX_MIB_LIMIT: u64 = u64::MAX >> 20;
/// `auto` | `off`: whether a container that replaces a dead one of the same pod sandbox and
/// container name (kubelet's restart, attempt + 1) starts from the dead one's latest checkpoint.
/// Default: `auto` under the `crab` policy, `off` under the others (`every-turn` keeps its
/// checkpoints for the baseline's own recovery; `off` has none).
pub const ANNOTATION_RESTORE: &str = "io.crab.restore";
/// On a Task Update: a request about turns (`mark`: end the current turn, begin the next).
pub const ANNOTATION_TURN: &str = "io.crab.turn";

/// What a Task Update's `io.crab.turn` annotation asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnRequest {
    Mark,
}

impl TurnRequest {
    pub fn parse(value: &str) -> Result<Self, AnnotationError> {
        match value {
            "mark" => Ok(TurnRequest::Mark),
            _ => Err(choice(ANNOTATION_TURN, value, "mark")),
        }
    }
}

/// What bounded a turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TurnSource {
    /// An exec's lifecycle: from its start until it exited (or, for a
    /// session, until it first waited for input).
    #[default]
    Exec,
    /// A burst of bytes to a session's stdin, until the session waited for input again.
    Stdin,
    /// An explicit mark ended it.
    Mark,
}

impl std::fmt::Display for TurnSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            TurnSource::Exec => "exec",
            TurnSource::Stdin => "stdin",
            TurnSource::Mark => "mark",
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AnnotationError {
    #[error("annotation {key}={value:?}: expected one of {expected}")]
    Choice { key: &'static str, value: String, expected: &'static str },
    #[error("annotation {key}={value:?}: {message}")]
    Invalid { key: &'static str, value: String, message: String },
}

/// How turn boundaries are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TurnsMode {
    /// exec lifecycles, plus stdin bursts of long-lived shells.
    Auto,
    /// Each exec is a turn.
    Exec,
    /// A stdin burst to a long-lived shell is a turn.
    Stdin,
    /// Only explicit marks.
    Explicit,
}

/// What is checkpointed per turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Per-turn granularity from the inspector's classification.
    Crab,
    /// Baseline: a full CRIU checkpoint plus the whole rootfs diff after every turn.
    EveryTurn,
    /// No checkpoints.
    Off,
}

/// What `io.crab.restore` asks for a kubelet replacement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestoreMode {
    /// Restore the dead predecessor's latest checkpoint into the replacement.
    Auto,
    /// The replacement starts from its image, as under runc.
    Off,
}

/// A checkpoint to start a container from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreFrom {
    /// The containerd namespace the annotation names; None: the new container's own.
    pub namespace: Option<String>,
    /// `<id>`, or `<id>@<generation>` for a retired chain.
    pub container: String,
    pub turn: u64,
}

impl RestoreFrom {
    /// The chain this names, for a container created in `own_namespace`.
    pub fn key(&self, own_namespace: &str) -> Result<crate::SandboxKey, crate::KeyError> {
        crate::SandboxKey::from_name(self.namespace.as_deref().unwrap_or(own_namespace), &self.container)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxPolicy {
    pub turns: TurnsMode,
    pub policy: Policy,
    pub ignore: Vec<PathBuf>,
    pub restore_from: Option<RestoreFrom>,
    /// `io.crab.restore`; None: the policy's default (see [`SandboxPolicy::restores_replacement`]).
    pub restore: Option<RestoreMode>,
    /// MiB the sandbox's chain may reference in the store (0: no bound).
    pub max_sandbox_mib: u64,
    /// The operator's (crab.toml), never an annotation's: whether [`ANNOTATION_MAX_SANDBOX_MIB`]
    /// may raise `max_sandbox_mib` above the default given to [`Self::from_annotations`].
    pub allow_quota_raise: bool,
}

impl Default for SandboxPolicy {
    fn default() -> Self {
        Self {
            turns: TurnsMode::Auto,
            policy: Policy::Crab,
            ignore: Vec::new(),
            restore_from: None,
            restore: None,
            max_sandbox_mib: DEFAULT_MAX_SANDBOX_MIB,
            allow_quota_raise: false,
        }
    }
}

impl SandboxPolicy {
    /// Reads the `io.crab.*` annotations; absent ones take `defaults`' values.
    pub fn from_annotations(
        annotations: &HashMap<String, String>,
        defaults: &SandboxPolicy,
    ) -> Result<Self, AnnotationError> {
        let mut p = defaults.clone();
        if let Some(v) = annotations.get(ANNOTATION_TURNS) {
            p.turns = match v.as_str() {
                "auto" => TurnsMode::Auto,
                "exec" => TurnsMode::Exec,
                "stdin" => TurnsMode::Stdin,
                "explicit" => TurnsMode::Explicit,
                _ => return Err(choice(ANNOTATION_TURNS, v, "auto, exec, stdin, explicit")),
            };
        }
        if let Some(v) = annotations.get(ANNOTATION_POLICY) {
            p.policy = parse_policy(v).ok_or_else(|| choice(ANNOTATION_POLICY, v, "crab, every-turn, off"))?;
        }
        if let Some(v) = annotations.get(ANNOTATION_IGNORE) {
            p.ignore = v
                .split([',', ':'])
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    let path = Path::new(s);
                    if !path.is_absolute() || path.components().any(|c| c == std::path::Component::ParentDir) {
                        Err(AnnotationError::Invalid {
                            key: ANNOTATION_IGNORE,
                            value: v.clone(),
                            message: format!("{s:?} is not an absolute path without `..`"),
                        })
                    } else {
                        Ok(path.to_path_buf())
                    }
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = annotations.get(ANNOTATION_RESTORE_FROM) {
            p.restore_from = Some(parse_restore_from(v)?);
        }
        if let Some(v) = annotations.get(ANNOTATION_MAX_SANDBOX_MIB) {
            p.max_sandbox_mib = parse_max_sandbox_mib(v, defaults)?;
        }
        if let Some(v) = annotations.get(ANNOTATION_RESTORE) {
            p.restore = Some(match v.as_str() {
                "auto" => RestoreMode::Auto,
                "off" => RestoreMode::Off,
                _ => return Err(choice(ANNOTATION_RESTORE, v, "auto, off")),
            });
            if p.restore == Some(RestoreMode::Auto) && p.policy == Policy::Off {
                // Nothing would ever be there to restore: say so rather than pretend.
                return Err(AnnotationError::Invalid {
                    key: ANNOTATION_RESTORE,
                    value: v.clone(),
                    message: format!(
                        "a replacement can only be restored from checkpoints, and {ANNOTATION_POLICY} is off"
                    ),
                });
            }
        }
        Ok(p)
    }

    /// Whether a kubelet replacement of this sandbox's container starts from its predecessor's
    /// latest checkpoint: `io.crab.restore`, else `auto` under the `crab` policy only.
    pub fn restores_replacement(&self) -> bool {
        match self.restore {
            Some(RestoreMode::Auto) => self.policy != Policy::Off,
            Some(RestoreMode::Off) => false,
            None => self.policy == Policy::Crab,
        }
    }

    /// The quota in bytes for the store (None: no bound).
    pub fn quota_bytes(&self) -> Option<u64> {
        (self.max_sandbox_mib != 0).then(|| self.max_sandbox_mib.saturating_mul(1 << 20))
    }
}

/// `io.crab.max-sandbox-mib`: a whole number of MiB, 0 for no bound. Lower than (or equal to)
/// the operator's default always; higher (0 is the highest) only where the operator allows it.
fn parse_max_sandbox_mib(v: &str, defaults: &SandboxPolicy) -> Result<u64, AnnotationError> {
    let invalid =
        |message: String| AnnotationError::Invalid { key: ANNOTATION_MAX_SANDBOX_MIB, value: v.into(), message };
    // Digits only: no sign, no spaces, no unit (u64's parser takes a leading '+').
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("expected a whole number of MiB (0: no bound)".into()));
    }
    let mib: u64 = v
        .parse()
        .ok()
        .filter(|mib| *mib <= MAX_SANDBOX_MIB_LIMIT)
        .ok_or_else(|| invalid(format!("at most {MAX_SANDBOX_MIB_LIMIT} MiB")))?;
    let unbounded = |mib: u64| if mib == 0 { u64::MAX } else { mib };
    let default = defaults.max_sandbox_mib;
    if unbounded(mib) > unbounded(default) && !defaults.allow_quota_raise {
        let default = if default == 0 { "no bound".to_string() } else { format!("{default} MiB") };
        return Err(invalid(format!(
            "raises the operator's quota ({default}); an annotation may only lower it unless crab.toml sets \
             [checkpoint] allow_sandbox_quota_raise = true"
        )));
    }
    Ok(mib)
}

pub fn parse_policy(v: &str) -> Option<Policy> {
    match v {
        "crab" => Some(Policy::Crab),
        "every-turn" => Some(Policy::EveryTurn),
        "off" => Some(Policy::Off),
        _ => None,
    }
}

fn choice(key: &'static str, value: &str, expected: &'static str) -> AnnotationError {
    AnnotationError::Choice { key, value: value.into(), expected }
}

fn parse_restore_from(v: &str) -> Result<RestoreFrom, AnnotationError> {
    let invalid = |message: &str| AnnotationError::Invalid {
        key: ANNOTATION_RESTORE_FROM,
        value: v.into(),
        message: message.into(),
    };
    let (source, turn) = v.rsplit_once(':').ok_or_else(|| invalid("expected [<namespace>/]<container>:<turn>"))?;
    if source.is_empty() {
        return Err(invalid("empty container id"));
    }
    let turn = turn.parse().map_err(|_| invalid("turn is not a number"))?;
    let (namespace, container) = match source.split_once('/') {
        Some((namespace, container)) => (Some(namespace.to_string()), container.to_string()),
        None => (None, source.to_string()),
    };
    let parsed = RestoreFrom { namespace, container, turn };
    // Checked against any namespace: the parts are validated here, the namespace at Create.
    parsed.key(crate::DEFAULT_NAMESPACE).map_err(|e| invalid(&e.to_string()))?;
    Ok(parsed)
}

/// The class of a turn as recorded (mirrors the inspector's, plus unknown for
/// turns the inspector did not see).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecordedClass {
    Clean,
    Fs,
    Proc,
}

/// One turn of one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub turn: u64,
    /// The exec that made the turn, or the session whose stdin did.
    pub exec_id: Option<String>,
    /// Records from before turn sources existed are exec turns.
    #[serde(default)]
    pub source: TurnSource,
    pub started_unix_ms: u64,
    pub ended_unix_ms: u64,
    pub class: RecordedClass,
    pub external: bool,
    /// The class was raised because the inspector could not see everything.
    pub escalated: bool,
    pub reasons: Vec<String>,
    /// The checkpoint turn that holds this turn's state (this turn, or an
    /// earlier one for a clean turn); None when nothing is checkpointed.
    pub checkpoint_turn: Option<u64>,
    /// The turn whose process checkpoint replaced this turn's before it was
    /// written (it holds this turn's changes): no checkpoint holds this
    /// turn's own state, so it cannot be rolled back to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded_by: Option<u64>,
    /// New bytes the checkpoint wrote (the checkpoint traffic).
    pub bytes_written: u64,
    /// Time the container was held for capture (frozen for a CRIU dump).
    pub capture_ms: f64,
    /// The part of `capture_ms` that the process dump took (the OCI runtime's checkpoint,
    /// every attempt); the rest is staging into the store. None when the turn took no dump.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_ms: Option<f64>,
    /// Time from the turn's end until its checkpoint was durable.
    pub checkpoint_ms: f64,
    pub policy: Policy,
    /// Why each failed attempt at this turn's process dump failed, in order (a dump is
    /// tried a bounded number of times; all of them failed when the checkpoint did).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dump_failures: Vec<String>,
    /// The checkpoint was refused: it would have taken the sandbox's chain over its quota
    /// (`checkpoint_turn` is then the sandbox's last recoverable turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over_quota: Option<crate::OverQuota>,
    /// Execs of this turn that crab-init's spawner did not start: the OCI runtime's `exec` ran
    /// them, outside the container's process tree, so no checkpoint holds their processes (an
    /// exec still running when the turn ended, a session above all, is not restorable; a restore
    /// of this turn brings back what they wrote, not them). Listed in every turn they ran in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runtime_execs: Vec<RuntimeExec>,
    /// The shell sessions crab asked for their state at this turn's end.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shells: Vec<ShellAsked>,
    /// The pid the container's next process gets after this turn, when the turn forked
    /// (see [`crate::Manifest::next_pid`]). Kept for clean turns too, which write no
    /// manifest: a recovery of their checkpoint sets the cursor past their forks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_pid: Option<u32>,
}

/// One shell session asked for its state at a turn's end (see crab-engine's `shell` module).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShellAsked {
    pub exec_id: String,
    /// From writing the question to the whole answer read.
    pub ms: f64,
    /// The answer's size on stdout.
    pub answer_bytes: u64,
    /// Listed in this turn's checkpoint (it changed, or the turn dumped the shell).
    pub listed: bool,
    /// Why the answer cannot stand for the session (None: it can).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unvouched: Option<String>,
}

/// An exec the OCI runtime started instead of crab-init's spawner, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeExec {
    pub exec_id: String,
    /// Why the spawner was not used (no crab-init in the container, the exec's identity differs
    /// from the init's, the spawner did not answer or refused the shim).
    pub reason: String,
    /// It was still running when the turn ended: no checkpoint holds its processes. One that
    /// ended within the turn left only its effects, which the turn's checkpoint has.
    #[serde(default)]
    pub running: bool,
}

impl std::fmt::Display for RuntimeExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.running {
            write!(
                f,
                "exec {} runs through the runtime ({}), outside the container's process tree: no checkpoint holds \
                 its processes, a restore of this turn does not bring them back (an exec session is not restorable)",
                self.exec_id, self.reason
            )
        } else {
            write!(
                f,
                "exec {} ran through the runtime ({}) and ended within the turn: its changes are checkpointed, \
                 its processes would not have been",
                self.exec_id, self.reason
            )
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TurnLogError {
    #[error("turn log {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("turn log {path} line {line}: {message}")]
    Corrupt { path: PathBuf, line: usize, message: String },
    #[error("no turn log for {container:?}: {source}")]
    BadKey { container: String, source: crate::KeyError },
}

/// Append-only JSON-lines log of a container's turns, under the state dir:
/// `turns/<namespace>/<id>.jsonl` (see [`crate::SandboxKey`]).
pub struct TurnLog {
    path: PathBuf,
}

impl TurnLog {
    /// The log of sandbox key `container` (`[<namespace>/]<id>[@<generation>]`).
    pub fn path_for(state_dir: &Path, container: &str) -> Result<PathBuf, TurnLogError> {
        let key = crate::SandboxKey::parse(container)
            .map_err(|source| TurnLogError::BadKey { container: container.into(), source })?;
        Ok(crate::turn_log_path(state_dir, &key))
    }

    pub fn open(state_dir: &Path, container: &str) -> Result<Self, TurnLogError> {
        Ok(Self { path: Self::path_for(state_dir, container)? })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record durably (a torn last line from a crash is skipped on read).
    pub fn append(&self, record: &TurnRecord) -> Result<(), TurnLogError> {
        let io = |source| TurnLogError::Io { path: self.path.clone(), source };
        if let Some(dir) = self.path.parent() {
            private_dir_all(dir).map_err(io)?;
        }
        let mut line = serde_json::to_vec(record).expect("turn records serialise");
        line.push(b'\n');
        // What agents ran and what it did: root's alone, as the store is.
        let mut f = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(&self.path).map_err(io)?;
        f.write_all(&line).map_err(io)?;
        f.sync_data().map_err(io)
    }

    fn busy_path(&self) -> PathBuf {
        self.path.with_extension("busy")
    }

    /// Marks the sandbox as having a turn in flight (open, or its checkpoint
    /// not yet written), so that a rollback or fork waits for it.
    pub fn mark_busy(&self, busy: bool) {
        let path = self.busy_path();
        let result = if busy {
            self.path.parent().map(private_dir_all).transpose().and_then(|_| std::fs::write(&path, b""))
        } else {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        };
        if let Err(e) = result {
            tracing::warn!(path = %path.display(), error = %e, "turn-in-flight mark not updated");
        }
    }

    /// Whether a turn is in flight (see [`TurnLog::mark_busy`]).
    pub fn is_busy(&self) -> bool {
        self.busy_path().exists()
    }

    /// Forgets every record (a new container reusing the id).
    pub fn reset(&self) -> Result<(), TurnLogError> {
        self.mark_busy(false);
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(TurnLogError::Io { path: self.path.clone(), source }),
        }
    }

    /// All records; a missing log is empty.
    pub fn read(&self) -> Result<Vec<TurnRecord>, TurnLogError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(TurnLogError::Io { path: self.path.clone(), source }),
        };
        let complete = if text.ends_with('\n') { text.as_str() } else { text.rsplit_once('\n').map_or("", |(a, _)| a) };
        complete
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|e| TurnLogError::Corrupt {
                    path: self.path.clone(),
                    line: i + 1,
                    message: e.to_string(),
                })
            })
            .collect()
    }
}

/// The pid cursor the newest of the turns that checkpoint `checkpoint` stands for (the clean
/// turns after it, which wrote no manifest) left, when one of them forked (see
/// [`TurnRecord::next_pid`]).
pub fn next_pid_after_clean_turns(records: &[TurnRecord], checkpoint: u64) -> Option<u32> {
    records
        .iter()
        .filter(|r| r.turn > checkpoint && r.checkpoint_turn == Some(checkpoint) && r.class == RecordedClass::Clean)
        .filter_map(|r| Some((r.turn, r.next_pid?)))
        .max_by_key(|(turn, _)| *turn)
        .map(|(_, next)| next)
}

pub fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// `mkdir -p` of directories root's alone (0700): turn logs live in crab's store.
fn private_dir_all(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn restore_annotation_defaults_to_auto_under_crab_only() {
        let defaults = SandboxPolicy::default();
        assert!(SandboxPolicy::from_annotations(&ann(&[]), &defaults).unwrap().restores_replacement());
        let every = SandboxPolicy::from_annotations(&ann(&[("io.crab.policy", "every-turn")]), &defaults).unwrap();
        assert!(!every.restores_replacement());
        let off = SandboxPolicy::from_annotations(&ann(&[("io.crab.restore", "off")]), &defaults).unwrap();
        assert_eq!(off.restore, Some(RestoreMode::Off));
        assert!(!off.restores_replacement());
        let asked = SandboxPolicy::from_annotations(
            &ann(&[("io.crab.policy", "every-turn"), ("io.crab.restore", "auto")]),
            &defaults,
        )
        .unwrap();
        assert!(asked.restores_replacement());
    }

    #[test]
    fn restore_annotation_errors_name_the_annotation() {
        let defaults = SandboxPolicy::default();
        let err = SandboxPolicy::from_annotations(&ann(&[("io.crab.restore", "yes")]), &defaults).unwrap_err();
        assert_eq!(err.to_string(), r#"annotation io.crab.restore="yes": expected one of auto, off"#);
        let err =
            SandboxPolicy::from_annotations(&ann(&[("io.crab.policy", "off"), ("io.crab.restore", "auto")]), &defaults)
                .unwrap_err();
        assert!(
            err.to_string().contains("io.crab.restore") && err.to_string().contains("io.crab.policy is off"),
            "{err}"
        );
    }

    #[test]
    fn annotations_parse_and_default() {
        let d = SandboxPolicy::default();
        assert_eq!(SandboxPolicy::from_annotations(&ann(&[]), &d).unwrap(), d);
        let p = SandboxPolicy::from_annotations(
            &ann(&[
                (ANNOTATION_TURNS, "exec"),
                (ANNOTATION_POLICY, "every-turn"),
                (ANNOTATION_IGNORE, "/root/.cache, /tmp/pip"),
                (ANNOTATION_RESTORE_FROM, "sandbox-1:7"),
            ]),
            &d,
        )
        .unwrap();
        assert_eq!(p.turns, TurnsMode::Exec);
        assert_eq!(p.policy, Policy::EveryTurn);
        assert_eq!(p.ignore, vec![PathBuf::from("/root/.cache"), PathBuf::from("/tmp/pip")]);
        assert_eq!(p.restore_from, Some(RestoreFrom { namespace: None, container: "sandbox-1".into(), turn: 7 }));
        let other =
            SandboxPolicy::from_annotations(&ann(&[(ANNOTATION_RESTORE_FROM, "tenant-b/sandbox-1@2:3")]), &d).unwrap();
        let source = other.restore_from.unwrap();
        assert_eq!(source.key("tenant-a").unwrap().to_string(), "tenant-b/sandbox-1@2");
        let own = SandboxPolicy::from_annotations(&ann(&[(ANNOTATION_RESTORE_FROM, "sandbox-1:3")]), &d).unwrap();
        assert_eq!(own.restore_from.unwrap().key("tenant-a").unwrap().to_string(), "tenant-a/sandbox-1");
    }

    #[test]
    fn bad_annotations_name_key_and_value() {
        let d = SandboxPolicy::default();
        for (k, v) in [
            (ANNOTATION_TURNS, "sometimes"),
            (ANNOTATION_POLICY, "always"),
            (ANNOTATION_IGNORE, "relative/path"),
            (ANNOTATION_IGNORE, "/a/../etc"),
            (ANNOTATION_RESTORE_FROM, "no-turn"),
            (ANNOTATION_RESTORE_FROM, "c:x"),
            (ANNOTATION_RESTORE_FROM, "../c:1"),
            (ANNOTATION_RESTORE_FROM, "a/b/c:1"),
            (ANNOTATION_RESTORE_FROM, "ns/..:1"),
            (ANNOTATION_RESTORE_FROM, "c@0:1"),
        ] {
            let err = SandboxPolicy::from_annotations(&ann(&[(k, v)]), &d).unwrap_err().to_string();
            assert!(err.contains(k) && err.contains(v), "{err}");
        }
    }

    #[test]
    fn a_recovery_takes_the_pid_cursor_of_the_newest_clean_turn_that_forked() {
        let rec = |turn: u64, class: RecordedClass, checkpoint: u64, next_pid: Option<u32>| TurnRecord {
            turn,
            exec_id: None,
            source: TurnSource::Stdin,
            started_unix_ms: 0,
            ended_unix_ms: 0,
            class,
            external: false,
            escalated: false,
            reasons: Vec::new(),
            checkpoint_turn: Some(checkpoint),
            superseded_by: None,
            bytes_written: 0,
            capture_ms: 0.0,
            dump_ms: None,
            checkpoint_ms: 0.0,
            policy: Policy::Crab,
            dump_failures: Vec::new(),
            over_quota: None,
            runtime_execs: Vec::new(),
            shells: Vec::new(),
            next_pid,
        };
        use RecordedClass::{Clean, Fs};
        let records = [
            rec(3, Fs, 3, Some(30)),
            rec(4, Clean, 3, Some(41)),
            rec(5, Clean, 3, Some(52)),
            // Forked nothing: turn 5's cursor stands.
            rec(6, Clean, 3, None),
            rec(7, Fs, 7, Some(70)),
            rec(8, Clean, 7, Some(81)),
        ];
        assert_eq!(next_pid_after_clean_turns(&records, 3), Some(52));
        assert_eq!(next_pid_after_clean_turns(&records, 7), Some(81));
        // The checkpoint's own turn is in its manifest, not here; no clean turn after 8.
        assert_eq!(next_pid_after_clean_turns(&records, 8), None);
        assert_eq!(next_pid_after_clean_turns(&records[..1], 3), None);
    }

    #[test]
    fn turn_log_round_trips_and_skips_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let log = TurnLog::open(dir.path(), "c1").unwrap();
        assert!(log.read().unwrap().is_empty());
        let rec = TurnRecord {
            turn: 1,
            exec_id: Some("e1".into()),
            source: TurnSource::Stdin,
            started_unix_ms: 1,
            ended_unix_ms: 2,
            class: RecordedClass::Fs,
            external: false,
            escalated: false,
            reasons: vec!["write /app/x".into()],
            checkpoint_turn: Some(1),
            superseded_by: None,
            bytes_written: 10,
            capture_ms: 0.5,
            dump_ms: Some(0.25),
            checkpoint_ms: 1.0,
            policy: Policy::Crab,
            dump_failures: Vec::new(),
            over_quota: Some(crate::OverQuota { used_bytes: 3 << 20, quota_bytes: 1 << 20, held_bytes: 1 << 19 }),
            runtime_execs: vec![RuntimeExec { exec_id: "e1".into(), reason: "no crab-init".into(), running: true }],
            shells: vec![ShellAsked {
                exec_id: "e1".into(),
                ms: 1.5,
                answer_bytes: 2048,
                listed: true,
                unvouched: Some("it knows jobs".into()),
            }],
            next_pid: Some(54),
        };
        log.append(&rec).unwrap();
        log.append(&TurnRecord { turn: 2, ..rec.clone() }).unwrap();
        let mut f = std::fs::OpenOptions::new().append(true).open(log.path()).unwrap();
        f.write_all(b"{\"turn\":3,").unwrap();
        let got = log.read().unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].turn, 2);
        assert_eq!(got[1].over_quota, rec.over_quota);
        assert_eq!(got[1].source, TurnSource::Stdin);
        assert_eq!(got[1].runtime_execs, rec.runtime_execs);
        assert_eq!(got[1].dump_ms, Some(0.25));
    }

    #[test]
    fn records_without_a_source_are_exec_turns() {
        let line = r#"{"turn":1,"exec_id":"e","started_unix_ms":1,"ended_unix_ms":2,"class":"clean","external":false,
            "escalated":false,"reasons":[],"checkpoint_turn":null,"bytes_written":0,"capture_ms":0.0,"checkpoint_ms":0.0,"policy":"crab"}"#;
        let rec: TurnRecord = serde_json::from_str(line).unwrap();
        assert_eq!(rec.source, TurnSource::Exec);
        assert_eq!(rec.over_quota, None, "records from before quotas were within theirs");
        assert!(
            !serde_json::to_string(&rec).unwrap().contains("over_quota"),
            "nothing new in a record within its quota"
        );
        assert_eq!(rec.dump_ms, None, "records from before dump times were recorded have none");
        assert!(!serde_json::to_string(&rec).unwrap().contains("dump_ms"), "nothing new in a turn without a dump");
        assert!(rec.runtime_execs.is_empty(), "records from before runtime execs were recorded list none");
        assert!(
            !serde_json::to_string(&rec).unwrap().contains("runtime_execs"),
            "nothing new in a record whose execs all went through the spawner"
        );
    }

    #[test]
    fn the_quota_annotation_lowers_always_and_raises_only_where_allowed() {
        let mib = |v: &str, default: u64, allow: bool| {
            let defaults = SandboxPolicy { max_sandbox_mib: default, allow_quota_raise: allow, ..Default::default() };
            SandboxPolicy::from_annotations(&ann(&[(ANNOTATION_MAX_SANDBOX_MIB, v)]), &defaults)
                .map(|p| p.max_sandbox_mib)
                .map_err(|e| e.to_string())
        };
        assert_eq!(SandboxPolicy::default().max_sandbox_mib, 10240);
        assert_eq!(SandboxPolicy::default().quota_bytes(), Some(10 << 30));
        assert_eq!(mib("1", 10240, false), Ok(1));
        assert_eq!(mib("10240", 10240, false), Ok(10240));
        assert_eq!(mib("5", 0, false), Ok(5), "any bound is lower than none");
        assert_eq!(mib("0", 0, false), Ok(0));
        assert_eq!(mib("20000", 10240, true), Ok(20000));
        assert_eq!(mib("0", 10240, true), Ok(0));
        for (v, default) in [("10241", 10240), ("0", 10240), ("2", 1)] {
            let err = mib(v, default, false).unwrap_err();
            assert!(
                err.contains(ANNOTATION_MAX_SANDBOX_MIB)
                    && err.contains("allow_sandbox_quota_raise")
                    && err.contains(v),
                "{err}"
            );
        }
        for v in ["", "-1", "+5", " 5", "5M", "1.5", "17592186044416", "99999999999999999999999"] {
            let err = mib(v, 0, true).unwrap_err();
            assert!(err.contains(ANNOTATION_MAX_SANDBOX_MIB), "{v:?}: {err}");
        }
        let p = SandboxPolicy { max_sandbox_mib: 0, ..Default::default() };
        assert_eq!(p.quota_bytes(), None);
    }

    #[test]
    fn turn_requests_parse_and_name_bad_values() {
        assert_eq!(TurnRequest::parse("mark").unwrap(), TurnRequest::Mark);
        let err = TurnRequest::parse("rollback").unwrap_err().to_string();
        assert!(err.contains(ANNOTATION_TURN) && err.contains("rollback") && err.contains("mark"), "{err}");
    }

    #[test]
    fn turn_log_ids_cannot_escape() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["../x", "a/b/c", "", "..", "ns/..", "../..", "ns/.x", "a b/c"] {
            assert!(TurnLog::open(dir.path(), bad).is_err(), "{bad}");
        }
        let log = TurnLog::open(dir.path(), "tenant-b/t2").unwrap();
        assert_eq!(log.path(), dir.path().join("turns/tenant-b/t2.jsonl"));
        assert_ne!(log.path(), TurnLog::open(dir.path(), "tenant-a/t2").unwrap().path());
    }
}
