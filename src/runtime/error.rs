//! Errors of the containerd runtime layer. Each names the object it was about
//! (socket, image, digest, snapshot) and the cause.

use std::path::PathBuf;

use tonic::Code;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("containerd at {}: {reason}", socket.display())]
    Unavailable { socket: PathBuf, reason: String },

    #[error("{context}: {}", describe_status(status))]
    Grpc {
        context: String,
        status: tonic::Status,
    },

    #[error("image archive {}: {reason}", path.display())]
    Archive { path: PathBuf, reason: String },

    #[error("{0}")]
    Invalid(String),

    /// A pull refused for what the registry or the image is (a bad manifest,
    /// a missing platform, a layer never unpacked).
    #[error("pull {reference}: {reason}")]
    Pull { reference: String, reason: String },
}

impl RuntimeError {
    /// Wraps a containerd call's failure with what was being done.
    pub fn grpc(context: impl Into<String>) -> impl FnOnce(tonic::Status) -> Self {
        let context = context.into();
        move |status| Self::Grpc { context, status }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Grpc { status, .. } if status.code() == Code::NotFound)
    }

    /// containerd could not be reached (down, restarting, its socket gone):
    /// worth asking again, unlike a refusal.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Unavailable { .. } => true,
            Self::Grpc { status, .. } => {
                status.code() == Code::Unavailable || std::error::Error::source(status).is_some()
            }
            _ => false,
        }
    }

    pub fn is_already_exists(&self) -> bool {
        matches!(self, Self::Grpc { status, .. } if status.code() == Code::AlreadyExists)
    }
}

fn describe_status(status: &tonic::Status) -> String {
    // A failed connection surfaces as a status with the transport error as source.
    if let Some(source) = std::error::Error::source(status) {
        let mut innermost = source.to_string();
        let mut next = source.source();
        while let Some(s) = next {
            innermost = s.to_string();
            next = s.source();
        }
        return format!("containerd unavailable ({innermost})");
    }
    match status.code() {
        Code::Unavailable => format!("containerd unavailable ({})", status.message()),
        Code::Unknown | Code::Internal => status.message().to_owned(),
        code => format!("{} ({code:?})", status.message()),
    }
}

/// Treats NotFound as success: removing what is already gone is a no-op.
pub fn ignore_not_found<T>(result: Result<T, tonic::Status>) -> Result<(), tonic::Status> {
    match result {
        Ok(_) => Ok(()),
        Err(s) if s.code() == Code::NotFound => Ok(()),
        Err(s) => Err(s),
    }
}
