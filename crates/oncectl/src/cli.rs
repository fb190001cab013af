//! The command line: every command, flag and environment variable, parsed once by clap.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use once_core::cli::NewCredential;

use crate::bulk::Filter;

/// The on-call CLI of once-ledger: find, inspect, reconcile, resolve and watch operations.
///
/// Exit codes: 0 done, 1 no ledger answered (or another failure), 2 usage, 3 not found,
/// 4 refused (by the ledger itself, or declined at the prompt).
#[derive(Debug, Parser)]
#[command(name = "oncectl", version = once_telemetry::version(), args_override_self = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// How to reach the ledger and how to print; flags win over environment variables, which win
/// over the profile.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Global options")]
pub struct Global {
    /// The ledger: http://HOST:PORT, or https:// for one serving TLS.
    #[arg(long, env = "ONCE_ADDR", global = true)]
    pub addr: Option<String>,

    /// The API key, sent as a bearer token (it names the tenant).
    #[arg(long, env = "ONCE_KEY", global = true)]
    pub key: Option<String>,

    /// A PEM file of the certificate authority that signed the ledger's TLS certificate.
    #[arg(long, env = "ONCE_CA", global = true)]
    pub ca: Option<PathBuf>,

    /// A PEM client certificate to present, for a ledger that asks for one (mTLS).
    #[arg(long, env = "ONCE_CERT", global = true, requires = "cert_key")]
    pub cert: Option<PathBuf>,

    /// The PEM private key of --cert.
    #[arg(long, env = "ONCE_CERT_KEY", global = true, requires = "cert")]
    pub cert_key: Option<PathBuf>,

    /// Who you are, recorded with every resolution as operator:<name>.
    #[arg(long, env = "ONCE_OPERATOR", global = true)]
    pub operator: Option<String>,

    /// A profile of the profile file to take settings from (its `default` otherwise).
    #[arg(long, env = "ONCE_PROFILE", global = true)]
    pub profile: Option<String>,

    /// The profile file [default: $XDG_CONFIG_HOME/once/oncectl.toml or
    /// ~/.config/once/oncectl.toml].
    #[arg(long, env = "ONCECTL_CONFIG", global = true)]
    pub profiles: Option<PathBuf>,

    /// How to print: a table for people, or JSON for programs.
    #[arg(short = 'o', long, value_enum, global = true, default_value = "table")]
    pub output: Output,

    /// The same as -o json.
    #[arg(long, global = true)]
    pub json: bool,

