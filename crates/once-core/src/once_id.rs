//! once-id-v1: operation ids from intent parts, byte-compatible with the public Once SDKs.
//!
//! The id is `<readable prefix>:<first 32 hex digits of a SHA-256 digest>`; the digest covers
//! every rendered part with its length, so no choice of separator characters inside a part can
//! make two different intents collide.

use sha2::{Digest, Sha256};

use crate::error::Invalid;

/// The largest integer every language's JSON numbers represent exactly: 2^53 − 1.
pub const MAX_SAFE_INTEGER: i64 = 9_007_199_254_740_991;

/// The reason code for a refused intent, shared with the other SDKs.
pub const INVALID_OPERATION_ID: &str = "invalid_operation_id";

/// One element of a business intent.
#[derive(Debug, Clone, PartialEq)]
pub enum IntentPart {
    Text(String),
    Integer(i64),
    /// A JSON-style number; valid only when it is integral and within the safe range.
    Number(f64),
}

impl IntentPart {
    /// Renders the part as the bytes that enter the digest, or says why it cannot be used.
    pub fn render(&self) -> Result<String, String> {
        match self {
            IntentPart::Text(s) => Ok(s.clone()),
            IntentPart::Integer(n) => render_integer(*n),
            IntentPart::Number(x) => {
                if !x.is_finite() {
                    return Err(format!(
                        "{INVALID_OPERATION_ID}: {x} is not a finite number"
                    ));
                }
                if x.fract() != 0.0 {
                    return Err(format!("{INVALID_OPERATION_ID}: {x} is not an integer"));
                }
                if x.abs() > MAX_SAFE_INTEGER as f64 {
                    return Err(out_of_range(x));
                }
                // Integral and within ±2^53−1, so the conversion is exact; -0.0 becomes 0.
                render_integer(*x as i64)
            }
        }
    }

    /// Reads a part from JSON, refusing every kind once-id-v1 does not accept.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        match value {
            Value::String(s) => Ok(IntentPart::Text(s.clone())),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Ok(IntentPart::Integer(i))
                } else if let Some(u) = n.as_u64() {
                    Err(out_of_range(u))
                } else {
                    Ok(IntentPart::Number(n.as_f64().unwrap_or(f64::NAN)))
                }
            }
            Value::Bool(_) => Err(format!(
                "{INVALID_OPERATION_ID}: booleans are not intent parts"
            )),
            Value::Null => Err(format!(
                "{INVALID_OPERATION_ID}: null is not an intent part"
            )),
            Value::Array(_) => Err(format!(
                "{INVALID_OPERATION_ID}: arrays are not intent parts"
            )),
            Value::Object(_) => Err(format!(
                "{INVALID_OPERATION_ID}: objects are not intent parts"
            )),
        }
    }
}

fn out_of_range(n: impl std::fmt::Display) -> String {
    format!("{INVALID_OPERATION_ID}: {n} is outside ±{MAX_SAFE_INTEGER}")
}

fn render_integer(n: i64) -> Result<String, String> {
    if n.unsigned_abs() > MAX_SAFE_INTEGER as u64 {
        return Err(out_of_range(n));
    }
    Ok(n.to_string())
}

