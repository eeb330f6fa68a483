//! Checkpoint store against real files in temp dirs: capture/restore round trips, in-place
//! rollback, dedup, corruption, crash leftovers, path escapes, chunked CRIU images, forks, GC.
//! Runs as root (owners, devices-free special files, CRIU).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt, lchown, symlink};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crab_store::{
    ChangedPath, CheckpointError, CheckpointStore, KeptImages, RetentionPolicy, RollbackRequest, TurnClass, TurnInput,
};

// ---------- helpers ----------

/// Everything the store promises to preserve about a tree, keyed by path. Directory mtimes are
/// left out: creating entries inside a directory changes them in the live tree too.
#[derive(Debug, PartialEq, Eq, Clone)]
enum Node {
    File { mode: u32, uid: u32, gid: u32, mtime: (i64, i64), xattrs: BTreeMap<String, Vec<u8>>, content: Vec<u8> },
    Dir { mode: u32, uid: u32, gid: u32, xattrs: BTreeMap<String, Vec<u8>> },
    Symlink { uid: u32, gid: u32, target: PathBuf },
    Other { mode: u32, uid: u32, gid: u32 },
}

/// Overwrites a stored blob's bytes where they are (its own file, or its place in its pack);
/// returns the file an error about it names.
fn overwrite_blob(store: &CheckpointStore, digest: &crab_store::Digest, bytes: &[u8]) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let (path, offset) = match store.blobs().location(digest).unwrap() {
        crab_store::BlobLocation::File(path) => {
            fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
            fs::write(&path, bytes).unwrap();
            return path;
        }
        crab_store::BlobLocation::Packed { pack, offset, len } => {
            assert_eq!(bytes.len() as u64, len, "a packed blob is overwritten in place");
            (pack, offset)
        }
    };
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    fs::OpenOptions::new().write(true).open(&path).unwrap().write_all_at(bytes, offset).unwrap();
    path
}

fn xattrs(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut names = vec![0u8; 4096];
    // SAFETY: `c` is NUL-terminated and `names` is valid for its length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "llistxattr {}", path.display());
    names.truncate(n as usize);
    let mut out = BTreeMap::new();
    for name in names.split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let cname = CString::new(name).unwrap();
        let mut value = vec![0u8; 4096];
        // SAFETY: both names are NUL-terminated and `value` is valid for its length.
        let n = unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        assert!(n >= 0);
        value.truncate(n as usize);
        out.insert(String::from_utf8(name.to_vec()).unwrap(), value);
    }
    out
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    // SAFETY: both names are NUL-terminated and `value` is valid for its length.
    let ret = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(ret, 0, "setxattr {}: {}", path.display(), std::io::Error::last_os_error());
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is NUL-terminated.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o640) }, 0);
}

