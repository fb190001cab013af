//! Why no ledger answered, said the way a person at a terminal needs it: which address, what
//! was found there, and what to change.
//!
//! A call that fails below the ledger's own answers (no listener, a name that does not resolve,
//! TLS on one side only, a certificate nobody vouches for, something that is not a ledger) fails
//! with a [`Cause`] read from the error's chain, not with the transport's words ("h2 protocol
//! error", "transport error"). A ledger that answers but whose database does not is told apart
//! by its own reason, `STORE_UNAVAILABLE`.

use std::error::Error as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_rustls::rustls;
use tonic::{Code, Status};
use tonic_types::StatusExt as _;

/// What was found at a ledger address that did not answer as a ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// Nothing listens there.
    ConnectionRefused,
    /// The host name does not resolve.
    UnknownHost,
    /// No answer within the deadline.
    TimedOut,
    /// The client speaks TLS (`https://`) to a port that speaks plaintext.
    TlsToPlaintext,
    /// The client speaks plaintext (`http://`) to a port that speaks TLS.
    PlaintextToTls,
    /// The ledger's certificate is signed by an authority the client does not trust.
    UnknownCa,
    /// The ledger asks for a client certificate the client did not present, or refused it.
    ClientCertificate,
    /// Another problem with the ledger's certificate (its name, its dates).
    Certificate(String),
    /// Something answers there, but not as a ledger.
    NotALedger,
    /// The ledger answers, but its database does not.
    DatabaseDown,
    /// The ledger answers that it cannot serve now (shutting down, overloaded).
    Unavailable(String),
    /// Anything else the transport said.
    Other(String),
}

impl Cause {
    /// Whether trying again may mend it: a ledger restarting, a database coming back, a name
    /// not yet in DNS. TLS on one side only, a certificate, something that is not a ledger:
    /// no.
    pub fn passes(&self) -> bool {
        matches!(
            self,
            Cause::ConnectionRefused
                | Cause::UnknownHost
                | Cause::TimedOut
                | Cause::DatabaseDown
                | Cause::Unavailable(_)
                | Cause::Other(_)
        )
    }
}

/// No ledger answered at `address`, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.sentence())]
pub struct Unreachable {
    /// The endpoint (or endpoints, comma-separated) the client was given.
    pub address: String,
    pub cause: Cause,
}

impl Unreachable {
    fn sentence(&self) -> String {
        let at = &self.address;
        match &self.cause {
            Cause::ConnectionRefused => format!(
                "nothing listens at {at} (connection refused): is onced running, on this host and port?"
            ),
            Cause::UnknownHost => {
                format!("{at} does not resolve (DNS): check the host's name")
            }
            Cause::TimedOut => format!(
                "{at} did not answer in time: a wrong address, a firewall that drops packets, or a ledger too busy to answer"
            ),
            Cause::TlsToPlaintext => format!(
                "{at} speaks plaintext, not TLS: use {} (or give the ledger --tls-cert and --tls-key)",
                swap_scheme(at, "http://")
            ),
            Cause::PlaintextToTls => {
                format!("{at} speaks TLS: use {}", swap_scheme(at, "https://"))
            }
            Cause::UnknownCa => format!(
                "the certificate of {at} is signed by an authority this client does not trust: give that CA's PEM file (oncectl --ca, once-proxy --ledger-ca, refund-mcp --ledger-ca)"
            ),
            Cause::ClientCertificate => format!(
                "{at} asks for a client certificate this client did not present, or refused the one it did: give one the ledger knows (oncectl --cert and --cert-key, once-proxy --ledger-cert and --ledger-cert-key, refund-mcp --ledger-cert and --ledger-cert-key)"
            ),
            Cause::Certificate(why) => format!("the certificate of {at} was refused: {why}"),
            Cause::NotALedger => format!(
                "something answers at {at}, but not as once-ledger: is it the ledger's gRPC address (--listen), not its metrics port or another service?"
            ),
            Cause::DatabaseDown => format!(
                "the ledger at {at} answers, but its database does not: see onced's log; calls are safe to retry as they were sent"
            ),
            Cause::Unavailable(why) => format!("the ledger at {at} cannot serve now: {why}"),
            Cause::Other(why) => format!("no ledger answered at {at}: {why}"),
        }
    }
}

