//! The inspector against the real kernel: needs root, BPF and cgroup v2.
//!
//! Each test makes its own cgroup v2 directory, runs real commands in it and
//! checks the effects the BPF programs reported.

use std::collections::HashSet;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crab_inspector::{
    AsyncIoCall, ClassifyOptions, Effect, EffectKind, EffectPath, Inspector, InspectorConfig, NamespacePid, Reason,
    SockAddr, TurnClass, WatchedContainer, cgroup_id_of_dir, cgroup2_mount, classify,
};

const PYTHON: &str = "/usr/bin/python3";

/// A cgroup v2 directory that is emptied and removed on drop.
struct TestCgroup {
    dir: PathBuf,
    id: u64,
}

impl TestCgroup {
    fn new(name: &str) -> Self {
        let parent = cgroup2_mount().expect("cgroup v2 is mounted");
        Self::under(&parent, &format!("crab-inspector-test-{}-{name}", std::process::id()))
    }

    fn under(parent: &Path, name: &str) -> Self {
        let dir = parent.join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let id = cgroup_id_of_dir(&dir).unwrap();
        Self { dir, id }
    }

    /// A command that moves itself into this cgroup before exec.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let procs = CString::new(self.dir.join("cgroup.procs").as_os_str().as_bytes()).unwrap();
        let mut command = Command::new(program);
        command.args(args).stdin(Stdio::null());
        // SAFETY: the hook only calls async-signal-safe functions on data prepared before fork.
        unsafe {
            command.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if written != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command
    }

    /// Runs a command in the cgroup to completion; panics when it fails.
    fn run(&self, program: &str, args: &[&str]) -> std::process::Output {
        let output = self.command(program, args).output().unwrap();
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(self.dir.join("cgroup.procs")).is_ok_and(|p| !p.trim().is_empty())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        while std::fs::remove_dir(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A fresh directory for a test's files, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = PathBuf::from(format!("/tmp/crab-inspector-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }

    fn str(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn watching(name: &str, cgroup: &TestCgroup) -> Inspector {
    watching_with(name, cgroup, InspectorConfig::default()).await
}

async fn watching_with(name: &str, cgroup: &TestCgroup, config: InspectorConfig) -> Inspector {
    let inspector = Inspector::start(config).await.expect("inspector loads (run the tests as root)");
    let container = WatchedContainer { id: name.into(), root_pid: None, rootfs: None };
    inspector.watch(cgroup.id, container).await.unwrap();
    inspector
}

async fn drain_all(inspector: &Inspector, container: &str) -> Vec<Effect> {
    inspector.drain(container, u64::MAX).await.unwrap().effects
}

/// (operation, paths) of every file-changing effect under `root`, in order.
fn file_changes_under(effects: &[Effect], root: &Path) -> Vec<(&'static str, Vec<PathBuf>)> {
    effects
        .iter()
        .filter(|e| e.changes_under(root))
        .map(|e| (e.kind.name(), e.kind.changed_paths().iter().map(|p| p.path.clone()).collect()))
        .collect()
}

fn one(path: PathBuf) -> Vec<PathBuf> {
    vec![path]
}

#[tokio::test]
async fn shell_file_operations_resolve_to_absolute_paths() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("shell");
    let scratch = Scratch::new("shell");
    std::fs::create_dir(scratch.path("x")).unwrap();
    let inspector = watching("shell", &cgroup).await;

    let script = format!("cd {}/x && echo a > f; mkdir d; mv f d/g; ln -s d l; chmod 600 d/g; rm -r d", scratch.str());
    let sh = cgroup.command("/bin/sh", &["-c", &script]).spawn().unwrap();
    let sh_pid = sh.id();
    assert!(sh.wait_with_output().unwrap().status.success());
    let effects = drain_all(&inspector, "shell").await;

    let x = scratch.path("x");
    assert_eq!(
        file_changes_under(&effects, &scratch.0),
        vec![
            ("open", one(x.join("f"))),
            ("mkdir", one(x.join("d"))),
            ("rename", vec![x.join("f"), x.join("d/g")]),
            ("symlink", one(x.join("l"))),
            ("chmod", one(x.join("d/g"))),
            // rm -r removes the entry through a descriptor of d: dirfd-relative.
            ("unlink", one(x.join("d/g"))),
            ("rmdir", one(x.join("d"))),
        ],
        "all effects: {effects:#?}"
    );
    let symlink = effects.iter().find(|e| e.kind.name() == "symlink").unwrap();
    assert!(matches!(&symlink.kind, EffectKind::Symlink { target, .. } if target == Path::new("d")));
    let chmod = effects.iter().find(|e| e.kind.name() == "chmod").unwrap();
    assert!(matches!(chmod.kind, EffectKind::Chmod { mode: 0o600, .. }), "{chmod:?}");
    assert!(effects.iter().all(|e| e.result >= 0));
    let open = effects.iter().find(|e| e.kind.name() == "open").unwrap();
    assert_eq!((open.pid, open.comm.as_str()), (sh_pid, "sh"));

    // The shell forked mkdir, mv, ln, chmod and rm, each exec'd and exited.
    let children: Vec<u32> = effects
        .iter()
        .filter_map(|e| match e.kind {
            EffectKind::Fork { child, .. } if e.pid == sh_pid => Some(child),
            _ => None,
        })
        .collect();
    assert_eq!(children.len(), 5, "{effects:#?}");
    for child in &children {
        assert!(effects.iter().any(|e| e.pid == *child && matches!(e.kind, EffectKind::Exec { .. })));
        assert!(effects.iter().any(|e| e.pid == *child && matches!(e.kind, EffectKind::Exit { status: 0 })));
    }
    let rm_exec = effects
        .iter()
        .find_map(|e| match &e.kind {
            EffectKind::Exec { path, filename } if filename.ends_with("/rm") => Some(path.clone()),
            _ => None,
        })
        .expect("rm was exec'd");
    assert!(rm_exec.resolved && rm_exec.path.ends_with("bin/rm"), "{rm_exec:?}");
    assert!(effects.iter().any(|e| e.pid == sh_pid && matches!(e.kind, EffectKind::Exit { status: 0 })));
    let verdict = classify(&effects, &ClassifyOptions::default());
    assert_eq!(verdict.class, TurnClass::Fs, "{verdict:#?}");
    assert!(!verdict.external && !verdict.escalated);
    assert!(effects.iter().all(|e| time_is_monotonic_now_ish(e.time_ns)), "timestamps are CLOCK_MONOTONIC");
}

/// How deep this process's pid namespace is (0 on the host), from its `NSpid` line.
fn own_pid_namespace_depth() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:")).expect("NSpid line");
    nspid.split_whitespace().count() as u32 - 1
}

/// A fork's record carries the child's pid as its own pid namespace numbers it: a restore
/// sets a container's pid cursor from the newest of them.
#[tokio::test]
async fn forks_carry_the_childs_pid_in_its_own_namespace() {
    crab_sys::skip_unless_root!("BPF programs, cgroups and a pid namespace");
    let cgroup = TestCgroup::new("nspid");
    let inspector = watching("nspid", &cgroup).await;
    let depth = own_pid_namespace_depth();

    // sh forks true and unshare in this namespace; unshare forks the new namespace's first
    // process (sh, 1), which forks two (2 and 3).
    let script = "/bin/true; unshare --pid --fork /bin/sh -c '/bin/true; /bin/true; echo'";
    let sh = cgroup.command("/bin/sh", &["-c", script]).spawn().unwrap();
    assert!(sh.wait_with_output().unwrap().status.success());
    let effects = drain_all(&inspector, "nspid").await;

    let forks: Vec<(u32, Option<NamespacePid>)> = effects
        .iter()
        .filter_map(|e| match e.kind {
            EffectKind::Fork { child, in_namespace } => Some((child, in_namespace)),
            _ => None,
        })
        .collect();
    let at = |d: u32| -> Vec<(u32, u32)> {
        forks.iter().filter_map(|(child, ns)| ns.filter(|ns| ns.depth == d).map(|ns| (*child, ns.pid))).collect()
    };
    assert_eq!(at(depth + 1).iter().map(|(_, pid)| *pid).collect::<Vec<_>>(), [1, 2, 3], "{forks:#?}");
    let outer = at(depth);
    assert_eq!(outer.len(), 2, "true and unshare: {forks:#?}");
    assert_eq!(outer.len() + 3, forks.len(), "every fork says where it was numbered: {forks:#?}");
    if depth == 0 {
        // On the host a pid is its own namespace's number.
        assert!(outer.iter().all(|(child, pid)| child == pid), "{forks:#?}");
    }
}

fn time_is_monotonic_now_ish(time_ns: u64) -> bool {
    let now = crab_inspector::monotonic_now_ns();
    time_ns <= now && now - time_ns < 60_000_000_000
}

#[tokio::test]
async fn python_dirfd_relative_calls_resolve_against_the_descriptor() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("dirfd");
    let scratch = Scratch::new("dirfd");
    std::fs::create_dir_all(scratch.path("base/sub")).unwrap();
    std::fs::write(scratch.path("base/old"), "x").unwrap();
    let inspector = watching("dirfd", &cgroup).await;

    let program = format!(
        r#"
import os
d = os.open("{base}", os.O_RDONLY | os.O_DIRECTORY)
os.chdir("/")
fd = os.open("sub/file", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)
os.fchmod(fd, 0o640)
os.ftruncate(fd, 0)
os.close(fd)
os.mkdir("newdir", dir_fd=d)
os.rename("sub/file", "newdir/moved", src_dir_fd=d, dst_dir_fd=d)
os.link("old", "hard", src_dir_fd=d, dst_dir_fd=d)
os.symlink("/etc/hostname", "sym", dir_fd=d)
os.chown("old", -1, 0, dir_fd=d)
os.utime("old", dir_fd=d)
os.unlink("old", dir_fd=d)
os.chdir("{base}/sub")
open("../cwd-relative", "w").close()
os.open("{base}/readonly-is-no-effect", os.O_RDONLY | os.O_CREAT, 0o644)
"#,
        base = scratch.path("base").display()
    );
    cgroup.run(PYTHON, &["-I", "-B", "-c", &program]);
    let effects = drain_all(&inspector, "dirfd").await;

    let base = scratch.path("base");
    assert_eq!(
        file_changes_under(&effects, &scratch.0),
        vec![
            ("open", one(base.join("sub/file"))),
            ("chmod", one(base.join("sub/file"))),
            ("truncate", one(base.join("sub/file"))),
            ("mkdir", one(base.join("newdir"))),
            ("rename", vec![base.join("sub/file"), base.join("newdir/moved")]),
            ("link", one(base.join("hard"))),
            ("symlink", one(base.join("sym"))),
            ("chown", one(base.join("old"))),
            ("utimes", one(base.join("old"))),
            ("unlink", one(base.join("old"))),
            ("open", one(base.join("cwd-relative"))),
            // O_CREAT makes even a read-only open a possible change.
            ("open", one(base.join("readonly-is-no-effect"))),
        ],
        "all effects: {effects:#?}"
    );
    let link = effects.iter().find(|e| e.kind.name() == "link").unwrap();
    assert!(matches!(&link.kind, EffectKind::Link { existing, .. } if existing.path == base.join("old")));
    let chown = effects.iter().find(|e| e.kind.name() == "chown").unwrap();
    assert!(matches!(chown.kind, EffectKind::Chown { uid: None, gid: Some(0), .. }), "{chown:?}");
}

#[tokio::test]
async fn failed_and_read_only_calls_are_not_effects() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("failed");
    let scratch = Scratch::new("failed");
    std::fs::write(scratch.path("exists"), "x").unwrap();
    let inspector = watching("failed", &cgroup).await;
    let script = format!(
        "cd {dir}; cat exists > /dev/null; mkdir exists 2>/dev/null; rm missing 2>/dev/null; \
         ls > /dev/null; test -e exists",
        dir = scratch.str()
    );
    cgroup.run("/bin/sh", &["-c", &script]);
    let effects = drain_all(&inspector, "failed").await;
    assert_eq!(file_changes_under(&effects, &scratch.0), vec![], "{effects:#?}");
    // /dev/null was opened for writing: recorded, but ignored by classify.
    assert!(effects.iter().any(|e| e.changes_under(Path::new("/dev/null"))));
    assert_eq!(classify(&effects, &ClassifyOptions::default()).class, TurnClass::Clean);
}

