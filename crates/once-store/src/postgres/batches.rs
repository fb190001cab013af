//! Group commit of the one-statement writes: the decisions concurrent callers make are written
//! together, up to [`MAX_BATCH`] of one shape in one statement ([`unlocked::write`]), and each
//! caller is answered after that statement commits.
//!
//! Their reads go together too. A call begun while another is under way ([`UnderWay`]) takes no
//! connection from the pool: its lock-free read is queued, and the reading lane (a lane reads or
//! writes, never both, so a read never waits behind a write waiting for a lock) makes every
//! queued read in one statement ([`READ_MANY`]), each as the call's own read would (the
//! operation, the clock, a fresh token for a claim of an operation not stored). A statement that
//! starts after the read was queued sees every commit answered before the call began. Its write
//! then joins the queue, or, when no other is being written, goes out alone on a pooled
//! connection taken then.
//!
//! An item begun while no other is being written is written at once, alone, on the connection
//! its caller read on: a lone caller never waits for a batch, nor for a hop to another task.
//! Any other joins a queue. While fewer than [`LANES`] lanes run, it starts one: a task with a
//! connection of its own that takes what is queued, writes it, answers, and takes again until
//! the queue is empty, then ends and leaves its connection for the next lane. Items queue only
//! while others are being written: the busier the ledger, the more items share a statement and
//! its commit. The lane is a task of its own, so a caller that stops waiting strands no one; an
//! item whose caller stopped waiting before it was taken is not written.
//!
//! A batch holds one item per operation, and one claim per intent: a second one waits for the
//! next batch, as the first one's write must be seen by the second's decision or guard. Items
//! are ordered by intent and then by operation, so two batches (of two replicas, or lanes)
//! take intent locks and rows in one order. A statement the database refuses commits nothing;
//! its items are then written one by one, so one item that cannot be written fails alone. A
//! statement with no answer, or given up for time (see [`PATIENCE`]), is answered unavailable
//! to each of its items' callers.
//!
//! The lanes' connections are their own, not the pool's: a lane never waits behind the calls
//! queued for the pool, and its connections plan the statements once, generically
//! (`plan_cache_mode = force_generic_plan`), as their arrays' lengths change from one batch to
//! the next and every plan finds each item's rows by their keys (`enable_seqscan = off`: a
//! plan made over a new database's empty tables would otherwise read them whole for good). A
//! connection that sat idle for a second or more, or through a loss another call noticed, is
//! pinged before it writes; one found closed is dropped, with every idle one, as the server
//! ends sessions together.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use once_core::{FencingToken, Millis, Operation, OperationId};
use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, PgConnection, Postgres};
use tokio::sync::oneshot;

use super::unlocked::{self, Item, Shape};
use crate::rows::{self, OPERATION_COLUMNS};
use crate::writer::MAX_BATCH;
use crate::{Store, StoreError, Unlocked};

/// How many lanes may write at once, each with a connection of its own. One: with reads in a
/// lane of their own, one writing lane makes larger batches, and each commit serves more
/// callers (README, Performance).
const LANES: usize = 1;

/// How many lanes read, each with a connection of its own. A lane reads or writes, never both:
/// a read never waits behind a write waiting for a lock.
const READING_LANES: usize = 1;

/// How long a lane waits for its connection to open or answer, or for a batch to be written,
/// before it gives the batch's items up as unavailable (their callers may ask again; each
/// decision is written only over what it was decided from) and closes the connection. The
/// server gives a lane's statement up at four fifths of it (`statement_timeout`), so none is
/// left waiting for a lock, to commit later.
const PATIENCE: Duration = Duration::from_secs(5);

/// The items waiting to be written, and the lanes writing.
#[derive(Debug)]
pub(crate) struct Batches {
    queue: Mutex<Queue>,
    patience: Duration,
    /// How many calls are under way ([`UnderWay`]): counted apart from the queue, as every
    /// call counts itself in and out.
    calls: AtomicUsize,
}

impl Default for Batches {
    fn default() -> Self {
        Batches {
            queue: Mutex::default(),
            patience: PATIENCE,
            calls: AtomicUsize::new(0),
        }
    }
}

#[derive(Debug, Default)]
struct Queue {
    waiting: VecDeque<Queued>,
    /// The reads of calls begun while others were under way.
    reading: VecDeque<QueuedRead>,
    /// The lanes writing.
    lanes: usize,
    /// The lanes reading.
    readers: usize,
    /// The connections no lane holds.
    idle: Vec<Held>,
    /// The store was closed: a lane's connection is closed as it ends.
    closed: bool,
    /// How many callers' items are being written, alone or queued.
    writing: usize,
}

/// A lane's connection, and when it last answered.
#[derive(Debug)]
pub(super) struct Held {
    conn: PgConnection,
    since: Instant,
}

#[derive(Debug)]
struct Queued {
    item: Item,
    reply: oneshot::Sender<Result<Unlocked, StoreError>>,
}

/// What a lock-free read finds: the operation, the store's clock, and for a claim of an
/// operation not stored, a fencing token never issued before.
pub(crate) type Found = (Option<Operation>, Millis, Option<FencingToken>);

/// A lock-free read of one operation, to be made with others in one statement.
#[derive(Debug, Clone)]
pub(crate) struct Read {
    pub(crate) tenant: String,
    pub(crate) id: OperationId,
    /// A token is taken when no operation is stored (a first claim may follow).
    pub(crate) claim: bool,
}

#[derive(Debug)]
struct QueuedRead {
    read: Read,
    reply: oneshot::Sender<Result<Found, StoreError>>,
}

