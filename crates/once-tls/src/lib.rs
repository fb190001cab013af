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

/// How long a new connection has to send its first byte: a TLS client sends its hello as soon
/// as it is connected, so one that says nothing for this long is not starting a handshake.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(2);

/// Most handshakes under way at once. A connection beyond it is still accepted, and the oldest
/// handshake that has not said a byte (or, when all have, the oldest) is shed for it.
pub const MAX_HANDSHAKES: usize = 256;

/// Most handshakes under way at once from one address, shed as [`MAX_HANDSHAKES`] is: a peer
/// that opens connections and stays silent holds at most these of the slots, and its own
/// newest connection takes the place of its oldest.
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
/// one). Handshakes run concurrently; one that fails, times out or is shed is logged and
/// dropped. Every connection is accepted at once: at [`MAX_HANDSHAKES`] (or
/// [`MAX_HANDSHAKES_PER_PEER`] from its address) the oldest silent handshake makes room for
/// it, so silent connections cannot keep a real client out. Accepting stops at `stop`, or
/// when the receiver is dropped.
pub fn handshakes(
    listener: TcpListener,
    acceptor: impl Fn() -> TlsAcceptor + Send + 'static,
    stop: CancellationToken,
) -> mpsc::Receiver<Handshaken> {
    let (ready, connections) = mpsc::channel(64);
    let under_way = UnderWay::new(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER);
    tokio::spawn(async move {
        loop {
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
            let slot = under_way.admit(peer.ip());
            let acceptor = acceptor();
            let ready = ready.clone();
            tokio::spawn(async move {
                let shed = slot.shed.clone();
                let handshake = async {
                    let mut first = [0u8; 1];
                    match tokio::time::timeout(FIRST_BYTE_TIMEOUT, tcp.peek(&mut first)).await {
                        Ok(Ok(1..)) => slot.heard(),
                        Ok(Ok(_)) => return Err("closed before a byte"),
                        Ok(Err(_)) => return Err("failed before a byte"),
                        Err(_) => return Err("silent for the first-byte timeout"),
                    }
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => Ok(stream),
                        Ok(Err(_)) => Err("TLS handshake failed"),
                        Err(_) => Err("TLS handshake timed out"),
                    }
                };
                let outcome = tokio::select! {
                    _ = shed.cancelled() => Err("shed for a newer connection"),
                    outcome = handshake => outcome,
                };
                drop(slot);
                match outcome {
                    Ok(stream) => {
                        let _ = ready.send((stream, peer)).await;
                    }
                    Err(why) => tracing::debug!(%peer, "connection dropped: {why}"),
                }
            });
        }
    });
    connections
}

/// The handshakes under way on one listener, oldest first, with what each has said: room for
/// a new one is made by shedding the oldest that has said nothing, else the oldest.
#[derive(Debug, Clone)]
struct UnderWay {
    limit: usize,
    per_peer: usize,
    table: Arc<std::sync::Mutex<Table>>,
}

#[derive(Debug, Default)]
struct Table {
    next: u64,
    /// By arrival: the peer, whether it has sent a byte, and what sheds it.
    pending: std::collections::BTreeMap<u64, (std::net::IpAddr, bool, CancellationToken)>,
    of_peer: std::collections::HashMap<std::net::IpAddr, usize>,
}

/// One handshake's place in [`UnderWay`], given up when dropped.
struct Slot {
    id: u64,
    table: Arc<std::sync::Mutex<Table>>,
    /// Cancelled when a newer connection takes the place.
    shed: CancellationToken,
}

impl UnderWay {
    fn new(limit: usize, per_peer: usize) -> Self {
        Self {
            limit,
            per_peer,
            table: Arc::default(),
        }
    }

    /// A place for a handshake from `ip`, shedding one of that address's or, at the limit,
    /// anyone's to make it.
    fn admit(&self, ip: std::net::IpAddr) -> Slot {
        let mut table = self.table.lock().expect("not poisoned");
        if table.of_peer.get(&ip).copied().unwrap_or(0) >= self.per_peer {
            table.shed(|of| of == ip);
        }
        if table.pending.len() >= self.limit {
            table.shed(|_| true);
        }
        let id = table.next;
        table.next += 1;
        let shed = CancellationToken::new();
        table.pending.insert(id, (ip, false, shed.clone()));
        *table.of_peer.entry(ip).or_default() += 1;
        Slot {
            id,
            table: self.table.clone(),
            shed,
        }
    }
}

