//! Client-side image pull (R-2): resolve through the OCI distribution API,
//! stream blobs into containerd's content store under a lease (a few layers
//! at once), and unpack each layer as soon as it and the layers below it are
//! in, while the rest still download. containerd 1.6 has no Transfer
//! service, so the agent does this itself.
//!
//! The registry protocol (token challenges, basic auth, media-type
//! negotiation) is `oci-client`'s; what is stored, verified, labelled and
//! unpacked is ours. A present image is never refreshed, even `latest`.
//! Pulls of one reference are serialised by [`Puller`], so concurrent callers
//! share the first pull's result instead of downloading twice.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use oci_spec::image::{ImageIndex, ImageManifest};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{Mutex, watch};

use super::archive::parse_diff_ids;
use super::connection::Containerd;
use super::content;
use super::descriptor::{Descriptor, media, select_manifest};
use super::digest::Digest;
use super::error::RuntimeError;
use super::images::{LocalImage, get_local, put_image_record};
use super::lease::Lease;
use super::manifest_get::{ManifestGet, describe};
use super::reference::ImageRef;
use super::unpack::{self, LABEL_GC_SNAPSHOT};

const PULL_LEASE_TTL: Duration = Duration::from_secs(3600);
/// Layers downloaded at once.
const PARALLEL_LAYERS: usize = 3;
const ACCEPTED: [&str; 4] = [
    media::OCI_INDEX,
    media::DOCKER_MANIFEST_LIST,
    media::OCI_MANIFEST,
    media::DOCKER_MANIFEST,
];

pub use crate::link::registry::{
    ClusterRegistry, ClusterRegistryFeed, ClusterRegistryWatch, Credentials,
};

/// What a pull reports while it runs (for a terminal progress line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullEvent {
    Resolved {
        manifest: Digest,
        layers: usize,
        bytes: u64,
    },
    LayerBytes {
        digest: Digest,
        bytes: u64,
    },
    LayerDone {
        digest: Digest,
        downloaded: bool,
    },
    /// The first layer is being unpacked (others may still download).
    Unpacking,
}

pub type ProgressFn = Arc<dyn Fn(PullEvent) + Send + Sync>;

/// Pulls images into one namespace, one pull per reference at a time.
#[derive(Clone)]
pub struct Puller {
    ctd: Containerd,
    /// Registries (`host[:port]`) reached over plain HTTP besides loopback ones.
    insecure: Vec<String>,
    cluster: ClusterRegistryWatch,
    inflight: Arc<Mutex<HashMap<String, Arc<Mutex<()>>>>>,
    /// Where the content store is, asked of containerd once.
    content_root: Arc<tokio::sync::OnceCell<Option<std::path::PathBuf>>>,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller")
            .field("insecure", &self.insecure)
            .finish_non_exhaustive()
    }
}

impl Puller {
    pub fn new(ctd: Containerd, insecure: Vec<String>) -> Self {
        crate::link::tls::install_process_provider();
        Self {
            ctd,
            insecure,
            cluster: watch::channel(None).1,
            inflight: Arc::default(),
            content_root: Arc::default(),
        }
    }

    /// Pulls from `cluster`'s registry trust its CA and send its credential.
    #[must_use]
    pub fn with_cluster_registry(mut self, cluster: ClusterRegistryWatch) -> Self {
        self.cluster = cluster;
        self
    }

    /// The cluster registry when `reference` lives there.
    fn cluster_for(&self, reference: &ImageRef) -> Option<Arc<ClusterRegistry>> {
        self.cluster
            .borrow()
            .as_ref()
            .filter(|c| !c.addr.is_empty() && c.serves(reference.domain()))
            .cloned()
    }

    /// Why `project_id` may not use `reference`: an image of another
    /// project in the cluster registry ([`ClusterRegistry::foreign_project`]),
    /// checked before anything, the image already on the node or not.
    pub fn foreign_project(&self, reference: &ImageRef, project_id: &str) -> Option<String> {
        self.cluster_for(reference)?
            .refuses(reference.domain(), reference.path(), project_id)
    }

