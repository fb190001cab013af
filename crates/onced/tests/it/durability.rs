//! SIGKILL `onced` in the middle of a load: every acknowledged confirm survives and replays.

use std::sync::Arc;
use std::time::Duration;

use once_api::pb;
use tokio::sync::Mutex;

use crate::support::*;

on_both_backends!(acknowledged_confirms_survive_sigkill);

/// Operation ids and the results the ledger acknowledged for them.
type Acknowledged = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

async fn acknowledged_confirms_survive_sigkill(store: Engine) {
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

/// SQLite rolls a write back itself when the disk is full. On a small filesystem the test
/// mounts and fills: every write the ledger could not make answers UNAVAILABLE (retryable, and
/// nothing of it was applied), health says NOT_SERVING while the ledger cannot write, and once
/// space comes back every write is served again, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_answers_unavailable_and_recovers_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("disk");
    std::fs::create_dir(&mount).unwrap();
    let url = format!("sqlite://{}/ledger.db", mount.display());
    // A mount namespace of its own, in which a 12 MiB tmpfs covers `mount`.
    let onced = OncedProcess::launch_under(
        &[
            "unshare",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            r#"mount -t tmpfs -o size=12m tmpfs "$0" && exec "$@""#,
            mount.to_str().unwrap(),
        ],
        &url,
        dir.path().join("onced.log"),
        &["--health-check-interval", "100ms"],
        &[],
        |addr| tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap(),
    )
    .await;
    let disk = std::path::PathBuf::from(format!("/proc/{}/root{}", onced.pid(), mount.display()));
    assert!(disk.join("ledger.db").exists() && !mount.join("ledger.db").exists());
    let mut client = onced.client().await;
    let result = vec![b'r'; 16 * 1024];
    let grant = claim(&mut client, begin("disk-before", ARGS)).await;
    confirm(&mut client, "disk-before", grant.fencing_token, &result)
        .await
        .unwrap();

    let ballast = disk.join("ballast");
    fill(&ballast);
    // Writes until the ledger has refused twenty: each refusal is a retryable outage.
    let (mut refused_claims, mut refused_confirms) = (Vec::new(), Vec::new());
    for n in 0..5_000 {
        if refused_claims.len() + refused_confirms.len() >= 20 {
            break;
        }
        let id = format!("disk-full-{n}");
        let grant = match client.begin(begin(&id, ARGS)).await {
            Ok(response) => expect_execute(&response.into_inner()),
            Err(refused) => {
                assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
                refused_claims.push(id);
                continue;
            }
        };
        if let Err(refused) = confirm(&mut client, &id, grant.fencing_token, &result).await {
            assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
            refused_confirms.push((id, grant.fencing_token));
        }
    }
    assert!(
        refused_claims.len() + refused_confirms.len() >= 20,
        "the full disk refused {} writes",
        refused_claims.len() + refused_confirms.len()
    );
    health_is(onced.addr, ServingStatus::NotServing).await;

    std::fs::remove_file(&ballast).unwrap();
    health_is(onced.addr, ServingStatus::Serving).await;
    // Nothing of a refused write was applied, and its retry is served.
    for id in &refused_claims {
        let grant = claim(&mut client, begin(id, ARGS)).await;
        confirm(&mut client, id, grant.fencing_token, &result)
            .await
            .unwrap();
    }
    for (id, token) in &refused_confirms {
        confirm(&mut client, id, *token, &result).await.unwrap();
    }
    for n in 0..200 {
        let id = format!("disk-after-{n}");
        let grant = claim(&mut client, begin(&id, ARGS)).await;
        confirm(&mut client, &id, grant.fencing_token, &result)
            .await
            .unwrap_or_else(|e| panic!("{id}: {e:?}"));
    }
    let replay = client.begin(begin("disk-before", ARGS)).await.unwrap();
    assert_eq!(expect_replay(&replay.into_inner()).result, result);
    assert!(onced.terminate().await.success());
}

/// Writes `path` until its filesystem has no space left.
fn fill(path: &std::path::Path) {
    use std::io::Write as _;
    let mut file = std::fs::File::create(path).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    loop {
        match file.write_all(&chunk).and_then(|()| file.sync_all()) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::StorageFull => return,
            Err(error) => panic!("filling {}: {error}", path.display()),
        }
    }
}
