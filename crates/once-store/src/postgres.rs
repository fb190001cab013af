//! The PostgreSQL backend: the production and multi-replica store.
//!
//! Writers lock the operation row with `SELECT … FOR UPDATE`; a first claim inserts the row and,
//! if a concurrent claim inserted it first, the unique key refuses the second insert and the
//! claim is retried against the now-existing row. Every timestamp comes from the database's
//! `clock_timestamp()`, so replicas with skewed clocks agree on when a lease ends.

use std::time::Duration;

use once_core::machine::Guard;
use once_core::{BeginCommand, Millis, Operation, OperationId};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

use crate::shared::{
    bind_operation, decode_attempt, decode_operation, shared_backend_methods, OPERATION_COLUMNS,
};
use crate::{Backend, StoreError};

/// Milliseconds since the epoch by the database's clock.
macro_rules! pg_now {
    () => {
        "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
    };
}

#[derive(Debug, Clone)]
pub struct PgBackend {
    pool: PgPool,
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

impl PgBackend {
    /// Connects to `url` and applies pending migrations (serialised across replicas by
    /// PostgreSQL's advisory lock).
    pub async fn connect(url: &str, settings: &PgSettings) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(StoreError::Internal)?;
        let options = options.application_name("onced");
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(settings.acquire_timeout)
            .connect_with(options)
            .await?;
        sqlx::migrate!("../../migrations/postgres")
            .run(&pool)
            .await
            .map_err(|e| StoreError::Internal(e.into()))?;
        Ok(Self { pool })
    }

    /// The pool, for tests that inspect the database directly.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// The advisory lock key of one intent: tenant, tool and fingerprint, hashed to 64 bits.
fn intent_key(cmd: &BeginCommand) -> i64 {
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

impl Backend for PgBackend {
    type Tx = Transaction<'static, Postgres>;

    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn begin_write(&self) -> Result<Self::Tx, StoreError> {
        Ok(self.pool.begin().await?)
    }

    async fn lock(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis), StoreError> {
        let sql = format!(
            "SELECT {} AS now_ms, o.* FROM (SELECT 1) AS one LEFT JOIN LATERAL \
             (SELECT {OPERATION_COLUMNS} FROM operations WHERE tenant = $1 AND operation_id = $2 FOR UPDATE) AS o ON TRUE",
            pg_now!()
        );
        read_with_clock(&sql, tx, tenant, id).await
    }

    async fn read(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis), StoreError> {
        let sql = format!(
            "SELECT {} AS now_ms, o.* FROM (SELECT 1) AS one LEFT JOIN \
             (SELECT {OPERATION_COLUMNS} FROM operations WHERE tenant = $1 AND operation_id = $2) AS o ON TRUE",
            pg_now!()
        );
        let mut conn = self.pool.acquire().await?;
        read_with_clock(&sql, &mut conn, tenant, id).await
    }

    async fn guard(&self, tx: &mut Self::Tx, cmd: &BeginCommand) -> Result<Guard, StoreError> {
        // A Begin declaring a new intent reads nothing of the others, so it needs no lock: were
        // it to run beside one that does not declare it, the outcome is the one where it ran
        // second.
        if cmd.new_intent {
            let token = self.next_token(tx).await?;
            return Ok(Guard::Clear { token });
        }
        // One statement takes the intent's advisory lock, held until the transaction ends, and
        // the token a clear claim uses (a blocked claim leaves it unused: tokens may skip, never
        // repeat). Row locks cannot serialise the guard: the other Begin's row may not exist
        // yet, or not be committed.
        let token: i64 = sqlx::query_scalar(
            "SELECT nextval('fencing_tokens') FROM (SELECT pg_advisory_xact_lock($1)) AS serialised",
        )
        .bind(intent_key(cmd))
        .fetch_one(&mut **tx)
        .await?;
        // A new statement, so a new snapshot: it sees what the intent's previous holder committed.
        let blocking = self.find_blocking(tx, cmd).await?;
        Ok(match blocking {
            Some(blocking) => Guard::Blocked(blocking),
            None => Guard::Clear {
                token: crate::shared::token(token)?,
            },
        })
    }

    async fn next_token(&self, tx: &mut Self::Tx) -> Result<u64, StoreError> {
        // A sequence never hands out a value twice, committed or not.
        let token: i64 = sqlx::query_scalar("SELECT nextval('fencing_tokens')")
            .fetch_one(&mut **tx)
            .await?;
        crate::shared::token(token)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // A standby or a demoted primary answers, but cannot record anything.
        let (in_recovery, read_only): (bool, String) =
            sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
                .fetch_one(&self.pool)
                .await?;
        if in_recovery || read_only == "on" {
            return Err(StoreError::ReadOnly);
        }
        Ok(())
    }

    shared_backend_methods!(Postgres, pg_now!());
}

async fn read_with_clock(
    sql: &str,
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    id: &OperationId,
) -> Result<(Option<Operation>, Millis), StoreError> {
    use sqlx::Row as _;
    let row = sqlx::query(sql)
        .bind(tenant)
        .bind(id.as_str())
        .fetch_one(conn)
        .await?;
    let now: Millis = row.try_get("now_ms")?;
    Ok((decode_operation!(&row), now))
}