    /// Makes sure `reference` is present and unpacked (R-2 `EnsureImage`).
    pub async fn ensure(
        &self,
        reference: &ImageRef,
        credentials: &Credentials,
        progress: Option<ProgressFn>,
    ) -> Result<LocalImage, RuntimeError> {
        let key = reference.to_string();
        let gate = {
            let mut inflight = self.inflight.lock().await;
            Arc::clone(inflight.entry(key.clone()).or_default())
        };
        let result = {
            let _turn = gate.lock().await;
            self.ensure_locked(reference, credentials, progress).await
        };
        let mut inflight = self.inflight.lock().await;
        if Arc::strong_count(&gate) <= 2 {
            inflight.remove(&key);
        }
        result
    }

    async fn ensure_locked(
        &self,
        reference: &ImageRef,
        credentials: &Credentials,
        progress: Option<ProgressFn>,
    ) -> Result<LocalImage, RuntimeError> {
        if let Some(image) = get_local(&self.ctd, reference).await?
            && image.unpacked
        {
            return Ok(image);
        }
        let lease = Lease::create(&self.ctd, "pull", PULL_LEASE_TTL).await?;
        let result = self.pull(reference, credentials, &lease, progress).await;
        if let Err(e) = lease.release(&self.ctd).await {
            tracing::warn!(error = %e, "could not release the pull lease; it expires by itself");
        }
        result?;
        get_local(&self.ctd, reference)
            .await?
            .ok_or_else(|| fail(reference, "the image record vanished after the pull"))
    }

    /// Refuses, before a byte is fetched, a pull whose missing layers alone
    /// do not fit the free space of containerd's content store (under disk
    /// pressure, the pull that cannot succeed is not started). A store whose
    /// filesystem cannot be measured is not checked.
    async fn check_space(
        &self,
        reference: &ImageRef,
        layers: &[Descriptor],
    ) -> Result<(), RuntimeError> {
        let root = self
            .content_root
            .get_or_init(|| async { self.ctd.content_root().await.ok() })
            .await;
        let Some(root) = root else { return Ok(()) };
        let mut need = 0u64;
        for layer in layers {
            if !content::exists(&self.ctd, &layer.digest).await? {
                need += layer.size;
            }
        }
        let Ok(usage) = super::disk::Usage::of(root) else {
            return Ok(());
        };
        if need > usage.available_bytes {
            return Err(fail(
                reference,
                &format!(
                    "no space left on {} for this image: its layers need {} MiB, {} MiB free",
                    root.display(),
                    need.div_ceil(1 << 20),
                    usage.available_bytes >> 20
                ),
            ));
        }
        Ok(())
    }

