//! The node's commit bandwidth: a token bucket and the order of the commits
//! waiting for it.
//!
//! Tokens (bytes) accrue at `rate` up to `burst`. A commit draws its bytes in
//! chunks of at most `chunk_bytes` (never more than the burst): each time the
//! first waiting commit in the order below can pay for its next chunk, the
//! chunk's tokens are taken, and the commit is granted once its last chunk is
//! paid. Between two chunks of a large CRIU dump the order is decided again,
//! so a small delta of another sandbox goes in between instead of waiting for
//! the whole dump. The bucket never goes into debt: over any window of length
//! T the tokens taken are at most `burst + rate·T`.
//!
//! Order of waiting commits, first to last:
//! 1. commits that have waited at least `aging`, oldest first: no sandbox
//!    waits without bound, whatever keeps arriving;
//! 2. commits of sandboxes marked for eviction, oldest first;
//! 3. file-system deltas, fewest bytes still to pay first (a small delta
//!    should not sit behind a memory image);
//! 4. process checkpoints (CRIU images), oldest first;
//! 5. pushes to the registry (the remote tier), oldest first, whatever their age and even for
//!    a sandbox marked for eviction: they read what a checkpoint wrote, so a checkpoint waiting
//!    behind one would only delay the push that follows it.
//!
//! Superseding: a waiting process checkpoint of a sandbox (marked
//! `supersedable` by its shim) is dropped, its waiter hearing `Superseded`,
//! once the shim reports a newer full process capture of the same sandbox
//! ([`Scheduler::supersede`], or a newer supersedable request arriving). A
//! request of an older turn that arrives after that report is dropped as
//! soon as it would have to wait; one the bucket can pay at once still goes.
//! Only the shim can promise what dropping needs: the newer capture holds a
//! whole CRIU dump, and its file-system delta holds every path of the
//! sandbox's earlier turns that no durable checkpoint has (the shim carries
//! them into each capture, re-read as of the newer turn's end; see
//! [`crab_engine::pipeline::TurnPipeline`]). So the newest state stays exact;
//! what is lost is a rollback to the dropped turn itself, which the turn log
//! then refuses by name. File-system deltas are never dropped: they are
//! small, and each keeps its turn reachable for rollback.
//!
//! The scheduler is plain data driven by explicit instants, so its maths is
//! tested without a clock; [`super::server`] drives it in real time.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// On the wire (see [`super::protocol`], whose digest names the build's compatibility).
pub use super::protocol::CommitKind;

/// Default size of the chunks a commit draws: large enough that a 100 MiB
/// dump is a few dozen grants, small enough that a delta queued behind a
/// chunk waits milliseconds at typical rates.
pub const DEFAULT_CHUNK_BYTES: u64 = 4 << 20;

#[derive(Debug, Clone, PartialEq)]
pub struct BucketConfig {
    pub rate_bytes_per_s: f64,
    pub burst_bytes: u64,
    /// A request waiting this long goes before every fresher one.
    pub aging: Duration,
    /// Largest draw of one commit at a time (capped at the burst).
    pub chunk_bytes: u64,
}

impl BucketConfig {
    pub fn from_node_config(config: &crab_config::NodeConfig) -> Self {
        Self {
            rate_bytes_per_s: config.rate_mib_per_s as f64 * (1u64 << 20) as f64,
            burst_bytes: config.burst_mib << 20,
            aging: Duration::from_millis(config.aging_ms),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
        }
    }

