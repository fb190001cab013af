//! The `sql` kind against real databases: a committed marker is CONFIRMED with its result; a
//! missing one is ABSENT only once fenced, after which the attempt looked up (or an earlier
//! one) cannot commit its marker, and a later one can; a transaction that may still write the
//! marker is waited for, never taken for a miss.

use std::time::Duration;

use once_reconcile::sql::{create_table, SqlReconciler, MARK_DONE};
use once_reconcile::{LookupRequest, Reconciler, Verdict};
use once_testdb::{on_both_backends, Engine, TestDb};
use sqlx::{AnyConnection, Connection as _};

on_both_backends!(
    a_committed_marker_is_confirmed_and_a_fenced_miss_is_absent_for_good,
    a_transaction_that_may_still_write_the_marker_is_waited_for,
);

fn request(key: &str, token: u64) -> LookupRequest {
    LookupRequest {
        tenant: "default".into(),
        operation_id: format!("book:{key}"),
        tool: "book_slot".into(),
        provider_key: key.into(),
        lookup_hints: serde_json::json!({}),
        attempt: 1,
        fencing_token: token,
        attempt_started_at_ms: 0,
    }
}

async fn connect(db: &TestDb) -> AnyConnection {
    sqlx::any::install_default_drivers();
    let url = match db.store {
        Engine::Sqlite => format!("{}?mode=rwc", db.url),
        Engine::Postgres => db.url.clone(),
    };
    AnyConnection::connect(&url).await.expect("connect")
}

/// The application's schema: its bookings, and the marker table.
async fn schema(db: &TestDb) {
    let mut conn = connect(db).await;
    sqlx::query("CREATE TABLE bookings (slot TEXT PRIMARY KEY, who TEXT NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    let postgres = db.store == Engine::Postgres;
    sqlx::query(&create_table("once_effects", postgres))
        .execute(&mut conn)
        .await
        .unwrap();
}

/// The application's guarded effect, in one transaction: the booking, then the marker of
/// attempt `token`. Whether the marker was written (else the transaction is rolled back).
async fn book(conn: &mut AnyConnection, key: &str, token: u64, slot: &str) -> bool {
    let mut tx = conn.begin().await.unwrap();
    let marked = book_in(&mut tx, key, token, slot).await;
    match marked {
        true => tx.commit().await.unwrap(),
        // At once: the refused upsert holds the marker's row until the transaction ends.
        false => tx.rollback().await.unwrap(),
    }
    marked
}

async fn book_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    key: &str,
    token: u64,
    slot: &str,
) -> bool {
    sqlx::query("INSERT INTO bookings (slot, who) VALUES ($1, $2)")
        .bind(slot)
        .bind(key)
        .execute(&mut **tx)
        .await
        .unwrap();
    mark(tx, key, token, slot).await
}

