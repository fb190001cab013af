//! The policy: which tools are guarded, and how each one's calls are named for the ledger.
//!
//! ```toml
//! # The read-only tool the model is told to call to follow an uncertain operation.
//! status_tool = "get_refund_status"
//! # Add a sentence to each guarded tool's description in tools/list results.
//! annotate = true
//!
//! [tools.issue_refund]
//! # The business intent, which names the operation whatever key a call carries: parts joined
//! # by once-id-v1. `{/pointer}` reads an argument; a part that is one pointer to an integer
//! # stays an integer. Without `intent`, an explicit key names the operation, and without one
//! # all of its arguments do.
//! intent = ["refund", "{/order_id}"]
//! # Top-level arguments left out of the fingerprint (nonces, client timestamps).
//! volatile = ["note"]
//! # Where an explicit idempotency key may come from (tools without an intent), in this order:
//! # an argument, the request's `_meta` `once/idempotency_key`, its `idempotencyKey` field.
//! key = ["argument:idempotency_key", "meta", "request"]
//! # The reconciler that can look the operation up, and its hints (templates as for intent).
//! provider = "orders"
//! lookup_hints = { order_id = "{/order_id}" }
//! lease = "30s"
//! # How long the upstream may take to answer; after that the outcome is unknown.
//! timeout = "60s"
//! # What an upstream tool error means: "unknown" (the default) or "absent", for tools whose
//! # errors are known to come before any side effect.
//! on_error = "unknown"
//! # Where the forwarded call carries the attempt's provider key: an argument the upstream
//! # passes to its provider as an idempotency key ("argument:NAME"), or `_meta`
//! # `once/provider_key` ("meta"). An `http` reconciler finds the effect by it.
//! provider_key = "argument:idempotency_key"
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use once_client::{OperationSpec, META_IDEMPOTENCY_KEY};
use once_core::once_id::IntentPart;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::message::Json;

/// The whole policy file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// The tool the model is told to call to follow an operation in progress or being verified.
    pub status_tool: Option<String>,
    /// Whether guarded tools' descriptions in tools/list say that retries are safe.
    #[serde(default)]
    pub annotate: bool,
    #[serde(default)]
    pub tools: BTreeMap<String, ToolPolicy>,
}

/// How one guarded tool's calls are named and judged.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolPolicy {
    pub intent: Option<Vec<Template>>,
    #[serde(default)]
    pub volatile: Vec<String>,
    #[serde(default = "default_key_sources")]
    pub key: Vec<KeySource>,
    pub provider: Option<String>,
    #[serde(default)]
    pub lookup_hints: BTreeMap<String, Template>,
    #[serde(default, with = "humantime_serde_opt")]
    pub lease: Option<Duration>,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    #[serde(default)]
    pub on_error: OnError,
    /// Where the forwarded call carries the ledger's provider key for the attempt, so the
    /// provider can dedupe on it and a reconciler can find the effect by it.
    pub provider_key: Option<KeySink>,
}

/// Where the proxy puts the attempt's provider key in the call it forwards.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum KeySink {
    /// The top-level argument of this name (set, or replaced).
    Argument(String),
    /// The request's `_meta` `once/provider_key`.
    Meta,
}

/// The `_meta` key a forwarded call carries the attempt's provider key under.
pub const META_PROVIDER_KEY: &str = "once/provider_key";

impl TryFrom<String> for KeySink {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match KeySource::try_from(text.clone()) {
            Ok(KeySource::Argument(name)) => Ok(KeySink::Argument(name)),
            Ok(KeySource::Meta) => Ok(KeySink::Meta),
            _ => Err(format!(
                "provider_key {text:?}: expected \"argument:NAME\" or \"meta\""
            )),
        }
    }
}

