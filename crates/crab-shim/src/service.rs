//! The containerd Task API (ttrpc) over [`Container`]s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use containerd_shim_protos::api::*;
use containerd_shim_protos::events::task::*;
use containerd_shim_protos::protobuf::well_known_types::{any::Any, timestamp::Timestamp};
use containerd_shim_protos::protobuf::{Message, MessageField};
use containerd_shim_protos::shim::oci;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::{self, r#async::TtrpcContext};
use tokio_util::sync::CancellationToken;

use super::ShimError;
use super::container::{Container, ContainerConfig, EngineLoad};
pub use super::events::EventSink;
use super::io::StdioUris;
use super::process::{Process, Status};
use crab_config::Config;
use crab_config::runtime_options::{self as options, CreateOptions};
use crab_engine::{ChainStart, ContainerHost, EngineContext, SandboxEngine};
use crab_runtime::{CheckpointOptions, Exit, OciRuntime, Reaper};
use crab_store::SandboxKey;
use crab_store::turns::{Policy, SandboxPolicy};

/// How long an exit waits for the process's output to drain before it is
/// published: output written before exit reaches the client first.
const DRAIN_BEFORE_EXIT: Duration = Duration::from_secs(2);

pub struct TaskService {
    namespace: String,
    /// Store and inspector, set up by the first checkpointed sandbox.
    engine_ctx: Arc<tokio::sync::OnceCell<Arc<EngineContext>>>,
    containers: Mutex<HashMap<String, Arc<Container>>>,
    /// Pod containers whose Create is under way, by (pod sandbox, container name): the id
    /// being created. A container is in `containers` only once its runtime created (or its
    /// restore prepared) it, so without this two replacements created at once would both
    /// find the dead predecessor and both restore its checkpoint, two live copies.
    pod_creates: Mutex<HashMap<(String, String), String>>,
    events: EventSink,
    reaper: Reaper,
    shutdown: CancellationToken,
    /// The path of the socket this shim serves, unlinked when a shutdown is granted.
    socket: PathBuf,
}

fn timestamp(t: SystemTime) -> MessageField<Timestamp> {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let mut ts = Timestamp::new();
    ts.seconds = d.as_secs() as i64;
    ts.nanos = d.subsec_nanos() as i32;
    MessageField::some(ts)
}

fn status_of(s: Status) -> containerd_shim_protos::types::task::Status {
    use containerd_shim_protos::types::task::Status as S;
    match s {
        Status::Created => S::CREATED,
        Status::Running => S::RUNNING,
        Status::Paused => S::PAUSED,
        Status::Stopped => S::STOPPED,
    }
}

type TtrpcResult<T> = ttrpc::Result<T>;

impl TaskService {
    pub fn new(
        namespace: &str,
        events: EventSink,
        reaper: Reaper,
        shutdown: CancellationToken,
        socket: PathBuf,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            engine_ctx: Default::default(),
            containers: Mutex::new(HashMap::new()),
            pod_creates: Mutex::new(HashMap::new()),
            events,
            reaper,
            shutdown,
            socket,
        }
    }

    fn container(&self, id: &str) -> Result<Arc<Container>, ShimError> {
        self.containers
            .lock()
            .expect("containers lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ShimError::NotFound(format!("container {id}")))
    }

    /// Watches a started process: when it exits, drain its output, record the
    /// exit and publish TaskExit.
    fn watch_exit(
        &self,
        container: &Arc<Container>,
        process: &Arc<Process>,
        pid: u32,
        exit: impl std::future::Future<Output = Exit> + Send + 'static,
    ) {
        let events = self.events.clone();
        let container_id = container.id().to_string();
        let process = process.clone();
        let container = container.clone();
        tokio::spawn(async move {
            let exit: Exit = exit.await;
            if let Some(io) = process.io() {
                io.drain(DRAIN_BEFORE_EXIT).await;
            }
            if !process.exec_id.is_empty()
                && let Some(engine) = container.engine()
            {
                // Before the exit is published: the agent's next exec must find the turn closed.
                engine.exec_exited(&process.exec_id).await;
            }
            if process.exec_id.is_empty() {
                if container.shares_pid_namespace() {
                    // No pid namespace of its own (hostPID): the kernel kills nothing when the
                    // init goes, so the rest of the container (crab-init's spawner, execs) is
                    // killed here, as containerd's runc shim does.
                    if let Err(e) = container.runtime.kill(container.id(), libc::SIGKILL as u32, true).await {
                        tracing::debug!(container = %container_id, error = %e, "the rest of the container not killed");
                    }
                }
                // With the init gone, the kernel killed the rest of the pid
                // namespace; their exits come first, as containerd expects.
                for exec in container.execs() {
                    if exec.status() == Status::Running {
                        let _ = tokio::time::timeout(Duration::from_secs(1), exec.wait()).await;
                    }
                }
            }
            if !process.set_exited(exit) {
                return;
            }
            tracing::info!(container = %container_id, exec = %process.exec_id, pid, status = exit.status, "process exited");
            let id = if process.exec_id.is_empty() { container_id.clone() } else { process.exec_id.clone() };
            events
                .publish(TaskExit {
                    container_id,
                    id,
                    pid,
                    exit_status: exit.status as u32,
                    exited_at: timestamp(exit.at),
                    ..Default::default()
                })
                .await;
        });
    }

    fn watch_oom(&self, container: &Arc<Container>) {
        let Some(cgroup) = container.cgroup() else { return };
        let events = self.events.clone();
        let container_id = container.id().to_string();
        tokio::spawn(async move {
            let mut state = Default::default();
            while cgroup.next_oom(&mut state).await.is_some() {
                tracing::warn!(container = %container_id, "OOM kill");
                events.publish(TaskOOM { container_id: container_id.clone(), ..Default::default() }).await;
            }
        });
    }

    async fn do_create(&self, req: CreateTaskRequest) -> Result<CreateTaskResponse, ShimError> {
        let opts = CreateOptions::decode(req.options.as_ref())?;
        let config = Config::load(opts.config_path.as_deref())?;
        let runtime = OciRuntime::new(
            opts.binary_name.clone().map(PathBuf::from).unwrap_or(config.runtime.binary.clone()),
            opts.root.clone().map(PathBuf::from).unwrap_or(config.runtime.root.clone()).join(&self.namespace),
            opts.systemd_cgroup || config.runtime.systemd_cgroup,
            self.reaper.clone(),
        );
        runtime.check_binary()?;
        if let Err(e) = super::bootstrap::write_runtime_record(Path::new(&req.bundle), &runtime) {
            tracing::warn!(error = %e, "runtime record not written: a later `delete` falls back to the config");
        }
        if self.containers.lock().expect("containers lock").contains_key(&req.id) {
            return Err(ShimError::AlreadyExists(format!("container {}", req.id)));
        }
        let bundle = PathBuf::from(&req.bundle);
        let mut policy = sandbox_policy(&bundle, &config)?;
        // A container of a Kubernetes pod: kubelet's replacement of a dead one starts from the
        // dead one's latest checkpoint, unless the pod opts out (io.crab.restore=off) or asks
        // for a checkpoint of its own (io.crab.restore-from).
        // Only a container the kernel places in the pod its annotations name is taken for
        // that pod's: one that is not is neither restored from nor recorded as the pod's
        // container (else another pod's container could become this pod's predecessor, and
        // its state be restored into this pod's next replacement).
        let claimed = super::cri::PodContainer::from_bundle(&bundle)?;
        let pod = claimed.clone().filter(|pod| match self.in_pod(pod) {
            Ok(()) => true,
            Err(why) => {
                tracing::warn!(container = %req.id, pod_sandbox = %pod.sandbox_id, name = %pod.name, reason = %why,
                    "not taken for a container of the pod its annotations name: not restored from, nor recorded as, its container");
                false
            }
        });
        // Held until this Create returns (the container then is in `containers`, or failed).
        let claim = pod.as_ref().map(|pod| PodCreate::claim(&self.pod_creates, &pod.sandbox_id, &pod.name, &req.id));
        let mut origin = None;
        if let (Some(pod), Some(claim)) = (&pod, &claim)
            && policy.restore_from.is_none()
            && policy.restores_replacement()
        {
            policy.restore_from = match &claim.other {
                Some(other) => {
                    tracing::warn!(container = %req.id, pod_sandbox = %pod.sandbox_id, name = %pod.name,
                        reason = %format!("container {other} of that name is being created"),
                        "the replacement starts from its image, not from its predecessor's checkpoint");
                    None
                }
                None => self.predecessor(pod, &req.id, &config),
            };
            if policy.restore_from.is_some() {
                origin = Some((pod.sandbox_id.clone(), pod.name.clone()));
            }
        }
        // Checkpoints are the sandbox's by containerd namespace and id: two tenants' `t2` never share one.
        let key =
            if policy.policy != Policy::Off || policy.restore_from.is_some() {
                Some(SandboxKey::new(&self.namespace, &req.id).map_err(|e| {
                    ShimError::InvalidArgument(format!("container {} cannot be checkpointed: {e}", req.id))
                })?)
            } else {
                None
            };
        let restore_source = match (&policy.restore_from, &key) {
            (Some(source), Some(_)) => Some(restore_source(&config.checkpoint, source, &self.namespace)?),
            _ => None,
        };
        if let Some(source) = &restore_source
            && origin.is_none()
        {
            // io.crab.restore-from (a kubelet replacement restores its own pod's container).
            check_pod_restore(&config.checkpoint, claimed.as_ref(), pod.as_ref(), source, &req.id)?;
        }
        if let Some(source) = &restore_source {
            // restore_step: scripts/lib/restore_breakdown.py times a restore by these fields.
            tracing::debug!(container = %req.id, %source, restore_step = "received", "create of a restored container");
        }
        let rootfs_mounted = mount_rootfs(&bundle, &req.rootfs).await?;
        // The engine context (crabd's connection, or this shim's own BPF programs
        // when there is no crabd) is set up in the background: a restore
        // reassembles its images meanwhile and restores its processes without
        // waiting for it; the engine attaches once both are done.
        let clock = std::time::Instant::now();
        let loading = (policy.policy != Policy::Off).then(|| {
            let (cell, config) = (self.engine_ctx.clone(), config.clone());
            let yielding = policy.restore_from.is_some();
            tokio::spawn(async move { engine_context(cell, config, yielding).await })
        });
        let prepared = match (&policy.restore_from, &restore_source, &key) {
            (Some(from), Some(source), Some(key)) => {
                prepare_restore(&config.checkpoint, source, from.turn, key, &bundle, origin.clone()).await
            }
            _ => Ok((None, Vec::new())),
        };
        let (prepared, restore_shells) = match prepared {
            Ok(prepared) => {
                if policy.restore_from.is_some() {
                    tracing::info!(container = %req.id, prepare_ms = clock.elapsed().as_secs_f64() * 1e3,
                        engine_ready = loading.as_ref().is_some_and(|l| l.is_finished()), restore_step = "prepared",
                        "restore prepared");
                }
                prepared
            }
            Err(e) => {
                if rootfs_mounted {
                    super::container::unmount_rootfs(&bundle);
                }
                return Err(e);
            }
        };
        tokio::fs::create_dir_all(runtime.root()).await.map_err(|e| ShimError::io(runtime.root(), e))?;
        let restore_images_owned = prepared.is_some();
        // The sandbox's tmpfs mounts exist only once the runtime made them: their content is
        // written after Create (no process checkpoint: into empty mounts) or after the
        // runtime's restore (CRIU brought them back as at the process checkpoint).
        let pending_mounts = match (&policy.restore_from, &restore_source) {
            // The chain's key (namespace and id), as checked above: never the bare name.
            (Some(from), Some(source)) => Some(PendingMounts {
                source: source.to_string(),
                turn: from.turn,
                since: prepared.as_ref().map(|(_, images_turn)| *images_turn),
                tmpfs: spec_mounts(&bundle)?.tmpfs(),
                state_dir: config.checkpoint.state_dir.clone(),
                kept: config.checkpoint.kept_images(),
            }),
            _ => None,
        };
        let prepared = prepared.map(|(images, _)| images);
        let restore_from = prepared.or_else(|| (!req.checkpoint.is_empty()).then(|| PathBuf::from(&req.checkpoint)));
        let init_binary = match usable_init(&config, restore_from.as_deref()) {
            Ok(init) => init,
            Err(e) => {
                if rootfs_mounted {
                    super::container::unmount_rootfs(&bundle);
                }
                return Err(e);
            }
        };
        let container = Container::new(
            ContainerConfig {
                id: req.id.clone(),
                namespace: self.namespace.clone(),
                bundle: bundle.clone(),
                restore_from,
                restore_images_owned,
                no_pivot: opts.no_pivot_root,
                no_new_keyring: opts.no_new_keyring,
                io_uid: opts.io_uid,
                io_gid: opts.io_gid,
                init_binary,
                dump_timeout: config.checkpoint.dump_timeout(),
                restore_shells,
            },
            runtime,
            self.reaper.clone(),
            StdioUris {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            },
        );
        let pid = match container.create().await {
            Ok(pid) => pid,
            Err(e) => {
                if rootfs_mounted {
                    super::container::unmount_rootfs(&bundle);
                }
                return Err(e);
            }
        };
        if let Some(pending) = pending_mounts {
            if pid != 0 {
                if let Err(e) = restore_mounts(pending, pid).await {
                    let _ = container.delete().await;
                    if rootfs_mounted {
                        super::container::unmount_rootfs(&bundle);
                    }
                    return Err(e);
                }
            } else {
                *container.pending_mounts.lock().expect("pending mounts lock") = Some(pending);
            }
        }
        if let (Some(pod), Some(key)) = (&pod, &key) {
            // The next replacement of this container in its pod finds this one's chain.
            let recorded =
                crab_store::CheckpointStore::open_with(&config.checkpoint.state_dir, &config.checkpoint.kept_images())
                    .and_then(|store| {
                        store.set_pod_member(key.namespace(), &pod.sandbox_id, &pod.name, key.id())?;
                        match &pod.kube_namespace {
                            // A pod of the same Kubernetes namespace may restore from this chain.
                            Some(kube_namespace) => store.set_owner(
                                &key.to_string(),
                                &crab_store::PodOwner {
                                    kube_namespace: kube_namespace.clone(),
                                    pod_sandbox: pod.sandbox_id.clone(),
                                    container_name: pod.name.clone(),
                                },
                            ),
                            None => Ok(()),
                        }
                    });
            if let Err(e) = recorded {
                tracing::warn!(container = %req.id, error = %e, "not recorded as its pod's container: a replacement will start from its image");
            }
        }
        self.containers.lock().expect("containers lock").insert(req.id.clone(), container.clone());
        if pid != 0 {
            self.watch_exit(&container, &container.init, pid, self.reaper.wait_for(pid));
            let engine_ctx = match loading {
                Some(loading) => Some(joined_engine_context(loading).await?),
                None => None,
            };
            let start = chain_start(&policy, &self.namespace, &req.id);
            attach_engine(&container, engine_ctx.as_ref(), &policy, pid, start).await?;
        } else {
            if loading.is_some() {
                container.engine_pending();
            }
            *container.pending_policy.lock().expect("policy lock") = Some((policy, loading));
        }
        tracing::info!(container = %req.id, pid, "created");
        self.events
            .publish(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin,
                    stdout: req.stdout,
                    stderr: req.stderr,
                    terminal: req.terminal,
                    ..Default::default()
                }),
                checkpoint: req.checkpoint,
                pid,
                ..Default::default()
            })
            .await;
        Ok(CreateTaskResponse { pid, ..Default::default() })
    }

    /// Whether `pod` (what a new container's annotations say) holds on the kernel's word: its
    /// pod sandbox runs in this shim and the new container joins that sandbox's namespaces
    /// (see [`super::cri`]). Err says why not.
    fn in_pod(&self, pod: &super::cri::PodContainer) -> Result<(), String> {
        let sandbox = self.containers.lock().expect("containers lock").get(&pod.sandbox_id).cloned();
        let Some(sandbox) = sandbox.filter(|s| s.init.status() == Status::Running) else {
            return Err(format!("pod sandbox {} is not running in this shim", pod.sandbox_id));
        };
        pod.check_in_sandbox(sandbox.init.pid())
            .map_err(|why| format!("not created in the pod sandbox its annotation names: {why}"))
    }

    /// The chain a kubelet replacement `id` of `pod`'s container (checked by [`Self::in_pod`])
    /// restores from: the latest checkpoint of the container recorded before it under the same
    /// pod sandbox and name, if that container is dead. None (logged) otherwise: the replacement
    /// then starts from its image, as under runc.
    fn predecessor(
        &self,
        pod: &super::cri::PodContainer,
        id: &str,
        config: &Config,
    ) -> Option<crab_store::turns::RestoreFrom> {
        let fresh = |why: String| {
            tracing::warn!(container = id, pod_sandbox = %pod.sandbox_id, name = %pod.name, reason = %why,
                "the replacement starts from its image, not from its predecessor's checkpoint");
            None
        };
        let store = match crab_store::CheckpointStore::open_with(
            &config.checkpoint.state_dir,
            &config.checkpoint.kept_images(),
        ) {
            Ok(store) => store,
            Err(e) => return fresh(format!("checkpoint store: {e}")),
        };
        let previous = match store.pod_member(&self.namespace, &pod.sandbox_id, &pod.name) {
            Ok(Some(previous)) if previous != id => previous,
            Ok(_) => {
                tracing::debug!(container = id, pod_sandbox = %pod.sandbox_id, name = %pod.name,
                    "no earlier container of that name in the pod: nothing to restore");
                return None;
            }
            Err(e) => return fresh(format!("pod record: {e}")),
        };
        let before = self.containers.lock().expect("containers lock").get(&previous).cloned();
        // Only a dead predecessor is replaced: one that runs, is paused, or is created and
        // not yet started (a pending restore is that too) would live on beside its copy.
        if let Some(before) = before
            && before.init.status() != Status::Stopped
        {
            return fresh(format!("container {previous} of that name is not dead ({:?})", before.init.status()));
        }
        let head = SandboxKey::new(&self.namespace, &previous)
            .map_err(|e| e.to_string())
            .and_then(|key| store.head(&key.to_string()).map_err(|e| e.to_string()));
        match head {
            Ok(Some(head)) => {
                tracing::info!(container = id, predecessor = %previous, turn = head.turn, pod_sandbox = %pod.sandbox_id,
                    name = %pod.name, "kubelet replacement: restoring its predecessor's latest checkpoint");
                Some(crab_store::turns::RestoreFrom { namespace: None, container: previous, turn: head.turn })
            }
            Ok(None) => {
                tracing::info!(container = id, predecessor = %previous, "kubelet replacement: its predecessor has no checkpoint");
                None
            }
            Err(e) => fresh(format!("chain of {previous}: {e}")),
        }
    }

    async fn do_start(&self, req: StartRequest) -> Result<StartResponse, ShimError> {
        let container = self.container(&req.id)?;
        if req.exec_id.is_empty() {
            let restoring = container.config.restore_from.is_some();
            let clock = std::time::Instant::now();
            // A restore that fails here attaches no engine: whoever waits for one (Delete, execs)
            // must not wait forever, so its slot is settled with the failure.
            let failed_restore = |e: &ShimError| {
                if restoring {
                    container.engine_settled(Err(format!("the restore failed at Start: {e}")));
                }
            };
            let pid = container.start().await.inspect_err(failed_restore)?;
            container.spawner_started();
            let pending_mounts = container.pending_mounts.lock().expect("pending mounts lock").take();
            if let Some(pending) = pending_mounts
                && let Err(e) = restore_mounts(pending, pid).await
            {
                // The restored processes must not go on with their tmpfs state missing.
                let _ = container.kill(&container.init, libc::SIGKILL as u32, true).await;
                failed_restore(&e);
                return Err(e);
            }
            if restoring {
                tracing::info!(container = %req.id, pid, runtime_restore_ms = clock.elapsed().as_secs_f64() * 1e3,
                    restore_step = "restored", "restored by the runtime");
                self.watch_exit(&container, &container.init, pid, self.reaper.wait_for(pid));
                let pending = container.pending_policy.lock().expect("policy lock").take();
                if let Some((policy, Some(loading))) = pending {
                    // The processes run again: the engine attaches behind the reply
                    // (what they do until then is start-up, set aside anyway), and
                    // execs, marks and Delete wait for it.
                    let start = chain_start(&policy, &self.namespace, &req.id);
                    attach_restored_engine(container.clone(), loading, policy, pid, start);
                }
            } else if let Some(engine) = container.engine() {
                engine.container_started().await;
            }
            self.watch_oom(&container);
            self.events.publish(TaskStart { container_id: req.id, pid, ..Default::default() }).await;
            return Ok(StartResponse { pid, ..Default::default() });
        }
        let process = container.process(&req.exec_id)?;
        if let Some(engine) = container.settled_engine().await? {
            let waited = engine.exec_started(&req.exec_id).await;
            if waited > Duration::from_millis(1) {
                tracing::info!(container = %req.id, exec = %req.exec_id, waited_ms = waited.as_secs_f64() * 1e3,
                    "exec waited for the previous turn's checkpoint");
            }
        }
        let super::container::StartedExec { pid, exit, through_runtime, restored_shell } =
            match container.start_exec(&process).await {
                Ok(started) => started,
                Err(e) => {
                    if let Some(engine) = container.engine() {
                        engine.exec_exited(&req.exec_id).await;
                    }
                    return Err(e);
                }
            };
        if let (Some(reason), Some(engine)) = (&through_runtime, container.engine()) {
            // Before the exit can be seen: the record of its turn lists it.
            engine.exec_through_runtime(&req.exec_id, reason).await;
        }
        self.watch_exit(&container, &process, pid, exit);
        if let (Some(engine), Some(io), false) = (container.engine(), process.io(), process.uris.stdin.is_empty()) {
            let shell = (through_runtime.is_none() && !process.uris.terminal && reads_commands_from_stdin(&process))
                .then(|| super::io::SessionShell::new(io.clone()))
                .flatten()
                .map(|s| crab_engine::shell::AskableSession { channel: Arc::new(s), restored: restored_shell });
            if let Some(observer) = engine.stdin_session(&req.exec_id, pid, shell).await {
                io.observe_stdin(observer);
            }
        }
        self.events
            .publish(TaskExecStarted { container_id: req.id, exec_id: req.exec_id, pid, ..Default::default() })
            .await;
        Ok(StartResponse { pid, ..Default::default() })
    }

    async fn do_delete(&self, req: DeleteRequest) -> Result<DeleteResponse, ShimError> {
        let container = self.container(&req.id)?;
        if !req.exec_id.is_empty() {
            let process = container.delete_exec(&req.exec_id)?;
            return Ok(delete_response(&process));
        }
        container.delete().await?;
        self.containers.lock().expect("containers lock").remove(&req.id);
        let response = delete_response(&container.init);
        self.events
            .publish(TaskDelete {
                container_id: req.id,
                pid: response.pid,
                exit_status: response.exit_status,
                exited_at: response.exited_at.clone(),
                ..Default::default()
            })
            .await;
        Ok(response)
    }

    async fn do_checkpoint(&self, req: CheckpointTaskRequest) -> Result<(), ShimError> {
        let container = self.container(&req.id)?;
        let o = options::checkpoint_options(req.options.as_ref())?;
        // containerd 1.6/1.7 honour the options' image path only for runtimes
        // named io.containerd.runc*: for others they pass a temporary directory
        // in `path` (and commit it to their content store) while the user's
        // directory stays in the options. Write where the user asked, and give
        // containerd its copy. (`ctr task checkpoint` itself drops
        // `--image-path`/`--exit` for such runtimes: only API clients that send
        // runc's CheckpointOptions reach this.)
        let image_path = if o.image_path.is_empty() { PathBuf::from(&req.path) } else { PathBuf::from(&o.image_path) };
        if image_path.as_os_str().is_empty() {
            return Err(ShimError::InvalidArgument("checkpoint: no image path".into()));
        }
        let opts = CheckpointOptions {
            image_path: image_path.clone(),
            work_path: (!o.work_path.is_empty()).then(|| PathBuf::from(&o.work_path)),
            leave_running: !o.exit,
            tcp_established: o.open_tcp,
            ext_unix_sockets: o.external_unix_sockets,
            shell_job: o.terminal || container.init.uris.terminal,
            file_locks: o.file_locks,
            empty_namespaces: o.empty_namespaces.clone(),
            manage_cgroups_mode: (!o.cgroups_mode.is_empty()).then(|| o.cgroups_mode.clone()),
            parent_path: None,
            // Set by the container: its dump timeout.
            deadline: None,
        };
        container.checkpoint(&opts).await?;
        if !req.path.is_empty() && Path::new(&req.path) != image_path {
            copy_dir(&image_path, Path::new(&req.path)).await?;
        }
        self.events
            .publish(TaskCheckpointed {
                container_id: req.id,
                checkpoint: image_path.display().to_string(),
                ..Default::default()
            })
            .await;
        Ok(())
    }

    async fn do_stats(&self, req: StatsRequest) -> Result<StatsResponse, ShimError> {
        let container = self.container(&req.id)?;
        let cgroup = container
            .cgroup()
            .ok_or_else(|| ShimError::FailedPrecondition(format!("container {} has no cgroup yet", req.id)))?;
        let mut stats = cgroup.metrics().map_err(|e| ShimError::Other(e.to_string()))?;
        if container.spawner_pid().is_some() {
            // The spawner is the runtime's own helper (as the shim is), not
            // the workload's: a container shows the pids it would under runc.
            stats = without_one_pid(stats);
        }
        Ok(StatsResponse { stats: MessageField::some(stats), ..Default::default() })
    }

    async fn do_pids(&self, req: PidsRequest) -> Result<PidsResponse, ShimError> {
        let container = self.container(&req.id)?;
        let processes = container
            .pids()
            .await?
            .into_iter()
            .map(|(pid, exec_id)| {
                let mut info = containerd_shim_protos::types::task::ProcessInfo { pid, ..Default::default() };
                if let Some(exec_id) = exec_id {
                    let details = oci::ProcessDetails { exec_id, ..Default::default() };
                    if let Ok(value) = details.write_to_bytes() {
                        info.info = MessageField::some(Any {
                            type_url: "containerd.runc.v1.ProcessDetails".into(),
                            value,
                            ..Default::default()
                        });
                    }
                }
                info
            })
            .collect();
        Ok(PidsResponse { processes, ..Default::default() })
    }
}

