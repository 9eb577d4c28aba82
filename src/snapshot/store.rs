//! The S3 object store (SNAP-5, SNAP-11): requests signed by rusty-s3
//! (sans-IO, V4, presigned) and sent with the agent's reqwest; one
//! concrete type until a second store is real.
//!
//! Endpoint rules: `https://` is TLS, `http://` is plaintext, no scheme is
//! TLS, and an empty endpoint is AWS's `s3.amazonaws.com` (the Rewrite
//! default). AWS hosts are addressed virtual-host style, every other host
//! path style (MinIO, moto, s3s). Transient failures (connection errors,
//! time-outs, 5xx, 429) are retried with exponential back-off.

use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};

use super::error::SnapshotError;

/// Presigned URLs live this long; each request is signed just before it is sent.
const SIGNED_FOR: Duration = Duration::from_secs(15 * 60);
/// Attempts per request, and the first back-off (doubled each time).
const ATTEMPTS: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// A whole object (a chunk is at most 4 MiB) must arrive within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Where snapshots live and how to reach them (`S3Target` without the
/// data key). Debug hides the secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct S3Config {
    pub endpoint: String,
    pub bucket: String,
    pub prefix: String,
    pub region: String,
    pub access_key: String,
    pub secret_key: String,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

/// The endpoint as a URL, by the SNAP-11 scheme rules.
pub fn endpoint_url(endpoint: &str) -> Result<url::Url, SnapshotError> {
    let e = endpoint.trim();
    let e = if e.is_empty() { "s3.amazonaws.com" } else { e };
    let full = if e.starts_with("http://") || e.starts_with("https://") {
        e.to_owned()
    } else {
        format!("https://{e}")
    };
    url::Url::parse(&full)
        .map_err(|err| SnapshotError::BadTarget(format!("endpoint {endpoint:?}: {err}")))
}

/// The key prefix: empty, or ending in exactly the `/` it was given or one added.
pub fn normalise_prefix(prefix: &str) -> String {
    if prefix.is_empty() || prefix.ends_with('/') {
        prefix.to_owned()
    } else {
        format!("{prefix}/")
    }
}

/// One object listed under a sub-prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The key with the store's prefix removed.
    pub key: String,
    pub size: u64,
    pub last_modified: String,
}

#[derive(Debug, Clone)]
pub struct Store {
    bucket: Bucket,
    creds: Credentials,
    prefix: String,
    http: reqwest::Client,
}

enum Attempt<T> {
    Done(T),
    Retry(String),
    Fail(String),
}

