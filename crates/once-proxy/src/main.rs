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
//! of the upstream's. Every client message is parsed strictly and forwarded as the proxy
//! re-serialised it; each `tools/call` of a tool the policy guards is claimed at the ledger
//! first, travels under the proxy's own id, and reaches the server at most once per logical
//! operation.

mod check;
mod door;
#[cfg(test)]
mod fuzz;
mod guard;
mod http;
mod message;
mod policy;
mod schema;
mod session;
mod stdio;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use once_client::{ClientConfig, ClientError, LedgerClient};

/// Guards an MCP server's state-changing tools with once-ledger.
// `Debug` never shows the ledger key.
#[derive(Parser)]
#[command(name = "once-proxy", version = once_telemetry::version(), args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    lint: Option<Lint>,
    /// The policy: which tools are guarded and how their calls are named (TOML).
    #[arg(long, env = "ONCE_PROXY_POLICY", required = true)]
    policy: Option<PathBuf>,
    #[command(flatten)]
    ledger: once_client::LedgerArgs,
    /// How log lines are written: text for people, or json (one object a line).
    #[arg(long, env = "ONCE_LOG_FORMAT", default_value = "text")]
    log_format: once_telemetry::LogFormat,
    /// Serve Prometheus metrics at http://ADDR/metrics: guarded calls by tool and how each
    /// ended (once_proxy_guarded_calls_total). Beyond loopback only with --metrics-token-file
    /// (or --insecure).
    #[arg(long, env = "ONCE_PROXY_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// A file holding the bearer token every scrape must send (as strong as an API key).
    #[arg(
        long,
        env = "ONCE_PROXY_METRICS_TOKEN_FILE",
        requires = "metrics_listen"
    )]
    metrics_token_file: Option<PathBuf>,
    /// The client name recorded in the ledger's attempt log.
    #[arg(long, env = "ONCE_PROXY_NAME", default_value = "once-proxy")]
    name: String,
    /// Deadline of one ledger RPC.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    ledger_timeout: Duration,
    /// Serve MCP over Streamable HTTP at `/mcp` on this address (with --upstream) instead of
    /// relaying stdio to a command. Beyond loopback it needs TLS and a client credential.
    #[arg(long, env = "ONCE_PROXY_LISTEN", requires = "upstream")]
    listen: Option<std::net::SocketAddr>,
    /// The upstream's Streamable HTTP MCP endpoint (with --listen).
    #[arg(long, env = "ONCE_PROXY_UPSTREAM", requires = "listen")]
    upstream: Option<reqwest::Url>,
    /// A header sent with every upstream request, `Name: value` (the upstream's credentials);
    /// the client's own headers pass through, its authorization too unless the proxy asks for
    /// a client token.
    #[arg(long = "upstream-header", value_parser = http::header)]
    upstream_headers: Vec<(axum::http::HeaderName, axum::http::HeaderValue)>,
    /// A file of such headers, one `Name: value` a line: credentials kept off the command
    /// line, which other users of the machine can read.
    #[arg(long, env = "ONCE_PROXY_UPSTREAM_HEADERS_FILE", requires = "listen")]
    upstream_headers_file: Option<PathBuf>,
    /// A file holding the token HTTP clients must present (`Authorization: Bearer …`).
    #[arg(long, env = "ONCE_PROXY_CLIENT_TOKEN_FILE", requires = "listen")]
    client_token_file: Option<PathBuf>,
    /// The listener's TLS certificate chain (PEM), with --tls-key.
    #[arg(long, env = "ONCE_PROXY_TLS_CERT", requires_all = ["listen", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// The listener's TLS private key (PEM).
    #[arg(long, env = "ONCE_PROXY_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Certificate authorities of client certificates (PEM): every client must present one.
    #[arg(long, env = "ONCE_PROXY_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// A `Host` the listener answers to besides its loopback names, as clients send it
    /// (`name` or `name:port`); repeatable.
    #[arg(
        long = "allowed-host",
        env = "ONCE_PROXY_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    allowed_hosts: Vec<String>,
    /// An `Origin` (`scheme://host[:port]`) whose browser pages may call the listener, besides
    /// its loopback names; repeatable.
    #[arg(
        long = "allowed-origin",
        env = "ONCE_PROXY_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    allowed_origins: Vec<String>,
    /// The largest request body read (bytes; K, M suffixes for KiB and MiB).
    #[arg(long, env = "ONCE_PROXY_MAX_BODY", default_value = "4M", value_parser = bytes)]
    max_body: usize,
    /// Serve beyond loopback without TLS or a client credential, and metrics without a token.
    /// Never in production.
    #[arg(long, env = "ONCE_PROXY_INSECURE")]
    insecure: bool,
    /// An environment variable the upstream command does not inherit (the ledger key never
    /// is); repeatable.
    #[arg(long = "env-remove", value_name = "NAME")]
    env_removed: Vec<String>,
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
    /// Reads a policy; against an MCP server, lists its tools beside the policy: which are
    /// guarded, which pass through, a warning for each tool that may change state but is not
    /// guarded, and for each argument a guarded tool's settings read that its inputSchema does
    /// not have or require. Exits 1 when it warns (notes do not count).
    #[command(
        override_usage = "once-proxy check POLICY\n       once-proxy check POLICY --against -- COMMAND [ARGS...]\n       once-proxy check POLICY --against-url URL [--header 'Name: value']..."
    )]
    Check {
        /// The policy to check.
        policy: PathBuf,
        /// Check against the stdio MCP server run by the command after `--`.
        #[arg(long, requires = "command", conflicts_with = "against_url")]
        against: bool,
        /// Check against the Streamable HTTP MCP server at this URL (its `/mcp` endpoint).
        #[arg(long, value_name = "URL")]
        against_url: Option<reqwest::Url>,
        /// A header sent with every request to --against-url, `Name: value` (its
        /// credentials); repeatable.
        #[arg(long = "header", value_parser = http::header, requires = "against_url")]
        headers: Vec<(axum::http::HeaderName, axum::http::HeaderValue)>,
        /// The MCP server to list the tools of, with --against.
        #[arg(last = true, requires = "against")]
        command: Vec<String>,
    },
}

