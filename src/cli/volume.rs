//! `zattera-agent volume snapshot|restore|ls`: the snapshot engine of the
//! node API without a control plane, for operators and disaster recovery.
//! The S3 target comes from `--target FILE` (TOML) and/or flags (flags win);
//! the snapshots are the same Tier A objects control's would be, so either
//! side can restore the other's.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde::Deserialize;
use zattera_agent::config::Config;
use zattera_agent::runtime::Containerd;
use zattera_agent::snapshot::{Engine, Event, ProgressFn, S3Config, VolumeLock, hooks};
use zattera_agent::volumes;

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Snapshot a volume (or any directory) into S3, encrypted and deduplicated.
    Snapshot {
        #[command(flatten)]
        which: Which,
        /// Snapshot id [default: <volume>-<UTC time>]
        #[arg(long, value_name = "ID")]
        id: Option<String>,
        /// Create the bucket first if it does not exist.
        #[arg(long)]
        create_bucket: bool,
        #[command(flatten)]
        target: TargetArgs,
    },
    /// Restore a snapshot: the volume becomes exactly the snapshot's tree.
    Restore {
        #[command(flatten)]
        which: Which,
        /// The snapshot id (what `volume ls` shows).
        #[arg(long, value_name = "ID")]
        snapshot: String,
        /// Restore even if containerd cannot be asked whether a running
        /// container mounts the volume.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        target: TargetArgs,
    },
    /// List the snapshots under the target's prefix.
    Ls {
        #[command(flatten)]
        target: TargetArgs,
    },
}

/// A node-local volume, or a directory.
#[derive(Debug, Args)]
pub struct Which {
    /// The volume's environment id.
    #[arg(long, value_name = "ID", requires = "volume", conflicts_with = "path")]
    environment: Option<String>,
    /// The volume's logical name.
    #[arg(long, value_name = "NAME", requires = "environment")]
    volume: Option<String>,
    /// A directory instead of a volume.
    #[arg(long, value_name = "DIR")]
    path: Option<PathBuf>,
}

impl Which {
    /// The root, a name for messages and default ids, and the node-local
    /// name of a volume (one kept under its legacy name is moved first).
    fn resolve(&self, config: &Config) -> Result<(PathBuf, String, Option<String>)> {
        match (&self.environment, &self.volume, &self.path) {
            (Some(env), Some(name), None) => {
                let local = volumes::ensure(&config.data_dir, env, name)?;
                Ok((
                    volumes::volume_root(&config.data_dir, &local),
                    name.clone(),
                    Some(local),
                ))
            }
            (None, None, Some(p)) => {
                let shown = p
                    .file_name()
                    .map_or_else(|| "dir".into(), |n| n.to_string_lossy().into_owned());
                Ok((p.clone(), shown, None))
            }
            _ => bail!("name a volume (--environment and --volume) or a directory (--path)"),
        }
    }
}

/// The S3 target; each flag overrides the file's key of the same name.
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// A TOML file with endpoint, bucket, prefix, region, access_key,
    /// secret_key and data_key_file.
    #[arg(long, value_name = "FILE")]
    target: Option<PathBuf>,
    /// S3 endpoint: host[:port], with http:// for plaintext [default: s3.amazonaws.com over TLS]
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    #[arg(long, value_name = "NAME")]
    bucket: Option<String>,
    /// Key prefix inside the bucket.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<String>,
    /// Bucket region [default: us-east-1]
    #[arg(long, value_name = "REGION")]
    region: Option<String>,
    #[arg(long, value_name = "KEY", env = "ZATTERA_S3_ACCESS_KEY")]
    access_key: Option<String>,
    #[arg(
        long,
        value_name = "SECRET",
        env = "ZATTERA_S3_SECRET_KEY",
        hide_env_values = true
    )]
    secret_key: Option<String>,
    /// The cluster data key: 32 raw bytes or 64 hex digits.
    #[arg(long, value_name = "FILE")]
    data_key_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetFile {
    endpoint: Option<String>,
    bucket: Option<String>,
    prefix: Option<String>,
    region: Option<String>,
    access_key: Option<String>,
    secret_key: Option<String>,
    data_key_file: Option<PathBuf>,
}