/// Store and inspector of this shim's checkpointed sandboxes, set up by the first one.
/// The store and the inspector of this shim's checkpointed sandboxes, set up
/// by the first one: crabd's connection, else BPF programs of this shim's own.
/// `yielding`: a restore needs the CPU more than a BPF load does (see
/// [`crab_inspector::Inspector::start_yielding`]).
async fn engine_context(
    cell: Arc<tokio::sync::OnceCell<Arc<EngineContext>>>,
    config: Config,
    yielding: bool,
) -> Result<Arc<EngineContext>, ShimError> {
    let state_dir = config.checkpoint.state_dir.clone();
    let dump_timeout = config.checkpoint.dump_timeout();
    let kept = config.checkpoint.kept_images();
    let node = crab_node::ClientOptions::from_config(&config.node);
    let max_effects_bytes = config.node.max_effects_bytes();
    let remote_config = config.clone();
    cell
        .get_or_try_init(|| async move {
            let store = crab_store::CheckpointStore::open_with(&state_dir, &kept).map_err(|e| {
                ShimError::FailedPrecondition(format!("checkpoint store {}: {e}", state_dir.display()))
            })?;
            // The node's inspector and bandwidth live in crabd; only without it
            // does this shim load BPF programs of its own.
            let (inspector, commit_gate) = match crab_node::NodeClient::connect(node).await {
                Ok(client) => {
                    let client = Arc::new(client);
                    tracing::info!(socket = %client.socket().display(), "using the node's crabd");
                    (Some(client.clone() as Arc<dyn crab_engine::EffectSource>),
                        Some(client as Arc<dyn crab_engine::CommitGate>))
                }
                Err(e) => {
                    if matches!(e, crab_node::NodeError::Incompatible { .. }) {
                        // Never used: its records or messages may mean something else to this build.
                        tracing::error!(error = %e, "crabd of another build: loading an inspector in this shim, commits not paced");
                    } else {
                        tracing::warn!(error = %e, "crabd unavailable: loading an inspector in this shim, commits not paced");
                    }
                    let config = crab_inspector::InspectorConfig {
                        ring_buffer_bytes: 4 << 20,
                        max_effects_bytes,
                        ..Default::default()
                    };
                    let local = if yielding {
                        crab_inspector::Inspector::start_yielding(config).await
                    } else {
                        crab_inspector::Inspector::start(config).await
                    };
                    match local {
                        Ok(i) => (Some(Arc::new(i) as Arc<dyn crab_engine::EffectSource>), None),
                        Err(e) => {
                            tracing::error!(error = %e, "inspector unavailable: every turn will be checkpointed in full");
                            (None, None)
                        }
                    }
                }
            };
            let store = Arc::new(store);
            let replicator = crate::remote::RemotePusher::start(&remote_config, store.clone(), commit_gate.clone())
                .map(|p| p as Arc<dyn crab_engine::Replicator>);
            Ok(Arc::new(EngineContext { store, inspector, commit_gate, state_dir, dump_timeout, replicator }))
        })
        .await
        .cloned()
}

