//! Fuzzing of the decoders that take what a caller sent: canonical JSON, tool arguments,
//! operation ids and once-id-v1 intent parts. Each runs PROPTEST_CASES cases (256 in
//! `make test`, far more under `make fuzz`); a failing case is kept in
//! `proptest-regressions/` and runs first ever after.

use proptest::prelude::*;

use crate::fuzzing::{json_value, near_json};
use crate::identity::{CanonicalArguments, OperationId};
use crate::jcs;
use crate::once_id::{self, IntentPart};

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
