//! The decision table and report rules on a clock the test owns: every time is an argument.

use super::*;
use crate::identity::Fingerprint;

const T0: Millis = 1_000_000;
const LEASE: i64 = 30_000;
const RETENTION: i64 = 600_000;

fn fp(byte: u8) -> Fingerprint {
    Fingerprint([byte; 32])
}

fn cmd(attempt_id: &str) -> BeginCommand {
    BeginCommand {
        tenant: "t".into(),
        operation_id: OperationId::parse("id", "refund:o1").unwrap(),
        tool: "refund".into(),
        fingerprint: fp(1),
        attempt_id: attempt_id.into(),
        context: AttemptContext::default(),
        lease_ttl_ms: LEASE,
        retention_ms: RETENTION,
        new_intent: false,
        provider: None,
        lookup_hints: None,
        actor: "executor:test".into(),
    }
}

/// The operation after a first claim by attempt `a1` at `T0`.
fn claimed() -> Operation {
    let (_, plan) = begin(None, &cmd("a1"), None, T0);
    plan.operation.unwrap().operation().clone()
}

fn report_by(
    op: &Operation,
    token: u64,
    report: Report,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    super::report(
        op,
        &ReportCommand {
            fencing_token: token,
            report,
            actor: "executor:test".into(),
        },
        now,
    )
}

fn confirmed(op: &Operation, now: Millis) -> Operation {
    let (_, plan) = report_by(
        op,
        op.attempt as u64,
        Report::Confirm {
            result: b"r".to_vec(),
            provider_ref: None,
        },
        now,
    );
    plan.operation.unwrap().operation().clone()
}

fn with_state(op: &Operation, report: Report, now: Millis) -> Operation {
    let (_, plan) = report_by(op, op.attempt as u64, report, now);
    plan.operation.unwrap().operation().clone()
}

fn absent() -> Report {
    Report::Absent {
        reason: "declined".into(),
    }
}

fn unknown() -> Report {
    Report::Unknown {
        reason: "timeout".into(),
    }
}

/// One row: what is stored, who asks and when, and what they must get.
fn check(
    stored: Option<&Operation>,
    command: &BeginCommand,
    now: Millis,
    decision: &str,
    state_after: Option<State>,
) {
    let (got, plan) = begin(stored, command, None, now);
    assert_eq!(
        got.name(),
        decision,
        "stored {:?} at {now}: {got:?}",
        stored.map(|o| o.state)
    );
    let after = plan
        .operation
        .as_ref()
        .map(|w| w.operation().state)
        .or(stored.map(|o| o.state));
    assert_eq!(after, state_after, "state after {decision}");
    // Every written transition carries exactly one event.
    if plan
        .operation
        .as_ref()
        .is_some_and(|w| Some(w.operation().state) != stored.map(|o| o.state))
    {
        assert_eq!(plan.events.len(), 1, "{plan:?}");
    }
}

#[test]
fn decision_table() {
    let in_flight = claimed();
    let done = confirmed(&in_flight, T0 + 10);
    let gone = with_state(&in_flight, absent(), T0 + 10);
    let unsure = with_state(&in_flight, unknown(), T0 + 10);
    let mut other_args = cmd("a2");
    other_args.fingerprint = fp(2);

    check(None, &cmd("a1"), T0, "EXECUTE", Some(State::InFlight));
    check(
        Some(&gone),
        &cmd("a2"),
        T0 + 20,
        "EXECUTE",
        Some(State::InFlight),
    );
    check(
        Some(&done),
        &cmd("a2"),
        T0 + 10 + RETENTION,
        "EXECUTE",
        Some(State::InFlight),
    );
    check(
        Some(&gone),
        &other_args,
        T0 + 10 + RETENTION,
        "EXECUTE",
        Some(State::InFlight),
    );
    check(
        Some(&in_flight),
        &cmd("a1"),
        T0 + 1,
        "EXECUTE",
        Some(State::InFlight),
    );
    check(
        Some(&in_flight),
        &cmd("a2"),
        T0 + 1,
        "IN_PROGRESS",
        Some(State::InFlight),
    );
    check(
        Some(&in_flight),
        &cmd("a2"),
        T0 + LEASE - 1,
        "IN_PROGRESS",
        Some(State::InFlight),
    );
    check(
        Some(&in_flight),
        &cmd("a2"),
        T0 + LEASE,
        "UNKNOWN",
        Some(State::Unknown),
    );
    check(
        Some(&in_flight),
        &cmd("a1"),
        T0 + LEASE,
        "UNKNOWN",
        Some(State::Unknown),
    );
    check(
        Some(&done),
        &cmd("a2"),
        T0 + 10 + RETENTION - 1,
        "REPLAY",
        Some(State::Confirmed),
    );
    check(
        Some(&unsure),
        &cmd("a2"),
        T0 + 100 * RETENTION,
        "UNKNOWN",
        Some(State::Unknown),
    );
    for stored in [&in_flight, &done, &gone, &unsure] {
        check(
            Some(stored),
            &other_args,
            T0 + 20,
            "CONFLICT",
            Some(stored.state),
        );
    }
}

