//! Where the ledger is and who is asking: flags and environment variables (clap reads both),
//! then the profile file, then the defaults.
//!
//! The profile file is TOML:
//!
//! ```toml
//! default = "prod"
//!
//! [profiles.prod]
//! addr = "https://ledger.internal:50051"
//! key_file = "~/.config/once/prod.key"   # or key_env = "ONCE_PROD_KEY"
//! ca = "/etc/once/ca.pem"
//! cert = "~/.config/once/alice.pem"       # a client certificate, for a ledger that asks
//! cert_key = "~/.config/once/alice.key"   # for one (mTLS)
//! operator = "alice"
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use once_client::ClientConfig;

use crate::cli::Global;

/// The ledger `oncectl` talks to when nothing says otherwise: `make run`'s.
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    default: Option<String>,
    #[serde(default)]
    profiles: BTreeMap<String, Profile>,
}

#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Profile {
    addr: Option<String>,
    key_file: Option<PathBuf>,
    key_env: Option<String>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    cert_key: Option<PathBuf>,
    operator: Option<String>,
}

/// The settings in force.
#[derive(Debug)]
pub struct Settings {
    pub client: ClientConfig,
    /// The name resolutions are recorded under.
    pub operator: String,
}

/// A setting that cannot be used; the message says which and why.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SettingsError(String);

impl Settings {
    pub fn resolve(global: &Global) -> Result<Self, SettingsError> {
        let profile = profile(global)?;
        let addr = global
            .addr
            .clone()
            .or(profile.addr)
            .unwrap_or_else(|| DEFAULT_ADDR.to_owned());
        let key = match (&global.key, &profile.key_file, &profile.key_env) {
            (Some(key), _, _) => Some(key.clone()),
            (None, Some(file), _) => Some(read(&expand(file), "the key file")?.trim().to_owned()),
            (None, None, Some(variable)) => Some(std::env::var(variable).map_err(|_| {
                SettingsError(format!(
                    "the profile names the key variable {variable}, which is not set"
                ))
            })?),
            (None, None, None) => None,
        };
        let ca = global.ca.clone().or(profile.ca);
        let mut client = ClientConfig::new(addr);
        client.token = key.filter(|k| !k.is_empty());
        client.client_name = "oncectl".into();
        client.tries = 3;
        if let Some(ca) = ca {
            client.tls_ca_pem = Some(read(&expand(&ca), "the CA file")?.into_bytes());
        }
        let cert = global.cert.clone().or(profile.cert);
        let cert_key = global.cert_key.clone().or(profile.cert_key);
        client.tls_identity_pem = match (cert, cert_key) {
            (Some(cert), Some(key)) => Some((
                read(&expand(&cert), "the client certificate")?.into_bytes(),
                read(&expand(&key), "the client certificate's key")?.into_bytes(),
            )),
            (None, None) => None,
            _ => {
                return Err(SettingsError(
                    "a client certificate needs both --cert and --cert-key (or cert and \
                     cert_key in the profile)"
                        .into(),
                ))
            }
        };
        let operator = global
            .operator
            .clone()
            .or(profile.operator)
            .or_else(|| std::env::var("USER").ok())
            .filter(|o| !o.is_empty())
            .unwrap_or_else(|| "oncectl".to_owned());
        Ok(Settings { client, operator })
    }
}

/// The profile in force: the one named, or the file's default, or none.
fn profile(global: &Global) -> Result<Profile, SettingsError> {
    let (path, named) = match &global.profiles {
        Some(path) => (path.clone(), true),
        None => match default_path() {
            Some(path) => (path, false),
            None => return Ok(Profile::default()),
        },
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        // No file where none was asked for: no profile.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !named => {
            return match &global.profile {
                Some(name) => Err(SettingsError(format!(
                    "profile {name:?}: there is no profile file at {}",
                    path.display()
                ))),
                None => Ok(Profile::default()),
            };
        }
        Err(e) => return Err(SettingsError(format!("{}: {e}", path.display()))),
    };
    let file: File = toml::from_str(&text)
        .map_err(|e| SettingsError(format!("{}: {}", path.display(), e.message())))?;
    let name = global.profile.clone().or(file.default.clone());
    match name {
        None => Ok(Profile::default()),
        Some(name) => file.profiles.get(&name).cloned().ok_or_else(|| {
            let known: Vec<&str> = file.profiles.keys().map(String::as_str).collect();
            SettingsError(format!(
                "{}: no profile {name:?} (it has: {})",
                path.display(),
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ))
        }),
    }
}

fn default_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config")))?;
    Some(base.join("once").join("oncectl.toml"))
}

/// `~/…` as the home directory's.
fn expand(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_owned(),
    }
}

fn read(path: &Path, what: &str) -> Result<String, SettingsError> {
    std::fs::read_to_string(path)
        .map_err(|e| SettingsError(format!("{what} {}: {e}", path.display())))
}
