//! The connection to the ledger, with retries that never mint a second attempt.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, SystemTime};

use futures::FutureExt as _;
use once_api::pb;
use once_api::pb::ledger_client::LedgerClient as Grpc;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

use crate::attempt::Attempt;
use crate::spec::OperationSpec;

/// How to reach the ledger.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// One or several `onced` endpoints (`http://host:port`); calls are spread over them.
    pub endpoints: Vec<String>,
    /// Sent as `authorization: Bearer <token>` when set.
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
        }
    }
}

/// Why a ledger call failed. None of these means the effect ran.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The ledger could not be reached after every retry. Fail closed: the effect was not
    /// performed, and the same call is safe to retry later.
    #[error("the ledger is unreachable: {0}")]
    Unreachable(String),
    /// The request was malformed.
    #[error("invalid operation: {0}")]
    Invalid(String),
    /// The ledger refused the call (a lost execution right, a settled operation, ...).
    #[error("the ledger refused the call: {} ({})", .0.message(), .0.code())]
    Refused(Status),
}

/// What the ledger decided.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one decision per call; boxing buys nothing"
)]
pub enum Decision {
    /// Perform the effect now, once, and report through the attempt.
    Execute(Attempt),
    Replay(Replay),
    InProgress(InProgress),
    Unknown(Unknown),
    Conflict(Conflict),
}

/// Another attempt holds the lease; do not perform the effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InProgress {
    pub operation_id: String,
    pub retry_after: Duration,
    /// Set when the same tool and arguments run under another id: that operation.
    pub blocking_operation_id: Option<String>,
}

/// The effect may have happened; do not perform it, and do not mint a new id for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unknown {
    pub operation_id: String,
    pub reason: String,
    /// Set when another operation with the same tool and arguments, UNKNOWN (or past its
    /// lease), blocks this one.
    pub blocking_operation_id: Option<String>,
}

/// The operation was already requested with different arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub operation_id: String,
    pub stored_fingerprint: String,
    pub requested_fingerprint: String,
}

/// A confirmed operation's original result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    pub operation_id: String,
    pub result: Vec<u8>,
    pub provider_ref: Option<String>,
    pub confirmed_at: SystemTime,
}

/// What a side effect produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    /// Stored by the ledger and replayed verbatim to every later caller.
    pub result: Vec<u8>,
    /// The provider's id for the effect (a refund id).
    pub provider_ref: Option<String>,
}

impl Effect {
    pub fn new(result: Vec<u8>) -> Self {
        Self {
            result,
            provider_ref: None,
        }
    }

    pub fn with_provider_ref(mut self, provider_ref: impl Into<String>) -> Self {
        self.provider_ref = Some(provider_ref.into());
        self
    }
}

/// How a side effect failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EffectError {
    /// The effect certainly did not happen (refused before anything changed): safe to retry.
    #[error("not performed: {0}")]
    NotPerformed(String),
    /// The effect may have happened: a timeout, a reset connection, a 5xx after sending.
    #[error("outcome unknown: {0}")]
    Ambiguous(String),
}

/// What [`LedgerClient::run`] did.
#[derive(Debug)]
pub enum Outcome {
    /// The effect ran now and its result is confirmed.
    Executed {
        operation_id: String,
        effect: Effect,
    },
    /// The effect had already run; here is its original result.
    Replayed(Replay),
    /// The effect ran now and failed without effect; the ledger knows it is ABSENT.
    NotPerformed {
        operation_id: String,
        reason: String,
    },
    /// The effect ran now and nobody can tell whether it happened; the ledger knows it is
    /// UNKNOWN.
    Ambiguous {
        operation_id: String,
        reason: String,
    },
    InProgress(InProgress),
    Unknown(Unknown),
    Conflict(Conflict),
}

/// A handle on the ledger. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LedgerClient {
    grpc: Grpc<Channel>,
    config: ClientConfig,
}

impl LedgerClient {
    /// Prepares the connection; nothing is dialled until the first call.
    pub fn connect(config: ClientConfig) -> Result<Self, ClientError> {
        if config.endpoints.is_empty() {
            return Err(ClientError::Invalid(
                "at least one ledger endpoint is required".into(),
            ));
        }
        let endpoints = config
            .endpoints
            .iter()
            .map(|uri| endpoint(uri, &config))
            .collect::<Result<Vec<_>, _>>()?;
        // One endpoint connects lazily; several are balanced over.
        let channel = match endpoints.as_slice() {
            [single] => single.connect_lazy(),
            _ => Channel::balance_list(endpoints.into_iter()),
        };
        Ok(Self {
            grpc: Grpc::new(channel),
            config,
        })
    }

