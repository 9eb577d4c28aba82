//! `zattera-agent status`: the live agent's view, or containerd's when the
//! agent is down (DESIGN decision 8).

use anyhow::Result;
use clap::Args;
use zattera_agent::config::Config;
use zattera_agent::runtime::Containerd;
use zattera_agent::status::StatusSnapshot;

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(config: &Config, args: &StatusArgs) -> Result<()> {
    let value = match zattera_agent::admin::request(&config.run_dir, "status").await {
        Ok(v) => v,
        // The agent is down: what containerd knows is still worth showing.
        Err(e) => {
            tracing::debug!(error = %e, "no agent; reading containerd");
            let ctd =
                Containerd::connect(&config.containerd_address, config.namespace.clone()).await?;
            let snapshot = zattera_agent::executor::offline_status(&ctd, &e.to_string()).await?;
            serde_json::to_value(snapshot)?
        }
    };
    let text = if args.json {
        serde_json::to_string_pretty(&value)? + "\n"
    } else {
        serde_json::from_value::<StatusSnapshot>(value)?.render_table()
    };
    super::write_stdout(&text)
}
