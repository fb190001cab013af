//! SIGKILL `onced` in the middle of a load: every acknowledged confirm survives and replays.

use std::sync::Arc;
use std::time::Duration;

use once_api::pb;
use tokio::sync::Mutex;

use crate::support::*;

on_both_backends!(acknowledged_confirms_survive_sigkill);

/// Operation ids and the results the ledger acknowledged for them.
type Acknowledged = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

async fn acknowledged_confirms_survive_sigkill(store: Store) {
    let db = TestDb::new(store).await;
    let log = db
        .scratch_dir()
        .join(format!("onced-{}.log", uuid::Uuid::new_v4().simple()));
    let onced = OncedProcess::spawn(&db.url, log.clone(), &[]).await;
    let client = onced.client().await;

    // Workers claim and confirm operations as fast as they can, recording every confirm the
    // ledger acknowledged, until the process dies under them.
    let acknowledged: Acknowledged = Arc::default();
    let mut workers = Vec::new();
    for worker in 0..4 {
        let mut client = client.clone();
        let acknowledged = acknowledged.clone();
        workers.push(tokio::spawn(async move {
            for n in 0.. {
                let id = format!("durable-{worker}-{n}");
                let Ok(response) = client.begin(begin(&id, ARGS)).await else {
                    return;
                };
                let grant = expect_execute(&response.into_inner());
                let result = format!("{{\"refund\":\"re_{worker}_{n}\",\"bytes\":[0,1,2]}}\u{0}")
                    .into_bytes();
                if confirm(&mut client, &id, grant.fencing_token, &result)
                    .await
                    .is_ok()
                {
                    acknowledged.lock().await.push((id, result));
                } else {
                    return;
                }
            }
        }));
    }
    eventually(
        Duration::from_secs(30),
        "some confirms acknowledged",
        || async { (acknowledged.lock().await.len() >= 40).then_some(()) },
    )
    .await;
    onced.kill().await;
    for worker in workers {
        within(Duration::from_secs(30), "workers to notice", worker)
            .await
            .unwrap();
    }

    let restarted = OncedProcess::spawn(&db.url, log, &[]).await;
    let mut client = restarted.client().await;
    let acknowledged = acknowledged.lock().await.clone();
    assert!(acknowledged.len() >= 40);
    for (id, result) in &acknowledged {
        let response = client.begin(begin(id, ARGS)).await.unwrap().into_inner();
        let replay = expect_replay(&response);
        assert_eq!(&replay.result, result, "{id} replays byte for byte");
        assert_eq!(
            state_of(&mut client, id).await,
            pb::OperationState::Confirmed
        );
    }
    assert!(restarted.terminate().await.success());
}

/// The database holds every stored result: its file, and the WAL and shared-memory files SQLite
/// makes beside it, are readable by their owner only; an existing file others can read is
/// served, with a warning that names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_files_are_created_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let url = format!("sqlite://{}", path.display());
    let log = dir.path().join("onced.log");
    let onced = OncedProcess::spawn(&url, log.clone(), &[]).await;
    let mut client = onced.client().await;
    let grant = claim(&mut client, begin("private-1", ARGS)).await;
    confirm(&mut client, "private-1", grant.fencing_token, b"{}")
        .await
        .unwrap();
    let mode = |suffix: &str| {
        let file = format!("{}{suffix}", path.display());
        std::fs::metadata(&file)
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .permissions()
            .mode()
            & 0o777
    };
    for suffix in ["", "-wal", "-shm"] {
        assert_eq!(mode(suffix), 0o600, "ledger.db{suffix}");
    }
    assert!(!onced.log().contains("readable by other users"));
    onced.terminate().await;

    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let again = OncedProcess::spawn(&url, dir.path().join("again.log"), &[]).await;
    let warned = eventually(Duration::from_secs(5), "the warning", || async {
        let log = again.log();
        log.contains("readable by other users").then_some(log)
    })
    .await;
    assert!(
        warned.contains("ledger.db") && warned.contains("644"),
        "{warned}"
    );
    again.terminate().await;
}