/// What a lane does: read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reads,
    Writes,
}

/// What a lane takes from the queue at once.
#[derive(Debug)]
enum Batch {
    Reads(Vec<QueuedRead>),
    Writes(Vec<Queued>),
}

impl Queue {
    /// How many lanes of `kind` run.
    fn lanes(&mut self, kind: Kind) -> &mut usize {
        match kind {
            Kind::Reads => &mut self.readers,
            Kind::Writes => &mut self.lanes,
        }
    }
}

/// One call under way, from when it asks for a connection to when it has been answered: while
/// any other is, a call takes no connection from the pool and its read and write go with others'
/// in a lane's statements.
#[derive(Debug)]
pub(crate) struct UnderWay {
    batches: Arc<Batches>,
}

impl UnderWay {
    /// A call begun, and whether no other was under way as it began.
    pub(crate) fn begun(batches: &Arc<Batches>) -> (UnderWay, bool) {
        let alone = batches.calls.fetch_add(1, Ordering::Relaxed) == 0;
        let batches = batches.clone();
        (UnderWay { batches }, alone)
    }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        self.batches.calls.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Batches {
    /// Writes `item`, decided from a read on `conn` (a call's pooled connection, if it took
    /// one), with whatever other items are waiting; what it did, once committed.
    pub(crate) async fn write(
        store: &Store<Postgres>,
        conn: Option<PoolConnection<Postgres>>,
        item: Item,
    ) -> Result<Unlocked, StoreError> {
        let writing = Writing::begun(&store.batches);
        if writing.alone {
            let mut conn = match conn {
                Some(conn) => conn,
                None => store.pool.acquire().await?,
            };
            return unlocked::write_one(&mut conn, &item).await;
        }
        drop(conn);
        let (reply, answer) = oneshot::channel();
        store.batches.queue(store, Kind::Writes, |queue| {
            queue.waiting.push_back(Queued { item, reply })
        });
        // A lane that ended without an answer (it panicked, or ran out of patience) may have
        // written the item or not: the caller is told the database is unavailable, and asked
        // again, is answered from what is stored.
        answer
            .await
            .map_err(|_| StoreError::Unavailable(sqlx::Error::WorkerCrashed))?
    }

    /// Reads what `read` names with whatever other reads are waiting, in a lane's statement.
    pub(crate) async fn read(store: &Store<Postgres>, read: Read) -> Result<Found, StoreError> {
        let (reply, answer) = oneshot::channel();
        store.batches.queue(store, Kind::Reads, |queue| {
            queue.reading.push_back(QueuedRead { read, reply })
        });
        answer
            .await
            .map_err(|_| StoreError::Unavailable(sqlx::Error::WorkerCrashed))?
    }

    /// Queues work of `kind` as `push` does, and starts a lane of that kind if fewer than
    /// [`LANES`] or [`READING_LANES`] run.
    fn queue(&self, store: &Store<Postgres>, kind: Kind, push: impl FnOnce(&mut Queue)) {
        let most = match kind {
            Kind::Reads => READING_LANES,
            Kind::Writes => LANES,
        };
        let start_a_lane = {
            let mut queue = self.lock();
            push(&mut queue);
            let lanes = queue.lanes(kind);
            let start = *lanes < most;
            if start {
                *lanes += 1;
            }
            start
        };
        if start_a_lane {
            tokio::spawn(lane(store.clone(), kind));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the idle connections; a lane still writing closes its own as it ends.
    pub(crate) async fn close(&self) {
        let idle = {
            let mut queue = self.lock();
            queue.closed = true;
            std::mem::take(&mut queue.idle)
        };
        for held in idle {
            let _ = held.conn.close().await;
        }
    }

    /// The next batch of `kind`, taken from the queue in arrival order; `None` when nothing
    /// of it waits, and then the lane asking has ended, leaving `conn` idle.
    fn take(&self, kind: Kind, conn: &mut Option<Held>) -> Option<Batch> {
        let mut queue = self.lock();
        let batch = match kind {
            Kind::Reads => {
                let mut reads = Vec::new();
                while reads.len() < MAX_BATCH {
                    match queue.reading.pop_front() {
                        Some(queued) if queued.reply.is_closed() => {}
                        Some(queued) => reads.push(queued),
                        None => break,
                    }
                }
                (!reads.is_empty()).then_some(Batch::Reads(reads))
            }
            Kind::Writes => queue.writes().map(Batch::Writes),
        };
        if batch.is_none() {
            *queue.lanes(kind) -= 1;
            if let Some(held) = conn.take().filter(|_| !queue.closed) {
                queue.idle.push(held);
            }
        }
        batch
    }
}

impl Queue {
    /// The next batch of writes: one item per operation, one claim per intent.
    fn writes(&mut self) -> Option<Vec<Queued>> {
        let queue = self;
        let mut batch: Vec<Queued> = Vec::new();
        let mut at = 0;
        while at < queue.waiting.len() && batch.len() < MAX_BATCH {
            let next = &queue.waiting[at];
            if next.reply.is_closed() {
                queue.waiting.remove(at);
                continue;
            }
            let meets = |taken: &Queued| {
                taken.item.key() == next.item.key()
                    || (next.item.intent.is_some() && taken.item.intent == next.item.intent)
            };
            if batch.iter().any(meets) {
                at += 1;
                continue;
            }
            batch.extend(queue.waiting.remove(at));
        }
        (!batch.is_empty()).then_some(batch)
    }
}

/// One caller's item being written, from its start to its answer (or the caller's going).
struct Writing<'b> {
    batches: &'b Batches,
    /// No other item was being written as it began.
    alone: bool,
}

impl<'b> Writing<'b> {
    fn begun(batches: &'b Batches) -> Self {
        let mut queue = batches.lock();
        queue.writing += 1;
        Writing {
            batches,
            alone: queue.writing == 1,
        }
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.batches.lock().writing -= 1;
    }
}

/// A lane's task: if it ends without finding the queue empty (it panicked, or its runtime
/// went), it gives its place back, and when no other lane runs, the callers still queued are
/// told the database is unavailable rather than left waiting.
struct Lane {
    store: Store<Postgres>,
    kind: Kind,
    ended: bool,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let stranded = {
            let mut queue = self.store.batches.lock();
            let lanes = queue.lanes(self.kind);
            *lanes -= 1;
            match (*lanes, self.kind) {
                (0, Kind::Reads) => (VecDeque::new(), std::mem::take(&mut queue.reading)),
                (0, Kind::Writes) => (std::mem::take(&mut queue.waiting), VecDeque::new()),
                _ => Default::default(),
            }
        };
        drop(stranded);
    }
}

/// One lane: reads or writes batch after batch on one connection until nothing of its kind
/// waits.
async fn lane(store: Store<Postgres>, kind: Kind) {
    let mut lane = Lane {
        store: store.clone(),
        kind,
        ended: false,
    };
    let patience = store.batches.patience;
    let mut held: Option<Held> = None;
    loop {
        let Some(batch) = store.batches.take(kind, &mut held) else {
            lane.ended = true;
            return;
        };
        let conn = match tokio::time::timeout(patience, connection(&store, held.take())).await {
            Ok(Ok(conn)) => held.insert(Held {
                conn,
                since: Instant::now(),
            }),
            Ok(Err(error)) => {
                match batch {
                    Batch::Reads(reads) => reads
                        .into_iter()
                        .for_each(|queued| drop(queued.reply.send(Err(error.again())))),
                    Batch::Writes(writes) => writes
                        .into_iter()
                        .for_each(|queued| drop(queued.reply.send(Err(error.again())))),
                }
                continue;
            }
            // Its items' callers are told the database is unavailable as the batch is dropped.
            Err(_) => continue,
        };
        let done = async {
            match batch {
                Batch::Reads(reads) => read_batch(&mut conn.conn, reads).await,
                Batch::Writes(writes) => write_batch(&mut conn.conn, writes).await,
            }
        };
        match tokio::time::timeout(patience, done).await {
            Ok(met) if !met.broken => conn.since = Instant::now(),
            Ok(met) => {
                if met.lost {
                    store.losses.noticed();
                    store.batches.lock().idle.clear();
                }
                held = None;
            }
            Err(_) => {
                tracing::warn!(
                    patience_ms = patience.as_millis(),
                    "a lane's batch was not done in time; its callers are told the database is unavailable"
                );
                held = None;
            }
        }
    }
}

/// A lane's connection: the one it holds or an idle one, checked if it may have died since it
/// last answered, or a new one.
pub(super) async fn connection(
    store: &Store<Postgres>,
    mut held: Option<Held>,
) -> Result<PgConnection, StoreError> {
    loop {
        if store.batches.lock().closed {
            return Err(StoreError::Unavailable(sqlx::Error::PoolClosed));
        }
        let Some(Held { mut conn, since }) =
            held.take().or_else(|| store.batches.lock().idle.pop())
        else {
            break;
        };
        let idle_for = since.elapsed();
        if idle_for < super::IDLE_BEFORE_PING && !store.losses.idle_through_one(idle_for) {
            return Ok(conn);
        }
        if conn.ping().await.is_ok() {
            return Ok(conn);
        }
    }
    let mut conn = PgConnection::connect_with(&store.pool.connect_options()).await?;
    // The server gives a statement up before the lane does, so a batch given up leaves no
    // statement behind, still waiting for a lock, that could commit later. The plans are made
    // once, whatever the tables hold then (a new database's are empty): they may not read a
    // table whole where a key finds the rows.
    let limit = store.batches.patience.as_millis() * 4 / 5;
    let settings = format!(
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; \
         SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; \
         SET statement_timeout = {limit}"
    );
    sqlx::Executor::execute(&mut conn, settings.as_str()).await?;
    Ok(conn)
}

/// What writing one batch met.
#[derive(Debug, Default)]
struct Batched {
    /// The connection may no longer be usable: an error not from the database.
    broken: bool,
    /// The connection was found closed by the server or the network.
    lost: bool,
    /// A statement failed, and its items were written one by one.
    split: bool,
}

impl Batched {
    /// Notes what an error says of the connection it came over.
    fn met(&mut self, error: &StoreError) {
        self.lost |= error.is_lost_connection();
        self.broken |= error.is_lost_connection() || !from_the_database(error);
    }
}

/// Many reads in one statement: `$1` tenants, `$2` ids, `$3` whether each claims; a row per
/// read, in their order, as a call's own read answers (`Statements::read_claimable`).
static READ_MANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} AS now_ms, \
         CASE WHEN o.tenant IS NULL AND r.claim THEN nextval('fencing_tokens') END AS fresh_token, \
         o.* FROM unnest($1::TEXT[], $2::TEXT[], $3::BOOLEAN[]) WITH ORDINALITY \
         AS r(tenant, operation_id, claim, n) \
         LEFT JOIN LATERAL (SELECT {} FROM operations \
         WHERE tenant = r.tenant AND operation_id = r.operation_id) AS o ON TRUE ORDER BY r.n",
        <Postgres as crate::Dialect>::NOW,
        OPERATION_COLUMNS.as_str()
    )
});

