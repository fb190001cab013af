//! The client crate against a real ledger: decisions, the attempt guard, heartbeats, and
//! retries that never mint a second attempt.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use once_client::{
    ClientConfig, ClientError, Decision, Effect, EffectError, LedgerClient, OperationSpec, Outcome,
    Receipt,
};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::instrument::WithSubscriber as _;

use crate::support::*;

fn client_for(addr: std::net::SocketAddr) -> LedgerClient {
    let mut config = ClientConfig::new(format!("http://{addr}"));
    config.client_name = "client-test".into();
    LedgerClient::connect(config).unwrap()
}

fn refund(order: &str) -> OperationSpec {
    OperationSpec::new(
        "issue_refund",
        json!({"order_id": order, "amount_cents": 500, "currency": "eur"}),
    )
    .intent(["refund", order])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_executes_once_then_replays() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let client = client_for(ledger.addr);

    let outcome = client
        .run(&refund("o-1"), |attempt| async move {
            assert!(attempt.provider_key.starts_with("once_"));
            Ok(Effect::new(br#"{"refund":"re_1"}"#.to_vec()).with_provider_ref("re_1"))
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed { .. }), "{outcome:?}");
    let outcome = client
        .run(&refund("o-1"), |_| async {
            panic!("a replayed operation must not run its effect")
        })
        .await
        .unwrap();
    let Outcome::Replayed(replay) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(replay.result, br#"{"refund":"re_1"}"#);
    assert_eq!(replay.provider_ref.as_deref(), Some("re_1"));
    assert_eq!(replay.receipt, None, "a receipt comes only when asked for");
    // Asked for, the replay carries the ledger's receipt; it verifies with the keys the ledger
    // serves, and the one GetReceipt signs says the same.
    // (once the history's chain has linked the event that settled it, within about a second)
    let replay = eventually(
        Duration::from_secs(20),
        "a replay with its receipt",
        || async {
            let outcome = client
                .run(&refund("o-1").with_receipt(), |_| async {
                    panic!("a replayed operation must not run its effect")
                })
                .await
                .unwrap();
            let Outcome::Replayed(replay) = outcome else {
                panic!("{outcome:?}")
            };
            replay.receipt.is_some().then_some(replay)
        },
    )
    .await;
    let keys = client.signing_keys().await.unwrap();
    assert_eq!(keys.keys.len(), 1);
    let receipt = Receipt::verify(replay.receipt.as_deref().unwrap(), &keys.keys).unwrap();
    assert!(receipt.covers_result(&replay.result));
    assert_eq!(
        (
            receipt.state,
            receipt.ledger.as_str(),
            receipt.provider_ref.as_deref()
        ),
        (
            once_client::State::Confirmed,
            keys.ledger.as_str(),
            Some("re_1")
        )
    );
    let again = Receipt::verify(
        &client.receipt(&replay.operation_id).await.unwrap(),
        &keys.keys,
    )
    .unwrap();
    assert_eq!(
        (again.sequence, again.fencing_token),
        (receipt.sequence, receipt.fencing_token)
    );

    let conflict = client
        .run(
            &OperationSpec::new(
                "issue_refund",
                json!({"order_id": "o-1", "amount_cents": 999}),
            )
            .intent(["refund", "o-1"]),
            |_| async { panic!("a conflicting operation must not run its effect") },
        )
        .await
        .unwrap();
    assert!(matches!(conflict, Outcome::Conflict(_)), "{conflict:?}");
    ledger.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effect_errors_and_panics_are_classified() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let client = client_for(ledger.addr);
    let mut grpc = ledger.client().await;

    let refused = client
        .run(&refund("o-2"), |_| async {
            Err(EffectError::NotPerformed("card declined".into()))
        })
        .await
        .unwrap();
    let Outcome::NotPerformed { operation_id, .. } = refused else {
        panic!("{refused:?}")
    };
    assert_eq!(
        state_of(&mut grpc, &operation_id).await,
        once_api::pb::OperationState::Absent
    );

    let timed_out = client
        .run(&refund("o-3"), |_| async {
            Err(EffectError::Ambiguous("timeout after sending".into()))
        })
        .await
        .unwrap();
    let Outcome::Ambiguous { operation_id, .. } = timed_out else {
        panic!("{timed_out:?}")
    };
    assert_eq!(
        state_of(&mut grpc, &operation_id).await,
        once_api::pb::OperationState::Unknown
    );

    let panicked = client
        .run(&refund("o-4"), |_| async {
            if true {
                panic!("the provider client crashed");
            }
            Ok(Effect::new(vec![]))
        })
        .await
        .unwrap();
    let Outcome::Ambiguous {
        operation_id,
        reason,
    } = panicked
    else {
        panic!("{panicked:?}")
    };
    assert!(reason.contains("panicked"));
    assert_eq!(
        state_of(&mut grpc, &operation_id).await,
        once_api::pb::OperationState::Unknown
    );
    // UNKNOWN is not permission to retry.
    let again = client
        .run(&refund("o-4"), |_| async { panic!("must not run") })
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Unknown(_)), "{again:?}");
    ledger.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_or_cancelled_attempt_becomes_unknown_never_absent() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let client = client_for(ledger.addr);
    let grpc = ledger.client().await;

    let Decision::Execute(attempt) = client.begin(&refund("o-5")).await.unwrap() else {
        panic!()
    };
    let id = attempt.operation_id().to_owned();
    drop(attempt);
    wait_for_state(&grpc, &id, once_api::pb::OperationState::Unknown).await;

    // A run whose future is dropped while the effect is under way.
    let started = Arc::new(tokio::sync::Notify::new());
    let running = {
        let client = client.clone();
        let started = started.clone();
        tokio::spawn(async move {
            client
                .run(&refund("o-6"), |_| async move {
                    started.notify_one();
                    std::future::pending::<Result<Effect, EffectError>>().await
                })
                .await
        })
    };
    started.notified().await;
    running.abort();
    let (id, _) = refund("o-6").resolve().unwrap();
    wait_for_state(&grpc, &id, once_api::pb::OperationState::Unknown).await;
    ledger.stop().await;
}

/// Runs `spec` with an effect that lasts until the database clock is `lasting_ms` past its
/// lease's start (several leases: the sweeper runs every 50 ms meanwhile), and checks that the
/// heartbeats kept the lease: CONFIRMED, with no lease expiry in the history.
async fn outlive_the_lease(ledger: &TestLedger, db: &TestDb, spec: OperationSpec, lasting_ms: i64) {
    let client = client_for(ledger.addr);
    let mut grpc = ledger.client().await;
    let outcome = client
        .run(&spec, |attempt| {
            let mut grpc = grpc.clone();
            async move {
                let started = db
                    .scalar(&format!(
                        "SELECT lease_started_at FROM operations WHERE operation_id = '{}'",
                        attempt.operation_id
                    ))
                    .await;
                eventually(
                    Duration::from_secs(10),
                    "the effect's time to pass",
                    || async { (db.clock().await >= started + lasting_ms).then_some(()) },
                )
                .await;
                assert_eq!(
                    state_of(&mut grpc, &attempt.operation_id).await,
                    once_api::pb::OperationState::InFlight
                );
                Ok(Effect::new(b"slow but done".to_vec()))
            }
        })
        .await
        .unwrap();
    let Outcome::Executed { operation_id, .. } = outcome else {
        panic!("{outcome:?}")
    };
    confirmed_without_lease_expiry(&mut grpc, &operation_id).await;
}

on_both_backends!(
    heartbeats_keep_a_long_effect_alive_past_its_lease,
    heartbeats_follow_the_lease_the_ledger_granted,
);

async fn heartbeats_keep_a_long_effect_alive_past_its_lease(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    // Three leases and more; a heartbeat due every 500 ms, so a stall of the loaded test machine
    // (a busy SQLite file, a CI run's other tests) shorter than a second costs nothing.
    let spec = refund("o-7").lease_ttl(Duration::from_millis(1_500));
    outlive_the_lease(&ledger, &db, spec, 5_000).await;
    ledger.stop().await;
}

/// The spec names no lease, so the ledger grants its own default (here 1.5 s, not the 30 s a
/// client might assume): the heartbeat follows the lease the grant carries.
async fn heartbeats_follow_the_lease_the_ledger_granted(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn_with(&db, &["--default-lease", "1500ms"]).await;
    outlive_the_lease(&ledger, &db, refund("o-default-lease"), 4_500).await;
    ledger.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_ledger_fails_closed() {
    let unused = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let client = client_for(unused);
    let performed = Arc::new(AtomicBool::new(false));
    let flag = performed.clone();
    let result = client
        .run(&refund("o-8"), |_| async move {
            flag.store(true, Ordering::SeqCst);
            Ok(Effect::new(vec![]))
        })
        .await;
    assert!(
        matches!(result, Err(ClientError::Unreachable(_))),
        "{result:?}"
    );
    assert!(
        !performed.load(Ordering::SeqCst),
        "the effect must not run without the ledger"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_after_a_lost_response_never_mint_a_second_attempt() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let proxy = ResponseEater::start(ledger.addr).await;
    let client = client_for(proxy.addr);
    let mut grpc = ledger.client().await;

    // Warm the connection, then lose the response of the Begin after the ledger committed it.
    client.get("warm-up").await.unwrap_err();
    proxy.eat_next_response();
    let Decision::Execute(attempt) = client.begin(&refund("o-9")).await.unwrap() else {
        panic!()
    };
    assert!(proxy.ate(), "the first response was lost");
    let id = attempt.operation_id().to_owned();
    // And the response of the Confirm.
    proxy.eat_next_response();
    attempt.confirm(b"ok".to_vec(), None).await.unwrap();
    assert!(proxy.ate());

    let history = get(&mut grpc, &id).await;
    assert_eq!(
        history.attempts.len(),
        1,
        "the retried Begin was the same attempt"
    );
    let kinds: Vec<&str> = history.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["CLAIMED", "CONFIRMED"]);
    ledger.stop().await;
}

/// A TCP proxy for HTTP/2 that, when armed, swallows one complete gRPC response (up to its
/// END_STREAM) and then cuts the connection: the server did the work, the client never hears.
struct ResponseEater {
    addr: std::net::SocketAddr,
    armed: Arc<AtomicBool>,
    eaten: Arc<AtomicBool>,
}

impl ResponseEater {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(false));
        let eaten = Arc::new(AtomicBool::new(false));
        let (a, e) = (armed.clone(), eaten.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                tokio::spawn(relay(client, server, a.clone(), e.clone()));
            }
        });
        Self { addr, armed, eaten }
    }

    fn eat_next_response(&self) {
        self.eaten.store(false, Ordering::SeqCst);
        self.armed.store(true, Ordering::SeqCst);
    }

    fn ate(&self) -> bool {
        self.eaten.load(Ordering::SeqCst)
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<AtomicBool>,
    eaten: Arc<AtomicBool>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    // Server to client, frame by frame: 9-byte header (length, type, flags, stream id).
    loop {
        let mut header = [0u8; 9];
        if server_read.read_exact(&mut header).await.is_err() {
            break;
        }
        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0u8; length];
        if server_read.read_exact(&mut payload).await.is_err() {
            break;
        }
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        let end_stream = header[4] & 0x1 != 0 && matches!(header[3], 0x0 | 0x1);
        if stream != 0 && armed.load(Ordering::SeqCst) {
            if end_stream {
                armed.store(false, Ordering::SeqCst);
                eaten.store(true, Ordering::SeqCst);
                break; // cut the connection with the response unsent
            }
            continue;
        }
        if client_write.write_all(&header).await.is_err()
            || client_write.write_all(&payload).await.is_err()
        {
            break;
        }
    }
    upstream.abort();
}

