//! A fingerprint of the whole sandbox, what any later turn could observe of it:
//! - every file of the container's mount tree (the rootfs and every mount on it: `/dev/shm`,
//!   `/run` and any other tmpfs or volume) with its type, mode, owner, size, content hash,
//!   extended attributes, symlink target, device number, which names share one inode (hard
//!   links) and, for a file with holes, where its data is. Left out: [`VOLATILE`], apt's
//!   [`DERIVED`] caches, the kernel's and crab's own mounts of the spec, and the trace's
//!   declared ignores;
//! - every process of the sandbox's pid namespace: command line, working directory, parent
//!   (which tells an exec session, a child of the runtime, from a process its init adopted)
//!   and open descriptors (files, deleted-but-open files with their size, pipes, sockets);
//! - the sockets: TCP listeners, established TCP connections (ephemeral ports masked) and
//!   listening unix sockets.
//!
//! Computed from the host, never by a program in the container: the container's tools may be
//! missing, broken or lying, and an exec would itself add a process and an exec id. The
//! container is hostile, so the files are walked with crab-store's walker
//! ([`crab_store::ContainerMount::walk`]: `openat2` beneath `/proc/<init>/root`, every entry
//! opened once without following links, devices and fifos never opened) and `/proc` is only
//! read (a descriptor's target is `stat`ed, never opened). Mtimes and atimes are not compared:
//! a restore need not keep them, and no trace depends on them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crab_store::{ContainerMount, ContainerRoot, MountKind, RelPath, SandboxMounts, WalkEntry};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crab_sys::proc_stat;

/// Container paths whose content is the kernel's or the runtime's, not state a turn leaves:
/// compared by nobody, whatever the spec says. `/dev/shm` (a tmpfs the agent writes) is kept.
pub const VOLATILE: [&str; 3] = ["/proc", "/sys", "/dev"];
/// Paths under [`VOLATILE`] that are state all the same.
pub const KEPT: [&str; 1] = ["/dev/shm"];
/// apt's binary caches of its package lists, which apt rebuilds whenever they do not match the
/// lists: their bytes differ between runs that did the same thing (the evaluation saw them
/// differ from both reference runs in a run whose fault touched nothing: chat-only under
/// kill-crabd, and crab under restart-containerd), so they are no state a recovery could keep
/// or lose. The lists themselves, and everything else under /var/cache/apt, are compared.
pub const DERIVED: [&str; 2] = ["/var/cache/apt/pkgcache.bin", "/var/cache/apt/srcpkgcache.bin"];

#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    #[error("walking the sandbox's files: {0}")]
    Walk(#[from] crab_store::CheckpointError),
    #[error("reading {path}: {source}")]
    Proc {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox init (pid {pid}): {source}")]
    Init {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("ignore entry {entry:?}: {problem}")]
    BadIgnore { entry: String, problem: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileEntry {
    /// f, d, l, p (fifo), s (socket), c, b.
    pub kind: char,
    pub mode: String,
    pub owner: String,
    /// Regular files and symlinks only: a directory's size depends on its history, not its entries.
    pub size: Option<u64>,
    pub link_target: Option<String>,
    pub sha256: Option<String>,
    /// Extended attributes of files and directories, values hex-encoded.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
    /// For a name of a multiply-linked file: the first name of the same inode in walk order
    /// (itself for the first), and the inode's link count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hard_link: Option<(String, u64)>,
    /// A file with holes: its data ranges (offset, length).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_ranges: Option<Vec<(u64, u64)>>,
    /// Device nodes: the device number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdev: Option<u64>,
}

/// One process, without its pid (a restore need not keep pids).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ProcessEntry {
    pub cwd: String,
    /// The parent's command line, or `(outside)` for a process whose parent is not in the
    /// sandbox (its init, and exec sessions the runtime holds).
    pub parent: String,
    /// `fd:target` of each open descriptor; pipes, sockets and anonymous inodes by kind only.
    pub fds: Vec<String>,
}

/// The files of a look, by container path. Paths and entries are shared with the sandbox's
/// previous look where they did not change (see [`ReadCache`]): a run keeps one look per turn,
/// and whole copies of a 17,000-file rootfs came to 2.9 GB after the two reference runs of a
/// 93-turn trace (pydicom-1413).
pub type Files = BTreeMap<Arc<str>, Arc<FileEntry>>;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Fingerprint {
    pub files: Files,
    /// Command line -> its processes, sorted.
    pub processes: BTreeMap<String, Vec<ProcessEntry>>,
    /// Listening sockets: `tcp 0100007F:1F90`, `unix /run/app.sock`.
    pub listeners: BTreeSet<String>,
    /// Established TCP connections (`tcp 0100007F:1F90 0100007F:*`, ephemeral ports as `*`) -> how many.
    pub connections: BTreeMap<String, usize>,
}

/// One way two fingerprints differ. `key` is stable across runs, so keys that
/// differ between two fault-free runs can be masked as nondeterministic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub key: String,
    pub detail: String,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.detail)
    }
}

