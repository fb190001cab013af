//! Several `onced` processes on one database: one claim wins, whichever replica it reaches.

use futures::future::join_all;
use once_api::pb::ledger_client::LedgerClient;
use tonic::transport::Channel;

use crate::support::*;

on_both_backends!(sixty_four_begins_over_three_processes_execute_once);

async fn sixty_four_begins_over_three_processes_execute_once(store: Store) {
    let db = TestDb::new(store).await;
    let logs = db.scratch_dir();
    // Started together on a fresh database, so they also race to apply the migrations.
    let replicas = join_all((0..3).map(|i| {
        let log = logs.join(format!("onced-{i}-{}.log", uuid::Uuid::new_v4().simple()));
        OncedProcess::spawn(&db.url, log, &[])
    }))
    .await;
    let mut clients: Vec<LedgerClient<Channel>> = Vec::new();
    for replica in &replicas {
        clients.push(replica.client().await);
    }

    let operations = 200;
    for op in 0..operations {
        let id = format!("refund:contended-{op}");
        let begins = (0..64).map(|i| {
            let mut client = clients[i % clients.len()].clone();
            let request = begin(&id, ARGS);
            async move { client.begin(request).await.expect("begin").into_inner() }
        });
        let responses = join_all(begins).await;
        let executes = responses
            .iter()
            .filter(|r| decision_name(r) == "EXECUTE")
            .count();
        let in_progress = responses
            .iter()
            .filter(|r| decision_name(r) == "IN_PROGRESS")
            .count();
        let others: Vec<_> = responses
            .iter()
            .filter(|r| !matches!(decision_name(r), "EXECUTE" | "IN_PROGRESS"))
            .collect();
        assert!(others.is_empty(), "unexpected decisions: {others:?}");
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
