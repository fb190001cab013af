//! The operation state machine (docs/semantics.md §2–5) as pure functions.
//!
//! Each function takes what is stored, a command and `now`, and returns the caller's answer and
//! a [`Plan`]: the writes that must commit in one transaction for that answer to be true. A store
//! applies the plan and commits before it lets the answer leave the process.
//!
//! Where a decision needs more than the operation row, the function says so and the store
//! fetches it in the same transaction: [`begin`] asks for a [`FreshIdGuard`] (the fresh-id guard's
//! finding and a new fencing token) before it grants anything, and [`report`] asks for the
//! attempt record of a superseded fencing token, of this life or of one that handed its provider
//! key to it ([`needs_attempt_record`]).
//!
//! # Lives and tokens
//!
//! A settled operation past retention (deleted, or found expired by a Begin) starts a new *life*
//! on its next claim, with a new provider key, unless the life before ended ABSENT for the same
//! intent (`inherited_key`): its provider key passes to the next life, and retention keeps the
//! ABSENT row, expired but readable, as a tombstone until `--provider-key-window` after it
//! settled, so a stalled attempt of the old life is deduplicated by the provider. Fencing tokens
//! come from one counter for the whole store, so a token is never issued twice for an operation id
//! across its lives; a life is named by the token of its first attempt, and its events carry it.
//!
//! A life that took over the key keeps the attempt log of the lives before it
//! (`Plan::forgets_attempts` is false), so a stalled attempt of one of them that reports late is
//! judged as a superseded attempt of this life would be: its effect is under this life's key. What
//! its confirm proves and changes nothing here is recorded in the life it belongs to
//! (`NewEvent::in_earlier_life`): RESOLUTION_CONTRADICTED when it names the provider object this
//! life confirmed, DOUBLE_EXECUTION when another. Every anomaly of one late token shares the
//! dedupe key `EARLIER_LIFE:<token>`; its report that it did nothing, or cannot tell, is recorded
//! in its life as a note (dedupe key `EARLIER_LIFE_REPORT:<token>`). A report with a token of a
//! life that kept its key, or one never issued for this operation, changes nothing.
//!
//! # Who holds an attempt
//!
//! An attempt belongs to the credential it was granted to (`holder`), recorded on the operation
//! and in the attempt log. A fencing token or an attempt id is readable by anyone who may read the
//! operation, so neither proves anything alone: a report or a heartbeat from another credential is
//! answered as one with a token never issued, and the same Begin again is granted again only to
//! the holder (to another credential it is IN_PROGRESS). An attempt granted to none (while the
//! ledger was open) is any credential's of its tenant (`model::may_act_for`).
//!
//! # A superseded attempt's confirm
//!
//! It is proof the effect happened. When every later attempt of the life said by itself that it
//! did nothing, the operation becomes CONFIRMED (recording that the ABSENT it had was
//! contradicted); when a later attempt runs or may have run, it is held UNKNOWN for an operator
//! (source `anomaly`, a DOUBLE_EXECUTION event): no reconciler settles it and an operator cannot
//! call it ABSENT. Either way the superseded attempt is answered EXECUTION_RIGHT_LOST. The
//! operation records which attempt's confirm its result is (`confirmed_by`), so a retried confirm
//! gets the same answer.
//!
//! # Resolutions
//!
//! An operator's resolution names the attempt examined by its fencing token, which also names the
//! life: a resolution of an attempt that is no longer the latest is refused naming the current
//! one. A resolution id names one resolution: the same outcome of the same attempt again gets the
//! first answer; the id reused for anything else is refused.

use serde_json::json;

use crate::identity::provider_key;
use crate::model::*;

/// The writes that make a decision true. Empty when nothing changes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub operation: Option<Write>,
    /// A newly granted attempt, for the attempt log.
    pub attempt: Option<Attempt>,
    /// The write starts a new life of an existing row with a provider key of its own: the
    /// attempt log of earlier lives goes, as retention would have taken it with the row. A new
    /// life that took over the key of the life before it ([`inherited_key`]) keeps their
    /// attempts, so a report one of them sends late is judged, and recorded in its life.
    pub forgets_attempts: bool,
    pub events: Vec<NewEvent>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.operation.is_none() && self.attempt.is_none() && self.events.is_empty()
    }
}

/// The new version of the operation row.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    Insert(Operation),
    Update(Operation),
}

impl Write {
    pub fn operation(&self) -> &Operation {
        match self {
            Write::Insert(op) | Write::Update(op) => op,
        }
    }
}

