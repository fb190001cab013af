//! Outbound: domain values to the messages the API answers with.

use once_core::forensics;
use once_core::*;

use super::*;
use crate::pb;

/// One call of an operation, classified.
pub fn call(c: forensics::Call) -> pb::Call {
    pb::Call {
        at: Some(timestamp(c.at)),
        attempt: c.attempt.unwrap_or(0),
        decision: c.decision,
        attempt_id: c.attempt_id,
        context: Some(context(c.context)),
        actor: c.actor.to_string(),
        requested_operation_id: c.requested.map(|id| id.to_string()).unwrap_or_default(),
        origin: c.origin.map(|o| o.as_str().to_owned()).unwrap_or_default(),
    }
}

/// An operation with its attempts, history (this life's, then `earlier` lives' events) and
/// calls, and its link in its provider's dashboard, as GetOperation answers.
pub fn explained(
    op: Operation,
    attempts: Vec<Attempt>,
    (events, earlier): (Vec<Event>, Vec<Event>),
    calls: Vec<forensics::Call>,
    dashboard: Option<String>,
) -> pb::GetOperationResponse {
    pb::GetOperationResponse {
        operation: Some(operation(op)),
        attempts: attempts.into_iter().map(attempt).collect(),
        events: events.into_iter().map(event).collect(),
        forensics: forensics::Summary::of(&calls).to_string(),
        calls: calls.into_iter().map(call).collect(),
        provider_dashboard: dashboard.unwrap_or_default(),
        earlier_events: earlier.into_iter().map(event).collect(),
    }
}

/// A tenant's figures.
pub fn stats_response(stats: once_core::stats::Stats) -> pb::GetStatsResponse {
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let ages = |a: once_core::stats::Ages| pb::Ages {
        count: a.count as u64,
        p50: Some(duration(a.p50)),
        p90: Some(duration(a.p90)),
        p99: Some(duration(a.p99)),
        max: Some(duration(a.max)),
    };
    pb::GetStatsResponse {
        operations: stats
            .operations
            .into_iter()
            .map(|(state, tool, n)| pb::StateCount {
                state: state_to_pb(state) as i32,
                tool,
                count: count(n),
            })
            .collect(),
        unknown: Some(ages(stats.unknown)),
        resolved: stats
            .resolved
            .into_iter()
            .map(|(door, a)| pb::DoorAges {
                door: door.as_str().to_owned(),
                ages: Some(ages(a)),
            })
            .collect(),
        events: stats
            .events
            .into_iter()
            .map(|(kind, n)| pb::KindCount {
                kind: kind.as_str().to_owned(),
                count: count(n),
            })
            .collect(),
        reconcilers: stats
            .lookups
            .into_iter()
            .map(|l| pb::ReconcilerLookups {
                reconciler: l.reconciler,
                settled: count(l.settled),
                missed: count(l.missed),
                failed: count(l.failed),
                mean_latency: l.mean_ms.map(|ms| duration(ms.max(0))),
                max_latency: l.max_ms.map(|ms| duration(ms.max(0))),
            })
            .collect(),
    }
}

/// What GetForensics found over `operations` operations.
pub fn forensics_response(
    operations: usize,
    summary: forensics::Summary,
) -> pb::GetForensicsResponse {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    pb::GetForensicsResponse {
        operations: count(operations),
        executions: count(summary.executions),
        prevented: count(summary.prevented),
        summary: summary.to_string(),
        origins: summary
            .origins
            .iter()
            .map(|(origin, n)| pb::OriginCount {
                origin: origin.as_str().to_owned(),
                count: count(*n),
            })
            .collect(),
    }
}

pub(crate) fn context(c: AttemptContext) -> pb::AttemptContext {
    pb::AttemptContext {
        client_name: c.client_name.unwrap_or_default(),
        session_id: c.session_id.unwrap_or_default(),
        request_id: c.request_id.unwrap_or_default(),
    }
}

/// An event with its operation, for a watcher.
pub fn operation_event(e: OperationEvent) -> pb::OperationEvent {
    pb::OperationEvent {
        tenant: e.tenant,
        operation_id: e.operation_id.to_string(),
        tool: e.tool.unwrap_or_default(),
        state: e.state.map_or(pb::OperationState::Unspecified, state_to_pb) as i32,
        event: Some(event(e.event)),
    }
}

/// One event of a watch, as its stream sends it.
pub fn watched(e: OperationEvent) -> pb::WatchOperationsResponse {
    let item = pb::watch_operations_response::Item::Event(operation_event(e));
    pb::WatchOperationsResponse { item: Some(item) }
}

/// A watch has sent every wanted event up to `sequence`.
pub fn caught_up_to(sequence: i64) -> pb::WatchOperationsResponse {
    let item = pb::watch_operations_response::Item::CaughtUpTo(sequence);
    pb::WatchOperationsResponse { item: Some(item) }
}

