//! Attaches an empty BPF program to every hook the inspector attaches on this
//! kernel (`crab_inspector::floor`), prints how many, and holds them until it
//! is killed: the `floor` phase of `scripts/bench-inspector-tax`, what a
//! process pays for those hooks with no work behind them. The kernel detaches
//! the links when the process exits.
use std::mem::MaybeUninit;

fn main() {
    let mut storage = MaybeUninit::uninit();
    let floor = match crab_inspector::floor::Floor::attach(&mut storage) {
        Ok(floor) => floor,
        Err(error) => {
            eprintln!("tracepoint_floor: {error}");
            std::process::exit(1);
        }
    };
    println!("attached {} empty programs", floor.links());
    loop {
        std::thread::park();
    }
}
