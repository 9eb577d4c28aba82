//! `zattera-agent join`: enrollment with a control plane (wire.md 1.2).

use anyhow::{Context, Result};
use clap::Args;
use zattera_agent::config::Config;

#[derive(Debug, Args)]
pub struct JoinArgs {
    #[arg(long, value_name = "ADDR")]
    control: String,
    #[arg(long, value_name = "TOKEN")]
    token: String,
    /// A control-plane node allowed to call this node's API (logs, exec,
    /// stats, snapshots, builds, upgrades); repeat for each. Needed on a
    /// cluster without the mesh, where no peer set names control's nodes.
    #[arg(long = "control-node-id", value_name = "ID")]
    control_node_ids: Vec<String>,
}

pub async fn run(config: &Config, args: JoinArgs) -> Result<()> {
    use zattera_agent::control::join::{JoinOptions, join};
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating {}", config.data_dir.display()))?;
    let mut opts = JoinOptions::for_this_node(args.control, args.token, config);
    opts.control_node_ids = args.control_node_ids;
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
        zattera_agent::link::identity::IdentityDir::new(&config.data_dir)
            .dir()
            .display()
    );
    if let Some(warning) = zattera_agent::node_api::refuses_everyone(
        &joined.control_node_ids,
        &config.control_node_ids,
        joined.mesh_enabled,
    ) {
        eprintln!("warning: {warning}");
    }
    Ok(())
}
