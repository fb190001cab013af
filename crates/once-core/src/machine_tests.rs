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
        actor: Actor::Executor("test".into()),
        holder: holder(HOLDER),
        held: false,
    }
}

/// The key id of the credential the tests' attempts are granted to.
const HOLDER: &str = "k1";

fn holder(key_id: &str) -> Holder {
    Some(key_id.to_owned())
}

/// A heartbeat from the tests' credential.
fn beat(
    op: &Operation,
    token: FencingToken,
    ttl_ms: i64,
    now: Millis,
) -> Result<(Millis, Plan), Rejection> {
    let cmd = HeartbeatCommand {
        fencing_token: token,
        holder: holder(HOLDER),
        ttl_ms,
    };
    heartbeat(op, &cmd, now)
}

/// The first fencing token the tests' store hands out; later ones are larger.
const TOKEN: FencingToken = FencingToken(1_000);

/// A Begin through both steps, with `token` as the store's next fencing token and nothing
/// blocking.
fn begin_with(
    stored: Option<&Operation>,
    command: &BeginCommand,
    token: FencingToken,
    now: Millis,
) -> (BeginDecision, Plan) {
    match begin(stored, command, now) {
        BeginStep::Decided(decision, plan) => (decision, plan),
        BeginStep::Claim => claim(stored, command, FreshIdGuard::Clear { token }, now),
    }
}

fn written(plan: &Plan) -> Operation {
    plan.operation.as_ref().unwrap().operation().clone()
}

/// The operation after a first claim by attempt `a1` at `T0`.
fn claimed() -> Operation {
    let (_, plan) = begin_with(None, &cmd("a1"), TOKEN, T0);
    written(&plan)
}

/// The attempt log's record of the first claim.
fn first_attempt() -> Attempt {
    let (_, plan) = begin_with(None, &cmd("a1"), TOKEN, T0);
    plan.attempt.unwrap()
}

fn report_by(
    op: &Operation,
    token: FencingToken,
    report: Report,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    report_from(op, token, None, report, now)
}

fn report_from(
    op: &Operation,
    token: FencingToken,
    earlier: Option<&Attempt>,
    report: Report,
    now: Millis,
) -> (Result<State, Rejection>, Plan) {
    super::report(
        op,
        &ReportCommand {
            fencing_token: token,
            holder: holder(HOLDER),
            report,
        },
        earlier,
        now,
    )
}

fn confirm_report(result: &[u8], provider_ref: Option<&str>) -> Report {
    Report::Confirm {
        result: result.to_vec(),
        provider_ref: provider_ref.map(str::to_owned),
    }
}

fn confirmed(op: &Operation, now: Millis) -> Operation {
    let (_, plan) = report_by(op, op.fencing_token, confirm_report(b"r", None), now);
    written(&plan)
}

