//! From one validated manifest environment to wire assignments: the same
//! `Assignment` + `AssignmentRuntime` pairs a control plane would send, so
//! the executor cannot tell the sources apart.
//!
//! Decisions:
//! * Ids are `<project>-<app>-<env>-<index>` (index from 0), stable across
//!   reloads and restarts. Names are DNS labels without `--`, so the id is a
//!   valid containerd id; one longer than [`MAX_ASSIGNMENT_ID_LEN`] keeps a
//!   prefix and gains 8 hex digits of the full name, which leaves the
//!   executor 16 of containerd's 76 characters for an incarnation suffix.
//! * `config_hash` (and `release_id`, which is the same value) is 16 hex
//!   digits of SHA-256 over a canonical, length-prefixed encoding of everything the
//!   executor receives for the instance: project, app, environment, image,
//!   the protobuf encoding of the `ServiceSpec` without its replica range
//!   (deterministic: it has no map entries here), the sorted environment variables, the subnet and the
//!   requested host ports. Replica count and index are not in it, so scaling
//!   does not restart the instances that stay.
//! * A fixed `host_port` is requested through the desired
//!   `Assignment.mesh_port_bindings` (port name → host port), which a control
//!   plane never fills: in standalone mode the executor reads requested host
//!   ports from there. Only instance 0 of an environment asks for it (two
//!   replicas on one node cannot share a host port); the others get
//!   ephemeral ports like unpinned ports.
//! * The environment carries what control injects (runtime.md C-4): `PORT`
//!   (the first container port) unless the user set it, `ZATTERA_ENV` and
//!   `ZATTERA_APP`, which override the user's.

use std::collections::BTreeMap;
use std::time::Duration;

use prost::Message as _;
use sha2::{Digest as _, Sha256};
use zattera_netns::Subnet;

use super::manifest::{AppManifest, EnvSpec, HealthKind, PortProtocol};
use super::name::Name;
use crate::proto::cluster::AssignmentRuntime;
use crate::proto::v1::{
    Assignment, AssignmentDesired, HealthCheck, HealthCheckType, Meta, PortSpec, Protocol,
    ReplicaRange, ResourceLimits, ServiceSpec, VolumeMount,
};

/// Longest assignment id this source produces.
pub const MAX_ASSIGNMENT_ID_LEN: usize = 60;

/// One desired instance: what the control plane's set holds per id.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    pub assignment: Assignment,
    pub runtime: AssignmentRuntime,
}

impl Instance {
    pub fn id(&self) -> &str {
        self.assignment.meta.as_ref().map_or("", |m| m.id.as_str())
    }
}

/// The stable id of instance `index` of (project, app, env).
pub fn assignment_id(project: &Name, app: &Name, env: &Name, index: u32) -> String {
    let base = format!("{project}-{app}-{env}");
    let id = format!("{base}-{index}");
    if id.len() <= MAX_ASSIGNMENT_ID_LEN {
        return id;
    }
    let digest = hex::encode(Sha256::digest(format!("{project}/{app}/{env}")));
    let tail = format!("-{}-{index}", &digest[..8]);
    let keep = MAX_ASSIGNMENT_ID_LEN.saturating_sub(tail.len());
    // `base` is ASCII, so any byte index is a character boundary.
    let prefix = base[..keep.min(base.len())].trim_end_matches('-');
    format!("{prefix}{tail}")
}

