//! One guarded `tools/call`: named by the policy, claimed at the ledger, sent upstream only on
//! EXECUTE, reported from the upstream's answer, and answered to the client as once-client
//! renders decisions.

use std::future::Future;
use std::sync::{Arc, Mutex};

use once_client::mcp::{not_performed, replay_marker, tool_result};
use once_client::{ClientError, Effect, EffectError, LedgerClient, Outcome, Replay};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::policy::{OnError, Policy, ToolPolicy};

/// What became of a guarded request sent upstream.
#[derive(Debug)]
pub enum Upstream {
    /// The upstream answered: its JSON-RPC response, byte for byte.
    Answered(Vec<u8>),
    /// No answer will come: the upstream died, the stream dropped, the client cancelled.
    /// `reply` says whether the client still waits for an answer.
    Gone { reason: String, reply: bool },
    /// The upstream's HTTP endpoint refused the request with an error status (Streamable HTTP).
    Refused { status: u16, text: String },
}

/// What the proxy needs to guard calls.
#[derive(Debug)]
pub struct Guard {
    pub policy: Policy,
    pub ledger: LedgerClient,
}

/// How a guarded call ended for the client.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// Send this JSON-RPC response.
    Reply(Vec<u8>),
    /// Send nothing: the client cancelled the request.
    Nothing,
    /// Answer with the upstream's HTTP error status and text, as it refused the request.
    Refused { status: u16, text: String },
}

#[derive(Deserialize)]
struct Reply<'a> {
    #[serde(borrow)]
    result: Option<&'a RawValue>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
}

impl Guard {
    /// The tool a `tools/call` request names, when the policy guards it.
    pub fn guards<'m>(&self, message: &'m Value) -> Option<(&'m str, &ToolPolicy)> {
        if message.get("method").and_then(Value::as_str) != Some("tools/call") {
            return None;
        }
        message.get("id")?;
        let tool = message.pointer("/params/name").and_then(Value::as_str)?;
        self.policy.guarded(tool).map(|policy| (tool, policy))
    }

    /// Runs one guarded call. `forward` sends the request upstream (as it came, or the bytes it
    /// is given instead: the request carrying the attempt's provider key) and waits for what
    /// becomes of it; it is called only when the ledger says EXECUTE.
    pub async fn call<F, Fut>(
        &self,
        tool: &str,
        policy: &ToolPolicy,
        request: &Value,
        forward: F,
    ) -> Answer
    where
        F: FnOnce(Option<Vec<u8>>) -> Fut,
        Fut: Future<Output = Upstream>,
    {
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        let empty = Map::new();
        let params = request
            .get("params")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let spec = match policy.spec(tool, params) {
            Ok(spec) => spec,
            Err(unnamed) => {
                let failure = ClientError::Invalid(unnamed.to_string());
                return reply(&id, to_value(&not_performed(&failure)));
            }
        };
        let timeout = policy.timeout;
        let on_error = policy.on_error;
        let sink = policy.provider_key.clone();
        // The upstream's own answer, kept to pass on verbatim where the outcome allows.
        let seen: Arc<Mutex<Option<Upstream>>> = Arc::default();
        let kept = seen.clone();
        let outcome = self
            .ledger
            .run(&spec, |context| async move {
                tracing::info!(operation_id = %context.operation_id, attempt = context.attempt, tool, "forwarding a guarded call upstream");
                let carried = sink.map(|sink| {
                    sink.carry(request, &context.provider_key)
                        .to_string()
                        .into_bytes()
                });
                let upstream = match tokio::time::timeout(timeout, forward(carried)).await {
                    Ok(upstream) => upstream,
                    Err(_) => Upstream::Gone {
                        reason: format!("the upstream did not answer within {timeout:?}"),
                        reply: true,
                    },
                };
                let performed = judge(&upstream, on_error);
                *kept.lock().expect("not poisoned") = Some(upstream);
                performed
            })
            .await;
        let upstream = seen.lock().expect("not poisoned").take();
        let status = self.status_tool();
        match (outcome, upstream) {
            (_, Some(Upstream::Gone { reply: false, .. })) => Answer::Nothing,
            (Ok(Outcome::Executed { .. }), Some(Upstream::Answered(line)))
            | (Ok(Outcome::NotPerformed { .. }), Some(Upstream::Answered(line))) => {
                Answer::Reply(line)
            }
            (Ok(Outcome::NotPerformed { .. }), Some(Upstream::Refused { status, text })) => {
                Answer::Refused { status, text }
            }
            (Ok(Outcome::Replayed(replay)), _) => reply(&id, replayed(&replay)),
            (Ok(ambiguous @ Outcome::Ambiguous { .. }), Some(Upstream::Answered(line))) => {
                // The upstream's own words follow the ledger's: the model reads both.
                let mut result = to_value(&tool_result(&ambiguous, &status));
                append(&mut result, upstream_content(&line));
                reply(&id, result)
            }
            (Ok(outcome), _) => reply(&id, to_value(&tool_result(&outcome, &status))),
            (Err(failure), _) => reply(&id, to_value(&not_performed(&failure))),
        }
    }

    fn status_tool(&self) -> String {
        self.policy.status_tool.clone().unwrap_or_else(|| {
            "the same tool again with the same arguments (it will not run twice)".into()
        })
    }
}

