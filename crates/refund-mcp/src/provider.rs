//! The payment provider's refunds API, with every failure classified: certainly not performed,
//! or ambiguous.

use std::time::Duration;

use once_client::EffectError;
use serde_json::Value;

#[derive(Debug, Clone)]
pub struct Provider {
    base: String,
    http: reqwest::Client,
}

/// A refund the provider created.
#[derive(Debug, Clone)]
pub struct Refund {
    pub id: String,
    pub body: Value,
}

impl Provider {
    pub fn new(base: &str, timeout: Duration) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            http,
        })
    }

    /// `POST /v1/refunds` with the operation's provider key as `Idempotency-Key` and in the
    /// refund's metadata, where reconcilers look for it (with the operation id, for people).
    pub async fn refund(
        &self,
        payment_intent: &str,
        amount_cents: i64,
        currency: &str,
        idempotency_key: &str,
        operation_id: &str,
    ) -> Result<Refund, EffectError> {
        let amount = amount_cents.to_string();
        let form = [
            ("payment_intent", payment_intent),
            ("amount", amount.as_str()),
            ("currency", currency),
            ("metadata[once_provider_key]", idempotency_key),
            ("metadata[once_operation_id]", operation_id),
        ];
        let request = self
            .http
            .post(format!("{}/v1/refunds", self.base))
            .header("Idempotency-Key", idempotency_key)
            .form(&form);
        let response = once_telemetry::http::send(request).await.map_err(|error| {
            if error.is_connect() {
                // The request never left: nothing can have happened.
                EffectError::NotPerformed(format!("the payment provider is unreachable: {error}"))
            } else {
                EffectError::Ambiguous(format!("no answer from the payment provider: {error}"))
            }
        })?;
        let status = response.status();
        let body: Value = response.json().await.map_err(|error| {
            EffectError::Ambiguous(format!(
                "unreadable answer from the payment provider ({status}): {error}"
            ))
        })?;
        let message = body["error"]["message"]
            .as_str()
            .unwrap_or("no message")
            .to_owned();
        match status.as_u16() {
            200..=299 => Ok(Refund {
                id: body["id"].as_str().unwrap_or_default().to_owned(),
                body,
            }),
            // Another request with our key is executing: that can only be an earlier attempt.
            409 => Err(EffectError::Ambiguous(format!(
                "the provider is still executing an earlier attempt: {message}"
            ))),
            // A definitive refusal: validation, authorisation, rate limiting. Nothing happened.
            400..=499 => Err(EffectError::NotPerformed(format!(
                "the payment provider refused the refund: {message}"
            ))),
            _ => Err(EffectError::Ambiguous(format!(
                "the payment provider failed after receiving the refund ({status}): {message}"
            ))),
        }
    }
}