    /// The chunk actually drawn: at least a byte, at most the burst.
    pub fn chunk(&self) -> u64 {
        self.chunk_bytes.clamp(1, self.burst_bytes.max(1))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRequest {
    pub sandbox: String,
    pub bytes: u64,
    pub kind: CommitKind,
    pub turn: u64,
    /// The shim may drop this commit for a newer process checkpoint of the
    /// same sandbox (see the module documentation for what that promises).
    pub supersedable: bool,
}

/// Identifies a waiting request (for grants and cancellation).
pub type Ticket = u64;

/// How a waiting commit ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every chunk is paid: write.
    Granted,
    /// Dropped for the newer commit of turn `by_turn`: do not write.
    Superseded { by_turn: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub ticket: Ticket,
    pub waited: Duration,
    pub outcome: Outcome,
}

/// How far back the per-sandbox recent rate looks.
const RECENT_WINDOW: Duration = Duration::from_secs(10);

struct Waiting {
    request: CommitRequest,
    enqueued: Instant,
    /// Bytes not yet paid for.
    remaining: u64,
}

#[derive(Default)]
struct SandboxTotals {
    granted_bytes: u64,
    granted_requests: u64,
    chunks: u64,
    superseded: u64,
    superseded_bytes: u64,
    /// Longest wait of any commit that has left the queue.
    max_lag: Duration,
    /// Draws within [`RECENT_WINDOW`]: (when, bytes).
    recent: VecDeque<(Instant, u64)>,
}

pub struct Scheduler {
    config: BucketConfig,
    tokens: f64,
    refilled_at: Instant,
    waiting: BTreeMap<Ticket, Waiting>,
    next_ticket: Ticket,
    evicting: HashSet<String>,
    totals: HashMap<String, SandboxTotals>,
    /// Superseded since the last poll, reported by it.
    dropped: Vec<Decision>,
    /// Per sandbox, the newest turn with a full process capture reported.
    captured: HashMap<String, u64>,
    /// What forgotten sandboxes contributed to the node's totals.
    gone: GoneTotals,
}

#[derive(Default)]
struct GoneTotals {
    max_lag: Duration,
    superseded: u64,
    granted_bytes: u64,
}

/// Where a request stands in the order (smaller goes first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    Aged { enqueued: Instant, ticket: Ticket },
    Evicting { enqueued: Instant, ticket: Ticket },
    Fs { bytes: u64, ticket: Ticket },
    Proc { enqueued: Instant, ticket: Ticket },
    Push { enqueued: Instant, ticket: Ticket },
}

impl Scheduler {
    /// A full bucket at `now`.
    pub fn new(config: BucketConfig, now: Instant) -> Self {
        Self {
            tokens: config.burst_bytes as f64,
            config,
            refilled_at: now,
            waiting: BTreeMap::new(),
            next_ticket: 1,
            evicting: HashSet::new(),
            totals: HashMap::new(),
            dropped: Vec::new(),
            captured: HashMap::new(),
            gone: GoneTotals::default(),
        }
    }

    pub fn config(&self) -> &BucketConfig {
        &self.config
    }

    /// Queues `request`; older supersedable process checkpoints of its
    /// sandbox are dropped when it is one too (the next poll reports them).
    pub fn enqueue(&mut self, request: CommitRequest, now: Instant) -> Ticket {
        if request.kind == CommitKind::Proc && request.supersedable {
            self.supersede(&request.sandbox, request.turn, now);
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let remaining = request.bytes;
        self.waiting.insert(ticket, Waiting { request, enqueued: now, remaining });
        ticket
    }

    /// Turn `turn` of `sandbox` has a full process capture: its waiting
    /// supersedable process checkpoints of earlier turns are dropped now (the
    /// next poll reports them), later ones when they would wait. Returns how
    /// many were dropped now.
    pub fn supersede(&mut self, sandbox: &str, turn: u64, now: Instant) -> usize {
        let newest = self.captured.entry(sandbox.to_string()).or_insert(turn);
        *newest = (*newest).max(turn);
        let dropped = self.drop_superseded(now);
        let count = dropped.len();
        self.dropped.extend(dropped);
        count
    }

    /// Removes every waiting request that a reported newer capture supersedes.
    fn drop_superseded(&mut self, now: Instant) -> Vec<Decision> {
        let superseded: Vec<(Ticket, u64)> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.request.kind == CommitKind::Proc && w.request.supersedable)
            .filter_map(|(ticket, w)| {
                let newest = *self.captured.get(&w.request.sandbox)?;
                (newest > w.request.turn).then_some((*ticket, newest))
            })
            .collect();
        superseded
            .into_iter()
            .map(|(ticket, by_turn)| {
                let w = self.waiting.remove(&ticket).expect("listed above");
                let waited = now.saturating_duration_since(w.enqueued);
                let totals = self.totals.entry(w.request.sandbox).or_default();
                totals.superseded += 1;
                totals.superseded_bytes += w.remaining;
                totals.max_lag = totals.max_lag.max(waited);
                Decision { ticket, waited, outcome: Outcome::Superseded { by_turn } }
            })
            .collect()
    }

