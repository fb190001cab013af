//! `onced`, the once-ledger service.
//!
//! [`run`] is built from what it is handed: a validated [`Config`], an already-bound listener
//! and a shutdown future. It opens the store named by the configuration, serves the ledger API
//! with gRPC health checking and reflection, runs the sweepers, and on shutdown stops
//! accepting, lets in-flight requests finish, stops the sweepers and closes the pool.

pub mod access;
pub mod admin;
pub mod cli;
pub mod config;
mod duplicates;
mod reconciliation;
mod service;
mod status;
mod sweeper;
mod telemetry;
mod tls;
mod wait;
mod watch;

use std::future::Future;

use anyhow::Context as _;
use once_api::admin_pb::admin_server::AdminServer;
use once_api::pb::ledger_server::LedgerServer;
use once_store::postgres::PgSettings;
use once_store::{Backend, Ledger, PgBackend, SqliteBackend};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;

/// onced's version: its release, and the commit it was built from when it was built from a
/// git checkout ("0.1.0 (3f2a9c1d04be)").
pub use once_telemetry::version;

pub use access::DEFAULT_TENANT;
pub use config::{Config, ConfigError, StoreKind};
pub use service::LedgerService;
pub use status::ERROR_DOMAIN;

/// Serves the ledger on `listener` until `shutdown` completes. Everything the configuration
/// names in files (the reconcilers, the admin key, TLS, the metrics token) is read and checked
/// before the database is opened: a typo fails before anything is touched.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.validate()?;
    let files = Files::read(&config)?;
    match config.store_kind()? {
        StoreKind::Sqlite => {
            let backend = sqlite(&config).await?;
            serve(backend, &config, files, listener, shutdown).await
        }
        StoreKind::Postgres => {
            let backend = postgres(&config).await?;
            serve(backend, &config, files, listener, shutdown).await
        }
    }
}

/// What the configuration names in files, read and checked.
struct Files {
    metrics_token: Option<once_core::access::SecretHash>,
    admin_key: Option<once_core::access::ApiKey>,
    tls: Option<tls::Tls>,
    reconciliation: once_reconcile::config::Reconciliation,
}

impl Files {
    fn read(config: &Config) -> anyhow::Result<Self> {
        let tls = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(
                tls::Tls::load(tls::TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: config.tls_client_ca.clone(),
                })
                .context("loading TLS")?,
            ),
            _ => None,
        };
        Ok(Self {
            metrics_token: config.metrics_token()?,
            admin_key: config.admin_key()?,
            tls,
            reconciliation: config.reconciliation()?,
        })
    }
}

/// Runs `onced tenants …` or `onced keys …` on the database the configuration names.
pub async fn administer(config: Config, command: cli::Command) -> anyhow::Result<()> {
    match config.store_kind()? {
        StoreKind::Sqlite => cli::run(sqlite(&config).await?, command).await,
        StoreKind::Postgres => cli::run(postgres(&config).await?, command).await,
    }
}

async fn sqlite(config: &Config) -> anyhow::Result<SqliteBackend> {
    let opening = || format!("opening the SQLite database {}", config.database_shown());
    match SqliteBackend::connect(&config.database_url).await {
        Ok(backend) => Ok(backend),
        // A file or directory that cannot be made: its own words, which name it.
        Err(once_store::StoreError::Internal(sqlx::Error::Configuration(cause))) => {
            Err(anyhow::anyhow!("{cause}").context(opening()))
        }
        Err(error) => Err(anyhow::Error::new(error).context(opening())),
    }
}

async fn postgres(config: &Config) -> anyhow::Result<PgBackend> {
    reach_postgres(config).await?;
    let settings = PgSettings {
        max_connections: config.db_max_connections,
        acquire_timeout: config.db_acquire_timeout,
    };
    PgBackend::connect(&config.database_url, &settings)
        .await
        .with_context(|| format!("connecting to PostgreSQL at {}", config.database_shown()))
}

