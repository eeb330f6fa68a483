//! Writes through descriptors, shared mappings and asynchronous I/O across turn boundaries.
//!
//! The kernel side reports the first write of a process to a file per turn
//! and remembers it in the `written` map (`struct write_key` ->
//! `struct write_seen` in `bpf/inspector.h`); the turn boundary it compares
//! against is the `epoch_ns` the reader sets at each drain. Two things only the
//! reader can settle:
//!
//! - Writes between a turn's end (`until_ns`) and the drain that sets the new
//!   boundary are still compared against the old one, so the kernel may skip
//!   them as repeats of a record that belongs to the turn before. It notes
//!   their time (`last_ns`); the drain finds them and carries the write into
//!   the next turn ([`WriteMemory::carry_over`]). Taking the time is most of
//!   the cost of a repeat, so the repeats of a process started in the turn of
//!   the record are only marked (`untimed`): the drain carries such a write
//!   over unless the process was gone by the cut ([`WriteMemory::gone_between`]),
//!   which a command run in the turn (the usual write loop) is.
//! - A shared mapping lets a process change a file with no syscall at all, in
//!   any later turn. The reader keeps the live mappings and, at each drain,
//!   reports those whose process used CPU since the previous drain. A
//!   submission-polling io_uring ring is the same: its kernel thread takes
//!   requests from memory.
//!
//! Asynchronous I/O calls (io_uring, AIO) share the kernel's dedup map with
//! writes, keyed by call instead of file ([`Channel::AsyncIo`]).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::effect::{AsyncIoCall, Effect, EffectKind, EffectPath, WriteVia};

/// Byte layout of `struct write_key` (checked against the skeleton's type in `layout.rs`).
pub(crate) const WRITE_KEY_LEN: usize = 16;
pub(crate) const WK_INODE: usize = 0;
pub(crate) const WK_PID: usize = 8;
pub(crate) const WK_CHANNEL: usize = 12;
/// Byte layout of `struct write_seen` (checked likewise).
pub(crate) const WRITE_SEEN_LEN: usize = 40;
pub(crate) const WS_RECORDED: usize = 0;
pub(crate) const WS_LAST: usize = 8;
pub(crate) const WS_CGROUP: usize = 16;
pub(crate) const WS_START: usize = 24;
pub(crate) const WS_UNTIMED: usize = 32;

/// What a dedup key counts (mirrors `enum write_channel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Channel {
    /// Writes through a descriptor.
    Descriptor,
    /// A shared mapping, which outlives the call.
    Mapping,
    /// Calls of one kind of asynchronous I/O; the key's `inode_key` is the call.
    AsyncIo,
}

impl Channel {
    fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            0 => Channel::Descriptor,
            1 => Channel::Mapping,
            2 => Channel::AsyncIo,
            _ => return None,
        })
    }
}

/// A process and a file it wrote (or an asynchronous I/O call it made), as
/// the kernel keys them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct WriteKey {
    pub inode_key: u64,
    pub pid: u32,
    pub channel: Channel,
}

impl WriteKey {
    pub fn of(effect: &Effect) -> Option<Self> {
        match effect.kind {
            EffectKind::Write { inode_key, via, .. } => Some(Self {
                inode_key,
                pid: effect.pid,
                channel: if via.is_mapping() { Channel::Mapping } else { Channel::Descriptor },
            }),
            EffectKind::AsyncIo { call, .. } if call != AsyncIoCall::EarlierPollingRing => {
                Some(Self { inode_key: call.raw(), pid: effect.pid, channel: Channel::AsyncIo })
            }
            _ => None,
        }
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != WRITE_KEY_LEN {
            return None;
        }
        Some(Self {
            inode_key: u64::from_ne_bytes(bytes[WK_INODE..WK_INODE + 8].try_into().ok()?),
            pid: u32::from_ne_bytes(bytes[WK_PID..WK_PID + 4].try_into().ok()?),
            channel: Channel::from_raw(u32::from_ne_bytes(bytes[WK_CHANNEL..WK_CHANNEL + 4].try_into().ok()?))?,
        })
    }
}

