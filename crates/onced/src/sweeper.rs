//! Background work every replica runs: expiring leases, deleting what retention allows, and
//! telling the health service whether the database answers.
//!
//! Both are safe to run on every replica at once: each lease expiry locks its operation and
//! re-checks it, and each deletion re-checks state and expiry on the row it deletes.

use std::time::Duration;

use once_store::{Backend, Ledger};
use tokio_util::sync::CancellationToken;

/// Operations looked at per lease sweep.
const LEASE_BATCH: u32 = 500;
/// Rows deleted per statement by the retention sweeper.
const RETENTION_BATCH: u32 = 1000;

/// Turns IN_FLIGHT operations past their lease into UNKNOWN, every `interval`, until `stop`.
pub async fn leases<B: Backend>(ledger: Ledger<B>, interval: Duration, stop: CancellationToken) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        match ledger.sweep_leases(LEASE_BATCH).await {
            Ok(0) => {}
            Ok(moved) => tracing::info!(moved, "leases expired: operations are now UNKNOWN"),
            Err(error) => tracing::warn!(%error, "lease sweep failed; will retry"),
        }
    }
}

/// Deletes settled operations past retention and events past `event_retention`.
pub async fn retention<B: Backend>(
    ledger: Ledger<B>,
    interval: Duration,
    event_retention: Duration,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let event_age_ms = i64::try_from(event_retention.as_millis()).unwrap_or(i64::MAX);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        match ledger.sweep_retention(RETENTION_BATCH).await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "settled operations past retention deleted"),
            Err(error) => tracing::warn!(%error, "retention sweep failed; will retry"),
        }
        match ledger.sweep_events(event_age_ms, RETENTION_BATCH).await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "old events deleted"),
            Err(error) => tracing::warn!(%error, "event sweep failed; will retry"),
        }
    }
}

/// Reports the ledger NOT_SERVING while the database does not answer, so load balancers and
/// orchestrators send calls to a replica that can serve them.
pub async fn health<B: Backend>(
    ledger: Ledger<B>,
    reporter: tonic_health::server::HealthReporter,
    interval: Duration,
    stop: CancellationToken,
) {
    use once_api::pb::ledger_server::LedgerServer;
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut serving = true;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let up = ledger.ping().await.is_ok();
        if up == serving {
            continue;
        }
        serving = up;
        if up {
            tracing::info!("database answers again: serving");
            reporter
                .set_serving::<LedgerServer<crate::LedgerService<B>>>()
                .await;
            reporter
                .set_service_status("", tonic_health::ServingStatus::Serving)
                .await;
        } else {
            tracing::warn!("database does not answer: not serving");
            reporter
                .set_not_serving::<LedgerServer<crate::LedgerService<B>>>()
                .await;
            reporter
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
        }
    }
}
