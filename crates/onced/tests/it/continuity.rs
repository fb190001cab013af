//! Continuity: a ledger restored to an earlier state than a client saw executes none of what it
//! lost again, holds the tenant until an operator accepts the loss, and takes back as UNKNOWN
//! what the client reports.

use std::time::Duration;

use clap::Parser as _;
use once_api::pb;
use tonic::Code;

use crate::support::*;

on_both_backends!(
    a_ledger_restored_to_before_what_a_client_saw_executes_none_of_it_again,
    a_ledger_that_lost_an_operation_but_kept_a_later_one_is_caught_by_the_operations_own_position,
    a_grant_lost_before_an_acceptance_is_refused_to_the_client_that_kept_it_until_it_reports,
    a_restored_ledger_that_moved_on_over_what_it_lost_is_caught_by_the_claim_it_lacks,
    a_position_not_sealed_by_the_ledger_is_refused_and_holds_nothing,
);

const ARGS: &str = r#"{"order_id":"o1","amount_cents":500}"#;

/// A Begin of a new `id` showing `seen`, claimed and confirmed: the position it was granted.
async fn run_once(client: &mut Grpc, id: &str, seen: &str) -> String {
    let mut request = begin(id, ARGS);
    request.seen_position = seen.to_owned();
    let grant = claim(client, request).await;
    assert!(grant.position.starts_with("p1."), "{grant:?}");
    confirm(client, id, grant.fencing_token, b"done")
        .await
        .unwrap();
    grant.position
}

fn showing(id: &str, seen: &str) -> pb::BeginRequest {
    let mut request = begin(id, ARGS);
    request.seen_position = seen.to_owned();
    request
}

/// A Begin of `id` showing `seen` as the highest position, and `own` as the operation's.
fn showing_both(id: &str, seen: &str, own: &str) -> pb::BeginRequest {
    let mut request = showing(id, seen);
    request.operation_position = own.to_owned();
    request
}

fn reason(status: &tonic::Status) -> String {
    use tonic_types::StatusExt as _;
    status
        .get_details_error_info()
        .map(|info| info.reason)
        .unwrap_or_default()
}

fn metadata(status: &tonic::Status, key: &str) -> String {
    use tonic_types::StatusExt as _;
    status
        .get_details_error_info()
        .and_then(|info| info.metadata.get(key).cloned())
        .unwrap_or_default()
}

/// What the ledger's `once.continuity` health check says.
async fn continuity_health(addr: std::net::SocketAddr) -> ServingStatus {
    health_of(addr, "once.continuity").await
}

/// `onced continuity accept --reason …` on the database at `url`.
async fn accept(url: &str) {
    let config = onced::Config::try_parse_from([
        "onced",
        "--database-url",
        url,
        "continuity",
        "accept",
        "--reason",
        "restored from the backup taken before the drill",
    ])
    .unwrap();
    let command = config.command.clone().unwrap();
    onced::administer(config, command).await.unwrap();
}