/// `address` with `scheme` in place of its own.
fn swap_scheme(address: &str, scheme: &str) -> String {
    match address.split_once("://") {
        Some((_, rest)) => format!("{scheme}{rest}"),
        None => format!("{scheme}{address}"),
    }
}

/// How a failed call's status reads, once it is known whether the ledger said it.
pub(crate) enum Judged {
    /// The ledger's own answer.
    Answer,
    /// No ledger answered.
    Unreachable(Cause),
}

/// Reads `status` of a call to `endpoint`: the ledger's answer, or why there was none. It may
/// open one connection to `endpoint` to tell a plaintext client at a TLS port from something
/// that is not a ledger, or, for a client that `presents_certificate` not, a TLS port that asks
/// for one from one that closed for another reason.
pub(crate) async fn judge(status: &Status, endpoint: &str, presents_certificate: bool) -> Judged {
    let ours = status
        .get_details_error_info()
        .is_some_and(|info| info.domain == once_api::ERROR_DOMAIN);
    if ours {
        return match status.get_details_error_info().map(|info| info.reason) {
            Some(reason) if reason == "STORE_UNAVAILABLE" => {
                Judged::Unreachable(Cause::DatabaseDown)
            }
            Some(reason) if reason == "SHUTTING_DOWN" => {
                Judged::Unreachable(Cause::Unavailable(status.message().to_owned()))
            }
            _ => Judged::Answer,
        };
    }
    let chain = Chain::of(status);
    if let Some(cause) = chain.cause() {
        return Judged::Unreachable(cause);
    }
    // TLS 1.3 ends the client's handshake before the server judges its certificate: a server
    // that asked for one and got none closes the connection, and the alert saying why may come
    // after the connection is already read as closed.
    if chain.local
        && !presents_certificate
        && endpoint.starts_with("https://")
        && asks_for_client_certificate(endpoint).await
    {
        return Judged::Unreachable(Cause::ClientCertificate);
    }
    // A TLS server closes the connection on the HTTP/2 preface it reads as a bad ClientHello;
    // whether the client first reads its alert (a protocol error, below) or finds the
    // connection cut while still writing is a race.
    if chain.cut_off() && !endpoint.starts_with("https://") && speaks_tls(endpoint).await {
        return Judged::Unreachable(Cause::PlaintextToTls);
    }
    match status.code() {
        // A gRPC server without the ledger's methods, or an HTTP/2 server answering 404.
        Code::Unimplemented => Judged::Unreachable(Cause::NotALedger),
        // Bytes that are not HTTP/2 came back: a TLS server, or not a gRPC server at all.
        _ if chain.protocol_error => {
            let tls = !endpoint.starts_with("https://") && speaks_tls(endpoint).await;
            Judged::Unreachable(match tls {
                true => Cause::PlaintextToTls,
                false => Cause::NotALedger,
            })
        }
        Code::DeadlineExceeded | Code::Cancelled if chain.timed_out => {
            Judged::Unreachable(Cause::TimedOut)
        }
        Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Cancelled
            if chain.local =>
        {
            Judged::Unreachable(Cause::Other(chain.words()))
        }
        // A gRPC server that is not ours answering as one (no ledger reason): an UNAVAILABLE
        // from a proxy in front of the ledger, say.
        Code::Unavailable => Judged::Unreachable(Cause::Unavailable(status.message().to_owned())),
        _ => Judged::Answer,
    }
}

/// What the error chain behind a status holds.
struct Chain {
    messages: Vec<String>,
    io_kinds: Vec<std::io::ErrorKind>,
    tls: Option<rustls::Error>,
    /// The status was made here from a transport error, not sent by a server.
    local: bool,
    protocol_error: bool,
    timed_out: bool,
}

