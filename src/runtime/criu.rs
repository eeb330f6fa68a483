//! What the shim tells CRIU beyond runc's flags, through a CRIU configuration
//! file that runc hands over when the spec's `org.criu.config` annotation
//! names it.
//!
//! A restored container gets a fresh network namespace whose loopback is
//! down (runc brings `lo` up when it creates a container, not when it
//! restores one). CRIU restores an established TCP connection by connecting
//! its socket back to the peer's address, so a connection over 127.0.0.1
//! fails the whole restore ("Network is unreachable"). CRIU runs an action
//! script at `setup-namespaces`, after it has made the namespaces and before
//! it restores any socket: the shim's own binary is that script, and brings
//! `lo` up there.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use serde_json::Value;

/// Set by CRIU when it runs an action script: the name of the action.
pub const ACTION_ENV: &str = "CRTOOLS_SCRIPT_ACTION";
/// runc passes the file this spec annotation names to CRIU as its config file.
pub const CONFIG_ANNOTATION: &str = "org.criu.config";

#[derive(Debug, thiserror::Error)]
pub enum CriuConfigError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("spec {path}: {detail}")]
    Spec { path: String, detail: String },
    #[error("action script path {0:?} cannot be written in a CRIU config file (it holds whitespace or a quote)")]
    ScriptPath(String),
}

/// Makes `runc restore` of `bundle` run `action_script` as CRIU's action script:
/// writes the CRIU config file `config_file` and names it in the spec. A spec
/// that names a CRIU config of its own keeps it (the user's choice wins; its
/// restore then has no loopback until the shim brings it up afterwards).
/// Returns whether the spec names our file.
pub fn use_action_script(bundle: &Path, config_file: &Path, action_script: &Path) -> Result<bool, CriuConfigError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| CriuConfigError::Io { path, source }
    };
    let script = action_script.to_str().filter(|s| !s.contains(|c: char| c.is_whitespace() || c == '"' || c == '\''));
    let Some(script) = script else { return Err(CriuConfigError::ScriptPath(action_script.display().to_string())) };
    let spec_path = bundle.join("config.json");
    let spec_error = |detail: String| CriuConfigError::Spec { path: spec_path.display().to_string(), detail };
    let bytes = std::fs::read(&spec_path).map_err(io(&spec_path))?;
    let mut spec: Value = serde_json::from_slice(&bytes).map_err(|e| spec_error(e.to_string()))?;
    let Some(object) = spec.as_object_mut() else { return Err(spec_error("not a JSON object".into())) };
    let annotations = object.entry("annotations").or_insert_with(|| Value::Object(Default::default()));
    let Some(annotations) = annotations.as_object_mut() else { return Err(spec_error("annotations is not an object".into())) };
    let ours = config_file.display().to_string();
    match annotations.get(CONFIG_ANNOTATION).and_then(Value::as_str) {
        Some(theirs) if theirs != ours => return Ok(false),
        Some(_) => {}
        None => {
            annotations.insert(CONFIG_ANNOTATION.into(), Value::String(ours));
        }
    }
    std::fs::write(config_file, format!("action-script {script}\n")).map_err(io(config_file))?;
    let tmp = bundle.join("config.json.crab-criu-tmp");
    let text = serde_json::to_vec_pretty(&spec).map_err(|e| spec_error(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &spec_path).map_err(io(&spec_path))?;
    Ok(true)
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
    fn the_spec_names_a_config_that_runs_the_action_script() {
        let dir = bundle(serde_json::json!({"ociVersion": "1.0.2", "annotations": {"a": "b"}}));
        let conf = dir.path().join("criu.conf");
        assert!(use_action_script(dir.path(), &conf, Path::new("/usr/bin/shim")).unwrap());
        assert_eq!(annotations(dir.path())[CONFIG_ANNOTATION], conf.display().to_string());
        assert_eq!(annotations(dir.path())["a"], "b");
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), "action-script /usr/bin/shim\n");
        // Again (a second restore of the same bundle): unchanged.
        assert!(use_action_script(dir.path(), &conf, Path::new("/usr/bin/shim")).unwrap());
    }

    #[test]
    fn a_spec_without_annotations_gets_them_and_a_users_config_wins() {
        let dir = bundle(serde_json::json!({"ociVersion": "1.0.2"}));
        let conf = dir.path().join("criu.conf");
        assert!(use_action_script(dir.path(), &conf, Path::new("/s")).unwrap());
        let theirs = bundle(serde_json::json!({"annotations": {CONFIG_ANNOTATION: "/etc/criu/mine.conf"}}));
        assert!(!use_action_script(theirs.path(), &theirs.path().join("criu.conf"), Path::new("/s")).unwrap());
        assert_eq!(annotations(theirs.path())[CONFIG_ANNOTATION], "/etc/criu/mine.conf");
    }

    #[test]
    fn bad_input_is_named() {
        let dir = bundle(serde_json::json!(["not", "an", "object"]));
        let err = use_action_script(dir.path(), &dir.path().join("c"), Path::new("/s")).unwrap_err();
        assert!(err.to_string().contains("config.json") && err.to_string().contains("not a JSON object"), "{err}");
        let err = use_action_script(dir.path(), &dir.path().join("c"), Path::new("/with space/s")).unwrap_err();
        assert!(matches!(err, CriuConfigError::ScriptPath(_)), "{err}");
    }

    #[test]
    fn other_actions_are_ignored() {
        assert_eq!(run_action("post-restore"), 0);
    }
}
