//! `zattera-agent`: the node agent's command line ([`cli`] parses and
//! dispatches, one file per command).

mod cli;

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // Before any TLS client exists (reqwest's use the process's provider).
    zattera_agent::link::tls::install_process_provider();
    // Started by containerd's runc shim as a container's logger: no CLI, no async.
    let args: Vec<String> = std::env::args().collect();
    if let Some(shim) = zattera_agent::logs::shim::invoked_as_shim(&args) {
        return match zattera_agent::logs::shim::run(&shim) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("zattera-agent log shim {}: {e}", shim.log_path.display());
                ExitCode::FAILURE
            }
        };
    }
    // Started by the agent as the userspace WireGuard device: it outlives
    // the agent, with no CLI and no async runtime of its own.
    if let [_, verb, interface] = args.as_slice()
        && verb == "mesh-device"
    {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .init();
        return match zattera_mesh::run_device(interface) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("zattera-agent mesh-device: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let cli = cli::Cli::parse();
    let daemon = cli.is_daemon();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new(if daemon { "info" } else { "warn" })),
        )
        .with_writer(std::io::stderr)
        .init();

    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zattera-agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zattera-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
