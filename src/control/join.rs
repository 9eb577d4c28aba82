//! `zattera-agent join`: enrollment with a control plane (wire.md §1.2).
//!
//! The token pins the cluster CA by hash; the key pair is made here and only
//! a CSR travels; the result is stored under the data dir ([`IdentityDir`]).
//! A node that joined before sends its old id to resume its record.

use std::path::PathBuf;
use std::time::Duration;

use crate::proto::cluster::JoinRequest;
use crate::proto::cluster::join_service_client::JoinServiceClient;
use crate::proto::v1::ResourceLimits;

use crate::link::identity::{Enrollment, IdentityDir, IdentityError};
use crate::link::tls::{self, NodeTls, TlsError};
use crate::metrics::host;

const TOKEN_PREFIX: &str = "K10";

/// A parsed join token: `K10<sha256 of the CA's DER, hex>::<secret>`.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub ca_pin: String,
    pub secret: String,
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinToken")
            .field("ca_pin", &self.ca_pin)
            .finish_non_exhaustive()
    }
}

impl std::str::FromStr for JoinToken {
    type Err = JoinError;
    fn from_str(token: &str) -> Result<Self, JoinError> {
        let bad = |why: &str| JoinError::BadToken(why.to_owned());
        let rest = token
            .trim()
            .strip_prefix(TOKEN_PREFIX)
            .ok_or_else(|| bad("it does not start with K10"))?;
        let (pin, secret) = rest
            .split_once("::")
            .ok_or_else(|| bad("no \"::\" between the CA pin and the secret"))?;
        if pin.len() != 64 || !pin.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("the CA pin is not 64 hex digits (a SHA-256)"));
        }
        if secret.is_empty() {
            return Err(bad("the secret after \"::\" is empty"));
        }
        Ok(Self {
            ca_pin: pin.to_ascii_lowercase(),
            secret: secret.to_owned(),
        })
    }
}

/// Why a join failed; each renders as one line an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("join token is malformed: {0} (expected K10<ca-sha256>::<secret>)")]
    BadToken(String),
    #[error("control plane {addr} is unreachable: {cause}")]
    Unreachable { addr: String, cause: String },
    #[error(
        "control plane {addr} failed the CA pin: its certificate chain does not contain the CA {pin} named by the token"
    )]
    PinMismatch { addr: String, pin: String },
    #[error("TLS with control plane {addr} failed: {cause}")]
    Tls { addr: String, cause: String },
    #[error("control plane {addr} refused the join token: {message}")]
    TokenRefused { addr: String, message: String },
    #[error("control plane {addr} rejected the join ({code:?}): {message}")]
    Rejected {
        addr: String,
        code: tonic::Code,
        message: String,
    },
    #[error("control plane {addr} answered with an unusable JoinResponse: {why}")]
    BadResponse { addr: String, why: String },
    #[error("generating the node key and CSR: {0}")]
    Csr(#[from] rcgen::Error),
    #[error(transparent)]
    TlsConfig(#[from] TlsError),
    #[error("storing the enrollment: {0}")]
    Store(#[from] IdentityError),
    #[error("the node's WireGuard key or peers: {0}")]
    MeshKey(crate::mesh::MeshError),
    /// The token was a control-role one: this agent runs workers only.
    #[error(
        "control plane {addr} made this node a CONTROL node (the join token is a control-role one): this agent runs worker nodes only; nothing of this join was kept. Create a worker token (`zt nodes join-token create`, without --control), remove this node's record (`zt nodes rm`), and join with the new token"
    )]
    ControlRole { addr: String },
}

/// What `join` needs to know.
#[derive(Clone)]
pub struct JoinOptions {
    /// `host:port` of a control node's API.
    pub control: String,
    pub token: String,
    pub data_dir: PathBuf,
    /// Display name for the node record (the host name by default).
    pub node_name: String,
    pub binary_version: String,
    /// The WireGuard port and endpoints the join announces.
    pub mesh: MeshJoin,
    /// Control-plane node ids the operator names (`join
    /// --control-node-id`): on a cluster without the mesh no peer set ever
    /// names them, and the reference's API certificates carry no node id,
    /// so the node API would refuse every caller.
    pub control_node_ids: Vec<String>,
    /// `detected_labels`: what control may place by (see [`node_labels`]).
    pub labels: std::collections::BTreeMap<String, String>,
}