/// What the fingerprint leaves out: [`VOLATILE`] but [`KEPT`], apt's [`DERIVED`] caches, the
/// kernel's and crab's own mounts of the sandbox's spec, and the trace's declared ignores.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    ignored: Vec<RelPath>,
    kept: Vec<RelPath>,
}

impl Scope {
    /// `ignore`: absolute container paths (a directory covers everything below it).
    pub fn new(mounts: &SandboxMounts, ignore: &[String]) -> Result<Scope, FingerprintError> {
        let parse = |entry: &str| {
            if !entry.starts_with('/') {
                return Err(FingerprintError::BadIgnore {
                    entry: entry.into(),
                    problem: "not an absolute path".into(),
                });
            }
            RelPath::parse(entry.as_bytes())
                .map_err(|error| FingerprintError::BadIgnore { entry: entry.into(), problem: error.to_string() })
        };
        let mut ignored = VOLATILE.iter().chain(&DERIVED).map(|path| parse(path)).collect::<Result<Vec<_>, _>>()?;
        for path in ignore {
            ignored.push(parse(path)?);
        }
        for mount in mounts.mounts() {
            // A read-only mount the sandbox does not own (package sources) is no state of the
            // sandbox: it cannot change it, and a restore does not touch it. A writable one is
            // fingerprinted: a change there is state crab does not restore, and must show.
            let external_ro = mount.kind == MountKind::External && mount.read_only;
            if matches!(mount.kind, MountKind::Kernel | MountKind::Crab) || external_ro {
                ignored.push(mount.destination.clone());
            }
        }
        let kept = KEPT.iter().map(|path| parse(path)).collect::<Result<Vec<_>, _>>()?;
        Ok(Scope { ignored, kept })
    }

    fn rel(path: &[u8]) -> Option<RelPath> {
        RelPath::parse(path).ok()
    }

    /// Left out of the fingerprint.
    pub fn ignores(&self, path: &[u8]) -> bool {
        let Some(rel) = Scope::rel(path) else { return true };
        let under = |roots: &[RelPath]| roots.iter().any(|root| *root == rel || root.is_ancestor_of(&rel));
        under(&self.ignored) && !under(&self.kept)
    }

    /// Not even walked: ignored, and holding nothing that is kept.
    fn prunes(&self, path: &[u8]) -> bool {
        let Some(rel) = Scope::rel(path) else { return true };
        self.ignores(path) && !self.kept.iter().any(|kept| rel.is_ancestor_of(kept))
    }
}

/// What the looks at one sandbox learnt, for the next. What was read of files and directories
/// (content hash, xattrs, holes), by [`WalkEntry::content_key`]: an inode that did not change
/// since (same device, inode, size, mtime and ctime, which no system call sets back; a write,
/// an xattr set or a hole punched moves ctime) is not opened again. And the files of the last
/// look, whose paths and equal entries the next look shares instead of holding copies.
#[derive(Debug, Default)]
pub struct ReadCache {
    read: HashMap<(u64, u64, u64, i128, i128), ReadOfInode>,
    last_look: Files,
}

#[derive(Debug, Clone)]
struct ReadOfInode {
    sha256: Option<String>,
    xattrs: BTreeMap<String, String>,
    data_ranges: Option<Vec<(u64, u64)>>,
}

impl Fingerprint {
    /// The whole sandbox whose init is `init` (a host pid the caller just learned from the
    /// runtime), as [`Scope`] bounds it.
    pub fn capture(init: u32, scope: &Scope, cache: &mut ReadCache) -> Result<Fingerprint, FingerprintError> {
        let root = ContainerRoot::new(init).map_err(|source| FingerprintError::Init { pid: init, source })?;
        let mount = root.open_mount(&RelPath::root())?;
        let files = files_of(&mount, scope, cache)?;
        let (processes, connections_of) = processes_of(init)?;
        let (listeners, connections) = sockets_of(init, connections_of)?;
        Ok(Fingerprint { files, processes, listeners, connections })
    }

    /// A short stable digest of the whole fingerprint, for reports.
    pub fn digest(&self) -> String {
        let canonical = serde_json::to_vec(self).expect("a fingerprint serializes");
        hex::encode(&Sha256::digest(&canonical)[..8])
    }

