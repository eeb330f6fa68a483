//! The inspector: an eBPF view of what each watched container does to the OS.
//!
//! BPF programs on syscall and sched tracepoints (`bpf/inspector.bpf.c`)
//! record file changes, processes, sockets and mounts of processes in watched
//! cgroup v2 groups. [`Inspector`] loads them once, reads their ring buffer on
//! a dedicated thread and keeps a log of [`Effect`]s per container, which the
//! caller drains at turn boundaries and feeds to [`classify`].
//!
//! Writes through descriptors and shared mappings are reported once per
//! process and file per turn, whenever the file was opened: a drain moves the
//! kernel's turn boundary (the `writes` module says how no write is lost at the cut).
//! io_uring and Linux AIO do I/O the programs cannot see: their use is the
//! effect ([`EffectKind::AsyncIo`]), which escalates the turn.
//!
//! Each syscall the inspector needs has its own program on its
//! `syscalls:sys_enter_*` (and `sys_exit_*`) tracepoint, so other syscalls run
//! no BPF. The programs are loaded (verified) once, at [`Inspector::start`],
//! but attached only while at least one container is watched: every process
//! on the node pays for an attached syscall tracepoint (the kernel's slow
//! syscall path, and the program's test of the caller's cgroup), so a node
//! with nothing to watch pays nothing. The first watch attaches them (its
//! cost is logged, `attach_ms`) and returns once they are attached; the last
//! unwatch detaches them, after a linger (`detach_after`: sandboxes come and go
//! in bursts) and in the background: the kernel waits for RCU grace
//! periods per detached tracepoint, which takes a while.
//!
//! ```no_run
//! # async fn turn() -> Result<(), crab_inspector::InspectorError> {
//! use crab_inspector::*;
//! let inspector = Inspector::start(InspectorConfig::default()).await?;
//! let cgroup = cgroup_id_of_pid(1234)?;
//! inspector.watch(cgroup, WatchedContainer { id: "c1".into(), root_pid: Some(1234), rootfs: None }).await?;
//! // ... the turn runs; then, once its processes are done:
//! let turn = inspector.drain("c1", monotonic_now_ns()).await?;
//! let verdict = classify(&turn.effects, &ClassifyOptions { lost_events: turn.lost_events, ..Default::default() });
//! # Ok(()) }
//! ```

mod buffer;
mod cgroup;
mod classify;
mod effect;
pub mod floor;
mod layout;
mod mounts;
mod record;
mod source_digest;
mod tracefs;
pub mod wire_path;
mod writes;

pub use source_digest::source_digest;

/// Digest (computed by build.rs, see [`source_digest`]) of the sources that define the BPF
/// records, their decoding into effects and how effects go on the wire: half of the identity
/// a shim and crabd must share (`crab_node::protocol::compat_identity`).
pub const RECORD_DIGEST: &str = env!("CRAB_RECORD_DIGEST");

use std::collections::{HashMap, HashSet};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, OpenObject, RingBufferBuilder};
use tokio::sync::oneshot;

pub use buffer::Overflow;
pub use cgroup::{CgroupError, cgroup_id_of_dir, cgroup_id_of_pid, cgroup_level, cgroup2_mount, cgroup2_path_of_pid};
pub use classify::{
    Classification, ClassifyOptions, DEFAULT_IGNORED_PREFIXES, ProcessRan, Reason, TurnClass, classify,
};
pub use effect::{AsyncIoCall, Effect, EffectKind, EffectPath, NamespacePid, SockAddr, WriteVia};
pub use mounts::{MountEntry, MountTable, MountsError};
pub use record::RecordError;
pub use tracefs::TracefsError;

use buffer::EffectBuffer;
use record::{FsTypeLookup, NoFsTypes};
use writes::{ProcFs, SeenAtDrain, WriteKey, WriteMemory, WriteSeen};

/// A module holding a skeleton that libbpf-cargo generated (build.rs) into `OUT_DIR`: its
/// unsafe blocks and names are the generator's, not ours to document or lint.
macro_rules! bpf_skeleton {
    ($module:ident, $file:literal) => {
        mod $module {
            #![allow(
                clippy::all,
                clippy::pedantic,
                clippy::undocumented_unsafe_blocks,
                missing_docs,
                non_camel_case_types,
                unused
            )]
            include!(concat!(env!("OUT_DIR"), "/", $file));
        }
    };
}
pub(crate) use bpf_skeleton;

bpf_skeleton!(skel, "inspector.skel.rs");
use skel::{InspectorSkel, InspectorSkelBuilder};