/// Makes `reads` in one statement (each alone when the database refuses it) and answers each
/// one's caller.
async fn read_batch(conn: &mut PgConnection, reads: Vec<QueuedRead>) -> Batched {
    let mut met = Batched::default();
    if reads.is_empty() {
        return met;
    }
    let asked: Vec<&Read> = reads.iter().map(|queued| &queued.read).collect();
    let found = read_many(conn, &asked).await;
    drop(asked);
    match found {
        Ok(found) => {
            for (queued, found) in reads.into_iter().zip(found) {
                let _ = queued.reply.send(found);
            }
        }
        Err(error) if reads.len() > 1 && refused(&error) => {
            met.split = true;
            met.met(&error);
            for queued in reads {
                let alone = read_many(conn, &[&queued.read]).await;
                let alone = alone.and_then(|mut found| {
                    found.pop().unwrap_or_else(|| {
                        Err(StoreError::Corrupt("a read answered no row".into()))
                    })
                });
                if let Err(error) = &alone {
                    met.met(error);
                }
                let _ = queued.reply.send(alone);
            }
        }
        Err(error) => {
            met.met(&error);
            for queued in reads {
                let _ = queued.reply.send(Err(error.again()));
            }
        }
    }
    met
}

/// What [`READ_MANY`] finds for each of `reads`, in their order.
pub(super) async fn read_many(
    conn: &mut PgConnection,
    reads: &[&Read],
) -> Result<Vec<Result<Found, StoreError>>, StoreError> {
    let rows = sqlx::query(&READ_MANY)
        .bind(reads.iter().map(|r| r.tenant.as_str()).collect::<Vec<_>>())
        .bind(reads.iter().map(|r| r.id.as_str()).collect::<Vec<_>>())
        .bind(reads.iter().map(|r| r.claim).collect::<Vec<_>>())
        .fetch_all(conn)
        .await?;
    if rows.len() != reads.len() {
        let miscounted = || {
            StoreError::Corrupt(format!(
                "{} rows answered {} reads made in one statement",
                rows.len(),
                reads.len()
            ))
        };
        return Ok(reads.iter().map(|_| Err(miscounted())).collect());
    }
    Ok(rows
        .iter()
        .map(|row| {
            let (op, now) = crate::store::clocked(row)?;
            let token: Option<i64> = sqlx::Row::try_get(row, "fresh_token")?;
            Ok((op, now, token.map(rows::token).transpose()?))
        })
        .collect())
}

