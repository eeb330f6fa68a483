//! Push and pull against a real docker-registry (distribution 2.8), plain and TLS + htpasswd,
//! started by scripts/registry; faults through a proxy in front of it or by hand-corrupting its
//! storage. Needs root (scripts/registry start) and docker-registry, htpasswd, openssl, curl,
//! skopeo (scripts/install-deps).

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Action, Fault, FaultProxy, Objects, Registry, free_port, page, turn};
use crab_remote::{Credentials, Digest, Remote, RemoteError, RemoteIndex, RetryPolicy, artifact};

async fn push(
    remote: &Remote,
    index: &mut RemoteIndex,
    objects: &Objects,
    t: &crab_remote::TurnPush,
) -> crab_remote::PushReport {
    remote.push_turn(index, t, Arc::new(objects.clone())).await.unwrap_or_else(|e| panic!("push {}: {e}", t.turn))
}

fn assert_all_pulled(local: &Objects, pulled: &Objects, t: &crab_remote::TurnPush) {
    for d in &t.objects {
        assert_eq!(pulled.get(d).as_ref(), local.get(d).as_ref(), "object {d} of turn {}", t.turn);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_round_trip_with_dedup_across_turns() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(false);
    let remote = Remote::new(registry.config()).unwrap();
    let local = Objects::default();
    let mut index = RemoteIndex::in_memory();
    // Turn 1: 600 pages and a 2 MiB file (a blob of its own).
    let big = local.insert((0..2 << 20).map(|i| (i % 251) as u8).collect());
    let t1 = turn(&local, "default", "box", 1, 0..600, &[big]);
    let r1 = push(&remote, &mut index, &local, &t1).await;
    assert_eq!(r1.new_objects, 601);
    assert!(r1.packs_created >= 2, "{r1:?}");
    // Packs, one blob of their indexes, the blob and the turn manifest.
    assert_eq!(r1.blobs_uploaded, r1.packs_created + 3, "{r1:?}");

    // Turn 2: the same pages but 50 new ones: only the new objects are packed and sent.
    let t2 = turn(&local, "default", "box", 2, 50..650, &[big]);
    let r2 = push(&remote, &mut index, &local, &t2).await;
    assert_eq!(r2.new_objects, 50, "{r2:?}");
    assert!(
        r2.bytes_uploaded < r1.bytes_uploaded / 5,
        "turn 2 sent {} bytes, turn 1 {}",
        r2.bytes_uploaded,
        r1.bytes_uploaded
    );

    // A node with nothing pulls turn 1 whole; one holding turn 1 pulls only what turn 2 added.
    let mut fresh = Objects::default();
    let p1 = remote.pull_turn("default", "box", 1, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &t1);
    // The turn manifest, one blob of the packs' indexes, the packs and the large blob.
    assert_eq!(p1.blobs_pulled, r1.packs_created + 3, "{p1:?}");
    assert_eq!(p1.turn_manifest, t1.turn_manifest);
    assert_eq!(p1.checkpoint.turn, 1);
    let p2 = remote.pull_turn("default", "box", 2, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &t2);
    assert_eq!(p2.objects_received, 50);
    assert!(p2.packs_skipped >= 2, "{p2:?}");
    assert_eq!(remote.list_turns("default", "box").await.unwrap(), vec![1, 2]);

    // An independent client sees crab's artifact type on the tag.
    let out = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{}/crab/default/box:turn-2", registry.host()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let manifest: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(manifest["artifactType"], artifact::ARTIFACT_TYPE);
    assert_eq!(manifest["config"]["mediaType"], artifact::TURN_MEDIA_TYPE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sandbox_mounts_what_the_first_pushed() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(false);
    let remote = Remote::new(registry.config()).unwrap();
    let local = Objects::default();
    let dir = tempfile::tempdir().unwrap();
    let mut index = RemoteIndex::open(dir.path()).unwrap();
    let a = turn(&local, "default", "a", 1, 0..800, &[]);
    let ra = push(&remote, &mut index, &local, &a).await;
    // The index survives a restart of the pusher (crabd): reopened from its directory.
    drop(index);
    let mut index = RemoteIndex::open(dir.path()).unwrap();
    assert_eq!(index.packed_objects(), 800);
    let mut b = turn(&local, "default", "b", 1, 0..800, &[]);
    b.turn_manifest = b"another sandbox's turn manifest".to_vec();
    let rb = push(&remote, &mut index, &local, &b).await;
    assert_eq!(rb.new_objects, 0);
    assert!(rb.blobs_mounted >= 2, "{rb:?}");
    assert!(
        (rb.bytes_uploaded as f64) <= 0.10 * ra.bytes_uploaded as f64,
        "sandbox b sent {} bytes, a {}",
        rb.bytes_uploaded,
        ra.bytes_uploaded
    );
    let mut fresh = Objects::default();
    remote.pull_turn("default", "b", 1, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_basic_auth_and_a_wrong_password() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(true);
    let remote = Remote::new(registry.config()).unwrap();
    let local = Objects::default();
    let mut index = RemoteIndex::in_memory();
    let t = turn(&local, "tenant-a", "Box_1", 1, 0..300, &[]);
    push(&remote, &mut index, &local, &t).await;
    let mut fresh = Objects::default();
    remote.pull_turn("tenant-a", "Box_1", 1, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &t);

    // A wrong password: refused at once (no retry), naming the reference and the file.
    let bad = registry.dir.path().join("bad-config.json");
    let auth = base64_of(&format!("crab:{}", "not-the-password"));
    std::fs::write(&bad, format!("{{\"auths\":{{\"{}\":{{\"auth\":\"{auth}\"}}}}}}", registry.host())).unwrap();
    let mut cfg = registry.config();
    cfg.credentials = Credentials::DockerConfig(Some(bad.clone()));
    let wrong = Remote::new(cfg).unwrap();
    let t2 = turn(&local, "tenant-a", "Box_1", 2, 0..10, &[]);
    let err = wrong.push_turn(&mut RemoteIndex::in_memory(), &t2, Arc::new(local.clone())).await.unwrap_err();
    assert!(matches!(err, RemoteError::Unauthorized { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("crab/tenant-a/x--426f785f31:turn-2") && msg.contains("bad-config.json"), "{msg}");
    let err = wrong.pull_turn("tenant-a", "Box_1", 1, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::Unauthorized { .. }), "{err}");

    // Without the CA the server's certificate is refused.
    let mut cfg = registry.config();
    cfg.ca_file = None;
    let untrusting = Remote::new(cfg).unwrap();
    let err = untrusting.pull_turn("tenant-a", "Box_1", 1, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::Unreachable { .. }), "{err}");
    assert!(err.to_string().to_lowercase().contains("certificate"), "{err}");
}

fn base64_of(s: &str) -> String {
    use std::process::Stdio;
    let mut child = Command::new("base64").arg("-w0").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), s.as_bytes()).unwrap();
    String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_down_then_back() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let port = free_port();
    let registry = Registry::start_on(false, port);
    registry.stop();
    let remote = Remote::new(registry.config()).unwrap();
    let local = Objects::default();
    let mut index = RemoteIndex::in_memory();
    let t = turn(&local, "default", "box", 1, 0..100, &[]);
    let err = remote.push_turn(&mut index, &t, Arc::new(local.clone())).await.unwrap_err();
    assert!(matches!(err, RemoteError::Unreachable { .. }), "{err}");
    assert!(err.is_transient());
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}/crab/default/box:turn-1")), "{err}");
    let err = remote.pull_turn("default", "box", 1, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::Unreachable { .. }), "{err}");
    // Back on the same port: the same push goes through.
    registry.restart();
    push(&remote, &mut index, &local, &t).await;
    let mut fresh = Objects::default();
    remote.pull_turn("default", "box", 1, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_registry_is_bounded_by_the_timeout() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(false);
    let proxy = FaultProxy::start(registry.port).await;
    proxy.set(vec![Fault {
        method: "GET",
        path_contains: "/manifests/",
        action: Action::Delay(Duration::from_secs(30)),
        skip: 0,
        times: None,
    }]);
    let mut cfg = registry.config_for(&proxy.host());
    cfg.request_timeout = Duration::from_secs(1);
    cfg.retry =
        RetryPolicy { attempts: 2, first_delay: Duration::from_millis(10), max_delay: Duration::from_millis(10) };
    let remote = Remote::new(cfg).unwrap();
    let started = Instant::now();
    let err = remote.pull_turn("default", "box", 1, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("crab/default/box:turn-1"), "{err}");
    // Two tries of at most about a second each, not the proxy's 30 s.
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    assert_eq!(proxy.count("GET", "/manifests/"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_and_a_full_registry_is_not() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(false);
    let proxy = FaultProxy::start(registry.port).await;
    let remote = Remote::new(registry.config_for(&proxy.host())).unwrap();
    let local = Objects::default();
    let mut index = RemoteIndex::in_memory();

    // Two 503s on blob uploads: retried with backoff, the push completes.
    proxy.set(vec![Fault {
        method: "POST",
        path_contains: "/blobs/uploads/",
        action: Action::Status(503),
        skip: 0,
        times: Some(2),
    }]);
    let t1 = turn(&local, "default", "box", 1, 0..200, &[]);
    let r1 = push(&remote, &mut index, &local, &t1).await;
    assert_eq!(proxy.count("POST", "/blobs/uploads/") as u64, r1.blobs_uploaded + 2, "the two 503s were retried");
    let mut fresh = Objects::default();
    remote.pull_turn("default", "box", 1, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &t1);

    // 413 on the second upload of turn 2 (the registry is full): not retried, the error names
    // the reference, and turn 2's tag does not exist although some of its blobs went in.
    proxy.seen.lock().unwrap().clear();
    let t2 = turn(&local, "default", "box", 2, 1000..1400, &[]);
    // Let the first upload through, then refuse every later one.
    proxy.set(vec![Fault {
        method: "PUT",
        path_contains: "/blobs/uploads/",
        action: Action::Status(413),
        skip: 1,
        times: None,
    }]);
    let err = remote.push_turn(&mut index, &t2, Arc::new(local.clone())).await.unwrap_err();
    assert!(matches!(err, RemoteError::TooLarge { .. }), "{err}");
    assert_eq!(proxy.count("PUT", "/blobs/uploads/"), 2, "a refusal is not retried");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("crab/default/box:turn-2"), "{err}");
    assert!(proxy.count("PUT", "/manifests/") == 0, "no manifest may be sent before its blobs");
    let err = remote.pull_turn("default", "box", 2, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");

    // Room again: the same push completes, sending only what is missing.
    proxy.set(vec![]);
    let r = push(&remote, &mut index, &local, &t2).await;
    assert!(r.blobs_present + r.blobs_uploaded > 0);
    let mut fresh = Objects::default();
    remote.pull_turn("default", "box", 2, &mut fresh).await.unwrap();
    assert_all_pulled(&local, &fresh, &t2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_blob_in_the_registry_is_refused() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(true);
    let remote = Remote::new(registry.config()).unwrap();
    let local = Objects::default();
    let mut index = RemoteIndex::in_memory();
    let t = turn(&local, "default", "box", 1, 0..600, &[]);
    push(&remote, &mut index, &local, &t).await;
    let mut probe = Objects::default();
    let pulled = remote.pull_turn("default", "box", 1, &mut probe).await.unwrap();
    // Flip one byte of the last pack in the registry's own storage (same length: the registry
    // serves it as if nothing happened).
    let pack = pulled
        .checkpoint
        .layers
        .iter()
        .rev()
        .find_map(|l| matches!(l, artifact::Layer::Pack { .. }).then(|| l.digest()))
        .unwrap();
    let file = registry.blob_file(&pack);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x55;
    std::fs::write(&file, &bytes).unwrap();

    let mut sink = Objects::default();
    let err = remote.pull_turn("default", "box", 1, &mut sink).await.unwrap_err();
    assert!(matches!(err, RemoteError::DigestMismatch { digest, .. } if digest == pack), "{err}");
    assert!(err.to_string().contains("crab/default/box:turn-1") && err.to_string().contains(&pack.to_hex()), "{err}");
    // Whatever reached the sink before the refusal came from other packs and is exactly right.
    for (d, data) in sink.0.lock().unwrap().iter() {
        assert_eq!(Digest::of(data), *d);
    }
    assert!(sink.len() < t.objects.len());

    // A corrupt turn manifest (config blob) is refused the same way.
    let config = registry.blob_file(&pulled.checkpoint.turn_manifest);
    let mut bytes = std::fs::read(&config).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&config, &bytes).unwrap();
    let err = remote.pull_turn("default", "box", 1, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::DigestMismatch { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_artifact_type_and_an_unknown_sandbox_are_named() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    let registry = Registry::start(true);
    let cfg = registry.config();
    let remote = Remote::new(cfg.clone()).unwrap();
    // A plain OCI image under a crab tag, pushed by oci-client as any image tool would.
    let auth = cfg.credentials.resolve(&registry.host()).unwrap();
    let client = oci_client::Client::try_from(oci_client::client::ClientConfig {
        extra_root_certificates: vec![oci_client::client::Certificate {
            encoding: oci_client::client::CertificateEncoding::Pem,
            data: std::fs::read(registry.dir.path().join("ca.crt")).unwrap(),
        }],
        ..Default::default()
    })
    .unwrap();
    let image: oci_client::Reference = format!("{}/crab/default/box:turn-1", registry.host()).parse().unwrap();
    let layer = oci_client::client::ImageLayer::oci_v1(page(1), None);
    let config = oci_client::client::Config::oci_v1(b"{}".to_vec(), None);
    client.push(&image, &[layer], config, &auth, None).await.unwrap();

    let err = remote.pull_turn("default", "box", 1, &mut Objects::default()).await.unwrap_err();
    assert!(
        matches!(err, RemoteError::WrongArtifactType { ref found, .. } if found == "application/vnd.oci.image.config.v1+json"),
        "{err}"
    );
    assert!(err.to_string().contains("crab/default/box:turn-1"), "{err}");

    let err = remote.pull_turn("default", "no-such-box", 3, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("crab/default/no-such-box:turn-3"), "{err}");
    let err = remote.list_turns("default", "no-such-box").await.unwrap_err();
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");
    // A missing turn of an existing sandbox too.
    let err = remote.pull_turn("default", "box", 9, &mut Objects::default()).await.unwrap_err();
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");
}

/// Figures, not a check: push and pull of a 64 MiB process (16,384 pages) through the loopback
/// registry, plain and TLS + auth. `cargo test --release -p crab-remote --test registry --
/// --ignored --nocapture throughput`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "prints figures; run by hand"]
async fn throughput() {
    crab_sys::skip_unless_root!("a registry from scripts/registry");
    for tls in [false, true] {
        let registry = Registry::start(tls);
        let mut cfg = registry.config();
        cfg.pack_target = crab_remote::pack::DEFAULT_PACK_TARGET;
        let remote = Remote::new(cfg).unwrap();
        let local = Objects::default();
        let t = turn(&local, "default", "box", 1, 0..16_384, &[]);
        let raw: u64 = t.objects.iter().map(|d| local.get(d).unwrap().len() as u64).sum();
        let started = Instant::now();
        let pushed = push(&remote, &mut RemoteIndex::in_memory(), &local, &t).await;
        let push_s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let pulled = remote.pull_turn("default", "box", 1, &mut Objects::default()).await.unwrap();
        let pull_s = started.elapsed().as_secs_f64();
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "{}: {:.1} MiB raw, {:.1} MiB sent ({:.3}x): push {push_s:.2} s ({:.1} MiB/s raw), pull {pull_s:.2} s ({:.1} MiB/s raw), {} packs",
            if tls { "TLS+auth" } else { "plain" },
            mib(raw),
            mib(pushed.bytes_uploaded),
            pushed.bytes_uploaded as f64 / raw as f64,
            mib(raw) / push_s,
            mib(raw) / pull_s,
            pushed.packs_created,
        );
        assert_eq!(pulled.objects_received, pushed.new_objects);
    }
}
