//! Harness for the CRI suites (`tests/cri.rs`, `tests/cri_recovery.rs`): pods and containers
//! driven over the CRI gRPC API (`runtime.v1`, the `k8s-cri` bindings) of the CRI containerd of
//! `scripts/cri-containerd`, as kubelet drives them, under the runtime handlers `runc` and `crab`.
//!
//! Environment: `CRAB_CRI_SOCK` (default `$CRAB_CRI_DIR/containerd.sock`, else
//! `${CRAB_CTRD_DIR:-/run/crab-dev}-cri/containerd.sock`, where `scripts/cri-containerd` puts it),
//! `CRAB_TEST_RUNTIMES` (handlers, default `runc,crab`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use containerd_client::tonic::transport::Channel;
use futures::future::LocalBoxFuture;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatusRequest, CreateContainerRequest, ExecRequest,
    ExecSyncRequest, ImageSpec, LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceOption, PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest,
    PortMapping, Protocol, RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
};

use crate::env::Runtime;
use crate::host::{mounts_of, shim_daemons};
use crate::{HarnessError, Outcome, ensure, wait_until};

/// CRI keeps every pod, container and image of its own in this containerd namespace.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Imported by `scripts/cri-containerd start`, beside the pause image.
pub const IMAGE: &str = "crab.local/busybox:latest";
/// The Kubernetes namespace of the suite's pods unless a test names another.
pub const KUBE_NAMESPACE: &str = "crab-cri";
/// Bound of one CRI call: kubelet's default runtime request timeout is 2 minutes; ours is shorter
/// so a hung shim fails the scenario well inside the test's own bound.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a removed pod's shim and mounts may take to go away.
const LEFTOVER_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound of `scripts/cri-containerd start` (a first start builds and imports two small images).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// The socket of the CRI containerd, started once per test process unless it already accepts
/// connections. Panics with the script's output when it cannot be started: a suite that cannot
/// reach CRI must fail, not pass vacuously.
pub fn socket() -> &'static Path {
    static SOCKET: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match SOCKET.get_or_init(ensure_running) {
        Ok(path) => path,
        Err(message) => panic!("CRI containerd not usable: {message}"),
    }
}

fn socket_path() -> PathBuf {
    if let Some(sock) = std::env::var_os("CRAB_CRI_SOCK") {
        return PathBuf::from(sock);
    }
    let dir = std::env::var_os("CRAB_CRI_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let plain = std::env::var("CRAB_CTRD_DIR").unwrap_or_else(|_| "/run/crab-dev".to_string());
        PathBuf::from(format!("{plain}-cri"))
    });
    dir.join("containerd.sock")
}

