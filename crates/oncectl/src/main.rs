//! `oncectl`, the on-call CLI of once-ledger.
//!
//! Each command is one function below: it asks the ledger through `once-client`, then prints
//! what it got as a table ([`render`]) or as JSON ([`json`]). What went wrong becomes an exit
//! code in one place, [`Failure::code`].

mod bulk;
mod cli;
mod json;
mod profile;
mod render;

use std::collections::HashMap;
use std::io::{IsTerminal, Write as _};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use once_client::{
    ClientError, LedgerClient, ListFilter, OperationView, PublicKey, Receipt, Resolution, Truth,
    WatchRequest, Watched, WatchedEvent,
};
use once_core::access::Credential;
use once_core::{EventKind, State};

use crate::bulk::Action;
use crate::cli::{
    Cli, Command, Global, KeysCommand, ListArgs, ReceiptCommand, ResolveArgs, WatchArgs,
};
use crate::profile::Settings;
use crate::render::Look;

/// Why a command did not do what it was asked, and so its exit code.
#[derive(Debug, thiserror::Error)]
enum Failure {
    /// 1: the ledger could not be reached, or something else failed.
    #[error("{0:#}")]
    Error(anyhow::Error),
    /// 2: the command was not given what it needs.
    #[error("{0}")]
    Usage(String),
    /// 3: no such operation (in the key's tenant).
    #[error("{0}")]
    NotFound(String),
    /// 4: the ledger refused, or the operator declined.
    #[error("{0}")]
    Refused(String),
    /// 5: the history does not match what its chain recorded, or a receipt does not verify.
    #[error("{0}")]
    Rewritten(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Error(_) => 1,
            Failure::Usage(_) => 2,
            Failure::NotFound(_) => 3,
            Failure::Refused(_) => 4,
            Failure::Rewritten(_) => 5,
        }
    }
}

impl From<ClientError> for Failure {
    fn from(error: ClientError) -> Self {
        match error {
            ClientError::NotFound => Failure::NotFound("no such operation".into()),
            ClientError::Invalid(message) => Failure::Usage(message),
            ClientError::Refused { reason, message } => {
                Failure::Refused(format!("{message} ({reason})"))
            }
            unreachable @ ClientError::Unreachable(_) => Failure::Error(unreachable.into()),
        }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Failure::Error(error)
    }
}

fn main() -> ExitCode {
    let cli: Cli = once_telemetry::parse_args();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("oncectl: {failure}");
            ExitCode::from(failure.code())
        }
    }
}

/// Where and how to print.
struct Out {
    json: bool,
    look: Look,
}

impl Out {
    fn new(global: &Global) -> Self {
        let terminal = std::io::stdout().is_terminal();
        let color = terminal && !global.no_color && std::env::var_os("NO_COLOR").is_none();
        let width = if terminal {
            comfy_table::Table::new().width().unwrap_or(80)
        } else {
            80
        };
        Out {
            json: global.json(),
            look: Look {
                width,
                color,
                now: SystemTime::now(),
            },
        }
    }

    fn print(&self, text: &str) {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    }