/// Why a report, heartbeat or resolution was refused. The refusal may still come with a plan
/// (an anomaly to record).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The fencing token is not the latest attempt's: that attempt lost its right to execute.
    #[error("fencing token {token} has no execution right: the latest attempt is {latest_attempt} (token {latest_token})")]
    ExecutionRightLost {
        token: FencingToken,
        latest_attempt: u32,
        latest_token: FencingToken,
    },
    /// The lease this heartbeat tries to extend has already ended.
    #[error("the lease of fencing token {token} has ended")]
    LeaseExpired { token: FencingToken },
    /// The report contradicts the operation's settled truth.
    #[error("the operation is already {state}")]
    AlreadySettled { state: State },
    /// Only UNKNOWN operations can be resolved.
    #[error("only UNKNOWN operations can be resolved; this one is {state}")]
    NotUnknown { state: State },
    /// The operator examined an attempt that is not the latest (perhaps of an earlier life).
    #[error("the resolution names the attempt with fencing token {examined}, but the latest attempt is {current} (fencing token {current_token}): look at the operation again")]
    AttemptMismatch {
        examined: FencingToken,
        current: u32,
        current_token: FencingToken,
    },
    /// The resolution id was already used for a different resolution of this operation.
    #[error("resolution_id {resolution_id:?} already resolved this operation {state}")]
    ResolutionIdReused { resolution_id: String, state: State },
    /// An attempt confirmed the effect: the operation cannot be declared ABSENT.
    #[error("an attempt confirmed the effect, so it cannot be ABSENT; resolve it CONFIRMED (or declare a new intent)")]
    EffectProven,
}

/// The longest retry-after an IN_PROGRESS answer suggests.
const MAX_RETRY_AFTER_MS: i64 = 1_000;
/// The shortest, so callers do not spin.
const MIN_RETRY_AFTER_MS: i64 = 20;

/// The first step of a Begin, from the operation row alone.
#[derive(Debug, Clone, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "one step per Begin, consumed at once; boxing buys nothing"
)]
pub enum BeginStep {
    /// The answer, and what must be written for it to be true (often nothing).
    Decided(BeginDecision, Plan),
    /// The Begin would grant a new execution right: the store must run the fresh-id guard
    /// (unless a new intent is declared), take a fencing token, and call [`claim`].
    Claim,
}

/// What the store found before a new execution right is granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreshIdGuard {
    /// Nothing blocks the claim; `token` is a fencing token never issued before.
    Clear { token: FencingToken },
    /// Another open operation with the same tool and fingerprint blocks it.
    Blocked(Blocking),
}

/// Decides a Begin from the stored operation, as far as the row alone can.
pub fn begin(current: Option<&Operation>, cmd: &BeginCommand, now: Millis) -> BeginStep {
    let op = match current {
        Some(op) if !op.is_expired(now) => op,
        // No record, or a settled one past retention: a new life.
        _ => return claim_unless_held(cmd),
    };
    if op.fingerprint != cmd.fingerprint {
        let decision = BeginDecision::Conflict {
            stored: op.fingerprint,
            requested: cmd.fingerprint,
        };
        return BeginStep::Decided(decision, Plan::default());
    }
    let (decision, plan) = match op.state {
        State::Absent => return claim_unless_held(cmd),
        State::InFlight if now >= op.lease_deadline => {
            let plan = expire_lease(op, now).expect("lease is IN_FLIGHT and past its deadline");
            let decision = BeginDecision::Unknown {
                since: now,
                reason: Some(lease_ended(op)),
                blocking: None,
            };
            (decision, plan)
        }
        // A transport retry of the very Begin that was granted: the same grant again. The
        // attempt id alone is not enough (a JSON-RPC id is unique only within its session),
        // and only the credential it was granted to is granted it again: an attempt id is
        // readable by anyone who may read the operation.
        State::InFlight
            if op.attempt_id == cmd.attempt_id
                && op.attempt_context == cmd.context
                && may_act_for(&op.holder, &cmd.holder) =>
        {
            let grant = Grant::issued(op, cmd.lease_ttl_ms, true);
            (BeginDecision::Execute(grant), Plan::default())
        }
        State::InFlight => (
            in_progress(op.attempt, op.lease_deadline, None, now),
            Plan::default(),
        ),
        State::Confirmed => {
            let decision = BeginDecision::Replay {
                result: op.result.clone().unwrap_or_default(),
                provider_ref: op.provider_ref.clone(),
                confirmed_at: op.updated_at,
                attempt: op.attempt,
            };
            (decision, Plan::default())
        }
        State::Unknown => {
            let decision = BeginDecision::Unknown {
                since: op.unknown_since.unwrap_or(op.updated_at),
                reason: op.reason.clone(),
                blocking: None,
            };
            (decision, Plan::default())
        }
    };
    BeginStep::Decided(decision, plan)
}

/// A claim, unless the tenant's executions are held: then nothing is done.
fn claim_unless_held(cmd: &BeginCommand) -> BeginStep {
    if cmd.held {
        BeginStep::Decided(BeginDecision::Held, Plan::default())
    } else {
        BeginStep::Claim
    }
}

/// Whether a Begin of `cmd` over `current` (as stored at `now`) would start a new execution, if
/// nothing blocks it: the rule of [`begin`] for when it asks to [`claim`] — no record, one past
/// its retention (a new life), or an ABSENT one of the same arguments (a new attempt). A tenant's
/// in-flight cap counts exactly these.
pub fn starts_execution(current: Option<&Operation>, cmd: &BeginCommand, now: Millis) -> bool {
    match current {
        Some(op) if !op.is_expired(now) => {
            op.state == State::Absent && op.fingerprint == cmd.fingerprint
        }
        _ => true,
    }
}

