//! A model-based randomized test of the core.
//!
//! Random sequences of Begins (fresh, retried, from another session, under a new intent, with
//! other arguments), reports (fresh, late, stale, duplicated, from earlier lives), heartbeats,
//! lease expiry, retention, reconciler lookups (claimed, then judged later, perhaps after the
//! operation moved on) and operator resolutions (of the attempt examined, or a stale one, with
//! retried resolution ids) run against a small in-memory store that orchestrates the core as
//! `once-store`'s `Ledger` does. A reference model records what has been granted, confirmed
//! and proven, and after every step checks that:
//!
//! - never two live grants: at most one operation of one intent holds a live lease, unless a
//!   new intent was declared, and only the latest token of an operation can heartbeat;
//! - a fencing token is never issued twice;
//! - a CONFIRMED operation never changes, until retention deletes it;
//! - once a report proving the effect (a confirm by an attempt of this life) was processed, the
//!   operation is never executable again in this life;
//! - every exit from UNKNOWN is one of the three doors, recorded with its actor;
//! - every change of state is recorded by one event saying from what to what;
//! - across backups and restores of the store (a ledger restored to an earlier state), with
//!   clients that remember the positions of every grant they saw and show the highest with each
//!   Begin, no attempt the restored store forgot is followed by a second EXECUTE of its
//!   operation: the client's Begin is refused, its report brings the operation back UNKNOWN,
//!   and an operator's acceptance opens the next epoch.
//!
//! `PROPTEST_CASES` sets how many sequences run (`make model-long` runs many).

use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;

use crate::continuity::{self, Check, Position};
use crate::identity::Fingerprint;
use crate::machine::{self, BeginStep, FreshIdGuard, Plan, Write};
use crate::model::*;
use crate::reconcile::{self, Applied, Backoff, Capabilities, Escalation, Lookup, LookupPolicy};

const TENANT: &str = "t";
const TOOL: &str = "refund";
const LEASE: i64 = 1_000;
const RETENTION: i64 = 5_000;
const CLAIM: i64 = 3_000;
/// How long an ABSENT row outlives its retention, keeping its provider key for the next life.
const TOMBSTONE: i64 = 20_000;
/// Operation ids; all share one intent (tool and fingerprint), so the fresh-id guard matters.
const IDS: [&str; 2] = ["refund:x", "refund:y"];

#[derive(Debug, Clone)]
enum ReportKind {
    Confirm {
        result: u8,
        provider_ref: Option<u8>,
    },
    Absent,
    Unknown,
}

#[derive(Debug, Clone)]
enum VerdictKind {
    Confirmed(u8),
    Absent,
    Unknown,
}

#[derive(Debug, Clone)]
enum Action {
    Begin {
        op: usize,
        new_intent: bool,
        other_arguments: bool,
    },
    /// A transport retry of an earlier Begin: the same attempt id and context.
    RetryBegin {
        grant: usize,
    },
    /// The same attempt id from another session.
    BeginElsewhere {
        grant: usize,
    },
    /// A report, sent `twice` when its transport retries it.
    Report {
        grant: usize,
        kind: ReportKind,
        twice: bool,
    },
    Heartbeat {
        grant: usize,
    },
    Tick {
        ms: i64,
    },
    SweepLeases,
    Retention,
    StartLookup {
        op: usize,
        before_due: bool,
    },
    FinishLookup {
        lookup: usize,
        verdict: VerdictKind,
    },
    Resolve {
        op: usize,
        stale: bool,
        confirmed: bool,
        resolution: u8,
    },
    /// A copy of the database as it is now, replacing the one before.
    Backup,
    /// The database put back to the last copy: the ledger restored to an earlier state.
    Restore,
    /// An operator accepts what the restore lost: the next epoch begins.
    Accept,
}

