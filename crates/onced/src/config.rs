//! `onced` configuration: parsed once from flags and environment, validated, then passed
//! explicitly to everything that needs it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use once_core::Limits;

/// The once-ledger service.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "onced",
    version = crate::version(),
    about = "The once-ledger operation ledger service",
    args_override_self = true
)]
pub struct Config {
    /// Administration of tenants and credentials, straight on the database; without one,
    /// `onced` serves.
    #[command(subcommand)]
    pub command: Option<crate::cli::Command>,

    /// Where operations are stored: `sqlite://PATH` (created if missing) or
    /// `postgres://USER@HOST/DB`.
    #[arg(
        long,
        env = "ONCE_DATABASE_URL",
        default_value = "sqlite://once.db",
        global = true
    )]
    pub database_url: String,

    /// The key file whose active Ed25519 key signs receipts (see docs/evidence.md). Default
    /// for a SQLite file: beside it (`once.db.signing-key`), created on the first start. On
    /// PostgreSQL receipts are signed only with this set, and the file must exist: create it
    /// once with `onced signing-keys rotate` and give every replica the same copy.
    #[arg(long, env = "ONCE_SIGNING_KEY_FILE", global = true)]
    pub signing_key_file: Option<PathBuf>,

    /// A TOML file configuring reconcilers (see the plugin guide). Without one, UNKNOWN
    /// operations wait for a late report or an operator.
    #[arg(long, env = "ONCE_CONFIG")]
    pub config: Option<std::path::PathBuf>,

    /// Address the gRPC API listens on.
    #[arg(long, env = "ONCE_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// A PEM certificate chain to serve TLS with (with --tls-key). Re-read on SIGHUP and
    /// when the file changes; connections already open keep theirs.
    #[arg(long, env = "ONCE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// The PEM private key of --tls-cert.
    #[arg(long, env = "ONCE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// PEM certificate authorities whose client certificates are accepted: every connection
    /// must then present one (mTLS). A client certificate registered with
    /// `onced keys create --certificate` stands in for an API key.
    #[arg(long, env = "ONCE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// How often the TLS files are checked for changes.
    #[arg(long, env = "ONCE_TLS_RELOAD_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub tls_reload_interval: Duration,

    /// A file holding the admin API key to store at start (also ONCE_ADMIN_KEY, the key
    /// itself). Stored once, as a hash, for tenant `default`; 32 random bytes' worth, e.g.
    /// `openssl rand -hex 32`.
    #[arg(long, env = "ONCE_ADMIN_KEY_FILE")]
    pub admin_key_file: Option<PathBuf>,

    /// How long a credential lookup is cached: a key created or revoked on any replica takes
    /// effect on every replica within this.
    #[arg(long, env = "ONCE_CREDENTIAL_TTL", default_value = "2s", value_parser = humantime::parse_duration)]
    pub credential_ttl: Duration,

    /// Serve beyond loopback without TLS, or without credentials. Never in production.
    #[arg(long, env = "ONCE_INSECURE")]
    pub insecure: bool,

    /// Lease granted when a Begin names none.
    #[arg(long, env = "ONCE_DEFAULT_LEASE", default_value = "30s", value_parser = humantime::parse_duration)]
    pub default_lease: Duration,

    /// Longest lease a Begin may ask for; longer effects send heartbeats.
    #[arg(long, env = "ONCE_MAX_LEASE", default_value = "1h", value_parser = humantime::parse_duration)]
    pub max_lease: Duration,

    /// How long settled operations with derived (`tool:h:…`) ids are kept.
    #[arg(long, env = "ONCE_RETENTION_DERIVED", default_value = "10m", value_parser = humantime::parse_duration)]
    pub retention_derived: Duration,

    /// How long settled operations with explicit or intent ids are kept.
    #[arg(long, env = "ONCE_RETENTION_EXPLICIT", default_value = "24h", value_parser = humantime::parse_duration)]
    pub retention_explicit: Duration,

    /// The most retention a Begin may ask for.
    #[arg(long, env = "ONCE_MAX_RETENTION", default_value = "30days", value_parser = humantime::parse_duration)]
    pub max_retention: Duration,

    /// How long an operation that ended ABSENT is kept at least, past its own retention, as
    /// the tombstone that hands its provider key to the next life: as long as providers
    /// remember an idempotency key (Stripe: 24 hours).
    #[arg(long, env = "ONCE_PROVIDER_KEY_WINDOW", default_value = "24h", value_parser = humantime::parse_duration)]
    pub provider_key_window: Duration,

    /// How long events are kept.
    #[arg(long, env = "ONCE_EVENT_RETENTION", default_value = "30days", value_parser = humantime::parse_duration)]
    pub event_retention: Duration,

    /// Largest result a Confirm may store, in bytes.
    #[arg(long, env = "ONCE_MAX_RESULT_BYTES", default_value_t = 64 * 1024)]
    pub max_result_bytes: usize,

    /// Longest a Begin may wait for an IN_PROGRESS operation to settle.
    #[arg(long, env = "ONCE_MAX_WAIT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub max_wait: Duration,

    /// How often IN_FLIGHT operations past their lease are turned UNKNOWN.
    #[arg(long, env = "ONCE_LEASE_SWEEP_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub lease_sweep_interval: Duration,

    /// How often settled operations past retention, and old events, are deleted.
    #[arg(long, env = "ONCE_RETENTION_SWEEP_INTERVAL", default_value = "1m", value_parser = humantime::parse_duration)]
    pub retention_sweep_interval: Duration,

    /// How often the database is pinged for the gRPC health service.
    #[arg(long, env = "ONCE_HEALTH_CHECK_INTERVAL", default_value = "2s", value_parser = humantime::parse_duration)]
    pub health_check_interval: Duration,

    /// The most WatchOperations streams this replica serves at once.
    #[arg(long, env = "ONCE_MAX_WATCHERS", default_value_t = 256)]
    pub max_watchers: usize,

    /// The most WatchOperations streams this replica serves at once to one tenant's callers.
    #[arg(long, env = "ONCE_MAX_WATCHERS_PER_TENANT", default_value_t = 64)]
    pub max_watchers_per_tenant: usize,

    /// The most WatchOperations streams this replica serves at once to one credential.
    #[arg(long, env = "ONCE_MAX_WATCHERS_PER_KEY", default_value_t = 16)]
    pub max_watchers_per_key: usize,

    /// How log lines are written: text for people, or json (one object a line) for log
    /// pipelines.
    #[arg(long, env = "ONCE_LOG_FORMAT", default_value = "text")]
    pub log_format: once_telemetry::LogFormat,

    /// Serve Prometheus metrics at http://ADDR/metrics (off unless given). Metrics are also
    /// pushed over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    #[arg(long, env = "ONCE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// A file holding the bearer token every scrape must send (`Authorization: Bearer
    /// <token>`; Prometheus: `authorization: { credentials_file: … }`). Needed to serve metrics
    /// beyond loopback, unless --insecure.
    #[arg(long, env = "ONCE_METRICS_TOKEN_FILE")]
    pub metrics_token_file: Option<PathBuf>,

    /// How often the gauges read from the database (open operations, UNKNOWN ages) are
    /// refreshed, while metrics are on.
    #[arg(long, env = "ONCE_METRICS_INTERVAL", default_value = "15s", value_parser = humantime::parse_duration)]
    pub metrics_interval: Duration,

    /// Serve the on-call web console at http://ADDR/ (off unless given): the UNKNOWN queue,
    /// each operation's story, and reconcile and resolve for operators, signed in with an API
    /// key. It is served without TLS, so beyond loopback only with --insecure (behind a
    /// TLS-terminating proxy that keeps the `Host`).
    #[arg(long, env = "ONCE_CONSOLE_LISTEN")]
    pub console_listen: Option<SocketAddr>,

    /// A `Host` the console answers to besides its loopback names, as browsers send it
    /// (`name` or `name:port`); repeatable.
    #[arg(
        long = "console-allowed-host",
        env = "ONCE_CONSOLE_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    pub console_allowed_hosts: Vec<String>,

    /// The origin browsers reach the console at when it is not the listener itself: behind a
    /// TLS-terminating proxy, `https://console.example.com`. Forms must come from it, its host
    /// is answered to, and under https the session cookie is `Secure`.
    #[arg(long, env = "ONCE_CONSOLE_PUBLIC_ORIGIN")]
    pub console_public_origin: Option<String>,

    /// A console session ends after this long without a request.
    #[arg(long, env = "ONCE_CONSOLE_SESSION_IDLE", default_value = "30m", value_parser = humantime::parse_duration)]
    pub console_session_idle: Duration,

    /// A console session ends this long after sign-in, used or not.
    #[arg(long, env = "ONCE_CONSOLE_SESSION_LIFETIME", default_value = "12h", value_parser = humantime::parse_duration)]
    pub console_session_lifetime: Duration,

    /// PostgreSQL connections per replica in its pool (it also opens up to two of its own that
    /// read and write for concurrent callers together).
    #[arg(long, env = "ONCE_DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,

    /// How long a request waits for a database connection before answering UNAVAILABLE.
    #[arg(long, env = "ONCE_DB_ACQUIRE_TIMEOUT", default_value = "3s", value_parser = humantime::parse_duration)]
    pub db_acquire_timeout: Duration,

    /// At start, how long to keep trying a PostgreSQL that cannot be reached (not started yet,
    /// restarting) before giving up; 0 gives up at once. Each try that fails is a WARN line
    /// naming the server and the cause.
    #[arg(long, env = "ONCE_WAIT_FOR_DATABASE", default_value = "0s", value_parser = humantime::parse_duration)]
    pub wait_for_database: Duration,
}

