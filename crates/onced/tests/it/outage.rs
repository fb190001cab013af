//! PostgreSQL outages — unreachable, refusing connections, read-only — answer UNAVAILABLE
//! (retryable), write nothing half-way, say NOT_SERVING, and recover on their own; an executor's
//! lease outlives a failover shorter than the lease.
//!
//! The ledger reaches PostgreSQL through a TCP proxy the test controls, so the outage is real
//! (connections reset, new ones refused) without stopping the shared server; refusals and
//! read-only mode are set on the test's own database.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::support::*;

/// A TCP proxy that can cut every connection and refuse new ones.
struct Proxy {
    addr: SocketAddr,
    down: Arc<AtomicBool>,
    cut: watch::Sender<u64>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let down = Arc::new(AtomicBool::new(false));
        let (cut, _) = watch::channel(0u64);
        let (accept_down, accept_cut) = (down.clone(), cut.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if accept_down.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is reset at once
                }
                let mut cut = accept_cut.subscribe();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Proxy { addr, down, cut }
    }

    fn go_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    fn come_back(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}

/// A proxy in front of `db`'s server, and `db`'s URL through it.
async fn proxied(db: &TestDb) -> (Proxy, String) {
    let url: url_parts::Parts = url_parts::parse(&db.url);
    let upstream: SocketAddr = tokio::net::lookup_host(format!("{}:{}", url.host, url.port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(upstream).await;
    let proxied = format!("postgres://{}@{}/{}", url.user, proxy.addr, url.database);
    (proxy, proxied)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_is_unavailable_and_recovers() {
    let db = TestDb::new(Engine::Postgres).await;
    let (proxy, proxied) = proxied(&db).await;
    let ledger = TestLedger::spawn_url(&proxied, &["--health-check-interval", "100ms"]).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("before-outage", ARGS)).await;
    let before = db.snapshot().await;

    proxy.go_down();
    let refused = client
        .begin(begin("during-outage", ARGS))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert_eq!(reason(&refused), "STORE_UNAVAILABLE");
    assert!(
        !refused.message().to_lowercase().contains("connection"),
        "no database text: {}",
        refused.message()
    );
    let refused = confirm(&mut client, "before-outage", grant.fencing_token, b"ok")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert_eq!(db.snapshot().await, before, "nothing half-written");
    eventually(
        Duration::from_secs(10),
        "health to say NOT_SERVING",
        || async { (ledger_health(ledger.addr).await == ServingStatus::NotServing).then_some(()) },
    )
    .await;

    proxy.come_back();
    // The same calls, retried, now succeed: the server recovered by itself.
    let response = eventually(Duration::from_secs(20), "the ledger to recover", || {
        let mut client = client.clone();
        async move { client.begin(begin("during-outage", ARGS)).await.ok() }
    })
    .await;
    expect_execute(&response.into_inner());
    eventually(
        Duration::from_secs(10),
        "health to say SERVING again",
        || async { (ledger_health(ledger.addr).await == ServingStatus::Serving).then_some(()) },
    )
    .await;
    confirm(&mut client, "before-outage", grant.fencing_token, b"ok")
        .await
        .unwrap();
    ledger.stop().await;
}

/// Begins until the ledger answers (it may take a reconnection), and checks it refused as a
/// retryable outage, never INTERNAL.
async fn refused_as_unavailable(client: &mut Grpc, id: &str) {
    for _ in 0..3 {
        let refused = client.begin(begin(id, ARGS)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert_eq!(reason(&refused), "STORE_UNAVAILABLE");
    }
}

/// The database is set to refuse the ledger with `refuse` (run as administrator, then every
/// session ended so the pool must reconnect), and back with `restore`. Meanwhile a Begin is a
/// retryable UNAVAILABLE that writes nothing and health says NOT_SERVING; afterwards both
/// recover on their own.
async fn refused_then_recovered(refuse: &str, restore: &str) {
    let db = TestDb::new(Engine::Postgres).await;
    let ledger = TestLedger::spawn_with(&db, &["--health-check-interval", "50ms"]).await;
    let mut client = ledger.client().await;
    claim(&mut client, begin("refused-0", ARGS)).await;

    db.as_server_admin(refuse).await;
    db.end_sessions().await;
    refused_as_unavailable(&mut client, "refused-1").await;
    health_is(ledger.addr, ServingStatus::NotServing).await;

    db.as_server_admin(restore).await;
    db.end_sessions().await;
    health_is(ledger.addr, ServingStatus::Serving).await;
    assert_eq!(db.snapshot().await[0], 1, "nothing was written meanwhile");
    claim(&mut client, begin("refused-1", ARGS)).await;
    ledger.stop().await;
}

/// The server refuses new connections (SQLSTATE 55000) after ending the ledger's sessions
/// (57P01), as during a planned switchover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refusing_connections_answers_unavailable_and_not_serving() {
    refused_then_recovered(
        "ALTER DATABASE {db} ALLOW_CONNECTIONS false",
        "ALTER DATABASE {db} ALLOW_CONNECTIONS true",
    )
    .await;
}

/// The database turns read-only (SQLSTATE 25006), as a demoted primary does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_postgres_answers_unavailable_and_not_serving() {
    refused_then_recovered(
        "ALTER DATABASE {db} SET default_transaction_read_only = on",
        "ALTER DATABASE {db} RESET default_transaction_read_only",
    )
    .await;
}

/// The server ends every session at once (a pooler or the server restarts, an operator
/// terminates backends), while the pool holds connections it used a moment ago and so hands out
/// without a ping. No call is answered UNAVAILABLE for a connection that died idle: the first
/// call to find one dead has every connection released before it checked on its way out, and is
/// itself answered on a live one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_the_server_ended_every_session_are_answered() {
    let db = TestDb::new(Engine::Postgres).await;
    // No health check comes first to find the dead connections.
    let ledger = TestLedger::spawn_with(&db, &["--health-check-interval", "1h"]).await;
    let client = ledger.client().await;
    for round in 0..3 {
        // Several connections in the pool, each used within the last second.
        let warm = (0..6).map(|i| {
            let mut client = client.clone();
            async move { claim(&mut client, begin(&format!("warm-{round}-{i}"), ARGS)).await }
        });
        futures::future::join_all(warm).await;
        db.end_sessions().await;
        for i in 0..6 {
            let mut client = client.clone();
            claim(&mut client, begin(&format!("after-{round}-{i}"), ARGS)).await;
        }
    }
    ledger.stop().await;
}