/// Grants a new execution right, or refuses it for the operation the guard found. Call only
/// after [`begin`] answered [`BeginStep::Claim`] for the same row and `now`.
pub fn claim(
    current: Option<&Operation>,
    cmd: &BeginCommand,
    guard: FreshIdGuard,
    now: Millis,
) -> (BeginDecision, Plan) {
    match guard {
        FreshIdGuard::Blocked(blocking) => (guarded(&blocking, now), Plan::default()),
        FreshIdGuard::Clear { token } => match current {
            Some(op) if !op.is_expired(now) => claim_again(op, cmd, token, now),
            previous => claim_new_life(previous, cmd, token, now),
        },
    }
}

fn in_progress(
    attempt: u32,
    lease_deadline: Millis,
    blocking: Option<OperationId>,
    now: Millis,
) -> BeginDecision {
    BeginDecision::InProgress {
        attempt,
        lease_deadline,
        retry_after_ms: (lease_deadline - now).clamp(MIN_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS),
        blocking,
    }
}

/// The fresh-id guard's answer: the same intent runs (IN_PROGRESS) or may have run (UNKNOWN)
/// under another id. An IN_FLIGHT operation past its lease is UNKNOWN whether or not the
/// sweeper has marked it yet.
fn guarded(blocking: &Blocking, now: Millis) -> BeginDecision {
    let id = &blocking.operation_id;
    if blocking.state == State::InFlight && now < blocking.lease_deadline {
        return in_progress(
            blocking.attempt,
            blocking.lease_deadline,
            Some(id.clone()),
            now,
        );
    }
    let since = match blocking.state {
        State::InFlight => blocking.lease_deadline,
        _ => blocking.updated_at,
    };
    BeginDecision::Unknown {
        since,
        reason: Some(format!(
            "operation {id} with the same tool and arguments is UNKNOWN; declare a new intent to run this one"
        )),
        blocking: Some(id.clone()),
    }
}

/// A first claim, or a claim on an id whose previous life ended with retention.
fn claim_new_life(
    previous: Option<&Operation>,
    cmd: &BeginCommand,
    token: FencingToken,
    now: Millis,
) -> (BeginDecision, Plan) {
    let op = Operation {
        tenant: cmd.tenant.clone(),
        operation_id: cmd.operation_id.clone(),
        tool: cmd.tool.clone(),
        fingerprint: cmd.fingerprint,
        state: State::InFlight,
        source: Source::Attempt,
        attempt: 1,
        fencing_token: token,
        life: token,
        attempt_id: cmd.attempt_id.clone(),
        attempt_context: cmd.context.clone(),
        executor: cmd.actor.clone(),
        holder: cmd.holder.clone(),
        lease_started_at: now,
        lease_deadline: now + cmd.lease_ttl_ms,
        result: None,
        provider_ref: None,
        provider_key: inherited_key(previous, cmd)
            .unwrap_or_else(|| provider_key(&cmd.tenant, &cmd.operation_id, token)),
        provider: cmd.provider.clone(),
        lookup_hints: cmd.lookup_hints.clone(),
        retention_ms: cmd.retention_ms,
        created_at: now,
        updated_at: now,
        expires_at: None,
        reason: None,
        version: previous.map_or(0, |p| p.version),
        unknown_since: None,
        last_report_at: None,
        // Who said ABSENT for whom carries over with the key: an attempt of the earlier life
        // that confirms late is judged against every attempt since it, in either life.
        declared_absent_token: inherited_key(previous, cmd)
            .and(previous.and_then(|p| p.declared_absent_token)),
        confirmed_by: None,
        reconcile_lookups: 0,
        reconcile_next_at: None,
        lookup_claimed_until: None,
    };
    let details = previous.map(
        |p| json!({ "previous_life_expired_at": p.expires_at, "previous_state": p.state.as_str() }),
    );
    let write = if previous.is_some() {
        Write::Update(op)
    } else {
        Write::Insert(op)
    };
    let inherits = inherited_key(previous, cmd).is_some();
    let (decision, mut plan) = granted(State::Absent, write, cmd, details);
    plan.forgets_attempts = previous.is_some() && !inherits;
    (decision, plan)
}

/// The provider key a new life takes over from the life before it: one that ended ABSENT (its
/// tombstone) for the same intent. Nothing happened under that key as far as the ledger knows,
/// so reusing it is safe, and an attempt of that life that stalled and runs late is then
/// deduplicated by the provider instead of making a second effect. A life that ended
/// CONFIRMED, or another intent under the same id, gets a key of its own: the provider would
/// answer it with the earlier effect, or refuse other parameters under a used key.
fn inherited_key(previous: Option<&Operation>, cmd: &BeginCommand) -> Option<String> {
    previous
        .filter(|p| p.state == State::Absent && p.fingerprint == cmd.fingerprint)
        .map(|p| p.provider_key.clone())
}

