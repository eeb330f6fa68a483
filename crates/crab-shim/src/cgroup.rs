//! A container's cgroup as the shim reads it: metrics for Stats and OOM
//! notifications, on cgroup v1 (including hybrid hosts, where the memory
//! controller is v1) and on pure cgroup v2.

use std::path::{Path, PathBuf};

use containerd_shim_protos::cgroups::metrics as v1;
use containerd_shim_protos::cgroups_v2::metrics as v2;
use containerd_shim_protos::protobuf::{Message, well_known_types::any::Any};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("reading cgroup of pid {pid}: {source}")]
    Proc { pid: u32, source: std::io::Error },
    #[error("pid {pid} is in no cgroup the shim can read")]
    NotFound { pid: u32 },
    #[error("cgroup metrics: {0}")]
    Encode(String),
}

/// Where one container's cgroup lives.
#[derive(Debug, Clone, PartialEq)]
pub enum Cgroup {
    /// v1 controller directories (memory, cpuacct, pids, ...).
    V1 {
        memory: Option<PathBuf>,
        cpuacct: Option<PathBuf>,
        pids: Option<PathBuf>,
    },
    V2 {
        dir: PathBuf,
    },
}

fn v2_mount() -> Option<PathBuf> {
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists() || p.join("cgroup.procs").exists() && is_cgroup2(p))
}

fn is_cgroup2(p: &Path) -> bool {
    nix::sys::statfs::statfs(p).map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC).unwrap_or(false)
}

fn v1_dir(controller: &str, rel: &str) -> Option<PathBuf> {
    let candidates = match controller {
        "cpuacct" => vec!["cpuacct", "cpu,cpuacct", "cpuacct,cpu"],
        other => vec![other],
    };
    candidates
        .into_iter()
        .map(|c| Path::new("/sys/fs/cgroup").join(c).join(rel.trim_start_matches('/')))
        .find(|p| p.is_dir())
}

impl Cgroup {
    /// The cgroup of `pid`, from `/proc/<pid>/cgroup`. A memory controller on
    /// v1 means the host is v1 or hybrid and runc accounts there.
    pub fn of_pid(pid: u32) -> Result<Self, CgroupError> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map_err(|source| CgroupError::Proc { pid, source })?;
        Self::parse(&text).ok_or(CgroupError::NotFound { pid })
    }

    fn parse(text: &str) -> Option<Self> {
        let mut v1_paths = std::collections::HashMap::new();
        let mut unified = None;
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            if controllers.is_empty() {
                unified = Some(path.to_string());
            }
            for c in controllers.split(',') {
                v1_paths.insert(c.to_string(), path.to_string());
            }
        }
        if let Some(mem) = v1_paths.get("memory") {
            return Some(Cgroup::V1 {
                memory: v1_dir("memory", mem),
                cpuacct: v1_paths.get("cpuacct").and_then(|p| v1_dir("cpuacct", p)),
                pids: v1_paths.get("pids").and_then(|p| v1_dir("pids", p)),
            });
        }
        let dir = v2_mount()?.join(unified?.trim_start_matches('/'));
        Some(Cgroup::V2 { dir })
    }

    /// Metrics packed as containerd's Stats expects them.
    pub fn metrics(&self) -> Result<Any, CgroupError> {
        let (type_url, bytes) = match self {
            Cgroup::V1 { memory, cpuacct, pids } => {
                let mut m = v1::Metrics::new();
                if let Some(dir) = pids {
                    let mut p = v1::PidsStat::new();
                    p.current = read_u64(dir, "pids.current");
                    p.limit = read_u64(dir, "pids.max");
                    m.pids = Some(p).into();
                }
                if let Some(dir) = cpuacct {
                    let mut usage = v1::CPUUsage::new();
                    usage.total = read_u64(dir, "cpuacct.usage");
                    let stat = read_kv(dir, "cpuacct.stat");
                    // cpuacct.stat is in USER_HZ ticks; containerd reports nanoseconds.
                    usage.user = stat("user") * 10_000_000;
                    usage.kernel = stat("system") * 10_000_000;
                    let mut cpu = v1::CPUStat::new();
                    cpu.usage = Some(usage).into();
                    m.cpu = Some(cpu).into();
                }
                if let Some(dir) = memory {
                    let stat = read_kv(dir, "memory.stat");
                    let mut mem = v1::MemoryStat::new();
                    mem.cache = stat("cache");
                    mem.rss = stat("rss");
                    mem.mapped_file = stat("mapped_file");
                    mem.inactive_file = stat("inactive_file");
                    mem.active_file = stat("active_file");
                    mem.total_cache = stat("total_cache");
                    mem.total_rss = stat("total_rss");
                    mem.hierarchical_memory_limit = stat("hierarchical_memory_limit");
                    let mut usage = v1::MemoryEntry::new();
                    usage.usage = read_u64(dir, "memory.usage_in_bytes");
                    usage.limit = read_u64(dir, "memory.limit_in_bytes");
                    usage.max = read_u64(dir, "memory.max_usage_in_bytes");
                    usage.failcnt = read_u64(dir, "memory.failcnt");
                    mem.usage = Some(usage).into();
                    m.memory = Some(mem).into();
                }
                ("io.containerd.cgroups.v1.Metrics", m.write_to_bytes())
            }
            Cgroup::V2 { dir } => {
                let mut m = v2::Metrics::new();
                let mut p = v2::PidsStat::new();
                p.current = read_u64(dir, "pids.current");
                p.limit = read_u64(dir, "pids.max");
                m.pids = Some(p).into();
                let cpu_stat = read_kv(dir, "cpu.stat");
                let mut cpu = v2::CPUStat::new();
                cpu.usage_usec = cpu_stat("usage_usec");
                cpu.user_usec = cpu_stat("user_usec");
                cpu.system_usec = cpu_stat("system_usec");
                m.cpu = Some(cpu).into();
                let mem_stat = read_kv(dir, "memory.stat");
                let mut mem = v2::MemoryStat::new();
                mem.anon = mem_stat("anon");
                mem.file = mem_stat("file");
                mem.usage = read_u64(dir, "memory.current");
                mem.usage_limit = read_u64(dir, "memory.max");
                m.memory = Some(mem).into();
                ("io.containerd.cgroups.v2.Metrics", m.write_to_bytes())
            }
        };
        let value = bytes.map_err(|e| CgroupError::Encode(e.to_string()))?;
        let mut any = Any::new();
        // containerd resolves metrics by the bare message name.
        any.type_url = type_url.into();
        any.value = value;
        Ok(any)
    }

    /// Resolves when the kernel OOM-kills a process of this cgroup; call it in
    /// a loop. Returns None when the cgroup is gone or OOM events cannot be
    /// watched here.
    pub async fn next_oom(&self, state: &mut OomState) -> Option<()> {
        match self {
            Cgroup::V1 { memory: Some(dir), .. } => {
                if state.eventfd.is_none() {
                    state.eventfd = Some(register_v1_oom(dir).ok()?);
                }
                let efd = state.eventfd.as_ref()?;
                // One OOM kill notifies many times: every allocation that fails
                // before the victim is gone does. The first notification is
                // the event (at once: it comes before the victim's exit, as
                // the runc shim reports it); the rest of its burst is not.
                if std::mem::take(&mut state.in_burst) {
                    while let Ok(Some(true)) = tokio::time::timeout(OOM_BURST_QUIET, read_eventfd(efd)).await {}
                }
                if !read_eventfd(efd).await? {
                    return None;
                }
                state.in_burst = true;
                // The eventfd also fires when the cgroup is removed.
                dir.exists().then_some(())
            }
            Cgroup::V2 { dir } => loop {
                // memory.events is a pollable kernfs file: it signals POLLPRI on change.
                let count = read_kv(dir, "memory.events")("oom_kill");
                if count > state.last_v2_count {
                    state.last_v2_count = count;
                    return Some(());
                }
                if !dir.exists() {
                    return None;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            },
            Cgroup::V1 { memory: None, .. } => None,
        }
    }
}

