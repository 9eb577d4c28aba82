//! The operator's requests on the admin socket (issue 17.5): `logs`,
//! `top`, `stats` and `images`, each a call of what already answers the
//! node API or the collectors, written back as JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::frames::{self, Frame};
use super::target;
use crate::proto::v1::{LogQuery, LogSelector, LogSource};
use crate::runtime::containers::{self, TaskState};
use crate::runtime::exec_session::{self, ExecEvent, SessionRequest};
use crate::runtime::{Containerd, ImageRef, images, stats};
use crate::status::StatusSnapshot;

/// What these requests read.
#[derive(Debug, Clone)]
pub struct Node {
    pub ctd: Containerd,
    pub data_dir: PathBuf,
    /// The executor's cgroup parent (`<parent>/<container id>`).
    pub cgroup_parent: String,
    /// Where exec FIFOs go (`<run dir>/exec`).
    pub run_dir: PathBuf,
}

#[derive(Debug, Deserialize)]
struct LogsRequest {
    target: String,
    #[serde(default)]
    follow: bool,
    /// Only lines of the last this many seconds.
    since_secs: Option<u64>,
    /// The newest this many lines (at most 10,000; default all up to that).
    tail: Option<u32>,
}

/// One line of `logs`.
#[derive(Debug, Serialize, Deserialize)]
pub struct LogRow {
    pub time: String,
    pub stream: String,
    pub line: String,
}

#[derive(Debug, Deserialize)]
struct TargetRequest {
    target: Option<String>,
}

/// One row of `stats`.
#[derive(Debug, Serialize, Deserialize)]
pub struct StatsRow {
    pub id: String,
    pub app: String,
    pub environment: String,
    pub project: String,
    pub container_id: String,
    pub cpu_percent: f64,
    pub memory_bytes: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// One row of `images`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ImageRow {
    pub name: String,
    /// Layers as stored, compressed.
    pub size_bytes: u64,
    /// Containers of the namespace using it.
    pub users: Vec<String>,
    /// When a container last used it (image GC's record), RFC 3339.
    pub last_used: Option<String>,
    /// Made by this agent (image GC may remove it).
    pub owned: bool,
}

pub(super) async fn refuse<W: AsyncWrite + Unpin>(out: &mut W, error: &str) -> std::io::Result<()> {
    let body = serde_json::to_vec(&serde_json::json!({ "error": error }))
        .map_err(std::io::Error::other)?;
    out.write_all(&body).await?;
    out.write_all(b"\n").await
}

async fn reply<W: AsyncWrite + Unpin, T: Serialize>(out: &mut W, value: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    out.write_all(&body).await?;
    out.write_all(b"\n").await
}

/// Answers `verb arg`; errors the client should see are written as
/// `{"error": …}`.
pub(super) async fn answer<W: AsyncWrite + Unpin>(
    node: &Node,
    status: &StatusSnapshot,
    verb: &str,
    arg: &str,
    out: &mut W,
) -> std::io::Result<()> {
    let result = match verb {
        "logs" => match serde_json::from_str::<LogsRequest>(arg) {
            Ok(req) => return logs(node, status, req, out).await,
            Err(e) => Err(format!("logs: {e}")),
        },
        "top" => match serde_json::from_str::<TargetRequest>(arg) {
            Ok(TargetRequest {
                target: Some(target),
            }) => top(node, status, &target).await,
            Ok(_) => Err("top: name a TARGET".to_owned()),
            Err(e) => Err(format!("top: {e}")),
        },
        "stats" => {
            match serde_json::from_str::<TargetRequest>(if arg.is_empty() { "{}" } else { arg }) {
                Ok(req) => stats_of(node, status, req.target.as_deref()).await,
                Err(e) => Err(format!("stats: {e}")),
            }
        }
        "images" => images_of(node).await,
        other => Err(format!(
            "unknown request {other:?}; try status, logs, top, stats or images"
        )),
    };
    match result {
        Ok(value) => reply(out, &value).await,
        Err(e) => refuse(out, &e).await,
    }
}