    /// Withdraws a waiting request; false when it was granted or unknown.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        self.waiting.remove(&ticket).is_some()
    }

    pub fn set_evicting(&mut self, sandbox: &str, evicting: bool) {
        if evicting {
            self.evicting.insert(sandbox.to_string());
        } else {
            self.evicting.remove(sandbox);
        }
    }

    /// Pays, in order, every chunk the bucket can pay for at `now`; returns
    /// the commits that are now fully granted or were superseded, and when to
    /// call again (None: nothing is waiting).
    pub fn poll(&mut self, now: Instant) -> (Vec<Decision>, Option<Instant>) {
        self.refill(now);
        let mut decisions = std::mem::take(&mut self.dropped);
        while let Some((ticket, chunk)) = self.head(now) {
            // A byte of slack: float sums of refills must not stall a grant.
            if self.tokens + 1.0 < chunk as f64 {
                break;
            }
            self.tokens -= chunk as f64;
            let waiting = self.waiting.get_mut(&ticket).expect("head is waiting");
            waiting.remaining -= chunk;
            let totals = self.totals.entry(waiting.request.sandbox.clone()).or_default();
            totals.granted_bytes += chunk;
            totals.chunks += 1;
            totals.recent.push_back((now, chunk));
            if waiting.remaining == 0 {
                let waiting = self.waiting.remove(&ticket).expect("head is waiting");
                let waited = now.saturating_duration_since(waiting.enqueued);
                totals.granted_requests += 1;
                totals.max_lag = totals.max_lag.max(waited);
                decisions.push(Decision { ticket, waited, outcome: Outcome::Granted });
            }
        }
        // What arrived after a newer capture was reported and could not be paid at once.
        decisions.extend(self.drop_superseded(now));
        let next = self.head(now).map(|(_, chunk)| {
            let short = (chunk as f64 - self.tokens).max(0.0);
            // Rounded up, and at least a nanosecond ahead, so that time moves on.
            let refill_at = now + Duration::from_nanos((short / self.config.rate_bytes_per_s * 1e9).ceil() as u64 + 1);
            // A request reaching its age may change the head before then.
            let next_aging = self.waiting.values().map(|w| w.enqueued + self.config.aging).filter(|at| *at > now).min();
            next_aging.map_or(refill_at, |aging| aging.min(refill_at))
        });
        (decisions, next)
    }

    /// The request that goes next and the size of its next chunk.
    fn head(&self, now: Instant) -> Option<(Ticket, u64)> {
        self.waiting
            .iter()
            .min_by_key(|(ticket, w)| self.rank(**ticket, w, now))
            .map(|(ticket, w)| (*ticket, w.remaining.min(self.config.chunk())))
    }

    fn rank(&self, ticket: Ticket, w: &Waiting, now: Instant) -> Rank {
        let enqueued = w.enqueued;
        if w.request.kind == CommitKind::Push {
            Rank::Push { enqueued, ticket }
        } else if now.saturating_duration_since(enqueued) >= self.config.aging {
            Rank::Aged { enqueued, ticket }
        } else if self.evicting.contains(&w.request.sandbox) {
            Rank::Evicting { enqueued, ticket }
        } else {
            match w.request.kind {
                CommitKind::Fs => Rank::Fs { bytes: w.remaining, ticket },
                CommitKind::Proc => Rank::Proc { enqueued, ticket },
                CommitKind::Push => unreachable!("pushes are ranked above"),
            }
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled_at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.config.rate_bytes_per_s).min(self.config.burst_bytes as f64);
        self.refilled_at = self.refilled_at.max(now);
    }

