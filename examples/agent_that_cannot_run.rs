//! A broken release of the agent, for the self-upgrade roll-back test
//! (`tests/power_cut.rs`): it answers `version --json` as the agent does
//! (its tag stamped like any release's) and starts `run` as the agent does,
//! counting its start of an upgrade on trial, then fails, as a release that
//! refuses its config would.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let tag = zattera_agent::version::tag();
    if args.get(1).map(String::as_str) == Some("version") {
        println!("{{\"name\":\"zattera-agent\",\"version\":\"{tag}\"}}");
        return ExitCode::SUCCESS;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = zattera_agent::upgrade::rollback::trial_at_start() {
        eprintln!("zattera-agent {tag}: {e}");
        return ExitCode::FAILURE;
    }
    eprintln!("zattera-agent {tag}: agent.toml: a key this release refuses");
    ExitCode::FAILURE
}
