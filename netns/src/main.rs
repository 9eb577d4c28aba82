//! `zattera-netns`: the operator's tool for debugging node networking.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "zattera-netns",
    version,
    about = "Inspect and debug the networks of a zattera node",
    long_about = "Inspect and debug the networks of a zattera node: environment bridges, \
                  container network namespaces, published ports and internal DNS.\n\n\
                  It asks the running agent through its admin socket (under --run-dir) and \
                  falls back to reading the kernel and containerd directly when the agent is down."
)]
struct Cli {
    /// The agent's run dir, where its admin socket lives.
    #[arg(
        long,
        global = true,
        env = "ZATTERA_RUN_DIR",
        default_value = "/run/zattera"
    )]
    run_dir: std::path::PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List environments: bridges, subnets, gateways, instances and their IPs.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Show one network: members, published ports, nft rules, DNS listener.
    Inspect { network: String },
    /// Run a host command inside an instance's network namespace.
    Exec {
        target: String,
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Resolve a name the way an instance would, against its gateway.
    Dig {
        name: String,
        #[arg(long)]
        from: String,
    },
    /// List (and with --apply remove) bridges, netns files, veths and rules nobody owns.
    Gc {
        #[arg(long)]
        apply: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let name = match cli.command {
        Command::Ls { .. } => "ls",
        Command::Inspect { .. } => "inspect",
        Command::Exec { .. } => "exec",
        Command::Dig { .. } => "dig",
        Command::Gc { .. } => "gc",
    };
    eprintln!(
        "zattera-netns {name}: not implemented yet (networking has not landed; run dir {})",
        cli.run_dir.display()
    );
    ExitCode::from(2)
}
