//! Reconciliation: UNKNOWN operations settled from provider truth by the `stripe` reconciler,
//! against fakepay on a real socket.

use std::time::Duration;

use once_api::pb;
use once_client::{ClientConfig, Effect, EffectError, LedgerClient, OperationSpec, Outcome};
use serde_json::json;

use crate::support::*;

on_both_backends!(
    a_lost_response_is_reconciled_confirmed_and_replayed,
    a_refusal_without_effect_is_reconciled_absent_after_the_settle_time,
    unavailable_lookups_keep_it_unknown_with_growing_intervals,
    a_lagging_list_never_produces_absent_before_the_settle_time,
);

struct Setup {
    _db: TestDb,
    ledger: TestLedger,
    provider: String,
    client: LedgerClient,
}

async fn setup(store: Engine, settle_time: &str) -> Setup {
    setup_with(store, settle_time, "50ms").await
}

fn reconciler_config(provider: &str, settle_time: &str, interval: &str, extra: &str) -> String {
    format!(
        "[reconciliation]\ninterval = \"{interval}\"\nfirst_backoff = \"100ms\"\nmax_backoff = \"400ms\"\n\n\
         [[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\nsettle_time = \"{settle_time}\"\ntimeout = \"2s\"\n{extra}"
    )
}

async fn setup_with(store: Engine, settle_time: &str, interval: &str) -> Setup {
    let db = TestDb::new(store).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let config = config_file(&db, reconciler_config(&provider, settle_time, interval, ""));
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut config = ClientConfig::new(format!("http://{}", ledger.addr));
    config.client_name = "reconcile-test".into();
    let client = LedgerClient::connect(config).unwrap();
    Setup {
        _db: db,
        ledger,
        provider,
        client,
    }
}

/// A refund with a short lease: a miss proves nothing until the settle time has passed since
/// the lease deadline, and these tests should not wait for a long one.
fn refund(order: &str) -> OperationSpec {
    OperationSpec::new(
        "issue_refund",
        json!({"order_id": order, "amount_cents": 700, "currency": "eur"}),
    )
    .intent(["refund", order])
    .provider("stripe", json!({"payment_intent": format!("pi_{order}")}))
    .lease_ttl(Duration::from_millis(300))
}

/// The refund effect, as the demo server performs it, with a fault for this one request.
async fn run_refund(setup: &Setup, order: &str, fault: Option<&'static str>) -> Outcome {
    let provider = setup.provider.clone();
    let order = order.to_owned();
    setup
        .client
        .run(&refund(&order), |attempt| async move {
            let mut request = reqwest::Client::new()
                .post(format!("{provider}/v1/refunds"))
                .header("Idempotency-Key", &attempt.provider_key)
                .form(&[
                    ("payment_intent", format!("pi_{order}")),
                    ("amount", "700".into()),
                    ("currency", "eur".into()),
                    ("metadata[once_provider_key]", attempt.provider_key.clone()),
                    ("metadata[once_operation_id]", attempt.operation_id.clone()),
                ]);
            if let Some(fault) = fault {
                request = request.header("X-Fakepay-Fault", fault);
            }
            let response = request
                .send()
                .await
                .map_err(|e| EffectError::Ambiguous(e.to_string()))?;
            if !response.status().is_success() {
                return Err(EffectError::Ambiguous(format!(
                    "provider answered {}",
                    response.status()
                )));
            }
            let body = response
                .bytes()
                .await
                .map_err(|e| EffectError::Ambiguous(e.to_string()))?;
            Ok(Effect::new(body.to_vec()))
        })
        .await
        .unwrap()
}

async fn refunds(setup: &Setup) -> u64 {
    fakepay_stats(&setup.provider).await["refunds"]
        .as_u64()
        .unwrap()
}

async fn set_faults(setup: &Setup, faults: serde_json::Value) {
    reqwest::Client::new()
        .post(format!("{}/_fakepay/faults", setup.provider))
        .json(&faults)
        .send()
        .await
        .unwrap();
}

