//! The `onced` binary: configuration, telemetry, the listener and the shutdown signal.

use std::process::ExitCode;

use anyhow::Context as _;
use once_telemetry::{Process, Telemetry};
use onced::Config;

#[tokio::main]
async fn main() -> ExitCode {
    let mut config: Config = once_telemetry::parse_args();
    let prometheus = config.command.is_none() && config.metrics_listen.is_some();
    let telemetry = match Telemetry::init(Process {
        name: "onced",
        log_format: config.log_format,
        prometheus,
    }) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("onced: {}", once_telemetry::sentence(&error));
            return ExitCode::FAILURE;
        }
    };
    let done = match config.command.take() {
        Some(command) => onced::administer(config, command).await,
        None => serve(config).await,
    };
    let code = match done {
        Ok(()) => ExitCode::SUCCESS,
        // One line, never a backtrace (whatever RUST_BACKTRACE says), in the log's format.
        Err(error) => {
            tracing::error!("onced stopped: {}", once_telemetry::sentence(&error));
            ExitCode::FAILURE
        }
    };
    telemetry.shutdown();
    code
}

async fn serve(config: Config) -> anyhow::Result<()> {
    // Every setting and every file they name, before a port is bound or the database opened.
    let settings = config.resolve()?;
    // SIGHUP re-reads the TLS files once serving; until then (the store is being opened) it
    // must not end the process, as it would by default. A handler registered once stays.
    drop(tokio::signal::unix::signal(
        tokio::signal::unix::SignalKind::hangup(),
    )?);
    let listen = settings.config.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listening on {listen} (--listen)"))?;
    onced::run(settings, listener, shutdown_signal()).await
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
