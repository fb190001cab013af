//! What people read: tables, an operation at a glance, a watched change. Every function is
//! pure — views, the moment it is, the width and whether to colour in; a string out — so the
//! output is tested as it is printed.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use anstyle::{AnsiColor, Style};
use comfy_table::{presets, Attribute, Cell, Color, ContentArrangement, Table};
use once_client::{
    AttemptView, CallView, EventView, ForensicsView, OperationView, Reconciled, ServerInfo,
    StatsView, Truth, WatchedEvent,
};
use once_core::access::Credential;
use once_core::State;

/// How output is laid out: its width, and whether it is coloured.
#[derive(Debug, Clone, Copy)]
pub struct Look {
    pub width: u16,
    pub color: bool,
    pub now: SystemTime,
}

impl Look {
    fn paint(&self, style: Style, text: &str) -> String {
        if self.color {
            format!("{}{text}{}", style.render(), style.render_reset())
        } else {
            text.to_owned()
        }
    }

    fn state(&self, state: Option<State>) -> String {
        match state {
            Some(state) => self.paint(state_style(state), state.as_str()),
            None => "-".to_owned(),
        }
    }

    fn dim(&self, text: &str) -> String {
        self.paint(Style::new().dimmed(), text)
    }

    fn bold(&self, text: &str) -> String {
        self.paint(Style::new().bold(), text)
    }

    fn table(&self) -> Table {
        let mut table = Table::new();
        table
            .load_preset(presets::NOTHING)
            .set_content_arrangement(ContentArrangement::Dynamic)
            .set_width(self.width);
        if self.color {
            table.enforce_styling();
        } else {
            table.force_no_tty();
        }
        table
    }

    fn header(&self, table: &mut Table, names: &[&str]) {
        table.set_header(
            names
                .iter()
                .map(|n| Cell::new(n).add_attribute(Attribute::Bold)),
        );
    }

    /// How long ago `at` was, compactly: `45s`, `12m`, `3h4m`, `2d`.
    fn ago(&self, at: Option<SystemTime>) -> String {
        at.map(|at| age(self.now.duration_since(at).unwrap_or_default()))
            .unwrap_or_else(|| "-".to_owned())
    }
}

fn state_style(state: State) -> Style {
    let color = match state {
        State::Unknown => AnsiColor::Red,
        State::InFlight => AnsiColor::Yellow,
        State::Confirmed => AnsiColor::Green,
        State::Absent => AnsiColor::Blue,
    };
    Style::new().fg_color(Some(color.into())).bold()
}

fn state_cell(state: State) -> Cell {
    let color = match state {
        State::Unknown => Color::Red,
        State::InFlight => Color::Yellow,
        State::Confirmed => Color::Green,
        State::Absent => Color::Blue,
    };
    Cell::new(state.as_str()).fg(color)
}

/// A duration as people say it, to its two largest units.
pub fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 if (s % 3600) / 60 == 0 => format!("{}h", s / 3600),
        3600..86_400 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d", s / 86_400),
    }
}

/// How long a call took: milliseconds under a second, then seconds to a tenth, then as
/// [`age`].
pub fn latency(d: Duration) -> String {
    match d.as_millis() {
        ms if ms < 1_000 => format!("{ms}ms"),
        ms if ms < 60_000 => format!("{:.1}s", d.as_secs_f64()),
        _ => age(d),
    }
}

/// A moment in UTC, to the second (or the millisecond, for a timeline).
pub fn when(at: Option<SystemTime>, millis: bool) -> String {
    let Some(at) = at else {
        return "-".to_owned();
    };
    let at: chrono::DateTime<chrono::Utc> = at.into();
    if millis {
        at.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
    } else {
        at.format("%Y-%m-%d %H:%M:%SZ").to_string()
    }
}

/// The time of day of a moment in UTC, to the millisecond.
fn clock(at: Option<SystemTime>) -> String {
    let Some(at) = at else {
        return "-".to_owned();
    };
    let at: chrono::DateTime<chrono::Utc> = at.into();
    at.format("%H:%M:%S%.3f").to_string()
}

