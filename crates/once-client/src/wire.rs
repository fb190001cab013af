//! The wire's types turned into the client's, and back: the one place this crate builds a
//! protobuf request from its own types or reads an answer into them (a Begin's decision, a
//! listing, a credential …). The calls that send them (`client`, `attempt`, `operator`) never
//! name a message.

use std::time::{Duration, SystemTime};

use once_api::admin_pb as apb;
use once_api::convert::{millis, state_to_pb};
use once_api::pb;
use once_core::access::{Credential, CredentialKind, Roles};
use once_core::{AttemptContext, State};
use tonic::Streaming;

use crate::attempt::{Attempt, Grant};
use crate::decision::{Conflict, Decision, InProgress, Replay, Unknown};
use crate::effect::Effect;
use crate::error::ClientError;
use crate::operator::{ListFilter, Page, Reconciled, Resolution, Truth, WatchRequest, Watched};
use crate::spec::OperationSpec;
use crate::view::{
    AgesView, AttemptView, CallView, EventView, ForensicsView, KeyInfo, OperationView,
    ReconcilerView, ServerInfo, StatsView, WatchedEvent,
};

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

fn std_duration(d: prost_types::Duration) -> Duration {
    Duration::new(
        u64::try_from(d.seconds).unwrap_or(0),
        u32::try_from(d.nanos).unwrap_or(0),
    )
}

fn system_time(ts: prost_types::Timestamp) -> SystemTime {
    let millis = u64::try_from(once_api::convert::millis(&ts)).unwrap_or(0);
    SystemTime::UNIX_EPOCH + Duration::from_millis(millis)
}

/// An empty string is the wire's "none".
fn present(text: String) -> Option<String> {
    Some(text).filter(|t| !t.is_empty())
}

fn context(context: &AttemptContext) -> pb::AttemptContext {
    pb::AttemptContext {
        client_name: context.client_name.clone().unwrap_or_default(),
        session_id: context.session_id.clone().unwrap_or_default(),
        request_id: context.request_id.clone().unwrap_or_default(),
    }
}

pub(crate) fn state(value: i32) -> Option<State> {
    match pb::OperationState::try_from(value).ok()? {
        pb::OperationState::Absent => Some(State::Absent),
        pb::OperationState::InFlight => Some(State::InFlight),
        pb::OperationState::Confirmed => Some(State::Confirmed),
        pb::OperationState::Unknown => Some(State::Unknown),
        pb::OperationState::Unspecified => None,
    }
}

pub(crate) fn operation(found: pb::GetOperationResponse) -> OperationView {
    let mut view = summary(found.operation.unwrap_or_default());
    view.attempts = found.attempts.into_iter().map(attempt).collect();
    view.events = found.events.into_iter().map(event).collect();
    view.calls = found.calls.into_iter().map(call).collect();
    view.forensics = present(found.forensics);
    view.provider_dashboard = present(found.provider_dashboard);
    view.earlier_events = found.earlier_events.into_iter().map(event).collect();
    view
}

fn call(c: pb::Call) -> CallView {
    CallView {
        at: c.at.map(system_time),
        attempt: (c.attempt != 0).then_some(c.attempt),
        decision: c.decision,
        attempt_id: c.attempt_id,
        context: attempt_context(c.context.unwrap_or_default()),
        actor: c.actor,
        requested_operation_id: present(c.requested_operation_id),
        origin: present(c.origin),
    }
}

fn attempt_context(context: pb::AttemptContext) -> AttemptContext {
    AttemptContext {
        client_name: present(context.client_name),
        session_id: present(context.session_id),
        request_id: present(context.request_id),
    }
}

