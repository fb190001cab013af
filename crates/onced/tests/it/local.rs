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
