//! crab-init: the container's PID 1 wrapper and its spawner of exec sessions.
//!
//! The shim rewrites a container's entrypoint to `/dev/.crab/init --key-fd 3 -- <args>`.
//! crab-init forks the *spawner* and then becomes the entrypoint (execve), so
//! PID 1 is exactly what it would be under runc. The spawner stays: the shim
//! asks it over a unix socket to start exec sessions, which are then children
//! of a process inside the container's tree and so part of every CRIU dump.
//!
//! This library holds what both sides share: the wire protocol and the places
//! inside the container. The binary (`main.rs`) holds the spawner itself.

pub mod protocol;

/// The directory the shim bind-mounts into the container (on its /dev tmpfs).
pub const MOUNT_DIR: &str = "/dev/.crab";
/// Where the shim bind-mounts the crab-init binary, read-only.
pub const INIT_PATH: &str = "/dev/.crab/init";
/// File names inside [`MOUNT_DIR`] (and the host directory behind it).
pub const INIT_NAME: &str = "init";
pub const SOCKET_NAME: &str = "sock";
/// The spawner's listening socket, as the container sees it.
pub const SOCKET_PATH: &str = "/dev/.crab/sock";
/// `crab-init --key-fd 3 -- PROGRAM...`: the descriptor on which the shim's
/// [`protocol::SpawnerKey`] arrives (the runtime's `--preserve-fds 1` hands it to the init).
pub const KEY_FD_FLAG: &str = "--key-fd";
pub const KEY_FD: i32 = 3;

/// The exit status containerd reports for a raw wait status: the exit code,
/// or 128 + the signal number for a killed process (as runc's shim does).
pub fn exit_status(wait_status: i32) -> i32 {
    if libc::WIFEXITED(wait_status) {
        libc::WEXITSTATUS(wait_status)
    } else if libc::WIFSIGNALED(wait_status) {
        128 + libc::WTERMSIG(wait_status)
    } else {
        255
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_status_follows_runc_conventions() {
        assert_eq!(exit_status(3 << 8), 3);
        assert_eq!(exit_status(libc::SIGKILL), 137);
        assert_eq!(exit_status(libc::SIGTERM), 143);
    }
}
