//! What a reconciler's verdict allows (docs/semantics.md §5).
//!
//! A reconciler looks up provider truth; the ledger, not the reconciler, decides what that truth
//! permits. A confirmed match settles the operation CONFIRMED. A miss settles it ABSENT only
//! when the provider's misses are authoritative, the lookup was *issued* at least the settle
//! time after the latest moment the effect could have been written (the operation's
//! [effect horizon](Operation::effect_horizon)), and the provider deduplicates by our provider
//! key (so that a new execution after ABSENT cannot double a late-landing effect). Anything else
//! leaves the operation UNKNOWN, with an event that says why, and schedules the next lookup.
//!
//! Every lookup runs under a claim ([`Lookup`]) and judges the operation as it was when
//! claimed: a verdict applies only if nothing about the operation changed since, so a slow
//! lookup about one attempt is never applied to another.

use serde_json::json;

use crate::machine::{moved, proven, Plan, Write};
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

impl Verdict {
    /// `confirmed`, `absent` or `unknown`.
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Confirmed { .. } => "confirmed",
            Verdict::Absent { .. } => "absent",
            Verdict::Unknown { .. } => "unknown",
        }
    }
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

/// One reconciler as the ledger sees it: its name, what its provider promises, how its lookups
/// of one operation are spaced, and the largest result it may store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupPolicy {
    pub name: String,
    pub capabilities: Capabilities,
    pub backoff: Backoff,
    pub escalation: Escalation,
    /// The same limit a Confirm's result is held to.
    pub max_result_bytes: usize,
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
    /// By age, the lookup that crosses the threshold escalates — or the first lookup, when the
    /// operation became UNKNOWN only after it.
    fn crossed(&self, op: &Operation, lookups: u32, now: Millis) -> bool {
        let by_count = self.after_lookups.is_some_and(|n| lookups == n);
        let by_age = self.after_ms.is_some_and(|age| {
            let due = op.lease_started_at + age;
            due <= now && (op.updated_at < due || lookups == 1)
        });
        by_count || by_age
    }
}

/// The claim a lookup ran under, read from the store in the claiming statement: which life and
/// attempt of the operation it looks up, the operation's version when claimed, and when the
/// lookup was issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    pub life: FencingToken,
    pub fencing_token: FencingToken,
    pub version: i64,
    pub issued_at: Millis,
    /// The operator who asked for it now, recorded with its events as `asked_by`; `None` for
    /// the workers' own lookups.
    pub asked_by: Option<Actor>,
}

impl Lookup {
    /// The claim of a lookup of `op` as it is now, issued at `issued_at`.
    pub fn of(op: &Operation, issued_at: Millis) -> Self {
        Self {
            life: op.life,
            fencing_token: op.fencing_token,
            version: op.version,
            issued_at,
            asked_by: None,
        }
    }
}

/// What applying a verdict did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The verdict was judged; the operation is now in this state.
    Judged(State),
    /// The operation changed after the lookup was claimed (a report, a resolution, another
    /// lookup, a new attempt): the verdict is about something that no longer is, and is dropped.
    Stale,
}

