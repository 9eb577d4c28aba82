//! The agent's nftables table, rendered from a desired state.
//!
//! The whole table is rebuilt in one `nft -f` transaction
//! (`table; delete table; table { ... }`), so the kernel switches from the old
//! rules to the new ones atomically and a rebuild from the same state is a
//! no-op. Only our table (family `inet`) is ever named: other tables, and the
//! host's own ruleset, are never read into the transaction nor flushed.
//!
//! The rules, per chain (all with policy accept, so they only ever act on
//! traffic of our bridges and published ports):
//! - `prerouting`/`output` (nat): DNAT of published ports, through maps keyed
//!   by `address . port` (one host address) or `port` (any local address);
//!   `output` covers connections made on the host itself, loopback included.
//! - `postrouting` (nat): masquerade a subnet leaving through a non-bridge
//!   interface; masquerade loopback-sourced traffic DNATed onto a bridge
//!   (needs `route_localnet`); hairpin masquerade for a container reaching a
//!   published port of its own bridge.
//! - `forward` (filter): established/related flows accepted; from a bridge
//!   to the mesh range, link-local (cloud metadata) or the operator's
//!   egress deny list refused; DNATed flows accepted; inside one bridge
//!   accepted; between two of our bridges dropped; out of a bridge
//!   accepted; unsolicited traffic into a bridge dropped. Only the node's
//!   own processes (the VIP proxies, `output`) dial mesh addresses.
//! - `prerouting` from a bridge to a mesh address DNATs only ports
//!   published to every address (the operator's, to the world): a port
//!   published on the mesh IP for the VIP proxies of other nodes is no door
//!   from one tenant's container to another's.
//! - `guard` (filter, prerouting at raw priority, before conntrack and
//!   routing): a packet arriving on a bridge to 127.0.0.0/8 is dropped (with
//!   `route_localnet` on, a container with CAP_NET_RAW could otherwise reach
//!   the host's loopback services: CVE-2020-8558), and so is one whose source
//!   is not in that bridge's subnet (spoofing another container, environment
//!   or the host).
//! - `input` (filter): from a bridge, the host accepts only replies to its
//!   own connections, DNS to that bridge's own gateway, and the service VIPs
//!   of the bridge's own scope (runtime.md V-6's allowed deviation: the
//!   reference lets every container reach every VIP and the whole host);
//!   everything else is refused with a TCP reset or an ICMP
//!   admin-prohibited, so a client fails at once instead of timing out.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use crate::subnet::Subnet;

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// The scope of the bridge build steps run on (guarded as every bridge).
pub const BUILD_SCOPE: &str = "zattera-build";

/// The mesh's address range (the reference's fixed 10.90.0.0/16): no
/// bridge reaches it.
pub const MESH_CIDR: &str = "10.90.0.0/16";
/// Link-local, where clouds answer metadata (whose user-data often holds a
/// join token): no bridge reaches it.
pub const LINK_LOCAL_CIDR: &str = "169.254.0.0/16";

/// An IPv4 range, `a.b.c.d/n`, with the host bits zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || crate::error::Error::Config(format!("{s:?} is not an IPv4 range a.b.c.d/n"));
        let (addr, prefix) = s.trim().split_once('/').ok_or_else(bad)?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        if prefix > 32 {
            return Err(bad());
        }
        let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
        Ok(Self {
            addr: Ipv4Addr::from(u32::from(addr) & mask),
            prefix,
        })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One environment bridge the rules cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeRules {
    pub bridge: String,
    pub subnet: Subnet,
    /// The network's logical name ([`crate::network_name`]): which VIPs its
    /// containers may reach.
    pub scope: String,
}

/// A service VIP and the network scope whose containers may reach it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ScopedVip {
    pub addr: Ipv4Addr,
    /// A [`crate::network_name`]; empty means no bridge may reach it yet.
    pub scope: String,
}