impl KeySink {
    /// Puts `provider_key` into `request` (a `tools/call`) where this sink says.
    pub fn carry(&self, request: &mut Json, provider_key: &str) {
        let key = Json::String(provider_key.to_owned());
        let Some(params) = request.get_mut("params") else {
            return;
        };
        let (holder, name) = match self {
            KeySink::Argument(name) => ("arguments", name.as_str()),
            KeySink::Meta => ("_meta", META_PROVIDER_KEY),
        };
        if let Some(holder) = params.object_at(holder) {
            holder.set(name, key);
        }
    }
}

/// What an upstream tool error (or JSON-RPC error) to a guarded call means.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// The effect may have happened: the operation is UNKNOWN until reconciled.
    #[default]
    Unknown,
    /// The tool's errors come before any side effect: the operation is ABSENT and may be
    /// tried again.
    Absent,
}

/// Where an explicit idempotency key may come from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum KeySource {
    /// A top-level string argument of this name.
    Argument(String),
    /// The request's `_meta` `once/idempotency_key`.
    Meta,
    /// The request's `idempotencyKey` field (the MCP idempotency proposal).
    Request,
}

impl TryFrom<String> for KeySource {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.as_str() {
            "meta" => Ok(KeySource::Meta),
            "request" => Ok(KeySource::Request),
            other => match other.strip_prefix("argument:") {
                Some(name) if !name.is_empty() => Ok(KeySource::Argument(name.to_owned())),
                _ => Err(format!(
                    "key source {other:?}: expected \"argument:NAME\", \"meta\" or \"request\""
                )),
            },
        }
    }
}

fn default_key_sources() -> Vec<KeySource> {
    vec![
        KeySource::Argument(once_core::identity::IDEMPOTENCY_KEY_FIELD.to_owned()),
        KeySource::Meta,
        KeySource::Request,
    ]
}

fn default_timeout() -> Duration {
    Duration::from_secs(60)
}

mod humantime_serde {
    use std::time::Duration;

    use serde::Deserialize;

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

mod humantime_serde_opt {
    use std::time::Duration;

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        super::humantime_serde::deserialize(d).map(Some)
    }
}

/// Why a guarded call cannot be named: it is not performed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unnamed(String);

impl Policy {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("policy {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| anyhow::anyhow!("policy {}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Self> {
        // Templates are parsed here, once: a malformed one refuses the policy.
        let policy: Policy = toml::from_str(text)?;
        for (tool, guarded) in &policy.tools {
            if guarded.intent.as_ref().is_some_and(Vec::is_empty) {
                anyhow::bail!("tools.{tool}.intent: name at least one part, or leave it out");
            }
        }
        Ok(policy)
    }

    pub fn guarded(&self, tool: &str) -> Option<&ToolPolicy> {
        self.tools.get(tool)
    }
}

impl ToolPolicy {
    /// The top-level arguments that carry a key rather than the request: the explicit key's
    /// arguments and the provider key's. Each is left out of the fingerprint, so a model that
    /// re-issues a call with a fresh key is still asking for the same thing, and the fresh-id
    /// guard sees it.
    fn key_arguments(&self) -> impl Iterator<Item = &str> {
        let sources = self.key.iter().filter_map(|source| match source {
            KeySource::Argument(name) => Some(name.as_str()),
            _ => None,
        });
        let sink = match &self.provider_key {
            Some(KeySink::Argument(name)) => Some(name.as_str()),
            _ => None,
        };
        sources.chain(sink)
    }

