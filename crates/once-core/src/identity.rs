//! How a logical operation is named: validated ids, derived keys, fingerprints, provider keys.
//!
//! The identity of an operation comes from business intent and the authenticated tenant, never
//! from a transport attempt. This module turns each of the three ways a caller may express that
//! intent into one validated [`OperationId`].

use std::fmt;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::error::Invalid;
use crate::jcs;
use crate::model::FencingToken;

/// The argument that, when present, names the operation explicitly (`tool:x:<key>`).
pub const IDEMPOTENCY_KEY_FIELD: &str = "idempotency_key";
/// The longest operation id, in bytes.
pub const MAX_OPERATION_ID_BYTES: usize = 255;
/// The longest tool name, in bytes.
pub const MAX_TOOL_BYTES: usize = 128;

/// Checks a short identifier-like string: non-empty, at most `max` bytes, no control characters.
pub fn check_name(field: &str, value: &str, max: usize) -> Result<(), Invalid> {
    if value.is_empty() {
        return Err(Invalid::new(field, "must not be empty"));
    }
    if value.len() > max {
        return Err(Invalid::new(
            field,
            format!("must be at most {max} bytes, got {}", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(Invalid::new(field, "must not contain control characters"));
    }
    Ok(())
}

/// Checks free text such as a reason: at most `max` bytes; newlines and tabs are allowed.
pub fn check_text(field: &str, value: &str, max: usize) -> Result<(), Invalid> {
    if value.len() > max {
        return Err(Invalid::new(
            field,
            format!("must be at most {max} bytes, got {}", value.len()),
        ));
    }
    if value
        .chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t' && c != '\r')
    {
        return Err(Invalid::new(field, "must not contain control characters"));
    }
    Ok(())
}

/// A validated operation id: 1..=255 bytes of UTF-8 without control characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperationId(String);

impl OperationId {
    pub fn parse(field: &str, value: &str) -> Result<Self, Invalid> {
        check_name(field, value, MAX_OPERATION_ID_BYTES)?;
        Ok(Self(value.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Derived keys (`tool:h:<hash>`) are kept for a short time by default: they exist only to
    /// absorb retries, not to record a business fact.
    pub fn is_derived_hash(&self) -> bool {
        let Some((head, hash)) = self.0.rsplit_once(':') else {
            return false;
        };
        head.ends_with(":h")
            && hash.len() == 32
            && hash
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// SHA-256 over the canonical arguments of an operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn of_canonical(canonical: &str) -> Self {
        Self(Sha256::digest(canonical.as_bytes()).into())
    }

    /// Parses 64 lowercase hex digits.
    pub fn parse_hex(field: &str, value: &str) -> Result<Self, Invalid> {
        let ok = value.len() == 64
            && value
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !ok {
            return Err(Invalid::new(
                field,
                "must be 64 lowercase hex digits (a SHA-256 digest)",
            ));
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(value, &mut bytes).map_err(|e| Invalid::new(field, e.to_string()))?;
        Ok(Self(bytes))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

/// Arguments of a tool call, canonicalised once and reused for both the fingerprint and the
/// derived key.
#[derive(Debug, Clone)]
pub struct CanonicalArguments {
    /// The value of an `idempotency_key` argument, if the caller gave one.
    pub idempotency_key: Option<String>,
    /// RFC 8785 text of the arguments without `idempotency_key` and the volatile fields.
    pub canonical: String,
}

impl CanonicalArguments {
    /// Parses `json` (an object), drops `idempotency_key` and every listed volatile field, and
    /// canonicalises the rest. `field` names the arguments in errors.
    pub fn parse(field: &str, json: &str, volatile_fields: &[String]) -> Result<Self, Invalid> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| Invalid::new(field, format!("invalid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Invalid::new(field, "must be a JSON object"));
        };
        Self::from_object(field, map, volatile_fields)
    }

    pub fn from_object(
        field: &str,
        mut map: Map<String, Value>,
        volatile_fields: &[String],
    ) -> Result<Self, Invalid> {
        let idempotency_key = match map.remove(IDEMPOTENCY_KEY_FIELD) {
            None | Some(Value::Null) => None,
            Some(Value::String(key)) => {
                check_name(
                    &format!("{field}.{IDEMPOTENCY_KEY_FIELD}"),
                    &key,
                    MAX_OPERATION_ID_BYTES,
                )?;
                Some(key)
            }
            Some(_) => {
                return Err(Invalid::new(
                    format!("{field}.{IDEMPOTENCY_KEY_FIELD}"),
                    "must be a string",
                ))
            }
        };
        for name in volatile_fields {
            map.remove(name);
        }
        let arguments = Value::Object(map);
        if let Some((path, literal)) = jcs::first_unsafe_number(&arguments) {
            return Err(unsafe_number(field, &path, &literal));
        }
        Ok(Self {
            idempotency_key,
            canonical: jcs::canonicalize(&arguments),
        })
    }

    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of_canonical(&self.canonical)
    }

    /// The derived operation id: `tool:x:<key>` when an idempotency key was given, else
    /// `tool:h:<first 32 hex digits of the fingerprint>`.
    pub fn derived_id(&self, tool: &str) -> Result<OperationId, Invalid> {
        let id = match &self.idempotency_key {
            Some(key) => format!("{tool}:x:{key}"),
            None => format!("{tool}:h:{}", &self.fingerprint().to_hex()[..32]),
        };
        OperationId::parse("operation_id", &id)
    }
}

/// Refuses a number that canonical JSON cannot keep exact, naming where it is.
fn unsafe_number(field: &str, path: &[jcs::Step], literal: &str) -> Invalid {
    let at = jcs::path_string(path);
    let field = if at.is_empty() {
        field.to_owned()
    } else {
        format!("{field}.{at}")
    };
    Invalid::new(
        field,
        format!(
            "{literal} is beyond ±(2^53−1); canonical JSON holds numbers as doubles, which beyond \
             that cannot tell it from its neighbours: send it as a string"
        ),
    )
}

/// The key handed to the downstream provider's own idempotency mechanism.
///
/// Stable for every attempt of one operation, different across tenants, and fresh when an
/// operation id starts a new life after retention (`life` identifies that life).
pub fn provider_key(tenant: &str, operation_id: &OperationId, life: FencingToken) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"once-provider-key-v1\0");
    for part in [tenant.as_bytes(), operation_id.as_str().as_bytes()] {
        hasher.update((part.len() as u32).to_be_bytes());
        hasher.update(part);
    }
    hasher.update(life.get().to_be_bytes());
    format!("once_{}", &hex::encode(hasher.finalize())[..40])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(json: &str, volatile: &[&str]) -> CanonicalArguments {
        let volatile: Vec<String> = volatile.iter().map(|s| s.to_string()).collect();
        CanonicalArguments::parse("arguments", json, &volatile).unwrap()
    }

    #[test]
    fn derived_ids_ignore_order_whitespace_and_volatile_fields() {
        let a = args(r#"{"order":"o1","amount":500,"nonce":"x1"}"#, &["nonce"]);
        let b = args(
            r#"{ "amount": 500.0, "order": "o1", "nonce": "y2" }"#,
            &["nonce"],
        );
        assert_eq!(a.canonical, r#"{"amount":500,"order":"o1"}"#);
        assert_eq!(
            a.derived_id("refund").unwrap(),
            b.derived_id("refund").unwrap()
        );
        assert_eq!(a.fingerprint(), b.fingerprint());
        let id = a.derived_id("refund").unwrap();
        assert!(id.as_str().starts_with("refund:h:"));
        assert_eq!(id.as_str().len(), "refund:h:".len() + 32);
        assert!(id.is_derived_hash());
        assert!(id.as_str().ends_with(&a.fingerprint().to_hex()[..32]));
    }

    #[test]
    fn explicit_idempotency_key_wins_and_is_not_fingerprinted() {
        let a = args(r#"{"order":"o1","idempotency_key":"k-1"}"#, &[]);
        let b = args(r#"{"order":"o1"}"#, &[]);
        assert_eq!(a.derived_id("refund").unwrap().as_str(), "refund:x:k-1");
        assert!(!a.derived_id("refund").unwrap().is_derived_hash());
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert!(CanonicalArguments::parse("arguments", r#"{"idempotency_key":5}"#, &[]).is_err());
        assert!(CanonicalArguments::parse("arguments", r#"{"idempotency_key":""}"#, &[]).is_err());
    }

    #[test]
    fn arguments_must_be_a_json_object() {
        for bad in ["[]", "1", "\"x\"", "{", ""] {
            let err = CanonicalArguments::parse("begin.arguments_json", bad, &[]).unwrap_err();
            assert_eq!(err.field, "begin.arguments_json");
        }
    }

    #[test]
    fn operation_id_rules() {
        assert!(OperationId::parse("id", "customer_91:create_order:cart_733").is_ok());
        assert!(OperationId::parse("id", "").is_err());
        assert!(OperationId::parse("id", &"x".repeat(255)).is_ok());
        assert!(OperationId::parse("id", &"x".repeat(256)).is_err());
        assert!(OperationId::parse("id", "a\nb").is_err());
        assert!(OperationId::parse("id", "a\u{7f}b").is_err());
        assert!(OperationId::parse("id", "ünïcode").is_ok());
    }

    #[test]
    fn provider_keys_are_stable_per_operation_and_differ_across_tenants() {
        let id = OperationId::parse("id", "refund:o1").unwrap();
        assert_eq!(
            provider_key("t1", &id, FencingToken(7)),
            provider_key("t1", &id, FencingToken(7))
        );
        assert_ne!(
            provider_key("t1", &id, FencingToken(7)),
            provider_key("t2", &id, FencingToken(7))
        );
        assert_ne!(
            provider_key("t1", &id, FencingToken(7)),
            provider_key("t1", &id, FencingToken(8))
        );
        let other = OperationId::parse("id", "refund:o2").unwrap();
        assert_ne!(
            provider_key("t1", &id, FencingToken(7)),
            provider_key("t1", &other, FencingToken(7))
        );
    }

    #[test]
    fn numbers_beyond_the_safe_range_are_refused_naming_their_path() {
        for json in [
            r#"{"channel_id": 1234567890123456789}"#,
            r#"{"channel_id": 123456789012345678901234567890}"#,
            r#"{"channel_id": 9007199254740993.0}"#,
        ] {
            let refused = CanonicalArguments::parse("arguments_json", json, &[]).unwrap_err();
            assert_eq!(refused.field, "arguments_json.channel_id", "{json}");
            assert!(refused.message.contains("send it as a string"));
        }
        let nested = CanonicalArguments::parse("a", r#"{"x": [{"y": -9007199254740992}]}"#, &[]);
        assert_eq!(nested.unwrap_err().field, "a.x[0].y");
        // Within range, as doubles, as strings, or left out of the fingerprint: accepted.
        for json in [
            r#"{"n": 9007199254740991, "m": -9007199254740991}"#,
            r#"{"n": 1.5e15, "s": "1234567890123456789"}"#,
            r#"{"nonce": 1234567890123456789, "idempotency_key": "k"}"#,
        ] {
            let volatile = vec!["nonce".to_owned()];
            assert!(
                CanonicalArguments::parse("a", json, &volatile).is_ok(),
                "{json}"
            );
        }
        let object = serde_json::json!({"channel_id": 1234567890123456789_u64});
        let Value::Object(map) = object else {
            unreachable!()
        };
        assert_eq!(
            CanonicalArguments::from_object("arguments", map, &[])
                .unwrap_err()
                .field,
            "arguments.channel_id"
        );
    }

    #[test]
    fn fingerprint_hex_round_trip() {
        let f = Fingerprint::of_canonical("{}");
        assert_eq!(Fingerprint::parse_hex("f", &f.to_hex()).unwrap(), f);
        assert!(Fingerprint::parse_hex("f", &f.to_hex().to_uppercase()).is_err());
        assert!(Fingerprint::parse_hex("f", "abc").is_err());
    }
}
