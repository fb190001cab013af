//! SQL both backends share. The statements are written once, in the dialect SQLite and
//! PostgreSQL have in common (`$n` placeholders, `ON CONFLICT`, `RETURNING`, row values, integer
//! milliseconds), and instantiated for each backend by [`shared_backend_methods!`].

use once_core::{AttemptContext, Fingerprint, OperationId, Source, State};

use crate::StoreError;

/// Every column of `operations`, as [`decode_operation!`] reads them.
pub(crate) const OPERATION_COLUMNS: &str = "tenant, operation_id, tool, fingerprint, state, source, attempt, fencing_token, life, \
     attempt_id, client_name, session_id, request_id, executor, lease_started_at, lease_deadline, result, provider_ref, \
     provider_key, provider, lookup_hints, retention_ms, created_at, updated_at, expires_at, reason, unknown_since, \
     last_report_at, declared_absent_token, confirmed_by, reconcile_lookups, reconcile_next_at, lookup_claimed_until, version";

pub(crate) const INSERT_OPERATION: &str = "INSERT INTO operations (tenant, operation_id, tool, fingerprint, state, source, attempt, \
     fencing_token, life, attempt_id, client_name, session_id, request_id, executor, lease_started_at, lease_deadline, \
     result, provider_ref, provider_key, provider, lookup_hints, retention_ms, created_at, updated_at, expires_at, reason, \
     unknown_since, last_report_at, declared_absent_token, confirmed_by, reconcile_lookups, reconcile_next_at, \
     lookup_claimed_until) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, \
     $24, $25, $26, $27, $28, $29, $30, $31, $32, $33)";

pub(crate) const UPDATE_OPERATION: &str = "UPDATE operations SET tool = $3, fingerprint = $4, state = $5, source = $6, \
     attempt = $7, fencing_token = $8, life = $9, attempt_id = $10, client_name = $11, session_id = $12, request_id = $13, \
     executor = $14, lease_started_at = $15, lease_deadline = $16, result = $17, provider_ref = $18, provider_key = $19, \
     provider = $20, lookup_hints = $21, retention_ms = $22, created_at = $23, updated_at = $24, expires_at = $25, \
     reason = $26, unknown_since = $27, last_report_at = $28, declared_absent_token = $29, confirmed_by = $30, \
     reconcile_lookups = $31, reconcile_next_at = $32, lookup_claimed_until = $33, version = version + 1 \
     WHERE tenant = $1 AND operation_id = $2";

pub(crate) const INSERT_ATTEMPT: &str = "INSERT INTO attempts (tenant, operation_id, number, fencing_token, attempt_id, started_at, \
     lease_deadline, actor, client_name, session_id, request_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

pub(crate) const ATTEMPT_COLUMNS: &str =
    "number, fencing_token, attempt_id, started_at, lease_deadline, actor, client_name, \
     session_id, request_id";

/// Anomalies carry a dedupe key so a repeated cause is recorded once.
pub(crate) const INSERT_EVENT: &str = "INSERT INTO events (tenant, operation_id, life, at, kind, from_state, to_state, attempt, actor, \
     reason, details, dedupe_key) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT DO NOTHING";

/// The fresh-id guard: an open operation with the same intent under another id, UNKNOWN ones
/// first (they block whatever their lease says).
pub(crate) const FIND_BLOCKING: &str = "SELECT operation_id, state, attempt, lease_deadline, updated_at FROM operations \
     WHERE tenant = $1 AND tool = $2 AND fingerprint = $3 AND state IN ('UNKNOWN', 'IN_FLIGHT') AND operation_id <> $4 \
     ORDER BY state DESC, created_at LIMIT 1";

pub(crate) fn state(value: &str) -> Result<State, StoreError> {
    State::parse(value).ok_or_else(|| StoreError::Corrupt(format!("unknown state {value:?}")))
}