/// Writes one batch, a statement per shape, and answers each item's caller.
async fn write_batch(conn: &mut PgConnection, batch: Vec<Queued>) -> Batched {
    if batch.is_empty() {
        return Batched::default();
    }
    let mut shapes: Vec<Vec<Queued>> = (0..Shape::COUNT).map(|_| Vec::new()).collect();
    for queued in batch {
        shapes[queued.item.shape().index()].push(queued);
    }
    let mut met = Batched::default();
    for mut group in shapes.into_iter().filter(|group| !group.is_empty()) {
        group.sort_by(|a, b| a.item.order().cmp(&b.item.order()));
        let items: Vec<&Item> = group.iter().map(|queued| &queued.item).collect();
        let written = unlocked::write(conn, &items).await;
        drop(items);
        match written {
            Ok(outcomes) => {
                for (queued, outcome) in group.into_iter().zip(outcomes) {
                    let _ = queued.reply.send(outcome);
                }
            }
            // The database refused the statement, which committed nothing: each is written
            // alone, and fails alone.
            Err(error) if group.len() > 1 && refused(&error) => {
                met.split = true;
                met.met(&error);
                tracing::debug!(%error, items = group.len(), "a batch of decisions failed; writing them one by one");
                for queued in group {
                    let alone = unlocked::write_one(conn, &queued.item).await;
                    if let Err(error) = &alone {
                        met.met(error);
                    }
                    let _ = queued.reply.send(alone);
                }
            }
            // No answer, or it ran out of time: each is told so.
            Err(error) => {
                met.met(&error);
                for queued in group {
                    let _ = queued.reply.send(Err(error.again()));
                }
            }
        }
    }
    met
}

/// Whether `error` is the database refusing a statement (a constraint, a deadlock, a value it
/// cannot take), which then committed nothing: not a statement it gave up for time, which
/// would only wait again.
fn refused(error: &StoreError) -> bool {
    if error.is_lost_connection() {
        return false;
    }
    match error {
        StoreError::Unavailable(sqlx::Error::Database(db))
        | StoreError::Internal(sqlx::Error::Database(db)) => {
            !matches!(db.code().as_deref(), Some("57014" | "55P03"))
        }
        StoreError::Duplicate => true,
        _ => false,
    }
}

