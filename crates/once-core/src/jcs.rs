//! RFC 8785 JSON Canonicalization Scheme (JCS).
//!
//! Two callers that mean the same arguments must hash the same bytes, whatever their JSON
//! library's key order, whitespace or number spelling. JCS fixes all three: object members sorted
//! by UTF-16 code units, no insignificant whitespace, numbers printed as ECMAScript prints an
//! IEEE-754 double, and a minimal string escaping.

use serde_json::Value;

use crate::once_id::MAX_SAFE_INTEGER;

/// Parses `text` and returns its canonical form, or the parser's complaint.
pub fn canonicalize_str(text: &str) -> Result<String, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    Ok(canonicalize(&value))
}

/// The canonical JSON text of `value`.
pub fn canonicalize(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&format_number(n.as_f64().unwrap_or(f64::NAN))),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (key, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, key);
                out.push(':');
                write_value(out, item);
            }
            out.push('}');
        }
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Formats a double the way ECMAScript's `Number.prototype.toString` does (shortest
/// round-trip digits, ties to even, JavaScript's exponent rules).
///
/// JSON cannot carry NaN or infinities, so they never reach here from parsed input; they are
/// printed as `null`, as `JSON.stringify` would.
pub fn format_number(x: f64) -> String {
    if !x.is_finite() {
        return "null".to_owned();
    }
    ryu_js::Buffer::new().format_finite(x).to_owned()
}

/// One step of a path into a JSON document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Key(String),
    Index(usize),
}

/// A path as people write it: `items[3].channel_id`.
pub fn path_string(path: &[Step]) -> String {
    let mut out = String::new();
    for step in path {
        match step {
            Step::Key(key) if out.is_empty() => out.push_str(key),
            Step::Key(key) => {
                out.push('.');
                out.push_str(key);
            }
            Step::Index(index) => out.push_str(&format!("[{index}]")),
        }
    }
    out
}

/// The first number in `value` beyond ±(2^53 − 1), with its path. Canonical JSON prints every
/// number as a double, and beyond that magnitude doubles are spaced two or more apart: two
/// different numbers there may canonicalise (and fingerprint) alike, however they were written
/// (`1234567890123456789`, `9007199254740993.0`, `1e20`).
pub fn first_unsafe_number(value: &Value) -> Option<(Vec<Step>, String)> {
    match value {
        Value::Number(n) => {
            let max = MAX_SAFE_INTEGER.unsigned_abs();
            let beyond = n.as_u64().is_some_and(|v| v > max)
                || n.as_i64().is_some_and(|v| v.unsigned_abs() > max)
                || n.as_f64().is_some_and(|v| v.abs() > max as f64);
            beyond.then(|| (Vec::new(), n.to_string()))
        }
        Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            first_unsafe_number(item).map(|(mut path, n)| {
                path.insert(0, Step::Index(i));
                (path, n)
            })
        }),
        Value::Object(map) => map.iter().find_map(|(key, item)| {
            first_unsafe_number(item).map(|(mut path, n)| {
                path.insert(0, Step::Key(key.clone()));
                (path, n)
            })
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 8785 Appendix B: IEEE-754 bit patterns and their canonical text.
    #[test]
    fn rfc8785_number_serialisation() {
        let cases: &[(u64, &str)] = &[
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for (bits, expected) in cases {
            assert_eq!(
                format_number(f64::from_bits(*bits)),
                *expected,
                "bits {bits:#018x}"
            );
        }
    }

    /// RFC 8785 §3.2.2: the worked example.
    #[test]
    fn rfc8785_example_document() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canonicalize_str(input).unwrap(), expected);
    }

    /// RFC 8785 §3.2.3: members are ordered by UTF-16 code units, not by code points.
    #[test]
    fn rfc8785_key_ordering_by_utf16_code_units() {
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let canonical = canonicalize_str(input).unwrap();
        let value: serde_json::Value = serde_json::from_str(&canonical).unwrap();
        let order: Vec<&str> = value
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap())
            .collect();
        let positions: Vec<usize> = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ]
        .iter()
        .map(|name| canonical.find(name).unwrap())
        .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{canonical}");
        assert_eq!(order.len(), 7);
    }

    #[test]
    fn string_escaping() {
        let cases = [
            ("\u{0}", r#""\u0000""#),
            ("\u{1f}", r#""\u001f""#),
            ("\u{7f}", "\"\u{7f}\""),
            ("\u{8}\t\n\u{c}\r", r#""\b\t\n\f\r""#),
            ("/", r#""/""#),
            ("\u{2028}", "\"\u{2028}\""),
            ("é😀", "\"é😀\""),
        ];
        for (input, expected) in cases {
            let mut out = String::new();
            write_string(&mut out, input);
            assert_eq!(out, expected, "input {input:?}");
        }
    }

    #[test]
    fn whitespace_and_order_do_not_matter() {
        let a = canonicalize_str(r#"{ "b" : [1, 2.0, {"y":1,"x":2}], "a": "z" }"#).unwrap();
        let b = canonicalize_str(r#"{"a":"z","b":[1.0,2,{"x":2,"y":1}]}"#).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, r#"{"a":"z","b":[1,2,{"x":2,"y":1}]}"#);
    }

    #[test]
    fn large_integers_are_doubles() {
        assert_eq!(
            canonicalize_str("9007199254740993").unwrap(),
            "9007199254740992"
        );
        assert!(
            canonicalize_str("1e400").is_err(),
            "numbers beyond a double are refused"
        );
    }

    #[test]
    fn numbers_beyond_the_safe_range_are_found_with_their_paths() {
        for (text, path) in [
            (r#"{"channel_id": 1234567890123456789}"#, "channel_id"),
            (r#"{"list": [1, {"id": -9007199254740992}]}"#, "list[1].id"),
            (r#"{"big": 123456789012345678901234567890}"#, "big"),
            (r#"{"x": 9007199254740993.0}"#, "x"),
            (r#"{"x": 1e20}"#, "x"),
        ] {
            let value: Value = serde_json::from_str(text).unwrap();
            let (found, _) = first_unsafe_number(&value).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(path_string(&found), path, "{text}");
        }
        let safe = serde_json::json!({"a": [9007199254740991_u64, -9007199254740991_i64, 1.5, 1e15], "s": "1234567890123456789"});
        assert_eq!(first_unsafe_number(&safe), None);
    }

    #[test]
    fn invalid_json_is_refused() {
        for bad in ["", "{", "{\"a\":}", "[1,]", "nul", "\"\\ud800\""] {
            assert!(canonicalize_str(bad).is_err(), "{bad:?}");
        }
    }
}