fn ensure_running() -> Result<PathBuf, String> {
    let socket = socket_path();
    if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        return Ok(socket);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cri-containerd");
    let mut child = Command::new("bash")
        .arg(&script)
        .arg("start")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{} start did not finish within {START_TIMEOUT:?}", script.display()));
            }
            Err(e) => return Err(format!("waiting for {}: {e}", script.display())),
        }
    }
    let output = child.wait_with_output().map_err(|e| format!("reading {}'s output: {e}", script.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} start failed ({}): {}{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(socket)
}

/// Bound of importing (or, when build-images never ran here, building) one sandbox image.
const IMAGE_TIMEOUT: Duration = Duration::from_secs(600);

/// Makes sure the CRI containerd has sandbox image `reference`: when CRI does not know it,
/// `scripts/cri-containerd images BUILD...` imports it from build-images' cache (building it
/// first if that is empty). `build` names it as `scripts/build-images` does (`terminal`,
/// `code-repair PROJECT VERSION`). `scripts/test` imports the suite's images beforehand.
pub async fn ensure_image(reference: &str, build: &[&str]) -> Outcome<()> {
    use k8s_cri::v1::ImageStatusRequest;
    use k8s_cri::v1::image_service_client::ImageServiceClient;
    let path = socket();
    let channel = containerd_client::connect(path)
        .await
        .map_err(|e| HarnessError::Expectation(format!("connecting to CRI at {}: {e:?}", path.display())))?;
    let mut images = ImageServiceClient::new(channel);
    let request = ImageStatusRequest {
        image: Some(ImageSpec { image: reference.to_string(), ..Default::default() }),
        verbose: false,
    };
    if bounded("ImageStatus", images.image_status(request)).await?.into_inner().image.is_some() {
        return Ok(());
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cri-containerd");
    let mut command = tokio::process::Command::new("bash");
    command.arg(&script).arg("images").args(build).env("CRAB_PACKAGE_SOURCES", "0");
    command.stdin(std::process::Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(IMAGE_TIMEOUT, command.output())
        .await
        .map_err(|_| HarnessError::Timeout {
            what: format!("{} images {build:?}", script.display()),
            after: IMAGE_TIMEOUT,
        })?
        .map_err(|e| HarnessError::io(format!("running {}", script.display()), e))?;
    ensure!(
        output.status.success(),
        "{} images {build:?} ({}): {}{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// The handlers to compare, from `CRAB_TEST_RUNTIMES` (default both); `crab` and `runc` are the
/// names `scripts/cri-containerd` gives the two runtime entries.
pub fn handlers() -> Vec<Runtime> {
    std::env::var("CRAB_TEST_RUNTIMES")
        .unwrap_or_else(|_| "runc,crab".to_string())
        .split(',')
        .filter(|part| !part.trim().is_empty())
        .map(|part| Runtime::parse(part).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

fn status_error(call: &str) -> impl FnOnce(containerd_client::tonic::Status) -> HarnessError {
    move |status| HarnessError::Expectation(format!("{call}: {}: {}", status.code(), status.message()))
}

/// Awaits one CRI call within [`CALL_TIMEOUT`].
async fn bounded<T>(call: &str, fut: impl Future<Output = Result<T, containerd_client::tonic::Status>>) -> Outcome<T> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(result) => result.map_err(status_error(call)),
        Err(_) => Err(HarnessError::Timeout { what: call.to_string(), after: CALL_TIMEOUT }),
    }
}

/// A CRI client on the suite's socket.
#[derive(Clone)]
pub struct Cri {
    runtime: RuntimeServiceClient<Channel>,
}

impl Cri {
    pub async fn connect() -> Outcome<Cri> {
        let path = socket();
        let channel = containerd_client::connect(path)
            .await
            .map_err(|e| HarnessError::Expectation(format!("connecting to CRI at {}: {e:?}", path.display())))?;
        Ok(Cri { runtime: RuntimeServiceClient::new(channel) })
    }

    /// Runs a pod of `shape` under `handler` in Kubernetes namespace [`KUBE_NAMESPACE`]; its
    /// logs go to a fresh directory.
    pub async fn run_pod(&self, scenario: &str, handler: &Runtime, shape: &PodShape) -> Outcome<Pod> {
        self.run_pod_in(KUBE_NAMESPACE, scenario, handler, shape).await
    }

    /// [`Self::run_pod`] in Kubernetes namespace `kube_namespace`.
    pub async fn run_pod_in(
        &self,
        kube_namespace: &str,
        scenario: &str,
        handler: &Runtime,
        shape: &PodShape,
    ) -> Outcome<Pod> {
        let handler_name = handler.short().to_string();
        let name = format!("{scenario}-{handler_name}");
        // A uid of its own per run, so a pod left behind by an earlier (killed) run never
        // collides with this one's name.
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let uid = format!("{name}-{}-{}", std::process::id(), stamp.as_nanos());
        let log_dir = std::env::temp_dir().join("crab-cri").join(&uid);
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| HarnessError::io(format!("creating {}", log_dir.display()), e))?;
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.clone(),
                uid,
                namespace: kube_namespace.into(),
                attempt: 0,
            }),
            // As kubelet: a pod in the host's network namespace keeps the host's name (runc
            // refuses to set one without a UTS namespace of the container's own).
            hostname: if shape.host_network { String::new() } else { name.clone() },
            log_directory: log_dir.display().to_string(),
            port_mappings: shape.port_mappings(),
            linux: Some(LinuxPodSandboxConfig {
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(shape.namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut runtime = self.runtime.clone();
        let request = RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: handler_name };
        let id = bounded("RunPodSandbox", runtime.run_pod_sandbox(request)).await?.into_inner().pod_sandbox_id;
        let netns = self.pod_netns(&id).await?;
        Ok(Pod { cri: self.clone(), id, config, log_dir, netns, shape: shape.clone() })
    }

    /// The network namespace CRI made for the pod (none for a hostNetwork pod), from the verbose
    /// status's runtime spec.
    async fn pod_netns(&self, id: &str) -> Outcome<Option<PathBuf>> {
        let mut runtime = self.runtime.clone();
        let request = PodSandboxStatusRequest { pod_sandbox_id: id.to_string(), verbose: true };
        let status = bounded("PodSandboxStatus", runtime.pod_sandbox_status(request)).await?.into_inner();
        let info = status.info.get("info").cloned().unwrap_or_default();
        let info: serde_json::Value = serde_json::from_str(&info)
            .map_err(|e| HarnessError::Parse { what: "PodSandboxStatus info".into(), detail: e.to_string() })?;
        let namespaces = info.pointer("/runtimeSpec/linux/namespaces").and_then(|n| n.as_array()).cloned();
        Ok(namespaces.unwrap_or_default().iter().find_map(|ns| {
            (ns.get("type")?.as_str()? == "network").then(|| ns.get("path")?.as_str().map(PathBuf::from)).flatten()
        }))
    }

    pub async fn container_status(&self, id: &str) -> Outcome<k8s_cri::v1::ContainerStatus> {
        let mut runtime = self.runtime.clone();
        let request = ContainerStatusRequest { container_id: id.to_string(), verbose: false };
        let response = bounded("ContainerStatus", runtime.container_status(request)).await?.into_inner();
        response.status.ok_or_else(|| HarnessError::Expectation(format!("ContainerStatus of {id} has no status")))
    }
}

/// Which host namespaces a pod shares, the security context of its container, and its
/// hostPorts.
#[derive(Debug, Clone, Default)]
pub struct PodShape {
    pub host_network: bool,
    pub host_pid: bool,
    pub host_ipc: bool,
    pub security: LinuxContainerSecurityContext,
    /// TCP hostPorts: CRI hands them to CNI's portmap, which DNATs connections to a host
    /// address at `host` to the pod's address at `container`.
    pub ports: Vec<TcpPort>,
}

/// A TCP port mapping of a pod (a container port's `hostPort` in Kubernetes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpPort {
    pub host: u16,
    pub container: u16,
}

impl PodShape {
    fn port_mappings(&self) -> Vec<PortMapping> {
        self.ports
            .iter()
            .map(|port| PortMapping {
                protocol: Protocol::Tcp as i32,
                container_port: port.container.into(),
                host_port: port.host.into(),
                host_ip: String::new(),
            })
            .collect()
    }

    fn namespaces(&self) -> NamespaceOption {
        use k8s_cri::v1::NamespaceMode;
        let mode = |host: bool| if host { NamespaceMode::Node } else { NamespaceMode::Pod } as i32;
        NamespaceOption {
            network: mode(self.host_network),
            pid: if self.host_pid { NamespaceMode::Node as i32 } else { NamespaceMode::Container as i32 },
            ipc: mode(self.host_ipc),
            ..Default::default()
        }
    }
}

/// A running pod sandbox. [`Pod::remove`] stops and removes it and checks that nothing is left;
/// a scenario that fails before calls [`Pod::discard`] so no pod outlives the test.
pub struct Pod {
    cri: Cri,
    pub id: String,
    config: PodSandboxConfig,
    pub log_dir: PathBuf,
    netns: Option<PathBuf>,
    shape: PodShape,
}

/// What a removed pod left on the host: shims, mounts, its network namespace, portmap's DNAT
/// rules for its hostPorts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Leftovers {
    shims: usize,
    mounts: usize,
    netns: bool,
    hostport_rules: usize,
}

/// The chain where CNI's portmap plugin puts one rule per pod with hostPorts (shared by every
/// CNI network of the host); each names its network and pod in a comment.
const HOSTPORT_CHAIN: &str = "CNI-HOSTPORT-DNAT";

/// portmap's rules for pod sandbox `pod_id` in the nat table's [`HOSTPORT_CHAIN`] (as
/// `iptables -S` prints them): CNI ADD puts one there for a pod with hostPorts, jumping to the
/// pod's own `CNI-DN-*` chain, and CNI DEL removes both. The whole table is listed, as listing
/// a chain that does not exist (no pod on the host ever had a hostPort) is an error whose
/// wording differs between iptables' backends.
pub fn hostport_rules(pod_id: &str) -> Outcome<Vec<String>> {
    let output = Command::new("iptables")
        .args(["-w", "5", "-t", "nat", "-S"])
        .output()
        .map_err(|e| HarnessError::io("running iptables -t nat -S", e))?;
    if !output.status.success() {
        return Err(HarnessError::Expectation(format!(
            "iptables -t nat -S: {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    let chain = format!("-A {HOSTPORT_CHAIN} ");
    let tag = format!("id: \\\"{pod_id}\\\"");
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with(&chain) && l.contains(&tag))
        .map(String::from)
        .collect())
}

impl Pod {
    /// Creates (not starts) container `name` running `command` with the pod's security context
    /// (attempt 0, log `<name>.log`).
    pub async fn create(&self, name: &str, command: &[&str]) -> Outcome<String> {
        self.create_container(name, 0, IMAGE, format!("{name}.log"), command, &[]).await
    }

    /// CreateContainer as kubelet sends it: the pod's security context and namespaces, and
    /// the given attempt, image, log path and container annotations.
    async fn create_container(
        &self,
        name: &str,
        attempt: u32,
        image: &str,
        log_path: String,
        command: &[&str],
        annotations: &[(&str, &str)],
    ) -> Outcome<String> {
        let mut security = self.shape.security.clone();
        security.namespace_options = Some(self.shape.namespaces());
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata { name: name.to_string(), attempt }),
            image: Some(ImageSpec { image: image.to_string(), ..Default::default() }),
            command: command.iter().map(|s| s.to_string()).collect(),
            log_path,
            linux: Some(LinuxContainerConfig { security_context: Some(security), resources: None }),
            annotations: annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        };
        let request = CreateContainerRequest {
            pod_sandbox_id: self.id.clone(),
            config: Some(config),
            sandbox_config: Some(self.config.clone()),
        };
        let mut runtime = self.cri.runtime.clone();
        Ok(bounded("CreateContainer", runtime.create_container(request)).await?.into_inner().container_id)
    }

    /// The pod's address on the CNI network, from PodSandboxStatus.
    pub async fn ip(&self) -> Outcome<std::net::IpAddr> {
        let mut runtime = self.cri.runtime.clone();
        let request = PodSandboxStatusRequest { pod_sandbox_id: self.id.clone(), verbose: false };
        let status = bounded("PodSandboxStatus", runtime.pod_sandbox_status(request)).await?.into_inner();
        let ip = status.status.and_then(|s| s.network).map(|n| n.ip).unwrap_or_default();
        ip.parse().map_err(|_| {
            HarnessError::Expectation(format!("pod {} has no address on the CNI network: {ip:?}", self.id))
        })
    }

    /// The host's own address towards the pod (the source of its route to the pod's address):
    /// the CNI bridge's, where a hostPort is reached as a node's address is.
    pub async fn host_address(&self) -> Outcome<std::net::IpAddr> {
        let pod = self.ip().await?;
        // Connecting a UDP socket sends nothing: it only picks the route and its source.
        let socket = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0))
            .map_err(|e| HarnessError::io("binding a UDP socket", e))?;
        socket
            .connect((pod, 9))
            .map_err(|e| HarnessError::io(format!("no route from the host to pod address {pod}"), e))?;
        let local = socket.local_addr().map_err(|e| HarnessError::io("reading a UDP socket's address", e))?.ip();
        ensure_on_bridge(local, pod)?;
        Ok(local)
    }

    pub async fn start(&self, id: &str) -> Outcome<()> {
        let mut runtime = self.cri.runtime.clone();
        let request = StartContainerRequest { container_id: id.to_string() };
        bounded("StartContainer", runtime.start_container(request)).await.map(drop)
    }

    /// Creates and starts container `name`.
    pub async fn run(&self, name: &str, command: &[&str]) -> Outcome<String> {
        let id = self.create(name, command).await?;
        self.start(&id).await?;
        Ok(id)
    }

    pub async fn stop(&self, id: &str, timeout_s: i64) -> Outcome<()> {
        let mut runtime = self.cri.runtime.clone();
        let request = StopContainerRequest { container_id: id.to_string(), timeout: timeout_s };
        bounded("StopContainer", runtime.stop_container(request)).await.map(drop)
    }

    pub async fn remove_container(&self, id: &str) -> Outcome<()> {
        let mut runtime = self.cri.runtime.clone();
        let request = RemoveContainerRequest { container_id: id.to_string() };
        bounded("RemoveContainer", runtime.remove_container(request)).await.map(drop)
    }

    pub async fn state(&self, id: &str) -> Outcome<ContainerState> {
        let status = self.cri.container_status(id).await?;
        Ok(ContainerState::try_from(status.state).unwrap_or(ContainerState::ContainerUnknown))
    }

    /// Waits until the container has exited; returns its exit code.
    pub async fn wait_exited(&self, id: &str, timeout: Duration) -> Outcome<i32> {
        wait_until(&format!("container {id} to exit"), timeout, || async {
            let status = self.cri.container_status(id).await?;
            Ok((status.state == ContainerState::ContainerExited as i32).then_some(status.exit_code))
        })
        .await
    }

    /// ExecSync with a timeout of `timeout_s` seconds: (stdout, stderr, exit code).
    pub async fn exec(&self, id: &str, cmd: &[&str], timeout_s: i64) -> Outcome<(String, String, i32)> {
        let mut runtime = self.cri.runtime.clone();
        let request = ExecSyncRequest {
            container_id: id.to_string(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: timeout_s,
        };
        let response = bounded("ExecSync", runtime.exec_sync(request)).await?.into_inner();
        Ok((
            String::from_utf8_lossy(&response.stdout).into_owned(),
            String::from_utf8_lossy(&response.stderr).into_owned(),
            response.exit_code,
        ))
    }

    /// Runs `cmd` through CRI's streaming Exec, as `kubectl exec` does: Exec answers with a URL of
    /// containerd's streaming server, spoken to over WebSocket in the `v4.channel.k8s.io`
    /// protocol, where each message's first byte is its channel (0 stdin, 1 stdout, 2 stderr,
    /// 3 the final status). `stdin`, when given, is sent as one message; with `tty` the
    /// process has a terminal and stderr goes to it.
    pub async fn exec_stream(&self, id: &str, cmd: &[&str], tty: bool, stdin: Option<&[u8]>) -> Outcome<Streamed> {
        use futures::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::Message;
        let mut socket = self.exec_socket(id, cmd, tty, stdin.is_some()).await?;
        if let Some(data) = stdin {
            let message: Vec<u8> = std::iter::once(0).chain(data.iter().copied()).collect();
            socket.send(Message::Binary(message.into())).await.map_err(stream_error("stdin"))?;
        }
        let (mut stdout, mut stderr, mut status) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            let next = tokio::time::timeout(CALL_TIMEOUT, socket.next()).await.map_err(|_| HarnessError::Timeout {
                what: format!("the end of streaming exec {cmd:?}"),
                after: CALL_TIMEOUT,
            })?;
            match next {
                None | Some(Ok(Message::Close(_))) => break,
                Some(Ok(Message::Binary(bytes))) => match bytes.split_first() {
                    Some((1, data)) => stdout.extend_from_slice(data),
                    Some((2, data)) => stderr.extend_from_slice(data),
                    Some((3, data)) => status.extend_from_slice(data),
                    _ => {}
                },
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(stream_error("read")(e)),
            }
        }
        Ok(Streamed {
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            exit_code: exit_code_of_status(&status)?,
        })
    }

    /// CRI's Exec, then a WebSocket to the URL it answers with (`v4.channel.k8s.io`).
    async fn exec_socket(&self, id: &str, cmd: &[&str], tty: bool, stdin: bool) -> Outcome<ExecSocket> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut runtime = self.cri.runtime.clone();
        let request = ExecRequest {
            container_id: id.to_string(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            tty,
            stdin,
            stdout: true,
            stderr: !tty,
        };
        let url = bounded("Exec", runtime.exec(request)).await?.into_inner().url;
        let mut request = url.replacen("http://", "ws://", 1).into_client_request().map_err(stream_error(&url))?;
        request.headers_mut().insert("Sec-WebSocket-Protocol", "v4.channel.k8s.io".parse().expect("a header value"));
        let (socket, _) = tokio::time::timeout(CALL_TIMEOUT, tokio_tungstenite::connect_async(request))
            .await
            .map_err(|_| HarnessError::Timeout { what: format!("connecting to {url}"), after: CALL_TIMEOUT })?
            .map_err(stream_error("connect"))?;
        Ok(socket)
    }

    /// A streaming Exec of `cmd` kept open with stdin (a shell an agent framework types into):
    /// [`ExecSession::send`] writes to it, [`ExecSession::read_until`] reads its stdout.
    pub async fn exec_session(&self, id: &str, cmd: &[&str]) -> Outcome<ExecSession> {
        Ok(ExecSession { socket: self.exec_socket(id, cmd, false, true).await?, stdout: Vec::new() })
    }

    /// The container's log as CRI wrote it: (stream, tag, content) per line, timestamps dropped.
    pub fn log(&self, name: &str) -> Outcome<Vec<(String, String, String)>> {
        let path = self.log_dir.join(format!("{name}.log"));
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(HarnessError::io(format!("reading {}", path.display()), e)),
        };
        text.lines()
            .map(|line| {
                let mut parts = line.splitn(4, ' ');
                let (_time, stream, tag) = (parts.next(), parts.next(), parts.next());
                match (stream, tag) {
                    (Some(stream), Some(tag)) => {
                        Ok((stream.to_string(), tag.to_string(), parts.next().unwrap_or_default().to_string()))
                    }
                    _ => {
                        Err(HarnessError::Parse { what: path.display().to_string(), detail: format!("line {line:?}") })
                    }
                }
            })
            .collect()
    }

    /// The log's stdout contents once a line equal to `marker` is there (the container wrote what
    /// came before it).
    pub async fn stdout_until(&self, name: &str, marker: &str, timeout: Duration) -> Outcome<Vec<String>> {
        wait_until(&format!("{marker:?} in the log of {name}"), timeout, || async {
            let lines: Vec<String> =
                self.log(name)?.into_iter().filter(|(s, _, _)| s == "stdout").map(|(_, _, c)| c).collect();
            Ok(lines.iter().any(|l| l == marker).then_some(lines))
        })
        .await
    }

    /// Stops and removes the pod (its containers with it), then requires that no shim serves it,
    /// none of its mounts is left and its network namespace is gone.
    pub async fn remove(self) -> Outcome<()> {
        let mut runtime = self.cri.runtime.clone();
        let stop = StopPodSandboxRequest { pod_sandbox_id: self.id.clone() };
        bounded("StopPodSandbox", runtime.stop_pod_sandbox(stop)).await?;
        let remove = RemovePodSandboxRequest { pod_sandbox_id: self.id.clone() };
        bounded("RemovePodSandbox", runtime.remove_pod_sandbox(remove)).await?;
        let _ = std::fs::remove_dir_all(&self.log_dir);
        // The shim exits after answering its last request: allow it a moment.
        let id = self.id.clone();
        let netns = self.netns.clone();
        let ports = !self.shape.ports.is_empty();
        let observe = || {
            Ok::<_, HarnessError>(Leftovers {
                shims: shim_daemons(CRI_NAMESPACE, &id).len(),
                mounts: mounts_of(&id)?.len(),
                netns: netns.as_deref().is_some_and(|p| p.exists()),
                hostport_rules: if ports { hostport_rules(&id)?.len() } else { 0 },
            })
        };
        let clean = Leftovers { shims: 0, mounts: 0, netns: false, hostport_rules: 0 };
        let waited =
            wait_until("the removed pod's shim, mounts, netns and hostPort rules to go", LEFTOVER_TIMEOUT, || async {
                let now = observe()?;
                Ok((now == clean).then_some(()))
            })
            .await;
        match waited {
            Ok(()) => Ok(()),
            // Say what was left rather than only that the wait timed out.
            Err(HarnessError::Timeout { .. }) => {
                Err(HarnessError::Expectation(format!("removed pod {} left {:?} behind", self.id, observe()?)))
            }
            Err(e) => Err(e),
        }
    }

    /// Best-effort removal after a failed scenario.
    pub async fn discard(self) {
        let mut runtime = self.cri.runtime.clone();
        let _ = bounded(
            "StopPodSandbox",
            runtime.stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id: self.id.clone() }),
        )
        .await;
        let _ = bounded(
            "RemovePodSandbox",
            runtime.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: self.id.clone() }),
        )
        .await;
        let _ = std::fs::remove_dir_all(&self.log_dir);
    }
}

