//! Every row of the decision table (SPEC §4), through gRPC.

use std::time::Duration;

use once_api::pb;
use once_api::pb::begin_response::Decision;

use crate::support::*;

on_both_backends!(
    first_begin_executes,
    absent_executes_again_with_the_same_provider_key,
    retried_begin_with_same_attempt_id_gets_the_same_grant,
    other_attempt_while_lease_live_is_in_progress,
    expired_lease_seen_by_begin_is_unknown,
    confirmed_replays_the_result_byte_for_byte,
    unknown_stays_unknown,
    different_fingerprint_conflicts_in_every_state,
    bounded_wait_returns_the_settled_outcome,
    identity_forms_and_fresh_id_guard,
);

async fn first_begin_executes(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let response = client
        .begin(begin("refund:o-1", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.operation_id, "refund:o-1");
    let grant = expect_execute(&response);
    assert_eq!(grant.attempt, 1);
    assert!(grant.fencing_token >= 1 << 20, "{grant:?}");
    assert!(!grant.regranted);
    assert!(grant.provider_key.starts_with("once_"));
    assert!(grant.lease_deadline.is_some());
    assert_eq!(
        state_of(&mut client, "refund:o-1").await,
        pb::OperationState::InFlight
    );
    ledger.stop().await;
}

async fn absent_executes_again_with_the_same_provider_key(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("refund:o-2", ARGS)).await;
    report_absent(&mut client, "refund:o-2", first.fencing_token)
        .await
        .unwrap();
    let second = claim(&mut client, begin("refund:o-2", ARGS)).await;
    assert_eq!(second.attempt, 2);
    assert!(second.fencing_token > first.fencing_token);
    assert_eq!(second.provider_key, first.provider_key);
    ledger.stop().await;
}

async fn retried_begin_with_same_attempt_id_gets_the_same_grant(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let request = begin("refund:o-3", ARGS);
    let first = claim(&mut client, request.clone()).await;
    let again = claim(&mut client, request.clone()).await;
    assert!(again.regranted);
    assert_eq!(
        (
            again.attempt,
            again.fencing_token,
            again.lease_deadline,
            again.provider_key
        ),
        (
            first.attempt,
            first.fencing_token,
            first.lease_deadline,
            first.provider_key
        )
    );
    let other = client
        .begin(begin("refund:o-3", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&other), "IN_PROGRESS");
    assert_eq!(
        db.scalar("SELECT count(*) FROM attempts").await,
        1,
        "a retried Begin mints no attempt"
    );
    ledger.stop().await;
}

async fn other_attempt_while_lease_live_is_in_progress(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("refund:o-4", ARGS)).await;
    let response = client
        .begin(begin("refund:o-4", ARGS))
        .await
        .unwrap()
        .into_inner();
    let Decision::InProgress(in_progress) = decision(&response) else {
        panic!("expected IN_PROGRESS, got {response:?}");
    };
    assert_eq!(in_progress.attempt, grant.attempt);
    assert_eq!(in_progress.lease_deadline, grant.lease_deadline);
    let retry_after = in_progress.retry_after.expect("retry_after");
    assert!(retry_after.seconds > 0 || retry_after.nanos > 0);
    assert_eq!(
        state_of(&mut client, "refund:o-4").await,
        pb::OperationState::InFlight
    );
    ledger.stop().await;
}

