//! The `onced` binary: configuration, telemetry, the listener and the shutdown signal.

use clap::Parser;
use once_telemetry::{Process, Telemetry};
use onced::Config;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut config = Config::parse();
    if let Some(command) = config.command.take() {
        let telemetry = Telemetry::init(Process {
            name: "onced",
            log_format: config.log_format,
            prometheus: false,
        })?;
        let done = onced::administer(config, command).await;
        telemetry.shutdown();
        return done;
    }
    let telemetry = Telemetry::init(Process {
        name: "onced",
        log_format: config.log_format,
        prometheus: config.metrics_listen.is_some(),
    })?;
    // SIGHUP re-reads the TLS files once serving; until then (the store is being opened) it
    // must not end the process, as it would by default. A handler registered once stays.
    drop(tokio::signal::unix::signal(
        tokio::signal::unix::SignalKind::hangup(),
    )?);
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let served = onced::run(config, listener, shutdown_signal()).await;
    telemetry.shutdown();
    served
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
    tracing::info!("shutdown requested");
}
