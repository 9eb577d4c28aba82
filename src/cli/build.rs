//! `zattera-agent build DIR`: the node's build pipeline on a local
//! directory, so an operator can try the builder of a node by hand.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use zattera_agent::config::Config;
use zattera_agent::image_build::pipeline::Source;
use zattera_agent::image_build::{BuildRequest, Event, Phase, Pipeline, PipelineConfig};
use zattera_agent::runtime::Containerd;

#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The context: a directory with a Dockerfile (or one nixpacks can plan).
    dir: PathBuf,
    /// The image name [default: zattera.local/builds/<dir name>:latest]
    #[arg(long, short = 't', value_name = "REF")]
    tag: Option<String>,
    /// Push the image to its registry (the node's credential for the cluster registry) instead of loading it into containerd.
    #[arg(long)]
    push: bool,
    /// Target platforms, comma-separated [default: this machine's]
    #[arg(long, value_name = "OS/ARCH", value_delimiter = ',')]
    platform: Vec<String>,
    /// A Dockerfile ARG value; repeatable.
    #[arg(long = "build-arg", value_name = "KEY=VALUE")]
    build_arg: Vec<String>,
}

fn pairs(items: &[String]) -> Result<BTreeMap<String, String>> {
    items
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("--build-arg {kv:?}: expected KEY=VALUE"))
        })
        .collect()
}

pub async fn run(config: &Config, args: BuildArgs) -> Result<()> {
    if !args.dir.is_dir() {
        bail!("{}: not a directory", args.dir.display());
    }
    let ctd = Containerd::connect(&config.containerd_address, config.namespace.clone()).await?;
    let backend = zattera_agent::image_build::choose_backend(&zattera_agent::image_build::Host {
        settings: &config.build,
        ctd: Some(ctd),
        containerd_address: &config.containerd_address,
        namespace: config.namespace.as_str(),
        data_dir: &config.data_dir,
        run_dir: &config.run_dir,
        oci_runtime: &config.oci_runtime,
    })
    .map_err(anyhow::Error::msg)?;
    let mut pipeline_config = PipelineConfig::new(&config.data_dir);
    pipeline_config
        .planner
        .binary
        .clone_from(&config.build.nixpacks);
    // An enrolled node pushes to the cluster registry with its credential.
    let identity = zattera_agent::link::identity::IdentityDir::new(&config.data_dir);
    if let (Ok(enrollment), Ok(tls)) = (identity.load_enrollment(), identity.load_tls()) {
        let registry = enrollment.cluster_registry(&tls).map(std::sync::Arc::new);
        pipeline_config.cluster_registry = Some(tokio::sync::watch::channel(registry).1);
    }
    let pipeline = Pipeline {
        config: pipeline_config,
        backend,
    };
    let name = args
        .dir
        .canonicalize()
        .ok()
        .and_then(|d| {
            d.file_name()
                .map(|n| n.to_string_lossy().to_ascii_lowercase())
        })
        .unwrap_or_else(|| "context".into());
    let tag = args
        .tag
        .clone()
        .unwrap_or_else(|| format!("zattera.local/builds/{name}:latest"));
    let req = BuildRequest {
        id: format!("local-{name}"),
        project: String::new(),
        source: Source::Dir(args.dir.clone()),
        platforms: args.platform.clone(),
        push_ref: args.push.then(|| tag.clone()),
        load_name: tag.clone(),
        build_args: pairs(&args.build_arg)?,
        build_env: BTreeMap::new(),
        registry_credential: None,
    };
    eprintln!(
        "building {} with {} → {tag}{}",
        args.dir.display(),
        pipeline.backend.name(),
        if args.push {
            " (push)"
        } else {
            " (containerd)"
        }
    );
    let (tx, mut rx) = tokio::sync::mpsc::channel(128);
    let cancel = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let interrupt = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: stopping the build");
            interrupt.cancel();
        }
    });
    let tty = std::io::stderr().is_terminal();
    let show = tokio::spawn(async move {
        while let Some(Event::Log { phase, line }) = rx.recv().await {
            let tag = match phase {
                Phase::Source => "source",
                Phase::Plan => "plan",
                Phase::Build => "build",
            };
            let secs = started.elapsed().as_secs_f32();
            if tty {
                eprintln!("\x1b[2m{secs:6.1}s {tag:>6}\x1b[0m {line}");
            } else {
                eprintln!("{secs:6.1}s {tag:>6} {line}");
            }
        }
    });
    let result = pipeline.run(req, tx, cancel).await;
    let _ = show.await;
    let outcome = result.map_err(|e| anyhow::anyhow!("{e}"))?;
    println!(
        "built {tag}@{} for {} in {:.1}s",
        outcome.digest,
        outcome.platforms.join(","),
        started.elapsed().as_secs_f32()
    );
    Ok(())
}
