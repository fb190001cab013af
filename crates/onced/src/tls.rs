//! TLS for the gRPC listener, with certificates re-read without a restart.
//!
//! The server configuration in use is swapped whole on SIGHUP or when a file changes: each
//! new connection takes the configuration of the moment it arrives, so connections already
//! open finish on the certificate they started with. A file that cannot be read or parsed
//! leaves the configuration as it was and says why.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use futures::Stream;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How long a client has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most handshakes under way at once; further connections wait to be accepted.
const MAX_HANDSHAKES: usize = 256;

/// The PEM files TLS is served from.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Certificate authorities of accepted client certificates; when set, every client must
    /// present one.
    pub client_ca: Option<PathBuf>,
}

/// The server configuration in use, and the files it was read from.
#[derive(Clone)]
pub struct Tls {
    files: TlsFiles,
    current: Arc<RwLock<Arc<ServerConfig>>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish()
    }
}

impl Tls {
    pub fn load(files: TlsFiles) -> anyhow::Result<Self> {
        let config = build(&files)?;
        Ok(Self {
            files,
            current: Arc::new(RwLock::new(Arc::new(config))),
        })
    }

    /// Re-reads the files; on failure the configuration in use stays.
    pub fn reload(&self) {
        match build(&self.files) {
            Ok(config) => {
                *self.current.write().expect("not poisoned") = Arc::new(config);
                tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
            }
            Err(error) => {
                tracing::error!(%error, "TLS files could not be reloaded; serving the previous certificate")
            }
        }
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().expect("not poisoned").clone())
    }

    /// Reloads on SIGHUP and whenever a file's modification time or size changes.
    pub async fn watch(self, interval: Duration, stop: CancellationToken) {
        let mut hangups =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(signal) => Some(signal),
                Err(error) => {
                    tracing::warn!(%error, "no SIGHUP handler; TLS reloads on file change only");
                    None
                }
            };
        let mut seen = self.stamps();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let hangup = async {
                match hangups.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = hangup => {
                    tracing::info!("SIGHUP: reloading TLS files");
                    seen = self.stamps();
                    self.reload();
                }
                _ = tick.tick() => {
                    let now = self.stamps();
                    if now != seen {
                        seen = now;
                        self.reload();
                    }
                }
            }
        }
    }

    fn stamps(&self) -> Vec<Option<(SystemTime, u64)>> {
        [
            Some(&self.files.cert),
            Some(&self.files.key),
            self.files.client_ca.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|path| {
            std::fs::metadata(path)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
    }

    /// The connections of `listener`, each after its handshake. Handshakes run concurrently, so
    /// a slow client delays no other; one that fails is logged and dropped.
    pub fn incoming(
        &self,
        listener: TcpListener,
        stop: CancellationToken,
    ) -> impl Stream<Item = io::Result<TlsStream<TcpStream>>> {
        let (ready, connections) = tokio::sync::mpsc::channel(64);
        let tls = self.clone();
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let permit = tokio::select! {
                    _ = stop.cancelled() => return,
                    permit = handshakes.clone().acquire_owned() => permit.expect("never closed"),
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
                let acceptor = tls.acceptor();
                let ready = ready.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = ready.send(Ok(stream)).await;
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(connections)
    }
}

fn build(files: &TlsFiles) -> anyhow::Result<ServerConfig> {
    use anyhow::Context as _;
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
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}
