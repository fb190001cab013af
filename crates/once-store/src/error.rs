//! Storage errors, classified so the service can tell a retryable outage from a bug.

use once_core::Rejection;

/// What went wrong below the domain. Database text stays inside: callers see the variant.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or is overloaded; the same call may succeed later.
    #[error("the database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// No operation with that id exists for the tenant.
    #[error("no such operation")]
    NotFound,
    /// The domain refused the command; nothing changed, except any anomaly it recorded.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// A concurrent transaction created the same operation first. Retried internally.
    #[error("the operation was created concurrently")]
    Duplicate,
    /// Anything else the database said; a bug or a misconfiguration.
    #[error("database error")]
    Internal(#[source] sqlx::Error),
    /// A stored value the domain cannot read.
    #[error("stored data cannot be read: {0}")]
    Corrupt(String),
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// PostgreSQL SQLSTATE classes and codes that mean "try again later".
fn postgres_retryable(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("53") // insufficient resources
        || code.starts_with("57P") // operator intervention: shutdown, cannot connect now
        || code == "40001" // serialization failure
        || code == "40P01" // deadlock detected
}

/// SQLite result codes (primary and extended) that mean the file is busy or locked.
fn sqlite_retryable(code: &str) -> bool {
    matches!(code, "5" | "6" | "261" | "517" | "262")
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        match &error {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable(error),
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Duplicate,
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                if postgres_retryable(&code) || sqlite_retryable(&code) {
                    StoreError::Unavailable(error)
                } else {
                    StoreError::Internal(error)
                }
            }
            _ => StoreError::Internal(error),
        }
    }
}