#[tokio::test]
async fn processes_outside_the_cgroup_are_not_recorded() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let watched = TestCgroup::new("inside");
    let other = TestCgroup::new("outside");
    let scratch = Scratch::new("outside");
    let inspector = watching("inside", &watched).await;
    let outside_script = format!("cd {} && mkdir outside && echo x > outside/f", scratch.str());
    // One in a sibling cgroup, one in this test's own cgroup (not watched either).
    other.run("/bin/sh", &["-c", &outside_script]);
    let own = Command::new("/bin/sh").args(["-c", &format!("echo y > {}/own", scratch.str())]).status().unwrap();
    assert!(own.success());
    watched.run("/bin/sh", &["-c", &format!("echo z > {}/inside", scratch.str())]);
    let effects = drain_all(&inspector, "inside").await;
    assert_eq!(file_changes_under(&effects, &scratch.0), vec![("open", one(scratch.path("inside")))], "{effects:#?}");
}

/// The early exit compares a task's ancestors with a short list of watched ids (8) before any
/// lookup: with more sandboxes watched than the list holds, the last one watched and one watched
/// first are still recorded, and so is a sandbox when others leave and the list shrinks again.
#[tokio::test]
async fn every_watched_cgroup_is_recorded_past_the_id_list() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    const WATCHED: usize = 10;
    let cgroups: Vec<TestCgroup> = (0..WATCHED).map(|i| TestCgroup::new(&format!("many-{i}"))).collect();
    let scratch = Scratch::new("many");
    let inspector = Inspector::start(InspectorConfig::default()).await.unwrap();
    for (i, cgroup) in cgroups.iter().enumerate() {
        let container = WatchedContainer { id: format!("many-{i}"), root_pid: None, rootfs: None };
        inspector.watch(cgroup.id, container).await.unwrap();
    }
    for i in [0, WATCHED - 1] {
        cgroups[i].run("/bin/sh", &["-c", &format!("echo {i} > {}/from-{i}", scratch.str())]);
        let effects = drain_all(&inspector, &format!("many-{i}")).await;
        let expected = vec![("open", one(scratch.path(&format!("from-{i}"))))];
        assert_eq!(file_changes_under(&effects, &scratch.0), expected, "{effects:#?}");
    }
    // Down to 2 watched (in the list again): the one left last is still recorded.
    for i in 1..WATCHED - 1 {
        inspector.unwatch(&format!("many-{i}")).await.unwrap();
    }
    let last = WATCHED - 1;
    cgroups[last].run("/bin/sh", &["-c", &format!("echo again > {}/again", scratch.str())]);
    let effects = drain_all(&inspector, &format!("many-{last}")).await;
    assert_eq!(file_changes_under(&effects, &scratch.0), vec![("open", one(scratch.path("again")))], "{effects:#?}");
}

#[tokio::test]
async fn nested_cgroups_count_for_the_watched_ancestor() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("nested");
    let child = TestCgroup::under(&cgroup.dir, "child");
    let scratch = Scratch::new("nested");
    let inspector = watching("nested", &cgroup).await;
    child.run("/bin/sh", &["-c", &format!("echo a > {}/from-child", scratch.str())]);
    let effects = drain_all(&inspector, "nested").await;
    assert_eq!(file_changes_under(&effects, &scratch.0), vec![("open", one(scratch.path("from-child")))]);
    drop(child);
}

#[tokio::test]
async fn background_process_survives_the_turn() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("background");
    let inspector = watching("background", &cgroup).await;
    let output = cgroup.run("/bin/sh", &["-c", "sleep 30 > /dev/null 2>&1 & echo $!"]);
    let sleep_pid: u32 = String::from_utf8(output.stdout).unwrap().trim().parse().unwrap();
    let effects = drain_all(&inspector, "background").await;

    let forked = effects.iter().any(|e| matches!(e.kind, EffectKind::Fork { child, .. } if child == sleep_pid));
    assert!(forked, "{effects:#?}");
    let exec = effects.iter().find(|e| e.pid == sleep_pid && matches!(e.kind, EffectKind::Exec { .. })).unwrap();
    let EffectKind::Exec { path, .. } = &exec.kind else { unreachable!() };
    assert_eq!(path, &EffectPath::resolved("/usr/bin/sleep"));
    let verdict = classify(&effects, &ClassifyOptions::default());
    assert_eq!(verdict.class, TurnClass::Proc);
    assert_eq!(verdict.reasons, vec![Reason::ProcessSurvives { pid: sleep_pid, comm: "sleep".into() }]);
}

