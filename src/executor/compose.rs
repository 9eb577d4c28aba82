//! What a container is made of, computed before anything is made (issue
//! 55, netavark's validate-before-setup, youki's builder): from the plan,
//! the image's config, the resolved user and the node's facts, the OCI
//! spec, every label, the log path, the stop signal and grace, the volumes
//! to mount and the files to write. No I/O: "this ServiceSpec gives this
//! container" is a table test here, not a rig test.
//!
//! A new ServiceSpec field lands in the wire (`proto/`), the manifest key
//! (`source/manifest.rs`, `source/assign.rs`), one line here and
//! `runtime/spec.rs`, with one row in the tests below.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use zattera_netns::Subnet;

use super::plan::Plan;
use crate::labels;
use crate::layout::Layout;
use crate::logs::files::StreamMeta;
use crate::proto::v1::ServiceSpec;
use crate::runtime::LocalImage;
use crate::runtime::spec::{self, BindMount, ContainerSpec, ProcessUser};
use crate::volumes::VolumeError;

/// The grace when the spec names none (wire.md `ServiceSpec.stop_grace`).
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);

/// What the image says about running it (its OCI config).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageFacts {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: String,
    pub stop_signal: Option<String>,
    /// The image's OCI architecture, for the seccomp filter.
    pub architecture: String,
}

impl ImageFacts {
    pub fn of(image: &LocalImage) -> Self {
        let cfg = image.config.config().clone().unwrap_or_default();
        Self {
            entrypoint: cfg.entrypoint().clone().unwrap_or_default(),
            cmd: cfg.cmd().clone().unwrap_or_default(),
            env: cfg.env().clone().unwrap_or_default(),
            working_dir: cfg.working_dir().clone().unwrap_or_default(),
            stop_signal: cfg.stop_signal().clone(),
            architecture: image.config.architecture().to_string(),
        }
    }
}

/// What the node decides for every container it runs.
#[derive(Debug, Clone)]
pub struct NodeFacts {
    pub layout: Layout,
    /// Containers' cgroups are `<parent>/<container id>`.
    pub cgroup_parent: String,
    pub cgroup_v2: bool,
    /// The node's pids limit (0: none).
    pub pids_limit: u32,
    /// Standalone manifests may ask for a lower pids limit.
    pub standalone: bool,
    /// The node-local default network, whose DNS is the host's.
    pub default_subnet: Option<Subnet>,
    /// The node attaches containers to networks (`false` in some tests).
    pub networked: bool,
}

/// One named volume of the spec, mounted at `mount_path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeUse {
    /// The spec's name for it.
    pub name: String,
    /// Its directory's name on this node.
    pub local: String,
    pub mount_path: String,
}

/// Everything the container is made of.
#[derive(Debug, Clone)]
pub struct Composed {
    pub container_id: String,
    pub hostname: String,
    pub spec: oci_spec::runtime::Spec,
    pub labels: HashMap<String, String>,
    pub log_path: PathBuf,
    pub log_meta: StreamMeta,
    pub stop_signal: u32,
    pub stop_grace: Duration,
    pub volumes: Vec<VolumeUse>,
    /// Where its `/etc` files are written, and the nameserver they name
    /// (the environment's gateway; `None`: the host's resolvers).
    pub files_dir: PathBuf,
    pub gateway: Option<Ipv4Addr>,
}

/// Why a plan cannot make a container.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ComposeError {
    #[error("the image has no command and none was given")]
    NoCommand,
    #[error("{0}")]
    Env(String),
    #[error("{0}")]
    StopSignal(String),
    #[error("volume {name}: {error}")]
    Volume { name: String, error: VolumeError },
    #[error("spec: {0}")]
    Spec(String),
}

/// The files mounted over the image's `/etc`, in `dir`.
pub const ETC_FILES: [(&str, &str); 3] = [
    ("resolv.conf", "/etc/resolv.conf"),
    ("hosts", "/etc/hosts"),
    ("hostname", "/etc/hostname"),
];

