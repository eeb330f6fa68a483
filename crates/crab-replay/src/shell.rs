//! Replay modes: how a trace's commands reach the sandbox.
//!
//! - `exec`: every command is its own `bash -c` exec (what the traces recorded).
//! - `stdin`: one long-lived `bash` exec session is fed every command through
//!   its stdin, as SWE-agent and OpenHands drive their shells.
//! - `tmux`: a tmux session in the sandbox is typed every command with
//!   `send-keys`, and its pane is read with `capture-pane`, as Terminus does.
//!
//! In the two shell modes a command's end is known from a sentinel the
//! shell prints after it: a marker with a fresh nonce and the command's `$?`.
//! The typed or written text prints the marker through a `printf` format, so
//! the text itself (echoed by a terminal) never contains the marker.

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;

use crab_containerd::Ctr;
use crab_containerd::grpc::{Containerd, ExecIo, GrpcError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ReplayMode {
    /// Each command is its own `bash -c` exec.
    #[default]
    Exec,
    /// One `bash` exec session, fed every command through its stdin.
    Stdin,
    /// A tmux session, typed every command with `send-keys`.
    Tmux,
}

impl ReplayMode {
    pub fn name(self) -> &'static str {
        match self {
            ReplayMode::Exec => "exec",
            ReplayMode::Stdin => "stdin",
            ReplayMode::Tmux => "tmux",
        }
    }
}

impl fmt::Display for ReplayMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The tmux session (and wait-for channel prefix) the replay drives.
pub const TMUX_SESSION: &str = "crab";

/// A marker nonce: fresh per command, so output of an earlier command (or a
/// command that prints marker-like text) cannot end a later one.
pub fn nonce() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mixed = (now as u64) ^ count.rotate_left(40) ^ u64::from(std::process::id()).rotate_left(20);
    format!("{mixed:016x}")
}

/// `cmd` as one bash ANSI-C quoted word (`$'...'`): a single line whatever the
/// command holds (newlines, tabs, quotes), so a terminal types it without
/// continuation prompts or completion, and `eval` runs exactly `cmd`.
pub fn ansi_c_quote(cmd: &str) -> String {
    let mut quoted = String::with_capacity(cmd.len() + 3);
    quoted.push_str("$'");
    for ch in cmd.chars() {
        match ch {
            '\\' => quoted.push_str("\\\\"),
            '\'' => quoted.push_str("\\'"),
            '\n' => quoted.push_str("\\n"),
            '\t' => quoted.push_str("\\t"),
            '\r' => quoted.push_str("\\r"),
            // Always two hex digits: `\xHH` takes at most two, so a following
            // hex letter of the command is never swallowed.
            c if (c as u32) < 0x20 || c as u32 == 0x7f => quoted.push_str(&format!("\\x{:02x}", c as u32)),
            c => quoted.push(c),
        }
    }
    quoted.push('\'');
    quoted
}

/// The line written to a stdin session for `cmd`: the shell's state as the command finds it
/// (see [`split_shell_state`]), the command (stdin at EOF, as exec mode gives it), then its
/// status on stdout and an end mark on stderr, so both streams are known complete.
pub fn stdin_line(cmd: &str, nonce: &str) -> String {
    format!(
        "{}eval {} </dev/null; printf '__crab_%s_%d__\\n' {nonce} \"$?\"; printf '__crab_%s__\\n' {nonce} >&2\n",
        shell_state_probe(nonce),
        ansi_c_quote(cmd)
    )
}

/// Commands that print, between two marks on stdout, what a bash session's builtins say of
/// its state: what the oracle compares after a recovery (a shell that came back at another
/// turn's state, or a new shell, shows there even when no later command prints it). Only
/// builtins: it starts no process and changes nothing the command could see but `$_`, which
/// the line's own last command sets anyway.
fn shell_state_probe(nonce: &str) -> String {
    let builtins =
        ["pwd", "declare -p", "declare -f", "alias -p", "shopt -p", "set +o", "trap -p", "dirs -l -p", "umask"];
    let mut probe = format!("\\builtin printf '__crab_%s_shell__\\n' {nonce}; ");
    for builtin in builtins {
        probe.push_str(&format!("\\builtin {builtin}; "));
    }
    probe.push_str(&format!("\\builtin printf '__crab_%s_shell_end__\\n' {nonce}; "));
    probe
}

