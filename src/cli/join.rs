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
}

pub async fn run(config: &Config, args: JoinArgs) -> Result<()> {
    use zattera_agent::control::join::{JoinOptions, join};
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating {}", config.data_dir.display()))?;
    let opts = JoinOptions::for_this_node(args.control, args.token, config);
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
