//! containerd's gRPC API: what crabctl asks containerd (namespaces, containers and their
//! specs, tasks), the containers it creates from a kept spec (its restores), and what the `ctr`
//! command line cannot ask at all: a Task Update that carries annotations and no resources
//! (crab's turn marks). Every call is bounded ([`CALL_TIMEOUT`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::containers_client::ContainersClient;
use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::services::v1::namespaces_client::NamespacesClient;
use containerd_client::services::v1::snapshots::snapshots_client::SnapshotsClient;
use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, RemoveSnapshotRequest};
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest, DeleteTaskRequest,
    ExecProcessRequest, GetContainerRequest, GetImageRequest, GetRequest, KillRequest, ListContainersRequest,
    ListNamespacesRequest, ListTasksRequest, ReadContentRequest, StartRequest, UpdateTaskRequest, WaitRequest,
};
use containerd_client::tonic;

use crate::image::{self, DocumentKind, ImageError, MAX_DOCUMENT_BYTES};
use crab_store::turns::{ANNOTATION_TURN, TurnRequest};

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("connecting to containerd at {socket}: {source}")]
    Connect { socket: PathBuf, source: tonic::transport::Error },
    #[error("namespace {0:?} cannot be sent as gRPC metadata")]
    Namespace(String),
    #[error("{call} of {container}: {code:?}: {message}")]
    Call { call: &'static str, container: String, code: tonic::Code, message: String },
    #[error("{call} of {container}: no answer from containerd within {after:?}")]
    Timeout { call: &'static str, container: String, after: Duration },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("exec {exec_id} in {container}: {problem}")]
    ExecSpec { container: String, exec_id: String, problem: String },
    #[error(
        "image {image} is not unpacked for snapshotter {snapshotter} on this node (no snapshot {chain_id}): \
         pull or import it here, which unpacks it"
    )]
    NotUnpacked { image: String, snapshotter: String, chain_id: String },
}

/// The type containerd stores a container's OCI spec under.
pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";

/// The type containerd takes an exec's process spec as.
pub const PROCESS_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";

/// An exec's standard streams: paths of fifos the caller made and holds open.
#[derive(Debug, Clone)]
pub struct ExecIo {
    pub stdin: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

/// containerd's default snapshotter on Linux, for a container whose record is gone.
pub const DEFAULT_SNAPSHOTTER: &str = "overlayfs";

/// A container to create from a kept spec and start, detached.
#[derive(Debug, Clone)]
pub struct NewContainer {
    pub id: String,
    /// The image whose layers its root file system starts from.
    pub image: String,
    pub runtime: String,
    /// The runtime's options as containerd holds them (type URL, bytes).
    pub runtime_options: Option<(String, Vec<u8>)>,
    /// The OCI spec, JSON, used as it is.
    pub spec: Vec<u8>,
    pub labels: HashMap<String, String>,
    pub snapshotter: String,
}

/// The bound on one call: containerd answers these in milliseconds, a Kill or a Delete included
/// (the shim's own verbs are bounded below it).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What containerd keeps of a container, as crabctl needs it.
#[derive(Debug, Clone)]
pub struct ContainerRecord {
    pub image: String,
    /// The runtime's name (`io.containerd.crab.v2`).
    pub runtime: String,
    /// The runtime's options (crab's `ConfigPath`), as containerd holds them.
    pub runtime_options: Option<(String, Vec<u8>)>,
    /// The OCI spec, JSON.
    pub spec: Option<Vec<u8>>,
    pub labels: HashMap<String, String>,
    /// The snapshotter of its root file system (empty for none).
    pub snapshotter: String,
}

/// A container's task: its init's pid and its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskState {
    pub container: String,
    pub pid: u32,
    pub status: containerd_client::types::v1::Status,
}

impl TaskState {
    pub fn is_running(&self) -> bool {
        self.status == containerd_client::types::v1::Status::Running
    }