pub(crate) fn source(value: &str) -> Result<Source, StoreError> {
    Source::parse(value).ok_or_else(|| StoreError::Corrupt(format!("unknown source {value:?}")))
}

pub(crate) fn fingerprint(bytes: Vec<u8>) -> Result<Fingerprint, StoreError> {
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".to_owned()))?;
    Ok(Fingerprint(bytes))
}

pub(crate) fn operation_id(value: String) -> Result<OperationId, StoreError> {
    OperationId::parse("operation_id", &value).map_err(|e| StoreError::Corrupt(e.to_string()))
}

pub(crate) fn attempt_number(value: i64) -> Result<u32, StoreError> {
    u32::try_from(value)
        .map_err(|_| StoreError::Corrupt(format!("attempt number {value} out of range")))
}

pub(crate) fn token(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value)
        .map_err(|_| StoreError::Corrupt(format!("fencing token {value} out of range")))
}

/// A fencing token as the database stores it (BIGINT). Tokens come from the store's own
/// counter, so one that does not fit was never issued.
pub(crate) fn token_column(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

pub(crate) fn context(
    client_name: Option<String>,
    session_id: Option<String>,
    request_id: Option<String>,
) -> AttemptContext {
    AttemptContext {
        client_name,
        session_id,
        request_id,
    }
}

/// Binds the columns of an operation that a plan writes, in the order of [`INSERT_OPERATION`]
/// and [`UPDATE_OPERATION`]. `version` is not among them: every update bumps it in SQL.
macro_rules! bind_operation {
    ($query:expr, $op:expr) => {{
        let op: &once_core::Operation = $op;
        $query
            .bind(op.tenant.as_str())
            .bind(op.operation_id.as_str())
            .bind(op.tool.as_str())
            .bind(op.fingerprint.0.to_vec())
            .bind(op.state.as_str())
            .bind(op.source.as_str())
            .bind(i64::from(op.attempt))
            .bind($crate::shared::token_column(op.fencing_token))
            .bind($crate::shared::token_column(op.life))
            .bind(op.attempt_id.as_str())
            .bind(op.attempt_context.client_name.clone())
            .bind(op.attempt_context.session_id.clone())
            .bind(op.attempt_context.request_id.clone())
            .bind(op.executor.as_str())
            .bind(op.lease_started_at)
            .bind(op.lease_deadline)
            .bind(op.result.clone())
            .bind(op.provider_ref.clone())
            .bind(op.provider_key.as_str())
            .bind(op.provider.clone())
            .bind(op.lookup_hints.clone())
            .bind(op.retention_ms)
            .bind(op.created_at)
            .bind(op.updated_at)
            .bind(op.expires_at)
            .bind(op.reason.clone())
            .bind(op.unknown_since)
            .bind(op.last_report_at)
            .bind(op.declared_absent_token.map($crate::shared::token_column))
            .bind(op.confirmed_by.map($crate::shared::token_column))
            .bind(i64::from(op.reconcile_lookups))
            .bind(op.reconcile_next_at)
            .bind(op.lookup_claimed_until)
    }};
}

/// Reads an operation from a row holding [`OPERATION_COLUMNS`]; `None` when the row is the
/// empty side of an outer join.
macro_rules! decode_operation {
    ($row:expr) => {{
        use sqlx::Row as _;
        let row = $row;
        let tenant: Option<String> = row.try_get("tenant")?;
        match tenant {
            None => None,
            Some(tenant) => Some(once_core::Operation {
                tenant,
                operation_id: $crate::shared::operation_id(row.try_get("operation_id")?)?,
                tool: row.try_get("tool")?,
                fingerprint: $crate::shared::fingerprint(row.try_get("fingerprint")?)?,
                state: $crate::shared::state(row.try_get("state")?)?,
                source: $crate::shared::source(row.try_get("source")?)?,
                attempt: $crate::shared::attempt_number(row.try_get("attempt")?)?,
                fencing_token: $crate::shared::token(row.try_get("fencing_token")?)?,
                life: $crate::shared::token(row.try_get("life")?)?,
                attempt_id: row.try_get("attempt_id")?,
                attempt_context: $crate::shared::context(
                    row.try_get("client_name")?,
                    row.try_get("session_id")?,
                    row.try_get("request_id")?,
                ),
                executor: row.try_get("executor")?,
                lease_started_at: row.try_get("lease_started_at")?,
                lease_deadline: row.try_get("lease_deadline")?,
                result: row.try_get("result")?,
                provider_ref: row.try_get("provider_ref")?,
                provider_key: row.try_get("provider_key")?,
                provider: row.try_get("provider")?,
                lookup_hints: row.try_get("lookup_hints")?,
                retention_ms: row.try_get("retention_ms")?,
                created_at: row.try_get("created_at")?,
                updated_at: row.try_get("updated_at")?,
                expires_at: row.try_get("expires_at")?,
                reason: row.try_get("reason")?,
                version: row.try_get("version")?,
                unknown_since: row.try_get("unknown_since")?,
                last_report_at: row.try_get("last_report_at")?,
                declared_absent_token: row
                    .try_get::<Option<i64>, _>("declared_absent_token")?
                    .map($crate::shared::token)
                    .transpose()?,
                confirmed_by: row
                    .try_get::<Option<i64>, _>("confirmed_by")?
                    .map($crate::shared::token)
                    .transpose()?,
                reconcile_lookups: $crate::shared::attempt_number(
                    row.try_get("reconcile_lookups")?,
                )?,
                reconcile_next_at: row.try_get("reconcile_next_at")?,
                lookup_claimed_until: row.try_get("lookup_claimed_until")?,
            }),
        }
    }};
}

/// Reads an attempt from a row holding [`ATTEMPT_COLUMNS`].
macro_rules! decode_attempt {
    ($row:expr) => {{
        use sqlx::Row as _;
        let row = $row;
        once_core::Attempt {
            number: $crate::shared::attempt_number(row.try_get("number")?)?,
            fencing_token: $crate::shared::token(row.try_get("fencing_token")?)?,
            attempt_id: row.try_get("attempt_id")?,
            started_at: row.try_get("started_at")?,
            lease_deadline: row.try_get("lease_deadline")?,
            actor: row.try_get("actor")?,
            context: $crate::shared::context(
                row.try_get("client_name")?,
                row.try_get("session_id")?,
                row.try_get("request_id")?,
            ),
        }
    }};
}

/// The [`crate::Backend`] methods whose SQL is the same on every backend. `$db` is the sqlx
/// database type and `$now` the SQL expression for the store's clock in epoch milliseconds.
macro_rules! shared_backend_methods {
    ($db:ty, $now:expr) => {
        async fn find_blocking(
            &self,
            tx: &mut Self::Tx,
            cmd: &once_core::BeginCommand,
        ) -> Result<Option<once_core::Blocking>, $crate::StoreError> {
            use sqlx::Row as _;
            let row = sqlx::query($crate::shared::FIND_BLOCKING)
                .bind(cmd.tenant.as_str())
                .bind(cmd.tool.as_str())
                .bind(cmd.fingerprint.0.to_vec())
                .bind(cmd.operation_id.as_str())
                .fetch_optional(&mut **tx)
                .await?;
            let Some(row) = row else { return Ok(None) };
            Ok(Some(once_core::Blocking {
                operation_id: $crate::shared::operation_id(row.try_get("operation_id")?)?,
                state: $crate::shared::state(row.try_get("state")?)?,
                attempt: $crate::shared::attempt_number(row.try_get("attempt")?)?,
                lease_deadline: row.try_get("lease_deadline")?,
                updated_at: row.try_get("updated_at")?,
            }))
        }

        async fn attempt(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &once_core::OperationId,
            fencing_token: u64,
        ) -> Result<Option<once_core::Attempt>, $crate::StoreError> {
            let sql = format!(
                "SELECT {} FROM attempts WHERE tenant = $1 AND operation_id = $2 AND fencing_token = $3",
                $crate::shared::ATTEMPT_COLUMNS
            );
            let row = sqlx::query(&sql)
                .bind(tenant)
                .bind(id.as_str())
                .bind($crate::shared::token_column(fencing_token))
                .fetch_optional(&mut **tx)
                .await?;
            Ok(match row {
                Some(row) => Some(decode_attempt!(&row)),
                None => None,
            })
        }

        async fn find_resolution(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &once_core::OperationId,
            resolution_id: &str,
        ) -> Result<Option<once_core::PriorResolution>, $crate::StoreError> {
            let found: Option<(Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT to_state, details FROM events WHERE tenant = $1 AND operation_id = $2 AND dedupe_key = $3",
            )
            .bind(tenant)
            .bind(id.as_str())
            .bind(once_core::machine::resolution_key(resolution_id))
            .fetch_optional(&mut **tx)
            .await?;
            let Some((Some(to), details)) = found else { return Ok(None) };
            let state = $crate::shared::state(&to)?;
            Ok(Some(once_core::PriorResolution::from_event(state, details.as_deref())))
        }

        async fn apply(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &once_core::OperationId,
            plan: &once_core::Plan,
            now: once_core::Millis,
        ) -> Result<(), $crate::StoreError> {
            use once_core::machine::Write;
            match &plan.operation {
                None => {}
                Some(Write::Insert(op)) => {
                    bind_operation!(sqlx::query($crate::shared::INSERT_OPERATION), op)
                        .execute(&mut **tx)
                        .await?;
                }
                Some(Write::Update(op)) => {
                    let updated = bind_operation!(sqlx::query($crate::shared::UPDATE_OPERATION), op)
                        .execute(&mut **tx)
                        .await?;
                    if updated.rows_affected() != 1 {
                        return Err($crate::StoreError::NotFound);
                    }
                }
            }
            if plan.new_life {
                sqlx::query("DELETE FROM attempts WHERE tenant = $1 AND operation_id = $2")
                    .bind(tenant)
                    .bind(id.as_str())
                    .execute(&mut **tx)
                    .await?;
            }
            if let Some(attempt) = &plan.attempt {
                sqlx::query($crate::shared::INSERT_ATTEMPT)
                    .bind(tenant)
                    .bind(id.as_str())
                    .bind(i64::from(attempt.number))
                    .bind($crate::shared::token_column(attempt.fencing_token))
                    .bind(attempt.attempt_id.as_str())
                    .bind(attempt.started_at)
                    .bind(attempt.lease_deadline)
                    .bind(attempt.actor.as_str())
                    .bind(attempt.context.client_name.clone())
                    .bind(attempt.context.session_id.clone())
                    .bind(attempt.context.request_id.clone())
                    .execute(&mut **tx)
                    .await?;
            }
            for event in &plan.events {
                sqlx::query($crate::shared::INSERT_EVENT)
                    .bind(tenant)
                    .bind(id.as_str())
                    .bind($crate::shared::token_column(event.life))
                    .bind(now)
                    .bind(event.kind.as_str())
                    .bind(event.from.map(|s| s.as_str()))
                    .bind(event.to.map(|s| s.as_str()))
                    .bind(event.attempt.map(i64::from))
                    .bind(event.actor.as_str())
                    .bind(event.reason.clone())
                    .bind(event.details.clone())
                    .bind(event.dedupe_key.clone())
                    .execute(&mut **tx)
                    .await?;
            }
            Ok(())
        }

        async fn history(
            &self,
            tenant: &str,
            id: &once_core::OperationId,
            life: u64,
        ) -> Result<(Vec<once_core::Attempt>, Vec<once_core::Event>), $crate::StoreError> {
            use sqlx::Row as _;
            let sql = format!(
                "SELECT {} FROM attempts WHERE tenant = $1 AND operation_id = $2 ORDER BY number",
                $crate::shared::ATTEMPT_COLUMNS
            );
            let rows = sqlx::query(&sql)
                .bind(tenant)
                .bind(id.as_str())
                .fetch_all(&self.pool)
                .await?;
            let mut attempts = Vec::with_capacity(rows.len());
            for row in &rows {
                attempts.push(decode_attempt!(row));
            }
            let rows = sqlx::query(
                "SELECT sequence, at, kind, from_state, to_state, attempt, actor, reason, details \
                 FROM events WHERE tenant = $1 AND operation_id = $2 AND life = $3 ORDER BY sequence",
            )
            .bind(tenant)
            .bind(id.as_str())
            .bind($crate::shared::token_column(life))
            .fetch_all(&self.pool)
            .await?;
            let mut events = Vec::with_capacity(rows.len());
            for row in rows {
                let from: Option<String> = row.try_get("from_state")?;
                let to: Option<String> = row.try_get("to_state")?;
                let attempt: Option<i64> = row.try_get("attempt")?;
                events.push(once_core::Event {
                    sequence: row.try_get("sequence")?,
                    at: row.try_get("at")?,
                    kind: row.try_get("kind")?,
                    from: from.as_deref().map($crate::shared::state).transpose()?,
                    to: to.as_deref().map($crate::shared::state).transpose()?,
                    attempt: attempt.map($crate::shared::attempt_number).transpose()?,
                    actor: row.try_get("actor")?,
                    reason: row.try_get("reason")?,
                    details: row.try_get("details")?,
                });
            }
            Ok((attempts, events))
        }

        async fn list(
            &self,
            tenant: &str,
            query: &once_core::ListQuery,
        ) -> Result<Vec<once_core::Operation>, $crate::StoreError> {
            let mut sql = sqlx::QueryBuilder::<$db>::new("SELECT ");
            // A page carries no results: GetOperation has them.
            sql.push($crate::shared::OPERATION_COLUMNS.replacen(" result,", " NULL AS result,", 1));
            sql.push(" FROM operations WHERE tenant = ").push_bind(tenant);
            if !query.states.is_empty() {
                sql.push(" AND state IN (");
                let mut states = sql.separated(", ");
                for state in &query.states {
                    states.push_bind(state.as_str());
                }
                sql.push(")");
            }
            if let Some(tool) = &query.tool {
                sql.push(" AND tool = ").push_bind(tool.as_str());
            }
            if let Some(age) = query.older_than_ms {
                sql.push(" AND created_at <= ").push($now).push(" - ").push_bind(age);
            }
            if let Some((created_at, id)) = &query.after {
                sql.push(" AND (created_at, operation_id) > (")
                    .push_bind(*created_at)
                    .push(", ")
                    .push_bind(id.as_str())
                    .push(")");
            }
            sql.push(" ORDER BY created_at, operation_id LIMIT ").push_bind(i64::from(query.page_size));
            let rows = sql.build().fetch_all(&self.pool).await?;
            let mut operations = Vec::with_capacity(rows.len());
            for row in &rows {
                operations.extend(decode_operation!(row));
            }
            Ok(operations)
        }

        async fn expired_leases(&self, limit: u32) -> Result<Vec<(String, once_core::OperationId)>, $crate::StoreError> {
            let rows: Vec<(String, String)> = sqlx::query_as(concat!(
                "SELECT tenant, operation_id FROM operations WHERE state = 'IN_FLIGHT' AND lease_deadline <= ",
                $now,
                " ORDER BY lease_deadline LIMIT $1"
            ))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
            rows.into_iter()
                .map(|(tenant, id)| Ok((tenant, $crate::shared::operation_id(id)?)))
                .collect()
        }

        async fn due_lookups(&self, limit: u32, providers: &[&str]) -> Result<Vec<(String, once_core::OperationId)>, $crate::StoreError> {
            if providers.is_empty() {
                return Ok(Vec::new());
            }
            let mut sql = sqlx::QueryBuilder::<$db>::new(concat!(
                "SELECT tenant, operation_id FROM operations WHERE state = 'UNKNOWN' AND provider IS NOT NULL \
                 AND reconcile_next_at <= ",
                $now,
                " AND (lookup_claimed_until IS NULL OR lookup_claimed_until <= ",
                $now,
                ") AND provider IN ("
            ));
            let mut names = sql.separated(", ");
            for provider in providers {
                names.push_bind(*provider);
            }
            sql.push(") ORDER BY reconcile_next_at LIMIT ").push_bind(i64::from(limit));
            let due: Vec<(String, String)> = sql.build_query_as().fetch_all(&self.pool).await?;
            due.into_iter()
                .map(|(tenant, id)| Ok((tenant, $crate::shared::operation_id(id)?)))
                .collect()
        }

        async fn claim_lookup(
            &self,
            tenant: &str,
            id: &once_core::OperationId,
            claim_ms: i64,
            before_due: bool,
        ) -> Result<Option<(once_core::Operation, once_core::reconcile::Lookup)>, $crate::StoreError> {
            use sqlx::Row as _;
            // The conditional UPDATE is the claim: one caller moves the claim forward, every
            // other sees it held until it lapses. The version it bumps makes any lookup claimed
            // before stale, and the row it returns is the snapshot this lookup judges.
            let sql = format!(
                concat!(
                    "UPDATE operations SET lookup_claimed_until = ",
                    $now,
                    " + $3, version = version + 1 \
                     WHERE tenant = $1 AND operation_id = $2 AND state = 'UNKNOWN' AND provider IS NOT NULL \
                     AND source <> 'anomaly' AND (lookup_claimed_until IS NULL OR lookup_claimed_until <= ",
                    $now,
                    ") AND ($4 OR reconcile_next_at <= ",
                    $now,
                    ") RETURNING {}, ",
                    $now,
                    " AS issued_at"
                ),
                $crate::shared::OPERATION_COLUMNS
            );
            let row = sqlx::query(&sql)
                .bind(tenant)
                .bind(id.as_str())
                .bind(claim_ms)
                .bind(before_due)
                .fetch_optional(&self.pool)
                .await?;
            let Some(row) = row else { return Ok(None) };
            let issued_at: once_core::Millis = row.try_get("issued_at")?;
            Ok(decode_operation!(&row).map(|op| {
                let lookup = once_core::reconcile::Lookup::of(&op, issued_at);
                (op, lookup)
            }))
        }

        async fn delete_expired(&self, limit: u32) -> Result<u64, $crate::StoreError> {
            // The state and expiry conditions are repeated on the outer DELETE so that a row a
            // concurrent Begin just claimed again is re-checked and kept.
            let deleted = sqlx::query(concat!(
                "DELETE FROM operations WHERE state IN ('CONFIRMED', 'ABSENT') AND expires_at <= ",
                $now,
                " AND (tenant, operation_id) IN (SELECT tenant, operation_id FROM operations \
                 WHERE state IN ('CONFIRMED', 'ABSENT') AND expires_at <= ",
                $now,
                " ORDER BY expires_at LIMIT $1)"
            ))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
            Ok(deleted.rows_affected())
        }

        async fn delete_events_older_than(&self, age_ms: i64, limit: u32) -> Result<u64, $crate::StoreError> {
            let deleted = sqlx::query(concat!(
                "DELETE FROM events WHERE sequence IN (SELECT sequence FROM events WHERE at <= ",
                $now,
                " - $1 ORDER BY sequence LIMIT $2)"
            ))
            .bind(age_ms)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
            Ok(deleted.rows_affected())
        }

        async fn commit(&self, tx: Self::Tx) -> Result<(), $crate::StoreError> {
            tx.commit().await?;
            Ok(())
        }

        async fn close(&self) {
            self.pool.close().await;
        }
    };
}

pub(crate) use {bind_operation, decode_attempt, decode_operation, shared_backend_methods};
