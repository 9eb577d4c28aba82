//! The network `RUN` steps run in (45.1): a namespace per build on a bridge
//! of the agent's own (`<prefix>b`, [`DEFAULT_SUBNET`]), with the guard
//! every container bridge has (no other bridge, no host address but the
//! replies to its own connections, no VIP, no loopback) and, for this
//! scope only, no route into the mesh. What leaves through the host's
//! uplink is masqueraded: registries, package mirrors and the source host
//! stay in reach.
//!
//! buildah's steps join a namespace the agent makes per build (host octets
//! up to [`NAMESPACE_LAST`]). BuildKit's daemon attaches its steps itself,
//! through CNI: [`cni_config`] puts them on the same bridge, addresses from
//! the rest of the /24, under the same guard.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use zattera_netns::{NetNode, Subnet};

/// The build bridge's /24 unless `build-subnet` says otherwise: next to the
/// node-local default network (10.202.0.0/24), away from the environment
/// pool (10.201.0.0/16).
pub const DEFAULT_SUBNET: Subnet = Subnet::from_octets(10, 202, 254);

/// The last host octet a per-build namespace takes; BuildKit's CNI range
/// is the rest of the /24 (its pool holds addresses while idle).
pub const NAMESPACE_LAST: u8 = 127;

/// The CNI network name BuildKit's steps are attached under.
pub const CNI_NETWORK: &str = "zattera-build";

/// Where one build's `RUN` steps send their traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepNetwork {
    /// The network namespace at `path`, with `dns` as its resolvers (none:
    /// the host's resolv.conf).
    Namespace {
        path: PathBuf,
        dns: Vec<Ipv4Addr>,
    },
    /// The build bridge itself, for a daemon that attaches its steps
    /// (BuildKit, through [`cni_config`]).
    Bridge {
        name: String,
        subnet: Subnet,
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
            // Only a daemon attaches to the bridge itself: buildah given
            // it would otherwise run on the host's network.
            Self::Bridge { .. } | Self::None => vec!["--network".to_owned(), "none".to_owned()],
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
            let free = (2..=NAMESPACE_LAST)
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

impl BuildNet {
    /// The build bridge (made if missing, with its guard), for a backend
    /// whose daemon attaches its steps itself.
    pub async fn bridge(&self) -> Result<StepNetwork, String> {
        let net = self
            .net
            .ensure_network(zattera_netns::firewall::BUILD_SCOPE, self.subnet)
            .await
            .map_err(|e| format!("build network {}: {e}", self.subnet))?;
        Ok(StepNetwork::Bridge {
            name: net.bridge,
            subnet: self.subnet,
        })
    }
}

/// A CNI network config for BuildKit's containerd worker: each step on
/// bridge `bridge`, an address above [`NAMESPACE_LAST`] of `subnet`, its
/// default route through the agent's gateway `.1`. CNI makes no gateway and
/// no masquerade of its own: the agent's bridge and firewall own both, so
/// the steps get exactly the guard a buildah build's namespace gets.
/// `ipam_dir` keeps host-local's leases with the daemon's state.
pub fn cni_config(bridge: &str, subnet: Subnet, ipam_dir: &std::path::Path) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "type": "bridge",
        "bridge": bridge,
        "isGateway": false,
        "isDefaultGateway": false,
        "ipMasq": false,
        "hairpinMode": false,
        "ipam": {
            "type": "host-local",
            "ranges": [[{
                "subnet": subnet.to_string(),
                "rangeStart": subnet.host(NAMESPACE_LAST + 1).to_string(),
                "rangeEnd": subnet.host(254).to_string(),
                "gateway": subnet.gateway().to_string(),
            }]],
            "routes": [{ "dst": "0.0.0.0/0" }],
            "dataDir": ipam_dir.display().to_string(),
        },
    })
    .to_string()
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
#[allow(clippy::disallowed_methods)]
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
        let bridge = StepNetwork::Bridge {
            name: "ztb".into(),
            subnet: DEFAULT_SUBNET,
        };
        assert_eq!(bridge.buildah_args(), ["--network", "none"]);
        assert_eq!(DEFAULT_SUBNET.to_string(), "10.202.254.0/24");
    }

    #[test]
    fn buildkit_steps_get_the_upper_half_of_the_bridge_and_no_cni_gateway() {
        let text = cni_config(
            "ztb",
            DEFAULT_SUBNET,
            std::path::Path::new("/var/lib/zattera/buildkit/cni-ipam"),
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["type"], "bridge");
        assert_eq!(v["bridge"], "ztb");
        assert_eq!(v["isGateway"], false);
        assert_eq!(v["ipMasq"], false);
        let range = &v["ipam"]["ranges"][0][0];
        assert_eq!(range["rangeStart"], "10.202.254.128");
        assert_eq!(range["rangeEnd"], "10.202.254.254");
        assert_eq!(range["gateway"], "10.202.254.1");
        assert_eq!(v["ipam"]["routes"][0]["dst"], "0.0.0.0/0");
        assert_eq!(v["ipam"]["dataDir"], "/var/lib/zattera/buildkit/cni-ipam");
    }
}
