//! The Streamable HTTP shape: an MCP endpoint in front of an upstream one.
//!
//! Each request is admitted by the [`Door`] (its `Host`, its `Origin`, the client's
//! credential) before anything else happens. A POST's body is parsed strictly and judged, and
//! what goes upstream is its re-serialisation, with the headers that cross (the session id,
//! the protocol version; the client's `Host` as `X-Forwarded-Host`). A guarded `tools/call`
//! goes upstream only on EXECUTE, under the proxy's own id, and runs in a task of its own: a
//! client whose stream drops does not cancel it, so its report reaches the ledger and the
//! client's retry is answered from there. `tools/list` answers are learned from, and annotated
//! when the policy asks.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::door::Door;
use crate::guard::{annotate, refusal, refusal_of_id, unparseable, Answer, Guard, Seen, Upstream};
use crate::message::{self, IdKey, Json};
use crate::policy::ToolPolicy;
use crate::session::{self, Minter, Session};

/// How long the guarded calls in flight may take to be reported once the proxy stops.
const REPORT_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Headers never forwarded upstream: one hop's; `accept-encoding` (the proxy reads the
/// upstream's answers to guarded calls, so they come uncompressed); what the proxy sets itself
/// (`content-type` of the body it serialised, the forwarding headers, which a client could
/// otherwise forge).
const HOP_BY_HOP: [&str; 14] = [
    "accept-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-type",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
];

/// The session header of Streamable HTTP.
const SESSION: &str = "mcp-session-id";

/// What the HTTP proxy is given.
#[derive(Debug)]
pub struct Settings {
    /// The upstream's MCP endpoint.
    pub upstream: reqwest::Url,
    /// Headers added to every upstream request (the upstream's own credentials).
    pub headers: HeaderMap,
    /// Who may come in.
    pub door: Door,
    /// The largest request body read.
    pub max_body: usize,
}

#[derive(Debug)]
struct Proxy {
    guard: Guard,
    settings: Settings,
    http: reqwest::Client,
    minter: Minter,
    /// What each client session (by its `mcp-session-id`) has in flight; a session with
    /// nothing in flight has no entry. Requests without a session are each their own scope.
    sessions: Mutex<HashMap<String, Session>>,
    /// The guarded calls in flight, which outlive their client's request.
    calls: tokio_util::task::TaskTracker,
}

