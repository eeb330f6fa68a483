//! Races a hostile container runs against capture and rollback. The container is root inside
//! its rootfs and may swap any name for a device node, a fifo or a symlink between two of our
//! calls; failpoints put each swap exactly between two steps, deterministically.
//!
//! Device nodes stand for the host's disks: a loop device over a file of `HOST_SECRET` plays the
//! disk, so a test sees whether its bytes reached a checkpoint or a checkpoint's bytes reached
//! it. These tests need root (mknod, losetup); without it they say so and pass.

use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use fail::FailScenario;
use nix::sys::stat::{Mode, SFlag, mknod};

use super::*;
use crate::manifest::Meta;

const HOST_SECRET: &[u8] = b"HOST-SECRET-0123456789";
const CHECKPOINT: &[u8] = b"CHECKPOINT-BYTES";

fn root_or_skip() -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    eprintln!("skipped: needs root (device nodes and loop devices)");
    false
}

/// A loop device over a file full of `HOST_SECRET`: what a container would aim at.
struct HostDisk {
    _dir: tempfile::TempDir,
    dev: PathBuf,
    rdev: u64,
}

impl HostDisk {
    fn new() -> HostDisk {
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("disk");
        fs::write(&backing, HOST_SECRET.repeat(3000)).unwrap();
        let out = Command::new("losetup").args(["--find", "--show"]).arg(&backing).output().expect("run losetup");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        let dev = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        let rdev = fs::metadata(&dev).unwrap().rdev();
        HostDisk { _dir: dir, dev, rdev }
    }

    /// The device's first bytes, as anyone opening it now reads them.
    fn head(&self) -> Vec<u8> {
        let mut buf = vec![0u8; HOST_SECRET.len()];
        fs::File::open(&self.dev).unwrap().read_exact(&mut buf).unwrap();
        buf
    }
}