async fn attach_engine(
    container: &Arc<Container>,
    ctx: Option<&Arc<EngineContext>>,
    policy: &SandboxPolicy,
    pid: u32,
    start: ChainStart,
) -> Result<(), ShimError> {
    let Some(ctx) = ctx else { return Ok(()) };
    let key = SandboxKey::new(&container.config.namespace, container.id())
        .map_err(|e| ShimError::InvalidArgument(format!("container {} cannot be checkpointed: {e}", container.id())))?;
    let engine = SandboxEngine::new(
        &key,
        policy.clone(),
        ctx.clone(),
        Arc::new(ContainerHost::new(container.runtime.clone(), container.id(), pid)),
        container.work_dir(),
        start,
    )
    .await
    .map_err(|e| ShimError::FailedPrecondition(format!("checkpoint engine for {}: {e}", container.id())))?;
    container.set_engine(engine);
    Ok(())
}

/// The engine context a background set-up produced.
async fn joined_engine_context(loading: EngineLoad) -> Result<Arc<EngineContext>, ShimError> {
    loading.await.map_err(|e| ShimError::Other(format!("engine set-up: {e}")))?
}

/// Attaches the engine of a restored container once its context is set up,
/// behind Start's reply; settles the container's engine either way.
fn attach_restored_engine(
    container: Arc<Container>,
    loading: EngineLoad,
    policy: SandboxPolicy,
    pid: u32,
    start: ChainStart,
) {
    tokio::spawn(async move {
        let clock = std::time::Instant::now();
        let attached = match joined_engine_context(loading).await {
            Ok(ctx) => attach_engine(&container, Some(&ctx), &policy, pid, start).await,
            Err(e) => Err(e),
        };
        match attached {
            Ok(()) => {
                if let Some(engine) = container.engine() {
                    engine.container_started().await;
                }
                tracing::info!(container = %container.id(), waited_ms = clock.elapsed().as_secs_f64() * 1e3,
                    restore_step = "attached", "engine attached to the restored container");
                container.engine_settled(Ok(()));
            }
            Err(e) => {
                tracing::error!(container = %container.id(), error = %e, "engine not attached to the restored container: its execs will fail");
                container.engine_settled(Err(e.to_string()));
            }
        }
    });
}

