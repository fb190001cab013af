//! The on-call web console: the UNKNOWN queue, live; one operation's whole story; and, for an
//! operator, reconcile and resolve with the CLI's safety.
//!
//! The console is a client of the ledger like `oncectl`: every page calls the ledger's API
//! through `once-client` with the signed-in key, over a channel its host hands it (`onced`
//! serves it one in the same process). So every check a call meets — the key, its revocation,
//! its role, its tenant, the fencing token a resolution is bound to — is the ledger's own,
//! and the console holds no rule of its own about who may do what. What it adds is the edge a
//! browser needs:
//!
//! - a key is exchanged at sign-in for a session (`session`); the key never reaches the page;
//! - every request's `Host` must be one the console answers to, and every request that changes
//!   something must come from the console's own origin (`Origin`) and carry the session's CSRF
//!   token;
//! - every answer forbids framing, sniffing, caching and scripts from anywhere else.
//!
//! In open mode (the ledger holds no credential) the console opens without sign-in and says so
//! on every page; once a credential exists, the ledger refuses its key-less calls and the
//! console asks for a key.

mod page;
mod session;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{Query, Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use futures::{Stream, StreamExt as _};
use once_client::{
    ClientConfig, ClientError, Done, LedgerClient, ListFilter, OperationView, Resolution,
    Selection, State as OpState, Target, Truth, WatchRequest, Watched,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use page::{QueueFilter, Viewer};
use session::{same_token, Session, Sessions};

/// The session cookie's name; over https, with the prefix that binds it to this origin.
const COOKIE: &str = "once_console";
const SECURE_COOKIE: &str = "__Host-once_console";
/// The header the live page's own requests carry.
const LIVE: &str = "x-console-live";
/// The most operations the queue shows at once.
const QUEUE_ROWS: usize = 500;
/// The most UNKNOWN operations a text or source search looks through, oldest first.
const SEARCHED: usize = 20_000;
/// How long a Reconcile pressed in the console may take.
const RECONCILE_WAIT: Duration = Duration::from_secs(30);

/// How a console is reached and how long its sessions last.
#[derive(Debug, Clone)]
pub struct ConsoleOptions {
    /// The address it listens on: its port makes the loopback names it answers to.
    pub listen: SocketAddr,
    /// Further `Host`s it answers to (`name` or `name:port`), as browsers send them.
    pub allowed_hosts: Vec<String>,
    /// The origin browsers reach it at when that is not the listener itself
    /// (`https://console.example.com` behind a TLS-terminating proxy): its host is answered to,
    /// forms must come from it, and its cookie is `Secure` when it is `https`.
    pub public_origin: Option<String>,
    /// A session ends after this long without a request...
    pub session_idle: Duration,
    /// ...and this long after sign-in in any case.
    pub session_lifetime: Duration,
}

/// The console: an axum [`Router`] over a channel to the ledger. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    /// Opens a new connection to the ledger: each session, and each live stream, has its own,
    /// so one that is slow to read holds up no other.
    connect: Box<dyn Fn() -> Channel + Send + Sync>,
    sessions: Sessions,
    /// The key-less client of requests without a session: open mode's, refused by the ledger
    /// once credentials exist. One for the console, so such requests open no connection each.
    keyless: LedgerClient,
    hosts: Vec<String>,
    /// The origin forms must come from, when it is not `http://` and the request's `Host`.
    origin: Option<String>,
    /// Cookies are `Secure` (and `__Host-` prefixed).
    secure: bool,
    /// The CSRF token of open mode's forms, where there is no session to hold one.
    open_csrf: String,
    /// Cancelled when the host shuts down: live streams end, so the server can drain.
    stop: CancellationToken,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("hosts", &self.hosts)
            .field("origin", &self.origin)
            .field("sessions", &self.sessions)
            .finish_non_exhaustive()
    }
}

impl Console {
    /// A console calling the ledger over the channels `connect` opens, until `stop` is
    /// cancelled.
    pub fn new(
        connect: impl Fn() -> Channel + Send + Sync + 'static,
        options: ConsoleOptions,
        stop: CancellationToken,
    ) -> Self {
        let origin = options
            .public_origin
            .as_deref()
            .map(|o| o.trim_end_matches('/').to_ascii_lowercase());
        let keyless = LedgerClient::over_channel(connect(), client_config(None))
            .expect("a client without a key has no header to refuse");
        Self {
            inner: Arc::new(Inner {
                connect: Box::new(connect),
                sessions: Sessions::new(options.session_idle, options.session_lifetime),
                keyless,
                hosts: hosts(&options, origin.as_deref()),
                secure: origin.as_deref().is_some_and(|o| o.starts_with("https://")),
                origin,
                open_csrf: session::random_token(),
                stop,
            }),
        }
    }

    /// Serves the console on `listener` until the console's stop token is cancelled.
    /// Connections, header time and streams are bounded as at every listener of ours, and
    /// live streams end as `stop` is cancelled, so the console never holds shutdown up.
    pub async fn serve(self, listener: TcpListener) {
        if let Ok(address) = listener.local_addr() {
            tracing::info!(%address, "console serving");
        }
        let stop = self.inner.stop.clone();
        once_tls::serve(listener, self.router(), stop.cancelled_owned()).await;
    }

