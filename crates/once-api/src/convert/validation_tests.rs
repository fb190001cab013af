//! Every malformed request is refused naming the field, before anything touches storage. The
//! cases are data: one table, one check. (The service answers each INVALID_ARGUMENT with the
//! field in its `ErrorInfo`; the integration suite checks that end to end.)

use super::*;
use crate::pb;

fn ms(ms: u64) -> Duration {
    Duration {
        seconds: i64::try_from(ms / 1000).unwrap(),
        nanos: i32::try_from(ms % 1000).unwrap() * 1_000_000,
    }
}

/// A well-formed Begin, which each case breaks in one way.
fn valid_begin() -> pb::BeginRequest {
    pb::BeginRequest {
        tool: "issue_refund".into(),
        identity: Some(pb::begin_request::Identity::OperationId("new-op".into())),
        effect: Some(pb::begin_request::Effect::ArgumentsJson(
            r#"{"order":"o-1","amount_cents":500,"currency":"eur"}"#.into(),
        )),
        attempt_id: "0b7c5e8e-5d0c-4c4e-9a53-0d1f3f1d2a11".into(),
        context: Some(pb::AttemptContext {
            client_name: "test".into(),
            session_id: "session-1".into(),
            request_id: "1".into(),
        }),
        ..Default::default()
    }
}

/// One call of the API.
enum Call {
    Begin(Box<pb::BeginRequest>),
    Confirm(pb::ConfirmRequest),
    Absent(pb::ReportAbsentRequest),
    Unknown(pb::ReportUnknownRequest),
    Heartbeat(pb::HeartbeatRequest),
    Get(pb::GetOperationRequest),
    List(pb::ListOperationsRequest),
    Resolve(pb::ResolveRequest),
}

/// Converts one call as the service does, before anything touches storage.
fn convert(call: Call) -> Result<(), Invalid> {
    let limits = Limits::default();
    let caller = Caller {
        tenant: "default".into(),
        actor: Actor::Executor("test".into()),
        holder: None,
    };
    match call {
        Call::Begin(r) => begin(*r, &caller, &limits).map(drop),
        Call::Confirm(r) => report(r, None, &limits).map(drop),
        Call::Absent(r) => report(r, None, &limits).map(drop),
        Call::Unknown(r) => report(r, None, &limits).map(drop),
        Call::Heartbeat(r) => heartbeat(r, None, &limits).map(drop),
        Call::Get(r) => get_operation(r).map(drop),
        Call::List(r) => list_operations(r).map(drop),
        Call::Resolve(r) => resolve(r, &limits).map(drop),
    }
}

const ID: &str = "valid-op";

fn with_begin(change: impl FnOnce(&mut pb::BeginRequest)) -> Call {
    let mut request = valid_begin();
    change(&mut request);
    Call::Begin(Box::new(request))
}

fn with_confirm(token: u64, change: impl FnOnce(&mut pb::ConfirmRequest)) -> Call {
    let mut request = pb::ConfirmRequest {
        operation_id: ID.into(),
        fencing_token: token,
        result: b"ok".to_vec(),
        provider_ref: "re_1".into(),
    };
    change(&mut request);
    Call::Confirm(request)
}

fn with_resolve(change: impl FnOnce(&mut pb::ResolveRequest)) -> Call {
    let mut request = pb::ResolveRequest {
        operation_id: ID.into(),
        outcome: pb::OperationState::Absent as i32,
        reason: "checked".into(),
        operator: "alice".into(),
        resolution_id: "r-1".into(),
        ..Default::default()
    };
    change(&mut request);
    Call::Resolve(request)
}

fn part(kind: pb::intent_part::Kind) -> pb::IntentPart {
    pb::IntentPart { kind: Some(kind) }
}

fn intent(parts: Vec<pb::IntentPart>) -> Option<pb::begin_request::Identity> {
    Some(pb::begin_request::Identity::Intent(pb::Intent { parts }))
}

