//! What `onced` measures and traces: one span per RPC (the W3C trace context a client sent is
//! its parent), the RPC latency histogram, the ledger's decisions, reports, anomalies and
//! resolutions as they commit, reconciler lookups, and gauges read from the database on an
//! interval — the same on every replica, since they count the shared store.
//!
//! Every instrument comes from [`once_telemetry::meter`]: without `--metrics-listen` or an OTLP
//! endpoint they are the API's no-op instruments and the gauges are never read. Labels are
//! bounded: tools and RPC methods go through a [`CappedLabel`], reconcilers are the configured
//! ones, and everything else is an enumeration.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use once_core::machine::Plan;
use once_core::stats::{Door, Gauges, UNKNOWN_AGE_THRESHOLDS};
use once_core::{EventKind, Millis, Operation, State};
use once_store::{Backend, Ledger, PoolUse};
use once_telemetry::CappedLabel;
use opentelemetry::metrics::{Counter, Histogram, ObservableGauge};
use opentelemetry::KeyValue;
use tokio_util::sync::CancellationToken;

use crate::access::DEFAULT_TENANT;

/// The most distinct tool names a replica labels a tenant's series with; later ones count as
/// `other`. Each tenant has its own budget, so one tenant's many tools never fold another's.
pub const MAX_TOOL_LABELS: usize = 64;

/// Histogram bounds, in seconds, for calls and lookups: 0.5 ms to 30 s.
const LATENCY_BOUNDS: [f64; 16] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
];

/// Histogram bounds, in seconds, for time spent UNKNOWN: a second to a week.
const RESOLUTION_BOUNDS: [f64; 13] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 10800.0, 21600.0, 86400.0, 604800.0,
];

/// The replica's instruments. Cheap to share.
#[derive(Debug)]
pub struct Metrics {
    /// Whether anything records them: when not, the calls of the Begin and report path return
    /// at once (no label is looked up or built).
    on: bool,
    tools: ToolLabels,
    methods: CappedLabel,
    decisions: Counter<u64>,
    reports: Counter<u64>,
    anomalies: Counter<u64>,
    escalations: Counter<u64>,
    became_unknown: Counter<u64>,
    resolution: Histogram<f64>,
    lookups: Counter<u64>,
    lookup_duration: Histogram<f64>,
    webhook_failures: Counter<u64>,
    rpc_duration: Histogram<f64>,
    transaction_start: Histogram<f64>,
    /// What the gauges report, refreshed by [`gauges`].
    read: Arc<Mutex<Read>>,
    _gauges: Vec<ObservableGauge<i64>>,
    _ages: Vec<ObservableGauge<f64>>,
}

/// One value of a gauge, with its labels.
type Observed = (i64, Vec<KeyValue>);

/// The figures the gauges report between two reads of the database.
#[derive(Debug, Default)]
struct Read {
    store: Option<Gauges>,
    store_up: Option<bool>,
    pool: Option<PoolUse>,
    /// The open operations of the last read by state, tenant and tool label.
    tools: Vec<(State, String, String, i64)>,
    /// Each tenant's UNKNOWN operations at least as old as each threshold, and the age of its
    /// oldest (0 when it has none): every tenant seen goes on being reported, at 0.
    unknown: Vec<TenantUnknown>,
    /// Every tenant seen since the replica started.
    tenants: std::collections::BTreeSet<String>,
    /// Each tenant with a continuity standing, and whether its executions are held.
    continuity: Vec<(String, bool)>,
    /// Committed events the history's chain had not linked, as the chain worker last saw.
    unlinked: Option<i64>,
}