/// A setting `onced` cannot start with; the message names it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--database-url must start with sqlite: or postgres://, got {scheme:?}")]
    DatabaseUrl { scheme: String },
    #[error("--default-lease must not exceed --max-lease")]
    LeaseOverMax,
    #[error("retention defaults must not exceed --max-retention")]
    RetentionOverMax,
    #[error("sweep intervals must be positive")]
    ZeroInterval,
    #[error(
        "watcher limits must nest, 1 <= --max-watchers-per-key ({key}) <= \
         --max-watchers-per-tenant ({tenant}) <= --max-watchers ({replica})"
    )]
    WatcherLimits {
        key: usize,
        tenant: usize,
        replica: usize,
    },
    #[error("--credential-ttl and --tls-reload-interval must be positive")]
    ZeroTtl,
    #[error("--credential-ttl must be at most 60s: a revoked key must be refused within seconds")]
    LongTtl,
    #[error("{}: cannot read it", path.display())]
    ReadFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("ONCE_ADMIN_KEY and --admin-key-file: {0}")]
    AdminKey(String),
    #[error(
        "refusing to listen on {listen} {why}: anyone who reaches it could call the ledger. \
         Listen on loopback, turn on TLS (--tls-cert, --tls-key) and credentials (create a key, \
         or ONCE_ADMIN_KEY), or pass --insecure"
    )]
    Exposed {
        listen: SocketAddr,
        why: &'static str,
    },
    #[error(
        "refusing to serve metrics on {listen} without a token: anyone who reaches it could \
         read the ledger's tools, volumes and errors. Serve them on loopback, give \
         --metrics-token-file, or pass --insecure"
    )]
    MetricsExposed { listen: SocketAddr },
    #[error(
        "refusing to serve the console on {listen}: it serves no TLS, so a key typed into it \
         and its session cookie would cross the network in clear. Serve it on loopback (reach \
         it through an SSH tunnel), or behind a TLS-terminating proxy with --insecure"
    )]
    ConsoleExposed { listen: SocketAddr },
    #[error(
        "--console-public-origin {0:?}: write the scheme and host browsers use, as \
         https://console.example.com"
    )]
    ConsoleOrigin(String),
    #[error(
        "refusing to serve the console while --tls-client-ca requires client certificates: the \
         console signs in with API keys alone, so it would let a caller without a certificate \
         in. Pass --insecure to serve it anyway"
    )]
    ConsoleWithoutCertificates,
    #[error("--console-session-idle and --console-session-lifetime must be positive")]
    ConsoleSessions,
    #[error("--metrics-token-file {}: {message}", path.display())]
    MetricsToken {
        path: std::path::PathBuf,
        message: String,
    },
    #[error("--config {}: cannot read it", path.display())]
    ReadReconcilers {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("--config {}: not a valid reconciler configuration", path.display())]
    Reconcilers {
        path: std::path::PathBuf,
        source: once_reconcile::config::ConfigError,
    },
}

