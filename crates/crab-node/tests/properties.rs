//! Property tests of crabd's frames: any local client of its socket may send anything.

use proptest::prelude::*;

fn config() -> ProptestConfig {
    // CI runs these on two busy cores: enough cases to find a panic, quick to run.
    ProptestConfig { cases: 512, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// crabd reads a frame of at most `max` bytes whatever the length prefix claims, and its
    /// messages decode or fail cleanly.
    #[test]
    fn crabd_frames_are_bounded_and_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..512), max in 0u32..300) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let read = runtime.block_on(crab_node::protocol::read_frame(&mut &buf[..], max));
        if let Ok(body) = read {
            prop_assert!(body.len() <= max as usize);
            let _ = serde_json::from_slice::<crab_node::protocol::Request>(&body);
            let _ = serde_json::from_slice::<crab_node::protocol::Reply>(&body);
        }
    }
}