/// A size in bytes: a number, or one with a K or M suffix (KiB, MiB).
fn bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let scale = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        _ => {
            return Err(format!(
                "{text:?}: a size is bytes, or a number with K or M"
            ))
        }
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{text:?}: a size is a positive number of bytes"))
}

/// A URL as logs and histories may show it: without userinfo, query or fragment, which may
/// carry credentials.
pub fn redacted(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            url.to_string()
        }
        Err(_) => "<an unparseable URL>".into(),
    }
}

impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Args")
            .field("policy", &self.policy)
            .field("ledger", &redacted(&self.ledger.ledger))
            .field(
                "ledger_key",
                &self.ledger.ledger_key.as_ref().map(|_| "<redacted>"),
            )
            .field("command", &self.command)
            .finish_non_exhaustive()
    }
}

fn main() -> std::process::ExitCode {
    let args: Args = once_telemetry::parse_args();
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
            policy,
            command,
            against_url,
            headers,
            ..
        }) => {
            let against = match against_url {
                Some(url) => check::Against::Url(url, headers),
                None if command.is_empty() => check::Against::Nothing,
                None => check::Against::Command(command),
            };
            runtime.block_on(lint(&policy, against))
        }
        None => runtime.block_on(proxy(args)),
    };
    match ran {
        Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // One line, in the log's format once it is set up.
        Err(error) => {
            let said = once_telemetry::sentence(&error);
            if tracing::dispatcher::has_been_set() {
                tracing::error!("once-proxy stopped: {said}");
            } else {
                eprintln!("once-proxy: {said}");
            }
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

async fn lint(policy: &std::path::Path, against: check::Against) -> anyhow::Result<i32> {
    let policy = policy::Policy::load(policy)?;
    let (report, warned) = check::check(&policy, against).await?;
    print!("{report}");
    Ok(i32::from(warned))
}

async fn proxy(args: Args) -> anyhow::Result<i32> {
    // stdout carries the MCP protocol: logs go to stderr.
    let telemetry = once_telemetry::Telemetry::init(once_telemetry::Process {
        name: "once-proxy",
        log_format: args.log_format,
        prometheus: args.metrics_listen.is_some(),
    })?;
    if let Some(address) = args.metrics_listen {
        serve_metrics(address, args.metrics_token_file.as_deref(), args.insecure).await?;
    }
    let path = args.policy.clone().expect("required without a subcommand");
    let policy = policy::Policy::load(&path)?;
    let mut config = args.ledger.config(&args.name)?;
    config.rpc_timeout = args.ledger_timeout;
    if let Err(refused) = check_ledger(&config).await {
        tracing::error!(ledger = %redacted(&args.ledger.ledger), reason = %refused, "once-proxy cannot use this ledger; stopping");
        return Ok(1);
    }
    let ledger = args.ledger.client_with(config)?;
    tracing::info!(policy = %path.display(), guarded = ?policy.tools.keys().collect::<Vec<_>>(), ledger = %redacted(&args.ledger.ledger), "once-proxy starting");
    let guard = guard::Guard::new(policy, ledger);
    let code = match (args.listen, args.upstream.clone()) {
        (Some(address), Some(upstream)) => http_proxy(guard, address, upstream, args).await,
        _ => stdio_proxy(guard, &args).await,
    };
    telemetry.shutdown();
    code
}

/// Serves the metrics on `address` (in the background, for as long as the proxy runs): beyond
/// loopback only with a token or `insecure`.
async fn serve_metrics(
    address: std::net::SocketAddr,
    token_file: Option<&std::path::Path>,
    insecure: bool,
) -> anyhow::Result<()> {
    let token = match token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--metrics-token-file {}: {e}", path.display()))?;
            let token = once_core::access::SecretHash::of_metrics_token(&text)
                .map_err(|e| anyhow::anyhow!("--metrics-token-file {}: {e}", path.display()))?;
            Some(token)
        }
        None => None,
    };
    if !address.ip().is_loopback() && token.is_none() && !insecure {
        anyhow::bail!(
            "refusing to serve metrics on {address} without a token: anyone who reaches it could \
             read them. Listen on loopback, give --metrics-token-file, or pass --insecure"
        );
    }
    let prometheus = once_telemetry::prometheus()
        .ok_or_else(|| anyhow::anyhow!("the metrics exporter is not set up"))?;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| anyhow::anyhow!("--metrics-listen {address}: {e}"))?;
    tokio::spawn(once_telemetry::serve_metrics(
        listener,
        prometheus,
        token.map(once_core::access::SecretHash::admits),
        std::future::pending(),
    ));
    Ok(())
}