fn action() -> impl Strategy<Value = Action> {
    let report = prop_oneof![
        (any::<u8>(), proptest::option::of(0u8..3)).prop_map(|(result, provider_ref)| {
            ReportKind::Confirm {
                result,
                provider_ref,
            }
        }),
        Just(ReportKind::Absent),
        Just(ReportKind::Unknown),
    ];
    let verdict = prop_oneof![
        (0u8..3).prop_map(VerdictKind::Confirmed),
        Just(VerdictKind::Absent),
        Just(VerdictKind::Unknown),
    ];
    prop_oneof![
        4 => (0..IDS.len(), prop::bool::weighted(0.1), prop::bool::weighted(0.05)).prop_map(
            |(op, new_intent, other_arguments)| Action::Begin { op, new_intent, other_arguments }
        ),
        1 => any::<usize>().prop_map(|grant| Action::RetryBegin { grant }),
        1 => any::<usize>().prop_map(|grant| Action::BeginElsewhere { grant }),
        5 => (any::<usize>(), report, prop::bool::weighted(0.3))
            .prop_map(|(grant, kind, twice)| Action::Report { grant, kind, twice }),
        1 => any::<usize>().prop_map(|grant| Action::Heartbeat { grant }),
        3 => (0..2 * LEASE).prop_map(|ms| Action::Tick { ms }),
        // Past a retention, so settled rows expire and the next Begin starts a new life.
        1 => (RETENTION..2 * RETENTION).prop_map(|ms| Action::Tick { ms }),
        1 => Just(Action::SweepLeases),
        1 => Just(Action::Retention),
        2 => (0..IDS.len(), any::<bool>()).prop_map(|(op, before_due)| Action::StartLookup { op, before_due }),
        2 => (any::<usize>(), verdict).prop_map(|(lookup, verdict)| Action::FinishLookup { lookup, verdict }),
        2 => (0..IDS.len(), prop::bool::weighted(0.2), any::<bool>(), 0u8..4).prop_map(
            |(op, stale, confirmed, resolution)| Action::Resolve { op, stale, confirmed, resolution }
        ),
        1 => Just(Action::Backup),
        1 => Just(Action::Restore),
        1 => Just(Action::Accept),
    ]
}

/// A grant as its executor holds it.
#[derive(Debug, Clone)]
struct Held {
    op: usize,
    token: FencingToken,
    life: FencingToken,
    /// Its number in its life.
    attempt: u32,
    /// The provider key it was granted.
    provider_key: String,
    attempt_id: String,
    context: AttemptContext,
    fingerprint: Fingerprint,
    new_intent: bool,
}

/// The in-memory store, orchestrating the core as `Ledger` does over a database.
#[derive(Debug, Default)]
struct Store {
    now: Millis,
    rows: BTreeMap<usize, Operation>,
    attempts: BTreeMap<usize, Vec<Attempt>>,
    /// Every event ever written, with its operation; kept across deletions, as events are.
    events: Vec<(usize, NewEvent)>,
    last_token: FencingToken,
    lookups: Vec<(usize, Lookup)>,
    /// The tenant's epoch and whether its executions are held (see `crate::continuity`).
    epoch: u64,
    held: bool,
}

/// A copy of what a database holds, and of what the reference model knows of that timeline.
#[derive(Debug, Clone)]
struct Snapshot {
    rows: BTreeMap<usize, Operation>,
    attempts: BTreeMap<usize, Vec<Attempt>>,
    events: Vec<(usize, NewEvent)>,
    last_token: FencingToken,
    epoch: u64,
    held: bool,
    confirmed: BTreeMap<usize, (FencingToken, Option<Vec<u8>>)>,
    proven: BTreeMap<usize, FencingToken>,
    did_not_run: HashSet<FencingToken>,
}

/// What a Begin showing a position may be answered, as the replica judges it.
#[derive(Debug, PartialEq, Eq)]
enum Judged {
    Free,
    Held,
    /// A position of an earlier epoch the history lacks: this Begin is refused.
    Lost,
    Behind,
}

impl Store {
    /// Whether the history records the attempt a position names (its claim or its recovery).
    fn recorded(&self, op: usize, position: &Position) -> bool {
        self.events.iter().any(|(o, e)| {
            *o == op
                && matches!(e.kind, EventKind::Claimed | EventKind::Recovered)
                && e.life == position.life
                && e.attempt == Some(position.attempt)
        })
    }

    /// Whether the history records any event of the life a position names.
    fn life_recorded(&self, op: usize, position: &Position) -> bool {
        self.events
            .iter()
            .any(|(o, e)| *o == op && e.life == position.life)
    }

    /// Whether the history records a grant (its claim or its recovery).
    fn knows(&self, held: &Held) -> bool {
        self.events.iter().any(|(o, e)| {
            *o == held.op
                && matches!(e.kind, EventKind::Claimed | EventKind::Recovered)
                && e.life == held.life
                && e.attempt == Some(held.attempt)
        })
    }