/// The BPF side wakes the reader only when the ring buffer fills up (a wakeup
/// per record costs more than the record); otherwise it reads this often.
const READ_INTERVAL: Duration = Duration::from_millis(20);

/// Records the reader consumes between two looks at its commands: under a
/// storm the ring buffer never empties, and a flush must not wait for it to.
const CONSUME_BATCH: usize = 4096;

/// Default bound on the effects held per container between two drains.
pub const DEFAULT_MAX_EFFECTS_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum InspectorError {
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
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
}

#[derive(Debug, Clone)]
pub struct InspectorConfig {
    /// Size of the BPF ring buffer (a power of two, at least a page). Bigger
    /// means fewer lost records under bursts of file changes.
    pub ring_buffer_bytes: u32,
    /// Bound on the bytes of effects held per container between two drains
    /// (see the `buffer` module): beyond it details are cut and the turn is
    /// marked [`Overflow`].
    pub max_effects_bytes: usize,
    /// How long the programs stay attached after the last unwatch. Sandboxes
    /// come and go in bursts (a test suite, a rollout, kubelet restarting a
    /// container): a watch within this time finds them attached instead of
    /// waiting for a detach (the kernel's RCU grace periods, seconds) and an
    /// attach, which would hold up the new sandbox's start.
    pub detach_after: Duration,
}

/// [`InspectorConfig::detach_after`] unless told otherwise.
pub const DEFAULT_DETACH_AFTER: Duration = Duration::from_secs(10);

impl Default for InspectorConfig {
    fn default() -> Self {
        Self {
            ring_buffer_bytes: 16 << 20,
            max_effects_bytes: DEFAULT_MAX_EFFECTS_BYTES,
            detach_after: DEFAULT_DETACH_AFTER,
        }
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
    /// Effects of the turn the container's buffer could not hold: the
    /// effects are incomplete and the turn must be captured in full.
    pub overflow: Option<Overflow>,
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
    /// The watched cgroup's level below the cgroup v2 root, when known (see `watch_filter`).
    level: Option<u32>,
    effects: EffectBuffer,
    /// Overflow of effects already taken (`take_effects_until`) that no
    /// drain has reported yet.
    overflow_taken: Option<Overflow>,
    mounts: Option<MountTable>,
    /// Records for this container the decoder rejected.
    undecodable: u64,
    /// Lost records already reported by `take_lost_events`.
    lost_reported: u64,
    writes: WriteMemory,
}

impl ContainerLog {
    fn new(container: WatchedContainer, level: Option<u32>, max_effects_bytes: usize) -> Self {
        let mut log = Self {
            container,
            level,
            effects: EffectBuffer::new(max_effects_bytes),
            overflow_taken: None,
            mounts: None,
            undecodable: 0,
            lost_reported: 0,
            writes: WriteMemory::default(),
        };
        log.refresh_mounts();
        log
    }

    fn refresh_mounts(&mut self) {
        let Some(pid) = self.container.root_pid else {
            return;
        };
        match MountTable::of_pid(pid) {
            Ok(table) => self.mounts = Some(table),
            Err(error) => {
                tracing::warn!(container = %self.container.id, pid, %error, "cannot read the container's mount table");
            }
        }
    }

