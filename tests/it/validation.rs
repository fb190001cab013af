//! A malformed request is refused with INVALID_ARGUMENT naming the field, and changes nothing.
//! Which requests are malformed is decided by `once-api` before anything touches storage, and
//! tested there case by case; here one request of each RPC goes through the service.

use once_api::pb;
use once_api::pb::ledger_client::LedgerClient;
use tonic::transport::Channel;

use crate::support::*;

on_both_backends!(malformed_requests_are_refused_naming_the_field);

/// One call of the API.
enum Call {
    Begin(pb::BeginRequest),
    Confirm(pb::ConfirmRequest),
    Absent(pb::ReportAbsentRequest),
    Unknown(pb::ReportUnknownRequest),
    Heartbeat(pb::HeartbeatRequest),
    Get(pb::GetOperationRequest),
    List(pb::ListOperationsRequest),
    Resolve(pb::ResolveRequest),
}

async fn send(client: &mut LedgerClient<Channel>, call: Call) -> Result<(), tonic::Status> {
    match call {
        Call::Begin(r) => client.begin(r).await.map(drop),
        Call::Confirm(r) => client.confirm(r).await.map(drop),
        Call::Absent(r) => client.report_absent(r).await.map(drop),
        Call::Unknown(r) => client.report_unknown(r).await.map(drop),
        Call::Heartbeat(r) => client.heartbeat(r).await.map(drop),
        Call::Get(r) => client.get_operation(r).await.map(drop),
        Call::List(r) => client.list_operations(r).await.map(drop),
        Call::Resolve(r) => client.resolve(r).await.map(drop),
    }
}

const ID: &str = "valid-op";

fn with_begin(change: impl FnOnce(&mut pb::BeginRequest)) -> Call {
    let mut request = begin("new-op", ARGS);
    change(&mut request);
    Call::Begin(request)
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

/// One malformed request of each kind the service receives: the whole table of what is
/// malformed is `once-api`'s (`convert_tests.rs`); this shows the service answers each refusal
/// as INVALID_ARGUMENT naming the field, and changes nothing.
fn cases(token: u64) -> Vec<(&'static str, Call, &'static str)> {
    vec![
        ("empty tool", with_begin(|r| r.tool.clear()), "tool"),
        (
            "result over the limit",
            with_confirm(token, |r| r.result = vec![b'x'; 64 * 1024 + 1]),
            "result",
        ),
        (
            "absent without operation id",
            Call::Absent(pb::ReportAbsentRequest {
                fencing_token: token,
                reason: "refused".into(),
                ..Default::default()
            }),
            "operation_id",
        ),
        (
            "unknown without fencing token",
            Call::Unknown(pb::ReportUnknownRequest {
                operation_id: ID.into(),
                reason: "timeout".into(),
                ..Default::default()
            }),
            "fencing_token",
        ),
        (
            "heartbeat without fencing token",
            Call::Heartbeat(pb::HeartbeatRequest {
                operation_id: ID.into(),
                ..Default::default()
            }),
            "fencing_token",
        ),
        (
            "get without operation id",
            Call::Get(pb::GetOperationRequest {
                operation_id: String::new(),
            }),
            "operation_id",
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
            "resolve without operator",
            with_resolve(|r| r.operator.clear()),
            "operator",
        ),
    ]
}

async fn malformed_requests_are_refused_naming_the_field(store: Store) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // One live operation, so reports have something they could wrongly change.
    let grant = claim(&mut client, begin(ID, ARGS)).await;
    let before = (get(&mut client, ID).await, db.snapshot().await);

    let mut failures = Vec::new();
    for (name, call, expected_field) in cases(grant.fencing_token) {
        match send(&mut client, call).await {
            Ok(()) => failures.push(format!("{name}: accepted")),
            Err(status) => {
                let got = (status.code(), field(&status));
                if got != (tonic::Code::InvalidArgument, expected_field.to_owned()) {
                    failures.push(format!(
                        "{name}: expected field {expected_field}, got {got:?}: {}",
                        status.message()
                    ));
                }
                if !status.message().starts_with(expected_field) {
                    failures.push(format!(
                        "{name}: message does not name the field: {}",
                        status.message()
                    ));
                }
                if name == "result over the limit" && reason(&status) != "RESULT_TOO_LARGE" {
                    failures.push(format!("{name}: reason {}", reason(&status)));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(
        (get(&mut client, ID).await, db.snapshot().await),
        before,
        "refused requests change nothing"
    );
    ledger.stop().await;
}
