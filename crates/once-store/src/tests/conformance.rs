//! The store conformance suite: what every [`Backend`] must do, tested at the trait, one suite
//! instantiated for SQLite and for PostgreSQL. A backend is done when all of it passes.

use crate::backend::sealed::Transactions as _;
use crate::Decision;
use crate::{Backend, Events as _, Probe, StoreError};
use once_core::machine::{self, FreshIdGuard, Plan, Write};
use once_core::reconcile::Lookup;
use once_core::*;

/// Defines `name::sqlite` and `name::postgres` from `async fn name<B: Backend>(backend: B)`.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use once_testdb::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    let db = TestDb::new(Engine::Sqlite).await;
                    let backend = crate::SqliteBackend::connect(&db.url).await.unwrap();
                    super::$name(backend).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let db = TestDb::new(Engine::Postgres).await;
                    let settings = crate::postgres::PgSettings::default();
                    let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
                    super::$name(backend).await;
                }
            }
        )*
    };
}

conformance!(
    a_first_insert_wins_and_a_second_is_a_duplicate,
    fencing_tokens_grow_and_are_never_issued_twice,
    every_update_bumps_the_version_and_needs_the_row,
    the_guard_finds_only_open_operations_of_the_same_intent,
    attempts_are_found_by_token_for_their_own_operation_only,
    resolutions_are_found_by_id_in_any_life,
    history_is_the_current_life_and_what_came_since_for_earlier_ones,
    a_new_life_clears_the_attempt_log_and_keeps_the_events,
    a_life_that_hands_its_key_on_keeps_its_attempts_and_their_late_anomalies_show,
    anomalies_are_recorded_once_per_dedupe_key,
    a_lookup_claim_is_exclusive_until_it_lapses_and_bumps_the_version,
    lookups_are_due_only_when_unknown_due_and_unclaimed,
    sweeps_see_only_expired_leases_and_settled_rows_past_retention,
    lists_page_in_creation_order_without_results,
    a_blocked_guard_takes_no_token,
    every_tenants_operations_are_listed_watched_and_counted_together,
    the_store_answers_pings,
    events_are_watched_in_order_with_their_tool_and_state,
    an_unlocked_write_happens_only_over_what_it_was_decided_from,
    credential_refresh_reads_only_what_changed,
    continuity_holds_a_tenant_until_its_loss_is_accepted_and_brings_lost_operations_back,
    one_replica_links_a_range_and_retention_keeps_each_tenants_anchor,
);

const TENANT: &str = "t1";

/// The reads of [`TENANT`] alone.
fn of_tenant(tenant: &str) -> Scope {
    Scope::Tenant(tenant.into())
}

fn id(text: &str) -> OperationId {
    OperationId::parse("id", text).unwrap()
}

fn command(operation_id: &str, tool: &str, fingerprint: u8) -> BeginCommand {
    BeginCommand {
        tenant: TENANT.into(),
        operation_id: id(operation_id),
        tool: tool.into(),
        fingerprint: Fingerprint([fingerprint; 32]),
        attempt_id: "attempt-0123456789".into(),
        context: AttemptContext {
            client_name: Some("conformance".into()),
            session_id: Some("s-1".into()),
            request_id: Some("1".into()),
        },
        lease_ttl_ms: 60_000,
        retention_ms: 60_000,
        new_intent: false,
        provider: Some("stripe".into()),
        lookup_hints: None,
        actor: Actor::Executor("conformance".into()),
        holder: Some(HOLDER.into()),
        held: false,
    }
}

/// The key id of the credential the suite's attempts are granted to.
const HOLDER: &str = "0123456789ab";

/// Reads the store's clock (and `id`, unlocked).
async fn now<B: Backend>(backend: &B) -> Millis {
    backend.read(TENANT, &id("clock")).await.unwrap().1
}

async fn commit<B: Backend>(backend: &B, operation_id: &str, plan: &Plan, at: Millis) {
    let mut tx = backend.begin_write().await.unwrap();
    backend
        .apply(&mut tx, TENANT, &id(operation_id), plan, at)
        .await
        .unwrap();
    backend.commit(tx).await.unwrap();
}

/// A first claim of `operation_id` with `token`, committed; returns the stored operation.
async fn claimed<B: Backend>(
    backend: &B,
    operation_id: &str,
    tool: &str,
    fingerprint: u8,
) -> Operation {
    let at = now(backend).await;
    let mut tx = backend.begin_write().await.unwrap();
    let token = backend.next_token(&mut tx).await.unwrap();
    let cmd = command(operation_id, tool, fingerprint);
    let (_, plan) = machine::claim(None, &cmd, FreshIdGuard::Clear { token }, at);
    backend
        .apply(&mut tx, TENANT, &cmd.operation_id, &plan, at)
        .await
        .unwrap();
    backend.commit(tx).await.unwrap();
    stored(backend, operation_id).await
}

async fn stored<B: Backend>(backend: &B, operation_id: &str) -> Operation {
    backend
        .read(TENANT, &id(operation_id))
        .await
        .unwrap()
        .0
        .expect("stored")
}

/// Writes `op` over its row, as a plan would, with no event.
async fn overwrite<B: Backend>(backend: &B, op: &Operation) {
    let plan = Plan {
        operation: Some(Write::Update(op.clone())),
        ..Plan::default()
    };
    commit(backend, op.operation_id.as_str(), &plan, op.updated_at).await;
}

/// `operation_id` claimed and then put in `state` (settled ones expiring `expires_in` from now).
async fn in_state<B: Backend>(
    backend: &B,
    operation_id: &str,
    fingerprint: u8,
    state: State,
    expires_in: i64,
) -> Operation {
    let mut op = claimed(backend, operation_id, "refund", fingerprint).await;
    let at = now(backend).await;
    op.state = state;
    op.expires_at = state.is_settled().then_some(at + expires_in);
    op.unknown_since = (state == State::Unknown).then_some(at);
    op.reconcile_next_at = (state == State::Unknown).then_some(at - 1);
    overwrite(backend, &op).await;
    stored(backend, operation_id).await
}

fn event(life: FencingToken, kind: EventKind, dedupe_key: Option<&str>) -> NewEvent {
    NewEvent {
        life,
        kind,
        from: None,
        to: None,
        attempt: Some(1),
        actor: Actor::Ledger,
        reason: None,
        details: None,
        dedupe_key: dedupe_key.map(str::to_owned),
    }
}

fn events_only(events: Vec<NewEvent>) -> Plan {
    Plan {
        events,
        ..Plan::default()
    }
}

async fn a_first_insert_wins_and_a_second_is_a_duplicate<B: Backend>(backend: B) {
    let first = claimed(&backend, "dup-1", "refund", 1).await;
    let (current, at) = {
        let mut tx = backend.begin_write().await.unwrap();
        let locked = backend.lock(&mut tx, TENANT, &id("dup-1")).await.unwrap();
        backend.commit(tx).await.unwrap();
        locked
    };
    assert_eq!(
        current.as_ref(),
        Some(&first),
        "lock reads what was committed"
    );
    assert!((at - first.created_at).abs() < 60_000, "one clock");
    let mut tx = backend.begin_write().await.unwrap();
    let cmd = command("dup-1", "refund", 1);
    let (_, plan) = machine::claim(
        None,
        &cmd,
        FreshIdGuard::Clear {
            token: FencingToken(7),
        },
        at,
    );
    let second = backend
        .apply(&mut tx, TENANT, &id("dup-1"), &plan, at)
        .await;
    assert!(matches!(second, Err(StoreError::Duplicate)), "{second:?}");
    drop(tx);
    assert_eq!(
        stored(&backend, "dup-1").await,
        first,
        "the loser changed nothing"
    );
}

