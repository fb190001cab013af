//! TLS for once-ledger's listeners (onced's gRPC, once-proxy's HTTP): a server configuration
//! read from PEM files, optionally asking every client for a certificate, and the accepted
//! connections of a listener, each after a handshake that runs beside the others and within a
//! bound, so a slow or silent client holds no one else up and nothing for long.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How long a client has to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most handshakes under way at once; further connections wait to be accepted.
pub const MAX_HANDSHAKES: usize = 256;

/// The PEM files TLS is served from (named in errors by the flags that give them:
/// `--tls-cert`, `--tls-key`, `--tls-client-ca`).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Certificate authorities of accepted client certificates; when set, every client must
    /// present one.
    pub client_ca: Option<PathBuf>,
}

/// A server configuration from `files`, offering `alpn` protocols.
pub fn server_config(files: &TlsFiles, alpn: &[&[u8]]) -> anyhow::Result<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("--tls-cert {}", files.cert.display()))?;
    anyhow::ensure!(
        !chain.is_empty(),
        "--tls-cert {}: no certificate in it",
        files.cert.display()
    );
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("--tls-key {}", files.key.display()))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path)
                .with_context(|| format!("--tls-client-ca {}", path.display()))?
            {
                roots
                    .add(cert.with_context(|| format!("--tls-client-ca {}", path.display()))?)
                    .with_context(|| format!("--tls-client-ca {}", path.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .with_context(|| format!("--tls-client-ca {}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .context("--tls-cert and --tls-key do not make a usable pair")?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A connection after its handshake, and its peer.
pub type Handshaken = (TlsStream<TcpStream>, SocketAddr);

/// The connections of `listener`, each after its handshake with the acceptor `acceptor` gives
/// at the moment the connection arrives (so a reloaded certificate takes effect for the next
/// one). Handshakes run concurrently; one that fails or times out is logged and dropped.
/// Accepting stops at `stop`, or when the receiver is dropped.
pub fn handshakes(
    listener: TcpListener,
    acceptor: impl Fn() -> TlsAcceptor + Send + 'static,
    stop: CancellationToken,
) -> mpsc::Receiver<Handshaken> {
    let (ready, connections) = mpsc::channel(64);
    let handshaking = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                _ = stop.cancelled() => return,
                permit = handshaking.clone().acquire_owned() => permit.expect("never closed"),
            };
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                _ = ready.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor();
            let ready = ready.clone();
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = ready.send((stream, peer)).await;
                    }
                    Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    connections
}

/// A TLS listener for `axum::serve`: the connections [`handshakes`] yields.
#[derive(Debug)]
pub struct TlsListener {
    connections: mpsc::Receiver<Handshaken>,
    local: SocketAddr,
    /// Stops the accept loop when the listener is dropped.
    _stop: tokio_util::sync::DropGuard,
}

impl TlsListener {
    pub fn new(listener: TcpListener, config: ServerConfig) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let stop = CancellationToken::new();
        let connections = handshakes(listener, move || acceptor.clone(), stop.clone());
        Ok(Self {
            connections,
            local,
            _stop: stop.drop_guard(),
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.connections.recv().await {
            Some(connection) => connection,
            // The accept loop ends only when stopped, and the guard that stops it is ours.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}