pub(crate) fn stats(found: pb::GetStatsResponse) -> StatsView {
    let ages = |a: Option<pb::Ages>| {
        let a = a.unwrap_or_default();
        let d = |d: Option<prost_types::Duration>| d.map(std_duration).unwrap_or_default();
        AgesView {
            count: a.count,
            p50: d(a.p50),
            p90: d(a.p90),
            p99: d(a.p99),
            max: d(a.max),
        }
    };
    StatsView {
        operations: found
            .operations
            .into_iter()
            .filter_map(|c| Some((state(c.state)?, c.tool, c.count)))
            .collect(),
        unknown: ages(found.unknown),
        resolved: found
            .resolved
            .into_iter()
            .map(|d| (d.door, ages(d.ages)))
            .collect(),
        events: found
            .events
            .into_iter()
            .map(|e| (e.kind, e.count))
            .collect(),
        reconcilers: found
            .reconcilers
            .into_iter()
            .map(|r| ReconcilerView {
                reconciler: r.reconciler,
                settled: r.settled,
                missed: r.missed,
                failed: r.failed,
                mean: r.mean_latency.map(std_duration),
                max: r.max_latency.map(std_duration),
            })
            .collect(),
    }
}

pub(crate) fn forensics(found: pb::GetForensicsResponse) -> ForensicsView {
    ForensicsView {
        operations: found.operations,
        executions: found.executions,
        prevented: found.prevented,
        origins: found
            .origins
            .into_iter()
            .map(|o| (o.origin, o.count))
            .collect(),
        summary: found.summary,
    }
}

/// An operation without its history, as a listing holds it.
fn summary(op: pb::Operation) -> OperationView {
    OperationView {
        state: state(op.state).unwrap_or(State::Unknown),
        result: Some(op.result)
            .filter(|r| !r.is_empty() || op.state == pb::OperationState::Confirmed as i32),
        tenant: op.tenant,
        operation_id: op.operation_id,
        tool: op.tool,
        attempt: op.attempt,
        fencing_token: op.fencing_token,
        provider_ref: present(op.provider_ref),
        provider_key: op.provider_key,
        reason: present(op.reason),
        source: op.source,
        fingerprint: op.fingerprint,
        provider: present(op.provider),
        lookup_hints: present(op.lookup_hints_json),
        lease_deadline: op.lease_deadline.map(system_time),
        expires_at: op.expires_at.map(system_time),
        created_at: op.created_at.map(system_time),
        updated_at: op.updated_at.map(system_time),
        last_event: present(op.last_event).zip(op.last_event_at.map(system_time)),
        attempts: Vec::new(),
        events: Vec::new(),
        calls: Vec::new(),
        forensics: None,
        provider_dashboard: None,
        earlier_events: Vec::new(),
    }
}

fn watched_event(e: pb::OperationEvent) -> WatchedEvent {
    WatchedEvent {
        tenant: e.tenant,
        operation_id: e.operation_id,
        tool: e.tool,
        state: state(e.state),
        event: event(e.event.unwrap_or_default()),
    }
}

fn attempt(a: pb::Attempt) -> AttemptView {
    AttemptView {
        number: a.attempt,
        fencing_token: a.fencing_token,
        attempt_id: a.attempt_id,
        context: attempt_context(a.context.unwrap_or_default()),
        actor: a.actor,
        started_at: a.started_at.map(system_time),
        lease_deadline: a.lease_deadline.map(system_time),
    }
}

fn event(e: pb::Event) -> EventView {
    EventView {
        sequence: e.sequence,
        at: e.at.map(system_time),
        kind: e.kind,
        from: state(e.from_state),
        to: state(e.to_state),
        attempt: e.attempt,
        actor: e.actor,
        reason: present(e.reason),
        details: present(e.details_json),
    }
}

pub(crate) fn server_info(found: pb::GetServerInfoResponse) -> ServerInfo {
    let key = (!found.open).then_some(KeyInfo {
        key_id: found.key_id,
        name: found.key_name,
        roles: found.roles,
    });
    ServerInfo {
        version: found.version,
        database: found.database,
        tenant: found.tenant,
        key,
    }
}