/// What a future logged, as text lines.
#[derive(Clone, Default)]
struct Logged(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logged {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    fn said(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The effect ran and its confirm was lost: the caller gets the effect's outcome, and the log
/// says, in one line, which operation, attempt and provider ref to look for, never the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_that_ran_is_reported_as_executed_even_when_its_confirm_is_lost() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let client = client_for(ledger.addr);
    let (effect_started, started) = tokio::sync::oneshot::channel();
    let (ledger_gone, gone) = tokio::sync::oneshot::channel::<()>();
    let logged = Logged::default();
    let running = {
        let client = client.clone();
        let subscriber = logged.subscriber();
        tokio::spawn(
            async move {
                client
                    .run(&refund("o-10"), |_| async move {
                        let _ = effect_started.send(());
                        let _ = gone.await;
                        Ok(Effect::new(b"refunded-secret".to_vec()).with_provider_ref("re_o10"))
                    })
                    .await
            }
            .with_subscriber(subscriber),
        )
    };
    started.await.unwrap();
    ledger.stop().await;
    let _ = ledger_gone.send(());
    let outcome = running
        .await
        .unwrap()
        .expect("the effect ran: not an error");
    assert!(matches!(outcome, Outcome::Executed { .. }), "{outcome:?}");
    let (id, _) = refund("o-10").resolve().unwrap();
    let said = logged.said();
    let line = said
        .lines()
        .find(|l| l.contains("its report did not reach the ledger"))
        .unwrap_or_else(|| panic!("no line says the report was lost:\n{said}"));
    for needle in [
        format!("operation_id={id}"),
        "attempt=1".to_owned(),
        "report=\"CONFIRMED\"".to_owned(),
        "provider_ref=\"re_o10\"".to_owned(),
    ] {
        assert!(line.contains(&needle), "{needle} not in: {line}");
    }
    assert!(
        !said.contains("refunded-secret") && !line.contains("result"),
        "the result never reaches a log, in any form: {said}"
    );

    // The ledger, back, holds the attempt until its lease expires into UNKNOWN, never ABSENT.
    let ledger = TestLedger::spawn(&db).await;
    let mut grpc = ledger.client().await;
    assert_eq!(
        state_of(&mut grpc, &id).await,
        once_api::pb::OperationState::InFlight
    );
    ledger.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_endpoints_verify_the_ledger_certificate() {
    // The ledger serving TLS with a certificate from a private authority.
    let db = TestDb::new(Engine::Sqlite).await;
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    // Self-signed: the certificate is its own authority.
    let ledger = TestLedger::spawn_tls(&db, &cert, &key, &cert, &[]).await;
    let port = ledger.addr.port();

    let mut trusting = ClientConfig::new(format!("https://localhost:{port}"));
    trusting.tls_ca_pem = Some(cert.into_bytes());
    let client = LedgerClient::connect(trusting).unwrap();
    let decision = client.begin(&refund("o-tls")).await.unwrap();
    assert!(matches!(decision, Decision::Execute(_)), "{decision:?}");

    // Without the private authority the certificate is refused, and nothing is performed.
    let mut config = ClientConfig::new(format!("https://localhost:{port}"));
    config.tries = 1;
    let untrusting = LedgerClient::connect(config).unwrap();
    let refused = untrusting.begin(&refund("o-tls-2")).await;
    assert!(
        matches!(refused, Err(ClientError::Unreachable(_))),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_endpoints_share_the_calls() {
    // Two replicas on one database, one client over both.
    let db = TestDb::new(Engine::Sqlite).await;
    let (first, second) = (TestLedger::spawn(&db).await, TestLedger::spawn(&db).await);
    let mut config = ClientConfig::new(format!("http://{}", first.addr));
    config.endpoints.push(format!("http://{}", second.addr));
    let client = LedgerClient::connect(config).unwrap();
    for i in 0..10 {
        let order = format!("o-many-{i}");
        let outcome = client
            .run(&refund(&order), |_| async {
                Ok(Effect::new(b"ok".to_vec()))
            })
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Executed { .. }), "{outcome:?}");
        let again = client
            .run(&refund(&order), |_| async { panic!("must not run twice") })
            .await
            .unwrap();
        assert!(matches!(again, Outcome::Replayed(_)), "{again:?}");
    }
    first.stop().await;
    second.stop().await;
}

on_both_backends!(a_client_refused_by_a_restored_ledger_reports_what_it_saw_and_nothing_runs_twice);

/// The client keeps its positions in a file; the ledger is restored to a backup taken before
/// the client ran three refunds, and the client restarts too.
async fn a_client_refused_by_a_restored_ledger_reports_what_it_saw_and_nothing_runs_twice(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    ledger.stop().await;
    db.back_up().await;
    let ledger = TestLedger::spawn(&db).await;
    let state = db.scratch_dir().join("client/positions");
    let remembering =
        |addr| client_for(addr).remembering(once_client::Positions::open(&state).unwrap());
    let effects = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let effect = |effects: Arc<std::sync::atomic::AtomicUsize>| {
        move |_| async move {
            effects.fetch_add(1, Ordering::SeqCst);
            Ok(Effect::new(b"refunded".to_vec()))
        }
    };
    let client = remembering(ledger.addr);
    for order in ["r-1", "r-2", "r-3"] {
        let outcome = client
            .run(&refund(order), effect(effects.clone()))
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Executed { .. }), "{outcome:?}");
    }
    assert!(client.positions().highest().is_some());
    // The client process ends: its file is free for the next one.
    drop(client);
    ledger.stop().await;
    db.restore().await;

    let ledger = TestLedger::spawn(&db).await;
    // A client started afresh from the same file.
    let client = remembering(ledger.addr);
    let refused = client
        .run(&refund("r-2"), effect(effects.clone()))
        .await
        .unwrap_err();
    let ClientError::Refused { reason, .. } = &refused else {
        panic!("{refused:?}")
    };
    assert_eq!(reason, once_client::LEDGER_BEHIND);
    // It reported what it kept: each refund is UNKNOWN again, and no Begin executes one.
    for order in ["r-1", "r-2", "r-3"] {
        let id = refund(order).resolve().unwrap().0;
        let view = client.get(&id).await.unwrap();
        assert_eq!(view.state, once_client::State::Unknown, "{order}");
    }

    // After the loss is accepted, a stateless client's retry is UNKNOWN, never executed.
    let config = onced_config(&db.url, &["continuity", "accept", "--reason", "drill"]);
    let command = config.command.clone().unwrap();
    onced::administer(config, command).await.unwrap();
    let stateless = client_for(ledger.addr);
    let fresh = eventually(Duration::from_secs(10), "executions to go on", || {
        let (client, effects) = (stateless.clone(), effects.clone());
        async move {
            match client.run(&refund("r-4"), effect(effects)).await {
                Err(ClientError::Refused { .. }) => None,
                answered => Some(answered),
            }
        }
    })
    .await;
    assert!(matches!(fresh, Ok(Outcome::Executed { .. })), "{fresh:?}");
    let answered = stateless.run(&refund("r-1"), effect(effects.clone())).await;
    assert!(matches!(answered, Ok(Outcome::Unknown(_))), "{answered:?}");
    assert_eq!(
        effects.load(Ordering::SeqCst),
        4,
        "three refunds before, one new one after"
    );
    ledger.stop().await;
}

fn onced_config(url: &str, command: &[&str]) -> onced::Config {
    use clap::Parser as _;
    let mut args = vec!["onced", "--database-url", url];
    args.extend_from_slice(command);
    onced::Config::try_parse_from(args).unwrap()
}
