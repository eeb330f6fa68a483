//! Property tests of crab.toml's parser: any text gives a config or an error naming the file.

use std::path::Path;

use proptest::prelude::*;

fn config() -> ProptestConfig {
    // CI runs these on two busy cores: enough cases to find a panic, quick to run.
    ProptestConfig { cases: 512, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// Any text as crab.toml: a config or an error naming the file.
    #[test]
    fn config_parses_or_names_the_file(text in "(\\[[a-z]{1,10}\\]\n([a-z_]{1,12} = [ -~]{0,20}\n){0,3}){0,3}") {
        if let Err(e) = crab_config::Config::parse(&text, Path::new("/etc/crab/crab.toml")) {
            prop_assert!(e.to_string().contains("crab.toml"), "{}", e);
        }
    }
}