#[test]
fn same_attempt_gets_the_same_grant_and_a_new_life_a_new_provider_key() {
    let in_flight = claimed();
    let (BeginDecision::Execute(first), _) = begin(None, &cmd("a1"), None, T0) else {
        panic!()
    };
    let (BeginDecision::Execute(again), plan) = begin(Some(&in_flight), &cmd("a1"), None, T0 + 5)
    else {
        panic!()
    };
    assert!(plan.is_empty());
    assert!(again.regranted);
    assert_eq!(
        (again.fencing_token, again.lease_deadline),
        (first.fencing_token, first.lease_deadline)
    );

    let done = confirmed(&in_flight, T0 + 10);
    let (BeginDecision::Execute(reborn), _) =
        begin(Some(&done), &cmd("a2"), None, T0 + 10 + RETENTION)
    else {
        panic!()
    };
    assert_eq!(
        reborn.attempt, 2,
        "tokens keep growing while the row exists"
    );
    assert_ne!(reborn.provider_key, first.provider_key);

    let gone = with_state(&in_flight, absent(), T0 + 10);
    let (BeginDecision::Execute(retry), _) = begin(Some(&gone), &cmd("a2"), None, T0 + 20) else {
        panic!()
    };
    assert_eq!(
        retry.provider_key, first.provider_key,
        "one life, one provider key"
    );
}

#[test]
fn fresh_id_guard_blocks_new_executions_unless_a_new_intent_is_declared() {
    let blocking = OperationId::parse("id", "refund:other").unwrap();
    assert!(needs_guard(None, &cmd("a1"), T0));
    let (decision, plan) = begin(None, &cmd("a1"), Some(&blocking), T0);
    assert!(plan.is_empty());
    assert!(
        matches!(decision, BeginDecision::Unknown { blocking: Some(ref b), .. } if *b == blocking)
    );

    let mut declared = cmd("a1");
    declared.new_intent = true;
    assert!(!needs_guard(None, &declared, T0));
    assert_eq!(
        begin(None, &declared, Some(&blocking), T0).0.name(),
        "EXECUTE"
    );

    // Replays, IN_PROGRESS and the like never need the guard.
    assert!(!needs_guard(Some(&claimed()), &cmd("a2"), T0 + 1));
}

#[test]
fn reports_from_the_holder_settle_and_are_idempotent() {
    let in_flight = claimed();
    let confirm = Report::Confirm {
        result: b"r".to_vec(),
        provider_ref: None,
    };
    for (report, state) in [
        (confirm.clone(), State::Confirmed),
        (absent(), State::Absent),
        (unknown(), State::Unknown),
    ] {
        let (outcome, plan) = report_by(&in_flight, 1, report.clone(), T0 + 5);
        assert_eq!(outcome, Ok(state));
        let settled = plan.operation.unwrap().operation().clone();
        assert_eq!(
            settled.expires_at,
            state.is_settled().then_some(T0 + 5 + RETENTION)
        );
        let (again, plan) = report_by(&settled, 1, report, T0 + 6);
        assert_eq!(
            again,
            Ok(state),
            "the same report twice gets the same answer"
        );
        assert!(plan.is_empty());
    }
}

#[test]
fn late_reports_are_accepted_after_the_lease_ran_out() {
    let in_flight = claimed();
    let plan = expire_lease(&in_flight, T0 + LEASE).unwrap();
    let expired = plan.operation.unwrap().operation().clone();
    assert_eq!(
        (expired.state, expired.source),
        (State::Unknown, Source::Lease)
    );
    assert!(expire_lease(&in_flight, T0 + LEASE - 1).is_none());

    let (outcome, plan) = report_by(
        &expired,
        1,
        Report::Confirm {
            result: b"r".to_vec(),
            provider_ref: None,
        },
        T0 + LEASE + 1,
    );
    assert_eq!(outcome, Ok(State::Confirmed));
    assert!(plan.events[0]
        .details
        .as_deref()
        .unwrap()
        .contains("\"late\":true"));
}

