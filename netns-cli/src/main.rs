//! `zattera-netns`: the operator's tool for debugging node networking.
//!
//! It reads the kernel directly (links, addresses, namespace files, our
//! nftables table), and asks a running agent through its admin socket which
//! containers are live and which container a TARGET names.

mod agent_view;
mod docs;

use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use zattera_netns::inventory::{self, Inventory};
use zattera_netns::{NetConfig, NetNode, PublishedPort, Subnet, nsfile};

const AFTER_HELP: &str = "\
NAMES
    Bridges are <prefix><slot> (default ztbr7 for 10.201.7.0/24) and carry the
    alias zattera:<network name> and the fixed hardware address
    02:7a:<first three octets of the subnet>; host veth ends are <prefix><slot>v<host>;
    each container's network namespace is the file <run-dir>/netns/<container id>;
    the rules live in the nftables table inet <table> (default zattera, or
    zattera_<namespace> for another containerd namespace).

EXIT STATUS
    0 on success (dig: on any DNS answer, NXDOMAIN included), 1 on an error,
    printed with its cause.

TARGET
    An assignment id, app.env.project (its first instance) or a container id.
    The first two are resolved by the agent's admin socket (<run-dir>/agent.sock).

WITHOUT THE AGENT
    Every command reads the kernel directly, so it works while the agent is
    down. TARGET is then a container id, and gc keeps every complete
    attachment; with the agent, gc also collects attachments of containers
    the agent does not run.

EXAMPLES
    zattera-netns ls
    zattera-netns inspect zt-shop-01hxenvid000
    zattera-netns exec 3f2a9c -- ss -tlnp
    zattera-netns dig web.internal --from 3f2a9c
    zattera-netns gc            # list what nobody owns
    zattera-netns gc --apply    # and remove it";

