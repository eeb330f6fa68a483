//! Property tests of every parser that reads bytes from outside crab's trust: spawner frames
//! (written by a process inside the container), crabd frames (any local client of its socket),
//! sealed manifests (the store's disk; later, a registry), agent traces, sandbox annotations
//! (a tenant's pod spec) and crab.toml. Sealed manifests have theirs beside their parser
//! (`checkpoint::manifest`). Each parser must turn any input into a value or a
//! clear error, never a panic, an unbounded allocation or a silently different value.

use std::collections::HashMap;
use std::path::Path;

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

    /// crabd reads a frame of at most `max` bytes whatever the length prefix claims, and its
    /// messages decode or fail cleanly.
    #[test]
    fn crabd_frames_are_bounded_and_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..512), max in 0u32..300) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let read = runtime.block_on(crate::node::protocol::read_frame(&mut &buf[..], max));
        if let Ok(body) = read {
            prop_assert!(body.len() <= max as usize);
            let _ = serde_json::from_slice::<crate::node::protocol::Request>(&body);
            let _ = serde_json::from_slice::<crate::node::protocol::Reply>(&body);
        }
    }

    /// Any text as a trace: a trace or an error that names the file.
    #[test]
    fn traces_parse_or_name_the_file(text in "(\\{[ -~]{0,80}\\}\n){0,4}|[ -~\n]{0,200}") {
        if let Err(e) = crate::replay::trace::Trace::parse(Path::new("t.jsonl"), &text) {
            prop_assert!(e.to_string().contains("t.jsonl"), "{}", e);
        }
    }

    /// Any annotation values: a policy or an error naming the annotation.
    #[test]
    fn annotations_parse_or_name_the_key(values in proptest::collection::vec("[ -~]{0,40}", 4)) {
        let keys = [
            crate::turns::ANNOTATION_TURNS,
            crate::turns::ANNOTATION_POLICY,
            crate::turns::ANNOTATION_IGNORE,
            "io.crab.restore-from",
        ];
        let annotations: HashMap<String, String> =
            keys.iter().map(|k| k.to_string()).zip(values).collect();
        if let Err(e) = crate::turns::SandboxPolicy::from_annotations(&annotations, &Default::default()) {
            let text = e.to_string();
            prop_assert!(keys.iter().any(|k| text.contains(k)), "{}", text);
        }
    }

    /// Any text as crab.toml: a config or an error naming the file.
    #[test]
    fn config_parses_or_names_the_file(text in "(\\[[a-z]{1,10}\\]\n([a-z_]{1,12} = [ -~]{0,20}\n){0,3}){0,3}") {
        if let Err(e) = crate::config::Config::parse(&text, Path::new("/etc/crab/crab.toml")) {
            prop_assert!(e.to_string().contains("crab.toml"), "{}", e);
        }
    }
}
