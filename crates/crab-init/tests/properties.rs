//! Property tests of the spawner's frames: bytes a process inside the container writes.
//! Any input gives a value or a clear error, never a panic or an unbounded allocation.

use proptest::prelude::*;

use crab_init::protocol::{self as spawner, Message, Request, SpawnRequest};

fn config() -> ProptestConfig {
    // CI runs these on two busy cores: enough cases to find a panic, quick to run.
    ProptestConfig { cases: 512, ..ProptestConfig::default() }
}

fn spawn_request() -> impl Strategy<Value = Request> {
    (any::<String>(), proptest::collection::vec(any::<String>(), 0..4), any::<u32>(), any::<bool>()).prop_map(
        |(exec_id, args, uid, stdin)| {
            Request::Spawn(SpawnRequest {
                exec_id,
                args,
                env: vec![],
                cwd: "/".into(),
                uid,
                gid: uid,
                additional_gids: vec![],
                umask: None,
                terminal: false,
                console_size: None,
                stdin,
                stdout: true,
                stderr: false,
            })
        },
    )
}

proptest! {
    #![proptest_config(config())]

    /// Any bytes: a frame is found only whole and within the buffer, and decoding it yields a
    /// message or an error.
    #[test]
    fn spawner_frames_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(Some((payload, used))) = spawner::split_frame(&buf) {
            prop_assert_eq!(used, spawner::LENGTH_BYTES + payload.len());
            prop_assert!(used <= buf.len());
            let _ = spawner::decode::<Message>(payload);
            let _ = spawner::decode::<Request>(payload);
        }
    }

    /// A stream of requests cut at any point is read back whole and in order once complete,
    /// and never earlier.
    #[test]
    fn spawner_stream_reassembles_at_any_cut(requests in proptest::collection::vec(spawn_request(), 1..5), cut in any::<prop::sample::Index>()) {
        let stream: Vec<u8> = requests.iter().flat_map(spawner::encode).collect();
        let cut = cut.index(stream.len() + 1);
        let mut decoded = Vec::new();
        let mut buf = stream[..cut].to_vec();
        for part in [&stream[cut..], &[][..]] {
            while let Some((payload, used)) = spawner::split_frame(&buf).expect("frames within bounds") {
                decoded.push(spawner::decode::<Request>(payload).expect("a frame we encoded"));
                buf.drain(..used);
            }
            buf.extend_from_slice(part);
        }
        prop_assert_eq!(decoded, requests);
    }
}