    fn json(&self, value: &serde_json::Value) {
        self.print(&format!("{value:#}\n"));
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Completions { shell } = cli.command {
        clap_complete::generate(
            shell,
            &mut once_telemetry::command::<Cli>(),
            "oncectl",
            &mut std::io::stdout(),
        );
        return Ok(());
    }
    let out = Out::new(&cli.global);
    // A receipt verified with keys given needs no ledger, and reaches none.
    if let Command::Receipt(ReceiptCommand::Verify {
        file,
        public_keys,
        result,
        operation,
        ledger,
    }) = &cli.command
    {
        if !public_keys.is_empty() {
            let keys = public_keys
                .iter()
                .map(|key| PublicKey::parse(key))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|refused| Failure::Usage(format!("--public-key: {refused}")))?;
            let expected = Expected {
                result: result.as_deref(),
                operation: operation.as_deref(),
                ledger: ledger.as_deref(),
            };
            return verify_receipt(&out, file, expected, &keys, "the keys given");
        }
    }
    let settings = Settings::resolve(&cli.global).map_err(|e| Failure::Usage(e.to_string()))?;
    let reached = Reached::of(&settings.client);
    let ledger = LedgerClient::connect(settings.client).map_err(Failure::from)?;
    match cli.command {
        Command::Status => status(&ledger, &out, &reached).await,
        Command::List(args) => {
            let ledger = reading(&ledger, &args.tenant, args.all_tenants);
            list(&ledger, &out, args).await
        }
        Command::Show { operation, tenant } => {
            show(&reading(&ledger, &tenant, false), &out, &operation).await
        }
        Command::Resolve(args) => match &args.bulk.filter {
            Some(filter) => {
                let action = Action::Absent {
                    reason: reason(&args.reason)?,
                    operator: settings.operator.clone(),
                };
                bulk::run(&ledger, &out, filter, args.bulk.dry_run, args.yes, action).await
            }
            None => resolve(&ledger, &out, &settings.operator, args).await,
        },
        Command::Reconcile(args) => match (&args.bulk.filter, &args.operation) {
            (Some(filter), _) => {
                let action = Action::Reconcile {
                    operator: settings.operator.clone(),
                    wait: args.wait,
                };
                bulk::run(&ledger, &out, filter, args.bulk.dry_run, args.yes, action).await
            }
            (None, Some(operation)) => {
                reconcile(&ledger, &out, operation, &settings.operator, args.wait).await
            }
            (None, None) => unreachable!("clap requires an operation or a filter"),
        },
        Command::Watch(args) => {
            let ledger = reading(&ledger, &args.tenant, args.all_tenants);
            watch(&ledger, &out, args).await
        }
        Command::Forensics {
            tool,
            since,
            tenant,
        } => forensics(&reading(&ledger, &tenant, false), &out, tool, since).await,
        Command::Stats {
            window,
            tenant,
            all_tenants,
        } => {
            let ledger = reading(&ledger, &tenant, all_tenants);
            stats(&ledger, &out, window, all_tenants).await
        }
        Command::Keys(command) => keys(&ledger, &out, command).await,
        Command::Verify { from, tenant } => {
            verify(&reading(&ledger, &tenant, false), &out, from).await
        }
        Command::Receipt(ReceiptCommand::Get {
            operation,
            tenant,
            out: file,
        }) => {
            let receipt = reading(&ledger, &tenant, false).receipt(&operation).await?;
            match file {
                Some(file) => std::fs::write(&file, format!("{receipt}\n")).map_err(|e| {
                    Failure::Error(anyhow::anyhow!("writing {}: {e}", file.display()))
                }),
                None => {
                    println!("{receipt}");
                    Ok(())
                }
            }
        }
        Command::Receipt(ReceiptCommand::Verify {
            file,
            result,
            operation,
            ledger: expected_ledger,
            ..
        }) => {
            let found = ledger.signing_keys().await?;
            let from = format!("the keys ledger {} serves", found.ledger);
            let expected = Expected {
                result: result.as_deref(),
                operation: operation.as_deref(),
                // Keys the ledger serves verify only its own receipts.
                ledger: Some(expected_ledger.as_deref().unwrap_or(&found.ledger)),
            };
            verify_receipt(&out, &file, expected, &found.keys, &from)
        }
        Command::Completions { .. } => unreachable!("handled above"),
    }
}

/// How oncectl reaches the ledger, as `oncectl status` tells it.
#[derive(Debug)]
pub struct Reached {
    pub address: String,
    pub tls: bool,
    /// A private certificate authority is trusted besides the public roots (`--ca`).
    pub private_ca: bool,
    /// A client certificate is presented (`--cert`).
    pub client_certificate: bool,
}

impl Reached {
    fn of(client: &once_client::ClientConfig) -> Self {
        let address = client.endpoints.join(", ");
        Reached {
            tls: address.starts_with("https://"),
            address,
            private_ca: client.tls_ca_pem.is_some(),
            client_certificate: client.tls_identity_pem.is_some(),
        }
    }
}

async fn status(ledger: &LedgerClient, out: &Out, reached: &Reached) -> Result<(), Failure> {
    let info = ledger.server_info().await?;
    if out.json {
        out.json(&json::status(reached, &info));
    } else {
        out.print(&render::status(&out.look, reached, &info));
    }
    Ok(())
}

/// The client, its reads naming `tenant` when one is given, or covering every tenant.
fn reading(ledger: &LedgerClient, tenant: &Option<String>, all_tenants: bool) -> LedgerClient {
    match tenant {
        _ if all_tenants => ledger.reading_all_tenants(),
        Some(tenant) => ledger.reading(tenant),
        None => ledger.clone(),
    }
}

