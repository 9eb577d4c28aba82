//! Client-side pull from a real registry (Debian's docker-registry on
//! 127.0.0.1, filled with skopeo) into the rig's containerd.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
mod support;

use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::{Arc, Mutex};

use support::registry::Registry;
use support::{list_snapshots, on_rig, rig, with_namespace};
use zattera_agent::runtime::content;
use zattera_agent::runtime::pull::{Credentials, PullEvent, Puller};
use zattera_agent::runtime::{Containerd, ImageRef};

#[tokio::test]
async fn anonymous_pull_stores_unpacks_and_reports_progress() {
    let Some(rig) = rig() else { return };
    let registry = Registry::start(None);
    let reference = push_test_image(&registry, &rig, "zattera/busybox:test");
    with_namespace(&rig, "pull-anon", |ctd, _rig| async move {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let puller = Puller::new(ctd.clone(), vec![]);
        let image = puller
            .ensure(
                &reference,
                &Credentials::Anonymous,
                Some(Arc::new(move |e| sink.lock().unwrap().push(e))),
            )
            .await
            .expect("pull");
        assert!(image.unpacked);
        assert!(support::image_exists(&ctd, &reference.to_string()).await);
        assert!(
            list_snapshots(&ctd)
                .await
                .contains(&image.chain_id.to_string())
        );
        assert_eq!(support::lease_count(&ctd).await, 0);
        let events = events.lock().unwrap().clone();
        assert!(
            matches!(events[0], PullEvent::Resolved { layers: 1, .. }),
            "{events:?}"
        );
        assert!(
            events
                .iter()
                .any(|e| matches!(e, PullEvent::LayerBytes { bytes, .. } if *bytes > 0))
        );
        assert!(events.contains(&PullEvent::Unpacking));

        // Present images are never refreshed: a second ensure needs no registry.
        drop(registry);
        let again = puller
            .ensure(&reference, &Credentials::Anonymous, None)
            .await
            .expect("present");
        assert_eq!(again.chain_id, image.chain_id);
    })
    .await;
}

/// Credentials are required and used, and neither password (nor its
/// base64 in an Authorization header) shows in an error, its Debug form or
/// anything the pull logs, down to TRACE.
#[tokio::test]
async fn basic_auth_is_required_and_used() {
    let Some(rig) = rig() else { return };
    let (user, right_pw, wrong_pw) = ("zuser", "zpass-9d1e", "wrong-pw-7f3a");
    let registry = Registry::start(Some((user, right_pw)));
    let reference = push_test_image(&registry, &rig, "private/busybox:1");
    let log = LogBuffer::default();
    let _logging = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(log.clone())
            .finish(),
    );
    with_namespace(&rig, "pull-auth", |ctd, _rig| async move {
        let puller = Puller::new(ctd.clone(), vec![]);
        let anon = puller
            .ensure(&reference, &Credentials::Anonymous, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            anon.contains(&reference.to_string()),
            "names the reference: {anon}"
        );
        let wrong = Credentials::Basic {
            username: user.into(),
            password: wrong_pw.into(),
        };
        let err = puller.ensure(&reference, &wrong, None).await.unwrap_err();
        let shown = format!("{err} | {err:?} | {err:#?} | {wrong:?}");
        assert!(shown.contains(&reference.to_string()), "{shown}");
        assert!(!support::image_exists(&ctd, &reference.to_string()).await);

        let right = Credentials::Basic {
            username: user.into(),
            password: right_pw.into(),
        };
        let image = puller
            .ensure(&reference, &right, None)
            .await
            .expect("pull with credentials");
        assert!(image.unpacked);
        let logged = log.text();
        assert!(
            logged.contains("registry client ready"),
            "the log was captured: {logged}"
        );
        for pw in [wrong_pw, right_pw] {
            let basic = base64_of(&format!("{user}:{pw}"));
            for (what, text) in [("error", &shown), ("log", &logged)] {
                assert!(!text.contains(pw), "the password in the {what}: {text}");
                assert!(
                    !text.contains(&basic),
                    "the Authorization in the {what}: {text}"
                );
            }
        }
    })
    .await;
}

