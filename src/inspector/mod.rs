//! The inspector: an eBPF view of what each watched container does to the OS.
//!
//! BPF programs on syscall and sched tracepoints (`bpf/inspector.bpf.c`)
//! record file changes, processes, sockets and mounts of processes in watched
//! cgroup v2 groups. [`Inspector`] loads them once, reads their ring buffer on
//! a dedicated thread and keeps a log of [`Effect`]s per container, which the
//! caller drains at turn boundaries and feeds to [`classify`].
//!
//! ```no_run
//! # async fn turn() -> Result<(), crab::inspector::InspectorError> {
//! use crab::inspector::*;
//! let inspector = Inspector::start(InspectorConfig::default()).await?;
//! let cgroup = cgroup_id_of_pid(1234)?;
//! inspector.watch(cgroup, WatchedContainer { id: "c1".into(), root_pid: Some(1234), rootfs: None })?;
//! // ... the turn runs; then, once its processes are done:
//! let turn = inspector.drain("c1", monotonic_now_ns()).await?;
//! let verdict = classify(&turn.effects, &ClassifyOptions { lost_events: turn.lost_events, ..Default::default() });
//! # Ok(()) }
//! ```

mod cgroup;
mod classify;
mod effect;
mod mounts;
mod record;

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, OpenObject, RingBufferBuilder};
use tokio::sync::oneshot;

pub use cgroup::{CgroupError, cgroup_id_of_dir, cgroup_id_of_pid, cgroup2_mount, cgroup2_path_of_pid};
pub use classify::{
    Classification, ClassifyOptions, DEFAULT_IGNORED_PREFIXES, Reason, TurnClass, classify,
};
pub use effect::{Effect, EffectKind, EffectPath, SockAddr};
pub use mounts::{MountEntry, MountTable, MountsError};
pub use record::RecordError;

use record::{FsTypeLookup, NoFsTypes};

mod skel {
    #![allow(clippy::all, clippy::pedantic, missing_docs, non_camel_case_types, unused)]
    include!(concat!(env!("OUT_DIR"), "/inspector.skel.rs"));
}
use skel::{InspectorSkel, InspectorSkelBuilder};