async fn fencing_tokens_grow_and_are_never_issued_twice<B: Backend>(backend: B) {
    let mut issued = Vec::new();
    for round in 0..6_u32 {
        let mut tx = backend.begin_write().await.unwrap();
        issued.push(backend.next_token(&mut tx).await.unwrap());
        if round.is_multiple_of(2) {
            backend.commit(tx).await.unwrap();
        }
        // Odd rounds roll back: their tokens reached nobody.
    }
    let committed: Vec<FencingToken> = issued.iter().step_by(2).copied().collect();
    assert!(committed.windows(2).all(|w| w[0] < w[1]), "{issued:?}");
    assert!(
        issued[0] >= FencingToken(1 << 20),
        "above every token an earlier schema issued"
    );
    // An operation claimed later gets a larger token still, and its life is named by it.
    let op = claimed(&backend, "token-1", "refund", 1).await;
    assert!(op.fencing_token > *committed.last().unwrap());
    assert_eq!(op.life, op.fencing_token);
}

async fn every_update_bumps_the_version_and_needs_the_row<B: Backend>(backend: B) {
    let op = claimed(&backend, "version-1", "refund", 1).await;
    let mut next = op.clone();
    next.reason = Some("changed".into());
    overwrite(&backend, &next).await;
    let after = stored(&backend, "version-1").await;
    assert_eq!(after.version, op.version + 1);
    assert_eq!(after.reason.as_deref(), Some("changed"));

    let mut missing = op.clone();
    missing.operation_id = id("version-missing");
    let plan = Plan {
        operation: Some(Write::Update(missing)),
        ..Plan::default()
    };
    let mut tx = backend.begin_write().await.unwrap();
    let updated = backend
        .apply(
            &mut tx,
            TENANT,
            &id("version-missing"),
            &plan,
            op.updated_at,
        )
        .await;
    assert!(matches!(updated, Err(StoreError::NotFound)), "{updated:?}");
    drop(tx);

    // With an attempt and an event written after the row, as a claim writes them (SQLite sends
    // them in one list): still for want of the row.
    let cmd = command("version-missing", "refund", 1);
    let mut tx = backend.begin_write().await.unwrap();
    let token = backend.next_token(&mut tx).await.unwrap();
    let (_, mut plan) = machine::claim(None, &cmd, FreshIdGuard::Clear { token }, op.updated_at);
    let Some(Write::Insert(row)) = plan.operation.take() else {
        panic!("a first claim inserts its row");
    };
    plan.operation = Some(Write::Update(row));
    assert!(plan.attempt.is_some() && !plan.events.is_empty());
    let updated = backend
        .apply(&mut tx, TENANT, &cmd.operation_id, &plan, op.updated_at)
        .await;
    assert!(matches!(updated, Err(StoreError::NotFound)), "{updated:?}");
}

async fn the_guard_finds_only_open_operations_of_the_same_intent<B: Backend>(backend: B) {
    in_state(&backend, "guard-done", 1, State::Confirmed, 60_000).await;
    in_state(&backend, "guard-gone", 1, State::Absent, 60_000).await;
    in_state(&backend, "guard-other-fp", 2, State::Unknown, 0).await;
    claimed(&backend, "guard-other-tool", "send_email", 1).await;
    // The guard of a Begin of `operation_id` for the intent (refund, fingerprint 1).
    let guard = |operation_id: &'static str, new_intent: bool| {
        let backend = backend.clone();
        async move {
            let mut cmd = command(operation_id, "refund", 1);
            cmd.new_intent = new_intent;
            let mut tx = backend.begin_write().await.unwrap();
            let guard = backend.guard(&mut tx, &cmd).await.unwrap();
            backend.commit(tx).await.unwrap();
            guard
        }
    };
    let find = |operation_id: &'static str| {
        let guard = guard(operation_id, false);
        async move {
            match guard.await {
                FreshIdGuard::Blocked(blocking) => Some(blocking),
                FreshIdGuard::Clear { .. } => None,
            }
        }
    };
    assert_eq!(
        find("guard-new").await,
        None,
        "settled operations block nothing"
    );

    let running = claimed(&backend, "guard-running", "refund", 1).await;
    let found = find("guard-new").await.unwrap();
    assert_eq!(
        (
            found.operation_id.as_str(),
            found.state,
            found.lease_deadline
        ),
        ("guard-running", State::InFlight, running.lease_deadline)
    );
    assert_eq!(
        find("guard-running").await,
        None,
        "an operation never blocks itself"
    );

    in_state(&backend, "guard-unknown", 1, State::Unknown, 0).await;
    let found = find("guard-new").await.unwrap();
    assert_eq!(
        (found.operation_id.as_str(), found.state),
        ("guard-unknown", State::Unknown),
        "UNKNOWN first"
    );
    // A new intent passes, with a token never issued before.
    let FreshIdGuard::Clear { token } = guard("guard-new", true).await else {
        panic!("a new intent is never blocked")
    };
    assert!(token > running.fencing_token);
}

async fn attempts_are_found_by_token_for_their_own_operation_only<B: Backend>(backend: B) {
    let a = claimed(&backend, "attempt-a", "refund", 1).await;
    let b = claimed(&backend, "attempt-b", "refund", 2).await;
    let mut tx = backend.begin_write().await.unwrap();
    let found = backend
        .attempt(&mut tx, TENANT, &id("attempt-a"), a.fencing_token)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            found.number,
            found.fencing_token,
            found.actor.to_string().as_str()
        ),
        (1, a.fencing_token, "executor:conformance")
    );
    assert_eq!(found.context.session_id.as_deref(), Some("s-1"));
    // The credential it was granted to, on the attempt and on the operation.
    assert_eq!(found.holder.as_deref(), Some(HOLDER));
    assert_eq!(a.holder.as_deref(), Some(HOLDER));
    assert_eq!(
        backend
            .attempt(&mut tx, TENANT, &id("attempt-a"), b.fencing_token)
            .await
            .unwrap(),
        None,
        "another operation's token"
    );
}

async fn resolutions_are_found_by_id_in_any_life<B: Backend>(backend: B) {
    let op = claimed(&backend, "resolved-1", "refund", 1).await;
    let mut resolved = event(op.life, EventKind::Resolved, Some("RESOLVED:r-1"));
    resolved.from = Some(State::Unknown);
    resolved.to = Some(State::Absent);
    resolved.details = Some(format!(
        r#"{{"resolution_id":"r-1","fencing_token":{}}}"#,
        op.fencing_token
    ));
    commit(
        &backend,
        "resolved-1",
        &events_only(vec![resolved]),
        op.updated_at,
    )
    .await;
    let mut tx = backend.begin_write().await.unwrap();
    assert_eq!(
        backend
            .find_resolution(&mut tx, TENANT, &id("resolved-1"), "r-1")
            .await
            .unwrap(),
        Some(PriorResolution {
            state: State::Absent,
            fencing_token: Some(op.fencing_token),
        })
    );
    assert_eq!(
        backend
            .find_resolution(&mut tx, TENANT, &id("resolved-1"), "r-2")
            .await
            .unwrap(),
        None
    );
}

async fn history_is_the_current_life_and_what_came_since_for_earlier_ones<B: Backend>(backend: B) {
    let op = claimed(&backend, "history-1", "refund", 1).await;
    let earlier_life = FencingToken(op.life.get() - 1);
    commit(
        &backend,
        "history-1",
        &events_only(vec![
            event(earlier_life, EventKind::DoubleExecution, None),
            event(op.life, EventKind::LeaseExpired, None),
            event(op.life, EventKind::Resolved, None),
        ]),
        op.updated_at,
    )
    .await;
    let (attempts, events) = backend
        .history(TENANT, &id("history-1"), op.life)
        .await
        .unwrap();
    assert_eq!(attempts.len(), 1);
    // The earlier life's event was recorded after this life began (a late report of that
    // life): it is part of this life's story. Events of earlier lives from before it are not
    // (a_new_life_clears_the_attempt_log_and_keeps_the_events).
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["CLAIMED", "DOUBLE_EXECUTION", "LEASE_EXPIRED", "RESOLVED"]
    );
    assert!(events.windows(2).all(|w| w[0].sequence < w[1].sequence));
}

/// A claim of `op` as stored (its id, tool and intent), applied in a write transaction left
/// open: the transaction, the token the claim took, and its plan.
async fn claim_over<B: Backend>(
    backend: &B,
    op: &Operation,
    at: Millis,
) -> (B::Tx, FencingToken, Plan) {
    let mut tx = backend.begin_write().await.unwrap();
    let token = backend.next_token(&mut tx).await.unwrap();
    let mut cmd = command(op.operation_id.as_str(), &op.tool, 0);
    cmd.fingerprint = op.fingerprint;
    let (_, plan) = machine::claim(Some(op), &cmd, FreshIdGuard::Clear { token }, at);
    backend
        .apply(&mut tx, TENANT, &op.operation_id, &plan, at)
        .await
        .unwrap();
    (tx, token, plan)
}