/// A Begin's answer as the client's [`Decision`]; `start` makes the attempt an EXECUTE grants.
pub(crate) fn decision(
    response: pb::BeginResponse,
    start: impl FnOnce(String, Grant) -> Attempt,
) -> Decision {
    use pb::begin_response::Decision as D;
    let operation_id = response.operation_id;
    match response.decision {
        Some(D::Execute(grant)) => {
            let grant = Grant {
                attempt: grant.attempt,
                fencing_token: grant.fencing_token,
                provider_key: grant.provider_key,
                lease_deadline: grant.lease_deadline.map(system_time),
                lease_ttl: grant.lease_ttl.map(std_duration),
            };
            Decision::Execute(start(operation_id, grant))
        }
        Some(D::Replay(replay)) => {
            // Only a receipt of this very result is handed on.
            let receipt = Some(replay.receipt).filter(|text| {
                crate::Receipt::unverified(text)
                    .is_ok_and(|receipt| receipt.covers_result(&replay.result))
            });
            Decision::Replay(Replay {
                operation_id,
                result: replay.result,
                provider_ref: Some(replay.provider_ref).filter(|r| !r.is_empty()),
                confirmed_at: replay
                    .confirmed_at
                    .map(system_time)
                    .unwrap_or(SystemTime::UNIX_EPOCH),
                receipt,
            })
        }
        Some(D::InProgress(p)) => Decision::InProgress(InProgress {
            operation_id,
            retry_after: p
                .retry_after
                .map(std_duration)
                .unwrap_or(Duration::from_secs(1)),
            blocking_operation_id: Some(p.blocking_operation_id).filter(|b| !b.is_empty()),
        }),
        Some(D::Unknown(u)) => Decision::Unknown(Unknown {
            operation_id,
            reason: u.reason,
            blocking_operation_id: Some(u.blocking_operation_id).filter(|b| !b.is_empty()),
        }),
        Some(D::Conflict(c)) => Decision::Conflict(Conflict {
            operation_id,
            stored_fingerprint: c.stored_fingerprint,
            requested_fingerprint: c.requested_fingerprint,
        }),
        None => Decision::Unknown(Unknown {
            operation_id,
            reason: "the ledger sent no decision".into(),
            blocking_operation_id: None,
        }),
    }
}

/// A credential as the admin service lists it.
pub(crate) fn credential(key: apb::Key) -> Result<Credential, ClientError> {
    let invalid = |what: String| ClientError::Invalid(format!("the ledger sent {what}"));
    Ok(Credential {
        roles: once_api::admin::roles(&key.roles).map_err(|e| invalid(e.to_string()))?,
        kind: CredentialKind::parse(&key.kind)
            .ok_or_else(|| invalid(format!("an unknown credential kind {:?}", key.kind)))?,
        key_id: key.key_id,
        tenant: key.tenant,
        name: key.name,
        // A ledger older than the Timestamp fields sends only the milliseconds.
        #[allow(deprecated)]
        created_at: key.created_at.as_ref().map_or(key.created_at_ms, millis),
        #[allow(deprecated)]
        revoked_at: match &key.revoked_at {
            Some(at) => Some(millis(at)),
            None => once_api::admin::cap(key.revoked_at_ms),
        },
    })
}

/// A created key and, for a generated one, its secret.
pub(crate) fn created_key(
    created: apb::CreateKeyResponse,
) -> Result<(Credential, Option<String>), ClientError> {
    let key = credential(created.key.unwrap_or_default())?;
    Ok((key, present(created.secret)))
}

/// A page of a listing.
pub(crate) fn page(listed: pb::ListOperationsResponse) -> Page {
    Page {
        operations: listed.operations.into_iter().map(summary).collect(),
        next: present(listed.next_page_token),
    }
}

pub(crate) fn reconciled(reconciled: pb::ReconcileResponse) -> Reconciled {
    Reconciled {
        reconciler: reconciled.reconciler,
        verdict: state(reconciled.verdict),
        state: state(reconciled.state),
        detail: reconciled.detail,
    }
}

/// The stream a watch reads.
pub(crate) type EventStream = Streaming<pb::WatchOperationsResponse>;

