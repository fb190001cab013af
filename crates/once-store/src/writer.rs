//! Group commit: one writer task per ledger takes the writes queued by many callers, runs them
//! one after another in one transaction, and commits them together, so they share one commit
//! and one flush to disk. Each caller is answered only after that commit.
//!
//! A write that fails is undone alone: in a shared transaction each write runs inside its own
//! savepoint, rolled back when it fails, so the others still commit. A batch whose transaction
//! cannot start, breaks, or fails to commit fails every write in it, and none of it is applied.
//! A write whose caller stopped waiting before it ran is not run.
//!
//! Used where one writer at a time is all the database allows anyway (SQLite's write lock):
//! queued writers then cost no lock waits, and the commit is shared.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::{Backend, StoreError};

/// How many writes share one transaction at most.
pub const MAX_BATCH: usize = 64;
/// How many writes may wait for the writer; callers beyond it wait to queue.
const QUEUE: usize = 1024;

/// The work of one write, run in a transaction it shares.
pub(crate) type TxFuture<'t, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 't>>;

/// `work` as a write over any borrow of a transaction (what closure inference needs told).
pub(crate) fn over_tx<Tx, T, F>(work: F) -> F
where
    F: for<'t> FnOnce(&'t mut Tx) -> TxFuture<'t, T>,
{
    work
}

/// One caller's write, type-erased for the queue.
trait Job<Tx>: Send {
    /// Whether its caller still waits for the answer.
    fn wanted(&self) -> bool;
    fn run<'t>(
        self: Box<Self>,
        tx: &'t mut Tx,
    ) -> Pin<Box<dyn Future<Output = Box<dyn Ran>> + Send + 't>>;
    fn fail(self: Box<Self>, error: StoreError);
}

/// A write that ran, waiting for the batch's commit.
trait Ran: Send {
    /// Its own error, when it failed.
    fn error(&self) -> Option<&StoreError>;
    /// Answers its caller: its own error, or its value once `committed`.
    fn answer(self: Box<Self>, committed: Result<(), &StoreError>);
}

struct Work<T, F> {
    work: F,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

struct Outcome<T> {
    result: Result<T, StoreError>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<Tx, T, F> Job<Tx> for Work<T, F>
where
    Tx: Send,
    T: Send + 'static,
    F: for<'t> FnOnce(&'t mut Tx) -> TxFuture<'t, T> + Send + 'static,
{
    fn wanted(&self) -> bool {
        !self.reply.is_closed()
    }

    fn run<'t>(
        self: Box<Self>,
        tx: &'t mut Tx,
    ) -> Pin<Box<dyn Future<Output = Box<dyn Ran>> + Send + 't>> {
        let Work { work, reply } = *self;
        Box::pin(async move {
            let result = work(tx).await;
            Box::new(Outcome { result, reply }) as Box<dyn Ran>
        })
    }

    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.reply.send(Err(error));
    }
}

impl<T: Send> Ran for Outcome<T> {
    fn error(&self) -> Option<&StoreError> {
        self.result.as_ref().err()
    }

    fn answer(self: Box<Self>, committed: Result<(), &StoreError>) {
        let answer = match (self.result, committed) {
            (Err(error), _) => Err(error),
            (Ok(value), Ok(())) => Ok(value),
            (Ok(_), Err(error)) => Err(error.again()),
        };
        let _ = self.reply.send(answer);
    }
}

/// The queue to a ledger's writer task. Cheap to clone; the task ends when every clone is gone.
pub(crate) struct Writer<B: Backend> {
    queue: mpsc::Sender<Box<dyn Job<B::Tx>>>,
    refusals: Arc<Refusals>,
}

/// Writes the database's storage refused (a full disk, a failing device), for the health
/// check: how many, and how many of them a later check found room for again.
#[derive(Debug, Default)]
struct Refusals {
    seen: AtomicU64,
    cleared: AtomicU64,
}

impl Refusals {
    fn note(&self, error: &StoreError) {
        if error.is_storage_failure() {
            self.seen.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<B: Backend> Clone for Writer<B> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            refusals: self.refusals.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Writer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("queued", &(QUEUE - self.queue.capacity()))
            .finish()
    }
}

impl<B: Backend> Writer<B> {
    /// Starts the writer task of `backend`.
    pub(crate) fn spawn(backend: B) -> Self {
        let (queue, jobs) = mpsc::channel(QUEUE);
        let refusals = Arc::<Refusals>::default();
        tokio::spawn(write_batches(backend, jobs, refusals.clone()));
        Self { queue, refusals }
    }

