//! `stripe`: finds an operation's refund in a Stripe-like refunds API.
//!
//! Lists the refunds of the payment intent named in the lookup hints (`payment_intent`), reading
//! every page, and matches the provider key the executor put in the refund's metadata
//! (`metadata.once_provider_key`; it is also the refund's `Idempotency-Key`). The provider key
//! names this life of the operation: an operation id is the same in every life (and may be in
//! other tenants), so it never attributes a refund. One match confirms; no match on a complete
//! listing is a miss; anything else — an error, a partial listing, several matches, a refund
//! that names the operation but carries no provider key — is unknown.

use std::time::Duration;

use serde_json::{json, Value};

use crate::{Capabilities, LookupRequest, Reconciler, Verdict};

/// The metadata key executors set to the operation's provider key.
pub const PROVIDER_KEY_METADATA: &str = "once_provider_key";
/// The metadata key executors set to the operation id, for people reading the provider's records.
pub const OPERATION_ID_METADATA: &str = "once_operation_id";
/// Refunds per page requested.
const PAGE_SIZE: usize = 100;
/// Pages read before giving up as unknown.
const MAX_PAGES: usize = 50;

#[derive(Clone)]
pub struct StripeReconciler {
    base: String,
    /// Sent as a bearer token; never logged, never put in evidence.
    api_key: Option<String>,
    settle_time: Duration,
    http: reqwest::Client,
}

impl std::fmt::Debug for StripeReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeReconciler")
            .field("base", &self.base)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("settle_time", &self.settle_time)
            .finish()
    }
}

impl StripeReconciler {
    pub fn new(
        base: &str,
        api_key: Option<String>,
        settle_time: Duration,
        timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            api_key,
            settle_time,
            http: reqwest::Client::builder().timeout(timeout).build()?,
        })
    }

    async fn page(&self, payment_intent: &str, after: Option<&str>) -> Result<Value, String> {
        let mut query = vec![
            ("payment_intent", payment_intent.to_owned()),
            ("limit", PAGE_SIZE.to_string()),
        ];
        if let Some(after) = after {
            query.push(("starting_after", after.to_owned()));
        }
        let mut request = self
            .http
            .get(format!("{}/v1/refunds", self.base))
            .query(&query);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = once_telemetry::http::send(request)
            .await
            .map_err(|e| format!("the provider did not answer: {}", e.without_url()))?;
        let status = response.status();
        match status.as_u16() {
            200 => response
                .json()
                .await
                .map_err(|_| "the provider's list could not be read".to_owned()),
            401 | 403 => Err(format!("the provider refused our credentials ({status})")),
            429 => Err("the provider is rate limiting lookups".to_owned()),
            _ => Err(format!("the provider answered {status}")),
        }
    }
}

#[async_trait::async_trait]
impl Reconciler for StripeReconciler {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // A complete listing of the payment's refunds is the provider's own record.
            miss_is_authoritative: true,
            settle_time_ms: once_core::duration_ms(self.settle_time),
            // Stripe replays a request with the same Idempotency-Key instead of repeating it.
            dedupes_by_provider_key: true,
        }
    }

    async fn lookup(&self, request: &LookupRequest) -> Verdict {
        let Some(payment_intent) = request
            .lookup_hints
            .get("payment_intent")
            .and_then(Value::as_str)
        else {
            return Verdict::Unknown {
                why: "the operation has no payment_intent lookup hint".into(),
            };
        };
        let mut matches = Vec::new();
        // Refunds that name the operation but not a life: they cannot be attributed.
        let mut unattributed = 0;
        let mut after: Option<String> = None;
        let mut pages = 0;
        loop {
            pages += 1;
            let page = match self.page(payment_intent, after.as_deref()).await {
                Ok(page) => page,
                Err(why) if pages > 1 => {
                    return Verdict::Unknown {
                        why: format!("partial listing after {} pages: {why}", pages - 1),
                    }
                }
                Err(why) => return Verdict::Unknown { why },
            };
            let Some(data) = page["data"].as_array() else {
                return Verdict::Unknown {
                    why: "the provider's list has no data".into(),
                };
            };
            for refund in data {
                let metadata = &refund["metadata"];
                if metadata[PROVIDER_KEY_METADATA] == request.provider_key.as_str() {
                    matches.push(refund.clone());
                } else if metadata[PROVIDER_KEY_METADATA].is_null()
                    && metadata[OPERATION_ID_METADATA] == request.operation_id.as_str()
                {
                    unattributed += 1;
                }
            }
            let has_more = page["has_more"].as_bool().unwrap_or(false);
            after = data
                .last()
                .and_then(|r| r["id"].as_str())
                .map(str::to_owned);
            if !has_more {
                break;
            }
            if pages >= MAX_PAGES || after.is_none() {
                return Verdict::Unknown {
                    why: format!("the listing did not end after {pages} pages"),
                };
            }
        }
        match matches.as_slice() {
            [] if unattributed > 0 => Verdict::Unknown {
                why: format!(
                    "{unattributed} refunds name this operation id but carry no provider key, so none can be attributed to this life of it"
                ),
            },
            [] => Verdict::Absent {
                evidence: json!({ "payment_intent": payment_intent, "pages": pages, "matched": 0 })
                    .to_string(),
            },
            [refund] => {
                let id = refund["id"].as_str().unwrap_or_default().to_owned();
                Verdict::Confirmed {
                    evidence: json!({ "payment_intent": payment_intent, "refund": id, "status": refund["status"], "pages": pages }).to_string(),
                    provider_ref: id,
                    result: refund.to_string().into_bytes(),
                }
            }
            several => Verdict::Unknown {
                why: format!("{} refunds carry this provider key", several.len()),
            },
        }
    }
}
