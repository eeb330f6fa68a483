//! The one call `ctr` lacks: containerd 1.6's `ctr` has no `task update`, so resource updates go
//! through containerd's Tasks gRPC service, as any containerd client would send them.

use containerd_client::services::v1::UpdateTaskRequest;
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::tonic::Request;
use containerd_client::with_namespace;

use crate::ctr::Ctr;
use crate::{HarnessError, Outcome};

/// containerd registers the OCI runtime-spec types under this URL prefix and encodes them as JSON.
const LINUX_RESOURCES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";

/// `Tasks.Update` of container `id` with OCI `LinuxResources` given as JSON.
pub async fn update_task_resources(
    ctr: &Ctr,
    id: &str,
    resources: &serde_json::Value,
) -> Outcome<()> {
    let grpc_error = |what: &str, detail: String| {
        HarnessError::Expectation(format!("{what} for task {id}: {detail}"))
    };
    let channel = containerd_client::connect(ctr.socket())
        .await
        .map_err(|e| {
            grpc_error(
                "connecting to containerd",
                format!("{} ({e:?})", ctr.socket().display()),
            )
        })?;
    let request = UpdateTaskRequest {
        container_id: id.to_string(),
        resources: Some(prost_types::Any {
            type_url: LINUX_RESOURCES_TYPE_URL.to_string(),
            value: serde_json::to_vec(resources).expect("JSON values serialise"),
        }),
        annotations: Default::default(),
    };
    TasksClient::new(channel)
        .update(with_namespace!(request, ctr.namespace()))
        .await
        .map_err(|status| {
            grpc_error(
                "Tasks.Update",
                format!("{}: {}", status.code(), status.message()),
            )
        })?;
    Ok(())
}
