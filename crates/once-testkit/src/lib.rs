//! The once-ledger test harness: fresh databases (`once-testdb`, re-exported), ledgers
//! running in the test's process on real sockets, gRPC clients and request builders, and waiting
//! on conditions with deadlines.
//!
//! Every wait is scaled by the patience factor, `ONCE_TEST_PATIENCE` (a number, 1 by default):
//! on a slow or loaded machine, raise it rather than editing deadlines.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser as _;
use once_api::pb;
use once_api::pb::ledger_client::LedgerClient;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// A gRPC client of the ledger.
pub type Grpc = LedgerClient<Channel>;

pub use once_testdb::{on_both_backends, postgres_admin_url, Engine, TestDb};

/// How much longer than its stated limit every wait may take: `ONCE_TEST_PATIENCE`, 1 unless
/// set.
pub fn patience() -> f64 {
    std::env::var("ONCE_TEST_PATIENCE")
        .ok()
        .and_then(|factor| factor.parse::<f64>().ok())
        .filter(|factor| factor.is_finite() && *factor >= 1.0)
        .unwrap_or(1.0)
}

/// `limit`, scaled by the [`patience`] factor.
pub fn patient(limit: Duration) -> Duration {
    limit.mul_f64(patience())
}

/// Awaits `future`, failing the test if it takes longer than `limit` (scaled by [`patience`]).
pub async fn within<F: std::future::Future>(limit: Duration, what: &str, future: F) -> F::Output {
    let limit = patient(limit);
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?} waiting for: {what}"))
}

/// Flags every test ledger gets: a fast lease sweeper and a short wait for connections.
pub const TEST_FLAGS: &[&str] = &[
    "--lease-sweep-interval",
    "50ms",
    "--db-acquire-timeout",
    "1s",
];

fn config(url: &str, extra: &[&str]) -> onced::Config {
    let mut args = vec!["onced", "--database-url", url, "--listen", "127.0.0.1:0"];
    args.extend_from_slice(TEST_FLAGS);
    args.extend_from_slice(extra);
    onced::Config::try_parse_from(args).expect("test configuration parses")
}

/// An `onced` running in this process on a real socket.
#[derive(Debug)]
pub struct TestLedger {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestLedger {
    pub async fn spawn(db: &TestDb) -> Self {
        Self::spawn_with(db, &[]).await
    }

    /// Starts a ledger with extra `onced` flags.
    pub async fn spawn_with(db: &TestDb, extra: &[&str]) -> Self {
        Self::spawn_url(&db.url, extra).await
    }

    /// Starts a ledger on which explicit ids are kept 1 ms once settled, with the retention
    /// sweeper running every `sweep_interval`.
    pub async fn spawn_with_short_retention(db: &TestDb, sweep_interval: &str) -> Self {
        let flags = [
            "--retention-explicit",
            "1ms",
            "--retention-sweep-interval",
            sweep_interval,
        ];
        Self::spawn_with(db, &flags).await
    }

    pub async fn spawn_url(url: &str, extra: &[&str]) -> Self {
        let ledger = Self::start(url, extra).await;
        wait_serving(ledger.addr).await;
        ledger
    }

    /// Starts a ledger on `addr` (where an earlier one served: a restart) and waits for it.
    pub async fn spawn_at(url: &str, addr: SocketAddr, extra: &[&str]) -> Self {
        let listener = TcpListener::bind(addr)
            .await
            .expect("bind the same address");
        let ledger = Self::start_on(listener, url, extra);
        wait_serving(ledger.addr).await;
        ledger
    }

    /// Starts a ledger without waiting for it to serve: for one that serves TLS, which
    /// [`wait_serving_on`] waits for.
    pub async fn start(url: &str, extra: &[&str]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::start_on(listener, url, extra)
    }

