//! Describing an operation: its tool, its identity, its arguments and its lookup hints.

use std::time::Duration;

use once_core::identity::{CanonicalArguments, IDEMPOTENCY_KEY_FIELD};
use once_core::once_id::IntentPart;
use once_core::Invalid;
use serde_json::Value;

use crate::AttemptContext;

/// The `_meta` key of an MCP request that carries an explicit idempotency key, for clients that
/// cannot add an `idempotency_key` argument to the tool's input.
pub const META_IDEMPOTENCY_KEY: &str = "once/idempotency_key";

/// How the operation is named.
#[derive(Debug, Clone, PartialEq)]
pub enum Identity {
    /// An id the application chose, e.g. `customer_91:create_order:cart_733`.
    Explicit(String),
    /// Business intent; the id is once-id-v1 over the parts.
    Intent(Vec<IntentPart>),
    /// `tool:x:<idempotency_key>` when the arguments carry one, else `tool:h:<hash>` of the
    /// canonical arguments.
    Derived,
}

/// Everything the ledger needs to know about one logical operation.
#[derive(Debug, Clone)]
pub struct OperationSpec {
    pub tool: String,
    pub identity: Identity,
    /// The arguments that define the effect; they are fingerprinted, never sent.
    pub arguments: Value,
    /// Top-level argument names left out of the fingerprint (nonces, client timestamps).
    pub volatile_fields: Vec<String>,
    /// The reconciler that can look the operation up at the provider, and its hints.
    pub provider: Option<String>,
    pub lookup_hints: Option<Value>,
    pub lease_ttl: Option<Duration>,
    /// How long Begin may wait for an operation in progress elsewhere to settle.
    pub wait: Option<Duration>,
    pub retention: Option<Duration>,
    /// Declares a new business intent, overriding the fresh-id guard.
    pub new_intent: bool,
    pub context: AttemptContext,
    /// Ask for the signed receipt with a REPLAY answer ([`crate::Replay::receipt`]).
    pub want_receipt: bool,
}

impl OperationSpec {
    /// An operation of `tool` over `arguments` (a JSON object), identified by its arguments
    /// until [`explicit`](Self::explicit) or [`intent`](Self::intent) says otherwise.
    pub fn new(tool: impl Into<String>, arguments: Value) -> Self {
        Self {
            tool: tool.into(),
            identity: Identity::Derived,
            arguments,
            volatile_fields: Vec::new(),
            provider: None,
            lookup_hints: None,
            lease_ttl: None,
            wait: None,
            retention: None,
            new_intent: false,
            context: AttemptContext::default(),
            want_receipt: false,
        }
    }

    /// Asks for the ledger's signed receipt with a REPLAY answer.
    pub fn with_receipt(mut self) -> Self {
        self.want_receipt = true;
        self
    }

    pub fn explicit(mut self, operation_id: impl Into<String>) -> Self {
        self.identity = Identity::Explicit(operation_id.into());
        self
    }

    /// Names the operation by text intent parts, e.g. `["refund", order_id]`.
    pub fn intent<I, S>(mut self, parts: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.identity = Identity::Intent(
            parts
                .into_iter()
                .map(|p| IntentPart::Text(p.into()))
                .collect(),
        );
        self
    }

    /// Names the operation by intent parts that may include integers.
    pub fn intent_parts(mut self, parts: Vec<IntentPart>) -> Self {
        self.identity = Identity::Intent(parts);
        self
    }

    /// Uses an explicit key when the caller gave one: the `idempotency_key` argument, or else
    /// `key` (e.g. from the request's `_meta`). The operation becomes `tool:x:<key>`.
    pub fn explicit_key(mut self, key: Option<&str>) -> Self {
        let from_arguments = self
            .arguments
            .get(IDEMPOTENCY_KEY_FIELD)
            .and_then(Value::as_str)
            .map(str::to_owned);
        if let Some(key) = from_arguments.or(key.map(str::to_owned)) {
            self.identity = Identity::Explicit(format!("{}:x:{key}", self.tool));
        }
        self
    }

    pub fn volatile(mut self, fields: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.volatile_fields = fields.into_iter().map(Into::into).collect();
        self
    }