    /// Asks the ledger whether to perform the operation's effect.
    pub async fn begin(&self, spec: &OperationSpec) -> Result<Decision, ClientError> {
        let (operation_id, fingerprint) = spec
            .resolve()
            .map_err(|e| ClientError::Invalid(e.to_string()))?;
        let mut context = spec.context.clone();
        if context.client_name.is_empty() {
            context.client_name = self.config.client_name.clone();
        }
        let request = pb::BeginRequest {
            tool: spec.tool.clone(),
            // Every identity form is resolved here, so the ledger gets the id it would compute.
            identity: Some(pb::begin_request::Identity::OperationId(
                operation_id.clone(),
            )),
            effect: Some(pb::begin_request::Effect::Fingerprint(fingerprint)),
            volatile_fields: Vec::new(),
            // One attempt id for every transport retry of this Begin.
            attempt_id: uuid::Uuid::new_v4().to_string(),
            context: Some(context),
            lease_ttl: spec.lease_ttl.map(duration),
            wait: spec.wait.map(duration),
            new_intent: spec.new_intent,
            retention: spec.retention.map(duration),
            provider: spec.provider.clone().unwrap_or_default(),
            lookup_hints_json: spec
                .lookup_hints
                .as_ref()
                .map(|h| h.to_string())
                .unwrap_or_default(),
        };
        // A bounded wait happens on the server: give the call that much longer.
        let extra = spec.wait.unwrap_or_default();
        let response = self
            .call(
                extra,
                |mut grpc, request| async move { grpc.begin(request).await },
                request,
            )
            .await?;
        Ok(self.decision(response, spec))
    }

    fn decision(&self, response: pb::BeginResponse, spec: &OperationSpec) -> Decision {
        use pb::begin_response::Decision as D;
        let operation_id = response.operation_id;
        match response.decision {
            Some(D::Execute(grant)) => Decision::Execute(Attempt::start(
                self.clone(),
                operation_id,
                grant,
                spec.lease_ttl,
            )),
            Some(D::Replay(replay)) => Decision::Replay(Replay {
                operation_id,
                result: replay.result,
                provider_ref: Some(replay.provider_ref).filter(|r| !r.is_empty()),
                confirmed_at: replay
                    .confirmed_at
                    .map(system_time)
                    .unwrap_or(SystemTime::UNIX_EPOCH),
            }),
            Some(D::InProgress(p)) => Decision::InProgress(InProgress {
                operation_id,
                retry_after: p
                    .retry_after
                    .map(std_duration)
                    .unwrap_or(Duration::from_secs(1)),
                blocking_operation_id: Some(p.blocking_operation_id).filter(|b| !b.is_empty()),
            }),
            Some(D::Unknown(u)) => Decision::Unknown(Unknown {
                operation_id,
                reason: u.reason,
                blocking_operation_id: Some(u.blocking_operation_id).filter(|b| !b.is_empty()),
            }),
            Some(D::Conflict(c)) => Decision::Conflict(Conflict {
                operation_id,
                stored_fingerprint: c.stored_fingerprint,
                requested_fingerprint: c.requested_fingerprint,
            }),
            None => Decision::Unknown(Unknown {
                operation_id,
                reason: "the ledger sent no decision".into(),
                blocking_operation_id: None,
            }),
        }
    }

    /// Runs `effect` at most once for the operation: asks the ledger, performs the effect only
    /// on EXECUTE, and reports what happened. A panic in the effect counts as ambiguous; so does
    /// dropping the returned future while the effect runs. An error means the effect did not
    /// run (the ledger could not be asked, or refused the request).
    pub async fn run<F, Fut>(&self, spec: &OperationSpec, effect: F) -> Result<Outcome, ClientError>
    where
        F: FnOnce(EffectContext) -> Fut,
        Fut: Future<Output = Result<Effect, EffectError>>,
    {
        let attempt = match self.begin(spec).await? {
            Decision::Execute(attempt) => attempt,
            Decision::Replay(replay) => return Ok(Outcome::Replayed(replay)),
            Decision::InProgress(in_progress) => return Ok(Outcome::InProgress(in_progress)),
            Decision::Unknown(unknown) => return Ok(Outcome::Unknown(unknown)),
            Decision::Conflict(conflict) => return Ok(Outcome::Conflict(conflict)),
        };
        let context = EffectContext {
            operation_id: attempt.operation_id().to_owned(),
            provider_key: attempt.provider_key().to_owned(),
            attempt: attempt.number(),
        };
        let operation_id = context.operation_id.clone();
        // Once the effect has run, its outcome is the truth the caller gets, whether or not the
        // report reaches the ledger: an unreported attempt becomes UNKNOWN when its lease runs
        // out, never ABSENT, so a failed report is logged and not turned into "not performed".
        let performed = AssertUnwindSafe(effect(context)).catch_unwind().await;
        let (outcome, reported) = match performed {
            Ok(Ok(effect)) => {
                let reported = attempt
                    .confirm(effect.result.clone(), effect.provider_ref.clone())
                    .await;
                (
                    Outcome::Executed {
                        operation_id,
                        effect,
                    },
                    reported,
                )
            }
            Ok(Err(EffectError::NotPerformed(reason))) => {
                let reported = attempt.absent(&reason).await;
                (
                    Outcome::NotPerformed {
                        operation_id,
                        reason,
                    },
                    reported,
                )
            }
            Ok(Err(EffectError::Ambiguous(reason))) => {
                let reported = attempt.unknown(&reason).await;
                (
                    Outcome::Ambiguous {
                        operation_id,
                        reason,
                    },
                    reported,
                )
            }
            Err(_panic) => {
                let reason = "the effect panicked".to_owned();
                let reported = attempt.unknown(&reason).await;
                (
                    Outcome::Ambiguous {
                        operation_id,
                        reason,
                    },
                    reported,
                )
            }
        };
        if let Err(error) = reported {
            tracing::warn!(%error, ?outcome, "the effect ran but its report did not reach the ledger; its lease will expire into UNKNOWN");
        }
        Ok(outcome)
    }