/// What a join says of the node's WireGuard.
#[derive(Clone, Debug)]
pub struct MeshJoin {
    pub listen_port: u16,
    /// The endpoints advertised, as configured (the reference's rule).
    pub endpoints: Vec<std::net::SocketAddr>,
    /// Also the default route's address at `listen_port` (opt-in).
    pub autodetect: bool,
}

impl Default for MeshJoin {
    fn default() -> Self {
        Self {
            listen_port: zattera_mesh::DEFAULT_PORT,
            endpoints: Vec::new(),
            autodetect: false,
        }
    }
}

impl MeshJoin {
    pub fn from_settings(s: &crate::mesh::settings::MeshSettings) -> Self {
        Self {
            listen_port: s.listen_port,
            endpoints: s.endpoints.clone(),
            autodetect: s.autodetect_endpoint,
        }
    }

    /// The endpoints a join advertises: the configured ones, and the
    /// detected one when asked for.
    fn advertised(&self) -> Vec<String> {
        self.advertised_with(crate::mesh::default_endpoint)
    }

    fn advertised_with(&self, detect: impl Fn(u16) -> Option<std::net::SocketAddr>) -> Vec<String> {
        let detected = self.autodetect.then(|| detect(self.listen_port)).flatten();
        self.endpoints
            .iter()
            .copied()
            .chain(detected)
            .map(|e| e.to_string())
            .collect()
    }
}

impl JoinOptions {
    /// This node joining `control` with `token`: named after the host, with
    /// this binary's version, its identity under the data dir of `config`
    /// and its WireGuard as `config` says.
    pub fn for_this_node(control: String, token: String, config: &crate::config::Config) -> Self {
        Self {
            control,
            token,
            data_dir: config.data_dir.clone(),
            node_name: host_name(),
            binary_version: crate::version::tag().to_owned(),
            mesh: MeshJoin::from_settings(&config.mesh),
            control_node_ids: Vec::new(),
            labels: node_labels(&config.build),
        }
    }
}

/// The label a reference control plane dispatches builds by.
pub const BUILDER_LABEL: &str = "builder";
/// The platform label the reference's nodes carry.
pub const OS_ARCH_LABEL: &str = "zattera.dev/os-arch";

/// The labels this node reports in its join: its platform, and
/// `builder=true` when a build backend is there (what doctor's `builder`
/// check says), so that control's dispatcher sends it builds.
pub fn node_labels(
    build: &crate::image_build::settings::BuildSettings,
) -> std::collections::BTreeMap<String, String> {
    let mut labels = std::collections::BTreeMap::from([(
        OS_ARCH_LABEL.to_owned(),
        format!("linux/{}", crate::runtime::descriptor::host_architecture()),
    )]);
    if crate::image_build::available_backend(build).is_ok() {
        labels.insert(BUILDER_LABEL.to_owned(), "true".to_owned());
    }
    labels
}

impl std::fmt::Debug for JoinOptions {
    // The token is a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinOptions")
            .field("control", &self.control)
            .field("data_dir", &self.data_dir)
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

/// Enrolls this node and stores the result; returns what was stored.
pub async fn join(opts: &JoinOptions) -> Result<Enrollment, JoinError> {
    let token: JoinToken = opts.token.parse()?;
    let addr = opts.control.clone();
    let ids = IdentityDir::new(&opts.data_dir);
    let existing_node_id = ids.previous_node_id().unwrap_or_default();

    probe(&addr, &token.ca_pin).await?;

    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, opts.node_name.clone());
    let csr = params.serialize_request(&key)?.pem()?;

