//! A fuzz harness for the proxy's reading of client messages: no input both reaches the
//! upstream as a guarded `tools/call` and skips the ledger.
//!
//! Inputs are tool calls and pings with their names respelled (case, `ſ`, the Kelvin sign,
//! `\u` escapes, invisible suffixes, fullwidth letters), their ids in every JSON form, members
//! duplicated and shuffled, and the whole wrapped as lenient parsers meet it (a byte-order mark,
//! text after the value, a `\r` or `\n` between two messages, a batch). Each is judged as the
//! proxy judges it, and read by a family of lenient readers: duplicate names first- or
//! last-wins, names matched exactly or case-insensitively, NaN, huge numbers, lone surrogates
//! and bad UTF-8 accepted, the bytes taken whole, as `\n` lines, as universal-newline lines, or
//! as a stream of values. Two properties:
//!
//! 1. Whatever any lenient reader takes for a guarded call in the client's bytes, the proxy does
//!    not pass as something else.
//! 2. What the proxy forwards, every lenient reader reads as the one value the proxy judged, and
//!    a message it passed is no guarded call to any of them.
//!
//! `make test` runs 2,000 cases; `make fuzz-proxy` (PROPTEST_CASES=200000, release) runs longer.

use proptest::prelude::*;
use serde_json::Value;

use crate::guard::{Guard, Seen};
use crate::message;

const GUARDED: &str = "place_order";

// A permissive reader: every lenient habit at once, with the choices that differ between
// parsers as options.

#[derive(Clone, Copy, Debug)]
enum Duplicates {
    First,
    Last,
}

#[derive(Clone, Copy, Debug)]
enum Names {
    Exact,
    Folded,
}

#[derive(Debug, Clone, PartialEq)]
enum Lax {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Lax>),
    Object(Vec<(String, Lax)>),
}

struct Reader<'t> {
    text: &'t [u8],
    at: usize,
    depth: usize,
}