/// Serves MCP at `/mcp` on `listener`, in front of the upstream, until `stop` resolves.
pub async fn serve<L>(
    guard: Guard,
    listener: L,
    settings: Settings,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
{
    let proxy = Arc::new(Proxy {
        guard,
        settings,
        // A redirect after a POST was handled would turn it into a GET: never followed.
        http: reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?,
        minter: Minter::new(),
        sessions: Mutex::default(),
        calls: tokio_util::task::TaskTracker::new(),
    });
    if proxy
        .guard
        .policy
        .tools
        .values()
        .any(|t| t.on_error == crate::policy::OnError::Absent)
    {
        let send = |method, headers: HeaderMap, body| {
            let proxy = proxy.clone();
            async move { proxy.send(method, &headers, None, body).await }
        };
        match list_tools(send, || proxy.minter.mint()).await {
            Ok(result) => {
                proxy.guard.learn(&result);
            }
            Err(error) => {
                tracing::warn!(%error, "the upstream's tools could not be listed at start; on_error = \"absent\" applies once a client's listing shows a tool without an outputSchema")
            }
        }
        let misjudged = proxy.guard.misjudged();
        if !misjudged.is_empty() {
            anyhow::bail!("{}", misjudged.join("\n"));
        }
    }
    let router = axum::Router::new()
        .route("/mcp", axum::routing::any(handle))
        .with_state(proxy.clone());
    tracing::info!(
        address = %listener.local_addr()?,
        upstream = %crate::redacted(proxy.settings.upstream.as_str()),
        tls = proxy.settings.door.tls(),
        "once-proxy serving MCP over Streamable HTTP at /mcp"
    );
    once_tls::serve(listener, router, stop).await;
    proxy.calls.close();
    if tokio::time::timeout(REPORT_GRACE, proxy.calls.wait())
        .await
        .is_err()
    {
        tracing::warn!("guarded calls still in flight at exit; their leases expire into UNKNOWN");
    }
    Ok(())
}

async fn handle(State(proxy): State<Arc<Proxy>>, request: Request) -> Response<Body> {
    let (parts, body) = request.into_parts();
    // Nothing of a request the door refuses is read, forwarded or asked of the ledger.
    if let Err(refused) = proxy.settings.door.admit(&parts.headers, &parts.uri) {
        return *refused;
    }
    let body = match axum::body::to_bytes(body, proxy.settings.max_body).await {
        Ok(body) => body,
        Err(_) => {
            return status(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!(
                    "once-proxy: a request body is at most {} bytes (--max-body)",
                    proxy.settings.max_body
                ),
            )
        }
    };
    let (method, headers) = (parts.method, parts.headers);
    let query = parts.uri.query().map(str::to_owned);
    if body.is_empty() {
        return match proxy.send(method, &headers, query.as_deref(), None).await {
            Ok(upstream) => relay(upstream, None),
            Err(error) => unreachable_upstream(&proxy, &error),
        };
    }
    if method != Method::POST {
        return status(
            StatusCode::BAD_REQUEST,
            "once-proxy: only a POST carries a message",
        );
    }
    // The session a request's ids are kept under is the one the upstream reads: one header,
    // in visible ASCII.
    let sessions = headers.get_all(SESSION).iter().collect::<Vec<_>>();
    if sessions.len() > 1 || sessions.iter().any(|s| s.to_str().is_err()) {
        return status(
            StatusCode::BAD_REQUEST,
            "once-proxy: a request carries at most one mcp-session-id, in visible ASCII",
        );
    }
    let encoded = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|e| e != "identity");
    if encoded {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "once-proxy: a compressed request cannot be checked for guarded tool calls",
        );
    }
    let message = match message::parse(&body) {
        Ok(message) => message,
        // Refused whatever it mentions: another parser might read a tool call in it.
        Err(malformed) => return json(StatusCode::BAD_REQUEST, unparseable(&malformed)),
    };
    let refused = |why: &str| match refusal(&message, why) {
        Some(answer) => json(StatusCode::OK, answer),
        None => status(StatusCode::ACCEPTED, ""),
    };
    let session = headers
        .get(SESSION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    match proxy.guard.inspect(&message) {
        Seen::Refused(why) => refused(&why),
        Seen::Guarded(tool, policy) => {
            let policy = policy.clone();
            let claimed = match &session {
                Some(session) => proxy
                    .with_session(session, |s| {
                        s.guard(message.get("id").unwrap_or(&Json::Null))
                    })
                    .map(|(key, cancel)| (Some(key), cancel)),
                None => Ok((None, CancellationToken::new())),
            };
            match claimed {
                Ok((key, cancel)) => {
                    let call = Call {
                        tool,
                        policy,
                        session: session.zip(key),
                        cancel,
                    };
                    guarded(proxy, call, headers, query, message).await
                }
                Err(why) => json(StatusCode::OK, refusal_of_id(&why)),
            }
        }
        Seen::Passed => {
            let passing = match &session {
                Some(session) => proxy.with_session(session, |s| s.pass(&message)),
                None => Session::default().pass(&message),
            };
            let passing = match passing {
                Ok(passing) => passing,
                Err(why) => return json(StatusCode::OK, refusal_of_id(&why)),
            };
            let release = Release {
                proxy: proxy.clone(),
                session: session.map(|s| (s, passing.claimed)),
            };
            let Some(forwarded) = passing.forwarded else {
                return status(StatusCode::ACCEPTED, "");
            };
            let body = Bytes::from(forwarded.to_bytes());
            if !passing.listings.is_empty() {
                return listing(&proxy, &headers, query, body, release).await;
            }
            match proxy
                .send(method, &headers, query.as_deref(), Some(body))
                .await
            {
                Ok(upstream) => relay(upstream, Some(release)),
                Err(error) => {
                    // Not connected, so nothing was sent: no answer will come.
                    if error.is_connect() {
                        release.answered();
                    }
                    unreachable_upstream(&proxy, &error)
                }
            }
        }
    }
}

/// A guarded call of a session: the tool, its policy, the session and the client's id it
/// holds, and the client's cancellation.
struct Call {
    tool: String,
    policy: ToolPolicy,
    session: Option<(String, IdKey)>,
    cancel: CancellationToken,
}

/// A passed request's ids in its session, freed once its answer has been relayed whole. A
/// stream the client dropped first leaves them in use: the answer may still come on another
/// stream (a resumed one), and must not be taken for a later request's under the same id.
struct Release {
    proxy: Arc<Proxy>,
    session: Option<(String, Vec<IdKey>)>,
}