pub fn state_to_pb(state: State) -> pb::OperationState {
    match state {
        State::Absent => pb::OperationState::Absent,
        State::InFlight => pb::OperationState::InFlight,
        State::Confirmed => pb::OperationState::Confirmed,
        State::Unknown => pb::OperationState::Unknown,
    }
}

/// An opaque continuation token for `(created_at, operation_id)`.
/// A page token: where the page ended, as the creation time, then the tenant and a NUL when the
/// listing covers every tenant (a tenant's name and an operation id hold no NUL), then the id.
pub fn encode_page_token(end: &PageEnd) -> String {
    let mut raw = end.created_at.to_be_bytes().to_vec();
    if !end.tenant.is_empty() {
        raw.extend_from_slice(end.tenant.as_bytes());
        raw.push(0);
    }
    raw.extend_from_slice(end.operation_id.as_bytes());
    hex::encode(raw)
}

/// The answer to a Begin, with the sealed position of an execution it grants; `None` for a
/// [`BeginDecision::Held`] one, which is no answer but a refusal (LEDGER_BEHIND, built where the
/// hold is known).
pub fn begin_response(
    operation_id: &OperationId,
    decision: BeginDecision,
    position: Option<String>,
) -> Option<pb::BeginResponse> {
    use pb::begin_response::Decision;
    let decision = match decision {
        BeginDecision::Execute(grant) => Decision::Execute(pb::Execute {
            attempt: grant.attempt,
            fencing_token: grant.fencing_token.get(),
            lease_deadline: Some(timestamp(grant.lease_deadline)),
            provider_key: grant.provider_key,
            regranted: grant.regranted,
            lease_ttl: Some(duration(grant.lease_ttl_ms)),
            position: position.unwrap_or_default(),
        }),
        BeginDecision::Replay {
            result,
            provider_ref,
            confirmed_at,
            attempt,
        } => Decision::Replay(pb::Replay {
            result,
            provider_ref: provider_ref.unwrap_or_default(),
            confirmed_at: Some(timestamp(confirmed_at)),
            attempt,
            receipt: String::new(),
        }),
        BeginDecision::InProgress {
            attempt,
            lease_deadline,
            retry_after_ms,
            blocking,
        } => Decision::InProgress(pb::InProgress {
            attempt,
            lease_deadline: Some(timestamp(lease_deadline)),
            retry_after: Some(duration(retry_after_ms)),
            blocking_operation_id: blocking.map(|id| id.to_string()).unwrap_or_default(),
        }),
        BeginDecision::Unknown {
            since,
            reason,
            blocking,
        } => Decision::Unknown(pb::Unknown {
            since: Some(timestamp(since)),
            reason: reason.unwrap_or_default(),
            blocking_operation_id: blocking.map(|id| id.to_string()).unwrap_or_default(),
        }),
        BeginDecision::Conflict { stored, requested } => Decision::Conflict(pb::Conflict {
            stored_fingerprint: stored.to_hex(),
            requested_fingerprint: requested.to_hex(),
        }),
        BeginDecision::Held => return None,
    };
    Some(pb::BeginResponse {
        operation_id: operation_id.to_string(),
        decision: Some(decision),
    })
}

pub fn operation(op: Operation) -> pb::Operation {
    pb::Operation {
        tenant: op.tenant,
        operation_id: op.operation_id.to_string(),
        tool: op.tool,
        state: state_to_pb(op.state) as i32,
        fingerprint: op.fingerprint.to_hex(),
        attempt: op.attempt,
        lease_deadline: (op.state == State::InFlight).then(|| timestamp(op.lease_deadline)),
        provider_key: op.provider_key,
        provider: op.provider.unwrap_or_default(),
        lookup_hints_json: op.lookup_hints.unwrap_or_default(),
        result: op.result.unwrap_or_default(),
        provider_ref: op.provider_ref.unwrap_or_default(),
        reason: op.reason.unwrap_or_default(),
        created_at: Some(timestamp(op.created_at)),
        updated_at: Some(timestamp(op.updated_at)),
        expires_at: op.expires_at.map(timestamp),
        fencing_token: op.fencing_token.get(),
        source: op.source.as_str().to_owned(),
        last_event: String::new(),
        last_event_at: None,
    }
}

/// An operation in a listing, with the latest event of its current life.
pub fn listed(listed: Listed) -> pb::Operation {
    let last_event = listed.last_event;
    pb::Operation {
        last_event: last_event
            .map(|(kind, _)| kind.as_str().to_owned())
            .unwrap_or_default(),
        last_event_at: last_event.map(|(_, at)| timestamp(at)),
        ..operation(listed.operation)
    }
}

