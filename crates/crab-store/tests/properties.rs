//! Property tests of the sandbox annotations: a tenant's pod spec sets them.

use std::collections::HashMap;

use proptest::prelude::*;

fn config() -> ProptestConfig {
    // CI runs these on two busy cores: enough cases to find a panic, quick to run.
    ProptestConfig { cases: 512, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// Any annotation values: a policy or an error naming the annotation.
    #[test]
    fn annotations_parse_or_name_the_key(values in proptest::collection::vec("[ -~]{0,40}", 4)) {
        let keys = [
            crab_store::turns::ANNOTATION_TURNS,
            crab_store::turns::ANNOTATION_POLICY,
            crab_store::turns::ANNOTATION_IGNORE,
            "io.crab.restore-from",
        ];
        let annotations: HashMap<String, String> =
            keys.iter().map(|k| k.to_string()).zip(values).collect();
        if let Err(e) = crab_store::turns::SandboxPolicy::from_annotations(&annotations, &Default::default()) {
            let text = e.to_string();
            prop_assert!(keys.iter().any(|k| text.contains(k)), "{}", text);
        }
    }
}