/// Fails unless `local` (the host's source address towards `pod`) is on the pod's own /24, as
/// the CNI bridge's address is: else the host has no address on the pod network (a bridge
/// without one) and reaches the pod, if at all, some other way.
fn ensure_on_bridge(local: std::net::IpAddr, pod: std::net::IpAddr) -> Outcome<()> {
    let same = match (local, pod) {
        (std::net::IpAddr::V4(l), std::net::IpAddr::V4(p)) => l.octets()[..3] == p.octets()[..3],
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(HarnessError::Expectation(format!(
            "the host reaches pod address {pod} from {local}, not from an address of the pod's bridge \
             (scripts/cri-containerd gives the bridge the subnet's first address)"
        )))
    }
}

/// Runs `body` on a fresh pod of `shape` under `handler`, then removes the pod and requires it
/// to leave nothing behind ([`Pod::remove`]); on failure the pod is discarded and the error
/// returned.
pub async fn with_pod<T, F>(scenario: &str, handler: Runtime, shape: PodShape, body: F) -> Outcome<T>
where
    F: for<'a> FnOnce(&'a Pod) -> LocalBoxFuture<'a, Outcome<T>>,
{
    with_pod_in(KUBE_NAMESPACE, scenario, handler, shape, body).await
}

/// [`with_pod`] in Kubernetes namespace `kube_namespace`.
pub async fn with_pod_in<T, F>(
    kube_namespace: &str,
    scenario: &str,
    handler: Runtime,
    shape: PodShape,
    body: F,
) -> Outcome<T>
where
    F: for<'a> FnOnce(&'a Pod) -> LocalBoxFuture<'a, Outcome<T>>,
{
    let cri = Cri::connect().await?;
    let pod = cri.run_pod_in(kube_namespace, scenario, &handler, &shape).await?;
    match body(&pod).await {
        Ok(observed) => {
            pod.remove().await?;
            Ok(observed)
        }
        Err(error) => {
            pod.discard().await;
            Err(error)
        }
    }
}

