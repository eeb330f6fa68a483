//! The hand-off between a sandbox's turns and their checkpoints.
//!
//! A turn's checkpoint has two halves: the capture, which must see the sandbox exactly as the
//! turn left it (reading the changed files, the CRIU dump), and the write-out (chunking, hashing,
//! flushing, waiting for the node's bandwidth), which must not. The next turn waits only for the
//! capture; write-outs run one after another in turn order while the agent thinks.
//!
//! A checkpoint that fails (a full disk, a failed dump) must not lose what its turn changed: the
//! changes stay "unpublished" and every later capture takes them in, until a checkpoint that
//! includes them is durable.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::fsdelta::ChangedPath;

/// Changes of turns whose checkpoint is not durable (yet).
#[derive(Default)]
struct Unpublished {
    /// Changed paths by turn, from the turn's capture until a checkpoint at or after it is durable.
    paths: BTreeMap<u64, Vec<ChangedPath>>,
    /// A process checkpoint failed: the processes are only as recent as an older dump until the
    /// next process checkpoint is durable.
    processes_since: Option<u64>,
}

/// What a turn must capture on behalf of earlier turns whose checkpoints are not durable.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Carried {
    pub paths: Vec<ChangedPath>,
    /// The turn whose process checkpoint failed: this turn must dump the processes.
    pub processes_of: Option<u64>,
}

impl Carried {
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty() && self.processes_of.is_none()
    }
}

/// One sandbox's sequence of checkpoint jobs.
#[derive(Default)]
pub struct TurnPipeline {
    /// Turns true when the last closed turn's capture is done; closes if it is abandoned.
    captured: Option<watch::Receiver<bool>>,
    /// The last turn's checkpoint job; it waits for the one before it.
    last_job: Option<JoinHandle<()>>,
    unpublished: Arc<Mutex<Unpublished>>,
}

impl TurnPipeline {
    pub fn new() -> Self {
        Self::default()
    }

    /// What a starting turn waits for: the previous turn's capture, never its write-out.
    /// Any number of execs starting together may wait on it.
    pub fn capture_wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let captured = self.captured.clone();
        async move {
            if let Some(mut captured) = captured {
                // An error means the job dropped its sender: gone, so nothing holds the turn.
                let _ = captured.wait_for(|done| *done).await;
            }
        }
    }

    /// Starts the checkpoint of closed turn `turn`; hand the job that runs it to
    /// [`set_job`](Self::set_job).
    pub fn begin(&mut self, turn: u64) -> TurnSlot {
        let (tx, rx) = watch::channel(false);
        self.captured = Some(rx);
        TurnSlot {
            turn,
            captured: Some(tx),
            previous: self.last_job.take(),
            unpublished: Arc::clone(&self.unpublished),
        }
    }

    pub fn set_job(&mut self, job: JoinHandle<()>) {
        self.last_job = Some(job);
    }

    /// The last checkpoint job; awaiting it awaits every earlier one.
    pub fn take_last_job(&mut self) -> Option<JoinHandle<()>> {
        self.last_job.take()
    }
}

/// One turn's place in the pipeline, owned by its checkpoint job.
pub struct TurnSlot {
    turn: u64,
    captured: Option<watch::Sender<bool>>,
    previous: Option<JoinHandle<()>>,
    unpublished: Arc<Mutex<Unpublished>>,
}

impl TurnSlot {
    pub fn turn(&self) -> u64 {
        self.turn
    }

