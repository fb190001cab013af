//! Effects in the executor's own database (`once_client::local`): the effect and its marker
//! commit together, the ledger is told, a repeat replays; an effect that fails commits nothing
//! and is ABSENT; an attempt whose answer was lost after its commit is settled CONFIRMED by the
//! `sql` reconciler from the marker.

use std::time::Duration;

use futures::FutureExt as _;
use once_api::pb;
use once_client::local::{create_table, mark, Marked};
use once_client::{
    ClientConfig, Decision, Effect, EffectError, LedgerClient, OperationSpec, Outcome,
};
use serde_json::json;

use crate::support::*;

on_both_backends!(a_local_effect_commits_with_its_marker_and_runs_once);

fn booking(slot: &str) -> OperationSpec {
    OperationSpec::new("book_slot", json!({ "slot": slot }))
        .intent(["book", slot])
        .provider("bookings", json!({}))
        .lease_ttl(Duration::from_millis(300))
}

async fn a_local_effect_commits_with_its_marker_and_runs_once(store: Engine) {
    let db = TestDb::new(store).await;
    let app = TestDb::new(store).await;
    let app_url = match app.url.strip_prefix("sqlite://") {
        Some(file) => format!("sqlite://{file}?mode=rwc"),
        None => app.url.clone(),
    };
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\n\n[[reconciler]]\nname = \"bookings\"\nkind = \"sql\"\n\
             endpoint = \"{app_url}\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let client =
        LedgerClient::connect(ClientConfig::new(format!("http://{}", ledger.addr))).unwrap();
    let grpc = ledger.client().await;
    let postgres = store == Engine::Postgres;

    macro_rules! scenario {
        ($pool:expr) => {{
            let pool = $pool;
            sqlx::query("CREATE TABLE bookings (slot TEXT PRIMARY KEY)")
                .execute(&pool)
                .await
                .unwrap();
            sqlx::query(&create_table("once_effects", postgres))
                .execute(&pool)
                .await
                .unwrap();
            // The effect, inline where `run_local` is called (so its connection's lifetime is
            // the one the call gives it).
            macro_rules! book {
                ($slot:expr) => {
                    |conn, _context| {
                        async move {
                            sqlx::query("INSERT INTO bookings (slot) VALUES ($1)")
                                .bind($slot)
                                .execute(conn)
                                .await
                                .map_err(|e| EffectError::NotPerformed(e.to_string()))?;
                            Ok(
                                Effect::new(format!(r#"{{"slot":"{}"}}"#, $slot).into_bytes())
                                    .with_provider_ref(format!("booking-{}", $slot)),
                            )
                        }
                        .boxed()
                    }
                };
            }
            // Booked once; the same booking again replays it, and books nothing.
            let first = client
                .run_local(&booking("mon-9"), &pool, "once_effects", book!("mon-9"))
                .await
                .unwrap();
            assert!(matches!(first, Outcome::Executed { .. }), "{first:?}");
            let again = client
                .run_local(&booking("mon-9"), &pool, "once_effects", |_conn, _| {
                    async { panic!("a replayed booking must not run") }.boxed()
                })
                .await
                .unwrap();
            let Outcome::Replayed(replay) = again else {
                panic!("{again:?}")
            };
            assert_eq!(replay.result, br#"{"slot":"mon-9"}"#);
            wait_for_state(&grpc, first_id(&first), pb::OperationState::Confirmed).await;

            // The slot is taken: the insert fails, nothing commits, ABSENT.
            let taken = client
                .run_local(
                    &booking("mon-9").intent(["book", "mon-9", "again"]),
                    &pool,
                    "once_effects",
                    book!("mon-9"),
                )
                .await
                .unwrap();
            let Outcome::NotPerformed { operation_id, .. } = &taken else {
                panic!("{taken:?}")
            };
            wait_for_state(&grpc, operation_id, pb::OperationState::Absent).await;

            // Committed with its marker, and the answer lost (the process gone before it
            // reported): UNKNOWN, then CONFIRMED from the marker, with the stored result.
            let Decision::Execute(attempt) = client.begin(&booking("tue-1")).await.unwrap() else {
                panic!("not granted")
            };
            let id = attempt.operation_id().to_owned();
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO bookings (slot) VALUES ('tue-1')")
                .execute(&mut *tx)
                .await
                .unwrap();
            let effect =
                Effect::new(br#"{"slot":"tue-1"}"#.to_vec()).with_provider_ref("booking-tue-1");
            assert_eq!(
                mark(&mut tx, "once_effects", &attempt, &effect)
                    .await
                    .unwrap(),
                Marked::Written
            );
            tx.commit().await.unwrap();
            drop(attempt);
            wait_for_state(&grpc, &id, pb::OperationState::Confirmed).await;
            let mut grpc = grpc.clone();
            let settled = get(&mut grpc, &id).await.operation.unwrap();
            assert_eq!(settled.result, br#"{"slot":"tue-1"}"#);
            assert_eq!(settled.provider_ref, "booking-tue-1");
            let count: i64 = sqlx::query_scalar("SELECT count(*) FROM bookings")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(count, 2, "one booking each, none twice");
        }};
    }
    match store {
        Engine::Postgres => scenario!(sqlx::PgPool::connect(&app_url).await.unwrap()),
        Engine::Sqlite => scenario!(sqlx::SqlitePool::connect(&app_url).await.unwrap()),
    }
    ledger.stop().await;
}

fn first_id(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Executed { operation_id, .. } => operation_id,
        other => panic!("{other:?}"),
    }
}

/// A relay between the application and PostgreSQL that cuts the connection at the
/// transaction's COMMIT: `forward` decides whether the COMMIT reaches the server first (it
/// commits, and its answer is lost) or not (it never commits). Counts the COMMITs it cut.
struct CommitCutter {
    addr: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CommitCutter {
    async fn start(server: std::net::SocketAddr, forward: bool) -> Self {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let upstream = tokio::net::TcpStream::connect(server).await.unwrap();
                    let (mut from_client, mut to_client) = client.into_split();
                    let (mut from_server, mut to_server) = upstream.into_split();
                    let answers = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                    });
                    // The client's messages, framed: the startup ones untyped (an SSL request
                    // first, perhaps), then each a type byte and a length.
                    let mut started = false;
                    loop {
                        let mut head = vec![0u8; if started { 5 } else { 4 }];
                        if from_client.read_exact(&mut head).await.is_err() {
                            break;
                        }
                        let len_at = usize::from(started);
                        let len = u32::from_be_bytes(head[len_at..len_at + 4].try_into().unwrap())
                            as usize;
                        let mut body = vec![0u8; len - 4];
                        from_client.read_exact(&mut body).await.unwrap();
                        if !started {
                            // 80877103 asks for SSL, which the server declines: the startup
                            // message follows.
                            started =
                                u32::from_be_bytes(body[..4].try_into().unwrap()) != 80_877_103;
                        }
                        let commit = started && head[0] == b'Q' && body.starts_with(b"COMMIT");
                        if commit && !forward {
                            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            break;
                        }
                        to_server.write_all(&head).await.unwrap();
                        to_server.write_all(&body).await.unwrap();
                        if commit {
                            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            // Its answer never reaches the client.
                            answers.abort();
                            break;
                        }
                    }
                });
            }
        });
        Self { addr, cut }
    }
}

