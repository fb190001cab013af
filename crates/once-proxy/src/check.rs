//! `once-proxy check`: reads a policy alone, or lists an upstream's tools beside it, and warns
//! about what the policy leaves open or reads wrong: an argument its `{/pointer}`s, key or
//! volatile names read that the tool's input schema does not have, or does not require.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::policy::{OnError, Policy, ToolPolicy};
use crate::schema::{find, Found};

/// How long the upstream has to answer each request of the check.
const PATIENCE: Duration = Duration::from_secs(30);

/// The MCP revision the proxy's own sessions (the check, the listing at start) speak.
pub const PROTOCOL_VERSION: &str = "2025-11-25";

/// One tool as the upstream lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    pub name: String,
    pub read_only: bool,
    pub idempotent: bool,
    /// Whether it declares an `outputSchema` (validated by the server after the tool ran).
    pub output_schema: bool,
    /// Its `inputSchema`, or null.
    pub input_schema: Value,
}

impl Listed {
    fn of(tool: &Value) -> Self {
        let hint = |name: &str| tool.pointer(&format!("/annotations/{name}")) == Some(&json!(true));
        Self {
            name: tool["name"].as_str().unwrap_or_default().to_owned(),
            read_only: hint("readOnlyHint"),
            idempotent: hint("idempotentHint"),
            output_schema: !matches!(tool.get("outputSchema"), None | Some(Value::Null)),
            input_schema: tool.get("inputSchema").cloned().unwrap_or(Value::Null),
        }
    }
}

/// What `guarded`'s settings read that `schema` does not have or does not require: one
/// warning each.
fn unread(guarded: &ToolPolicy, schema: &Value) -> Vec<String> {
    if schema.is_null() {
        return Vec::new();
    }
    let mut warnings = Vec::new();
    for read in guarded.reads() {
        match find(schema, schema, &read.path, 0) {
            Found::No { member, has } => warnings.push(format!(
                "{} reads {}, but the inputSchema has no {member:?} (it has: {}): {}",
                read.setting,
                read.said,
                has.join(", "),
                if read.needed {
                    "every call would be refused, not performed"
                } else {
                    "the setting does nothing"
                }
            )),
            Found::Yes {
                required: false, ..
            } if read.needed => warnings.push(format!(
                "{} reads {}, which the inputSchema does not require: a call without it \
                 cannot be named and is not performed",
                read.setting, read.said
            )),
            _ => {}
        }
    }
    warnings
}

/// What leaving `on_error` at its default costs, for a guarded tool that does.
fn on_error_note(guarded: &ToolPolicy) -> Option<String> {
    (guarded.on_error == OnError::Unknown).then(|| {
        "note: on_error = \"unknown\" (the default): a call the tool refuses (isError) is \
         UNKNOWN until a reconciler or an operator settles it, and the same call waits for \
         that; if the tool's errors always come before any effect and it declares no \
         outputSchema, on_error = \"absent\" makes them ABSENT, and the same call may run \
         again at once"
            .to_owned()
    })
}

/// What the policy alone says: each guarded tool, how it is named, and the notes. It never
/// warns: the file parsed, and only a listing can tell what the tools take.
pub fn report_alone(policy: &Policy) -> String {
    let mut out = String::new();
    let width = policy
        .tools
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(out, "{:<width$}  verdict", "tool");
    for (name, guarded) in &policy.tools {
        let _ = writeln!(out, "{name:<width$}  guarded, {}", naming(guarded));
        if let Some(note) = on_error_note(guarded) {
            let _ = writeln!(out, "{:<width$}  {note}", "");
        }
    }
    let _ = writeln!(
        out,
        "\nThe policy parses. With --against -- COMMAND (stdio) or --against-url URL (Streamable \
         HTTP), each guarded tool's settings are compared with the tool's inputSchema, and \
         unguarded tools that may change state are named."
    );
    out
}

/// How a guarded tool's calls are named.
fn naming(guarded: &ToolPolicy) -> String {
    match &guarded.intent {
        Some(parts) => {
            let parts: Vec<&str> = parts.iter().map(|p| p.as_str()).collect();
            format!("intent {}", parts.join(" · "))
        }
        None => "named by its arguments or an explicit key".to_owned(),
    }
}

/// What a policy is checked against.
#[derive(Debug)]
pub enum Against {
    /// Nothing: the policy alone.
    Nothing,
    /// The stdio MCP server this command runs.
    Command(Vec<String>),
    /// The Streamable HTTP MCP server at this URL, asked with these headers.
    Url(
        reqwest::Url,
        Vec<(axum::http::HeaderName, axum::http::HeaderValue)>,
    ),
}

/// Reports on `policy`, beside the tools of what it is checked `against`. The report, and
/// whether it warns.
pub async fn check(policy: &Policy, against: Against) -> anyhow::Result<(String, bool)> {
    let listed = match against {
        Against::Nothing => return Ok((report_alone(policy), false)),
        Against::Command(command) => list_tools(&command, &[]).await?,
        Against::Url(url, headers) => list_tools_at(&url, &headers).await?,
    };
    let tools: Vec<Listed> = listed.iter().map(Listed::of).collect();
    Ok(report(policy, &tools))
}

