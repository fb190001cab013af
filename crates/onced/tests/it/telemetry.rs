//! Telemetry against real parts: a real Prometheus scrapes a real `onced` through a scripted
//! run, and its HTTP API must report what the run did; the shipped alerts pass `promtool`; every
//! query of the shipped Grafana dashboard is one Prometheus accepts; an OTLP collector built from
//! the opentelemetry-proto definitions receives an operator's Reconcile as one trace, down to
//! the provider lookup. (One refund from the MCP client down is `tests/mcp/test_telemetry.py`.)

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use once_api::pb;
use serde_json::Value;

use crate::support::*;

on_both_backends!(prometheus_scrapes_what_the_run_did);

/// The root of the workspace, where `deploy/` is.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A binary the test set-up installs (Debian's `prometheus` package); failing, not skipping,
/// when it is missing.
fn installed(binary: &str) -> PathBuf {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file());
    found.unwrap_or_else(|| {
        panic!("{binary} is not installed: `make test` installs it (Debian's prometheus package)")
    })
}

/// A Prometheus server scraping one target every second, on its own port and storage.
struct Prometheus {
    base: String,
    _child: tokio::process::Child,
}

impl Prometheus {
    async fn scraping(target: SocketAddr, dir: &Path) -> Self {
        let config = write_file(
            dir,
            "prometheus.yml",
            &format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: onced\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        );
        // Prometheus cannot be told to pick its own port and say which; a port just freed is
        // tried, and another if something took it meanwhile.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
            let mut child = tokio::process::Command::new(installed("prometheus"))
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("tsdb").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .expect("start prometheus");
            let base = format!("http://127.0.0.1:{port}");
            let ready = async {
                eventually(
                    Duration::from_secs(30),
                    "prometheus to be ready",
                    || async {
                        let answer = reqwest::get(format!("{base}/-/ready")).await.ok()?;
                        answer.status().is_success().then_some(())
                    },
                )
                .await
            };
            tokio::select! {
                _ = ready => return Prometheus { base, _child: child },
                _ = child.wait() => continue,
            }
        }
        panic!(
            "prometheus did not start: {}",
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
    }

