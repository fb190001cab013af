//! `http`: a generic lookup configured entirely in TOML.
//!
//! ```toml
//! [[reconciler]]
//! name = "tickets"
//! kind = "http"
//! endpoint = "https://tickets.internal"
//! url = "{endpoint}/v2/tickets?request_key={provider_key}&customer={hints.customer}"
//! found_status = [200]          # these statuses mean the effect exists…
//! not_found_status = [404]      # …these that it does not; any other status is unknown
//! provider_ref_pointer = "/id"  # JSON pointer into a found body
//! result_pointer = ""           # the part of the body to replay ("" = all of it)
//! miss_is_authoritative = true
//! dedupes_by_provider_key = true
//! settle_time = "2s"
//! api_key_env = "TICKETS_TOKEN" # sent as a bearer token
//! ```
//!
//! Placeholders: `{endpoint}`, `{operation_id}`, `{provider_key}`, `{tool}` and `{hints.NAME}`
//! for a lookup hint; values are percent-encoded. A hint the operation lacks makes the lookup
//! unknown.

use std::time::Duration;

use serde_json::{json, Value};

use crate::{Capabilities, LookupRequest, Reconciler, Verdict};

/// How an `http` reconciler finds an operation and reads the answer.
#[derive(Clone)]
pub struct HttpReconciler {
    pub endpoint: String,
    pub url: String,
    pub found_status: Vec<u16>,
    pub not_found_status: Vec<u16>,
    pub provider_ref_pointer: String,
    pub result_pointer: String,
    pub capabilities: Capabilities,
    /// Sent as a bearer token; never logged, never put in evidence.
    pub api_key: Option<String>,
    pub http: reqwest::Client,
}

impl std::fmt::Debug for HttpReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpReconciler")
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("capabilities", &self.capabilities)
            .finish()
    }
}

impl HttpReconciler {
    pub fn client(timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
        reqwest::Client::builder().timeout(timeout).build()
    }

    /// The lookup URL for `request`, or why it cannot be built.
    pub fn render(&self, request: &LookupRequest) -> Result<String, String> {
        let encode =
            |value: &str| form_urlencoded::byte_serialize(value.as_bytes()).collect::<String>();
        let mut out = String::new();
        let mut rest = self.url.as_str();
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let close = rest[open..]
                .find('}')
                .ok_or("the url template has an unclosed '{'")?
                + open;
            let name = &rest[open + 1..close];
            let value = match name {
                "endpoint" => self.endpoint.trim_end_matches('/').to_owned(),
                "operation_id" => encode(&request.operation_id),
                "provider_key" => encode(&request.provider_key),
                "tool" => encode(&request.tool),
                _ => match name.strip_prefix("hints.") {
                    Some(hint) => match &request.lookup_hints[hint] {
                        Value::String(s) => encode(s),
                        Value::Number(n) => n.to_string(),
                        _ => return Err(format!("the operation has no {hint:?} lookup hint")),
                    },
                    None => return Err(format!("unknown placeholder {{{name}}}")),
                },
            };
            out.push_str(&value);
            rest = &rest[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

#[async_trait::async_trait]
impl Reconciler for HttpReconciler {
    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    async fn lookup(&self, request: &LookupRequest) -> Verdict {
        let url = match self.render(request) {
            Ok(url) => url,
            Err(why) => return Verdict::Unknown { why },
        };
        let mut call = self.http.get(&url);
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let response = match once_telemetry::http::send(call).await {
            Ok(response) => response,
            Err(error) => {
                return Verdict::Unknown {
                    why: format!("the provider did not answer: {}", error.without_url()),
                }
            }
        };
        let status = response.status().as_u16();
        if self.not_found_status.contains(&status) {
            return Verdict::Absent {
                evidence: json!({ "status": status }).to_string(),
            };
        }
        if !self.found_status.contains(&status) {
            return Verdict::Unknown {
                why: format!("the provider answered {status}"),
            };
        }
        let Ok(body) = response.json::<Value>().await else {
            return Verdict::Unknown {
                why: "the provider's answer is not JSON".into(),
            };
        };
        let provider_ref = match body.pointer(&self.provider_ref_pointer) {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                return Verdict::Unknown {
                    why: format!(
                        "the answer has no provider reference at {:?}",
                        self.provider_ref_pointer
                    ),
                }
            }
        };
        let Some(result) = body.pointer(&self.result_pointer) else {
            return Verdict::Unknown {
                why: format!("the answer has nothing at {:?}", self.result_pointer),
            };
        };
        Verdict::Confirmed {
            evidence: json!({ "status": status, "provider_ref": provider_ref }).to_string(),
            provider_ref,
            result: result.to_string().into_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reconciler(url: &str) -> HttpReconciler {
        HttpReconciler {
            endpoint: "http://tickets.internal/".into(),
            url: url.into(),
            found_status: vec![200],
            not_found_status: vec![404],
            provider_ref_pointer: "/id".into(),
            result_pointer: String::new(),
            capabilities: Capabilities {
                miss_is_authoritative: true,
                settle_time_ms: 0,
                dedupes_by_provider_key: true,
            },
            api_key: None,
            http: reqwest::Client::new(),
        }
    }

    fn request() -> LookupRequest {
        LookupRequest {
            tenant: "default".into(),
            operation_id: "refund:a b".into(),
            tool: "issue_refund".into(),
            provider_key: "once_1".into(),
            lookup_hints: json!({"customer": "c&1", "n": 7}),
            attempt: 1,
            fencing_token: 1,
            attempt_started_at_ms: 0,
        }
    }

    #[test]
    fn templates_fill_and_encode_placeholders() {
        let url = reconciler(
            "{endpoint}/t?op={operation_id}&k={provider_key}&c={hints.customer}&n={hints.n}",
        )
        .render(&request())
        .unwrap();
        assert_eq!(
            url,
            "http://tickets.internal/t?op=refund%3Aa+b&k=once_1&c=c%261&n=7"
        );
        assert!(reconciler("{endpoint}/{hints.missing}")
            .render(&request())
            .is_err());
        assert!(reconciler("{endpoint}/{nope}").render(&request()).is_err());
        assert!(reconciler("{endpoint/x").render(&request()).is_err());
    }
}