    /// How `self` differs from `reference`, in key order: files, processes, listeners, connections.
    pub fn diff(&self, reference: &Fingerprint) -> Vec<Difference> {
        let mut differences = Vec::new();
        for (path, expected) in &reference.files {
            let key = format!("file:{path}");
            match self.files.get(path) {
                None => differences.push(Difference { key, detail: "missing".to_string() }),
                Some(actual) if actual != expected => {
                    differences.push(Difference { key, detail: describe_change(actual, expected) })
                }
                Some(_) => {}
            }
        }
        for path in self.files.keys().filter(|path| !reference.files.contains_key(*path)) {
            differences.push(Difference { key: format!("file:{path}"), detail: "unexpected".to_string() });
        }
        let commands: BTreeSet<&String> = self.processes.keys().chain(reference.processes.keys()).collect();
        let none = Vec::new();
        for command in commands {
            let actual = self.processes.get(command).unwrap_or(&none);
            let expected = reference.processes.get(command).unwrap_or(&none);
            let detail = if actual.len() != expected.len() {
                format!("{} running, expected {}", actual.len(), expected.len())
            } else if actual != expected {
                let (got, want) = actual.iter().zip(expected).find(|(a, e)| a != e).expect("they differ");
                describe_process(got, want)
            } else {
                continue;
            };
            differences.push(Difference { key: format!("process:{command}"), detail });
        }
        for listener in reference.listeners.difference(&self.listeners) {
            differences.push(Difference { key: format!("listen:{listener}"), detail: "not listening".to_string() });
        }
        for listener in self.listeners.difference(&reference.listeners) {
            differences.push(Difference { key: format!("listen:{listener}"), detail: "unexpected".to_string() });
        }
        let connections: BTreeSet<&String> = self.connections.keys().chain(reference.connections.keys()).collect();
        for connection in connections {
            let actual = self.connections.get(connection).copied().unwrap_or(0);
            let expected = reference.connections.get(connection).copied().unwrap_or(0);
            if actual != expected {
                differences.push(Difference {
                    key: format!("connection:{connection}"),
                    detail: format!("{actual} open, expected {expected}"),
                });
            }
        }
        differences
    }
}

/// Every file of `mount` that `scope` keeps.
pub fn files_of(mount: &ContainerMount, scope: &Scope, cache: &mut ReadCache) -> Result<Files, FingerprintError> {
    let mut files = Files::new();
    let mut first_names: HashMap<(u64, u64), String> = HashMap::new();
    mount.walk(&mut |path| scope.prunes(path), &mut |entry| {
        if scope.ignores(entry.path()) {
            return Ok(());
        }
        let path = String::from_utf8_lossy(entry.path());
        let file = file_entry(entry, &path, &mut first_names, cache)?;
        let (path, file) = match cache.last_look.get_key_value(&*path) {
            Some((seen, same)) if **same == file => (seen.clone(), same.clone()),
            Some((seen, _)) => (seen.clone(), Arc::new(file)),
            None => (Arc::from(path), Arc::new(file)),
        };
        files.insert(path, file);
        Ok(())
    })?;
    cache.last_look = files.clone();
    Ok(files)
}

fn file_entry(
    entry: &WalkEntry<'_>,
    path: &str,
    first_names: &mut HashMap<(u64, u64), String>,
    cache: &mut ReadCache,
) -> Result<FileEntry, crab_store::CheckpointError> {
    let file_type = entry.file_type();
    let kind = match file_type {
        libc::S_IFREG => 'f',
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        libc::S_IFIFO => 'p',
        libc::S_IFSOCK => 's',
        libc::S_IFCHR => 'c',
        libc::S_IFBLK => 'b',
        _ => '?',
    };
    let (uid, gid) = entry.owner();
    let hard_link = (kind != 'd' && entry.links() > 1).then(|| {
        let first = first_names.entry(entry.inode()).or_insert_with(|| path.to_string());
        (first.clone(), entry.links())
    });
    // Only regular files and directories have content, xattrs or holes the walk reads.
    let read = if matches!(kind, 'f' | 'd') {
        let key = entry.content_key();
        match cache.read.get(&key) {
            Some(read) => read.clone(),
            None => {
                let read = ReadOfInode {
                    sha256: entry.file()?.map(|file| content_hash(entry, file, path)).transpose()?,
                    xattrs: entry.xattrs()?.into_iter().map(|(name, value)| (name, hex::encode(value.0))).collect(),
                    data_ranges: entry.data_ranges()?,
                };
                cache.read.insert(key, read.clone());
                read
            }
        }
    } else {
        ReadOfInode { sha256: None, xattrs: BTreeMap::new(), data_ranges: None }
    };
    Ok(FileEntry {
        kind,
        mode: format!("{:04o}", entry.mode()),
        owner: format!("{uid}:{gid}"),
        size: matches!(kind, 'f' | 'l').then(|| entry.size()),
        link_target: entry.link_target()?.map(|target| String::from_utf8_lossy(&target).into_owned()),
        sha256: read.sha256,
        xattrs: read.xattrs,
        hard_link,
        data_ranges: read.data_ranges,
        rdev: matches!(kind, 'c' | 'b').then(|| entry.rdev()),
    })
}

