//! `zattera-agent`: the node agent's command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;
use zattera_agent::config::{Config, Settings};

use zattera_agent::executor::status::StatusSnapshot;
use zattera_agent::runtime::pull::{Credentials, Puller};
use zattera_agent::runtime::{Containerd, ImageRef, import_archive};

mod pull_progress;

#[derive(Debug, Parser)]
#[command(
    name = "zattera-agent",
    version,
    about = "containerd-native node agent"
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// Options every command understands; they override the config file.
#[derive(Debug, Args)]
struct GlobalArgs {
    /// Config file [default: /etc/zattera/agent.toml, if present]
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// containerd's gRPC socket [default: /run/containerd/containerd.sock]
    #[arg(long, global = true, value_name = "PATH")]
    containerd_address: Option<PathBuf>,
    /// containerd namespace the agent owns [default: zattera]
    #[arg(long, global = true, value_name = "NS")]
    namespace: Option<String>,
    /// Where durable state lives [default: /var/lib/zattera]
    #[arg(long, global = true, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Where the admin socket and netns files live [default: /run/zattera]
    #[arg(long, global = true, value_name = "DIR", env = "ZATTERA_RUN_DIR")]
    run_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent: converge containerd to the desired set and keep it there.
    Run(RunArgs),
    /// Show the assignments this node runs.
    Status {
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Manage images in the agent's containerd namespace.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Enroll this node with a control plane.
    Join {
        #[arg(long, value_name = "ADDR")]
        control: String,
        #[arg(long, value_name = "TOKEN")]
        token: String,
    },
    /// Print the version.
    Version,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Directory of standalone manifests (one TOML file per app).
    #[arg(long, value_name = "DIR")]
    manifests: Option<PathBuf>,
    /// Control-plane address; without it the agent runs standalone.
    #[arg(long, value_name = "ADDR")]
    control: Option<String>,
    /// Host address published ports bind to [default: 127.0.0.1]
    #[arg(long, value_name = "IP")]
    host_ip: Option<std::net::IpAddr>,
    /// This node's id.
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// Prefix of the bridges and veths this agent creates [default: ztbr]
    #[arg(long, value_name = "PREFIX")]
    bridge_prefix: Option<String>,
    /// Subnet slots for standalone networks, FIRST-LAST of 10.201.X.0/24 [default: 0-255]
    #[arg(long, value_name = "FIRST-LAST")]
    subnet_pool: Option<String>,
    /// Address of the node API served to the control plane (mTLS) [default: 0.0.0.0:8444]
    #[arg(long, value_name = "ADDR")]
    node_api_listen: Option<std::net::SocketAddr>,
    /// URL prefix self-upgrades may come from (`*` = any); none: upgrades refused
    #[arg(long, value_name = "URL")]
    upgrade_base_url: Option<String>,
    /// Ephemeral host ports for published ports [default: 30000-32767]
    #[arg(long, value_name = "LO-HI")]
    host_port_range: Option<String>,
}

#[derive(Debug, Subcommand)]
enum ImageCommand {
    /// Import an OCI image layout archive or a `docker save` archive and unpack it.
    Import {
        /// The archive (an uncompressed tar).
        file: PathBuf,
        /// Name for the archive's single image, instead of the name it carries.
        #[arg(long, value_name = "REF")]
        name: Option<String>,
    },
    /// Pull an image from its registry and unpack it.
    Pull {
        /// Image reference, normalised as Docker does (busybox → docker.io/library/busybox:latest).
        reference: String,
        /// Registry user for basic auth; the password comes from ZATTERA_REGISTRY_PASSWORD.
        #[arg(long, value_name = "USER")]
        username: Option<String>,
        /// A registry (`host:port`) to reach over plain HTTP; loopback ones always are.
        #[arg(long, value_name = "HOST")]
        insecure_registry: Vec<String>,
    },
}

fn main() -> ExitCode {
    // Started by containerd's runc shim as a container's logger: no CLI, no async.
    let args: Vec<String> = std::env::args().collect();
    if let Some(path) = zattera_agent::logshim::invoked_as_shim(&args) {
        return match zattera_agent::logshim::run(&path) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("zattera-agent log shim {}: {e}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    let cli = Cli::parse();
    let daemon = matches!(cli.command, Command::Run(_));
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
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zattera-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Prints to stdout; a reader that went away (`| head`) is not an error.
fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn load_config(global: &GlobalArgs, run: Option<&RunArgs>) -> Result<Config> {
    let file = Settings::load(global.config.as_deref())?;
    let flags = Settings {
        containerd_address: global.containerd_address.clone(),
        namespace: global.namespace.clone(),
        data_dir: global.data_dir.clone(),
        run_dir: global.run_dir.clone(),
        manifests: run.and_then(|r| r.manifests.clone()),
        control: run.and_then(|r| r.control.clone()),
        host_ip: run.and_then(|r| r.host_ip),
        node_id: run.and_then(|r| r.node_id.clone()),
        bridge_prefix: run.and_then(|r| r.bridge_prefix.clone()),
        subnet_pool: run.and_then(|r| r.subnet_pool.clone()),
        node_api_listen: run.and_then(|r| r.node_api_listen),
        upgrade_base_url: run.and_then(|r| r.upgrade_base_url.clone()),
        host_port_range: run.and_then(|r| r.host_port_range.clone()),
    };
    Ok(file.overlay(flags).resolve()?)
}

async fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Version => {
            println!("zattera-agent {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Image(ImageCommand::Import { file, name }) => {
            let config = load_config(&cli.global, None)?;
            let name = name
                .map(|n| n.parse::<ImageRef>())
                .transpose()
                .context("--name")?;
            let ctd = Containerd::connect(&config.containerd_address, config.namespace).await?;
            let imported = import_archive(&ctd, &file, name)
                .await
                .with_context(|| format!("import {}", file.display()))?;
            for image in imported {
                for name in &image.names {
                    println!(
                        "imported {name} ({}, {} new blobs, rootfs {})",
                        image.target.digest, image.blobs_written, image.chain_id
                    );
                }
            }
            Ok(())
        }
        Command::Image(ImageCommand::Pull {
            reference,
            username,
            insecure_registry,
        }) => {
            let config = load_config(&cli.global, None)?;
            let reference = reference.parse::<ImageRef>()?;
            let credentials = match username {
                None => Credentials::Anonymous,
                Some(username) => Credentials::Basic {
                    username,
                    password: std::env::var("ZATTERA_REGISTRY_PASSWORD")
                        .context("--username needs the password in ZATTERA_REGISTRY_PASSWORD")?,
                },
            };
            let ctd = Containerd::connect(&config.containerd_address, config.namespace).await?;
            let puller = Puller::new(ctd, insecure_registry);
            let on_terminal = std::io::stderr().is_terminal();
            let progress = on_terminal.then(|| pull_progress::terminal(reference.to_string()));
            let image = puller.ensure(&reference, &credentials, progress).await;
            if on_terminal {
                eprintln!();
            }
            let image = image?;
            println!(
                "pulled {reference} ({}, rootfs {})",
                image.target.digest, image.chain_id
            );
            Ok(())
        }
        Command::Run(args) => {
            let config = load_config(&cli.global, Some(&args))?;
            let me = std::env::current_exe().context("locating this binary for the log shim")?;
            zattera_agent::agent::run(config, me).await
        }
        Command::Status { json } => {
            let config = load_config(&cli.global, None)?;
            let value = match zattera_agent::admin::request(&config.run_dir, "status").await {
                Ok(v) => v,
                // The agent is down: what containerd knows is still worth showing.
                Err(e) => {
                    tracing::debug!(error = %e, "no agent; reading containerd");
                    let ctd =
                        Containerd::connect(&config.containerd_address, config.namespace).await?;
                    let snapshot =
                        zattera_agent::executor::offline_status(&ctd, &e.to_string()).await?;
                    serde_json::to_value(snapshot)?
                }
            };
            let text = if json {
                serde_json::to_string_pretty(&value)? + "\n"
            } else {
                serde_json::from_value::<StatusSnapshot>(value)?.render_table()
            };
            write_stdout(&text)
        }
        Command::Join { control, token } => {
            use zattera_agent::control::join::{JoinOptions, host_name, join};
            let config = load_config(&cli.global, None)?;
            std::fs::create_dir_all(&config.data_dir)
                .with_context(|| format!("creating {}", config.data_dir.display()))?;
            let opts = JoinOptions {
                control,
                token,
                data_dir: config.data_dir.clone(),
                node_name: host_name(),
                binary_version: env!("CARGO_PKG_VERSION").to_owned(),
            };
            let joined = join(&opts).await?;
            println!(
                "joined as node {} (control {}, mesh IP {}); identity in {}",
                joined.node_id,
                joined.control_addr,
                if joined.mesh_ip.is_empty() {
                    "none"
                } else {
                    &joined.mesh_ip
                },
                zattera_agent::control::identity::IdentityDir::new(&config.data_dir)
                    .dir()
                    .display()
            );
            Ok(())
        }
    }
}
