//! What telemetry costs a Begin: its latency with telemetry off, and on (Prometheus metrics
//! kept for a scrape, traces and metrics exported over OTLP to a collector in this process,
//! every Begin carrying a sampled `traceparent`). Prints the figures; asserts nothing.
//!
//! ```text
//! cargo bench -p onced --bench telemetry -- [--seconds 5] [--rounds 2] \
//!     [--database-url postgres://postgres@127.0.0.1:5432/DB]
//! ```
//!
//! Each round starts the built `onced` twice on the same database, off then on, and measures
//! one caller making Begin then Confirm on fresh operations for `--seconds`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use once_api::pb::ledger_client::LedgerClient;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use support::{begin, confirm_if_granted, onced, percentile};
use tonic::transport::Channel;

mod support;

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    run: support::Run,
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Accepted for `cargo bench`'s sake.
    #[arg(long, hide = true)]
    bench: bool,
}

/// An OTLP collector that counts what it receives.
#[derive(Debug, Clone, Default)]
struct Collector {
    spans: Arc<AtomicU64>,
    metric_exports: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.spans.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Collector {
    async fn export(
        &self,
        _request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.metric_exports.fetch_add(1, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// A sampled W3C trace context with fresh ids.
fn traceparent() -> String {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    format!("00-{trace}-{span}-01")
}

/// Begin latencies over `seconds`, one caller, each operation confirmed.
async fn latencies(channel: Channel, seconds: u64, traced: bool) -> Vec<Duration> {
    let mut ledger = LedgerClient::new(channel);
    let mut latencies = Vec::new();
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        let id = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let mut request = tonic::Request::new(begin(&id));
        if traced {
            let parent = traceparent().parse().expect("a header value");
            request.metadata_mut().insert("traceparent", parent);
        }
        let started = Instant::now();
        let response = ledger.begin(request).await;
        latencies.push(started.elapsed());
        if let Some(confirm) = response
            .ok()
            .and_then(|r| confirm_if_granted(id, r.into_inner()))
        {
            let _ = ledger.confirm(confirm).await;
        }
    }
    latencies
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (dir, url) = args.run.database()?;

    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let collector_address = listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .add_service(MetricsServiceServer::new(collector.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    println!(
        "store: {}; {} s per run; one caller, Begin then Confirm on fresh operations",
        url.split(':').next().unwrap_or_default(),
        args.run.seconds
    );
    println!(
        "{:<8} {:<15} {:>8} {:>9} {:>9}",
        "round", "telemetry", "begins", "p50 ms", "p99 ms"
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mut p50s = (Vec::new(), Vec::new());
    for round in 1..=args.rounds {
        for on in [false, true] {
            let log = dir.path().join(format!("onced-{round}-{on}.log"));
            let (mut child, address) = onced(
                env!("CARGO_BIN_EXE_onced"),
                &url,
                &log,
                on.then_some(collector_address),
            )
            .await?;
            let channel = Channel::from_shared(format!("http://{address}"))?
                .connect()
                .await?;
            let mut measured = latencies(channel, args.run.seconds, on).await;
            child.kill().await?;
            measured.sort();
            let p50 = percentile(&measured, 50.0);
            if on {
                p50s.1.push(ms(p50));
            } else {
                p50s.0.push(ms(p50));
            }
            println!(
                "{:<8} {:<15} {:>8} {:>9.3} {:>9.3}",
                round,
                if on { "on (OTLP+prom)" } else { "off" },
                measured.len(),
                ms(p50),
                ms(percentile(&measured, 99.0))
            );
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "Begin p50: off {:.3} ms, on {:.3} ms ({:+.1}%); the collector received {} spans and {} metric exports",
        mean(&p50s.0),
        mean(&p50s.1),
        (mean(&p50s.1) / mean(&p50s.0).max(1e-9) - 1.0) * 100.0,
        collector.spans.load(Ordering::Relaxed),
        collector.metric_exports.load(Ordering::Relaxed)
    );
    Ok(())
}