    /// Its processes exist (running, or paused with their memory).
    pub fn is_alive(&self) -> bool {
        use containerd_client::types::v1::Status;
        self.pid > 0 && matches!(self.status, Status::Running | Status::Paused | Status::Pausing)
    }
}

/// One containerd socket and namespace, over one connection (made at the first call).
pub struct Containerd {
    socket: PathBuf,
    namespace: String,
    channel: tokio::sync::OnceCell<tonic::transport::Channel>,
}

impl Containerd {
    pub fn new(socket: impl Into<PathBuf>, namespace: impl Into<String>) -> Self {
        Self { socket: socket.into(), namespace: namespace.into(), channel: Default::default() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn request<T>(&self, message: T) -> Result<tonic::Request<T>, GrpcError> {
        let mut request = tonic::Request::new(message);
        let namespace = self.namespace.parse().map_err(|_| GrpcError::Namespace(self.namespace.clone()))?;
        // containerd reads the namespace of every call from this header.
        request.metadata_mut().insert("containerd-namespace", namespace);
        Ok(request)
    }

    async fn channel(&self) -> Result<tonic::transport::Channel, GrpcError> {
        let channel = self.channel.get_or_try_init(|| async {
            match tokio::time::timeout(CALL_TIMEOUT, containerd_client::connect(&self.socket)).await {
                Ok(connected) => connected.map_err(|source| GrpcError::Connect { socket: self.socket.clone(), source }),
                Err(_) => Err(GrpcError::Timeout { call: "connect", container: String::new(), after: CALL_TIMEOUT }),
            }
        });
        Ok(channel.await?.clone())
    }

    async fn tasks(&self) -> Result<TasksClient<tonic::transport::Channel>, GrpcError> {
        Ok(TasksClient::new(self.channel().await?))
    }

    async fn containers_client(&self) -> Result<ContainersClient<tonic::transport::Channel>, GrpcError> {
        Ok(ContainersClient::new(self.channel().await?))
    }

    /// Runs one call within [`CALL_TIMEOUT`]; Err(Ok(status)) is containerd's answer of failure.
    async fn bounded<T>(
        call: &'static str,
        container: &str,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<Result<T, tonic::Status>, GrpcError> {
        match tokio::time::timeout(CALL_TIMEOUT, fut).await {
            Ok(answer) => Ok(answer.map(tonic::Response::into_inner)),
            Err(_) => Err(GrpcError::Timeout { call, container: container.into(), after: CALL_TIMEOUT }),
        }
    }

    fn failed(call: &'static str, container: &str, status: tonic::Status) -> GrpcError {
        GrpcError::Call { call, container: container.into(), code: status.code(), message: status.message().into() }
    }

    /// Every namespace of this containerd (whatever this client's own is).
    pub async fn namespaces(&self) -> Result<Vec<String>, GrpcError> {
        let mut client = NamespacesClient::new(self.channel().await?);
        let request = tonic::Request::new(ListNamespacesRequest { filter: String::new() });
        let listed = Self::bounded("Namespaces.List", "", client.list(request)).await?;
        let listed = listed.map_err(|status| Self::failed("Namespaces.List", "", status))?;
        Ok(listed.namespaces.into_iter().map(|n| n.name).collect())
    }

    /// The containers of this namespace, with their runtime's name.
    pub async fn containers(&self) -> Result<Vec<(String, String)>, GrpcError> {
        let request = self.request(ListContainersRequest { filters: Vec::new() })?;
        let mut client = self.containers_client().await?;
        let listed = Self::bounded("Containers.List", "", client.list(request)).await?;
        let listed = listed.map_err(|status| Self::failed("Containers.List", "", status))?;
        Ok(listed.containers.into_iter().map(|c| (c.id, c.runtime.map(|r| r.name).unwrap_or_default())).collect())
    }

    /// What containerd keeps of `container`; None when it does not know it.
    pub async fn container(&self, container: &str) -> Result<Option<ContainerRecord>, GrpcError> {
        let Some(found) = self.get_container(container).await? else { return Ok(None) };
        let (runtime, runtime_options) = match found.runtime {
            Some(r) => (r.name, r.options.map(|o| (o.type_url, o.value))),
            None => (String::new(), None),
        };
        Ok(Some(ContainerRecord {
            image: found.image,
            runtime,
            runtime_options,
            spec: found.spec.map(|s| s.value),
            labels: found.labels,
            snapshotter: found.snapshotter,
        }))
    }

    async fn get_container(
        &self,
        container: &str,
    ) -> Result<Option<containerd_client::services::v1::Container>, GrpcError> {
        let request = self.request(GetContainerRequest { id: container.into() })?;
        let mut client = self.containers_client().await?;
        match Self::bounded("Containers.Get", container, client.get(request)).await? {
            Ok(got) => Ok(got.container),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(Self::failed("Containers.Get", container, status)),
        }
    }

    /// The tasks of this namespace.
    pub async fn task_states(&self) -> Result<Vec<TaskState>, GrpcError> {
        let request = self.request(ListTasksRequest { filter: String::new() })?;
        let listed = Self::bounded("Tasks.List", "", self.tasks().await?.list(request)).await?;
        let listed = listed.map_err(|status| Self::failed("Tasks.List", "", status))?;
        Ok(listed.tasks.into_iter().map(task_state).collect())
    }

    /// The task of `container`; None when it has none.
    pub async fn task(&self, container: &str) -> Result<Option<TaskState>, GrpcError> {
        self.process(container, "").await
    }

    /// Exec `exec_id` of `container`'s task (the task itself for ""); None when there is none.
    pub async fn process(&self, container: &str, exec_id: &str) -> Result<Option<TaskState>, GrpcError> {
        let request = self.request(GetRequest { container_id: container.into(), exec_id: exec_id.into() })?;
        match Self::bounded("Tasks.Get", container, self.tasks().await?.get(request)).await? {
            Ok(got) => Ok(got.process.map(task_state)),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(Self::failed("Tasks.Get", container, status)),
        }
    }

    /// Starts `argv` in `container` as exec `exec_id` with the container's own process
    /// settings (environment, user, capabilities) in `cwd`, without a terminal, as `ctr tasks
    /// exec` does; its streams are the caller's fifos. A client that holds its fifos itself
    /// (as dockerd does) keeps the exec's stdin open across a containerd restart, where `ctr`
    /// exits and its closed fifo is the end of the process's input.
    pub async fn exec(
        &self,
        container: &str,
        exec_id: &str,
        argv: &[&str],
        cwd: &str,
        io: &ExecIo,
    ) -> Result<u32, GrpcError> {
        let spec_problem =
            |problem: String| GrpcError::ExecSpec { container: container.into(), exec_id: exec_id.into(), problem };
        let found = self.get_container(container).await?.ok_or_else(|| spec_problem("no such container".into()))?;
        let spec = found.spec.ok_or_else(|| spec_problem("the container has no spec".into()))?;
        let mut spec: serde_json::Value =
            serde_json::from_slice(&spec.value).map_err(|e| spec_problem(format!("its spec is not JSON: {e}")))?;
        let process = spec
            .get_mut("process")
            .and_then(serde_json::Value::as_object_mut)
            .ok_or_else(|| spec_problem("its spec has no process".into()))?;
        process.insert("args".into(), argv.iter().map(|arg| serde_json::Value::from(*arg)).collect());
        process.insert("cwd".into(), cwd.into());
        process.insert("terminal".into(), false.into());
        let process = serde_json::to_vec(process).map_err(|e| spec_problem(e.to_string()))?;
        let path = |path: &Path| path.to_string_lossy().into_owned();
        let request = self.request(ExecProcessRequest {
            container_id: container.into(),
            stdin: path(&io.stdin),
            stdout: path(&io.stdout),
            stderr: path(&io.stderr),
            terminal: false,
            spec: Some(prost_types::Any { type_url: PROCESS_TYPE_URL.into(), value: process }),
            exec_id: exec_id.into(),
        })?;
        let created = Self::bounded("Tasks.Exec", container, self.tasks().await?.exec(request)).await?;
        created.map_err(|status| Self::failed("Tasks.Exec", container, status))?;
        let request = self.request(StartRequest { container_id: container.into(), exec_id: exec_id.into() })?;
        let started = Self::bounded("Tasks.Start", container, self.tasks().await?.start(request)).await?;
        Ok(started.map_err(|status| Self::failed("Tasks.Start", container, status))?.pid)
    }

    /// The exit status of exec `exec_id` once it has exited; None if it has not within `within`.
    pub async fn wait(&self, container: &str, exec_id: &str, within: Duration) -> Result<Option<u32>, GrpcError> {
        let request = self.request(WaitRequest { container_id: container.into(), exec_id: exec_id.into() })?;
        let mut tasks = self.tasks().await?;
        match tokio::time::timeout(within, tasks.wait(request)).await {
            Err(_) => Ok(None),
            Ok(Ok(waited)) => Ok(Some(waited.into_inner().exit_status)),
            Ok(Err(status)) => Err(Self::failed("Tasks.Wait", container, status)),
        }
    }

    /// SIGKILLs every process of `container`'s task.
    pub async fn kill_all(&self, container: &str) -> Result<(), GrpcError> {
        const SIGKILL: u32 = 9;
        let request = self.request(KillRequest {
            container_id: container.into(),
            exec_id: String::new(),
            signal: SIGKILL,
            all: true,
        })?;
        let killed = Self::bounded("Tasks.Kill", container, self.tasks().await?.kill(request)).await?;
        killed.map(drop).map_err(|status| Self::failed("Tasks.Kill", container, status))
    }

    /// Deletes `container`'s (stopped) task; a container without one is fine.
    pub async fn delete_task(&self, container: &str) -> Result<(), GrpcError> {
        let request = self.request(DeleteTaskRequest { container_id: container.into() })?;
        match Self::bounded("Tasks.Delete", container, self.tasks().await?.delete(request)).await? {
            Ok(_) => Ok(()),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
            Err(status) => Err(Self::failed("Tasks.Delete", container, status)),
        }
    }

    /// Deletes `container` (its task gone first) and its root file system's snapshot, as
    /// `ctr containers delete` does (containerd keeps the snapshot otherwise, and a container
    /// created again with the id fails on it); one containerd does not know is fine.
    pub async fn delete_container(&self, container: &str) -> Result<(), GrpcError> {
        let snapshot = self.snapshot_of(container).await?;
        let request = self.request(DeleteContainerRequest { id: container.into() })?;
        let mut client = self.containers_client().await?;
        match Self::bounded("Containers.Delete", container, client.delete(request)).await? {
            Ok(_) => {}
            Err(status) if status.code() == tonic::Code::NotFound => {}
            Err(status) => return Err(Self::failed("Containers.Delete", container, status)),
        }
        let Some((snapshotter, key)) = snapshot else { return Ok(()) };
        let request = self.request(RemoveSnapshotRequest { snapshotter, key })?;
        let mut client = SnapshotsClient::new(self.channel().await?);
        match Self::bounded("Snapshots.Remove", container, client.remove(request)).await? {
            Ok(_) => Ok(()),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
            Err(status) => Err(Self::failed("Snapshots.Remove", container, status)),
        }
    }

    /// The snapshotter and key of `container`'s root file system, when it has one.
    async fn snapshot_of(&self, container: &str) -> Result<Option<(String, String)>, GrpcError> {
        let found = self.get_container(container).await?;
        Ok(found.filter(|c| !c.snapshot_key.is_empty()).map(|c| (c.snapshotter, c.snapshot_key)))
    }

    /// Creates `new` (its container record, a root file system over its image's layers, its
    /// task with no stdio) and starts it; returns its init's pid. What `ctr run -d` does, but
    /// from a whole spec instead of one built from the image, so nothing of the kept spec
    /// (mounts, user, capabilities, resources, namespaces, annotations) is lost. On a failure
    /// nothing of `new` is left behind in containerd.
    pub async fn run_detached(&self, new: &NewContainer) -> Result<u32, GrpcError> {
        let parent = self.image_chain_id(&new.image).await?;
        // The record first: it references the snapshot, so containerd's garbage collector
        // keeps the snapshot from the moment it exists (a snapshot no container or lease
        // references may be collected).
        let container = Container {
            id: new.id.clone(),
            labels: new.labels.clone(),
            image: new.image.clone(),
            runtime: Some(Runtime {
                name: new.runtime.clone(),
                options: new
                    .runtime_options
                    .as_ref()
                    .map(|(type_url, value)| prost_types::Any { type_url: type_url.clone(), value: value.clone() }),
            }),
            spec: Some(prost_types::Any { type_url: SPEC_TYPE_URL.into(), value: new.spec.clone() }),
            snapshotter: new.snapshotter.clone(),
            snapshot_key: new.id.clone(),
            ..Default::default()
        };
        let request = self.request(CreateContainerRequest { container: Some(container) })?;
        let mut client = self.containers_client().await?;
        let created = Self::bounded("Containers.Create", &new.id, client.create(request)).await?;
        created.map_err(|status| Self::failed("Containers.Create", &new.id, status))?;
        match self.start_created(new, &parent).await {
            Ok(pid) => Ok(pid),
            Err(error) => {
                // Best effort: the error that matters is the first one.
                let _ = self.kill_all(&new.id).await;
                let _ = self.delete_task(&new.id).await;
                let _ = self.delete_container(&new.id).await;
                Err(error)
            }
        }
    }

    /// The root file system, the task and its start, for a container just recorded.
    async fn start_created(&self, new: &NewContainer, parent: &str) -> Result<u32, GrpcError> {
        let request = self.request(PrepareSnapshotRequest {
            snapshotter: new.snapshotter.clone(),
            key: new.id.clone(),
            parent: parent.into(),
            labels: HashMap::new(),
        })?;
        let mut snapshots = SnapshotsClient::new(self.channel().await?);
        let mounts = match Self::bounded("Snapshots.Prepare", &new.id, snapshots.prepare(request)).await? {
            Ok(prepared) => prepared.mounts,
            Err(status) if status.code() == tonic::Code::NotFound => {
                return Err(GrpcError::NotUnpacked {
                    image: new.image.clone(),
                    snapshotter: new.snapshotter.clone(),
                    chain_id: parent.into(),
                });
            }
            Err(status) => return Err(Self::failed("Snapshots.Prepare", &new.id, status)),
        };
        // No stdio: the shim drops the output and gives an empty input, as `ctr run -d` left
        // them once it exited (nobody read its fifos any more).
        let request =
            self.request(CreateTaskRequest { container_id: new.id.clone(), rootfs: mounts, ..Default::default() })?;
        let created = Self::bounded("Tasks.Create", &new.id, self.tasks().await?.create(request)).await?;
        created.map_err(|status| Self::failed("Tasks.Create", &new.id, status))?;
        let request = self.request(StartRequest { container_id: new.id.clone(), exec_id: String::new() })?;
        let started = Self::bounded("Tasks.Start", &new.id, self.tasks().await?.start(request)).await?;
        Ok(started.map_err(|status| Self::failed("Tasks.Start", &new.id, status))?.pid)
    }

    /// The chain ID of `image`'s layers for this host's platform: the key of its unpacked top
    /// layer in a snapshotter.
    pub async fn image_chain_id(&self, image: &str) -> Result<String, GrpcError> {
        let request = self.request(GetImageRequest { name: image.into() })?;
        let mut client = ImagesClient::new(self.channel().await?);
        let got = Self::bounded("Images.Get", image, client.get(request)).await?;
        let target =
            got.map_err(|status| Self::failed("Images.Get", image, status))?.image.and_then(|i| i.target).ok_or_else(
                || ImageError::Document {
                    image: image.into(),
                    what: "record",
                    digest: String::new(),
                    problem: "has no target".into(),
                },
            )?;
        let (mut media_type, mut digest) = (target.media_type, target.digest);
        // An index names one manifest per platform; a manifest list inside an index is not
        // followed further than this one step.
        if DocumentKind::of(&media_type) == Some(DocumentKind::Index) {
            let index = self.read_document(image, &digest).await?;
            (media_type, digest) = image::pick_manifest(image, &digest, &index, image::host_platform())?;
        }
        if DocumentKind::of(&media_type) != Some(DocumentKind::Manifest) {
            return Err(ImageError::Document {
                image: image.into(),
                what: "manifest",
                digest,
                problem: format!("unexpected media type {media_type:?}"),
            }
            .into());
        }
        let manifest = self.read_document(image, &digest).await?;
        let config_digest = image::config_digest(image, &digest, &manifest)?;
        let config = self.read_document(image, &config_digest).await?;
        Ok(image::chain_id_of_config(image, &config_digest, &config)?)
    }

    /// One of `image`'s JSON documents from the content store, at most [`MAX_DOCUMENT_BYTES`].
    async fn read_document(&self, image: &str, digest: &str) -> Result<Vec<u8>, GrpcError> {
        let request = self.request(ReadContentRequest { digest: digest.into(), offset: 0, size: 0 })?;
        let mut client = ContentClient::new(self.channel().await?);
        let read = async {
            let mut stream = client.read(request).await?.into_inner();
            let mut bytes = Vec::new();
            while let Some(chunk) = stream.message().await? {
                bytes.extend_from_slice(&chunk.data);
                if bytes.len() > MAX_DOCUMENT_BYTES {
                    return Ok(None);
                }
            }
            Ok(Some(bytes))
        };
        let read: Result<Option<Vec<u8>>, tonic::Status> = tokio::time::timeout(CALL_TIMEOUT, read)
            .await
            .map_err(|_| GrpcError::Timeout { call: "Content.Read", container: digest.into(), after: CALL_TIMEOUT })?;
        read.map_err(|status| Self::failed("Content.Read", digest, status))?.ok_or_else(|| {
            ImageError::Document {
                image: image.into(),
                what: "document",
                digest: digest.into(),
                problem: format!("larger than {MAX_DOCUMENT_BYTES} bytes"),
            }
            .into()
        })
    }

    /// Sends the task of `container` a turn request (`io.crab.turn`). The
    /// call returns once the shim has acted on it (for a mark: once the
    /// ended turn is checkpointed).
    pub async fn turn_request(&self, container: &str, request: TurnRequest) -> Result<(), GrpcError> {
        let value = match request {
            TurnRequest::Mark => "mark",
        };
        self.send_turn_annotation(container, value).await
    }

    /// The raw form of [`Containerd::turn_request`]: the shim validates `value`.
    pub async fn send_turn_annotation(&self, container: &str, value: &str) -> Result<(), GrpcError> {
        let update = UpdateTaskRequest {
            container_id: container.to_string(),
            resources: None,
            annotations: [(ANNOTATION_TURN.to_string(), value.to_string())].into(),
        };
        let request = self.request(update)?;
        // Bounded by the shim, which answers once the ended turn is checkpointed (its dump has
        // a bound of its own): no timeout of ours here.
        self.tasks().await?.update(request).await.map_err(|status| Self::failed("Tasks.Update", container, status))?;
        Ok(())
    }
}

fn task_state(process: containerd_client::types::v1::Process) -> TaskState {
    let status = containerd_client::types::v1::Status::try_from(process.status).unwrap_or_default();
    TaskState { container: process.container_id, pid: process.pid, status }
}
