//! The flags by which a server names its ledger — `--ledger`, `--ledger-key`, `--ledger-ca`,
//! `--ledger-cert`, `--ledger-cert-key` — flattened into once-proxy's and refund-mcp's
//! command lines, and the [`ClientConfig`] they make.

use std::path::{Path, PathBuf};

use crate::ClientConfig;

/// How a server reaches the ledger. `Debug` never shows the API key.
#[derive(Clone, clap::Args)]
pub struct LedgerArgs {
    /// The once-ledger endpoint: http://HOST:PORT, or https:// for one serving TLS.
    #[arg(long, env = "ONCE_LEDGER", default_value = "http://127.0.0.1:50051")]
    pub ledger: String,
    /// The API key presented to the ledger; it names the tenant whose operations this server
    /// sees. Needed when the ledger requires credentials.
    #[arg(long, env = "ONCE_LEDGER_KEY")]
    pub ledger_key: Option<String>,
    /// A PEM file of certificate authorities to trust for an `https://` ledger (a private CA).
    #[arg(long, env = "ONCE_LEDGER_CA")]
    pub ledger_ca: Option<PathBuf>,
    /// For a ledger that verifies client certificates (mTLS): this server's PEM certificate
    /// (with --ledger-cert-key).
    #[arg(long, env = "ONCE_LEDGER_CERT", requires = "ledger_cert_key")]
    pub ledger_cert: Option<PathBuf>,
    /// The PEM private key of --ledger-cert.
    #[arg(long, env = "ONCE_LEDGER_CERT_KEY", requires = "ledger_cert")]
    pub ledger_cert_key: Option<PathBuf>,
    /// Keep the positions the ledger hands out in this file (made if missing, readable by its
    /// owner only; one file per process), so that a ledger restored from an older backup is
    /// caught even after this process restarts. Kept in memory only when unset.
    #[arg(long, env = "ONCE_STATE_FILE")]
    pub state_file: Option<PathBuf>,
}

/// A file one of [`LedgerArgs`]' flags names that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("--{flag} {}: {source}", path.display())]
pub struct UnreadableFile {
    pub flag: &'static str,
    pub path: PathBuf,
    pub source: std::io::Error,
}

impl LedgerArgs {
    /// The configuration these flags make, for a client recorded in the attempt log as
    /// `client_name`, the certificate files read.
    pub fn config(&self, client_name: &str) -> Result<ClientConfig, UnreadableFile> {
        let read = |flag, path: &Path| {
            std::fs::read(path).map_err(|source| UnreadableFile {
                flag,
                path: path.to_owned(),
                source,
            })
        };
        let mut config = ClientConfig::new(self.ledger.clone());
        config.client_name = client_name.to_owned();
        config.token = self.ledger_key.clone();
        if let Some(path) = &self.ledger_ca {
            config.tls_ca_pem = Some(read("ledger-ca", path)?);
        }
        if let (Some(cert), Some(key)) = (&self.ledger_cert, &self.ledger_cert_key) {
            config.tls_identity_pem =
                Some((read("ledger-cert", cert)?, read("ledger-cert-key", key)?));
        }
        Ok(config)
    }

    /// A client with `config`, remembering its positions where `--state-file` says.
    pub fn client_with(
        &self,
        config: ClientConfig,
    ) -> Result<crate::LedgerClient, crate::ClientError> {
        let positions = match &self.state_file {
            None => crate::Positions::in_memory(),
            Some(path) => crate::Positions::open(path).map_err(|source| {
                crate::ClientError::Invalid(
                    UnreadableFile {
                        flag: "state-file",
                        path: path.clone(),
                        source,
                    }
                    .to_string(),
                )
            })?,
        };
        Ok(crate::LedgerClient::connect(config)?.remembering(positions))
    }
}

impl std::fmt::Debug for LedgerArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerArgs")
            .field("ledger", &self.ledger)
            .field(
                "ledger_key",
                &self.ledger_key.as_ref().map(|_| "<redacted>"),
            )
            .field("ledger_ca", &self.ledger_ca)
            .field("ledger_cert", &self.ledger_cert)
            .field("ledger_cert_key", &self.ledger_cert_key)
            .field("state_file", &self.state_file)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        ledger: LedgerArgs,
    }

    #[test]
    fn a_file_that_cannot_be_read_is_named_with_its_flag() {
        let line = Line::parse_from(["x", "--ledger-ca", "/nonexistent/ca.pem"]);
        let error = line.ledger.config("x").unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("--ledger-ca /nonexistent/ca.pem: "),
            "{error}"
        );
    }

    #[test]
    fn debug_never_shows_the_key() {
        let line = Line::parse_from(["x", "--ledger-key", "s3cret"]);
        assert!(!format!("{:?}", line.ledger).contains("s3cret"));
        assert_eq!(
            line.ledger.config("x").unwrap().token.as_deref(),
            Some("s3cret")
        );
    }
}
