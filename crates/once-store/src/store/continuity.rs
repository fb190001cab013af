//! What continuity reads and writes (see `once_core::continuity`): the ledger's identity, the
//! highest token issued, a claim in the history, and each tenant's epoch, hold and accepted
//! losses.

use once_core::continuity::{Accepted, Behind, Held, Standing, Why};
use once_core::{Actor, FencingToken, Millis, OperationId};
use sqlx::{Decode, Encode, Executor, FromRow, IntoArguments, Type};

use super::Store;
use crate::backend::sealed::Transactions as _;
use crate::backend::Continuity;
use crate::rows;
use crate::{Dialect, StoreError};

/// A hold's columns, in `continuity` and `continuity_accepts` alike.
const HOLD_COLUMNS: &str =
    "held_since, why, client_epoch, client_token, operation_id, ledger_epoch, ledger_token";

/// A hold as stored: every column NULL when there is none.
type HoldRow = (
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

fn held(row: HoldRow) -> Result<Option<Held>, StoreError> {
    let (since, why, client_epoch, client_token, operation_id, ledger_epoch, ledger_token) = row;
    let Some(since) = since else { return Ok(None) };
    let corrupt = || StoreError::Corrupt("a continuity hold with a column missing".into());
    let number = |value: Option<i64>| {
        value
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(corrupt)
    };
    Ok(Some(Held {
        since,
        behind: Behind {
            why: why.as_deref().and_then(Why::parse).ok_or_else(corrupt)?,
            client_epoch: number(client_epoch)?,
            client_token: FencingToken(number(client_token)?),
            operation_id: OperationId::parse("operation_id", &operation_id.ok_or_else(corrupt)?)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            ledger_epoch: number(ledger_epoch)?,
            ledger_token: FencingToken(number(ledger_token)?),
        },
    }))
}

fn epoch_column(epoch: u64) -> i64 {
    i64::try_from(epoch).unwrap_or(i64::MAX)
}

fn epoch(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("epoch {value} out of range")))
}