pub fn attempt(a: Attempt) -> pb::Attempt {
    pb::Attempt {
        attempt: a.number,
        attempt_id: a.attempt_id,
        started_at: Some(timestamp(a.started_at)),
        lease_deadline: Some(timestamp(a.lease_deadline)),
        actor: a.actor.to_string(),
        context: Some(context(a.context)),
        fencing_token: a.fencing_token.get(),
    }
}

pub fn event(e: Event) -> pb::Event {
    let state = |s: Option<State>| s.map_or(pb::OperationState::Unspecified, state_to_pb) as i32;
    pb::Event {
        sequence: e.sequence,
        at: Some(timestamp(e.at)),
        kind: e.kind.as_str().to_owned(),
        from_state: state(e.from),
        to_state: state(e.to),
        attempt: e.attempt.unwrap_or_default(),
        actor: e.actor.to_string(),
        reason: e.reason.unwrap_or_default(),
        details_json: e.details.unwrap_or_default(),
    }
}

pub fn heartbeat_response(lease_deadline: Millis) -> pb::HeartbeatResponse {
    pb::HeartbeatResponse {
        lease_deadline: Some(timestamp(lease_deadline)),
    }
}

/// A page of a listing, and the token of the next page when there may be more.
pub fn list_operations_response(
    operations: Vec<Listed>,
    next: Option<PageEnd>,
) -> pb::ListOperationsResponse {
    pb::ListOperationsResponse {
        operations: operations.into_iter().map(listed).collect(),
        next_page_token: next.map(|end| encode_page_token(&end)).unwrap_or_default(),
    }
}

/// What a Reconcile's lookup found (`found`) and the state the operation is in afterwards.
pub fn reconcile_response(
    reconciler: String,
    (found, state): (State, State),
    detail: String,
) -> pb::ReconcileResponse {
    pb::ReconcileResponse {
        reconciler,
        verdict: state_to_pb(found) as i32,
        state: state_to_pb(state) as i32,
        detail,
    }
}

pub fn resolve_response(state: State) -> pb::ResolveResponse {
    pb::ResolveResponse {
        state: state_to_pb(state) as i32,
    }
}

pub fn report_response(state: State) -> pb::ReportResponse {
    pb::ReportResponse {
        state: state_to_pb(state) as i32,
    }
}

/// The ledger (its version and database kind) and who the caller is to it: its tenant, and the
/// credential it presented (none on an open ledger).
pub fn server_info_response(
    (version, database): (&str, &str),
    tenant: &str,
    credential: Option<&once_core::access::Credential>,
) -> pb::GetServerInfoResponse {
    pb::GetServerInfoResponse {
        version: version.to_owned(),
        database: database.to_owned(),
        tenant: tenant.to_owned(),
        key_id: credential.map(|c| c.key_id.clone()).unwrap_or_default(),
        key_name: credential.map(|c| c.name.clone()).unwrap_or_default(),
        roles: credential
            .map(|c| c.roles.iter().map(|r| r.as_str().to_owned()).collect())
            .unwrap_or_default(),
        open: credential.is_none(),
    }
}

pub fn history_head(
    tenant: String,
    head: Option<once_core::chain::Link>,
    verified: Option<once_core::chain::Verification>,
) -> pb::GetHistoryHeadResponse {
    let head = head.unwrap_or_else(|| once_core::chain::Link {
        tenant: tenant.clone(),
        number: 0,
        after: 0,
        through: 0,
        entries: String::new(),
        previous: String::new(),
        hash: String::new(),
        at: 0,
    });
    pb::GetHistoryHeadResponse {
        tenant,
        head_number: head.number,
        head_hash: head.hash,
        head_through: head.through,
        linked_at: (head.number > 0).then(|| timestamp(head.at)),
        last_verification: verified.map(|v| pb::HistoryVerification {
            at: Some(timestamp(v.at)),
            links: v.links,
            events: v.events,
            through: v.through,
            problem: v.problem.unwrap_or_default(),
        }),
    }
}

pub fn verify_history_response(verified: once_core::chain::Verified) -> pb::VerifyHistoryResponse {
    let (head_number, head_hash) = verified.head.unwrap_or_default();
    pb::VerifyHistoryResponse {
        tenant: verified.tenant,
        links: verified.links,
        events: verified.events,
        through: verified.through,
        head_number,
        head_hash,
        verified_at: Some(timestamp(verified.at)),
        problem: verified.problem.map(|problem| {
            let operation_id = match &problem {
                once_core::chain::Problem::Changed { operation_id, .. }
                | once_core::chain::Problem::Added { operation_id, .. }
                | once_core::chain::Problem::Result { operation_id, .. }
                | once_core::chain::Problem::State { operation_id, .. } => operation_id.clone(),
                _ => String::new(),
            };
            pb::HistoryProblem {
                code: problem.code().into(),
                sequence: problem.sequence().unwrap_or_default(),
                operation_id,
                message: problem.to_string(),
            }
        }),
    }
}