/// Builds the once-id-v1 operation id for `parts`.
///
/// Errors name the offending part by index (`parts[2]`).
pub fn operation_id(parts: &[IntentPart]) -> Result<String, Invalid> {
    if parts.is_empty() {
        return Err(Invalid::new(
            "parts",
            format!("{INVALID_OPERATION_ID}: at least one intent part is required"),
        )
        .with_code("INVALID_OPERATION_ID"));
    }
    let rendered = parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.render().map_err(|m| {
                Invalid::new(format!("parts[{i}]"), m).with_code("INVALID_OPERATION_ID")
            })
        })
        .collect::<Result<Vec<_>, _>>()?;

    let mut hasher = Sha256::new();
    hasher.update(b"once-id-v1\0");
    hasher.update(len_u32(rendered.len())?.to_be_bytes());
    for part in &rendered {
        hasher.update(len_u32(part.len())?.to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hex::encode(hasher.finalize());
    Ok(format!(
        "{}:{}",
        readable_prefix(&rendered[0]),
        &digest[..32]
    ))
}

fn len_u32(n: usize) -> Result<u32, Invalid> {
    u32::try_from(n).map_err(|_| Invalid::new("parts", "intent is too large"))
}

/// The human-readable prefix, from the first rendered part.
pub fn readable_prefix(first: &str) -> String {
    let allowed = |c: char| matches!(c, 'a'..='z' | '0'..='9' | '.' | '_' | ':' | '-');
    let mut replaced = String::with_capacity(first.len());
    let mut in_run = false;
    for c in first.chars().map(|c| c.to_ascii_lowercase()) {
        if allowed(c) {
            replaced.push(c);
            in_run = false;
        } else if !in_run {
            replaced.push('-');
            in_run = true;
        }
    }
    let trimmed = replaced
        .trim_start_matches(|c: char| !c.is_ascii_lowercase() && !c.is_ascii_digit())
        .trim_end_matches('-');
    // Every remaining character is ASCII, so byte and character counts agree.
    let prefix: String = trimmed.chars().take(48).collect();
    if prefix.is_empty() {
        "operation".to_owned()
    } else {
        prefix
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> IntentPart {
        IntentPart::Text(s.to_owned())
    }

    fn check(parts: &[IntentPart], expected: &str) {
        assert_eq!(operation_id(parts).unwrap(), expected, "parts: {parts:?}");
    }

    #[test]
    fn shared_examples() {
        check(
            &[text("order"), text("123")],
            "order:811f7fc3e6463f1ebe36518adfb37345",
        );
        check(
            &[text("Order Created"), text("ABC")],
            "order-created:f54fb3f736237d6e895b356232cf456b",
        );
        check(
            &[text("order"), IntentPart::Integer(42)],
            "order:40ffb083c1b146b4786b631bcbf0b5c2",
        );
    }

    #[test]
    fn integral_numbers_render_as_integers() {
        let as_int = operation_id(&[text("order"), IntentPart::Integer(42)]).unwrap();
        assert_eq!(
            operation_id(&[text("order"), IntentPart::Number(42.0)]).unwrap(),
            as_int
        );
        let zero = operation_id(&[text("n"), IntentPart::Integer(0)]).unwrap();
        assert_eq!(
            operation_id(&[text("n"), IntentPart::Number(-0.0)]).unwrap(),
            zero
        );
        // A number part and the same digits as text are the same bytes in the digest.
        assert_eq!(operation_id(&[text("order"), text("42")]).unwrap(), as_int);
    }

    #[test]
    fn integer_limits() {
        let max = MAX_SAFE_INTEGER;
        assert!(operation_id(&[IntentPart::Integer(max)]).is_ok());
        assert!(operation_id(&[IntentPart::Integer(-max)]).is_ok());
        assert!(operation_id(&[IntentPart::Integer(max + 1)]).is_err());
        assert!(operation_id(&[IntentPart::Integer(-max - 1)]).is_err());
        assert!(operation_id(&[IntentPart::Integer(i64::MIN)]).is_err());
        assert!(operation_id(&[IntentPart::Number(max as f64)]).is_ok());
        assert!(operation_id(&[IntentPart::Number(9_007_199_254_740_992.0)]).is_err());
        assert_eq!(
            IntentPart::Integer(-max).render().unwrap(),
            "-9007199254740991"
        );
    }

    #[test]
    fn every_invalid_kind_is_refused() {
        for bad in [
            IntentPart::Number(1.5),
            IntentPart::Number(f64::NAN),
            IntentPart::Number(f64::INFINITY),
            IntentPart::Number(f64::NEG_INFINITY),
            IntentPart::Number(1e300),
        ] {
            let err = operation_id(&[text("x"), bad.clone()]).unwrap_err();
            assert_eq!(err.field, "parts[1]", "{bad:?}");
            assert!(err.message.starts_with(INVALID_OPERATION_ID));
        }
        for json in [
            "true",
            "null",
            "[]",
            "{}",
            "1.5",
            "18446744073709551615",
            "-9007199254740992",
        ] {
            let value: serde_json::Value = serde_json::from_str(json).unwrap();
            let refused = IntentPart::from_json(&value).and_then(|p| p.render());
            assert!(refused.is_err(), "{json} must be refused");
        }
        assert_eq!(operation_id(&[]).unwrap_err().field, "parts");
    }

    #[test]
    fn prefix_rules() {
        let cases = [
            ("", "operation"),
            ("!!!", "operation"),
            ("---", "operation"),
            ("__abc", "abc"),
            ("-.:x", "x"),
            ("Hello  World!!", "hello-world"),
            ("a--b", "a--b"),
            ("a - b", "a---b"),
            ("abc-", "abc"),
            ("abc_", "abc_"),
            ("abc:", "abc:"),
            ("ÉCOLE école", "cole-cole"),
            ("日本語", "operation"),
            ("a\0b", "a-b"),
            ("tenant:order", "tenant:order"),
        ];
        for (input, expected) in cases {
            assert_eq!(readable_prefix(input), expected, "input {input:?}");
        }
        let long = "x".repeat(100);
        assert_eq!(readable_prefix(&long), "x".repeat(48));
        // Truncation happens after trimming, so the prefix may end in a hyphen.
        let hyphen_at_48 = format!("{}!b", "a".repeat(47));
        assert_eq!(
            readable_prefix(&hyphen_at_48),
            format!("{}-", "a".repeat(47))
        );
    }

    #[test]
    fn separators_and_nul_inside_parts_do_not_collide() {
        let a = operation_id(&[text("a\0b"), text("c")]).unwrap();
        let b = operation_id(&[text("a"), text("b\0c")]).unwrap();
        let c = operation_id(&[text("a:b"), text("c")]).unwrap();
        let d = operation_id(&[text("a"), text("b:c")]).unwrap();
        let ids = [a, b, c, d];
        for i in 0..ids.len() {
            for j in i + 1..ids.len() {
                assert_ne!(ids[i].rsplit(':').next(), ids[j].rsplit(':').next());
            }
        }
    }

    #[test]
    fn strings_are_not_normalised() {
        let composed = operation_id(&[text("caf\u{e9}")]).unwrap();
        let decomposed = operation_id(&[text("cafe\u{301}")]).unwrap();
        assert_ne!(composed, decomposed);
        assert_ne!(
            operation_id(&[text(" a")]).unwrap(),
            operation_id(&[text("a")]).unwrap()
        );
    }
}