/// Splits a stdin turn's stdout into the shell state [`stdin_line`]'s probe printed first
/// (without the variables bash keeps itself) and the command's own output. A stdout that does
/// not start with the probe (a session that ended) is all output.
pub fn split_shell_state(stdout: &[u8], nonce: &str) -> (String, Vec<u8>) {
    let begin = format!("__crab_{nonce}_shell__\n");
    let end = format!("__crab_{nonce}_shell_end__\n");
    let Some(body) = stdout.strip_prefix(begin.as_bytes()) else { return (String::new(), stdout.to_vec()) };
    let Some(stop) = find(body, end.as_bytes()) else { return (String::new(), stdout.to_vec()) };
    let text = String::from_utf8_lossy(&body[..stop]);
    let mut state = String::new();
    for line in text.split_inclusive('\n') {
        let own = line.starts_with("declare -") && {
            let name = crab_store::declared_name(line.trim_end_matches('\n'));
            crab_store::BASH_OWN_VARIABLES.contains(&name) || name.starts_with("__crab_")
        };
        if !own {
            state.push_str(line);
        }
    }
    (state, body[stop + end.len()..].to_vec())
}

/// The line typed into the tmux pane for `cmd`: a begin mark (the pane also
/// shows the prompt and the typed line), the pane shell's state as the command
/// finds it (the probe of stdin mode; [`split_shell_state`] takes it off the
/// pane's text), the command, its status, then the wait-for signal the turn's
/// exec waits on.
pub fn tmux_line(cmd: &str, nonce: &str) -> String {
    format!(
        "printf '__crab_%s_begin__\\n' {nonce}; {}eval {} </dev/null; printf '__crab_%s_%d__\\n' {nonce} \"$?\"; tmux wait-for -S {TMUX_SESSION}-{nonce}",
        shell_state_probe(nonce),
        ansi_c_quote(cmd)
    )
}

/// The tmux servers a run's pane shells reported, in order, so that their pids compare by
/// identity rather than by number: the pid in `$TMUX` (`socket,pid,session`) is handed out
/// when a fresh sandbox starts its server, and differs between fresh sandboxes by chance (11 in
/// one, 12 in the next), while what the oracle must see is whether the shell after a recovery
/// is the server's it had before the fault (CRIU restores the pid) or one started anew.
/// [`TmuxServers::identify`] writes the first server's pid as `<tmux server 1>`, another as
/// `<tmux server 2>`, and so on, for the whole run.
#[derive(Debug, Default)]
pub struct TmuxServers {
    seen: Vec<String>,
}

impl TmuxServers {
    pub fn identify(&mut self, shell: &str) -> String {
        let mut out = String::with_capacity(shell.len());
        for line in shell.split_inclusive('\n') {
            out.push_str(&self.identify_line(line).unwrap_or_else(|| line.to_string()));
        }
        out
    }

    fn identify_line(&mut self, line: &str) -> Option<String> {
        let value = line.strip_prefix("declare -x TMUX=\"")?;
        let (value, rest) = value.split_once('"')?;
        let mut parts = value.rsplitn(3, ',');
        let (session, pid, socket) = (parts.next()?, parts.next()?, parts.next()?);
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let ordinal = match self.seen.iter().position(|p| p == pid) {
            Some(i) => i + 1,
            None => {
                self.seen.push(pid.to_string());
                self.seen.len()
            }
        };
        Some(format!("declare -x TMUX=\"{socket},<tmux server {ordinal}>,{session}\"{rest}"))
    }
}

/// The end of a command on a stdin session's stdout: `output` is what the
/// command printed, `consumed` how much of the buffer the command and its
/// marker took (the rest belongs to the next command).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StdoutEnd {
    pub output: usize,
    pub rc: i32,
    pub consumed: usize,
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}

/// Finds `__crab_<nonce>_<rc>__\n` anywhere in `buffer` (output that does not
/// end in a newline puts the marker mid-line). None until it is complete.
pub fn parse_stdout_end(buffer: &[u8], nonce: &str) -> Option<StdoutEnd> {
    let prefix = format!("__crab_{nonce}_");
    let mut from = 0;
    while let Some(at) = find(&buffer[from..], prefix.as_bytes()) {
        let start = from + at;
        let rest = &buffer[start + prefix.len()..];
        let digits =
            rest.iter().enumerate().take_while(|(i, b)| b.is_ascii_digit() || (*i == 0 && **b == b'-')).count();
        if digits > 0
            && rest.len() >= digits + 3
            && &rest[digits..digits + 3] == b"__\n"
            && let Some(rc) = std::str::from_utf8(&rest[..digits]).ok().and_then(|text| text.parse::<i32>().ok())
        {
            return Some(StdoutEnd { output: start, rc, consumed: start + prefix.len() + digits + 3 });
        }
        from = start + 1;
    }
    None
}

