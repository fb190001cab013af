//! The Begins answered without a new execution right, kept beside the ledger for forensics:
//! recorded many at a time in one statement, read per operation since its life began or per
//! tenant over a window.

use once_core::forensics::Duplicate;
use once_core::{Millis, OperationId};
use sqlx::{Decode, Encode, Executor, FromRow, IntoArguments, Type};

use super::{Binds, Store};
use crate::backend::Forensics;
use crate::rows::{self, DuplicateRow, DUPLICATE_COLUMNS};
use crate::{Dialect, StoreError};

impl<D> Forensics for Store<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> String: Encode<'q, D> + Type<D>,
    for<'r> DuplicateRow: FromRow<'r, D::Row>,
{
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
}