#[derive(Debug, Parser)]
#[command(
    name = "zattera-netns",
    version,
    about = "Inspect and debug the networks of a zattera node",
    long_about = "Inspect and debug the networks of a zattera node: environment bridges, \
                  container network namespaces, published ports and the agent's nftables table.\n\n\
                  It reads the kernel directly, so it works while the agent is down. It only ever \
                  changes objects under the names below (gc --apply); everything else on the host \
                  is left alone. Run it as root.",
    after_long_help = AFTER_HELP
)]
struct Cli {
    /// The agent's run dir; namespace files live in <run-dir>/netns.
    #[arg(
        long,
        global = true,
        env = "ZATTERA_RUN_DIR",
        default_value = "/run/zattera"
    )]
    run_dir: PathBuf,
    /// The agent's containerd namespace: picks the nft table name (zattera_<ns> unless it is "zattera").
    #[arg(
        long,
        global = true,
        env = "ZATTERA_NAMESPACE",
        default_value = "zattera"
    )]
    namespace: String,
    /// Interface name prefix of the agent's bridges and veths.
    #[arg(long, global = true, default_value = "ztbr", value_name = "PREFIX")]
    bridge_prefix: String,
    /// Override the nft table name (family inet).
    #[arg(long, global = true, value_name = "TABLE")]
    nft_table: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List networks: bridge, subnet, gateway, network name, members with their IPs and veths, published ports.
    Ls {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one network: members, published ports, its nft rules, its DNS listener.
    Inspect {
        /// A network name (zt-…), a bridge name or a subnet (10.201.X.0/24).
        network: String,
    },
    /// Run a host program inside a container's network namespace.
    ///
    /// TARGET is an assignment id, app.env.project or a container id. The program
    /// comes from the host (ss, tcpdump, curl, ip) and sees only the
    /// container's interfaces, routes and sockets.
    Exec {
        /// An assignment id or app.env.project (resolved by the running agent), or a
        /// container id: the name of its namespace file under <run-dir>/netns.
        target: String,
        /// The program and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Resolve a name the way an instance would: an A query from inside its
    /// network namespace to its gateway's resolver.
    ///
    /// TARGET (after --from) is an assignment id, app.env.project or a container
    /// id. Prints the response code and
    /// the addresses with their TTLs.
    Dig {
        /// The name to resolve, e.g. web.internal.
        name: String,
        #[arg(long, value_name = "TARGET")]
        from: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// List, and with --apply remove, bridges, namespace files, veths and rules nobody owns.
    ///
    /// Without the agent, only what is provably broken counts: namespace files
    /// that are not mounted or whose eth0 has no address (a crash in the
    /// middle of an attach), veths of ours off any bridge or whose other end
    /// is in no namespace file, half-built bridges (<bridge>t), bridges with
    /// no port left, and the nft table once no bridge is left. Complete
    /// attachments are kept: only the agent knows whether their container
    /// still exists.
    Gc {
        /// Remove what is listed.
        #[arg(long)]
        apply: bool,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The WireGuard mesh: the interface, each peer with its endpoint, latest handshake,
    /// bytes each way and allowed IPs, and the control leader.
    ///
    /// The device is read directly (the kernel's over netlink, a userspace one over its
    /// UAPI socket); node names and the leader come from <run-dir>/mesh.json, which the
    /// agent rewrites on every peer set.
    Mesh {
        /// The interface [default: the agent's, from mesh.json, else zt0].
        #[arg(long, value_name = "NAME")]
        interface: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script (bash, zsh, fish, ...).
    Completions { shell: clap_complete::Shell },
    /// Write the man pages (zattera-netns.1 and one per command) into a directory.
    Man { dir: PathBuf },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zattera-netns: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn config(cli: &Cli) -> Result<NetConfig> {
    let mut cfg = NetConfig::for_namespace(&cli.namespace, &cli.run_dir)?;
    cfg.bridge_prefix.clone_from(&cli.bridge_prefix);
    if let Some(t) = &cli.nft_table {
        cfg.nft_table.clone_from(t);
    }
    cfg.validate()?;
    Ok(cfg)
}

fn run(cli: Cli) -> Result<ExitCode> {
    match &cli.command {
        Command::Completions { shell } => return docs::completions::<Cli>(*shell),
        Command::Man { dir } => return docs::man::<Cli>(dir),
        _ => {}
    }
    if let Command::Mesh { interface, json } = &cli.command {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        return rt
            .block_on(mesh(&cli.run_dir, interface.as_deref(), *json))
            .map(|()| ExitCode::SUCCESS);
    }
    let cfg = config(&cli)?;
    match cli.command {
        // exec replaces this process: no runtime, no threads to leave behind.
        Command::Exec { target, command } => {
            let target = resolve_target(&cfg, &target)?;
            exec(&cfg, &target, &command)
        }
        command => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            rt.block_on(async move {
                let node = NetNode::new(cfg)?;
                match command {
                    Command::Ls { json } => ls(&node, json).await,
                    Command::Inspect { network } => inspect(&node, &network).await,
                    Command::Gc { apply, json } => gc(&node, apply, json).await,
                    Command::Dig { name, from, json } => dig(&node, &name, &from, json).await,
                    Command::Exec { .. }
                    | Command::Mesh { .. }
                    | Command::Completions { .. }
                    | Command::Man { .. } => {
                        unreachable!("handled above")
                    }
                }
            })
            .map(|()| ExitCode::SUCCESS)
        }
    }
}

#[derive(Debug, serde::Serialize)]
struct NetworkView {
    network: Option<String>,
    bridge: String,
    subnet: Subnet,
    gateway: Ipv4Addr,
    up: bool,
    mtu: u32,
    members: Vec<Member>,
    published: Vec<PublishedView>,
    /// Service VIPs this network's containers may reach (nothing else).
    vips: Vec<Ipv4Addr>,
}

#[derive(Debug, serde::Serialize)]
struct Member {
    container_id: String,
    ip: Ipv4Addr,
    veth: Option<String>,
    netns: PathBuf,
}

#[derive(Debug, serde::Serialize)]
struct PublishedView {
    proto: &'static str,
    host: String,
    container: String,
}

fn views(
    cfg: &NetConfig,
    inv: &Inventory,
    published: &[PublishedPort],
    vip_access: &[(String, Ipv4Addr)],
) -> Vec<NetworkView> {
    inv.bridges
        .iter()
        .map(|b| {
            let members = inv
                .netns
                .iter()
                .filter_map(|n| {
                    let ip = n.ip.filter(|ip| b.subnet.contains(*ip))?;
                    let veth = cfg.host_veth_name(ip);
                    let present = inv.veths.iter().any(|v| v.name == veth);
                    Some(Member {
                        container_id: n.container_id.clone(),
                        ip,
                        veth: present.then_some(veth),
                        netns: n.path.clone(),
                    })
                })
                .collect();
            let published = published
                .iter()
                .filter(|p| b.subnet.contains(p.container_ip))
                .map(|p| PublishedView {
                    proto: p.proto.name(),
                    host: format!("{}:{}", p.host_ip, p.host_port),
                    container: format!("{}:{}", p.container_ip, p.container_port),
                })
                .collect();
            let vips = vip_access
                .iter()
                .filter(|(bridge, _)| *bridge == b.name)
                .map(|(_, vip)| *vip)
                .collect();
            NetworkView {
                vips,
                network: b.scope.clone(),
                bridge: b.name.clone(),
                subnet: b.subnet,
                gateway: b.subnet.gateway(),
                up: b.up,
                mtu: b.mtu,
                members,
                published,
            }
        })
        .collect()
}

/// The networks as the kernel has them, with the ports and VIPs of our table.
async fn read_views(node: &NetNode) -> Result<(Inventory, Vec<NetworkView>)> {
    let inv = inventory::read(node).await?;
    let current = node.nft().current().await?.unwrap_or_default();
    let views = views(node.config(), &inv, &current.published, &current.vip_access);
    Ok((inv, views))
}

async fn ls(node: &NetNode, json: bool) -> Result<()> {
    let (inv, views) = read_views(node).await?;
    if json {
        let doc = serde_json::json!({
            "networks": views,
            "nft_table": format!("inet {}", inv.table),
            "nft_table_present": inv.table_present,
            "agent": "not asked (admin socket not implemented); read from the kernel",
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    if views.is_empty() {
        println!(
            "no networks (no bridge named {}<slot>); nft table inet {} {}",
            node.config().bridge_prefix,
            inv.table,
            if inv.table_present {
                "present"
            } else {
                "absent"
            }
        );
        return Ok(());
    }
    println!(
        "{:<28} {:<12} {:<16} {:<12} {:>7}",
        "NETWORK", "BRIDGE", "SUBNET", "GATEWAY", "MEMBERS"
    );
    for v in &views {
        println!(
            "{:<28} {:<12} {:<16} {:<12} {:>7}",
            v.network.as_deref().unwrap_or("(not ours)"),
            v.bridge,
            v.subnet.to_string(),
            v.gateway.to_string(),
            v.members.len()
        );
        for m in &v.members {
            println!(
                "    {:<24} {:<15} {}",
                m.container_id,
                m.ip.to_string(),
                m.veth.as_deref().unwrap_or("(no veth)")
            );
        }
        for p in &v.published {
            println!("    publish {} {} -> {}", p.proto, p.host, p.container);
        }
        for vip in &v.vips {
            println!("    may reach VIP {vip}");
        }
    }
    Ok(())
}

async fn inspect(node: &NetNode, wanted: &str) -> Result<()> {
    let (inv, views) = read_views(node).await?;
    let found = views.iter().find(|v| {
        v.network.as_deref() == Some(wanted) || v.bridge == wanted || v.subnet.to_string() == wanted
    });
    let Some(v) = found else {
        let known: Vec<String> = views
            .iter()
            .map(|v| {
                format!(
                    "{} ({}, {})",
                    v.network.as_deref().unwrap_or("?"),
                    v.bridge,
                    v.subnet
                )
            })
            .collect();
        if known.is_empty() {
            bail!("network {wanted:?} not found: there are no networks on this node");
        }
        bail!(
            "network {wanted:?} not found; networks here: {}",
            known.join(", ")
        );
    };
    println!(
        "network   {}",
        v.network
            .as_deref()
            .unwrap_or("(bridge without our alias: not ours)")
    );
    println!(
        "bridge    {} ({}, mtu {})",
        v.bridge,
        if v.up { "up" } else { "DOWN" },
        v.mtu
    );
    println!("subnet    {}", v.subnet);
    println!("gateway   {}", v.gateway);
    println!("members   {}", v.members.len());
    for m in &v.members {
        println!(
            "  {:<24} {:<15} {:<14} {}",
            m.container_id,
            m.ip.to_string(),
            m.veth.as_deref().unwrap_or("(no veth)"),
            m.netns.display()
        );
    }
    println!("published {}", v.published.len());
    for p in &v.published {
        println!("  {} {} -> {}", p.proto, p.host, p.container);
    }
    let vips: Vec<String> = v.vips.iter().map(Ipv4Addr::to_string).collect();
    println!(
        "vips      {}",
        if vips.is_empty() {
            "none reachable".to_owned()
        } else {
            vips.join(", ")
        }
    );
    println!("dns       {}", dns_listener(v.gateway));
    let table = inv.table.clone();
    match node.nft().list().await? {
        None => println!("rules     table inet {table} is absent"),
        Some(text) => {
            let subnet = v.subnet.to_string();
            let quoted = format!("\"{}\"", v.bridge);
            let gateway = v.gateway.to_string();
            println!("rules     (from table inet {table})");
            for line in text
                .lines()
                .filter(|l| l.contains(&quoted) || l.contains(&subnet) || l.contains(&gateway))
            {
                println!("  {}", line.trim());
            }
        }
    }
    Ok(())
}

/// Whether a socket is bound to gateway:53, read from /proc/net (no traffic).
fn dns_listener(gateway: Ipv4Addr) -> String {
    let local = format!("{:08X}:0035", u32::from_ne_bytes(gateway.octets()));
    let mut found = Vec::new();
    for proto in ["udp", "tcp"] {
        let table = std::fs::read_to_string(format!("/proc/net/{proto}")).unwrap_or_default();
        if table
            .lines()
            .skip(1)
            .any(|l| l.split_whitespace().nth(1) == Some(local.as_str()))
        {
            found.push(proto);
        }
    }
    if found.is_empty() {
        format!("no listener on {gateway}:53")
    } else {
        format!("listening on {gateway}:53 ({})", found.join(", "))
    }
}

/// Resolves TARGET through the agent when one answers; otherwise it is taken
/// as a container id.
fn resolve_target(cfg: &NetConfig, target: &str) -> Result<String> {
    let Some(run_dir) = cfg.netns_dir.parent() else {
        return Ok(target.to_owned());
    };
    match agent_view::instances(run_dir) {
        Some(instances) => agent_view::resolve(&instances, target).map_err(anyhow::Error::msg),
        None => Ok(target.to_owned()),
    }
}

async fn mesh(run_dir: &std::path::Path, interface: Option<&str>, json: bool) -> Result<()> {
    let status = zattera_mesh::status::MeshStatus::load(&zattera_mesh::status_path(run_dir));
    let interface = interface
        .map(str::to_owned)
        .or_else(|| status.as_ref().map(|s| s.interface.clone()))
        .unwrap_or_else(|| "zt0".to_owned());
    let Some(device) = zattera_mesh::inspect(&interface).await? else {
        bail!("no WireGuard interface {interface} (kernel or userspace) on this host");
    };
    let name_of = |key: &str| {
        status
            .iter()
            .flat_map(|s| &s.peers)
            .find(|p| p.public_key == key)
            .map(|p| (p.node_id.clone(), p.is_control))
    };
    if json {
        let peers: Vec<serde_json::Value> = device
            .peers
            .iter()
            .map(|p| {
                let (node, control) = name_of(&p.public_key).unzip();
                serde_json::json!({
                    "node_id": node, "is_control": control, "public_key": p.public_key,
                    "endpoint": p.endpoint, "allowed_ips": p.allowed_ips.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "latest_handshake_seconds_ago": p.since_handshake.map(|d| d.as_secs_f64()),
                    "rx_bytes": p.rx_bytes, "tx_bytes": p.tx_bytes, "keepalive": p.keepalive,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "interface": device.interface, "backend": device.backend,
                "public_key": device.public_key, "listen_port": device.listen_port,
                "mesh_ip": status.as_ref().map(|s| s.mesh_ip.clone()),
                "leader_node_id": status.as_ref().map(|s| s.leader_node_id.clone()),
                "leader_addr": status.as_ref().map(|s| s.leader_addr.clone()),
                "peer_set_version": status.as_ref().map(|s| s.version),
                "peers": peers,
            }))?
        );
        return Ok(());
    }
    println!(
        "interface {} ({}), port {}, public key {}{}",
        device.interface,
        device.backend,
        device.listen_port,
        device.public_key.as_deref().unwrap_or("-"),
        status
            .as_ref()
            .map(|s| format!(", mesh IP {}", s.mesh_ip))
            .unwrap_or_default()
    );
    match &status {
        Some(s) if !s.leader_node_id.is_empty() => {
            println!(
                "leader {} at {} (peer set {})",
                s.leader_node_id, s.leader_addr, s.version
            );
        }
        Some(s) => println!("leader unknown (election?); dialing {}", s.leader_addr),
        None => println!(
            "leader unknown: no {} (is the agent running?)",
            zattera_mesh::status_path(run_dir).display()
        ),
    }
    println!(
        "{:<28} {:<22} {:>10} {:>12} {:>12}  ALLOWED IPS",
        "PEER", "ENDPOINT", "HANDSHAKE", "RX", "TX"
    );
    for p in &device.peers {
        let name = name_of(&p.public_key).map_or_else(
            || format!("{}…", p.public_key.get(..12).unwrap_or(&p.public_key)),
            |(n, control)| if control { format!("{n} (control)") } else { n },
        );
        println!(
            "{:<28} {:<22} {:>10} {:>12} {:>12}  {}",
            name,
            p.endpoint.map_or_else(|| "-".to_owned(), |e| e.to_string()),
            p.since_handshake
                .map_or_else(|| "never".to_owned(), |d| format!("{}s ago", d.as_secs())),
            p.rx_bytes,
            p.tx_bytes,
            p.allowed_ips
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(())
}

async fn gc(node: &NetNode, apply: bool, json: bool) -> Result<()> {
    let inv = inventory::read(node).await?;
    // With an agent, only its live containers keep their attachments.
    let live: Option<std::collections::BTreeSet<String>> = node
        .config()
        .netns_dir
        .parent()
        .and_then(agent_view::instances)
        .map(|all| {
            all.into_iter()
                .map(|i| i.container_id)
                .filter(|c| !c.is_empty())
                .collect()
        });
    let plan = inventory::plan(&inv, live.as_ref());
    // The mesh interface is the agent's while it runs; with no agent, the
    // one its mesh.json names is nobody's.
    let status_file = node
        .config()
        .netns_dir
        .parent()
        .map(zattera_mesh::status_path);
    let mesh = match (&live, &status_file) {
        (None, Some(path)) => zattera_mesh::status::MeshStatus::load(path).map(|s| s.interface),
        _ => None,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "plan": plan, "mesh_interface": mesh, "applied": apply })
            )?
        );
    } else if plan.is_empty() && mesh.is_none() {
        println!("nothing to collect");
    } else {
        let verb = if apply { "removing" } else { "would remove" };
        for p in &plan.netns {
            println!("{verb} netns file {}", p.display());
        }
        for v in &plan.veths {
            println!("{verb} veth {v}");
        }
        for b in &plan.bridges {
            println!("{verb} bridge {b}");
        }
        if plan.delete_table {
            println!("{verb} nft table inet {}", inv.table);
        }
        if let Some(m) = &mesh {
            println!("{verb} mesh interface {m} (no agent answers)");
        }
        if !apply {
            println!("(run with --apply to remove)");
        }
    }
    if apply {
        inventory::apply(node, &plan).await?;
        if let (Some(interface), Some(path)) = (&mesh, &status_file) {
            remove_mesh(interface).await?;
            let _ = std::fs::remove_file(path);
        }
    }
    Ok(())
}

/// Removes the mesh interface, whichever backend runs it.
async fn remove_mesh(interface: &str) -> Result<()> {
    let userspace = zattera_mesh::userspace::Userspace {
        interface: interface.to_owned(),
        device_binary: PathBuf::new(),
        log: PathBuf::new(),
    };
    if !userspace.remove().await? {
        zattera_mesh::kernel::Kernel {
            interface: interface.to_owned(),
        }
        .remove()
        .await?;
    }
    Ok(())
}

async fn dig(node: &NetNode, name: &str, from: &str, json: bool) -> Result<()> {
    let resolved = resolve_target(node.config(), from)?;
    let from = resolved.as_str();
    let inv = inventory::read(node).await?;
    let Some(target) = inv.netns.iter().find(|n| n.container_id == from) else {
        let known: Vec<&str> = inv.netns.iter().map(|n| n.container_id.as_str()).collect();
        bail!(
            "no network namespace for {from:?} under {} (known: {})",
            node.config().netns_dir.display(),
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        );
    };
    let Some(gateway) = target.ip.and_then(Subnet::of).map(Subnet::gateway) else {
        bail!("{from:?} has no eth0 address in a 10.201.X.0/24 network, so no gateway to ask");
    };
    let server = std::net::SocketAddrV4::new(gateway, 53);
    let (path, name_owned) = (target.path.clone(), name.to_owned());
    let answer = tokio::task::spawn_blocking(move || {
        zattera_netns::dig::query_from(
            &path,
            server,
            &name_owned,
            std::time::Duration::from_secs(1),
        )
    })
    .await
    .context("the query task failed")??;
    if json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        println!(";; {} from {from} via {server}: {}", name, answer.rcode);
        for (a, ttl) in answer.addresses.iter().zip(&answer.ttls) {
            println!("{name}\t{ttl}\tIN\tA\t{a}");
        }
    }
    Ok(())
}

fn exec(cfg: &NetConfig, target: &str, command: &[String]) -> Result<ExitCode> {
    let path = cfg.netns_path(target)?;
    if !nsfile::is_mounted(&path) {
        let mut known: Vec<String> = std::fs::read_dir(&cfg.netns_dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        known.sort();
        let known = if known.is_empty() {
            "none".to_owned()
        } else {
            known.join(", ")
        };
        bail!(
            "no network namespace for {target:?} at {} (known: {known}); assignment ids and \
             app.env.project are resolved only while the agent runs",
            path.display()
        );
    }
    nsfile::enter(&path)?;
    let (program, args) = command.split_first().context("no command given after --")?;
    let err = std::process::Command::new(program).args(args).exec();
    Err(err).with_context(|| format!("cannot run {program:?} in {}", path.display()))
}