/// What a test's tracing subscriber wrote.
#[derive(Clone, Default)]
struct LogBuffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl LogBuffer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = Self;
    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

fn base64_of(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[tokio::test]
async fn an_index_with_two_platforms_resolves_to_this_one() {
    let Some(rig) = rig() else { return };
    let registry = Registry::start(None);
    let multi = rig.images.join("busybox-multi-oci.tar");
    let reference: ImageRef = registry
        .push(&multi, Some("multi"), "zattera/multi:v1")
        .parse()
        .unwrap();
    with_namespace(&rig, "pull-multi", |ctd, _rig| async move {
        let image = Puller::new(ctd.clone(), vec![])
            .ensure(&reference, &Credentials::Anonymous, None)
            .await
            .expect("pull");
        assert!(zattera_agent::runtime::descriptor::media::is_index(
            &image.target.media_type
        ));
        let arch = image.config.architecture().to_string();
        assert_eq!(
            arch,
            zattera_agent::runtime::descriptor::host_architecture()
        );
    })
    .await;
}

#[tokio::test]
async fn a_corrupted_blob_is_refused_and_leaves_nothing() {
    let Some(rig) = rig() else { return };
    let registry = Registry::start(None);
    let reference = push_test_image(&registry, &rig, "zattera/corrupt:1");
    // The layer is the largest blob; flip a byte in the registry's copy.
    let layer_digest = registry.largest_blob();
    let file = registry.blob_file(&layer_digest);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut b = [0u8];
    f.seek(SeekFrom::Start(1000)).unwrap();
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(1000)).unwrap();
    f.write_all(&[b[0] ^ 0xff]).unwrap();
    drop(f);

    with_namespace(&rig, "pull-corrupt", |ctd, _rig| async move {
        let err = pull_error(&ctd, &reference).await;
        assert!(
            err.contains(&reference.to_string()) && err.contains(&layer_digest),
            "{err}"
        );
        assert!(
            !support::image_exists(&ctd, &reference.to_string()).await,
            "no image record"
        );
        assert!(
            !content::exists(&ctd, &layer_digest.parse().unwrap())
                .await
                .unwrap(),
            "no bad blob"
        );
        assert!(list_snapshots(&ctd).await.is_empty());
        assert_eq!(support::lease_count(&ctd).await, 0);
    })
    .await;
}

#[tokio::test]
async fn concurrent_pulls_of_one_reference_share_the_work() {
    let Some(rig) = rig() else { return };
    let registry = Registry::start(None);
    let reference = push_test_image(&registry, &rig, "zattera/busybox:shared");
    with_namespace(&rig, "pull-shared", |ctd, _rig| async move {
        let downloads = Arc::new(Mutex::new(0));
        let puller = Puller::new(ctd.clone(), vec![]);
        let pull = |puller: Puller, reference: ImageRef, downloads: Arc<Mutex<i32>>| async move {
            let progress = Arc::new(move |e| {
                if let PullEvent::LayerDone {
                    downloaded: true, ..
                } = e
                {
                    *downloads.lock().unwrap() += 1;
                }
            });
            puller
                .ensure(&reference, &Credentials::Anonymous, Some(progress))
                .await
        };
        let (a, b, c) = Box::pin(async {
            tokio::join!(
                pull(puller.clone(), reference.clone(), Arc::clone(&downloads)),
                pull(puller.clone(), reference.clone(), Arc::clone(&downloads)),
                pull(puller.clone(), reference.clone(), Arc::clone(&downloads)),
            )
        })
        .await;
        assert_eq!(a.unwrap().chain_id, b.unwrap().chain_id);
        assert!(c.is_ok());
        assert_eq!(
            *downloads.lock().unwrap(),
            1,
            "the layer is downloaded once"
        );
    })
    .await;
}

