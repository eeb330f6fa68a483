//! Compiles the inspector's BPF programs and generates their libbpf-rs skeleton.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const BPF_SOURCE: &str = "bpf/inspector.bpf.c";

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = match env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86",
        Ok("aarch64") => "arm64",
        Ok(other) => panic!("no BPF target arch mapping for {other}"),
        Err(_) => panic!("cargo sets CARGO_CFG_TARGET_ARCH"),
    };
    SkeletonBuilder::new()
        .source(BPF_SOURCE)
        .clang_args(["-I", "bpf", "-O2", "-g", &format!("-D__TARGET_ARCH_{arch}")])
        .build_and_generate(out_dir.join("inspector.skel.rs"))
        .expect("building bpf/inspector.bpf.c");
    for input in [BPF_SOURCE, "bpf/inspector.h", "bpf/vmlinux.h"] {
        println!("cargo:rerun-if-changed={input}");
    }
}
