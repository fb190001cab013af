//! What the background work reads and deletes: leases past their end, lookups due, settled
//! operations past retention, old events and duplicates.
//!
//! Each statement compares indexed columns with the store's clock read once per statement
//! (`(SELECT now)`): PostgreSQL's clock is volatile, and compared directly it is read again for
//! every row, which turns an idle sweep into a filter over the whole table. Old events and
//! duplicates are taken oldest first through their time index and deleted by primary key
//! ([`Dialect::one_of`]). Every condition is re-checked on the row a DELETE removes, so a row a
//! concurrent Begin just claimed again stays. `src/tests/plans.rs` checks the plan of every
//! statement here over tables of rows not due: an empty index range, no row read or filtered.

use once_core::reconcile::Lookup;
use once_core::{Millis, Operation, OperationId};
use sqlx::{ColumnIndex, Decode, Encode, Executor, FromRow, IntoArguments, Row, Transaction, Type};

use super::{now_once, Store};
use crate::backend::Sweeps;
use crate::rows::{self, KeyRow, OperationRow, OPERATION_COLUMNS};
use crate::{Dialect, StoreError};

/// Deletes up to `$2` rows of `table` recorded (`at`) at least `$1` ms ago, oldest first,
/// returning their `key`: a range of the table's time index, empty when nothing is that old.
fn delete_older_sql<D: Dialect>(table: &str, key: &str) -> String {
    // Events stay until the history's chain has linked them (see `once_core::chain`).
    let linked = if table == "events" {
        " AND sequence <= (SELECT through FROM chain_progress WHERE id = 1)"
    } else {
        ""
    };
    let oldest = format!(
        "SELECT {key} FROM {table} WHERE at <= {} - $1{linked} ORDER BY at LIMIT $2",
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

impl<D> Sweeps for Store<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> bool: Encode<'q, D> + Type<D>,
    for<'r> KeyRow: FromRow<'r, D::Row>,
    for<'r> OperationRow: FromRow<'r, D::Row>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'n> &'n str: ColumnIndex<D::Row>,
{
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
}
