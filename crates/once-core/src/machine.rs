//! The operation state machine (SPEC §4) as pure functions.
//!
//! Each function takes what is stored, a command and `now`, and returns the caller's answer and
//! a [`Plan`]: the writes that must commit in one transaction for that answer to be true. A store
//! applies the plan and commits before it lets the answer leave the process.

use serde_json::json;

use crate::identity::provider_key;
use crate::model::*;

/// The writes that make a decision true. Empty when nothing changes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub operation: Option<Write>,
    /// A newly granted attempt, for the attempt log.
    pub attempt: Option<Attempt>,
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
    #[error("attempt {token} lost its execution right: the latest attempt is {latest}")]
    ExecutionRightLost { token: u64, latest: u32 },
    /// The lease this heartbeat tries to extend has already ended.
    #[error("the lease of attempt {token} has ended")]
    LeaseExpired { token: u64 },
    /// The report contradicts the operation's settled truth.
    #[error("the operation is already {state}")]
    AlreadySettled { state: State },
    /// Only UNKNOWN operations can be resolved.
    #[error("only UNKNOWN operations can be resolved; this one is {state}")]
    NotUnknown { state: State },
}

/// The longest retry-after an IN_PROGRESS answer suggests.
const MAX_RETRY_AFTER_MS: i64 = 1_000;
/// The shortest, so callers do not spin.
const MIN_RETRY_AFTER_MS: i64 = 20;

/// Whether this Begin would grant a new execution right and so must first pass the fresh-id
/// guard: the store then looks for a blocking UNKNOWN operation and passes it to [`begin`].
pub fn needs_guard(current: Option<&Operation>, cmd: &BeginCommand, now: Millis) -> bool {
    if cmd.new_intent {
        return false;
    }
    match current {
        None => true,
        Some(op) if op.is_expired(now) => true,
        Some(op) => op.state == State::Absent && op.fingerprint == cmd.fingerprint,
    }
}

/// Decides a Begin. `blocking` is the fresh-id guard's finding, if [`needs_guard`] asked for it.
pub fn begin(
    current: Option<&Operation>,
    cmd: &BeginCommand,
    blocking: Option<&OperationId>,
    now: Millis,
) -> (BeginDecision, Plan) {
    let op = match current {
        Some(op) if !op.is_expired(now) => op,
        _ => {
            if let Some(blocking) = blocking.filter(|_| !cmd.new_intent) {
                return guarded(blocking, now);
            }
            return claim_new_life(current, cmd, now);
        }
    };

    if op.fingerprint != cmd.fingerprint {
        let decision = BeginDecision::Conflict {
            stored: op.fingerprint,
            requested: cmd.fingerprint,
        };
        return (decision, Plan::default());
    }

    match op.state {
        State::Absent => {
            if let Some(blocking) = blocking.filter(|_| !cmd.new_intent) {
                return guarded(blocking, now);
            }
            claim_again(op, cmd, now)
        }
        State::InFlight if now >= op.lease_deadline => {
            let plan = expire_lease(op, now).expect("lease is IN_FLIGHT and past its deadline");
            let expired = plan
                .operation
                .as_ref()
                .expect("expiry writes the operation")
                .operation();
            let decision = BeginDecision::Unknown {
                since: expired.updated_at,
                reason: expired.reason.clone(),
                blocking: None,
            };
            (decision, plan)
        }
        State::InFlight if op.attempt_id == cmd.attempt_id => {
            let grant = Grant {
                attempt: op.attempt,
                fencing_token: op.attempt as u64,
                lease_deadline: op.lease_deadline,
                provider_key: op.provider_key.clone(),
                regranted: true,
            };
            (BeginDecision::Execute(grant), Plan::default())
        }
        State::InFlight => {
            let decision = BeginDecision::InProgress {
                attempt: op.attempt,
                lease_deadline: op.lease_deadline,
                retry_after_ms: (op.lease_deadline - now)
                    .clamp(MIN_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS),
            };
            (decision, Plan::default())
        }
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
                since: op.updated_at,
                reason: op.reason.clone(),
                blocking: None,
            };
            (decision, Plan::default())
        }
    }
}