/// The container `plan` makes from `image`, run as `user`, in network
/// namespace `netns`.
pub fn compose(
    plan: &Plan,
    image: &ImageFacts,
    user: ProcessUser,
    netns: Option<PathBuf>,
    node: &NodeFacts,
) -> Result<Composed, ComposeError> {
    let input = plan.runtime.spec.clone().unwrap_or_default();
    let cid = plan.container_id.clone();
    let hostname = hostname_of(&cid);

    let volumes = volume_uses(plan, &input)?;
    let files_dir = node.layout.container_files(&cid);
    let mounts: Vec<BindMount> = volumes
        .iter()
        .map(|v| BindMount {
            source: crate::volumes::volume_root(&node.layout.data_dir, &v.local),
            destination: v.mount_path.clone(),
            readonly: false,
        })
        .chain(ETC_FILES.iter().map(|(file, inside)| BindMount {
            source: files_dir.join(file),
            destination: (*inside).to_owned(),
            readonly: false,
        }))
        .collect();

    let args = spec::process_args(&image.entrypoint, &image.cmd, &input.command, plan.is_job());
    if args.is_empty() {
        return Err(ComposeError::NoCommand);
    }
    let mut env_pairs: Vec<(&str, &str)> = plan
        .runtime
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env_pairs.sort_unstable();
    let env = spec::process_env(&hostname, &image.env, env_pairs).map_err(ComposeError::Env)?;
    let stop_signal =
        spec::stop_signal(image.stop_signal.as_deref()).map_err(ComposeError::StopSignal)?;
    let stop_grace = input
        .stop_grace
        .and_then(|d| Duration::try_from(d).ok())
        .filter(|d| !d.is_zero())
        .unwrap_or(DEFAULT_STOP_GRACE);
    let resources = input.resources.unwrap_or_default();
    let container = ContainerSpec {
        hostname: hostname.clone(),
        args,
        env,
        cwd: image.working_dir.clone(),
        user,
        mounts,
        cpu_millis: resources.cpu_millis,
        memory_mb: resources.memory_mb,
        pids_limit: i64::from(pids_limit(node, &input)),
        netns,
        cgroups_path: PathBuf::from(&node.cgroup_parent).join(&cid),
        image_architecture: image.architecture.clone(),
        cgroup_v2: node.cgroup_v2,
        shim_group: plan.shim_group.clone(),
        read_only_rootfs: input.read_only_rootfs,
    };
    let spec = spec::build(&container).map_err(|e| ComposeError::Spec(e.to_string()))?;

    let log_path = node.layout.log_path(&cid);
    let labels = container_labels(plan, stop_signal, stop_grace, &log_path);
    let gateway = plan
        .subnet
        .filter(|s| node.networked && plan.ip.is_some() && Some(*s) != node.default_subnet)
        .map(Subnet::gateway);
    Ok(Composed {
        log_meta: StreamMeta {
            assignment_id: plan.assignment_id().to_owned(),
            project_id: plan.assignment.project_id.clone(),
            app_id: plan.assignment.app_id.clone(),
            environment_id: plan.assignment.environment_id.clone(),
            job_id: plan.assignment.job_id.clone(),
        },
        container_id: cid,
        hostname,
        spec,
        labels,
        log_path,
        stop_signal,
        stop_grace,
        volumes,
        files_dir,
        gateway,
    })
}

/// The whole container id (a DNS label holds 63): Docker's 12-character
/// prefix of a random id is unique, a prefix of ours would not be (C-11).
pub fn hostname_of(container_id: &str) -> String {
    container_id.chars().take(63).collect()
}

fn volume_uses(plan: &Plan, input: &ServiceSpec) -> Result<Vec<VolumeUse>, ComposeError> {
    input
        .volumes
        .iter()
        .map(|v| {
            let failed = |error| ComposeError::Volume {
                name: v.volume_name.clone(),
                error,
            };
            let local = crate::volumes::local_name(&plan.assignment.environment_id, &v.volume_name)
                .map_err(failed)?;
            crate::volumes::check_mount_path(&v.mount_path).map_err(failed)?;
            Ok(VolumeUse {
                name: v.volume_name.clone(),
                local,
                mount_path: v.mount_path.clone(),
            })
        })
        .collect()
}