/// The configuration resolved before anything is touched: every setting checked, and every
/// file a setting names read and checked (the reconcilers, the admin key, TLS, the metrics
/// token), so a typo fails before a port is bound or the database opened.
#[derive(Debug)]
pub struct Settings {
    pub config: Config,
    pub(crate) store: StoreKind,
    pub(crate) limits: Limits,
    pub(crate) metrics_token: Option<once_core::access::SecretHash>,
    pub(crate) admin_key: Option<once_core::access::ApiKey>,
    pub(crate) tls: Option<crate::tls::Tls>,
    pub(crate) reconciliation: once_reconcile::config::Reconciliation,
    pub(crate) signing: crate::signing::Signing,
}

/// The database `database_url` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Sqlite,
    Postgres,
}

impl Config {
    /// Checks every setting and reads every file the settings name: see [`Settings`].
    pub fn resolve(self) -> anyhow::Result<Settings> {
        use anyhow::Context as _;
        self.validate()?;
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(
                crate::tls::Tls::load(crate::tls::TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: self.tls_client_ca.clone(),
                })
                .context("loading TLS")?,
            ),
            _ => None,
        };
        Ok(Settings {
            store: self.store_kind()?,
            limits: self.limits(),
            metrics_token: self.metrics_token()?,
            admin_key: self.admin_key()?,
            tls,
            reconciliation: self.reconciliation()?,
            signing: self.signing_keys()?,
            config: self,
        })
    }

    /// Checks what flags alone cannot, and says which setting is wrong.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.store_kind()?;
        if self.default_lease > self.max_lease {
            return Err(ConfigError::LeaseOverMax);
        }
        if self.retention_derived > self.max_retention
            || self.retention_explicit > self.max_retention
        {
            return Err(ConfigError::RetentionOverMax);
        }
        if self.credential_ttl.is_zero() || self.tls_reload_interval.is_zero() {
            return Err(ConfigError::ZeroTtl);
        }
        if self.credential_ttl > Duration::from_secs(60) {
            return Err(ConfigError::LongTtl);
        }
        if self.lease_sweep_interval.is_zero()
            || self.retention_sweep_interval.is_zero()
            || self.health_check_interval.is_zero()
            || self.metrics_interval.is_zero()
        {
            return Err(ConfigError::ZeroInterval);
        }
        if self.max_watchers_per_key == 0
            || self.max_watchers_per_key > self.max_watchers_per_tenant
            || self.max_watchers_per_tenant > self.max_watchers
        {
            return Err(ConfigError::WatcherLimits {
                key: self.max_watchers_per_key,
                tenant: self.max_watchers_per_tenant,
                replica: self.max_watchers,
            });
        }
        if self.console_session_idle.is_zero() || self.console_session_lifetime.is_zero() {
            return Err(ConfigError::ConsoleSessions);
        }
        if let Some(origin) = &self.console_public_origin {
            let well_formed = origin.split_once("://").is_some_and(|(scheme, host)| {
                matches!(scheme, "http" | "https")
                    && !host.is_empty()
                    && !host.trim_end_matches('/').contains('/')
            });
            if !well_formed {
                return Err(ConfigError::ConsoleOrigin(origin.clone()));
            }
        }
        match self.console_listen {
            Some(listen) if !listen.ip().is_loopback() && !self.insecure => {
                Err(ConfigError::ConsoleExposed { listen })
            }
            Some(_) if self.tls_client_ca.is_some() && !self.insecure => {
                Err(ConfigError::ConsoleWithoutCertificates)
            }
            _ => Ok(()),
        }
    }

    /// How the console is reached, when it is served.
    pub(crate) fn console(&self) -> Option<once_console::ConsoleOptions> {
        Some(once_console::ConsoleOptions {
            listen: self.console_listen?,
            allowed_hosts: self.console_allowed_hosts.clone(),
            public_origin: self.console_public_origin.clone(),
            session_idle: self.console_session_idle,
            session_lifetime: self.console_session_lifetime,
        })
    }

    pub fn store_kind(&self) -> Result<StoreKind, ConfigError> {
        let url = self.database_url.as_str();
        if url.starts_with("sqlite:") {
            Ok(StoreKind::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(StoreKind::Postgres)
        } else {
            Err(ConfigError::DatabaseUrl {
                scheme: url.split(':').next().unwrap_or_default().to_owned(),
            })
        }
    }

    /// The signing key file: the one named, or for a SQLite file the one beside it.
    pub fn signing_key_path(&self) -> Option<PathBuf> {
        if let Some(path) = &self.signing_key_file {
            return Some(path.clone());
        }
        let url = self.database_url.as_str();
        let path = url.strip_prefix("sqlite:")?.split(['?', '#']).next()?;
        let path = path.strip_prefix("//").unwrap_or(path);
        let in_memory = path.is_empty() || path.contains(":memory:");
        (!in_memory).then(|| PathBuf::from(format!("{path}.signing-key")))
    }

    /// Reads the signing keys. A SQLite ledger's key file is made on its first start, once its
    /// database (and the directory the file goes in) is.
    fn signing_keys(&self) -> anyhow::Result<crate::signing::Signing> {
        use crate::signing::{KeyRing, Signing};
        use anyhow::Context as _;
        let Some(path) = self.signing_key_path() else {
            return Ok(Signing::None);
        };
        match self.store_kind()? {
            // The file beside a SQLite database is made on its first start; a file named is
            // one made already (a misspelt path is not a new key).
            StoreKind::Sqlite if self.signing_key_file.is_none() && !path.exists() => {
                Ok(Signing::Create(path))
            }
            StoreKind::Sqlite | StoreKind::Postgres => KeyRing::load(&path)
                .map(|ring| Signing::Ring(Box::new(ring)))
                .context("create the key file once with `onced signing-keys rotate --signing-key-file FILE` (replicas on PostgreSQL share one: copy it to each)"),
        }
    }

    /// The database as a log may show it: a SQLite file's path, or PostgreSQL's host, port and
    /// database, never a user, a password or the URL's parameters.
    pub fn database_shown(&self) -> String {
        let url = self.database_url.as_str();
        let without_query = url.split(['?', '#']).next().unwrap_or_default();
        match without_query.split_once("://") {
            Some((scheme, rest)) if scheme.starts_with("postgres") => {
                let (authority, database) = rest.split_once('/').unwrap_or((rest, ""));
                let host = authority
                    .rsplit_once('@')
                    .map_or(authority, |(_, host)| host);
                format!("postgres://{host}/{database}")
            }
            _ => without_query.to_owned(),
        }
    }

    /// Reads the reconcilers from `--config`; credentials come from the environment.
    pub fn reconciliation(&self) -> Result<once_reconcile::config::Reconciliation, ConfigError> {
        let Some(path) = &self.config else {
            return Ok(Default::default());
        };
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::ReadReconcilers {
                path: path.clone(),
                source,
            })?;
        once_reconcile::config::parse(&text, |name| std::env::var(name).ok()).map_err(|source| {
            ConfigError::Reconcilers {
                path: path.clone(),
                source,
            }
        })
    }

    /// The admin key to bootstrap: the ONCE_ADMIN_KEY variable, or the file it names.
    pub fn admin_key(&self) -> Result<Option<once_core::access::ApiKey>, ConfigError> {
        let supplied = match (&self.admin_key_file, std::env::var("ONCE_ADMIN_KEY").ok()) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::AdminKey("give one of them, not both".into()))
            }
            (Some(path), None) => {
                std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
                    path: path.clone(),
                    source,
                })?
            }
            (None, Some(key)) => key,
            (None, None) => return Ok(None),
        };
        let mut id = [0u8; 6];
        getrandom::getrandom(&mut id)
            .map_err(|e| ConfigError::AdminKey(format!("no randomness for its key id: {e}")))?;
        once_core::access::ApiKey::supplied(supplied, id)
            .map(Some)
            .map_err(ConfigError::AdminKey)
    }

    /// The token metrics scrapes must send, read from `--metrics-token-file` and held to the
    /// strength of a supplied key; refuses to serve metrics beyond loopback without one,
    /// unless `--insecure`.
    pub fn metrics_token(&self) -> Result<Option<once_core::access::SecretHash>, ConfigError> {
        let token = match &self.metrics_token_file {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
                        path: path.clone(),
                        source,
                    })?;
                let token =
                    once_core::access::SecretHash::of_metrics_token(&text).map_err(|message| {
                        ConfigError::MetricsToken {
                            path: path.clone(),
                            message,
                        }
                    })?;
                Some(token)
            }
            None => None,
        };
        match self.metrics_listen {
            Some(listen) if !listen.ip().is_loopback() && token.is_none() && !self.insecure => {
                Err(ConfigError::MetricsExposed { listen })
            }
            _ => Ok(token),
        }
    }

    /// Refuses to expose an unprotected ledger beyond loopback, unless `--insecure`.
    pub fn check_exposure(&self, authenticated: bool) -> Result<(), ConfigError> {
        if self.insecure || self.listen.ip().is_loopback() {
            return Ok(());
        }
        let why = if self.tls_cert.is_none() {
            "without TLS"
        } else if !authenticated {
            "without credentials"
        } else {
            return Ok(());
        };
        Err(ConfigError::Exposed {
            listen: self.listen,
            why,
        })
    }

    pub fn limits(&self) -> Limits {
        let ms = once_core::duration_ms;
        Limits {
            default_lease_ms: ms(self.default_lease),
            max_lease_ms: ms(self.max_lease),
            retention_derived_ms: ms(self.retention_derived),
            retention_explicit_ms: ms(self.retention_explicit),
            max_retention_ms: ms(self.max_retention),
            max_wait_ms: ms(self.max_wait),
            max_result_bytes: self.max_result_bytes,
            ..Limits::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validated(extra: &[&str]) -> Result<(), ConfigError> {
        let mut args = vec!["onced"];
        args.extend(extra);
        Config::try_parse_from(args)
            .expect("flags parse")
            .validate()
    }

    #[test]
    fn the_console_is_served_beyond_loopback_only_when_told_insecure() {
        assert!(validated(&["--console-listen", "127.0.0.1:8080"]).is_ok());
        assert!(validated(&["--console-listen", "[::1]:8080"]).is_ok());
        assert!(matches!(
            validated(&["--console-listen", "0.0.0.0:8080"]),
            Err(ConfigError::ConsoleExposed { .. })
        ));
        assert!(validated(&["--console-listen", "0.0.0.0:8080", "--insecure"]).is_ok());
        assert!(matches!(
            validated(&[
                "--console-listen",
                "127.0.0.1:8080",
                "--tls-cert",
                "c.pem",
                "--tls-key",
                "k.pem",
                "--tls-client-ca",
                "ca.pem"
            ]),
            Err(ConfigError::ConsoleWithoutCertificates)
        ));
        assert!(matches!(
            validated(&["--console-public-origin", "console.example.com"]),
            Err(ConfigError::ConsoleOrigin(_))
        ));
        assert!(validated(&["--console-public-origin", "https://console.example.com"]).is_ok());
        assert!(matches!(
            validated(&["--console-session-idle", "0s"]),
            Err(ConfigError::ConsoleSessions)
        ));
    }

    #[test]
    fn the_database_is_shown_without_credentials_or_parameters() {
        let shown = |url: &str| {
            Config::try_parse_from(["onced", "--database-url", url])
                .unwrap()
                .database_shown()
        };
        assert_eq!(
            shown("postgres://ledger:s3cret@db.internal:5433/once?sslmode=require"),
            "postgres://db.internal:5433/once"
        );
        assert_eq!(shown("postgresql://db/once"), "postgres://db/once");
        assert_eq!(
            shown("sqlite:/var/lib/once/ledger.db?mode=rwc"),
            "sqlite:/var/lib/once/ledger.db"
        );
    }

    #[test]
    fn watcher_limits_nest_key_within_tenant_within_replica() {
        assert!(validated(&[]).is_ok(), "the defaults nest");
        let limits = |key: &'static str, tenant: &'static str, replica: &'static str| {
            validated(&[
                "--max-watchers-per-key",
                key,
                "--max-watchers-per-tenant",
                tenant,
                "--max-watchers",
                replica,
            ])
        };
        assert!(limits("1", "1", "1").is_ok());
        assert!(limits("4", "8", "8").is_ok());
        for (key, tenant, replica) in [("0", "8", "8"), ("9", "8", "16"), ("4", "17", "16")] {
            let refused = limits(key, tenant, replica).unwrap_err();
            assert!(matches!(refused, ConfigError::WatcherLimits { .. }));
            let message = refused.to_string();
            assert!(
                message.contains(&format!("--max-watchers-per-key ({key})")),
                "{message}"
            );
        }
    }
}