/// A new attempt after an ABSENT outcome: same life, same provider key, a new fencing token.
fn claim_again(
    op: &Operation,
    cmd: &BeginCommand,
    token: FencingToken,
    now: Millis,
) -> (BeginDecision, Plan) {
    let mut next = op.clone();
    next.state = State::InFlight;
    next.source = Source::Attempt;
    next.attempt = op.attempt + 1;
    next.fencing_token = token;
    next.attempt_id = cmd.attempt_id.clone();
    next.attempt_context = cmd.context.clone();
    next.executor = cmd.actor.clone();
    next.holder = cmd.holder.clone();
    next.lease_started_at = now;
    next.lease_deadline = now + cmd.lease_ttl_ms;
    next.updated_at = now;
    next.expires_at = None;
    next.reason = None;
    next.unknown_since = None;
    next.last_report_at = None;
    next.reconcile_lookups = 0;
    next.reconcile_next_at = None;
    next.lookup_claimed_until = None;
    if cmd.provider.is_some() {
        next.provider = cmd.provider.clone();
    }
    if cmd.lookup_hints.is_some() {
        next.lookup_hints = cmd.lookup_hints.clone();
    }
    next.retention_ms = next.retention_ms.max(cmd.retention_ms);
    granted(State::Absent, Write::Update(next), cmd, None)
}

fn granted(
    from: State,
    write: Write,
    cmd: &BeginCommand,
    details: Option<serde_json::Value>,
) -> (BeginDecision, Plan) {
    let op = write.operation();
    let grant = Grant::issued(op, cmd.lease_ttl_ms, false);
    let attempt = Attempt {
        number: op.attempt,
        fencing_token: op.fencing_token,
        life: op.life,
        attempt_id: cmd.attempt_id.clone(),
        started_at: op.lease_started_at,
        lease_deadline: op.lease_deadline,
        actor: cmd.actor.clone(),
        holder: cmd.holder.clone(),
        context: cmd.context.clone(),
    };
    let mut event = NewEvent::transition(
        op,
        EventKind::Claimed,
        (from, State::InFlight),
        op.attempt,
        cmd.actor.clone(),
    );
    event.details = details.map(|d| d.to_string());
    let plan = Plan {
        operation: Some(write),
        attempt: Some(attempt),
        forgets_attempts: false,
        events: vec![event],
    };
    (BeginDecision::Execute(grant), plan)
}

fn lease_ended(op: &Operation) -> String {
    format!("the lease of attempt {} ended with no report", op.attempt)
}

/// IN_FLIGHT past its lease becomes UNKNOWN: lease expiry is evidence of nothing. `None` when
/// the operation is not IN_FLIGHT or its lease is still live.
pub fn expire_lease(op: &Operation, now: Millis) -> Option<Plan> {
    if op.state != State::InFlight || now < op.lease_deadline {
        return None;
    }
    let reason = lease_ended(op);
    let mut next = moved(op, State::Unknown, Source::Lease, now);
    next.reason = Some(reason.clone());
    Some(single(
        next,
        NewEvent::transition(
            op,
            EventKind::LeaseExpired,
            (State::InFlight, State::Unknown),
            op.attempt,
            Actor::Ledger,
        )
        .because(reason)
        .with_details(json!({ "lease_deadline": op.lease_deadline })),
    ))
}

/// The operation moved to `to` by `source` at `now`, with everything that follows from the
/// state alone: when it became UNKNOWN, when retention may take it, and its lookup schedule.
pub(crate) fn moved(op: &Operation, to: State, source: Source, now: Millis) -> Operation {
    let mut next = op.clone();
    next.state = to;
    next.source = source;
    next.updated_at = now;
    next.expires_at = to.is_settled().then(|| now + op.retention_ms);
    next.unknown_since = match to {
        State::Unknown if op.state == State::Unknown => op.unknown_since,
        State::Unknown => Some(now),
        _ => None,
    };
    // An operation entering UNKNOWN with a reconciler is due for a lookup at once (unless it
    // is held for an operator); one leaving UNKNOWN is due for none.
    next.reconcile_next_at = match to {
        State::Unknown if next.provider.is_some() && source != Source::Anomaly => {
            Some(op.reconcile_next_at.unwrap_or(now))
        }
        _ => None,
    };
    if to != State::Unknown || source == Source::Anomaly {
        next.lookup_claimed_until = None;
    }
    next.confirmed_by = None;
    next
}

/// The operation moved to `to` by `source` with a proven effect on record: its result and
/// provider reference, and the attempt whose confirm proved it (`None` for a reconciler's or an
/// operator's).
pub(crate) fn proven(
    op: &Operation,
    to: State,
    source: Source,
    effect: (Vec<u8>, Option<String>),
    proven_by: Option<FencingToken>,
    now: Millis,
) -> Operation {
    let mut next = moved(op, to, source, now);
    (next.result, next.provider_ref) = (Some(effect.0), effect.1);
    next.confirmed_by = proven_by;
    next
}

fn single(next: Operation, event: NewEvent) -> Plan {
    Plan {
        operation: Some(Write::Update(next)),
        attempt: None,
        forgets_attempts: false,
        events: vec![event],
    }
}

/// Whether a report with `token` may come from an earlier attempt, whose record the store must
/// read from the attempt log and pass to [`report`]: one of this life, or of an earlier life
/// that handed its provider key on (the log keeps only those; see [`Plan::forgets_attempts`]).
pub fn needs_attempt_record(op: &Operation, token: FencingToken) -> bool {
    token < op.fencing_token
}

