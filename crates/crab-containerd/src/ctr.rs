//! The `ctr` binary against one containerd socket and namespace. Every call has a deadline
//! and every error names the command line (copy-pasteable) and what `ctr` printed on stderr.
//!
//! Two shapes of result, over one way of running `ctr`:
//! - [`Invocation::output`] and [`Invocation::success`] (and [`Ctr::blocking`]) give a
//!   [`CtrOutput`] of text, for callers that read listings and messages (the tests);
//! - [`Ctr::run`] and [`Ctr::run_raw`] give a [`RawOutput`] of bytes with its exit code and
//!   time, for callers that keep what a command printed as it was (the replay's turns, blobs
//!   read with `ctr content get`) or that treat a deadline as a result, not an error.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// The tests' default: long enough for a checkpoint or a restore on a loaded 2-core machine.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// [`Ctr::run`]'s bound: checkpoints and restores of a loaded 2-core machine fit well within it.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(120);

/// The private containerd of `scripts/containerd`, which [`Ctr::from_env`] falls back to.
pub const DEFAULT_SOCKET: &str = "/run/crab-dev/containerd.sock";
pub const DEFAULT_NAMESPACE: &str = "crab";

/// How long the output of a finished `ctr` is waited for: a process it started in a container
/// may hold the pipes open after `ctr` itself has exited.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum CtrError {
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` did not finish within {after:?} (stdout so far: {stdout:?}, stderr so far: {stderr:?})")]
    Timeout { command: String, after: Duration, stdout: String, stderr: String },
    #[error("`{command}` exited with {status}: {stderr}")]
    Failed { command: String, status: ExitStatus, stderr: String },
    #[error("waiting for `{command}`: {source}")]
    Wait {
        command: String,
        #[source]
        source: std::io::Error,
    },
}

/// What a finished `ctr` invocation printed, as text.
#[derive(Debug, Clone)]
pub struct CtrOutput {
    pub command: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CtrOutput {
    /// The exit code, or `None` if `ctr` itself died by a signal.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

/// What a `ctr` run produced, as bytes; a run cut at its deadline is a result too.
#[derive(Debug, Clone)]
pub struct RawOutput {
    pub command: String,
    /// `None` when `ctr` was stopped by a signal or by the deadline.
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub elapsed: Duration,
    pub timed_out: bool,
    status: ExitStatus,
}

impl RawOutput {
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).trim().to_string()
    }
}

/// `ctr` bound to one containerd socket and namespace.
#[derive(Debug, Clone)]
pub struct Ctr {
    socket: PathBuf,
    namespace: String,
}

impl Ctr {
    pub fn new(socket: impl Into<PathBuf>, namespace: impl Into<String>) -> Self {
        Ctr { socket: socket.into(), namespace: namespace.into() }
    }

    /// `CRAB_CTRD_SOCK` (else `CONTAINERD_ADDRESS`, as `ctr` reads it) and `CRAB_NS`, defaulting
    /// to the private containerd of `scripts/containerd`.
    pub fn from_env() -> Ctr {
        let socket = std::env::var("CRAB_CTRD_SOCK")
            .or_else(|_| std::env::var("CONTAINERD_ADDRESS"))
            .unwrap_or_else(|_| DEFAULT_SOCKET.to_string());
        let namespace = std::env::var("CRAB_NS").unwrap_or_else(|_| DEFAULT_NAMESPACE.to_string());
        Ctr::new(socket, namespace)
    }

    /// The containerd socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The same containerd, another namespace.
    pub fn in_namespace(&self, namespace: impl Into<String>) -> Ctr {
        Ctr::new(&self.socket, namespace)
    }

    /// The global flags that select the socket and namespace, followed by `args`.
    pub fn full_args<I, S>(&self, args: I) -> Vec<String>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut all = vec![
            "--address".to_string(),
            self.socket.display().to_string(),
            "--namespace".to_string(),
            self.namespace.clone(),
        ];
        all.extend(args.into_iter().map(Into::into));
        all
    }

    pub fn invoke<I, S>(&self, args: I) -> Invocation
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Invocation { args: self.full_args(args), stdin: None, stdin_close_gate: None, timeout: DEFAULT_TIMEOUT }
    }

    /// Runs `ctr ARGS` and returns whatever it produced, whatever its exit code. On `deadline`
    /// the `ctr` process is killed and `timed_out` is set; callers that started something
    /// inside a container stop it themselves.
    pub async fn run_raw<S: AsRef<str>>(&self, args: &[S], deadline: Duration) -> Result<RawOutput, CtrError> {
        self.invoke(args.iter().map(|arg| arg.as_ref().to_string())).timeout(deadline).raw().await
    }

    /// Runs `ctr ARGS` and fails unless it exits 0 within [`ADMIN_TIMEOUT`].
    pub async fn run<S: AsRef<str>>(&self, args: &[S]) -> Result<RawOutput, CtrError> {
        let output = self.run_raw(args, ADMIN_TIMEOUT).await?;
        if output.timed_out {
            return Err(CtrError::Timeout {
                command: output.command.clone(),
                after: ADMIN_TIMEOUT,
                stdout: output.stdout_text(),
                stderr: output.stderr_text(),
            });
        }
        if output.code != Some(0) {
            let stderr = output.stderr_text();
            return Err(CtrError::Failed { command: output.command, status: output.status, stderr });
        }
        Ok(output)
    }

    /// Kills container `id`'s task, deletes the task once containerd lets go of it (2 s at
    /// most), then the container; for clean-ups, so nothing here fails.
    pub async fn force_remove(&self, id: &str) {
        let _ = self.run(&["tasks", "kill", "--signal", "SIGKILL", id]).await;
        for _ in 0..40 {
            if self.run(&["tasks", "delete", "--force", id]).await.is_ok() {
                break;
            }
            let listed = self.run(&["tasks", "ls", "-q"]).await;
            if !listed.map(|o| o.stdout_text().lines().any(|l| l.trim() == id)).unwrap_or(false) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.run(&["containers", "delete", id]).await;
    }

    /// The manifest or index digest an image name points to, `None` when absent.
    pub async fn image_digest(&self, reference: &str) -> Result<Option<String>, CtrError> {
        let output = self.run(&["images", "ls", &format!("name=={reference}")]).await?;
        Ok(parse_image_digest(&output.stdout_text(), reference))
    }

    /// Runs `ctr` synchronously, for contexts that cannot await (guards' `Drop`, one-time checks).
    pub fn blocking<I, S>(&self, args: I, timeout: Duration) -> Result<CtrOutput, CtrError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let args = self.full_args(args);
        let command = describe(&args);
        let mut child = std::process::Command::new("ctr")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| CtrError::Spawn { command: command.clone(), source })?;
        let (stdout, stdout_reader) = drain_blocking(child.stdout.take());
        let (stderr, stderr_reader) = drain_blocking(child.stderr.take());
        let deadline = Instant::now() + timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(CtrError::Timeout {
                        command,
                        after: timeout,
                        stdout: take_text(&stdout),
                        stderr: take_text(&stderr),
                    });
                }
                Err(source) => return Err(CtrError::Wait { command, source }),
            }
        };
        // `ctr` starts no children of its own, so its pipes close when it exits and the readers end.
        for reader in [stdout_reader, stderr_reader].into_iter().flatten() {
            let _ = reader.join();
        }
        Ok(CtrOutput { command, status, stdout: take_text(&stdout), stderr: take_text(&stderr) })
    }
}

/// One `ctr` command line, configured builder-style and then run.
pub struct Invocation {
    args: Vec<String>,
    stdin: Option<Vec<u8>>,
    /// Stdin is closed only once this completes (see `close_stdin_after`).
    stdin_close_gate: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    timeout: Duration,
}

impl Invocation {
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(bytes.into());
        self
    }

    /// Delays closing stdin until `gate` completes. `ctr run` only learns how to close the task's
    /// stdin once the task exists; an EOF that arrives earlier is lost and the task never sees it.
    pub fn close_stdin_after(mut self, gate: impl Future<Output = ()> + Send + 'static) -> Self {
        self.stdin_close_gate = Some(Box::pin(gate));
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn command_line(&self) -> String {
        describe(&self.args)
    }

    /// Runs to completion whatever the exit status; the deadline is an error.
    pub async fn output(self) -> Result<CtrOutput, CtrError> {
        let after = self.timeout;
        let raw = self.raw().await?;
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        if raw.timed_out {
            return Err(CtrError::Timeout {
                command: raw.command,
                after,
                stdout: text(&raw.stdout),
                stderr: text(&raw.stderr),
            });
        }
        Ok(CtrOutput { command: raw.command, status: raw.status, stdout: text(&raw.stdout), stderr: text(&raw.stderr) })
    }

    /// Runs to completion and requires exit status 0.
    pub async fn success(self) -> Result<CtrOutput, CtrError> {
        let output = self.output().await?;
        if output.status.success() {
            Ok(output)
        } else {
            Err(CtrError::Failed { command: output.command, status: output.status, stderr: output.stderr })
        }
    }

    /// Starts `ctr` in the background with stdout piped, for streaming commands such as `ctr events`.
    pub fn spawn_streaming(self) -> Result<tokio::process::Child, CtrError> {
        let command = self.command_line();
        tokio::process::Command::new("ctr")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| CtrError::Spawn { command, source })
    }

    /// The one way `ctr` is run asynchronously: stdin fed (and closed after its gate), stdout
    /// and stderr drained while it runs, killed at the deadline (then `timed_out`).
    async fn raw(self) -> Result<RawOutput, CtrError> {
        let command = self.command_line();
        let started = Instant::now();
        let mut child = tokio::process::Command::new("ctr")
            .args(&self.args)
            .stdin(if self.stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| CtrError::Spawn { command: command.clone(), source })?;
        if let (Some(bytes), Some(mut writer)) = (self.stdin, child.stdin.take()) {
            let gate = self.stdin_close_gate;
            // Closing stdin after the bytes is what lets `cat`/`wc` in the container finish.
            tokio::spawn(async move {
                let _ = writer.write_all(&bytes).await;
                if let Some(gate) = gate {
                    gate.await;
                }
                let _ = writer.shutdown().await;
            });
        }
        let (stdout, stdout_reader) = drain_async(child.stdout.take());
        let (stderr, stderr_reader) = drain_async(child.stderr.take());
        let (status, timed_out) = match tokio::time::timeout(self.timeout, child.wait()).await {
            Ok(status) => (status.map_err(|source| CtrError::Wait { command: command.clone(), source })?, false),
            Err(_) => {
                let _ = child.start_kill();
                let status =
                    child.wait().await.map_err(|source| CtrError::Wait { command: command.clone(), source })?;
                (status, true)
            }
        };
        let elapsed = started.elapsed();
        for reader in [stdout_reader, stderr_reader].into_iter().flatten() {
            let _ = tokio::time::timeout(DRAIN_GRACE, reader).await;
        }
        Ok(RawOutput {
            command,
            code: if timed_out { None } else { status.code() },
            stdout: take_bytes(&stdout),
            stderr: take_bytes(&stderr),
            elapsed,
            timed_out,
            status,
        })
    }
}

type SharedBuffer = Arc<Mutex<Vec<u8>>>;

fn drain_async<R>(reader: Option<R>) -> (SharedBuffer, Option<tokio::task::JoinHandle<()>>)
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let buffer = SharedBuffer::default();
    let handle = reader.map(|mut reader| {
        let buffer = buffer.clone();
        tokio::spawn(async move {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = reader.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                buffer.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend_from_slice(&chunk[..n]);
            }
        })
    });
    (buffer, handle)
}

fn drain_blocking<R>(reader: Option<R>) -> (SharedBuffer, Option<std::thread::JoinHandle<()>>)
where
    R: std::io::Read + Send + 'static,
{
    let buffer = SharedBuffer::default();
    let handle = reader.map(|mut reader| {
        let buffer = buffer.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = reader.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buffer.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend_from_slice(&chunk[..n]);
            }
        })
    });
    (buffer, handle)
}

fn take_bytes(buffer: &SharedBuffer) -> Vec<u8> {
    std::mem::take(&mut *buffer.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

fn take_text(buffer: &SharedBuffer) -> String {
    String::from_utf8_lossy(&take_bytes(buffer)).into_owned()
}

/// A copy-pasteable rendering of a command line.
pub fn describe(args: &[String]) -> String {
    let mut line = String::from("ctr");
    for arg in args {
        line.push(' ');
        if !arg.is_empty() && arg.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+".contains(c)) {
            line.push_str(arg);
        } else {
            line.push('\'');
            line.push_str(&arg.replace('\'', r"'\''"));
            line.push('\'');
        }
    }
    line
}

/// Picks the DIGEST column of `ctr images ls` for exactly `reference`.
pub fn parse_image_digest(listing: &str, reference: &str) -> Option<String> {
    listing.lines().skip(1).find_map(|line| {
        let mut columns = line.split_whitespace();
        let name = columns.next()?;
        let _media_type = columns.next()?;
        let digest = columns.next()?;
        (name == reference && digest.starts_with("sha256:")).then(|| digest.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_digest_is_taken_from_the_matching_row() {
        let listing = "REF TYPE DIGEST SIZE PLATFORMS LABELS\n\
            crab.local/terminal:latest application/vnd.oci.image.manifest.v1+json sha256:b7ee 314.1 MiB linux/amd64 -\n\
            crab.local/terminal:latest2 application/vnd.oci.image.manifest.v1+json sha256:ffff 1 MiB linux/amd64 -\n";
        assert_eq!(parse_image_digest(listing, "crab.local/terminal:latest").as_deref(), Some("sha256:b7ee"));
        assert_eq!(parse_image_digest(listing, "crab.local/busybox:latest"), None);
    }

    #[test]
    fn command_lines_are_quoted_to_paste_into_a_shell() {
        let args: Vec<String> = ["run", "--env", "A=b c", "it's"].map(String::from).into();
        assert_eq!(describe(&args), r#"ctr run --env 'A=b c' 'it'\''s'"#);
        assert_eq!(describe(&[String::new()]), "ctr ''");
    }
}
