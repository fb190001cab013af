//! The `once.ledger.v1.Ledger` gRPC service: each call converts its request with `once-api`,
//! runs the ledger (or the lookup, or the wait), and converts the answer back.

use std::time::Duration;

use once_api::convert::{self, Caller, ReportRequest};
use once_api::pb;
use once_core::{continuity, Limits, OperationId};
use once_store::{Backend, Ledger, StoreError};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::access::{Access, Allowed, Principal};
use crate::continuity::{Continuity, Judged};
use crate::duplicates::Recorder;
use crate::reconciliation::{Reconciliation, Settled};
use crate::signing::Receipts;
use crate::status;
use crate::telemetry::Metrics;
use crate::wait;
use crate::watch::Feed;
use once_core::forensics::Duplicate;

pub struct LedgerService<B: Backend> {
    ledger: Ledger<B>,
    access: Access<B>,
    limits: Limits,
    /// The configured reconcilers, for the Reconcile RPC and a waiting Begin's lookup.
    reconciliation: Reconciliation<B>,
    settled: Settled,
    /// The replica's watermark, for WatchOperations.
    feed: Feed,
    /// Where Begins answered without a new execution right go, for forensics.
    duplicates: Recorder,
    metrics: std::sync::Arc<Metrics>,
    /// Positions sealed and judged, holds and recoveries.
    continuity: Continuity<B>,
    /// The signing key, for receipts.
    receipts: Receipts,
}

/// The most operations one GetForensics looks at.
const FORENSICS_OPERATIONS: u32 = 1000;

impl<B: Backend> std::fmt::Debug for LedgerService<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerService")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> LedgerService<B> {
    /// The service over `ledger`; `(feed, duplicates)` are where its watches read and its
    /// duplicate Begins go.
    pub fn new(
        ledger: Ledger<B>,
        access: Access<B>,
        limits: Limits,
        configured: &once_reconcile::config::Reconciliation,
        (feed, duplicates): (Feed, Recorder),
        metrics: std::sync::Arc<Metrics>,
        (continuity, receipts): (Continuity<B>, Receipts),
    ) -> Self {
        let settled = Settled::default();
        let reconciliation = Reconciliation::new(
            ledger.clone(),
            configured,
            limits.max_result_bytes,
            settled.clone(),
            metrics.clone(),
        );
        Self {
            ledger,
            access,
            limits,
            reconciliation,
            settled,
            feed,
            duplicates,
            metrics,
            continuity,
            receipts,
        }
    }

    /// The signed receipt of the tenant's operation `id`, as it stands now and as the
    /// history's chain recorded it.
    async fn receipt(&self, tenant: &str, id: &OperationId) -> Result<String, Status> {
        let (op, _, events) = self.ledger.get(tenant, id).await.map_err(status::store)?;
        if self.receipts.ring().is_none() {
            return Err(status::no_signing_key());
        }
        // A ledger behind what its clients saw may have lost a later attempt of an operation
        // it holds ABSENT: no ABSENT is signed until the loss is accepted.
        if op.state == once_core::State::Absent {
            if let Judged::Held(held) = self.continuity.judge(tenant, &[]).await? {
                return Err(status::ledger_behind(&held));
            }
        }
        let settled = crate::signing::settled(self.ledger.backend(), &op, &events)
            .await
            .map_err(status::store)?
            .map_err(status::unsigned)?;
        self.receipts
            .sign(&op, settled)
            .ok_or_else(status::no_signing_key)
    }

    /// The reconciliation workers to run beside this service; their verdicts wake its waiting
    /// Begins.
    pub(crate) fn reconciliation(&self) -> Reconciliation<B> {
        self.reconciliation.clone()
    }
}

/// The attempt a decision is about, for the RPC span.
fn decision_attempt(decision: &once_core::BeginDecision) -> Option<u32> {
    use once_core::BeginDecision::*;
    match decision {
        Execute(grant) => Some(grant.attempt),
        Replay { attempt, .. } | InProgress { attempt, .. } => Some(*attempt),
        Unknown { .. } | Conflict { .. } | Held => None,
    }
}

fn report_kind(report: &once_core::Report) -> &'static str {
    match report {
        once_core::Report::Confirm { .. } => "confirm",
        once_core::Report::Absent { .. } => "absent",
        once_core::Report::Unknown { .. } => "unknown",
    }
}

/// How a report ended, for the reports counter: `stale` is a superseded attempt's.
fn report_outcome(answer: &Result<once_core::State, once_store::StoreError>) -> &'static str {
    use once_core::Rejection;
    use once_store::StoreError;
    match answer {
        Ok(_) => "accepted",
        Err(StoreError::Rejected(Rejection::ExecutionRightLost { .. })) => "stale",
        Err(StoreError::Rejected(Rejection::AlreadySettled { .. })) => "settled",
        Err(StoreError::Rejected(_) | StoreError::NotFound) => "refused",
        Err(_) => "failed",
    }
}