    /// The replica's judgement of the position a Begin shows (`onced`'s `continuity`).
    fn judge(&mut self, shown: &[&Position]) -> Judged {
        let mut judged = if self.held {
            Judged::Held
        } else {
            Judged::Free
        };
        for position in shown {
            let behind = match continuity::check(position, self.epoch, self.last_token) {
                Check::Fine => false,
                Check::Behind(_) => true,
                Check::LookUp => {
                    let op = op_of(position);
                    let recorded = self.recorded(op, position);
                    continuity::after_lookup(
                        position,
                        recorded,
                        (self.epoch, self.last_token),
                        self.now,
                        i64::MAX / 4,
                    )
                    .is_some()
                }
            };
            if !behind {
                continue;
            }
            if position.epoch < self.epoch {
                // Of an epoch whose loss was accepted: this Begin is refused, the tenant is not
                // held again.
                if judged != Judged::Behind {
                    judged = Judged::Lost;
                }
                continue;
            }
            self.held = true;
            self.last_token = self.last_token.max(position.token);
            judged = Judged::Behind;
        }
        judged
    }

    /// A client's report of the positions it kept: each attempt the history does not record
    /// comes back UNKNOWN.
    fn recover(&mut self, positions: &[Position]) {
        for position in positions {
            let op = op_of(position);
            if self.recorded(op, position) {
                continue;
            }
            let current = self.rows.get(&op).cloned();
            let reporter = (Actor::Executor("mcp-0".into()), None);
            let life_recorded = self.life_recorded(op, position);
            if let Some(plan) = continuity::recover(
                current.as_ref(),
                (position, life_recorded),
                (&reporter.0, &reporter.1),
                self.now,
            ) {
                self.last_token = self.last_token.max(position.token);
                self.apply(op, &plan);
            }
        }
    }

    fn apply(&mut self, op: usize, plan: &Plan) {
        let before = self.rows.get(&op).map(|row| row.state);
        match &plan.operation {
            None => {}
            Some(Write::Insert(row)) => {
                assert!(
                    self.rows.insert(op, row.clone()).is_none(),
                    "an insert over a row"
                );
            }
            Some(Write::Update(row)) => {
                let stored = self.rows.get_mut(&op).expect("an update of a missing row");
                let version = stored.version + 1;
                *stored = row.clone();
                stored.version = version;
            }
        }
        if plan.forgets_attempts {
            self.attempts.remove(&op);
        }
        if let Some(attempt) = &plan.attempt {
            self.attempts.entry(op).or_default().push(attempt.clone());
        }
        for event in &plan.events {
            let duplicate = event.dedupe_key.is_some()
                && self
                    .events
                    .iter()
                    .any(|(o, e)| *o == op && e.dedupe_key == event.dedupe_key);
            if !duplicate {
                self.events.push((op, event.clone()));
            }
        }
        // Every change of state is recorded by one event saying from what to what.
        if let Some(write) = &plan.operation {
            let after = write.operation().state;
            let from = if plan.forgets_attempts {
                Some(State::Absent)
            } else {
                before
            };
            if from != Some(after) {
                let recorded = plan
                    .events
                    .iter()
                    .any(|e| e.from == from.or(Some(State::Absent)) && e.to == Some(after));
                assert!(
                    recorded,
                    "{from:?} -> {after:?} without its event: {plan:?}"
                );
            }
        }
    }

    fn guard(&mut self, op: usize, cmd: &BeginCommand) -> FreshIdGuard {
        if !cmd.new_intent {
            let mut open: Vec<&Operation> = self
                .rows
                .iter()
                .filter(|(other, row)| {
                    **other != op
                        && row.tool == cmd.tool
                        && row.fingerprint == cmd.fingerprint
                        && matches!(row.state, State::Unknown | State::InFlight)
                })
                .map(|(_, row)| row)
                .collect();
            open.sort_by_key(|row| row.state != State::Unknown);
            if let Some(row) = open.first() {
                return FreshIdGuard::Blocked(Blocking {
                    operation_id: row.operation_id.clone(),
                    state: row.state,
                    attempt: row.attempt,
                    lease_deadline: row.lease_deadline,
                    updated_at: row.updated_at,
                });
            }
        }
        self.last_token += 1 + self.last_token.get() % 3;
        FreshIdGuard::Clear {
            token: self.last_token,
        }
    }

