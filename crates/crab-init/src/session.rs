//! One exec session: a process the spawner started, and the spawner's own
//! copies of the shim's ends of its stdio. Keeping them means every pipe or
//! pty of a session has both ends inside the container's process tree, so a
//! CRIU dump takes it whole (a restored pipe with one end missing would give
//! the process end-of-file or SIGPIPE).

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crab_init::protocol::{FdRole, SessionInfo, SpawnRequest};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The prefix of runc's messages for a process that could not be started.
const START_FAILED: &str = "exec failed: unable to start container process";

pub struct Session {
    pub info: SessionInfo,
    stdin: Option<OwnedFd>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    console: Option<OwnedFd>,
    /// Raw wait status once reaped.
    pub exit: Option<i32>,
    /// A pidfd of the process went to the shim, which has not yet released
    /// it: the process must stay reapable-but-unreaped until then.
    pub held: bool,
}

impl Session {
    /// The descriptors the shim gets, in the order of their roles.
    pub fn fds(&self) -> Vec<(FdRole, BorrowedFd<'_>)> {
        [
            (FdRole::Stdin, &self.stdin),
            (FdRole::Stdout, &self.stdout),
            (FdRole::Stderr, &self.stderr),
            (FdRole::Console, &self.console),
        ]
        .into_iter()
        .filter_map(|(role, fd)| fd.as_ref().map(|fd| (role, fd.as_fd())))
        .collect()
    }

    /// CloseIO: with the shim's writer gone too, the process reads end of file.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }
}

fn os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Go's wording of an errno ("no such file or directory"), as in runc's messages.
fn errno_text(errno: i32) -> String {
    // SAFETY: strerror returns a static NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(libc::strerror(errno)) }.to_string_lossy().into_owned();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => format!("errno {errno}"),
    }
}

fn cstring(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{START_FAILED}: {what} {s:?} contains a NUL byte"))
}

fn is_executable_file(path: &str) -> bool {
    let Ok(c) = CString::new(path) else { return false };
    // SAFETY: all-zero bytes are a valid `stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    unsafe {
        libc::stat(c.as_ptr(), &mut st) == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFREG
            && libc::access(c.as_ptr(), libc::X_OK) == 0
    }
}

/// The program to exec: a name with a slash as given, else the first match
/// on the PATH of the session's own environment (as runc resolves it).
fn resolve_program(arg0: &str, env: &[String]) -> Result<String, String> {
    if arg0.contains('/') {
        return Ok(arg0.to_string());
    }
    let path = env.iter().rev().find_map(|e| e.strip_prefix("PATH=")).unwrap_or(DEFAULT_PATH);
    path.split(':')
        .map(|dir| if dir.is_empty() { format!("./{arg0}") } else { format!("{}/{arg0}", dir.trim_end_matches('/')) })
        .find(|candidate| is_executable_file(candidate))
        .ok_or_else(|| format!("{START_FAILED}: exec: {arg0:?}: executable file not found in $PATH"))
}

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("{START_FAILED}: pipe: {}", os_error()));
    }
    // SAFETY: pipe2 returned two new descriptors we now own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The environment with HOME added as runc adds it when the process spec has
/// none: the user's home directory from the container's passwd file, else "/".
fn with_home(env: &[String], uid: u32, passwd: &str) -> Vec<String> {
    let mut env = env.to_vec();
    if !env.iter().any(|e| e.starts_with("HOME=")) {
        let home =
            std::fs::read_to_string(passwd).ok().and_then(|text| home_of(&text, uid)).unwrap_or_else(|| "/".into());
        env.push(format!("HOME={home}"));
    }
    env
}

/// The home directory of `uid` in passwd(5) text.
fn home_of(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.len() >= 7 && fields[2].parse::<u32>().ok() == Some(uid) && !fields[5].is_empty())
            .then(|| fields[5].to_string())
    })
}

fn dev_null() -> Result<OwnedFd, String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map(OwnedFd::from)
        .map_err(|e| format!("{START_FAILED}: open /dev/null: {e}"))
}