/// Decoded `struct write_seen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteSeen {
    pub recorded_ns: u64,
    pub last_ns: u64,
    pub cgroup_id: u64,
    /// Start time of the process that made the record.
    pub start_ns: u64,
    /// Written again after the record, at a time the kernel did not take.
    pub untimed: bool,
}

impl WriteSeen {
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != WRITE_SEEN_LEN {
            return None;
        }
        let at = |i: usize| bytes[i..i + 8].try_into().ok().map(u64::from_ne_bytes);
        let untimed = u32::from_ne_bytes(bytes[WS_UNTIMED..WS_UNTIMED + 4].try_into().ok()?);
        Some(Self {
            recorded_ns: at(WS_RECORDED)?,
            last_ns: at(WS_LAST)?,
            cgroup_id: at(WS_CGROUP)?,
            start_ns: at(WS_START)?,
            untimed: untimed != 0,
        })
    }
}

/// What the kernel's dedup entry of one key means at a drain up to `until_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeenAtDrain {
    /// Recorded after the cut: it dedups the next turn's writes rightly. Keep.
    NextTurn,
    /// Recorded up to the cut, nothing after: delete it so that the next
    /// turn's first write is recorded again.
    Stale,
    /// Recorded up to the cut, but written again after it without a record:
    /// the next turn wrote the file. Delete it and carry the write over.
    /// Also when a repeat had no time taken and the process may have run
    /// past the cut (then `at_ns` is just after the cut).
    SkippedAfterCut { at_ns: u64 },
}

/// `gone_by_cut`: the process that made the record had no thread left at
/// some point between the record and the cut (see [`WriteMemory::gone_between`]).
pub(crate) fn seen_at_drain(seen: &WriteSeen, until_ns: u64, gone_by_cut: bool) -> SeenAtDrain {
    if seen.recorded_ns > until_ns {
        SeenAtDrain::NextTurn
    } else if seen.last_ns > until_ns {
        SeenAtDrain::SkippedAfterCut { at_ns: seen.last_ns }
    } else if seen.untimed && !gone_by_cut {
        SeenAtDrain::SkippedAfterCut { at_ns: until_ns.saturating_add(1) }
    } else {
        SeenAtDrain::Stale
    }
}

/// Key of a live polling io_uring ring among the mappings: no inode has address 0.
const RING_KEY: u64 = 0;

/// A shared mapping of a file a process may still be storing through, or a
/// polling io_uring ring it may still be submitting through.
#[derive(Debug, Clone)]
struct LiveMapping {
    /// The record that reported it (path, inode, process).
    effect: Effect,
    /// CPU time of the process at the previous drain; None before the first.
    cpu_ns_at_drain: Option<u64>,
}

/// Per container: the latest write record per key, and the live shared mappings.
#[derive(Debug, Default)]
pub(crate) struct WriteMemory {
    latest: HashMap<WriteKey, Effect>,
    mappings: HashMap<(u32, u64), LiveMapping>,
    /// Time of the latest exit, with no thread left, of each pid.
    gone: HashMap<u32, u64>,
}

