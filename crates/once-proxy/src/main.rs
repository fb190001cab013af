//! `once-proxy`: puts once-ledger in front of any MCP server, with no change to its code.
//!
//! ```text
//! once-proxy --policy policy.toml -- <command> [args…]
//! once-proxy --policy policy.toml --listen 127.0.0.1:8808 --upstream http://127.0.0.1:8000/mcp
//! once-proxy check policy.toml --against -- <command> [args…]
//! ```
//!
//! Over stdio the MCP client launches the proxy as if it were the server, and the proxy runs
//! the server as its child; over Streamable HTTP the proxy is an MCP endpoint (`/mcp`) in front
//! of the upstream's. Each `tools/call` of a tool the policy guards is claimed at the ledger first and
//! reaches the server at most once per logical operation; everything else passes untouched.

mod check;
mod guard;
mod http;
mod policy;
mod stdio;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use once_client::{ClientConfig, LedgerClient};

/// Guards an MCP server's state-changing tools with once-ledger.
// `Debug` never shows the ledger key.
#[derive(Parser)]
#[command(name = "once-proxy", version, args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    lint: Option<Lint>,
    /// The policy: which tools are guarded and how their calls are named (TOML).
    #[arg(long, env = "ONCE_PROXY_POLICY", required = true)]
    policy: Option<PathBuf>,
    /// The once-ledger endpoint.
    #[arg(long, env = "ONCE_LEDGER", default_value = "http://127.0.0.1:50051")]
    ledger: String,
    /// The API key the proxy presents to the ledger; it names the tenant.
    #[arg(long, env = "ONCE_LEDGER_KEY", hide_env_values = true)]
    ledger_key: Option<String>,
    /// A PEM file of certificate authorities to trust for an `https://` ledger.
    #[arg(long, env = "ONCE_LEDGER_CA")]
    ledger_ca: Option<PathBuf>,
    /// The client name recorded in the ledger's attempt log.
    #[arg(long, env = "ONCE_PROXY_NAME", default_value = "once-proxy")]
    name: String,
    /// Deadline of one ledger RPC.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    ledger_timeout: Duration,
    /// Serve MCP over Streamable HTTP at `/mcp` on this address (with --upstream) instead of
    /// relaying stdio to a command.
    #[arg(long, env = "ONCE_PROXY_LISTEN", requires = "upstream")]
    listen: Option<std::net::SocketAddr>,
    /// The upstream's Streamable HTTP MCP endpoint (with --listen).
    #[arg(long, env = "ONCE_PROXY_UPSTREAM", requires = "listen")]
    upstream: Option<String>,
    /// A header sent with every upstream request, `Name: value` (the upstream's credentials);
    /// the client's own headers, its authorization among them, are passed through.
    #[arg(long = "upstream-header", value_parser = http::header)]
    upstream_headers: Vec<(axum::http::HeaderName, axum::http::HeaderValue)>,
    /// The MCP server to run over stdio, after `--`.
    #[arg(
        last = true,
        required_unless_present = "upstream",
        conflicts_with = "upstream"
    )]
    command: Vec<String>,
}

#[derive(Debug, clap::Subcommand)]
enum Lint {
    /// Lists the upstream's tools beside the policy: which are guarded, which pass through,
    /// and a warning for each tool that may change state but is not guarded. Exits 1 when it
    /// warns.
    Check {
        /// The policy to check.
        policy: PathBuf,
        /// Check against the MCP server run by the command after `--`.
        #[arg(long, required = true)]
        against: bool,
        /// The MCP server to list the tools of.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Args")
            .field("policy", &self.policy)
            .field("ledger", &self.ledger)
            .field(
                "ledger_key",
                &self.ledger_key.as_ref().map(|_| "<redacted>"),
            )
            .field("command", &self.command)
            .finish_non_exhaustive()
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("once-proxy: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let ran = match args.lint {
        Some(Lint::Check {
            policy, command, ..
        }) => runtime.block_on(lint(&policy, &command)),
        None => runtime.block_on(proxy(args)),
    };
    match ran {
        Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(error) => {
            eprintln!("once-proxy: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// SIGTERM or SIGINT. A second one, while the proxy stops, ends it at once.
async fn stopped() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                eprintln!("once-proxy: stopped again; exiting now");
                std::process::exit(130);
            });
        }
        _ => std::future::pending().await,
    }
}

async fn lint(policy: &std::path::Path, command: &[String]) -> anyhow::Result<i32> {
    let policy = policy::Policy::load(policy)?;
    let (report, warned) = check::check(&policy, command).await?;
    print!("{report}");
    Ok(i32::from(warned))
}

async fn proxy(args: Args) -> anyhow::Result<i32> {
    // stdout carries the MCP protocol: logs go to stderr.
    let telemetry = once_telemetry::Telemetry::init("once-proxy", false)?;
    let path = args.policy.clone().expect("required without a subcommand");
    let policy = policy::Policy::load(&path)?;
    let mut config = ClientConfig::new(args.ledger.clone());
    config.client_name = args.name.clone();
    config.token = args.ledger_key.clone();
    config.rpc_timeout = args.ledger_timeout;
    if let Some(path) = &args.ledger_ca {
        config.tls_ca_pem = Some(
            std::fs::read(path)
                .map_err(|e| anyhow::anyhow!("--ledger-ca {}: {e}", path.display()))?,
        );
    }
    let ledger = LedgerClient::connect(config)?;
    tracing::info!(policy = %path.display(), guarded = ?policy.tools.keys().collect::<Vec<_>>(), ledger = %args.ledger, "once-proxy starting");
    let guard = guard::Guard { policy, ledger };
    let code = match (args.listen, args.upstream) {
        (Some(address), Some(upstream)) => {
            let listener = tokio::net::TcpListener::bind(address).await?;
            tracing::info!(address = %listener.local_addr()?, %upstream, "once-proxy serving MCP over Streamable HTTP at /mcp");
            let headers = args.upstream_headers.into_iter().collect();
            http::serve(guard, listener, upstream, headers, stopped())
                .await
                .map(|()| 0)
        }
        _ => stdio::run(guard, &args.command).await,
    };
    telemetry.shutdown();
    code
}