impl Store {
    pub fn new(cfg: &S3Config) -> Result<Self, SnapshotError> {
        if cfg.bucket.is_empty() {
            return Err(SnapshotError::BadTarget("no bucket given".into()));
        }
        let url = endpoint_url(&cfg.endpoint)?;
        let aws = url
            .host_str()
            .is_some_and(|h| h == "amazonaws.com" || h.ends_with(".amazonaws.com"));
        let style = if aws {
            UrlStyle::VirtualHost
        } else {
            UrlStyle::Path
        };
        let region = if cfg.region.is_empty() {
            "us-east-1".to_owned()
        } else {
            cfg.region.clone()
        };
        let bucket = Bucket::new(url, style, cfg.bucket.clone(), region)
            .map_err(|e| SnapshotError::BadTarget(format!("endpoint {:?}: {e}", cfg.endpoint)))?;
        crate::link::tls::install_process_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| SnapshotError::Internal(format!("http client: {e}")))?;
        Ok(Self {
            bucket,
            creds: Credentials::new(cfg.access_key.clone(), cfg.secret_key.clone()),
            prefix: normalise_prefix(&cfg.prefix),
            http,
        })
    }

    /// The bucket's URL and the prefix: where this store's objects live.
    pub fn location(&self) -> String {
        format!("{}{}", self.bucket.base_url(), self.prefix)
    }

    /// The full object key of `key` under the prefix.
    pub fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Runs `once` up to ATTEMPTS times while it asks for a retry.
    async fn retried<T, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut once: F,
    ) -> Result<T, SnapshotError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Attempt<T>>,
    {
        let mut delay = FIRST_BACKOFF;
        let mut attempt = 1;
        loop {
            match once().await {
                Attempt::Done(v) => return Ok(v),
                Attempt::Fail(message) => {
                    return Err(SnapshotError::S3 {
                        op,
                        key: key.to_owned(),
                        message,
                        unreachable: false,
                    });
                }
                Attempt::Retry(message) if attempt >= ATTEMPTS => {
                    return Err(SnapshotError::S3 {
                        op,
                        key: key.to_owned(),
                        message: format!("{message} (after {attempt} attempts)"),
                        unreachable: true,
                    });
                }
                Attempt::Retry(message) => {
                    tracing::debug!(op, key, attempt, %message, "s3: transient failure, retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                    attempt += 1;
                }
            }
        }
    }

    /// HEAD: whether the object exists (404 and `NoSuchKey` are "no").
    pub async fn has(&self, key: &str) -> Result<bool, SnapshotError> {
        let full = self.full_key(key);
        self.retried("HEAD", &full, || async {
            let url = self
                .bucket
                .head_object(Some(&self.creds), &full)
                .sign(SIGNED_FOR);
            match self.http.head(url).send().await {
                Err(e) => Attempt::Retry(transport(&e)),
                Ok(r) if r.status().is_success() => Attempt::Done(true),
                Ok(r) if r.status() == StatusCode::NOT_FOUND => Attempt::Done(false),
                Ok(r) => refused(r.status(), ""),
            }
        })
        .await
    }

    /// PUT one object (`application/octet-stream`).
    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), SnapshotError> {
        let full = self.full_key(key);
        self.retried("PUT", &full, || async {
            let mut action = self.bucket.put_object(Some(&self.creds), &full);
            action
                .headers_mut()
                .insert("content-type", "application/octet-stream");
            let url = action.sign(SIGNED_FOR);
            let sent = self
                .http
                .put(url)
                .header("content-type", "application/octet-stream")
                .body(body.clone())
                .send()
                .await;
            match sent {
                Err(e) => Attempt::Retry(transport(&e)),
                Ok(r) if r.status().is_success() => Attempt::Done(()),
                Ok(r) => {
                    let status = r.status();
                    let text = r.text().await.unwrap_or_default();
                    refused(status, &text)
                }
            }
        })
        .await
    }

    /// GET a whole object; `None` when it does not exist.
    /// GETs `key`, reading at most `max` bytes of its body (45.3): a store
    /// (or whoever answers for it) that sends more is refused, never held
    /// whole.
    pub async fn get(&self, key: &str, max: u64) -> Result<Option<Bytes>, SnapshotError> {
        let full = self.full_key(key);
        self.retried("GET", &full, || async {
            let url = self
                .bucket
                .get_object(Some(&self.creds), &full)
                .sign(SIGNED_FOR);
            match self.http.get(url).send().await {
                Err(e) => Attempt::Retry(transport(&e)),
                Ok(r) if r.status() == StatusCode::NOT_FOUND => Attempt::Done(None),
                Ok(mut r) if r.status().is_success() => {
                    if r.content_length().is_some_and(|n| n > max) {
                        return too_big(&full, max);
                    }
                    let mut body = bytes::BytesMut::new();
                    loop {
                        match r.chunk().await {
                            Ok(Some(c)) => {
                                if (body.len() + c.len()) as u64 > max {
                                    return too_big(&full, max);
                                }
                                body.extend_from_slice(&c);
                            }
                            Ok(None) => return Attempt::Done(Some(body.freeze())),
                            Err(e) => return Attempt::Retry(transport(&e)),
                        }
                    }
                }
                Ok(r) => {
                    let status = r.status();
                    let text = r.text().await.unwrap_or_default();
                    if text.contains("<Code>NoSuchKey</Code>") {
                        return Attempt::Done(None);
                    }
                    refused(status, &text)
                }
            }
        })
        .await
    }

    /// Every object under `sub` (below the prefix), keys without the prefix.
    pub async fn list(&self, sub: &str) -> Result<Vec<Listed>, SnapshotError> {
        let full = self.full_key(sub);
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .retried("LIST", &full, || async {
                    let mut action = self.bucket.list_objects_v2(Some(&self.creds));
                    action.with_prefix(full.as_str());
                    if let Some(t) = &token {
                        action.with_continuation_token(t.as_str());
                    }
                    let url = action.sign(SIGNED_FOR);
                    match self.http.get(url).send().await {
                        Err(e) => Attempt::Retry(transport(&e)),
                        Ok(r) => {
                            let status = r.status();
                            let text = match r.text().await {
                                Ok(t) => t,
                                Err(e) => return Attempt::Retry(transport(&e)),
                            };
                            if !status.is_success() {
                                return refused(status, &text);
                            }
                            match rusty_s3::actions::ListObjectsV2::parse_response(&text) {
                                Ok(page) => Attempt::Done(page),
                                Err(e) => Attempt::Fail(format!("unreadable listing: {e}")),
                            }
                        }
                    }
                })
                .await?;
            for c in page.contents {
                let key = c
                    .key
                    .strip_prefix(&self.prefix)
                    .unwrap_or(&c.key)
                    .to_owned();
                out.push(Listed {
                    key,
                    size: c.size,
                    last_modified: c.last_modified,
                });
            }
            match page.next_continuation_token {
                Some(t) if !t.is_empty() => token = Some(t),
                _ => return Ok(out),
            }
        }
    }

    /// Creates the bucket (tests, bench and `volume snapshot --create-bucket`);
    /// one that exists already is fine.
    pub async fn create_bucket(&self) -> Result<(), SnapshotError> {
        let name = self.bucket.name().to_owned();
        self.retried("CREATE BUCKET", &name, || async {
            let url = self.bucket.create_bucket(&self.creds).sign(SIGNED_FOR);
            let put = self
                .http
                .put(url)
                .header("content-length", "0")
                .body(Vec::new());
            match put.send().await {
                Err(e) => Attempt::Retry(transport(&e)),
                Ok(r) if r.status().is_success() => Attempt::Done(()),
                Ok(r) => {
                    let status = r.status();
                    let text = r.text().await.unwrap_or_default();
                    if text.contains("BucketAlreadyOwnedByYou")
                        || text.contains("BucketAlreadyExists")
                    {
                        return Attempt::Done(());
                    }
                    refused(status, &text)
                }
            }
        })
        .await
    }
}