async fn expired_lease_seen_by_begin_is_unknown(store: Engine) {
    let db = TestDb::new(store).await;
    // No sweeper in the way: the Begin itself must notice the expired lease.
    let ledger = TestLedger::spawn_with(&db, &["--lease-sweep-interval", "1h"]).await;
    let mut client = ledger.client().await;

    let mut request = begin("refund:o-5", ARGS);
    request.lease_ttl = Some(ms(200));
    claim(&mut client, request).await;
    let unknown = eventually(
        Duration::from_secs(10),
        "Begin to see the lease expired",
        || {
            let mut client = client.clone();
            async move {
                let response = client
                    .begin(begin("refund:o-5", ARGS))
                    .await
                    .unwrap()
                    .into_inner();
                match decision(&response) {
                    Decision::InProgress(_) => None,
                    Decision::Unknown(unknown) => Some(unknown.clone()),
                    other => panic!("expected IN_PROGRESS then UNKNOWN, got {other:?}"),
                }
            }
        },
    )
    .await;
    assert!(unknown.reason.contains("lease"), "{unknown:?}");
    let history = get(&mut client, "refund:o-5").await;
    assert_eq!(
        history.operation.unwrap().state,
        pb::OperationState::Unknown as i32
    );
    let last = history.events.last().unwrap();
    assert_eq!(
        (last.kind.as_str(), last.actor.as_str()),
        ("LEASE_EXPIRED", "ledger")
    );
    ledger.stop().await;
}

async fn confirmed_replays_the_result_byte_for_byte(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // Not UTF-8, with NULs: the ledger stores bytes, not text.
    let result: Vec<u8> = vec![0, 159, 146, 150, b'{', b'}', 0, 255];
    let grant = claim(&mut client, begin("refund:o-6", ARGS)).await;
    confirm(&mut client, "refund:o-6", grant.fencing_token, &result)
        .await
        .unwrap();
    for _ in 0..2 {
        let response = client
            .begin(begin("refund:o-6", ARGS))
            .await
            .unwrap()
            .into_inner();
        let replay = expect_replay(&response);
        assert_eq!(replay.result, result);
        assert_eq!(replay.provider_ref, "re_1");
        assert_eq!(replay.attempt, 1);
        assert!(replay.confirmed_at.is_some());
    }
    ledger.stop().await;
}

async fn unknown_stays_unknown(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("refund:o-7", ARGS)).await;
    report_unknown(&mut client, "refund:o-7", grant.fencing_token)
        .await
        .unwrap();
    let response = client
        .begin(begin("refund:o-7", ARGS))
        .await
        .unwrap()
        .into_inner();
    let unknown = expect_unknown(&response);
    assert_eq!(unknown.reason, "timeout after sending");
    assert!(unknown.blocking_operation_id.is_empty());
    assert_eq!(
        state_of(&mut client, "refund:o-7").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

async fn different_fingerprint_conflicts_in_every_state(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let other_args = r#"{"order":"o-1","amount_cents":900,"currency":"eur"}"#;

    let states = [
        ("c-in-flight", pb::OperationState::InFlight),
        ("c-confirmed", pb::OperationState::Confirmed),
        ("c-absent", pb::OperationState::Absent),
        ("c-unknown", pb::OperationState::Unknown),
    ];
    for (id, state) in states {
        let grant = claim(&mut client, begin(id, ARGS)).await;
        match state {
            pb::OperationState::Confirmed => drop(
                confirm(&mut client, id, grant.fencing_token, b"ok")
                    .await
                    .unwrap(),
            ),
            pb::OperationState::Absent => drop(
                report_absent(&mut client, id, grant.fencing_token)
                    .await
                    .unwrap(),
            ),
            pb::OperationState::Unknown => drop(
                report_unknown(&mut client, id, grant.fencing_token)
                    .await
                    .unwrap(),
            ),
            _ => {}
        }
        let before = db.snapshot().await;
        let response = client
            .begin(begin(id, other_args))
            .await
            .unwrap()
            .into_inner();
        let Decision::Conflict(conflict) = decision(&response) else {
            panic!("{state:?}: expected CONFLICT, got {response:?}");
        };
        assert_ne!(conflict.stored_fingerprint, conflict.requested_fingerprint);
        assert_eq!(conflict.stored_fingerprint.len(), 64);
        assert_eq!(
            state_of(&mut client, id).await,
            state,
            "a conflict changes nothing"
        );
        assert_eq!(db.snapshot().await, before);
    }
    ledger.stop().await;
}

async fn bounded_wait_returns_the_settled_outcome(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("refund:o-8", ARGS)).await;
    let mut waiting = begin("refund:o-8", ARGS);
    waiting.wait = Some(ms(20_000));
    let mut waiter = client.clone();
    let waited = tokio::spawn(async move { waiter.begin(waiting).await.unwrap().into_inner() });
    // The waiter is parked on IN_PROGRESS until the confirm lands.
    confirm(
        &mut client,
        "refund:o-8",
        grant.fencing_token,
        b"refund re_1",
    )
    .await
    .unwrap();
    let response = within(Duration::from_secs(15), "the waiting Begin", waited)
        .await
        .unwrap();
    assert_eq!(expect_replay(&response).result, b"refund re_1");

    // A bound that runs out answers IN_PROGRESS.
    claim(&mut client, begin("refund:o-9", ARGS)).await;
    let mut short = begin("refund:o-9", ARGS);
    short.wait = Some(ms(100));
    let response = client.begin(short).await.unwrap().into_inner();
    assert_eq!(decision_name(&response), "IN_PROGRESS");
    ledger.stop().await;
}