/// Waits until some effect matches, flushing the inspector meanwhile.
async fn wait_for_effect(inspector: &Inspector, container: &str, found: impl Fn(&Effect) -> bool) -> Vec<Effect> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut effects = Vec::new();
    loop {
        effects.extend(drain_all(inspector, container).await);
        if effects.iter().any(&found) {
            return effects;
        }
        assert!(Instant::now() < deadline, "no matching effect in {effects:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn listening_server_and_connects() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("listen");
    let inspector = watching("listen", &cgroup).await;
    let server = cgroup
        .command(PYTHON, &["-I", "-B", "-m", "http.server", "0", "--bind", "127.0.0.1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = KillOnDrop(server);
    let server_pid = server.0.id();
    let effects = wait_for_effect(&inspector, "listen", |e| matches!(e.kind, EffectKind::Listen { .. })).await;

    let bind = effects.iter().find(|e| matches!(e.kind, EffectKind::Bind { .. })).unwrap();
    let EffectKind::Bind { addr: SockAddr::Inet(bound) } = bind.kind else { panic!("{bind:?}") };
    assert_eq!((bind.pid, bound.ip().to_string(), bound.port()), (server_pid, "127.0.0.1".into(), 0));
    let listen = effects.iter().find(|e| matches!(e.kind, EffectKind::Listen { .. })).unwrap();
    let EffectKind::Listen { addr: SockAddr::Inet(listening), .. } = listen.kind else { panic!("{listen:?}") };
    assert_eq!(listen.pid, server_pid);
    assert_eq!(listening.ip().to_string(), "127.0.0.1");
    assert_ne!(listening.port(), 0, "listen reports the port the kernel picked");
    let verdict = classify(&effects, &ClassifyOptions::default());
    assert_eq!(verdict.class, TurnClass::Proc);
    assert!(verdict.reasons.contains(&Reason::ProcessSurvives { pid: server_pid, comm: "python3".into() }));
    assert!(verdict.reasons.iter().any(|r| matches!(r, Reason::Listening { pid, .. } if *pid == server_pid)));
    assert!(!verdict.external);

    // A loopback connect is not external; a UDP connect (sends nothing) to a
    // documentation address is.
    let client = format!(
        "import socket\n\
         socket.create_connection(('127.0.0.1', {port})).close()\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         u.connect(('198.51.100.7', 9))\n",
        port = listening.port()
    );
    cgroup.run(PYTHON, &["-I", "-B", "-c", &client]);
    let effects = drain_all(&inspector, "listen").await;
    let connects: Vec<String> = effects
        .iter()
        .filter_map(|e| match &e.kind {
            EffectKind::Connect { addr } => Some(addr.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(connects, vec![format!("127.0.0.1:{}", listening.port()), "198.51.100.7:9".to_string()]);
    let verdict = classify(&effects, &ClassifyOptions::default());
    assert!(verdict.external);
    assert!(verdict.reasons.contains(&Reason::ExternalConnect { pid: effects[0].pid, addr: "198.51.100.7:9".into() }));
}

#[tokio::test]
async fn mounts_are_recorded_with_their_target() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("mount");
    let scratch = Scratch::new("mount");
    std::fs::create_dir(scratch.path("m")).unwrap();
    let inspector = watching("mount", &cgroup).await;
    let script = format!("cd {} && mount -t tmpfs crabtest m && umount m", scratch.str());
    cgroup.run("/usr/bin/unshare", &["-m", "--propagation", "private", "/bin/sh", "-c", &script]);
    let effects = drain_all(&inspector, "mount").await;
    let mounts: Vec<&EffectKind> = effects.iter().map(|e| &e.kind).filter(|k| k.is_mount_change()).collect();
    assert_eq!(
        mounts,
        vec![
            // unshare makes its new mount namespace private first.
            &EffectKind::Mount {
                target: EffectPath::resolved("/"),
                source: "none".into(),
                fs_type: "".into(),
                flags: libc::MS_REC | libc::MS_PRIVATE,
            },
            &EffectKind::Mount {
                target: EffectPath::resolved(scratch.path("m")),
                source: "crabtest".into(),
                fs_type: "tmpfs".into(),
                flags: 0,
            },
            &EffectKind::Unmount { target: EffectPath::resolved(scratch.path("m")), flags: 0 },
        ],
        "{effects:#?}"
    );
    assert_eq!(classify(&effects, &ClassifyOptions::default()).class, TurnClass::Proc);
}

#[tokio::test]
async fn mount_table_names_the_file_system() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("fstype");
    let inspector = Inspector::start(InspectorConfig::default()).await.unwrap();
    let container = WatchedContainer { id: "fstype".into(), root_pid: Some(std::process::id()), rootfs: None };
    inspector.watch(cgroup.id, container).await.unwrap();
    cgroup.run("/bin/sh", &["-c", "echo > /dev/shm/crab-inspector-fstype; rm /dev/shm/crab-inspector-fstype"]);
    let effects = drain_all(&inspector, "fstype").await;
    let open = effects.iter().find(|e| e.changes_under(Path::new("/dev/shm"))).expect("write to /dev/shm seen");
    let EffectKind::Open { path, .. } = &open.kind else { panic!("{open:?}") };
    assert_eq!(path.fs_type.as_deref(), Some("tmpfs"), "{path:?}");
}

#[tokio::test]
async fn every_record_is_delivered_or_counted_lost() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    const FILES: usize = 3000;
    let cgroup = TestCgroup::new("lost");
    let scratch = Scratch::new("lost");
    // One page of ring buffer holds only a few records: a burst must overflow it.
    let inspector =
        watching_with("lost", &cgroup, InspectorConfig { ring_buffer_bytes: 4096, ..Default::default() }).await;
    let script = format!("cd {} && i=0; while [ $i -lt {FILES} ]; do : > f$i; i=$((i+1)); done", scratch.str());
    // Whether the reader falls behind depends on scheduling: repeat the burst
    // until it does. Every attempt must account for each record exactly.
    let mut saw_loss = false;
    for _attempt in 0..10 {
        cgroup.run("/bin/sh", &["-c", &script]);
        let turn = inspector.drain("lost", u64::MAX).await.unwrap();
        let delivered_files = file_changes_under(&turn.effects, &scratch.0).len() as u64;
        let delivered_lifecycle =
            turn.effects.iter().filter(|e| matches!(e.kind, EffectKind::Exec { .. } | EffectKind::Exit { .. })).count()
                as u64;
        // The shell's records: its exec, one open per file (all builtins), its exit.
        assert_eq!(delivered_files + delivered_lifecycle + turn.lost_events, FILES as u64 + 2);
        if turn.lost_events > 0 {
            let options = ClassifyOptions { lost_events: turn.lost_events, ..Default::default() };
            let verdict = classify(&turn.effects, &options);
            assert_eq!((verdict.class, verdict.escalated), (TurnClass::Proc, true));
            saw_loss = true;
            break;
        }
    }
    assert!(saw_loss, "a 4 KiB ring buffer kept up with {FILES}-record bursts 10 times");
    assert_eq!(inspector.take_lost_events("lost").unwrap(), 0, "lost counts are reported once");
}

/// Links in the kernel (anyone's) that run one of `inspector`'s programs: what the node pays for, as
/// the kernel counts it.
fn links_of(inspector: &Inspector) -> usize {
    let ids: HashSet<u32> = inspector.program_ids().into_iter().collect();
    libbpf_rs::query::LinkInfoIter::default().filter(|link| ids.contains(&link.prog_id)).count()
}

/// Waits (bounded) until `inspector`'s programs have `want` links; detaching runs in the background.
async fn wait_for_links(inspector: &Inspector, want: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while links_of(inspector) != want {
        assert!(Instant::now() < deadline, "{what}: {} links, want {want}", links_of(inspector));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn programs_are_attached_only_while_something_is_watched() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let first = TestCgroup::new("attach-a");
    let second = TestCgroup::new("attach-b");
    let scratch = Scratch::new("attach");
    let linger = Duration::from_secs(3);
    let inspector = Inspector::start(InspectorConfig { detach_after: linger, ..Default::default() }).await.unwrap();
    let programs = inspector.program_ids().len();
    assert!(programs > 0, "the inspector has programs");
    assert_eq!(links_of(&inspector), 0, "nothing watched: no program of the inspector is attached");

    let container = |id: &str| WatchedContainer { id: id.into(), root_pid: None, rootfs: None };
    inspector.watch(first.id, container("a")).await.unwrap();
    assert_eq!(links_of(&inspector), programs, "one container watched: every program attached");
    inspector.watch(second.id, container("b")).await.unwrap();
    assert_eq!(links_of(&inspector), programs, "attached once, however many containers");
    inspector.unwatch("a").await.unwrap();
    assert_eq!(links_of(&inspector), programs, "still watching one: still attached");
    let unwatched = Instant::now();
    inspector.unwatch("b").await.unwrap();
    // Sandboxes come and go in bursts: the programs stay for the linger, then go.
    let lingering = links_of(&inspector);
    if unwatched.elapsed() < linger {
        assert_eq!(lingering, programs, "within the linger after the last unwatch: still attached");
    }
    wait_for_links(&inspector, 0, "after the last unwatch").await;
    assert!(unwatched.elapsed() >= linger, "detached before the linger was over");

    // Watched again: attached again, and recording.
    inspector.watch(first.id, container("again")).await.unwrap();
    assert_eq!(links_of(&inspector), programs, "watched again: attached again");
    first.run("/bin/sh", &["-c", &format!("echo x > {}/f", scratch.str())]);
    let effects = drain_all(&inspector, "again").await;
    assert_eq!(file_changes_under(&effects, &scratch.0), vec![("open", one(scratch.path("f")))]);
    inspector.unwatch("again").await.unwrap();
    // A watch within the linger keeps the links it finds: attached once, not twice.
    inspector.watch(second.id, container("soon")).await.unwrap();
    assert_eq!(links_of(&inspector), programs, "watched within the linger: the same links");
    inspector.unwatch("soon").await.unwrap();
    wait_for_links(&inspector, 0, "after unwatching again").await;
}

#[tokio::test]
async fn turn_boundaries_cut_by_time_and_unwatch_stops_recording() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("turns");
    let scratch = Scratch::new("turns");
    let inspector = watching("turns", &cgroup).await;
    cgroup.run("/bin/sh", &["-c", &format!("echo 1 > {}/first", scratch.str())]);
    let boundary = crab_inspector::monotonic_now_ns();
    cgroup.run("/bin/sh", &["-c", &format!("echo 2 > {}/second", scratch.str())]);
    inspector.flush().await.unwrap();
    let first = inspector.take_effects_until("turns", boundary).unwrap();
    let second = inspector.take_effects("turns").unwrap();
    assert_eq!(file_changes_under(&first, &scratch.0), vec![("open", one(scratch.path("first")))]);
    assert_eq!(file_changes_under(&second, &scratch.0), vec![("open", one(scratch.path("second")))]);

    assert!(inspector.unwatch("turns").await.unwrap().is_empty());
    cgroup.run("/bin/sh", &["-c", &format!("echo 3 > {}/third", scratch.str())]);
    assert!(matches!(inspector.take_effects("turns"), Err(crab_inspector::InspectorError::NotWatched(_))));
}

#[tokio::test]
async fn paths_are_relative_to_the_process_root() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("chroot");
    let rootfs = Scratch::new("chroot");
    std::fs::create_dir_all(rootfs.path("bin")).unwrap();
    std::fs::create_dir_all(rootfs.path("w")).unwrap();
    std::fs::copy("/bin/busybox", rootfs.path("bin/busybox")).expect("busybox-static is installed");
    let inspector = watching("chroot", &cgroup).await;
    cgroup.run(
        "/usr/sbin/chroot",
        &[rootfs.str(), "/bin/busybox", "sh", "-c", "cd /w && echo a > f && mkdir d && mv f d/g"],
    );
    let effects = drain_all(&inspector, "chroot").await;
    assert_eq!(
        file_changes_under(&effects, Path::new("/w")),
        vec![
            ("open", one("/w/f".into())),
            ("mkdir", one("/w/d".into())),
            ("rename", vec!["/w/f".into(), "/w/d/g".into()]),
        ],
        "{effects:#?}"
    );
    assert_eq!(file_changes_under(&effects, &rootfs.0), vec![], "no host paths leak out");
    let busybox_exec = effects.iter().find_map(|e| match &e.kind {
        EffectKind::Exec { path, .. } if e.comm == "busybox" => Some(path.clone()),
        _ => None,
    });
    assert_eq!(busybox_exec, Some(EffectPath::resolved("/bin/busybox")));
}

// --- benchmark ----------------------------------------------------------------

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap().trim().trim_end_matches(" kB").parse().unwrap()
}

/// A git repository with many files: `CRAB_BENCH_REPO`, or a copy of
/// /usr/include committed once and kept in /tmp for later runs.
fn bench_repo() -> PathBuf {
    if let Ok(repo) = std::env::var("CRAB_BENCH_REPO") {
        return PathBuf::from(repo);
    }
    let repo = PathBuf::from("/tmp/crab-inspector-bench-repo");
    if !repo.join(".git").exists() {
        let _ = std::fs::remove_dir_all(&repo);
        let script = format!(
            "cp -a /usr/include {r} && cd {r} && git init -q && git add -A && \
             git -c user.name=bench -c user.email=bench@localhost commit -qm files",
            r = repo.display()
        );
        assert!(Command::new("/bin/sh").args(["-c", &script]).status().unwrap().success());
    }
    repo
}

fn malloc_trimmed_rss_kib() -> u64 {
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe { libc::malloc_trim(0) };
    rss_kib()
}

/// Wall-clock and CPU (user + system) time of one run. The BPF programs run
/// inside the workload's syscalls, so their cost is its system time: CPU
/// time shows it even when other load makes wall-clock time noisy.
#[derive(Debug, Clone, Copy)]
struct Timing {
    wall: Duration,
    cpu: Duration,
}

/// CPU time of the waited-for children of this process so far.
fn children_cpu() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct we own.
    let usage = unsafe {
        assert_eq!(libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()), 0);
        usage.assume_init()
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

struct Samples {
    without: Vec<Timing>,
    loaded: Vec<Timing>,
    watching: Vec<Timing>,
    records: usize,
    lost: u64,
    /// Inspector::start (load only: programs attach at the first watch) and drop times.
    starts: Vec<Duration>,
    stops: Vec<Duration>,
}

#[derive(Clone, Copy)]
enum Variant {
    Without,
    Loaded,
    Watching,
}

const BENCH_CONTAINER: &str = "bench";

/// The inspector state a variant runs under, changed only when needed.
#[derive(Default)]
struct BenchState {
    inspector: Option<Inspector>,
    watching: bool,
}

impl BenchState {
    async fn enter(&mut self, variant: Variant, cgroup: &TestCgroup, samples: &mut Samples) {
        if matches!(variant, Variant::Without) {
            if let Some(inspector) = self.inspector.take() {
                self.take_turn(&inspector, samples).await;
                let start = Instant::now();
                drop(inspector);
                samples.stops.push(start.elapsed());
                self.watching = false;
            }
            return;
        }
        if self.inspector.is_none() {
            let start = Instant::now();
            self.inspector = Some(Inspector::start(InspectorConfig::default()).await.unwrap());
            samples.starts.push(start.elapsed());
        }
        let inspector = self.inspector.as_ref().unwrap();
        let want_watching = matches!(variant, Variant::Watching);
        if want_watching && !self.watching {
            let container = WatchedContainer { id: BENCH_CONTAINER.into(), root_pid: None, rootfs: None };
            inspector.watch(cgroup.id, container).await.unwrap();
        } else if !want_watching && self.watching {
            self.take_turn(inspector, samples).await;
            inspector.unwatch(BENCH_CONTAINER).await.unwrap();
        }
        self.watching = want_watching;
    }

    async fn take_turn(&self, inspector: &Inspector, samples: &mut Samples) {
        if self.watching {
            let turn = inspector.drain(BENCH_CONTAINER, u64::MAX).await.unwrap();
            samples.records += turn.effects.len();
            samples.lost += turn.lost_events;
        }
    }
}

/// Runs without the inspector, with it loaded but watching another cgroup,
/// and with it watching, in an order that rotates each round: drift on the
/// machine and caches warmed by the previous run favour no variant.
async fn compare(cgroup: &TestCgroup, script: &str, rounds: usize) -> Samples {
    let mut samples = Samples {
        without: vec![],
        loaded: vec![],
        watching: vec![],
        records: 0,
        lost: 0,
        starts: vec![],
        stops: vec![],
    };
    let mut state = BenchState::default();
    let order = [Variant::Without, Variant::Loaded, Variant::Watching];
    for round in 0..rounds {
        for i in 0..order.len() {
            let variant = order[(round + i) % order.len()];
            state.enter(variant, cgroup, &mut samples).await;
            let (start, cpu_start) = (Instant::now(), children_cpu());
            cgroup.run("/bin/sh", &["-c", script]);
            let elapsed = Timing { wall: start.elapsed(), cpu: children_cpu() - cpu_start };
            match variant {
                Variant::Without => samples.without.push(elapsed),
                Variant::Loaded => samples.loaded.push(elapsed),
                Variant::Watching => samples.watching.push(elapsed),
            }
        }
    }
    state.enter(Variant::Without, cgroup, &mut samples).await;
    samples
}

fn report(title: &str, samples: &Samples) {
    let watching_total: Duration = samples.watching.iter().map(|t| t.wall).sum();
    let medians = |timings: &[Timing]| {
        (median(timings.iter().map(|t| t.wall).collect()), median(timings.iter().map(|t| t.cpu).collect()))
    };
    let without = medians(&samples.without);
    println!("{title} (median of {})", samples.without.len());
    println!("  no inspector          {:>8.3} s wall {:>8.3} s cpu", without.0.as_secs_f64(), without.1.as_secs_f64());
    for (name, timings) in [("loaded, not watching", &samples.loaded), ("watching", &samples.watching)] {
        let (wall, cpu) = medians(timings);
        println!(
            "  {name:<21} {:>8.3} s wall {:>8.3} s cpu  ratio {:.3} wall {:.3} cpu",
            wall.as_secs_f64(),
            cpu.as_secs_f64(),
            wall.as_secs_f64() / without.0.as_secs_f64(),
            cpu.as_secs_f64() / without.1.as_secs_f64()
        );
    }
    println!(
        "  records while watching: {} ({:.0}/s), lost {}",
        samples.records,
        samples.records as f64 / watching_total.as_secs_f64(),
        samples.lost
    );
    println!(
        "  inspector start (load; attached at the first watch) {:.0} ms, stop {:.0} ms (medians)",
        median(samples.starts.clone()).as_secs_f64() * 1e3,
        median(samples.stops.clone()).as_secs_f64() * 1e3
    );
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark: cargo test --release --test inspector -- --ignored --nocapture"]
async fn inspector_overhead_benchmark() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    // A multiple of 3: each variant runs in each position of the rotation alike.
    const ROUNDS: usize = 6;
    const FILES: usize = 20_000;
    const WRITES: usize = 200_000;
    let repo = bench_repo();
    let cgroup = TestCgroup::new("bench");
    let scratch = Scratch::new("bench");
    let read_heavy =
        format!("find /usr -type f | wc -l > /dev/null; cd {} && git status --porcelain > /dev/null", repo.display());
    let write_heavy =
        format!("cd {} && i=0; while [ $i -lt {FILES} ]; do : > f$i; i=$((i+1)); done; rm -f f*", scratch.str());
    // Every write syscall passes the inspector's write program and its dedup map.
    let write_loop = format!("dd if=/dev/zero of={}/big bs=512 count={WRITES} status=none", scratch.str());
    // Warm the page cache and git's index stat data.
    cgroup.run("/bin/sh", &["-c", &read_heavy]);

    let read = compare(&cgroup, &read_heavy, ROUNDS).await;
    report(&format!("find /usr -type f | wc -l; git status in {}", repo.display()), &read);
    let write = compare(&cgroup, &write_heavy, ROUNDS).await;
    report(&format!("{FILES} file creations then rm -f in a shell loop"), &write);
    let writes = compare(&cgroup, &write_loop, ROUNDS).await;
    report(&format!("{WRITES} writes of 512 B (dd)"), &writes);

    let rss_before = malloc_trimmed_rss_kib();
    let inspector = Inspector::start(InspectorConfig::default()).await.unwrap();
    let rss_loaded = malloc_trimmed_rss_kib();
    println!(
        "memory: BPF maps {} KiB (ring buffer 16 MiB); process RSS +{} KiB once loaded",
        inspector.map_memory_bytes() / 1024,
        rss_loaded.saturating_sub(rss_before)
    );

    // Kernel-side cost, free of the noise of wall-clock runs on a shared machine.
    inspector.watch(cgroup.id, WatchedContainer { id: "bench".into(), root_pid: None, rootfs: None }).await.unwrap();
    const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
    std::fs::write(BPF_STATS, "1").unwrap();
    for (title, script) in [("read-heavy", &read_heavy), ("write-heavy", &write_heavy), ("write-loop", &write_loop)] {
        let before = inspector.program_stats();
        cgroup.run("/bin/sh", &["-c", script]);
        let records = inspector.drain("bench", u64::MAX).await.unwrap().effects.len();
        let total_ns: u64 =
            inspector.program_stats().iter().zip(&before).map(|(a, b)| a.run_time_ns - b.run_time_ns).sum();
        println!("BPF time, {title} run: {:.1} ms in all programs, {records} records", total_ns as f64 / 1e6);
        for (after, before) in inspector.program_stats().iter().zip(&before) {
            let runs = after.run_count - before.run_count;
            if runs > 0 {
                let avg = (after.run_time_ns - before.run_time_ns) as f64 / runs as f64;
                println!("  {:<14} {runs:>9} runs  {avg:>7.0} ns/run", after.name);
            }
        }
    }
    std::fs::write(BPF_STATS, "0").unwrap();
    assert_eq!(write.lost, 0, "the default ring buffer keeps up with a shell loop");
    assert_eq!(write.records, ROUNDS * (2 * FILES + 5), "every create and unlink recorded");
    // sh's exec, dd's fork and exec, dd's open of its output (which stands for
    // its 200 000 writes), two exits.
    assert_eq!(writes.records, ROUNDS * 6, "a write loop adds no record to the open");
}

#[tokio::test]
async fn descriptor_outside_the_process_root_is_unresolved() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("escape");
    let scratch = Scratch::new("escape");
    std::fs::create_dir_all(scratch.path("outside")).unwrap();
    std::fs::create_dir_all(scratch.path("root")).unwrap();
    let inspector = watching("escape", &cgroup).await;
    // A descriptor opened before chroot points above the new root: the path
    // it names has no meaning inside the root and must not be guessed.
    let program = format!(
        "import os\n\
         d = os.open('{outside}', os.O_RDONLY | os.O_DIRECTORY)\n\
         os.chroot('{root}')\n\
         os.close(os.open('f', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d))\n",
        outside = scratch.path("outside").display(),
        root = scratch.path("root").display()
    );
    cgroup.run(PYTHON, &["-I", "-B", "-c", &program]);
    assert!(scratch.path("outside/f").exists());
    let effects = drain_all(&inspector, "escape").await;
    let opens: Vec<&EffectPath> = effects
        .iter()
        .filter_map(|e| match &e.kind {
            EffectKind::Open { path, .. } if path.path.ends_with("f") => Some(path),
            _ => None,
        })
        .collect();
    assert_eq!(opens.len(), 1, "{effects:#?}");
    assert!(!opens[0].resolved, "{:?}", opens[0]);
    let verdict = classify(&effects, &ClassifyOptions::default());
    assert_eq!((verdict.class, verdict.escalated), (TurnClass::Fs, true), "{verdict:#?}");
}

