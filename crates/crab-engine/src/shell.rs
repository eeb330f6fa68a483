//! Shell turns: a `bash` session fed through its stdin, asked for its state at its prompt.
//!
//! A stdin turn changes the session's memory, which only a process dump takes whole. But when
//! the session is `bash`, every process the turn started has exited and the shell is back at
//! its prompt, what its memory holds that the next input can see is small and knowable: what
//! its own builtins print (`declare -p`, `declare -f`, `alias -p`, `shopt -p`, `set +o`,
//! `trap -p`, `dirs`, `umask`, `jobs`, `$PWD`, `$-`, `$?`, `$_`). The shim writes one line into
//! the session's stdin that prints them between two marks ([`capture_line`]) and withholds
//! that output from the client; the line leaves `$?` and `$_` as they were, so the session
//! cannot tell it was asked. A turn whose answer [`cheap_from`] accepts needs no dump: a
//! restore brings the shell back from the newest process images and then writes it
//! [`restore_line`], which takes it from the state those images hold to the turn's.
//!
//! What the answer cannot vouch for keeps the turn a process turn: a job still known to the
//! shell, history being recorded (the asked line would enter it), `-x` or `-v` (the line would
//! be traced or echoed), a DEBUG, RETURN or ERR trap (it would run), a function named
//! `builtin` (it would run instead of the builtins the line calls), read-only variables or a
//! directory stack that changed (nothing can bring them back in the same process).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use crab_store::ShellState;

use crab_store::{BASH_OWN_VARIABLES as BASH_OWN, declared_name};

/// The prefix of every name crab's lines use in the shell.
const OWN_PREFIX: &str = "__crab_";

/// Answers above this are not a shell state crab keeps per turn: a checkpoint lists the state
/// in its manifest, outside the blobs the sandbox's quota counts, so its size is bounded here.
/// A larger answer comes back empty, and the session is not asked again (it dumps, and the
/// dump counts against the quota).
pub const MAX_ANSWER: usize = 256 << 10;

/// How long a session may take to answer.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShellError {
    #[error("the shell's answer has no {0} mark")]
    NoMark(&'static str),
    #[error("the shell's answer has no {0} section")]
    NoSection(&'static str),
    #[error("the shell's answer has a malformed {what}: {text:?}")]
    Malformed { what: &'static str, text: String },
}

/// The marks around a session's answer on stdout and stderr: a fresh nonce each time, printed
/// through a format so that the line written to the shell never contains them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marks {
    pub nonce: String,
}

impl Marks {
    pub fn new(nonce: impl Into<String>) -> Self {
        Marks { nonce: nonce.into() }
    }

    pub fn begin(&self) -> Vec<u8> {
        format!("{OWN_PREFIX}{}_begin\n", self.nonce).into_bytes()
    }

    pub fn end(&self) -> Vec<u8> {
        format!("{OWN_PREFIX}{}_end\n", self.nonce).into_bytes()
    }

    /// Commands printing the begin mark on stdout and on stderr.
    fn print_begin(&self) -> String {
        let n = &self.nonce;
        format!("\\builtin printf '{OWN_PREFIX}%s_begin\\n' {n}; \\builtin printf '{OWN_PREFIX}%s_begin\\n' {n} >&2; ")
    }

    fn print_end(&self) -> String {
        let n = &self.nonce;
        format!("\\builtin printf '{OWN_PREFIX}%s_end\\n' {n}; \\builtin printf '{OWN_PREFIX}%s_end\\n' {n} >&2; ")
    }
}

/// A fresh nonce for [`Marks`].
pub fn nonce() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:016x}", (now as u64) ^ count.rotate_left(40) ^ u64::from(std::process::id()).rotate_left(20))
}

/// The shim's side of a session, for asking it (see the module's documentation).
pub trait ShellChannel: Send + Sync {
    /// Device and inode of the pipes the shim holds the other ends of: the session's stdin,
    /// stdout and stderr as it was started.
    fn stdio(&self) -> [(u64, u64); 3];

    /// Writes `input` to the session's stdin and returns what it printed on stdout from the
    /// begin mark through the end mark. Everything it prints on stdout and stderr from the
    /// begin mark through the end mark is withheld from the client; nothing of the client's
    /// input is written meanwhile.
    fn ask(&self, input: Vec<u8>, marks: Marks, timeout: Duration) -> AskFuture<'_>;
}