    /// No colour, even on a terminal (also when NO_COLOR is set).
    #[arg(long, global = true)]
    pub no_color: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

impl Global {
    pub fn json(&self) -> bool {
        self.json || self.output == Output::Json
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Which ledger this reaches and how (address, TLS), who you are to it (tenant, key,
    /// roles), and its version: a check of the settings that changes nothing.
    Status,
    /// Operations, oldest first: UNKNOWN ones unless told otherwise.
    List(ListArgs),
    /// One operation: its attempts, its calls and where they came from, and its history.
    Show {
        /// The operation id.
        operation: String,
        /// Another tenant's (a key with the admin role).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Settle an UNKNOWN operation, with the attempt you examined and a reason; or, with
    /// --filter, every UNKNOWN operation a filter selects ABSENT, each bound to the attempt it
    /// had when listed.
    Resolve(ResolveArgs),
    /// Look an UNKNOWN operation up with its reconciler now, and apply the verdict; or, with
    /// --filter, every UNKNOWN operation a filter selects.
    Reconcile(ReconcileArgs),
    /// Counts by state and tool, UNKNOWN ages, time to resolution by door, anomalies.
    Stats {
        /// How far back resolutions and anomalies are counted.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        window: Duration,
        /// Another tenant's (a key with the admin role).
        #[arg(long)]
        tenant: Option<String>,
        /// Every tenant's, added up (a key with the admin role).
        #[arg(long, conflicts_with = "tenant")]
        all_tenants: bool,
    },
    /// Where repeated calls came from: retries, reconnects, re-issues, other clients.
    Forensics {
        /// Only this tool's operations.
        #[arg(long)]
        tool: Option<String>,
        /// How far back (e.g. 15m, 1h, 1d).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        since: Duration,
        /// Another tenant's (a key with the admin role).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Walk the tenant's chained history and name the first event, result or state that does
    /// not match what the chain recorded (exit 5 when one does not).
    Verify {
        /// Only the links covering events after this sequence.
        #[arg(long, default_value_t = 0)]
        from: i64,
        /// Another tenant's (a key with the admin role).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Signed receipts of CONFIRMED and ABSENT operations: get one, verify one (offline with
    /// --public-key; exit 5 when it does not verify).
    #[command(subcommand)]
    Receipt(ReceiptCommand),
    /// Follow changes as they happen; reconnects and resumes without gaps or repeats.
    Watch(WatchArgs),
    /// API keys of a tenant (admin).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Print a shell completion script.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// A state as people write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StateArg {
    Absent,
    InFlight,
    Confirmed,
    Unknown,
}

impl From<StateArg> for once_core::State {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Absent => once_core::State::Absent,
            StateArg::InFlight => once_core::State::InFlight,
            StateArg::Confirmed => once_core::State::Confirmed,
            StateArg::Unknown => once_core::State::Unknown,
        }
    }
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only these states (repeat, or separate with commas) [default: UNKNOWN].
    #[arg(long = "state", value_enum, value_delimiter = ',', ignore_case = true)]
    pub states: Vec<StateArg>,
    /// Every state.
    #[arg(long, conflicts_with = "states")]
    pub all: bool,
    /// Only this tool's operations.
    #[arg(long)]
    pub tool: Option<String>,
    /// Only operations this reconciler looks up.
    #[arg(long)]
    pub provider: Option<String>,
    /// Only operations created at least this long ago (e.g. 10m, 2h).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub older_than: Option<Duration>,
    /// At most this many (every page is fetched until then).
    #[arg(long, default_value_t = 500)]
    pub limit: usize,
    /// Another tenant's (a key with the admin role).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Every tenant's, with a TENANT column (a key with the admin role).
    #[arg(long, conflicts_with = "tenant")]
    pub all_tenants: bool,
}

/// Many UNKNOWN operations at once: which, and whether only to list them.
#[derive(Debug, Args)]
pub struct BulkArgs {
    /// Every UNKNOWN operation this selects, instead of one: comma-separated tool=NAME,
    /// provider=NAME, older-than=DURATION (e.g. provider=stripe,older-than=1h), or `all`.
    /// The list is shown, and asked about, before anything is done.
    #[arg(long, value_name = "FILTER")]
    pub filter: Option<Filter>,
    /// With --filter: list what would be done, and do nothing.
    #[arg(long, requires = "filter")]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["operation", "filter"])))]
pub struct ReconcileArgs {
    /// The operation id, or a unique start of it.
    #[arg(conflicts_with = "filter")]
    pub operation: Option<String>,
    #[command(flatten)]
    pub bulk: BulkArgs,
    /// How long to wait for each lookup.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
    /// With --filter: do not ask.
    #[arg(long, short = 'y', requires = "filter")]
    pub yes: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("truth").required(true).args(["confirmed", "absent"])))]
#[command(group(clap::ArgGroup::new("which").required(true).args(["operation", "filter"])))]
pub struct ResolveArgs {
    /// The operation id, or a unique start of it.
    #[arg(conflicts_with = "filter")]
    pub operation: Option<String>,
    #[command(flatten)]
    pub bulk: BulkArgs,
    /// The effect happened (give the provider's reference). One operation at a time: each
    /// has a reference and a result of its own.
    #[arg(long, requires = "provider_ref", conflicts_with = "filter")]
    pub confirmed: bool,
    /// The effect certainly did not happen.
    #[arg(long, conflicts_with_all = ["provider_ref", "result"])]
    pub absent: bool,
    /// The provider's id of the effect (e.g. the refund id).
    #[arg(long)]
    pub provider_ref: Option<String>,
    /// The result later callers are replayed: text, or @FILE for a file's bytes.
    #[arg(long)]
    pub result: Option<String>,
    /// Why you believe this (recorded with the resolution).
    #[arg(long, required = true)]
    pub reason: String,
    /// The number of the attempt you examined [default: the latest]. The resolution is refused
    /// if another attempt has run since.
    #[arg(long, conflicts_with = "filter")]
    pub attempt: Option<u32>,
    /// The resolution's id, to retry one whose answer was lost [default: a new one].
    #[arg(long, conflicts_with = "filter")]
    pub resolution_id: Option<String>,
    /// Do not ask.
    #[arg(long, short = 'y')]
    pub yes: bool,
}

#[derive(Debug, Args)]
pub struct WatchArgs {
    /// Changes that move an operation into or out of these states, or happen while it is in
    /// one [default: UNKNOWN, with the anomalies].
    #[arg(long = "state", value_enum, value_delimiter = ',', ignore_case = true)]
    pub states: Vec<StateArg>,
    /// And events of these kinds (e.g. CLAIMED, ESCALATED, DOUBLE_EXECUTION).
    #[arg(long = "kind", value_delimiter = ',')]
    pub kinds: Vec<String>,
    /// Every change.
    #[arg(long, conflicts_with_all = ["states", "kinds"])]
    pub all: bool,
    /// Only this tool's operations.
    #[arg(long)]
    pub tool: Option<String>,
    /// Only operations this reconciler looks up (each event's operation is looked up once).
    #[arg(long)]
    pub provider: Option<String>,
    /// Only operations created at least this long before the event (e.g. 10m, 2h).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub older_than: Option<Duration>,
    /// Start after this event sequence (a printed one) instead of now: nothing after it is
    /// missed.
    #[arg(long)]
    pub after: Option<i64>,
    /// Stop after this many events.
    #[arg(long)]
    pub count: Option<usize>,
    /// Another tenant's (a key with the admin role).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Every tenant's, with a TENANT column (a key with the admin role).
    #[arg(long, conflicts_with = "tenant")]
    pub all_tenants: bool,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create an API key, shown this once; or register a client certificate.
    Create(NewCredential),
    /// List credentials (never a secret).
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke a credential by its key id.
    Revoke { key_id: String },
}

#[derive(Debug, Subcommand)]
pub enum ReceiptCommand {
    /// The ledger's signed receipt of a CONFIRMED or ABSENT operation, printed (or written to
    /// --out) as text to keep.
    Get {
        operation: String,
        /// Another tenant's (a key with the admin role).
        #[arg(long)]
        tenant: Option<String>,
        /// Write it to this file instead of printing it.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Checks a receipt's signature and prints what it says. With --public-key it needs no
    /// ledger: the keys are the ones `onced signing-keys` printed. Without, it asks the ledger
    /// for its keys (and so takes its word for them).
    Verify {
        /// The receipt's file ("-": standard input).
        file: std::path::PathBuf,
        /// A public key to verify with (base64url), repeatable: the active one and retired ones.
        /// (A key may begin with `-`: it is taken as the key.)
        #[arg(long = "public-key", allow_hyphen_values = true)]
        public_keys: Vec<String>,
        /// Also check that this file holds the result the receipt was signed for, byte for byte.
        #[arg(long)]
        result: Option<std::path::PathBuf>,
        /// Also check that it is a receipt of this operation (a genuine receipt of another
        /// proves nothing about this one).
        #[arg(long)]
        operation: Option<String>,
        /// Also check that this ledger signed it (its id, as `GetSigningKeys` or another
        /// receipt names it).
        #[arg(long)]
        ledger: Option<String>,
    },
}
