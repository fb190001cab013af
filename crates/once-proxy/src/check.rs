//! `once-proxy check`: lists an upstream's tools beside the policy, and warns about what the
//! policy leaves open.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::policy::{OnError, Policy};

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
}

impl Listed {
    fn of(tool: &Value) -> Self {
        let hint = |name: &str| tool.pointer(&format!("/annotations/{name}")) == Some(&json!(true));
        Self {
            name: tool["name"].as_str().unwrap_or_default().to_owned(),
            read_only: hint("readOnlyHint"),
            idempotent: hint("idempotentHint"),
            output_schema: !matches!(tool.get("outputSchema"), None | Some(Value::Null)),
        }
    }
}

/// Runs `command`, lists its tools over stdio and reports on `policy`. The report, and whether
/// it warns.
pub async fn check(policy: &Policy, command: &[String]) -> anyhow::Result<(String, bool)> {
    let tools: Vec<Listed> = list_tools(command, &[])
        .await?
        .iter()
        .map(Listed::of)
        .collect();
    Ok(report(policy, &tools))
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
            (Some(guarded), _) => {
                let named = match &guarded.intent {
                    Some(parts) => {
                        let parts: Vec<&str> = parts.iter().map(|p| p.as_str()).collect();
                        format!("intent {}", parts.join(" · "))
                    }
                    None => "named by its arguments or an explicit key".to_owned(),
                };
                ("yes", format!("guarded, {named}"))
            }
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