async fn logs<W: AsyncWrite + Unpin>(
    node: &Node,
    status: &StatusSnapshot,
    req: LogsRequest,
    out: &mut W,
) -> std::io::Result<()> {
    let instance = match target::resolve(status, &req.target) {
        Ok(a) => a.id.clone(),
        Err(e) => return refuse(out, &e).await,
    };
    let query = LogQuery {
        selector: Some(LogSelector {
            instance_id: instance,
            ..LogSelector::default()
        }),
        since: req
            .since_secs
            .map(|s| (SystemTime::now() - Duration::from_secs(s)).into()),
        limit: req.tail.unwrap_or(u32::MAX),
        follow: req.follow,
        ..LogQuery::default()
    };
    let (_, desired) = tokio::sync::watch::channel(None);
    let mut lines =
        match crate::logs::query::query_logs(&node.ctd, &node.data_dir, &desired, query).await {
            Ok(s) => s,
            Err(e) => return refuse(out, &e.to_string()).await,
        };
    while let Some(line) = lines.next().await {
        let time = line
            .time
            .and_then(|t| SystemTime::try_from(t).ok())
            .map(|t| humantime::format_rfc3339_nanos(t).to_string())
            .unwrap_or_default();
        let stream = if line.source == LogSource::Stderr as i32 {
            "stderr"
        } else {
            "stdout"
        };
        let row = LogRow {
            time,
            stream: stream.to_owned(),
            line: line.line,
        };
        // The client went away (Ctrl-C on `logs -f`): the follow ends.
        reply(out, &row).await?;
    }
    Ok(())
}

async fn top(
    node: &Node,
    status: &StatusSnapshot,
    target: &str,
) -> Result<serde_json::Value, String> {
    let a = target::resolve(status, target)?;
    if a.container_id.is_empty() {
        return Err(format!("{}: no container yet ({:?})", a.id, a.state));
    }
    let t = crate::runtime::top::top(&node.ctd, &a.container_id)
        .await
        .map_err(|e| format!("top {}: {e}", a.id))?;
    let processes: Vec<&Vec<String>> = t.processes.iter().map(|p| &p.fields).collect();
    Ok(serde_json::json!({ "titles": t.titles, "processes": processes }))
}

/// Two samples half a second apart: CPU is the rate between them.
async fn stats_of(
    node: &Node,
    status: &StatusSnapshot,
    target: Option<&str>,
) -> Result<serde_json::Value, String> {
    let rows = match target {
        Some(t) => vec![target::resolve(status, t)?],
        None => status.assignments.iter().collect(),
    };
    let mut running = Vec::new();
    for a in rows.into_iter().filter(|a| !a.container_id.is_empty()) {
        if let Ok(TaskState::Running { pid }) =
            containers::task_state(&node.ctd, &a.container_id).await
        {
            running.push((a, pid));
        }
    }
    let path = |cid: &str| PathBuf::from(&node.cgroup_parent).join(cid);
    let first: Vec<Option<stats::Sample>> = running
        .iter()
        .map(|(a, pid)| stats::sample(&path(&a.container_id), *pid).ok())
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut out = Vec::new();
    for ((a, pid), before) in running.iter().zip(first) {
        let (Some(before), Ok(now)) = (before, stats::sample(&path(&a.container_id), *pid)) else {
            continue;
        };
        out.push(StatsRow {
            id: a.id.clone(),
            app: a.app.clone(),
            environment: a.environment.clone(),
            project: a.project.clone(),
            container_id: a.container_id.clone(),
            cpu_percent: stats::cpu_percent(&before, &now),
            memory_bytes: now.memory_bytes,
            rx_bytes: now.rx_bytes,
            tx_bytes: now.tx_bytes,
        });
    }
    serde_json::to_value(out).map_err(|e| e.to_string())
}

async fn images_of(node: &Node) -> Result<serde_json::Value, String> {
    let listed = images::list_images(&node.ctd)
        .await
        .map_err(|e| e.to_string())?;
    let mut users: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for c in containers::list(&node.ctd, &[])
        .await
        .map_err(|e| e.to_string())?
    {
        users.entry(c.image).or_default().insert(c.id);
    }
    let last_used =
        crate::image_gc::load_record(&crate::image_gc::ImageGc::record_path(&node.data_dir));
    let mut out = Vec::new();
    for i in listed {
        let size_bytes = match i.name.parse::<ImageRef>() {
            Ok(r) => images::get_local(&node.ctd, &r)
                .await
                .ok()
                .flatten()
                .map_or(0, |l| l.layer_bytes),
            Err(_) => 0,
        };
        out.push(ImageRow {
            size_bytes,
            users: users
                .remove(&i.name)
                .unwrap_or_default()
                .into_iter()
                .collect(),
            last_used: last_used
                .get(&i.name)
                .map(|t| humantime::format_rfc3339_seconds(*t).to_string()),
            owned: i.owned,
            name: i.name,
        });
    }
    serde_json::to_value(out).map_err(|e| e.to_string())
}

