//! Signed receipts: a CONFIRMED or ABSENT operation's receipt says what the ledger recorded and
//! verifies with the public key alone; a replay carries one when asked; a rotation keeps the
//! receipts the old key signed verifiable.

use std::time::Duration;

use clap::Parser as _;
use once_api::pb;
use once_client::{PublicKey, Receipt};
use once_core::State;

use crate::support::*;

on_both_backends!(
    a_receipt_says_what_the_ledger_recorded_and_verifies_with_the_public_key_alone,
    a_rotation_keeps_the_receipts_of_the_old_key_verifiable,
);

const ARGS: &str = r#"{"order_id":"o1","amount_cents":500}"#;
const RESULT: &[u8] = br#"{"refund":"re_1"}"#;

/// Runs `onced signing-keys …` on the key file `file`: its standard output.
fn signing_keys(file: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
        .arg("signing-keys")
        .args(args)
        .args(["--signing-key-file", file.to_str().unwrap()])
        .output()
        .expect("run onced signing-keys");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The public keys the key file holds, as `onced signing-keys --json` prints them.
fn pinned(file: &std::path::Path) -> Vec<PublicKey> {
    let listed: serde_json::Value = serde_json::from_str(&signing_keys(file, &["--json"])).unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .map(|key| PublicKey::parse(key["public_key"].as_str().unwrap()).unwrap())
        .collect()
}

async fn receipt_of(client: &mut Grpc, id: &str) -> Result<String, tonic::Status> {
    client
        .get_receipt(pb::GetReceiptRequest {
            operation_id: id.into(),
            tenant: String::new(),
        })
        .await
        .map(|answer| answer.into_inner().receipt)
}

/// The receipt of `id` once the chain has linked the event that settled it (refused
/// `NOT_LINKED_YET` until then, about a second).
async fn linked_receipt(client: &mut Grpc, id: &str) -> String {
    let client = client.clone();
    eventually(patient(Duration::from_secs(20)), "a linked receipt", || {
        let mut client = client.clone();
        async move {
            match receipt_of(&mut client, id).await {
                Ok(receipt) => Some(receipt),
                Err(status) if reason(&status) == "NOT_LINKED_YET" => None,
                Err(status) => panic!("{status:?}"),
            }
        }
    })
    .await
}

async fn served_keys(client: &mut Grpc) -> pb::GetSigningKeysResponse {
    client
        .get_signing_keys(pb::GetSigningKeysRequest {})
        .await
        .unwrap()
        .into_inner()
}

async fn a_receipt_says_what_the_ledger_recorded_and_verifies_with_the_public_key_alone(
    store: Engine,
) {
    let db = TestDb::new(store).await;
    let file = db.scratch_dir().join("signing.key");
    signing_keys(&file, &["rotate"]);
    let keys = pinned(&file);
    assert_eq!(keys.len(), 1);
    let flag = ["--signing-key-file", file.to_str().unwrap()];
    let ledger = TestLedger::spawn_with(&db, &flag).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("receipt-1", ARGS)).await;
    confirm(&mut client, "receipt-1", grant.fencing_token, RESULT)
        .await
        .unwrap();
    let text = linked_receipt(&mut client, "receipt-1").await;
    // Verified with the keys pinned from the key file: no word of the ledger's is needed.
    let receipt = Receipt::verify(&text, &keys).expect("verifies with the pinned key");
    let confirmed = db
        .scalar(
            "SELECT sequence FROM events WHERE operation_id = 'receipt-1' AND kind = 'CONFIRMED'",
        )
        .await;
    assert_eq!(
        (
            receipt.state,
            receipt.source.as_str(),
            receipt.operation_id.as_str(),
            receipt.tenant.as_str(),
            receipt.attempt,
            receipt.fencing_token,
            receipt.life,
            receipt.sequence,
        ),
        (
            State::Confirmed,
            "attempt",
            "receipt-1",
            "default",
            1,
            grant.fencing_token,
            grant.fencing_token,
            confirmed,
        )
    );
    assert!(receipt.covers_result(RESULT));
    assert_eq!(receipt.key, keys[0].id());
    // The keys the ledger serves are the same, and it names itself as its receipts do.
    let served = served_keys(&mut client).await;
    assert_eq!(served.ledger, receipt.ledger);
    assert_eq!(served.keys.len(), 1);
    assert!(served.keys[0].active && served.keys[0].key_id == keys[0].id());

    // ABSENT: a receipt for the attempt that said it did nothing, with no result.
    let grant = claim(&mut client, begin("receipt-2", ARGS)).await;
    report_absent(&mut client, "receipt-2", grant.fencing_token)
        .await
        .unwrap();
    let absent = Receipt::verify(&linked_receipt(&mut client, "receipt-2").await, &keys).unwrap();
    assert_eq!(
        (absent.state, absent.result_sha256, absent.fencing_token),
        (State::Absent, None, grant.fencing_token)
    );

    // A superseded attempt's late confirm, after every later attempt said it did nothing: the
    // receipt names the latest attempt, and the one whose confirm proved the effect.
    let first = claim(&mut client, begin("receipt-5", ARGS)).await;
    report_absent(&mut client, "receipt-5", first.fencing_token)
        .await
        .unwrap();
    let second = claim(&mut client, begin("receipt-5", ARGS)).await;
    report_absent(&mut client, "receipt-5", second.fencing_token)
        .await
        .unwrap();
    let lost = confirm(&mut client, "receipt-5", first.fencing_token, RESULT).await;
    assert!(
        lost.is_err(),
        "a superseded attempt's right is lost: {lost:?}"
    );
    let late = Receipt::verify(&linked_receipt(&mut client, "receipt-5").await, &keys).unwrap();
    assert_eq!(
        (
            late.state,
            late.attempt,
            late.fencing_token,
            late.confirmed_by
        ),
        (
            State::Confirmed,
            2,
            second.fencing_token,
            Some(first.fencing_token)
        )
    );
    assert!(late.covers_result(RESULT));

    // Not settled, or not there: no receipt.
    claim(&mut client, begin("receipt-3", ARGS)).await;
    let refused = receipt_of(&mut client, "receipt-3").await.unwrap_err();
    assert_eq!(
        (refused.code(), reason(&refused)),
        (tonic::Code::FailedPrecondition, "NOT_SETTLED".to_owned())
    );
    let missing = receipt_of(&mut client, "receipt-none").await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);

    // A replay carries the receipt when asked, and only then.
    let mut again = begin("receipt-1", ARGS);
    let replay = expect_replay(&client.begin(again.clone()).await.unwrap().into_inner());
    assert_eq!(replay.receipt, "");
    again.want_receipt = true;
    let replay = expect_replay(&client.begin(again).await.unwrap().into_inner());
    let replayed = Receipt::verify(&replay.receipt, &keys).unwrap();
    assert!(replayed.covers_result(&replay.result));
    assert_eq!(replayed.sequence, confirmed);

    // The stored result rewritten in the database: the receipt kept does not cover what the
    // ledger now replays, and the ledger signs no receipt of what its chain did not record.
    let blob = match store {
        Engine::Postgres => "'\\x7b7d'::bytea",
        Engine::Sqlite => "X'7b7d'",
    };
    db.execute(&format!(
        "UPDATE operations SET result = {blob} WHERE operation_id = 'receipt-1'"
    ))
    .await;
    let mut again = begin("receipt-1", ARGS);
    again.want_receipt = true;
    let rewritten = expect_replay(&client.begin(again).await.unwrap().into_inner());
    assert_eq!(rewritten.result, b"{}");
    assert!(!receipt.covers_result(&rewritten.result));
    assert_eq!(rewritten.receipt, "", "no receipt of a rewritten result");
    let refused = receipt_of(&mut client, "receipt-1").await.unwrap_err();
    assert_eq!(reason(&refused), "HISTORY_MISMATCH", "{refused:?}");
    // A state rewritten without its event: refused too.
    db.execute("UPDATE operations SET state = 'CONFIRMED' WHERE operation_id = 'receipt-2'")
        .await;
    let refused = receipt_of(&mut client, "receipt-2").await.unwrap_err();
    assert_eq!(reason(&refused), "HISTORY_MISMATCH", "{refused:?}");

    // While the tenant is held (the ledger is behind what a client saw), no ABSENT is signed:
    // a later attempt it lost may have run.
    let grant = claim(&mut client, begin("receipt-4", ARGS)).await;
    report_absent(&mut client, "receipt-4", grant.fencing_token)
        .await
        .unwrap();
    linked_receipt(&mut client, "receipt-4").await;
    db.execute(
        "INSERT INTO continuity (tenant, epoch, held_since, why, client_epoch, client_token, \
         operation_id, ledger_epoch, ledger_token) \
         VALUES ('default', 0, 1, 'TOKEN_AHEAD', 0, 999999999, 'receipt-4', 0, 1)",
    )
    .await;
    eventually(
        patient(Duration::from_secs(10)),
        "the hold to be seen",
        || {
            let mut client = client.clone();
            async move {
                let refused = receipt_of(&mut client, "receipt-4").await.err()?;
                (reason(&refused) == "LEDGER_BEHIND").then_some(())
            }
        },
    )
    .await;
    ledger.stop().await;
}

