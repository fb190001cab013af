//! The `sql` kind: the truth of an effect that is a write to the executor's own database (a
//! booking, a ticket, a plan change), read from a *marker* row the executor writes in the same
//! transaction as the effect.
//!
//! The marker table, one row per provider key (one per life of an operation):
//!
//! ```sql
//! CREATE TABLE once_effects (
//!     provider_key  TEXT    PRIMARY KEY,
//!     operation_id  TEXT    NOT NULL,
//!     fencing_token BIGINT  NOT NULL,
//!     state         TEXT    NOT NULL,   -- 'done', or 'absent' (a lookup's fence)
//!     result        BYTEA,              -- BLOB on SQLite
//!     provider_ref  TEXT,               -- what the effect made (a booking id)
//!     at            BIGINT  NOT NULL
//! );
//! ```
//!
//! The executor's transaction writes the effect and, before it commits, the marker `done` with
//! its fencing token ([`MARK_DONE`]): an upsert that takes the key only if no row is there, or
//! if the row there is a fence of an earlier token. If it wrote no row, the transaction must
//! roll back: the effect is not this attempt's to make.
//!
//! A lookup writes, in its own transaction, a fence: the row `absent` with the latest attempt's
//! token, unless a row is there ([`FENCE`]); then it reads the row. On PostgreSQL the upsert waits
//! for a transaction that wrote the key and has not ended (up to `lock_timeout`, then the lookup
//! cannot tell); on SQLite the lookup takes the write lock first (`BEGIN IMMEDIATE`), which waits
//! for any writing transaction to end. So when a lookup reads:
//!
//! - `done`: the effect's transaction committed. CONFIRMED, with the result it stored.
//! - `absent`: no transaction that wrote the marker committed, none is open (the fence waited
//!   for it), and none of this attempt or an earlier one can commit one any more (its upsert finds
//!   the fence and writes nothing, so it rolls back). The miss is authoritative: ABSENT.
//!
//! An attempt granted after that (a later token) takes the key over the fence.

use std::time::Duration;

use async_trait::async_trait;
use once_core::reconcile::{Capabilities, Verdict};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::{ConnectOptions as _, Row as _};

use crate::{LookupRequest, Reconciler};

pub use once_core::local::{create_table, table_name, FENCE, MARK_DONE};

#[derive(Debug, Clone)]
enum Pool {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// Where the executor's database is, until the first lookup connects to it.
#[derive(Clone)]
enum Target {
    Postgres(PgConnectOptions),
    Sqlite(SqliteConnectOptions),
}

/// Looks effects up in the executor's own database by their marker.
pub struct SqlReconciler {
    target: Target,
    pool: std::sync::OnceLock<Pool>,
    fence: String,
    read: String,
    /// How long a lookup waits for a transaction that may write the marker.
    wait: Duration,
}

impl std::fmt::Debug for SqlReconciler {
    // Never the password: where the database is, and who connects.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let database = match &self.target {
            Target::Postgres(options) => format!(
                "postgres://{}@{}:{}/{}",
                options.get_username(),
                options.get_host(),
                options.get_port(),
                options.get_database().unwrap_or_default()
            ),
            Target::Sqlite(options) => {
                format!("sqlite:{}", options.get_filename().display())
            }
        };
        f.debug_struct("SqlReconciler")
            .field("database", &database)
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

impl SqlReconciler {
    /// A reconciler reading `table` in the database at `url` (`postgres://…` or `sqlite:…`),
    /// with `password` when the URL's user needs one. Connects on its first lookup.
    pub fn new(
        url: &str,
        password: Option<String>,
        table: &str,
        wait: Duration,
    ) -> Result<Self, String> {
        let table = table_name(table)?;
        if wait < Duration::from_millis(2) {
            return Err("the sql kind's timeout must be at least 2ms".into());
        }
        // The database's own waits end before the lookup's timeout does, so a lookup that
        // waited too long for an open transaction ends in a statement error, not a cancel.
        let wait = wait / 2;
        let target = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let mut options: PgConnectOptions = url
                .parse()
                .map_err(|e| format!("not a PostgreSQL URL: {e}"))?;
            // The one configured, or an empty one: never onced's own from PGPASSWORD or
            // ~/.pgpass, which are for the ledger's database, not the executor's.
            options = options.password(password.as_deref().unwrap_or_default());
            Target::Postgres(options.log_statements(tracing::log::LevelFilter::Trace))
        } else if url.starts_with("sqlite:") {
            let options: SqliteConnectOptions =
                url.parse().map_err(|e| format!("not a SQLite URL: {e}"))?;
            Target::Sqlite(
                options
                    .busy_timeout(wait)
                    .log_statements(tracing::log::LevelFilter::Trace),
            )
        } else {
            return Err("the sql kind's endpoint is a postgres:// or sqlite: URL".into());
        };
        Ok(Self {
            target,
            pool: std::sync::OnceLock::new(),
            fence: FENCE.replace("{table}", &table),
            read: format!(
                "SELECT state, result, provider_ref, operation_id FROM {table} WHERE provider_key = $1"
            ),
            wait,
        })
    }

