//! Runs `ctr` on a pseudo-terminal, as a person at a terminal would: `ctr run -t` needs its stdin to
//! be a console, forwards window-size changes (SIGWINCH) to the task, and puts it in raw mode.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::pty::{Winsize, openpty};

use crate::{HarnessError, Outcome, wait_until};
use crab_containerd::Ctr;
use crab_containerd::ctr::describe;

nix::ioctl_write_ptr_bad!(set_window_size, libc::TIOCSWINSZ, Winsize);

pub struct PtySession {
    command: String,
    master: std::fs::File,
    output: Arc<Mutex<Vec<u8>>>,
    child: tokio::process::Child,
}

impl PtySession {
    /// Starts `ctr <args>` as the session leader of a new terminal of `rows` x `cols`.
    pub fn spawn(ctr: &Ctr, args: Vec<String>, rows: u16, cols: u16) -> Outcome<PtySession> {
        let args = ctr.full_args(args);
        let command = describe(&args);
        let size = Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
        let pty = openpty(Some(&size), None).map_err(|e| HarnessError::io("openpty", e.into()))?;
        let slave: OwnedFd = pty.slave;
        let stdio = |fd: &OwnedFd| -> Outcome<Stdio> {
            Ok(Stdio::from(fd.try_clone().map_err(|e| HarnessError::io("duplicating the pty slave", e))?))
        };
        let mut process = tokio::process::Command::new("ctr");
        process.args(&args).stdin(stdio(&slave)?).stdout(stdio(&slave)?).stderr(stdio(&slave)?).kill_on_drop(true);
        // SAFETY: only async-signal-safe calls between fork and exec. A new session with the pty as
        // controlling terminal makes resizes reach `ctr` as SIGWINCH.
        unsafe {
            process.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = process.spawn().map_err(|e| HarnessError::io(format!("starting `{command}`"), e))?;
        drop(slave);
        let master = std::fs::File::from(pty.master);
        let output: Arc<Mutex<Vec<u8>>> = Arc::default();
        let mut reader = master.try_clone().map_err(|e| HarnessError::io("duplicating the pty master", e))?;
        let sink = output.clone();
        // Reading the master blocks; it ends with EIO once every slave descriptor is closed.
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = reader.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Ok(PtySession { command, master, output, child })
    }

    pub fn send(&self, text: &str) -> Outcome<()> {
        (&self.master)
            .write_all(text.as_bytes())
            .map_err(|e| HarnessError::io(format!("typing into `{}`", self.command), e))
    }

    /// Everything the terminal showed so far.
    pub fn screen(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Waits until the terminal output, from byte offset `from` on, contains `needle`; returns that
    /// part of the output.
    pub async fn wait_for_text(&self, from: usize, needle: &str, timeout: Duration) -> Outcome<String> {
        wait_until(&format!("{needle:?} on the terminal of `{}`", self.command), timeout, || async {
            let bytes = self.output.lock().unwrap();
            let tail = String::from_utf8_lossy(&bytes[from.min(bytes.len())..]).into_owned();
            Ok(tail.contains(needle).then_some(tail))
        })
        .await
        .map_err(|error| match error {
            HarnessError::Timeout { what, after } => {
                HarnessError::Timeout { what: format!("{what}; terminal showed {:?}", self.screen()), after }
            }
            other => other,
        })
    }

    pub fn output_len(&self) -> usize {
        self.output.lock().unwrap().len()
    }

    /// Changes the terminal size; the kernel sends SIGWINCH to `ctr`, which resizes the task's console.
    pub fn resize(&self, rows: u16, cols: u16) -> Outcome<()> {
        let size = Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: TIOCSWINSZ reads one Winsize from a valid pointer on an open pty master.
        unsafe { set_window_size(self.master.as_raw_fd(), &size) }
            .map_err(|e| HarnessError::io("resizing the terminal", e.into()))?;
        Ok(())
    }

    pub async fn wait_exit(&mut self, timeout: Duration) -> Outcome<ExitStatus> {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.map_err(|e| HarnessError::io(format!("waiting for `{}`", self.command), e)),
            Err(_) => Err(HarnessError::Timeout {
                what: format!("`{}` to exit; terminal showed {:?}", self.command, self.screen()),
                after: timeout,
            }),
        }
    }
}
