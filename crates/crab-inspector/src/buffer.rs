//! A container's effects between two drains, bounded in bytes.
//!
//! A process in a sandbox decides how many records it makes: a loop of
//! `renameat2` makes hundreds of thousands a second. What the buffer holds is
//! therefore bounded by the bytes it takes in memory, not by a count:
//!
//! - **Repeats cost nothing.** An effect equal to one held (same process,
//!   thread, name, result and kind with the same paths; only the time
//!   differs) is folded into it: the held entry keeps the first and the last
//!   time it happened and how often. A storm of renames among a few names stays
//!   a few entries. Classification and the changed paths depend only on the set
//!   of distinct effects, never on their number.
//! - **Byte accounting** counts what the buffer holds: the entries' slots
//!   (allocated capacity, not only the used part), the heap bytes of their
//!   strings and paths, and the dedup index.
//! - **Overflow.** File effects may fill the buffer up to 7/8 of its bound;
//!   beyond it their details are no longer kept and the turn is marked
//!   [`Overflow`] (the caller then captures the whole rootfs diff: the class
//!   stays what the kept effects and the cut say, never cleaner). Process,
//!   socket and mount effects keep the last eighth, so that a file storm does
//!   not hide that a process outlived the turn; when even those no longer fit,
//!   the overflow says so (`processes_cut`) and the turn is a process turn.
//!   Nothing is kept of an effect that does not fit, only its count and the
//!   bytes it would have taken.
//!
//! Drains cut by time ([`EffectBuffer::take_until`]): an entry whose first
//! occurrence is at or before the cut goes to the turn; when it happened again
//! after the cut it also stays for the next turn. The overflow mark is cut the
//! same way, so it is reset at the end of the turn it belongs to.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};
use std::mem::size_of;

use super::effect::{Effect, EffectKind, SockAddr};

/// What a turn's effects lost to the buffer's bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Overflow {
    /// Records whose details were not kept.
    pub events: u64,
    /// Bytes they would have taken in the buffer (for records dropped before
    /// decoding: their size in the ring buffer).
    pub bytes: u64,
    /// Process, socket or mount effects were cut too: the process state of
    /// the turn is unknown.
    pub processes_cut: bool,
}

impl std::fmt::Display for Overflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "effects overflowed: {} events, {} bytes", self.events, self.bytes)?;
        if self.processes_cut {
            write!(f, " (process effects among them)")?;
        }
        Ok(())
    }
}

/// An overflow and the times of the first and last record it dropped.
#[derive(Debug, Clone, Copy)]
struct OverflowSpan {
    overflow: Overflow,
    first_ns: u64,
    last_ns: u64,
}

/// A distinct effect and when it happened.
#[derive(Debug)]
struct Held {
    /// `time_ns` is the first occurrence not yet taken.
    effect: Effect,
    last_ns: u64,
    count: u64,
    /// Key of the dedup index.
    hash: u64,
    /// Heap bytes of the effect's strings and paths.
    heap: usize,
}

/// Bytes of one slot of the dedup index: its (hash, index) pair plus
/// hashbrown's control byte, rounded up for its load factor.
const INDEX_SLOT_BYTES: usize = 24;

/// The effects of one container since its last drain.
#[derive(Debug)]
pub(crate) struct EffectBuffer {
    limit_bytes: usize,
    entries: Vec<Held>,
    /// Hash of an entry's identity -> its index. A hash shared by two
    /// different effects (SipHash with a random key: practically never) only
    /// costs the second its dedup.
    index: HashMap<u64, usize>,
    hasher: RandomState,
    heap_bytes: usize,
    overflow: Option<OverflowSpan>,
    /// Records folded into held entries since the buffer was made.
    folded: u64,
}

impl EffectBuffer {
    pub fn new(limit_bytes: usize) -> Self {
        Self {
            limit_bytes,
            entries: Vec::new(),
            index: HashMap::new(),
            hasher: RandomState::new(),
            heap_bytes: 0,
            overflow: None,
            folded: 0,
        }
    }

