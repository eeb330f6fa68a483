//! The node's commit bandwidth: a token bucket and the order of the commits
//! waiting for it.
//!
//! Tokens (bytes) accrue at `rate` up to `burst`. Only the first waiting
//! request in the order below can be granted, once the bucket holds
//! `min(bytes, burst)`; its bytes are then taken, so a request bigger than the
//! burst leaves the bucket in debt and the next grant waits for it to be paid
//! back. Over any window of length T the granted bytes are therefore at most
//! `burst + rate·T` (plus, once, the excess of a single request over the burst).
//!
//! Order of waiting requests, first to last:
//! 1. requests that have waited at least `aging`, oldest first: no sandbox
//!    waits without bound, whatever keeps arriving;
//! 2. requests of sandboxes marked for eviction, oldest first;
//! 3. file-system deltas, smallest first (a small delta should not sit behind
//!    a memory image);
//! 4. process checkpoints (CRIU images), oldest first.
//!
//! The scheduler is plain data driven by explicit instants, so its maths is
//! tested without a clock; [`super::server`] drives it in real time.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What a commit writes: it decides the commit's place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommitKind {
    /// A file-system delta.
    Fs,
    /// A process checkpoint (CRIU images, plus the file-system delta).
    Proc,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BucketConfig {
    pub rate_bytes_per_s: f64,
    pub burst_bytes: u64,
    /// A request waiting this long goes before every fresher one.
    pub aging: Duration,
}

