//! `onced tenants …` and `onced keys …`: administration straight on the database, for the
//! first tenants and keys and for when no admin key is at hand. Changes reach running replicas
//! within their credential TTL.

use clap::Subcommand;
use once_core::access::{Credential, Tenant};
use once_core::cli::NewCredential;
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
    let admin = Admin::new(backend);
    match command {
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
