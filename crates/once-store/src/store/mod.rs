//! The ledger's SQL, written once for every [`Dialect`], split by concern: the transaction
//! primitives (`transactions`), what admission reads and changes (`credentials`), what watchers
//! read (`events`), forensics, and the sweeps; here, the store itself and the reads of the API
//! (an operation's history, listings, figures, gauges).
//!
//! The SQL is written in the dialect SQLite and PostgreSQL share: `$n` placeholders,
//! `ON CONFLICT`, `RETURNING`, row values, integer milliseconds. A call's lookup of one
//! operation (by tenant and operation id) has only the indexes keyed by the operation to choose
//! from: the indexes that order a tenant's rows (listing, watching, forensics) are partial on a
//! condition true of every row, which only the statements written for them say
//! (`0007_lookups_cannot_take_a_tenant_index.sql`), so PostgreSQL cannot plan a call's lookup
//! over one of them while a table is empty and keep that plan as it fills.

mod chain;
mod continuity;
mod credentials;
mod events;
mod forensics;
mod listed;
mod sweeps;
mod transactions;

#[cfg(test)]
pub(crate) use sweeps::{sweep_statements, SweepBinds};
pub(crate) use transactions::clocked;
#[cfg(test)]
pub(crate) use transactions::{call_statements, CallBinds};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use once_core::stats::{Gauges, LookupRow, Stats, UNKNOWN_AGE_THRESHOLDS};
use once_core::{
    Attempt, Event, EventKind, FencingToken, ListQuery, Listed, Millis, OperationId, Scope,
};
use sqlx::pool::PoolConnection;
use sqlx::{Arguments, Database, Decode, Encode, Executor, FromRow, IntoArguments, Pool, Type};

use crate::backend::sealed::Transactions;
use crate::backend::{Credentials, Events, Forensics, Sweeps};
use crate::rows::{
    self, AttemptRow, EventRow, ListedRow, EVENT_COLUMNS, LISTED_OPERATION_COLUMNS,
    OPERATION_COLUMNS,
};
use crate::{Backend, Dialect, StoreError};

/// The ledger's tables in one database, reached through a connection pool. Cheap to clone;
/// every clone shares the pool.
#[derive(Debug)]
pub struct Store<D: Database> {
    pub(crate) pool: Pool<D>,
    pub(crate) losses: Arc<Losses>,
    /// The decisions waiting to be written in one statement with others' (PostgreSQL).
    pub(crate) batches: Arc<crate::postgres::Batches>,
}

/// One call's way to the database, for its lock-free read and the one-statement write decided
/// from it: a connection from the pool, or — on PostgreSQL, for a call begun while others were
/// under way — none, its read and its write then made with other calls' in a lane's statements
/// ([`crate::postgres::Batches`]), which spares a connection's round trips for each.
#[derive(Debug)]
pub struct Call<D: Database> {
    pub(crate) pooled: Option<PoolConnection<D>>,
    /// How long its read, made with others', took from being asked to being answered.
    pub(crate) read_waited: Duration,
    /// While the call holds it, others know it is under way.
    _under_way: Option<crate::postgres::UnderWay>,
}

impl<D: Database> Clone for Store<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            losses: self.losses.clone(),
            batches: self.batches.clone(),
        }
    }
}

/// When a call last found one of the pool's connections closed by the server. The server ends
/// sessions together (it restarts, fails over, or an operator or a pooler ends them), so every
/// connection that sat idle in the pool then is as likely dead: each is pinged on its way out,
/// once, before a call can meet it.
#[derive(Debug)]
pub(crate) struct Losses {
    epoch: Instant,
    /// Nanoseconds from `epoch` to the latest loss; 0 before the first.
    latest: AtomicU64,
}

impl Default for Losses {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            latest: AtomicU64::new(0),
        }
    }
}

impl Losses {
    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// A call found a connection closed: every connection idle since before now is suspect.
    pub(crate) fn noticed(&self) {
        self.latest
            .fetch_max(self.nanos(Instant::now()).max(1), Ordering::Relaxed);
    }

    /// Whether a connection that has sat idle for `idle_for` was already in the pool when a
    /// loss was last noticed.
    pub(crate) fn idle_through_one(&self, idle_for: Duration) -> bool {
        let released = Instant::now().checked_sub(idle_for).unwrap_or(self.epoch);
        self.latest.load(Ordering::Relaxed) >= self.nanos(released).max(1)
    }
}