impl Release {
    fn answered(mut self) {
        if let Some((session, claimed)) = self.session.take() {
            self.proxy.with_session(&session, |s| {
                for key in &claimed {
                    s.answered(key);
                }
            });
        }
    }
}

impl Proxy {
    /// Runs `f` on the session `id`'s bookkeeping, which is dropped once nothing is in flight.
    fn with_session<T>(&self, id: &str, f: impl FnOnce(&mut Session) -> T) -> T {
        let mut sessions = self.sessions.lock().expect("not poisoned");
        let session = sessions.entry(id.to_owned()).or_default();
        let out = f(session);
        if session.is_idle() {
            sessions.remove(id);
        }
        out
    }

    async fn send(
        &self,
        method: Method,
        headers: &HeaderMap,
        query: Option<&str>,
        body: Option<Bytes>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut forwarded = reqwest::header::HeaderMap::new();
        for (name, value) in crossing(headers) {
            let own = name == header::AUTHORIZATION && self.settings.door.takes_authorization();
            // The body forwarded is the proxy's own, unencoded; a proxy's credentials are for it.
            if own || name == header::CONTENT_ENCODING || name == header::PROXY_AUTHORIZATION {
                continue;
            }
            forwarded.append(name.clone(), value.clone());
        }
        if let Some(host) = headers.get(header::HOST) {
            forwarded.insert(HeaderName::from_static("x-forwarded-host"), host.clone());
        }
        forwarded.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static(if self.settings.door.tls() {
                "https"
            } else {
                "http"
            }),
        );
        for (name, value) in &self.settings.headers {
            forwarded.insert(name.clone(), value.clone());
        }
        let mut url = self.settings.upstream.clone();
        if let Some(query) = query {
            let joined = match url.query() {
                Some(own) => format!("{own}&{query}"),
                None => query.to_owned(),
            };
            url.set_query(Some(&joined));
        }
        let mut request = self.http.request(method, url).headers(forwarded);
        if let Some(body) = body {
            request = request
                .header(header::CONTENT_TYPE, "application/json")
                .body(body);
        }
        request.send().await
    }
}

/// The headers that cross the proxy: not one hop's (nor any its `Connection` header names),
/// and not the body's length (the body is streamed again).
fn crossing(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
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
    let head = crossing(upstream.headers()).fold(
        Response::builder().status(upstream.status()),
        |response, (name, value)| response.header(name, value),
    );
    match upstream.headers().get(header::CONTENT_TYPE) {
        Some(kind) => head.header(header::CONTENT_TYPE, kind),
        None => head,
    }
}

