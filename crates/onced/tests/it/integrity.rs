//! Truth integrity: each path found to a second execution or a false truth, closed, and the
//! test that proves it, on both backends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use once_api::pb;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::support::*;

on_both_backends!(
    a_fencing_token_is_never_issued_twice_across_lives,
    earlier_lives_are_told_apart_from_the_current_one,
    anomalies_of_a_new_life_are_recorded_again,
    the_fresh_id_guard_stops_a_new_id_while_the_same_intent_runs,
    the_fresh_id_guard_sees_an_expired_lease_before_the_sweeper_does,
    new_ids_for_one_intent_at_once_execute_once,
    a_late_confirm_after_an_absent_resolution_and_an_absent_retry_settles_confirmed,
    a_regrant_needs_the_same_attempt_id_and_context,
    a_miss_counts_only_when_issued_a_settle_time_after_the_effect_could_last_be_written,
    a_verdict_about_an_earlier_attempt_is_never_applied_to_a_later_one,
    this_lifes_effect_found_after_the_operation_moved_on_still_settles_it,
    a_resolution_names_the_attempt_it_examined,
    a_new_life_is_never_confirmed_by_an_earlier_lifes_refund,
    a_retried_resolution_gets_its_first_answer_after_the_operation_moved_on,
    reports_are_recorded_under_their_attempts_executor,
);

/// Deletes a settled operation as the retention sweeper does (its attempts go with it; its
/// events stay), without waiting for retention to pass.
async fn delete_as_retention_does(db: &TestDb, id: &str) {
    let deleted = db
        .execute(&format!(
            "DELETE FROM operations WHERE operation_id = '{id}' AND state IN ('CONFIRMED', 'ABSENT')"
        ))
        .await;
    assert_eq!(deleted, 1, "{id} is settled");
}

fn count(history: &pb::GetOperationResponse, kind: &str) -> usize {
    history.events.iter().filter(|e| e.kind == kind).count()
}

/// GetOperation tells an operation's current life from the earlier ones of its id (settled,
/// deleted by retention, begun again): the history is this life's, the earlier events beside it.
async fn earlier_lives_are_told_apart_from_the_current_one(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with_short_retention(&db, "50ms").await;
    let mut client = ledger.client().await;
    let first = claim(&mut client, begin("lives-2", ARGS)).await;
    let kinds = |events: &[pb::Event]| events.iter().map(|e| e.kind.clone()).collect::<Vec<_>>();
    assert!(get(&mut client, "lives-2").await.earlier_events.is_empty());
    confirm(&mut client, "lives-2", first.fencing_token, b"life one")
        .await
        .unwrap();
    wait_deleted(&db, "lives-2").await;

    let second = claim(&mut client, begin("lives-2", ARGS)).await;
    let found = get(&mut client, "lives-2").await;
    assert_eq!(kinds(&found.events), ["CLAIMED"]);
    assert_eq!(kinds(&found.earlier_events), ["CLAIMED", "CONFIRMED"]);
    assert!(found.earlier_events[0].sequence < found.earlier_events[1].sequence);
    assert!(found.earlier_events[1].sequence < found.events[0].sequence);
    report_absent(&mut client, "lives-2", second.fencing_token)
        .await
        .unwrap();
    let found = get(&mut client, "lives-2").await;
    assert_eq!(kinds(&found.events), ["CLAIMED", "REPORTED_ABSENT"]);
    assert_eq!(found.earlier_events.len(), 2);
    ledger.stop().await;
}

