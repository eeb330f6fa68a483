//! The persistent push queue: checkpoints waiting to leave the node survive shim and crabd
//! restarts and crashes.
//!
//! **Journal.** One small file per queued push, `<dir>/<namespace>@<sandbox>@<turn>.json`
//! (namespace and sandbox as repository path components, which never contain `@`), written
//! tmp → fsync → rename → fsync dir once the turn's checkpoint is durable in the local store,
//! and removed (rename-free unlink + fsync dir) only after the registry accepted the turn's
//! manifest. The entry holds no data: the objects and the turn manifest stay in the local
//! store, which keeps them (GC must count queued turns as live) until the push completes.
//!
//! **Idempotent steps.** A push is: pack the objects the [`RemoteIndex`] does not know
//! (deterministic: the same objects in the same order give the same packs), upload each blob the
//! repository lacks (HEAD first), record the new packs in the index, PUT the manifest, remove
//! the entry. A process killed at any point leaves either the entry (and the push runs again:
//! blobs already uploaded are found by HEAD and not sent again; the registry never saw the
//! manifest, so no tag names a missing blob) or no entry (the manifest was accepted). A
//! manifest PUT that succeeded just before the crash is PUT again: same bytes, same digest.
//!
//! **Failures.** A transient failure (registry down, slow, 5xx) leaves the entry with its
//! attempt count, last error and a time before which it is not tried again (exponential, up to
//! [`MAX_BACKOFF`]); a refusal (credentials, 413) the same, with the error kept for
//! `crabctl node` / `crabctl turns` to show. Nothing is dropped: only a completed push removes
//! an entry.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::artifact::path_component;
use crate::error::{RemoteError, Result};
use crate::remote::{ObjectSource, PushReport, Remote, RemoteIndex, TurnPush, write_atomic};

/// Longest pause between two tries of one entry.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedPush {
    pub namespace: String,
    pub sandbox: String,
    pub turn: u64,
    pub enqueued_unix_ms: u64,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub not_before_unix_ms: u64,
}

impl QueuedPush {
    fn file_name(&self) -> String {
        format!("{}@{}@{:020}.json", path_component(&self.namespace), path_component(&self.sandbox), self.turn)
    }
}

/// What one pass over the queue did.
#[derive(Debug, Default)]
pub struct QueueRun {
    pub pushed: Vec<PushReport>,
    /// Entries that failed this time, with the error (they stay queued).
    pub failed: Vec<(QueuedPush, String)>,
    /// Entries not due yet.
    pub waiting: usize,
}

