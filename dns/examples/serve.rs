//! A standalone resolver for benchmarks and manual tries (bench/dns/run.sh):
//!
//! ```text
//! serve --listen 127.77.50.1 [--port 10053] [--names 10000]
//!       [--upstream 127.77.50.2:10053] [--project bench] [--env production]
//!       [--udp-sockets N]
//! ```
//!
//! The table holds `web` plus `app<i>` for i below `--names`, all in the
//! scope (`--project`, `--env`), each with one VIP. It prints `ready` and
//! its resident memory once serving, then runs until killed.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;

use zattera_dns::{
    Config, DnsServer, ListenerSpec, NameTable, RouteService, Scope, UpstreamSource,
};

struct Args {
    listen: IpAddr,
    port: u16,
    names: u32,
    upstream: Vec<SocketAddr>,
    project: String,
    env: String,
    udp_sockets: Option<usize>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
        port: 10053,
        names: 0,
        upstream: Vec::new(),
        project: "bench".into(),
        env: "production".into(),
        udp_sockets: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--listen" => args.listen = value.parse().map_err(|e| bad(&e))?,
            "--port" => args.port = value.parse().map_err(|e| bad(&e))?,
            "--names" => args.names = value.parse().map_err(|e| bad(&e))?,
            "--upstream" => args.upstream.push(value.parse().map_err(|e| bad(&e))?),
            "--project" => args.project = value,
            "--env" => args.env = value,
            "--udp-sockets" => args.udp_sockets = Some(value.parse().map_err(|e| bad(&e))?),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(args)
}

fn table(args: &Args) -> NameTable {
    let service = |app: &str, vip: Ipv4Addr| RouteService {
        fqdn: format!("{app}.{}.{}.internal.", args.env, args.project),
        project_id: args.project.clone(),
        environment_id: "bench-env".into(),
        vip: vip.to_string(),
    };
    let mut services = vec![service("web", Ipv4Addr::new(10, 97, 0, 1))];
    for i in 0..args.names {
        let [_, _, hi, lo] = (i + 2).to_be_bytes();
        services.push(service(&format!("app{i}"), Ipv4Addr::new(10, 97, hi, lo)));
    }
    NameTable::from_routes(&services)
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("serve: {e}");
            return ExitCode::from(2);
        }
    };
    let config = Config {
        port: args.port,
        upstreams: UpstreamSource::Fixed(args.upstream.clone()),
        ..Config::default()
    };
    let config = Config {
        udp_sockets: args.udp_sockets.unwrap_or(config.udp_sockets),
        ..config
    };
    let server = match DnsServer::new(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    server.set_table(table(&args));
    let status = server
        .reconcile(vec![ListenerSpec {
            addr: args.listen,
            scope: Scope::new(args.project.clone(), args.env.clone()),
        }])
        .await;
    for s in &status {
        if let zattera_dns::ListenerState::Failed(e) = &s.state {
            eprintln!("serve: {e}");
            return ExitCode::FAILURE;
        }
    }
    println!(
        "ready names={} rss_kib={}",
        server.table().len(),
        rss_kib().unwrap_or(0)
    );
    if let Err(e) = tokio::signal::ctrl_c().await {
        eprintln!("serve: {e}");
    }
    server.shutdown().await;
    ExitCode::SUCCESS
}
