//! TLS for the control hops (wire.md §8), on rustls with the ring provider.
//!
//! tonic's own TLS layer cannot pin a CA by hash, so every hop dials through
//! [`connect`] with a rustls config built here: the join hop trusts the CA
//! pinned by the token; the sync and route hops present the node certificate
//! and trust only the cluster CA; the node API server requires a client
//! certificate of the cluster CA carrying a `zattera://node/` identity.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use sha2::{Digest, Sha256};
use tonic::transport::{Channel, Endpoint};

/// The URI SAN prefix that names a node (wire.md §8).
pub const NODE_URI_PREFIX: &str = "zattera://node/";

/// What went wrong building a TLS configuration or a channel.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what}: no PEM certificate found")]
    NoCertificate { what: &'static str },
    #[error("{what}: not a PEM certificate: {source}")]
    BadCertificate {
        what: &'static str,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{what}: not a PEM private key: {source}")]
    BadKey {
        what: &'static str,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{what}: {source}")]
    Rustls {
        what: &'static str,
        source: rustls::Error,
    },
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("address {addr:?}: expected host:port")]
    BadAddress { addr: String },
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: String,
        source: tonic::transport::Error,
    },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Installs ring as the process's rustls provider, which reqwest's clients
/// use (the agent's own TLS configurations name theirs). `main` does it
/// first of all, so that no client is built before it; the constructors
/// that build such clients call it too, for the library's other users
/// (tests, benches). Idempotent.
pub fn install_process_provider() {
    // Err: one is installed already, which is the point.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Lowercase hex SHA-256 of a DER certificate: the join token's CA pin.
pub fn pin_of(der: &[u8]) -> String {
    hex::encode(Sha256::digest(der))
}

/// Every certificate in a PEM text.
pub fn certs_from_pem(
    what: &'static str,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::BadCertificate { what, source })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { what });
    }
    Ok(certs)
}

fn key_from_pem(what: &'static str, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|source| TlsError::BadKey { what, source })
}

fn roots(ca_pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certs_from_pem("cluster CA", ca_pem)? {
        store.add(cert).map_err(|source| TlsError::Rustls {
            what: "cluster CA",
            source,
        })?;
    }
    Ok(store)
}

/// The node's key pair and certificate, with the cluster CA, all PEM.
#[derive(Clone)]
pub struct NodeTls {
    pub key_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub ca_pem: Vec<u8>,
}

impl fmt::Debug for NodeTls {
    // The private key stays out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeTls").finish_non_exhaustive()
    }
}

/// The node identity as it is now; a renewal (control's `renew`) sends the
/// next one, and every connection made after that presents it.
pub type CurrentTls = tokio::sync::watch::Receiver<Arc<NodeTls>>;

/// A [`CurrentTls`] that never changes.
pub fn fixed(node: NodeTls) -> CurrentTls {
    tokio::sync::watch::channel(Arc::new(node)).1
}

/// Resolves once `current` holds a new identity; never when none can come.
pub async fn renewed(current: &mut CurrentTls) {
    if current.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// `notBefore` and `notAfter` of the first certificate in `cert_pem`.
pub fn validity_of(cert_pem: &[u8]) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = certs_from_pem("certificate", cert_pem)
        .ok()?
        .into_iter()
        .next()?;
    let (_, cert) = X509Certificate::from_der(&der).ok()?;
    let at = |t: x509_parser::time::ASN1Time| {
        let secs = u64::try_from(t.timestamp()).unwrap_or(0);
        std::time::UNIX_EPOCH + Duration::from_secs(secs)
    };
    Some((
        at(cert.validity().not_before),
        at(cert.validity().not_after),
    ))
}

/// Client config for the join hop: accept the server iff its chain holds
/// the pinned certificate and the leaf chains to it (or is it).
pub fn pinned_client(pin: &str) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let verifier = PinVerifier {
        pin: pin.to_ascii_lowercase(),
        algs: provider.signature_verification_algorithms,
    };
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "join TLS",
            source,
        })?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// Client config for sync and routes: the node certificate out, only the