#[tokio::test]
async fn missing_images_and_dead_registries_name_the_reference() {
    let Some(rig) = rig() else { return };
    let registry = Registry::start(None);
    let missing: ImageRef = format!("{}/zattera/nope:1", registry.addr).parse().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead: ImageRef = format!("127.0.0.1:{port}/zattera/nope:1").parse().unwrap();
    with_namespace(&rig, "pull-missing", |ctd, _rig| async move {
        let puller = Puller::new(ctd.clone(), vec![]);
        for reference in [missing, dead] {
            let err = puller
                .ensure(&reference, &Credentials::Anonymous, None)
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains(&reference.to_string()), "{err}");
        }
        assert_eq!(support::lease_count(&ctd).await, 0);
    })
    .await;
}

/// A disk that fills mid-pull: the pull fails naming the reference and the
/// cause, and leaves no image record, no lease and no partial ingest
/// holding the space.
#[tokio::test]
async fn a_full_disk_fails_the_pull_and_leaves_no_partial_ingest() {
    use containerd_client::services::v1::ListStatusesRequest;
    let Some(rig) = rig() else { return };
    let dir = tempfile::tempdir().unwrap();
    // Two incompressible 12 MiB layers for a 16 MiB content store.
    let big = rig.big_archive(dir.path());
    let registry = Registry::start(None);
    let reference: ImageRef = registry.push(&big, None, "zattera/big:1").parse().unwrap();
    let private = support::private::PrivateContainerd::start_with_content_limit(16);
    let ctd = zattera_agent::runtime::Containerd::connect(
        &private.socket,
        support::unique_namespace("pull-full"),
    )
    .await
    .unwrap();
    let err = pull_error(&ctd, &reference).await;
    assert!(
        err.contains(&reference.to_string()) && err.contains("no space left"),
        "{err}"
    );
    assert!(!support::image_exists(&ctd, &reference.to_string()).await);
    assert_eq!(support::lease_count(&ctd).await, 0);
    let ingests = ctd
        .content()
        .list_statuses(ctd.request(ListStatusesRequest { filters: vec![] }))
        .await
        .unwrap()
        .into_inner()
        .statuses;
    assert!(ingests.is_empty(), "partial ingests left: {ingests:?}");
}

/// Two writers of one blob at once (two images sharing a layer, pulled side
/// by side): both end with the blob in the store. They used to share the
/// ingest ref and abort each other's write, in step on every retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_of_one_blob_both_succeed() {
    on_rig("pull-twice", |ctd, _rig| async move {
        use tokio::io::AsyncWriteExt;
        use zattera_agent::runtime::descriptor::Descriptor;
        use zattera_agent::runtime::digest::Digest;
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        let desc = Descriptor {
            media_type: "application/octet-stream".into(),
            digest: Digest::of(&data),
            size: data.len() as u64,
        };
        let lease = zattera_agent::runtime::lease::Lease::create(
            &ctd,
            "two-writers",
            std::time::Duration::from_secs(300),
        )
        .await
        .unwrap();
        // Each source drips its copy in 256 KiB steps, so the writes overlap.
        let slow = |data: Vec<u8>| {
            let (mut tx, rx) = tokio::io::duplex(64 << 10);
            tokio::spawn(async move {
                for chunk in data.chunks(256 << 10) {
                    if tx.write_all(chunk).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            });
            rx
        };
        let (a, b) = tokio::join!(
            content::ensure_blob(&ctd, &lease, &desc, slow(data.clone())),
            content::ensure_blob(&ctd, &lease, &desc, slow(data.clone())),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(a ^ b, "exactly one of them writes the blob: {a} {b}");
        assert!(content::exists(&ctd, &desc.digest).await.unwrap());
    })
    .await;
}

/// Pushes the test image to `registry` as `name`; returns its reference.
fn push_test_image(registry: &Registry, rig: &support::Rig, name: &str) -> ImageRef {
    registry
        .push(&rig.oci_archive(), None, name)
        .parse()
        .unwrap()
}

/// Pulls `reference` anonymously, which must fail; returns the error text.
async fn pull_error(ctd: &Containerd, reference: &ImageRef) -> String {
    Puller::new(ctd.clone(), vec![])
        .ensure(reference, &Credentials::Anonymous, None)
        .await
        .unwrap_err()
        .to_string()
}

/// [`pull_error`], where the pull must also end within a minute.
async fn pull_error_within_a_minute(ctd: &Containerd, reference: &ImageRef) -> String {
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        pull_error(ctd, reference),
    )
    .await
    .expect("the pull ended")
}

