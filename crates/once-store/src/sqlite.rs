//! The embedded SQLite backend: a single file, no setup.
//!
//! Several `onced` processes may share one file. The file runs in WAL mode with a busy
//! timeout, and every write transaction starts with `BEGIN IMMEDIATE`, taking SQLite's single
//! write lock before it reads: two writers never both read a state and then both act on it.

use std::str::FromStr;
use std::time::Duration;

use once_core::machine::Guard;
use once_core::{BeginCommand, Millis, Operation, OperationId};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, Transaction};

use crate::shared::{
    bind_operation, decode_attempt, decode_operation, shared_backend_methods, OPERATION_COLUMNS,
};
use crate::{Backend, StoreError};

/// How long a writer waits for another process's write lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often start-up migration is retried when another process migrates the same file.
const MIGRATION_TRIES: u64 = 5;

/// Milliseconds since the epoch by SQLite's clock (the host's).
macro_rules! sqlite_now {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
    };
}

#[derive(Debug, Clone)]
pub struct SqliteBackend {
    pool: SqlitePool,
}

impl SqliteBackend {
    /// Opens (creating if missing) the database at `url` and applies pending migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(StoreError::Internal)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // An acknowledged commit survives power loss, not just a process crash.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_with(options)
            .await?;
        migrate(&pool).await?;
        Ok(Self { pool })
    }

    /// The pool, for tests that inspect the database directly.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

impl Backend for SqliteBackend {
    type Tx = Transaction<'static, Sqlite>;

    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn begin_write(&self) -> Result<Self::Tx, StoreError> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn lock(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis), StoreError> {
        // The transaction already holds the write lock, so a plain read is a locked read.
        read_with_clock(tx, tenant, id).await
    }

    async fn read(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis), StoreError> {
        let mut conn = self.pool.acquire().await?;
        read_with_clock(&mut conn, tenant, id).await
    }

    async fn guard(&self, tx: &mut Self::Tx, cmd: &BeginCommand) -> Result<Guard, StoreError> {
        // The transaction holds SQLite's one write lock: the guard is serialised already.
        if !cmd.new_intent {
            let blocking = self.find_blocking(tx, cmd).await?;
            if let Some(blocking) = blocking {
                return Ok(Guard::Blocked(blocking));
            }
        }
        let token = self.next_token(tx).await?;
        Ok(Guard::Clear { token })
    }

    async fn next_token(&self, tx: &mut Self::Tx) -> Result<u64, StoreError> {
        // The counter row is written under the write lock and rolls back with the transaction
        // that took a token, so a token no committed transaction used may come again, but
        // never one that any committed transaction used.
        let token: i64 = sqlx::query_scalar(
            "UPDATE fencing_tokens SET last = last + 1 WHERE id = 1 RETURNING last",
        )
        .fetch_one(&mut **tx)
        .await?;
        crate::shared::token(token)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    shared_backend_methods!(Sqlite, sqlite_now!());
}

/// Applies pending migrations. SQLite has no lock that spans the migrator's transactions, so
/// when several processes open a new file at once one of them may find a migration applied
/// under it; it then looks again, and finds nothing left to do.
async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    let migrator = sqlx::migrate!("../../migrations/sqlite");
    let mut tries = 0;
    loop {
        match migrator.run(pool).await {
            Ok(()) => return Ok(()),
            Err(error) if tries < MIGRATION_TRIES => {
                tries += 1;
                tracing::debug!(%error, tries, "migration raced another process; trying again");
                tokio::time::sleep(Duration::from_millis(50 * tries)).await;
            }
            Err(error) => return Err(StoreError::Internal(error.into())),
        }
    }
}

async fn read_with_clock(
    conn: &mut sqlx::SqliteConnection,
    tenant: &str,
    id: &OperationId,
) -> Result<(Option<Operation>, Millis), StoreError> {
    use sqlx::Row as _;
    let sql = format!(
        "SELECT {} AS now_ms, o.* FROM (SELECT 1) AS one \
         LEFT JOIN (SELECT {OPERATION_COLUMNS} FROM operations WHERE tenant = $1 AND operation_id = $2) AS o ON 1 = 1",
        sqlite_now!()
    );
    let row = sqlx::query(&sql)
        .bind(tenant)
        .bind(id.as_str())
        .fetch_one(conn)
        .await?;
    let now: Millis = row.try_get("now_ms")?;
    Ok((decode_operation!(&row), now))
}