/// crab-init from the config, if it is enabled and fit to run in any image.
/// The crab-init the container runs: for a restore, the pinned build its
/// checkpoint was taken with (a restore with another build fails in CRIU);
/// otherwise the configured one, pinned (`runtime::init::pin`) under the
/// store's `init/`. Err (why) without a usable crab-init.
fn usable_init(config: &Config, restore_from: Option<&Path>) -> Result<Result<PathBuf, String>, ShimError> {
    use crab_runtime::init;
    let path = &config.runtime.init;
    if path.as_os_str().is_empty() {
        return Ok(Err("no crab-init spawner: crab.toml's [runtime] init is empty".into()));
    }
    let pins = config.checkpoint.state_dir.join("init");
    if let Some(images) = restore_from {
        let pinned = match init::pinned_for_images(images, &pins) {
            // A checkpoint pulled from another node (`crabctl recover --from`) names the build
            // its processes ran, which this node's store has not pinned yet: when the configured
            // crab-init is that build, pinning it now is what lets the restore find it. Any
            // other build stays unpinned and the error names the one the restore needs. Only
            // then: a build pinned here already must not pin the configured one beside it.
            Err(init::InitError::Unusable { .. }) => {
                let _ = init::pin(path, &pins);
                init::pinned_for_images(images, &pins)
            }
            found => found,
        };
        if let Some(pinned) =
            pinned.map_err(|e| ShimError::FailedPrecondition(format!("restore from {}: {e}", images.display())))?
        {
            return Ok(Ok(pinned));
        }
    }
    match init::pin(path, &pins) {
        Ok(pinned) => Ok(Ok(pinned)),
        Err(e @ init::InitError::Unusable { .. }) => {
            tracing::warn!(error = %e, "exec sessions go through the runtime and are left out of checkpoints");
            Ok(Err(format!("no crab-init spawner: {e}")))
        }
        Err(e) => {
            // Checked and usable (pin fails as Unusable otherwise), only not pinned: an upgrade
            // of it in place breaks restores.
            tracing::warn!(error = %e, init = %path.display(), "crab-init not pinned: it is used where it is installed");
            Ok(Ok(path.clone()))
        }
    }
}

