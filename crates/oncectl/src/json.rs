//! What programs read (`-o json`): one JSON document a command, or one a line for `watch`.
//! Times are RFC 3339 in UTC (a credential's are milliseconds, as `onced keys` prints them:
//! [`once_core::access::Credential::to_json`]); a result is its text when it is UTF-8, else its
//! bytes as numbers.

use std::time::SystemTime;

use once_client::{
    AgesView, AttemptView, CallView, EventView, ForensicsView, OperationView, Reconciled,
    ServerInfo, StatsView, WatchedEvent,
};
use once_core::State;
use serde_json::{json, Value};

fn time(at: Option<SystemTime>) -> Value {
    match at {
        Some(at) => {
            let at: chrono::DateTime<chrono::Utc> = at.into();
            Value::String(at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        }
        None => Value::Null,
    }
}

fn state(state: Option<State>) -> Value {
    state.map_or(Value::Null, |s| Value::String(s.as_str().to_owned()))
}

/// A result as JSON text when it is UTF-8, else its bytes as a list of numbers.
fn result(bytes: &Option<Vec<u8>>) -> Value {
    match bytes {
        None => Value::Null,
        Some(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => Value::String(text.to_owned()),
            Err(_) => Value::from(bytes.clone()),
        },
    }
}

pub fn operation(op: &OperationView) -> Value {
    json!({
        "tenant": op.tenant,
        "operation_id": op.operation_id,
        "tool": op.tool,
        "state": op.state.as_str(),
        "source": op.source,
        "attempt": op.attempt,
        "fencing_token": op.fencing_token,
        "fingerprint": op.fingerprint,
        "provider": op.provider,
        // The hints are JSON the executor sent: kept as JSON, not as a string of it.
        "lookup_hints": op.lookup_hints.as_deref().map(|hints| {
            serde_json::from_str::<Value>(hints).unwrap_or_else(|_| Value::String(hints.to_owned()))
        }),
        "provider_key": op.provider_key,
        "provider_ref": op.provider_ref,
        "result": result(&op.result),
        "reason": op.reason,
        "lease_deadline": time(op.lease_deadline),
        "expires_at": time(op.expires_at),
        "created_at": time(op.created_at),
        "updated_at": time(op.updated_at),
        "last_event": op.last_event.as_ref().map(|(kind, _)| kind),
        "last_event_at": time(op.last_event.as_ref().map(|(_, at)| *at)),
        "attempts": op.attempts.iter().map(attempt).collect::<Vec<_>>(),
        "events": op.events.iter().map(event).collect::<Vec<_>>(),
        "calls": op.calls.iter().map(call).collect::<Vec<_>>(),
        "forensics": op.forensics,
        "provider_dashboard": op.provider_dashboard,
        "earlier_events": op.earlier_events.iter().map(event).collect::<Vec<_>>(),
    })
}

pub fn call(c: &CallView) -> Value {
    json!({
        "at": time(c.at),
        "attempt": c.attempt,
        "decision": c.decision,
        "attempt_id": c.attempt_id,
        "client_name": c.context.client_name,
        "session_id": c.context.session_id,
        "request_id": c.context.request_id,
        "actor": c.actor,
        "requested_operation_id": c.requested_operation_id,
        "origin": c.origin,
    })
}

fn ages(a: &AgesView) -> Value {
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    json!({
        "count": a.count,
        "p50_ms": ms(a.p50),
        "p90_ms": ms(a.p90),
        "p99_ms": ms(a.p99),
        "max_ms": ms(a.max),
    })
}

pub fn status(reached: &crate::Reached, info: &ServerInfo) -> Value {
    json!({
        "address": reached.address,
        "tls": reached.tls,
        "private_ca": reached.private_ca,
        "client_certificate": reached.client_certificate,
        "version": info.version,
        "database": info.database,
        "tenant": info.tenant,
        "open": info.key.is_none(),
        "key_id": info.key.as_ref().map(|k| &k.key_id),
        "key_name": info.key.as_ref().map(|k| &k.name),
        "roles": info.key.as_ref().map(|k| &k.roles),
    })
}

pub fn stats(s: &StatsView, window: &str) -> Value {
    let operations: Vec<Value> = s
        .operations
        .iter()
        .map(|(state, tool, count)| json!({"state": state.as_str(), "tool": tool, "count": count}))
        .collect();
    let resolved: serde_json::Map<String, Value> = s
        .resolved
        .iter()
        .map(|(door, a)| (door.clone(), ages(a)))
        .collect();
    let events: serde_json::Map<String, Value> = s
        .events
        .iter()
        .map(|(kind, n)| (kind.clone(), Value::from(*n)))
        .collect();
    let millis = |d: Option<std::time::Duration>| d.map(|d| d.as_millis() as u64);
    let reconcilers: Vec<Value> = s
        .reconcilers
        .iter()
        .map(|r| {
            json!({
                "reconciler": r.reconciler,
                "lookups": r.lookups(),
                "settled": r.settled,
                "missed": r.missed,
                "failed": r.failed,
                "mean_ms": millis(r.mean),
                "max_ms": millis(r.max),
            })
        })
        .collect();
    json!({
        "window": window,
        "operations": operations,
        "unknown": ages(&s.unknown),
        "resolved": resolved,
        "events": events,
        "reconcilers": reconcilers,
    })
}

pub fn forensics(found: &ForensicsView, since: &str) -> Value {
    let origins: serde_json::Map<String, Value> = found
        .origins
        .iter()
        .map(|(origin, count)| (origin.clone(), Value::from(*count)))
        .collect();
    json!({
        "since": since,
        "operations": found.operations,
        "executions": found.executions,
        "prevented": found.prevented,
        "origins": origins,
        "summary": found.summary,
    })
}

pub fn attempt(a: &AttemptView) -> Value {
    json!({
        "attempt": a.number,
        "attempt_id": a.attempt_id,
        "fencing_token": a.fencing_token,
        "actor": a.actor,
        "client_name": a.context.client_name,
        "session_id": a.context.session_id,
        "request_id": a.context.request_id,
        "started_at": time(a.started_at),
        "lease_deadline": time(a.lease_deadline),
    })
}

pub fn event(e: &EventView) -> Value {
    let details = e
        .details
        .as_deref()
        .and_then(|d| serde_json::from_str::<Value>(d).ok());
    json!({
        "sequence": e.sequence,
        "at": time(e.at),
        "kind": e.kind,
        "from": state(e.from),
        "to": state(e.to),
        "attempt": e.attempt,
        "actor": e.actor,
        "reason": e.reason,
        "details": details,
    })
}

pub fn watched(e: &WatchedEvent) -> Value {
    let mut value = event(&e.event);
    value["tenant"] = e.tenant.clone().into();
    value["operation_id"] = e.operation_id.clone().into();
    value["tool"] = e.tool.clone().into();
    value["state"] = state(e.state);
    value
}

pub fn reconciled(operation_id: &str, r: &Reconciled) -> Value {
    json!({
        "operation_id": operation_id,
        "reconciler": r.reconciler,
        "verdict": state(r.verdict),
        "state": state(r.state),
        "detail": r.detail,
    })
}

pub fn receipt(receipt: &once_client::Receipt, result_matches: Option<bool>) -> Value {
    json!({
        "verified": true,
        "ledger": receipt.ledger,
        "key": receipt.key,
        "tenant": receipt.tenant,
        "operation_id": receipt.operation_id,
        "tool": receipt.tool,
        "life": receipt.life,
        "state": receipt.state.as_str(),
        "source": receipt.source,
        "attempt": receipt.attempt,
        "fencing_token": receipt.fencing_token,
        "confirmed_by": receipt.confirmed_by,
        "result_sha256": receipt.result_sha256,
        "provider_ref": receipt.provider_ref,
        "sequence": receipt.sequence,
        "settled_at": time(Some(millis_time(receipt.settled_at))),
        "issued_at": time(Some(millis_time(receipt.issued_at))),
        "result_matches": result_matches,
    })
}

/// A time in milliseconds since the epoch.
pub fn millis_time(millis: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}

pub fn history(found: &once_client::HistoryView) -> Value {
    json!({
        "tenant": found.tenant,
        "links": found.links,
        "events": found.events,
        "through": found.through,
        "head": { "number": found.head_number, "hash": found.head_hash },
        "verified_at": time(Some(found.verified_at)),
        "problem": found.problem.as_ref().map(|p| json!({
            "code": p.code,
            "sequence": p.sequence,
            "operation_id": p.operation_id,
            "message": p.message,
        })),
    })
}
