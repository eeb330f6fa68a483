//! What differs between the two OCI runtimes crab drives, runc and crun, in one place.
//!
//! Both take the same global flags (`--root`, `--log`, `--log-format json`,
//! `--systemd-cgroup`), the same verbs and most of the same verb flags, and both
//! log JSON lines with `level` and `msg`. The differences crab meets:
//!
//! - The CRIU config file: runc hands CRIU the file the spec's `org.criu.config`
//!   annotation names; crun ignores the annotation. crun talks to CRIU through
//!   libcriu, whose `criu swrk` reads the file `CRIU_CONFIG_FILE` names (CRIU
//!   parses it before the RPC options, and crun sets none of what crab's file
//!   holds: ghost limit, action script, network lock), so crun runs with that
//!   variable set to the annotation's file.
//! - `checkpoint --empty-ns`: crun has no such flag (it makes a network
//!   namespace given by path external itself, as runc does); asking for it is
//!   refused with the flag's name rather than dropped.
//! - `restore --no-pivot`: crun's restore has no such flag (CRIU mounts the
//!   restored root itself); it is left out.
//! - A container that does not exist: runc says "container does not exist", crun
//!   fails to open the container's state (`<root>/<id>/status` or the directory):
//!   both become [`RuntimeError::NoContainer`](crate::RuntimeError::NoContainer),
//!   so the shim treats them, and answers containerd, the same way.
//! - Work and image paths: both write CRIU's `dump.log`/`restore.log` into the
//!   work path, else the image path, and both keep crun's and runc's own state
//!   under `--root`. runc creates a missing work path; crun fails ("error
//!   opening CRIU work directory"), so crab creates it first for crun.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::{CheckpointOptions, LaunchOptions};

/// Environment variable `criu swrk` reads a config file from (CRIU's config.c).
pub const CRIU_CONFIG_ENV: &str = "CRIU_CONFIG_FILE";

/// Which OCI runtime's command line a binary speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Runc,
    Crun,
}

/// A flag crab was asked to pass that this runtime does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{runtime} {verb} has no {flag} (asked for {value:?})")]
pub struct Unsupported {
    pub runtime: &'static str,
    pub verb: &'static str,
    pub flag: &'static str,
    pub value: String,
}

impl Dialect {
    /// By the binary's file name: `crun` (or a name starting with it, `crun-1.21`) is crun;
    /// anything else is taken for runc, the reference dialect.
    pub fn of(binary: &Path) -> Dialect {
        let name = binary.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.starts_with("crun") { Dialect::Crun } else { Dialect::Runc }
    }

    /// Whether `pause` returns only once the freezer reads frozen. runc's does (it writes
    /// FROZEN again until `freezer.state` reads it); crun 1.21's writes FROZEN once and
    /// returns, and a v1 freezer under load may still read FREEZING then, so the caller
    /// waits ([`crate::freezer::wait_frozen`]): containerd's Pause promises a frozen task.
    pub fn pause_returns_frozen(self) -> bool {
        matches!(self, Dialect::Runc)
    }