    /// Every page and form of the console, behind its `Host`, `Origin` and header rules.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/", get(|| async { Redirect::to("/queue") }))
            .route("/sign-in", get(sign_in_form).post(sign_in))
            .route("/sign-out", post(sign_out))
            .route("/queue", get(queue))
            .route("/queue/live", get(queue_live))
            .route("/overview", get(overview))
            .route("/operation", get(operation))
            .route("/operation/reconcile", post(reconcile))
            .route("/operation/resolve", post(resolve))
            .route("/bulk", get(bulk))
            .route("/bulk/reconcile", post(bulk_reconcile))
            .route("/bulk/resolve", post(bulk_resolve))
            .route("/assets/console.css", get(css))
            .route("/assets/console.js", get(js))
            .layer(middleware::from_fn_with_state(self.clone(), edge))
            .with_state(self.clone())
    }

    /// A client of its own connection, carrying `key`.
    fn client(&self, key: Option<String>) -> Result<LedgerClient, ClientError> {
        LedgerClient::over_channel((self.inner.connect)(), client_config(key))
    }

    /// Who asks: the live session a cookie names, or, without one, a key-less client (open
    /// mode; the ledger refuses it once credentials exist). A request the live page makes by
    /// itself (`X-Console-Live`) does not restart the session's idle clock.
    fn who(&self, headers: &HeaderMap) -> Who {
        let touch = !live(headers);
        let sent = cookies(headers, self.cookie_name());
        let found = sent
            .iter()
            .find_map(|id| self.inner.sessions.get(id, touch).map(|s| (id.clone(), s)));
        match found {
            Some((id, session)) => Who {
                client: session.client.clone(),
                session: Some(session),
                id: Some(id),
                stale_cookie: false,
            },
            None => Who {
                client: self.inner.keyless.clone(),
                session: None,
                id: None,
                stale_cookie: !sent.is_empty(),
            },
        }
    }

    /// Who asks to change something, if the form's CSRF token is the one their pages carry.
    fn acting(&self, headers: &HeaderMap, csrf: &str, next: &str) -> Result<Who, Refusal> {
        let who = self.who(headers);
        if who.session.is_none() && who.stale_cookie {
            // The session ended (idle, old, signed out) since the page was loaded.
            return Err(Refusal::SignIn(next.to_owned()));
        }
        let expected = match &who.session {
            Some(session) => session.csrf.as_str(),
            None => self.inner.open_csrf.as_str(),
        };
        match same_token(expected, csrf) {
            true => Ok(who),
            false => Err(Refusal::Forged),
        }
    }

    /// The answer to a failed call: sign in again when the ledger no longer takes the key (or
    /// never took the key-less call), a page saying why otherwise.
    fn failed(&self, who: &Who, error: &ClientError, here: &str) -> Response {
        let (status, heading, text) = match error {
            ClientError::Refused { reason, .. } if reason.starts_with("CREDENTIALS_") => {
                if let Some(id) = &who.id {
                    self.inner.sessions.end(id);
                }
                return Refusal::SignIn(here.to_owned()).answer(self);
            }
            ClientError::Refused { reason, message } if reason == "ROLE_NOT_ALLOWED" => {
                (StatusCode::FORBIDDEN, "Not allowed", message.clone())
            }
            ClientError::Refused { reason, message } => (
                StatusCode::CONFLICT,
                "The ledger refused",
                format!("{message} ({reason})"),
            ),
            ClientError::NotFound => (
                StatusCode::NOT_FOUND,
                "Not found",
                "The ledger holds no such operation (or it is another tenant's).".to_owned(),
            ),
            ClientError::Invalid(message) => (StatusCode::BAD_REQUEST, "Refused", message.clone()),
            other => (
                StatusCode::BAD_GATEWAY,
                "The ledger could not be asked",
                other.to_string(),
            ),
        };
        let body = page::message(heading, &text, "/queue");
        self.page(status, heading, who, false, &body)
    }

    /// A whole page; `answered` says the ledger answered it, so a page without a session is
    /// open mode's.
    fn page(
        &self,
        status: StatusCode,
        title: &str,
        who: &Who,
        answered: bool,
        body: &str,
    ) -> Response {
        let viewer = self.viewer(who, answered);
        (status, Html(page::layout(title, &viewer, body))).into_response()
    }

    fn viewer<'a>(&'a self, who: &'a Who, answered: bool) -> Viewer<'a> {
        Viewer {
            session: who.session.as_ref(),
            open_csrf: &self.inner.open_csrf,
            open: answered,
        }
    }

    fn cookie_name(&self) -> &'static str {
        match self.inner.secure {
            true => SECURE_COOKIE,
            false => COOKIE,
        }
    }

    /// The cookie's attributes: `Secure` where the console is reached over https.
    fn cookie(&self, value: &str, max_age: u64) -> HeaderValue {
        let secure = if self.inner.secure { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}{secure}",
            self.cookie_name()
        ))
        .expect("a hex id and fixed attributes make a valid header")
    }

    /// The origin a request to `host` must come from to change something.
    fn origin_for(&self, host: &str) -> String {
        match &self.inner.origin {
            Some(origin) => origin.clone(),
            None => format!("http://{host}"),
        }
    }
}

/// How the console's clients call: as `once-console`, with `key` when there is one.
fn client_config(key: Option<String>) -> ClientConfig {
    let mut config = ClientConfig::new("in-process");
    config.token = key;
    config.client_name = "once-console".into();
    config.rpc_timeout = Duration::from_secs(10);
    config
}