/// The `replicas` instances of environment `env` of `m`, on `subnet`.
pub fn env_instances(m: &AppManifest, env: &Name, spec: &EnvSpec, subnet: Subnet) -> Vec<Instance> {
    let service = service_spec(spec, m);
    // The replica count shapes no container: scaling must not replace instances.
    let hashed_spec = ServiceSpec {
        replicas: None,
        ..service.clone()
    };
    let vars = injected_env(m, env, spec);
    let subnet_cidr = subnet.to_string();
    let fixed: BTreeMap<String, u32> = spec
        .ports
        .iter()
        .filter_map(|p| Some((p.name.to_string(), u32::from(p.host_port?))))
        .collect();
    (0..spec.replicas)
        .map(|index| {
            let bindings = if index == 0 {
                fixed.clone()
            } else {
                BTreeMap::new()
            };
            let hash = config_hash(&HashInput {
                project: m.project.as_str(),
                app: m.app.as_str(),
                environment: env.as_str(),
                image: &m.image,
                spec: &hashed_spec,
                env: &vars,
                subnet: &subnet_cidr,
                host_ports: &bindings,
            });
            let id = assignment_id(&m.project, &m.app, env, index);
            Instance {
                assignment: Assignment {
                    meta: Some(Meta {
                        id,
                        created_at: None,
                        updated_at: None,
                    }),
                    node_id: String::new(),
                    project_id: m.project.to_string(),
                    app_id: m.app.to_string(),
                    environment_id: env.to_string(),
                    release_id: hash.clone(),
                    deployment_id: String::new(),
                    desired: AssignmentDesired::Run as i32,
                    config_hash: hash,
                    mesh_port_bindings: bindings,
                    observed: None,
                    job_id: String::new(),
                },
                runtime: AssignmentRuntime {
                    image_ref: m.image.clone(),
                    spec: Some(service.clone()),
                    env: vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                    subnet_cidr: subnet_cidr.clone(),
                    volume_lease: None,
                },
            }
        })
        .collect()
}

/// The `ServiceSpec` of one environment, defaults explicit.
pub fn service_spec(spec: &EnvSpec, m: &AppManifest) -> ServiceSpec {
    let ports: Vec<PortSpec> = spec
        .ports
        .iter()
        .map(|p| PortSpec {
            name: p.name.to_string(),
            container_port: u32::from(p.container_port),
            protocol: match p.protocol {
                PortProtocol::Http => Protocol::Http,
                PortProtocol::Tcp => Protocol::Tcp,
                PortProtocol::Udp => Protocol::Udp,
            } as i32,
            public_l4_port: 0,
        })
        .collect();
    let healthcheck = m.healthcheck.as_ref().map(|h| {
        // H-4: no type means HTTP when the service declares a port, TCP otherwise.
        let kind = h.kind.unwrap_or(if ports.is_empty() {
            HealthKind::Tcp
        } else {
            HealthKind::Http
        });
        HealthCheck {
            r#type: match kind {
                HealthKind::Http => HealthCheckType::Http,
                HealthKind::Tcp => HealthCheckType::Tcp,
                HealthKind::Exec => HealthCheckType::Exec,
            } as i32,
            path: if kind == HealthKind::Http {
                h.path.clone()
            } else {
                String::new()
            },
            port: h.port.map_or(0, u32::from),
            command: h.command.clone().unwrap_or_default(),
            interval: Some(duration(h.interval)),
            timeout: Some(duration(h.timeout)),
            grace_period: Some(duration(h.grace_period)),
            unhealthy_threshold: h.unhealthy_threshold,
        }
    });
    ServiceSpec {
        replicas: Some(ReplicaRange {
            min: spec.replicas,
            max: spec.replicas,
        }),
        autoscale: None,
        resources: Some(ResourceLimits {
            cpu_millis: spec.resources.cpu_millis,
            memory_mb: spec.resources.memory_mb,
        }),
        ports,
        healthcheck,
        scale_to_zero: false,
        max_concurrency: 0,
        stateful: false,
        volumes: spec
            .volumes
            .iter()
            .map(|v| VolumeMount {
                volume_name: v.name.to_string(),
                mount_path: v.mount_path.clone(),
            })
            .collect(),
        cron: Vec::new(),
        stop_grace: Some(duration(spec.stop_grace)),
        command: spec.command.clone().unwrap_or_default(),
        // The wire has no pids limit; standalone carries the manifest's here
        // (no scheduler reads it), and only standalone executors honour it.
        placement_constraints: if spec.resources.pids > 0 {
            BTreeMap::from([(
                crate::labels::PIDS_LIMIT_KEY.to_owned(),
                spec.resources.pids.to_string(),
            )])
        } else {
            BTreeMap::new()
        },
        rate_limit: None,
        read_only_rootfs: spec.read_only_rootfs,
    }
}