/// `oncectl list`: a line an operation, in a table when it fits the width; otherwise each
/// operation's id on a line of its own (an id is copied into the next command, so it never
/// wraps), with the rest below it.
pub fn operations(look: &Look, operations: &[OperationView], more: bool, tenants: bool) -> String {
    if operations.is_empty() {
        return "No operations match.\n".to_owned();
    }
    let rows: Vec<[String; 7]> = operations
        .iter()
        .map(|op| {
            let last = match &op.last_event {
                Some((kind, at)) => format!("{kind} {}", look.ago(Some(*at))),
                None => "-".to_owned(),
            };
            [
                op.tenant.clone(),
                op.operation_id.clone(),
                op.tool.clone(),
                op.state.as_str().to_owned(),
                look.ago(op.created_at),
                op.attempt.to_string(),
                last,
            ]
        })
        .collect();
    // The tenant's column only in a listing of every tenant's.
    let shown = usize::from(!tenants);
    let mut table = look.table();
    table.set_content_arrangement(ContentArrangement::Disabled);
    let header = [
        "TENANT",
        "OPERATION",
        "TOOL",
        "STATE",
        "AGE",
        "ATT",
        "LAST EVENT, AGO",
    ];
    look.header(&mut table, &header[shown..]);
    for (row, op) in rows.iter().zip(operations) {
        let mut cells: Vec<Cell> = row[shown..].iter().map(Cell::new).collect();
        cells[3 - shown] = state_cell(op.state);
        table.add_row(cells);
    }
    let mut out = trimmed(&mut table);
    let fits = out
        .lines()
        .all(|line| line.chars().count() <= usize::from(look.width));
    if !fits {
        out = String::new();
        for (row, op) in rows.iter().zip(operations) {
            let [tenant, id, tool, _, age, attempts, last] = row;
            let tenant = if tenants {
                format!("  tenant {tenant}")
            } else {
                String::new()
            };
            out += &format!("{}{tenant}\n", look.bold(id));
            out += &format!(
                "    {tool}  {}  age {age}  attempt {attempts}  last {last} ago\n",
                look.state(Some(op.state))
            );
        }
    }
    if more {
        out += &look.dim("(more match: raise --limit to see them)\n");
    }
    out
}

/// `oncectl show`: the operation, its attempts, and its history.
pub fn operation(look: &Look, op: &OperationView) -> String {
    let mut out = String::new();
    let field = |out: &mut String, name: &str, value: String| {
        let _ = writeln!(out, "{} {value}", look.bold(&format!("{name:<12}")));
    };
    field(&mut out, "Operation", op.operation_id.clone());
    let mut state = look.state(Some(op.state));
    let since = match op.state {
        State::Unknown | State::InFlight => op.updated_at,
        _ => None,
    };
    if since.is_some() {
        state += &format!(" for {}", look.ago(since));
    }
    state += &look.dim(&format!(" (put there by: {})", op.source));
    field(&mut out, "State", state);
    field(&mut out, "Tool", op.tool.clone());
    field(
        &mut out,
        "Attempt",
        format!("{} (fencing token {})", op.attempt, op.fencing_token),
    );
    if let Some(deadline) = op.lease_deadline {
        field(&mut out, "Lease until", when(Some(deadline), false));
    }
    if let Some(reason) = &op.reason {
        field(&mut out, "Reason", reason.clone());
    }
    let provider = match (&op.provider, &op.lookup_hints) {
        (Some(p), Some(h)) => format!("{p} {}", look.dim(h)),
        (Some(p), None) => p.clone(),
        (None, _) => "- (no reconciler: an operator settles it)".to_owned(),
    };
    field(&mut out, "Provider", provider);
    field(&mut out, "Provider key", op.provider_key.clone());
    if let Some(reference) = &op.provider_ref {
        field(&mut out, "Provider ref", reference.clone());
    }
    if let Some(link) = &op.provider_dashboard {
        field(&mut out, "Dashboard", link.clone());
    }
    if let Some(result) = &op.result {
        field(&mut out, "Result", excerpt(result, 120));
    }
    field(
        &mut out,
        "Created",
        format!(
            "{} ({} ago)",
            when(op.created_at, false),
            look.ago(op.created_at)
        ),
    );
    if let Some(expires) = op.expires_at {
        field(&mut out, "Kept until", when(Some(expires), false));
    }

    out += &format!("\n{}\n", look.bold("Attempts"));
    if op.attempts.is_empty() {
        out += "  none in this life\n";
    }
    for a in &op.attempts {
        out += &attempt(look, a);
    }

    if !op.calls.is_empty() {
        let verdict = op.forensics.as_deref().unwrap_or_default();
        out += &format!("\n{}  {verdict}\n", look.bold("Calls"));
        for c in &op.calls {
            out += &call(look, c);
        }
    }

    out += &format!("\n{}\n", look.bold("History"));
    for e in &op.events {
        out += &event_line(look, e, None);
    }
    out
}

