//! Where the kernel lists its tracepoints, which libbpf reads to attach the
//! per-syscall programs.
//!
//! libbpf looks at `/sys/kernel/debug/tracing` when it exists and at
//! `/sys/kernel/tracing` otherwise; hosts often have neither mounted. The
//! inspector mounts tracefs at `/sys/kernel/tracing` in that case, as tracing
//! tools do.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";
const TRACEFS: &str = "/sys/kernel/tracing";

#[derive(Debug, thiserror::Error)]
pub enum TracefsError {
    #[error("mounting tracefs at {path}: {source}")]
    Mount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("tracefs at {path} lists no syscall tracepoints (kernel built without CONFIG_FTRACE_SYSCALLS?)")]
    NoSyscallEvents { path: PathBuf },
}

/// The tracefs directory libbpf will use, mounted if it was not.
#[derive(Debug, Clone)]
pub struct Tracefs {
    root: PathBuf,
}

impl Tracefs {
    pub fn ensure_mounted() -> Result<Self, TracefsError> {
        let root = if Path::new(DEBUGFS_TRACING).exists() {
            PathBuf::from(DEBUGFS_TRACING)
        } else {
            let root = PathBuf::from(TRACEFS);
            if !root.join("events").exists() {
                mount_tracefs(&root)?;
                tracing::info!(path = %root.display(), "mounted tracefs for the inspector's syscall tracepoints");
            }
            root
        };
        let tracefs = Self { root };
        let syscalls = tracefs.root.join("events/syscalls");
        if !syscalls.is_dir() {
            return Err(TracefsError::NoSyscallEvents { path: syscalls });
        }
        Ok(tracefs)
    }

    /// Whether tracepoint `category/name` exists on this kernel.
    pub fn has_event(&self, category: &str, name: &str) -> bool {
        self.root.join("events").join(category).join(name).is_dir()
    }
}

fn mount_tracefs(target: &Path) -> Result<(), TracefsError> {
    let error = |source| TracefsError::Mount { path: target.to_owned(), source };
    let c_target = CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|e| error(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    // SAFETY: all pointers are NUL-terminated strings that live across the call.
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            c_target.as_ptr(),
            c"tracefs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let source = io::Error::last_os_error();
        // Mounted meanwhile by someone else: fine.
        if source.raw_os_error() == Some(libc::EBUSY) && target.join("events").exists() {
            return Ok(());
        }
        return Err(error(source));
    }
    Ok(())
}

/// The tracepoint a program's ELF section names: `tp/<category>/<name>`.
pub fn tracepoint_of_section(section: &str) -> Option<(&str, &str)> {
    let rest = section.strip_prefix("tp/").or_else(|| section.strip_prefix("tracepoint/"))?;
    rest.split_once('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracepoint_sections_name_category_and_event() {
        assert_eq!(tracepoint_of_section("tp/syscalls/sys_enter_openat"), Some(("syscalls", "sys_enter_openat")));
        assert_eq!(tracepoint_of_section("tracepoint/sched/sched_switch"), Some(("sched", "sched_switch")));
        assert_eq!(tracepoint_of_section("tp_btf/sched_process_fork"), None);
        assert_eq!(tracepoint_of_section("tp/nocategory"), None);
    }
}