    /// The cluster registry always speaks TLS, even on loopback; other
    /// loopback registries are dev ones, reached over plain HTTP.
    fn client_for(
        &self,
        reference: &ImageRef,
        cluster: Option<&ClusterRegistry>,
    ) -> Result<(Client, ManifestGet), RuntimeError> {
        let plain_http = cluster.is_none()
            && (is_loopback_registry(reference.domain())
                || self.insecure.iter().any(|r| r == reference.domain()));
        let manifests = ManifestGet::new(plain_http, cluster.map(|c| c.ca_pem.as_slice()))
            .map_err(|e| fail(reference, &e))?;
        let oci = Client::new(ClientConfig {
            protocol: if plain_http {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            extra_root_certificates: cluster
                .map(|c| {
                    vec![Certificate {
                        encoding: CertificateEncoding::Pem,
                        data: c.ca_pem.clone(),
                    }]
                })
                .unwrap_or_default(),
            connect_timeout: Some(Duration::from_secs(10)),
            read_timeout: Some(Duration::from_secs(60)),
            ..ClientConfig::default()
        });
        Ok((oci, manifests))
    }

    async fn pull(
        &self,
        reference: &ImageRef,
        credentials: &Credentials,
        lease: &Lease,
        progress: Option<ProgressFn>,
    ) -> Result<(), RuntimeError> {
        let ctd = &self.ctd;
        let began = std::time::Instant::now();
        let cluster = self.cluster_for(reference);
        let (client, manifests) = self.client_for(reference, cluster.as_deref())?;
        let ms = |at: std::time::Instant| {
            u64::try_from(at.duration_since(began).as_millis()).unwrap_or(u64::MAX)
        };
        tracing::debug!(target: "zattera::pull", client_ms = ms(std::time::Instant::now()), "registry client ready");
        // An explicit credential is the caller's; otherwise only the cluster
        // registry gets the node's (X-14: never another registry).
        let credentials = match (credentials, &cluster) {
            (Credentials::Anonymous, Some(c)) => &c.credentials,
            (given, _) => given,
        };
        let auth = match credentials {
            Credentials::Anonymous => RegistryAuth::Anonymous,
            Credentials::Basic { username, password } => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
        };
        let oref = registry_reference(reference);

        // The top object: what the reference names (an index or a manifest).
        let (top_bytes, top_digest) =
            fetch_manifest(&client, &manifests, &oref, &auth, reference, None).await?;
        if let Some(pinned) = reference.digest()
            && *pinned != top_digest
        {
            return Err(fail(
                reference,
                &format!("registry returned {top_digest}, not the pinned {pinned}"),
            ));
        }
        let top_media = media_type_of(&top_bytes);
        let mut parents: Vec<(Descriptor, Vec<u8>, HashMap<String, String>)> = Vec::new();
        let (manifest_bytes, manifest_desc) = if media::is_index(&top_media) {
            let index = ImageIndex::from_reader(&top_bytes[..])
                .map_err(|e| fail(reference, &format!("index {top_digest}: {e}")))?;
            let chosen = select_manifest(&index).ok_or_else(|| {
                fail(
                    reference,
                    &format!(
                        "no manifest for linux/{} in index {top_digest}",
                        super::descriptor::host_architecture()
                    ),
                )
            })?;
            let chosen = Descriptor::from_oci(chosen)?;
            let (bytes, digest) = fetch_manifest(
                &client,
                &manifests,
                &oref,
                &auth,
                reference,
                Some(&chosen.digest),
            )
            .await?;
            let labels = HashMap::from([(
                "containerd.io/gc.ref.content.m.0".to_owned(),
                chosen.digest.to_string(),
            )]);
            let top = Descriptor {
                media_type: top_media,
                digest: top_digest,
                size: top_bytes.len() as u64,
            };
            parents.push((top, top_bytes.to_vec(), labels));
            let desc = Descriptor {
                media_type: chosen.media_type,
                digest,
                size: bytes.len() as u64,
            };
            (bytes, desc)
        } else if media::is_manifest(&top_media) {
            let desc = Descriptor {
                media_type: top_media,
                digest: top_digest,
                size: top_bytes.len() as u64,
            };
            (top_bytes, desc)
        } else {
            return Err(fail(
                reference,
                &format!("unsupported manifest media type {top_media:?}"),
            ));
        };
        let target = parents
            .first()
            .map_or_else(|| manifest_desc.clone(), |p| p.0.clone());

        let manifest = ImageManifest::from_reader(&manifest_bytes[..]).map_err(|e| {
            fail(
                reference,
                &format!("manifest {}: {e}", manifest_desc.digest),
            )
        })?;
        let (config_desc, layers) = Descriptor::parts_of(&manifest)?;
        if let Some(p) = &progress {
            p(PullEvent::Resolved {
                manifest: manifest_desc.digest.clone(),
                layers: layers.len(),
                bytes: layers.iter().map(|l| l.size).sum(),
            });
        }
        self.check_space(reference, &layers).await?;

        // Config first (small, needed for the diff ids), then the layers in parallel.
        let config_bytes = fetch_small_blob(&client, &oref, reference, &config_desc).await?;
        let diff_ids = parse_diff_ids(&config_bytes)
            .map_err(|e| fail(reference, &format!("config {}: {e}", config_desc.digest)))?;
        // Each layer is unpacked as soon as it and every layer below it are
        // in, while the layers above it are still downloading.
        let mut stack = unpack::LayerStack::new(&layers, &diff_ids)?;
        let (arrived_tx, mut arrived_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
        let unpack_progress = progress.clone();
        let fetch_all = {
            let (layers, client, oref) = (&layers, &client, &oref);
            async move {
                futures::stream::iter(layers.iter().cloned().enumerate().map(|(i, layer)| {
                    let progress = progress.clone();
                    async move {
                        fetch_layer(ctd, lease, client, oref, reference, &layer, progress).await?;
                        tracing::debug!(target: "zattera::pull", layer = i, at_ms = ms(std::time::Instant::now()), "layer fetched");
                        Ok::<_, RuntimeError>(i)
                    }
                }))
                .buffer_unordered(PARALLEL_LAYERS)
                .try_for_each(|i| {
                    // The unpacker only ends early on an error, which ends this too.
                    let _ = arrived_tx.send(i);
                    futures::future::ready(Ok(()))
                })
                .await
            }
        };
        let unpack_in_order = async {
            let mut arrived = vec![false; layers.len()];
            let mut announced = false;
            while stack.unpacked() < layers.len() {
                let Some(i) = arrived_rx.recv().await else {
                    // Every fetch is done: the fetch side's result decides.
                    break;
                };
                arrived[i] = true;
                while arrived.get(stack.unpacked()).copied().unwrap_or(false) {
                    if !announced {
                        if let Some(p) = &unpack_progress {
                            p(PullEvent::Unpacking);
                        }
                        announced = true;
                    }
                    let layer = stack.unpacked();
                    let from = ms(std::time::Instant::now());
                    stack.unpack_next(ctd, lease).await?;
                    tracing::debug!(target: "zattera::pull", layer, from_ms = from, at_ms = ms(std::time::Instant::now()), "layer unpacked");
                }
            }
            Ok::<_, RuntimeError>(())
        };
        futures::try_join!(fetch_all, unpack_in_order)?;
        if stack.unpacked() < layers.len() {
            return Err(fail(reference, "a layer was fetched but never unpacked"));
        }
        let chain_id = stack.top().clone();
        content::ensure_blob(ctd, lease, &config_desc, std::io::Cursor::new(config_bytes)).await?;
        let manifest_labels = content::manifest_gc_labels(&config_desc, &layers);
        content::ensure_blob(
            ctd,
            lease,
            &manifest_desc,
            std::io::Cursor::new(manifest_bytes.to_vec()),
        )
        .await?;
        content::add_labels(ctd, &manifest_desc.digest, manifest_labels).await?;
        for (desc, bytes, labels) in parents {
            content::ensure_blob(ctd, lease, &desc, std::io::Cursor::new(bytes)).await?;
            content::add_labels(ctd, &desc.digest, labels).await?;
        }

        content::add_labels(
            ctd,
            &config_desc.digest,
            HashMap::from([(LABEL_GC_SNAPSHOT.to_owned(), chain_id.to_string())]),
        )
        .await?;
        put_image_record(ctd, reference, &target).await?;
        tracing::debug!(target: "zattera::pull", at_ms = ms(std::time::Instant::now()), "image recorded");
        Ok(())
    }
}

/// The registry client's form of `reference`, built from its parts: it is
/// already validated, and parsing it again compiles a large regex (~40 ms of
/// a CLI pull).
fn registry_reference(reference: &ImageRef) -> Reference {
    let (domain, path) = (reference.domain().to_owned(), reference.path().to_owned());
    match (reference.tag(), reference.digest()) {
        (Some(tag), Some(digest)) => {
            Reference::with_tag_and_digest(domain, path, tag.to_owned(), digest.to_string())
        }
        (None, Some(digest)) => Reference::with_digest(domain, path, digest.to_string()),
        (tag, None) => Reference::with_tag(domain, path, tag.unwrap_or("latest").to_owned()),
    }
}

fn fail(reference: &ImageRef, reason: &str) -> RuntimeError {
    RuntimeError::Pull {
        reference: reference.to_string(),
        reason: reason.to_owned(),
    }
}

fn is_loopback_registry(domain: &str) -> bool {
    let host = domain.rsplit_once(':').map_or(domain, |(h, _)| h);
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The media type a manifest declares (or implies by its shape).
fn media_type_of(bytes: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
    if let Some(m) = v.get("mediaType").and_then(|m| m.as_str()) {
        return m.to_owned();
    }
    if v.get("manifests").is_some() {
        media::OCI_INDEX.to_owned()
    } else {
        media::OCI_MANIFEST.to_owned()
    }
}

async fn fetch_manifest(
    client: &Client,
    manifests: &ManifestGet,
    oref: &Reference,
    auth: &RegistryAuth,
    reference: &ImageRef,
    digest: Option<&Digest>,
) -> Result<(bytes::Bytes, Digest), RuntimeError> {
    let target = match digest {
        Some(d) => Reference::with_digest(
            oref.registry().to_owned(),
            oref.repository().to_owned(),
            d.to_string(),
        ),
        None => oref.clone(),
    };
    let bytes = manifests
        .get(client, &target, auth, &ACCEPTED)
        .await
        .map_err(|e| fail(reference, &e))?;
    // Verify ourselves: the registry's Docker-Content-Digest header is not proof.
    let actual = Digest::of(&bytes);
    if let Some(d) = digest
        && *d != actual
    {
        return Err(fail(
            reference,
            &format!("manifest {d} does not match its content ({actual})"),
        ));
    }
    Ok((bytes, actual))
}

async fn fetch_small_blob(
    client: &Client,
    oref: &Reference,
    reference: &ImageRef,
    desc: &Descriptor,
) -> Result<Vec<u8>, RuntimeError> {
    if desc.size > content::MAX_METADATA_BLOB {
        return Err(fail(
            reference,
            &format!("config {} is {} bytes", desc.digest, desc.size),
        ));
    }
    // Streamed, and cut at the declared size (45.3): a body that goes on
    // is never held whole.
    let stream = client
        .pull_blob_stream(oref, desc.digest.as_str())
        .await
        .map_err(|e| {
            fail(
                reference,
                &format!("config {}: {}", desc.digest, describe(&e)),
            )
        })?;
    let mut data = Vec::new();
    {
        use tokio::io::AsyncReadExt;
        let reader = tokio_util::io::StreamReader::new(stream.stream);
        reader
            .take(desc.size.saturating_add(1))
            .read_to_end(&mut data)
            .await
            .map_err(|e| fail(reference, &format!("config {}: {e}", desc.digest)))?;
    }
    if data.len() as u64 > desc.size {
        return Err(fail(
            reference,
            &format!(
                "config {} is longer than its declared {} bytes",
                desc.digest, desc.size
            ),
        ));
    }
    if Digest::of(&data) != desc.digest {
        return Err(fail(
            reference,
            &format!("config {} does not match its content", desc.digest),
        ));
    }
    Ok(data)
}

async fn fetch_layer(
    ctd: &Containerd,
    lease: &Lease,
    client: &Client,
    oref: &Reference,
    reference: &ImageRef,
    layer: &Descriptor,
    progress: Option<ProgressFn>,
) -> Result<(), RuntimeError> {
    if content::exists(ctd, &layer.digest).await? {
        lease.hold(ctd, "content", layer.digest.as_str()).await?;
        if let Some(p) = &progress {
            p(PullEvent::LayerDone {
                digest: layer.digest.clone(),
                downloaded: false,
            });
        }
        return Ok(());
    }
    let stream = client
        .pull_blob_stream(oref, layer.digest.as_str())
        .await
        .map_err(|e| {
            fail(
                reference,
                &format!("layer {}: {}", layer.digest, describe(&e)),
            )
        })?;
    let reader = tokio_util::io::StreamReader::new(stream.stream);
    let counted = Counting {
        inner: reader,
        digest: layer.digest.clone(),
        progress: progress.clone(),
        pending: 0,
        read: 0,
        declared: layer.size,
    };
    // containerd verifies size and digest at commit; a corrupt blob is never stored.
    content::ensure_blob(ctd, lease, layer, counted)
        .await
        .map_err(|e| fail(reference, &format!("layer {}: {e}", layer.digest)))?;
    if let Some(p) = &progress {
        p(PullEvent::LayerDone {
            digest: layer.digest.clone(),
            downloaded: true,
        });
    }
    Ok(())
}

/// Reports bytes read, in steps of 1 MiB so progress costs nothing, and
/// fails once more than the declared size has come (45.3): an endless body
/// would otherwise fill the disk before containerd refuses it at commit.
struct Counting<R> {
    inner: R,
    digest: Digest,
    progress: Option<ProgressFn>,
    pending: u64,
    read: u64,
    declared: u64,
}

impl<R: AsyncRead + Unpin> AsyncRead for Counting<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        self.read += read;
        if self.read > self.declared {
            return Poll::Ready(Err(std::io::Error::other(format!(
                "longer than its declared {} bytes",
                self.declared
            ))));
        }
        self.pending += read;
        if (self.pending >= 1 << 20 || (read == 0 && self.pending > 0))
            && let Some(p) = &self.progress
        {
            p(PullEvent::LayerBytes {
                digest: self.digest.clone(),
                bytes: self.pending,
            });
            self.pending = 0;
        }
        poll
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn registry_reference_matches_the_parsed_one() {
        for name in [
            "busybox",
            "127.0.0.1:5999/b/big:v1",
            "ghcr.io/a/b@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "localhost:5000/x/y:t@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            let ours: ImageRef = name.parse().unwrap();
            let parsed: Reference = ours.to_string().parse().unwrap();
            assert_eq!(registry_reference(&ours), parsed, "{name}");
        }
    }

    #[test]
    fn loopback_registries_use_plain_http() {
        assert!(is_loopback_registry("localhost:5000"));
        assert!(is_loopback_registry("127.0.0.1:5000"));
        assert!(is_loopback_registry("127.8.9.1"));
        assert!(!is_loopback_registry("registry.example:5000"));
        assert!(!is_loopback_registry("10.0.0.1:5000"));
    }

    #[test]
    fn media_type_from_content() {
        assert_eq!(
            media_type_of(
                br#"{"mediaType":"application/vnd.docker.distribution.manifest.v2+json"}"#
            ),
            media::DOCKER_MANIFEST
        );
        assert_eq!(
            media_type_of(br#"{"schemaVersion":2,"manifests":[]}"#),
            media::OCI_INDEX
        );
        assert_eq!(
            media_type_of(br#"{"schemaVersion":2,"layers":[]}"#),
            media::OCI_MANIFEST
        );
    }

    #[test]
    fn credentials_never_print_the_password() {
        let c = Credentials::Basic {
            username: "u".into(),
            password: "s3cr3t-pw".into(),
        };
        let cluster = ClusterRegistry {
            addr: "10.90.0.1:5000".into(),
            ca_pem: Vec::new(),
            credentials: c.clone(),
            also_at: Vec::new(),
        };
        for shown in [
            format!("{c:?}"),
            format!("{c:#?}"),
            format!("{cluster:?}"),
            format!("{cluster:#?}"),
        ] {
            assert!(
                shown.contains('u') && !shown.contains("s3cr3t-pw"),
                "{shown}"
            );
        }
        // A pull's errors and log are checked against a real registry in
        // tests/pull.rs (basic_auth_is_required_and_used).
    }
}