/// The caller as the domain records it.
fn caller(principal: &Principal, client_name: Option<&str>) -> Caller {
    Caller {
        tenant: principal.tenant.clone(),
        actor: principal.executor(client_name),
        holder: principal.holder(),
    }
}

#[tonic::async_trait]
impl<B: Backend> pb::ledger_server::Ledger for LedgerService<B> {
    async fn begin(
        &self,
        request: Request<pb::BeginRequest>,
    ) -> Result<Response<pb::BeginResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::EXECUTOR).await?;
        let client_name = request
            .get_ref()
            .context
            .as_ref()
            .map(|c| c.client_name.clone());
        let caller = caller(&principal, client_name.as_deref());
        let input =
            convert::begin(request.into_inner(), &caller, &self.limits).map_err(status::invalid)?;
        let mut cmd = input.command;
        let shown: Vec<(&str, &str)> = [
            (continuity::FIELD, &input.seen_position),
            (continuity::OPERATION_FIELD, &input.operation_position),
        ]
        .into_iter()
        .filter_map(|(field, text)| text.as_deref().map(|text| (field, text)))
        .collect();
        let held = match self.continuity.judge(&cmd.tenant, &shown).await? {
            Judged::Free => None,
            Judged::Held(held) => Some(held),
            Judged::Behind(held) => return Err(status::ledger_behind(&held)),
            Judged::Lost(behind) => return Err(status::grant_lost(&behind)),
        };
        cmd.held = held.is_some();
        self.access.check_in_flight(&principal, &cmd).await?;
        let span = tracing::Span::current();
        span.record("once.operation_id", cmd.operation_id.as_str());
        span.record("once.tool", cmd.tool.as_str());

        let wait = Duration::from_millis(u64::try_from(input.wait_ms).unwrap_or(0));
        let (decision, at) = wait::begin(
            &self.ledger,
            &self.reconciliation,
            &self.settled,
            &cmd,
            wait,
        )
        .await
        .map_err(status::store)?;
        span.record("once.decision", decision.name());
        if let Some(attempt) = decision_attempt(&decision) {
            span.record("once.attempt", i64::from(attempt));
        }
        self.metrics
            .decided(decision.name(), &cmd.tenant, &cmd.tool);
        if let Some(duplicate) = Duplicate::of(&cmd, &decision, at) {
            self.duplicates.record(duplicate);
        }
        let position = match &decision {
            once_core::BeginDecision::Execute(grant) => {
                Some(self.continuity.position(&cmd, grant, at))
            }
            _ => None,
        };
        let replayed = matches!(decision, once_core::BeginDecision::Replay { .. });
        match (
            convert::begin_response(&cmd.operation_id, decision, position),
            held,
        ) {
            (Some(mut answer), _) => {
                if let (true, true, Some(pb::begin_response::Decision::Replay(replay))) =
                    (replayed, input.want_receipt, answer.decision.as_mut())
                {
                    // A receipt is evidence, asked for beside the answer: the replay stands
                    // without it when it cannot be signed now.
                    match self.receipt(&cmd.tenant, &cmd.operation_id).await {
                        Ok(receipt) => replay.receipt = receipt,
                        Err(refused) => tracing::debug!(
                            reason = refused.message(),
                            "a replay's receipt was not signed"
                        ),
                    }
                }
                Ok(Response::new(answer))
            }
            (None, Some(held)) => Err(status::ledger_behind(&held)),
            (None, None) => Err(status::internal()),
        }
    }

    async fn verify_history(
        &self,
        request: Request<pb::VerifyHistoryRequest>,
    ) -> Result<Response<pb::VerifyHistoryResponse>, Status> {
        let (_, tenant) = self.access.admit_reader(&request, Allowed::READ).await?;
        let from = request.get_ref().from_sequence.max(0);
        let verified = crate::chain::verify(self.ledger.backend(), &tenant, from)
            .await
            .map_err(status::store)?;
        Ok(Response::new(convert::verify_history_response(verified)))
    }

    async fn get_receipt(
        &self,
        request: Request<pb::GetReceiptRequest>,
    ) -> Result<Response<pb::GetReceiptResponse>, Status> {
        let tenant = self.access.admit_read(&request, Allowed::READ_ONE).await?;
        let id = OperationId::parse("operation_id", &request.get_ref().operation_id)
            .map_err(status::invalid)?;
        tracing::Span::current().record("once.operation_id", id.as_str());
        let receipt = self.receipt(&tenant, &id).await?;
        Ok(Response::new(pb::GetReceiptResponse { receipt }))
    }

    async fn get_signing_keys(
        &self,
        request: Request<pb::GetSigningKeysRequest>,
    ) -> Result<Response<pb::GetSigningKeysResponse>, Status> {
        self.access.admit(&request, Allowed::ANY).await?;
        let keys = self.receipts.ring().map_or_else(Vec::new, |ring| {
            ring.listed()
                .into_iter()
                .map(|listed| pb::SigningKey {
                    key_id: listed.key.id().to_owned(),
                    algorithm: "ed25519".into(),
                    public_key: listed.key.to_string(),
                    active: listed.active,
                })
                .collect()
        });
        Ok(Response::new(pb::GetSigningKeysResponse {
            ledger: self.receipts.ledger().to_owned(),
            keys,
        }))
    }

    async fn get_history_head(
        &self,
        request: Request<pb::GetHistoryHeadRequest>,
    ) -> Result<Response<pb::GetHistoryHeadResponse>, Status> {
        let (_, tenant) = self.access.admit_reader(&request, Allowed::READ).await?;
        let backend = self.ledger.backend();
        let head = backend.last_link(&tenant).await.map_err(status::store)?;
        let verified = backend.verification(&tenant).await.map_err(status::store)?;
        Ok(Response::new(convert::history_head(tenant, head, verified)))
    }

    async fn recover_operations(
        &self,
        request: Request<pb::RecoverOperationsRequest>,
    ) -> Result<Response<pb::RecoverOperationsResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::EXECUTOR).await?;
        let positions =
            convert::recover_positions(request.into_inner()).map_err(status::invalid)?;
        let reporter = (principal.executor(None), principal.holder());
        let recovered = self
            .continuity
            .recover(&principal.tenant, reporter, positions)
            .await?;
        Ok(Response::new(pb::RecoverOperationsResponse {
            operations: recovered
                .into_iter()
                .map(|(id, recovered)| pb::RecoveredOperation {
                    operation_id: id,
                    recovered,
                })
                .collect(),
        }))
    }

    async fn confirm(
        &self,
        request: Request<pb::ConfirmRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.report(request).await
    }

    async fn report_absent(
        &self,
        request: Request<pb::ReportAbsentRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.report(request).await
    }

    async fn report_unknown(
        &self,
        request: Request<pb::ReportUnknownRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.report(request).await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::SETTLE).await?;
        let (id, cmd) = convert::heartbeat(request.into_inner(), principal.holder(), &self.limits)
            .map_err(status::invalid)?;
        tracing::Span::current().record("once.operation_id", id.as_str());
        let deadline = self.ledger.heartbeat(&principal.tenant, &id, cmd).await;
        if deadline.as_ref().is_err_and(settled_nothing) {
            self.access.charge(&principal)?;
        }
        let deadline = deadline.map_err(status::store)?;
        Ok(Response::new(convert::heartbeat_response(deadline)))
    }

    async fn get_operation(
        &self,
        request: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::GetOperationResponse>, Status> {
        let tenant = self.access.admit_read(&request, Allowed::READ_ONE).await?;
        let id = convert::get_operation(request.into_inner()).map_err(status::invalid)?;
        tracing::Span::current().record("once.operation_id", id.as_str());
        let (op, attempts, events, calls) = self
            .ledger
            .explain(&tenant, &id)
            .await
            .map_err(status::store)?;
        let dashboard = self.reconciliation.dashboard(&op);
        let earlier = self
            .ledger
            .backend()
            .earlier_lives(&tenant, &id, op.life)
            .await
            .map_err(status::store)?;
        Ok(Response::new(convert::explained(
            op,
            attempts,
            (events, earlier),
            calls,
            dashboard,
        )))
    }

    async fn get_stats(
        &self,
        request: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::GetStatsResponse>, Status> {
        let (_, scope) = self.access.admit_scoped(&request, Allowed::READ).await?;
        let window = convert::get_stats(request.into_inner(), self.limits.max_retention_ms)
            .map_err(status::invalid)?;
        let stats = self
            .ledger
            .backend()
            .stats(&scope, window)
            .await
            .map_err(status::store)?;
        Ok(Response::new(convert::stats_response(stats)))
    }

    async fn get_server_info(
        &self,
        request: Request<pb::GetServerInfoRequest>,
    ) -> Result<Response<pb::GetServerInfoResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::ANY).await?;
        Ok(Response::new(convert::server_info_response(
            (crate::version(), self.ledger.backend().kind()),
            &principal.tenant,
            principal.credential.as_ref(),
        )))
    }

    async fn get_forensics(
        &self,
        request: Request<pb::GetForensicsRequest>,
    ) -> Result<Response<pb::GetForensicsResponse>, Status> {
        let tenant = self.access.admit_read(&request, Allowed::READ).await?;
        let (tool, since_ms) =
            convert::get_forensics(request.into_inner(), self.limits.max_retention_ms)
                .map_err(status::invalid)?;
        let (operations, summary) = self
            .ledger
            .forensics(&tenant, tool.as_deref(), since_ms, FORENSICS_OPERATIONS)
            .await
            .map_err(status::store)?;
        Ok(Response::new(convert::forensics_response(
            operations, summary,
        )))
    }

    async fn list_operations(
        &self,
        request: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        let (_, scope) = self.access.admit_scoped(&request, Allowed::READ).await?;
        let query = convert::list_operations(request.into_inner()).map_err(status::invalid)?;
        let (operations, next) = self
            .ledger
            .list(&scope, &query)
            .await
            .map_err(status::store)?;
        Ok(Response::new(convert::list_operations_response(
            operations, next,
        )))
    }

    type WatchOperationsStream = ReceiverStream<Result<pb::WatchOperationsResponse, Status>>;

    async fn watch_operations(
        &self,
        request: Request<pb::WatchOperationsRequest>,
    ) -> Result<Response<Self::WatchOperationsStream>, Status> {
        let watcher = self.access.admit_scoped(&request, Allowed::READ).await?;
        let (start, filter) =
            convert::watch_operations(request.into_inner()).map_err(status::invalid)?;
        let (stream, after) = self
            .feed
            .watch(
                (self.ledger.backend().clone(), self.access.clone()),
                watcher,
                start,
                filter,
            )
            .await?;
        let mut response = Response::new(ReceiverStream::new(stream));
        response
            .metadata_mut()
            .insert(once_api::WATCH_START_HEADER, after.into());
        Ok(response)
    }

    async fn reconcile(
        &self,
        request: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::ReconcileResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::OPERATOR).await?;
        let (id, operator) = convert::reconcile(request.into_inner()).map_err(status::invalid)?;
        let asked_by = principal.asker(&operator);
        let span = tracing::Span::current();
        span.record("once.operation_id", id.as_str());
        span.record("once.actor", asked_by.to_string());
        let reconciled = self
            .reconciliation
            .now(&principal.tenant, &id, asked_by)
            .await
            .map_err(status::refused)?;
        Ok(Response::new(convert::reconcile_response(
            reconciled.reconciler,
            (reconciled.found, reconciled.state),
            reconciled.detail,
        )))
    }

    async fn resolve(
        &self,
        request: Request<pb::ResolveRequest>,
    ) -> Result<Response<pb::ResolveResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::OPERATOR).await?;
        let (id, mut cmd) =
            convert::resolve(request.into_inner(), &self.limits).map_err(status::invalid)?;
        if let once_core::Actor::Operator(given) = &cmd.actor {
            cmd.actor = principal.operator(given);
        }
        let span = tracing::Span::current();
        span.record("once.operation_id", id.as_str());
        span.record("once.actor", cmd.actor.to_string());
        let state = self
            .ledger
            .resolve(&principal.tenant, &id, &cmd)
            .await
            .map_err(status::store)?;
        self.settled.notify();
        tracing::info!(state = state.as_str(), "operation resolved");
        Ok(Response::new(convert::resolve_response(state)))
    }
}