    /// The operation as the ledger holds it, for status tools.
    pub async fn get(&self, operation_id: &str) -> Result<pb::GetOperationResponse, ClientError> {
        let request = pb::GetOperationRequest {
            operation_id: operation_id.into(),
        };
        self.call(
            Duration::ZERO,
            |mut grpc, request| async move { grpc.get_operation(request).await },
            request,
        )
        .await
    }

    /// Sends one RPC, retrying transport failures and UNAVAILABLE with the very same message,
    /// so a retry is the same attempt or the same report, never a new one.
    pub(crate) async fn call<Req, Resp, F, Fut>(
        &self,
        extra: Duration,
        send: F,
        message: Req,
    ) -> Result<Resp, ClientError>
    where
        Req: Clone,
        F: Fn(Grpc<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        self.call_with(Retries::Tries, extra, send, message).await
    }

    /// [`call`](Self::call), retrying as `retries` says.
    pub(crate) async fn call_with<Req, Resp, F, Fut>(
        &self,
        retries: Retries,
        extra: Duration,
        send: F,
        message: Req,
    ) -> Result<Resp, ClientError>
    where
        Req: Clone,
        F: Fn(Grpc<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let mut pause = self.config.backoff;
        let mut last = None;
        for try_number in 1.. {
            let mut request = Request::new(message.clone());
            request.set_timeout(self.config.rpc_timeout + extra);
            if let Some(token) = &self.config.token {
                if let Ok(value) = MetadataValue::try_from(format!("Bearer {token}")) {
                    request.metadata_mut().insert("authorization", value);
                }
            }
            match send(self.grpc.clone(), request).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if retryable(&status) => {
                    tracing::debug!(code = ?status.code(), try_number, "ledger call failed; retrying");
                    last = Some(status);
                    let again = match retries {
                        Retries::Tries => try_number < self.config.tries.max(1),
                        Retries::Until(until) => tokio::time::Instant::now() + pause < until,
                    };
                    if !again {
                        break;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_RETRY_PAUSE);
                }
                Err(status) if status.code() == Code::InvalidArgument => {
                    return Err(ClientError::Invalid(status.message().to_owned()))
                }
                Err(status) => return Err(ClientError::Refused(status)),
            }
        }
        let status = last.expect("at least one try");
        Err(ClientError::Unreachable(format!(
            "{}: {}",
            status.code(),
            status.message()
        )))
    }
}

/// The longest pause between two tries of one call.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// How long a call keeps trying through transport failures and UNAVAILABLE.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Retries {
    /// [`ClientConfig::tries`] tries in all.
    Tries,
    /// Until this moment: a heartbeat keeps trying while its lease may still be extended.
    Until(tokio::time::Instant),
}

/// One ledger endpoint with its timeouts, and TLS when the scheme is `https`.
fn endpoint(uri: &str, config: &ClientConfig) -> Result<Endpoint, ClientError> {
    let invalid =
        |e: tonic::transport::Error| ClientError::Invalid(format!("ledger endpoint {uri:?}: {e}"));
    let mut endpoint = Endpoint::from_shared(uri.to_owned())
        .map_err(invalid)?
        .connect_timeout(config.rpc_timeout)
        .timeout(config.rpc_timeout);
    if uri.starts_with("https://") {
        let mut tls = ClientTlsConfig::new().with_webpki_roots();
        if let Some(pem) = &config.tls_ca_pem {
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        endpoint = endpoint.tls_config(tls).map_err(invalid)?;
    }
    Ok(endpoint)
}

/// What the side effect needs from the ledger.
#[derive(Debug, Clone)]
pub struct EffectContext {
    pub operation_id: String,
    /// Pass to the provider's idempotency mechanism (e.g. the `Idempotency-Key` header).
    pub provider_key: String,
    pub attempt: u32,
}

/// Transport failures and an unavailable ledger are worth another try; everything else is an
/// answer.
fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
    )
}

pub(crate) fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub(crate) fn std_duration(d: prost_types::Duration) -> Duration {
    Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32)
}

pub(crate) fn system_time(ts: prost_types::Timestamp) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(once_api::convert::millis(&ts).max(0) as u64)
}