/// One call: when, what it was answered, where it came from, and its transport.
fn call(look: &Look, c: &CallView) -> String {
    let answer = match c.attempt {
        Some(n) => format!("EXECUTE (attempt {n})"),
        None if c.decision == "EXECUTE" => "EXECUTE (the same grant again)".to_owned(),
        None => c.decision.clone(),
    };
    let origin = c.origin.as_deref().map_or("the first call", said);
    let context = &c.context;
    let mut out = format!(
        "  {}  {:<30} {}\n",
        look.dim(&clock(c.at)),
        answer,
        look.bold(origin)
    );
    out += &format!(
        "                client {}, session {}, request {}\n",
        context.client_name.as_deref().unwrap_or("-"),
        context.session_id.as_deref().unwrap_or("-"),
        context.request_id.as_deref().unwrap_or("-"),
    );
    if let Some(requested) = &c.requested_operation_id {
        out += &format!("                asked for {requested} (the same intent)\n");
    }
    out
}

/// `oncectl status`: where the ledger is, how it is reached, and who the caller is to it.
pub fn status(look: &Look, reached: &crate::Reached, info: &ServerInfo) -> String {
    let tls = match (reached.tls, reached.private_ca, reached.client_certificate) {
        (false, _, _) => "none (plaintext)".to_owned(),
        (true, ca, cert) => {
            let trust = if ca {
                "verified with --ca and the public roots"
            } else {
                "verified with the public roots"
            };
            let cert = if cert {
                ", client certificate presented"
            } else {
                ""
            };
            format!("{trust}{cert}")
        }
    };
    let (key, roles) = match &info.key {
        Some(key) if key.name.is_empty() => (key.key_id.clone(), key.roles.join(", ")),
        Some(key) => (
            format!("{} ({})", key.key_id, key.name),
            key.roles.join(", "),
        ),
        None => (
            "none: the ledger is open (no key exists yet)".to_owned(),
            "every role".to_owned(),
        ),
    };
    let rows = [
        ("Ledger", reached.address.clone()),
        ("TLS", tls),
        ("Version", info.version.clone()),
        ("Database", info.database.clone()),
        ("Tenant", info.tenant.clone()),
        ("Key", key),
        ("Roles", roles),
    ];
    rows.iter()
        .map(|(name, value)| format!("{} {value}\n", look.bold(&format!("{name:<9}"))))
        .collect()
}

/// `oncectl stats`: the tenant's figures.
/// Every tenant's figures added up when `tenants`.
pub fn stats(look: &Look, s: &StatsView, window: &str, tenants: bool) -> String {
    let title = if tenants {
        "Operations now, every tenant"
    } else {
        "Operations now"
    };
    let mut out = format!("{}\n", look.bold(title));
    if s.operations.is_empty() {
        out += "  none\n";
    } else {
        let mut table = look.table();
        look.header(&mut table, &["STATE", "TOOL", "COUNT"]);
        for (state, tool, count) in &s.operations {
            table.add_row(vec![state_cell(*state), Cell::new(tool), Cell::new(count)]);
        }
        out += &trimmed(&mut table);
    }
    let u = &s.unknown;
    if u.count > 0 {
        out += &format!(
            "UNKNOWN for: p50 {}, p90 {}, p99 {}, the oldest {} ({} operations)\n",
            age(u.p50),
            age(u.p90),
            age(u.p99),
            age(u.max),
            u.count
        );
    }
    out += &format!(
        "\n{}\n",
        look.bold(&format!("Left UNKNOWN over the last {window}"))
    );
    let mut table = look.table();
    look.header(
        &mut table,
        &["DOOR", "COUNT", "P50", "P90", "P99", "LONGEST"],
    );
    for (door, a) in &s.resolved {
        let took = |d: Duration| if a.count == 0 { "-".to_owned() } else { age(d) };
        table.add_row(vec![
            Cell::new(door.replace('_', " ")),
            Cell::new(a.count),
            Cell::new(took(a.p50)),
            Cell::new(took(a.p90)),
            Cell::new(took(a.p99)),
            Cell::new(took(a.max)),
        ]);
    }
    out += &trimmed(&mut table);
    let events: Vec<String> = s
        .events
        .iter()
        .map(|(kind, n)| format!("{n} {kind}"))
        .collect();
    out += &format!(
        "\n{}\n",
        look.bold(&format!("Reconciler lookups over the last {window}"))
    );
    if s.reconcilers.is_empty() {
        out += "  none\n";
    } else {
        let mut table = look.table();
        look.header(
            &mut table,
            &[
                "RECONCILER",
                "LOOKUPS",
                "SETTLED",
                "MISSED",
                "FAILED",
                "MEAN",
                "LONGEST",
            ],
        );
        for r in &s.reconcilers {
            let took = |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), latency);
            let failed = match r.failed {
                0 => Cell::new(0),
                n => Cell::new(n).fg(Color::Red),
            };
            table.add_row(vec![
                Cell::new(&r.reconciler),
                Cell::new(r.lookups()),
                Cell::new(r.settled),
                Cell::new(r.missed),
                failed,
                Cell::new(took(r.mean)),
                Cell::new(took(r.max)),
            ]);
        }
        out += &trimmed(&mut table);
    }
    out += &format!(
        "\n{}\n",
        look.bold(&format!("Anomalies and escalations over the last {window}"))
    );
    for line in wrap(
        &events.join(", "),
        usize::from(look.width).saturating_sub(2),
    ) {
        out += &format!("  {line}\n");
    }
    out
}