/// Metrics with the spawner taken out of the current pid count.
fn without_one_pid(mut stats: Any) -> Any {
    use containerd_shim_protos::cgroups::metrics as v1;
    use containerd_shim_protos::cgroups_v2::metrics as v2;
    fn adjust<M: Message>(stats: &mut Any, f: impl FnOnce(&mut M)) {
        if let Ok(mut m) = M::parse_from_bytes(&stats.value) {
            f(&mut m);
            if let Ok(bytes) = m.write_to_bytes() {
                stats.value = bytes;
            }
        }
    }
    if stats.type_url.ends_with("v1.Metrics") {
        adjust::<v1::Metrics>(&mut stats, |m| {
            if let Some(p) = m.pids.as_mut() {
                p.current = p.current.saturating_sub(1);
            }
        });
    } else if stats.type_url.ends_with("v2.Metrics") {
        adjust::<v2::Metrics>(&mut stats, |m| {
            if let Some(p) = m.pids.as_mut() {
                p.current = p.current.saturating_sub(1);
            }
        });
    }
    stats
}

/// The sandbox's checkpoint policy from its spec's `io.crab.*` annotations.
fn sandbox_policy(bundle: &Path, config: &Config) -> Result<SandboxPolicy, ShimError> {
    let path = bundle.join("config.json");
    let bytes = std::fs::read(&path).map_err(|e| ShimError::io(&path, e))?;
    #[derive(serde::Deserialize)]
    struct Spec {
        #[serde(default)]
        annotations: HashMap<String, String>,
    }
    let spec: Spec =
        serde_json::from_slice(&bytes).map_err(|e| ShimError::InvalidArgument(format!("{}: {e}", path.display())))?;
    let defaults = SandboxPolicy {
        policy: crab_store::turns::parse_policy(&config.checkpoint.policy).unwrap_or(Policy::Crab),
        max_sandbox_mib: config.checkpoint.max_sandbox_mib,
        allow_quota_raise: config.checkpoint.allow_sandbox_quota_raise,
        ..Default::default()
    };
    SandboxPolicy::from_annotations(&spec.annotations, &defaults).map_err(|e| ShimError::InvalidArgument(e.to_string()))
}

/// The mounts the bundle's spec gives the container.
fn spec_mounts(bundle: &Path) -> Result<crab_store::SandboxMounts, ShimError> {
    crab_store::SandboxMounts::from_spec_file(&bundle.join("config.json")).map_err(ShimError::InvalidArgument)
}

/// What a restored container's tmpfs mounts must get once they exist.
pub struct PendingMounts {
    source: String,
    turn: u64,
    /// The turn of the process checkpoint CRIU restores them from (None: they start empty).
    since: Option<u64>,
    tmpfs: Vec<crab_store::RelPath>,
    state_dir: PathBuf,
    kept: crab_store::KeptImages,
}