async fn identity_forms_and_fresh_id_guard(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // Intent parts: the ledger computes the once-id-v1 id.
    let mut intent = begin("unused", ARGS);
    intent.identity = Some(pb::begin_request::Identity::Intent(pb::Intent {
        parts: vec![
            pb::IntentPart {
                kind: Some(pb::intent_part::Kind::Text("order".into())),
            },
            pb::IntentPart {
                kind: Some(pb::intent_part::Kind::Integer(42)),
            },
        ],
    }));
    let response = client.begin(intent).await.unwrap().into_inner();
    assert_eq!(
        response.operation_id,
        "order:40ffb083c1b146b4786b631bcbf0b5c2"
    );
    expect_execute(&response);

    // Derived from tool and canonical arguments, volatile fields left out.
    let derived = |args: &str| {
        let mut request = begin_exact("unused", args);
        request.identity = Some(pb::begin_request::Identity::Derived(pb::Derived {}));
        request.volatile_fields = vec!["nonce".into()];
        request
    };
    let first = client
        .begin(derived(r#"{"b":2,"a":1,"nonce":"x"}"#))
        .await
        .unwrap()
        .into_inner();
    assert!(
        first.operation_id.starts_with("issue_refund:h:"),
        "{}",
        first.operation_id
    );
    let grant = expect_execute(&first);
    let second = client
        .begin(derived(r#"{"a":1.0,"b":2,"nonce":"y"}"#))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.operation_id, first.operation_id);
    assert_eq!(decision_name(&second), "IN_PROGRESS");
    let keyed = client
        .begin(derived(r#"{"a":1,"b":2,"idempotency_key":"k-77"}"#))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(keyed.operation_id, "issue_refund:x:k-77");

    // The fresh-id guard: while the derived operation is UNKNOWN, a new id for the same tool
    // and arguments does not execute, unless a new intent is declared.
    report_unknown(&mut client, &first.operation_id, grant.fencing_token)
        .await
        .unwrap();
    let fresh = client
        .begin(begin_exact("refund:fresh-id", r#"{"a":1,"b":2}"#))
        .await
        .unwrap()
        .into_inner();
    let unknown = expect_unknown(&fresh);
    assert_eq!(unknown.blocking_operation_id, first.operation_id);
    assert_eq!(
        db.scalar("SELECT count(*) FROM operations WHERE operation_id = 'refund:fresh-id'")
            .await,
        0
    );
    let mut declared = begin_exact("refund:fresh-id", r#"{"a":1,"b":2}"#);
    declared.new_intent = true;
    expect_execute(&client.begin(declared).await.unwrap().into_inner());
    ledger.stop().await;
}
