//! The stdio shape: the MCP client launches the proxy as if it were the server; the proxy
//! launches the real server as its child and relays newline-delimited JSON-RPC both ways.
//! Every line it does not guard passes byte for byte.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinSet;

use crate::guard::{
    annotate, may_call_a_tool, refusal, unparseable, Answer, Guard, Seen, Upstream,
};

/// How long the upstream has to exit once the client has gone, before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// The requests in flight that the proxy watches for.
#[derive(Debug, Default)]
struct Watched {
    /// Guarded calls sent upstream, by JSON-RPC id (as JSON text): who waits for the answer.
    guarded: HashMap<String, oneshot::Sender<Upstream>>,
    /// `tools/list` requests whose answers are annotated.
    listings: HashSet<String>,
    /// Guarded calls given up on (timed out, cancelled): a late answer is the ledger's to learn
    /// from a reconciler, not a second answer for the client.
    abandoned: HashSet<String>,
    /// Ids of the guarded calls being handled, from the moment they are read: a second request
    /// under an id in use is refused.
    in_flight: HashSet<String>,
    /// The upstream's output has ended: no answer will come to a call sent now.
    closed: bool,
}

/// Runs `command` as the upstream server and relays between it and this process's stdio until
/// either side ends. Returns the upstream's exit code.
pub async fn run(guard: Guard, command: &[String]) -> anyhow::Result<i32> {
    let mut child = spawn_upstream(command)?;
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
/// its stderr this process's; killed if dropped.
pub fn spawn_upstream(command: &[String]) -> anyhow::Result<tokio::process::Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("name the MCP server to run after --"))?;
    tokio::process::Command::new(program)
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
    let watched: Arc<Mutex<Watched>> = Arc::default();

    let mut from_upstream = tokio::spawn(read_upstream(
        BufReader::new(upstream_out),
        guard.clone(),
        watched.clone(),
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
        let message = match serde_json::from_slice::<Value>(&line) {
            Ok(message) => message,
            // Another parser might read a tool call in what this one cannot: fail closed.
            Err(_) if may_call_a_tool(&line) => {
                let _ = to_client.send(unparseable());
                continue;
            }
            Err(_) => {
                let _ = to_upstream.send(line);
                continue;
            }
        };
        let (tool, policy) = match guard.inspect(&message) {
            Seen::Refused(why) => {
                if let Some(answer) = refusal(&message, why) {
                    let _ = to_client.send(answer);
                }
                continue;
            }
            Seen::Guarded(tool, policy) => (tool.to_owned(), policy.clone()),
            Seen::Passed => {
                pass(&guard, &watched, &message);
                let _ = to_upstream.send(line);
                continue;
            }
        };
        {
            // An id whose answer may still come (a call in flight, or one given up on) cannot
            // carry a new guarded call: that answer would be taken for the new call's.
            let key = message["id"].to_string();
            let mut watched = watched.lock().expect("not poisoned");
            if watched.abandoned.contains(&key) || !watched.in_flight.insert(key) {
                drop(watched);
                let why =
                    "a guarded call's id is already in use by a call whose answer may still come";
                if let Some(answer) = refusal(&message, why) {
                    let _ = to_client.send(answer);
                }
                continue;
            }
        }
        {
            let guard = guard.clone();
            let watched = watched.clone();
            let to_upstream = to_upstream.clone();
            let to_client = to_client.clone();
            calls.spawn(async move {
                let key = message["id"].to_string();
                let forward = |carried: Option<Vec<u8>>| async {
                    let (answer, answered) = oneshot::channel();
                    {
                        let mut watched = watched.lock().expect("not poisoned");
                        if watched.closed {
                            return Upstream::Gone {
                                reason: "the upstream server had ended".into(),
                                reply: true,
                            };
                        }
                        watched.guarded.insert(key.clone(), answer);
                    }
                    if to_upstream.send(carried.unwrap_or(line)).is_err() {
                        watched.lock().expect("not poisoned").guarded.remove(&key);
                        return Upstream::Gone {
                            reason: "the upstream server's input is closed".into(),
                            reply: true,
                        };
                    }
                    answered.await.unwrap_or(Upstream::Gone {
                        reason: "the upstream server ended".into(),
                        reply: true,
                    })
                };
                let answer = guard.call(&tool, &policy, &message, forward).await;
                {
                    // A call that timed out is no longer waited for upstream.
                    let mut watched = watched.lock().expect("not poisoned");
                    if watched.guarded.remove(&key).is_some() {
                        watched.abandoned.insert(key.clone());
                    }
                    watched.in_flight.remove(&key);
                }
                if let Answer::Reply(reply) = answer {
                    let _ = to_client.send(reply);
                }
            });
        }
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

/// Notes what a message passing to the upstream means for the calls the proxy watches.
fn pass(guard: &Guard, watched: &Mutex<Watched>, message: &Value) {
    let mut watched = watched.lock().expect("not poisoned");
    if message.get("method").is_some() {
        if let Some(id) = message.get("id") {
            // An id reused for a new request: its answer is not a late one to drop.
            watched.abandoned.remove(&id.to_string());
        }
    }
    match message.get("method").and_then(Value::as_str) {
        Some("notifications/cancelled") => {
            let Some(key) = message.pointer("/params/requestId").map(Value::to_string) else {
                return;
            };
            if let Some(waiting) = watched.guarded.remove(&key) {
                watched.abandoned.insert(key);
                let _ = waiting.send(Upstream::Gone {
                    reason: "the client cancelled the call after it was sent".into(),
                    reply: false,
                });
            }
        }
        Some("tools/list") if guard.policy.annotate => {
            if let Some(id) = message.get("id") {
                watched.listings.insert(id.to_string());
            }
        }
        _ => {}
    }
}

/// Reads the upstream's lines: answers to guarded calls go to their waiters; everything else
/// goes to the client (`tools/list` answers annotated when the policy asks). When the
/// upstream's output ends, every guarded call still waiting learns it is gone.
async fn read_upstream(
    mut upstream: impl tokio::io::AsyncBufRead + Unpin,
    guard: Arc<Guard>,
    watched: Arc<Mutex<Watched>>,
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
        let response = serde_json::from_slice::<Value>(&line)
            .ok()
            .filter(|m| m.get("method").is_none() && m.get("id").is_some());
        if let Some(mut response) = response {
            let key = response["id"].to_string();
            let waiting = {
                let mut watched = watched.lock().expect("not poisoned");
                if watched.abandoned.remove(&key) {
                    tracing::warn!(id = %key, "the upstream answered a guarded call after it was given up on; the answer is dropped and the operation stays UNKNOWN until reconciled");
                    continue;
                }
                let listing = watched.listings.remove(&key);
                watched
                    .guarded
                    .remove(&key)
                    .map(Ok)
                    .or(listing.then_some(Err(())))
            };
            match waiting {
                Some(Ok(waiter)) => {
                    let _ = waiter.send(Upstream::Answered(line));
                    continue;
                }
                Some(Err(())) if annotate(&guard.policy, &mut response) => {
                    let _ = to_client.send(response.to_string().into_bytes());
                    continue;
                }
                _ => {}
            }
        }
        let _ = to_client.send(line);
    }
    let waiting: Vec<_> = {
        let mut watched = watched.lock().expect("not poisoned");
        watched.closed = true;
        watched.guarded.drain().collect()
    };
    for (_, waiter) in waiting {
        let _ = waiter.send(Upstream::Gone {
            reason: "the upstream server ended before it answered".into(),
            reply: true,
        });
    }
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