    fn begin(&mut self, op: usize, cmd: &BeginCommand) -> BeginDecision {
        let current = self.rows.get(&op).cloned();
        let (decision, plan) = match machine::begin(current.as_ref(), cmd, self.now) {
            BeginStep::Decided(decision, plan) => (decision, plan),
            BeginStep::Claim => {
                let guard = self.guard(op, cmd);
                machine::claim(current.as_ref(), cmd, guard, self.now)
            }
        };
        self.apply(op, &plan);
        decision
    }

    fn report(
        &mut self,
        op: usize,
        cmd: &ReportCommand,
    ) -> (Result<State, machine::Rejection>, Plan) {
        let Some(row) = self.rows.get(&op).cloned() else {
            return (Ok(State::Absent), Plan::default());
        };
        let earlier = machine::needs_attempt_record(&row, cmd.fencing_token)
            .then(|| {
                self.attempts
                    .get(&op)
                    .and_then(|log| log.iter().find(|a| a.fencing_token == cmd.fencing_token))
                    .cloned()
            })
            .flatten();
        let (answer, plan) = machine::report(&row, cmd, earlier.as_ref(), self.now);
        self.apply(op, &plan);
        (answer, plan)
    }
}

/// What the reference model knows, independently of the store.
#[derive(Debug, Default)]
struct Reference {
    held: Vec<Held>,
    issued: HashSet<FencingToken>,
    /// Per operation: the life and result it was CONFIRMED with.
    confirmed: BTreeMap<usize, (FencingToken, Option<Vec<u8>>)>,
    /// Per operation: the life in which an attempt of that life confirmed the effect.
    proven: BTreeMap<usize, FencingToken>,
    /// Tokens whose attempt said by itself, while it held the execution right, that it did not
    /// perform the effect.
    did_not_run: HashSet<FencingToken>,
    /// The position of every grant the clients saw, in every timeline: they remember them all.
    positions: Vec<Position>,
    /// The last backup.
    backup: Option<Snapshot>,
}

impl Reference {
    /// The highest position the clients saw, which they show with every Begin.
    fn highest(&self) -> Option<&Position> {
        self.positions.iter().max_by_key(|p| (p.epoch, p.token))
    }

    /// Records the position of a grant of `op` made for `cmd` in `store`.
    fn saw(&mut self, store: &Store, cmd: &BeginCommand, grant: &Grant) {
        self.positions.push(Position {
            ledger: "sim".into(),
            epoch: store.epoch,
            tenant: TENANT.into(),
            operation_id: cmd.operation_id.clone(),
            tool: cmd.tool.clone(),
            fingerprint: cmd.fingerprint,
            life: grant.life,
            attempt: grant.attempt,
            token: grant.fencing_token,
            provider: cmd.provider.clone(),
            provider_key: grant.provider_key.clone(),
            lookup_hints: None,
            retention_ms: cmd.retention_ms,
            at: store.now,
        });
    }

    /// Whether the store forgot an attempt of `op` the clients saw granted: its history does not
    /// record it, and its life is not one the history records with no live row left (a life
    /// that settled past its retention is over, restored or not).
    fn forgotten(&self, store: &Store, op: usize) -> bool {
        self.positions.iter().any(|p| {
            let life_over = store.life_recorded(op, p)
                && store
                    .rows
                    .get(&op)
                    .is_none_or(|row| row.life != p.life || row.is_expired(store.now));
            op_of(p) == op && !store.recorded(op, p) && !life_over
        })
    }
}

fn op_of(position: &Position) -> usize {
    IDS.iter()
        .position(|id| *id == position.operation_id.as_str())
        .expect("one of the simulation's ids")
}

/// A Begin of `op` as the clients make it: showing their highest position; refused when it
/// shows the store behind or would execute while the tenant is held, and then reporting every
/// position they kept. `None` when refused.
fn begin_shown(
    store: &mut Store,
    model: &mut Reference,
    op: usize,
    cmd: &mut BeginCommand,
) -> Option<BeginDecision> {
    // The highest position seen, and the latest of this operation.
    let highest = model.highest().cloned();
    let own = model
        .positions
        .iter()
        .filter(|p| op_of(p) == op)
        .max_by_key(|p| (p.epoch, p.token))
        .cloned();
    let shown: Vec<&Position> = highest.iter().chain(own.iter()).collect();
    match store.judge(&shown) {
        Judged::Behind | Judged::Lost => {
            store.recover(&model.positions);
            return None;
        }
        Judged::Held => cmd.held = true,
        Judged::Free => {}
    }
    let forgotten = model.forgotten(store, op);
    let decision = store.begin(op, cmd);
    match &decision {
        BeginDecision::Held => {
            store.recover(&model.positions);
            return None;
        }
        BeginDecision::Execute(grant) if !grant.regranted => {
            assert!(
                !forgotten,
                "a second EXECUTE of {op} after the ledger forgot an attempt its clients saw"
            );
            model.saw(store, cmd, grant);
        }
        _ => {}
    }
    Some(decision)
}

