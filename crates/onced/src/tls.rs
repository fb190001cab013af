//! TLS for the gRPC listener, with certificates re-read without a restart.
//!
//! The server configuration in use is swapped whole on SIGHUP or when a file changes: each
//! new connection takes the configuration of the moment it arrives, so connections already
//! open finish on the certificate they started with. A file that cannot be read or parsed
//! leaves the configuration as it was and says why.

use std::io;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use futures::{Stream, StreamExt};
pub use once_tls::TlsFiles;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

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

    /// The connections of `listener`, each after its handshake with the certificate in use
    /// when it arrived. Handshakes run concurrently, so a slow client delays no other; one that
    /// fails is logged and dropped.
    pub fn incoming(
        &self,
        listener: TcpListener,
        stop: CancellationToken,
    ) -> impl Stream<Item = io::Result<TlsStream<TcpStream>>> {
        let tls = self.clone();
        let connections = once_tls::handshakes(listener, move || tls.acceptor(), stop);
        tokio_stream::wrappers::ReceiverStream::new(connections).map(|(stream, _peer)| Ok(stream))
    }
}

fn build(files: &TlsFiles) -> anyhow::Result<ServerConfig> {
    once_tls::server_config(files, &[b"h2"])
}