/// A Begin's answer, as it came: read by [`decision`] and [`granted_position`].
pub(crate) type BeginAnswer = pb::BeginResponse;

/// One message of a watch: an event, or how far it has caught up; `None` when it holds neither.
pub(crate) fn watched(message: pb::WatchOperationsResponse) -> Option<Watched> {
    use pb::watch_operations_response::Item;
    match message.item? {
        Item::Event(event) => Some(Watched::Event(watched_event(event))),
        Item::CaughtUpTo(sequence) => Some(Watched::CaughtUpTo(sequence)),
    }
}

// The requests, each built from the client's own types.

fn states(states: &[State]) -> Vec<i32> {
    states.iter().map(|s| state_to_pb(*s) as i32).collect()
}

pub(crate) fn begin(
    spec: &OperationSpec,
    operation_id: String,
    fingerprint: String,
    attempt_id: String,
    attempt_context: &AttemptContext,
    (seen_position, operation_position): (Option<String>, Option<String>),
) -> pb::BeginRequest {
    pb::BeginRequest {
        tool: spec.tool.clone(),
        // Every identity form is resolved by the client, so the ledger gets the id it would
        // compute.
        identity: Some(pb::begin_request::Identity::OperationId(operation_id)),
        effect: Some(pb::begin_request::Effect::Fingerprint(fingerprint)),
        volatile_fields: Vec::new(),
        attempt_id,
        context: Some(context(attempt_context)),
        lease_ttl: spec.lease_ttl.map(duration),
        wait: spec.wait.map(duration),
        new_intent: spec.new_intent,
        retention: spec.retention.map(duration),
        provider: spec.provider.clone().unwrap_or_default(),
        lookup_hints_json: spec
            .lookup_hints
            .as_ref()
            .map(|h| h.to_string())
            .unwrap_or_default(),
        seen_position: seen_position.unwrap_or_default(),
        operation_position: operation_position.unwrap_or_default(),
        want_receipt: spec.want_receipt,
    }
}

/// The request fields a Begin shows positions in, as a refusal names them.
pub(crate) const SEEN_POSITION: &str = "seen_position";
pub(crate) const OPERATION_POSITION: &str = "operation_position";

/// The sealed position of the execution a Begin granted, if it granted one.
pub(crate) fn granted_position(response: &pb::BeginResponse) -> Option<&str> {
    match &response.decision {
        Some(pb::begin_response::Decision::Execute(execute)) if !execute.position.is_empty() => {
            Some(&execute.position)
        }
        _ => None,
    }
}

pub(crate) fn recover_operations(positions: Vec<String>) -> pb::RecoverOperationsRequest {
    pb::RecoverOperationsRequest { positions }
}

/// How many operations a RecoverOperations call brought back.
pub(crate) fn recovered(response: &pb::RecoverOperationsResponse) -> usize {
    response.operations.iter().filter(|o| o.recovered).count()
}

pub(crate) fn confirm(
    operation_id: String,
    fencing_token: u64,
    effect: Effect,
) -> pb::ConfirmRequest {
    pb::ConfirmRequest {
        operation_id,
        fencing_token,
        result: effect.result,
        provider_ref: effect.provider_ref.unwrap_or_default(),
    }
}

pub(crate) fn report_absent(
    operation_id: String,
    fencing_token: u64,
    reason: String,
) -> pb::ReportAbsentRequest {
    pb::ReportAbsentRequest {
        operation_id,
        fencing_token,
        reason,
    }
}

pub(crate) fn report_unknown(
    operation_id: String,
    fencing_token: u64,
    reason: String,
) -> pb::ReportUnknownRequest {
    pb::ReportUnknownRequest {
        operation_id,
        fencing_token,
        reason,
    }
}

pub(crate) fn heartbeat(
    operation_id: &str,
    fencing_token: u64,
    ttl: Duration,
) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        operation_id: operation_id.to_owned(),
        fencing_token,
        lease_ttl: Some(duration(ttl)),
    }
}