/// A path string in a page the process never touched cannot be read at
/// syscall entry (BPF reads may not fault pages in): the inspector reads it
/// again at the exit of the successful call. git hits this opening
/// "/dev/null" from its read-only data.
#[tokio::test]
async fn path_strings_in_pages_not_yet_paged_in_are_resolved() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("unpaged");
    let scratch = Scratch::new("unpaged");
    let base = scratch.path("base");
    std::fs::create_dir_all(&base).unwrap();
    // One string per page; each page gets a mapping of its own so that the
    // kernel's fault-around on one cannot map another.
    let strings =
        [format!("{}/absolute", base.display()), "relative".to_string(), "relative".to_string(), "renamed".to_string()];
    let mut pages = Vec::new();
    for s in &strings {
        let mut page = s.as_bytes().to_vec();
        page.resize(4096, 0);
        pages.extend(page);
    }
    std::fs::write(scratch.path("strings"), &pages).unwrap();
    let inspector = watching("unpaged", &cgroup).await;

    let program = format!(
        r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.open.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
libc.rename.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
PROT_READ, MAP_PRIVATE = 1, 2
fd = os.open("{strings}", os.O_RDONLY)
page = [libc.mmap(None, 4096, PROT_READ, MAP_PRIVATE, fd, i * 4096) for i in range(4)]
os.chdir("{base}")
def check(ret):
    if ret < 0:
        raise OSError(ctypes.get_errno(), "call failed")
    return ret
os.close(check(libc.open(page[0], os.O_WRONLY | os.O_CREAT, 0o644)))
os.close(check(libc.open(page[1], os.O_WRONLY | os.O_CREAT, 0o644)))
check(libc.rename(page[2], page[3]))
"#,
        strings = scratch.path("strings").display(),
        base = base.display()
    );
    cgroup.run(PYTHON, &["-I", "-B", "-c", &program]);
    let effects = drain_all(&inspector, "unpaged").await;

    assert_eq!(
        file_changes_under(&effects, &scratch.0),
        vec![
            ("open", one(base.join("absolute"))),
            ("open", one(base.join("relative"))),
            ("rename", vec![base.join("relative"), base.join("renamed")]),
        ],
        "all effects: {effects:#?}"
    );
    let unresolved: Vec<&Effect> =
        effects.iter().filter(|e| e.kind.changed_paths().iter().any(|p| !p.resolved)).collect();
    assert!(unresolved.is_empty(), "unresolved paths: {unresolved:#?}");
}

