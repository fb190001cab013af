//! The human output as it is printed, in 80 columns without colour (what a pipe or a log gets),
//! checked against snapshots; and that colour is only ever added when asked for.

use std::time::{Duration, SystemTime};

use once_client::{
    AttemptContext, AttemptView, CallView, EventView, OperationView, Truth, WatchedEvent,
};
use once_core::State;

use super::*;

/// 2026-12-01 03:12:00 UTC: the page arrived at 3 a.m.
fn at(seconds_after_three: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_094_000 + seconds_after_three)
}

fn plain() -> Look {
    Look {
        width: 80,
        color: false,
        now: at(15 * 60),
    }
}

fn event(
    sequence: i64,
    seconds: u64,
    kind: &str,
    moved: (Option<State>, Option<State>),
) -> EventView {
    EventView {
        sequence,
        at: Some(at(seconds)),
        kind: kind.into(),
        from: moved.0,
        to: moved.1,
        attempt: 1,
        actor: "executor:refund-mcp-prod".into(),
        reason: None,
        details: None,
    }
}

fn unknown_refund() -> OperationView {
    let mut expired = event(
        1043,
        32,
        "LEASE_EXPIRED",
        (Some(State::InFlight), Some(State::Unknown)),
    );
    expired.actor = "ledger".into();
    expired.reason = Some("the lease ran out with no report".into());
    let mut lookup = event(1051, 95, "LOOKUP_INCONCLUSIVE", (None, None));
    lookup.actor = "reconciler:stripe".into();
    lookup.reason = Some("the provider's list may lag its writes".into());
    lookup.details = Some(r#"{"lookups":1,"next_lookup_at":1796094125000}"#.into());
    OperationView {
        tenant: "acme".into(),
        operation_id: "refund:order_4821".into(),
        tool: "issue_refund".into(),
        state: State::Unknown,
        attempt: 1,
        fencing_token: 1_048_601,
        result: None,
        provider_ref: None,
        provider_key: "once_pk_5f2c0e1a9b7d4c3e".into(),
        reason: Some("the lease ran out with no report".into()),
        source: "lease".into(),
        fingerprint: "9c1f".repeat(16),
        provider: Some("stripe".into()),
        lookup_hints: Some(r#"{"payment_intent":"pi_order_4821"}"#.into()),
        lease_deadline: None,
        expires_at: None,
        created_at: Some(at(2)),
        updated_at: Some(at(32)),
        last_event: Some(("LOOKUP_INCONCLUSIVE".into(), at(95))),
        attempts: vec![AttemptView {
            number: 1,
            fencing_token: 1_048_601,
            attempt_id: "6f0d6a1c-63e4-4a51-9f1e-2f5d2b7c9a10".into(),
            context: AttemptContext {
                client_name: Some("claude-desktop".into()),
                session_id: Some("3e5b8c1d".into()),
                request_id: Some("17".into()),
            },
            actor: "executor:refund-mcp-prod".into(),
            started_at: Some(at(2)),
            lease_deadline: Some(at(32)),
        }],
        events: vec![
            event(1042, 2, "CLAIMED", (None, Some(State::InFlight))),
            expired,
            lookup,
        ],
        calls: vec![
            call(2, Some(1), "EXECUTE", "17", None),
            call(3, None, "IN_PROGRESS", "18", Some("harness_retry")),
            call(80, None, "UNKNOWN", "2", Some("reconnect")),
        ],
        forensics: Some("1 execution, 2 duplicates prevented: 1 harness retry, 1 reconnect".into()),
        provider_dashboard: None,
        earlier_events: Vec::new(),
    }
}

fn call(
    seconds: u64,
    attempt: Option<u32>,
    decision: &str,
    request: &str,
    origin: Option<&str>,
) -> CallView {
    let session = if origin == Some("reconnect") {
        "9a0b7e42"
    } else {
        "3e5b8c1d"
    };
    CallView {
        at: Some(at(seconds)),
        attempt,
        decision: decision.into(),
        attempt_id: format!("attempt-{seconds}"),
        context: AttemptContext {
            client_name: Some("claude-desktop".into()),
            session_id: Some(session.into()),
            request_id: Some(request.into()),
        },
        actor: "executor:refund-mcp-prod".into(),
        requested_operation_id: None,
        origin: origin.map(str::to_owned),
    }
}

fn confirmed_email() -> OperationView {
    OperationView {
        operation_id: "send_email:h:0123456789abcdef0123456789abcdef".into(),
        tool: "send_email".into(),
        state: State::Confirmed,
        attempt: 2,
        source: "attempt".into(),
        provider: None,
        lookup_hints: None,
        created_at: Some(at(14 * 60)),
        last_event: Some(("CONFIRMED".into(), at(14 * 60 + 3))),
        attempts: Vec::new(),
        events: Vec::new(),
        calls: Vec::new(),
        forensics: None,
        ..unknown_refund()
    }
}

#[test]
fn a_list_is_a_table_when_it_fits_80_columns() {
    let mut other = unknown_refund();
    other.operation_id = "refund:order_4822".into();
    other.state = State::InFlight;
    other.last_event = Some(("CLAIMED".into(), at(14 * 60)));
    let listed = operations(&plain(), &[unknown_refund(), other], true, false);
    assert!(listed.lines().all(|l| l.chars().count() <= 80), "{listed}");
    insta::assert_snapshot!(listed);
}

#[test]
fn a_list_too_wide_for_a_table_puts_each_id_on_its_own_line() {
    let listed = operations(
        &plain(),
        &[unknown_refund(), confirmed_email()],
        false,
        false,
    );
    assert!(listed.lines().all(|l| l.chars().count() <= 80), "{listed}");
    insta::assert_snapshot!(listed);
}

#[test]
fn an_operation_reads_at_a_glance() {
    let shown = operation(&plain(), &unknown_refund());
    assert!(shown.lines().all(|l| l.chars().count() <= 80), "{shown}");
    insta::assert_snapshot!(shown);
}

#[test]
fn a_watched_change_is_one_line_with_its_sequence() {
    let refund = unknown_refund();
    let watched_event = WatchedEvent {
        tenant: refund.tenant.clone(),
        operation_id: refund.operation_id.clone(),
        tool: refund.tool.clone(),
        state: Some(State::Unknown),
        event: refund.events[1].clone(),
    };
    let line = watched(&plain(), &watched_event, false);
    assert!(line.lines().all(|l| l.chars().count() <= 80), "{line}");
    insta::assert_snapshot!(line);
}

#[test]
fn a_resolution_says_what_it_will_do_and_to_which_attempt() {
    let mut refund = unknown_refund();
    let examined = refund.attempts[0].clone();
    refund.attempt = 2;
    let truth = Truth::Confirmed {
        result: b"{}".to_vec(),
        provider_ref: Some("re_3Nf".into()),
    };
    let plan = resolution_plan(
        &plain(),
        &refund,
        &examined,
        &truth,
        "refund re_3Nf is in the provider's dashboard",
        "b2c4",
    );
    insta::assert_snapshot!(plan);
}

#[test]
fn colour_only_when_asked_for() {
    let op = unknown_refund();
    let plain_text = [
        operations(&plain(), std::slice::from_ref(&op), false, false),
        operation(&plain(), &op),
    ];
    for text in &plain_text {
        assert!(!text.contains('\u{1b}'), "{text}");
    }
    let coloured = Look {
        color: true,
        ..plain()
    };
    let text = operation(&coloured, &op);
    assert!(text.contains('\u{1b}'), "{text}");
    let listed = operations(&coloured, std::slice::from_ref(&op), false, false);
    assert!(listed.contains('\u{1b}'), "{listed}");
}

#[test]
fn ages_are_said_in_their_two_largest_units() {
    let cases = [
        (0, "0s"),
        (59, "59s"),
        (60, "1m"),
        (3599, "59m"),
        (3600, "1h"),
        (3 * 3600 + 4 * 60, "3h4m"),
        (2 * 86_400 + 5, "2d"),
    ];
    for (seconds, said) in cases {
        assert_eq!(age(Duration::from_secs(seconds)), said);
    }
}

#[test]
fn forensics_over_a_window_say_where_repeats_came_from() {
    let found = once_client::ForensicsView {
        operations: 12,
        executions: 12,
        prevented: 42,
        origins: vec![
            ("harness_retry".into(), 30),
            ("reconnect".into(), 8),
            ("model_reissue".into(), 4),
        ],
        summary: "12 executions, 42 duplicates prevented: 30 harness retries, 8 reconnects, 4 model re-issues".into(),
    };
    insta::assert_snapshot!(forensics(&plain(), &found, "1h"));
}

#[test]
fn stats_fit_80_columns() {
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let ages = |count, p50, max| once_client::AgesView {
        count,
        p50: minutes(p50),
        p90: minutes(max),
        p99: minutes(max),
        max: minutes(max),
    };
    let figures = once_client::StatsView {
        operations: vec![
            (State::Confirmed, "issue_refund".into(), 1204),
            (State::Unknown, "issue_refund".into(), 3),
        ],
        unknown: ages(3, 4, 12),
        resolved: vec![
            ("late_report".into(), ages(2, 0, 1)),
            ("reconciler".into(), ages(5, 2, 9)),
            ("operator".into(), ages(0, 0, 0)),
        ],
        events: vec![
            ("DOUBLE_EXECUTION".into(), 0),
            ("RESOLUTION_CONTRADICTED".into(), 0),
            ("ESCALATED".into(), 1),
        ],
        reconcilers: vec![once_client::ReconcilerView {
            reconciler: "stripe".into(),
            settled: 41,
            missed: 3,
            failed: 2,
            mean: Some(Duration::from_millis(180)),
            max: Some(Duration::from_secs(5)),
        }],
    };
    let text = stats(&plain(), &figures, "1h", false);
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
    insta::assert_snapshot!(text);
}

#[test]
fn a_verification_says_what_was_checked_and_where_to_look() {
    let mut found = once_client::HistoryView {
        tenant: "acme".into(),
        links: 12,
        events: 340,
        through: 981,
        head_number: 12,
        head_hash: "ab".repeat(32),
        verified_at: at(0),
        problem: None,
    };
    let clean = history(&found);
    assert!(
        clean.starts_with("Tenant acme: 12 links, 340 events, through event 981.\n"),
        "{clean}"
    );
    assert!(clean.contains("Everything matches"), "{clean}");
    found.problem = Some(once_client::HistoryProblem {
        code: "EVENT_CHANGED".into(),
        sequence: 77,
        operation_id: "refund:1".into(),
        message: "event 77 (operation refund:1) is not the event the chain recorded".into(),
    });
    let rewritten = history(&found);
    assert!(
        rewritten.contains("DOES NOT MATCH (EVENT_CHANGED): event 77"),
        "{rewritten}"
    );
    assert!(
        rewritten.contains("oncectl watch --all --after 76"),
        "{rewritten}"
    );
}
