//! One agent sandbox: a containerd container running `sleep infinity`, into
//! which each turn is exec'd, driven through `ctr` as a user of containerd would.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tracing::{debug, warn};

use super::archive::Descriptor;
use super::fingerprint::{Fingerprint, FingerprintError, ReadCache, Scope, pids_of_sandbox};
use super::injector::task_entry;
use super::settle::{Activity, Settled, Settling};
use super::shell::{ReplayMode, SessionError, StdinSession, TMUX_TURN_SCRIPT, TMUX_UNAVAILABLE};
use crab_containerd::{Ctr, CtrError};

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    Ctr(#[from] CtrError),
    #[error("sandbox {container}: `ctr` could not run the turn: {stderr}")]
    ExecFailed { container: String, stderr: String },
    #[error("checkpoint {reference}: {problem}")]
    Checkpoint { reference: String, problem: String },
    #[error("sandbox {container}: fingerprint: {source}")]
    Fingerprint {
        container: String,
        #[source]
        source: FingerprintError,
    },
    #[error("sandbox {container}: {problem}")]
    Task { container: String, problem: String },
    #[error("sandbox {container}: {source}")]
    Session {
        container: String,
        #[source]
        source: SessionError,
    },
}

/// What a sandbox is made from.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub image: String,
    pub runtime: String,
    pub workdir: String,
    /// OCI annotations, e.g. `io.crab.policy` to choose what the crab shim itself saves.
    pub annotations: Vec<(String, String)>,
    /// Container paths the fingerprint leaves out besides its own volatile ones (the trace's
    /// declared ignores).
    pub ignore: Vec<String>,
    /// Host directories the sandbox sees read-only: (host path, container path). State the
    /// sandbox does not own and cannot change (package sources), left out of its fingerprint.
    pub read_only_binds: Vec<(PathBuf, String)>,
    /// How each turn's command reaches the sandbox.
    pub mode: ReplayMode,
    /// A crab config of the sandbox's own (its runtime options' `ConfigPath`): a run that
    /// will lose its node keeps its store there (see [`crate::node::NodeA`]).
    pub runtime_config: Option<PathBuf>,
}

/// The agent-visible result of one exec'd command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecResult {
    /// `None` when the command was stopped at its timeout.
    pub rc: Option<i32>,
    pub timed_out: bool,
    pub duration: Duration,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// stdin mode: the shell's state as the command found it (empty in the other modes).
    pub shell: String,
}

/// A checkpoint image in containerd's content store.
#[derive(Debug, Clone)]
pub struct CheckpointImage {
    pub reference: String,
    /// The checkpoint's index blob.
    pub index: Descriptor,
    /// What the checkpoint wrote: the index and every blob it lists but the
    /// base image's manifest, which the checkpoint only names.
    pub blobs: Vec<Descriptor>,
    pub bytes: u64,
}

/// containerd's media type for the CRIU image of a task checkpoint.
const CRIU_CHECKPOINT_MEDIA_TYPE: &str = "application/vnd.containerd.container.criu.checkpoint.criu.tar";
/// The index `ctr c checkpoint` writes (containerd's `writeIndex`).
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// An entry of a checkpoint index of one of these types is its base image.
const IMAGE_MEDIA_TYPES: [&str; 4] = [
    "application/vnd.oci.image.manifest.v1+json",
    INDEX_MEDIA_TYPE,
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];
/// Whether a descriptor of `media_type` is a manifest or an index (which a registry keeps
/// apart from the repository's blobs).
pub fn is_manifest_type(media_type: &str) -> bool {
    IMAGE_MEDIA_TYPES.contains(&media_type)
}

