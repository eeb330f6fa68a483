//! containerd's gRPC API, for what the `ctr` command line cannot ask: a Task
//! Update that carries annotations and no resources (crab's turn marks).

use std::path::{Path, PathBuf};

use containerd_client::services::v1::UpdateTaskRequest;
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::tonic;

use crab_store::turns::{ANNOTATION_TURN, TurnRequest};

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("connecting to containerd at {socket}: {source}")]
    Connect { socket: PathBuf, source: tonic::transport::Error },
    #[error("namespace {0:?} cannot be sent as gRPC metadata")]
    Namespace(String),
    #[error("{call} of {container}: {code:?}: {message}")]
    Call { call: &'static str, container: String, code: tonic::Code, message: String },
}

/// One containerd socket and namespace.
pub struct Containerd {
    socket: PathBuf,
    namespace: String,
}

impl Containerd {
    pub fn new(socket: impl Into<PathBuf>, namespace: impl Into<String>) -> Self {
        Self { socket: socket.into(), namespace: namespace.into() }
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

    async fn tasks(&self) -> Result<TasksClient<tonic::transport::Channel>, GrpcError> {
        let channel = containerd_client::connect(&self.socket)
            .await
            .map_err(|source| GrpcError::Connect { socket: self.socket.clone(), source })?;
        Ok(TasksClient::new(channel))
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
        self.tasks().await?.update(request).await.map_err(|status| GrpcError::Call {
            call: "Tasks.Update",
            container: container.into(),
            code: status.code(),
            message: status.message().into(),
        })?;
        Ok(())
    }
}