/// A Python interpreter in a test cgroup that runs one line of code per
/// request and answers "ok": a long-lived process whose writes happen in the
/// turn the test chooses, through descriptors and mappings of earlier turns.
struct Interpreter {
    child: KillOnDrop,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Interpreter {
    const LOOP: &'static str = "import sys, os, mmap, socket\n\
        for line in sys.stdin:\n    exec(line)\n    sys.stdout.write('ok\\n')\n    sys.stdout.flush()\n";

    fn start(cgroup: &TestCgroup) -> Self {
        let mut child = cgroup
            .command(PYTHON, &["-I", "-B", "-u", "-c", Self::LOOP])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        Self { child: KillOnDrop(child), stdin, stdout }
    }

    fn pid(&self) -> u32 {
        self.child.0.id()
    }

    /// Runs one line of Python (`;`-separated statements) and waits for it.
    fn run(&mut self, code: &str) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{code}").unwrap();
        self.stdin.flush().unwrap();
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).unwrap();
        assert_eq!(answer, "ok\n", "`{code}` failed");
        self.wait_until_reading_stdin();
    }

    /// The answer is written before the loop's tail (flush, the next
    /// `readline`) has run: on a loaded machine that tail, with its own
    /// syscalls, lands in whatever turn the test drains next. The turn is over
    /// only once the interpreter blocks in read(0), which `/proc/<pid>/syscall`
    /// shows as syscall 0 with descriptor 0.
    fn wait_until_reading_stdin(&self) {
        let path = format!("/proc/{}/syscall", self.pid());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let now = std::fs::read_to_string(&path).unwrap_or_default();
            if now.starts_with("0 0x0 ") {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the interpreter never went back to reading its stdin (syscall: {now:?})"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// The file writes (kind Write) of `pid` in `effects`, as (operation, path).
fn writes_of(effects: &[Effect], pid: u32) -> Vec<(&'static str, PathBuf)> {
    effects
        .iter()
        .filter(|e| e.pid == pid)
        .filter_map(|e| match &e.kind {
            EffectKind::Write { path, via, .. } => Some((via.name(), path.path.clone())),
            _ => None,
        })
        .collect()
}

/// One turn: drains up to now, as the shim does at a turn's end.
async fn turn(inspector: &Inspector, container: &str) -> Vec<Effect> {
    let until = crab_inspector::monotonic_now_ns();
    inspector.drain(container, until).await.unwrap().effects
}

#[tokio::test]
async fn a_daemon_writing_through_a_descriptor_of_an_earlier_turn_is_seen() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("olddesc");
    let scratch = Scratch::new("olddesc");
    let log = scratch.path("access.log");
    let inspector = watching("olddesc", &cgroup).await;
    let mut daemon = Interpreter::start(&cgroup);
    // The copies below refuse O_APPEND descriptors: `out` is a plain one.
    daemon.run(&format!("log = open('{log}', 'a'); out = os.open('{log}', os.O_WRONLY)", log = log.display()));
    let opening = turn(&inspector, "olddesc").await;
    assert_eq!(file_changes_under(&opening, &scratch.0), vec![("open", one(log.clone())), ("open", one(log.clone()))]);

    // A later turn: only a write through the old descriptor.
    daemon.run("log.write('GET /\\n'); log.flush()");
    let serving = turn(&inspector, "olddesc").await;
    assert_eq!(writes_of(&serving, daemon.pid()), vec![("write", log.clone())]);
    let verdict = classify(&serving, &ClassifyOptions::default());
    assert_eq!((verdict.class, verdict.escalated), (TurnClass::Fs, false), "{verdict:#?}");

    // A tight loop of writes is one record per turn.
    daemon.run("[(log.write('x\\n'), log.flush()) for _ in range(2000)]");
    let busy = turn(&inspector, "olddesc").await;
    assert_eq!(writes_of(&busy, daemon.pid()), vec![("write", log.clone())]);

    // Other ways to put data in the file: pwrite, writev, fallocate, and
    // copies into it from another file.
    for (code, op) in [
        ("os.pwrite(out, b'p', 0)", "write"),
        ("os.writev(log.fileno(), [b'a', b'b'])", "write"),
        ("os.posix_fallocate(out, 0, 8192)", "fallocate"),
        ("src = os.open('/etc/hostname', os.O_RDONLY); os.sendfile(out, src, 0, 4); os.close(src)", "sendfile"),
        (
            "src = os.open('/etc/hostname', os.O_RDONLY); os.copy_file_range(src, out, 4, 0, 0); os.close(src)",
            "copy_file_range",
        ),
        ("r, w = os.pipe(); os.write(w, b'spliced'); os.splice(r, out, 7); os.close(r); os.close(w)", "splice"),
    ] {
        daemon.run(code);
        let effects = turn(&inspector, "olddesc").await;
        assert_eq!(writes_of(&effects, daemon.pid()), vec![(op, log.clone())], "`{code}`: {effects:#?}");
    }

    // An idle turn: nothing.
    let idle = turn(&inspector, "olddesc").await;
    assert!(writes_of(&idle, daemon.pid()).is_empty(), "{idle:#?}");
    assert_eq!(classify(&idle, &ClassifyOptions::default()).class, TurnClass::Clean);
}

/// The kernel compares writes with the boundary the last drain set: a write
/// after a turn's end but before the drain that ends it looks like a repeat of
/// the turn's own record. The drain carries it into the next turn.
#[tokio::test]
async fn a_write_between_the_cut_and_the_drain_lands_in_the_next_turn() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("cut");
    let scratch = Scratch::new("cut");
    let file = scratch.path("f");
    std::fs::write(&file, "").unwrap();
    let inspector = watching("cut", &cgroup).await;
    let mut daemon = Interpreter::start(&cgroup);
    daemon.run(&format!("f = open('{}', 'r+')", file.display()));
    turn(&inspector, "cut").await;

    daemon.run("f.write('1'); f.flush()");
    let until = crab_inspector::monotonic_now_ns();
    daemon.run("f.write('2'); f.flush()");
    let first = inspector.drain("cut", until).await.unwrap().effects;
    assert_eq!(writes_of(&first, daemon.pid()), vec![("write", file.clone())]);
    let second = turn(&inspector, "cut").await;
    let carried = writes_of(&second, daemon.pid());
    assert_eq!(carried, vec![("write", file.clone())], "{second:#?}");
    assert!(second.iter().all(|e| e.time_ns > until));
}

