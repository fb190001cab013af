//! The embedded SQLite backend: a single file, no setup.
//!
//! Several `onced` processes may share one file. The file runs in WAL mode with a busy
//! timeout, and every write transaction starts with `BEGIN IMMEDIATE`, taking SQLite's single
//! write lock before it reads: two writers never both read a state and then both act on it.
//!
//! The file is created mode 600 (SQLite gives its WAL and shared-memory files the same mode; an
//! existing file others can read is served with a warning), with `synchronous = FULL`. On a bad
//! disk day (a full disk, an I/O error, no memory) SQLite rolls a transaction back itself and
//! sqlx's connection is left believing it is still inside one; the pool's `after_release` check
//! closes such a connection instead of handing it out again, so the failure is one `UNAVAILABLE`
//! per refused write and service resumes once space is back, with no restart.

use std::str::FromStr;
use std::time::Duration;

use once_core::{BeginCommand, Blocking};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Pool, Sqlite, Transaction, TransactionManager as _};

use std::sync::LazyLock;

use crate::rows::{self, BlockingRow, BLOCKING_COLUMNS};
use crate::store::Statements;
use crate::{Announcements, Dialect, Store, StoreError};

/// The ledger in a SQLite file.
pub type SqliteBackend = Store<Sqlite>;

/// How long a writer waits for another process's write lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often start-up migration is retried when another process migrates the same file.
const MIGRATION_TRIES: u64 = 5;
/// How often opening is retried while another process holds a new file's exclusive lock.
const OPEN_TRIES: u64 = 10;

/// What blocks a claim: an open operation of the same intent (`$1` tenant, `$2` tool, `$3`
/// fingerprint) under another id (`$4`).
const BLOCKS: &str = "tenant = $1 AND tool = $2 AND fingerprint = $3 \
     AND state IN ('UNKNOWN', 'IN_FLIGHT') AND operation_id <> $4";

/// The fresh-id guard: an open operation of the same intent under another id. UNKNOWN ones
/// come first: they block whatever their lease says.
static FIND_BLOCKING: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {BLOCKING_COLUMNS} FROM operations WHERE {BLOCKS} \
         ORDER BY state DESC, created_at LIMIT 1"
    )
});

/// A fresh token, taken only when nothing blocks the intent (bound as [`FIND_BLOCKING`]).
static CLEAR_TOKEN: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} AND NOT EXISTS (SELECT 1 FROM operations WHERE {BLOCKS}) RETURNING last",
        Sqlite::NEXT_TOKEN.trim_end_matches(" RETURNING last")
    )
});

impl Dialect for Sqlite {
    const KIND: &'static str = "sqlite";

    /// The host's clock.
    const NOW: &'static str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

    /// A write transaction holds SQLite's one write lock from its start, so a plain read is a
    /// locked read.
    const ROW_LOCK: &'static str = "";

    /// The counter row is written under the write lock and rolls back with the transaction that
    /// took a token, so a token no committed transaction used may come again, but never one that
    /// any committed transaction used.
    const NEXT_TOKEN: &'static str =
        "UPDATE fencing_tokens SET last = last + 1 WHERE id = 1 RETURNING last";

    /// A token taken outside the write lock could be taken again (see above).
    const ISSUED_THROUGH: &'static str = "SELECT last FROM fencing_tokens WHERE id = 1";

    // One writer at a time: the counter is raised exactly.
    const RAISE_TOKENS: &'static str =
        "UPDATE fencing_tokens SET last = $1 WHERE id = 1 AND last < $1";

    const RAISING: Option<&'static str> = None;

    const FRESH_TOKEN: Option<&'static str> = None;