/// The SHA-256 of a regular file's first `size` bytes (the size seen when it was opened: a
/// file the container keeps appending to cannot keep us reading).
fn content_hash(entry: &WalkEntry<'_>, file: std::fs::File, path: &str) -> Result<String, crab_store::CheckpointError> {
    let mut hasher = Sha256::new();
    let mut reader = file.take(entry.size());
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let read = reader.read(&mut buffer).map_err(|source| crab_store::CheckpointError::Io {
            op: "read",
            path: PathBuf::from(path),
            source,
        })?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    Ok(hex::encode(hasher.finalize()))
}

fn read_proc(path: &Path) -> Result<Vec<u8>, FingerprintError> {
    std::fs::read(path).map_err(|source| FingerprintError::Proc { path: path.to_path_buf(), source })
}

fn readlink_proc(path: &Path) -> Option<String> {
    std::fs::read_link(path).ok().map(|target| target.to_string_lossy().into_owned())
}

/// Socket inodes the sandbox's processes hold, for telling its connections from others in
/// the same network namespace (there are none today, but a shared one would have them).
type SocketInodes = BTreeSet<u64>;

/// The host pids of `init`'s pid namespace (the sandbox's processes), zombies included.
pub(crate) fn pids_of_sandbox(init: u32) -> Result<Vec<u32>, FingerprintError> {
    let namespace = |pid: u32| readlink_proc(Path::new(&format!("/proc/{pid}/ns/pid")));
    let sandbox_ns =
        namespace(init).ok_or_else(|| FingerprintError::Init { pid: init, source: std::io::Error::last_os_error() })?;
    let entries =
        std::fs::read_dir("/proc").map_err(|source| FingerprintError::Proc { path: PathBuf::from("/proc"), source })?;
    Ok(entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()))
        .filter(|pid| namespace(*pid).as_deref() == Some(sandbox_ns.as_str()))
        .collect())
}

/// The processes of `init`'s pid namespace, as the host sees them.
fn processes_of(init: u32) -> Result<(BTreeMap<String, Vec<ProcessEntry>>, SocketInodes), FingerprintError> {
    // Paths under the sandbox's root show as seen from the host's root: cut that prefix.
    let root = readlink_proc(Path::new(&format!("/proc/{init}/root"))).unwrap_or_else(|| "/".to_string());
    let root = root.trim_end_matches('/').to_string();
    let container_path = |target: String| match target.strip_prefix(&root) {
        Some(rest) if !root.is_empty() && (rest.is_empty() || rest.starts_with('/')) => {
            if rest.is_empty() {
                "/".to_string()
            } else {
                rest.to_string()
            }
        }
        _ => target,
    };
    let mut members: BTreeMap<u32, (String, u32)> = BTreeMap::new();
    for pid in pids_of_sandbox(init)? {
        // A process that exits meanwhile is simply not there.
        let Ok(cmdline) = read_proc(&PathBuf::from(format!("/proc/{pid}/cmdline"))) else { continue };
        let args: Vec<String> =
            cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into()).collect();
        if args.is_empty() {
            continue; // a zombie
        }
        let Ok(stat) = proc_stat::read(pid) else { continue };
        members.insert(pid, (args.join(" "), proc_stat::parent(&stat).unwrap_or(0)));
    }
    let mut processes: BTreeMap<String, Vec<ProcessEntry>> = BTreeMap::new();
    let mut sockets = SocketInodes::new();
    for (pid, (command, parent)) in &members {
        let cwd = readlink_proc(Path::new(&format!("/proc/{pid}/cwd"))).map(&container_path).unwrap_or_default();
        let parent = members.get(parent).map_or_else(|| "(outside)".to_string(), |(command, _)| command.clone());
        let mut fds = Vec::new();
        if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in dir.flatten() {
                let Some(target) = readlink_proc(&fd.path()) else { continue };
                let number = fd.file_name().to_string_lossy().into_owned();
                let shown = describe_fd(&target, &fd.path(), &mut sockets, &container_path);
                fds.push((number.parse::<u32>().unwrap_or(u32::MAX), format!("{number}:{shown}")));
            }
        }
        fds.sort();
        let fds = fds.into_iter().map(|(_, fd)| fd).collect();
        processes.entry(command.clone()).or_default().push(ProcessEntry { cwd, parent, fds });
    }
    for list in processes.values_mut() {
        list.sort();
    }
    Ok((processes, sockets))
}

