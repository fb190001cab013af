//! The PostgreSQL backend: the production and multi-replica store.
//!
//! Writers lock the operation row with `SELECT … FOR UPDATE`; a first claim inserts the row and,
//! if a concurrent claim inserted it first, the unique key refuses the second insert and the
//! claim is retried against the now-existing row. Every timestamp comes from the database's
//! `clock_timestamp()`, so replicas with skewed clocks agree on when a lease ends.
//!
//! The fresh-id guard of one intent is serialised by a transaction-scoped advisory lock, taken in
//! one statement with the token a clear claim will use. Fencing tokens come from a sequence.
//! `GATE` is the one advisory-lock key of the write gate, which the gate, the frontier query and
//! [`unlocked`] share. The pool's connections are set to READ COMMITTED whatever the database's
//! default, which the guard's fresh snapshot and the version checks rely on. `ping` also checks
//! that the server accepts writes (not in recovery, not read-only), and the pool pings a
//! connection on its way out only when it sat idle for a second or more, or through the moment a
//! call last found a connection closed by the server, so a call's path has no ping on it. The
//! call that found it is made once more ([`crate::Ledger`]), so a restart or a failover fails no
//! call for the dead connections the pool still held.

mod batches;
pub(crate) use batches::{Batches, UnderWay};
mod unlocked;

use std::sync::Arc;
use std::time::Duration;

use once_core::{BeginCommand, Blocking, FencingToken, Millis, Operation, OperationId};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPoolOptions};
use sqlx::{Pool, Postgres, Transaction};

use std::sync::LazyLock;

use crate::rows::{self, BlockingRow, BLOCKING_COLUMNS};
use crate::store::{Call, Losses, Statements};
use crate::Decision;
use crate::{Announcements, Dialect, Store, StoreError, Unlocked};

/// The channel replicas announce committed events on.
const EVENTS_CHANNEL: &str = "once_events";

/// The ledger in a PostgreSQL database.
pub type PgBackend = Store<Postgres>;

/// How long a pooled connection may sit unused before it is pinged on its way out.
const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// Why [`PgBackend::reach`] reached no server.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{cause}")]
pub struct Unreached {
    /// What the connection met, in its own words.
    pub cause: String,
    /// Whether it may pass: nothing listening yet, a server starting or shutting down, no
    /// answer; not a password refused or a database that does not exist.
    pub passes: bool,
}

/// Pool settings for [`PgBackend::connect`].
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub max_connections: u32,
    /// How long a request waits for a connection before answering UNAVAILABLE.
    pub acquire_timeout: Duration,
}

impl Default for PgSettings {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(3),
        }
    }
}

/// The advisory lock every write transaction holds while it may write events, the write gate
/// watchers read the frontier by ([`crate::watch`]): (class, object) in the two-key form, so it
/// never meets an intent lock (`once_blocking`, one key).
const GATE: (i32, i32) = (1330529093, 1);

/// Serialises raises of the token counter (continuity) until the transaction ends: the write
/// gate's class, object 2.
const RAISING: &str = "SELECT pg_advisory_xact_lock(1330529093, 2)";
const _: () = assert!(GATE.0 == 1330529093, "RAISING names the write gate's class");

/// The fresh-id guard, in the function that serialises it: `$1` the intent's lock key, then the
/// tenant, tool, fingerprint and the operation id asking.
static FIND_BLOCKING: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {BLOCKING_COLUMNS} FROM once_blocking($1, $2, $3, $4, $5)"));

/// Takes the write gate, shared, so writers never wait for one another on it.
static WRITE_GATE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT pg_advisory_xact_lock_shared({}, {})",
        GATE.0, GATE.1
    )
});

/// The newest event, and the transactions holding the write gate (which may still commit
/// older ones): a two-key advisory lock shows its keys as `classid` and `objid`, `objsubid` 2.
static FRONTIER: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT (SELECT COALESCE(MAX(sequence), 0) FROM events) AS newest, \
         COALESCE(string_agg(virtualtransaction, ','), '') AS writing FROM pg_locks \
         WHERE locktype = 'advisory' AND classid = {} AND objid = {} AND objsubid = 2 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        GATE.0, GATE.1
    )
});

impl Dialect for Postgres {
    const KIND: &'static str = "postgres";