    /// Writers hold the one write lock from their first statement to their commit, so events
    /// commit in the order of their sequence: no gate is needed.
    fn write_gate() -> &'static str {
        "SELECT 1"
    }

    fn one_of(subquery: &str) -> String {
        format!("IN ({subquery})")
    }

    /// SQLite takes one writer at a time: writes queued for it share one transaction and one
    /// flush to disk.
    const GROUP_COMMIT: bool = true;

    /// The driver runs a query's statements one after another on the connection's thread, each
    /// bound from the query's one list of values by number. (sqlx documents this as a behaviour
    /// of its SQLite driver it may drop; every write of a plan goes through it, so the store's
    /// tests would fail at once.)
    const STATEMENT_LISTS: bool = true;

    /// Under the one write lock the guard needs no lock of its own: the token is taken in the
    /// statement that finds the way clear.
    fn clear_token() -> Option<&'static str> {
        Some(&CLEAR_TOKEN)
    }

    fn frontier() -> &'static str {
        "SELECT COALESCE(MAX(sequence), 0) AS newest, '' AS writing FROM events"
    }

    fn json_text(column: &str, field: &str) -> String {
        format!("json_extract({column}, '$.{field}')")
    }

    fn json_integer(column: &str, field: &str) -> String {
        format!("CAST(json_extract({column}, '$.{field}') AS INTEGER)")
    }

    fn statements() -> &'static Statements {
        static STATEMENTS: LazyLock<Statements> = LazyLock::new(|| {
            Statements::new(
                Sqlite::NOW,
                Sqlite::ROW_LOCK,
                Sqlite::write_gate(),
                Sqlite::FRESH_TOKEN,
            )
        });
        &STATEMENTS
    }

    async fn begin_write(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, StoreError> {
        Ok(pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn blocking(
        tx: &mut SqliteConnection,
        cmd: &BeginCommand,
    ) -> Result<Option<Blocking>, StoreError> {
        // The transaction holds SQLite's one write lock: the guard is serialised already.
        let row: Option<BlockingRow> = rows::bind_intent(sqlx::query_as(&FIND_BLOCKING), cmd)
            .fetch_optional(tx)
            .await?;
        row.map(Blocking::try_from).transpose()
    }

    #[cfg(test)]
    fn guard_statement() -> Option<String> {
        Some(FIND_BLOCKING.clone())
    }

    /// A statement cannot both read and write here (no data-modifying CTEs), and writes
    /// already share one transaction under the one write lock: `apply_unlocked` writes nothing.
    const UNLOCKED_WRITES: bool = false;

    async fn announce_events(_pool: &Pool<Self>) -> Result<(), StoreError> {
        // Other processes on the same file read it again every poll interval.
        Ok(())
    }

    async fn listen_for_events(_pool: &Pool<Self>) -> Result<Option<Announcements>, StoreError> {
        Ok(None)
    }

    fn rows_affected(result: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        result.rows_affected()
    }

    /// A write committed to the file: one that is rolled back never reaches the disk, so it
    /// would prove only that the write lock can be taken, and a full disk or a failing device
    /// would still read as serving. The write leaves every value as it was. A
    /// [`crate::Probe::Room`] then commits a row of that many bytes and deletes it again:
    /// small writes may still fit in space a refused one left behind.
    async fn ping(pool: &Pool<Self>, probe: crate::Probe) -> Result<(), StoreError> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query("UPDATE fencing_tokens SET last = last WHERE id = 1")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        if probe == crate::Probe::Room {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            sqlx::query("INSERT OR REPLACE INTO disk_room (id, room) VALUES (1, zeroblob($1))")
                .bind(crate::Probe::ROOM as i64)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            sqlx::query("DELETE FROM disk_room").execute(pool).await?;
        }
        Ok(())
    }
}

impl Store<Sqlite> {
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
        if creates_a_file(url) {
            private_file(options.get_filename())?;
        }
        let pool = open(&options).await?;
        migrate(&pool).await?;
        Ok(Self {
            pool,
            losses: Default::default(),
            batches: Default::default(),
        })
    }
}

/// Whether opening `url` may create a database file: not an in-memory database, nor one opened
/// read-only or immutable.
fn creates_a_file(url: &str) -> bool {
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let in_memory = path.ends_with(":memory:");
    let read_only = query.split('&').any(|pair| {
        matches!(
            pair,
            "mode=memory" | "mode=ro" | "immutable=1" | "immutable=true"
        )
    });
    !in_memory && !read_only
}

