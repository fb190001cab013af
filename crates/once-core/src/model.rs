//! The nouns of the ledger: operations, attempts, events, and the commands that move them.
//!
//! [`FencingToken`] is a newtype (a token is never an attempt number). [`Actor`] (`ledger`,
//! `executor:<name>`, `reconciler:<name>`, `operator:<name>`, or `operator:<name>@<key name>` for
//! a resolution made with a credential of another name) has `Display` and `FromStr`, so the string
//! form exists only at the edges. Events are built by `NewEvent::transition` (a state change),
//! `NewEvent::note` (a lookup, an escalation) and `NewEvent::anomaly` (recorded once per cause:
//! the dedupe key is the kind and the cause). What the read API returns is here too: [`Listed`],
//! [`OperationEvent`] and [`WatchFilter`], whose `matches` states the rule the store's query
//! applies.

use std::fmt;

pub use crate::identity::{Fingerprint, OperationId};

/// Milliseconds since the Unix epoch, on the clock the store trusts (the database's, when the
/// database has one).
pub type Millis = i64;

/// `d` in milliseconds, saturating at the largest [`Millis`] (a duration that long is, for a
/// ledger, forever).
pub fn duration_ms(d: std::time::Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

/// A fencing token: the number the store issues with each execution right, from one counter for
/// the whole store. A later right has a larger token, and no token is issued twice, so a report
/// carrying one names exactly one attempt of one life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct FencingToken(pub u64);

impl FencingToken {
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Tokens issued later, for tests that name them relative to one another.
#[cfg(test)]
impl std::ops::Add<u64> for FencingToken {
    type Output = FencingToken;

    fn add(self, n: u64) -> FencingToken {
        FencingToken(self.0 + n)
    }
}

#[cfg(test)]
impl std::ops::Sub<u64> for FencingToken {
    type Output = FencingToken;

    fn sub(self, n: u64) -> FencingToken {
        FencingToken(self.0 - n)
    }
}

#[cfg(test)]
impl std::ops::AddAssign<u64> for FencingToken {
    fn add_assign(&mut self, n: u64) {
        self.0 += n;
    }
}

impl From<u64> for FencingToken {
    fn from(token: u64) -> Self {
        Self(token)
    }
}

/// Who did something the history records.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Actor {
    /// The ledger itself: a lease that ran out, an escalation.
    Ledger,
    /// An MCP server holding (or having held) the execution right, by its client name.
    Executor(String),
    /// A reconciler plugin, by its configured name.
    Reconciler(String),
    /// An on-call person settling an operation, by the name they gave.
    Operator(String),
}

impl fmt::Display for Actor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Actor::Ledger => f.write_str("ledger"),
            Actor::Executor(name) => write!(f, "executor:{name}"),
            Actor::Reconciler(name) => write!(f, "reconciler:{name}"),
            Actor::Operator(name) => write!(f, "operator:{name}"),
        }
    }
}

impl std::str::FromStr for Actor {
    type Err = String;

    /// Reads an actor as [`fmt::Display`] writes it.
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "ledger" {
            return Ok(Actor::Ledger);
        }
        let (kind, name) = s
            .split_once(':')
            .ok_or_else(|| format!("unknown actor {s:?}"))?;
        let name = name.to_owned();
        match kind {
            "executor" => Ok(Actor::Executor(name)),
            "reconciler" => Ok(Actor::Reconciler(name)),
            "operator" => Ok(Actor::Operator(name)),
            _ => Err(format!("unknown actor {s:?}")),
        }
    }
}

/// The truth the ledger holds about an operation's effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// No effect happened (or there is no record at all).
    Absent,
    /// One attempt holds a lease and may be performing the effect right now.
    InFlight,
    /// The effect happened; its result is stored and replayed.
    Confirmed,
    /// The effect may or may not have happened. Never read as permission to retry.
    Unknown,
}