/// A lookup found this life's effect at the provider, but the operation moved on while it
/// looked. ABSENT becomes CONFIRMED, recording the contradiction; an attempt running now may
/// perform the effect again, so an IN_FLIGHT operation is held for an operator, with the found
/// effect as its proof. A CONFIRMED operation whose effect on record is another provider object
/// keeps its truth, and the second object is recorded as DOUBLE_EXECUTION. Another attempt's
/// UNKNOWN, or a CONFIRMED operation holding this very object (or none to compare), is left as
/// it is (the next lookup judges an UNKNOWN one again).
fn proven_after_all(
    op: &Operation,
    finder: &Finder,
    found: (&str, Vec<u8>),
    evidence: &str,
    now: Millis,
) -> (Applied, Plan) {
    let (provider_ref, result) = found;
    let event = |kind, to: State, reason: String| {
        NewEvent::transition(op, kind, (op.state, to), op.attempt, finder.actor.clone())
            .because(reason)
            .with_details(
                finder.details(json!({ "evidence": evidence, "provider_ref": provider_ref })),
            )
    };
    let (to, source, events) = match op.state {
        State::Absent => {
            let contradicted = NewEvent::anomaly(
                op,
                EventKind::ResolutionContradicted,
                op.attempt,
                finder.actor.clone(),
                format!("ref:{provider_ref}"),
            )
            .because(format!(
                "the provider holds the effect as {provider_ref} although a {} said ABSENT",
                op.source.as_str()
            ))
            .with_details(finder.details(json!({ "evidence": evidence, "provider_ref": provider_ref })));
            let settled = event(
                EventKind::Reconciled,
                State::Confirmed,
                format!("the provider holds the effect as {provider_ref}"),
            );
            (
                State::Confirmed,
                Source::Reconciler,
                vec![settled, contradicted],
            )
        }
        State::InFlight => (
            State::Unknown,
            Source::Anomaly,
            vec![event(
                EventKind::DoubleExecution,
                State::Unknown,
                format!(
                    "the provider holds the effect as {provider_ref} while attempt {} runs; held for an operator",
                    op.attempt
                ),
            )],
        ),
        State::Confirmed => {
            let plan = match op.provider_ref.as_deref() {
                Some(on_record) if on_record != provider_ref => Plan {
                    events: vec![NewEvent::anomaly(
                        op,
                        EventKind::DoubleExecution,
                        op.attempt,
                        finder.actor.clone(),
                        format!("ref:{provider_ref}"),
                    )
                    .because(format!(
                        "the provider holds {provider_ref} besides {on_record}, the effect on record: the effect happened twice"
                    ))
                    .with_details(finder.details(json!({
                        "evidence": evidence,
                        "provider_ref": provider_ref,
                        "on_record": on_record,
                    })))],
                    ..Plan::default()
                },
                _ => Plan::default(),
            };
            return (Applied::Stale, plan);
        }
        State::Unknown => return (Applied::Stale, Plan::default()),
    };
    let effect = (result, Some(provider_ref.to_owned()));
    let mut next = proven(op, to, source, effect, None, now);
    next.reason = events[0].reason.clone();
    let plan = Plan {
        operation: Some(Write::Update(next)),
        events,
        ..Plan::default()
    };
    (Applied::Judged(to), plan)
}

/// Whether the operation is due for a lookup now, and no lookup holds it.
pub fn is_due(op: &Operation, now: Millis) -> bool {
    op.state == State::Unknown
        && op.provider.is_some()
        && !op.held_for_operator()
        && op.reconcile_next_at.is_some_and(|at| at <= now)
        && op.lookup_claimed_until.is_none_or(|until| until <= now)
}

/// A result the store can keep: the provider's record as found, or, when it is over the result
/// limit, a small document naming the provider's reference instead. The truth (CONFIRMED, and
/// the reference) is kept either way.
pub fn bounded_result(result: &[u8], provider_ref: &str, max_bytes: usize) -> Vec<u8> {
    if result.len() <= max_bytes {
        return result.to_vec();
    }
    json!({
        "provider_ref": provider_ref,
        "result_omitted": format!(
            "the provider's record is {} bytes, over the {max_bytes}-byte result limit; look it up by provider_ref",
            result.len()
        ),
    })
    .to_string()
    .into_bytes()
}

/// What a verdict means for the operation as its lookup claimed it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Judgement<'v> {
    /// The provider holds the effect.
    Found {
        provider_ref: &'v str,
        result: &'v [u8],
        evidence: &'v str,
    },
    /// The provider's miss is proof the effect did not happen.
    Missing { evidence: &'v str },
    /// The operation stays UNKNOWN, for this reason.
    Inconclusive(String),
}