/// A refusal: retried when the server may answer otherwise later.
fn refused<T>(status: StatusCode, body: &str) -> Attempt<T> {
    let text = if body.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {}", s3_message(body))
    };
    if status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
    {
        Attempt::Retry(text)
    } else {
        Attempt::Fail(text)
    }
}

/// A transport error's text, with its causes (reqwest's own is terse).
/// A body longer than the caller can hold: refused, not retried.
fn too_big<T>(key: &str, max: u64) -> Attempt<T> {
    Attempt::Fail(format!(
        "{key}: the object is larger than the {max} bytes it may be"
    ))
}

fn transport(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The `<Code>` and `<Message>` of an S3 error body, if it has them.
fn s3_message(body: &str) -> String {
    let tag = |t: &str| {
        let open = format!("<{t}>");
        let close = format!("</{t}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find(&close)? + start;
        Some(body[start..end].to_owned())
    };
    match (tag("Code"), tag("Message")) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c,
        _ => body.chars().take(200).collect(),
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_the_scheme_rules() {
        assert_eq!(
            endpoint_url("http://127.0.0.1:9000").unwrap().as_str(),
            "http://127.0.0.1:9000/"
        );
        assert_eq!(
            endpoint_url("minio.example:9000").unwrap().scheme(),
            "https"
        );
        assert_eq!(
            endpoint_url("https://s3.example").unwrap().scheme(),
            "https"
        );
        assert_eq!(
            endpoint_url("").unwrap().as_str(),
            "https://s3.amazonaws.com/"
        );
        assert!(endpoint_url("http://[bad").is_err());
    }

    #[test]
    fn prefixes_get_one_slash() {
        assert_eq!(normalise_prefix(""), "");
        assert_eq!(normalise_prefix("snaps"), "snaps/");
        assert_eq!(normalise_prefix("snaps/"), "snaps/");
    }

    #[test]
    fn addressing_is_virtual_host_for_aws_only() {
        let mut cfg = S3Config {
            bucket: "b".into(),
            ..S3Config::default()
        };
        let aws = Store::new(&cfg).unwrap();
        assert_eq!(
            aws.bucket.base_url().as_str(),
            "https://b.s3.amazonaws.com/"
        );
        cfg.endpoint = "http://127.0.0.1:9555".into();
        let local = Store::new(&cfg).unwrap();
        assert_eq!(local.bucket.base_url().as_str(), "http://127.0.0.1:9555/b/");
        assert!(!format!("{cfg:?}").contains("secret"));
        cfg.bucket.clear();
        assert!(Store::new(&cfg).is_err());
    }

    #[test]
    fn s3_errors_read_well() {
        let body = "<Error><Code>AccessDenied</Code><Message>no</Message></Error>";
        assert_eq!(s3_message(body), "AccessDenied: no");
    }
}