async fn a_new_life_clears_the_attempt_log_and_keeps_the_events<B: Backend>(backend: B) {
    let op = in_state(&backend, "reborn-1", 1, State::Confirmed, -1).await;
    let at = now(&backend).await;
    let (tx, token, plan) = claim_over(&backend, &op, at).await;
    assert!(plan.forgets_attempts);
    backend.commit(tx).await.unwrap();
    let reborn = stored(&backend, "reborn-1").await;
    assert_eq!((reborn.attempt, reborn.life), (1, token));
    let (attempts, events) = backend
        .history(TENANT, &id("reborn-1"), reborn.life)
        .await
        .unwrap();
    assert_eq!(attempts.len(), 1, "only this life's attempt");
    assert_eq!(attempts[0].fencing_token, token);
    assert_eq!(events.len(), 1, "only this life's events");
    let (_, old) = backend
        .history(TENANT, &id("reborn-1"), op.life)
        .await
        .unwrap();
    assert_eq!(old.len(), 1, "the previous life's events are kept");
}

/// A life that ended ABSENT hands its key on and keeps its attempts: each is found by its token
/// with its own life and number, the new life's history lists only the new life's attempts,
/// and an event recorded for the earlier life after the new one began is in its history.
async fn a_life_that_hands_its_key_on_keeps_its_attempts_and_their_late_anomalies_show<
    B: Backend,
>(
    backend: B,
) {
    let op = in_state(&backend, "handed-1", 1, State::Absent, -1).await;
    let at = now(&backend).await;
    let (mut tx, token, plan) = claim_over(&backend, &op, at).await;
    assert!(!plan.forgets_attempts);
    let old = backend
        .attempt(&mut tx, TENANT, &id("handed-1"), op.fencing_token)
        .await
        .unwrap()
        .expect("the earlier life's attempt is kept");
    assert_eq!((old.number, old.life), (1, op.life));
    let new = backend
        .attempt(&mut tx, TENANT, &id("handed-1"), token)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((new.number, new.life), (1, token), "numbers start again");
    backend.commit(tx).await.unwrap();
    let reborn = stored(&backend, "handed-1").await;
    assert_eq!(reborn.provider_key, op.provider_key);

    // A late anomaly of the earlier life, recorded in it now, shows in this life's history;
    // the earlier life's own events from before do not.
    let late = NewEvent {
        dedupe_key: Some("DOUBLE_EXECUTION:late".into()),
        ..event(op.life, EventKind::DoubleExecution, None)
    };
    commit(&backend, "handed-1", &events_only(vec![late]), at).await;
    let (attempts, events) = backend
        .history(TENANT, &id("handed-1"), reborn.life)
        .await
        .unwrap();
    assert_eq!(attempts.len(), 1, "only this life's attempts");
    assert_eq!(attempts[0].fencing_token, token);
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["CLAIMED", "DOUBLE_EXECUTION"]);

    // A new life with a key of its own (after CONFIRMED) forgets every earlier attempt.
    let mut done = reborn.clone();
    done.state = State::Confirmed;
    done.expires_at = Some(at - 1);
    overwrite(&backend, &done).await;
    let done = stored(&backend, "handed-1").await;
    let (mut tx, _, plan) = claim_over(&backend, &done, at).await;
    assert!(plan.forgets_attempts);
    for gone in [op.fencing_token, token] {
        assert!(backend
            .attempt(&mut tx, TENANT, &id("handed-1"), gone)
            .await
            .unwrap()
            .is_none());
    }
    backend.commit(tx).await.unwrap();
}

async fn anomalies_are_recorded_once_per_dedupe_key<B: Backend>(backend: B) {
    let op = claimed(&backend, "anomaly-1", "refund", 1).await;
    for key in [
        "DOUBLE_EXECUTION:5",
        "DOUBLE_EXECUTION:5",
        "DOUBLE_EXECUTION:6",
    ] {
        let anomaly = event(op.life, EventKind::DoubleExecution, Some(key));
        commit(
            &backend,
            "anomaly-1",
            &events_only(vec![anomaly]),
            op.updated_at,
        )
        .await;
    }
    let (_, events) = backend
        .history(TENANT, &id("anomaly-1"), op.life)
        .await
        .unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::DoubleExecution)
            .count(),
        2
    );
}

async fn a_lookup_claim_is_exclusive_until_it_lapses_and_bumps_the_version<B: Backend>(backend: B) {
    let op = in_state(&backend, "claim-1", 1, State::Unknown, 0).await;
    let (claimed_op, lookup): (Operation, Lookup) = backend
        .claim_lookup(TENANT, &id("claim-1"), 60_000, false)
        .await
        .unwrap()
        .expect("due and unclaimed");
    assert_eq!(lookup.version, op.version + 1);
    assert_eq!(claimed_op.version, lookup.version);
    assert!(claimed_op.lookup_claimed_until.unwrap() >= lookup.issued_at + 60_000);
    assert!(
        (lookup.issued_at - now(&backend).await).abs() < 60_000,
        "issued on the store clock"
    );
    for before_due in [false, true] {
        assert!(
            backend
                .claim_lookup(TENANT, &id("claim-1"), 60_000, before_due)
                .await
                .unwrap()
                .is_none(),
            "held by the first claim"
        );
    }

    // A claim of no length lapses at once: the next claim takes it, and the first is stale.
    let op = in_state(&backend, "claim-2", 1, State::Unknown, 0).await;
    let (_, first) = backend
        .claim_lookup(TENANT, &id("claim-2"), 0, false)
        .await
        .unwrap()
        .unwrap();
    let (_, second) = backend
        .claim_lookup(TENANT, &id("claim-2"), 60_000, false)
        .await
        .unwrap()
        .unwrap();
    assert!(second.version > first.version && first.version > op.version);

    // Not due yet: only an operator's claim (before_due) takes it.
    let mut later = in_state(&backend, "claim-3", 1, State::Unknown, 0).await;
    later.reconcile_next_at = Some(now(&backend).await + 3_600_000);
    overwrite(&backend, &later).await;
    assert!(backend
        .claim_lookup(TENANT, &id("claim-3"), 60_000, false)
        .await
        .unwrap()
        .is_none());
    assert!(backend
        .claim_lookup(TENANT, &id("claim-3"), 60_000, true)
        .await
        .unwrap()
        .is_some());

    // Held for an operator, settled, or in flight: never.
    let mut held = in_state(&backend, "claim-4", 1, State::Unknown, 0).await;
    held.source = Source::Anomaly;
    overwrite(&backend, &held).await;
    in_state(&backend, "claim-5", 1, State::Confirmed, 60_000).await;
    claimed(&backend, "claim-6", "refund", 1).await;
    for unclaimable in ["claim-4", "claim-5", "claim-6", "claim-none"] {
        assert!(
            backend
                .claim_lookup(TENANT, &id(unclaimable), 60_000, true)
                .await
                .unwrap()
                .is_none(),
            "{unclaimable}"
        );
    }
}

async fn lookups_are_due_only_when_unknown_due_and_unclaimed<B: Backend>(backend: B) {
    in_state(&backend, "due-1", 1, State::Unknown, 0).await;
    in_state(&backend, "due-2", 2, State::Unknown, 0).await;
    let mut later = in_state(&backend, "due-later", 3, State::Unknown, 0).await;
    later.reconcile_next_at = Some(now(&backend).await + 3_600_000);
    overwrite(&backend, &later).await;
    in_state(&backend, "due-done", 4, State::Confirmed, 60_000).await;
    let mut elsewhere = in_state(&backend, "due-elsewhere", 5, State::Unknown, 0).await;
    elsewhere.provider = Some("a-reconciler-this-replica-lacks".into());
    overwrite(&backend, &elsewhere).await;
    backend
        .claim_lookup(TENANT, &id("due-2"), 60_000, false)
        .await
        .unwrap()
        .unwrap();
    let due: Vec<String> = backend
        .due_lookups(10, &[(TENANT, "stripe")])
        .await
        .unwrap()
        .into_iter()
        .map(|(_, id)| id.to_string())
        .collect();
    assert_eq!(due, ["due-1"]);
}

