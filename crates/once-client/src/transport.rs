//! One ledger RPC, retried through transport failures with the very same message.

use std::future::Future;
use std::time::Duration;

use once_api::admin_pb::admin_client::AdminClient;
use once_api::pb::ledger_client::LedgerClient;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_types::StatusExt as _;

use crate::config::ClientConfig;
use crate::error::ClientError;
use crate::reach::{self, Cause, Judged, Unreachable};

/// The generated ledger client every call of this crate goes through.
pub(crate) type Grpc = LedgerClient<Channel>;
/// The generated admin client.
pub(crate) type AdminGrpc = AdminClient<Channel>;

/// A generated client of one of the ledger's services, made over a transport's channel.
pub(crate) trait Service {
    fn over(transport: &Transport) -> Self;
}

impl Service for Grpc {
    fn over(transport: &Transport) -> Self {
        transport.grpc.clone()
    }
}

impl Service for AdminGrpc {
    fn over(transport: &Transport) -> Self {
        AdminClient::new(transport.channel.clone())
    }
}

/// The longest pause between two tries of one call.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// The channel to the ledger and how calls over it are retried. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Transport {
    grpc: Grpc,
    channel: Channel,
    config: ClientConfig,
}

/// How patient one call is: how long it keeps trying, and how much longer than the configured
/// deadline each try may take. The default is a plain call.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Patience {
    pub(crate) retries: Retries,
    /// Added to the deadline of each try (a Begin or a lookup that waits on the server).
    pub(crate) extra: Duration,
}

/// How long a call keeps trying through transport failures and UNAVAILABLE.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) enum Retries {
    /// [`ClientConfig::tries`] tries in all.
    #[default]
    Tries,
    /// Until this moment: a heartbeat keeps trying while its lease may still be extended.
    Until(tokio::time::Instant),
}

impl Transport {
    /// Prepares the channel; nothing is dialled until the first call.
    pub(crate) fn new(config: ClientConfig) -> Result<Self, ClientError> {
        if config.endpoints.is_empty() {
            return Err(ClientError::Invalid(
                "at least one ledger endpoint is required".into(),
            ));
        }
        let endpoints = config
            .endpoints
            .iter()
            .map(|uri| config.endpoint(uri))
            .collect::<Result<Vec<_>, _>>()?;
        // One endpoint connects lazily; several are balanced over.
        let channel = match endpoints.as_slice() {
            [single] => single.connect_lazy(),
            _ => Channel::balance_list(endpoints.into_iter()),
        };
        Self::over(channel, config)
    }

    /// Calls over `channel`, a channel the caller opened.
    pub(crate) fn over(channel: Channel, config: ClientConfig) -> Result<Self, ClientError> {
        if let Some(token) = &config.token {
            if MetadataValue::try_from(format!("Bearer {token}")).is_err() {
                return Err(ClientError::Invalid(
                    "the API key holds characters a header cannot carry".into(),
                ));
            }
        }
        Ok(Self {
            grpc: LedgerClient::new(channel.clone()),
            channel,
            config,
        })
    }

    pub(crate) fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Sends one RPC to the service of `G`, retrying transport failures and UNAVAILABLE with
    /// the very same message, so a retry is the same attempt or the same report, never a new
    /// one, for as long as `patience` says.
    pub(crate) async fn call<G, Req, Resp, F, Fut>(
        &self,
        patience: Patience,
        send: F,
        message: Req,
    ) -> Result<Resp, ClientError>
    where
        G: Service,
        Req: Clone,
        F: Fn(G, Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let mut pause = self.config.backoff;
        let mut last = None;
        for try_number in 1.. {
            let mut request = self.authorized(message.clone());
            request.set_timeout(self.config.rpc_timeout + patience.extra);
            let status = match send(G::over(self), request).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => status,
            };
            let unreachable = match self.failure(&status).await {
                Failure::Final(error) => return Err(error),
                Failure::Passing(unreachable) => unreachable,
            };
            tracing::debug!(code = ?status.code(), try_number, %unreachable, "ledger call failed; retrying");
            last = Some(unreachable);
            let again = match patience.retries {
                Retries::Tries => try_number < self.config.tries.max(1),
                Retries::Until(until) => tokio::time::Instant::now() + pause < until,
            };
            if !again {
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
        }
        Err(ClientError::Unreachable(last.expect("at least one try")))
    }

    /// The ledger's gRPC client, for a call [`Transport::call`] cannot make (a stream).
    pub(crate) fn grpc(&self) -> Grpc {
        self.grpc.clone()
    }

    /// `message` as a request carrying the API key, if there is one, and the trace context of
    /// the current span, if it is traced.
    pub(crate) fn authorized<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        once_telemetry::propagation::inject_grpc(request.metadata_mut());
        if let Some(token) = &self.config.token {
            if let Ok(mut value) = MetadataValue::try_from(format!("Bearer {token}")) {
                value.set_sensitive(true);
                request.metadata_mut().insert("authorization", value);
            }
        }
        request
    }

    /// Where the ledger is, as a person gave it.
    pub(crate) fn address(&self) -> String {
        self.config.endpoints.join(", ")
    }

    /// What a failed call's `status` means: an answer or a failure no retry mends, or a
    /// failure that may pass.
    pub(crate) async fn failure(&self, status: &Status) -> Failure {
        let endpoint = self.config.endpoints.first().map_or("", String::as_str);
        let unreachable = |cause| Unreachable {
            address: self.address(),
            cause,
        };
        let presents_certificate = self.config.tls_identity_pem.is_some();
        match reach::judge(status, endpoint, presents_certificate).await {
            Judged::Unreachable(cause) if cause.passes() => Failure::Passing(unreachable(cause)),
            Judged::Unreachable(cause) => {
                Failure::Final(ClientError::Unreachable(unreachable(cause)))
            }
            Judged::Answer if retryable(status) => Failure::Passing(unreachable(
                Cause::Unavailable(format!("{:?}: {}", status.code(), status.message())),
            )),
            Judged::Answer => Failure::Final(refusal(status)),
        }
    }
}

/// What a failed call means.
pub(crate) enum Failure {
    /// An answer, or a failure that trying again cannot mend.
    Final(ClientError),
    /// A failure that may pass: worth another try.
    Passing(Unreachable),
}

/// Transport failures and an unavailable ledger are worth another try; everything else is an
/// answer.
pub(crate) fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
    )
}

/// The ledger's answer, when it is a refusal.
pub(crate) fn refusal(status: &Status) -> ClientError {
    let message = status.message().to_owned();
    match status.code() {
        Code::InvalidArgument => ClientError::Invalid(message),
        Code::NotFound => ClientError::NotFound,
        code => {
            let reason = status
                .get_details_error_info()
                .map(|info| info.reason)
                .unwrap_or_else(|| format!("{code:?}"));
            ClientError::Refused { reason, message }
        }
    }
}