impl State {
    pub const ALL: [State; 4] = [
        State::Absent,
        State::InFlight,
        State::Confirmed,
        State::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Absent => "ABSENT",
            State::InFlight => "IN_FLIGHT",
            State::Confirmed => "CONFIRMED",
            State::Unknown => "UNKNOWN",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|state| state.as_str() == s)
    }

    /// CONFIRMED and ABSENT are settled: retention may eventually delete them.
    pub fn is_settled(self) -> bool {
        matches!(self, State::Confirmed | State::Absent)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who or what put the operation in its current state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The attempt holding the execution right (a Begin or a report).
    Attempt,
    /// The ledger itself, because a lease ran out.
    Lease,
    /// A reconciler's verdict from provider truth.
    Reconciler,
    /// An operator's resolution.
    Operator,
    /// The ledger, because a superseded attempt proved an effect while a later attempt may also
    /// have performed it: the operation is held UNKNOWN for an operator.
    Anomaly,
    /// A client showed the ledger had lost the operation, restored to an earlier state: see
    /// [`crate::continuity`].
    Continuity,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Attempt => "attempt",
            Source::Lease => "lease",
            Source::Reconciler => "reconciler",
            Source::Operator => "operator",
            Source::Anomaly => "anomaly",
            Source::Continuity => "continuity",
        }
    }

    pub fn parse(s: &str) -> Option<Source> {
        [
            Source::Attempt,
            Source::Lease,
            Source::Reconciler,
            Source::Operator,
            Source::Anomaly,
            Source::Continuity,
        ]
        .into_iter()
        .find(|source| source.as_str() == s)
    }
}

/// One logical operation as stored: `(tenant, operation_id)` is its key.
///
/// A row lives through one or more *lives*: retention deletes a settled operation (or a Begin
/// finds it past retention), and the next Begin of the same id starts a new life with a new
/// provider key. Fencing tokens come from one sequence for the whole store, so no token is ever
/// issued twice for an operation id, across lives.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation {
    pub tenant: String,
    pub operation_id: OperationId,
    pub tool: String,
    pub fingerprint: Fingerprint,
    pub state: State,
    pub source: Source,
    /// Number of the latest attempt in this life, counting from 1.
    pub attempt: u32,
    /// The latest attempt's fencing token. Never decreases while the row exists, and is never
    /// issued again, in this life or any later one.
    pub fencing_token: FencingToken,
    /// Identifies this life of the operation id: the fencing token of its first attempt. Every
    /// token of this life is at least this; every token of an earlier life is below it.
    pub life: FencingToken,
    /// The caller-chosen id of the latest attempt, so a transport retry of its Begin is known.
    pub attempt_id: String,
    /// The transport context the latest attempt was granted with; a regrant needs the same.
    pub attempt_context: AttemptContext,
    /// Who holds (or last held) the execution right: the actor recorded for the latest attempt.
    pub executor: Actor,
    /// The credential the latest attempt was granted to: only it reports for the attempt.
    pub holder: Holder,
    /// When the latest attempt's lease began.
    pub lease_started_at: Millis,
    /// When the latest attempt's lease ends, unless extended by a heartbeat.
    pub lease_deadline: Millis,
    /// The stored result of a CONFIRMED operation, replayed byte for byte. While the operation
    /// is held for an operator, the result a superseded attempt confirmed.
    pub result: Option<Vec<u8>>,
    pub provider_ref: Option<String>,
    /// The key the downstream provider deduplicates by; stable across attempts of one life.
    pub provider_key: String,
    /// The reconciler that can look this operation up, if any.
    pub provider: Option<String>,
    /// JSON hints for that reconciler.
    pub lookup_hints: Option<String>,
    /// How long the operation is kept once settled.
    pub retention_ms: i64,
    /// When this life of the operation id began.
    pub created_at: Millis,
    pub updated_at: Millis,
    /// When retention may delete a settled operation; `None` while not settled.
    pub expires_at: Option<Millis>,
    /// Why the operation is in its current state, when someone said.
    pub reason: Option<String>,
    /// Counts every write of the row, including lookup claims, so that a lookup read before a
    /// change is recognised as stale. Maintained by the store: plans do not set it.
    pub version: i64,
    /// When the operation last became UNKNOWN.
    pub unknown_since: Option<Millis>,
    /// When the latest attempt last reported.
    pub last_report_at: Option<Millis>,
    /// The latest attempt of this life that a reconciler or an operator declared ABSENT (rather
    /// than the attempt itself): it may have performed the effect after all.
    pub declared_absent_token: Option<FencingToken>,
    /// The fencing token of the attempt whose confirm the stored result is (while the operation
    /// is held for an operator, the superseded attempt's proof); `None` when a reconciler or an
    /// operator supplied the result. A retried confirm is known by it.
    pub confirmed_by: Option<FencingToken>,
    /// How many reconciler lookups this UNKNOWN operation has had.
    pub reconcile_lookups: u32,
    /// When an UNKNOWN operation with a provider is next due for a lookup.
    pub reconcile_next_at: Option<Millis>,
    /// Until when a lookup holds the operation: no other lookup starts before then.
    pub lookup_claimed_until: Option<Millis>,
}