/// Finds `__crab_<nonce>__\n` in `buffer`: (output length, consumed length).
pub fn parse_stderr_end(buffer: &[u8], nonce: &str) -> Option<(usize, usize)> {
    let marker = format!("__crab_{nonce}__\n");
    find(buffer, marker.as_bytes()).map(|at| (at, at + marker.len()))
}

/// A command's result read off a tmux pane (`capture-pane -p -J`): the lines
/// between the begin mark and the status mark, and the status. None when the
/// pane does not show both (the command has not finished, or scrolled out).
pub fn parse_pane(pane: &str, nonce: &str) -> Option<(String, i32)> {
    let begin = format!("__crab_{nonce}_begin__");
    let lines: Vec<&str> = pane.lines().collect();
    let first = lines.iter().rposition(|line| *line == begin)? + 1;
    let mut output = String::new();
    for line in &lines[first..] {
        let mut text = line.as_bytes().to_vec();
        text.push(b'\n');
        if let Some(end) = parse_stdout_end(&text, nonce) {
            output.push_str(&line[..end.output]);
            return Some((output, end.rc));
        }
        output.push_str(line);
        output.push('\n');
    }
    None
}

/// The script of one tmux-mode turn, run as `bash -c SCRIPT crab-tmux LINE NONCE WORKDIR`:
/// starts the tmux server and session if there is none (first turn, or a
/// sandbox that lost its processes), types the line, waits for its signal,
/// prints the pane and clears its history. Exit 125 with a message when the
/// image has no tmux.
pub const TMUX_TURN_SCRIPT: &str = r#"command -v tmux >/dev/null || { echo "crab-replay: this image has no tmux (tmux mode needs it)" >&2; exit 125; }
s=crab
tmux has-session -t "$s" 2>/dev/null || tmux start-server \; set-option -g history-limit 100000 \; new-session -d -s "$s" -x 400 -y 50 -c "$3" 'exec bash --norc --noprofile -i' || exit 125
tmux send-keys -t "$s" -l -- "$1" && tmux send-keys -t "$s" Enter && tmux wait-for "$s-$2"
tmux capture-pane -p -J -S - -E - -t "$s"
tmux clear-history -t "$s""#;