    /// Bytes held now (see the module's accounting).
    pub fn held_bytes(&self) -> usize {
        self.heap_bytes + self.entries.capacity() * size_of::<Held>() + self.index.capacity() * INDEX_SLOT_BYTES
    }

    /// Distinct effects held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True once file effects are no longer kept (until the drain that takes
    /// the turn the cut belongs to).
    pub fn files_cut(&self) -> bool {
        self.overflow.is_some()
    }

    /// Adds an effect, folds it into an equal one held, or (over the bound)
    /// counts it in the overflow.
    pub fn push(&mut self, effect: Effect) {
        let hash = self.identity_hash(&effect);
        if let Some(&i) = self.index.get(&hash)
            && let Some(held) = self.entries.get_mut(i)
            && same_identity(&held.effect, &effect)
        {
            held.effect.time_ns = held.effect.time_ns.min(effect.time_ns);
            held.last_ns = held.last_ns.max(effect.time_ns);
            held.count += 1;
            self.folded += 1;
            return;
        }
        let heap = heap_bytes(&effect);
        let file = is_file_effect(&effect.kind);
        let limit = if file { self.limit_bytes - self.limit_bytes / 8 } else { self.limit_bytes };
        let held = self.held_bytes();
        let slot = if self.entries.len() == self.entries.capacity() { size_of::<Held>() } else { 0 };
        // Once file details are cut they stay cut until the turn is drained:
        // a later smaller one must not make the kept set look complete.
        if (file && self.overflow.is_some()) || held + heap + slot > limit {
            self.note_dropped(effect.time_ns, (heap + size_of::<Held>() + INDEX_SLOT_BYTES) as u64, !file);
            return;
        }
        if slot > 0 {
            // Grown by hand: doubling a large vector near the bound would
            // take more than the bound has left (the process effects' last
            // eighth included). Up to doubling while there is room, else by
            // what is left.
            let room_slots = (limit - held - heap) / size_of::<Held>();
            self.entries.reserve_exact(self.entries.capacity().max(4).min(room_slots).max(1));
        }
        let time_ns = effect.time_ns;
        self.entries.push(Held { effect, last_ns: time_ns, count: 1, hash, heap });
        self.heap_bytes += heap;
        // The index grows by doubling too: when that does not fit, the entry
        // is kept unindexed (its repeats are then kept as entries of their own).
        let index_growth = if self.index.len() == self.index.capacity() {
            // hashbrown doubles its buckets (3, 7, 14, 28, ... items).
            (self.index.capacity() + 4) * INDEX_SLOT_BYTES
        } else {
            0
        };
        if self.held_bytes() + index_growth <= limit {
            self.index.insert(hash, self.entries.len() - 1);
        }
    }

    /// Counts a record dropped without its details (over the bound, or
    /// skipped undecoded once file effects are cut).
    pub fn note_dropped(&mut self, time_ns: u64, bytes: u64, process: bool) {
        let span = self.overflow.get_or_insert(OverflowSpan {
            overflow: Overflow::default(),
            first_ns: time_ns,
            last_ns: time_ns,
        });
        span.overflow.events += 1;
        span.overflow.bytes += bytes;
        span.overflow.processes_cut |= process;
        span.first_ns = span.first_ns.min(time_ns);
        span.last_ns = span.last_ns.max(time_ns);
    }