impl Operation {
    /// Settled and past retention: as good as no record.
    pub fn is_expired(&self, now: Millis) -> bool {
        self.state.is_settled() && self.expires_at.is_some_and(|at| at <= now)
    }

    pub fn lease_live(&self, now: Millis) -> bool {
        self.state == State::InFlight && now < self.lease_deadline
    }

    /// UNKNOWN because a superseded attempt proved an effect while a later one may also have
    /// performed it: neither reconcilers nor new attempts settle it, only an operator (or the
    /// latest attempt's own report, when it shows there was one effect).
    pub fn held_for_operator(&self) -> bool {
        self.state == State::Unknown && self.source == Source::Anomaly
    }

    /// The latest moment the latest attempt's effect could have been written at the provider,
    /// as far as the ledger knows: the later of its lease deadline, its last report, and when
    /// the operation became UNKNOWN.
    pub fn effect_horizon(&self) -> Millis {
        [self.last_report_at, self.unknown_since]
            .into_iter()
            .flatten()
            .fold(self.lease_deadline, Millis::max)
    }
}

/// Whether `token` falls within the current life of `op`: issued no earlier than its first
/// attempt and no later than its latest. Tokens of one life increase but are not consecutive,
/// so the attempt log says whether such a token is really one of this operation's.
pub fn is_token_of_life(token: FencingToken, op: &Operation) -> bool {
    token >= op.life && token <= op.fencing_token
}

/// What the caller knows of the transport that carried an attempt, for duplicate forensics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptContext {
    pub client_name: Option<String>,
    pub session_id: Option<String>,
    pub request_id: Option<String>,
}

/// One granted execution right, as recorded in the attempt log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// Its number in its life (1, 2, …).
    pub number: u32,
    pub fencing_token: FencingToken,
    /// The life of the operation it was granted in (see [`Operation::life`]).
    pub life: FencingToken,
    pub attempt_id: String,
    pub started_at: Millis,
    pub lease_deadline: Millis,
    pub actor: Actor,
    /// The credential the attempt was granted to.
    pub holder: Holder,
    pub context: AttemptContext,
}

/// The credential an attempt was granted to: its key id, or `None` when it was granted to none
/// (while the ledger was open, or by a version that did not record it). A fencing token is
/// readable by anyone who may read the operation, so it proves nothing by itself: only the
/// holder reports for an attempt granted to a credential, heartbeats its lease or is granted it
/// again. See [`may_act_for`].
pub type Holder = Option<String>;

/// Whether a caller presenting `caller` may act for an attempt granted to `holder`: the same
/// credential, or any caller of the tenant for an attempt granted to none.
pub fn may_act_for(holder: &Holder, caller: &Holder) -> bool {
    holder.is_none() || holder == caller
}

/// The kinds of event in an operation's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// An attempt was granted the execution right.
    Claimed,
    /// The executing attempt reported the effect happened.
    Confirmed,
    /// The executing attempt reported the effect certainly did not happen.
    ReportedAbsent,
    /// The executing attempt reported it cannot tell.
    ReportedUnknown,
    /// The lease ran out with no report.
    LeaseExpired,
    /// An operator settled an UNKNOWN operation.
    Resolved,
    /// A superseded attempt confirmed an effect after another attempt was granted: the effect
    /// may have happened twice.
    DoubleExecution,
    /// A genuine confirm arrived after a resolution had said ABSENT.
    ResolutionContradicted,
    /// A reconciler's verdict settled an UNKNOWN operation.
    Reconciled,
    /// A reconciler looked the operation up and the ledger kept it UNKNOWN; the reason says why.
    LookupInconclusive,
    /// The operation stayed UNKNOWN past the escalation threshold: people must look.
    Escalated,
    /// A client showed the ledger had lost an attempt it granted (the ledger was restored to an
    /// earlier state): the operation is UNKNOWN again, with that attempt.
    Recovered,
}

impl EventKind {
    pub const ALL: [EventKind; 12] = [
        EventKind::Claimed,
        EventKind::Confirmed,
        EventKind::ReportedAbsent,
        EventKind::ReportedUnknown,
        EventKind::LeaseExpired,
        EventKind::Resolved,
        EventKind::DoubleExecution,
        EventKind::ResolutionContradicted,
        EventKind::Reconciled,
        EventKind::LookupInconclusive,
        EventKind::Escalated,
        EventKind::Recovered,
    ];

