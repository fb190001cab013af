//! The Streamable HTTP shape: an MCP endpoint in front of an upstream one. Every request is
//! forwarded with its headers (sessions, protocol version, the client's own authorization) and
//! every answer streamed back, except a POST of a guarded `tools/call`, which goes upstream only
//! on EXECUTE, and `tools/list` answers, annotated when the policy asks.
//!
//! A guarded call runs in a task of its own: a client whose stream drops does not cancel it, so
//! its report reaches the ledger and the client's retry is answered from there.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::guard::{
    annotate, may_call_a_tool, refusal, unparseable, Answer, Guard, Seen, Upstream,
};
use crate::policy::ToolPolicy;

/// The largest request body the proxy reads.
const BODY_LIMIT: usize = 64 * 1024 * 1024;

/// How long open streams (a client's GET stream) may keep the proxy from stopping.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long the guarded calls in flight may take to be reported once the proxy stops.
const REPORT_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Headers never forwarded upstream: one hop's, and `accept-encoding` (the proxy reads the
/// upstream's answers to guarded calls, so they come uncompressed).
const HOP_BY_HOP: [&str; 9] = [
    "accept-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
];

#[derive(Debug)]
struct Proxy {
    guard: Guard,
    upstream: String,
    /// Headers added to every upstream request (the upstream's own credentials).
    headers: HeaderMap,
    http: reqwest::Client,
    /// The guarded calls in flight, which outlive their client's request.
    calls: tokio_util::task::TaskTracker,
}

/// Serves MCP at `/mcp` on `listener`, in front of `upstream`, until `stop` resolves.
pub async fn serve(
    guard: Guard,
    listener: tokio::net::TcpListener,
    upstream: String,
    headers: HeaderMap,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let proxy = Arc::new(Proxy {
        guard,
        upstream,
        headers,
        // A redirect after a POST was handled would turn it into a GET: never followed.
        http: reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?,
        calls: tokio_util::task::TaskTracker::new(),
    });
    let router = axum::Router::new()
        .route("/mcp", axum::routing::any(handle))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(proxy.clone());
    let (stopping, stopped) = oneshot::channel::<()>();
    let server = axum::serve(listener, router).with_graceful_shutdown(async move {
        stop.await;
        let _ = stopping.send(());
    });
    tokio::select! {
        served = server => served?,
        _ = async {
            let _ = stopped.await;
            tokio::time::sleep(STOP_GRACE).await;
        } => tracing::info!("streams still open after the grace; closing them"),
    }
    proxy.calls.close();
    if tokio::time::timeout(REPORT_GRACE, proxy.calls.wait())
        .await
        .is_err()
    {
        tracing::warn!("guarded calls still in flight at exit; their leases expire into UNKNOWN");
    }
    Ok(())
}

async fn handle(
    State(proxy): State<Arc<Proxy>>,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    let query = uri.query().map(str::to_owned);
    if !body.is_empty() {
        let encoded = headers
            .get(axum::http::header::CONTENT_ENCODING)
            .is_some_and(|e| e != "identity");
        if encoded {
            return status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "once-proxy: a compressed request cannot be checked for guarded tool calls",
            );
        }
        match serde_json::from_slice::<Value>(&body) {
            // Another parser might read a tool call in what this one cannot: fail closed.
            Err(_) if may_call_a_tool(&body) => {
                return json(StatusCode::BAD_REQUEST, unparseable())
            }
            Err(_) => {}
            Ok(message) => match proxy.guard.inspect(&message) {
                Seen::Refused(why) => {
                    return match refusal(&message, why) {
                        Some(answer) => json(StatusCode::OK, answer),
                        None => status(StatusCode::ACCEPTED, ""),
                    }
                }
                Seen::Guarded(tool, policy) if method == Method::POST => {
                    let (tool, policy) = (tool.to_owned(), policy.clone());
                    return guarded(proxy, (tool, policy), headers, query, body, message).await;
                }
                Seen::Guarded(..) => {
                    return status(
                        StatusCode::METHOD_NOT_ALLOWED,
                        "once-proxy: a guarded tool is called with POST",
                    )
                }
                Seen::Passed => {
                    let lists = message.get("method").and_then(Value::as_str) == Some("tools/list");
                    if proxy.guard.policy.annotate && lists && method == Method::POST {
                        return listing(&proxy, headers, query, body).await;
                    }
                }
            },
        }
    }
    match proxy.send(method, &headers, query.as_deref(), body).await {
        Ok(upstream) => relay(upstream),
        Err(error) => unreachable_upstream(&error),
    }
}

