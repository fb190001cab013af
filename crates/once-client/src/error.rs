//! Why a ledger call failed.

/// Why a ledger call failed. None of these means the effect ran.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The ledger could not be reached after every retry. Fail closed: the effect was not
    /// performed, and the same call is safe to retry later.
    #[error("the ledger is unreachable: {0}")]
    Unreachable(String),
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