    /// Reads a kind as [`EventKind::as_str`] writes it.
    pub fn parse(s: &str) -> Option<EventKind> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Claimed => "CLAIMED",
            EventKind::Confirmed => "CONFIRMED",
            EventKind::ReportedAbsent => "REPORTED_ABSENT",
            EventKind::ReportedUnknown => "REPORTED_UNKNOWN",
            EventKind::LeaseExpired => "LEASE_EXPIRED",
            EventKind::Resolved => "RESOLVED",
            EventKind::DoubleExecution => "DOUBLE_EXECUTION",
            EventKind::ResolutionContradicted => "RESOLUTION_CONTRADICTED",
            EventKind::Reconciled => "RECONCILED",
            EventKind::LookupInconclusive => "LOOKUP_INCONCLUSIVE",
            EventKind::Escalated => "ESCALATED",
            EventKind::Recovered => "RECOVERED",
        }
    }

    /// Anomalies are facts about the world the ledger could not prevent; they are counted.
    pub fn is_anomaly(self) -> bool {
        matches!(
            self,
            EventKind::DoubleExecution | EventKind::ResolutionContradicted
        )
    }
}

/// An event to append, in the same transaction as the transition it records.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// The life of the operation the event belongs to (see [`Operation::life`]).
    pub life: FencingToken,
    pub kind: EventKind,
    pub from: Option<State>,
    pub to: Option<State>,
    pub attempt: Option<u32>,
    pub actor: Actor,
    pub reason: Option<String>,
    /// JSON object with whatever else the event needs to be understood later.
    pub details: Option<String>,
    /// Set for events that must be recorded once however often their cause repeats.
    pub dedupe_key: Option<String>,
}

impl NewEvent {
    /// An event of `op`'s current life recording its move from `from` to `to`.
    pub fn transition(
        op: &Operation,
        kind: EventKind,
        (from, to): (State, State),
        attempt: u32,
        actor: Actor,
    ) -> Self {
        Self {
            from: Some(from),
            to: Some(to),
            ..Self::note(op, kind, attempt, actor)
        }
    }

    /// An event of `op`'s current life about `attempt` that moves no state: a lookup that could
    /// not tell, an escalation.
    pub fn note(op: &Operation, kind: EventKind, attempt: u32, actor: Actor) -> Self {
        Self {
            life: op.life,
            kind,
            from: None,
            to: None,
            attempt: Some(attempt),
            actor,
            reason: None,
            details: None,
            dedupe_key: None,
        }
    }

    /// An anomaly (or an escalation) recorded once however often its cause repeats: `cause`
    /// names the cause within the operation (the attempt's token, the provider object).
    pub fn anomaly(
        op: &Operation,
        kind: EventKind,
        attempt: u32,
        actor: Actor,
        cause: impl fmt::Display,
    ) -> Self {
        Self {
            dedupe_key: Some(format!("{}:{cause}", kind.as_str())),
            ..Self::note(op, kind, attempt, actor)
        }
    }

    /// Records the event in `life`, an earlier life of the operation than the one `op` is in,
    /// saying so in its details.
    pub fn in_earlier_life(self, op: &Operation, life: FencingToken) -> Self {
        Self {
            life,
            ..self.naming_lives(op, life)
        }
    }

    /// Names in its details `life`, the earlier life the event's cause came from, beside the
    /// life `op` is in.
    pub fn naming_lives(mut self, op: &Operation, life: FencingToken) -> Self {
        let mut details: serde_json::Map<String, serde_json::Value> = self
            .details
            .as_deref()
            .and_then(|d| serde_json::from_str(d).ok())
            .unwrap_or_default();
        details.insert("life".into(), life.get().into());
        details.insert("current_life".into(), op.life.get().into());
        self.details = Some(serde_json::Value::Object(details).to_string());
        self
    }

    /// Says why.
    pub fn because(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Adds what else the event needs to be understood later.
    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.details = Some(details.to_string());
        self
    }
}

/// A stored event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub sequence: i64,
    pub at: Millis,
    pub kind: EventKind,
    pub from: Option<State>,
    pub to: Option<State>,
    pub attempt: Option<u32>,
    pub actor: Actor,
    pub reason: Option<String>,
    pub details: Option<String>,
}

