//! Logs, traces and metrics for once-ledger's processes (`onced`, `refund-mcp`).
//!
//! [`Telemetry::init`] installs, once per process:
//! - logs to stderr, filtered by `RUST_LOG` (default `info`): text, coloured only on a terminal
//!   and never when `NO_COLOR` is set, or one JSON object per line ([`LogFormat::Json`]);
//! - OpenTelemetry traces exported over OTLP/gRPC when the standard variables ask for them
//!   (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or
//!   `OTEL_TRACES_EXPORTER=otlp`), every `tracing` span becoming an OpenTelemetry span;
//! - OpenTelemetry metrics pushed the same way (`…_METRICS_ENDPOINT`, `OTEL_METRICS_EXPORTER`,
//!   every `OTEL_METRIC_EXPORT_INTERVAL`), and kept for a Prometheus scrape when asked, beside
//!   the process's own figures (`process_*`) and `<name>_build_info`.
//!
//! With none of those variables set no exporter, batch queue or tracing layer exists: spans are
//! only what the log needs, and instruments are the API's no-op ones. `OTEL_SDK_DISABLED=true`
//! turns everything off.
//!
//! [`propagation`] carries the W3C trace context (`traceparent`, `tracestate`) in gRPC metadata,
//! HTTP headers and an MCP request's `_meta`.

pub mod http;
pub mod propagation;

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::EnvFilter;

/// The instrumentation scope of every span and instrument the project makes.
pub const SCOPE: &str = "once-ledger";

static METRICS_ON: AtomicBool = AtomicBool::new(false);
static PROMETHEUS: OnceLock<Prometheus> = OnceLock::new();

/// Whether instruments record anything: metrics are exported or kept for a scrape.
pub fn metrics_on() -> bool {
    METRICS_ON.load(Ordering::Relaxed)
}

/// The process's Prometheus registry, when [`Telemetry::init`] was asked for one.
pub fn prometheus() -> Option<Prometheus> {
    PROMETHEUS.get().cloned()
}

/// The meter every instrument of the project comes from: the no-op one unless metrics are on.
pub fn meter() -> opentelemetry::metrics::Meter {
    opentelemetry::global::meter(SCOPE)
}

/// The release the binaries were built as and, when built from a git checkout, the commit:
/// `0.1.0 (3f2a9c1d04be)`.
pub fn version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| match revision() {
        "" => env!("CARGO_PKG_VERSION").to_owned(),
        commit => format!("{} ({commit})", env!("CARGO_PKG_VERSION")),
    })
}

/// The commit the binaries were built from; empty when not built from a git checkout.
pub fn revision() -> &'static str {
    env!("ONCE_GIT_COMMIT")
}

/// The command line `T` declares, with one rule every binary keeps: help never shows the value
/// of an environment variable an argument reads, as keys, tokens and URLs with credentials may
/// be among them.
pub fn command<T: clap::CommandFactory>() -> clap::Command {
    fn values_hidden(command: clap::Command) -> clap::Command {
        command
            .mut_args(|arg| arg.hide_env_values(true))
            .mut_subcommands(values_hidden)
    }
    values_hidden(T::command())
}

/// Parses the process's arguments as [`command`] declares them; on a usage error, or for
/// `--help` and `--version`, prints and exits as clap does.
pub fn parse_args<T: clap::Parser>() -> T {
    parse_args_with::<T>(|command| command)
}

/// [`parse_args`] of the command line `T` declares as `adjust` changes it: a binary's own
/// environment variables or aliases for arguments it shares with others.
pub fn parse_args_with<T: clap::Parser>(adjust: impl FnOnce(clap::Command) -> clap::Command) -> T {
    let mut command = adjust(command::<T>());
    let mut matches = command.get_matches_mut();
    T::from_arg_matches_mut(&mut matches).unwrap_or_else(|error| error.format(&mut command).exit())
}

/// An error and its causes on one line, each cause left out when the words before it say it
/// already.
pub fn sentence(error: &anyhow::Error) -> String {
    let mut said = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if said.contains(&text) {
            continue;
        }
        if !said.is_empty() {
            said.push_str(": ");
        }
        said.push_str(&text);
    }
    said
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// For people: `time LEVEL target: message field=value …`.
    #[default]
    Text,
    /// For log pipelines: one JSON object per line, the event's fields at its top level.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format: text or json")),
        }
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// What a process sets its telemetry up for.
#[derive(Debug, Clone, Copy)]
pub struct Process {
    /// Its name: the service name of its traces and metrics (unless `OTEL_SERVICE_NAME` names
    /// it), and the prefix of its `_build_info` metric.
    pub name: &'static str,
    pub log_format: LogFormat,
    /// Keep the metrics for a Prometheus scrape ([`prometheus()`]).
    pub prometheus: bool,
}

