//! A plan for one bring-up (E-8): the container id, the subnet, and the
//! address and host ports the executor allocates for it, checked before
//! anything is made.

use std::net::Ipv4Addr;

use zattera_netns::{Proto, Subnet, SubnetError};

use super::alloc::{Alloc, AllocError, Allocation, WantedPort};
use super::diff;
use crate::labels::{self, NamedPort};
use crate::proto::cluster::AssignmentRuntime;
use crate::proto::v1::{Assignment, Protocol};

/// Everything decided before a bring-up starts: addresses and ports are
/// allocated by the executor, which owns IPAM.
#[derive(Debug, Clone)]
pub struct Plan {
    pub assignment: Assignment,
    pub runtime: AssignmentRuntime,
    pub container_id: String,
    pub subnet: Option<Subnet>,
    pub ip: Option<Ipv4Addr>,
    pub ports: Vec<NamedPort>,
    /// The runc shim it shares with others of its scope, if any.
    pub shim_group: Option<String>,
}

impl Plan {
    pub fn assignment_id(&self) -> &str {
        self.assignment.meta.as_ref().map_or("", |m| m.id.as_str())
    }

    /// The app's name: what control injects as ZATTERA_APP, else its id.
    pub fn app_name(&self) -> &str {
        self.runtime
            .env
            .get("ZATTERA_APP")
            .map_or(&self.assignment.app_id, |v| v)
    }

    /// The environment's name (ZATTERA_ENV), else its id.
    pub fn environment_name(&self) -> &str {
        self.runtime
            .env
            .get("ZATTERA_ENV")
            .map_or(&self.assignment.environment_id, |v| v)
    }

    pub(super) fn is_job(&self) -> bool {
        !self.assignment.job_id.is_empty()
    }
}

/// Where this node places instances.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placement {
    /// Where host ports are published.
    pub host_ip: Ipv4Addr,
    /// Where an assignment without a subnet goes.
    pub default_subnet: Option<Subnet>,
    /// Standalone: a port may ask for its host port (`mesh_port_bindings`).
    pub standalone: bool,
    /// Whether the agent manages the host's network at all.
    pub with_network: bool,
}

/// Allocates what a bring-up needs: container id, IP, host ports.
pub(super) fn plan(
    alloc: &mut Alloc,
    cfg: Placement,
    a: &Assignment,
    rt: &AssignmentRuntime,
) -> Result<Plan, PlanError> {
    let id = a.meta.as_ref().map(|m| m.id.clone()).unwrap_or_default();
    let container_id = labels::container_id(&id, &a.config_hash);
    let subnet = diff::wanted_subnet(rt, cfg.default_subnet)?;
    let spec = rt.spec.clone().unwrap_or_default();
    for p in &spec.ports {
        if u16::try_from(p.container_port).is_err() {
            return Err(PlanError::ContainerPort {
                name: p.name.clone(),
                port: p.container_port,
            });
        }
    }
    let wanted: Vec<WantedPort> = spec
        .ports
        .iter()
        .map(|p| WantedPort {
            name: p.name.clone(),
            proto: if p.protocol == Protocol::Udp as i32 {
                Proto::Udp
            } else {
                Proto::Tcp
            },
            container_port: u16::try_from(p.container_port).unwrap_or_default(),
            requested: if cfg.standalone {
                a.mesh_port_bindings
                    .get(&p.name)
                    .and_then(|v| u16::try_from(*v).ok())
                    .filter(|v| *v > 0)
            } else {
                None
            },
        })
        .collect();
    // Without the host's networking an instance gets neither.
    let on_network = subnet.filter(|_| cfg.with_network);
    let Allocation { ip, ports } =
        alloc.allocate(&container_id, on_network, cfg.host_ip, &wanted)?;
    let scope = zattera_netns::network_name(&a.project_id, &a.environment_id);
    let shim_group = alloc.shim_group(&scope, &container_id);
    Ok(Plan {
        assignment: a.clone(),
        runtime: rt.clone(),
        container_id,
        subnet,
        ip,
        ports,
        shim_group,
    })
}

