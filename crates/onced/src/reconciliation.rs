//! Every reconciler lookup `onced` runs: the workers' rounds, the one a waiting Begin may run,
//! and an operator's Reconcile. Each claims its operation in the store first, so no two lookups
//! of one operation run at once on any replica, and each goes through
//! [`Reconciliation::look_up`]: the lookup, then the verdict applied with its events in one
//! transaction.

use std::sync::Arc;
use std::time::Duration;

use once_core::reconcile::{is_due, Applied, Lookup};
use once_core::{Actor, Operation, OperationId, Rejection, State};
use once_reconcile::config::Settings;
use once_reconcile::{LookupRequest, Registered, Registry, Verdict};
use once_store::{Backend, Ledger, StoreError};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::rounds;
use crate::telemetry::Metrics;

/// Woken whenever this replica records a report, a resolution or a verdict, so a Begin waiting
/// on an IN_PROGRESS operation looks again at once instead of at its next poll.
#[derive(Debug, Clone, Default)]
pub struct Settled(Arc<Notify>);

impl Settled {
    pub fn notify(&self) {
        self.0.notify_waiters();
    }

    /// Completes at the next [`Settled::notify`] after it is made, polled or not.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.0.notified()
    }
}

/// Lookups one replica runs at once. Each round claims at most this many operations and looks
/// them all up together, each within its reconciler's timeout, which the configuration keeps
/// well inside the claim: a round never holds a claim it cannot use before it lapses.
const LOOKUP_CONCURRENCY: u32 = 8;
/// How many times an escalation webhook is tried.
const WEBHOOK_TRIES: u32 = 8;

/// The configured reconcilers over one ledger.
#[derive(Debug, Clone)]
pub struct Reconciliation<B: Backend> {
    ledger: Ledger<B>,
    reconcilers: Registry,
    settings: Settings,
    /// How long a lookup holds its operation.
    claim_ms: i64,
    /// The result limit a found effect is held to, as a Confirm's is.
    max_result_bytes: usize,
    settled: Settled,
    metrics: std::sync::Arc<Metrics>,
}

/// What an operator's Reconcile did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    pub reconciler: String,
    /// What the reconciler found: CONFIRMED, ABSENT, or UNKNOWN when it could not tell.
    pub found: State,
    /// The evidence, or why it could not tell.
    pub detail: String,
    /// The operation's state afterwards.
    pub state: State,
}

/// Why an operator's Reconcile did not look the operation up.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the operation is held for an operator")]
    HeldForOperator,
    #[error("another lookup of the operation is running")]
    LookupInProgress,
    #[error("no reconciler named {provider:?} serves tenant {tenant:?}")]
    NoReconciler { provider: String, tenant: String },
}

impl<B: Backend> Reconciliation<B> {
    pub fn new(
        ledger: Ledger<B>,
        configured: &once_reconcile::config::Reconciliation,
        max_result_bytes: usize,
        settled: Settled,
        metrics: std::sync::Arc<Metrics>,
    ) -> Self {
        for (_, name) in configured.registry.names() {
            metrics.reconciler_configured(name);
        }
        Self {
            ledger,
            reconcilers: configured.registry.clone(),
            settings: configured.settings.clone(),
            claim_ms: once_core::duration_ms(configured.settings.claim),
            max_result_bytes,
            settled,
            metrics,
        }
    }

    /// The reconciler `op` names, if this replica has it.
    fn reconciler_of(&self, op: &Operation) -> Option<&Registered> {
        op.provider
            .as_deref()
            .and_then(|p| self.reconcilers.get(&op.tenant, p))
    }

    /// The link to `op` in its provider's dashboard, when its reconciler has a template and
    /// the operation what the template needs.
    pub fn dashboard(&self, op: &Operation) -> Option<String> {
        self.reconciler_of(op)?
            .dashboard
            .as_ref()?
            .link(op.provider_ref.as_deref(), &op.provider_key)
    }

    /// Looks `op` up under the claim `lookup` and applies the verdict. The one path every
    /// lookup takes. Returns the verdict, and what applying it did and whether it escalated.
    async fn look_up(
        &self,
        registered: &Registered,
        op: &Operation,
        lookup: &Lookup,
    ) -> (Verdict, Result<(Applied, bool), StoreError>) {
        let started = tokio::time::Instant::now();
        let verdict = registered.lookup(&lookup_request(op)).await;
        self.metrics
            .looked_up(&registered.name, verdict.name(), started.elapsed());
        let jitter = jitter(op.operation_id.as_str(), op.reconcile_lookups);
        let applied = self
            .ledger
            .apply_verdict(
                &op.tenant,
                &op.operation_id,
                lookup,
                &verdict,
                &registered.policy(self.max_result_bytes),
                jitter,
            )
            .await;
        self.settled.notify();
        (verdict, applied)
    }

