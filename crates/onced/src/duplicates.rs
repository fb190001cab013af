//! Forensics: every Begin answered without a new execution right (a replay, IN_PROGRESS,
//! UNKNOWN, CONFLICT, the same grant again) is recorded with the transport context that
//! carried it, so `GetOperation` can say where an operation's repeated calls came from.
//!
//! Recording is off the Begin's path: the answer goes out at once, and a writer task stores
//! what queued up meanwhile in one statement. The queue is bounded; when it is full (the store
//! is slower than the duplicates) a record is dropped and counted, never waited for. A record
//! is evidence for people, not state the ledger decides by, so losing one at a crash costs an
//! explanation, never a decision.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use once_core::forensics::Duplicate;
use once_store::Backend;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Records waiting for the writer.
const QUEUE: usize = 8192;
/// Records written per statement.
const BATCH: usize = 256;

/// Takes records from the Begin path. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Recorder {
    sender: mpsc::Sender<Duplicate>,
    dropped: Arc<AtomicU64>,
}

/// The writer's end of the queue.
#[derive(Debug)]
pub struct Queue(mpsc::Receiver<Duplicate>);

impl Recorder {
    pub fn new() -> (Self, Queue) {
        let (sender, receiver) = mpsc::channel(QUEUE);
        let recorder = Recorder {
            sender,
            dropped: Arc::default(),
        };
        (recorder, Queue(receiver))
    }

    /// Queues a record; drops it (and counts it) when the queue is full.
    pub fn record(&self, duplicate: Duplicate) {
        if self.sender.try_send(duplicate).is_err() {
            let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if dropped.is_power_of_two() {
                tracing::warn!(dropped, "duplicate records dropped: the store is behind");
            }
        }
    }
}

/// Writes queued records until `stop`, then what is left.
pub async fn write<B: Backend>(backend: B, queue: Queue, stop: CancellationToken) {
    let Queue(mut receiver) = queue;
    loop {
        let first = tokio::select! {
            first = receiver.recv() => first,
            _ = stop.cancelled() => None,
        };
        let Some(first) = first else {
            break;
        };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match receiver.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        store(&backend, &batch).await;
    }
    // What the last Begins queued before the stop.
    receiver.close();
    let mut rest = Vec::new();
    while let Ok(next) = receiver.try_recv() {
        rest.push(next);
    }
    for batch in rest.chunks(BATCH) {
        store(&backend, batch).await;
    }
}

async fn store<B: Backend>(backend: &B, batch: &[Duplicate]) {
    let mut pause = Duration::from_millis(50);
    for try_number in 1..=3 {
        match backend.record_duplicates(batch).await {
            Ok(()) => return,
            Err(error) if try_number < 3 && error.is_retryable() => {
                tokio::time::sleep(pause).await;
                pause *= 4;
            }
            Err(error) => {
                tracing::warn!(%error, records = batch.len(), "could not record duplicates; they are lost");
                return;
            }
        }
    }
}
