//! Task lifecycle through containerd: exit codes, stdio, TTY, execs, signals, pause/resume, ps,
//! metrics, cleanup, events, and a SIGKILLed shim. Each test runs under every runtime of
//! CRAB_TEST_RUNTIMES and requires the same observation from all of them.

use std::time::Duration;

use crab_integration::host::{self, ProcessCgroups};
use crab_integration::{Container, EventStream, Outcome, PtySession, across_runtimes, ensure, ensure_eq, wait_until};

const SHORT: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(30);

/// An init that keeps running until killed with SIGKILL (sh as pid 1 ignores SIGTERM without a trap).
const IDLE: &[&str] = &["sh", "-c", "while :; do sleep 1; done"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_are_the_task_exit_status() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("exit codes", |runtime| async move {
        let mut codes = Vec::new();
        for (script, expected) in [("exit 0", 0), ("exit 3", 3)] {
            let container = Container::new(&runtime, "exit-code");
            let output = container.run_to_exit(&["sh", "-c", script], None).await?;
            ensure_eq!(output.code(), Some(expected), "exit code of `{script}` (stderr: {})", output.stderr.trim());
            codes.push((script.to_string(), output.code()));
        }
        // A signal sent from inside cannot kill pid 1 of a pid namespace, so SIGKILL comes from
        // containerd while `ctr run` waits in the foreground.
        let container = Container::new(&runtime, "exit-signal");
        let (output, ()) = tokio::try_join!(container.run_to_exit(IDLE, None), async {
            container.wait_status("RUNNING", LONG).await?;
            container.kill("SIGKILL", false).await
        })?;
        ensure_eq!(output.code(), Some(137), "exit code after SIGKILL (stderr: {})", output.stderr.trim());
        codes.push(("SIGKILL".to_string(), output.code()));
        Ok(codes)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_and_stderr_stay_separate() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("stdout/stderr separation", |runtime| async move {
        let container = Container::new(&runtime, "stdio");
        let output =
            container.run_to_exit(&["sh", "-c", "echo to-stdout; echo to-stderr >&2; echo more-stdout"], None).await?;
        ensure_eq!(output.code(), Some(0), "exit code");
        ensure_eq!(output.stdout, "to-stdout\nmore-stdout\n", "stdout");
        ensure!(output.stderr.contains("to-stderr"), "stderr lacks the line written to fd 2: {:?}", output.stderr);
        ensure!(!output.stderr.contains("stdout"), "stdout leaked into stderr: {:?}", output.stderr);
        Ok(output.stdout)
    })
    .await;
}

/// An exec's environment is the one runc gives: the spec's variables plus HOME from the
/// container's passwd file (ctr's exec spec has none), under both runtimes alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_environment_has_home_as_under_runc() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("exec environment", |runtime| async move {
        let container = Container::new(&runtime, "exec-env");
        container.start(&["sleep", "100000"]).await?;
        let seen = container.exec_output("env", &["sh", "-c", "echo home=$HOME; echo path=$PATH"]).await;
        container.kill("SIGKILL", true).await?;
        container.wait_status("STOPPED", std::time::Duration::from_secs(10)).await?;
        container.delete_task().await?;
        container.delete_container().await?;
        let seen = seen?;
        ensure!(seen.contains("home=/root\n"), "HOME of a root exec: {seen:?}");
        Ok(seen)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_is_forwarded_and_closed() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("stdin", |runtime| async move {
        let input = b"first line\nsecond line\n";
        let cat = Container::new(&runtime, "stdin-cat");
        let echoed = cat.run_to_exit(&["cat"], Some(input)).await?;
        ensure_eq!(echoed.code(), Some(0), "exit code of cat (stderr: {})", echoed.stderr.trim());
        ensure_eq!(echoed.stdout.as_bytes(), input.as_slice(), "cat output");

        // `wc -c` only prints once stdin reaches EOF, so this also proves the close is propagated.
        let wc = Container::new(&runtime, "stdin-wc");
        let counted = wc.run_to_exit(&["wc", "-c"], Some(input)).await?;
        ensure_eq!(counted.stdout.trim(), input.len().to_string(), "wc -c output");
        Ok((echoed.stdout, counted.stdout.trim().to_string()))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tty_gets_a_terminal_and_follows_resizes() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("tty", |runtime| async move {
        let container = Container::new(&runtime, "tty");
        let mut terminal = PtySession::spawn(container.ctr(), container.run_args(&["--rm", "-t"], &["sh"]), 24, 80)?;
        container.wait_status("RUNNING", LONG).await?;

        let mark = terminal.output_len();
        terminal.send("tty; echo tty-done\n")?;
        let tty = terminal.wait_for_text(mark, "\ntty-done", SHORT).await?;
        ensure!(tty.contains("/dev/pts/0"), "`tty` inside the container printed {tty:?}");

        let mark = terminal.output_len();
        terminal.send("stty size; echo size-done\n")?;
        let initial = terminal.wait_for_text(mark, "\nsize-done", SHORT).await?;
        ensure!(initial.contains("24 80"), "initial `stty size` printed {initial:?}");

        terminal.resize(40, 132)?;
        // ctr forwards the resize asynchronously: poll until the console reports it.
        let shared = &terminal;
        let resized = wait_until("the console to report 40 132", SHORT, || {
            let terminal = shared;
            let mark = terminal.output_len();
            let sent = terminal.send("stty size; echo size-done\n");
            async move {
                sent?;
                let seen = terminal.wait_for_text(mark, "\nsize-done", SHORT).await?;
                Ok(seen.contains("40 132").then_some(seen))
            }
        })
        .await?;

        terminal.send("exit 7\n")?;
        let status = terminal.wait_exit(LONG).await?;
        ensure_eq!(status.code(), Some(7), "ctr's exit code after `exit 7` in the TTY shell");
        Ok(("/dev/pts/0", resized.contains("40 132"), status.code()))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_execs_keep_their_own_io_and_exit_codes() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("concurrent execs", |runtime| async move {
        let container = Container::new(&runtime, "execs");
        container.start(IDLE).await?;
        let runs = (1..=4).map(|n| {
            let container = &container;
            async move {
                let exec_id = format!("exec-{n}");
                let script = format!("sleep 0.{n}; echo out-{n}; echo err-{n} >&2; exit {n}");
                let output = container.exec(&exec_id, &["sh", "-c", &script]).await?;
                let has_stderr = output.stderr.contains(&format!("err-{n}"));
                let code = output.code();
                Outcome::Ok((exec_id, output.stdout, has_stderr, code))
            }
        });
        let results: Vec<_> = futures::future::join_all(runs).await.into_iter().collect::<Outcome<_>>()?;
        for (n, (exec_id, stdout, has_stderr, code)) in (1..=4).zip(&results) {
            ensure_eq!(*stdout, format!("out-{n}\n"), "stdout of {exec_id}");
            ensure!(*has_stderr, "stderr of {exec_id} lacks err-{n}");
            ensure_eq!(*code, Some(n), "exit code of {exec_id}");
        }
        // The init is untouched by its execs.
        ensure_eq!(container.task().await?.map(|t| t.status), Some("RUNNING".to_string()), "init status");
        Ok(results)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_reaches_the_init_trap() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("SIGTERM trap", |runtime| async move {
        let container = Container::new(&runtime, "sigterm");
        let events = EventStream::start(container.ctr()).await?;
        container
            .start(&["sh", "-c", "trap 'echo got-term; exit 42' TERM; echo ready; while :; do sleep 0.1; done"])
            .await?;
        wait_until("the init to install its trap", SHORT, || async {
            Ok(container.read_log().contains("ready").then_some(()))
        })
        .await?;
        container.kill("SIGTERM", false).await?;
        let exit = events.wait_init_exit(container.id(), SHORT).await?;
        ensure_eq!(exit.u64_field("exit_status"), Some(42), "exit status in TaskExit");
        container.wait_status("STOPPED", SHORT).await?;
        ensure!(container.read_log().contains("got-term"), "trap output missing: {:?}", container.read_log());
        container.delete_task().await?;
        Ok(exit.u64_field("exit_status"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_all_reaches_every_process() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("kill --all", |runtime| async move {
        let container = Container::new(&runtime, "killall");
        let events = EventStream::start(container.ctr()).await?;
        container.start(&["sh", "-c", "sleep 1000 & sleep 1000 & wait"]).await?;
        let pids = wait_until("three processes in the container", SHORT, || async {
            let pids = container.pids().await?;
            Ok((pids.len() == 3).then_some(pids))
        })
        .await?;
        container.kill("SIGKILL", true).await?;
        let exit = events.wait_init_exit(container.id(), SHORT).await?;
        ensure_eq!(exit.u64_field("exit_status"), Some(137), "init exit status");
        wait_until("every container process to be gone", SHORT, || async {
            Ok(pids.iter().all(|pid| !host::process_running(*pid)).then_some(()))
        })
        .await?;
        container.delete_task().await?;
        Ok((pids.len(), exit.u64_field("exit_status")))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_freezes_and_resume_thaws() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("pause/resume", |runtime| async move {
        let container = Container::new(&runtime, "pause");
        let events = EventStream::start(container.ctr()).await?;
        container.start(&["sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.05; done"]).await?;
        wait_until("the counter to start", SHORT, || async { Ok((!container.read_log().is_empty()).then_some(())) })
            .await?;
        let cgroups = container.cgroups().await?;

        container.ctr().invoke(["task", "pause", container.id()]).success().await?;
        container.wait_status("PAUSED", SHORT).await?;
        events.wait_for(container.id(), "/tasks/paused", SHORT, |_| true).await?;
        ensure!(cgroups.frozen()?, "the freezer does not report the cgroup frozen");
        let frozen_at = container.read_log().len();
        tokio::time::sleep(Duration::from_millis(600)).await;
        let after_pause = container.read_log().len();
        ensure_eq!(after_pause, frozen_at, "output grew while paused");

        container.ctr().invoke(["task", "resume", container.id()]).success().await?;
        container.wait_status("RUNNING", SHORT).await?;
        events.wait_for(container.id(), "/tasks/resumed", SHORT, |_| true).await?;
        ensure!(!cgroups.frozen()?, "the freezer still reports the cgroup frozen");
        wait_until("the counter to advance after resume", SHORT, || async {
            Ok((container.read_log().len() > after_pause).then_some(()))
        })
        .await?;
        Ok(("PAUSED", "advanced after resume"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ps_lists_the_container_processes() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("task ps", |runtime| async move {
        let container = Container::new(&runtime, "ps");
        let init = container.start(&["sh", "-c", "sleep 1000 & sleep 1001 & wait"]).await?;
        let pids = wait_until("three processes in the container", SHORT, || async {
            let pids = container.pids().await?;
            Ok((pids.len() == 3).then_some(pids))
        })
        .await?;
        ensure!(pids.contains(&init.pid), "ps {pids:?} lacks the init pid {}", init.pid);
        let mut commands: Vec<String> = pids.iter().map(|pid| host::cmdline(*pid).join(" ")).collect();
        commands.sort();
        ensure_eq!(
            commands,
            vec!["sh -c sleep 1000 & sleep 1001 & wait", "sleep 1000", "sleep 1001"],
            "command lines of the listed pids"
        );
        Ok(commands)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_memory_cpu_and_pids() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("task metrics", |runtime| async move {
        let container = Container::new(&runtime, "metrics");
        container.start(&["sh", "-c", "sleep 1000 & i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; wait"]).await?;
        let metrics = wait_until("metrics showing two pids and used CPU", LONG, || async {
            let output =
                container.ctr().invoke(["task", "metrics", "--format", "json", container.id()]).success().await?;
            let metrics: serde_json::Value = serde_json::from_str(&output.stdout).map_err(|e| {
                crab_integration::HarnessError::Parse { what: "ctr task metrics".into(), detail: e.to_string() }
            })?;
            let ready = metrics.pointer("/pids/current").and_then(|v| v.as_u64()) == Some(2) && cpu_usage(&metrics) > 0;
            Ok(ready.then_some(metrics))
        })
        .await?;
        let memory = memory_usage(&metrics);
        ensure!(memory > 0, "memory usage is 0 in {metrics}");
        Ok((metrics.pointer("/pids/current").cloned(), memory > 0, cpu_usage(&metrics) > 0))
    })
    .await;
}

/// CPU time in the v1 (`cpu.usage.total`) or v2 (`cpu.usage_usec`) metrics layout.
fn cpu_usage(metrics: &serde_json::Value) -> u64 {
    ["/cpu/usage/total", "/cpu/usage_usec"].iter().find_map(|p| metrics.pointer(p)?.as_u64()).unwrap_or(0)
}

/// Memory use in the v1 (`memory.usage.usage`) or v2 (`memory.usage`) metrics layout.
fn memory_usage(metrics: &serde_json::Value) -> u64 {
    ["/memory/usage/usage", "/memory/usage"].iter().find_map(|p| metrics.pointer(p)?.as_u64()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_leaves_no_mounts_cgroups_or_processes() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("delete cleanup", |runtime| async move {
        let container = Container::new(&runtime, "cleanup");
        let init = container.start(&["sh", "-c", "sleep 1000 & wait"]).await?;
        let shim = container.shim_pid()?;
        let pids = wait_until("two processes in the container", SHORT, || async {
            let pids = container.pids().await?;
            Ok((pids.len() == 2).then_some(pids))
        })
        .await?;
        let cgroup_dirs = ProcessCgroups::of_pid(init.pid)?.existing_dirs();
        ensure!(
            cgroup_dirs.iter().any(|d| d.display().to_string().contains(container.id())),
            "no cgroup of the container is named after it: {cgroup_dirs:?}"
        );
        ensure!(!container.mounts()?.is_empty(), "the container's rootfs is not mounted");

        container.kill("SIGKILL", false).await?;
        container.wait_status("STOPPED", SHORT).await?;
        container.delete_task().await?;
        container.delete_container().await?;

        wait_until("container processes and the shim to exit", SHORT, || async {
            Ok(pids.iter().chain([&shim]).all(|pid| !host::process_running(*pid)).then_some(()))
        })
        .await?;
        let left_dirs: Vec<_> =
            cgroup_dirs.iter().filter(|d| d.display().to_string().contains(container.id()) && d.exists()).collect();
        ensure!(left_dirs.is_empty(), "cgroups left behind: {left_dirs:?}");
        let left_mounts = container.mounts()?;
        ensure!(left_mounts.is_empty(), "mounts left behind: {left_mounts:?}");
        let snapshots = container.ctr().invoke(["snapshot", "ls"]).success().await?;
        ensure!(
            !snapshots.stdout.lines().any(|l| l.split_whitespace().next() == Some(container.id())),
            "snapshot left behind: {}",
            snapshots.stdout
        );
        ensure_eq!(container.task().await?, None, "task after delete");
        Ok("clean")
    })
    .await;
}

/// Task and container events about one container, reduced to what must match between runtimes:
/// topic, which process (init or exec id) and exit status.
fn lifecycle_trace(events: &EventStream, id: &str) -> Vec<(String, String, Option<u64>)> {
    events
        .for_container(id)
        .into_iter()
        .filter(|e| e.topic.starts_with("/tasks/") || e.topic.starts_with("/containers/"))
        .map(|e| {
            let process = e.str_field("exec_id").or_else(|| e.str_field("id")).unwrap_or(id);
            let process = if process == id { "init" } else { process };
            (e.topic.clone(), process.to_string(), e.u64_field("exit_status"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_containerds_order() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("event sequence", |runtime| async move {
        let container = Container::new(&runtime, "events");
        let events = EventStream::start(container.ctr()).await?;
        container.start(IDLE).await?;
        let output = container.exec("probe", &["sh", "-c", "exit 5"]).await?;
        ensure_eq!(output.code(), Some(5), "exec exit code");
        container.kill("SIGKILL", false).await?;
        events.wait_init_exit(container.id(), SHORT).await?;
        container.delete_task().await?;
        container.delete_container().await?;
        events.wait_for(container.id(), "/containers/delete", SHORT, |_| true).await?;

        let trace = lifecycle_trace(&events, container.id());
        let expected: Vec<(String, String, Option<u64>)> = [
            ("/containers/create", "init", None),
            ("/tasks/create", "init", None),
            ("/tasks/start", "init", None),
            ("/tasks/exec-added", "probe", None),
            ("/tasks/exec-started", "probe", None),
            ("/tasks/exit", "probe", Some(5)),
            ("/tasks/exit", "init", Some(137)),
            ("/tasks/delete", "init", Some(137)),
            ("/containers/delete", "init", None),
        ]
        .into_iter()
        .map(|(t, p, s)| (t.to_string(), p.to_string(), s))
        .collect();
        ensure_eq!(trace, expected, "event sequence");
        Ok(trace)
    })
    .await;
}

/// An exec that outgrows the container's memory limit is OOM-killed: /tasks/oom, then its exit
/// with 137, and the container goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_kill_is_reported_once() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("OOM kill", |runtime| async move {
        let container = Container::new(&runtime, "oom");
        let events = EventStream::start(container.ctr()).await?;
        container.start_with(&["--memory-limit", "33554432"], IDLE).await?;
        // A 100 MB shell variable in a 32 MiB cgroup (this host has no swap).
        let output = container.exec("hog", &["sh", "-c", "big=$(printf '%100000000s' x); echo ${#big}"]).await?;
        ensure_eq!(output.code(), Some(137), "the hog's exit code");
        events.wait_for(container.id(), "/tasks/oom", LONG, |_| true).await?;
        // Notifications that arrive later than this are not part of the kill.
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The kernel may take the container's init as one more victim of the same OOM: its exit,
        // 137, came 5 ms after the hog's in about 1 run of 20 to 40 under runc. Whether the
        // container outlives its hog is the kernel's choice, not the shim's; the OOM and the
        // exits are reported either way.
        let init_exit = |events: &EventStream| {
            events
                .for_container(container.id())
                .into_iter()
                .find(|e| e.topic == "/tasks/exit" && e.str_field("id") == Some(container.id()))
                .map(|e| e.payload["exit_status"].as_u64())
        };
        let killed_with_the_hog = init_exit(&events);
        let alive = match killed_with_the_hog {
            None => Some(container.exec_ok("alive", &["true"]).await),
            Some(status) => {
                ensure_eq!(status, Some(137), "the init's exit status, when it exited with the hog");
                eprintln!("{}: the OOM killer took the init as well", container.id());
                None
            }
        };
        if killed_with_the_hog.is_none() {
            container.kill("SIGKILL", false).await?;
        }
        events.wait_init_exit(container.id(), SHORT).await?;
        container.delete_task().await?;
        container.delete_container().await?;
        alive.transpose()?;
        let topics: Vec<String> = events
            .for_container(container.id())
            .into_iter()
            .map(|e| e.topic)
            .filter(|t| t == "/tasks/oom" || t == "/tasks/exit")
            .collect();
        // The runc shim reports every notification of the kill (one to a dozen, as timing has
        // it), before or after the victim's exit; crab reports the kill once, as it happens.
        if runtime.name() == crab_integration::env::CRAB_RUNTIME {
            ensure_eq!(topics.iter().filter(|t| *t == "/tasks/oom").count(), 1, "OOM events of one kill: {topics:?}");
        }
        Ok((output.code(), "oom reported"))
    })
    .await;
}

/// `binary://` stdio: the shim starts the logging program with stdout on fd 3, stderr on fd 4
/// and a pipe on fd 5 that it closes when ready, passing the URI's query as arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_log_uri_gets_stdout_and_stderr() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("binary:// logger", |runtime| async move {
        let container = Container::new(&runtime, "binlog");
        let dir = std::env::temp_dir().join(format!("crab-binlog-{}", container.id()));
        std::fs::create_dir_all(&dir).map_err(|e| crab_integration::HarnessError::io("creating the logger dir", e))?;
        let logger = dir.join("logger");
        let script = "#!/bin/sh\n# containerd's logging protocol: $1 $2 are the query's key and value.\nexec 5>&-\ncat <&3 > \"$2.out\" &\ncat <&4 > \"$2.err\"\nwait\n";
        std::fs::write(&logger, script).map_err(|e| crab_integration::HarnessError::io("writing the logger", e))?;
        std::fs::set_permissions(&logger, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| crab_integration::HarnessError::io("chmod the logger", e))?;
        let base = dir.join("log");
        let uri = format!("binary://{}?file={}", logger.display(), base.display());
        container
            .ctr()
            .invoke(container.run_args(&["-d", "--log-uri", &uri], &["sh", "-c", "echo to-out; echo to-err >&2"]))
            .success()
            .await?;
        container.wait_status("STOPPED", LONG).await?;
        let read = |suffix: &str| std::fs::read_to_string(dir.join(format!("log.{suffix}"))).unwrap_or_default();
        let logged = wait_until("the logger to write both streams", SHORT, || async {
            let (out, err) = (read("out"), read("err"));
            Ok((out.ends_with('\n') && err.ends_with('\n')).then_some((out, err)))
        })
        .await;
        container.delete_task().await?;
        container.delete_container().await?;
        let _ = std::fs::remove_dir_all(&dir);
        let (out, err) = logged?;
        ensure_eq!(out, "to-out\n", "stdout through the logger");
        ensure_eq!(err, "to-err\n", "stderr through the logger");
        Ok((out, err))
    })
    .await;
}

/// Containers of one pod (the CRI's `io.kubernetes.cri.sandbox-id` annotation) share one shim:
/// the second is served by the first one's shim, outlives the first's delete, and the shim
/// exits with the last container of its pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_of_one_pod_share_a_shim() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("pod grouping", |runtime| async move {
        let first = Container::new(&runtime, "pod-first");
        let second = Container::new(&runtime, "pod-second");
        let pod = format!("io.kubernetes.cri.sandbox-id={}", first.id());
        first.start_with(&["--annotation", &pod], IDLE).await?;
        second.start_with(&["--annotation", &pod], IDLE).await?;
        let shim = first.shim_pid()?;
        let own = host::shim_daemons(second.ctr().namespace(), second.id());
        ensure!(own.is_empty(), "the pod's second container has a shim of its own: {own:?}");
        ensure_eq!(second.exec_output("second", &["echo", "two"]).await?, "two\n", "exec in the second container");

        first.kill("SIGKILL", false).await?;
        first.wait_status("STOPPED", SHORT).await?;
        first.delete_task().await?;
        first.delete_container().await?;
        ensure!(host::process_running(shim), "the pod's shim exited while a container of the pod runs");
        ensure_eq!(second.exec_output("after", &["echo", "still"]).await?, "still\n", "exec after the first's delete");

        second.kill("SIGKILL", false).await?;
        second.wait_status("STOPPED", SHORT).await?;
        second.delete_task().await?;
        second.delete_container().await?;
        wait_until("the pod's shim to exit", LONG, || async { Ok((!host::process_running(shim)).then_some(())) })
            .await?;
        Ok("one shim per pod")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_shim_is_cleaned_up_and_reported() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("shim SIGKILL", |runtime| async move {
        let container = Container::new(&runtime, "shimkill");
        let events = EventStream::start(container.ctr()).await?;
        let init = container.start(IDLE).await?;
        let shim = container.shim_pid()?;
        let cgroup_dirs = ProcessCgroups::of_pid(init.pid)?.existing_dirs();

        nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim as i32), nix::sys::signal::Signal::SIGKILL)
            .map_err(|e| crab_integration::HarnessError::io("killing the shim", e.into()))?;

        let exit = events.wait_init_exit(container.id(), LONG).await?;
        let delete = events.wait_for(container.id(), "/tasks/delete", LONG, |_| true).await?;
        // containerd cleans up after the dead shim: the task is gone (or at least not running).
        let task = wait_until("the task to stop being listed as running", LONG, || async {
            let task = container.task().await?;
            Ok((task.as_ref().map(|t| t.status.as_str()) != Some("RUNNING")).then_some(task))
        })
        .await?;
        wait_until("the init to be gone", SHORT, || async { Ok((!host::process_running(init.pid)).then_some(())) })
            .await?;
        ensure!(container.mounts()?.is_empty(), "rootfs still mounted: {:?}", container.mounts()?);
        let left_dirs: Vec<_> =
            cgroup_dirs.iter().filter(|d| d.display().to_string().contains(container.id()) && d.exists()).collect();
        ensure!(left_dirs.is_empty(), "cgroups left behind: {left_dirs:?}");
        container.delete_container().await?;
        // Events arrive through `ctr events` after the call returns: the trace is complete once
        // the last one is in.
        events.wait_for(container.id(), "/containers/delete", SHORT, |_| true).await?;
        Ok((
            exit.u64_field("exit_status"),
            delete.u64_field("exit_status"),
            task.map(|t| t.status),
            lifecycle_trace(&events, container.id()).into_iter().map(|(topic, _, _)| topic).collect::<Vec<_>>(),
        ))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_changes_the_memory_limit_in_the_cgroup() {
    crab_sys::skip_unless_root!("containerd, runc and CRIU");
    across_runtimes("update memory limit", |runtime| async move {
        const LIMIT: u64 = 64 * 1024 * 1024;
        let container = Container::new(&runtime, "update");
        container.start(IDLE).await?;
        let cgroups = container.cgroups().await?;
        let before = cgroups.memory_limit()?;
        ensure!(before > LIMIT, "memory limit {before} is already at or below {LIMIT}");
        crab_integration::api::update_task_resources(
            container.ctr(),
            container.id(),
            &serde_json::json!({ "memory": { "limit": LIMIT } }),
        )
        .await?;
        let after = cgroups.memory_limit()?;
        ensure_eq!(after, LIMIT, "memory limit in the cgroup after update");
        let metrics = container.ctr().invoke(["task", "metrics", "--format", "json", container.id()]).success().await?;
        ensure!(metrics.stdout.contains(&LIMIT.to_string()), "metrics do not show the new limit: {}", metrics.stdout);
        Ok(after)
    })
    .await;
}