    /// Why a call's arguments name its operation by a spelling the tool would read as another
    /// value, given the tool's `inputSchema` as the upstream lists it: an argument an intent
    /// reads that the schema declares an integer, sent as text that is not that integer's own
    /// digits (`"042"`, `"+42"`, `"42.0"`, `" 42"`). A lenient server converts each to 42, so
    /// one action would have two names, and two executions; `"42"` names what `42` names, and
    /// passes.
    pub fn mistyped(&self, schema: &Value, arguments: &Value) -> Option<Unnamed> {
        let pointers = self.intent.iter().flatten().flat_map(Template::pointers);
        for pointer in pointers {
            let Some(Value::String(text)) = arguments.pointer(pointer) else {
                continue;
            };
            let integer = match crate::schema::find(schema, schema, &pointer_path(pointer), 0) {
                crate::schema::Found::Yes { at, .. } => crate::schema::admits_integer(schema, at),
                _ => false,
            };
            let own_digits = text.parse::<i64>().is_ok_and(|n| n.to_string() == *text);
            if integer && !own_digits {
                return Some(Unnamed(format!(
                    "argument {pointer} is {text:?}, and the tool declares it an integer: send it \
                     as a number (or as its own digits), so that one action has one name"
                )));
            }
        }
        None
    }

    /// The paths into the arguments that the policy reads (its templates' pointers, volatile
    /// fields, key arguments, the provider key's argument), each a list of member names.
    pub fn paths_read(&self) -> Vec<Vec<String>> {
        let templates = self
            .intent
            .iter()
            .flatten()
            .chain(self.lookup_hints.values())
            .flat_map(Template::pointers)
            .map(pointer_path);
        let top = self
            .volatile
            .iter()
            .map(String::as_str)
            .chain(self.key_arguments())
            .map(|name| vec![name.to_owned()]);
        templates.chain(top).collect()
    }

    /// Where the policy reads the call's arguments, setting by setting, as `once-proxy check`
    /// compares them with the tool's input schema. Key arguments are listed only when the
    /// policy names its key sources (the default ones are only tried).
    pub fn reads(&self) -> Vec<Read> {
        let mut reads = Vec::new();
        let templates = self
            .intent
            .iter()
            .flatten()
            .map(|t| ("intent".to_owned(), t))
            .chain(
                self.lookup_hints
                    .iter()
                    .map(|(name, t)| (format!("lookup_hints.{name}"), t)),
            );
        for (setting, template) in templates {
            for pointer in template.pointers() {
                reads.push(Read {
                    setting: setting.clone(),
                    said: format!("{{{pointer}}}"),
                    path: pointer_path(pointer),
                    needed: true,
                });
            }
        }
        let named = |setting: &str, said: String, name: &str| Read {
            setting: setting.to_owned(),
            said,
            path: vec![name.to_owned()],
            needed: false,
        };
        for name in &self.volatile {
            reads.push(named("volatile", name.clone(), name));
        }
        if self.key != default_key_sources() {
            for source in &self.key {
                if let KeySource::Argument(name) = source {
                    reads.push(named("key", format!("argument:{name}"), name));
                }
            }
        }
        if let Some(KeySink::Argument(name)) = &self.provider_key {
            reads.push(named("provider_key", format!("argument:{name}"), name));
        }
        reads
    }

    /// The operation a `tools/call` request's params describe, or why it cannot be named.
    pub fn spec(&self, tool: &str, params: &Map<String, Value>) -> Result<OperationSpec, Unnamed> {
        let arguments = match params.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(object @ Value::Object(_)) => object.clone(),
            Some(_) => return Err(Unnamed("the tool's arguments are not an object".into())),
        };
        // The business intent names the operation whatever key the caller sends: a model that
        // re-issues a call with a fresh key is still asking for the same action. Without an
        // intent, an explicit key is the caller's word for "this one action"; without either,
        // the arguments name it.
        let intent = match &self.intent {
            Some(parts) => Some(
                parts
                    .iter()
                    .map(|part| part.intent_part(&arguments))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(Unnamed)?,
            ),
            None => None,
        };
        let key = match intent {
            Some(_) => None,
            None => self.explicit_key(&arguments, params),
        };
        let hints = self
            .lookup_hints
            .iter()
            .map(|(name, hint)| Ok((name.clone(), hint.render(&arguments)?)))
            .collect::<Result<Map<_, _>, String>>()
            .map_err(Unnamed)?;
        let mut volatile = self.volatile.clone();
        volatile.extend(self.key_arguments().map(str::to_owned));
        let mut spec = OperationSpec::new(tool, arguments).volatile(volatile);
        match (intent, key) {
            (Some(parts), _) => spec = spec.intent_parts(parts),
            (None, Some(key)) => spec = spec.explicit(format!("{tool}:x:{key}")),
            (None, None) => {}
        }
        if let Some(provider) = &self.provider {
            spec = spec.provider(provider.clone(), Value::Object(hints));
        }
        if let Some(lease) = self.lease {
            spec = spec.lease_ttl(lease);
        }
        Ok(spec)
    }