/// Decides what a verdict means, by the provider's capabilities and the time the lookup was
/// issued: a miss is proof only from a provider whose misses are authoritative, that
/// deduplicates by provider key, asked at least its settle time after the effect horizon.
fn judge<'v>(
    op: &Operation,
    lookup: &Lookup,
    verdict: &'v Verdict,
    capabilities: &Capabilities,
) -> Judgement<'v> {
    match verdict {
        Verdict::Confirmed {
            provider_ref,
            result,
            evidence,
        } => Judgement::Found {
            provider_ref,
            result,
            evidence,
        },
        Verdict::Unknown { why } => {
            Judgement::Inconclusive(format!("the lookup could not tell: {why}"))
        }
        Verdict::Absent { evidence } => {
            let horizon = op.effect_horizon();
            let settles_at = horizon.saturating_add(capabilities.settle_time_ms);
            if !capabilities.miss_is_authoritative {
                Judgement::Inconclusive(format!(
                    "the provider found nothing, but its misses are not authoritative ({evidence})"
                ))
            } else if lookup.issued_at < settles_at {
                Judgement::Inconclusive(format!(
                    "the provider found nothing, but the lookup was issued {} ms after the effect could last have been written; its settle time is {} ms",
                    lookup.issued_at - horizon,
                    capabilities.settle_time_ms
                ))
            } else if !capabilities.dedupes_by_provider_key {
                Judgement::Inconclusive(format!(
                    "the provider found nothing, but it does not deduplicate by provider key, so ABSENT \
                     could let a new execution double a late effect: awaiting an operator ({evidence})"
                ))
            } else {
                Judgement::Missing { evidence }
            }
        }
    }
}

/// Who records a lookup's events, and what each of them says of the lookup besides its own
/// details: what the provider answered (`found`: CONFIRMED, ABSENT or UNKNOWN, which the figures
/// of its lookups count) and the operator who asked for the lookup, if one did (`asked_by`).
struct Finder {
    actor: Actor,
    found: State,
    asked_by: Option<String>,
}

impl Finder {
    fn new(lookup: &Lookup, verdict: &Verdict, policy: &LookupPolicy) -> Self {
        let found = match verdict {
            Verdict::Confirmed { .. } => State::Confirmed,
            Verdict::Absent { .. } => State::Absent,
            Verdict::Unknown { .. } => State::Unknown,
        };
        Finder {
            actor: Actor::Reconciler(policy.name.clone()),
            found,
            asked_by: lookup.asked_by.as_ref().map(Actor::to_string),
        }
    }

    /// `details` (an object) with what the lookup found and who asked for it.
    fn details(&self, mut details: serde_json::Value) -> serde_json::Value {
        details["found"] = self.found.as_str().into();
        if let Some(asked_by) = &self.asked_by {
            details["asked_by"] = asked_by.as_str().into();
        }
        details
    }
}

