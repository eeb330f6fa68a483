//! Property tests of the trace parser: traces come from outside crab.

use std::path::Path;

use proptest::prelude::*;

fn config() -> ProptestConfig {
    // CI runs these on two busy cores: enough cases to find a panic, quick to run.
    ProptestConfig { cases: 512, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// Any text as a trace: a trace or an error that names the file.
    #[test]
    fn traces_parse_or_name_the_file(text in "(\\{[ -~]{0,80}\\}\n){0,4}|[ -~\n]{0,200}") {
        if let Err(e) = crab_replay::trace::Trace::parse(Path::new("t.jsonl"), &text) {
            prop_assert!(e.to_string().contains("t.jsonl"), "{}", e);
        }
    }
}