/// Applies a report sent with `cmd.fencing_token`. `earlier` is the attempt log's record of
/// that token when [`needs_attempt_record`] asked for it. On success returns the state the
/// operation is in afterwards. A refusal may still come with a plan: an anomaly to record.
pub fn report(
    op: &Operation,
    cmd: &ReportCommand,
    earlier: Option<&Attempt>,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    let token = cmd.fencing_token;
    let lost = Err(Rejection::ExecutionRightLost {
        token,
        latest_attempt: op.attempt,
        latest_token: op.fencing_token,
    });
    if token == op.fencing_token {
        // From another credential than the attempt's, a report is answered as one with a token
        // never issued, and changes nothing.
        if !may_act_for(&op.holder, &cmd.holder) {
            return (lost, Plan::default());
        }
        return latest_attempt_report(op, cmd, now);
    }
    // A token the attempt log does not know (never issued, another operation's, of a life
    // whose key went with it), or another credential's attempt: it changes nothing.
    let Some(attempt) = earlier.filter(|a| {
        a.fencing_token == token
            && (is_token_of_life(token, op) || a.life < op.life)
            && may_act_for(&a.holder, &cmd.holder)
    }) else {
        return (lost, Plan::default());
    };
    match &cmd.report {
        Report::Confirm {
            result,
            provider_ref,
        } => superseded_confirm(op, attempt, result, provider_ref.as_deref(), now, lost),
        Report::Absent { reason } if attempt.life < op.life => {
            let plan = earlier_life_report(op, attempt, EventKind::ReportedAbsent, reason);
            (lost, plan)
        }
        Report::Unknown { reason } if attempt.life < op.life => {
            let plan = earlier_life_report(op, attempt, EventKind::ReportedUnknown, reason);
            (lost, plan)
        }
        // A superseded attempt of this life saying it did nothing, or cannot tell, adds
        // nothing: that its life's truth may be wrong is known already to whoever superseded it.
        Report::Absent { .. } | Report::Unknown { .. } => (lost, Plan::default()),
    }
}

/// A report from attempt `earlier` of a life that ended ABSENT and handed its provider key to
/// this one, saying it did nothing or cannot tell. It moves nothing here: an effect of it, if
/// any, is under this life's provider key, which the provider deduplicates, and a confirm of it
/// would be judged as a superseded attempt's. It is recorded in the life it belongs to, once
/// for its token, so its life's history shows what its attempt said after the life ended.
fn earlier_life_report(op: &Operation, earlier: &Attempt, kind: EventKind, said: &str) -> Plan {
    let token = earlier.fencing_token;
    let what = match kind {
        EventKind::ReportedAbsent => "that it did nothing",
        _ => "that it cannot tell whether its effect happened",
    };
    let mut event = NewEvent::note(op, kind, earlier.number, earlier.actor.clone())
        .because(format!(
            "attempt {} of an earlier life (fencing token {token}) reported late, after its life ended ABSENT, {what}: {said}; an effect of it, if any, is under the provider key this life took over",
            earlier.number
        ))
        .with_details(json!({ "late": true, "fencing_token": token.get() }))
        .in_earlier_life(op, earlier.life);
    event.dedupe_key = Some(format!("EARLIER_LIFE_REPORT:{token}"));
    Plan {
        events: vec![event],
        ..Plan::default()
    }
}

/// A report from the attempt that holds (or last held) the execution right.
fn latest_attempt_report(
    op: &Operation,
    cmd: &ReportCommand,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    let settled = |state| (Err(Rejection::AlreadySettled { state }), Plan::default());
    match (op.state, &cmd.report) {
        (State::Unknown, _) if op.held_for_operator() => held_report(op, cmd, now),
        // The report of the attempt in flight, or a late one after its lease ran out.
        (State::InFlight, _) | (State::Unknown, Report::Confirm { .. } | Report::Absent { .. }) => {
            (Ok(cmd.report.target()), settle_by_attempt(op, cmd, now))
        }
        // The same UNKNOWN report again changes no state, but the attempt was still alive to
        // send it: a lookup must wait its settle time from this moment too.
        (State::Unknown, Report::Unknown { .. }) => {
            let mut next = op.clone();
            next.last_report_at = Some(now);
            let plan = Plan {
                operation: Some(Write::Update(next)),
                ..Plan::default()
            };
            (Ok(State::Unknown), plan)
        }
        (
            State::Confirmed,
            Report::Confirm {
                result,
                provider_ref,
            },
        ) => {
            let same_report =
                op.result.as_ref() == Some(result) && op.provider_ref == *provider_ref;
            // The effect on record is another's (an earlier attempt's, a reconciler's), and this
            // attempt names the same provider object: one effect.
            let same_effect = provider_ref.is_some()
                && op.provider_ref == *provider_ref
                && op.confirmed_by != Some(op.fencing_token);
            if same_report || same_effect {
                (Ok(State::Confirmed), Plan::default())
            } else if provider_ref.is_some()
                && op.provider_ref.is_some()
                && op.confirmed_by != Some(op.fencing_token)
            {
                // Another provider object than the one on record, which this attempt did not
                // report: the effect may have happened twice.
                let plan = beside_the_record(op, provider_ref.as_deref());
                (Err(Rejection::AlreadySettled { state: op.state }), plan)
            } else {
                settled(op.state)
            }
        }
        (State::Absent, Report::Absent { .. }) => (Ok(State::Absent), Plan::default()),
        // An UNKNOWN report adds nothing to a settled truth.
        (State::Confirmed | State::Absent, Report::Unknown { .. }) => {
            (Ok(op.state), Plan::default())
        }
        // A confirm after ABSENT (said by a reconciler, an operator, or the attempt itself):
        // the effect did happen, and no later attempt exists. Record the truth, and the
        // contradiction as an anomaly.
        (State::Absent, Report::Confirm { .. }) => {
            let said = if op.source == Source::Attempt {
                "the attempt itself".to_owned()
            } else {
                format!("a {}", op.source.as_str())
            };
            let mut plan = settle_by_attempt(op, cmd, now);
            let who = format!("attempt {}", op.attempt);
            let attempt = (who.as_str(), op.attempt, op.fencing_token);
            plan.events
                .push(contradiction(op, attempt, &op.executor, &said));
            (Ok(State::Confirmed), plan)
        }
        // This attempt did nothing, and the effect on record is another attempt's (its report
        // settled a hold with it): no contradiction. Against an operator's or a reconciler's
        // CONFIRMED, or its own confirm, an ABSENT is refused.
        (State::Confirmed, Report::Absent { .. })
            if op.source == Source::Attempt && op.confirmed_by != Some(op.fencing_token) =>
        {
            (Ok(State::Confirmed), Plan::default())
        }
        (State::Confirmed, Report::Absent { .. }) => settled(op.state),
    }
}

