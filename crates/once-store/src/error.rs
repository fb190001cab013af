//! Storage errors, classified so the service can tell a retryable outage from a bug.
//!
//! [`POSTGRES_SQLSTATES`] and [`SQLITE_CODES`] are the one table of what each database error
//! means to a caller. The rule: whatever says "this database cannot serve you right now" — it
//! is unreachable, restarting, refusing connections, read-only (a standby or a demoted primary),
//! out of resources, or asked us to retry a transaction — is [`StoreError::Unavailable`], which
//! the API answers `UNAVAILABLE` (safe to retry; nothing changed) while health says NOT_SERVING.
//! Whatever means our SQL or our data is wrong is [`StoreError::Internal`].

use once_core::Rejection;

/// What went wrong below the domain. Database text stays inside: callers see the variant.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached, refuses us, or is overloaded; the same call may succeed
    /// later.
    #[error("the database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// The database answers but does not accept writes (a standby, or a demoted primary).
    #[error("the database is read-only")]
    ReadOnly,
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
        matches!(self, StoreError::Unavailable(_) | StoreError::ReadOnly)
    }

    /// Whether a connection the pool handed out had been closed by the server or the network: it
    /// ended the session (an administrator, a crash, its idle-session timeout: SQLSTATE 57P01,
    /// 57P02, 57P05; the connection failed or is gone: 08000, 08003, 08006, 08007) or the socket
    /// met its end. Not a connection refused as it was opened. The call
    /// failed before anything on it could commit, or its COMMIT's answer was lost, and either
    /// way it is safe to make again as it was; on a new connection it may well succeed.
    pub fn is_lost_connection(&self) -> bool {
        match self {
            StoreError::Unavailable(sqlx::Error::Io(error)) => matches!(
                error.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            ),
            StoreError::Unavailable(sqlx::Error::Database(db)) => db.code().is_some_and(|code| {
                matches!(
                    &*code,
                    "57P01" | "57P02" | "57P05" | "08000" | "08003" | "08006" | "08007"
                )
            }),
            _ => false,
        }
    }

    /// Whether the database's storage refused the write: a full disk, an I/O error, memory, a
    /// file that cannot be written or opened (not another writer's lock).
    pub fn is_storage_failure(&self) -> bool {
        let StoreError::Unavailable(sqlx::Error::Database(db)) = self else {
            return false;
        };
        db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
            && db
                .code()
                .and_then(|code| code.parse::<i32>().ok())
                .is_some_and(|code| SQLITE_STORAGE.contains(&(code & 0xff)))
    }

    /// The same error for another caller it befell (every write of a batch whose commit
    /// failed): the same variant, so the same answer, with the database's text; a lost
    /// connection is still one, and the pool's own errors stay what they are.
    pub fn again(&self) -> StoreError {
        if self.is_lost_connection() {
            let lost = std::io::Error::new(std::io::ErrorKind::ConnectionReset, self.to_string());
            return StoreError::Unavailable(sqlx::Error::Io(lost));
        }
        let text = |error: &sqlx::Error| match error {
            sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
            sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
            other => sqlx::Error::Protocol(other.to_string()),
        };
        match self {
            StoreError::Unavailable(error) => StoreError::Unavailable(text(error)),
            StoreError::ReadOnly => StoreError::ReadOnly,
            StoreError::NotFound => StoreError::NotFound,
            StoreError::Rejected(rejection) => StoreError::Rejected(rejection.clone()),
            StoreError::Duplicate => StoreError::Duplicate,
            StoreError::Internal(error) => StoreError::Internal(text(error)),
            StoreError::Corrupt(what) => StoreError::Corrupt(what.clone()),
        }
    }
}

/// What a database error means to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// Try again later: `UNAVAILABLE`.
    Unavailable,
    /// A concurrent insert of the same key won: retried inside the ledger.
    Duplicate,
    /// Our SQL, our schema or our data is wrong: `INTERNAL`, logged.
    Internal,
}

/// PostgreSQL SQLSTATEs, by class (two characters) or by code (five); the longest match wins,
/// and anything not listed is [`Meaning::Internal`].
pub const POSTGRES_SQLSTATES: &[(&str, Meaning, &str)] = &[
    ("08", Meaning::Unavailable, "connection exception"),
    (
        "23505",
        Meaning::Duplicate,
        "unique violation: a concurrent first claim",
    ),
    (
        "25006",
        Meaning::Unavailable,
        "read-only transaction: a standby or a demoted primary",
    ),
    (
        "25P03",
        Meaning::Unavailable,
        "idle-in-transaction timeout ended the session",
    ),
    (
        "28",
        Meaning::Unavailable,
        "the server refuses our credentials",
    ),
    (
        "3D000",
        Meaning::Unavailable,
        "the database does not exist (yet, or any more)",
    ),
    (
        "40001",
        Meaning::Unavailable,
        "serialization failure: retry the transaction",
    ),
    (
        "40003",
        Meaning::Unavailable,
        "statement completion unknown: retry, the call is idempotent",
    ),
    (
        "40P01",
        Meaning::Unavailable,
        "deadlock detected: retry the transaction",
    ),
    (
        "53",
        Meaning::Unavailable,
        "insufficient resources: disk full, out of memory, too many connections",
    ),
    (
        "55000",
        Meaning::Unavailable,
        "not in prerequisite state: the database is not accepting connections",
    ),
    ("55006", Meaning::Unavailable, "object in use"),
    ("55P03", Meaning::Unavailable, "lock not available"),
    (
        "57",
        Meaning::Unavailable,
        "operator intervention: shutdown, restart, cancelled statement",
    ),
    (
        "58",
        Meaning::Unavailable,
        "system error: I/O failure on the server",
    ),
    (
        "XX",
        Meaning::Internal,
        "internal error or corruption on the server",
    ),
];