fn command(
    op: usize,
    attempt_id: String,
    context: AttemptContext,
    fingerprint: Fingerprint,
    new_intent: bool,
) -> BeginCommand {
    BeginCommand {
        tenant: TENANT.into(),
        operation_id: OperationId::parse("id", IDS[op]).unwrap(),
        tool: TOOL.into(),
        fingerprint,
        attempt_id,
        actor: Actor::Executor(context.client_name.clone().unwrap_or_default()),
        context,
        lease_ttl_ms: LEASE,
        retention_ms: RETENTION,
        new_intent,
        provider: Some("stripe".into()),
        lookup_hints: None,
        holder: None,
        held: false,
    }
}

fn policy() -> LookupPolicy {
    LookupPolicy {
        name: "stripe".into(),
        capabilities: Capabilities {
            miss_is_authoritative: true,
            settle_time_ms: LEASE / 2,
            dedupes_by_provider_key: true,
        },
        backoff: Backoff {
            first_ms: 200,
            max_ms: 2_000,
        },
        escalation: Escalation {
            after_lookups: Some(3),
            after_ms: None,
        },
        max_result_bytes: 64,
    }
}

fn run(actions: Vec<Action>) {
    let mut store = Store {
        now: 1_000_000,
        last_token: FencingToken(1 << 20),
        ..Store::default()
    };
    let mut model = Reference::default();
    let intent = Fingerprint([1; 32]);
    for (step, action) in actions.into_iter().enumerate() {
        let pick = |n: usize, len: usize| (len > 0).then(|| n % len);
        match action {
            Action::Begin {
                op,
                new_intent,
                other_arguments,
            } => {
                let fingerprint = if other_arguments {
                    Fingerprint([2; 32])
                } else {
                    intent
                };
                let context = AttemptContext {
                    client_name: Some(format!("mcp-{}", step % 3)),
                    session_id: Some(format!("session-{step}")),
                    request_id: Some("1".into()),
                };
                let mut cmd = command(
                    op,
                    format!("attempt-{step:012}"),
                    context,
                    fingerprint,
                    new_intent,
                );
                let Some(decision) = begin_shown(&mut store, &mut model, op, &mut cmd) else {
                    continue;
                };
                if let BeginDecision::Execute(grant) = decision {
                    assert!(!grant.regranted);
                    assert!(
                        model.issued.insert(grant.fencing_token),
                        "token {} issued twice",
                        grant.fencing_token
                    );
                    assert!(
                        !other_arguments || store.rows[&op].fingerprint == fingerprint,
                        "EXECUTE with another fingerprint"
                    );
                    model.held.push(Held {
                        op,
                        token: grant.fencing_token,
                        life: store.rows[&op].life,
                        attempt: grant.attempt,
                        provider_key: grant.provider_key,
                        attempt_id: cmd.attempt_id,
                        context: cmd.context,
                        fingerprint,
                        new_intent,
                    });
                }
            }
            Action::RetryBegin { grant } | Action::BeginElsewhere { grant } => {
                let Some(i) = pick(grant, model.held.len()) else {
                    continue;
                };
                let held = model.held[i].clone();
                let elsewhere = matches!(action, Action::BeginElsewhere { .. });
                let mut context = held.context.clone();
                if elsewhere {
                    context.session_id = Some("another-session".into());
                }
                let mut cmd = command(
                    held.op,
                    held.attempt_id.clone(),
                    context,
                    held.fingerprint,
                    held.new_intent,
                );
                let Some(decision) = begin_shown(&mut store, &mut model, held.op, &mut cmd) else {
                    continue;
                };
                if let BeginDecision::Execute(grant) = decision {
                    if grant.regranted {
                        // Only to the very attempt that holds the grant: same id, same context.
                        let holder = model
                            .held
                            .iter()
                            .find(|h| h.op == held.op && h.token == grant.fencing_token)
                            .expect("a regrant of a token never granted");
                        assert_eq!(
                            (&holder.attempt_id, &holder.context),
                            (&cmd.attempt_id, &cmd.context),
                            "a regrant to another attempt"
                        );
                    } else {
                        assert!(
                            model.issued.insert(grant.fencing_token),
                            "token issued twice"
                        );
                        model.held.push(Held {
                            token: grant.fencing_token,
                            life: store.rows[&held.op].life,
                            attempt: grant.attempt,
                            provider_key: grant.provider_key,
                            context: cmd.context,
                            ..held
                        });
                    }
                }
            }
            Action::Report { grant, kind, twice } => {
                let Some(i) = pick(grant, model.held.len()) else {
                    continue;
                };
                let held = model.held[i].clone();
                let report = match kind {
                    ReportKind::Confirm {
                        result,
                        provider_ref,
                    } => Report::Confirm {
                        result: vec![result],
                        provider_ref: provider_ref.map(|r| format!("re_{r}")),
                    },
                    ReportKind::Absent => Report::Absent {
                        reason: "declined".into(),
                    },
                    ReportKind::Unknown => Report::Unknown {
                        reason: "timeout".into(),
                    },
                };
                let proves = matches!(report, Report::Confirm { .. });
                let says_absent = matches!(report, Report::Absent { .. });
                let before = store.rows.get(&held.op).cloned();
                let latest = before
                    .as_ref()
                    .is_some_and(|row| row.fencing_token == held.token);
                let cmd = ReportCommand {
                    fencing_token: held.token,
                    holder: None,
                    report,
                };
                let (answer, plan) = store.report(held.op, &cmd);
                if twice {
                    // Reports are idempotent: the same answer, and nothing recorded twice.
                    let state = |store: &Store| store.rows.get(&held.op).map(|row| row.state);
                    let (recorded, before) = (store.events.len(), state(&store));
                    let (again, _) = store.report(held.op, &cmd);
                    assert_eq!(again, answer, "a retried report got another answer");
                    assert_eq!(
                        (store.events.len(), state(&store)),
                        (recorded, before),
                        "a retried report changed something"
                    );
                }
                let current_life = before.as_ref().map(|row| row.life);
                // An attempt of an earlier life that handed its provider key on reports an
                // effect under this life's key: it is judged as this life's own would be.
                let shares_key = before
                    .as_ref()
                    .is_some_and(|row| row.provider_key == held.provider_key);
                if current_life == Some(held.life) || shares_key {
                    // A confirm by an attempt the store forgot (a restore) it cannot take
                    // yet: that attempt comes back with the client's report, before any Begin
                    // of the operation executes (the second-EXECUTE check).
                    if let (true, Some(life), true) = (proves, current_life, store.knows(&held)) {
                        model.proven.insert(held.op, life);
                    }
                    if says_absent && latest && answer.is_ok() {
                        model.did_not_run.insert(held.token);
                    }
                    // A superseded attempt's confirm settles CONFIRMED only when every later
                    // attempt of the life said by itself that it did nothing; otherwise the
                    // effect may have happened twice, and that is for an operator.
                    let was_confirmed = before
                        .as_ref()
                        .is_some_and(|row| row.state == State::Confirmed);
                    let now_confirmed = store
                        .rows
                        .get(&held.op)
                        .is_some_and(|row| row.state == State::Confirmed);
                    if proves && !latest && !was_confirmed && now_confirmed {
                        // Of the later attempts the store knows: one a restore made it forget
                        // is for continuity to bring back, when a client reports it.
                        for later in model
                            .held
                            .iter()
                            .filter(|h| h.op == held.op && h.token > held.token && store.knows(h))
                        {
                            assert!(
                                model.did_not_run.contains(&later.token),
                                "CONFIRMED by token {} although token {} may also have run",
                                held.token,
                                later.token
                            );
                        }
                    }
                } else {
                    assert!(
                        plan.is_empty(),
                        "a report from a life that kept its provider key changed something"
                    );
                }
            }
            Action::Heartbeat { grant } => {
                let Some(i) = pick(grant, model.held.len()) else {
                    continue;
                };
                let held = model.held[i].clone();
                let Some(row) = store.rows.get(&held.op).cloned() else {
                    continue;
                };
                let beat = HeartbeatCommand {
                    fencing_token: held.token,
                    holder: None,
                    ttl_ms: LEASE,
                };
                if let Ok((_, plan)) = machine::heartbeat(&row, &beat, store.now) {
                    assert_eq!(
                        held.token, row.fencing_token,
                        "only the latest token heartbeats"
                    );
                    store.apply(held.op, &plan);
                }
            }
            Action::Tick { ms } => store.now += ms,
            Action::SweepLeases => {
                for op in 0..IDS.len() {
                    let expired = store
                        .rows
                        .get(&op)
                        .and_then(|row| machine::expire_lease(row, store.now));
                    if let Some(plan) = expired {
                        store.apply(op, &plan);
                    }
                }
            }
            Action::Retention => {
                let now = store.now;
                let gone: Vec<usize> = store
                    .rows
                    .iter()
                    // ABSENT rows stay as tombstones for the provider key window, as the
                    // store keeps them, so their key can pass to the next life.
                    .filter(|(_, row)| {
                        row.is_expired(now)
                            && (row.state != State::Absent || row.updated_at + TOMBSTONE <= now)
                    })
                    .map(|(op, _)| *op)
                    .collect();
                for op in gone {
                    assert!(
                        store.rows[&op].state.is_settled(),
                        "retention of an open operation"
                    );
                    store.rows.remove(&op);
                    store.attempts.remove(&op);
                }
            }
            Action::StartLookup { op, before_due } => {
                let now = store.now;
                let Some(row) = store.rows.get_mut(&op) else {
                    continue;
                };
                let claimable = row.state == State::Unknown
                    && !row.held_for_operator()
                    && row.lookup_claimed_until.is_none_or(|until| until <= now)
                    && (before_due || reconcile::is_due(row, now));
                if claimable {
                    row.lookup_claimed_until = Some(now + CLAIM);
                    row.version += 1;
                    store.lookups.push((op, Lookup::of(row, now)));
                }
            }
            Action::FinishLookup { lookup, verdict } => {
                let Some(i) = pick(lookup, store.lookups.len()) else {
                    continue;
                };
                let (op, lookup) = store.lookups.remove(i);
                let Some(row) = store.rows.get(&op).cloned() else {
                    continue;
                };
                let verdict = match verdict {
                    VerdictKind::Confirmed(r) => reconcile::Verdict::Confirmed {
                        provider_ref: format!("re_{r}"),
                        result: vec![r; 1 + r as usize * 40],
                        evidence: "{}".into(),
                    },
                    VerdictKind::Absent => reconcile::Verdict::Absent {
                        evidence: "{}".into(),
                    },
                    VerdictKind::Unknown => reconcile::Verdict::Unknown { why: "503".into() },
                };
                let (applied, plan) =
                    reconcile::apply_verdict(&row, &lookup, &verdict, &policy(), 0.0, store.now);
                if applied == Applied::Stale {
                    // It changes nothing; at most it records a second provider object found
                    // for a CONFIRMED operation.
                    assert!(plan.operation.is_none() && plan.attempt.is_none());
                    assert!(plan.events.iter().all(|e| {
                        e.kind == EventKind::DoubleExecution && row.state == State::Confirmed
                    }));
                }
                if let (reconcile::Verdict::Absent { .. }, Applied::Judged(State::Absent)) =
                    (&verdict, applied)
                {
                    assert!(
                        lookup.issued_at
                            >= row.effect_horizon() + policy().capabilities.settle_time_ms,
                        "a miss counted before the settle time"
                    );
                }
                store.apply(op, &plan);
            }
            Action::Resolve {
                op,
                stale,
                confirmed,
                resolution,
            } => {
                let cmd = |fencing_token| ResolveCommand {
                    resolution: if confirmed {
                        Resolution::Confirmed {
                            result: b"resolved".to_vec(),
                            provider_ref: Some("re_op".into()),
                        }
                    } else {
                        Resolution::Absent
                    },
                    reason: "checked".into(),
                    actor: Actor::Operator("alice".into()),
                    resolution_id: format!("r-{resolution}"),
                    fencing_token,
                    attempt: None,
                };
                let key = machine::resolution_key(&format!("r-{resolution}"));
                let prior = store
                    .events
                    .iter()
                    .find(|(o, e)| *o == op && e.dedupe_key.as_deref() == Some(key.as_str()))
                    .and_then(|(_, e)| {
                        e.to.map(|state| PriorResolution::from_event(state, e.details.as_deref()))
                    });
                let Some(row) = store.rows.get(&op).cloned() else {
                    continue;
                };
                // A stale resolution names a token the operator saw earlier: of an earlier
                // attempt, perhaps of an earlier life.
                let examined = if stale {
                    model
                        .held
                        .iter()
                        .filter(|h| h.op == op)
                        .map(|h| h.token)
                        .nth(resolution as usize)
                        .unwrap_or(row.fencing_token)
                } else {
                    row.fencing_token
                };
                if let Ok((_, plan)) = machine::resolve(&row, &cmd(examined), prior, store.now) {
                    if !plan.is_empty() {
                        assert_eq!(
                            examined, row.fencing_token,
                            "a resolution of an attempt not examined"
                        );
                    }
                    store.apply(op, &plan);
                }
            }
            Action::Backup => {
                model.backup = Some(Snapshot {
                    rows: store.rows.clone(),
                    attempts: store.attempts.clone(),
                    events: store.events.clone(),
                    last_token: store.last_token,
                    epoch: store.epoch,
                    held: store.held,
                    confirmed: model.confirmed.clone(),
                    proven: model.proven.clone(),
                    did_not_run: model.did_not_run.clone(),
                });
            }
            Action::Restore => {
                let Some(backup) = model.backup.clone() else {
                    continue;
                };
                store.rows = backup.rows;
                store.attempts = backup.attempts;
                store.events = backup.events;
                store.last_token = backup.last_token;
                store.epoch = backup.epoch;
                store.held = backup.held;
                // The replicas restart with it: no lookup is in flight.
                store.lookups.clear();
                model.confirmed = backup.confirmed;
                model.proven = backup.proven;
                model.did_not_run = backup.did_not_run;
            }
            Action::Accept => {
                if store.held {
                    store.epoch += 1;
                    store.held = false;
                }
            }
        }
        check(&store, &mut model);
    }
}

