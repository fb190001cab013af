//! The stdio shape: the MCP client launches the proxy as if it were the server; the proxy
//! launches the real server as its child and relays newline-delimited JSON-RPC both ways.
//!
//! Each line from the client is parsed strictly and judged; what reaches the upstream is the
//! re-serialisation of what was judged, a guarded call under the proxy's own id. Lines from the
//! upstream reach the client as they came, but for the answers and progress of guarded calls.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinSet;

use crate::guard::{annotate, refusal, refusal_of_id, unparseable, Answer, Guard, Seen, Upstream};
use crate::message::{self, IdKey, Json};
use crate::session::{self, Minter, Session};

/// How long the upstream has to exit once the client has gone, before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// The environment variable the proxy's ledger key may come from: never the child's.
pub const LEDGER_KEY_ENV: &str = "ONCE_LEDGER_KEY";

/// A guarded call sent upstream, by the proxy's id.
#[derive(Debug)]
struct Sent {
    /// Who waits for the answer.
    waiter: oneshot::Sender<Upstream>,
    /// The client's progress token, which the upstream's progress notifications are given
    /// back under.
    token: Option<Json>,
}

/// What the relay tracks between the client and the upstream.
#[derive(Debug, Default)]
struct State {
    session: Session,
    sent: HashMap<String, Sent>,
    /// The client's `tools/list` requests: their answers are learned from, and annotated when
    /// the policy asks.
    listings: HashSet<IdKey>,
    /// The upstream's output has ended: no answer will come to a call sent now.
    closed: bool,
}

/// Runs `command` as the upstream server and relays between it and this process's stdio until
/// either side ends. Returns the upstream's exit code.
pub async fn run(guard: Guard, command: &[String], env_removed: &[String]) -> anyhow::Result<i32> {
    let mut child = spawn_upstream(command, env_removed)?;
    let upstream_in = child.stdin.take().expect("piped");
    let upstream_out = child.stdout.take().expect("piped");
    tracing::info!(command = %command.join(" "), "once-proxy relaying stdio");

    let client_gone = Arc::new(Notify::new());
    let relayed = relay(
        Arc::new(guard),
        tokio::io::stdin(),
        tokio::io::stdout(),
        upstream_in,
        upstream_out,
        client_gone.clone(),
    );
    tokio::pin!(relayed);
    // The relay ends when the upstream's output does. An upstream that outlives its input by
    // the grace, or a proxy told to stop, ends with the upstream killed: its output then ends,
    // and the calls in flight are answered and reported UNKNOWN.
    let code = tokio::select! {
        code = &mut relayed => code,
        _ = async {
            client_gone.notified().await;
            tokio::time::sleep(EXIT_GRACE).await;
        } => {
            tracing::warn!("the upstream did not exit after its input closed; killing it");
            child.start_kill()?;
            relayed.await
        }
        _ = crate::stopped() => {
            tracing::info!("once-proxy stopping; killing the upstream");
            child.start_kill()?;
            relayed.await
        }
    };
    let status = match tokio::time::timeout(EXIT_GRACE, child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            tracing::warn!("the upstream did not exit after its input closed; killing it");
            child.kill().await?;
            child.wait().await?
        }
    };
    code?;
    Ok(status.code().unwrap_or(1))
}

/// Starts the upstream MCP server `command` names, its stdin and stdout piped to this process,
/// its stderr this process's, and its environment this process's without the ledger key or
/// the variables `env_removed` names; killed if dropped.
pub fn spawn_upstream(
    command: &[String],
    env_removed: &[String],
) -> anyhow::Result<tokio::process::Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("name the MCP server to run after --"))?;
    let mut child = tokio::process::Command::new(program);
    child.env_remove(LEDGER_KEY_ENV);
    for name in env_removed {
        child.env_remove(name);
    }
    child
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {program}: {e}"))
}

