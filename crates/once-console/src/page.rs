//! The console's pages, rendered on the server as HTML. Every value that came from the ledger
//! or the request passes through [`esc`] on its way into a page; the pages read without
//! JavaScript, and `console.js` only makes the queue live.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use once_client::{AttemptView, EventView, OperationView, State, StatsView};

use crate::session::Session;

/// Text made safe to stand in HTML, in an element or a quoted attribute.
pub(crate) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Text made safe to stand in a URL's path segment or query value.
pub(crate) fn url(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

/// Who is signed in, as the pages show it: `None` in open mode.
pub(crate) struct Viewer<'a> {
    pub(crate) session: Option<&'a Session>,
    /// The CSRF token of open mode's forms.
    pub(crate) open_csrf: &'a str,
    /// Without a session, whether the ledger answered this page key-less: open mode.
    pub(crate) open: bool,
}

impl Viewer<'_> {
    fn csrf(&self) -> &str {
        self.session.map_or(self.open_csrf, |s| s.csrf.as_str())
    }

    /// Whether the viewer may settle operations: an operator's key, or open mode.
    pub(crate) fn operates(&self) -> bool {
        self.session.is_none_or(Session::operates)
    }

    fn hidden_csrf(&self) -> String {
        format!(
            r#"<input type="hidden" name="csrf" value="{}">"#,
            esc(self.csrf())
        )
    }
}

/// A whole page around `body`.
pub(crate) fn layout(title: &str, viewer: &Viewer<'_>, body: &str) -> String {
    let who = match viewer.session {
        Some(s) => format!(
            r#"<span class="who">{tenant} · {name} <span class="roles">({roles})</span></span>
<form method="post" action="/sign-out" class="inline">{csrf}<button type="submit">Sign out</button></form>"#,
            tenant = esc(&s.tenant),
            name = esc(&s.key_name),
            roles = esc(&s.roles.join(", ")),
            csrf = viewer.hidden_csrf(),
        ),
        None => String::new(),
    };
    let banner = match viewer.session.is_none() && viewer.open {
        true => {
            r#"<p class="banner" role="status">Open mode: the ledger holds no credentials, so this console opens without sign-in and acts as tenant <code>default</code> with every role. Create a key (<code>onced keys create</code>) to require sign-in.</p>"#
        }
        false => "",
    };
    format!(
        r##"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · once-ledger</title>
<link rel="stylesheet" href="/assets/console.css">
<script src="/assets/console.js" defer></script>
</head>
<body>
<a class="skip" href="#main">Skip to content</a>
<header>
<nav aria-label="Console">
<a class="brand" href="/">once-ledger</a>
<a href="/queue">UNKNOWN queue</a>
<a href="/overview">Overview</a>
</nav>
<div class="session">{who}</div>
</header>
{banner}
<main id="main">
{body}
</main>
</body>
</html>
"##,
        title = esc(title),
    )
}