    let channel = tls::connect(&addr, tls::pinned_client(&token.ca_pin)?)
        .await
        .map_err(|e| JoinError::Unreachable {
            addr: addr.clone(),
            cause: e.to_string(),
        })?;
    let (_, disk_total) = host::disk(&opts.data_dir);
    let wg_key = crate::mesh::load_or_create_key(&opts.data_dir).map_err(JoinError::MeshKey)?;
    let request = JoinRequest {
        token_secret: token.secret.clone(),
        node_name: opts.node_name.clone(),
        capacity: Some(ResourceLimits {
            cpu_millis: host::cpu_millis(),
            memory_mb: host::mib(host::memory().1),
        }),
        capacity_disk_mb: host::mib(disk_total),
        os_arch: format!("linux/{}", crate::runtime::descriptor::host_architecture()),
        binary_version: opts.binary_version.clone(),
        csr_pem: csr.into_bytes(),
        existing_node_id: existing_node_id.clone(),
        wireguard_public_key: wg_key.public().to_base64(),
        wireguard_listen_port: u32::from(opts.mesh.listen_port),
        public_endpoints: opts.mesh.advertised(),
        detected_labels: opts.labels.clone(),
        ..JoinRequest::default()
    };
    let mut request = tonic::Request::new(request);
    request.set_timeout(Duration::from_secs(30));
    let resp = JoinServiceClient::new(channel)
        .join(request)
        .await
        .map_err(|s| status_error(&addr, &s))?
        .into_inner();

    let bad = |why: String| JoinError::BadResponse {
        addr: addr.clone(),
        why,
    };
    if resp.node_id.is_empty() {
        return Err(bad("node_id is empty".into()));
    }
    // A control node is a raft voter, a hub candidate and an is_control
    // peer to every node: nothing this agent is. Refused before anything
    // of the response is stored.
    if resp
        .roles
        .contains(&(crate::proto::v1::NodeRole::Control as i32))
    {
        return Err(JoinError::ControlRole { addr: addr.clone() });
    }
    // The CA handed over must be the one the token pinned: it is the trust
    // anchor of every later hop.
    let ca = tls::certs_from_pem("JoinResponse.ca_cert_pem", &resp.ca_cert_pem)
        .map_err(|e| bad(e.to_string()))?;
    if !ca.iter().any(|c| tls::pin_of(c) == token.ca_pin) {
        return Err(bad(format!(
            "ca_cert_pem is not the CA {} named by the token",
            token.ca_pin
        )));
    }
    let leaf = tls::certs_from_pem("JoinResponse.node_cert_pem", &resp.node_cert_pem)
        .map_err(|e| bad(e.to_string()))?;
    match leaf.first().and_then(|c| tls::node_id_of(c)) {
        Some(id) if id == resp.node_id => {}
        other => {
            return Err(bad(format!(
                "node_cert_pem names node {other:?}, not {:?}",
                resp.node_id
            )));
        }
    }
    // A re-join of the same node (a renewal) keeps the ids named before.
    let kept = ids
        .load_enrollment()
        .ok()
        .filter(|prev| prev.node_id == resp.node_id)
        .map(|prev| prev.control_node_ids)
        .unwrap_or_default();
    let enrollment = Enrollment {
        node_id: resp.node_id,
        mesh_ip: resp.mesh_ip,
        // Loopback setups may leave it empty: the address we dialed works.
        control_addr: if resp.control_grpc_addr.is_empty() {
            addr.clone()
        } else {
            resp.control_grpc_addr
        },
        registry_addr: resp.registry_addr,
        registry_username: resp.registry_username,
        registry_password: resp.registry_password,
        control_node_ids: control_node_ids(
            resp.initial_peers.as_ref(),
            &opts.control_node_ids,
            kept,
        ),
        mesh_enabled: resp.mesh_enabled,
    };
    if resp.mesh_enabled {
        let mesh_ip = enrollment.mesh_ip.parse::<std::net::Ipv4Addr>();
        if mesh_ip.is_err() {
            return Err(bad(format!(
                "mesh_enabled, but mesh_ip {:?} is not an IPv4 address",
                enrollment.mesh_ip
            )));
        }
        // A re-join (renewal, restart) keeps the fuller set WatchPeers gave
        // since: initial_peers names only the control nodes.
        let peers = crate::mesh::peers::path(&opts.data_dir);
        if !peers.exists() || existing_node_id != enrollment.node_id {
            let initial = resp.initial_peers.clone().unwrap_or_default();
            crate::mesh::peers::store(&peers, &initial).map_err(JoinError::MeshKey)?;
        }
    }
    let node_tls = NodeTls {
        key_pem: key.serialize_pem().into_bytes(),
        cert_pem: resp.node_cert_pem,
        ca_pem: resp.ca_cert_pem,
    };
    ids.store(&enrollment, &node_tls)?;
    Ok(enrollment)
}

