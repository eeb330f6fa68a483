//! A thin wrapper around the `ctr` binary: every call has a timeout and every error names the command
//! line and what `ctr` printed on stderr.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// Long enough for a checkpoint or a restore on a loaded 2-core machine.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

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

/// What a finished `ctr` invocation produced.
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

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
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
        let deadline = std::time::Instant::now() + timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
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
        // `ctr` starts no children, so its pipes close when it exits and the readers end.
        for reader in [stdout_reader, stderr_reader].into_iter().flatten() {
            let _ = reader.join();
        }
        Ok(CtrOutput { command, status, stdout: take_text(&stdout), stderr: take_text(&stderr) })
    }
}

/// One `ctr` command line, configured builder-style and then run with `output` or `success`.
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

    /// Runs to completion whatever the exit status.
    pub async fn output(self) -> Result<CtrOutput, CtrError> {
        let command = self.command_line();
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
                drop(writer);
            });
        }
        let stdout = drain_async(child.stdout.take());
        let stderr = drain_async(child.stderr.take());
        let status = match tokio::time::timeout(self.timeout, child.wait()).await {
            Ok(Ok(status)) => status,
            Ok(Err(source)) => return Err(CtrError::Wait { command, source }),
            Err(_) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Err(CtrError::Timeout {
                    command,
                    after: self.timeout,
                    stdout: take_text(&stdout.0),
                    stderr: take_text(&stderr.0),
                });
            }
        };
        for reader in [stdout.1, stderr.1].into_iter().flatten() {
            let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
        }
        Ok(CtrOutput { command, status, stdout: take_text(&stdout.0), stderr: take_text(&stderr.0) })
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
                buffer.lock().unwrap().extend_from_slice(&chunk[..n]);
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
                buffer.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        })
    });
    (buffer, handle)
}

fn take_text(buffer: &SharedBuffer) -> String {
    String::from_utf8_lossy(&buffer.lock().unwrap()).into_owned()
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
