//! Puts crab-init in front of a container's entrypoint by rewriting its
//! bundle's `config.json` at Create (see the `crab_init` crate for why).

use std::path::{Component, Path, PathBuf};

use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("crab-init {path} is unusable: {reason}")]
    Unusable { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {detail}")]
    Spec { path: PathBuf, detail: String },
    /// The entrypoint does not exist in the rootfs; worded as runc words it.
    #[error("{0}")]
    Entrypoint(String),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> InitError + '_ {
    move |source| InitError::Io { path: path.to_path_buf(), source }
}

/// Checks that `path` is an executable, statically linked ELF (no program
/// interpreter): it runs inside images that may have no libc at all.
pub fn check_static_binary(path: &Path) -> Result<(), InitError> {
    read_static_binary(path).map(drop)
}

/// [`check_static_binary`], returning the bytes it read.
fn read_static_binary(path: &Path) -> Result<Vec<u8>, InitError> {
    use std::os::unix::fs::PermissionsExt;
    let unusable = |reason: &str| InitError::Unusable { path: path.to_path_buf(), reason: reason.into() };
    let meta = std::fs::metadata(path).map_err(|e| unusable(&e.to_string()))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(unusable("not an executable file"));
    }
    let bytes = std::fs::read(path).map_err(|e| unusable(&e.to_string()))?;
    match elf_has_interpreter(&bytes) {
        Ok(false) => Ok(bytes),
        Ok(true) => Err(unusable("dynamically linked (has PT_INTERP); build it with +crt-static")),
        Err(reason) => Err(unusable(reason)),
    }
}

/// The file each CRIU dump of a container with crab-init gets beside its
/// images: the sha256 (hex) of the crab-init build the dumped processes run.
pub const DIGEST_FILE: &str = "crab-init.sha256";

/// Checks `init` as [`check_static_binary`] does and pins it: a copy named by
/// its sha256 under `pins`, written once and never replaced. Containers bind
/// the pinned copy, so installing a new crab-init at `init` leaves the file
/// their running (and checkpointed) init executes in place; CRIU could not
/// restore a process whose binary was replaced or deleted under it.
pub fn pin(init: &Path, pins: &Path) -> Result<PathBuf, InitError> {
    use sha2::Digest;
    let bytes = read_static_binary(init)?;
    let pinned = pins.join(hex::encode(sha2::Sha256::digest(&bytes)));
    if std::fs::metadata(&pinned).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64) {
        return Ok(pinned);
    }
    std::fs::create_dir_all(pins).map_err(io_error(pins))?;
    // Written aside and renamed: shims of other containers may pin the same build at once.
    let tmp = pins.join(format!(".pin-{}-{:?}", std::process::id(), std::thread::current().id()));
    let written = (|| {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o755).open(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &pinned)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(InitError::Io { path: pinned, source: e });
    }
    Ok(pinned)
}

/// The pinned crab-init a checkpoint's processes ran, from the [`DIGEST_FILE`]
/// in its image directory; None for images without one (taken without
/// crab-init, or before builds were pinned).
pub fn pinned_for_images(images: &Path, pins: &Path) -> Result<Option<PathBuf>, InitError> {
    let record = images.join(DIGEST_FILE);
    let text = match std::fs::read_to_string(&record) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(InitError::Io { path: record, source: e }),
    };
    let digest = text.trim();
    if !is_sha256_hex(digest) {
        return Err(InitError::Spec { path: record, detail: format!("{digest:?} is not a sha256 in lower-case hex") });
    }
    let pinned = pins.join(digest);
    if !pinned.is_file() {
        return Err(InitError::Unusable {
            path: pinned,
            reason: format!("the checkpoint's processes run crab-init {digest}, which is no longer kept there"),
        });
    }
    Ok(Some(pinned))
}

/// The digest a pinned crab-init path ([`pin`]) is named by; None for a path
/// that is not a pin.
pub fn pinned_digest(init: &Path) -> Option<&str> {
    init.file_name().and_then(|n| n.to_str()).filter(|name| is_sha256_hex(name))
}

fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Records, beside a dump's images, which pinned crab-init its processes run.
pub fn record_in_images(images: &Path, digest: &str) -> Result<(), InitError> {
    let record = images.join(DIGEST_FILE);
    std::fs::write(&record, format!("{digest}\n")).map_err(io_error(&record))
}

/// The file each CRIU dump of a container with a keyed spawner gets beside its images: the
/// spawner's key in hex (root's alone), so the shim that restores the spawner can talk to it.
pub const KEY_FILE: &str = "crab-spawner.key";