/// The control node ids a join stores: the join's control peers, the ones
/// the operator named, and those kept from an earlier join of this node;
/// sorted, without repeats.
fn control_node_ids(
    initial: Option<&crate::proto::cluster::PeerSet>,
    named: &[String],
    kept: Vec<String>,
) -> Vec<String> {
    initial
        .iter()
        .flat_map(|set| &set.peers)
        .filter(|p| p.is_control && !p.node_id.is_empty())
        .map(|p| p.node_id.clone())
        .chain(named.iter().cloned())
        .chain(kept)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Dials and handshakes once before any RPC, so an unreachable address and
/// a failed pin each get their own message instead of a transport error.
async fn probe(addr: &str, pin: &str) -> Result<(), JoinError> {
    let unreachable = |cause: String| JoinError::Unreachable {
        addr: addr.to_owned(),
        cause,
    };
    let name = tls::server_name_of(addr)?;
    let tcp = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .map_err(|_| unreachable("no answer within 10 s".into()))?
    .map_err(|e| unreachable(e.to_string()))?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls::pinned_client(pin)?));
    match tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp)).await {
        Err(_) => Err(JoinError::Tls {
            addr: addr.to_owned(),
            cause: "handshake timed out after 10 s".into(),
        }),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) if e.to_string().contains(tls::PIN_MISMATCH) => Err(JoinError::PinMismatch {
            addr: addr.to_owned(),
            pin: pin.to_owned(),
        }),
        Ok(Err(e)) => Err(JoinError::Tls {
            addr: addr.to_owned(),
            cause: e.to_string(),
        }),
    }
}

fn status_error(addr: &str, s: &tonic::Status) -> JoinError {
    let addr = addr.to_owned();
    match s.code() {
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => JoinError::TokenRefused {
            addr,
            message: s.message().to_owned(),
        },
        tonic::Code::Unavailable if s.message().contains("transport") => JoinError::Unreachable {
            addr,
            cause: s.message().to_owned(),
        },
        code => JoinError::Rejected {
            addr,
            code,
            message: s.message().to_owned(),
        },
    }
}

/// This machine's host name, for `node_name`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".into())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    #[test]
    fn only_configured_endpoints_unless_autodetection_is_asked_for() {
        // A host whose default route has a public address.
        let public = |port| Some(std::net::SocketAddr::from(([203, 0, 113, 9], port)));
        let configured: std::net::SocketAddr = "198.51.100.4:51820".parse().unwrap();
        let mesh = |endpoints: Vec<std::net::SocketAddr>, autodetect| MeshJoin {
            endpoints,
            autodetect,
            ..MeshJoin::default()
        };
        assert!(mesh(vec![], false).advertised_with(public).is_empty());
        assert_eq!(
            mesh(vec![configured], false).advertised_with(public),
            ["198.51.100.4:51820"]
        );
        assert_eq!(
            mesh(vec![], true).advertised_with(public),
            ["203.0.113.9:51820"]
        );
        assert_eq!(
            mesh(vec![configured], true).advertised_with(public),
            ["198.51.100.4:51820", "203.0.113.9:51820"]
        );
    }

    use super::*;

    #[test]
    fn token_parsing() {
        let pin = "ab".repeat(32);
        let t: JoinToken = format!("K10{pin}::s3cret").parse().unwrap();
        assert_eq!(t.ca_pin, pin);
        assert_eq!(t.secret, "s3cret");
        let upper: JoinToken = format!("K10{}::x::y", pin.to_uppercase()).parse().unwrap();
        assert_eq!(upper.ca_pin, pin);
        assert_eq!(upper.secret, "x::y");
        assert!(!format!("{t:?}").contains("s3cret"));
        for bad in [
            String::new(),
            format!("K11{pin}::s"),
            format!("K10{pin}"),
            format!("K10{pin}::"),
            format!("K10{}::s", &pin[..62]),
            format!("K10{}zz::s", &pin[..62]),
        ] {
            let err = bad.parse::<JoinToken>().unwrap_err();
            assert!(matches!(err, JoinError::BadToken(_)), "{bad}: {err}");
        }
    }
}
