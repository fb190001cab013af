//! `onced tenants …`, `onced keys …` and `onced continuity …`: administration straight on the
//! database, for the first tenants and keys, for when no admin key is at hand, and for accepting
//! what a restore of the database lost. Keys and tenants reach running replicas within their
//! credential TTL; an acceptance within a second.

use clap::Subcommand;
use once_core::access::{Credential, Tenant};
use once_core::cli::NewCredential;
use once_core::continuity::{Accepted, Held, Standing};
use once_core::Actor;
use once_store::Backend;

use crate::admin::Admin;

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Tenants: create one or set its limits, list them.
    #[command(subcommand)]
    Tenants(TenantsCommand),
    /// API keys and client certificates: create, list, revoke.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Whether the ledger was found behind what its clients saw (restored from an older
    /// backup), and accepting that loss so executions go on.
    #[command(subcommand)]
    Continuity(ContinuityCommand),
    /// The public keys that verify the ledger's receipts (from its key file, never the
    /// database); `rotate` replaces the signing key, keeping the old public key.
    SigningKeys {
        #[command(subcommand)]
        action: Option<SigningKeysCommand>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum SigningKeysCommand {
    /// Replaces the active signing key with a new one (creating the file when there is none);
    /// the old key's public half stays so its receipts still verify. Copy the file to every
    /// replica and restart them, one at a time.
    Rotate,
}

#[derive(Debug, Clone, Subcommand)]
pub enum ContinuityCommand {
    /// Each tenant's epoch, whether its executions are held and why, and the latest
    /// acceptances.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Accepts that the ledger lost what its clients saw: the held tenants (or the one named,
    /// held or not) open their next epoch and execute again. Recorded, with the reason. The
    /// operations clients reported are UNKNOWN for the reconcilers; run this once the database
    /// is the one to keep.
    Accept {
        /// Why (recorded): what was restored, from when.
        #[arg(long)]
        reason: String,
        /// Only this tenant, held or not (default: every held tenant).
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum TenantsCommand {
    /// Creates a tenant, or sets the limits of an existing one (a limit left out: no cap).
    Put {
        /// 1 to 63 characters of a-z, 0-9, - and _.
        name: String,
        /// The most IN_FLIGHT operations the tenant may hold at once.
        #[arg(long)]
        max_in_flight: Option<i64>,
        /// The most requests per second each of its keys may send.
        #[arg(long)]
        requests_per_second: Option<i64>,
    },
    /// Lists the tenants.
    List {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum KeysCommand {
    /// Creates an API key and prints it, this once; or registers a client certificate.
    Create {
        #[command(flatten)]
        new: NewCredential,
        #[arg(long)]
        json: bool,
    },
    /// Lists credentials (never a secret), of one tenant or of all.
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Revokes a credential by its key id.
    Revoke {
        key_id: String,
        #[arg(long)]
        json: bool,
    },
}

/// Runs one administrative command against `backend`.
pub async fn run<B: Backend>(backend: B, command: Command) -> anyhow::Result<()> {
    if let Command::Continuity(command) = command {
        return continuity(&backend, command).await;
    }
    let admin = Admin::new(backend);
    match command {
        Command::Continuity(_) | Command::SigningKeys { .. } => unreachable!("handled above"),
        Command::Tenants(TenantsCommand::Put {
            name,
            max_in_flight,
            requests_per_second,
        }) => {
            let tenant = admin
                .put_tenant(&name, max_in_flight, requests_per_second)
                .await?;
            print_tenants(&[tenant], false);
        }
        Command::Tenants(TenantsCommand::List { json }) => {
            print_tenants(&admin.tenants().await?, json);
        }
        Command::Keys(KeysCommand::Create { new, json }) => {
            let pem = new.certificate_pem().map_err(anyhow::Error::msg)?;
            let (credential, key) = admin
                .create_key(
                    &new.tenant,
                    &new.name,
                    new.roles(),
                    pem.as_deref(),
                    crate::admin::Authority::Operator,
                )
                .await?;
            if json {
                let mut shown = credential.to_json();
                if let Some(key) = &key {
                    shown["secret"] = key.expose().into();
                }
                println!("{shown}");
            } else {
                print_keys(std::slice::from_ref(&credential));
                if let Some(key) = key {
                    eprintln!("\nThe key, shown this once (the ledger keeps only its hash):");
                    println!("{}", key.expose());
                }
            }
        }
        Command::Keys(KeysCommand::List { tenant, json }) => {
            let keys = admin.keys(tenant.as_deref()).await?;
            if json {
                let shown: Vec<_> = keys.iter().map(Credential::to_json).collect();
                println!("{}", serde_json::Value::Array(shown));
            } else {
                print_keys(&keys);
            }
        }
        Command::Keys(KeysCommand::Revoke { key_id, json }) => {
            let credential = admin.revoke(&key_id).await?;
            if json {
                println!("{}", credential.to_json());
            } else {
                print_keys(std::slice::from_ref(&credential));
            }
        }
    }
    Ok(())
}

/// `onced signing-keys [rotate]`: on the key file alone, without the database.
pub fn signing_keys(
    config: &crate::Config,
    action: Option<SigningKeysCommand>,
    json: bool,
) -> anyhow::Result<()> {
    use crate::signing::KeyRing;
    let path = config.signing_key_path().ok_or_else(|| {
        anyhow::anyhow!(
            "no signing key file: name one with --signing-key-file (ONCE_SIGNING_KEY_FILE)"
        )
    })?;
    let ring = match action {
        None => KeyRing::load(&path)?,
        Some(SigningKeysCommand::Rotate) if !path.exists() => {
            let ring = KeyRing::load_or_create(&path)?;
            eprintln!("Created {} with a new signing key.", path.display());
            ring
        }
        Some(SigningKeysCommand::Rotate) => {
            let mut ring = KeyRing::load(&path)?;
            let old = ring.active().id().to_owned();
            ring.rotate()?;
            eprintln!(
                "Rotated {}: key {} signs now; {old} is retired and still verifies its receipts. \
                 Copy the file to every replica and restart them one at a time.",
                path.display(),
                ring.active().id()
            );
            ring
        }
    };
    let listed = ring.listed();
    if json {
        let keys: Vec<_> = listed
            .iter()
            .map(|listed| {
                serde_json::json!({
                    "key_id": listed.key.id(),
                    "algorithm": "ed25519",
                    "public_key": listed.key.to_string(),
                    "active": listed.active,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(keys));
        return Ok(());
    }
    println!(
        "{:<18} {:<8} PUBLIC KEY (ed25519, base64url)",
        "KEY", "STATE"
    );
    for listed in &listed {
        let state = if listed.active { "active" } else { "retired" };
        println!("{:<18} {state:<8} {}", listed.key.id(), listed.key);
    }
    Ok(())
}

/// The operator an acceptance made here is recorded as: the account that ran it.
fn operator() -> Actor {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    Actor::Operator(format!("onced-cli@{user}"))
}

async fn continuity<B: Backend>(backend: &B, command: ContinuityCommand) -> anyhow::Result<()> {
    match command {
        ContinuityCommand::Status { json } => {
            let standings = backend.standings().await?;
            let accepted = backend.acceptances(None, 20).await?;
            if json {
                let shown = serde_json::json!({
                    "tenants": standings.iter().map(standing_json).collect::<Vec<_>>(),
                    "acceptances": accepted.iter().map(accepted_json).collect::<Vec<_>>(),
                });
                println!("{shown}");
                return Ok(());
            }
            let held: Vec<&Standing> = standings.iter().filter(|s| s.held.is_some()).collect();
            if held.is_empty() {
                println!("No tenant is held: no client has seen more than this ledger holds.");
            } else {
                println!(
                    "{} tenant(s) held: the ledger is behind what their clients saw (restored to an earlier state).",
                    held.len()
                );
            }
            if !standings.is_empty() {
                print_standings(&standings);
            }
            if !accepted.is_empty() {
                println!();
                print_acceptances(&accepted);
            }
        }
        ContinuityCommand::Accept {
            reason,
            tenant,
            json,
        } => {
            if reason.trim().is_empty() {
                anyhow::bail!("--reason must say why the loss is accepted");
            }
            let accepted = backend
                .accept(tenant.as_deref(), &operator(), reason.trim())
                .await?;
            if json {
                let shown: Vec<_> = accepted.iter().map(accepted_json).collect();
                println!("{}", serde_json::Value::Array(shown));
            } else if accepted.is_empty() {
                println!("No tenant is held: nothing to accept.");
            } else {
                print_acceptances(&accepted);
                eprintln!(
                    "\nExecutions go on within a second on every replica. The operations clients reported \
                     are UNKNOWN: their reconcilers settle them (oncectl list)."
                );
            }
        }
    }
    Ok(())
}

fn held_json(held: &Held) -> serde_json::Value {
    let b = &held.behind;
    serde_json::json!({
        "since_ms": held.since,
        "why": b.why.as_str(),
        "client_epoch": b.client_epoch,
        "client_token": b.client_token.get(),
        "operation_id": b.operation_id.as_str(),
        "ledger_epoch": b.ledger_epoch,
        "ledger_token": b.ledger_token.get(),
    })
}

fn standing_json(s: &Standing) -> serde_json::Value {
    serde_json::json!({
        "tenant": s.tenant,
        "epoch": s.epoch,
        "held": s.held.as_ref().map(held_json),
    })
}

fn accepted_json(a: &Accepted) -> serde_json::Value {
    serde_json::json!({
        "tenant": a.tenant,
        "epoch": a.epoch,
        "at_ms": a.at,
        "actor": a.actor.to_string(),
        "reason": a.reason,
        "held": a.held.as_ref().map(held_json),
    })
}

fn print_standings(standings: &[Standing]) {
    println!(
        "{:<24} {:>6}  {:<14} {:>14} {:>14}  OPERATION",
        "TENANT", "EPOCH", "HELD", "CLIENT TOKEN", "LEDGER TOKEN"
    );
    for s in standings {
        let (why, client, ledger, op) = match &s.held {
            Some(held) => (
                held.behind.why.as_str().to_owned(),
                held.behind.client_token.to_string(),
                held.behind.ledger_token.to_string(),
                held.behind.operation_id.to_string(),
            ),
            None => ("no".into(), "-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<24} {:>6}  {:<14} {:>14} {:>14}  {op}",
            s.tenant, s.epoch, why, client, ledger
        );
    }
}

fn print_acceptances(accepted: &[Accepted]) {
    println!("{:<24} {:>6}  {:<28} REASON", "ACCEPTED FOR", "EPOCH", "BY");
    for a in accepted {
        println!(
            "{:<24} {:>6}  {:<28} {}",
            a.tenant,
            a.epoch,
            a.actor.to_string(),
            a.reason
        );
    }
}

fn print_tenants(tenants: &[Tenant], json: bool) {
    if json {
        let shown: Vec<_> = tenants
            .iter()
            .map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "created_at_ms": t.created_at,
                    "max_in_flight": t.max_in_flight,
                    "requests_per_second": t.requests_per_second,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(shown));
        return;
    }
    let cap = |v: Option<i64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    println!(
        "{:<24} {:>14} {:>20}",
        "TENANT", "MAX IN FLIGHT", "REQUESTS/S PER KEY"
    );
    for t in tenants {
        println!(
            "{:<24} {:>14} {:>20}",
            t.name,
            cap(t.max_in_flight),
            cap(t.requests_per_second)
        );
    }
}

fn print_keys(keys: &[Credential]) {
    println!(
        "{:<22} {:<16} {:<24} {:<28} {:<12} STATUS",
        "KEY ID", "TENANT", "NAME", "ROLES", "KIND"
    );
    for k in keys {
        let status = if k.revoked_at.is_some() {
            "revoked"
        } else {
            "active"
        };
        println!(
            "{:<22} {:<16} {:<24} {:<28} {:<12} {}",
            k.key_id,
            k.tenant,
            k.name,
            k.roles.to_string(),
            k.kind.as_str(),
            status
        );
    }
}