async fn a_ledger_restored_to_before_what_a_client_saw_executes_none_of_it_again(store: Engine) {
    let db = TestDb::new(store).await;
    // The backup is taken of a ledger that has run one operation.
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let before = run_once(&mut client, "cont-before", "").await;
    ledger.stop().await;
    db.back_up().await;

    // After it, two more run; the client keeps the highest position it saw.
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let first = run_once(&mut client, "cont-1", &before).await;
    let second = run_once(&mut client, "cont-2", &first).await;
    ledger.stop().await;

    // The database is restored to the backup: cont-1 and cont-2 are gone from it.
    db.restore().await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    assert_eq!(continuity_health(ledger.addr).await, ServingStatus::Serving);

    // The client's next Begin of cont-2 is refused, naming both positions; nothing is stored.
    let stored = db.snapshot().await;
    let refused = client.begin(showing("cont-2", &second)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert_eq!(reason(&refused), "LEDGER_BEHIND");
    assert_eq!(metadata(&refused, "why"), "TOKEN_AHEAD");
    assert!(!metadata(&refused, "client_token").is_empty());
    assert!(
        refused.message().contains("onced continuity accept"),
        "{refused:?}"
    );
    assert_eq!(db.snapshot().await, stored, "a refused Begin wrote nothing");

    // The tenant is held, for every Begin that would execute: one showing nothing, one of a
    // new operation.
    for (id, seen) in [
        ("cont-1", ""),
        ("cont-new", ""),
        ("cont-new", before.as_str()),
    ] {
        let refused = client.begin(showing(id, seen)).await.unwrap_err();
        assert_eq!(reason(&refused), "LEDGER_BEHIND", "{id}: {refused:?}");
    }
    // What needs no execution is answered as usual: the operation the backup holds replays;
    // but not to a client showing what the ledger lost, which is refused whatever it asks, so
    // that it reports what it kept.
    let replayed = client.begin(showing("cont-before", "")).await.unwrap();
    expect_replay(&replayed.into_inner());
    let refused = client
        .begin(showing("cont-before", &second))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "LEDGER_BEHIND");
    // Health says so (NOT_SERVING for `once.continuity`) on this replica, and on another one
    // started on the same database.
    eventually(Duration::from_secs(10), "continuity health", || async {
        (continuity_health(ledger.addr).await == ServingStatus::NotServing).then_some(())
    })
    .await;
    let other = TestLedger::spawn(&db).await;
    let refused = other
        .client()
        .await
        .begin(showing("cont-other", ""))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "LEDGER_BEHIND");

    // The client reports the positions it kept: what the ledger lost comes back UNKNOWN.
    let recovered = client
        .recover_operations(pb::RecoverOperationsRequest {
            positions: vec![before.clone(), first.clone(), second.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let brought: Vec<(String, bool)> = recovered
        .operations
        .iter()
        .map(|o| (o.operation_id.clone(), o.recovered))
        .collect();
    assert_eq!(
        brought,
        [
            ("cont-before".into(), false),
            ("cont-1".into(), true),
            ("cont-2".into(), true)
        ]
    );
    for id in ["cont-1", "cont-2"] {
        assert_eq!(
            state_of(&mut client, id).await,
            pb::OperationState::Unknown,
            "{id}"
        );
        let history = get(&mut client, id).await;
        let last = history.events.last().unwrap();
        assert_eq!(last.kind, "RECOVERED", "{id}: {history:?}");
    }
    // Its client, having reported, is answered again (anything but an execution).
    let answer = client.begin(showing("cont-2", &second)).await.unwrap();
    expect_unknown(&answer.into_inner());
    // Reported again, nothing changes.
    let again = client
        .recover_operations(pb::RecoverOperationsRequest {
            positions: vec![second.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.operations[0].recovered);

    // An operator accepts the loss: executions go on, in the tenant's next epoch, on every
    // replica; the lost operations stay UNKNOWN (never executed again) for their reconciler.
    accept(&db.url).await;
    let executed = eventually(Duration::from_secs(10), "executions to go on", || {
        let (mut client, second) = (client.clone(), second.clone());
        async move { client.begin(showing("cont-new", &second)).await.ok() }
    })
    .await;
    let grant = expect_execute(&executed.into_inner());
    assert!(grant.position.starts_with("p1."));
    let answer = client
        .begin(showing("cont-2", &grant.position))
        .await
        .unwrap();
    expect_unknown(&answer.into_inner());
    eventually(Duration::from_secs(10), "continuity health", || async {
        (continuity_health(ledger.addr).await == ServingStatus::Serving).then_some(())
    })
    .await;
    // No token the client saw is issued again.
    let granted: u64 = grant.fencing_token;
    let seen_token: u64 = db
        .scalar("SELECT max(fencing_token) FROM attempts WHERE operation_id = 'cont-2'")
        .await
        .try_into()
        .unwrap();
    assert!(granted > seen_token, "{granted} after {seen_token}");
    other.stop().await;
    ledger.stop().await;
}

async fn a_restored_ledger_that_moved_on_over_what_it_lost_is_caught_by_the_claim_it_lacks(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    ledger.stop().await;
    db.back_up().await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let seen = run_once(&mut client, "fork-1", "").await;
    ledger.stop().await;
    db.restore().await;

    // Another client, with nothing to show, runs operations on the restored ledger until it
    // has issued tokens past the one the first client saw.
    let ledger = TestLedger::spawn(&db).await;
    let mut other = ledger.client().await;
    for n in 0..3 {
        let _ = run_once(&mut other, &format!("fork-other-{n}"), "").await;
    }
    // The first client shows its position: its token is no longer ahead, but its claim is not
    // in the ledger's history, which retention cannot have taken.
    let mut client = ledger.client().await;
    let refused = client.begin(showing("fork-2", &seen)).await.unwrap_err();
    assert_eq!(reason(&refused), "LEDGER_BEHIND", "{refused:?}");
    assert_eq!(metadata(&refused, "why"), "CLAIM_MISSING");
    ledger.stop().await;
}

async fn a_position_not_sealed_by_the_ledger_is_refused_and_holds_nothing(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let seen = run_once(&mut client, "seal-1", "").await;
    // One byte of its seal changed: refused, naming the field, and nothing is held.
    let mut forged = seen.clone().into_bytes();
    let inside_the_seal = forged.len() - 6;
    forged[inside_the_seal] = if forged[inside_the_seal] == b'A' {
        b'B'
    } else {
        b'A'
    };
    let forged = String::from_utf8(forged).unwrap();
    let refused = client.begin(showing("seal-2", &forged)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(metadata(&refused, "field"), "seen_position");
    for junk in ["p1.not-a-position", "hello"] {
        let refused = client.begin(showing("seal-2", junk)).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{junk}");
    }
    let fine = client.begin(showing("seal-2", &seen)).await.unwrap();
    expect_execute(&fine.into_inner());
    // Nor does RecoverOperations take one: it brings nothing back, and the rest of the report
    // is judged as ever.
    let answered = client
        .recover_operations(pb::RecoverOperationsRequest {
            positions: vec![forged, seen.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let brought: Vec<(&str, bool)> = answered
        .operations
        .iter()
        .map(|o| (o.operation_id.as_str(), o.recovered))
        .collect();
    assert_eq!(brought, [("", false), ("seal-1", false)]);
    assert_eq!(continuity_health(ledger.addr).await, ServingStatus::Serving);
    ledger.stop().await;
}

/// A standby that missed one commit (or a backup taken between two commits that PostgreSQL
/// made in the other order): the ledger holds the later operation, not the earlier one.
async fn a_ledger_that_lost_an_operation_but_kept_a_later_one_is_caught_by_the_operations_own_position(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let lost = run_once(&mut client, "lag-1", "").await;
    let kept = run_once(&mut client, "lag-2", &lost).await;
    ledger.stop().await;
    for table in ["events", "attempts", "operations"] {
        db.execute(&format!("DELETE FROM {table} WHERE operation_id = 'lag-1'"))
            .await;
    }
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    // The highest position alone shows nothing: the ledger holds lag-2.
    let fine = client.begin(showing("lag-3", &kept)).await.unwrap();
    let grant = expect_execute(&fine.into_inner());
    confirm(&mut client, "lag-3", grant.fencing_token, b"done")
        .await
        .unwrap();
    // The retry of lag-1 shows its own position too: the ledger lost that claim.
    let refused = client
        .begin(showing_both("lag-1", &grant.position, &lost))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "LEDGER_BEHIND", "{refused:?}");
    assert_eq!(metadata(&refused, "why"), "CLAIM_MISSING");
    assert_eq!(metadata(&refused, "operation_id"), "lag-1");
    assert_eq!(
        db.scalar("SELECT count(*) FROM operations WHERE operation_id = 'lag-1'")
            .await,
        0
    );
    ledger.stop().await;
}

/// A client that was away while the loss was accepted still holds a grant the ledger lost.
async fn a_grant_lost_before_an_acceptance_is_refused_to_the_client_that_kept_it_until_it_reports(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    ledger.stop().await;
    db.back_up().await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let seen = run_once(&mut client, "away-1", "").await;
    let away = run_once(&mut client, "away-2", &seen).await;
    ledger.stop().await;
    db.restore().await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    // One client shows the loss and reports its own grant; the loss is accepted.
    let refused = client.begin(showing("away-1", &seen)).await.unwrap_err();
    assert_eq!(reason(&refused), "LEDGER_BEHIND");
    client
        .recover_operations(pb::RecoverOperationsRequest {
            positions: vec![seen.clone()],
        })
        .await
        .unwrap();
    accept(&db.url).await;
    eventually(Duration::from_secs(10), "executions to go on", || {
        let mut client = client.clone();
        async move { client.begin(showing("away-new", "")).await.ok() }
    })
    .await;
    // The client that was away shows its grant of away-2, of the epoch before: its Begin is
    // refused, and the tenant is not held again.
    let refused = client
        .begin(showing_both("away-2", &away, &away))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "LEDGER_BEHIND", "{refused:?}");
    assert_eq!(metadata(&refused, "why"), "CLAIM_MISSING");
    let other = client.begin(showing("away-other", "")).await.unwrap();
    expect_execute(&other.into_inner());
    // It reports; away-2 is UNKNOWN, never executed again.
    let brought = client
        .recover_operations(pb::RecoverOperationsRequest {
            positions: vec![away.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(brought.operations[0].recovered);
    let answer = client
        .begin(showing_both("away-2", &away, &away))
        .await
        .unwrap();
    expect_unknown(&answer.into_inner());
    ledger.stop().await;
}