async fn list(ledger: &LedgerClient, out: &Out, args: ListArgs) -> Result<(), Failure> {
    let states = if args.all {
        Vec::new()
    } else if args.states.is_empty() {
        vec![State::Unknown]
    } else {
        args.states.into_iter().map(State::from).collect()
    };
    let filter = ListFilter {
        states,
        tool: args.tool,
        provider: args.provider,
        older_than: args.older_than,
    };
    // Every page, until the limit: paging is the tool's business, not the operator's.
    let mut operations = Vec::new();
    let mut page = None;
    let more = loop {
        let wanted = args.limit.saturating_sub(operations.len());
        if wanted == 0 {
            break page.is_some();
        }
        let size = u32::try_from(wanted.min(1000)).unwrap_or(1000);
        let got = ledger.list_page(&filter, size, page.as_deref()).await?;
        operations.extend(got.operations);
        page = got.next;
        if page.is_none() {
            break false;
        }
    };
    if out.json {
        let listed: Vec<_> = operations.iter().map(json::operation).collect();
        out.json(&serde_json::json!({ "operations": listed, "more": more }));
    } else {
        let tenants = args.all_tenants;
        out.print(&render::operations(&out.look, &operations, more, tenants));
    }
    Ok(())
}

async fn show(ledger: &LedgerClient, out: &Out, operation: &str) -> Result<(), Failure> {
    let op = find(ledger, operation).await?;
    if out.json {
        out.json(&json::operation(&op));
    } else {
        out.print(&render::operation(&out.look, &op));
    }
    Ok(())
}

/// How many operations a prefix is looked for among, at most.
const PREFIX_SCAN: usize = 20_000;

/// The operation `given` names: its whole id, or (as git takes a commit's) the start of exactly
/// one operation's id in the tenant, `refund:885d` for `refund:885d2c…`.
async fn find(ledger: &LedgerClient, given: &str) -> Result<OperationView, Failure> {
    match ledger.get(given).await {
        Err(ClientError::NotFound) => {}
        found => return found.map_err(|e| not_found(e, given)),
    }
    let every = ListFilter {
        states: Vec::new(),
        tool: None,
        provider: None,
        older_than: None,
    };
    let mut matching = Vec::new();
    let (mut page, mut scanned) = (None, 0);
    loop {
        let got = ledger.list_page(&every, 1000, page.as_deref()).await?;
        scanned += got.operations.len();
        matching.extend(
            got.operations
                .into_iter()
                .map(|op| op.operation_id)
                .filter(|id| id.starts_with(given)),
        );
        page = got.next;
        if page.is_none() || scanned >= PREFIX_SCAN || matching.len() > 10 {
            break;
        }
    }
    match matching.as_slice() {
        [] => Err(not_found(ClientError::NotFound, given)),
        [one] => ledger.get(one).await.map_err(|e| not_found(e, one)),
        several => Err(Failure::Usage(format!(
            "{given:?} is the start of several operations' ids ({}{}): give more of it",
            several
                .iter()
                .take(10)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            if several.len() > 10 { ", …" } else { "" }
        ))),
    }
}

/// A missing operation, named.
fn not_found(error: ClientError, operation: &str) -> Failure {
    match error {
        ClientError::NotFound => Failure::NotFound(format!(
            "no operation {operation:?} in this key's tenant (retention may have deleted a settled one)"
        )),
        other => other.into(),
    }
}

