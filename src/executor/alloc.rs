//! Addresses and host ports for the executor's instances: one owner of IPAM
//! and of the sockets that hold published ports, so that what one bring-up
//! took is given back together, whether the plan fails half-way, the
//! bring-up fails, or the container goes.
//!
//! Nothing here is persisted: the records are the containers' labels
//! ([`OwnedContainer`]), read back at boot ([`Alloc::adopt`]).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use zattera_netns::{HostPorts, IpRecord, Ipam, PortRange, Proto, PublishedPort, Subnet};

use super::shim_groups::ShimGroups;
use crate::labels::{NamedPort, OwnedContainer};

/// A port of the spec, as the allocation needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedPort {
    pub name: String,
    pub proto: Proto,
    pub container_port: u16,
    /// A fixed host port (standalone manifests); `None` takes one from the
    /// range.
    pub requested: Option<u16>,
}

/// What one bring-up was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub ip: Option<Ipv4Addr>,
    pub ports: Vec<NamedPort>,
}

#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    #[error("ensure network: {0}")]
    Ip(Box<zattera_netns::Error>),
    #[error("create: port {name}: {source}")]
    HostPort {
        name: String,
        source: Box<zattera_netns::Error>,
    },
}

impl AllocError {
    /// A host port that another process holds frees by itself: worth
    /// trying again without counting it as the instance's failure.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::HostPort { source, .. } if source.is_port_in_use())
    }
}

#[derive(Debug)]
pub struct Alloc {
    ipam: Ipam,
    ports: HostPorts,
    shims: ShimGroups,
}

impl Alloc {
    pub fn new(range: PortRange, shims: ShimGroups) -> Self {
        Self {
            ipam: Ipam::default(),
            ports: HostPorts::new(range),
            shims,
        }
    }