/// Asks the ledger, once, who the proxy is to it before serving. What no retry mends (TLS on
/// one side only, an untrusted authority, something that is not a ledger, a key the ledger
/// refuses or one without the executor role) is the error returned, and the proxy stops. A
/// ledger not reachable yet (nothing listening, no answer, its database down) is an ERROR line
/// and the proxy serves: each guarded call is refused, unforwarded, until the ledger answers.
async fn check_ledger(config: &ClientConfig) -> Result<(), String> {
    let mut once = config.clone();
    once.tries = 1;
    let ledger = LedgerClient::connect(once).map_err(|e| e.to_string())?;
    match ledger.server_info().await {
        Ok(info) => {
            let key = match &info.key {
                Some(key) if !key.roles.iter().any(|r| r == "executor") => {
                    return Err(format!(
                        "the key {} ({}) of tenant {:?} holds {}, not the executor role a proxy \
                         needs to run guarded calls",
                        key.key_id,
                        key.name,
                        info.tenant,
                        key.roles.join(", ")
                    ))
                }
                Some(key) => format!("{} ({})", key.key_id, key.name),
                None => "none (an open ledger)".to_owned(),
            };
            tracing::info!(version = %info.version, tenant = %info.tenant, %key, "the ledger answers");
            Ok(())
        }
        Err(ClientError::Unreachable(unreachable)) if unreachable.cause.passes() => {
            tracing::error!(reason = %unreachable, "the ledger cannot be reached yet; serving, and refusing each guarded call until it answers");
            Ok(())
        }
        Err(ClientError::Refused { reason, message }) => Err(format!(
            "the ledger refuses the proxy's key: {message} ({reason})"
        )),
        Err(other) => Err(other.to_string()),
    }
}