impl Proxy {
    async fn send(
        &self,
        method: Method,
        headers: &HeaderMap,
        query: Option<&str>,
        body: Bytes,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut forwarded = reqwest::header::HeaderMap::new();
        for (name, value) in crossing(headers) {
            forwarded.append(name.clone(), value.clone());
        }
        for (name, value) in &self.headers {
            forwarded.insert(name.clone(), value.clone());
        }
        let url = match query {
            Some(query) if self.upstream.contains('?') => format!("{}&{query}", self.upstream),
            Some(query) => format!("{}?{query}", self.upstream),
            None => self.upstream.clone(),
        };
        self.http
            .request(method, url)
            .headers(forwarded)
            .body(body)
            .send()
            .await
    }
}

/// The headers that cross the proxy: not one hop's (nor any its `Connection` header names),
/// and not the body's length (the body is streamed again).
fn crossing(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    let named: Vec<String> = headers
        .get_all(axum::http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    headers.iter().filter(move |(name, _)| {
        let name = name.as_str();
        !HOP_BY_HOP.contains(&name) && name != "content-length" && !named.iter().any(|n| n == name)
    })
}

/// The start of the client's answer: the upstream's status and the headers that cross.
fn answer_head(upstream: &reqwest::Response) -> axum::http::response::Builder {
    crossing(upstream.headers()).fold(
        Response::builder().status(upstream.status()),
        |response, (name, value)| response.header(name, value),
    )
}

/// Whether the upstream answers with an SSE stream rather than one JSON body.
fn is_event_stream(upstream: &reqwest::Response) -> bool {
    upstream
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The upstream's answer, status, headers and body, streamed as it comes.
fn relay(upstream: reqwest::Response) -> Response<Body> {
    answer_head(&upstream)
        .body(Body::from_stream(upstream.bytes_stream()))
        .unwrap_or_else(|_| status(StatusCode::BAD_GATEWAY, "once-proxy: a bad upstream answer"))
}

fn status(code: StatusCode, text: &str) -> Response<Body> {
    let mut response = Response::new(Body::from(text.to_owned()));
    *response.status_mut() = code;
    response
}

fn unreachable_upstream(error: &reqwest::Error) -> Response<Body> {
    tracing::warn!(%error, "the upstream MCP server cannot be reached");
    status(
        StatusCode::BAD_GATEWAY,
        "once-proxy: the upstream MCP server cannot be reached",
    )
}

fn json(code: StatusCode, message: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(message));
    *response.status_mut() = code;
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// One event of an SSE stream: its raw text (to relay as it was) and its data.
#[derive(Debug, PartialEq)]
struct Event {
    raw: Vec<u8>,
    data: String,
}

/// Splits an SSE byte stream into events as their ends arrive.
#[derive(Debug, Default)]
struct Events {
    pending: Vec<u8>,
}

impl Events {
    fn push(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        loop {
            let text = &self.pending;
            let end = [&b"\r\n\r\n"[..], b"\n\n", b"\r\r"]
                .iter()
                .filter_map(|sep| {
                    text.windows(sep.len())
                        .position(|w| w == *sep)
                        .map(|at| (at, sep.len()))
                })
                .min();
            let Some((at, len)) = end else { break };
            let raw: Vec<u8> = self.pending.drain(..at + len).collect();
            let body = String::from_utf8_lossy(&raw[..at]).into_owned();
            let data: Vec<&str> = body
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            events.push(Event {
                raw,
                data: data.join("\n"),
            });
        }
        events
    }
}

/// Whether `data` is the JSON-RPC response to request `id`.
fn answers(data: &str, id: &Value) -> bool {
    serde_json::from_str::<Value>(data)
        .is_ok_and(|m| m.get("method").is_none() && m.get("id") == Some(id))
}

/// A guarded call: claimed at the ledger; on EXECUTE sent upstream, whose events other than
/// the answer (progress, requests to the client) reach the client as they come.
async fn guarded(
    proxy: Arc<Proxy>,
    (tool, policy): (String, ToolPolicy),
    headers: HeaderMap,
    query: Option<String>,
    body: Bytes,
    message: Value,
) -> Response<Body> {
    let (events, mut passing) = mpsc::unbounded_channel::<Vec<u8>>();
    let (answered, answer) = oneshot::channel::<Answer>();
    let call = proxy.clone();
    proxy.calls.spawn(async move {
        let forward = |carried: Option<Vec<u8>>| {
            let body = carried.map(Bytes::from).unwrap_or(body);
            forward(&call, headers, query, body, &message["id"], events)
        };
        let outcome = call.guard.call(&tool, &policy, &message, forward).await;
        let _ = answered.send(outcome);
    });
    // Answered before anything else came: one JSON answer. Otherwise an event stream: what
    // came, as it comes, then the answer.
    let mut answer = answer;
    let first = tokio::select! {
        biased;
        done = &mut answer => return answered_alone(done),
        first = passing.recv() => first,
    };
    let Some(first) = first else {
        return answered_alone(answer.await);
    };
    let tail = Tail {
        first: Some(first),
        passing,
        answer: Some(answer),
    };
    let stream = futures::stream::unfold(tail, |mut tail| async move {
        if let Some(first) = tail.first.take() {
            return Some((Ok::<_, Infallible>(Bytes::from(first)), tail));
        }
        tail.answer.as_ref()?;
        match tail.passing.recv().await {
            Some(raw) => Some((Ok(Bytes::from(raw)), tail)),
            None => match tail.answer.take()?.await {
                Ok(Answer::Reply(reply)) => Some((Ok(sse_message(&reply)), tail)),
                _ => None,
            },
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(axum::http::header::CONTENT_TYPE, "text/event-stream")
        .header(axum::http::header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR, "once-proxy"))
}

/// What is left to send of a guarded call's event stream.
struct Tail {
    first: Option<Vec<u8>>,
    passing: mpsc::UnboundedReceiver<Vec<u8>>,
    answer: Option<oneshot::Receiver<Answer>>,
}

/// The answer to a guarded call that streamed nothing before it.
fn answered_alone(done: Result<Answer, oneshot::error::RecvError>) -> Response<Body> {
    match done {
        Ok(Answer::Reply(reply)) => json(StatusCode::OK, reply),
        Ok(Answer::Refused { status: code, text }) => status(
            StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
            &text,
        ),
        Ok(Answer::Nothing) | Err(_) => status(StatusCode::ACCEPTED, ""),
    }
}

fn sse_message(message: &[u8]) -> Bytes {
    let mut event = b"event: message\ndata: ".to_vec();
    event.extend_from_slice(message);
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

/// Sends a guarded call upstream and waits for its answer; the upstream's other events go to
/// `events` as they come.
async fn forward(
    proxy: &Proxy,
    headers: HeaderMap,
    query: Option<String>,
    body: Bytes,
    id: &Value,
    events: mpsc::UnboundedSender<Vec<u8>>,
) -> Upstream {
    let gone = |reason: String| Upstream::Gone {
        reason,
        reply: true,
    };
    let upstream = match proxy
        .send(Method::POST, &headers, query.as_deref(), body)
        .await
    {
        Ok(upstream) => upstream,
        // Whether the request reached the server before the connection failed is unknown.
        Err(error) => return gone(format!("the upstream request failed: {error}")),
    };
    let code = upstream.status();
    let event_stream = is_event_stream(&upstream);
    if !code.is_success() {
        let text = upstream.text().await.unwrap_or_default();
        return Upstream::Refused {
            status: code.as_u16(),
            text,
        };
    }
    if !event_stream {
        return match upstream.bytes().await {
            Ok(bytes) => Upstream::Answered(bytes.to_vec()),
            Err(error) => gone(format!("the upstream's answer was cut off: {error}")),
        };
    }
    let mut stream = upstream.bytes_stream();
    let mut parser = Events::default();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => return gone(format!("the upstream's stream dropped: {error}")),
        };
        for event in parser.push(&chunk) {
            if answers(&event.data, id) {
                return Upstream::Answered(event.data.into_bytes());
            }
            // Without the upstream's event ids: a client resuming this stream would reach the
            // upstream's raw answer past the ledger.
            let _ = events.send(without_event_ids(&event.raw));
        }
    }
    gone("the upstream's stream ended before it answered".into())
}

/// A `tools/list` answer with the policy's note in each guarded tool's description.
async fn listing(
    proxy: &Proxy,
    headers: HeaderMap,
    query: Option<String>,
    body: Bytes,
) -> Response<Body> {
    let upstream = match proxy
        .send(Method::POST, &headers, query.as_deref(), body)
        .await
    {
        Ok(upstream) => upstream,
        Err(error) => return unreachable_upstream(&error),
    };
    let response = answer_head(&upstream);
    let event_stream = is_event_stream(&upstream);
    let Ok(bytes) = upstream.bytes().await else {
        return status(
            StatusCode::BAD_GATEWAY,
            "once-proxy: the upstream's answer was cut off",
        );
    };
    let rewrite = |data: &str| -> Option<String> {
        let mut message = serde_json::from_str::<Value>(data).ok()?;
        annotate(&proxy.guard.policy, &mut message).then(|| message.to_string())
    };
    let body = if event_stream {
        let mut out = Vec::new();
        for event in Events::default().push(&bytes) {
            match rewrite(&event.data) {
                Some(data) => out.extend_from_slice(&sse_message(data.as_bytes())),
                None => out.extend_from_slice(&event.raw),
            }
        }
        out
    } else {
        match std::str::from_utf8(&bytes).ok().and_then(rewrite) {
            Some(data) => data.into_bytes(),
            None => bytes.to_vec(),
        }
    };
    response
        .body(Body::from(body))
        .unwrap_or_else(|_| status(StatusCode::BAD_GATEWAY, "once-proxy: a bad upstream answer"))
}

/// An SSE event's text without its `id:` lines.
fn without_event_ids(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    for line in raw.split_inclusive(|b| *b == b'\n') {
        if !line.starts_with(b"id:") {
            out.extend_from_slice(line);
        }
    }
    out
}

/// Parses `Name: value` headers given on the command line.
pub fn header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?}: expected \"Name: value\""))?;
    let name = HeaderName::try_from(name.trim()).map_err(|e| format!("{name:?}: {e}"))?;
    let value = HeaderValue::try_from(value.trim()).map_err(|e| format!("header {name}: {e}"))?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_where_they_end_whatever_the_chunks() {
        let stream = b"event: message\ndata: {\"a\":1}\n\nid: 2\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\r\n\r\n";
        for cut in 1..stream.len() {
            let mut parser = Events::default();
            let mut events = parser.push(&stream[..cut]);
            events.extend(parser.push(&stream[cut..]));
            assert_eq!(events.len(), 2, "cut at {cut}");
            assert_eq!(events[0].data, "{\"a\":1}");
            assert!(answers(&events[1].data, &serde_json::json!(7)));
            assert!(!answers(&events[0].data, &serde_json::json!(7)));
            let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.clone()).collect();
            assert_eq!(raw, stream.to_vec());
        }
    }

    #[test]
    fn headers_a_connection_header_names_stay_on_their_hop() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "connection",
            HeaderValue::from_static("keep-alive, X-Trace-Hop"),
        );
        for name in [
            "x-trace-hop",
            "accept-encoding",
            "content-length",
            "mcp-session-id",
        ] {
            headers.insert(name, HeaderValue::from_static("1"));
        }
        let crossed: Vec<&str> = crossing(&headers).map(|(name, _)| name.as_str()).collect();
        // The names a Connection header lists stay on their hop, as do the hop's own headers.
        assert_eq!(crossed, ["mcp-session-id"]);
    }

    #[test]
    fn relayed_events_lose_their_ids() {
        assert_eq!(
            without_event_ids(b"id: 3\nevent: message\ndata: {}\n\n"),
            b"event: message\ndata: {}\n\n".to_vec()
        );
    }

    #[test]
    fn headers_are_name_colon_value() {
        let (name, value) = header("Authorization: Bearer abc").unwrap();
        assert_eq!(name, "authorization");
        assert_eq!(value, "Bearer abc");
        assert!(header("no colon").is_err());
    }
}