    /// At boot: the addresses of the containers found. A record IPAM
    /// refuses (two holders of one address) leaves IPAM empty, as before:
    /// the containers keep their addresses, and new ones may clash.
    pub fn adopt<'a>(&mut self, owned: impl IntoIterator<Item = &'a OwnedContainer>) {
        let owned: Vec<&OwnedContainer> = owned.into_iter().collect();
        self.shims.adopt(owned.iter().copied());
        let records: Vec<IpRecord> = owned
            .iter()
            .filter_map(|o| {
                Some(IpRecord {
                    holder: o.container_id.clone(),
                    ip: o.ip?,
                })
            })
            .collect();
        self.ipam = Ipam::from_records(&records).unwrap_or_default();
    }

    /// Holds every host port a found container publishes; all or none.
    pub fn hold(&mut self, o: &OwnedContainer) -> Result<(), zattera_netns::Error> {
        for (i, p) in o.ports.iter().enumerate() {
            if let Err(e) = self
                .ports
                .hold(p.port.proto, p.port.host_ip, p.port.host_port)
            {
                self.release_ports(&o.ports[..i]);
                return Err(e);
            }
        }
        Ok(())
    }

    /// An address on `subnet` (when the instance has a network) and a host
    /// port on `host_ip` for each wanted port; on any failure nothing stays
    /// taken.
    pub fn allocate(
        &mut self,
        container_id: &str,
        subnet: Option<Subnet>,
        host_ip: Ipv4Addr,
        wanted: &[WantedPort],
    ) -> Result<Allocation, AllocError> {
        let Some(subnet) = subnet else {
            return Ok(Allocation {
                ip: None,
                ports: Vec::new(),
            });
        };
        let ip = self
            .ipam
            .allocate(subnet, container_id)
            .map_err(|e| AllocError::Ip(Box::new(e)))?;
        let mut ports = Vec::with_capacity(wanted.len());
        for w in wanted {
            match self.ports.allocate(w.proto, host_ip, w.requested) {
                Ok(host_port) => ports.push(NamedPort {
                    name: w.name.clone(),
                    port: PublishedPort {
                        proto: w.proto,
                        host_ip,
                        host_port,
                        container_ip: ip,
                        container_port: w.container_port,
                    },
                }),
                Err(e) => {
                    self.release_ports(&ports);
                    self.ipam.release(container_id, ip);
                    return Err(AllocError::HostPort {
                        name: w.name.clone(),
                        source: Box::new(e),
                    });
                }
            }
        }
        Ok(Allocation {
            ip: Some(ip),
            ports,
        })
    }

    /// The runc shim a new container of `scope` shares, if any.
    pub fn shim_group(&mut self, scope: &str, container_id: &str) -> Option<String> {
        self.shims.assign(scope, container_id)
    }

    /// The container's task runs: its shim is free for the next bring-up.
    pub fn brought_up(&mut self, container_id: &str) {
        self.shims.brought_up(container_id);
    }

    /// Gives back what a bring-up or a container had.
    pub fn release(&mut self, container_id: &str, ip: Option<Ipv4Addr>, ports: &[NamedPort]) {
        self.shims.release(container_id);
        if let Some(ip) = ip {
            self.ipam.release(container_id, ip);
        }
        self.release_ports(ports);
    }

    /// The addresses held on `subnet`, with their holders.
    pub fn addresses(&self, subnet: Subnet) -> Vec<IpRecord> {
        self.ipam.held(subnet)
    }

    /// Whether the port's socket is ours: only those are published.
    pub fn is_held(&self, p: &PublishedPort) -> bool {
        self.ports.is_held(p.proto, p.host_ip, p.host_port)
    }

    /// The ports to publish, marked: see [`Alloc::retire_through`].
    pub fn published(
        &mut self,
        owned: &BTreeMap<String, OwnedContainer>,
    ) -> (Vec<PublishedPort>, u64) {
        let published = owned
            .values()
            .flat_map(|o| o.ports.iter().map(|p| p.port))
            .filter(|p| self.is_held(p))
            .collect();
        (published, self.ports.mark())
    }

    /// The rules of the set marked `mark` are in place: the sockets of the
    /// ports released before it close.
    pub fn retire_through(&mut self, mark: u64) {
        self.ports.retire_through(mark);
    }

    fn release_ports(&mut self, ports: &[NamedPort]) {
        for p in ports {
            self.ports
                .release(p.port.proto, p.port.host_ip, p.port.host_port);
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn wanted(name: &str, requested: Option<u16>) -> WantedPort {
        WantedPort {
            name: name.into(),
            proto: Proto::Tcp,
            container_port: 80,
            requested,
        }
    }

    /// A free range of ten ports on loopback, and the first of it: above
    /// the kernel's ephemeral ports (to 60999), which other tests' clients
    /// take at any moment, and each test in a `band` of its own, as they
    /// run in parallel.
    fn free_range(band: u16) -> (PortRange, u16) {
        let from = 62_000 + band * 600;
        for lo in (from..from + 600).step_by(11) {
            let hi = lo + 9;
            if (lo..=hi).all(|p| TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok()) {
                return (PortRange { lo, hi }, lo);
            }
        }
        panic!("no free range of ten ports on loopback");
    }

    #[test]
    fn a_failed_port_gives_back_the_address_and_the_ports_before_it() {
        let (range, lo) = free_range(0);
        let mut alloc = Alloc::new(range, ShimGroups::default());
        let subnet = Subnet::from_slot(77);
        // Someone else holds the fixed port the second one asks for.
        let taken = TcpListener::bind((Ipv4Addr::LOCALHOST, lo + 5)).unwrap();
        let err = alloc
            .allocate(
                "c1",
                Some(subnet),
                Ipv4Addr::LOCALHOST,
                &[wanted("http", Some(lo)), wanted("admin", Some(lo + 5))],
            )
            .unwrap_err();
        assert!(err.to_string().starts_with("create: port admin: "), "{err}");
        assert!(
            err.is_transient(),
            "a port another process holds frees by itself"
        );
        drop(taken);
        // Nothing stayed taken: no address, and the same ports again.
        assert!(alloc.addresses(subnet).is_empty());
        let got = alloc
            .allocate(
                "c1",
                Some(subnet),
                Ipv4Addr::LOCALHOST,
                &[wanted("http", Some(lo)), wanted("admin", Some(lo + 5))],
            )
            .unwrap();
        let ports: Vec<u16> = got.ports.iter().map(|p| p.port.host_port).collect();
        assert_eq!(ports, vec![lo, lo + 5]);
        assert!(
            got.ports
                .iter()
                .all(|p| Some(p.port.container_ip) == got.ip)
        );
    }

    #[test]
    fn released_ports_stay_bound_until_the_rules_let_go() {
        let (range, lo) = free_range(1);
        let mut alloc = Alloc::new(range, ShimGroups::default());
        let subnet = Subnet::from_slot(78);
        let got = alloc
            .allocate(
                "c1",
                Some(subnet),
                Ipv4Addr::LOCALHOST,
                &[wanted("http", Some(lo))],
            )
            .unwrap();
        let port = got.ports[0].port;
        assert!(alloc.is_held(&port));
        alloc.release("c1", got.ip, &got.ports);
        assert!(!alloc.is_held(&port));
        // The socket stays until the rules of a set without it are in
        // place: a rule may still point at it.
        let (published, mark) = alloc.published(&BTreeMap::new());
        assert!(published.is_empty());
        assert!(TcpListener::bind((Ipv4Addr::LOCALHOST, lo)).is_err());
        alloc.retire_through(mark);
        assert!(TcpListener::bind((Ipv4Addr::LOCALHOST, lo)).is_ok());
        // The address is free again too.
        assert!(alloc.addresses(subnet).is_empty());
    }

    #[test]
    fn adoption_keeps_found_addresses_and_holds_their_ports_all_or_none() {
        let (range, lo) = free_range(2);
        let subnet = Subnet::from_slot(79);
        let found = |id: &str, ip: Ipv4Addr, ports: &[u16]| OwnedContainer {
            container_id: id.into(),
            ip: Some(ip),
            subnet: Some(subnet),
            ports: ports
                .iter()
                .map(|p| NamedPort {
                    name: format!("p{p}"),
                    port: PublishedPort {
                        proto: Proto::Tcp,
                        host_ip: Ipv4Addr::LOCALHOST,
                        host_port: *p,
                        container_ip: ip,
                        container_port: 80,
                    },
                })
                .collect(),
            ..OwnedContainer::default()
        };
        let a = found("a", subnet.host(2), &[lo]);
        let b = found("b", subnet.host(3), &[lo + 1, lo + 2]);
        let mut alloc = Alloc::new(range, ShimGroups::default());
        alloc.adopt([&a, &b]);
        alloc.hold(&a).unwrap();
        // b's second port was taken while the agent was down.
        let taken = TcpListener::bind((Ipv4Addr::LOCALHOST, lo + 2)).unwrap();
        assert!(alloc.hold(&b).is_err());
        assert!(
            !alloc.is_held(&b.ports[0].port),
            "none of b's ports stays held"
        );
        drop(taken);
        // A new instance gets neither found address.
        let new = alloc
            .allocate("c", Some(subnet), Ipv4Addr::LOCALHOST, &[])
            .unwrap();
        assert_eq!(new.ip, Some(subnet.host(4)));
    }

    #[test]
    fn an_instance_without_a_network_takes_nothing() {
        let (range, _) = free_range(3);
        let mut alloc = Alloc::new(range, ShimGroups::default());
        let got = alloc
            .allocate("c1", None, Ipv4Addr::LOCALHOST, &[wanted("http", None)])
            .unwrap();
        assert_eq!(
            got,
            Allocation {
                ip: None,
                ports: vec![]
            }
        );
    }
}