/// Applies a verdict from a lookup of `op` claimed as `lookup`. Every event the reconciler
/// records says what it found and who asked for the lookup ([`Finder`]).
pub fn apply_verdict(
    op: &Operation,
    lookup: &Lookup,
    verdict: &Verdict,
    policy: &LookupPolicy,
    jitter: f64,
    now: Millis,
) -> (Applied, Plan) {
    let finder = Finder::new(lookup, verdict, policy);
    let same_life = op.life == lookup.life;
    let open = op.state == State::Unknown && !op.held_for_operator();
    let found = matches!(verdict, Verdict::Confirmed { .. });
    // A verdict judges the operation as its lookup claimed it. The effect of the attempt it
    // looked up, found, stays found even if that attempt reported UNKNOWN again meanwhile.
    let as_claimed = open
        && same_life
        && op.fencing_token == lookup.fencing_token
        && (op.version == lookup.version || found);
    if !as_claimed {
        // A verdict about an earlier life, or one that found nothing, says nothing about the
        // operation as it is now. But this life's effect, found after all, is proof: it must
        // not leave the operation executable.
        return match verdict {
            Verdict::Confirmed {
                provider_ref,
                result,
                evidence,
            } if same_life => {
                let result = bounded_result(result, provider_ref, policy.max_result_bytes);
                proven_after_all(op, &finder, (provider_ref, result), evidence, now)
            }
            _ => (Applied::Stale, Plan::default()),
        };
    }
    let lookups = op.reconcile_lookups + 1;
    let (to, mut next, reason, evidence) = match judge(op, lookup, verdict, &policy.capabilities) {
        Judgement::Found {
            provider_ref,
            result,
            evidence,
        } => {
            let result = bounded_result(result, provider_ref, policy.max_result_bytes);
            let effect = (result, Some(provider_ref.to_owned()));
            let next = proven(op, State::Confirmed, Source::Reconciler, effect, None, now);
            let reason = format!("the provider holds the effect as {provider_ref}");
            (State::Confirmed, next, reason, evidence)
        }
        Judgement::Missing { evidence } => {
            let mut next = moved(op, State::Absent, Source::Reconciler, now);
            next.declared_absent_token = Some(op.fencing_token);
            let reason = "the provider has no record of the effect".to_owned();
            (State::Absent, next, reason, evidence)
        }
        Judgement::Inconclusive(why) => {
            return kept_unknown(op, lookup, policy, (&finder, why), jitter, now);
        }
    };
    next.reconcile_lookups = lookups;
    next.reason = Some(reason.clone());
    let evidence =
        serde_json::from_str::<serde_json::Value>(evidence).unwrap_or_else(|_| evidence.into());
    let event = NewEvent::transition(
        op,
        EventKind::Reconciled,
        (State::Unknown, to),
        op.attempt,
        finder.actor.clone(),
    )
    .because(reason)
    .with_details(finder.details(
        json!({ "evidence": evidence, "lookups": lookups, "issued_at": lookup.issued_at }),
    ));
    let plan = Plan {
        operation: Some(Write::Update(next)),
        events: vec![event],
        ..Plan::default()
    };
    (Applied::Judged(to), plan)
}