const TRACEFS: &str = "/sys/kernel/tracing";
const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";
/// The reader wakes up this often even without records, to notice a dropped [`Inspector`].
const IDLE_WAKEUP: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum InspectorError {
    #[error("mounting tracefs at {TRACEFS} (needed to attach syscall tracepoints): {0}")]
    Tracefs(#[source] io::Error),
    #[error("loading or attaching the BPF programs: {0}")]
    Load(#[source] libbpf_rs::Error),
    #[error("BPF map {map}: {source}")]
    Map { map: &'static str, source: libbpf_rs::Error },
    #[error("container {0:?} is not watched")]
    NotWatched(String),
    #[error("cgroup {cgroup_id} is already watched for container {container:?}")]
    AlreadyWatched { cgroup_id: u64, container: String },
    #[error("container {0:?} is already watched under another cgroup")]
    DuplicateContainer(String),
    #[error("the inspector's reader thread has stopped")]
    ReaderGone,
    #[error("starting the inspector's reader thread: {0}")]
    Thread(#[source] io::Error),
    #[error("creating the reader's wake-up eventfd: {0}")]
    EventFd(#[source] io::Error),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
}

#[derive(Debug, Clone)]
pub struct InspectorConfig {
    /// Size of the BPF ring buffer (a power of two, at least a page). Bigger
    /// means fewer lost records under bursts of file changes.
    pub ring_buffer_bytes: u32,
}

impl Default for InspectorConfig {
    fn default() -> Self {
        Self { ring_buffer_bytes: 16 << 20 }
    }
}

/// A container the inspector records effects for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedContainer {
    pub id: String,
    /// The container's init process (host pid namespace): its mount table tells
    /// which file system each path is on.
    pub root_pid: Option<u32>,
    /// The container's root file system on the host, for callers that need it.
    pub rootfs: Option<PathBuf>,
}

/// What [`Inspector::drain`] took out of a container's log.
#[derive(Debug, Clone, Default)]
pub struct TurnEffects {
    pub effects: Vec<Effect>,
    /// Records lost since the previous drain or [`Inspector::take_lost_events`].
    pub lost_events: u64,
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of [`Effect::time_ns`].
pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "CLOCK_MONOTONIC is always available");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

struct ContainerLog {
    container: WatchedContainer,
    effects: Vec<Effect>,
    mounts: Option<MountTable>,
    /// Records for this container the decoder rejected.
    undecodable: u64,
    /// Lost records already reported by `take_lost_events`.
    lost_reported: u64,
}

impl ContainerLog {
    fn new(container: WatchedContainer) -> Self {
        let mut log = Self { container, effects: Vec::new(), mounts: None, undecodable: 0, lost_reported: 0 };
        log.refresh_mounts();
        log
    }

    fn refresh_mounts(&mut self) {
        let Some(pid) = self.container.root_pid else { return };
        match MountTable::of_pid(pid) {
            Ok(table) => self.mounts = Some(table),
            Err(error) => {
                tracing::warn!(container = %self.container.id, pid, %error, "cannot read the container's mount table");
            }
        }
    }

    fn record(&mut self, bytes: &[u8]) {
        let lookup: &dyn FsTypeLookup = match &self.mounts {
            Some(table) => table,
            None => &NoFsTypes,
        };
        match record::decode(bytes, lookup) {
            Ok(decoded) => {
                let remount = decoded.effect.kind.is_mount_change();
                self.effects.push(decoded.effect);
                if remount {
                    self.refresh_mounts();
                }
            }
            Err(error) => {
                tracing::warn!(container = %self.container.id, %error, "undecodable inspector record");
                self.undecodable += 1;
            }
        }
    }
}

/// Logs by watched cgroup id, shared by the reader thread and callers.
#[derive(Default)]
struct Logs(Mutex<HashMap<u64, ContainerLog>>);

impl Logs {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, ContainerLog>> {
        // A panic while holding the lock leaves plain data behind: keep going.
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn on_record(&self, bytes: &[u8]) {
        let Ok(cgroup_id) = record::record_cgroup(bytes) else {
            tracing::warn!(len = bytes.len(), "inspector record too short to name its cgroup");
            return;
        };
        // Records of a container unwatched a moment ago are dropped here.
        if let Some(log) = self.lock().get_mut(&cgroup_id) {
            log.record(bytes);
        }
    }
}

enum Command {
    Flush(oneshot::Sender<()>),
}

/// The loaded BPF programs and the per-container effect logs.
pub struct Inspector {
    logs: Arc<Logs>,
    watched: MapHandle,
    lost: MapHandle,
    commands: mpsc::Sender<Command>,
    wake: Arc<OwnedFd>,
    reader: Option<JoinHandle<()>>,
}

struct ReaderHandles {
    watched: MapHandle,
    lost: MapHandle,
}

impl Inspector {
    /// Loads and attaches the BPF programs and starts reading their records.
    pub async fn start(config: InspectorConfig) -> Result<Self, InspectorError> {
        let logs = Arc::new(Logs::default());
        let wake = Arc::new(new_eventfd()?);
        let (commands, command_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let reader = {
            let logs = logs.clone();
            let wake = wake.clone();
            std::thread::Builder::new()
                .name("crab-inspector".into())
                .spawn(move || run_reader(config, logs, wake, command_rx, ready_tx))
                .map_err(InspectorError::Thread)?
        };
        let handles = ready_rx.await.map_err(|_| InspectorError::ReaderGone)??;
        tracing::info!("inspector attached");
        Ok(Self { logs, watched: handles.watched, lost: handles.lost, commands, wake, reader: Some(reader) })
    }

    /// Starts recording the processes in cgroup `cgroup_id` (and its descendants) as `container`.
    pub fn watch(&self, cgroup_id: u64, container: WatchedContainer) -> Result<(), InspectorError> {
        {
            let mut logs = self.logs.lock();
            if let Some(existing) = logs.get(&cgroup_id) {
                return Err(InspectorError::AlreadyWatched { cgroup_id, container: existing.container.id.clone() });
            }
            if logs.values().any(|l| l.container.id == container.id) {
                return Err(InspectorError::DuplicateContainer(container.id));
            }
            tracing::info!(container = %container.id, cgroup_id, "watching container");
            logs.insert(cgroup_id, ContainerLog::new(container));
        }
        let result = self
            .watched
            .update(&cgroup_id.to_ne_bytes(), &[1u8], MapFlags::ANY)
            .map_err(|source| InspectorError::Map { map: "watched", source });
        if result.is_err() {
            self.logs.lock().remove(&cgroup_id);
        }
        result
    }

    /// Stops recording `container`; returns the effects not yet taken.
    pub async fn unwatch(&self, container: &str) -> Result<Vec<Effect>, InspectorError> {
        let cgroup_id = self.cgroup_of(container)?;
        self.watched
            .delete(&cgroup_id.to_ne_bytes())
            .map_err(|source| InspectorError::Map { map: "watched", source })?;
        // Records already in the ring buffer still belong to the container.
        self.flush().await?;
        // The lost counter may never have been created: nothing to delete then.
        let _ = self.lost.delete(&cgroup_id.to_ne_bytes());
        let log = self.logs.lock().remove(&cgroup_id);
        tracing::info!(container, cgroup_id, "stopped watching container");
        Ok(log.map(|l| l.effects).unwrap_or_default())
    }

    /// Returns once every record submitted before the call is in the logs.
    pub async fn flush(&self) -> Result<(), InspectorError> {
        let (done_tx, done_rx) = oneshot::channel();
        self.commands.send(Command::Flush(done_tx)).map_err(|_| InspectorError::ReaderGone)?;
        signal_eventfd(&self.wake);
        done_rx.await.map_err(|_| InspectorError::ReaderGone)
    }

    /// Takes every effect recorded so far for `container`.
    pub fn take_effects(&self, container: &str) -> Result<Vec<Effect>, InspectorError> {
        self.take_effects_until(container, u64::MAX)
    }

    /// Takes the effects of `container` that happened at or before `until_ns`
    /// (CLOCK_MONOTONIC, see [`monotonic_now_ns`]); later ones stay for the next turn.
    pub fn take_effects_until(&self, container: &str, until_ns: u64) -> Result<Vec<Effect>, InspectorError> {
        let mut logs = self.logs.lock();
        let log = find_log(&mut logs, container)?;
        let (taken, kept) = std::mem::take(&mut log.effects).into_iter().partition(|e| e.time_ns <= until_ns);
        log.effects = kept;
        Ok(taken)
    }

    /// Records of `container` lost so far (ring buffer full, per-thread table
    /// full, or undecodable), since the container was watched.
    pub fn lost_events(&self, container: &str) -> Result<u64, InspectorError> {
        let cgroup_id = self.cgroup_of(container)?;
        let kernel = self.kernel_lost(cgroup_id)?;
        Ok(kernel + find_log(&mut self.logs.lock(), container)?.undecodable)
    }

    /// Records of `container` lost since the previous call.
    pub fn take_lost_events(&self, container: &str) -> Result<u64, InspectorError> {
        let total = self.lost_events(container)?;
        let mut logs = self.logs.lock();
        let log = find_log(&mut logs, container)?;
        let new = total.saturating_sub(log.lost_reported);
        log.lost_reported = total;
        Ok(new)
    }

    /// Flushes, then takes the effects up to `until_ns` and the records lost
    /// meanwhile: everything a turn classification needs.
    pub async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, InspectorError> {
        self.flush().await?;
        Ok(TurnEffects {
            effects: self.take_effects_until(container, until_ns)?,
            lost_events: self.take_lost_events(container)?,
        })
    }

    /// The containers being watched, by cgroup id.
    pub fn watched(&self) -> Vec<(u64, WatchedContainer)> {
        self.logs.lock().iter().map(|(id, log)| (*id, log.container.clone())).collect()
    }

    fn cgroup_of(&self, container: &str) -> Result<u64, InspectorError> {
        self.logs
            .lock()
            .iter()
            .find(|(_, log)| log.container.id == container)
            .map(|(id, _)| *id)
            .ok_or_else(|| InspectorError::NotWatched(container.to_string()))
    }

    fn kernel_lost(&self, cgroup_id: u64) -> Result<u64, InspectorError> {
        let value = self
            .lost
            .lookup(&cgroup_id.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| InspectorError::Map { map: "lost", source })?;
        Ok(value.and_then(|v| v.get(..8).map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))).unwrap_or(0))
    }
}

impl Drop for Inspector {
    fn drop(&mut self) {
        // Dropping the command sender tells the reader to stop.
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.commands, closed));
        signal_eventfd(&self.wake);
        if let Some(reader) = self.reader.take()
            && reader.join().is_err()
        {
            tracing::error!("inspector reader thread panicked");
        }
    }
}

fn find_log<'a>(
    logs: &'a mut HashMap<u64, ContainerLog>,
    container: &str,
) -> Result<&'a mut ContainerLog, InspectorError> {
    logs.values_mut()
        .find(|l| l.container.id == container)
        .ok_or_else(|| InspectorError::NotWatched(container.to_string()))
}

