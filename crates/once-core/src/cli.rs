//! What the command lines that manage credentials share: `onced keys create`, on the database,
//! and `oncectl keys create`, through the admin API, take a new credential the same way.

use std::path::PathBuf;

use crate::access::{Role, Roles};

/// A credential to create: an API key, or a client certificate to register.
#[derive(Debug, Clone, clap::Args)]
pub struct NewCredential {
    /// The tenant the credential acts in.
    #[arg(long)]
    pub tenant: String,
    /// Who the credential is for (e.g. refund-mcp-prod); recorded as the actor of its calls.
    #[arg(long)]
    pub name: String,
    /// executor, reader, operator or admin; repeat or separate with commas.
    #[arg(long = "role", required = true, value_delimiter = ',')]
    pub roles: Vec<Role>,
    /// Register this PEM client certificate (mTLS) instead of creating a key.
    #[arg(long)]
    pub certificate: Option<PathBuf>,
}

impl NewCredential {
    pub fn roles(&self) -> Roles {
        Roles::of(self.roles.iter().copied())
    }

    /// The PEM of `--certificate`, read; `None` for a key.
    pub fn certificate_pem(&self) -> Result<Option<String>, String> {
        self.certificate
            .as_ref()
            .map(|path| {
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
            })
            .transpose()
    }
}
