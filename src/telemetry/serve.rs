//! The `/metrics` endpoint: plain HTTP/1.1 on the opt-in `metrics-listen`
//! address (loopback unless a host is named), OpenMetrics text.
//! Each connection is its own task, so a slow scraper stalls nobody.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;

// What prometheus-client writes: OpenMetrics text (Prometheus reads it).
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves scrapes until the task is dropped.
pub async fn run(listener: tokio::net::TcpListener, registry: Arc<Registry>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let registry = Arc::clone(&registry);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let registry = Arc::clone(&registry);
                async move { Ok::<_, Infallible>(answer(&req, &registry)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            // A scrape is small; a client that stalls is cut off.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), conn).await;
        });
    }
}

fn answer<B>(req: &Request<B>, registry: &Registry) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            CONTENT_TYPE,
            super::collect::render(registry),
        ),
        (&Method::GET, _) => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: metrics are at /metrics\n".to_owned(),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET\n".to_owned(),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

/// `metrics-listen` as written: `HOST:PORT`, or `:PORT` / `PORT` for
/// loopback.
pub fn parse_listen(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Some(addr);
    }
    let port = text.strip_prefix(':').unwrap_or(text).parse::<u16>().ok()?;
    Some(SocketAddr::from(([127, 0, 0, 1], port)))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_is_loopback() {
        assert_eq!(parse_listen("9464"), "127.0.0.1:9464".parse().ok());
        assert_eq!(parse_listen(":9464"), "127.0.0.1:9464".parse().ok());
        assert_eq!(parse_listen("0.0.0.0:9464"), "0.0.0.0:9464".parse().ok());
        assert_eq!(parse_listen("[::1]:9464"), "[::1]:9464".parse().ok());
        assert_eq!(parse_listen("nonsense"), None);
    }
}
