//! TLS for once-ledger's listeners (onced's gRPC, once-proxy's HTTP): a server configuration
//! read from PEM files, optionally asking every client for a certificate, and the accepted
//! connections of a listener, each after a handshake that runs beside the others and within a
//! bound, so a slow or silent client holds no one else up and nothing for long; and
//! [`PerPeer`], the count that keeps one address from holding all of a listener.

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

/// Most handshakes under way at once from one address: a peer that opens connections and
/// stays silent holds at most these of the slots, never all of them.
pub const MAX_HANDSHAKES_PER_PEER: usize = 32;

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
    let peers = PerPeer::new(MAX_HANDSHAKES_PER_PEER);
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
            let Some(held) = peers.hold(peer.ip()) else {
                tracing::debug!(%peer, "{MAX_HANDSHAKES_PER_PEER} handshakes under way from one address; dropping another");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor();
            let ready = ready.clone();
            tokio::spawn(async move {
                let _permits = (permit, held);
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

/// A count of what each peer address holds (connections, handshakes), with a limit: a peer
/// that opens many and stays silent holds at most `limit`, never everything.
#[derive(Debug, Clone)]
pub struct PerPeer {
    limit: usize,
    held: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

/// One thing a peer holds, counted until it is dropped.
#[derive(Debug)]
pub struct Held {
    of: PerPeer,
    ip: std::net::IpAddr,
}

impl PerPeer {
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            held: Arc::default(),
        }
    }

    /// Counts one more for `ip`; none when it already holds the limit.
    pub fn hold(&self, ip: std::net::IpAddr) -> Option<Held> {
        let mut held = self.held.lock().expect("not poisoned");
        let count = held.entry(ip).or_default();
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(Held {
            of: self.clone(),
            ip,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.of.held.lock().expect("not poisoned");
        if let Some(count) = held.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.ip);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holds_at_most_its_limit_until_it_lets_go() {
        let limit = PerPeer::new(2);
        let one: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let other: std::net::IpAddr = "::1".parse().unwrap();
        let first = limit.hold(one).unwrap();
        let _second = limit.hold(one).unwrap();
        assert!(limit.hold(one).is_none());
        assert!(
            limit.hold(other).is_some(),
            "another address has its own count"
        );
        drop(first);
        assert!(limit.hold(one).is_some());
    }
}
