//! An interactive exec: a process in a running container with its stdin,
//! stdout and stderr (or one terminal) streamed, for the node API's `Exec`.
//!
//! Like [`super::exec`], the process spec is the container's own with other
//! args, and the I/O goes through FIFOs the agent makes. Output is read on
//! blocking threads until EOF, which the runc shim delivers once the process
//! has exited and its output is copied, so the exit event always comes
//! last. Stdin is opened read-write, which never blocks on a FIFO, and
//! written from its own thread; closing it (and `CloseIO`) gives the process
//! EOF. Dropping the [`ExecSession`] kills a process still running.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use containerd_client::services::v1::{
    CloseIoRequest, ExecProcessRequest, KillRequest, ResizePtyRequest, StartRequest, WaitRequest,
};
use tokio::sync::mpsc;

use super::connection::Containerd;
use super::error::RuntimeError;
use super::exec::{ExecRequest, delete_process, make_fifo, poke_reader, process_for};
use super::spec::PROCESS_TYPE_URL;

const SIGKILL: u32 = 9;
const READ_SIZE: usize = 32 * 1024;

/// What the process does, in order; `Exited` is the last event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exited(u32),
}

/// How to start the process.
#[derive(Debug, Clone, Default)]
pub struct SessionRequest {
    pub args: Vec<String>,
    pub tty: bool,
    /// Terminal size, `(cols, rows)`; ignored without a tty.
    pub size: Option<(u32, u32)>,
}

/// A running exec: its input side. Events arrive on the receiver
/// [`start`] returned.
#[derive(Debug)]
pub struct ExecSession {
    ctd: Containerd,
    container_id: String,
    exec_id: String,
    stdin: Option<mpsc::Sender<Vec<u8>>>,
    finished: tokio::sync::watch::Receiver<bool>,
}

/// Stdin chunks queued for a process at most: a caller that writes faster
/// than the process reads is slowed down, not buffered without end.
pub const STDIN_QUEUE: usize = 16;

/// Starts `req` in container `id`. `fifo_dir` is a private directory for
/// the FIFOs (removed when the session ends).
pub async fn start(
    ctd: &Containerd,
    id: &str,
    fifo_dir: &Path,
    req: &SessionRequest,
) -> Result<(ExecSession, mpsc::Receiver<ExecEvent>), RuntimeError> {
    if req.args.is_empty() {
        return Err(RuntimeError::Invalid(format!(
            "exec in {id}: no command given"
        )));
    }
    let spec = ExecRequest {
        args: req.args.clone(),
        console_size: req.size.filter(|(c, r)| *c > 0 && *r > 0),
        ..ExecRequest::default()
    };
    let process_json = process_for(ctd, id, &spec, req.tty).await?;
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let exec_id = format!("session-{nanos}");
    let dir = fifo_dir.join(&exec_id);
    let fifos = Fifos::create(&dir, req.tty)
        .map_err(|e| RuntimeError::Invalid(format!("exec in {id}: fifos: {e}")))?;
    let context = format!("exec {exec_id} in {id}");
    let created = ctd
        .tasks()
        .exec(ctd.request(ExecProcessRequest {
            container_id: id.into(),
            stdin: path_string(&fifos.stdin),
            stdout: path_string(&fifos.stdout),
            stderr: fifos.stderr.as_deref().map(path_string).unwrap_or_default(),
            terminal: req.tty,
            spec: Some(prost_types::Any {
                type_url: PROCESS_TYPE_URL.into(),
                value: process_json,
            }),
            exec_id: exec_id.clone(),
        }))
        .await;
    if let Err(s) = created {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(RuntimeError::grpc(context)(s));
    }

    let (events_tx, events_rx) = mpsc::channel(64);
    let readers: Vec<std::thread::JoinHandle<()>> = [
        Some((fifos.stdout.clone(), false)),
        fifos.stderr.clone().map(|p| (p, true)),
    ]
    .into_iter()
    .flatten()
    .map(|(path, err)| {
        let tx = events_tx.clone();
        std::thread::spawn(move || pump_output(&path, err, &tx))
    })
    .collect();
    let stdin_file = match OpenOptions::new().read(true).write(true).open(&fifos.stdin) {
        Ok(f) => f,
        Err(e) => {
            release(&fifos, &readers).await;
            cleanup(ctd, id, &exec_id, &dir).await;
            return Err(RuntimeError::Invalid(format!("{context}: stdin: {e}")));
        }
    };
    let (stdin_tx, mut stdin_rx) = mpsc::channel::<Vec<u8>>(STDIN_QUEUE);
    std::thread::spawn(move || pump_input(stdin_file, &mut stdin_rx));

    if let Err(s) = ctd
        .tasks()
        .start(ctd.request(StartRequest {
            container_id: id.into(),
            exec_id: exec_id.clone(),
        }))
        .await
    {
        drop(stdin_tx);
        // Readers waiting for a writer are let go before the FIFOs go.
        release(&fifos, &readers).await;
        cleanup(ctd, id, &exec_id, &dir).await;
        return Err(RuntimeError::grpc(context)(s));
    }

    let (done_tx, finished) = tokio::sync::watch::channel(false);
    let (ctd2, id2, exec2) = (ctd.clone(), id.to_owned(), exec_id.clone());
    // An exited exec process keeps its status until deleted: a fast exit
    // cannot be missed by this later Wait.
    let wait = ctd.request(WaitRequest {
        container_id: id.into(),
        exec_id: exec_id.clone(),
    });
    tokio::spawn(async move {
        let code = match ctd2.tasks().wait(wait).await {
            Ok(r) => r.into_inner().exit_status,
            Err(s) => {
                tracing::warn!(container = %id2, exec = %exec2, error = %s.message(), "exec wait failed");
                128 + SIGKILL
            }
        };
        // All output is in once the readers hit EOF.
        let _ = tokio::task::spawn_blocking(move || {
            for r in readers {
                let _ = r.join();
            }
        })
        .await;
        let _ = events_tx.send(ExecEvent::Exited(code)).await;
        let _ = done_tx.send(true);
        cleanup(&ctd2, &id2, &exec2, &dir).await;
    });
    Ok((
        ExecSession {
            ctd: ctd.clone(),
            container_id: id.to_owned(),
            exec_id,
            stdin: Some(stdin_tx),
            finished,
        },
        events_rx,
    ))
}