#[derive(Debug, Deserialize)]
struct ExecArgs {
    target: String,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default)]
    tty: bool,
    cols: Option<u16>,
    rows: Option<u16>,
}

/// What the client's frames ask of the session besides stdin.
enum Control {
    Resize(u16, u16),
    StdinEnd,
    Gone,
}

/// `exec {…}`: a process in the instance, its I/O framed ([`frames`]) on
/// this connection until it exits; a client that goes away kills it.
pub(super) async fn exec<W: AsyncWrite + Unpin>(
    node: &Node,
    status: &StatusSnapshot,
    arg: &str,
    mut reader: tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>,
    out: &mut W,
) -> std::io::Result<()> {
    let fail = |e: String| Frame::Error(e);
    let req: ExecArgs = match serde_json::from_str(arg) {
        Ok(r) => r,
        Err(e) => return frames::write(out, &fail(format!("exec: {e}"))).await,
    };
    let instance = match target::resolve(status, &req.target) {
        Ok(a) if !a.container_id.is_empty() => a,
        Ok(a) => return frames::write(out, &fail(format!("{}: no container yet", a.id))).await,
        Err(e) => return frames::write(out, &fail(e)).await,
    };
    let session_req = SessionRequest {
        args: if req.command.is_empty() {
            vec!["/bin/sh".to_owned()]
        } else {
            req.command
        },
        tty: req.tty,
        size: req
            .cols
            .zip(req.rows)
            .map(|(c, r)| (u32::from(c), u32::from(r))),
    };
    let started = exec_session::start(
        &node.ctd,
        &instance.container_id,
        &node.run_dir.join("exec"),
        &session_req,
    )
    .await;
    let (mut session, mut events) = match started {
        Ok(s) => s,
        Err(e) => return frames::write(out, &fail(e.to_string())).await,
    };
    // The client's frames on their own task: stdin goes straight to the
    // process (a process that does not read slows the client, not the
    // output); the rest comes here.
    let stdin = session.take_stdin();
    let (control_tx, mut control) = tokio::sync::mpsc::channel::<Control>(4);
    let frames_in = tokio::spawn(async move {
        let mut stdin = stdin;
        loop {
            let next = match frames::read(&mut reader).await {
                Ok(Some(Frame::Stdin(bytes))) => {
                    if let Some(tx) = &stdin
                        && tx.send(bytes).await.is_err()
                    {
                        stdin = None;
                    }
                    continue;
                }
                Ok(Some(Frame::Resize { cols, rows })) => Control::Resize(cols, rows),
                Ok(Some(Frame::StdinEnd)) => {
                    stdin = None;
                    Control::StdinEnd
                }
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => Control::Gone,
            };
            let gone = matches!(next, Control::Gone);
            if control_tx.send(next).await.is_err() || gone {
                return;
            }
        }
    });
    let result = loop {
        tokio::select! {
            c = control.recv() => match c {
                Some(Control::Resize(cols, rows)) => session.resize(cols.into(), rows.into()).await,
                Some(Control::StdinEnd) => session.close_stdin().await,
                // Dropping the session kills the process.
                Some(Control::Gone) | None => break Ok(()),
            },
            e = events.recv() => {
                let frame = match e {
                    Some(ExecEvent::Stdout(b)) => Frame::Stdout(b),
                    Some(ExecEvent::Stderr(b)) => Frame::Stderr(b),
                    Some(ExecEvent::Exited(code)) => Frame::Exit(i32::try_from(code).unwrap_or(i32::MAX)),
                    None => break Ok(()),
                };
                let last = matches!(frame, Frame::Exit(_));
                if let Err(e) = frames::write(out, &frame).await {
                    break Err(e);
                }
                if last {
                    break Ok(());
                }
            }
        }
    };
    frames_in.abort();
    result
}