async fn a_fencing_token_is_never_issued_twice_across_lives(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with_short_retention(&db, "50ms").await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("lives-1", ARGS)).await;
    confirm(&mut client, "lives-1", first.fencing_token, b"life one")
        .await
        .unwrap();
    wait_deleted(&db, "lives-1").await;

    let second = claim(&mut client, begin("lives-1", ARGS)).await;
    assert_eq!(second.attempt, 1, "a new life counts attempts from 1");
    assert!(
        second.fencing_token > first.fencing_token,
        "{} after {}",
        second.fencing_token,
        first.fencing_token
    );
    assert_ne!(second.provider_key, first.provider_key);

    // A very late report from the first life is refused and changes nothing.
    let before = (get(&mut client, "lives-1").await, db.snapshot().await);
    for late in [
        confirm(&mut client, "lives-1", first.fencing_token, b"late")
            .await
            .unwrap_err(),
        report_absent(&mut client, "lives-1", first.fencing_token)
            .await
            .unwrap_err(),
    ] {
        assert_eq!(reason(&late), "EXECUTION_RIGHT_LOST", "{late:?}");
    }
    assert_eq!(
        (get(&mut client, "lives-1").await, db.snapshot().await),
        before
    );
    assert_eq!(
        confirm(&mut client, "lives-1", second.fencing_token, b"life two")
            .await
            .unwrap(),
        pb::OperationState::Confirmed as i32
    );
    ledger.stop().await;
}

/// Attempt 1 goes UNKNOWN and is resolved ABSENT; attempt 2 runs; attempt 1 then confirms.
/// Returns the history after, and resolves the operation CONFIRMED.
async fn double_execution(client: &mut Grpc, id: &str) -> pb::GetOperationResponse {
    let first = claim(client, begin(id, ARGS)).await;
    report_unknown(client, id, first.fencing_token)
        .await
        .unwrap();
    resolve(client, id, pb::OperationState::Absent, &new_attempt_id())
        .await
        .unwrap();
    claim(client, begin(id, ARGS)).await;
    let refused = confirm(client, id, first.fencing_token, b"one")
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
    let history = get(client, id).await;
    resolve(client, id, pb::OperationState::Confirmed, &new_attempt_id())
        .await
        .unwrap();
    history
}

async fn anomalies_of_a_new_life_are_recorded_again(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    for life in 1..=2 {
        let history = double_execution(&mut client, "lives-2").await;
        assert_eq!(
            count(&history, "DOUBLE_EXECUTION"),
            1,
            "life {life}: {:?}",
            history.events
        );
        assert_eq!(history.events[0].kind, "CLAIMED", "only this life's events");
        delete_as_retention_does(&db, "lives-2").await;
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM events WHERE operation_id = 'lives-2' AND kind = 'DOUBLE_EXECUTION'")
            .await,
        2,
        "each life's anomaly is kept"
    );
    ledger.stop().await;
}

async fn the_fresh_id_guard_stops_a_new_id_while_the_same_intent_runs(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    // The harness timed out; the model retries under a new key while the first call runs.
    let running = claim(&mut client, begin_exact("intent-a", ARGS)).await;
    let mut retry = begin_exact("intent-b", ARGS);
    retry.wait = Some(ms(10_000));
    let response = client.begin(retry).await.unwrap().into_inner();
    let pb::begin_response::Decision::InProgress(in_progress) = decision(&response) else {
        panic!("expected IN_PROGRESS, got {response:?}")
    };
    assert_eq!(in_progress.blocking_operation_id, "intent-a");
    assert_eq!(
        db.scalar("SELECT count(*) FROM operations WHERE operation_id = 'intent-b'")
            .await,
        0
    );
    // Declaring a new intent runs it.
    let mut declared = begin_exact("intent-b", ARGS);
    declared.new_intent = true;
    expect_execute(&client.begin(declared).await.unwrap().into_inner());
    confirm(&mut client, "intent-a", running.fencing_token, b"ok")
        .await
        .unwrap();
    ledger.stop().await;
}

async fn the_fresh_id_guard_sees_an_expired_lease_before_the_sweeper_does(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with(&db, &["--lease-sweep-interval", "1h"]).await;
    let mut client = ledger.client().await;

    let mut short = begin_exact("lapsed-a", ARGS);
    short.lease_ttl = Some(ms(150));
    let grant = claim(&mut client, short).await;
    let deadline = once_api::convert::millis(grant.lease_deadline.as_ref().unwrap());
    eventually(
        Duration::from_secs(10),
        "the database clock to pass the lease",
        || async { (db.clock().await >= deadline).then_some(()) },
    )
    .await;
    let fresh = client
        .begin(begin_exact("lapsed-b", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_unknown(&fresh).blocking_operation_id, "lapsed-a");
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM operations WHERE operation_id = 'lapsed-a' AND state = 'IN_FLIGHT'"
        )
        .await,
        1,
        "no sweeper has marked it yet"
    );
    ledger.stop().await;
}