fn guarded(blocking: &OperationId, now: Millis) -> (BeginDecision, Plan) {
    let decision = BeginDecision::Unknown {
        since: now,
        reason: Some(format!(
            "operation {blocking} with the same tool and arguments is UNKNOWN; declare a new intent to run this one"
        )),
        blocking: Some(blocking.clone()),
    };
    (decision, Plan::default())
}

/// A first claim, or a claim on an id whose previous life ended with retention.
fn claim_new_life(
    previous: Option<&Operation>,
    cmd: &BeginCommand,
    now: Millis,
) -> (BeginDecision, Plan) {
    let attempt = previous.map_or(1, |op| op.attempt + 1);
    let op = Operation {
        tenant: cmd.tenant.clone(),
        operation_id: cmd.operation_id.clone(),
        tool: cmd.tool.clone(),
        fingerprint: cmd.fingerprint,
        state: State::InFlight,
        source: Source::Attempt,
        attempt,
        attempt_id: cmd.attempt_id.clone(),
        lease_started_at: now,
        lease_deadline: now + cmd.lease_ttl_ms,
        result: None,
        provider_ref: None,
        provider_key: provider_key(&cmd.tenant, &cmd.operation_id, now),
        provider: cmd.provider.clone(),
        lookup_hints: cmd.lookup_hints.clone(),
        retention_ms: cmd.retention_ms,
        created_at: now,
        updated_at: now,
        expires_at: None,
        reason: None,
        resolution_id: None,
        reconcile_lookups: 0,
        reconcile_next_at: None,
    };
    let details = previous.map(|p| {
        json!({ "previous_life_expired_at": p.expires_at, "previous_state": p.state.as_str() })
            .to_string()
    });
    let write = if previous.is_some() {
        Write::Update(op)
    } else {
        Write::Insert(op)
    };
    granted(
        previous.map(|p| p.state).unwrap_or(State::Absent),
        write,
        cmd,
        details,
    )
}

/// A new attempt after an ABSENT outcome: same life, same provider key, next fencing token.
fn claim_again(op: &Operation, cmd: &BeginCommand, now: Millis) -> (BeginDecision, Plan) {
    let mut next = op.clone();
    next.state = State::InFlight;
    next.source = Source::Attempt;
    next.attempt = op.attempt + 1;
    next.attempt_id = cmd.attempt_id.clone();
    next.lease_started_at = now;
    next.lease_deadline = now + cmd.lease_ttl_ms;
    next.updated_at = now;
    next.expires_at = None;
    next.reason = None;
    next.resolution_id = None;
    next.reconcile_lookups = 0;
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
    details: Option<String>,
) -> (BeginDecision, Plan) {
    let op = write.operation();
    let grant = Grant {
        attempt: op.attempt,
        fencing_token: op.attempt as u64,
        lease_deadline: op.lease_deadline,
        provider_key: op.provider_key.clone(),
        regranted: false,
    };
    let attempt = Attempt {
        number: op.attempt,
        attempt_id: cmd.attempt_id.clone(),
        started_at: op.lease_started_at,
        lease_deadline: op.lease_deadline,
        actor: cmd.actor.clone(),
        context: cmd.context.clone(),
    };
    let event = NewEvent {
        kind: EventKind::Claimed,
        from: Some(from),
        to: Some(State::InFlight),
        attempt: Some(op.attempt),
        actor: cmd.actor.clone(),
        reason: None,
        details,
        dedupe_key: None,
    };
    let plan = Plan {
        operation: Some(write),
        attempt: Some(attempt),
        events: vec![event],
    };
    (BeginDecision::Execute(grant), plan)
}

