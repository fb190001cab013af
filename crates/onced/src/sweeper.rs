//! Background work every replica runs: expiring leases, deleting what retention allows, and
//! telling the health service whether the database answers (the reconciliation workers are in
//! [`crate::reconciliation`]). All run on [`every`].
//!
//! All are safe to run on every replica at once: each lease expiry locks its operation and
//! re-checks it, and each deletion re-checks state and expiry on the row it deletes.
//!
//! The health sweeper reports NOT_SERVING while the database does not answer or does not commit a
//! write: `Ledger::ping` commits a write that changes nothing on SQLite, and once the storage
//! refused a write, a 1 MiB row written and deleted again, until one commits; PostgreSQL is asked
//! whether it is read-only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use once_api::pb::ledger_server::SERVICE_NAME;
use once_store::{Backend, Ledger, StoreError};
use tokio_util::sync::CancellationToken;

use crate::rounds::every;
use crate::telemetry::Metrics;

/// Operations looked at per lease sweep.
const LEASE_BATCH: u32 = 500;
/// Rows deleted per statement by the retention sweeper.
const RETENTION_BATCH: u32 = 1000;

/// Logs what one sweep did: nothing when it found nothing, `done(count)` otherwise.
fn logged<N>(swept: Result<N, StoreError>, done: impl FnOnce(N), what: &str)
where
    N: PartialEq + Default,
{
    match swept {
        Ok(count) if count == N::default() => {}
        Ok(count) => done(count),
        Err(error) => tracing::warn!(%error, "{what} sweep failed; will retry"),
    }
}

/// Turns IN_FLIGHT operations past their lease into UNKNOWN, every `interval`, until `stop`.
pub async fn leases<B: Backend>(ledger: Ledger<B>, interval: Duration, stop: CancellationToken) {
    let ledger = &ledger;
    every(interval, &stop, || async move {
        let moved = ledger.sweep_leases(LEASE_BATCH).await;
        let done = |moved| tracing::info!(moved, "leases expired: operations are now UNKNOWN");
        logged(moved, done, "lease");
    })
    .await;
}

/// Deletes settled operations past retention (an ABSENT one no sooner than
/// `provider_key_window` after it settled) and events past `event_retention`.
pub async fn retention<B: Backend>(
    ledger: Ledger<B>,
    interval: Duration,
    (provider_key_window, event_retention): (Duration, Duration),
    stop: CancellationToken,
) {
    let ms = once_core::duration_ms;
    let (window_ms, event_age_ms) = (ms(provider_key_window), ms(event_retention));
    let ledger = &ledger;
    every(interval, &stop, || async move {
        let deleted = ledger.sweep_retention(RETENTION_BATCH, window_ms).await;
        let done = |deleted| tracing::info!(deleted, "settled operations past retention deleted");
        logged(deleted, done, "retention");
        let deleted = ledger.sweep_events(event_age_ms, RETENTION_BATCH).await;
        logged(
            deleted,
            |deleted| tracing::info!(deleted, "old events deleted"),
            "event",
        );
    })
    .await;
}

/// Reports the ledger NOT_SERVING while the database does not answer or cannot write (see
/// [`Ledger::ping`]), so load balancers and orchestrators send calls to a replica that can
/// serve them.
pub async fn health<B: Backend>(
    ledger: Ledger<B>,
    reporter: tonic_health::server::HealthReporter,
    metrics: std::sync::Arc<Metrics>,
    interval: Duration,
    stop: CancellationToken,
) {
    let serving = AtomicBool::new(true);
    let (ledger, reporter, serving, metrics) = (&ledger, &reporter, &serving, &metrics);
    every(interval, &stop, || async move {
        let checked = ledger.ping().await;
        let up = checked.is_ok();
        metrics.store_up(up);
        if serving.swap(up, Ordering::Relaxed) != up {
            announce(reporter, checked.err()).await;
        }
    })
    .await;
}

/// Tells the health service, and the log, that the ledger serves, or does not for `failed`.
async fn announce(
    reporter: &tonic_health::server::HealthReporter,
    failed: Option<once_store::StoreError>,
) {
    let status = if let Some(error) = failed {
        let cause = std::error::Error::source(&error).map_or_else(String::new, ToString::to_string);
        tracing::warn!(%error, cause, "the database does not answer or cannot write: not serving");
        tonic_health::ServingStatus::NotServing
    } else {
        tracing::info!("the database answers and writes again: serving");
        tonic_health::ServingStatus::Serving
    };
    reporter.set_service_status(SERVICE_NAME, status).await;
    reporter.set_service_status("", status).await;
}