async fn new_ids_for_one_intent_at_once_execute_once(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let client = ledger.client().await;

    for round in 0..3 {
        let arguments = format!(r#"{{"order":"o-race-{round}","amount_cents":500}}"#);
        let begins = (0..16).map(|i| {
            let mut client = client.clone();
            let request = begin_exact(&format!("race-{round}-{i}"), &arguments);
            async move { client.begin(request).await.unwrap().into_inner() }
        });
        let responses = futures::future::join_all(begins).await;
        let executes = responses
            .iter()
            .filter(|r| decision_name(r) == "EXECUTE")
            .count();
        assert_eq!(executes, 1, "round {round}: {responses:?}");
        assert!(
            responses
                .iter()
                .all(|r| matches!(decision_name(r), "EXECUTE" | "IN_PROGRESS")),
            "{responses:?}"
        );
    }
    assert_eq!(db.scalar("SELECT count(*) FROM attempts").await, 3);
    ledger.stop().await;
}

async fn a_late_confirm_after_an_absent_resolution_and_an_absent_retry_settles_confirmed(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("late-1", ARGS)).await;
    report_unknown(&mut client, "late-1", first.fencing_token)
        .await
        .unwrap();
    resolve(&mut client, "late-1", pb::OperationState::Absent, "r-late")
        .await
        .unwrap();
    let second = claim(&mut client, begin("late-1", ARGS)).await;
    report_absent(&mut client, "late-1", second.fencing_token)
        .await
        .unwrap();
    // Attempt 1's effect did happen; no later attempt performed one.
    for _ in 0..2 {
        // The second time is the transport's retry: the same answer, nothing recorded again. A
        // superseded attempt is told its right is lost; its proof is recorded all the same.
        let refused = confirm(&mut client, "late-1", first.fencing_token, b"it did happen")
            .await
            .unwrap_err();
        assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
        assert_eq!(
            state_of(&mut client, "late-1").await,
            pb::OperationState::Confirmed
        );
    }
    let history = get(&mut client, "late-1").await;
    assert_eq!(count(&history, "RESOLUTION_CONTRADICTED"), 1);
    assert_eq!(count(&history, "DOUBLE_EXECUTION"), 0);
    let replay = client
        .begin(begin("late-1", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_replay(&replay).result, b"it did happen");
    assert_eq!(
        db.scalar("SELECT count(*) FROM attempts").await,
        2,
        "no third execution"
    );
    ledger.stop().await;
}

async fn a_regrant_needs_the_same_attempt_id_and_context(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let request = begin("regrant-1", ARGS);
    let grant = claim(&mut client, request.clone()).await;
    let again = claim(&mut client, request.clone()).await;
    assert!(again.regranted);
    assert_eq!(again.fencing_token, grant.fencing_token);

    // The same attempt id from another session is another attempt, not a transport retry.
    let mut elsewhere = request.clone();
    elsewhere.context.as_mut().unwrap().session_id = "session-2".into();
    let response = client.begin(elsewhere).await.unwrap().into_inner();
    assert_eq!(decision_name(&response), "IN_PROGRESS");

    // A JSON-RPC request id is no attempt id.
    let mut weak = request.clone();
    weak.attempt_id = "1".into();
    let refused = client.begin(weak).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(field(&refused), "attempt_id");
    assert_eq!(db.scalar("SELECT count(*) FROM attempts").await, 1);
    ledger.stop().await;
}

/// A Stripe-shaped refunds list the test controls: it lists `refunds`, and while held it keeps
/// every lookup waiting.
#[derive(Clone)]
struct HeldProvider {
    lookups: Arc<AtomicUsize>,
    hold: Arc<watch::Sender<bool>>,
    refunds: Arc<Mutex<Vec<Value>>>,
}

impl HeldProvider {
    /// Starts it, held; returns it and its base URL.
    async fn start() -> (Self, String) {
        let provider = HeldProvider {
            lookups: Arc::default(),
            hold: Arc::new(watch::channel(true).0),
            refunds: Arc::default(),
        };
        let state = provider.clone();
        let router = axum::Router::new().route(
            "/v1/refunds",
            axum::routing::get(move || {
                let state = state.clone();
                async move {
                    state.lookups.fetch_add(1, Ordering::SeqCst);
                    let mut held = state.hold.subscribe();
                    while *held.borrow_and_update() {
                        if held.changed().await.is_err() {
                            break;
                        }
                    }
                    let data = state.refunds.lock().unwrap().clone();
                    axum::Json(json!({"object": "list", "data": data, "has_more": false}))
                }
            }),
        );
        let base = serve(router).await;
        (provider, base)
    }

    fn release(&self) {
        self.hold.send_replace(false);
    }

    /// Claims `id` as a refund, reports it UNKNOWN, and starts a Reconcile RPC whose lookup the
    /// provider holds. Returns the grant and the pending answer.
    async fn unknown_and_looked_up(
        &self,
        client: &mut Grpc,
        id: &str,
    ) -> (pb::Execute, ReconcileAnswer) {
        let grant = claim(client, refund_request(id)).await;
        report_unknown(client, id, grant.fencing_token)
            .await
            .unwrap();
        let before = self.lookups.load(Ordering::SeqCst);
        let answer = reconcile_later(client, id);
        self.wait_for_lookups(before + 1).await;
        (grant, answer)
    }

    async fn wait_for_lookups(&self, n: usize) {
        eventually(
            Duration::from_secs(10),
            "the lookup to reach the provider",
            || async { (self.lookups.load(Ordering::SeqCst) >= n).then_some(()) },
        )
        .await;
    }
}

/// A ledger whose workers never look anything up on their own (only the Reconcile RPC does),
/// with a stripe reconciler on `provider` and a one-second settle time.
async fn held_setup(store: Engine) -> (TestDb, TestLedger, HeldProvider) {
    let db = TestDb::new(store).await;
    let (provider, base) = HeldProvider::start().await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"1h\"\nclaim = \"1m\"\n\n[[reconciler]]\nname = \"stripe\"\n\
             kind = \"stripe\"\nendpoint = \"{base}\"\nsettle_time = \"1s\"\ntimeout = \"20s\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    (db, ledger, provider)
}

fn refund_request(id: &str) -> pb::BeginRequest {
    let mut request = begin(id, ARGS);
    request.lease_ttl = Some(ms(300));
    request.provider = "stripe".into();
    request.lookup_hints_json = r#"{"payment_intent":"pi_held"}"#.into();
    request
}

/// Waits until the database clock is past the moment a miss about `id`'s latest attempt
/// starts to count: its effect horizon plus the one-second settle time.
async fn wait_past_settle_time(db: &TestDb, id: &str) {
    let horizon = db
        .scalar(&format!(
            "SELECT {}(lease_deadline, COALESCE(unknown_since, 0), COALESCE(last_report_at, 0)) \
             FROM operations WHERE operation_id = '{id}'",
            match db.store {
                Engine::Postgres => "GREATEST",
                Engine::Sqlite => "MAX",
            }
        ))
        .await;
    eventually(
        Duration::from_secs(10),
        "the settle time to pass",
        || async { (db.clock().await >= horizon + 1_000).then_some(()) },
    )
    .await;
}

/// A Reconcile RPC's answer, once it comes.
type ReconcileAnswer = tokio::task::JoinHandle<Result<pb::ReconcileResponse, tonic::Status>>;

fn reconcile_later(client: &Grpc, id: &str) -> ReconcileAnswer {
    let mut client = client.clone();
    let operation_id = id.to_owned();
    tokio::spawn(async move {
        client
            .reconcile(pb::ReconcileRequest {
                operation_id,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
    })
}

async fn a_miss_counts_only_when_issued_a_settle_time_after_the_effect_could_last_be_written(
    store: Engine,
) {
    let (db, ledger, provider) = held_setup(store).await;
    let mut client = ledger.client().await;
    // Issued at once; the provider lags and answers "nothing" only after the settle time.
    let (_, early) = provider
        .unknown_and_looked_up(&mut client, "settle-1")
        .await;
    wait_past_settle_time(&db, "settle-1").await;
    provider.release();
    let answer = early.await.unwrap().unwrap();
    assert_eq!(
        (answer.verdict, answer.state),
        (
            pb::OperationState::Absent as i32,
            pb::OperationState::Unknown as i32
        ),
        "a miss from a lookup issued before the settle time proves nothing"
    );
    let history = get(&mut client, "settle-1").await;
    let inconclusive = history.events.last().unwrap();
    assert_eq!(inconclusive.kind, "LOOKUP_INCONCLUSIVE");
    assert!(inconclusive.reason.contains("issued"), "{inconclusive:?}");

    // Issued after the settle time, the same miss settles it.
    let late = reconcile_later(&client, "settle-1").await.unwrap().unwrap();
    assert_eq!(late.state, pb::OperationState::Absent as i32);
    ledger.stop().await;
}

async fn a_verdict_about_an_earlier_attempt_is_never_applied_to_a_later_one(store: Engine) {
    let (db, ledger, provider) = held_setup(store).await;
    let mut client = ledger.client().await;
    let (_, slow) = provider
        .unknown_and_looked_up(&mut client, "judged-1")
        .await;

    // Meanwhile an operator settles attempt 1, and attempt 2 runs and goes UNKNOWN.
    resolve(
        &mut client,
        "judged-1",
        pb::OperationState::Absent,
        "r-judged",
    )
    .await
    .unwrap();
    let second = claim(&mut client, refund_request("judged-1")).await;
    report_unknown(&mut client, "judged-1", second.fencing_token)
        .await
        .unwrap();
    wait_past_settle_time(&db, "judged-1").await;

    // The lookup about attempt 1 finds nothing: true of attempt 1, and no evidence about 2.
    provider.release();
    let answer = slow.await.unwrap().unwrap();
    assert_eq!(answer.state, pb::OperationState::Unknown as i32);
    let history = get(&mut client, "judged-1").await;
    let op = history.operation.as_ref().unwrap();
    assert_eq!(
        (op.state, op.attempt),
        (pb::OperationState::Unknown as i32, 2)
    );
    assert!(
        history
            .events
            .iter()
            .all(|e| e.kind != "RECONCILED" && e.kind != "LOOKUP_INCONCLUSIVE"),
        "the stale verdict wrote nothing: {:?}",
        history.events
    );
    ledger.stop().await;
}

async fn this_lifes_effect_found_after_the_operation_moved_on_still_settles_it(store: Engine) {
    let (_db, ledger, provider) = held_setup(store).await;
    let mut client = ledger.client().await;
    let (grant, slow) = provider.unknown_and_looked_up(&mut client, "found-1").await;
    // The attempt says, late, that it did nothing: ABSENT, and executable again...
    report_absent(&mut client, "found-1", grant.fencing_token)
        .await
        .unwrap();
    // ...but the provider holds this life's refund.
    provider.refunds.lock().unwrap().push(json!({
        "id": "re_found",
        "metadata": {"once_provider_key": grant.provider_key, "once_operation_id": "found-1"},
    }));
    provider.release();
    let answer = slow.await.unwrap().unwrap();
    assert_eq!(answer.state, pb::OperationState::Confirmed as i32);
    let history = get(&mut client, "found-1").await;
    assert_eq!(history.operation.as_ref().unwrap().provider_ref, "re_found");
    assert_eq!(count(&history, "RESOLUTION_CONTRADICTED"), 1);
    let replay = client
        .begin(refund_request("found-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&replay), "REPLAY", "never executed again");
    ledger.stop().await;
}

async fn a_resolution_names_the_attempt_it_examined(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let absent = pb::OperationState::Absent;

    let first = claim(&mut client, begin("examined-1", ARGS)).await;
    report_absent(&mut client, "examined-1", first.fencing_token)
        .await
        .unwrap();
    let second = claim(&mut client, begin("examined-1", ARGS)).await;
    report_unknown(&mut client, "examined-1", second.fencing_token)
        .await
        .unwrap();
    // The operator looked at attempt 1; attempt 2 is the one that is UNKNOWN.
    let refused = resolve_examined(
        &mut client,
        "examined-1",
        absent,
        "r-1",
        first.fencing_token,
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason(&refused), "ATTEMPT_MISMATCH");
    assert!(
        refused.message().contains("latest attempt is 2"),
        "{refused:?}"
    );
    let resolution = |fencing_token, attempt| pb::ResolveRequest {
        operation_id: "examined-1".into(),
        outcome: absent as i32,
        reason: "checked".into(),
        operator: "alice".into(),
        resolution_id: format!("r-{fencing_token}-{attempt}"),
        attempt,
        fencing_token,
        ..Default::default()
    };
    let missing = client.resolve(resolution(0, 2)).await.unwrap_err();
    assert_eq!(field(&missing), "fencing_token");
    let wrong_number = client
        .resolve(resolution(second.fencing_token, 1))
        .await
        .unwrap_err();
    assert_eq!(reason(&wrong_number), "ATTEMPT_MISMATCH");
    client
        .resolve(resolution(second.fencing_token, 2))
        .await
        .unwrap();

    // Across lives: the operator examined attempt 1 of the first life; meanwhile that life was
    // settled and deleted, and attempt 1 of a new life is UNKNOWN.
    let old = claim(&mut client, begin("examined-2", ARGS)).await;
    report_unknown(&mut client, "examined-2", old.fencing_token)
        .await
        .unwrap();
    resolve(&mut client, "examined-2", absent, "r-someone-else")
        .await
        .unwrap();
    delete_as_retention_does(&db, "examined-2").await;
    let new = claim(&mut client, begin("examined-2", ARGS)).await;
    assert_eq!(
        new.attempt, old.attempt,
        "the same attempt number in each life"
    );
    report_unknown(&mut client, "examined-2", new.fencing_token)
        .await
        .unwrap();
    let refused = resolve_examined(
        &mut client,
        "examined-2",
        absent,
        "r-late",
        old.fencing_token,
    )
    .await
    .unwrap_err();
    assert_eq!(reason(&refused), "ATTEMPT_MISMATCH");
    assert_eq!(
        state_of(&mut client, "examined-2").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

async fn a_new_life_is_never_confirmed_by_an_earlier_lifes_refund(store: Engine) {
    use once_client::{ClientConfig, EffectError, LedgerClient as Client, OperationSpec, Outcome};

    let db = TestDb::new(store).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\nfirst_backoff = \"100ms\"\nmax_backoff = \"400ms\"\n\n\
             [[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\nsettle_time = \"0s\"\ntimeout = \"2s\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(
        &db,
        &[
            "--config",
            config.as_str(),
            "--retention-explicit",
            "1ms",
            "--retention-sweep-interval",
            "50ms",
        ],
    )
    .await;
    let client = Client::connect(ClientConfig::new(format!("http://{}", ledger.addr))).unwrap();
    let spec = OperationSpec::new(
        "issue_refund",
        json!({"order_id": "o-lives", "amount_cents": 700, "currency": "eur"}),
    )
    .intent(["refund", "o-lives"])
    .provider("stripe", json!({"payment_intent": "pi_o-lives"}))
    .lease_ttl(Duration::from_millis(300));

    // Life 1 refunds, and its retention passes at once.
    let base = provider.clone();
    let outcome = client
        .run(&spec, |attempt| async move {
            let response = reqwest::Client::new()
                .post(format!("{base}/v1/refunds"))
                .header("Idempotency-Key", &attempt.provider_key)
                .form(&[
                    ("payment_intent", "pi_o-lives".to_owned()),
                    ("amount", "700".into()),
                    ("currency", "eur".into()),
                    ("metadata[once_provider_key]", attempt.provider_key.clone()),
                    ("metadata[once_operation_id]", attempt.operation_id.clone()),
                ])
                .send()
                .await
                .map_err(|e| EffectError::Ambiguous(e.to_string()))?;
            Ok(once_client::Effect::new(
                response.bytes().await.unwrap().to_vec(),
            ))
        })
        .await
        .unwrap();
    let Outcome::Executed { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    // Past its retention: swept (a Begin within the millisecond of its retention replays).
    eventually(Duration::from_secs(10), "life 1 to be swept", || async {
        let rows = db
            .scalar(&format!(
                "SELECT count(*) FROM operations WHERE operation_id = '{operation_id}'"
            ))
            .await;
        (rows == 0).then_some(())
    })
    .await;
    // Life 2 of the same id crashes before it calls the provider.
    let outcome = client
        .run(&spec, |_| async {
            Err::<once_client::Effect, _>(EffectError::Ambiguous("crashed".into()))
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Ambiguous { .. }), "{outcome:?}");
    // Life 1's refund carries the same operation id: it must not settle life 2.
    let grpc = ledger.client().await;
    wait_for_state(&grpc, &operation_id, pb::OperationState::Absent).await;
    ledger.stop().await;
}

async fn a_retried_resolution_gets_its_first_answer_after_the_operation_moved_on(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("retried-1", ARGS)).await;
    report_unknown(&mut client, "retried-1", first.fencing_token)
        .await
        .unwrap();
    let absent = pb::OperationState::Absent as i32;
    let token = first.fencing_token;
    let resolve_first = |client: &mut Grpc, outcome| {
        let mut client = client.clone();
        async move { resolve_examined(&mut client, "retried-1", outcome, "r-once", token).await }
    };
    assert_eq!(
        resolve_first(&mut client, pb::OperationState::Absent)
            .await
            .unwrap(),
        absent
    );
    // The operation moves on: a new attempt confirms.
    let second = claim(&mut client, begin("retried-1", ARGS)).await;
    confirm(&mut client, "retried-1", second.fencing_token, b"ok")
        .await
        .unwrap();
    assert_eq!(
        resolve_first(&mut client, pb::OperationState::Absent)
            .await
            .unwrap(),
        absent,
        "the retry gets the first answer"
    );
    let reused = resolve_first(&mut client, pb::OperationState::Confirmed)
        .await
        .unwrap_err();
    assert_eq!(reason(&reused), "RESOLUTION_ID_REUSED");
    // The same id for another attempt is another resolution.
    let other_attempt = resolve_examined(
        &mut client,
        "retried-1",
        pb::OperationState::Absent,
        "r-once",
        second.fencing_token,
    )
    .await
    .unwrap_err();
    assert_eq!(reason(&other_attempt), "RESOLUTION_ID_REUSED");
    // And after retention deleted it.
    delete_as_retention_does(&db, "retried-1").await;
    assert_eq!(
        resolve_first(&mut client, pb::OperationState::Absent)
            .await
            .unwrap(),
        absent
    );
    ledger.stop().await;
}

async fn reports_are_recorded_under_their_attempts_executor(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let first = claim(&mut client, begin("executor-1", ARGS)).await;
    report_unknown(&mut client, "executor-1", first.fencing_token)
        .await
        .unwrap();
    resolve(&mut client, "executor-1", pb::OperationState::Absent, "r-x")
        .await
        .unwrap();
    let mut other = begin("executor-1", ARGS);
    other.context.as_mut().unwrap().client_name = "billing-mcp".into();
    let second = claim(&mut client, other).await;
    report_absent(&mut client, "executor-1", second.fencing_token)
        .await
        .unwrap();
    confirm(&mut client, "executor-1", first.fencing_token, b"late")
        .await
        .unwrap_err();
    let history = get(&mut client, "executor-1").await;
    let actors: Vec<(&str, &str)> = history
        .events
        .iter()
        .map(|e| (e.kind.as_str(), e.actor.as_str()))
        .collect();
    assert_eq!(
        actors,
        [
            ("CLAIMED", "executor:it"),
            ("REPORTED_UNKNOWN", "executor:it"),
            ("RESOLVED", "operator:alice"),
            ("CLAIMED", "executor:billing-mcp"),
            ("REPORTED_ABSENT", "executor:billing-mcp"),
            ("CONFIRMED", "executor:it"),
            ("RESOLUTION_CONTRADICTED", "executor:it"),
        ]
    );
    ledger.stop().await;
}
