//! Counts node API calls by method and gRPC code, in one place: the code
//! a handler answered with is in the response headers (a trailers-only
//! error); a call whose response started is `OK` (a stream's own end is its
//! business).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::telemetry::{AgentMetrics, NODE_API_METHODS};

#[derive(Debug, Clone)]
pub struct ObserveLayer(pub Arc<AgentMetrics>);

impl<S> tower::Layer<S> for ObserveLayer {
    type Service = Observe<S>;
    fn layer(&self, inner: S) -> Observe<S> {
        Observe {
            inner,
            metrics: Arc::clone(&self.0),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Observe<S> {
    inner: S,
    metrics: Arc<AgentMetrics>,
}

/// The method of a gRPC path, as one of ours (`other` for anything else).
fn method_of(path: &str) -> &'static str {
    let name = path.rsplit('/').next().unwrap_or_default();
    NODE_API_METHODS
        .iter()
        .find(|m| **m == name)
        .copied()
        .unwrap_or("other")
}

impl<S, B, R> tower::Service<http::Request<B>> for Observe<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_of(req.uri().path());
        let metrics = Arc::clone(&self.metrics);
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await?;
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map_or(tonic::Code::Ok, tonic::Code::from_i32);
            metrics.node_api_call(method, code);
            Ok(response)
        })
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn methods_come_from_the_path() {
        assert_eq!(
            method_of("/zattera.cluster.v1.AgentLocalService/QueryLogs"),
            "QueryLogs"
        );
        assert_eq!(
            method_of("/zattera.cluster.v1.AgentLocalService/ProxyTCP"),
            "ProxyTCP"
        );
        assert_eq!(method_of("/x.Y/Nope"), "other");
        assert_eq!(method_of(""), "other");
    }
}
