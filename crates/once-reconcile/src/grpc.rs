//! `grpc`: a reconciler in another process, in any language, speaking `once.reconciler.v1`
//! (see `proto/once/reconciler/v1/reconciler.proto`).
//!
//! ```toml
//! [[reconciler]]
//! name = "ledgerbank"
//! kind = "grpc"
//! endpoint = "http://127.0.0.1:7070"
//! timeout = "5s"
//! ```
//!
//! The plugin declares its provider's capabilities itself; until it has answered, misses count
//! for nothing.

use std::sync::OnceLock;
use std::time::Duration;

use once_api::reconciler_pb as pb;
use once_api::reconciler_pb::reconciler_client::ReconcilerClient;
use tonic::transport::{Channel, Endpoint};

use crate::{Capabilities, LookupRequest, Reconciler, Verdict};

/// What is assumed of a plugin that has not said: nothing.
const UNDECLARED: Capabilities = Capabilities {
    miss_is_authoritative: false,
    settle_time_ms: i64::MAX,
    dedupes_by_provider_key: false,
};

pub struct GrpcReconciler {
    client: ReconcilerClient<Channel>,
    /// The plugin's declared capabilities, once it has declared them.
    declared: OnceLock<Capabilities>,
    /// The credential of the one tenant this instance serves, sent as a bearer token.
    api_key: Option<String>,
}

impl std::fmt::Debug for GrpcReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcReconciler")
            .field("declared", &self.declared)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish_non_exhaustive()
    }
}

impl GrpcReconciler {
    /// Prepares the connection; nothing is dialled until the first lookup.
    pub fn new(
        endpoint: &str,
        api_key: Option<String>,
        timeout: Duration,
    ) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(endpoint.to_owned())?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect_lazy();
        Ok(Self {
            client: ReconcilerClient::new(channel),
            declared: OnceLock::new(),
            api_key,
        })
    }

    async fn declare(&self) -> Result<Capabilities, String> {
        if let Some(known) = self.declared.get() {
            return Ok(*known);
        }
        let answer = self
            .client
            .clone()
            .capabilities(pb::CapabilitiesRequest {})
            .await
            .map_err(|status| {
                format!(
                    "the plugin did not declare its capabilities: {}",
                    status.code()
                )
            })?
            .into_inner();
        let settle = answer.settle_time.unwrap_or_default();
        let declared = Capabilities {
            miss_is_authoritative: answer.miss_is_authoritative,
            settle_time_ms: settle
                .seconds
                .saturating_mul(1000)
                .saturating_add(i64::from(settle.nanos / 1_000_000)),
            dedupes_by_provider_key: answer.dedupes_by_provider_key,
        };
        // Two lookups may ask at once: the first declaration kept is the one every lookup reads.
        Ok(*self.declared.get_or_init(|| declared))
    }
}

#[async_trait::async_trait]
impl Reconciler for GrpcReconciler {
    fn capabilities(&self) -> Capabilities {
        self.declared.get().copied().unwrap_or(UNDECLARED)
    }

    async fn lookup(&self, request: &LookupRequest) -> Verdict {
        if let Err(why) = self.declare().await {
            return Verdict::Unknown { why };
        }
        let message = pb::LookupRequest {
            operation_id: request.operation_id.clone(),
            tool: request.tool.clone(),
            provider_key: request.provider_key.clone(),
            lookup_hints_json: request.lookup_hints.to_string(),
            attempt: request.attempt,
            attempt_started_at: Some(once_api::convert::timestamp(request.attempt_started_at_ms)),
            fencing_token: request.fencing_token,
            tenant: request.tenant.clone(),
        };
        let mut message = tonic::Request::new(message);
        if let Some(key) = &self.api_key {
            match tonic::metadata::MetadataValue::try_from(format!("Bearer {key}")) {
                Ok(mut value) => {
                    value.set_sensitive(true);
                    message.metadata_mut().insert("authorization", value);
                }
                Err(_) => {
                    return Verdict::Unknown {
                        why: "the configured credential cannot be sent as a header".into(),
                    }
                }
            }
        }
        let answer = match self.client.clone().lookup(message).await {
            Ok(answer) => answer.into_inner(),
            Err(status) => {
                return Verdict::Unknown {
                    why: format!("the plugin failed: {} {}", status.code(), status.message()),
                }
            }
        };
        match answer.verdict {
            Some(pb::lookup_response::Verdict::Confirmed(c)) if !c.provider_ref.is_empty() => {
                Verdict::Confirmed {
                    provider_ref: c.provider_ref,
                    result: c.result,
                    evidence: c.evidence_json,
                }
            }
            Some(pb::lookup_response::Verdict::Confirmed(_)) => Verdict::Unknown {
                why: "the plugin confirmed without a provider reference".into(),
            },
            Some(pb::lookup_response::Verdict::Absent(a)) => Verdict::Absent {
                evidence: a.evidence_json,
            },
            Some(pb::lookup_response::Verdict::Unknown(u)) => Verdict::Unknown { why: u.why },
            None => Verdict::Unknown {
                why: "the plugin gave no verdict".into(),
            },
        }
    }
}