/// Reads an HTTP request's head from `conn`; its first line, or `None`
/// when the peer goes away first.
async fn request_line(conn: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut req = Vec::new();
    let mut buf = [0u8; 4096];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&req);
    Some(head.lines().next().unwrap_or_default().to_owned())
}

/// Issue 45.3, attack: a registry whose layer body never ends (here: 64 MiB
/// for a layer that declares 1 KiB, then it stops). The old pull read it
/// all into containerd's ingest, filling the disk, before the commit
/// refused the size; now the read stops past the declared size, and the
/// pull fails naming it.
#[tokio::test]
async fn a_layer_longer_than_declared_is_cut_off() {
    use sha2::Digest as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::AsyncWriteExt;
    let Some(rig) = rig() else { return };
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:0000000000000000000000000000000000000000000000000000000000000000"]},"config":{}}"#.to_vec();
    let config_digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&config)));
    let layer_digest = format!("sha256:{}", "ab".repeat(32));
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{layer_digest}","size":1024}}]}}"#,
        config.len()
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let sent_by_server = Arc::clone(&sent);
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let (manifest, config, layer, sent) = (
                manifest.clone(),
                config.clone(),
                layer_digest.clone(),
                Arc::clone(&sent_by_server),
            );
            tokio::spawn(async move {
                let Some(line) = request_line(&mut conn).await else {
                    return;
                };
                let reply = |ctype: &str, body: &[u8]| {
                    let mut r = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    r.extend_from_slice(body);
                    r
                };
                if line.contains("/manifests/") {
                    let _ = conn
                        .write_all(&reply(
                            "application/vnd.oci.image.manifest.v1+json",
                            manifest.as_bytes(),
                        ))
                        .await;
                } else if line.contains(&format!("/blobs/{layer}")) {
                    // No length: the body ends when the server closes, after 64 MiB.
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n")
                        .await;
                    let chunk = vec![b'x'; 64 * 1024];
                    for _ in 0..1024 {
                        if conn.write_all(&chunk).await.is_err() {
                            break;
                        }
                        sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    }
                } else if line.contains("/blobs/") {
                    let _ = conn
                        .write_all(&reply("application/octet-stream", &config))
                        .await;
                } else {
                    let _ = conn.write_all(&reply("application/json", b"{}")).await;
                }
                let _ = conn.shutdown().await;
            });
        }
    });
    let reference: ImageRef = format!("{addr}/evil/endless:1").parse().unwrap();
    with_namespace(&rig, "pull-endless", |ctd, _rig| async move {
        let err = pull_error_within_a_minute(&ctd, &reference).await;
        assert!(err.contains("declared 1024 bytes"), "{err}");
        assert!(
            sent.load(Ordering::Relaxed) < 16 << 20,
            "the pull read {} bytes of a 1 KiB layer",
            sent.load(Ordering::Relaxed)
        );
        assert_eq!(support::lease_count(&ctd).await, 0);
    })
    .await;
    server.abort();
}

