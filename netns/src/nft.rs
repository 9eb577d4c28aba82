//! Runs `nft` on our table, and nothing else: the only commands sent are a
//! rebuild, a delete and a list of `inet <table>`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::error::{Error, Result};
use crate::firewall::{FirewallState, render};

/// The agent's nftables table.
#[derive(Debug, Clone)]
pub struct Nft {
    binary: PathBuf,
    table: String,
}

impl Nft {
    pub fn new(binary: impl Into<PathBuf>, table: impl Into<String>) -> Self {
        Self {
            binary: binary.into(),
            table: table.into(),
        }
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Replaces the table with `state`, atomically.
    pub fn apply(&self, state: &FirewallState) -> Result<()> {
        self.run("rebuild", &["-f", "-"], Some(&render(&self.table, state)))
            .map(drop)
    }

    /// Deletes the table; an absent table is fine.
    pub fn delete(&self) -> Result<()> {
        let t = &self.table;
        let script = format!("table inet {t}\ndelete table inet {t}\n");
        self.run("delete", &["-f", "-"], Some(&script)).map(drop)
    }

    /// The table as `nft list` prints it, or `None` when it does not exist.
    pub fn list(&self) -> Result<Option<String>> {
        match self.run("list", &["list", "table", "inet", &self.table], None) {
            Ok(out) => Ok(Some(out)),
            Err(Error::Nft { stderr, .. }) if stderr.contains("No such file or directory") => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn run(&self, action: &'static str, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut child = Command::new(&self.binary)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| Error::NftMissing {
                binary: self.binary.clone(),
                source,
            })?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A write error shows up as nft's own failure below.
            let _ = pipe.write_all(text.as_bytes());
        }
        let out = child
            .wait_with_output()
            .map_err(|source| Error::NftMissing {
                binary: self.binary.clone(),
                source,
            })?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(Error::Nft {
                action,
                table: self.table.clone(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }
}
