//! The ledger's SQL, written once for every [`Dialect`].

use std::time::{Duration, Instant};

use once_core::access::{Credential, NewCredential, Tenant};
use once_core::forensics::Duplicate;
use once_core::machine::{self, FreshIdGuard, Write};
use once_core::reconcile::Lookup;
use once_core::stats::{Gauges, Stats, UNKNOWN_AGE_THRESHOLDS};
use once_core::{
    Attempt, BeginCommand, Event, EventKind, FencingToken, ListQuery, Listed, Millis, Operation,
    OperationEvent, OperationId, Plan, PriorResolution, Scope, WatchFilter,
};
use sqlx::pool::PoolConnection;
use sqlx::{
    Arguments, ColumnIndex, Database, Decode, Encode, Executor, FromRow, IntoArguments, Pool, Row,
    Transaction, Type,
};

use crate::backend::sealed::Transactions;
use crate::rows::{
    self, AttemptRow, BlockingRow, Clocked, CredentialRow, DuplicateRow, EventRow, KeyRow,
    KnownCredentialRow, ListedRow, OperationRow, TenantRow, WatchedEventRow, CREDENTIAL_COLUMNS,
    DUPLICATE_COLUMNS, EVENT_COLUMNS, INSERT_ATTEMPT, INSERT_EVENT, INSERT_OPERATION,
    LISTED_OPERATION_COLUMNS, OPERATION_COLUMNS, TENANT_COLUMNS, UPDATE_OPERATION,
    WATCHED_EVENT_COLUMNS,
};
use crate::watch::Frontier;
use crate::Announcements;
use crate::{Backend, CredentialChanges, Dialect, StoreError};

/// The ledger's tables in one database, reached through a connection pool. Cheap to clone;
/// every clone shares the pool.
#[derive(Debug)]
pub struct Store<D: Database> {
    pub(crate) pool: Pool<D>,
}

impl<D: Database> Clone for Store<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<D: Database> Store<D> {
    /// The pool, for tests that inspect the database directly.
    #[cfg(test)]
    pub(crate) fn pool(&self) -> &Pool<D> {
        &self.pool
    }
}

/// The store's clock read once for the whole statement. A condition on an indexed column
/// against it is an index range; against the clock itself (volatile in PostgreSQL) it is read
/// again for every row, so the condition is a filter over every row of the index or table, and
/// an idle sweep reads the whole table.
fn now_once<D: Dialect>() -> String {
    format!("(SELECT {})", D::NOW)
}

/// Deletes up to `$2` rows of `table` recorded (`at`) at least `$1` ms ago, oldest first,
/// returning their `key`: a range of the table's time index, empty when nothing is that old.
fn delete_older_sql<D: Dialect>(table: &str, key: &str) -> String {
    let oldest = format!(
        "SELECT {key} FROM {table} WHERE at <= {} - $1 ORDER BY at LIMIT $2",
        now_once::<D>()
    );
    format!(
        "DELETE FROM {table} WHERE {key} {} RETURNING {key}",
        D::one_of(&oldest)
    )
}

/// Deletes up to `$1` CONFIRMED operations past their expiry. The state and expiry conditions
/// are repeated on the outer DELETE so that a row a concurrent Begin just claimed again is
/// re-checked and kept.
fn delete_expired_sql<D: Dialect>() -> String {
    let now = now_once::<D>();
    delete_oldest_sql(
        &format!("state = 'CONFIRMED' AND expires_at <= {now}"),
        "expires_at",
    )
}

/// Up to `$1` ABSENT operations past retention whose tombstone has been kept `$2` ms since
/// they settled, oldest settled first (by their own index, so the tombstones still kept are
/// not read), with the conditions re-checked on the outer DELETE as above.
fn delete_tombstones_sql<D: Dialect>() -> String {
    let now = now_once::<D>();
    delete_oldest_sql(
        &format!("state = 'ABSENT' AND updated_at <= {now} - $2 AND expires_at <= {now}"),
        "updated_at",
    )
}

/// Deletes up to `$1` operations where `gone` holds, the first by `oldest`; `gone` is checked
/// again on the rows deleted, so a row that changed since the inner select stays.
fn delete_oldest_sql(gone: &str, oldest: &str) -> String {
    format!(
        "DELETE FROM operations WHERE {gone} \
         AND (tenant, operation_id) IN (SELECT tenant, operation_id FROM operations \
         WHERE {gone} ORDER BY {oldest} LIMIT $1)"
    )
}

/// Up to `$1` IN_FLIGHT operations past their lease.
fn expired_leases_sql<D: Dialect>() -> String {
    format!(
        "SELECT tenant, operation_id FROM operations \
         WHERE state = 'IN_FLIGHT' AND lease_deadline <= {} ORDER BY lease_deadline LIMIT $1",
        now_once::<D>()
    )
}

/// UNKNOWN operations due for a lookup by one of `served` (tenant, reconciler) pairs, bound
/// first, then the limit.
fn due_lookups_sql<D: Dialect>(served: usize) -> String {
    let now = now_once::<D>();
    let pairs: Vec<String> = (0..served)
        .map(|n| format!("(${}, ${})", 2 * n + 1, 2 * n + 2))
        .collect();
    format!(
        "SELECT tenant, operation_id FROM operations WHERE state = 'UNKNOWN' \
         AND provider IS NOT NULL AND reconcile_next_at <= {now} \
         AND (lookup_claimed_until IS NULL OR lookup_claimed_until <= {now}) \
         AND (tenant, provider) IN (VALUES {}) ORDER BY reconcile_next_at LIMIT ${}",
        pairs.join(", "),
        2 * served + 1
    )
}

/// The attempt log's record of one attempt, by its token: `$1` tenant, `$2` id, `$3` token.
static FIND_ATTEMPT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {} FROM attempts a \
         WHERE a.tenant = $1 AND a.operation_id = $2 AND a.fencing_token = $3",
        rows::ATTEMPT_SELECTED.as_str()
    )
});

/// A resolution's event, by its dedupe key: `$1` tenant, `$2` id, `$3` key.
const FIND_RESOLUTION: &str = "SELECT to_state, details FROM events \
     WHERE tenant = $1 AND operation_id = $2 AND dedupe_key = $3";