    /// The first explicit key the policy's sources find, in their order.
    fn explicit_key(&self, arguments: &Value, params: &Map<String, Value>) -> Option<String> {
        self.key.iter().find_map(|source| {
            let found = match source {
                KeySource::Argument(name) => arguments.get(name),
                KeySource::Meta => params
                    .get("_meta")
                    .and_then(|m| m.get(META_IDEMPOTENCY_KEY)),
                KeySource::Request => params.get("idempotencyKey"),
            };
            found
                .and_then(Value::as_str)
                .filter(|k| !k.is_empty())
                .map(str::to_owned)
        })
    }
}

/// One place a guarded tool's policy reads the call's arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// The setting that reads it: `intent`, `lookup_hints.NAME`, `volatile`, `key`,
    /// `provider_key`.
    pub setting: String,
    /// What the setting says: `{/order_id}`, `note`, `argument:idempotency_key`.
    pub said: String,
    /// The member names down into the arguments.
    pub path: Vec<String>,
    /// A call without it cannot be named, and is not performed.
    pub needed: bool,
}

/// A JSON pointer's member names, unescaped.
fn pointer_path(pointer: &str) -> Vec<String> {
    pointer
        .split('/')
        .skip(1)
        .map(|token| token.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// One piece of a template: literal text, or a JSON pointer into the arguments.
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Pointer(String),
}

/// A template: literal text with `{/json/pointer}` holes filled from the arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "String")]
pub struct Template {
    text: String,
    pieces: Vec<Piece>,
}

impl TryFrom<String> for Template {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut rest = text.as_str();
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("{text:?} has an unclosed '{{'"))?
                + open;
            let pointer = &rest[open + 1..close];
            if !pointer.starts_with('/') {
                return Err(format!(
                    "{text:?}: {{{pointer}}} is not a JSON pointer (they start with '/')"
                ));
            }
            pieces.push(Piece::Pointer(pointer.to_owned()));
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        Ok(Self { text, pieces })
    }
}

impl Template {
    /// The template as the policy wrote it.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The JSON pointers the template reads.
    fn pointers(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|piece| match piece {
            Piece::Pointer(pointer) => Some(pointer.as_str()),
            Piece::Text(_) => None,
        })
    }

    /// The value a template of one pointer names, kept as it is; otherwise the text.
    fn render(&self, arguments: &Value) -> Result<Value, String> {
        if let [Piece::Pointer(pointer)] = self.pieces.as_slice() {
            return lookup(arguments, pointer).cloned();
        }
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(text) => out.push_str(text),
                Piece::Pointer(pointer) => match lookup(arguments, pointer)? {
                    Value::String(s) => out.push_str(s),
                    Value::Number(n) => out.push_str(&number_text(n)),
                    Value::Bool(b) => out.push_str(&b.to_string()),
                    other => {
                        return Err(format!(
                            "argument {pointer} is {other}, not text or a number: it cannot be part of a name"
                        ))
                    }
                },
            }
        }
        Ok(Value::String(out))
    }

    fn intent_part(&self, arguments: &Value) -> Result<IntentPart, String> {
        match self.render(arguments)? {
            Value::String(s) => Ok(IntentPart::Text(s)),
            Value::Number(n) => match n.as_i64() {
                Some(i) => Ok(IntentPart::Integer(i)),
                None => Ok(IntentPart::Number(n.as_f64().unwrap_or(f64::NAN))),
            },
            other => Err(format!(
                "an intent part is {other}, not text or a number: it cannot be part of a name"
            )),
        }
    }
}