/// The exit code of [`TMUX_TURN_SCRIPT`] when tmux is missing or cannot start.
pub const TMUX_UNAVAILABLE: i32 = 125;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("the shell session's fifos: {what}: {source}")]
    Fifo {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the shell session: {0}")]
    Exec(#[source] GrpcError),
    #[error("shell session {exec_id}: {what}: {source}")]
    Io {
        exec_id: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// What one command on a stdin session gave.
#[derive(Debug)]
pub struct SessionTurn {
    pub rc: Option<i32>,
    pub timed_out: bool,
    /// The shell's state as the command found it (see [`split_shell_state`]).
    pub shell: String,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The shell exited (the command ran `exit`, or the session was killed):
    /// the next command needs a new session.
    pub ended: bool,
}

/// A long-lived `bash` exec session, started through containerd's API with
/// fifos the replay makes and holds itself, as dockerd does for `docker exec
/// -i` (SWE-agent's and OpenHands' sandboxes). The session's input stays open
/// across a containerd restart: `ctr tasks exec` would exit with containerd,
/// and its closed fifo would be the end of the shell's input.
#[derive(Debug)]
pub struct StdinSession {
    pub exec_id: String,
    container: String,
    /// The containerd (socket and namespace) the session was started through.
    ctr: Ctr,
    stdin: pipe::Sender,
    stdout: pipe::Receiver,
    stderr: pipe::Receiver,
    /// The fifos' directory, removed with the session (the open ends outlive their names).
    _fifos: tempfile::TempDir,
    out: Vec<u8>,
    err: Vec<u8>,
}

/// The session's command line (a re-attach must ask for the same one).
pub const SESSION_ARGV: [&str; 3] = ["bash", "--norc", "--noprofile"];

/// How long a session that ended is waited for to give containerd its exit status.
const EXIT_STATUS_WAIT: Duration = Duration::from_secs(5);

impl StdinSession {
    /// Starts (or, where the runtime holds a restored session of that id,
    /// re-attaches) exec `exec_id` running [`SESSION_ARGV`] in `workdir`.
    pub async fn start(ctr: &Ctr, container: &str, exec_id: &str, workdir: &str) -> Result<StdinSession, SessionError> {
        let fifos = tempfile::Builder::new()
            .prefix("crab-replay-session-")
            .tempdir()
            .map_err(|source| SessionError::Fifo { what: "a directory for them".into(), source })?;
        let io = ExecIo {
            stdin: fifos.path().join("stdin"),
            stdout: fifos.path().join("stdout"),
            stderr: fifos.path().join("stderr"),
        };
        for path in [&io.stdin, &io.stdout, &io.stderr] {
            nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600))
                .map_err(|errno| fifo_error(path, "mkfifo", errno.into()))?;
        }
        // Readers first: a runtime opens its write ends once a reader exists.
        // A fifo no writer has opened yet is never readable, so no read sees
        // an end before the runtime came.
        let stdout =
            pipe::OpenOptions::new().open_receiver(&io.stdout).map_err(|e| fifo_error(&io.stdout, "open", e))?;
        let stderr =
            pipe::OpenOptions::new().open_receiver(&io.stderr).map_err(|e| fifo_error(&io.stderr, "open", e))?;
        // Read and write (Linux): the open does not wait for the runtime's
        // reader, and the fifo keeps a writer for as long as the session lives.
        let stdin = pipe::OpenOptions::new()
            .read_write(true)
            .open_sender(&io.stdin)
            .map_err(|e| fifo_error(&io.stdin, "open", e))?;
        let containerd = Containerd::new(ctr.socket(), ctr.namespace());
        containerd.exec(container, exec_id, &SESSION_ARGV, workdir, &io).await.map_err(SessionError::Exec)?;
        Ok(StdinSession {
            exec_id: exec_id.to_string(),
            container: container.to_string(),
            ctr: ctr.clone(),
            stdin,
            stdout,
            stderr,
            _fifos: fifos,
            out: Vec::new(),
            err: Vec::new(),
        })
    }

    /// A client of its own per call: the session outlives containerd restarts.
    fn containerd(&self) -> Containerd {
        Containerd::new(self.ctr.socket(), self.ctr.namespace())
    }

    /// Whether the shell has ended, as containerd knows its exec (one it
    /// cannot ask counts as ended: the caller starts a new session).
    pub async fn exited(&self) -> bool {
        match self.containerd().process(&self.container, &self.exec_id).await {
            Ok(Some(process)) => !process.is_alive(),
            Ok(None) => true,
            Err(error) => {
                tracing::warn!(exec = %self.exec_id, %error, "asking containerd for the shell session");
                true
            }
        }
    }

    /// Writes `cmd` with its sentinel and reads until both streams carry the
    /// marker, the shell exits, or `timeout` passes (then the caller kills the session).
    pub async fn run(&mut self, cmd: &str, timeout: Duration) -> Result<SessionTurn, SessionError> {
        let nonce = nonce();
        let exec_id = self.exec_id.clone();
        let io = |what: &'static str| {
            let exec_id = exec_id.clone();
            move |source| SessionError::Io { exec_id, what, source }
        };
        let deadline = Instant::now() + timeout;
        let line = stdin_line(cmd, &nonce);
        if let Err(error) = self.stdin.write_all(line.as_bytes()).await {
            // The shell is gone (broken pipe): that is the command's result.
            if error.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(self.ended(deadline, &nonce).await);
            }
            return Err(io("writing the command")(error));
        }
        self.stdin.flush().await.map_err(io("writing the command"))?;
        let mut stdout_end = None;
        let mut stderr_end = None;
        let mut out_open = true;
        let mut err_open = true;
        let mut out_chunk = vec![0u8; 65536];
        let mut err_chunk = vec![0u8; 65536];
        loop {
            if stdout_end.is_none() {
                stdout_end = parse_stdout_end(&self.out, &nonce);
            }
            if stderr_end.is_none() {
                stderr_end = parse_stderr_end(&self.err, &nonce);
            }
            if let (Some(out), Some((err_len, err_used))) = (&stdout_end, stderr_end) {
                let (shell, stdout) = split_shell_state(&self.out[..out.output], &nonce);
                let stderr = self.err[..err_len].to_vec();
                self.out.drain(..out.consumed);
                self.err.drain(..err_used);
                return Ok(SessionTurn { rc: Some(out.rc), timed_out: false, shell, stdout, stderr, ended: false });
            }
            if !out_open && (stdout_end.is_none() || !err_open) {
                return Ok(self.ended(deadline, &nonce).await);
            }
            tokio::select! {
                read = self.stdout.read(&mut out_chunk), if out_open && stdout_end.is_none() => {
                    match read.map_err(io("reading stdout"))? {
                        0 => out_open = false,
                        n => self.out.extend_from_slice(&out_chunk[..n]),
                    }
                }
                read = self.stderr.read(&mut err_chunk), if err_open && stderr_end.is_none() => {
                    match read.map_err(io("reading stderr"))? {
                        0 => err_open = false,
                        n => self.err.extend_from_slice(&err_chunk[..n]),
                    }
                }
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let (shell, stdout) = split_shell_state(&std::mem::take(&mut self.out), &nonce);
                    let stderr = std::mem::take(&mut self.err);
                    return Ok(SessionTurn { rc: None, timed_out: true, shell, stdout, stderr, ended: true });
                }
            }
        }
    }

    /// The shell ended before printing its marker: its exit status is the
    /// command's (`exit 3`), and what it printed is the output.
    async fn ended(&mut self, deadline: Instant, nonce: &str) -> SessionTurn {
        let wait = deadline.saturating_duration_since(Instant::now()).max(EXIT_STATUS_WAIT);
        let status = match self.containerd().wait(&self.container, &self.exec_id, wait).await {
            Ok(status) => status.and_then(|status| i32::try_from(status).ok()),
            Err(error) => {
                tracing::warn!(exec = %self.exec_id, %error, "the shell session's exit status");
                None
            }
        };
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(200), self.stderr.read_to_end(&mut rest)).await;
        self.err.extend_from_slice(&rest);
        let (shell, stdout) = split_shell_state(&std::mem::take(&mut self.out), nonce);
        SessionTurn { rc: status, timed_out: false, shell, stdout, stderr: std::mem::take(&mut self.err), ended: true }
    }

    /// Closes the session's ends: the shell reads the end of its input (the
    /// caller kills the exec in the container where it must not wait for that).
    pub fn close(self) {}
}