impl Chain {
    fn of(status: &Status) -> Self {
        let mut chain = Chain {
            messages: Vec::new(),
            io_kinds: Vec::new(),
            tls: None,
            local: status.source().is_some(),
            protocol_error: false,
            timed_out: false,
        };
        let mut next = status.source();
        while let Some(error) = next {
            chain.messages.push(error.to_string());
            if let Some(io) = error.downcast_ref::<std::io::Error>() {
                chain.io_kinds.push(io.kind());
                // An io::Error's own source skips the error it wraps: look at it here.
                if let Some(inner) = io.get_ref() {
                    chain.note(inner);
                }
            }
            chain.note(error);
            next = error.source();
        }
        chain
    }

    fn note(&mut self, error: &(dyn std::error::Error + 'static)) {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            self.tls.get_or_insert_with(|| tls.clone());
        }
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            match h2.get_io() {
                Some(io) => self.io_kinds.push(io.kind()),
                None => self.protocol_error = true,
            }
        }
        if error.downcast_ref::<tonic::TimeoutExpired>().is_some() {
            self.timed_out = true;
        }
    }

    fn cause(&self) -> Option<Cause> {
        use rustls::{AlertDescription as Alert, CertificateError, Error as Tls};
        use std::io::ErrorKind;
        if let Some(tls) = &self.tls {
            return Some(match tls {
                Tls::InvalidCertificate(CertificateError::UnknownIssuer) => Cause::UnknownCa,
                Tls::InvalidCertificate(other) => Cause::Certificate(certificate_fault(other)),
                Tls::InvalidMessage(_) | Tls::InappropriateMessage { .. } => Cause::TlsToPlaintext,
                Tls::AlertReceived(
                    Alert::CertificateRequired
                    | Alert::BadCertificate
                    | Alert::UnknownCA
                    | Alert::CertificateUnknown
                    | Alert::HandshakeFailure,
                ) => Cause::ClientCertificate,
                other => Cause::Other(other.to_string()),
            });
        }
        // After a TLS 1.3 handshake a refused client certificate comes as an alert on the first
        // read, which HTTP/2 keeps only as words.
        let alert = self.messages.iter().find_map(|m| {
            m.split_once("received fatal alert: ")
                .map(|(_, alert)| alert)
        });
        if let Some(alert) = alert {
            return Some(match alert {
                "CertificateRequired"
                | "BadCertificate"
                | "UnknownCA"
                | "CertificateUnknown"
                | "HandshakeFailure" => Cause::ClientCertificate,
                other => Cause::Other(format!("the ledger ended TLS: {other}")),
            });
        }
        if self.io_kinds.contains(&ErrorKind::ConnectionRefused) {
            return Some(Cause::ConnectionRefused);
        }
        if self.messages.iter().any(|m| m == "dns error")
            || self
                .messages
                .iter()
                .any(|m| m.contains("failed to lookup address"))
        {
            return Some(Cause::UnknownHost);
        }
        if self.io_kinds.contains(&ErrorKind::TimedOut) {
            return Some(Cause::TimedOut);
        }
        None
    }

    /// The connection was closed under the client.
    fn cut_off(&self) -> bool {
        use std::io::ErrorKind;
        self.io_kinds.iter().any(|kind| {
            matches!(
                kind,
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
            )
        })
    }

    fn words(&self) -> String {
        self.messages.last().cloned().unwrap_or_default()
    }
}

/// Whether `endpoint` answers a TLS ClientHello with a TLS record: a server hello or an alert.
async fn speaks_tls(endpoint: &str) -> bool {
    let Some(authority) = authority(endpoint) else {
        return false;
    };
    let hello = match client_hello(&authority) {
        Some(hello) => hello,
        None => return false,
    };
    let answer = async {
        let mut stream = tokio::net::TcpStream::connect(&authority).await.ok()?;
        stream.write_all(&hello).await.ok()?;
        let mut head = [0u8; 2];
        stream.read_exact(&mut head).await.ok()?;
        Some(head)
    };
    // A TLS record starts with its type (handshake 22, alert 21) and the major version 3.
    matches!(
        tokio::time::timeout(Duration::from_secs(2), answer).await,
        Ok(Some([22 | 21, 3]))
    )
}