    /// Takes the effects that happened at or before `until_ns`, one per
    /// distinct effect (at the time of its latest occurrence up to the cut
    /// when known, else its first), and the overflow of that part. What
    /// happened after the cut stays.
    pub fn take_until(&mut self, until_ns: u64) -> (Vec<Effect>, Option<Overflow>) {
        let mut taken = Vec::new();
        let mut kept = Vec::new();
        for mut held in std::mem::take(&mut self.entries) {
            if held.effect.time_ns > until_ns {
                kept.push(held);
                continue;
            }
            if held.last_ns <= until_ns {
                held.effect.time_ns = held.last_ns;
                taken.push(held.effect);
            } else {
                // Happened on both sides of the cut: in both turns.
                taken.push(held.effect.clone());
                held.effect.time_ns = held.last_ns;
                kept.push(held);
            }
        }
        self.entries = kept;
        self.entries.shrink_to(self.entries.len() * 2);
        self.index = HashMap::with_capacity(self.entries.len());
        self.heap_bytes = 0;
        for (i, held) in self.entries.iter().enumerate() {
            self.index.insert(held.hash, i);
            self.heap_bytes += held.heap;
        }
        let overflow = match self.overflow {
            Some(span) if span.first_ns <= until_ns => {
                // Records dropped after the cut belong to the next turn, which is cut too.
                self.overflow = (span.last_ns > until_ns).then_some(OverflowSpan { first_ns: span.last_ns, ..span });
                Some(span.overflow)
            }
            _ => None,
        };
        (taken, overflow)
    }

    /// Takes everything (the container is no longer watched).
    pub fn take_all(&mut self) -> (Vec<Effect>, Option<Overflow>) {
        self.take_until(u64::MAX)
    }

    /// Records folded into an earlier equal one since the buffer was made.
    pub fn folded(&self) -> u64 {
        self.folded
    }

    fn identity_hash(&self, effect: &Effect) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        effect.pid.hash(&mut hasher);
        effect.tid.hash(&mut hasher);
        effect.comm.hash(&mut hasher);
        effect.result.hash(&mut hasher);
        effect.kind.hash(&mut hasher);
        hasher.finish()
    }
}

/// Equal but for the time.
fn same_identity(a: &Effect, b: &Effect) -> bool {
    a.pid == b.pid && a.tid == b.tid && a.result == b.result && a.comm == b.comm && a.kind == b.kind
}

/// Effects that only say a file changed: cut first (the whole rootfs diff
/// stands for them). Everything else tells about processes, sockets or mounts.
pub(crate) fn is_file_effect(kind: &EffectKind) -> bool {
    matches!(
        kind,
        EffectKind::Open { .. }
            | EffectKind::Truncate { .. }
            | EffectKind::Unlink { .. }
            | EffectKind::Rmdir { .. }
            | EffectKind::Rename { .. }
            | EffectKind::Mkdir { .. }
            | EffectKind::Link { .. }
            | EffectKind::Symlink { .. }
            | EffectKind::Chmod { .. }
            | EffectKind::Chown { .. }
            | EffectKind::SetXattr { .. }
            | EffectKind::RemoveXattr { .. }
            | EffectKind::Mknod { .. }
            | EffectKind::Utimes { .. }
            | EffectKind::Write { .. }
    )
}