/// A request for the execution right, validated.
#[derive(Debug, Clone)]
pub struct BeginCommand {
    pub tenant: String,
    pub operation_id: OperationId,
    pub tool: String,
    pub fingerprint: Fingerprint,
    pub attempt_id: String,
    pub context: AttemptContext,
    pub lease_ttl_ms: i64,
    pub retention_ms: i64,
    /// The caller declares a new business intent: the fresh-id guard does not apply.
    pub new_intent: bool,
    pub provider: Option<String>,
    pub lookup_hints: Option<String>,
    pub actor: Actor,
    /// The credential the caller presented.
    pub holder: Holder,
    /// The tenant's executions are held: its ledger was found behind what a client saw (see
    /// [`crate::continuity`]). A Begin that would start an execution is answered
    /// [`BeginDecision::Held`]; every other answer is as usual.
    pub held: bool,
}

/// The right to perform the effect once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The life of the operation it was granted in (see [`Operation::life`]).
    pub life: FencingToken,
    pub attempt: u32,
    pub fencing_token: FencingToken,
    pub lease_deadline: Millis,
    /// The lease length granted; heartbeats extend the lease by this much.
    pub lease_ttl_ms: i64,
    pub provider_key: String,
    /// True when this is the same grant again, for a transport retry of the same Begin.
    pub regranted: bool,
}

impl Grant {
    /// The right `op` holds as stored, for a Begin asking for `lease_ttl_ms`; `regranted` when
    /// it is handed out again to a transport retry of the Begin it was granted to.
    pub fn issued(op: &Operation, lease_ttl_ms: i64, regranted: bool) -> Self {
        Grant {
            life: op.life,
            attempt: op.attempt,
            fencing_token: op.fencing_token,
            lease_deadline: op.lease_deadline,
            lease_ttl_ms,
            provider_key: op.provider_key.clone(),
            regranted,
        }
    }
}

/// The answer to a Begin.
#[derive(Debug, Clone, PartialEq)]
pub enum BeginDecision {
    Execute(Grant),
    Replay {
        result: Vec<u8>,
        provider_ref: Option<String>,
        confirmed_at: Millis,
        attempt: u32,
    },
    InProgress {
        attempt: u32,
        lease_deadline: Millis,
        retry_after_ms: i64,
        /// Set by the fresh-id guard: the IN_FLIGHT operation with the same tool and
        /// fingerprint, under another id, that is running now.
        blocking: Option<OperationId>,
    },
    Unknown {
        since: Millis,
        reason: Option<String>,
        /// Set by the fresh-id guard: the UNKNOWN operation (or IN_FLIGHT past its lease) with
        /// the same tool and fingerprint, under another id, that blocks this one.
        blocking: Option<OperationId>,
    },
    Conflict {
        stored: Fingerprint,
        requested: Fingerprint,
    },
    /// It would start an execution, and the tenant's executions are held
    /// ([`BeginCommand::held`]): nothing was done.
    Held,
}

impl BeginDecision {
    pub fn name(&self) -> &'static str {
        match self {
            BeginDecision::Execute(_) => "EXECUTE",
            BeginDecision::Replay { .. } => "REPLAY",
            BeginDecision::InProgress { .. } => "IN_PROGRESS",
            BeginDecision::Unknown { .. } => "UNKNOWN",
            BeginDecision::Conflict { .. } => "CONFLICT",
            BeginDecision::Held => "HELD",
        }
    }
}

/// What the executing attempt says happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Report {
    Confirm {
        result: Vec<u8>,
        provider_ref: Option<String>,
    },
    Absent {
        reason: String,
    },
    Unknown {
        reason: String,
    },
}

impl Report {
    pub fn target(&self) -> State {
        match self {
            Report::Confirm { .. } => State::Confirmed,
            Report::Absent { .. } => State::Absent,
            Report::Unknown { .. } => State::Unknown,
        }
    }
}

/// A report from the attempt holding fencing token `fencing_token`. The event it writes names
/// the executor recorded for that attempt.
#[derive(Debug, Clone)]
pub struct ReportCommand {
    pub fencing_token: FencingToken,
    /// The credential the report came with: it must be the attempt's.
    pub holder: Holder,
    pub report: Report,
}

/// A heartbeat from the attempt holding `fencing_token`, asking for its lease to last `ttl_ms`
/// from now.
#[derive(Debug, Clone)]
pub struct HeartbeatCommand {
    pub fencing_token: FencingToken,
    /// The credential the heartbeat came with: it must be the attempt's.
    pub holder: Holder,
    pub ttl_ms: i64,
}

