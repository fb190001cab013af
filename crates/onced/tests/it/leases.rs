//! Lease expiry, late and stale reports, heartbeats and the DOUBLE_EXECUTION anomaly.

use once_api::pb;

use crate::support::*;

on_both_backends!(
    sweeper_turns_an_expired_lease_unknown_and_a_late_confirm_settles_it,
    stale_token_is_refused_and_changes_nothing,
    superseded_attempt_confirming_while_a_later_attempt_runs_is_held_for_an_operator,
    late_confirm_after_an_absent_resolution_contradicts_it,
    heartbeat_keeps_a_long_effect_alive,
);

async fn sweeper_turns_an_expired_lease_unknown_and_a_late_confirm_settles_it(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let mut request = begin("lease-1", ARGS);
    request.lease_ttl = Some(ms(150));
    let grant = claim(&mut client, request).await;
    // Nobody calls Begin: the sweeper alone moves it.
    wait_for_state(&client, "lease-1", pb::OperationState::Unknown).await;
    let history = get(&mut client, "lease-1").await;
    let expired = history.events.last().unwrap();
    assert_eq!(
        (expired.kind.as_str(), expired.actor.as_str()),
        ("LEASE_EXPIRED", "ledger")
    );
    assert_eq!(expired.attempt, 1);

    let state = confirm(
        &mut client,
        "lease-1",
        grant.fencing_token,
        b"late but genuine",
    )
    .await
    .unwrap();
    assert_eq!(state, pb::OperationState::Confirmed as i32);
    let replay = client
        .begin(begin("lease-1", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_replay(&replay).result, b"late but genuine");
    ledger.stop().await;
}

async fn stale_token_is_refused_and_changes_nothing(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let mut request = begin("lease-2", ARGS);
    request.lease_ttl = Some(ms(150));
    let grant = claim(&mut client, request).await;
    wait_for_state(&client, "lease-2", pb::OperationState::Unknown).await;
    let before = (get(&mut client, "lease-2").await, db.snapshot().await);

    for token in [grant.fencing_token + 1, 1000] {
        let refused = confirm(&mut client, "lease-2", token, b"forged")
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
        assert!(
            refused.message().contains("no execution right"),
            "{}",
            refused.message()
        );
    }
    assert_eq!(
        (get(&mut client, "lease-2").await, db.snapshot().await),
        before
    );
    ledger.stop().await;
}

async fn superseded_attempt_confirming_while_a_later_attempt_runs_is_held_for_an_operator(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let mut request = begin("lease-3", ARGS);
    request.lease_ttl = Some(ms(150));
    let first = claim(&mut client, request).await;
    wait_for_state(&client, "lease-3", pb::OperationState::Unknown).await;
    resolve(&mut client, "lease-3", pb::OperationState::Absent, "res-3")
        .await
        .unwrap();
    let second = claim(&mut client, begin("lease-3", ARGS)).await;
    assert_eq!(second.attempt, 2);

    // Attempt 1 did perform the effect after all; attempt 2 may have too.
    for _ in 0..2 {
        let refused = confirm(&mut client, "lease-3", first.fencing_token, b"one")
            .await
            .unwrap_err();
        assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
    }
    let history = get(&mut client, "lease-3").await;
    let anomalies: Vec<&pb::Event> = history
        .events
        .iter()
        .filter(|e| e.kind == "DOUBLE_EXECUTION")
        .collect();
    assert_eq!(
        anomalies.len(),
        1,
        "recorded once however often it is reported: {:?}",
        history.events
    );
    assert_eq!(anomalies[0].attempt, 1);
    assert!(
        anomalies[0].reason.contains("attempt 1"),
        "{:?}",
        anomalies[0]
    );
    let op = history.operation.unwrap();
    assert_eq!(
        (op.state, op.attempt, op.source.as_str()),
        (pb::OperationState::Unknown as i32, 2, "anomaly"),
        "both attempts may have performed the effect: held for an operator"
    );
    // Attempt 2 lost its lease; nobody executes again; no reconciler settles it.
    let heartbeat = client
        .heartbeat(pb::HeartbeatRequest {
            operation_id: "lease-3".into(),
            fencing_token: second.fencing_token,
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&heartbeat), "LEASE_EXPIRED");
    let again = client
        .begin(begin("lease-3", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&again), "UNKNOWN");
    let refused = client
        .reconcile(pb::ReconcileRequest {
            operation_id: "lease-3".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "HELD_FOR_OPERATOR");
    // An attempt proved the effect: an operator may not call it ABSENT.
    let refused = resolve(&mut client, "lease-3", pb::OperationState::Absent, "res-4")
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "EFFECT_PROVEN");
    resolve(
        &mut client,
        "lease-3",
        pb::OperationState::Confirmed,
        "res-5",
    )
    .await
    .unwrap();
    ledger.stop().await;
}

async fn late_confirm_after_an_absent_resolution_contradicts_it(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("lease-4", ARGS)).await;
    report_unknown(&mut client, "lease-4", grant.fencing_token)
        .await
        .unwrap();
    resolve(&mut client, "lease-4", pb::OperationState::Absent, "res-4")
        .await
        .unwrap();
    // No new attempt ran yet: the effect happened once, and the ledger now knows it.
    let state = confirm(
        &mut client,
        "lease-4",
        grant.fencing_token,
        b"it did happen",
    )
    .await
    .unwrap();
    assert_eq!(state, pb::OperationState::Confirmed as i32);
    let history = get(&mut client, "lease-4").await;
    assert!(history
        .events
        .iter()
        .any(|e| e.kind == "RESOLUTION_CONTRADICTED"));
    let replay = client
        .begin(begin("lease-4", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_replay(&replay).result, b"it did happen");
    ledger.stop().await;
}

async fn heartbeat_keeps_a_long_effect_alive(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let mut request = begin("lease-5", ARGS);
    request.lease_ttl = Some(ms(300));
    let grant = claim(&mut client, request).await;
    let mut deadline = once_api::convert::millis(grant.lease_deadline.as_ref().unwrap());
    let original = deadline;
    // Heartbeat until the lease has been extended past three original TTLs.
    while deadline < original + 900 {
        let extended = client
            .heartbeat(pb::HeartbeatRequest {
                operation_id: "lease-5".into(),
                fencing_token: grant.fencing_token,
                lease_ttl: Some(ms(300)),
            })
            .await
            .expect("heartbeat on a live lease")
            .into_inner();
        let next = once_api::convert::millis(extended.lease_deadline.as_ref().unwrap());
        assert!(next >= deadline, "a heartbeat never shortens the lease");
        deadline = next;
        assert_eq!(
            state_of(&mut client, "lease-5").await,
            pb::OperationState::InFlight
        );
        // The next heartbeat a tenth of a second later, by the clock leases are measured on.
        let next_beat = db.clock().await + 100;
        eventually(
            std::time::Duration::from_secs(10),
            "the next heartbeat's time",
            || async { (db.clock().await >= next_beat).then_some(()) },
        )
        .await;
    }
    confirm(&mut client, "lease-5", grant.fencing_token, b"done")
        .await
        .unwrap();
    ledger.stop().await;
}