    /// Whether the storage refused a write since a check last found room: the count of
    /// refusals to pass to [`Writer::room_again`] when one does.
    pub(crate) fn refused(&self) -> Option<u64> {
        let seen = self.refusals.seen.load(Ordering::Relaxed);
        (seen != self.refusals.cleared.load(Ordering::Relaxed)).then_some(seen)
    }

    /// A check found room for writes again after the first `seen` refusals.
    pub(crate) fn room_again(&self, seen: u64) {
        self.refusals.cleared.fetch_max(seen, Ordering::Relaxed);
    }

    /// Runs `work` in the next batch's transaction and answers once that has committed.
    pub(crate) async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'t> FnOnce(&'t mut B::Tx) -> TxFuture<'t, T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Box::new(Work { work, reply }))
            .await
            .map_err(|_| StoreError::Unavailable(sqlx::Error::PoolClosed))?;
        // Its batch ended without an answer (a bug panicked in it): nothing of it committed.
        answer.await.map_err(|_| {
            StoreError::Internal(sqlx::Error::Protocol(
                "a batch of writes ended without an answer".into(),
            ))
        })?
    }
}

/// The writer task: a batch of whatever is queued, in one transaction, until the queue closes.
/// Each batch runs as a task of its own, so a write that panics fails its batch (dropped
/// uncommitted, its callers answered with an error) and the writer goes on.
async fn write_batches<B: Backend>(
    backend: B,
    mut jobs: mpsc::Receiver<Box<dyn Job<B::Tx>>>,
    refusals: Arc<Refusals>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while jobs.recv_many(&mut batch, MAX_BATCH).await > 0 {
        batch.retain(|job| job.wanted());
        if batch.is_empty() {
            continue;
        }
        let written = tokio::spawn(write_batch(
            backend.clone(),
            std::mem::take(&mut batch),
            refusals.clone(),
        ));
        if let Err(error) = written.await {
            tracing::error!(%error, "a batch of writes failed without an answer; none of it was applied");
        }
    }
}

