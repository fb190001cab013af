//! The storage trait every backend implements.

use std::future::Future;
use std::time::Duration;

use once_core::access::{Credential, NewCredential, SecretHash, Tenant};
use once_core::chain::{Link, Stored};
use once_core::continuity::{Accepted, Behind, Standing};
use once_core::forensics::Duplicate;
use once_core::machine::FreshIdGuard;
use once_core::reconcile::Lookup;
use once_core::stats::{Gauges, Stats};
use once_core::{
    Actor, Attempt, BeginCommand, Blocking, Event, FencingToken, ListQuery, Listed, Millis,
    Operation, OperationEvent, OperationId, Plan, PriorResolution, Scope, WatchFilter,
};

use crate::watch::Frontier;
use crate::{Announcements, StoreError};

/// What [`sealed::Transactions::apply`] wrote of a plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    /// For each of the plan's events, in order, whether it was written.
    pub events: Vec<bool>,
}

/// A plan decided from a lock-free read, as [`sealed::Transactions::apply_unlocked`] writes it.
#[derive(Debug, Clone, Copy)]
pub struct Decision<'a> {
    /// The life and version of the operation the read found; `None` when none was stored.
    pub from: Option<(FencingToken, i64)>,
    /// For a claim, its Begin: written only if no other operation blocks it (see
    /// [`sealed::Transactions::guard`]).
    pub guard: Option<&'a BeginCommand>,
    pub plan: &'a Plan,
    /// When it was decided: written only while that is recent.
    pub now: Millis,
}

impl<'a> Decision<'a> {
    /// `plan`, decided at `now` from what the read found: `before`.
    pub fn new(before: Option<&Operation>, plan: &'a Plan, now: Millis) -> Self {
        Decision {
            from: before.map(|op| (op.life, op.version)),
            guard: None,
            plan,
            now,
        }
    }

    /// The decision, a claim for `begin`.
    pub fn guarded(self, begin: &'a BeginCommand) -> Self {
        Decision {
            guard: Some(begin),
            ..self
        }
    }
}

/// What [`sealed::Transactions::apply_unlocked`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unlocked {
    /// The plan is written and committed.
    Applied { written: Written },
    /// The operation is no longer what the plan was decided from: nothing was written.
    Changed,
    /// Another open operation of the Begin's intent blocks its claim: nothing was written.
    Blocked(Blocking),
}

/// The connection pool at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUse {
    pub open: u32,
    pub idle: u32,
    pub max: u32,
}

/// What [`Credentials::credentials_since`] read.
#[derive(Debug, Clone, Default)]
pub struct CredentialChanges {
    /// Each changed credential as it is now, with the hash of its secret and its tenant.
    pub changed: Vec<(SecretHash, Credential, Tenant)>,
    /// The watermark to read from next time: every change through it is in `changed` or was
    /// read before.
    pub through: i64,
}

/// The most events of earlier lives [`Backend::earlier_lives`] gives.
pub const EARLIER_EVENTS: i64 = 200;