impl WriteMemory {
    /// Follows a decoded effect: remembers writes and mappings, and the
    /// processes that inherit or drop mappings.
    pub fn observe(&mut self, effect: &Effect) {
        match &effect.kind {
            EffectKind::AsyncIo { call, polling_ring } => {
                if let Some(key) = WriteKey::of(effect) {
                    self.latest.insert(key, effect.clone());
                }
                // The ring's kernel thread takes submissions with no syscall
                // for as long as the process keeps it (its descriptor is
                // close-on-exec, so until exec or exit).
                if *call == AsyncIoCall::IoUringSetup && *polling_ring {
                    self.mappings
                        .entry((effect.pid, RING_KEY))
                        .or_insert_with(|| LiveMapping { effect: effect.clone(), cpu_ns_at_drain: None });
                }
            }
            EffectKind::Write { via, inode_key, .. } => {
                if let Some(key) = WriteKey::of(effect) {
                    self.latest.insert(key, effect.clone());
                }
                if *via == WriteVia::SharedMapping {
                    self.mappings
                        .entry((effect.pid, *inode_key))
                        .or_insert_with(|| LiveMapping { effect: effect.clone(), cpu_ns_at_drain: None });
                }
            }
            // A forked child shares its parent's MAP_SHARED mappings.
            EffectKind::Fork { child, .. } => {
                let inherited: Vec<LiveMapping> = self
                    .mappings
                    .iter()
                    .filter(|((pid, _), _)| *pid == effect.pid)
                    .map(|(_, mapping)| {
                        let mut effect = mapping.effect.clone();
                        effect.pid = *child;
                        effect.tid = *child;
                        LiveMapping { effect, cpu_ns_at_drain: None }
                    })
                    .collect();
                for mapping in inherited {
                    let key = (*child, write_inode(&mapping.effect));
                    self.mappings.insert(key, mapping);
                }
            }
            // execve replaces the address space.
            EffectKind::Exec { .. } => self.mappings.retain(|(pid, _), _| *pid != effect.pid),
            // The latest writes stay until the drain that deletes their kernel
            // entries (`keep_only`): a write carried over past the cut still
            // names its file when the process exited before that drain.
            EffectKind::Exit { .. } => self.mappings.retain(|(pid, _), _| *pid != effect.pid),
            _ => {}
        }
    }

    /// Follows the exit of the last thread of process `pid` at `time_ns`.
    pub fn observe_gone(&mut self, pid: u32, time_ns: u64) {
        self.gone.insert(pid, time_ns);
    }

    /// True when process `pid` had no thread left at some time in
    /// `(after_ns, until_ns]`. A pid is used again only once its process is
    /// gone, so an exit of the pid after a record of its process means that
    /// process is gone, even if a later one has the pid now.
    pub fn gone_between(&self, pid: u32, after_ns: u64, until_ns: u64) -> bool {
        self.gone.get(&pid).is_some_and(|&t| t > after_ns && t <= until_ns)
    }

    /// Forgets exits up to `until_ns`: the drain up to there has judged every
    /// record they could bear on (later ones are younger than the cut).
    pub fn forget_gone_until(&mut self, until_ns: u64) {
        self.gone.retain(|_, t| *t > until_ns);
    }

    /// Follows an open for writing that the kernel took as the record of the
    /// writes through its descriptor (`inode_key`, see `Record::opened_inode`).
    pub fn observe_open(&mut self, effect: &Effect, inode_key: u64) {
        let EffectKind::Open { path, .. } = &effect.kind else {
            return;
        };
        let as_write = Effect {
            kind: EffectKind::Write { path: path.clone(), via: WriteVia::Write, inode_key, ino: 0 },
            ..effect.clone()
        };
        let key = WriteKey { inode_key, pid: effect.pid, channel: Channel::Descriptor };
        self.latest.insert(key, as_write);
    }

    /// The write effect to put in the next turn for a write the kernel skipped
    /// after the cut. Without the record it repeats (lost or undecodable), the
    /// file is unknown: an unresolved path, which escalates.
    pub fn carry_over(&self, key: &WriteKey, at_ns: u64) -> Effect {
        match self.latest.get(key) {
            Some(recorded) => Effect { time_ns: at_ns, ..recorded.clone() },
            None => {
                let unresolved = EffectPath { path: PathBuf::new(), resolved: false, fs_type: None };
                let kind = match key.channel {
                    Channel::Descriptor | Channel::Mapping => EffectKind::Write {
                        path: unresolved,
                        via: if key.channel == Channel::Mapping { WriteVia::SharedMapping } else { WriteVia::Write },
                        inode_key: key.inode_key,
                        ino: 0,
                    },
                    // The kernel keys only the calls it knows.
                    Channel::AsyncIo => EffectKind::AsyncIo {
                        call: AsyncIoCall::from_raw(key.inode_key).unwrap_or(AsyncIoCall::IoUringEnter),
                        polling_ring: false,
                    },
                };
                Effect { time_ns: at_ns, pid: key.pid, tid: key.pid, comm: String::new(), result: 0, kind }
            }
        }
    }