/// One batch in one transaction.
async fn write_batch<B: Backend>(
    backend: B,
    batch: Vec<Box<dyn Job<B::Tx>>>,
    refusals: Arc<Refusals>,
) {
    let mut tx = match backend.begin_write().await {
        Ok(tx) => tx,
        Err(error) => {
            refusals.note(&error);
            for job in batch {
                job.fail(error.again());
            }
            return;
        }
    };
    // Alone, a failed write is undone by not committing; shared, by its savepoint. The
    // savepoint of a write that succeeded stays open until the next write's is marked, in the
    // same round trip, or until the commit: one round trip a write.
    let shared = batch.len() > 1;
    let mut ran: Vec<Box<dyn Ran>> = Vec::with_capacity(batch.len());
    let mut broken: Option<StoreError> = None;
    let mut open = false;
    for job in batch {
        if let Some(error) = &broken {
            job.fail(error.again());
            continue;
        }
        if shared {
            let marked = match open {
                true => backend.savepoint_again(&mut tx).await,
                false => backend.savepoint(&mut tx).await,
            };
            if let Err(error) = marked {
                // Releasing the last write's savepoint failed, or marking this one: the
                // database may have rolled the whole transaction back itself.
                job.fail(error.again());
                broken = Some(error);
                continue;
            }
        }
        let outcome = job.run(&mut tx).await;
        open = shared && outcome.error().is_none();
        if shared && !open {
            if let Err(error) = backend.rollback_to_savepoint(&mut tx).await {
                // The database rolled the whole transaction back itself (a full disk, an I/O
                // error) and took the savepoint with it: nothing of the batch is applied, and
                // the write's own error says why.
                broken = Some(match outcome.error() {
                    Some(cause) if cause.is_retryable() => cause.again(),
                    _ => error,
                });
            }
        }
        ran.push(outcome);
    }
    let committed = match broken {
        // Dropping the transaction rolls it back: nothing of the batch is applied.
        Some(error) => Err(error),
        None if !shared && ran.iter().all(|r| r.error().is_some()) => Ok(()),
        None => backend.commit(tx).await,
    };
    if let Err(error) = &committed {
        refusals.note(error);
    }
    for outcome in ran {
        if let Some(error) = outcome.error() {
            refusals.note(error);
        }
        outcome.answer(committed.as_ref().map(|_| ()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sealed::Transactions;
    use crate::SqliteBackend;

    async fn store() -> (tempfile::TempDir, SqliteBackend) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("writer.db").display());
        let store = SqliteBackend::connect(&url).await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE parent (id INTEGER PRIMARY KEY); \
             CREATE TABLE child (id INTEGER PRIMARY KEY, \
             parent INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)",
        )
        .execute(store.pool())
        .await
        .unwrap();
        (dir, store)
    }

    /// `insert(id, fail)` sent to the writer from a task of its own.
    fn inserting(
        writer: &Writer<SqliteBackend>,
        id: i64,
        fail: bool,
    ) -> tokio::task::JoinHandle<Result<i64, StoreError>> {
        let writer = writer.clone();
        tokio::spawn(async move { writer.write(insert(id, fail)).await })
    }

    /// A write inserting parent `id`, failing afterwards when `fail`.
    fn insert(
        id: i64,
        fail: bool,
    ) -> impl for<'t> FnOnce(&'t mut <SqliteBackend as Transactions>::Tx) -> TxFuture<'t, i64> {
        over_tx(move |tx: &mut <SqliteBackend as Transactions>::Tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO parent (id) VALUES ($1)")
                    .bind(id)
                    .execute(&mut **tx)
                    .await?;
                if fail {
                    return Err(StoreError::NotFound);
                }
                Ok(id)
            })
        })
    }

    async fn parents(store: &SqliteBackend) -> Vec<i64> {
        sqlx::query_scalar("SELECT id FROM parent ORDER BY id")
            .fetch_all(store.pool())
            .await
            .unwrap()
    }

    /// Holds the writer in its current batch until the returned sender is dropped.
    async fn hold(
        writer: &Writer<SqliteBackend>,
    ) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let (release, released) = oneshot::channel::<()>();
        let (running, ran) = oneshot::channel::<()>();
        let held = writer.clone();
        let task = tokio::spawn(async move {
            held.write(over_tx(
                move |_tx: &mut <SqliteBackend as Transactions>::Tx| {
                    Box::pin(async move {
                        let _ = running.send(());
                        let _ = released.await;
                        Ok(())
                    })
                },
            ))
            .await
            .unwrap();
        });
        ran.await.unwrap();
        (release, task)
    }

    /// Waits until `n` writes are queued behind the one running.
    async fn queued(writer: &Writer<SqliteBackend>, n: usize) {
        let waiting = async {
            while QUEUE - writer.queue.capacity() < n {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(30), waiting)
            .await
            .expect("the writes to be queued");
    }

    #[tokio::test]
    async fn a_failed_write_is_undone_alone_and_the_rest_of_its_batch_commits() {
        let (_dir, store) = store().await;
        let writer = Writer::spawn(store.clone());
        let (release, held) = hold(&writer).await;
        // Two failures in a row, each undone to its own savepoint; then two successes, the
        // first's savepoint released as the second's is marked; then a failure last, undone to
        // the savepoint marked as the one before it was released.
        let writes: Vec<_> = [
            (1, false),
            (2, true),
            (3, true),
            (4, false),
            (5, false),
            (6, true),
        ]
        .into_iter()
        .map(|(id, fail)| inserting(&writer, id, fail))
        .collect();
        queued(&writer, 6).await;
        drop(release);
        held.await.unwrap();
        let mut answers = Vec::new();
        for write in writes {
            answers.push(write.await.unwrap().ok());
        }
        assert_eq!(answers, [Some(1), None, None, Some(4), Some(5), None]);
        assert_eq!(parents(&store).await, [1, 4, 5]);
    }

    /// What SQLite does itself when a write fails for want of disk, done by hand in the middle
    /// of a batch: the transaction ends under the writer. Releasing that write's savepoint then
    /// fails, so no write after it runs outside the transaction (each would commit on its own)
    /// and no write of the batch is answered as committed.
    #[tokio::test]
    async fn a_batch_whose_transaction_the_database_ended_answers_no_write_as_committed() {
        let (_dir, store) = store().await;
        let writer = Writer::spawn(store.clone());
        let (release, held) = hold(&writer).await;
        let first = inserting(&writer, 1, false);
        let ending = writer.clone();
        let ended = tokio::spawn(async move {
            ending
                .write(over_tx(|tx: &mut <SqliteBackend as Transactions>::Tx| {
                    Box::pin(async move {
                        sqlx::query("ROLLBACK").execute(&mut **tx).await?;
                        Ok(2)
                    })
                }))
                .await
        });
        let after = inserting(&writer, 3, false);
        queued(&writer, 3).await;
        drop(release);
        held.await.unwrap();
        assert!(first.await.unwrap().is_err(), "a write the rollback undid");
        assert!(ended.await.unwrap().is_err(), "a write of an ended batch");
        assert!(
            after.await.unwrap().is_err(),
            "a write after the batch ended"
        );
        assert!(parents(&store).await.is_empty());
        // The writer goes on.
        assert_eq!(writer.write(insert(4, false)).await.unwrap(), 4);
        assert_eq!(parents(&store).await, [4]);
    }

    #[tokio::test]
    async fn a_batch_whose_commit_fails_fails_every_write_and_applies_none() {
        let (_dir, store) = store().await;
        let writer = Writer::spawn(store.clone());
        let (release, held) = hold(&writer).await;
        let mut writes: Vec<_> = [4, 5]
            .into_iter()
            .map(|id| inserting(&writer, id, false))
            .collect();
        // A child of no parent: allowed until the commit, which it makes fail.
        let orphan = writer.clone();
        writes.push(tokio::spawn(async move {
            orphan
                .write(over_tx(|tx: &mut <SqliteBackend as Transactions>::Tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO child (id, parent) VALUES (1, 99)")
                            .execute(&mut **tx)
                            .await?;
                        Ok(0)
                    })
                }))
                .await
        }));
        queued(&writer, 3).await;
        drop(release);
        // The holding write's batch commits alone; the next three share one commit.
        held.await.unwrap();
        for write in writes {
            assert!(write.await.unwrap().is_err(), "a write of a failed batch");
        }
        assert!(parents(&store).await.is_empty());
        // The writer goes on.
        assert_eq!(writer.write(insert(6, false)).await.unwrap(), 6);
        assert_eq!(parents(&store).await, [6]);
    }

    #[tokio::test]
    async fn a_write_that_panics_fails_its_batch_and_the_writer_goes_on() {
        let (_dir, store) = store().await;
        let writer = Writer::spawn(store.clone());
        let (release, held) = hold(&writer).await;
        let first = inserting(&writer, 9, false);
        let panicking = {
            let writer = writer.clone();
            tokio::spawn(async move {
                writer
                    .write(over_tx(|_tx: &mut <SqliteBackend as Transactions>::Tx| {
                        Box::pin(async move {
                            if true {
                                panic!("a bug in a write");
                            }
                            Ok(0)
                        })
                    }))
                    .await
            })
        };
        queued(&writer, 2).await;
        drop(release);
        held.await.unwrap();
        assert!(first.await.unwrap().is_err(), "its batch is not applied");
        assert!(panicking.await.unwrap().is_err());
        assert_eq!(writer.write(insert(10, false)).await.unwrap(), 10);
        assert_eq!(parents(&store).await, [10]);
    }

    #[tokio::test]
    async fn a_write_whose_caller_gave_up_before_it_ran_is_not_run() {
        let (_dir, store) = store().await;
        let writer = Writer::spawn(store.clone());
        let (release, held) = hold(&writer).await;
        let abandoned = inserting(&writer, 7, false);
        queued(&writer, 1).await;
        abandoned.abort();
        assert!(abandoned.await.unwrap_err().is_cancelled());
        drop(release);
        held.await.unwrap();
        // Written after it, so answered after the abandoned one was passed over.
        assert_eq!(writer.write(insert(8, false)).await.unwrap(), 8);
        assert_eq!(parents(&store).await, [8]);
    }
}