/// Whether the upstream answers with an SSE stream rather than one JSON body.
fn is_event_stream(upstream: &reqwest::Response) -> bool {
    upstream
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The upstream's answer, status, headers and body, streamed as it comes; `release` frees the
/// request's ids once the stream has ended.
fn relay(upstream: reqwest::Response, release: Option<Release>) -> Response<Body> {
    let head = answer_head(&upstream);
    let mut release = release;
    let ended = futures::stream::poll_fn(move |_| {
        if let Some(release) = release.take() {
            release.answered();
        }
        std::task::Poll::Ready(None::<Result<Bytes, reqwest::Error>>)
    });
    let stream = upstream.bytes_stream().chain(ended);
    head.body(Body::from_stream(stream))
        .unwrap_or_else(|_| status(StatusCode::BAD_GATEWAY, "once-proxy: a bad upstream answer"))
}

fn status(code: StatusCode, text: &str) -> Response<Body> {
    let mut response = Response::new(Body::from(text.to_owned()));
    *response.status_mut() = code;
    response
}

fn unreachable_upstream(proxy: &Proxy, error: &reqwest::Error) -> Response<Body> {
    let upstream = crate::redacted(proxy.settings.upstream.as_str());
    let error = error_text(error);
    tracing::warn!(%upstream, %error, "the upstream MCP server cannot be reached");
    status(
        StatusCode::BAD_GATEWAY,
        "once-proxy: the upstream MCP server cannot be reached",
    )
}

/// A reqwest error without its URL, whose userinfo and query may hold credentials.
fn error_text(error: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut text = error_kind(error).to_owned();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn error_kind(error: &reqwest::Error) -> &'static str {
    if error.is_connect() {
        "cannot connect"
    } else if error.is_timeout() {
        "timed out"
    } else if error.is_body() || error.is_decode() {
        "the body failed"
    } else {
        "the request failed"
    }
}

fn json(code: StatusCode, message: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(message));
    *response.status_mut() = code;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
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

/// Splits an SSE byte stream into events as their ends arrive: lines end with CRLF, LF or CR,
/// and a blank line ends an event. Each byte is looked at once, however the chunks fall.
#[derive(Debug, Default)]
struct Events {
    /// Bytes not yet part of a whole line.
    pending: Vec<u8>,
    /// How far `pending` is known to hold no line end.
    scanned: usize,
    /// The current event's raw text and data lines so far.
    raw: Vec<u8>,
    data: Vec<String>,
}

impl Events {
    fn push(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut start = 0;
        let mut at = self.scanned.max(start);
        while at < self.pending.len() {
            let end = match self.pending[at] {
                b'\n' => at + 1,
                // A CR at the end of what came may be the first half of a CRLF.
                b'\r' if at + 1 == self.pending.len() => break,
                b'\r' if self.pending[at + 1] == b'\n' => at + 2,
                b'\r' => at + 1,
                _ => {
                    at += 1;
                    continue;
                }
            };
            let line = String::from_utf8_lossy(&self.pending[start..at]).into_owned();
            self.raw.extend_from_slice(&self.pending[start..end]);
            if line.is_empty() {
                events.push(Event {
                    raw: std::mem::take(&mut self.raw),
                    data: std::mem::take(&mut self.data).join("\n"),
                });
            } else if let Some(data) = line.strip_prefix("data:") {
                self.data
                    .push(data.strip_prefix(' ').unwrap_or(data).to_owned());
            }
            start = end;
            at = end;
        }
        self.pending.drain(..start);
        self.scanned = at - start;
        events
    }
}

/// A guarded call: claimed at the ledger; on EXECUTE sent upstream, whose events other than
/// the answer (progress, requests to the client) reach the client as they come.
async fn guarded(
    proxy: Arc<Proxy>,
    call: Call,
    headers: HeaderMap,
    query: Option<String>,
    message: Json,
) -> Response<Body> {
    let (events, mut passing) = mpsc::unbounded_channel::<Vec<u8>>();
    let (answered, answer) = oneshot::channel::<Answer>();
    let task = proxy.clone();
    proxy.calls.spawn(async move {
        let proxy_id = task.minter.mint();
        let Call {
            tool,
            policy,
            session,
            cancel,
        } = call;
        // Borrowed by the forwarding future, and used again once the call is answered.
        let (task, session, proxy_id) = (&task, &session, &proxy_id);
        let forward = |mut request: Json| async move {
            let sending = match session {
                Some((id, key)) => task.with_session(id, |s| s.sending(key, proxy_id)),
                None => !cancel.is_cancelled(),
            };
            if !sending {
                return Upstream::Unsent;
            }
            let token = session::under_proxy_id(&mut request, proxy_id);
            let body = Bytes::from(request.to_bytes());
            tokio::select! {
                upstream = forward(task, headers, query, body, proxy_id, token, events) => upstream,
                _ = cancel.cancelled() => Upstream::Gone {
                    reason: "the client cancelled the call after it was sent".into(),
                    reply: false,
                },
            }
        };
        let outcome = task.guard.call(&tool, &policy, &message, forward).await;
        if let Some((id, key)) = session {
            task.with_session(id, |s| s.finished(key));
        }
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
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
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

/// An SSE event carrying `message`, one `data:` line for each of its lines.
fn sse_message(message: &[u8]) -> Bytes {
    let mut event = b"event: message\n".to_vec();
    for line in message.split(|b| *b == b'\n') {
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
        event.push(b'\n');
    }
    event.push(b'\n');
    Bytes::from(event)
}

/// What one upstream message on a guarded call's stream is to the call.
#[derive(Debug, PartialEq)]
enum Heard {
    /// The answer under the proxy's id.
    Answer,
    /// A progress notification under the proxy's token, re-written under the client's.
    Progress(Vec<u8>),
    /// A progress notification under the proxy's token, with no client token to give it.
    Dropped,
    /// Anything else (a request to the client, an answer to another of its requests).
    Other,
}

fn hear(data: &[u8], proxy_id: &str, token: Option<&Json>) -> Heard {
    let Ok(message) = serde_json::from_slice::<Value>(data) else {
        // What cannot be parsed but names the call is its answer (judged UNKNOWN), and never
        // reaches the client under the proxy's id.
        return if contains(data, format!("\"{proxy_id}\"").as_bytes()) {
            Heard::Answer
        } else {
            Heard::Other
        };
    };
    if message.get("method").is_none()
        && message.get("id").and_then(Value::as_str) == Some(proxy_id)
    {
        return Heard::Answer;
    }
    let progress = message.get("method").and_then(Value::as_str) == Some("notifications/progress")
        && message
            .pointer("/params/progressToken")
            .and_then(Value::as_str)
            == Some(proxy_id);
    match (progress, token) {
        (true, Some(token)) => {
            let mut message = message;
            session::progress_for_client(&mut message, token);
            Heard::Progress(message.to_string().into_bytes())
        }
        (true, None) => Heard::Dropped,
        (false, _) => Heard::Other,
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Sends a guarded call upstream and waits for the answer carrying `proxy_id`; the upstream's
/// other events go to `events` as they come, progress under the client's `token`.
async fn forward(
    proxy: &Proxy,
    headers: HeaderMap,
    query: Option<String>,
    body: Bytes,
    proxy_id: &str,
    token: Option<Json>,
    events: mpsc::UnboundedSender<Vec<u8>>,
) -> Upstream {
    let gone = |reason: String| Upstream::Gone {
        reason,
        reply: true,
    };
    let upstream = match proxy
        .send(Method::POST, &headers, query.as_deref(), Some(body))
        .await
    {
        Ok(upstream) => upstream,
        // No connection, so nothing was sent.
        Err(error) if error.is_connect() => return Upstream::Unreached(error_text(&error)),
        // Whether the request reached the server before the connection failed is unknown.
        Err(error) => {
            return gone(format!(
                "the upstream request failed: {}",
                error_text(&error)
            ))
        }
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
            Ok(bytes) => match hear(&bytes, proxy_id, None) {
                Heard::Answer => Upstream::Answered(bytes.to_vec()),
                _ => gone("the upstream's answer carries another request's id".into()),
            },
            Err(error) => gone(format!(
                "the upstream's answer was cut off: {}",
                error_text(&error)
            )),
        };
    }
    let mut stream = upstream.bytes_stream();
    let mut parser = Events::default();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                return gone(format!(
                    "the upstream's stream dropped: {}",
                    error_text(&error)
                ))
            }
        };
        for event in parser.push(&chunk) {
            match hear(event.data.as_bytes(), proxy_id, token.as_ref()) {
                Heard::Answer => return Upstream::Answered(event.data.into_bytes()),
                Heard::Progress(data) => {
                    let _ = events.send(sse_message(&data).to_vec());
                }
                Heard::Dropped => {}
                // Without the upstream's event ids: a client resuming this stream would reach
                // the upstream's raw answer past the ledger.
                Heard::Other => {
                    let _ = events.send(without_event_ids(&event.raw));
                }
            }
        }
    }
    gone("the upstream's stream ended before it answered".into())
}

/// A `tools/list` answer, learned from, with the policy's note in each guarded tool's
/// description when it asks.
async fn listing(
    proxy: &Proxy,
    headers: &HeaderMap,
    query: Option<String>,
    body: Bytes,
    release: Release,
) -> Response<Body> {
    let upstream = match proxy
        .send(Method::POST, headers, query.as_deref(), Some(body))
        .await
    {
        Ok(upstream) => upstream,
        Err(error) => {
            if error.is_connect() {
                release.answered();
            }
            return unreachable_upstream(proxy, &error);
        }
    };
    let response = answer_head(&upstream);
    let event_stream = is_event_stream(&upstream);
    let Ok(bytes) = upstream.bytes().await else {
        return status(
            StatusCode::BAD_GATEWAY,
            "once-proxy: the upstream's answer was cut off",
        );
    };
    release.answered();
    let rewrite = |data: &str| -> Option<String> {
        let mut message = serde_json::from_str::<Value>(data).ok()?;
        if let Some(result) = message.get("result") {
            proxy.guard.learn_relayed(result);
        }
        let policy = &proxy.guard.policy;
        (policy.annotate && annotate(policy, &mut message)).then(|| message.to_string())
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

/// The tools of a Streamable HTTP MCP server, listed in a session of the proxy's own, each
/// request sent by `send` (method, headers, JSON body): `initialize`, `tools/list` page by
/// page, and the session ended. Request ids come from `mint`.
pub async fn list_tools<S, F>(send: S, mint: impl Fn() -> String) -> anyhow::Result<Value>
where
    S: Fn(Method, HeaderMap, Option<Bytes>) -> F,
    F: std::future::Future<Output = Result<reqwest::Response, reqwest::Error>>,
{
    let send = &send;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::ACCEPT,
        HeaderValue::from_static("application/json, text/event-stream"),
    );
    let ask = |headers: HeaderMap, id: Option<String>, method: &'static str, params: Value| async move {
        let mut message = serde_json::json!({"jsonrpc": "2.0", "method": method, "params": params});
        if let Some(id) = &id {
            message["id"] = Value::String(id.clone());
        }
        let body = Bytes::from(message.to_string());
        let upstream = send(Method::POST, headers, Some(body))
            .await
            .map_err(|e| anyhow::anyhow!("{}", error_text(&e)))?;
        let session = upstream.headers().get(SESSION).cloned();
        if !upstream.status().is_success() {
            anyhow::bail!("{method} was answered HTTP {}", upstream.status());
        }
        let Some(id) = id else {
            return Ok((session, Value::Null));
        };
        let event_stream = is_event_stream(&upstream);
        let bytes = upstream
            .bytes()
            .await
            .map_err(|e| anyhow::anyhow!("{method}: {}", error_text(&e)))?;
        let messages: Vec<Value> = if event_stream {
            Events::default()
                .push(&bytes)
                .iter()
                .filter_map(|e| serde_json::from_str(&e.data).ok())
                .collect()
        } else {
            vec![serde_json::from_slice(&bytes)
                .map_err(|_| anyhow::anyhow!("{method} was not answered with JSON"))?]
        };
        let answer = messages
            .into_iter()
            .find(|m| m.get("id").and_then(Value::as_str) == Some(id.as_str()))
            .ok_or_else(|| anyhow::anyhow!("{method} was not answered"))?;
        match answer.get("result") {
            Some(result) => Ok((session, result.clone())),
            None => anyhow::bail!(
                "{method} was answered {}",
                answer.get("error").unwrap_or(&Value::Null)
            ),
        }
    };
    let (session, _) = ask(
        headers.clone(),
        Some(mint()),
        "initialize",
        serde_json::json!({
            "protocolVersion": crate::check::PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "once-proxy", "version": env!("CARGO_PKG_VERSION")},
        }),
    )
    .await?;
    if let Some(session) = session {
        headers.insert(HeaderName::from_static(SESSION), session);
    }
    headers.insert(
        HeaderName::from_static("mcp-protocol-version"),
        HeaderValue::from_static(crate::check::PROTOCOL_VERSION),
    );
    ask(
        headers.clone(),
        None,
        "notifications/initialized",
        Value::Null,
    )
    .await?;
    let mut tools = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let params = match &cursor {
            Some(cursor) => serde_json::json!({"cursor": cursor}),
            None => serde_json::json!({}),
        };
        let (_, page) = ask(headers.clone(), Some(mint()), "tools/list", params).await?;
        tools.extend(
            page.get("tools")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        );
        match page.get("nextCursor").and_then(Value::as_str) {
            Some(next) if !next.is_empty() => cursor = Some(next.to_owned()),
            _ => break,
        }
    }
    if headers.contains_key(SESSION) {
        let _ = send(Method::DELETE, headers, None).await;
    }
    Ok(serde_json::json!({ "tools": tools }))
}

