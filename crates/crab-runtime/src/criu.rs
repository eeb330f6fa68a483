//! What the shim tells CRIU beyond runc's flags, through a CRIU configuration
//! file that runc hands over when the spec's `org.criu.config` annotation
//! names it (runc reads the annotation when the container is created, so
//! the shim names the file at Create, for dumps and restores alike).
//!
//! - A ghost limit: a file a process still maps or holds open after it was
//!   deleted is a "ghost" that CRIU carries in the dump, by default only up
//!   to 1 MiB. Sandboxes make such files all the time (`pip install -U` of a
//!   library a running interpreter has loaded), and so does an upgrade of
//!   crab-init itself (every container's spawner runs the bind-mounted file).
//!   Over the limit the whole dump fails.
//! - During a restore, an action script: a restored container gets a fresh
//!   network namespace whose loopback is down (runc brings `lo` up when it
//!   creates a container, not when it restores one), and CRIU restores an
//!   established TCP connection by connecting its socket back to the peer, so
//!   a connection over 127.0.0.1 fails the whole restore ("Network is
//!   unreachable"). CRIU runs its action script at `setup-namespaces`, after
//!   it has made the namespaces and before it restores any socket: the shim's
//!   own binary is that script, and brings `lo` up there.
//! - Before each dump, the network lock: CRIU locks the container's network
//!   (iptables-restore runs, forked from CRIU, at lock and at unlock, tens of
//!   milliseconds) so that no TCP segment changes a connection while it is
//!   dumped. With no TCP connection in the namespace there is nothing to
//!   protect: the dump skips the lock, and so does every restore of it (CRIU
//!   records the lock method in the images).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use serde_json::Value;

/// Set by CRIU when it runs an action script: the name of the action.
pub const ACTION_ENV: &str = "CRTOOLS_SCRIPT_ACTION";
/// runc passes the file this spec annotation names to CRIU as its config file.
pub const CONFIG_ANNOTATION: &str = "org.criu.config";
/// Where in a container's bundle the shim keeps crab's CRIU config (its work directory).
pub const CONFIG_IN_BUNDLE: &str = "crab/criu.conf";

/// Whether `path`, the value of a spec's [`CONFIG_ANNOTATION`], is crab's own config of
/// container `container`'s bundle (containerd names bundles after their container): what the
/// shim wrote into that container's spec, not a config the user chose. A spec kept from that
/// container (its saved copy, a checkpoint pulled from a registry) names it; a container
/// restored from that spec, under another bundle or on another node, must not read it.
pub fn is_crab_config_of(path: &str, container: &str) -> bool {
    Path::new(path).ends_with(Path::new(container).join(CONFIG_IN_BUNDLE))
}

/// Largest deleted file a dump carries. Its content is stored like any image file
/// (content-addressed), so a ghost that does not change costs one write.
pub const GHOST_LIMIT_MIB: u64 = 64;

#[derive(Debug, thiserror::Error)]
pub enum CriuConfigError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("spec {path}: {detail}")]
    Spec { path: String, detail: String },
    #[error("action script path {0:?} cannot be written in a CRIU config file (it holds whitespace or a quote)")]
    ScriptPath(String),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CriuConfigError + '_ {
    move |source| CriuConfigError::Io { path: path.display().to_string(), source }
}

/// Whether a dump locks the container's network (see the module's notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkLock {
    /// CRIU's default (iptables).
    Lock,
    /// `network-lock skip`: for a namespace without TCP connections.
    Skip,
}

