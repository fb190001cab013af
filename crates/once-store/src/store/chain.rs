//! What the history's chain reads and writes (see `once_core::chain`): the events to link,
//! with the results they recorded, each tenant's links, how far the history is linked, and the
//! latest verification of each tenant.

use once_core::chain::{Link, Recorded, Stored};
use sqlx::{Decode, Encode, Executor, FromRow, IntoArguments, Type};

use super::Store;
use crate::backend::sealed::Transactions as _;
use crate::backend::{Chain, Checked, Verification};
use crate::{Dialect, StoreError};

/// An event as stored, with the result of its operation's row of that life, when the event
/// left the operation CONFIRMED.
#[derive(sqlx::FromRow)]
pub(crate) struct ChainedRow {
    sequence: i64,
    tenant: String,
    operation_id: String,
    life: i64,
    at: i64,
    kind: String,
    from_state: Option<String>,
    to_state: Option<String>,
    state: Option<String>,
    tool: Option<String>,
    attempt: Option<i64>,
    actor: String,
    reason: Option<String>,
    details: Option<String>,
    dedupe_key: Option<String>,
    result: Option<Vec<u8>>,
    provider_ref: Option<String>,
    /// Whether a row of the event's life, CONFIRMED after it, was found.
    joined: bool,
}

type Chained = Stored;

impl From<ChainedRow> for Chained {
    fn from(row: ChainedRow) -> Self {
        let result = row
            .joined
            .then(|| (row.result.unwrap_or_default(), row.provider_ref));
        let recorded = Recorded {
            sequence: row.sequence,
            tenant: row.tenant,
            operation_id: row.operation_id,
            life: row.life,
            at: row.at,
            kind: row.kind,
            from_state: row.from_state,
            to_state: row.to_state,
            state: row.state,
            tool: row.tool,
            attempt: row.attempt,
            actor: row.actor,
            reason: row.reason,
            details: row.details,
            dedupe_key: row.dedupe_key,
        };
        (recorded, result)
    }
}

/// The events of a range (`$1` < sequence ≤ `$2`), each with the result its operation's row of
/// that life holds when the event left it CONFIRMED; `tenant` narrows to one tenant (`$4`).
fn chained_sql(tenant: bool) -> String {
    format!(
        "SELECT e.sequence, e.tenant, e.operation_id, e.life, e.at, e.kind, e.from_state, \
         e.to_state, e.state, e.tool, e.attempt, e.actor, e.reason, e.details, e.dedupe_key, \
         o.result, o.provider_ref, o.tenant IS NOT NULL AS joined \
         FROM events e LEFT JOIN operations o ON e.state = 'CONFIRMED' AND o.tenant = e.tenant \
         AND o.operation_id = e.operation_id AND o.life = e.life \
         WHERE e.sequence > $1 AND e.sequence <= $2 {} ORDER BY e.sequence LIMIT $3",
        if tenant { "AND e.tenant = $4" } else { "" }
    )
}

const LINK_COLUMNS: &str = "tenant, number, starts_after, through, entries, previous, hash, at";

type LinkRow = (String, i64, i64, i64, String, String, String, i64);

fn link((tenant, number, after, through, entries, previous, hash, at): LinkRow) -> Link {
    Link {
        tenant,
        number,
        after,
        through,
        entries,
        previous,
        hash,
        at,
    }
}

type VerificationRow = (String, i64, i64, i64, i64, Option<String>);