    pub fn provider(mut self, name: impl Into<String>, lookup_hints: Value) -> Self {
        self.provider = Some(name.into());
        self.lookup_hints = Some(lookup_hints);
        self
    }

    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = Some(ttl);
        self
    }

    pub fn wait(mut self, bound: Duration) -> Self {
        self.wait = Some(bound);
        self
    }

    pub fn context(mut self, context: AttemptContext) -> Self {
        self.context = context;
        self
    }

    /// The operation id and fingerprint, computed here exactly as the ledger would.
    pub fn resolve(&self) -> Result<(String, String), Invalid> {
        let canonical = self.canonical()?;
        let id = match &self.identity {
            Identity::Derived => canonical.derived_id(&self.tool)?.to_string(),
            named => Self::named(named)?,
        };
        Ok((id, canonical.fingerprint().to_hex()))
    }

    /// The operation id alone, as the ledger would compute it. An explicit or intent identity
    /// needs no arguments: a status tool names the operation without inventing any.
    pub fn operation_id(&self) -> Result<String, Invalid> {
        match &self.identity {
            Identity::Derived => Ok(self.canonical()?.derived_id(&self.tool)?.to_string()),
            named => Self::named(named),
        }
    }

    fn named(identity: &Identity) -> Result<String, Invalid> {
        match identity {
            Identity::Explicit(id) => Ok(id.clone()),
            Identity::Intent(parts) => Ok(once_core::once_id::operation_id(parts)?),
            Identity::Derived => Err(Invalid::new("identity", "is derived from the arguments")),
        }
    }

    fn canonical(&self) -> Result<CanonicalArguments, Invalid> {
        let Value::Object(map) = &self.arguments else {
            return Err(Invalid::new("arguments", "must be a JSON object"));
        };
        CanonicalArguments::from_object("arguments", map.clone(), &self.volatile_fields)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn derived_ids_drop_volatile_fields_and_ignore_key_order() {
        let a = OperationSpec::new("refund", json!({"order": "o1", "amount": 5, "nonce": 1}))
            .volatile(["nonce"]);
        let b = OperationSpec::new("refund", json!({"nonce": 2, "amount": 5.0, "order": "o1"}))
            .volatile(["nonce"]);
        assert_eq!(a.resolve().unwrap(), b.resolve().unwrap());
        assert!(a.resolve().unwrap().0.starts_with("refund:h:"));
        let c = OperationSpec::new("refund", json!({"order": "o1", "amount": 6}));
        assert_ne!(a.resolve().unwrap().1, c.resolve().unwrap().1);
    }

    #[test]
    fn explicit_key_from_arguments_wins_over_meta() {
        let args = json!({"order": "o1", "idempotency_key": "k1"});
        let spec = OperationSpec::new("refund", args)
            .intent(["refund", "o1"])
            .explicit_key(Some("meta-key"));
        assert_eq!(spec.resolve().unwrap().0, "refund:x:k1");
        let spec =
            OperationSpec::new("refund", json!({"order": "o1"})).explicit_key(Some("meta-key"));
        assert_eq!(spec.resolve().unwrap().0, "refund:x:meta-key");
        let spec = OperationSpec::new("refund", json!({"order": "o1"}))
            .intent(["refund", "o1"])
            .explicit_key(None);
        let intent_id = once_core::once_id::operation_id(&[
            IntentPart::Text("refund".into()),
            IntentPart::Text("o1".into()),
        ])
        .unwrap();
        assert_eq!(
            spec.resolve().unwrap().0,
            intent_id,
            "without a key the intent names it"
        );
    }

    #[test]
    fn the_key_is_not_part_of_the_fingerprint() {
        let with_key =
            OperationSpec::new("refund", json!({"order": "o1", "idempotency_key": "k1"}))
                .explicit_key(None);
        let without = OperationSpec::new("refund", json!({"order": "o1"}));
        assert_eq!(with_key.resolve().unwrap().1, without.resolve().unwrap().1);
    }

    #[test]
    fn integers_beyond_the_safe_range_are_refused_before_anything_is_sent() {
        let a = OperationSpec::new("notify", json!({"channel_id": 1234567890123456789_u64}));
        let refused = a.resolve().unwrap_err();
        assert_eq!(refused.field, "arguments.channel_id");
        assert!(refused.message.contains("send it as a string"));
        let as_text = OperationSpec::new("notify", json!({"channel_id": "1234567890123456789"}));
        let other = OperationSpec::new("notify", json!({"channel_id": "1234567890123456788"}));
        assert_ne!(as_text.resolve().unwrap(), other.resolve().unwrap());
    }

    #[test]
    fn a_named_operation_needs_no_arguments_for_its_id() {
        let full = OperationSpec::new("refund", json!({"order": "o1", "amount": 5}))
            .intent(["refund", "o1"]);
        let bare = OperationSpec::new("refund", Value::Null).intent(["refund", "o1"]);
        assert_eq!(bare.operation_id().unwrap(), full.resolve().unwrap().0);
        let derived = OperationSpec::new("refund", json!({"order": "o1"}));
        assert_eq!(
            derived.operation_id().unwrap(),
            derived.resolve().unwrap().0
        );
        assert!(OperationSpec::new("refund", Value::Null)
            .operation_id()
            .is_err());
    }

    #[test]
    fn arguments_must_be_an_object() {
        assert!(OperationSpec::new("refund", json!([1])).resolve().is_err());
    }
}
