//! The calls `ctr` cannot make for every runtime, sent to containerd's Tasks gRPC service as any
//! containerd client would send them:
//! - containerd 1.6's `ctr` has no `task update`;
//! - `ctr task checkpoint` puts `--image-path`, `--work-path` and `--exit` into the request's options
//!   only when the container's runtime is named `io.containerd.runc.v1`/`.v2`: for any other runtime
//!   name it drops them silently (its `withCheckpointOpts` switches on the name), so the shim never
//!   learns of them. A client that knows the runtime speaks runc's checkpoint options sends them.
//!   containerd 1.6 then honours the image path only for runtimes named io.containerd.runc.*: for
//!   others it also stores the CRIU files and the container's spec in its content store and
//!   returns their descriptors; committing the same spec again fails with "already exists" until
//!   the garbage collector took the first copy. The client removes what it did not ask for.

use std::time::Duration;

use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::services::v1::{
    CheckpointTaskRequest, DeleteContentRequest, PauseTaskRequest, ResumeTaskRequest, UpdateTaskRequest,
};
use containerd_client::tonic::Request;
use containerd_client::tonic::transport::Channel;
use containerd_client::with_namespace;

use crate::{HarnessError, Outcome};
use crab_containerd::Ctr;

/// containerd registers the OCI runtime-spec types under this URL prefix and encodes them as JSON.
const LINUX_RESOURCES_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";

/// runc's checkpoint options, the type containerd's runc shims (and crab's) decode.
const RUNC_CHECKPOINT_OPTIONS_TYPE_URL: &str = "containerd.runc.v1.CheckpointOptions";

fn grpc_error(id: &str, what: &str, detail: String) -> HarnessError {
    HarnessError::Expectation(format!("{what} for task {id}: {detail}"))
}

async fn tasks_client(ctr: &Ctr, id: &str) -> Outcome<TasksClient<Channel>> {
    Ok(TasksClient::new(channel(ctr, id).await?))
}

async fn channel(ctr: &Ctr, id: &str) -> Outcome<Channel> {
    containerd_client::connect(ctr.socket())
        .await
        .map_err(|e| grpc_error(id, "connecting to containerd", format!("{} ({e:?})", ctr.socket().display())))
}

fn status_error(id: &str, call: &str) -> impl FnOnce(containerd_client::tonic::Status) -> HarnessError {
    move |status| grpc_error(id, call, format!("{}: {}", status.code(), status.message()))
}

/// What `ctr task checkpoint --image-path DIR [--exit]` asks of a runc shim.
#[derive(Debug, Clone, Default)]
pub struct TaskCheckpoint {
    pub image_path: String,
    pub exit: bool,
}

impl TaskCheckpoint {
    /// `containerd.runc.v1.CheckpointOptions` on the wire: `exit` is field 1 (bool), `image_path`
    /// field 8 (string). Hand-encoded: the client crate does not build runc's option protos.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.exit {
            out.extend_from_slice(&[1 << 3, 1]);
        }
        if !self.image_path.is_empty() {
            out.push((8 << 3) | 2);
            let mut len = self.image_path.len();
            while len >= 0x80 {
                out.push((len as u8 & 0x7f) | 0x80);
                len >>= 7;
            }
            out.push(len as u8);
            out.extend_from_slice(self.image_path.as_bytes());
        }
        out
    }
}

/// `ctr task checkpoint` as its client library does it (pause, checkpoint, resume), with the
/// options sent whatever the runtime's name. The resume that follows an `exit` checkpoint finds no
/// task, as in `ctr`, and its error is ignored the same way.
pub async fn checkpoint_task(ctr: &Ctr, id: &str, checkpoint: &TaskCheckpoint, timeout: Duration) -> Outcome<()> {
    tokio::time::timeout(timeout, pause_checkpoint_resume(ctr, id, checkpoint)).await.map_err(|_| {
        HarnessError::Timeout { what: format!("checkpoint of task {id} ({checkpoint:?})"), after: timeout }
    })?
}

async fn pause_checkpoint_resume(ctr: &Ctr, id: &str, checkpoint: &TaskCheckpoint) -> Outcome<()> {
    let mut tasks = tasks_client(ctr, id).await?;
    let pause = PauseTaskRequest { container_id: id.to_string() };
    tasks.pause(with_namespace!(pause, ctr.namespace())).await.map_err(status_error(id, "Tasks.Pause"))?;
    let request = CheckpointTaskRequest {
        container_id: id.to_string(),
        parent_checkpoint: String::new(),
        options: Some(prost_types::Any {
            type_url: RUNC_CHECKPOINT_OPTIONS_TYPE_URL.to_string(),
            value: checkpoint.encode(),
        }),
    };
    let checkpointed = match tasks.checkpoint(with_namespace!(request, ctr.namespace())).await {
        Ok(response) => discard_content(ctr, id, &response.into_inner().descriptors).await,
        Err(status) => Err(status_error(id, "Tasks.Checkpoint")(status)),
    };
    let resume = ResumeTaskRequest { container_id: id.to_string() };
    let resumed = tasks.resume(with_namespace!(resume, ctr.namespace())).await;
    checkpointed?;
    if !checkpoint.exit {
        resumed.map_err(status_error(id, "Tasks.Resume"))?;
    }
    Ok(())
}

/// Deletes content containerd stored for a checkpoint that was asked to go to a directory.
async fn discard_content(ctr: &Ctr, id: &str, descriptors: &[containerd_client::types::Descriptor]) -> Outcome<()> {
    if descriptors.is_empty() {
        return Ok(());
    }
    let mut content = ContentClient::new(channel(ctr, id).await?);
    for descriptor in descriptors {
        let request = DeleteContentRequest { digest: descriptor.digest.clone() };
        match content.delete(with_namespace!(request, ctr.namespace())).await {
            Ok(_) => {}
            Err(status) if status.code() == containerd_client::tonic::Code::NotFound => {}
            Err(status) => return Err(status_error(id, "Content.Delete")(status)),
        }
    }
    Ok(())
}

/// `Tasks.Update` of container `id` with OCI `LinuxResources` given as JSON.
pub async fn update_task_resources(ctr: &Ctr, id: &str, resources: &serde_json::Value) -> Outcome<()> {
    let mut tasks = tasks_client(ctr, id).await?;
    let request = UpdateTaskRequest {
        container_id: id.to_string(),
        resources: Some(prost_types::Any {
            type_url: LINUX_RESOURCES_TYPE_URL.to_string(),
            value: serde_json::to_vec(resources).expect("JSON values serialise"),
        }),
        annotations: Default::default(),
    };
    tasks.update(with_namespace!(request, ctr.namespace())).await.map_err(status_error(id, "Tasks.Update"))?;
    Ok(())
}