impl BucketConfig {
    pub fn from_node_config(config: &crate::config::NodeConfig) -> Self {
        Self {
            rate_bytes_per_s: config.rate_mib_per_s as f64 * (1u64 << 20) as f64,
            burst_bytes: config.burst_mib << 20,
            aging: Duration::from_millis(config.aging_ms),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRequest {
    pub sandbox: String,
    pub bytes: u64,
    pub kind: CommitKind,
    pub turn: u64,
}

/// Identifies a waiting request (for grants and cancellation).
pub type Ticket = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub ticket: Ticket,
    pub waited: Duration,
}

/// How far back the per-sandbox recent rate looks.
const RECENT_WINDOW: Duration = Duration::from_secs(10);

struct Waiting {
    request: CommitRequest,
    enqueued: Instant,
}

#[derive(Default)]
struct SandboxTotals {
    granted_bytes: u64,
    granted_requests: u64,
    /// Grants within [`RECENT_WINDOW`]: (when, bytes).
    recent: VecDeque<(Instant, u64)>,
}

pub struct Scheduler {
    config: BucketConfig,
    /// May be negative: the debt of a request bigger than the burst.
    tokens: f64,
    refilled_at: Instant,
    waiting: BTreeMap<Ticket, Waiting>,
    next_ticket: Ticket,
    evicting: HashSet<String>,
    totals: HashMap<String, SandboxTotals>,
}

/// Where a request stands in the order (smaller goes first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    Aged { enqueued: Instant, ticket: Ticket },
    Evicting { enqueued: Instant, ticket: Ticket },
    Fs { bytes: u64, ticket: Ticket },
    Proc { enqueued: Instant, ticket: Ticket },
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
        }
    }

    pub fn config(&self) -> &BucketConfig {
        &self.config
    }

    pub fn enqueue(&mut self, request: CommitRequest, now: Instant) -> Ticket {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.waiting.insert(ticket, Waiting { request, enqueued: now });
        ticket
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

    /// Grants, in order, every request the bucket can pay for at `now`, and
    /// tells when to call again (None: nothing is waiting).
    pub fn poll(&mut self, now: Instant) -> (Vec<Grant>, Option<Instant>) {
        self.refill(now);
        let mut grants = Vec::new();
        while let Some((ticket, needed)) = self.head(now) {
            // A byte of slack: float sums of refills must not stall a grant.
            if self.tokens + 1.0 < needed {
                break;
            }
            let waiting = self.waiting.remove(&ticket).expect("head is waiting");
            self.tokens -= waiting.request.bytes as f64;
            let totals = self.totals.entry(waiting.request.sandbox).or_default();
            totals.granted_bytes += waiting.request.bytes;
            totals.granted_requests += 1;
            totals.recent.push_back((now, waiting.request.bytes));
            grants.push(Grant { ticket, waited: now.saturating_duration_since(waiting.enqueued) });
        }
        let next = self.head(now).map(|(_, needed)| {
            let short = (needed - self.tokens).max(0.0);
            // Rounded up, and at least a nanosecond ahead, so that time moves on.
            let refill_at = now + Duration::from_nanos((short / self.config.rate_bytes_per_s * 1e9).ceil() as u64 + 1);
            // A request reaching its age may change the head before then.
            let next_aging = self
                .waiting
                .values()
                .map(|w| w.enqueued + self.config.aging)
                .filter(|at| *at > now)
                .min();
            next_aging.map_or(refill_at, |aging| aging.min(refill_at))
        });
        (grants, next)
    }

    /// The request that goes next and the tokens it needs.
    fn head(&self, now: Instant) -> Option<(Ticket, f64)> {
        self.waiting
            .iter()
            .min_by_key(|(ticket, w)| self.rank(**ticket, w, now))
            .map(|(ticket, w)| (*ticket, w.request.bytes.min(self.config.burst_bytes) as f64))
    }

    fn rank(&self, ticket: Ticket, w: &Waiting, now: Instant) -> Rank {
        let enqueued = w.enqueued;
        if now.saturating_duration_since(enqueued) >= self.config.aging {
            Rank::Aged { enqueued, ticket }
        } else if self.evicting.contains(&w.request.sandbox) {
            Rank::Evicting { enqueued, ticket }
        } else {
            match w.request.kind {
                CommitKind::Fs => Rank::Fs { bytes: w.request.bytes, ticket },
                CommitKind::Proc => Rank::Proc { enqueued, ticket },
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
            s.waiting_bytes += w.request.bytes;
            s.lag_ms = s.lag_ms.max(now.saturating_duration_since(w.enqueued).as_secs_f64() * 1e3);
        }
        for (name, totals) in &mut self.totals {
            while totals.recent.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) > RECENT_WINDOW) {
                totals.recent.pop_front();
            }
            let s = sandboxes.entry(name).or_insert_with(|| blank(name));
            s.granted_bytes = totals.granted_bytes;
            s.granted_requests = totals.granted_requests;
            s.recent_rate_bytes_per_s =
                totals.recent.iter().map(|(_, b)| *b as f64).sum::<f64>() / RECENT_WINDOW.as_secs_f64();
        }
        for name in &self.evicting {
            sandboxes.entry(name).or_insert_with(|| blank(name)).evicting = true;
        }
        let mut sandboxes: Vec<_> = sandboxes.into_values().collect();
        sandboxes.sort_by(|a, b| a.sandbox.cmp(&b.sandbox));
        super::protocol::BucketStatus {
            rate_bytes_per_s: self.config.rate_bytes_per_s,
            burst_bytes: self.config.burst_bytes,
            aging_ms: self.config.aging.as_millis() as u64,
            tokens: self.tokens,
            sandboxes,
        }
    }

    /// Forgets the totals of a sandbox that is gone (nothing waiting, no mark).
    pub fn forget(&mut self, sandbox: &str) {
        if !self.waiting.values().any(|w| w.request.sandbox == sandbox) {
            self.totals.remove(sandbox);
            self.evicting.remove(sandbox);
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
        }
    }

    fn request(sandbox: &str, bytes: u64, kind: CommitKind) -> CommitRequest {
        CommitRequest { sandbox: sandbox.into(), bytes, kind, turn: 1 }
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

    /// Runs `arrivals` (offset, request) through a scheduler, polling exactly
    /// when it asks to be polled and at each arrival; returns (grant time, bytes, ticket order).
    fn simulate(config: BucketConfig, arrivals: Vec<(Duration, CommitRequest)>) -> Vec<(Duration, u64, String)> {
        let start = Instant::now();
        let mut scheduler = Scheduler::new(config, start);
        let mut pending: VecDeque<_> = arrivals.into_iter().collect();
        let mut names = HashMap::new();
        let mut granted = Vec::new();
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
            let (grants, next) = scheduler.poll(now);
            for g in grants {
                let (label, bytes) = names[&g.ticket].clone();
                granted.push((now - start, bytes, label));
            }
            wake = next;
        }
        granted
    }

    /// Max over every window [a, b] between grants of (granted bytes - rate·(b-a)).
    fn worst_excess(rate: f64, grants: &[(Duration, u64, String)]) -> f64 {
        let mut worst = 0f64;
        for i in 0..grants.len() {
            let mut sum = 0f64;
            for j in i..grants.len() {
                sum += grants[j].1 as f64;
                let window = (grants[j].0 - grants[i].0).as_secs_f64();
                worst = worst.max(sum - rate * window);
            }
        }
        worst
    }

    #[test]
    fn granted_bytes_never_exceed_burst_plus_rate_over_any_window() {
        let config = config(200, 64, 2_000);
        let mut rng = Rng(0x9e3779b97f4a7c15);
        let mut at = Duration::ZERO;
        let arrivals: Vec<_> = (0..400)
            .map(|i| {
                at += Duration::from_micros(rng.next() % 40_000);
                let kind = if i % 5 == 0 { CommitKind::Proc } else { CommitKind::Fs };
                let bytes = 1 + rng.next() % (48 * MIB);
                (at, request(&format!("s{}", i % 16), bytes, kind))
            })
            .collect();
        let total: u64 = arrivals.iter().map(|(_, r)| r.bytes).sum();
        let grants = simulate(config.clone(), arrivals);
        assert_eq!(grants.len(), 400, "every request is granted in the end");
        let excess = worst_excess(config.rate_bytes_per_s, &grants);
        assert!(excess <= config.burst_bytes as f64 + 1.0, "window excess {excess} > burst {}", config.burst_bytes);
        // The offered load is above the rate, so the bucket is what paces it:
        // the whole run takes at least (total - burst) / rate.
        let span = grants.last().unwrap().0.as_secs_f64();
        let floor = (total - config.burst_bytes) as f64 / config.rate_bytes_per_s;
        assert!(span >= floor - 1e-3, "span {span} s < {floor} s: rate exceeded");
        assert!(span <= floor + 0.5, "span {span} s far above {floor} s: the bucket idles");
    }

    #[test]
    fn a_request_above_the_burst_waits_for_its_debt() {
        let config = config(100, 10, 60_000);
        let arrivals = vec![
            (Duration::ZERO, request("big", 110 * MIB, CommitKind::Proc)),
            (Duration::ZERO, request("small", MIB, CommitKind::Fs)),
            (Duration::from_millis(20), request("next", MIB, CommitKind::Fs)),
        ];
        let grants = simulate(config.clone(), arrivals);
        // The small delta goes first, then the big dump once 10 MiB accrued
        // again, then the debt of 100 MiB takes a second to repay.
        assert_eq!(grants[0].2, format!("small:{}", MIB));
        assert_eq!(grants[1].2, format!("big:{}", 110 * MIB));
        let big_at = grants[1].0.as_secs_f64();
        assert!((big_at - 0.01).abs() < 0.002, "big granted at {big_at}");
        let next_at = grants[2].0.as_secs_f64();
        assert!((next_at - (big_at + 1.01)).abs() < 0.002, "next granted at {next_at}");
        let excess = worst_excess(config.rate_bytes_per_s, &grants);
        assert!(excess <= (110 * MIB) as f64 + 1.0, "excess {excess}");
    }

    #[test]
    fn small_fs_deltas_go_before_large_dumps_and_eviction_before_both() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        // Empty the bucket so that everything below has to wait.
        let drain = s.enqueue(request("x", MIB, CommitKind::Fs), start);
        assert_eq!(s.poll(start).0, vec![Grant { ticket: drain, waited: Duration::ZERO }]);
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
        let grants = simulate(config, arrivals);
        let dump = grants.iter().find(|g| g.2.starts_with("dumper")).expect("the dump is granted");
        // It ages at 2.005 s, then waits for what aged before it and for 1 MiB of tokens.
        let at = dump.0.as_secs_f64();
        assert!((2.0..2.5).contains(&at), "dump granted at {at} s");
        // Whatever arrived after it but was granted before is newer and small (fs first until aging).
        assert!(grants.iter().filter(|g| g.0 < dump.0).all(|g| g.2.starts_with("fs")));
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
    fn status_reports_lag_of_the_oldest_waiting_request_and_rates() {
        let config = config(1, 1, 60_000);
        let start = Instant::now();
        let mut s = Scheduler::new(config, start);
        s.enqueue(request("a", MIB, CommitKind::Fs), start);
        s.poll(start);
        s.enqueue(request("b", MIB, CommitKind::Fs), start + Duration::from_millis(100));
        s.enqueue(request("b", MIB, CommitKind::Fs), start + Duration::from_millis(300));
        s.set_evicting("c", true);
        let status = s.status(start + Duration::from_millis(500));
        let by_name: HashMap<_, _> = status.sandboxes.iter().map(|s| (s.sandbox.as_str(), s)).collect();
        assert_eq!(by_name["a"].granted_bytes, MIB);
        assert!((by_name["a"].recent_rate_bytes_per_s - MIB as f64 / 10.0).abs() < 1.0);
        assert_eq!(by_name["b"].waiting, 2);
        assert!((by_name["b"].lag_ms - 400.0).abs() < 1e-6, "lag {}", by_name["b"].lag_ms);
        assert!(by_name["c"].evicting);
        assert!((status.tokens - MIB as f64 / 2.0).abs() < 1.0, "tokens {}", status.tokens);
    }
}
