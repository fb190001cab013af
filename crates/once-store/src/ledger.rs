//! The domain state machine run over a [`Backend`]: read, decide, write, commit.
//!
//! Every write (a Begin's claim, a report, a heartbeat, a resolution, a lease's expiry, a verdict)
//! is one closure over a transaction (`Ledger::write`): it locks, decides with the core, applies
//! the plan, and returns its answer with what it wrote. A Begin or a report is first decided from a
//! lock-free read; what needs no write is answered from it (those states change only under a lock
//! or a version check, so the read is a committed truth), and on PostgreSQL a decided write may be
//! one checked statement (`postgres::unlocked`). After a commit that wrote events the ledger
//! signals `events_committed`, which the replica's watch feed waits on. [`Ledger::explain`] is an
//! operation with its history and its classified calls (of its duplicates, the latest
//! `EXPLAINED_DUPLICATES`, so a call replayed without end still answers in one small message).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use once_core::continuity::{self, Position};
use once_core::forensics;
use once_core::machine::{self, FreshIdGuard, Plan};
use once_core::reconcile;
use once_core::*;
use tokio::sync::Notify;
use tracing::Instrument as _;

use crate::writer::{over_tx, TxFuture, Writer};
use crate::Decision;
use crate::{Backend, Probe, StoreError, Unlocked, Written};

/// The most duplicates of one operation [`Ledger::explain`] reads: the latest, so an operation
/// replayed without end still answers GetOperation in one small message.
pub const EXPLAINED_DUPLICATES: u32 = 100;

/// How often a first claim is retried after losing the race to create the row.
const CLAIM_RACE_RETRIES: usize = 3;

/// The ledger over one backend. Cheap to clone; every clone shares the pool.
#[derive(Debug, Clone)]
pub struct Ledger<B: Backend> {
    backend: B,
    /// Where writes go when the backend commits them in batches.
    writer: Option<Writer<B>>,
    /// Signalled after every commit that wrote events, for the replica's watch feed.
    committed: Arc<Notify>,
    observer: Option<Arc<dyn Observer>>,
}

/// What one write transaction wrote: a plan over the operation as it was before.
struct Wrote {
    before: Option<Operation>,
    plan: Plan,
    written: Written,
    now: Millis,
}

/// Writes `plan` (if it writes anything) over `before` in `tx`; what it wrote.
async fn apply<B: Backend>(
    backend: &B,
    tx: &mut B::Tx,
    (tenant, id): (&str, &OperationId),
    before: Option<Operation>,
    plan: Plan,
    now: Millis,
) -> Result<Option<Wrote>, StoreError> {
    if plan.is_empty() {
        return Ok(None);
    }
    let written = backend.apply(tx, tenant, id, &plan, now).await?;
    Ok(Some(Wrote {
        before,
        plan,
        written,
        now,
    }))
}

/// What a replica learns from its ledger's writes, for its metrics. Called after the fact,
/// on the writing task: it must be quick and must not block.
pub trait Observer: Send + Sync + std::fmt::Debug {
    /// A write transaction started `waited` after it was asked for: the wait for a pooled
    /// connection, then BEGIN (where writes are batched, the wait in the writer's queue too; for
    /// a call that took no connection, the wait for its read, made with others').
    fn transaction_started(&self, waited: Duration);
    /// `plan` was committed over `before` (none for an operation it created), at `now`;
    /// `written` says which of its events were (an anomaly already recorded is not again).
    fn committed(&self, before: Option<&Operation>, plan: &Plan, written: &Written, now: Millis);
}

impl<B: Backend> Ledger<B> {
    /// The ledger over `backend`; with the backend's writer task when it commits in batches
    /// (which needs a Tokio runtime).
    pub fn new(backend: B) -> Self {
        let writer = backend
            .group_commit()
            .then(|| Writer::spawn(backend.clone()));
        Self {
            backend,
            writer,
            committed: Arc::default(),
            observer: None,
        }
    }