impl<D> Continuity for Store<D>
where
    D: Dialect,
    Store<D>: crate::backend::sealed::Transactions<Tx = sqlx::Transaction<'static, D>>,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
    for<'q> String: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> bool: Encode<'q, D> + Type<D>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'r> (String, String): FromRow<'r, D::Row>,
    for<'r> (String,): FromRow<'r, D::Row>,
    for<'r> StandingRow: FromRow<'r, D::Row>,
    for<'r> AcceptedRow: FromRow<'r, D::Row>,
{
    async fn identity(&self, made: (&str, [u8; 32])) -> Result<(String, [u8; 32]), StoreError> {
        let now = D::NOW;
        sqlx::query(&format!(
            "INSERT INTO ledger_identity (id, ledger, seal_key, created_at) \
             VALUES (1, $1, $2, {now}) ON CONFLICT (id) DO NOTHING"
        ))
        .bind(made.0)
        .bind(hex::encode(made.1))
        .execute(&self.pool)
        .await?;
        let (ledger, key): (String, String) =
            sqlx::query_as("SELECT ledger, seal_key FROM ledger_identity WHERE id = 1")
                .fetch_one(&self.pool)
                .await?;
        let key = hex::decode(&key)
            .ok()
            .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
            .ok_or_else(|| {
                StoreError::Corrupt("the ledger's sealing key is not 32 bytes".into())
            })?;
        Ok((ledger, key))
    }

    async fn issued_through(&self) -> Result<FencingToken, StoreError> {
        let (last,): (i64,) = sqlx::query_as(D::ISSUED_THROUGH)
            .fetch_one(&self.pool)
            .await?;
        rows::token(last)
    }

    async fn claim_recorded(
        &self,
        tenant: &str,
        id: &OperationId,
        (life, attempt): (FencingToken, u32),
    ) -> Result<bool, StoreError> {
        let found: Option<(i64,)> = sqlx::query_as(
            "SELECT sequence FROM events WHERE tenant = $1 AND operation_id = $2 AND life = $3 \
             AND kind IN ('CLAIMED', 'RECOVERED') AND attempt = $4 LIMIT 1",
        )
        .bind(tenant)
        .bind(id.as_str())
        .bind(rows::token_column(life))
        .bind(i64::from(attempt))
        .fetch_optional(&self.pool)
        .await?;
        Ok(found.is_some())
    }

    async fn life_recorded(
        &self,
        tenant: &str,
        id: &OperationId,
        life: FencingToken,
    ) -> Result<bool, StoreError> {
        let found: Option<(i64,)> = sqlx::query_as(
            "SELECT sequence FROM events WHERE tenant = $1 AND operation_id = $2 AND life = $3 \
             LIMIT 1",
        )
        .bind(tenant)
        .bind(id.as_str())
        .bind(rows::token_column(life))
        .fetch_optional(&self.pool)
        .await?;
        Ok(found.is_some())
    }

    async fn standings(&self) -> Result<Vec<Standing>, StoreError> {
        let rows: Vec<StandingRow> = sqlx::query_as(&format!(
            "SELECT tenant, epoch, {HOLD_COLUMNS} FROM continuity ORDER BY tenant"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(tenant, e, a, b, c, d, f, g, h)| {
                Ok(Standing {
                    tenant,
                    epoch: epoch(e)?,
                    held: held((a, b, c, d, f, g, h))?,
                })
            })
            .collect()
    }

    async fn hold(&self, tenant: &str, behind: &Behind) -> Result<Standing, StoreError> {
        let now = D::NOW;
        let mut tx = self.begin_write().await?;
        // A hold is written only over the epoch it was judged in, and never over another hold:
        // the first one found stays, with what showed it.
        sqlx::query(&format!(
            "INSERT INTO continuity (tenant, epoch, {HOLD_COLUMNS}) \
             VALUES ($1, $2, {now}, $3, $4, $5, $6, $2, $7) \
             ON CONFLICT (tenant) DO UPDATE SET held_since = {now}, why = $3, \
             client_epoch = $4, client_token = $5, operation_id = $6, ledger_epoch = $2, \
             ledger_token = $7 \
             WHERE continuity.held_since IS NULL AND continuity.epoch = $2"
        ))
        .bind(tenant)
        .bind(epoch_column(behind.ledger_epoch))
        .bind(behind.why.as_str())
        .bind(epoch_column(behind.client_epoch))
        .bind(rows::token_column(behind.client_token))
        .bind(behind.operation_id.as_str())
        .bind(rows::token_column(behind.ledger_token))
        .execute(&mut *tx)
        .await?;
        self.raise_tokens(&mut tx, behind.client_token).await?;
        tx.commit().await?;
        let standing = self
            .standings()
            .await?
            .into_iter()
            .find(|s| s.tenant == tenant);
        standing.ok_or_else(|| StoreError::Corrupt("a hold that was not stored".into()))
    }

    async fn accept(
        &self,
        tenant: Option<&str>,
        actor: &Actor,
        reason: &str,
    ) -> Result<Vec<Accepted>, StoreError> {
        let now = D::NOW;
        let mut tx = self.begin_write().await?;
        if let Some(tenant) = tenant {
            // A tenant accepted by name opens its next epoch whether or not it is held (an
            // operator who knows the ledger was restored need not wait for a client to show it).
            sqlx::query("INSERT INTO continuity (tenant, epoch) VALUES ($1, 0) ON CONFLICT (tenant) DO NOTHING")
                .bind(tenant)
                .execute(&mut *tx)
                .await?;
        }
        // The tenants accepted, locked until the transaction ends: a hold written meanwhile
        // waits for it, and is then a hold of the next epoch, which no one has accepted.
        let chosen: Vec<(String,)> = sqlx::query_as(&format!(
            "SELECT tenant FROM continuity \
             WHERE ($1 AND tenant = $2) OR (NOT $1 AND held_since IS NOT NULL) \
             ORDER BY tenant{}",
            D::ROW_LOCK
        ))
        .bind(tenant.is_some())
        .bind(tenant.unwrap_or_default())
        .fetch_all(&mut *tx)
        .await?;
        let mut accepted: Vec<AcceptedRow> = Vec::with_capacity(chosen.len());
        for (tenant,) in chosen {
            let row = sqlx::query_as(&format!(
                "INSERT INTO continuity_accepts (tenant, at, actor, reason, epoch, {HOLD_COLUMNS}) \
                 SELECT tenant, {now}, $1, $2, epoch + 1, {HOLD_COLUMNS} FROM continuity \
                 WHERE tenant = $3 \
                 RETURNING tenant, epoch, at, actor, reason, {HOLD_COLUMNS}"
            ))
            .bind(actor.to_string())
            .bind(reason)
            .bind(&tenant)
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE continuity SET epoch = epoch + 1, held_since = NULL, why = NULL, \
                 client_epoch = NULL, client_token = NULL, operation_id = NULL, \
                 ledger_epoch = NULL, ledger_token = NULL WHERE tenant = $1",
            )
            .bind(&tenant)
            .execute(&mut *tx)
            .await?;
            accepted.push(row);
        }
        tx.commit().await?;
        accepted.into_iter().map(accepted_row).collect()
    }

    async fn acceptances(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Accepted>, StoreError> {
        let rows = sqlx::query_as(&format!(
            "SELECT tenant, epoch, at, actor, reason, {HOLD_COLUMNS} FROM continuity_accepts \
             WHERE NOT $1 OR tenant = $2 ORDER BY id DESC LIMIT $3"
        ))
        .bind(tenant.is_some())
        .bind(tenant.unwrap_or_default())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(accepted_row).collect()
    }
}

/// A tenant's row of `continuity`.
type StandingRow = (
    String,
    i64,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

/// A row of `continuity_accepts`.
type AcceptedRow = (
    String,
    i64,
    Millis,
    String,
    String,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

fn accepted_row(row: AcceptedRow) -> Result<Accepted, StoreError> {
    let (tenant, e, at, actor, reason, a, b, c, d, f, g, h) = row;
    Ok(Accepted {
        tenant,
        epoch: epoch(e)?,
        at,
        actor: actor.parse().map_err(StoreError::Corrupt)?,
        reason,
        held: held((a, b, c, d, f, g, h))?,
    })
}
