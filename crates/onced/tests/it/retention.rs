//! Retention: settled operations start a new life after it; others are never swept.

use std::time::Duration;

use once_api::pb;

use crate::support::*;

on_both_backends!(
    confirmed_past_retention_executes_again,
    sweeper_deletes_settled_operations_in_batches_and_keeps_the_rest,
    caller_may_ask_for_longer_retention,
    a_life_that_ended_absent_hands_its_provider_key_to_the_next,
    a_report_for_an_earlier_life_is_recorded_in_it,
);

async fn confirmed_past_retention_executes_again(store: Engine) {
    let db = TestDb::new(store).await;
    // The sweeper is kept out of the way: Begin alone must see that retention has passed.
    let ledger = TestLedger::spawn_with_short_retention(&db, "1h").await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("ret-1", ARGS)).await;
    confirm(&mut client, "ret-1", first.fencing_token, b"old")
        .await
        .unwrap();
    let again = eventually(Duration::from_secs(5), "retention to pass", || {
        let mut client = client.clone();
        async move {
            let response = client
                .begin(begin("ret-1", ARGS))
                .await
                .unwrap()
                .into_inner();
            (decision_name(&response) == "EXECUTE").then(|| expect_execute(&response))
        }
    })
    .await;
    assert_eq!(again.attempt, 1, "a new life counts its attempts from 1");
    assert!(
        again.fencing_token > first.fencing_token,
        "fencing tokens keep growing across lives"
    );
    assert_ne!(
        again.provider_key, first.provider_key,
        "a new life gets a new provider key"
    );

    // ABSENT past retention, with different arguments this time: a new life, not a conflict.
    let grant = claim(&mut client, begin("ret-2", ARGS)).await;
    report_absent(&mut client, "ret-2", grant.fencing_token)
        .await
        .unwrap();
    eventually(Duration::from_secs(5), "retention to pass", || {
        let mut client = client.clone();
        async move {
            let response = client
                .begin(begin("ret-2", r#"{"different":1}"#))
                .await
                .unwrap()
                .into_inner();
            (decision_name(&response) == "EXECUTE").then_some(())
        }
    })
    .await;
    ledger.stop().await;
}

async fn sweeper_deletes_settled_operations_in_batches_and_keeps_the_rest(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with(
        &db,
        &[
            "--retention-explicit",
            "1ms",
            "--retention-sweep-interval",
            "50ms",
            "--event-retention",
            "1h",
            "--provider-key-window",
            "1ms",
        ],
    )
    .await;
    let mut client = ledger.client().await;

    for i in 0..30 {
        let id = format!("ret-bulk-{i}");
        let grant = claim(&mut client, begin(&id, ARGS)).await;
        if i % 2 == 0 {
            confirm(&mut client, &id, grant.fencing_token, b"ok")
                .await
                .unwrap();
        } else {
            report_absent(&mut client, &id, grant.fencing_token)
                .await
                .unwrap();
        }
    }
    let mut long_lease = begin("ret-in-flight", ARGS);
    long_lease.lease_ttl = Some(ms(3_600_000));
    claim(&mut client, long_lease).await;
    let grant = claim(&mut client, begin("ret-unknown", ARGS)).await;
    report_unknown(&mut client, "ret-unknown", grant.fencing_token)
        .await
        .unwrap();

    eventually(
        Duration::from_secs(10),
        "settled operations swept",
        || async { (db.scalar("SELECT count(*) FROM operations").await == 2).then_some(()) },
    )
    .await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM attempts").await,
        2,
        "attempts go with their operation"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM events").await,
        63,
        "events are kept for their own retention"
    );
    assert_eq!(
        state_of(&mut client, "ret-in-flight").await,
        pb::OperationState::InFlight
    );
    assert_eq!(
        state_of(&mut client, "ret-unknown").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

async fn caller_may_ask_for_longer_retention(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with_short_retention(&db, "50ms").await;
    let mut client = ledger.client().await;

    let mut kept = begin("ret-kept", ARGS);
    kept.retention = Some(ms(3_600_000));
    let grant = claim(&mut client, kept).await;
    confirm(&mut client, "ret-kept", grant.fencing_token, b"kept")
        .await
        .unwrap();
    let grant = claim(&mut client, begin("ret-short", ARGS)).await;
    confirm(&mut client, "ret-short", grant.fencing_token, b"short")
        .await
        .unwrap();
    wait_deleted(&db, "ret-short").await;
    let replay = client
        .begin(begin("ret-kept", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_replay(&replay).result, b"kept");
    ledger.stop().await;
}

/// An operation that ended ABSENT outlives its retention as a tombstone (the provider key
/// window, 24 hours by default), and its next life takes over its provider key: an attempt of
/// the old life that stalled and refunds late is deduplicated by the provider, so the refund
/// happens once.
async fn a_life_that_ended_absent_hands_its_provider_key_to_the_next(store: Engine) {
    let db = TestDb::new(store).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let ledger = spawn_keeping_tombstones(&db).await;
    let mut client = ledger.client().await;
    // An attempt that stalls before it refunds; its life ends ABSENT meanwhile.
    let stalled = claim(&mut client, begin("tomb-1", ARGS)).await;
    report_absent(&mut client, "tomb-1", stalled.fencing_token)
        .await
        .unwrap();
    past_retention(&db, &mut client).await;
    assert_eq!(rows(&db, "tomb-1").await, 1, "the ABSENT operation is kept");

    let next = claim(&mut client, begin("tomb-1", ARGS)).await;
    assert_eq!(next.attempt, 1, "a new life");
    assert!(next.fencing_token > stalled.fencing_token);
    assert_eq!(next.provider_key, stalled.provider_key);
    // Both refund under the key they were given: the provider makes one refund.
    for key in [&next.provider_key, &stalled.provider_key] {
        refund(&provider, key).await;
    }
    let stats = fakepay_stats(&provider).await;
    assert_eq!(stats["refunds"], 1, "{stats}");
    confirm(&mut client, "tomb-1", next.fencing_token, b"{}")
        .await
        .unwrap();
    ledger.stop().await;
}

/// A ledger whose explicit retention is 50 ms, swept every 50 ms, with events kept an hour.
async fn spawn_keeping_tombstones(db: &TestDb) -> TestLedger {
    TestLedger::spawn_with(
        db,
        &[
            "--retention-explicit",
            "50ms",
            "--retention-sweep-interval",
            "50ms",
            "--event-retention",
            "1h",
        ],
    )
    .await
}

async fn rows(db: &TestDb, id: &str) -> i64 {
    db.scalar(&format!(
        "SELECT count(*) FROM operations WHERE operation_id = '{id}'"
    ))
    .await
}

/// Returns once what settled before the call is past its retention: a canary settled now,
/// with the same retention, has been deleted by the sweeper.
async fn past_retention(
    db: &TestDb,
    client: &mut once_api::pb::ledger_client::LedgerClient<tonic::transport::Channel>,
) {
    let canary = claim(client, begin("tomb-canary", ARGS)).await;
    confirm(client, "tomb-canary", canary.fencing_token, b"{}")
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "the sweeper to pass the retention",
        || async { (rows(db, "tomb-canary").await == 0).then_some(()) },
    )
    .await;
}

/// A refund through fakepay under `key`; its refund id.
async fn refund(provider: &str, key: &str) -> String {
    let refunded: serde_json::Value = reqwest::Client::new()
        .post(format!("{provider}/v1/refunds"))
        .header("Idempotency-Key", key)
        .form(&[
            ("payment_intent", "pi_late"),
            ("amount", "500"),
            ("currency", "eur"),
        ])
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    refunded["id"].as_str().unwrap().to_owned()
}

/// An attempt stalls, its life is resolved ABSENT by an operator, and past retention the next
/// life takes over its key and refunds. The stalled attempt then refunds too (fakepay makes
/// one refund of the two, by the key) and confirms: it is refused, and what its confirm proves
/// is recorded in the life it belongs to — a contradicted ABSENT when it names this life's
/// refund, a double execution when it names another — and shown in this life's history. What
/// it says before that, that it cannot tell, is recorded in its life too, once.
async fn a_report_for_an_earlier_life_is_recorded_in_it(store: Engine) {
    let db = TestDb::new(store).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let ledger = spawn_keeping_tombstones(&db).await;
    let mut client = ledger.client().await;
    let ids = ["late-same", "late-other"];
    let mut stalled = Vec::new();
    for id in ids {
        let attempt = claim(&mut client, begin(id, ARGS)).await;
        report_unknown(&mut client, id, attempt.fencing_token)
            .await
            .unwrap();
        resolve(
            &mut client,
            id,
            pb::OperationState::Absent,
            &new_attempt_id(),
        )
        .await
        .unwrap();
        stalled.push(attempt);
    }
    past_retention(&db, &mut client).await;
    for (id, stalled) in ids.into_iter().zip(&stalled) {
        let next = claim(&mut client, begin(id, ARGS)).await;
        assert_eq!(next.provider_key, stalled.provider_key);
        for _ in 0..2 {
            let refused = report_unknown(&mut client, id, stalled.fencing_token)
                .await
                .unwrap_err();
            assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
        }
        let refund_id = refund(&provider, &next.provider_key).await;
        confirm_with(&mut client, id, next.fencing_token, b"{}", &refund_id)
            .await
            .unwrap();
        // The stalled attempt lands: the provider answers it with the same refund.
        let late = refund(&provider, &stalled.provider_key).await;
        assert_eq!(late, refund_id);
        let named = if id == "late-same" {
            late
        } else {
            "re_elsewhere".into()
        };
        let refused = confirm_with(&mut client, id, stalled.fencing_token, b"{}", &named)
            .await
            .unwrap_err();
        assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
        // A retry records nothing twice.
        confirm_with(&mut client, id, stalled.fencing_token, b"{}", &named)
            .await
            .unwrap_err();
        let history = get(&mut client, id).await;
        assert_eq!(
            history.operation.unwrap().state,
            pb::OperationState::Confirmed as i32
        );
        let expected = if id == "late-same" {
            "RESOLUTION_CONTRADICTED"
        } else {
            "DOUBLE_EXECUTION"
        };
        let kinds: Vec<&str> = history.events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(
            kinds,
            ["CLAIMED", "REPORTED_UNKNOWN", "CONFIRMED", expected],
            "{id}"
        );
        let said = &history.events[1];
        assert!(said.reason.contains("cannot tell"), "{id}: {said:?}");
        assert_eq!(
            db.scalar(&format!(
                "SELECT count(*) FROM events WHERE operation_id = '{id}' \
                 AND kind = 'REPORTED_UNKNOWN' AND life = {} AND from_state IS NULL",
                stalled.fencing_token
            ))
            .await,
            1,
            "{id}: the late report recorded once, in the earlier life"
        );
        let anomaly = history.events.last().unwrap();
        let details: serde_json::Value = serde_json::from_str(&anomaly.details_json).unwrap();
        assert_eq!(details["life"], stalled.fencing_token, "{id}: {details}");
        assert_eq!(
            details["current_life"], next.fencing_token,
            "{id}: {details}"
        );
        assert_eq!(
            db.scalar(&format!(
                "SELECT count(*) FROM events WHERE operation_id = '{id}' AND kind = '{expected}' \
                 AND life = {}",
                stalled.fencing_token
            ))
            .await,
            1,
            "{id}: recorded once, in the earlier life"
        );
    }
    let stats = fakepay_stats(&provider).await;
    assert_eq!(stats["refunds"], 2, "one refund per operation: {stats}");
    ledger.stop().await;
}