/// Variables plus what control injects (runtime.md C-4).
pub fn injected_env(m: &AppManifest, env: &Name, spec: &EnvSpec) -> BTreeMap<String, String> {
    let mut vars = spec.variables.clone();
    if let Some(first) = spec.ports.first() {
        vars.entry("PORT".to_owned())
            .or_insert_with(|| first.container_port.to_string());
    }
    vars.insert("ZATTERA_ENV".to_owned(), env.to_string());
    vars.insert("ZATTERA_APP".to_owned(), m.app.to_string());
    vars
}

/// Everything that shapes one instance's container.
struct HashInput<'a> {
    project: &'a str,
    app: &'a str,
    environment: &'a str,
    image: &'a str,
    spec: &'a ServiceSpec,
    env: &'a BTreeMap<String, String>,
    subnet: &'a str,
    host_ports: &'a BTreeMap<String, u32>,
}

fn config_hash(input: &HashInput<'_>) -> String {
    // Each field is length-prefixed, so no two different inputs share bytes.
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update(u64::try_from(bytes.len()).unwrap_or(u64::MAX).to_le_bytes());
        hasher.update(bytes);
    };
    field(b"zattera-standalone-v1");
    for s in [input.project, input.app, input.environment, input.image] {
        field(s.as_bytes());
    }
    field(&input.spec.encode_to_vec());
    field(&input.env.len().to_le_bytes());
    for (k, v) in input.env {
        field(k.as_bytes());
        field(v.as_bytes());
    }
    field(input.subnet.as_bytes());
    let ports: BTreeMap<&str, u32> = input
        .host_ports
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    field(&ports.len().to_le_bytes());
    for (name, port) in ports {
        field(name.as_bytes());
        field(&port.to_le_bytes());
    }
    hex::encode(hasher.finalize())[..16].to_owned()
}

/// A wire duration; manifest durations are at most a day, so nothing overflows.
fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::runtime::validate_identifier;
    use crate::source::manifest::parse;

    const WEB: &str = r#"