async fn sweeps_see_only_expired_leases_and_settled_rows_past_retention<B: Backend>(backend: B) {
    let mut lapsed = claimed(&backend, "sweep-lapsed", "refund", 1).await;
    lapsed.lease_deadline = now(&backend).await - 1;
    overwrite(&backend, &lapsed).await;
    claimed(&backend, "sweep-live", "refund", 2).await;
    let expired: Vec<String> = backend
        .expired_leases(10)
        .await
        .unwrap()
        .into_iter()
        .map(|(_, id)| id.to_string())
        .collect();
    assert_eq!(expired, ["sweep-lapsed"]);

    in_state(&backend, "sweep-old-confirmed", 3, State::Confirmed, -1).await;
    in_state(&backend, "sweep-old-absent", 4, State::Absent, -1).await;
    in_state(&backend, "sweep-young", 5, State::Confirmed, 3_600_000).await;
    // Open operations are never deleted, whatever their expiry says.
    let mut unknown = in_state(&backend, "sweep-unknown", 6, State::Unknown, 0).await;
    unknown.expires_at = Some(0);
    overwrite(&backend, &unknown).await;
    // An ABSENT row past retention stays, as a tombstone, for the provider key window.
    let window = 3_600_000;
    assert_eq!(
        backend.delete_expired(1, window).await.unwrap(),
        1,
        "in batches"
    );
    assert_eq!(backend.delete_expired(10, window).await.unwrap(), 0);
    assert!(stored_or_not(&backend, "sweep-old-absent").await);
    assert_eq!(backend.delete_expired(10, 0).await.unwrap(), 1);
    assert_eq!(backend.delete_expired(10, 0).await.unwrap(), 0);
    for (kept, present) in [
        ("sweep-old-confirmed", false),
        ("sweep-old-absent", false),
        ("sweep-young", true),
        ("sweep-unknown", true),
        ("sweep-lapsed", true),
    ] {
        let found = backend.read(TENANT, &id(kept)).await.unwrap().0;
        assert_eq!(found.is_some(), present, "{kept}");
    }
    // Events outlive their operation until their own retention.
    let (_, events) = backend
        .history(TENANT, &id("sweep-old-confirmed"), FencingToken(0))
        .await
        .unwrap();
    assert!(events.is_empty(), "life 0 has no events");
    // Events are deleted only once the history's chain has linked them: none is yet.
    assert_eq!(
        backend.delete_events_older_than(-60_000, 4).await.unwrap(),
        0,
        "not linked"
    );
    let newest = backend.event_frontier().await.unwrap().newest;
    assert!(backend.append_links((0, newest), &[]).await.unwrap());
    assert_eq!(
        backend
            .delete_events_older_than(3_600_000, 100)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        backend.delete_events_older_than(-60_000, 4).await.unwrap(),
        4,
        "in batches"
    );
    assert_eq!(
        backend
            .delete_events_older_than(-60_000, 100)
            .await
            .unwrap(),
        2
    );
}