/// Runs `scenario` under every handler concurrently (each within
/// [`crate::matrix::SCENARIO_TIMEOUT`]) and requires every run to succeed with the same
/// observation, as [`crate::across_runtimes`] does for the Task API.
pub async fn across_handlers<T, F, Fut>(name: &str, scenario: F)
where
    T: std::fmt::Debug + PartialEq,
    F: Fn(Runtime) -> Fut,
    Fut: Future<Output = Outcome<T>>,
{
    let handlers = handlers();
    let runs = handlers.iter().map(|handler| {
        let run = scenario(handler.clone());
        async move {
            let timeout = crate::matrix::SCENARIO_TIMEOUT;
            let outcome = match tokio::time::timeout(timeout, run).await {
                Ok(outcome) => outcome,
                Err(_) => Err(HarnessError::Timeout { what: format!("scenario {name}"), after: timeout }),
            };
            (handler, outcome)
        }
    });
    crate::require_same(name, futures::future::join_all(runs).await);
}

/// What a streaming Exec gave back.
#[derive(Debug, PartialEq)]
pub struct Streamed {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
}

type ExecSocket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn stream_error(what: &str) -> impl FnOnce(tokio_tungstenite::tungstenite::Error) -> HarnessError {
    let what = what.to_string();
    move |e| HarnessError::Expectation(format!("streaming exec, {what}: {e}"))
}