/// A pty from the container's own devpts: (master, slave).
fn open_pty(size: Option<crab_init::protocol::ConsoleSize>) -> Result<(OwnedFd, OwnedFd), String> {
    let master = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags_noctty()
        .open("/dev/ptmx")
        .map(OwnedFd::from)
        .map_err(|e| format!("{START_FAILED}: open /dev/ptmx: {e}"))?;
    let unlock: libc::c_int = 0;
    // SAFETY: ioctls on a descriptor we own with correctly typed arguments.
    unsafe {
        if libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) != 0 {
            return Err(format!("{START_FAILED}: unlock pty: {}", os_error()));
        }
        let slave = libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        if slave < 0 {
            return Err(format!("{START_FAILED}: open pty slave: {}", os_error()));
        }
        if let Some(size) = size {
            let ws = libc::winsize { ws_row: size.height, ws_col: size.width, ws_xpixel: 0, ws_ypixel: 0 };
            libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws);
        }
        Ok((master, OwnedFd::from_raw_fd(slave)))
    }
}

trait NoCtty {
    fn custom_flags_noctty(&mut self) -> &mut Self;
}

impl NoCtty for std::fs::OpenOptions {
    fn custom_flags_noctty(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_NOCTTY)
    }
}

/// Everything the child needs, prepared before fork.
struct Plan {
    program: CString,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: CString,
    /// The child's stdin, stdout, stderr.
    stdio: [OwnedFd; 3],
    terminal: bool,
    umask: Option<u32>,
    /// The identity changes to make, in order (see [`identity_steps`]).
    identity: Vec<IdentityStep>,
}

/// A process's user, group and supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    uid: u32,
    gid: u32,
    groups: Vec<libc::gid_t>,
}

impl Identity {
    /// The spawner's own, which a forked child starts with.
    fn current() -> Result<Self, String> {
        let groups = nix::unistd::getgroups()
            .map_err(|e| format!("{START_FAILED}: getgroups: {e}"))?
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        Ok(Self { uid: nix::unistd::getuid().as_raw(), gid: nix::unistd::getgid().as_raw(), groups })
    }
}

/// One change of identity a session's process makes before its exec.
#[derive(Debug, Clone, PartialEq, Eq)]
enum IdentityStep {
    Groups(Vec<libc::gid_t>),
    Gid(u32),
    Uid(u32),
}

/// What turns `current` into `wanted`: supplementary groups, then the group, then the user (as
/// runc orders them: setuid away from root drops the capabilities the other two need), each only
/// when it changes anything. The spawner runs with the container's capabilities, which may be
/// none at all (a pod that drops ALL): a call that changes nothing would still need
/// CAP_SETGID or CAP_SETUID and fail, so it is not made. Groups compare as sets, as the kernel
/// keeps them.
fn identity_steps(current: &Identity, wanted: &Identity) -> Vec<IdentityStep> {
    let as_set = |groups: &[libc::gid_t]| {
        let mut set = groups.to_vec();
        set.sort_unstable();
        set.dedup();
        set
    };
    let mut steps = Vec::new();
    if as_set(&current.groups) != as_set(&wanted.groups) {
        steps.push(IdentityStep::Groups(wanted.groups.clone()));
    }
    if current.gid != wanted.gid {
        steps.push(IdentityStep::Gid(wanted.gid));
    }
    if current.uid != wanted.uid {
        steps.push(IdentityStep::Uid(wanted.uid));
    }
    steps
}