/// `oncectl forensics`: where the repeated calls came from.
pub fn forensics(look: &Look, found: &ForensicsView, window: &str) -> String {
    let mut out = format!(
        "Over the last {window}, {} operations were called more than once:\n",
        found.operations
    );
    for line in wrap(&found.summary, usize::from(look.width).saturating_sub(2)) {
        out += &format!("  {line}\n");
    }
    if found.origins.is_empty() {
        return out;
    }
    let mut table = look.table();
    look.header(&mut table, &["ORIGIN", "CALLS"]);
    for (origin, count) in &found.origins {
        table.add_row(vec![Cell::new(said(origin)), Cell::new(count)]);
    }
    out += "\n";
    out += &trimmed(&mut table);
    out
}

/// Where a call came from, as people say it.
fn said(origin: &str) -> &str {
    match origin {
        "transport_retry" => "transport retry",
        "harness_retry" => "harness retry",
        "model_reissue" => "model re-issue",
        "reconnect" => "reconnect",
        "other_client" => "another client",
        "unattributed" => "unattributed",
        other => other,
    }
}

/// One attempt of the attempt log: when, by whom, and the transport that carried it (which
/// tells a retry from a reconnect).
fn attempt(look: &Look, a: &AttemptView) -> String {
    let context = &a.context;
    let mut out = format!(
        "  {}  started {}, lease until {}\n",
        look.bold(&a.number.to_string()),
        clock(a.started_at),
        clock(a.lease_deadline)
    );
    out += &format!("     by {}\n", a.actor);
    out += &format!(
        "     client {}, session {}, request {}\n",
        context.client_name.as_deref().unwrap_or("-"),
        context.session_id.as_deref().unwrap_or("-"),
        context.request_id.as_deref().unwrap_or("-"),
    );
    out += &look.dim(&format!(
        "     attempt id {}, fencing token {}\n",
        a.attempt_id, a.fencing_token
    ));
    out
}