    /// This ledger, telling `observer` about its writes.
    pub fn observed(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The span of one store call that may write, a child of the RPC or sweep it serves.
    fn span(&self, operation: &'static str) -> tracing::Span {
        // The database semantic conventions' names for the two systems.
        let system = match self.backend.kind() {
            "postgres" => "postgresql",
            other => other,
        };
        tracing::info_span!(
            "db.transaction",
            otel.name = format!("{operation} {system}"),
            otel.kind = "client",
            db.system.name = system,
            db.operation.name = operation,
        )
    }

    /// Runs `work` in a write transaction and commits what it wrote (the backend's writer
    /// batches it with other callers' writes; otherwise it has a transaction of its own, rolled
    /// back when it wrote nothing). The answer comes only after the commit.
    async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'t> FnOnce(&'t mut B::Tx) -> TxFuture<'t, (T, Option<Wrote>)> + Send + 'static,
    {
        let asked = tokio::time::Instant::now();
        let observer = self.observer.clone();
        let timed = over_tx(move |tx: &mut B::Tx| {
            if let Some(observer) = &observer {
                observer.transaction_started(asked.elapsed());
            }
            work(tx)
        });
        let (value, wrote) = match &self.writer {
            Some(writer) => writer.write(timed).await?,
            None => {
                let mut tx = self.backend.begin_write().await?;
                let (value, wrote) = timed(&mut tx).await?;
                if wrote.is_some() {
                    self.backend.commit(tx).await?;
                }
                (value, wrote)
            }
        };
        if let Some(wrote) = wrote {
            self.wrote(&wrote);
        }
        Ok(value)
    }

    /// Tells the watch feed and the observer what a commit wrote.
    fn wrote(&self, wrote: &Wrote) {
        if !wrote.plan.events.is_empty() {
            self.committed.notify_one();
        }
        if let Some(observer) = &self.observer {
            observer.committed(
                wrote.before.as_ref(),
                &wrote.plan,
                &wrote.written,
                wrote.now,
            );
        }
    }