/// A lookup left the operation UNKNOWN, for `why`: the next one after a capped, jittered
/// backoff, and an escalation when this lookup crosses the policy's threshold.
fn kept_unknown(
    op: &Operation,
    lookup: &Lookup,
    policy: &LookupPolicy,
    (finder, why): (&Finder, String),
    jitter: f64,
    now: Millis,
) -> (Applied, Plan) {
    let lookups = op.reconcile_lookups + 1;
    let mut next = op.clone();
    next.updated_at = now;
    next.reconcile_lookups = lookups;
    next.reconcile_next_at = Some(now + policy.backoff.after(lookups, jitter));
    next.lookup_claimed_until = None;
    let escalated = policy.escalation.crossed(op, lookups, now).then(|| {
        NewEvent::anomaly(
            op,
            EventKind::Escalated,
            op.attempt,
            Actor::Ledger,
            op.fencing_token,
        )
        .because(format!(
            "still UNKNOWN after {lookups} lookups; needs an operator"
        ))
    });
    let event = NewEvent::note(
        op,
        EventKind::LookupInconclusive,
        op.attempt,
        finder.actor.clone(),
    )
    .because(why)
    .with_details(finder.details(json!({
        "lookups": lookups,
        "next_lookup_at": next.reconcile_next_at,
        "issued_at": lookup.issued_at,
    })));
    (
        Applied::Judged(State::Unknown),
        Plan {
            operation: Some(Write::Update(next)),
            events: std::iter::once(event).chain(escalated).collect(),
            ..Plan::default()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Fingerprint;
    use crate::machine::{self, BeginStep, FreshIdGuard};

    const T0: Millis = 1_000_000;
    const LEASE: i64 = 1_000;
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
    /// When the lease of the operation [`unknown`] returns ran out, and it became UNKNOWN.
    const EXPIRED: Millis = T0 + LEASE;

    fn unknown() -> Operation {
        let cmd = BeginCommand {
            tenant: "t".into(),
            operation_id: OperationId::parse("id", "refund:o1").unwrap(),
            tool: "refund".into(),
            fingerprint: Fingerprint([1; 32]),
            attempt_id: "a1".into(),
            context: AttemptContext::default(),
            lease_ttl_ms: LEASE,
            retention_ms: 600_000,
            new_intent: false,
            provider: Some("stripe".into()),
            lookup_hints: Some(r#"{"payment_intent":"pi_1"}"#.into()),
            actor: Actor::Executor("test".into()),
            holder: None,
            held: false,
        };
        assert_eq!(machine::begin(None, &cmd, T0), BeginStep::Claim);
        let (_, plan) = machine::claim(
            None,
            &cmd,
            FreshIdGuard::Clear {
                token: FencingToken(7),
            },
            T0,
        );
        let in_flight = plan.operation.unwrap().operation().clone();
        let plan = machine::expire_lease(&in_flight, EXPIRED).unwrap();
        let op = plan.operation.unwrap().operation().clone();
        assert_eq!(
            op.reconcile_next_at,
            Some(EXPIRED),
            "due at once on entering UNKNOWN"
        );
        op
    }

    /// A lookup claimed on `op` as it is now, issued at `at`.
    fn claimed(op: &Operation, at: Millis) -> Lookup {
        Lookup::of(op, at)
    }

    fn found(provider_ref: &str) -> Verdict {
        Verdict::Confirmed {
            provider_ref: provider_ref.into(),
            result: b"{}".to_vec(),
            evidence: "{}".into(),
        }
    }

    /// Applies `verdict` from `lookup` to `op` at `now`, under the stripe-like policy.
    fn judge(op: &Operation, lookup: &Lookup, verdict: &Verdict, now: Millis) -> (Applied, Plan) {
        apply_verdict(op, lookup, verdict, &policy(STRIPE), 0.0, now)
    }

    /// A lookup claimed on `op` as soon as its settle time passed.
    fn claimed_after_settling(op: &Operation) -> Lookup {
        claimed(op, EXPIRED + SETTLE)
    }

    /// Applies `verdict` from `lookup` to `op` as soon as the settle time passed.
    fn judged(op: &Operation, lookup: &Lookup, verdict: &Verdict) -> (Applied, Plan) {
        judge(op, lookup, verdict, EXPIRED + SETTLE)
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
            max_result_bytes: 64,
        }
    }

    /// Applies `verdict` from a lookup issued at `issued` and judged at `issued + 10`.
    fn check(
        capabilities: Capabilities,
        verdict: Verdict,
        issued: Millis,
        expected: State,
        kind: EventKind,
    ) -> Operation {
        let op = unknown();
        let (applied, plan) = apply_verdict(
            &op,
            &claimed(&op, issued),
            &verdict,
            &policy(capabilities),
            0.0,
            issued + 10,
        );
        assert_eq!(
            applied,
            Applied::Judged(expected),
            "{verdict:?} with {capabilities:?} issued at {issued}"
        );
        assert_eq!(plan.events.len(), 1);
        assert_eq!(plan.events[0].kind, kind);
        assert_eq!(plan.events[0].actor, Actor::Reconciler("stripe".into()));
        plan.operation.unwrap().operation().clone()
    }

    #[test]
    fn a_confirmed_match_settles_and_stores_the_result() {
        let op = check(
            STRIPE,
            found("re_1"),
            EXPIRED + 10,
            State::Confirmed,
            EventKind::Reconciled,
        );
        assert_eq!(
            (op.provider_ref.as_deref(), op.source),
            (Some("re_1"), Source::Reconciler)
        );
        assert_eq!(op.reconcile_next_at, None);
        assert_eq!(op.lookup_claimed_until, None);
    }

    #[test]
    fn a_result_over_the_limit_keeps_the_truth_and_a_reference() {
        let verdict = Verdict::Confirmed {
            provider_ref: "re_big".into(),
            result: vec![b'x'; 65],
            evidence: "{}".into(),
        };
        let op = check(
            STRIPE,
            verdict,
            EXPIRED + 10,
            State::Confirmed,
            EventKind::Reconciled,
        );
        let stored: serde_json::Value =
            serde_json::from_slice(op.result.as_deref().unwrap()).unwrap();
        assert_eq!(stored["provider_ref"], "re_big");
        assert!(stored["result_omitted"]
            .as_str()
            .unwrap()
            .contains("65 bytes"));
        assert_eq!(op.provider_ref.as_deref(), Some("re_big"));
    }

    #[test]
    fn a_miss_settles_absent_only_when_authoritative_issued_after_the_settle_time_and_deduplicated()
    {
        let issued_after_settle = EXPIRED + SETTLE;
        let op = check(
            STRIPE,
            absent(),
            issued_after_settle,
            State::Absent,
            EventKind::Reconciled,
        );
        assert_eq!(op.declared_absent_token, Some(FencingToken(7)));
        let op = check(
            STRIPE,
            absent(),
            issued_after_settle - 1,
            State::Unknown,
            EventKind::LookupInconclusive,
        );
        assert_eq!(op.reconcile_next_at, Some(issued_after_settle + 9 + 1_000));
        let not_authoritative = Capabilities {
            miss_is_authoritative: false,
            ..STRIPE
        };
        check(
            not_authoritative,
            absent(),
            issued_after_settle,
            State::Unknown,
            EventKind::LookupInconclusive,
        );
        let no_dedupe = Capabilities {
            dedupes_by_provider_key: false,
            ..STRIPE
        };
        let op = unknown();
        let (_, plan) = apply_verdict(
            &op,
            &claimed(&op, issued_after_settle),
            &absent(),
            &policy(no_dedupe),
            0.0,
            issued_after_settle,
        );
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
            issued_after_settle,
            State::Unknown,
            EventKind::LookupInconclusive,
        );
    }

    #[test]
    fn the_settle_time_runs_from_the_effect_horizon_and_is_judged_when_the_lookup_was_issued() {
        // A lookup issued before the settle time, however late it is applied, proves nothing.
        let op = unknown();
        let (applied, _) = judge(
            &op,
            &claimed(&op, EXPIRED + SETTLE - 1),
            &absent(),
            EXPIRED + 100 * SETTLE,
        );
        assert_eq!(applied, Applied::Judged(State::Unknown));

        // The horizon is the latest of the lease deadline, the last report and when the
        // operation became UNKNOWN: an attempt that was still reporting moves it.
        let mut reported_late = unknown();
        reported_late.last_report_at = Some(EXPIRED + 3_000);
        assert_eq!(reported_late.effect_horizon(), EXPIRED + 3_000);
        let (applied, _) = judge(
            &reported_late,
            &claimed(&reported_late, EXPIRED + SETTLE),
            &absent(),
            EXPIRED + SETTLE,
        );
        assert_eq!(applied, Applied::Judged(State::Unknown));
        let mut extended = unknown();
        extended.lease_deadline = EXPIRED + 4_000;
        extended.unknown_since = Some(EXPIRED + 2_000);
        assert_eq!(extended.effect_horizon(), EXPIRED + 4_000);
    }

    /// A miss about an operation written since the lookup's claim is dropped; so is any verdict,
    /// even one that found the effect, about another life or another attempt.
    #[test]
    fn a_verdict_about_an_operation_that_changed_since_its_claim_is_dropped() {
        let op = unknown();
        let lookup = claimed_after_settling(&op);
        let mut written = op.clone();
        written.version += 1;
        let mut other_life = op.clone();
        other_life.life += 10;
        other_life.fencing_token += 10;
        let mut other_attempt = op.clone();
        other_attempt.fencing_token += 1;
        for (changed, verdict) in [
            (&written, absent()),
            (&other_life, found("re_1")),
            (&other_life, absent()),
            (&other_attempt, absent()),
        ] {
            let (applied, plan) = judged(changed, &lookup, &verdict);
            assert_eq!(applied, Applied::Stale, "{verdict:?}");
            assert!(plan.is_empty());
        }
    }

    #[test]
    fn this_lifes_effect_found_after_the_operation_moved_on_is_proof() {
        let op = unknown();
        let lookup = claimed_after_settling(&op);
        // Meanwhile an operator said ABSENT: the effect found contradicts it.
        let mut absent_now = op.clone();
        absent_now.state = State::Absent;
        absent_now.source = Source::Operator;
        absent_now.version += 1;
        let (applied, plan) = judged(&absent_now, &lookup, &found("re_1"));
        assert_eq!(applied, Applied::Judged(State::Confirmed));
        let kinds: Vec<EventKind> = plan.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [EventKind::Reconciled, EventKind::ResolutionContradicted]
        );
        // Meanwhile a new attempt runs: it may perform the effect again.
        let mut running = absent_now.clone();
        running.state = State::InFlight;
        running.fencing_token += 1;
        let (applied, plan) = judged(&running, &lookup, &found("re_1"));
        assert_eq!(applied, Applied::Judged(State::Unknown));
        let held = plan.operation.unwrap().operation().clone();
        assert!(held.held_for_operator());
        assert_eq!(held.provider_ref.as_deref(), Some("re_1"));
        assert_eq!(plan.events[0].kind, EventKind::DoubleExecution);
        // The same attempt, only reported UNKNOWN again meanwhile: found is found.
        let mut reported_again = op.clone();
        reported_again.version += 1;
        reported_again.last_report_at = Some(EXPIRED + 10);
        let (applied, _) = judged(&reported_again, &lookup, &found("re_1"));
        assert_eq!(applied, Applied::Judged(State::Confirmed));
        let (applied, _) = judged(&reported_again, &lookup, &absent());
        assert_eq!(
            applied,
            Applied::Stale,
            "a miss from before the report proves nothing"
        );
        // A miss, though, says nothing about what changed.
        let (applied, _) = judged(&absent_now, &lookup, &absent());
        assert_eq!(applied, Applied::Stale);
    }

    /// Every event a lookup's reconciler records, whatever the verdict came to (a transition, a
    /// note, a contradiction), says what the provider answered and which operator asked; the
    /// ledger's own escalation is not the reconciler's and says neither.
    #[test]
    fn every_event_a_reconciler_records_says_what_it_found_and_who_asked() {
        let op = unknown();
        let mut lookup = claimed_after_settling(&op);
        lookup.asked_by = Some(Actor::Operator("alice".into()));
        let mut absent_now = op.clone();
        absent_now.state = State::Absent;
        absent_now.version += 1;
        // Meanwhile a new attempt runs, or a late confirm stored another provider object.
        let mut running = absent_now.clone();
        running.state = State::InFlight;
        running.fencing_token += 1;
        let mut confirmed_otherwise = op.clone();
        confirmed_otherwise.state = State::Confirmed;
        confirmed_otherwise.provider_ref = Some("re_late".into());
        confirmed_otherwise.version += 1;
        let inconclusive = Verdict::Unknown {
            why: "rate limited".into(),
        };
        let mut escalating = policy(STRIPE);
        escalating.escalation.after_lookups = Some(1);
        let mut escalations = 0;
        let mut kinds = std::collections::BTreeSet::new();
        for (judged_op, verdict, policy) in [
            (&op, found("re_1"), policy(STRIPE)),
            (&op, absent(), policy(STRIPE)),
            (&absent_now, found("re_1"), policy(STRIPE)),
            (&running, found("re_1"), policy(STRIPE)),
            (&confirmed_otherwise, found("re_1"), policy(STRIPE)),
            (&op, inconclusive, escalating),
        ] {
            let (_, plan) =
                apply_verdict(judged_op, &lookup, &verdict, &policy, 0.0, EXPIRED + SETTLE);
            let found = match verdict {
                Verdict::Confirmed { .. } => "CONFIRMED",
                Verdict::Absent { .. } => "ABSENT",
                Verdict::Unknown { .. } => "UNKNOWN",
            };
            assert!(!plan.events.is_empty(), "{verdict:?}");
            for event in &plan.events {
                kinds.insert(event.kind.as_str());
                let details: serde_json::Value =
                    serde_json::from_str(event.details.as_deref().unwrap_or("{}")).unwrap();
                if event.actor == Actor::Ledger {
                    assert_eq!(event.kind, EventKind::Escalated);
                    escalations += 1;
                    assert!(details.get("found").is_none(), "{event:?}");
                } else {
                    assert_eq!(details["found"], found, "{event:?}");
                    assert_eq!(details["asked_by"], "operator:alice", "{event:?}");
                }
            }
        }
        assert_eq!(escalations, 1);
        let recorded = [
            EventKind::Reconciled,
            EventKind::ResolutionContradicted,
            EventKind::DoubleExecution,
            EventKind::LookupInconclusive,
        ];
        for kind in recorded {
            assert!(kinds.contains(kind.as_str()), "no {kind:?} among {kinds:?}");
        }
    }

    /// A late confirm settled the operation while a lookup ran, and the lookup found another
    /// provider object: two effects, recorded, and the truth on record kept. The same object
    /// again, or a confirm with no object to compare, is no second effect.
    #[test]
    fn a_lookup_finding_another_object_for_a_confirmed_operation_records_double_execution() {
        let op = unknown();
        let lookup = claimed_after_settling(&op);
        let mut confirmed = op.clone();
        confirmed.state = State::Confirmed;
        confirmed.provider_ref = Some("re_late".into());
        confirmed.version += 1;
        let (applied, plan) = judged(&confirmed, &lookup, &found("re_1"));
        assert_eq!(applied, Applied::Stale);
        assert!(plan.operation.is_none(), "CONFIRMED never changes");
        let kinds: Vec<EventKind> = plan.events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [EventKind::DoubleExecution]);
        assert!(plan.events[0].reason.as_deref().unwrap().contains("re_1"));
        for same in [Some("re_1"), None] {
            confirmed.provider_ref = same.map(str::to_owned);
            let (_, plan) = judged(&confirmed, &lookup, &found("re_1"));
            assert!(plan.is_empty(), "{same:?}");
        }
    }

    #[test]
    fn settled_and_held_operations_ignore_verdicts() {
        let mut op = unknown();
        op.state = State::Confirmed;
        let (applied, plan) = judge(&op, &claimed(&op, T0 + SETTLE), &absent(), T0 + SETTLE);
        assert_eq!(applied, Applied::Stale);
        assert!(plan.is_empty());
        let mut held = unknown();
        held.source = Source::Anomaly;
        assert!(!is_due(&held, EXPIRED + 1));
        let (applied, _) = judge(
            &held,
            &claimed(&held, EXPIRED + SETTLE),
            &absent(),
            EXPIRED + SETTLE,
        );
        assert_eq!(applied, Applied::Stale);
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
            let (_, plan) = judge(
                &op,
                &claimed(&op, T0),
                &Verdict::Unknown { why: "503".into() },
                T0,
            );
            op = plan.operation.unwrap().operation().clone();
            assert_eq!(op.reconcile_lookups, lookups);
            assert_eq!(op.reconcile_next_at, Some(T0 + BACKOFF.after(lookups, 0.0)));
        }
    }

    #[test]
    fn claims_hold_an_operation_until_they_lapse() {
        let mut op = unknown();
        assert!(is_due(&op, EXPIRED));
        op.lookup_claimed_until = Some(EXPIRED + 100);
        assert!(!is_due(&op, EXPIRED + 99));
        assert!(is_due(&op, EXPIRED + 100));
    }

    #[test]
    fn escalates_once_when_a_threshold_is_crossed() {
        let escalation = Escalation {
            after_lookups: Some(3),
            after_ms: Some(10_000),
        };
        let mut op = unknown();
        op.lease_started_at = 0;
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
        // UNKNOWN only after the age passed (a long lease): its first lookup escalates.
        op.updated_at = 12_000;
        assert!(escalation.crossed(&op, 1, 12_500));
        assert!(!escalation.crossed(&op, 2, 13_000));
    }
}
