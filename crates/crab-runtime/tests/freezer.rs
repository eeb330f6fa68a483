//! The wait for a freezer to read frozen (after crun's pause, which returns without it) on
//! this host's real cgroups: a cgroup of the test's own with a process in it (needs root).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use crab_runtime::freezer::{self, Freezer};

/// A cgroup of this test's own under the v1 freezer when the host mounts it (a hybrid host),
/// else under cgroup v2, with a `sleep` in it; removed on drop.
struct Frozen {
    dir: PathBuf,
    child: Child,
    v1: bool,
}

impl Frozen {
    fn new(name: &str) -> Frozen {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mount = |fstype: &str, option: Option<&str>| {
            mountinfo.lines().find_map(|line| {
                let (before, after) = line.split_once(" - ")?;
                let mut after = after.split(' ');
                let (fs, _, options) = (after.next()?, after.next()?, after.next()?);
                let fits = fs == fstype && option.is_none_or(|o| options.split(',').any(|x| x == o));
                fits.then(|| PathBuf::from(before.split(' ').nth(4).unwrap()))
            })
        };
        let (root, v1) = match mount("cgroup", Some("freezer")) {
            Some(root) => (root, true),
            None => (mount("cgroup2", None).expect("a v1 freezer or cgroup v2"), false),
        };
        let dir = root.join(format!("crab-freezer-test-{}-{name}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        let child = Command::new("sleep").arg("60").spawn().unwrap();
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        Frozen { dir, child, v1 }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = freezer::thaw(self.child.id());
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_cgroup_asked_to_freeze_is_waited_for_until_it_reads_frozen() {
    crab_sys::skip_unless_root!("a cgroup of its own");
    let cgroup = Frozen::new("asked");
    // What a pause does; the wait then returns only once the kernel says frozen.
    let (request, value) = if cgroup.v1 { ("freezer.state", "FROZEN") } else { ("cgroup.freeze", "1") };
    std::fs::write(cgroup.dir.join(request), value).unwrap();
    let found = freezer::wait_frozen(cgroup.child.id(), Duration::from_secs(2)).unwrap();
    match found {
        Freezer::V1(file) => assert_eq!(std::fs::read_to_string(file).unwrap().trim(), "FROZEN"),
        Freezer::V2(file) => {
            let events = std::fs::read_to_string(file.with_file_name("cgroup.events")).unwrap();
            assert!(events.lines().any(|l| l == "frozen 1"), "{events}");
        }
    }
}

#[test]
fn a_v1_freezer_left_short_of_frozen_is_asked_again_as_runc_does() {
    crab_sys::skip_unless_root!("a cgroup of its own");
    let cgroup = Frozen::new("again");
    if !cgroup.v1 {
        eprintln!("skipped: no v1 freezer on this host (cgroup v2 freezes in one write)");
        return;
    }
    // Nothing asked it to freeze yet (as if a pause's one write had not taken): the wait's own
    // write of FROZEN does it.
    let state = cgroup.dir.join("freezer.state");
    assert_eq!(std::fs::read_to_string(&state).unwrap().trim(), "THAWED");
    freezer::wait_frozen(cgroup.child.id(), Duration::from_secs(2)).unwrap();
    assert_eq!(std::fs::read_to_string(&state).unwrap().trim(), "FROZEN");
}

#[test]
fn a_process_that_is_gone_is_named() {
    let err = freezer::wait_frozen(u32::MAX, Duration::from_millis(10)).unwrap_err();
    assert!(err.to_string().contains(&format!("/proc/{}/cgroup", u32::MAX)), "{err}");
}

/// A sandbox paused before a turn's dump began (by containerd or its user) was frozen by someone
/// else: when the dump hangs and is abandoned, the sandbox is left frozen for them, not thawed
/// behind their back.
#[tokio::test]
async fn an_abandoned_dump_leaves_a_sandbox_that_was_paused_before_it_frozen() {
    use std::os::unix::fs::PermissionsExt;
    crab_sys::skip_unless_root!("a cgroup of its own");
    let cgroup = Frozen::new("paused-before");
    let (request, value) = if cgroup.v1 { ("freezer.state", "FROZEN") } else { ("cgroup.freeze", "1") };
    std::fs::write(cgroup.dir.join(request), value).unwrap();
    freezer::wait_frozen(cgroup.child.id(), Duration::from_secs(2)).unwrap();
    // A runtime whose checkpoint hangs, as one with a hung CRIU does.
    let dir = tempfile::tempdir().unwrap();
    let runtime_binary = dir.path().join("hangs");
    std::fs::write(&runtime_binary, "#!/bin/sh\nsleep 30 &\nwait\n").unwrap();
    std::fs::set_permissions(&runtime_binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(dir.path().join("root")).unwrap();
    let reaper = crab_runtime::Reaper::default();
    reaper.start().unwrap();
    let runtime = crab_runtime::OciRuntime::new(&runtime_binary, dir.path().join("root"), false, reaper);
    let opts = crab_runtime::CheckpointOptions {
        image_path: dir.path().join("images"),
        deadline: Some(crab_runtime::DumpDeadline {
            after: Duration::from_millis(300),
            thaw_pid: Some(cgroup.child.id()),
        }),
        ..Default::default()
    };
    let err = tokio::time::timeout(Duration::from_secs(20), runtime.checkpoint("c1", &opts))
        .await
        .expect("an abandoned dump returns")
        .unwrap_err();
    let text = err.to_string();
    assert!(err.is_timeout(), "{text}");
    assert!(text.contains("sandbox left paused as it was"), "{text}");
    assert!(freezer::is_frozen(cgroup.child.id()).unwrap(), "the abandoned dump thawed a paused sandbox");
}