/// Attempt `number` (`who`, by name) with fencing token `token` confirmed its effect after
/// `said` said ABSENT.
fn contradiction(
    op: &Operation,
    (who, number, token): (&str, u32, FencingToken),
    actor: &Actor,
    said: &str,
) -> NewEvent {
    NewEvent::anomaly(
        op,
        EventKind::ResolutionContradicted,
        number,
        actor.clone(),
        token,
    )
    .because(format!(
        "{who} confirmed its effect after {said} said ABSENT"
    ))
    .with_details(json!({ "fencing_token": token.get() }))
}

fn settle_by_attempt(op: &Operation, cmd: &ReportCommand, now: Millis) -> Plan {
    let target = cmd.report.target();
    let mut next = moved(op, target, Source::Attempt, now);
    next.last_report_at = Some(now);
    let (kind, reason) = match &cmd.report {
        Report::Confirm {
            result,
            provider_ref,
        } => {
            next.result = Some(result.clone());
            next.provider_ref = provider_ref.clone();
            next.confirmed_by = Some(op.fencing_token);
            next.reason = None;
            (EventKind::Confirmed, None)
        }
        Report::Absent { reason } => {
            next.reason = Some(reason.clone());
            (EventKind::ReportedAbsent, Some(reason.clone()))
        }
        Report::Unknown { reason } => {
            next.reason = Some(reason.clone());
            (EventKind::ReportedUnknown, Some(reason.clone()))
        }
    };
    let late = op.state != State::InFlight || now >= op.lease_deadline;
    let mut event = NewEvent::transition(
        op,
        kind,
        (op.state, target),
        op.attempt,
        op.executor.clone(),
    );
    event.reason = reason;
    if late {
        event = event.with_details(json!({ "late": true, "previous_source": op.source.as_str() }));
    }
    single(next, event)
}