/// Over stdio: the upstream command run as the proxy's child. When a guarded tool's errors are
/// to be taken for ABSENT, the command is first run on its own to list its tools, and a policy
/// that says so of a tool with an output schema is refused.
async fn stdio_proxy(guard: guard::Guard, args: &Args) -> anyhow::Result<i32> {
    if guard
        .policy
        .tools
        .values()
        .any(|t| t.on_error == policy::OnError::Absent)
    {
        let tools = check::list_tools(&args.command, &args.env_removed)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "listing the upstream's tools, to check on_error = \"absent\": {e:#}"
                )
            })?;
        guard.learn(&serde_json::json!({ "tools": tools }));
        let misjudged = guard.misjudged();
        anyhow::ensure!(misjudged.is_empty(), "{}", misjudged.join("\n"));
    }
    stdio::run(guard, &args.command, &args.env_removed).await
}

/// Over Streamable HTTP: a listener closed by default beyond loopback, in front of `upstream`.
async fn http_proxy(
    guard: guard::Guard,
    address: std::net::SocketAddr,
    upstream: reqwest::Url,
    args: Args,
) -> anyhow::Result<i32> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(once_tls::server_config(
            &once_tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.tls_client_ca.clone(),
            },
            &[b"h2", b"http/1.1"],
        )?),
        _ => None,
    };
    let token = match &args.client_token_file {
        Some(path) => {
            let token = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--client-token-file {}: {e}", path.display()))?;
            let token = token.trim().to_owned();
            anyhow::ensure!(
                token.len() >= door::MIN_TOKEN,
                "--client-token-file {}: a client token is at least {} characters",
                path.display(),
                door::MIN_TOKEN
            );
            Some(token)
        }
        None => None,
    };
    let credential = token.is_some() || args.tls_client_ca.is_some();
    if !address.ip().is_loopback() && !args.insecure {
        let missing = match (tls.is_some(), credential) {
            (false, _) => Some("without TLS (--tls-cert, --tls-key)"),
            (true, false) => {
                Some("without a client credential (--client-token-file or --tls-client-ca)")
            }
            (true, true) => None,
        };
        if let Some(missing) = missing {
            anyhow::bail!(
                "--listen {address} is beyond loopback and would be served {missing}: anyone \
                 who reaches it could call the upstream's tools with its credentials. Add them, \
                 listen on 127.0.0.1, or pass --insecure"
            );
        }
    }
    let mut headers: axum::http::HeaderMap = args.upstream_headers.into_iter().collect();
    if let Some(path) = &args.upstream_headers_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--upstream-headers-file {}: {e}", path.display()))?;
        for (n, line) in text.lines().map(str::trim).enumerate() {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // The line is not quoted back: it may hold a credential.
            let (name, value) = http::header(line).map_err(|_| {
                anyhow::anyhow!(
                    "--upstream-headers-file {}: line {} is not \"Name: value\"",
                    path.display(),
                    n + 1
                )
            })?;
            headers.insert(name, value);
        }
    }
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| anyhow::anyhow!("--listen {address}: {e}"))?;
    let bound = listener.local_addr()?;
    let settings = http::Settings {
        door: door::Door::new(
            bound,
            tls.is_some(),
            &args.allowed_hosts,
            &args.allowed_origins,
            token.as_deref(),
        ),
        upstream,
        headers,
        max_body: args.max_body,
    };
    let served = match tls {
        Some(config) => {
            let listener = once_tls::TlsListener::new(listener, config)?;
            http::serve(guard, listener, settings, stopped()).await
        }
        None => http::serve(guard, listener, settings, stopped()).await,
    };
    served.map(|()| 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_in_logs_lose_their_credentials() {
        assert_eq!(
            redacted("http://user:pa55@127.0.0.1:9/mcp?token=s3cret#frag"),
            "http://127.0.0.1:9/mcp"
        );
        assert_eq!(redacted("not a url"), "<an unparseable URL>");
    }

    #[test]
    fn sizes_are_bytes_or_kib_or_mib() {
        assert_eq!(bytes("4M"), Ok(4 << 20));
        assert_eq!(bytes("512K"), Ok(512 << 10));
        assert_eq!(bytes("1000"), Ok(1000));
        assert!(bytes("0").is_err());
        assert!(bytes("4G").is_err());
    }
}
