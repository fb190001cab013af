//! The `rmcp` integration: the attempt context of an MCP request, and the tool result the
//! model should read for each outcome (MCP tool results carry no headers, so everything the
//! model must know is in the body).
//!
//! - REPLAY is never an error (an error makes a model retry): the original text, verbatim, then
//!   a marker `{"replayed": true, "operation_id": …, "original_time": …}`.
//! - IN_PROGRESS, UNKNOWN and CONFLICT are error results whose text says what happened, that the
//!   model must not retry, and which status tool to call.
//! - An unreachable ledger fails closed: the action was not performed; retrying later is safe.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rmcp::model::{CallToolResult, ContentBlock, NumberOrString, ProgressNotificationParam};
use rmcp::service::RequestContext;
use rmcp::RoleServer;
use serde_json::json;

use crate::{
    AttemptContext, ClientError, Conflict, InProgress, Outcome, Replay, Unknown,
    META_IDEMPOTENCY_KEY,
};

/// The transport facts of an MCP request, for the ledger's attempt log: the JSON-RPC request
/// id, the MCP session id (Streamable HTTP), and the client's name from its handshake.
pub fn attempt_context(ctx: &RequestContext<RoleServer>) -> AttemptContext {
    let request_id = match &ctx.id {
        NumberOrString::Number(n) => n.to_string(),
        NumberOrString::String(s) => s.to_string(),
    };
    let session_id = ctx
        .extensions
        .get::<http::request::Parts>()
        .and_then(|parts| parts.headers.get("mcp-session-id"))
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let client_name = ctx
        .peer
        .peer_info()
        .map(|info| info.client_info.name.clone())
        .filter(|name| !name.is_empty());
    AttemptContext {
        client_name,
        session_id,
        request_id: Some(request_id),
    }
}

/// The span of one `tools/call` of `tool`, as the MCP semantic conventions name it
/// (`tools/call {tool}`, kind server, `mcp.method.name`, `gen_ai.tool.name`, `mcp.session.id`,
/// `jsonrpc.request.id`), continuing the trace the client sent in the request's `_meta`
/// (`traceparent`, `tracestate`). Run the tool's work in it: the ledger calls it makes carry
/// its trace context, so one tool call is one trace from the MCP client to the ledger and the
/// provider. `once.operation_id` and `once.outcome` are left for the tool to record.
pub fn tool_span(ctx: &RequestContext<RoleServer>, tool: &str) -> tracing::Span {
    let facts = attempt_context(ctx);
    let span = tracing::info_span!(
        "tool",
        otel.name = format!("tools/call {tool}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        mcp.method.name = "tools/call",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = tool,
        mcp.session.id = facts.session_id.as_deref(),
        jsonrpc.request.id = facts.request_id.as_deref(),
        once.operation_id = tracing::field::Empty,
        once.outcome = tracing::field::Empty,
    );
    once_telemetry::propagation::continue_trace(&span, |key| {
        ctx.meta
            .get(key)
            .and_then(|value| value.as_str())
            .map(str::to_owned)
    });
    span
}

/// Records on `span` (a [`tool_span`]) how the call ended.
pub fn record_outcome(span: &tracing::Span, outcome: &Result<Outcome, ClientError>) {
    let (operation_id, name) = match outcome {
        Ok(Outcome::Executed { operation_id, .. }) => (Some(operation_id.as_str()), "EXECUTED"),
        Ok(Outcome::Replayed(replay)) => (Some(replay.operation_id.as_str()), "REPLAYED"),
        Ok(Outcome::NotPerformed { operation_id, .. }) => {
            (Some(operation_id.as_str()), "NOT_PERFORMED")
        }
        Ok(Outcome::Ambiguous { operation_id, .. }) => (Some(operation_id.as_str()), "AMBIGUOUS"),
        Ok(Outcome::Unknown(unknown)) => (Some(unknown.operation_id.as_str()), "UNKNOWN"),
        Ok(Outcome::InProgress(progress)) => (Some(progress.operation_id.as_str()), "IN_PROGRESS"),
        Ok(Outcome::Conflict(conflict)) => (Some(conflict.operation_id.as_str()), "CONFLICT"),
        Err(_) => (None, "LEDGER_FAILED"),
    };
    if let Some(id) = operation_id {
        span.record("once.operation_id", id);
    }
    span.record("once.outcome", name);
    if outcome.is_err() {
        span.record("otel.status_code", "ERROR");
    }
}

/// The explicit idempotency key a client put in the request's `_meta`, if any.
pub fn meta_idempotency_key(ctx: &RequestContext<RoleServer>) -> Option<String> {
    ctx.meta
        .get(META_IDEMPOTENCY_KEY)
        .and_then(|v| v.as_str())
        .map(str::to_owned)
}

/// Runs `work` while telling the client, once a second, that the call is still going — when
/// the client asked for progress with a progress token.
pub async fn with_progress<F: Future>(
    ctx: &RequestContext<RoleServer>,
    message: &str,
    work: F,
) -> F::Output {
    let Some(token) = ctx.meta.get_progress_token() else {
        return work.await;
    };
    let peer = ctx.peer.clone();
    tokio::pin!(work);
    let mut ticks = tokio::time::interval(Duration::from_secs(1));
    ticks.tick().await;
    let mut progress = 0.0;
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = ticks.tick() => {
                progress += 1.0;
                let note = ProgressNotificationParam::new(token.clone(), progress).with_message(message);
                if peer.notify_progress(note).await.is_err() {
                    tracing::debug!("client stopped listening for progress");
                }
            }
        }
    }
}