/// A confirm from attempt `earlier`, superseded by a later attempt: of this life, or of this
/// life's first attempt when `earlier` is of a life that ended ABSENT and handed its provider
/// key to this one. The effect happened, under this life's key either way; whether it may have
/// happened twice depends on what the later attempts did. For an earlier life's attempt, an
/// anomaly that changes nothing here is recorded in the life it belongs to, an event that moves
/// this life's row in this life; every anomaly of that late token shares one dedupe key, so it
/// is recorded once however the operation moves on between its retries.
fn superseded_confirm(
    op: &Operation,
    earlier: &Attempt,
    result: &[u8],
    provider_ref: Option<&str>,
    now: Millis,
    lost: Result<State, Rejection>,
) -> (Result<State, Rejection>, Plan) {
    let token = earlier.fencing_token;
    let of_earlier_life = earlier.life < op.life;
    let who = if of_earlier_life {
        format!(
            "attempt {} of an earlier life (fencing token {token})",
            earlier.number
        )
    } else {
        format!("attempt {}", earlier.number)
    };
    let late_key = |mut event: NewEvent| {
        if of_earlier_life && event.dedupe_key.is_some() {
            event.dedupe_key = Some(format!("EARLIER_LIFE:{token}"));
        }
        event
    };
    let in_its_life = |event: NewEvent| match of_earlier_life {
        true => late_key(event.in_earlier_life(op, earlier.life)),
        false => event,
    };
    let in_this_life = |event: NewEvent| match of_earlier_life {
        true => late_key(event.naming_lives(op, earlier.life)),
        false => event,
    };
    // This very confirm is already on record: a retry changes nothing. A superseded attempt is
    // always answered that its right is lost, whatever its proof did, so a retry gets the same
    // answer however the operation moved on.
    if op.confirmed_by == Some(token) {
        return (lost, Plan::default());
    }
    // The effect is already on record (CONFIRMED, or held with an earlier confirm): the same
    // provider object again is no second effect — though for an earlier life, whose end said
    // ABSENT, it contradicts that end; another object may be a second effect.
    if op.state == State::Confirmed || op.held_for_operator() {
        let events = if provider_ref.is_some() && op.provider_ref.as_deref() == provider_ref {
            if !of_earlier_life {
                return (lost, Plan::default());
            }
            let attempt = (who.as_str(), earlier.number, token);
            let event = contradiction(op, attempt, &earlier.actor, "its life")
                .because(format!(
                    "{who} confirmed its effect after its life ended ABSENT; it names the provider object this life confirmed, so under the shared provider key the effect happened once"
                ));
            vec![event]
        } else {
            vec![double_execution(op, earlier, &who, provider_ref, None)]
        };
        let plan = Plan {
            events: events.into_iter().map(in_its_life).collect(),
            ..Plan::default()
        };
        return (lost, plan);
    }
    // Every later attempt said by itself that it did nothing: the effect happened once.
    let no_later_attempt_ran = op.declared_absent_token.is_none_or(|d| d <= token);
    if op.state == State::Absent && no_later_attempt_ran {
        let effect = (result.to_vec(), provider_ref.map(str::to_owned));
        let mut next = proven(
            op,
            State::Confirmed,
            Source::Attempt,
            effect,
            Some(token),
            now,
        );
        next.reason = None;
        // A declaration carried over from an earlier life is not this life's.
        let said = match (of_earlier_life, op.declared_absent_token) {
            (true, _) => "its life's end",
            (false, Some(declared)) if declared >= op.life => "a reconciler or an operator",
            (false, _) => "it",
        };
        let confirmed = NewEvent::transition(
            op,
            EventKind::Confirmed,
            (State::Absent, State::Confirmed),
            earlier.number,
            earlier.actor.clone(),
        )
        .because(format!(
            "{who} confirmed late; no later attempt performed the effect"
        ))
        .with_details(json!({ "late": true, "superseded_by_attempt": op.attempt }));
        let mut plan = single(next, in_this_life(confirmed));
        let attempt = (who.as_str(), earlier.number, token);
        let contradicted = contradiction(op, attempt, &earlier.actor, said);
        plan.events.push(in_its_life(contradicted));
        return (lost, plan);
    }
    // A later attempt runs, may have run, or was declared ABSENT by someone other than itself:
    // the effect may have happened twice. Nothing automatic settles that.
    let effect = (result.to_vec(), provider_ref.map(str::to_owned));
    let mut next = proven(
        op,
        State::Unknown,
        Source::Anomaly,
        effect,
        Some(token),
        now,
    );
    next.reason = Some(format!(
        "{who} confirmed its effect after attempt {} was granted the execution right; held for an operator",
        op.attempt
    ));
    // The anomaly records this life's move too, so it is this life's: the second effect, if
    // any, is this life's attempt's.
    let event = double_execution(op, earlier, &who, provider_ref, Some(State::Unknown));
    (lost, single(next, in_this_life(event)))
}

fn double_execution(
    op: &Operation,
    earlier: &Attempt,
    who: &str,
    provider_ref: Option<&str>,
    to: Option<State>,
) -> NewEvent {
    let token = earlier.fencing_token;
    let mut event = NewEvent::anomaly(
        op,
        EventKind::DoubleExecution,
        earlier.number,
        earlier.actor.clone(),
        token,
    )
    .because(format!(
        "{who} confirmed its effect after attempt {} was granted the execution right",
        op.attempt
    ))
    .with_details(json!({
        "stale_attempt": earlier.number,
        "stale_fencing_token": token.get(),
        "stale_provider_ref": provider_ref,
        "latest_attempt": op.attempt,
        "state": op.state.as_str(),
    }));
    (event.from, event.to) = (to.map(|_| op.state), to);
    event
}

/// The latest attempt reports while the operation is held for an operator because an effect
/// was proven (by a superseded attempt's confirm, or a reconciler that found it) while this
/// attempt may also have performed it. The operation holds the proven effect's result.
fn held_report(
    op: &Operation,
    cmd: &ReportCommand,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    let confirmed = |kind: EventKind, reason: String| {
        let mut next = moved(op, State::Confirmed, Source::Attempt, now);
        next.confirmed_by = op.confirmed_by;
        let event = NewEvent::transition(
            op,
            kind,
            (State::Unknown, State::Confirmed),
            op.attempt,
            op.executor.clone(),
        )
        .because(reason);
        (Ok(State::Confirmed), single(next, event))
    };
    match &cmd.report {
        // This attempt did nothing: the effect already proven is the only one.
        Report::Absent { reason } => confirmed(
            EventKind::ReportedAbsent,
            format!("attempt {} did not perform the effect ({reason}); the effect already proven is the only one", op.attempt),
        ),
        // The provider returned the same object to both attempts: one effect.
        Report::Confirm {
            provider_ref: Some(reference),
            ..
        } if op.provider_ref.as_deref() == Some(reference.as_str()) => confirmed(
            EventKind::Confirmed,
            format!(
                "attempt {} confirmed the same effect ({reference}) as the earlier attempt",
                op.attempt
            ),
        ),
        // Another: the effect may have happened twice; it stays held.
        Report::Confirm { provider_ref, .. } => (
            Ok(State::Unknown),
            beside_the_record(op, provider_ref.as_deref()),
        ),
        Report::Unknown { .. } => (Ok(State::Unknown), Plan::default()),
    }
}