impl ExecSession {
    /// The process's stdin queue ([`STDIN_QUEUE`] chunks), for the caller
    /// to own: dropping it (and [`close_stdin`]) ends stdin.
    ///
    /// [`close_stdin`]: ExecSession::close_stdin
    pub fn take_stdin(&mut self) -> Option<mpsc::Sender<Vec<u8>>> {
        self.stdin.take()
    }

    /// Ends stdin: the process reads EOF (once the queue from
    /// [`take_stdin`](ExecSession::take_stdin) is dropped too).
    pub async fn close_stdin(&mut self) {
        self.stdin = None;
        let _ = self
            .ctd
            .tasks()
            .close_io(self.ctd.request(CloseIoRequest {
                container_id: self.container_id.clone(),
                exec_id: self.exec_id.clone(),
                stdin: true,
            }))
            .await;
    }

    pub async fn resize(&self, cols: u32, rows: u32) {
        resize_pty(&self.ctd, &self.container_id, &self.exec_id, cols, rows).await;
    }
}

impl Drop for ExecSession {
    /// A session given up before its process ended kills the process.
    fn drop(&mut self) {
        if *self.finished.borrow() {
            return;
        }
        let (ctd, container_id, exec_id) = (
            self.ctd.clone(),
            self.container_id.clone(),
            self.exec_id.clone(),
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = ctd
                    .tasks()
                    .kill(ctd.request(KillRequest {
                        container_id,
                        exec_id,
                        signal: SIGKILL,
                        all: false,
                    }))
                    .await;
            });
        }
    }
}

async fn resize_pty(ctd: &Containerd, id: &str, exec_id: &str, cols: u32, rows: u32) {
    if cols == 0 || rows == 0 {
        return;
    }
    if let Err(s) = ctd
        .tasks()
        .resize_pty(ctd.request(ResizePtyRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            width: cols,
            height: rows,
        }))
        .await
    {
        tracing::debug!(container = id, exec_id, error = %s.message(), "resize not applied");
    }
}

async fn cleanup(ctd: &Containerd, id: &str, exec_id: &str, dir: &Path) {
    delete_process(ctd, id, exec_id).await;
    let _ = std::fs::remove_dir_all(dir);
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Reads one output FIFO to EOF, forwarding chunks.
fn pump_output(path: &Path, stderr: bool, tx: &mpsc::Sender<ExecEvent>) {
    let Ok(mut file) = File::open(path) else {
        return;
    };
    let mut buf = vec![0u8; READ_SIZE];
    loop {
        match file.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let chunk = buf[..n].to_vec();
                let event = if stderr {
                    ExecEvent::Stderr(chunk)
                } else {
                    ExecEvent::Stdout(chunk)
                };
                // A gone receiver still reads on, so the shim never blocks.
                let _ = tx.blocking_send(event);
            }
        }
    }
}

/// Writes queued stdin until the queue closes; then the FIFO is closed.
fn pump_input(mut file: File, rx: &mut mpsc::Receiver<Vec<u8>>) {
    while let Some(data) = rx.blocking_recv() {
        if file.write_all(&data).is_err() {
            return;
        }
    }
}

/// Unblocks output readers whose writer never came (the exec failed to
/// start): a writer that opens and closes gives them EOF. A non-blocking
/// open for writing succeeds only once the reader waits in open, so it is
/// retried for a while.
async fn release(fifos: &Fifos, readers: &[std::thread::JoinHandle<()>]) {
    for _ in 0..100 {
        if readers.iter().all(std::thread::JoinHandle::is_finished) {
            return;
        }
        for path in std::iter::once(&fifos.stdout).chain(fifos.stderr.as_ref()) {
            poke_reader(path);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

struct Fifos {
    stdin: PathBuf,
    stdout: PathBuf,
    /// None with a terminal: it carries both streams.
    stderr: Option<PathBuf>,
}

impl Fifos {
    fn create(dir: &Path, tty: bool) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let this = Self {
            stdin: dir.join("stdin"),
            stdout: dir.join("stdout"),
            stderr: (!tty).then(|| dir.join("stderr")),
        };
        for path in [&this.stdin, &this.stdout]
            .into_iter()
            .chain(this.stderr.as_ref())
        {
            make_fifo(path)?;
        }
        Ok(this)
    }
}