async fn resolve(
    ledger: &LedgerClient,
    out: &Out,
    operator: &str,
    args: ResolveArgs,
) -> Result<(), Failure> {
    reason(&args.reason)?;
    let given = args.operation.as_deref().unwrap_or_default();
    let op = find(ledger, given).await?;
    let number = args.attempt.unwrap_or(op.attempt);
    let examined = op
        .attempts
        .iter()
        .find(|a| a.number == number)
        .cloned()
        .ok_or_else(|| {
            Failure::Usage(format!(
                "{} has no attempt {number} in its current life (its latest is {})",
                op.operation_id, op.attempt
            ))
        })?;
    let truth = if args.confirmed {
        let result = match args.result.as_deref() {
            // A file as an editor saves it: without the line end it closes with.
            Some(path) if path.starts_with('@') => {
                let mut bytes = std::fs::read(&path[1..])
                    .map_err(|e| Failure::Usage(format!("--result {path}: {e}")))?;
                if bytes.ends_with(b"\r\n") {
                    bytes.truncate(bytes.len() - 2);
                } else if bytes.ends_with(b"\n") {
                    bytes.truncate(bytes.len() - 1);
                }
                bytes
            }
            Some(text) => text.as_bytes().to_vec(),
            None => Vec::new(),
        };
        Truth::Confirmed {
            result,
            provider_ref: args.provider_ref,
        }
    } else {
        Truth::Absent
    };
    let resolution_id = args
        .resolution_id
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let plan = render::resolution_plan(
        &out.look,
        &op,
        &examined,
        &truth,
        &args.reason,
        &resolution_id,
    );
    eprint!("{plan}");
    if !args.yes {
        confirm("Resolve?")?;
    }
    let resolution = Resolution {
        operation_id: op.operation_id.clone(),
        truth,
        reason: args.reason,
        operator: operator.to_owned(),
        resolution_id: resolution_id.clone(),
        fencing_token: examined.fencing_token,
        attempt: Some(examined.number),
    };
    let state = ledger.resolve(&resolution).await?;
    if out.json {
        out.json(&serde_json::json!({
            "operation_id": op.operation_id,
            "state": state.as_str(),
            "resolution_id": resolution_id,
            "attempt": examined.number,
            "fencing_token": examined.fencing_token,
        }));
    } else {
        out.print(&format!("{} is now {state}.\n", op.operation_id));
    }
    Ok(())
}

/// A resolution's reason, which is mandatory.
fn reason(given: &str) -> Result<String, Failure> {
    match given.trim() {
        "" => Err(Failure::Usage(
            "--reason is mandatory: say why you believe this outcome".into(),
        )),
        reason => Ok(reason.to_owned()),
    }
}

/// Asks on the terminal whether to go on.
fn confirm(question: &str) -> Result<(), Failure> {
    if !std::io::stdin().is_terminal() {
        return Err(Failure::Usage(
            "not asking without a terminal: pass --yes to go on".into(),
        ));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .read_line(&mut answer)
        .map_err(|e| Failure::Error(e.into()))?;
    match answer.trim() {
        "y" | "Y" | "yes" | "YES" | "Yes" => Ok(()),
        _ => Err(Failure::Refused("declined: nothing was sent".into())),
    }
}

async fn reconcile(
    ledger: &LedgerClient,
    out: &Out,
    operation: &str,
    operator: &str,
    wait: Duration,
) -> Result<(), Failure> {
    let op = find(ledger, operation).await?;
    let operation = op.operation_id.as_str();
    // Settled already: nothing to look up (exit 4, as the ledger would refuse it).
    if op.state != State::Unknown {
        return Err(Failure::Refused(format!(
            "{operation} is {} already: only an UNKNOWN operation is reconciled; nothing was looked up",
            op.state
        )));
    }
    let reconciled = ledger
        .reconcile(operation, operator, wait)
        .await
        .map_err(|e| not_found(e, operation))?;
    if out.json {
        out.json(&json::reconciled(operation, &reconciled));
    } else {
        out.print(&render::reconciled(&out.look, operation, &reconciled));
    }
    Ok(())
}

async fn stats(
    ledger: &LedgerClient,
    out: &Out,
    window: Duration,
    all_tenants: bool,
) -> Result<(), Failure> {
    let found = ledger.stats(window).await?;
    let window = humantime::format_duration(window).to_string();
    if out.json {
        out.json(&json::stats(&found, &window));
    } else {
        out.print(&render::stats(&out.look, &found, &window, all_tenants));
    }
    Ok(())
}

async fn forensics(
    ledger: &LedgerClient,
    out: &Out,
    tool: Option<String>,
    since: Duration,
) -> Result<(), Failure> {
    let found = ledger.forensics(tool.as_deref(), since).await?;
    let window = humantime::format_duration(since).to_string();
    if out.json {
        out.json(&json::forensics(&found, &window));
    } else {
        out.print(&render::forensics(&out.look, &found, &window));
    }
    Ok(())
}

/// What a receipt must also be, besides well signed.
struct Expected<'a> {
    /// The file holding the result it was signed for.
    result: Option<&'a std::path::Path>,
    operation: Option<&'a str>,
    ledger: Option<&'a str>,
}

