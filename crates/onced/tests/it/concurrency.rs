//! Several `onced` processes on one database: one claim wins, whichever replica it reaches.

use futures::future::join_all;

use crate::support::*;

on_both_backends!(sixty_four_begins_over_three_processes_execute_once);

async fn sixty_four_begins_over_three_processes_execute_once(store: Engine) {
    let db = TestDb::new(store).await;
    let logs = db.scratch_dir();
    // Started together on a fresh database, so they also race to apply the migrations.
    let replicas = join_all((0..3).map(|i| {
        let log = logs.join(format!("onced-{i}-{}.log", uuid::Uuid::new_v4().simple()));
        OncedProcess::spawn(&db.url, log, &[])
    }))
    .await;
    let mut clients: Vec<Grpc> = Vec::new();
    for replica in &replicas {
        clients.push(replica.client().await);
    }

    let operations = 200;
    for op in 0..operations {
        let id = format!("refund:contended-{op}");
        let (executes, in_progress) = race(&clients, &id, 64).await;
        assert_eq!((executes, in_progress), (1, 63), "operation {op}");
    }
    assert_eq!(db.scalar("SELECT count(*) FROM attempts").await, operations);
    assert_eq!(
        db.scalar("SELECT count(*) FROM events WHERE kind = 'CLAIMED'")
            .await,
        operations
    );

    for replica in replicas {
        assert!(
            replica.terminate().await.success(),
            "onced exits cleanly on SIGTERM"
        );
    }
}