/// The latest attempt confirmed `provider_ref`, another provider object than the effect on record
/// (an earlier attempt's, or one a reconciler found): the effect may have happened twice. Recorded
/// once per attempt.
fn beside_the_record(op: &Operation, provider_ref: Option<&str>) -> Plan {
    let event = NewEvent::anomaly(
        op,
        EventKind::DoubleExecution,
        op.attempt,
        op.executor.clone(),
        op.fencing_token,
    )
    .because(format!(
        "attempt {} confirmed an effect beside the one on record",
        op.attempt
    ))
    .with_details(json!({ "provider_ref": provider_ref, "on_record": op.provider_ref }));
    Plan {
        events: vec![event],
        ..Plan::default()
    }
}

/// Extends the live lease of the latest attempt to `now + ttl` (never shortens it). Returns the
/// new deadline.
pub fn heartbeat(
    op: &Operation,
    cmd: &HeartbeatCommand,
    now: Millis,
) -> Result<(Millis, Plan), Rejection> {
    let HeartbeatCommand {
        fencing_token,
        ref holder,
        ttl_ms,
    } = *cmd;
    // Another credential's heartbeat is answered as one with a token never issued.
    if fencing_token != op.fencing_token || !may_act_for(&op.holder, holder) {
        return Err(Rejection::ExecutionRightLost {
            token: fencing_token,
            latest_attempt: op.attempt,
            latest_token: op.fencing_token,
        });
    }
    if !op.lease_live(now) {
        return Err(Rejection::LeaseExpired {
            token: fencing_token,
        });
    }
    let deadline = op.lease_deadline.max(now + ttl_ms);
    if deadline == op.lease_deadline {
        return Ok((deadline, Plan::default()));
    }
    let mut next = op.clone();
    next.lease_deadline = deadline;
    next.updated_at = now;
    let plan = Plan {
        operation: Some(Write::Update(next)),
        ..Plan::default()
    };
    Ok((deadline, plan))
}

/// Applies an operator's resolution. `prior` is an earlier resolution with the same resolution
/// id, if any: a retry gets that answer again, whatever the operation did since.
pub fn resolve(
    op: &Operation,
    cmd: &ResolveCommand,
    prior: Option<PriorResolution>,
    now: Millis,
) -> Result<(State, Plan), Rejection> {
    let target = cmd.resolution.target();
    if let Some(prior) = prior {
        return retried_resolution(cmd, prior).map(|state| (state, Plan::default()));
    }
    if op.state != State::Unknown {
        return Err(Rejection::NotUnknown { state: op.state });
    }
    if cmd.fencing_token != op.fencing_token || cmd.attempt.is_some_and(|a| a != op.attempt) {
        return Err(Rejection::AttemptMismatch {
            examined: cmd.fencing_token,
            current: op.attempt,
            current_token: op.fencing_token,
        });
    }
    if target == State::Absent && op.held_for_operator() {
        return Err(Rejection::EffectProven);
    }
    let mut next = moved(op, target, Source::Operator, now);
    next.reason = Some(cmd.reason.clone());
    match &cmd.resolution {
        Resolution::Confirmed {
            result,
            provider_ref,
        } => {
            next.result = Some(result.clone());
            next.provider_ref = provider_ref.clone();
        }
        Resolution::Absent => {
            next.result = None;
            next.provider_ref = None;
            next.declared_absent_token = Some(op.fencing_token);
        }
    }
    let mut event = NewEvent::transition(
        op,
        EventKind::Resolved,
        (State::Unknown, target),
        op.attempt,
        cmd.actor.clone(),
    )
    .because(cmd.reason.clone())
    .with_details(json!({
        "resolution_id": cmd.resolution_id,
        "provider_ref": next.provider_ref,
        "fencing_token": op.fencing_token.get(),
    }));
    event.dedupe_key = Some(resolution_key(&cmd.resolution_id));
    Ok((target, single(next, event)))
}

/// The same resolution is the same outcome of the same attempt; an id reused for another
/// outcome, or for another attempt (a later one, or one of a later life), is refused.
pub fn retried_resolution(
    cmd: &ResolveCommand,
    prior: PriorResolution,
) -> Result<State, Rejection> {
    let same_attempt = prior
        .fencing_token
        .is_none_or(|token| token == cmd.fencing_token);
    if prior.state == cmd.resolution.target() && same_attempt {
        Ok(prior.state)
    } else {
        Err(Rejection::ResolutionIdReused {
            resolution_id: cmd.resolution_id.clone(),
            state: prior.state,
        })
    }
}

/// The dedupe key of the RESOLVED event a resolution writes, by which a retry finds it.
pub fn resolution_key(resolution_id: &str) -> String {
    format!("RESOLVED:{resolution_id}")
}

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