/// Notifications of one OOM kill closer together than this are one event.
const OOM_BURST_QUIET: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits for the eventfd and reads its counter: Some(true) for a notification,
/// Some(false) for a failed read, None when it cannot be polled.
async fn read_eventfd(efd: &tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>) -> Option<bool> {
    loop {
        let mut guard = efd.readable().await.ok()?;
        let mut buf = [0u8; 8];
        // SAFETY: reading 8 bytes into a buffer of 8 from a descriptor we own.
        let n = unsafe { libc::read(std::os::fd::AsRawFd::as_raw_fd(guard.get_inner()), buf.as_mut_ptr().cast(), 8) };
        if n == 8 {
            return Some(true);
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
            return Some(false);
        }
        guard.clear_ready();
    }
}

/// Per-watcher state of [`Cgroup::next_oom`].
#[derive(Default)]
pub struct OomState {
    eventfd: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
    /// An event was just reported: its burst of notifications is still coming.
    in_burst: bool,
    last_v2_count: u64,
}

fn register_v1_oom(dir: &Path) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: eventfd takes two integers and returns a new descriptor or -1.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if efd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `efd` was just returned by eventfd and is owned by nobody else.
    let efd = unsafe { OwnedFd::from_raw_fd(efd) };
    let control = std::fs::File::open(dir.join("memory.oom_control"))?;
    std::fs::write(dir.join("cgroup.event_control"), format!("{} {}", efd.as_raw_fd(), control.as_raw_fd()))?;
    // SAFETY: the AsyncFd owns `efd`, so the descriptor stays open and the same until it is dropped.
    Ok(unsafe { tokio::io::unix::AsyncFd::register(efd) }?)
}

fn read_u64(dir: &Path, file: &str) -> u64 {
    std::fs::read_to_string(dir.join(file)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// A lookup over a `key value` per line file; absent keys read as 0.
fn read_kv(dir: &Path, file: &str) -> impl Fn(&str) -> u64 + use<> {
    let text = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
    move |key: &str| {
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_only_membership_parses_to_v2() {
        let cg = Cgroup::parse("0::/crab/abc\n");
        if let Some(Cgroup::V2 { dir }) = cg {
            assert!(dir.ends_with("crab/abc"), "{dir:?}");
        } else {
            // No v2 mount on this machine: nothing to resolve against.
            assert!(v2_mount().is_none());
        }
    }

    #[test]
    fn memory_on_v1_means_v1_metrics() {
        let cg = Cgroup::parse("4:memory:/\n2:cpuacct:/\n8:pids:/\n0::/\n").unwrap();
        assert!(matches!(cg, Cgroup::V1 { .. }));
    }

    #[test]
    fn kv_files_read_zero_for_missing_keys() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("memory.events"), "low 0\noom 2\noom_kill 1\n").unwrap();
        let kv = read_kv(dir.path(), "memory.events");
        assert_eq!(kv("oom_kill"), 1);
        assert_eq!(kv("absent"), 0);
    }
}