/// Lists the tools of the Streamable HTTP MCP server at `url`.
async fn list_tools_at(
    url: &reqwest::Url,
    headers: &[(axum::http::HeaderName, axum::http::HeaderValue)],
) -> anyhow::Result<Vec<Value>> {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(PATIENCE)
        .build()?;
    let send = |method, mut asked: axum::http::HeaderMap, body: Option<axum::body::Bytes>| {
        for (name, value) in headers {
            asked.insert(name.clone(), value.clone());
        }
        let mut request = http.request(method, url.clone()).headers(asked);
        if let Some(body) = body {
            request = request
                .header(axum::http::header::CONTENT_TYPE, "application/json")
                .body(body);
        }
        request.send()
    };
    let next = std::sync::atomic::AtomicU64::new(0);
    let mint = || {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("once-proxy-check:{n}")
    };
    let listed = crate::http::list_tools(send, mint).await.map_err(|e| {
        anyhow::anyhow!(
            "listing the tools at {}: {e:#}",
            crate::redacted(url.as_str())
        )
    })?;
    Ok(listed["tools"].as_array().cloned().unwrap_or_default())
}

/// What the policy does with each listed tool, and its warnings.
pub fn report(policy: &Policy, tools: &[Listed]) -> (String, bool) {
    let mut out = String::new();
    let mut warned = false;
    let width = tools
        .iter()
        .map(|t| t.name.len())
        .chain(policy.tools.keys().map(String::len))
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(out, "{:<width$}  {:<8}  verdict", "tool", "guarded");
    for tool in tools {
        let hints: Vec<&str> = [
            (tool.read_only, "readOnlyHint"),
            (tool.idempotent, "idempotentHint"),
        ]
        .iter()
        .filter_map(|(set, name)| set.then_some(*name))
        .collect();
        let (guarded, verdict) = match (policy.guarded(&tool.name), hints.is_empty()) {
            (Some(guarded), _) if guarded.on_error == OnError::Absent && tool.output_schema => {
                warned = true;
                (
                    "yes",
                    "WARNING: on_error = \"absent\", but it declares an outputSchema, which is \
                     validated after the tool ran: its errors may come after the effect (the \
                     proxy refuses this policy)"
                        .to_owned(),
                )
            }
            (Some(guarded), _) => ("yes", format!("guarded, {}", naming(guarded))),
            (None, false) => ("no", format!("passes through ({})", hints.join(", "))),
            (None, true) => {
                warned = true;
                (
                    "no",
                    "WARNING: may change state (no readOnlyHint or idempotentHint) and is not \
                     guarded: a repeated call runs again"
                        .to_owned(),
                )
            }
        };
        let _ = writeln!(out, "{:<width$}  {guarded:<8}  {verdict}", tool.name);
        if let Some(policy) = policy.guarded(&tool.name) {
            for warning in unread(policy, &tool.input_schema) {
                warned = true;
                let _ = writeln!(out, "{:<width$}  {:<8}  WARNING: {warning}", tool.name, "");
            }
            if let Some(note) = on_error_note(policy) {
                let _ = writeln!(out, "{:<width$}  {:<8}  {note}", tool.name, "");
            }
        }
    }
    for name in policy.tools.keys() {
        if !tools.iter().any(|t| &t.name == name) {
            warned = true;
            let _ = writeln!(
                out,
                "{name:<width$}  {:<8}  WARNING: the policy guards it, but the upstream lists no such tool",
                "-"
            );
        }
    }
    (out, warned)
}

/// Starts `command` (its environment without the variables `env_removed` names, nor the
/// ledger key), initializes an MCP session over stdio and lists every page of its tools.
pub async fn list_tools(command: &[String], env_removed: &[String]) -> anyhow::Result<Vec<Value>> {
    let mut child = crate::stdio::spawn_upstream(command, env_removed)?;
    let mut input = child.stdin.take().expect("piped");
    let mut output = BufReader::new(child.stdout.take().expect("piped"));
    let mut next_id = 0;
    let mut ask = |method: &str, params: Value| {
        next_id += 1;
        (
            next_id,
            json!({"jsonrpc": "2.0", "id": next_id, "method": method, "params": params}),
        )
    };

    let (id, initialize) = ask(
        "initialize",
        json!({
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "once-proxy check", "version": env!("CARGO_PKG_VERSION")},
        }),
    );
    send(&mut input, &initialize).await?;
    answer(&mut output, id).await?;
    send(
        &mut input,
        &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await?;
    let mut tools = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let params = match &cursor {
            Some(cursor) => json!({"cursor": cursor}),
            None => json!({}),
        };
        let (id, list) = ask("tools/list", params);
        send(&mut input, &list).await?;
        let page = answer(&mut output, id).await?;
        tools.extend(page["tools"].as_array().into_iter().flatten().cloned());
        match page.get("nextCursor").and_then(Value::as_str) {
            Some(next) if !next.is_empty() => cursor = Some(next.to_owned()),
            _ => break,
        }
    }
    drop(input);
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    Ok(tools)
}

