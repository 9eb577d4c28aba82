//! Control's build-source endpoint (`GET /internal/blobs/<digest>`,
//! wire.md §0.4) for build tests: HTTPS with a cluster-CA certificate,
//! requiring the client certificate of a node. Serves what it is given;
//! a path it does not know is a 404.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use zattera_agent::link::tls::{self, ClientAuth};

pub struct BlobServer {
    pub addr: std::net::SocketAddr,
    blobs: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    /// Requests served (paths), to tell that a fetch happened.
    pub served: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl BlobServer {
    /// Serves with `identity` (chain PEM, key PEM), trusting `ca_pem` for
    /// client certificates.
    pub async fn start(identity: (&str, &str), ca_pem: &str) -> Self {
        let mut cfg = tls::server(
            identity.0.as_bytes(),
            identity.1.as_bytes(),
            ClientAuth::Required(ca_pem.as_bytes()),
        )
        .unwrap();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let blobs: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let served: Arc<Mutex<Vec<String>>> = Arc::default();
        let (b, s) = (Arc::clone(&blobs), Arc::clone(&served));
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, blobs, served) = (acceptor.clone(), Arc::clone(&b), Arc::clone(&s));
                tokio::spawn(async move {
                    let Ok(mut stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
                        if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let text = String::from_utf8_lossy(&head);
                    let path = text.split_whitespace().nth(1).unwrap_or("").to_owned();
                    served.lock().unwrap().push(path.clone());
                    let body = blobs.lock().unwrap().get(&path).cloned();
                    let (status, body) = match body {
                        Some(b) => ("200 OK", b),
                        None => ("404 Not Found", b"no such blob".to_vec()),
                    };
                    let head = format!(
                        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(&body).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self {
            addr,
            blobs,
            served,
            task,
        }
    }

    /// Serves `bytes` at its digest's path; the URL a RunBuild names.
    pub fn put(&self, bytes: Vec<u8>) -> String {
        let hex = hex::encode(Sha256::digest(&bytes));
        self.put_at(&format!("/internal/blobs/sha256:{hex}"), bytes)
    }

    /// Serves `bytes` at `path` (which may name another digest).
    pub fn put_at(&self, path: &str, bytes: Vec<u8>) -> String {
        self.blobs.lock().unwrap().insert(path.to_owned(), bytes);
        format!("https://127.0.0.1:{}{path}", self.addr.port())
    }
}

impl Drop for BlobServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A tar.gz of `files` (path, contents), as a build context.
pub fn context(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        builder.append_data(&mut h, path, *data).unwrap();
    }
    builder.into_inner().unwrap().finish().unwrap()
}