/// A registry whose manifest never ends (256 MiB with no length, then it
/// stops). oci-client read a manifest whole, so the old pull held all of it
/// (its peak memory grew past 256 MiB); now the read stops past 4 MiB and
/// the pull fails naming the cap.
#[tokio::test]
async fn an_endless_manifest_is_cut_off() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::AsyncWriteExt;
    let Some(rig) = rig() else { return };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let sent_by_server = Arc::clone(&sent);
    let server = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let sent = Arc::clone(&sent_by_server);
            tokio::spawn(async move {
                let Some(line) = request_line(&mut conn).await else {
                    return;
                };
                if line.contains("/manifests/") {
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nConnection: close\r\n\r\n{\"schemaVersion\":2,\"annotations\":{\"a\":\"")
                        .await;
                    let chunk = vec![b'x'; 64 * 1024];
                    for _ in 0..4096 {
                        if conn.write_all(&chunk).await.is_err() {
                            break;
                        }
                        sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    }
                } else {
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
                        )
                        .await;
                }
                let _ = conn.shutdown().await;
            });
        }
    });
    let reference: ImageRef = format!("{addr}/evil/endless-manifest:1").parse().unwrap();
    with_namespace(&rig, "pull-endless-manifest", |ctd, _rig| async move {
        let before = support::peak_rss();
        let err = pull_error_within_a_minute(&ctd, &reference).await;
        let grew = support::peak_rss().saturating_sub(before);
        eprintln!(
            "read {} MiB of the manifest; peak memory grew {} MiB",
            sent.load(Ordering::Relaxed) >> 20,
            grew >> 20
        );
        assert!(err.contains("larger than 4194304 bytes"), "{err}");
        assert!(
            sent.load(Ordering::Relaxed) < 32 << 20,
            "the pull read {} bytes of a manifest",
            sent.load(Ordering::Relaxed)
        );
        assert!(
            grew < 64 << 20,
            "the pull's peak memory grew by {} MiB",
            grew >> 20
        );
    })
    .await;
    server.abort();
}

/// 57.7: the cluster registry runs on every control node, and an image's
/// reference names the one that built it: the node's credential and the
/// cluster CA hold at every control peer's address (`also_at`, from the
/// peer sets), not only at the join's `registry_addr`.
#[tokio::test]
async fn the_cluster_registry_grant_holds_at_every_control_node() {
    use zattera_agent::runtime::pull::ClusterRegistry;
    let Some(rig) = rig() else { return };
    let ca = control_plane::TestCa::new("cluster");
    let (chain, key) = ca.server_identity();
    let registry = Registry::start_with(Some(("node-n1", "cluster-pw")), Some((&chain, &key)));
    let reference = push_test_image(&registry, &rig, "proj/app:b1");
    with_namespace(&rig, "pull-controls", |ctd, _rig| async move {
        // The join named the leader's registry; this image was built on
        // another control node (here: the rig's registry).
        let grant = ClusterRegistry {
            addr: "10.90.0.1:5000".into(),
            ca_pem: ca.pem.clone().into_bytes(),
            credentials: Credentials::Basic {
                username: "node-n1".into(),
                password: "cluster-pw".into(),
            },
            also_at: Vec::new(),
        };
        let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(grant)));
        let puller = Puller::new(ctd.clone(), vec![]).with_cluster_registry(rx);
        let refused = puller
            .ensure(&reference, &Credentials::Anonymous, None)
            .await
            .unwrap_err();
        assert!(
            refused.to_string().contains(&reference.to_string()),
            "{refused}"
        );
        // A peer set names that control node: the grant holds there too.
        tx.send_modify(|g| {
            Arc::make_mut(g.as_mut().unwrap()).also_at = vec![registry.addr.to_string()];
        });
        let image = puller
            .ensure(&reference, &Credentials::Anonymous, None)
            .await
            .expect("a pull from another control node's registry");
        assert!(image.unpacked);
    })
    .await;
}
