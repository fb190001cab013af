//! What one tenant's flood does to another tenant's Begin latency, with and without the
//! noisy tenant's limits.
//!
//! ```text
//! cargo run --release -p onced --example noisy_neighbour -- [--seconds 5] [--flooders 32] \
//!     [--database-url postgres://postgres@127.0.0.1:5432/DB]
//! ```
//!
//! Starts `onced` in this process (on a fresh SQLite file unless a database is named), makes
//! tenants `quiet` and `noisy` with an executor key each, and measures `quiet`'s Begin latency
//! (one caller, Begin then Confirm on fresh operations) three times: alone; while `noisy`
//! floods with `--flooders` concurrent callers and no limits; and while it floods under its
//! limits (`--rate` requests a second per key, `--max-in-flight` live operations).

use std::time::{Duration, Instant};

use clap::Parser;
use once_api::admin_pb::admin_client::AdminClient;
use once_api::admin_pb::{CreateKeyRequest, PutTenantRequest};
use once_api::pb::ledger_client::LedgerClient;
use once_testkit::with_key;
use support::{begin, confirm_if_granted};
use tonic::transport::Channel;

#[path = "../benches/support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    run: support::Run,
    #[arg(long, default_value_t = 32)]
    flooders: usize,
    /// The noisy tenant's requests per second per key, when limited.
    #[arg(long, default_value_t = 200)]
    rate: i64,
    /// The noisy tenant's cap on live operations, when limited.
    #[arg(long, default_value_t = 50)]
    max_in_flight: i64,
}

/// `quiet`'s Begin latencies over `seconds`, one caller, each operation confirmed.
async fn quiet_latencies(channel: Channel, key: &str, seconds: u64) -> Vec<Duration> {
    let mut ledger = LedgerClient::new(channel);
    let mut latencies = Vec::new();
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        let id = format!("quiet-{}", uuid::Uuid::new_v4().simple());
        let started = Instant::now();
        let response = ledger.begin(with_key(begin(&id), Some(key))).await;
        latencies.push(started.elapsed());
        let Ok(response) = response else { continue };
        if let Some(confirm) = confirm_if_granted(id, response.into_inner()) {
            let _ = ledger.confirm(with_key(confirm, Some(key))).await;
        }
    }
    latencies
}

/// Floods as `noisy` until `stop`; returns (answered, refused).
async fn flood(
    channel: Channel,
    key: String,
    stop: tokio_util::sync::CancellationToken,
) -> (u64, u64) {
    let mut ledger = LedgerClient::new(channel);
    let (mut answered, mut refused) = (0, 0);
    while !stop.is_cancelled() {
        let id = format!("noisy-{}", uuid::Uuid::new_v4().simple());
        match ledger.begin(with_key(begin(&id), Some(&key))).await {
            Ok(_) => answered += 1,
            Err(_) => refused += 1,
        }
    }
    (answered, refused)
}

/// A new executor key of `tenant`.
async fn new_key(
    admin: &mut AdminClient<Channel>,
    admin_key: &str,
    tenant: &str,
) -> anyhow::Result<String> {
    let request = CreateKeyRequest {
        tenant: tenant.into(),
        name: format!("{tenant}-bench"),
        roles: vec!["executor".into()],
        certificate_pem: String::new(),
    };
    let created = admin.create_key(with_key(request, Some(admin_key))).await?;
    Ok(created.into_inner().secret)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (dir, url) = args.run.database()?;
    let admin_key = format!(
        "bench-admin-{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let key_file = dir.path().join("admin.key");
    std::fs::write(&key_file, &admin_key)?;
    let config = onced::Config::try_parse_from([
        "onced",
        "--database-url",
        &url,
        "--admin-key-file",
        key_file.to_str().unwrap(),
    ])?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop_server = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(onced::run(
        config.resolve()?,
        listener,
        stop_server.clone().cancelled_owned(),
    ));
    once_testkit::wait_serving(addr).await;
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut admin = AdminClient::new(channel.clone());
    for tenant in ["quiet", "noisy"] {
        let put = PutTenantRequest {
            name: tenant.into(),
            ..Default::default()
        };
        admin.put_tenant(with_key(put, Some(&admin_key))).await?;
    }
    let quiet = new_key(&mut admin, &admin_key, "quiet").await?;

    println!(
        "store: {}; {} s per phase; {} flooders",
        url.split(':').next().unwrap_or_default(),
        args.run.seconds,
        args.flooders
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10} {:>14} {:>14}",
        "phase", "quiet n", "p50 ms", "p99 ms", "noisy ok/s", "noisy refused/s"
    );
    let mut baseline = None;
    for (phase, limits) in [
        ("quiet alone", None),
        ("noisy floods, no limits", Some((0, 0))),
        (
            "noisy floods under its limits",
            Some((args.rate, args.max_in_flight)),
        ),
    ] {
        let stop = tokio_util::sync::CancellationToken::new();
        let mut flooders = Vec::new();
        if let Some((rate, max_in_flight)) = limits {
            let limits = PutTenantRequest {
                name: "noisy".into(),
                max_in_flight,
                requests_per_second: rate,
            };
            admin.put_tenant(with_key(limits, Some(&admin_key))).await?;
            // A new key is looked up afresh, so it carries the limits just set.
            let noisy = new_key(&mut admin, &admin_key, "noisy").await?;
            for _ in 0..args.flooders {
                flooders.push(tokio::spawn(flood(
                    channel.clone(),
                    noisy.clone(),
                    stop.clone(),
                )));
            }
        }
        let mut latencies = quiet_latencies(channel.clone(), &quiet, args.run.seconds).await;
        stop.cancel();
        let (mut ok, mut refused) = (0, 0);
        for flooder in flooders {
            let (a, r) = flooder.await?;
            ok += a;
            refused += r;
        }
        latencies.sort();
        let (p50, p99) = (percentile(&latencies, 50.0), percentile(&latencies, 99.0));
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let per_second = |n: u64| n as f64 / args.run.seconds as f64;
        println!(
            "{:<34} {:>10} {:>10.2} {:>10.2} {:>14.0} {:>14.0}",
            phase,
            latencies.len(),
            ms(p50),
            ms(p99),
            per_second(ok),
            per_second(refused)
        );
        match baseline {
            None => baseline = Some(p99),
            Some(base) => println!(
                "{:<34} quiet p99 is {:.1}x its p99 alone",
                "",
                ms(p99) / ms(base).max(0.001)
            ),
        }
    }
    stop_server.cancel();
    let _ = server.await;
    Ok(())
}
