//! Compiles the inspector's BPF programs and generates their libbpf-rs skeleton, and computes
//! the digest of the inspector's part of what a shim and crabd must agree on
//! (`CRAB_RECORD_DIGEST`, exported as `crab_inspector::RECORD_DIGEST`; crab-node adds the digest
//! of its own messages in `crab_node::protocol::compat_identity`).

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const BPF_SOURCE: &str = "bpf/inspector.bpf.c";
const MECHANISM_SOURCE: &str = "bpf/mechanism.bpf.c";
const FLOOR_SOURCE: &str = "bpf/floor.bpf.c";

/// What defines crabd's records and the effects it sends: the BPF programs and their record
/// layout, the Rust side that decodes the records into effects, and how effects' paths go on
/// the wire. A change to any of them makes a crabd of the old build one a shim must not use.
const WIRE_SOURCES: &[&str] =
    &["bpf/inspector.h", "bpf/inspector.bpf.c", "src/record.rs", "src/effect.rs", "src/wire_path.rs"];

include!("src/source_digest.rs");

/// [`source_digest`] of [`WIRE_SOURCES`] as they are on disk.
fn wire_digest() -> String {
    let texts: Vec<(&str, String)> = WIRE_SOURCES
        .iter()
        .map(|path| (*path, std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))))
        .collect();
    let files: Vec<(&str, &str)> = texts.iter().map(|(path, text)| (*path, text.as_str())).collect();
    source_digest(&files)
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
    let target_arch = format!("-D__TARGET_ARCH_{arch}");
    let skeleton = |source: &str, skel: &str| {
        SkeletonBuilder::new()
            .source(source)
            .clang_args(["-I", "bpf", "-I", &asm_headers, "-O2", "-g", &target_arch])
            .build_and_generate(out_dir.join(skel))
            .unwrap_or_else(|e| panic!("building {source}: {e}"));
    };
    skeleton(BPF_SOURCE, "inspector.skel.rs");
    // Hook designs reduced to their cost for unwatched processes, for a benchmark only
    // (tests/inspector.rs includes its skeleton; the crate does not).
    skeleton(MECHANISM_SOURCE, "mechanism.skel.rs");
    // Empty programs on the inspector's hooks, for the node benchmark's floor (src/floor.rs).
    skeleton(FLOOR_SOURCE, "floor.skel.rs");
    for input in
        [BPF_SOURCE, MECHANISM_SOURCE, FLOOR_SOURCE, "bpf/inspector.h", "bpf/vmlinux.h"].iter().chain(WIRE_SOURCES)
    {
        println!("cargo:rerun-if-changed={input}");
    }
    println!("cargo:rustc-env=CRAB_RECORD_DIGEST={}", wire_digest());
}