fn tree(root: &Path) -> BTreeMap<String, Node> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Node>) {
        let mut names: Vec<_> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        names.sort();
        for path in names {
            let rel = format!("/{}", path.strip_prefix(root).unwrap().display());
            let md = fs::symlink_metadata(&path).unwrap();
            let (mode, uid, gid) = (md.mode() & 0o7777, md.uid(), md.gid());
            let node = if md.file_type().is_symlink() {
                Node::Symlink { uid, gid, target: fs::read_link(&path).unwrap() }
            } else if md.is_dir() {
                Node::Dir { mode, uid, gid, xattrs: xattrs(&path) }
            } else if md.is_file() {
                let content = fs::read(&path).unwrap();
                Node::File { mode, uid, gid, mtime: (md.mtime(), md.mtime_nsec()), xattrs: xattrs(&path), content }
            } else {
                Node::Other { mode: md.mode(), uid, gid }
            };
            out.insert(rel, node);
            if md.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn assert_same_tree(actual: &Path, expected: &BTreeMap<String, Node>) {
    let actual = tree(actual);
    for (path, node) in expected {
        assert_eq!(actual.get(path), Some(node), "at {path}");
    }
    for path in actual.keys() {
        assert!(expected.contains_key(path), "unexpected {path}");
    }
}

fn copy_tree(from: &Path, to: &Path) {
    let status = Command::new("cp").arg("-a").arg(format!("{}/.", from.display())).arg(to).status().unwrap();
    assert!(status.success());
}

fn write(root: &Path, rel: &str, content: &[u8]) {
    let path = root.join(rel.trim_start_matches('/'));
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

/// A small image rootfs: what a container starts from.
fn make_base(dir: &Path) {
    write(dir, "/etc/hostname", b"sandbox\n");
    write(dir, "/etc/old.conf", b"old=1\n");
    write(dir, "/etc/sub/a.conf", b"a\n");
    write(dir, "/etc/sub/deeper/b.conf", b"b\n");
    write(dir, "/app/README", b"readme\n");
    write(dir, "/usr/bin/tool", b"#!/bin/sh\necho tool\n");
    fs::set_permissions(dir.join("usr/bin/tool"), fs::Permissions::from_mode(0o755)).unwrap();
    symlink("usr/bin", dir.join("bin")).unwrap();
}

struct Sandbox {
    _tmp: tempfile::TempDir,
    state: PathBuf,
    base: PathBuf,
    live: PathBuf,
    store: CheckpointStore,
}

impl Sandbox {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let (state, base, live) = (tmp.path().join("state"), tmp.path().join("base"), tmp.path().join("live"));
        fs::create_dir_all(&base).unwrap();
        fs::create_dir_all(&live).unwrap();
        make_base(&base);
        copy_tree(&base, &live);
        let store = CheckpointStore::open(&state).unwrap();
        Sandbox { _tmp: tmp, state, base, live, store }
    }

    fn commit(&self, container: &str, turn: u64, changed: &[ChangedPath]) -> crab_store::CommitReport {
        self.store
            .commit_turn(&TurnInput { container, turn, rootfs: Some(&self.live), changed, criu_images: None })
            .unwrap()
    }

    fn fresh_target(&self, name: &str) -> PathBuf {
        let target = self._tmp.path().join(name);
        fs::create_dir_all(&target).unwrap();
        copy_tree(&self.base, &target);
        target
    }

    fn rollback(&self, container: &str, to_turn: u64) -> crab_store::Result<crab_store::RollbackReport> {
        self.store.rollback_in_place(&RollbackRequest {
            container,
            to_turn,
            root: &self.live,
            base: Some(&self.base),
            uncommitted: &[],
        })
    }
}

fn m(p: &str) -> ChangedPath {
    ChangedPath::modified(p)
}

fn c(p: &str) -> ChangedPath {
    ChangedPath::created(p)
}

/// A turn that exercises every kind of entry; returns its change list.
fn rich_turn(live: &Path) -> Vec<ChangedPath> {
    write(live, "/app/a.txt", b"alpha\n");
    fs::set_permissions(live.join("app/a.txt"), fs::Permissions::from_mode(0o640)).unwrap();
    lchown(live.join("app/a.txt"), Some(1000), Some(1001)).unwrap();
    set_xattr(&live.join("app/a.txt"), "user.note", b"hi\xff");
    write(live, "/app/suid", b"s");
    lchown(live.join("app/suid"), Some(0), Some(50)).unwrap();
    fs::set_permissions(live.join("app/suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    symlink("../etc/hostname", live.join("app/rel-link")).unwrap();
    symlink("/etc/passwd", live.join("app/abs-link")).unwrap();
    lchown(live.join("app/abs-link"), Some(7), Some(8)).unwrap();
    write(live, "/app/h1", b"linked content\n");
    fs::hard_link(live.join("app/h1"), live.join("app/h2")).unwrap();
    write(live, "/app/new/deep/x.txt", b"x\n");
    write(live, "/app/new/deep/y.txt", b"y\n");
    set_xattr(&live.join("app/new/deep"), "user.dir", b"d");
    fs::set_permissions(live.join("app/new"), fs::Permissions::from_mode(0o711)).unwrap();
    mkfifo(&live.join("app/new/fifo"));
    fs::remove_file(live.join("etc/old.conf")).unwrap();
    write(live, "/etc/hostname", b"changed\n");
    vec![
        c("/app/a.txt"),
        c("/app/suid"),
        c("/app/rel-link"),
        c("/app/abs-link"),
        c("/app/h1"),
        c("/app/h2"),
        c("/app/new"),
        m("/app/new/deep/x.txt"), // already covered by the new directory
        m("/etc/old.conf"),
        m("/etc/hostname"),
        m("/app"),
    ]
}

// ---------- capture / restore ----------

#[test]
fn materialize_reproduces_modes_owners_xattrs_links_and_deletions() {
    crab_sys::skip_unless_root!("mounts, ownership and CRIU");
    let sb = Sandbox::new();
    sb.commit("c1", 0, &[]);
    let report = sb.commit("c1", 1, &rich_turn(&sb.live));
    assert_eq!(report.class, TurnClass::Fs);

    let target = sb.fresh_target("restored");
    let stats = sb.store.materialize("c1", 1, &target).unwrap();
    assert!(stats.links_made >= 1, "{stats:?}");
    assert_same_tree(&target, &tree(&sb.live));
    let (h1, h2) = (fs::metadata(target.join("app/h1")).unwrap(), fs::metadata(target.join("app/h2")).unwrap());
    assert_eq!(h1.ino(), h2.ino(), "hardlinks restored as one inode");
    assert!(!target.join("etc/old.conf").exists());

    // Turn 0 is the base: materialising it changes nothing.
    let target0 = sb.fresh_target("restored0");
    sb.store.materialize("c1", 0, &target0).unwrap();
    assert_same_tree(&target0, &tree(&sb.base));
}

#[test]
fn manifest_records_entry_kinds() {
    crab_sys::skip_unless_root!("mounts, ownership and CRIU");
    let sb = Sandbox::new();
    let report = sb.commit("c1", 1, &rich_turn(&sb.live));
    let (id, manifest) = sb.store.manifest_at("c1", 1).unwrap();
    assert_eq!(id, report.id);
    let kinds: BTreeMap<String, String> = manifest
        .fs_delta
        .iter()
        .map(|e| {
            let json = serde_json::to_value(e).unwrap();
            (e.path.to_string(), json["kind"].as_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(kinds["/etc/old.conf"], "whiteout");
    assert_eq!(kinds["/app/h2"], "hardlink");
    assert_eq!(kinds["/app/abs-link"], "symlink");
    assert_eq!(kinds["/app/new"], "dir");
    assert_eq!(kinds["/app/new/deep/y.txt"], "file");
    assert_eq!(kinds["/app/new/fifo"], "special");
    assert_eq!(kinds["/app"], "dir");
    let app = manifest.fs_delta.iter().find(|e| e.path.to_string() == "/app").unwrap();
    assert!(matches!(app.node, crab_store::FsNode::Dir { complete: false, .. }), "modified dir is not recursive");
}

#[test]
fn in_place_rollback_restores_every_turn_exactly() {
    crab_sys::skip_unless_root!("mounts, ownership and CRIU");
    let sb = Sandbox::new();
    sb.commit("c1", 0, &[]);
    let mut trees = vec![tree(&sb.live)];

    let changes = rich_turn(&sb.live);
    sb.commit("c1", 1, &changes);
    trees.push(tree(&sb.live));

    // Turn 2: a file becomes a directory, a directory becomes a file, a base directory is
    // deleted recursively, contents and metadata change.
    fs::remove_file(sb.live.join("app/a.txt")).unwrap();
    write(&sb.live, "/app/a.txt/inner", b"now a dir\n");
    fs::remove_dir_all(sb.live.join("app/new")).unwrap();
    write(&sb.live, "/app/new", b"now a file\n");
    fs::remove_dir_all(sb.live.join("etc/sub")).unwrap();
    fs::set_permissions(sb.live.join("usr/bin/tool"), fs::Permissions::from_mode(0o700)).unwrap();
    write(&sb.live, "/app/README", b"edited\n");
    sb.commit("c1", 2, &[c("/app/a.txt"), c("/app/new"), m("/etc/sub"), m("/usr/bin/tool"), m("/app/README")]);
    trees.push(tree(&sb.live));

    // Turn 3: recreate a deleted base directory with different content, delete a symlink.
    write(&sb.live, "/etc/sub/other", b"other\n");
    fs::remove_file(sb.live.join("app/rel-link")).unwrap();
    sb.commit("c1", 3, &[c("/etc/sub"), m("/app/rel-link")]);
    trees.push(tree(&sb.live));

    let report = sb.rollback("c1", 2).unwrap();
    assert_eq!((report.from_turn, report.to_turn), (3, 2));
    assert_same_tree(&sb.live, &trees[2]);

    sb.rollback("c1", 1).unwrap();
    assert_same_tree(&sb.live, &trees[1]);
    assert_eq!(sb.store.head("c1").unwrap().unwrap().turn, 1);

    sb.rollback("c1", 0).unwrap();
    assert_same_tree(&sb.live, &trees[0]);
    assert_same_tree(&sb.live, &tree(&sb.base));

    // The chain goes on from the rollback point; the abandoned turns are gone from history.
    write(&sb.live, "/app/after", b"after rollback\n");
    sb.commit("c1", 1, &[c("/app/after")]);
    let turns: Vec<u64> = sb.store.history("c1").unwrap().iter().map(|i| i.turn).collect();
    assert_eq!(turns, [1, 0]);
}

#[test]
fn rollback_of_uncommitted_changes_and_missing_base() {
    let sb = Sandbox::new();
    sb.commit("c1", 0, &[]);
    write(&sb.live, "/app/README", b"turn 1\n");
    sb.commit("c1", 1, &[m("/app/README")]);
    let at_turn1 = tree(&sb.live);

    // Changes after the head that no checkpoint saw are put back too when reported.
    write(&sb.live, "/app/README", b"uncommitted\n");
    write(&sb.live, "/app/scratch/tmp.txt", b"junk\n");
    let uncommitted = [m("/app/README"), c("/app/scratch")];
    sb.store
        .rollback_in_place(&RollbackRequest {
            container: "c1",
            to_turn: 1,
            root: &sb.live,
            base: None,
            uncommitted: &uncommitted,
        })
        .unwrap();
    assert_same_tree(&sb.live, &at_turn1);

    // Going back to turn 0 needs the base for /app/README, which no checkpoint holds.
    let err = sb
        .store
        .rollback_in_place(&RollbackRequest {
            container: "c1",
            to_turn: 0,
            root: &sb.live,
            base: None,
            uncommitted: &[],
        })
        .unwrap_err();
    assert!(matches!(err, CheckpointError::NoBaseState { ref path, turn: 0 } if path == "/app/README"), "{err}");
    assert_same_tree(&sb.live, &at_turn1);
}

// ---------- dedup and traffic ----------

#[test]
fn identical_content_is_stored_once_across_turns_and_containers() {
    let sb = Sandbox::new();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    write(&sb.live, "/app/big.bin", &big);
    let first = sb.commit("a", 1, &[c("/app/big.bin")]);
    assert!(first.traffic.written_bytes >= big.len() as u64);

    // Same content under a new name in the next turn: no new blob bytes.
    write(&sb.live, "/app/copy.bin", &big);
    let second = sb.commit("a", 2, &[c("/app/copy.bin")]);
    assert_eq!(second.traffic.written_bytes, 0, "{:?}", second.traffic);
    assert_eq!(second.traffic.logical_bytes, big.len() as u64);

    // Another container writing the same file shares the blob too.
    let other = sb.commit("b", 1, &[c("/app/big.bin")]);
    assert_eq!(other.traffic.written_bytes, 0);

    let total = sb.store.blobs().traffic();
    assert_eq!(total.logical_bytes, 3 * big.len() as u64);
    assert_eq!(total.written_bytes, big.len() as u64);
}

/// The store holds sandboxes' files, environment and memory: nothing in it is readable by
/// another host user, including a store an older build made world-readable.
#[test]
fn the_store_is_root_s_alone() {
    use std::os::unix::fs::PermissionsExt;
    let sb = Sandbox::new();
    write(&sb.live, "/app/secret.txt", b"sandbox secret");
    sb.commit("a", 1, &[c("/app/secret.txt")]);
    // An older store's modes: opening it again closes it.
    fs::set_permissions(&sb.state, fs::Permissions::from_mode(0o755)).unwrap();
    let store = CheckpointStore::open(&sb.state).unwrap();
    drop(store);
    let mut seen = 0;
    let mut stack = vec![sb.state.clone()];
    while let Some(path) = stack.pop() {
        let md = fs::symlink_metadata(&path).unwrap();
        if md.file_type().is_symlink() {
            continue;
        }
        let mode = md.permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{} is {mode:o}: readable by other users", path.display());
        seen += 1;
        if md.is_dir() {
            stack.extend(fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        }
    }
    assert!(seen > 256, "walked only {seen} entries");
}

// ---------- capture and write-out ----------

/// The next turn may change files as soon as a turn is staged: what is published later is the
/// state at the capture. Nothing is visible before the publish, a dropped staged turn leaves
/// nothing behind, and GC waits for a staged turn instead of deleting its blobs.
#[test]
fn a_staged_turn_publishes_the_state_at_its_capture() {
    let sb = Sandbox::new();
    write(&sb.live, "/app/notes.txt", b"turn one");
    let one = sb
        .store
        .stage_turn(&TurnInput {
            container: "s",
            turn: 1,
            rootfs: Some(&sb.live),
            changed: &[c("/app/notes.txt")],
            criu_images: None,
        })
        .unwrap();
    assert_eq!(one.staged_bytes(), 8);
    // The next turn runs while turn 1 waits for its write-out.
    write(&sb.live, "/app/notes.txt", b"turn two!");
    let two = sb
        .store
        .stage_turn(&TurnInput {
            container: "s",
            turn: 2,
            rootfs: Some(&sb.live),
            changed: &[m("/app/notes.txt")],
            criu_images: None,
        })
        .unwrap();
    assert_eq!(sb.store.head("s").unwrap(), None, "nothing is visible before a publish");

    // GC needs the store to itself: it waits until the staged turns are published.
    let gc = std::thread::spawn({
        let state = sb.state.clone();
        move || CheckpointStore::open(state).unwrap().gc(&RetentionPolicy { keep_last: 10 }).unwrap()
    });
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!gc.is_finished(), "GC waits for staged turns");
    let first = sb.store.publish(one).unwrap();
    let second = sb.store.publish(two).unwrap();
    assert_eq!((first.turn, second.turn), (1, 2));
    assert_eq!(gc.join().unwrap().blobs_removed, 0);

    for (turn, content) in [(1, &b"turn one"[..]), (2, &b"turn two!"[..])] {
        let target = sb.fresh_target(&format!("t{turn}"));
        sb.store.materialize("s", turn, &target).unwrap();
        assert_eq!(fs::read(target.join("app/notes.txt")).unwrap(), content);
    }

    // A staged turn that is never published leaves neither blobs nor tmp files.
    write(&sb.live, "/app/notes.txt", b"abandoned");
    let abandoned = sb
        .store
        .stage_turn(&TurnInput {
            container: "s",
            turn: 3,
            rootfs: Some(&sb.live),
            changed: &[m("/app/notes.txt")],
            criu_images: None,
        })
        .unwrap();
    drop(abandoned);
    assert_eq!(fs::read_dir(sb.state.join("tmp")).unwrap().count(), 0);
    assert!(!sb.store.blobs().contains(&crab_store::Digest::of(b"abandoned")));
    assert_eq!(sb.store.head("s").unwrap().map(|h| h.turn), Some(2));

    // Turns publish in order: a staged turn older than the head is refused by name.
    write(&sb.live, "/app/notes.txt", b"late");
    let late = sb
        .store
        .stage_turn(&TurnInput {
            container: "s",
            turn: 4,
            rootfs: Some(&sb.live),
            changed: &[m("/app/notes.txt")],
            criu_images: None,
        })
        .unwrap();
    sb.commit("s", 5, &[m("/app/notes.txt")]);
    let err = sb.store.publish(late).unwrap_err();
    assert!(matches!(err, CheckpointError::TurnNotAfterHead { turn: 4, head: 5, .. }), "{err}");
}

// ---------- integrity ----------

#[test]
fn corrupt_blob_is_refused_before_anything_is_written() {
    let sb = Sandbox::new();
    write(&sb.live, "/app/one", b"first file\n");
    write(&sb.live, "/app/two", b"second file\n");
    sb.commit("c1", 1, &[c("/app/one"), c("/app/two")]);
    let (_, manifest) = sb.store.manifest_at("c1", 1).unwrap();
    let blob = *manifest.fs_delta.iter().find(|e| e.path.to_string() == "/app/two").unwrap().node.blob().unwrap();
    let blob_path = overwrite_blob(&sb.store, &blob, b"second filf\n");

    let target = sb.fresh_target("restored");
    let err = sb.store.materialize("c1", 1, &target).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CheckpointError::CorruptBlob { .. }), "{text}");
    assert!(text.contains(&blob.to_hex()) && text.contains(&blob_path.display().to_string()), "{text}");
    assert!(!target.join("app/one").exists(), "nothing restored from a corrupt checkpoint");
    assert!(matches!(sb.store.verify("c1", 1), Err(CheckpointError::CorruptBlob { .. })));

    remove_blob(&sb.store, &blob);
    let err = sb.store.materialize("c1", 1, &target).unwrap_err();
    assert!(matches!(err, CheckpointError::MissingBlob { .. }), "{err}");
}

/// Makes a stored blob gone: its file, or for a packed blob its pack and the pack's table (with
/// the other blobs in it).
fn remove_blob(store: &CheckpointStore, digest: &crab_store::Digest) {
    match store.blobs().location(digest).unwrap() {
        crab_store::BlobLocation::File(path) => fs::remove_file(path).unwrap(),
        crab_store::BlobLocation::Packed { pack, .. } => {
            fs::remove_file(pack.with_extension("idx")).unwrap();
            fs::remove_file(pack).unwrap();
        }
    }
}

/// What a puller of the remote tier does with `from`'s chain of `container`: every object `into`
/// lacks through one batch under the writer lock, then the manifests. Returns the lock (held
/// until the head is set), the objects the batch stored from bytes it hashed, and the head.
fn pull_chain_into(
    from: &CheckpointStore,
    container: &str,
    into: &CheckpointStore,
) -> (crab_store::WriterLock, std::collections::HashSet<crab_store::Digest>, crab_store::Head) {
    let exported = from.export_chain(container).unwrap();
    let writing = into.writer_lock().unwrap();
    let mut batch = into.blobs().batch();
    let mut hashed = std::collections::HashSet::new();
    for object in exported.iter().flat_map(|turn| &turn.objects) {
        if into.blobs().contains(object) {
            continue;
        }
        let stored = batch.put_bytes(&from.blobs().read(object).unwrap()).unwrap();
        assert_eq!(stored, *object);
        if batch.wrote(&stored) {
            hashed.insert(stored);
        }
    }
    batch.commit().unwrap();
    for turn in &exported {
        into.import_manifest(&turn.sealed).unwrap();
    }
    let newest = exported.last().unwrap();
    (writing, hashed, crab_store::Head { manifest: newest.manifest_id, turn: newest.turn })
}

#[test]
fn an_import_reads_back_only_the_blobs_it_did_not_hash_as_it_wrote_them() {
    let a = Sandbox::new();
    write(&a.live, "/app/one", b"first file\n");
    // A file of its own in the store (past what goes into packs): removed alone below.
    let second: Vec<u8> = b"second file\n".iter().copied().cycle().take(100_000).collect();
    write(&a.live, "/app/two", &second);
    a.commit("box", 1, &[c("/app/one"), c("/app/two")]);
    let (_, manifest) = a.store.manifest_at("box", 1).unwrap();
    let blob_of =
        |path: &str| *manifest.fs_delta.iter().find(|e| e.path.to_string() == path).unwrap().node.blob().unwrap();
    let (one, two) = (blob_of("/app/one"), blob_of("/app/two"));

    // Node B holds /app/one's blob already (another sandbox's checkpoint), and its copy has
    // rotted on disk since: the pull skips it, so the import must read it.
    let b = Sandbox::new();
    write(&b.live, "/app/one", b"first file\n");
    b.commit("other", 1, &[c("/app/one")]);
    overwrite_blob(&b.store, &one, b"first filf\n");
    let (writing, hashed, head) = pull_chain_into(&a.store, "box", &b.store);
    assert!(hashed.contains(&two) && !hashed.contains(&one), "{hashed:?}");
    let err = b.store.import_head_over("box", head, None, &hashed).unwrap_err();
    assert!(matches!(err, CheckpointError::CorruptBlob { .. }) && err.to_string().contains(&one.to_hex()), "{err}");
    assert_eq!(b.store.head("box").unwrap(), None, "no head over a chain with a corrupt blob");

    // With that copy sound, the blobs the pull hashed as it wrote them are not read back: one
    // that changed on disk after its write is taken (present is all that is checked)...
    overwrite_blob(&b.store, &one, b"first file\n");
    overwrite_blob(&b.store, &two, &[&second[..99_999], b"X"].concat());
    b.store.import_head_over("box", head, None, &hashed).unwrap();
    drop(writing);
    assert_eq!(b.store.head("box").unwrap(), Some(head));
    // ... and a restore, which hashes every blob it copies, refuses it before writing a byte.
    let target = b.fresh_target("restored");
    let err = b.store.materialize("box", 1, &target).unwrap_err();
    assert!(matches!(err, CheckpointError::CorruptBlob { .. }) && err.to_string().contains(&two.to_hex()), "{err}");

    // A hashed blob that is gone is refused by name.
    let c_ = Sandbox::new();
    let (writing, hashed, head) = pull_chain_into(&a.store, "box", &c_.store);
    remove_blob(&c_.store, &two);
    let err = c_.store.import_head_over("box", head, None, &hashed).unwrap_err();
    assert!(matches!(err, CheckpointError::MissingBlob { .. }) && err.to_string().contains(&two.to_hex()), "{err}");
    drop(writing);
}

#[test]
fn tampered_or_missing_manifests_break_the_chain_loudly() {
    let sb = Sandbox::new();
    sb.commit("c1", 1, &[]);
    write(&sb.live, "/app/f", b"f");
    let second = sb.commit("c1", 2, &[c("/app/f")]);
    let (first_id, _) = sb.store.manifest_at("c1", 1).unwrap();

    // A fresh store instance has no cache: everything comes from disk.
    let manifest_path = sb.state.join("manifests").join(format!("{first_id}.json"));
    fs::remove_file(&manifest_path).unwrap();
    let reopened = CheckpointStore::open(&sb.state).unwrap();
    let err = reopened.history("c1").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CheckpointError::BrokenChain { .. }), "{text}");
    assert!(text.contains(&first_id.to_hex()) && text.contains("turn 1"), "{text}");

    let head_path = sb.state.join("manifests").join(format!("{}.json", second.id));
    let bytes = fs::read_to_string(&head_path).unwrap().replace("\"turn\":2", "\"turn\":3");
    fs::write(&head_path, bytes).unwrap();
    let err = CheckpointStore::open(&sb.state).unwrap().history("c1").unwrap_err();
    assert!(matches!(err, CheckpointError::CorruptManifest { .. }), "{err}");
}

#[test]
fn leftovers_of_a_crashed_commit_are_invisible_and_collected() {
    let sb = Sandbox::new();
    sb.commit("c1", 1, &[]);
    let head = sb.store.head("c1").unwrap().unwrap();
    // What a crash mid-commit leaves: blob and manifest tmp files, and an orphan manifest that
    // was published but never made the head.
    fs::write(sb.state.join("tmp/blob-999-0"), b"half a blob").unwrap();
    fs::write(sb.state.join("tmp/manifest-999-1"), b"{\"sha256\":").unwrap();
    write(&sb.live, "/app/orphan", b"orphan");
    sb.commit("c2", 1, &[c("/app/orphan")]);
    let orphan = sb.store.head("c2").unwrap().unwrap();
    fs::remove_dir_all(sb.state.join("containers/crab/c2")).unwrap();

    let reopened = CheckpointStore::open(&sb.state).unwrap();
    assert_eq!(reopened.head("c1").unwrap(), Some(head));
    assert_eq!(reopened.history("c1").unwrap().len(), 1);
    assert!(matches!(reopened.history("c2"), Err(CheckpointError::NoSuchContainer(_))));

    let gc = reopened.gc(&RetentionPolicy { keep_last: 5 }).unwrap();
    assert_eq!(gc.tmp_files_removed, 2);
    assert_eq!(gc.manifests_removed, 1);
    assert!(gc.blobs_removed >= 1);
    assert!(!sb.state.join("manifests").join(format!("{}.json", orphan.manifest)).exists());
    assert_eq!(reopened.history("c1").unwrap().len(), 1);
}

// ---------- untrusted paths ----------

#[test]
fn escaping_paths_are_refused() {
    let sb = Sandbox::new();
    let outside = sb._tmp.path().join("outside");
    write(&outside, "/secret", b"host secret\n");
    symlink(&outside, sb.live.join("evil-abs")).unwrap();
    symlink("../outside", sb.live.join("evil-rel")).unwrap();
    fs::create_dir_all(sb.live.join("app/inner")).unwrap();
    symlink("../../../outside", sb.live.join("app/inner/up")).unwrap();

    let cases = [
        "/../outside/secret",
        "/app/../../outside/secret",
        "/evil-abs/secret",
        "/evil-rel/secret",
        "/app/inner/up/secret",
        "relative",
    ];
    for path in cases {
        let err = sb
            .store
            .commit_turn(&TurnInput {
                container: "c1",
                turn: 1,
                rootfs: Some(&sb.live),
                changed: &[m(path)],
                criu_images: None,
            })
            .unwrap_err();
        assert!(
            matches!(err, CheckpointError::UnsafePath { .. } | CheckpointError::OutsideRoot { .. }),
            "{path}: {err}"
        );
    }
    assert!(sb.store.head("c1").unwrap().is_none(), "a refused capture publishes nothing");

    // The symlink itself is recorded as a symlink, not followed.
    sb.commit("c1", 1, &[c("/evil-abs")]);
    let (_, manifest) = sb.store.manifest_at("c1", 1).unwrap();
    assert!(matches!(manifest.fs_delta[0].node, crab_store::FsNode::Symlink { .. }));

    // Restoring into a root where a recorded directory is now a symlink to the outside replaces
    // the symlink itself; nothing is written through it.
    write(&sb.live, "/app/data/file", b"inside\n");
    sb.commit("c1", 2, &[c("/app/data")]);
    let target = sb.fresh_target("restored");
    symlink(&outside, target.join("app/data")).unwrap();
    sb.store.materialize("c1", 2, &target).unwrap();
    assert!(fs::symlink_metadata(target.join("app/data")).unwrap().is_dir());
    assert_eq!(fs::read(target.join("app/data/file")).unwrap(), b"inside\n");
    assert_eq!(fs::read(outside.join("secret")).unwrap(), b"host secret\n");
    assert!(!outside.join("file").exists());
}

#[test]
fn restore_never_writes_through_a_symlinked_parent() {
    let sb = Sandbox::new();
    let outside = sb._tmp.path().join("outside");
    write(&outside, "/keep", b"keep\n");
    write(&sb.live, "/app/cfg/settings", b"v1\n");
    sb.commit("c1", 1, &[c("/app/cfg")]);
    write(&sb.live, "/app/cfg/settings", b"v2\n");
    sb.commit("c1", 2, &[m("/app/cfg/settings")]);

    // The live root's /app/cfg is swapped for a symlink pointing out of the root.
    fs::remove_dir_all(sb.live.join("app/cfg")).unwrap();
    symlink(&outside, sb.live.join("app/cfg")).unwrap();
    let err = sb
        .store
        .rollback_in_place(&RollbackRequest {
            container: "c1",
            to_turn: 1,
            root: &sb.live,
            base: Some(&sb.base),
            uncommitted: &[m("/app/cfg/settings")],
        })
        .unwrap_err();
    assert!(matches!(err, CheckpointError::OutsideRoot { .. }), "{err}");
    assert!(!outside.join("settings").exists());
    assert_eq!(fs::read(outside.join("keep")).unwrap(), b"keep\n");
}

// ---------- CRIU images ----------

fn synthetic_dump(dir: &Path, seed: u32) {
    fs::create_dir_all(dir).unwrap();
    let mut pages: Vec<u8> = (0..2 * 1024 * 1024u32).map(|i| (i.wrapping_mul(2246822519) >> 11) as u8).collect();
    pages.extend(std::iter::repeat_n(0u8, 64 * 4096));
    pages.extend_from_slice(&[7u8; 1000]); // a page file whose size is not a chunk multiple
    fs::write(dir.join("pages-1.img"), &pages).unwrap();
    fs::write(dir.join("pagemap-1.img"), b"pagemap bytes").unwrap();
    fs::write(dir.join("core-1.img"), format!("core {seed}")).unwrap();
    fs::write(dir.join("pages-2.img"), b"").unwrap();
}

fn assert_same_dir(a: &Path, b: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<_> = fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        v.sort();
        v
    };
    assert_eq!(list(a), list(b));
    for name in list(a) {
        assert_eq!(fs::read(a.join(&name)).unwrap(), fs::read(b.join(&name)).unwrap(), "{name:?}");
        let (ma, mb) = (fs::metadata(a.join(&name)).unwrap(), fs::metadata(b.join(&name)).unwrap());
        assert_eq!(ma.mode() & 0o7777, mb.mode() & 0o7777, "{name:?}");
    }
}

#[test]
fn chunked_images_round_trip_and_second_dump_is_nearly_free() {
    let sb = Sandbox::new();
    let (d1, d2) = (sb._tmp.path().join("dump1"), sb._tmp.path().join("dump2"));
    synthetic_dump(&d1, 1);
    synthetic_dump(&d2, 2);
    let commit = |turn, dir: &Path| {
        sb.store
            .commit_turn(&TurnInput { container: "c1", turn, rootfs: None, changed: &[], criu_images: Some(dir) })
            .unwrap()
    };
    let first = commit(1, &d1);
    assert_eq!(first.class, TurnClass::Proc);
    let second = commit(2, &d2);
    let ratio = second.traffic.written_bytes as f64 / second.traffic.logical_bytes as f64;
    assert!(ratio <= 0.05, "second dump wrote {ratio:.4} of its bytes: {:?}", second.traffic);
    assert!(second.manifest_bytes < 4096, "manifest of an image set stays small: {}", second.manifest_bytes);

    for (turn, dir) in [(1, &d1), (2, &d2)] {
        let out = sb._tmp.path().join(format!("restored{turn}"));
        assert_eq!(sb.store.restore_images("c1", turn, &out).unwrap(), Some(turn));
        assert_same_dir(&out, dir);
    }
    // A later fs turn restores the images of the newest proc turn before it.
    write(&sb.live, "/app/x", b"x");
    sb.commit("c1", 3, &[c("/app/x")]);
    let out = sb._tmp.path().join("restored3");
    assert_eq!(sb.store.restore_images("c1", 3, &out).unwrap(), Some(2));
}

/// A page image of several reassembly jobs (thousands of chunks, repeated zero pages spread
/// over them, a short last chunk) comes back byte for byte; a corrupt chunk, unique or
/// repeated, is refused by name and leaves no image directory behind.
#[test]
fn large_page_images_reassemble_exactly_and_refuse_a_corrupt_chunk() {
    let sb = Sandbox::new();
    let dump = sb._tmp.path().join("dump");
    fs::create_dir_all(&dump).unwrap();
    let page = 4096usize;
    let mut pages = Vec::new();
    for i in 0..3000usize {
        if i % 7 == 0 {
            pages.extend(std::iter::repeat_n(0u8, page));
        } else {
            pages.extend((0..page).map(|j| (((i * page + j) as u32).wrapping_mul(2654435761) >> 13) as u8));
        }
    }
    pages.extend_from_slice(&[9u8; 123]);
    fs::write(dump.join("pages-1.img"), &pages).unwrap();
    fs::write(dump.join("core-1.img"), b"core").unwrap();
    fs::set_permissions(dump.join("core-1.img"), fs::Permissions::from_mode(0o640)).unwrap();
    sb.store
        .commit_turn(&TurnInput { container: "c1", turn: 1, rootfs: None, changed: &[], criu_images: Some(&dump) })
        .unwrap();
    let out = sb._tmp.path().join("restored");
    assert_eq!(sb.store.restore_images("c1", 1, &out).unwrap(), Some(1));
    assert_same_dir(&out, &dump);
    let (_, report) = sb.store.restore_images_report("c1", 1, &sb._tmp.path().join("restored-again")).unwrap().unwrap();
    assert_eq!(report.chunks, 3001);
    assert!(report.chunks_read < report.chunks, "repeated zero pages are read once per worker: {report:?}");

    // The chunks themselves, not the copy the commit kept assembled (tested below).
    fs::remove_dir_all(sb.state.join("assembled")).unwrap();
    let unique = page * 2048; // in the second job of 1024 chunks
    let zero = page * 7 * 200;
    for (offset, len) in [(unique, page), (zero, page)] {
        let digest = crab_store::Digest::of(&pages[offset..offset + len]);
        let good = sb.store.blobs().read(&digest).unwrap();
        let mut bad = good.clone();
        bad[100] ^= 1;
        overwrite_blob(&sb.store, &digest, &bad);
        let out = sb._tmp.path().join(format!("refused-{offset}"));
        let err = sb.store.restore_images("c1", 1, &out).unwrap_err();
        assert!(
            matches!(err, CheckpointError::CorruptBlob { .. }) && err.to_string().contains(&digest.to_hex()),
            "{err}"
        );
        assert!(!out.exists(), "no image directory from a corrupt checkpoint");
        let partial = sb._tmp.path().join(format!("refused-{offset}.partial"));
        assert!(!partial.exists(), "the partial directory is removed");
        overwrite_blob(&sb.store, &digest, &good);
    }
}

/// The kept copy of container `c`'s newest process checkpoint.
fn kept_dir(sb: &Sandbox, container: &str) -> PathBuf {
    let owner = sb.state.join("assembled").join(crab_store::DEFAULT_NAMESPACE).join(container);
    let mut dirs: Vec<PathBuf> = fs::read_dir(&owner)
        .unwrap_or_else(|e| panic!("{}: {e}", owner.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with(".dump-"))
        .collect();
    assert_eq!(dirs.len(), 1, "one kept image set per container: {dirs:?}");
    dirs.pop().unwrap()
}

fn commit_dump(sb: &Sandbox, container: &str, turn: u64, dump: &Path) {
    sb.store.commit_turn(&TurnInput { container, turn, rootfs: None, changed: &[], criu_images: Some(dump) }).unwrap();
}

/// The newest process checkpoint's image files are kept as CRIU wrote them (linked, not
/// copied), and a restore checks them against the manifest and links them: no chunk is read.
/// Only the newest is kept; an older turn, a fork's restore after the source moved on, and a
/// removed container fall back to (or lose) the kept copy as they should.
#[test]
fn newest_images_are_kept_assembled_and_restored_by_link_after_a_check() {
    let sb = Sandbox::new();
    let (d1, d2) = (sb._tmp.path().join("dump1"), sb._tmp.path().join("dump2"));
    synthetic_dump(&d1, 1);
    synthetic_dump(&d2, 2);
    commit_dump(&sb, "c1", 1, &d1);
    let kept1 = kept_dir(&sb, "c1");
    assert_eq!(
        fs::metadata(kept1.join("pages-1.img")).unwrap().ino(),
        fs::metadata(d1.join("pages-1.img")).unwrap().ino(),
        "kept by a hard link to CRIU's own file"
    );
    let out = sb._tmp.path().join("restored1");
    let (turn, report) = sb.store.restore_images_report("c1", 1, &out).unwrap().unwrap();
    assert_eq!(turn, 1);
    assert!(report.assembled, "{report:?}");
    assert_eq!(report.chunks_read, 0, "{report:?}");
    assert!(report.chunks > 500, "{report:?}");
    assert_same_dir(&out, &d1);
    // CRIU reads the dump's own bytes: nothing was copied.
    assert_eq!(
        fs::metadata(out.join("pages-1.img")).unwrap().ino(),
        fs::metadata(d1.join("pages-1.img")).unwrap().ino()
    );
    // The engine removes its dump directory once published: the kept copy stays.
    fs::remove_dir_all(&d1).unwrap();
    let out = sb._tmp.path().join("restored1-again");
    assert!(sb.store.restore_images_report("c1", 1, &out).unwrap().unwrap().1.assembled);

    // A fork restores its source's kept copy too.
    sb.store.fork("c1", 1, "f1").unwrap();
    let out = sb._tmp.path().join("restored-fork");
    assert!(sb.store.restore_images_report("f1", 1, &out).unwrap().unwrap().1.assembled);

    // A newer process checkpoint replaces the kept copy.
    commit_dump(&sb, "c1", 2, &d2);
    let kept2 = kept_dir(&sb, "c1");
    assert_ne!(kept1, kept2);
    assert!(!kept1.exists());
    let out = sb._tmp.path().join("restored2");
    assert!(sb.store.restore_images_report("c1", 2, &out).unwrap().unwrap().1.assembled);
    assert_same_dir(&out, &d2);
    // Turn 1 is no longer kept: reassembled from its chunks, the same bytes.
    let out = sb._tmp.path().join("restored1-chunks");
    let (_, report) = sb.store.restore_images_report("c1", 1, &out).unwrap().unwrap();
    assert!(!report.assembled && report.chunks_read > 0, "{report:?}");
    synthetic_dump(&d1, 1);
    assert_same_dir(&out, &d1);

    // A removed container takes its kept copy along; GC drops the copy of a gone checkpoint.
    sb.store.remove_container("c1").unwrap();
    assert!(!sb.state.join("assembled/crab/c1").exists());
    commit_dump(&sb, "c2", 1, &d1);
    let kept_c2 = kept_dir(&sb, "c2");
    sb.store.remove_container("c2").unwrap();
    fs::create_dir_all(&kept_c2).unwrap(); // as if a crash had left it behind
    let report = sb.store.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!(report.assembled_removed, 1, "{report:?}");
    assert!(!kept_c2.exists());
}

/// A dump on another file system than the store is not kept (a copy would write the whole
/// image set again): the restore reassembles from the chunks.
#[test]
fn a_dump_on_another_file_system_is_not_kept() {
    let sb = Sandbox::new();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    if fs::metadata(shm.path()).unwrap().dev() == fs::metadata(&sb.state).unwrap().dev() {
        eprintln!("/dev/shm is on the store's file system here: nothing to test");
        return;
    }
    let dump = shm.path().join("dump");
    synthetic_dump(&dump, 1);
    commit_dump(&sb, "c1", 1, &dump);
    let owner = sb.state.join("assembled/crab/c1");
    assert!(
        !owner.exists() || fs::read_dir(&owner).unwrap().next().is_none(),
        "nothing kept: {:?}",
        fs::read_dir(&owner).map(|d| d.map(|e| e.unwrap().file_name()).collect::<Vec<_>>())
    );
    let out = sb._tmp.path().join("restored");
    let (_, report) = sb.store.restore_images_report("c1", 1, &out).unwrap().unwrap();
    assert!(!report.assembled && report.chunks_read > 0, "{report:?}");
    assert_same_dir(&out, &dump);

    // The other way round: a copy kept on the store's file system cannot serve a restore into
    // a directory elsewhere (only a hard link does: CRIU reads images from inside the
    // container's mount namespace, where a symbolic link to a host path leads nowhere). The
    // chunks restore it, and the copy stays for a restore on its own file system.
    let local = sb._tmp.path().join("dump-local");
    synthetic_dump(&local, 2);
    commit_dump(&sb, "c2", 1, &local);
    let out = shm.path().join("restored-elsewhere");
    let (_, report) = sb.store.restore_images_report("c2", 1, &out).unwrap().unwrap();
    assert!(!report.assembled && report.chunks_read > 0, "{report:?}");
    assert!(!fs::symlink_metadata(out.join("pages-1.img")).unwrap().file_type().is_symlink());
    assert_same_dir(&out, &local);
    let out = sb._tmp.path().join("restored-here");
    assert!(sb.store.restore_images_report("c2", 1, &out).unwrap().unwrap().1.assembled, "the copy was kept");
}

/// With the kept copies in a directory of their own (a tmpfs, as `/run` is on a node), the
/// store's `assembled` entry links there, the engine's dumps are written there too (so keeping
/// one is a hard link, whatever file system the store is on), and every opener of the store
/// (crabctl opens it without the config) finds them. After a reboot has emptied that
/// directory the store opens as before; copies beyond the bound are not kept.
#[test]
fn kept_copies_live_beside_the_dumps_in_a_directory_of_their_own() {
    let sb = Sandbox::new();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let kept = KeptImages { dir: Some(shm.path().join("kept")), max_bytes: u64::MAX };
    let store = CheckpointStore::open_with(&sb.state, &kept).unwrap();
    let link = fs::read_link(sb.state.join("assembled")).expect("assembled is a link");
    assert!(link.starts_with(shm.path().join("kept")), "{}", link.display());
    assert_eq!(fs::metadata(&link).unwrap().mode() & 0o777, 0o700, "root's alone");
    // Opening it again with the same settings leaves the link as it is.
    drop(CheckpointStore::open_with(&sb.state, &kept).unwrap());
    assert_eq!(fs::read_link(sb.state.join("assembled")).unwrap(), link);

    let dump = store.dump_path("c1", 1).unwrap();
    let dump_home = fs::canonicalize(dump.parent().unwrap()).unwrap();
    assert!(dump_home.starts_with(&link), "the dump is written beside the kept copies: {}", dump_home.display());
    synthetic_dump(&dump, 1);
    store
        .commit_turn(&TurnInput { container: "c1", turn: 1, rootfs: None, changed: &[], criu_images: Some(&dump) })
        .unwrap();
    let kept1 = kept_dir(&sb, "c1");
    assert_eq!(
        fs::metadata(kept1.join("pages-1.img")).unwrap().ino(),
        fs::metadata(dump.join("pages-1.img")).unwrap().ino(),
        "kept by a hard link"
    );
    assert!(dump.exists(), "the dump in flight is not taken for an old copy");
    fs::remove_dir_all(&dump).unwrap();
    // A plain open follows the link: a restore beside the copy links it after its check.
    let plain = CheckpointStore::open(&sb.state).unwrap();
    let out = plain.restore_path("r1").unwrap();
    let (_, report) = plain.restore_images_report("c1", 1, &out).unwrap().unwrap();
    assert!(report.assembled && report.chunks_read == 0, "{report:?}");
    synthetic_dump(&sb._tmp.path().join("expected"), 1);
    assert_same_dir(&out, &sb._tmp.path().join("expected"));
    // Restored elsewhere (another file system), the chunks serve and the copy stays.
    let (_, report) = plain.restore_images_report("c1", 1, &sb._tmp.path().join("restored")).unwrap().unwrap();
    assert!(!report.assembled, "{report:?}");
    assert_same_dir(&sb._tmp.path().join("restored"), &sb._tmp.path().join("expected"));
    assert!(kept1.exists());

    // A dead shim's dump is removed when the container's engine starts again.
    let stale = store.dump_path("c1", 2).unwrap();
    synthetic_dump(&stale, 2);
    store.remove_stale_dumps("c1");
    assert!(!stale.exists() && kept1.exists());

    // A bound smaller than the dump: nothing kept, the chunks restore it.
    let bounded = CheckpointStore::open_with(&sb.state, &KeptImages { max_bytes: 1 << 20, ..kept.clone() }).unwrap();
    let dump2 = bounded.dump_path("c2", 1).unwrap();
    synthetic_dump(&dump2, 2);
    bounded
        .commit_turn(&TurnInput { container: "c2", turn: 1, rootfs: None, changed: &[], criu_images: Some(&dump2) })
        .unwrap();
    let c2_sets: Vec<_> = fs::read_dir(sb.state.join("assembled/crab/c2"))
        .unwrap()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(c2_sets.is_empty(), "over the bound: not kept");
    let (_, report) = bounded.restore_images_report("c2", 1, &sb._tmp.path().join("restored2")).unwrap().unwrap();
    assert!(!report.assembled && report.chunks_read > 0, "{report:?}");

    // A reboot empties the tmpfs: the store opens, restores from its chunks, and keeps again.
    fs::remove_dir_all(shm.path().join("kept")).unwrap();
    let after_reboot = CheckpointStore::open_with(&sb.state, &kept).unwrap();
    let (_, report) = after_reboot.restore_images_report("c1", 1, &sb._tmp.path().join("restored3")).unwrap().unwrap();
    assert!(!report.assembled, "{report:?}");
    assert_same_dir(&sb._tmp.path().join("restored3"), &sb._tmp.path().join("expected"));
    assert!(CheckpointStore::open(&sb.state).is_ok(), "a plain open too");
}

/// The bound on kept copies counts every container's copy by the bytes recorded beside it when
/// it was kept: a publish reads one small file per copy on the node, not a stat of each of
/// their image files. A copy kept by an older build, without that record, counts by its files.
/// Stores that share a kept images directory (a node's `/run/crab/kept-images`) each have a
/// directory there named by a hash; when a store's state directory is deleted (a test's
/// temporary store, a node moved to another `state_dir`), any other store's GC removes its
/// copies, which on a tmpfs would hold memory until a reboot. Live stores' directories, and
/// one that does not say whose it is, stay.
#[test]
fn gc_removes_the_kept_copies_of_a_store_that_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let kept = KeptImages { dir: Some(tmp.path().join("kept")), max_bytes: u64::MAX };
    let open = |name: &str| CheckpointStore::open_with(tmp.path().join(name), &kept).unwrap();
    let (a, b, c) = (open("a"), open("b"), open("c"));
    let kept_dir_of = |name: &str| fs::read_link(tmp.path().join(name).join("assembled")).unwrap();
    let (own, gone, live) = (kept_dir_of("a"), kept_dir_of("b"), kept_dir_of("c"));
    for dir in [&own, &gone, &live] {
        fs::create_dir_all(dir.join("default/box/copy")).unwrap();
        fs::write(dir.join("default/box/copy/pages-1.img"), vec![7u8; 4096]).unwrap();
    }
    let unnamed = tmp.path().join("kept/0123456789abcdef");
    fs::create_dir_all(unnamed.join("default")).unwrap();
    drop((b, c));
    fs::remove_dir_all(tmp.path().join("b")).unwrap();

    let report = a.gc(&RetentionPolicy { keep_last: 16 }).unwrap();
    assert_eq!(report.orphaned_kept_removed, 1, "{report:?}");
    assert!(!gone.exists(), "the deleted store's copies are removed");
    assert!(live.join("default/box/copy/pages-1.img").is_file(), "a live store's copies stay");
    assert!(own.is_dir() && unnamed.is_dir());
    // Opened again, a store finds its directory still its own: nothing more goes.
    drop(open("c"));
    assert_eq!(a.gc(&RetentionPolicy { keep_last: 16 }).unwrap().orphaned_kept_removed, 0);
    assert!(live.is_dir());
}

/// A shim opens its store from several tasks at once: every one of many simultaneous first
/// opens succeeds, and the store's kept directory names it once, with no temporary left.
#[test]
fn simultaneous_first_opens_all_succeed_and_name_the_store_once() {
    for round in 0..20 {
        let tmp = tempfile::tempdir().unwrap();
        let kept = KeptImages { dir: Some(tmp.path().join("kept")), max_bytes: u64::MAX };
        let state = tmp.path().join(format!("state-{round}"));
        let barrier = std::sync::Barrier::new(8);
        std::thread::scope(|scope| {
            let opens: Vec<_> = (0..8)
                .map(|_| {
                    scope.spawn(|| {
                        barrier.wait();
                        CheckpointStore::open_with(&state, &kept).map(drop)
                    })
                })
                .collect();
            for open in opens {
                open.join().unwrap().unwrap();
            }
        });
        let own = fs::read_link(state.join("assembled")).unwrap();
        let names: Vec<String> =
            fs::read_dir(&own).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names, [".state-dir"], "round {round}");
        assert_eq!(fs::read(own.join(".state-dir")).unwrap(), fs::canonicalize(&state).unwrap().as_os_str().as_bytes());
    }
}

#[test]
fn the_bound_on_kept_copies_counts_each_copy_by_its_recorded_bytes() {
    let sb = Sandbox::new();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    // A synthetic dump holds about 2.3 MiB: room for one kept copy, not for two.
    let kept = KeptImages { dir: Some(shm.path().join("kept")), max_bytes: 3 << 20 };
    let store = CheckpointStore::open_with(&sb.state, &kept).unwrap();
    let commit = |container: &str| {
        let dump = store.dump_path(container, 1).unwrap();
        synthetic_dump(&dump, 1);
        store
            .commit_turn(&TurnInput { container, turn: 1, rootfs: None, changed: &[], criu_images: Some(&dump) })
            .unwrap();
        fs::remove_dir_all(&dump).unwrap();
    };
    let copies = |container: &str| -> usize {
        fs::read_dir(sb.state.join("assembled").join(crab_store::DEFAULT_NAMESPACE).join(container))
            .unwrap()
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .count()
    };
    commit("c1");
    let c1 = kept_dir(&sb, "c1");
    let image_bytes: u64 = fs::read_dir(&c1)
        .unwrap()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(image_bytes > 2 << 20, "{image_bytes}");
    assert_eq!(fs::read_to_string(c1.join(".bytes")).unwrap(), image_bytes.to_string(), "recorded when kept");
    commit("c2");
    assert_eq!(copies("c2"), 0, "c1's copy leaves no room");
    // A copy kept before the record existed counts by its files.
    fs::remove_file(c1.join(".bytes")).unwrap();
    commit("c3");
    assert_eq!(copies("c3"), 0, "c1's copy, without a record, still leaves no room");
    // The record is what a publish reads: c1's recorded as empty leaves room for c4's copy.
    fs::write(c1.join(".bytes"), "0").unwrap();
    commit("c4");
    assert_eq!(copies("c4"), 1, "kept within the bound");
    // A restore from a kept copy hands CRIU the image files only.
    let out = store.restore_path("r4").unwrap();
    let (_, report) = store.restore_images_report("c4", 1, &out).unwrap().unwrap();
    assert!(report.assembled, "{report:?}");
    assert!(!out.join(".bytes").exists(), "the record stays beside the kept copy");
}

/// A kept copy that does not match the manifest (a flipped byte in a page image, a truncated
/// or swapped small file, a file missing, a symlink in place of a file) is refused and never
/// used: the restore reassembles from the chunks, byte for byte, and drops the bad copy. A
/// corrupt chunk behind a corrupt kept copy still fails the restore, naming the chunk.
#[test]
fn a_corrupted_kept_copy_is_refused_and_the_chunks_restore_instead() {
    type Damage = fn(&Path, &Path);
    let damages: [(&str, Damage); 5] = [
        ("flipped page byte", |kept, _| {
            let path = kept.join("pages-1.img");
            let mut bytes = fs::read(&path).unwrap();
            bytes[4096 * 300 + 17] ^= 0x40;
            // A new file under the same name: the dump's inode stays intact.
            fs::remove_file(&path).unwrap();
            fs::write(&path, &bytes).unwrap();
        }),
        ("truncated page image", |kept, _| {
            let path = kept.join("pages-1.img");
            let bytes = fs::read(&path).unwrap();
            fs::remove_file(&path).unwrap();
            fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
        }),
        ("swapped small file", |kept, _| {
            let path = kept.join("core-1.img");
            fs::remove_file(&path).unwrap();
            fs::write(&path, b"core 9").unwrap();
        }),
        ("missing file", |kept, _| fs::remove_file(kept.join("pagemap-1.img")).unwrap()),
        ("symlink to a file of the same content elsewhere", |kept, elsewhere| {
            let path = kept.join("core-1.img");
            let outside = elsewhere.join("outside-core");
            fs::copy(&path, &outside).unwrap();
            fs::remove_file(&path).unwrap();
            symlink(&outside, &path).unwrap();
        }),
    ];
    for (what, damage) in damages {
        let sb = Sandbox::new();
        let dump = sb._tmp.path().join("dump");
        synthetic_dump(&dump, 1);
        commit_dump(&sb, "c1", 1, &dump);
        let kept = kept_dir(&sb, "c1");
        damage(&kept, sb._tmp.path());
        let out = sb._tmp.path().join("restored");
        let (_, report) = sb.store.restore_images_report("c1", 1, &out).unwrap().unwrap();
        assert!(!report.assembled, "{what}: the damaged copy was used: {report:?}");
        assert!(report.chunks_read > 0, "{what}: {report:?}");
        assert_same_dir(&out, &dump);
        assert!(!kept.exists(), "{what}: the damaged copy is dropped");
        assert!(!sb._tmp.path().join("restored.partial").exists(), "{what}");
    }

    // Bad kept copy and a bad chunk: refused, naming the chunk, nothing left at the target.
    let sb = Sandbox::new();
    let dump = sb._tmp.path().join("dump");
    synthetic_dump(&dump, 1);
    commit_dump(&sb, "c1", 1, &dump);
    let kept = kept_dir(&sb, "c1");
    let pages = fs::read(dump.join("pages-1.img")).unwrap();
    let chunk = &pages[4096 * 10..4096 * 11];
    let digest = crab_store::Digest::of(chunk);
    let mut bad = chunk.to_vec();
    bad[1] ^= 1;
    overwrite_blob(&sb.store, &digest, &bad);
    let kept_pages = kept.join("pages-1.img");
    fs::remove_file(&kept_pages).unwrap();
    fs::write(&kept_pages, [&pages[..4096 * 10], &bad[..], &pages[4096 * 11..]].concat()).unwrap();
    let out = sb._tmp.path().join("refused");
    let err = sb.store.restore_images("c1", 1, &out).unwrap_err();
    assert!(matches!(err, CheckpointError::CorruptBlob { .. }) && err.to_string().contains(&digest.to_hex()), "{err}");
    assert!(!out.exists() && !sb._tmp.path().join("refused.partial").exists());
}

struct Victim(Child);

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn criu_dump(pid: u32, dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    let out = Command::new("criu")
        .args(["dump", "--leave-running", "-o", "dump.log", "-t", &pid.to_string(), "-D"])
        .arg(dir)
        .output()
        .expect("criu must be installed (scripts/install-deps)");
    assert!(out.status.success(), "criu dump failed: {}", fs::read_to_string(dir.join("dump.log")).unwrap_or_default());
    fs::remove_file(dir.join("dump.log")).unwrap();
}

#[test]
fn real_criu_dump_twice_writes_little_and_restores_byte_identical() {
    crab_sys::skip_unless_root!("mounts, ownership and CRIU");
    let sb = Sandbox::new();
    let script = "import time\nx = bytearray(16 << 20)\nfor i in range(0, len(x), 4096): x[i] = i % 251\nprint('ready', flush=True)\ntime.sleep(600)\n";
    let mut child = Command::new("setsid")
        .args(["python3", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let victim = Victim(child);

    let (d1, d2) = (sb._tmp.path().join("criu1"), sb._tmp.path().join("criu2"));
    criu_dump(victim.0.id(), &d1);
    criu_dump(victim.0.id(), &d2);
    let commit = |turn, dir: &Path| {
        sb.store
            .commit_turn(&TurnInput { container: "c1", turn, rootfs: None, changed: &[], criu_images: Some(dir) })
            .unwrap()
    };
    let first = commit(1, &d1);
    assert!(first.traffic.logical_bytes > 16 << 20, "{:?}", first.traffic);
    let second = commit(2, &d2);
    let ratio = second.traffic.written_bytes as f64 / second.traffic.logical_bytes as f64;
    assert!(ratio <= 0.05, "second dump wrote {ratio:.4} of its bytes: {:?}", second.traffic);

    let out = sb._tmp.path().join("criu-restored");
    sb.store.restore_images("c1", 2, &out).unwrap();
    assert_same_dir(&out, &d2);
}

// ---------- forks and GC ----------

#[test]
fn gc_keeps_the_window_and_what_forks_reference() {
    let sb = Sandbox::new();
    sb.commit("a", 0, &[]);
    let mut trees = vec![tree(&sb.live)];
    for turn in 1..=6u64 {
        write(&sb.live, &format!("/app/file{turn}"), format!("content of turn {turn}\n").as_bytes());
        write(&sb.live, "/app/counter", format!("{turn}\n").as_bytes());
        sb.commit("a", turn, &[c(&format!("/app/file{turn}")), m("/app/counter")]);
        trees.push(tree(&sb.live));
    }
    // Fork b off turn 2, and let it make a turn of its own.
    sb.store.fork("a", 2, "b").unwrap();
    let b_live = sb.fresh_target("b-live");
    sb.store.materialize("b", 2, &b_live).unwrap();
    assert_same_tree(&b_live, &trees[2]);
    write(&b_live, "/app/b-only", b"fork data\n");
    sb.store
        .commit_turn(&TurnInput {
            container: "b",
            turn: 3,
            rootfs: Some(&b_live),
            changed: &[c("/app/b-only")],
            criu_images: None,
        })
        .unwrap();
    let b_tree = tree(&b_live);

    let (_, t1) = sb.store.manifest_at("a", 1).unwrap();
    let counter_turn1 =
        *t1.fs_delta.iter().find(|e| e.path.to_string() == "/app/counter").unwrap().node.blob().unwrap();
    let (_, t4) = sb.store.manifest_at("a", 4).unwrap();
    let counter_turn4 =
        *t4.fs_delta.iter().find(|e| e.path.to_string() == "/app/counter").unwrap().node.blob().unwrap();

    let report = sb.store.gc(&RetentionPolicy { keep_last: 2 }).unwrap();
    assert_eq!(report.snapshots_written, 2, "{report:?}");
    // a keeps 6 and 5; b keeps its 3 and a's 2: turns 0, 1, 3, 4 of a go.
    assert_eq!(report.manifests_removed, 4, "{report:?}");
    assert!(!sb.store.blobs().contains(&counter_turn4), "a blob only dropped turns used is collected");
    assert!(!sb.store.blobs().contains(&counter_turn1));

    let a_turns: Vec<u64> = sb.store.history("a").unwrap().iter().map(|i| i.turn).collect();
    assert_eq!(a_turns, [6, 5]);
    assert!(matches!(sb.store.materialize("a", 3, &sb.fresh_target("x")), Err(CheckpointError::NoSuchTurn { .. })));
    for turn in [5, 6] {
        let target = sb.fresh_target(&format!("a{turn}"));
        sb.store.materialize("a", turn, &target).unwrap();
        assert_same_tree(&target, &trees[turn as usize]);
    }
    let target = sb.fresh_target("b3");
    sb.store.materialize("b", 3, &target).unwrap();
    assert_same_tree(&target, &b_tree);
    let target = sb.fresh_target("b2");
    sb.store.materialize("b", 2, &target).unwrap();
    assert_same_tree(&target, &trees[2]);

    // Rolling back within the window still works after GC, on a fresh store instance.
    let reopened = CheckpointStore::open(&sb.state).unwrap();
    reopened
        .rollback_in_place(&RollbackRequest {
            container: "a",
            to_turn: 5,
            root: &sb.live,
            base: Some(&sb.base),
            uncommitted: &[],
        })
        .unwrap();
    assert_same_tree(&sb.live, &trees[5]);

    // The rollback abandoned turn 6 of a: the next run drops it, and a run after that finds
    // nothing more to do.
    let abandoned = reopened.gc(&RetentionPolicy { keep_last: 2 }).unwrap();
    assert_eq!((abandoned.manifests_removed, abandoned.snapshots_written), (1, 0), "{abandoned:?}");
    assert!(abandoned.blobs_removed >= 1, "{abandoned:?}");
    let again = reopened.gc(&RetentionPolicy { keep_last: 2 }).unwrap();
    assert_eq!((again.manifests_removed, again.blobs_removed, again.snapshots_written), (0, 0, 0), "{again:?}");
    // Turn 5 is now the head of a; a third turn pushes the window and replaces its snapshot.
    write(&sb.live, "/app/file7", b"7\n");
    reopened
        .commit_turn(&TurnInput {
            container: "a",
            turn: 7,
            rootfs: Some(&sb.live),
            changed: &[c("/app/file7")],
            criu_images: None,
        })
        .unwrap();
    let third = reopened.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert!(third.snapshots_written >= 1 && third.snapshots_removed >= 1, "{third:?}");
    let target = sb.fresh_target("a7");
    reopened.materialize("a", 7, &target).unwrap();
    assert_same_tree(&target, &tree(&sb.live));
}

#[test]
fn bad_requests_are_named() {
    let sb = Sandbox::new();
    let err =
        sb.store.commit_turn(&TurnInput { container: "../x", turn: 1, rootfs: None, changed: &[], criu_images: None });
    assert!(matches!(err, Err(CheckpointError::InvalidKey(_))));
    sb.commit("c1", 5, &[]);
    let err =
        sb.store.commit_turn(&TurnInput { container: "c1", turn: 5, rootfs: None, changed: &[], criu_images: None });
    assert!(matches!(err, Err(CheckpointError::TurnNotAfterHead { turn: 5, head: 5, .. })));
    let err = sb.store.commit_turn(&TurnInput {
        container: "c1",
        turn: 6,
        rootfs: None,
        changed: &[m("/x")],
        criu_images: None,
    });
    assert!(matches!(err, Err(CheckpointError::InvalidRequest(_))));
    assert!(matches!(sb.store.manifest_at("c1", 4), Err(CheckpointError::NoSuchTurn { turn: 4, .. })));
    assert!(matches!(sb.store.fork("c1", 5, "c1"), Err(CheckpointError::InvalidRequest(_))));
    assert!(matches!(sb.store.gc(&RetentionPolicy { keep_last: 0 }), Err(CheckpointError::InvalidRequest(_))));
}

// ---------- hard links ----------

/// Link count, content and inode of each name (relative to `root`).
fn names(root: &Path, rels: &[&str]) -> Vec<(u64, Vec<u8>, u64)> {
    rels.iter()
        .map(|rel| {
            let path = root.join(rel);
            let md = fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (md.nlink(), fs::read(&path).unwrap(), md.ino())
        })
        .collect()
}

/// The names are one inode with `links` names and `content`.
fn assert_one_inode(root: &Path, rels: &[&str], links: u64, content: &[u8]) {
    let got = names(root, rels);
    let first = got[0].2;
    for (rel, (nlink, data, ino)) in rels.iter().zip(&got) {
        assert_eq!(
            (*nlink, String::from_utf8_lossy(data).into_owned(), *ino == first),
            (links, String::from_utf8_lossy(content).into_owned(), true),
            "{rel} under {}: (link count, content, same inode as {})",
            root.display(),
            rels[0]
        );
    }
}

/// Three names of one inode, then a write through the second: the turn's change list names only
/// that one, yet every name is the written inode after a restore of that turn, and the earlier
/// turn restores all three with the old content, linked (`traces/adversarial/hard-links`).
#[test]
fn a_file_written_through_one_of_its_names_restores_with_every_name_linked() {
    let sb = Sandbox::new();
    let all = ["app/links/one", "app/links/three", "app/links/two"];
    write(&sb.live, "/app/links/one", b"a\n");
    fs::hard_link(sb.live.join("app/links/one"), sb.live.join("app/links/two")).unwrap();
    fs::hard_link(sb.live.join("app/links/one"), sb.live.join("app/links/three")).unwrap();
    sb.commit("c1", 1, &[c("/app/links")]);
    let mut file = fs::OpenOptions::new().append(true).open(sb.live.join("app/links/two")).unwrap();
    std::io::Write::write_all(&mut file, b"b\n").unwrap();
    drop(file);
    sb.commit("c1", 2, &[m("/app/links/two")]);

    let at2 = sb.fresh_target("at2");
    sb.store.materialize("c1", 2, &at2).unwrap();
    assert_one_inode(&at2, &all, 3, b"a\nb\n");
    let at1 = sb.fresh_target("at1");
    sb.store.materialize("c1", 1, &at1).unwrap();
    assert_one_inode(&at1, &all, 3, b"a\n");

    sb.rollback("c1", 1).unwrap();
    assert_one_inode(&sb.live, &all, 3, b"a\n");
}

/// A name removed later (the file's first name included) leaves the others one inode, in a
/// restore and in a rollback that brings the removed name back.
#[test]
fn removing_a_name_of_a_hard_linked_file_keeps_the_others_linked() {
    let sb = Sandbox::new();
    write(&sb.live, "/app/links/one", b"a\n");
    fs::hard_link(sb.live.join("app/links/one"), sb.live.join("app/links/two")).unwrap();
    fs::hard_link(sb.live.join("app/links/one"), sb.live.join("app/links/three")).unwrap();
    sb.commit("c1", 1, &[c("/app/links")]);
    fs::remove_file(sb.live.join("app/links/one")).unwrap();
    sb.commit("c1", 2, &[m("/app/links/one")]);
    // A new file at the removed first name, of the same content: not one of the group.
    write(&sb.live, "/app/links/one", b"a\n");
    sb.commit("c1", 3, &[c("/app/links/one")]);

    let at3 = sb.fresh_target("at3");
    sb.store.materialize("c1", 3, &at3).unwrap();
    assert_one_inode(&at3, &["app/links/three", "app/links/two"], 2, b"a\n");
    assert_one_inode(&at3, &["app/links/one"], 1, b"a\n");

    sb.rollback("c1", 1).unwrap();
    assert_one_inode(&sb.live, &["app/links/one", "app/links/three", "app/links/two"], 3, b"a\n");
}

/// A write through a name in one directory records the names in others (found by their
/// inode), and a rollback of a turn that replaced one name puts it back into the group.
#[test]
fn names_in_other_directories_are_found_and_rolled_back_together() {
    let sb = Sandbox::new();
    write(&sb.live, "/app/x/data", b"1\n");
    fs::create_dir_all(sb.live.join("etc/y")).unwrap();
    fs::hard_link(sb.live.join("app/x/data"), sb.live.join("etc/y/data")).unwrap();
    sb.commit("c1", 1, &[c("/app/x"), c("/etc/y")]);
    write(&sb.live, "/etc/y/data", b"2\n");
    sb.commit("c1", 2, &[m("/etc/y/data")]);
    let manifest = sb.store.manifest_at("c1", 2).unwrap().1;
    let recorded: Vec<String> = manifest.fs_delta.iter().map(|e| e.path.to_string()).collect();
    assert_eq!(recorded, ["/app/x/data", "/etc/y/data"], "both names recorded");

    // Turn 3 replaces one name with a file of its own.
    fs::remove_file(sb.live.join("app/x/data")).unwrap();
    write(&sb.live, "/app/x/data", b"3\n");
    sb.commit("c1", 3, &[c("/app/x/data")]);
    sb.rollback("c1", 2).unwrap();
    assert_one_inode(&sb.live, &["app/x/data", "etc/y/data"], 2, b"2\n");
}

/// An overlay rootfs as containers have: the other names of a file written through one are
/// looked up in the writable layer (where they are one inode), never in the whole image, and
/// recorded with it.
#[test]
fn the_names_of_a_hard_linked_file_are_found_in_the_overlay_upper_layer() {
    crab_sys::skip_unless_root!("mounts, ownership and CRIU");
    let tmp = tempfile::tempdir().unwrap();
    let [lower, upper, work, merged] = ["lower", "upper", "work", "merged"].map(|d| tmp.path().join(d));
    for dir in [&lower, &upper, &work, &merged] {
        fs::create_dir_all(dir).unwrap();
    }
    write(&lower, "/usr/share/doc/big", b"image file\n");
    let options = format!("lowerdir={},upperdir={},workdir={}", lower.display(), upper.display(), work.display());
    let status =
        Command::new("mount").args(["-t", "overlay", "overlay", "-o", &options]).arg(&merged).status().unwrap();
    assert!(status.success(), "mount overlay");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&merged);

    let store = CheckpointStore::open(tmp.path().join("state")).unwrap();
    let commit = |turn: u64, changed: &[ChangedPath]| {
        let input = TurnInput { container: "c1", turn, rootfs: Some(&merged), changed, criu_images: None };
        let staged = store.stage_turn_in(&input, &[], Some(&upper)).unwrap();
        store.publish(staged).unwrap()
    };
    write(&merged, "/app/one", b"a\n");
    fs::create_dir_all(merged.join("srv")).unwrap();
    fs::hard_link(merged.join("app/one"), merged.join("app/two")).unwrap();
    fs::hard_link(merged.join("app/one"), merged.join("srv/three")).unwrap();
    commit(1, &[c("/app"), c("/srv")]);
    let mut file = fs::OpenOptions::new().append(true).open(merged.join("srv/three")).unwrap();
    std::io::Write::write_all(&mut file, b"b\n").unwrap();
    drop(file);
    commit(2, &[m("/srv/three")]);
    let manifest = store.manifest_at("c1", 2).unwrap().1;
    let recorded: Vec<String> = manifest.fs_delta.iter().map(|e| e.path.to_string()).collect();
    assert_eq!(recorded, ["/app/one", "/app/two", "/srv/three"]);

    let target = tmp.path().join("restored");
    fs::create_dir_all(&target).unwrap();
    store.materialize("c1", 2, &target).unwrap();
    assert_one_inode(&target, &["app/one", "app/two", "srv/three"], 3, b"a\nb\n");
}

/// A dump of one page image of `pages` (plus a core file of its own) in `dir`.
fn dump_of(dir: &Path, pages: &[u8], core: &str) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("pages-1.img"), pages).unwrap();
    fs::write(dir.join("core-1.img"), core).unwrap();
}