/// What a statement of a call's path is bound with.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallBinds {
    /// `$1` a tenant, `$2` an operation id.
    Operation,
    /// `$1` a tenant, `$2` a tool, `$3` a fingerprint, `$4` the operation id asking.
    Intent,
    /// `$1` a tenant, `$2` an operation id, `$3` a fencing token.
    Token,
    /// `$1` a tenant, `$2` an operation id, `$3` an event's dedupe key.
    DedupeKey,
}

/// The statements of the Begin and report path that look rows up, as they are sent, with how
/// each is bound: for tests of their plans (one operation is found by an index whatever the
/// table holds).
#[cfg(test)]
pub(crate) fn call_statements<D: Dialect>() -> Vec<(&'static str, String, CallBinds)> {
    let statements = D::statements();
    let guard = D::guard_statement().map(|sql| ("fresh-id guard", sql, CallBinds::Intent));
    let mut listed = vec![
        ("read", statements.read.clone(), CallBinds::Operation),
        (
            "read for a Begin",
            statements.read_claimable.clone(),
            CallBinds::Operation,
        ),
        ("lock", statements.lock.clone(), CallBinds::Operation),
        ("attempt", FIND_ATTEMPT.clone(), CallBinds::Token),
        (
            "resolution",
            FIND_RESOLUTION.to_owned(),
            CallBinds::DedupeKey,
        ),
    ];
    listed.extend(guard);
    listed
}

/// What a sweeper statement is bound with.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepBinds {
    /// `$1`, a limit.
    Limit,
    /// `$1`, a limit; `$2`, an age in ms.
    LimitThenAge,
    /// `$1`, an age in ms; `$2`, a limit.
    AgeThenLimit,
    /// `$1`, a tenant; `$2`, a reconciler; `$3`, a limit.
    TenantReconcilerLimit,
}

/// Every statement the background sweepers run over a table that grows, as they are sent, with
/// how each is bound: for tests of their plans (an idle sweep must read an index range, not
/// the table).
#[cfg(test)]
pub(crate) fn sweep_statements<D: Dialect>() -> Vec<(&'static str, String, SweepBinds)> {
    vec![
        ("retention", delete_expired_sql::<D>(), SweepBinds::Limit),
        (
            "tombstones",
            delete_tombstones_sql::<D>(),
            SweepBinds::LimitThenAge,
        ),
        (
            "events",
            delete_older_sql::<D>("events", "sequence"),
            SweepBinds::AgeThenLimit,
        ),
        (
            "duplicates",
            delete_older_sql::<D>("duplicates", "id"),
            SweepBinds::AgeThenLimit,
        ),
        ("leases", expired_leases_sql::<D>(), SweepBinds::Limit),
        (
            "lookups",
            due_lookups_sql::<D>(1),
            SweepBinds::TenantReconcilerLimit,
        ),
    ]
}

/// Deletes up to `limit` rows of `table` (history kept beside the ledger, keyed by `key`)
/// whose `at` is older than `age_ms`, oldest first, in `tx`; returns their keys.
async fn delete_older<D>(
    tx: &mut Transaction<'static, D>,
    (table, key): (&str, &str),
    age_ms: i64,
    limit: u32,
) -> Result<Vec<i64>, StoreError>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'r> (i64,): FromRow<'r, D::Row>,
{
    let sql = delete_older_sql::<D>(table, key);
    let deleted: Vec<(i64,)> = sqlx::query_as(&sql)
        .bind(age_ms)
        .bind(i64::from(limit))
        .fetch_all(&mut **tx)
        .await?;
    Ok(deleted.into_iter().map(|(key,)| key).collect())
}