/// The reader thread: owns the BPF objects (libbpf handles are not Send) for
/// the inspector's whole life, and moves records into the logs.
fn run_reader(
    config: InspectorConfig,
    logs: Arc<Logs>,
    wake: Arc<OwnedFd>,
    commands: mpsc::Receiver<Command>,
    ready: oneshot::Sender<Result<ReaderHandles, InspectorError>>,
) {
    let mut storage = MaybeUninit::uninit();
    let loaded = load(&mut storage, &config).and_then(|skel| {
        let handles = ReaderHandles {
            watched: map_handle(&skel.maps.watched, "watched")?,
            lost: map_handle(&skel.maps.lost, "lost")?,
        };
        let mut builder = RingBufferBuilder::new();
        let sink = logs.clone();
        builder
            .add(&skel.maps.events, move |bytes: &[u8]| {
                sink.on_record(bytes);
                0
            })
            .map_err(|source| InspectorError::Map { map: "events", source })?;
        let ring = builder.build().map_err(|source| InspectorError::Map { map: "events", source })?;
        Ok((skel, ring, handles))
    });
    let (_skel, ring) = match loaded {
        Ok((skel, ring, handles)) => {
            if ready.send(Ok(handles)).is_err() {
                return;
            }
            (skel, ring)
        }
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    let mut fds = [
        libc::pollfd { fd: ring.epoll_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    loop {
        // SAFETY: fds is a valid array of two pollfd for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, IDLE_WAKEUP.as_millis() as i32) };
        if rc < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            tracing::error!(error = %io::Error::last_os_error(), "inspector poll failed");
            return;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            drain_eventfd(&wake);
        }
        // Commands are collected before consuming so a flush is answered only
        // after a consume that started after the flush was asked for.
        let mut flushes = Vec::new();
        let stop = loop {
            match commands.try_recv() {
                Ok(Command::Flush(done)) => flushes.push(done),
                Err(mpsc::TryRecvError::Empty) => break false,
                Err(mpsc::TryRecvError::Disconnected) => break true,
            }
        };
        if let Err(error) = ring.consume() {
            tracing::error!(%error, "consuming the inspector ring buffer failed");
        }
        for done in flushes {
            let _ = done.send(());
        }
        if stop {
            tracing::info!("inspector reader stopping");
            return;
        }
    }
}

fn map_handle<T: std::fmt::Debug>(
    map: &libbpf_rs::MapImpl<'_, T>,
    name: &'static str,
) -> Result<MapHandle, InspectorError> {
    MapHandle::try_from(map).map_err(|source| InspectorError::Map { map: name, source })
}

fn load<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    config: &InspectorConfig,
) -> Result<InspectorSkel<'obj>, InspectorError> {
    let events_dir = tracing_events_dir()?;
    let mut open = InspectorSkelBuilder::default().open(storage).map_err(InspectorError::Load)?;
    open.maps
        .events
        .set_max_entries(config.ring_buffer_bytes)
        .map_err(|source| InspectorError::Map { map: "events", source })?;
    // Older kernels lack some syscalls (openat2, fchmodat2, setxattrat, ...):
    // skip their programs instead of failing the whole load.
    for mut prog in open.open_object_mut().progs_mut() {
        let section = prog.section().to_string_lossy().into_owned();
        if let Some(tracepoint) = section.strip_prefix("tracepoint/")
            && !events_dir.join(tracepoint).exists()
        {
            tracing::debug!(tracepoint, "tracepoint missing on this kernel, program skipped");
            prog.set_autoload(false);
        }
    }
    let mut skel = open.load().map_err(InspectorError::Load)?;
    skel.attach().map_err(InspectorError::Load)?;
    Ok(skel)
}

/// The tracefs `events` directory, mounting tracefs when no one has.
fn tracing_events_dir() -> Result<PathBuf, InspectorError> {
    for base in [TRACEFS, DEBUGFS_TRACING] {
        let events = Path::new(base).join("events");
        if events.is_dir() {
            return Ok(events);
        }
    }
    let target = CString::new(TRACEFS).expect("no NUL in a constant");
    let fstype = CString::new("tracefs").expect("no NUL in a constant");
    // SAFETY: all pointers are valid NUL-terminated strings or null.
    let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(InspectorError::Tracefs(io::Error::last_os_error()));
    }
    tracing::info!(path = TRACEFS, "mounted tracefs");
    Ok(Path::new(TRACEFS).join("events"))
}

fn new_eventfd() -> Result<OwnedFd, InspectorError> {
    // SAFETY: eventfd returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(InspectorError::EventFd(io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn signal_eventfd(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer; a full counter (EAGAIN) still leaves it readable.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

fn drain_eventfd(fd: &OwnedFd) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer; EAGAIN is fine.
    unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
}