fn with_state(op: &Operation, report: Report, now: Millis) -> Operation {
    let (_, plan) = report_by(op, op.fencing_token, report, now);
    written(&plan)
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

/// A resolution by an operator who examined the attempt holding `fencing_token`.
fn resolution(resolution: Resolution, fencing_token: FencingToken, id: &str) -> ResolveCommand {
    ResolveCommand {
        resolution,
        reason: "checked the provider".into(),
        actor: Actor::Operator("alice".into()),
        resolution_id: id.into(),
        fencing_token,
        attempt: None,
    }
}

/// Attempt 1 went UNKNOWN and an operator said ABSENT; attempt 2 (token `TOKEN + 1`) holds the
/// execution right at `T0 + 30`.
fn second_attempt_after_absent_resolution() -> Operation {
    let unsure = with_state(&claimed(), unknown(), T0 + 10);
    let (_, plan) = resolve(
        &unsure,
        &resolution(Resolution::Absent, TOKEN, "r-1"),
        None,
        T0 + 20,
    )
    .unwrap();
    let (_, plan) = begin_with(Some(&written(&plan)), &cmd("a2"), TOKEN + 1, T0 + 30);
    written(&plan)
}

/// One row: what is stored, who asks and when, and what they must get.
fn check(
    stored: Option<&Operation>,
    command: &BeginCommand,
    now: Millis,
    decision: &str,
    state_after: Option<State>,
) {
    let (got, plan) = begin_with(stored, command, TOKEN + 7, now);
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

/// A life that ended ABSENT hands its provider key to the next life of the same intent, so a
/// stalled attempt of the old life is deduplicated by the provider; a life that ended
/// CONFIRMED, or another intent under the id, gets a key of its own.
#[test]
fn a_life_that_ended_absent_hands_its_provider_key_to_the_next() {
    let in_flight = claimed();
    let after = T0 + 10 + RETENTION;
    let gone = with_state(&in_flight, absent(), T0 + 10);
    let (BeginDecision::Execute(next), plan) =
        begin_with(Some(&gone), &cmd("a2"), TOKEN + 50, after)
    else {
        panic!()
    };
    assert!(
        !plan.forgets_attempts,
        "the old life's attempts stay with its key"
    );
    assert_eq!((next.attempt, next.fencing_token), (1, TOKEN + 50));
    assert_eq!(next.provider_key, in_flight.provider_key);

    let mut other_intent = cmd("a2");
    other_intent.fingerprint = fp(9);
    let (BeginDecision::Execute(other), plan) =
        begin_with(Some(&gone), &other_intent, TOKEN + 51, after)
    else {
        panic!()
    };
    assert_ne!(other.provider_key, in_flight.provider_key);
    assert!(plan.forgets_attempts);

    let done = confirmed(&in_flight, T0 + 10);
    let (BeginDecision::Execute(reborn), plan) =
        begin_with(Some(&done), &cmd("a2"), TOKEN + 52, after)
    else {
        panic!()
    };
    assert_ne!(reborn.provider_key, in_flight.provider_key);
    assert!(plan.forgets_attempts);
}

#[test]
fn same_attempt_gets_the_same_grant_and_a_new_life_a_new_token_and_provider_key() {
    let in_flight = claimed();
    let (BeginDecision::Execute(first), _) = begin_with(None, &cmd("a1"), TOKEN, T0) else {
        panic!()
    };
    assert_eq!((first.attempt, first.fencing_token), (1, TOKEN));
    let BeginStep::Decided(BeginDecision::Execute(again), plan) =
        begin(Some(&in_flight), &cmd("a1"), T0 + 5)
    else {
        panic!("a retried Begin is answered from the row")
    };
    assert!(plan.is_empty());
    assert!(again.regranted);
    assert_eq!(
        (again.fencing_token, again.lease_deadline),
        (first.fencing_token, first.lease_deadline)
    );

    // The same attempt id from another session is another attempt.
    let mut elsewhere = cmd("a1");
    elsewhere.context.session_id = Some("other-session".into());
    let BeginStep::Decided(decision, _) = begin(Some(&in_flight), &elsewhere, T0 + 5) else {
        panic!()
    };
    assert_eq!(decision.name(), "IN_PROGRESS");

    let done = confirmed(&in_flight, T0 + 10);
    let (BeginDecision::Execute(reborn), plan) =
        begin_with(Some(&done), &cmd("a2"), TOKEN + 50, T0 + 10 + RETENTION)
    else {
        panic!()
    };
    assert_eq!((reborn.attempt, reborn.fencing_token), (1, TOKEN + 50));
    assert!(
        plan.forgets_attempts,
        "the previous life's attempt log goes"
    );
    assert_eq!(written(&plan).life, TOKEN + 50);
    assert_ne!(reborn.provider_key, first.provider_key);

    let gone = with_state(&in_flight, absent(), T0 + 10);
    let (BeginDecision::Execute(retry), plan) =
        begin_with(Some(&gone), &cmd("a2"), TOKEN + 3, T0 + 20)
    else {
        panic!()
    };
    assert_eq!((retry.attempt, retry.fencing_token), (2, TOKEN + 3));
    assert!(!plan.forgets_attempts);
    assert_eq!(written(&plan).life, TOKEN, "one life");
    assert_eq!(
        retry.provider_key, first.provider_key,
        "one life, one provider key"
    );
}

#[test]
fn fresh_id_guard_blocks_new_executions_unless_a_new_intent_is_declared() {
    let other = OperationId::parse("id", "refund:other").unwrap();
    let blocking = |state, lease_deadline| Blocking {
        operation_id: other.clone(),
        state,
        attempt: 1,
        lease_deadline,
        updated_at: T0 - 5,
    };
    assert_eq!(begin(None, &cmd("a1"), T0), BeginStep::Claim);

    let (decision, plan) = claim(
        None,
        &cmd("a1"),
        FreshIdGuard::Blocked(blocking(State::Unknown, T0 - 10)),
        T0,
    );
    assert!(plan.is_empty());
    assert!(
        matches!(decision, BeginDecision::Unknown { blocking: Some(ref b), .. } if *b == other)
    );
    // Still running: IN_PROGRESS, naming it.
    let (decision, _) = claim(
        None,
        &cmd("a1"),
        FreshIdGuard::Blocked(blocking(State::InFlight, T0 + 10)),
        T0,
    );
    assert!(
        matches!(decision, BeginDecision::InProgress { blocking: Some(ref b), .. } if *b == other),
        "{decision:?}"
    );
    // Past its lease it is UNKNOWN, whether or not a sweeper has said so.
    let (decision, _) = claim(
        None,
        &cmd("a1"),
        FreshIdGuard::Blocked(blocking(State::InFlight, T0)),
        T0,
    );
    assert!(
        matches!(decision, BeginDecision::Unknown { blocking: Some(ref b), .. } if *b == other),
        "{decision:?}"
    );

    // Replays, IN_PROGRESS and the like never reach the guard.
    let BeginStep::Decided(decision, _) = begin(Some(&claimed()), &cmd("a2"), T0 + 1) else {
        panic!()
    };
    assert_eq!(decision.name(), "IN_PROGRESS");
}

#[test]
fn reports_from_the_holder_settle_and_are_idempotent() {
    let in_flight = claimed();
    for (report, state) in [
        (confirm_report(b"r", None), State::Confirmed),
        (absent(), State::Absent),
        (unknown(), State::Unknown),
    ] {
        let (outcome, plan) = report_by(&in_flight, TOKEN, report.clone(), T0 + 5);
        assert_eq!(outcome, Ok(state));
        assert_eq!(
            plan.events[0].actor.to_string(),
            "executor:test",
            "the attempt's executor"
        );
        let settled = written(&plan);
        assert_eq!(
            settled.expires_at,
            state.is_settled().then_some(T0 + 5 + RETENTION)
        );
        let (again, plan) = report_by(&settled, TOKEN, report, T0 + 6);
        assert_eq!(
            again,
            Ok(state),
            "the same report twice gets the same answer"
        );
        assert!(plan.events.is_empty(), "and records no second transition");
        if state == State::Unknown {
            assert_eq!(
                written(&plan).last_report_at,
                Some(T0 + 6),
                "a repeated UNKNOWN report moves the effect horizon"
            );
        } else {
            assert!(plan.is_empty());
        }
    }
}

#[test]
fn late_reports_are_accepted_after_the_lease_ran_out() {
    let in_flight = claimed();
    let plan = expire_lease(&in_flight, T0 + LEASE).unwrap();
    let expired = written(&plan);
    assert_eq!(
        (expired.state, expired.source, expired.unknown_since),
        (State::Unknown, Source::Lease, Some(T0 + LEASE))
    );
    assert!(expire_lease(&in_flight, T0 + LEASE - 1).is_none());

    let (outcome, plan) = report_by(&expired, TOKEN, confirm_report(b"r", None), T0 + LEASE + 1);
    assert_eq!(outcome, Ok(State::Confirmed));
    assert!(plan.events[0]
        .details
        .as_deref()
        .unwrap()
        .contains("\"late\":true"));
}

#[test]
fn reports_from_another_life_or_no_attempt_change_nothing() {
    let in_flight = claimed();
    let lost = |token| {
        Err(Rejection::ExecutionRightLost {
            token,
            latest_attempt: 1,
            latest_token: TOKEN,
        })
    };
    // An earlier life's token, a token never issued, and one the attempt log does not know.
    assert!(!needs_attempt_record(&in_flight, TOKEN + 1), "never issued");
    for token in [TOKEN - 1, TOKEN + 1, FencingToken(1)] {
        for report in [confirm_report(b"x", None), absent(), unknown()] {
            let (outcome, plan) = report_by(&in_flight, token, report, T0 + 5);
            assert_eq!(outcome, lost(token));
            assert!(plan.is_empty());
        }
    }
    // A new life after a CONFIRMED one: the previous life's attempts go with its key, so the
    // store has no record of its token, and its report is refused, never applied.
    let done = confirmed(&in_flight, T0 + 10);
    let (_, plan) = begin_with(Some(&done), &cmd("a2"), TOKEN + 9, T0 + 10 + RETENTION);
    assert!(plan.forgets_attempts);
    let reborn = written(&plan);
    assert!(needs_attempt_record(&reborn, TOKEN));
    let (outcome, plan) = report_by(
        &reborn,
        TOKEN,
        confirm_report(b"old", None),
        T0 + 11 + RETENTION,
    );
    assert!(matches!(
        outcome,
        Err(Rejection::ExecutionRightLost { token: TOKEN, .. })
    ));
    assert!(plan.is_empty());
}

/// A stalled attempt of a life that ended ABSENT, and handed its provider key to the next
/// life, confirms late: its effect is under this life's key, so it is judged as a superseded
/// attempt of this life would be, and the anomaly is recorded in the life it belongs to.
#[test]
fn a_report_for_an_earlier_life_is_recorded_in_it() {
    let stalled = first_attempt();
    let ended = with_state(&claimed(), absent(), T0 + 10);
    let after = T0 + 10 + RETENTION;
    let (_, plan) = begin_with(Some(&ended), &cmd("a2"), TOKEN + 9, after);
    assert!(!plan.forgets_attempts);
    let next = written(&plan);
    assert!(needs_attempt_record(&next, TOKEN));
    let late = |op: &Operation, report: Report| {
        let (outcome, plan) = report_from(op, TOKEN, Some(&stalled), report, after + 5);
        assert!(
            matches!(
                outcome,
                Err(Rejection::ExecutionRightLost { token: TOKEN, .. })
            ),
            "{outcome:?}"
        );
        plan
    };
    let kinds = |plan: &Plan| -> Vec<(EventKind, FencingToken)> {
        plan.events.iter().map(|e| (e.kind, e.life)).collect()
    };
    // Every anomaly of the late token is recorded once, whatever kind it turns out to be.
    let late_key = Some(format!("EARLIER_LIFE:{TOKEN}"));

    // This life confirmed the same provider object: one effect; the earlier life's ABSENT
    // was wrong, and that is recorded in it.
    let same = with_state(&next, confirm_report(b"r", Some("re_1")), after + 1);
    let plan = late(&same, confirm_report(b"r", Some("re_1")));
    assert!(plan.operation.is_none());
    assert_eq!(kinds(&plan), [(EventKind::ResolutionContradicted, TOKEN)]);
    assert_eq!(plan.events[0].dedupe_key, late_key);
    let details = plan.events[0].details.as_deref().unwrap();
    assert!(details.contains("\"current_life\":1009"), "{details}");
    // Another provider object: the effect may have happened twice.
    let plan = late(&same, confirm_report(b"r", Some("re_2")));
    assert_eq!(kinds(&plan), [(EventKind::DoubleExecution, TOKEN)]);
    assert_eq!(plan.events[0].dedupe_key, late_key);

    // This life's attempt is running: held for an operator with the proven effect. The
    // anomaly records this life's move, so it is this life's, naming the earlier one.
    let plan = late(&next, confirm_report(b"r", Some("re_1")));
    let held = written(&plan);
    assert!(held.held_for_operator(), "{held:?}");
    assert_eq!(held.confirmed_by, Some(TOKEN));
    assert_eq!(kinds(&plan), [(EventKind::DoubleExecution, TOKEN + 9)]);
    assert_eq!(
        (plan.events[0].from, plan.events[0].to),
        (Some(State::InFlight), Some(State::Unknown))
    );
    assert_eq!(plan.events[0].dedupe_key, late_key);
    let details = plan.events[0].details.as_deref().unwrap();
    assert!(details.contains("\"life\":1000"), "{details}");
    // Its retry finds its confirm on record and changes nothing.
    assert!(late(&held, confirm_report(b"r", Some("re_1"))).is_empty());
    // An operator settles the hold CONFIRMED; a retry then names the object on record, and
    // what it would record has the key already used: nothing is recorded twice.
    let settle = resolution(
        Resolution::Confirmed {
            result: b"r".to_vec(),
            provider_ref: Some("re_1".into()),
        },
        held.fencing_token,
        "r-held",
    );
    let (_, plan) = resolve(&held, &settle, None, after + 6).unwrap();
    let resolved = written(&plan);
    assert_eq!(resolved.state, State::Confirmed);
    let retried = late(&resolved, confirm_report(b"r", Some("re_1")));
    assert!(retried.operation.is_none());
    assert_eq!(retried.events.len(), 1);
    assert_eq!(retried.events[0].dedupe_key, late_key);

    // This life's attempt said by itself that it did nothing: the effect happened once, the
    // earlier attempt's, and this life replays it from now on.
    let nothing = with_state(&next, absent(), after + 1);
    let plan = late(&nothing, confirm_report(b"r", Some("re_1")));
    let settled = written(&plan);
    assert_eq!(settled.state, State::Confirmed);
    assert_eq!(settled.result.as_deref(), Some(&b"r"[..]));
    assert_eq!(
        kinds(&plan),
        [
            (EventKind::Confirmed, TOKEN + 9),
            (EventKind::ResolutionContradicted, TOKEN)
        ]
    );
    // A reconciler said ABSENT for the earlier life's last attempt before the key was handed
    // on: that attempt may have run too, so this is for an operator, not CONFIRMED.
    let mut doubtful = nothing.clone();
    doubtful.declared_absent_token = Some(TOKEN + 1);
    let plan = late(&doubtful, confirm_report(b"r", Some("re_1")));
    assert!(written(&plan).held_for_operator());

    // Saying it did nothing, or cannot tell, moves nothing here (its effect, if any, is under
    // this life's key) and is recorded in its own life, once for its token.
    for (report, kind) in [
        (absent(), EventKind::ReportedAbsent),
        (unknown(), EventKind::ReportedUnknown),
    ] {
        let plan = late(&next, report);
        assert!(plan.operation.is_none());
        assert_eq!(kinds(&plan), [(kind, TOKEN)]);
        let event = &plan.events[0];
        assert_eq!((event.from, event.to), (None, None));
        assert_eq!(event.attempt, Some(stalled.number));
        assert_eq!(
            event.dedupe_key.as_deref(),
            Some(format!("EARLIER_LIFE_REPORT:{TOKEN}").as_str())
        );
        let details = event.details.as_deref().unwrap();
        assert!(details.contains("\"current_life\":1009"), "{details}");
    }
    // A superseded attempt of this life saying so adds nothing: whoever superseded it knew.
    let this_life = Attempt {
        fencing_token: next.fencing_token,
        life: next.life,
        ..stalled.clone()
    };
    let mut later = next.clone();
    later.fencing_token = next.fencing_token + 1;
    later.attempt += 1;
    let (_, plan) = report_from(
        &later,
        next.fencing_token,
        Some(&this_life),
        unknown(),
        after + 5,
    );
    assert!(plan.is_empty(), "{plan:?}");
    // Another credential adds nothing.
    let (_, plan) = super::report(
        &next,
        &ReportCommand {
            fencing_token: TOKEN,
            holder: holder("k2"),
            report: confirm_report(b"r", Some("re_1")),
        },
        Some(&stalled),
        after + 5,
    );
    assert!(plan.is_empty());
}

/// Who said ABSENT for whom goes with the provider key into the next life.
#[test]
fn a_declared_absent_carries_over_with_the_key() {
    let mut ended = with_state(&claimed(), absent(), T0 + 10);
    ended.declared_absent_token = Some(TOKEN);
    let (_, plan) = begin_with(Some(&ended), &cmd("a2"), TOKEN + 9, T0 + 10 + RETENTION);
    assert_eq!(written(&plan).declared_absent_token, Some(TOKEN));
    let mut other_intent = cmd("a2");
    other_intent.fingerprint = fp(9);
    let (_, plan) = begin_with(Some(&ended), &other_intent, TOKEN + 9, T0 + 10 + RETENTION);
    assert_eq!(written(&plan).declared_absent_token, None);
}

#[test]
fn a_superseded_attempt_saying_absent_or_unknown_changes_nothing() {
    let second = second_attempt_after_absent_resolution();
    assert!(needs_attempt_record(&second, TOKEN));
    for report in [absent(), unknown()] {
        let (outcome, plan) = report_from(&second, TOKEN, Some(&first_attempt()), report, T0 + 40);
        assert_eq!(
            outcome,
            Err(Rejection::ExecutionRightLost {
                token: TOKEN,
                latest_attempt: 2,
                latest_token: TOKEN + 1
            })
        );
        assert!(plan.is_empty());
    }
}

#[test]
fn a_late_confirm_when_no_later_attempt_ran_settles_confirmed_and_contradicts_the_resolution() {
    // Attempt 1 UNKNOWN, resolved ABSENT; attempt 2 reports ABSENT itself; attempt 1 confirms.
    let second = second_attempt_after_absent_resolution();
    let gone = with_state(&second, absent(), T0 + 40);
    let (outcome, plan) = report_from(
        &gone,
        TOKEN,
        Some(&first_attempt()),
        confirm_report(b"one", Some("re_1")),
        T0 + 50,
    );
    assert!(
        matches!(outcome, Err(Rejection::ExecutionRightLost { .. })),
        "a superseded attempt is told its right is lost, though its proof is recorded"
    );
    let op = written(&plan);
    assert_eq!(
        (op.state, op.result.as_deref(), op.provider_ref.as_deref()),
        (State::Confirmed, Some(&b"one"[..]), Some("re_1"))
    );
    let kinds: Vec<EventKind> = plan.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [EventKind::Confirmed, EventKind::ResolutionContradicted]
    );
    assert_eq!(plan.events[0].attempt, Some(1));
    let BeginStep::Decided(decision, _) = begin(Some(&op), &cmd("a3"), T0 + 60) else {
        panic!()
    };
    assert_eq!(decision.name(), "REPLAY", "never executable again");
}

#[test]
fn a_late_confirm_after_a_later_attempt_ran_is_held_for_an_operator() {
    // Attempt 2 is running when attempt 1 confirms: both may have performed the effect.
    let second = second_attempt_after_absent_resolution();
    let (outcome, plan) = report_from(
        &second,
        TOKEN,
        Some(&first_attempt()),
        confirm_report(b"one", Some("re_1")),
        T0 + 40,
    );
    assert!(matches!(outcome, Err(Rejection::ExecutionRightLost { .. })));
    let held = written(&plan);
    assert!(held.held_for_operator());
    assert_eq!(held.reconcile_next_at, None, "no reconciler settles it");
    assert_eq!(plan.events.len(), 1);
    assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
    assert_eq!(
        plan.events[0].dedupe_key.as_deref(),
        Some(format!("DOUBLE_EXECUTION:{TOKEN}").as_str())
    );
    let BeginStep::Decided(decision, _) = begin(Some(&held), &cmd("a3"), T0 + 41) else {
        panic!()
    };
    assert_eq!(decision.name(), "UNKNOWN");
    // Attempt 2's lease is gone.
    assert!(beat(&held, TOKEN + 1, LEASE, T0 + 41).is_err());
    // No ABSENT resolution: an attempt proved the effect.
    assert_eq!(
        resolve(
            &held,
            &resolution(Resolution::Absent, TOKEN + 1, "r-2"),
            None,
            T0 + 42
        )
        .unwrap_err(),
        Rejection::EffectProven
    );

    // Attempt 2 says it did nothing: attempt 1's effect is the only one.
    let (outcome, plan) = report_by(&held, TOKEN + 1, absent(), T0 + 43);
    assert_eq!(outcome, Ok(State::Confirmed));
    assert_eq!(written(&plan).result.as_deref(), Some(&b"one"[..]));
    // Attempt 2 got the same provider object: one effect.
    let (outcome, _) = report_by(
        &held,
        TOKEN + 1,
        confirm_report(b"two", Some("re_1")),
        T0 + 43,
    );
    assert_eq!(outcome, Ok(State::Confirmed));
    // Attempt 2 made another: still held, a second anomaly.
    let (outcome, plan) = report_by(
        &held,
        TOKEN + 1,
        confirm_report(b"two", Some("re_2")),
        T0 + 43,
    );
    assert_eq!(outcome, Ok(State::Unknown));
    assert!(plan.operation.is_none());
    assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
    // An operator settles it.
    let (state, _) = resolve(
        &held,
        &resolution(
            Resolution::Confirmed {
                result: b"both".to_vec(),
                provider_ref: Some("re_1".into()),
            },
            TOKEN + 1,
            "r-3",
        ),
        None,
        T0 + 44,
    )
    .unwrap();
    assert_eq!(state, State::Confirmed);
}

#[test]
fn a_late_confirm_after_a_doubtful_absent_or_a_confirmation_records_the_double_execution() {
    let second = second_attempt_after_absent_resolution();
    // Attempt 2 too was declared ABSENT by an operator, not by itself: it may have run.
    let unsure = with_state(&second, unknown(), T0 + 40);
    let (_, plan) = resolve(
        &unsure,
        &resolution(Resolution::Absent, TOKEN + 1, "r-2"),
        None,
        T0 + 41,
    )
    .unwrap();
    let doubtful = written(&plan);
    let (_, plan) = report_from(
        &doubtful,
        TOKEN,
        Some(&first_attempt()),
        confirm_report(b"one", None),
        T0 + 42,
    );
    assert!(written(&plan).held_for_operator());

    // Attempt 2 confirmed: CONFIRMED stays, the anomaly is recorded (unless it is the same
    // provider object).
    let done = with_state(&second, confirm_report(b"two", Some("re_2")), T0 + 40);
    let (_, plan) = report_from(
        &done,
        TOKEN,
        Some(&first_attempt()),
        confirm_report(b"one", Some("re_1")),
        T0 + 42,
    );
    assert!(plan.operation.is_none());
    assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
    let (_, plan) = report_from(
        &done,
        TOKEN,
        Some(&first_attempt()),
        confirm_report(b"two", Some("re_2")),
        T0 + 42,
    );
    assert!(plan.is_empty());
}

#[test]
fn contradicting_reports_are_refused_unless_they_prove_the_effect() {
    let in_flight = claimed();
    let done = confirmed(&in_flight, T0 + 10);
    let (outcome, _) = report_by(&done, TOKEN, confirm_report(b"other", None), T0 + 11);
    assert_eq!(
        outcome,
        Err(Rejection::AlreadySettled {
            state: State::Confirmed
        })
    );
    let (outcome, _) = report_by(&done, TOKEN, absent(), T0 + 11);
    assert_eq!(
        outcome,
        Err(Rejection::AlreadySettled {
            state: State::Confirmed
        })
    );
    // The attempt itself said ABSENT, then confirms: the effect happened after all.
    let gone = with_state(&in_flight, absent(), T0 + 10);
    let (outcome, plan) = report_by(&gone, TOKEN, confirm_report(b"r", None), T0 + 11);
    assert_eq!(outcome, Ok(State::Confirmed));
    assert_eq!(plan.events[1].kind, EventKind::ResolutionContradicted);
}

#[test]
fn heartbeats_extend_only_a_live_lease_and_never_shorten_it() {
    let in_flight = claimed();
    let (deadline, plan) = beat(&in_flight, TOKEN, LEASE, T0 + 1000).unwrap();
    assert_eq!(deadline, T0 + 1000 + LEASE);
    assert!(!plan.is_empty());
    let (deadline, plan) = beat(&in_flight, TOKEN, 10, T0 + 1000).unwrap();
    assert_eq!(deadline, in_flight.lease_deadline);
    assert!(plan.is_empty());
    assert_eq!(
        beat(&in_flight, TOKEN, LEASE, T0 + LEASE).unwrap_err(),
        Rejection::LeaseExpired { token: TOKEN }
    );
    assert!(matches!(
        beat(&in_flight, TOKEN + 1, LEASE, T0 + 1),
        Err(Rejection::ExecutionRightLost { .. })
    ));
}

#[test]
fn resolutions_apply_to_the_examined_attempt_of_an_unknown_operation_and_are_idempotent() {
    let in_flight = claimed();
    let unsure = with_state(&in_flight, unknown(), T0 + 10);
    let resolve_absent = resolution(Resolution::Absent, TOKEN, "r1");
    let (state, plan) = resolve(&unsure, &resolve_absent, None, T0 + 20).unwrap();
    assert_eq!(state, State::Absent);
    let plan_details = plan.events[0].details.clone();
    let resolved = written(&plan);
    assert_eq!(
        (
            resolved.source,
            resolved.expires_at,
            resolved.declared_absent_token
        ),
        (Source::Operator, Some(T0 + 20 + RETENTION), Some(TOKEN))
    );
    assert_eq!(plan.events[0].actor, Actor::Operator("alice".into()));
    assert_eq!(plan.events[0].dedupe_key.as_deref(), Some("RESOLVED:r1"));

    // A retry finds its earlier resolution, whatever the operation did since.
    let (_, plan) = begin_with(Some(&resolved), &cmd("a2"), TOKEN + 1, T0 + 25);
    let moved_on = written(&plan);
    let prior = PriorResolution::from_event(State::Absent, plan_details.as_deref());
    let (again, plan) = resolve(&moved_on, &resolve_absent, Some(prior), T0 + 30).unwrap();
    assert_eq!(again, State::Absent);
    assert!(plan.is_empty());
    let confirmed_instead = resolution(
        Resolution::Confirmed {
            result: vec![],
            provider_ref: None,
        },
        TOKEN,
        "r1",
    );
    assert!(matches!(
        resolve(&moved_on, &confirmed_instead, Some(prior), T0 + 30),
        Err(Rejection::ResolutionIdReused { .. })
    ));
    // The same id for another attempt (here the next one) is another resolution: refused.
    let next_attempt = resolution(Resolution::Absent, TOKEN + 1, "r1");
    assert!(matches!(
        resolve(&moved_on, &next_attempt, Some(prior), T0 + 30),
        Err(Rejection::ResolutionIdReused { .. })
    ));
    assert_eq!(
        resolve(
            &resolved,
            &resolution(Resolution::Absent, TOKEN, "r2"),
            None,
            T0 + 30
        )
        .unwrap_err(),
        Rejection::NotUnknown {
            state: State::Absent
        }
    );

    // The examined attempt must be the latest: by token (which names its life too) and, when
    // given, by number.
    assert_eq!(
        resolve(
            &unsure,
            &resolution(Resolution::Absent, TOKEN + 99, "r3"),
            None,
            T0 + 30
        )
        .unwrap_err(),
        Rejection::AttemptMismatch {
            examined: TOKEN + 99,
            current: 1,
            current_token: TOKEN
        }
    );
    let mut wrong_number = resolution(Resolution::Absent, TOKEN, "r4");
    wrong_number.attempt = Some(2);
    assert!(matches!(
        resolve(&unsure, &wrong_number, None, T0 + 30),
        Err(Rejection::AttemptMismatch { .. })
    ));
}

#[test]
fn a_report_comes_from_the_credential_that_holds_the_attempt() {
    let in_flight = claimed();
    assert_eq!(in_flight.holder, holder(HOLDER));
    let from_another = |report: Report| ReportCommand {
        fencing_token: TOKEN,
        holder: holder("k2"),
        report,
    };
    let lost = Err(Rejection::ExecutionRightLost {
        token: TOKEN,
        latest_attempt: 1,
        latest_token: TOKEN,
    });
    for report in [
        confirm_report(b"r", Some("re_1")),
        Report::Absent {
            reason: "no".into(),
        },
        Report::Unknown { reason: "?".into() },
    ] {
        let (answer, plan) = super::report(&in_flight, &from_another(report), None, T0 + 1);
        assert_eq!(answer, lost);
        assert!(
            plan.is_empty(),
            "another credential's report changes nothing"
        );
    }
    // Nor from an open ledger's caller, which presents none.
    let keyless = ReportCommand {
        holder: None,
        ..from_another(Report::Absent {
            reason: "no".into(),
        })
    };
    assert!(super::report(&in_flight, &keyless, None, T0 + 1)
        .1
        .is_empty());
    // An attempt granted to no credential (while the ledger was open, or before holders were
    // recorded) is any credential's of the tenant to report, as before.
    let unheld = Operation {
        holder: None,
        ..in_flight.clone()
    };
    let (answer, _) = super::report(
        &unheld,
        &from_another(Report::Absent {
            reason: "no".into(),
        }),
        None,
        T0 + 1,
    );
    assert_eq!(answer, Ok(State::Absent));
    // Its heartbeat is answered as a token never issued.
    let beat_from_another = HeartbeatCommand {
        fencing_token: TOKEN,
        holder: holder("k2"),
        ttl_ms: LEASE,
    };
    assert!(matches!(
        heartbeat(&in_flight, &beat_from_another, T0 + 1),
        Err(Rejection::ExecutionRightLost { .. })
    ));
    // The same Begin again (attempt id and context, read from the operation) is granted again
    // only to the holder: to another credential it is IN_PROGRESS.
    let mut again = cmd("a1");
    again.holder = holder("k2");
    let BeginStep::Decided(decision, plan) = begin(Some(&in_flight), &again, T0 + 1) else {
        panic!("an IN_FLIGHT operation is decided from its row")
    };
    assert_eq!(decision.name(), "IN_PROGRESS");
    assert!(plan.is_empty());
    let BeginStep::Decided(decision, _) = begin(Some(&in_flight), &cmd("a1"), T0 + 1) else {
        panic!()
    };
    assert!(matches!(
        decision,
        BeginDecision::Execute(Grant {
            regranted: true,
            ..
        })
    ));
    // The holder's own report settles it.
    let (answer, _) = report_by(
        &in_flight,
        TOKEN,
        Report::Absent {
            reason: "no".into(),
        },
        T0 + 2,
    );
    assert_eq!(answer, Ok(State::Absent));
}

#[test]
fn a_superseded_attempts_confirm_counts_only_from_its_own_credential() {
    let first = first_attempt();
    let absent = with_state(
        &claimed(),
        Report::Absent {
            reason: "no".into(),
        },
        T0 + 1,
    );
    let mut second = cmd("a2");
    second.holder = holder("k2");
    let (_, plan) = begin_with(Some(&absent), &second, TOKEN + 1, T0 + 2);
    let running = written(&plan);
    assert_eq!(running.holder, holder("k2"));
    // Attempt 1's token, reported by attempt 2's credential: nothing, not even an anomaly.
    let forged = ReportCommand {
        fencing_token: TOKEN,
        holder: holder("k2"),
        report: confirm_report(b"r", Some("re_1")),
    };
    let (answer, plan) = super::report(&running, &forged, Some(&first), T0 + 3);
    assert!(matches!(answer, Err(Rejection::ExecutionRightLost { .. })));
    assert!(plan.is_empty());
    // From its own credential, it is proof, recorded.
    let (_, plan) = report_from(
        &running,
        TOKEN,
        Some(&first),
        confirm_report(b"r", Some("re_1")),
        T0 + 3,
    );
    assert!(!plan.is_empty());
}

#[test]
fn a_begin_starts_an_execution_exactly_when_begin_asks_to_claim() {
    let live = claimed();
    let settled = confirmed(&live, T0 + 1);
    let gone = with_state(&live, absent(), T0 + 1);
    let doubtful = with_state(&live, unknown(), T0 + 1);
    let past_retention = T0 + 1 + RETENTION;
    let other_arguments = BeginCommand {
        fingerprint: fp(2),
        ..cmd("a2")
    };
    let cases: [(Option<&Operation>, &BeginCommand, Millis, bool); 8] = [
        (None, &cmd("a2"), T0, true),
        (Some(&live), &cmd("a2"), T0 + 1, false),
        (Some(&settled), &cmd("a2"), T0 + 2, false),
        (Some(&settled), &cmd("a2"), past_retention, true),
        (Some(&gone), &cmd("a2"), T0 + 2, true),
        (Some(&gone), &other_arguments, T0 + 2, false),
        (Some(&gone), &other_arguments, past_retention, true),
        (Some(&doubtful), &cmd("a2"), past_retention, false),
    ];
    for (current, command, now, starts) in cases {
        assert_eq!(
            super::starts_execution(current, command, now),
            starts,
            "{:?} at {now}",
            current.map(|op| op.state)
        );
        // The same rule as Begin's: a claim where it says one starts, nothing where not.
        let claims = matches!(super::begin(current, command, now), BeginStep::Claim);
        assert_eq!(claims, starts, "{:?} at {now}", current.map(|op| op.state));
    }
}

#[test]
fn held_executions_answer_everything_but_a_new_execution() {
    let held = BeginCommand {
        held: true,
        ..cmd("a2")
    };
    // Nothing stored, or a life that ended ABSENT: an execution would start, so none does.
    let (decision, plan) = begin_with(None, &held, TOKEN, T0);
    assert_eq!((decision, plan), (BeginDecision::Held, Plan::default()));
    let ended = with_state(&claimed(), absent(), T0 + 1);
    let (decision, plan) = begin_with(Some(&ended), &held, TOKEN + 1, T0 + 2);
    assert_eq!((decision, plan), (BeginDecision::Held, Plan::default()));
    // A replay, IN_PROGRESS, and the same grant again for a retried Begin go on.
    let done = confirmed(&claimed(), T0 + 1);
    let (decision, _) = begin_with(Some(&done), &held, TOKEN + 1, T0 + 2);
    assert_eq!(decision.name(), "REPLAY");
    let (decision, _) = begin_with(Some(&claimed()), &held, TOKEN + 1, T0 + 1);
    assert_eq!(decision.name(), "IN_PROGRESS");
    let retried = BeginCommand {
        held: true,
        ..cmd("a1")
    };
    let (decision, _) = begin_with(Some(&claimed()), &retried, TOKEN + 1, T0 + 1);
    assert!(matches!(
        decision,
        BeginDecision::Execute(Grant {
            regranted: true,
            ..
        })
    ));
}