fn fifo_error(path: &Path, what: &str, source: std::io::Error) -> SessionError {
    SessionError::Fifo { what: format!("{what} {}", path.display()), source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_stdout_marker_ends_output_mid_line_and_leaves_what_follows() {
        let buffer = b"abc__crab_n1_7__\nnext";
        assert_eq!(parse_stdout_end(buffer, "n1"), Some(StdoutEnd { output: 3, rc: 7, consumed: 17 }));
        assert_eq!(&buffer[17..], b"next");
    }

    #[test]
    fn an_incomplete_or_foreign_marker_is_not_an_end() {
        assert_eq!(parse_stdout_end(b"__crab_n1_0__", "n1"), None, "no newline yet");
        assert_eq!(parse_stdout_end(b"__crab_n1_", "n1"), None);
        assert_eq!(parse_stdout_end(b"__crab_n2_0__\n", "n1"), None, "another command's nonce");
        assert_eq!(parse_stdout_end(b"__crab_n1_%d__\n", "n1"), None, "the format, as a terminal echoes it");
        assert_eq!(parse_stdout_end(b"__crab_n1_x__\n__crab_n1_2__\n", "n1").map(|end| end.rc), Some(2));
    }

    #[test]
    fn the_stderr_marker_ends_stderr() {
        assert_eq!(parse_stderr_end(b"oops\n__crab_n1__\n", "n1"), Some((5, 17)));
        assert_eq!(parse_stderr_end(b"oops\n__crab_n1__", "n1"), None);
    }

    #[test]
    fn the_pane_gives_the_lines_between_the_marks() {
        let pane = "bash-5.2# printf '__crab_%s_begin__\\n' n1; eval $'ls' ...\n__crab_n1_begin__\na\nb\n__crab_n1_0__\nbash-5.2# \n";
        assert_eq!(parse_pane(pane, "n1"), Some(("a\nb\n".to_string(), 0)));
        let unfinished = "__crab_n1_begin__\na\n";
        assert_eq!(parse_pane(unfinished, "n1"), None);
        let no_newline = "__crab_n1_begin__\nabc__crab_n1_3__\n";
        assert_eq!(parse_pane(no_newline, "n1"), Some(("abc".to_string(), 3)));
    }

    /// Runs `cmds` as stdin turns of a real `bash` and splits each turn's stdout.
    fn turns_in_bash(cmds: &[&str]) -> Vec<(String, String)> {
        use std::io::Write;
        let nonces: Vec<String> = cmds.iter().map(|_| nonce()).collect();
        let input: String = cmds.iter().zip(&nonces).map(|(cmd, n)| stdin_line(cmd, n)).collect();
        let mut child = std::process::Command::new("bash")
            .arg("--norc")
            .current_dir("/")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap().stdout;
        let mut rest: &[u8] = &out;
        let mut turns = Vec::new();
        for n in &nonces {
            let end = parse_stdout_end(rest, n).expect("status marker");
            let (shell, stdout) = split_shell_state(&rest[..end.output], n);
            turns.push((shell, String::from_utf8(stdout).unwrap()));
            rest = &rest[end.consumed..];
        }
        turns
    }

    #[test]
    fn each_stdin_turn_shows_the_shell_state_its_command_found() {
        let turns = turns_in_bash(&["cd /tmp; X=1; f() { :; }; echo out", "echo \"$X\"", "unset X"]);
        assert_eq!(turns[0].1, "out\n");
        assert_eq!(turns[1].1, "1\n", "the probe changes nothing the command sees");
        let (first, second, third) = (&turns[0].0, &turns[1].0, &turns[2].0);
        assert!(first.starts_with("/\n") && !first.contains("declare -- X="), "{first}");
        assert!(second.starts_with("/tmp\n") && second.contains("declare -- X=\"1\"\n") && second.contains("f () \n"));
        assert!(third.contains("declare -- X=\"1\"\n"));
        // bash's own variables (and the replay's) are left out: two identical states compare equal.
        for state in [first, second, third] {
            assert!(
                !state.contains("declare -- _=") && !state.contains("BASH_COMMAND") && !state.contains("RANDOM"),
                "{state}"
            );
        }
        let again = turns_in_bash(&["cd /tmp; X=1; f() { :; }; echo out", "echo \"$X\"", "unset X"]);
        assert_eq!(again.iter().map(|t| &t.0).collect::<Vec<_>>(), [first, second, third]);
    }

    /// Types `cmds` as tmux-mode turns into a real tmux pane (a server of its own) running the
    /// shell tmux mode runs, and splits each turn's pane text as the replay does.
    fn turns_in_tmux(cmds: &[&str]) -> Vec<(String, String, i32)> {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("tmux.sock");
        let tmux = |args: &[&str]| {
            let out = std::process::Command::new("tmux").arg("-S").arg(&socket).args(args).output().unwrap();
            assert!(out.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        let session = TMUX_SESSION;
        tmux(&[
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "400",
            "-y",
            "50",
            "-c",
            "/",
            "exec bash --norc --noprofile -i",
        ]);
        tmux(&["set-option", "-g", "history-limit", "100000"]);
        let mut turns = Vec::new();
        for cmd in cmds {
            let n = nonce();
            // The line signals the replay's server by name: this test's server is another.
            let line = tmux_line(cmd, &n).replace("tmux wait-for", &format!("tmux -S {} wait-for", socket.display()));
            tmux(&["send-keys", "-t", session, "-l", "--", &line]);
            tmux(&["send-keys", "-t", session, "Enter"]);
            tmux(&["wait-for", &format!("{session}-{n}")]);
            let pane = tmux(&["capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", session]);
            tmux(&["clear-history", "-t", session]);
            let (text, rc) = parse_pane(&pane, &n).expect("the pane shows the command's end");
            let (shell, output) = split_shell_state(text.as_bytes(), &n);
            turns.push((shell, String::from_utf8(output).unwrap(), rc));
        }
        tmux(&["kill-server"]);
        turns
    }

    #[test]
    fn each_tmux_turn_shows_the_pane_shells_state() {
        if std::process::Command::new("tmux").arg("-V").output().is_err() {
            panic!("tmux is not installed: scripts/install-deps installs it");
        }
        let cmds = [
            "cd /tmp; X=1; f() { :; }; L=$(printf 'x%.0s' {1..900}); echo out",
            "echo \"$X\"; false",
            "unset X; alias hi='echo hi'",
        ];
        let turns = turns_in_tmux(&cmds);
        assert_eq!((turns[0].1.as_str(), turns[0].2), ("out\n", 0));
        assert_eq!((turns[1].1.as_str(), turns[1].2), ("1\n", 1), "the probe changes nothing the command sees");
        let (first, second, third) = (&turns[0].0, &turns[1].0, &turns[2].0);
        assert!(first.starts_with("/\n") && !first.contains("declare -- X="), "{first}");
        assert!(
            second.starts_with("/tmp\n") && second.contains("declare -- X=\"1\"\n") && second.contains("f () \n"),
            "{second}"
        );
        assert!(third.contains("declare -- X=\"1\"\n") && !third.contains("alias hi"), "{third}");
        // Wider than the pane (400 columns): -J gives the wrapped line back whole.
        assert!(third.contains(&format!("declare -- L=\"{}\"\n", "x".repeat(900))), "{third}");
        // A second server in the same states shows the same text but for $TMUX
        // (this test's socket path and server pid; the replay's are the sandbox's own).
        let without_tmux =
            |state: &str| state.lines().filter(|l| !l.starts_with("declare -x TMUX=")).collect::<Vec<_>>().join("\n");
        let again = turns_in_tmux(&cmds);
        for (a, b) in again.iter().zip([first, second, third]) {
            assert_eq!(without_tmux(&a.0), without_tmux(b));
        }
    }

    #[test]
    fn tmux_servers_compare_by_identity_not_by_pid() {
        let state = |pid: u32| {
            format!("/app\ndeclare -x TERM=\"tmux\"\ndeclare -x TMUX=\"/tmp/tmux-0/default,{pid},0\"\numask\n")
        };
        let (mut reference, mut run) = (TmuxServers::default(), TmuxServers::default());
        // Fresh sandboxes whose servers got different pids show the same state ...
        assert_eq!(reference.identify(&state(11)), run.identify(&state(12)));
        assert!(run.identify(&state(12)).contains("default,<tmux server 1>,0\"\n"));
        // ... and a run whose shell after a recovery is another server's shows it.
        assert_eq!(reference.identify(&state(11)), reference.identify(&state(11)));
        assert_ne!(reference.identify(&state(11)), run.identify(&state(40)));
        assert!(run.identify(&state(40)).contains("<tmux server 2>"));
        // Other lines, and a value that is not socket,pid,session, are left as they are.
        assert_eq!(run.identify("declare -x TMUX=\"odd\"\nx\n"), "declare -x TMUX=\"odd\"\nx\n");
    }

    #[test]
    fn a_quoted_command_is_one_line() {
        assert_eq!(ansi_c_quote("echo 'a'\n\tb\\c"), "$'echo \\'a\\'\\n\\tb\\\\c'");
        assert_eq!(ansi_c_quote("\x01f"), "$'\\x01f'");
        assert!(!stdin_line("a\nb", "n").trim_end_matches('\n').contains('\n'));
        assert!(!tmux_line("a\nb", "n").contains('\n'));
    }

    proptest! {
        #[test]
        fn output_before_the_marker_is_returned_whole(output in proptest::collection::vec(any::<u8>(), 0..200), rc in -300i32..300, tail in proptest::collection::vec(any::<u8>(), 0..20)) {
            let nonce = "0123456789abcdef";
            let mut buffer = output.clone();
            buffer.extend_from_slice(format!("__crab_{nonce}_{rc}__\n").as_bytes());
            let consumed = buffer.len();
            buffer.extend_from_slice(&tail);
            // Random bytes cannot hold a 16-hex-digit nonce by chance here.
            prop_assume!(find(&output, nonce.as_bytes()).is_none());
            let end = parse_stdout_end(&buffer, nonce).unwrap();
            prop_assert_eq!(end, StdoutEnd { output: output.len(), rc, consumed });
        }

        #[test]
        fn any_prefix_of_the_marker_is_not_an_end(output in "[a-z\n]{0,50}", cut in 0usize..24) {
            let nonce = "0123456789abcdef";
            let marker = format!("__crab_{nonce}_0__\n");
            let mut buffer = output.into_bytes();
            buffer.extend_from_slice(&marker.as_bytes()[..cut.min(marker.len() - 1)]);
            prop_assert_eq!(parse_stdout_end(&buffer, nonce), None);
        }
    }
}