async fn mark(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    key: &str,
    token: u64,
    slot: &str,
) -> bool {
    let result = format!(r#"{{"slot":"{slot}"}}"#);
    let written = sqlx::query(&MARK_DONE.replace("{table}", "once_effects"))
        .bind(key)
        .bind(format!("book:{key}"))
        .bind(i64::try_from(token).unwrap())
        .bind(result.into_bytes())
        .bind(format!("booking-{slot}"))
        .bind(0_i64)
        .execute(&mut **tx)
        .await
        .unwrap()
        .rows_affected();
    written == 1
}

fn reconciler(db: &TestDb, wait: Duration) -> SqlReconciler {
    SqlReconciler::new(&db.url, None, "once_effects", wait).expect("a reconciler")
}

async fn bookings(db: &TestDb) -> i64 {
    let mut conn = connect(db).await;
    sqlx::query_scalar("SELECT count(*) FROM bookings")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

async fn a_committed_marker_is_confirmed_and_a_fenced_miss_is_absent_for_good(store: Engine) {
    let db = TestDb::new(store).await;
    schema(&db).await;
    let sql = reconciler(&db, Duration::from_secs(10));
    let mut app = connect(&db).await;

    // Committed with its marker: CONFIRMED, with the result the application stored.
    assert!(book(&mut app, "once_k1", 5, "mon-9").await);
    match sql.lookup(&request("once_k1", 5)).await {
        Verdict::Confirmed {
            provider_ref,
            result,
            ..
        } => {
            assert_eq!(provider_ref, "booking-mon-9");
            assert_eq!(result, br#"{"slot":"mon-9"}"#);
        }
        other => panic!("{other:?}"),
    }

    // Nothing written: ABSENT, and from then on neither the attempt looked up nor an earlier
    // one can commit its marker, so its booking rolls back; a later attempt books.
    let verdict = sql.lookup(&request("once_k2", 7)).await;
    assert!(matches!(verdict, Verdict::Absent { .. }), "{verdict:?}");
    for fenced in [6, 7] {
        assert!(
            !book(&mut app, "once_k2", fenced, &format!("tue-{fenced}")).await,
            "attempt {fenced} wrote its marker after the fence"
        );
    }
    assert_eq!(bookings(&db).await, 1, "the fenced bookings rolled back");
    assert!(matches!(
        sql.lookup(&request("once_k2", 7)).await,
        Verdict::Absent { .. }
    ));
    assert!(book(&mut app, "once_k2", 8, "tue-8").await);
    assert!(matches!(
        sql.lookup(&request("once_k2", 8)).await,
        Verdict::Confirmed { .. }
    ));
    // A lookup again, of an attempt the marker is already from: the same answer.
    assert!(matches!(
        sql.lookup(&request("once_k2", 8)).await,
        Verdict::Confirmed { .. }
    ));
    assert_eq!(bookings(&db).await, 2);

    // A marker under this key that names another operation proves nothing of this one.
    let mut tx = app.begin().await.unwrap();
    assert!(mark(&mut tx, "once_k4", 3, "wed-3").await);
    tx.commit().await.unwrap();
    let mut other = request("once_k4", 3);
    other.operation_id = "book:someone-else".into();
    assert!(matches!(sql.lookup(&other).await, Verdict::Unknown { .. }));

    // A database that cannot be reached: it cannot tell, never ABSENT.
    let nowhere = match store {
        Engine::Postgres => "postgres://postgres@127.0.0.1:1/none".to_owned(),
        Engine::Sqlite => "sqlite:///proc/nowhere/app.db".to_owned(),
    };
    let unreachable =
        SqlReconciler::new(&nowhere, None, "once_effects", Duration::from_secs(1)).unwrap();
    assert!(matches!(
        unreachable.lookup(&request("once_k3", 9)).await,
        Verdict::Unknown { .. }
    ));
}

async fn a_transaction_that_may_still_write_the_marker_is_waited_for(store: Engine) {
    let db = TestDb::new(store).await;
    schema(&db).await;
    let mut app = connect(&db).await;

    // The effect and its marker written, not committed: a lookup that cannot wait long enough
    // cannot tell; one that waits gets the truth once the transaction ends, either way.
    for commit in [true, false] {
        let key = if commit { "once_c" } else { "once_r" };
        let mut tx = app.begin().await.unwrap();
        assert!(book_in(&mut tx, key, 3, key).await);
        let impatient = reconciler(&db, Duration::from_millis(200));
        assert!(
            matches!(
                impatient.lookup(&request(key, 3)).await,
                Verdict::Unknown { .. }
            ),
            "a miss taken while the marker's transaction is open"
        );
        let patient = reconciler(&db, Duration::from_secs(20));
        let looked_up = tokio::spawn(async move { patient.lookup(&request(key, 3)).await });
        // On PostgreSQL the lookup is seen waiting for the transaction before it ends.
        if store == Engine::Postgres {
            let mut watcher = connect(&db).await;
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                     AND datname = current_database()",
                )
                .fetch_one(&mut watcher)
                .await
                .unwrap();
                if waiting > 0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the lookup never waited"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        match commit {
            true => tx.commit().await.unwrap(),
            false => tx.rollback().await.unwrap(),
        }
        let verdict = looked_up.await.unwrap();
        match commit {
            true => assert!(matches!(verdict, Verdict::Confirmed { .. }), "{verdict:?}"),
            false => assert!(matches!(verdict, Verdict::Absent { .. }), "{verdict:?}"),
        }
    }

    // A transaction that has not written its marker yet. On PostgreSQL the lookup fences the
    // key at once, and the marker written after it is refused, so the booking rolls back. On
    // SQLite the booking holds the database's write lock, which the lookup waits for.
    let mut tx = app.begin().await.unwrap();
    sqlx::query("INSERT INTO bookings (slot, who) VALUES ('wed-1', 'once_late')")
        .execute(&mut *tx)
        .await
        .unwrap();
    // (Patient on PostgreSQL, where nothing holds the key: the answer is at once.)
    let impatient = match store {
        Engine::Postgres => reconciler(&db, Duration::from_secs(20)),
        Engine::Sqlite => reconciler(&db, Duration::from_millis(200)),
    };
    let verdict = impatient.lookup(&request("once_late", 4)).await;
    match store {
        Engine::Postgres => {
            assert!(matches!(verdict, Verdict::Absent { .. }), "{verdict:?}");
            assert!(
                !mark(&mut tx, "once_late", 4, "wed-1").await,
                "the fence holds"
            );
            tx.rollback().await.unwrap();
        }
        Engine::Sqlite => {
            assert!(matches!(verdict, Verdict::Unknown { .. }), "{verdict:?}");
            assert!(mark(&mut tx, "once_late", 4, "wed-1").await);
            tx.commit().await.unwrap();
            assert!(matches!(
                impatient.lookup(&request("once_late", 4)).await,
                Verdict::Confirmed { .. }
            ));
        }
    }
}