/// Whether log lines may be coloured: on a terminal, unless `NO_COLOR` is set (no-color.org).
pub fn colour_allowed(terminal: bool) -> bool {
    terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// What the process set up; dropping it does not flush, [`Telemetry::shutdown`] does.
#[derive(Debug)]
pub struct Telemetry {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
}

/// The metrics kept for a Prometheus scrape.
#[derive(Debug, Clone)]
pub struct Prometheus {
    registry: prometheus::Registry,
}

impl Prometheus {
    /// The metrics in Prometheus's text exposition format.
    pub fn render(&self) -> anyhow::Result<String> {
        use prometheus::Encoder as _;
        let mut text = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut text)
            .context("encoding the metrics")?;
        String::from_utf8(text).context("the metrics are not UTF-8")
    }
}

/// Serves `GET /metrics` on `listener` in Prometheus's text format until `stop` resolves. With
/// `admits`, only to scrapes whose bearer token it admits (it is given the token sent, if any);
/// others are answered 401.
pub async fn serve_metrics<A>(
    listener: tokio::net::TcpListener,
    prometheus: Prometheus,
    admits: Option<A>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) where
    A: Fn(Option<&str>) -> bool + Clone + Send + Sync + 'static,
{
    use axum::http::{header, HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    let scrape = move |headers: HeaderMap| {
        let (prometheus, admits) = (prometheus.clone(), admits.clone());
        async move {
            let sent = headers
                .get(header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.split_once(' '))
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, sent)| sent.trim());
            if admits.is_some_and(|admits| !admits(sent)) {
                return (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer realm=\"metrics\"")],
                    "this endpoint needs `Authorization: Bearer <the --metrics-token-file token>`\n",
                )
                    .into_response();
            }
            match prometheus.render() {
                Ok(text) => (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    text,
                )
                    .into_response(),
                Err(error) => {
                    tracing::warn!(%error, "could not render the metrics");
                    StatusCode::INTERNAL_SERVER_ERROR.into_response()
                }
            }
        }
    };
    let router = axum::Router::new().route("/metrics", axum::routing::get(scrape));
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "serving Prometheus metrics at /metrics");
    }
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await;
    if let Err(error) = served {
        tracing::warn!(%error, "the metrics endpoint stopped");
    }
}

/// Which OpenTelemetry signals the environment turns on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Signals {
    traces: bool,
    metrics: bool,
}