/// Writes the checkpointed content of the tmpfs mounts into the new container's own mounts,
/// reached through its init `pid` (just created or restored by the runtime).
async fn restore_mounts(pending: PendingMounts, pid: u32) -> Result<(), ShimError> {
    if pending.tmpfs.is_empty() {
        return Ok(());
    }
    let what = format!("restore from {}:{} into the container's tmpfs mounts", pending.source, pending.turn);
    tokio::task::spawn_blocking(move || {
        let clock = std::time::Instant::now();
        let root = crab_store::ContainerRoot::new(pid).map_err(|source| crab_store::CheckpointError::Io {
            op: "pidfd_open",
            path: PathBuf::from(format!("/proc/{pid}")),
            source,
        })?;
        let mounts = pending.tmpfs.iter().map(|d| root.open_mount(d)).collect::<Result<Vec<_>, _>>()?;
        let store = crab_store::CheckpointStore::open_with(&pending.state_dir, &pending.kept)?;
        let stats = store.materialize_mounts(&pending.source, pending.turn, &mounts, pending.since)?;
        tracing::info!(source = %pending.source, turn = pending.turn, since = ?pending.since, files = stats.files_written,
            bytes = stats.bytes_written, removed = stats.paths_removed, ms = clock.elapsed().as_secs_f64() * 1e3,
            "tmpfs mounts restored");
        Ok::<_, crab_store::CheckpointError>(())
    })
    .await
    .map_err(|e| ShimError::Other(format!("{what}: {e}")))?
    .map_err(|e| ShimError::FailedPrecondition(format!("{what}: {e}")))
}

/// How the chain of container `id` (namespace `namespace`) begins: from its own
/// checkpoint it continues, from another's it is a fork, else it is new.
fn chain_start(policy: &SandboxPolicy, namespace: &str, id: &str) -> ChainStart {
    match &policy.restore_from {
        None => ChainStart::New,
        Some(source)
            if source.key(namespace).is_ok_and(|k| k == k.current() && k.namespace() == namespace && k.id() == id) =>
        {
            ChainStart::Continued
        }
        Some(_) => ChainStart::Forked,
    }
}

/// The chain `io.crab.restore-from` names for a container of `namespace`: one of its own
/// namespace, or of another only where crab.toml allows it. A restore hands the source's files
/// and process memory to the new container, so naming another tenant's chain is refused
/// with an error that says which annotation, which chain and why.
fn restore_source(
    checkpoint: &crab_config::CheckpointConfig,
    source: &crab_store::turns::RestoreFrom,
    namespace: &str,
) -> Result<SandboxKey, ShimError> {
    let annotation = crab_store::turns::ANNOTATION_RESTORE_FROM;
    let key = source.key(namespace).map_err(|e| ShimError::InvalidArgument(format!("annotation {annotation}: {e}")))?;
    if !checkpoint.restore_allowed(key.namespace(), namespace) {
        return Err(ShimError::InvalidArgument(format!(
            "annotation {annotation}={key}:{turn} refused: chain {key} is in containerd namespace {:?}, \
             this container in {namespace:?}, and a container may restore only from its own namespace's \
             chains unless crab.toml allows that namespace ([checkpoint] restore_from_namespaces)",
            key.namespace(),
            turn = source.turn,
        )));
    }
    Ok(key)
}

/// A pod's container naming `io.crab.restore-from`: the chain must be one the shim recorded
/// for a pod of the same Kubernetes namespace (see [`super::cri::restore_allowed`]); refused
/// with an error naming the annotation, the chain and why.
fn check_pod_restore(
    checkpoint: &crab_config::CheckpointConfig,
    claimed: Option<&super::cri::PodContainer>,
    verified: Option<&super::cri::PodContainer>,
    source: &SandboxKey,
    id: &str,
) -> Result<(), ShimError> {
    if claimed.is_none() {
        return Ok(());
    }
    let annotation = crab_store::turns::ANNOTATION_RESTORE_FROM;
    let owner = crab_store::CheckpointStore::open_with(&checkpoint.state_dir, &checkpoint.kept_images())
        .and_then(|store| store.owner(&source.to_string()))
        .map_err(|e| {
            ShimError::FailedPrecondition(format!("annotation {annotation}={source}: owner of the chain: {e}"))
        })?;
    super::cri::restore_allowed(claimed, verified, &source.to_string(), owner.as_ref()).map_err(|why| {
        tracing::warn!(container = id, %source, reason = %why, "io.crab.restore-from refused");
        ShimError::InvalidArgument(format!("annotation {annotation} of container {id} refused: {why}"))
    })
}

/// Prepares a container created from a checkpoint: writes the source's rootfs as
/// at the turn onto the fresh rootfs, points the new chain at that checkpoint
/// (retiring whatever chain the new container's key had, when it is another's),
/// and returns the CRIU images to restore at Start (None when the chain has no
/// process checkpoint up to that turn). Opens the store itself, so it does not
/// wait for the engine (and its inspector).
/// A pod container's Create in progress (see [`TaskService::pod_creates`]): claims its
/// (pod sandbox, name) unless another Create holds it, and gives it up when dropped.
struct PodCreate<'a> {
    creates: &'a Mutex<HashMap<(String, String), String>>,
    key: (String, String),
    /// The container whose Create holds the claim, when not this one.
    other: Option<String>,
}

impl<'a> PodCreate<'a> {
    fn claim(creates: &'a Mutex<HashMap<(String, String), String>>, sandbox_id: &str, name: &str, id: &str) -> Self {
        let key = (sandbox_id.to_string(), name.to_string());
        let mut map = creates.lock().expect("pod creates lock");
        let other = match map.get(&key) {
            Some(holder) if holder != id => Some(holder.clone()),
            _ => {
                map.insert(key.clone(), id.to_string());
                None
            }
        };
        Self { creates, key, other }
    }
}

impl Drop for PodCreate<'_> {
    fn drop(&mut self) {
        if self.other.is_none() {
            self.creates.lock().expect("pod creates lock").remove(&self.key);
        }
    }
}

/// Whether an exec is `bash` reading its commands from stdin, not interactive: its program's
/// name is `bash` and its arguments are options that neither give it a command (`-c`), a
/// script, nor make it interactive (`-i`, which prints prompts). Only such a session is asked
/// for its state (see `crab_engine::shell`).
fn reads_commands_from_stdin(process: &super::process::Process) -> bool {
    let spec: serde_json::Value = match serde_json::from_slice(process.spec.as_deref().unwrap_or_default()) {
        Ok(spec) => spec,
        Err(_) => return false,
    };
    let args: Vec<&str> = spec["args"].as_array().into_iter().flatten().filter_map(|a| a.as_str()).collect();
    shell_session_args(&args)
}

fn shell_session_args(args: &[&str]) -> bool {
    let Some((program, options)) = args.split_first() else { return false };
    if program.rsplit('/').next() != Some("bash") {
        return false;
    }
    options.iter().all(|o| match o.strip_prefix("--") {
        Some(long) => matches!(long, "login" | "norc" | "noprofile" | "posix" | "noediting"),
        None => o
            .strip_prefix('-')
            .is_some_and(|short| !short.is_empty() && short.chars().all(|c| matches!(c, 'l' | 's' | 'e' | 'u'))),
    })
}

