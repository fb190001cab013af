//! One replica, built from resolved [`Settings`] over an open database: the ledger, access,
//! the services that answer calls, and the workers that run beside them until shutdown.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context as _;
use once_api::admin_pb::admin_server::AdminServer;
use once_api::pb::ledger_server::{LedgerServer, SERVICE_NAME};
use once_store::{Backend, Ledger};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::admin::{Admin, AdminService};
use crate::config::Settings;
use crate::continuity::Continuity;
use crate::service::LedgerService;
use crate::signing::Receipts;
use crate::telemetry::{Metrics, RpcLayer};
use crate::{access, duplicates, status, sweeper, telemetry, version, watch};

/// How long the console's in-process calls may keep the replica from stopping once the
/// console has closed its connections.
const CONSOLE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// What serves calls, and what the workers beside it need.
pub(crate) struct Replica<B: Backend> {
    ledger: Ledger<B>,
    metrics: Arc<Metrics>,
    service: LedgerService<B>,
    admin: AdminService<B>,
    feed: watch::Feed,
    /// The Begins answered without a new execution right, until its writer takes it.
    duplicates: Option<duplicates::Queue>,
    /// What the health service answers: SERVING while the database answers and writes.
    health: HealthReporter,
    /// Cancelled as soon as shutdown begins: watch streams never end by themselves, and the
    /// server drains only once every stream has.
    stop_watchers: CancellationToken,
    continuity: Continuity<B>,
}