async fn lists_page_in_creation_order_without_results<B: Backend>(backend: B) {
    for i in 0..3 {
        let mut op = in_state(&backend, &format!("list-{i}"), i, State::Confirmed, 60_000).await;
        op.result = Some(vec![b'r'; 1024]);
        overwrite(&backend, &op).await;
    }
    let page = backend
        .list(
            &of_tenant(TENANT),
            &ListQuery {
                states: vec![State::Confirmed],
                page_size: 2,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    let ids: Vec<&str> = page
        .iter()
        .map(|l| l.operation.operation_id.as_str())
        .collect();
    assert_eq!(ids, ["list-0", "list-1"]);
    assert!(
        page.iter().all(|l| l.operation.result.is_none()),
        "no results in a page"
    );
    // Each with the latest event of its current life: its claim (the state was overwritten).
    assert!(page
        .iter()
        .all(|l| l.last_event.map(|(kind, _)| kind) == Some(EventKind::Claimed)));
    let last = &page.last().unwrap().operation;
    let rest = backend
        .list(
            &of_tenant(TENANT),
            &ListQuery {
                page_size: 10,
                after: Some(PageEnd {
                    created_at: last.created_at,
                    tenant: String::new(),
                    operation_id: last.operation_id.to_string(),
                }),
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(rest.len(), 1);
    assert!(backend
        .list(
            &of_tenant("another-tenant"),
            &ListQuery {
                page_size: 10,
                ..ListQuery::default()
            }
        )
        .await
        .unwrap()
        .is_empty());
}

/// A reading of every tenant (an admin's) lists their operations in one order, (created_at,
/// tenant, operation_id), so pages neither skip nor repeat operations of two tenants created in
/// the same millisecond under the same id; it watches every tenant's events, each naming its
/// tenant; and it adds every tenant's figures up.
async fn every_tenants_operations_are_listed_watched_and_counted_together<B: Backend>(backend: B) {
    let at = now(&backend).await;
    for tenant in ["t2", TENANT] {
        for (n, operation_id) in ["same-b", "same-a"].into_iter().enumerate() {
            let mut tx = backend.begin_write().await.unwrap();
            let token = backend.next_token(&mut tx).await.unwrap();
            let cmd = BeginCommand {
                tenant: tenant.into(),
                ..command(operation_id, "refund", n as u8)
            };
            let (_, plan) = machine::claim(None, &cmd, FreshIdGuard::Clear { token }, at);
            backend
                .apply(&mut tx, tenant, &cmd.operation_id, &plan, at)
                .await
                .unwrap();
            backend.commit(tx).await.unwrap();
        }
    }
    let mut listed = Vec::new();
    let mut after = None;
    loop {
        let query = ListQuery {
            page_size: 1,
            after: after.clone(),
            ..ListQuery::default()
        };
        let page = backend.list(&Scope::AllTenants, &query).await.unwrap();
        let Some(last) = page.last() else { break };
        let op = &last.operation;
        listed.push(format!("{}/{}", op.tenant, op.operation_id));
        after = Some(PageEnd {
            created_at: op.created_at,
            tenant: op.tenant.clone(),
            operation_id: op.operation_id.to_string(),
        });
    }
    assert_eq!(listed, ["t1/same-a", "t1/same-b", "t2/same-a", "t2/same-b"]);
    let own = backend
        .list(
            &of_tenant("t2"),
            &ListQuery {
                page_size: 10,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert!(own.iter().all(|l| l.operation.tenant == "t2") && own.len() == 2);

    let mut mark = crate::Watermark::default();
    let reached = mark.observe(backend.event_frontier().await.unwrap());
    let watched = backend
        .watch_events(
            &Scope::AllTenants,
            (0, reached),
            &WatchFilter::default(),
            100,
        )
        .await
        .unwrap();
    let watched: Vec<String> = watched
        .iter()
        .map(|e| format!("{}/{}", e.tenant, e.operation_id))
        .collect();
    assert_eq!(
        watched,
        ["t2/same-b", "t2/same-a", "t1/same-b", "t1/same-a"]
    );

    let every = backend.stats(&Scope::AllTenants, 3_600_000).await.unwrap();
    let one = backend.stats(&of_tenant(TENANT), 3_600_000).await.unwrap();
    let in_flight = |stats: &once_core::stats::Stats| -> i64 {
        stats
            .operations
            .iter()
            .filter(|(state, _, _)| *state == State::InFlight)
            .map(|(_, _, n)| n)
            .sum()
    };
    assert_eq!((in_flight(&every), in_flight(&one)), (4, 2));
}

async fn the_store_answers_pings<B: Backend>(backend: B) {
    for probe in [Probe::Write, Probe::Room] {
        backend.ping(probe).await.unwrap();
    }
    backend.close().await;
    assert!(backend.ping(Probe::Write).await.unwrap_err().is_retryable());
}

/// The guard is serialised before it looks (SQLite's write lock, PostgreSQL's intent lock in
/// `once_blocking`), so a token is taken only for a claim that is clear: Begins blocked behind
/// an open operation of their intent take none.
async fn a_blocked_guard_takes_no_token<B: Backend>(backend: B) {
    let last = |backend: B| async move {
        let probe = command("probe", "probe", 9);
        let mut tx = backend.begin_write().await.unwrap();
        let FreshIdGuard::Clear { token } = backend.guard(&mut tx, &probe).await.unwrap() else {
            panic!("nothing blocks the probe");
        };
        drop(tx);
        token.get()
    };
    claimed(&backend, "blocker", "refund", 1).await;
    let before = last(backend.clone()).await;
    for _ in 0..3 {
        let mut tx = backend.begin_write().await.unwrap();
        let guard = backend
            .guard(&mut tx, &command("blocked", "refund", 1))
            .await
            .unwrap();
        backend.commit(tx).await.unwrap();
        assert!(matches!(guard, FreshIdGuard::Blocked(_)), "{guard:?}");
    }
    // SQLite's counter rolls back with a transaction that dropped its token; PostgreSQL's
    // sequence does not, so a probe's token shows what the blocked guards took.
    let after = last(backend.clone()).await;
    assert!(after <= before + 1, "{before} then {after}");
}

async fn events_are_watched_in_order_with_their_tool_and_state<B: Backend>(backend: B) {
    let first = in_state(&backend, "watched-1", 1, State::Unknown, 0).await;
    let mut other = claimed(&backend, "watched-2", "send_email", 2).await;
    commit(
        &backend,
        "watched-1",
        &events_only(vec![event(first.life, EventKind::Escalated, None)]),
        first.updated_at,
    )
    .await;
    other.state = State::Confirmed;
    let plan = Plan {
        operation: Some(Write::Update(other.clone())),
        events: vec![event(other.life, EventKind::Confirmed, None)],
        ..Plan::default()
    };
    commit(&backend, "watched-2", &plan, other.updated_at).await;

    let mut mark = crate::Watermark::default();
    let reached = mark.observe(backend.event_frontier().await.unwrap());
    let all = backend
        .watch_events(
            &of_tenant(TENANT),
            (0, reached),
            &WatchFilter::default(),
            100,
        )
        .await
        .unwrap();
    let seen: Vec<(&str, &str, Option<&str>, Option<State>)> = all
        .iter()
        .map(|e| {
            (
                e.operation_id.as_str(),
                e.event.kind.as_str(),
                e.tool.as_deref(),
                e.state,
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (
                "watched-1",
                "CLAIMED",
                Some("refund"),
                Some(State::InFlight)
            ),
            (
                "watched-2",
                "CLAIMED",
                Some("send_email"),
                Some(State::InFlight)
            ),
            (
                "watched-1",
                "ESCALATED",
                Some("refund"),
                Some(State::Unknown)
            ),
            (
                "watched-2",
                "CONFIRMED",
                Some("send_email"),
                Some(State::Confirmed)
            ),
        ]
    );
    assert_eq!(reached, all.last().unwrap().event.sequence);
    // Other tenants' events are never among them; pages resume after their last event.
    assert!(backend
        .watch_events(&of_tenant("t2"), (0, reached), &WatchFilter::default(), 100)
        .await
        .unwrap()
        .is_empty());
    let page = backend
        .watch_events(&of_tenant(TENANT), (0, reached), &WatchFilter::default(), 2)
        .await
        .unwrap();
    let rest = backend
        .watch_events(
            &of_tenant(TENANT),
            (page[1].event.sequence, reached),
            &WatchFilter::default(),
            100,
        )
        .await
        .unwrap();
    assert_eq!(page.len() + rest.len(), all.len());
    assert_eq!(rest[0], all[2]);
    let escalations = WatchFilter {
        states: vec![State::Unknown],
        tool: Some("refund".into()),
        ..Default::default()
    };
    let wanted = backend
        .watch_events(&of_tenant(TENANT), (0, reached), &escalations, 100)
        .await
        .unwrap();
    let expected: Vec<_> = all.into_iter().filter(|e| escalations.matches(e)).collect();
    assert_eq!(wanted, expected);
    assert_eq!(wanted.len(), 1);
}

/// PostgreSQL commits events out of sequence order; the watermark waits for the writer of an
/// earlier event, however long it takes, and passes it once it has committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watermark_never_passes_an_event_still_being_written() {
    use once_testdb::{Engine, TestDb};
    let db = TestDb::new(Engine::Postgres).await;
    let settings = crate::postgres::PgSettings::default();
    let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
    let slow = claimed(&backend, "slow", "refund", 1).await;
    let quick = claimed(&backend, "quick", "refund", 2).await;
    let mut mark = crate::Watermark::default();
    let before = mark.observe(backend.event_frontier().await.unwrap());

    // A writer takes the gate (with its lock), writes an event and does not commit yet...
    let mut tx = backend.begin_write().await.unwrap();
    backend.lock(&mut tx, TENANT, &id("slow")).await.unwrap();
    let slow_events = events_only(vec![event(slow.life, EventKind::Escalated, None)]);
    backend
        .apply(&mut tx, TENANT, &id("slow"), &slow_events, slow.updated_at)
        .await
        .unwrap();
    // ...while a later event commits.
    commit(
        &backend,
        "quick",
        &events_only(vec![event(quick.life, EventKind::Escalated, None)]),
        quick.updated_at,
    )
    .await;
    let frontier = backend.event_frontier().await.unwrap();
    assert!(frontier.newest > before);
    assert_eq!(frontier.writing.len(), 1, "{frontier:?}");
    for _ in 0..3 {
        let frontier = backend.event_frontier().await.unwrap();
        assert_eq!(mark.observe(frontier), before, "held back by the writer");
    }
    backend.commit(tx).await.unwrap();
    let reached = mark.observe(backend.event_frontier().await.unwrap());
    let watched = backend
        .watch_events(
            &of_tenant(TENANT),
            (before, reached),
            &WatchFilter::default(),
            100,
        )
        .await
        .unwrap();
    let ids: Vec<&str> = watched.iter().map(|e| e.operation_id.as_str()).collect();
    assert_eq!(ids, ["slow", "quick"], "both, in sequence order");
    assert_eq!(reached, watched[1].event.sequence);
}

/// How many events `operation_id` has of `kind`, in any life.
async fn events_of<B: Backend>(backend: &B, operation_id: &str, kind: EventKind) -> usize {
    let op = backend.read(TENANT, &id(operation_id)).await.unwrap().0;
    let Some(op) = op else { return 0 };
    let (_, events) = backend
        .history(TENANT, &id(operation_id), op.life)
        .await
        .unwrap();
    events.iter().filter(|e| e.kind == kind).count()
}

/// Deletes `operation_id`'s row whatever its state (its attempts go with it).
async fn delete_settled_or_not<B: Backend>(backend: &B, operation_id: &str) {
    let op = stored(backend, operation_id).await;
    let mut settled = op.clone();
    settled.state = State::Absent;
    settled.expires_at = Some(op.updated_at - 1);
    overwrite(backend, &settled).await;
    let mut deleted = 0;
    while stored_or_not(backend, operation_id).await {
        deleted += backend.delete_expired(100, 0).await.unwrap();
        assert!(deleted <= 100, "{operation_id} is deleted by retention");
    }
}

async fn stored_or_not<B: Backend>(backend: &B, operation_id: &str) -> bool {
    backend
        .read(TENANT, &id(operation_id))
        .await
        .unwrap()
        .0
        .is_some()
}

async fn an_unlocked_write_happens_only_over_what_it_was_decided_from<B: Backend>(backend: B) {
    let blocker = claimed(&backend, "unlocked-blocker", "refund", 7).await;
    let cmd = command("unlocked-1", "refund", 9);
    // One connection for every read and write, as a call holds one for both.
    let (mut conn, _) = backend.connection().await.unwrap();
    let (none, at, token) = backend
        .read_claimable(&mut conn, TENANT, &cmd.operation_id)
        .await
        .unwrap();
    assert!(none.is_none());
    if !backend.writes_unlocked() {
        // Every write takes the write transaction: no token is handed out unlocked, and no
        // plan is written without a lock.
        assert_eq!(token, None);
        let op = claimed(&backend, "unlocked-0", "refund", 8).await;
        let (_, plan) = machine::report(&op, &confirm_command(&op), None, at);
        let unlocked = backend
            .apply_unlocked(
                backend.connection().await.unwrap().0,
                Decision::new(Some(&op), &plan, at),
            )
            .await;
        assert_eq!(unlocked.unwrap(), None);
        assert_eq!(stored(&backend, "unlocked-0").await.state, State::InFlight);
        return;
    }

    // A first claim with the token the read took: written, with its attempt and event.
    let token = token.expect("a token for an operation not stored");
    assert!(
        token > blocker.fencing_token,
        "{token} after {}",
        blocker.fencing_token
    );
    let (_, claim) = machine::claim(None, &cmd, FreshIdGuard::Clear { token }, at);
    match backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(None, &claim, at).guarded(&cmd),
        )
        .await
        .unwrap()
    {
        Some(crate::Unlocked::Applied { written, .. }) => {
            assert_eq!(written.events, vec![true; claim.events.len()])
        }
        other => panic!("{other:?}"),
    }
    let op = stored(&backend, "unlocked-1").await;
    assert_eq!(
        (op.state, op.fencing_token, op.life),
        (State::InFlight, token, token)
    );
    let (attempts, _) = backend
        .history(TENANT, &op.operation_id, op.life)
        .await
        .unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(
        events_of(&backend, "unlocked-1", EventKind::Claimed).await,
        1
    );
    // A stored operation gets no token from the read.
    assert_eq!(
        backend
            .read_claimable(&mut conn, TENANT, &op.operation_id)
            .await
            .unwrap()
            .2,
        None
    );

    // The same claim again meets the row: nothing is written.
    let again = backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(None, &claim, at).guarded(&cmd),
        )
        .await
        .unwrap();
    assert_eq!(again, Some(crate::Unlocked::Changed));
    assert_eq!(stored(&backend, "unlocked-1").await, op);
    assert_eq!(
        events_of(&backend, "unlocked-1", EventKind::Claimed).await,
        1
    );

    // A confirm decided from a version that another write has since replaced: nothing is
    // written. Decided again from what is stored now, it is.
    let (_, confirm) = machine::report(&op, &confirm_command(&op), None, at);
    let mut moved = op.clone();
    moved.reason = Some("moved on".into());
    overwrite(&backend, &moved).await;
    let stale = backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(Some(&op), &confirm, at),
        )
        .await
        .unwrap();
    assert_eq!(stale, Some(crate::Unlocked::Changed));
    let now_stored = stored(&backend, "unlocked-1").await;
    assert_eq!(now_stored.state, State::InFlight);
    assert_eq!(now_stored.reason.as_deref(), Some("moved on"));
    assert_eq!(
        events_of(&backend, "unlocked-1", EventKind::Confirmed).await,
        0
    );
    let fresh = confirm_unlocked(&backend, &now_stored, at).await;
    assert!(
        matches!(fresh, Some(crate::Unlocked::Applied { .. })),
        "{fresh:?}"
    );
    let confirmed = stored(&backend, "unlocked-1").await;
    assert_eq!(confirmed.state, State::Confirmed);
    assert_eq!(confirmed.version, now_stored.version + 1);
    assert_eq!(
        events_of(&backend, "unlocked-1", EventKind::Confirmed).await,
        1
    );

    // A new id for an intent still running is blocked by it, and writes nothing.
    let blocked = command("unlocked-2", "refund", 7);
    let (_, _, token) = backend
        .read_claimable(&mut conn, TENANT, &blocked.operation_id)
        .await
        .unwrap();
    let (_, claim) = machine::claim(
        None,
        &blocked,
        FreshIdGuard::Clear {
            token: token.unwrap(),
        },
        at,
    );
    match backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(None, &claim, at).guarded(&blocked),
        )
        .await
        .unwrap()
    {
        Some(crate::Unlocked::Blocked(by)) => {
            assert_eq!(by.operation_id, blocker.operation_id);
            assert_eq!(by.state, State::InFlight);
        }
        other => panic!("{other:?}"),
    }
    assert!(backend
        .read(TENANT, &blocked.operation_id)
        .await
        .unwrap()
        .0
        .is_none());
    // Without the guard (what a Begin declaring a new intent sends), it is not.
    let unblocked = backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(None, &claim, at),
        )
        .await
        .unwrap();
    assert!(
        matches!(unblocked, Some(crate::Unlocked::Applied { .. })),
        "{unblocked:?}"
    );

    // An event whose dedupe key is recorded already is not written again.
    let confirmed_op = stored(&backend, "unlocked-1").await;
    let anomaly = || {
        event(
            confirmed_op.life,
            EventKind::DoubleExecution,
            Some("DOUBLE_EXECUTION:1"),
        )
    };
    commit(&backend, "unlocked-1", &events_only(vec![anomaly()]), at).await;
    let mut touched = confirmed_op.clone();
    touched.updated_at += 1;
    let plan = Plan {
        operation: Some(Write::Update(touched)),
        events: vec![
            anomaly(),
            event(confirmed_op.life, EventKind::DoubleExecution, None),
        ],
        ..Plan::default()
    };
    match backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(Some(&confirmed_op), &plan, at),
        )
        .await
        .unwrap()
    {
        Some(crate::Unlocked::Applied { written, .. }) => {
            assert_eq!(written.events, vec![false, true])
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        events_of(&backend, "unlocked-1", EventKind::DoubleExecution).await,
        2
    );

    // A plan decided from an earlier life is not written over a new life at the same
    // version, however long it took to arrive: retention deleted the row it was decided from,
    // and the id was claimed again.
    let first_life = claimed(&backend, "unlocked-lives", "refund", 5).await;
    let (_, late) = machine::report(&first_life, &confirm_command(&first_life), None, at);
    delete_settled_or_not(&backend, "unlocked-lives").await;
    let second_life = claimed(&backend, "unlocked-lives", "refund", 5).await;
    assert_eq!(second_life.version, first_life.version);
    assert_ne!(second_life.life, first_life.life);
    let stale = backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(Some(&first_life), &late, at),
        )
        .await
        .unwrap();
    assert_eq!(stale, Some(crate::Unlocked::Changed));
    assert_eq!(stored(&backend, "unlocked-lives").await, second_life);

    // A decision whose clock reading is older than the statement allows is not written either.
    let now_stored = stored(&backend, "unlocked-lives").await;
    let late = confirm_unlocked(&backend, &now_stored, at - 60_000).await;
    assert_eq!(late, Some(crate::Unlocked::Changed));
    assert_eq!(stored(&backend, "unlocked-lives").await, now_stored);

    // Plans this statement does not write: events alone, and a new life of a stored row.
    let events_alone = events_only(vec![event(op.life, EventKind::DoubleExecution, None)]);
    let current = stored(&backend, "unlocked-1").await;
    let new_life = Plan {
        forgets_attempts: true,
        ..plan.clone()
    };
    for plan in [&events_alone, &new_life] {
        let unlocked = backend
            .apply_unlocked(
                backend.connection().await.unwrap().0,
                Decision::new(Some(&current), plan, at),
            )
            .await;
        assert_eq!(unlocked.unwrap(), None, "{plan:?}");
    }
    // Nor a new life that keeps the attempt log (it took over an ABSENT life's key): a new
    // life of a stored row is claimed under the lock, with the fresh-id guard.
    let ended = in_state(&backend, "unlocked-handed", 1, State::Absent, -1).await;
    let token = FencingToken(ended.fencing_token.get() + 1_000);
    let cmd = command("unlocked-handed", "refund", 1);
    let later = now(&backend).await;
    let (_, handed) = machine::claim(Some(&ended), &cmd, FreshIdGuard::Clear { token }, later);
    assert!(!handed.forgets_attempts);
    let reborn = handed.operation.as_ref().unwrap().operation();
    assert_eq!(reborn.life, token, "a new life that took over the key");
    assert_eq!(reborn.provider_key, ended.provider_key);
    let unlocked = backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(Some(&ended), &handed, later),
        )
        .await;
    assert_eq!(unlocked.unwrap(), None, "{handed:?}");
    assert_eq!(stored(&backend, "unlocked-handed").await, ended);

    // A first claim whose token was taken before another life of the id began, and ended
    // with retention, is not written: a life's tokens all come after every earlier life's.
    let cmd = command("unlocked-overtaken", "refund", 6);
    let (none, at, early) = backend
        .read_claimable(&mut conn, TENANT, &cmd.operation_id)
        .await
        .unwrap();
    assert!(none.is_none());
    let early = early.expect("a token for an operation not stored");
    let between = claimed(&backend, "unlocked-overtaken", "refund", 6).await;
    assert!(between.life > early, "{} after {early}", between.life);
    delete_settled_or_not(&backend, "unlocked-overtaken").await;
    let (_, claim) = machine::claim(None, &cmd, FreshIdGuard::Clear { token: early }, at);
    let overtaken = backend
        .apply_unlocked(
            backend.connection().await.unwrap().0,
            Decision::new(None, &claim, at).guarded(&cmd),
        )
        .await
        .unwrap();
    assert_eq!(overtaken, Some(crate::Unlocked::Changed));
    assert!(!stored_or_not(&backend, "unlocked-overtaken").await);
}