async fn prepare_restore(
    checkpoint: &crab_config::CheckpointConfig,
    source: &SandboxKey,
    turn: u64,
    new_key: &SandboxKey,
    bundle: &Path,
    pod: Option<(String, String)>,
) -> Result<(Option<(PathBuf, u64)>, Vec<crab_store::ShellRestore>), ShimError> {
    let rootfs = bundle.join("rootfs");
    let skip = spec_mounts(bundle)?.destinations();
    let (src, new) = (source.to_string(), new_key.to_string());
    let (state_dir, kept) = (checkpoint.state_dir.clone(), checkpoint.kept_images());
    let ms = |since: std::time::Instant| since.elapsed().as_secs_f64() * 1e3;
    let failed =
        |e: &dyn std::fmt::Display| ShimError::FailedPrecondition(format!("restore from {source}:{turn}: {e}"));
    let restored = tokio::task::spawn_blocking(move || {
        let store = crab_store::CheckpointStore::open_with(&state_dir, &kept)?;
        if src != new {
            // A fork onto an id that had a chain: that one is kept aside, not overwritten.
            store.retire(&new)?;
        }
        // The rootfs and the CRIU images are independent: both are put together at once.
        let (rootfs_done, images) = std::thread::scope(|scope| {
            let rootfs_job = scope.spawn(|| {
                let clock = std::time::Instant::now();
                store.materialize_rootfs(&src, turn, &rootfs, &skip).map(|_| ms(clock))
            });
            let clock = std::time::Instant::now();
            // Beside the kept copy, so that it is linked, not copied.
            let images = store.restore_path(&new).and_then(|dest| {
                let _ = std::fs::remove_dir_all(&dest);
                store.restore_images_report(&src, turn, &dest).map(|report| (report, dest))
            });
            let images_ms = ms(clock);
            let rootfs_done = rootfs_job.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (rootfs_done, images.map(|(report, dest)| (report, dest, images_ms)))
        });
        let rootfs_ms = rootfs_done?;
        let (images, dest, images_ms) = images?;
        let shells = store.shell_restores(&src, turn)?;
        if images.is_some() {
            set_next_pid_in_images(&store, &state_dir, &src, turn, &dest)?;
        }
        let clock = std::time::Instant::now();
        if src != new {
            store.fork(&src, turn, &new)?;
            // Which chain this one continues: `crabctl turns` says so, and GC keeps the
            // source's checkpoint through the new head.
            let (reason, (pod_sandbox, container_name)) = match pod {
                Some((sandbox, name)) => (crab_store::OriginReason::KubeletReplacement, (Some(sandbox), Some(name))),
                None => (crab_store::OriginReason::RestoreFrom, (None, None)),
            };
            let at_unix_ms = crab_store::turns::unix_ms(std::time::SystemTime::now());
            let origin =
                crab_store::Origin { source: src.clone(), turn, reason, pod_sandbox, container_name, at_unix_ms };
            store.set_origin(&new, &origin)?;
        }
        tracing::info!(container = %new, source = %src, turn, images_turn = ?images.map(|(t, _)| t),
            rootfs_ms, images_ms, fork_ms = ms(clock),
            image_bytes = images.map_or(0, |(_, r)| r.bytes),
            chunks = images.map_or(0, |(_, r)| r.chunks),
            chunks_read = images.map_or(0, |(_, r)| r.chunks_read),
            restore_step = "store", "restoring from checkpoint");
        Ok::<_, crab_store::CheckpointError>((images.map(|(images_turn, _)| (dest, images_turn)), shells))
    })
    .await
    .map_err(|e| failed(&e))?
    .map_err(|e| failed(&e))?;
    Ok(restored)
}

/// CRIU restores every pid but not the pid namespace's cursor: the dump recorded it beside its
/// images ([`crab_runtime::pidns`]), and the turns after the dump that forked moved it on. The
/// newest of them that `turn`'s checkpoint stands for says where it stood: the clean turns
/// after it (in the turn log, on the node that ran them), else the file-system turns between
/// the images and it (in their manifests, which travel with the checkpoint).
fn set_next_pid_in_images(
    store: &crab_store::CheckpointStore,
    state_dir: &Path,
    src: &str,
    turn: u64,
    images: &Path,
) -> Result<(), crab_store::CheckpointError> {
    let after_clean = match crab_store::turns::TurnLog::open(state_dir, src).and_then(|log| log.read()) {
        Ok(records) => crab_store::turns::next_pid_after_clean_turns(&records, turn),
        Err(e) => {
            tracing::warn!(container = src, error = %e, "turn log unread: the pid cursor of the clean turns after the checkpoint is not restored");
            None
        }
    };
    // The manifests only when no clean turn after the checkpoint forked: reading them loads the chain.
    let next = match after_clean {
        Some(next) => Some(next),
        None => store.restore_next_pid(src, turn)?,
    };
    let Some(next) = next else { return Ok(()) };
    match crab_runtime::pidns::record_in_images(images, next) {
        Ok(()) => tracing::debug!(container = src, turn, next, "pid cursor of a turn after the dump"),
        Err(e) => {
            tracing::warn!(container = src, turn, next, error = %e, "the restore sets the pid cursor its dump recorded")
        }
    }
    Ok(())
}

async fn copy_dir(from: &Path, to: &Path) -> Result<(), ShimError> {
    tokio::fs::create_dir_all(to).await.map_err(|e| ShimError::io(to, e))?;
    let mut entries = tokio::fs::read_dir(from).await.map_err(|e| ShimError::io(from, e))?;
    while let Some(entry) = entries.next_entry().await.map_err(|e| ShimError::io(from, e))? {
        let target = to.join(entry.file_name());
        let kind = entry.file_type().await.map_err(|e| ShimError::io(&entry.path(), e))?;
        if kind.is_dir() {
            Box::pin(copy_dir(&entry.path(), &target)).await?;
        } else if kind.is_file() {
            tokio::fs::copy(entry.path(), &target).await.map_err(|e| ShimError::io(&target, e))?;
        }
    }
    Ok(())
}

fn delete_response(process: &Process) -> DeleteResponse {
    let snap = process.snapshot();
    let exit = snap.exit.unwrap_or(Exit { pid: snap.pid, status: 0, at: SystemTime::now() });
    DeleteResponse {
        pid: snap.pid,
        exit_status: exit.status as u32,
        exited_at: timestamp(exit.at),
        ..Default::default()
    }
}

/// Mounts the rootfs containerd prepared (usually one overlay) on bundle/rootfs.
async fn mount_rootfs(bundle: &Path, mounts: &[containerd_shim_protos::api::Mount]) -> Result<bool, ShimError> {
    if mounts.is_empty() {
        return Ok(false);
    }
    let target = bundle.join("rootfs");
    tokio::fs::create_dir_all(&target).await.map_err(|e| ShimError::io(&target, e))?;
    for m in mounts {
        containerd_shim::asynchronous::util::mount_rootfs(m, &target)
            .await
            .map_err(|e| ShimError::Other(format!("mount {} ({}) on {}: {e}", m.source, m.type_, target.display())))?;
    }
    Ok(true)
}

fn empty() -> ttrpc::Result<Empty> {
    Ok(Empty::new())
}

