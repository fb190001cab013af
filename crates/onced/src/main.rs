//! The `onced` binary: configuration, telemetry, the listener and the shutdown signal.

use clap::Parser;
use onced::Config;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let mut config = Config::parse();
    if let Some(command) = config.command.take() {
        return onced::administer(config, command).await;
    }
    // SIGHUP re-reads the TLS files once serving; until then (the store is being opened) it
    // must not end the process, as it would by default. A handler registered once stays.
    drop(tokio::signal::unix::signal(
        tokio::signal::unix::SignalKind::hangup(),
    )?);
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    onced::run(config, listener, shutdown_signal()).await
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