/// The tool result for an outcome. `status_tool` is the read-only tool the model should call
/// to follow an operation that is in progress or being verified.
pub fn tool_result(outcome: &Outcome, status_tool: &str) -> CallToolResult {
    match outcome {
        Outcome::Executed { effect, .. } => {
            CallToolResult::success(vec![ContentBlock::text(text(&effect.result))])
        }
        Outcome::Replayed(replay) => replayed(replay),
        Outcome::NotPerformed {
            operation_id,
            reason,
        } => error(format!(
            "The action was not performed: {reason}. Nothing changed (operation {operation_id}). \
             You may correct the request and try again."
        )),
        Outcome::Ambiguous { operation_id, .. }
        | Outcome::Unknown(Unknown {
            blocking_operation_id: None,
            operation_id,
            ..
        })
        | Outcome::Unknown(Unknown {
            blocking_operation_id: Some(operation_id),
            ..
        }) => error(format!(
            "The outcome of this action is being verified: it may or may not have happened. \
             Do not retry it, and do not retry it under a different id or idempotency key: that \
             could perform it twice. On-call staff have the operation id {operation_id}; call \
             {status_tool} to follow it."
        )),
        Outcome::InProgress(InProgress {
            operation_id,
            retry_after,
            blocking_operation_id,
        }) => {
            let running = blocking_operation_id.as_deref().unwrap_or(operation_id);
            error(format!(
                "This action is already in progress (operation {running}). Do not retry it, and \
                 do not retry it under a different id or idempotency key: that could perform it \
                 twice. Call {status_tool} in about {} seconds to see its result.",
                retry_after.as_secs().max(1)
            ))
        }
        Outcome::Conflict(Conflict { operation_id, .. }) => error(format!(
            "This action was already requested with different arguments (operation \
             {operation_id}), so it was not performed again. Do not retry with changed arguments \
             under the same identity; if a different action is intended, it needs a different \
             identity. Call {status_tool} to see the original request's state."
        )),
    }
}

/// The tool result when the ledger could not be consulted: fail closed.
pub fn not_performed(failure: &ClientError) -> CallToolResult {
    match failure {
        ClientError::Unreachable(_) => error_text(
            "The action was NOT performed: the operation ledger is unreachable, so it could not \
             be done safely. Nothing changed. It is safe to retry later.",
        ),
        ClientError::Refused { reason, .. } if reason == crate::LEDGER_BEHIND => error_text(
            "The action was NOT performed: the operation ledger was restored from an earlier \
             state and cannot tell yet whether this action already ran, so it grants no new \
             action until on-call staff have checked. Nothing changed. Do not try it under a \
             different identity; it is safe to retry later.",
        ),
        other => error(format!(
            "The action was NOT performed: {other}. Nothing changed."
        )),
    }
}