fn packs_in(sb: &Sandbox) -> Vec<PathBuf> {
    let mut packs: Vec<PathBuf> = fs::read_dir(sb.state.join("packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pack"))
        .collect();
    packs.sort();
    packs
}

/// GC frees packed chunks by the pack: a pack none of whose chunks is live goes, a pack whose
/// live chunks are under half its bytes is rewritten with them alone (with a table of its own), and
/// the chain's images restore byte for byte afterwards, also through a store opened before.
#[test]
fn gc_removes_dead_packs_and_rewrites_mostly_dead_ones() {
    let sb = Sandbox::new();
    // Pages unlike each other and unlike other seeds' (xorshift).
    let pages = |seed: u64, n: usize| -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n * 4096 / 8)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()
            })
            .collect()
    };
    let n = 512; // 2 MiB
    let p1 = pages(1, n);
    let p2 = pages(2, n);
    // Turn 3 keeps turn 2's first quarter of pages; the rest is new.
    let p3 = [&p2[..n / 4 * 4096], &pages(3, n)[n / 4 * 4096..]].concat();
    for (turn, data) in [(1, &p1), (2, &p2), (3, &p3)] {
        let dump = sb._tmp.path().join(format!("dump{turn}"));
        dump_of(&dump, data, &format!("core of turn {turn}"));
        commit_dump(&sb, "a", turn, &dump);
    }
    let before = packs_in(&sb);
    assert_eq!(before.len(), 3, "one pack per dump: {before:?}");
    let kept_chunk = crab_store::Digest::of(&p2[4096..8192]);
    let crab_store::BlobLocation::Packed { pack: turn2_pack, .. } = sb.store.blobs().location(&kept_chunk).unwrap()
    else {
        panic!("a page chunk is packed")
    };
    let opened_before = CheckpointStore::open(&sb.state).unwrap();

    let report = sb.store.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!((report.packs_removed, report.packs_rewritten), (1, 1), "{report:?}");
    assert!(report.bytes_freed >= (n + n * 3 / 4) as u64 * 4096, "{report:?}");
    let after = packs_in(&sb);
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(!after.contains(&turn2_pack), "turn 2's pack was rewritten");
    let crab_store::BlobLocation::Packed { pack, offset, len } = sb.store.blobs().location(&kept_chunk).unwrap() else {
        panic!("a page chunk is packed")
    };
    assert_eq!((offset, len), (4096, 4096), "the live quarter alone, in its order");
    assert_eq!(fs::metadata(&pack).unwrap().len(), (n / 4) as u64 * 4096);

    fs::remove_dir_all(sb.state.join("assembled")).unwrap();
    for (name, store) in [("now", &sb.store), ("opened-before", &opened_before)] {
        let out = sb._tmp.path().join(format!("restored-{name}"));
        store.restore_images("a", 3, &out).unwrap();
        assert_eq!(fs::read(out.join("pages-1.img")).unwrap(), p3, "{name}");
    }
    assert!(sb.store.verify("a", 3).is_ok());
    // Nothing more to do: a second GC leaves the packs alone.
    let again = sb.store.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!((again.packs_removed, again.packs_rewritten), (0, 0), "{again:?}");
    assert_eq!(packs_in(&sb), after);
}

