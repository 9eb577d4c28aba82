//! `Exec`: an interactive process in a container, for `zattera exec`.
//!
//! The first frame carries `start` (and maybe early stdin); later frames
//! carry stdin and terminal resizes. When the caller half-closes, stdin is
//! closed and the process may finish (the safer reading of wire.md; the
//! reference kills it); on a terminal, where that would hang the terminal
//! up, stdin stays open and the process ends by itself or with the caller. When the caller goes away, the process is killed.
//! Output frames follow the process; the last frame has `exited` and the
//! code. A runtime failure after a valid start (no such container, a
//! stopped task, an exec containerd refused) is reported in the last frame,
//! on stderr, with code -1, and the call still ends OK (EX-5).

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::proto::cluster::{AgentExecInput, AgentExecOutput};
use crate::runtime::exec_session::{self, ExecEvent, SessionRequest};

use super::{NodeContext, Out};

/// The code of a process that could not be started (EX-5: -1, as the
/// reference sends; never a code a process could exit with).
const NOT_STARTED: i32 = -1;

pub async fn exec(
    node: &NodeContext,
    mut inbound: Streaming<AgentExecInput>,
) -> Result<Out<AgentExecOutput>, Status> {
    let first = inbound
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("Exec: the stream ended before start"))?;
    let start = first
        .start
        .ok_or_else(|| Status::invalid_argument("Exec: the first frame has no start"))?;
    if start.container_id.is_empty() {
        return Err(Status::invalid_argument(
            "Exec: start.container_id is empty",
        ));
    }
    let req = SessionRequest {
        args: if start.command.is_empty() {
            vec!["/bin/sh".to_owned()]
        } else {
            start.command
        },
        tty: start.tty,
        size: start.initial_size.map(|s| (s.cols, s.rows)),
    };
    let (tx, rx) = mpsc::channel::<Result<AgentExecOutput, Status>>(16);
    let fifo_dir = node.run_dir.join("exec");
    match exec_session::start(&node.ctd, &start.container_id, &fifo_dir, &req).await {
        Err(e) => {
            let _ = tx
                .send(Ok(AgentExecOutput {
                    stderr: format!("{e}\n").into_bytes(),
                    exited: true,
                    exit_code: NOT_STARTED,
                    ..AgentExecOutput::default()
                }))
                .await;
        }
        Ok((mut session, mut events)) => {
            let tty = req.tty;
            let mut stdin = session.take_stdin();
            if let Some(tx) = &stdin
                && !first.stdin.is_empty()
            {
                let _ = tx.try_send(first.stdin);
            }
            tokio::spawn(async move {
                let mut input_open = true;
                // A frame is read only once its stdin has room: a slow
                // reader slows the caller (HTTP/2 flow control) while
                // output keeps flowing.
                let mut room: Option<tokio::sync::mpsc::OwnedPermit<Vec<u8>>> = None;
                loop {
                    tokio::select! {
                        permit = reserve(stdin.as_ref()), if input_open && room.is_none() => match permit {
                            Some(p) => room = Some(p),
                            // The process closed its stdin: nothing more to send.
                            None => input_open = false,
                        },
                        frame = inbound.message(), if input_open && room.is_some() => match frame {
                            Ok(Some(f)) => {
                                // The resize first, and done: the stdin of
                                // the same frame may make the process read
                                // its terminal's size at once.
                                if let Some(size) = f.resize {
                                    session.resize(size.cols, size.rows).await;
                                }
                                if !f.stdin.is_empty()
                                    && let Some(p) = room.take()
                                {
                                    p.send(f.stdin);
                                }
                            }
                            Ok(None) => {
                                input_open = false;
                                room = None;
                                // Closing a terminal's input hangs it up (the
                                // shim closes the console: SIGHUP, code 129,
                                // maybe before the output is out). On a
                                // terminal the caller ends input with ^D.
                                if !tty {
                                    stdin = None;
                                    session.close_stdin().await;
                                }
                            }
                            // The caller is gone: dropping the session kills.
                            Err(_) => return,
                        },
                        event = events.recv() => {
                            let (frame, last) = match event {
                                Some(ExecEvent::Stdout(b)) => (AgentExecOutput { stdout: b, ..AgentExecOutput::default() }, false),
                                Some(ExecEvent::Stderr(b)) => (AgentExecOutput { stderr: b, ..AgentExecOutput::default() }, false),
                                Some(ExecEvent::Exited(code)) => (AgentExecOutput {
                                    exited: true,
                                    exit_code: i32::try_from(code).unwrap_or(i32::MAX),
                                    ..AgentExecOutput::default()
                                }, true),
                                None => return,
                            };
                            if tx.send(Ok(frame)).await.is_err() || last {
                                return;
                            }
                        }
                    }
                }
            });
        }
    }
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Room for one more stdin chunk; `None` once the queue is closed.
async fn reserve(
    stdin: Option<&tokio::sync::mpsc::Sender<Vec<u8>>>,
) -> Option<tokio::sync::mpsc::OwnedPermit<Vec<u8>>> {
    stdin?.clone().reserve_owned().await.ok()
}