/// The names the console answers to: the listener's own (loopback names for a loopback or
/// unspecified address, its address otherwise), a public origin's host, and those given.
fn hosts(options: &ConsoleOptions, origin: Option<&str>) -> Vec<String> {
    let port = options.listen.port();
    let ip = options.listen.ip();
    let mut names = vec!["127.0.0.1".to_owned(), "localhost".into(), "[::1]".into()];
    if !ip.is_loopback() && !ip.is_unspecified() {
        names.push(match ip {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        });
    }
    let mut hosts: Vec<String> = names.iter().map(|name| format!("{name}:{port}")).collect();
    if port == 80 {
        hosts.extend(names);
    }
    if let Some(authority) = origin.and_then(|o| o.split_once("://")).map(|(_, a)| a) {
        hosts.push(authority.to_owned());
    }
    hosts.extend(options.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()));
    hosts
}

/// Why a form is not acted on.
enum Refusal {
    /// Its session ended: sign in again, then come back here.
    SignIn(String),
    /// Its CSRF token is not the session's.
    Forged,
}

impl Refusal {
    fn answer(self, console: &Console) -> Response {
        match self {
            Refusal::SignIn(next) => {
                let mut response =
                    Redirect::to(&format!("/sign-in?next={}", page::url(&next))).into_response();
                response
                    .headers_mut()
                    .insert(header::SET_COOKIE, console.cookie("", 0));
                response
            }
            Refusal::Forged => refused(
                StatusCode::FORBIDDEN,
                "Refused: the form's token does not match this session.",
            ),
        }
    }
}

/// The asker of one request.
struct Who {
    client: LedgerClient,
    session: Option<Session>,
    /// The session's id, to end it.
    id: Option<String>,
    /// A cookie was sent that names no live session.
    stale_cookie: bool,
}

impl Who {
    /// Who acts, as the ledger records it: the signed-in key's name (beside the key itself,
    /// which the ledger records from the call); `console` in open mode.
    fn operator(&self) -> String {
        self.session
            .as_ref()
            .map_or_else(|| "console".to_owned(), |s| s.key_name.clone())
    }
}

/// The values of the cookies named `name` the request carries (a cookie another site on this
/// host set may stand beside ours).
fn cookies(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(found, id)| *found == name && !id.is_empty())
        .map(|(_, id)| id.to_owned())
        .collect()
}

/// The rules every request meets before a page sees it, and the headers every answer carries.
async fn edge(State(console): State<Console>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_ascii_lowercase);
    let Some(host) = host.filter(|h| console.inner.hosts.iter().any(|allowed| allowed == h)) else {
        return refused(
            StatusCode::MISDIRECTED_REQUEST,
            "This console does not answer to that Host.",
        );
    };
    let reads = matches!(*request.method(), Method::GET | Method::HEAD);
    if !reads {
        let origin = request
            .headers()
            .get(header::ORIGIN)
            .and_then(|o| o.to_str().ok())
            .map(str::to_ascii_lowercase);
        if origin.as_deref() != Some(console.origin_for(&host).as_str()) {
            return refused(
                StatusCode::FORBIDDEN,
                "Refused: a request that changes something must come from this console's own pages.",
            );
        }
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        // Not `no-referrer`: under it a browser sends `Origin: null` with a form.
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

fn refused(status: StatusCode, text: &'static str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        text,
    )
        .into_response()
}

fn unavailable(error: &ClientError) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("The ledger cannot be reached: {error}"),
    )
        .into_response()
}

/// Where to go after signing in: a path of this console, nothing else.
fn local(next: &str) -> &str {
    // Visible ASCII only: a browser drops tabs and line ends from a URL, so `/\t/host` would
    // be followed as `//host`, another site.
    let path = next.starts_with('/') && next.bytes().all(|b| b.is_ascii_graphic());
    match path && !next.starts_with("//") && !next.contains('\\') {
        true => next,
        false => "/queue",
    }
}

#[derive(serde::Deserialize)]
struct AfterSignIn {
    #[serde(default)]
    next: String,
}

async fn sign_in_form(Query(next): Query<AfterSignIn>) -> Html<String> {
    Html(page::sign_in(None, local(&next.next)))
}

#[derive(serde::Deserialize)]
struct SignInForm {
    key: String,
    #[serde(default)]
    next: String,
}

/// Exchanges a key for a session: the ledger says whose it is, or refuses it.
async fn sign_in(State(console): State<Console>, Form(form): Form<SignInForm>) -> Response {
    let next = local(&form.next).to_owned();
    let secret = form.key.trim().to_owned();
    let problem = |status: StatusCode, text: &str| {
        (status, Html(page::sign_in(Some(text), &next))).into_response()
    };
    if secret.is_empty() {
        return problem(StatusCode::BAD_REQUEST, "Enter an API key.");
    }
    let Ok(client) = console.client(Some(secret.clone())) else {
        return problem(StatusCode::UNAUTHORIZED, "That key was not accepted.");
    };
    let info = match client.server_info().await {
        Ok(info) => info,
        Err(ClientError::Refused { reason, .. }) if reason.starts_with("CREDENTIALS_") => {
            return problem(StatusCode::UNAUTHORIZED, "That key was not accepted.")
        }
        Err(error) => return unavailable(&error),
    };
    let Some(key) = info.key else {
        // Open mode: every caller is the default tenant; nothing to sign in to.
        return Redirect::to(&next).into_response();
    };
    let session = Session::new(client, secret, info.tenant, key.name, key.key_id, key.roles);
    let Some(id) = console.inner.sessions.open(session) else {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "Too many sessions are open; sign out elsewhere, or try again later.",
        );
    };
    let mut response = Redirect::to(&next).into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        console.cookie(&id, console.inner.sessions.lifetime().as_secs()),
    );
    response
}