/// The properties that hold after every step.
fn check(store: &Store, model: &mut Reference) {
    let now = store.now;
    // Never two live grants of one intent, unless a new intent was declared.
    let live_without_new_intent = store
        .rows
        .iter()
        .filter(|(op, row)| {
            row.lease_live(now)
                && row.fingerprint == Fingerprint([1; 32])
                && model
                    .held
                    .iter()
                    .any(|h| h.op == **op && h.token == row.fencing_token && !h.new_intent)
        })
        .count();
    assert!(
        live_without_new_intent <= 1,
        "two live grants of one intent"
    );

    for op in 0..IDS.len() {
        let row = store.rows.get(&op);
        // CONFIRMED never changes until retention deletes it (or a new life begins).
        match (model.confirmed.get(&op), row) {
            (Some((life, result)), Some(row)) if row.life == *life => {
                assert_eq!(row.state, State::Confirmed, "CONFIRMED changed: {row:?}");
                assert_eq!(&row.result, result, "a confirmed result changed");
            }
            _ => {
                model.confirmed.remove(&op);
            }
        }
        if let Some(row) = row.filter(|row| row.state == State::Confirmed) {
            model
                .confirmed
                .entry(op)
                .or_insert((row.life, row.result.clone()));
        }
        // A proven effect leaves the operation never executable again in that life.
        if let (Some(life), Some(row)) = (model.proven.get(&op), row) {
            if row.life == *life {
                assert!(
                    matches!(row.state, State::Confirmed | State::Unknown),
                    "an effect was proven, yet the operation is {}: {row:?}",
                    row.state
                );
            }
        }
    }
    // Every exit from UNKNOWN is a door, recorded with its actor.
    for (_, event) in &store.events {
        if event.from == Some(State::Unknown) && event.to != Some(State::Unknown) {
            let by_its_door = match event.kind {
                EventKind::Confirmed | EventKind::ReportedAbsent => {
                    matches!(event.actor, Actor::Executor(_))
                }
                EventKind::Reconciled => matches!(event.actor, Actor::Reconciler(_)),
                EventKind::Resolved => matches!(event.actor, Actor::Operator(_)),
                other => panic!("UNKNOWN left by {other:?}: {event:?}"),
            };
            assert!(by_its_door, "{event:?}");
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn no_sequence_of_calls_breaks_an_invariant(actions in prop::collection::vec(action(), 1..60)) {
        run(actions);
    }
}
