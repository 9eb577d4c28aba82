//! The command line: global options, one file per command, and `dispatch`.

mod build;
mod docs;
mod doctor;
mod image;
mod join;
mod ops;
mod pull_progress;
mod run;
mod status;
mod volume;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use zattera_agent::config::{Config, Settings};

#[derive(Debug, Parser)]
#[command(
    name = "zattera-agent",
    version = zattera_agent::version::tag(),
    about = "containerd-native node agent",
    long_about = "containerd-native node agent: keeps this machine in sync with a control plane \
                  (or with manifest files, standalone) and runs its containers through containerd, \
                  with per-environment bridge networks, nftables and internal DNS of its own."
)]
pub struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The long-running agent logs at info; one-shot commands at warn.
    pub fn is_daemon(&self) -> bool {
        matches!(self.command, Command::Run(_))
    }
}

/// Options every command understands; they override the config file.
#[derive(Debug, Args)]
pub struct GlobalArgs {
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

impl GlobalArgs {
    fn settings(&self) -> Settings {
        Settings {
            containerd_address: self.containerd_address.clone(),
            namespace: self.namespace.clone(),
            data_dir: self.data_dir.clone(),
            run_dir: self.run_dir.clone(),
            ..Settings::default()
        }
    }

    /// The config file's settings under these flags (and `run`'s, if any).
    fn load(&self, run: Option<&run::RunArgs>) -> Result<Config> {
        let file = Settings::load(self.config.as_deref())?;
        let flags = match run {
            Some(r) => r.settings(self.settings()),
            None => self.settings(),
        };
        Ok(file.overlay(flags).resolve()?)
    }
}

#[derive(Debug, Subcommand)]
// Parsed once per process: the size of the `run` flags costs nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Run the agent: converge containerd to the desired set and keep it there.
    Run(run::RunArgs),
    /// Show the assignments this node runs.
    Status(status::StatusArgs),
    /// Manage images in the agent's containerd namespace.
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Print an instance's output (compressed rotations included).
    Logs(ops::LogsArgs),
    /// Run a command in an instance (-it: a terminal, stdin attached).
    Exec(ops::ExecArgs),
    /// List the processes of an instance.
    Top(ops::TopArgs),
    /// CPU, memory and network of running instances.
    Stats(ops::StatsArgs),
    /// The images in the agent's namespace: size, users, last use.
    Images(ops::ImagesArgs),
    /// Enroll this node with a control plane.
    Join(join::JoinArgs),
    /// Build an image from a directory with this node's builder (BuildKit or buildah).
    Build(build::BuildArgs),
    /// Snapshot and restore volumes in S3 without a control plane.
    #[command(subcommand)]
    Volume(volume::VolumeCommand),
    /// Check what the agent needs from this host; each failure with its fix.
    Doctor(doctor::DoctorArgs),
    /// Print a shell completion script (bash, zsh, fish, ...).
    Completions(docs::CompletionsArgs),
    /// Write the man pages (zattera-agent.1 and one per command) into a directory.
    Man(docs::ManArgs),
    /// Print the version.
    Version(VersionArgs),
}

#[derive(Debug, clap::Args)]
pub struct VersionArgs {
    /// JSON (`{"name": "zattera-agent", "version": …}`): how an upgrade
    /// checks that a staged binary is this agent.
    #[arg(long)]
    json: bool,
}

/// Prints to stdout; a reader that went away (`| head`) is not an error.
fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

pub async fn dispatch(cli: Cli) -> Result<ExitCode> {
    let g = &cli.global;
    match cli.command {
        Command::Version(args) => {
            let version = zattera_agent::version::tag();
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"name": "zattera-agent", "version": version})
                );
            } else {
                println!("zattera-agent {version}");
            }
        }
        Command::Run(args) => {
            // Before the config: a new binary that refuses it is a failed
            // start like any other.
            zattera_agent::upgrade::rollback::trial_at_start()?;
            run::run(g.load(Some(&args))?).await?;
        }
        Command::Status(args) => status::run(&g.load(None)?, &args).await?,
        Command::Image(cmd) => image::run(&g.load(None)?, cmd).await?,
        Command::Logs(args) => ops::logs(&g.load(None)?, &args).await?,
        Command::Exec(args) => return ops::exec(&g.load(None)?, &args).await,
        Command::Top(args) => ops::top(&g.load(None)?, &args).await?,
        Command::Stats(args) => ops::stats(&g.load(None)?, &args).await?,
        Command::Images(args) => ops::images(&g.load(None)?, &args).await?,
        Command::Join(args) => join::run(&g.load(None)?, args).await?,
        Command::Volume(cmd) => volume::run(&g.load(None)?, cmd).await?,
        Command::Build(args) => build::run(&g.load(None)?, args).await?,
        Command::Doctor(args) => return doctor::run(g, &args).await,
        Command::Completions(args) => docs::completions(&args)?,
        Command::Man(args) => docs::man(&args)?,
    }
    Ok(ExitCode::SUCCESS)
}
