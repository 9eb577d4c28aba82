//! A control node that answers the sync stream with a malformed frame: after
//! the agent's hello it sends a `ControlMessage` whose `assignments` field
//! holds bytes that are not an `AssignmentSet`. It speaks real gRPC over the
//! test CA's TLS, so only the frame's content is wrong.

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::sync::oneshot;
use tonic::codegen::{BoxFuture, Service, http};
use zattera_agent::link::tls::{self, ClientAuth};
use zattera_agent::proto::cluster::AgentMessage;

use crate::control_plane::TestCa;

/// Field 1 of `ControlMessage` is the `AssignmentSet`; here it carries a
/// truncated varint instead.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MalformedControlMessage {
    #[prost(bytes = "vec", tag = "1")]
    pub assignments: Vec<u8>,
}

#[derive(Clone, Default)]
struct Counters {
    hellos: Arc<AtomicUsize>,
    sent: Arc<AtomicUsize>,
}

#[derive(Clone)]
struct GarbageSync(Counters);

impl tonic::server::NamedService for GarbageSync {
    const NAME: &'static str = "zattera.cluster.v1.AgentSyncService";
}

struct Handler(Counters);

impl tonic::server::StreamingService<AgentMessage> for Handler {
    type Response = MalformedControlMessage;
    type ResponseStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<MalformedControlMessage, tonic::Status>> + Send>,
    >;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, tonic::Status>;

    fn call(&mut self, req: tonic::Request<tonic::Streaming<AgentMessage>>) -> Self::Future {
        let counters = self.0.clone();
        Box::pin(async move {
            let mut inbound = req.into_inner();
            if let Ok(Some(_hello)) = inbound.message().await {
                counters.hellos.fetch_add(1, Ordering::SeqCst);
            }
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                let _ = tx
                    .send(Ok(MalformedControlMessage {
                        assignments: vec![0xff, 0xff, 0xff],
                    }))
                    .await;
                counters.sent.fetch_add(1, Ordering::SeqCst);
                // Keep the stream open: the agent is the one to end it.
                while let Ok(Some(_)) = inbound.message().await {}
            });
            let stream: Self::ResponseStream =
                Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
            Ok(tonic::Response::new(stream))
        })
    }
}

impl<B> Service<http::Request<B>> for GarbageSync
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let counters = self.0.clone();
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<MalformedControlMessage, AgentMessage>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            Ok(grpc.streaming(Handler(counters), req).await)
        })
    }
}

/// The malformed control node, serving until dropped.
pub struct GarbageControl {
    counters: Counters,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl GarbageControl {
    /// Serves on `addr` (a stopped control plane's port) with `ca`'s server
    /// identity.
    pub async fn start(addr: SocketAddr, ca: &TestCa) -> Self {
        let listener = loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
            }
        };
        let (chain, key) = ca.server_identity();
        let cfg = tls::server(
            chain.as_bytes(),
            key.as_bytes(),
            ClientAuth::Optional(ca.pem.as_bytes()),
        )
        .unwrap();
        let counters = Counters::default();
        let svc = GarbageSync(counters.clone());
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(tls::incoming(listener, Arc::new(cfg)), async {
                    let _ = stop_rx.await;
                })
                .await;
        });
        Self {
            counters,
            stop: Some(stop_tx),
            task,
        }
    }

    /// Hellos received, malformed frames sent.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.counters.hellos.load(Ordering::SeqCst),
            self.counters.sent.load(Ordering::SeqCst),
        )
    }

    /// Stops serving and frees the port.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}