/// An open streaming Exec with stdin ([`Pod::exec_session`]).
pub struct ExecSession {
    socket: ExecSocket,
    stdout: Vec<u8>,
}

impl ExecSession {
    /// Writes `data` to the process's stdin (one message on channel 0).
    pub async fn send(&mut self, data: &[u8]) -> Outcome<()> {
        use futures::SinkExt;
        let message: Vec<u8> = std::iter::once(0).chain(data.iter().copied()).collect();
        let sent = self.socket.send(tokio_tungstenite::tungstenite::Message::Binary(message.into()));
        tokio::time::timeout(CALL_TIMEOUT, sent)
            .await
            .map_err(|_| HarnessError::Timeout { what: "a write to the exec session".into(), after: CALL_TIMEOUT })?
            .map_err(stream_error("stdin"))
    }

    /// The stdout read so far once it holds `marker` (what came before it); stderr is dropped.
    pub async fn read_until(&mut self, marker: &str, timeout: Duration) -> Outcome<String> {
        use futures::StreamExt;
        use tokio_tungstenite::tungstenite::Message;
        let deadline = Instant::now() + timeout;
        loop {
            let text = String::from_utf8_lossy(&self.stdout).into_owned();
            if let Some(at) = text.find(marker) {
                self.stdout.drain(..at + marker.len());
                return Ok(text[..at].to_string());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let next = tokio::time::timeout(left, self.socket.next()).await.map_err(|_| HarnessError::Timeout {
                what: format!("{marker:?} from the exec session (stdout so far {text:?})"),
                after: timeout,
            })?;
            match next {
                None | Some(Ok(Message::Close(_))) => {
                    return Err(HarnessError::Expectation(format!(
                        "the exec session ended before {marker:?}: {text:?}"
                    )));
                }
                Some(Ok(Message::Binary(bytes))) => {
                    if let Some((1, data)) = bytes.split_first() {
                        self.stdout.extend_from_slice(data);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(stream_error("read")(e)),
            }
        }
    }
}

/// The exit code in a streaming exec's final status (a Kubernetes `Status`): 0 for `Success`,
/// else the `ExitCode` cause of a `NonZeroExitCode` failure.
fn exit_code_of_status(status: &[u8]) -> Outcome<i32> {
    let parse_error = |detail: String| HarnessError::Parse { what: "streaming exec status".into(), detail };
    let value: serde_json::Value =
        serde_json::from_slice(status).map_err(|e| parse_error(format!("{e}: {}", String::from_utf8_lossy(status))))?;
    if value["status"] == "Success" {
        return Ok(0);
    }
    value["details"]["causes"]
        .as_array()
        .and_then(|causes| causes.iter().find(|c| c["reason"] == "ExitCode"))
        .and_then(|cause| cause["message"].as_str())
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| parse_error(format!("no exit code in {value}")))
}

// Kubelet's replacement of a dead container (transparent recovery under crab): containers
// created as kubelet creates them after a crash, with an attempt number and annotations.

impl Pod {
    /// Creates container `name` as kubelet does for its `attempt` (0 first, + 1 for each
    /// replacement after the previous one died): same config, its own log
    /// (`<name>-<attempt>.log`, read with [`Pod::log`] of that name), and container
    /// `annotations` (CRI passes `io.crab.*` through to the crab handler).
    pub async fn create_attempt(
        &self,
        name: &str,
        attempt: u32,
        command: &[&str],
        annotations: &[(&str, &str)],
    ) -> Outcome<String> {
        self.create_attempt_of(IMAGE, name, attempt, command, annotations).await
    }

    /// [`Pod::create_attempt`] of a container of `image` (one the CRI containerd has: see
    /// [`ensure_image`]).
    pub async fn create_attempt_of(
        &self,
        image: &str,
        name: &str,
        attempt: u32,
        command: &[&str],
        annotations: &[(&str, &str)],
    ) -> Outcome<String> {
        self.create_container(name, attempt, image, format!("{name}-{attempt}.log"), command, annotations).await
    }

    /// CRI's verbose information on the container (containerd's: `pid`, `runtimeSpec`, ...).
    pub async fn container_info(&self, id: &str) -> Outcome<serde_json::Value> {
        let mut runtime = self.cri.runtime.clone();
        let request = ContainerStatusRequest { container_id: id.to_string(), verbose: true };
        let response = bounded("ContainerStatus", runtime.container_status(request)).await?.into_inner();
        let info = response.info.get("info").cloned().unwrap_or_default();
        serde_json::from_str(&info)
            .map_err(|e| HarnessError::Parse { what: "ContainerStatus info".into(), detail: e.to_string() })
    }

    /// The host pid of the container's init, from CRI's verbose status.
    pub async fn init_pid(&self, id: &str) -> Outcome<u32> {
        let info = self.container_info(id).await?;
        info.get("pid")
            .and_then(|p| p.as_u64())
            .filter(|p| *p > 0)
            .map(|p| p as u32)
            .ok_or_else(|| HarnessError::Expectation(format!("ContainerStatus of {id} names no init pid: {info}")))
    }
}

// ---- crab's side of a CRI container: its handler, store and keys -------------------------------

/// The `crab` handler, unless `CRAB_TEST_RUNTIMES` leaves it out.
pub fn crab_handler() -> Option<Runtime> {
    handlers().into_iter().find(|h| h.short() == "crab")
}

/// The state directory of the crab config the crab handler's shims read.
pub fn crab_state_dir() -> Outcome<PathBuf> {
    let config = crab_config::Config::load(None).map_err(|e| HarnessError::Expectation(format!("crab config: {e}")))?;
    Ok(config.checkpoint.state_dir)
}

/// The store the crab handler's shims write.
pub fn crab_store() -> Outcome<crab_store::CheckpointStore> {
    let dir = crab_state_dir()?;
    crab_store::CheckpointStore::open(&dir)
        .map_err(|e| HarnessError::Expectation(format!("store {}: {e}", dir.display())))
}

/// The store's key of CRI container `id` (every pod's containers are in namespace k8s.io).
pub fn store_key(id: &str) -> String {
    format!("{CRI_NAMESPACE}/{id}")
}

impl Pod {
    /// SIGKILLs container `id`'s init on the host (a crash, an OOM kill); returns its exit code
    /// once CRI sees it exited, within `timeout`.
    pub async fn crash(&self, id: &str, timeout: Duration) -> Outcome<i32> {
        let pid = self.init_pid(id).await?;
        // SAFETY: kill(2) with a pid CRI reported for this running container; no memory involved.
        if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
            return Err(HarnessError::Expectation(format!("kill -9 {pid}: {}", std::io::Error::last_os_error())));
        }
        self.wait_exited(id, timeout).await
    }
}
