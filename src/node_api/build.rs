//! `RunBuild` and `CancelBuild` (dataplane.md BLD-1, BLD-12) on the
//! pipeline of [`crate::image_build`]: the request becomes a [`BuildRequest`],
//! events become `BuildEvent` log frames, and the end is one terminal
//! frame. Failures are in-band; the RPC ends OK (wire.md §3.5).

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::image_build::pipeline::Source;
use crate::image_build::source::GitSource;
use crate::image_build::{BuildError, BuildRequest, Builds, Event, Pipeline};
use crate::proto::cluster::{BuildEvent, CancelBuildRequest, CancelBuildResponse, RunBuildRequest};
use crate::proto::v1::{BuildStatus, LogLine};

use super::Out;

/// A node's builder: the pipeline and the builds in flight.
#[derive(Debug, Clone)]
pub struct Builder {
    pub pipeline: Pipeline,
    pub builds: Arc<Builds>,
}

/// The build a request asks for; `Err` for one that names no build.
pub fn request(r: RunBuildRequest) -> Result<BuildRequest, Status> {
    let build = r.build.unwrap_or_default();
    let id = build.meta.map(|m| m.id).unwrap_or_default();
    let project = build.project_id;
    if id.is_empty() {
        return Err(Status::invalid_argument("RunBuild: build.meta.id is empty"));
    }
    let source = match (r.source_url.is_empty(), r.git) {
        (false, _) => Source::Tarball { url: r.source_url },
        (true, Some(git)) if !git.clone_url.is_empty() => Source::Git(GitSource {
            url: git.clone_url,
            token: git.access_token,
            reference: git.r#ref,
        }),
        _ => {
            return Err(Status::invalid_argument(
                "RunBuild: neither source_url nor git.clone_url is set",
            ));
        }
    };
    let credential = (!r.registry_username.is_empty())
        .then(|| (r.registry_username.clone(), r.registry_password.clone()));
    Ok(BuildRequest {
        load_name: format!("zattera.local/builds/{}:latest", id.to_ascii_lowercase()),
        id,
        project,
        source,
        platforms: build.platforms,
        push_ref: (!r.push_image_ref.is_empty()).then_some(r.push_image_ref),
        build_args: r.build_args.into_iter().collect(),
        build_env: r.build_env.into_iter().collect(),
        registry_credential: credential,
    })
}

fn line(text: String) -> BuildEvent {
    BuildEvent {
        log: Some(LogLine {
            line: text,
            ..LogLine::default()
        }),
        ..BuildEvent::default()
    }
}

/// How often a queued build says it still waits.
const QUEUED_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs the build on a task feeding the stream (128 events, BLD-10).
pub fn run_build(builder: &Builder, req: RunBuildRequest) -> Result<Out<BuildEvent>, Status> {
    let req = request(req)?;
    let (tx, rx) = mpsc::channel::<Result<BuildEvent, Status>>(128);
    let pipeline = builder.pipeline.clone();
    let ticket = builder
        .builds
        .start(&req.id)
        .map_err(|full| Status::resource_exhausted(format!("RunBuild: {full}")))?;
    tokio::spawn(async move {
        let id = req.id.clone();
        // Past max-builds the build waits its turn, saying so now and then
        // (control takes a silent builder for lost after 4 minutes).
        let slot = {
            let waiting = ticket.slot();
            tokio::pin!(waiting);
            if !ticket.runs_at_once() {
                let text = format!(
                    "queued behind {} build(s): this node runs {} at once (max-builds)",
                    ticket.ahead,
                    ticket.max()
                );
                if tx.send(Ok(line(text))).await.is_err() {
                    return;
                }
            }
            let mut every = tokio::time::interval(QUEUED_HEARTBEAT);
            every.tick().await;
            loop {
                tokio::select! {
                    slot = &mut waiting => break slot,
                    _ = every.tick() => {
                        if tx.send(Ok(line("still queued for a build slot".into()))).await.is_err() {
                            return;
                        }
                    }
                }
            }
        };
        let Some(_slot) = slot else {
            tracing::info!(build = %id, "build cancelled while queued");
            let _ = tx
                .send(Ok(BuildEvent {
                    status: BuildStatus::Canceled as i32,
                    error: BuildError::Canceled.to_string(),
                    ..BuildEvent::default()
                }))
                .await;
            return;
        };
        let (events, mut from_pipeline) = mpsc::channel::<Event>(128);
        let build = pipeline.run(req, events, ticket.cancel.clone());
        let forward = {
            let tx = tx.clone();
            async move {
                while let Some(Event::Log { line: text, .. }) = from_pipeline.recv().await {
                    if tx.send(Ok(line(text))).await.is_err() {
                        return;
                    }
                }
            }
        };
        let (result, ()) = tokio::join!(build, forward);
        let terminal = match result {
            Ok(outcome) => {
                tracing::info!(build = %id, digest = %outcome.digest, "build succeeded");
                BuildEvent {
                    status: BuildStatus::Succeeded as i32,
                    image_digest: outcome.digest,
                    platforms: outcome.platforms,
                    ..BuildEvent::default()
                }
            }
            Err(BuildError::Canceled) if ticket.canceled_by_request() => {
                tracing::info!(build = %id, "build cancelled by CancelBuild");
                BuildEvent {
                    status: BuildStatus::Canceled as i32,
                    error: BuildError::Canceled.to_string(),
                    ..BuildEvent::default()
                }
            }
            Err(e) => {
                tracing::warn!(build = %id, error = %e, "build failed");
                BuildEvent {
                    status: BuildStatus::Failed as i32,
                    error: e.to_string(),
                    ..BuildEvent::default()
                }
            }
        };
        let _ = tx.send(Ok(terminal)).await;
        drop(ticket);
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

pub fn cancel_build(builder: &Builder, req: &CancelBuildRequest) -> CancelBuildResponse {
    CancelBuildResponse {
        canceled: builder.builds.cancel(&req.build_id),
    }
}
