//! The history's chain: an untouched history verifies; an event, a result or a state edited in
//! the database, or an event removed or added, is named by the first event that does not
//! match; retention's cuts are not taken for tampering.

use std::time::Duration;

use once_api::pb;

use crate::support::*;

on_both_backends!(
    an_untouched_history_verifies_and_every_rewrite_is_named_by_its_first_event,
    what_retention_deleted_is_not_taken_for_a_rewrite,
);

const ARGS: &str = r#"{"order_id":"o1","amount_cents":500}"#;

/// Waits until the chain covers every event stored.
async fn chained(db: &TestDb) {
    eventually(
        Duration::from_secs(20),
        "the history to be linked",
        || async {
            let newest = db
                .scalar("SELECT COALESCE(max(sequence), 0) FROM events")
                .await;
            let through = db.scalar("SELECT through FROM chain_progress").await;
            (through >= newest).then_some(())
        },
    )
    .await;
}

async fn verify(client: &mut Grpc) -> pb::VerifyHistoryResponse {
    client
        .verify_history(pb::VerifyHistoryRequest::default())
        .await
        .expect("verify")
        .into_inner()
}

/// The problem a verification names: its code, event and operation.
fn named(answer: &pb::VerifyHistoryResponse) -> Option<(String, i64, String)> {
    answer
        .problem
        .as_ref()
        .map(|p| (p.code.clone(), p.sequence, p.operation_id.clone()))
}

async fn sequence_of(db: &TestDb, id: &str, kind: &str) -> i64 {
    db.scalar(&format!(
        "SELECT sequence FROM events WHERE operation_id = '{id}' AND kind = '{kind}'"
    ))
    .await
}

async fn an_untouched_history_verifies_and_every_rewrite_is_named_by_its_first_event(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    for id in ["chain-1", "chain-2"] {
        let grant = claim(&mut client, begin(id, ARGS)).await;
        confirm(
            &mut client,
            id,
            grant.fencing_token,
            b"{\"refund\":\"re_1\"}",
        )
        .await
        .unwrap();
    }
    claim(&mut client, begin("chain-3", ARGS)).await;
    chained(&db).await;

    let clean = verify(&mut client).await;
    assert_eq!(named(&clean), None, "{clean:?}");
    assert_eq!(clean.events, db.scalar("SELECT count(*) FROM events").await);
    assert!(clean.links >= 1 && clean.head_hash.len() == 64, "{clean:?}");
    assert_eq!(clean.tenant, "default");
    let recorded = db
        .scalar("SELECT count(*) FROM chain_verifications WHERE problem IS NULL")
        .await;
    assert_eq!(recorded, 1, "the verification is kept for the console");

    // An event's column edited.
    let claimed = sequence_of(&db, "chain-2", "CLAIMED").await;
    db.execute(&format!(
        "UPDATE events SET actor = 'executor:someone-else' WHERE sequence = {claimed}"
    ))
    .await;
    let found = verify(&mut client).await;
    assert_eq!(
        named(&found),
        Some(("EVENT_CHANGED".into(), claimed, "chain-2".into()))
    );
    db.execute(&format!(
        "UPDATE events SET actor = (SELECT actor FROM events WHERE operation_id = 'chain-1' \
         AND kind = 'CLAIMED') WHERE sequence = {claimed}"
    ))
    .await;
    assert_eq!(named(&verify(&mut client).await), None);

    // A stored result.
    let result = db
        .scalar("SELECT count(*) FROM operations WHERE result IS NOT NULL")
        .await;
    assert_eq!(result, 2);
    let original: Vec<u8> = b"{\"refund\":\"re_1\"}".to_vec();
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let blob = |bytes: &[u8]| match store {
        Engine::Postgres => format!("'\\x{}'::bytea", hex(bytes)),
        Engine::Sqlite => format!("X'{}'", hex(bytes)),
    };
    db.execute(&format!(
        "UPDATE operations SET result = {} WHERE operation_id = 'chain-1'",
        blob(b"{\"refund\":\"re_9\"}")
    ))
    .await;
    let confirmed = sequence_of(&db, "chain-1", "CONFIRMED").await;
    assert_eq!(
        named(&verify(&mut client).await),
        Some(("RESULT_CHANGED".into(), confirmed, "chain-1".into()))
    );
    db.execute(&format!(
        "UPDATE operations SET result = {} WHERE operation_id = 'chain-1'",
        blob(&original)
    ))
    .await;

    // A state.
    db.execute("UPDATE operations SET state = 'ABSENT' WHERE operation_id = 'chain-3'")
        .await;
    let (code, _, operation) = named(&verify(&mut client).await).unwrap();
    assert_eq!(
        (code.as_str(), operation.as_str()),
        ("STATE_CHANGED", "chain-3")
    );
    db.execute("UPDATE operations SET state = 'IN_FLIGHT' WHERE operation_id = 'chain-3'")
        .await;
    assert_eq!(named(&verify(&mut client).await), None);

    // An event removed.
    db.execute(&format!("DELETE FROM events WHERE sequence = {confirmed}"))
        .await;
    assert_eq!(
        named(&verify(&mut client).await),
        Some(("EVENT_MISSING".into(), confirmed, String::new()))
    );
    ledger.stop().await;
}

async fn what_retention_deleted_is_not_taken_for_a_rewrite(store: Engine) {
    let db = TestDb::new(store).await;
    let flags = [
        "--retention-explicit",
        "1ms",
        "--event-retention",
        "1ms",
        "--retention-sweep-interval",
        "50ms",
    ];
    let ledger = TestLedger::spawn_with(&db, &flags).await;
    let mut client = ledger.client().await;
    let grant = claim(&mut client, begin("kept-1", ARGS)).await;
    confirm(&mut client, "kept-1", grant.fencing_token, b"done")
        .await
        .unwrap();
    chained(&db).await;
    // Retention deletes the settled operation and its events.
    eventually(
        Duration::from_secs(20),
        "retention to delete the events",
        || async { (db.scalar("SELECT count(*) FROM events").await == 0).then_some(()) },
    )
    .await;
    let found = verify(&mut client).await;
    assert_eq!(named(&found), None, "{found:?}");
    assert!(found.links >= 1);
    ledger.stop().await;
}