impl Reader<'_> {
    fn ws(&mut self) {
        while matches!(self.text.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, word: &str) -> bool {
        if self.text[self.at..].starts_with(word.as_bytes()) {
            self.at += word.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Option<Lax> {
        self.ws();
        self.depth += 1;
        if self.depth > 1000 {
            return None;
        }
        let value = match *self.text.get(self.at)? {
            b'{' => {
                self.at += 1;
                let mut members = Vec::new();
                self.ws();
                if self.eat("}") {
                    Some(Lax::Object(members))
                } else {
                    loop {
                        self.ws();
                        let Lax::String(name) = self.value()? else {
                            return None;
                        };
                        self.ws();
                        if !self.eat(":") {
                            return None;
                        }
                        members.push((name, self.value()?));
                        self.ws();
                        if self.eat(",") {
                            continue;
                        }
                        if self.eat("}") {
                            break Some(Lax::Object(members));
                        }
                        return None;
                    }
                }
            }
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                self.ws();
                if self.eat("]") {
                    Some(Lax::Array(items))
                } else {
                    loop {
                        items.push(self.value()?);
                        self.ws();
                        if self.eat(",") {
                            continue;
                        }
                        if self.eat("]") {
                            break Some(Lax::Array(items));
                        }
                        return None;
                    }
                }
            }
            b'"' => self.string().map(Lax::String),
            _ if self.eat("true") => Some(Lax::Bool(true)),
            _ if self.eat("false") => Some(Lax::Bool(false)),
            _ if self.eat("null") => Some(Lax::Null),
            _ if self.eat("NaN") => Some(Lax::Number(f64::NAN)),
            _ if self.eat("Infinity") => Some(Lax::Number(f64::INFINITY)),
            _ if self.eat("-Infinity") => Some(Lax::Number(f64::NEG_INFINITY)),
            _ => {
                let from = self.at;
                while matches!(
                    self.text.get(self.at),
                    Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                ) {
                    self.at += 1;
                }
                std::str::from_utf8(&self.text[from..self.at])
                    .ok()?
                    .parse()
                    .ok()
                    .map(Lax::Number)
            }
        };
        self.depth -= 1;
        value
    }

    fn string(&mut self) -> Option<String> {
        self.at += 1;
        let mut units: Vec<u16> = Vec::new();
        let mut out = String::new();
        let flush = |units: &mut Vec<u16>, out: &mut String| {
            out.extend(char::decode_utf16(units.drain(..)).map(|c| c.unwrap_or('\u{FFFD}')));
        };
        loop {
            let b = *self.text.get(self.at)?;
            self.at += 1;
            match b {
                b'"' => {
                    flush(&mut units, &mut out);
                    return Some(out);
                }
                b'\\' => {
                    let e = *self.text.get(self.at)?;
                    self.at += 1;
                    let c = match e {
                        b'u' => {
                            let hex =
                                std::str::from_utf8(self.text.get(self.at..self.at + 4)?).ok()?;
                            self.at += 4;
                            units.push(u16::from_str_radix(hex, 16).ok()?);
                            continue;
                        }
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        other => char::from(other),
                    };
                    flush(&mut units, &mut out);
                    out.push(c);
                }
                _ => {
                    flush(&mut units, &mut out);
                    // Raw bytes, UTF-8 or not.
                    let from = self.at - 1;
                    let mut end = self.at;
                    while end < self.text.len() && !matches!(self.text[end], b'"' | b'\\') {
                        end += 1;
                    }
                    out.push_str(&String::from_utf8_lossy(&self.text[from..end]));
                    self.at = end;
                }
            }
        }
    }
}

/// The values a lenient reader finds in `bytes` taken whole, or as a stream of values.
fn lax_values(bytes: &[u8], stream: bool) -> Vec<Lax> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let mut reader = Reader {
        text: bytes,
        at: 0,
        depth: 0,
    };
    let mut values = Vec::new();
    while let Some(value) = reader.value() {
        values.push(value);
        reader.ws();
        if !stream || reader.at >= bytes.len() {
            break;
        }
    }
    values
}

/// Every way a reader may frame `bytes` into messages: whole, `\n` lines (a trailing `\r`
/// stripped), universal-newline lines, and one stream of values.
fn framings(bytes: &[u8]) -> Vec<Lax> {
    let mut found = lax_values(bytes, false);
    for line in bytes.split(|b| *b == b'\n') {
        found.extend(lax_values(line.strip_suffix(b"\r").unwrap_or(line), false));
    }
    for line in bytes.split(|b| *b == b'\n' || *b == b'\r') {
        found.extend(lax_values(line, false));
    }
    found.extend(lax_values(bytes, true));
    found
}

/// A case-insensitive reader's comparison, modelled apart from the proxy's own `fold`: each
/// character to the one ASCII letter it is a case of (Go's simple folding, `İ` and `ı` as `i`),
/// invisible characters dropped, fullwidth forms read as ASCII.
fn loose(name: &str) -> String {
    name.chars()
        .filter_map(|c| match c {
            'ſ' => Some('s'),
            'ß' | '\u{1E9E}' => Some('s'),
            '\u{212A}' => Some('k'),
            '\u{130}' | '\u{131}' => Some('i'),
            '\u{FF01}'..='\u{FF5E}' => {
                char::from_u32(u32::from(c) - 0xFEE0).map(|a| a.to_ascii_lowercase())
            }
            c if c.is_whitespace()
                || c.is_control()
                || matches!(c, '\u{200B}'..='\u{200F}' | '\u{FEFF}' | '\u{AD}') =>
            {
                None
            }
            c => Some(c.to_lowercase().next().unwrap_or(c)),
        })
        .collect()
}