fn read_key(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).with_context(|| format!("data key {}", path.display()))?;
    if raw.len() == 32 {
        return Ok(raw);
    }
    let text = String::from_utf8_lossy(&raw);
    let text = text.trim();
    if let Some(k) = (text.len() == 64).then(|| hex::decode(text).ok()).flatten() {
        return Ok(k);
    }
    bail!(
        "data key {}: expected 32 raw bytes or 64 hex digits, found {} bytes",
        path.display(),
        raw.len()
    )
}

impl TargetArgs {
    fn engine(&self) -> Result<Engine> {
        let file = match &self.target {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("target {}", p.display()))?;
                toml::from_str::<TargetFile>(&text)
                    .with_context(|| format!("target {}", p.display()))?
            }
            None => TargetFile::default(),
        };
        let pick = |flag: &Option<String>, from_file: Option<String>| {
            flag.clone().or(from_file).unwrap_or_default()
        };
        let cfg = S3Config {
            endpoint: pick(&self.endpoint, file.endpoint),
            bucket: pick(&self.bucket, file.bucket),
            prefix: pick(&self.prefix, file.prefix),
            region: pick(&self.region, file.region),
            access_key: pick(&self.access_key, file.access_key),
            secret_key: pick(&self.secret_key, file.secret_key),
        };
        if cfg.bucket.is_empty() {
            bail!("no bucket: give --bucket or bucket in --target");
        }
        let key_file = self
            .data_key_file
            .clone()
            .or(file.data_key_file)
            .context("no data key: give --data-key-file or data_key_file in --target")?;
        Ok(Engine::new(&cfg, &read_key(&key_file)?)?)
    }
}

/// Redraws one progress line on stderr, at most ten times a second.
fn progress_line(verb: &'static str) -> (ProgressFn, Arc<Mutex<Vec<String>>>) {
    let warnings: Arc<Mutex<Vec<String>>> = Arc::default();
    let kept = Arc::clone(&warnings);
    let tty = std::io::stderr().is_terminal();
    let last = Mutex::new(
        Instant::now()
            .checked_sub(Duration::from_secs(1))
            .unwrap_or_else(Instant::now),
    );
    #[allow(clippy::cast_precision_loss)]
    let mib = |b: u64| b as f64 / 1_048_576.0;
    let progress: ProgressFn = Arc::new(move |e| {
        let line = match e {
            Event::Warning(w) => {
                if let Ok(mut k) = kept.lock() {
                    k.push(w);
                }
                return;
            }
            Event::Chunk {
                stored_bytes,
                tar_bytes,
                ..
            } => {
                format!(
                    "{verb}: {:.1} MiB read, {:.1} MiB new",
                    mib(tar_bytes),
                    mib(stored_bytes)
                )
            }
            Event::Downloaded { bytes, total } => {
                let width = 30usize;
                let filled = bytes
                    .saturating_mul(width as u64)
                    .checked_div(total)
                    .map_or(width, |f| usize::try_from(f).unwrap_or(width));
                format!(
                    "{verb}: [{}{}] {:.1}/{:.1} MiB",
                    "#".repeat(filled.min(width)),
                    "-".repeat(width - filled.min(width)),
                    mib(bytes),
                    mib(total)
                )
            }
        };
        if !tty {
            return;
        }
        let Ok(mut at) = last.lock() else { return };
        if at.elapsed() >= Duration::from_millis(100) {
            *at = Instant::now();
            eprint!("\r\x1b[K{line}");
        }
    });
    (progress, warnings)
}

fn finish_line(warnings: &Mutex<Vec<String>>) {
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[K");
    }
    if let Ok(w) = warnings.lock() {
        for line in w.iter() {
            eprintln!("warning: {line}");
        }
    }
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0))
}

