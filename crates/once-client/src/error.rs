//! Why a ledger call failed.

/// Why a ledger call failed. None of these means the effect ran.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No ledger answered: after every retry, or at once when what answered will not change
    /// by trying again (TLS on one side only, something that is not a ledger). Fail closed: the
    /// effect was not performed, and the same call is safe to retry later. It says where and
    /// what was found there.
    #[error("{0}")]
    Unreachable(crate::Unreachable),
    /// The request was malformed.
    #[error("invalid operation: {0}")]
    Invalid(String),
    /// The ledger holds no such operation.
    #[error("no such operation")]
    NotFound,
    /// The ledger refused the call (a lost execution right, a settled operation, ...).
    /// `reason` is the ledger's machine-readable reason (e.g. `EXECUTION_RIGHT_LOST`), when it
    /// gave one.
    #[error("the ledger refused the call: {message} ({reason})")]
    Refused { reason: String, message: String },
}