/// The connection lost during COMMIT, on PostgreSQL: the application cannot tell whether the
/// booking committed, and says UNKNOWN; the marker tells. Committed (the COMMIT reached the
/// server, its answer did not): CONFIRMED with the stored result. Not committed (the COMMIT
/// never reached it): ABSENT, and the booking is not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_during_commit_is_unknown_then_the_marker_tells() {
    let db = TestDb::new(Engine::Postgres).await;
    let app = TestDb::new(Engine::Postgres).await;
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\n\n[[reconciler]]\nname = \"bookings\"\nkind = \"sql\"\n\
             endpoint = \"{}\"\n",
            app.url
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let client =
        LedgerClient::connect(ClientConfig::new(format!("http://{}", ledger.addr))).unwrap();
    let grpc = ledger.client().await;
    let direct = sqlx::PgPool::connect(&app.url).await.unwrap();
    sqlx::query("CREATE TABLE bookings (slot TEXT PRIMARY KEY)")
        .execute(&direct)
        .await
        .unwrap();
    sqlx::query(&create_table("once_effects", true))
        .execute(&direct)
        .await
        .unwrap();
    let options: sqlx::postgres::PgConnectOptions = app.url.parse().unwrap();
    let server: std::net::SocketAddr = format!("{}:{}", options.get_host(), options.get_port())
        .parse()
        .unwrap();
    for (slot, forward, settled) in [
        ("thu-1", true, pb::OperationState::Confirmed),
        ("thu-2", false, pb::OperationState::Absent),
    ] {
        let cutter = CommitCutter::start(server, forward).await;
        let through = options
            .clone()
            .host("127.0.0.1")
            .port(cutter.addr.port())
            .ssl_mode(sqlx::postgres::PgSslMode::Disable);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(through)
            .await
            .unwrap();
        let outcome = client
            .run_local(&booking(slot), &pool, "once_effects", |conn, _context| {
                async move {
                    sqlx::query("INSERT INTO bookings (slot) VALUES ($1)")
                        .bind(slot)
                        .execute(conn)
                        .await
                        .map_err(|e| EffectError::NotPerformed(e.to_string()))?;
                    Ok(Effect::new(format!(r#"{{"slot":"{slot}"}}"#).into_bytes()))
                }
                .boxed()
            })
            .await
            .unwrap();
        assert_eq!(
            cutter.cut.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the COMMIT was cut"
        );
        let Outcome::Ambiguous { operation_id, .. } = &outcome else {
            panic!("{outcome:?}")
        };
        wait_for_state(&grpc, operation_id, settled).await;
        let booked: i64 = sqlx::query_scalar("SELECT count(*) FROM bookings WHERE slot = $1")
            .bind(slot)
            .fetch_one(&direct)
            .await
            .unwrap();
        assert_eq!(booked, i64::from(forward), "{slot}");
    }
    ledger.stop().await;
}
