//! The proxy's reading of a message: strict JSON, exactly one value, and the re-serialisation
//! that is forwarded in its place.
//!
//! Parsers disagree at JSON's edges: a UTF-8 byte-order mark, `NaN`, `1e400`, lone surrogate
//! escapes, duplicate keys (first or last wins), keys matched case-insensitively (Go), a bare
//! `\r` that ends a line (Python's universal newlines), several values on one line or one value
//! across several. A message that any of these make ambiguous is refused here, and what is
//! forwarded is never the client's bytes but [`Json::to_bytes`] of the tree the proxy judged:
//! compact, pure ASCII (every other character escaped), members in the order they came, numbers
//! as they were written. Every JSON parser reads that text as one and the same message.

use std::collections::HashMap;
use std::fmt::Write as _;

/// How deeply arrays and objects may nest.
const MAX_DEPTH: usize = 128;

/// A JSON value as the proxy parsed it.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// A number's text as it was written: valid JSON, finite as a double.
    Number(String),
    String(String),
    Array(Vec<Json>),
    /// Members in the order they came; no two names are the same, even after case folding.
    Object(Vec<(String, Json)>),
}

/// Why bytes are not one strict JSON value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}, at byte {at}")]
pub struct Malformed {
    pub what: String,
    pub at: usize,
}

/// Parses `bytes` as exactly one JSON value (RFC 8259, with nothing a lenient parser would
/// read differently): valid UTF-8 with no byte-order mark, no duplicate or case-folded
/// duplicate names in an object, no lone surrogate escapes, finite numbers only, nesting at
/// most 128 deep, and nothing but whitespace around the value.
pub fn parse(bytes: &[u8]) -> Result<Json, Malformed> {
    let text = std::str::from_utf8(bytes).map_err(|e| Malformed {
        what: "the message is not valid UTF-8".into(),
        at: e.valid_up_to(),
    })?;
    let mut parser = Parser {
        text: text.as_bytes(),
        at: 0,
        depth: 0,
    };
    parser.whitespace();
    let value = parser.value()?;
    parser.whitespace();
    if parser.at != parser.text.len() {
        return Err(parser.malformed(
            "more than one JSON value, or text after the value (send one message per line)",
        ));
    }
    Ok(value)
}

struct Parser<'t> {
    text: &'t [u8],
    at: usize,
    depth: usize,
}