impl<B: Backend> Replica<B> {
    /// Stores the bootstrap admin key, reads the credentials, refuses an exposure the settings
    /// do not allow, and builds the services.
    pub(crate) async fn build(backend: B, settings: &Settings) -> anyhow::Result<Self> {
        let config = &settings.config;
        let metrics = Metrics::new();
        // The ledger reports its commits only when something records them.
        let ledger = match metrics.on() {
            true => Ledger::new(backend.clone()).observed(metrics.clone()),
            false => Ledger::new(backend.clone()),
        };
        if let Some(key) = &settings.admin_key {
            Admin::new(backend.clone())
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
        let registry = &settings.reconciliation.registry;
        if !registry.is_empty() {
            let names: Vec<String> = registry
                .names()
                .map(|(tenant, name)| format!("{tenant}/{name}"))
                .collect();
            tracing::info!(reconcilers = ?names, "reconciliation on");
            unserved_tenants(&backend, registry).await;
        }
        let stop_watchers = CancellationToken::new();
        let feed = watch::Feed::new(
            watch::WatcherLimits {
                replica: config.max_watchers,
                tenant: config.max_watchers_per_tenant,
                key: config.max_watchers_per_key,
            },
            stop_watchers.clone(),
        );
        let (recorder, duplicates) = duplicates::Recorder::new();
        let continuity = Continuity::open(ledger.clone(), config.event_retention)
            .await
            .context("reading the ledger's identity")?;
        let service = LedgerService::new(
            ledger.clone(),
            access.clone(),
            settings.limits.clone(),
            &settings.reconciliation,
            (feed.clone(), recorder),
            metrics.clone(),
            (
                continuity.clone(),
                Receipts::new(settings.signing.ring(), continuity.ledger_id()),
            ),
        );
        let health = HealthReporter::new();
        health
            .set_service_status(SERVICE_NAME, ServingStatus::Serving)
            .await;
        Ok(Self {
            admin: AdminService::new(backend, access),
            ledger,
            metrics,
            service,
            feed,
            duplicates: Some(duplicates),
            health,
            stop_watchers,
            continuity,
        })
    }

    /// Starts the workers: the watch feed, the duplicate recorder, reconciliation, the lease,
    /// health, gauge and retention sweepers, and the metrics endpoint on `scrapes`.
    pub(crate) fn spawn_workers(
        &mut self,
        settings: &Settings,
        scrapes: Option<(TcpListener, once_telemetry::Prometheus)>,
    ) -> Workers<B> {
        let config = &settings.config;
        let stop = CancellationToken::new();
        let ledger = &self.ledger;
        let mut tasks = vec![tokio::spawn(self.feed.clone().follow(ledger.clone()))];
        if let Some(queue) = self.duplicates.take() {
            let backend = ledger.backend().clone();
            tasks.push(tokio::spawn(duplicates::write(
                backend,
                queue,
                stop.clone(),
            )));
        }
        tasks.extend([
            tokio::spawn(self.service.reconciliation().run(stop.clone())),
            tokio::spawn(sweeper::leases(
                ledger.clone(),
                config.lease_sweep_interval,
                stop.clone(),
            )),
            tokio::spawn(sweeper::health(
                ledger.clone(),
                self.health.clone(),
                self.metrics.clone(),
                config.health_check_interval,
                stop.clone(),
            )),
            tokio::spawn(crate::chain::follow(
                ledger.clone(),
                self.metrics.clone(),
                stop.clone(),
            )),
            tokio::spawn(crate::continuity::follow(
                self.continuity.clone(),
                self.health.clone(),
                self.metrics.clone(),
                stop.clone(),
            )),
            tokio::spawn(telemetry::gauges(
                ledger.clone(),
                self.metrics.clone(),
                config.metrics_interval,
                stop.clone(),
            )),
            tokio::spawn(sweeper::retention(
                ledger.clone(),
                config.retention_sweep_interval,
                (config.provider_key_window, config.event_retention),
                stop.clone(),
            )),
        ]);
        if let Some((listener, prometheus)) = scrapes {
            let stopped = stop.clone();
            tasks.push(tokio::spawn(once_telemetry::serve_metrics(
                listener,
                prometheus,
                settings
                    .metrics_token
                    .map(once_core::access::SecretHash::admits),
                async move { stopped.cancelled().await },
            )));
        }
        Workers {
            stop,
            tasks,
            backend: ledger.backend().clone(),
        }
    }

    /// Serves the API on `listener` (over TLS when the settings have it) until `shutdown`
    /// completes and every call in flight has finished.
    pub(crate) async fn serve(
        self,
        settings: Settings,
        listener: TcpListener,
        console: Option<TcpListener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let config = &settings.config;
        let health = HealthServer::new(HealthService::from_health_reporter(self.health));
        // Room for the largest result and everything around it; a larger request is refused
        // before it is decoded (RESOURCE_EXHAUSTED), so it costs no more memory than this.
        let max_request_bytes = (settings.limits.max_result_bytes + 64 * 1024).max(1024 * 1024);
        // Both reflection versions: grpcurl and newer tools ask v1, older clients v1alpha.
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(once_api::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let routes = tonic::service::Routes::new(health)
            .add_service(reflection().build_v1().context("building reflection")?)
            .add_service(
                reflection()
                    .build_v1alpha()
                    .context("building reflection")?,
            )
            .add_service(AdminServer::new(self.admin))
            .add_service(
                LedgerServer::new(self.service).max_decoding_message_size(max_request_bytes),
            );
        let router = tonic::transport::Server::builder()
            .layer(RpcLayer {
                metrics: self.metrics.clone(),
            })
            .layer(status::too_large_layer())
            .add_routes(routes);
        let stop_watchers = self.stop_watchers;
        // The console calls this router in process, and stops as shutdown begins.
        let console = match (console, config.console()) {
            (Some(listener), Some(mut options)) => {
                // The port it answers to is the one bound (the flag may have said 0).
                options.listen = listener.local_addr()?;
                let (pipes, connections) = crate::console::pipes();
                let stopped = stop_watchers.clone();
                let in_process = tokio::spawn(
                    router
                        .clone()
                        .serve_with_incoming_shutdown(connections, stopped.cancelled_owned()),
                );
                let console = once_console::Console::new(
                    move || crate::console::connect(&pipes),
                    options,
                    stop_watchers.clone(),
                );
                Some((in_process, tokio::spawn(console.serve(listener))))
            }
            _ => None,
        };
        let stop_console = stop_watchers.clone();
        let shutdown = async move {
            shutdown.await;
            stop_watchers.cancel();
        };
        let address = listener.local_addr()?;
        let database = config.database_shown();
        let served = match settings.tls {
            None => {
                tracing::info!(%address, %database, version = version(), tls = false, "onced serving");
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
                let reloads = tokio::spawn(
                    tls.clone()
                        .watch(config.tls_reload_interval, stop_accepting.clone()),
                );
                let client_certificates = config.tls_client_ca.is_some();
                tracing::info!(%address, %database, version = version(), tls = true, client_certificates, "onced serving");
                let served = router.serve_with_incoming_shutdown(incoming, shutdown).await;
                stop_accepting.cancel();
                let _ = reloads.await;
                served
            }
        }
        .context("serving gRPC");
        if let Some((in_process, console)) = console {
            stop_console.cancel();
            let _ = console.await;
            // The console's connections are gone; its in-process ones close as they finish.
            let _ = tokio::time::timeout(CONSOLE_GRACE, in_process).await;
        }
        served?;
        tracing::info!("stopped accepting; in-flight requests finished");
        Ok(())
    }
}

/// The workers of a replica, stopped once it has stopped serving.
pub(crate) struct Workers<B> {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    backend: B,
}

impl<B: Backend> Workers<B> {
    /// Stops every worker, waits for them, and closes the database pool they used.
    pub(crate) async fn drain(self) {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        self.backend.close().await;
        tracing::info!("database pool closed; bye");
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