    /// Writes `plan`, decided at `now` from `before` as a lock-free read on `conn` found it
    /// (`conn` came from the pool after `waited`), in one statement where the backend can check
    /// that `before` is still what is stored (and, for a claim, that nothing blocks `guard`'s
    /// intent). Whether it did: if not, the call must be decided again in a write transaction
    /// (the backend cannot; the operation changed; the decision is too old; or the claim is
    /// blocked, which the lock decides again, as the read may not be true any longer either).
    async fn write_unlocked(
        &self,
        (conn, waited): (B::Conn, Duration),
        before: Option<Operation>,
        guard: Option<&BeginCommand>,
        plan: Plan,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let waited = waited + self.backend.read_waited(&conn);
        let unlocked = self
            .backend
            .apply_unlocked(
                conn,
                Decision {
                    guard,
                    ..Decision::new(before.as_ref(), &plan, now)
                },
            )
            .await?;
        match unlocked {
            Some(Unlocked::Applied { written }) => {
                if let Some(observer) = &self.observer {
                    observer.transaction_started(waited);
                }
                self.wrote(&Wrote {
                    before,
                    plan,
                    written,
                    now,
                });
                Ok(true)
            }
            Some(Unlocked::Blocked(_) | Unlocked::Changed) | None => Ok(false),
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Completes once events were committed through this ledger (or any clone) since the last
    /// time it completed. One waiter: the replica's watch feed.
    pub async fn events_committed(&self) {
        self.committed.notified().await
    }

    /// Decides a Begin and commits whatever the decision needs before returning it, with the
    /// moment it was decided, by the store's clock.
    pub async fn begin(&self, cmd: &BeginCommand) -> Result<(BeginDecision, Millis), StoreError> {
        self.on_a_live_connection(|| self.begin_in_store(cmd))
            .instrument(self.span("begin"))
            .await
    }

    /// Runs `call`, and once more when it met a connection the server had closed
    /// ([`StoreError::is_lost_connection`]): after a restart or a failover, the pool still holds
    /// connections that died idle, and a call should not fail for having drawn one. Every call
    /// made again this way is one the caller may make again as it was sent (the same attempt id,
    /// fencing token or resolution id get the first answer); the second run has every connection
    /// that was idle through the loss checked before use. The workers' writes (a verdict, a
    /// lease's end) are not made again here: their next round does, from what is stored.
    async fn on_a_live_connection<'a, T, F>(
        &'a self,
        call: impl Fn() -> F + 'a,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>> + 'a,
    {
        match call().await {
            Err(error) if error.is_lost_connection() => {
                tracing::debug!(%error, "a pooled connection had been closed; calling again on another");
                self.backend.connection_lost();
                call().await
            }
            answered => answered,
        }
    }

    async fn begin_in_store(
        &self,
        cmd: &BeginCommand,
    ) -> Result<(BeginDecision, Millis), StoreError> {
        // Most Begins that write nothing (replays, IN_PROGRESS, UNKNOWN, a retried grant) are
        // answered from a plain read: those states only change under a lock, and each answer is
        // true of the committed state it was read from.
        let (mut conn, waited) = self.backend.connection().await?;
        let (current, now, token) = self
            .backend
            .read_claimable(&mut conn, &cmd.tenant, &cmd.operation_id)
            .await?;
        // The rest are written from the same read where the backend can check, as it writes,
        // that the read is still true: a first claim (with the token the read took) and any
        // decided write. Otherwise, or when the operation changed, it is decided again below
        // under the row's lock.
        let unlocked = match machine::begin(current.as_ref(), cmd, now) {
            machine::BeginStep::Decided(decision, plan) if plan.is_empty() => {
                return Ok((decision, now))
            }
            machine::BeginStep::Decided(decision, plan) => Some((decision, plan, None)),
            machine::BeginStep::Claim => match (&current, token) {
                (None, Some(token)) => {
                    let (decision, plan) =
                        machine::claim(None, cmd, FreshIdGuard::Clear { token }, now);
                    Some((decision, plan, (!cmd.new_intent).then_some(cmd)))
                }
                _ => None,
            },
        };
        if let Some((decision, plan, guard)) = unlocked {
            // The connection goes back to the pool with the write, before the write transaction
            // below takes one: a call holding two at once could wait for the pool forever.
            if self
                .write_unlocked((conn, waited), current, guard, plan, now)
                .await?
            {
                return Ok((decision, now));
            }
        } else {
            drop(conn);
        }
        for _ in 0..CLAIM_RACE_RETRIES {
            let backend = self.backend.clone();
            let cmd = cmd.clone();
            let decided = self
                .write(move |tx| {
                    Box::pin(async move {
                        let key = (cmd.tenant.as_str(), &cmd.operation_id);
                        let (current, now) = backend.lock(tx, key.0, key.1).await?;
                        let (decision, plan) = match machine::begin(current.as_ref(), &cmd, now) {
                            machine::BeginStep::Decided(decision, plan) => (decision, plan),
                            machine::BeginStep::Claim => {
                                let guard = backend.guard(tx, &cmd).await?;
                                machine::claim(current.as_ref(), &cmd, guard, now)
                            }
                        };
                        let wrote = apply(&backend, tx, key, current, plan, now).await?;
                        Ok(((decision, now), wrote))
                    })
                })
                .await;
            match decided {
                // Another transaction created the row between our read and our insert; the row
                // now exists and the next round locks it.
                Err(StoreError::Duplicate) => continue,
                other => return other,
            }
        }
        Err(StoreError::Duplicate)
    }

    /// Applies an executor's report. A refused report may still record an anomaly.
    pub async fn report(
        &self,
        tenant: &str,
        id: &OperationId,
        cmd: &ReportCommand,
    ) -> Result<State, StoreError> {
        self.report_noting(tenant, id, cmd).await.0
    }

    /// [`Ledger::report`], and whether the report wrote anything: a refused one may still
    /// record what it proves (a superseded attempt's confirm).
    pub async fn report_noting(
        &self,
        tenant: &str,
        id: &OperationId,
        cmd: &ReportCommand,
    ) -> (Result<State, StoreError>, bool) {
        match self
            .on_a_live_connection(|| self.report_in_store(tenant, id, cmd))
            .instrument(self.span("report"))
            .await
        {
            Ok((answer, wrote)) => (answer, wrote),
            Err(error) => (Err(error), false),
        }
    }

    async fn report_in_store(
        &self,
        tenant: &str,
        id: &OperationId,
        cmd: &ReportCommand,
    ) -> Result<(Result<State, StoreError>, bool), StoreError> {
        let fencing_token = cmd.fencing_token;
        let answered = |answer: Result<State, machine::Rejection>,
                        life: FencingToken,
                        wrote: bool| {
            if answer.is_err() && fencing_token < life && !wrote {
                tracing::warn!(operation_id = %id, %fencing_token, %life, "refused a report with a token below this life's; it changed nothing");
            }
            Ok((answer.map_err(StoreError::from), wrote))
        };
        // Where the backend can check a decision as it writes it: decided from a lock-free
        // read, and written in one statement if the operation has not changed since.
        // The connection goes back to the pool as this block ends, before the write
        // transaction below takes one.
        if self.backend.writes_unlocked() {
            let (mut conn, waited) = self.backend.connection().await?;
            let (current, now) = self.backend.read_held(&mut conn, tenant, id).await?;
            let op = current.ok_or(StoreError::NotFound)?;
            if !machine::needs_attempt_record(&op, fencing_token) {
                let (answer, plan) = machine::report(&op, cmd, None, now);
                let life = op.life;
                if plan.is_empty() {
                    return answered(answer, life, false);
                }
                if self
                    .write_unlocked((conn, waited), Some(op), None, plan, now)
                    .await?
                {
                    return answered(answer, life, true);
                }
            }
        }
        let backend = self.backend.clone();
        let (tenant_owned, id_owned, cmd) = (tenant.to_owned(), id.clone(), cmd.clone());
        let (answer, life, wrote) = self
            .write(move |tx| {
                Box::pin(async move {
                    let key = (tenant_owned.as_str(), &id_owned);
                    let (current, now) = backend.lock(tx, key.0, key.1).await?;
                    let op = current.ok_or(StoreError::NotFound)?;
                    // A superseded attempt of this life is known by its record in the attempt
                    // log.
                    let earlier = if machine::needs_attempt_record(&op, cmd.fencing_token) {
                        backend.attempt(tx, key.0, key.1, cmd.fencing_token).await?
                    } else {
                        None
                    };
                    let (answer, plan) = machine::report(&op, &cmd, earlier.as_ref(), now);
                    let life = op.life;
                    let wrote = apply(&backend, tx, key, Some(op), plan, now).await?;
                    Ok(((answer, life, wrote.is_some()), wrote))
                })
            })
            .await?;
        answered(answer, life, wrote)
    }

    /// Extends a live lease; returns the new deadline.
    pub async fn heartbeat(
        &self,
        tenant: &str,
        id: &OperationId,
        cmd: HeartbeatCommand,
    ) -> Result<Millis, StoreError> {
        let decide = move |op: &Operation, now| match machine::heartbeat(op, &cmd, now) {
            Ok((deadline, plan)) => (Ok(deadline), plan),
            Err(rejection) => (Err(rejection.into()), Plan::default()),
        };
        self.on_a_live_connection(|| self.locked("heartbeat", tenant, id, decide.clone()))
            .await
    }

    /// Applies an operator's resolution of an UNKNOWN operation. A retry with the same
    /// resolution id gets the first answer, even after the operation moved on or retention
    /// deleted it (for as long as its events are kept).
    pub async fn resolve(
        &self,
        tenant: &str,
        id: &OperationId,
        cmd: &ResolveCommand,
    ) -> Result<State, StoreError> {
        self.on_a_live_connection(|| self.resolve_in_store(tenant, id, cmd))
            .instrument(self.span("resolve"))
            .await
    }

    async fn resolve_in_store(
        &self,
        tenant: &str,
        id: &OperationId,
        cmd: &ResolveCommand,
    ) -> Result<State, StoreError> {
        let backend = self.backend.clone();
        let (tenant, id, cmd) = (tenant.to_owned(), id.clone(), cmd.clone());
        self.write(move |tx| {
            Box::pin(async move {
                let key = (tenant.as_str(), &id);
                let (current, now) = backend.lock(tx, key.0, key.1).await?;
                let prior = backend
                    .find_resolution(tx, key.0, key.1, &cmd.resolution_id)
                    .await?;
                let op = match (current, prior) {
                    (Some(op), _) => op,
                    (None, Some(prior)) => {
                        return Ok((machine::retried_resolution(&cmd, prior)?, None))
                    }
                    (None, None) => return Err(StoreError::NotFound),
                };
                let (state, plan) = machine::resolve(&op, &cmd, prior, now)?;
                let wrote = apply(&backend, tx, key, Some(op), plan, now).await?;
                Ok((state, wrote))
            })
        })
        .await
    }

    /// Turns one IN_FLIGHT operation whose lease has ended into UNKNOWN. Returns whether it did.
    pub async fn expire_lease(&self, tenant: &str, id: &OperationId) -> Result<bool, StoreError> {
        let expired = self
            .locked(
                "expire_lease",
                tenant,
                id,
                |op, now| match machine::expire_lease(op, now) {
                    Some(plan) => (Ok(true), plan),
                    None => (Ok(false), Plan::default()),
                },
            )
            .await;
        match expired {
            Err(StoreError::NotFound) => Ok(false),
            other => other,
        }
    }

    /// Brings back an operation a client saw granted and the ledger lost, restored to an
    /// earlier state ([`continuity::recover`]): UNKNOWN, with the attempt the client saw, and
    /// every token issued from then on above that attempt's. Whether the operation is UNKNOWN
    /// again (not when the ledger knows that attempt or a later one, or the life settled and
    /// retention deleted it; for a CONFIRMED life, the possible second effect is recorded).
    pub async fn recover(
        &self,
        position: &Position,
        reporter: (Actor, Holder),
    ) -> Result<bool, StoreError> {
        // Read before the write: no event of a life whose row is gone can be written meanwhile.
        let life_recorded = self
            .backend
            .life_recorded(&position.tenant, &position.operation_id, position.life)
            .await?;
        for _ in 0..CLAIM_RACE_RETRIES {
            let backend = self.backend.clone();
            let (position, reporter) = (position.clone(), reporter.clone());
            let recovered = self
                .write(move |tx| {
                    Box::pin(async move {
                        let key = (position.tenant.as_str(), &position.operation_id);
                        let (current, now) = backend.lock(tx, key.0, key.1).await?;
                        let by = (&reporter.0, &reporter.1);
                        let shown = (&position, life_recorded);
                        let Some(plan) = continuity::recover(current.as_ref(), shown, by, now)
                        else {
                            return Ok((false, None));
                        };
                        backend.raise_tokens(tx, position.token).await?;
                        let unknown_again = plan.operation.is_some();
                        let wrote = apply(&backend, tx, key, current, plan, now).await?;
                        Ok((unknown_again, wrote))
                    })
                })
                .instrument(self.span("recover"))
                .await;
            match recovered {
                // A Begin created the row meanwhile: the next round judges it.
                Err(StoreError::Duplicate) => continue,
                other => return other,
            }
        }
        Err(StoreError::Duplicate)
    }

    /// Locks an existing operation, lets `decide` produce an answer and a plan, and commits the
    /// plan (even when the answer is a refusal: a refusal may record an anomaly).
    async fn locked<T: Send + 'static>(
        &self,
        operation: &'static str,
        tenant: &str,
        id: &OperationId,
        decide: impl FnOnce(&Operation, Millis) -> (Result<T, StoreError>, Plan) + Send + 'static,
    ) -> Result<T, StoreError> {
        let backend = self.backend.clone();
        let (tenant, id) = (tenant.to_owned(), id.clone());
        self.write(move |tx| {
            Box::pin(async move {
                let key = (tenant.as_str(), &id);
                let (current, now) = backend.lock(tx, key.0, key.1).await?;
                let Some(op) = current else {
                    return Err(StoreError::NotFound);
                };
                let (answer, plan) = decide(&op, now);
                let wrote = apply(&backend, tx, key, Some(op), plan, now).await?;
                Ok((answer, wrote))
            })
        })
        .instrument(self.span(operation))
        .await?
    }

    /// One operation as stored, and the store's clock; no lock is taken.
    pub async fn read(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Option<Operation>, Millis), StoreError> {
        self.on_a_live_connection(|| self.backend.read(tenant, id))
            .await
    }

    /// One operation with its attempt log and event history.
    pub async fn get(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Operation, Vec<Attempt>, Vec<Event>), StoreError> {
        self.on_a_live_connection(|| async {
            let (op, _) = self.backend.read(tenant, id).await?;
            let op = op.ok_or(StoreError::NotFound)?;
            let (attempts, events) = self.backend.history(tenant, id, op.life).await?;
            Ok((op, attempts, events))
        })
        .await
    }

    /// One page of the operations of `scope` and, when there may be more, where the next page
    /// starts.
    pub async fn list(
        &self,
        scope: &Scope,
        query: &ListQuery,
    ) -> Result<(Vec<Listed>, Option<PageEnd>), StoreError> {
        let mut probe = query.clone();
        probe.page_size = query.page_size.saturating_add(1);
        let mut operations = self
            .on_a_live_connection(|| self.backend.list(scope, &probe))
            .await?;
        let next = if operations.len() > query.page_size as usize {
            operations.truncate(query.page_size as usize);
            operations.last().map(|listed| {
                let op = &listed.operation;
                PageEnd {
                    created_at: op.created_at,
                    tenant: match scope {
                        Scope::Tenant(_) => String::new(),
                        Scope::AllTenants => op.tenant.clone(),
                    },
                    operation_id: op.operation_id.to_string(),
                }
            })
        } else {
            None
        };
        Ok((operations, next))
    }

    /// Claims up to `limit` operations due for a lookup by one of `served` (the tenants and
    /// reconcilers this replica has: it never holds one it cannot look up), each for `claim_ms`, and returns
    /// them as claimed, with their claims. See [`Backend::claim_lookup`].
    pub async fn claim_lookups(
        &self,
        limit: u32,
        claim_ms: i64,
        served: &[(&str, &str)],
    ) -> Result<Vec<(Operation, reconcile::Lookup)>, StoreError> {
        let mut claimed = Vec::new();
        for (tenant, id) in self.backend.due_lookups(limit, served).await? {
            // Another replica may claim it first: then this one finds it held and skips it.
            if let Some(found) = self
                .backend
                .claim_lookup(&tenant, &id, claim_ms, false)
                .await?
            {
                claimed.push(found);
            }
        }
        Ok(claimed)
    }

    /// Claims one operation for a lookup: only when it is due, unless `before_due`.
    pub async fn claim_lookup(
        &self,
        tenant: &str,
        id: &OperationId,
        claim_ms: i64,
        before_due: bool,
    ) -> Result<Option<(Operation, reconcile::Lookup)>, StoreError> {
        self.backend
            .claim_lookup(tenant, id, claim_ms, before_due)
            .await
    }

    /// Applies the verdict of a lookup claimed as `lookup`, in one transaction with its events.
    /// Returns what it did, and whether this lookup escalated the operation.
    pub async fn apply_verdict(
        &self,
        tenant: &str,
        id: &OperationId,
        lookup: &reconcile::Lookup,
        verdict: &reconcile::Verdict,
        policy: &reconcile::LookupPolicy,
        jitter: f64,
    ) -> Result<(reconcile::Applied, bool), StoreError> {
        let (lookup, verdict, policy) = (lookup.clone(), verdict.clone(), policy.clone());
        self.locked("apply_verdict", tenant, id, move |op, now| {
            let (applied, plan) =
                reconcile::apply_verdict(op, &lookup, &verdict, &policy, jitter, now);
            let escalated = plan.events.iter().any(|e| e.kind == EventKind::Escalated);
            (Ok((applied, escalated)), plan)
        })
        .await
    }

    /// Moves up to `limit` IN_FLIGHT operations past their lease to UNKNOWN, each in its own
    /// transaction with its event. Returns how many moved.
    pub async fn sweep_leases(&self, limit: u32) -> Result<usize, StoreError> {
        let mut moved = 0;
        for (tenant, id) in self.backend.expired_leases(limit).await? {
            if self.expire_lease(&tenant, &id).await? {
                moved += 1;
            }
        }
        Ok(moved)
    }

    /// Deletes settled operations past retention, in batches of `batch`, until none is left.
    /// One that ended ABSENT is kept, expired, until `absent_kept_ms` after it settled: the
    /// tombstone that hands its provider key to the next life.
    pub async fn sweep_retention(
        &self,
        batch: u32,
        absent_kept_ms: i64,
    ) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = self.backend.delete_expired(batch, absent_kept_ms).await?;
            total += deleted;
            if deleted < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// Whether the database answers and commits a write; once its storage refused a write,
    /// whether it commits a large one ([`Probe::Room`]), until one does.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let refused = self.writer.as_ref().and_then(Writer::refused);
        let probe = if refused.is_some() {
            Probe::Room
        } else {
            Probe::Write
        };
        self.on_a_live_connection(|| self.backend.ping(probe))
            .await?;
        if let (Some(writer), Some(seen)) = (&self.writer, refused) {
            writer.room_again(seen);
        }
        Ok(())
    }