/// The descriptors a manifest or index names: an index's entries, a manifest's config and
/// layers; nothing for any other blob. What containerd's push walks to find what to send.
pub fn children(descriptor: &Descriptor, content: &[u8]) -> Result<Vec<Descriptor>, serde_json::Error> {
    #[derive(Deserialize)]
    struct Named {
        #[serde(default)]
        manifests: Vec<Descriptor>,
        config: Option<Descriptor>,
        #[serde(default)]
        layers: Vec<Descriptor>,
    }
    if !is_manifest_type(&descriptor.media_type) {
        return Ok(Vec::new());
    }
    let named: Named = serde_json::from_slice(content)?;
    Ok(named.manifests.into_iter().chain(named.config).chain(named.layers).collect())
}

impl CheckpointImage {
    /// Everything `ctr images push` of this image sends to a registry that holds none of it,
    /// each digest once: the index, every entry, and where an entry is an image manifest (a
    /// base image the index lists; containerd 1.6 only names it by annotation) its config and
    /// layers, read from `ctr`'s content store.
    pub async fn push_set(&self, ctr: &Ctr) -> Result<Vec<Descriptor>, SandboxError> {
        let mut set: Vec<Descriptor> = Vec::new();
        let mut pending = vec![self.index.clone()];
        while let Some(descriptor) = pending.pop() {
            if set.iter().any(|seen| seen.digest == descriptor.digest) {
                continue;
            }
            if is_manifest_type(&descriptor.media_type) {
                let content = ctr.run(&["content", "get", &descriptor.digest]).await?.stdout;
                let named = children(&descriptor, &content).map_err(|error| SandboxError::Checkpoint {
                    reference: self.reference.clone(),
                    problem: format!("{} {} does not parse: {error}", descriptor.media_type, descriptor.digest),
                })?;
                pending.extend(named.into_iter().rev());
            }
            set.push(descriptor);
        }
        Ok(set)
    }
}

/// How long `ctr` may go on after a turn's timeout: enough for the SIGKILLed
/// command to be reaped, not for background children that keep its output open.
const KILL_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub struct Sandbox {
    ctr: Ctr,
    id: String,
    spec: SandboxSpec,
    next_exec: u64,
    /// What the fingerprint read of files and directories, reused while their inodes are unchanged.
    reads: ReadCache,
    /// What the fingerprint looks at, from the container's spec (read at the first look: a
    /// container's spec does not change).
    scope: Option<Scope>,
    /// Its init's host pid, asked of containerd at the first exec or settle (a handle's init
    /// never changes: a recovered container gets a handle of its own).
    init: Option<u32>,
    /// Which of its processes were last seen quiet (see [`Sandbox::settle`]).
    settling: Settling,
    /// stdin mode: the shell session the commands are written to.
    session: Option<StdinSession>,
    /// stdin mode: the exec id of the last session started, and how many
    /// commands were written to it (a crab turn record is made per command).
    session_exec: Option<(String, u64)>,
}

impl Sandbox {
    /// Starts a new container from the spec's image.
    pub async fn create(ctr: &Ctr, id: &str, spec: &SandboxSpec) -> Result<Sandbox, SandboxError> {
        let mut args = vec!["run".to_string(), "-d".to_string(), "--runtime".to_string(), spec.runtime.clone()];
        for (key, value) in &spec.annotations {
            args.push("--annotation".to_string());
            args.push(format!("{key}={value}"));
        }
        for (host, at) in &spec.read_only_binds {
            args.push("--mount".to_string());
            args.push(format!("type=bind,src={},dst={at},options=rbind:ro", host.display()));
        }
        if let Some(config) = &spec.runtime_config {
            args.push("--runtime-config-path".to_string());
            args.push(config.display().to_string());
        }
        args.extend([spec.image.clone(), id.to_string(), "sleep".to_string(), "infinity".to_string()]);
        ctr.run(&args).await?;
        debug!(container = id, image = %spec.image, runtime = %spec.runtime, "sandbox created");
        Ok(Sandbox::handle(ctr, id, spec, 0, None))
    }

    /// Recreates container `id` from a checkpoint image, processes and rw layer included.
    pub async fn restore(ctr: &Ctr, id: &str, spec: &SandboxSpec, reference: &str) -> Result<Sandbox, SandboxError> {
        ctr.run(&["containers", "restore", "--live", "--rw", id, reference]).await?;
        debug!(container = id, checkpoint = reference, "sandbox restored");
        Ok(Sandbox::handle(ctr, id, spec, 0, None))
    }