/// What the upstream's answer means for the effect.
fn judge(upstream: &Upstream, on_error: OnError) -> Result<Effect, EffectError> {
    let failed = |why: String| match on_error {
        OnError::Absent => EffectError::NotPerformed(why),
        OnError::Unknown => EffectError::Ambiguous(why),
    };
    let line = match upstream {
        Upstream::Answered(line) => line,
        Upstream::Gone { reason, .. } => return Err(EffectError::Ambiguous(reason.clone())),
        // A client error status comes from the transport before any tool runs (no such
        // session, a malformed request, too many requests), except a request timeout; a server
        // error may come after.
        Upstream::Refused { status, text } => {
            let why = format!("the upstream refused the request with HTTP {status}: {text}");
            return Err(if (400..500).contains(status) && *status != 408 {
                EffectError::NotPerformed(why)
            } else {
                EffectError::Ambiguous(why)
            });
        }
    };
    let Ok(parsed) = serde_json::from_slice::<Reply>(line) else {
        return Err(EffectError::Ambiguous(
            "the upstream's answer is not a JSON-RPC response".into(),
        ));
    };
    match (parsed.result, parsed.error) {
        (Some(result), None) => {
            let is_error = serde_json::from_str::<Value>(result.get())
                .ok()
                .and_then(|r| r.get("isError").and_then(Value::as_bool))
                .unwrap_or(false);
            if is_error {
                Err(failed("the tool answered with an error".into()))
            } else {
                Ok(Effect::new(result.get().as_bytes().to_vec()))
            }
        }
        (None, Some(error)) => Err(failed(format!("the upstream answered {}", error.get()))),
        _ => Err(EffectError::Ambiguous(
            "the upstream's answer has neither a result nor an error".into(),
        )),
    }
}

/// A replay: the stored result as it was, its marker after its content. A result stored by a
/// reconciler (a provider's record, not a tool result) becomes the text of one block, and the
/// structured content too when it is a JSON object.
fn replayed(replay: &Replay) -> Value {
    let marker = json!({"type": "text", "text": replay_marker(replay).to_string()});
    match serde_json::from_slice::<Value>(&replay.result) {
        Ok(Value::Object(mut result)) if result.get("content").is_some_and(Value::is_array) => {
            if let Some(Value::Array(content)) = result.get_mut("content") {
                content.push(marker);
            }
            Value::Object(result)
        }
        record => {
            let mut result = json!({
                "content": [
                    {"type": "text", "text": String::from_utf8_lossy(&replay.result)},
                    marker,
                ],
                "isError": false,
            });
            if let Ok(object @ Value::Object(_)) = record {
                result["structuredContent"] = object;
            }
            result
        }
    }
}

/// The content blocks of an upstream answer: a tool result's, or an error's message.
fn upstream_content(line: &[u8]) -> Vec<Value> {
    let Ok(answer) = serde_json::from_slice::<Value>(line) else {
        return Vec::new();
    };
    if let Some(Value::Array(content)) = answer.pointer("/result/content") {
        return content.clone();
    }
    match answer.get("error") {
        Some(error) => {
            vec![json!({"type": "text", "text": format!("The upstream server answered: {error}")})]
        }
        None => Vec::new(),
    }
}