#[test]
fn stale_reports_change_nothing_and_a_stale_confirm_is_a_double_execution() {
    let in_flight = claimed();
    let gone = with_state(&in_flight, absent(), T0 + 10);
    let (BeginDecision::Execute(_), plan) = begin(Some(&gone), &cmd("a2"), None, T0 + 20) else {
        panic!()
    };
    let second = plan.operation.unwrap().operation().clone();

    for report in [absent(), unknown()] {
        let (outcome, plan) = report_by(&second, 1, report, T0 + 30);
        assert_eq!(
            outcome,
            Err(Rejection::ExecutionRightLost {
                token: 1,
                latest: 2
            })
        );
        assert!(plan.is_empty());
    }
    let (outcome, plan) = report_by(
        &second,
        1,
        Report::Confirm {
            result: b"r".to_vec(),
            provider_ref: None,
        },
        T0 + 30,
    );
    assert!(outcome.is_err());
    assert!(plan.operation.is_none(), "state never changes");
    assert_eq!(plan.events.len(), 1);
    assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
    assert_eq!(
        plan.events[0].dedupe_key.as_deref(),
        Some("DOUBLE_EXECUTION:1")
    );

    // A token from the future is stale too, and no anomaly.
    let (outcome, plan) = report_by(
        &second,
        9,
        Report::Confirm {
            result: b"r".to_vec(),
            provider_ref: None,
        },
        T0 + 30,
    );
    assert!(outcome.is_err() && plan.is_empty());
}

#[test]
fn contradicting_reports_are_refused() {
    let in_flight = claimed();
    let done = confirmed(&in_flight, T0 + 10);
    let (outcome, _) = report_by(
        &done,
        1,
        Report::Confirm {
            result: b"other".to_vec(),
            provider_ref: None,
        },
        T0 + 11,
    );
    assert_eq!(
        outcome,
        Err(Rejection::AlreadySettled {
            state: State::Confirmed
        })
    );
    let (outcome, _) = report_by(&done, 1, absent(), T0 + 11);
    assert_eq!(
        outcome,
        Err(Rejection::AlreadySettled {
            state: State::Confirmed
        })
    );
    let gone = with_state(&in_flight, absent(), T0 + 10);
    let (outcome, _) = report_by(
        &gone,
        1,
        Report::Confirm {
            result: b"r".to_vec(),
            provider_ref: None,
        },
        T0 + 11,
    );
    assert_eq!(
        outcome,
        Err(Rejection::AlreadySettled {
            state: State::Absent
        }),
        "the attempt itself said ABSENT"
    );
}

#[test]
fn heartbeats_extend_only_a_live_lease_and_never_shorten_it() {
    let in_flight = claimed();
    let (deadline, plan) = heartbeat(&in_flight, 1, LEASE, T0 + 1000).unwrap();
    assert_eq!(deadline, T0 + 1000 + LEASE);
    assert!(!plan.is_empty());
    let (deadline, plan) = heartbeat(&in_flight, 1, 10, T0 + 1000).unwrap();
    assert_eq!(deadline, in_flight.lease_deadline);
    assert!(plan.is_empty());
    assert_eq!(
        heartbeat(&in_flight, 1, LEASE, T0 + LEASE).unwrap_err(),
        Rejection::LeaseExpired { token: 1 }
    );
    assert!(matches!(
        heartbeat(&in_flight, 2, LEASE, T0 + 1),
        Err(Rejection::ExecutionRightLost { .. })
    ));
}

#[test]
fn resolutions_apply_to_unknown_only_and_are_idempotent() {
    let in_flight = claimed();
    let unsure = with_state(&in_flight, unknown(), T0 + 10);
    let resolve_absent = ResolveCommand {
        resolution: Resolution::Absent,
        reason: "provider has no record".into(),
        actor: "operator:alice".into(),
        resolution_id: "r1".into(),
    };
    let (state, plan) = resolve(&unsure, &resolve_absent, T0 + 20).unwrap();
    assert_eq!(state, State::Absent);
    let resolved = plan.operation.unwrap().operation().clone();
    assert_eq!(
        (resolved.source, resolved.expires_at),
        (Source::Operator, Some(T0 + 20 + RETENTION))
    );
    assert_eq!(plan.events[0].actor, "operator:alice");

    let (again, plan) = resolve(&resolved, &resolve_absent, T0 + 30).unwrap();
    assert_eq!(again, State::Absent);
    assert!(plan.is_empty());
    let other = ResolveCommand {
        resolution_id: "r2".into(),
        ..resolve_absent.clone()
    };
    assert_eq!(
        resolve(&resolved, &other, T0 + 30).unwrap_err(),
        Rejection::NotUnknown {
            state: State::Absent
        }
    );
    assert!(resolve(&in_flight, &resolve_absent, T0 + 30).is_err());
}