impl Table {
    /// Sheds the oldest silent handshake of a peer `of` accepts, else the oldest of them.
    fn shed(&mut self, of: impl Fn(std::net::IpAddr) -> bool) {
        let of = |(_, (ip, _, _)): &(&u64, &(std::net::IpAddr, bool, CancellationToken))| of(*ip);
        let victim = self
            .pending
            .iter()
            .filter(of)
            .find(|(_, (_, heard, _))| !heard)
            .or_else(|| self.pending.iter().find(of))
            .map(|(id, _)| *id);
        if let Some(id) = victim {
            if let Some((_, _, shed)) = self.remove(id) {
                shed.cancel();
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<(std::net::IpAddr, bool, CancellationToken)> {
        let removed = self.pending.remove(&id)?;
        if let Some(count) = self.of_peer.get_mut(&removed.0) {
            *count -= 1;
            if *count == 0 {
                self.of_peer.remove(&removed.0);
            }
        }
        Some(removed)
    }
}

impl Slot {
    /// The peer has sent its first byte: it is shed after every silent one.
    fn heard(&self) {
        if let Some((_, heard, _)) = self
            .table
            .lock()
            .expect("not poisoned")
            .pending
            .get_mut(&self.id)
        {
            *heard = true;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.table.lock().expect("not poisoned").remove(self.id);
    }
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

/// Most connections an HTTP listener holds at once, and from one peer address (clients on this
/// machine share one).
const MAX_CONNECTIONS: usize = 1024;
const MAX_PER_PEER: usize = 256;

/// How long a client has to send a request's headers, or its next request on a connection.
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long open streams (a client's event stream) may keep a listener from stopping.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `router` on the connections of `listener` (HTTP/1.1 and HTTP/2, plaintext or TLS)
/// until `stop`, then lets the open ones finish for at most [`STOP_GRACE`]. What a peer can
/// hold before the router judges its request is bounded: connections (in all and per address),
/// the time to send headers, their size, the streams of an HTTP/2 connection.
pub async fn serve<L>(
    mut listener: L,
    router: axum::Router,
    stop: impl std::future::Future<Output = ()>,
) where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
{
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(64 * 1024);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(64 * 1024)
        .max_concurrent_streams(64);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let peers = PerPeer::new(MAX_PER_PEER);
    tokio::pin!(stop);
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stop => break,
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "{MAX_CONNECTIONS} connections open; refusing another");
            continue;
        };
        let Some(held) = peers.hold(peer.ip()) else {
            tracing::warn!(%peer, "{MAX_PER_PEER} connections open from one address; refusing another");
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "connection ended");
            }
            drop((permit, held));
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(STOP_GRACE) => tracing::info!("streams still open after the grace; closing them"),
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

    #[test]
    fn a_new_handshake_sheds_the_oldest_silent_one_of_its_peer_then_of_anyone() {
        let under_way = UnderWay::new(4, 2);
        let one: std::net::IpAddr = "127.0.0.2".parse().unwrap();
        let two: std::net::IpAddr = "127.0.0.3".parse().unwrap();
        let three: std::net::IpAddr = "127.0.0.4".parse().unwrap();
        let first = under_way.admit(one);
        let second = under_way.admit(one);
        first.heard();
        // One's third sheds its oldest silent handshake, the second, not the first that spoke.
        let third = under_way.admit(one);
        assert!(second.shed.is_cancelled());
        assert!(!first.shed.is_cancelled());
        let fourth = under_way.admit(two);
        fourth.heard();
        let fifth = under_way.admit(two);
        // Four under way (first, third, fourth, fifth): a newcomer from anywhere sheds the
        // oldest silent one of all, the third.
        let sixth = under_way.admit(three);
        assert!(third.shed.is_cancelled());
        // Everyone left has spoken but the fifth and the sixth; then, the oldest that spoke.
        fifth.heard();
        sixth.heard();
        let _seventh = under_way.admit(three);
        assert!(first.shed.is_cancelled());
        assert!(!fourth.shed.is_cancelled() && !fifth.shed.is_cancelled());
        let table = under_way.table.lock().unwrap();
        assert_eq!(table.pending.len(), 4);
        assert_eq!(table.of_peer.values().sum::<usize>(), 4);
    }

    #[test]
    fn a_shed_or_finished_handshake_gives_its_place_back_once() {
        let under_way = UnderWay::new(2, 2);
        let one: std::net::IpAddr = "127.0.0.2".parse().unwrap();
        let first = under_way.admit(one);
        let _second = under_way.admit(one);
        let _third = under_way.admit(one);
        assert!(first.shed.is_cancelled());
        // The shed one's own drop finds its place already gone and takes nothing else.
        drop(first);
        let table = under_way.table.lock().unwrap();
        assert_eq!(table.pending.len(), 2);
        assert_eq!(table.of_peer.get(&one), Some(&2));
    }
}