    /// The database's clock, which every replica shares.
    const NOW: &'static str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

    const ROW_LOCK: &'static str = " FOR UPDATE";

    /// A sequence never hands out a value twice, committed or not.
    const NEXT_TOKEN: &'static str = "SELECT nextval('fencing_tokens')";

    /// The same sequence: what it hands out is never handed out again, whatever commits.
    const ISSUED_THROUGH: &'static str = "SELECT last_value FROM fencing_tokens";

    // Other sessions take tokens from the sequence meanwhile, which `setval` does not wait for:
    // it sets the sequence a whole start's worth (2^20) above the token seen, so that no token
    // taken between the check and the set can still be reached again. Raises are serialised
    // (`RAISING`): one that read the counter before another's set would set it back.
    const RAISE_TOKENS: &'static str =
        "SELECT setval('fencing_tokens', $1 + 1048576) FROM fencing_tokens WHERE last_value < $1";

    const RAISING: Option<&'static str> = Some(RAISING);

    const FRESH_TOKEN: Option<&'static str> = Some("nextval('fencing_tokens')");

    fn write_gate() -> &'static str {
        &WRITE_GATE
    }

    /// Writers run side by side, each in its own transaction, locking only what they write.
    const GROUP_COMMIT: bool = false;

    /// A prepared statement holds one statement.
    const STATEMENT_LISTS: bool = false;

    fn one_of(subquery: &str) -> String {
        // `IN (subquery)` is a join, which the planner may make a scan of the whole table.
        format!("= ANY(ARRAY({subquery}))")
    }

    fn frontier() -> &'static str {
        &FRONTIER
    }

    fn json_text(column: &str, field: &str) -> String {
        format!("({column}::json ->> '{field}')")
    }

    fn json_integer(column: &str, field: &str) -> String {
        format!("({column}::json ->> '{field}')::bigint")
    }

    fn statements() -> &'static Statements {
        static STATEMENTS: LazyLock<Statements> = LazyLock::new(|| {
            Statements::new(
                Postgres::NOW,
                Postgres::ROW_LOCK,
                Postgres::write_gate(),
                Postgres::FRESH_TOKEN,
            )
        });
        &STATEMENTS
    }

    async fn begin_write(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, StoreError> {
        Ok(pool.begin().await?)
    }

    async fn blocking(
        tx: &mut PgConnection,
        cmd: &BeginCommand,
    ) -> Result<Option<Blocking>, StoreError> {
        // `once_blocking` (migration 0006) takes the intent's advisory lock, held until the
        // transaction ends, then looks with a snapshot taken after the lock was granted: row
        // locks cannot serialise the guard, as the other Begin's row may not exist yet, or not
        // be committed. The one-statement claim (`unlocked`) runs the same function.
        let query = sqlx::query_as(&FIND_BLOCKING).bind(intent_key(cmd));
        let row: Option<BlockingRow> = rows::bind_intent(query, cmd).fetch_optional(tx).await?;
        row.map(Blocking::try_from).transpose()
    }

    /// The guard runs in `once_blocking`: `plans::guard_function_reads_an_index` reads its plan.
    #[cfg(test)]
    fn guard_statement() -> Option<String> {
        None
    }

    const UNLOCKED_WRITES: bool = true;

    /// Written alone on the call's connection (or one from the pool), or with other callers'
    /// decisions by a lane ([`batches`]).
    async fn apply_unlocked(
        store: &Store<Postgres>,
        call: Call<Postgres>,
        decision: Decision<'_>,
    ) -> Result<Option<Unlocked>, StoreError> {
        match unlocked::Item::of(decision) {
            Some(item) => batches::Batches::write(store, call.pooled, item)
                .await
                .map(Some),
            None => Ok(None),
        }
    }

    async fn read_with_others(
        store: &Store<Postgres>,
        tenant: &str,
        id: &OperationId,
        claim: bool,
    ) -> Result<(Option<Operation>, Millis, Option<FencingToken>), StoreError> {
        let read = batches::Read {
            tenant: tenant.to_owned(),
            id: id.clone(),
            claim,
        };
        batches::Batches::read(store, read).await
    }

    async fn announce_events(pool: &Pool<Self>) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(EVENTS_CHANNEL)
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn listen_for_events(pool: &Pool<Self>) -> Result<Option<Announcements>, StoreError> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(EVENTS_CHANNEL).await?;
        Ok(Some(Announcements { listener }))
    }

    fn rows_affected(result: &sqlx::postgres::PgQueryResult) -> u64 {
        result.rows_affected()
    }

    /// PostgreSQL reports its own disk: a write it cannot make fails with the server's error,
    /// and the connection stays usable, so [`crate::Probe::Room`] asks nothing more.
    async fn ping(pool: &Pool<Self>, _probe: crate::Probe) -> Result<(), StoreError> {
        // A standby or a demoted primary answers, but cannot record anything.
        let (in_recovery, read_only): (bool, String) =
            sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
                .fetch_one(pool)
                .await?;
        if in_recovery || read_only == "on" {
            return Err(StoreError::ReadOnly);
        }
        Ok(())
    }
}