/// Relays until the client's input ends or the upstream's output does, then waits for the
/// guarded calls in flight to be reported and answered.
async fn relay(
    guard: Arc<Guard>,
    client_in: impl AsyncRead + Unpin,
    client_out: impl AsyncWrite + Unpin + Send + 'static,
    upstream_in: impl AsyncWrite + Unpin + Send + 'static,
    upstream_out: impl AsyncRead + Unpin + Send + 'static,
    client_gone: Arc<Notify>,
) -> anyhow::Result<()> {
    let (to_client, client_written) = writer(client_out);
    let (to_upstream, _) = writer(upstream_in);
    let state: Arc<Mutex<State>> = Arc::default();
    let minter = Arc::new(Minter::new());

    let mut from_upstream = tokio::spawn(read_upstream(
        BufReader::new(upstream_out),
        guard.clone(),
        minter.clone(),
        state.clone(),
        to_client.clone(),
    ));
    let mut calls = JoinSet::new();
    let mut client = BufReader::new(client_in);
    let mut upstream_ended = false;
    loop {
        let mut line = Vec::new();
        tokio::select! {
            read = client.read_until(b'\n', &mut line) => {
                if read? == 0 {
                    break;
                }
            }
            _ = &mut from_upstream => {
                upstream_ended = true;
                break;
            }
        }
        let line = strip_newline(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let message = match message::parse(&line) {
            Ok(message) => message,
            // Refused whatever it mentions: another parser might read a tool call in it.
            Err(malformed) => {
                let _ = to_client.send(unparseable(&malformed));
                continue;
            }
        };
        let refuse = |why: &str| {
            if let Some(answer) = refusal(&message, why) {
                let _ = to_client.send(answer);
            }
        };
        let (tool, policy) = match guard.inspect(&message) {
            Seen::Refused(why) => {
                refuse(&why);
                continue;
            }
            Seen::Guarded(tool, policy) => (tool, policy.clone()),
            Seen::Passed => {
                let mut state = state.lock().expect("not poisoned");
                match state.session.pass(&message) {
                    Err(why) => {
                        drop(state);
                        let _ = to_client.send(refusal_of_id(&why));
                    }
                    Ok(passing) => {
                        state.listings.extend(passing.listings);
                        // Sent while the state is held, so a cancellation translated here
                        // follows the guarded call it names.
                        if let Some(forwarded) = passing.forwarded {
                            let _ = to_upstream.send(forwarded.to_bytes());
                        }
                    }
                }
                continue;
            }
        };
        let id = message.get("id").cloned().unwrap_or(Json::Null);
        let claimed = state.lock().expect("not poisoned").session.guard(&id);
        let (key, cancelled) = match claimed {
            Ok(claimed) => claimed,
            Err(why) => {
                let _ = to_client.send(refusal_of_id(&why));
                continue;
            }
        };
        let guard = guard.clone();
        let state = state.clone();
        let to_upstream = to_upstream.clone();
        let to_client = to_client.clone();
        let proxy_id = minter.mint();
        calls.spawn(async move {
            // Borrowed by the forwarding future, and used again once the call is answered.
            let (state, key, proxy_id) = (&state, &key, &proxy_id);
            let forward = |mut request: Json| async move {
                let (answer, answered) = oneshot::channel();
                {
                    let mut state = state.lock().expect("not poisoned");
                    if state.closed {
                        return Upstream::Unreached("the upstream server had ended".into());
                    }
                    if !state.session.sending(key, proxy_id) {
                        return Upstream::Unsent;
                    }
                    let token = session::under_proxy_id(&mut request, proxy_id);
                    state.sent.insert(
                        proxy_id.clone(),
                        Sent {
                            waiter: answer,
                            token,
                        },
                    );
                    if to_upstream.send(request.to_bytes()).is_err() {
                        state.sent.remove(proxy_id);
                        return Upstream::Unreached("the upstream server's input is closed".into());
                    }
                }
                tokio::select! {
                    answer = answered => answer.unwrap_or(Upstream::Gone {
                        reason: "the upstream server ended".into(),
                        reply: true,
                    }),
                    _ = cancelled.cancelled() => Upstream::Gone {
                        reason: "the client cancelled the call after it was sent".into(),
                        reply: false,
                    },
                }
            };
            let answer = guard.call(&tool, &policy, &message, forward).await;
            {
                // A call given up on (timed out, cancelled) is no longer waited for: a late
                // answer under its proxy id is dropped.
                let mut state = state.lock().expect("not poisoned");
                state.sent.remove(proxy_id);
                state.session.finished(key);
            }
            if let Answer::Reply(reply) = answer {
                let _ = to_client.send(reply);
            }
        });
    }
    // Closing the upstream's input asks it to exit (the stdio transport's shutdown); the calls
    // in flight keep it open until they are answered, and only then does the upstream's grace
    // to exit begin.
    drop(to_upstream);
    while calls.join_next().await.is_some() {}
    client_gone.notify_one();
    if !upstream_ended {
        let _ = from_upstream.await;
    }
    drop(to_client);
    // Every answer reaches the client before the proxy exits.
    let _ = client_written.await;
    Ok(())
}

/// Reads the upstream's lines: answers to guarded calls (under the proxy's ids) go to their
/// waiters and their progress to the client under its own token; everything else goes to the
/// client, `tools/list` answers learned from (and annotated when the policy asks). When the
/// upstream's output ends, every guarded call still waiting learns it is gone.
async fn read_upstream(
    mut upstream: impl tokio::io::AsyncBufRead + Unpin,
    guard: Arc<Guard>,
    minter: Arc<Minter>,
    state: Arc<Mutex<State>>,
    to_client: mpsc::UnboundedSender<Vec<u8>>,
) {
    loop {
        let mut line = Vec::new();
        match upstream.read_until(b'\n', &mut line).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "reading the upstream server's output failed");
                break;
            }
        }
        let line = strip_newline(line);
        let parsed = serde_json::from_slice::<Value>(&line);
        let mut state = state.lock().expect("not poisoned");
        let message = match parsed {
            Ok(message) => message,
            Err(_) => {
                // An answer that cannot be parsed is still the answer of the guarded calls whose
                // ids it names (judged UNKNOWN), and never the client's to see.
                let named: Vec<String> = state
                    .sent
                    .keys()
                    .filter(|id| contains(&line, format!("\"{id}\"").as_bytes()))
                    .cloned()
                    .collect();
                for id in &named {
                    if let Some(sent) = state.sent.remove(id) {
                        let _ = sent.waiter.send(Upstream::Answered(line.clone()));
                    }
                }
                if named.is_empty() && !contains(&line, minter.prefix().as_bytes()) {
                    let _ = to_client.send(line);
                }
                continue;
            }
        };
        for response in responses(&message) {
            let Some(id) = response.get("id") else {
                continue;
            };
            if let Some(key) = IdKey::of_value(id) {
                state.session.answered(&key);
            }
        }
        // An upstream batch: the answers under the proxy's ids go to their calls, the rest on.
        if let Value::Array(items) = message {
            let mut rest = Vec::new();
            for item in &items {
                match owned_answer(&minter, item) {
                    Some(proxy_id) => deliver(&mut state, proxy_id, item.to_string().into_bytes()),
                    None => rest.push(item),
                }
                let listing = item
                    .get("id")
                    .and_then(IdKey::of_value)
                    .is_some_and(|key| item.get("method").is_none() && state.listings.remove(&key));
                if let Some(result) = item.get("result").filter(|_| listing) {
                    guard.learn_relayed(result);
                }
            }
            if rest.len() == items.len() {
                let _ = to_client.send(line);
            } else if !rest.is_empty() {
                let _ = to_client.send(serde_json::to_vec(&rest).unwrap_or_default());
            }
            continue;
        }
        let response_id = (message.get("method").is_none())
            .then(|| message.get("id"))
            .flatten();
        if let Some(proxy_id) = owned_answer(&minter, &message) {
            deliver(&mut state, proxy_id, line);
            continue;
        }
        if let Some(token) = session::proxy_progress_token(&minter, &message) {
            let client_token = state.sent.get(token).and_then(|sent| sent.token.clone());
            if let Some(client_token) = client_token {
                let mut message = message;
                session::progress_for_client(&mut message, &client_token);
                let _ = to_client.send(message.to_string().into_bytes());
            }
            continue;
        }
        let listing = response_id
            .and_then(IdKey::of_value)
            .is_some_and(|key| state.listings.remove(&key));
        drop(state);
        if listing {
            if let Some(result) = message.get("result") {
                guard.learn_relayed(result);
            }
            let mut message = message;
            if guard.policy.annotate && annotate(&guard.policy, &mut message) {
                let _ = to_client.send(message.to_string().into_bytes());
                continue;
            }
        }
        let _ = to_client.send(line);
    }
    let waiting: Vec<_> = {
        let mut state = state.lock().expect("not poisoned");
        state.closed = true;
        state.sent.drain().collect()
    };
    for (_, sent) in waiting {
        let _ = sent.waiter.send(Upstream::Gone {
            reason: "the upstream server ended before it answered".into(),
            reply: true,
        });
    }
}