impl Drop for HostDisk {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// A container rootfs, a host directory beside it that the container must never reach, and a
/// store.
struct Tree {
    _dirs: [tempfile::TempDir; 3],
    root: PathBuf,
    host: PathBuf,
    blobs: BlobStore,
}

impl Tree {
    fn new() -> Tree {
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let root = dirs[0].path().to_owned();
        let host = dirs[1].path().to_owned();
        fs::write(host.join("secret"), HOST_SECRET).unwrap();
        fs::set_permissions(host.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
        let blobs = BlobStore::open(dirs[2].path()).unwrap();
        Tree { _dirs: dirs, root, host, blobs }
    }

    fn capture(&self, paths: &[&str]) -> Result<Vec<FsEntry>> {
        let changes: Vec<_> = paths.iter().map(ChangedPath::modified).collect();
        let mut batch = self.blobs.batch();
        let entries = capture(&self.root, None, &changes, &mut batch)?;
        batch.commit()?;
        Ok(entries)
    }

    fn apply(&self, entry: &FsEntry) -> Result<ApplyStats> {
        let root = Root::open(&self.root)?;
        let mut applier = Applier::new(&root, &self.blobs);
        if let Some(blob) = entry.node.blob() {
            applier.prefetch([blob])?;
        }
        applier.apply(entry, false)?;
        applier.finish()
    }

    /// Every byte the store holds for `entries`.
    fn stored_bytes(&self, entries: &[FsEntry]) -> Vec<u8> {
        let mut all = Vec::new();
        for e in entries {
            if let Some(blob) = e.node.blob() {
                all.extend(self.blobs.read(blob).unwrap());
            }
        }
        all
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// What the container puts in place of the name, at the failpoint.
#[derive(Clone, Copy, Debug)]
enum Intruder {
    /// A block device node of the host disk.
    Disk,
    /// A symlink to the host's secret file.
    LinkToHostFile,
    /// A symlink to the host directory.
    LinkToHostDir,
}

const INTRUDERS: [Intruder; 3] = [Intruder::Disk, Intruder::LinkToHostFile, Intruder::LinkToHostDir];

/// Prepares the intruder under a hidden name beside `target`, and at the first pass through
/// `failpoint` renames it over `target` (a directory there is moved away first), as a process
/// in the container would. Returns how often the swap ran.
fn swap_at(
    failpoint: &'static str,
    tree: &Tree,
    disk: &HostDisk,
    target: &str,
    intruder: Intruder,
) -> Arc<AtomicUsize> {
    let staged = tree.root.join(".intruder");
    let _ = fs::remove_file(&staged);
    match intruder {
        Intruder::Disk => mknod(&staged, SFlag::S_IFBLK, Mode::from_bits_truncate(0o600), disk.rdev).unwrap(),
        Intruder::LinkToHostFile => symlink(tree.host.join("secret"), &staged).unwrap(),
        Intruder::LinkToHostDir => symlink(&tree.host, &staged).unwrap(),
    }
    let target = tree.root.join(target.trim_start_matches('/'));
    let aside = tree.root.join(".moved-away");
    let swaps = Arc::new(AtomicUsize::new(0));
    let counter = swaps.clone();
    fail::cfg_callback(failpoint, move || {
        if counter.fetch_add(1, Ordering::SeqCst) == 0 {
            if fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
                fs::rename(&target, &aside).unwrap();
            }
            fs::rename(&staged, &target).unwrap();
        }
    })
    .unwrap();
    swaps
}

/// The first bytes of a host file and its mode, to compare before and after.
fn host_file_state(tree: &Tree) -> (Vec<u8>, u32) {
    let path = tree.host.join("secret");
    (fs::read(&path).unwrap(), fs::metadata(&path).unwrap().mode() & 0o7777)
}

#[test]
fn capture_never_reads_a_device_node_swapped_in_for_a_file() {
    if !root_or_skip() {
        return;
    }
    let disk = HostDisk::new();
    let tree = Tree::new();
    fs::write(tree.root.join("f"), b"mine").unwrap();
    let scenario = FailScenario::setup();
    let swaps = swap_at("fsdelta-capture-open", &tree, &disk, "/f", Intruder::Disk);
    let entries = tree.capture(&["/f"]).expect("capture");
    scenario.teardown();
    assert!(swaps.load(Ordering::SeqCst) >= 1, "the failpoint never ran");
    let stored = tree.stored_bytes(&entries);
    assert!(!contains(&stored, HOST_SECRET), "the host disk's bytes were captured: {entries:?}");
    match &entries[0].node {
        FsNode::Special { file_type, rdev, .. } => {
            assert_eq!((*file_type, *rdev), (libc::S_IFBLK, disk.rdev), "recorded as what it is")
        }
        FsNode::File { .. } => assert_eq!(stored, b"mine"),
        other => panic!("unexpected node {other:?}"),
    }
}

/// Every kind of entry, each intruder, at each step of the capture: no error, no host byte in
/// the store, and the entry is recorded as what was there before or after the swap.
#[test]
fn capture_races_never_reach_the_host() {
    if !root_or_skip() {
        return;
    }
    let disk = HostDisk::new();
    for failpoint in ["fsdelta-capture-open", "fsdelta-capture-read"] {
        for original in ["file", "dir", "symlink", "fifo"] {
            for intruder in INTRUDERS {
                let tree = Tree::new();
                let target = tree.root.join("x");
                match original {
                    "file" => fs::write(&target, b"mine").unwrap(),
                    "dir" => {
                        fs::create_dir(&target).unwrap();
                        fs::write(target.join("inner"), b"mine").unwrap();
                    }
                    "symlink" => symlink("elsewhere", &target).unwrap(),
                    _ => mknod(&target, SFlag::S_IFIFO, Mode::from_bits_truncate(0o644), 0).unwrap(),
                }
                let scenario = FailScenario::setup();
                let _swaps = swap_at(failpoint, &tree, &disk, "/x", intruder);
                let changes = [ChangedPath::created("/x")];
                let mut batch = tree.blobs.batch();
                let result = capture(&tree.root, None, &changes, &mut batch);
                scenario.teardown();
                let case = format!("{original} swapped for {intruder:?} at {failpoint}");
                let entries = result.unwrap_or_else(|e| panic!("{case}: capture failed: {e}"));
                batch.commit().unwrap();
                let stored = tree.stored_bytes(&entries);
                assert!(!contains(&stored, HOST_SECRET), "{case}: host bytes captured: {entries:?}");
                assert!(
                    entries.iter().all(|e| !e.path.to_string().contains("secret")),
                    "{case}: a host directory was walked: {entries:?}"
                );
            }
        }
    }
}

fn meta(mode: u32) -> Meta {
    Meta { mode, uid: 0, gid: 0, mtime_sec: 1_700_000_000, mtime_nsec: 0, xattrs: Default::default() }
}

#[test]
fn rollback_never_writes_into_a_device_node_swapped_in_for_a_file() {
    if !root_or_skip() {
        return;
    }
    let disk = HostDisk::new();
    let tree = Tree::new();
    fs::write(tree.root.join("f"), b"old content of f").unwrap();
    let blob = tree.blobs.put(CHECKPOINT).unwrap();
    let entry = FsEntry {
        path: RelPath::parse("/f").unwrap(),
        node: FsNode::File { meta: meta(0o644), blob, size: CHECKPOINT.len() as u64, extents: None },
    };
    let scenario = FailScenario::setup();
    let swaps = swap_at("fsdelta-write-open", &tree, &disk, "/f", Intruder::Disk);
    let result = tree.apply(&entry);
    scenario.teardown();
    assert!(swaps.load(Ordering::SeqCst) >= 1, "the failpoint never ran");
    assert_eq!(disk.head(), HOST_SECRET, "the checkpoint was written into the host disk");
    result.expect("rollback");
    let f = tree.root.join("f");
    assert!(fs::symlink_metadata(&f).unwrap().file_type().is_file(), "f is a regular file again");
    assert_eq!(fs::read(&f).unwrap(), CHECKPOINT);
}

#[test]
fn rollback_never_chmods_through_a_symlink_swapped_in_for_a_special_file() {
    if !root_or_skip() {
        return;
    }
    let disk = HostDisk::new();
    let tree = Tree::new();
    let before = host_file_state(&tree);
    let entry = FsEntry {
        path: RelPath::parse("/p").unwrap(),
        node: FsNode::Special { meta: meta(0o6777), file_type: libc::S_IFIFO, rdev: 0 },
    };
    let scenario = FailScenario::setup();
    let swaps = swap_at("fsdelta-special-meta", &tree, &disk, "/p", Intruder::LinkToHostFile);
    let result = tree.apply(&entry);
    scenario.teardown();
    assert!(swaps.load(Ordering::SeqCst) >= 1, "the failpoint never ran");
    assert_eq!(host_file_state(&tree), before, "the host file was changed through the symlink");
    result.expect("rollback");
    let p = fs::symlink_metadata(tree.root.join("p")).unwrap();
    assert!(p.file_type().is_fifo(), "p is the checkpoint's fifo again");
    assert_eq!(p.mode() & 0o7777, 0o6777);
}

/// Every kind of checkpoint entry, each intruder, at each step of the rollback: the host file
/// and disk are untouched and the path ends up as the checkpoint has it.
#[test]
fn rollback_races_never_reach_the_host() {
    if !root_or_skip() {
        return;
    }
    let disk = HostDisk::new();
    for failpoint in ["fsdelta-write-open", "fsdelta-apply-meta", "fsdelta-special-meta"] {
        for kind in ["file", "dir", "symlink", "fifo"] {
            for intruder in INTRUDERS {
                let tree = Tree::new();
                let host_before = host_file_state(&tree);
                fs::write(tree.root.join("x"), b"before").unwrap();
                let blob = tree.blobs.put(CHECKPOINT).unwrap();
                let node = match kind {
                    "file" => FsNode::File { meta: meta(0o4755), blob, size: CHECKPOINT.len() as u64, extents: None },
                    "dir" => FsNode::Dir { meta: meta(0o1777), complete: false },
                    "symlink" => FsNode::Symlink { meta: meta(0o777), target: crate::path::Bytes(b"t".to_vec()) },
                    _ => FsNode::Special { meta: meta(0o6666), file_type: libc::S_IFIFO, rdev: 0 },
                };
                let entry = FsEntry { path: RelPath::parse("/x").unwrap(), node };
                let scenario = FailScenario::setup();
                let _swaps = swap_at(failpoint, &tree, &disk, "/x", intruder);
                let result = tree.apply(&entry);
                scenario.teardown();
                let case = format!("{kind} rolled back, {intruder:?} swapped in at {failpoint}");
                assert_eq!(disk.head(), HOST_SECRET, "{case}: the host disk was written");
                assert_eq!(host_file_state(&tree), host_before, "{case}: the host file was changed");
                result.unwrap_or_else(|e| panic!("{case}: rollback failed: {e}"));
                let x = fs::symlink_metadata(tree.root.join("x")).unwrap();
                let ft = x.file_type();
                let is_kind = match kind {
                    "file" => ft.is_file() && fs::read(tree.root.join("x")).unwrap() == CHECKPOINT,
                    "dir" => ft.is_dir(),
                    "symlink" => ft.is_symlink(),
                    _ => ft.is_fifo(),
                };
                assert!(is_kind, "{case}: ended up as {ft:?}");
                if !ft.is_symlink() {
                    assert_eq!(x.mode() & 0o7777, entry.node.meta().unwrap().mode, "{case}: mode");
                }
            }
        }
    }
}

fn sparse_file(path: &Path, size: u64, data_at: &[u64]) {
    let f = fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    for &off in data_at {
        std::os::unix::fs::FileExt::write_all_at(&f, CHECKPOINT, off).unwrap();
    }
}

#[test]
fn a_sparse_file_costs_only_its_allocated_bytes_and_comes_back_sparse() {
    let tree = Tree::new();
    const TIB: u64 = 1 << 40;
    let offsets = [0, 1 << 30, TIB - 4096];
    sparse_file(&tree.root.join("huge"), TIB, &offsets);
    sparse_file(&tree.root.join("empty-huge"), TIB, &[]);
    let changes = [ChangedPath::modified("/huge"), ChangedPath::modified("/empty-huge")];
    let mut batch = tree.blobs.batch();
    let entries = capture(&tree.root, None, &changes, &mut batch).expect("capture");
    let new_bytes = batch.commit().unwrap().written_bytes;
    // Three data blocks at most, whatever the file system's block size.
    assert!(new_bytes <= 3 * 64 * 1024, "a 1 TiB sparse file cost {new_bytes} bytes");

    let target = tempfile::tempdir().unwrap();
    let root = Root::open(target.path()).unwrap();
    let mut applier = Applier::new(&root, &tree.blobs);
    for e in &entries {
        applier.apply(e, false).expect("apply");
    }
    applier.finish().unwrap();
    for (name, data_at) in [("huge", &offsets[..]), ("empty-huge", &[][..])] {
        let path = target.path().join(name);
        let md = fs::metadata(&path).unwrap();
        assert_eq!(md.len(), TIB, "{name}: size");
        assert!(md.blocks() * 512 <= 3 * 64 * 1024, "{name}: restored with {} blocks", md.blocks());
        let f = fs::File::open(&path).unwrap();
        for &off in data_at {
            let mut buf = vec![0u8; CHECKPOINT.len()];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, off).unwrap();
            assert_eq!(buf, CHECKPOINT, "{name}: data at {off}");
        }
        let mut buf = vec![1u8; 4096];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, 1 << 20).unwrap();
        assert!(buf.iter().all(|b| *b == 0), "{name}: a hole reads as zeros");
    }
}

/// Rolling a sparse file back over a longer, fully written one leaves holes where the
/// checkpoint had them, not the old bytes.
#[test]
fn a_sparse_file_rolled_back_in_place_drops_the_old_bytes() {
    let tree = Tree::new();
    sparse_file(&tree.root.join("s"), 1 << 20, &[0]);
    let entries = tree.capture(&["/s"]).unwrap();
    fs::write(tree.root.join("s"), vec![7u8; 2 << 20]).unwrap();
    tree.apply(&entries[0]).unwrap();
    let data = fs::read(tree.root.join("s")).unwrap();
    assert_eq!(data.len(), 1 << 20);
    assert_eq!(&data[..CHECKPOINT.len()], CHECKPOINT);
    assert!(data[4096..].iter().all(|b| *b == 0), "old bytes survived the rollback");
}