pub(crate) fn get_operation(operation_id: &str, tenant: String) -> pb::GetOperationRequest {
    pb::GetOperationRequest {
        operation_id: operation_id.to_owned(),
        tenant,
    }
}

pub(crate) fn server_info_request() -> pb::GetServerInfoRequest {
    pb::GetServerInfoRequest {}
}

pub(crate) fn list(
    filter: &ListFilter,
    page_size: u32,
    page: Option<&str>,
    tenant: String,
    all_tenants: bool,
) -> pb::ListOperationsRequest {
    pb::ListOperationsRequest {
        states: states(&filter.states),
        tool: filter.tool.clone().unwrap_or_default(),
        provider: filter.provider.clone().unwrap_or_default(),
        older_than: filter.older_than.map(duration),
        page_size,
        page_token: page.unwrap_or_default().to_owned(),
        tenant,
        all_tenants,
    }
}

pub(crate) fn watch(
    request: &WatchRequest,
    tenant: String,
    all_tenants: bool,
) -> pb::WatchOperationsRequest {
    pb::WatchOperationsRequest {
        after_sequence: request.after.unwrap_or(0),
        from_now: request.after.is_none(),
        states: states(&request.states),
        kinds: request.kinds.clone(),
        tool: request.tool.clone().unwrap_or_default(),
        tenant,
        all_tenants,
    }
}

pub(crate) fn resolve(resolution: &Resolution) -> pb::ResolveRequest {
    let (outcome, result, provider_ref) = match &resolution.truth {
        Truth::Confirmed {
            result,
            provider_ref,
        } => (
            State::Confirmed,
            result.clone(),
            provider_ref.clone().unwrap_or_default(),
        ),
        Truth::Absent => (State::Absent, Vec::new(), String::new()),
    };
    pb::ResolveRequest {
        operation_id: resolution.operation_id.clone(),
        outcome: state_to_pb(outcome) as i32,
        result,
        provider_ref,
        reason: resolution.reason.clone(),
        operator: resolution.operator.clone(),
        resolution_id: resolution.resolution_id.clone(),
        attempt: resolution.attempt.unwrap_or(0),
        fencing_token: resolution.fencing_token,
    }
}

pub(crate) fn reconcile(operation_id: &str, operator: &str) -> pb::ReconcileRequest {
    pb::ReconcileRequest {
        operation_id: operation_id.to_owned(),
        operator: operator.to_owned(),
    }
}

pub(crate) fn get_stats(
    window: Duration,
    tenant: String,
    all_tenants: bool,
) -> pb::GetStatsRequest {
    pb::GetStatsRequest {
        window: Some(duration(window)),
        tenant,
        all_tenants,
    }
}

pub(crate) fn get_forensics(
    tool: Option<&str>,
    since: Duration,
    tenant: String,
) -> pb::GetForensicsRequest {
    pb::GetForensicsRequest {
        tool: tool.unwrap_or_default().to_owned(),
        since: Some(duration(since)),
        tenant,
    }
}

pub(crate) fn create_key(
    tenant: &str,
    name: &str,
    roles: &Roles,
    certificate_pem: Option<&str>,
) -> apb::CreateKeyRequest {
    apb::CreateKeyRequest {
        tenant: tenant.to_owned(),
        name: name.to_owned(),
        roles: roles.iter().map(|r| r.to_string()).collect(),
        certificate_pem: certificate_pem.unwrap_or_default().to_owned(),
    }
}

pub(crate) fn list_keys(tenant: Option<&str>) -> apb::ListKeysRequest {
    apb::ListKeysRequest {
        tenant: tenant.unwrap_or_default().to_owned(),
    }
}

pub(crate) fn revoke_key(key_id: &str) -> apb::RevokeKeyRequest {
    apb::RevokeKeyRequest {
        key_id: key_id.to_owned(),
    }
}

