//! Fetching an upgrade: bounded (10 min, 512 MiB), hashed as it arrives
//! into a file beside the binary, and never led into the node's networks.
//!
//! The URL itself lies under the operator's `upgrade-base-url`, so its host
//! is trusted whatever its address (an internal mirror). A redirect to
//! another host is followed (release assets redirect to a CDN; the SHA-256
//! guards the bytes) only to public addresses: never to loopback (the
//! agent's metrics, the admin side of local services), the bridges and the
//! mesh (tenants' unpublished ports), link-local (cloud metadata) or any
//! private range (56.10). An address literal is checked by the redirect
//! policy; a name is resolved here and its non-public addresses dropped,
//! so a name that points inward connects nowhere. Never from https to http.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::redirect::Policy;
use sha2::{Digest, Sha256};

use super::{DOWNLOAD_TIMEOUT, MAX_DOWNLOAD, UpgradeError};
use crate::addr_scope::is_global;

/// Streams `url` into `path`, checking size and digest; the file is
/// executable and synced when this returns Ok.
pub(super) async fn download(url: &str, path: &Path, want: &str) -> Result<(), UpgradeError> {
    let shown = crate::redact::url(url);
    let unavailable = |e: &dyn std::error::Error| {
        // reqwest's own errors quote the whole URL: the redacted one replaces it.
        let reason = chain(e).replace(url, &shown);
        UpgradeError::Download {
            url: shown.clone(),
            reason,
        }
    };
    let trusted = reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default();
    crate::link::tls::install_process_provider();
    // A stalled server fails the call, and the whole of it is bounded.
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(60))
        .timeout(DOWNLOAD_TIMEOUT)
        .redirect(redirects(trusted.clone()))
        .dns_resolver(PublicBeyond { trusted })
        .build()
        .map_err(|e| unavailable(&e))?;
    let mut resp = client.get(url).send().await.map_err(|e| unavailable(&e))?;
    if !resp.status().is_success() {
        return Err(UpgradeError::Download {
            url: shown,
            reason: format!("HTTP {}", resp.status()),
        });
    }
    if resp.content_length().is_some_and(|n| n > MAX_DOWNLOAD) {
        return Err(too_big(&shown));
    }
    let internal = |e: std::io::Error| UpgradeError::Local(format!("staging: {e}"));
    let mut file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o755)
            .open(path)
            .map_err(internal)?
    };
    let mut hasher = Sha256::new();
    let mut total: u64 = 0;
    while let Some(chunk) = resp.chunk().await.map_err(|e| unavailable(&e))? {
        total += chunk.len() as u64;
        if total > MAX_DOWNLOAD {
            return Err(too_big(&shown));
        }
        hasher.update(&chunk);
        file.write_all(&chunk).map_err(internal)?;
    }
    let got = hex::encode(hasher.finalize());
    if got != want {
        return Err(UpgradeError::DigestMismatch {
            url: shown,
            got,
            want: want.to_owned(),
        });
    }
    file.sync_all().map_err(internal)
}

/// At most 10 hops; never from https to http; to another host than
/// `trusted` only when it is a name (resolved by [`PublicBeyond`]) or a
/// public address.
fn redirects(trusted: String) -> Policy {
    Policy::custom(move |attempt| {
        let to = attempt.url();
        let downgraded =
            to.scheme() == "http" && attempt.previous().iter().any(|u| u.scheme() == "https");
        let inward = match to.host() {
            Some(url::Host::Ipv4(ip)) => !is_global(ip.into()),
            Some(url::Host::Ipv6(ip)) => !is_global(ip.into()),
            _ => false,
        } && to.host_str() != Some(trusted.as_str());
        let shown = crate::redact::url(to.as_str());
        if attempt.previous().len() >= 10 {
            attempt.error("too many redirects")
        } else if downgraded {
            attempt.error(format!("redirected from https to {shown}"))
        } else if inward {
            attempt.error(format!(
                "redirected to {shown}, which is not a public address: only the host of upgrade-base-url may be"
            ))
        } else {
            attempt.follow()
        }
    })
}

/// Resolves `trusted` as the system does, and any other name to its public
/// addresses only.
struct PublicBeyond {
    trusted: String,
}

impl Resolve for PublicBeyond {
    fn resolve(&self, name: Name) -> Resolving {
        let any = name.as_str() == self.trusted;
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let kept: Vec<SocketAddr> = found
                .iter()
                .copied()
                .filter(|a| any || is_global(a.ip()))
                .collect();
            if kept.is_empty() && !found.is_empty() {
                return Err(format!(
                    "{host} resolves only to addresses that are not public ({}): only the host of upgrade-base-url may be",
                    found[0].ip()
                )
                .into());
            }
            Ok(Box::new(kept.into_iter()) as Addrs)
        })
    }
}

/// An error with its causes, as reqwest keeps the useful part in them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let more = cause.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        next = cause.source();
    }
    text
}

fn too_big(url: &str) -> UpgradeError {
    UpgradeError::TooLarge {
        url: url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A server on `ip` answering every request with `response`; the
    /// count of connections it took.
    async fn serve(ip: &str, response: String) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let taken = Arc::new(AtomicUsize::new(0));
        let count = taken.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut buf = vec![0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let _ = conn.write_all(response.as_bytes()).await;
                let _ = conn.shutdown().await;
            }
        });
        (addr, taken)
    }

    fn redirect_to(location: &str) -> String {
        format!(
            "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
    }

    fn body(text: &str) -> String {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        )
    }

    /// 56.10: a URL under the base that redirects into the node (another
    /// loopback address, a name that resolves to loopback) is not followed:
    /// the inner server is never connected to. A redirect to the base's own
    /// host (another port: the tests' CDN) still is.
    #[tokio::test]
    async fn a_redirect_never_leads_into_the_node_s_networks() {
        let tmp = tempfile::tempdir().unwrap();
        let staged = tmp.path().join("staged");
        let want = hex::encode(Sha256::digest(b"agent"));
        let (inner, inner_hits) = serve("127.0.0.2", body("metrics of every tenant")).await;
        let (named, named_hits) = serve("127.0.0.1", body("metrics of every tenant")).await;
        let (cdn, _) = serve("127.0.0.1", body("agent")).await;
        for (to, hits, says) in [
            (
                format!("http://{inner}/metrics"),
                &inner_hits,
                "which is not a public address",
            ),
            (
                format!("http://localhost:{}/metrics", named.port()),
                &named_hits,
                "resolves only to addresses that are not public",
            ),
        ] {
            let (base, _) = serve("127.0.0.1", redirect_to(&to)).await;
            let err = download(&format!("http://{base}/releases/x"), &staged, &want)
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{to}: {err}");
            assert_eq!(hits.load(Ordering::SeqCst), 0, "{to} was fetched");
        }
        let (base, _) = serve("127.0.0.1", redirect_to(&format!("http://{cdn}/x"))).await;
        download(&format!("http://{base}/releases/x"), &staged, &want)
            .await
            .unwrap();
        assert_eq!(std::fs::read(&staged).unwrap(), b"agent");
    }
}