/// cluster CA trusted, the server name checked against the dialed host.
pub fn node_client(node: &NodeTls) -> Result<ClientConfig, TlsError> {
    let certs = certs_from_pem("node certificate", &node.cert_pem)?;
    let key = key_from_pem("node key", &node.key_pem)?;
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "node TLS",
            source,
        })?
        .with_root_certificates(roots(&node.ca_pem)?)
        .with_client_auth_cert(certs, key)
        .map_err(|source| TlsError::Rustls {
            what: "node certificate and key",
            source,
        })?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// Who a server lets in.
#[derive(Debug, Clone, Copy)]
pub enum ClientAuth<'a> {
    /// No client certificate asked for.
    None,
    /// A certificate is verified against this CA (PEM) when one is given.
    Optional(&'a [u8]),
    /// A certificate chaining to this CA (PEM) is required.
    Required(&'a [u8]),
}

/// Server config presenting `chain_pem` + `key_pem`; identities are checked
/// per call from [`PeerIdentity`].
pub fn server(
    chain_pem: &[u8],
    key_pem: &[u8],
    clients: ClientAuth<'_>,
) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "server TLS",
            source,
        })?;
    let verifier = |ca: &[u8]| {
        Ok::<_, TlsError>(rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots(ca)?),
            Arc::clone(&provider),
        ))
    };
    let builder = match clients {
        ClientAuth::None => builder.with_no_client_auth(),
        ClientAuth::Optional(ca) => {
            builder.with_client_cert_verifier(verifier(ca)?.allow_unauthenticated().build()?)
        }
        ClientAuth::Required(ca) => builder.with_client_cert_verifier(verifier(ca)?.build()?),
    };
    let mut cfg = builder
        .with_single_cert(
            certs_from_pem("server certificate", chain_pem)?,
            key_from_pem("server key", key_pem)?,
        )
        .map_err(|source| TlsError::Rustls {
            what: "server certificate and key",
            source,
        })?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// Why `node` is not a usable identity of node `node_id` now, if it is
/// not: its certificate must chain to its CA and be valid for a client,
/// name `zattera://node/<node_id>`, and belong to its key.
pub fn identity_problem(node: &NodeTls, node_id: &str) -> Option<String> {
    let check = || -> Result<(), String> {
        let certs =
            certs_from_pem("node certificate", &node.cert_pem).map_err(|e| e.to_string())?;
        let leaf = &certs[0];
        match node_id_of(leaf) {
            Some(id) if id == node_id => {}
            other => {
                return Err(format!(
                    "the certificate names node {other:?}, not {node_id:?}"
                ));
            }
        }
        let provider = provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots(&node.ca_pem).map_err(|e| e.to_string())?),
            Arc::clone(&provider),
        )
        .build()
        .map_err(|e| e.to_string())?;
        verifier
            .verify_client_cert(leaf, &certs[1..], rustls::pki_types::UnixTime::now())
            .map_err(|e| format!("the certificate does not verify against ca.crt: {e}"))?;
        let key = key_from_pem("node key", &node.key_pem).map_err(|e| e.to_string())?;
        let signing = provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| format!("the key: {e}"))?;
        rustls::sign::CertifiedKey::new(certs, signing)
            .keys_match()
            .map_err(|e| format!("the key is not the certificate's: {e}"))
    };
    check().err()
}

/// The node id in a certificate's `zattera://node/<id>` URI SAN, if any.
pub fn node_id_of(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(uri) => uri
            .strip_prefix(NODE_URI_PREFIX)
            .filter(|id| !id.is_empty())
            .map(str::to_owned),
        _ => None,
    })
}

/// Splits `host:port` (IPv6 in brackets) into the TLS server name and the
/// address to dial.
pub fn server_name_of(addr: &str) -> Result<ServerName<'static>, TlsError> {
    let bad = || TlsError::BadAddress {
        addr: addr.to_owned(),
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    ServerName::try_from(host.to_owned()).map_err(|_| bad())
}

/// A gRPC channel to `addr` over TLS with `cfg`, HTTP/2 keepalive 15 s / 5 s
/// even while idle (wire.md §1.3), so a dead control node is seen in ~20 s.
pub async fn connect(addr: &str, cfg: ClientConfig) -> Result<Channel, TlsError> {
    connect_as(addr, server_name_of(addr)?, cfg).await
}

