//! Two nodes and a registry on one machine, for the registry tier's tests (`tests/remote.rs`)
//! and its measurements (`tests/remote_figures.rs`).
//!
//! Node A is the private containerd of the environment (`scripts/containerd`, CRAB_CTRD_*),
//! its sandboxes with a store of their own (a config given by `--runtime-config-path`) so
//! deleting it touches nothing else. Node B is a second containerd (`scripts/containerd start`
//! with CRAB_CTRD_DIR=`$CRAB_CTRD_DIR-b-<tag>`) with its own crab configuration, store, runc
//! root, kept images and crabd socket, `crab.local/busybox:latest` imported from the image
//! cache, and stopped on drop when it was started here. The registry is Debian's
//! docker-registry (`scripts/registry`) on a free port, its storage in a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::env::crab_binary;

/// The image a sandbox runs unless told otherwise.
pub const IMAGE: &str = "crab.local/busybox:latest";

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$name`, or `default` when unset or empty.
pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| default.to_owned())
}

/// A command's stdout then stderr, as text.
pub fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// One node: a containerd socket and the crab config its crabctl reads.
#[derive(Clone)]
pub struct Node {
    pub name: &'static str,
    pub socket: String,
    pub namespace: String,
    pub config: PathBuf,
    pub state: PathBuf,
}

impl Node {
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr").args(["-a", &self.socket, "-n", &self.namespace]).args(args).output().expect("run ctr")
    }

    pub fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(out.status.success(), "node {}: ctr {args:?}: {}", self.name, text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts sandbox `id` (busybox sleeping) under crab with the shim config `shim_config`.
    pub fn run_sandbox(&self, id: &str, shim_config: &Path) {
        self.run_sandbox_of(IMAGE, id, shim_config);
    }

    /// Starts sandbox `id` of `image` (sleeping) under crab with the shim config `shim_config`.
    pub fn run_sandbox_of(&self, image: &str, id: &str, shim_config: &Path) {
        let config = shim_config.display().to_string();
        let run = ["run", "-d", "--runtime", "io.containerd.crab.v2", "--runtime-config-path", &config, image, id];
        let args: Vec<&str> = run.into_iter().chain(["sleep", "3600"]).collect();
        self.ctr_ok(&args);
    }

    pub fn exec(&self, id: &str, script: &str) -> String {
        let exec_id =
            format!("x{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
        self.ctr_ok(&["tasks", "exec", "--exec-id", &exec_id, id, "sh", "-c", script])
    }

    /// crabctl with `args`, set to this node (its config, store, containerd and namespace).
    pub fn crabctl_command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(crab_binary("crabctl"));
        command
            .args(args)
            .env("CRAB_CONFIG", &self.config)
            .env("CRAB_STATE_DIR", &self.state)
            .env("CRAB_CTRD_SOCK", &self.socket)
            .env("CRAB_NS", &self.namespace);
        command
    }

    pub fn crabctl(&self, args: &[&str]) -> Output {
        self.crabctl_command(args).output().expect("run crabctl")
    }

    pub fn crabctl_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.push("--json");
        let out = self.crabctl(&all);
        assert!(out.status.success(), "node {}: crabctl {args:?}: {}", self.name, text(&out));
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("crabctl {args:?} printed no JSON ({e}): {}", text(&out)))
    }

    pub fn remove(&self, id: &str) {
        let _ = self.ctr(&["tasks", "kill", "--signal", "SIGKILL", id]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.ctr(&["tasks", "delete", "--force", id]).status.success() && Instant::now() < deadline {
            if !String::from_utf8_lossy(&self.ctr(&["tasks", "ls", "-q"]).stdout).lines().any(|l| l.trim() == id) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.ctr(&["containers", "delete", id]);
    }
}

/// A docker-registry on a free port with its storage in a temporary directory, stopped on drop.
pub struct Registry {
    dir: tempfile::TempDir,
    port: u16,
}

impl Registry {
    pub fn start() -> Registry {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let registry = Registry { dir: tempfile::Builder::new().prefix("crab-registry-").tempdir().unwrap(), port };
        registry.run("start");
        registry
    }

    /// `scripts/registry CMD` (start, stop) for this registry.
    pub fn run(&self, cmd: &str) {
        let out = Command::new(repo_root().join("scripts/registry"))
            .arg(cmd)
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--port")
            .arg(self.port.to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "scripts/registry {cmd}: {}", text(&out));
    }

    /// `host:port/crab`: the `[remote] prefix` of this registry.
    pub fn prefix(&self) -> String {
        format!("127.0.0.1:{}/crab", self.port)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ =
            Command::new(repo_root().join("scripts/registry")).arg("stop").arg("--dir").arg(self.dir.path()).output();
    }
}

/// Node B's containerd, stopped (with its shims, and the crabd a shim of B started) on drop
/// when this test started it.
pub struct NodeB {
    /// The environment the scripts (`scripts/containerd`, `scripts/build-images`) see node B by.
    pub env: Vec<(String, String)>,
    crabd_socket: PathBuf,
    started: bool,
}

impl NodeB {
    /// `bash ARGS` in the repository with `env` added.
    pub fn script(env: &[(String, String)], args: &[&str]) -> Output {
        Command::new("bash").args(args).current_dir(repo_root()).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap()
    }

    fn start(env: Vec<(String, String)>, crabd_socket: PathBuf) -> NodeB {
        let running = Self::script(&env, &["scripts/containerd", "status"]).status.success();
        if !running {
            let out = Self::script(&env, &["scripts/containerd", "start"]);
            assert!(out.status.success(), "starting node B's containerd: {}", text(&out));
        }
        let out = Self::script(&env, &["scripts/build-images", "busybox"]);
        assert!(out.status.success(), "importing busybox into node B: {}", text(&out));
        NodeB { env, crabd_socket, started: !running }
    }
}

impl Drop for NodeB {
    fn drop(&mut self) {
        if self.started {
            let _ = Self::script(&self.env, &["scripts/containerd", "stop", "--all"]);
            // A shim starts the node's crabd when none answers; `stop --all` leaves it.
            if let Ok(crabd) = crab_replay::injector::listener_pid("crabd", &self.crabd_socket) {
                let _ = Command::new("kill").arg(crabd.to_string()).status();
            }
        }
    }
}

/// Writes `config` as a crab.toml at `path`, making its directory.
pub fn write_config(path: &Path, config: &crab_config::Config) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, config.to_toml().unwrap()).unwrap();
}

/// Polls `ready` every 50 ms; panics naming `what` when it is not true after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < deadline, "{what}: not after {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Node A: the environment's containerd, with `config` (its own store) as `<scratch>/a.toml`.
pub fn node_a(config: &crab_config::Config, namespace: &str, scratch: &Path) -> Node {
    let a = Node {
        name: "A",
        socket: env_or("CRAB_CTRD_SOCK", crab_containerd::ctr::DEFAULT_SOCKET),
        namespace: namespace.to_owned(),
        config: scratch.join("a.toml"),
        state: config.checkpoint.state_dir.clone(),
    };
    write_config(&a.config, config);
    a
}

/// Node B: a second containerd, runc root, store, kept images and crabd socket on this
/// machine, its config under `scratch`; its containerd is stopped on drop when this started it.
/// Each test has a node B of its own (`tag`): tests run in parallel, and one that stopped a
/// shared node B would kill the other's shims (two that started it at once collided).
pub fn node_b(base: &crab_config::Config, ctrd_dir: &str, tag: &str, namespace: &str, scratch: &Path) -> (Node, NodeB) {
    let b_dir = format!("{ctrd_dir}-b-{tag}");
    let mut b_config = base.clone();
    b_config.runtime.root = PathBuf::from(format!("{b_dir}/runc"));
    b_config.checkpoint.state_dir = scratch.join("b-store");
    b_config.checkpoint.kept_images_dir = PathBuf::from(format!("{b_dir}/kept-images"));
    b_config.node.socket = PathBuf::from(format!("{b_dir}/crabd/crabd.sock"));
    b_config.remote = crab_config::RemoteConfig { plain_http: true, ..Default::default() };
    let b = Node {
        name: "B",
        socket: format!("{b_dir}/containerd.sock"),
        namespace: namespace.to_owned(),
        config: scratch.join("b.toml"),
        state: b_config.checkpoint.state_dir.clone(),
    };
    write_config(&b.config, &b_config);
    let started = NodeB::start(
        vec![
            ("CRAB_CTRD_DIR".into(), b_dir.clone()),
            ("CRAB_CTRD_ROOT".into(), format!("{}-b-{tag}", env_or("CRAB_CTRD_ROOT", "/var/lib/crab-dev/containerd"))),
            ("CRAB_CTRD_SOCK".into(), b.socket.clone()),
            ("CRAB_CONFIG".into(), b.config.display().to_string()),
            ("CRAB_NS".into(), namespace.to_owned()),
            ("CONTAINERD_ADDRESS".into(), b.socket.clone()),
            ("CONTAINERD_NAMESPACE".into(), namespace.to_owned()),
        ],
        b_config.node.socket.clone(),
    );
    (b, started)
}
