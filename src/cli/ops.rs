//! `zattera-agent logs`, `top`, `stats` and `images`: the running agent's
//! answers on its admin socket ([`zattera_agent::admin::ops`]), as tables,
//! lines or `--json`.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use zattera_agent::admin::ops::{ImageRow, LogRow, StatsRow};
use zattera_agent::config::Config;

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Assignment id, container id, or app.env.project
    target: String,
    /// Keep printing new lines (across rotations) until interrupted.
    #[arg(short, long)]
    follow: bool,
    /// Only lines newer than this, as 10m or 2h.
    #[arg(long, value_name = "DURATION")]
    since: Option<String>,
    /// Only the newest N lines (at most 10,000).
    #[arg(long, value_name = "N")]
    tail: Option<u32>,
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// Assignment id, container id, or app.env.project
    target: String,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// One instance (assignment id, container id, or app.env.project); all without.
    target: Option<String>,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct ImagesArgs {
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The running agent's admin socket.
async fn connect(config: &Config) -> Result<tokio::net::UnixStream> {
    let path = zattera_agent::admin::socket_path(&config.run_dir);
    tokio::net::UnixStream::connect(&path)
        .await
        .with_context(|| {
            format!(
                "no agent answers at {} (is it running? --run-dir)",
                path.display()
            )
        })
}

/// Sends one request; every answer line goes to `each` until the agent
/// ends the answer. `{"error": …}` is the agent refusing.
async fn ask(
    config: &Config,
    request: &str,
    mut each: impl FnMut(Value) -> Result<()>,
) -> Result<()> {
    let mut stream = connect(config).await?;
    stream.write_all(format!("{request}\n").as_bytes()).await?;
    let mut lines = BufReader::new(stream).lines();
    while let Some(line) = lines.next_line().await? {
        let value: Value = serde_json::from_str(&line).context("the agent's answer")?;
        if let Some(e) = value.get("error").and_then(Value::as_str) {
            bail!("{e}");
        }
        each(value)?;
    }
    Ok(())
}

/// [`ask`] for a request answered by one document.
async fn ask_one(config: &Config, request: &str) -> Result<Value> {
    let mut answer = Value::Null;
    ask(config, request, |v| {
        answer = v;
        Ok(())
    })
    .await?;
    Ok(answer)
}

pub async fn logs(config: &Config, args: &LogsArgs) -> Result<()> {
    let since_secs = args
        .since
        .as_deref()
        .map(|s| humantime::parse_duration(s).map(|d: Duration| d.as_secs()))
        .transpose()
        .context("--since: a duration such as 10m or 2h")?;
    let request = serde_json::json!({
        "target": args.target,
        "follow": args.follow,
        "since_secs": since_secs,
        "tail": args.tail,
    });
    ask(config, &format!("logs {request}"), |v| {
        let row: LogRow = serde_json::from_value(v)?;
        // The container's two streams stay apart, as `docker logs` keeps them.
        if row.stream == "stderr" {
            eprintln!("{}", row.line);
            Ok(())
        } else {
            super::write_stdout(&format!("{}\n", row.line))
        }
    })
    .await
}

pub async fn top(config: &Config, args: &TopArgs) -> Result<()> {
    let answer = ask_one(
        config,
        &format!("top {}", serde_json::json!({ "target": args.target })),
    )
    .await?;
    let titles: Vec<String> = serde_json::from_value(answer["titles"].clone()).unwrap_or_default();
    let rows: Vec<Vec<String>> =
        serde_json::from_value(answer["processes"].clone()).unwrap_or_default();
    super::write_stdout(&table(&titles, &rows))
}

pub async fn stats(config: &Config, args: &StatsArgs) -> Result<()> {
    let answer = ask_one(
        config,
        &format!("stats {}", serde_json::json!({ "target": args.target })),
    )
    .await?;
    if args.json {
        return super::write_stdout(&(serde_json::to_string_pretty(&answer)? + "\n"));
    }
    let rows: Vec<StatsRow> = serde_json::from_value(answer)?;
    let titles = [
        "INSTANCE", "APP", "ENV", "CPU %", "MEMORY", "NET RX", "NET TX",
    ]
    .map(String::from);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.id.clone(),
                r.app.clone(),
                r.environment.clone(),
                format!("{:.1}", r.cpu_percent),
                mib(r.memory_bytes),
                mib(r.rx_bytes),
                mib(r.tx_bytes),
            ]
        })
        .collect();
    super::write_stdout(&table(&titles, &cells))
}