/// Records the spawner's key beside a dump's images.
pub fn record_key_in_images(images: &Path, key: &crab_init::protocol::SpawnerKey) -> Result<(), InitError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let record = images.join(KEY_FILE);
    let _ = std::fs::remove_file(&record);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&record)
        .and_then(|mut file| file.write_all(format!("{}\n", key.to_hex()).as_bytes()))
        .map_err(io_error(&record))
}

/// The key of the spawner a checkpoint holds ([`KEY_FILE`]); None for images without one
/// (taken without crab-init, or before spawners had keys).
pub fn key_for_images(images: &Path) -> Result<Option<crab_init::protocol::SpawnerKey>, InitError> {
    let record = images.join(KEY_FILE);
    let text = match std::fs::read_to_string(&record) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(InitError::Io { path: record, source: e }),
    };
    crab_init::protocol::SpawnerKey::parse_hex(text.trim()).map(Some).ok_or_else(|| InitError::Spec {
        path: record,
        detail: format!("not a spawner key: {} lower-case hex digits expected", 2 * crab_init::protocol::KEY_BYTES),
    })
}

/// Whether a 64-bit little-endian ELF image declares a program interpreter.
fn elf_has_interpreter(elf: &[u8]) -> Result<bool, &'static str> {
    const PT_INTERP: u32 = 3;
    if elf.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err("not an ELF file");
    }
    if elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file");
    }
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| elf.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let u64_at = |o: usize| elf.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let truncated = "truncated ELF header";
    let phoff = u64_at(0x20).ok_or(truncated)? as usize;
    let phentsize = u16_at(0x36).ok_or(truncated)? as usize;
    let phnum = u16_at(0x38).ok_or(truncated)? as usize;
    for i in 0..phnum {
        let kind = u32_at(phoff + i * phentsize).ok_or("truncated program headers")?;
        if kind == PT_INTERP {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The parts of the init's process spec an exec must share to be started by
/// the spawner (a child of the init's process, with its credentials).
pub fn process_identity(process: &Value) -> Value {
    json!({
        "user": process.get("user"),
        "capabilities": process.get("capabilities"),
        "apparmorProfile": process.get("apparmorProfile"),
        "selinuxLabel": process.get("selinuxLabel"),
        "noNewPrivileges": process.get("noNewPrivileges").and_then(Value::as_bool).unwrap_or(false),
    })
}

/// The options of the tmpfs at `/dev/.crab`, for a container whose process runs as
/// `uid`:`gid`. It holds the spawner's socket and the mount point of crab-init's binary, so
/// it is tiny and bounded in bytes and inodes (what a container writes there is charged to
/// it, in memory it is limited to, never to the host's disk); owned by the process's user and
/// closed to others, so the spawner can bind there whatever the container's user and however
/// read-only its rootfs.
fn spawner_tmpfs_options(uid: u64, gid: u64) -> Vec<String> {
    ["nosuid", "nodev", "noexec", "size=64k", "nr_inodes=16", "mode=0700"]
        .into_iter()
        .map(String::from)
        .chain([format!("uid={uid}"), format!("gid={gid}")])
        .collect()
}

/// What [`install`] did.
pub struct Installed {
    /// [`process_identity`] of the original process.
    pub identity: Value,
}

/// Rewrites `bundle/config.json` so `init` runs first: `process.args`
/// becomes `[/dev/.crab/init, --, <args>]` and two mounts follow all others
/// (a small tmpfs at `/dev/.crab` for the spawner's socket, the binary read-only
/// at `/dev/.crab/init`). Returns None, leaving the bundle alone, when the spec
/// has no tmpfs at /dev to put them on. A spec already rewritten (a saved
/// one recovered) is unwrapped first, so the rewrite is idempotent.
/// `check_entrypoint` fails like runc when the entrypoint is not in the rootfs.
pub fn install(bundle: &Path, init: &Path, check_entrypoint: bool) -> Result<Option<Installed>, InitError> {
    let path = bundle.join("config.json");
    let bytes = std::fs::read(&path).map_err(io_error(&path))?;
    let spec_error = |detail: &str| InitError::Spec { path: path.clone(), detail: detail.into() };
    let mut spec: Value = serde_json::from_slice(&bytes).map_err(|e| spec_error(&e.to_string()))?;
    let Some(Value::Array(mut mounts)) = spec.get_mut("mounts").map(Value::take) else { return Ok(None) };
    let is_ours = |m: &Value| {
        let dest = m.get("destination").and_then(Value::as_str).unwrap_or_default();
        Path::new(dest) == Path::new(crab_init::MOUNT_DIR) || Path::new(dest) == Path::new(crab_init::INIT_PATH)
    };
    mounts.retain(|m| !is_ours(m));
    let dev_is_tmpfs = mounts.iter().any(|m| {
        m.get("destination").and_then(Value::as_str).is_some_and(|d| Path::new(d) == Path::new("/dev"))
            && m.get("type").and_then(Value::as_str) == Some("tmpfs")
    });
    if !dev_is_tmpfs {
        return Ok(None);
    }
    let user = spec.get("process").and_then(|p| p.get("user"));
    let id_of = |field: &str| user.and_then(|u| u.get(field)).and_then(Value::as_u64).unwrap_or(0);
    mounts.push(json!({
        "destination": crab_init::MOUNT_DIR,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": spawner_tmpfs_options(id_of("uid"), id_of("gid")),
    }));
    mounts.push(json!({
        "destination": crab_init::INIT_PATH,
        "type": "bind",
        "source": init,
        "options": ["bind", "ro", "nosuid", "nodev"],
    }));
    let process = spec.get("process").and_then(Value::as_object).ok_or_else(|| spec_error("no process"))?;
    let mut args: Vec<String> = process
        .get("args")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(String::from).collect())
        .unwrap_or_default();
    args.drain(..wrapper_len(&args));
    if args.is_empty() {
        return Err(spec_error("process.args is empty"));
    }
    let identity = process_identity(&Value::Object(process.clone()));
    if check_entrypoint {
        let env: Vec<String> = process
            .get("env")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).map(String::from).collect())
            .unwrap_or_default();
        let cwd = process.get("cwd").and_then(Value::as_str).unwrap_or("/").to_string();
        let rootfs = spec.get("root").and_then(|r| r.get("path")).and_then(Value::as_str).unwrap_or("rootfs");
        let rootfs = bundle.join(rootfs);
        let mount_points: Vec<String> =
            mounts.iter().filter_map(|m| m.get("destination").and_then(Value::as_str).map(String::from)).collect();
        check_entrypoint_exists(&rootfs, &args[0], &env, &cwd, &mount_points)?;
    }
    spec["mounts"] = Value::Array(mounts);
    let wrapper = [crab_init::INIT_PATH, crab_init::KEY_FD_FLAG, &crab_init::KEY_FD.to_string(), "--"];
    let wrapped: Vec<String> = wrapper.into_iter().map(String::from).chain(args).collect();
    spec["process"]["args"] = json!(wrapped);
    let text = serde_json::to_vec_pretty(&spec).map_err(|e| spec_error(&e.to_string()))?;
    let tmp = bundle.join("config.json.crab-tmp");
    std::fs::write(&tmp, text).map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_error(&path))?;
    Ok(Some(Installed { identity }))
}