/// IN_FLIGHT past its lease becomes UNKNOWN: lease expiry is evidence of nothing. `None` when
/// the operation is not IN_FLIGHT or its lease is still live.
pub fn expire_lease(op: &Operation, now: Millis) -> Option<Plan> {
    if op.state != State::InFlight || now < op.lease_deadline {
        return None;
    }
    let reason = format!("the lease of attempt {} ended with no report", op.attempt);
    let mut next = op.clone();
    next.state = State::Unknown;
    next.source = Source::Lease;
    next.updated_at = now;
    next.reason = Some(reason.clone());
    schedule_lookups(&mut next, now);
    Some(Plan {
        operation: Some(Write::Update(next)),
        attempt: None,
        events: vec![NewEvent {
            kind: EventKind::LeaseExpired,
            from: Some(State::InFlight),
            to: Some(State::Unknown),
            attempt: Some(op.attempt),
            actor: "ledger".to_owned(),
            reason: Some(reason),
            details: Some(json!({ "lease_deadline": op.lease_deadline }).to_string()),
            dedupe_key: None,
        }],
    })
}

/// An operation entering UNKNOWN with a reconciler is due for a lookup at once; one leaving
/// UNKNOWN is due for none.
fn schedule_lookups(next: &mut Operation, now: Millis) {
    next.reconcile_next_at = match next.state {
        State::Unknown if next.provider.is_some() => Some(next.reconcile_next_at.unwrap_or(now)),
        _ => None,
    };
}

/// Applies a report from the attempt holding `cmd.fencing_token`. On success returns the state
/// the operation is in afterwards.
pub fn report(
    op: &Operation,
    cmd: &ReportCommand,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    let token = cmd.fencing_token;
    if token != op.attempt as u64 {
        let mut plan = Plan::default();
        let superseded = token >= 1 && token < op.attempt as u64;
        if superseded && matches!(cmd.report, Report::Confirm { .. }) {
            plan.events.push(NewEvent {
                kind: EventKind::DoubleExecution,
                from: None,
                to: None,
                attempt: Some(token as u32),
                actor: cmd.actor.clone(),
                reason: Some(format!(
                    "attempt {token} confirmed its effect after attempt {} was granted the execution right",
                    op.attempt
                )),
                details: Some(json!({ "stale_attempt": token, "latest_attempt": op.attempt, "state": op.state.as_str() }).to_string()),
                dedupe_key: Some(format!("DOUBLE_EXECUTION:{token}")),
            });
        }
        return (
            Err(Rejection::ExecutionRightLost {
                token,
                latest: op.attempt,
            }),
            plan,
        );
    }

    let target = cmd.report.target();
    match (op.state, &cmd.report) {
        // The report of the attempt in flight, or a late one after its lease ran out.
        (State::InFlight, _) | (State::Unknown, Report::Confirm { .. } | Report::Absent { .. }) => {
            (Ok(target), settle_by_attempt(op, cmd, now))
        }
        // Reports are idempotent: the same report again changes nothing.
        (State::Unknown, Report::Unknown { .. }) => (Ok(State::Unknown), Plan::default()),
        (
            State::Confirmed,
            Report::Confirm {
                result,
                provider_ref,
            },
        ) => {
            if op.result.as_ref() == Some(result) && op.provider_ref == *provider_ref {
                (Ok(State::Confirmed), Plan::default())
            } else {
                (
                    Err(Rejection::AlreadySettled { state: op.state }),
                    Plan::default(),
                )
            }
        }
        (State::Absent, Report::Absent { .. }) => (Ok(State::Absent), Plan::default()),
        // An UNKNOWN report adds nothing to a settled truth.
        (State::Confirmed | State::Absent, Report::Unknown { .. }) => {
            (Ok(op.state), Plan::default())
        }
        // A genuine confirm after someone other than this attempt said ABSENT: the effect did
        // happen. Record the truth, and the contradiction as an anomaly.
        (State::Absent, Report::Confirm { .. }) if op.source != Source::Attempt => {
            let mut plan = settle_by_attempt(op, cmd, now);
            plan.events.push(NewEvent {
                kind: EventKind::ResolutionContradicted,
                from: None,
                to: None,
                attempt: Some(op.attempt),
                actor: cmd.actor.clone(),
                reason: Some(format!(
                    "attempt {} confirmed its effect after a {} said ABSENT",
                    op.attempt,
                    op.source.as_str()
                )),
                details: None,
                dedupe_key: Some(format!("RESOLUTION_CONTRADICTED:{}", op.attempt)),
            });
            (Ok(State::Confirmed), plan)
        }
        (State::Absent | State::Confirmed, _) => (
            Err(Rejection::AlreadySettled { state: op.state }),
            Plan::default(),
        ),
    }
}