    /// Looks an UNKNOWN operation up before `deadline`, if a lookup is due and no other holds
    /// it, and returns whether it may have settled. A storm of retried Begins is therefore no
    /// storm of lookups. Failures only mean the Begin answers UNKNOWN, as it would have.
    pub async fn settle_before(
        &self,
        tenant: &str,
        id: &OperationId,
        deadline: tokio::time::Instant,
    ) -> bool {
        // Only a lookup this replica can run, of an operation that is due: otherwise a claim
        // would hold it from the replicas that can.
        let due = match self.ledger.read(tenant, id).await {
            Ok((Some(op), now)) => is_due(&op, now) && self.reconciler_of(&op).is_some(),
            Ok((None, _)) => false,
            Err(error) => {
                tracing::warn!(%error, "could not read an operation to look up during Begin");
                false
            }
        };
        if !due {
            return false;
        }
        let claimed = self
            .ledger
            .claim_lookup(tenant, id, self.claim_ms, false)
            .await;
        let (op, lookup) = match claimed {
            Ok(Some(claimed)) => claimed,
            Ok(None) => return false,
            Err(error) => {
                tracing::warn!(%error, "could not claim a lookup during Begin");
                return false;
            }
        };
        let Some(registered) = self.reconciler_of(&op) else {
            return false;
        };
        // Running out of time drops the lookup; its claim lapses and a worker looks again.
        let looked_up = self.look_up(registered, &op, &lookup);
        let Ok((_, applied)) = tokio::time::timeout_at(deadline, looked_up).await else {
            return false;
        };
        match applied {
            Ok((Applied::Judged(state), _)) => state != State::Unknown,
            Ok((Applied::Stale, _)) => true,
            Err(error) => {
                tracing::warn!(%error, "could not apply a verdict during Begin");
                false
            }
        }
    }

    /// Looks `id` up with its reconciler now, whatever the backoff says, and applies the
    /// verdict. An operator's action, under the same claim as the workers' lookups, so it never
    /// runs beside one.
    pub async fn now(
        &self,
        tenant: &str,
        id: &OperationId,
        asked_by: Actor,
    ) -> Result<Reconciled, Refused> {
        let op = self.get(tenant, id).await?;
        if op.state != State::Unknown || op.held_for_operator() {
            return Err(refusal(&op));
        }
        // Claim only what this replica can look up.
        if self.reconciler_of(&op).is_none() {
            return Err(Refused::NoReconciler {
                provider: op.provider.unwrap_or_default(),
                tenant: tenant.to_owned(),
            });
        }
        let claimed = self
            .ledger
            .claim_lookup(tenant, id, self.claim_ms, true)
            .await?;
        let Some((op, mut lookup)) = claimed else {
            // It changed since it was read, is held, or another lookup holds it: say which.
            return Err(refusal(&self.get(tenant, id).await?));
        };
        // The reconciler the operation names as claimed (a new attempt may have named another
        // since it was read).
        let reconciler = op.provider.clone().unwrap_or_default();
        let Some(registered) = self.reconcilers.get(tenant, &reconciler) else {
            return Err(Refused::NoReconciler {
                provider: reconciler,
                tenant: tenant.to_owned(),
            });
        };
        lookup.asked_by = Some(asked_by);
        let (verdict, applied) = self.look_up(registered, &op, &lookup).await;
        let state = match applied?.0 {
            Applied::Judged(state) => state,
            // It changed under the lookup: whatever it is now is the answer.
            Applied::Stale => self.get(tenant, id).await?.state,
        };
        let (found, detail) = match verdict {
            Verdict::Confirmed { evidence, .. } => (State::Confirmed, evidence),
            Verdict::Absent { evidence } => (State::Absent, evidence),
            Verdict::Unknown { why } => (State::Unknown, why),
        };
        Ok(Reconciled {
            reconciler,
            found,
            detail,
            state,
        })
    }

    async fn get(&self, tenant: &str, id: &OperationId) -> Result<Operation, StoreError> {
        let (op, _) = self.ledger.read(tenant, id).await?;
        op.ok_or(StoreError::NotFound)
    }