/// A form that only acts: its CSRF token, and the operation it acts on, if any.
#[derive(serde::Deserialize)]
struct ActForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    id: String,
}

async fn sign_out(
    State(console): State<Console>,
    headers: HeaderMap,
    Form(form): Form<ActForm>,
) -> Response {
    let who = match console.acting(&headers, &form.csrf, "/queue") {
        Ok(who) => who,
        Err(refusal) => return refusal.answer(&console),
    };
    if let Some(id) = &who.id {
        console.inner.sessions.end(id);
    }
    Refusal::SignIn("/queue".into()).answer(&console)
}

/// The listing of UNKNOWN operations the queue's filter asks for (its text search is the
/// console's own, applied to what the listing holds).
fn list_filter(filter: &QueueFilter) -> Result<ListFilter, ClientError> {
    let older_than = match filter.older_than.trim() {
        "" => None,
        text => Some(humantime::parse_duration(text).map_err(|_| {
            ClientError::Invalid(format!(
                "older than {text:?}: write a number and a unit, as 90s, 15m, 2h or 1d"
            ))
        })?),
    };
    Ok(ListFilter {
        states: vec![OpState::Unknown],
        tool: Some(filter.tool.trim().to_owned()).filter(|t| !t.is_empty()),
        provider: Some(filter.provider.trim().to_owned()).filter(|p| !p.is_empty()),
        older_than,
    })
}

/// The UNKNOWN operations the filter selects, oldest first (at most `limit`), and whether
/// there are more. What the console matches itself (text, source) is looked for through every
/// page of the listing, up to [`SEARCHED`] operations, not only the first.
async fn matching(
    client: &LedgerClient,
    filter: &QueueFilter,
    limit: usize,
) -> Result<Selection, ClientError> {
    let list = list_filter(filter)?;
    match filter.q.trim().is_empty() && filter.source.trim().is_empty() {
        true => client.select_unknown(&list, limit).await,
        false => {
            let keep = |op: &OperationView| filter.matches(op);
            client.search_unknown(&list, limit, SEARCHED, keep).await
        }
    }
}

/// The queue; to the live page's own requests (`X-Console-Live`), its table alone.
async fn queue(
    State(console): State<Console>,
    headers: HeaderMap,
    Query(filter): Query<QueueFilter>,
) -> Response {
    let who = console.who(&headers);
    let Selection {
        operations: rows,
        more,
    } = match matching(&who.client, &filter, QUEUE_ROWS).await {
        Ok(found) => found,
        Err(error) => return console.failed(&who, &error, "/queue"),
    };
    let now = SystemTime::now();
    match live(&headers) {
        true => Html(page::queue_rows(&rows, now)).into_response(),
        false => {
            let operates = console.viewer(&who, true).operates();
            let body = page::queue(&filter, &rows, more, operates, now);
            console.page(StatusCode::OK, "UNKNOWN queue", &who, true, &body)
        }
    }
}

/// Whether the live page made this request by itself, to swap in what changed.
fn live(headers: &HeaderMap) -> bool {
    headers.contains_key(LIVE)
}

#[derive(serde::Deserialize)]
struct Window {
    #[serde(default)]
    window: String,
}

impl Window {
    /// The window asked for, if it is one the page offers; a day otherwise.
    fn chosen(&self) -> &'static str {
        page::WINDOWS
            .iter()
            .find(|w| **w == self.window)
            .copied()
            .unwrap_or("24h")
    }
}

/// The overview's figures: the ledger's own (GetStats), the UNKNOWN operations' ages, and the
/// history's chain (its head and last verification; `None` when the key may not read it).
async fn figures(
    client: &LedgerClient,
    window: &'static str,
) -> Result<page::Figures, ClientError> {
    let span = humantime::parse_duration(window).expect("the offered windows parse");
    let stats = client.stats(span).await?;
    let unknown = matching(client, &QueueFilter::default(), QUEUE_ROWS).await?;
    // Not shown to a key that may not read it, nor by a ledger that does not serve it yet.
    let history = client.history_head().await.ok();
    Ok(page::Figures {
        stats,
        unknown: unknown.operations,
        history,
    })
}

/// The overview; to the live page's own requests, its figures alone.
async fn overview(
    State(console): State<Console>,
    headers: HeaderMap,
    Query(window): Query<Window>,
) -> Response {
    let who = console.who(&headers);
    let window = window.chosen();
    let figures = match figures(&who.client, window).await {
        Ok(found) => found,
        Err(error) => return console.failed(&who, &error, "/overview"),
    };
    let now = SystemTime::now();
    match live(&headers) {
        true => Html(page::overview_body(window, &figures, now)).into_response(),
        false => {
            let body = page::overview(window, &figures, now);
            console.page(StatusCode::OK, "Overview", &who, true, &body)
        }
    }
}