    fn start_on(listener: TcpListener, url: &str, extra: &[&str]) -> Self {
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let config = config(url, extra);
        let task = tokio::spawn(async move {
            let settings = config.resolve()?;
            onced::run(settings, listener, async {
                let _ = stopped.await;
            })
            .await
        });
        TestLedger {
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Starts a ledger serving TLS with the PEM `cert` and `key` (written into `db`'s
    /// directory), and waits until a client trusting `ca` is served.
    pub async fn spawn_tls(db: &TestDb, cert: &str, key: &str, ca: &str, extra: &[&str]) -> Self {
        let dir = db.scratch_dir();
        let cert = write_file(&dir, "tls-cert.pem", cert);
        let key = write_file(&dir, "tls-key.pem", key);
        let mut flags = vec![
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ];
        flags.extend_from_slice(extra);
        let ledger = Self::start(&db.url, &flags).await;
        wait_serving_on(https(ledger.addr.port(), ca, None)).await;
        ledger
    }

    pub async fn client(&self) -> Grpc {
        client(self.addr).await
    }

    /// Graceful shutdown; fails the test if the server did not stop cleanly.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let task = self.task.take().unwrap();
        within(Duration::from_secs(10), "the ledger to stop", task)
            .await
            .expect("ledger task")
            .expect("ledger shut down cleanly");
    }
}

impl Drop for TestLedger {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A key to bootstrap a ledger with: `label`, then 64 hex digits of two random UUIDs (244
/// random bits; shaped as the ledger requires of a supplied key).
pub fn strong_key(label: &str) -> String {
    format!(
        "{label}-{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Writes `contents` to `name` in `dir` whole: written under another name, then renamed, so a
/// server re-reading the file never sees half of it.
pub fn write_file(dir: &std::path::Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    let partial = dir.join(format!("{name}.partial"));
    std::fs::write(&partial, contents).expect("write a test file");
    std::fs::rename(&partial, &path).expect("rename a test file");
    path
}

/// An `https://localhost:PORT` endpoint trusting the PEM authority `ca`, presenting the PEM
/// certificate and key `identity` when given.
pub fn https(
    port: u16,
    ca: &str,
    identity: Option<&(String, String)>,
) -> tonic::transport::Endpoint {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    tonic::transport::Endpoint::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .tls_config(tls)
        .unwrap()
}

/// `message` with `authorization: Bearer <key>`, when a key is given.
pub fn with_key<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let value = format!("Bearer {key}")
            .parse()
            .expect("a key fits a header");
        request.metadata_mut().insert("authorization", value);
    }
    request
}

pub async fn client(addr: SocketAddr) -> Grpc {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(patient(Duration::from_secs(2)))
        .connect()
        .await
        .expect("connect to ledger");
    LedgerClient::new(channel)
}

/// Waits until the gRPC health service at `addr` says SERVING.
pub async fn wait_serving(addr: SocketAddr) {
    wait_serving_on(Channel::from_shared(format!("http://{addr}")).unwrap()).await
}

/// Waits until the ledger at `endpoint` (TLS settings included) reports SERVING.
pub async fn wait_serving_on(endpoint: tonic::transport::Endpoint) {
    let endpoint = &endpoint;
    eventually(Duration::from_secs(60), "ledger serving", || async move {
        // Each look is bounded: a port that is open before its server serves (the store is
        // still being opened) holds a request rather than refusing it.
        let look = async {
            let channel = endpoint.connect().await.ok()?;
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            let request = tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            };
            let reply = health.check(request).await.ok()?;
            let serving = tonic_health::pb::health_check_response::ServingStatus::Serving;
            (reply.into_inner().status == serving as i32).then_some(())
        };
        tokio::time::timeout(Duration::from_secs(2), look)
            .await
            .ok()
            .flatten()
    })
    .await;
}

/// Polls `probe` until it returns `Some`, failing the test after `limit`. For conditions that
/// depend on a clock the test does not own (the database's) or on another process.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let limit = patient(limit);
    let deadline = tokio::time::Instant::now() + limit;
    let mut pause = Duration::from_millis(10);
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// The arguments every test operation uses unless it says otherwise.
pub const ARGS: &str = r#"{"order":"o-1","amount_cents":500,"currency":"eur"}"#;

/// A Begin for an explicit operation id with a fresh attempt id. The operation id is added to
/// the arguments as `op`, so that operations of one test never share a fingerprint (and so
/// never trip the fresh-id guard) unless a test means them to: see [`begin_exact`].
pub fn begin(operation_id: &str, arguments_json: &str) -> pb::BeginRequest {
    let mut arguments: serde_json::Value =
        serde_json::from_str(arguments_json).expect("test arguments are JSON");
    arguments["op"] = operation_id.into();
    begin_exact(operation_id, &arguments.to_string())
}

/// A Begin whose arguments are exactly `arguments_json`.
pub fn begin_exact(operation_id: &str, arguments_json: &str) -> pb::BeginRequest {
    pb::BeginRequest {
        tool: "issue_refund".into(),
        identity: Some(pb::begin_request::Identity::OperationId(
            operation_id.into(),
        )),
        effect: Some(pb::begin_request::Effect::ArgumentsJson(
            arguments_json.into(),
        )),
        attempt_id: new_attempt_id(),
        context: Some(pb::AttemptContext {
            client_name: "it".into(),
            session_id: "session-1".into(),
            request_id: "1".into(),
        }),
        ..Default::default()
    }
}

pub fn new_attempt_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

pub fn ms(ms: u64) -> prost_types::Duration {
    once_api::convert::duration(ms as i64)
}

/// The decision of a Begin response, for matching.
pub fn decision(response: &pb::BeginResponse) -> &pb::begin_response::Decision {
    response.decision.as_ref().expect("a decision")
}

pub fn decision_name(response: &pb::BeginResponse) -> &'static str {
    use pb::begin_response::Decision::*;
    match decision(response) {
        Execute(_) => "EXECUTE",
        Replay(_) => "REPLAY",
        InProgress(_) => "IN_PROGRESS",
        Unknown(_) => "UNKNOWN",
        Conflict(_) => "CONFLICT",
    }
}

pub fn expect_execute(response: &pb::BeginResponse) -> pb::Execute {
    match decision(response) {
        pb::begin_response::Decision::Execute(grant) => grant.clone(),
        _ => panic!("expected EXECUTE, got {response:?}"),
    }
}

pub fn expect_replay(response: &pb::BeginResponse) -> pb::Replay {
    match decision(response) {
        pb::begin_response::Decision::Replay(replay) => replay.clone(),
        _ => panic!("expected REPLAY, got {response:?}"),
    }
}

pub fn expect_unknown(response: &pb::BeginResponse) -> pb::Unknown {
    match decision(response) {
        pb::begin_response::Decision::Unknown(unknown) => unknown.clone(),
        _ => panic!("expected UNKNOWN, got {response:?}"),
    }
}

/// Begins and returns the grant, failing unless the decision is EXECUTE.
pub async fn claim(client: &mut Grpc, request: pb::BeginRequest) -> pb::Execute {
    let response = client.begin(request).await.expect("begin").into_inner();
    expect_execute(&response)
}

/// Confirms with the provider ref `re_1`.
pub async fn confirm(
    client: &mut Grpc,
    id: &str,
    token: u64,
    result: &[u8],
) -> Result<i32, tonic::Status> {
    confirm_with(client, id, token, result, "re_1").await
}

pub async fn confirm_with(
    client: &mut Grpc,
    id: &str,
    token: u64,
    result: &[u8],
    provider_ref: &str,
) -> Result<i32, tonic::Status> {
    client
        .confirm(pb::ConfirmRequest {
            operation_id: id.into(),
            fencing_token: token,
            result: result.to_vec(),
            provider_ref: provider_ref.into(),
        })
        .await
        .map(|r| r.into_inner().state)
}

pub async fn report_absent(client: &mut Grpc, id: &str, token: u64) -> Result<i32, tonic::Status> {
    client
        .report_absent(pb::ReportAbsentRequest {
            operation_id: id.into(),
            fencing_token: token,
            reason: "provider refused: card declined".into(),
        })
        .await
        .map(|r| r.into_inner().state)
}

pub async fn report_unknown(client: &mut Grpc, id: &str, token: u64) -> Result<i32, tonic::Status> {
    client
        .report_unknown(pb::ReportUnknownRequest {
            operation_id: id.into(),
            fencing_token: token,
            reason: "timeout after sending".into(),
        })
        .await
        .map(|r| r.into_inner().state)
}

/// Resolves `id` as an operator who examined its latest attempt (read just before).
pub async fn resolve(
    client: &mut Grpc,
    id: &str,
    outcome: pb::OperationState,
    resolution_id: &str,
) -> Result<i32, tonic::Status> {
    let examined = client
        .get_operation(pb::GetOperationRequest {
            operation_id: id.into(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().operation.unwrap_or_default().fencing_token)
        .unwrap_or(1);
    resolve_examined(client, id, outcome, resolution_id, examined).await
}

/// Resolves `id` as an operator who examined the attempt holding `fencing_token`.
pub async fn resolve_examined(
    client: &mut Grpc,
    id: &str,
    outcome: pb::OperationState,
    resolution_id: &str,
    fencing_token: u64,
) -> Result<i32, tonic::Status> {
    let confirmed = outcome == pb::OperationState::Confirmed;
    client
        .resolve(pb::ResolveRequest {
            operation_id: id.into(),
            outcome: outcome as i32,
            result: if confirmed {
                b"{\"resolved\":true}".to_vec()
            } else {
                vec![]
            },
            provider_ref: if confirmed {
                "re_op".into()
            } else {
                String::new()
            },
            reason: "checked the provider dashboard".into(),
            operator: "alice".into(),
            resolution_id: resolution_id.into(),
            fencing_token,
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().state)
}

pub async fn get(client: &mut Grpc, id: &str) -> pb::GetOperationResponse {
    client
        .get_operation(pb::GetOperationRequest {
            operation_id: id.into(),
            ..Default::default()
        })
        .await
        .expect("get operation")
        .into_inner()
}

pub async fn state_of(client: &mut Grpc, id: &str) -> pb::OperationState {
    let op = get(client, id).await.operation.expect("operation");
    pb::OperationState::try_from(op.state).expect("valid state")
}

/// Waits until retention has deleted `id` (the sweeper runs on its own schedule).
pub async fn wait_deleted(db: &TestDb, id: &str) {
    let sql = format!("SELECT count(*) FROM operations WHERE operation_id = '{id}'");
    eventually(
        Duration::from_secs(10),
        &format!("retention to delete {id}"),
        || async { (db.scalar(&sql).await == 0).then_some(()) },
    )
    .await;
}

/// Checks that `id` was CONFIRMED with no lease expiry on the way: its heartbeats held.
pub async fn confirmed_without_lease_expiry(client: &mut Grpc, id: &str) {
    let history = get(client, id).await;
    assert!(
        history.events.iter().all(|e| e.kind != "LEASE_EXPIRED"),
        "{:?}",
        history.events
    );
    assert_eq!(
        history.operation.unwrap().state,
        pb::OperationState::Confirmed as i32
    );
}

/// Waits until the operation is in `state` (moved there by the sweeper or another party).
pub async fn wait_for_state(client: &Grpc, id: &str, state: pb::OperationState) {
    eventually(
        Duration::from_secs(10),
        &format!("{id} to become {state:?}"),
        || {
            let mut client = client.clone();
            let id = id.to_owned();
            async move { (state_of(&mut client, &id).await == state).then_some(()) }
        },
    )
    .await
}

/// The `ErrorInfo.reason` of a status.
pub fn reason(status: &tonic::Status) -> String {
    use tonic_types::StatusExt as _;
    status
        .get_error_details()
        .error_info()
        .map(|info| info.reason.clone())
        .unwrap_or_default()
}

/// The field an INVALID_ARGUMENT status names.
pub fn field(status: &tonic::Status) -> String {
    use tonic_types::StatusExt as _;
    status
        .get_error_details()
        .error_info()
        .and_then(|info| info.metadata.get("field").cloned())
        .unwrap_or_default()
}

/// Sends `n` Begins for `id` at once, spread over `clients`, each with its own attempt id.
/// Returns how many were EXECUTE and IN_PROGRESS, failing on any other decision. A Begin
/// answered UNAVAILABLE (a replica out of database connections) is sent again as it was, as
/// clients do: with the same attempt id, it can only get the answer it would have got.
pub async fn race(clients: &[Grpc], id: &str, n: usize) -> (usize, usize) {
    let begins = (0..n).map(|i| {
        let mut client = clients[i % clients.len()].clone();
        let request = begin(id, ARGS);
        async move {
            let deadline = tokio::time::Instant::now() + patient(Duration::from_secs(10));
            loop {
                match client.begin(request.clone()).await {
                    Ok(response) => return response.into_inner(),
                    Err(status)
                        if status.code() == tonic::Code::Unavailable
                            && tokio::time::Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(status) => panic!("begin: {status:?}"),
                }
            }
        }
    });
    let responses = futures::future::join_all(begins).await;
    let count = |name: &str| {
        responses
            .iter()
            .filter(|r| decision_name(r) == name)
            .count()
    };
    let (executes, in_progress) = (count("EXECUTE"), count("IN_PROGRESS"));
    assert_eq!(
        executes + in_progress,
        n,
        "unexpected decisions: {responses:?}"
    );
    (executes, in_progress)
}

/// Serves `router` on a fresh loopback port; returns its base URL.
/// fakepay's counters (refunds made, lookups answered, …) at `base`.
pub async fn fakepay_stats(base: &str) -> serde_json::Value {
    reqwest::get(format!("{base}/_fakepay/stats"))
        .await
        .expect("fakepay stats")
        .json()
        .await
        .expect("fakepay stats as JSON")
}

pub async fn serve(router: axum::Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// Writes an `onced --config` file beside the database; returns its path.
pub fn config_file(db: &TestDb, contents: String) -> String {
    let path = db
        .scratch_dir()
        .join(format!("onced-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, contents).expect("write config");
    path.to_str().expect("a UTF-8 path").to_owned()
}

/// A TCP proxy in front of a ledger that loses one answer, as a network that drops a response
/// does: the connection over which a client sends `marker` (bytes of a request's body, such as
/// a resolution id) carries the request to the ledger, but nothing the ledger sends back from
/// then on; once [`LosingProxy::cut`] is called that connection is closed. Every other
/// connection passes every byte.
#[derive(Debug)]
pub struct LosingProxy {
    pub addr: SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
}

impl LosingProxy {
    pub async fn start(target: SocketAddr, marker: Vec<u8>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        let (cut, cutting) = tokio::sync::watch::channel(false);
        let marker = std::sync::Arc::new(marker);
        let armed_once = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                tokio::spawn(relay(
                    client,
                    server,
                    marker.clone(),
                    armed_once.clone(),
                    cutting.clone(),
                ));
            }
        });
        LosingProxy { addr, cut }
    }

    /// Closes the connection whose answer is being lost.
    pub fn cut(&self) {
        let _ = self.cut.send(true);
    }
}

async fn relay(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    marker: std::sync::Arc<Vec<u8>>,
    armed_once: std::sync::Arc<std::sync::atomic::AtomicBool>,
    mut cutting: tokio::sync::watch::Receiver<bool>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let (armed_tx, armed) = tokio::sync::watch::channel(false);
    let upstream = async move {
        let mut seen: Vec<u8> = Vec::new();
        let mut buffer = [0u8; 16 * 1024];
        loop {
            let n = match from_client.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            seen.extend_from_slice(&buffer[..n]);
            let already = *armed_tx.borrow();
            if !already
                && seen.windows(marker.len()).any(|w| w == marker.as_slice())
                && !armed_once.swap(true, Ordering::SeqCst)
            {
                let _ = armed_tx.send(true);
            }
            let keep = seen.len().saturating_sub(marker.len());
            seen.drain(..keep);
            if to_server.write_all(&buffer[..n]).await.is_err() {
                return;
            }
        }
    };
    let mut losing = armed.clone();
    let downstream = async move {
        let mut buffer = [0u8; 16 * 1024];
        loop {
            let n = match from_server.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // Once armed, the ledger's answers are lost.
            let lost = *armed.borrow();
            if !lost && to_client.write_all(&buffer[..n]).await.is_err() {
                return;
            }
        }
    };
    let cut = async move {
        let _ = losing.wait_for(|armed| *armed).await;
        let _ = cutting.wait_for(|cut| *cut).await;
    };
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
        _ = cut => {}
    }
}

/// Has the fake provider at `provider` make the refund of payment intent `payment_intent` that
/// the attempt granted `provider_key` performs, as its executor would just before its answer
/// is lost: what a reconciler then finds.
pub async fn refund_at_provider(provider: &str, payment_intent: &str, provider_key: &str) {
    reqwest::Client::new()
        .post(format!("{provider}/v1/refunds"))
        .header("Idempotency-Key", provider_key)
        .form(&[
            ("payment_intent", payment_intent),
            ("amount", "500"),
            ("currency", "eur"),
            ("metadata[once_provider_key]", provider_key),
        ])
        .send()
        .await
        .expect("the provider answers")
        .error_for_status()
        .expect("the provider refunds");
}