/// What the container's record says of it: ownership, names, address,
/// ports, how to stop it, its log, its shim group, whether it restarts.
fn container_labels(
    plan: &Plan,
    stop_signal: u32,
    stop_grace: Duration,
    log_path: &std::path::Path,
) -> HashMap<String, String> {
    let mut labels = labels::ownership(&plan.assignment);
    labels.insert(labels::NAME.into(), labels::display_name(&plan.assignment));
    labels.insert(labels::APP_NAME.into(), plan.app_name().to_owned());
    labels.insert(labels::ENV_NAME.into(), plan.environment_name().to_owned());
    if let (Some(ip), Some(subnet)) = (plan.ip, plan.subnet) {
        labels.insert(labels::IP.into(), ip.to_string());
        labels.insert(labels::SUBNET.into(), subnet.to_string());
    }
    if !plan.ports.is_empty() {
        labels.insert(labels::PORTS.into(), labels::encode_ports(&plan.ports));
    }
    labels.insert(labels::STOP_SIGNAL.into(), stop_signal.to_string());
    labels.insert(
        labels::STOP_GRACE_MS.into(),
        stop_grace.as_millis().to_string(),
    );
    labels.insert(labels::LOG_PATH.into(), log_path.display().to_string());
    if let Some(group) = &plan.shim_group {
        labels.insert(labels::SHIM_GROUP.into(), group.clone());
    }
    let restart = if plan.is_job() {
        "no"
    } else {
        "unless-stopped"
    };
    labels.insert(labels::RESTART.into(), restart.into());
    labels
}

