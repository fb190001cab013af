//! One test per invariant of SPEC §5, named after it.

use once_api::pb;

use crate::support::*;

on_both_backends!(
    invariant_1_at_most_one_live_lease,
    invariant_2_confirmed_never_changes,
    invariant_3_unknown_leaves_only_through_its_doors,
    invariant_4_retention_never_deletes_unknown_or_in_flight,
    invariant_5_no_execute_when_the_fingerprint_differs,
    invariant_6_every_transition_appends_one_event,
    invariant_7_a_stale_report_never_changes_state,
    invariant_8_every_rpc_is_safe_to_retry,
    invariant_9_leases_are_measured_on_the_database_clock,
);

async fn invariant_1_at_most_one_live_lease(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let client = ledger.client().await;

    for round in 0..5 {
        let id = format!("refund:race-{round}");
        let (executes, in_progress) = race(std::slice::from_ref(&client), &id, 64).await;
        assert_eq!((executes, in_progress), (1, 63), "round {round}");
    }
    assert_eq!(db.scalar("SELECT count(*) FROM attempts").await, 5);
    ledger.stop().await;
}

async fn invariant_2_confirmed_never_changes(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("inv2", ARGS)).await;
    confirm(&mut client, "inv2", grant.fencing_token, b"first")
        .await
        .unwrap();
    let before = get(&mut client, "inv2").await.operation.unwrap();

    let settled =
        |status: tonic::Status| assert_eq!(reason(&status), "ALREADY_SETTLED", "{status:?}");
    settled(
        confirm(&mut client, "inv2", grant.fencing_token, b"second")
            .await
            .unwrap_err(),
    );
    settled(
        report_absent(&mut client, "inv2", grant.fencing_token)
            .await
            .unwrap_err(),
    );
    assert_eq!(
        report_unknown(&mut client, "inv2", grant.fencing_token)
            .await
            .unwrap(),
        pb::OperationState::Confirmed as i32
    );
    let refused = resolve(&mut client, "inv2", pb::OperationState::Absent, "r-1")
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "NOT_UNKNOWN");
    let heartbeat = client
        .heartbeat(pb::HeartbeatRequest {
            operation_id: "inv2".into(),
            fencing_token: grant.fencing_token,
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&heartbeat), "LEASE_EXPIRED");
    let conflict = client
        .begin(begin("inv2", r#"{"other":true}"#))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&conflict), "CONFLICT");

    let after = get(&mut client, "inv2").await.operation.unwrap();
    assert_eq!(after, before);
    assert_eq!(after.result, b"first");
    ledger.stop().await;
}

async fn invariant_3_unknown_leaves_only_through_its_doors(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // Nothing but a door moves an UNKNOWN operation: not Begins, not the sweepers, not a
    // heartbeat, not reports from another attempt.
    let grant = claim(&mut client, begin("inv3-a", ARGS)).await;
    report_unknown(&mut client, "inv3-a", grant.fencing_token)
        .await
        .unwrap();
    for _ in 0..3 {
        let response = client
            .begin(begin("inv3-a", ARGS))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(decision_name(&response), "UNKNOWN");
    }
    let heartbeat = client
        .heartbeat(pb::HeartbeatRequest {
            operation_id: "inv3-a".into(),
            fencing_token: grant.fencing_token,
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&heartbeat), "LEASE_EXPIRED");
    assert_eq!(
        reason(&confirm(&mut client, "inv3-a", 7, b"x").await.unwrap_err()),
        "EXECUTION_RIGHT_LOST"
    );
    assert_eq!(
        state_of(&mut client, "inv3-a").await,
        pb::OperationState::Unknown
    );

    // Door 1: a late report from the attempt that held the lease.
    confirm(&mut client, "inv3-a", grant.fencing_token, b"late")
        .await
        .unwrap();
    let history = get(&mut client, "inv3-a").await;
    let last = history.events.last().unwrap();
    assert_eq!(
        (last.kind.as_str(), last.attempt),
        ("CONFIRMED", grant.attempt)
    );
    assert!(last.actor.starts_with("executor:"), "{last:?}");
    assert!(last.details_json.contains("\"late\":true"), "{last:?}");

    // Door 3: an operator's resolution, with reason and identity.
    let grant = claim(&mut client, begin("inv3-b", ARGS)).await;
    report_unknown(&mut client, "inv3-b", grant.fencing_token)
        .await
        .unwrap();
    let refused = client
        .resolve(pb::ResolveRequest {
            operation_id: "inv3-b".into(),
            outcome: pb::OperationState::Absent as i32,
            reason: String::new(),
            operator: "alice".into(),
            resolution_id: "r-1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(field(&refused), "reason");
    resolve(&mut client, "inv3-b", pb::OperationState::Absent, "r-2")
        .await
        .unwrap();
    let history = get(&mut client, "inv3-b").await;
    let last = history.events.last().unwrap();
    assert_eq!(
        (
            last.kind.as_str(),
            last.actor.as_str(),
            last.reason.as_str()
        ),
        (
            "RESOLVED",
            "operator:alice",
            "checked the provider dashboard"
        )
    );
    assert_eq!(last.from_state, pb::OperationState::Unknown as i32);
    assert_eq!(last.to_state, pb::OperationState::Absent as i32);
    ledger.stop().await;
}

async fn invariant_4_retention_never_deletes_unknown_or_in_flight(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with(
        &db,
        &[
            "--retention-explicit",
            "1ms",
            "--retention-derived",
            "1ms",
            "--retention-sweep-interval",
            "50ms",
        ],
    )
    .await;
    let mut client = ledger.client().await;

    let mut long_lease = begin("inv4-in-flight", ARGS);
    long_lease.lease_ttl = Some(ms(3_600_000));
    claim(&mut client, long_lease).await;
    let grant = claim(&mut client, begin("inv4-unknown", ARGS)).await;
    report_unknown(&mut client, "inv4-unknown", grant.fencing_token)
        .await
        .unwrap();
    let grant = claim(&mut client, begin("inv4-confirmed", ARGS)).await;
    confirm(&mut client, "inv4-confirmed", grant.fencing_token, b"ok")
        .await
        .unwrap();

    // However old: age every timestamp to the first second of the epoch.
    db.execute("UPDATE operations SET created_at = 1, updated_at = 1 WHERE state <> 'CONFIRMED'")
        .await;

    // The sweeper has run once the settled operation is gone.
    wait_deleted(&db, "inv4-confirmed").await;
    assert_eq!(
        state_of(&mut client, "inv4-in-flight").await,
        pb::OperationState::InFlight
    );
    assert_eq!(
        state_of(&mut client, "inv4-unknown").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

async fn invariant_5_no_execute_when_the_fingerprint_differs(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // Including ABSENT, where the same fingerprint would execute again.
    let grant = claim(&mut client, begin("inv5", ARGS)).await;
    report_absent(&mut client, "inv5", grant.fencing_token)
        .await
        .unwrap();
    for args in [
        r#"{"order":"o-1"}"#,
        r#"{"order":"o-1","amount_cents":501,"currency":"eur"}"#,
    ] {
        let response = client
            .begin(begin("inv5", args))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(decision_name(&response), "CONFLICT");
    }
    let mut by_fingerprint = begin("inv5", ARGS);
    by_fingerprint.effect = Some(pb::begin_request::Effect::Fingerprint("0".repeat(64)));
    let response = client.begin(by_fingerprint).await.unwrap().into_inner();
    assert_eq!(decision_name(&response), "CONFLICT");
    assert_eq!(db.scalar("SELECT count(*) FROM attempts").await, 1);
    ledger.stop().await;
}

async fn invariant_6_every_transition_appends_one_event(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // ABSENT→IN_FLIGHT→ABSENT→IN_FLIGHT→UNKNOWN→CONFIRMED(resolved): five transitions.
    let first = claim(&mut client, begin("inv6", ARGS)).await;
    report_absent(&mut client, "inv6", first.fencing_token)
        .await
        .unwrap();
    let second = claim(&mut client, begin("inv6", ARGS)).await;
    report_unknown(&mut client, "inv6", second.fencing_token)
        .await
        .unwrap();
    resolve(&mut client, "inv6", pb::OperationState::Confirmed, "r-6")
        .await
        .unwrap();
    // Answers that change nothing append nothing.
    client.begin(begin("inv6", ARGS)).await.unwrap();
    resolve(&mut client, "inv6", pb::OperationState::Confirmed, "r-6")
        .await
        .unwrap();

    let history = get(&mut client, "inv6").await;
    let kinds: Vec<&str> = history.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "CLAIMED",
            "REPORTED_ABSENT",
            "CLAIMED",
            "REPORTED_UNKNOWN",
            "RESOLVED"
        ]
    );
    let states = |e: &pb::Event| (e.from_state, e.to_state);
    use pb::OperationState::*;
    let expected = [
        (Absent, InFlight),
        (InFlight, Absent),
        (Absent, InFlight),
        (InFlight, Unknown),
        (Unknown, Confirmed),
    ];
    for (event, (from, to)) in history.events.iter().zip(expected) {
        assert_eq!(states(event), (from as i32, to as i32), "{event:?}");
        assert!(
            event.at.is_some() && !event.actor.is_empty() && event.attempt >= 1,
            "{event:?}"
        );
    }
    assert!(history
        .events
        .windows(2)
        .all(|w| w[0].sequence < w[1].sequence));
    assert_eq!(history.attempts.len(), 2);
    assert_eq!(
        history.attempts[0].context.as_ref().unwrap().session_id,
        "session-1"
    );
    ledger.stop().await;
}

async fn invariant_7_a_stale_report_never_changes_state(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("inv7", ARGS)).await;
    report_absent(&mut client, "inv7", first.fencing_token)
        .await
        .unwrap();
    let second = claim(&mut client, begin("inv7", ARGS)).await;
    let before = get(&mut client, "inv7").await.operation.unwrap();
    for status in [
        report_absent(&mut client, "inv7", first.fencing_token)
            .await
            .unwrap_err(),
        report_unknown(&mut client, "inv7", first.fencing_token)
            .await
            .unwrap_err(),
        report_unknown(&mut client, "inv7", 99).await.unwrap_err(),
    ] {
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(reason(&status), "EXECUTION_RIGHT_LOST");
    }
    let heartbeat = client
        .heartbeat(pb::HeartbeatRequest {
            operation_id: "inv7".into(),
            fencing_token: first.fencing_token,
            lease_ttl: Some(ms(60_000)),
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&heartbeat), "EXECUTION_RIGHT_LOST");
    assert_eq!(get(&mut client, "inv7").await.operation.unwrap(), before);
    confirm(&mut client, "inv7", second.fencing_token, b"ok")
        .await
        .unwrap();
    ledger.stop().await;
}

async fn invariant_8_every_rpc_is_safe_to_retry(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // Begin: the same attempt id gets the same grant (and no second attempt).
    let request = begin("inv8", ARGS);
    let grant = claim(&mut client, request.clone()).await;
    assert_eq!(
        claim(&mut client, request).await.fencing_token,
        grant.fencing_token
    );
    // Reports: the same report twice gets the same answer.
    let confirmed = pb::OperationState::Confirmed as i32;
    assert_eq!(
        confirm(&mut client, "inv8", grant.fencing_token, b"r")
            .await
            .unwrap(),
        confirmed
    );
    assert_eq!(
        confirm(&mut client, "inv8", grant.fencing_token, b"r")
            .await
            .unwrap(),
        confirmed
    );

    let grant = claim(&mut client, begin("inv8-absent", ARGS)).await;
    let absent = pb::OperationState::Absent as i32;
    assert_eq!(
        report_absent(&mut client, "inv8-absent", grant.fencing_token)
            .await
            .unwrap(),
        absent
    );
    assert_eq!(
        report_absent(&mut client, "inv8-absent", grant.fencing_token)
            .await
            .unwrap(),
        absent
    );

    // Resolutions: the same resolution id twice gets the same answer; another one is refused.
    let grant = claim(&mut client, begin("inv8-unknown", ARGS)).await;
    let unknown = pb::OperationState::Unknown as i32;
    assert_eq!(
        report_unknown(&mut client, "inv8-unknown", grant.fencing_token)
            .await
            .unwrap(),
        unknown
    );
    assert_eq!(
        report_unknown(&mut client, "inv8-unknown", grant.fencing_token)
            .await
            .unwrap(),
        unknown
    );
    assert_eq!(
        resolve(
            &mut client,
            "inv8-unknown",
            pb::OperationState::Absent,
            "res-1"
        )
        .await
        .unwrap(),
        absent
    );
    assert_eq!(
        resolve(
            &mut client,
            "inv8-unknown",
            pb::OperationState::Absent,
            "res-1"
        )
        .await
        .unwrap(),
        absent
    );
    let other = resolve(
        &mut client,
        "inv8-unknown",
        pb::OperationState::Absent,
        "res-2",
    )
    .await
    .unwrap_err();
    assert_eq!(reason(&other), "NOT_UNKNOWN");

    assert_eq!(db.scalar("SELECT count(*) FROM attempts").await, 3);
    assert_eq!(db.scalar("SELECT count(*) FROM events").await, 7);
    ledger.stop().await;
}

async fn invariant_9_leases_are_measured_on_the_database_clock(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let clock = match store {
        Engine::Postgres => "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
        Engine::Sqlite => "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    };
    let before = db.scalar(clock).await;
    let mut request = begin("inv9", ARGS);
    request.lease_ttl = Some(ms(45_000));
    let grant = claim(&mut client, request).await;
    let after = db.scalar(clock).await;
    let started = db
        .scalar("SELECT lease_started_at FROM operations WHERE operation_id = 'inv9'")
        .await;
    let deadline = once_api::convert::millis(grant.lease_deadline.as_ref().unwrap());
    assert!(
        before <= started && started <= after,
        "lease began at {started}, database clock read {before}..{after}"
    );
    assert_eq!(deadline - started, 45_000);
    ledger.stop().await;
}
