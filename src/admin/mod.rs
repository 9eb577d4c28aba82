//! The local admin socket (`<run dir>/agent.sock`, root only): how
//! `zattera-agent status`, `logs`, `top`, `stats`, `images` and
//! `zattera-netns` read the running agent's live state. One request line in
//! (`status`, or a verb and a JSON argument: `logs {"target":…}`), one JSON
//! document out (a JSON line per log line for `logs`, until the history
//! ends or, with `follow`, the client goes), then the connection closes, so
//! `socat` or `nc -U` work as clients too.

pub mod frames;
pub mod ops;
pub mod target;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use crate::status::StatusSnapshot;

pub const SOCKET_NAME: &str = "agent.sock";
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of one request line at most.
const MAX_REQUEST: u64 = 64 * 1024;

pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join(SOCKET_NAME)
}

/// Binds the socket (replacing a stale one) with mode 0600.
pub fn bind(run_dir: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(run_dir)?;
    let path = socket_path(run_dir);
    // A socket file left by a killed agent refuses connections: replace it.
    if std::os::unix::net::UnixStream::connect(&path).is_err() {
        let _ = std::fs::remove_file(&path);
    }
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Node-level warnings, one feed per service that has any (the identity's
/// expiry, disk pressure).
pub type Notices = Vec<watch::Receiver<Vec<String>>>;

/// What the admin socket answers from.
#[derive(Debug, Clone)]
pub struct Admin {
    pub status: watch::Receiver<Arc<StatusSnapshot>>,
    /// Shown with the status.
    pub notices: Notices,
    /// For `logs`, `top`, `stats` and `images`; `None` answers only `status`.
    pub node: Option<ops::Node>,
}

/// Serves requests until the task is dropped.
pub async fn serve(listener: UnixListener, admin: Admin) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, admin).await {
                tracing::debug!(error = %e, "admin request failed");
            }
        });
    }
}

async fn answer(stream: UnixStream, admin: Admin) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut line = String::new();
    // A request is one short line; a caller cannot make us buffer more, nor
    // hold a task by never sending it. What follows it (exec frames) stays
    // in `reader`.
    tokio::time::timeout(
        REQUEST_TIMEOUT,
        (&mut reader).take(MAX_REQUEST).read_line(&mut line),
    )
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let (verb, arg) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
    let snapshot = || {
        let mut snapshot = StatusSnapshot::clone(&admin.status.borrow());
        snapshot.notices = admin
            .notices
            .iter()
            .flat_map(|n| n.borrow().clone())
            .collect();
        snapshot
    };
    if verb == "status" {
        let body = serde_json::to_vec(&snapshot()).map_err(std::io::Error::other)?;
        write.write_all(&body).await?;
        write.write_all(b"\n").await?;
        return write.shutdown().await;
    }
    let Some(node) = &admin.node else {
        return ops::refuse(
            &mut write,
            &format!("unknown request {verb:?}; try \"status\""),
        )
        .await;
    };
    if verb == "exec" {
        ops::exec(node, &snapshot(), arg, reader, &mut write).await?;
    } else {
        ops::answer(node, &snapshot(), verb, arg, &mut write).await?;
    }
    write.shutdown().await
}

/// Client side: one request, the JSON answer.
pub async fn request(run_dir: &Path, what: &str) -> std::io::Result<serde_json::Value> {
    let path = socket_path(run_dir);
    let mut stream = UnixStream::connect(&path).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("no agent answers at {}: {e}", path.display()),
        )
    })?;
    stream.write_all(format!("{what}\n").as_bytes()).await?;
    let mut body = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut body).await?;
    serde_json::from_slice(&body).map_err(std::io::Error::other)
}