fn settle_by_attempt(op: &Operation, cmd: &ReportCommand, now: Millis) -> Plan {
    let mut next = op.clone();
    next.source = Source::Attempt;
    next.updated_at = now;
    let (kind, reason) = match &cmd.report {
        Report::Confirm {
            result,
            provider_ref,
        } => {
            next.result = Some(result.clone());
            next.provider_ref = provider_ref.clone();
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
    next.state = cmd.report.target();
    next.expires_at = next.state.is_settled().then(|| now + next.retention_ms);
    schedule_lookups(&mut next, now);
    let late = op.state != State::InFlight || now >= op.lease_deadline;
    let details =
        late.then(|| json!({ "late": true, "previous_source": op.source.as_str() }).to_string());
    Plan {
        operation: Some(Write::Update(next)),
        attempt: None,
        events: vec![NewEvent {
            kind,
            from: Some(op.state),
            to: Some(cmd.report.target()),
            attempt: Some(op.attempt),
            actor: cmd.actor.clone(),
            reason,
            details,
            dedupe_key: None,
        }],
    }
}

/// Extends the live lease of the latest attempt to `now + ttl` (never shortens it). Returns the
/// new deadline.
pub fn heartbeat(
    op: &Operation,
    fencing_token: u64,
    ttl_ms: i64,
    now: Millis,
) -> Result<(Millis, Plan), Rejection> {
    if fencing_token != op.attempt as u64 {
        return Err(Rejection::ExecutionRightLost {
            token: fencing_token,
            latest: op.attempt,
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

/// Applies an operator's resolution to an UNKNOWN operation. A retry of a resolution that
/// already took effect gets the same answer.
pub fn resolve(
    op: &Operation,
    cmd: &ResolveCommand,
    now: Millis,
) -> Result<(State, Plan), Rejection> {
    let target = match cmd.resolution {
        Resolution::Confirmed { .. } => State::Confirmed,
        Resolution::Absent => State::Absent,
    };
    if op.state != State::Unknown {
        if op.resolution_id.as_deref() == Some(cmd.resolution_id.as_str()) && op.state == target {
            return Ok((target, Plan::default()));
        }
        return Err(Rejection::NotUnknown { state: op.state });
    }
    let mut next = op.clone();
    next.state = target;
    next.source = Source::Operator;
    next.updated_at = now;
    next.reason = Some(cmd.reason.clone());
    next.resolution_id = Some(cmd.resolution_id.clone());
    next.expires_at = Some(now + op.retention_ms);
    next.reconcile_next_at = None;
    if let Resolution::Confirmed {
        result,
        provider_ref,
    } = &cmd.resolution
    {
        next.result = Some(result.clone());
        next.provider_ref = provider_ref.clone();
    }
    let event = NewEvent {
        kind: EventKind::Resolved,
        from: Some(State::Unknown),
        to: Some(target),
        attempt: Some(op.attempt),
        actor: cmd.actor.clone(),
        reason: Some(cmd.reason.clone()),
        details: Some(
            json!({ "resolution_id": cmd.resolution_id, "provider_ref": next.provider_ref })
                .to_string(),
        ),
        dedupe_key: None,
    };
    Ok((
        target,
        Plan {
            operation: Some(Write::Update(next)),
            attempt: None,
            events: vec![event],
        },
    ))
}

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
