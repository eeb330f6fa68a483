//! Task events to containerd, over its ttrpc Events service.
//!
//! One task forwards the events in the order they were raised. When containerd
//! goes away (a crash or restart), the connection breaks: the event is retried
//! on a fresh connection until containerd answers again, for up to
//! [`RETRY_FOR`], so an exit that happens while containerd restarts still
//! reaches the new one. (The containerd-shim crate's publisher reconnects only
//! on two error kinds, and a dead connection reports a third: every later
//! event was lost.)

use std::time::{Duration, Instant, SystemTime};

use containerd_shim::event::Event;
use containerd_shim_protos::protobuf::well_known_types::{any::Any, timestamp::Timestamp};
use containerd_shim_protos::protobuf::{MessageDyn, MessageField};
use containerd_shim_protos::shim::event::Envelope;
use containerd_shim_protos::shim::events::ForwardRequest;
use containerd_shim_protos::shim_async::EventsClient;
use containerd_shim_protos::ttrpc;
use tokio::sync::mpsc;

/// Events raised while containerd is unreachable wait here, in order.
const QUEUE_LEN: usize = 1024;
/// How long a publisher waits for room in a full queue before dropping its event.
const QUEUE_WAIT: Duration = Duration::from_secs(3);
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);
/// containerd restarts in seconds; an event it did not take in this long is dropped.
const RETRY_FOR: Duration = Duration::from_secs(120);
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// Publishes task events to containerd in the order they are raised.
#[derive(Clone)]
pub struct EventSink {
    queue: Option<mpsc::Sender<Queued>>,
    namespace: String,
}

enum Queued {
    Event(Envelope),
    /// Answered once everything queued before it was handled.
    Barrier(tokio::sync::oneshot::Sender<()>),
}

impl EventSink {
    /// Events go to containerd's ttrpc `address` (`TTRPC_ADDRESS`); without
    /// one they go nowhere. Must be called from the tokio runtime.
    pub fn new(address: Option<String>, namespace: &str) -> Self {
        let queue = address.map(|address| {
            let (tx, rx) = mpsc::channel(QUEUE_LEN);
            tokio::spawn(forward_all(address, rx));
            tx
        });
        Self { queue, namespace: namespace.into() }
    }

    pub async fn publish(&self, event: impl Event + Send + 'static) {
        let Some(queue) = &self.queue else { return };
        let topic = event.topic();
        let envelope = match envelope(&self.namespace, &topic, &event) {
            Ok(envelope) => envelope,
            Err(e) => return tracing::error!(%topic, error = %e, "event not encoded"),
        };
        if let Err(e) = queue.send_timeout(Queued::Event(envelope), QUEUE_WAIT).await {
            tracing::error!(%topic, error = %e, "event not published: its queue stayed full");
        }
    }

    /// Waits, at most `timeout`, until every event published so far was
    /// delivered or dropped: the last ones (TaskDelete) must not die with the shim.
    pub async fn flush(&self, timeout: Duration) {
        let Some(queue) = &self.queue else { return };
        let (done, handled) = tokio::sync::oneshot::channel();
        let flushed = async {
            if queue.send(Queued::Barrier(done)).await.is_ok() {
                let _ = handled.await;
            }
        };
        if tokio::time::timeout(timeout, flushed).await.is_err() {
            tracing::warn!(timeout_ms = timeout.as_millis() as u64, "events still queued at exit");
        }
    }
}

fn envelope(namespace: &str, topic: &str, event: &dyn MessageDyn) -> Result<Envelope, String> {
    let mut any = Any::new();
    any.type_url = event.descriptor_dyn().full_name().to_string();
    any.value = event.write_to_bytes_dyn().map_err(|e| e.to_string())?;
    let since_epoch = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let mut timestamp = Timestamp::new();
    timestamp.seconds = since_epoch.as_secs() as i64;
    timestamp.nanos = since_epoch.subsec_nanos() as i32;
    let mut envelope = Envelope::new();
    envelope.topic = topic.into();
    envelope.namespace = namespace.into();
    envelope.timestamp = MessageField::some(timestamp);
    envelope.event = MessageField::some(any);
    Ok(envelope)
}

async fn forward_all(address: String, mut queue: mpsc::Receiver<Queued>) {
    let mut client: Option<EventsClient> = None;
    while let Some(queued) = queue.recv().await {
        let envelope = match queued {
            Queued::Event(envelope) => envelope,
            Queued::Barrier(done) => {
                let _ = done.send(());
                continue;
            }
        };
        let topic = envelope.topic.clone();
        let mut request = ForwardRequest::new();
        request.envelope = MessageField::some(envelope);
        let give_up = Instant::now() + RETRY_FOR;
        let mut pause = FIRST_PAUSE;
        while let Err(e) = forward_once(&address, &mut client, &request).await {
            // Whatever failed, the connection is suspect: the next try dials again.
            client = None;
            if Instant::now() >= give_up {
                tracing::error!(%topic, error = %e, after_s = RETRY_FOR.as_secs(), "event dropped: containerd did not take it");
                break;
            }
            tracing::warn!(%topic, error = %e, retry_in_ms = pause.as_millis() as u64, "event not delivered yet");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}

async fn forward_once(
    address: &str,
    client: &mut Option<EventsClient>,
    request: &ForwardRequest,
) -> Result<(), String> {
    if client.is_none() {
        let path = address.strip_prefix("unix://").unwrap_or(address);
        let connected = ttrpc::r#async::Client::connect(&format!("unix://{path}"))
            .await
            .map_err(|e| format!("connect {path}: {e}"))?;
        *client = Some(EventsClient::new(connected));
    }
    let events = client.as_ref().expect("connected above");
    let ctx = ttrpc::context::with_timeout(FORWARD_TIMEOUT.as_nanos() as i64);
    match tokio::time::timeout(FORWARD_TIMEOUT, events.forward(ctx, request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer in {FORWARD_TIMEOUT:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim_protos::events::task::TaskExit;
    use containerd_shim_protos::protobuf::Message;

    #[test]
    fn envelope_carries_topic_namespace_and_the_typed_event() {
        let exit = TaskExit { container_id: "c1".into(), exit_status: 3, ..Default::default() };
        let env = envelope("ns", &exit.topic(), &exit).unwrap();
        assert_eq!(env.topic, "/tasks/exit");
        assert_eq!(env.namespace, "ns");
        assert!(env.timestamp.seconds > 0);
        let any = env.event.as_ref().unwrap();
        assert_eq!(any.type_url, "containerd.events.TaskExit");
        let back = TaskExit::parse_from_bytes(&any.value).unwrap();
        assert_eq!((back.container_id.as_str(), back.exit_status), ("c1", 3));
    }
}