impl<B: Backend> LedgerService<B> {
    /// Confirm, ReportAbsent and ReportUnknown: one report, one path.
    async fn report<R: ReportRequest>(
        &self,
        request: Request<R>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let principal = self.access.admit(&request, Allowed::SETTLE).await?;
        let (id, cmd) = convert::report(request.into_inner(), principal.holder(), &self.limits)
            .map_err(status::invalid)?;
        let span = tracing::Span::current();
        span.record("once.operation_id", id.as_str());
        span.record(
            "once.fencing_token",
            i64::try_from(cmd.fencing_token.get()).unwrap_or(i64::MAX),
        );
        let (state, wrote) = self
            .ledger
            .report_noting(&principal.tenant, &id, &cmd)
            .await;
        self.settled.notify();
        self.metrics
            .reported(report_kind(&cmd.report), report_outcome(&state));
        // A refused report that recorded something (a superseded attempt's confirm) settled
        // something: it is free, and its answer stands.
        if !wrote && state.as_ref().is_err_and(settled_nothing) {
            self.access.charge(&principal)?;
        }
        let state = state.map_err(status::store)?;
        Ok(Response::new(convert::report_response(state)))
    }
}

/// Whether a report or heartbeat that failed so named nothing it may act on: an operation that
/// does not exist, an attempt that is not the latest or not the caller's, a lease that ended.
fn settled_nothing(error: &StoreError) -> bool {
    use once_core::Rejection;
    matches!(
        error,
        StoreError::NotFound
            | StoreError::Rejected(
                Rejection::ExecutionRightLost { .. } | Rejection::LeaseExpired { .. }
            )
    )
}
