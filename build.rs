//! Compiles the inspector's BPF programs and generates their libbpf-rs skeleton, and computes
//! the digest of what a shim and crabd must agree on (`CRAB_WIRE_DIGEST`, see
//! `crab::node::protocol::compat_identity`).

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;
use sha2::{Digest, Sha256};

const BPF_SOURCE: &str = "bpf/inspector.bpf.c";

/// What defines crabd's records and its wire format: the BPF programs and their record layout,
/// the Rust side that decodes the records into effects, and the messages on the socket. A
/// change to any of them makes a crabd of the old build one a shim must not use.
const WIRE_SOURCES: &[&str] = &[
    "bpf/inspector.h",
    "bpf/inspector.bpf.c",
    "src/inspector/record.rs",
    "src/inspector/effect.rs",
    "src/node/protocol.rs",
];

/// SHA-256 over [`WIRE_SOURCES`], first 16 hex digits. Of a Rust file only the code counts:
/// its unit tests (from `#[cfg(test)]` on) and its comment lines do not change what goes on
/// the wire.
fn wire_digest() -> String {
    let mut hasher = Sha256::new();
    for path in WIRE_SOURCES {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        let code = if path.ends_with(".rs") {
            text.lines()
                .take_while(|line| line.trim() != "#[cfg(test)]")
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            text
        };
        hasher.update(path.as_bytes());
        hasher.update([0]);
        hasher.update(code.as_bytes());
        hasher.update([0]);
    }
    hasher.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // bpf_tracing.h needs the kernel's name for the architecture; the
    // syscall numbers come from the multiarch <asm/unistd.h> (linux-libc-dev).
    let (arch, multiarch) = match env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => ("x86", "x86_64-linux-gnu"),
        Ok("aarch64") => ("arm64", "aarch64-linux-gnu"),
        Ok(other) => panic!("no BPF target arch mapping for {other}"),
        Err(_) => panic!("cargo sets CARGO_CFG_TARGET_ARCH"),
    };
    let asm_headers = format!("/usr/include/{multiarch}");
    SkeletonBuilder::new()
        .source(BPF_SOURCE)
        .clang_args(["-I", "bpf", "-I", &asm_headers, "-O2", "-g", &format!("-D__TARGET_ARCH_{arch}")])
        .build_and_generate(out_dir.join("inspector.skel.rs"))
        .expect("building bpf/inspector.bpf.c");
    for input in [BPF_SOURCE, "bpf/inspector.h", "bpf/vmlinux.h"].iter().chain(WIRE_SOURCES) {
        println!("cargo:rerun-if-changed={input}");
    }
    println!("cargo:rustc-env=CRAB_WIRE_DIGEST={}", wire_digest());
}
