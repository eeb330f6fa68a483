//! What can go wrong between crab and a registry. Every variant names the reference (or file)
//! it is about; [`RemoteError::is_transient`] says which ones a retry may cure.

use std::path::PathBuf;
use std::time::Duration;

use oci_client::errors::{OciDistributionError, OciErrorCode};

use crate::digest::Digest;
use crate::pack::PackError;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("{reference}: registry {registry} cannot be reached: {reason}")]
    Unreachable { reference: String, registry: String, reason: String },
    #[error("{reference}: {what} got no answer within {after:?}")]
    Timeout { reference: String, what: String, after: Duration },
    #[error("{reference}: {what}: the registry failed with HTTP {status}: {message}")]
    ServerError { reference: String, what: String, status: u16, message: String },
    #[error("{reference}: {what}: the registry refused it as too large (HTTP 413): is the registry full? {message}")]
    TooLarge { reference: String, what: String, message: String },
    #[error("{reference}: {what}: the registry refused the credentials (HTTP {status}); check {credentials}")]
    Unauthorized { reference: String, what: String, status: u16, credentials: String },
    #[error("{reference}: not in the registry ({what})")]
    NotFound { reference: String, what: String },
    #[error("{reference} is not a crab checkpoint: its artifact type is {found:?}, expected {expected:?}")]
    WrongArtifactType { reference: String, found: String, expected: &'static str },
    #[error("{reference}: {what} is not a crab checkpoint manifest: {reason}")]
    BadManifest { reference: String, what: String, reason: String },
    #[error("{reference}: blob {digest} does not match its digest: the registry sent bytes hashing to {actual}")]
    DigestMismatch { reference: String, digest: Digest, actual: String },
    #[error("{reference}: blob {digest} is larger than its descriptor's {expected} bytes")]
    BlobTooLong { reference: String, digest: Digest, expected: u64 },
    #[error("{reference}: {source}")]
    Pack {
        reference: String,
        #[source]
        source: PackError,
    },
    #[error("{reference}: object {digest} cannot be read from the local store: {reason}")]
    Source { reference: String, digest: Digest, reason: String },
    #[error("{reference}: the local checkpoint store: {reason}")]
    Store { reference: String, reason: String },
    #[error("{reference}: {reason}")]
    InvalidReference { reference: String, reason: String },
    #[error("credentials file {path}: {reason}")]
    Credentials { path: PathBuf, reason: String },
    #[error("CA file {path}: {reason}")]
    Tls { path: PathBuf, reason: String },
    #[error("{reference}: {what}: {message}")]
    Protocol { reference: String, what: String, message: String },
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = RemoteError> = std::result::Result<T, E>;

impl RemoteError {
    /// Worth another try after a pause: the registry is down, slow, overloaded or failing
    /// inside. A refusal (credentials, not found, wrong type, bad bytes, too large) is not:
    /// the same request would get the same answer, so it goes back to the caller at once (a
    /// queue may still try again much later, e.g. once the registry has room).
    pub fn is_transient(&self) -> bool {
        match self {
            RemoteError::Unreachable { .. } | RemoteError::Timeout { .. } => true,
            RemoteError::ServerError { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            _ => false,
        }
    }

    /// The reference the error is about, when it is about one.
    pub fn reference(&self) -> Option<&str> {
        match self {
            RemoteError::Unreachable { reference, .. }
            | RemoteError::Timeout { reference, .. }
            | RemoteError::ServerError { reference, .. }
            | RemoteError::TooLarge { reference, .. }
            | RemoteError::Unauthorized { reference, .. }
            | RemoteError::NotFound { reference, .. }
            | RemoteError::WrongArtifactType { reference, .. }
            | RemoteError::BadManifest { reference, .. }
            | RemoteError::DigestMismatch { reference, .. }
            | RemoteError::BlobTooLong { reference, .. }
            | RemoteError::Pack { reference, .. }
            | RemoteError::Source { reference, .. }
            | RemoteError::InvalidReference { reference, .. }
            | RemoteError::Store { reference, .. }
            | RemoteError::Protocol { reference, .. } => Some(reference),
            RemoteError::Credentials { .. } | RemoteError::Tls { .. } | RemoteError::Io { .. } => None,
        }
    }
}

/// What the caller was doing, to name it in errors.
pub(crate) struct Ctx<'a> {
    pub reference: &'a str,
    pub registry: &'a str,
    pub what: &'a str,
    /// Where the credentials came from, for the message of a refusal.
    pub credentials: &'a str,
}

impl Ctx<'_> {
    fn status(&self, status: u16, message: String) -> RemoteError {
        let (reference, what) = (self.reference.to_owned(), self.what.to_owned());
        match status {
            401 | 403 => {
                RemoteError::Unauthorized { reference, what, status, credentials: self.credentials.to_owned() }
            }
            404 => RemoteError::NotFound { reference, what },
            413 => RemoteError::TooLarge { reference, what, message },
            _ => RemoteError::ServerError { reference, what, status, message },
        }
    }

    pub(crate) fn reqwest(&self, e: &reqwest::Error) -> RemoteError {
        if let Some(status) = e.status() {
            return self.status(status.as_u16(), e.to_string());
        }
        if e.is_timeout() {
            return RemoteError::Timeout {
                reference: self.reference.to_owned(),
                what: self.what.to_owned(),
                after: Duration::ZERO,
            };
        }
        // Connection refused or reset, TLS failures, a body cut short: the registry was not
        // there to answer. The chain of sources carries the cause (a refused certificate says so).
        let mut reason = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            reason.push_str(": ");
            reason.push_str(&s.to_string());
            source = s.source();
        }
        RemoteError::Unreachable { reference: self.reference.to_owned(), registry: self.registry.to_owned(), reason }
    }

    pub(crate) fn oci(&self, e: OciDistributionError) -> RemoteError {
        let (reference, what) = (self.reference.to_owned(), self.what.to_owned());
        match e {
            OciDistributionError::RequestError(e) => self.reqwest(&e),
            OciDistributionError::ServerError { code, message, .. } => self.status(code, message),
            OciDistributionError::UnauthorizedError { .. } => self.status(401, String::new()),
            OciDistributionError::AuthenticationFailure(message) => RemoteError::Unauthorized {
                reference,
                what: format!("{what}: {message}"),
                status: 401,
                credentials: self.credentials.to_owned(),
            },
            OciDistributionError::RegistryError { envelope, .. } => {
                let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
                let message = envelope.to_string();
                if codes.iter().any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied)) {
                    self.status(401, message)
                } else if codes.iter().any(|c| {
                    matches!(
                        c,
                        OciErrorCode::ManifestUnknown
                            | OciErrorCode::NameUnknown
                            | OciErrorCode::BlobUnknown
                            | OciErrorCode::NotFound
                    )
                }) {
                    RemoteError::NotFound { reference, what: format!("{what}: {message}") }
                } else if codes.iter().any(|c| matches!(c, OciErrorCode::Toomanyrequests)) {
                    self.status(429, message)
                } else {
                    RemoteError::Protocol { reference, what, message }
                }
            }
            OciDistributionError::DigestError(e) => {
                RemoteError::DigestMismatch { reference, digest: Digest([0; 32]), actual: e.to_string() }
            }
            other => RemoteError::Protocol { reference, what, message: other.to_string() },
        }
    }
}