    /// The pool, made on the first lookup (it needs the runtime, which reading the
    /// configuration may not have); it connects as lookups need connections.
    fn pool(&self) -> &Pool {
        self.pool.get_or_init(|| match &self.target {
            Target::Postgres(options) => Pool::Postgres(
                PgPoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(self.wait)
                    .connect_lazy_with(options.clone()),
            ),
            Target::Sqlite(options) => Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(self.wait)
                    .connect_lazy_with(options.clone()),
            ),
        })
    }

    async fn look(&self, request: &LookupRequest) -> Result<Marker, sqlx::Error> {
        let token = i64::try_from(request.fencing_token).unwrap_or(i64::MAX);
        let now = now_ms();
        // The fence, then the row, in the transaction `$tx` (one sqlx began, so a lookup given
        // up on is rolled back); the same statements on either database.
        macro_rules! fence_and_read {
            ($tx:expr) => {{
                let mut tx = $tx;
                sqlx::query(&self.fence)
                    .bind(&request.provider_key)
                    .bind(&request.operation_id)
                    .bind(token)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                let row = sqlx::query(&self.read)
                    .bind(&request.provider_key)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                (
                    row.try_get(0)?,
                    row.try_get(1)?,
                    row.try_get(2)?,
                    row.try_get(3)?,
                )
            }};
        }
        let row = match self.pool() {
            Pool::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let wait = format!("SET LOCAL lock_timeout = '{}ms'", self.wait.as_millis());
                sqlx::query(&wait).execute(&mut *tx).await?;
                fence_and_read!(tx)
            }
            // The write lock first: it waits for a transaction writing the marker to end.
            Pool::Sqlite(pool) => fence_and_read!(pool.begin_with("BEGIN IMMEDIATE").await?),
        };
        Ok(row)
    }
}

/// A marker as a lookup reads it: its state, result, provider reference and operation.
type Marker = (String, Option<Vec<u8>>, Option<String>, String);

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}

#[async_trait]
impl Reconciler for SqlReconciler {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // The fence makes a miss final: no attempt up to the one looked up can commit its
            // marker after it.
            miss_is_authoritative: true,
            settle_time_ms: 0,
            dedupes_by_provider_key: true,
        }
    }

    async fn lookup(&self, request: &LookupRequest) -> Verdict {
        match self.look(request).await {
            // A marker of another operation under this key is no proof of this one.
            Ok((_, _, _, operation_id)) if operation_id != request.operation_id => {
                Verdict::Unknown {
                    why: format!(
                        "the marker of {} names operation {operation_id}, not {}",
                        request.provider_key, request.operation_id
                    ),
                }
            }
            Ok((state, result, provider_ref, _)) if state == "done" => Verdict::Confirmed {
                provider_ref: provider_ref.unwrap_or_else(|| request.provider_key.clone()),
                result: result.unwrap_or_default(),
                evidence: serde_json::json!({
                    "marker": "done",
                    "provider_key": request.provider_key,
                })
                .to_string(),
            },
            // No transaction wrote the marker and none can any more: the lookup fenced every
            // attempt up to the one looked up.
            Ok((state, _, _, _)) if state == "absent" => Verdict::Absent {
                evidence: serde_json::json!({
                    "marker": "absent",
                    "provider_key": request.provider_key,
                    "fenced_through_token": request.fencing_token,
                })
                .to_string(),
            },
            Ok((state, _, _, _)) => Verdict::Unknown {
                why: format!("the marker's state is {state:?}, neither done nor absent"),
            },
            // A transaction that may write the marker is still open (lock or busy timeout), or
            // the database could not be asked: it cannot tell.
            Err(error) => Verdict::Unknown {
                why: format!("the executor's database could not tell: {error}"),
            },
        }
    }
}
