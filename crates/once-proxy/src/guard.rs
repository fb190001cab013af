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

/// What the proxy does with one message from the client.
#[derive(Debug)]
pub enum Seen<'m, 'p> {
    /// A `tools/call` request of a guarded tool.
    Guarded(&'m str, &'p ToolPolicy),
    /// A message that might reach a guarded tool past the ledger: answered with an error (a
    /// request) or dropped (a notification), never forwarded.
    Refused(&'static str),
    /// Everything else: forwarded untouched.
    Passed,
}

/// The keys whose spelling decides where a message goes, at the top and in `params`.
const TOP_KEYS: [&str; 4] = ["jsonrpc", "id", "method", "params"];
const PARAM_KEYS: [&str; 3] = ["name", "arguments", "_meta"];

/// Whether `object` has a key that is one of `keys` in another case: a lenient decoder (Go's,
/// which matches names case-insensitively) may read it where this proxy does not.
fn respelled(object: &Map<String, Value>, keys: &[&str]) -> bool {
    object.keys().any(|key| {
        keys.iter()
            .any(|canonical| key.eq_ignore_ascii_case(canonical) && key != canonical)
    })
}

/// Whether bytes the proxy cannot parse might still be a tool call to some other parser.
pub fn may_call_a_tool(raw: &[u8]) -> bool {
    raw.windows(b"tools/call".len())
        .any(|w| w.eq_ignore_ascii_case(b"tools/call"))
}

impl Guard {
    /// What to do with `message`. Fails closed: a message that a more lenient reader could take
    /// for a guarded call is refused rather than forwarded.
    pub fn inspect<'m>(&self, message: &'m Value) -> Seen<'m, '_> {
        let top = match message {
            Value::Array(batch) => {
                return if batch
                    .iter()
                    .any(|m| !matches!(self.inspect(m), Seen::Passed))
                {
                    Seen::Refused(
                        "a batch may not carry a guarded tool call; nothing in it was performed. \
                         Send the call on its own",
                    )
                } else {
                    Seen::Passed
                };
            }
            Value::Object(top) => top,
            _ => return Seen::Passed,
        };
        let calls = |value: &Value| {
            value
                .as_str()
                .is_some_and(|m| m.eq_ignore_ascii_case("tools/call"))
        };
        let method = top.get("method");
        if respelled(top, &TOP_KEYS) {
            let any_call = top
                .iter()
                .any(|(key, value)| key.eq_ignore_ascii_case("method") && calls(value));
            return if any_call {
                Seen::Refused("a tool call's keys must be spelled as MCP spells them")
            } else {
                Seen::Passed
            };
        }
        if !method.is_some_and(calls) {
            return Seen::Passed;
        }
        let Some(Value::Object(params)) = top.get("params") else {
            return Seen::Passed;
        };
        if respelled(params, &PARAM_KEYS) {
            return Seen::Refused("a tool call's keys must be spelled as MCP spells them");
        }
        let Some(tool) = params.get("name").and_then(Value::as_str) else {
            return Seen::Passed;
        };
        let Some(policy) = self.policy.guarded(tool) else {
            return Seen::Passed;
        };
        if method != Some(&Value::String("tools/call".into())) {
            return Seen::Refused("a guarded tool is called with the method spelled tools/call");
        }
        match top.get("id") {
            Some(Value::String(_) | Value::Number(_)) => Seen::Guarded(tool, policy),
            _ => Seen::Refused("a guarded tool call must be a request with a string or number id"),
        }
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
        // Only errors raised before a tool runs (a malformed request, no such method or tool,
        // invalid arguments) may mean ABSENT; any other (an internal error, a cancelled call)
        // may come after the effect.
        (None, Some(error)) => {
            let why = format!("the upstream answered {}", error.get());
            let code = serde_json::from_str::<Value>(error.get())
                .ok()
                .and_then(|e| e.get("code").and_then(Value::as_i64));
            match code {
                Some(-32602..=-32600) => Err(failed(why)),
                _ => Err(EffectError::Ambiguous(why)),
            }
        }
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

/// The answer to a refused message: an error for each request in it (one, or a batch's), or
/// nothing when it holds only notifications.
pub fn refusal(message: &Value, why: &str) -> Option<Vec<u8>> {
    let error = |id: &Value| {
        json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": {"code": -32600, "message": format!("once-proxy: {why}; it was not performed.")},
        })
    };
    let requested = |m: &Value| m.get("id").filter(|id| !id.is_null()).cloned();
    let answer = match message {
        Value::Array(batch) => {
            let errors: Vec<Value> = batch
                .iter()
                .filter_map(requested)
                .map(|id| error(&id))
                .collect();
            (!errors.is_empty()).then_some(Value::Array(errors))
        }
        single => requested(single).map(|id| error(&id)),
    };
    if answer.is_none() {
        tracing::warn!(why, "a refused notification is dropped");
    }
    answer.map(|a| a.to_string().into_bytes())
}

