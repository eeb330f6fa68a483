//! Runs one scenario under every configured runtime and requires the same observation from each.

use std::fmt::Debug;
use std::time::Duration;

use futures::future::join_all;

use crate::env::{Runtime, TestEnv};
use crate::{HarnessError, Outcome};

/// Upper bound of one scenario under one runtime, so a hung shim fails the test instead of the suite.
pub const SCENARIO_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `scenario` for every runtime of `CRAB_TEST_RUNTIMES` concurrently. Each run asserts the
/// absolute expectations itself (returning `Err` when one fails) and returns what it observed; the
/// test then fails unless every runtime succeeded and all observations are equal, since crab must
/// behave exactly as runc.v2. Panics with every runtime's failure at once.
pub async fn across_runtimes<T, F, Fut>(name: &str, scenario: F)
where
    T: Debug + PartialEq,
    F: Fn(Runtime) -> Fut,
    Fut: Future<Output = Outcome<T>>,
{
    let env = TestEnv::get();
    let runs = env.runtimes.iter().map(|runtime| {
        let run = scenario(runtime.clone());
        async move {
            let outcome = match tokio::time::timeout(SCENARIO_TIMEOUT, run).await {
                Ok(outcome) => outcome,
                Err(_) => Err(HarnessError::Timeout { what: format!("scenario {name}"), after: SCENARIO_TIMEOUT }),
            };
            (runtime, outcome)
        }
    });
    require_same(name, join_all(runs).await);
}

/// Fails unless every runtime's run succeeded and all observations are equal. Panics with every
/// runtime's failure at once.
pub fn require_same<T: Debug + PartialEq>(name: &str, results: Vec<(&Runtime, Outcome<T>)>) {
    let mut failures = Vec::new();
    let mut observations = Vec::new();
    for (runtime, outcome) in results {
        match outcome {
            Ok(observation) => observations.push((runtime, observation)),
            Err(error) => failures.push(format!("  {runtime}: {error}")),
        }
    }
    if !failures.is_empty() {
        panic!("scenario {name} failed under {} runtime(s):\n{}", failures.len(), failures.join("\n"));
    }
    if let Some(((reference_runtime, reference), rest)) = observations.split_first() {
        for (runtime, observation) in rest {
            assert!(
                observation == reference,
                "scenario {name}: {runtime} behaved differently from {reference_runtime}\n  {reference_runtime}: {reference:?}\n  {runtime}: {observation:?}"
            );
        }
    }
}