/// A store written before pack tables: each packed blob's name is a link to its place, and
/// its packs have no table. Its checkpoints restore through the links, and one GC moves every
/// live blob into an indexed pack and removes the links (dead ones with their blobs).
#[test]
fn gc_moves_the_blobs_of_a_store_written_before_pack_tables_into_indexed_packs() {
    let sb = Sandbox::new();
    write(&sb.live, "/app/one", b"first version\n");
    write(&sb.live, "/app/two", b"stays\n");
    sb.commit("c1", 1, &[c("/app/one"), c("/app/two")]);
    let (_, turn1) = sb.store.manifest_at("c1", 1).unwrap();
    let blob_of =
        |path: &str| *turn1.fs_delta.iter().find(|e| e.path.to_string() == path).unwrap().node.blob().unwrap();
    let (one, two) = (blob_of("/app/one"), blob_of("/app/two"));
    // Turn 1 as an older store wrote it: links, and no table beside the pack.
    let mut pack = None;
    for blob in [one, two] {
        let crab_store::BlobLocation::Packed { pack: file, offset, len } = sb.store.blobs().location(&blob).unwrap()
        else {
            panic!("a small file is packed")
        };
        let id = file.file_stem().unwrap().to_str().unwrap().to_owned();
        std::os::unix::fs::symlink(format!("{id}+{offset}+{len}"), sb.store.blobs().path_of(&blob)).unwrap();
        pack = Some(file);
    }
    let pack = pack.unwrap();
    fs::remove_file(pack.with_extension("idx")).unwrap();
    let older = CheckpointStore::open(&sb.state).unwrap();
    let restored = sb.fresh_target("through-links");
    older.materialize("c1", 1, &restored).unwrap();
    assert_eq!(fs::read(restored.join("app/two")).unwrap(), b"stays\n");

    write(&sb.live, "/app/one", b"second version\n");
    sb.commit("c1", 2, &[c("/app/one")]);
    let report = older.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!(report.packs_rewritten, 1, "{report:?}");
    assert!(!pack.exists(), "turn 1's pack, with a dead blob, was rewritten");
    let names: usize =
        fs::read_dir(sb.state.join("blobs")).unwrap().map(|d| fs::read_dir(d.unwrap().path()).unwrap().count()).sum();
    assert_eq!(names, 0, "no link is left");
    let fresh = CheckpointStore::open(&sb.state).unwrap();
    assert!(fresh.blobs().contains(&two) && !fresh.blobs().contains(&one));
    let crab_store::BlobLocation::Packed { pack: moved, .. } = fresh.blobs().location(&two).unwrap() else {
        panic!("still packed")
    };
    assert!(moved.with_extension("idx").is_file(), "in an indexed pack");
    let restored = sb.fresh_target("after-gc");
    fresh.materialize("c1", 2, &restored).unwrap();
    assert_eq!(fs::read(restored.join("app/two")).unwrap(), b"stays\n");
    assert_eq!(fs::read(restored.join("app/one")).unwrap(), b"second version\n");
    let again = fresh.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!((again.packs_rewritten, again.packs_removed, again.blobs_removed), (0, 0, 0), "{again:?}");
}