/// The settled truth an operator (or reconciler) assigns to an UNKNOWN operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    Confirmed {
        result: Vec<u8>,
        provider_ref: Option<String>,
    },
    Absent,
}

impl Resolution {
    pub fn target(&self) -> State {
        match self {
            Resolution::Confirmed { .. } => State::Confirmed,
            Resolution::Absent => State::Absent,
        }
    }
}

/// An operator's resolution of an UNKNOWN operation.
#[derive(Debug, Clone)]
pub struct ResolveCommand {
    pub resolution: Resolution,
    pub reason: String,
    pub actor: Actor,
    /// Makes a retried Resolve recognisable, even after the operation moved on.
    pub resolution_id: String,
    /// The fencing token of the attempt the operator examined: it names the attempt and the
    /// life of the operation. The resolution applies only while that attempt is the latest.
    pub fencing_token: FencingToken,
    /// The examined attempt's number, when the operator gives it: checked too.
    pub attempt: Option<u32>,
}

/// An earlier resolution with the same resolution id, as its RESOLVED event recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorResolution {
    /// The state it settled the operation in.
    pub state: State,
    /// The fencing token of the attempt it resolved (events written before tokens were
    /// recorded have none).
    pub fencing_token: Option<FencingToken>,
}

impl PriorResolution {
    /// Reads one from its event's `to_state` and `details`.
    pub fn from_event(state: State, details: Option<&str>) -> Self {
        let fencing_token = details
            .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .and_then(|d| d["fencing_token"].as_u64())
            .map(FencingToken);
        Self {
            state,
            fencing_token,
        }
    }
}

/// What the fresh-id guard found: an open operation with the same tenant, tool and fingerprint
/// under another id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocking {
    pub operation_id: OperationId,
    pub state: State,
    pub attempt: u32,
    pub lease_deadline: Millis,
    pub updated_at: Millis,
}

/// A page request for ListOperations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    /// Any of these states; every state when empty.
    pub states: Vec<State>,
    pub tool: Option<String>,
    /// Only operations whose reconciler is this one.
    pub provider: Option<String>,
    /// Only operations created at least this long ago.
    pub older_than_ms: Option<i64>,
    pub page_size: u32,
    /// Resume after this operation, from the previous page.
    pub after: Option<PageEnd>,
}

/// Where a page of ListOperations ended: its last operation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageEnd {
    pub created_at: Millis,
    /// Orders operations of several tenants created in the same millisecond; empty in a token
    /// of one tenant's listing, which it does not order.
    pub tenant: String,
    pub operation_id: String,
}

/// Whose operations a read covers: one tenant's, or every tenant's (for the admin role, which
/// is ledger-wide).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Tenant(String),
    AllTenants,
}

impl Scope {
    /// The one tenant read, or `None` for every tenant.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Scope::Tenant(tenant) => Some(tenant),
            Scope::AllTenants => None,
        }
    }
}

/// An event of some operation of a tenant, as a watcher receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct OperationEvent {
    pub tenant: String,
    pub operation_id: OperationId,
    /// The operation's tool when the event was recorded (unknown for events written before
    /// events named it).
    pub tool: Option<String>,
    /// The state the operation was in once the event was recorded.
    pub state: Option<State>,
    pub event: Event,
}

/// Which events a watcher wants. `states` and `kinds` widen: an event is wanted when it moved an
/// operation into or out of one of the states, was recorded while its operation was in one, or
/// is one of the kinds (every event when both are empty). `tool` narrows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchFilter {
    pub states: Vec<State>,
    pub kinds: Vec<EventKind>,
    pub tool: Option<String>,
}

impl WatchFilter {
    /// Whether `event` is wanted: the rule the store's query applies, written once more for
    /// tests and for readers.
    pub fn matches(&self, event: &OperationEvent) -> bool {
        let touches = |state: Option<State>| state.is_some_and(|s| self.states.contains(&s));
        let wide = (self.states.is_empty() && self.kinds.is_empty())
            || touches(event.event.from)
            || touches(event.event.to)
            || touches(event.state)
            || self.kinds.contains(&event.event.kind);
        let narrow = self
            .tool
            .as_ref()
            .is_none_or(|tool| event.tool.as_ref() == Some(tool));
        wide && narrow
    }
}

/// An operation in a listing: without its result, with the latest event of its current life.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    pub operation: Operation,
    /// The kind and time of the latest event of its current life.
    pub last_event: Option<(EventKind, Millis)>,
}