/// The node's limit, or a standalone manifest's when it is lower: a
/// manifest can ask for less, never for more.
fn pids_limit(node: &NodeFacts, spec: &ServiceSpec) -> u32 {
    let asked = node
        .standalone
        .then(|| spec.placement_constraints.get(labels::PIDS_LIMIT_KEY))
        .flatten()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|n| *n > 0);
    match (asked, node.pids_limit) {
        (Some(a), 0) => a,
        (Some(a), node) if a <= node => a,
        (Some(a), node) => {
            tracing::warn!(
                asked = a,
                node,
                "a manifest asks for more processes than the node allows; the node's limit applies"
            );
            node
        }
        (None, node) => node,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    //! One row per field the composition reads: the plan's ServiceSpec,
    //! its runtime, the image's config and the node's facts.

    use std::collections::BTreeMap;

    use super::*;
    use crate::proto::cluster::AssignmentRuntime;
    use crate::proto::v1::{Assignment, Meta, ResourceLimits, VolumeMount};

    fn plan(spec: ServiceSpec) -> Plan {
        Plan {
            assignment: Assignment {
                meta: Some(Meta {
                    id: "web-0".into(),
                    ..Meta::default()
                }),
                project_id: "proj".into(),
                app_id: "app-web".into(),
                environment_id: "01JENVIRONMENT".into(),
                ..Assignment::default()
            },
            runtime: AssignmentRuntime {
                image_ref: "registry.test/web:1".into(),
                spec: Some(spec),
                env: BTreeMap::from([("ZATTERA_APP".into(), "web".into())]),
                ..AssignmentRuntime::default()
            },
            container_id: "web-0-h1".into(),
            subnet: None,
            ip: None,
            ports: Vec::new(),
            shim_group: None,
        }
    }

    fn image() -> ImageFacts {
        ImageFacts {
            entrypoint: vec!["/entry".into()],
            cmd: vec!["serve".into()],
            env: vec!["PATH=/bin".into()],
            working_dir: "/srv".into(),
            stop_signal: None,
            architecture: "amd64".into(),
        }
    }

    fn node() -> NodeFacts {
        NodeFacts {
            layout: Layout::new("/var/lib/zattera", "/run/zattera"),
            cgroup_parent: "/zattera/ns".into(),
            cgroup_v2: true,
            pids_limit: 4096,
            standalone: false,
            default_subnet: None,
            networked: true,
        }
    }

    fn composed(p: &Plan, img: &ImageFacts, n: &NodeFacts) -> Composed {
        compose(p, img, ProcessUser::default(), None, n).unwrap()
    }

    fn args(c: &Composed) -> Vec<String> {
        c.spec.process().as_ref().unwrap().args().clone().unwrap()
    }

    fn env(c: &Composed) -> Vec<String> {
        c.spec.process().as_ref().unwrap().env().clone().unwrap()
    }

    fn resources(c: &Composed) -> oci_spec::runtime::LinuxResources {
        c.spec
            .linux()
            .as_ref()
            .unwrap()
            .resources()
            .clone()
            .unwrap()
    }

    fn mounts(c: &Composed) -> Vec<(String, String)> {
        c.spec
            .mounts()
            .clone()
            .unwrap()
            .iter()
            .filter(|m| m.typ().as_deref() == Some("bind"))
            .map(|m| {
                (
                    m.source().clone().unwrap().display().to_string(),
                    m.destination().display().to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn service_spec_fields() {
        type Check = fn(&Composed, &Composed);
        let base = composed(&plan(ServiceSpec::default()), &image(), &node());
        let rows: Vec<(&str, ServiceSpec, Check)> = vec![
            (
                "command: the image's entrypoint runs sh -c with it",
                ServiceSpec {
                    command: "echo hi".into(),
                    ..ServiceSpec::default()
                },
                |c, _| assert_eq!(args(c), ["/entry", "/bin/sh", "-c", "echo hi"]),
            ),
            (
                "stop_grace: the label the stop reads",
                ServiceSpec {
                    stop_grace: Some(prost_types::Duration {
                        seconds: 42,
                        nanos: 0,
                    }),
                    ..ServiceSpec::default()
                },
                |c, base| {
                    assert_eq!(c.stop_grace, Duration::from_secs(42));
                    assert_eq!(c.labels[labels::STOP_GRACE_MS], "42000");
                    assert_eq!(base.stop_grace, DEFAULT_STOP_GRACE);
                },
            ),
            (
                "resources: cpu quota and memory with twice the swap",
                ServiceSpec {
                    resources: Some(ResourceLimits {
                        cpu_millis: 500,
                        memory_mb: 64,
                    }),
                    ..ServiceSpec::default()
                },
                |c, base| {
                    let r = resources(c);
                    assert_eq!(r.cpu().as_ref().unwrap().quota(), Some(50_000));
                    assert_eq!(r.memory().as_ref().unwrap().limit(), Some(64 << 20));
                    assert_eq!(r.memory().as_ref().unwrap().swap(), Some(128 << 20));
                    assert!(resources(base).cpu().is_none() && resources(base).memory().is_none());
                },
            ),
            (
                "volumes: mounted from the node's volume dir, listed for the steps",
                ServiceSpec {
                    volumes: vec![VolumeMount {
                        volume_name: "data".into(),
                        mount_path: "/var/lib/data".into(),
                    }],
                    ..ServiceSpec::default()
                },
                |c, _| {
                    assert_eq!(
                        mounts(c)[0],
                        (
                            "/var/lib/zattera/volumes/zt-01JENVIRONMENT-data/_data".into(),
                            "/var/lib/data".into()
                        )
                    );
                    assert_eq!(c.volumes[0].local, "zt-01JENVIRONMENT-data");
                },
            ),
            (
                "placement_constraints: a pids limit is read only standalone",
                ServiceSpec {
                    placement_constraints: BTreeMap::from([(
                        labels::PIDS_LIMIT_KEY.into(),
                        "64".into(),
                    )]),
                    ..ServiceSpec::default()
                },
                |c, _| assert_eq!(resources(c).pids().as_ref().unwrap().limit(), 4096),
            ),
            (
                "read_only_rootfs: the root is mounted read-only",
                ServiceSpec {
                    read_only_rootfs: true,
                    ..ServiceSpec::default()
                },
                |c, base| {
                    assert_eq!(c.spec.root().as_ref().unwrap().readonly(), Some(true));
                    assert_eq!(base.spec.root().as_ref().unwrap().readonly(), Some(false));
                },
            ),
        ];
        for (row, spec, check) in rows {
            let c = composed(&plan(spec), &image(), &node());
            eprintln!("row: {row}");
            check(&c, &base);
        }
        // Fields the node never reads into a container: the same container.
        let ignored = ServiceSpec {
            replicas: Some(crate::proto::v1::ReplicaRange { min: 3, max: 3 }),
            scale_to_zero: true,
            max_concurrency: 7,
            stateful: true,
            ..ServiceSpec::default()
        };
        let c = composed(&plan(ignored), &image(), &node());
        assert_eq!(c.spec, base.spec);
        assert_eq!(c.labels, base.labels);
    }

    #[test]
    fn the_plan_and_the_node() {
        let mut p = plan(ServiceSpec {
            placement_constraints: BTreeMap::from([(labels::PIDS_LIMIT_KEY.into(), "64".into())]),
            ..ServiceSpec::default()
        });
        p.subnet = Some("10.201.7.0/24".parse().unwrap());
        p.ip = Some("10.201.7.2".parse().unwrap());
        p.shim_group = Some("g1".into());
        let standalone = NodeFacts {
            standalone: true,
            ..node()
        };
        let netns = PathBuf::from("/run/zattera/netns/web-0-h1");
        let c = compose(
            &p,
            &image(),
            ProcessUser::default(),
            Some(netns.clone()),
            &standalone,
        )
        .unwrap();
        assert_eq!(
            resources(&c).pids().as_ref().unwrap().limit(),
            64,
            "standalone asks for less"
        );
        assert_eq!(c.labels[labels::IP], "10.201.7.2");
        assert_eq!(c.labels[labels::SUBNET], "10.201.7.0/24");
        assert_eq!(c.gateway, Some("10.201.7.1".parse().unwrap()));
        assert_eq!(c.labels[labels::SHIM_GROUP], "g1");
        let annotations = c.spec.annotations().clone().unwrap();
        assert_eq!(annotations[spec::RUNC_GROUP_ANNOTATION], "g1");
        let ns = c
            .spec
            .linux()
            .as_ref()
            .unwrap()
            .namespaces()
            .clone()
            .unwrap();
        assert!(ns.iter().any(|n| n.path().as_ref() == Some(&netns)));
        assert_eq!(
            c.spec
                .linux()
                .as_ref()
                .unwrap()
                .cgroups_path()
                .as_ref()
                .unwrap(),
            &PathBuf::from("/zattera/ns/web-0-h1")
        );
        assert_eq!(
            c.log_path,
            PathBuf::from("/var/lib/zattera/logs/web-0-h1.log")
        );
        assert_eq!(
            c.labels[labels::LOG_PATH],
            "/var/lib/zattera/logs/web-0-h1.log"
        );
        assert_eq!(c.labels[labels::APP_NAME], "web");
        assert_eq!(c.labels[labels::RESTART], "unless-stopped");
        assert_eq!(c.hostname, "web-0-h1");
        // The default network's DNS is the host's.
        let on_default = NodeFacts {
            default_subnet: p.subnet,
            ..node()
        };
        assert_eq!(composed(&p, &image(), &on_default).gateway, None);
        // A job: its command replaces the entrypoint, and it never restarts.
        p.assignment.job_id = "job-1".into();
        p.runtime.spec.as_mut().unwrap().command = "migrate".into();
        let job = composed(&p, &image(), &node());
        assert_eq!(args(&job), ["/bin/sh", "-c", "migrate"]);
        assert_eq!(job.labels[labels::RESTART], "no");
        assert_eq!(job.log_meta.job_id, "job-1");
    }

    #[test]
    fn the_image_config() {
        let p = plan(ServiceSpec::default());
        let c = composed(&p, &image(), &node());
        assert_eq!(args(&c), ["/entry", "serve"]);
        assert_eq!(
            c.spec
                .process()
                .as_ref()
                .unwrap()
                .cwd()
                .display()
                .to_string(),
            "/srv"
        );
        assert!(env(&c).contains(&"PATH=/bin".to_owned()));
        assert!(env(&c).contains(&"ZATTERA_APP=web".to_owned()));
        assert!(env(&c).contains(&"HOSTNAME=web-0-h1".to_owned()));
        assert_eq!(c.stop_signal, 15);
        let quit = ImageFacts {
            stop_signal: Some("SIGQUIT".into()),
            ..image()
        };
        assert_eq!(composed(&p, &quit, &node()).stop_signal, 3);
        assert_eq!(
            composed(&p, &quit, &node()).labels[labels::STOP_SIGNAL],
            "3"
        );
        let bad = ImageFacts {
            stop_signal: Some("SIGNOPE".into()),
            ..image()
        };
        assert!(matches!(
            compose(&p, &bad, ProcessUser::default(), None, &node()),
            Err(ComposeError::StopSignal(_))
        ));
        let empty = ImageFacts {
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            ..image()
        };
        assert_eq!(
            compose(&p, &empty, ProcessUser::default(), None, &node()).unwrap_err(),
            ComposeError::NoCommand
        );
        let user = ProcessUser {
            uid: 999,
            gid: 998,
            additional_gids: vec![5],
        };
        let c = compose(&p, &image(), user, None, &node()).unwrap();
        let u = c.spec.process().as_ref().unwrap().user().clone();
        assert_eq!((u.uid(), u.gid()), (999, 998));
    }

    #[test]
    fn a_volume_that_escapes_is_refused_by_name() {
        let p = plan(ServiceSpec {
            volumes: vec![VolumeMount {
                volume_name: "data".into(),
                mount_path: "/../etc".into(),
            }],
            ..ServiceSpec::default()
        });
        let err = compose(&p, &image(), ProcessUser::default(), None, &node()).unwrap_err();
        assert!(
            matches!(&err, ComposeError::Volume { name, .. } if name == "data"),
            "{err}"
        );
    }
}
