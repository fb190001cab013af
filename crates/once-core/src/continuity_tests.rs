//! Positions sealed and opened, judged, and what a lost operation comes back as.

use super::*;
use crate::machine::{self, BeginStep};
use crate::{BeginCommand, BeginDecision, Report, ReportCommand};

const T0: Millis = 5_000_000;
const KEPT: i64 = 30 * 24 * 3_600_000;

fn seal() -> Seal {
    Seal::new("ledger-a", [7; 32])
}

fn position(token: u64) -> Position {
    Position {
        ledger: "ledger-a".into(),
        epoch: 0,
        tenant: "t".into(),
        operation_id: OperationId::parse("id", "refund:o1").unwrap(),
        tool: "refund".into(),
        fingerprint: Fingerprint([1; 32]),
        life: FencingToken(token),
        attempt: 1,
        token: FencingToken(token),
        provider: Some("stripe".into()),
        provider_key: "once_key".into(),
        lookup_hints: Some(r#"{"payment_intent":"pi_1"}"#.into()),
        retention_ms: 600_000,
        at: T0,
    }
}

fn holder() -> Holder {
    Some("k1".into())
}

fn executor() -> Actor {
    Actor::Executor("mcp".into())
}

#[test]
fn a_sealed_position_opens_as_it_was() {
    let p = position(1_048_600);
    let text = seal().seal(&p);
    assert!(text.starts_with("p1."), "{text}");
    assert_eq!(seal().open(&text), Ok(Opened::Ours(Box::new(p.clone()))));
    // A client reads what it says, without the key.
    assert_eq!(peek(&text), Ok(p));
}

#[test]
fn a_position_changed_or_sealed_by_another_key_is_refused() {
    let p = position(1_048_600);
    let text = seal().seal(&p);
    // Any one byte of the payload changed.
    let payload_at = PREFIX.len() + 5;
    let mut changed = text.clone().into_bytes();
    changed[payload_at] = if changed[payload_at] == b'A' {
        b'B'
    } else {
        b'A'
    };
    let changed = String::from_utf8(changed).unwrap();
    let refused = seal().open(&changed).unwrap_err();
    assert_eq!(refused.field, FIELD);
    // The same ledger's name with another key: a forgery.
    let forged = Seal::new("ledger-a", [8; 32]).seal(&p);
    assert!(seal()
        .open(&forged)
        .unwrap_err()
        .message
        .contains("not sealed by this ledger"));
    // A seal cut short proves nothing.
    let (body, tag) = text.rsplit_once('.').unwrap();
    let short = format!("{body}.{}", &tag[..4]);
    assert!(seal().open(&short).is_err());
    // Text that is no position at all.
    for junk in [
        "",
        "p1.",
        "p1.abc",
        "p2.e30.AAAA",
        "p1.e30.AAAA",
        &"p1.x".repeat(2_000),
    ] {
        assert!(seal().open(junk).is_err(), "{junk}");
    }
}

#[test]
fn a_position_of_another_ledger_proves_nothing_here() {
    let p = Position {
        ledger: "ledger-b".into(),
        ..position(1_048_600)
    };
    let text = Seal::new("ledger-b", [9; 32]).seal(&p);
    assert_eq!(
        seal().open(&text),
        Ok(Opened::Elsewhere {
            ledger: "ledger-b".into()
        })
    );
}

#[test]
fn a_position_the_ledger_cannot_account_for_shows_it_behind() {
    let p = Position {
        epoch: 2,
        ..position(2_000)
    };
    // An earlier epoch of the tenant was accepted since: whatever its token, its claim is
    // looked up (a client that did not report before the acceptance still holds it).
    assert_eq!(
        check(
            &Position {
                epoch: 1,
                ..p.clone()
            },
            2,
            FencingToken(1)
        ),
        Check::LookUp
    );
    // A later epoch: the ledger was restored to before an accepted loss.
    let Check::Behind(behind) = check(
        &Position {
            epoch: 3,
            ..p.clone()
        },
        2,
        FencingToken(9_000),
    ) else {
        panic!("not behind")
    };
    assert_eq!(behind.why, Why::EpochAhead);
    // A token the ledger never issued.
    let Check::Behind(behind) = check(&p, 2, FencingToken(1_999)) else {
        panic!("not behind")
    };
    assert_eq!(
        (behind.why, behind.client_token, behind.ledger_token),
        (Why::TokenAhead, FencingToken(2_000), FencingToken(1_999))
    );
    assert!(behind.to_string().contains("1999"), "{behind}");
    // Tokens issued past it: its claim must be in the history.
    assert_eq!(check(&p, 2, FencingToken(2_000)), Check::LookUp);
    assert_eq!(
        after_lookup(&p, true, (2, FencingToken(5_000)), T0 + 1, KEPT),
        None
    );
    let missing = after_lookup(&p, false, (2, FencingToken(5_000)), T0 + 1, KEPT).unwrap();
    assert_eq!(missing.why, Why::ClaimMissing);
    // Unless retention may have deleted its claim with the events of that day.
    assert_eq!(
        after_lookup(&p, false, (2, FencingToken(5_000)), T0 + KEPT, KEPT),
        None
    );
}

#[test]
fn a_lost_operation_comes_back_unknown_with_the_attempt_the_client_saw() {
    let p = position(2_000);
    let plan = recover(None, (&p, false), (&executor(), &holder()), T0 + 10).unwrap();
    let Some(Write::Insert(op)) = &plan.operation else {
        panic!("not an insert: {plan:?}")
    };
    assert_eq!(op.state, State::Unknown);
    assert_eq!(op.source, Source::Continuity);
    assert_eq!(
        (op.attempt, op.fencing_token, op.life),
        (1, FencingToken(2_000), FencingToken(2_000))
    );
    assert_eq!(op.provider_key, "once_key");
    assert_eq!(
        op.lookup_hints, p.lookup_hints,
        "its reconciler can look it up"
    );
    assert_eq!(
        op.reconcile_next_at,
        Some(T0 + 10),
        "due for a lookup at once"
    );
    assert_eq!(op.holder, holder());
    assert_eq!(plan.events[0].kind, EventKind::Recovered);
    assert_eq!(
        plan.attempt.as_ref().unwrap().fencing_token,
        FencingToken(2_000)
    );

    // No Begin executes it again: it answers UNKNOWN.
    let begin = BeginCommand {
        tenant: "t".into(),
        operation_id: p.operation_id.clone(),
        tool: "refund".into(),
        fingerprint: p.fingerprint,
        attempt_id: "again".into(),
        context: AttemptContext::default(),
        lease_ttl_ms: 30_000,
        retention_ms: 600_000,
        new_intent: false,
        provider: None,
        lookup_hints: None,
        actor: executor(),
        holder: holder(),
        held: false,
    };
    let BeginStep::Decided(BeginDecision::Unknown { .. }, _) =
        machine::begin(Some(op), &begin, T0 + 20)
    else {
        panic!("a recovered operation executed again")
    };
    // The attempt's own late confirm settles it, as any attempt's would.
    let confirm = ReportCommand {
        fencing_token: FencingToken(2_000),
        holder: holder(),
        report: Report::Confirm {
            result: b"r".to_vec(),
            provider_ref: None,
        },
    };
    let (settled, _) = machine::report(op, &confirm, None, T0 + 30);
    assert_eq!(settled, Ok(State::Confirmed));
}

#[test]
fn a_life_retention_deleted_after_it_settled_is_not_brought_back() {
    // No row, but the history records events of the life the client saw: it settled and
    // retention deleted it; its idempotency window is over.
    assert_eq!(
        recover(None, (&position(2_000), true), (&executor(), &holder()), T0),
        None
    );
}

#[test]
fn an_operation_the_ledger_knows_as_far_as_the_client_is_not_recovered() {
    let p = position(2_000);
    let lost = recover(None, (&p, false), (&executor(), &holder()), T0).unwrap();
    let known = lost.operation.unwrap().operation().clone();
    // The same attempt is known.
    assert_eq!(
        recover(Some(&known), (&p, false), (&executor(), &holder()), T0 + 1),
        None
    );
    // A later one was granted since the ledger lost this one: both may have run, which is
    // recorded, once; nothing else changes.
    let plan = recover(
        Some(&known),
        (&position(1_999), false),
        (&executor(), &holder()),
        T0 + 1,
    )
    .unwrap();
    assert!(
        plan.operation.is_none() && plan.attempt.is_none(),
        "{plan:?}"
    );
    assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
    assert!(plan.events[0].dedupe_key.is_some());
    // A CONFIRMED operation never changes: a later attempt of its life it lost is recorded as
    // a possible second effect. A later life the client saw begin replaces an earlier one
    // (in the state the ledger lost, that one had ended).
    let mut confirmed = known.clone();
    (confirmed.state, confirmed.fencing_token) = (State::Confirmed, FencingToken(1_000));
    let plan = recover(
        Some(&confirmed),
        (&p, false),
        (&executor(), &holder()),
        T0 + 1,
    )
    .unwrap();
    assert!(
        plan.operation.is_none() && plan.attempt.is_none(),
        "{plan:?}"
    );
    assert_eq!(plan.events.len(), 1);
    assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
    assert!(plan.events[0].dedupe_key.is_some(), "recorded once");
    confirmed.life = FencingToken(500);
    let plan = recover(
        Some(&confirmed),
        (&p, false),
        (&executor(), &holder()),
        T0 + 1,
    )
    .unwrap();
    let Some(Write::Update(op)) = &plan.operation else {
        panic!("{plan:?}")
    };
    assert_eq!((op.life, op.state), (FencingToken(2_000), State::Unknown));
}

#[test]
fn an_earlier_attempt_the_ledger_kept_gives_way_to_the_later_one_the_client_saw() {
    // The restored ledger holds attempt 1 IN_FLIGHT (or ABSENT); the client saw attempt 2.
    let first = recover(
        None,
        (&position(2_000), false),
        (&executor(), &holder()),
        T0,
    )
    .unwrap();
    let mut kept = first.operation.unwrap().operation().clone();
    kept.state = State::Absent;
    let later = Position {
        attempt: 2,
        token: FencingToken(2_500),
        ..position(2_000)
    };
    let plan = recover(
        Some(&kept),
        (&later, false),
        (&executor(), &holder()),
        T0 + 1,
    )
    .unwrap();
    let Some(Write::Update(op)) = &plan.operation else {
        panic!("not an update")
    };
    assert_eq!(
        (op.state, op.attempt, op.fencing_token),
        (State::Unknown, 2, FencingToken(2_500))
    );
    assert!(
        !plan.forgets_attempts,
        "the same life keeps its attempt log"
    );
    assert_eq!(plan.events[0].from, Some(State::Absent));

    // A settled life past retention gives way to the new life the client saw.
    let mut expired = kept.clone();
    (expired.state, expired.expires_at) = (State::Confirmed, Some(T0));
    let next_life = Position {
        life: FencingToken(3_000),
        token: FencingToken(3_000),
        provider_key: "once_next".into(),
        ..position(3_000)
    };
    let plan = recover(
        Some(&expired),
        (&next_life, false),
        (&executor(), &holder()),
        T0 + 5,
    )
    .unwrap();
    let Some(Write::Update(op)) = &plan.operation else {
        panic!("not an update")
    };
    assert_eq!((op.life, op.state), (FencingToken(3_000), State::Unknown));
    assert!(plan.forgets_attempts, "a new life starts a new attempt log");
    // One that took over the stored life's provider key (that life ended ABSENT) keeps the
    // stored life's attempts beside its own, so a late confirm of one is judged.
    let mut ended = kept.clone();
    (ended.expires_at, ended.life) = (Some(T0), FencingToken(2_000));
    let took_over = Position {
        provider_key: kept.provider_key.clone(),
        ..next_life.clone()
    };
    let plan = recover(
        Some(&ended),
        (&took_over, false),
        (&executor(), &holder()),
        T0 + 5,
    )
    .unwrap();
    assert!(!plan.forgets_attempts, "{plan:?}");
    assert_eq!(plan.events[0].from, Some(State::Absent));
}

#[test]
fn an_effect_proven_before_the_restore_stays_proven_over_a_recovered_attempt() {
    // The restored ledger holds attempt 1 UNKNOWN for an operator: attempt 0's late confirm
    // proved the effect while attempt 1 may also have run. The client saw attempt 2 granted.
    let first = recover(
        None,
        (&position(2_000), false),
        (&executor(), &holder()),
        T0,
    )
    .unwrap();
    let mut held = first.operation.unwrap().operation().clone();
    (held.source, held.result) = (Source::Anomaly, Some(b"{\"refund\":\"re_1\"}".to_vec()));
    (held.provider_ref, held.confirmed_by) = (Some("re_1".into()), Some(FencingToken(1_500)));
    held.reason = Some("attempt 0 confirmed its effect after attempt 1 was granted".into());
    let later = Position {
        attempt: 2,
        token: FencingToken(2_500),
        ..position(2_000)
    };
    let plan = recover(
        Some(&held),
        (&later, false),
        (&executor(), &holder()),
        T0 + 1,
    )
    .unwrap();
    let Some(Write::Update(op)) = &plan.operation else {
        panic!("not an update: {plan:?}")
    };
    assert_eq!((op.attempt, op.fencing_token), (2, FencingToken(2_500)));
    assert!(op.held_for_operator(), "no longer held: {op:?}");
    assert_eq!(op.result, held.result, "the proven result is kept");
    assert_eq!(op.provider_ref.as_deref(), Some("re_1"));
    assert_eq!(op.confirmed_by, Some(FencingToken(1_500)));
    assert_eq!(op.reconcile_next_at, None, "no reconciler settles it");
    // An operator cannot call it ABSENT; the attempt brought back saying it did nothing
    // settles it CONFIRMED with the proven effect.
    let absent = ReportCommand {
        fencing_token: FencingToken(2_500),
        holder: holder(),
        report: Report::Absent {
            reason: "declined".into(),
        },
    };
    let (answer, plan) = machine::report(op, &absent, None, T0 + 2);
    assert_eq!(answer, Ok(State::Confirmed));
    let Some(Write::Update(settled)) = &plan.operation else {
        panic!("not an update: {plan:?}")
    };
    assert_eq!(settled.result, held.result);
}

proptest::proptest! {
    /// A position comes from the network: whatever the text, opening it answers, never panics.
    #[test]
    fn any_text_opens_to_an_answer(text in "(p1\\.)?[A-Za-z0-9_.=-]{0,400}", json in ".{0,200}") {
        let _ = seal().open(&text);
        let _ = peek(&text);
        let crafted = format!("{PREFIX}{}.AAAAAAAAAAAAAAAAAAAAAA", URL_SAFE_NO_PAD.encode(json));
        let _ = seal().open(&crafted);
        let _ = peek(&crafted);
    }
}

#[test]
fn no_position_the_ledger_seals_is_longer_than_it_accepts() {
    // The longest of everything a position names, the hints all quotes (escaped, twice as long).
    let hints = format!("{{\"h\":\"{}\"}}", "\\\"".repeat(2_040));
    assert!(hints.len() <= 4_096 + 16, "{}", hints.len());
    let long = Position {
        operation_id: OperationId::parse("id", &"x".repeat(255)).unwrap(),
        tool: "t".repeat(128),
        provider: Some("p".repeat(128)),
        provider_key: "k".repeat(128),
        tenant: "n".repeat(63),
        lookup_hints: Some(hints),
        ..position(u64::MAX >> 1)
    };
    let sealed = seal().seal(&long);
    assert!(sealed.len() <= MAX_SEALED, "{} bytes", sealed.len());
    assert_eq!(seal().open(&sealed), Ok(Opened::Ours(Box::new(long))));
}