/// The sign-in form; `problem` says why the last try failed.
pub(crate) fn sign_in(problem: Option<&str>, next: &str) -> String {
    let problem = problem
        .map(|p| format!(r#"<p class="error" role="alert">{}</p>"#, esc(p)))
        .unwrap_or_default();
    format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sign in · once-ledger</title>
<link rel="stylesheet" href="/assets/console.css">
</head>
<body>
<main id="main" class="narrow">
<h1>once-ledger console</h1>
{problem}
<form method="post" action="/sign-in">
<input type="hidden" name="next" value="{next}">
<label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="off" required autofocus>
<p class="hint">A key of your tenant: a reader's to look, an operator's to settle operations. It stays on the server; the browser holds only a session cookie.</p>
<button type="submit">Sign in</button>
</form>
</main>
</body>
</html>
"#,
        next = esc(next),
    )
}

/// The queue's filters, as the query string gives them.
#[derive(Debug, Default, Clone, serde::Deserialize)]
pub(crate) struct QueueFilter {
    #[serde(default)]
    pub(crate) tool: String,
    #[serde(default)]
    pub(crate) provider: String,
    /// Only operations older than this (`90s`, `15m`, `2h`, `1d`).
    #[serde(default)]
    pub(crate) older_than: String,
    /// Part of an operation id, a provider reference, a reason or a tool, or the start of the
    /// fingerprint of its arguments (its intent).
    #[serde(default)]
    pub(crate) q: String,
    /// Only operations put in UNKNOWN this way: `attempt` (its attempt said it could not
    /// tell), `lease` (its lease ran out) or `anomaly` (held for an operator).
    #[serde(default)]
    pub(crate) source: String,
}

/// The ways into UNKNOWN the queue filters by, as the page names them.
const SOURCES: [(&str, &str); 3] = [
    ("attempt", "its attempt could not tell"),
    ("lease", "its lease ran out"),
    ("anomaly", "held for an operator"),
];

impl QueueFilter {
    fn query(&self) -> String {
        format!(
            "tool={}&provider={}&older_than={}&q={}&source={}",
            url(&self.tool),
            url(&self.provider),
            url(&self.older_than),
            url(&self.q),
            url(&self.source)
        )
    }

    /// The filter in words: what a bulk action takes.
    pub(crate) fn described(&self) -> String {
        let mut parts = Vec::new();
        for (what, value) in [
            ("tool", &self.tool),
            ("provider", &self.provider),
            ("older than", &self.older_than),
        ] {
            if !value.trim().is_empty() {
                parts.push(format!("{what} {}", value.trim()));
            }
        }
        if !self.q.trim().is_empty() {
            parts.push(format!("matching “{}”", self.q.trim()));
        }
        if let Some((_, said)) = SOURCES.iter().find(|(s, _)| *s == self.source) {
            parts.push(format!("where {said}"));
        }
        match parts.is_empty() {
            true => "Every UNKNOWN operation".to_owned(),
            false => format!("UNKNOWN operations of {}", parts.join(", ")),
        }
    }

    /// Whether `op` matches the text search and the source.
    pub(crate) fn matches(&self, op: &OperationView) -> bool {
        let source = self.source.trim();
        if !source.is_empty() && op.source != source {
            return false;
        }
        let q = self.q.trim();
        q.is_empty()
            || op.operation_id.contains(q)
            || op.provider_ref.as_deref().is_some_and(|r| r.contains(q))
            || op.reason.as_deref().is_some_and(|r| r.contains(q))
            || op.tool.contains(q)
            || op.fingerprint.starts_with(q)
    }
}

/// The UNKNOWN queue, oldest first.
pub(crate) fn queue(
    filter: &QueueFilter,
    rows: &[OperationView],
    more: bool,
    operates: bool,
    now: SystemTime,
) -> String {
    let input = |name: &str, label: &str, value: &str, hint: &str| {
        format!(
            r#"<label>{label}<input name="{name}" value="{value}" placeholder="{hint}"></label>"#,
            value = esc(value)
        )
    };
    let more = if more {
        r#"<p class="hint">Only the oldest operations are shown; narrow the filter to see others.</p>"#
    } else {
        ""
    };
    let bulk = match operates {
        true => format!(
            r#"<p class="bulk"><a href="/bulk?{query}">Act on these…</a> Reconcile or resolve every operation this filter selects, after a look at the list.</p>"#,
            query = esc(&filter.query())
        ),
        false => String::new(),
    };
    format!(
        r#"<h1>UNKNOWN operations</h1>
<p class="lede">The effect of each may or may not have happened. A reconciler settles what its provider can tell; the rest wait for a person. Oldest first.</p>
<form method="get" action="/queue" class="filters" role="search">
{tool}{provider}{older}{source}{q}
<button type="submit">Filter</button>
</form>
<section aria-live="polite" data-live="/queue/live?{query}" data-rows="/queue?{query}">
{table}
</section>
{more}
{bulk}"#,
        source = source_choice(&filter.source),
        tool = input("tool", "Tool", &filter.tool, "issue_refund"),
        provider = input("provider", "Provider", &filter.provider, "stripe"),
        older = input("older_than", "Older than", &filter.older_than, "1h"),
        q = input(
            "q",
            "Search",
            &filter.q,
            "operation id, provider ref, reason"
        ),
        query = esc(&filter.query()),
        table = queue_rows(rows, now),
    )
}

/// The queue's choice of how operations came to be UNKNOWN.
fn source_choice(chosen: &str) -> String {
    let mut options = String::from(r#"<option value="">any way</option>"#);
    for (value, said) in SOURCES {
        let selected = if value == chosen { " selected" } else { "" };
        let _ = write!(
            options,
            r#"<option value="{value}"{selected}>{said}</option>"#
        );
    }
    format!(r#"<label>Why UNKNOWN<select name="source">{options}</select></label>"#)
}

/// The queue's table alone: what the live page swaps in when an operation enters or leaves.
pub(crate) fn queue_rows(rows: &[OperationView], now: SystemTime) -> String {
    if rows.is_empty() {
        return r#"<p class="empty" id="queue-count" data-count="0">No UNKNOWN operation matches.</p>"#.into();
    }
    format!(
        r#"<p id="queue-count" data-count="{n}">{n} UNKNOWN</p>
{table}"#,
        n = rows.len(),
        table = unknown_table(rows, now, false),
    )
}

/// UNKNOWN operations, a row each; with the attempt each is bound to when `attempts`.
fn unknown_table(rows: &[OperationView], now: SystemTime, attempts: bool) -> String {
    let attempt_head = match attempts {
        true => r#"<th scope="col">Attempt</th>"#,
        false => "",
    };
    let mut table = format!(
        r#"<table class="queue">
<thead><tr><th scope="col">Age</th><th scope="col">Operation</th>{attempt_head}<th scope="col">Tool</th><th scope="col">Provider</th><th scope="col">Source</th><th scope="col">Why</th></tr></thead>
<tbody>
"#
    );
    for op in rows {
        let attempt = match attempts {
            true => format!("<td>{}</td>", op.attempt),
            false => String::new(),
        };
        let _ = writeln!(
            table,
            r#"<tr data-operation="{id}"><td>{age}</td><td><a href="/operation?id={link}">{id}</a></td>{attempt}<td>{tool}</td><td>{provider}</td><td>{source}</td><td>{reason}</td></tr>"#,
            id = esc(&op.operation_id),
            link = url(&op.operation_id),
            age = age(op.created_at, now),
            tool = esc(&op.tool),
            provider = esc(op.provider.as_deref().unwrap_or("—")),
            source = esc(&op.source),
            reason = esc(op.reason.as_deref().unwrap_or("")),
        );
    }
    table.push_str("</tbody>\n</table>");
    table
}

/// How long ago `at` was, in the largest unit that fits.
fn age(at: Option<SystemTime>, now: SystemTime) -> String {
    match at {
        Some(at) => duration(now.duration_since(at).unwrap_or(Duration::ZERO)),
        None => "—".into(),
    }
}

fn time(at: Option<SystemTime>) -> String {
    at.map(|at| {
        chrono::DateTime::<chrono::Utc>::from(at)
            .format("%Y-%m-%d %H:%M:%S%.3f UTC")
            .to_string()
    })
    .unwrap_or_else(|| "—".into())
}

/// A stored result as a person reads it: JSON indented, anything else as text or bytes.
fn result(bytes: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) {
        if let Ok(pretty) = serde_json::to_string_pretty(&value) {
            return pretty;
        }
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => format!("{} bytes, not UTF-8: {}", bytes.len(), hex::encode(bytes)),
    }
}

/// One operation: what it is, its timeline, its attempts, where its calls came from, and, for
/// an operator and an UNKNOWN operation, what can be done.
pub(crate) fn operation(op: &OperationView, viewer: &Viewer<'_>, notice: Option<&str>) -> String {
    let id = esc(&op.operation_id);
    let mut body = format!(
        r#"<h1>Operation <code>{id}</code></h1>
{notice}
<dl class="facts">
<dt>State</dt><dd><span class="state state-{st}">{st}</span> <span class="hint">set by {source}</span></dd>
<dt>Tool</dt><dd>{tool}</dd>
<dt>Tenant</dt><dd>{tenant}</dd>
<dt>Provider</dt><dd>{provider}</dd>
<dt>Provider reference</dt><dd>{provider_ref}</dd>
<dt>Provider key</dt><dd><code>{provider_key}</code>{dashboard}</dd>
<dt>Latest attempt</dt><dd>{attempt} (fencing token {token})</dd>
<dt>Why</dt><dd>{reason}</dd>
<dt>Created</dt><dd>{created}</dd>
<dt>Updated</dt><dd>{updated}</dd>
<dt>Kept until</dt><dd>{expires}</dd>
</dl>
"#,
        notice = notice
            .map(|n| format!(r#"<p class="notice" role="status">{}</p>"#, esc(n)))
            .unwrap_or_default(),
        st = op.state.as_str(),
        source = esc(&op.source),
        tool = esc(&op.tool),
        tenant = esc(&op.tenant),
        provider = esc(op.provider.as_deref().unwrap_or("—")),
        provider_ref = esc(op.provider_ref.as_deref().unwrap_or("—")),
        provider_key = esc(&op.provider_key),
        dashboard = op
            .provider_dashboard
            .as_deref()
            .map(|link| format!(
                r#" <a class="dashboard" href="{}" rel="noopener noreferrer" target="_blank">Open in {}'s dashboard</a>"#,
                esc(link),
                esc(op.provider.as_deref().unwrap_or("the provider"))
            ))
            .unwrap_or_default(),
        attempt = op.attempt,
        token = op.fencing_token,
        reason = esc(op.reason.as_deref().unwrap_or("—")),
        created = time(op.created_at),
        updated = time(op.updated_at),
        expires = time(op.expires_at),
    );
    if op.state == State::Unknown && viewer.operates() {
        body.push_str(&acts(op, viewer));
    }
    if let Some(forensics) = &op.forensics {
        let _ = write!(
            body,
            r#"<h2>Why it was called more than once</h2><p class="forensics">{}</p>"#,
            esc(forensics)
        );
    }
    body.push_str(&timeline(&op.events));
    body.push_str(&earlier_lives(&op.earlier_events));
    body.push_str(&attempts(&op.attempts));
    if !op.calls.is_empty() {
        body.push_str(r#"<h2>Calls</h2><table><thead><tr><th scope="col">When</th><th scope="col">Decision</th><th scope="col">Attempt</th><th scope="col">Client</th><th scope="col">Session</th><th scope="col">Request</th><th scope="col">Origin</th></tr></thead><tbody>"#);
        for call in &op.calls {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                time(call.at),
                esc(&call.decision),
                call.attempt.map(|a| a.to_string()).unwrap_or_default(),
                esc(call.context.client_name.as_deref().unwrap_or("")),
                esc(call.context.session_id.as_deref().unwrap_or("")),
                esc(call.context.request_id.as_deref().unwrap_or("")),
                esc(call.origin.as_deref().unwrap_or("")),
            );
        }
        body.push_str("</tbody></table>");
    }
    body.push_str("<h2>Stored result</h2>");
    match &op.result {
        Some(bytes) => {
            let _ = write!(body, r#"<pre class="result">{}</pre>"#, esc(&result(bytes)));
        }
        None => body.push_str(r#"<p class="hint">None stored.</p>"#),
    }
    body
}

fn timeline(events: &[EventView]) -> String {
    let mut out = String::from(r#"<h2>Timeline</h2>"#);
    out.push_str(&timeline_items(events));
    out
}

/// The events of the operation's earlier lives, folded away under one line.
fn earlier_lives(events: &[EventView]) -> String {
    if events.is_empty() {
        return String::new();
    }
    format!(
        r#"<details class="earlier"><summary>Earlier lives: {n} event{s} (before, this id was settled, deleted by retention and begun again)</summary>{items}</details>"#,
        n = events.len(),
        s = if events.len() == 1 { "" } else { "s" },
        items = timeline_items(events),
    )
}

fn timeline_items(events: &[EventView]) -> String {
    let mut out = String::from(r#"<ol class="timeline">"#);
    for event in events {
        let change = match (event.from, event.to) {
            (Some(from), Some(to)) => format!("{} → {}", from.as_str(), to.as_str()),
            (None, Some(to)) => format!("→ {}", to.as_str()),
            _ => String::new(),
        };
        let _ = write!(
            out,
            r#"<li><span class="when">{at}</span> <strong>{kind}</strong> <span class="change">{change}</span> <span class="actor">by {actor}</span>{attempt}{reason}{details}</li>"#,
            at = time(event.at),
            kind = esc(&event.kind),
            actor = esc(&event.actor),
            attempt = match event.attempt {
                0 => String::new(),
                n => format!(" <span class=\"hint\">attempt {n}</span>"),
            },
            reason = event
                .reason
                .as_deref()
                .map(|r| format!(r#"<div class="reason">{}</div>"#, esc(r)))
                .unwrap_or_default(),
            details = event
                .details
                .as_deref()
                .map(|d| format!(
                    r#"<pre class="details">{}</pre>"#,
                    esc(&result(d.as_bytes()))
                ))
                .unwrap_or_default(),
        );
    }
    out.push_str("</ol>");
    out
}

fn attempts(attempts: &[AttemptView]) -> String {
    if attempts.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        r#"<h2>Attempts</h2><table><thead><tr><th scope="col">#</th><th scope="col">Started</th><th scope="col">Lease until</th><th scope="col">Executor</th><th scope="col">Client</th><th scope="col">Session</th><th scope="col">Request</th><th scope="col">Fencing token</th></tr></thead><tbody>"#,
    );
    for a in attempts {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            a.number,
            time(a.started_at),
            time(a.lease_deadline),
            esc(&a.actor),
            esc(a.context.client_name.as_deref().unwrap_or("")),
            esc(a.context.session_id.as_deref().unwrap_or("")),
            esc(a.context.request_id.as_deref().unwrap_or("")),
            a.fencing_token,
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// Reconcile and resolve, bound to the attempt this page shows.
fn acts(op: &OperationView, viewer: &Viewer<'_>) -> String {
    let id = esc(&op.operation_id);
    let bound = format!(
        r#"{csrf}<input type="hidden" name="fencing_token" value="{token}"><input type="hidden" name="attempt" value="{attempt}">"#,
        csrf = viewer.hidden_csrf(),
        token = op.fencing_token,
        attempt = op.attempt,
    );
    format!(
        r#"<section class="acts" aria-labelledby="acts-title">
<h2 id="acts-title">Settle it</h2>
<form method="post" action="/operation/reconcile" class="inline">{csrf}<input type="hidden" name="id" value="{id}"><button type="submit">Reconcile now</button></form>
<form method="post" action="/operation/resolve" class="resolve">
<input type="hidden" name="id" value="{id}">
{bound}
<fieldset>
<legend>Resolve as</legend>
<label><input type="radio" name="outcome" value="ABSENT" required> ABSENT: the effect did not happen; the next call executes it</label>
<label><input type="radio" name="outcome" value="CONFIRMED"> CONFIRMED: the effect happened; the next call replays this result</label>
</fieldset>
<label for="result">Result to replay (CONFIRMED)</label>
<textarea id="result" name="result" rows="4"></textarea>
<label for="provider_ref">Provider reference (CONFIRMED)</label>
<input id="provider_ref" name="provider_ref">
<label for="reason">Reason (recorded with your name)</label>
<input id="reason" name="reason" required>
<button type="submit">Review…</button>
</form>
</section>
"#,
        csrf = viewer.hidden_csrf(),
    )
}

/// What a resolution will do, asked before it is sent.
pub(crate) fn confirm_resolve(
    op: &OperationView,
    viewer: &Viewer<'_>,
    form: &crate::ResolveForm,
) -> String {
    let what = match form.outcome.as_str() {
        "CONFIRMED" => "CONFIRMED: the ledger will record that the effect happened, and every later call of this operation will be answered with the result below, never executed again.",
        _ => "ABSENT: the ledger will record that the effect did not happen, and the next call of this operation will execute it.",
    };
    format!(
        r#"<h1>Resolve <code>{id}</code>?</h1>
<p>{what}</p>
<dl class="facts">
<dt>Bound to</dt><dd>attempt {attempt}, fencing token {token}: if the operation moved since you looked, nothing is applied</dd>
<dt>Reason</dt><dd>{reason}</dd>
<dt>Provider reference</dt><dd>{provider_ref}</dd>
</dl>
<pre class="result">{result}</pre>
<form method="post" action="/operation/resolve">
<input type="hidden" name="id" value="{id}">
{csrf}
<input type="hidden" name="confirmed" value="yes">
<input type="hidden" name="resolution_id" value="{resolution_id}">
<input type="hidden" name="outcome" value="{outcome}">
<input type="hidden" name="fencing_token" value="{token}">
<input type="hidden" name="attempt" value="{attempt}">
<input type="hidden" name="reason" value="{reason}">
<input type="hidden" name="provider_ref" value="{provider_ref}">
<input type="hidden" name="result" value="{result}">
<button type="submit">Resolve {outcome}</button>
<a href="/operation?id={link}">Cancel</a>
</form>"#,
        id = esc(&op.operation_id),
        link = url(&op.operation_id),
        attempt = form.attempt,
        token = form.fencing_token,
        reason = esc(&form.reason),
        provider_ref = esc(&form.provider_ref),
        result = esc(&form.result),
        outcome = esc(&form.outcome),
        resolution_id = esc(&crate::session::random_token()),
        csrf = viewer.hidden_csrf(),
    )
}

/// How far back the overview's figures look, as the page offers it.
pub(crate) const WINDOWS: [&str; 4] = ["1h", "24h", "7d", "30d"];

/// What the overview shows.
pub(crate) struct Figures {
    pub stats: StatsView,
    pub unknown: Vec<OperationView>,
    pub history: Option<once_client::HistoryHead>,
}

/// The overview: what is open now and how UNKNOWN operations have been settled over `window`.
pub(crate) fn overview(window: &str, figures: &Figures, now: SystemTime) -> String {
    let choices: String = WINDOWS
        .iter()
        .map(|w| {
            let current = if *w == window {
                r#" aria-current="page""#
            } else {
                ""
            };
            format!(r#"<a href="/overview?window={w}"{current}>{w}</a> "#)
        })
        .collect();
    format!(
        r#"<h1>Overview</h1>
<nav class="windows" aria-label="Window">Over the last: {choices}</nav>
<section aria-live="polite" data-live="/queue/live" data-rows="/overview?window={window}">
{body}
</section>"#,
        window = url(window),
        body = overview_body(window, figures, now),
    )
}

/// The overview's figures alone: what the live page swaps in when an operation enters or
/// leaves UNKNOWN.
pub(crate) fn overview_body(window: &str, figures: &Figures, now: SystemTime) -> String {
    let (stats, unknown) = (&figures.stats, figures.unknown.as_slice());
    let mut out = String::new();
    let ages = stats.unknown;
    let _ = write!(
        out,
        r#"<h2>UNKNOWN now</h2>
<p class="figure" id="unknown-count" data-count="{count}"><strong>{count}</strong> UNKNOWN; the oldest for {max}, half for more than {p50}.</p>
{histogram}
"#,
        count = ages.count,
        max = duration(ages.max),
        p50 = duration(ages.p50),
        histogram = histogram(unknown, now),
    );
    out.push_str(r#"<h2>Operations by state and tool</h2>"#);
    if stats.operations.is_empty() {
        out.push_str(r#"<p class="hint">None.</p>"#);
    } else {
        out.push_str(r#"<table><thead><tr><th scope="col">State</th><th scope="col">Tool</th><th scope="col">Operations</th></tr></thead><tbody>"#);
        for (state, tool, count) in &stats.operations {
            let _ = write!(
                out,
                r#"<tr><td><span class="state state-{st}">{st}</span></td><td>{tool}</td><td>{count}</td></tr>"#,
                st = state.as_str(),
                tool = esc(tool),
            );
        }
        out.push_str("</tbody></table>");
    }
    let _ = write!(
        out,
        r#"<h2>How UNKNOWN operations were settled, last {}</h2>"#,
        esc(window)
    );
    if stats.resolved.iter().all(|(_, a)| a.count == 0) {
        out.push_str(r#"<p class="hint">None settled in this window.</p>"#);
    } else {
        out.push_str(r#"<table><thead><tr><th scope="col">By</th><th scope="col">Settled</th><th scope="col">p50</th><th scope="col">p90</th><th scope="col">p99</th><th scope="col">Longest</th></tr></thead><tbody>"#);
        for (door, a) in &stats.resolved {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&door.replace('_', " ")),
                a.count,
                duration(a.p50),
                duration(a.p90),
                duration(a.p99),
                duration(a.max),
            );
        }
        out.push_str("</tbody></table>");
    }
    let _ = write!(out, r#"<h2>Reconcilers, last {}</h2>"#, esc(window));
    if stats.reconcilers.is_empty() {
        out.push_str(r#"<p class="hint">No lookups in this window.</p>"#);
    } else {
        out.push_str(r#"<table class="reconcilers"><thead><tr><th scope="col">Reconciler</th><th scope="col">Lookups</th><th scope="col">Settled</th><th scope="col">Found nothing yet</th><th scope="col">Could not tell</th><th scope="col">Mean</th><th scope="col">Longest</th></tr></thead><tbody>"#);
        for r in &stats.reconcilers {
            let took = |d: Option<Duration>| d.map_or_else(|| "—".to_owned(), duration);
            let failed = match r.failed {
                0 => "0".to_owned(),
                n => format!(r#"<strong class="warn">{n}</strong>"#),
            };
            let _ = write!(
                out,
                r#"<tr data-reconciler="{name}"><td>{name}</td><td>{lookups}</td><td>{settled}</td><td>{missed}</td><td>{failed}</td><td>{mean}</td><td>{max}</td></tr>"#,
                name = esc(&r.reconciler),
                lookups = r.lookups(),
                settled = r.settled,
                missed = r.missed,
                mean = took(r.mean),
                max = took(r.max),
            );
        }
        out.push_str("</tbody></table>");
    }
    let _ = write!(
        out,
        r#"<h2>Anomalies and escalations, last {}</h2>"#,
        esc(window)
    );
    if stats.events.is_empty() {
        out.push_str(r#"<p class="hint">None.</p>"#);
    } else {
        out.push_str(r#"<table><thead><tr><th scope="col">Kind</th><th scope="col">Events</th></tr></thead><tbody>"#);
        for (kind, count) in &stats.events {
            let _ = write!(out, "<tr><td>{}</td><td>{count}</td></tr>", esc(kind));
        }
        out.push_str("</tbody></table>");
    }
    if let Some(head) = &figures.history {
        out.push_str(&history(head));
    }
    out
}

/// The history's chain: its head, and what its last verification found.
fn history(head: &once_client::HistoryHead) -> String {
    let mut out = String::from(r#"<h2>The history's chain</h2>"#);
    if head.head_number == 0 {
        out.push_str(r#"<p class="hint" id="chain-head">No event is linked yet.</p>"#);
    } else {
        let _ = write!(
            out,
            r#"<p id="chain-head" data-link="{number}" data-through="{through}">Linked through event {through}: the newest link is number {number}, hash <code title="{hash}">{short}…</code>, written {at}.</p>"#,
            number = head.head_number,
            through = head.head_through,
            hash = esc(&head.head_hash),
            short = esc(head.head_hash.get(..16).unwrap_or(&head.head_hash)),
            at = time(head.linked_at),
        );
    }
    match &head.last_verification {
        None => out.push_str(
            r#"<p class="hint" id="chain-verified" data-verified="never">Never verified: <code>oncectl verify</code> walks the chain and names the first event, result or state that does not match.</p>"#,
        ),
        Some(v) => {
            let said = match &v.problem {
                None => "everything matched what the chain recorded.".to_owned(),
                Some(problem) => format!(
                    r#"<strong class="warn">it does not match</strong>: {}"#,
                    esc(problem)
                ),
            };
            let _ = write!(
                out,
                r#"<p id="chain-verified" data-verified="{verdict}">Last verified {at}: {links} links, {events} events, through event {through}; {said}</p>"#,
                verdict = if v.problem.is_none() { "clean" } else { "problem" },
                at = time(Some(v.at)),
                links = v.links,
                events = v.events,
                through = v.through,
            );
        }
    }
    out
}

/// The UNKNOWN operations' ages (since their last change) as an SVG bar chart, drawn here.
fn histogram(unknown: &[OperationView], now: SystemTime) -> String {
    const BUCKETS: [(&str, u64); 6] = [
        ("< 1 min", 60),
        ("1–10 min", 600),
        ("10–60 min", 3600),
        ("1–6 h", 6 * 3600),
        ("6–24 h", 86_400),
        ("> 1 d", u64::MAX),
    ];
    let mut counts = [0u64; BUCKETS.len()];
    for op in unknown {
        let since = op.updated_at.or(op.created_at).unwrap_or(now);
        let age = now
            .duration_since(since)
            .unwrap_or(Duration::ZERO)
            .as_secs();
        let bucket = BUCKETS
            .iter()
            .position(|(_, below)| age < *below)
            .unwrap_or(BUCKETS.len() - 1);
        counts[bucket] += 1;
    }
    let highest = counts.iter().copied().max().unwrap_or(0).max(1);
    let (width, bar, gap, height) = (600u64, 80u64, 20u64, 120u64);
    let described: Vec<String> = BUCKETS
        .iter()
        .zip(counts)
        .map(|((label, _), n)| format!("{label}: {n}"))
        .collect();
    let mut svg = format!(
        r#"<figure class="chart"><svg viewBox="0 0 {width} {total}" role="img" aria-label="UNKNOWN operations by age: {described}">"#,
        total = height + 40,
        described = esc(&described.join(", ")),
    );
    for (i, ((label, _), n)) in BUCKETS.iter().zip(counts).enumerate() {
        let x = i as u64 * (bar + gap) + gap / 2;
        let h = n * height / highest;
        let _ = write!(
            svg,
            r#"<g><title>{label}: {n}</title><rect class="bar" x="{x}" y="{y}" width="{bar}" height="{h}"></rect><text x="{cx}" y="{ty}" text-anchor="middle">{n}</text><text x="{cx}" y="{ly}" text-anchor="middle" class="axis">{label}</text></g>"#,
            y = height - h + 14,
            cx = x + bar / 2,
            ty = (height - h + 10).max(12),
            ly = height + 34,
        );
    }
    svg.push_str(r#"</svg><figcaption>UNKNOWN operations by time since their last change</figcaption></figure>"#);
    svg
}

/// A duration as a person reads it.
fn duration(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0 => format!("{} ms", d.as_millis()),
        s if s < 120 => format!("{s} s"),
        s if s < 2 * 3600 => format!("{} min", s / 60),
        s if s < 2 * 86_400 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// A page that says one thing, with a way back.
pub(crate) fn message(heading: &str, text: &str, back: &str) -> String {
    format!(
        r#"<h1>{}</h1><p role="alert">{}</p><p><a href="{}">Back</a></p>"#,
        esc(heading),
        esc(text),
        esc(back)
    )
}

/// Where a streamed page's body goes in its layout.
pub(crate) const STREAMED: &str = "\u{0}streamed\u{0}";

/// What a filter selects, before anything is done to it (a dry run), and for an operator what
/// can be done to all of it: reconcile each, or resolve each ABSENT with one reason, each bound
/// to the attempt shown here.
pub(crate) fn bulk(
    filter: &QueueFilter,
    rows: &[OperationView],
    more: bool,
    viewer: &Viewer<'_>,
    now: SystemTime,
) -> String {
    let count = rows.len();
    let mut out = format!(
        r#"<h1>{count} UNKNOWN operation{s} selected</h1>
<p class="lede">{what}. This is a dry run: nothing has been done to them.</p>
"#,
        s = if count == 1 { "" } else { "s" },
        what = esc(&filter.described()),
    );
    if count == 0 {
        out.push_str(r#"<p><a href="/queue">Back to the queue</a></p>"#);
        return out;
    }
    out.push_str(&unknown_table(rows, now, true));
    if more {
        let _ = write!(
            out,
            r#"<p class="hint">More than {count} match: only the oldest are shown, and nothing can be done to them all at once. Narrow the filter.</p>"#
        );
        return out;
    }
    if !viewer.operates() {
        return out;
    }
    let targets: Vec<once_client::Target> = rows.iter().map(Into::into).collect();
    let bound = bound_targets(&targets);
    let _ = write!(
        out,
        r#"<section class="acts" aria-labelledby="bulk-reconcile-title">
<h2 id="bulk-reconcile-title">Reconcile them</h2>
<p>Each is looked up with its reconciler now. What the provider proves is applied; a miss leaves it UNKNOWN.</p>
<form method="post" action="/bulk/reconcile" class="bulk-reconcile">{csrf}{bound}<button type="submit">Reconcile these {count}</button></form>
</section>
<section class="acts" aria-labelledby="bulk-resolve-title">
<h2 id="bulk-resolve-title">Resolve them ABSENT</h2>
<p>For effects that certainly did not happen: the next call of each executes it. Each resolution is bound to the attempt shown above; one that moved since is refused and left as it is.</p>
<form method="post" action="/bulk/resolve" class="bulk-resolve">{csrf}{bound}
<label for="bulk-reason">Reason (recorded with your name, on each)</label>
<input id="bulk-reason" name="reason" required>
<button type="submit">Review…</button>
</form>
</section>"#,
        csrf = viewer.hidden_csrf(),
    );
    out
}

/// Each operation as a hidden field, with the attempt it is bound to.
fn bound_targets(targets: &[once_client::Target]) -> String {
    let mut out = String::new();
    for (i, t) in targets.iter().enumerate() {
        let _ = write!(
            out,
            r#"<input type="hidden" name="t{i}" value="{token} {attempt} {id}">"#,
            token = t.fencing_token,
            attempt = t.attempt,
            id = esc(&t.operation_id),
        );
    }
    out
}

/// What resolving the targets ABSENT will do, asked before it is done.
pub(crate) fn confirm_bulk_resolve(
    targets: &[once_client::Target],
    reason: &str,
    viewer: &Viewer<'_>,
) -> String {
    let count = targets.len();
    let mut list = String::new();
    for t in targets {
        let _ = write!(
            list,
            "<li><code>{id}</code> at attempt {attempt}</li>",
            id = esc(&t.operation_id),
            attempt = t.attempt
        );
    }
    let bound = bound_targets(targets);
    format!(
        r#"<h1>Resolve {count} operation{s} ABSENT?</h1>
<p>ABSENT: the ledger will record, for each, that the effect did not happen, and the next call of each will execute it. Each is bound to the attempt listed: one that moved since is refused, and nothing is applied to it.</p>
<dl class="facts"><dt>Reason</dt><dd>{reason_text}</dd></dl>
<ul class="targets">{list}</ul>
<form method="post" action="/bulk/resolve">{csrf}{bound}
<input type="hidden" name="confirmed" value="yes">
<input type="hidden" name="reason" value="{reason_text}">
<button type="submit">Resolve {count} ABSENT</button>
<a href="/queue">Cancel</a>
</form>"#,
        s = if count == 1 { "" } else { "s" },
        reason_text = esc(reason),
        csrf = viewer.hidden_csrf(),
    )
}

/// The top of a bulk action's outcome table, sent before the first operation is done.
pub(crate) fn bulk_started(doing: &str, count: usize) -> String {
    format!(
        r#"<h1>{doing} {count} operation{s}</h1>
<p class="lede">Each row appears as its operation is done.</p>
<table class="queue outcomes"><thead><tr><th scope="col">Operation</th><th scope="col">Attempt</th><th scope="col">Outcome</th><th scope="col">State</th><th scope="col">Detail</th></tr></thead><tbody>
"#,
        s = if count == 1 { "" } else { "s" },
    )
}

/// One operation's outcome.
pub(crate) fn bulk_row(
    target: &once_client::Target,
    outcome: &str,
    state: Option<once_client::State>,
    detail: &str,
) -> String {
    format!(
        r#"<tr data-operation="{id}" data-outcome="{outcome}" data-state="{state}"><td><a href="/operation?id={link}">{id}</a></td><td>{attempt}</td><td>{outcome}</td><td>{state}</td><td>{detail}</td></tr>
"#,
        id = esc(&target.operation_id),
        link = url(&target.operation_id),
        attempt = target.attempt,
        state = state.map_or("—", |s| s.as_str()),
        detail = esc(detail),
    )
}

/// Why a bulk action ended before it started every operation.
pub(crate) enum Stopped {
    No,
    /// The console is shutting down.
    ShuttingDown,
    /// The ledger refused the key itself, for `why`: the rest would be refused alike.
    KeyRefused {
        why: String,
        not_started: usize,
    },
}

/// The end of a bulk action's outcome table: how many of each outcome, and why it stopped
/// early if it did.
pub(crate) fn bulk_finished(
    done: usize,
    refused: usize,
    failed: usize,
    stopped: &Stopped,
) -> String {
    let stopped = match stopped {
        Stopped::No => String::new(),
        Stopped::ShuttingDown => " The console is shutting down: the operations without a row were not started, and are as they were.".to_owned(),
        Stopped::KeyRefused { why, not_started } => format!(
            " Your key itself was refused ({}), so the other {not_started} were not started: they would be refused alike, and are as they were.",
            esc(why)
        ),
    };
    format!(
        r#"</tbody></table>
<p id="bulk-finished" role="status" data-done="{done}" data-refused="{refused}" data-failed="{failed}">Finished: {done} done, {refused} refused (nothing was applied to them; each row says why), {failed} without an answer (each may be done again).{stopped}</p>
<p><a href="/queue">Back to the queue</a></p>
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_the_ledger_cannot_become_markup() {
        let hostile = r#"<script>alert("x")</script>' onmouseover='x"#;
        let escaped = esc(hostile);
        assert!(!escaped.contains('<') && !escaped.contains('"') && !escaped.contains('\''));
        assert_eq!(esc("a & b"), "a &amp; b");
        assert_eq!(url("refund:a/b?c=d&e"), "refund%3Aa%2Fb%3Fc%3Dd%26e");
    }

    #[test]
    fn earlier_lives_are_folded_away_and_shown_only_when_there_are_some() {
        assert_eq!(earlier_lives(&[]), "");
        let event = EventView {
            sequence: 7,
            at: None,
            kind: "CONFIRMED".into(),
            from: None,
            to: None,
            attempt: 1,
            actor: "executor:<b>mcp</b>".into(),
            reason: None,
            details: None,
        };
        let folded = earlier_lives(&[event]);
        assert!(folded.starts_with(r#"<details class="earlier"><summary>Earlier lives: 1 event "#));
        assert!(folded.contains("CONFIRMED") && folded.contains("&lt;b&gt;mcp"));
    }

    #[test]
    fn a_result_is_shown_indented_when_it_is_json_and_as_bytes_when_not_text() {
        assert_eq!(result(br#"{"a":1}"#), "{\n  \"a\": 1\n}");
        assert_eq!(result(b"plain"), "plain");
        assert_eq!(result(&[0xff, 0x00]), "2 bytes, not UTF-8: ff00");
    }
}