fn cases(token: u64) -> Vec<(&'static str, Call, &'static str)> {
    use pb::begin_request::{Effect, Identity};
    use pb::intent_part::Kind;
    let long = |n: usize| "x".repeat(n);
    let args = |json: &str| Some(Effect::ArgumentsJson(json.into()));
    vec![
        ("empty tool", with_begin(|r| r.tool.clear()), "tool"),
        ("long tool", with_begin(|r| r.tool = long(129)), "tool"),
        (
            "tool with control character",
            with_begin(|r| r.tool = "a\u{7}b".into()),
            "tool",
        ),
        ("no identity", with_begin(|r| r.identity = None), "identity"),
        (
            "empty operation id",
            with_begin(|r| r.identity = Some(Identity::OperationId(String::new()))),
            "operation_id",
        ),
        (
            "long operation id",
            with_begin(|r| r.identity = Some(Identity::OperationId(long(256)))),
            "operation_id",
        ),
        (
            "operation id with NUL",
            with_begin(|r| r.identity = Some(Identity::OperationId("a\0b".into()))),
            "operation_id",
        ),
        (
            "intent without parts",
            with_begin(|r| r.identity = intent(vec![])),
            "intent.parts",
        ),
        (
            "intent part unset",
            with_begin(|r| r.identity = intent(vec![pb::IntentPart { kind: None }])),
            "intent.parts[0]",
        ),
        (
            "intent integer out of range",
            with_begin(|r| {
                r.identity = intent(vec![
                    part(Kind::Text("o".into())),
                    part(Kind::Integer(1 << 53)),
                ])
            }),
            "intent.parts[1]",
        ),
        (
            "intent fraction",
            with_begin(|r| {
                r.identity = intent(vec![part(Kind::Text("o".into())), part(Kind::Number(1.5))])
            }),
            "intent.parts[1]",
        ),
        (
            "intent NaN",
            with_begin(|r| r.identity = intent(vec![part(Kind::Number(f64::NAN))])),
            "intent.parts[0]",
        ),
        (
            "derived without arguments",
            with_begin(|r| {
                r.identity = Some(Identity::Derived(pb::Derived {}));
                r.effect = Some(Effect::Fingerprint("a".repeat(64)));
            }),
            "arguments_json",
        ),
        ("no effect", with_begin(|r| r.effect = None), "effect"),
        (
            "empty arguments",
            with_begin(|r| r.effect = args("")),
            "arguments_json",
        ),
        (
            "invalid JSON arguments",
            with_begin(|r| r.effect = args("{\"a\":")),
            "arguments_json",
        ),
        (
            "arguments not an object",
            with_begin(|r| r.effect = args("[1,2]")),
            "arguments_json",
        ),
        (
            "idempotency key not a string",
            with_begin(|r| r.effect = args(r#"{"idempotency_key":7}"#)),
            "arguments_json.idempotency_key",
        ),
        (
            "an integer beyond 2^53 - 1 in the arguments",
            with_begin(|r| r.effect = args(r#"{"channel_id":1234567890123456789}"#)),
            "arguments_json.channel_id",
        ),
        (
            "an integer beyond 64 bits, nested",
            with_begin(|r| {
                r.effect = args(r#"{"items":[{"sku":"a","id":123456789012345678901234567890}]}"#)
            }),
            "arguments_json.items[0].id",
        ),
        (
            "an attempt id unique only within a session",
            with_begin(|r| r.attempt_id = "1".into()),
            "attempt_id",
        ),
        (
            "short fingerprint",
            with_begin(|r| r.effect = Some(Effect::Fingerprint("abc".into()))),
            "fingerprint",
        ),
        (
            "uppercase fingerprint",
            with_begin(|r| r.effect = Some(Effect::Fingerprint("A".repeat(64)))),
            "fingerprint",
        ),
        (
            "empty volatile field",
            with_begin(|r| r.volatile_fields = vec!["ok".into(), String::new()]),
            "volatile_fields[1]",
        ),
        (
            "empty attempt id",
            with_begin(|r| r.attempt_id.clear()),
            "attempt_id",
        ),
        (
            "long attempt id",
            with_begin(|r| r.attempt_id = long(129)),
            "attempt_id",
        ),
        (
            "client name with control character",
            with_begin(|r| r.context.as_mut().unwrap().client_name = "a\nb".into()),
            "context.client_name",
        ),
        (
            "long session id",
            with_begin(|r| r.context.as_mut().unwrap().session_id = long(257)),
            "context.session_id",
        ),
        (
            "lease below the minimum",
            with_begin(|r| r.lease_ttl = Some(ms(0))),
            "lease_ttl",
        ),
        (
            "lease above the maximum",
            with_begin(|r| r.lease_ttl = Some(ms(2 * 3_600_000))),
            "lease_ttl",
        ),
        (
            "malformed lease",
            with_begin(|r| {
                r.lease_ttl = Some(prost_types::Duration {
                    seconds: 1,
                    nanos: -5,
                })
            }),
            "lease_ttl",
        ),
        (
            "negative wait",
            with_begin(|r| {
                r.wait = Some(prost_types::Duration {
                    seconds: -1,
                    nanos: 0,
                })
            }),
            "wait",
        ),
        (
            "wait above the maximum",
            with_begin(|r| r.wait = Some(ms(61_000))),
            "wait",
        ),
        (
            "retention above 30 days",
            with_begin(|r| r.retention = Some(ms(31 * 86_400_000))),
            "retention",
        ),
        (
            "provider with control character",
            with_begin(|r| r.provider = "s\u{1b}[31m".into()),
            "provider",
        ),
        (
            "lookup hints not JSON",
            with_begin(|r| r.lookup_hints_json = "{nope".into()),
            "lookup_hints_json",
        ),
        (
            "lookup hints not an object",
            with_begin(|r| r.lookup_hints_json = "\"pi_1\"".into()),
            "lookup_hints_json",
        ),
        (
            "lookup hints over 4 KiB",
            with_begin(|r| r.lookup_hints_json = format!("{{\"a\":\"{}\"}}", long(4096))),
            "lookup_hints_json",
        ),
        (
            "confirm without operation id",
            with_confirm(token, |r| r.operation_id.clear()),
            "operation_id",
        ),
        (
            "confirm with token zero",
            with_confirm(token, |r| r.fencing_token = 0),
            "fencing_token",
        ),
        (
            "result over the limit",
            with_confirm(token, |r| r.result = vec![b'x'; 64 * 1024 + 1]),
            "result",
        ),
        (
            "provider ref with control character",
            with_confirm(token, |r| r.provider_ref = "re\t1".into()),
            "provider_ref",
        ),
        (
            "absent reason over 1 KiB",
            Call::Absent(pb::ReportAbsentRequest {
                operation_id: ID.into(),
                fencing_token: token,
                reason: long(1025),
            }),
            "reason",
        ),
        (
            "unknown reason with control character",
            Call::Unknown(pb::ReportUnknownRequest {
                operation_id: ID.into(),
                fencing_token: token,
                reason: "reset\u{0}".into(),
            }),
            "reason",
        ),
        (
            "unknown with long operation id",
            Call::Unknown(pb::ReportUnknownRequest {
                operation_id: long(300),
                fencing_token: token,
                reason: String::new(),
            }),
            "operation_id",
        ),
        (
            "heartbeat with token zero",
            Call::Heartbeat(pb::HeartbeatRequest {
                operation_id: ID.into(),
                fencing_token: 0,
                lease_ttl: None,
            }),
            "fencing_token",
        ),
        (
            "heartbeat lease above the maximum",
            Call::Heartbeat(pb::HeartbeatRequest {
                operation_id: ID.into(),
                fencing_token: token,
                lease_ttl: Some(ms(5 * 3_600_000)),
            }),
            "lease_ttl",
        ),
        (
            "get without operation id",
            Call::Get(pb::GetOperationRequest {
                operation_id: String::new(),
                ..Default::default()
            }),
            "operation_id",
        ),
        (
            "list with unspecified state",
            Call::List(pb::ListOperationsRequest {
                states: vec![4, 0],
                ..Default::default()
            }),
            "states[1]",
        ),
        (
            "list with unknown enum value",
            Call::List(pb::ListOperationsRequest {
                states: vec![99],
                ..Default::default()
            }),
            "states[0]",
        ),
        (
            "list naming more states than there are",
            Call::List(pb::ListOperationsRequest {
                states: vec![1, 2, 3, 4, 1],
                ..Default::default()
            }),
            "states",
        ),
        (
            "list naming a state twice",
            Call::List(pb::ListOperationsRequest {
                states: vec![4, 4],
                ..Default::default()
            }),
            "states[1]",
        ),
        (
            "list page too large",
            Call::List(pb::ListOperationsRequest {
                page_size: 5000,
                ..Default::default()
            }),
            "page_size",
        ),
        (
            "list with a forged page token",
            Call::List(pb::ListOperationsRequest {
                page_token: "not-a-token".into(),
                ..Default::default()
            }),
            "page_token",
        ),
        (
            "list tool with control character",
            Call::List(pb::ListOperationsRequest {
                tool: "a\rb".into(),
                ..Default::default()
            }),
            "tool",
        ),
        (
            "resolve naming no attempt examined",
            with_resolve(|_| {}),
            "fencing_token",
        ),
        (
            "resolve with unspecified outcome",
            with_resolve(|r| r.outcome = 0),
            "outcome",
        ),
        (
            "resolve to IN_FLIGHT",
            with_resolve(|r| r.outcome = pb::OperationState::InFlight as i32),
            "outcome",
        ),
        (
            "resolve with unknown enum value",
            with_resolve(|r| r.outcome = 42),
            "outcome",
        ),
        (
            "resolve without reason",
            with_resolve(|r| r.reason = "   ".into()),
            "reason",
        ),
        (
            "resolve reason over 1 KiB",
            with_resolve(|r| r.reason = long(1025)),
            "reason",
        ),
        (
            "resolve without operator",
            with_resolve(|r| r.operator.clear()),
            "operator",
        ),
        (
            "resolve without resolution id",
            with_resolve(|r| r.resolution_id.clear()),
            "resolution_id",
        ),
        (
            "resolve ABSENT with a result",
            with_resolve(|r| r.result = b"x".to_vec()),
            "result",
        ),
        (
            "resolve CONFIRMED with a result over the limit",
            with_resolve(|r| {
                r.outcome = pb::OperationState::Confirmed as i32;
                r.result = vec![0; 64 * 1024 + 1];
            }),
            "result",
        ),
    ]
}

#[test]
fn malformed_requests_are_refused_naming_the_field() {
    let mut failures = Vec::new();
    for (name, call, expected_field) in cases(1 << 20) {
        match convert(call) {
            Ok(()) => failures.push(format!("{name}: accepted")),
            Err(invalid) => {
                if invalid.field != expected_field {
                    failures.push(format!(
                        "{name}: expected field {expected_field}, got {}: {invalid}",
                        invalid.field
                    ));
                }
                if !invalid.to_string().starts_with(expected_field) {
                    failures.push(format!(
                        "{name}: message does not name the field: {invalid}"
                    ));
                }
                if name == "result over the limit" && invalid.code != "RESULT_TOO_LARGE" {
                    failures.push(format!("{name}: reason {}", invalid.code));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_valid_requests_the_cases_start_from_are_accepted() {
    for call in [
        Call::Begin(Box::new(valid_begin())),
        with_confirm(1 << 20, |_| {}),
        with_resolve(|r| r.fencing_token = 1 << 20),
    ] {
        convert(call).expect("a well-formed request");
    }
}
