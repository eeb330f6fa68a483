//! `containerd-shim-crab-v2`: containerd selects it for runtime `io.containerd.crab.v2`.

fn main() {
    crab_shim::bootstrap::main("io.containerd.crab.v2")
}