/// Advances the credential clock inside `tx`, holding its row until `tx` ends, and returns the
/// version of the change `tx` makes (see `credential_watermark.sql`).
async fn tick<D>(tx: &mut Transaction<'static, D>) -> Result<i64, StoreError>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'r> (i64,): FromRow<'r, D::Row>,
{
    let (version,): (i64,) = sqlx::query_as(
        "UPDATE credential_clock SET version = version + 1 WHERE id = 1 RETURNING version",
    )
    .fetch_one(&mut **tx)
    .await?;
    Ok(version)
}

// The transaction primitives need less of the driver than the reads and sweeps below: the
// rows of an operation, its attempts, events and guard, and the types their columns hold.
impl<D> Transactions for Store<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
    for<'q> &'q [u8]: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q [u8]>: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> Option<i64>: Encode<'q, D> + Type<D>,
    for<'q> bool: Encode<'q, D> + Type<D>,
    for<'q> String: Encode<'q, D> + Type<D>,
    for<'q> Option<String>: Decode<'q, D> + Type<D>,
    for<'r> OperationRow: FromRow<'r, D::Row>,
    for<'r> AttemptRow: FromRow<'r, D::Row>,
    for<'r> EventRow: FromRow<'r, D::Row>,
    for<'r> BlockingRow: FromRow<'r, D::Row>,
    for<'r> KeyRow: FromRow<'r, D::Row>,
    for<'q> Option<i64>: Decode<'q, D>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'r> (Option<String>, Option<String>): FromRow<'r, D::Row>,
    for<'n> &'n str: ColumnIndex<D::Row>,
{
    type Tx = Transaction<'static, D>;
    type Conn = PoolConnection<D>;

    async fn begin_write(&self) -> Result<Self::Tx, StoreError> {
        D::begin_write(&self.pool).await
    }

    async fn lock(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
    ) -> Result<Clocked, StoreError> {
        let row = by_operation::<D>(&mut **tx, &D::statements().lock, tenant, id).await?;
        clocked(&row)
    }

    async fn connection(&self) -> Result<(Self::Conn, Duration), StoreError> {
        let asked = Instant::now();
        let conn = self.pool.acquire().await?;
        Ok((conn, asked.elapsed()))
    }

    async fn read_held(
        &self,
        conn: &mut Self::Conn,
        tenant: &str,
        id: &OperationId,
    ) -> Result<Clocked, StoreError> {
        let row = by_operation::<D>(&mut **conn, &D::statements().read, tenant, id).await?;
        clocked(&row)
    }

    async fn read_claimable(
        &self,
        conn: &mut Self::Conn,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis, Option<FencingToken>), StoreError> {
        let statement = &D::statements().read_claimable;
        let row = by_operation::<D>(&mut **conn, statement, tenant, id).await?;
        let (op, now) = clocked(&row)?;
        let token: Option<i64> = row.try_get("fresh_token")?;
        Ok((op, now, token.map(rows::token).transpose()?))
    }

    fn writes_unlocked(&self) -> bool {
        D::UNLOCKED_WRITES
    }

    async fn apply_unlocked(
        &self,
        conn: &mut Self::Conn,
        decided_from: Option<(FencingToken, i64)>,
        guard: Option<&BeginCommand>,
        plan: &Plan,
        now: Millis,
    ) -> Result<Option<crate::Unlocked>, StoreError> {
        D::apply_unlocked(&mut **conn, decided_from, guard, plan, now).await
    }

    async fn guard(
        &self,
        tx: &mut Self::Tx,
        cmd: &BeginCommand,
    ) -> Result<FreshIdGuard, StoreError> {
        // A Begin declaring a new intent reads nothing of the others, so it needs no lock: were
        // it to run beside one that does not declare it, the outcome is the one where it ran
        // second.
        if cmd.new_intent {
            let token = self.next_token(tx).await?;
            return Ok(FreshIdGuard::Clear { token });
        }
        if let Some(blocking) = D::blocking(&mut **tx, cmd).await? {
            return Ok(FreshIdGuard::Blocked(blocking));
        }
        let token = self.next_token(tx).await?;
        Ok(FreshIdGuard::Clear { token })
    }

    async fn next_token(&self, tx: &mut Self::Tx) -> Result<FencingToken, StoreError> {
        let token: (i64,) = sqlx::query_as(D::NEXT_TOKEN).fetch_one(&mut **tx).await?;
        rows::token(token.0)
    }

    async fn attempt(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
        fencing_token: FencingToken,
    ) -> Result<Option<Attempt>, StoreError> {
        let row: Option<AttemptRow> = sqlx::query_as(&FIND_ATTEMPT)
            .bind(tenant)
            .bind(id.as_str())
            .bind(rows::token_column(fencing_token))
            .fetch_optional(&mut **tx)
            .await?;
        row.map(Attempt::try_from).transpose()
    }

    async fn find_resolution(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
        resolution_id: &str,
    ) -> Result<Option<PriorResolution>, StoreError> {
        let key = machine::resolution_key(resolution_id);
        let found: Option<(Option<String>, Option<String>)> = sqlx::query_as(FIND_RESOLUTION)
            .bind(tenant)
            .bind(id.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut **tx)
            .await?;
        let Some((Some(to), details)) = found else {
            return Ok(None);
        };
        let state = rows::state(&to)?;
        Ok(Some(PriorResolution::from_event(state, details.as_deref())))
    }

    async fn apply(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
        plan: &Plan,
        now: Millis,
    ) -> Result<crate::backend::Written, StoreError> {
        let mut written_events = Vec::with_capacity(plan.events.len());
        if let Some(write) = &plan.operation {
            let (sql, op) = match write {
                Write::Insert(op) => (INSERT_OPERATION.as_str(), op),
                Write::Update(op) => (UPDATE_OPERATION.as_str(), op),
            };
            let written = rows::bind_operation(sqlx::query(sql), op)
                .execute(&mut **tx)
                .await?;
            if matches!(write, Write::Update(_)) && D::rows_affected(&written) != 1 {
                return Err(StoreError::NotFound);
            }
        }
        if plan.forgets_attempts {
            sqlx::query("DELETE FROM attempts WHERE tenant = $1 AND operation_id = $2")
                .bind(tenant)
                .bind(id.as_str())
                .execute(&mut **tx)
                .await?;
        }
        if let Some(attempt) = &plan.attempt {
            rows::bind_attempt(
                sqlx::query(&INSERT_ATTEMPT).bind(tenant).bind(id.as_str()),
                attempt,
            )
            .execute(&mut **tx)
            .await?;
        }
        for event in &plan.events {
            // Anomalies carry a dedupe key so a repeated cause is recorded once. The tool and
            // the state are the operation row's as this plan left it (written above), for
            // watchers' filters.
            let inserted = sqlx::query(&INSERT_EVENT)
                .bind(tenant)
                .bind(id.as_str())
                .bind(rows::token_column(event.life))
                .bind(now)
                .bind(event.kind.as_str())
                .bind(event.from.map(|s| s.as_str()))
                .bind(event.to.map(|s| s.as_str()))
                .bind(event.attempt.map(i64::from))
                .bind(event.actor.to_string())
                .bind(event.reason.as_deref())
                .bind(event.details.as_deref())
                .bind(event.dedupe_key.as_deref())
                .execute(&mut **tx)
                .await?;
            written_events.push(D::rows_affected(&inserted) == 1);
        }
        Ok(crate::backend::Written {
            events: written_events,
        })
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await?;
        Ok(())
    }

    fn group_commit(&self) -> bool {
        D::GROUP_COMMIT
    }

    async fn savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError> {
        sqlx::query("SAVEPOINT write").execute(&mut **tx).await?;
        Ok(())
    }

    async fn release_savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError> {
        sqlx::query("RELEASE SAVEPOINT write")
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn rollback_to_savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError> {
        sqlx::query("ROLLBACK TO SAVEPOINT write")
            .execute(&mut **tx)
            .await?;
        self.release_savepoint(tx).await
    }
}

// What the shared SQL needs of a database's sqlx driver: that its connections execute queries,
// and that it encodes and decodes the handful of types the ledger's columns hold. SQLite's and
// PostgreSQL's drivers both do; the compiler checks it where a backend is named.
impl<D> Backend for Store<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
    for<'q> &'q [u8]: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q [u8]>: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> Option<i64>: Encode<'q, D> + Type<D>,
    for<'q> bool: Encode<'q, D> + Type<D>,
    for<'q> String: Encode<'q, D> + Type<D>,
    for<'q> Option<String>: Decode<'q, D> + Type<D>,
    for<'r> OperationRow: FromRow<'r, D::Row>,
    for<'r> AttemptRow: FromRow<'r, D::Row>,
    for<'r> EventRow: FromRow<'r, D::Row>,
    for<'r> BlockingRow: FromRow<'r, D::Row>,
    for<'r> KeyRow: FromRow<'r, D::Row>,
    for<'r> TenantRow: FromRow<'r, D::Row>,
    for<'r> CredentialRow: FromRow<'r, D::Row>,
    for<'r> KnownCredentialRow: FromRow<'r, D::Row>,
    for<'r> WatchedEventRow: FromRow<'r, D::Row>,
    for<'r> ListedRow: FromRow<'r, D::Row>,
    for<'r> DuplicateRow: FromRow<'r, D::Row>,
    for<'r> (String, String, i64): FromRow<'r, D::Row>,
    for<'r> (String, Option<i64>): FromRow<'r, D::Row>,
    for<'r> (String, i64): FromRow<'r, D::Row>,
    for<'r> (i64, String): FromRow<'r, D::Row>,
    for<'q> Option<i64>: Decode<'q, D>,
    for<'r> (Option<String>, Option<String>): FromRow<'r, D::Row>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'n> &'n str: ColumnIndex<D::Row>,
{
    fn kind(&self) -> &'static str {
        D::KIND
    }

    async fn history(
        &self,
        tenant: &str,
        id: &OperationId,
        life: FencingToken,
    ) -> Result<(Vec<Attempt>, Vec<Event>), StoreError> {
        // This life's attempts: its tokens are at least its first. An earlier life's, kept
        // with the provider key it handed on, are below it.
        let sql = format!(
            "SELECT {} FROM attempts a \
             WHERE a.tenant = $1 AND a.operation_id = $2 AND a.fencing_token >= $3 \
             ORDER BY a.fencing_token",
            rows::ATTEMPT_SELECTED.as_str()
        );
        let attempts: Vec<AttemptRow> = sqlx::query_as(&sql)
            .bind(tenant)
            .bind(id.as_str())
            .bind(rows::token_column(life))
            .fetch_all(&self.pool)
            .await?;
        // This life's events, and any recorded since it began for an earlier life (the late
        // report of an attempt of that life, recorded in it).
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events \
             WHERE tenant = $1 AND operation_id = $2 AND (life = $3 OR (life < $3 AND \
             sequence > (SELECT min(sequence) FROM events WHERE tenant = $1 \
             AND operation_id = $2 AND life = $3))) ORDER BY sequence"
        );
        let events: Vec<EventRow> = sqlx::query_as(&sql)
            .bind(tenant)
            .bind(id.as_str())
            .bind(rows::token_column(life))
            .fetch_all(&self.pool)
            .await?;
        Ok((rows::convert(attempts)?, rows::convert(events)?))
    }

    async fn list(&self, scope: &Scope, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        // Declared before the arguments, which borrow it as long as they live.
        let mut sql = String::new();
        let mut binds = Binds::<D>::default();
        // `created_at >= 0`, true of every row, lets PostgreSQL read a tenant's rows in order
        // by their partial index (see `0007_lookups_cannot_take_a_tenant_index.sql`). Every
        // tenant's are read in (created_at, tenant, operation_id) order, which no index keeps.
        sql += &format!(
            "SELECT {} FROM operations WHERE created_at >= 0",
            LISTED_OPERATION_COLUMNS.as_str(),
        );
        if let Some(tenant) = scope.tenant() {
            sql += &format!(" AND tenant = {}", binds.push(tenant)?);
        }
        if !query.states.is_empty() {
            let states = query
                .states
                .iter()
                .map(|state| binds.push(state.as_str()))
                .collect::<Result<Vec<_>, _>>()?;
            sql += &format!(" AND state IN ({})", states.join(", "));
        }
        if let Some(tool) = &query.tool {
            sql += &format!(" AND tool = {}", binds.push(tool.as_str())?);
        }
        if let Some(provider) = &query.provider {
            sql += &format!(" AND provider = {}", binds.push(provider.as_str())?);
        }
        if let Some(age) = query.older_than_ms {
            sql += &format!(" AND created_at <= {} - {}", D::NOW, binds.push(age)?);
        }
        let order = match (scope, &query.after) {
            (Scope::Tenant(_), Some(end)) => {
                let created_at = binds.push(end.created_at)?;
                let id = binds.push(end.operation_id.as_str())?;
                sql += &format!(" AND (created_at, operation_id) > ({created_at}, {id})");
                "created_at, operation_id"
            }
            (Scope::AllTenants, Some(end)) => {
                let created_at = binds.push(end.created_at)?;
                let tenant = binds.push(end.tenant.as_str())?;
                let id = binds.push(end.operation_id.as_str())?;
                sql += &format!(
                    " AND (created_at, tenant, operation_id) > ({created_at}, {tenant}, {id})"
                );
                "created_at, tenant, operation_id"
            }
            (Scope::Tenant(_), None) => "created_at, operation_id",
            (Scope::AllTenants, None) => "created_at, tenant, operation_id",
        };
        let limit = binds.push(i64::from(query.page_size))?;
        sql += &format!(" ORDER BY {order} LIMIT {limit}");
        let page: Vec<ListedRow> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        rows::convert(page)
    }

    async fn expired_leases(&self, limit: u32) -> Result<Vec<(String, OperationId)>, StoreError> {
        let sql = expired_leases_sql::<D>();
        let expired: Vec<KeyRow> = sqlx::query_as(&sql)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows::convert(expired)
    }

    async fn due_lookups(
        &self,
        limit: u32,
        served: &[(&str, &str)],
    ) -> Result<Vec<(String, OperationId)>, StoreError> {
        if served.is_empty() {
            return Ok(Vec::new());
        }
        let sql = due_lookups_sql::<D>(served.len());
        let mut due = sqlx::query_as(&sql);
        for (tenant, provider) in served {
            due = due.bind(*tenant).bind(*provider);
        }
        let due: Vec<KeyRow> = due.bind(i64::from(limit)).fetch_all(&self.pool).await?;
        rows::convert(due)
    }

    async fn claim_lookup(
        &self,
        tenant: &str,
        id: &OperationId,
        claim_ms: i64,
        before_due: bool,
    ) -> Result<Option<(Operation, Lookup)>, StoreError> {
        // The conditional UPDATE is the claim: one caller moves the claim forward, every other
        // sees it held until it lapses. The version it bumps makes any lookup claimed before
        // stale, and the row it returns is the snapshot this lookup judges. The lookup is issued
        // at the moment of the claim: one reading of the clock (read twice, a volatile clock
        // would put the claim's end less than its length after the issue).
        let now = D::NOW;
        let sql = format!(
            "UPDATE operations SET lookup_claimed_until = {now} + $3, version = version + 1 \
             WHERE tenant = $1 AND operation_id = $2 AND state = 'UNKNOWN' \
             AND provider IS NOT NULL AND source <> 'anomaly' \
             AND (lookup_claimed_until IS NULL OR lookup_claimed_until <= {now}) \
             AND ($4 OR reconcile_next_at <= {now}) \
             RETURNING {}, lookup_claimed_until - $3 AS issued_at",
            OPERATION_COLUMNS.as_str()
        );
        let row = sqlx::query(&sql)
            .bind(tenant)
            .bind(id.as_str())
            .bind(claim_ms)
            .bind(before_due)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let issued_at: Millis = row.try_get("issued_at")?;
        let op = Operation::try_from(OperationRow::from_row(&row)?)?;
        let lookup = Lookup::of(&op, issued_at);
        Ok(Some((op, lookup)))
    }

    async fn delete_expired(&self, limit: u32, absent_kept_ms: i64) -> Result<u64, StoreError> {
        let confirmed = sqlx::query(&delete_expired_sql::<D>())
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
        let confirmed = D::rows_affected(&confirmed);
        let room = u64::from(limit).saturating_sub(confirmed);
        if room == 0 {
            return Ok(confirmed);
        }
        let absent = sqlx::query(&delete_tombstones_sql::<D>())
            .bind(i64::try_from(room).unwrap_or(i64::MAX))
            .bind(absent_kept_ms)
            .execute(&self.pool)
            .await?;
        Ok(confirmed + D::rows_affected(&absent))
    }

    async fn delete_events_older_than(&self, age_ms: i64, limit: u32) -> Result<u64, StoreError> {
        // The deletion and the horizon it moves commit together: a watcher that reads the
        // horizon after its events sees every deletion that took events from under it.
        let mut tx = D::begin_write(&self.pool).await?;
        let deleted = delete_older(&mut tx, ("events", "sequence"), age_ms, limit).await?;
        if let Some(&through) = deleted.iter().max() {
            sqlx::query(
                "UPDATE event_horizon SET deleted_through = \
                 CASE WHEN deleted_through < $1 THEN $1 ELSE deleted_through END WHERE id = 1",
            )
            .bind(through)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(deleted.len() as u64)
    }

    async fn deleted_through(&self) -> Result<i64, StoreError> {
        let (through,): (i64,) =
            sqlx::query_as("SELECT deleted_through FROM event_horizon WHERE id = 1")
                .fetch_one(&self.pool)
                .await?;
        Ok(through)
    }

    async fn put_tenant(&self, tenant: &Tenant) -> Result<Tenant, StoreError> {
        let sql = format!(
            "INSERT INTO tenants ({TENANT_COLUMNS}, changed) VALUES ($1, {}, $2, $3, $4) \
             ON CONFLICT (name) DO UPDATE SET max_in_flight = $2, requests_per_second = $3, \
             changed = $4 RETURNING {TENANT_COLUMNS}",
            D::NOW
        );
        let mut tx = D::begin_write(&self.pool).await?;
        let version = tick(&mut tx).await?;
        let row: TenantRow = sqlx::query_as(&sql)
            .bind(tenant.name.as_str())
            .bind(tenant.max_in_flight)
            .bind(tenant.requests_per_second)
            .bind(version)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Tenant::try_from(row)
    }

    async fn tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let sql = format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY name");
        let rows: Vec<TenantRow> = sqlx::query_as(&sql).fetch_all(&self.pool).await?;
        rows::convert(rows)
    }

    async fn create_credential(&self, new: &NewCredential) -> Result<Credential, StoreError> {
        // Inserted only beside an existing tenant: no row means there is none. One created
        // while the ledger was open is inserted only while no credential is stored, and takes
        // the one `while_open` mark the unique index allows: of concurrent first credentials,
        // one commits and the others are duplicates.
        let sql = format!(
            "INSERT INTO credentials \
             (key_id, tenant, name, roles, kind, secret_hash, created_at, while_open, changed) \
             SELECT $1, name, $3, $4, $5, $6, {}, $7, $8 FROM tenants WHERE name = $2 \
             AND ($7 IS NULL OR NOT EXISTS (SELECT 1 FROM credentials)) \
             RETURNING {CREDENTIAL_COLUMNS}",
            D::NOW
        );
        let mut tx = D::begin_write(&self.pool).await?;
        let version = tick(&mut tx).await?;
        let row: Option<CredentialRow> = sqlx::query_as(&sql)
            .bind(new.key_id.as_str())
            .bind(new.tenant.as_str())
            .bind(new.name.as_str())
            .bind(new.roles.to_string())
            .bind(new.kind.as_str())
            .bind(&new.secret_hash.0[..])
            .bind(new.while_open.then_some(1_i64))
            .bind(version)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        match row {
            Some(row) => Credential::try_from(row),
            None if new.while_open && !self.credentials(None).await?.is_empty() => {
                Err(StoreError::Duplicate)
            }
            None => Err(StoreError::NotFound),
        }
    }

    async fn credentials(&self, tenant: Option<&str>) -> Result<Vec<Credential>, StoreError> {
        let sql = format!(
            "SELECT {CREDENTIAL_COLUMNS} FROM credentials WHERE $1 IS NULL OR tenant = $1 \
             ORDER BY created_at, key_id"
        );
        let rows: Vec<CredentialRow> = sqlx::query_as(&sql)
            .bind(tenant)
            .fetch_all(&self.pool)
            .await?;
        rows::convert(rows)
    }

    async fn revoke_credential(&self, key_id: &str) -> Result<Option<Credential>, StoreError> {
        let sql = format!(
            "UPDATE credentials SET revoked_at = COALESCE(revoked_at, {}), changed = $2 \
             WHERE key_id = $1 RETURNING {CREDENTIAL_COLUMNS}",
            D::NOW
        );
        let mut tx = D::begin_write(&self.pool).await?;
        let version = tick(&mut tx).await?;
        let row: Option<CredentialRow> = sqlx::query_as(&sql)
            .bind(key_id)
            .bind(version)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        row.map(Credential::try_from).transpose()
    }

    async fn credentials_since(&self, watermark: i64) -> Result<CredentialChanges, StoreError> {
        // `c.*` and the tenant's columns, those that share a name with the credential's
        // renamed: the credentials changed since, and every credential of a tenant changed
        // since. One statement, so one snapshot: with changes committed in version order, it
        // holds every change up to the highest version it shows.
        let columns = "c.*, t.created_at AS tenant_created_at, t.max_in_flight, \
                       t.requests_per_second, t.changed AS tenant_changed";
        let sql = format!(
            "SELECT {columns} FROM credentials c JOIN tenants t ON t.name = c.tenant \
             WHERE c.changed > $1 \
             UNION ALL SELECT {columns} FROM tenants t JOIN credentials c ON c.tenant = t.name \
             WHERE t.changed > $1"
        );
        let rows: Vec<KnownCredentialRow> = sqlx::query_as(&sql)
            .bind(watermark)
            .fetch_all(&self.pool)
            .await?;
        let through = rows
            .iter()
            .map(KnownCredentialRow::version)
            .fold(watermark, i64::max);
        Ok(CredentialChanges {
            changed: rows::convert(rows)?,
            through,
        })
    }

    async fn in_flight(&self, tenant: &str) -> Result<i64, StoreError> {
        let (count,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM operations WHERE tenant = $1 AND state = 'IN_FLIGHT'",
        )
        .bind(tenant)
        .fetch_one(&self.pool)
        .await?;
        Ok(count)
    }

    async fn event_frontier(&self) -> Result<Frontier, StoreError> {
        let (newest, writing): (i64, String) =
            sqlx::query_as(D::frontier()).fetch_one(&self.pool).await?;
        Ok(Frontier {
            newest,
            writing: writing
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .collect(),
        })
    }

    async fn watch_events(
        &self,
        scope: &Scope,
        (after, upto): (i64, i64),
        filter: &WatchFilter,
        limit: u32,
    ) -> Result<Vec<OperationEvent>, StoreError> {
        // Declared before the arguments, which borrow it as long as they live.
        let mut sql = String::new();
        let mut binds = Binds::<D>::default();
        sql += &format!(
            // `sequence > 0`: see `list`.
            "SELECT {} FROM events WHERE sequence > 0 AND sequence > {} AND sequence <= {}",
            WATCHED_EVENT_COLUMNS.as_str(),
            binds.push(after)?,
            binds.push(upto)?,
        );
        if let Some(tenant) = scope.tenant() {
            sql += &format!(" AND tenant = {}", binds.push(tenant)?);
        }
        // The rule of `WatchFilter::matches`: states and kinds widen, the tool narrows.
        let mut wide = Vec::new();
        if !filter.states.is_empty() {
            let states = filter
                .states
                .iter()
                .map(|state| binds.push(state.as_str()))
                .collect::<Result<Vec<_>, _>>()?
                .join(", ");
            for column in ["from_state", "to_state", "state"] {
                wide.push(format!("{column} IN ({states})"));
            }
        }
        if !filter.kinds.is_empty() {
            let kinds = filter
                .kinds
                .iter()
                .map(|kind| binds.push(kind.as_str()))
                .collect::<Result<Vec<_>, _>>()?
                .join(", ");
            wide.push(format!("kind IN ({kinds})"));
        }
        if !wide.is_empty() {
            sql += &format!(" AND ({})", wide.join(" OR "));
        }
        if let Some(tool) = &filter.tool {
            sql += &format!(" AND tool = {}", binds.push(tool.as_str())?);
        }
        let limit = binds.push(i64::from(limit))?;
        sql += &format!(" ORDER BY sequence LIMIT {limit}");
        let page: Vec<WatchedEventRow> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        rows::convert(page)
    }

    async fn stats(&self, scope: &Scope, window_ms: i64) -> Result<Stats, StoreError> {
        let now = D::NOW;
        let (mut sql, mut binds) = (String::new(), Binds::<D>::default());
        sql += &format!(
            "SELECT state, tool, COUNT(*) FROM operations WHERE {} \
             GROUP BY state, tool ORDER BY state, tool",
            binds.of_scope("tenant", scope)?
        );
        let counts: Vec<(String, String, i64)> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        let counts = counts
            .into_iter()
            .map(|(state, tool, n)| Ok((rows::state(&state)?, tool, n)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        let (mut sql, mut binds) = (String::new(), Binds::<D>::default());
        sql += &format!(
            "SELECT {now} - COALESCE(unknown_since, updated_at) FROM operations \
             WHERE {} AND state = 'UNKNOWN'",
            binds.of_scope("tenant", scope)?
        );
        let ages: Vec<(i64,)> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        // Each move out of UNKNOWN in the window, and how long after the operation's latest
        // move into UNKNOWN in the same life.
        let (mut sql, mut binds) = (String::new(), Binds::<D>::default());
        sql += &format!(
            "SELECT e.kind, e.at - (SELECT MAX(u.at) FROM events u WHERE u.tenant = e.tenant \
             AND u.operation_id = e.operation_id AND u.life = e.life AND u.to_state = 'UNKNOWN' \
             AND u.sequence < e.sequence) FROM events e WHERE {} \
             AND e.from_state = 'UNKNOWN' AND e.to_state IN ('CONFIRMED', 'ABSENT')",
            binds.in_window(scope, window_ms)?
        );
        let resolved: Vec<(String, Option<i64>)> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        let resolved = resolved
            .into_iter()
            .filter_map(|(kind, took)| Some((EventKind::parse(&kind)?, took?)))
            .collect();
        let kinds: Vec<String> = once_core::stats::COUNTED
            .iter()
            .map(|k| format!("'{}'", k.as_str()))
            .collect();
        let (mut sql, mut binds) = (String::new(), Binds::<D>::default());
        sql += &format!(
            "SELECT e.kind, COUNT(*) FROM events e WHERE {} AND e.kind IN ({}) \
             GROUP BY e.kind",
            binds.in_window(scope, window_ms)?,
            kinds.join(", ")
        );
        let events: Vec<(String, i64)> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        let events = events
            .into_iter()
            .filter_map(|(kind, n)| Some((EventKind::parse(&kind)?, n)))
            .collect();
        Ok(Stats::of(
            counts,
            ages.into_iter().map(|(age,)| age).collect(),
            resolved,
            events,
        ))
    }

    async fn gauges(&self) -> Result<Gauges, StoreError> {
        let now = now_once::<D>();
        // One statement, each part on the open operations only (their partial indexes): the
        // open counts, then for each tenant one row for each age threshold and the oldest age,
        // and the leases past. A tenant name has no `/`, so `tenant/tool` splits at its first.
        let mut sql = String::from(
            "SELECT state, tenant || '/' || tool, COUNT(*) FROM operations \
             WHERE state IN ('IN_FLIGHT', 'UNKNOWN') GROUP BY state, tenant, tool",
        );
        let since = "COALESCE(unknown_since, updated_at)";
        for threshold in UNKNOWN_AGE_THRESHOLDS {
            sql.push_str(&format!(
                " UNION ALL SELECT 'AGE', tenant || '/{threshold}', COUNT(*) FROM operations \
                 WHERE state = 'UNKNOWN' AND {since} <= {now} - {threshold} GROUP BY tenant"
            ));
        }
        sql.push_str(&format!(
            " UNION ALL SELECT 'OLDEST', tenant, {now} - MIN({since}) FROM operations \
             WHERE state = 'UNKNOWN' GROUP BY tenant \
             UNION ALL SELECT 'PAST_LEASE', '', COUNT(*) FROM operations \
             WHERE state = 'IN_FLIGHT' AND lease_deadline < {now} \
             UNION ALL SELECT 'TENANT', name, 0 FROM tenants"
        ));
        let rows: Vec<(String, String, i64)> = sqlx::query_as(&sql).fetch_all(&self.pool).await?;
        let mut gauges = Gauges::default();
        for (kind, key, n) in rows {
            match kind.as_str() {
                "AGE" => {
                    let (tenant, threshold) = key
                        .rsplit_once('/')
                        .and_then(|(tenant, t)| Some((tenant.to_owned(), t.parse().ok()?)))
                        .ok_or_else(|| {
                            StoreError::Corrupt(format!("an age threshold read back as {key:?}"))
                        })?;
                    gauges.unknown_older_than.push((tenant, threshold, n));
                }
                "OLDEST" => gauges.oldest_unknown.push((key, n.max(0))),
                "PAST_LEASE" => gauges.past_lease = n,
                "TENANT" => gauges.tenants.push(key),
                state => {
                    let (tenant, tool) = key.split_once('/').ok_or_else(|| {
                        StoreError::Corrupt(format!("an open count read back as {key:?}"))
                    })?;
                    let (tenant, tool) = (tenant.to_owned(), tool.to_owned());
                    gauges.open.push((rows::state(state)?, tenant, tool, n));
                }
            }
        }
        Ok(gauges)
    }

    fn pool_use(&self) -> crate::backend::PoolUse {
        crate::backend::PoolUse {
            open: self.pool.size(),
            idle: u32::try_from(self.pool.num_idle()).unwrap_or(u32::MAX),
            max: self.pool.options().get_max_connections(),
        }
    }

    async fn record_duplicates(&self, duplicates: &[Duplicate]) -> Result<(), StoreError> {
        if duplicates.is_empty() {
            return Ok(());
        }
        let mut sql = format!("INSERT INTO duplicates ({DUPLICATE_COLUMNS}) VALUES ");
        let mut binds = Binds::<D>::default();
        let mut rows = Vec::with_capacity(duplicates.len());
        for d in duplicates {
            let values = [
                binds.push(d.tenant.as_str())?,
                binds.push(d.operation_id.as_str())?,
                binds.push(d.tool.as_str())?,
                binds.push(d.at)?,
                binds.push(d.decision.as_str())?,
                binds.push(d.attempt_id.as_str())?,
                binds.push(d.context.client_name.as_deref())?,
                binds.push(d.context.session_id.as_deref())?,
                binds.push(d.context.request_id.as_deref())?,
                binds.push(d.actor.to_string())?,
                binds.push(d.requested.as_ref().map(|id| id.as_str()))?,
            ];
            rows.push(format!("({})", values.join(", ")));
        }
        sql += &rows.join(", ");
        sqlx::query_with(&sql, binds.arguments)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn duplicates(
        &self,
        tenant: &str,
        id: &OperationId,
        since: Millis,
        limit: u32,
    ) -> Result<Vec<Duplicate>, StoreError> {
        let sql = format!(
            "SELECT {DUPLICATE_COLUMNS} FROM duplicates \
             WHERE tenant = $1 AND operation_id = $2 AND at >= $3 ORDER BY at DESC, id DESC \
             LIMIT $4"
        );
        let mut rows: Vec<DuplicateRow> = sqlx::query_as(&sql)
            .bind(tenant)
            .bind(id.as_str())
            .bind(since)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.reverse();
        rows::convert(rows)
    }

    async fn recent_duplicates(
        &self,
        tenant: &str,
        tool: Option<&str>,
        since: Millis,
        limit: u32,
    ) -> Result<Vec<Duplicate>, StoreError> {
        let sql = format!(
            // `at >= 0`: see `list`.
            "SELECT {DUPLICATE_COLUMNS} FROM duplicates WHERE tenant = $1 AND at >= 0 AND at >= $2 \
             AND ($3 IS NULL OR tool = $3) ORDER BY at, id LIMIT $4"
        );
        let rows: Vec<DuplicateRow> = sqlx::query_as(&sql)
            .bind(tenant)
            .bind(since)
            .bind(tool)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows::convert(rows)
    }

    async fn delete_duplicates_older_than(
        &self,
        age_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let mut tx = D::begin_write(&self.pool).await?;
        let deleted = delete_older(&mut tx, ("duplicates", "id"), age_ms, limit).await?;
        tx.commit().await?;
        Ok(deleted.len() as u64)
    }

    async fn announce_events(&self) -> Result<(), StoreError> {
        D::announce_events(&self.pool).await
    }

    async fn listen_for_events(&self) -> Result<Option<Announcements>, StoreError> {
        D::listen_for_events(&self.pool).await
    }

    async fn clock(&self) -> Result<Millis, StoreError> {
        let (now,): (i64,) = sqlx::query_as(&format!("SELECT {}", D::NOW))
            .fetch_one(&self.pool)
            .await?;
        Ok(now)
    }

    async fn ping(&self, probe: crate::Probe) -> Result<(), StoreError> {
        D::ping(&self.pool, probe).await
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}

/// The arguments of a statement built piece by piece: binding a value gives its placeholder.
struct Binds<'a, D: Database> {
    arguments: D::Arguments<'a>,
    count: usize,
}

impl<D: Database> Default for Binds<'_, D> {
    fn default() -> Self {
        Self {
            arguments: Default::default(),
            count: 0,
        }
    }
}

impl<'a, D: Database> Binds<'a, D> {
    fn push<T>(&mut self, value: T) -> Result<String, StoreError>
    where
        T: Encode<'a, D> + Type<D> + 'a,
    {
        self.arguments
            .add(value)
            .map_err(|e| StoreError::Internal(sqlx::Error::Encode(e)))?;
        self.count += 1;
        Ok(format!("${}", self.count))
    }

    /// The condition that `column` names a tenant of `scope`.
    fn of_scope(&mut self, column: &str, scope: &'a Scope) -> Result<String, StoreError>
    where
        &'a str: Encode<'a, D> + Type<D>,
    {
        Ok(match scope.tenant() {
            Some(tenant) => format!("{column} = {}", self.push(tenant)?),
            None => "TRUE".to_owned(),
        })
    }

    /// The condition that an event `e` is of `scope` and of the last `window_ms` by the
    /// store's clock. The window's events are read by (tenant, sequence) from the sequence of
    /// the first event in it by time (one probe of the time index), not by scanning the
    /// tenant's (`sequence > 0`: see `list`).
    fn in_window(&mut self, scope: &'a Scope, window_ms: i64) -> Result<String, StoreError>
    where
        D: Dialect,
        &'a str: Encode<'a, D> + Type<D>,
        i64: Encode<'a, D> + Type<D>,
    {
        let now = D::NOW;
        let ms = self.push(window_ms)?;
        Ok(format!(
            "{} AND e.sequence > 0 AND e.at >= {now} - {ms} \
             AND e.sequence >= COALESCE((SELECT w.sequence FROM events w \
             WHERE w.at >= {now} - {ms} ORDER BY w.at LIMIT 1), 0)",
            self.of_scope("e.tenant", scope)?
        ))
    }
}

/// The statements whose text depends on the dialect and is the same for every call, built once
/// per dialect (see [`Dialect::statements`]).
#[derive(Debug)]
pub struct Statements {
    /// The operation with the store's clock beside it, in one row even when there is none.
    read: String,
    /// The same, with a fresh fencing token (`fresh_token`) when there is no operation and the
    /// dialect can issue one outside the write lock (see [`Dialect::FRESH_TOKEN`]).
    read_claimable: String,
    /// The same, locking the row until the transaction ends.
    lock: String,
}

impl Statements {
    /// From the dialect's clock, its row lock, its write gate and its fresh token.
    pub fn new(now: &str, row_lock: &str, gate: &str, fresh_token: Option<&str>) -> Self {
        let clocked = |one: &str, lock: &str, extra: &str| {
            format!(
                "SELECT {now} AS now_ms{extra}, o.* FROM ({one}) AS one LEFT JOIN \
                 (SELECT {} FROM operations WHERE tenant = $1 AND operation_id = $2{lock}) AS o ON TRUE",
                OPERATION_COLUMNS.as_str()
            )
        };
        // CASE evaluates the branch it takes only: a stored operation takes no token.
        let token = match fresh_token {
            Some(token) => format!(", CASE WHEN o.tenant IS NULL THEN {token} END AS fresh_token"),
            None => ", NULL AS fresh_token".to_owned(),
        };
        Self {
            read: clocked("SELECT 1", "", ""),
            read_claimable: clocked("SELECT 1", "", &token),
            lock: clocked(gate, row_lock, ""),
        }
    }
}

/// The one row `sql` returns for an operation, bound with its key (`$1` the tenant, `$2` the id).
async fn by_operation<D>(
    conn: &mut D::Connection,
    sql: &str,
    tenant: &str,
    id: &OperationId,
) -> Result<D::Row, StoreError>
where
    D: Database,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
{
    Ok(sqlx::query(sql)
        .bind(tenant)
        .bind(id.as_str())
        .fetch_one(conn)
        .await?)
}

/// Reads a row of [`Statements::read`]: the operation's columns are all NULL when there is none.
fn clocked<R>(row: &R) -> Result<Clocked, StoreError>
where
    R: Row,
    for<'r> OperationRow: FromRow<'r, R>,
    for<'q> i64: Decode<'q, R::Database> + Type<R::Database>,
    for<'q> Option<String>: Decode<'q, R::Database> + Type<R::Database>,
    for<'n> &'n str: ColumnIndex<R>,
{
    let now: Millis = row.try_get("now_ms")?;
    let tenant: Option<String> = row.try_get("tenant")?;
    let op = match tenant {
        Some(_) => Some(Operation::try_from(OperationRow::from_row(row)?)?),
        None => None,
    };
    Ok((op, now))
}