/// Why an assignment could not be planned; the text is its FAILED message.
#[derive(Debug, thiserror::Error)]
pub(super) enum PlanError {
    #[error("ensure network: {0}")]
    Subnet(#[from] SubnetError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error("create: port {name}: container_port {port} is not a port")]
    ContainerPort { name: String, port: u32 },
}

impl PlanError {
    /// Retried every pass without counting toward parking (E-9): a host
    /// port held by another process frees by itself.
    pub(super) fn is_transient(&self) -> bool {
        matches!(self, Self::Alloc(e) if e.is_transient())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::executor::shim_groups::ShimGroups;
    use crate::proto::v1::{Meta, PortSpec, ServiceSpec};

    /// Addresses and ports from `range`; no shared shims.
    fn alloc(range: zattera_netns::PortRange) -> Alloc {
        Alloc::new(range, ShimGroups::default())
    }

    fn assignment(bindings: &[(&str, u32)]) -> Assignment {
        Assignment {
            meta: Some(Meta {
                id: "a1".into(),
                ..Meta::default()
            }),
            config_hash: "h1".into(),
            mesh_port_bindings: bindings
                .iter()
                .map(|(n, p)| ((*n).to_owned(), *p))
                .collect(),
            ..Assignment::default()
        }
    }

    fn runtime(ports: &[(&str, u32)]) -> AssignmentRuntime {
        AssignmentRuntime {
            subnet_cidr: "10.201.64.0/24".into(),
            spec: Some(ServiceSpec {
                ports: ports
                    .iter()
                    .map(|(name, port)| PortSpec {
                        name: (*name).into(),
                        container_port: *port,
                        ..PortSpec::default()
                    })
                    .collect(),
                ..ServiceSpec::default()
            }),
            ..AssignmentRuntime::default()
        }
    }

    fn placement(standalone: bool, with_network: bool) -> Placement {
        Placement {
            host_ip: Ipv4Addr::LOCALHOST,
            default_subnet: None,
            standalone,
            with_network,
        }
    }

    /// A free port on loopback for a fixed binding, above the kernel's
    /// ephemeral ports, so that no other test's client takes it meanwhile.
    fn free_port() -> u16 {
        (64_950..65_000)
            .find(|p| std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, *p)).is_ok())
            .expect("a free port in 64950-64999")
    }

    #[test]
    fn a_port_that_is_no_port_fails_the_plan_before_anything_is_taken() {
        let mut alloc = alloc(zattera_netns::PortRange {
            lo: 64_400,
            hi: 64_409,
        });
        let e = plan(
            &mut alloc,
            placement(false, true),
            &assignment(&[]),
            &runtime(&[("http", 80), ("bad", 70_000)]),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "create: port bad: container_port 70000 is not a port"
        );
        assert!(alloc.addresses(Subnet::from_slot(64)).is_empty());
    }

    #[test]
    fn standalone_binds_the_port_its_manifest_asks_for_and_control_never_does() {
        let fixed = free_port();
        let a = assignment(&[("http", u32::from(fixed))]);
        let rt = runtime(&[("http", 80)]);
        let range = zattera_netns::PortRange {
            lo: 64_500,
            hi: 64_509,
        };
        let p = plan(&mut alloc(range), placement(true, true), &a, &rt).unwrap();
        assert_eq!(p.container_id, labels::container_id("a1", "h1"));
        assert_eq!(p.ports[0].port.host_port, fixed);
        assert_eq!(p.ip, Some(Subnet::from_slot(64).host(2)));
        let p = plan(&mut alloc(range), placement(false, true), &a, &rt).unwrap();
        assert!(range.contains(p.ports[0].port.host_port), "from the range");
    }

    #[test]
    fn without_the_hosts_network_an_instance_gets_no_address_or_port() {
        let p = plan(
            &mut alloc(zattera_netns::PortRange {
                lo: 64_600,
                hi: 64_609,
            }),
            placement(false, false),
            &assignment(&[]),
            &runtime(&[("http", 80)]),
        )
        .unwrap();
        assert_eq!((p.ip, p.ports.len()), (None, 0));
        assert_eq!(
            p.subnet,
            Some(Subnet::from_slot(64)),
            "its subnet is still its own"
        );
    }
}