/// The running managed containers that mount the volume (or `root`), when
/// containerd answers.
async fn users(config: &Config, root: &Path, local: Option<&str>) -> Result<Vec<String>> {
    let ctd = tokio::time::timeout(
        Duration::from_secs(5),
        Containerd::connect(&config.containerd_address, config.namespace.clone()),
    )
    .await
    .context("containerd did not answer in 5 s")??;
    Ok(match local {
        Some(local) => hooks::running_users_of(&ctd, &config.data_dir, local).await?,
        None => hooks::running_users(&ctd, root).await?,
    })
}

pub async fn run(config: &Config, cmd: VolumeCommand) -> Result<()> {
    match cmd {
        VolumeCommand::Snapshot {
            which,
            id,
            create_bucket,
            target,
        } => {
            let (root, name, _) = which.resolve(config)?;
            if !root.is_dir() {
                bail!("{}: no such volume directory", root.display());
            }
            let engine = target
                .engine()?
                .with_cache(config.data_dir.join("snapshot-cache"));
            if create_bucket {
                engine.store().create_bucket().await?;
            }
            let id = id.unwrap_or_else(|| {
                let stamp = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
                format!("{name}-{}", stamp.replace(['-', ':'], ""))
            });
            let _lock = VolumeLock::acquire(&root, &name)?;
            let (progress, warnings) = progress_line("snapshot");
            let started = Instant::now();
            let result = engine.snapshot(&root, &id, now_unix(), progress).await;
            finish_line(&warnings);
            let out = result?;
            #[allow(clippy::cast_precision_loss)]
            let mib = |b: u64| b as f64 / 1_048_576.0;
            super::write_stdout(&format!(
                "snapshot {}: {:.1} MiB, {:.1} MiB new ({} of {} chunks{}), {} warnings, {:.1} s\n",
                out.manifest_key,
                mib(out.tar_bytes),
                mib(out.new_bytes),
                out.new_chunks,
                out.chunks,
                if out.reused {
                    "; unchanged, nothing read"
                } else {
                    ""
                },
                out.warnings,
                started.elapsed().as_secs_f64()
            ))?;
        }
        VolumeCommand::Restore {
            which,
            snapshot,
            force,
            target,
        } => {
            let (root, name, local) = which.resolve(config)?;
            let engine = target.engine()?;
            let _lock = VolumeLock::acquire(&root, &name)?;
            match users(config, &root, local.as_deref()).await {
                Ok(running) if !running.is_empty() => {
                    bail!(
                        "{name} is mounted by running container {}; stop it first",
                        running.join(", ")
                    )
                }
                Ok(_) => {}
                Err(e) if force => eprintln!("warning: not checked for running containers: {e:#}"),
                Err(e) => {
                    bail!("cannot check for running containers ({e:#}); --force restores anyway")
                }
            }
            let (progress, warnings) = progress_line("restore");
            let started = Instant::now();
            let result = engine.restore(&snapshot, &root, progress).await;
            finish_line(&warnings);
            let out = result?;
            super::write_stdout(&format!(
                "restored {snapshot} into {}: {} entries, {:.1} s\n",
                root.display(),
                out.entries,
                started.elapsed().as_secs_f64()
            ))?;
        }
        VolumeCommand::Ls { target } => {
            let engine = target.engine()?;
            let mut rows = Vec::new();
            for l in engine.list().await? {
                let (created, size, chunks) = match engine.manifest(&l.key).await {
                    Ok(m) => {
                        let t = UNIX_EPOCH
                            + Duration::from_secs(u64::try_from(m.created_at_unix).unwrap_or(0));
                        (
                            humantime::format_rfc3339_seconds(t).to_string(),
                            format!("{}", m.tar_bytes),
                            m.chunks.len().to_string(),
                        )
                    }
                    Err(e) => (format!("unreadable: {e}"), "-".into(), "-".into()),
                };
                rows.push((created, l.key, size, chunks));
            }
            rows.sort();
            let mut text = format!(
                "{:<22} {:<40} {:>14} {:>7}\n",
                "CREATED", "SNAPSHOT", "BYTES", "CHUNKS"
            );
            for (created, id, size, chunks) in rows {
                let _ = writeln!(text, "{created:<22} {id:<40} {size:>14} {chunks:>7}");
            }
            super::write_stdout(&text)?;
        }
    }
    Ok(())
}