/// Creates the database file readable and writable by its owner only (SQLite gives its WAL and
/// shared-memory files the same mode), or warns when an existing one is readable by others: it
/// holds every stored result.
fn private_file(path: &std::path::Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
    if path.as_os_str().is_empty() {
        return Ok(());
    }
    let cannot = |what: &str, error: std::io::Error| {
        StoreError::Internal(sqlx::Error::Configuration(
            format!("cannot create {what}: {error}").into(),
        ))
    };
    // Missing directories are made, for the owner only, as the file is.
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(|e| cannot(&format!("the directory {}", parent.display()), e))?;
            tracing::info!(directory = %parent.display(), "created the database file's directory");
        }
    }
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    match created {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
            let mode = std::fs::metadata(path)
                .map(|m| m.permissions().mode())
                .unwrap_or(0);
            if mode & 0o077 != 0 {
                tracing::warn!(
                    path = %path.display(),
                    mode = format!("{:o}", mode & 0o777),
                    "the database file is readable by other users; `chmod 600` it (and its -wal and -shm files)"
                );
            }
            Ok(())
        }
        Err(error) => Err(cannot(
            &format!("the database file {}", path.display()),
            error,
        )),
    }
}

/// Opens the pool. A new file that another process is opening at the same moment may be locked
/// for a while (switching it to WAL takes SQLite's exclusive lock, which no busy timeout waits
/// for); opening is then tried again.
async fn open(options: &SqliteConnectOptions) -> Result<SqlitePool, StoreError> {
    let mut tries = 0;
    loop {
        // A connection to a file is not dropped by a server or a network: pinging it before
        // each use would only add a round trip to sqlx's worker thread to every call.
        let opened = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .after_release(|conn, _| Box::pin(still_usable(conn)))
            .max_connections(8)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_with(options.clone())
            .await;
        match opened.map_err(StoreError::from) {
            Ok(pool) => return Ok(pool),
            Err(error) if error.is_retryable() && tries < OPEN_TRIES => {
                tries += 1;
                tracing::debug!(%error, tries, "the database file is locked by another process; trying again");
                tokio::time::sleep(Duration::from_millis(50 * tries)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Whether a connection coming back to the pool may be handed out again. SQLite rolls a
/// transaction back itself when a write fails for want of disk, memory or a working device;
/// the rollback sqlx then runs fails, the connection goes on believing it is inside a
/// transaction, and every `BEGIN` on it would fail until a restart. Such a connection is
/// closed instead, and the pool opens a new one.
async fn still_usable(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    type Transactions = <Sqlite as sqlx::Database>::TransactionManager;
    if Transactions::get_transaction_depth(conn) == 0 {
        return Ok(true);
    }
    // Runs the rollback queued when the transaction was dropped.
    sqlx::Connection::ping(conn).await?;
    Ok(Transactions::get_transaction_depth(conn) == 0)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What SQLite does itself when a write fails for want of disk (the transaction ends under
    /// sqlx, whose rollback then fails), done by hand to more connections than the pool holds:
    /// every write transaction after it still begins.
    #[tokio::test]
    async fn a_connection_whose_transaction_sqlite_ended_is_not_pooled_again() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("ended.db").display());
        let store = SqliteBackend::connect(&url).await.unwrap();
        for round in 0..20 {
            let mut tx = Sqlite::begin_write(store.pool())
                .await
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
            drop(tx);
            tokio::task::yield_now().await;
        }
        Sqlite::ping(store.pool(), crate::Probe::Write)
            .await
            .unwrap();
    }

    #[test]
    fn only_a_writable_file_database_is_created_beforehand() {
        assert!(creates_a_file("sqlite://once.db"));
        assert!(creates_a_file("sqlite:///var/lib/once/ledger.db?mode=rwc"));
        assert!(!creates_a_file("sqlite::memory:"));
        assert!(!creates_a_file("sqlite://once.db?mode=memory"));
        assert!(!creates_a_file("sqlite://once.db?cache=shared&mode=ro"));
        assert!(!creates_a_file("sqlite://once.db?immutable=1"));
    }
}