pub async fn images(config: &Config, args: &ImagesArgs) -> Result<()> {
    let answer = ask_one(config, "images").await?;
    if args.json {
        return super::write_stdout(&(serde_json::to_string_pretty(&answer)? + "\n"));
    }
    let rows: Vec<ImageRow> = serde_json::from_value(answer)?;
    let titles = ["IMAGE", "SIZE", "USERS", "LAST USED"].map(String::from);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                mib(r.size_bytes),
                r.users.len().to_string(),
                r.last_used.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    super::write_stdout(&table(&titles, &cells))
}

fn mib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let m = bytes as f64 / f64::from(1 << 20);
    format!("{m:.1} MiB")
}

/// Columns padded to their widest cell; the last one is not.
fn table(titles: &[String], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = titles.iter().map(|t| t.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    for row in std::iter::once(titles).chain(rows.iter().map(Vec::as_slice)) {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            if i == last {
                let _ = write!(out, "{cell}");
            } else {
                let _ = write!(out, "{cell:<w$}  ", w = widths.get(i).copied().unwrap_or(0));
            }
        }
        out.push('\n');
    }
    out
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Keep stdin open and send it to the process.
    #[arg(short, long)]
    interactive: bool,
    /// A terminal for the process (raw mode here, resized with this one).
    #[arg(short, long)]
    tty: bool,
    /// Assignment id, container id, or app.env.project
    target: String,
    /// The command and its arguments [default: /bin/sh]
    #[arg(last = true)]
    command: Vec<String>,
}

/// The terminal as it was, put back on drop (also on an error path).
struct RawMode(rustix::termios::Termios);

impl RawMode {
    fn enter() -> Option<Self> {
        let stdin = std::io::stdin();
        let before = rustix::termios::tcgetattr(&stdin).ok()?;
        let mut raw = before.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw).ok()?;
        Some(Self(before))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.0,
        );
    }
}

fn terminal_size() -> Option<(u16, u16)> {
    let w = rustix::termios::tcgetwinsize(std::io::stdin()).ok()?;
    (w.ws_col > 0 && w.ws_row > 0).then_some((w.ws_col, w.ws_row))
}

/// `exec [-it] TARGET -- CMD...`: the process's exit code is ours.
pub async fn exec(config: &Config, args: &ExecArgs) -> Result<std::process::ExitCode> {
    use zattera_agent::admin::frames::{self, Frame};
    let stream = connect(config).await?;
    let size = if args.tty { terminal_size() } else { None };
    let request = serde_json::json!({
        "target": args.target,
        "command": args.command,
        "tty": args.tty,
        "cols": size.map(|s| s.0),
        "rows": size.map(|s| s.1),
    });
    let (mut read, mut write) = stream.into_split();
    write
        .write_all(format!("exec {request}\n").as_bytes())
        .await?;

    // One writer: stdin and resizes both go through it.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Frame>(16);
    tokio::spawn(async move {
        while let Some(f) = rx.recv().await {
            if frames::write(&mut write, &f).await.is_err() {
                return;
            }
        }
        // Kept open until the process is done: a closed socket means gone.
        let _open = write;
        std::future::pending::<()>().await;
    });
    let raw = if args.tty { RawMode::enter() } else { None };
    if args.interactive {
        let tx = tx.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match stdin.read(&mut buf).await {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(Frame::StdinEnd).await;
                        return;
                    }
                    Ok(n) => {
                        if tx.send(Frame::Stdin(buf[..n].to_vec())).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
    } else {
        tx.send(Frame::StdinEnd).await.ok();
    }
    if args.tty {
        let tx = tx.clone();
        if let Ok(mut winch) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        {
            tokio::spawn(async move {
                while winch.recv().await.is_some() {
                    if let Some((cols, rows)) = terminal_size()
                        && tx.send(Frame::Resize { cols, rows }).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    }
    let code = loop {
        match frames::read(&mut read).await? {
            Some(Frame::Stdout(b)) => {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                out.write_all(&b)?;
                out.flush()?;
            }
            Some(Frame::Stderr(b)) => {
                use std::io::Write;
                let mut err = std::io::stderr().lock();
                err.write_all(&b)?;
                err.flush()?;
            }
            Some(Frame::Exit(code)) => break code,
            Some(Frame::Error(e)) => {
                drop(raw);
                bail!("{e}");
            }
            Some(_) => {}
            None => {
                drop(raw);
                bail!("the agent ended the exec without an exit code");
            }
        }
    };
    drop(raw);
    // A blocking stdin read would hold the runtime's shutdown: leave now.
    std::process::exit(code.clamp(0, 255));
}
