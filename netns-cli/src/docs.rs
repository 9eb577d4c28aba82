//! Shell completions and man pages, generated from the clap definitions so
//! they never drift from the flags.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;

pub fn completions<C: CommandFactory>(shell: clap_complete::Shell) -> Result<ExitCode> {
    let mut cmd = C::command();
    let name = cmd.get_name().to_owned();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut script);
    match std::io::stdout().lock().write_all(&script) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::SUCCESS),
    }
}

pub fn man<C: CommandFactory>(dir: &Path) -> Result<ExitCode> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(C::command(), dir)
        .with_context(|| format!("writing man pages into {}", dir.display()))?;
    Ok(ExitCode::SUCCESS)
}