pub fn spawn(req: &SpawnRequest) -> Result<Session, String> {
    let arg0 = req.args.first().ok_or_else(|| format!("{START_FAILED}: args must not be empty"))?;
    let program = resolve_program(arg0, &req.env)?;
    let (mut stdin, mut stdout, mut stderr, mut console) = (None, None, None, None);
    let stdio: [OwnedFd; 3] = if req.terminal {
        let (master, slave) = open_pty(req.console_size)?;
        if req.uid != 0 {
            // SAFETY: fchown on our descriptor; best effort as runc's console is.
            unsafe { libc::fchown(slave.as_raw_fd(), req.uid, u32::MAX) };
        }
        console = Some(master);
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| format!("{START_FAILED}: dup pty: {e}"));
        [dup(&slave)?, dup(&slave)?, slave]
    } else {
        let child_in = if req.stdin {
            let (r, w) = pipe()?;
            stdin = Some(w);
            r
        } else {
            dev_null()?
        };
        let output = |wanted: bool, keep: &mut Option<OwnedFd>| -> Result<OwnedFd, String> {
            if !wanted {
                return dev_null();
            }
            let (r, w) = pipe()?;
            *keep = Some(r);
            Ok(w)
        };
        let child_out = output(req.stdout, &mut stdout)?;
        let child_err = output(req.stderr, &mut stderr)?;
        [child_in, child_out, child_err]
    };
    let plan = Plan {
        program: cstring(&program, "program")?,
        argv: req.args.iter().map(|a| cstring(a, "argument")).collect::<Result<_, _>>()?,
        envp: with_home(&req.env, req.uid, "/etc/passwd")
            .iter()
            .map(|e| cstring(e, "environment entry"))
            .collect::<Result<_, _>>()?,
        cwd: cstring(&req.cwd, "cwd")?,
        stdio,
        terminal: req.terminal,
        umask: req.umask,
        identity: identity_steps(
            &Identity::current()?,
            &Identity { uid: req.uid, gid: req.gid, groups: req.additional_gids.clone() },
        ),
    };
    let (report_r, report_w) = pipe()?;
    // SAFETY: the spawner is single-threaded: the child may run any code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("{START_FAILED}: fork: {}", os_error()));
    }
    if pid == 0 {
        drop(report_r);
        let message = exec_child(&plan, &req.cwd, arg0);
        let _ = write_all(report_w.as_raw_fd(), message.as_bytes());
        // SAFETY: leave without running the spawner's destructors.
        unsafe { libc::_exit(127) };
    }
    drop(plan);
    drop(report_w);
    // The report pipe closes on a successful exec (CLOEXEC) or carries the reason.
    let mut report = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::fs::File::from(report_r), &mut report);
    if !report.is_empty() {
        let mut status = 0;
        // SAFETY: reap the child that failed to start.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(String::from_utf8_lossy(&report).into_owned());
    }
    Ok(Session {
        info: SessionInfo {
            exec_id: req.exec_id.clone(),
            args: req.args.clone(),
            pid,
            terminal: req.terminal,
            exited: false,
        },
        stdin,
        stdout,
        stderr,
        console,
        exit: None,
        held: false,
    })
}