pub(crate) fn verify_history(from: i64, tenant: String) -> pb::VerifyHistoryRequest {
    pb::VerifyHistoryRequest {
        tenant,
        from_sequence: from,
    }
}

pub(crate) fn get_history_head(tenant: String) -> pb::GetHistoryHeadRequest {
    pb::GetHistoryHeadRequest { tenant }
}

pub(crate) fn history_head(found: pb::GetHistoryHeadResponse) -> crate::HistoryHead {
    crate::HistoryHead {
        tenant: found.tenant,
        head_number: found.head_number,
        head_hash: found.head_hash,
        head_through: found.head_through,
        linked_at: found.linked_at.map(system_time),
        last_verification: found.last_verification.map(|v| crate::LastVerification {
            at: v.at.map(system_time).unwrap_or(SystemTime::UNIX_EPOCH),
            links: v.links,
            events: v.events,
            through: v.through,
            problem: Some(v.problem).filter(|p| !p.is_empty()),
        }),
    }
}

pub(crate) fn get_receipt(operation_id: &str, tenant: String) -> pb::GetReceiptRequest {
    pb::GetReceiptRequest {
        operation_id: operation_id.to_owned(),
        tenant,
    }
}

pub(crate) fn get_signing_keys() -> pb::GetSigningKeysRequest {
    pb::GetSigningKeysRequest {}
}

pub(crate) fn signing_keys(found: pb::GetSigningKeysResponse) -> crate::SigningKeys {
    let mut keys = Vec::new();
    let mut active = None;
    for listed in found.keys {
        // A key this client cannot read is left out: a receipt it signed does not verify here.
        let Ok(key) = crate::PublicKey::parse(&listed.public_key) else {
            continue;
        };
        if listed.active {
            active = Some(key.id().to_owned());
        }
        keys.push(key);
    }
    crate::SigningKeys {
        ledger: found.ledger,
        active,
        keys,
    }
}

pub(crate) fn history(found: pb::VerifyHistoryResponse) -> crate::HistoryView {
    crate::HistoryView {
        tenant: found.tenant,
        links: found.links,
        events: found.events,
        through: found.through,
        head_number: found.head_number,
        head_hash: found.head_hash,
        verified_at: found
            .verified_at
            .map(system_time)
            .unwrap_or(SystemTime::UNIX_EPOCH),
        problem: found.problem.map(|p| crate::HistoryProblem {
            code: p.code,
            sequence: p.sequence,
            operation_id: p.operation_id,
            message: p.message,
        }),
    }
}

#[cfg(test)]
mod tests {
    use once_core::access::{CredentialKind, Role, Roles};

    use super::*;

    fn key() -> apb::Key {
        apb::Key {
            key_id: "2fa1ee5785ef".into(),
            tenant: "acme".into(),
            name: "oncall".into(),
            roles: vec!["reader".into()],
            kind: "key".into(),
            ..Default::default()
        }
    }

    #[test]
    #[allow(deprecated)]
    fn a_key_from_a_ledger_older_than_its_timestamps_reads_its_milliseconds() {
        let old = apb::Key {
            created_at_ms: 1_700_000_000_000,
            revoked_at_ms: 1_700_000_500_000,
            ..key()
        };
        let read = credential(old).expect("a valid key");
        assert_eq!(read.created_at, 1_700_000_000_000);
        assert_eq!(read.revoked_at, Some(1_700_000_500_000));
        assert_eq!(read.roles, Roles::of([Role::Reader]));
        assert_eq!(read.kind, CredentialKind::Key);
    }

    #[test]
    #[allow(deprecated)]
    fn a_keys_timestamps_win_over_its_milliseconds() {
        let new = apb::Key {
            created_at: Some(once_api::convert::timestamp(1_700_000_000_000)),
            revoked_at: None,
            created_at_ms: 1,
            revoked_at_ms: 0,
            ..key()
        };
        let read = credential(new).expect("a valid key");
        assert_eq!(
            (read.created_at, read.revoked_at),
            (1_700_000_000_000, None)
        );
    }
}
