//! `onced`, the once-ledger service.
//!
//! Three steps, each before the next touches anything: [`Config::resolve`] checks every
//! setting and reads every file they name ([`Settings`]); [`run`] opens the database and builds
//! the replica (`replica`: the ledger, access, the services) over it; then the replica's
//! workers start beside the server, and on shutdown the server stops accepting, lets in-flight
//! requests finish, and the workers stop and the pool closes.

pub mod access;
pub mod admin;
mod chain;
pub mod cli;
pub mod config;
mod console;
mod continuity;
mod database;
mod duplicates;
mod reconciliation;
mod replica;
mod rounds;
mod service;
pub mod signing;
mod status;
mod sweeper;
mod telemetry;
mod tls;
mod wait;
mod watch;

use std::future::Future;

use anyhow::Context as _;
use once_store::Backend;
use tokio::net::TcpListener;

/// onced's version: its release, and the commit it was built from when it was built from a
/// git checkout ("0.1.0 (3f2a9c1d04be)").
pub use once_telemetry::version;

pub use access::DEFAULT_TENANT;
pub use config::{Config, ConfigError, Settings, StoreKind};
pub use service::LedgerService;
pub use status::ERROR_DOMAIN;

/// Serves the ledger on `listener` until `shutdown` completes: binds the metrics and console
/// listeners, opens the database, builds the replica, starts its workers, serves, and drains.
pub async fn run(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let scrapes = match settings.config.metrics_listen {
        Some(address) => {
            let prometheus = once_telemetry::prometheus().context(
                "--metrics-listen needs the process's telemetry set up for Prometheus (once_telemetry::Telemetry::init)",
            )?;
            let listener = TcpListener::bind(address)
                .await
                .with_context(|| format!("listening for metrics scrapes on {address}"))?;
            Some((listener, prometheus))
        }
        None => None,
    };
    let console = match settings.config.console_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .with_context(|| format!("listening for the console on {address}"))?,
        ),
        None => None,
    };
    let listening = Listening {
        calls: listener,
        scrapes,
        console,
    };
    match settings.store {
        StoreKind::Sqlite => {
            let backend = database::sqlite(&settings.config).await?;
            serve(backend, settings, listening, shutdown).await
        }
        StoreKind::Postgres => {
            let backend = database::postgres(&settings.config).await?;
            serve(backend, settings, listening, shutdown).await
        }
    }
}

/// The listener for calls, the one for metrics scrapes and the console's, when asked for.
struct Listening {
    calls: TcpListener,
    scrapes: Option<(TcpListener, once_telemetry::Prometheus)>,
    console: Option<TcpListener>,
}

async fn serve<B: Backend>(
    backend: B,
    settings: Settings,
    listening: Listening,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut replica = replica::Replica::build(backend, &settings).await?;
    let workers = replica.spawn_workers(&settings, listening.scrapes);
    let served = replica
        .serve(settings, listening.calls, listening.console, shutdown)
        .await;
    workers.drain().await;
    served
}

/// Runs `onced tenants …` or `onced keys …` on the database the configuration names.
pub async fn administer(config: Config, command: cli::Command) -> anyhow::Result<()> {
    if let cli::Command::SigningKeys { action, json } = command {
        return cli::signing_keys(&config, action, json);
    }
    match config.store_kind()? {
        StoreKind::Sqlite => cli::run(database::sqlite(&config).await?, command).await,
        StoreKind::Postgres => cli::run(database::postgres(&config).await?, command).await,
    }
}