/// Whether `error` is the database's answer to a statement, which leaves the connection as
/// usable as before.
fn from_the_database(error: &StoreError) -> bool {
    match error {
        StoreError::Unavailable(error) | StoreError::Internal(error) => {
            matches!(error, sqlx::Error::Database(_))
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sealed::Transactions as _;
    use crate::{Backend, Decision, Ledger, PgBackend};
    use once_core::machine::{self, FreshIdGuard};
    use once_core::*;
    use once_testdb::{Engine, TestDb};

    const TENANT: &str = "t1";

    fn command(operation_id: &str, fingerprint: u8) -> BeginCommand {
        BeginCommand {
            tenant: TENANT.into(),
            operation_id: OperationId::parse("id", operation_id).unwrap(),
            tool: "refund".into(),
            fingerprint: Fingerprint([fingerprint; 32]),
            attempt_id: "attempt-0123456789".into(),
            context: AttemptContext::default(),
            lease_ttl_ms: 60_000,
            retention_ms: 60_000,
            new_intent: false,
            provider: None,
            lookup_hints: None,
            actor: Actor::Executor("batches".into()),
            holder: Some("0123456789ab".into()),
            held: false,
        }
    }

    async fn postgres() -> (TestDb, PgBackend) {
        let db = TestDb::new(Engine::Postgres).await;
        let settings = crate::postgres::PgSettings::default();
        let backend = PgBackend::connect(&db.url, &settings).await.unwrap();
        (db, backend)
    }

    /// Claims each of `ids` (another intent each) and decides a confirm of it from what is
    /// stored: one item each, as a caller's read would have made them.
    async fn confirms(backend: &PgBackend, ids: &[String]) -> Vec<Item> {
        let ledger = Ledger::new(backend.clone());
        let mut items = Vec::new();
        for (n, id) in ids.iter().enumerate() {
            let cmd = command(id, u8::try_from(n).unwrap());
            let (decision, _) = ledger.begin(&cmd).await.unwrap();
            assert!(
                matches!(decision, BeginDecision::Execute(_)),
                "{decision:?}"
            );
            let (op, now) = backend.read(TENANT, &cmd.operation_id).await.unwrap();
            let op = op.unwrap();
            let confirm = ReportCommand {
                fencing_token: op.fencing_token,
                holder: op.holder.clone(),
                report: Report::Confirm {
                    result: b"done".to_vec(),
                    provider_ref: None,
                },
            };
            let (_, plan) = machine::report(&op, &confirm, None, now);
            items.push(Item::of(Decision::new(Some(&op), &plan, now)).unwrap());
        }
        items
    }

    /// `items` queued, and where each one's answer comes.
    fn queued(
        items: Vec<Item>,
    ) -> (
        Vec<Queued>,
        Vec<oneshot::Receiver<Result<Unlocked, StoreError>>>,
    ) {
        items
            .into_iter()
            .map(|item| {
                let (reply, answer) = oneshot::channel();
                (Queued { item, reply }, answer)
            })
            .unzip()
    }

    async fn confirmed_events(db: &TestDb, id: &str) -> i64 {
        db.scalar(&format!(
            "SELECT count(*) FROM events WHERE operation_id = '{id}' AND kind = 'CONFIRMED'"
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_fails_is_written_one_by_one_and_never_half_applied() {
        let (db, backend) = postgres().await;
        let ids: Vec<String> = ["good-1", "poisoned", "good-2"].map(String::from).into();
        let mut items = confirms(&backend, &ids).await;
        // PostgreSQL refuses a NUL in text: this item's statement cannot commit.
        items[1].poison();
        let (batch, answers) = queued(items);
        let mut conn = connection(&backend, None).await.unwrap();
        let met = write_batch(&mut conn, batch).await;
        assert!(met.split && !met.lost, "{met:?}");

        let mut answered = Vec::new();
        for answer in answers {
            answered.push(answer.await.unwrap());
        }
        // Written alone after the batch failed, the good ones are applied: had the failed
        // statement written them, they would now be found changed.
        for (id, answer) in ids.iter().zip(&answered) {
            let stored = backend
                .read(TENANT, &OperationId::parse("id", id).unwrap())
                .await;
            let state = stored.unwrap().0.unwrap().state;
            if id == "poisoned" {
                assert!(answer.is_err(), "{answer:?}");
                assert_eq!(state, State::InFlight);
                assert_eq!(confirmed_events(&db, id).await, 0);
            } else {
                assert!(
                    matches!(answer, Ok(Unlocked::Applied { .. })),
                    "{id}: {answer:?}"
                );
                assert_eq!(state, State::Confirmed);
                assert_eq!(confirmed_events(&db, id).await, 1);
            }
        }
    }

    /// Callers deciding at once, most of them queued for the lanes, are each answered with what
    /// their own decision did, and each decision is written once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_at_once_are_each_answered_for_their_own_decision() {
        let (db, backend) = postgres().await;
        let ids: Vec<String> = (0..48).map(|n| format!("at-once-{n}")).collect();
        let items = confirms(&backend, &ids).await;
        let mut calls = tokio::task::JoinSet::new();
        for item in items {
            let backend = backend.clone();
            calls.spawn(async move {
                let conn = backend.pool.acquire().await.unwrap();
                let id = item.key().1.to_owned();
                (id, Batches::write(&backend, Some(conn), item).await)
            });
        }
        let mut answered = 0;
        while let Some(call) = calls.join_next().await {
            let (id, outcome) = call.unwrap();
            assert!(
                matches!(outcome, Ok(Unlocked::Applied { .. })),
                "{id}: {outcome:?}"
            );
            let stored = backend
                .read(TENANT, &OperationId::parse("id", &id).unwrap())
                .await;
            assert_eq!(stored.unwrap().0.unwrap().state, State::Confirmed, "{id}");
            assert_eq!(confirmed_events(&db, &id).await, 1, "{id}");
            answered += 1;
        }
        assert_eq!(answered, ids.len());
        let queue = backend.batches.lock();
        assert_eq!((queue.writing, queue.waiting.len()), (0, 0));
    }

    /// A lane that cannot write in time gives its batch up, its callers told the database is
    /// unavailable, and goes on: what was queued behind it is written, not stranded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lane_that_cannot_write_in_time_gives_its_batch_up_and_goes_on() {
        let (db, backend) = postgres().await;
        let store = PgBackend {
            pool: backend.pool.clone(),
            losses: backend.losses.clone(),
            batches: std::sync::Arc::new(Batches {
                queue: Mutex::default(),
                patience: Duration::from_millis(300),
                calls: AtomicUsize::new(0),
            }),
        };
        let free = confirms(&backend, &["free".to_owned()]).await.remove(0);
        let stuck: Vec<BeginCommand> = (0..3).map(|n| command(&format!("stuck-{n}"), 5)).collect();
        let mut claims = Vec::new();
        for cmd in &stuck {
            claims.push(claim(&backend, cmd).await);
        }
        // Another session holds the claims' intent lock.
        let mut holder = connection(&backend, None).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(crate::postgres::intent_key(&stuck[0]))
            .execute(&mut holder)
            .await
            .unwrap();
        let write = |item: Item| {
            let store = store.clone();
            tokio::spawn(async move {
                let conn = store.pool.acquire().await.unwrap();
                Batches::write(&store, Some(conn), item).await
            })
        };
        let mut claims = claims.into_iter();
        // The first is written alone, on its caller's connection, and waits for the lock.
        let alone = write(claims.next().unwrap());
        let waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
        while db.scalar(waiting).await < 1 {
            tokio::task::yield_now().await;
        }
        // The others are queued: each lane takes one and waits for the lock too.
        let given_up: Vec<_> = claims.map(write).collect();
        let lanes = i64::try_from(LANES).unwrap();
        while db.scalar(waiting).await < 1 + lanes {
            tokio::task::yield_now().await;
        }
        let behind = write(free).await.unwrap();
        assert!(matches!(behind, Ok(Unlocked::Applied { .. })), "{behind:?}");
        for claim in given_up {
            let answer = claim.await.unwrap();
            assert!(
                answer.as_ref().is_err_and(StoreError::is_retryable),
                "{answer:?}"
            );
        }
        holder.close().await.unwrap();
        let first = alone.await.unwrap();
        assert!(matches!(first, Ok(Unlocked::Applied { .. })), "{first:?}");
    }

    /// A claim decided from a read that found nothing stored, with a token of its own.
    async fn claim(backend: &PgBackend, cmd: &BeginCommand) -> Item {
        let (mut conn, _) = backend.connection().await.unwrap();
        let (_, now, token) = backend
            .read_claimable(&mut conn, TENANT, &cmd.operation_id)
            .await
            .unwrap();
        let guard = FreshIdGuard::Clear {
            token: token.unwrap(),
        };
        let (_, plan) = machine::claim(None, cmd, guard, now);
        Item::of(Decision::new(None, &plan, now).guarded(cmd)).unwrap()
    }

    /// Claims written together are each written with their attempt and event as a lone one
    /// is; one whose intent another open operation holds is blocked by it, and one whose id
    /// was stored since its read is found changed; neither writes anything.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_written_together_are_each_checked_as_one_alone() {
        let (db, backend) = postgres().await;
        let ledger = Ledger::new(backend.clone());
        let held = command("holder", 9);
        ledger.begin(&held).await.unwrap();
        let taken = command("taken", 8);
        let cmds = [
            command("first", 1),
            command("second", 2),
            command("third", 3),
            command("blocked", 9),
            taken.clone(),
        ];
        let mut items = Vec::new();
        for cmd in &cmds {
            items.push(claim(&backend, cmd).await);
        }
        // Stored by another call after this one read nothing there.
        ledger.begin(&taken).await.unwrap();
        let (batch, answers) = queued(items);
        let mut conn = connection(&backend, None).await.unwrap();
        let met = write_batch(&mut conn, batch).await;
        assert!(!met.split && !met.lost, "{met:?}");

        let mut outcomes = Vec::new();
        for answer in answers {
            outcomes.push(answer.await.unwrap().unwrap());
        }
        for (cmd, outcome) in cmds.iter().zip(&outcomes).take(3) {
            let id = cmd.operation_id.as_str();
            assert!(
                matches!(outcome, Unlocked::Applied { .. }),
                "{id}: {outcome:?}"
            );
            let op = backend
                .read(TENANT, &cmd.operation_id)
                .await
                .unwrap()
                .0
                .unwrap();
            assert_eq!((op.state, op.attempt), (State::InFlight, 1), "{id}");
            let (attempts, _) = backend
                .history(TENANT, &cmd.operation_id, op.life)
                .await
                .unwrap();
            assert_eq!(attempts.len(), 1, "{id}");
            let claimed = db
                .scalar(&format!(
                    "SELECT count(*) FROM events WHERE operation_id = '{id}' AND kind = 'CLAIMED'"
                ))
                .await;
            assert_eq!(claimed, 1, "{id}");
        }
        match &outcomes[3] {
            Unlocked::Blocked(by) => assert_eq!(by.operation_id, held.operation_id),
            other => panic!("{other:?}"),
        }
        assert!(backend
            .read(TENANT, &cmds[3].operation_id)
            .await
            .unwrap()
            .0
            .is_none());
        assert_eq!(outcomes[4], Unlocked::Changed);
        let taken_claims = db
            .scalar("SELECT count(*) FROM events WHERE operation_id = 'taken' AND kind = 'CLAIMED'")
            .await;
        assert_eq!(taken_claims, 1);
    }

    /// Two lanes (or replicas) writing decisions about the same operations, queued in opposite
    /// orders, lock them in one order: neither statement fails for a deadlock, and each
    /// operation is confirmed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_over_the_same_operations_lock_them_in_one_order() {
        let (db, backend) = postgres().await;
        // Enough rows that the statements find each by its index, one after another.
        db.execute(
            "INSERT INTO operations (tenant, operation_id, tool, fingerprint, state, source, \
             attempt, fencing_token, life, attempt_id, executor, provider_key, retention_ms, \
             lease_started_at, lease_deadline, created_at, updated_at, expires_at) SELECT 'other', 'op-' || n, 'refund', \
             '\\x00', 'CONFIRMED', 'EXECUTOR', 1, n, n, 'a', 'e', 'k', 1, 0, 0, 0, 0, 0 \
             FROM generate_series(1, 20000) AS n",
        )
        .await;
        db.execute("ANALYZE operations").await;
        for round in 0..20 {
            let ids: Vec<String> = (0..8).map(|n| format!("r{round}-op{n}")).collect();
            let forward = confirms(&backend, &ids).await;
            let mut backward = forward.clone();
            backward.reverse();
            let (forward, forward_answers) = queued(forward);
            let (backward, backward_answers) = queued(backward);
            let mut one = connection(&backend, None).await.unwrap();
            let mut other = connection(&backend, None).await.unwrap();
            let (a, b) = tokio::join!(
                write_batch(&mut one, forward),
                write_batch(&mut other, backward)
            );
            assert!(!a.split && !b.split, "round {round}: {a:?} {b:?}");
            let mut applied = 0;
            for answer in forward_answers.into_iter().chain(backward_answers) {
                match answer.await.unwrap().unwrap() {
                    Unlocked::Applied { .. } => applied += 1,
                    Unlocked::Changed => {}
                    other => panic!("{other:?}"),
                }
            }
            assert_eq!(applied, ids.len(), "round {round}");
            for id in &ids {
                assert_eq!(confirmed_events(&db, id).await, 1, "{id}");
            }
        }
    }

    /// A batch holds one item per operation and one claim per intent; the rest wait for the
    /// next, in the order they came. An item whose caller stopped waiting is dropped.
    #[test]
    fn a_batch_holds_one_item_per_operation_and_one_claim_per_intent() {
        let now = 1_000;
        let claim = |id: &str, fingerprint: u8| {
            let cmd = command(id, fingerprint);
            let token = FencingToken(7);
            let (_, plan) = machine::claim(None, &cmd, FreshIdGuard::Clear { token }, now);
            Item::of(Decision::new(None, &plan, now).guarded(&cmd)).unwrap()
        };
        let items = vec![
            claim("a", 1),
            claim("a", 2),
            claim("b", 1),
            claim("c", 3),
            claim("gone", 4),
            claim("d", 1),
        ];
        let (queued, mut answers) = queued(items);
        drop(answers.remove(4));
        let batches = Batches::default();
        {
            let mut queue = batches.lock();
            queue.waiting.extend(queued);
            queue.lanes = 1;
        }
        let keys = |batch: Batch| -> Vec<String> {
            let Batch::Writes(writes) = batch else {
                panic!("reads taken for a writing lane")
            };
            writes.iter().map(|q| q.item.key().1.to_owned()).collect()
        };
        let mut none = None;
        assert_eq!(
            keys(batches.take(Kind::Writes, &mut none).unwrap()),
            ["a", "c"]
        );
        assert_eq!(
            keys(batches.take(Kind::Writes, &mut none).unwrap()),
            ["a", "b"]
        );
        assert_eq!(keys(batches.take(Kind::Writes, &mut none).unwrap()), ["d"]);
        assert!(batches.take(Kind::Writes, &mut none).is_none());
        assert_eq!(batches.lock().lanes, 0);
    }

    /// Calls begun while another is under way take no connection from the pool: their reads
    /// are made together in a lane's statement, and each is answered with its own operation,
    /// the stored ones as stored and each new one with a token of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_begun_together_read_together_each_its_own_operation() {
        let (_db, backend) = postgres().await;
        let stored: Vec<String> = (0..8).map(|n| format!("stored-{n}")).collect();
        confirms(&backend, &stored).await;
        let (first, _) = backend.connection().await.unwrap();
        assert!(
            first.pooled.is_some(),
            "a call begun alone reads on its own connection"
        );
        let mut calls = tokio::task::JoinSet::new();
        for n in 0..32 {
            let id = match n % 2 {
                0 => stored[n / 4].clone(),
                _ => format!("new-{n}"),
            };
            let backend = backend.clone();
            calls.spawn(async move {
                let (mut call, _) = backend.connection().await.unwrap();
                assert!(call.pooled.is_none());
                let id = OperationId::parse("id", &id).unwrap();
                let found = backend.read_claimable(&mut call, TENANT, &id).await;
                // What it waited for counts as the wait for its write's start.
                assert!(backend.read_waited(&call) > Duration::ZERO);
                (id, found.unwrap())
            });
        }
        let mut tokens = std::collections::HashSet::new();
        while let Some(call) = calls.join_next().await {
            let (id, (op, _, token)) = call.unwrap();
            match id.as_str().strip_prefix("new-") {
                Some(_) => {
                    assert!(op.is_none(), "{id}");
                    assert!(tokens.insert(token.unwrap()), "{id}: a token twice");
                }
                None => {
                    assert_eq!(op.unwrap().operation_id, id);
                    assert_eq!(token, None, "{id}");
                }
            }
        }
        drop(first);
        let queue = backend.batches.lock();
        assert_eq!(backend.batches.calls.load(Ordering::Relaxed), 0);
        assert_eq!(queue.reading.len(), 0);
    }

    /// A statement of reads the database refuses answers none of them: each is read alone, and
    /// only the one it cannot read fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_refused_together_are_read_one_by_one() {
        let (_db, backend) = postgres().await;
        confirms(&backend, &["kept".to_owned()]).await;
        let mut answers = Vec::new();
        let reads: Vec<QueuedRead> = ["kept", "poisoned", "new"]
            .into_iter()
            .map(|id| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                let tenant = match id {
                    // PostgreSQL refuses a NUL in text.
                    "poisoned" => "t\0",
                    _ => TENANT,
                };
                let read = Read {
                    tenant: tenant.to_owned(),
                    id: OperationId::parse("id", id).unwrap(),
                    claim: true,
                };
                QueuedRead { read, reply }
            })
            .collect();
        let mut conn = connection(&backend, None).await.unwrap();
        let met = read_batch(&mut conn, reads).await;
        assert!(met.split && !met.broken, "{met:?}");
        let mut answered = Vec::new();
        for answer in answers {
            answered.push(answer.await.unwrap());
        }
        let kept = answered[0].as_ref().unwrap();
        assert_eq!(kept.0.as_ref().unwrap().operation_id.as_str(), "kept");
        assert!(answered[1].is_err(), "{:?}", answered[1]);
        let new = answered[2].as_ref().unwrap();
        assert!(new.0.is_none() && new.2.is_some(), "{new:?}");
    }

    /// Planned once, generically, over empty tables, as a lane's new connection plans it, the
    /// reads' statement finds each operation by its key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_planned_over_empty_tables_find_each_operation_by_its_key() {
        let (_db, backend) = postgres().await;
        let mut lane = connection(&backend, None).await.unwrap();
        let types = "(TEXT[], TEXT[], BOOLEAN[])";
        let plan =
            crate::tests::prepared_plan(&mut lane, types, &READ_MANY, "(NULL, NULL, NULL)").await;
        let nodes = crate::tests::plan_nodes(&plan);
        assert!(
            nodes
                .iter()
                .any(|node| node["Index Name"] == "operations_pkey"),
            "{plan:#}"
        );
        for node in nodes {
            assert!(
                node["Node Type"] != "Seq Scan" || node["Relation Name"].is_null(),
                "{plan:#}"
            );
        }
    }

    /// Reads made in one statement are each answered as the read alone would be: the stored
    /// operation as stored, and a token only for a claim of an operation not stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_made_together_are_each_answered_as_alone() {
        let (_db, backend) = postgres().await;
        confirms(&backend, &["kept".to_owned()]).await;
        let asked = [
            ("kept", true),
            ("new", true),
            ("kept", false),
            ("other", false),
        ];
        let mut answers = Vec::new();
        let reads: Vec<QueuedRead> = asked
            .iter()
            .map(|&(id, claim)| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                let read = Read {
                    tenant: TENANT.to_owned(),
                    id: OperationId::parse("id", id).unwrap(),
                    claim,
                };
                QueuedRead { read, reply }
            })
            .collect();
        let mut conn = connection(&backend, None).await.unwrap();
        let met = read_batch(&mut conn, reads).await;
        assert!(!met.split && !met.broken, "{met:?}");
        for ((id, claim), answer) in asked.into_iter().zip(answers) {
            let (op, _, token) = answer.await.unwrap().unwrap();
            match id {
                "kept" => assert_eq!(op.unwrap().operation_id.as_str(), "kept"),
                _ => assert!(op.is_none(), "{id}"),
            }
            assert_eq!(
                token.is_some(),
                claim && id != "kept",
                "{id}, claim {claim}"
            );
        }
    }

    /// A read made with others never waits for a write waiting for a lock: the lanes that
    /// write are not the lane that reads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_never_waits_for_a_write_waiting_for_a_lock() {
        let (db, backend) = postgres().await;
        confirms(&backend, &["kept".to_owned()]).await;
        let stuck: Vec<BeginCommand> = (0..3).map(|n| command(&format!("stuck-{n}"), 5)).collect();
        let mut claims = Vec::new();
        for cmd in &stuck {
            claims.push(claim(&backend, cmd).await);
        }
        let mut holder = connection(&backend, None).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(crate::postgres::intent_key(&stuck[0]))
            .execute(&mut holder)
            .await
            .unwrap();
        // One claim written alone, the others by the writing lanes: each one written waits for
        // the lock.
        let writes: Vec<_> = claims
            .into_iter()
            .map(|item| {
                let backend = backend.clone();
                tokio::spawn(async move { Batches::write(&backend, None, item).await })
            })
            .collect();
        let waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
        let lanes = i64::try_from(LANES).unwrap();
        while db.scalar(waiting).await < 1 + lanes {
            tokio::task::yield_now().await;
        }
        // A call begun while another is under way reads through the reading lane.
        let (_first, _) = backend.connection().await.unwrap();
        let (mut call, _) = backend.connection().await.unwrap();
        assert!(call.pooled.is_none());
        let id = OperationId::parse("id", "kept").unwrap();
        let read = backend.read_claimable(&mut call, TENANT, &id);
        let (op, _, _) = tokio::time::timeout(Duration::from_secs(30), read)
            .await
            .expect("the read waited for the writes")
            .unwrap();
        assert_eq!(op.unwrap().state, State::InFlight);
        assert_eq!(db.scalar(waiting).await, 1 + lanes, "the writes still wait");
        holder.close().await.unwrap();
        // One claim of the intent is written; the others find it blocking them.
        let mut applied = 0;
        for write in writes {
            match write.await.unwrap() {
                Ok(Unlocked::Applied { .. }) => applied += 1,
                Ok(Unlocked::Blocked(_)) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(applied, 1);
    }
}
