//! Strategies for fuzzing what callers send, shared by every crate that decodes it (built with
//! the `fuzzing` feature, for tests only): JSON values with the numbers and strings that trouble
//! encoders, and texts near a valid one.

use proptest::prelude::*;
use serde_json::Value;

/// Any JSON value, a few levels deep, with the numbers and strings that trouble encoders.
pub fn json_value() -> impl Strategy<Value = Value> {
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

/// `base` with up to `most` characters replaced, deleted or inserted.
pub fn edited(base: String, most: usize) -> impl Strategy<Value = String> {
    let edit = (any::<prop::sample::Index>(), any::<char>(), 0..3u8);
    prop::collection::vec(edit, 0..=most).prop_map(move |edits| {
        let mut chars: Vec<char> = base.chars().collect();
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

/// A text near JSON: a value's text with a few characters replaced, deleted or inserted.
pub fn near_json() -> impl Strategy<Value = String> {
    json_value().prop_flat_map(|value| edited(value.to_string(), 3))
}

/// A file a person wrote, `base`, mangled a little, or any text at all.
pub fn mangled(base: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![edited(base.to_owned(), 5), any::<String>()]
}
