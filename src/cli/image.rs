//! `zattera-agent image import|pull`.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use zattera_agent::config::Config;
use zattera_agent::runtime::pull::{Credentials, Puller};
use zattera_agent::runtime::{Containerd, ImageRef, import_archive};

use super::pull_progress;

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Import an OCI image layout archive or a `docker save` archive and unpack it.
    Import {
        /// The archive (an uncompressed tar).
        file: PathBuf,
        /// Name for the archive's single image, instead of the name it carries.
        #[arg(long, value_name = "REF")]
        name: Option<String>,
    },
    /// Pull an image from its registry and unpack it.
    Pull {
        /// Image reference, normalised as Docker does (busybox → docker.io/library/busybox:latest).
        reference: String,
        /// Registry user for basic auth; the password comes from ZATTERA_REGISTRY_PASSWORD.
        #[arg(long, value_name = "USER")]
        username: Option<String>,
        /// A registry (`host:port`) to reach over plain HTTP; loopback ones always are.
        #[arg(long, value_name = "HOST")]
        insecure_registry: Vec<String>,
    },
}

pub async fn run(config: &Config, cmd: ImageCommand) -> Result<()> {
    let ctd = Containerd::connect(&config.containerd_address, config.namespace.clone()).await?;
    match cmd {
        ImageCommand::Import { file, name } => {
            let name = name
                .map(|n| n.parse::<ImageRef>())
                .transpose()
                .context("--name")?;
            let imported = import_archive(&ctd, &file, name)
                .await
                .with_context(|| format!("import {}", file.display()))?;
            for image in imported {
                for name in &image.names {
                    println!(
                        "imported {name} ({}, {} new blobs, rootfs {})",
                        image.target.digest, image.blobs_written, image.chain_id
                    );
                }
            }
        }
        ImageCommand::Pull {
            reference,
            username,
            insecure_registry,
        } => {
            let reference = reference.parse::<ImageRef>()?;
            let credentials = match username {
                None => Credentials::Anonymous,
                Some(username) => Credentials::Basic {
                    username,
                    password: std::env::var("ZATTERA_REGISTRY_PASSWORD")
                        .context("--username needs the password in ZATTERA_REGISTRY_PASSWORD")?,
                },
            };
            let puller = Puller::new(ctd, insecure_registry);
            let on_terminal = std::io::stderr().is_terminal();
            let progress = on_terminal.then(|| pull_progress::terminal(reference.to_string()));
            let image = puller.ensure(&reference, &credentials, progress).await;
            if on_terminal {
                eprintln!();
            }
            let image = image?;
            println!(
                "pulled {reference} ({}, rootfs {})",
                image.target.digest, image.chain_id
            );
        }
    }
    Ok(())
}
