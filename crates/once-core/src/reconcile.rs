//! What a reconciler's verdict allows (SPEC §4, door 2).
//!
//! A reconciler looks up provider truth; the ledger, not the reconciler, decides what that truth
//! permits. A confirmed match settles the operation CONFIRMED. A miss settles it ABSENT only
//! when the provider's misses are authoritative, the provider has had its settle time since the
//! last attempt began, and the provider deduplicates by our provider key (so that a new
//! execution after ABSENT cannot double a late-landing effect). Anything else leaves the
//! operation UNKNOWN, with an event that says why, and schedules the next lookup.

use serde_json::json;

use crate::machine::{Plan, Write};
use crate::model::*;

/// What a provider can promise, declared by its reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// A lookup that finds nothing means the effect did not happen (after the settle time).
    pub miss_is_authoritative: bool,
    /// How long after a write a lookup may still miss it.
    pub settle_time_ms: i64,
    /// The provider deduplicates requests by our provider key (e.g. Stripe's Idempotency-Key).
    pub dedupes_by_provider_key: bool,
}

/// What a reconciler found at the provider.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The effect happened: the provider's reference, the result to replay, and sanitised
    /// evidence (JSON).
    Confirmed {
        provider_ref: String,
        result: Vec<u8>,
        evidence: String,
    },
    /// The lookup found no effect; sanitised evidence (JSON).
    Absent { evidence: String },
    /// The lookup could not tell: timeouts, permission errors, rate limits, partial pages,
    /// ambiguous matches.
    Unknown { why: String },
}

/// How lookups of one UNKNOWN operation are spaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first_ms: i64,
    pub max_ms: i64,
}

impl Backoff {
    /// The pause after `lookups` lookups: doubling from `first_ms`, capped at `max_ms`, with
    /// `jitter` (0.0..1.0) taking off up to half of it so replicas do not move in step.
    pub fn after(&self, lookups: u32, jitter: f64) -> i64 {
        let doubled = self
            .first_ms
            .saturating_mul(1i64 << lookups.min(30).saturating_sub(1));
        let capped = doubled.min(self.max_ms).max(1);
        capped - (capped as f64 * 0.5 * jitter.clamp(0.0, 1.0)) as i64
    }
}

/// One reconciler as the ledger sees it: its name, what its provider promises, and how its
/// lookups of one operation are spaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupPolicy {
    pub name: String,
    pub capabilities: Capabilities,
    pub backoff: Backoff,
    pub escalation: Escalation,
}

/// When an operation that stays UNKNOWN is escalated to people.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Escalation {
    /// After this many inconclusive lookups.
    pub after_lookups: Option<u32>,
    /// Once this long has passed since the last attempt began.
    pub after_ms: Option<i64>,
}

impl Escalation {
    /// Whether the lookup that took `op` to `lookups` lookups at `now` crosses a threshold.
    fn crossed(&self, op: &Operation, lookups: u32, now: Millis) -> bool {
        let by_count = self.after_lookups.is_some_and(|n| lookups == n);
        let by_age = self.after_ms.is_some_and(|age| {
            let due = op.lease_started_at + age;
            op.updated_at < due && due <= now
        });
        by_count || by_age
    }
}

/// Whether the operation is due for a lookup now.
pub fn is_due(op: &Operation, now: Millis) -> bool {
    op.state == State::Unknown
        && op.provider.is_some()
        && op.reconcile_next_at.is_some_and(|at| at <= now)
}

