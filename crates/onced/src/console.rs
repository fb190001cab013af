//! The web console (`once-console`) on its own listener, calling this replica's gRPC services
//! in process: its channel's connections are in-memory pipes into the very router that serves
//! the network, behind the same layers, so a console call is checked, measured and answered as
//! any other call is.

use std::io;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::DuplexStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::{Channel, Endpoint};

/// The bytes a pipe holds in each direction before a writer waits.
const PIPE_BYTES: usize = 256 * 1024;

/// What opens connections to this replica, and the connections it opens, for the router to
/// serve.
pub(crate) fn pipes() -> (Pipes, impl Stream<Item = io::Result<DuplexStream>>) {
    let (open, opened) = mpsc::unbounded_channel();
    (Pipes(open), UnboundedReceiverStream::new(opened).map(Ok))
}

/// A channel of its own to this replica: a connection that no other channel's slow reader
/// holds up.
pub(crate) fn connect(pipes: &Pipes) -> Channel {
    Endpoint::from_static("http://in-process.invalid").connect_with_connector_lazy(pipes.clone())
}

/// Opens a connection by handing its far end to the router.
#[derive(Debug, Clone)]
pub(crate) struct Pipes(mpsc::UnboundedSender<DuplexStream>);

impl tower_service::Service<http::Uri> for Pipes {
    type Response = TokioIo<DuplexStream>;
    type Error = io::Error;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let (near, far) = tokio::io::duplex(PIPE_BYTES);
        let handed = self.0.send(far).map_err(|_| {
            io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "the replica stopped serving",
            )
        });
        std::future::ready(handed.map(|()| TokioIo::new(near)))
    }
}
