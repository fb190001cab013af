//! One guarded `tools/call`: judged, named by the policy, claimed at the ledger, sent upstream
//! only on EXECUTE, reported from the upstream's answer, and answered to the client as
//! once-client renders decisions.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use once_client::mcp::{not_performed, replay_marker, tool_result};
use once_client::{ClientError, Effect, EffectError, LedgerClient, Outcome, Replay};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::message::{looks, Json};
use crate::policy::{OnError, Policy, ToolPolicy};

/// The prefix of every id and progress token the proxy makes for the upstream. A client
/// message naming one is refused: the proxy's ids are its own.
pub const RESERVED: &str = "once-proxy:";

/// What became of a guarded request sent upstream.
#[derive(Debug)]
pub enum Upstream {
    /// The upstream answered the proxy's id: its JSON-RPC response, byte for byte.
    Answered(Vec<u8>),
    /// No answer will come: the upstream died, the stream dropped, the client cancelled.
    /// `reply` says whether the client still waits for an answer.
    Gone { reason: String, reply: bool },
    /// The upstream's HTTP endpoint answered with an error status (Streamable HTTP).
    Refused { status: u16, text: String },
    /// The client cancelled the call before it was sent: nothing reached the upstream.
    Unsent,
    /// The request could not be sent (the upstream had ended, its connection could not be
    /// made): nothing reached it.
    Unreached(String),
}

/// What the upstream's tool listings said of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// No listing seen names it.
    Unseen,
    /// Listed without an `outputSchema`.
    Plain,
    /// Listed with an `outputSchema`, which the server validates after the tool has run.
    Validated,
}

/// What the proxy needs to guard calls.
#[derive(Debug)]
pub struct Guard {
    pub policy: Policy,
    pub ledger: LedgerClient,
    /// What the upstream's listings said of each tool, learned from every `tools/list` answer.
    listed: Mutex<HashMap<String, Listed>>,
    /// The `inputSchema` of each guarded tool, as the latest listing gave it.
    inputs: Mutex<HashMap<String, Value>>,
    /// Guarded calls by tool and how each ended ([`CALL_OUTCOMES`]).
    calls: opentelemetry::metrics::Counter<u64>,
}

/// How a guarded call ends, as `once_proxy_guarded_calls_total` counts it: forwarded and
/// `executed`, `not_performed` or `ambiguous` (UNKNOWN); answered by the ledger without
/// forwarding, `replayed`, `in_progress`, `unknown` or `conflict`; or `refused`: not forwarded
/// because the ledger could not be reached or refused the proxy, or the policy cannot name it.
pub const CALL_OUTCOMES: [&str; 8] = [
    "executed",
    "not_performed",
    "ambiguous",
    "replayed",
    "in_progress",
    "unknown",
    "conflict",
    "refused",
];

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
pub enum Seen<'p> {
    /// A `tools/call` request of a guarded tool.
    Guarded(String, &'p ToolPolicy),
    /// A message that some reader downstream might take for something the proxy did not judge:
    /// answered with an error (a request) or dropped (a notification), never forwarded.
    Refused(String),
    /// Everything else: forwarded, re-serialised.
    Passed,
}

/// The names the proxy reads at each level of a message. A name that is not one of these but
/// looks like one to a careless reader ([`looks`]) is refused wherever it appears at that level.
const TOP_KEYS: [&str; 6] = ["jsonrpc", "id", "method", "params", "result", "error"];
const PARAM_KEYS: [&str; 7] = [
    "name",
    "arguments",
    "_meta",
    "requestId",
    "progressToken",
    "idempotencyKey",
    TASK,
];
const META_KEYS: [&str; 3] = [
    "progressToken",
    crate::policy::META_PROVIDER_KEY,
    once_client::META_IDEMPOTENCY_KEY,
];
const TOOLS_CALL: &str = "tools/call";
/// The member of a request's params that asks for it to run as a task (MCP 2025-11-25).
const TASK: &str = "task";

/// The most messages one batch may carry (the TypeScript SDK's own limit): a batch is judged
/// and its ids checked as a whole, so its size is bounded.
pub const MAX_BATCH: usize = 100;

/// The first member of `object` whose name looks like one of `names` without being it.
fn lookalike(object: &Json, names: &[&str]) -> Option<String> {
    let mut folded: Option<Vec<String>> = None;
    object.members().iter().find_map(|(key, _)| {
        if names.contains(&key.as_str()) {
            return None;
        }
        let seen = looks(key);
        let folded = folded.get_or_insert_with(|| names.iter().map(|n| looks(n)).collect());
        names
            .iter()
            .zip(folded.iter())
            .find(|(_, name)| **name == seen)
            .map(|(name, _)| {
                format!(
                    "the name {key:?} is not {name:?}, but a lenient reader takes it for it; \
                     spell it as MCP does"
                )
            })
    })
}

/// Whether `value` is an id or token a client may not use: one of the proxy's own.
fn reserved(value: Option<&Json>) -> bool {
    value
        .and_then(Json::as_str)
        .is_some_and(|s| s.starts_with(RESERVED))
}