impl Parser<'_> {
    fn malformed(&self, what: impl Into<String>) -> Malformed {
        Malformed {
            what: what.into(),
            at: self.at,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &str, value: Json) -> Result<Json, Malformed> {
        if self.text[self.at..].starts_with(word.as_bytes()) {
            self.at += word.len();
            Ok(value)
        } else {
            Err(self.malformed("not a JSON value"))
        }
    }

    fn value(&mut self) -> Result<Json, Malformed> {
        match self.peek() {
            Some(b'{') => self.nested(Self::object),
            Some(b'[') => self.nested(Self::array),
            Some(b'"') => self.string().map(Json::String),
            Some(b't') => self.literal("true", Json::Bool(true)),
            Some(b'f') => self.literal("false", Json::Bool(false)),
            Some(b'n') => self.literal("null", Json::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.malformed("not a JSON value")),
            None => Err(self.malformed("the message ends before its value")),
        }
    }

    fn nested(
        &mut self,
        inner: fn(&mut Self) -> Result<Json, Malformed>,
    ) -> Result<Json, Malformed> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.malformed(format!("nested more than {MAX_DEPTH} deep")));
        }
        let value = inner(self);
        self.depth -= 1;
        value
    }

    fn object(&mut self) -> Result<Json, Malformed> {
        self.at += 1;
        let mut members: Vec<(String, Json)> = Vec::new();
        let mut folded: HashMap<String, usize> = HashMap::new();
        self.whitespace();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(Json::Object(members));
        }
        loop {
            self.whitespace();
            if self.peek() != Some(b'"') {
                return Err(self.malformed("an object's member names are strings"));
            }
            let start = self.at;
            let name = self.string()?;
            if let Some(&earlier) = folded.get(&fold(&name)) {
                let earlier = &members[earlier].0;
                let what = if *earlier == name {
                    format!("the name {name:?} appears twice in one object")
                } else {
                    format!(
                        "the names {earlier:?} and {name:?} in one object are the same to a \
                         case-insensitive reader"
                    )
                };
                return Err(Malformed { what, at: start });
            }
            self.whitespace();
            if self.peek() != Some(b':') {
                return Err(self.malformed("expected ':' after a member name"));
            }
            self.at += 1;
            self.whitespace();
            let value = self.value()?;
            folded.insert(fold(&name), members.len());
            members.push((name, value));
            self.whitespace();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b'}') => {
                    self.at += 1;
                    return Ok(Json::Object(members));
                }
                _ => return Err(self.malformed("expected ',' or '}' in an object")),
            }
        }
    }

    fn array(&mut self) -> Result<Json, Malformed> {
        self.at += 1;
        let mut items = Vec::new();
        self.whitespace();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(Json::Array(items));
        }
        loop {
            self.whitespace();
            items.push(self.value()?);
            self.whitespace();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Ok(Json::Array(items));
                }
                _ => return Err(self.malformed("expected ',' or ']' in an array")),
            }
        }
    }

    fn number(&mut self) -> Result<Json, Malformed> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while matches!(p.peek(), Some(b'0'..=b'9')) {
                p.at += 1;
            }
            p.at - from
        };
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek() {
            Some(b'0') => {
                self.at += 1;
                if matches!(self.peek(), Some(b'0'..=b'9')) {
                    return Err(self.malformed("a number with a leading zero"));
                }
            }
            Some(b'1'..=b'9') => {
                digits(self);
            }
            _ => return Err(self.malformed("not a JSON number")),
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if digits(self) == 0 {
                return Err(self.malformed("a number's fraction has no digits"));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if digits(self) == 0 {
                return Err(self.malformed("a number's exponent has no digits"));
            }
        }
        let text = std::str::from_utf8(&self.text[start..self.at]).expect("ASCII");
        match text.parse::<f64>() {
            Ok(n) if n.is_finite() => Ok(Json::Number(text.to_owned())),
            _ => Err(Malformed {
                what: format!("the number {text} is beyond what a double holds"),
                at: start,
            }),
        }
    }

    fn hex4(&mut self) -> Result<u16, Malformed> {
        let digits = self
            .text
            .get(self.at..self.at + 4)
            .filter(|d| d.iter().all(u8::is_ascii_hexdigit))
            .ok_or_else(|| self.malformed("a \\u escape needs four hex digits"))?;
        let digits = std::str::from_utf8(digits).expect("ASCII");
        self.at += 4;
        Ok(u16::from_str_radix(digits, 16).expect("hex digits"))
    }

    fn string(&mut self) -> Result<String, Malformed> {
        self.at += 1;
        let mut out = String::new();
        loop {
            let from = self.at;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.at += 1;
            }
            // The input is valid UTF-8 and the run stops only at ASCII bytes.
            out.push_str(std::str::from_utf8(&self.text[from..self.at]).expect("UTF-8"));
            match self.peek() {
                Some(b'"') => {
                    self.at += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.at += 1;
                    let escaped = self.peek();
                    self.at += 1;
                    match escaped {
                        Some(b'"') => out.push('"'),
                        Some(b'\\') => out.push('\\'),
                        Some(b'/') => out.push('/'),
                        Some(b'b') => out.push('\u{8}'),
                        Some(b'f') => out.push('\u{c}'),
                        Some(b'n') => out.push('\n'),
                        Some(b'r') => out.push('\r'),
                        Some(b't') => out.push('\t'),
                        Some(b'u') => out.push(self.escaped_char()?),
                        _ => {
                            self.at -= 1;
                            return Err(self.malformed("an unknown escape in a string"));
                        }
                    }
                }
                Some(_) => {
                    return Err(self.malformed("a control character inside a string (escape it)"))
                }
                None => return Err(self.malformed("a string is not closed")),
            }
        }
    }

    /// The character of a `\u` escape whose `\u` has been read: a surrogate only as a pair.
    fn escaped_char(&mut self) -> Result<char, Malformed> {
        let lone = |p: &Self| p.malformed("a lone surrogate escape in a string");
        let unit = self.hex4()?;
        match unit {
            0xD800..=0xDBFF => {
                if !self.text[self.at..].starts_with(b"\\u") {
                    return Err(lone(self));
                }
                self.at += 2;
                let low = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(lone(self));
                }
                let code = 0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
                Ok(char::from_u32(code).expect("a valid pair"))
            }
            0xDC00..=0xDFFF => Err(lone(self)),
            unit => Ok(char::from_u32(u32::from(unit)).expect("not a surrogate")),
        }
    }
}