fn replayed(replay: &Replay) -> CallToolResult {
    CallToolResult::success(vec![
        ContentBlock::text(text(&replay.result)),
        ContentBlock::text(replay_marker(replay).to_string()),
    ])
}

/// The marker a replayed result carries after its original content, as a text block: that it
/// is a replay, of which operation, and when the original ran.
pub fn replay_marker(replay: &Replay) -> serde_json::Value {
    let original_time = replay
        .confirmed_at
        .duration_since(UNIX_EPOCH)
        .map(once_core::duration_ms)
        .unwrap_or_default();
    json!({
        "replayed": true,
        "operation_id": replay.operation_id,
        "original_time_ms": original_time,
        "original_time": rfc3339(replay.confirmed_at),
        "note": "This action had already been performed; this is its original result. It was not performed again.",
    })
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

fn error_text(message: &str) -> CallToolResult {
    error(message.to_owned())
}

fn rfc3339(time: SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(time).to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        assert_eq!(rfc3339(at(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(at(951_782_400_123)), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(at(1_796_005_265_156)), "2026-11-30T02:21:05.156Z");
    }

    #[test]
    fn a_ledger_behind_says_not_performed_and_not_to_change_the_identity() {
        let refused = ClientError::Refused {
            reason: crate::LEDGER_BEHIND.into(),
            message: "the ledger is behind what a client saw: token 1048600".into(),
        };
        let result = not_performed(&refused);
        assert_eq!(result.is_error, Some(true));
        let body = serde_json::to_value(&result).unwrap().to_string();
        assert!(body.contains("NOT performed"), "{body}");
        assert!(
            body.contains("Do not try it under a different identity"),
            "{body}"
        );
        assert!(
            !body.contains("1048600"),
            "the ledger's figures are for on-call, not the model"
        );
    }

    #[test]
    fn replays_are_successes_with_the_original_text_first() {
        let replay = Replay {
            operation_id: "refund:1".into(),
            result: br#"{"refund_id":"re_1"}"#.to_vec(),
            provider_ref: None,
            confirmed_at: UNIX_EPOCH,
            receipt: None,
        };
        let result = tool_result(&Outcome::Replayed(replay), "get_refund_status");
        assert_eq!(result.is_error, Some(false));
        let body = serde_json::to_value(&result).unwrap();
        assert_eq!(body["content"][0]["text"], r#"{"refund_id":"re_1"}"#);
        assert!(body["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains(r#""replayed":true"#));
    }

    #[test]
    fn uncertain_outcomes_say_do_not_retry_and_name_the_status_tool() {
        for outcome in [
            Outcome::InProgress(InProgress {
                operation_id: "op".into(),
                retry_after: Duration::from_secs(2),
                blocking_operation_id: None,
            }),
            Outcome::InProgress(InProgress {
                operation_id: "op-fresh".into(),
                retry_after: Duration::from_secs(2),
                blocking_operation_id: Some("op".into()),
            }),
            Outcome::Unknown(Unknown {
                operation_id: "op".into(),
                reason: "lease expired".into(),
                blocking_operation_id: None,
            }),
            Outcome::Unknown(Unknown {
                operation_id: "op-fresh".into(),
                reason: "blocked".into(),
                blocking_operation_id: Some("op".into()),
            }),
        ] {
            let result = tool_result(&outcome, "get_refund_status");
            assert_eq!(result.is_error, Some(true));
            let body = serde_json::to_value(&result).unwrap().to_string();
            assert!(
                body.contains("Do not retry") && body.contains("get_refund_status"),
                "{body}"
            );
            assert!(
                body.contains("operation op)") || body.contains("operation id op;"),
                "names the operation that holds the intent: {body}"
            );
        }
    }
}
