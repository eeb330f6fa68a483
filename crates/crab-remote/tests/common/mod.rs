//! Test harness: real docker-registry instances started through scripts/registry, a faulty
//! HTTP proxy in front of one for the faults a registry will not produce on demand, and an
//! in-memory object store standing in for crab's store (pure bookkeeping, not under test).
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crab_remote::{Credentials, Digest, ObjectSink, ObjectSource, RemoteConfig, RetryPolicy, TurnPush};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/registry")
}

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A docker-registry on 127.0.0.1 with its storage in a temporary directory, stopped on drop.
pub struct Registry {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub tls: bool,
}

impl Registry {
    pub fn start(tls: bool) -> Self {
        Self::start_on(tls, free_port())
    }

    pub fn start_on(tls: bool, port: u16) -> Self {
        let dir = tempfile::Builder::new().prefix("crab-registry-").tempdir().unwrap();
        let registry = Registry { dir, port, tls };
        registry.run("start");
        registry
    }

    fn run(&self, cmd: &str) {
        let mut c = Command::new(script());
        c.arg(cmd).arg("--dir").arg(self.dir.path()).arg("--port").arg(self.port.to_string());
        if self.tls {
            c.arg("--tls");
        }
        let out = c.output().expect("run scripts/registry");
        assert!(out.status.success(), "scripts/registry {cmd}: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn stop(&self) {
        let out = Command::new(script()).arg("stop").arg("--dir").arg(self.dir.path()).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn restart(&self) {
        self.run("start");
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn storage(&self) -> PathBuf {
        self.dir.path().join("storage")
    }

    /// Where the registry keeps a blob's bytes.
    pub fn blob_file(&self, digest: &Digest) -> PathBuf {
        let hex = digest.to_hex();
        self.storage().join("docker/registry/v2/blobs/sha256").join(&hex[..2]).join(&hex).join("data")
    }

    pub fn config(&self) -> RemoteConfig {
        self.config_for(&self.host())
    }

    /// A config for `host` (the registry itself or a proxy in front of it) with this registry's
    /// TLS and credentials, and short retries.
    pub fn config_for(&self, host: &str) -> RemoteConfig {
        let mut cfg = RemoteConfig::new(format!("{host}/crab"));
        cfg.plain_http = !self.tls;
        if self.tls {
            cfg.ca_file = Some(self.dir.path().join("ca.crt"));
            cfg.credentials = Credentials::DockerConfig(Some(self.dir.path().join("docker-config.json")));
        } else {
            cfg.credentials = Credentials::Anonymous;
        }
        cfg.retry =
            RetryPolicy { attempts: 3, first_delay: Duration::from_millis(50), max_delay: Duration::from_millis(200) };
        cfg.request_timeout = Duration::from_secs(20);
        cfg.pack_target = 256 << 10;
        cfg
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg("--dir").arg(self.dir.path()).output();
    }
}

/// Objects by digest: the local store's part in a push (source) or a pull (sink).
#[derive(Default, Clone)]
pub struct Objects(pub Arc<Mutex<HashMap<Digest, Vec<u8>>>>);

impl Objects {
    pub fn insert(&self, data: Vec<u8>) -> Digest {
        let d = Digest::of(&data);
        self.0.lock().unwrap().insert(d, data);
        d
    }

    pub fn get(&self, d: &Digest) -> Option<Vec<u8>> {
        self.0.lock().unwrap().get(d).cloned()
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

impl ObjectSource for Objects {
    fn read(&self, digest: &Digest) -> std::io::Result<Vec<u8>> {
        self.get(digest).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such object"))
    }
}

impl ObjectSink for Objects {
    fn has(&self, digest: &Digest, _len: u64) -> bool {
        self.0.lock().unwrap().contains_key(digest)
    }

    fn put(&mut self, digest: Digest, data: &[u8]) -> std::io::Result<()> {
        self.0.lock().unwrap().insert(digest, data.to_vec());
        Ok(())
    }
}

/// A page of memory-like content: some zero runs, some noise, from a seed.
pub fn page(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..4096)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (i / 512) % 2 == 0 { 0 } else { x as u8 }
        })
        .collect()
}

/// A turn of `pages` page chunks from `first_seed` on, plus the given extra objects.
pub fn turn(
    objects: &Objects,
    ns: &str,
    sandbox: &str,
    turn: u64,
    seeds: std::ops::Range<u64>,
    extra: &[Digest],
) -> TurnPush {
    let mut digests: Vec<Digest> = seeds.map(|s| objects.insert(page(s))).collect();
    digests.extend_from_slice(extra);
    TurnPush {
        namespace: ns.into(),
        sandbox: sandbox.into(),
        turn,
        parent_turn: turn.checked_sub(1).filter(|t| *t > 0),
        turn_manifest: format!("{{\"turn\":{turn},\"sandbox\":\"{sandbox}\"}}").into_bytes(),
        objects: digests,
        created: "2025-01-01T00:00:00Z".into(),
        annotations: Default::default(),
    }
}

/// What the faulty proxy does to a request.
#[derive(Clone, Debug)]
pub enum Action {
    /// Answer with this HTTP status, never reaching the registry.
    Status(u16),
    /// Hold the request this long, then pass it on.
    Delay(Duration),
}

/// A rule: requests whose method and path match get `action`, the first `times` of them (None:
/// all).
#[derive(Clone, Debug)]
pub struct Fault {
    pub method: &'static str,
    pub path_contains: &'static str,
    pub action: Action,
    /// Matching requests let through before the fault applies.
    pub skip: usize,
    pub times: Option<usize>,
}

/// An HTTP proxy in front of a plain registry, one request per connection, that applies the
/// current faults and counts the requests it saw.
pub struct FaultProxy {
    pub port: u16,
    pub faults: Arc<Mutex<Vec<Fault>>>,
    /// (method, path) of every request, in order.
    pub seen: Arc<Mutex<Vec<(String, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let faults: Arc<Mutex<Vec<Fault>>> = Arc::default();
        let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let (f, s) = (faults.clone(), seen.clone());
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (f, s) = (f.clone(), s.clone());
                tokio::spawn(async move {
                    let _ = serve(conn, upstream_port, f, s).await;
                });
            }
        });
        FaultProxy { port, faults, seen, task }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn set(&self, faults: Vec<Fault>) {
        *self.faults.lock().unwrap() = faults;
    }