impl Json {
    /// The text forwarded in place of the message: compact, pure ASCII, members in order,
    /// numbers as written.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = String::new();
        self.write(&mut out);
        out.into_bytes()
    }

    fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(text) => out.push_str(text),
            Json::String(s) => write_string(s, out),
            Json::Array(items) => {
                out.push('[');
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Json::Object(members) => {
                out.push('{');
                for (n, (name, value)) in members.iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    write_string(name, out);
                    out.push(':');
                    value.write(out);
                }
                out.push('}');
            }
        }
    }

    /// The value as serde_json holds it, for the parts the policy reads.
    pub fn to_value(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Number(text) => serde_json::from_str(text).unwrap_or(Value::Null),
            Json::String(s) => Value::String(s.clone()),
            Json::Array(items) => Value::Array(items.iter().map(Json::to_value).collect()),
            Json::Object(members) => Value::Object(
                members
                    .iter()
                    .map(|(name, value)| (name.clone(), value.to_value()))
                    .collect(),
            ),
        }
    }

    /// The member `name` of an object.
    pub fn get(&self, name: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.iter().find(|(n, _)| n == name).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The member `name` of an object, to change.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Json> {
        match self {
            Json::Object(members) => members.iter_mut().find(|(n, _)| n == name).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Sets the member `name` of an object (in its place, or last), and returns it.
    pub fn set(&mut self, name: &str, value: Json) -> Option<&mut Json> {
        let Json::Object(members) = self else {
            return None;
        };
        let at = match members.iter().position(|(n, _)| n == name) {
            Some(at) => {
                members[at].1 = value;
                at
            }
            None => {
                members.push((name.to_owned(), value));
                members.len() - 1
            }
        };
        Some(&mut members[at].1)
    }

    /// The member `name` of an object, set to an empty object first if it is missing or null.
    pub fn object_at(&mut self, name: &str) -> Option<&mut Json> {
        if matches!(self.get(name), None | Some(Json::Null)) {
            self.set(name, Json::Object(Vec::new()));
        }
        self.get_mut(name).filter(|v| matches!(v, Json::Object(_)))
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    /// The members of an object; none for anything else.
    pub fn members(&self) -> &[(String, Json)] {
        match self {
            Json::Object(members) => members,
            _ => &[],
        }
    }
}

impl std::fmt::Display for Json {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.to_bytes()))
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// `name` as a case-insensitive reader compares it: each character upper-cased, then
/// lower-cased, which joins every set that Unicode's simple case folding joins (`s`, `S` and
/// `ſ`; `k`, `K` and the Kelvin sign) and some that only full folding does (`ß` and `ss`). A
/// character that lower-cases to a letter and combining marks is that letter (`İ` is `i`, as a
/// reader mapping one character to one takes it).
pub fn fold(name: &str) -> String {
    // Twice, so that what folds to a foldable text folds on (`ẞ` to `ß` to `ss`).
    fold_once(&fold_once(name))
}

fn fold_once(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        let folded: String = c.to_uppercase().flat_map(char::to_lowercase).collect();
        let mut chars = folded.chars();
        match (chars.next(), chars.as_str()) {
            (Some(base), marks)
                if !marks.is_empty()
                    && marks.chars().all(|m| ('\u{300}'..='\u{36F}').contains(&m)) =>
            {
                out.push(base)
            }
            _ => out.push_str(&folded),
        }
    }
    out
}

/// `text` as a careless reader might take it: folded as [`fold`] does, fullwidth forms read as
/// ASCII, and invisible characters (whitespace, controls, zero-width and direction marks)
/// dropped. Two names that look alike this way and differ are a trap for some reader.
pub fn looks(text: &str) -> String {
    let plain: String = text
        .chars()
        .filter(|c| !invisible(*c))
        .map(|c| match u32::from(c) {
            // Fullwidth ASCII.
            code @ 0xFF01..=0xFF5E => char::from_u32(code - 0xFF01 + 0x21).expect("ASCII"),
            _ => c,
        })
        .collect();
    fold(&plain)
}

fn invisible(c: char) -> bool {
    c.is_whitespace()
        || c.is_control()
        || matches!(
            c,
            '\u{AD}'
                | '\u{34F}'
                | '\u{61C}'
                | '\u{180E}'
                | '\u{200B}'..='\u{200F}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{206F}'
                | '\u{FEFF}'
                | '\u{FE00}'..='\u{FE0F}'
        )
}

/// A JSON-RPC id as the readers downstream compare it: a number by its value (`1`, `1.0` and
/// `1e0` are one id to JavaScript and to pydantic), a string by its text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IdKey {
    Number(String),
    Text(String),
}