/// Verifies the receipt in `file` with `keys` (`whose`: where they came from, as said).
fn verify_receipt(
    out: &Out,
    file: &std::path::Path,
    expected: Expected<'_>,
    keys: &[PublicKey],
    whose: &str,
) -> Result<(), Failure> {
    let read = |path: &std::path::Path| -> Result<Vec<u8>, Failure> {
        let read = if path.as_os_str() == "-" {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).map(|_| bytes)
        } else {
            std::fs::read(path)
        };
        read.map_err(|e| Failure::Usage(format!("reading {}: {e}", path.display())))
    };
    let text = String::from_utf8(read(file)?)
        .map_err(|_| Failure::Rewritten("that is not a receipt: it is not text".into()))?;
    let receipt = Receipt::verify(&text, keys)
        .map_err(|refused| Failure::Rewritten(format!("the receipt does not verify: {refused}")))?;
    if let Some(operation) = expected.operation.filter(|op| *op != receipt.operation_id) {
        return Err(Failure::Rewritten(format!(
            "the receipt is of operation {}, not {operation}",
            receipt.operation_id
        )));
    }
    if let Some(ledger) = expected.ledger.filter(|id| *id != receipt.ledger) {
        return Err(Failure::Rewritten(format!(
            "the receipt was signed by ledger {}, not {ledger}",
            receipt.ledger
        )));
    }
    let result_matches = match expected.result {
        Some(path) => Some(receipt.covers_result(&read(path)?)),
        None => None,
    };
    if out.json {
        out.json(&json::receipt(&receipt, result_matches));
    } else {
        out.print(&render::receipt(&receipt, whose, result_matches));
    }
    match result_matches {
        Some(false) => Err(Failure::Rewritten(
            "the result given is not the one the receipt was signed for".into(),
        )),
        _ => Ok(()),
    }
}

async fn verify(ledger: &LedgerClient, out: &Out, from: i64) -> Result<(), Failure> {
    let found = ledger.verify_history(from).await?;
    if out.json {
        out.json(&json::history(&found));
    } else {
        out.print(&render::history(&found));
    }
    match found.problem {
        Some(problem) => Err(Failure::Rewritten(format!(
            "the history does not match its chain: {}",
            problem.message
        ))),
        None => Ok(()),
    }
}

