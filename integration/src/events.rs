//! containerd's event stream, read from `ctr events` running in the background.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::{HarnessError, Outcome, wait_until};
use crab_containerd::Ctr;

/// One line of `ctr events`: `<date> <time> <zone> UTC <namespace> <topic> <json payload>`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub namespace: String,
    pub topic: String,
    pub payload: Value,
}

impl Event {
    pub fn parse(line: &str) -> Option<Event> {
        let mut fields = line.splitn(7, ' ');
        let _timestamp = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let namespace = fields.next()?.to_string();
        let topic = fields.next()?.to_string();
        let payload = fields.next().and_then(|json| serde_json::from_str(json).ok()).unwrap_or(Value::Null);
        topic.starts_with('/').then_some(Event { namespace, topic, payload })
    }

    /// Whether the event is about container `id`: task events carry `container_id`, container events
    /// `id`, snapshot events `key`.
    pub fn concerns(&self, id: &str) -> bool {
        ["container_id", "id", "key"].iter().any(|field| self.payload.get(field).and_then(Value::as_str) == Some(id))
    }

    pub fn str_field(&self, name: &str) -> Option<&str> {
        self.payload.get(name).and_then(Value::as_str)
    }

    pub fn u64_field(&self, name: &str) -> Option<u64> {
        self.payload.get(name).and_then(Value::as_u64)
    }
}

static NEXT_TOKEN: AtomicU64 = AtomicU64::new(0);

/// Events collected since `start`; the `ctr events` child is killed on drop.
pub struct EventStream {
    events: Arc<Mutex<Vec<Event>>>,
    _child: tokio::process::Child,
}

impl EventStream {
    /// Starts `ctr events` and returns once it provably receives events, so nothing a scenario does
    /// afterwards can be missed: it sets a unique namespace label and waits for that update event.
    pub async fn start(ctr: &Ctr) -> Outcome<EventStream> {
        let mut child = ctr.invoke(["events"]).spawn_streaming()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let events: Arc<Mutex<Vec<Event>>> = Arc::default();
        let sink = events.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(event) = Event::parse(&line) {
                    sink.lock().unwrap().push(event);
                }
            }
        });
        let stream = EventStream { events, _child: child };
        let token = format!("{}-{}", std::process::id(), NEXT_TOKEN.fetch_add(1, Ordering::Relaxed));
        let label = format!("crab.integration.sync={token}");
        wait_until("`ctr events` to deliver its synchronisation event", Duration::from_secs(20), || async {
            ctr.invoke(["namespaces", "label", ctr.namespace(), label.as_str()]).success().await?;
            let seen = stream.snapshot().iter().any(|event| {
                event.topic == "/namespaces/update"
                    && event.payload.pointer("/labels/crab.integration.sync").and_then(Value::as_str) == Some(&token)
            });
            Ok(seen.then_some(()))
        })
        .await?;
        Ok(stream)
    }

    pub fn snapshot(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    /// Events about container `id`, in arrival order.
    pub fn for_container(&self, id: &str) -> Vec<Event> {
        self.snapshot().into_iter().filter(|e| e.concerns(id)).collect()
    }

    /// Waits for an event about `id` with `topic` that also satisfies `filter`.
    pub async fn wait_for(
        &self,
        id: &str,
        topic: &str,
        timeout: Duration,
        filter: impl Fn(&Event) -> bool,
    ) -> Outcome<Event> {
        wait_until(&format!("event {topic} for {id}"), timeout, || async {
            Ok(self.for_container(id).into_iter().find(|e| e.topic == topic && filter(e)))
        })
        .await
        .map_err(|error| match error {
            HarnessError::Timeout { what, after } => HarnessError::Timeout {
                what: format!("{what}; events seen for it: {:?}", self.for_container(id)),
                after,
            },
            other => other,
        })
    }

    /// The TaskExit event of the init process of `id` (its `id` field equals the container id).
    pub async fn wait_init_exit(&self, id: &str, timeout: Duration) -> Outcome<Event> {
        self.wait_for(id, "/tasks/exit", timeout, |e| e.str_field("id") == Some(id)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ctr_events_line() {
        let line = r#"2026-11-29 13:25:10.237700442 +0000 UTC crab /tasks/exit {"container_id":"c1","id":"x","pid":13379,"exit_status":4}"#;
        let event = Event::parse(line).unwrap();
        assert_eq!(event.namespace, "crab");
        assert_eq!(event.topic, "/tasks/exit");
        assert_eq!(event.u64_field("exit_status"), Some(4));
        assert!(event.concerns("c1"));
        assert!(!event.concerns("c"));
    }

    #[test]
    fn rejects_lines_that_are_not_events() {
        assert_eq!(Event::parse("ctr: connection refused"), None);
    }
}
