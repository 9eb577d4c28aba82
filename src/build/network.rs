//! The network `RUN` steps run in (45.1): a namespace per build on a bridge
//! of the agent's own (`<prefix>b`, [`DEFAULT_SUBNET`]), with the guard
//! every container bridge has (no other bridge, no host address but the
//! replies to its own connections, no VIP, no loopback) and, for this
//! scope only, no route into the mesh. What leaves through the host's
//! uplink is masqueraded: registries, package mirrors and the source host
//! stay in reach.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use zattera_netns::{NetNode, Subnet};

/// The build bridge's /24 unless `build-subnet` says otherwise: next to the
/// node-local default network (10.202.0.0/24), away from the environment
/// pool (10.201.0.0/16).
pub const DEFAULT_SUBNET: Subnet = Subnet::from_octets(10, 202, 254);

/// Where one build's `RUN` steps send their traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepNetwork {
    /// The network namespace at `path`, with `dns` as its resolvers (none:
    /// the host's resolv.conf).
    Namespace {
        path: PathBuf,
        dns: Vec<Ipv4Addr>,
    },
    None,
    Host,
}

impl StepNetwork {
    /// buildah's `--network` (and `--dns`) arguments.
    pub fn buildah_args(&self) -> Vec<String> {
        match self {
            Self::Namespace { path, dns } => {
                let mut args = vec!["--network".to_owned(), format!("ns:{}", path.display())];
                if !dns.is_empty() {
                    args.push("--dns".to_owned());
                    args.push(
                        dns.iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(","),
                    );
                }
                args
            }
            Self::None => vec!["--network".to_owned(), "none".to_owned()],
            Self::Host => vec!["--network".to_owned(), "host".to_owned()],
        }
    }
}

/// The build bridge of this node, shared by its builds.
#[derive(Debug)]
pub struct BuildNet {
    net: Arc<NetNode>,
    subnet: Subnet,
    /// Resolvers `RUN` steps get: the host's upstreams, when they are not
    /// on its loopback (which a namespace cannot reach).
    dns: Vec<Ipv4Addr>,
    /// Host octets held by running builds.
    held: Arc<Mutex<BTreeSet<u8>>>,
}

/// One build's place on the bridge; [`Lease::leave`] gives it back.
#[derive(Debug)]
pub struct Lease {
    net: Arc<NetNode>,
    id: String,
    ip: Ipv4Addr,
    octet: u8,
    held: Arc<Mutex<BTreeSet<u8>>>,
    pub network: StepNetwork,
}

impl BuildNet {
    pub fn new(net: Arc<NetNode>, subnet: Subnet, upstreams: &[std::net::SocketAddr]) -> Self {
        let dns = upstreams
            .iter()
            .filter_map(|a| match a.ip() {
                std::net::IpAddr::V4(ip) if !ip.is_loopback() && a.port() == 53 => Some(ip),
                _ => None,
            })
            .collect();
        Self {
            net,
            subnet,
            dns,
            held: Arc::default(),
        }
    }

    /// A namespace on the bridge for build `build_id` (the bridge is made
    /// first if it is not there).
    pub async fn enter(&self, build_id: &str) -> Result<Lease, String> {
        let octet = {
            let mut held = self
                .held
                .lock()
                .map_err(|_| "build network state poisoned")?;
            let free = (2..=254u8)
                .find(|o| !held.contains(o))
                .ok_or("no free address on the build network")?;
            held.insert(free);
            free
        };
        let ip = self.subnet.host(octet);
        let id = format!("zt-build-{octet}");
        let attached = async {
            self.net
                .ensure_network(zattera_netns::firewall::BUILD_SCOPE, self.subnet)
                .await
                .map_err(|e| format!("build network {}: {e}", self.subnet))?;
            // What a killed agent's build left under this name.
            let _ = self.net.detach(&id, Some(ip)).await;
            self.net
                .attach(&id, self.subnet, ip)
                .await
                .map_err(|e| format!("build network {}: {e}", self.subnet))
        }
        .await;
        match attached {
            Ok(a) => {
                tracing::debug!(build = build_id, %ip, "build steps on the build network");
                Ok(Lease {
                    net: Arc::clone(&self.net),
                    id,
                    ip,
                    octet,
                    held: Arc::clone(&self.held),
                    network: StepNetwork::Namespace {
                        path: a.netns_path,
                        dns: self.dns.clone(),
                    },
                })
            }
            Err(e) => {
                if let Ok(mut held) = self.held.lock() {
                    held.remove(&octet);
                }
                Err(e)
            }
        }
    }
}

impl Lease {
    /// Removes the namespace and its veth, and frees the address.
    pub async fn leave(self) {
        if let Err(e) = self.net.detach(&self.id, Some(self.ip)).await {
            tracing::warn!(ip = %self.ip, error = %e, "build namespace not removed");
        }
        if let Ok(mut held) = self.held.lock() {
            held.remove(&self.octet);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buildah_gets_the_namespace_and_resolvers() {
        let n = StepNetwork::Namespace {
            path: PathBuf::from("/run/zattera/netns/zt-build-2"),
            dns: vec![Ipv4Addr::new(10, 0, 0, 53), Ipv4Addr::new(10, 0, 0, 54)],
        };
        assert_eq!(
            n.buildah_args(),
            [
                "--network",
                "ns:/run/zattera/netns/zt-build-2",
                "--dns",
                "10.0.0.53,10.0.0.54"
            ]
        );
        assert_eq!(StepNetwork::None.buildah_args(), ["--network", "none"]);
        assert_eq!(DEFAULT_SUBNET.to_string(), "10.202.254.0/24");
    }
}
