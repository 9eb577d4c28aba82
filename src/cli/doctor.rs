//! `zattera-agent doctor [--json]`: the preflight report.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use zattera_agent::config::Settings;

use super::GlobalArgs;

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// One JSON object (`ok`, `checks`) instead of lines.
    #[arg(long)]
    json: bool,
}

/// Exits 1 when a check the agent cannot run without fails.
pub async fn run(global: &GlobalArgs, args: &DoctorArgs) -> Result<ExitCode> {
    let origin = global.config.as_ref().map_or_else(
        || zattera_agent::config::DEFAULT_CONFIG_PATH.to_owned(),
        |p| p.display().to_string(),
    );
    let config = Settings::load(global.config.as_deref())
        .and_then(|file| file.overlay(global.settings()).resolve());
    let report = zattera_agent::doctor::run(config, &origin).await;
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        report.render()
    };
    super::write_stdout(&text)?;
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
