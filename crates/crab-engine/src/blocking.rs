//! The store blocks on file I/O (crab-store has no async runtime): the engine runs its calls
//! on tokio's blocking pool, so a write-out never stalls the shim's Task API.

use std::sync::Arc;

use crab_store::{CheckpointError, CheckpointStore, Result};

/// Runs `work` on the store on tokio's blocking pool.
pub async fn on_store<T, F>(store: &Arc<CheckpointStore>, work: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&CheckpointStore) -> Result<T> + Send + 'static,
{
    let store = Arc::clone(store);
    tokio::task::spawn_blocking(move || work(&store)).await.map_err(|e| CheckpointError::Join(e.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn store_calls_run_on_the_blocking_pool_and_their_errors_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(CheckpointStore::open(dir.path()).unwrap());
        let runtime_thread = std::thread::current().id();
        let on = on_store(&store, move |_| Ok(std::thread::current().id())).await.unwrap();
        assert_ne!(on, runtime_thread, "the work ran on a thread of the blocking pool");
        let failed = on_store(&store, |_| -> Result<()> { Err(CheckpointError::InvalidRequest("no".into())) }).await;
        assert!(matches!(failed, Err(CheckpointError::InvalidRequest(_))));
    }
}