/// Heap bytes an effect holds: its strings and paths, by allocated capacity.
fn heap_bytes(effect: &Effect) -> usize {
    let paths: usize =
        effect.kind.paths().iter().map(|p| p.path.capacity() + p.fs_type.as_ref().map_or(0, String::capacity)).sum();
    let strings = match &effect.kind {
        EffectKind::Symlink { target, .. } => target.capacity(),
        EffectKind::SetXattr { name, .. } | EffectKind::RemoveXattr { name, .. } => name.capacity(),
        EffectKind::Mount { source, fs_type, .. } => source.capacity() + fs_type.capacity(),
        EffectKind::Exec { filename, .. } => filename.capacity(),
        EffectKind::Bind { addr } | EffectKind::Listen { addr, .. } | EffectKind::Connect { addr } => match addr {
            SockAddr::UnixAbstract(name) => name.capacity(),
            // A named socket's path is among `paths()` for bind and connect, not for listen.
            SockAddr::Unix(path) if matches!(effect.kind, EffectKind::Listen { .. }) => path.path.capacity(),
            _ => 0,
        },
        _ => 0,
    };
    effect.comm.capacity() + paths + strings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effect::EffectPath;

    fn rename(pid: u32, time_ns: u64, from: &str, to: &str) -> Effect {
        Effect {
            time_ns,
            ..Effect::of_shell(
                pid,
                EffectKind::Rename { from: EffectPath::resolved(from), to: EffectPath::resolved(to), flags: 0 },
            )
        }
    }

    fn fork(pid: u32, time_ns: u64, child: u32) -> Effect {
        Effect { time_ns, ..Effect::of_shell(pid, EffectKind::Fork { child, in_namespace: None }) }
    }

    #[test]
    fn a_storm_of_renames_among_few_names_stays_a_few_entries() {
        let mut buffer = EffectBuffer::new(64 << 10);
        for i in 0..1_000_000u64 {
            let (from, to) = if i % 2 == 0 { ("/app/a", "/app/b") } else { ("/app/b", "/app/a") };
            buffer.push(rename(7, i, from, to));
        }
        assert_eq!(buffer.len(), 2);
        assert_eq!(buffer.folded(), 999_998);
        assert!(buffer.held_bytes() < 2048, "{} bytes held", buffer.held_bytes());
        assert!(!buffer.files_cut());
        let (taken, overflow) = buffer.take_until(u64::MAX);
        assert_eq!(overflow, None);
        assert_eq!(taken.len(), 2);
        // Each at its latest occurrence.
        let mut times: Vec<u64> = taken.iter().map(|e| e.time_ns).collect();
        times.sort_unstable();
        assert_eq!(times, vec![999_998, 999_999]);
    }

    #[test]
    fn the_same_rename_by_other_processes_is_kept_for_each() {
        let mut buffer = EffectBuffer::new(64 << 10);
        buffer.push(rename(1, 1, "/a", "/b"));
        buffer.push(rename(2, 2, "/a", "/b"));
        buffer.push(rename(1, 3, "/a", "/c"));
        buffer.push(rename(1, 4, "/a", "/b"));
        assert_eq!(buffer.len(), 3);
        assert_eq!(buffer.folded(), 1);
    }

    #[test]
    fn bytes_held_count_paths_slots_and_index_and_stay_under_the_bound() {
        let limit = 256 << 10;
        let mut buffer = EffectBuffer::new(limit);
        let long = "n".repeat(200);
        buffer.push(rename(1, 1, &format!("/app/{long}0"), &format!("/app/{long}1")));
        // Two paths of ~205 bytes, the comm, one slot and one index slot at least.
        let one = buffer.held_bytes();
        assert!(one >= 410 + size_of::<Held>() + INDEX_SLOT_BYTES, "{one}");
        let mut i = 1u64;
        while !buffer.files_cut() {
            i += 1;
            buffer.push(rename(1, i, &format!("/app/{long}{i}"), &format!("/app/{long}{}", i + 1)));
            assert!(buffer.held_bytes() <= limit - limit / 8, "{} bytes held after {i} records", buffer.held_bytes());
        }
        let kept = buffer.len() as u64;
        assert!(kept > 200, "only {kept} renames fit in {limit} bytes");
        // The entries' heap alone is what the paths take.
        let heap: usize = buffer.entries.iter().map(|h| h.heap).sum();
        assert_eq!(heap, buffer.heap_bytes);
        // Further records only count.
        for j in 0..10_000u64 {
            buffer.push(rename(1, i + 1 + j, &format!("/app/{long}x{j}"), "/app/y"));
        }
        assert!(buffer.held_bytes() <= limit - limit / 8);
        let (taken, overflow) = buffer.take_until(u64::MAX);
        let overflow = overflow.expect("an overflow");
        assert_eq!(taken.len() as u64, kept);
        assert_eq!(overflow.events, 10_001);
        assert!(overflow.bytes > 10_001 * 200, "{overflow:?}");
        assert!(!overflow.processes_cut);
        assert_eq!(overflow.to_string(), format!("effects overflowed: 10001 events, {} bytes", overflow.bytes));
    }

    #[test]
    fn process_effects_keep_the_last_eighth_after_files_are_cut() {
        let limit = 64 << 10;
        let mut buffer = EffectBuffer::new(limit);
        let mut t = 0;
        while !buffer.files_cut() {
            t += 1;
            buffer.push(rename(1, t, &format!("/app/{t:0>100}"), "/app/z"));
        }
        // A fork after the cut is still kept.
        buffer.push(fork(1, t + 1, 99));
        assert!(buffer.entries.iter().any(|h| matches!(h.effect.kind, EffectKind::Fork { child: 99, .. })));
        // A later file effect is not, even a small one that would fit.
        let before = buffer.len();
        buffer.push(rename(1, t + 2, "/s", "/t"));
        assert_eq!(buffer.len(), before);
        // Forks until even they do not fit: the cut then covers processes.
        let mut child = 100;
        while buffer.held_bytes() + 512 < limit {
            buffer.push(fork(1, t + 3, child));
            child += 1;
        }
        for c in 0..1000 {
            buffer.push(fork(1, t + 4, child + c));
        }
        assert!(buffer.held_bytes() <= limit, "{} held", buffer.held_bytes());
        let (_, overflow) = buffer.take_until(u64::MAX);
        assert!(overflow.expect("overflow").processes_cut);
    }

    #[test]
    fn the_cut_splits_effects_and_the_overflow_by_time_and_resets_it() {
        let mut buffer = EffectBuffer::new(4096);
        buffer.push(rename(1, 10, "/a", "/b"));
        buffer.push(rename(1, 30, "/a", "/b")); // before and after the cut at 20
        buffer.push(rename(1, 15, "/c", "/d")); // before only
        buffer.push(rename(1, 25, "/e", "/f")); // after only
        let (taken, overflow) = buffer.take_until(20);
        assert_eq!(overflow, None);
        let mut got: Vec<(String, u64)> =
            taken.iter().map(|e| (e.kind.paths()[0].path.display().to_string(), e.time_ns)).collect();
        got.sort();
        assert_eq!(got, vec![("/a".to_string(), 10), ("/c".to_string(), 15)]);
        let (rest, _) = buffer.take_until(u64::MAX);
        let mut got: Vec<(String, u64)> =
            rest.iter().map(|e| (e.kind.paths()[0].path.display().to_string(), e.time_ns)).collect();
        got.sort();
        assert_eq!(got, vec![("/a".to_string(), 30), ("/e".to_string(), 25)]);

        // An overflow before the cut is that turn's only; one spanning the cut is in both.
        buffer.note_dropped(5, 100, false);
        let (_, overflow) = buffer.take_until(6);
        assert_eq!(overflow, Some(Overflow { events: 1, bytes: 100, processes_cut: false }));
        assert!(!buffer.files_cut(), "reset at the end of its turn");
        assert_eq!(buffer.take_until(100).1, None);
        buffer.note_dropped(200, 100, false);
        buffer.note_dropped(300, 100, true);
        assert!(buffer.files_cut());
        assert!(buffer.take_until(150).1.is_none(), "dropped after the cut: the next turn's");
        assert!(buffer.take_until(250).1.is_some());
        assert!(buffer.files_cut(), "dropped after the cut too: the next turn is cut as well");
        assert!(buffer.take_until(300).1.is_some_and(|o| o.processes_cut));
        assert!(!buffer.files_cut());
        // Room again after the turn is taken.
        buffer.push(rename(1, 400, "/a", "/b"));
        assert_eq!(buffer.len(), 1);
    }

    #[test]
    fn taking_frees_the_bytes() {
        let mut buffer = EffectBuffer::new(8 << 20);
        for i in 0..5000u64 {
            buffer.push(rename(1, i, &format!("/app/{i:0>150}"), "/app/z"));
        }
        let full = buffer.held_bytes();
        assert!(full > 5000 * 150, "{full}");
        let (taken, _) = buffer.take_until(u64::MAX);
        assert_eq!(taken.len(), 5000);
        assert!(buffer.held_bytes() < 1024, "{} bytes held after the drain", buffer.held_bytes());
    }
}