[app]
name = "web"
project = "demo"
[build]
type = "image"
image = "docker.io/library/nginx:alpine"
[deploy.healthcheck]
type = "http"
path = "/"
interval = "5s"
[env.production]
replicas = 2
command = "nginx -g 'daemon off;'"
stop_grace = "20s"
[env.production.resources]
cpu_millis = 500
memory_mb = 256
[[env.production.ports]]
name = "http"
container_port = 80
protocol = "http"
host_port = 8080
[env.production.variables]
GREETING = "hello"
[[env.production.volumes]]
name = "data"
mount_path = "/data"
"#;

    fn name(s: &str) -> Name {
        Name::new(s).unwrap()
    }

    fn instances_of(text: &str, slot: u8) -> Vec<Instance> {
        let m = parse(text, Path::new("web.toml")).unwrap_or_else(|e| panic!("{e}"));
        m.envs
            .iter()
            .flat_map(|(env, spec)| env_instances(&m, env, spec, Subnet::from_slot(slot)))
            .collect()
    }

    fn hashes(text: &str) -> Vec<String> {
        instances_of(text, 3)
            .into_iter()
            .map(|i| i.assignment.config_hash)
            .collect()
    }

    #[test]
    fn ids_are_stable_and_valid_containerd_ids() {
        let (p, a, e) = (name("demo"), name("web"), name("production"));
        assert_eq!(assignment_id(&p, &a, &e, 0), "demo-web-production-0");
        assert_eq!(assignment_id(&p, &a, &e, 12), "demo-web-production-12");

        let long = name(&"x".repeat(63));
        let other = name(&format!("{}y", "x".repeat(62)));
        let id = assignment_id(&long, &long, &long, 7);
        assert!(id.len() <= MAX_ASSIGNMENT_ID_LEN, "{id}");
        assert!(id.ends_with("-7"), "{id}");
        assert_eq!(id, assignment_id(&long, &long, &long, 7), "stable");
        assert_ne!(id, assignment_id(&long, &long, &other, 7), "hash separates");
        for id in [
            id,
            assignment_id(&p, &a, &e, 0),
            assignment_id(&name("a-b"), &name("9"), &name(&"z".repeat(63)), 252),
        ] {
            validate_identifier(&id).unwrap();
            assert!(id.len() <= MAX_ASSIGNMENT_ID_LEN, "{id}");
        }
    }

    #[test]
    fn design_example_becomes_two_run_assignments() {
        let got = instances_of(WEB, 3);
        assert_eq!(got.len(), 2);
        for (i, inst) in got.iter().enumerate() {
            let a = &inst.assignment;
            assert_eq!(inst.id(), format!("demo-web-production-{i}"));
            assert_eq!(
                (
                    a.project_id.as_str(),
                    a.app_id.as_str(),
                    a.environment_id.as_str()
                ),
                ("demo", "web", "production")
            );
            assert_eq!(a.desired, AssignmentDesired::Run as i32);
            assert_eq!(a.config_hash.len(), 16);
            assert!(a.config_hash.bytes().all(|b| b.is_ascii_hexdigit()));
            assert_eq!(a.release_id, a.config_hash);
            assert!(a.node_id.is_empty() && a.job_id.is_empty());

            let r = &inst.runtime;
            assert_eq!(r.image_ref, "docker.io/library/nginx:alpine");
            assert_eq!(r.subnet_cidr, "10.201.3.0/24");
            assert!(r.volume_lease.is_none());
            let s = r.spec.as_ref().unwrap();
            assert_eq!(s.command, "nginx -g 'daemon off;'");
            assert_eq!(
                s.stop_grace,
                Some(prost_types::Duration {
                    seconds: 20,
                    nanos: 0
                })
            );
            assert_eq!(s.replicas, Some(ReplicaRange { min: 2, max: 2 }));
            assert_eq!(
                s.resources,
                Some(ResourceLimits {
                    cpu_millis: 500,
                    memory_mb: 256
                })
            );
            assert_eq!(
                s.ports,
                vec![PortSpec {
                    name: "http".into(),
                    container_port: 80,
                    protocol: Protocol::Http as i32,
                    public_l4_port: 0
                }]
            );
            assert_eq!(
                s.volumes,
                vec![VolumeMount {
                    volume_name: "data".into(),
                    mount_path: "/data".into()
                }]
            );
            assert!(!s.stateful, "stateful would fence on a volume lease (E-10)");
            let h = s.healthcheck.as_ref().unwrap();
            assert_eq!(h.r#type, HealthCheckType::Http as i32);
            assert_eq!(h.path, "/");
            assert_eq!(
                h.interval,
                Some(prost_types::Duration {
                    seconds: 5,
                    nanos: 0
                })
            );
            assert_eq!(
                h.timeout,
                Some(prost_types::Duration {
                    seconds: 5,
                    nanos: 0
                })
            );
            assert_eq!(
                h.grace_period,
                Some(prost_types::Duration {
                    seconds: 60,
                    nanos: 0
                })
            );
            assert_eq!(h.unhealthy_threshold, 3);
        }
        // The fixed host port is requested by instance 0 only.
        assert_eq!(
            got[0].assignment.mesh_port_bindings,
            BTreeMap::from([("http".to_owned(), 8080)])
        );
        assert!(got[1].assignment.mesh_port_bindings.is_empty());
        assert_ne!(got[0].assignment.config_hash, got[1].assignment.config_hash);
    }

    #[test]
    fn platform_variables_are_injected_as_control_would() {
        let env = |text: &str| instances_of(text, 0)[0].runtime.env.clone();
        let e = env(WEB);
        assert_eq!(e["PORT"], "80");
        assert_eq!(e["ZATTERA_ENV"], "production");
        assert_eq!(e["ZATTERA_APP"], "web");
        assert_eq!(e["GREETING"], "hello");
        assert_eq!(e.len(), 4);

        let user = WEB.replace(
            "GREETING = \"hello\"",
            "PORT = \"9000\"\nZATTERA_ENV = \"mine\"\nZATTERA_APP = \"mine\"",
        );
        let e = env(&user);
        assert_eq!(e["PORT"], "9000", "the user's PORT wins");
        assert_eq!(
            e["ZATTERA_ENV"], "production",
            "ZATTERA_ENV is the platform's"
        );
        assert_eq!(e["ZATTERA_APP"], "web", "ZATTERA_APP is the platform's");

        let no_ports = WEB.replace("[[env.production.ports]]\nname = \"http\"\ncontainer_port = 80\nprotocol = \"http\"\nhost_port = 8080\n", "");
        assert!(!no_ports.contains("container_port"));
        assert!(!env(&no_ports).contains_key("PORT"));
    }

    #[test]
    fn health_type_defaults_per_environment() {
        let untyped = WEB.replace("type = \"http\"\npath = \"/\"\n", "");
        let h = instances_of(&untyped, 0)[0]
            .runtime
            .spec
            .clone()
            .unwrap()
            .healthcheck
            .unwrap();
        assert_eq!(
            (h.r#type, h.path.as_str()),
            (HealthCheckType::Http as i32, "/healthz")
        );

        let portless = untyped.replace("[[env.production.ports]]\nname = \"http\"\ncontainer_port = 80\nprotocol = \"http\"\nhost_port = 8080\n", "");
        let h = instances_of(&portless, 0)[0]
            .runtime
            .spec
            .clone()
            .unwrap()
            .healthcheck
            .unwrap();
        assert_eq!(
            (h.r#type, h.path.as_str()),
            (HealthCheckType::Tcp as i32, "")
        );

        let none = WEB.replace(
            "[deploy.healthcheck]\ntype = \"http\"\npath = \"/\"\ninterval = \"5s\"\n",
            "",
        );
        assert!(
            instances_of(&none, 0)[0]
                .runtime
                .spec
                .clone()
                .unwrap()
                .healthcheck
                .is_none()
        );
    }

    #[test]
    fn config_hash_is_stable_and_follows_every_input() {
        let base = hashes(WEB);
        assert_eq!(base, hashes(WEB), "same input, same hashes");

        let edits = [
            ("image", WEB.replace("nginx:alpine", "nginx:1.27")),
            ("command", WEB.replace("daemon off;", "daemon off; ")),
            ("variable", WEB.replace("hello", "hallo")),
            (
                "new variable",
                WEB.replace("GREETING", "A = \"1\"\nGREETING"),
            ),
            (
                "container port",
                WEB.replace("container_port = 80", "container_port = 81"),
            ),
            (
                "protocol",
                WEB.replace("protocol = \"http\"", "protocol = \"tcp\""),
            ),
            (
                "port name",
                WEB.replace("name = \"http\"", "name = \"web\""),
            ),
            (
                "volume",
                WEB.replace("mount_path = \"/data\"", "mount_path = \"/srv\""),
            ),
            ("cpu", WEB.replace("cpu_millis = 500", "cpu_millis = 501")),
            ("memory", WEB.replace("memory_mb = 256", "memory_mb = 512")),
            (
                "health",
                WEB.replace("interval = \"5s\"", "interval = \"6s\""),
            ),
            (
                "stop grace",
                WEB.replace("stop_grace = \"20s\"", "stop_grace = \"21s\""),
            ),
            (
                "project",
                WEB.replace("project = \"demo\"", "project = \"demo2\""),
            ),
        ];
        for (what, text) in edits {
            let changed = hashes(&text);
            assert_eq!(changed.len(), base.len());
            for (a, b) in base.iter().zip(&changed) {
                assert_ne!(a, b, "editing the {what} must change every hash");
            }
        }
        // The host port only shapes the instance that publishes it.
        let moved = hashes(&WEB.replace("host_port = 8080", "host_port = 8081"));
        assert_ne!(moved[0], base[0]);
        assert_eq!(moved[1], base[1]);
        // Another subnet is another network.
        let other_subnet: Vec<String> = instances_of(WEB, 4)
            .into_iter()
            .map(|i| i.assignment.config_hash)
            .collect();
        assert_ne!(other_subnet, base);
        // Scaling keeps the instances that stay.
        let scaled = hashes(&WEB.replace("replicas = 2", "replicas = 3"));
        assert_eq!(scaled.len(), 3);
        assert_eq!(scaled[1], base[1]);
        assert_eq!(scaled[2], base[1]);
    }
}