impl Signals {
    fn from_env(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| var(name).is_some_and(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Signals {
                traces: false,
                metrics: false,
            };
        }
        let wanted = |signal: &str, exporter_var: &str| {
            let exporter = var(exporter_var).map(|v| v.trim().to_ascii_lowercase());
            match exporter.as_deref() {
                Some("none") => false,
                Some("otlp") => true,
                Some("") | None => {
                    set("OTEL_EXPORTER_OTLP_ENDPOINT")
                        || set(&format!("OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))
                }
                Some(other) => {
                    eprintln!("{exporter_var}={other} is not supported (only otlp); not exporting");
                    false
                }
            }
        };
        let grpc = |signal: &str| {
            let protocol = var(&format!("OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"))
                .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
                .map(|v| v.trim().to_ascii_lowercase());
            match protocol.as_deref() {
                None | Some("") | Some("grpc") => true,
                Some(other) => {
                    eprintln!(
                        "OTLP over {other} is not built in (only grpc); {} are not exported",
                        signal.to_ascii_lowercase()
                    );
                    false
                }
            }
        };
        Signals {
            traces: wanted("TRACES", "OTEL_TRACES_EXPORTER") && grpc("TRACES"),
            metrics: wanted("METRICS", "OTEL_METRICS_EXPORTER") && grpc("METRICS"),
        }
    }
}

impl Telemetry {
    /// Sets up logs, and traces and metrics as the environment asks, for `process`. Call it
    /// once, inside the Tokio runtime when anything is exported (the OTLP exporters are gRPC
    /// clients).
    pub fn init(process: Process) -> anyhow::Result<Self> {
        let prometheus = process.prometheus;
        let signals = Signals::from_env(|name| std::env::var(name).ok());
        let resource = {
            let builder = Resource::builder()
                .with_attribute(opentelemetry::KeyValue::new("service.version", version()));
            match std::env::var("OTEL_SERVICE_NAME") {
                Ok(name) if !name.trim().is_empty() => builder.build(),
                _ => builder.with_service_name(process.name).build(),
            }
        };

        let tracer = if signals.traces {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .build()
                .context("setting up the OTLP trace exporter")?;
            Some(
                SdkTracerProvider::builder()
                    .with_resource(resource.clone())
                    .with_batch_exporter(exporter)
                    .build(),
            )
        } else {
            None
        };

        let meter = if signals.metrics || prometheus {
            let mut builder = SdkMeterProvider::builder().with_resource(resource);
            if prometheus {
                let registry = prometheus::Registry::new();
                let exporter = opentelemetry_prometheus::exporter()
                    .with_registry(registry.clone())
                    .scope_info_enabled(false)
                    .build()
                    .context("setting up the Prometheus exporter")?;
                builder = builder.with_reader(exporter);
                register_process(&registry, process.name)?;
                let _ = PROMETHEUS.set(Prometheus { registry });
            }
            if signals.metrics {
                let exporter = opentelemetry_otlp::MetricExporter::builder()
                    .with_tonic()
                    .build()
                    .context("setting up the OTLP metric exporter")?;
                builder = builder.with_reader(PeriodicReader::builder(exporter).build());
            }
            let provider = builder.build();
            opentelemetry::global::set_meter_provider(provider.clone());
            METRICS_ON.store(true, Ordering::Relaxed);
            Some(provider)
        } else {
            None
        };

        // PostgreSQL's notices (a migration's "already exists, skipping") are not news.
        let filter = EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
        let text = (process.log_format == LogFormat::Text).then(|| {
            tracing_subscriber::fmt::layer()
                .fmt_fields(LogFields)
                .with_writer(std::io::stderr)
                .with_ansi(colour_allowed(std::io::IsTerminal::is_terminal(
                    &std::io::stderr(),
                )))
        });
        let json = (process.log_format == LogFormat::Json).then(|| {
            tracing_subscriber::fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false)
                .with_writer(std::io::stderr)
        });
        let spans = tracer.as_ref().map(|provider| {
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer(SCOPE))
                .with_error_records_to_exceptions(true)
        });
        tracing_subscriber::registry()
            .with(filter)
            .with(text)
            .with(json)
            .with(spans)
            .try_init()
            .context("installing the log subscriber")?;
        if tracer.is_some() || signals.metrics {
            tracing::info!(
                traces = tracer.is_some(),
                metrics = signals.metrics,
                "exporting telemetry over OTLP"
            );
        }
        Ok(Telemetry { tracer, meter })
    }

    /// Exports what is still queued, then stops the exporters.
    pub fn shutdown(self) {
        if let Some(tracer) = self.tracer {
            if let Err(error) = tracer.shutdown() {
                tracing::warn!(%error, "could not flush the last spans");
            }
        }
        if let Some(meter) = self.meter {
            if let Err(error) = meter.shutdown() {
                tracing::warn!(%error, "could not flush the last metrics");
            }
        }
    }
}

/// The process's own figures (CPU, memory, open files: `process_*`) and
/// `<name>_build_info{version, revision}` = 1 in `registry`.
fn register_process(registry: &prometheus::Registry, name: &str) -> anyhow::Result<()> {
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .context("registering the process metrics")?;
    let info = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            format!("{}_build_info", name.replace('-', "_")),
            format!("The build of {name}: always 1, its version and revision as labels"),
        ),
        &["version", "revision"],
    )
    .context("the build info metric")?;
    info.with_label_values(&[env!("CARGO_PKG_VERSION"), revision()])
        .set(1);
    registry
        .register(Box::new(info))
        .context("registering the build info metric")
}

/// The fields of a span or event as the log shows them: the attributes that only a trace
/// needs (`otel.*`, and the semantic conventions' `rpc.*`, `db.*`, `http.*`, `url.*`,
/// `server.*`, `mcp.*`, `gen_ai.*`, `jsonrpc.*`, `network.*`, `error.*`) are left out.
#[derive(Debug, Clone, Copy)]
struct LogFields;