/// Waits until the database clock reads at least `at`.
async fn clock_at(db: &TestDb, at: i64) {
    eventually(Duration::from_secs(30), "the database clock", || async {
        (db.clock().await >= at).then_some(())
    })
    .await;
}

/// A long effect holds a 12 s lease, heartbeating every 4 s, with one try per call; the
/// database is unreachable for 4 s. The heartbeat keeps trying until the lease would end, so
/// the outage costs the attempt nothing: its lease is extended after the outage and it
/// confirms with no lease expiry in its history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_outlasts_a_database_failover_shorter_than_its_lease() {
    use once_client::{ClientConfig, Effect, LedgerClient, OperationSpec, Outcome};

    let db = TestDb::new(Engine::Postgres).await;
    let (proxy, proxied) = proxied(&db).await;
    let ledger = TestLedger::spawn_url(&proxied, &[]).await;
    let mut config = ClientConfig::new(format!("http://{}", ledger.addr));
    config.tries = 1;
    let client = LedgerClient::connect(config).unwrap();
    let spec = OperationSpec::new("long_job", serde_json::json!({"job": "failover"}))
        .explicit("failover-1")
        .lease_ttl(Duration::from_secs(12));
    let column =
        |name: &str| format!("SELECT {name} FROM operations WHERE operation_id = 'failover-1'");
    let outcome = client
        .run(&spec, |_| async {
            let started = db.scalar(&column("lease_started_at")).await;
            clock_at(&db, started + 1_000).await;
            proxy.go_down();
            clock_at(&db, started + 5_000).await;
            proxy.come_back();
            let back = db.clock().await;
            // Without its heartbeat the lease would end at `started + 12 s`, no later than
            // `back + 8 s`; a heartbeat sent after the outage extends it past `back + 10 s`.
            eventually(
                Duration::from_secs(20),
                "a heartbeat after the outage",
                || async {
                    (db.scalar(&column("lease_deadline")).await >= back + 10_000).then_some(())
                },
            )
            .await;
            Ok(Effect::new(b"done".to_vec()))
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed { .. }), "{outcome:?}");
    let mut grpc = ledger.client().await;
    let history = get(&mut grpc, "failover-1").await;
    let kinds: Vec<&str> = history.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["CLAIMED", "CONFIRMED"]);
    ledger.stop().await;
}

/// Just enough URL parsing for the test's own PostgreSQL URLs.
mod url_parts {
    pub struct Parts {
        pub user: String,
        pub host: String,
        pub port: u16,
        pub database: String,
    }

    pub fn parse(url: &str) -> Parts {
        let rest = url.split_once("://").expect("scheme").1;
        let (authority, database) = rest.split_once('/').expect("database");
        let (user, hostport) = authority
            .rsplit_once('@')
            .unwrap_or(("postgres", authority));
        let (host, port) = hostport
            .rsplit_once(':')
            .map_or((hostport, 5432), |(h, p)| (h, p.parse().expect("port")));
        Parts {
            user: user.to_owned(),
            host: host.to_owned(),
            port,
            database: database.split('?').next().unwrap().to_owned(),
        }
    }
}