    /// The bucket and every sandbox it has seen, as of `now`.
    pub fn status(&mut self, now: Instant) -> super::protocol::BucketStatus {
        self.refill(now);
        let mut sandboxes: HashMap<&str, super::protocol::SandboxStatus> = HashMap::new();
        let blank = |name: &str| super::protocol::SandboxStatus { sandbox: name.to_string(), ..Default::default() };
        for w in self.waiting.values() {
            let s = sandboxes.entry(&w.request.sandbox).or_insert_with(|| blank(&w.request.sandbox));
            s.waiting += 1;
            s.waiting_bytes += w.remaining;
            let lag_ms = now.saturating_duration_since(w.enqueued).as_secs_f64() * 1e3;
            if lag_ms >= s.lag_ms {
                s.lag_ms = lag_ms;
                s.oldest_waiting_turn = Some(w.request.turn);
            }
        }
        for (name, totals) in &mut self.totals {
            while totals.recent.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) > RECENT_WINDOW) {
                totals.recent.pop_front();
            }
            let s = sandboxes.entry(name).or_insert_with(|| blank(name));
            s.granted_bytes = totals.granted_bytes;
            s.granted_requests = totals.granted_requests;
            s.granted_chunks = totals.chunks;
            s.superseded = totals.superseded;
            s.superseded_bytes = totals.superseded_bytes;
            s.max_lag_ms = totals.max_lag.as_secs_f64() * 1e3;
            s.recent_rate_bytes_per_s =
                totals.recent.iter().map(|(_, b)| *b as f64).sum::<f64>() / RECENT_WINDOW.as_secs_f64();
        }
        for name in &self.evicting {
            sandboxes.entry(name).or_insert_with(|| blank(name)).evicting = true;
        }
        let mut sandboxes: Vec<_> = sandboxes.into_values().collect();
        for s in &mut sandboxes {
            // A commit still waiting may already be the longest wait.
            s.max_lag_ms = s.max_lag_ms.max(s.lag_ms);
        }
        sandboxes.sort_by(|a, b| a.sandbox.cmp(&b.sandbox));
        let gone = &self.gone;
        super::protocol::BucketStatus {
            rate_bytes_per_s: self.config.rate_bytes_per_s,
            burst_bytes: self.config.burst_bytes,
            chunk_bytes: self.config.chunk(),
            aging_ms: self.config.aging.as_millis() as u64,
            tokens: self.tokens,
            max_lag_ms: sandboxes.iter().map(|s| s.max_lag_ms).fold(gone.max_lag.as_secs_f64() * 1e3, f64::max),
            superseded: gone.superseded + sandboxes.iter().map(|s| s.superseded).sum::<u64>(),
            granted_bytes: gone.granted_bytes + sandboxes.iter().map(|s| s.granted_bytes).sum::<u64>(),
            sandboxes,
        }
    }

    /// Forgets the totals of a sandbox that is gone (nothing waiting, no mark).
    pub fn forget(&mut self, sandbox: &str) {
        if !self.waiting.values().any(|w| w.request.sandbox == sandbox) {
            if let Some(totals) = self.totals.remove(sandbox) {
                self.gone.max_lag = self.gone.max_lag.max(totals.max_lag);
                self.gone.superseded += totals.superseded;
                self.gone.granted_bytes += totals.granted_bytes;
            }
            self.evicting.remove(sandbox);
            self.captured.remove(sandbox);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn config(rate_mib: u64, burst_mib: u64, aging_ms: u64) -> BucketConfig {
        BucketConfig {
            rate_bytes_per_s: (rate_mib * MIB) as f64,
            burst_bytes: burst_mib * MIB,
            aging: Duration::from_millis(aging_ms),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
        }
    }

    fn request(sandbox: &str, bytes: u64, kind: CommitKind) -> CommitRequest {
        CommitRequest { sandbox: sandbox.into(), bytes, kind, turn: 1, supersedable: false }
    }

    /// Deterministic pseudo-random numbers (xorshift), so a failure replays.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// What a simulated run produced: finished commits (time, bytes, label,
    /// outcome) and every draw from the bucket (time, bytes).
    struct Run {
        decisions: Vec<(Duration, u64, String, Outcome)>,
        draws: Vec<(Duration, u64)>,
    }

    impl Run {
        fn granted(&self) -> Vec<&(Duration, u64, String, Outcome)> {
            self.decisions.iter().filter(|d| d.3 == Outcome::Granted).collect()
        }
    }

    /// Runs `arrivals` (offset, request) through a scheduler, polling exactly
    /// when it asks to be polled and at each arrival.
    fn simulate(config: BucketConfig, arrivals: Vec<(Duration, CommitRequest)>) -> Run {
        let start = Instant::now();
        let mut scheduler = Scheduler::new(config, start);
        let mut pending: VecDeque<_> = arrivals.into_iter().collect();
        let mut names = HashMap::new();
        let mut run = Run { decisions: Vec::new(), draws: Vec::new() };
        let mut paid = 0;
        let mut wake: Option<Instant> = None;
        loop {
            let next_arrival = pending.front().map(|(at, _)| start + *at);
            let now = match (next_arrival, wake) {
                (Some(a), Some(w)) => a.min(w),
                (Some(a), None) => a,
                (None, Some(w)) => w,
                (None, None) => break,
            };
            while pending.front().is_some_and(|(at, _)| start + *at <= now) {
                let (_, req) = pending.pop_front().unwrap();
                let label = format!("{}:{}", req.sandbox, req.bytes);
                let bytes = req.bytes;
                names.insert(scheduler.enqueue(req, now), (label, bytes));
            }
            let (decisions, next) = scheduler.poll(now);
            for d in decisions {
                let (label, bytes) = names[&d.ticket].clone();
                run.decisions.push((now - start, bytes, label, d.outcome));
            }
            let total = scheduler.status(now).granted_bytes;
            if total > paid {
                run.draws.push((now - start, total - paid));
                paid = total;
            }
            wake = next;
        }
        run
    }

    /// Max over every window [a, b] between draws of (drawn bytes - rate·(b-a)).
    fn worst_excess(rate: f64, draws: &[(Duration, u64)]) -> f64 {
        let mut worst = 0f64;
        for i in 0..draws.len() {
            let mut sum = 0f64;
            for j in i..draws.len() {
                sum += draws[j].1 as f64;
                let window = (draws[j].0 - draws[i].0).as_secs_f64();
                worst = worst.max(sum - rate * window);
            }
        }
        worst
    }

    #[test]
    fn drawn_bytes_never_exceed_burst_plus_rate_over_any_window() {
        let config = config(200, 64, 2_000);
        let mut rng = Rng(0x9e3779b97f4a7c15);
        let mut at = Duration::ZERO;
        let arrivals: Vec<_> = (0..400)
            .map(|i| {
                at += Duration::from_micros(rng.next() % 40_000);
                let kind = if i % 5 == 0 { CommitKind::Proc } else { CommitKind::Fs };
                // Some commits are bigger than the burst.
                let bytes = 1 + rng.next() % (96 * MIB);
                (at, request(&format!("s{}", i % 16), bytes, kind))
            })
            .collect();
        let total: u64 = arrivals.iter().map(|(_, r)| r.bytes).sum();
        let run = simulate(config.clone(), arrivals);
        assert_eq!(run.granted().len(), 400, "every request is granted in the end");
        assert_eq!(run.draws.iter().map(|d| d.1).sum::<u64>(), total, "every byte is drawn exactly once");
        let excess = worst_excess(config.rate_bytes_per_s, &run.draws);
        assert!(excess <= config.burst_bytes as f64 + 1.0, "window excess {excess} > burst {}", config.burst_bytes);
        // The offered load is above the rate, so the bucket is what paces it:
        // the whole run takes at least (total - burst) / rate.
        let span = run.draws.last().unwrap().0.as_secs_f64();
        let floor = (total - config.burst_bytes) as f64 / config.rate_bytes_per_s;
        assert!(span >= floor - 1e-3, "span {span} s < {floor} s: rate exceeded");
        assert!(span <= floor + 0.5, "span {span} s far above {floor} s: the bucket idles");
    }

    #[test]
    fn a_dump_bigger_than_the_burst_is_paid_in_chunks_with_deltas_in_between() {
        // 100 MiB/s, 10 MiB burst, 4 MiB chunks: the 40 MiB dump needs ten draws.
        let config = config(100, 10, 60_000);
        let arrivals = vec![
            (Duration::ZERO, request("big", 40 * MIB, CommitKind::Proc)),
            (Duration::from_millis(50), request("small", MIB, CommitKind::Fs)),
        ];
        let run = simulate(config.clone(), arrivals);
        let granted = run.granted();
        // The delta arrived while the dump was half paid and did not wait for the rest.
        assert_eq!(granted[0].2, format!("small:{}", MIB));
        let small_at = granted[0].0.as_secs_f64();
        assert!(small_at < 0.07, "delta granted at {small_at} s");
        assert_eq!(granted[1].2, format!("big:{}", 40 * MIB));
        // 40 + 1 MiB at 100 MiB/s with 10 MiB in the bucket at the start.
        let big_at = granted[1].0.as_secs_f64();
        assert!((big_at - 0.31).abs() < 0.005, "dump granted at {big_at} s");
        // Polls see what the bucket holds: two chunks from the full bucket at
        // first, then one chunk each time 4 MiB have accrued.
        assert!(run.draws.iter().all(|d| d.1 <= 10 * MIB), "no draw above the burst: {:?}", run.draws);
        assert!(run.draws.len() >= 9, "the dump is paid over time: {:?}", run.draws);
        assert_eq!(run.draws.iter().map(|d| d.1).sum::<u64>(), 41 * MIB);
        assert!(worst_excess(config.rate_bytes_per_s, &run.draws) <= (10 * MIB) as f64 + 1.0);
    }

    /// Pushes to the registry go after every checkpoint, even once they are past the aging
    /// bound and for a sandbox being evicted; among themselves oldest first.
    #[test]
    fn pushes_go_after_every_checkpoint_however_long_they_waited() {
        let config = config(1, 1, 1_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        let drain = s.enqueue(request("x", MIB, CommitKind::Fs), start);
        assert_eq!(s.poll(start).0.len(), 1, "{drain:?} empties the bucket");
        let push_old = s.enqueue(request("d", 500_000, CommitKind::Push), start);
        let push_new = s.enqueue(request("a", 500_000, CommitKind::Push), start + Duration::from_millis(1));
        s.set_evicting("d", true);
        // Arriving after the pushes passed the aging bound, the checkpoints still go first.
        let later = start + Duration::from_millis(1_500);
        let dump = s.enqueue(request("a", 200_000, CommitKind::Proc), later);
        let fs = s.enqueue(request("b", 100_000, CommitKind::Fs), later);
        let mut order = Vec::new();
        let mut now = later;
        while order.len() < 4 {
            let (grants, next) = s.poll(now);
            order.extend(grants.into_iter().map(|g| g.ticket));
            now = next.unwrap_or(now);
        }
        assert_eq!(order, vec![fs, dump, push_old, push_new]);
    }

    #[test]
    fn small_fs_deltas_go_before_large_dumps_and_eviction_before_both() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        // Empty the bucket so that everything below has to wait.
        let drain = s.enqueue(request("x", MIB, CommitKind::Fs), start);
        assert_eq!(
            s.poll(start).0,
            vec![Decision { ticket: drain, waited: Duration::ZERO, outcome: Outcome::Granted }]
        );
        let dump = s.enqueue(request("a", 900_000, CommitKind::Proc), start);
        let big_fs = s.enqueue(request("b", 800_000, CommitKind::Fs), start);
        let small_fs = s.enqueue(request("c", 1_000, CommitKind::Fs), start);
        let evicted = s.enqueue(request("d", 900_000, CommitKind::Proc), start);
        s.set_evicting("d", true);
        let mut order = Vec::new();
        let mut now = start;
        while order.len() < 4 {
            let (grants, next) = s.poll(now);
            order.extend(grants.into_iter().map(|g| g.ticket));
            now = next.unwrap_or(now);
        }
        assert_eq!(order, vec![evicted, small_fs, big_fs, dump]);
    }

    #[test]
    fn aging_bounds_the_wait_of_a_dump_under_a_stream_of_small_deltas() {
        // Small deltas arrive faster than the rate, forever: without aging
        // the dump would never go.
        let config = config(10, 1, 2_000);
        let mut arrivals = vec![(Duration::from_millis(5), request("dumper", 5 * MIB, CommitKind::Proc))];
        for i in 0..2_000u64 {
            arrivals.push((Duration::from_millis(i * 5), request(&format!("fs{}", i % 8), 100_000, CommitKind::Fs)));
        }
        arrivals.sort_by_key(|(at, _)| *at);
        let run = simulate(config, arrivals);
        let granted = run.granted();
        let dump = granted.iter().find(|g| g.2.starts_with("dumper")).expect("the dump is granted");
        // It ages at 2.005 s, then waits for what aged before it and for its
        // five 1 MiB chunks (0.1 s each at 10 MiB/s).
        let at = dump.0.as_secs_f64();
        assert!((2.0..3.0).contains(&at), "dump granted at {at} s");
        // Whatever arrived after it but was granted before is newer and small (fs first until aging).
        assert!(granted.iter().filter(|g| g.0 < dump.0).all(|g| g.2.starts_with("fs")));
    }

    #[test]
    fn a_newer_supersedable_dump_drops_the_waiting_one_but_never_an_fs_delta() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        let blocker = s.enqueue(request("x", MIB, CommitKind::Fs), start);
        assert_eq!(s.poll(start).0.len(), 1, "{blocker} empties the bucket");
        let dump = |turn, supersedable| CommitRequest {
            sandbox: "a".into(),
            bytes: 300_000,
            kind: CommitKind::Proc,
            turn,
            supersedable,
        };
        let fs = s.enqueue(CommitRequest { turn: 1, ..request("a", 200_000, CommitKind::Fs) }, start);
        let pinned = s.enqueue(dump(2, false), start);
        let old = s.enqueue(dump(3, true), start);
        let other_sandbox = s.enqueue(CommitRequest { sandbox: "b".into(), ..dump(3, true) }, start);
        let later = start + Duration::from_millis(100);
        let new = s.enqueue(dump(4, true), later);
        let (decisions, _) = s.poll(later);
        assert_eq!(
            decisions,
            vec![Decision {
                ticket: old,
                waited: Duration::from_millis(100),
                outcome: Outcome::Superseded { by_turn: 4 }
            }]
        );
        let status = s.status(later);
        let a = status.sandboxes.iter().find(|x| x.sandbox == "a").unwrap();
        assert_eq!((a.superseded, a.superseded_bytes, a.waiting), (1, 300_000, 3));
        assert_eq!(status.superseded, 1);
        // Everything else is granted in the end: the fs delta, the dump not
        // marked supersedable, the other sandbox's dump and the newer one.
        let mut granted = Vec::new();
        let mut now = later;
        while granted.len() < 4 {
            let (decisions, next) = s.poll(now);
            assert!(decisions.iter().all(|d| d.outcome == Outcome::Granted));
            granted.extend(decisions.into_iter().map(|d| d.ticket));
            match next {
                Some(at) => now = at,
                None => break,
            }
        }
        granted.sort();
        assert_eq!(granted, vec![fs, pinned, other_sandbox, new]);
    }

    #[test]
    fn a_reported_capture_drops_waiting_dumps_of_earlier_turns_and_later_ones_that_would_wait() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        let draw = |sandbox: &str, turn, kind, supersedable| CommitRequest {
            sandbox: sandbox.into(),
            bytes: 300_000,
            kind,
            turn,
            supersedable,
        };
        let blocker = s.enqueue(request("x", MIB, CommitKind::Fs), start);
        assert_eq!(s.poll(start).0.len(), 1, "{blocker} empties the bucket");
        let waiting_dump = s.enqueue(draw("a", 4, CommitKind::Proc, true), start);
        let fs_same_turn = s.enqueue(draw("a", 4, CommitKind::Fs, false), start);
        let pinned = s.enqueue(draw("a", 3, CommitKind::Proc, false), start);
        let other_sandbox = s.enqueue(draw("b", 4, CommitKind::Proc, true), start);
        let later = start + Duration::from_millis(50);
        // Turn 5 of a is captured (a newer dump): only a's waiting supersedable dump goes.
        assert_eq!(s.supersede("a", 5, later), 1);
        let (decisions, _) = s.poll(later);
        assert_eq!(
            decisions,
            vec![Decision {
                ticket: waiting_dump,
                waited: Duration::from_millis(50),
                outcome: Outcome::Superseded { by_turn: 5 }
            }]
        );
        // A draw of the same turn 4 arriving later, while the bucket is empty: dropped at once.
        let late_draw = s.enqueue(draw("a", 4, CommitKind::Proc, true), later);
        let (decisions, _) = s.poll(later);
        assert_eq!(
            decisions.iter().map(|d| (d.ticket, d.outcome)).collect::<Vec<_>>(),
            vec![(late_draw, Outcome::Superseded { by_turn: 5 })]
        );
        // Turn 5's own draws are not superseded by its own report.
        let own = s.enqueue(draw("a", 5, CommitKind::Proc, true), later);
        // Once the bucket has refilled, a draw of an older turn that can be paid at once still goes.
        let mut now = later;
        let mut granted = Vec::new();
        while granted.len() < 4 {
            let (decisions, next) = s.poll(now);
            assert!(decisions.iter().all(|d| d.outcome == Outcome::Granted), "{decisions:?}");
            granted.extend(decisions.into_iter().map(|d| d.ticket));
            if granted.len() < 4 {
                now = next.expect("something waits");
            }
        }
        granted.sort();
        assert_eq!(granted, vec![fs_same_turn, pinned, other_sandbox, own]);
        let idle = now + Duration::from_secs(5);
        s.poll(idle);
        let paid_at_once = s.enqueue(draw("a", 4, CommitKind::Proc, true), idle);
        let (decisions, _) = s.poll(idle);
        assert_eq!(
            decisions,
            vec![Decision { ticket: paid_at_once, waited: Duration::ZERO, outcome: Outcome::Granted }]
        );
        let a = s.status(idle).sandboxes.into_iter().find(|x| x.sandbox == "a").unwrap();
        assert_eq!((a.superseded, a.superseded_bytes), (2, 600_000));
    }

    #[test]
    fn cancelled_requests_are_never_granted_and_free_the_head() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        let first = s.enqueue(request("a", MIB, CommitKind::Fs), start);
        assert_eq!(s.poll(start).0.len(), 1, "{first} granted from the full bucket");
        let blocked = s.enqueue(request("b", MIB, CommitKind::Proc), start);
        let small = s.enqueue(request("c", 10, CommitKind::Proc), start);
        assert!(s.cancel(blocked));
        assert!(!s.cancel(blocked));
        let (grants, next) = s.poll(start + Duration::from_millis(1));
        assert_eq!(grants.iter().map(|g| g.ticket).collect::<Vec<_>>(), vec![small]);
        assert_eq!(next, None);
    }

    #[test]
    fn status_reports_lag_max_lag_and_rates_and_keeps_node_totals_of_forgotten_sandboxes() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        s.enqueue(request("a", MIB, CommitKind::Fs), start);
        s.poll(start);
        s.enqueue(CommitRequest { turn: 7, ..request("b", MIB, CommitKind::Fs) }, start + Duration::from_millis(100));
        s.enqueue(CommitRequest { turn: 8, ..request("b", MIB, CommitKind::Fs) }, start + Duration::from_millis(300));
        s.set_evicting("c", true);
        let status = s.status(start + Duration::from_millis(500));
        let by_name: HashMap<_, _> = status.sandboxes.iter().map(|s| (s.sandbox.as_str(), s)).collect();
        assert_eq!(by_name["a"].granted_bytes, MIB);
        assert!((by_name["a"].recent_rate_bytes_per_s - MIB as f64 / 10.0).abs() < 1.0);
        assert_eq!(by_name["b"].waiting, 2);
        assert!((by_name["b"].lag_ms - 400.0).abs() < 1e-6, "lag {}", by_name["b"].lag_ms);
        assert_eq!(by_name["b"].oldest_waiting_turn, Some(7));
        assert!((by_name["b"].max_lag_ms - 400.0).abs() < 1e-6);
        assert!(by_name["c"].evicting);
        assert!((status.tokens - MIB as f64 / 2.0).abs() < 1.0, "tokens {}", status.tokens);

        // b's first commit is granted after 1 s of waiting (it needs a full MiB),
        // its second waits on; then b is forgotten once nothing of it waits.
        let (decisions, _) = s.poll(start + Duration::from_millis(1_100));
        assert_eq!(decisions.len(), 1);
        let status = s.status(start + Duration::from_millis(1_200));
        let b = status.sandboxes.iter().find(|x| x.sandbox == "b").unwrap();
        assert!((b.max_lag_ms - 1_000.0).abs() < 1e-6, "max lag {}", b.max_lag_ms);
        assert!((b.lag_ms - 900.0).abs() < 1e-6, "lag {}", b.lag_ms);
        let (decisions, _) = s.poll(start + Duration::from_millis(2_100));
        assert_eq!(decisions.len(), 1);
        s.forget("b");
        let status = s.status(start + Duration::from_millis(2_200));
        assert!(status.sandboxes.iter().all(|x| x.sandbox != "b"));
        assert!((status.max_lag_ms - 1_800.0).abs() < 1e-6, "node max lag {}", status.max_lag_ms);
        assert_eq!(status.granted_bytes, 3 * MIB);
    }
}
