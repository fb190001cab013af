//! How to reach the ledger.

use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::error::ClientError;

/// How to reach the ledger. `Debug` never shows the API key or the client key.
#[derive(Clone)]
pub struct ClientConfig {
    /// One or several `onced` endpoints (`http://host:port`); calls are spread over them.
    pub endpoints: Vec<String>,
    /// The API key, sent as `authorization: Bearer <token>` when set. It names the tenant.
    pub token: Option<String>,
    /// Deadline of one RPC attempt.
    pub rpc_timeout: Duration,
    /// How many times a call is tried in all before the ledger counts as unreachable.
    pub tries: u32,
    /// Pause before the first retry; doubled for each further one.
    pub backoff: Duration,
    /// The client name recorded in the attempt log.
    pub client_name: String,
    /// For `https://` endpoints: a PEM bundle of extra certificate authorities to trust (a
    /// private CA) besides the public web roots.
    pub tls_ca_pem: Option<Vec<u8>>,
    /// For `https://` endpoints of a ledger that verifies client certificates (mTLS): the PEM
    /// certificate and private key to present.
    pub tls_identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("endpoints", &self.endpoints)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("rpc_timeout", &self.rpc_timeout)
            .field("tries", &self.tries)
            .field("backoff", &self.backoff)
            .field("client_name", &self.client_name)
            .field("tls_ca_pem", &self.tls_ca_pem.as_ref().map(Vec::len))
            .field(
                "tls_identity_pem",
                &self.tls_identity_pem.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl ClientConfig {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoints: vec![endpoint.into()],
            token: None,
            rpc_timeout: Duration::from_secs(2),
            tries: 5,
            backoff: Duration::from_millis(100),
            client_name: "once-client".into(),
            tls_ca_pem: None,
            tls_identity_pem: None,
        }
    }

    /// One ledger endpoint with its timeouts, and TLS when the scheme is `https`.
    pub(crate) fn endpoint(&self, uri: &str) -> Result<Endpoint, ClientError> {
        let invalid = |e: tonic::transport::Error| {
            ClientError::Invalid(format!("ledger endpoint {uri:?}: {e}"))
        };
        match uri.split_once("://") {
            Some(("http" | "https", _)) => {}
            Some((scheme, _)) => {
                return Err(ClientError::Invalid(format!(
                    "ledger address {uri:?}: the scheme is http:// (plaintext) or https:// (TLS), not {scheme}://"
                )))
            }
            None => {
                return Err(ClientError::Invalid(format!(
                    "ledger address {uri:?} has no scheme: write http://{uri} for plaintext, or https://{uri} for TLS"
                )))
            }
        }
        let mut endpoint = Endpoint::from_shared(uri.to_owned())
            .map_err(invalid)?
            .connect_timeout(self.rpc_timeout)
            .timeout(self.rpc_timeout);
        if uri.starts_with("https://") {
            let mut tls = ClientTlsConfig::new().with_webpki_roots();
            if let Some(pem) = &self.tls_ca_pem {
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            if let Some((cert, key)) = &self.tls_identity_pem {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            endpoint = endpoint.tls_config(tls).map_err(invalid)?;
        }
        Ok(endpoint)
    }
}