fn member<'v>(value: &'v Lax, name: &str, names: Names, dup: Duplicates) -> Option<&'v Lax> {
    let Lax::Object(members) = value else {
        return None;
    };
    let matches = |key: &str| match names {
        Names::Exact => key == name,
        Names::Folded => loose(key) == loose(name),
    };
    let mut found = members.iter().filter(|(k, _)| matches(k)).map(|(_, v)| v);
    match dup {
        Duplicates::First => found.next(),
        Duplicates::Last => found.next_back(),
    }
}

/// Whether `value` is (or, as a batch, holds) a call of the guarded tool to some reader.
fn calls_guarded(value: &Lax) -> bool {
    if let Lax::Array(items) = value {
        return items.iter().any(calls_guarded);
    }
    [Names::Exact, Names::Folded].iter().any(|&names| {
        [Duplicates::First, Duplicates::Last].iter().any(|&dup| {
            let text = |v: Option<&Lax>| match v {
                Some(Lax::String(s)) => Some(loose(s)),
                _ => None,
            };
            let method = text(member(value, "method", names, dup));
            let params = member(value, "params", names, dup);
            let name = text(params.and_then(|p| member(p, "name", names, dup)));
            method.as_deref() == Some("tools/call") && name.as_deref() == Some(GUARDED)
        })
    })
}

/// A lenient reading as serde_json holds it, duplicates resolved one way.
fn plain(value: &Lax, dup: Duplicates) -> Value {
    match value {
        Lax::Null => Value::Null,
        Lax::Bool(b) => Value::Bool(*b),
        Lax::Number(n) => serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number),
        Lax::String(s) => Value::String(s.clone()),
        Lax::Array(items) => Value::Array(items.iter().map(|v| plain(v, dup)).collect()),
        Lax::Object(members) => {
            let mut map = serde_json::Map::new();
            for (k, v) in members {
                if matches!(dup, Duplicates::Last) || !map.contains_key(k) {
                    map.insert(k.clone(), plain(v, dup));
                }
            }
            Value::Object(map)
        }
    }
}