fn append(result: &mut Value, blocks: Vec<Value>) {
    if let Some(Value::Array(content)) = result.get_mut("content") {
        content.extend(blocks);
    }
}

fn to_value(result: &impl serde::Serialize) -> Value {
    serde_json::to_value(result).unwrap_or_else(|e| {
        json!({"content": [{"type": "text", "text": format!("once-proxy: {e}")}], "isError": true})
    })
}

fn reply(id: &Value, result: Value) -> Answer {
    let message = json!({"jsonrpc": "2.0", "id": id, "result": result});
    Answer::Reply(message.to_string().into_bytes())
}

/// The answer to a guarded call sent inside a JSON-RPC batch: refused, not performed.
pub fn refuse_in_batch(id: &Value) -> Vec<u8> {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {
            "code": -32600,
            "message": "once-proxy: a guarded tool cannot be called inside a batch; it was not performed. Send the call on its own.",
        },
    })
    .to_string()
    .into_bytes()
}

/// Adds the policy's note to each guarded tool's description in a `tools/list` response.
pub fn annotate(policy: &Policy, response: &mut Value) -> bool {
    let Some(Value::Array(tools)) = response.pointer_mut("/result/tools") else {
        return false;
    };
    let mut changed = false;
    for tool in tools {
        let guarded = tool
            .get("name")
            .and_then(Value::as_str)
            .is_some_and(|name| policy.guarded(name).is_some());
        if !guarded {
            continue;
        }
        let described = tool
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let note = "Guarded by once-ledger: a repeated call with the same arguments (or the same \
                    idempotency key) does not run again; it returns the original result, marked \
                    as a replay.";
        let description = if described.is_empty() {
            note.to_owned()
        } else {
            format!("{described}\n\n{note}")
        };
        tool["description"] = Value::String(description);
        changed = true;
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(value: Value) -> Upstream {
        Upstream::Answered(value.to_string().into_bytes())
    }

    #[test]
    fn a_tool_result_is_the_effect_verbatim() {
        let line = br#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}"#;
        let effect = judge(&Upstream::Answered(line.to_vec()), OnError::Unknown).unwrap();
        assert_eq!(
            effect.result,
            br#"{"content":[{"type":"text","text":"ok"}],"isError":false}"#
        );
    }

    #[test]
    fn errors_are_unknown_unless_the_policy_says_absent() {
        for upstream in [
            answered(
                json!({"jsonrpc": "2.0", "id": 1, "result": {"content": [], "isError": true}}),
            ),
            answered(
                json!({"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "boom"}}),
            ),
        ] {
            assert!(matches!(
                judge(&upstream, OnError::Unknown),
                Err(EffectError::Ambiguous(_))
            ));
            assert!(matches!(
                judge(&upstream, OnError::Absent),
                Err(EffectError::NotPerformed(_))
            ));
        }
        // No answer is never absent, whatever the policy says.
        let gone = Upstream::Gone {
            reason: "the upstream exited".into(),
            reply: true,
        };
        assert!(matches!(
            judge(&gone, OnError::Absent),
            Err(EffectError::Ambiguous(_))
        ));
    }

    #[test]
    fn a_replay_keeps_the_original_content_and_appends_the_marker() {
        let replay = Replay {
            operation_id: "op".into(),
            result: br#"{"content":[{"type":"text","text":"re_1"}],"structuredContent":{"id":"re_1"},"isError":false}"#.to_vec(),
            provider_ref: None,
            confirmed_at: std::time::UNIX_EPOCH,
        };
        let result = replayed(&replay);
        assert_eq!(result["content"][0]["text"], "re_1");
        assert_eq!(result["structuredContent"]["id"], "re_1");
        assert!(result["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains(r#""replayed":true"#));
        let reconciled = Replay {
            result: br#"{"id":"re_1","status":"succeeded"}"#.to_vec(),
            ..replay
        };
        let result = replayed(&reconciled);
        assert_eq!(
            result["content"][0]["text"],
            r#"{"id":"re_1","status":"succeeded"}"#
        );
        assert_eq!(result["isError"], false);
    }
}