/// A reader that read a chunk's link just before GC rewrote its pack (and removed the old
/// one) looks again and reads the chunk from the new pack.
#[test]
fn a_read_racing_a_pack_rewrite_finds_the_blob_in_the_new_pack() {
    let sb = Sandbox::new();
    let chunks: Vec<Vec<u8>> = (0..64u32).map(|i| [i.to_le_bytes().as_slice(), &[5u8; 4092]].concat()).collect();
    let p1: Vec<u8> = chunks.concat();
    // Turn 2 keeps 8 of turn 1's 64 pages: its pack is mostly dead once turn 1 goes.
    let p2: Vec<u8> = [&p1[..8 * 4096], &vec![6u8; 56 * 4096][..]].concat();
    for (turn, data) in [(1, &p1), (2, &p2)] {
        let dump = sb._tmp.path().join(format!("dump{turn}"));
        dump_of(&dump, data, &format!("core of turn {turn}"));
        commit_dump(&sb, "a", turn, &dump);
    }
    let chunk = crab_store::Digest::of(&chunks[3]);
    let before = sb.store.blobs().location(&chunk).unwrap();
    let reader = crab_store::BlobStore::open(&sb.state).unwrap();
    let scenario = fail::FailScenario::setup();
    let gc_ran = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (counter, state) = (gc_ran.clone(), sb.state.clone());
    fail::cfg_callback("blobs-open-pack", move || {
        if counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            let report = CheckpointStore::open(&state).unwrap().gc(&RetentionPolicy { keep_last: 1 }).unwrap();
            assert_eq!(report.packs_rewritten, 1, "{report:?}");
        }
    })
    .unwrap();
    let read = reader.read(&chunk);
    scenario.teardown();
    assert!(gc_ran.load(std::sync::atomic::Ordering::SeqCst) >= 1, "the failpoint never ran");
    assert_ne!(sb.store.blobs().location(&chunk).unwrap(), before, "the chunk moved to a new pack");
    assert_eq!(read.unwrap(), chunks[3]);
}

