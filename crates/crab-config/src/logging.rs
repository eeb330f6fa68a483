//! Logging of the command-line binaries (`crabctl`, `crabd`): `tracing` to
//! stderr, level from RUST_LOG (default info), colour only on a terminal. The
//! shim logs to containerd's log fifo instead (`shim::bootstrap`).

use std::io::IsTerminal;

pub fn init_stderr() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