/// An SSE event's text without its `id:` lines (lines end with CRLF, LF or CR).
fn without_event_ids(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut start = 0;
    while start < raw.len() {
        let mut end = start;
        while end < raw.len() && !matches!(raw[end], b'\n' | b'\r') {
            end += 1;
        }
        if end < raw.len() {
            end += if raw[end] == b'\r' && raw.get(end + 1) == Some(&b'\n') {
                2
            } else {
                1
            };
        }
        if !raw[start..end].starts_with(b"id:") {
            out.extend_from_slice(&raw[start..end]);
        }
        start = end;
    }
    out
}

/// Parses `Name: value` headers given on the command line. An error never quotes the value,
/// which may be a credential.
pub fn header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| "expected \"Name: value\"".to_owned())?;
    let name =
        HeaderName::try_from(name.trim()).map_err(|_| "not a header name before ':'".to_owned())?;
    let value = HeaderValue::try_from(value.trim())
        .map_err(|_| format!("header {name}: not a header value"))?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_where_they_end_whatever_the_chunks() {
        let stream = b"event: message\ndata: {\"a\":1}\n\nid: 2\ndata: {\"jsonrpc\":\"2.0\",\"id\":\"once-proxy:x:7\",\"result\":{}}\r\n\r\n";
        for cut in 1..stream.len() {
            let mut parser = Events::default();
            let mut events = parser.push(&stream[..cut]);
            events.extend(parser.push(&stream[cut..]));
            assert_eq!(events.len(), 2, "cut at {cut}");
            assert_eq!(events[0].data, "{\"a\":1}");
            assert_eq!(
                hear(events[1].data.as_bytes(), "once-proxy:x:7", None),
                Heard::Answer
            );
            assert_eq!(
                hear(events[0].data.as_bytes(), "once-proxy:x:7", None),
                Heard::Other
            );
            let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.clone()).collect();
            assert_eq!(raw, stream.to_vec());
        }
    }

    #[test]
    fn every_line_end_sse_allows_ends_an_event() {
        let stream =
            b"data: {\"a\":1}\r\rdata: 2\n\r\ndata: 3\r\n\r\n: keep-alive\n\ndata: x\ndata: y\n\n";
        for cut in 1..stream.len() {
            let mut parser = Events::default();
            let mut events = parser.push(&stream[..cut]);
            events.extend(parser.push(&stream[cut..]));
            let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
            assert_eq!(data, ["{\"a\":1}", "2", "3", "", "x\ny"], "cut at {cut}");
            let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.clone()).collect();
            assert_eq!(raw, stream.to_vec());
        }
        // A message of several lines is sent as several data lines, and read back whole.
        let sent = sse_message(b"{\n  \"a\": 1\r\n}");
        assert_eq!(Events::default().push(&sent)[0].data, "{\n  \"a\": 1\n}");
    }

    #[test]
    fn only_the_answer_under_the_proxys_id_is_the_calls() {
        let id = "once-proxy:ab:3";
        // Another request's answer, under the client's id the call once had.
        assert_eq!(
            hear(br#"{"jsonrpc":"2.0","id":3,"result":{}}"#, id, None),
            Heard::Other
        );
        assert_eq!(
            hear(
                br#"{"jsonrpc":"2.0","id":"once-proxy:ab:4","result":{}}"#,
                id,
                None
            ),
            Heard::Other
        );
        // A request from the server under that id is not an answer.
        assert_eq!(
            hear(
                br#"{"jsonrpc":"2.0","id":"once-proxy:ab:3","method":"ping"}"#,
                id,
                None
            ),
            Heard::Other
        );
        let token = Json::Number("9".into());
        let progress = br#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"once-proxy:ab:3","progress":0.5}}"#;
        match hear(progress, id, Some(&token)) {
            Heard::Progress(data) => {
                let data: Value = serde_json::from_slice(&data).unwrap();
                assert_eq!(data["params"]["progressToken"], 9);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(hear(progress, id, None), Heard::Dropped);
        // Unparseable text naming the call is its answer; naming a longer id, it is not.
        assert_eq!(
            hear(br#"{"id":"once-proxy:ab:3", oops"#, id, None),
            Heard::Answer
        );
        assert_eq!(
            hear(br#"{"id":"once-proxy:ab:31", oops"#, id, None),
            Heard::Other
        );
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
            "x-forwarded-host",
            "mcp-session-id",
        ] {
            headers.insert(name, HeaderValue::from_static("1"));
        }
        let crossed: Vec<&str> = crossing(&headers).map(|(name, _)| name.as_str()).collect();
        // The names a Connection header lists stay on their hop, as do the hop's own headers
        // and the forwarding headers a client could forge.
        assert_eq!(crossed, ["mcp-session-id"]);
    }

    #[test]
    fn relayed_events_lose_their_ids() {
        assert_eq!(
            without_event_ids(b"id: 3\nevent: message\ndata: {}\n\n"),
            b"event: message\ndata: {}\n\n".to_vec()
        );
        assert_eq!(
            without_event_ids(b"id: 3\revent: message\r\nid:4\r\ndata: {}\r\r"),
            b"event: message\r\ndata: {}\r\r".to_vec()
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