#[async_trait]
impl Task for TaskService {
    async fn state(&self, _ctx: &TtrpcContext, req: StateRequest) -> TtrpcResult<StateResponse> {
        let container = self.container(&req.id)?;
        let process = container.process(&req.exec_id)?;
        let snap = process.snapshot();
        let mut resp = StateResponse {
            id: if req.exec_id.is_empty() { req.id.clone() } else { req.exec_id.clone() },
            bundle: container.config.bundle.display().to_string(),
            pid: snap.pid,
            stdin: process.uris.stdin.clone(),
            stdout: process.uris.stdout.clone(),
            stderr: process.uris.stderr.clone(),
            terminal: process.uris.terminal,
            exec_id: req.exec_id,
            ..Default::default()
        };
        resp.status = status_of(snap.status).into();
        if let Some(exit) = snap.exit {
            resp.exit_status = exit.status as u32;
            resp.exited_at = timestamp(exit.at);
        }
        Ok(resp)
    }

    async fn create(&self, _ctx: &TtrpcContext, req: CreateTaskRequest) -> TtrpcResult<CreateTaskResponse> {
        let id = req.id.clone();
        self.do_create(req).await.map_err(|e| {
            tracing::error!(container = %id, error = %e, "create failed");
            e.into()
        })
    }

    async fn start(&self, _ctx: &TtrpcContext, req: StartRequest) -> TtrpcResult<StartResponse> {
        Ok(self.do_start(req).await?)
    }

    async fn delete(&self, _ctx: &TtrpcContext, req: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        Ok(self.do_delete(req).await?)
    }

    async fn pids(&self, _ctx: &TtrpcContext, req: PidsRequest) -> TtrpcResult<PidsResponse> {
        Ok(self.do_pids(req).await?)
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: PauseRequest) -> TtrpcResult<Empty> {
        self.container(&req.id)?.pause().await?;
        self.events.publish(TaskPaused { container_id: req.id, ..Default::default() }).await;
        empty()
    }

    async fn resume(&self, _ctx: &TtrpcContext, req: ResumeRequest) -> TtrpcResult<Empty> {
        self.container(&req.id)?.resume().await?;
        self.events.publish(TaskResumed { container_id: req.id, ..Default::default() }).await;
        empty()
    }

    async fn checkpoint(&self, _ctx: &TtrpcContext, req: CheckpointTaskRequest) -> TtrpcResult<Empty> {
        self.do_checkpoint(req).await?;
        empty()
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: KillRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        let process = container.process(&req.exec_id)?;
        container.kill(&process, req.signal, req.all).await?;
        empty()
    }

    async fn exec(&self, _ctx: &TtrpcContext, req: ExecProcessRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        let spec = req
            .spec
            .as_ref()
            .map(|any| any.value.clone())
            .ok_or_else(|| ShimError::InvalidArgument(format!("exec {}: no process spec", req.exec_id)))?;
        let uris = StdioUris { stdin: req.stdin, stdout: req.stdout, stderr: req.stderr, terminal: req.terminal };
        container.add_exec(&req.exec_id, uris, spec)?;
        self.events.publish(TaskExecAdded { container_id: req.id, exec_id: req.exec_id, ..Default::default() }).await;
        empty()
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> TtrpcResult<Empty> {
        let process = self.container(&req.id)?.process(&req.exec_id)?;
        match process.io() {
            Some(io) => io.resize(req.width, req.height).map_err(ShimError::from)?,
            None => return Err(ShimError::FailedPrecondition("process has no io yet".into()).into()),
        }
        empty()
    }

    async fn close_io(&self, _ctx: &TtrpcContext, req: CloseIORequest) -> TtrpcResult<Empty> {
        let process = self.container(&req.id)?.process(&req.exec_id)?;
        if req.stdin
            && let Some(io) = process.io()
        {
            io.close_stdin().await;
        }
        empty()
    }

    async fn update(&self, _ctx: &TtrpcContext, req: UpdateTaskRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        if let Some(value) = req.annotations.get(crab_store::turns::ANNOTATION_TURN)
            && req.resources.as_ref().is_none_or(|r| r.value.is_empty())
        {
            let engine = container.settled_engine().await?;
            crab_engine::turn_request(container.id(), engine, value).await.map_err(ShimError::from)?;
            return empty();
        }
        let resources = req
            .resources
            .as_ref()
            .map(|any| any.value.clone())
            .ok_or_else(|| ShimError::InvalidArgument("update: no resources".into()))?;
        container.update(&resources).await?;
        empty()
    }

    async fn wait(&self, _ctx: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
        let process = self.container(&req.id)?.process(&req.exec_id)?;
        let exit = process.wait().await;
        Ok(WaitResponse { exit_status: exit.status as u32, exited_at: timestamp(exit.at), ..Default::default() })
    }

    async fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> TtrpcResult<StatsResponse> {
        Ok(self.do_stats(req).await?)
    }

    async fn connect(&self, _ctx: &TtrpcContext, req: ConnectRequest) -> TtrpcResult<ConnectResponse> {
        let task_pid = self.container(&req.id).map(|c| c.init.pid()).unwrap_or(0);
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, req: ShutdownRequest) -> TtrpcResult<Empty> {
        // One shim may serve a whole pod: it stays while any container remains.
        if !self.containers.lock().expect("containers lock").is_empty() && !req.now {
            return empty();
        }
        tracing::info!("shutdown requested");
        // The socket's name goes before the answer. containerd's task delete returns once
        // this is answered, and a client may create a container of the same id at once
        // (crabctl recover does): that container's `start` must not find this shim, which
        // stops accepting but keeps listening while its connections wind down (a second
        // or more under load), take it for live and hand containerd an address whose
        // server is going away ("ttrpc: closed" at Create).
        if let Err(e) = std::fs::remove_file(&self.socket)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(socket = %self.socket.display(), error = %e, "shim socket not unlinked at shutdown");
        }
        self.shutdown.cancel();
        empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bash_reading_commands_from_stdin_is_a_shell_session() {
        for args in
            [&["bash"][..], &["/bin/bash", "--norc", "--noprofile"], &["bash", "-l"], &["/usr/bin/bash", "-s", "-eu"]]
        {
            assert!(shell_session_args(args), "{args:?}");
        }
        for args in [
            &[][..],
            &["sh"],
            &["bash", "-c", "cat"],
            &["bash", "-lc", "cat"],
            &["bash", "-i"],
            &["bash", "script.sh"],
            &["bash", "--rcfile", "x"],
            &["python3"],
            &["notbash"],
        ] {
            assert!(!shell_session_args(args), "{args:?}");
        }
    }

    #[test]
    fn one_create_at_a_time_claims_a_pod_container_name() {
        let creates = Mutex::new(HashMap::new());
        let first = PodCreate::claim(&creates, "pod1", "main", "c1");
        assert_eq!(first.other, None);
        // A second replacement created meanwhile is told who holds the name: it starts fresh.
        let second = PodCreate::claim(&creates, "pod1", "main", "c2");
        assert_eq!(second.other.as_deref(), Some("c1"));
        // Another name, or the same name in another pod, is free.
        assert_eq!(PodCreate::claim(&creates, "pod1", "sidecar", "c3").other, None);
        assert_eq!(PodCreate::claim(&creates, "pod2", "main", "c4").other, None);
        // The loser's drop leaves the holder's claim; the holder's drop frees the name.
        drop(second);
        assert_eq!(PodCreate::claim(&creates, "pod1", "main", "c5").other.as_deref(), Some("c1"));
        drop(first);
        assert_eq!(PodCreate::claim(&creates, "pod1", "main", "c6").other, None);
    }
}