#[derive(Debug, Default)]
struct TenantUnknown {
    tenant: String,
    older_than: Vec<(Millis, i64)>,
    oldest: Millis,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let meter = once_telemetry::meter();
        let read = Arc::new(Mutex::new(Read::default()));
        let latency = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(LATENCY_BOUNDS.to_vec())
                .build()
        };
        let gauge =
            |name: &'static str, description: &'static str, observe: fn(&Read) -> Vec<Observed>| {
                let read = read.clone();
                meter
                    .i64_observable_gauge(name)
                    .with_description(description)
                    .with_callback(move |observer| {
                        let read = read.lock().unwrap_or_else(|e| e.into_inner());
                        for (value, labels) in observe(&read) {
                            observer.observe(value, &labels);
                        }
                    })
                    .build()
            };
        let gauges = vec![
            gauge(
                "once.operations",
                "Open operations (IN_FLIGHT, UNKNOWN) in the store, by state, tenant and tool",
                |read| {
                    read.tools
                        .iter()
                        .map(|(state, tenant, tool, n)| {
                            (
                                *n,
                                vec![
                                    KeyValue::new("state", state.as_str()),
                                    KeyValue::new("tenant", tenant.clone()),
                                    KeyValue::new("tool", tool.clone()),
                                ],
                            )
                        })
                        .collect()
                },
            ),
            gauge(
                "once.unknown.older_than",
                "UNKNOWN operations that have been UNKNOWN at least `age_seconds`",
                |read| {
                    read.unknown
                        .iter()
                        .flat_map(|u| {
                            u.older_than.iter().map(|(age, n)| {
                                (
                                    *n,
                                    vec![
                                        KeyValue::new("tenant", u.tenant.clone()),
                                        KeyValue::new("age_seconds", age / 1000),
                                    ],
                                )
                            })
                        })
                        .collect()
                },
            ),
            gauge(
                "once.in_flight.past_lease",
                "IN_FLIGHT operations whose lease has ended, not yet swept to UNKNOWN",
                |read| read.store.iter().map(|g| (g.past_lease, vec![])).collect(),
            ),
            gauge(
                "once.store.up",
                "1 while the database answers this replica's health check, 0 while it does not",
                |read| {
                    read.store_up
                        .map(|up| (i64::from(up), vec![]))
                        .into_iter()
                        .collect()
                },
            ),
            gauge(
                "once.db.pool.connections",
                "The replica's database connections, by state (idle, used)",
                |read| {
                    read.pool
                        .iter()
                        .flat_map(|pool| {
                            let used = i64::from(pool.open.saturating_sub(pool.idle));
                            [
                                (i64::from(pool.idle), vec![KeyValue::new("state", "idle")]),
                                (used, vec![KeyValue::new("state", "used")]),
                            ]
                        })
                        .collect()
                },
            ),
            gauge(
                "once.continuity.held",
                "1 while a tenant's executions are held: the ledger is behind what its clients saw (restored to an earlier state)",
                |read| {
                    // Every tenant seen, at 0 unless held, so a rule sees each one's first hold.
                    let mut tenants: std::collections::BTreeMap<&str, bool> =
                        read.tenants.iter().map(|t| (t.as_str(), false)).collect();
                    for (tenant, held) in &read.continuity {
                        tenants.insert(tenant, *held);
                    }
                    tenants
                        .into_iter()
                        .map(|(tenant, held)| {
                            (i64::from(held), vec![KeyValue::new("tenant", tenant.to_owned())])
                        })
                        .collect()
                },
            ),
            gauge(
                "once.chain.unlinked",
                "Committed events (by sequence) the history's chain has not linked yet, as this replica last saw; retention keeps every event until it is linked",
                |read| read.unlinked.map(|n| (n, vec![])).into_iter().collect(),
            ),
            gauge(
                "once.db.pool.max_connections",
                "The most database connections the replica opens",
                |read| {
                    read.pool
                        .iter()
                        .map(|pool| (i64::from(pool.max), vec![]))
                        .collect()
                },
            ),
        ];
        let ages = vec![{
            let read = read.clone();
            meter
                .f64_observable_gauge("once.unknown.oldest_age")
                .with_unit("s")
                .with_description(
                    "How long each tenant's oldest UNKNOWN operation has been UNKNOWN (0 when none is)",
                )
                .with_callback(move |observer| {
                    let read = read.lock().unwrap_or_else(|e| e.into_inner());
                    for u in &read.unknown {
                        let age = u.oldest as f64 / 1000.0;
                        observer.observe(age, &[KeyValue::new("tenant", u.tenant.clone())]);
                    }
                })
                .build()
        }];
        let metrics = Arc::new(Self {
            on: once_telemetry::metrics_on(),
            tools: ToolLabels::default(),
            methods: CappedLabel::new(64),
            decisions: meter
                .u64_counter("once.decisions")
                .with_description("Begin decisions, by decision, tenant and tool")
                .build(),
            reports: meter
                .u64_counter("once.reports")
                .with_description("Reports (confirm, absent, unknown) by outcome: accepted, stale (a superseded attempt), settled (already settled), refused, failed")
                .build(),
            anomalies: meter
                .u64_counter("once.anomalies")
                .with_description(
                    "Anomalies recorded (DOUBLE_EXECUTION, RESOLUTION_CONTRADICTED), by tenant",
                )
                .build(),
            escalations: meter
                .u64_counter("once.escalations")
                .with_description("UNKNOWN operations escalated to people, by tenant")
                .build(),
            became_unknown: meter
                .u64_counter("once.unknown.entered")
                .with_description("Operations that became UNKNOWN, by cause (reported, lease_expired, other)")
                .build(),
            resolution: meter
                .f64_histogram("once.unknown.resolution.duration")
                .with_unit("s")
                .with_description("How long operations were UNKNOWN before they settled, by door (late_report, reconciler, operator)")
                .with_boundaries(RESOLUTION_BOUNDS.to_vec())
                .build(),
            lookups: meter
                .u64_counter("once.reconciler.lookups")
                .with_description("Reconciler lookups, by reconciler and verdict (confirmed, absent, unknown)")
                .build(),
            lookup_duration: latency(
                "once.reconciler.lookup.duration",
                "How long reconciler lookups took, by reconciler",
            ),
            webhook_failures: meter
                .u64_counter("once.escalation.webhook.failures")
                .with_description("Escalation webhook tries that failed (each try)")
                .build(),
            rpc_duration: latency(
                "rpc.server.call.duration",
                "How long the replica took to answer each RPC, by method and gRPC status code",
            ),
            transaction_start: latency(
                "once.db.transaction.start.duration",
                "How long a write transaction waited to start: for a pooled connection (or for its call's read, made with others'), then BEGIN",
            ),
            read,
            _gauges: gauges,
            _ages: ages,
        });
        // The counters alerts watch start at 0, so the first anomaly is an increase: the
        // tenant-less ones here, each tenant's as the gauges first see it.
        metrics.webhook_failures.add(0, &[]);
        for cause in ["reported", "lease_expired"] {
            metrics
                .became_unknown
                .add(0, &[KeyValue::new("cause", cause)]);
        }
        metrics
    }

    /// Starts the lookup counters of a configured reconciler at 0.
    pub fn reconciler_configured(&self, reconciler: &str) {
        for verdict in ["confirmed", "absent", "unknown"] {
            self.lookups.add(
                0,
                &[
                    KeyValue::new("reconciler", reconciler.to_owned()),
                    KeyValue::new("verdict", verdict),
                ],
            );
        }
    }

    /// Whether anything records the metrics.
    pub fn on(&self) -> bool {
        self.on
    }

    /// The labels a tenant's tool's series carry.
    pub fn tool(&self, tenant: &str, tool: &str) -> [KeyValue; 2] {
        [
            KeyValue::new("tenant", tenant.to_owned()),
            KeyValue::new("tool", self.tools.of(tenant, tool)),
        ]
    }

    pub fn decided(&self, decision: &'static str, tenant: &str, tool: &str) {
        if !self.on {
            return;
        }
        let [tenant, tool] = self.tool(tenant, tool);
        self.decisions
            .add(1, &[KeyValue::new("decision", decision), tenant, tool]);
    }

    /// A report of `kind` (confirm, absent, unknown) ended as `outcome`.
    pub fn reported(&self, kind: &'static str, outcome: &'static str) {
        if !self.on {
            return;
        }
        self.reports.add(
            1,
            &[
                KeyValue::new("kind", kind),
                KeyValue::new("outcome", outcome),
            ],
        );
    }

    /// A lookup by `reconciler` found `verdict` in `took`.
    pub fn looked_up(&self, reconciler: &str, verdict: &'static str, took: Duration) {
        if !self.on {
            return;
        }
        let reconciler = KeyValue::new("reconciler", reconciler.to_owned());
        self.lookups
            .add(1, &[reconciler.clone(), KeyValue::new("verdict", verdict)]);
        self.lookup_duration
            .record(took.as_secs_f64(), &[reconciler]);
    }

    pub fn webhook_failed(&self) {
        self.webhook_failures.add(1, &[]);
    }

    /// Each tenant's continuity standing, as last read.
    pub fn continuity(&self, standings: &[once_core::continuity::Standing]) {
        self.lock().continuity = standings
            .iter()
            .map(|s| (s.tenant.clone(), s.held.is_some()))
            .collect();
    }

    /// How many committed events the chain has not linked yet.
    pub fn unlinked(&self, events: i64) {
        self.lock().unlinked = Some(events);
    }

    pub fn store_up(&self, up: bool) {
        self.lock().store_up = Some(up);
    }

    /// One RPC answered with gRPC status `code` after `took`.
    pub fn answered(&self, service: &str, method: &str, code: i32, took: Duration) {
        if !self.on {
            return;
        }
        // A method the server does not have takes no label of its own: anyone can send one.
        let method = if code == tonic::Code::Unimplemented as i32 {
            std::borrow::Cow::Borrowed("other/other")
        } else {
            self.methods.of(&format!("{service}/{method}"))
        };
        let (service, method) = method.split_once('/').unwrap_or(("other", "other"));
        self.rpc_duration.record(
            took.as_secs_f64(),
            &[
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", service.to_owned()),
                KeyValue::new("rpc.method", method.to_owned()),
                KeyValue::new("rpc.grpc.status_code", i64::from(code)),
            ],
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Read> {
        self.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The counters alerts watch, at 0 for `tenant`, so its first anomaly or escalation is an
    /// increase a rule sees.
    fn counters_start(&self, tenant: &str) {
        for kind in [
            EventKind::DoubleExecution,
            EventKind::ResolutionContradicted,
        ] {
            self.anomalies.add(
                0,
                &[
                    KeyValue::new("kind", kind.as_str()),
                    KeyValue::new("tenant", tenant.to_owned()),
                ],
            );
        }
        self.escalations
            .add(0, &[KeyValue::new("tenant", tenant.to_owned())]);
    }

    /// Takes in what the database holds now.
    fn refreshed(&self, store: Gauges, pool: PoolUse) {
        // Tools past the cap are summed under `other`, as the counters count them.
        let mut tools: Vec<(State, String, String, i64)> = Vec::new();
        for (state, tenant, tool, n) in &store.open {
            let label = self.tools.of(tenant, tool);
            let same = |(s, t, l, _): &&mut (State, String, String, i64)| {
                s == state && t == tenant && *l == label
            };
            match tools.iter_mut().find(same) {
                Some(row) => row.3 += n,
                None => tools.push((*state, tenant.clone(), label, *n)),
            }
        }
        let mut read = self.lock();
        // A series once reported goes on at 0 rather than vanishing, so graphs and alerts see
        // the count fall; a state with no open operation at all is reported as 0 too.
        for (state, tenant, tool, _) in &read.tools {
            if !tools
                .iter()
                .any(|(s, t, l, _)| s == state && t == tenant && l == tool)
            {
                tools.push((*state, tenant.clone(), tool.clone(), 0));
            }
        }
        for state in [State::InFlight, State::Unknown] {
            if !tools.iter().any(|(s, ..)| *s == state) {
                let other = once_telemetry::OTHER.to_owned();
                tools.push((state, other.clone(), other, 0));
            }
        }
        // Every tenant ever seen, its series at 0 when it has nothing UNKNOWN. In open mode
        // every caller is tenant `default`, which no row names.
        let candidates = std::iter::once(DEFAULT_TENANT.to_owned())
            .chain(store.tenants.iter().cloned())
            .chain(store.oldest_unknown.iter().map(|(t, _)| t.clone()))
            .chain(store.open.iter().map(|(_, t, _, _)| t.clone()));
        for tenant in candidates {
            if read.tenants.insert(tenant.clone()) {
                self.counters_start(&tenant);
            }
        }
        read.unknown = read
            .tenants
            .iter()
            .map(|tenant| TenantUnknown {
                tenant: tenant.clone(),
                older_than: UNKNOWN_AGE_THRESHOLDS
                    .iter()
                    .map(|threshold| {
                        let n = store
                            .unknown_older_than
                            .iter()
                            .find(|(t, at, _)| t == tenant && at == threshold)
                            .map_or(0, |(_, _, n)| *n);
                        (*threshold, n)
                    })
                    .collect(),
                oldest: store
                    .oldest_unknown
                    .iter()
                    .find(|(t, _)| t == tenant)
                    .map_or(0, |(_, age)| *age),
            })
            .collect();
        read.store = Some(store);
        read.pool = Some(pool);
        read.tools = tools;
    }
}

/// Tool labels, with a budget of [`MAX_TOOL_LABELS`] for each tenant. Tenants are named by
/// whoever runs the ledger, so their number is theirs to bound.
#[derive(Debug, Default)]
struct ToolLabels {
    by_tenant: Mutex<HashMap<String, Arc<CappedLabel>>>,
}

impl ToolLabels {
    /// `tool`'s label in `tenant`'s series: itself, or `other` once the tenant has labelled
    /// [`MAX_TOOL_LABELS`] others.
    fn of(&self, tenant: &str, tool: &str) -> String {
        let label = {
            let mut by_tenant = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
            match by_tenant.get(tenant) {
                Some(label) => label.clone(),
                None => by_tenant
                    .entry(tenant.to_owned())
                    .or_insert_with(|| Arc::new(CappedLabel::new(MAX_TOOL_LABELS)))
                    .clone(),
            }
        };
        label.of(tool).into_owned()
    }
}

impl once_store::Observer for Metrics {
    fn transaction_started(&self, waited: Duration) {
        self.transaction_start.record(waited.as_secs_f64(), &[]);
    }

    fn committed(
        &self,
        before: Option<&Operation>,
        plan: &Plan,
        written: &once_store::Written,
        now: Millis,
    ) {
        // Only what was written: an anomaly or escalation whose cause repeats is recorded, and
        // counted, once.
        let events = plan
            .events
            .iter()
            .zip(&written.events)
            .filter_map(|(event, written)| written.then_some(event));
        let tenant = plan
            .operation
            .as_ref()
            .map(|w| w.operation())
            .or(before)
            .map_or(DEFAULT_TENANT, |op| op.tenant.as_str());
        for event in events {
            match event.kind {
                EventKind::DoubleExecution | EventKind::ResolutionContradicted => {
                    self.anomalies.add(
                        1,
                        &[
                            KeyValue::new("kind", event.kind.as_str()),
                            KeyValue::new("tenant", tenant.to_owned()),
                        ],
                    );
                }
                EventKind::Escalated => self
                    .escalations
                    .add(1, &[KeyValue::new("tenant", tenant.to_owned())]),
                _ => {}
            }
            if event.to == Some(State::Unknown) && event.from != Some(State::Unknown) {
                let cause = match event.kind {
                    EventKind::LeaseExpired => "lease_expired",
                    EventKind::ReportedUnknown => "reported",
                    _ => "other",
                };
                self.became_unknown.add(1, &[KeyValue::new("cause", cause)]);
            }
            let settled = matches!(event.to, Some(State::Confirmed | State::Absent));
            if event.from == Some(State::Unknown) && settled {
                if let (Some(door), Some(since)) = (
                    Door::of(event.kind),
                    before.and_then(|op| op.unknown_since.or(Some(op.updated_at))),
                ) {
                    let took = (now - since).max(0) as f64 / 1000.0;
                    self.resolution
                        .record(took, &[KeyValue::new("door", door.as_str())]);
                }
            }
        }
    }
}

/// Reads the gauges' figures from the database every `interval` until `stop`, while metrics
/// are on.
pub async fn gauges<B: Backend>(
    ledger: Ledger<B>,
    metrics: Arc<Metrics>,
    interval: Duration,
    stop: CancellationToken,
) {
    if !metrics.on() {
        return;
    }
    let (ledger, metrics) = (&ledger, &metrics);
    crate::rounds::every(interval, &stop, || async move {
        match ledger.backend().gauges().await {
            Ok(store) => metrics.refreshed(store, ledger.backend().pool_use()),
            Err(error) => {
                // No figure rather than a stale one: the store's own alert says why.
                metrics.lock().store = None;
                tracing::warn!(%error, "could not read the gauges from the database");
            }
        }
    })
    .await;
}

/// The RPC span and latency around every call the server answers: the span is the parent of
/// everything the call does (the database transaction, a lookup), continues the trace the
/// caller sent in `traceparent`, and carries the RPC semantic conventions' attributes and the
/// ledger's (`once.operation_id`, `once.decision`, `once.attempt`, `once.tool`), which the
/// handlers record.
#[derive(Debug, Clone)]
pub struct RpcLayer {
    pub metrics: Arc<Metrics>,
}

impl<S> tower_layer::Layer<S> for RpcLayer {
    type Service = Rpc<S>;

    fn layer(&self, inner: S) -> Rpc<S> {
        Rpc {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// See [`RpcLayer`].
#[derive(Debug, Clone)]
pub struct Rpc<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

/// Services whose calls are measured but not traced: health checks and reflection say
/// nothing about operations, and a load balancer's health checks would fill the traces.
fn traced(service: &str) -> bool {
    !service.starts_with("grpc.")
}

impl<S, ReqBody, ResBody> tower_service::Service<http::Request<ReqBody>> for Rpc<S>
where
    S: tower_service::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        use tracing::Instrument as _;
        let path = request.uri().path().trim_start_matches('/').to_owned();
        let (service, method) = path.split_once('/').unwrap_or((path.as_str(), ""));
        let (service, method) = (service.to_owned(), method.to_owned());
        let span = if traced(&service) {
            let span = tracing::info_span!(
                "rpc",
                otel.name = %path,
                otel.kind = "server",
                otel.status_code = tracing::field::Empty,
                rpc.system = "grpc",
                rpc.service = %service,
                rpc.method = %method,
                rpc.grpc.status_code = tracing::field::Empty,
                once.operation_id = tracing::field::Empty,
                once.tool = tracing::field::Empty,
                once.decision = tracing::field::Empty,
                once.attempt = tracing::field::Empty,
                once.fencing_token = tracing::field::Empty,
                once.actor = tracing::field::Empty,
            );
            once_telemetry::propagation::continue_from_headers(&span, request.headers());
            span
        } else {
            tracing::Span::none()
        };
        let answered = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        // Dropped unanswered (the client went away, or its deadline passed), the call is timed
        // and traced as CANCELLED.
        let mut timing = Timing {
            metrics: self.metrics.clone(),
            service,
            method,
            started: tokio::time::Instant::now(),
            span: span.clone(),
            answered: false,
        };
        Box::pin(
            async move {
                let response = answered.await?;
                // A unary call that failed answers with its status in the headers; one that
                // succeeded sends it in the trailers, after this.
                let code = response
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .unwrap_or(0);
                timing.answer(code);
                Ok(response)
            }
            .instrument(span),
        )
    }
}

/// One RPC's time and span until it is answered, or dropped unanswered.
struct Timing {
    metrics: Arc<Metrics>,
    service: String,
    method: String,
    started: tokio::time::Instant,
    span: tracing::Span,
    answered: bool,
}

impl Timing {
    fn answer(&mut self, code: i32) {
        self.answered = true;
        self.span.record("rpc.grpc.status_code", code);
        if server_error(code) {
            self.span.record("otel.status_code", "ERROR");
        }
        self.metrics
            .answered(&self.service, &self.method, code, self.started.elapsed());
    }
}

impl Drop for Timing {
    fn drop(&mut self) {
        if !self.answered {
            self.answer(tonic::Code::Cancelled as i32);
        }
    }
}

/// The gRPC codes the semantic conventions count as a server's error: the rest are answers.
fn server_error(code: i32) -> bool {
    use tonic::Code;
    matches!(
        Code::from_i32(code),
        Code::Unknown
            | Code::DeadlineExceeded
            | Code::Unimplemented
            | Code::Internal
            | Code::Unavailable
            | Code::DataLoss
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_server_faults_mark_a_span_as_an_error() {
        assert!(!server_error(0));
        assert!(!server_error(tonic::Code::FailedPrecondition as i32));
        assert!(!server_error(tonic::Code::NotFound as i32));
        assert!(server_error(tonic::Code::Unavailable as i32));
        assert!(server_error(tonic::Code::Internal as i32));
    }

    #[test]
    fn health_checks_are_not_traced() {
        assert!(!traced("grpc.health.v1.Health"));
        assert!(!traced("grpc.reflection.v1.ServerReflection"));
        assert!(traced("once.ledger.v1.Ledger"));
        assert!(traced("once.admin.v1.Admin"));
    }

    #[test]
    fn the_tool_label_budget_is_per_tenant() {
        let labels = ToolLabels::default();
        for n in 0..MAX_TOOL_LABELS {
            assert_eq!(labels.of("acme", &format!("tool-{n}")), format!("tool-{n}"));
        }
        assert_eq!(labels.of("acme", "one-too-many"), once_telemetry::OTHER);
        assert_eq!(labels.of("globex", "refund"), "refund");
        assert_eq!(labels.of("globex", "one-too-many"), "one-too-many");
        assert_eq!(labels.of("acme", "tool-0"), "tool-0");
    }

    #[test]
    fn open_operations_are_counted_by_tenant_and_folded_within_it() {
        let metrics = Metrics::new();
        let mut open: Vec<(State, String, String, i64)> = (0..=MAX_TOOL_LABELS)
            .map(|n| (State::Unknown, "acme".to_owned(), format!("tool-{n}"), 1))
            .collect();
        open.push((
            State::Unknown,
            "acme".to_owned(),
            "tool-extra".to_owned(),
            1,
        ));
        open.push((State::Unknown, "globex".to_owned(), "refund".to_owned(), 2));
        let store = Gauges {
            open,
            ..Gauges::default()
        };
        let pool = PoolUse {
            open: 1,
            idle: 1,
            max: 1,
        };
        metrics.refreshed(store, pool);
        let read = metrics.lock();
        let count = |tenant: &str, tool: &str| {
            read.tools
                .iter()
                .find(|(s, t, l, _)| *s == State::Unknown && t == tenant && l == tool)
                .map(|row| row.3)
        };
        assert_eq!(count("acme", "tool-0"), Some(1));
        assert_eq!(count("acme", once_telemetry::OTHER), Some(2));
        assert_eq!(count("globex", "refund"), Some(2));
        assert_eq!(count("globex", once_telemetry::OTHER), None);
        assert!(read
            .tools
            .iter()
            .any(|(s, _, _, n)| *s == State::InFlight && *n == 0));
    }
}