/// The kernel takes no time for the repeats of a process started in the
/// turn of its record: the drain carries such a write into the next turn
/// unless the process was gone by the cut. A process that keeps writing past
/// the cut is in the next turn; one that exited before it is not.
#[tokio::test]
async fn repeats_of_a_process_from_this_turn_after_the_cut_land_in_the_next_turn() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("untimed");
    let scratch = Scratch::new("untimed");
    let file = scratch.path("f");
    std::fs::write(&file, "").unwrap();
    let inspector = watching("untimed", &cgroup).await;
    // A boundary before the process starts: it belongs to the next turn.
    turn(&inspector, "untimed").await;
    let mut writer = Interpreter::start(&cgroup);
    writer.run(&format!(
        "fd = os.open('{}', os.O_WRONLY | os.O_APPEND); os.write(fd, b'1'); os.write(fd, b'2')",
        file.display()
    ));
    let until = crab_inspector::monotonic_now_ns();
    // After the cut, before the drain: compared with the old boundary, a repeat.
    writer.run("os.write(fd, b'3')");
    let first = inspector.drain("untimed", until).await.unwrap().effects;
    assert_eq!(file_changes_under(&first, &scratch.0), vec![("open", one(file.clone()))], "{first:#?}");
    let second = turn(&inspector, "untimed").await;
    assert_eq!(writes_of(&second, writer.pid()), vec![("write", file.clone())], "{second:#?}");
    assert!(second.iter().all(|e| e.time_ns > until));
    // From now on the writer is from an earlier turn: an idle turn is clean.
    let idle = turn(&inspector, "untimed").await;
    assert!(writes_of(&idle, writer.pid()).is_empty(), "{idle:#?}");

    // A write loop that ends before the cut: its turn only.
    let output = cgroup.run(
        "/bin/sh",
        &["-c", &format!("dd if=/dev/zero of={} bs=512 count=2000 conv=notrunc status=none; echo $$", file.display())],
    );
    let shell: u32 = String::from_utf8_lossy(&output.stdout).trim().parse().unwrap();
    let looped = turn(&inspector, "untimed").await;
    assert_eq!(file_changes_under(&looped, &scratch.0), vec![("open", one(file.clone()))], "{looped:#?}");
    let after = turn(&inspector, "untimed").await;
    assert!(
        file_changes_under(&after, &scratch.0).is_empty(),
        "dd (a child of {shell}) was gone by the cut: {after:#?}"
    );
    assert_eq!(classify(&after, &ClassifyOptions::default()).class, TurnClass::Clean);
}

/// A write that repeats one already recorded in the turn is not recorded
/// again, but what else happens to the file is: a rename, a truncation and a
/// new open after such a repeat are each reported, within the turn and in the
/// turns after.
#[tokio::test]
async fn a_file_renamed_truncated_or_rewritten_after_a_repeat_is_still_reported() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    for started_in_turn in [false, true] {
        let name = if started_in_turn { "hitnew" } else { "hitold" };
        let cgroup = TestCgroup::new(name);
        let scratch = Scratch::new(name);
        let (a, b) = (scratch.path("a"), scratch.path("b"));
        std::fs::write(&a, "").unwrap();
        let inspector = watching(name, &cgroup).await;
        let mut writer = Interpreter::start(&cgroup);
        if !started_in_turn {
            writer.run(&format!("fd = os.open('{}', os.O_WRONLY)", a.display()));
            turn(&inspector, name).await;
        } else {
            turn(&inspector, name).await;
            writer.run(&format!("fd = os.open('{}', os.O_WRONLY)", a.display()));
        }
        let first_write = if started_in_turn { ("open", one(a.clone())) } else { ("write", one(a.clone())) };

        // Written twice (the second a repeat), renamed, written again.
        writer.run(&format!(
            "os.write(fd, b'x'); os.write(fd, b'y'); os.rename('{}', '{}'); os.write(fd, b'z')",
            a.display(),
            b.display()
        ));
        let renamed = turn(&inspector, name).await;
        assert_eq!(
            file_changes_under(&renamed, &scratch.0),
            vec![first_write.clone(), ("rename", vec![a.clone(), b.clone()])],
            "{name}: {renamed:#?}"
        );
        let verdict = classify(&renamed, &ClassifyOptions::default());
        assert_eq!(verdict.class, TurnClass::Fs, "{name}: {verdict:#?}");

        // The next turn: the file under its new name, written after a repeat, then truncated.
        writer.run("os.write(fd, b'1'); os.write(fd, b'2'); os.ftruncate(fd, 0); os.write(fd, b'3')");
        let truncated = turn(&inspector, name).await;
        assert_eq!(
            file_changes_under(&truncated, &scratch.0),
            vec![("write", one(b.clone())), ("truncate", one(b.clone()))],
            "{name}: {truncated:#?}"
        );

        // Written after a repeat, then opened again with O_TRUNC and rewritten.
        writer.run(&format!(
            "os.write(fd, b'4'); os.write(fd, b'5'); g = os.open('{}', os.O_WRONLY | os.O_TRUNC); os.write(g, b'6'); os.close(g)",
            b.display()
        ));
        let rewritten = turn(&inspector, name).await;
        assert_eq!(
            file_changes_under(&rewritten, &scratch.0),
            vec![("write", one(b.clone())), ("open", one(b.clone()))],
            "{name}: {rewritten:#?}"
        );

        // Nothing more: clean.
        let idle = turn(&inspector, name).await;
        assert!(file_changes_under(&idle, &scratch.0).is_empty(), "{name}: {idle:#?}");
    }
}

#[tokio::test]
async fn writes_to_pipes_sockets_memfd_and_devices_are_not_file_effects() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("notfiles");
    let inspector = watching("notfiles", &cgroup).await;
    let mut daemon = Interpreter::start(&cgroup);
    daemon.run(
        "r, w = os.pipe(); a, b = socket.socketpair(); m = os.memfd_create('m'); \
         n = os.open('/dev/null', os.O_WRONLY); e = os.eventfd(0)",
    );
    turn(&inspector, "notfiles").await;
    daemon.run(
        "os.write(w, b'x'); a.send(b'x'); os.write(m, b'x'); os.write(n, b'x'); \
         os.eventfd_write(e, 1); os.ftruncate(m, 4096); mm = mmap.mmap(m, 4096); mm[0] = 1",
    );
    let effects = turn(&inspector, "notfiles").await;
    assert!(writes_of(&effects, daemon.pid()).is_empty(), "{effects:#?}");
    let verdict = classify(&effects, &ClassifyOptions::default());
    assert_eq!(verdict.class, TurnClass::Clean, "{verdict:#?}");
}