impl<D> Chain for Store<D>
where
    D: Dialect,
    Store<D>: crate::backend::sealed::Transactions<Tx = sqlx::Transaction<'static, D>>,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
    for<'q> String: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'r> ChainedRow: FromRow<'r, D::Row>,
    for<'r> LinkRow: FromRow<'r, D::Row>,
    for<'r> VerificationRow: FromRow<'r, D::Row>,
    for<'r> (String, String, i64, Option<String>): FromRow<'r, D::Row>,
{
    async fn chained_through(&self) -> Result<i64, StoreError> {
        let (through,): (i64,) = sqlx::query_as("SELECT through FROM chain_progress WHERE id = 1")
            .fetch_one(&self.pool)
            .await?;
        Ok(through)
    }

    async fn chainable(
        &self,
        (after, upto): (i64, i64),
        limit: u32,
    ) -> Result<Vec<Chained>, StoreError> {
        let rows: Vec<ChainedRow> = sqlx::query_as(&chained_sql(false))
            .bind(after)
            .bind(upto)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().map(Chained::from).collect())
    }

    async fn tenant_events(
        &self,
        tenant: &str,
        (after, through): (i64, i64),
        limit: u32,
    ) -> Result<Vec<Chained>, StoreError> {
        let rows: Vec<ChainedRow> = sqlx::query_as(&chained_sql(true))
            .bind(after)
            .bind(through)
            .bind(i64::from(limit))
            .bind(tenant)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().map(Chained::from).collect())
    }

    async fn last_link(&self, tenant: &str) -> Result<Option<Link>, StoreError> {
        let row: Option<LinkRow> = sqlx::query_as(&format!(
            "SELECT {LINK_COLUMNS} FROM chain_links WHERE tenant = $1 \
             ORDER BY number DESC LIMIT 1"
        ))
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(link))
    }

    async fn append_links(
        &self,
        (from, to): (i64, i64),
        links: &[Link],
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let moved =
            sqlx::query("UPDATE chain_progress SET through = $2 WHERE id = 1 AND through = $1")
                .bind(from)
                .bind(to)
                .execute(&mut *tx)
                .await?;
        if D::rows_affected(&moved) == 0 {
            // Another replica linked this range first.
            return Ok(false);
        }
        for l in links {
            sqlx::query(&format!(
                "INSERT INTO chain_links ({LINK_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
            ))
            .bind(l.tenant.as_str())
            .bind(l.number)
            .bind(l.after)
            .bind(l.through)
            .bind(l.entries.as_str())
            .bind(l.previous.as_str())
            .bind(l.hash.as_str())
            .bind(l.at)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn links(&self, tenant: &str, after: i64, limit: u32) -> Result<Vec<Link>, StoreError> {
        let rows: Vec<LinkRow> = sqlx::query_as(&format!(
            "SELECT {LINK_COLUMNS} FROM chain_links WHERE tenant = $1 AND through > $2 \
             ORDER BY number LIMIT $3"
        ))
        .bind(tenant)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(link).collect())
    }

    async fn link_before(&self, tenant: &str, number: i64) -> Result<Option<Link>, StoreError> {
        let row: Option<LinkRow> = sqlx::query_as(&format!(
            "SELECT {LINK_COLUMNS} FROM chain_links WHERE tenant = $1 AND number = $2"
        ))
        .bind(tenant)
        .bind(number - 1)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(link))
    }

    async fn states(
        &self,
        tenant: &str,
        through: i64,
        (after, limit): (&str, u32),
    ) -> Result<Vec<Checked>, StoreError> {
        // Each operation (by id, from `after`) with its state and its latest event's, where
        // that event is linked.
        let rows: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(
            "SELECT o.operation_id, o.state, e.sequence, e.state FROM operations o \
             JOIN events e ON e.sequence = (SELECT max(x.sequence) FROM events x \
             WHERE x.tenant = o.tenant AND x.operation_id = o.operation_id AND x.life = o.life) \
             WHERE o.tenant = $1 AND o.operation_id > $2 AND e.sequence <= $3 \
             ORDER BY o.operation_id LIMIT $4",
        )
        .bind(tenant)
        .bind(after)
        .bind(through)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(operation_id, stored, sequence, recorded)| Checked {
                operation_id,
                stored,
                sequence,
                recorded,
            })
            .collect())
    }

    async fn record_verification(&self, verification: &Verification) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO chain_verifications (tenant, at, through, links, events, problem) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant) DO UPDATE SET at = $2, \
             through = $3, links = $4, events = $5, problem = $6",
        )
        .bind(verification.tenant.as_str())
        .bind(verification.at)
        .bind(verification.through)
        .bind(verification.links)
        .bind(verification.events)
        .bind(verification.problem.as_deref())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn verification(&self, tenant: &str) -> Result<Option<Verification>, StoreError> {
        let row: Option<VerificationRow> = sqlx::query_as(
            "SELECT tenant, at, through, links, events, problem FROM chain_verifications \
             WHERE tenant = $1",
        )
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(verification))
    }

    async fn verifications(&self) -> Result<Vec<Verification>, StoreError> {
        let rows: Vec<VerificationRow> = sqlx::query_as(
            "SELECT tenant, at, through, links, events, problem FROM chain_verifications \
             ORDER BY tenant",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(verification).collect())
    }

    async fn delete_links_through(&self, deleted_through: i64) -> Result<u64, StoreError> {
        // Links every event of which retention deleted, but each tenant's newest such link: the
        // anchor the rest of its chain is checked from.
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "DELETE FROM chain_links WHERE through <= $1 AND number < \
             (SELECT max(k.number) FROM chain_links k WHERE k.tenant = chain_links.tenant \
             AND k.through <= $1)",
        )
        .bind(deleted_through)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(D::rows_affected(&done))
    }
}

fn verification((tenant, at, through, links, events, problem): VerificationRow) -> Verification {
    Verification {
        tenant,
        at,
        through,
        links,
        events,
        problem,
    }
}