/// A confirm of `op` decided at `at` from `op` as read, written by one statement.
async fn confirm_unlocked<B: Backend>(
    backend: &B,
    op: &Operation,
    at: Millis,
) -> Option<crate::Unlocked> {
    let (_, confirm) = machine::report(op, &confirm_command(op), None, at);
    let (conn, _) = backend.connection().await.unwrap();
    backend
        .apply_unlocked(conn, Decision::new(Some(op), &confirm, at))
        .await
        .unwrap()
}

fn confirm_command(op: &Operation) -> ReportCommand {
    ReportCommand {
        fencing_token: op.fencing_token,
        holder: op.holder.clone(),
        report: Report::Confirm {
            result: b"done".to_vec(),
            provider_ref: Some("re_1".into()),
        },
    }
}

/// The fresh-id guard and the one-statement writes rely on READ COMMITTED (each statement sees
/// what committed before it began; a version check re-reads a row another writer changed):
/// the ledger's connections use it whatever the database's default says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_reads_committed_whatever_the_database_default() {
    use once_testdb::{Engine, TestDb};
    let db = TestDb::new(Engine::Postgres).await;
    db.execute(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.pg_name()
    ))
    .await;
    let mut direct = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let default: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&mut direct)
        .await
        .unwrap();
    assert_eq!(default, "repeatable read");
    let settings = crate::postgres::PgSettings::default();
    let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
    let mut tx = backend.begin_write().await.unwrap();
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(isolation, "read committed");
}