/// What a descriptor's target is, without its kernel-chosen numbers. A deleted file gets its
/// size, from a `stat` of the magic link (which never opens what it points to).
fn describe_fd(
    target: &str,
    link: &Path,
    sockets: &mut SocketInodes,
    container_path: &dyn Fn(String) -> String,
) -> String {
    if let Some(inode) = target.strip_prefix("socket:[").and_then(|rest| rest.strip_suffix(']')) {
        if let Ok(inode) = inode.parse() {
            sockets.insert(inode);
        }
        return "socket".to_string();
    }
    if target.starts_with("pipe:[") {
        return "pipe".to_string();
    }
    if target.starts_with("anon_inode:") || !target.starts_with('/') {
        return target.split('[').next().unwrap_or(target).to_string();
    }
    let shown = container_path(target.to_string());
    match shown.strip_suffix(" (deleted)") {
        Some(path) => {
            let size = std::fs::metadata(link).map_or("?".to_string(), |meta| meta.len().to_string());
            format!("{path} (deleted, {size} bytes)")
        }
        None => shown,
    }
}

/// The first port of the kernel's ephemeral range: ports from there up are chosen at random.
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// Listening TCP and unix sockets of `init`'s network namespace, and the established TCP
/// connections the sandbox's processes hold.
fn sockets_of(init: u32, held: SocketInodes) -> Result<(BTreeSet<String>, BTreeMap<String, usize>), FingerprintError> {
    let mut listeners = BTreeSet::new();
    let mut connections = BTreeMap::new();
    let ephemeral = ephemeral_start();
    let mask = |address: &str| match address.rsplit_once(':') {
        Some((host, port)) if u32::from_str_radix(port, 16).is_ok_and(|port| port >= ephemeral) => format!("{host}:*"),
        _ => address.to_string(),
    };
    for table in ["tcp", "tcp6"] {
        let path = PathBuf::from(format!("/proc/{init}/net/{table}"));
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for line in text.lines().skip(1) {
            let columns: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(state), Some(inode)) =
                (columns.get(1), columns.get(2), columns.get(3), columns.get(9))
            else {
                continue;
            };
            match *state {
                "0A" => {
                    listeners.insert(format!("{table} {local}"));
                }
                "01" if inode.parse().is_ok_and(|inode: u64| held.contains(&inode)) => {
                    *connections.entry(format!("{table} {} {}", mask(local), mask(remote))).or_default() += 1;
                }
                _ => {}
            }
        }
    }
    let path = PathBuf::from(format!("/proc/{init}/net/unix"));
    if let Ok(text) = std::fs::read_to_string(&path) {
        for line in text.lines().skip(1) {
            let columns: Vec<&str> = line.split_whitespace().collect();
            // Flags 00010000: __SO_ACCEPTCON, a listening socket; only named ones are state.
            if columns.get(3) == Some(&"00010000")
                && let Some(name) = columns.get(7)
            {
                listeners.insert(format!("unix {name}"));
            }
        }
    }
    Ok((listeners, connections))
}

fn describe_process(actual: &ProcessEntry, expected: &ProcessEntry) -> String {
    let mut parts = Vec::new();
    if actual.cwd != expected.cwd {
        parts.push(format!("cwd {} (expected {})", actual.cwd, expected.cwd));
    }
    if actual.parent != expected.parent {
        parts.push(format!("parent {:?} (expected {:?})", actual.parent, expected.parent));
    }
    if actual.fds != expected.fds {
        let got: BTreeSet<&String> = actual.fds.iter().collect();
        let want: BTreeSet<&String> = expected.fds.iter().collect();
        let extra: Vec<&&String> = got.difference(&want).collect();
        let missing: Vec<&&String> = want.difference(&got).collect();
        parts.push(format!("descriptors: {extra:?} open, {missing:?} missing"));
    }
    parts.join(", ")
}