/// A database that can hold the ledger: the API's reads here, the rest by concern in its
/// supertraits ([`Credentials`], [`Events`], [`Forensics`], [`Sweeps`]). Only the
/// [`crate::Ledger`] writes an operation, through the transaction primitives of its sealed
/// supertrait, which nothing outside this crate can name or call (see [`sealed::Transactions`]).
pub trait Backend:
    sealed::Transactions
    + Chain
    + Continuity
    + Credentials
    + Events
    + Forensics
    + Sweeps
    + Clone
    + Send
    + Sync
    + 'static
{
    /// A short name for logs: `sqlite` or `postgres`.
    fn kind(&self) -> &'static str;

    /// Reads the operation and the store's clock without taking any lock, on a connection of
    /// its own ([`sealed::Transactions::read_held`]).
    fn read(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> impl Future<Output = Result<(Option<Operation>, Millis), StoreError>> + Send {
        async move {
            let (mut conn, _) = self.connection().await?;
            self.read_held(&mut conn, tenant, id).await
        }
    }

    /// The attempt log and the event history of one life of an operation, oldest first.
    fn history(
        &self,
        tenant: &str,
        id: &OperationId,
        life: FencingToken,
    ) -> impl Future<Output = Result<(Vec<Attempt>, Vec<Event>), StoreError>> + Send;

    /// The events of an operation's lives before `life` (each was settled, deleted by
    /// retention, and its id begun again), oldest first, at most [`EARLIER_EVENTS`] of the latest; those
    /// [`Backend::history`] gives with `life` are not among them.
    fn earlier_lives(
        &self,
        tenant: &str,
        id: &OperationId,
        life: FencingToken,
    ) -> impl Future<Output = Result<Vec<Event>, StoreError>> + Send;

    /// One page of the operations of `scope`, oldest first, without their results, each with
    /// the latest event of its current life.
    fn list(
        &self,
        scope: &Scope,
        query: &ListQuery,
    ) -> impl Future<Output = Result<Vec<Listed>, StoreError>> + Send;

    /// The figures of `scope`: its operations by state and tool and the ages of its UNKNOWN
    /// ones now, and what left UNKNOWN and the anomalies recorded over the last `window_ms`, by
    /// the store's clock.
    fn stats(
        &self,
        scope: &Scope,
        window_ms: i64,
    ) -> impl Future<Output = Result<Stats, StoreError>> + Send;

    /// Every tenant's open operations, the ages of the UNKNOWN ones and the leases past their
    /// end, now, in one statement.
    fn gauges(&self) -> impl Future<Output = Result<Gauges, StoreError>> + Send;

    /// The connection pool now: connections open, idle, and the most it opens.
    fn pool_use(&self) -> PoolUse;

    /// The store's clock.
    fn clock(&self) -> impl Future<Output = Result<Millis, StoreError>> + Send;

    /// Checks that the database answers and accepts writes, as hard as `probe` says.
    fn ping(&self, probe: Probe) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A call found a pooled connection the server had closed
    /// ([`StoreError::is_lost_connection`]): every connection idle in the pool since before now
    /// is checked before it is handed out again.
    fn connection_lost(&self);

    /// Closes the pool: waits for checked-out connections to return, then closes them.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// What the background work reads and deletes: leases past their end, lookups due, and what
/// retention allows.
pub trait Sweeps {
    /// Up to `limit` IN_FLIGHT operations whose lease has ended, by the store's clock.
    fn expired_leases(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<(String, OperationId)>, StoreError>> + Send;

    /// Up to `limit` UNKNOWN operations of a (tenant, provider) in `served`, due for a reconciler
    /// lookup that no lookup holds, most overdue first. Nothing is claimed: see
    /// [`Sweeps::claim_lookup`].
    fn due_lookups(
        &self,
        limit: u32,
        served: &[(&str, &str)],
    ) -> impl Future<Output = Result<Vec<(String, OperationId)>, StoreError>> + Send;

    /// Claims one UNKNOWN operation for a lookup lasting at most `claim_ms`: no other claim
    /// succeeds until this one lapses or a verdict is applied. Only a due operation is claimed,
    /// unless `before_due` (an operator asking now). Returns the operation as claimed and the
    /// lookup's claim (its version, and when it was issued by the store's clock); `None` when
    /// the operation is not UNKNOWN, is held for an operator, is held by another lookup, or is
    /// not due.
    fn claim_lookup(
        &self,
        tenant: &str,
        id: &OperationId,
        claim_ms: i64,
        before_due: bool,
    ) -> impl Future<Output = Result<Option<(Operation, Lookup)>, StoreError>> + Send;

    /// Deletes up to `limit` settled operations past retention, an ABSENT one only once
    /// `absent_kept_ms` have passed since it settled; returns how many.
    fn delete_expired(
        &self,
        limit: u32,
        absent_kept_ms: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes up to `limit` events older than `age_ms`; returns how many.
    fn delete_events_older_than(
        &self,
        age_ms: i64,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes up to `limit` duplicates older than `age_ms`; returns how many.
    fn delete_duplicates_older_than(
        &self,
        age_ms: i64,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Tenants and credentials, and the count admission caps.
pub trait Credentials {
    /// Creates a tenant, or changes the limits of the one with its name; returns it as stored.
    fn put_tenant(
        &self,
        tenant: &Tenant,
    ) -> impl Future<Output = Result<Tenant, StoreError>> + Send;

    /// Every tenant, by name.
    fn tenants(&self) -> impl Future<Output = Result<Vec<Tenant>, StoreError>> + Send;

    /// Stores a credential. [`StoreError::NotFound`] when its tenant does not exist;
    /// [`StoreError::Duplicate`] when its key id or secret is already stored, or when it was
    /// made `while_open` and a credential exists (or another such one won the race to be
    /// first): the ledger is closed.
    fn create_credential(
        &self,
        credential: &NewCredential,
    ) -> impl Future<Output = Result<Credential, StoreError>> + Send;

    /// The credentials of `tenant` (of every tenant when `None`), oldest first, revoked ones
    /// included. Never a secret: the store holds none.
    fn credentials(
        &self,
        tenant: Option<&str>,
    ) -> impl Future<Output = Result<Vec<Credential>, StoreError>> + Send;

    /// Revokes a credential (a revoked one stays revoked as it was); `None` when there is no
    /// credential with that id.
    fn revoke_credential(
        &self,
        key_id: &str,
    ) -> impl Future<Output = Result<Option<Credential>, StoreError>> + Send;

    /// The credentials, revoked ones included, with the hash of their secret and their
    /// tenant, that changed after `watermark` (a [`CredentialChanges::through`] read before;
    /// `-1` for every one): what admission holds in memory, refreshed without reading again
    /// what it holds already. A tenant's change brings every credential of the tenant.
    fn credentials_since(
        &self,
        watermark: i64,
    ) -> impl Future<Output = Result<CredentialChanges, StoreError>> + Send;

    /// How many operations of `tenant` are IN_FLIGHT.
    fn in_flight(&self, tenant: &str) -> impl Future<Output = Result<i64, StoreError>> + Send;
}

/// What a watcher reads, and how replicas tell one another they committed events.
pub trait Events {
    /// The highest event sequence retention has deleted (0 when none).
    fn deleted_through(&self) -> impl Future<Output = Result<i64, StoreError>> + Send;

    /// Reads the newest event sequence and the transactions that may still commit older
    /// events: see [`crate::watch`].
    fn event_frontier(&self) -> impl Future<Output = Result<Frontier, StoreError>> + Send;

    /// The events of `scope` after the first sequence of `range` and up to the second that
    /// `filter` wants, oldest first, at most `limit`.
    fn watch_events(
        &self,
        scope: &Scope,
        range: (i64, i64),
        filter: &WatchFilter,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<OperationEvent>, StoreError>> + Send;

    /// Tells other replicas that this one committed events (PostgreSQL's NOTIFY); nothing where
    /// they cannot be told.
    fn announce_events(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Listens for other replicas' announcements; `None` where there are none to hear (then
    /// the store is read again every [`crate::Announcements::POLL`]).
    fn listen_for_events(
        &self,
    ) -> impl Future<Output = Result<Option<Announcements>, StoreError>> + Send;
}

/// One operation's stored state beside the state its latest event recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub operation_id: String,
    pub stored: String,
    pub sequence: i64,
    pub recorded: Option<String>,
}

pub use once_core::chain::Verification;

/// What the history's chain reads and writes (see [`once_core::chain`]).
pub trait Chain {
    /// How far the history is linked: every event up to this sequence is in a link.
    fn chained_through(&self) -> impl Future<Output = Result<i64, StoreError>> + Send;

    /// The events after the first sequence of `range` up to the second, oldest first, at most
    /// `limit`, each with the result its operation's row of that life holds when the event left
    /// it CONFIRMED.
    fn chainable(
        &self,
        range: (i64, i64),
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Stored>, StoreError>> + Send;

    /// [`Chain::chainable`] of one tenant.
    fn tenant_events(
        &self,
        tenant: &str,
        range: (i64, i64),
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Stored>, StoreError>> + Send;

    /// The tenant's latest verification recorded.
    fn verification(
        &self,
        tenant: &str,
    ) -> impl Future<Output = Result<Option<Verification>, StoreError>> + Send;

    /// The tenant's newest link.
    fn last_link(
        &self,
        tenant: &str,
    ) -> impl Future<Output = Result<Option<Link>, StoreError>> + Send;

    /// Writes `links` and moves the progress from the first of `progress` to the second, only
    /// if it is still at the first (one replica links a range); whether it did.
    fn append_links(
        &self,
        progress: (i64, i64),
        links: &[Link],
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The tenant's links that cover events after `after`, oldest first, at most `limit`.
    fn links(
        &self,
        tenant: &str,
        after: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Link>, StoreError>> + Send;

    /// The tenant's link before link `number`, if kept.
    fn link_before(
        &self,
        tenant: &str,
        number: i64,
    ) -> impl Future<Output = Result<Option<Link>, StoreError>> + Send;

    /// The tenant's operations whose latest event is linked (at or below `through`), by id
    /// after the first of `page`, at most its second: each one's state and its latest event's.
    fn states(
        &self,
        tenant: &str,
        through: i64,
        page: (&str, u32),
    ) -> impl Future<Output = Result<Vec<Checked>, StoreError>> + Send;

    /// Keeps a tenant's latest verification.
    fn record_verification(
        &self,
        verification: &Verification,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Each tenant's latest verification, by tenant.
    fn verifications(&self) -> impl Future<Output = Result<Vec<Verification>, StoreError>> + Send;

    /// Deletes the links every event of which retention deleted (all at or below
    /// `deleted_through`), but each tenant's newest such: its anchor. How many.
    fn delete_links_through(
        &self,
        deleted_through: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// What continuity needs of the store (see [`once_core::continuity`]): the ledger's identity,
/// the highest token issued, claims in the history, and each tenant's epoch and hold.
pub trait Continuity {
    /// The ledger's identity and sealing key; `made` is stored as them when none is yet (by
    /// the first replica to start; the others read its).
    fn identity(
        &self,
        made: (&str, [u8; 32]),
    ) -> impl Future<Output = Result<(String, [u8; 32]), StoreError>> + Send;

    /// The highest fencing token issued (or skipped).
    fn issued_through(&self) -> impl Future<Output = Result<FencingToken, StoreError>> + Send;

    /// Whether the history records an attempt, `claim` (its life and number): its claim, or
    /// its recovery from a client's position.
    fn claim_recorded(
        &self,
        tenant: &str,
        id: &OperationId,
        claim: (FencingToken, u32),
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Whether the history records any event of `life` of the operation.
    fn life_recorded(
        &self,
        tenant: &str,
        id: &OperationId,
        life: FencingToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Every tenant that has an epoch or a hold, by name.
    fn standings(&self) -> impl Future<Output = Result<Vec<Standing>, StoreError>> + Send;

    /// Holds the executions of `tenant`, found `behind` in its epoch `behind.ledger_epoch`, and
    /// raises the token counter past the token the client saw (none is issued again). Nothing
    /// changes when the tenant is held already or its epoch moved on. Returns where it stands.
    fn hold(
        &self,
        tenant: &str,
        behind: &Behind,
    ) -> impl Future<Output = Result<Standing, StoreError>> + Send;

    /// Accepts the loss of every held tenant, or of `tenant` alone (held or not): each opens
    /// its next epoch and its executions go on; each acceptance is recorded.
    fn accept(
        &self,
        tenant: Option<&str>,
        actor: &Actor,
        reason: &str,
    ) -> impl Future<Output = Result<Vec<Accepted>, StoreError>> + Send;

    /// The latest `limit` acceptances (of `tenant`, when given), newest first.
    fn acceptances(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Accepted>, StoreError>> + Send;
}

/// The Begins answered without a new execution right.
pub trait Forensics {
    /// Records duplicates, all in one statement.
    fn record_duplicates(
        &self,
        duplicates: &[Duplicate],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The latest `limit` duplicates of one operation recorded at or after `since` (the start
    /// of its current life), oldest first.
    fn duplicates(
        &self,
        tenant: &str,
        id: &OperationId,
        since: Millis,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Duplicate>, StoreError>> + Send;

    /// At most `limit` duplicates of `tenant` (of one tool, when given) recorded at or after
    /// `since`, oldest first.
    fn recent_duplicates(
        &self,
        tenant: &str,
        tool: Option<&str>,
        since: Millis,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Duplicate>, StoreError>> + Send;
}

/// How hard a health check tries the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// It answers and commits a write.
    Write,
    /// It also commits a write of [`Probe::ROOM`] bytes: asked once the disk refused a write,
    /// until one this large commits.
    Room,
}

impl Probe {
    /// How much a [`Probe::Room`] writes: sixteen of the largest results a call may store.
    pub const ROOM: usize = 1 << 20;
}

/// The transaction primitives, safe only inside the ledger's template ([`crate::Ledger`]): the
/// module is private, so the trait is a bound of [`Backend`] that no other crate can name, and
/// no other crate can call these.
pub(crate) mod sealed {
    use super::*;

    /// Writers go through a transaction: [`Transactions::lock`] reads an operation and the clock
    /// while excluding every other writer of that operation, [`Transactions::apply`] writes a
    /// plan, and [`Transactions::commit`] makes it durable. Dropping a transaction rolls it back.
    pub trait Transactions {
        type Tx: Send;
        /// A connection one call holds for its lock-free read and the one-statement write decided
        /// from it ([`Transactions::apply_unlocked`]): one trip to the pool, not two. Released
        /// before the call takes a write transaction, which needs a connection of its own.
        type Conn: Send;

        /// Starts a write transaction.
        fn begin_write(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

        /// Reads the operation for update (creating no row) and the store's clock.
        fn lock(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &OperationId,
        ) -> impl Future<Output = Result<(Option<Operation>, Millis), StoreError>> + Send;

        /// Takes a connection for one call, and how long that waited.
        fn connection(
            &self,
        ) -> impl Future<Output = Result<(Self::Conn, Duration), StoreError>> + Send;

        /// [`Backend::read`] on the call's connection.
        fn read_held(
            &self,
            conn: &mut Self::Conn,
            tenant: &str,
            id: &OperationId,
        ) -> impl Future<Output = Result<(Option<Operation>, Millis), StoreError>> + Send;

        /// Reads like [`Backend::read`], and when no operation is stored, also takes a fencing
        /// token never issued before, where the store can issue one outside a write transaction
        /// (for a first claim written by [`Transactions::apply_unlocked`]; an unused one is
        /// skipped, never issued again).
        fn read_claimable(
            &self,
            conn: &mut Self::Conn,
            tenant: &str,
            id: &OperationId,
        ) -> impl Future<
            Output = Result<(Option<Operation>, Millis, Option<FencingToken>), StoreError>,
        > + Send;

        /// How long the call's read on `conn` waited to be made with other calls' (its queue and
        /// the read), where a call that took no connection from the pool reads so (see
        /// [`Transactions::connection`]); nothing for a read on the call's own connection.
        fn read_waited(&self, conn: &Self::Conn) -> Duration;

        /// Whether [`Transactions::apply_unlocked`] can write anything here.
        fn writes_unlocked(&self) -> bool;

        /// Writes a decision's plan in one statement that commits by itself (maybe with other
        /// callers' decisions), only if what it was decided from is still what is stored and it
        /// is recent, and for a claim only if no other operation blocks it (see [`Decision`]). It
        /// takes the write gate as [`Transactions::lock`] does. `None` where the store cannot
        /// check a decision that way, or the plan is not one it writes so (then the caller
        /// decides again in a write transaction). The call's connection is given back: the write
        /// may go over another.
        fn apply_unlocked(
            &self,
            conn: Self::Conn,
            decision: Decision<'_>,
        ) -> impl Future<Output = Result<Option<Unlocked>, StoreError>> + Send;

        /// What must be found before a Begin is granted a new execution right: unless it declares a
        /// new intent, the operation that blocks it (an UNKNOWN or IN_FLIGHT operation of the
        /// Begin's tenant, tool and fingerprint under another id, UNKNOWN ones first); otherwise a
        /// new fencing token ([`Transactions::next_token`]). The guard of one intent is serialised
        /// until the transaction ends, so two Begins of it under two new ids cannot both find the
        /// way clear.
        fn guard(
            &self,
            tx: &mut Self::Tx,
            cmd: &BeginCommand,
        ) -> impl Future<Output = Result<FreshIdGuard, StoreError>> + Send;

        /// Makes every fencing token issued from now on larger than `seen`, one a client saw
        /// granted by this ledger before it was restored to an earlier state.
        fn raise_tokens(
            &self,
            tx: &mut Self::Tx,
            seen: FencingToken,
        ) -> impl Future<Output = Result<(), StoreError>> + Send;

        /// A fencing token never issued before by this store, larger than every one it issued.
        fn next_token(
            &self,
            tx: &mut Self::Tx,
        ) -> impl Future<Output = Result<FencingToken, StoreError>> + Send;

        /// The attempt log's record of the attempt granted `fencing_token`, if it is this
        /// operation's.
        fn attempt(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &OperationId,
            fencing_token: FencingToken,
        ) -> impl Future<Output = Result<Option<Attempt>, StoreError>> + Send;

        /// The resolution with `resolution_id` of this operation, if there was one (in any life
        /// whose events are still kept).
        fn find_resolution(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &OperationId,
            resolution_id: &str,
        ) -> impl Future<Output = Result<Option<PriorResolution>, StoreError>> + Send;

        /// Writes a plan. An insert that meets an existing row fails with
        /// [`StoreError::Duplicate`]. Every update of the operation row bumps its version. A
        /// transaction that writes events first calls [`Transactions::lock`], which takes the write
        /// gate watchers rely on ([`crate::watch`]). Returns which of the plan's events were
        /// written: one whose dedupe key is already recorded is not.
        fn apply(
            &self,
            tx: &mut Self::Tx,
            tenant: &str,
            id: &OperationId,
            plan: &Plan,
            now: Millis,
        ) -> impl Future<Output = Result<Written, StoreError>> + Send;

        fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

        /// Whether the ledger's writes go through one writer task that commits them in batches
        /// ([`crate::writer`]): where the database takes one writer at a time anyway.
        fn group_commit(&self) -> bool;

        /// Marks where one write of a shared transaction starts.
        fn savepoint(
            &self,
            tx: &mut Self::Tx,
        ) -> impl Future<Output = Result<(), StoreError>> + Send;

        /// Keeps what was written since the savepoint, and marks where the next write starts:
        /// one round trip.
        fn savepoint_again(
            &self,
            tx: &mut Self::Tx,
        ) -> impl Future<Output = Result<(), StoreError>> + Send;

        /// Undoes what was written since the savepoint, and releases it: one round trip.
        fn rollback_to_savepoint(
            &self,
            tx: &mut Self::Tx,
        ) -> impl Future<Output = Result<(), StoreError>> + Send;
    }
}
