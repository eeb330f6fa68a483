//! Compiles the inspector's BPF programs and generates their libbpf-rs skeleton.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const BPF_SOURCE: &str = "bpf/inspector.bpf.c";

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
        .clang_args([
            "-I",
            "bpf",
            "-I",
            &asm_headers,
            "-O2",
            "-g",
            &format!("-D__TARGET_ARCH_{arch}"),
        ])
        .build_and_generate(out_dir.join("inspector.skel.rs"))
        .expect("building bpf/inspector.bpf.c");
    for input in [BPF_SOURCE, "bpf/inspector.h", "bpf/vmlinux.h"] {
        println!("cargo:rerun-if-changed={input}");
    }
}
