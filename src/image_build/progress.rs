//! Build output as log lines (BLD-10) and the heartbeat that keeps control
//! from calling a silent build lost (BLD-13).

use std::time::Duration;

use tokio::sync::mpsc;

use super::Event;

/// One vertex of a BuildKit status update, as far as lines go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vertex {
    pub name: String,
    pub cached: bool,
    pub completed: bool,
}

/// One BuildKit status update: its vertices and the data of its logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SolveStatus {
    pub vertexes: Vec<Vertex>,
    pub logs: Vec<Vec<u8>>,
}

/// The lines of one update: each named vertex that is cached (`CACHED
/// <name>`) or completed (`<name>`), then each log's lines. Per-layer
/// statuses and warnings have no lines.
pub fn status_lines(status: &SolveStatus) -> Vec<String> {
    let mut lines = Vec::new();
    for v in status.vertexes.iter().filter(|v| !v.name.is_empty()) {
        if v.cached {
            lines.push(format!("CACHED {}", v.name));
        } else if v.completed {
            lines.push(v.name.clone());
        }
    }
    for data in &status.logs {
        let text = String::from_utf8_lossy(data);
        let text = text.trim_end_matches('\n');
        if !text.is_empty() {
            lines.extend(text.split('\n').map(str::to_owned));
        }
    }
    lines
}

/// buildah's own output, minus what corresponds to BuildKit's per-layer
/// statuses (copy progress of blobs and signatures).
pub fn buildah_line(line: &str) -> Option<&str> {
    const NOISE: [&str; 6] = [
        "Getting image source signatures",
        "Copying blob ",
        "Copying config ",
        "Writing manifest to image destination",
        "Storing signatures",
        "Trying to pull ",
    ];
    let line = line.trim_end_matches(['\n', '\r']);
    (!line.is_empty() && !NOISE.iter().any(|n| line.starts_with(n))).then_some(line)
}

/// Silence after which a heartbeat line is sent (BLD-13: control gives up
/// after 4 min without an event).
pub const HEARTBEAT_AFTER: Duration = Duration::from_secs(60);

/// Forwards `from` to `to`, adding "still building… (<elapsed>)" after
/// each `every` of silence. Ends when `from` closes or `to` does.
pub async fn relay_with_heartbeat(
    mut from: mpsc::Receiver<Event>,
    to: mpsc::Sender<Event>,
    every: Duration,
) {
    let started = tokio::time::Instant::now();
    loop {
        match tokio::time::timeout(every, from.recv()).await {
            Ok(Some(event)) => {
                if to.send(event).await.is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(_) => {
                let elapsed = Duration::from_secs(started.elapsed().as_secs());
                let line = format!("still building… ({})", humantime::format_duration(elapsed));
                if to
                    .send(Event::log(super::Phase::Build, line))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
    use super::*;

    /// dataplane.md §13, verbatim.
    #[test]
    fn the_reference_status_mapping() {
        let status = SolveStatus {
            vertexes: vec![
                Vertex {
                    name: "[1/2] FROM alpine".into(),
                    completed: true,
                    ..Vertex::default()
                },
                Vertex {
                    name: "[2/2] RUN build".into(),
                    cached: true,
                    ..Vertex::default()
                },
                Vertex {
                    completed: true,
                    ..Vertex::default()
                },
            ],
            logs: vec![b"compiling...\nlinking...\n".to_vec(), Vec::new()],
        };
        assert_eq!(
            status_lines(&status),
            [
                "[1/2] FROM alpine",
                "CACHED [2/2] RUN build",
                "compiling...",
                "linking..."
            ]
        );
    }

    #[test]
    fn a_started_vertex_has_no_line_until_it_completes() {
        let mut v = Vertex {
            name: "[1/1] RUN make".into(),
            ..Vertex::default()
        };
        let started = SolveStatus {
            vertexes: vec![v.clone()],
            logs: vec![],
        };
        assert!(status_lines(&started).is_empty());
        v.completed = true;
        let done = SolveStatus {
            vertexes: vec![v],
            logs: vec![],
        };
        assert_eq!(status_lines(&done), ["[1/1] RUN make"]);
    }

    #[test]
    fn buildah_copy_noise_is_dropped() {
        assert_eq!(buildah_line("STEP 1/2: FROM x\n"), Some("STEP 1/2: FROM x"));
        assert_eq!(buildah_line("Copying blob sha256:abc"), None);
        assert_eq!(buildah_line(""), None);
    }

    #[tokio::test]
    async fn silence_brings_heartbeats_and_events_pass_through() {
        let (in_tx, in_rx) = mpsc::channel(8);
        let (out_tx, mut out_rx) = mpsc::channel(8);
        let relay = tokio::spawn(relay_with_heartbeat(
            in_rx,
            out_tx,
            Duration::from_millis(200),
        ));
        in_tx
            .send(Event::log(crate::image_build::Phase::Build, "step".into()))
            .await
            .unwrap();
        assert_eq!(out_rx.recv().await.unwrap().line(), Some("step"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let beat = out_rx.recv().await.unwrap();
        assert!(
            beat.line().unwrap().starts_with("still building… ("),
            "{beat:?}"
        );
        drop(in_tx);
        relay.await.unwrap();
    }
}