async fn a_rotation_keeps_the_receipts_of_the_old_key_verifiable(store: Engine) {
    let db = TestDb::new(store).await;
    let file = db.scratch_dir().join("signing.key");
    signing_keys(&file, &["rotate"]);
    let flag = ["--signing-key-file", file.to_str().unwrap()];
    let ledger = TestLedger::spawn_with(&db, &flag).await;
    let mut client = ledger.client().await;
    let grant = claim(&mut client, begin("rotated-1", ARGS)).await;
    confirm(&mut client, "rotated-1", grant.fencing_token, RESULT)
        .await
        .unwrap();
    let before = linked_receipt(&mut client, "rotated-1").await;
    ledger.stop().await;

    let old = pinned(&file);
    let printed = signing_keys(&file, &["rotate"]);
    assert!(printed.contains("retired"), "{printed}");
    let ledger = TestLedger::spawn_with(&db, &flag).await;
    let mut client = ledger.client().await;
    let after = receipt_of(&mut client, "rotated-1").await.unwrap();
    let now = pinned(&file);
    assert_eq!(now.len(), 2);
    // The old receipt verifies with the keys kept; the new one is the new key's, which the
    // old key alone does not verify.
    let old_receipt = Receipt::verify(&before, &now).unwrap();
    let new_receipt = Receipt::verify(&after, &now).unwrap();
    assert_eq!(old_receipt.key, old[0].id());
    assert_ne!(new_receipt.key, old_receipt.key);
    assert!(Receipt::verify(&after, &old).is_err());
    let served = served_keys(&mut client).await;
    let listed: Vec<(String, bool)> = served
        .keys
        .iter()
        .map(|key| (key.key_id.clone(), key.active))
        .collect();
    assert_eq!(
        listed,
        [
            (new_receipt.key.clone(), true),
            (old_receipt.key.clone(), false)
        ]
    );
    ledger.stop().await;
}

