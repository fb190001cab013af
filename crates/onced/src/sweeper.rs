//! Background work every replica runs: expiring leases, reconciling UNKNOWN operations with
//! their providers, deleting what retention allows, and telling the health service whether the
//! database answers.
//!
//! All are safe to run on every replica at once: each lease expiry locks its operation and
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

/// Lookups one replica runs at once. Each round claims at most this many operations and looks
/// them all up together, each within its reconciler's timeout, which the configuration keeps
/// well inside the claim: a round never holds a claim it cannot use before it lapses.
const LOOKUP_CONCURRENCY: u32 = 8;
/// How many times an escalation webhook is tried.
const WEBHOOK_TRIES: u32 = 8;

/// Looks up due UNKNOWN operations with their reconcilers and applies the verdicts. Replicas
/// share the work through claims in the database: no two look up one operation at once.
pub async fn reconcile<B: Backend>(
    ledger: Ledger<B>,
    reconciliation: once_reconcile::config::Reconciliation,
    max_result_bytes: usize,
    stop: CancellationToken,
) {
    if reconciliation.registry.is_empty() {
        return;
    }
    let settings = &reconciliation.settings;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client with default settings");
    let claim_ms = i64::try_from(settings.claim.as_millis()).unwrap_or(i64::MAX);
    let providers: Vec<&str> = reconciliation.registry.names().collect();
    let mut ticks = tokio::time::interval(settings.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        // Rounds follow one another while there is a full batch of work.
        loop {
            let claimed = match ledger
                .claim_lookups(LOOKUP_CONCURRENCY, claim_ms, &providers)
                .await
            {
                Ok(claimed) => claimed,
                Err(error) => {
                    tracing::warn!(%error, "could not claim operations to reconcile; will retry");
                    break;
                }
            };
            let full = claimed.len() as u32 == LOOKUP_CONCURRENCY;
            let lookups = claimed.iter().map(|(op, lookup)| {
                reconcile_one(
                    &ledger,
                    &reconciliation,
                    &http,
                    op,
                    lookup,
                    max_result_bytes,
                )
            });
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = futures::future::join_all(lookups) => {}
            }
            if !full {
                break;
            }
        }
    }
}

/// One claimed operation: look it up, apply the verdict, and escalate if this lookup crossed
/// a threshold.
async fn reconcile_one<B: Backend>(
    ledger: &Ledger<B>,
    reconciliation: &once_reconcile::config::Reconciliation,
    http: &reqwest::Client,
    op: &once_core::Operation,
    lookup: &once_core::reconcile::Lookup,
    max_result_bytes: usize,
) {
    let provider = op.provider.clone().unwrap_or_default();
    let Some(registered) = reconciliation.registry.get(&provider) else {
        tracing::warn!(operation_id = %op.operation_id, %provider, "no reconciler of that name is configured");
        return;
    };
    let (verdict, applied) = look_up(ledger, registered, op, lookup, max_result_bytes).await;
    match applied {
        Ok((once_core::reconcile::Applied::Judged(state), escalated)) => {
            tracing::info!(operation_id = %op.operation_id, reconciler = %provider, state = state.as_str(), "looked up");
            if escalated {
                tracing::warn!(operation_id = %op.operation_id, lookups = op.reconcile_lookups + 1, "escalated: still UNKNOWN");
                if let Some(url) = &reconciliation.settings.webhook {
                    tokio::spawn(send_escalation(
                        http.clone(),
                        url.clone(),
                        escalation_summary(op, &verdict),
                    ));
                }
            }
        }
        Ok((once_core::reconcile::Applied::Stale, _)) => {
            tracing::info!(operation_id = %op.operation_id, reconciler = %provider, "the operation changed during its lookup; the verdict was dropped")
        }
        Err(error) => {
            tracing::warn!(operation_id = %op.operation_id, %error, "could not apply a verdict; the claim will lapse and the lookup repeat")
        }
    }
}

/// What an escalation webhook receives.
fn escalation_summary(
    op: &once_core::Operation,
    verdict: &once_reconcile::Verdict,
) -> serde_json::Value {
    let last_lookup = match verdict {
        once_reconcile::Verdict::Unknown { why } => why.clone(),
        once_reconcile::Verdict::Absent { .. } => {
            "the provider has no record, but that does not settle it".into()
        }
        once_reconcile::Verdict::Confirmed { .. } => "confirmed".into(),
    };
    serde_json::json!({
        "event": "ESCALATED",
        "tenant": op.tenant,
        "operation_id": op.operation_id.as_str(),
        "tool": op.tool,
        "provider": op.provider,
        "attempt": op.attempt,
        "lookups": op.reconcile_lookups + 1,
        "attempt_started_at_ms": op.lease_started_at,
        "reason": op.reason,
        "last_lookup": last_lookup,
    })
}

/// POSTs an escalation, retrying with backoff; runs beside the worker, never blocking it.
async fn send_escalation(http: reqwest::Client, url: String, summary: serde_json::Value) {
    let mut pause = Duration::from_millis(200);
    for try_number in 1..=WEBHOOK_TRIES {
        match http.post(&url).json(&summary).send().await {
            Ok(response) if response.status().is_success() => return,
            Ok(response) => {
                tracing::warn!(status = %response.status(), try_number, "escalation webhook refused")
            }
            Err(error) => {
                tracing::warn!(error = %error.without_url(), try_number, "escalation webhook failed")
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
    tracing::error!(operation_id = %summary["operation_id"], "escalation webhook gave up");
}

/// A spread in 0.0..1.0 that differs between operations and between lookups of one operation,
/// so retries of many operations do not line up.
fn jitter(operation_id: &str, lookups: u32) -> f64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (operation_id, lookups).hash(&mut hasher);
    (hasher.finish() % 1000) as f64 / 1000.0
}

/// Looks `op` up with `registered` under the claim `lookup` and applies the verdict, in one
/// transaction with its events. The one path every lookup takes: the workers, the Reconcile
/// RPC, and a waiting Begin.
pub async fn look_up<B: Backend>(
    ledger: &Ledger<B>,
    registered: &once_reconcile::Registered,
    op: &once_core::Operation,
    lookup: &once_core::reconcile::Lookup,
    max_result_bytes: usize,
) -> (
    once_reconcile::Verdict,
    Result<(once_core::reconcile::Applied, bool), once_store::StoreError>,
) {
    let verdict = registered.lookup(&lookup_request(op)).await;
    let jitter = jitter(op.operation_id.as_str(), op.reconcile_lookups);
    let applied = ledger
        .apply_verdict(
            &op.tenant,
            &op.operation_id,
            lookup,
            &verdict,
            &registered.policy(max_result_bytes),
            jitter,
        )
        .await;
    (verdict, applied)
}

/// What a reconciler is told about an operation.
fn lookup_request(op: &once_core::Operation) -> once_reconcile::LookupRequest {
    once_reconcile::LookupRequest {
        operation_id: op.operation_id.to_string(),
        tool: op.tool.clone(),
        provider_key: op.provider_key.clone(),
        lookup_hints: op
            .lookup_hints
            .as_deref()
            .and_then(|h| serde_json::from_str(h).ok())
            .unwrap_or(serde_json::Value::Null),
        attempt: op.attempt,
        fencing_token: op.fencing_token.get(),
        attempt_started_at_ms: op.lease_started_at,
    }
}