/// A number as text in a name, by its value: `42`, `42.0` and `4.2e1` are one number to the
/// upstreams, so they are one text (`42`, as once-id-v1 writes an integral part); -0 is `0`.
fn number_text(n: &serde_json::Number) -> String {
    let x = n.as_f64().unwrap_or(f64::NAN);
    IntentPart::Number(x).render().unwrap_or_else(|_| {
        if n.is_f64() {
            x.to_string()
        } else {
            n.to_string()
        }
    })
}

fn lookup<'v>(arguments: &'v Value, pointer: &str) -> Result<&'v Value, String> {
    arguments
        .pointer(pointer)
        .filter(|v| !v.is_null())
        .ok_or_else(|| format!("the call has no argument {pointer}, which names the operation"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    /// The operation `tool`'s policy names a call of issue_refund with `params`.
    fn operation_id(tool: &ToolPolicy, params: Value) -> String {
        let params = params.as_object().unwrap();
        tool.spec("issue_refund", params)
            .unwrap()
            .operation_id()
            .unwrap()
    }

    /// An intent read from an argument the tool declares an integer (directly, through a
    /// `$ref`, or in an `anyOf`) must be sent as that integer or its own digits; text, or a
    /// schema that says nothing (or loops), leaves it as it is.
    #[test]
    fn an_integer_intent_must_be_sent_as_its_own_digits() {
        let tool: ToolPolicy = toml::from_str("intent = [\"refund\", \"{/order_id}\"]").unwrap();
        let declared = |kind: Value| json!({"type": "object", "properties": {"order_id": kind}});
        let integer = declared(json!({"type": "integer"}));
        for refused in ["042", "+42", "42.0", " 42", "4_2", "42 ", "0x2a"] {
            let arguments = json!({"order_id": refused});
            assert!(tool.mistyped(&integer, &arguments).is_some(), "{refused:?}");
        }
        for passes in [json!("42"), json!("-7"), json!(42), json!(42.0)] {
            let arguments = json!({"order_id": passes});
            assert!(tool.mistyped(&integer, &arguments).is_none(), "{passes}");
        }
        let arguments = json!({"order_id": "042"});
        let optional = declared(json!({"anyOf": [{"type": "integer"}, {"type": "null"}]}));
        assert!(tool.mistyped(&optional, &arguments).is_some());
        for silent in [
            declared(json!({"type": "string"})),
            declared(json!({})),
            json!({"type": "object"}),
            declared(json!({"anyOf": [{"$ref": "#/properties/order_id"}]})),
        ] {
            assert!(tool.mistyped(&silent, &arguments).is_none(), "{silent}");
        }
        let nested: ToolPolicy =
            toml::from_str("intent = [\"refund\", \"order-{/order/id}\"]").unwrap();
        let referenced = json!({
            "type": "object",
            "properties": {"order": {"$ref": "#/$defs/Order"}},
            "$defs": {"Order": {"type": "object", "properties": {"id": {"type": ["integer", "null"]}}}},
        });
        let arguments = json!({"order": {"id": "0042"}});
        assert!(nested.mistyped(&referenced, &arguments).is_some());
    }

    const POLICY: &str = r#"
        status_tool = "get_refund_status"
        [tools.issue_refund]
        intent = ["refund", "{/order_id}"]
        volatile = ["note"]
        provider = "orders"
        lookup_hints = { order_id = "{/order_id}", label = "order-{/order_id}" }
        lease = "5s"
    "#;

    proptest::proptest! {
        /// The policy file, mangled: read or refused with a reason, never a panic.
        #[test]
        fn fuzz_policy_parse_accepts_or_refuses(text in once_core::fuzzing::mangled(POLICY)) {
            let _ = Policy::parse(&text);
        }
    }

    #[test]
    fn intent_parts_read_the_arguments() {
        let policy = Policy::parse(POLICY).unwrap();
        let tool = policy.guarded("issue_refund").unwrap();
        let spec = tool
            .spec(
                "issue_refund",
                &params(
                    json!({"name": "issue_refund", "arguments": {"order_id": 42, "amount": 5}}),
                ),
            )
            .unwrap();
        let same = OperationSpec::new("issue_refund", json!({})).intent_parts(vec![
            IntentPart::Text("refund".into()),
            IntentPart::Integer(42),
        ]);
        assert_eq!(spec.operation_id().unwrap(), same.operation_id().unwrap());
        assert_eq!(
            spec.lookup_hints,
            Some(json!({"order_id": 42, "label": "order-42"}))
        );
        assert_eq!(spec.lease_ttl, Some(Duration::from_secs(5)));
        // The policy's volatile fields, and the argument an explicit key may come from.
        assert_eq!(
            spec.volatile_fields,
            vec!["note".to_string(), "idempotency_key".to_string()]
        );
    }

    #[test]
    fn the_intent_names_the_operation_whatever_key_comes_with_it() {
        let policy = Policy::parse(POLICY).unwrap();
        let tool = policy.guarded("issue_refund").unwrap();
        let by = |p: Value| operation_id(tool, p);
        let first = by(json!({"arguments": {"order_id": 1, "idempotency_key": "k1"}}));
        let reissued = by(
            json!({"arguments": {"order_id": 1, "idempotency_key": "k2"}, "idempotencyKey": "k3"}),
        );
        assert_eq!(first, reissued);
    }

    #[test]
    fn an_explicit_key_names_the_operation_from_any_configured_source() {
        let policy = Policy::parse("[tools.issue_refund]\n").unwrap();
        let tool = policy.guarded("issue_refund").unwrap();
        let by = |p: Value| operation_id(tool, p);
        let argument = by(json!({"arguments": {"order_id": 1, "idempotency_key": "k1"}}));
        let meta =
            by(json!({"arguments": {"order_id": 1}, "_meta": {"once/idempotency_key": "k1"}}));
        let request = by(json!({"arguments": {"order_id": 1}, "idempotencyKey": "k1"}));
        assert_eq!(argument, "issue_refund:x:k1");
        assert_eq!(meta, argument);
        assert_eq!(request, argument);
        let only_meta = Policy::parse("[tools.t]\nkey = [\"meta\"]\n").unwrap();
        let t = only_meta.guarded("t").unwrap();
        let derived = t
            .spec(
                "t",
                &params(json!({"arguments": {"a": 1}, "idempotencyKey": "k1"})),
            )
            .unwrap()
            .operation_id()
            .unwrap();
        assert!(derived.starts_with("t:h:"), "{derived}");
    }

    #[test]
    fn a_number_names_the_same_operation_however_it_is_spelled() {
        let policy = Policy::parse("[tools.t]\nintent = [\"ord-{/n}\", \"{/n}\"]\n").unwrap();
        let tool = policy.guarded("t").unwrap();
        let by = |text: &str| {
            let arguments: Value = serde_json::from_str(&format!("{{\"n\": {text}}}")).unwrap();
            tool.spec("t", &params(json!({ "arguments": arguments })))
                .unwrap()
                .operation_id()
                .unwrap()
        };
        assert_eq!(by("42"), by("42.0"));
        assert_eq!(by("42"), by("4.2e1"));
        assert_eq!(by("0"), by("-0"));
        assert_ne!(by("42"), by("43"));
    }

    #[test]
    fn a_missing_intent_argument_is_refused_not_guessed() {
        let policy = Policy::parse(POLICY).unwrap();
        let tool = policy.guarded("issue_refund").unwrap();
        let refused = tool
            .spec("issue_refund", &params(json!({"arguments": {"amount": 5}})))
            .unwrap_err();
        assert!(refused.to_string().contains("/order_id"), "{refused}");
    }

    #[test]
    fn the_provider_key_is_carried_where_the_policy_says() {
        let request = crate::message::parse(
            br#"{"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                 "params": {"name": "t", "arguments": {"a": 1, "idempotency_key": "client"}}}"#,
        )
        .unwrap();
        let carried = |sink: KeySink, request: &Json| {
            let mut request = request.clone();
            sink.carry(&mut request, "pk-1");
            request.to_value()
        };
        let argument = carried(KeySink::Argument("idempotency_key".into()), &request);
        assert_eq!(
            argument["params"]["arguments"],
            json!({"a": 1, "idempotency_key": "pk-1"})
        );
        let meta = carried(KeySink::Meta, &request);
        assert_eq!(meta["params"]["_meta"]["once/provider_key"], "pk-1");
        assert_eq!(
            meta["params"]["arguments"],
            json!({"a": 1, "idempotency_key": "client"})
        );
        // Arguments sent as null still carry the key.
        let bare = crate::message::parse(
            br#"{"id": 1, "method": "tools/call", "params": {"name": "t", "arguments": null}}"#,
        )
        .unwrap();
        let argument = carried(KeySink::Argument("request_key".into()), &bare);
        assert_eq!(
            argument["params"]["arguments"],
            json!({"request_key": "pk-1"})
        );
    }

    #[test]
    fn key_arguments_leave_the_fingerprint_so_a_fresh_key_meets_the_fresh_id_guard() {
        let policy = Policy::parse(
            "[tools.transfer]\nkey = [\"argument:request_id\"]\nprovider_key = \"argument:pk\"\n",
        )
        .unwrap();
        let tool = policy.guarded("transfer").unwrap();
        let spec = |arguments: Value| {
            tool.spec("transfer", &params(json!({ "arguments": arguments })))
                .unwrap()
                .resolve()
                .unwrap()
        };
        let (first_id, first_fingerprint) = spec(json!({"to": "acct_1", "request_id": "r1"}));
        let (again_id, again_fingerprint) =
            spec(json!({"to": "acct_1", "request_id": "r2", "pk": "whatever"}));
        assert_eq!(first_id, "transfer:x:r1");
        assert_eq!(again_id, "transfer:x:r2");
        assert_eq!(first_fingerprint, again_fingerprint);
        let (_, other) = spec(json!({"to": "acct_2", "request_id": "r3"}));
        assert_ne!(other, first_fingerprint);
    }

    #[test]
    fn the_paths_a_policy_reads_are_known() {
        let policy = Policy::parse(POLICY).unwrap();
        let mut read = policy.guarded("issue_refund").unwrap().paths_read();
        read.sort();
        read.dedup();
        let path = |parts: &[&str]| parts.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        assert_eq!(
            read,
            vec![
                path(&["idempotency_key"]),
                path(&["note"]),
                path(&["order_id"]),
            ]
        );
        let nested = Policy::parse("[tools.t]\nintent = [\"{/order/id~1x}\"]\n").unwrap();
        assert!(nested
            .guarded("t")
            .unwrap()
            .paths_read()
            .contains(&path(&["order", "id/x"])));
    }

    #[test]
    fn bad_policies_are_refused_at_load() {
        for (text, says) in [
            ("[tools.t]\nintent = [\"{order_id}\"]\n", "JSON pointer"),
            ("[tools.t]\nintent = [\"{/order_id\"]\n", "unclosed"),
            ("[tools.t]\nkey = [\"header\"]\n", "key source"),
            ("[tools.t]\non_error = \"maybe\"\n", "on_error"),
            ("[tools.t]\nleese = \"5s\"\n", "leese"),
            ("[tools.t]\nintent = []\n", "at least one part"),
            ("[tools.t]\nprovider_key = \"header\"\n", "provider_key"),
        ] {
            let refused = Policy::parse(text).unwrap_err().to_string();
            assert!(refused.contains(says), "{text}: {refused}");
        }
    }
}
