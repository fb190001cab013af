//! `refund-mcp`: an MCP server whose `issue_refund` tool runs at most once per order, guarded by
//! once-ledger, in front of a Stripe-like payment provider.
//!
//! Over stdio by default; over Streamable HTTP with `--http ADDR` (endpoint `/mcp`).

mod provider;
mod tools;

use std::time::Duration;

use clap::Parser;
use rmcp::ServiceExt;

/// The demo refund MCP server.
// `Debug` never shows the ledger key.
#[derive(Clone, Parser)]
#[command(name = "refund-mcp", version = once_telemetry::version())]
pub struct Args {
    #[command(flatten)]
    ledger: once_client::LedgerArgs,
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
            .field("provider", &self.provider)
            .field("http", &self.http)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

/// The names refund-mcp's deployments already give the ledger's flags: its own environment
/// variables, and the certificate flags' earlier names.
fn own_names(command: clap::Command) -> clap::Command {
    command
        .mut_arg("ledger", |arg| arg.env("REFUND_MCP_LEDGER"))
        .mut_arg("ledger_ca", |arg| arg.env("REFUND_MCP_LEDGER_CA"))
        .mut_arg("ledger_cert", |arg| {
            arg.env("REFUND_MCP_LEDGER_CLIENT_CERT")
                .visible_alias("ledger-client-cert")
        })
        .mut_arg("ledger_cert_key", |arg| {
            arg.env("REFUND_MCP_LEDGER_CLIENT_KEY")
                .visible_alias("ledger-client-key")
        })
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Args = once_telemetry::parse_args_with::<Args>(own_names);
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
    tracing::info!(instance = %args.instance, ledger = %args.ledger.ledger, provider = %args.provider, "refund-mcp starting");
    let config = args.ledger.config(&args.instance)?;
    let ledger = args.ledger.client_with(config)?;
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

#[cfg(test)]
mod tests {
    use clap::FromArgMatches;

    use super::*;

    #[test]
    fn the_ledger_flags_keep_refund_mcps_own_names() {
        let command = own_names(once_telemetry::command::<Args>());
        let env = |id: &str| {
            let arg = command.get_arguments().find(|arg| arg.get_id() == id);
            arg.and_then(|arg| arg.get_env())
                .map(|env| env.to_string_lossy().into_owned())
        };
        assert_eq!(env("ledger").as_deref(), Some("REFUND_MCP_LEDGER"));
        assert_eq!(env("ledger_key").as_deref(), Some("ONCE_LEDGER_KEY"));
        assert_eq!(env("ledger_ca").as_deref(), Some("REFUND_MCP_LEDGER_CA"));
        assert_eq!(
            env("ledger_cert").as_deref(),
            Some("REFUND_MCP_LEDGER_CLIENT_CERT")
        );
        assert_eq!(
            env("ledger_cert_key").as_deref(),
            Some("REFUND_MCP_LEDGER_CLIENT_KEY")
        );
        for (cert, key) in [
            ("--ledger-client-cert", "--ledger-client-key"),
            ("--ledger-cert", "--ledger-cert-key"),
        ] {
            let line = ["refund-mcp", cert, "c.pem", key, "k.pem"];
            let matches = command.clone().try_get_matches_from(line).unwrap();
            let args = Args::from_arg_matches(&matches).unwrap();
            assert_eq!(args.ledger.ledger_cert, Some("c.pem".into()));
            assert_eq!(args.ledger.ledger_cert_key, Some("k.pem".into()));
        }
    }
}