/// Whether `endpoint` asks a TLS client for a certificate (a CertificateRequest in its
/// handshake). The probe trusts whatever certificate the server shows, since nothing but the
/// handshake is sent over it, and it presents none.
async fn asks_for_client_certificate(endpoint: &str) -> bool {
    let Some(authority) = authority(endpoint) else {
        return false;
    };
    let Some(name) = server_name(&authority) else {
        return false;
    };
    let asked = Arc::new(Asked::default());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let Ok(config) = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
    else {
        return false;
    };
    let config = config
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_client_cert_resolver(asked.clone());
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let handshake = async {
        let tcp = tokio::net::TcpStream::connect(&authority).await.ok()?;
        let _tls = connector.connect(name, tcp).await;
        Some(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), handshake).await;
    asked.0.load(std::sync::atomic::Ordering::Relaxed)
}

/// A client certificate resolver that presents none and notes that one was asked for.
#[derive(Debug, Default)]
struct Asked(std::sync::atomic::AtomicBool);

impl rustls::client::ResolvesClientCert for Asked {
    fn resolve(
        &self,
        _hints: &[&[u8]],
        _schemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        None
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// For the probe only: any server certificate is taken, its handshake signatures checked.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `host:port` of a URL.
fn authority(endpoint: &str) -> Option<String> {
    let uri: tonic::codegen::http::Uri = endpoint.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16().unwrap_or(80);
    Some(match host.contains(':') {
        true => format!("[{}]:{port}", host.trim_matches(['[', ']'])),
        false => format!("{host}:{port}"),
    })
}

/// The TLS server name of `authority`'s host (`host:port`, `[v6]:port`).
fn server_name(authority: &str) -> Option<rustls::pki_types::ServerName<'static>> {
    let host = authority.rsplit_once(':')?.0.trim_matches(['[', ']']);
    rustls::pki_types::ServerName::try_from(host.to_owned()).ok()
}

/// The bytes of a TLS ClientHello to `authority`'s host.
fn client_hello(authority: &str) -> Option<Vec<u8>> {
    let name = server_name(authority)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let mut connection = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut hello = Vec::new();
    connection.write_tls(&mut hello).ok()?;
    Some(hello)
}

/// Why a ledger's certificate was refused, in words: rustls's own for most, and for what
/// webpki reports only by name, a sentence.
fn certificate_fault(fault: &rustls::CertificateError) -> String {
    let named = format!("{fault:?}");
    if named.contains("CaUsedAsEndEntity") {
        return "it is a certificate authority's own certificate, not a server's: serve one \
                that authority signed for the ledger's name"
            .to_owned();
    }
    match fault {
        rustls::CertificateError::Other(other) => format!("{other}"),
        fault => fault.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that answers whatever it is sent with `answer`, then closes.
    async fn answering(answer: &'static [u8]) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("bound");
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut first = [0u8; 5];
                let _ = stream.read(&mut first).await;
                let _ = stream.write_all(answer).await;
            }
        });
        format!("http://{address}")
    }

    /// What a client sees when the server closed the connection while its HTTP/2 preface was
    /// still being written.
    fn cut_off() -> Status {
        Status::from_error(Box::new(std::io::Error::from(
            std::io::ErrorKind::BrokenPipe,
        )))
    }

    #[tokio::test]
    async fn a_plaintext_call_cut_off_by_a_tls_server_is_named_as_one() {
        // A TLS alert record: what a TLS server answers a ClientHello it refuses.
        let tls = answering(&[21, 3, 3, 0, 2, 2, 40]).await;
        assert!(matches!(
            judge(&cut_off(), &tls, false).await,
            Judged::Unreachable(Cause::PlaintextToTls)
        ));
        let closing = answering(b"").await;
        assert!(matches!(
            judge(&cut_off(), &closing, false).await,
            Judged::Unreachable(Cause::Other(_))
        ));
    }
}