/// Returns once one connection to PostgreSQL opens, trying for `--wait-for-database` while
/// what stops it may pass; else says where and why, and what to do.
async fn reach_postgres(config: &Config) -> anyhow::Result<()> {
    let shown = config.database_shown();
    let deadline = tokio::time::Instant::now() + config.wait_for_database;
    let mut tries = 0u32;
    loop {
        let unreached =
            match PgBackend::reach(&config.database_url, config.db_acquire_timeout).await {
                Ok(()) => return Ok(()),
                Err(unreached) => unreached,
            };
        tries += 1;
        let waiting = unreached.passes && tokio::time::Instant::now() < deadline;
        if !waiting {
            let hint = match (unreached.passes, config.wait_for_database.is_zero()) {
                (true, true) => " (--wait-for-database 60s keeps trying while it comes up)".into(),
                (true, false) => format!(
                    " (tried for --wait-for-database {})",
                    humantime::format_duration(config.wait_for_database)
                ),
                (false, _) => String::new(),
            };
            anyhow::bail!(
                "cannot connect to PostgreSQL at {shown}: {}{hint}",
                unreached.cause
            );
        }
        // The first failures, then one in ten: a person watching sees it wait, a log is not
        // flooded.
        if tries <= 3 || tries % 10 == 0 {
            tracing::warn!(database = %shown, cause = %unreached.cause, tries, "waiting for PostgreSQL");
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// Warns of each tenant of the store that no configured reconciler serves: its UNKNOWN
/// operations wait for a late report or an operator, whatever provider they name.
async fn unserved_tenants<B: Backend>(backend: &B, registry: &once_reconcile::Registry) {
    let Ok(tenants) = backend.tenants().await else {
        return;
    };
    let names: std::collections::BTreeSet<&str> = registry.names().map(|(_, name)| name).collect();
    let serving: Vec<String> = names
        .iter()
        .map(|name| format!("{name} serves {}", registry.tenants_of(name).join(", ")))
        .collect();
    // The ledger's own tenant holds the admin keys and may run no operation at all.
    let unserved = tenants
        .iter()
        .map(|t| t.name.as_str())
        .filter(|tenant| *tenant != access::LEDGER_TENANT)
        .filter(|tenant| !registry.names().any(|(t, _)| t == *tenant));
    for tenant in unserved {
        tracing::warn!(
            tenant,
            "no reconciler serves tenant {tenant:?}: its UNKNOWN operations wait for a late report or an operator ({}); add it to a reconciler in --config",
            serving.join("; ")
        );
    }
}

async fn serve<B: Backend>(
    backend: B,
    config: &Config,
    files: Files,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let metrics = telemetry::Metrics::new();
    // The ledger reports its commits only when something records them.
    let ledger = match metrics.on() {
        true => Ledger::new(backend.clone()).observed(metrics.clone()),
        false => Ledger::new(backend.clone()),
    };
    let Files {
        metrics_token,
        admin_key,
        tls,
        reconciliation: configured,
    } = files;
    let metrics_listener = match config.metrics_listen {
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
    if let Some(key) = &admin_key {
        admin::Admin::new(backend.clone())
            .bootstrap(key, access::LEDGER_TENANT)
            .await
            .context("storing the bootstrap admin key")?;
    }
    let access = access::Access::new(backend.clone(), config.credential_ttl)
        .await
        .context("reading the credentials")?;
    config.check_exposure(!access.is_open())?;
    if access.is_open() {
        tracing::warn!(
            "authentication is off: no credential exists, so every caller is tenant `default` with every role; \
             create a key (onced keys create) or set ONCE_ADMIN_KEY to turn it on"
        );
    }
    if !configured.registry.is_empty() {
        let names: Vec<String> = configured
            .registry
            .names()
            .map(|(tenant, name)| format!("{tenant}/{name}"))
            .collect();
        tracing::info!(reconcilers = ?names, "reconciliation on");
        unserved_tenants(&backend, &configured.registry).await;
    }
    let limits = config.limits();
    // Room for the largest result and everything around it; a larger request is refused before
    // it is decoded (RESOURCE_EXHAUSTED), so it costs no more memory than this.
    let max_request_bytes = (limits.max_result_bytes + 64 * 1024).max(1024 * 1024);
    // Cancelled as soon as shutdown begins: watch streams never end by themselves, and the
    // server drains only once every stream has.
    let stop_watchers = CancellationToken::new();
    let shutdown = {
        let stop_watchers = stop_watchers.clone();
        async move {
            shutdown.await;
            stop_watchers.cancel();
        }
    };
    let feed = watch::Feed::new(
        watch::WatcherLimits {
            replica: config.max_watchers,
            tenant: config.max_watchers_per_tenant,
            key: config.max_watchers_per_key,
        },
        stop_watchers.clone(),
    );
    let (recorder, duplicates) = duplicates::Recorder::new();
    let service = LedgerService::new(
        ledger.clone(),
        access.clone(),
        limits,
        &configured,
        feed.clone(),
        recorder,
        metrics.clone(),
    );
    let admin_service = admin::AdminService::new(backend, access);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<LedgerServer<LedgerService<B>>>().await;
    // Both reflection versions: grpcurl and newer tools ask v1, older clients v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(once_api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .context("building the reflection service")?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .context("building the reflection service")?;

    // Cancelled after the server has drained, so no sweeper outlives the pool it uses.
    let stop_sweepers = CancellationToken::new();
    let sweepers = [
        tokio::spawn(feed.follow(ledger.clone())),
        tokio::spawn(duplicates::write(
            ledger.backend().clone(),
            duplicates,
            stop_sweepers.clone(),
        )),
        tokio::spawn(service.reconciliation().run(stop_sweepers.clone())),
        tokio::spawn(sweeper::leases(
            ledger.clone(),
            config.lease_sweep_interval,
            stop_sweepers.clone(),
        )),
        tokio::spawn(sweeper::health(
            ledger.clone(),
            health.clone(),
            metrics.clone(),
            config.health_check_interval,
            stop_sweepers.clone(),
        )),
        tokio::spawn(telemetry::gauges(
            ledger.clone(),
            metrics.clone(),
            config.metrics_interval,
            stop_sweepers.clone(),
        )),
        tokio::spawn(sweeper::retention(
            ledger.clone(),
            config.retention_sweep_interval,
            (config.provider_key_window, config.event_retention),
            stop_sweepers.clone(),
        )),
    ];

    let scrapes = metrics_listener.map(|(listener, prometheus)| {
        let stop = stop_sweepers.clone();
        tokio::spawn(once_telemetry::serve_metrics(
            listener,
            prometheus,
            metrics_token.map(once_core::access::SecretHash::admits),
            async move { stop.cancelled().await },
        ))
    });

    let address = listener.local_addr()?;
    let router = tonic::transport::Server::builder()
        .layer(telemetry::RpcLayer {
            metrics: metrics.clone(),
        })
        .layer(status::TooLargeLayer)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(AdminServer::new(admin_service))
        .add_service(LedgerServer::new(service).max_decoding_message_size(max_request_bytes));
    match tls {
        None => {
            tracing::info!(%address, database = %config.database_shown(), version = version(), tls = false, "onced serving");
            // Answers go out as they are written, not held back for the next segment's ack.
            let incoming = TcpListenerStream::new(listener).map(|accepted| {
                accepted.inspect(|tcp| {
                    let _ = tcp.set_nodelay(true);
                })
            });
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Some(tls) => {
            let stop_accepting = CancellationToken::new();
            let incoming = tls.incoming(listener, stop_accepting.clone());
            let watcher = tokio::spawn(
                tls.clone()
                    .watch(config.tls_reload_interval, stop_accepting.clone()),
            );
            tracing::info!(%address, database = %config.database_shown(), version = version(), tls = true, client_certificates = config.tls_client_ca.is_some(), "onced serving");
            let served = router.serve_with_incoming_shutdown(incoming, shutdown).await;
            stop_accepting.cancel();
            let _ = watcher.await;
            served
        }
    }
    .context("serving gRPC")?;

    tracing::info!("stopped accepting; in-flight requests finished");
    stop_sweepers.cancel();
    for sweeper in sweepers {
        let _ = sweeper.await;
    }
    if let Some(scrapes) = scrapes {
        let _ = scrapes.await;
    }
    ledger.backend().close().await;
    tracing::info!("database pool closed; bye");
    Ok(())
}