async fn send(input: &mut tokio::process::ChildStdin, message: &Value) -> anyhow::Result<()> {
    let mut line = message.to_string().into_bytes();
    line.push(b'\n');
    input.write_all(&line).await?;
    input.flush().await?;
    Ok(())
}

/// The result of the response to request `id`, skipping the upstream's other messages.
async fn answer(
    output: &mut BufReader<tokio::process::ChildStdout>,
    id: u64,
) -> anyhow::Result<Value> {
    tokio::time::timeout(PATIENCE, async {
        loop {
            let mut line = String::new();
            if output.read_line(&mut line).await? == 0 {
                anyhow::bail!("the upstream closed its output before answering");
            }
            let Ok(message) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if message.get("id") != Some(&json!(id)) || message.get("method").is_some() {
                continue;
            }
            if let Some(error) = message.get("error") {
                anyhow::bail!("the upstream answered request {id} with {error}");
            }
            return Ok(message["result"].clone());
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("the upstream did not answer within {PATIENCE:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(name: &str, read_only: bool, idempotent: bool) -> Listed {
        Listed {
            name: name.into(),
            read_only,
            idempotent,
            output_schema: false,
            input_schema: Value::Null,
        }
    }

    #[test]
    fn absent_on_a_tool_with_an_output_schema_is_warned_about() {
        let policy = Policy::parse("[tools.place_order]\non_error = \"absent\"\n").unwrap();
        let typed = Listed {
            output_schema: true,
            ..listed("place_order", false, false)
        };
        let (text, warned) = report(&policy, &[typed]);
        assert!(warned, "{text}");
        assert!(text.contains("declares an outputSchema"), "{text}");
        let (_, warned) = report(&policy, &[listed("place_order", false, false)]);
        assert!(!warned);
    }

    #[test]
    fn unguarded_state_changing_tools_and_missing_tools_are_warned_about() {
        let policy = Policy::parse(
            "[tools.place_order]\nintent = [\"order\", \"{/order_id}\"]\n[tools.gone]\n",
        )
        .unwrap();
        let (text, warned) = report(
            &policy,
            &[
                listed("place_order", false, false),
                listed("get_order", true, false),
                listed("cancel_order", false, false),
            ],
        );
        assert!(warned);
        let line = |tool: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("{tool} ")))
                .unwrap_or_else(|| panic!("no line for {tool}: {text}"))
        };
        assert!(line("place_order").contains("guarded, intent order · {/order_id}"));
        assert!(line("get_order").contains("passes through (readOnlyHint)"));
        assert!(line("cancel_order").contains("WARNING: may change state"));
        assert!(line("gone").contains("the upstream lists no such tool"));
    }

    #[test]
    fn what_a_policy_reads_is_held_against_the_input_schema() {
        let policy = Policy::parse(
            "[tools.place_order]\nintent = [\"order\", \"{/order_d}\"]\nvolatile = [\"nte\"]\n\
             key = [\"argument:request_key\"]\nlookup_hints = { id = \"{/note}\" }\n",
        )
        .unwrap();
        let schema = json!({
            "type": "object",
            "properties": {"order_id": {}, "note": {}, "request_key": {}},
            "required": ["order_id"],
        });
        let warnings = unread(policy.guarded("place_order").unwrap(), &schema);
        assert_eq!(warnings.len(), 3, "{warnings:#?}");
        assert!(warnings[0].starts_with("intent reads {/order_d}, but the inputSchema has no \"order_d\" (it has: note, order_id, request_key): every call"), "{warnings:#?}");
        assert!(
            warnings[1].starts_with(
                "lookup_hints.id reads {/note}, which the inputSchema does not require"
            ),
            "{warnings:#?}"
        );
        assert!(
            warnings[2].starts_with("volatile reads nte"),
            "{warnings:#?}"
        );
        // The default key sources are only tried: a tool without idempotency_key is fine.
        let plain = Policy::parse("[tools.place_order]\n").unwrap();
        assert!(unread(plain.guarded("place_order").unwrap(), &schema).is_empty());
        // No schema listed: nothing to hold it against.
        assert!(unread(policy.guarded("place_order").unwrap(), &Value::Null).is_empty());
    }

    #[test]
    fn a_policy_that_covers_every_state_changing_tool_does_not_warn() {
        let policy = Policy::parse("[tools.place_order]\n").unwrap();
        let (_, warned) = report(
            &policy,
            &[
                listed("place_order", false, false),
                listed("get_order", true, false),
                listed("set_flag", false, true),
            ],
        );
        assert!(!warned);
    }
}