/// A call holds one pooled connection for its lock-free read and the one-statement write, and
/// gives it back before it takes a write transaction: on a pool of one connection, a Begin the
/// one statement cannot write (a new id blocked by its intent) and one it writes both answer,
/// where holding the read's connection into the transaction would wait for the pool forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_never_holds_two_pooled_connections() {
    use once_testdb::{Engine, TestDb};
    let db = TestDb::new(Engine::Postgres).await;
    let settings = crate::postgres::PgSettings {
        max_connections: 1,
        acquire_timeout: std::time::Duration::from_secs(2),
    };
    let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
    let ledger = crate::Ledger::new(backend);
    let (first, _) = ledger
        .begin(&command("one-connection-1", "refund", 3))
        .await
        .unwrap();
    let BeginDecision::Execute(grant) = first else {
        panic!("{first:?}")
    };
    // The same intent under a new id: the one statement finds it blocked, the lock decides.
    let (blocked, _) = ledger
        .begin(&command("one-connection-2", "refund", 3))
        .await
        .unwrap();
    assert!(
        matches!(blocked, BeginDecision::InProgress { .. }),
        "{blocked:?}"
    );
    let op = ledger
        .read(TENANT, &id("one-connection-1"))
        .await
        .unwrap()
        .0
        .unwrap();
    assert_eq!(op.fencing_token, grant.fencing_token);
    // A report from an attempt this life has since replaced needs its attempt record, read
    // under the lock: the locked path after the read, on a report as on a Begin.
    let absent = ReportCommand {
        fencing_token: op.fencing_token,
        holder: op.holder.clone(),
        report: Report::Absent {
            reason: "declined".into(),
        },
    };
    let state = ledger
        .report(TENANT, &id("one-connection-1"), &absent)
        .await
        .unwrap();
    assert_eq!(state, State::Absent);
    let retried = BeginCommand {
        attempt_id: "attempt-retried-after-absent".into(),
        ..command("one-connection-1", "refund", 3)
    };
    let (again, _) = ledger.begin(&retried).await.unwrap();
    let BeginDecision::Execute(second) = again else {
        panic!("{again:?}")
    };
    assert!(second.fencing_token > grant.fencing_token);
    let late = ledger
        .report(TENANT, &id("one-connection-1"), &confirm_command(&op))
        .await;
    // Refused by the state machine, not left waiting for a second connection.
    assert!(matches!(late, Err(StoreError::Rejected(_))), "{late:?}");
    let now = ledger
        .read(TENANT, &id("one-connection-1"))
        .await
        .unwrap()
        .0
        .unwrap();
    let state = ledger
        .report(TENANT, &id("one-connection-1"), &confirm_command(&now))
        .await
        .unwrap();
    assert_eq!(state, State::Confirmed);
}

/// A credential stored under `tenant`, with a secret of `byte`s.
fn new_credential(key_id: &str, tenant: &str, byte: u8) -> access::NewCredential {
    access::NewCredential {
        key_id: key_id.into(),
        tenant: tenant.into(),
        name: key_id.into(),
        roles: access::Roles::of([access::Role::Executor]),
        kind: access::CredentialKind::Key,
        secret_hash: access::SecretHash([byte; 32]),
        while_open: false,
    }
}

fn tenant(name: &str, requests_per_second: Option<i64>) -> access::Tenant {
    access::Tenant {
        name: name.into(),
        created_at: 0,
        max_in_flight: None,
        requests_per_second,
    }
}

/// Admission refreshes its credentials by a watermark: from `-1` every credential; from the
/// watermark it returned, only the credentials created or revoked since, and every credential
/// of a tenant whose limits changed since, as they are now.
async fn credential_refresh_reads_only_what_changed<B: Backend>(backend: B) {
    for name in ["acme", "globex"] {
        backend.put_tenant(&tenant(name, None)).await.unwrap();
    }
    for (n, name) in ["a1", "a2", "g1"].iter().enumerate() {
        let owner = if name.starts_with('a') {
            "acme"
        } else {
            "globex"
        };
        let new = new_credential(name, owner, n as u8 + 1);
        backend.create_credential(&new).await.unwrap();
    }
    let ids = |changes: &crate::CredentialChanges| {
        let mut ids: Vec<String> = changes
            .changed
            .iter()
            .map(|(_, credential, _)| credential.key_id.clone())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    };
    let all = backend.credentials_since(-1).await.unwrap();
    assert_eq!(ids(&all), ["a1", "a2", "g1"]);
    let quiet = backend.credentials_since(all.through).await.unwrap();
    assert!(quiet.changed.is_empty(), "{quiet:?}");
    assert_eq!(quiet.through, all.through);

    backend.revoke_credential("a2").await.unwrap().unwrap();
    let revoked = backend.credentials_since(all.through).await.unwrap();
    assert_eq!(ids(&revoked), ["a2"]);
    assert!(revoked.changed[0].1.revoked_at.is_some());
    assert!(revoked.through > all.through);

    backend
        .put_tenant(&tenant("globex", Some(5)))
        .await
        .unwrap();
    let limited = backend.credentials_since(revoked.through).await.unwrap();
    assert_eq!(ids(&limited), ["g1"]);
    assert_eq!(limited.changed[0].2.requests_per_second, Some(5));

    let later = new_credential("a3", "acme", 9);
    backend.create_credential(&later).await.unwrap();
    let created = backend.credentials_since(limited.through).await.unwrap();
    assert_eq!(ids(&created), ["a3"]);
    assert_eq!(created.changed[0].0, access::SecretHash([9; 32]));
    assert!(backend
        .credentials_since(created.through)
        .await
        .unwrap()
        .changed
        .is_empty());
}

