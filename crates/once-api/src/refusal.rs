//! A refusal as a gRPC status with its `google.rpc` details (`ErrorInfo`, and `RetryInfo` or
//! `BadRequest` when they apply), encoded in one fixed order: the same refusal is the same bytes
//! every time, metadata sorted by key. The messages below are `google.rpc`'s own, field for
//! field, so any client's rich-error decoder (tonic-types, grpcio-status, …) reads them.

use std::collections::BTreeMap;
use std::time::Duration;

use prost::Message;
use tonic::{Code, Status};

use crate::ERROR_DOMAIN;

/// `google.rpc.Status`.
#[derive(Clone, PartialEq, Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// `google.rpc.ErrorInfo`, its metadata in key order.
#[derive(Clone, PartialEq, Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
    #[prost(btree_map = "string, string", tag = "3")]
    metadata: BTreeMap<String, String>,
}

/// `google.rpc.RetryInfo`.
#[derive(Clone, PartialEq, Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<prost_types::Duration>,
}

/// `google.rpc.BadRequest`.
#[derive(Clone, PartialEq, Message)]
struct BadRequest {
    #[prost(message, repeated, tag = "1")]
    field_violations: Vec<FieldViolation>,
}

/// `google.rpc.BadRequest.FieldViolation`.
#[derive(Clone, PartialEq, Message)]
struct FieldViolation {
    #[prost(string, tag = "1")]
    field: String,
    #[prost(string, tag = "2")]
    description: String,
}

fn any(name: &str, message: &impl Message) -> prost_types::Any {
    prost_types::Any {
        type_url: format!("type.googleapis.com/google.rpc.{name}"),
        value: message.encode_to_vec(),
    }
}

/// A refusal: a status code, a stable reason clients branch on, a sentence for people, and what
/// else a client may need to act on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    code: Code,
    reason: String,
    message: String,
    metadata: BTreeMap<String, String>,
    retry_after: Option<Duration>,
    violation: Option<(String, String)>,
}

impl Refusal {
    pub fn new(code: Code, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
            message: message.into(),
            metadata: BTreeMap::new(),
            retry_after: None,
            violation: None,
        }
    }

    /// One entry of the `ErrorInfo`'s metadata.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// A `RetryInfo`: the call may be sent again after `delay`.
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// A `BadRequest` naming the field at fault.
    pub fn bad_field(mut self, field: impl Into<String>, description: impl Into<String>) -> Self {
        self.violation = Some((field.into(), description.into()));
        self
    }

    /// The status, its details in `grpc-status-details-bin`.
    pub fn into_status(self) -> Status {
        let mut details = vec![any(
            "ErrorInfo",
            &ErrorInfo {
                reason: self.reason,
                domain: ERROR_DOMAIN.to_owned(),
                metadata: self.metadata,
            },
        )];
        if let Some(delay) = self.retry_after {
            let retry_delay = prost_types::Duration {
                seconds: i64::try_from(delay.as_secs()).unwrap_or(i64::MAX),
                nanos: i32::try_from(delay.subsec_nanos()).unwrap_or(0),
            };
            details.push(any(
                "RetryInfo",
                &RetryInfo {
                    retry_delay: Some(retry_delay),
                },
            ));
        }
        if let Some((field, description)) = self.violation {
            let field_violations = vec![FieldViolation { field, description }];
            details.push(any("BadRequest", &BadRequest { field_violations }));
        }
        let status = RpcStatus {
            code: self.code as i32,
            message: self.message.clone(),
            details,
        };
        Status::with_details(self.code, self.message, status.encode_to_vec().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_types::StatusExt as _;

    #[test]
    fn the_same_refusal_is_the_same_bytes_every_time() {
        let refusal = || {
            Refusal::new(Code::PermissionDenied, "ROLE_NOT_ALLOWED", "no")
                .with("needed", "operator")
                .with("held", "reader")
                .with("tenant", "acme")
                .with("key_id", "k1")
                .into_status()
        };
        let first = refusal();
        for _ in 0..64 {
            assert_eq!(refusal().details(), first.details());
        }
    }

    #[test]
    fn a_rich_error_decoder_reads_every_detail() {
        let status = Refusal::new(Code::ResourceExhausted, "RATE_LIMITED", "slow down")
            .with("retry_after_ms", "1500")
            .retry_after(Duration::from_millis(1500))
            .bad_field("tool", "too long")
            .into_status();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "slow down");
        let details = status.get_error_details();
        let info = details.error_info().expect("an ErrorInfo");
        assert_eq!(info.reason, "RATE_LIMITED");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert_eq!(info.metadata["retry_after_ms"], "1500");
        let retry = details.retry_info().expect("a RetryInfo");
        assert_eq!(retry.retry_delay, Some(Duration::from_millis(1500)));
        let violations = &details
            .bad_request()
            .expect("a BadRequest")
            .field_violations;
        assert_eq!(violations[0].field, "tool");
        assert_eq!(violations[0].description, "too long");
    }
}