    pub fn count(&self, method: &str, path_contains: &str) -> usize {
        self.seen.lock().unwrap().iter().filter(|(m, p)| m == method && p.contains(path_contains)).count()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    mut client: TcpStream,
    upstream_port: u16,
    faults: Arc<Mutex<Vec<Fault>>>,
    seen: Arc<Mutex<Vec<(String, String)>>>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if client.read(&mut byte).await? == 0 || head.len() > 64 << 10 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut first = text.lines().next().unwrap_or_default().split(' ');
    let (method, path) = (first.next().unwrap_or_default().to_owned(), first.next().unwrap_or_default().to_owned());
    let length: usize = text
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    client.read_exact(&mut body).await?;
    seen.lock().unwrap().push((method.clone(), path.clone()));
    let action = {
        let mut faults = faults.lock().unwrap();
        match faults.iter_mut().find(|f| f.method == method && path.contains(f.path_contains) && f.times != Some(0)) {
            Some(f) if f.skip > 0 => {
                f.skip -= 1;
                None
            }
            Some(f) => {
                if let Some(n) = &mut f.times {
                    *n -= 1;
                }
                Some(f.action.clone())
            }
            None => None,
        }
    };
    match action {
        Some(Action::Status(code)) => {
            let body = format!("{{\"errors\":[{{\"code\":\"UNKNOWN\",\"message\":\"injected {code}\"}}]}}");
            let response = format!(
                "HTTP/1.1 {code} Injected\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            client.write_all(response.as_bytes()).await?;
            return client.shutdown().await;
        }
        Some(Action::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }
    let mut upstream = TcpStream::connect(("127.0.0.1", upstream_port)).await?;
    // One request per connection: the registry closes after answering, so the client opens a
    // new connection (and the proxy sees every request).
    let head = text.replacen("\r\n", "\r\nConnection: close\r\n", 1);
    upstream.write_all(head.as_bytes()).await?;
    upstream.write_all(&body).await?;
    tokio::io::copy(&mut upstream, &mut client).await?;
    client.shutdown().await
}
