//! The one place where the operations' errors become gRPC codes: the node
//! API translates, and the operations themselves (log queries, top, volume
//! files, snapshots, the upgrade) return typed errors that the admin socket
//! shows as text. What stays in the other files is the checking of the
//! wire's own frames (INVALID_ARGUMENT) and of which capabilities a node
//! serves (UNIMPLEMENTED, PERMISSION_DENIED).
//!
//! The rule: the caller's mistake is INVALID_ARGUMENT, a thing that is not
//! there NOT_FOUND, a refusal of this state FAILED_PRECONDITION, a
//! dependency that is down (containerd) UNAVAILABLE, and only the agent's
//! own fault INTERNAL.

use tonic::{Code, Status};

use crate::logs::query::QueryError;
use crate::runtime::RuntimeError;
use crate::runtime::top::TopError;
use crate::snapshot::SnapshotError;
use crate::upgrade::UpgradeError;
use crate::volumes::VolumeError;

pub fn query(e: &QueryError) -> Status {
    let text = e.to_string();
    match e {
        QueryError::Runtime(r) => runtime(r, text),
        QueryError::Internal(_) => Status::internal(text),
    }
}

pub fn top(e: &TopError) -> Status {
    let text = e.to_string();
    match e {
        TopError::NoContainer => Status::invalid_argument(text),
        TopError::NoTask(_) => Status::not_found(text),
        TopError::Runtime { .. } => Status::unavailable(text),
    }
}

pub fn volume(e: &VolumeError) -> Status {
    let text = e.to_string();
    match e {
        VolumeError::BadName(_)
        | VolumeError::BadEnvironment(_)
        | VolumeError::Escapes(_)
        | VolumeError::BadMountPath(_)
        | VolumeError::NameRequired
        | VolumeError::NotADirectory(_)
        | VolumeError::IsADirectory(_)
        | VolumeError::NotARegularFile(_) => Status::invalid_argument(text),
        VolumeError::NoVolume(_) | VolumeError::NotFound(_) => Status::not_found(text),
        VolumeError::PermissionDenied(_) => Status::permission_denied(text),
        VolumeError::InUse { .. } => Status::failed_precondition(text),
        VolumeError::UsersUnknown(_) => Status::unavailable(text),
        VolumeError::Io { .. } | VolumeError::Interrupted(_) => Status::internal(text),
    }
}

pub fn upgrade(e: &UpgradeError) -> Status {
    let text = e.to_string();
    match e {
        UpgradeError::Invalid(_) => Status::invalid_argument(text),
        UpgradeError::NotConfigured | UpgradeError::NotAnAgent { .. } => {
            Status::failed_precondition(text)
        }
        UpgradeError::NotInChannel { .. } => Status::not_found(text),
        UpgradeError::Busy => Status::aborted(text),
        UpgradeError::Download { .. } => Status::unavailable(text),
        UpgradeError::TooLarge { .. } => Status::resource_exhausted(text),
        UpgradeError::DigestMismatch { .. } => Status::data_loss(text),
        UpgradeError::Local(_) => Status::internal(text),
    }
}

/// Snapshot and restore (SNAP-12). Streams end with this code after an
/// error frame, so the map gives a code, not a status. No `_` arm: a new
/// variant must be mapped.
pub fn snapshot(e: &SnapshotError) -> Code {
    match e {
        SnapshotError::NoTarget
        | SnapshotError::Key(_)
        | SnapshotError::BadTarget(_)
        | SnapshotError::BadRequest(_) => Code::InvalidArgument,
        SnapshotError::NoVolume(_) | SnapshotError::NoManifest(_) => Code::NotFound,
        SnapshotError::Busy(_) | SnapshotError::InUse { .. } => Code::FailedPrecondition,
        SnapshotError::HookExec(_) | SnapshotError::HookExit(_) => Code::Aborted,
        SnapshotError::S3 {
            unreachable: true, ..
        } => Code::Unavailable,
        SnapshotError::Open { .. }
        | SnapshotError::Manifest { .. }
        | SnapshotError::HashMismatch { .. } => Code::DataLoss,
        SnapshotError::Runtime(crate::runtime::RuntimeError::Unavailable { .. }) => {
            Code::Unavailable
        }
        SnapshotError::S3 { .. }
        | SnapshotError::Walk { .. }
        | SnapshotError::Sink(_)
        | SnapshotError::Restore(_)
        | SnapshotError::RestoreIo { .. }
        | SnapshotError::Runtime(_)
        | SnapshotError::Internal(_) => Code::Internal,
    }
}