/// One event of a history or a watch: when, what, and the move; below it the attempt, the
/// actor and why; below that the evidence.
fn event_line(look: &Look, e: &EventView, about: Option<(&str, &str)>) -> String {
    let moved = match (e.from, e.to) {
        (Some(from), Some(to)) => format!("{} → {}", look.state(Some(from)), look.state(Some(to))),
        (None, Some(to)) => format!("→ {}", look.state(Some(to))),
        _ => String::new(),
    };
    let padded = format!("{:<19}", e.kind);
    let kind = if once_core::EventKind::parse(&e.kind).is_some_and(|k| k.is_anomaly()) {
        look.paint(
            Style::new()
                .fg_color(Some(AnsiColor::Magenta.into()))
                .bold(),
            &padded,
        )
    } else {
        look.bold(&padded)
    };
    let mut line = format!("  {}  {kind}", look.dim(&clock(e.at)));
    if !moved.is_empty() {
        line += &format!(" {moved}");
    }
    let mut out = format!("{}\n", line.trim_end());
    let margin = "                ";
    let room = usize::from(look.width).saturating_sub(margin.len()).max(40);
    let who = match about {
        Some((operation, tool)) if !tool.is_empty() => {
            format!("{operation} ({tool}), attempt {} by {}", e.attempt, e.actor)
        }
        Some((operation, _)) => format!("{operation}, attempt {} by {}", e.attempt, e.actor),
        None => format!("attempt {} by {}", e.attempt, e.actor),
    };
    match &e.reason {
        Some(reason) if who.len() + 2 + reason.chars().count() <= room => {
            out += &format!("{margin}{who}: {reason}\n");
        }
        Some(reason) => {
            out += &format!("{margin}{who}:\n");
            for line in wrap(reason, room) {
                out += &format!("{margin}{line}\n");
            }
        }
        None => out += &format!("{margin}{who}\n"),
    }
    if let Some(details) = &e.details {
        out += &look.dim(&format!("{margin}{}\n", excerpt(details.as_bytes(), room)));
    }
    out
}

/// `oncectl watch`: one change, with its sequence to resume after; with its operation's
/// tenant when `tenants` (a watch of every tenant's).
pub fn watched(look: &Look, e: &WatchedEvent, tenants: bool) -> String {
    let sequence = look.dim(&format!("#{}", e.event.sequence));
    let operation = if tenants {
        format!("[{}] {}", e.tenant, e.operation_id)
    } else {
        e.operation_id.clone()
    };
    format!(
        "{sequence}{}",
        event_line(look, &e.event, Some((&operation, &e.tool)))
    )
}

/// What `oncectl resolve` is about to do, for the operator to check before saying yes.
pub fn resolution_plan(
    look: &Look,
    op: &OperationView,
    examined: &AttemptView,
    truth: &Truth,
    reason: &str,
    resolution_id: &str,
) -> String {
    let settle = match truth {
        Truth::Confirmed { provider_ref, .. } => format!(
            "{}: the effect happened (provider ref {})",
            look.state(Some(State::Confirmed)),
            provider_ref.as_deref().unwrap_or("-")
        ),
        Truth::Absent => format!(
            "{}: the effect certainly did not happen, and a new attempt may run",
            look.state(Some(State::Absent))
        ),
    };
    let context = &examined.context;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "About to resolve {} ({}, now {})",
        look.bold(&op.operation_id),
        op.tool,
        look.state(Some(op.state))
    );
    let _ = writeln!(out, "  as {settle}");
    let _ = writeln!(
        out,
        "  bound to attempt {}, fencing token {}",
        examined.number, examined.fencing_token
    );
    let _ = writeln!(
        out,
        "    started {} by {}",
        when(examined.started_at, false),
        examined.actor
    );
    let _ = writeln!(
        out,
        "    client {}, session {}, request {}",
        context.client_name.as_deref().unwrap_or("-"),
        context.session_id.as_deref().unwrap_or("-"),
        context.request_id.as_deref().unwrap_or("-"),
    );
    let _ = writeln!(out, "  reason: {reason}");
    let _ = writeln!(
        out,
        "  resolution id: {resolution_id} (to retry this one: --resolution-id {resolution_id})"
    );
    if examined.number != op.attempt {
        let warning = format!(
            "Attempt {} has run since: the ledger will refuse a resolution of attempt {}.",
            op.attempt, examined.number
        );
        let yellow = Style::new().fg_color(Some(AnsiColor::Yellow.into()));
        let _ = writeln!(out, "{}", look.paint(yellow, &warning));
    }
    out
}

/// What `oncectl reconcile` found.
pub fn reconciled(look: &Look, operation_id: &str, r: &Reconciled) -> String {
    format!(
        "{} looked up {operation_id}: found {}; the operation is {}.\n  {}\n",
        r.reconciler,
        look.state(r.verdict),
        look.state(r.state),
        r.detail
    )
}

/// One operation of a bulk command: what became of it, its state after, and what was said.
pub struct Outcome<'a> {
    pub operation_id: &'a str,
    pub attempt: u32,
    /// `done`, `refused` or `failed`.
    pub outcome: &'a str,
    pub state: Option<State>,
    pub detail: &'a str,
}