/// `host_ip:host_port -> container_ip:container_port`. A `host_ip` of
/// 0.0.0.0 means every local address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PublishedPort {
    pub proto: Proto,
    pub host_ip: Ipv4Addr,
    pub host_port: u16,
    pub container_ip: Ipv4Addr,
    pub container_port: u16,
}

impl PublishedPort {
    /// The same host side (protocol, address, port), wherever it leads.
    pub fn same_host_port(&self, other: &PublishedPort) -> bool {
        (self.proto, self.host_ip, self.host_port) == (other.proto, other.host_ip, other.host_port)
    }
}

/// The label form, `tcp/127.0.0.1:8080->10.201.5.2:80`: what the agent
/// records on a container so the rules can be rebuilt after a restart.
impl std::fmt::Display for PublishedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}:{}->{}:{}",
            self.proto.name(),
            self.host_ip,
            self.host_port,
            self.container_ip,
            self.container_port
        )
    }
}

impl std::str::FromStr for PublishedPort {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            crate::error::Error::Config(format!(
                "published port {s:?} is not proto/host_ip:host_port->container_ip:container_port"
            ))
        };
        let (proto, rest) = s.split_once('/').ok_or_else(bad)?;
        let proto = match proto {
            "tcp" => Proto::Tcp,
            "udp" => Proto::Udp,
            _ => return Err(bad()),
        };
        let (host, container) = rest.split_once("->").ok_or_else(bad)?;
        let host: std::net::SocketAddrV4 = host.parse().map_err(|_| bad())?;
        let container: std::net::SocketAddrV4 = container.parse().map_err(|_| bad())?;
        Ok(Self {
            proto,
            host_ip: *host.ip(),
            host_port: host.port(),
            container_ip: *container.ip(),
            container_port: container.port(),
        })
    }
}

/// Everything the table must hold. Build it from the agent's state and hand
/// it to [`crate::nft::Nft::apply`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FirewallState {
    pub bridges: Vec<BridgeRules>,
    pub published: Vec<PublishedPort>,
    /// Service VIPs on this host (runtime.md §9), each reachable from the
    /// bridges of its own scope only.
    pub vips: Vec<ScopedVip>,
    /// Ranges no container or build step may reach, besides the mesh and
    /// link-local (the operator's `egress-deny`: underlay, VPC).
    pub egress_deny: Vec<Cidr>,
}

