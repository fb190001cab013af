//! Effects in the application's own database (PostgreSQL or SQLite, through sqlx): the effect
//! and a marker row naming its attempt commit in one transaction, and the ledger's `sql`
//! reconciler reads the marker as the truth (docs/reconcilers.md, "the `sql` kind").
//!
//! [`LedgerClient::run_local`] is the guarded form: it asks the ledger, runs the effect in a
//! transaction of the pool, writes the marker in it, commits, and reports. The effect must only
//! write through the connection it is given: what it does elsewhere the marker does not cover.

use std::panic::AssertUnwindSafe;

use futures::future::BoxFuture;
use futures::FutureExt as _;
use sqlx::{Database, Encode, Executor, IntoArguments, Type};

pub use once_core::local::{create_table, MARK_DONE};

use crate::{
    Attempt, ClientError, Decision, Effect, EffectContext, EffectError, LedgerClient,
    OperationSpec, Outcome, Report,
};

/// How many rows a statement wrote, on either database.
pub trait RowsWritten {
    fn rows_written(&self) -> u64;
}

impl RowsWritten for sqlx::postgres::PgQueryResult {
    fn rows_written(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsWritten for sqlx::sqlite::SqliteQueryResult {
    fn rows_written(&self) -> u64 {
        self.rows_affected()
    }
}

/// What writing the marker found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marked {
    /// The marker is this attempt's: commit.
    Written,
    /// The key is taken: a lookup fenced this attempt (it was judged not to have run), or an
    /// earlier attempt's marker is there already. Roll back.
    Fenced,
}

/// Writes the marker of `attempt`'s `effect` in `table`, inside `tx`, the transaction that makes
/// the effect, before it commits.
pub async fn mark<DB>(
    tx: &mut sqlx::Transaction<'_, DB>,
    table: &str,
    attempt: &Attempt,
    effect: &Effect,
) -> Result<Marked, sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
    DB::QueryResult: RowsWritten,
{
    let sql = MARK_DONE.replace("{table}", table);
    let token = i64::try_from(attempt.fencing_token()).unwrap_or(i64::MAX);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        });
    let written = sqlx::query::<DB>(&sql)
        .bind(attempt.provider_key().to_owned())
        .bind(attempt.operation_id().to_owned())
        .bind(token)
        .bind(effect.result.clone())
        .bind(effect.provider_ref.clone())
        .bind(now)
        .execute(&mut **tx)
        .await?
        .rows_written();
    Ok(match written {
        1 => Marked::Written,
        _ => Marked::Fenced,
    })
}

impl LedgerClient {
    /// Runs `effect` at most once, as a transaction of `pool` that also writes its marker in
    /// `table` (see [`create_table`]): EXECUTE runs it, REPLAY and the rest return without it.
    ///
    /// What is reported: the transaction committed, CONFIRMED with the effect's result; the
    /// effect failed, the transaction is rolled back and ABSENT (nothing of it committed); the
    /// marker's key taken (fenced, or done by an earlier attempt), rolled back and UNKNOWN; the
    /// COMMIT's outcome is unknown (the connection lost during it), UNKNOWN. The `sql`
    /// reconciler settles an UNKNOWN from the marker.
    pub async fn run_local<DB, F>(
        &self,
        spec: &OperationSpec,
        pool: &sqlx::Pool<DB>,
        table: &str,
        effect: F,
    ) -> Result<Outcome, ClientError>
    where
        DB: Database,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
        for<'q> String: Encode<'q, DB> + Type<DB>,
        for<'q> i64: Encode<'q, DB> + Type<DB>,
        for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
        for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
        DB::QueryResult: RowsWritten,
        F: for<'t> FnOnce(
            &'t mut DB::Connection,
            EffectContext,
        ) -> BoxFuture<'t, Result<Effect, EffectError>>,
    {
        let attempt = match self.begin(spec).await? {
            Decision::Execute(attempt) => attempt,
            Decision::Replay(replay) => return Ok(Outcome::Replayed(replay)),
            Decision::InProgress(in_progress) => return Ok(Outcome::InProgress(in_progress)),
            Decision::Unknown(unknown) => return Ok(Outcome::Unknown(unknown)),
            Decision::Conflict(conflict) => return Ok(Outcome::Conflict(conflict)),
        };
        let operation_id = attempt.operation_id().to_owned();
        let performed = perform(&attempt, pool, table, effect).await;
        let report = match &performed {
            Ok(effect) => Report::Confirmed(effect.clone()),
            Err(EffectError::NotPerformed(reason)) => Report::Absent {
                reason: reason.clone(),
            },
            Err(EffectError::Ambiguous(reason)) => Report::Unknown {
                reason: reason.clone(),
            },
        };
        if let Err(error) = attempt.report(report).await {
            tracing::warn!(
                %operation_id,
                %error,
                "the local effect's report did not reach the ledger; its lease will expire into UNKNOWN, and the sql reconciler reads its marker"
            );
        }
        Ok(Outcome::performed(operation_id, performed))
    }
}

/// The effect in a transaction with its marker: its outcome, as the ledger is to be told.
async fn perform<DB, F>(
    attempt: &Attempt,
    pool: &sqlx::Pool<DB>,
    table: &str,
    effect: F,
) -> Result<Effect, EffectError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
    DB::QueryResult: RowsWritten,
    F: for<'t> FnOnce(
        &'t mut DB::Connection,
        EffectContext,
    ) -> BoxFuture<'t, Result<Effect, EffectError>>,
{
    // No transaction, no effect.
    let mut tx = pool.begin().await.map_err(|e| {
        EffectError::NotPerformed(format!("the database could not be reached: {e}"))
    })?;
    let context = EffectContext {
        operation_id: attempt.operation_id().to_owned(),
        provider_key: attempt.provider_key().to_owned(),
        attempt: attempt.number(),
    };
    let ran = AssertUnwindSafe(effect(&mut tx, context))
        .catch_unwind()
        .await
        .unwrap_or_else(|_panic| Err(EffectError::NotPerformed("the effect panicked".into())));
    // Whatever failed before the commit: a transaction that never committed made nothing.
    let rolled_back = |why: String| EffectError::NotPerformed(why);
    let done = match ran {
        Ok(done) => done,
        Err(error) => {
            let _ = tx.rollback().await;
            return Err(rolled_back(match error {
                EffectError::NotPerformed(why) | EffectError::Ambiguous(why) => why,
            }));
        }
    };
    match mark(&mut tx, table, attempt, &done).await {
        Ok(Marked::Written) => {}
        // Rolled back, and UNKNOWN, not ABSENT: whether the key was fenced (the lookup then
        // reads ABSENT) or an earlier attempt's effect is done under it (the lookup reads
        // CONFIRMED), the marker tells.
        Ok(Marked::Fenced) => {
            let _ = tx.rollback().await;
            return Err(EffectError::Ambiguous(
                "the marker's key is taken (fenced by a lookup, or done by an earlier attempt): rolled back; the sql reconciler reads which".into(),
            ));
        }
        Err(error) => {
            let _ = tx.rollback().await;
            return Err(rolled_back(format!("the marker was not written: {error}")));
        }
    }
    // The one moment whose outcome may be unknown: the COMMIT's answer lost.
    tx.commit().await.map_err(|error| {
        EffectError::Ambiguous(format!(
            "the commit's outcome is unknown ({error}); the sql reconciler reads the marker"
        ))
    })?;
    Ok(done)
}