fn write_all(fd: RawFd, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: writing from a valid buffer.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            return Err(os_error());
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// In the forked child: becomes the session's process, or returns why not.
fn exec_child(plan: &Plan, cwd: &str, arg0: &str) -> String {
    let fail = |what: String| format!("{START_FAILED}: {what}");
    // SAFETY: plain system calls on values prepared before fork.
    unsafe {
        // The spawner ignores termination signals and blocks SIGCHLD; neither
        // may leak into the process (ignored dispositions survive execve).
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE, libc::SIGCHLD] {
            libc::signal(sig, libc::SIG_DFL);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        if libc::setsid() < 0 {
            return fail(format!("setsid: {}", os_error()));
        }
        if plan.terminal && libc::ioctl(plan.stdio[0].as_raw_fd(), libc::TIOCSCTTY, 0) != 0 {
            return fail(format!("set controlling terminal: {}", os_error()));
        }
        for (target, fd) in plan.stdio.iter().enumerate() {
            if libc::dup2(fd.as_raw_fd(), target as RawFd) < 0 {
                return fail(format!("dup2 stdio: {}", os_error()));
            }
        }
        if libc::chdir(plan.cwd.as_ptr()) != 0 {
            let errno = *libc::__errno_location();
            return fail(format!("chdir to cwd ({cwd:?}) set in config.json failed: {}", errno_text(errno)));
        }
        if let Some(mask) = plan.umask {
            libc::umask(mask as libc::mode_t);
        }
        for step in &plan.identity {
            match step {
                IdentityStep::Groups(groups) if libc::setgroups(groups.len(), groups.as_ptr()) != 0 => {
                    return fail(format!("setgroups: {}", os_error()));
                }
                IdentityStep::Gid(gid) if libc::setgid(*gid) != 0 => {
                    return fail(format!("setgid {gid}: {}", os_error()));
                }
                IdentityStep::Uid(uid) if libc::setuid(*uid) != 0 => {
                    return fail(format!("setuid {uid}: {}", os_error()));
                }
                _ => {}
            }
        }
        let mut argv: Vec<*const libc::c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<*const libc::c_char> = plan.envp.iter().map(|e| e.as_ptr()).collect();
        envp.push(std::ptr::null());
        libc::execve(plan.program.as_ptr(), argv.as_ptr(), envp.as_ptr());
        let errno = *libc::__errno_location();
        fail(format!("exec: {arg0:?}: {}", errno_text(errno)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_changes_only_what_differs_groups_first_user_last() {
        let root = Identity { uid: 0, gid: 0, groups: vec![0, 10, 1] };
        // The same identity, groups in another order and repeated: nothing to do, so a spawner
        // without CAP_SETGID (capabilities dropped ALL) still starts the exec.
        assert_eq!(identity_steps(&root, &Identity { groups: vec![1, 0, 10, 10], ..root.clone() }), vec![]);
        let user = Identity { uid: 1000, gid: 100, groups: vec![100, 27] };
        assert_eq!(
            identity_steps(&root, &user),
            vec![IdentityStep::Groups(vec![100, 27]), IdentityStep::Gid(100), IdentityStep::Uid(1000)]
        );
        assert_eq!(identity_steps(&root, &Identity { gid: 5, ..root.clone() }), vec![IdentityStep::Gid(5)]);
        assert_eq!(
            identity_steps(&root, &Identity { groups: vec![], ..root.clone() }),
            vec![IdentityStep::Groups(vec![])]
        );
        assert_eq!(identity_steps(&user, &Identity { uid: 0, ..user.clone() }), vec![IdentityStep::Uid(0)]);
    }

    #[test]
    fn program_lookup_uses_the_sessions_path() {
        let env = vec!["PATH=/nonexistent:/bin:/usr/bin".to_string()];
        assert!(resolve_program("sh", &env).unwrap().ends_with("/sh"));
        let err = resolve_program("crab-no-such-program", &env).unwrap_err();
        assert!(err.ends_with("exec: \"crab-no-such-program\": executable file not found in $PATH"), "{err}");
        assert_eq!(resolve_program("./x", &env).unwrap(), "./x");
    }

    #[test]
    fn errno_text_reads_like_go() {
        assert_eq!(errno_text(libc::ENOENT), "no such file or directory");
        assert_eq!(errno_text(libc::EACCES), "permission denied");
    }

    #[test]
    fn home_is_added_from_passwd_as_runc_does() {
        let dir = std::env::temp_dir().join(format!("crab-init-passwd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let passwd = dir.join("passwd");
        std::fs::write(&passwd, "root:x:0:0:root:/root:/bin/sh\nwww-data:x:33:33:www:/var/www:/usr/sbin/nologin\n")
            .unwrap();
        let passwd = passwd.to_str().unwrap();
        let env = vec!["PATH=/bin".to_string()];
        assert_eq!(with_home(&env, 0, passwd), vec!["PATH=/bin".to_string(), "HOME=/root".into()]);
        assert_eq!(with_home(&env, 33, passwd).last().unwrap(), "HOME=/var/www");
        assert_eq!(with_home(&env, 1000, passwd).last().unwrap(), "HOME=/");
        assert_eq!(with_home(&env, 0, "/nonexistent/passwd").last().unwrap(), "HOME=/");
        let given = vec!["HOME=/work".to_string()];
        assert_eq!(with_home(&given, 0, passwd), given);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn spawned_process_gets_its_output_pipe_and_exit_error_reports() {
        let req = SpawnRequest {
            exec_id: "t".into(),
            args: vec!["sh".into(), "-c".into(), "echo out; echo err >&2".into()],
            env: vec!["PATH=/bin:/usr/bin".into()],
            cwd: "/".into(),
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            additional_gids: vec![],
            umask: None,
            terminal: false,
            console_size: None,
            stdin: false,
            stdout: true,
            stderr: true,
        };
        let mut session = spawn(&req).unwrap();
        let mut out = String::new();
        let stdout = session.stdout.take().unwrap();
        std::io::Read::read_to_string(&mut std::fs::File::from(stdout), &mut out).unwrap();
        assert_eq!(out, "out\n");
        let mut status = 0;
        // SAFETY: waitpid writes one int, `status`, for the call's duration.
        unsafe { libc::waitpid(session.info.pid, &mut status, 0) };
        assert_eq!(crab_init::exit_status(status), 0);

        let bad_cwd = SpawnRequest { cwd: "/crab-no-such-dir".into(), ..req };
        let err = spawn(&bad_cwd).err().unwrap();
        assert!(
            err.contains("chdir to cwd (\"/crab-no-such-dir\") set in config.json failed: no such file or directory"),
            "{err}"
        );
    }
}