pub struct PushQueue {
    dir: PathBuf,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl PushQueue {
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| RemoteError::Io {
            path: dir.to_owned(),
            what: "create",
            source,
        })?;
        Ok(PushQueue { dir: dir.to_owned() })
    }

    /// Takes the per-sandbox push lock without waiting (None: another process, a shim's
    /// pusher or a `crabctl push`/`migrate`, holds it). One pusher per sandbox at a time keeps
    /// two from packing and uploading the same turns at once; the lock goes with the handle.
    pub fn try_lock(&self, namespace: &str, sandbox: &str) -> Result<Option<std::fs::File>> {
        let path = self.dir.join(format!(".{}@{}.lock", path_component(namespace), path_component(sandbox)));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| RemoteError::Io { path: path.clone(), what: "open", source })?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(file)),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(RemoteError::Io { path, what: "lock", source: e.into() }),
        }
    }

    /// Queues a turn's push (again: a turn already queued keeps its entry and history).
    pub fn enqueue(&self, namespace: &str, sandbox: &str, turn: u64) -> Result<QueuedPush> {
        let item = QueuedPush {
            namespace: namespace.to_owned(),
            sandbox: sandbox.to_owned(),
            turn,
            enqueued_unix_ms: now_ms(),
            attempts: 0,
            last_error: None,
            not_before_unix_ms: 0,
        };
        let path = self.dir.join(item.file_name());
        if let Some(existing) = self.read(&path)? {
            return Ok(existing);
        }
        self.write(&item)?;
        Ok(item)
    }

    fn read(&self, path: &Path) -> Result<Option<QueuedPush>> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| RemoteError::Io {
                path: path.to_owned(),
                what: "parse",
                source: std::io::Error::other(e),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(RemoteError::Io { path: path.to_owned(), what: "read", source }),
        }
    }

    fn write(&self, item: &QueuedPush) -> Result<()> {
        let bytes = serde_json::to_vec(item).expect("a queue entry always serializes");
        write_atomic(&self.dir.join(item.file_name()), &bytes)
    }

    /// Every queued push, oldest first (by time queued, then turn). Files that are not entries
    /// (a tmp file of a write cut short) are skipped.
    pub fn pending(&self) -> Result<Vec<QueuedPush>> {
        let io = |source| RemoteError::Io { path: self.dir.clone(), what: "read dir", source };
        let mut items = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "json")
                && let Ok(Some(item)) = self.read(&path)
            {
                items.push(item);
            }
        }
        items.sort_by_key(|item| (item.enqueued_unix_ms, item.turn));
        Ok(items)
    }

    /// Removes a completed push's entry, durably.
    pub fn complete(&self, item: &QueuedPush) -> Result<()> {
        let path = self.dir.join(item.file_name());
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(RemoteError::Io { path, what: "remove", source }),
        }
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(|source| RemoteError::Io {
            path: self.dir.clone(),
            what: "fsync dir",
            source,
        })
    }

    /// Records a failed try: the entry stays, with the error and a backoff.
    pub fn defer(&self, item: &QueuedPush, error: &RemoteError) -> Result<QueuedPush> {
        let attempts = item.attempts.saturating_add(1);
        let backoff = Duration::from_secs(1).saturating_mul(1 << attempts.min(16)).min(MAX_BACKOFF);
        let updated = QueuedPush {
            attempts,
            last_error: Some(error.to_string()),
            not_before_unix_ms: now_ms() + backoff.as_millis() as u64,
            ..item.clone()
        };
        self.write(&updated)?;
        Ok(updated)
    }

    /// One pass: pushes every due entry, oldest first. `resolve` turns an entry into the push
    /// (from the local store: its turn manifest and objects) and the source of its objects.
    pub async fn run_once<F>(&self, remote: &Remote, index: &mut RemoteIndex, resolve: F) -> Result<QueueRun>
    where
        F: Fn(&QueuedPush) -> Result<(TurnPush, Arc<dyn ObjectSource>)>,
    {
        let mut run = QueueRun::default();
        let now = now_ms();
        for item in self.pending()? {
            if item.not_before_unix_ms > now {
                run.waiting += 1;
                continue;
            }
            let pushed = match resolve(&item) {
                Ok((push, source)) => remote.push_turn(index, &push, source).await,
                Err(e) => Err(e),
            };
            match pushed {
                Ok(report) => {
                    self.complete(&item)?;
                    run.pushed.push(report);
                }
                Err(e) => {
                    let updated = self.defer(&item, &e)?;
                    run.failed.push((updated, e.to_string()));
                }
            }
        }
        Ok(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_reopen_and_leave_only_when_completed() {
        let dir = tempfile::tempdir().unwrap();
        let q = PushQueue::open(dir.path()).unwrap();
        q.enqueue("default", "b", 2).unwrap();
        q.enqueue("default", "Box", 1).unwrap();
        let first = q.enqueue("default", "b", 2).unwrap();
        // A tmp file of a write cut short is not an entry.
        std::fs::write(dir.path().join("x.tmp-1"), b"{").unwrap();
        let q = PushQueue::open(dir.path()).unwrap();
        let pending = q.pending().unwrap();
        assert_eq!(pending.len(), 2);
        let err = RemoteError::NotFound { reference: "r".into(), what: "w".into() };
        let deferred = q.defer(&first, &err).unwrap();
        assert_eq!(deferred.attempts, 1);
        assert!(deferred.not_before_unix_ms > now_ms());
        let again = q.pending().unwrap().into_iter().find(|i| i.sandbox == "b").unwrap();
        assert_eq!(again.last_error.as_deref(), Some(err.to_string().as_str()));
        q.complete(&again).unwrap();
        assert_eq!(q.pending().unwrap().iter().map(|i| i.sandbox.as_str()).collect::<Vec<_>>(), vec!["Box"]);
    }
}
