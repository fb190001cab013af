//! Fuzzing of every request conversion the ledger runs on what arrives from the network:
//! arbitrary bytes decoded as each request (what a hostile peer sends), and requests built
//! field by field with the values that trouble validators (huge or negative durations, odd
//! numbers, near-JSON, any Unicode). A conversion accepts or refuses with a reason; it never
//! panics. PROPTEST_CASES cases each (256 in `make test`, far more under `make fuzz`); a
//! failing case is kept in `proptest-regressions/`.

use once_core::access::DEFAULT_TENANT;
use once_core::{Actor, Limits};
use proptest::prelude::*;
use prost::Message;

use crate::convert::{self, Caller};
use crate::pb;

fn caller() -> Caller {
    Caller {
        tenant: DEFAULT_TENANT.to_owned(),
        actor: Actor::Executor("fuzz".into()),
        holder: None,
    }
}

/// Text a caller could send in a string field.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9_:.-]{0,24}",
        any::<String>(),
        once_core::fuzzing::near_json(),
        Just(String::new()),
        "x{200,300}",
    ]
}

/// A duration as sent: any seconds and nanoseconds, the edges among them.
fn duration() -> impl Strategy<Value = Option<prost_types::Duration>> {
    let seconds = prop_oneof![any::<i64>(), -2..120i64, Just(i64::MAX), Just(i64::MIN)];
    let nanos = prop_oneof![any::<i32>(), 0..1_000_000_000i32];
    proptest::option::of(
        (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
    )
}

fn intent_part() -> impl Strategy<Value = pb::IntentPart> {
    use pb::intent_part::Kind;
    let kind = prop_oneof![
        text().prop_map(Kind::Text),
        any::<i64>().prop_map(Kind::Integer),
        any::<f64>().prop_map(Kind::Number),
        Just(Kind::Number(9_007_199_254_740_992.0)),
    ];
    proptest::option::of(kind).prop_map(|kind| pb::IntentPart { kind })
}

fn begin_request() -> impl Strategy<Value = pb::BeginRequest> {
    use pb::begin_request::{Effect, Identity};
    let identity = proptest::option::of(prop_oneof![
        text().prop_map(Identity::OperationId),
        prop::collection::vec(intent_part(), 0..4)
            .prop_map(|parts| Identity::Intent(pb::Intent { parts })),
        Just(Identity::Derived(pb::Derived {})),
    ]);
    let effect = proptest::option::of(prop_oneof![
        text().prop_map(Effect::ArgumentsJson),
        text().prop_map(Effect::Fingerprint),
        "[0-9a-f]{64}".prop_map(Effect::Fingerprint),
    ]);
    let context = proptest::option::of((text(), text(), text()).prop_map(
        |(client_name, session_id, request_id)| pb::AttemptContext {
            client_name,
            session_id,
            request_id,
        },
    ));
    (
        (
            text(),
            identity,
            effect,
            prop::collection::vec(text(), 0..3),
        ),
        (text(), context, duration(), duration(), any::<bool>()),
        (duration(), text(), text(), text(), text(), any::<bool>()),
    )
        .prop_map(
            |(
                (tool, identity, effect, volatile_fields),
                (attempt_id, context, lease_ttl, wait, new_intent),
                (
                    retention,
                    provider,
                    lookup_hints_json,
                    seen_position,
                    operation_position,
                    want_receipt,
                ),
            )| pb::BeginRequest {
                tool,
                identity,
                effect,
                volatile_fields,
                attempt_id,
                context,
                lease_ttl,
                wait,
                new_intent,
                retention,
                provider,
                lookup_hints_json,
                seen_position,
                operation_position,
                want_receipt,
            },
        )
}

/// Every request conversion, on one request decoded from `bytes` as each kind.
fn convert_all(bytes: &[u8], limits: &Limits) {
    if let Ok(req) = pb::BeginRequest::decode(bytes) {
        let _ = convert::begin(req, &caller(), limits);
    }
    if let Ok(req) = pb::ConfirmRequest::decode(bytes) {
        let _ = convert::report(req, None, limits);
    }
    if let Ok(req) = pb::RecoverOperationsRequest::decode(bytes) {
        let _ = convert::recover_positions(req);
    }
    if let Ok(req) = pb::ReportAbsentRequest::decode(bytes) {
        let _ = convert::report(req, None, limits);
    }
    if let Ok(req) = pb::ReportUnknownRequest::decode(bytes) {
        let _ = convert::report(req, None, limits);
    }
    if let Ok(req) = pb::HeartbeatRequest::decode(bytes) {
        let _ = convert::heartbeat(req, None, limits);
    }
    if let Ok(req) = pb::GetOperationRequest::decode(bytes) {
        let _ = convert::get_operation(req);
    }
    if let Ok(req) = pb::ReconcileRequest::decode(bytes) {
        let _ = convert::reconcile(req);
    }
    if let Ok(req) = pb::ListOperationsRequest::decode(bytes) {
        let _ = convert::list_operations(req);
    }
    if let Ok(req) = pb::WatchOperationsRequest::decode(bytes) {
        let _ = convert::watch_operations(req);
    }
    if let Ok(req) = pb::GetStatsRequest::decode(bytes) {
        let _ = convert::get_stats(req, limits.max_retention_ms);
    }
    if let Ok(req) = pb::GetForensicsRequest::decode(bytes) {
        let _ = convert::get_forensics(req, limits.max_retention_ms);
    }
    if let Ok(req) = pb::ResolveRequest::decode(bytes) {
        let _ = convert::resolve(req, limits);
    }
}

proptest! {
    /// Arbitrary bytes, decoded as every request: accepted or refused, never a panic.
    #[test]
    fn fuzz_requests_from_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        convert_all(&bytes, &Limits::default());
    }

    /// Begins built field by field, and their bytes with one byte changed, as every request.
    #[test]
    fn fuzz_begin_requests_accept_or_refuse(
        req in begin_request(),
        flip in any::<(prop::sample::Index, u8)>(),
    ) {
        let limits = Limits::default();
        let mut bytes = req.encode_to_vec();
        if let Ok(input) = convert::begin(req, &caller(), &limits) {
            let cmd = input.command;
            prop_assert!(cmd.lease_ttl_ms >= limits.min_lease_ms);
            prop_assert!(cmd.lease_ttl_ms <= limits.max_lease_ms);
            prop_assert!(cmd.retention_ms <= limits.max_retention_ms);
            prop_assert!((0..=limits.max_wait_ms).contains(&input.wait_ms));
        }
        if !bytes.is_empty() {
            let at = flip.0.index(bytes.len());
            bytes[at] ^= flip.1;
        }
        convert_all(&bytes, &limits);
    }

    /// Reports, heartbeats, lists, watches and resolutions built from odd values.
    #[test]
    fn fuzz_other_requests_accept_or_refuse(
        (operation_id, provider_ref, reason) in (text(), text(), text()),
        token in prop_oneof![any::<u64>(), Just(0u64), Just(u64::MAX)],
        (span, states, page_size) in (duration(), prop::collection::vec(any::<i32>(), 0..4), any::<u32>()),
        (after_sequence, from_now, outcome) in (any::<i64>(), any::<bool>(), any::<i32>()),
    ) {
        let limits = Limits::default();
        let _ = convert::report(
            pb::ConfirmRequest {
                operation_id: operation_id.clone(),
                fencing_token: token,
                result: reason.clone().into_bytes(),
                provider_ref: provider_ref.clone(),
            },
            None,
            &limits,
        );
        let _ = convert::heartbeat(
            pb::HeartbeatRequest { operation_id: operation_id.clone(), fencing_token: token, lease_ttl: span },
            None,
            &limits,
        );
        let _ = convert::list_operations(pb::ListOperationsRequest {
            states: states.clone(),
            tool: provider_ref.clone(),
            older_than: span,
            page_size,
            page_token: reason.clone(),
            ..Default::default()
        });
        let _ = convert::watch_operations(pb::WatchOperationsRequest {
            after_sequence,
            from_now,
            states,
            tool: provider_ref.clone(),
            ..Default::default()
        });
        let _ = convert::get_stats(pb::GetStatsRequest { window: span, ..Default::default() }, limits.max_retention_ms);
        let _ = convert::get_forensics(pb::GetForensicsRequest { tool: reason.clone(), since: span, ..Default::default() }, limits.max_retention_ms);
        let _ = convert::resolve(
            pb::ResolveRequest {
                operation_id,
                outcome,
                provider_ref,
                reason,
                ..Default::default()
            },
            &limits,
        );
    }
}
