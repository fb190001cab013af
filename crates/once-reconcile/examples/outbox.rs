//! A small reconciler, as a plugin author writes one: it looks up messages a mail provider has
//! accepted, by the idempotency key the executor sent with each. Run its test with
//! `cargo test -p once-reconcile --example outbox`.

use std::collections::HashMap;
use std::sync::Mutex;

use once_reconcile::{Capabilities, LookupRequest, Reconciler, Verdict};
use serde_json::json;

/// Stands for the provider's API: accepted messages by idempotency key.
#[derive(Debug, Default)]
pub struct Outbox {
    accepted: Mutex<HashMap<String, String>>,
    /// Set when the provider's API is down.
    unavailable: Mutex<bool>,
}

#[async_trait::async_trait]
impl Reconciler for Outbox {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // The provider's record by key is complete…
            miss_is_authoritative: true,
            // …thirty seconds after a send at the latest…
            settle_time_ms: 30_000,
            // …and a resend with the same key is not sent twice.
            dedupes_by_provider_key: true,
        }
    }

    async fn lookup(&self, request: &LookupRequest) -> Verdict {
        if *self.unavailable.lock().unwrap() {
            // Never `Absent` when the provider could not be asked.
            return Verdict::Unknown {
                why: "the outbox API is down".into(),
            };
        }
        match self.accepted.lock().unwrap().get(&request.provider_key) {
            Some(message_id) => Verdict::Confirmed {
                provider_ref: message_id.clone(),
                result: json!({ "message_id": message_id, "status": "accepted" })
                    .to_string()
                    .into_bytes(),
                // Evidence is stored with the event: no message bodies, no addresses.
                evidence: json!({ "message_id": message_id }).to_string(),
            },
            None => Verdict::Absent {
                evidence: json!({ "looked_up": "provider_key", "found": 0 }).to_string(),
            },
        }
    }
}

fn main() {
    println!("a reconciler is a library: see the test below and docs/reconcilers.md");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(key: &str) -> LookupRequest {
        LookupRequest {
            tenant: "default".into(),
            operation_id: "send:welcome:c-9".into(),
            tool: "send_email".into(),
            provider_key: key.into(),
            lookup_hints: json!({}),
            attempt: 1,
            fencing_token: 1,
            attempt_started_at_ms: 0,
        }
    }

    #[tokio::test]
    async fn verdicts() {
        let outbox = Outbox::default();
        outbox
            .accepted
            .lock()
            .unwrap()
            .insert("once_k1".into(), "msg_1".into());
        assert!(
            matches!(outbox.lookup(&request("once_k1")).await, Verdict::Confirmed { ref provider_ref, .. } if provider_ref == "msg_1")
        );
        assert!(matches!(
            outbox.lookup(&request("once_k2")).await,
            Verdict::Absent { .. }
        ));
        *outbox.unavailable.lock().unwrap() = true;
        assert!(matches!(
            outbox.lookup(&request("once_k1")).await,
            Verdict::Unknown { .. }
        ));
    }
}
