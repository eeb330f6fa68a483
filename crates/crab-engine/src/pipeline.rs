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
//!
//! The write-out draws the node's bandwidth chunk by chunk as its bytes go to the disk
//! ([`TurnSlot::write_out`]). A process checkpoint still waiting for bandwidth when a newer turn
//! of the same sandbox has captured a process dump is superseded (the node decides, see
//! [`crab_node::bucket`]): nothing of it is published. What it loses is nothing of the newest
//! state: the newer dump holds the processes, and the newer capture already took in the
//! superseded turn's paths, re-read as of the newer turn's end, because they were unpublished
//! when it captured (and they stay so until a checkpoint holding them is durable). What is lost
//! is a rollback to the superseded turn itself: its record says which turn superseded it, and
//! rollback and fork to it are refused with that reason.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::CommitGate;
use crab_node::{Acquired, CommitKind};
use crab_store::{
    ChangedPath, CheckpointError, CheckpointStore, CommitReport, Result, StagedTurn, TurnClass, WriteTokens,
};

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
        let mut paths: Vec<ChangedPath> =
            unpublished.paths.range(..self.turn).flat_map(|(_, p)| p.iter().cloned()).collect();
        paths.sort_by(|a, b| a.path.cmp(&b.path).then(b.created.cmp(&a.created)));
        paths.dedup_by(|later, earlier| later.path == earlier.path);
        Carried { paths, processes_of: unpublished.processes_since.filter(|t| *t < self.turn) }
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

    /// This turn's process capture (dump and file-system delta) is complete: waiting process
    /// write-outs of earlier turns of the sandbox, which it covers, may be dropped.
    pub async fn process_captured(&self, gate: Option<&dyn CommitGate>, sandbox: &str) {
        if let Some(gate) = gate {
            gate.process_captured(sandbox, self.turn).await;
        }
    }

    /// Writes the captured turn out (call after [`previous_written`](Self::previous_written)),
    /// drawing `gate`'s bandwidth chunk by chunk as the bytes go to the disk. A process
    /// checkpoint may be superseded while it waits: then nothing of it is published and its
    /// changes stay unpublished for the newer checkpoint that holds them.
    pub async fn write_out(
        &self,
        store: &Arc<CheckpointStore>,
        gate: Option<Arc<dyn CommitGate>>,
        sandbox: &str,
        staged: StagedTurn,
    ) -> Result<WrittenOut> {
        let with_processes = staged.class() == TurnClass::Proc;
        let mut ungated = None;
        let report = match gate {
            None => crate::blocking::on_store(store, move |store| store.publish(staged)).await?,
            Some(gate) => {
                let superseded = Arc::new(OnceLock::new());
                let ungated_because = Arc::new(OnceLock::new());
                let mut tokens = GateTokens {
                    chunk: gate.chunk_bytes().max(1),
                    gate,
                    runtime: tokio::runtime::Handle::current(),
                    sandbox: sandbox.to_string(),
                    turn: self.turn,
                    kind: if with_processes { CommitKind::Proc } else { CommitKind::Fs },
                    superseded: Arc::clone(&superseded),
                    ungated: Arc::clone(&ungated_because),
                };
                let paced =
                    crate::blocking::on_store(store, move |store| store.publish_paced(staged, &mut tokens)).await;
                ungated = ungated_because.get().cloned();
                match paced {
                    Ok(report) => report,
                    Err(CheckpointError::WriteOutStopped(_)) if superseded.get().is_some() => {
                        let by_turn = *superseded.get().expect("checked above");
                        tracing::info!(
                            sandbox,
                            turn = self.turn,
                            by_turn,
                            "process checkpoint superseded while waiting for bandwidth"
                        );
                        return Ok(WrittenOut::Superseded { by_turn });
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        self.published(with_processes);
        Ok(WrittenOut::Published { report, ungated })
    }
}

/// How a turn's write-out ended.
#[derive(Debug)]
pub enum WrittenOut {
    /// Durable. `ungated`: why some of its bytes went without the node's grant (crabd did not
    /// grant within the bound, or was unavailable).
    Published { report: CommitReport, ungated: Option<String> },
    /// Dropped for the newer process checkpoint of turn `by_turn`, which holds this turn's
    /// changes once it is durable.
    Superseded { by_turn: u64 },
}

/// The store's write-out drawing from the node's bucket: the store's code blocks, the gate is
/// async, so each draw waits on the runtime that started the write-out.
struct GateTokens {
    gate: Arc<dyn CommitGate>,
    runtime: tokio::runtime::Handle,
    sandbox: String,
    turn: u64,
    kind: CommitKind,
    chunk: u64,
    /// Set when the node dropped this write-out for a newer one.
    superseded: Arc<OnceLock<u64>>,
    /// Set when a draw went ungranted: the rest of the write-out does not ask again, so a node
    /// that stopped answering costs one bound per write-out, not one per chunk.
    ungated: Arc<OnceLock<String>>,
}

impl WriteTokens for GateTokens {
    fn chunk_bytes(&self) -> Option<u64> {
        Some(self.chunk)
    }

    fn draw(&mut self, bytes: u64) -> Result<()> {
        if self.ungated.get().is_some() {
            return Ok(());
        }
        let supersedable = self.kind == CommitKind::Proc;
        let acquired =
            self.runtime.block_on(self.gate.acquire(&self.sandbox, bytes, self.kind, self.turn, supersedable));
        match acquired {
            Acquired::Granted { .. } => Ok(()),
            Acquired::Ungated { reason, .. } => {
                let _ = self.ungated.set(reason);
                Ok(())
            }
            Acquired::Superseded { by_turn, .. } => {
                let _ = self.superseded.set(by_turn);
                Err(CheckpointError::WriteOutStopped(format!("turn {} superseded by turn {by_turn}", self.turn)))
            }
        }
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

    /// A node that grants every draw at once (recording it), except that a supersedable draw
    /// waits until a newer process capture of its sandbox is reported, and is then superseded.
    #[derive(Default)]
    struct HeldNode {
        captured: Mutex<Option<u64>>,
        reported: tokio::sync::Notify,
        draws: Mutex<Vec<(u64, u64)>>,
    }

    #[async_trait::async_trait]
    impl CommitGate for HeldNode {
        fn chunk_bytes(&self) -> u64 {
            8192
        }

        async fn acquire(
            &self,
            _sandbox: &str,
            bytes: u64,
            _kind: CommitKind,
            turn: u64,
            supersedable: bool,
        ) -> Acquired {
            loop {
                let notified = self.reported.notified();
                let newest = *self.captured.lock().unwrap();
                match newest {
                    Some(by_turn) if supersedable && by_turn > turn => {
                        return Acquired::Superseded { by_turn, waited_ms: 0.0 };
                    }
                    _ if !supersedable => {
                        self.draws.lock().unwrap().push((turn, bytes));
                        return Acquired::Granted { waited_ms: 0.0 };
                    }
                    _ => notified.await,
                }
            }
        }

        async fn process_captured(&self, _sandbox: &str, turn: u64) {
            *self.captured.lock().unwrap() = Some(turn);
            self.reported.notify_waiters();
        }
    }

    fn write(root: &std::path::Path, name: &str, data: &[u8]) {
        std::fs::write(root.join(name), data).unwrap();
    }

    /// A flat directory standing for a CRIU dump (the store only needs regular files).
    fn dump_dir(parent: &std::path::Path, turn: u64) -> std::path::PathBuf {
        let dir = parent.join(format!("dump-{turn}"));
        std::fs::create_dir(&dir).unwrap();
        // Distinct pages (a linear congruential sequence), so no chunk deduplicates.
        let mut x = turn as u32;
        let pages: Vec<u8> = (0..40_000)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect();
        write(&dir, "pages-1.img", &pages);
        write(&dir, "core-1.img", format!("core of turn {turn}").as_bytes());
        dir
    }

    /// Turn 1's process checkpoint waits for bandwidth when turn 2 captures a newer dump: turn 1
    /// is dropped, turn 2's checkpoint holds turn 1's paths as of turn 2, and it was written in
    /// draws of at most the node's chunk.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_superseded_process_checkpoint_leaves_its_paths_to_the_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        let (state, root, dumps) = (dir.path().join("state"), dir.path().join("root"), dir.path().join("dumps"));
        for d in [&root, &dumps] {
            std::fs::create_dir_all(d).unwrap();
        }
        let store = Arc::new(CheckpointStore::open(&state).unwrap());
        let node = Arc::new(HeldNode::default());
        let gate: Arc<dyn CommitGate> = node.clone();
        let stage = |turn: u64, changed: Vec<ChangedPath>, images: std::path::PathBuf| {
            let (store, root) = (store.clone(), root.clone());
            async move {
                crate::blocking::on_store(&store, move |s| {
                    s.stage_turn(&crab_store::TurnInput {
                        container: "c1",
                        turn,
                        rootfs: Some(&root),
                        changed: &changed,
                        criu_images: Some(&images),
                    })
                })
                .await
                .unwrap()
            }
        };
        let mut pipeline = TurnPipeline::new();

        write(&root, "a", b"a as of turn 1");
        let mut one = pipeline.begin(1);
        let changed_one = vec![ChangedPath::created("/a")];
        one.capturing(&changed_one);
        let staged_one = stage(1, changed_one, dump_dir(&dumps, 1)).await;
        one.process_captured(Some(gate.as_ref()), "c1").await;
        one.previous_written().await;
        let job_one = {
            let (store, gate) = (store.clone(), gate.clone());
            tokio::spawn(
                async move { one.write_out(&store, Some(gate), "c1", staged_one).await.map(|w| format!("{w:?}")) },
            )
        };

        // Turn 2 changes a again and makes b; it carries turn 1's unwritten paths.
        write(&root, "a", b"a as of turn 2");
        write(&root, "b", b"b of turn 2");
        let two = pipeline.begin(2);
        let carried = two.carried();
        assert_eq!(paths(&carried), ["/a"], "turn 1's paths are carried while it is not durable");
        let mut changed_two = vec![ChangedPath::created("/b")];
        changed_two.extend(carried.paths);
        two.capturing(&changed_two);
        let staged_two = stage(2, changed_two, dump_dir(&dumps, 2)).await;
        assert!(!job_one.is_finished(), "turn 1 waits for bandwidth");
        two.process_captured(Some(gate.as_ref()), "c1").await;
        let one_ended = tokio::time::timeout(Duration::from_secs(10), job_one).await.unwrap().unwrap().unwrap();
        assert_eq!(one_ended, "Superseded { by_turn: 2 }");
        assert!(store.head("c1").unwrap().is_none(), "nothing of turn 1 is published");

        // Turn 2 is not superseded by its own report, and is written in bounded draws.
        let gate_two: Arc<dyn CommitGate> = Arc::new(Ungated(node.clone()));
        let written = two.write_out(&store, Some(gate_two), "c1", staged_two).await.unwrap();
        let WrittenOut::Published { report, ungated: None } = written else { panic!("turn 2: {written:?}") };
        let draws = node.draws.lock().unwrap().clone();
        assert!(draws.len() >= 5 && draws.iter().all(|(turn, bytes)| *turn == 2 && *bytes <= 8192), "{draws:?}");
        assert_eq!(
            draws.iter().map(|d| d.1).sum::<u64>(),
            report.traffic.written_bytes + report.manifest_bytes,
            "every new byte drawn once, the manifest's too"
        );

        let history = store.history("c1").unwrap();
        assert_eq!(history.iter().map(|c| c.turn).collect::<Vec<_>>(), [2]);
        let target = dir.path().join("restored");
        std::fs::create_dir(&target).unwrap();
        store.materialize("c1", 2, &target).unwrap();
        assert_eq!(std::fs::read(target.join("a")).unwrap(), b"a as of turn 2");
        assert_eq!(std::fs::read(target.join("b")).unwrap(), b"b of turn 2");
        assert!(pipeline.begin(3).carried().is_empty(), "turn 2 holds everything");
        assert_eq!(std::fs::read_dir(state.join("tmp")).unwrap().count(), 0, "the dropped write-out left no tmp files");
    }

    /// A gate that never supersedes: the turn that reported the newest capture draws through it.
    struct Ungated(Arc<HeldNode>);

    #[async_trait::async_trait]
    impl CommitGate for Ungated {
        fn chunk_bytes(&self) -> u64 {
            self.0.chunk_bytes()
        }

        async fn acquire(
            &self,
            sandbox: &str,
            bytes: u64,
            kind: CommitKind,
            turn: u64,
            _supersedable: bool,
        ) -> Acquired {
            self.0.acquire(sandbox, bytes, kind, turn, false).await
        }

        async fn process_captured(&self, sandbox: &str, turn: u64) {
            self.0.process_captured(sandbox, turn).await
        }
    }

    /// A node that stopped answering: every draw ends ungranted after its bound.
    #[derive(Default)]
    struct SilentNode {
        asked: Mutex<u64>,
    }

    #[async_trait::async_trait]
    impl CommitGate for SilentNode {
        fn chunk_bytes(&self) -> u64 {
            4096
        }

        async fn acquire(
            &self,
            _sandbox: &str,
            _bytes: u64,
            _kind: CommitKind,
            _turn: u64,
            _supersedable: bool,
        ) -> Acquired {
            *self.asked.lock().unwrap() += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
            Acquired::Ungated { waited_ms: 200.0, reason: "no grant within the bound".into() }
        }

        async fn process_captured(&self, _sandbox: &str, _turn: u64) {}
    }

    /// A write-out of many chunks against a node that does not answer waits for one bound, not
    /// one per chunk, is published, and says that it went without a grant.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_node_costs_a_write_out_one_bound_and_the_report_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let (state, root, dumps) = (dir.path().join("state"), dir.path().join("root"), dir.path().join("dumps"));
        for d in [&root, &dumps] {
            std::fs::create_dir_all(d).unwrap();
        }
        let store = Arc::new(CheckpointStore::open(&state).unwrap());
        let images = dump_dir(&dumps, 1);
        write(&root, "a", b"a");
        let changed = vec![ChangedPath::created("/a")];
        let staged = {
            let root = root.clone();
            crate::blocking::on_store(&store, move |s| {
                s.stage_turn(&crab_store::TurnInput {
                    container: "c1",
                    turn: 1,
                    rootfs: Some(&root),
                    changed: &changed,
                    criu_images: Some(&images),
                })
            })
            .await
            .unwrap()
        };
        let node = Arc::new(SilentNode::default());
        let mut pipeline = TurnPipeline::new();
        let mut one = pipeline.begin(1);
        one.previous_written().await;
        let started = std::time::Instant::now();
        let written = one.write_out(&store, Some(node.clone() as Arc<dyn CommitGate>), "c1", staged).await.unwrap();
        let WrittenOut::Published { report, ungated: Some(reason) } = written else { panic!("{written:?}") };
        assert!(report.traffic.written_bytes > 8 * 4096, "many chunks: {}", report.traffic.written_bytes);
        assert_eq!(*node.asked.lock().unwrap(), 1, "asked once, then written without asking");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert!(reason.contains("no grant"), "{reason}");
        assert_eq!(store.head("c1").unwrap().map(|h| h.turn), Some(1));
    }

    #[test]
    fn when_the_superseding_checkpoint_fails_the_next_turn_carries_both() {
        let mut pipeline = TurnPipeline::new();
        let one = pipeline.begin(1);
        one.capturing(&[ChangedPath::created("/a")]);
        // Turn 1 superseded: neither published nor failed.
        let two = pipeline.begin(2);
        let mut changed = vec![ChangedPath::modified("/b")];
        changed.extend(two.carried().paths);
        two.capturing(&changed);
        two.processes_lost();
        let carried = pipeline.begin(3).carried();
        assert_eq!(paths(&carried), ["/a", "/b"]);
        assert!(carried.paths[0].created, "a stays created: captured whole");
        assert_eq!(carried.processes_of, Some(2));
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