    /// Prometheus's answer to an instant query.
    async fn query(&self, query: &str) -> Value {
        reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.base))
            .query(&[("query", query)])
            .send()
            .await
            .expect("prometheus answers")
            .json()
            .await
            .expect("prometheus answers JSON")
    }

    /// The value of a query that yields one sample, once it yields one.
    async fn value(&self, query: &str) -> Option<f64> {
        let answer = self.query(query).await;
        let result = answer["data"]["result"].as_array()?;
        let [sample] = result.as_slice() else {
            return None;
        };
        sample["value"][1].as_str()?.parse().ok()
    }

    /// Waits until `query` is `expected`; fails with what it last was.
    async fn expect(&self, query: &str, expected: f64) {
        let mut last = None;
        let reached = tokio::time::timeout(patient(Duration::from_secs(30)), async {
            loop {
                last = self.value(query).await;
                if last == Some(expected) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        assert!(
            reached.is_ok(),
            "{query}: expected {expected}, Prometheus says {last:?}"
        );
    }
}

/// The metric names (`once_…`, `rpc_server_…`) a rules file or dashboard mentions.
fn metric_names(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("once_") || word.starts_with("rpc_server_"))
        // `once_unknown_*` in a comment is a family, not a name.
        .filter(|word| !word.ends_with('_'))
        .map(str::to_owned)
        .collect()
}

/// Claims `id` as a refund the stripe reconciler can look up, and has the provider make it,
/// as if its answer were lost: the grant, for the report that follows.
async fn refunded_at_the_provider(
    grpc: &mut once_api::pb::ledger_client::LedgerClient<tonic::transport::Channel>,
    provider: &str,
    id: &str,
) -> pb::Execute {
    let grant = claim(grpc, begin_refund(id)).await;
    refund_at_provider(provider, &format!("pi_{id}"), &grant.provider_key).await;
    grant
}

/// A stripe reconciler against `provider`, its workers looking every `interval`.
fn stripe_config(db: &TestDb, provider: &str, interval: &str) -> String {
    config_file(
        db,
        format!(
            "[reconciliation]\ninterval = \"{interval}\"\nfirst_backoff = \"100ms\"\n\n\
             [[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\n"
        ),
    )
}

/// A Begin that names the stripe reconciler, with the payment intent it looks under.
fn begin_refund(id: &str) -> pb::BeginRequest {
    pb::BeginRequest {
        provider: "stripe".into(),
        lookup_hints_json: format!(r#"{{"payment_intent":"pi_{id}"}}"#),
        ..begin(id, ARGS)
    }
}

/// The scripted run: two refunds confirmed and one replayed; three become UNKNOWN, of which
/// the reconciler settles one (the provider has it) and an operator resolves one. Prometheus,
/// scraping the replica, must then say exactly that.
async fn prometheus_scrapes_what_the_run_did(store: Engine) {
    let db = TestDb::new(store).await;
    let dir = db.scratch_dir();
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let config = stripe_config(&db, &provider, "100ms");
    let onced = OncedProcess::spawn(
        &db.url,
        dir.join("onced.log"),
        &[
            "--config",
            &config,
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-interval",
            "200ms",
        ],
    )
    .await;
    let metrics = metrics_address(&onced).await;
    let prometheus = Prometheus::scraping(metrics, &dir).await;
    let mut grpc = onced.client().await;

    for id in ["ok-1", "ok-2"] {
        let grant = claim(&mut grpc, begin(id, ARGS)).await;
        confirm(&mut grpc, id, grant.fencing_token, b"{}")
            .await
            .unwrap();
    }
    let again = grpc.begin(begin("ok-1", ARGS)).await.unwrap().into_inner();
    expect_replay(&again);

    // The refund the reconciler will find: the provider made it, the answer was lost.
    let lost = refunded_at_the_provider(&mut grpc, &provider, "lost").await;
    for (id, token) in [
        ("lost", lost.fencing_token),
        (
            "for-an-operator",
            claim(&mut grpc, begin("for-an-operator", ARGS))
                .await
                .fencing_token,
        ),
        (
            "stays",
            claim(&mut grpc, begin("stays", ARGS)).await.fencing_token,
        ),
    ] {
        report_unknown(&mut grpc, id, token).await.unwrap();
    }
    wait_for_state(&grpc, "lost", pb::OperationState::Confirmed).await;
    resolve(
        &mut grpc,
        "for-an-operator",
        pb::OperationState::Absent,
        "res-1",
    )
    .await
    .unwrap();

    // Counted as the calls committed…
    prometheus
        .expect(r#"sum(once_decisions_total{decision="EXECUTE"})"#, 5.0)
        .await;
    prometheus
        .expect(
            r#"sum(once_decisions_total{decision="REPLAY", tenant="default"})"#,
            1.0,
        )
        .await;
    prometheus
        .expect(
            r#"sum(once_reports_total{kind="confirm", outcome="accepted"})"#,
            2.0,
        )
        .await;
    prometheus
        .expect(r#"sum(once_unknown_entered_total)"#, 3.0)
        .await;
    prometheus
        .expect(
            r#"sum(once_unknown_resolution_duration_seconds_count{door="reconciler"})"#,
            1.0,
        )
        .await;
    prometheus
        .expect(
            r#"sum(once_unknown_resolution_duration_seconds_count{door="operator"})"#,
            1.0,
        )
        .await;
    prometheus
        .expect(
            r#"sum(once_reconciler_lookups_total{reconciler="stripe", verdict="confirmed"})"#,
            1.0,
        )
        .await;
    prometheus.expect(r#"sum(once_anomalies_total)"#, 0.0).await;
    // Each tenant's anomaly series exists at 0 before its first anomaly, so a rule sees the
    // first as an increase.
    prometheus
        .expect(
            r#"once_anomalies_total{kind="DOUBLE_EXECUTION", tenant="default"}"#,
            0.0,
        )
        .await;
    // …and read from the database: one operation is still UNKNOWN, none IN_FLIGHT.
    prometheus
        .expect(r#"sum(once_operations{state="UNKNOWN"})"#, 1.0)
        .await;
    prometheus
        .expect(
            r#"sum(once_operations{state="UNKNOWN", tenant="default", tool="issue_refund"})"#,
            1.0,
        )
        .await;
    prometheus
        .expect(r#"sum(once_operations{state="IN_FLIGHT"})"#, 0.0)
        .await;
    prometheus
        .expect(
            r#"once_unknown_older_than{tenant="default", age_seconds="0"}"#,
            1.0,
        )
        .await;
    prometheus
        .expect(
            r#"once_unknown_older_than{tenant="default", age_seconds="3600"}"#,
            0.0,
        )
        .await;
    prometheus.expect("once_store_up", 1.0).await;
    // The chain keeps up: every committed event is linked within a round or two.
    prometheus.expect("once_chain_unlinked", 0.0).await;
    let oldest = prometheus
        .value(r#"once_unknown_oldest_age_seconds{tenant="default"}"#)
        .await
        .expect("the oldest UNKNOWN age");
    assert!((0.0..600.0).contains(&oldest), "{oldest}");
    // Every RPC is timed, by method and status code: 2 Confirms answered OK.
    prometheus
        .expect(
            r#"sum(rpc_server_call_duration_seconds_count{rpc_method="Confirm", rpc_grpc_status_code="0"})"#,
            2.0,
        )
        .await;

    // Once the last UNKNOWN is resolved, its series falls to 0 rather than vanishing.
    resolve(&mut grpc, "stays", pb::OperationState::Absent, "res-2")
        .await
        .unwrap();
    prometheus
        .expect(
            r#"once_operations{state="UNKNOWN", tool="issue_refund"}"#,
            0.0,
        )
        .await;
    prometheus
        .expect(
            r#"once_unknown_older_than{tenant="default", age_seconds="0"}"#,
            0.0,
        )
        .await;

    // A superseded attempt confirms another provider object than the attempt that settled
    // it, twice: one anomaly (recorded once, so counted once), two stale reports.
    let first = claim(&mut grpc, begin("twice", ARGS)).await;
    report_unknown(&mut grpc, "twice", first.fencing_token)
        .await
        .unwrap();
    resolve(&mut grpc, "twice", pb::OperationState::Absent, "res-3")
        .await
        .unwrap();
    let second = claim(&mut grpc, begin("twice", ARGS)).await;
    confirm(&mut grpc, "twice", second.fencing_token, b"two")
        .await
        .unwrap();
    for _ in 0..2 {
        let refused = grpc
            .confirm(pb::ConfirmRequest {
                operation_id: "twice".into(),
                fencing_token: first.fencing_token,
                result: b"one".to_vec(),
                provider_ref: "re_other".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(reason(&refused), "EXECUTION_RIGHT_LOST");
    }
    prometheus
        .expect(
            r#"sum(once_anomalies_total{kind="DOUBLE_EXECUTION", tenant="default"})"#,
            1.0,
        )
        .await;
    prometheus
        .expect(
            r#"sum(once_reports_total{kind="confirm", outcome="stale"})"#,
            2.0,
        )
        .await;
    // A Begin whose caller gives up while it waits (its deadline passes) is timed as CANCELLED.
    claim(&mut grpc, begin("held", ARGS)).await;
    let mut waiting = tonic::Request::new(pb::BeginRequest {
        wait: Some(ms(5_000)),
        ..begin("held", ARGS)
    });
    waiting.set_timeout(Duration::from_millis(300));
    let gave_up = grpc.begin(waiting).await.unwrap_err();
    assert!(
        matches!(
            gave_up.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{gave_up:?}"
    );
    prometheus
        .expect(
            r#"sum(rpc_server_call_duration_seconds_count{rpc_method="Begin", rpc_grpc_status_code="1"})"#,
            1.0,
        )
        .await;

    // Every metric the alerts and the dashboard name is one the replica exports.
    let alerts = std::fs::read_to_string(workspace().join("deploy/prometheus/alerts.yml")).unwrap();
    let dashboard_text =
        std::fs::read_to_string(workspace().join("deploy/grafana/once-ledger.json")).unwrap();
    let named = metric_names(&alerts)
        .into_iter()
        .chain(metric_names(&dashboard_text))
        .collect::<std::collections::BTreeSet<_>>();
    assert!(named.len() >= 15, "{named:?}");
    for name in named {
        let series = prometheus
            .value(&format!(r#"count({{__name__="{name}"}})"#))
            .await;
        assert!(
            series.is_some_and(|n| n >= 1.0),
            "{name} is named in deploy/ but onced exports no such series"
        );
    }

    // Every figure of the dashboard is a query Prometheus accepts.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(workspace().join("deploy/grafana/once-ledger.json")).unwrap(),
    )
    .unwrap();
    let queries: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|panel| panel["targets"].as_array().unwrap())
        .map(|target| target["expr"].as_str().unwrap())
        .collect();
    assert!(queries.len() >= 15, "{queries:?}");
    for query in queries {
        let query = query
            .replace("$__rate_interval", "1m")
            .replace("$__range", "1h");
        let answer = prometheus.query(&query).await;
        assert_eq!(answer["status"], "success", "{query}: {answer}");
    }
    drop(onced);
}

/// The shipped alerting rules are valid, and their unit tests pass.
#[tokio::test]
async fn the_shipped_alerts_pass_promtool() {
    let rules = workspace().join("deploy/prometheus");
    for args in [
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ] {
        let ran = tokio::process::Command::new(installed("promtool"))
            .args(args)
            .current_dir(&rules)
            .output()
            .await
            .expect("run promtool");
        assert!(
            ran.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&ran.stdout),
            String::from_utf8_lossy(&ran.stderr)
        );
    }
}

/// The spans an OTLP collector in the test received: (name, kind, trace id, span id, parent
/// span id, attributes as text).
#[derive(Debug, Clone, Default)]
struct Collector {
    spans: std::sync::Arc<std::sync::Mutex<Vec<Received>>>,
}

#[derive(Debug, Clone)]
struct Received {
    name: String,
    kind: i32,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    attributes: std::collections::HashMap<String, String>,
}

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService
    for Collector
{
    async fn export(
        &self,
        request: tonic::Request<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
        >,
    ) -> Result<
        tonic::Response<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse,
        >,
        tonic::Status,
    > {
        use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
        let mut spans = self.spans.lock().unwrap();
        for resource in &request.get_ref().resource_spans {
            for scope in &resource.scope_spans {
                for span in &scope.spans {
                    let attributes = span
                        .attributes
                        .iter()
                        .map(|kv| {
                            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                                Some(Any::StringValue(s)) => s.clone(),
                                Some(Any::IntValue(i)) => i.to_string(),
                                Some(Any::BoolValue(b)) => b.to_string(),
                                Some(Any::DoubleValue(d)) => d.to_string(),
                                _ => String::new(),
                            };
                            (kv.key.clone(), value)
                        })
                        .collect();
                    spans.push(Received {
                        name: span.name.clone(),
                        kind: span.kind,
                        trace_id: span.trace_id.clone(),
                        span_id: span.span_id.clone(),
                        parent: span.parent_span_id.clone(),
                        attributes,
                    });
                }
            }
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

impl Collector {
    /// Listens on a port of its own; returns its address.
    async fn start(&self) -> SocketAddr {
        use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(self.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        address
    }

    fn trace(&self, trace_id: &[u8]) -> Vec<Received> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    }
}

on_both_backends!(an_operator_reconcile_is_one_trace_down_to_the_provider_lookup);

/// An operator's Reconcile sent with a `traceparent` continues that trace in onced: the RPC
/// span, the reconciler's lookup below it, the lookup's HTTP call to the provider below that
/// (which was sent the trace context), and the transaction that applied the verdict.
async fn an_operator_reconcile_is_one_trace_down_to_the_provider_lookup(store: Engine) {
    let db = TestDb::new(store).await;
    let dir = db.scratch_dir();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let provider = {
        // fakepay, noting the traceparent of every lookup it is sent.
        let seen = seen.clone();
        let router =
            fakepay::router(fakepay::Provider::default()).layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let seen = seen.clone();
                    async move {
                        if let Some(parent) = request.headers().get("traceparent") {
                            seen.lock()
                                .unwrap()
                                .push(parent.to_str().unwrap_or_default().to_owned());
                        }
                        next.run(request).await
                    }
                },
            ));
        serve(router).await
    };
    let collector = Collector::default();
    let endpoint = format!("http://{}", collector.start().await);
    // The workers wait an hour: only the operator's Reconcile looks anything up.
    let config = stripe_config(&db, &provider, "1h");
    let onced = OncedProcess::spawn_with_env(
        &db.url,
        dir.join("onced.log"),
        &["--config", &config],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_METRICS_EXPORTER", "none"),
        ],
    )
    .await;
    let mut grpc = onced.client().await;
    let lost = refunded_at_the_provider(&mut grpc, &provider, "traced").await;
    report_unknown(&mut grpc, "traced", lost.fencing_token)
        .await
        .unwrap();

    let trace_id = *uuid::Uuid::new_v4().as_bytes();
    let caller = uuid::Uuid::new_v4().as_bytes()[..8].to_vec();
    let mut request = tonic::Request::new(pb::ReconcileRequest {
        operation_id: "traced".into(),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{}-{}-01", hex(&trace_id), hex(&caller))
            .parse()
            .unwrap(),
    );
    let answer = grpc.reconcile(request).await.unwrap().into_inner();
    assert_eq!(answer.state, pb::OperationState::Confirmed as i32);

    let system = match store {
        Engine::Postgres => "postgresql",
        Engine::Sqlite => "sqlite",
    };
    let spans = eventually(Duration::from_secs(20), "the Reconcile's spans", || async {
        let spans = collector.trace(&trace_id);
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        let apply = format!("apply_verdict {system}");
        [
            "once.ledger.v1.Ledger/Reconcile",
            "reconcile stripe",
            "GET",
            apply.as_str(),
        ]
        .iter()
        .all(|wanted| names.contains(wanted))
        .then_some(spans)
    })
    .await;
    let named = |name: &str| {
        let found: Vec<&Received> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
        found[0].clone()
    };
    let rpc = named("once.ledger.v1.Ledger/Reconcile");
    assert_eq!(rpc.parent, caller, "the RPC continues the caller's trace");
    assert_eq!(rpc.kind, 2, "a server span");
    assert_eq!(rpc.attributes["rpc.system"], "grpc");
    assert_eq!(rpc.attributes["rpc.method"], "Reconcile");
    assert_eq!(rpc.attributes["rpc.grpc.status_code"], "0");
    assert_eq!(rpc.attributes["once.operation_id"], "traced");
    let lookup = named("reconcile stripe");
    assert_eq!(lookup.parent, rpc.span_id);
    assert_eq!(lookup.attributes["once.verdict"], "confirmed");
    let get = named("GET");
    assert_eq!(get.parent, lookup.span_id);
    assert_eq!(get.kind, 3, "a client span");
    assert_eq!(get.attributes["http.response.status_code"], "200");
    assert_eq!(
        get.attributes["url.full"],
        format!("{provider}/v1/refunds"),
        "no query in the span"
    );
    let applied = named(&format!("apply_verdict {system}"));
    assert_eq!(applied.parent, rpc.span_id);
    assert_eq!(applied.attributes["db.system.name"], system);
    // The provider was sent the lookup's span as the parent of whatever it does.
    let sent = seen.lock().unwrap().clone();
    assert_eq!(
        sent,
        [format!("00-{}-{}-01", hex(&trace_id), hex(&get.span_id))],
        "the provider is sent the trace context of its call, once"
    );
    drop(onced);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The metrics listener obeys the rule of the gRPC one: beyond loopback it needs a bearer token
/// (or `--insecure`), a weak token is refused at start, and with a token a scrape without it is
/// answered 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_is_closed_beyond_loopback() {
    let db = TestDb::new(Engine::Sqlite).await;
    let dir = db.scratch_dir();
    let refused = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
            .args(["--database-url", &db.url, "--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = refused(&["--metrics-listen", "0.0.0.0:0"]);
    assert!(
        said.contains("0.0.0.0:0") && said.contains("--metrics-token-file"),
        "{said}"
    );
    let weak = write_file(&dir, "weak.token", "metrics-metrics-metrics-metrics");
    let said = refused(&[
        "--metrics-listen",
        "0.0.0.0:0",
        "--metrics-token-file",
        weak.to_str().unwrap(),
    ]);
    assert!(said.contains("a metrics token"), "{said}");

    let token = strong_key("scrape");
    let file = write_file(&dir, "metrics.token", &format!("{token}\n"));
    let onced = OncedProcess::spawn(
        &db.url,
        dir.join("onced.log"),
        &[
            "--metrics-listen",
            "0.0.0.0:0",
            "--metrics-token-file",
            file.to_str().unwrap(),
        ],
    )
    .await;
    let port = metrics_address(&onced).await.port();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let scrape = |bearer: Option<String>| {
        let url = url.clone();
        async move {
            let mut request = reqwest::Client::new().get(url);
            if let Some(bearer) = bearer {
                request = request.bearer_auth(bearer);
            }
            request.send().await.unwrap()
        }
    };
    for wrong in [
        None,
        Some(strong_key("scrape")),
        Some(token[..20].to_owned()),
    ] {
        let answer = scrape(wrong.clone()).await;
        assert_eq!(
            answer.status(),
            reqwest::StatusCode::UNAUTHORIZED,
            "{wrong:?}"
        );
        assert!(answer.headers().contains_key("www-authenticate"));
    }
    let answer = scrape(Some(token.clone())).await;
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    assert!(answer.text().await.unwrap().contains("once_store_up"));
    assert!(onced.terminate().await.success());
    assert!(!onced_logs_contain(&dir, &token));
}

/// What runs is named: `--version`, the serving line (the database without its secrets, the
/// version), `onced_build_info`, `target_info` and `process_*` in the scrape. With
/// `--log-format json` every line is one JSON object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_version_and_the_process_are_in_the_log_and_the_metrics() {
    let version = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
        .arg("--version")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&version.stdout).into_owned();
    assert_eq!(said.trim(), format!("onced {}", onced::version()));
    assert!(
        onced::version().starts_with(env!("CARGO_PKG_VERSION")),
        "{said}"
    );

    let db = TestDb::new(Engine::Sqlite).await;
    let dir = db.scratch_dir();
    let onced = OncedProcess::spawn_with_env(
        &db.url,
        dir.join("onced.log"),
        &["--metrics-listen", "127.0.0.1:0"],
        &[("ONCE_LOG_FORMAT", "json")],
    )
    .await;
    let metrics = metrics_address(&onced).await;
    let log = onced.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let serving = lines
        .iter()
        .find(|line| line["message"] == "onced serving")
        .unwrap_or_else(|| panic!("no serving line: {log}"));
    assert_eq!(serving["level"], "INFO", "{serving}");
    assert_eq!(serving["version"], onced::version(), "{serving}");
    let file = db.url.trim_start_matches("sqlite://");
    assert!(
        serving["database"]
            .as_str()
            .is_some_and(|d| d.contains(file)),
        "{serving}"
    );

    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let revision = onced::version()
        .split_once(" (")
        .map_or("", |(_, r)| r.trim_end_matches(')'));
    let info = format!(
        "onced_build_info{{revision=\"{revision}\",version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.contains(&info), "{info} not in:\n{text}");
    assert!(
        text.lines().any(|l| l.starts_with("target_info{")
            && l.contains(&format!("service_version=\"{}\"", onced::version()))
            && l.contains("service_name=\"onced\"")),
        "{text}"
    );
    for figure in [
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(text.contains(figure), "{figure} not in:\n{text}");
    }
    assert!(onced.terminate().await.success());
}

/// Whether any log in `dir` holds `text`.
fn onced_logs_contain(dir: &Path, text: &str) -> bool {
    std::fs::read_dir(dir).unwrap().flatten().any(|entry| {
        std::fs::read_to_string(entry.path()).is_ok_and(|log| {
            entry.path().extension().is_some_and(|e| e == "log") && log.contains(text)
        })
    })
}

/// Where `onced` says it serves metrics, once it says so.
async fn metrics_address(onced: &OncedProcess) -> std::net::SocketAddr {
    eventually(
        Duration::from_secs(10),
        "onced to say where it serves metrics",
        || async { announced_address(&onced.log(), "serving Prometheus metrics") },
    )
    .await
}