/// containerd's failures: unreachable is UNAVAILABLE (the caller may retry),
/// a refusal keeps its meaning.
fn runtime(e: &RuntimeError, text: String) -> Status {
    if e.is_not_found() {
        Status::not_found(text)
    } else if e.is_unavailable() {
        Status::unavailable(text)
    } else {
        Status::internal(text)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::snapshot::seal::SealError;

    #[test]
    fn each_error_has_its_code() {
        let mut table: Vec<(Status, Code)> = vec![
            (
                query(&QueryError::Internal("task died".into())),
                Code::Internal,
            ),
            (
                query(&QueryError::Runtime(RuntimeError::Grpc {
                    context: "list containers".into(),
                    status: Status::unavailable("restarting"),
                })),
                Code::Unavailable,
            ),
            (
                query(&QueryError::Runtime(RuntimeError::Invalid(
                    "bad label".into(),
                ))),
                Code::Internal,
            ),
            (
                query(&QueryError::Runtime(RuntimeError::Unavailable {
                    socket: "/run/containerd/containerd.sock".into(),
                    reason: "connection refused".into(),
                })),
                Code::Unavailable,
            ),
            (top(&TopError::NoContainer), Code::InvalidArgument),
            (top(&TopError::NoTask("c1".into())), Code::NotFound),
            (
                top(&TopError::Runtime {
                    container: "c1".into(),
                    message: "shim timeout".into(),
                }),
                Code::Unavailable,
            ),
            (
                volume(&VolumeError::BadName("..".into())),
                Code::InvalidArgument,
            ),
            (volume(&VolumeError::NotFound("x".into())), Code::NotFound),
            (
                volume(&VolumeError::IsADirectory("d".into())),
                Code::InvalidArgument,
            ),
            (
                volume(&VolumeError::InUse {
                    volume: "v".into(),
                    containers: vec!["c".into()],
                }),
                Code::FailedPrecondition,
            ),
            (
                volume(&VolumeError::UsersUnknown("containerd down".into())),
                Code::Unavailable,
            ),
            (
                volume(&VolumeError::Io {
                    path: "/v".into(),
                    message: "disk".into(),
                }),
                Code::Internal,
            ),
        ];
        let url = || "https://example.invalid/agent".to_owned();
        table.extend([
            (
                upgrade(&UpgradeError::Invalid("no url".into())),
                Code::InvalidArgument,
            ),
            (
                upgrade(&UpgradeError::NotConfigured),
                Code::FailedPrecondition,
            ),
            (
                upgrade(&UpgradeError::NotInChannel {
                    base: "https://b".into(),
                    version: "v9".into(),
                    asset: "zattera-agent-linux-amd64".into(),
                    why: "HTTP 404".into(),
                    running: "v1".into(),
                }),
                Code::NotFound,
            ),
            (upgrade(&UpgradeError::Busy), Code::Aborted),
            (
                upgrade(&UpgradeError::Download {
                    url: url(),
                    reason: "refused".into(),
                }),
                Code::Unavailable,
            ),
            (
                upgrade(&UpgradeError::TooLarge { url: url() }),
                Code::ResourceExhausted,
            ),
            (
                upgrade(&UpgradeError::DigestMismatch {
                    url: url(),
                    got: "a".into(),
                    want: "b".into(),
                }),
                Code::DataLoss,
            ),
            (
                upgrade(&UpgradeError::NotAnAgent {
                    url: url(),
                    why: "a script".into(),
                }),
                Code::FailedPrecondition,
            ),
            (
                upgrade(&UpgradeError::Local("disk full".into())),
                Code::Internal,
            ),
        ]);
        for (status, code) in table {
            assert_eq!(status.code(), code, "{}", status.message());
        }
        let s = query(&QueryError::Internal("a task died".into()));
        assert_eq!(s.message(), "QueryLogs: a task died");
    }

    #[test]
    fn snapshot_errors_map_to_codes_and_say_what_the_spec_says() {
        let table: Vec<(SnapshotError, Code, &str)> = vec![
            (
                SnapshotError::NoTarget,
                Code::InvalidArgument,
                "no s3 target provided",
            ),
            (
                SnapshotError::Key(SealError::KeyLength(5)),
                Code::InvalidArgument,
                "data key must be 32 bytes, got 5",
            ),
            (
                SnapshotError::NoVolume("data".into()),
                Code::NotFound,
                "volume \"data\" does not exist on this node",
            ),
            (
                SnapshotError::HookExit(3),
                Code::Aborted,
                "pre-hook exited 3",
            ),
            (
                SnapshotError::HookExec("no such container".into()),
                Code::Aborted,
                "pre-hook exec: no such container",
            ),
            (
                SnapshotError::InUse {
                    volume: "v".into(),
                    container: "c".into(),
                },
                Code::FailedPrecondition,
                "running container c",
            ),
            (
                SnapshotError::Busy("v".into()),
                Code::FailedPrecondition,
                "busy",
            ),
            (
                SnapshotError::HashMismatch { hash: "ab".into() },
                Code::DataLoss,
                "does not match",
            ),
            (
                SnapshotError::S3 {
                    op: "PUT",
                    key: "k".into(),
                    message: "refused".into(),
                    unreachable: true,
                },
                Code::Unavailable,
                "s3 PUT k: refused",
            ),
        ];
        for (e, c, text) in table {
            assert_eq!(snapshot(&e), c, "{e}");
            assert!(e.to_string().contains(text), "{e}");
        }
    }
}
