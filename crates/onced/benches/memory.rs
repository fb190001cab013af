//! What `onced` holds in memory: its resident set idle, and at its peak while many callers
//! (1,000 by default) each make Begin then Confirm on fresh operations at once. Prints the
//! figures; asserts nothing.
//!
//! ```text
//! cargo bench -p onced --bench memory -- [--callers 1000] [--seconds 5] \
//!     [--database-url postgres://postgres@127.0.0.1:5432/DB]
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use once_api::pb::ledger_client::LedgerClient;
use support::{begin, confirm_if_granted, onced};
use tonic::transport::Channel;

mod support;

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    run: support::Run,
    #[arg(long, default_value_t = 1000)]
    callers: usize,
    /// Connections the callers share (gRPC multiplexes calls over each).
    #[arg(long, default_value_t = 20)]
    connections: usize,
    /// Accepted for `cargo bench`'s sake.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The resident set of process `pid`, in KiB, from /proc.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS in /proc/{pid}/status"))
}

/// One caller: Begin then Confirm on fresh operations until `end`; returns the cycles done.
async fn caller(channel: Channel, end: Instant) -> u64 {
    let mut ledger = LedgerClient::new(channel);
    let mut cycles = 0;
    while Instant::now() < end {
        let id = format!("mem-{}", uuid::Uuid::new_v4().simple());
        let Ok(response) = ledger.begin(begin(&id)).await else {
            continue;
        };
        if let Some(confirm) = confirm_if_granted(id, response.into_inner()) {
            if ledger.confirm(confirm).await.is_ok() {
                cycles += 1;
            }
        }
    }
    cycles
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (dir, url) = args.run.database()?;
    let (child, address) = onced(
        env!("CARGO_BIN_EXE_onced"),
        &url,
        &dir.path().join("onced.log"),
        None,
    )
    .await?;
    let pid = child.id().expect("running");
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(
            Channel::from_shared(format!("http://{address}"))?
                .connect()
                .await?,
        );
    }
    // Settled after start and a first call.
    let _ = caller(
        channels[0].clone(),
        Instant::now() + Duration::from_millis(200),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = rss_kib(pid)?;

    let end = Instant::now() + Duration::from_secs(args.run.seconds);
    let callers: Vec<_> = (0..args.callers)
        .map(|n| tokio::spawn(caller(channels[n % channels.len()].clone(), end)))
        .collect();
    let mut peak = idle;
    while Instant::now() < end {
        peak = peak.max(rss_kib(pid)?);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut cycles = 0;
    for caller in callers {
        cycles += caller.await?;
    }
    peak = peak.max(rss_kib(pid)?);
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "store: {}; {} callers over {} connections for {} s",
        url.split(':').next().unwrap_or_default(),
        args.callers,
        channels.len(),
        args.run.seconds
    );
    println!("onced RSS idle: {:.1} MiB", mib(idle));
    println!(
        "onced RSS peak with {} callers: {:.1} MiB ({} cycles, {:.0}/s)",
        args.callers,
        mib(peak),
        cycles,
        cycles as f64 / args.run.seconds as f64
    );
    Ok(())
}
