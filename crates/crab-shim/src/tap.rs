//! Taking a shell session's answer out of its output stream (see `crab_engine::shell`).
//!
//! While crab asks a session, each of its output copies passes the bytes through a [`Tap`]:
//! what comes before the begin mark goes on to the client (output of the turn that was still
//! in the pipe), everything from the begin mark through the end mark is withheld and handed
//! to the asker, and what follows goes on again.

use tokio::sync::oneshot;

/// One output stream's tap for one answer.
pub struct Tap {
    begin: Vec<u8>,
    end: Vec<u8>,
    /// Bytes that may be the start of the begin mark, held until the next read decides.
    held: Vec<u8>,
    /// From the begin mark on.
    answer: Vec<u8>,
    inside: bool,
    /// Answers above this are dropped (the asker hears an empty answer).
    limit: usize,
    overflowed: bool,
    done: Option<oneshot::Sender<Vec<u8>>>,
}

/// What a tap made of one read.
#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    /// Bytes for the client.
    pub forward: Vec<u8>,
    /// The end mark went by: the tap is finished.
    pub finished: bool,
}

impl Tap {
    pub fn new(begin: Vec<u8>, end: Vec<u8>, limit: usize) -> (Tap, oneshot::Receiver<Vec<u8>>) {
        let (tx, rx) = oneshot::channel();
        let tap = Tap {
            begin,
            end,
            held: Vec::new(),
            answer: Vec::new(),
            inside: false,
            limit,
            overflowed: false,
            done: Some(tx),
        };
        (tap, rx)
    }

    /// Routes one read's bytes.
    pub fn route(&mut self, bytes: &[u8]) -> Routed {
        let mut forward = Vec::new();
        let mut rest: Vec<u8> = std::mem::take(&mut self.held);
        rest.extend_from_slice(bytes);
        if !self.inside {
            match find(&rest, &self.begin) {
                Some(at) => {
                    forward.extend_from_slice(&rest[..at]);
                    rest.drain(..at);
                    self.inside = true;
                }
                None => {
                    // Only a tail that could still become the begin mark waits.
                    let keep = partial_suffix(&rest, &self.begin);
                    forward.extend_from_slice(&rest[..rest.len() - keep]);
                    self.held = rest[rest.len() - keep..].to_vec();
                    return Routed { forward, finished: false };
                }
            }
        }
        // Inside: the end mark is searched from where it could start in what is new.
        let from = self.answer.len().saturating_sub(self.end.len() - 1);
        self.answer.extend_from_slice(&rest);
        match find(&self.answer[from..], &self.end).map(|at| at + from + self.end.len()) {
            Some(stop) => {
                forward.extend_from_slice(&self.answer[stop..]);
                self.answer.truncate(stop);
                let answer = if self.overflowed { Vec::new() } else { std::mem::take(&mut self.answer) };
                if let Some(done) = self.done.take() {
                    let _ = done.send(answer);
                }
                Routed { forward, finished: true }
            }
            None => {
                if self.answer.len() > self.limit {
                    // Keep only what may hold the start of the end mark.
                    self.overflowed = true;
                    let tail = self.answer.split_off(self.answer.len() - (self.end.len() - 1));
                    self.answer = tail;
                }
                Routed { forward, finished: false }
            }
        }
    }

    /// The asker gave up: whatever was held goes on to the client.
    pub fn release(self) -> Vec<u8> {
        let mut out = self.held;
        out.extend(self.answer);
        out
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The length of the longest end of `bytes` that is a start of `mark` (shorter than `mark`).
fn partial_suffix(bytes: &[u8], mark: &[u8]) -> usize {
    (1..mark.len().min(bytes.len() + 1)).rev().find(|&n| bytes[bytes.len() - n..] == mark[..n]).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEGIN: &[u8] = b"__crab_abc_begin\n";
    const END: &[u8] = b"__crab_abc_end\n";

    /// Feeds `stream` in pieces cut at `cuts`, returns (forwarded, answer).
    fn run(stream: &[u8], cuts: &[usize], limit: usize) -> (Vec<u8>, Option<Vec<u8>>) {
        let (mut tap, mut rx) = Tap::new(BEGIN.to_vec(), END.to_vec(), limit);
        let mut forwarded = Vec::new();
        let mut last = 0;
        let mut finished = false;
        for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
            if finished {
                forwarded.extend_from_slice(&stream[last..cut]);
            } else {
                let routed = tap.route(&stream[last..cut]);
                forwarded.extend(routed.forward);
                finished = routed.finished;
            }
            last = cut;
        }
        if !finished {
            forwarded.extend(tap.release());
        }
        (forwarded, rx.try_recv().ok())
    }

    #[test]
    fn the_answer_is_withheld_wherever_the_reads_cut_the_stream() {
        let stream = b"turn output __crab_ not a mark\n__crab_abc_begin\nstate\n__crab_abc_end\nafter";
        for a in 0..stream.len() {
            for b in a..stream.len() {
                let (forwarded, answer) = run(stream, &[a, b], 1 << 20);
                assert_eq!(forwarded, b"turn output __crab_ not a mark\nafter", "cuts {a} {b}");
                assert_eq!(answer.as_deref(), Some(&b"__crab_abc_begin\nstate\n__crab_abc_end\n"[..]), "cuts {a} {b}");
            }
        }
    }

    #[test]
    fn output_without_an_answer_goes_on_whole() {
        let stream = b"plain output ending in __crab_ab";
        let (forwarded, answer) = run(stream, &[5, 20], 1 << 20);
        assert_eq!(forwarded, stream);
        assert_eq!(answer, None);
    }

    #[test]
    fn an_answer_over_the_limit_is_withheld_and_comes_back_empty() {
        let mut stream = BEGIN.to_vec();
        stream.extend(std::iter::repeat_n(b'x', 5000));
        stream.extend_from_slice(END);
        stream.extend_from_slice(b"next");
        let cuts: Vec<usize> = (1..stream.len()).step_by(97).collect();
        let (forwarded, answer) = run(&stream, &cuts, 1000);
        assert_eq!(forwarded, b"next");
        assert_eq!(answer, Some(Vec::new()));
    }
}
