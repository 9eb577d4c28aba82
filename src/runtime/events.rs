//! Lifecycle events from containerd (C-13, L-4): task exits and OOM kills in
//! the agent's namespace, and that a container was created, updated or
//! deleted there (so a listing can be kept until one is). A subscription
//! ends when containerd restarts; the caller re-subscribes and relies on its
//! poll for what it missed meanwhile.

use containerd_client::events::{
    ContainerCreate, ContainerDelete, ContainerUpdate, TaskExit, TaskOom,
};
use containerd_client::services::v1::SubscribeRequest;
use futures::{Stream, StreamExt};
use prost::Message;

use super::connection::Containerd;
use super::error::RuntimeError;

pub const TOPIC_EXIT: &str = "/tasks/exit";
pub const TOPIC_OOM: &str = "/tasks/oom";
/// A container record changed: what a listing of them shows is stale.
const TOPIC_CREATE: &str = "/containers/create";
const TOPIC_UPDATE: &str = "/containers/update";
const TOPIC_DELETE: &str = "/containers/delete";
const CONTAINER_TOPICS: [&str; 3] = [TOPIC_CREATE, TOPIC_UPDATE, TOPIC_DELETE];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskEvent {
    /// A process exited. `exec_id` equals `container_id` for the init process.
    Exited {
        container_id: String,
        exec_id: String,
        exit_code: u32,
    },
    /// The kernel's OOM killer acted in the container.
    OomKilled { container_id: String },
    /// This container of the namespace was created, updated or deleted.
    ContainerChanged { container_id: String },
    /// A container record changed, but the event did not say which.
    ContainersChanged,
}

impl TaskEvent {
    /// Whether this is the exit of the container's main process (not an exec).
    pub fn is_init_exit(&self) -> bool {
        matches!(self, Self::Exited { container_id, exec_id, .. } if exec_id.is_empty() || exec_id == container_id)
    }
}

/// Subscribes to exit, OOM and container events of this namespace. The
/// request is sent at once from a task of its own: containerd answers a
/// subscription only with its first event, so awaiting the call here could
/// wait forever.
pub fn subscribe(ctd: &Containerd) -> impl Stream<Item = Result<TaskEvent, RuntimeError>> + use<> {
    let ns = ctd.namespace().to_string();
    let filters = [TOPIC_EXIT, TOPIC_OOM]
        .iter()
        .chain(CONTAINER_TOPICS.iter())
        .map(|t| format!("topic==\"{t}\",namespace==\"{ns}\""))
        .collect();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let request = ctd.request(SubscribeRequest { filters });
    let mut client = ctd.events();
    tokio::spawn(async move {
        let mut stream = match client.subscribe(request).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                let _ = tx
                    .send(Err(RuntimeError::grpc("subscribe to task events")(s)))
                    .await;
                return;
            }
        };
        while let Some(envelope) = stream.next().await {
            let event = match envelope {
                Ok(envelope) => decode(envelope),
                Err(s) => Some(Err(RuntimeError::grpc("task event stream")(s))),
            };
            if let Some(event) = event
                && tx.send(event).await.is_err()
            {
                return; // the subscriber is gone
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

fn decode(envelope: containerd_client::types::Envelope) -> Option<Result<TaskEvent, RuntimeError>> {
    let any = envelope.event?;
    match envelope.topic.as_str() {
        TOPIC_EXIT => TaskExit::decode(&any.value[..]).ok().map(|e| {
            Ok(TaskEvent::Exited {
                container_id: e.container_id,
                exec_id: e.id,
                exit_code: e.exit_status,
            })
        }),
        TOPIC_OOM => TaskOom::decode(&any.value[..]).ok().map(|e| {
            Ok(TaskEvent::OomKilled {
                container_id: e.container_id,
            })
        }),
        topic if CONTAINER_TOPICS.contains(&topic) => {
            Some(Ok(container_changed(topic, &any.value)))
        }
        _ => None,
    }
}

/// Which container a create, update or delete event is about; one that
/// cannot be read stales every container, not none.
fn container_changed(topic: &str, value: &[u8]) -> TaskEvent {
    let id = match topic {
        TOPIC_CREATE => ContainerCreate::decode(value).map(|e| e.id),
        TOPIC_UPDATE => ContainerUpdate::decode(value).map(|e| e.id),
        _ => ContainerDelete::decode(value).map(|e| e.id),
    };
    match id {
        Ok(container_id) if !container_id.is_empty() => {
            TaskEvent::ContainerChanged { container_id }
        }
        _ => TaskEvent::ContainersChanged,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn a_container_event_names_its_container() {
        let create = ContainerCreate {
            id: "c1".into(),
            image: "img".into(),
            ..Default::default()
        };
        assert_eq!(
            container_changed(TOPIC_CREATE, &create.encode_to_vec()),
            TaskEvent::ContainerChanged {
                container_id: "c1".into()
            }
        );
        let delete = ContainerDelete { id: "c2".into() };
        assert_eq!(
            container_changed(TOPIC_DELETE, &delete.encode_to_vec()),
            TaskEvent::ContainerChanged {
                container_id: "c2".into()
            }
        );
    }

    #[test]
    fn an_unreadable_container_event_stales_every_container() {
        assert_eq!(
            container_changed(TOPIC_UPDATE, &[0xff, 0xff, 0xff]),
            TaskEvent::ContainersChanged
        );
        assert_eq!(
            container_changed(TOPIC_DELETE, &[]),
            TaskEvent::ContainersChanged
        );
    }
}
