//! Disruptive: SIGKILLs the shared containerd and starts it again with the control script
//! (CRAB_CTRD_CONTROL, default scripts/containerd). It has its own test binary so that no other
//! test runs meanwhile (cargo runs test binaries one at a time); tests in here are serialised too.

use std::time::Duration;

use crab_integration::daemon::{Containerd, RestartGuard};
use crab_integration::host;
use crab_integration::{Container, EventStream, Outcome, TestEnv, ensure, ensure_eq, require_same, wait_until};

const SHORT: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(30);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TICKER: &[&str] = &["sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.05; done"];

async fn log_grows(container: &Container, what: &str) -> Outcome<()> {
    let before = container.read_log().len();
    wait_until(&format!("output of {} to keep flowing {what}", container.id()), SHORT, || async {
        Ok((container.read_log().len() > before).then_some(()))
    })
    .await
}

struct Subject {
    container: Container,
    init: u32,
    shim: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_survive_a_containerd_crash_and_restart() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    let _serial = SERIAL.lock().await;
    let env = TestEnv::get();
    let containerd = Containerd::new(env).unwrap_or_else(|e| panic!("{e}"));

    let mut subjects = Vec::new();
    for runtime in &env.runtimes {
        let container = Container::new(runtime, "ctrd-restart");
        let task = container.start(TICKER).await.unwrap_or_else(|e| panic!("{runtime}: {e}"));
        let shim = container.shim_pid().unwrap_or_else(|e| panic!("{runtime}: {e}"));
        subjects.push(Subject { container, init: task.pid, shim });
    }
    // Declared after the containers so that it is dropped first: containerd must answer before
    // their guards clean up.
    let _restart = RestartGuard(&containerd);

    let killed = containerd.kill().await.unwrap_or_else(|e| panic!("{e}"));

    let while_down = futures::future::join_all(subjects.iter().map(|s| async move {
        let outcome: Outcome<&str> = async {
            ensure!(host::process_running(s.init), "init {} died with containerd", s.init);
            ensure!(host::process_running(s.shim), "shim {} died with containerd", s.shim);
            log_grows(&s.container, "while containerd is down").await?;
            Ok("running, output flowing")
        }
        .await;
        (s.container.runtime(), outcome)
    }))
    .await;

    containerd.start().await.unwrap_or_else(|e| panic!("restarting containerd: {e}"));
    let restarted = containerd.pid().unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(restarted, killed, "containerd was not restarted");
    require_same("tasks while containerd is down", while_down);

    let after_restart = futures::future::join_all(subjects.iter().map(|s| async move {
        let outcome: Outcome<_> = async {
            let container = &s.container;
            let task = container.task().await?;
            ensure_eq!(
                task.as_ref().map(|t| (t.pid, t.status.as_str())),
                Some((s.init, "RUNNING")),
                "task after containerd restart"
            );
            ensure_eq!(container.shim_pid()?, s.shim, "shim after containerd restart");
            let output = container.exec("after-restart", &["sh", "-c", "echo exec-works; exit 4"]).await?;
            ensure_eq!(output.stdout, "exec-works\n", "exec stdout after restart");
            ensure_eq!(output.code(), Some(4), "exec exit code after restart");
            log_grows(container, "after containerd restarted").await?;

            // The new containerd still receives the shim's events.
            let events = EventStream::start(container.ctr()).await?;
            container.kill("SIGKILL", false).await?;
            let exit = events.wait_init_exit(container.id(), LONG).await?;
            container.wait_status("STOPPED", SHORT).await?;
            container.delete_task().await?;
            container.delete_container().await?;
            wait_until("the shim to exit after delete", SHORT, || async {
                Ok((!host::process_running(s.shim)).then_some(()))
            })
            .await?;
            ensure!(container.mounts()?.is_empty(), "mounts left: {:?}", container.mounts()?);
            Ok((output.code(), output.stdout, exit.u64_field("exit_status")))
        }
        .await;
        (s.container.runtime(), outcome)
    }))
    .await;
    require_same("tasks after containerd restarted", after_restart);
}
