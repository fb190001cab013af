//! A PostgreSQL outage: UNAVAILABLE (retryable), nothing half-written, recovery on its own.
//!
//! The ledger reaches PostgreSQL through a TCP proxy the test controls, so the outage is real
//! (connections reset, new ones refused) without stopping the shared server.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use tonic_health::pb::health_check_response::ServingStatus;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_is_unavailable_and_recovers() {
    let db = TestDb::new(Store::Postgres).await;
    let url: url_parts::Parts = url_parts::parse(&db.url);
    let upstream: SocketAddr = tokio::net::lookup_host(format!("{}:{}", url.host, url.port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(upstream).await;
    let proxied = format!("postgres://{}@{}/{}", url.user, proxy.addr, url.database);
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

async fn ledger_health(addr: SocketAddr) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let reply = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "once.ledger.v1.Ledger".into(),
        })
        .await
        .unwrap();
    ServingStatus::try_from(reply.into_inner().status).unwrap()
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