/// The lock a dump of the processes in `pid`'s network namespace needs: none
/// when its TCP sockets are all listening or closed. Unreadable tables lock.
///
/// The namespace's socket counters come first: with no TCP socket in use (most
/// sandboxes) there is no connection, and the tables are not read. Reading
/// `/proc/<pid>/net/tcp` walks the kernel's whole established-socket hash,
/// shared by every namespace of the node, whatever the namespace holds: about
/// 4 ms per table per read here, 13 ms of every dump's hooks before this.
pub fn network_lock_for(pid: u32) -> NetworkLock {
    let counters = ["sockstat", "sockstat6"].map(|f| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")));
    if let [Ok(v4), Ok(v6)] = &counters
        && tcp_in_use(v4, "TCP") == Some(0)
        && tcp_in_use(v6, "TCP6") == Some(0)
    {
        return NetworkLock::Skip;
    }
    let tables = ["tcp", "tcp6"].map(|t| std::fs::read_to_string(format!("/proc/{pid}/net/{t}")));
    if tables.iter().any(Result::is_err) {
        return NetworkLock::Lock;
    }
    if tables.iter().flatten().any(|table| has_tcp_connection(table)) { NetworkLock::Lock } else { NetworkLock::Skip }
}

/// `inuse` of the `protocol:` line of a sockstat file: the namespace's sockets of that protocol
/// in its hash tables (listening, connecting, connected or closing; not TIME_WAIT, which belongs
/// to no process). None when the line is not there.
fn tcp_in_use(sockstat: &str, protocol: &str) -> Option<u64> {
    let line = sockstat.lines().find_map(|l| l.strip_prefix(protocol)?.strip_prefix(':'))?;
    line.split_whitespace().skip_while(|word| *word != "inuse").nth(1)?.parse().ok()
}

/// Whether a `/proc/net/tcp` table holds a connection: a socket that is not
/// listening (0A), closed (07) or in TIME_WAIT (06; no process holds it and
/// CRIU does not dump it).
fn has_tcp_connection(table: &str) -> bool {
    table.lines().skip(1).any(|line| !matches!(line.split_whitespace().nth(3), Some("0A" | "07" | "06") | None))
}

/// Names `config_file` as the CRIU config in `bundle`'s spec and writes it (no action
/// script). A spec that names a CRIU config of its own keeps it: the user's choice wins.
/// Returns whether the spec names our file.
pub fn name_config(bundle: &Path, config_file: &Path) -> Result<bool, CriuConfigError> {
    let spec_path = bundle.join("config.json");
    let spec_error = |detail: String| CriuConfigError::Spec { path: spec_path.display().to_string(), detail };
    let bytes = std::fs::read(&spec_path).map_err(io_error(&spec_path))?;
    let mut spec: Value = serde_json::from_slice(&bytes).map_err(|e| spec_error(e.to_string()))?;
    let Some(object) = spec.as_object_mut() else { return Err(spec_error("not a JSON object".into())) };
    let annotations = object.entry("annotations").or_insert_with(|| Value::Object(Default::default()));
    let Some(annotations) = annotations.as_object_mut() else {
        return Err(spec_error("annotations is not an object".into()));
    };
    let ours = config_file.display().to_string();
    match annotations.get(CONFIG_ANNOTATION).and_then(Value::as_str) {
        Some(theirs) if theirs != ours => return Ok(false),
        Some(_) => {}
        None => {
            annotations.insert(CONFIG_ANNOTATION.into(), Value::String(ours));
            let tmp = bundle.join("config.json.crab-criu-tmp");
            let text = serde_json::to_vec_pretty(&spec).map_err(|e| spec_error(e.to_string()))?;
            std::fs::write(&tmp, text).map_err(io_error(&tmp))?;
            std::fs::rename(&tmp, &spec_path).map_err(io_error(&spec_path))?;
        }
    }
    write_config(config_file, None, NetworkLock::Lock)?;
    Ok(true)
}

/// Writes the CRIU config file: the ghost limit, `action_script` while a restore runs, and
/// the network lock of the next dump.
pub fn write_config(
    config_file: &Path,
    action_script: Option<&Path>,
    lock: NetworkLock,
) -> Result<(), CriuConfigError> {
    let mut text = format!("ghost-limit {GHOST_LIMIT_MIB}M\n");
    if let Some(script) = action_script {
        let plain = script.to_str().filter(|s| !s.contains(|c: char| c.is_whitespace() || c == '"' || c == '\''));
        let Some(plain) = plain else { return Err(CriuConfigError::ScriptPath(script.display().to_string())) };
        text.push_str(&format!("action-script {plain}\n"));
    }
    if lock == NetworkLock::Skip {
        text.push_str("network-lock skip\n");
    }
    // Replaced whole: a CRIU run starting meanwhile reads the old file or the new one.
    let tmp = config_file.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, config_file).map_err(io_error(config_file))
}

