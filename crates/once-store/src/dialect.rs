//! What differs between the databases the ledger can live in.
//!
//! Implemented for `sqlx::Sqlite` and `sqlx::Postgres`: the clock expression, the row lock a read
//! appends, the token statement, how a write transaction starts, the fresh-id guard's query
//! ([`Dialect::blocking`], once per dialect), rows affected, a key among a subquery's keys
//! ([`Dialect::one_of`]), whether a token may be taken outside the write lock and a decision written
//! in one checked statement, and `ping`. The statements of the Begin and report path that name the
//! clock are built from these once.

use std::future::Future;

use once_core::{BeginCommand, Blocking, FencingToken, Millis, Operation, OperationId};
use sqlx::{Database, Pool, Transaction};

use crate::Decision;
use crate::{StoreError, Unlocked};

/// A database the ledger can live in: everything that is not the same SQL on SQLite and
/// PostgreSQL. The shared queries are written once in [`crate::Store`], in the dialect both
/// speak (`$n` placeholders, `ON CONFLICT`, `RETURNING`, row values, integer milliseconds).
pub trait Dialect: Database {
    /// A short name for logs: `sqlite` or `postgres`.
    const KIND: &'static str;

    /// The store's clock, in milliseconds since the epoch, as an SQL expression.
    const NOW: &'static str;

    /// A condition that a key is one of the keys `subquery` selects, written so the keys are
    /// looked up by the primary key one by one, whatever the planner guesses of their number.
    fn one_of(subquery: &str) -> String;

    /// What a read of the operation row appends to lock it against every other writer until
    /// the transaction ends (empty where the write transaction already excludes them).
    const ROW_LOCK: &'static str;

    /// The statement that issues a fencing token never issued before, larger than every one
    /// issued before.
    const NEXT_TOKEN: &'static str;

    /// A query answering the highest token issued (or skipped) so far.
    const ISSUED_THROUGH: &'static str;

    /// A statement, bound with a token `$1` a client saw, that makes every token issued from
    /// then on larger than it (nothing when they are already). It runs in a write transaction
    /// after [`Dialect::RAISING`], when there is one.
    const RAISE_TOKENS: &'static str;

    /// A statement that serialises raises of the token counter until the transaction ends,
    /// where two could otherwise interleave (and the later, lower one set it back).
    const RAISING: Option<&'static str>;

    /// An expression that issues such a token outside any write transaction (a lock-free read
    /// hands it out for a first claim written by [`Dialect::apply_unlocked`]); `None` where a
    /// token is only safe under the write lock.
    const FRESH_TOKEN: Option<&'static str>;

    /// A subquery the first statement of every write transaction (the one that locks the
    /// operation row) runs, to hold the write gate until the transaction ends: see
    /// [`crate::watch`]. `SELECT 1` where writers commit in sequence order.
    fn write_gate() -> &'static str;

    /// One statement reading the [`crate::watch::Frontier`]: `newest`, then `writing` (the
    /// holders of the write gate, comma-separated).
    fn frontier() -> &'static str;

    /// Whether the ledger's writes share transactions through one writer task
    /// ([`crate::writer`]).
    const GROUP_COMMIT: bool;

    /// Whether one query may hold several statements bound from one list of values, run in
    /// one round trip (a plan's writes are then sent together).
    const STATEMENT_LISTS: bool;

    /// The text of `field` of the JSON object in the text column `column` (NULL when absent).
    fn json_text(column: &str, field: &str) -> String;

    /// The integer `field` of the JSON object in the text column `column` (NULL when absent).
    fn json_integer(column: &str, field: &str) -> String;

    /// The statements built from the constants above, once.
    fn statements() -> &'static crate::store::Statements;

    /// Starts a write transaction.
    fn begin_write(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, StoreError>> + Send;

    /// The fresh-id guard of `cmd`'s intent, its query written once for this dialect: the open
    /// operation of the same tenant, tool and fingerprint under another id (UNKNOWN ones
    /// first), read with a snapshot taken once the guard of the intent is serialised until the
    /// transaction ends, so two Begins of one intent under two new ids cannot both find the way
    /// clear.
    fn blocking(
        tx: &mut Self::Connection,
        cmd: &BeginCommand,
    ) -> impl Future<Output = Result<Option<Blocking>, StoreError>> + Send;

    /// A statement that takes a token as [`Dialect::NEXT_TOKEN`] does, but only where nothing
    /// blocks the intent it is bound with (as [`Dialect::blocking`] reads it): the guard and
    /// the token in one round trip, where the guard needs no lock of its own. It answers no row
    /// when something blocks. `None` where the guard takes a lock first.
    fn clear_token() -> Option<&'static str> {
        None
    }

    /// The guard's query as a write transaction sends it, for the tests of its plan; `None`
    /// where it runs inside a function whose plan is tested there.
    #[cfg(test)]
    fn guard_statement() -> Option<String>;

    /// Whether [`Dialect::apply_unlocked`] writes anything.
    const UNLOCKED_WRITES: bool;

    /// See [`crate::Backend::apply_unlocked`]: `None` (as here) where the database cannot
    /// check a decision in the statement that writes it.
    fn apply_unlocked(
        _store: &crate::Store<Self>,
        _call: crate::store::Call<Self>,
        _decision: Decision<'_>,
    ) -> impl Future<Output = Result<Option<Unlocked>, StoreError>> + Send {
        async { Ok(None) }
    }

    /// A lock-free read of a call that took no connection (see [`crate::store::Call`]), made
    /// with other calls' reads; a fresh token with it when `claim` and nothing is stored. Only
    /// where [`Dialect::UNLOCKED_WRITES`]: every other dialect's calls take a connection.
    fn read_with_others(
        _store: &crate::Store<Self>,
        _tenant: &str,
        _id: &OperationId,
        _claim: bool,
    ) -> impl Future<Output = Result<(Option<Operation>, Millis, Option<FencingToken>), StoreError>> + Send
    {
        async {
            Err(StoreError::Corrupt(
                "a call without a connection where reads are not made together".into(),
            ))
        }
    }

    /// Tells the other replicas that events were committed; nothing where they cannot be told
    /// (they look every [`crate::Announcements`] poll interval instead).
    fn announce_events(pool: &Pool<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Listens for other replicas' announcements; `None` where there are none to hear.
    fn listen_for_events(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Option<crate::Announcements>, StoreError>> + Send;

    /// How many rows a statement wrote.
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// Checks that the database answers and accepts writes, as hard as `probe` says.
    fn ping(
        pool: &Pool<Self>,
        probe: crate::Probe,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
