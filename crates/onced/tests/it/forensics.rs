//! Duplicate forensics: every Begin answered without a new execution right is recorded with
//! its transport context, and GetOperation and GetForensics say where each repeated call came
//! from.

use std::time::Duration;

use once_api::pb;

use crate::support::*;

on_both_backends!(
    each_repeated_call_is_recorded_and_its_origin_told,
    an_operation_replayed_without_end_explains_its_latest_calls,
);

/// A Begin of `id` with these arguments and this transport context.
fn call(id: &str, client: &str, session: &str, request: &str) -> pb::BeginRequest {
    let mut request_ = begin_exact(id, ARGS);
    request_.context = Some(pb::AttemptContext {
        client_name: client.into(),
        session_id: session.into(),
        request_id: request.into(),
    });
    request_
}

async fn calls(client: &mut Grpc, id: &str, count: usize) -> pb::GetOperationResponse {
    let client = client.clone();
    eventually(
        Duration::from_secs(10),
        "the duplicates to be recorded",
        || {
            let mut client = client.clone();
            async move {
                let found = get(&mut client, id).await;
                (found.calls.len() >= count).then_some(found)
            }
        },
    )
    .await
}

async fn each_repeated_call_is_recorded_and_its_origin_told(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let first = call("refund:o-1", "claude", "s-1", "7");
    let grant = claim(&mut client, first.clone()).await;
    // The client library sent its Begin again: the same grant.
    let again = client.begin(first.clone()).await.unwrap().into_inner();
    assert!(expect_execute(&again).regranted);
    // The harness retried at once in the same session.
    let retried = client
        .begin(call("refund:o-1", "claude", "s-1", "8"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&retried), "IN_PROGRESS");
    report_unknown(&mut client, "refund:o-1", grant.fencing_token)
        .await
        .unwrap();
    // The client reconnected and replayed its queued call; another client asked too.
    client
        .begin(call("refund:o-1", "claude", "s-2", "1"))
        .await
        .unwrap();
    client
        .begin(call("refund:o-1", "cursor", "c-1", "1"))
        .await
        .unwrap();
    // The model minted a new key for the same refund: the fresh-id guard answered for o-1.
    let reissued = client
        .begin(call("refund:x:new-key", "claude", "s-2", "2"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        expect_unknown(&reissued).blocking_operation_id,
        "refund:o-1"
    );

    let found = calls(&mut client, "refund:o-1", 6).await;
    let told: Vec<(&str, u32, &str, &str)> = found
        .calls
        .iter()
        .map(|c| {
            (
                c.decision.as_str(),
                c.attempt,
                c.origin.as_str(),
                c.requested_operation_id.as_str(),
            )
        })
        .collect();
    assert_eq!(
        told,
        [
            ("EXECUTE", 1, "", ""),
            ("EXECUTE", 0, "transport_retry", ""),
            ("IN_PROGRESS", 0, "harness_retry", ""),
            ("UNKNOWN", 0, "reconnect", ""),
            ("UNKNOWN", 0, "other_client", ""),
            ("UNKNOWN", 0, "model_reissue", "refund:x:new-key"),
        ]
    );
    assert_eq!(
        found.forensics,
        "1 execution, 5 duplicates prevented: 1 transport retry, 1 harness retry, \
         1 model re-issue, 1 reconnect, 1 call from another client"
    );
    let context = found.calls[3].context.clone().unwrap();
    assert_eq!(
        (context.session_id.as_str(), context.request_id.as_str()),
        ("s-2", "1")
    );

    // Over a window, for the tenant.
    let window = client
        .get_forensics(pb::GetForensicsRequest {
            tool: "issue_refund".into(),
            since: Some(ms(3_600_000)),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (window.operations, window.executions, window.prevented),
        (1, 1, 5)
    );
    let origins: Vec<(&str, u32)> = window
        .origins
        .iter()
        .map(|o| (o.origin.as_str(), o.count))
        .collect();
    assert_eq!(
        origins,
        [
            ("transport_retry", 1),
            ("harness_retry", 1),
            ("model_reissue", 1),
            ("reconnect", 1),
            ("other_client", 1),
        ]
    );
    let other_tool = client
        .get_forensics(pb::GetForensicsRequest {
            tool: "send_email".into(),
            since: None,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((other_tool.operations, other_tool.prevented), (0, 0));
    ledger.stop().await;
}

async fn an_operation_replayed_without_end_explains_its_latest_calls(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let grant = claim(&mut client, call("refund:o-2", "claude", "s-1", "1")).await;
    confirm(&mut client, "refund:o-2", grant.fencing_token, b"{}")
        .await
        .unwrap();
    let replays = once_store::EXPLAINED_DUPLICATES as usize + 30;
    for n in 0..replays {
        let replay = client
            .begin(call("refund:o-2", "claude", "s-1", &format!("r-{n}")))
            .await
            .unwrap()
            .into_inner();
        expect_replay(&replay);
    }
    let recorded = "SELECT count(*) FROM duplicates WHERE operation_id = 'refund:o-2'";
    eventually(
        Duration::from_secs(10),
        "every replay to be recorded",
        || async { (db.scalar(recorded).await == replays as i64).then_some(()) },
    )
    .await;
    let found = get(&mut client, "refund:o-2").await;
    // The attempt and the latest duplicates, the last of them the latest replay.
    assert_eq!(
        found.calls.len(),
        once_store::EXPLAINED_DUPLICATES as usize + 1
    );
    assert_eq!(found.calls[0].decision, "EXECUTE");
    let last = found.calls.last().unwrap().context.clone().unwrap();
    assert_eq!(last.request_id, format!("r-{}", replays - 1));
    ledger.stop().await;
}
