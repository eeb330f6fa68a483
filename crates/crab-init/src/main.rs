//! `crab-init -- PROGRAM [ARGS...]`: the container's first process.
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
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.len() < 3 || args[1] != "--" {
        eprintln!("crab-init: usage: crab-init -- PROGRAM [ARGS...]");
        std::process::exit(2);
    }
    let entrypoint = &args[2..];
    match spawner::listen(crab_init::SOCKET_PATH) {
        Ok(listener) => {
            // SAFETY: single-threaded here; the child only runs the spawner loop.
            match unsafe { libc::fork() } {
                0 => spawner::run(listener),
                -1 => eprintln!("crab-init: fork of the spawner failed: {}", std::io::Error::last_os_error()),
                _ => drop(listener),
            }
        }
        Err(e) => eprintln!("crab-init: spawner socket {}: {e}; running without a spawner", crab_init::SOCKET_PATH),
    }
    let error = exec(entrypoint);
    eprintln!("crab-init: exec {:?}: {error}", entrypoint[0]);
    std::process::exit(127);
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