/// How often a live stream checks that its session is still live.
const SESSION_CHECK: Duration = Duration::from_secs(5);

/// Server-sent events, one per event that moved an operation into or out of UNKNOWN (the
/// ledger's WatchOperations, resumed after `Last-Event-ID` when the browser reconnects). Each
/// carries only the operation's id: the page fetches what it shows through the same checks.
/// The stream has its own connection to the ledger, and ends with its session.
async fn queue_live(
    State(console): State<Console>,
    headers: HeaderMap,
    Query(filter): Query<QueueFilter>,
) -> Response {
    let who = console.who(&headers);
    let key = who.session.as_ref().map(|s| s.key.clone());
    let client = match console.client(key) {
        Ok(client) => client,
        Err(error) => return unavailable(&error),
    };
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    // Without a resume point the stream starts now: the page just loaded what came before.
    let watch = client.watch(WatchRequest {
        after,
        states: vec![OpState::Unknown],
        kinds: vec![],
        tool: Some(filter.tool.trim().to_owned()).filter(|t| !t.is_empty()),
    });
    let sessions = console.inner.sessions.clone();
    let session = who.id.clone();
    let ended = async move {
        let Some(id) = session else {
            return std::future::pending().await;
        };
        let mut every = tokio::time::interval(SESSION_CHECK);
        loop {
            every.tick().await;
            if !sessions.live(&id) {
                return;
            }
        }
    };
    let stop = console.inner.stop.clone().cancelled_owned();
    let until = async move {
        tokio::select! {
            () = stop => {}
            () = ended => {}
        }
    };
    Sse::new(changes(watch).take_until(until))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn changes(
    watch: once_client::Watch,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> + Send {
    futures::stream::unfold(Some(watch), |watch| async move {
        let mut watch = watch?;
        loop {
            match watch.next().await {
                Ok(Watched::Event(event)) => {
                    let sent = Event::default()
                        .id(event.event.sequence.to_string())
                        .event("change")
                        .data(event.operation_id);
                    return Some((Ok(sent), Some(watch)));
                }
                Ok(Watched::CaughtUpTo(_)) | Ok(Watched::Reconnecting { .. }) => continue,
                // A revoked key, a shutting-down ledger: the stream ends, the browser reconnects
                // and meets the same checks as any request.
                Err(error) => {
                    tracing::debug!(%error, "console watch ended");
                    return None;
                }
            }
        }
    })
}

#[derive(serde::Deserialize)]
struct OperationQuery {
    id: String,
}

/// The page of one operation.
fn here(id: &str) -> String {
    format!("/operation?id={}", page::url(id))
}

async fn operation(
    State(console): State<Console>,
    headers: HeaderMap,
    Query(query): Query<OperationQuery>,
) -> Response {
    let who = console.who(&headers);
    console
        .operation_page(&who, &query.id, StatusCode::OK, None)
        .await
}

async fn reconcile(
    State(console): State<Console>,
    headers: HeaderMap,
    Form(form): Form<ActForm>,
) -> Response {
    let who = match console.acting(&headers, &form.csrf, &here(&form.id)) {
        Ok(who) => who,
        Err(refusal) => return refusal.answer(&console),
    };
    let reconciled = match who
        .client
        .reconcile(&form.id, &who.operator(), RECONCILE_WAIT)
        .await
    {
        Ok(reconciled) => reconciled,
        Err(error) => return console.failed(&who, &error, &here(&form.id)),
    };
    let verdict = reconciled.verdict.map_or("nothing", OpState::as_str);
    let notice = format!(
        "Reconciler {} found {verdict}: {}",
        reconciled.reconciler, reconciled.detail
    );
    console
        .operation_page(&who, &form.id, StatusCode::OK, Some(&notice))
        .await
}

/// A resolution as the operation page's form sends it.
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct ResolveForm {
    #[serde(default)]
    csrf: String,
    id: String,
    #[serde(default)]
    pub(crate) outcome: String,
    #[serde(default)]
    pub(crate) result: String,
    #[serde(default)]
    pub(crate) provider_ref: String,
    #[serde(default)]
    pub(crate) reason: String,
    pub(crate) fencing_token: u64,
    #[serde(default)]
    pub(crate) attempt: u32,
    /// Set by the confirmation page: without it the console only asks.
    #[serde(default)]
    confirmed: String,
    #[serde(default)]
    resolution_id: String,
}

/// Asks first (what will happen, bound to which attempt), then resolves. A page that went
/// stale — another attempt started, the operation was settled — is refused by the ledger,
/// and the page says what moved and who moved it.
async fn resolve(
    State(console): State<Console>,
    headers: HeaderMap,
    Form(mut form): Form<ResolveForm>,
) -> Response {
    let back = here(&form.id);
    let who = match console.acting(&headers, &form.csrf, &back) {
        Ok(who) => who,
        Err(refusal) => return refusal.answer(&console),
    };
    let refuse = |text: &str| {
        let body = page::message("Refused", text, &back);
        console.page(StatusCode::BAD_REQUEST, "Refused", &who, false, &body)
    };
    let truth = match form.outcome.as_str() {
        "ABSENT" => {
            form.result.clear();
            form.provider_ref.clear();
            Truth::Absent
        }
        "CONFIRMED" => Truth::Confirmed {
            result: form.result.clone().into_bytes(),
            provider_ref: Some(form.provider_ref.trim().to_owned()).filter(|r| !r.is_empty()),
        },
        _ => return refuse("Choose ABSENT or CONFIRMED."),
    };
    if form.reason.trim().is_empty() {
        return refuse("A reason is required: it is recorded with the resolution.");
    }
    if form.confirmed != "yes" || form.resolution_id.is_empty() {
        let op = match who.client.get(&form.id).await {
            Ok(op) => op,
            Err(error) => return console.failed(&who, &error, &back),
        };
        if op.state != OpState::Unknown || op.fencing_token != form.fencing_token {
            let notice = moved(&op);
            let body = page::operation(&op, &console.viewer(&who, true), Some(&notice));
            return console.page(StatusCode::CONFLICT, "Operation", &who, true, &body);
        }
        let body = page::confirm_resolve(&op, &console.viewer(&who, true), &form);
        return console.page(StatusCode::OK, "Resolve?", &who, true, &body);
    }
    let resolution = Resolution {
        operation_id: form.id.clone(),
        truth,
        reason: form.reason.trim().to_owned(),
        operator: who.operator(),
        resolution_id: form.resolution_id.clone(),
        fencing_token: form.fencing_token,
        attempt: Some(form.attempt).filter(|a| *a > 0),
    };
    match who.client.resolve(&resolution).await {
        Ok(state) => {
            let notice = format!("Resolved: the operation is {}.", state.as_str());
            console
                .operation_page(&who, &form.id, StatusCode::OK, Some(&notice))
                .await
        }
        Err(ClientError::Refused { reason, .. })
            if matches!(
                reason.as_str(),
                "ATTEMPT_MISMATCH" | "NOT_UNKNOWN" | "ALREADY_SETTLED" | "RESOLUTION_ID_REUSED"
            ) =>
        {
            match who.client.get(&form.id).await {
                Ok(op) => {
                    let notice = moved(&op);
                    let body = page::operation(&op, &console.viewer(&who, true), Some(&notice));
                    console.page(StatusCode::CONFLICT, "Operation", &who, true, &body)
                }
                Err(error) => console.failed(&who, &error, &back),
            }
        }
        Err(error) => console.failed(&who, &error, &back),
    }
}

/// What a stale page is told: nothing was applied, and what moved, and who moved it.
fn moved(op: &OperationView) -> String {
    let latest = op
        .events
        .last()
        .map(|e| format!(" Latest: {} by {}.", e.kind, e.actor))
        .unwrap_or_default();
    format!(
        "Nothing was applied: the operation moved since your page was loaded. It is {} at attempt {}.{latest} Read it again and decide again.",
        op.state.as_str(),
        op.attempt
    )
}

/// What the queue's filter selects, before anything is done to it: a dry run, and for an
/// operator the bulk actions.
async fn bulk(
    State(console): State<Console>,
    headers: HeaderMap,
    Query(filter): Query<QueueFilter>,
) -> Response {
    let who = console.who(&headers);
    let selected = matching(&who.client, &filter, once_client::BULK_LIMIT).await;
    let Selection { operations, more } = match selected {
        Ok(selection) => selection,
        Err(error) => return console.failed(&who, &error, "/queue"),
    };
    let viewer = console.viewer(&who, true);
    let body = page::bulk(&filter, &operations, more, &viewer, SystemTime::now());
    console.page(StatusCode::OK, "Bulk action", &who, true, &body)
}

/// A bulk action's form: its CSRF token, the operations it takes, each as `t<i>` =
/// `TOKEN ATTEMPT ID` (the attempt it is bound to), and a resolution's reason and confirmation.
#[derive(Debug)]
struct BulkForm {
    csrf: String,
    targets: Vec<Target>,
    reason: String,
    confirmed: bool,
}

impl BulkForm {
    /// The form as sent, or what is wrong with it.
    fn read(mut fields: HashMap<String, String>) -> Result<Self, &'static str> {
        let mut numbered: Vec<(usize, Target)> = Vec::new();
        for (name, value) in &fields {
            let Some(i) = name.strip_prefix('t').and_then(|i| i.parse::<usize>().ok()) else {
                continue;
            };
            let mut parts = value.splitn(3, ' ');
            let target = (|| {
                Some(Target {
                    fencing_token: parts.next()?.parse().ok()?,
                    attempt: parts.next()?.parse().ok()?,
                    operation_id: parts.next().filter(|id| !id.is_empty())?.to_owned(),
                })
            })()
            .ok_or("An operation of the form cannot be read.")?;
            numbered.push((i, target));
        }
        if numbered.is_empty() {
            return Err("The form names no operation.");
        }
        if numbered.len() > once_client::BULK_LIMIT {
            return Err("The form names more operations than one bulk action takes.");
        }
        numbered.sort_by_key(|(i, _)| *i);
        let mut take = |name: &str| fields.remove(name).unwrap_or_default();
        Ok(BulkForm {
            csrf: take("csrf"),
            reason: take("reason").trim().to_owned(),
            confirmed: take("confirmed") == "yes",
            targets: numbered.into_iter().map(|(_, t)| t).collect(),
        })
    }
}

/// A bulk action as asked for: who asks and what the form names, once the request came from
/// this console with its CSRF token, the form can be read, and the key may settle operations.
struct BulkAction {
    who: Who,
    form: BulkForm,
}

impl axum::extract::FromRequest<Console> for BulkAction {
    type Rejection = Response;

    async fn from_request(request: Request, console: &Console) -> Result<Self, Response> {
        let headers = request.headers().clone();
        let Form(fields) = Form::<HashMap<String, String>>::from_request(request, console)
            .await
            .map_err(IntoResponse::into_response)?;
        let form = BulkForm::read(fields);
        let csrf = form.as_ref().map_or("", |f| f.csrf.as_str());
        let who = console
            .acting(&headers, csrf, "/queue")
            .map_err(|refusal| refusal.answer(console))?;
        let form = form.map_err(|problem| console.bulk_refused(&who, problem))?;
        if !console.viewer(&who, true).operates() {
            return Err(console.not_an_operator(&who));
        }
        Ok(BulkAction { who, form })
    }
}

/// What a bulk action does to each operation.
enum Bulk {
    Reconcile,
    ResolveAbsent { reason: String },
}

impl BulkAction {
    /// Does `bulk` to each operation of the form, in turn (`once-client`'s bulk: the first alone,
    /// then a few at a time, none after a refusal of the key), and shows each outcome as it
    /// comes.
    fn run(self, console: &Console, bulk: Bulk) -> Response {
        let BulkAction { who, form } = self;
        let client = who.client.clone();
        let operator = who.operator();
        let (title, doing) = match bulk {
            Bulk::Reconcile => ("Reconciling", "Reconciling"),
            Bulk::ResolveAbsent { .. } => ("Resolving", "Resolving ABSENT"),
        };
        let head = page::bulk_started(doing, form.targets.len());
        console.streamed(&who, title, head, move |rows| async move {
            let total = form.targets.len();
            let targets = rows.until_stopped(form.targets);
            let outcomes = match bulk {
                Bulk::Reconcile => client
                    .reconcile_each(targets, &operator, RECONCILE_WAIT)
                    .map(|(target, done)| {
                        Outcome::of(target, done, |r| {
                            (r.state, format!("{}: {}", r.reconciler, r.detail))
                        })
                    })
                    .left_stream(),
                Bulk::ResolveAbsent { reason } => client
                    .resolve_each_absent(targets, reason, operator.clone())
                    .map(|(target, _, done)| {
                        Outcome::of(target, done, |state| (Some(state), String::new()))
                    })
                    .right_stream(),
            };
            rows.send_all(total, outcomes).await
        })
    }
}

async fn bulk_reconcile(State(console): State<Console>, action: BulkAction) -> Response {
    action.run(&console, Bulk::Reconcile)
}

/// Asks first (what will happen, to which operations, bound to which attempts), then resolves
/// each operation of the form ABSENT with one reason.
async fn bulk_resolve(State(console): State<Console>, action: BulkAction) -> Response {
    let BulkAction { who, form } = &action;
    if form.reason.is_empty() {
        return console.bulk_refused(
            who,
            "A reason is required: it is recorded with each resolution.",
        );
    }
    if !form.confirmed {
        let viewer = console.viewer(who, true);
        let body = page::confirm_bulk_resolve(&form.targets, &form.reason, &viewer);
        return console.page(StatusCode::OK, "Resolve?", who, true, &body);
    }
    let reason = form.reason.clone();
    action.run(&console, Bulk::ResolveAbsent { reason })
}

/// One operation's outcome in a bulk action.
struct Outcome {
    target: Target,
    /// `done`, `refused` or `failed`.
    kind: &'static str,
    state: Option<OpState>,
    detail: String,
    /// The ledger refused the key itself: no further operation is started.
    refuses_the_key: bool,
}

impl Outcome {
    fn of<T>(
        target: Target,
        done: Done<T>,
        applied: impl FnOnce(T) -> (Option<OpState>, String),
    ) -> Self {
        let refuses_the_key = done.refuses_the_key();
        let (kind, (state, detail)) = match done {
            Done::Applied(done) => ("done", applied(done)),
            Done::Refused(error) => ("refused", (None, error.to_string())),
            Done::Failed(error) => ("failed", (None, error.to_string())),
        };
        Outcome {
            target,
            kind,
            state,
            detail,
            refuses_the_key,
        }
    }
}

/// Where a bulk action sends its outcomes, rendered, as they come.
struct Rows {
    sender: tokio::sync::mpsc::Sender<String>,
    stop: CancellationToken,
}

impl Rows {
    /// The targets, of which none is started once the console is shutting down.
    fn until_stopped(&self, targets: Vec<Target>) -> impl Stream<Item = Target> + Send + 'static {
        futures::stream::iter(targets).take_until(self.stop.clone().cancelled_owned())
    }

    /// Sends each outcome as a row (every operation started is seen through), and the tally at
    /// the end. A reader that went away stops nothing.
    async fn send_all(self, total: usize, outcomes: impl Stream<Item = Outcome>) {
        let (mut done, mut refused, mut failed) = (0, 0, 0);
        let mut key_refused = None;
        let mut outcomes = std::pin::pin!(outcomes);
        while let Some(outcome) = outcomes.next().await {
            if outcome.refuses_the_key && key_refused.is_none() {
                key_refused = Some(outcome.detail.clone());
            }
            match outcome.kind {
                "done" => done += 1,
                "refused" => refused += 1,
                _ => failed += 1,
            }
            let row = page::bulk_row(
                &outcome.target,
                outcome.kind,
                outcome.state,
                &outcome.detail,
            );
            let _ = self.sender.send(row).await;
        }
        let not_started = total - (done + refused + failed);
        let stopped = match (not_started, key_refused) {
            (0, _) => page::Stopped::No,
            (n, Some(why)) => page::Stopped::KeyRefused {
                why,
                not_started: n,
            },
            (_, None) => page::Stopped::ShuttingDown,
        };
        let finished = page::bulk_finished(done, refused, failed, &stopped);
        let _ = self.sender.send(finished).await;
    }
}

