//! `fakepay --listen ADDR`: the Stripe-like provider as a process.

use clap::Parser;

/// A Stripe-like refunds API with fault injection.
#[derive(Debug, Parser)]
#[command(name = "fakepay", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "FAKEPAY_LISTEN", default_value = "127.0.0.1:12111")]
    listen: std::net::SocketAddr,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        )
        .init();
    let args = Args::parse();
    match serve(args.listen).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // One line, never a backtrace.
        Err(error) => {
            tracing::error!("fakepay stopped: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(address: std::net::SocketAddr) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("listening on {address} (--listen)"))?;
    tracing::info!(address = %listener.local_addr()?, "fakepay listening");
    axum::serve(listener, fakepay::router(fakepay::Provider::default()))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
