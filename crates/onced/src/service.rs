//! The `once.ledger.v1.Ledger` gRPC service: validate at the edge, run the ledger, map errors.

use std::sync::Arc;
use std::time::Duration;

use once_api::convert::{self, Caller};
use once_api::pb;
use once_core::{Actor, BeginDecision, Limits};
use once_store::{Backend, Ledger};
use tokio::sync::Notify;
use tonic::{Request, Response, Status};
use tracing::instrument;

use crate::status;

/// The tenant every caller belongs to while authentication is off.
pub const DEFAULT_TENANT: &str = "default";

/// Upper bound on the pause between two looks at an IN_PROGRESS operation during a wait.
const MAX_WAIT_POLL: Duration = Duration::from_millis(250);

pub struct LedgerService<B> {
    ledger: Ledger<B>,
    limits: Limits,
    /// The configured reconcilers, for the Reconcile RPC and a waiting Begin's lookup.
    reconcilers: once_reconcile::Registry,
    /// How long a lookup this service starts holds its operation (the workers' claim).
    claim_ms: i64,
    /// Woken whenever this replica records a report or resolution, so a Begin waiting on an
    /// IN_PROGRESS operation looks again at once instead of at its next poll.
    settled: Arc<Notify>,
}

impl<B> std::fmt::Debug for LedgerService<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerService")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> LedgerService<B> {
    pub fn new(
        ledger: Ledger<B>,
        limits: Limits,
        reconciliation: &once_reconcile::config::Reconciliation,
    ) -> Self {
        Self {
            ledger,
            limits,
            reconcilers: reconciliation.registry.clone(),
            claim_ms: i64::try_from(reconciliation.settings.claim.as_millis()).unwrap_or(i64::MAX),
            settled: Arc::new(Notify::new()),
        }
    }
}

/// Establishes who is calling. Authentication is off: every caller is tenant `default`, and
/// an executor is named after the client it says it is (reports are recorded under the
/// executor of the attempt they report on).
fn caller<T>(_request: &Request<T>, client_name: Option<&str>) -> Caller {
    let name = client_name
        .filter(|n| !n.is_empty())
        .unwrap_or(DEFAULT_TENANT);
    Caller {
        tenant: DEFAULT_TENANT.to_owned(),
        actor: Actor::Executor(name.to_owned()),
    }
}

/// How long to pause before looking again, when a waiting Begin should wait for `decision` to
/// change: only while this very operation is IN_PROGRESS. When the same intent runs under
/// another id, its outcome must not turn this Begin into a second execution.
fn worth_waiting_for(decision: &BeginDecision) -> Option<Duration> {
    match decision {
        BeginDecision::InProgress {
            retry_after_ms,
            blocking: None,
            ..
        } => Some(Duration::from_millis(*retry_after_ms as u64)),
        _ => None,
    }
}

#[tonic::async_trait]
impl<B: Backend> pb::ledger_server::Ledger for LedgerService<B> {
    #[instrument(skip_all, fields(operation_id, tool, decision))]
    async fn begin(
        &self,
        request: Request<pb::BeginRequest>,
    ) -> Result<Response<pb::BeginResponse>, Status> {
        let client_name = request
            .get_ref()
            .context
            .as_ref()
            .map(|c| c.client_name.clone());
        let caller = caller(&request, client_name.as_deref());
        let input =
            convert::begin(request.into_inner(), &caller, &self.limits).map_err(status::invalid)?;
        let cmd = input.command;
        let span = tracing::Span::current();
        span.record("operation_id", cmd.operation_id.as_str());
        span.record("tool", cmd.tool.as_str());

        let deadline = tokio::time::Instant::now() + Duration::from_millis(input.wait_ms as u64);
        let mut looked_up = false;
        let decision = loop {
            let settled = self.settled.notified();
            let decision = self.ledger.begin(&cmd).await.map_err(status::store)?;
            // A caller willing to wait gets one synchronous lookup of an UNKNOWN operation, if
            // one is due, and the decision its verdict allows.
            if let BeginDecision::Unknown { blocking: None, .. } = &decision {
                if !looked_up && input.wait_ms > 0 {
                    looked_up = true;
                    if self
                        .reconcile_within(&cmd.tenant, &cmd.operation_id, deadline)
                        .await
                    {
                        continue;
                    }
                }
            }
            let Some(retry_after) = worth_waiting_for(&decision) else {
                break decision;
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break decision;
            }
            let pause = retry_after.min(MAX_WAIT_POLL).min(deadline - now);
            tokio::select! {
                _ = settled => {}
                _ = tokio::time::sleep(pause) => {}
            }
        };
        span.record("decision", decision.name());
        Ok(Response::new(convert::begin_response(
            &cmd.operation_id,
            decision,
        )))
    }

    #[instrument(skip_all, fields(operation_id))]
    async fn confirm(
        &self,
        request: Request<pb::ConfirmRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let caller = caller(&request, None);
        let (id, cmd) =
            convert::confirm(request.into_inner(), &self.limits).map_err(status::invalid)?;
        tracing::Span::current().record("operation_id", id.as_str());
        self.report(&caller, &id, &cmd).await
    }