/// A session the shim can ask (see [`crate::SandboxEngine::stdin_session`]).
pub struct AskableSession {
    pub channel: std::sync::Arc<dyn ShellChannel>,
    /// A restored session brought to its turn's state: what its process images hold of it,
    /// and their turn.
    pub restored: Option<(ShellState, u64)>,
}

pub type AskFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<u8>, String>> + Send + 'a>>;

/// Why asking the session now could harm it or its client, from the kernel's view of it (None:
/// it waits at its prompt and nothing else can write between the marks):
/// - it is `bash` (its command name), blocked reading one byte from its stdin into its heap:
///   that is bash's own input buffer at the prompt, while `read` and `mapfile` read into their
///   stack (an asked line would become their data);
/// - its descriptors are 0, 1 and 2, still the shim's pipes (a descriptor the turn opened or
///   moved is process state a later restore could not give back);
/// - no other process of the container (`pids`, from its cgroup) can write to its stdout or
///   stderr (its output between the marks would be withheld with the answer).
pub fn not_at_prompt(
    pid: u32,
    call: &crate::stdin::SyscallState,
    stdio: [(u64, u64); 3],
    pids: &[u32],
) -> Option<String> {
    use crate::stdin::SyscallState;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if comm.trim_end() != "bash" {
        return Some(format!("process {pid} is {:?}, not bash", comm.trim_end()));
    }
    let SyscallState::Blocked { nr, args } = *call else {
        return Some("it is not blocked in a system call".into());
    };
    if nr != libc::SYS_read || args[0] != 0 || args[2] != 1 {
        return Some(format!("it is in system call {nr}, not a one-byte read of its stdin"));
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let in_heap = maps.lines().filter(|l| l.ends_with("[heap]")).filter_map(|l| l.split(' ').next()).any(|range| {
        let (lo, hi) = range.split_once('-').unwrap_or(("", ""));
        match (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
            (Ok(lo), Ok(hi)) => (lo..hi).contains(&args[1]),
            _ => false,
        }
    });
    if !in_heap {
        return Some("it reads its stdin for a builtin (read, mapfile), not at its prompt".into());
    }
    let fd_dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<u32> = match std::fs::read_dir(&fd_dir) {
        Ok(dir) => dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect(),
        Err(e) => return Some(format!("{fd_dir}: {e}")),
    };
    fds.sort_unstable();
    if fds != [0, 1, 2] {
        return Some(format!("it holds descriptors {fds:?}, not just 0, 1 and 2"));
    }
    for (fd, want) in stdio.iter().enumerate() {
        if inode_of(&format!("{fd_dir}/{fd}")) != Some(*want) {
            return Some(format!("its descriptor {fd} is no longer the pipe it was started with"));
        }
    }
    for &other in pids.iter().filter(|&&p| p != pid) {
        let dir = format!("/proc/{other}/fd");
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(ino) = inode_of(&path.to_string_lossy()) else { continue };
            if ino != stdio[1] && ino != stdio[2] {
                continue;
            }
            let info = format!("/proc/{other}/fdinfo/{}", entry.file_name().to_string_lossy());
            let flags = std::fs::read_to_string(&info).ok().and_then(|t| {
                t.lines().find_map(|l| l.strip_prefix("flags:")).and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
            });
            // Unknown flags count as a writer.
            if flags.is_none_or(|f| f & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32) {
                return Some(format!("process {other} can write to its output"));
            }
        }
    }
    None
}

