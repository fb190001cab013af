//! The transaction primitives the `Ledger`'s template runs (`backend::sealed::Transactions`):
//! lock or read an operation with the store's clock, the fresh-id guard, a token, an attempt's
//! record, a resolution's event, applying a plan, commit and savepoints.

use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use once_core::machine::{self, FreshIdGuard, Write};
use once_core::{
    Attempt, BeginCommand, FencingToken, Millis, Operation, OperationId, Plan, PriorResolution,
};
use sqlx::{
    ColumnIndex, Database, Decode, Either, Encode, Executor, FromRow, IntoArguments, Row,
    Transaction, Type,
};

use super::{listed, Call, Store};
use crate::backend::sealed::Transactions;
use crate::rows::{
    self, AttemptRow, BlockingRow, Clocked, EventRow, KeyRow, One, OperationRow, INSERT_ATTEMPT,
    INSERT_EVENT, INSERT_OPERATION, UPDATE_OPERATION,
};
use crate::Decision;
use crate::{Dialect, StoreError};

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
    let clear = D::clear_token().map(|sql| {
        (
            "fresh-id guard taking a token",
            sql.to_owned(),
            CallBinds::Intent,
        )
    });
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
    listed.extend(clear);
    listed
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
    type Conn = Call<D>;

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
        // Where the lanes are, a call begun while others are under way reads and writes there.
        let (under_way, alone) = match D::UNLOCKED_WRITES {
            true => {
                let (under_way, alone) = crate::postgres::UnderWay::begun(&self.batches);
                (Some(under_way), alone)
            }
            false => (None, true),
        };
        if !alone {
            let call = Call {
                pooled: None,
                read_waited: Duration::ZERO,
                _under_way: under_way,
            };
            return Ok((call, Duration::ZERO));
        }
        let asked = Instant::now();
        let conn = self.pool.acquire().await?;
        let call = Call {
            pooled: Some(conn),
            read_waited: Duration::ZERO,
            _under_way: under_way,
        };
        Ok((call, asked.elapsed()))
    }

    async fn read_held(
        &self,
        conn: &mut Self::Conn,
        tenant: &str,
        id: &OperationId,
    ) -> Result<Clocked, StoreError> {
        let Some(pooled) = &mut conn.pooled else {
            let (op, now, _) = read_with_others(self, conn, tenant, id, false).await?;
            return Ok((op, now));
        };
        let row = by_operation::<D>(&mut **pooled, &D::statements().read, tenant, id).await?;
        clocked(&row)
    }

    async fn read_claimable(
        &self,
        conn: &mut Self::Conn,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis, Option<FencingToken>), StoreError> {
        let Some(pooled) = &mut conn.pooled else {
            return read_with_others(self, conn, tenant, id, true).await;
        };
        let statement = &D::statements().read_claimable;
        let row = by_operation::<D>(&mut **pooled, statement, tenant, id).await?;
        let (op, now) = clocked(&row)?;
        let token: Option<i64> = row.try_get("fresh_token")?;
        Ok((op, now, token.map(rows::token).transpose()?))
    }

    fn writes_unlocked(&self) -> bool {
        D::UNLOCKED_WRITES
    }

    fn read_waited(&self, conn: &Self::Conn) -> Duration {
        conn.read_waited
    }

    async fn apply_unlocked(
        &self,
        conn: Self::Conn,
        decision: Decision<'_>,
    ) -> Result<Option<crate::Unlocked>, StoreError> {
        D::apply_unlocked(self, conn, decision).await
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
        if let Some(sql) = D::clear_token() {
            let clear: Option<(i64,)> = rows::bind_intent(sqlx::query_as(sql), cmd)
                .fetch_optional(&mut **tx)
                .await?;
            if let Some((token,)) = clear {
                return Ok(FreshIdGuard::Clear {
                    token: rows::token(token)?,
                });
            }
        }
        if let Some(blocking) = D::blocking(&mut **tx, cmd).await? {
            return Ok(FreshIdGuard::Blocked(blocking));
        }
        let token = self.next_token(tx).await?;
        Ok(FreshIdGuard::Clear { token })
    }

    async fn raise_tokens(&self, tx: &mut Self::Tx, seen: FencingToken) -> Result<(), StoreError> {
        if let Some(raising) = D::RAISING {
            sqlx::query(raising).execute(&mut **tx).await?;
        }
        // A token that high was never issued: it is kept where raising past it cannot overflow.
        let seen = rows::token_column(seen).min(i64::MAX >> 1);
        sqlx::query(D::RAISE_TOKENS)
            .bind(seen)
            .execute(&mut **tx)
            .await?;
        Ok(())
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
        // Where the driver takes a list of statements, all of them in one round trip, sharing
        // one list of values: the row's (its key `$1` and `$2`), the attempt's, each event's.
        if let Some(list) = D::STATEMENT_LISTS
            .then(|| listed::statements(plan))
            .flatten()
        {
            let mut query = match &plan.operation {
                Some(Write::Insert(op) | Write::Update(op)) => {
                    listed::same_key(op, (tenant, id))?;
                    rows::operation_columns(One {
                        query: sqlx::query(list),
                        row: op,
                    })
                    .query
                }
                None => sqlx::query(list).bind(tenant).bind(id.as_str()),
            };
            if let Some(attempt) = &plan.attempt {
                query = rows::attempt_columns(One {
                    query,
                    row: attempt,
                })
                .query;
            }
            for event in &plan.events {
                query = rows::event_values(query, event, now);
            }
            let mut wrote = Vec::with_capacity(4 + plan.events.len());
            let mut steps = (&mut **tx).fetch_many(query);
            let failed = loop {
                match steps.try_next().await {
                    Ok(Some(Either::Left(done))) => wrote.push(D::rows_affected(&done)),
                    Ok(Some(Either::Right(_))) => {}
                    Ok(None) => break None,
                    Err(error) => break Some(error),
                }
            };
            drop(steps);
            return listed::written(plan, &wrote, failed);
        }
        let mut written_events = Vec::with_capacity(plan.events.len());
        if let Some(write) = &plan.operation {
            let (sql, op) = match write {
                Write::Insert(op) => (INSERT_OPERATION.as_str(), op),
                Write::Update(op) => (UPDATE_OPERATION.as_str(), op),
            };
            let bound = One {
                query: sqlx::query(sql),
                row: op,
            };
            let written = rows::operation_columns(bound)
                .query
                .execute(&mut **tx)
                .await?;
            if matches!(write, Write::Update(_)) && D::rows_affected(&written) != 1 {
                return Err(StoreError::NotFound);
            }
        }
        if plan.forgets_attempts {
            sqlx::query(listed::FORGET_ATTEMPTS)
                .bind(tenant)
                .bind(id.as_str())
                .execute(&mut **tx)
                .await?;
        }
        if let Some(attempt) = &plan.attempt {
            let bound = One {
                query: sqlx::query(&INSERT_ATTEMPT).bind(tenant).bind(id.as_str()),
                row: attempt,
            };
            rows::attempt_columns(bound)
                .query
                .execute(&mut **tx)
                .await?;
        }
        for event in &plan.events {
            // Anomalies carry a dedupe key so a repeated cause is recorded once. The tool and
            // the state are the operation row's as this plan left it (written above), for
            // watchers' filters.
            let query = sqlx::query(&INSERT_EVENT).bind(tenant).bind(id.as_str());
            let inserted = rows::event_values(query, event, now)
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

    async fn savepoint_again(&self, tx: &mut Self::Tx) -> Result<(), StoreError> {
        (&mut **tx)
            .execute("RELEASE SAVEPOINT write; SAVEPOINT write")
            .await?;
        Ok(())
    }

    async fn rollback_to_savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError> {
        (&mut **tx)
            .execute("ROLLBACK TO SAVEPOINT write; RELEASE SAVEPOINT write")
            .await?;
        Ok(())
    }
}

/// The read of a call that took no connection, made with others' ([`Dialect::read_with_others`]);
/// how long it took is kept with the call, for the wait its write's start reports.
async fn read_with_others<D: Dialect>(
    store: &Store<D>,
    call: &mut Call<D>,
    tenant: &str,
    id: &OperationId,
    claim: bool,
) -> Result<(Option<Operation>, Millis, Option<FencingToken>), StoreError> {
    let asked = Instant::now();
    let found = D::read_with_others(store, tenant, id, claim).await?;
    call.read_waited = asked.elapsed();
    Ok(found)
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
pub(crate) fn clocked<R>(row: &R) -> Result<Clocked, StoreError>
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