async fn continuity_holds_a_tenant_until_its_loss_is_accepted_and_brings_lost_operations_back<
    B: Backend,
>(
    backend: B,
) {
    use once_core::continuity::{self, Behind, Position, Why};

    // One identity, whichever replica makes it first.
    let first = backend.identity(("ledger-1", [1; 32])).await.unwrap();
    let second = backend.identity(("ledger-2", [2; 32])).await.unwrap();
    assert_eq!(first, ("ledger-1".to_owned(), [1; 32]));
    assert_eq!(second, first);

    // A claim is in the history, by its life and attempt; the highest token issued covers it.
    let ledger = crate::Ledger::new(backend.clone());
    let (granted, _) = ledger.begin(&command("kept-1", "refund", 1)).await.unwrap();
    let BeginDecision::Execute(grant) = granted else {
        panic!("{granted:?}")
    };
    assert!(backend
        .claim_recorded(TENANT, &id("kept-1"), (grant.life, 1))
        .await
        .unwrap());
    assert!(!backend
        .claim_recorded(TENANT, &id("kept-1"), (grant.life, 2))
        .await
        .unwrap());
    let through = backend.issued_through().await.unwrap();
    assert!(through >= grant.fencing_token);
    assert_eq!(backend.standings().await.unwrap(), vec![]);

    // A client saw a token far above: the tenant is held, and no token it saw is issued again.
    let seen = FencingToken(through.get() + 5_000);
    let behind = Behind {
        why: Why::TokenAhead,
        client_epoch: 0,
        client_token: seen,
        operation_id: id("lost-1"),
        ledger_epoch: 0,
        ledger_token: through,
    };
    let standing = backend.hold(TENANT, &behind).await.unwrap();
    assert_eq!(standing.epoch, 0);
    assert_eq!(standing.held.as_ref().unwrap().behind, behind);
    assert!(backend.issued_through().await.unwrap() >= seen);
    // A second finding keeps the first.
    let later = Behind {
        client_token: FencingToken(seen.get() + 1),
        ..behind.clone()
    };
    let again = backend.hold(TENANT, &later).await.unwrap();
    assert_eq!(again.held.unwrap().behind, behind);

    // While held, a Begin that would execute is answered HELD; one that replays is not.
    let held = BeginCommand {
        held: true,
        ..command("new-1", "refund", 2)
    };
    assert_eq!(ledger.begin(&held).await.unwrap().0, BeginDecision::Held);
    assert_eq!(ledger.read(TENANT, &id("new-1")).await.unwrap().0, None);
    let retried = BeginCommand {
        held: true,
        ..command("kept-1", "refund", 1)
    };
    assert!(matches!(
        ledger.begin(&retried).await.unwrap().0,
        BeginDecision::Execute(Grant {
            regranted: true,
            ..
        })
    ));

    // The operation the client saw comes back UNKNOWN, with the attempt it saw, once.
    let now = now(&backend).await;
    let lost = Position {
        ledger: "ledger-1".into(),
        epoch: 0,
        tenant: TENANT.into(),
        operation_id: id("lost-1"),
        tool: "refund".into(),
        fingerprint: Fingerprint([9; 32]),
        life: seen,
        attempt: 1,
        token: seen,
        provider: Some("stripe".into()),
        provider_key: "once_lost".into(),
        lookup_hints: None,
        retention_ms: 60_000,
        at: now - 1_000,
    };
    let reporter = (
        Actor::Executor("conformance".into()),
        Some(HOLDER.to_owned()),
    );
    assert!(ledger.recover(&lost, reporter.clone()).await.unwrap());
    assert!(!ledger.recover(&lost, reporter.clone()).await.unwrap());
    let (op, _) = ledger.read(TENANT, &id("lost-1")).await.unwrap();
    let op = op.unwrap();
    assert_eq!(
        (op.state, op.fencing_token, op.source),
        (State::Unknown, seen, Source::Continuity)
    );
    assert!(op.reconcile_next_at.is_some(), "due for a lookup");
    let (attempts, events) = backend.history(TENANT, &id("lost-1"), seen).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(events.last().unwrap().kind, EventKind::Recovered);
    // An operation the ledger holds at that attempt or later is not brought back.
    let known = Position {
        operation_id: id("kept-1"),
        life: grant.life,
        token: grant.fencing_token,
        fingerprint: Fingerprint([1; 32]),
        ..lost.clone()
    };
    assert!(!ledger.recover(&known, reporter).await.unwrap());
    assert!(
        continuity::check(&known, 0, backend.issued_through().await.unwrap())
            == continuity::Check::LookUp
    );

    // Accepting opens the next epoch and ends the hold, recorded with who and why.
    let operator = Actor::Operator("oncall".into());
    let accepted = backend
        .accept(None, &operator, "restored from last night's backup")
        .await
        .unwrap();
    assert_eq!(accepted.len(), 1);
    assert_eq!(
        (accepted[0].tenant.as_str(), accepted[0].epoch),
        (TENANT, 1)
    );
    assert_eq!(accepted[0].held.as_ref().unwrap().behind, behind);
    let standings = backend.standings().await.unwrap();
    assert_eq!((standings[0].epoch, standings[0].held.is_none()), (1, true));
    // Nothing held is left to accept; a tenant named is accepted whether or not it is held.
    assert_eq!(
        backend.accept(None, &operator, "again").await.unwrap(),
        vec![]
    );
    let named = backend
        .accept(Some("t2"), &operator, "t2 too")
        .await
        .unwrap();
    assert_eq!(
        (
            named[0].tenant.as_str(),
            named[0].epoch,
            named[0].held.is_none()
        ),
        ("t2", 1, true)
    );
    let history = backend.acceptances(None, 10).await.unwrap();
    assert_eq!(
        history
            .iter()
            .map(|a| a.tenant.as_str())
            .collect::<Vec<_>>(),
        ["t2", TENANT]
    );
    assert_eq!(history[1].actor, operator);
    assert_eq!(backend.acceptances(Some("t2"), 10).await.unwrap().len(), 1);
    // A hold judged in an epoch that has moved on is not written.
    let stale = backend.hold(TENANT, &behind).await.unwrap();
    assert_eq!((stale.epoch, stale.held), (1, None));
}

async fn one_replica_links_a_range_and_retention_keeps_each_tenants_anchor<B: Backend>(backend: B) {
    use once_core::chain::{self, Entry};

    let entry = |sequence| Entry {
        sequence,
        digest: "00".repeat(16),
        result: None,
    };
    assert_eq!(backend.chained_through().await.unwrap(), 0);
    let first = chain::next_link("t1", None, &[entry(3)], 5, 1);
    let other = chain::next_link("t2", None, &[entry(4)], 5, 1);
    assert!(backend
        .append_links((0, 5), &[first.clone(), other])
        .await
        .unwrap());
    // A second replica that read the same progress links nothing.
    let late = chain::next_link("t1", None, &[entry(3)], 5, 2);
    assert!(!backend.append_links((0, 5), &[late]).await.unwrap());
    assert_eq!(backend.chained_through().await.unwrap(), 5);
    assert_eq!(backend.last_link("t1").await.unwrap(), Some(first.clone()));
    let second = chain::next_link("t1", Some(&first), &[entry(7)], 9, 3);
    assert!(backend
        .append_links((5, 9), std::slice::from_ref(&second))
        .await
        .unwrap());
    assert_eq!(
        backend.links("t1", 0, 10).await.unwrap(),
        vec![first.clone(), second.clone()]
    );
    assert_eq!(
        backend.links("t1", 5, 10).await.unwrap(),
        vec![second.clone()]
    );
    assert_eq!(backend.link_before("t1", 2).await.unwrap(), Some(first));
    // Retention deleted every event through 9: each tenant keeps its newest link as anchor.
    assert_eq!(backend.delete_links_through(9).await.unwrap(), 1);
    assert_eq!(backend.links("t1", 0, 10).await.unwrap(), vec![second]);
    assert_eq!(backend.links("t2", 0, 10).await.unwrap().len(), 1);
}