/// A SQLite ledger makes its key file beside the database on its first start; a PostgreSQL
/// one signs nothing without a key file; neither starts on a key file named that is not there
/// (replicas on PostgreSQL must share one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_signing_key_comes_from() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let served = served_keys(&mut client).await;
    assert_eq!(served.keys.len(), 1, "{served:?}");
    let beside = format!("{}.signing-key", db.url.trim_start_matches("sqlite://"));
    let file = std::path::Path::new(&beside);
    assert_eq!(pinned(file)[0].id(), served.keys[0].key_id);
    ledger.stop().await;

    let pg = TestDb::new(Engine::Postgres).await;
    let ledger = TestLedger::spawn(&pg).await;
    let mut client = ledger.client().await;
    assert!(served_keys(&mut client).await.keys.is_empty());
    let grant = claim(&mut client, begin("unsigned", ARGS)).await;
    confirm(&mut client, "unsigned", grant.fencing_token, RESULT)
        .await
        .unwrap();
    let refused = receipt_of(&mut client, "unsigned").await.unwrap_err();
    assert_eq!(reason(&refused), "NO_SIGNING_KEY");
    // A replay asked for a receipt still replays.
    let mut again = begin("unsigned", ARGS);
    again.want_receipt = true;
    let replay = expect_replay(&client.begin(again).await.unwrap().into_inner());
    assert_eq!(
        (replay.result.as_slice(), replay.receipt.as_str()),
        (RESULT, "")
    );
    ledger.stop().await;

    // A key file named is one made already, on either database: a misspelt path is not a
    // new key.
    for url in [&db.url, &pg.url] {
        let missing = pg.scratch_dir().join("none.key");
        let config = onced::Config::try_parse_from([
            "onced",
            "--database-url",
            url,
            "--signing-key-file",
            missing.to_str().unwrap(),
        ])
        .unwrap();
        let refused = config.resolve().unwrap_err();
        assert!(
            format!("{refused:#}").contains("onced signing-keys rotate"),
            "{refused:#}"
        );
        assert!(!missing.exists());
    }
}
