//! Shell completions and man pages, generated from the clap definitions so
//! they never drift from the flags.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Where `zattera-agent.1` and one page per command go.
    dir: PathBuf,
}

pub fn completions(args: &CompletionsArgs) -> Result<()> {
    let mut cmd = super::Cli::command();
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "zattera-agent", &mut script);
    super::write_stdout(&String::from_utf8_lossy(&script))
}

pub fn man(args: &ManArgs) -> Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    clap_mangen::generate_to(super::Cli::command(), &args.dir)
        .with_context(|| format!("writing man pages into {}", args.dir.display()))
}
