//! `crab-init [--key-fd FD] -- PROGRAM [ARGS...]`: the container's first process.
//!
//! It binds the spawner's socket, forks the spawner, and then execs PROGRAM
//! in place, so PID 1 is the entrypoint exactly as without crab-init (same
//! pid, signals, exit status and terminal). The spawner is its child and so
//! part of the container's process tree, which is what a CRIU dump takes.
//! If the socket cannot be made the entrypoint still runs, without a spawner
//! (the shim then starts exec sessions through the OCI runtime).

mod session;
mod spawner;

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt;

fn main() {
    // Not dumpable while it holds the spawner's key (until the exec below, which makes the
    // entrypoint dumpable again): no other process (a sibling in a pod's shared pid namespace)
    // may read it from this one's memory.
    // SAFETY: prctl with plain integer arguments.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) };
    let args: Vec<OsString> = std::env::args_os().collect();
    let parsed = match args.get(1..).unwrap_or_default() {
        [flag, fd, dashes, entrypoint @ ..] if flag == crab_init::KEY_FD_FLAG && dashes == "--" => {
            fd.to_str().and_then(|fd| fd.parse::<i32>().ok()).map(|fd| (Some(fd), entrypoint))
        }
        [dashes, entrypoint @ ..] if dashes == "--" => Some((None, entrypoint)),
        _ => None,
    };
    let Some((key_fd, entrypoint)) = parsed.filter(|(_, entrypoint)| !entrypoint.is_empty()) else {
        eprintln!("crab-init: usage: crab-init [{} FD] -- PROGRAM [ARGS...]", crab_init::KEY_FD_FLAG);
        std::process::exit(2);
    };
    // A key that was promised and did not come means no spawner: one that let anybody in
    // would be worse than execs through the runtime.
    let key = match key_fd.map(read_key) {
        Some(Ok(key)) => Some(Some(key)),
        Some(Err(e)) => {
            eprintln!("crab-init: the spawner's key on fd {key_fd:?}: {e}; running without a spawner");
            None
        }
        None => Some(None),
    };
    if let Some(key) = key {
        match spawner::listen(crab_init::SOCKET_PATH) {
            Ok(listener) => {
                // SAFETY: single-threaded here; the child only runs the spawner loop.
                match unsafe { libc::fork() } {
                    0 => spawner::run(listener, key),
                    -1 => eprintln!("crab-init: fork of the spawner failed: {}", std::io::Error::last_os_error()),
                    _ => drop(listener),
                }
            }
            Err(e) => {
                eprintln!("crab-init: spawner socket {}: {e}; running without a spawner", crab_init::SOCKET_PATH)
            }
        }
    }
    let error = exec(entrypoint);
    eprintln!("crab-init: exec {:?}: {error}", entrypoint[0]);
    std::process::exit(127);
}

/// Reads the spawner's key from `fd` (the read end of the shim's pipe) and closes it, so the
/// entrypoint never inherits it.
fn read_key(fd: i32) -> std::io::Result<crab_init::protocol::SpawnerKey> {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: the runtime handed this descriptor to crab-init for this purpose
    // (`--preserve-fds`); nothing else in this process owns it, and the File closes it.
    let mut pipe = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut bytes = [0u8; crab_init::protocol::KEY_BYTES];
    pipe.read_exact(&mut bytes)?;
    Ok(crab_init::protocol::SpawnerKey::from_bytes(bytes))
}

/// execvp: the PATH lookup uses the process's own environment, as the OCI
/// runtime's does for the entrypoint. Returns only on failure.
fn exec(argv: &[OsString]) -> std::io::Error {
    let owned: Result<Vec<CString>, _> = argv.iter().map(|a| CString::new(a.as_bytes())).collect();
    let Ok(owned) = owned else {
        return std::io::Error::new(std::io::ErrorKind::InvalidInput, "argument contains a NUL byte");
    };
    let mut ptrs: Vec<*const libc::c_char> = owned.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: NUL-terminated strings and a null-terminated array that outlive the call.
    unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
    std::io::Error::last_os_error()
}