impl FirewallState {
    /// `(bridge, vip)` for every bridge that may reach a VIP: same scope.
    pub fn vip_access(&self) -> Vec<(String, Ipv4Addr)> {
        let mut out: Vec<(String, Ipv4Addr)> = self
            .vips
            .iter()
            .flat_map(|v| {
                self.bridges
                    .iter()
                    .filter(move |b| !v.scope.is_empty() && b.scope == v.scope)
                    .map(move |b| (b.bridge.clone(), v.addr))
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// The `nft -f` script that replaces table `inet <table>` with `state`.
pub fn render(table: &str, state: &FirewallState) -> String {
    let mut bridges = state.bridges.clone();
    bridges.sort_by_key(|b| b.subnet);
    bridges.dedup();
    let mut published = state.published.clone();
    published.sort();
    published.dedup();

    let mut s = String::new();
    // Declaring then deleting makes the delete valid when the table is absent.
    let _ = writeln!(
        s,
        "table inet {table}\ndelete table inet {table}\ntable inet {table} {{"
    );

    let names: Vec<String> = bridges
        .iter()
        .map(|b| format!("\"{}\"", b.bridge))
        .collect();
    s.push_str("  set bridges {\n    type ifname\n");
    push_elements(&mut s, &names);
    s.push_str("  }\n");
    let mut vips: Vec<Ipv4Addr> = state.vips.iter().map(|v| v.addr).collect();
    vips.sort();
    vips.dedup();
    let vips: Vec<String> = vips.iter().map(Ipv4Addr::to_string).collect();
    s.push_str("  set vips {\n    type ipv4_addr\n");
    push_elements(&mut s, &vips);
    s.push_str("  }\n");
    let access: Vec<String> = state
        .vip_access()
        .iter()
        .map(|(bridge, vip)| format!("\"{bridge}\" . {vip}"))
        .collect();
    s.push_str("  set vip_access {\n    type ifname . ipv4_addr\n");
    push_elements(&mut s, &access);
    s.push_str("  }\n");
    let mut deny: Vec<String> = [MESH_CIDR.to_owned(), LINK_LOCAL_CIDR.to_owned()]
        .into_iter()
        .chain(state.egress_deny.iter().map(Cidr::to_string))
        .collect();
    deny.sort();
    deny.dedup();
    s.push_str("  set egress_deny {\n    type ipv4_addr\n    flags interval\n    auto-merge\n");
    push_elements(&mut s, &deny);
    s.push_str("  }\n");

    for proto in [Proto::Tcp, Proto::Udp] {
        let p = proto.name();
        let one: Vec<String> = published
            .iter()
            .filter(|x| x.proto == proto && !x.host_ip.is_unspecified())
            .map(|x| {
                format!(
                    "{} . {} : {} . {}",
                    x.host_ip, x.host_port, x.container_ip, x.container_port
                )
            })
            .collect();
        let any: Vec<String> = published
            .iter()
            .filter(|x| x.proto == proto && x.host_ip.is_unspecified())
            .map(|x| {
                format!(
                    "{} : {} . {}",
                    x.host_port, x.container_ip, x.container_port
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "  map pub_{p} {{\n    type ipv4_addr . inet_service : ipv4_addr . inet_service"
        );
        push_elements(&mut s, &one);
        s.push_str("  }\n");
        let _ = writeln!(
            s,
            "  map puball_{p} {{\n    type inet_service : ipv4_addr . inet_service"
        );
        push_elements(&mut s, &any);
        s.push_str("  }\n");
    }

    for (chain, hook, prio) in [
        ("prerouting", "prerouting", "dstnat"),
        ("output", "output", "-100"),
    ] {
        let _ = writeln!(
            s,
            "  chain {chain} {{\n    type nat hook {hook} priority {prio}; policy accept;"
        );
        if chain == "prerouting" {
            let _ = writeln!(
                s,
                "    iifname @bridges ip daddr {MESH_CIDR} goto world_ports"
            );
        }
        for p in ["tcp", "udp"] {
            let _ = writeln!(s, "    dnat ip to ip daddr . {p} dport map @pub_{p}");
            let _ = writeln!(
                s,
                "    fib daddr type local dnat ip to {p} dport map @puball_{p}"
            );
        }
        s.push_str("  }\n");
    }

    // From a bridge to a mesh address: ports published to every address
    // only; a mesh-only port (for other nodes' VIP proxies) is not DNATed.
    s.push_str("  chain world_ports {\n");
    for p in ["tcp", "udp"] {
        let _ = writeln!(
            s,
            "    fib daddr type local dnat ip to {p} dport map @puball_{p}"
        );
    }
    s.push_str("  }\n");
    s.push_str(
        "  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n",
    );
    s.push_str("    ip saddr 127.0.0.0/8 oifname @bridges masquerade\n");
    for b in &bridges {
        let (n, net) = (&b.bridge, b.subnet);
        let _ = writeln!(
            s,
            "    ct status dnat oifname \"{n}\" ip saddr {net} ip daddr {net} masquerade"
        );
        let _ = writeln!(s, "    ip saddr {net} oifname != @bridges masquerade");
    }
    s.push_str("  }\n");

    s.push_str("  chain forward {\n    type filter hook forward priority filter; policy accept;\n");
    s.push_str("    ct state established,related accept\n");
    s.push_str(
        "    iifname @bridges ip daddr @egress_deny reject with icmpx type admin-prohibited\n",
    );
    s.push_str("    ct status dnat oifname @bridges accept\n");
    for b in &bridges {
        let _ = writeln!(s, "    iifname \"{0}\" oifname \"{0}\" accept", b.bridge);
    }
    s.push_str("    iifname @bridges oifname @bridges drop\n");
    s.push_str("    iifname @bridges accept\n    oifname @bridges drop\n  }\n");

    s.push_str("  chain guard {\n    type filter hook prerouting priority raw; policy accept;\n");
    s.push_str("    iifname @bridges ip daddr 127.0.0.0/8 drop\n");
    for b in &bridges {
        let _ = writeln!(
            s,
            "    iifname \"{}\" ip saddr != {} drop",
            b.bridge, b.subnet
        );
    }
    s.push_str("  }\n");

    s.push_str("  chain input {\n    type filter hook input priority filter; policy accept;\n");
    s.push_str("    iifname != @bridges accept\n");
    s.push_str("    ct state established,related accept\n");
    s.push_str("    iifname . ip daddr @vip_access accept\n");
    for b in &bridges {
        for p in ["udp", "tcp"] {
            let _ = writeln!(
                s,
                "    iifname \"{}\" ip daddr {} {p} dport 53 accept",
                b.bridge,
                b.subnet.gateway()
            );
        }
    }
    s.push_str("    meta l4proto tcp reject with tcp reset\n");
    s.push_str("    reject with icmpx type admin-prohibited\n");
    s.push_str("  }\n}\n");
    s
}

fn push_elements(s: &mut String, elements: &[String]) {
    if !elements.is_empty() {
        let _ = writeln!(s, "    elements = {{ {} }}", elements.join(", "));
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn published_ports_round_trip_through_their_label_form() {
        let p: PublishedPort = "udp/0.0.0.0:5353->10.201.5.3:53".parse().unwrap();
        assert_eq!(p.proto, Proto::Udp);
        assert!(p.host_ip.is_unspecified());
        assert_eq!((p.host_port, p.container_port), (5353, 53));
        assert_eq!(p.to_string(), "udp/0.0.0.0:5353->10.201.5.3:53");
        for bad in [
            "",
            "sctp/1.2.3.4:1->1.2.3.4:2",
            "tcp/1.2.3.4:1",
            "tcp/1.2.3.4:99999->1.2.3.4:2",
        ] {
            assert!(bad.parse::<PublishedPort>().is_err(), "{bad}");
        }
    }

    #[test]
    fn no_bridge_reaches_the_mesh_link_local_or_the_deny_list() {
        let bridge = |name: &str, slot, scope: &str| BridgeRules {
            bridge: name.into(),
            subnet: Subnet::from_slot(slot),
            scope: scope.into(),
        };
        let state = FirewallState {
            bridges: vec![
                bridge("ztbr5", 5, "zt-p-prod"),
                bridge("ztbr9", 9, BUILD_SCOPE),
            ],
            egress_deny: vec!["192.168.7.9/16".parse().unwrap()],
            ..FirewallState::default()
        };
        let text = render("zattera_t", &state);
        assert!(
            text.contains("elements = { 10.90.0.0/16, 169.254.0.0/16, 192.168.0.0/16 }"),
            "{text}"
        );
        let reject =
            "    iifname @bridges ip daddr @egress_deny reject with icmpx type admin-prohibited";
        // Before anything accepts a new flow out of a bridge, DNATed ones
        // included (a DNAT to a container never reaches the mesh anyway).
        assert!(text.find(reject) < text.find("    ct status dnat oifname @bridges accept"));
        assert!(text.find(reject) < text.find("    iifname @bridges accept"));
        // From a bridge, a mesh address DNATs ports published to every
        // address only.
        let prerouting = &text[text.find("chain prerouting").unwrap()..];
        assert!(prerouting.starts_with(
            "chain prerouting {\n    type nat hook prerouting priority dstnat; policy accept;\n    iifname @bridges ip daddr 10.90.0.0/16 goto world_ports\n"
        ));
        let world = &text[text.find("chain world_ports").unwrap()..];
        let world = &world[..world.find("  }").unwrap()];
        assert!(
            world.contains("@puball_tcp") && !world.contains("@pub_tcp"),
            "{world}"
        );
    }

    #[test]
    fn ranges_parse_with_their_host_bits_cleared() {
        let c: Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert_eq!(
            "0.0.0.0/0".parse::<Cidr>().unwrap().to_string(),
            "0.0.0.0/0"
        );
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "10.0.0.0/-1"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn renders_one_atomic_replacement_of_our_table_only() {
        let state = FirewallState {
            bridges: vec![
                BridgeRules {
                    bridge: "ztbr5".into(),
                    subnet: Subnet::from_slot(5),
                    scope: "zt-p-prod".into(),
                },
                BridgeRules {
                    bridge: "ztbr6".into(),
                    subnet: Subnet::from_slot(6),
                    scope: "zt-p-staging".into(),
                },
            ],
            published: vec![
                PublishedPort {
                    proto: Proto::Tcp,
                    host_ip: Ipv4Addr::LOCALHOST,
                    host_port: 8080,
                    container_ip: Ipv4Addr::new(10, 201, 5, 2),
                    container_port: 80,
                },
                PublishedPort {
                    proto: Proto::Udp,
                    host_ip: Ipv4Addr::UNSPECIFIED,
                    host_port: 5353,
                    container_ip: Ipv4Addr::new(10, 201, 5, 3),
                    container_port: 53,
                },
            ],
            vips: Vec::new(),
            egress_deny: Vec::new(),
        };
        let mut state = state;
        state.vips = vec![
            ScopedVip {
                addr: Ipv4Addr::new(10, 97, 0, 5),
                scope: "zt-p-prod".into(),
            },
            ScopedVip {
                addr: Ipv4Addr::new(10, 97, 0, 6),
                scope: String::new(),
            },
        ];
        let script = render("zattera_t", &state);
        assert!(script.contains("elements = { 10.97.0.5, 10.97.0.6 }"));
        // Only prod's bridge may reach prod's VIP; nobody the unscoped one.
        assert!(
            script.contains("elements = { \"ztbr5\" . 10.97.0.5 }"),
            "{script}"
        );
        assert!(script.contains("iifname . ip daddr @vip_access accept"));
        // From a bridge, anything not accepted above is refused.
        assert!(
            script.contains("iifname != @bridges accept\n    ct state established,related accept")
        );
        assert!(script.contains("    meta l4proto tcp reject with tcp reset\n"));
        // Before routing: no loopback destinations, no foreign sources.
        assert!(script.contains("type filter hook prerouting priority raw"));
        assert!(script.contains("iifname @bridges ip daddr 127.0.0.0/8 drop"));
        assert!(script.contains("iifname \"ztbr5\" ip saddr != 10.201.5.0/24 drop"));
        assert!(script.starts_with("table inet zattera_t\ndelete table inet zattera_t\n"));
        assert!(!script.contains("flush ruleset"));
        assert!(script.contains("127.0.0.1 . 8080 : 10.201.5.2 . 80"));
        assert!(script.contains("5353 : 10.201.5.3 . 53"));
        assert!(script.contains("ip saddr 10.201.5.0/24 oifname != @bridges masquerade"));
        assert!(script.contains("iifname \"ztbr5\" ip daddr 10.201.5.1 udp dport 53 accept"));
        // Every table the script names is ours.
        for line in script.lines().filter(|l| l.contains("table ")) {
            assert!(line.contains("inet zattera_t"), "{line}");
        }
        // Deterministic: the same state renders the same script.
        assert_eq!(script, render("zattera_t", &state));
    }
}