/// The binary run as CRIU's action script: acts on `setup-namespaces` (the
/// restored tree's network namespace gets its loopback up), ignores every
/// other action. Returns the exit status; a failure is printed into CRIU's
/// log and fails the restore, which without `lo` could not bring back a
/// loopback connection anyway.
pub fn run_action(action: &str) -> i32 {
    if action != "setup-namespaces" {
        return 0;
    }
    let pid = std::env::var("CRTOOLS_INIT_PID").ok().and_then(|p| p.parse::<u32>().ok());
    let Some(pid) = pid else {
        eprintln!("crab: CRIU action {action}: CRTOOLS_INIT_PID is not a pid");
        return 1;
    };
    match loopback_up(pid) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("crab: CRIU action {action}: loopback of pid {pid}'s network namespace: {e}");
            1
        }
    }
}

/// Sets `lo` up in the network namespace of `pid`, if it is down. Enters the
/// namespace on a thread of its own, the only thread that ever is in it.
pub fn loopback_up(pid: u32) -> std::io::Result<()> {
    std::thread::spawn(move || -> std::io::Result<()> {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
        // SAFETY: setns on a thread that does nothing else afterwards.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a plain socket(2) call; the descriptor is owned at once.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ifreq is plain old data; all zeroes is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        // SAFETY: SIOCGIFFLAGS fills the ifreq it is given.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: SIOCGIFFLAGS set the flags member of the union.
        let flags = unsafe { req.ifr_ifru.ifru_flags };
        if flags & libc::IFF_UP as libc::c_short == 0 {
            req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
            // SAFETY: SIOCSIFFLAGS reads the ifreq it is given.
            if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    })
    .join()
    .unwrap_or_else(|_| Err(std::io::Error::other("loopback thread panicked")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle(spec: Value) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
        dir
    }

    fn annotations(dir: &Path) -> Value {
        let spec: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        spec["annotations"].clone()
    }

    #[test]
    fn the_spec_names_a_config_with_a_ghost_limit_and_a_restore_adds_the_action_script() {
        let dir = bundle(serde_json::json!({"ociVersion": "1.0.2", "annotations": {"a": "b"}}));
        let conf = dir.path().join("criu.conf");
        assert!(name_config(dir.path(), &conf).unwrap());
        assert_eq!(annotations(dir.path())[CONFIG_ANNOTATION], conf.display().to_string());
        assert_eq!(annotations(dir.path())["a"], "b");
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), "ghost-limit 64M\n");
        // Again (a restore's Create of a recovered spec): unchanged.
        assert!(name_config(dir.path(), &conf).unwrap());
        write_config(&conf, Some(Path::new("/usr/bin/shim")), NetworkLock::Lock).unwrap();
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), "ghost-limit 64M\naction-script /usr/bin/shim\n");
        write_config(&conf, None, NetworkLock::Lock).unwrap();
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), "ghost-limit 64M\n");
        write_config(&conf, None, NetworkLock::Skip).unwrap();
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), "ghost-limit 64M\nnetwork-lock skip\n");
    }

    #[test]
    fn a_spec_without_annotations_gets_them_and_a_users_config_wins() {
        let dir = bundle(serde_json::json!({"ociVersion": "1.0.2"}));
        assert!(name_config(dir.path(), &dir.path().join("criu.conf")).unwrap());
        let crabs = "/run/containerd/io.containerd.runtime.v2.task/ns/sbx-1/crab/criu.conf";
        assert!(is_crab_config_of(crabs, "sbx-1"));
        assert!(!is_crab_config_of(crabs, "sbx-10") && !is_crab_config_of(crabs, "bx-1"), "another container's");
        assert!(!is_crab_config_of("/etc/criu/sbx-1.conf", "sbx-1"), "the user's own");
        let theirs = bundle(serde_json::json!({"annotations": {CONFIG_ANNOTATION: "/etc/criu/mine.conf"}}));
        assert!(!name_config(theirs.path(), &theirs.path().join("criu.conf")).unwrap());
        assert_eq!(annotations(theirs.path())[CONFIG_ANNOTATION], "/etc/criu/mine.conf");
        assert!(!theirs.path().join("criu.conf").exists());
    }

    #[test]
    fn bad_input_is_named() {
        let dir = bundle(serde_json::json!(["not", "an", "object"]));
        let err = name_config(dir.path(), &dir.path().join("c")).unwrap_err();
        assert!(err.to_string().contains("config.json") && err.to_string().contains("not a JSON object"), "{err}");
        let err = write_config(&dir.path().join("c"), Some(Path::new("/with space/s")), NetworkLock::Lock).unwrap_err();
        assert!(matches!(err, CriuConfigError::ScriptPath(_)), "{err}");
    }

    #[test]
    fn other_actions_are_ignored() {
        assert_eq!(run_action("post-restore"), 0);
    }

    #[test]
    fn only_tcp_connections_need_the_network_lock() {
        let header =
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let listening = "   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0\n";
        let established = "   1: 0100007F:1F90 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1\n";
        let time_wait =
            "   2: 0100007F:1F90 0100007F:A1B3 06 00000000:00000000 03:00001000 00000000     0        0 0 3 0\n";
        let closing = "   3: 0100007F:1F90 0100007F:A1B4 04 00000000:00000000 01:00000010 00000000     0        0 3 2 0 20 4 30 10 -1\n";
        assert!(!has_tcp_connection(header));
        assert!(!has_tcp_connection(&format!("{header}{listening}")));
        assert!(has_tcp_connection(&format!("{header}{listening}{established}")));
        assert!(!has_tcp_connection(&format!("{header}{listening}{time_wait}")), "TIME_WAIT belongs to no process");
        assert!(has_tcp_connection(&format!("{header}{closing}")), "a connection on its way out is one");
        assert_eq!(network_lock_for(u32::MAX), NetworkLock::Lock, "no tables: lock");
    }

    #[test]
    fn the_sockstat_counters_say_whether_any_tcp_socket_is_in_use() {
        let v4 = "sockets: used 11\nTCP: inuse 3 orphan 0 tw 2 alloc 5 mem 102\nUDP: inuse 0 mem 0\n";
        let v6 = "TCP6: inuse 0\nUDP6: inuse 1\n";
        assert_eq!(tcp_in_use(v4, "TCP"), Some(3));
        assert_eq!(tcp_in_use(v6, "TCP6"), Some(0));
        assert_eq!(tcp_in_use(v6, "TCP"), None, "TCP6: is not TCP:");
        assert_eq!(tcp_in_use("TCP: orphan 0\n", "TCP"), None);
        assert_eq!(tcp_in_use("TCP: inuse x\n", "TCP"), None);
    }

    /// A namespace of its own (`unshare -n`): no TCP socket skips the lock (by the counters), a
    /// listener alone still skips it (through the tables), a connection locks.
    #[test]
    fn a_real_namespace_locks_only_for_a_connection() {
        use std::io::{BufRead, Write};
        crab_sys::skip_unless_root!("a network namespace of its own");
        let script = r#"ip link set lo up; echo empty; read _; exec python3 -c '
import socket, sys
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen()
print("listening", flush=True); sys.stdin.readline()
c = socket.create_connection(l.getsockname()); a = l.accept()
print("connected", flush=True); sys.stdin.readline()
'"#;
        let mut child = std::process::Command::new("unshare")
            .args(["-n", "sh", "-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut stdin = child.stdin.take().unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut step = |expected: &str| {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), expected);
        };
        step("empty");
        assert_eq!(network_lock_for(pid), NetworkLock::Skip, "no socket");
        stdin.write_all(b"\n").unwrap();
        step("listening");
        assert_eq!(network_lock_for(pid), NetworkLock::Skip, "a listener alone");
        stdin.write_all(b"\n").unwrap();
        step("connected");
        assert_eq!(network_lock_for(pid), NetworkLock::Lock, "a connection");
        stdin.write_all(b"\n").unwrap();
        child.wait().unwrap();
    }
}