    /// Forgets write records whose kernel entry is gone (deleted at a drain or evicted).
    pub fn keep_only(&mut self, live: &HashSet<WriteKey>) {
        self.latest.retain(|key, _| live.contains(key));
    }

    /// Writes through shared mappings of earlier turns whose processes ran
    /// since the previous drain, for the turn up to `until_ns` and, because
    /// the process may also have run after that cut, for the next turn
    /// (`now_ns`). Mappings that are gone are forgotten.
    pub fn mapped_writes(&mut self, until_ns: u64, now_ns: u64, probe: &dyn ProcessProbe) -> Vec<Effect> {
        let mut effects = Vec::new();
        self.mappings.retain(|(pid, _), mapping| {
            let Some(cpu_ns) = probe.cpu_ns(*pid) else {
                return false; // the process is gone
            };
            if let EffectKind::Write { ino, .. } = mapping.effect.kind
                && probe.maps_shared(*pid, ino) == Some(false)
            {
                return false;
            }
            if mapping.cpu_ns_at_drain.is_some_and(|before| before != cpu_ns) {
                for time_ns in [until_ns, now_ns] {
                    let mut effect = mapping.effect.clone();
                    effect.time_ns = time_ns;
                    match &mut effect.kind {
                        EffectKind::Write { via, .. } => *via = WriteVia::EarlierSharedMapping,
                        EffectKind::AsyncIo { call, .. } => *call = AsyncIoCall::EarlierPollingRing,
                        _ => {}
                    }
                    effects.push(effect);
                }
            }
            mapping.cpu_ns_at_drain = Some(cpu_ns);
            true
        });
        effects
    }
}

fn write_inode(effect: &Effect) -> u64 {
    match effect.kind {
        EffectKind::Write { inode_key, .. } => inode_key,
        _ => 0,
    }
}

/// What the reader asks the host about a process with a shared mapping.
pub(crate) trait ProcessProbe {
    /// CPU time of all threads of `pid` (ns), None when it is gone.
    fn cpu_ns(&self, pid: u32) -> Option<u64>;
    /// Whether `pid` still has a shared mapping of inode number `ino`; None
    /// when that cannot be told (then the mapping is kept).
    fn maps_shared(&self, pid: u32, ino: u64) -> Option<bool>;
}

/// Reads `/proc` (host pid namespace).
pub(crate) struct ProcFs;

impl ProcessProbe for ProcFs {
    fn cpu_ns(&self, pid: u32) -> Option<u64> {
        // Per thread: /proc/PID/schedstat covers the main thread only.
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        let mut total = 0u64;
        for task in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
                continue; // the thread just ended
            };
            total += text.split_whitespace().next()?.parse::<u64>().ok()?;
        }
        Some(total)
    }

    fn maps_shared(&self, pid: u32, ino: u64) -> Option<bool> {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
        Some(maps_has_shared_inode(&maps, ino))
    }
}