#[tokio::test]
async fn shared_mappings_count_in_the_turns_their_process_runs() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("mmap");
    let scratch = Scratch::new("mmap");
    let data = scratch.path("data.bin");
    std::fs::write(&data, vec![0u8; 4096]).unwrap();
    let inspector = watching("mmap", &cgroup).await;
    let mut daemon = Interpreter::start(&cgroup);
    turn(&inspector, "mmap").await;

    daemon.run(&format!("fd = os.open('{}', os.O_RDWR); mm = mmap.mmap(fd, 4096); mm[0] = 1", data.display()));
    let mapping = turn(&inspector, "mmap").await;
    assert_eq!(writes_of(&mapping, daemon.pid()), vec![("shared mmap", data.clone())]);

    // Stores through the mapping need no syscall: the turn counts because the
    // process ran. msync is a write too.
    daemon.run("mm[1] = 2; mm.flush()");
    let storing = turn(&inspector, "mmap").await;
    let ops: Vec<&str> = writes_of(&storing, daemon.pid())
        .into_iter()
        .map(|(op, path)| {
            assert_eq!(path, data);
            op
        })
        .collect();
    assert!(ops.contains(&"msync"), "{storing:#?}");
    assert!(ops.contains(&"shared mmap of an earlier turn"), "{storing:#?}");
    assert_eq!(classify(&storing, &ClassifyOptions::default()).class, TurnClass::Fs);

    // It may have run after that turn's cut: the next turn counts too. Idle
    // after that, it cannot have stored anything.
    turn(&inspector, "mmap").await;
    let idle = turn(&inspector, "mmap").await;
    assert!(writes_of(&idle, daemon.pid()).is_empty(), "{idle:#?}");

    // Unmapped: running no longer counts.
    daemon.run("mm.close()");
    turn(&inspector, "mmap").await;
    turn(&inspector, "mmap").await;
    daemon.run("x = sum(range(1000))");
    let unmapped = turn(&inspector, "mmap").await;
    assert!(writes_of(&unmapped, daemon.pid()).is_empty(), "{unmapped:#?}");
}

#[tokio::test]
async fn metadata_calls_on_descriptors_name_the_file() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("fdmeta");
    let scratch = Scratch::new("fdmeta");
    let file = scratch.path("f");
    std::fs::write(&file, "x").unwrap();
    let inspector = watching("fdmeta", &cgroup).await;
    let mut daemon = Interpreter::start(&cgroup);
    daemon.run(&format!(
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); fd = os.open('{}', os.O_RDONLY)",
        file.display()
    ));
    turn(&inspector, "fdmeta").await;
    // AT_EMPTY_PATH = 0x1000; fchmodat2 is syscall 452 everywhere.
    for (code, op) in [
        ("os.chmod(fd, 0o600)", "chmod"),
        ("os.chown(fd, -1, 0)", "chown"),
        ("os.setxattr(fd, 'user.k', b'v')", "setxattr"),
        ("os.removexattr(fd, 'user.k')", "removexattr"),
        ("os.utime(fd, (0, 0))", "utimes"),
        ("assert libc.syscall(452, fd, b'', 0o640, 0x1000) == 0, ctypes.get_errno()", "chmod"),
        ("assert libc.fchownat(fd, b'', -1, 0, 0x1000) == 0, ctypes.get_errno()", "chown"),
    ] {
        daemon.run(code);
        let effects = turn(&inspector, "fdmeta").await;
        assert_eq!(file_changes_under(&effects, &scratch.0), vec![(op, one(file.clone()))], "`{code}`: {effects:#?}");
    }
}

/// Keeps an inspector loaded for `CRAB_HOLD_SECS` seconds, watching the
/// cgroup v2 directory `CRAB_HOLD_CGROUP` when set: for measuring other
/// programs against it by hand.
#[tokio::test]
#[ignore = "manual: CRAB_HOLD_SECS=30 cargo test --release --test inspector -- --ignored hold_inspector"]
async fn hold_inspector() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let secs: u64 = std::env::var("CRAB_HOLD_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let start = Instant::now();
    let inspector = Inspector::start(InspectorConfig::default()).await.unwrap();
    println!("loaded in {:?} (attached only while something is watched)", start.elapsed());
    if let Ok(dir) = std::env::var("CRAB_HOLD_CGROUP") {
        let container = WatchedContainer { id: "held".into(), root_pid: None, rootfs: None };
        inspector.watch(cgroup_id_of_dir(Path::new(&dir)).unwrap(), container).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let start = Instant::now();
    drop(inspector);
    println!("detached in {:?}", start.elapsed());
}

/// The helper that writes files through io_uring and AIO (see its header).
const ASYNC_IO_HELPER_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/bpf/testdata");

/// The asynchronous I/O calls of `pid` in `effects`, as (call, polling ring).
fn async_io_of(effects: &[Effect], pid: u32) -> Vec<(AsyncIoCall, bool)> {
    effects
        .iter()
        .filter(|e| e.pid == pid)
        .filter_map(|e| match e.kind {
            EffectKind::AsyncIo { call, polling_ring } => Some((call, polling_ring)),
            _ => None,
        })
        .collect()
}

/// An interpreter with the asynchronous I/O helper imported.
fn async_io_interpreter(cgroup: &TestCgroup) -> Interpreter {
    let mut interpreter = Interpreter::start(cgroup);
    interpreter.run(&format!("sys.path.insert(0, '{ASYNC_IO_HELPER_DIR}'); import async_io"));
    interpreter
}

/// What classify says of a turn whose file changes only the kernel saw.
fn assert_escalated_naming(effects: &[Effect], call: &str) {
    let verdict = classify(effects, &ClassifyOptions::default());
    assert_eq!((verdict.class, verdict.escalated), (TurnClass::Fs, true), "{verdict:#?}");
    assert!(
        verdict.reasons.iter().any(|r| matches!(r, Reason::AsyncIo { call: c, .. } if *c == call)),
        "no reason names {call}: {verdict:#?}"
    );
}

#[tokio::test]
async fn io_uring_and_aio_escalate_the_turns_they_write_in() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("async-io");
    let scratch = Scratch::new("async-io");
    let inspector = watching("async-io", &cgroup).await;
    let mut daemon = async_io_interpreter(&cgroup);
    turn(&inspector, "async-io").await;

    // io_uring opens and writes the file itself: no open or write syscall.
    let ring_file = scratch.path("ring.txt");
    daemon.run(&format!("async_io.Ring().write_file('{}', 'through the ring')", ring_file.display()));
    let ring_turn = turn(&inspector, "async-io").await;
    assert_eq!(std::fs::read_to_string(&ring_file).unwrap(), "through the ring");
    assert!(
        file_changes_under(&ring_turn, &scratch.0).is_empty(),
        "the ring's own open and write are invisible: {ring_turn:#?}"
    );
    assert_eq!(
        async_io_of(&ring_turn, daemon.pid()),
        vec![(AsyncIoCall::IoUringSetup, false), (AsyncIoCall::IoUringEnter, false)]
    );
    assert_escalated_naming(&ring_turn, "io_uring_enter");

    // AIO through a descriptor of an earlier turn: io_submit is the only sign.
    let aio_file = scratch.path("aio.txt");
    daemon.run(&format!("fd = os.open('{}', os.O_WRONLY | os.O_CREAT, 0o644)", aio_file.display()));
    turn(&inspector, "async-io").await;
    daemon.run("async_io.aio_write(fd, 'through aio')");
    let aio_turn = turn(&inspector, "async-io").await;
    assert_eq!(std::fs::read_to_string(&aio_file).unwrap(), "through aio");
    assert!(file_changes_under(&aio_turn, &scratch.0).is_empty(), "{aio_turn:#?}");
    assert_eq!(async_io_of(&aio_turn, daemon.pid()), vec![(AsyncIoCall::IoSubmit, false)]);
    assert_escalated_naming(&aio_turn, "io_submit");

    // Nothing asynchronous any more: the process's turns are clean again.
    daemon.run("x = sum(range(1000))");
    let quiet = turn(&inspector, "async-io").await;
    assert!(async_io_of(&quiet, daemon.pid()).is_empty(), "{quiet:#?}");
}

#[tokio::test]
async fn a_polling_ring_escalates_every_turn_its_process_runs_in() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    let cgroup = TestCgroup::new("sqpoll");
    let scratch = Scratch::new("sqpoll");
    let inspector = watching("sqpoll", &cgroup).await;
    let mut daemon = async_io_interpreter(&cgroup);
    turn(&inspector, "sqpoll").await;

    // The ring's kernel thread polls for 10 s after each request (the first
    // may need a wake-up syscall when the thread went to sleep before it).
    daemon.run("ring = async_io.Ring(async_io.IORING_SETUP_SQPOLL, 10_000); ring.nop()");
    let setup = turn(&inspector, "sqpoll").await;
    assert_eq!(async_io_of(&setup, daemon.pid()).first(), Some(&(AsyncIoCall::IoUringSetup, true)), "{setup:#?}");

    // Polling, it takes the next requests from memory: no syscall at all,
    // and still the turn is not clean.
    let file = scratch.path("polled.txt");
    daemon.run(&format!("ring.write_file('{}', 'no syscall')", file.display()));
    let polled = turn(&inspector, "sqpoll").await;
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "no syscall");
    let calls = async_io_of(&polled, daemon.pid());
    assert!(calls.contains(&(AsyncIoCall::EarlierPollingRing, true)), "{polled:#?}");
    assert!(!calls.contains(&(AsyncIoCall::IoUringEnter, false)), "the request needed no syscall: {polled:#?}");
    assert_escalated_naming(&polled, "io_uring (polling ring of an earlier turn)");

    // Gone with its process.
    drop(daemon);
    turn(&inspector, "sqpoll").await;
    let after = turn(&inspector, "sqpoll").await;
    assert!(!after.iter().any(|e| matches!(e.kind, EffectKind::AsyncIo { .. })), "{after:#?}");
}