/// Whether a field is only for traces.
fn trace_only(name: &str) -> bool {
    const PREFIXES: [&str; 11] = [
        "otel.", "rpc.", "db.", "http.", "url.", "server.", "mcp.", "gen_ai.", "jsonrpc.",
        "network.", "error.",
    ];
    PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for LogFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = LogVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct LogVisitor<'w> {
    writer: tracing_subscriber::fmt::format::Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl tracing::field::Visit for LogVisitor<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if self.result.is_err() || trace_only(field.name()) {
            return;
        }
        let gap = if self.first { "" } else { " " };
        self.first = false;
        self.result = if field.name() == "message" {
            write!(self.writer, "{gap}{value:?}")
        } else {
            write!(self.writer, "{gap}{}={value:?}", field.name())
        };
    }
}

/// A label whose values come from callers (a tool name): the first `max` distinct values are
/// kept, every later one is `other`, so no caller can grow the number of series without bound.
#[derive(Debug)]
pub struct CappedLabel {
    max: usize,
    seen: Mutex<HashSet<String>>,
}

/// The value a [`CappedLabel`] gives every value past its cap.
pub const OTHER: &str = "other";

impl CappedLabel {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            seen: Mutex::default(),
        }
    }

    /// `value`, if it is one of the first `max` values seen, or [`OTHER`].
    pub fn of(&self, value: &str) -> Cow<'static, str> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(value) {
            return Cow::Owned(value.to_owned());
        }
        if seen.len() < self.max && value != OTHER {
            seen.insert(value.to_owned());
            return Cow::Owned(value.to_owned());
        }
        Cow::Borrowed(OTHER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[arg(long, env = "ONCE_TEST_KEY", global = true)]
        key: Option<String>,
        #[command(subcommand)]
        inner: Option<Inner>,
    }

    #[derive(clap::Subcommand)]
    enum Inner {
        Deeper {
            #[arg(long, env = "ONCE_TEST_TOKEN")]
            token: Option<String>,
        },
    }

    #[test]
    fn help_never_shows_an_environment_variables_value() {
        fn every_arg(command: &clap::Command, seen: &mut Vec<(String, bool)>) {
            for arg in command.get_arguments() {
                seen.push((arg.get_id().to_string(), arg.is_hide_env_values_set()));
            }
            for sub in command.get_subcommands() {
                every_arg(sub, seen);
            }
        }
        let mut seen = Vec::new();
        every_arg(&command::<Cli>(), &mut seen);
        assert!(seen.iter().any(|(id, _)| id == "token"), "{seen:?}");
        assert!(seen.iter().all(|(_, hidden)| *hidden), "{seen:?}");
    }

    fn signals(vars: &[(&str, &str)]) -> Signals {
        Signals::from_env(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn nothing_is_exported_unless_the_environment_asks() {
        let none = Signals {
            traces: false,
            metrics: false,
        };
        let both = Signals {
            traces: true,
            metrics: true,
        };
        assert_eq!(signals(&[]), none);
        assert_eq!(
            signals(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")]),
            both
        );
        assert_eq!(
            signals(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4317")]),
            Signals {
                traces: true,
                metrics: false
            }
        );
        assert_eq!(
            signals(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_METRICS_EXPORTER", "none")
            ]),
            Signals {
                traces: true,
                metrics: false
            }
        );
        assert!(signals(&[("OTEL_TRACES_EXPORTER", "otlp")]).traces);
        assert_eq!(
            signals(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_SDK_DISABLED", "true")
            ]),
            none
        );
        assert_eq!(
            signals(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
            ]),
            none,
            "a protocol that is not built in exports nothing rather than failing later"
        );
    }

    #[test]
    fn the_log_leaves_out_what_only_a_trace_needs() {
        assert!(
            trace_only("otel.name") && trace_only("rpc.method") && trace_only("db.system.name")
        );
        assert!(
            !trace_only("once.operation_id") && !trace_only("message") && !trace_only("address")
        );
    }

    #[test]
    fn a_capped_label_keeps_the_first_values_and_folds_the_rest_into_other() {
        let label = CappedLabel::new(2);
        assert_eq!(label.of("refund"), "refund");
        assert_eq!(label.of("send"), "send");
        assert_eq!(label.of("provision"), OTHER);
        assert_eq!(label.of("refund"), "refund");
        assert_eq!(label.of(OTHER), OTHER);
    }
}
