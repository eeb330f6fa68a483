//! The `ctr` command line against one containerd socket and namespace: what
//! a user of containerd has at hand, so the baselines measure what they do.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum CtrError {
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed (exit {code:?}): {stderr}")]
    Failed { command: String, code: Option<i32>, stderr: String },
    #[error("`{command}` did not finish within {after:?}")]
    Timeout { command: String, after: Duration },
    #[error("waiting for `{command}`: {source}")]
    Wait {
        command: String,
        #[source]
        source: std::io::Error,
    },
}

/// What a finished `ctr` run produced.
#[derive(Debug, Clone)]
pub struct CtrOutput {
    /// `None` when `ctr` was stopped by a signal or by our deadline.
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub elapsed: Duration,
    pub timed_out: bool,
}

impl CtrOutput {
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).trim().to_string()
    }
}

/// Checkpoints and restores of a loaded 2-core machine fit well within this.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
pub struct Ctr {
    socket: PathBuf,
    namespace: String,
}

impl Ctr {
    pub fn new(socket: impl Into<PathBuf>, namespace: impl Into<String>) -> Ctr {
        Ctr { socket: socket.into(), namespace: namespace.into() }
    }

    /// The containerd socket this client talks to.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// `CRAB_CTRD_SOCK` (else `CONTAINERD_ADDRESS`, as `ctr` reads it) and `CRAB_NS`, defaulting
    /// to the private containerd of `scripts/containerd`.
    pub fn from_env() -> Ctr {
        let socket = std::env::var("CRAB_CTRD_SOCK")
            .or_else(|_| std::env::var("CONTAINERD_ADDRESS"))
            .unwrap_or_else(|_| "/run/crab-dev/containerd.sock".to_string());
        let namespace = std::env::var("CRAB_NS").unwrap_or_else(|_| "crab".to_string());
        Ctr::new(socket, namespace)
    }

    fn command_line(&self, args: &[String]) -> String {
        format!("ctr {}", args.join(" "))
    }

    /// Runs `ctr ARGS` and returns whatever it produced, whatever its exit code.
    /// On `deadline` the `ctr` process is killed and `timed_out` is set; callers
    /// that started something inside a container stop it themselves.
    pub async fn run_raw(&self, args: &[String], deadline: Duration) -> Result<CtrOutput, CtrError> {
        let command = self.command_line(args);
        let started = Instant::now();
        let mut child = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .arg("--namespace")
            .arg(&self.namespace)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| CtrError::Spawn { command: command.clone(), source })?;
        let mut stdout_pipe = child.stdout.take().expect("stdout is piped");
        let mut stderr_pipe = child.stderr.take().expect("stderr is piped");
        let stdout_task = tokio::spawn(async move {
            let mut buffer = Vec::new();
            let _ = stdout_pipe.read_to_end(&mut buffer).await;
            buffer
        });
        let stderr_task = tokio::spawn(async move {
            let mut buffer = Vec::new();
            let _ = stderr_pipe.read_to_end(&mut buffer).await;
            buffer
        });
        let (status, timed_out) = match tokio::time::timeout(deadline, child.wait()).await {
            Ok(status) => (status.map_err(|source| CtrError::Wait { command: command.clone(), source })?, false),
            Err(_) => {
                let _ = child.start_kill();
                let status =
                    child.wait().await.map_err(|source| CtrError::Wait { command: command.clone(), source })?;
                (status, true)
            }
        };
        let elapsed = started.elapsed();
        // A process left running in the container may hold the pipes open: do not wait for it forever.
        let collect = |task: tokio::task::JoinHandle<Vec<u8>>| async move {
            tokio::time::timeout(Duration::from_secs(2), task).await.ok().and_then(Result::ok).unwrap_or_default()
        };
        let stdout = collect(stdout_task).await;
        let stderr = collect(stderr_task).await;
        Ok(CtrOutput { code: if timed_out { None } else { status.code() }, stdout, stderr, elapsed, timed_out })
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
            if !listed.map(|o| o.stdout_text().lines().any(|l| l == id)).unwrap_or(false) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.run(&["containers", "delete", id]).await;
    }

    /// Runs `ctr ARGS` and fails unless it exits 0 within [`ADMIN_TIMEOUT`].
    pub async fn run<S: AsRef<str>>(&self, args: &[S]) -> Result<CtrOutput, CtrError> {
        let args: Vec<String> = args.iter().map(|arg| arg.as_ref().to_string()).collect();
        let output = self.run_raw(&args, ADMIN_TIMEOUT).await?;
        if output.timed_out {
            return Err(CtrError::Timeout { command: self.command_line(&args), after: ADMIN_TIMEOUT });
        }
        if output.code != Some(0) {
            return Err(CtrError::Failed {
                command: self.command_line(&args),
                code: output.code,
                stderr: output.stderr_text(),
            });
        }
        Ok(output)
    }

    /// The manifest or index digest an image name points to, `None` when absent.
    pub async fn image_digest(&self, reference: &str) -> Result<Option<String>, CtrError> {
        let output = self.run(&["images", "ls", &format!("name=={reference}")]).await?;
        Ok(parse_image_digest(&output.stdout_text(), reference))
    }
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
}