async fn watch(ledger: &LedgerClient, out: &Out, args: WatchArgs) -> Result<(), Failure> {
    for kind in &args.kinds {
        if EventKind::parse(kind).is_none() {
            let known: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(Failure::Usage(format!(
                "--kind {kind}: not an event kind; one of {}",
                known.join(", ")
            )));
        }
    }
    let (states, kinds) = if args.all {
        (Vec::new(), Vec::new())
    } else if args.states.is_empty() && args.kinds.is_empty() {
        // What on-call staff watch for: new UNKNOWN operations, lookups and escalations, their
        // resolutions, and the anomalies.
        let anomalies = EventKind::ALL
            .iter()
            .filter(|k| k.is_anomaly())
            .map(|k| k.as_str().to_owned())
            .collect();
        (vec![State::Unknown], anomalies)
    } else {
        (
            args.states.into_iter().map(State::from).collect(),
            args.kinds,
        )
    };
    let mut watch = ledger.watch(WatchRequest {
        after: args.after,
        states,
        kinds,
        tool: args.tool,
    });
    let mut operations = Operations::new(args.provider, args.older_than);
    let mut received = 0;
    let mut caught_up = false;
    // Said once when the stream breaks, and once when it is back, however many tries between:
    // where it broke, while it is broken.
    let mut broken: Option<String> = None;
    loop {
        if args.count.is_some_and(|count| received >= count) {
            return Ok(());
        }
        let item = tokio::select! {
            item = watch.next() => item?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        if !matches!(item, Watched::Reconnecting { .. }) {
            if let Some(after) = broken.take() {
                eprintln!("(reconnected; watching after {after})");
            }
        }
        match item {
            Watched::Event(event) => {
                if !operations.wanted(ledger, &event).await? {
                    continue;
                }
                received += 1;
                if out.json {
                    out.print(&format!("{}\n", json::watched(&event)));
                } else {
                    out.print(&render::watched(&out.look, &event, args.all_tenants));
                }
            }
            Watched::CaughtUpTo(sequence) => {
                if !caught_up {
                    eprintln!("(caught up to #{sequence}; watching)");
                    caught_up = true;
                }
            }
            Watched::Reconnecting { after, error } => {
                if broken.is_none() {
                    let after = after.map_or_else(|| "now".to_owned(), |a| format!("#{a}"));
                    eprintln!("(stream broken: {error}; reconnecting after {after}, for as long as it takes)");
                    broken = Some(after);
                }
            }
        }
    }
}

/// The filters of a watch the ledger does not apply: by the operation's provider and age,
/// each operation looked up once.
struct Operations {
    provider: Option<String>,
    older_than: Option<Duration>,
    /// Each operation seen, by tenant and id; `None` once deleted.
    seen: HashMap<(String, String), Option<Seen>>,
}

/// An operation's provider, and when it was created.
type Seen = (Option<String>, Option<SystemTime>);

impl Operations {
    /// How many operations are remembered before the memory starts again.
    const REMEMBERED: usize = 10_000;

    fn new(provider: Option<String>, older_than: Option<Duration>) -> Self {
        Self {
            provider,
            older_than,
            seen: HashMap::new(),
        }
    }

    async fn wanted(
        &mut self,
        ledger: &LedgerClient,
        event: &WatchedEvent,
    ) -> Result<bool, ClientError> {
        if self.provider.is_none() && self.older_than.is_none() {
            return Ok(true);
        }
        let key = (event.tenant.clone(), event.operation_id.clone());
        if !self.seen.contains_key(&key) {
            if self.seen.len() >= Self::REMEMBERED {
                self.seen.clear();
            }
            // Each event names its operation's tenant: in a watch of every tenant, the
            // operation is read there.
            let found = match ledger.reading(&event.tenant).get(&event.operation_id).await {
                Ok(op) => Some((op.provider, op.created_at)),
                // Deleted by retention since: nothing to match it by.
                Err(ClientError::NotFound) => None,
                Err(error) => return Err(error),
            };
            self.seen.insert(key.clone(), found);
        }
        let Some((provider, created_at)) = &self.seen[&key] else {
            return Ok(false);
        };
        let provider_matches = self
            .provider
            .as_ref()
            .is_none_or(|wanted| provider.as_ref() == Some(wanted));
        let old_enough = match (self.older_than, created_at, event.event.at) {
            (None, _, _) => true,
            (Some(age), Some(created), Some(at)) => {
                at.duration_since(*created).unwrap_or_default() >= age
            }
            (Some(_), _, _) => false,
        };
        Ok(provider_matches && old_enough)
    }
}

async fn keys(ledger: &LedgerClient, out: &Out, command: KeysCommand) -> Result<(), Failure> {
    match command {
        KeysCommand::Create(new) => {
            let pem = new.certificate_pem().map_err(Failure::Usage)?;
            let (key, secret) = ledger
                .create_key(&new.tenant, &new.name, &new.roles(), pem.as_deref())
                .await?;
            if out.json {
                let mut shown = key.to_json();
                if let Some(secret) = &secret {
                    shown["secret"] = secret.clone().into();
                }
                out.json(&shown);
            } else {
                out.print(&render::keys(&out.look, std::slice::from_ref(&key)));
                if let Some(secret) = secret {
                    eprintln!("\nThe key, shown this once (the ledger keeps only its hash):");
                    out.print(&format!("{secret}\n"));
                }
            }
        }
        KeysCommand::List { tenant } => {
            let keys = ledger.list_keys(tenant.as_deref()).await?;
            if out.json {
                out.json(&serde_json::Value::Array(
                    keys.iter().map(Credential::to_json).collect(),
                ));
            } else {
                out.print(&render::keys(&out.look, &keys));
            }
        }
        KeysCommand::Revoke { key_id } => {
            let key = ledger
                .revoke_key(&key_id)
                .await
                .map_err(|error| match error {
                    ClientError::NotFound => Failure::NotFound(format!("no key with id {key_id}")),
                    other => other.into(),
                })?;
            if out.json {
                out.json(&key.to_json());
            } else {
                out.print(&render::keys(&out.look, std::slice::from_ref(&key)));
            }
        }
    }
    Ok(())
}