impl Store<Postgres> {
    /// Opens one connection to the server `url` names, outside any pool, and closes it: at
    /// start, what a pool's timeout would hide (nothing listening, a name that does not
    /// resolve, a password refused, no such database), in the words of its cause.
    pub async fn reach(url: &str, within: Duration) -> Result<(), Unreached> {
        let options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| Unreached {
            cause: e.to_string(),
            passes: false,
        })?;
        let options = options.application_name("onced");
        match tokio::time::timeout(within, sqlx::Connection::connect_with(&options)).await {
            Ok(Ok(connection)) => {
                let connection: PgConnection = connection;
                let _ = sqlx::Connection::close(connection).await;
                Ok(())
            }
            Ok(Err(error)) => {
                let cause = match &error {
                    sqlx::Error::Io(io) => io.to_string(),
                    sqlx::Error::Database(db) => db.message().to_owned(),
                    other => other.to_string(),
                };
                let passes = StoreError::from(error).is_retryable();
                Err(Unreached { cause, passes })
            }
            Err(_) => Err(Unreached {
                cause: format!("no answer within {within:?}"),
                passes: true,
            }),
        }
    }

    /// Connects to `url` and applies pending migrations (serialised across replicas by
    /// PostgreSQL's advisory lock).
    pub async fn connect(url: &str, settings: &PgSettings) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(StoreError::Internal)?;
        let options = options.application_name("onced");
        // A connection handed out again within a second of its last use is not pinged first:
        // that would be a round trip on every call's path, and sqlx pinged it as it came back
        // (closing one that did not answer). One idle for longer, which a restarted server may
        // have dropped meanwhile, is pinged, and replaced if it does not answer; so is one that
        // was idle when a call last found a connection closed by the server.
        let losses = Arc::new(Losses::default());
        let seen = losses.clone();
        let pool = PgPoolOptions::new()
            .test_before_acquire(false)
            .before_acquire(move |connection, used| {
                let suspect =
                    used.idle_for >= IDLE_BEFORE_PING || seen.idle_through_one(used.idle_for);
                Box::pin(async move {
                    if suspect {
                        sqlx::Connection::ping(connection).await?;
                    }
                    Ok(true)
                })
            })
            // The fresh-id guard and the version-checked writes rely on READ COMMITTED: each
            // statement sees what committed before it began, and an update re-reads a row
            // another writer changed meanwhile. A database or role defaulting to more is
            // overridden, by a statement rather than a startup option, which poolers in front
            // of PostgreSQL may refuse.
            .after_connect(|connection, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(
                        &mut *connection,
                        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
                    )
                    .await?;
                    Ok(())
                })
            })
            .max_connections(settings.max_connections)
            .acquire_timeout(settings.acquire_timeout)
            .connect_with(options)
            .await?;
        sqlx::migrate!("../../migrations/postgres")
            .run(&pool)
            .await
            .map_err(|e| StoreError::Internal(e.into()))?;
        Ok(Self {
            pool,
            losses,
            batches: Default::default(),
        })
    }
}

/// The advisory lock key of one intent: tenant, tool and fingerprint, hashed to 64 bits.
pub(crate) fn intent_key(cmd: &BeginCommand) -> i64 {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for part in [
        cmd.tenant.as_bytes(),
        cmd.tool.as_bytes(),
        &cmd.fingerprint.0,
    ] {
        hasher.update((part.len() as u32).to_be_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    let mut key = [0; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}