async fn a_lost_response_is_reconciled_confirmed_and_replayed(store: Engine) {
    let setup = setup(store, "200ms").await;
    let outcome = run_refund(&setup, "o-1", Some("commit_then_drop")).await;
    let Outcome::Ambiguous { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let grpc = setup.ledger.client().await;
    wait_for_state(&grpc, &operation_id, pb::OperationState::Confirmed).await;

    let history = get(&mut grpc.clone(), &operation_id).await;
    let settled = history.events.last().unwrap();
    assert_eq!(
        (settled.kind.as_str(), settled.actor.as_str()),
        ("RECONCILED", "reconciler:stripe")
    );
    assert!(settled.details_json.contains("evidence"), "{settled:?}");
    let replay = run_refund(&setup, "o-1", None).await;
    let Outcome::Replayed(replay) = replay else {
        panic!("{replay:?}")
    };
    let refund: serde_json::Value = serde_json::from_slice(&replay.result).unwrap();
    assert_eq!(
        refund["metadata"]["once_operation_id"],
        operation_id.as_str()
    );
    assert_eq!(replay.provider_ref.as_deref(), refund["id"].as_str());
    assert_eq!(refunds(&setup).await, 1);
    setup.ledger.stop().await;
}

async fn a_refusal_without_effect_is_reconciled_absent_after_the_settle_time(store: Engine) {
    let setup = setup(store, "300ms").await;
    let outcome = run_refund(&setup, "o-2", Some("fail_before_commit")).await;
    let Outcome::Ambiguous { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let grpc = setup.ledger.client().await;
    wait_for_state(&grpc, &operation_id, pb::OperationState::Absent).await;
    let history = get(&mut grpc.clone(), &operation_id).await;
    let absent = history.events.last().unwrap();
    assert_eq!(
        (absent.kind.as_str(), absent.to_state),
        ("RECONCILED", pb::OperationState::Absent as i32)
    );
    // The next call executes, exactly once.
    let outcome = run_refund(&setup, "o-2", None).await;
    assert!(matches!(outcome, Outcome::Executed { .. }), "{outcome:?}");
    assert_eq!(refunds(&setup).await, 1);
    setup.ledger.stop().await;
}

async fn unavailable_lookups_keep_it_unknown_with_growing_intervals(store: Engine) {
    let setup = setup(store, "0s").await;
    set_faults(&setup, json!({ "lookups_unavailable": true })).await;
    let outcome = run_refund(&setup, "o-3", Some("commit_then_drop")).await;
    let Outcome::Ambiguous { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let mut grpc = setup.ledger.client().await;
    let events = eventually(Duration::from_secs(15), "four inconclusive lookups", || {
        let mut grpc = grpc.clone();
        let id = operation_id.clone();
        async move {
            let events: Vec<pb::Event> = get(&mut grpc, &id)
                .await
                .events
                .into_iter()
                .filter(|e| e.kind == "LOOKUP_INCONCLUSIVE")
                .collect();
            (events.len() >= 4).then_some(events)
        }
    })
    .await;
    assert_eq!(
        state_of(&mut grpc, &operation_id).await,
        pb::OperationState::Unknown
    );
    let at: Vec<i64> = events
        .iter()
        .map(|e| once_api::convert::millis(e.at.as_ref().unwrap()))
        .collect();
    let scheduled: Vec<i64> = events
        .iter()
        .map(|e| {
            serde_json::from_str::<serde_json::Value>(&e.details_json).unwrap()["next_lookup_at"]
                .as_i64()
                .unwrap()
        })
        .collect();
    let gaps: Vec<i64> = scheduled
        .iter()
        .zip(&at)
        .map(|(next, at)| next - at)
        .collect();
    assert!(
        gaps[1] > gaps[0] && gaps[2] > gaps[1],
        "intervals grow: {gaps:?}"
    );
    assert!(gaps.iter().all(|g| *g <= 400), "and are capped: {gaps:?}");
    assert!(
        events[0].reason.contains("could not tell"),
        "{:?}",
        events[0]
    );
    set_faults(&setup, json!({})).await;
    wait_for_state(&grpc, &operation_id, pb::OperationState::Confirmed).await;
    setup.ledger.stop().await;
}

async fn a_lagging_list_never_produces_absent_before_the_settle_time(store: Engine) {
    // The list shows a refund a second after it is written; the reconciler's settle time is
    // longer than that, so early misses must not settle anything.
    let setup = setup(store, "2s").await;
    set_faults(&setup, json!({ "list_lag_ms": 1000 })).await;
    let outcome = run_refund(&setup, "o-4", Some("commit_then_drop")).await;
    let Outcome::Ambiguous { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let mut grpc = setup.ledger.client().await;
    wait_for_state(&grpc, &operation_id, pb::OperationState::Confirmed).await;
    let history = get(&mut grpc, &operation_id).await;
    assert!(
        history
            .events
            .iter()
            .all(|e| e.to_state != pb::OperationState::Absent as i32),
        "{:?}",
        history.events
    );
    assert!(
        history
            .events
            .iter()
            .any(|e| e.kind == "LOOKUP_INCONCLUSIVE" && e.reason.contains("settle time")),
        "early misses were held back: {:?}",
        history.events
    );
    setup.ledger.stop().await;
}

on_both_backends!(replicas_never_claim_one_operation_at_once);

/// Four replicas' workers race for the same due operations: each is claimed exactly once.
async fn replicas_never_claim_one_operation_at_once(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut grpc = ledger.client().await;
    for i in 0..20 {
        let id = format!("claim-{i}");
        let mut request = begin(&id, ARGS);
        request.provider = "stripe".into();
        let grant = claim(&mut grpc, request).await;
        report_unknown(&mut grpc, &id, grant.fencing_token)
            .await
            .unwrap();
    }
    ledger.stop().await;

    async fn claims(url: String, store: Engine) -> Vec<String> {
        let claimed = match store {
            Engine::Sqlite => {
                let ledger = once_store::Ledger::new(
                    once_store::SqliteBackend::connect(&url).await.unwrap(),
                );
                ledger
                    .claim_lookups(50, 60_000, &[("default", "stripe")])
                    .await
                    .unwrap()
            }
            Engine::Postgres => {
                let backend = once_store::PgBackend::connect(&url, &Default::default())
                    .await
                    .unwrap();
                once_store::Ledger::new(backend)
                    .claim_lookups(50, 60_000, &[("default", "stripe")])
                    .await
                    .unwrap()
            }
        };
        claimed
            .into_iter()
            .map(|(op, _)| op.operation_id.to_string())
            .collect()
    }
    let rounds = futures::future::join_all((0..4).map(|_| claims(db.url.clone(), store))).await;
    let mut all: Vec<String> = rounds.into_iter().flatten().collect();
    assert_eq!(all.len(), 20, "every due operation claimed once: {all:?}");
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 20, "no operation claimed twice");
}

on_both_backends!(reconcile_rpc_looks_up_now);

async fn reconcile_rpc_looks_up_now(store: Engine) {
    // The workers wait an hour: only the RPC looks anything up.
    let setup = setup_with(store, "0s", "1h").await;
    let outcome = run_refund(&setup, "o-5", Some("commit_then_drop")).await;
    let Outcome::Ambiguous { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let mut grpc = setup.ledger.client().await;
    let answer = grpc
        .reconcile(pb::ReconcileRequest {
            operation_id: operation_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.reconciler, "stripe");
    assert_eq!(
        (answer.verdict, answer.state),
        (
            pb::OperationState::Confirmed as i32,
            pb::OperationState::Confirmed as i32
        )
    );
    let again = grpc
        .reconcile(pb::ReconcileRequest {
            operation_id: operation_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&again), "NOT_UNKNOWN");

    let grant = claim(&mut grpc, begin("no-provider", ARGS)).await;
    report_unknown(&mut grpc, "no-provider", grant.fencing_token)
        .await
        .unwrap();
    let refused = grpc
        .reconcile(pb::ReconcileRequest {
            operation_id: "no-provider".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        (refused.code(), reason(&refused)),
        (tonic::Code::FailedPrecondition, "NO_RECONCILER".to_owned())
    );
    setup.ledger.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_never_reach_logs_or_events() {
    let db = TestDb::new(Engine::Sqlite).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let secret = format!("sk_test_{}", uuid::Uuid::new_v4().simple());
    let config = config_file(
        &db,
        reconciler_config(
            &provider,
            "0s",
            "50ms",
            "api_key_env = \"ONCE_IT_STRIPE_KEY\"\n",
        ),
    );
    let log = db.scratch_dir().join("onced-secret.log");
    let onced = OncedProcess::spawn_with_env(
        &db.url,
        log.clone(),
        &["--config", config.as_str()],
        &[
            ("ONCE_IT_STRIPE_KEY", secret.as_str()),
            ("RUST_LOG", "debug"),
        ],
    )
    .await;
    let mut grpc = onced.client().await;
    let mut request = begin("secret-op", ARGS);
    request.lease_ttl = Some(ms(200));
    request.provider = "stripe".into();
    request.lookup_hints_json = r#"{"payment_intent":"pi_secret"}"#.into();
    let grant = claim(&mut grpc, request).await;
    report_unknown(&mut grpc, "secret-op", grant.fencing_token)
        .await
        .unwrap();
    // A miss after a zero settle time with a deduplicating provider: ABSENT, after lookups.
    wait_for_state(&grpc, "secret-op", pb::OperationState::Absent).await;
    let history = get(&mut grpc, "secret-op").await;
    assert!(onced.terminate().await.success());
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("reconciliation on"), "the log was captured");
    assert!(
        !logged.contains(&secret),
        "the credential appeared in the log"
    );
    assert!(
        !format!("{history:?}").contains(&secret),
        "the credential appeared in the events"
    );
}

on_both_backends!(an_operation_that_stays_unknown_is_escalated_once_and_posted);

async fn an_operation_that_stays_unknown_is_escalated_once_and_posted(store: Engine) {
    use std::sync::{Arc, Mutex};

    // The webhook receiver refuses the first delivery, so the ledger must retry.
    let received: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
    let receiver = {
        let received = received.clone();
        axum::Router::new().route(
            "/hook",
            axum::routing::post(move |axum::Json(body): axum::Json<serde_json::Value>| {
                let received = received.clone();
                async move {
                    let mut received = received.lock().unwrap();
                    received.push(body);
                    if received.len() == 1 {
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        axum::http::StatusCode::OK
                    }
                }
            }),
        )
    };
    let hook = format!("{}/hook", serve(receiver).await);

    let db = TestDb::new(store).await;
    let payments = fakepay::Provider::default();
    payments.set_faults(fakepay::Faults {
        lookups_unavailable: true,
        ..Default::default()
    });
    let provider = serve(fakepay::router(payments)).await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\nfirst_backoff = \"50ms\"\nmax_backoff = \"100ms\"\n\
             escalate_after_lookups = 3\nwebhook = \"{hook}\"\n\n\
             [[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut grpc = ledger.client().await;
    let mut request = begin("escalate-me", ARGS);
    request.provider = "stripe".into();
    request.lookup_hints_json = r#"{"payment_intent":"pi_x"}"#.into();
    let grant = claim(&mut grpc, request).await;
    report_unknown(&mut grpc, "escalate-me", grant.fencing_token)
        .await
        .unwrap();

    eventually(
        Duration::from_secs(15),
        "the escalation delivered, after a retry",
        || async { (received.lock().unwrap().len() >= 2).then_some(()) },
    )
    .await;
    // Further lookups do not escalate again.
    eventually(Duration::from_secs(15), "six lookups", || {
        let mut grpc = grpc.clone();
        async move {
            let events = get(&mut grpc, "escalate-me").await.events;
            (events
                .iter()
                .filter(|e| e.kind == "LOOKUP_INCONCLUSIVE")
                .count()
                >= 6)
                .then_some(events)
        }
    })
    .await;
    let events = get(&mut grpc, "escalate-me").await.events;
    let escalations: Vec<&pb::Event> = events.iter().filter(|e| e.kind == "ESCALATED").collect();
    assert_eq!(escalations.len(), 1, "{events:?}");
    let delivered = received.lock().unwrap().clone();
    assert_eq!(
        delivered.len(),
        2,
        "one escalation: refused once, then delivered"
    );
    assert_eq!(delivered[1]["operation_id"], "escalate-me");
    assert_eq!(delivered[1]["lookups"], 3);
    assert_eq!(
        state_of(&mut grpc, "escalate-me").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

on_both_backends!(a_begin_that_may_wait_reconciles_synchronously);

async fn a_begin_that_may_wait_reconciles_synchronously(store: Engine) {
    // The workers wait an hour: only the Begin's own lookup can settle the operation.
    let setup = setup_with(store, "0s", "1h").await;
    let outcome = run_refund(&setup, "o-6", Some("commit_then_drop")).await;
    assert!(matches!(outcome, Outcome::Ambiguous { .. }), "{outcome:?}");
    let impatient = setup
        .client
        .run(&refund("o-6"), |_| async { panic!("must not run") })
        .await
        .unwrap();
    assert!(
        matches!(impatient, Outcome::Unknown(_)),
        "no wait, no lookup: {impatient:?}"
    );
    let patient = setup
        .client
        .run(&refund("o-6").wait(Duration::from_secs(5)), |_| async {
            panic!("must not run")
        })
        .await
        .unwrap();
    let Outcome::Replayed(replay) = patient else {
        panic!("{patient:?}")
    };
    assert!(replay.provider_ref.is_some());
    assert_eq!(refunds(&setup).await, 1);
    setup.ledger.stop().await;
}

on_both_backends!(the_http_kind_resolves_from_a_configured_lookup);

async fn the_http_kind_resolves_from_a_configured_lookup(store: Engine) {
    use axum::extract::Query;
    use std::collections::HashMap;

    // A ticket system that knows one request key.
    let tickets = axum::Router::new().route(
        "/v2/tickets",
        axum::routing::get(|Query(query): Query<HashMap<String, String>>| async move {
            match query.get("customer").map(String::as_str) {
                Some("c-known") => (
                    axum::http::StatusCode::OK,
                    axum::Json(json!({"ticket": {"id": "T-17", "state": "open"}})),
                ),
                // A record over the 64 KiB result limit.
                Some("c-huge") => (
                    axum::http::StatusCode::OK,
                    axum::Json(json!({"ticket": {"id": "T-18", "log": "x".repeat(100 * 1024)}})),
                ),
                _ => (
                    axum::http::StatusCode::NOT_FOUND,
                    axum::Json(json!({"error": "no such ticket"})),
                ),
            }
        }),
    );
    let endpoint = serve(tickets).await;

    let db = TestDb::new(store).await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\n\n[[reconciler]]\nname = \"tickets\"\nkind = \"http\"\n\
             endpoint = \"{endpoint}\"\nurl = \"{{endpoint}}/v2/tickets?key={{provider_key}}&customer={{hints.customer}}\"\n\
             provider_ref_pointer = \"/ticket/id\"\nresult_pointer = \"/ticket\"\nmiss_is_authoritative = true\n\
             dedupes_by_provider_key = true\nsettle_time = \"0s\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut grpc = ledger.client().await;
    for (id, customer) in [
        ("ticket-found", "c-known"),
        ("ticket-missing", "c-other"),
        ("ticket-huge", "c-huge"),
    ] {
        let mut request = begin(id, ARGS);
        request.lease_ttl = Some(ms(200));
        request.tool = "open_ticket".into();
        request.provider = "tickets".into();
        request.lookup_hints_json = json!({ "customer": customer }).to_string();
        let grant = claim(&mut grpc, request).await;
        report_unknown(&mut grpc, id, grant.fencing_token)
            .await
            .unwrap();
    }
    wait_for_state(&grpc, "ticket-found", pb::OperationState::Confirmed).await;
    wait_for_state(&grpc, "ticket-missing", pb::OperationState::Absent).await;
    let found = get(&mut grpc, "ticket-found").await.operation.unwrap();
    assert_eq!(found.provider_ref, "T-17");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&found.result).unwrap(),
        json!({"id": "T-17", "state": "open"})
    );
    // Over the result limit: CONFIRMED all the same, with a reference instead of the record.
    wait_for_state(&grpc, "ticket-huge", pb::OperationState::Confirmed).await;
    let huge = get(&mut grpc, "ticket-huge").await.operation.unwrap();
    assert_eq!(huge.provider_ref, "T-18");
    let stored: serde_json::Value = serde_json::from_slice(&huge.result).unwrap();
    assert_eq!(stored["provider_ref"], "T-18");
    assert!(stored["result_omitted"].is_string(), "{stored}");
    ledger.stop().await;
}

on_both_backends!(two_replicas_look_each_operation_up_once);

/// Two `onced` processes on one database, each running its reconciliation worker: with a
/// backoff of an hour after a lookup, each UNKNOWN operation must be looked up exactly once in
/// all — twice would mean the replicas overlapped.
async fn two_replicas_look_each_operation_up_once(store: Engine) {
    let db = TestDb::new(store).await;
    let payments = fakepay::Provider::default();
    payments.set_faults(fakepay::Faults {
        lookups_unavailable: true,
        delay_ms: 100,
        ..Default::default()
    });
    let counted = payments.clone();
    let provider = serve(fakepay::router(payments)).await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"20ms\"\nfirst_backoff = \"1h\"\nmax_backoff = \"1h\"\nclaim = \"1m\"\n\n\
             [[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\n"
        ),
    );
    let flags = ["--config", config.as_str()];
    let logs = db.scratch_dir();
    let replicas = futures::future::join_all((0..2).map(|i| {
        let log = logs.join(format!("replica-{i}-{}.log", uuid::Uuid::new_v4().simple()));
        OncedProcess::spawn(&db.url, log, &flags)
    }))
    .await;
    let mut clients = Vec::new();
    for replica in &replicas {
        clients.push(replica.client().await);
    }
    let operations = 12;
    for i in 0..operations {
        let id = format!("replicated-{i}");
        let client = &mut clients[i % 2];
        let mut request = begin(&id, ARGS);
        request.provider = "stripe".into();
        request.lookup_hints_json = r#"{"payment_intent":"pi_r"}"#.into();
        let grant = claim(client, request).await;
        report_unknown(client, &id, grant.fencing_token)
            .await
            .unwrap();
    }
    let mut grpc = clients[0].clone();
    eventually(Duration::from_secs(20), "every operation looked up", || {
        let mut grpc = grpc.clone();
        async move {
            for i in 0..operations {
                let events = get(&mut grpc, &format!("replicated-{i}")).await.events;
                if !events.iter().any(|e| e.kind == "LOOKUP_INCONCLUSIVE") {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    // Every verdict is in and every operation waits an hour: no further lookup can start, so
    // the count is final.
    waiting_an_hour(&db, operations).await;
    assert_eq!(
        counted.stats().lookups,
        operations,
        "one lookup per operation across both replicas"
    );
    for i in 0..operations {
        let events = get(&mut grpc, &format!("replicated-{i}")).await.events;
        assert_eq!(
            events
                .iter()
                .filter(|e| e.kind == "LOOKUP_INCONCLUSIVE")
                .count(),
            1
        );
    }
    for replica in replicas {
        assert!(replica.terminate().await.success());
    }
}

/// The stripe reconciler against a provider that misbehaves in each way a lookup can: none of
/// them is ever a miss.
#[tokio::test]
async fn stripe_lookups_that_cannot_tell_are_unknown_never_absent() {
    use once_reconcile::stripe::StripeReconciler;
    use once_reconcile::{LookupRequest, Reconciler, Verdict};

    let provider = axum::Router::new().route(
        "/v1/refunds",
        axum::routing::get(|axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>| async move {
            let refund = |id: &str| json!({"id": id, "metadata": {"once_provider_key": "once_k", "once_operation_id": "op-1"}});
            let page = |data: Vec<serde_json::Value>, has_more: bool| json!({"object": "list", "data": data, "has_more": has_more});
            let (status, body) = match q["payment_intent"].as_str() {
                "pi_forbidden" => (403, json!({"error": {"message": "bad key"}})),
                "pi_throttled" => (429, json!({"error": {"message": "slow down"}})),
                "pi_twice" => (200, page(vec![refund("re_1"), refund("re_2")], false)),
                // The first page is fine; the next one fails.
                "pi_partial" if q.contains_key("starting_after") => (500, json!({})),
                "pi_partial" => (200, page(vec![json!({"id": "re_9", "metadata": {}})], true)),
                "pi_once" => (200, page(vec![refund("re_1")], false)),
                // An earlier life of the same operation id: its refund is not this life's.
                "pi_earlier_life" => (200, page(vec![json!({"id": "re_0", "metadata": {"once_provider_key": "once_old", "once_operation_id": "op-1"}})], false)),
                // A refund that names the operation but no life cannot be attributed.
                "pi_unattributed" => (200, page(vec![json!({"id": "re_0", "metadata": {"once_operation_id": "op-1"}})], false)),
                _ => (200, page(vec![], false)),
            };
            (axum::http::StatusCode::from_u16(status).unwrap(), axum::Json(body))
        }),
    );
    let base = serve(provider).await;
    let stripe = StripeReconciler::new(
        &base,
        Some("sk_test_x".into()),
        Duration::ZERO,
        Duration::from_secs(2),
    )
    .unwrap();
    let lookup = |payment_intent: &str| LookupRequest {
        tenant: "default".into(),
        operation_id: "op-1".into(),
        tool: "issue_refund".into(),
        provider_key: "once_k".into(),
        lookup_hints: json!({ "payment_intent": payment_intent }),
        attempt: 1,
        fencing_token: 1,
        attempt_started_at_ms: 0,
    };
    for (payment_intent, expected) in [
        ("pi_forbidden", "credentials"),
        ("pi_throttled", "rate limiting"),
        ("pi_twice", "2 refunds"),
        ("pi_partial", "partial listing"),
        ("pi_unattributed", "no provider key"),
    ] {
        match stripe.lookup(&lookup(payment_intent)).await {
            Verdict::Unknown { why } => assert!(why.contains(expected), "{payment_intent}: {why}"),
            other => panic!("{payment_intent}: expected unknown, got {other:?}"),
        }
    }
    let mut no_hint = lookup("x");
    no_hint.lookup_hints = json!({});
    assert!(matches!(
        stripe.lookup(&no_hint).await,
        Verdict::Unknown { .. }
    ));
    assert!(
        matches!(stripe.lookup(&lookup("pi_once")).await, Verdict::Confirmed { ref provider_ref, .. } if provider_ref == "re_1")
    );
    assert!(matches!(
        stripe.lookup(&lookup("pi_none")).await,
        Verdict::Absent { .. }
    ));
    assert!(
        matches!(
            stripe.lookup(&lookup("pi_earlier_life")).await,
            Verdict::Absent { .. }
        ),
        "an earlier life's refund never confirms this life"
    );
}

/// Waits until `n` operations have had one lookup each and wait at least half an hour for the
/// next, with no claim outstanding: from then on no lookup can start.
async fn waiting_an_hour(db: &TestDb, n: usize) {
    let clock = match db.store {
        Engine::Postgres => "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
        Engine::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    };
    let sql = format!(
        "SELECT count(*) FROM operations WHERE reconcile_lookups = 1 AND lookup_claimed_until IS NULL \
         AND reconcile_next_at > {clock} + 1800000"
    );
    eventually(
        Duration::from_secs(30),
        "every lookup judged and the next an hour away",
        || async { (db.scalar(&sql).await == n as i64).then_some(()) },
    )
    .await;
}

/// A provider whose lookups are slow and inconclusive, and a reconciliation that waits an hour
/// after an inconclusive lookup, claims for 2 s and gives a lookup 1 s.
async fn slow_provider(db: &TestDb, interval: &str, extra: &str) -> (fakepay::Provider, String) {
    let payments = fakepay::Provider::default();
    payments.set_faults(fakepay::Faults {
        lookups_unavailable: true,
        delay_ms: 300,
        ..Default::default()
    });
    let provider = serve(fakepay::router(payments.clone())).await;
    let config = config_file(
        db,
        format!(
            "[reconciliation]\ninterval = \"{interval}\"\nfirst_backoff = \"1h\"\nmax_backoff = \"1h\"\nclaim = \"2s\"\n{extra}\n\
             [[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\ntimeout = \"1s\"\n"
        ),
    );
    (payments, config)
}

async fn unknown_with_provider(client: &mut Grpc, id: &str) {
    let mut request = begin(id, ARGS);
    request.provider = "stripe".into();
    request.lookup_hints_json = r#"{"payment_intent":"pi_slow"}"#.into();
    let grant = claim(client, request).await;
    report_unknown(client, id, grant.fencing_token)
        .await
        .unwrap();
}

on_both_backends!(
    a_round_claims_no_more_than_it_can_look_up_before_the_claims_lapse,
    a_storm_of_waiting_begins_is_one_lookup,
);

/// Two replicas, 24 due operations, lookups of 300 ms and claims of 2 s. A replica that claimed
/// them all and looked them up one by one would hold claims for 7 s: the other replica would
/// take the lapsed ones and look them up a second time.
async fn a_round_claims_no_more_than_it_can_look_up_before_the_claims_lapse(store: Engine) {
    let db = TestDb::new(store).await;
    let (payments, config) = slow_provider(&db, "20ms", "").await;
    let flags = ["--config", config.as_str()];
    let replicas = [
        TestLedger::spawn_with(&db, &flags).await,
        TestLedger::spawn_with(&db, &flags).await,
    ];
    let mut client = replicas[0].client().await;
    let operations = 24;
    for i in 0..operations {
        unknown_with_provider(&mut client, &format!("round-{i}")).await;
    }
    waiting_an_hour(&db, operations).await;
    assert_eq!(payments.stats().lookups, operations, "one lookup each");
    for replica in replicas {
        replica.stop().await;
    }
}

/// A model retrying an UNKNOWN call over and over, each Begin willing to wait: the first one
/// due looks the operation up; the rest honour the backoff and the claim. Nothing escalates.
async fn a_storm_of_waiting_begins_is_one_lookup(store: Engine) {
    let db = TestDb::new(store).await;
    let (payments, config) = slow_provider(&db, "1h", "escalate_after_lookups = 2").await;
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut client = ledger.client().await;
    unknown_with_provider(&mut client, "storm-1").await;
    let begins = (0..20).map(|_| {
        let mut client = client.clone();
        let mut request = begin("storm-1", ARGS);
        request.provider = "stripe".into();
        request.lookup_hints_json = r#"{"payment_intent":"pi_slow"}"#.into();
        request.wait = Some(ms(3_000));
        async move { client.begin(request).await.unwrap().into_inner() }
    });
    for response in futures::future::join_all(begins).await {
        assert_eq!(decision_name(&response), "UNKNOWN", "{response:?}");
    }
    waiting_an_hour(&db, 1).await;
    assert_eq!(payments.stats().lookups, 1);
    let history = get(&mut client, "storm-1").await;
    assert!(
        history.events.iter().all(|e| e.kind != "ESCALATED"),
        "{:?}",
        history.events
    );
    ledger.stop().await;
}

on_both_backends!(
    a_lookup_finding_another_object_of_a_confirmed_operation_records_double_execution
);

/// A lookup is under way when the attempt's late Confirm settles the operation with another
/// provider object than the one the lookup then finds: two effects. The truth on record (the
/// attempt's) is kept, and the second object is recorded as DOUBLE_EXECUTION, not dropped.
async fn a_lookup_finding_another_object_of_a_confirmed_operation_records_double_execution(
    store: Engine,
) {
    // The workers wait an hour: only the RPC looks anything up.
    let setup = setup_with(store, "0s", "1h").await;
    let outcome = run_refund(&setup, "o-dx", Some("commit_then_drop")).await;
    let Outcome::Ambiguous { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let mut grpc = setup.ledger.client().await;
    let token = get(&mut grpc, &operation_id)
        .await
        .operation
        .unwrap()
        .fencing_token;
    // Lookups take 1.5 s (the reconciler gives them 2 s).
    set_faults(&setup, json!({ "delay_ms": 1500 })).await;
    let reconcile = tokio::spawn({
        let mut grpc = grpc.clone();
        let operation_id = operation_id.clone();
        async move {
            grpc.reconcile(pb::ReconcileRequest {
                operation_id,
                ..Default::default()
            })
            .await
            .map(tonic::Response::into_inner)
        }
    });
    let lookups = || async {
        fakepay_stats(&setup.provider).await["lookups"]
            .as_u64()
            .unwrap()
    };
    eventually(
        Duration::from_secs(10),
        "the lookup to be under way",
        || async { (lookups().await >= 1).then_some(()) },
    )
    .await;
    grpc.confirm(pb::ConfirmRequest {
        operation_id: operation_id.clone(),
        fencing_token: token,
        result: b"{}".to_vec(),
        provider_ref: "re_other".into(),
    })
    .await
    .expect("the late confirm settles it");
    let answer = within(Duration::from_secs(10), "the lookup to end", reconcile)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (answer.verdict, answer.state),
        (
            pb::OperationState::Confirmed as i32,
            pb::OperationState::Confirmed as i32
        )
    );
    let history = get(&mut grpc, &operation_id).await;
    assert_eq!(
        history.operation.unwrap().provider_ref,
        "re_other",
        "the truth on record stays"
    );
    let kinds: Vec<&str> = history.events.iter().map(|e| e.kind.as_str()).collect();
    let confirmed = kinds.iter().position(|k| *k == "CONFIRMED");
    let doubled = kinds.iter().position(|k| *k == "DOUBLE_EXECUTION");
    assert!(
        matches!((confirmed, doubled), (Some(c), Some(d)) if c < d),
        "{kinds:?}"
    );
    let reason = &history.events[doubled.unwrap()].reason;
    assert!(
        reason.contains("re_other") && reason.contains("re_"),
        "{reason}"
    );
    setup.ledger.stop().await;
}

on_both_backends!(the_sql_kind_settles_a_local_effect_from_its_marker);

/// An effect that is a write to the executor's own database: its marker committed with it is
/// CONFIRMED with the result stored beside it; no marker is ABSENT, and the attempt is fenced
/// so that its marker can no longer be written.
async fn the_sql_kind_settles_a_local_effect_from_its_marker(store: Engine) {
    let db = TestDb::new(store).await;
    // The executor's own database, of the same kind.
    let app = TestDb::new(store).await;
    if let Some(file) = app.url.strip_prefix("sqlite://") {
        std::fs::File::create(file).unwrap();
    }
    app.execute("CREATE TABLE bookings (slot TEXT PRIMARY KEY, who TEXT NOT NULL)")
        .await;
    app.execute(&once_reconcile::sql::create_table(
        "once_effects",
        store == Engine::Postgres,
    ))
    .await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\n\n[[reconciler]]\nname = \"bookings\"\nkind = \"sql\"\n\
             endpoint = \"{}\"\ntable = \"once_effects\"\n",
            app.url
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut grpc = ledger.client().await;
    let mut grants = Vec::new();
    for id in ["booked", "rolled-back"] {
        let mut request = begin(id, ARGS);
        request.lease_ttl = Some(ms(200));
        request.tool = "book_slot".into();
        request.provider = "bookings".into();
        grants.push(claim(&mut grpc, request).await);
    }
    // The booking and its marker committed; the answer lost.
    let blob = match store {
        Engine::Postgres => "'\\x7b22736c6f74223a226d6f6e2d39227d'::bytea",
        Engine::Sqlite => "X'7b22736c6f74223a226d6f6e2d39227d'",
    };
    app.execute("INSERT INTO bookings (slot, who) VALUES ('mon-9', 'booked')")
        .await;
    app.execute(&format!(
        "INSERT INTO once_effects (provider_key, operation_id, fencing_token, state, result, provider_ref, at) \
         VALUES ('{}', 'booked', {}, 'done', {blob}, 'booking-mon-9', 0)",
        grants[0].provider_key, grants[0].fencing_token
    ))
    .await;
    // The other's transaction rolled back: nothing of it is there.
    for (id, grant) in ["booked", "rolled-back"].iter().zip(&grants) {
        report_unknown(&mut grpc, id, grant.fencing_token)
            .await
            .unwrap();
    }
    wait_for_state(&grpc, "booked", pb::OperationState::Confirmed).await;
    wait_for_state(&grpc, "rolled-back", pb::OperationState::Absent).await;
    let booked = get(&mut grpc, "booked").await.operation.unwrap();
    assert_eq!(booked.provider_ref, "booking-mon-9");
    assert_eq!(booked.result, br#"{"slot":"mon-9"}"#);
    // The lookup fenced the attempt that did nothing: its marker can no longer be written.
    let fenced = app
        .scalar(&format!(
            "SELECT count(*) FROM once_effects WHERE provider_key = '{}' AND state = 'absent' \
             AND fencing_token = {}",
            grants[1].provider_key, grants[1].fencing_token
        ))
        .await;
    assert_eq!(fenced, 1);
    ledger.stop().await;
}