    /// A handle on container `id`, already running (recreated by someone
    /// else, under the same id): exec ids go on from `previous`'s, so the
    /// sandbox's turn log never sees one twice.
    pub fn attach(previous: &Sandbox) -> Sandbox {
        Sandbox::attach_on(&previous.ctr, previous)
    }

    /// [`Sandbox::attach`] to the container recreated through `ctr` (another node's containerd).
    pub fn attach_on(ctr: &Ctr, previous: &Sandbox) -> Sandbox {
        Sandbox::handle(ctr, &previous.id, &previous.spec, previous.next_exec, previous.session_exec.clone())
    }

    /// A handle on a container as it is now: what the handle learnt of an earlier one (the
    /// files it read, its init, which processes were quiet) is not carried over.
    fn handle(ctr: &Ctr, id: &str, spec: &SandboxSpec, next_exec: u64, session_exec: Option<(String, u64)>) -> Sandbox {
        Sandbox {
            ctr: ctr.clone(),
            id: id.to_string(),
            spec: spec.clone(),
            next_exec,
            reads: ReadCache::default(),
            scope: None,
            init: None,
            settling: Settling::default(),
            session: None,
            session_exec,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn spec(&self) -> &SandboxSpec {
        &self.spec
    }

    /// The containerd this sandbox runs on.
    pub fn ctr(&self) -> &Ctr {
        &self.ctr
    }

    /// How many exec ids this sandbox handed out (`replay-1` to `replay-N`).
    pub fn execs_made(&self) -> u64 {
        self.next_exec
    }

    /// A sandbox restored from a checkpoint of one that made `made` execs:
    /// its exec ids go on after theirs. The runtime keeps restored exec
    /// sessions by id, so reusing one would attach to the restored process
    /// instead of starting a new one.
    pub fn with_exec_ids_after(mut self, made: u64) -> Sandbox {
        self.next_exec = self.next_exec.max(made);
        self
    }

    /// The exec id of the last command run, if any.
    pub fn last_exec_id(&self) -> Option<String> {
        (self.next_exec > 0).then(|| format!("replay-{}", self.next_exec))
    }

    pub fn mode(&self) -> ReplayMode {
        self.spec.mode
    }

    /// The exec id the runtime's record of the last turn carries, and how
    /// many turns that exec made so far: the last command's exec (1) in exec
    /// and tmux mode, the shell session and the commands written to it in stdin mode.
    pub fn last_turn_exec(&self) -> Option<(String, u64)> {
        match self.spec.mode {
            ReplayMode::Stdin => self.session_exec.clone(),
            ReplayMode::Exec | ReplayMode::Tmux => self.last_exec_id().map(|id| (id, 1)),
        }
    }

    /// After a recovery, stdin mode needs its shell again: with `reattach`
    /// (the runtime restored the exec sessions and holds them by id) the same
    /// exec id is asked for, which re-attaches the restored shell; else a new
    /// session is started. Either way before the oracle looks, so that its
    /// fingerprint sees the shell the agent's next command goes to.
    pub async fn resume_shell(&mut self, reattach: bool) -> Result<(), SandboxError> {
        if self.spec.mode != ReplayMode::Stdin {
            return Ok(());
        }
        // A session whose client survived the fault (the task kept running) goes on as it is.
        if reattach
            && let Some(session) = &self.session
            && !session.exited().await
        {
            return Ok(());
        }
        if let Some(session) = self.session.take() {
            session.close();
        }
        match self.session_exec.clone() {
            Some((exec_id, turns)) if reattach => self.start_session(exec_id, turns).await?,
            _ => {
                self.next_exec += 1;
                self.start_session(format!("replay-{}", self.next_exec), 0).await?;
            }
        }
        Ok(())
    }

    async fn start_session(&mut self, exec_id: String, turns: u64) -> Result<(), SandboxError> {
        let session = StdinSession::start(&self.ctr, &self.id, &exec_id, &self.spec.workdir)
            .await
            .map_err(|source| SandboxError::Session { container: self.id.clone(), source })?;
        debug!(container = %self.id, exec = %exec_id, "shell session started");
        self.session = Some(session);
        self.session_exec = Some((exec_id, turns));
        Ok(())
    }

    fn exec_args(&mut self, argv: &[&str]) -> (String, Vec<String>) {
        self.next_exec += 1;
        let exec_id = format!("replay-{}", self.next_exec);
        let mut args = vec![
            "tasks".to_string(),
            "exec".to_string(),
            "--exec-id".to_string(),
            exec_id.clone(),
            "--cwd".to_string(),
            self.spec.workdir.clone(),
            self.id.clone(),
        ];
        args.extend(argv.iter().map(|arg| arg.to_string()));
        (exec_id, args)
    }

    /// Runs one turn's command the way the sandbox's mode says.
    pub async fn exec(&mut self, cmd: &str, timeout: Duration) -> Result<ExecResult, SandboxError> {
        let init = self.init_pid().await;
        let pids_of = |init: Option<u32>| -> BTreeSet<u32> {
            init.and_then(|init| pids_of_sandbox(init).ok()).unwrap_or_default().into_iter().collect()
        };
        let before = pids_of(init);
        let result = match self.spec.mode {
            ReplayMode::Exec => self.exec_once(cmd, timeout).await,
            ReplayMode::Stdin => self.exec_stdin(cmd, timeout).await,
            ReplayMode::Tmux => self.exec_tmux(cmd, timeout).await,
        }?;
        // What the command started and its timeout left running goes on at its own pace.
        if result.timed_out {
            self.settling.abandon(pids_of(init).difference(&before).copied());
        }
        Ok(result)
    }

    /// The host pid of the container's init, asked of containerd once per handle.
    async fn init_pid(&mut self) -> Option<u32> {
        if self.init.is_none() {
            match self.ctr.run(&["tasks", "ls"]).await {
                Ok(listing) => self.init = task_entry(&listing.stdout_text(), &self.id).map(|(init, _)| init),
                Err(error) => debug!(container = %self.id, %error, "no task listed"),
            }
        }
        self.init
    }

    /// Writes `cmd` to the shell session (started first if there is none, or
    /// the last one ended). At `timeout` the session is killed, as an agent
    /// framework restarts a shell that stopped answering; so is one that exited.
    async fn exec_stdin(&mut self, cmd: &str, timeout: Duration) -> Result<ExecResult, SandboxError> {
        if let Some(session) = &self.session
            && session.exited().await
        {
            self.session.take().expect("checked").close();
        }
        if self.session.is_none() {
            self.next_exec += 1;
            self.start_session(format!("replay-{}", self.next_exec), 0).await?;
        }
        if let Some((_, turns)) = self.session_exec.as_mut() {
            *turns += 1;
        }
        let started = Instant::now();
        let session = self.session.as_mut().expect("started above");
        let turn = session
            .run(cmd, timeout)
            .await
            .map_err(|source| SandboxError::Session { container: self.id.clone(), source })?;
        let duration = started.elapsed();
        if turn.ended {
            let session = self.session.take().expect("ran above");
            if turn.timed_out {
                self.kill_exec(&session.exec_id).await;
            }
            session.close();
        }
        Ok(ExecResult {
            rc: turn.rc,
            timed_out: turn.timed_out,
            duration,
            stdout: turn.stdout,
            stderr: turn.stderr,
            shell: turn.shell,
        })
    }

    /// Types `cmd` into the sandbox's tmux session with one exec that waits
    /// for the command's signal and prints the pane; the command's output is
    /// the pane between its marks (stdout and stderr mixed, as a terminal shows them).
    async fn exec_tmux(&mut self, cmd: &str, timeout: Duration) -> Result<ExecResult, SandboxError> {
        let nonce = super::shell::nonce();
        let line = super::shell::tmux_line(cmd, &nonce);
        let workdir = self.spec.workdir.clone();
        let (exec_id, args) = self.exec_args(&[
            "bash",
            "-c",
            TMUX_TURN_SCRIPT,
            "crab-tmux",
            line.as_str(),
            nonce.as_str(),
            workdir.as_str(),
        ]);
        let started = Instant::now();
        let finished = {
            let run = self.ctr.run_raw(&args, timeout + KILL_GRACE);
            tokio::pin!(run);
            tokio::select! {
                output = &mut run => Some(output?),
                _ = tokio::time::sleep(timeout) => {
                    self.kill_exec(&exec_id).await;
                    let _ = run.await;
                    None
                }
            }
        };
        let (output, timed_out) = match finished {
            Some(output) => (output, false),
            None => {
                // Interrupt the command in the pane, as a user at the terminal would.
                let session = super::shell::TMUX_SESSION;
                let interrupt = format!(
                    "tmux send-keys -t {session} C-c; tmux capture-pane -p -J -S - -E - -t {session}; tmux clear-history -t {session}"
                );
                let (_, args) = self.exec_args(&["bash", "-c", interrupt.as_str()]);
                (self.ctr.run_raw(&args, KILL_GRACE * 5).await?, true)
            }
        };
        let duration = started.elapsed();
        if !timed_out && is_ctr_failure(output.code, &output.stderr) {
            return Err(SandboxError::ExecFailed { container: self.id.clone(), stderr: output.stderr_text() });
        }
        if output.code == Some(TMUX_UNAVAILABLE) {
            return Err(SandboxError::Task {
                container: self.id.clone(),
                problem: format!("tmux mode cannot run here: {}", output.stderr_text().trim()),
            });
        }
        let pane = String::from_utf8_lossy(&output.stdout);
        let parsed = super::shell::parse_pane(&pane, &nonce);
        let (shell, stdout, rc) = match (parsed, timed_out) {
            (Some((text, rc)), false) => {
                let (shell, stdout) = super::shell::split_shell_state(text.as_bytes(), &nonce);
                (shell, stdout, Some(rc))
            }
            (_, true) => (String::new(), output.stdout, None),
            (None, false) => {
                return Err(SandboxError::Task {
                    container: self.id.clone(),
                    problem: format!("the tmux pane does not show the command's end mark: {pane:?}"),
                });
            }
        };
        Ok(ExecResult { rc, timed_out, duration, stdout, stderr: Vec::new(), shell })
    }

    /// Runs `bash -c CMD` in the workdir; at `timeout` the command is SIGKILLed.
    async fn exec_once(&mut self, cmd: &str, timeout: Duration) -> Result<ExecResult, SandboxError> {
        // `ctr tasks exec` never closes the process's stdin, so a command that
        // reads it (a `tail` whose file argument slipped to the next line) would
        // hang until its timeout; agents run commands with stdin at EOF.
        let (exec_id, args) = self.exec_args(&["bash", "-c", "exec bash -c \"$1\" </dev/null", "crab-turn", cmd]);
        let started = Instant::now();
        let run = self.ctr.run_raw(&args, timeout + KILL_GRACE);
        tokio::pin!(run);
        let (output, timed_out) = tokio::select! {
            output = &mut run => (output?, false),
            _ = tokio::time::sleep(timeout) => {
                self.kill_exec(&exec_id).await;
                (run.await?, true)
            }
        };
        let duration = started.elapsed();
        if !timed_out && is_ctr_failure(output.code, &output.stderr) {
            return Err(SandboxError::ExecFailed { container: self.id.clone(), stderr: output.stderr_text() });
        }
        Ok(ExecResult {
            rc: if timed_out { None } else { output.code },
            timed_out,
            duration,
            stdout: output.stdout,
            stderr: output.stderr,
            shell: String::new(),
        })
    }

    async fn kill_exec(&self, exec_id: &str) {
        let killed = self.ctr.run(&["tasks", "kill", "--exec-id", exec_id, "--signal", "SIGKILL", &self.id]).await;
        match killed {
            Ok(_) => {}
            // The command itself exited; background children still hold its output open.
            Err(CtrError::Failed { stderr, .. }) if stderr.contains("not found") => {}
            Err(error) => {
                warn!(container = %self.id, exec = exec_id, %error, "could not kill a timed-out command")
            }
        }
    }

    /// Waits, up to `bound`, until the processes a turn left running are quiet (see
    /// [`crate::settle`]), so that what they wrote is the same whenever the sandbox is saved
    /// and looked at. A sandbox whose task cannot be listed has nothing to wait for.
    pub async fn settle(&mut self, bound: Duration) -> Settled {
        let Some(init) = self.init_pid().await else { return Settled { waited: Duration::ZERO, settled: true } };
        self.settling.settle(bound, || Activity::sample(init)).await
    }

    /// The whole sandbox as [`Fingerprint::capture`] sees it from the host.
    pub async fn fingerprint(&mut self) -> Result<Fingerprint, SandboxError> {
        let task = |problem: String| SandboxError::Task { container: self.id.clone(), problem };
        let listing = self.ctr.run(&["tasks", "ls"]).await?.stdout_text();
        let (init, status) = task_entry(&listing, &self.id).ok_or_else(|| task("has no task".to_string()))?;
        if status != "RUNNING" {
            return Err(task(format!("its task is {status}, not RUNNING")));
        }
        let scope = match &self.scope {
            Some(scope) => scope.clone(),
            None => {
                let info = self.ctr.run(&["containers", "info", &self.id]).await?.stdout;
                let spec = serde_json::from_slice::<serde_json::Value>(&info)
                    .ok()
                    .and_then(|info| info.get("Spec").map(serde_json::to_vec))
                    .and_then(Result::ok)
                    .ok_or_else(|| task("`ctr containers info` shows no spec".to_string()))?;
                let mounts = crab_store::SandboxMounts::from_spec(&spec).map_err(task)?;
                let scope = Scope::new(&mounts, &self.spec.ignore)
                    .map_err(|source| SandboxError::Fingerprint { container: self.id.clone(), source })?;
                self.scope.insert(scope).clone()
            }
        };
        wait_for_exec(init).await;
        let mut reads = std::mem::take(&mut self.reads);
        let (captured, reads) = tokio::task::spawn_blocking(move || {
            let captured = Fingerprint::capture(init, &scope, &mut reads);
            (captured, reads)
        })
        .await
        .map_err(|error| task(format!("the fingerprint's thread failed: {error}")))?;
        self.reads = reads;
        captured.map_err(|source| SandboxError::Fingerprint { container: self.id.clone(), source })
    }

    /// The fault: SIGKILL every process of the container, as an OOM kill or a
    /// crashed node would. The dead container stays until [`Sandbox::remove`].
    pub async fn kill_all(&self) -> Result<(), SandboxError> {
        self.ctr.run(&["tasks", "kill", "--all", "--signal", "SIGKILL", &self.id]).await?;
        Ok(())
    }

    /// Deletes the task (killing what still runs) and the container with its rw snapshot.
    pub async fn remove(mut self) -> Result<(), SandboxError> {
        if let Some(session) = self.session.take() {
            session.close();
        }
        remove_container(&self.ctr, &self.id).await
    }

    /// `ctr c checkpoint --task --rw`: processes (CRIU) plus the rw layer, into image `reference`.
    pub async fn checkpoint(&self, reference: &str) -> Result<CheckpointImage, SandboxError> {
        self.ctr.run(&["containers", "checkpoint", "--task", "--rw", &self.id, reference]).await?;
        let problem = |problem: String| SandboxError::Checkpoint { reference: reference.to_string(), problem };
        let digest =
            self.ctr.image_digest(reference).await?.ok_or_else(|| problem("the image was not created".to_string()))?;
        let index_blob = self.ctr.run(&["content", "get", &digest]).await?.stdout;
        let parsed: CheckpointIndex = serde_json::from_slice(&index_blob)
            .map_err(|error| problem(format!("index {digest} is not an OCI index: {error}")))?;
        parsed.check().map_err(|why| problem(format!("index {digest}: {why}")))?;
        let index = Descriptor { media_type: INDEX_MEDIA_TYPE.to_string(), digest, size: index_blob.len() as u64 };
        let mut blobs = vec![index.clone()];
        blobs.extend(parsed.manifests.into_iter().filter(|m| !IMAGE_MEDIA_TYPES.contains(&m.media_type.as_str())));
        let bytes = blobs.iter().map(|blob| blob.size).sum();
        Ok(CheckpointImage { reference: reference.to_string(), index, blobs, bytes })
    }

    /// Recreates container `id` from a checkpoint kept out of containerd:
    /// imports the archive as image `reference` (blobs checked against their
    /// digests on the way in), then restores from it.
    pub async fn restore_from_archive(
        ctr: &Ctr,
        id: &str,
        spec: &SandboxSpec,
        reference: &str,
        archive: &std::path::Path,
    ) -> Result<Sandbox, SandboxError> {
        // The image is a checkpoint, not a rootfs: nothing to unpack.
        let archive = archive.to_string_lossy();
        ctr.run(&["images", "import", "--no-unpack", archive.as_ref()]).await?;
        if ctr.image_digest(reference).await?.is_none() {
            return Err(SandboxError::Checkpoint {
                reference: reference.to_string(),
                problem: format!("importing {archive} did not create the image"),
            });
        }
        Sandbox::restore(ctr, id, spec, reference).await
    }

    /// Recreates container `id` from a checkpoint image in a registry: `ctr content fetch` of
    /// `reference` (containerd's pull without the unpack, which a checkpoint index, not a rootfs,
    /// fails: `ctr images pull` of one stores the image, then exits 1 with "unexpected media
    /// type"), then restores from it. The base image it names must be on the node already.
    pub async fn restore_from_registry(
        ctr: &Ctr,
        id: &str,
        spec: &SandboxSpec,
        reference: &str,
        flags: &[String],
    ) -> Result<Sandbox, SandboxError> {
        let mut args = vec!["content".to_owned(), "fetch".to_owned()];
        args.extend(flags.iter().cloned());
        args.push(reference.to_owned());
        ctr.run(&args).await?;
        if ctr.image_digest(reference).await?.is_none() {
            return Err(SandboxError::Checkpoint {
                reference: reference.to_string(),
                problem: "fetching it from the registry did not create the image".to_string(),
            });
        }
        Sandbox::restore(ctr, id, spec, reference).await
    }
}

/// A sandbox that was just started or recovered shows its init as `runc init` until the
/// runtime lets it exec its command (a while, under load): that is not a state of the
/// sandbox, so it is waited for, for at most 5 s.
async fn wait_for_exec(init: u32) {
    for _ in 0..100 {
        match std::fs::read(format!("/proc/{init}/cmdline")) {
            Ok(cmdline) if cmdline == b"runc\0init\0" => tokio::time::sleep(Duration::from_millis(50)).await,
            _ => return,
        }
    }
}

#[derive(Deserialize)]
struct CheckpointIndex {
    manifests: Vec<Descriptor>,
}

impl CheckpointIndex {
    /// Whether the index names every part of a checkpoint that restores. containerd 1.6
    /// loses a part without an error when one of its blobs is already stored: the task part
    /// when it is the spec of an earlier checkpoint of the same container (a checkpoint that
    /// could not restore processes must not pass), and the descriptor of the runtime options
    /// of a restored container, empty bytes every time, whenever something keeps that blob
    /// (a lease left by a `ctr` that was killed keeps what it wrote for 24 hours).
    fn check(&self) -> Result<(), String> {
        if let Some(entry) = self.manifests.iter().find(|entry| entry.digest.is_empty()) {
            return Err(format!(
                "its {} entry has no digest (containerd 1.6 writes a blob it finds already stored this way; \
                 a lease a killed `ctr` left keeps blobs stored: `ctr leases ls`, `ctr leases rm --sync ID`)",
                entry.media_type
            ));
        }
        if !self.manifests.iter().any(|entry| entry.media_type == CRIU_CHECKPOINT_MEDIA_TYPE) {
            return Err("containerd stored no CRIU image (task part missing)".to_string());
        }
        Ok(())
    }
}

/// Removes a container by id whatever state it is in; absent is fine.
pub async fn remove_container(ctr: &Ctr, id: &str) -> Result<(), SandboxError> {
    ignore_not_found(ctr.run(&["tasks", "delete", "--force", id]).await)?;
    ignore_not_found(ctr.run(&["containers", "delete", id]).await)?;
    Ok(())
}

/// Removes an image and waits for containerd's garbage collection to free its blobs.
pub async fn remove_image(ctr: &Ctr, reference: &str) -> Result<(), SandboxError> {
    ignore_not_found(ctr.run(&["images", "rm", "--sync", reference]).await)
}

fn ignore_not_found(result: Result<crab_containerd::RawOutput, CtrError>) -> Result<(), SandboxError> {
    match result {
        Ok(_) => Ok(()),
        Err(CtrError::Failed { stderr, .. }) if stderr.contains("not found") => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// `ctr` reports its own failures (no such container, exec id in use) as exit 1
/// with a last stderr line `ctr: ...`; the command's own exit codes pass through.
fn is_ctr_failure(code: Option<i32>, stderr: &[u8]) -> bool {
    code == Some(1)
        && String::from_utf8_lossy(stderr).trim().lines().last().is_some_and(|line| line.starts_with("ctr: "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(media_type: &str, digest: char, size: u64) -> Descriptor {
        Descriptor { media_type: media_type.into(), digest: format!("sha256:{}", digest.to_string().repeat(64)), size }
    }

    #[test]
    fn a_checkpoint_index_without_its_criu_image_or_with_an_entry_without_digest_is_refused() {
        let criu = descriptor(CRIU_CHECKPOINT_MEDIA_TYPE, 'c', 9000);
        let options = "application/vnd.containerd.container.runtime.options+protobuf";
        let whole = CheckpointIndex { manifests: vec![criu.clone(), descriptor(options, 'e', 0)] };
        assert_eq!(whole.check(), Ok(()));
        let no_criu = CheckpointIndex { manifests: vec![descriptor(options, 'e', 0)] };
        assert!(no_criu.check().unwrap_err().contains("no CRIU image"));
        let empty = Descriptor { media_type: options.into(), digest: String::new(), size: 0 };
        let error = CheckpointIndex { manifests: vec![criu, empty] }.check().unwrap_err();
        assert!(error.contains(options) && error.contains("no digest") && error.contains("ctr leases"), "{error}");
    }

    #[test]
    fn a_push_walks_an_index_to_its_entries_and_a_manifest_to_its_config_and_layers() {
        let manifest = descriptor("application/vnd.oci.image.manifest.v1+json", 'b', 400);
        let criu = descriptor(CRIU_CHECKPOINT_MEDIA_TYPE, 'c', 9000);
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [manifest, criu]});
        let index_descriptor = descriptor(INDEX_MEDIA_TYPE, 'a', 300);
        assert_eq!(
            children(&index_descriptor, index.to_string().as_bytes()).unwrap(),
            [manifest.clone(), criu.clone()]
        );

        let config = descriptor("application/vnd.oci.image.config.v1+json", 'd', 50);
        let layer = descriptor("application/vnd.oci.image.layer.v1.tar+gzip", 'e', 7000);
        let body = serde_json::json!({"schemaVersion": 2, "config": config, "layers": [layer]});
        assert_eq!(children(&manifest, body.to_string().as_bytes()).unwrap(), [config, layer]);

        // A CRIU image, a layer, a config: nothing beneath them, whatever their bytes are.
        assert!(children(&criu, b"not json").unwrap().is_empty());
        assert!(children(&manifest, b"not json").is_err());
    }
}