impl<D: Database> Store<D> {
    /// The pool, for tests that inspect the database directly.
    #[cfg(test)]
    pub(crate) fn pool(&self) -> &Pool<D> {
        &self.pool
    }
}

// The concerns' impls (in the files beside this one) each say what their SQL needs of a
// database's sqlx driver; these reads need only what they bind and decode. SQLite's and
// PostgreSQL's drivers have all of it; the compiler checks that where a backend is named.
impl<D> Backend for Store<D>
where
    D: Dialect,
    Self: Transactions
        + crate::backend::Chain
        + crate::backend::Continuity
        + Credentials
        + Events
        + Forensics
        + Sweeps,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'r> AttemptRow: FromRow<'r, D::Row>,
    for<'r> EventRow: FromRow<'r, D::Row>,
    for<'r> ListedRow: FromRow<'r, D::Row>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'r> (String, String, i64): FromRow<'r, D::Row>,
    for<'r> (String, Option<i64>): FromRow<'r, D::Row>,
    for<'r> (String, i64): FromRow<'r, D::Row>,
    for<'r> LookedUp: FromRow<'r, D::Row>,
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

    async fn earlier_lives(
        &self,
        tenant: &str,
        id: &OperationId,
        life: FencingToken,
    ) -> Result<Vec<Event>, StoreError> {
        // Before the first event of `life`: what `history` gives of earlier lives comes after.
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events \
             WHERE tenant = $1 AND operation_id = $2 AND life < $3 AND sequence < COALESCE(\
             (SELECT min(sequence) FROM events WHERE tenant = $1 AND operation_id = $2 \
             AND life = $3), sequence + 1) ORDER BY sequence DESC LIMIT $4"
        );
        let mut events: Vec<EventRow> = sqlx::query_as(&sql)
            .bind(tenant)
            .bind(id.as_str())
            .bind(rows::token_column(life))
            .bind(crate::backend::EARLIER_EVENTS)
            .fetch_all(&self.pool)
            .await?;
        events.reverse();
        rows::convert(events)
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
        // Each reconciler's lookups in the window, by what they found, timed from the claim
        // (`issued_at`) to the verdict's commit.
        let (found, issued) = (
            D::json_text("e.details", "found"),
            D::json_integer("e.details", "issued_at"),
        );
        let (mut sql, mut binds) = (String::new(), Binds::<D>::default());
        sql += &format!(
            "SELECT e.actor, e.kind, {found}, COUNT(*), CAST(AVG(e.at - {issued}) AS BIGINT), \
             MAX(e.at - {issued}) FROM events e WHERE {} \
             AND e.kind IN ('RECONCILED', 'LOOKUP_INCONCLUSIVE') AND e.actor LIKE 'reconciler:%' \
             GROUP BY e.actor, e.kind, {found}",
            binds.in_window(scope, window_ms)?
        );
        let looked: Vec<LookedUp> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        let lookups = looked
            .into_iter()
            .filter_map(|(actor, kind, found, count, mean_ms, max_ms)| {
                Some(LookupRow {
                    actor,
                    kind: EventKind::parse(&kind)?,
                    found,
                    count,
                    mean_ms,
                    max_ms,
                })
            })
            .collect();
        Ok(Stats::of(
            counts,
            ages.into_iter().map(|(age,)| age).collect(),
            resolved,
            events,
            lookups,
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

    async fn clock(&self) -> Result<Millis, StoreError> {
        let (now,): (i64,) = sqlx::query_as(&format!("SELECT {}", D::NOW))
            .fetch_one(&self.pool)
            .await?;
        Ok(now)
    }

    async fn ping(&self, probe: crate::Probe) -> Result<(), StoreError> {
        D::ping(&self.pool, probe).await
    }

    fn connection_lost(&self) {
        self.losses.noticed();
    }

    async fn close(&self) {
        self.batches.close().await;
        self.pool.close().await;
    }
}

/// One row of a window's lookups: reconciler actor, event kind, what it found, how many, and
/// the mean and longest time from claim to commit.
type LookedUp = (
    String,
    String,
    Option<String>,
    i64,
    Option<i64>,
    Option<i64>,
);

/// The store's clock read once for the whole statement. A condition on an indexed column
/// against it is an index range; against the clock itself (volatile in PostgreSQL) it is read
/// again for every row, so the condition is a filter over every row of the index or table, and
/// an idle sweep reads the whole table.
fn now_once<D: Dialect>() -> String {
    format!("(SELECT {})", D::NOW)
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
