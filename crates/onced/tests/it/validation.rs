//! A malformed request is refused with INVALID_ARGUMENT naming the field, and changes nothing.
//! Which requests are malformed is decided by `once-api` before anything touches storage, and
//! tested there case by case (`convert_tests.rs`); here one malformed request of each RPC goes
//! through the service.

use once_api::pb;

use crate::support::*;

on_both_backends!(malformed_requests_are_refused_naming_the_field);

const ID: &str = "valid-op";

async fn malformed_requests_are_refused_naming_the_field(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // One live operation, so reports have something they could wrongly change.
    let token = claim(&mut client, begin(ID, ARGS)).await.fencing_token;
    let before = (get(&mut client, ID).await, db.snapshot().await);

    let mut nameless = begin("new-op", ARGS);
    nameless.tool.clear();
    let answers = [
        ("tool", client.begin(nameless).await.map(drop)),
        (
            "result",
            client
                .confirm(pb::ConfirmRequest {
                    operation_id: ID.into(),
                    fencing_token: token,
                    result: vec![b'x'; 64 * 1024 + 1],
                    provider_ref: "re_1".into(),
                })
                .await
                .map(drop),
        ),
        (
            "operation_id",
            client
                .report_absent(pb::ReportAbsentRequest {
                    fencing_token: token,
                    reason: "refused".into(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "fencing_token",
            client
                .report_unknown(pb::ReportUnknownRequest {
                    operation_id: ID.into(),
                    reason: "timeout".into(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "fencing_token",
            client
                .heartbeat(pb::HeartbeatRequest {
                    operation_id: ID.into(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "operation_id",
            client
                .get_operation(pb::GetOperationRequest::default())
                .await
                .map(drop),
        ),
        (
            "page_size",
            client
                .list_operations(pb::ListOperationsRequest {
                    page_size: 5000,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "operator",
            client
                .resolve(pb::ResolveRequest {
                    operation_id: ID.into(),
                    outcome: pb::OperationState::Absent as i32,
                    reason: "checked".into(),
                    resolution_id: "r-1".into(),
                    fencing_token: token,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
    ];

    for (expected_field, answer) in answers {
        let status = answer.expect_err(expected_field);
        assert_eq!(
            (status.code(), field(&status)),
            (tonic::Code::InvalidArgument, expected_field.to_owned()),
            "{}",
            status.message()
        );
        assert!(status.message().starts_with(expected_field), "{status:?}");
        if expected_field == "result" {
            assert_eq!(reason(&status), "RESULT_TOO_LARGE");
        }
    }
    assert_eq!(
        (get(&mut client, ID).await, db.snapshot().await),
        before,
        "refused requests change nothing"
    );
    ledger.stop().await;
}