/// SQLite primary result codes (an extended code's low byte); anything not listed is
/// [`Meaning::Internal`].
pub const SQLITE_CODES: &[(i32, Meaning, &str)] = &[
    (
        5,
        Meaning::Unavailable,
        "SQLITE_BUSY: another process holds the write lock",
    ),
    (6, Meaning::Unavailable, "SQLITE_LOCKED"),
    (7, Meaning::Unavailable, "SQLITE_NOMEM"),
    (
        8,
        Meaning::Unavailable,
        "SQLITE_READONLY: the file cannot be written",
    ),
    (10, Meaning::Unavailable, "SQLITE_IOERR"),
    (13, Meaning::Unavailable, "SQLITE_FULL: the disk is full"),
    (14, Meaning::Unavailable, "SQLITE_CANTOPEN"),
    (15, Meaning::Unavailable, "SQLITE_PROTOCOL: a locking race"),
];

/// The SQLite primary codes of a storage that refused: NOMEM, READONLY, IOERR, FULL, CANTOPEN.
const SQLITE_STORAGE: [i32; 5] = [7, 8, 10, 13, 14];

/// The meaning of a PostgreSQL SQLSTATE.
pub fn postgres_meaning(sqlstate: &str) -> Meaning {
    POSTGRES_SQLSTATES
        .iter()
        .filter(|(prefix, _, _)| sqlstate.starts_with(prefix))
        .max_by_key(|(prefix, _, _)| prefix.len())
        .map_or(Meaning::Internal, |(_, meaning, _)| *meaning)
}

/// The meaning of an SQLite result code, primary or extended.
pub fn sqlite_meaning(code: i32) -> Meaning {
    let primary = code & 0xff;
    if code == 2067 || code == 1555 {
        // SQLITE_CONSTRAINT_UNIQUE, SQLITE_CONSTRAINT_PRIMARYKEY
        return Meaning::Duplicate;
    }
    SQLITE_CODES
        .iter()
        .find(|(c, _, _)| *c == primary)
        .map_or(Meaning::Internal, |(_, meaning, _)| *meaning)
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        let meaning = match &error {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => Meaning::Unavailable,
            sqlx::Error::Database(db) if db.is_unique_violation() => Meaning::Duplicate,
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                if db
                    .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                    .is_some()
                {
                    postgres_meaning(&code)
                } else {
                    code.parse().map_or(Meaning::Internal, sqlite_meaning)
                }
            }
            _ => Meaning::Internal,
        };
        match meaning {
            Meaning::Unavailable => StoreError::Unavailable(error),
            Meaning::Duplicate => StoreError::Duplicate,
            Meaning::Internal => StoreError::Internal(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_map_by_code_then_class() {
        for (code, meaning) in [
            ("08006", Meaning::Unavailable),
            ("55000", Meaning::Unavailable),
            ("57P01", Meaning::Unavailable),
            ("57P03", Meaning::Unavailable),
            ("57014", Meaning::Unavailable),
            ("25006", Meaning::Unavailable),
            ("53300", Meaning::Unavailable),
            ("40001", Meaning::Unavailable),
            ("23505", Meaning::Duplicate),
            ("23503", Meaning::Internal),
            ("22021", Meaning::Internal),
            ("42P01", Meaning::Internal),
            ("55001", Meaning::Internal),
            ("XX001", Meaning::Internal),
        ] {
            assert_eq!(postgres_meaning(code), meaning, "{code}");
        }
    }

    #[test]
    fn sqlite_codes_map_by_primary_code() {
        assert_eq!(sqlite_meaning(5), Meaning::Unavailable);
        assert_eq!(sqlite_meaning(517), Meaning::Unavailable, "BUSY_SNAPSHOT");
        assert_eq!(sqlite_meaning(778), Meaning::Unavailable, "IOERR_WRITE");
        assert_eq!(sqlite_meaning(2067), Meaning::Duplicate);
        assert_eq!(sqlite_meaning(1), Meaning::Internal);
        assert_eq!(sqlite_meaning(787), Meaning::Internal, "a foreign key");
    }
}