    fn unpublished(&self) -> std::sync::MutexGuard<'_, Unpublished> {
        self.unpublished.lock().expect("unpublished changes poisoned")
    }

    /// Changes of earlier turns that no durable checkpoint holds yet; this turn's capture must
    /// include them.
    pub fn carried(&self) -> Carried {
        let unpublished = self.unpublished();
        let mut paths: Vec<ChangedPath> = unpublished
            .paths
            .range(..self.turn)
            .flat_map(|(_, p)| p.iter().cloned())
            .collect();
        paths.sort_by(|a, b| a.path.cmp(&b.path).then(b.created.cmp(&a.created)));
        paths.dedup_by(|later, earlier| later.path == earlier.path);
        Carried {
            paths,
            processes_of: unpublished.processes_since.filter(|t| *t < self.turn),
        }
    }

    /// Registers what this turn captures, so later turns take it in until it is durable.
    pub fn capturing(&self, changed: &[ChangedPath]) {
        if !changed.is_empty() {
            self.unpublished().paths.insert(self.turn, changed.to_vec());
        }
    }

    /// The capture is over (done or failed): the next turn may start.
    pub fn captured(&mut self) {
        if let Some(captured) = self.captured.take() {
            let _ = captured.send(true);
        }
    }

    /// Waits until the previous turn's checkpoint job is over (its write-out done or failed);
    /// releases the next turn first, so it never waits for a write-out.
    pub async fn previous_written(&mut self) {
        self.captured();
        if let Some(previous) = self.previous.take() {
            let _ = previous.await;
        }
    }

    /// This turn's checkpoint is durable: it holds its own changes and every carried one.
    pub fn published(&self, with_processes: bool) {
        let mut unpublished = self.unpublished();
        unpublished.paths.retain(|turn, _| *turn > self.turn);
        if with_processes && unpublished.processes_since.is_some_and(|t| t < self.turn) {
            unpublished.processes_since = None;
        }
    }

    /// This turn's process checkpoint failed: later turns dump the processes until one is durable.
    pub fn processes_lost(&self) {
        self.unpublished().processes_since.get_or_insert(self.turn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn paths(carried: &Carried) -> Vec<String> {
        carried.paths.iter().map(|p| String::from_utf8_lossy(&p.path).into_owned()).collect()
    }

    #[tokio::test]
    async fn next_turn_waits_for_the_capture_not_the_write_out() {
        let mut pipeline = TurnPipeline::new();
        let mut slot = pipeline.begin(1);
        let (release_write_out, write_out_may_finish) = tokio::sync::oneshot::channel::<()>();
        let job = tokio::spawn(async move {
            slot.captured();
            let _ = write_out_may_finish.await;
        });
        pipeline.set_job(job);
        tokio::time::timeout(Duration::from_secs(5), pipeline.capture_wait())
            .await
            .expect("the next turn starts while the write-out is still running");
        let mut next = pipeline.begin(2);
        let waiting = tokio::spawn(async move { next.previous_written().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "turn 2's write-out waits for turn 1's");
        release_write_out.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_turn_still_capturing_holds_the_next_one() {
        let mut pipeline = TurnPipeline::new();
        let slot = pipeline.begin(1);
        // Two execs starting together both wait.
        let waiters = [tokio::spawn(pipeline.capture_wait()), tokio::spawn(pipeline.capture_wait())];
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(waiters.iter().all(|w| !w.is_finished()));
        // A job that ends without signalling (an error, a panic) releases the next turn too.
        drop(slot);
        for waiter in waiters {
            tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        }
        // Once captured, later waits return at once.
        tokio::time::timeout(Duration::from_secs(5), pipeline.capture_wait()).await.unwrap();
    }

    #[test]
    fn changes_of_failed_checkpoints_are_carried_until_a_later_one_is_durable() {
        let mut pipeline = TurnPipeline::new();
        let one = pipeline.begin(1);
        one.capturing(&[ChangedPath::created("/a"), ChangedPath::modified("/b")]);
        let two = pipeline.begin(2);
        // Turn 1 is still being written: turn 2 takes its paths in, as they are now.
        assert_eq!(paths(&two.carried()), ["/a", "/b"]);
        assert!(two.carried().paths[0].created);
        two.capturing(&[ChangedPath::modified("/a"), ChangedPath::modified("/c")]);
        one.published(false);
        // Turn 2's checkpoint fails: turn 3 carries what turn 2 changed.
        two.processes_lost();
        let three = pipeline.begin(3);
        let carried = three.carried();
        assert_eq!(paths(&carried), ["/a", "/c"]);
        assert_eq!(carried.processes_of, Some(2));
        three.capturing(&carried.paths);
        three.published(true);
        let four = pipeline.begin(4);
        assert!(four.carried().is_empty(), "{:?}", four.carried());
    }

    #[test]
    fn an_fs_checkpoint_does_not_stand_for_lost_processes() {
        let mut pipeline = TurnPipeline::new();
        pipeline.begin(1).processes_lost();
        let two = pipeline.begin(2);
        two.published(false);
        assert_eq!(pipeline.begin(3).carried().processes_of, Some(1));
    }
}
