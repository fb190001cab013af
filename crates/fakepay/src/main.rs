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
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(address = %listener.local_addr()?, "fakepay listening");
    axum::serve(listener, fakepay::router(fakepay::Provider::default()))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
