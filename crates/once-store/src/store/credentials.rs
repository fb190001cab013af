//! Tenants and credentials as stored: created, listed, revoked, and read again by admission
//! from a watermark. Every credential or tenant change advances one counter
//! (`credential_clock`) in its own transaction and stamps its row, so changes commit in version
//! order and one statement's snapshot holds every change through the highest version it shows.

use once_core::access::{Credential, NewCredential, Tenant};
use sqlx::{Decode, Encode, Executor, FromRow, IntoArguments, Transaction, Type};

use super::Store;
use crate::backend::Credentials;
use crate::rows::{
    self, CredentialRow, KnownCredentialRow, TenantRow, CREDENTIAL_COLUMNS, TENANT_COLUMNS,
};
use crate::{CredentialChanges, Dialect, StoreError};

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

impl<D> Credentials for Store<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'q> Option<i64>: Encode<'q, D> + Type<D>,
    for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
    for<'q> &'q [u8]: Encode<'q, D> + Type<D>,
    for<'q> String: Encode<'q, D> + Type<D>,
    for<'r> TenantRow: FromRow<'r, D::Row>,
    for<'r> CredentialRow: FromRow<'r, D::Row>,
    for<'r> KnownCredentialRow: FromRow<'r, D::Row>,
    for<'r> (i64,): FromRow<'r, D::Row>,
{
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
}