/// As [`connect`], verifying the server as `name` instead of the dialed
/// host (a node certificate without an IP SAN is checked by its DNS SAN).
pub async fn connect_as(
    addr: &str,
    name: ServerName<'static>,
    cfg: ClientConfig,
) -> Result<Channel, TlsError> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let dial = addr.to_owned();
    let service = tower::service_fn(move |_uri: tonic::codegen::http::Uri| {
        let connector = connector.clone();
        let name = name.clone();
        let dial = dial.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(&dial).await?;
            tcp.set_nodelay(true)?;
            let tls = connector.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    let err = |source| TlsError::Connect {
        addr: addr.to_owned(),
        source,
    };
    Endpoint::from_shared(format!("http://{addr}"))
        .map_err(err)?
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(15))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect_with_connector(service)
        .await
        .map_err(err)
}

/// Message of the handshake error a pin mismatch produces, so callers can
/// tell it from other TLS failures.
pub const PIN_MISMATCH: &str = "no certificate in the server's chain matches the CA pin";

#[derive(Debug)]
struct PinVerifier {
    pin: String,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if pin_of(end_entity) == self.pin {
            return Ok(ServerCertVerified::assertion());
        }
        let Some(anchor) = intermediates.iter().find(|c| pin_of(c) == self.pin) else {
            return Err(rustls::Error::General(PIN_MISMATCH.into()));
        };
        // A pinned root is not enough on its own: anyone can replay it. The
        // leaf must chain to it; the host name is not checked (wire.md §1.2).
        let mut store = RootCertStore::empty();
        store.add(anchor.clone().into_owned())?;
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &store,
            intermediates,
            now,
            self.algs.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// A server-side TLS stream that tells tonic who the client is: the leaf
/// certificate's node identity, if any, reaches handlers as a request
/// extension ([`PeerIdentity`]).
#[derive(Debug)]
pub struct ServerStream(pub tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

/// The connection's client identity, as a request extension.
#[derive(Debug, Clone, Default)]
pub struct PeerIdentity {
    /// From the client certificate's `zattera://node/` URI SAN.
    pub node_id: Option<String>,
    /// Whether a (verified) client certificate was presented at all.
    pub has_certificate: bool,
}

impl tonic::transport::server::Connected for ServerStream {
    type ConnectInfo = PeerIdentity;
    fn connect_info(&self) -> PeerIdentity {
        let leaf = self
            .0
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first());
        PeerIdentity {
            node_id: leaf.and_then(|c| node_id_of(c)),
            has_certificate: leaf.is_some(),
        }
    }
}

impl tokio::io::AsyncRead for ServerStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for ServerStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Accepts TCP connections on `listener` and yields the completed TLS
/// handshakes; a failed handshake is logged and skipped, never fatal.
pub fn incoming(
    listener: tokio::net::TcpListener,
    cfg: Arc<ServerConfig>,
) -> impl futures::Stream<Item = std::io::Result<ServerStream>> {
    incoming_current(listener, tokio::sync::watch::channel(cfg).1)
}

/// [`incoming`] with a server config that may be replaced (a renewed
/// certificate): each handshake uses the one current when it starts.
pub fn incoming_current(
    listener: tokio::net::TcpListener,
    cfg: tokio::sync::watch::Receiver<Arc<ServerConfig>>,
) -> impl futures::Stream<Item = std::io::Result<ServerStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            // The listener closes with the server, so its port is free again.
            let accepted = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&cfg.borrow()));
            let tx = tx.clone();
            // Handshakes run apart so one slow client cannot stall the rest.
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(ServerStream(tls))).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn server_names_from_addresses() {
        assert!(matches!(
            server_name_of("127.0.0.1:8443").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name_of("[::1]:8443").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name_of("control.example:8443").unwrap(),
            ServerName::DnsName(_)
        ));
        for bad in ["127.0.0.1", "127.0.0.1:x", ":8443", ""] {
            assert!(server_name_of(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn node_identity_from_uri_san() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = vec![
            rcgen::SanType::DnsName("node-n1".try_into().unwrap()),
            rcgen::SanType::URI("zattera://node/n1".try_into().unwrap()),
        ];
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(node_id_of(cert.der()).as_deref(), Some("n1"));
        let other = rcgen::CertificateParams::new(vec!["node:n1".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(node_id_of(other.der()), None);
    }
}