/// The answer to bytes that might be a tool call but cannot be parsed.
pub fn unparseable() -> Vec<u8> {
    json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": -32700, "message": "once-proxy: a message that may call a tool cannot be parsed; it was not forwarded."},
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
                json!({"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "bad arguments"}}),
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

    fn guard() -> Guard {
        let policy = Policy::parse("[tools.refund]\n").unwrap();
        let ledger =
            LedgerClient::connect(once_client::ClientConfig::new("http://127.0.0.1:1")).unwrap();
        Guard { policy, ledger }
    }

    #[tokio::test]
    async fn messages_a_lenient_reader_could_take_for_a_guarded_call_are_refused() {
        let guard = guard();
        let seen = |m: Value| match guard.inspect(&m) {
            Seen::Guarded(..) => "guarded",
            Seen::Refused(_) => "refused",
            Seen::Passed => "passed",
        };
        let call = |extra: Value| {
            let mut m = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "refund", "arguments": {}}});
            for (k, v) in extra.as_object().unwrap() {
                m[k] = v.clone();
            }
            m
        };
        assert_eq!(seen(call(json!({}))), "guarded");
        assert_eq!(seen(call(json!({"id": "a"}))), "guarded");
        assert_eq!(
            seen(
                json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "lookup"}})
            ),
            "passed"
        );
        // Case variants of the keys that route a message.
        assert_eq!(seen(call(json!({"Method": "tools/call"}))), "refused");
        assert_eq!(
            seen(
                json!({"jsonrpc": "2.0", "ID": 1, "method": "tools/call", "params": {"name": "refund"}})
            ),
            "refused"
        );
        assert_eq!(
            seen(
                json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "lookup", "Name": "refund"}})
            ),
            "refused"
        );
        assert_eq!(
            seen(
                json!({"jsonrpc": "2.0", "id": 1, "method": "Tools/Call", "params": {"name": "refund"}})
            ),
            "refused"
        );
        // No id, or a null or object id: not a request the proxy can answer and report.
        assert_eq!(
            seen(json!({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "refund"}})),
            "refused"
        );
        assert_eq!(seen(call(json!({"id": null}))), "refused");
        // A batch with a guarded call in it is refused whole; one without passes.
        assert_eq!(
            seen(json!([call(json!({})), {"jsonrpc": "2.0", "id": 2, "method": "ping"}])),
            "refused"
        );
        assert_eq!(
            seen(json!([{"jsonrpc": "2.0", "id": 2, "method": "ping"}])),
            "passed"
        );
        assert!(may_call_a_tool(b"{\"method\": \"TOOLS/CALL\", oops"));
        assert!(!may_call_a_tool(b"{\"method\": \"ping\""));
    }

    #[test]
    fn a_refused_batch_answers_each_request_in_it() {
        let batch = json!([
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "refund"}},
            {"jsonrpc": "2.0", "method": "notifications/progress"},
            {"jsonrpc": "2.0", "id": "b", "method": "tools/list"},
        ]);
        let answer: Value = serde_json::from_slice(&refusal(&batch, "no").unwrap()).unwrap();
        let ids: Vec<&Value> = answer
            .as_array()
            .unwrap()
            .iter()
            .map(|a| &a["id"])
            .collect();
        assert_eq!(ids, [&json!(1), &json!("b")]);
        assert!(refusal(&json!({"jsonrpc": "2.0", "method": "tools/call"}), "no").is_none());
    }

    #[test]
    fn only_errors_raised_before_a_tool_runs_may_be_absent() {
        for (code, absent) in [
            (-32600, true),
            (-32601, true),
            (-32602, true),
            (-32603, false),
            (0, false),
            (-32001, false),
        ] {
            let upstream = answered(
                json!({"jsonrpc": "2.0", "id": 1, "error": {"code": code, "message": "x"}}),
            );
            let judged = judge(&upstream, OnError::Absent);
            assert_eq!(
                matches!(judged, Err(EffectError::NotPerformed(_))),
                absent,
                "code {code}: {judged:?}"
            );
        }
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