    /// Deletes events older than `age_ms`, in batches of `batch`, and the duplicates recorded
    /// as long ago: they are kept as long as the history they explain.
    pub async fn sweep_events(&self, age_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = self.backend.delete_events_older_than(age_ms, batch).await?;
            total += deleted;
            if deleted < u64::from(batch) {
                break;
            }
        }
        while self
            .backend
            .delete_duplicates_older_than(age_ms, batch)
            .await?
            == u64::from(batch)
        {}
        Ok(total)
    }

    /// Every call of the current life of an operation (of its duplicates, the latest
    /// [`EXPLAINED_DUPLICATES`]), classified (see [`once_core::forensics`]), with the operation,
    /// its attempts and its history.
    pub async fn explain(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> Result<(Operation, Vec<Attempt>, Vec<Event>, Vec<forensics::Call>), StoreError> {
        let (op, attempts, events) = self.get(tenant, id).await?;
        let duplicates = self
            .backend
            .duplicates(tenant, id, op.created_at, EXPLAINED_DUPLICATES)
            .await?;
        let calls = forensics::classify(&attempts, &duplicates);
        Ok((op, attempts, events, calls))
    }

    /// Where the repeated calls of `tenant`'s operations (of one tool, when given) over the
    /// last `window_ms` came from: every operation with a duplicate recorded since then, at
    /// most `limit` of them, each classified over its current life. Returns how many
    /// operations were looked at, and the summary of their calls in the window.
    pub async fn forensics(
        &self,
        tenant: &str,
        tool: Option<&str>,
        window_ms: i64,
        limit: u32,
    ) -> Result<(usize, forensics::Summary), StoreError> {
        let since = self.backend.clock().await? - window_ms;
        let recent = self
            .backend
            .recent_duplicates(tenant, tool, since, limit.saturating_mul(16))
            .await?;
        let mut ids: Vec<&OperationId> = Vec::new();
        for d in &recent {
            if !ids.contains(&&d.operation_id) && ids.len() < limit as usize {
                ids.push(&d.operation_id);
            }
        }
        let mut summary = forensics::Summary::default();
        for id in &ids {
            match self.explain(tenant, id).await {
                Ok((_, _, _, calls)) => {
                    let since_then: Vec<_> = calls.into_iter().filter(|c| c.at >= since).collect();
                    summary.add(&since_then);
                }
                // Deleted by retention since: its duplicates explain nothing now.
                Err(StoreError::NotFound) => {}
                Err(error) => return Err(error),
            }
        }
        Ok((ids.len(), summary))
    }
}