    pub fn name(self) -> &'static str {
        match self {
            Dialect::Runc => "runc",
            Dialect::Crun => "crun",
        }
    }

    /// `checkpoint` arguments after the verb, the container id last.
    pub fn checkpoint_args(self, id: &str, opts: &CheckpointOptions) -> Result<Vec<OsString>, Unsupported> {
        let mut args: Vec<OsString> = vec!["checkpoint".into(), "--image-path".into(), opts.image_path.clone().into()];
        if let Some(work) = &opts.work_path {
            args.push("--work-path".into());
            args.push(work.into());
        }
        if let Some(parent) = &opts.parent_path {
            args.push("--parent-path".into());
            args.push(parent.into());
        }
        self.push_criu_flags(&mut args, opts, "checkpoint")?;
        if opts.leave_running {
            args.push("--leave-running".into());
        }
        args.push(id.into());
        Ok(args)
    }

    /// `restore` arguments (detached), the container id last.
    pub fn restore_args(
        self,
        id: &str,
        bundle: &Path,
        opts: &CheckpointOptions,
        launch: &LaunchOptions<'_>,
    ) -> Result<Vec<OsString>, Unsupported> {
        let mut args: Vec<OsString> = vec![
            "restore".into(),
            "--detach".into(),
            "--bundle".into(),
            bundle.into(),
            "--image-path".into(),
            opts.image_path.clone().into(),
        ];
        if let Some(work) = &opts.work_path {
            args.push("--work-path".into());
            args.push(work.into());
        }
        self.push_criu_flags(&mut args, opts, "restore")?;
        args.push("--pid-file".into());
        args.push(launch.pid_file.into());
        if let Some(socket) = launch.console_socket {
            args.push("--console-socket".into());
            args.push(socket.into());
        }
        if launch.no_pivot && self == Dialect::Runc {
            args.push("--no-pivot".into());
        }
        args.push(id.into());
        Ok(args)
    }

    fn push_criu_flags(
        self,
        args: &mut Vec<OsString>,
        opts: &CheckpointOptions,
        verb: &'static str,
    ) -> Result<(), Unsupported> {
        if opts.tcp_established {
            args.push("--tcp-established".into());
        }
        if opts.ext_unix_sockets {
            args.push("--ext-unix-sk".into());
        }
        if opts.shell_job {
            args.push("--shell-job".into());
        }
        if opts.file_locks {
            args.push("--file-locks".into());
        }
        if let (Dialect::Crun, Some(ns)) = (self, opts.empty_namespaces.first()) {
            return Err(Unsupported { runtime: "crun", verb, flag: "--empty-ns", value: ns.clone() });
        }
        for ns in &opts.empty_namespaces {
            args.push("--empty-ns".into());
            args.push(ns.into());
        }
        if let Some(mode) = &opts.manage_cgroups_mode {
            args.push("--manage-cgroups-mode".into());
            args.push(mode.into());
        }
        Ok(())
    }

    /// Directories that must exist before `checkpoint` or `restore` runs: the work path for
    /// crun, which opens it without creating it (runc makes it itself).
    pub fn dirs_to_create(self, opts: &CheckpointOptions) -> Vec<&Path> {
        match self {
            Dialect::Runc => Vec::new(),
            Dialect::Crun => opts.work_path.as_deref().into_iter().collect(),
        }
    }

    /// The environment a checkpoint or restore runs with: for crun, the CRIU config file the
    /// spec at `spec` names (runc reads the annotation itself). An unreadable spec or one
    /// without the annotation adds nothing.
    pub fn criu_env(self, spec: &Path) -> Option<(&'static str, PathBuf)> {
        if self == Dialect::Runc {
            return None;
        }
        let bytes = std::fs::read(spec).ok()?;
        let spec: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        let file = spec.get("annotations")?.get(crate::criu::CONFIG_ANNOTATION)?.as_str()?;
        (!file.is_empty()).then(|| (CRIU_CONFIG_ENV, PathBuf::from(file)))
    }

    /// Where the runtime keeps its copy of a created container's spec under `root`:
    /// what a checkpoint's CRIU config is read from (crun copies the bundle's spec there
    /// at create; runc keeps none, and needs none).
    pub fn state_spec(self, root: &Path, id: &str) -> Option<PathBuf> {
        match self {
            Dialect::Runc => None,
            Dialect::Crun => Some(root.join(id).join("config.json")),
        }
    }

    /// Whether a failed verb's message says the container does not exist.
    pub fn says_no_container(self, root: &Path, id: &str, message: &str) -> bool {
        match self {
            // runc 1.1: "container does not exist"; older wordings say "not found".
            Dialect::Runc => message.contains("does not exist") || message.contains("not found"),
            Dialect::Crun => {
                let dir = root.join(id);
                let status = dir.join("status");
                message.ends_with("No such file or directory")
                    && (message.contains(&format!("`{}`", dir.display()))
                        || message.contains(&format!("`{}`", status.display())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ProcessStdio;

    fn strings(args: &[OsString]) -> Vec<String> {
        args.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    fn opts() -> CheckpointOptions {
        CheckpointOptions {
            image_path: "/img".into(),
            work_path: Some("/work".into()),
            leave_running: true,
            tcp_established: true,
            ext_unix_sockets: true,
            file_locks: true,
            manage_cgroups_mode: Some("soft".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_dialect_follows_the_binary_name() {
        assert_eq!(Dialect::of(Path::new("runc")), Dialect::Runc);
        assert_eq!(Dialect::of(Path::new("/usr/sbin/runc")), Dialect::Runc);
        assert_eq!(Dialect::of(Path::new("crun")), Dialect::Crun);
        assert_eq!(Dialect::of(Path::new("/usr/local/bin/crun")), Dialect::Crun);
        assert_eq!(Dialect::of(Path::new("/opt/crun-1.21")), Dialect::Crun);
        assert_eq!(Dialect::of(Path::new("/tmp/fake-runtime.sh")), Dialect::Runc);
    }

    #[test]
    fn only_cruns_pause_is_waited_on_to_freeze() {
        assert!(Dialect::Runc.pause_returns_frozen());
        assert!(!Dialect::Crun.pause_returns_frozen());
    }

    #[test]
    fn checkpoint_flags_are_the_same_in_both() {
        let runc = strings(&Dialect::Runc.checkpoint_args("c1", &opts()).unwrap());
        let crun = strings(&Dialect::Crun.checkpoint_args("c1", &opts()).unwrap());
        assert_eq!(runc, crun);
        assert_eq!(
            runc,
            [
                "checkpoint",
                "--image-path",
                "/img",
                "--work-path",
                "/work",
                "--tcp-established",
                "--ext-unix-sk",
                "--file-locks",
                "--manage-cgroups-mode",
                "soft",
                "--leave-running",
                "c1"
            ]
        );
    }

    #[test]
    fn crun_refuses_empty_namespaces_by_name() {
        let o = CheckpointOptions { empty_namespaces: vec!["network".into()], ..opts() };
        let runc = strings(&Dialect::Runc.checkpoint_args("c1", &o).unwrap());
        assert!(runc.windows(2).any(|w| w == ["--empty-ns", "network"]), "{runc:?}");
        let err = Dialect::Crun.checkpoint_args("c1", &o).unwrap_err();
        assert_eq!(err.to_string(), "crun checkpoint has no --empty-ns (asked for \"network\")");
        let launch = LaunchOptions {
            pid_file: Path::new("/p"),
            console_socket: None,
            no_pivot: false,
            no_new_keyring: false,
            stdio: ProcessStdio::default(),
        };
        assert!(Dialect::Crun.restore_args("c1", Path::new("/b"), &o, &launch).is_err());
    }

    #[test]
    fn crun_restores_without_no_pivot() {
        let launch = LaunchOptions {
            pid_file: Path::new("/p"),
            console_socket: None,
            no_pivot: true,
            no_new_keyring: false,
            stdio: ProcessStdio::default(),
        };
        let runc = strings(&Dialect::Runc.restore_args("c1", Path::new("/b"), &opts(), &launch).unwrap());
        let crun = strings(&Dialect::Crun.restore_args("c1", Path::new("/b"), &opts(), &launch).unwrap());
        assert!(runc.contains(&"--no-pivot".to_string()), "{runc:?}");
        assert!(!crun.contains(&"--no-pivot".to_string()), "{crun:?}");
        let without: Vec<String> = runc.into_iter().filter(|a| a != "--no-pivot").collect();
        assert_eq!(without, crun, "nothing else differs");
        assert_eq!(&crun[..6], ["restore", "--detach", "--bundle", "/b", "--image-path", "/img"]);
        assert_eq!(crun.last().map(String::as_str), Some("c1"));
    }

    #[test]
    fn crun_gets_its_work_path_created_first() {
        assert_eq!(Dialect::Crun.dirs_to_create(&opts()), [Path::new("/work")]);
        assert!(Dialect::Runc.dirs_to_create(&opts()).is_empty(), "runc creates it itself");
        let without = CheckpointOptions { work_path: None, ..opts() };
        assert!(Dialect::Crun.dirs_to_create(&without).is_empty(), "the image path is the caller's");
    }

    #[test]
    fn crun_gets_the_annotations_criu_config_through_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let spec = dir.path().join("config.json");
        std::fs::write(&spec, r#"{"annotations":{"org.criu.config":"/run/x/criu.conf"}}"#).unwrap();
        assert_eq!(Dialect::Runc.criu_env(&spec), None, "runc reads the annotation itself");
        assert_eq!(Dialect::Crun.criu_env(&spec), Some(("CRIU_CONFIG_FILE", PathBuf::from("/run/x/criu.conf"))));
        std::fs::write(&spec, r#"{"annotations":{"a":"b"}}"#).unwrap();
        assert_eq!(Dialect::Crun.criu_env(&spec), None);
        assert_eq!(Dialect::Crun.criu_env(&dir.path().join("missing.json")), None);
        assert_eq!(Dialect::Crun.state_spec(Path::new("/r"), "c1"), Some(PathBuf::from("/r/c1/config.json")));
        assert_eq!(Dialect::Runc.state_spec(Path::new("/r"), "c1"), None);
    }

    #[test]
    fn a_missing_container_is_recognised_in_either_wording() {
        let root = Path::new("/run/crab/runc/ns");
        // Verbatim from runc 1.1.5 and crun 1.21.
        assert!(Dialect::Runc.says_no_container(root, "c1", "container does not exist"));
        assert!(Dialect::Crun.says_no_container(
            root,
            "c1",
            "error opening file `/run/crab/runc/ns/c1/status`: No such file or directory"
        ));
        assert!(Dialect::Crun.says_no_container(
            root,
            "c1",
            "cannot open directory `/run/crab/runc/ns/c1`: No such file or directory"
        ));
        // A missing file that is not the container's state is another failure.
        assert!(!Dialect::Crun.says_no_container(
            root,
            "c1",
            "error opening file `/bundle/config.json`: No such file or directory"
        ));
        assert!(!Dialect::Crun.says_no_container(root, "c1", "the container `c1` is not running"));
        assert!(!Dialect::Runc.says_no_container(root, "c1", "container not running"));
    }
}