    fn record(&mut self, bytes: &[u8]) {
        // Once file details are cut, a record that only names changed paths
        // (and feeds no write or mapping tracking) is counted undecoded: a
        // storm costs the reader a header read per record, not a decode.
        if self.effects.files_cut()
            && let Some(time_ns) = record::path_only_time(bytes)
        {
            self.effects.note_dropped(time_ns, bytes.len() as u64, false);
            return;
        }
        let lookup: &dyn FsTypeLookup = match &self.mounts {
            Some(table) => table,
            None => &NoFsTypes,
        };
        match record::decode(bytes, lookup) {
            Ok(decoded) => {
                let remount = decoded.effect.kind.is_mount_change();
                self.writes.observe(&decoded.effect);
                if let Some(inode_key) = decoded.opened_inode {
                    self.writes.observe_open(&decoded.effect, inode_key);
                }
                if decoded.process_gone {
                    self.writes.observe_gone(decoded.effect.pid, decoded.effect.time_ns);
                }
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
struct Logs {
    by_cgroup: Mutex<HashMap<u64, ContainerLog>>,
    /// Bound of each container's effect buffer.
    max_effects_bytes: usize,
}

impl Logs {
    fn new(max_effects_bytes: usize) -> Self {
        Self { by_cgroup: Mutex::new(HashMap::new()), max_effects_bytes }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, ContainerLog>> {
        // A panic while holding the lock leaves plain data behind: keep going.
        self.by_cgroup.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
    /// Attach every program (a no-op when attached); answers with the time it took.
    Attach(oneshot::Sender<Result<Duration, InspectorError>>),
    /// Detach every program (in the background) once this long has passed
    /// without an attach.
    Detach(Duration),
}

/// Bit of `watch_filter.levels`: some watched cgroup's level is unknown (inspector.h).
const LEVELS_UNKNOWN: u32 = 1 << 31;
/// Levels the BPF side can look at one by one (MAX_CGROUP_LEVEL in inspector.h).
const MAX_CGROUP_LEVEL: u32 = 16;
/// Watched ids the early exit compares with before a hash lookup (WATCHED_IDS in inspector.h).
pub(crate) const WATCHED_IDS: usize = 8;
/// Byte offsets in `struct watch_filter` (checked against the skeleton's type in layout.rs).
pub(crate) const WF_LEVELS: usize = 0;
pub(crate) const WF_NR_IDS: usize = 4;
pub(crate) const WF_IDS: usize = 8;
pub(crate) const WATCH_FILTER_LEN: usize = WF_IDS + 8 * WATCHED_IDS;

/// The `struct watch_filter` (the whole `.data.levels` section) for the watched cgroups
/// `watched`, each with its level when known.
fn watch_filter(watched: &[(u64, Option<u32>)]) -> [u8; WATCH_FILTER_LEN] {
    let mut filter = [0u8; WATCH_FILTER_LEN];
    let levels = levels_mask(watched.iter().map(|(_, level)| *level));
    filter[WF_LEVELS..WF_LEVELS + 4].copy_from_slice(&levels.to_ne_bytes());
    // More than fit: the count alone says so, and the BPF side looks every ancestor up.
    let nr = u32::try_from(watched.len()).unwrap_or(u32::MAX);
    filter[WF_NR_IDS..WF_NR_IDS + 4].copy_from_slice(&nr.to_ne_bytes());
    if watched.len() <= WATCHED_IDS {
        for (i, (id, _)) in watched.iter().enumerate() {
            filter[WF_IDS + 8 * i..WF_IDS + 8 * (i + 1)].copy_from_slice(&id.to_ne_bytes());
        }
    }
    filter
}

/// The `watch_filter.levels` value for cgroups at `levels` (None: unknown).
fn levels_mask(levels: impl IntoIterator<Item = Option<u32>>) -> u32 {
    levels.into_iter().fold(0, |mask, level| match level {
        Some(level) if level < MAX_CGROUP_LEVEL => mask | (1 << level),
        _ => mask | LEVELS_UNKNOWN,
    })
}

/// The loaded BPF programs and the per-container effect logs.
pub struct Inspector {
    logs: Arc<Logs>,
    watched: MapHandle,
    /// The `.data.levels` section: the `watch_filter` global.
    levels: MapHandle,
    /// Whether the programs are attached; held across a watch or unwatch so
    /// that attaching and detaching follow the watches in order.
    attached: tokio::sync::Mutex<bool>,
    /// [`InspectorConfig::detach_after`].
    detach_after: Duration,
    lost: MapHandle,
    written: MapHandle,
    /// Every map of the BPF object, to report kernel memory use.
    all_maps: Vec<MapHandle>,
    programs: Vec<(String, OwnedFd)>,
    commands: mpsc::Sender<Command>,
    wake: Arc<OwnedFd>,
    reader: Option<JoinHandle<()>>,
}

struct ReaderHandles {
    watched: MapHandle,
    levels: MapHandle,
    lost: MapHandle,
    written: MapHandle,
    all_maps: Vec<MapHandle>,
    programs: Vec<(String, OwnedFd)>,
}

/// Kernel-measured cost of one BPF program, counted only while the
/// `kernel.bpf_stats_enabled` sysctl is 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramStats {
    pub name: String,
    pub run_count: u64,
    pub run_time_ns: u64,
}

impl Inspector {
    /// Loads the BPF programs and starts reading their records; the programs
    /// are attached while something is watched.
    pub async fn start(config: InspectorConfig) -> Result<Self, InspectorError> {
        Self::start_at(config, 0).await
    }

    /// [`start`](Self::start) with the program load (the kernel's verifier, CPU-bound for a
    /// while) at a lower CPU priority, for a load that runs beside work that matters more (a
    /// restore). The reader then drains at normal priority.
    pub async fn start_yielding(config: InspectorConfig) -> Result<Self, InspectorError> {
        Self::start_at(config, LOAD_NICE).await
    }

    async fn start_at(config: InspectorConfig, load_nice: i32) -> Result<Self, InspectorError> {
        let logs = Arc::new(Logs::new(config.max_effects_bytes));
        let detach_after = config.detach_after;
        let wake = Arc::new(new_eventfd()?);
        let (commands, command_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let reader = {
            let logs = logs.clone();
            let wake = wake.clone();
            std::thread::Builder::new()
                .name("crab-inspector".into())
                .spawn(move || run_reader(config, load_nice, logs, wake, command_rx, ready_tx))
                .map_err(InspectorError::Thread)?
        };
        let handles = ready_rx.await.map_err(|_| InspectorError::ReaderGone)??;
        tracing::info!("inspector loaded");
        Ok(Self {
            logs,
            watched: handles.watched,
            levels: handles.levels,
            attached: tokio::sync::Mutex::new(false),
            detach_after,
            lost: handles.lost,
            written: handles.written,
            all_maps: handles.all_maps,
            programs: handles.programs,
            commands,
            wake,
            reader: Some(reader),
        })
    }

    /// Starts recording the processes in cgroup `cgroup_id` (and its descendants) as `container`.
    /// Attaches the programs when nothing was watched; returns once they are attached.
    pub async fn watch(&self, cgroup_id: u64, container: WatchedContainer) -> Result<(), InspectorError> {
        let level = cgroup_level(cgroup_id, container.root_pid);
        let mut attached = self.attached.lock().await;
        {
            let mut logs = self.logs.lock();
            if let Some(existing) = logs.get(&cgroup_id) {
                return Err(InspectorError::AlreadyWatched { cgroup_id, container: existing.container.id.clone() });
            }
            if logs.values().any(|l| l.container.id == container.id) {
                return Err(InspectorError::DuplicateContainer(container.id));
            }
            tracing::info!(container = %container.id, cgroup_id, ?level, "watching container");
            logs.insert(cgroup_id, ContainerLog::new(container, level, self.logs.max_effects_bytes));
        }
        // The first boundary is now: processes already running (the entrypoint)
        // count as from an earlier turn, whose repeated writes are timed.
        let mut result = self.set_epoch(cgroup_id, monotonic_now_ns(), MapFlags::ANY).and_then(|()| self.set_levels());
        if result.is_ok() && !*attached {
            result = self.attach().await;
            *attached = result.is_ok();
        }
        if result.is_err() {
            self.logs.lock().remove(&cgroup_id);
            let _ = self.watched.delete(&cgroup_id.to_ne_bytes());
            let _ = self.set_levels();
        }
        result
    }

    async fn attach(&self) -> Result<(), InspectorError> {
        let (done_tx, done_rx) = oneshot::channel();
        self.commands.send(Command::Attach(done_tx)).map_err(|_| InspectorError::ReaderGone)?;
        signal_eventfd(&self.wake);
        let took = done_rx.await.map_err(|_| InspectorError::ReaderGone)??;
        tracing::info!(
            attach_ms = took.as_secs_f64() * 1e3,
            programs = self.programs.len(),
            "inspector programs attached"
        );
        Ok(())
    }

    /// Writes the watched cgroups and their levels into `watch_filter`.
    fn set_levels(&self) -> Result<(), InspectorError> {
        let watched: Vec<(u64, Option<u32>)> = self.logs.lock().iter().map(|(id, log)| (*id, log.level)).collect();
        self.levels
            .update(&0u32.to_ne_bytes(), &watch_filter(&watched), MapFlags::ANY)
            .map_err(|source| InspectorError::Map { map: ".data.levels", source })
    }

    /// Stops recording `container`; returns the effects not yet taken.
    /// Detaches the programs (in the background) when it was the last.
    pub async fn unwatch(&self, container: &str) -> Result<Vec<Effect>, InspectorError> {
        let mut attached = self.attached.lock().await;
        let cgroup_id = self.cgroup_of(container)?;
        self.watched
            .delete(&cgroup_id.to_ne_bytes())
            .map_err(|source| InspectorError::Map { map: "watched", source })?;
        // Records already in the ring buffer still belong to the container.
        self.flush().await?;
        // The lost counter may never have been created: nothing to delete then.
        let _ = self.lost.delete(&cgroup_id.to_ne_bytes());
        let (log, none_left) = {
            let mut logs = self.logs.lock();
            let log = logs.remove(&cgroup_id);
            (log, logs.is_empty())
        };
        tracing::info!(container, cgroup_id, "stopped watching container");
        if let Err(error) = self.set_levels() {
            tracing::warn!(%error, "watched levels not updated");
        }
        if none_left && *attached {
            // Nobody listens for the answer: the reader detaches once nothing is watched.
            if self.commands.send(Command::Detach(self.detach_after)).is_ok() {
                signal_eventfd(&self.wake);
            }
            *attached = false;
        }
        Ok(log
            .map(|mut l| {
                let (effects, overflow) = l.effects.take_all();
                if let Some(overflow) = overflow.or(l.overflow_taken) {
                    tracing::info!(container, %overflow, "effects of an unwatched container were cut");
                }
                effects
            })
            .unwrap_or_default())
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
        let (taken, overflow) = log.effects.take_until(until_ns);
        // Reported by the next drain: an overflow is never forgotten.
        log.overflow_taken = merge_overflow(log.overflow_taken, overflow);
        Ok(taken)
    }

    /// The effects up to `until_ns` and the overflow of the effects taken,
    /// this time and by earlier `take_effects_until` calls.
    fn take_turn_until(
        &self,
        container: &str,
        until_ns: u64,
    ) -> Result<(Vec<Effect>, Option<Overflow>), InspectorError> {
        let mut logs = self.logs.lock();
        let log = find_log(&mut logs, container)?;
        let (taken, overflow) = log.effects.take_until(until_ns);
        let overflow = merge_overflow(log.overflow_taken.take(), overflow);
        tracing::debug!(
            container,
            taken = taken.len(),
            kept = log.effects.len(),
            folded_so_far = log.effects.folded(),
            "effects taken"
        );
        if let Some(overflow) = &overflow {
            tracing::warn!(container, %overflow, held_after = log.effects.held_bytes(),
                "the container's effects exceeded their bound: its turn is captured in full");
        }
        Ok((taken, overflow))
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
    /// meanwhile: everything a turn classification needs. `until_ns` is the
    /// turn boundary: the kernel reports the first write of each process to
    /// each file again after it. A boundary in the future means now.
    pub async fn drain(&self, container: &str, until_ns: u64) -> Result<TurnEffects, InspectorError> {
        // Records after the boundary stay for the next drain, and so must the
        // dedup entries made after it: both halves cut at the same instant.
        let until_ns = until_ns.min(monotonic_now_ns());
        let cgroup_id = self.cgroup_of(container)?;
        // Before the flush: writes recorded after this point are on the ring
        // buffer by the time the written map is read.
        self.set_epoch(cgroup_id, until_ns, MapFlags::EXIST)?;
        self.flush().await?;
        self.settle_writes(container, cgroup_id, until_ns)?;
        let (effects, overflow) = self.take_turn_until(container, until_ns)?;
        Ok(TurnEffects { effects, lost_events: self.take_lost_events(container)?, overflow })
    }

    /// Kernel memory held by the inspector's BPF maps (ring buffer, pending
    /// syscalls, ...), as the kernel accounts it.
    pub fn map_memory_bytes(&self) -> u64 {
        self.all_maps.iter().filter_map(|map| fdinfo_field(map.as_fd().as_raw_fd(), "memlock:")).sum()
    }

    /// Run counts and times of the BPF programs (see [`ProgramStats`]).
    pub fn program_stats(&self) -> Vec<ProgramStats> {
        self.programs
            .iter()
            .map(|(name, fd)| {
                let field = |key| fdinfo_field(fd.as_raw_fd(), key).unwrap_or(0);
                ProgramStats { name: name.clone(), run_count: field("run_cnt:"), run_time_ns: field("run_time_ns:") }
            })
            .collect()
    }

    /// Kernel ids of the loaded BPF programs (to find their links, `bpftool link`).
    pub fn program_ids(&self) -> Vec<u32> {
        self.programs
            .iter()
            .filter_map(|(_, fd)| fdinfo_field(fd.as_raw_fd(), "prog_id:").and_then(|id| u32::try_from(id).ok()))
            .collect()
    }

    /// The containers being watched, by cgroup id.
    pub fn watched(&self) -> Vec<(u64, WatchedContainer)> {
        self.logs.lock().iter().map(|(id, log)| (*id, log.container.clone())).collect()
    }

    fn set_epoch(&self, cgroup_id: u64, epoch_ns: u64, flags: MapFlags) -> Result<(), InspectorError> {
        self.watched
            .update(&cgroup_id.to_ne_bytes(), &epoch_ns.to_ne_bytes(), flags)
            .map_err(|source| InspectorError::Map { map: "watched", source })
    }

    /// At a drain up to `until_ns`: deletes the container's dedup entries of
    /// turns up to the cut, carries writes the kernel skipped after the cut
    /// into the next turn, and adds the writes through shared mappings of
    /// earlier turns (see the `writes` module).
    fn settle_writes(&self, container: &str, cgroup_id: u64, until_ns: u64) -> Result<(), InspectorError> {
        let map_error = |source| InspectorError::Map { map: "written", source };
        // Deleting while walking the keys would restart the walk.
        let keys: Vec<Vec<u8>> = self.written.keys().collect();
        let mut live = HashSet::new();
        let mut carried = Vec::new();
        // Exits are read from the log: everything up to the cut is in it after the flush.
        let mut logs = self.logs.lock();
        let log = find_log(&mut logs, container)?;
        for raw_key in keys {
            let Some(value) = self.written.lookup(&raw_key, MapFlags::ANY).map_err(map_error)? else {
                continue; // evicted meanwhile
            };
            let (Some(key), Some(seen)) = (WriteKey::from_bytes(&raw_key), WriteSeen::from_bytes(&value)) else {
                continue;
            };
            if seen.cgroup_id != cgroup_id {
                continue;
            }
            let gone = log.writes.gone_between(key.pid, seen.recorded_ns, until_ns);
            match writes::seen_at_drain(&seen, until_ns, gone) {
                SeenAtDrain::NextTurn => {
                    live.insert(key);
                    continue;
                }
                SeenAtDrain::SkippedAfterCut { at_ns } => carried.push((key, at_ns)),
                SeenAtDrain::Stale => {}
            }
            // Already gone (evicted, or the process wrote again and the entry was replaced): fine either way.
            let _ = self.written.delete(&raw_key);
        }
        log.writes.forget_gone_until(until_ns);
        for (key, at_ns) in carried {
            let effect = log.writes.carry_over(&key, at_ns);
            tracing::debug!(container, pid = key.pid, %effect, "write after the turn's cut carried into the next turn");
            log.effects.push(effect);
        }
        log.writes.keep_only(&live);
        let mapped = log.writes.mapped_writes(until_ns, monotonic_now_ns(), &ProcFs);
        for effect in mapped {
            log.effects.push(effect);
        }
        Ok(())
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

/// Both overflows together (counts add up, a process cut in either stays).
fn merge_overflow(a: Option<Overflow>, b: Option<Overflow>) -> Option<Overflow> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Overflow {
            events: a.events + b.events,
            bytes: a.bytes + b.bytes,
            processes_cut: a.processes_cut || b.processes_cut,
        }),
        (a, b) => a.or(b),
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
/// Nice value of a [`Inspector::start_yielding`] load.
const LOAD_NICE: i32 = 10;

/// Sets this thread's nice value (Linux: per thread); returns the previous one.
fn set_thread_nice(nice: i32) -> i32 {
    // SAFETY: plain syscalls on this thread's own id.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        let before = libc::getpriority(libc::PRIO_PROCESS, tid);
        if libc::setpriority(libc::PRIO_PROCESS, tid, nice) != 0 {
            tracing::debug!(nice, error = %io::Error::last_os_error(), "inspector load priority unchanged");
        }
        before
    }
}

fn run_reader(
    config: InspectorConfig,
    load_nice: i32,
    logs: Arc<Logs>,
    wake: Arc<OwnedFd>,
    commands: mpsc::Receiver<Command>,
    ready: oneshot::Sender<Result<ReaderHandles, InspectorError>>,
) {
    let normal = (load_nice != 0).then(|| set_thread_nice(load_nice));
    let ring_bytes = u64::from(config.ring_buffer_bytes);
    // Bytes of ring buffer consumed so far (records with their 8-byte headers).
    let consumed = Arc::new(AtomicU64::new(0));
    let mut storage = MaybeUninit::uninit();
    let loaded = load(&mut storage, &config).and_then(|skel| {
        let handles = ReaderHandles {
            watched: map_handle(&skel.maps.watched, "watched")?,
            levels: map_handle(&skel.maps.data_levels, ".data.levels")?,
            lost: map_handle(&skel.maps.lost, "lost")?,
            written: map_handle(&skel.maps.written, "written")?,
            all_maps: skel.object().maps().map(|m| map_handle(&m, "any")).collect::<Result<_, _>>()?,
            programs: skel
                .object()
                .progs()
                // Programs of syscalls this kernel lacks were not loaded: no descriptor.
                .filter(|p| p.autoload())
                .map(|p| Ok((p.name().to_string_lossy().into_owned(), p.as_fd().try_clone_to_owned()?)))
                .collect::<Result<_, io::Error>>()
                .map_err(|e| InspectorError::Load(e.into()))?,
        };
        let mut builder = RingBufferBuilder::new();
        let sink = logs.clone();
        let counter = consumed.clone();
        builder
            .add(&skel.maps.events, move |bytes: &[u8]| {
                sink.on_record(bytes);
                counter.fetch_add(ring_record_bytes(bytes.len()), Ordering::Relaxed);
                0
            })
            .map_err(|source| InspectorError::Map { map: "events", source })?;
        let ring = builder.build().map_err(|source| InspectorError::Map { map: "events", source })?;
        Ok((skel, ring, handles))
    });
    if let Some(normal) = normal {
        // Back to the priority it was spawned with: records are drained without delay.
        set_thread_nice(normal);
    }
    let (mut skel, ring) = match loaded {
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
    // Flushes not yet answered, with the bytes consumed when each was asked.
    let mut flushes: Vec<(oneshot::Sender<()>, u64)> = Vec::new();
    let mut attachment = Attachment::default();
    loop {
        // SAFETY: fds is a valid array of two pollfd for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, READ_INTERVAL.as_millis() as i32) };
        if rc < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            tracing::error!(error = %io::Error::last_os_error(), "inspector poll failed");
            return;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            drain_eventfd(&wake);
        }
        // Consumed in batches, with the commands read between them: a flush
        // is answered once every record submitted before it was asked for is
        // in the logs: the ring was seen empty after it was asked for (a
        // batch came back short), or a whole ring's worth of bytes has been
        // consumed since (the records that were in the ring then are all
        // behind). A storm that keeps the ring full never holds a flush for
        // longer than one ring's worth of records.
        loop {
            let mut control = Vec::new();
            let stop = take_commands(&commands, &mut flushes, &mut control, consumed.load(Ordering::Relaxed));
            for command in control {
                match command {
                    Command::Attach(done) => {
                        let _ = done.send(attachment.attach(&mut skel));
                    }
                    Command::Detach(after) => attachment.detach_at = Some(Instant::now() + after),
                    Command::Flush(_) => unreachable!("take_commands keeps flushes apart"),
                }
            }
            if attachment.detach_at.is_some_and(|at| Instant::now() >= at) {
                attachment.detach();
            }
            let n = ring.consume_raw_n(CONSUME_BATCH);
            if n < 0 {
                tracing::error!(error = %io::Error::from_raw_os_error(-n), "consuming the inspector ring buffer failed");
            }
            let emptied = n < 0 || (n as usize) < CONSUME_BATCH;
            let now = consumed.load(Ordering::Relaxed);
            let (answered, waiting): (Vec<_>, Vec<_>) =
                flushes.drain(..).partition(|(_, asked_at)| emptied || now.saturating_sub(*asked_at) >= ring_bytes);
            flushes = waiting;
            for (done, _) in answered {
                // A waiter that gave up (timed out) is fine.
                let _ = done.send(());
            }
            if stop {
                tracing::info!("inspector reader stopping");
                return;
            }
            if emptied {
                break;
            }
        }
    }
}

/// The links of the attached programs, and the thread destroying the links of
/// the previous attachment (which takes a while: see the module's doc).
#[derive(Default)]
struct Attachment {
    links: Vec<libbpf_rs::Link>,
    detaching: Option<JoinHandle<()>>,
    /// When the links go, unless an attach comes first (the last unwatch's linger).
    detach_at: Option<Instant>,
}

impl Attachment {
    /// Attaches every loaded program, once the previous detach is over (a
    /// program attached twice would record each call twice).
    fn attach(&mut self, skel: &mut InspectorSkel<'_>) -> Result<Duration, InspectorError> {
        // Watched again within the linger: the links are still there.
        self.detach_at = None;
        if let Some(detaching) = self.detaching.take()
            && detaching.join().is_err()
        {
            tracing::error!("the inspector's detaching thread panicked");
        }
        let started = Instant::now();
        if !self.links.is_empty() {
            return Ok(Duration::ZERO);
        }
        for prog in skel.object_mut().progs_mut().filter(|p| p.autoload()) {
            match prog.attach() {
                Ok(link) => self.links.push(link),
                Err(error) => {
                    // All or nothing: a half-attached inspector would miss calls.
                    self.links.clear();
                    return Err(InspectorError::Load(error));
                }
            }
        }
        Ok(started.elapsed())
    }

    fn detach(&mut self) {
        self.detach_at = None;
        let links = std::mem::take(&mut self.links);
        if links.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new().name("crab-inspector-detach".into()).spawn(move || {
            let (started, programs) = (Instant::now(), links.len());
            drop(links);
            tracing::info!(programs, detach_ms = started.elapsed().as_secs_f64() * 1e3, "inspector programs detached");
        });
        match spawned {
            Ok(thread) => self.detaching = Some(thread),
            // The links went with the closure: detached, only not in the background.
            Err(error) => tracing::warn!(%error, "detached in the reader thread"),
        }
    }
}

/// Moves the waiting commands into `flushes` (asked when `consumed` bytes had
/// been consumed) and `control` (attach, detach: in order); true when the
/// inspector is gone and the reader must stop.
fn take_commands(
    commands: &mpsc::Receiver<Command>,
    flushes: &mut Vec<(oneshot::Sender<()>, u64)>,
    control: &mut Vec<Command>,
    consumed: u64,
) -> bool {
    loop {
        match commands.try_recv() {
            Ok(Command::Flush(done)) => flushes.push((done, consumed)),
            Ok(other) => control.push(other),
            Err(mpsc::TryRecvError::Empty) => return false,
            Err(mpsc::TryRecvError::Disconnected) => return true,
        }
    }
}

/// Bytes a record of `len` bytes takes in the ring buffer: an 8-byte header,
/// rounded up to 8 bytes.
fn ring_record_bytes(len: usize) -> u64 {
    ((len as u64) + 8).div_ceil(8) * 8
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
    let started = Instant::now();
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Info, libbpf_log)));
    let tracefs = tracefs::Tracefs::ensure_mounted()?;
    let mut open = InspectorSkelBuilder::default().open(storage).map_err(InspectorError::Load)?;
    // A syscall this kernel does not have (too old, or another architecture)
    // cannot be called either: its programs are simply not loaded.
    let mut skipped = Vec::new();
    let mut programs = 0;
    for mut prog in open.open_object_mut().progs_mut() {
        let section = prog.section().to_string_lossy().into_owned();
        let missing = tracefs::tracepoint_of_section(&section)
            .is_some_and(|(category, event)| !tracefs.has_event(category, event));
        if missing {
            prog.set_autoload(false);
            skipped.push(section);
        } else {
            programs += 1;
        }
    }
    open.maps
        .events
        .set_max_entries(config.ring_buffer_bytes)
        .map_err(|source| InspectorError::Map { map: "events", source })?;
    let skel = open.load().map_err(InspectorError::Load)?;
    tracing::info!(programs, ?skipped, load_ms = started.elapsed().as_millis() as u64, "inspector programs loaded");
    Ok(skel)
}

/// A numeric line (`key` includes the colon) of a BPF descriptor's fdinfo.
fn fdinfo_field(fd: i32, key: &str) -> Option<u64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    info.lines().find_map(|line| line.strip_prefix(key)).and_then(|v| v.trim().parse().ok())
}

/// Sends libbpf's messages (verifier logs on failure) to tracing.
fn libbpf_log(level: libbpf_rs::PrintLevel, message: String) {
    let message = message.trim_end();
    match level {
        libbpf_rs::PrintLevel::Warn => tracing::warn!(target: "libbpf", "{message}"),
        libbpf_rs::PrintLevel::Info => tracing::info!(target: "libbpf", "{message}"),
        libbpf_rs::PrintLevel::Debug => tracing::debug!(target: "libbpf", "{message}"),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn field(filter: &[u8], at: usize, len: usize) -> u64 {
        let mut bytes = [0u8; 8];
        bytes[..len].copy_from_slice(&filter[at..at + len]);
        u64::from_ne_bytes(bytes)
    }

    #[test]
    fn watch_filter_lists_the_watched_ids_while_they_fit() {
        let filter = watch_filter(&[(7, Some(2)), (9, Some(3))]);
        assert_eq!(field(&filter, WF_LEVELS, 4), (1 << 2) | (1 << 3));
        assert_eq!(field(&filter, WF_NR_IDS, 4), 2);
        assert_eq!((field(&filter, WF_IDS, 8), field(&filter, WF_IDS + 8, 8)), (7, 9));
        assert_eq!(field(&filter, WF_IDS + 16, 8), 0);
    }

    #[test]
    fn watch_filter_with_more_ids_than_fit_says_so_by_its_count() {
        let many: Vec<(u64, Option<u32>)> = (1..=WATCHED_IDS as u64 + 1).map(|id| (id, None)).collect();
        let filter = watch_filter(&many);
        assert_eq!(field(&filter, WF_LEVELS, 4), u64::from(LEVELS_UNKNOWN));
        assert_eq!(field(&filter, WF_NR_IDS, 4), WATCHED_IDS as u64 + 1);
        assert!(filter[WF_IDS..].iter().all(|b| *b == 0));
    }
}