/// Device and inode of what a `/proc/<pid>/fd/<n>` link names.
fn inode_of(path: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Sets `$?` and `$_` back to `status` and `last_arg` (shell words) as the line's last
/// command: a function that removes itself and crab's variables, called so that neither
/// `errexit` nor an ERR trap sees a failing command.
fn put_back(status: &str, last_arg: &str) -> String {
    format!(
        "{OWN_PREFIX}st() {{ \\builtin unset -f {OWN_PREFIX}st; \\builtin unset -v {OWN_PREFIX}s {OWN_PREFIX}u; \\builtin return \"$1\"; }}; \
         case {status} in 0) {OWN_PREFIX}st 0 {last_arg};; *) {OWN_PREFIX}st {status} {last_arg} && \\builtin :;; esac\n"
    )
}

/// The line that makes a bash session print its state between `marks` (see [`parse_answer`]).
pub fn capture_line(marks: &Marks) -> String {
    let n = &marks.nonce;
    let section =
        |name: &str, command: &str| format!("\\builtin printf '{OWN_PREFIX}%s_%s\\n' {n} {name}; {command}; ");
    let mut line = format!("{OWN_PREFIX}s=$? {OWN_PREFIX}u=$_; ");
    line.push_str(&marks.print_begin());
    line.push_str(&section("status", &format!("\\builtin printf '%s\\n' \"${OWN_PREFIX}s\"")));
    line.push_str(&section("last_arg", &format!("\\builtin printf '%q\\n' \"${OWN_PREFIX}u\"")));
    line.push_str(&section("cwd", "\\builtin printf '%q\\n' \"$PWD\""));
    line.push_str(&section("flags", "\\builtin printf '%s\\n' \"$-\""));
    line.push_str(&section("set_options", "\\builtin set +o"));
    line.push_str(&section("shopt", "\\builtin shopt -p"));
    line.push_str(&section("variables", "\\builtin declare -p"));
    line.push_str(&section("functions", "\\builtin declare -f"));
    line.push_str(&section("aliases", "\\builtin alias -p"));
    line.push_str(&section("traps", "\\builtin trap -p"));
    line.push_str(&section("dirs", "\\builtin dirs -l -p"));
    line.push_str(&section("umask", "\\builtin umask"));
    line.push_str(&section("jobs", "\\builtin jobs -l"));
    line.push_str(&section("limits", "\\builtin ulimit -S -a; \\builtin ulimit -H -a"));
    line.push_str(&section("disabled", "\\builtin enable -n"));
    line.push_str(&marks.print_end());
    line.push_str(&put_back(&format!("\"${OWN_PREFIX}s\""), &format!("\"${OWN_PREFIX}u\"")));
    line
}

/// The state in a session's answer to [`capture_line`] (`answer` from its begin mark through
/// its end mark).
pub fn parse_answer(exec_id: &str, answer: &[u8], marks: &Marks) -> Result<ShellState, ShellError> {
    let text = String::from_utf8_lossy(answer);
    let begin = String::from_utf8(marks.begin()).expect("ascii");
    let end = String::from_utf8(marks.end()).expect("ascii");
    let start = text.find(&begin).ok_or(ShellError::NoMark("begin"))? + begin.len();
    let stop = text[start..].rfind(&end).ok_or(ShellError::NoMark("end"))? + start;
    let body = &text[start..stop];
    let mut sections: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Option<String> = None;
    let header = format!("{OWN_PREFIX}{}_", marks.nonce);
    for line in body.split_inclusive('\n') {
        if let Some(name) = line.strip_prefix(&header) {
            let name = name.trim_end_matches('\n').to_string();
            sections.entry(name.clone()).or_default();
            current = Some(name);
        } else if let Some(name) = &current {
            sections.get_mut(name).expect("section").push_str(line);
        } else {
            return Err(ShellError::Malformed { what: "answer", text: line.to_string() });
        }
    }
    let mut take = |name: &'static str| sections.remove(name).ok_or(ShellError::NoSection(name));
    let one_line = |s: String| s.trim_end_matches('\n').to_string();
    let status_text = one_line(take("status")?);
    let status = status_text.parse().map_err(|_| ShellError::Malformed { what: "status", text: status_text })?;
    Ok(ShellState {
        exec_id: exec_id.to_string(),
        status,
        last_arg: one_line(take("last_arg")?),
        cwd: one_line(take("cwd")?),
        flags: one_line(take("flags")?),
        set_options: take("set_options")?,
        shopt: take("shopt")?,
        variables: declarations(&take("variables")?)
            .into_iter()
            .filter(|d| {
                let name = declared_name(d);
                !BASH_OWN.contains(&name) && !name.starts_with(OWN_PREFIX)
            })
            .collect(),
        functions: take("functions")?,
        aliases: take("aliases")?,
        traps: take("traps")?,
        dirs: take("dirs")?,
        umask: one_line(take("umask")?),
        jobs: take("jobs")?,
        limits: take("limits")?,
        disabled: take("disabled")?,
        base_turn: None,
        inherited: Vec::new(),
    })
}

/// `declare -p` output, one declaration each (a value printed over several lines stays one).
fn declarations(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.split_inclusive('\n') {
        match out.last_mut() {
            Some(last) if !line.starts_with("declare -") => last.push_str(line),
            _ => out.push(line.to_string()),
        }
    }
    out.into_iter().map(|d| d.trim_end_matches('\n').to_string()).collect()
}

/// `declare -ax NAME=...` → `ax`.
fn declared_flags(declaration: &str) -> &str {
    let rest = declaration.strip_prefix("declare -").unwrap_or("");
    rest.split(' ').next().unwrap_or("")
}

fn variables_by_name(state: &ShellState) -> BTreeMap<&str, &str> {
    state.variables.iter().map(|d| (declared_name(d), d.as_str())).collect()
}

/// Names of the functions in `declare -f` output (a definition starts at column 0).
fn function_names(text: &str) -> BTreeSet<&str> {
    text.lines().filter_map(|l| l.strip_suffix(" () ")).filter(|l| !l.starts_with(' ')).collect()
}

/// Signals with a trap in `trap -p` output (`trap -- 'cmd' SIGINT`).
fn trapped_signals(text: &str) -> BTreeSet<&str> {
    text.lines().filter(|l| l.starts_with("trap -- ")).filter_map(|l| l.rsplit(' ').next()).collect()
}

/// Why this answer cannot stand for the session's memory (None: it can).
pub fn unvouched(state: &ShellState) -> Option<String> {
    if !state.jobs.trim().is_empty() {
        return Some(format!("it knows jobs: {}", state.jobs.lines().next().unwrap_or_default()));
    }
    if state.set_options.lines().any(|l| l.trim() == "set -o history") {
        return Some("it records history".into());
    }
    if let Some(flag) = state.flags.chars().find(|c| matches!(c, 'x' | 'v')) {
        return Some(format!("it runs with -{flag}"));
    }
    if let Some(signal) = trapped_signals(&state.traps).into_iter().find(|s| matches!(*s, "DEBUG" | "RETURN" | "ERR")) {
        return Some(format!("it has a {signal} trap"));
    }
    if function_names(&state.functions).contains("builtin") {
        return Some("it has a function named builtin".into());
    }
    if !state.disabled.trim().is_empty() {
        return Some(format!(
            "it disabled builtins: {}",
            state.disabled.split_whitespace().collect::<Vec<_>>().join(" ")
        ));
    }
    None
}

/// Why a restore cannot bring a shell from `base` (what its process images hold) to `target`
/// (None: [`restore_line`] can).
pub fn unreachable_from(base: &ShellState, target: &ShellState) -> Option<String> {
    if let Some(why) = unvouched(target) {
        return Some(why);
    }
    if base.exec_id != target.exec_id {
        return Some(format!("states of two sessions ({} and {})", base.exec_id, target.exec_id));
    }
    let readonly = |s: &ShellState| -> BTreeSet<String> {
        s.variables.iter().filter(|d| declared_flags(d).contains('r')).cloned().collect()
    };
    if readonly(base) != readonly(target) {
        return Some("its read-only variables changed".into());
    }
    // The stack's first entry is the working directory, which `cd` brings back.
    let stack = |s: &ShellState| s.dirs.lines().skip(1).map(str::to_string).collect::<Vec<_>>();
    if stack(base) != stack(target) {
        return Some("its directory stack changed".into());
    }
    // The process images hold the base's limits, and a raised hard limit cannot be lowered back.
    if base.limits != target.limits {
        return Some("its resource limits changed".into());
    }
    None
}

/// Whether a turn that left the session at `target` needs no dump: the session's newest
/// process checkpoint holds it at `base` and a restore can bring it from there. The reason
/// when not.
pub fn cheap_from(base: Option<&ShellState>, target: &ShellState) -> Result<(), String> {
    match base {
        None => Err("no process checkpoint holds a state the shell answered for".into()),
        Some(base) => unreachable_from(base, target).map_or(Ok(()), Err),
    }
}

/// The input that takes a bash session from `base` to `target` (see [`unreachable_from`]),
/// printing nothing outside `marks`, and leaving `$?` and `$_` as `target` has them.
pub fn restore_line(base: &ShellState, target: &ShellState, marks: &Marks) -> String {
    let mut s = format!("{OWN_PREFIX}s={} {OWN_PREFIX}u={}; ", target.status, target.last_arg);
    s.push_str(&marks.print_begin());
    s.push('\n');
    // `cd` sets PWD and OLDPWD: both are declared again below, as the target has them.
    s.push_str(&format!("\\builtin cd -- {}\n", target.cwd));
    let (old, new) = (variables_by_name(base), variables_by_name(target));
    for (name, declaration) in &old {
        // `cd` gave PWD and OLDPWD values the target may not have (an exported OLDPWD without
        // a value is declared again as such, which keeps a value it has): both go first.
        let moved_by_cd = matches!(*name, "PWD" | "OLDPWD");
        let changed = new.get(name) != Some(declaration) || moved_by_cd;
        if changed && !declared_flags(declaration).contains('r') {
            // A nameref is removed as itself, not as the variable it names.
            let how = if declared_flags(declaration).contains('n') { "-n" } else { "-v" };
            s.push_str(&format!("\\builtin unset {how} {name}\n"));
        }
    }
    for (name, declaration) in &new {
        let moved_by_cd = matches!(*name, "PWD" | "OLDPWD");
        if (old.get(name) != Some(declaration) || moved_by_cd) && !declared_flags(declaration).contains('r') {
            s.push_str(&redeclare(declaration));
        }
    }
    if base.functions != target.functions {
        for name in function_names(&base.functions) {
            s.push_str(&format!("\\builtin unset -f {name}\n"));
        }
        s.push_str(&target.functions);
        if !target.functions.ends_with('\n') && !target.functions.is_empty() {
            s.push('\n');
        }
    }
    if base.aliases != target.aliases {
        s.push_str("\\builtin unalias -a\n");
        for line in target.aliases.lines() {
            s.push_str(&format!("\\builtin {line}\n"));
        }
    }
    if base.traps != target.traps {
        let kept = trapped_signals(&target.traps);
        for signal in trapped_signals(&base.traps).difference(&kept) {
            s.push_str(&format!("\\builtin trap - {signal}\n"));
        }
        for line in target.traps.lines() {
            s.push_str(&format!("\\builtin {line}\n"));
        }
    }
    if base.shopt != target.shopt {
        for line in target.shopt.lines() {
            s.push_str(&format!("\\builtin {line}\n"));
        }
    }
    s.push_str(&format!("\\builtin umask {}\n", target.umask));
    // Last: `set -e` or `set -u` would judge crab's own commands before it.
    if base.set_options != target.set_options {
        for line in target.set_options.lines() {
            s.push_str(&format!("\\builtin {line}\n"));
        }
    }
    s.push_str(&marks.print_end());
    s.push_str(&put_back(&format!("\"${OWN_PREFIX}s\""), &format!("\"${OWN_PREFIX}u\"")));
    s
}

/// A `declare -p` line as a command run through `builtin`. An array's compound assignment is
/// only parsed as such after a plain `declare` word (which a function could stand in for), so
/// it goes quoted, which `declare` evaluates the same way.
fn redeclare(declaration: &str) -> String {
    let flags = declared_flags(declaration);
    match declaration.split_once(' ').and_then(|(_, rest)| rest.split_once(' ')) {
        Some((_, assignment)) if flags.contains('a') || flags.contains('A') => {
            format!("\\builtin declare -{flags} '{}'\n", assignment.replace('\'', "'\\''"))
        }
        _ => format!("\\builtin {declaration}\n"),
    }
}

/// Whether two answers are the same state, `$?` and `$_` aside.
pub fn same_but_status(a: &ShellState, b: &ShellState) -> bool {
    let strip = |s: &ShellState| ShellState { status: 0, last_arg: String::new(), ..s.clone() };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};

    /// Runs `script` in a `bash` reading its stdin (as a session does), then asks it; returns
    /// the state and what it printed outside the marks.
    fn run_and_ask(script: &str, after: &str) -> (ShellState, String, String) {
        let marks = Marks::new(nonce());
        let input = format!("{script}\n{}{after}\n", capture_line(&marks));
        let out = feed(&input);
        let (state, stdout) = split_answer(&out.0, &marks);
        let (_, stderr) = split_answer(&out.1, &marks);
        (state, stdout, stderr)
    }

    fn feed(input: &str) -> (String, String) {
        let mut child = Command::new("bash")
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("bash");
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// The state between the marks (stdout) and everything outside them.
    fn split_answer(out: &str, marks: &Marks) -> (ShellState, String) {
        let begin = String::from_utf8(marks.begin()).unwrap();
        let end = String::from_utf8(marks.end()).unwrap();
        let (Some(b), Some(e)) = (out.find(&begin), out.find(&end)) else {
            return (empty(), out.to_string());
        };
        let state = parse_answer("s", &out.as_bytes()[b..e + end.len()], marks).unwrap_or_else(|_| empty());
        (state, format!("{}{}", &out[..b], &out[e + end.len()..]))
    }

    fn empty() -> ShellState {
        ShellState {
            exec_id: String::new(),
            status: -1,
            last_arg: String::new(),
            cwd: String::new(),
            flags: String::new(),
            set_options: String::new(),
            shopt: String::new(),
            variables: Vec::new(),
            functions: String::new(),
            aliases: String::new(),
            traps: String::new(),
            dirs: String::new(),
            umask: String::new(),
            jobs: String::new(),
            limits: String::new(),
            disabled: String::new(),
            base_turn: None,
            inherited: Vec::new(),
        }
    }

    #[test]
    fn asking_leaves_status_last_argument_and_output_as_they_were() {
        // Before the ask the shell's $? is 3 and $_ is "c d"; after it both are the same.
        let (state, stdout, stderr) = run_and_ask(
            "cd /tmp; X=1; export Y='a b'; f() { echo f; }; alias ll='ls -l'; echo a 'c d'; (exit 3)",
            "echo \"rc=$? _=$_\"; declare -F | grep -c __crab_ || true; declare -p | grep -c __crab_ || true",
        );
        assert_eq!(stdout, "a c d\nrc=3 _=c d\n0\n0\n", "output outside the marks");
        assert_eq!(stderr, "");
        assert_eq!(state.status, 3);
        assert_eq!(state.cwd, "/tmp");
        assert!(state.variables.contains(&"declare -- X=\"1\"".to_string()), "{:?}", state.variables);
        assert!(state.variables.contains(&"declare -x Y=\"a b\"".to_string()));
        assert!(!state.variables.iter().any(|v| declared_name(v) == "_" || declared_name(v).starts_with(OWN_PREFIX)));
        assert_eq!(function_names(&state.functions), BTreeSet::from(["f"]));
        assert_eq!(state.aliases, "alias ll='ls -l'\n");
        assert_eq!(unvouched(&state), None);
    }

    #[test]
    fn asking_under_errexit_with_a_failed_status_keeps_the_shell_alive() {
        let (state, stdout, _) = run_and_ask("set -e; false && true", "echo \"alive rc=$?\"");
        assert_eq!(state.status, 1);
        assert_eq!(stdout, "alive rc=1\n");
    }

    #[test]
    fn what_the_answer_cannot_vouch_for_is_named() {
        for (script, why) in [
            ("sleep 0.2 &", "jobs"),
            ("set -o history", "history"),
            ("trap 'true' DEBUG", "DEBUG trap"),
            ("builtin() { command builtin \"$@\"; }", "function named builtin"),
            ("enable -n echo", "disabled builtins: enable -n echo"),
        ] {
            let (state, _, _) = run_and_ask(script, "");
            let reason = unvouched(&state).unwrap_or_default();
            assert!(reason.contains(why), "{script}: {reason:?}");
        }
    }

    /// What the oracle compares after a recovery, from inside the shell.
    const PROBE: &str = "echo \"rc=$? _=$_\"; pwd; declare -p | grep -vE '^declare -[-a-zA-Z]* (_|BASH_.*|BASHPID|EPOCH.*|RANDOM|SRANDOM|SECONDS|LINENO|PIPESTATUS|HISTCMD|FUNCNAME|GROUPS|DIRSTACK|BASHOPTS|SHELLOPTS|COMP_WORDBREAKS)(=|$)'; declare -f; alias; shopt -p; set +o; trap -p; dirs; umask";

    /// Runs `base_script` then `turns` in a bash, asking it after each; then runs `base_script`
    /// in a new bash, writes it the restore line from the first answer to the second, and
    /// asserts the probe sees what it saw in the first bash.
    fn assert_restores(base_script: &str, turns: &str) -> (ShellState, ShellState) {
        let base_marks = Marks::new(nonce());
        let target_marks = Marks::new(nonce());
        // The reference: the base script, the turns, the probe.
        let input =
            format!("{base_script}\n{}{turns}\n{}{PROBE}\n", capture_line(&base_marks), capture_line(&target_marks));
        let (out, err) = feed(&input);
        assert_eq!(err.lines().filter(|l| !l.starts_with(OWN_PREFIX)).count(), 0, "{err}");
        let (base, rest) = split_answer(&out, &base_marks);
        let (target, reference) = split_answer(&rest, &target_marks);
        assert_eq!(cheap_from(Some(&base), &target), Ok(()));
        // A new shell at the base (as process images hold it), then the restore line, then the probe.
        let restore_marks = Marks::new(nonce());
        let input = format!("{base_script}\n{}{PROBE}\n", restore_line(&base, &target, &restore_marks));
        let (out, err) = feed(&input);
        let begin = String::from_utf8(restore_marks.begin()).unwrap();
        let end = String::from_utf8(restore_marks.end()).unwrap();
        let (b, e) = (out.find(&begin).expect("begin"), out.find(&end).expect("end"));
        assert_eq!(&out[b + begin.len()..e], "", "the restore line printed on stdout");
        assert!(err.matches("_begin").count() == 1 && err.ends_with("_end\n"), "stderr: {err:?}");
        let restored = format!("{}{}", &out[..b], &out[e + end.len()..]);
        // The base script's and the turns' own output: before the probe's first line, rc=.
        let probe = |text: &str| text[text.find("rc=").expect("probe")..].to_string();
        assert_eq!(probe(&restored), probe(&reference));
        (base, target)
    }

    #[test]
    fn the_restore_line_brings_a_base_shell_to_the_target_state() {
        let base_script = "cd /usr; export OLDPWD; A=1; B=2; declare -n R=A; f() { echo f; }; g() { echo g; }; alias a1='echo 1'; trap 'echo usr1' USR1; umask 022; echo x y";
        let turns = "cd /tmp; unset B; C=$'multi\\nline'; export A; declare -a ARR=(1 '2 3' \"it's\"); declare -A MAP=([k]=v ['a b']=\"c'd\"); declare -n R=C; unset -f g; f() { echo f2; }; h() { echo h; }; unalias a1; alias a2='echo 2'; trap - USR1; trap 'echo t' TERM; shopt -s extglob; umask 077; set -u; cd /; cd /tmp; echo last 'arg here'; (exit 4)";
        let (_, target) = assert_restores(base_script, turns);
        assert_eq!(target.status, 4);
    }

    #[test]
    fn a_restored_shell_that_never_changed_directory_has_no_oldpwd_value() {
        // bash exports OLDPWD without a value until the first cd; the restore line's own cd
        // must not leave one behind (the stdin evaluation's recoveries all did).
        let (base, target) = assert_restores("X=1", "X=2");
        assert!(base.variables.contains(&"declare -x OLDPWD".to_string()), "{:?}", base.variables);
        assert!(target.variables.contains(&"declare -x OLDPWD".to_string()));
    }

    /// A `bash` on pipes, given `input` and left waiting for more.
    struct Waiting {
        child: std::process::Child,
        stdio: [(u64, u64); 3],
    }

    impl Waiting {
        fn start(input: &str) -> Waiting {
            use std::os::fd::AsFd;
            use std::os::unix::process::CommandExt;
            let mut command = Command::new("bash");
            command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
            // SAFETY: close_range is async-signal-safe; it only closes what the test harness
            // leaked to its children (a jobserver's pipes), as crab-init's sessions have none.
            unsafe {
                command.pre_exec(|| {
                    libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                    Ok(())
                });
            }
            let mut child = command.spawn().expect("bash");
            let inode = |fd: std::os::fd::BorrowedFd<'_>| {
                let st = nix::sys::stat::fstat(fd).unwrap();
                (st.st_dev, st.st_ino)
            };
            let stdio = [
                inode(child.stdin.as_ref().unwrap().as_fd()),
                inode(child.stdout.as_ref().unwrap().as_fd()),
                inode(child.stderr.as_ref().unwrap().as_fd()),
            ];
            child.stdin.as_mut().unwrap().write_all(input.as_bytes()).unwrap();
            Waiting { child, stdio }
        }

        /// Why it is not at its prompt, once it has been blocked in the same call twice.
        fn not_at_prompt(&self, pids: &[u32]) -> Option<String> {
            use crate::stdin::{ProcFs, ProcReader};
            let pid = self.child.id();
            let mut last = None;
            for _ in 0..200 {
                std::thread::sleep(Duration::from_millis(10));
                let call = ProcFs.syscall(pid).unwrap();
                if matches!(call, crate::stdin::SyscallState::Blocked { .. }) && last == Some(call) {
                    return not_at_prompt(pid, &call, self.stdio, pids);
                }
                last = Some(call);
            }
            panic!("bash never blocked");
        }
    }

    impl Drop for Waiting {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    #[test]
    fn only_a_shell_waiting_at_its_prompt_with_its_own_pipes_is_asked() {
        let shell = Waiting::start("cd /tmp\n");
        assert_eq!(shell.not_at_prompt(&[]), None);
        // A builtin reading the next line would take the question as its data.
        let reading = Waiting::start("read x\n");
        assert!(reading.not_at_prompt(&[]).unwrap().contains("for a builtin"), "{:?}", reading.not_at_prompt(&[]));
        let mapfile = Waiting::start("mapfile -n 1 y\n");
        assert!(mapfile.not_at_prompt(&[]).unwrap().contains("for a builtin"));
        // A descriptor the turn opened, or stdout moved to a file.
        let opened = Waiting::start("exec 3>/dev/null\n");
        assert!(opened.not_at_prompt(&[]).unwrap().contains("descriptors [0, 1, 2, 3]"));
        let moved = Waiting::start("exec 1>/dev/null\n");
        assert!(moved.not_at_prompt(&[]).unwrap().contains("descriptor 1 is no longer"));
        // Another process that can write to the session's output (here: a background child).
        let with_child = Waiting::start("sleep 30 &\n");
        let child_pid = loop {
            let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", with_child.child.id()))
                .unwrap_or_default();
            if let Some(pid) = children.split_whitespace().next() {
                break pid.parse::<u32>().unwrap();
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let why = with_child.not_at_prompt(&[with_child.child.id(), child_pid]).unwrap();
        assert_eq!(why, format!("process {child_pid} can write to its output"));
        // Not bash at all.
        let mut cat = Command::new("cat").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let call = crate::stdin::SyscallState::Blocked { nr: libc::SYS_read, args: [0, 0, 1, 0, 0, 0] };
        assert!(not_at_prompt(cat.id(), &call, shell.stdio, &[]).unwrap().contains("not bash"));
        let _ = cat.kill();
        let _ = cat.wait();
    }

    #[test]
    fn read_only_and_directory_stack_changes_are_unreachable() {
        let (base, _, _) = run_and_ask("A=1", "");
        let (ro, _, _) = run_and_ask("A=1; readonly R=2", "");
        let (pushed, _, _) = run_and_ask("A=1; pushd /tmp >/dev/null", "");
        let (limited, _, _) = run_and_ask("A=1; ulimit -S -n 64", "");
        assert!(unreachable_from(&base, &limited).unwrap().contains("resource limits"));
        assert!(unreachable_from(&base, &ro).unwrap().contains("read-only"));
        assert!(unreachable_from(&base, &pushed).unwrap().contains("directory stack"));
        assert_eq!(cheap_from(None, &base).unwrap_err(), "no process checkpoint holds a state the shell answered for");
    }
}