impl IdKey {
    /// The key of an id; none for what is not a string or a number.
    pub fn of(id: &Json) -> Option<Self> {
        match id {
            Json::String(s) => Some(IdKey::Text(s.clone())),
            Json::Number(text) => {
                let n: f64 = text.parse().ok()?;
                // -0 is 0.
                let n = if n == 0.0 { 0.0 } else { n };
                Some(IdKey::Number(n.to_string()))
            }
            _ => None,
        }
    }

    /// The key of an id serde_json read (an upstream's answer).
    pub fn of_value(id: &serde_json::Value) -> Option<Self> {
        match id {
            serde_json::Value::String(s) => Some(IdKey::Text(s.clone())),
            serde_json::Value::Number(n) => IdKey::of(&Json::Number(n.to_string())),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(bytes: &[u8]) -> String {
        match parse(bytes) {
            Ok(value) => panic!("{:?} parsed as {value:?}", String::from_utf8_lossy(bytes)),
            Err(malformed) => malformed.what,
        }
    }

    #[test]
    fn what_lenient_parsers_accept_is_refused() {
        for (bytes, says) in [
            (&b"\xEF\xBB\xBF{}"[..], "not a JSON value"),
            (b"{\"a\": NaN}", "not a JSON value"),
            (b"{\"a\": Infinity}", "not a JSON value"),
            (b"{\"a\": -Infinity}", "not a JSON number"),
            (b"{\"a\": 1e400}", "beyond what a double holds"),
            (b"{\"a\": -1e400}", "beyond what a double holds"),
            (b"{\"a\": \"\\ud800\"}", "lone surrogate"),
            (b"{\"a\": \"\\ud800\\u0041\"}", "lone surrogate"),
            (b"{\"a\": \"\\udc00\"}", "lone surrogate"),
            (b"{\"a\": \"\xff\"}", "not valid UTF-8"),
            (b"{\"a\": 1, \"a\": 2}", "appears twice"),
            (b"{\"params\": 1, \"param\xc5\xbf\": 2}", "case-insensitive"),
            (b"{\"k\": 1, \"\xe2\x84\xaa\": 2}", "case-insensitive"),
            (b"{\"id\": 1, \"ID\": 2}", "case-insensitive"),
            (
                b"{\"order_id\": 1, \"order_\xc4\xb0d\": 2}",
                "case-insensitive",
            ),
            (b"{} {}", "more than one JSON value"),
            (b"{}\r{}", "more than one JSON value"),
            (b"{}x", "more than one JSON value"),
            (b"{\"a\": 01}", "leading zero"),
            (b"{\"a\": 1.}", "fraction"),
            (b"{\"a\": 1e}", "exponent"),
            (b"{\"a\": +1}", "not a JSON value"),
            (b"{\"a\": \"\t\"}", "control character"),
            (b"{\"a\": \"\\x41\"}", "unknown escape"),
            (b"{'a': 1}", "member names are strings"),
            (b"{\"a\": 1,}", "member names are strings"),
            (b"[1,]", "not a JSON value"),
            (b"{\"a\": 1 /* c */}", "expected ','"),
            (b"", "ends before"),
            (b"{\"a\": \"open", "not closed"),
        ] {
            let what = refused(bytes);
            assert!(
                what.contains(says),
                "{:?}: {what}",
                String::from_utf8_lossy(bytes)
            );
        }
        let deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
        assert!(refused(deep.as_bytes()).contains("nested"));
        let fine = format!("{}{}", "[".repeat(128), "]".repeat(128));
        assert!(parse(fine.as_bytes()).is_ok());
    }

    #[test]
    fn the_forwarded_text_is_ascii_and_reads_back_as_the_same_value() {
        let input = "{\"m\\u0065thod\" : \"tools\\/call\",\r\n\t\"id\":-0,\"n\":1.50e+3, \
                     \"s\":\"h\u{e9}llo \u{2028} \u{1F600} \\ud83d\\ude00 \\u0000\x7f\",\"e\":[ ],\"o\":{}}";
        let parsed = parse(input.as_bytes()).unwrap();
        let forwarded = parsed.to_bytes();
        assert!(
            forwarded.is_ascii(),
            "{}",
            String::from_utf8_lossy(&forwarded)
        );
        assert_eq!(
            String::from_utf8(forwarded.clone()).unwrap(),
            "{\"method\":\"tools/call\",\"id\":-0,\"n\":1.50e+3,\"s\":\"h\\u00e9llo \\u2028 \
             \\ud83d\\ude00 \\ud83d\\ude00 \\u0000\\u007f\",\"e\":[],\"o\":{}}"
        );
        assert_eq!(parse(&forwarded).unwrap(), parsed);
        // serde_json reads the same value from the client's text and from the forwarded one.
        let theirs: serde_json::Value = serde_json::from_str(input).unwrap();
        let ours: serde_json::Value = serde_json::from_slice(&forwarded).unwrap();
        assert_eq!(theirs, ours);
        assert_eq!(parsed.to_value(), theirs);
    }

    #[test]
    fn names_fold_as_unicode_folds_them() {
        assert_eq!(fold("paramſ"), "params");
        assert_eq!(fold("\u{212A}EY"), "key");
        assert_eq!(fold("Straße"), "strasse");
        assert_eq!(fold("stra\u{1E9E}e"), fold("straße"));
        assert_eq!(fold("ΣΑΣ"), fold("σας"));
        assert_eq!(fold("order_\u{130}d"), "order_id");
        assert_eq!(fold("\u{131}d"), "id");
        assert_eq!(looks("tools/call\u{200B}"), "tools/call");
        assert_eq!(looks(" Tools/Call\u{0}"), "tools/call");
        assert_eq!(looks("\u{FF54}ools/call"), "tools/call");
        assert_ne!(looks("tools/cal"), "tools/call");
    }

    #[test]
    fn ids_compare_by_value() {
        let key = |text: &str| IdKey::of(&parse(text.as_bytes()).unwrap()).unwrap();
        assert_eq!(key("1"), key("1.0"));
        assert_eq!(key("1"), key("1e0"));
        assert_eq!(key("0"), key("-0"));
        assert_ne!(key("1"), key("\"1\""));
        assert_ne!(key("1"), key("2"));
        assert_eq!(
            IdKey::of_value(&serde_json::json!(1.0)),
            Some(key("1")),
            "an upstream's answer to 1.0 carries 1"
        );
        assert_eq!(IdKey::of(&Json::Null), None);
    }
}