impl Console {
    /// A page whose body comes as `work` sends it: `head` at once, then each row as it is done.
    /// The work runs to its end even if the browser leaves.
    fn streamed<F, Fut>(&self, who: &Who, title: &str, head: String, work: F) -> Response
    where
        F: FnOnce(Rows) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let page = page::layout(title, &self.viewer(who, true), page::STREAMED);
        let (top, bottom) = page
            .split_once(page::STREAMED)
            .map(|(top, bottom)| (top.to_owned() + &head, bottom.to_owned()))
            .expect("the layout holds its body once");
        let (sender, receiver) = tokio::sync::mpsc::channel(16);
        tokio::spawn(work(Rows {
            sender,
            stop: self.inner.stop.clone(),
        }));
        let rows = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|row| (row, receiver))
        });
        let body = futures::stream::once(async { top })
            .chain(rows)
            .chain(futures::stream::once(async { bottom }))
            .map(Ok::<_, std::convert::Infallible>);
        (
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            axum::body::Body::from_stream(body),
        )
            .into_response()
    }

    /// A bulk action asked for by a key that cannot settle anything: nothing is tried.
    fn not_an_operator(&self, who: &Who) -> Response {
        let body = page::message(
            "Not allowed",
            "Your key cannot reconcile or resolve operations: sign in with a key that has the operator role.",
            "/queue",
        );
        self.page(StatusCode::FORBIDDEN, "Not allowed", who, true, &body)
    }

    fn bulk_refused(&self, who: &Who, problem: &str) -> Response {
        let body = page::message("Refused", problem, "/queue");
        self.page(StatusCode::BAD_REQUEST, "Refused", who, false, &body)
    }
}