    #[instrument(skip_all, fields(operation_id))]
    async fn report_absent(
        &self,
        request: Request<pb::ReportAbsentRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let caller = caller(&request, None);
        let (id, cmd) =
            convert::report_absent(request.into_inner(), &self.limits).map_err(status::invalid)?;
        tracing::Span::current().record("operation_id", id.as_str());
        self.report(&caller, &id, &cmd).await
    }

    #[instrument(skip_all, fields(operation_id))]
    async fn report_unknown(
        &self,
        request: Request<pb::ReportUnknownRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let caller = caller(&request, None);
        let (id, cmd) =
            convert::report_unknown(request.into_inner(), &self.limits).map_err(status::invalid)?;
        tracing::Span::current().record("operation_id", id.as_str());
        self.report(&caller, &id, &cmd).await
    }

    #[instrument(skip_all, fields(operation_id))]
    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let caller = caller(&request, None);
        let (id, token, ttl) =
            convert::heartbeat(request.into_inner(), &self.limits).map_err(status::invalid)?;
        tracing::Span::current().record("operation_id", id.as_str());
        let deadline = self
            .ledger
            .heartbeat(&caller.tenant, &id, token, ttl)
            .await
            .map_err(status::store)?;
        Ok(Response::new(pb::HeartbeatResponse {
            lease_deadline: Some(convert::timestamp(deadline)),
        }))
    }

    #[instrument(skip_all, fields(operation_id))]
    async fn get_operation(
        &self,
        request: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::GetOperationResponse>, Status> {
        let caller = caller(&request, None);
        let id = convert::get_operation(request.into_inner()).map_err(status::invalid)?;
        tracing::Span::current().record("operation_id", id.as_str());
        let (op, attempts, events) = self
            .ledger
            .get(&caller.tenant, &id)
            .await
            .map_err(status::store)?;
        Ok(Response::new(pb::GetOperationResponse {
            operation: Some(convert::operation(op)),
            attempts: attempts.into_iter().map(convert::attempt).collect(),
            events: events.into_iter().map(convert::event).collect(),
        }))
    }

    #[instrument(skip_all)]
    async fn list_operations(
        &self,
        request: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        let caller = caller(&request, None);
        let query = convert::list_operations(request.into_inner()).map_err(status::invalid)?;
        let (operations, next) = self
            .ledger
            .list(&caller.tenant, &query)
            .await
            .map_err(status::store)?;
        Ok(Response::new(pb::ListOperationsResponse {
            operations: operations.into_iter().map(convert::operation).collect(),
            next_page_token: next
                .map(|(created_at, id)| convert::encode_page_token(created_at, &id))
                .unwrap_or_default(),
        }))
    }

    #[instrument(skip_all, fields(operation_id))]
    async fn reconcile(
        &self,
        request: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::ReconcileResponse>, Status> {
        let caller = caller(&request, None);
        let id = convert::reconcile(request.into_inner()).map_err(status::invalid)?;
        tracing::Span::current().record("operation_id", id.as_str());
        Ok(Response::new(
            self.reconcile_now(&caller.tenant, &id).await?,
        ))
    }

    #[instrument(skip_all, fields(operation_id, actor))]
    async fn resolve(
        &self,
        request: Request<pb::ResolveRequest>,
    ) -> Result<Response<pb::ResolveResponse>, Status> {
        let caller = caller(&request, None);
        let (id, cmd) =
            convert::resolve(request.into_inner(), &self.limits).map_err(status::invalid)?;
        let span = tracing::Span::current();
        span.record("operation_id", id.as_str());
        span.record("actor", cmd.actor.to_string());
        let state = self
            .ledger
            .resolve(&caller.tenant, &id, &cmd)
            .await
            .map_err(status::store)?;
        self.settled.notify_waiters();
        tracing::info!(state = state.as_str(), "operation resolved");
        Ok(Response::new(pb::ResolveResponse {
            state: convert::state_to_pb(state) as i32,
        }))
    }
}

impl<B: Backend> LedgerService<B> {
    /// Looks an UNKNOWN operation up before `deadline`, if a lookup is due and no other holds
    /// it, and returns whether the verdict settled it. A storm of retried Begins is therefore
    /// no storm of lookups. Failures only mean the Begin answers UNKNOWN, as it would have.
    async fn reconcile_within(
        &self,
        tenant: &str,
        id: &once_core::OperationId,
        deadline: tokio::time::Instant,
    ) -> bool {
        // Only a lookup this replica can run, of an operation that is due: otherwise a claim
        // would hold it from the replicas that can.
        let due = match self.ledger.read(tenant, id).await {
            Ok((Some(op), now)) => {
                once_core::reconcile::is_due(&op, now)
                    && op
                        .provider
                        .as_deref()
                        .is_some_and(|p| self.reconcilers.get(p).is_some())
            }
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
        let Some(registered) = op.provider.as_deref().and_then(|p| self.reconcilers.get(p)) else {
            return false;
        };
        let looked_up = crate::sweeper::look_up(
            &self.ledger,
            registered,
            &op,
            &lookup,
            self.limits.max_result_bytes,
        );
        // Running out of time drops the lookup; its claim lapses and a worker looks again.
        let Ok((_, applied)) = tokio::time::timeout_at(deadline, looked_up).await else {
            return false;
        };
        match applied {
            Ok((once_core::reconcile::Applied::Judged(state), _)) => {
                state != once_core::State::Unknown
            }
            Ok((once_core::reconcile::Applied::Stale, _)) => true,
            Err(error) => {
                tracing::warn!(%error, "could not apply a verdict during Begin");
                false
            }
        }
    }

    /// Looks `id` up with its reconciler now, whatever the backoff says, and applies the
    /// verdict. An operator's action, under the same claim as the workers' lookups, so it never
    /// runs beside one.
    async fn reconcile_now(
        &self,
        tenant: &str,
        id: &once_core::OperationId,
    ) -> Result<pb::ReconcileResponse, Status> {
        let refused = |op: &once_core::Operation| {
            if op.state != once_core::State::Unknown {
                status::store(once_store::StoreError::Rejected(
                    once_core::Rejection::NotUnknown { state: op.state },
                ))
            } else if op.held_for_operator() {
                status::held_for_operator()
            } else {
                status::lookup_in_progress()
            }
        };
        let (op, _) = self.ledger.read(tenant, id).await.map_err(status::store)?;
        let op = op.ok_or_else(|| status::store(once_store::StoreError::NotFound))?;
        if op.state != once_core::State::Unknown || op.held_for_operator() {
            return Err(refused(&op));
        }
        // Claim only what this replica can look up.
        let provider = op.provider.clone().unwrap_or_default();
        if self.reconcilers.get(&provider).is_none() {
            return Err(status::no_reconciler(&provider));
        }
        let claimed = self
            .ledger
            .claim_lookup(tenant, id, self.claim_ms, true)
            .await
            .map_err(status::store)?;
        let Some((op, lookup)) = claimed else {
            // It changed since it was read, is held, or another lookup holds it: say which.
            let (op, _) = self.ledger.read(tenant, id).await.map_err(status::store)?;
            let op = op.ok_or_else(|| status::store(once_store::StoreError::NotFound))?;
            return Err(refused(&op));
        };
        // The reconciler the operation names as claimed (a new attempt may have named another
        // since it was read).
        let provider = op.provider.clone().unwrap_or_default();
        let Some(registered) = self.reconcilers.get(&provider) else {
            return Err(status::no_reconciler(&provider));
        };
        let (verdict, applied) = crate::sweeper::look_up(
            &self.ledger,
            registered,
            &op,
            &lookup,
            self.limits.max_result_bytes,
        )
        .await;
        let (applied, _) = applied.map_err(status::store)?;
        self.settled.notify_waiters();
        let state = match applied {
            once_core::reconcile::Applied::Judged(state) => state,
            // It changed under the lookup: whatever it is now is the answer.
            once_core::reconcile::Applied::Stale => {
                self.ledger
                    .get(tenant, id)
                    .await
                    .map_err(status::store)?
                    .0
                    .state
            }
        };
        let (found, detail) = match &verdict {
            once_reconcile::Verdict::Confirmed { evidence, .. } => {
                (once_core::State::Confirmed, evidence.clone())
            }
            once_reconcile::Verdict::Absent { evidence } => {
                (once_core::State::Absent, evidence.clone())
            }
            once_reconcile::Verdict::Unknown { why } => (once_core::State::Unknown, why.clone()),
        };
        Ok(pb::ReconcileResponse {
            reconciler: provider,
            verdict: convert::state_to_pb(found) as i32,
            state: convert::state_to_pb(state) as i32,
            detail,
        })
    }

    async fn report(
        &self,
        caller: &Caller,
        id: &once_core::OperationId,
        cmd: &once_core::ReportCommand,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let state = self.ledger.report(&caller.tenant, id, cmd).await;
        self.settled.notify_waiters();
        let state = state.map_err(status::store)?;
        Ok(Response::new(pb::ReportResponse {
            state: convert::state_to_pb(state) as i32,
        }))
    }
}

#[cfg(test)]
mod tests {
    use once_core::{BeginDecision, OperationId};

    use super::worth_waiting_for;

    #[test]
    fn a_begin_waits_only_for_its_own_operation() {
        let in_progress = |blocking: Option<&str>| BeginDecision::InProgress {
            attempt: 1,
            lease_deadline: 0,
            retry_after_ms: 40,
            blocking: blocking.map(|id| OperationId::parse("id", id).unwrap()),
        };
        assert_eq!(
            worth_waiting_for(&in_progress(None)),
            Some(std::time::Duration::from_millis(40))
        );
        assert_eq!(worth_waiting_for(&in_progress(Some("refund:other"))), None);
        let unknown = BeginDecision::Unknown {
            since: 0,
            reason: None,
            blocking: None,
        };
        assert_eq!(worth_waiting_for(&unknown), None);
    }
}