/// Numbers as doubles, the only way every reader agrees to compare them.
fn as_doubles(value: &Value) -> Value {
    match value {
        Value::Number(n) => serde_json::Number::from_f64(n.as_f64().unwrap_or(f64::NAN))
            .map_or(Value::Null, Value::Number),
        Value::Array(items) => Value::Array(items.iter().map(as_doubles).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), as_doubles(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

// The inputs.

fn respelled(canonical: &'static str) -> impl Strategy<Value = String> {
    let escape_all = |s: &str| {
        s.chars()
            .map(|c| format!("\\u{:04x}", u32::from(c)))
            .collect::<String>()
    };
    prop_oneof![
        4 => Just(canonical.to_owned()),
        1 => Just(canonical.to_ascii_uppercase()),
        1 => Just(canonical.replace('s', "ſ").replace('k', "\u{212A}")),
        1 => Just(canonical.replace('i', "\u{130}")),
        1 => Just(canonical.replace('i', "\u{131}")),
        1 => Just(escape_all(canonical)),
        1 => Just(canonical.replace('/', "\\/")),
        1 => Just(canonical.replace('/', "\\u002f")),
        1 => Just(format!("{canonical}\\u200b")),
        1 => Just(format!("{canonical}\\u0000")),
        1 => Just(format!("{canonical} ")),
        1 => Just(fullwidth_first(canonical)),
        1 => (0..canonical.len()).prop_map(move |at| {
            let mut s = canonical.to_owned();
            let c = s.as_bytes()[at].to_ascii_uppercase() as char;
            s.replace_range(at..=at, &c.to_string());
            s
        }),
    ]
}

/// `name` with its first letter in its fullwidth form.
fn fullwidth_first(name: &str) -> String {
    let mut chars = name.chars();
    let first = chars
        .next()
        .map_or(' ', |c| char::from_u32(u32::from(c) + 0xFEE0).unwrap_or(c));
    std::iter::once(first).chain(chars).collect()
}

fn id() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        6 => Just(Some("1".into())),
        1 => Just(Some("1.0".into())),
        1 => Just(Some("-0".into())),
        1 => Just(Some("1e0".into())),
        1 => Just(Some("\"a\"".into())),
        1 => Just(Some("null".into())),
        1 => Just(Some("{}".into())),
        1 => Just(Some("1e400".into())),
        1 => Just(Some("NaN".into())),
        1 => Just(Some("\"once-proxy:x:1\"".into())),
        1 => Just(None),
    ]
}

fn member_text(name: &str, value: &str) -> String {
    format!("\"{name}\":{value}")
}

/// The spellings of a message's names and values, one per site: the keys `jsonrpc`, `id`,
/// `method`, `params`, `name`, `arguments` and a second `order_id`, the method and the tool.
const SITES: usize = 9;

fn message() -> impl Strategy<Value = String> {
    let method = prop_oneof![
        3 => respelled("tools/call"),
        1 => Just("ping".to_owned()),
        1 => Just("tools/list".to_owned()),
    ];
    let tool = prop_oneof![3 => respelled(GUARDED), 1 => Just("get_order".to_owned())];
    let spellings = (
        respelled("jsonrpc"),
        respelled("id"),
        respelled("method"),
        respelled("params"),
        respelled("name"),
        respelled("arguments"),
        respelled("order_id"),
        method,
        tool,
    )
        .prop_map(|(a, b, c, d, e, f, g, h, i)| vec![a, b, c, d, e, f, g, h, i]);
    // Mostly one site respelled and the rest as MCP spells them, so each respelling meets a
    // message that is otherwise a guarded call; sometimes every site at once.
    let focus = prop_oneof![3 => (0..SITES).prop_map(Some), 1 => Just(None)];
    (spellings, focus, id(), (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()))
        .prop_flat_map(|(mut spelled, focus, id, (dup_method, dup_name, second_order, reorder))| {
            if let Some(kept) = focus {
                let canonical = ["jsonrpc", "id", "method", "params", "name", "arguments", "order_id", "tools/call", GUARDED];
                for (site, spelling) in spelled.iter_mut().enumerate() {
                    if site != kept {
                        *spelling = canonical[site].to_owned();
                    }
                }
            }
            let [jsonrpc_key, id_key, method_key, params_key, name_key, arguments_key, order_key, method, tool] =
                <[String; SITES]>::try_from(spelled).expect("nine sites");
            let arguments = if second_order {
                format!(r#"{{"order_id":"o","{order_key}":"p","amount_cents":1}}"#)
            } else {
                format!(r#"{{"{order_key}":"o","amount_cents":1}}"#)
            };
            let mut params = vec![
                member_text(&name_key, &format!("\"{tool}\"")),
                member_text(&arguments_key, &arguments),
            ];
            if dup_name {
                params.push(member_text("name", "\"get_order\""));
            }
            let mut top = vec![
                member_text(&jsonrpc_key, "\"2.0\""),
                member_text(&method_key, &format!("\"{method}\"")),
                member_text(&params_key, &format!("{{{}}}", params.join(","))),
            ];
            if let Some(id) = id {
                top.push(member_text(&id_key, &id));
            }
            if dup_method {
                top.push(member_text("method", "\"ping\""));
            }
            let top = Just(top);
            if reorder {
                top.prop_shuffle().prop_map(|m| format!("{{{}}}", m.join(","))).boxed()
            } else {
                top.prop_map(|m| format!("{{{}}}", m.join(","))).boxed()
            }
        })
}

fn input() -> impl Strategy<Value = Vec<u8>> {
    let ping = r#"{"jsonrpc":"2.0","id":9,"method":"ping"}"#;
    (message(), 0..24usize).prop_map(move |(message, wrap)| {
        match wrap {
            0 => format!("\u{FEFF}{message}"),
            1 => format!("{message} x"),
            2 => format!("{ping}\r{message}"),
            3 => format!("{ping}\n{message}"),
            4 => format!("{ping} {message}"),
            5 => format!("[{message},{ping}]"),
            6 => message.replacen(',', ",\n", 1),
            7 => message.replacen(',', ",\r", 1),
            _ => message,
        }
        .into_bytes()
    })
}

fn guard() -> Guard {
    let policy = crate::policy::Policy::parse(&format!(
        "[tools.{GUARDED}]\nintent = [\"order\", \"{{/order_id}}\"]\n"
    ))
    .expect("a policy");
    let ledger =
        once_client::LedgerClient::connect(once_client::ClientConfig::new("http://127.0.0.1:1"))
            .expect("a client");
    Guard::new(policy, ledger)
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn fuzz_no_input_reaches_a_guarded_tool_past_the_ledger(bytes in input()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _entered = runtime.enter();
        let guard = guard();
        let lenient = framings(&bytes).iter().any(calls_guarded);
        let Ok(judged) = message::parse(&bytes) else {
            return Ok(());
        };
        let seen = guard.inspect(&judged);
        // 1. A guarded call to any lenient reader is not passed as something else.
        prop_assert!(
            !(lenient && matches!(seen, Seen::Passed)),
            "passed, but a lenient reader calls {GUARDED}: {}", String::from_utf8_lossy(&bytes)
        );
        if matches!(seen, Seen::Refused(_)) {
            return Ok(());
        }
        // 2. What is forwarded reads the same to every reader, and a passed message calls no
        // guarded tool for any of them.
        let forwarded = judged.to_bytes();
        let strict = as_doubles(&judged.to_value());
        for read in framings(&forwarded) {
            for dup in [Duplicates::First, Duplicates::Last] {
                prop_assert_eq!(as_doubles(&plain(&read, dup)), strict.clone(), "{}", String::from_utf8_lossy(&forwarded));
            }
            if matches!(seen, Seen::Passed) {
                prop_assert!(!calls_guarded(&read), "{}", String::from_utf8_lossy(&forwarded));
            }
            // 3. The argument that names a guarded call's operation is the one every reader
            // acts on, however it matches names.
            if matches!(seen, Seen::Guarded(..)) {
                let named = judged.get("params").and_then(|p| p.get("arguments")).and_then(|a| a.get("order_id")).map(message::Json::to_value);
                for names in [Names::Exact, Names::Folded] {
                    for dup in [Duplicates::First, Duplicates::Last] {
                        let acted = member(&read, "params", names, dup)
                            .and_then(|p| member(p, "arguments", names, dup))
                            .and_then(|a| member(a, "order_id", names, dup))
                            .map(|v| plain(v, dup));
                        prop_assert_eq!(&acted, &named, "{}", String::from_utf8_lossy(&forwarded));
                    }
                }
            }
        }
    }
}

#[test]
fn the_lenient_readers_find_what_the_corpus_hides() {
    // Sanity: the harness's readers do see the calls the proxy refuses.
    for bytes in [
        &b"\xEF\xBB\xBF{\"method\":\"tools/call\",\"params\":{\"name\":\"place_order\"}}"[..],
        b"{\"method\":\"ping\",\"METHOD\":\"tools/call\",\"params\":{\"name\":\"place_order\"}}",
        b"{\"method\":\"tools/call\",\"params\":{\"name\":\"place_order\",\"x\":NaN}}",
        b"{\"id\":1,\"method\":\"ping\"}\r{\"method\":\"tools/call\",\"params\":{\"name\":\"place_order\"}}",
        b"{\"method\":\"tools/call\",\n\"params\":{\"name\":\"place_order\"}}",
        "{\"method\":\"tools/call\",\"paramſ\":{\"name\":\"place_order\"}}".as_bytes(),
    ] {
        assert!(framings(bytes).iter().any(calls_guarded), "{}", String::from_utf8_lossy(bytes));
    }
    assert!(!framings(b"{\"method\":\"ping\"}").iter().any(calls_guarded));
}