/// A `renameat2` storm over ever new names in one watched cgroup: what the inspector keeps of
/// it stops at the container's bound (the drain reports the overflow, and the effects it hands
/// over are a small part of the storm), and drains of another watched cgroup meanwhile answer
/// promptly and completely: the reader answers a flush once the records before it are read,
/// not once the storm leaves the ring buffer empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_storm_is_cut_at_its_bound_and_holds_up_no_other_drain() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    const BOUND: usize = 1 << 20;
    let storm = TestCgroup::new("storm");
    let quiet = TestCgroup::new("storm-quiet");
    let scratch = Scratch::new("storm");
    let config = InspectorConfig { max_effects_bytes: BOUND, ..Default::default() };
    let inspector = watching_with("storm", &storm, config).await;
    let quiet_container = WatchedContainer { id: "quiet".into(), root_pid: None, rootfs: None };
    inspector.watch(quiet.id, quiet_container).await.unwrap();
    let script = format!(
        r#"
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
stem = b"{dir}/" + b"n" * 200
cur = stem + b"0"
open(cur, "wb").close()
end = time.monotonic() + 4
i = 0
while time.monotonic() < end:
    for _ in range(500):
        i += 1
        nxt = stem + str(i).encode()
        if libc.renameat2(-100, cur, -100, nxt, 0) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")
        cur = nxt
print(i)
"#,
        dir = scratch.str()
    );
    let mut child = storm.command(PYTHON, &["-c", &script]).stdout(Stdio::piped()).spawn().unwrap();
    let mut slowest = Duration::ZERO;
    let mut drains = 0;
    while child.try_wait().unwrap().is_none() {
        let file = scratch.path(&format!("quiet-{drains}"));
        quiet.run("/bin/sh", &["-c", &format!(": > {}", file.display())]);
        let started = Instant::now();
        let turn = inspector.drain("quiet", u64::MAX).await.unwrap();
        slowest = slowest.max(started.elapsed());
        assert_eq!(turn.overflow, None, "the quiet cgroup's drain {drains}");
        assert!(
            turn.lost_events > 0 || turn.effects.iter().any(|e| e.changes_under(&file)),
            "the quiet cgroup's drain {drains} has its file: {:?}",
            turn.effects
        );
        drains += 1;
        // Paced like turns; a drain's wait is what is measured.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let renames: u64 = String::from_utf8_lossy(&output.stdout).trim().parse().unwrap();
    let turn = inspector.drain("storm", u64::MAX).await.unwrap();
    let overflow = turn.overflow.expect("the storm's drain reports an overflow");
    eprintln!(
        "{renames} renames: {} effects kept, {overflow}, {} lost; {drains} quiet drains, slowest {slowest:?}",
        turn.effects.len(),
        turn.lost_events
    );
    assert!(renames > 20_000, "only {renames} renames in 4 s");
    assert!(!overflow.processes_cut, "{overflow:?}");
    // Each rename holds two paths of over 200 bytes: far fewer fit in the bound.
    assert!(
        (turn.effects.len() as u64) < (BOUND / 400) as u64,
        "{} effects kept within {BOUND} bytes",
        turn.effects.len()
    );
    assert!(
        overflow.events + turn.effects.len() as u64 + turn.lost_events >= renames,
        "{renames} renames, {} kept, {overflow:?}, {} lost",
        turn.effects.len(),
        turn.lost_events
    );
    assert!(drains >= 3, "{drains} quiet drains during the storm");
    assert!(slowest < Duration::from_secs(2), "a quiet drain during the storm took {slowest:?}");
    // The cut ends with the turn: the next one is whole again.
    storm.run("/bin/sh", &["-c", &format!(": > {}/after", scratch.str())]);
    let next = inspector.drain("storm", u64::MAX).await.unwrap();
    assert_eq!(next.overflow, None);
    assert!(next.effects.iter().any(|e| e.changes_under(&scratch.path("after"))));
}

mod mechanism {
    // Generated by libbpf-cargo (build.rs): its unsafe blocks are the generator's.
    #![allow(
        clippy::all,
        clippy::pedantic,
        clippy::undocumented_unsafe_blocks,
        missing_docs,
        non_camel_case_types,
        unused,
        unsafe_op_in_unsafe_fn
    )]
    include!(concat!(env!("OUT_DIR"), "/mechanism.skel.rs"));
}

/// The hook designs of `bpf/mechanism.bpf.c`, as what a process outside every watched cgroup
/// pays per syscall: a 512-byte write loop on the host runs with nothing attached and with each
/// design attached alone (a cgroup elsewhere is watched), in a rotating order, and the extra CPU
/// time per write is printed against nothing attached.
#[tokio::test]
#[ignore = "benchmark: cargo test --release -p crab-inspector --test inspector -- --ignored --nocapture tracepoint_mechanism"]
async fn tracepoint_mechanism_benchmark() {
    crab_sys::skip_unless_root!("BPF programs and cgroups");
    use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
    use libbpf_rs::{Link, MapCore, MapFlags};
    const ROUNDS: usize = 9;
    const WRITES: u64 = 1_000_000;
    const WRITE_NR: u32 = 1;
    let elsewhere = TestCgroup::new("mechanism");
    let mut storage = std::mem::MaybeUninit::uninit();
    let open = mechanism::MechanismSkelBuilder::default().open(&mut storage).unwrap();
    let mut skel = open.load().unwrap();
    let level = crab_inspector::cgroup_level(elsewhere.id, None).expect("the test cgroup's level");
    skel.maps.bss_data.as_deref_mut().unwrap().watched_levels = 1 << level;
    skel.maps.bss_data.as_deref_mut().unwrap().watched_ids[0] = elsewhere.id;
    skel.maps.watched.update(&elsewhere.id.to_ne_bytes(), &0u64.to_ne_bytes(), MapFlags::ANY).unwrap();
    skel.maps.hooked.update(&WRITE_NR.to_ne_bytes(), &1u32.to_ne_bytes(), MapFlags::ANY).unwrap();

    let designs: [(&str, &[&str]); 10] = [
        ("nothing attached", &[]),
        ("tracepoint sys_enter_getppid (not called)", &["tp_other"]),
        ("tracepoint sys_enter_write, empty", &["tp_empty"]),
        ("tracepoint sys_enter+exit_write, empty", &["tp_empty", "tp_exit_empty"]),
        ("tracepoint sys_enter_write, early exit", &["tp_check"]),
        ("tracepoint sys_enter_write, exit by id list", &["tp_check_ids"]),
        ("raw_tp sys_enter, empty", &["raw_empty"]),
        ("raw_tp sys_enter+sys_exit, empty", &["raw_empty", "raw_exit_empty"]),
        ("raw_tp sys_enter+sys_exit, cgroup lookup", &["raw_cgroup", "raw_cgroup_exit"]),
        ("raw_tp sys_enter+sys_exit dispatcher", &["raw_enter", "raw_exit"]),
    ];
    // The last design is the inspector itself, loaded and watching `elsewhere` (its
    // programs attach on the watch and go when it is dropped).
    const INSPECTOR: usize = 10;
    let names = designs.iter().map(|(name, _)| *name).chain(["the inspector (all its programs)"]);
    let names: Vec<&str> = names.collect();
    let script = format!("dd if=/dev/zero of=/dev/null bs=512 count={WRITES} status=none");
    let mut samples: Vec<Vec<Timing>> = vec![Vec::new(); names.len()];
    for round in 0..ROUNDS {
        for i in 0..names.len() {
            let index = (round + i) % names.len();
            let mut inspector = None;
            let links: Vec<Link> = if index == INSPECTOR {
                let started = Inspector::start(InspectorConfig::default()).await.unwrap();
                let container = WatchedContainer { id: "elsewhere".into(), root_pid: None, rootfs: None };
                started.watch(elsewhere.id, container).await.unwrap();
                inspector = Some(started);
                Vec::new()
            } else {
                skel.object_mut()
                    .progs_mut()
                    .filter(|p| designs[index].1.contains(&p.name().to_str().unwrap()))
                    .map(|p| p.attach().unwrap())
                    .collect()
            };
            let (start, cpu_start) = (Instant::now(), children_cpu());
            let status = Command::new("/bin/sh").args(["-c", &script]).status().unwrap();
            assert!(status.success());
            samples[index].push(Timing { wall: start.elapsed(), cpu: children_cpu() - cpu_start });
            drop(links);
            drop(inspector);
        }
    }
    let median_cpu = |s: &[Timing]| median(s.iter().map(|t| t.cpu).collect()).as_secs_f64();
    let median_wall = |s: &[Timing]| median(s.iter().map(|t| t.wall).collect()).as_secs_f64();
    let (base_cpu, base_wall) = (median_cpu(&samples[0]), median_wall(&samples[0]));
    println!("{WRITES} writes of 512 B to /dev/null (dd: as many reads), medians of {ROUNDS}, unwatched process");
    for (name, s) in names.iter().zip(&samples) {
        let (cpu, wall) = (median_cpu(s), median_wall(s));
        println!(
            "  {name:<40} {wall:>6.3} s wall {cpu:>6.3} s cpu  ratio {:.3} wall {:.3} cpu  {:>+5.0} ns/write",
            wall / base_wall,
            cpu / base_cpu,
            (cpu - base_cpu) * 1e9 / WRITES as f64
        );
    }
}