fn shell_state(exec_id: &str, cwd: &str, status: i32) -> crab_store::ShellState {
    crab_store::ShellState {
        exec_id: exec_id.into(),
        status,
        last_arg: "x".into(),
        cwd: cwd.into(),
        flags: "hB".into(),
        set_options: "set +o errexit\n".into(),
        shopt: "shopt -u extglob\n".into(),
        variables: vec![format!("declare -- WHERE=\"{cwd}\"")],
        functions: String::new(),
        aliases: String::new(),
        traps: String::new(),
        dirs: format!("{cwd}\n"),
        umask: "0022".into(),
        jobs: String::new(),
        limits: String::new(),
        disabled: String::new(),
        base_turn: None,
        inherited: Vec::new(),
    }
}

/// Commits `turn` of c1 with no file changed, as `set` completes it: a process turn when
/// `dump` is given.
fn commit_staged(sb: &Sandbox, turn: u64, dump: Option<&Path>, set: impl FnOnce(&mut crab_store::StagedTurn)) {
    let mut staged = sb
        .store
        .stage_turn(&TurnInput { container: "c1", turn, rootfs: None, changed: &[], criu_images: dump })
        .unwrap();
    set(&mut staged);
    sb.store.publish(staged).unwrap();
}

/// Commits `turn` of c1 listing `shells`: a process turn when `dump` is given.
fn commit_with_shells(sb: &Sandbox, turn: u64, dump: Option<&Path>, shells: Vec<crab_store::ShellState>) {
    commit_staged(sb, turn, dump, |staged| staged.set_shells(shells));
}