/// Applies a verdict from reconciler `name` to an UNKNOWN operation. Returns the state after.
/// An operation that is no longer UNKNOWN is left as it is.
pub fn apply_verdict(
    op: &Operation,
    verdict: &Verdict,
    policy: &LookupPolicy,
    jitter: f64,
    now: Millis,
) -> (State, Plan) {
    let (capabilities, backoff) = (&policy.capabilities, &policy.backoff);
    if op.state != State::Unknown {
        return (op.state, Plan::default());
    }
    let actor = format!("reconciler:{}", policy.name);
    let mut next = op.clone();
    next.updated_at = now;
    next.reconcile_lookups = op.reconcile_lookups + 1;
    let settled = |mut next: Operation, to: State, evidence: &str, reason: String| {
        next.state = to;
        next.source = Source::Reconciler;
        next.reason = Some(reason.clone());
        next.expires_at = Some(now + op.retention_ms);
        next.reconcile_next_at = None;
        let event = NewEvent {
            kind: EventKind::Reconciled,
            from: Some(State::Unknown),
            to: Some(to),
            attempt: Some(op.attempt),
            actor: actor.clone(),
            reason: Some(reason),
            details: Some(json!({ "evidence": serde_json::from_str::<serde_json::Value>(evidence).unwrap_or_else(|_| evidence.into()), "lookups": next.reconcile_lookups }).to_string()),
            dedupe_key: None,
        };
        (
            to,
            Plan {
                operation: Some(Write::Update(next)),
                attempt: None,
                events: vec![event],
            },
        )
    };

    let inconclusive = match verdict {
        Verdict::Confirmed {
            provider_ref,
            result,
            evidence,
        } => {
            let mut next = next;
            next.result = Some(result.clone());
            next.provider_ref = Some(provider_ref.clone());
            return settled(
                next,
                State::Confirmed,
                evidence,
                format!("the provider holds the effect as {provider_ref}"),
            );
        }
        Verdict::Unknown { why } => format!("the lookup could not tell: {why}"),
        Verdict::Absent { evidence } => {
            let settles_at = op.lease_started_at + capabilities.settle_time_ms;
            if !capabilities.miss_is_authoritative {
                format!(
                    "the provider found nothing, but its misses are not authoritative ({evidence})"
                )
            } else if now < settles_at {
                format!(
                    "the provider found nothing, but only {} ms after the attempt began; its settle time is {} ms",
                    now - op.lease_started_at,
                    capabilities.settle_time_ms
                )
            } else if !capabilities.dedupes_by_provider_key {
                format!(
                    "the provider found nothing, but it does not deduplicate by provider key, so ABSENT \
                     could let a new execution double a late effect: awaiting an operator ({evidence})"
                )
            } else {
                return settled(
                    next,
                    State::Absent,
                    evidence,
                    "the provider has no record of the effect".to_owned(),
                );
            }
        }
    };
    next.reconcile_next_at = Some(now + backoff.after(next.reconcile_lookups, jitter));
    let escalated = policy
        .escalation
        .crossed(op, next.reconcile_lookups, now)
        .then(|| NewEvent {
            kind: EventKind::Escalated,
            from: None,
            to: None,
            attempt: Some(op.attempt),
            actor: "ledger".to_owned(),
            reason: Some(format!(
                "still UNKNOWN after {} lookups; needs an operator",
                next.reconcile_lookups
            )),
            details: None,
            dedupe_key: Some(format!("ESCALATED:{}", op.attempt)),
        });
    let event = NewEvent {
        kind: EventKind::LookupInconclusive,
        from: None,
        to: None,
        attempt: Some(op.attempt),
        actor,
        reason: Some(inconclusive),
        details: Some(
            json!({ "lookups": next.reconcile_lookups, "next_lookup_at": next.reconcile_next_at })
                .to_string(),
        ),
        dedupe_key: None,
    };
    (
        State::Unknown,
        Plan {
            operation: Some(Write::Update(next)),
            attempt: None,
            events: std::iter::once(event).chain(escalated).collect(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Fingerprint;

    const T0: Millis = 1_000_000;
    const SETTLE: i64 = 5_000;
    const BACKOFF: Backoff = Backoff {
        first_ms: 1_000,
        max_ms: 60_000,
    };
    const STRIPE: Capabilities = Capabilities {
        miss_is_authoritative: true,
        settle_time_ms: SETTLE,
        dedupes_by_provider_key: true,
    };

    fn unknown() -> Operation {
        let cmd = BeginCommand {
            tenant: "t".into(),
            operation_id: OperationId::parse("id", "refund:o1").unwrap(),
            tool: "refund".into(),
            fingerprint: Fingerprint([1; 32]),
            attempt_id: "a1".into(),
            context: AttemptContext::default(),
            lease_ttl_ms: 1_000,
            retention_ms: 600_000,
            new_intent: false,
            provider: Some("stripe".into()),
            lookup_hints: Some(r#"{"payment_intent":"pi_1"}"#.into()),
            actor: "executor:test".into(),
        };
        let (_, plan) = crate::machine::begin(None, &cmd, None, T0);
        let in_flight = plan.operation.unwrap().operation().clone();
        let plan = crate::machine::expire_lease(&in_flight, T0 + 1_000).unwrap();
        let op = plan.operation.unwrap().operation().clone();
        assert_eq!(
            op.reconcile_next_at,
            Some(T0 + 1_000),
            "due at once on entering UNKNOWN"
        );
        op
    }

    fn absent() -> Verdict {
        Verdict::Absent {
            evidence: r#"{"pages":1}"#.into(),
        }
    }

    fn policy(capabilities: Capabilities) -> LookupPolicy {
        LookupPolicy {
            name: "stripe".into(),
            capabilities,
            backoff: BACKOFF,
            escalation: Escalation::default(),
        }
    }

    fn check(
        capabilities: Capabilities,
        verdict: Verdict,
        now: Millis,
        expected: State,
        kind: EventKind,
    ) -> Operation {
        let (state, plan) = apply_verdict(&unknown(), &verdict, &policy(capabilities), 0.0, now);
        assert_eq!(
            state, expected,
            "{verdict:?} with {capabilities:?} at {now}"
        );
        assert_eq!(plan.events.len(), 1);
        assert_eq!(plan.events[0].kind, kind);
        assert_eq!(plan.events[0].actor, "reconciler:stripe");
        plan.operation.unwrap().operation().clone()
    }

    #[test]
    fn a_confirmed_match_settles_and_stores_the_result() {
        let verdict = Verdict::Confirmed {
            provider_ref: "re_1".into(),
            result: b"{}".to_vec(),
            evidence: "{}".into(),
        };
        let op = check(
            STRIPE,
            verdict,
            T0 + 1_500,
            State::Confirmed,
            EventKind::Reconciled,
        );
        assert_eq!(
            (op.provider_ref.as_deref(), op.source),
            (Some("re_1"), Source::Reconciler)
        );
        assert_eq!(op.reconcile_next_at, None);
    }

    #[test]
    fn a_miss_settles_absent_only_when_authoritative_settled_and_deduplicated() {
        let after_settle = T0 + SETTLE;
        check(
            STRIPE,
            absent(),
            after_settle,
            State::Absent,
            EventKind::Reconciled,
        );
        let op = check(
            STRIPE,
            absent(),
            after_settle - 1,
            State::Unknown,
            EventKind::LookupInconclusive,
        );
        assert_eq!(op.reconcile_next_at, Some(after_settle - 1 + 1_000));
        let not_authoritative = Capabilities {
            miss_is_authoritative: false,
            ..STRIPE
        };
        check(
            not_authoritative,
            absent(),
            after_settle,
            State::Unknown,
            EventKind::LookupInconclusive,
        );
        let no_dedupe = Capabilities {
            dedupes_by_provider_key: false,
            ..STRIPE
        };
        let (_, plan) = apply_verdict(&unknown(), &absent(), &policy(no_dedupe), 0.0, after_settle);
        assert!(plan.events[0]
            .reason
            .as_deref()
            .unwrap()
            .contains("awaiting an operator"));
        check(
            STRIPE,
            Verdict::Unknown {
                why: "rate limited".into(),
            },
            after_settle,
            State::Unknown,
            EventKind::LookupInconclusive,
        );
    }

    #[test]
    fn settled_operations_ignore_verdicts() {
        let mut op = unknown();
        op.state = State::Confirmed;
        let (state, plan) = apply_verdict(&op, &absent(), &policy(STRIPE), 0.0, T0 + SETTLE);
        assert_eq!(state, State::Confirmed);
        assert!(plan.is_empty());
    }

    #[test]
    fn lookups_back_off_exponentially_with_a_cap_and_jitter() {
        assert_eq!(BACKOFF.after(1, 0.0), 1_000);
        assert_eq!(BACKOFF.after(2, 0.0), 2_000);
        assert_eq!(BACKOFF.after(5, 0.0), 16_000);
        assert_eq!(BACKOFF.after(30, 0.0), 60_000);
        assert_eq!(BACKOFF.after(2, 1.0), 1_000);
        let mut op = unknown();
        for lookups in 1..=4 {
            let (_, plan) = apply_verdict(
                &op,
                &Verdict::Unknown { why: "503".into() },
                &policy(STRIPE),
                0.0,
                T0,
            );
            op = plan.operation.unwrap().operation().clone();
            assert_eq!(op.reconcile_lookups, lookups);
            assert_eq!(op.reconcile_next_at, Some(T0 + BACKOFF.after(lookups, 0.0)));
        }
    }
}

#[cfg(test)]
mod escalation_tests {
    use super::*;

    #[test]
    fn escalates_once_when_a_threshold_is_crossed() {
        let escalation = Escalation {
            after_lookups: Some(3),
            after_ms: Some(10_000),
        };
        let mut op = test_operation();
        op.updated_at = 5_000;
        assert!(!escalation.crossed(&op, 2, 6_000));
        assert!(escalation.crossed(&op, 3, 6_000), "by count");
        assert!(!escalation.crossed(&op, 4, 6_000));
        assert!(escalation.crossed(&op, 4, 10_000), "by age");
        op.updated_at = 10_000;
        assert!(
            !escalation.crossed(&op, 5, 12_000),
            "only the lookup that crosses the age escalates"
        );
    }

    fn test_operation() -> Operation {
        Operation {
            tenant: "t".into(),
            operation_id: OperationId::parse("id", "x").unwrap(),
            tool: "tool".into(),
            fingerprint: crate::identity::Fingerprint([0; 32]),
            state: State::Unknown,
            source: Source::Lease,
            attempt: 1,
            attempt_id: "a".into(),
            lease_started_at: 0,
            lease_deadline: 0,
            result: None,
            provider_ref: None,
            provider_key: "k".into(),
            provider: Some("stripe".into()),
            lookup_hints: None,
            retention_ms: 0,
            created_at: 0,
            updated_at: 0,
            expires_at: None,
            reason: None,
            resolution_id: None,
            reconcile_lookups: 0,
            reconcile_next_at: Some(0),
        }
    }
}
