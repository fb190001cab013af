//! The MCP tools: `issue_refund` (destructive, guarded by the ledger) and `get_refund_status`.

use once_client::mcp;
use once_client::{ClientError, Effect, LedgerClient, OperationSpec, State};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{schemars, tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler};
use serde_json::json;
use tracing::Instrument as _;

use crate::provider::Provider;
use crate::Args;

/// The status tool the model is told to call instead of retrying.
const STATUS_TOOL: &str = "get_refund_status";

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct IssueRefund {
    /// The order to refund.
    pub order_id: String,
    /// Amount in the currency's minor unit (cents).
    pub amount_cents: i64,
    /// Three-letter ISO currency code, e.g. "eur".
    pub currency: String,
    /// Optional: a key naming this refund request. Two requests with different keys are two
    /// refunds; without a key, an order is refunded at most once.
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct RefundStatus {
    /// The order whose refund to look up.
    pub order_id: String,
    /// The idempotency key the refund was requested with, if any.
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Clone)]
pub struct RefundServer {
    ledger: LedgerClient,
    provider: Provider,
    args: Args,
}

impl RefundServer {
    pub fn new(ledger: LedgerClient, provider: Provider, args: &Args) -> Self {
        Self {
            ledger,
            provider,
            args: args.clone(),
        }
    }

    /// The refund of `order_id`, named by its intent, or by `key` when the caller gave one.
    fn named(&self, order_id: &str, key: Option<&str>) -> OperationSpec {
        OperationSpec::new("issue_refund", serde_json::Value::Null)
            .intent(["refund", order_id])
            .explicit_key(key)
    }

    /// The operation a refund request is: once per order, unless the caller names it with a key.
    fn operation(
        &self,
        order_id: &str,
        amount_cents: i64,
        currency: &str,
        key: Option<&str>,
    ) -> OperationSpec {
        let mut spec = self.named(order_id, key);
        spec.arguments = json!({ "order_id": order_id, "amount_cents": amount_cents, "currency": currency.to_lowercase() });
        spec.provider(
            "stripe",
            json!({ "payment_intent": payment_intent(order_id) }),
        )
        .lease_ttl(self.args.lease_ttl)
        .wait(self.args.wait)
    }
}

fn payment_intent(order_id: &str) -> String {
    format!("pi_{order_id}")
}

#[tool_router]
impl RefundServer {
    #[tool(
        description = "Refund an order through the payment provider. Runs at most once per order \
                       (or per idempotency_key): calling it again returns the original refund.",
        annotations(
            destructive_hint = true,
            idempotent_hint = true,
            read_only_hint = false,
            open_world_hint = true
        )
    )]
    async fn issue_refund(
        &self,
        Parameters(request): Parameters<IssueRefund>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let span = mcp::tool_span(&ctx, "issue_refund");
        let key = request
            .idempotency_key
            .clone()
            .or_else(|| mcp::meta_idempotency_key(&ctx));
        let spec = self
            .operation(
                &request.order_id,
                request.amount_cents,
                &request.currency,
                key.as_deref(),
            )
            .context(mcp::attempt_context(&ctx));
        let provider = self.provider.clone();
        let run = self.ledger.run(&spec, |attempt| async move {
            let refund = provider
                .refund(
                    &payment_intent(&request.order_id),
                    request.amount_cents,
                    &request.currency,
                    &attempt.provider_key,
                    &attempt.operation_id,
                )
                .await?;
            let result = json!({
                "refund_id": refund.id,
                "order_id": request.order_id,
                "amount_cents": refund.body["amount"],
                "currency": refund.body["currency"],
                "status": refund.body["status"],
                "operation_id": attempt.operation_id,
            });
            Ok(Effect::new(result.to_string().into_bytes()).with_provider_ref(refund.id))
        });
        let outcome = mcp::with_progress(&ctx, "refund in progress", run)
            .instrument(span.clone())
            .await;
        mcp::record_outcome(&span, &outcome);
        Ok(match outcome {
            Ok(outcome) => mcp::tool_result(&outcome, STATUS_TOOL),
            Err(error) => {
                tracing::warn!(%error, "ledger call failed; the refund was not performed");
                mcp::not_performed(&error)
            }
        })
    }

    #[tool(
        description = "Look up what the refund ledger knows about an order's refund: not requested, \
                       in progress, refunded (with the refund), not performed, or being verified.",
        annotations(read_only_hint = true)
    )]
    async fn get_refund_status(
        &self,
        Parameters(request): Parameters<RefundStatus>,
    ) -> Result<CallToolResult, ErrorData> {
        let operation_id = self
            .named(&request.order_id, request.idempotency_key.as_deref())
            .operation_id()
            .map_err(|e| ErrorData::invalid_params(e.to_string(), None))?;
        let body = match self.ledger.get(&operation_id).await {
            Ok(found) => {
                let result: serde_json::Value = found
                    .result
                    .and_then(|r| serde_json::from_slice(&r).ok())
                    .unwrap_or(serde_json::Value::Null);
                // Where each attempt came from: tells a model retry from a client replay.
                let attempts: Vec<serde_json::Value> = found
                    .attempts
                    .iter()
                    .map(|a| {
                        json!({
                            "attempt": a.number,
                            "client": a.context.client_name,
                            "session_id": a.context.session_id,
                            "request_id": a.context.request_id,
                        })
                    })
                    .collect();
                // The ledger's signed receipt of a settled refund: proof to keep, verifiable
                // with the ledger's public key alone (`oncectl receipt verify`).
                let receipt = match found.state {
                    State::Confirmed | State::Absent => {
                        match self.ledger.receipt(&operation_id).await {
                            Ok(receipt) => Some(receipt),
                            Err(error) => {
                                tracing::debug!(%error, "no receipt for the status");
                                None
                            }
                        }
                    }
                    _ => None,
                };
                let mut body = json!({
                    "order_id": request.order_id,
                    "operation_id": operation_id,
                    "state": found.state.as_str(),
                    "refund": result,
                    "reason": found.reason,
                    "attempts": attempts,
                });
                if let Some(receipt) = receipt {
                    body["receipt"] = receipt.into();
                }
                body
            }
            Err(ClientError::NotFound) => json!({
                "order_id": request.order_id,
                "operation_id": operation_id,
                "state": "NOT_REQUESTED",
            }),
            Err(error) => return Ok(mcp::not_performed(&error)),
        };
        Ok(CallToolResult::success(vec![ContentBlock::text(
            body.to_string(),
        )]))
    }
}

#[tool_handler]
impl ServerHandler for RefundServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::from_build_env())
            .with_instructions(
            "Refunds orders at most once. If a refund's outcome is in progress or being verified, do not \
             retry it: call get_refund_status.",
        )
    }
}