/// How many leading arguments are crab-init's own (`INIT_PATH [--key-fd N] --`), for a spec
/// rewritten before (with or without a key).
fn wrapper_len(args: &[String]) -> usize {
    match args {
        [init, flag, _, dashes, ..]
            if init == crab_init::INIT_PATH && flag == crab_init::KEY_FD_FLAG && dashes == "--" =>
        {
            4
        }
        [init, dashes, ..] if init == crab_init::INIT_PATH && dashes == "--" => 2,
        _ => 0,
    }
}

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// runc resolves the entrypoint inside the container when it starts; with
/// crab-init in front, a missing one would only show as crab-init exiting.
/// Checks it up front so Create fails as runc's does. A program that could
/// come from another mount than the rootfs is given the benefit of the doubt.
fn check_entrypoint_exists(
    rootfs: &Path,
    arg0: &str,
    env: &[String],
    cwd: &str,
    mount_points: &[String],
) -> Result<(), InitError> {
    let under_a_mount = |container_path: &Path| {
        mount_points.iter().any(|m| Path::new(m) != Path::new("/") && container_path.starts_with(m))
    };
    let candidates: Vec<PathBuf> = if arg0.contains('/') {
        vec![Path::new(cwd).join(arg0)]
    } else {
        let path = env.iter().rev().find_map(|e| e.strip_prefix("PATH=")).unwrap_or(DEFAULT_PATH);
        path.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(arg0)).collect()
    };
    for candidate in &candidates {
        if under_a_mount(candidate) {
            return Ok(());
        }
        if let Some(host) = resolve_in_root(rootfs, candidate)
            && is_executable(&host)
        {
            return Ok(());
        }
    }
    let message = if arg0.contains('/') {
        format!("exec: {arg0:?}: no such file or directory")
    } else {
        format!("exec: {arg0:?}: executable file not found in $PATH")
    };
    Err(InitError::Entrypoint(format!("runc create failed: unable to start container process: {message}")))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The host path of `path` as the container would see it under `root`:
/// symbolic links are followed with `root` as `/`, and `..` stops at `root`,
/// so the result never leaves it. None when a component is missing or links
/// loop.
pub fn resolve_in_root(root: &Path, path: &Path) -> Option<PathBuf> {
    const MAX_LINKS: usize = 40;
    let mut resolved = PathBuf::new();
    let mut pending: Vec<std::ffi::OsString> = path
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut links = 0;
    while let Some(name) = pending.pop() {
        if name == ".." {
            resolved.pop();
            continue;
        }
        let host = root.join(&resolved).join(&name);
        match std::fs::symlink_metadata(&host) {
            Ok(meta) if meta.file_type().is_symlink() => {
                links += 1;
                if links > MAX_LINKS {
                    return None;
                }
                let target = std::fs::read_link(&host).ok()?;
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                pending.extend(target.components().rev().filter_map(|c| match c {
                    Component::Normal(n) => Some(n.to_os_string()),
                    Component::ParentDir => Some("..".into()),
                    _ => None,
                }));
            }
            Ok(_) => resolved.push(&name),
            Err(_) => return None,
        }
    }
    Some(root.join(resolved))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle_with(spec: Value) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
        let bin = dir.path().join("rootfs/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("busybox"), b"#!").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(bin.join("busybox"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("/bin/busybox", bin.join("sh")).unwrap();
        dir
    }

    fn spec(args: &[&str]) -> Value {
        json!({
            "root": {"path": "rootfs"},
            "process": {"args": args, "env": ["PATH=/usr/bin:/bin"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "mounts": [{"destination": "/proc", "type": "proc"}, {"destination": "/dev", "type": "tmpfs"}],
        })
    }

    fn read(dir: &Path) -> Value {
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
    }

    #[test]
    fn entrypoint_is_wrapped_and_mounts_go_last_idempotently() {
        let bundle = bundle_with(spec(&["sh", "-c", "sleep 1"]));
        let init = Path::new("/usr/local/lib/crab/crab-init");
        assert!(install(bundle.path(), init, true).unwrap().is_some());
        assert!(install(bundle.path(), init, true).unwrap().is_some());
        let written = read(bundle.path());
        let wrapped = json!(["/dev/.crab/init", "--key-fd", "3", "--", "sh", "-c", "sleep 1"]);
        assert_eq!(written["process"]["args"], wrapped);
        let mounts = written["mounts"].as_array().unwrap();
        assert_eq!(mounts.len(), 4);
        assert_eq!(mounts[2]["destination"], "/dev/.crab");
        assert_eq!(mounts[3]["destination"], "/dev/.crab/init");
        assert_eq!(mounts[3]["source"], "/usr/local/lib/crab/crab-init");
        // No directory of the host is writable from the container: a bounded tmpfs of its own.
        assert_eq!(mounts[2]["type"], "tmpfs");
        assert_eq!(mounts[2]["options"], json!(spawner_tmpfs_options(0, 0)));
        assert!(!bundle.path().join("crab").exists());
        // A spec a shim from before keys wrapped (a saved one, recovered) is wrapped once.
        let old = bundle_with(spec(&["/dev/.crab/init", "--", "sh", "-c", "sleep 1"]));
        assert!(install(old.path(), init, true).unwrap().is_some());
        assert_eq!(read(old.path())["process"]["args"], wrapped);
    }

    #[test]
    fn a_spawner_key_is_kept_beside_the_images_for_root_alone() {
        use std::os::unix::fs::PermissionsExt;
        let images = tempfile::tempdir().unwrap();
        assert!(key_for_images(images.path()).unwrap().is_none(), "images from before keys");
        let key = crab_init::protocol::SpawnerKey::from_bytes([7; crab_init::protocol::KEY_BYTES]);
        record_key_in_images(images.path(), &key).unwrap();
        record_key_in_images(images.path(), &key).unwrap();
        assert_eq!(key_for_images(images.path()).unwrap(), Some(key));
        let mode = std::fs::metadata(images.path().join(KEY_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(images.path().join(KEY_FILE), "../../etc/shadow\n").unwrap();
        let err = key_for_images(images.path()).unwrap_err().to_string();
        assert!(err.contains(KEY_FILE) && err.contains("not a spawner key"), "{err}");
    }

    #[test]
    fn without_a_dev_tmpfs_the_bundle_is_left_alone() {
        let mut s = spec(&["sh"]);
        s["mounts"] = json!([{"destination": "/proc", "type": "proc"}]);
        let bundle = bundle_with(s.clone());
        assert!(install(bundle.path(), Path::new("/x"), true).unwrap().is_none());
        assert_eq!(read(bundle.path())["process"], s["process"]);
    }

    #[test]
    fn missing_entrypoint_fails_with_runcs_message() {
        let bundle = bundle_with(spec(&["crab-no-such-binary"]));
        let err = install(bundle.path(), Path::new("/x"), true).err().unwrap();
        assert_eq!(
            err.to_string(),
            "runc create failed: unable to start container process: exec: \"crab-no-such-binary\": executable file not found in $PATH"
        );
        assert_eq!(read(bundle.path())["process"]["args"], json!(["crab-no-such-binary"]));
    }

    #[test]
    fn resolution_never_leaves_the_root() {
        let bundle = bundle_with(spec(&["sh"]));
        let root = bundle.path().join("rootfs");
        assert_eq!(resolve_in_root(&root, Path::new("/bin/sh")).unwrap(), root.join("bin/busybox"));
        std::os::unix::fs::symlink("../../../../../../etc", root.join("bin/escape")).unwrap();
        // /etc of the root, not of the host: it does not exist there.
        assert_eq!(resolve_in_root(&root, Path::new("/bin/escape/passwd")), None);
        assert_eq!(resolve_in_root(&root, Path::new("/../../bin/busybox")).unwrap(), root.join("bin/busybox"));
    }

    #[test]
    fn static_binaries_are_told_from_dynamic_ones() {
        assert!(elf_has_interpreter(b"#!/bin/sh").is_err());
        let sh = std::fs::read("/bin/sh").unwrap();
        assert_eq!(elf_has_interpreter(&sh), Ok(true));
        let err = check_static_binary(Path::new("/bin/sh")).unwrap_err();
        assert!(err.to_string().contains("PT_INTERP"), "{err}");
        assert!(check_static_binary(Path::new("/nonexistent/crab-init")).is_err());
    }

    /// An executable that passes as a static ELF (a header with no program headers), `tag`
    /// making its content differ.
    fn fake_static_binary(path: &Path, tag: u8) {
        use std::os::unix::fs::PermissionsExt;
        let mut elf = vec![0u8; 0x40];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf.push(tag);
        std::fs::write(path, elf).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn a_pinned_build_survives_an_upgrade_and_dumps_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let (init, pins, images) = (dir.path().join("crab-init"), dir.path().join("pins"), dir.path().join("images"));
        std::fs::create_dir(&images).unwrap();
        fake_static_binary(&init, 1);
        let old = pin(&init, &pins).unwrap();
        assert_eq!(std::fs::read(&old).unwrap(), std::fs::read(&init).unwrap());
        assert_eq!(pin(&init, &pins).unwrap(), old, "the same build pins to the same path");
        let digest = pinned_digest(&old).unwrap().to_string();
        record_in_images(&images, &digest).unwrap();

        // An upgrade replaces the binary by a rename, as an installer does.
        let staged = dir.path().join("staged");
        fake_static_binary(&staged, 2);
        std::fs::rename(&staged, &init).unwrap();
        let new = pin(&init, &pins).unwrap();
        assert_ne!(new, old);
        assert_eq!(std::fs::read(&old).unwrap().last(), Some(&1), "the old build is left as it was");
        assert_eq!(pinned_for_images(&images, &pins).unwrap(), Some(old.clone()), "a restore binds the dump's build");

        assert_eq!(pinned_for_images(dir.path(), &pins).unwrap(), None, "images without a record");
        assert_eq!(pinned_digest(&init), None, "the installed path is not a pin");
    }

    #[test]
    fn a_missing_or_malformed_pin_record_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (pins, images) = (dir.path().join("pins"), dir.path().join("images"));
        std::fs::create_dir_all(&images).unwrap();
        std::fs::write(images.join(DIGEST_FILE), "../../etc/passwd\n").unwrap();
        let err = pinned_for_images(&images, &pins).unwrap_err().to_string();
        assert!(err.contains(DIGEST_FILE) && err.contains("not a sha256"), "{err}");

        let gone = "ab".repeat(32);
        std::fs::write(images.join(DIGEST_FILE), format!("{gone}\n")).unwrap();
        let err = pinned_for_images(&images, &pins).unwrap_err().to_string();
        assert!(err.contains(&gone) && err.contains("no longer kept"), "{err}");
        let dynamic = pin(Path::new("/bin/sh"), &pins).unwrap_err().to_string();
        assert!(dynamic.contains("PT_INTERP"), "{dynamic}");
    }
}
