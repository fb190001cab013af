//! `refund-mcp`: an MCP server whose `issue_refund` tool runs at most once per order, guarded by
//! once-ledger, in front of a Stripe-like payment provider.
//!
//! Over stdio by default; over Streamable HTTP with `--http ADDR` (endpoint `/mcp`).

mod provider;
mod tools;

use std::time::Duration;

use clap::Parser;
use once_client::{ClientConfig, LedgerClient};
use rmcp::ServiceExt;

/// The demo refund MCP server.
// `Debug` never shows the ledger key.
#[derive(Clone, Parser)]
#[command(name = "refund-mcp", version = once_telemetry::version())]
pub struct Args {
    /// The once-ledger endpoint.
    #[arg(
        long,
        env = "REFUND_MCP_LEDGER",
        default_value = "http://127.0.0.1:50051"
    )]
    ledger: String,
    /// The API key this server presents to the ledger; it names the tenant whose operations
    /// the server sees. Needed when the ledger requires credentials.
    #[arg(long, env = "ONCE_LEDGER_KEY")]
    ledger_key: Option<String>,
    /// A PEM file of certificate authorities to trust for an `https://` ledger (a private CA).
    #[arg(long, env = "REFUND_MCP_LEDGER_CA")]
    ledger_ca: Option<std::path::PathBuf>,
    /// For a ledger that verifies client certificates (mTLS): this server's PEM certificate
    /// (with --ledger-client-key).
    #[arg(
        long,
        env = "REFUND_MCP_LEDGER_CLIENT_CERT",
        requires = "ledger_client_key"
    )]
    ledger_client_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --ledger-client-cert.
    #[arg(
        long,
        env = "REFUND_MCP_LEDGER_CLIENT_KEY",
        requires = "ledger_client_cert"
    )]
    ledger_client_key: Option<std::path::PathBuf>,
    /// The payment provider's base URL.
    #[arg(
        long,
        env = "REFUND_MCP_PROVIDER",
        default_value = "http://127.0.0.1:12111"
    )]
    provider: String,
    /// Serve Streamable HTTP on this address instead of stdio.
    #[arg(long, env = "REFUND_MCP_HTTP")]
    http: Option<std::net::SocketAddr>,
    /// The lease each refund attempt holds while it calls the provider.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
    /// How long a call to the provider may take before its outcome counts as unknown.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    provider_timeout: Duration,
    /// This instance's name: the client name in the ledger's attempt log when the MCP client
    /// gives none, and in logs.
    #[arg(long, env = "REFUND_MCP_INSTANCE", default_value = "refund-mcp")]
    instance: String,
    /// How log lines are written: text for people, or json (one object a line).
    #[arg(long, env = "ONCE_LOG_FORMAT", default_value = "text")]
    log_format: once_telemetry::LogFormat,
    /// How long a refund call waits for the same refund in progress elsewhere.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    wait: Duration,
}

impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Args")
            .field("ledger", &self.ledger)
            .field(
                "ledger_key",
                &self.ledger_key.as_ref().map(|_| "<redacted>"),
            )
            .field("ledger_ca", &self.ledger_ca)
            .field("provider", &self.provider)
            .field("http", &self.http)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Args = once_telemetry::parse_args();
    // stdout carries the MCP protocol in stdio mode: logs go to stderr.
    let telemetry = match once_telemetry::Telemetry::init(once_telemetry::Process {
        name: "refund-mcp",
        log_format: args.log_format,
        prometheus: false,
    }) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("refund-mcp: {}", once_telemetry::sentence(&error));
            return std::process::ExitCode::FAILURE;
        }
    };
    let code = match serve(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // One line, never a backtrace, in the log's format.
        Err(error) => {
            tracing::error!("refund-mcp stopped: {}", once_telemetry::sentence(&error));
            std::process::ExitCode::FAILURE
        }
    };
    // What is still queued is exported before the process ends.
    telemetry.shutdown();
    code
}

async fn serve(args: Args) -> anyhow::Result<()> {
    tracing::info!(instance = %args.instance, ledger = %args.ledger, provider = %args.provider, "refund-mcp starting");
    let mut config = ClientConfig::new(args.ledger.clone());
    config.client_name = args.instance.clone();
    config.token = args.ledger_key.clone();
    if let (Some(cert), Some(key)) = (&args.ledger_client_cert, &args.ledger_client_key) {
        let read = |path: &std::path::PathBuf| {
            std::fs::read(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
        };
        config.tls_identity_pem = Some((read(cert)?, read(key)?));
    }
    if let Some(path) = &args.ledger_ca {
        config.tls_ca_pem = Some(
            std::fs::read(path)
                .map_err(|e| anyhow::anyhow!("--ledger-ca {}: {e}", path.display()))?,
        );
    }
    let ledger = LedgerClient::connect(config)?;
    let provider = provider::Provider::new(&args.provider, args.provider_timeout)?;
    let server = tools::RefundServer::new(ledger, provider, &args);

    match args.http {
        None => {
            tracing::info!("refund-mcp serving MCP over stdio");
            let running = server.serve(rmcp::transport::stdio()).await?;
            running.waiting().await?;
        }
        Some(address) => {
            use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
            use rmcp::transport::streamable_http_server::{
                StreamableHttpServerConfig, StreamableHttpService,
            };
            let stop = tokio_util::sync::CancellationToken::new();
            let service = StreamableHttpService::new(
                move || Ok(server.clone()),
                LocalSessionManager::default().into(),
                StreamableHttpServerConfig::default().with_cancellation_token(stop.child_token()),
            );
            // A session ended by DELETE is answered 204, not the transport's 202, which MCP
            // clients (the Python SDK) report as a failed termination.
            let router = axum::Router::new()
                .nest_service("/mcp", service)
                .layer(axum::middleware::from_fn(ended_sessions_answer_no_content));
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| anyhow::anyhow!("listening on {address} (--http): {e}"))?;
            tracing::info!(address = %listener.local_addr()?, "refund-mcp serving MCP over Streamable HTTP at /mcp");
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let mut terminate =
                        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                            .expect("a SIGTERM handler");
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = terminate.recv() => {}
                    }
                    stop.cancel();
                })
                .await?;
        }
    }
    Ok(())
}

/// DELETE of a session that was ended answers 204 No Content.
async fn ended_sessions_answer_no_content(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let delete = request.method() == axum::http::Method::DELETE;
    let mut response = next.run(request).await;
    if delete && response.status() == axum::http::StatusCode::ACCEPTED {
        *response.status_mut() = axum::http::StatusCode::NO_CONTENT;
        *response.body_mut() = axum::body::Body::empty();
    }
    response
}