impl Guard {
    pub fn new(policy: Policy, ledger: LedgerClient) -> Self {
        let calls = once_telemetry::meter()
            .u64_counter("once_proxy.guarded_calls")
            .with_description("Guarded calls, by tool and how each ended")
            .build();
        // Every series exists from the start, at 0, so a rule sees the first of each.
        for tool in policy.tools.keys() {
            for outcome in CALL_OUTCOMES {
                calls.add(0, &Self::labels(tool, outcome));
            }
        }
        Self {
            policy,
            ledger,
            listed: Mutex::default(),
            inputs: Mutex::default(),
            calls,
        }
    }

    fn labels(tool: &str, outcome: &'static str) -> [opentelemetry::KeyValue; 2] {
        [
            opentelemetry::KeyValue::new("tool", tool.to_owned()),
            opentelemetry::KeyValue::new("outcome", outcome),
        ]
    }

    /// Counts a guarded call of `tool` that ended as `outcome`.
    fn ended(&self, tool: &str, outcome: &'static str) {
        self.calls.add(1, &Self::labels(tool, outcome));
    }

    /// What to do with `message`. Fails closed: a message that another reader could take for a
    /// call the proxy did not judge as one is refused rather than forwarded.
    pub fn inspect(&self, message: &Json) -> Seen<'_> {
        match message {
            Json::Array(batch) if batch.is_empty() => Seen::Refused("an empty batch".into()),
            Json::Array(batch) if batch.len() > MAX_BATCH => {
                Seen::Refused(format!("a batch of more than {MAX_BATCH} messages"))
            }
            Json::Array(batch) => {
                if batch.iter().any(|m| matches!(m, Json::Array(_))) {
                    return Seen::Refused("a batch inside a batch".into());
                }
                match batch
                    .iter()
                    .map(|m| self.inspect(m))
                    .find_map(|seen| match seen {
                        Seen::Passed => None,
                        Seen::Guarded(..) => Some(
                            "a batch may not carry a guarded tool call; send the call on its own"
                                .to_owned(),
                        ),
                        Seen::Refused(why) => Some(why),
                    }) {
                    Some(why) => Seen::Refused(why),
                    None => Seen::Passed,
                }
            }
            Json::Object(_) => self.inspect_one(message),
            _ => Seen::Refused("a JSON-RPC message is an object, or a batch of them".into()),
        }
    }

    fn inspect_one(&self, message: &Json) -> Seen<'_> {
        if let Some(why) = lookalike(message, &TOP_KEYS) {
            return Seen::Refused(why);
        }
        let params = message.get("params");
        for (object, names) in [
            (params, &PARAM_KEYS[..]),
            (params.and_then(|p| p.get("_meta")), &META_KEYS[..]),
        ] {
            if let Some(why) = object.and_then(|o| lookalike(o, names)) {
                return Seen::Refused(why);
            }
        }
        let meta = params.and_then(|p| p.get("_meta"));
        if reserved(message.get("id"))
            || reserved(params.and_then(|p| p.get("requestId")))
            || reserved(meta.and_then(|m| m.get("progressToken")))
        {
            return Seen::Refused(format!(
                "ids and progress tokens beginning {RESERVED:?} are the proxy's own"
            ));
        }
        let Some(method) = message.get("method") else {
            return Seen::Passed;
        };
        if message.get("result").is_some() || message.get("error").is_some() {
            return Seen::Refused("a message is a request or a response, not both".into());
        }
        let Some(method) = method.as_str() else {
            return Seen::Passed;
        };
        if method != TOOLS_CALL {
            return if looks(method) == TOOLS_CALL {
                Seen::Refused(format!(
                    "the method {method:?} is not \"tools/call\", but a lenient reader takes it \
                     for it"
                ))
            } else {
                Seen::Passed
            };
        }
        if message.get("jsonrpc").and_then(Json::as_str) != Some("2.0") {
            return Seen::Refused(
                "a tool call is a JSON-RPC 2.0 request (\"jsonrpc\": \"2.0\")".into(),
            );
        }
        let Some(Json::Object(_)) = params else {
            return Seen::Refused("a tool call's params are an object".into());
        };
        let Some(tool) = params.and_then(|p| p.get("name")).and_then(Json::as_str) else {
            return Seen::Refused("a tool call names its tool with a string".into());
        };
        let Some(policy) = self.policy.guarded(tool) else {
            let seen = looks(tool);
            return match self.policy.tools.keys().find(|g| looks(g) == seen) {
                Some(guarded) => Seen::Refused(format!(
                    "the tool {tool:?} is not {guarded:?}, but a lenient reader takes it for it"
                )),
                None => Seen::Passed,
            };
        };
        if !matches!(message.get("id"), Some(Json::String(_) | Json::Number(_))) {
            return Seen::Refused(
                "a guarded tool call must be a request with a string or number id".into(),
            );
        }
        // A task-augmented call is answered with a task handle before the tool has done
        // anything, and its outcome comes later, by another method: there is no answer to record
        // as the effect's.
        if params.and_then(|p| p.get(TASK)).is_some() {
            return Seen::Refused(format!(
                "the tool {tool:?} is guarded, and a guarded call cannot run as a task: send it \
                 without \"{TASK}\", and its answer comes when the tool is done"
            ));
        }
        let arguments = params.and_then(|p| p.get("arguments"));
        for path in policy.paths_read() {
            let mut at = arguments;
            for name in &path {
                let Some(object) = at else { break };
                if let Some(why) = lookalike(object, &[name.as_str()]) {
                    return Seen::Refused(why);
                }
                at = object.get(name);
            }
        }
        Seen::Guarded(tool.to_owned(), policy)
    }

    /// Learns from a `tools/list` result which tools declare an `outputSchema`; says why for
    /// each guarded tool it finds that way whose policy says `on_error = "absent"`: its errors
    /// may come after its effect, so they are judged UNKNOWN.
    pub fn learn(&self, result: &Value) -> Vec<String> {
        let Some(Value::Array(tools)) = result.get("tools") else {
            return Vec::new();
        };
        let mut listed = self.listed.lock().expect("not poisoned");
        let mut misjudged = Vec::new();
        for tool in tools {
            let Some(name) = tool.get("name").and_then(Value::as_str) else {
                continue;
            };
            let now = match tool.get("outputSchema") {
                None | Some(Value::Null) => Listed::Plain,
                Some(_) => Listed::Validated,
            };
            // A listing without the schema does not undo one with it: a server may leave it
            // out for a client of an older revision, and validate the output all the same.
            let before = listed.get(name).copied();
            if before != Some(Listed::Validated) {
                listed.insert(name.to_owned(), now);
            }
            if self.policy.guarded(name).is_some() {
                let mut inputs = self.inputs.lock().expect("not poisoned");
                match tool.get("inputSchema") {
                    Some(schema @ Value::Object(_)) => {
                        inputs.insert(name.to_owned(), schema.clone())
                    }
                    _ => inputs.remove(name),
                };
            }
            let absent = self
                .policy
                .guarded(name)
                .is_some_and(|p| p.on_error == OnError::Absent);
            if absent && now == Listed::Validated && before != Some(Listed::Validated) {
                misjudged.push(validated_absent(name));
            }
        }
        misjudged
    }

    /// [`Guard::learn`] from a listing relayed to a client, what it finds logged.
    pub fn learn_relayed(&self, result: &Value) {
        for why in self.learn(result) {
            tracing::error!("{why}");
        }
    }

    /// The guarded tools whose policy says `on_error = "absent"` but which the upstream lists
    /// with an `outputSchema`.
    pub fn misjudged(&self) -> Vec<String> {
        let listed = self.listed.lock().expect("not poisoned");
        self.policy
            .tools
            .iter()
            .filter(|(name, policy)| {
                policy.on_error == OnError::Absent && listed.get(*name) == Some(&Listed::Validated)
            })
            .map(|(name, _)| validated_absent(name))
            .collect()
    }

    fn listed(&self, tool: &str) -> Listed {
        self.listed
            .lock()
            .expect("not poisoned")
            .get(tool)
            .copied()
            .unwrap_or(Listed::Unseen)
    }

    /// Runs one guarded call. `forward` sends the request upstream (the client's, carrying the
    /// attempt's provider key where the policy says; the transport gives it the proxy's own id)
    /// and waits for what becomes of it; it is called only when the ledger says EXECUTE.
    pub async fn call<F, Fut>(
        &self,
        tool: &str,
        policy: &ToolPolicy,
        request: &Json,
        forward: F,
    ) -> Answer
    where
        F: FnOnce(Json) -> Fut,
        Fut: Future<Output = Upstream>,
    {
        let id = request.get("id").cloned().unwrap_or(Json::Null);
        let params = match request.get("params").map(Json::to_value) {
            Some(Value::Object(params)) => params,
            _ => Map::new(),
        };
        let arguments = params.get("arguments").unwrap_or(&Value::Null);
        let mistyped = self
            .inputs
            .lock()
            .expect("not poisoned")
            .get(tool)
            .and_then(|schema| policy.mistyped(schema, arguments));
        let named = match mistyped {
            Some(unnamed) => Err(unnamed),
            None => policy.spec(tool, &params),
        };
        let spec = match named {
            Ok(spec) => spec,
            Err(unnamed) => {
                self.ended(tool, "refused");
                tracing::warn!(tool, reason = %unnamed, "a guarded call was not forwarded: the policy cannot name its operation from these arguments");
                let failure = ClientError::Invalid(unnamed.to_string());
                return reply(&id, to_value(&not_performed(&failure)));
            }
        };
        let timeout = policy.timeout;
        let on_error = match (policy.on_error, self.listed(tool)) {
            (OnError::Absent, Listed::Plain) => OnError::Absent,
            (OnError::Absent, listed) => {
                tracing::warn!(tool, ?listed, "on_error = \"absent\" applies only to a tool listed without an outputSchema; this call's errors are judged UNKNOWN");
                OnError::Unknown
            }
            (OnError::Unknown, _) => OnError::Unknown,
        };
        let sink = policy.provider_key.clone();
        // The upstream's own answer, kept to pass on where the outcome allows.
        let seen: Arc<Mutex<Option<Upstream>>> = Arc::default();
        let kept = seen.clone();
        let outcome = self
            .ledger
            .run(&spec, |context| async move {
                tracing::info!(operation_id = %context.operation_id, attempt = context.attempt, tool, "forwarding a guarded call upstream");
                let mut upstream_request = request.clone();
                if let Some(sink) = sink {
                    sink.carry(&mut upstream_request, &context.provider_key);
                }
                let upstream = match tokio::time::timeout(timeout, forward(upstream_request)).await
                {
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
        let verbatim = match &upstream {
            Some(Upstream::Answered(line)) => reanswered(&id, line),
            _ => None,
        };
        let status = self.status_tool();
        self.ended(
            tool,
            match &outcome {
                Ok(Outcome::Executed { .. }) => "executed",
                Ok(Outcome::NotPerformed { .. }) => "not_performed",
                Ok(Outcome::Ambiguous { .. }) => "ambiguous",
                Ok(Outcome::Replayed(_)) => "replayed",
                Ok(Outcome::InProgress(_)) => "in_progress",
                Ok(Outcome::Unknown(_)) => "unknown",
                Ok(Outcome::Conflict(_)) => "conflict",
                Err(_) => "refused",
            },
        );
        match (outcome, upstream, verbatim) {
            (_, Some(Upstream::Gone { reply: false, .. } | Upstream::Unsent), _) => Answer::Nothing,
            (Ok(Outcome::Executed { .. } | Outcome::NotPerformed { .. }), _, Some(answer)) => {
                Answer::Reply(answer)
            }
            (Ok(Outcome::NotPerformed { .. }), Some(Upstream::Refused { status, text }), _) => {
                Answer::Refused { status, text }
            }
            (Ok(Outcome::Replayed(replay)), _, _) => reply(&id, replayed(&replay)),
            (Ok(ambiguous @ Outcome::Ambiguous { .. }), Some(Upstream::Answered(line)), _) => {
                // The upstream's own words follow the ledger's: the model reads both.
                let mut result = to_value(&tool_result(&ambiguous, &status));
                append(&mut result, upstream_content(&line));
                reply(&id, result)
            }
            (Ok(outcome), _, _) => reply(&id, to_value(&tool_result(&outcome, &status))),
            (Err(failure), _, _) => {
                let operation_id = spec.operation_id().unwrap_or_default();
                tracing::warn!(tool, %operation_id, reason = %failure, "a guarded call was not forwarded: the ledger did not let it run");
                reply(&id, to_value(&not_performed(&failure)))
            }
        }
    }

    fn status_tool(&self) -> String {
        self.policy.status_tool.clone().unwrap_or_else(|| {
            "the same tool again with the same arguments (it will not run twice)".into()
        })
    }
}

fn validated_absent(tool: &str) -> String {
    format!(
        "tools.{tool}: on_error = \"absent\", but the upstream lists {tool} with an outputSchema, \
         which its SDK validates after the tool has run: an error may come after the effect, so \
         it is never taken for ABSENT. Remove on_error or the tool's output schema"
    )
}

/// Plain-text refusals of the Python SDK's transport security (mcp 2.3.0,
/// `mcp/server/transport_security.py`) and of FastMCP's host guard (fastmcp 4.2.3,
/// `fastmcp/server/http.py`), sent before a request is read as JSON-RPC.
const PLAIN_REFUSALS: [(u16, &str); 6] = [
    (400, "Invalid Content-Type header"),
    (421, "Invalid Host header"),
    (403, "Invalid Origin header"),
    (413, "Request body too large"),
    (421, "Misdirected Request"),
    (403, "Forbidden Origin"),
];

/// Whether an HTTP error answer is one an MCP server's transport sends before it hands a
/// request to any tool (README, once-proxy, lists each shape with the SDK it was read from):
///
/// - a JSON-RPC error whose `id` is null or missing, an error that answers no request: every
///   refusal of the TypeScript SDK's Streamable HTTP transport (1.32.2: no or unknown session,
///   a wrong protocol version, Accept, Content-Type, a body too large or unparseable, not
///   initialized) and of the Python SDK's (mcp 2.3.0: no or unknown session, Accept,
///   Content-Type, a parse or validation error);
/// - the plain-text refusals in [`PLAIN_REFUSALS`].
///
/// An error that carries the request's id may come from the tool's own handler, whatever its
/// code (mcp 2.3.0 maps a handler's error to a 4xx under the 2026-07-28 revision; FastMCP raises
/// -32021 from inside a tool), and so may anything else: a gateway's 403 or 429, a page of HTML.
fn pre_dispatch(status: u16, text: &str) -> bool {
    if !(400..500).contains(&status) || status == 408 {
        return false;
    }
    if PLAIN_REFUSALS.contains(&(status, text.trim())) {
        return true;
    }
    let Ok(Value::Object(answer)) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    let coded = answer
        .get("error")
        .and_then(|e| e.get("code"))
        .and_then(Value::as_i64)
        .is_some();
    let unaddressed = matches!(answer.get("id"), None | Some(Value::Null));
    answer.get("jsonrpc") == Some(&json!("2.0"))
        && answer.get("result").is_none()
        && coded
        && unaddressed
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
        Upstream::Unsent => {
            return Err(EffectError::NotPerformed(
                "the client cancelled the call before it was sent upstream".into(),
            ))
        }
        Upstream::Unreached(why) => {
            return Err(EffectError::NotPerformed(format!(
                "the upstream could not be reached: {why}"
            )))
        }
        Upstream::Refused { status, text } => {
            let why = format!(
                "the upstream answered HTTP {status}: {}",
                text.chars().take(512).collect::<String>()
            );
            // Anything else may come after the effect, whatever the policy says: `on_error`
            // speaks of the tool's own errors, and a gateway may refuse after the tool ran.
            return Err(if pre_dispatch(*status, text) {
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
            // Only a tool's result is its outcome: an object, which a task handle (the tool
            // has only started) is not.
            let judged = serde_json::from_str::<Value>(result.get()).ok();
            let Some(Value::Object(judged)) = judged else {
                return Err(EffectError::Ambiguous(
                    "the upstream's result is not a tool's result (an object)".into(),
                ));
            };
            if judged.contains_key(TASK) {
                return Err(EffectError::Ambiguous(
                    "the upstream answered with a task, not the tool's result: the tool may \
                     still run"
                        .into(),
                ));
            }
            if judged.get("isError").and_then(Value::as_bool) == Some(true) {
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

/// The upstream's answer to the proxy's id, its result or error verbatim, under the client's id.
fn reanswered(id: &Json, line: &[u8]) -> Option<Vec<u8>> {
    let parsed = serde_json::from_slice::<Reply>(line).ok()?;
    let (member, raw) = match (parsed.result, parsed.error) {
        (Some(result), None) => ("result", result),
        (None, Some(error)) => ("error", error),
        _ => return None,
    };
    Some(response(id, member, raw.get().as_bytes()))
}

/// A JSON-RPC response under `id` (as the client wrote it), whose `member` (`result` or
/// `error`) is the JSON text `body`, spliced in as it is.
fn response(id: &Json, member: &str, body: &[u8]) -> Vec<u8> {
    let mut answer = br#"{"jsonrpc":"2.0","id":"#.to_vec();
    answer.extend_from_slice(&id.to_bytes());
    answer.extend_from_slice(format!(r#","{member}":"#).as_bytes());
    answer.extend_from_slice(body);
    answer.push(b'}');
    answer
}

/// A JSON-RPC error under `id`.
fn error_response(id: &Json, code: i64, message: String) -> Vec<u8> {
    let error = json!({"code": code, "message": message});
    response(id, "error", error.to_string().as_bytes())
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

fn reply(id: &Json, result: Value) -> Answer {
    Answer::Reply(response(id, "result", result.to_string().as_bytes()))
}

/// The answer to a refused message: an error for each request in it (one, or a batch's), or
/// nothing when it holds only notifications.
pub fn refusal(message: &Json, why: &str) -> Option<Vec<u8>> {
    let error = |id: &Json| {
        error_response(
            id,
            -32600,
            format!("once-proxy: {why}; it was not performed."),
        )
    };
    // A request's id; null for one that cannot be answered under its id (null, an object, one
    // of the proxy's own); none for a notification.
    let requested = |m: &Json| match m.get("id") {
        None => None,
        Some(id @ (Json::String(_) | Json::Number(_))) if !reserved(Some(id)) => Some(id.clone()),
        Some(_) => Some(Json::Null),
    };
    let answer = match message {
        Json::Array(batch) if !batch.is_empty() => {
            let errors: Vec<Vec<u8>> = batch
                .iter()
                .filter_map(requested)
                .map(|id| error(&id))
                .collect();
            (!errors.is_empty()).then(|| {
                let mut all = b"[".to_vec();
                all.extend_from_slice(&errors.join(&b','));
                all.push(b']');
                all
            })
        }
        Json::Object(_) => requested(message).map(|id| error(&id)),
        _ => Some(error(&Json::Null)),
    };
    if answer.is_none() {
        tracing::warn!(why, "a refused notification is dropped");
    }
    answer
}

/// The answer to a request refused because its id is in use: under no id, since an answer
/// under that id would be taken by the client for the answer of its request in flight.
pub fn refusal_of_id(why: &str) -> Vec<u8> {
    error_response(
        &Json::Null,
        -32600,
        format!("once-proxy: {why}; it was not performed."),
    )
}

/// The answer to bytes that are not one strict JSON value: refused whatever they mention.
pub fn unparseable(malformed: &crate::message::Malformed) -> Vec<u8> {
    error_response(
        &Json::Null,
        -32700,
        format!(
            "once-proxy: the message is not one strict JSON value: {malformed}; it was not \
             forwarded."
        ),
    )
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
    use crate::message::parse;

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
        let client = parse(b"1.0").unwrap();
        assert_eq!(
            reanswered(&client, line).unwrap(),
            br#"{"jsonrpc":"2.0","id":1.0,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}"#
        );
    }

    /// A result that is no tool's result (a task handle, which an upstream may send for a
    /// call it runs as a task; or no object at all) is UNKNOWN, whatever the policy says.
    #[test]
    fn a_task_handle_or_a_result_that_is_no_object_is_unknown() {
        for result in [
            json!({"task": {"taskId": "t-1", "status": "working"}}),
            json!({"content": [], "task": {"taskId": "t-1", "status": "working"}}),
            json!("ok"),
            json!(null),
            json!([]),
        ] {
            let upstream = answered(json!({"jsonrpc": "2.0", "id": 1, "result": result}));
            for on_error in [OnError::Unknown, OnError::Absent] {
                assert!(
                    matches!(judge(&upstream, on_error), Err(EffectError::Ambiguous(_))),
                    "{result}"
                );
            }
        }
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

    #[test]
    fn an_http_error_is_absent_only_in_a_transports_pre_dispatch_shape() {
        let refused = |status: u16, text: &str, on_error| {
            matches!(
                judge(
                    &Upstream::Refused {
                        status,
                        text: text.into()
                    },
                    on_error
                ),
                Err(EffectError::NotPerformed(_))
            )
        };
        // The SDKs' transports, before any handler runs.
        for text in [
            r#"{"jsonrpc":"2.0","error":{"code":-32000,"message":"Bad Request: No valid session ID provided"},"id":null}"#,
            r#"{"jsonrpc":"2.0","error":{"code":-32001,"message":"Session not found"},"id":null}"#,
            r#"{"jsonrpc":"2.0","error":{"code":-32000,"message":"Bad Request: Unsupported protocol version"},"id":null}"#,
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Bad Request: Missing session ID"}}"#,
            r#"{"jsonrpc":"2.0","error":{"code":-32700,"message":"Parse error"}}"#,
        ] {
            assert!(refused(400, text, OnError::Unknown), "{text}");
            assert!(refused(404, text, OnError::Unknown), "{text}");
        }
        assert!(refused(421, "Invalid Host header", OnError::Unknown));
        assert!(refused(413, "Request body too large", OnError::Unknown));
        // A gateway's refusal after the tool ran, a tool's own error in a 4xx, a timeout, a
        // server error: UNKNOWN.
        for (status, text) in [
            (403, "Forbidden"),
            (403, r#"{"error": "forbidden"}"#),
            (
                400,
                r#"{"jsonrpc":"2.0","id":"once-proxy:1","error":{"code":-32603,"message":"x"}}"#,
            ),
            (
                400,
                r#"{"jsonrpc":"2.0","id":"once-proxy:1","error":{"code":-32602,"message":"x"}}"#,
            ),
            (
                400,
                r#"{"jsonrpc":"2.0","id":"once-proxy:1","error":{"code":-32600,"message":"x"}}"#,
            ),
            (400, "<html><body>Bad Request</body></html>"),
            (403, "Invalid Host header"),
            (
                408,
                r#"{"jsonrpc":"2.0","error":{"code":-32000,"message":"timeout"},"id":null}"#,
            ),
            (
                500,
                r#"{"jsonrpc":"2.0","error":{"code":-32603,"message":"boom"},"id":null}"#,
            ),
        ] {
            assert!(!refused(status, text, OnError::Unknown), "{status} {text}");
        }
        // And whatever the policy says: it speaks of the tool's errors, not a gateway's.
        assert!(!refused(403, "Forbidden", OnError::Absent));
        assert!(!refused(
            400,
            r#"{"jsonrpc":"2.0","id":"once-proxy:1","error":{"code":-32602,"message":"x"}}"#,
            OnError::Absent
        ));
        assert!(!refused(500, "boom", OnError::Absent));
    }

    fn guard(policy: &str) -> Guard {
        let policy = Policy::parse(policy).unwrap();
        let ledger =
            LedgerClient::connect(once_client::ClientConfig::new("http://127.0.0.1:1")).unwrap();
        Guard::new(policy, ledger)
    }

    /// How `guard` sees the message `text`: guarded, refused (`lenient` when for a name that
    /// looks like another), passed, or malformed.
    fn seen(guard: &Guard, text: &str) -> &'static str {
        match parse(text.as_bytes()) {
            Err(_) => "malformed",
            Ok(message) => match guard.inspect(&message) {
                Seen::Guarded(..) => "guarded",
                Seen::Refused(why)
                    if why.contains("lenient reader takes it") && why.contains("the name") =>
                {
                    "lenient"
                }
                Seen::Refused(_) => "refused",
                Seen::Passed => "passed",
            },
        }
    }

    #[tokio::test]
    async fn messages_a_lenient_reader_could_take_for_another_are_refused() {
        let guard =
            guard("[tools.refund]\nintent = [\"r\", \"{/order/id}\"]\nvolatile = [\"note\"]\n");
        let call = |id: &str, method: &str, params: &str| {
            format!(r#"{{"jsonrpc": "2.0", "id": {id}, "method": {method}, "params": {params}}}"#)
        };
        let refund = r#"{"name": "refund", "arguments": {"order": {"id": 1}}}"#;
        for (text, verdict) in [
            (call("1", r#""tools/call""#, refund), "guarded"),
            (call(r#""a""#, r#""tools\/call""#, refund), "guarded"),
            (call("1.0", r#""tools\u002fcall""#, refund), "guarded"),
            (call("1", r#""tools/call""#, r#"{"n\u0061me": "refund"}"#), "guarded"),
            (call("1", r#""tools/call""#, r#"{"name": "lookup"}"#), "passed"),
            // A guarded call cannot run as a task; another tool's can.
            (call("1", r#""tools/call""#, r#"{"name": "refund", "arguments": {"order": {"id": 1}}, "task": {"ttl": 60000}}"#), "refused"),
            (call("1", r#""tools/call""#, r#"{"name": "lookup", "task": {"ttl": 60000}}"#), "passed"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "arguments": {"order": {"id": 1}}, "Task": {"ttl": 60000}}"#), "lenient"),
            (call("1", r#""ping""#, "{}"), "passed"),
            // Methods, tools and names that look alike.
            (call("1", r#""Tools/Call""#, refund), "refused"),
            (call("1", r#""tools/call ""#, refund), "refused"),
            (call("1", r#""tools/call\u0000""#, refund), "refused"),
            (call("1", r#""tools/call\u200b""#, refund), "refused"),
            (call("1", r#""\uff54ools/call""#, refund), "refused"),
            (call("1", r#""tools/call""#, r#"{"name": "Refund"}"#), "refused"),
            (call("1", r#""tools/call""#, r#"{"name": "refund\u0000"}"#), "refused"),
            (call("1", r#""tools/call""#, r#"{"name": ["refund"]}"#), "refused"),
            (call("1", r#""tools/call""#, r#"["refund"]"#), "refused"),
            (call("1", r#""tools/call""#, r#"{"name": "lookup", "Name": "refund"}"#), "malformed"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "argumentſ": {}}"#), "lenient"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "_meta": {"progressToKen": 1}}"#), "lenient"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "arguments": {"Order": {"id": 1}}}"#), "lenient"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "arguments": {"order": {"ID": 1}}}"#), "lenient"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "arguments": {"order": {"id": 1}, "NOTE": ""}}"#), "lenient"),
            (r#"{"jsonrpc": "2.0", "id": 1, "method": "ping", "Method": "tools/call", "params": {"name": "refund"}}"#.into(), "malformed"),
            (r#"{"jsonrpc": "2.0", "id": 1, "METHOD": "tools/call", "params": {"name": "refund"}}"#.into(), "lenient"),
            (r#"{"jsonrpc": "2.0", "ıd": 1, "method": "tools/call", "params": {"name": "refund"}}"#.into(), "lenient"),
            (r#"{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "paramſ": {"name": "refund"}}"#.into(), "lenient"),
            // Beside the name itself: what folding keeps apart, a careless reader does not.
            (r#"{"jsonrpc": "2.0", "id": 1, "method": "ping", "method\u200b": "tools/call", "params": {"name": "refund"}}"#.into(), "lenient"),
            (r#"{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "lookup", "\uff4eame": "refund"}}"#.into(), "lenient"),
            (call("1", r#""tools/call""#, r#"{"name": "refund", "arguments": {"order": {"id": 1, "id\u00ad": 2}}}"#), "lenient"),
            // Not a request the proxy can answer and report.
            (r#"{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "refund"}}"#.into(), "refused"),
            (call("null", r#""tools/call""#, refund), "refused"),
            (call("{}", r#""tools/call""#, refund), "refused"),
            (r#"{"jsonrpc": "1.0", "id": 1, "method": "tools/call", "params": {"name": "refund"}}"#.into(), "refused"),
            (r#"{"id": 1, "method": "tools/call", "params": {"name": "refund"}}"#.into(), "refused"),
            (r#"{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "result": {}, "params": {"name": "refund"}}"#.into(), "refused"),
            // The proxy's own ids and tokens.
            (call(r#""once-proxy:1""#, r#""ping""#, "{}"), "refused"),
            (r#"{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "once-proxy:x:1"}}"#.into(), "refused"),
            (r#"{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"RequestId": 1}}"#.into(), "lenient"),
            // Batches and what is not a message.
            (format!("[{}, {}]", call("1", r#""tools/call""#, refund), call("2", r#""ping""#, "{}")), "refused"),
            (format!("[{}]", call("2", r#""ping""#, "{}")), "passed"),
            (format!("[[{}]]", call("2", r#""ping""#, "{}")), "refused"),
            ("[]".into(), "refused"),
            (r#""tools/call""#.into(), "refused"),
            // A response from the client (to a server's request) passes.
            (r#"{"jsonrpc": "2.0", "id": 3, "result": {}}"#.into(), "passed"),
        ] {
            assert_eq!(seen(&guard, &text), verdict, "{text}");
        }
    }

    #[test]
    fn a_refused_batch_answers_each_request_in_it() {
        let batch = parse(
            br#"[
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "refund"}},
            {"jsonrpc": "2.0", "method": "notifications/progress"},
            {"jsonrpc": "2.0", "id": "b", "method": "tools/list"},
            {"jsonrpc": "2.0", "id": "once-proxy:7", "method": "ping"}
        ]"#,
        )
        .unwrap();
        let answer: Value = serde_json::from_slice(&refusal(&batch, "no").unwrap()).unwrap();
        let ids: Vec<&Value> = answer
            .as_array()
            .unwrap()
            .iter()
            .map(|a| &a["id"])
            .collect();
        assert_eq!(ids, [&json!(1), &json!("b"), &Value::Null]);
        let notification = parse(br#"{"jsonrpc": "2.0", "method": "tools/call"}"#).unwrap();
        assert!(refusal(&notification, "no").is_none());
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

    #[tokio::test]
    async fn absent_applies_only_to_a_tool_listed_without_an_output_schema() {
        let guard =
            guard("[tools.refund]\non_error = \"absent\"\n[tools.typed]\non_error = \"absent\"\n");
        assert_eq!(guard.listed("refund"), Listed::Unseen);
        guard.learn(&json!({"tools": [
            {"name": "refund", "inputSchema": {}},
            {"name": "typed", "inputSchema": {}, "outputSchema": {"type": "object"}},
        ]}));
        assert_eq!(guard.listed("refund"), Listed::Plain);
        assert_eq!(guard.listed("typed"), Listed::Validated);
        // A later listing without the schema (a client of an older revision) changes nothing.
        guard.learn(&json!({"tools": [{"name": "typed", "inputSchema": {}}]}));
        assert_eq!(guard.listed("typed"), Listed::Validated);
        let misjudged = guard.misjudged();
        assert_eq!(misjudged.len(), 1, "{misjudged:?}");
        assert!(
            misjudged[0].starts_with("tools.typed: on_error"),
            "{misjudged:?}"
        );
    }

    #[test]
    fn a_replay_keeps_the_original_content_and_appends_the_marker() {
        let replay = Replay {
            operation_id: "op".into(),
            result: br#"{"content":[{"type":"text","text":"re_1"}],"structuredContent":{"id":"re_1"},"isError":false}"#.to_vec(),
            provider_ref: None,
            confirmed_at: std::time::UNIX_EPOCH,
            receipt: None,
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

    /// Once the upstream has listed a guarded tool whose intent reads an integer, a call that
    /// spells it otherwise (which a lenient server would convert, and run a second time under
    /// another name) is not forwarded and not begun; its own digits, or the number, pass.
    #[tokio::test]
    async fn an_integer_intent_spelled_otherwise_is_not_forwarded() {
        let guard = guard("[tools.refund]\nintent = [\"r\", \"{/order_id}\"]\n");
        let listing = json!({"tools": [{
            "name": "refund",
            "inputSchema": {"type": "object", "properties": {"order_id": {"type": "integer"}}},
        }]});
        let call = |order_id: Value| {
            let text = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "refund", "arguments": {"order_id": order_id}}});
            parse(text.to_string().as_bytes()).unwrap()
        };
        let policy = guard.policy.guarded("refund").unwrap().clone();
        let answer = |request: Json| {
            let (guard, policy) = (&guard, &policy);
            async move {
                let forwarded = std::sync::atomic::AtomicBool::new(false);
                let answer = guard
                    .call("refund", policy, &request, |_| {
                        forwarded.store(true, std::sync::atomic::Ordering::SeqCst);
                        async { Upstream::Unsent }
                    })
                    .await;
                let text = match answer {
                    Answer::Reply(bytes) => String::from_utf8(bytes).unwrap(),
                    other => format!("{other:?}"),
                };
                (text, forwarded.into_inner())
            }
        };
        // Before the listing the proxy cannot tell, and asks the ledger (here unreachable).
        let (before, forwarded) = answer(call(json!("042"))).await;
        assert!(!forwarded);
        assert!(!before.contains("declares it an integer"), "{before}");
        guard.learn(&listing);
        let (refused, forwarded) = answer(call(json!("042"))).await;
        assert!(!forwarded);
        assert!(refused.contains("declares it an integer"), "{refused}");
        assert!(refused.contains("NOT performed"), "{refused}");
        for passes in [json!("42"), json!(42)] {
            let (answered, _) = answer(call(passes.clone())).await;
            assert!(
                !answered.contains("declares it an integer"),
                "{passes}: {answered}"
            );
        }
    }
}