/// A shell session's states listed by its turns: a restore of a later turn gets the state its
/// process images hold and the newest at or below the turn; a turn that changed only the
/// shell is still a checkpoint; GC's snapshot keeps what a restore of its turn needs.
#[test]
fn shell_states_listed_by_turns_come_back_with_the_images_that_hold_their_shell() {
    let sb = Sandbox::new();
    let dump = sb._tmp.path().join("dump");
    synthetic_dump(&dump, 1);
    let (s1, s2, s3) = (shell_state("sh", "/a", 0), shell_state("sh", "/b", 3), shell_state("sh", "/c", 0));
    commit_with_shells(&sb, 1, Some(&dump), vec![s1.clone()]);
    // No file changed: the listing alone makes turn 2 a file-system checkpoint. Turn 3 lists
    // only what differs from turn 1's (the engine's way): a restore gets it whole.
    commit_with_shells(&sb, 2, None, vec![s2.clone()]);
    let relative = s3.relative_to(&s1, 1);
    assert!(relative.inherited.contains(&"shopt".to_string()) && relative.shopt.is_empty(), "{relative:?}");
    commit_with_shells(&sb, 3, None, vec![relative]);
    let history = sb.store.history("c1").unwrap();
    let mut classes: Vec<(u64, TurnClass)> = history.iter().map(|c| (c.turn, c.class)).collect();
    classes.sort_by_key(|(turn, _)| *turn);
    assert_eq!(classes, [(1, TurnClass::Proc), (2, TurnClass::Fs), (3, TurnClass::Fs)]);
    let at = |turn| sb.store.shell_restores("c1", turn).unwrap();
    let one = at(1);
    assert_eq!(one.len(), 1);
    assert_eq!((one[0].base.as_ref(), &one[0].target, one[0].images_turn), (Some(&s1), &s1, 1));
    let two = at(2);
    assert_eq!((two[0].base.as_ref(), &two[0].target, two[0].target_turn), (Some(&s1), &s2, 2));
    // A new process checkpoint is the new base.
    let dump2 = sb._tmp.path().join("dump2");
    synthetic_dump(&dump2, 2);
    commit_with_shells(&sb, 4, Some(&dump2), vec![s3.clone()]);
    commit_with_shells(&sb, 5, None, vec![s1.clone()]);
    let five = at(5);
    assert_eq!((five[0].base.as_ref(), &five[0].target, five[0].images_turn), (Some(&s3), &s1, 4));
    assert_eq!(at(3)[0].target, s3);
    // GC folds turns 1-4 into a snapshot at turn 4: restores of 4 and 5 see the same.
    sb.store.gc(&RetentionPolicy { keep_last: 2 }).unwrap();
    let four = at(4);
    assert_eq!((four[0].base.as_ref(), &four[0].target), (Some(&s3), &s3));
    assert_eq!(at(5), five);
    sb.store.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!(at(5), five, "from the snapshot at turn 5");
    // A listing relative to a turn whose dump is not the images' cannot be completed: no base.
    commit_with_shells(&sb, 6, None, vec![s2.relative_to(&s1, 1)]);
    assert_eq!(at(6)[0].base, None);
}