/// The proxy's id an upstream answer carries, if it is one of the proxy's.
fn owned_answer<'m>(minter: &Minter, message: &'m Value) -> Option<&'m str> {
    if message.get("method").is_some() {
        return None;
    }
    message
        .get("id")
        .and_then(Value::as_str)
        .filter(|id| minter.owns(id))
}

/// Hands an answer under `proxy_id` to the call that waits for it; a late answer to a call
/// given up on is dropped.
fn deliver(state: &mut State, proxy_id: &str, answer: Vec<u8>) {
    match state.sent.remove(proxy_id) {
        Some(sent) => {
            let _ = sent.waiter.send(Upstream::Answered(answer));
        }
        None => tracing::warn!(id = proxy_id, "the upstream answered a guarded call after it was given up on; the answer is dropped and the operation stays UNKNOWN until reconciled"),
    }
}

/// The responses in an upstream message: itself, or a batch's.
fn responses(message: &Value) -> Vec<&Value> {
    let items = match message {
        Value::Array(items) => items.iter().collect(),
        single => vec![single],
    };
    items
        .into_iter()
        .filter(|m| m.get("method").is_none())
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A task writing each line it is sent, newline-terminated, in order, until every sender is
/// gone.
fn writer(
    mut sink: impl AsyncWrite + Unpin + Send + 'static,
) -> (mpsc::UnboundedSender<Vec<u8>>, tokio::task::JoinHandle<()>) {
    let (lines, mut queued) = mpsc::unbounded_channel::<Vec<u8>>();
    let written = tokio::spawn(async move {
        while let Some(mut line) = queued.recv().await {
            line.push(b'\n');
            if sink.write_all(&line).await.is_err() || sink.flush().await.is_err() {
                break;
            }
        }
        let _ = sink.shutdown().await;
    });
    (lines, written)
}

fn strip_newline(mut line: Vec<u8>) -> Vec<u8> {
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    line
}