/// True when a `/proc/PID/maps` text has a shared mapping of inode `ino`.
fn maps_has_shared_inode(maps: &str, ino: u64) -> bool {
    maps.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let perms = fields.nth(1).unwrap_or("");
        let inode = fields.nth(2).and_then(|f| f.parse::<u64>().ok());
        perms.ends_with('s') && inode == Some(ino)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn write(pid: u32, inode_key: u64, via: WriteVia, time_ns: u64) -> Effect {
        Effect {
            time_ns,
            pid,
            tid: pid,
            comm: "nginx".into(),
            result: 0,
            kind: EffectKind::Write {
                path: EffectPath::resolved("/var/log/nginx/access.log"),
                via,
                inode_key,
                ino: 12,
            },
        }
    }

    fn process(pid: u32, kind: EffectKind) -> Effect {
        Effect::of_shell(pid, kind)
    }

    #[test]
    fn key_and_seen_decode_the_kernel_layout() {
        let mut key = Vec::new();
        key.extend_from_slice(&0xffff_8880_0000_1000u64.to_ne_bytes());
        key.extend_from_slice(&42u32.to_ne_bytes());
        key.extend_from_slice(&1u32.to_ne_bytes());
        assert_eq!(
            WriteKey::from_bytes(&key),
            Some(WriteKey { inode_key: 0xffff_8880_0000_1000, pid: 42, channel: Channel::Mapping })
        );
        assert_eq!(WriteKey::from_bytes(&key[..15]), None);
        let mut seen: Vec<u8> = [5u64, 9, 7, 3].iter().flat_map(|v| v.to_ne_bytes()).collect();
        seen.extend_from_slice(&1u32.to_ne_bytes());
        seen.extend_from_slice(&0u32.to_ne_bytes());
        assert_eq!(
            WriteSeen::from_bytes(&seen),
            Some(WriteSeen { recorded_ns: 5, last_ns: 9, cgroup_id: 7, start_ns: 3, untimed: true })
        );
        assert_eq!(WriteSeen::from_bytes(&seen[..24]), None);
    }

    #[test]
    fn a_write_skipped_after_the_cut_is_carried_over() {
        let seen = |recorded_ns, last_ns| WriteSeen { recorded_ns, last_ns, cgroup_id: 1, start_ns: 0, untimed: false };
        for gone in [false, true] {
            assert_eq!(seen_at_drain(&seen(150, 160), 100, gone), SeenAtDrain::NextTurn);
            assert_eq!(seen_at_drain(&seen(50, 100), 100, gone), SeenAtDrain::Stale);
            assert_eq!(seen_at_drain(&seen(50, 130), 100, gone), SeenAtDrain::SkippedAfterCut { at_ns: 130 });
        }

        let mut memory = WriteMemory::default();
        memory.observe(&write(7, 0xa0, WriteVia::Write, 50));
        let key = WriteKey { inode_key: 0xa0, pid: 7, channel: Channel::Descriptor };
        let carried = memory.carry_over(&key, 130);
        assert_eq!(carried, write(7, 0xa0, WriteVia::Write, 130));
        // An open for writing stands for the writes through its descriptor.
        let open = Effect {
            kind: EffectKind::Open { path: EffectPath::resolved("/app/out.log"), flags: 0o1101, mode: 0o644 },
            ..write(9, 0xb0, WriteVia::Write, 60)
        };
        memory.observe_open(&open, 0xb0);
        let from_open = memory.carry_over(&WriteKey { inode_key: 0xb0, pid: 9, channel: Channel::Descriptor }, 140);
        assert_eq!(from_open.time_ns, 140);
        assert!(matches!(&from_open.kind, EffectKind::Write { path, via: WriteVia::Write, .. }
            if path == &EffectPath::resolved("/app/out.log")));
        // The process exited after the cut, before the drain: still named.
        memory.observe(&process(7, EffectKind::Exit { status: 0 }));
        assert_eq!(memory.carry_over(&key, 130), write(7, 0xa0, WriteVia::Write, 130));
        // Without the record, the file is unknown: the carried write escalates.
        memory.keep_only(&HashSet::new());
        assert!(memory.carry_over(&key, 130).has_unresolved_path());
    }

    /// Repeats without a time (a process started in the turn) are carried into
    /// the next turn unless the process was gone by the cut.
    #[test]
    fn an_untimed_repeat_is_carried_over_unless_its_process_was_gone() {
        let untimed =
            |recorded_ns| WriteSeen { recorded_ns, last_ns: recorded_ns, cgroup_id: 1, start_ns: 40, untimed: true };
        assert_eq!(seen_at_drain(&untimed(50), 100, false), SeenAtDrain::SkippedAfterCut { at_ns: 101 });
        assert_eq!(seen_at_drain(&untimed(50), 100, true), SeenAtDrain::Stale);
        assert_eq!(seen_at_drain(&untimed(150), 100, false), SeenAtDrain::NextTurn);

        let mut memory = WriteMemory::default();
        memory.observe_gone(7, 90);
        // Gone between the record and the cut.
        assert!(memory.gone_between(7, 50, 100));
        // The exit was before the record: it was an earlier process with the pid.
        assert!(!memory.gone_between(7, 95, 100));
        // Gone only after the cut: it may have written after the cut.
        assert!(!memory.gone_between(7, 50, 80));
        assert!(!memory.gone_between(8, 50, 100));
        memory.forget_gone_until(100);
        assert!(!memory.gone_between(7, 50, 100));
        memory.observe_gone(7, 120);
        memory.forget_gone_until(100);
        assert!(memory.gone_between(7, 110, 130));
    }

    /// A probe with scripted answers.
    #[derive(Default)]
    struct FakeProbe {
        cpu: RefCell<HashMap<u32, u64>>,
        unmapped: HashSet<u32>,
    }

    impl ProcessProbe for FakeProbe {
        fn cpu_ns(&self, pid: u32) -> Option<u64> {
            self.cpu.borrow().get(&pid).copied()
        }
        fn maps_shared(&self, pid: u32, _ino: u64) -> Option<bool> {
            Some(!self.unmapped.contains(&pid))
        }
    }

    #[test]
    fn a_mapping_counts_in_later_turns_only_when_its_process_ran() {
        let mut memory = WriteMemory::default();
        memory.observe(&write(7, 0xa0, WriteVia::SharedMapping, 10));
        let probe = FakeProbe::default();
        probe.cpu.borrow_mut().insert(7, 1000);
        // The turn that mapped it reports the mmap itself; this drain sets the baseline.
        assert!(memory.mapped_writes(100, 110, &probe).is_empty());
        // Idle since: nothing.
        assert!(memory.mapped_writes(200, 210, &probe).is_empty());
        // Ran: this turn and the next one (it may have run after the cut).
        probe.cpu.borrow_mut().insert(7, 1500);
        let effects = memory.mapped_writes(300, 310, &probe);
        let times: Vec<u64> = effects.iter().map(|e| e.time_ns).collect();
        assert_eq!(times, vec![300, 310]);
        assert!(
            effects.iter().all(|e| matches!(e.kind, EffectKind::Write { via: WriteVia::EarlierSharedMapping, .. }))
        );
        // Gone: forgotten.
        probe.cpu.borrow_mut().remove(&7);
        assert!(memory.mapped_writes(400, 410, &probe).is_empty());
        probe.cpu.borrow_mut().insert(7, 9999);
        assert!(memory.mapped_writes(500, 510, &probe).is_empty());
    }

    #[test]
    fn children_inherit_mappings_and_exec_drops_them() {
        let mut memory = WriteMemory::default();
        memory.observe(&write(7, 0xa0, WriteVia::SharedMapping, 10));
        memory.observe(&process(7, EffectKind::Fork { child: 8, in_namespace: None }));
        memory.observe(&process(
            7,
            EffectKind::Exec { path: EffectPath::resolved("/bin/true"), filename: "true".into() },
        ));
        let probe = FakeProbe::default();
        probe.cpu.borrow_mut().extend([(7, 1), (8, 1)]);
        memory.mapped_writes(100, 110, &probe);
        probe.cpu.borrow_mut().extend([(7, 2), (8, 2)]);
        let pids: Vec<u32> = memory.mapped_writes(200, 210, &probe).iter().map(|e| e.pid).collect();
        assert_eq!(pids, vec![8, 8]);
    }

    #[test]
    fn an_unmapped_file_is_forgotten() {
        let mut memory = WriteMemory::default();
        memory.observe(&write(7, 0xa0, WriteVia::SharedMapping, 10));
        let mut probe = FakeProbe::default();
        probe.cpu.borrow_mut().insert(7, 1);
        memory.mapped_writes(100, 110, &probe);
        probe.unmapped.insert(7);
        probe.cpu.borrow_mut().insert(7, 2);
        assert!(memory.mapped_writes(200, 210, &probe).is_empty());
    }

    #[test]
    fn maps_lines_match_shared_mappings_by_inode() {
        let maps = "7f00-7f01 rw-s 00000000 00:2a 12 /app/data.bin\n\
                    7f02-7f03 r--p 00000000 00:2a 13 /usr/lib/x.so\n";
        assert!(maps_has_shared_inode(maps, 12));
        assert!(!maps_has_shared_inode(maps, 13));
        assert!(!maps_has_shared_inode(maps, 14));
    }
}