/// Commits `turn` of c1 with the pid cursor its forks left: a process turn when `dump` is given.
fn commit_with_next_pid(sb: &Sandbox, turn: u64, dump: Option<&Path>, next_pid: Option<u32>) {
    commit_staged(sb, turn, dump, |staged| {
        staged.set_next_pid(next_pid);
        if staged.class() == TurnClass::Clean {
            // A turn whose only change is the cursor (the test's way to publish one).
            staged.set_shells(vec![shell_state("sh", "/", 0)]);
        }
    });
}

/// A restore of a file-system turn sets the pid cursor the newest turn after the images left
/// (the dump's own, beside its images, is older); a restore of the process turn itself, or of
/// a chain whose later turns forked nothing, leaves the dump's. GC's snapshot keeps it.
#[test]
fn a_restore_takes_the_pid_cursor_of_the_newest_turn_after_its_images() {
    let sb = Sandbox::new();
    let dump = sb._tmp.path().join("dump");
    synthetic_dump(&dump, 1);
    commit_with_next_pid(&sb, 1, Some(&dump), Some(20));
    commit_with_next_pid(&sb, 2, None, Some(31));
    commit_with_next_pid(&sb, 3, None, None);
    commit_with_next_pid(&sb, 4, None, Some(48));
    let at = |turn| sb.store.restore_next_pid("c1", turn).unwrap();
    assert_eq!([at(1), at(2), at(3), at(4)], [None, Some(31), Some(31), Some(48)]);
    let dump2 = sb._tmp.path().join("dump2");
    synthetic_dump(&dump2, 2);
    commit_with_next_pid(&sb, 5, Some(&dump2), Some(50));
    commit_with_next_pid(&sb, 6, None, None);
    assert_eq!([at(5), at(6)], [None, None], "the dump of turn 5 read the cursor after every older turn");
    commit_with_next_pid(&sb, 7, None, Some(77));
    // GC folds turns 1-6 into a snapshot at turn 6, then 1-7 into one at 7.
    sb.store.gc(&RetentionPolicy { keep_last: 2 }).unwrap();
    assert_eq!([at(6), at(7)], [None, Some(77)]);
    sb.store.gc(&RetentionPolicy { keep_last: 1 }).unwrap();
    assert_eq!(at(7), Some(77), "from the snapshot at turn 7");
}

/// A plain open that finds no `assembled` makes it a directory. When that happens between
/// `open_with` moving the old directory aside and renaming its link in, the rename met a
/// directory ("Is a directory"): a fork's Create on node B failed so, once in a CI run. The new
/// directory is moved aside too, and the link goes in.
#[test]
fn a_directory_made_by_a_concurrent_open_during_the_link_swap_is_moved_aside_again() {
    let scenario = fail::FailScenario::setup();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    CheckpointStore::open(&state).unwrap();
    let assembled = state.join("assembled");
    assert!(fs::symlink_metadata(&assembled).unwrap().is_dir(), "a plain open keeps copies in a directory");
    let made = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (made_in, state_in) = (made.clone(), state.clone());
    fail::cfg_callback("assembled-moved-aside", move || {
        if !made_in.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // The concurrent open, in the window.
            CheckpointStore::open(&state_in).unwrap();
        }
    })
    .unwrap();
    let kept = KeptImages { dir: Some(tmp.path().join("kept")), max_bytes: u64::MAX };
    CheckpointStore::open_with(&state, &kept).unwrap();
    assert!(made.load(std::sync::atomic::Ordering::SeqCst), "the failpoint ran");
    let target = fs::read_link(&assembled).expect("assembled is the link to the kept directory");
    assert!(target.starts_with(tmp.path().join("kept")), "{}", target.display());
    let leftovers: Vec<_> = fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(".assembled"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    scenario.teardown();
}