fn describe_change(actual: &FileEntry, expected: &FileEntry) -> String {
    fn field<T: fmt::Display + PartialEq>(name: &str, actual: T, expected: T) -> Option<String> {
        (actual != expected).then(|| format!("{name} {actual} (expected {expected})"))
    }
    fn debug<T: fmt::Debug + PartialEq>(name: &str, actual: &T, expected: &T) -> Option<String> {
        (actual != expected).then(|| format!("{name} {actual:?} (expected {expected:?})"))
    }
    let size = |entry: &FileEntry| entry.size.map_or("-".to_string(), |size| size.to_string());
    let target = |entry: &FileEntry| format!("{:?}", entry.link_target.as_deref().unwrap_or(""));
    [
        field("type", actual.kind, expected.kind),
        field("mode", &actual.mode, &expected.mode),
        field("owner", &actual.owner, &expected.owner),
        field("size", size(actual), size(expected)),
        field("link target", target(actual), target(expected)),
        (actual.sha256 != expected.sha256).then(|| "content differs".to_string()),
        debug("xattrs", &actual.xattrs, &expected.xattrs),
        debug("hard link", &actual.hard_link, &expected.hard_link),
        debug("data ranges", &actual.data_ranges, &expected.data_ranges),
        debug("device", &actual.rdev, &expected.rdev),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn file(kind: char, sha256: Option<&str>) -> FileEntry {
        FileEntry {
            kind,
            mode: "0644".into(),
            owner: "0:0".into(),
            size: (kind == 'f').then_some(3),
            link_target: None,
            sha256: sha256.map(Into::into),
            xattrs: BTreeMap::new(),
            hard_link: None,
            data_ranges: None,
            rdev: None,
        }
    }

    fn process(cwd: &str, fds: &[&str]) -> ProcessEntry {
        ProcessEntry { cwd: cwd.into(), parent: "(outside)".into(), fds: fds.iter().map(|fd| fd.to_string()).collect() }
    }

    fn sample() -> Fingerprint {
        let mut fingerprint = Fingerprint::default();
        fingerprint.files.insert("/app".into(), file('d', None).into());
        fingerprint.files.insert("/app/a".into(), file('f', Some(HASH_A)).into());
        fingerprint.files.insert("/run/x".into(), file('f', Some(HASH_A)).into());
        fingerprint.processes.insert("sleep 1".into(), vec![process("/app", &["0:/dev/null", "1:pipe"])]);
        fingerprint.listeners.insert("tcp 0100007F:1F90".into());
        fingerprint.connections.insert("tcp 0100007F:1F90 0100007F:*".into(), 1);
        fingerprint
    }

    fn keys(differences: &[Difference]) -> Vec<&str> {
        differences.iter().map(|d| d.key.as_str()).collect()
    }

    #[test]
    fn equal_states_have_no_differences_and_equal_digests() {
        assert!(sample().diff(&sample()).is_empty());
        assert_eq!(sample().digest(), sample().digest());
        // The digest is of the fingerprint's JSON (shared paths and entries serialize as their
        // values): reports of different builds stay comparable. The JSON, hashed by hand:
        // {"files":{"/app":{"kind":"d","mode":"0644","owner":"0:0","size":null,...}, ...}
        assert_eq!(sample().digest(), "715976b475a71fcf");
    }

    #[test]
    fn every_kind_of_file_difference_is_named() {
        let reference = sample();
        let mut changed = sample();
        let entry = Arc::make_mut(changed.files.get_mut("/app/a").unwrap());
        entry.xattrs.insert("user.k".into(), "76".into());
        entry.hard_link = Some(("/app/a".into(), 2));
        entry.data_ranges = Some(vec![(4096, 1)]);
        entry.mode = "0600".into();
        changed.files.remove("/run/x");
        changed.files.insert("/etc/new".into(), file('f', Some(HASH_A)).into());
        let differences = changed.diff(&reference);
        assert_eq!(keys(&differences), ["file:/app/a", "file:/run/x", "file:/etc/new"]);
        assert_eq!(
            differences[0].detail,
            r#"mode 0600 (expected 0644), xattrs {"user.k": "76"} (expected {}), hard link Some(("/app/a", 2)) (expected None), data ranges Some([(4096, 1)]) (expected None)"#
        );
        assert_eq!((differences[1].detail.as_str(), differences[2].detail.as_str()), ("missing", "unexpected"));
        assert_ne!(changed.digest(), reference.digest());
    }

    #[test]
    fn processes_sockets_and_connections_are_compared() {
        let reference = sample();
        let mut moved = sample();
        moved.processes.insert("sleep 1".into(), vec![process("/", &["0:/dev/null"])]);
        let differences = moved.diff(&reference);
        assert_eq!(keys(&differences), ["process:sleep 1"]);
        assert_eq!(differences[0].detail, r#"cwd / (expected /app), descriptors: [] open, ["1:pipe"] missing"#);
        let mut gone = sample();
        gone.processes.clear();
        gone.listeners.clear();
        gone.listeners.insert("unix /run/s.sock".into());
        gone.connections.clear();
        let differences = gone.diff(&reference);
        assert_eq!(
            keys(&differences),
            [
                "process:sleep 1",
                "listen:tcp 0100007F:1F90",
                "listen:unix /run/s.sock",
                "connection:tcp 0100007F:1F90 0100007F:*"
            ]
        );
        assert_eq!(differences[0].detail, "0 running, expected 1");
        assert_eq!(differences[3].detail, "0 open, expected 1");
    }

    const SPEC: &str = r#"{"mounts": [
        {"destination": "/proc", "type": "proc"},
        {"destination": "/dev", "type": "tmpfs"},
        {"destination": "/dev/shm", "type": "tmpfs"},
        {"destination": "/run", "type": "tmpfs"},
        {"destination": "/sys/fs/cgroup", "type": "cgroup"},
        {"destination": "/opt/kernelish", "type": "sysfs"},
        {"destination": "/dev/.crab", "type": "bind", "source": "/x", "options": ["rbind"]},
        {"destination": "/opt/crab-packages", "type": "bind", "source": "/p", "options": ["rbind", "ro"]},
        {"destination": "/data", "type": "bind", "source": "/d", "options": ["rbind", "rw"]}
    ]}"#;

    #[test]
    fn the_scope_leaves_out_volatile_kernel_and_declared_paths_only() {
        let mounts = SandboxMounts::from_spec(SPEC.as_bytes()).unwrap();
        let scope = Scope::new(&mounts, &["/app/cache".to_string()]).unwrap();
        for ignored in [
            "/proc/1/environ",
            "/sys",
            "/dev/null",
            "/dev/.crab/sock",
            "/opt/kernelish/x",
            "/app/cache/y",
            "/opt/crab-packages/pypi/simple/index.html",
            "/var/cache/apt/pkgcache.bin",
            "/var/cache/apt/srcpkgcache.bin",
        ] {
            assert!(scope.ignores(ignored.as_bytes()), "{ignored}");
        }
        // A writable bind mount is state crab does not own: a change there must show.
        for kept in [
            "/",
            "/etc/passwd",
            "/run/x",
            "/dev/shm",
            "/dev/shm/x",
            "/app/cachex",
            "/opt/y",
            "/data/x",
            "/var/cache/apt/archives/nginx.deb",
            "/var/lib/apt/lists/x_Packages",
        ] {
            assert!(!scope.ignores(kept.as_bytes()), "{kept}");
        }
        // /dev is walked (for /dev/shm) though not recorded; /proc is not even walked.
        assert!(!scope.prunes(b"/dev") && scope.ignores(b"/dev"));
        assert!(scope.prunes(b"/proc") && scope.prunes(b"/dev/pts"));
        let error = Scope::new(&mounts, &["relative".to_string()]).unwrap_err();
        assert_eq!(error.to_string(), r#"ignore entry "relative": not an absolute path"#);
    }

    /// `files_of` over a directory of this machine, reached as a container's would be
    /// (beneath this process's `/proc/<pid>/root`).
    fn walk(dir: &Path) -> Files {
        walk_with(dir, &mut ReadCache::default())
    }

    /// [`walk`] with the reads of earlier walks, paths relative to `dir`.
    fn walk_with(dir: &Path, cache: &mut ReadCache) -> Files {
        let prefix = dir.to_str().unwrap();
        look(dir, cache).into_iter().map(|(path, entry)| (Arc::from(&path[prefix.len()..]), entry)).collect()
    }

    /// `files_of` `dir`, paths as the walk gives them.
    fn look(dir: &Path, cache: &mut ReadCache) -> Files {
        let root = ContainerRoot::new(std::process::id()).unwrap();
        let mount = root.open_mount(&RelPath::parse(dir.to_str().unwrap().as_bytes()).unwrap()).unwrap();
        files_of(&mount, &Scope::default(), cache).unwrap()
    }

    fn set_xattr(path: &Path, name: &str, value: &[u8]) {
        let path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: both strings are NUL-terminated and outlive the call; value's pointer and length match.
        let ret = unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        assert_eq!(ret, 0, "setxattr: {}", std::io::Error::last_os_error());
    }

    #[test]
    fn the_host_walk_sees_links_xattrs_holes_and_special_files_without_following_them() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let at = |name: &str| dir.path().join(name);
        std::fs::write(at("a"), "abc").unwrap();
        std::fs::hard_link(at("a"), at("b")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", at("escape")).unwrap();
        nix::unistd::mkfifo(&at("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        set_xattr(&at("a"), "user.crab", b"v");
        let sparse = std::fs::File::create(at("sparse")).unwrap();
        sparse.set_len(1 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&sparse, b"x", 1 << 19).unwrap();
        sparse.sync_all().unwrap();

        let files = walk(dir.path());
        let names: Vec<&str> = files.keys().map(|name| &**name).collect();
        assert_eq!(names, ["", "/a", "/b", "/escape", "/fifo", "/sparse"]);
        let (a, b) = (&files["/a"], &files["/b"]);
        assert_eq!(a.sha256.as_deref(), Some("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
        assert_eq!(a.xattrs.get("user.crab").map(String::as_str), Some("76"));
        let first = format!("{}/a", dir.path().display());
        assert_eq!((a.hard_link.clone(), b.hard_link.clone()), (Some((first.clone(), 2)), Some((first, 2))));
        let escape = &files["/escape"];
        assert_eq!(
            (escape.kind, escape.link_target.as_deref(), escape.sha256.as_ref()),
            ('l', Some("/etc/passwd"), None)
        );
        assert_eq!((files["/fifo"].kind, files["/fifo"].sha256.as_ref()), ('p', None));
        let ranges = files["/sparse"].data_ranges.clone().expect("a file with holes");
        assert!(ranges.len() == 1 && ranges[0].0 <= 1 << 19 && ranges[0].0 + ranges[0].1 > 1 << 19, "{ranges:?}");
        assert_eq!(files["/sparse"].size, Some(1 << 20));

        // A second look at an unchanged tree is equal; every change shows.
        assert!(walk(dir.path()) == files);
        std::fs::write(at("b"), "abd").unwrap();
        std::fs::remove_file(at("fifo")).unwrap();
        let before = Fingerprint { files: files.clone(), ..Fingerprint::default() };
        let after = Fingerprint { files: walk(dir.path()), ..Fingerprint::default() };
        let differences = after.diff(&before);
        assert_eq!(keys(&differences), ["file:/a", "file:/b", "file:/fifo"]);
        assert_eq!(differences[0].detail, "content differs");
    }

    /// A sandbox's looks share what they read of unchanged inodes; every change a container can
    /// make to a file or directory without changing its size or mtime (content rewritten and
    /// mtime set back, an xattr, a hole punched) still shows in the next look.
    #[test]
    fn looks_that_share_what_they_read_still_see_every_change() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let at = |name: &str| dir.path().join(name);
        std::fs::write(at("content"), "abc").unwrap();
        std::fs::write(at("xattr"), "abc").unwrap();
        std::fs::create_dir(at("dir")).unwrap();
        let holes = std::fs::File::create(at("holes")).unwrap();
        std::os::unix::fs::FileExt::write_at(&holes, &[1u8; 1 << 16], 0).unwrap();
        holes.sync_all().unwrap();
        let mut cache = ReadCache::default();
        let first = walk_with(dir.path(), &mut cache);
        assert!(first["/holes"].data_ranges.is_none(), "{:?}", first["/holes"]);
        assert_eq!(walk_with(dir.path(), &mut cache), first);

        let mtime = std::fs::metadata(at("content")).unwrap().modified().unwrap();
        std::fs::write(at("content"), "abd").unwrap();
        std::fs::File::options().write(true).open(at("content")).unwrap().set_modified(mtime).unwrap();
        set_xattr(&at("xattr"), "user.crab", b"v");
        set_xattr(&at("dir"), "user.crab", b"w");
        nix::fcntl::fallocate(
            &holes,
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            0,
            1 << 15,
        )
        .unwrap();
        holes.sync_all().unwrap();
        let second = walk_with(dir.path(), &mut cache);
        assert_eq!(second["/content"].size, first["/content"].size);
        assert_ne!(second["/content"].sha256, first["/content"].sha256);
        assert_eq!(second["/xattr"].xattrs.get("user.crab").map(String::as_str), Some("76"));
        assert_eq!(second["/dir"].xattrs.get("user.crab").map(String::as_str), Some("77"));
        let ranges = second["/holes"].data_ranges.clone().expect("a hole was punched");
        assert_eq!(ranges, [(1 << 15, 1 << 15)]);
        assert_eq!(second, walk(dir.path()), "a look without the shared reads sees the same");
    }

    /// A run keeps its look after every turn: a look holds the last one's paths and unchanged
    /// entries, not copies of them, and a changed or new entry of its own.
    #[test]
    fn a_look_shares_with_the_last_what_did_not_change() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let at = |name: &str| dir.path().join(name);
        std::fs::write(at("kept"), "abc").unwrap();
        std::fs::write(at("changed"), "abc").unwrap();
        let mut cache = ReadCache::default();
        let first = look(dir.path(), &mut cache);
        std::fs::write(at("changed"), "abcd").unwrap();
        std::fs::write(at("new"), "abc").unwrap();
        let second = look(dir.path(), &mut cache);
        let entry = |files: &Files, name: &str| {
            let path = at(name);
            let (path, entry) = files.get_key_value(path.to_str().unwrap()).unwrap();
            (path.clone(), entry.clone())
        };
        let (kept, changed) =
            ((entry(&first, "kept"), entry(&second, "kept")), (entry(&first, "changed"), entry(&second, "changed")));
        assert!(Arc::ptr_eq(&kept.0.0, &kept.1.0) && Arc::ptr_eq(&kept.0.1, &kept.1.1), "an unchanged file is shared");
        assert!(Arc::ptr_eq(&changed.0.0, &changed.1.0), "the path of a changed file is shared");
        assert!(!Arc::ptr_eq(&changed.0.1, &changed.1.1) && changed.0.1 != changed.1.1, "its entry is its own");
        assert_eq!(second.len(), first.len() + 1);
        // What sharing saves changes nothing a look sees.
        assert_eq!(second, look(dir.path(), &mut ReadCache::default()));
        assert_eq!(
            Fingerprint { files: second.clone(), ..Fingerprint::default() }.digest(),
            Fingerprint { files: look(dir.path(), &mut ReadCache::default()), ..Fingerprint::default() }.digest()
        );
    }
}
