//! What the benches (and the noisy-neighbour example) share: the built `onced` started on a
//! database, the messages of a cycle, percentiles.
// Each bench uses part of it.
#![allow(dead_code)]

pub mod cost;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use once_api::pb;

/// What every bench is told: the database, and how long to measure.
#[derive(Debug, clap::Args)]
pub struct Run {
    /// Defaults to a new SQLite file in a temporary directory.
    #[arg(long)]
    pub database_url: Option<String>,
    /// How long each measurement lasts.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
}

impl Run {
    /// A directory of the run's own, and the database to use: the one named, or a new SQLite
    /// file there.
    pub fn database(&self) -> anyhow::Result<(tempfile::TempDir, String)> {
        let dir = tempfile::tempdir()?;
        let url = self
            .database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("bench.db").display()));
        Ok((dir, url))
    }
}

/// A Begin of a fresh operation `id`.
pub fn begin(id: &str) -> pb::BeginRequest {
    pb::BeginRequest {
        tool: "issue_refund".into(),
        identity: Some(pb::begin_request::Identity::OperationId(id.into())),
        effect: Some(pb::begin_request::Effect::ArgumentsJson(format!(
            r#"{{"order":"{id}","amount_cents":500}}"#
        ))),
        attempt_id: uuid::Uuid::new_v4().to_string(),
        ..Default::default()
    }
}

/// The Confirm of `id` a Begin answered with EXECUTE, if it did.
pub fn confirm_if_granted(id: String, answer: pb::BeginResponse) -> Option<pb::ConfirmRequest> {
    match answer.decision {
        Some(pb::begin_response::Decision::Execute(grant)) => Some(pb::ConfirmRequest {
            operation_id: id,
            fencing_token: grant.fencing_token,
            result: b"{}".to_vec(),
            provider_ref: "re_1".into(),
        }),
        _ => None,
    }
}

/// The resident set of process `pid`, in KiB, from /proc.
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS in /proc/{pid}/status"))
}

/// What one caller saw making Begin then Confirm on fresh operations.
#[derive(Debug, Default)]
pub struct Cycles {
    /// Cycles whose Begin was granted and whose Confirm was taken.
    pub done: u64,
    /// Calls that failed.
    pub failed: u64,
    pub begins: Vec<Duration>,
    /// Begin through Confirm, of each cycle done.
    pub cycles: Vec<Duration>,
}

impl Cycles {
    pub fn merge(&mut self, other: Cycles) {
        self.done += other.done;
        self.failed += other.failed;
        self.begins.extend(other.begins);
        self.cycles.extend(other.cycles);
    }
}

/// One caller: Begin then Confirm on fresh operations until `end`.
pub async fn cycles(channel: tonic::transport::Channel, end: Instant) -> Cycles {
    let mut ledger = pb::ledger_client::LedgerClient::new(channel);
    let mut seen = Cycles::default();
    while Instant::now() < end {
        let id = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let started = Instant::now();
        let Ok(response) = ledger.begin(begin(&id)).await else {
            seen.failed += 1;
            continue;
        };
        seen.begins.push(started.elapsed());
        let Some(confirm) = confirm_if_granted(id, response.into_inner()) else {
            seen.failed += 1;
            continue;
        };
        match ledger.confirm(confirm).await {
            Ok(_) => {
                seen.done += 1;
                seen.cycles.push(started.elapsed());
            }
            Err(_) => seen.failed += 1,
        }
    }
    seen
}

/// One caller: two health checks a cycle until `end`, the gRPC work of a Begin + Confirm with no
/// ledger work at all: what any ledger behind this API could reach on this host at most.
pub async fn empty_cycles(channel: tonic::transport::Channel, end: Instant) -> Cycles {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let mut health = HealthClient::new(channel);
    let mut seen = Cycles::default();
    while Instant::now() < end {
        let started = Instant::now();
        let first = health.check(HealthCheckRequest::default()).await;
        seen.begins.push(started.elapsed());
        match (first, health.check(HealthCheckRequest::default()).await) {
            (Ok(_), Ok(_)) => {
                seen.done += 1;
                seen.cycles.push(started.elapsed());
            }
            _ => seen.failed += 1,
        }
    }
    seen
}

/// Begins of one confirmed operation, each answered REPLAY, until `end`: their latencies,
/// sorted (a Begin that needs no write: the service and one read).
pub async fn replays(
    channel: tonic::transport::Channel,
    end: Instant,
) -> anyhow::Result<Vec<Duration>> {
    let mut ledger = pb::ledger_client::LedgerClient::new(channel);
    let id = format!("bench-replayed-{}", uuid::Uuid::new_v4().simple());
    let granted = ledger.begin(begin(&id)).await?.into_inner();
    let confirm = confirm_if_granted(id.clone(), granted)
        .ok_or_else(|| anyhow::anyhow!("the first Begin of {id} was not granted"))?;
    ledger.confirm(confirm).await?;
    let mut latencies = Vec::new();
    while Instant::now() < end {
        let started = Instant::now();
        let answer = ledger.begin(begin(&id)).await?.into_inner();
        latencies.push(started.elapsed());
        anyhow::ensure!(
            matches!(
                answer.decision,
                Some(pb::begin_response::Decision::Replay(_))
            ),
            "a Begin of confirmed {id} was not a replay: {answer:?}"
        );
    }
    latencies.sort();
    Ok(latencies)
}

/// Health checks of the ledger, one after another, until `end`: their latencies, sorted (the
/// gRPC round trip with no store call, the floor under every call's latency).
pub async fn health_checks(
    channel: tonic::transport::Channel,
    end: Instant,
) -> anyhow::Result<Vec<Duration>> {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let mut health = HealthClient::new(channel);
    let mut latencies = Vec::new();
    while Instant::now() < end {
        let started = Instant::now();
        health.check(HealthCheckRequest::default()).await?;
        latencies.push(started.elapsed());
    }
    latencies.sort();
    Ok(latencies)
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Starts the `onced` binary on `url`, with telemetry on when `collector` is given; returns it
/// and its gRPC address.
pub async fn onced(
    binary: &str,
    url: &str,
    log: &std::path::Path,
    collector: Option<SocketAddr>,
) -> anyhow::Result<(tokio::process::Child, SocketAddr)> {
    let mut command = tokio::process::Command::new(binary);
    command
        .args(["--database-url", url, "--listen", "127.0.0.1:0"])
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .kill_on_drop(true);
    if let Some(collector) = collector {
        command
            .args(["--metrics-listen", "127.0.0.1:0"])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"))
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            .env("OTEL_METRIC_EXPORT_INTERVAL", "1000");
    }
    let child = command.spawn()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let address = text
            .lines()
            .find(|line| line.contains("onced serving"))
            .and_then(|line| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix("address="))
            })
            .and_then(|a| a.parse().ok());
        if let Some(address) = address {
            return Ok((child, address));
        }
        anyhow::ensure!(Instant::now() < deadline, "onced did not start: {text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