/// A bulk command's outcomes, one line each.
pub fn outcomes(look: &Look, rows: &[Outcome<'_>]) -> String {
    let mut table = look.table();
    look.header(
        &mut table,
        &["OPERATION", "ATTEMPT", "OUTCOME", "STATE", "DETAIL"],
    );
    for row in rows {
        let outcome = match row.outcome {
            "done" => Cell::new(row.outcome),
            _ => Cell::new(row.outcome).fg(Color::Red),
        };
        table.add_row(vec![
            Cell::new(row.operation_id),
            Cell::new(row.attempt),
            outcome,
            row.state.map_or_else(|| Cell::new("-"), state_cell),
            Cell::new(row.detail),
        ]);
    }
    trimmed(&mut table)
}

/// `oncectl keys`: the credentials, never a secret.
pub fn keys(look: &Look, keys: &[Credential]) -> String {
    if keys.is_empty() {
        return "No credentials.\n".to_owned();
    }
    let mut table = look.table();
    look.header(
        &mut table,
        &["KEY ID", "TENANT", "NAME", "ROLES", "KIND", "STATUS"],
    );
    for k in keys {
        let status = if k.revoked_at.is_some() {
            Cell::new("revoked").fg(Color::Red)
        } else {
            Cell::new("active").fg(Color::Green)
        };
        table.add_row(vec![
            Cell::new(&k.key_id),
            Cell::new(&k.tenant),
            Cell::new(&k.name),
            Cell::new(k.roles.to_string()),
            Cell::new(k.kind.as_str()),
            status,
        ]);
    }
    trimmed(&mut table)
}

/// A table's lines, its columns two spaces apart, without trailing blanks.
fn trimmed(table: &mut Table) -> String {
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    table
        .lines()
        .map(|line| format!("{}\n", line.trim_end()))
        .collect()
}

/// Text broken into lines of at most `width` characters, between words (a longer word stands
/// alone).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split_whitespace() {
        match lines.last_mut() {
            Some(line) if line.chars().count() + 1 + word.chars().count() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_owned()),
        }
    }
    lines
}

/// Bytes as text, cut to `max` characters.
fn excerpt(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.replace('\n', " ");
    if text.chars().count() <= max {
        text
    } else {
        let cut: String = text.chars().take(max).collect();
        format!("{cut}…")
    }
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;

pub fn receipt(
    receipt: &once_client::Receipt,
    whose: &str,
    result_matches: Option<bool>,
) -> String {
    let at = |millis| when(Some(crate::json::millis_time(millis)), true);
    let mut out = format!(
        "The receipt verifies: signed by key {} of ledger {}, with {whose}.\n",
        receipt.key, receipt.ledger
    );
    out += &format!(
        "  operation     {} (tool {}), tenant {}\n",
        receipt.operation_id, receipt.tool, receipt.tenant
    );
    out += &format!(
        "  state         {} (by {}): attempt {}, fencing token {}, life {}\n",
        receipt.state, receipt.source, receipt.attempt, receipt.fencing_token, receipt.life
    );
    if let Some(token) = receipt.confirmed_by {
        out += &format!("  confirmed by  the attempt of fencing token {token} (superseded)\n");
    }
    if let Some(hash) = &receipt.result_sha256 {
        out += &format!("  result        sha256 {hash}\n");
    }
    if let Some(reference) = &receipt.provider_ref {
        out += &format!("  provider ref  {reference}\n");
    }
    out += &format!(
        "  settled       {} (event {} of the tenant's history: oncectl verify)\n",
        at(receipt.settled_at),
        receipt.sequence
    );
    out += &format!("  issued        {}\n", at(receipt.issued_at));
    match result_matches {
        Some(true) => out += "The result given is the one it was signed for.\n",
        Some(false) => out += "THE RESULT GIVEN IS NOT the one it was signed for.\n",
        None => {}
    }
    out
}

pub fn history(found: &once_client::HistoryView) -> String {
    let mut out = format!(
        "Tenant {}: {} links, {} events, through event {}.\n",
        found.tenant, found.links, found.events, found.through
    );
    if found.head_number > 0 {
        out += &format!("Head: link {} {}\n", found.head_number, found.head_hash);
    }
    match &found.problem {
        None => out += "Everything matches what the chain recorded.\n",
        Some(p) => {
            out += &format!("DOES NOT MATCH ({}): {}\n", p.code, p.message);
            if p.sequence > 0 {
                out += &format!("See it: oncectl watch --all --after {}\n", p.sequence - 1);
            }
        }
    }
    out
}