    /// The workers: look up due UNKNOWN operations and apply the verdicts, until `stop`.
    /// Replicas share the work through claims in the database.
    pub async fn run(self, stop: CancellationToken) {
        if self.reconcilers.is_empty() {
            return;
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("an HTTP client with default settings");
        let (this, http) = (&self, &http);
        // The first round one interval after start, as every other: the interval is the pace
        // of lookups from the start, so a ledger told to look up rarely (or, with a long
        // interval, only when asked) does not look up as it starts.
        let first = tokio::time::Instant::now() + self.settings.interval;
        rounds::every_from(first, self.settings.interval, &stop, || async move {
            // Rounds follow one another while there is a full batch of work.
            while this.round(http).await == LOOKUP_CONCURRENCY {}
        })
        .await;
    }

    /// One round: claims up to [`LOOKUP_CONCURRENCY`] due operations and looks them up together.
    /// Returns how many it claimed.
    async fn round(&self, http: &reqwest::Client) -> u32 {
        let served: Vec<(&str, &str)> = self.reconcilers.names().collect();
        let claimed = self
            .ledger
            .claim_lookups(LOOKUP_CONCURRENCY, self.claim_ms, &served)
            .await;
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(error) => {
                tracing::warn!(%error, "could not claim operations to reconcile; will retry");
                return 0;
            }
        };
        let lookups = claimed
            .iter()
            .map(|(op, lookup)| self.reconcile_one(http, op, lookup));
        futures::future::join_all(lookups).await;
        u32::try_from(claimed.len()).unwrap_or(u32::MAX)
    }

    /// One claimed operation: look it up, apply the verdict, and escalate if this lookup crossed
    /// a threshold.
    async fn reconcile_one(&self, http: &reqwest::Client, op: &Operation, lookup: &Lookup) {
        let provider = op.provider.clone().unwrap_or_default();
        let Some(registered) = self.reconcilers.get(&op.tenant, &provider) else {
            tracing::warn!(operation_id = %op.operation_id, %provider, "no reconciler of that name is configured");
            return;
        };
        let (verdict, applied) = self.look_up(registered, op, lookup).await;
        match applied {
            Ok((Applied::Judged(state), escalated)) => {
                tracing::info!(operation_id = %op.operation_id, reconciler = %provider, state = state.as_str(), "looked up");
                if escalated {
                    tracing::warn!(operation_id = %op.operation_id, lookups = op.reconcile_lookups + 1, "escalated: still UNKNOWN");
                    if let Some(url) = &self.settings.webhook {
                        tokio::spawn(send_escalation(
                            http.clone(),
                            self.metrics.clone(),
                            url.clone(),
                            escalation_summary(op, &verdict),
                        ));
                    }
                }
            }
            Ok((Applied::Stale, _)) => {
                tracing::info!(operation_id = %op.operation_id, reconciler = %provider, "the operation changed during its lookup; the verdict was dropped")
            }
            Err(error) => {
                tracing::warn!(operation_id = %op.operation_id, %error, "could not apply a verdict; the claim will lapse and the lookup repeat")
            }
        }
    }
}

/// Why an operation read after a claim failed could not be claimed.
fn refusal(op: &Operation) -> Refused {
    if op.state != State::Unknown {
        Refused::Store(StoreError::Rejected(Rejection::NotUnknown {
            state: op.state,
        }))
    } else if op.held_for_operator() {
        Refused::HeldForOperator
    } else {
        Refused::LookupInProgress
    }
}

/// What an escalation webhook receives.
fn escalation_summary(op: &Operation, verdict: &Verdict) -> serde_json::Value {
    let last_lookup = match verdict {
        Verdict::Unknown { why } => why.clone(),
        Verdict::Absent { .. } => "the provider has no record, but that does not settle it".into(),
        Verdict::Confirmed { .. } => "confirmed".into(),
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
async fn send_escalation(
    http: reqwest::Client,
    metrics: std::sync::Arc<Metrics>,
    url: String,
    summary: serde_json::Value,
) {
    let mut pause = Duration::from_millis(200);
    for try_number in 1..=WEBHOOK_TRIES {
        match http.post(&url).json(&summary).send().await {
            Ok(response) if response.status().is_success() => return,
            Ok(response) => {
                metrics.webhook_failed();
                tracing::warn!(status = %response.status(), try_number, "escalation webhook refused")
            }
            Err(error) => {
                metrics.webhook_failed();
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

/// What a reconciler is told about an operation.
fn lookup_request(op: &Operation) -> LookupRequest {
    LookupRequest {
        tenant: op.tenant.clone(),
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
