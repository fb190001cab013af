//! Fuzzing of the decoders that take what a caller sent: canonical JSON, tool arguments,
//! operation ids and once-id-v1 intent parts. Each runs PROPTEST_CASES cases (256 in
//! `make test`, far more under `make fuzz`); a failing case is kept in
//! `proptest-regressions/` and runs first ever after.

use proptest::prelude::*;
use serde_json::Value;

use crate::identity::{CanonicalArguments, OperationId};
use crate::jcs;
use crate::once_id::{self, IntentPart};

/// Any JSON value, a few levels deep, with the numbers and strings that trouble encoders.
pub(crate) fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON holds finite numbers", |f| f.is_finite())
            .prop_map(Value::from),
        prop_oneof![
            Just(9_007_199_254_740_992.0),
            Just(-0.0),
            Just(1e21),
            Just(5e-324)
        ]
        .prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
        "[\\u{0}-\\u{1f}\"\\\\\u{2028}\u{fffd}]{0,4}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("\\PC{0,8}", inner, 0..6)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

/// A text near JSON: a value's text with a few characters replaced, deleted or inserted.
pub(crate) fn near_json() -> impl Strategy<Value = String> {
    let edit = (any::<prop::sample::Index>(), any::<char>(), 0..3u8);
    (json_value(), prop::collection::vec(edit, 0..4)).prop_map(|(value, edits)| {
        let mut chars: Vec<char> = value.to_string().chars().collect();
        for (at, c, how) in edits {
            if chars.is_empty() {
                chars.push(c);
                continue;
            }
            let i = at.index(chars.len());
            match how {
                0 => chars[i] = c,
                1 => {
                    chars.remove(i);
                }
                _ => chars.insert(i, c),
            }
        }
        chars.into_iter().collect()
    })
}

/// Any text a caller could send: near JSON, or anything at all.
fn sent() -> impl Strategy<Value = String> {
    prop_oneof![near_json(), any::<String>(), "[ -~]{0,40}"]
}

proptest! {
    /// Canonical JSON parses or refuses; what it accepts canonicalises to a fixed point.
    #[test]
    fn fuzz_canonical_json_is_a_fixed_point(text in sent()) {
        if let Ok(canonical) = jcs::canonicalize_str(&text) {
            prop_assert_eq!(jcs::canonicalize_str(&canonical), Ok(canonical.clone()));
        }
    }

    /// Tool arguments parse or are refused with a reason; accepted ones have one fingerprint
    /// however they were spelled, and their derived id is an id or a refusal.
    #[test]
    fn fuzz_arguments_parse_or_refuse(
        text in sent(),
        volatile in prop::collection::vec("\\PC{0,6}", 0..3),
        tool in "[a-z_]{1,12}",
    ) {
        if let Ok(arguments) = CanonicalArguments::parse("arguments_json", &text, &volatile) {
            let again = CanonicalArguments::parse("arguments_json", &arguments.canonical, &[])
                .expect("canonical arguments parse again");
            prop_assert_eq!(again.fingerprint(), arguments.fingerprint());
            let _ = arguments.derived_id(&tool);
        }
    }

    /// An operation id parses or is refused; an accepted one is itself again.
    #[test]
    fn fuzz_operation_ids_parse_or_refuse(text in sent()) {
        if let Ok(id) = OperationId::parse("operation_id", &text) {
            prop_assert_eq!(id.as_str(), text.as_str());
            prop_assert_eq!(OperationId::parse("operation_id", id.as_str()).unwrap(), id);
        }
    }

    /// Intent parts are read from any JSON or refused; the id of accepted parts is the same
    /// every time and is an operation id.
    #[test]
    fn fuzz_intent_parts_make_one_id(values in prop::collection::vec(json_value(), 0..5)) {
        let parts: Result<Vec<IntentPart>, String> =
            values.iter().map(IntentPart::from_json).collect();
        if let Ok(parts) = parts {
            let id = once_id::operation_id(&parts);
            prop_assert_eq!(&id, &once_id::operation_id(&parts));
            if let Ok(id) = id {
                prop_assert!(OperationId::parse("operation_id", &id).is_ok(), "{}", id);
            }
        }
    }
}