impl Console {
    /// The operation's page as it is now, with `notice` above it.
    async fn operation_page(
        &self,
        who: &Who,
        id: &str,
        status: StatusCode,
        notice: Option<&str>,
    ) -> Response {
        match who.client.get(id).await {
            Ok(op) => {
                let body = page::operation(&op, &self.viewer(who, true), notice);
                self.page(status, "Operation", who, true, &body)
            }
            Err(error) => self.failed(who, &error, &here(id)),
        }
    }
}

async fn css() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        include_str!("../assets/console.css"),
    )
}

async fn js() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        include_str!("../assets/console.js"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bulk action the ledger stopped by refusing the key says so, and how many operations
    /// were not started; one the console's shutdown stopped says that instead.
    #[tokio::test]
    async fn a_bulk_action_says_why_it_stopped() {
        let target = |n: usize| Target {
            operation_id: format!("op-{n}"),
            fencing_token: 1,
            attempt: 1,
        };
        let revoked = || {
            Done::<OpState>::Refused(once_client::ClientError::Refused {
                reason: "CREDENTIALS_REVOKED".into(),
                message: "the key was revoked".into(),
            })
        };
        let finished = |outcomes: Vec<Outcome>| async move {
            let (sender, mut receiver) = tokio::sync::mpsc::channel(16);
            let rows = Rows {
                sender,
                stop: CancellationToken::new(),
            };
            rows.send_all(5, futures::stream::iter(outcomes)).await;
            let mut last = String::new();
            while let Some(row) = receiver.recv().await {
                last = row;
            }
            last
        };
        let applied = |n| {
            Outcome::of(target(n), Done::Applied(OpState::Absent), |s| {
                (Some(s), String::new())
            })
        };
        let refused = |n| Outcome::of(target(n), revoked(), |s| (Some(s), String::new()));
        let said = finished(vec![applied(0), refused(1)]).await;
        assert!(
            said.contains("data-done=\"1\" data-refused=\"1\""),
            "{said}"
        );
        assert!(
            said.contains("Your key itself was refused (the ledger refused the call: the key was revoked (CREDENTIALS_REVOKED)), so the other 3 were not started"),
            "{said}"
        );
        let said = finished(vec![applied(0), applied(1)]).await;
        assert!(said.contains("The console is shutting down"), "{said}");
        let said = finished((0..5).map(applied).collect()).await;
        assert!(!said.contains("not started"), "{said}");
    }

    #[test]
    fn after_sign_in_only_a_path_of_this_console_is_followed() {
        assert_eq!(
            local("/operation?id=refund%3Aa"),
            "/operation?id=refund%3Aa"
        );
        for elsewhere in [
            "https://evil.example/",
            "//evil.example/",
            "/\\evil.example",
            // Browsers drop tabs and line ends from a URL: this is `//evil.example`.
            "/\t/evil.example",
            "/\n/evil.example",
            "/ /x",
            "queue",
            "",
        ] {
            assert_eq!(local(elsewhere), "/queue", "{elsewhere:?}");
        }
    }
}
