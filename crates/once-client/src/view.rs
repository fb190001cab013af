//! What the ledger holds about an operation, for status tools and people.

use std::time::{Duration, SystemTime};

use once_core::{AttemptContext, State};

/// What a ledger is, and who the caller is to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// Its release and, when known, the commit it was built from.
    pub version: String,
    /// `sqlite` or `postgres`.
    pub database: String,
    /// The caller's tenant.
    pub tenant: String,
    /// The credential the caller presented; `None` on an open ledger.
    pub key: Option<KeyInfo>,
}

/// The credential a caller presented, as the ledger knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub key_id: String,
    pub name: String,
    pub roles: Vec<String>,
}

/// One operation as the ledger holds it: its state, its result, and the history of its current
/// life.
#[derive(Debug, Clone, PartialEq)]
pub struct OperationView {
    /// Its tenant (empty from a ledger older than this field).
    pub tenant: String,
    pub operation_id: String,
    pub tool: String,
    pub state: State,
    /// The latest attempt's number in this life.
    pub attempt: u32,
    pub fencing_token: u64,
    /// The stored result: a CONFIRMED operation's, or, for one held for an operator, the result
    /// of the effect already proven.
    pub result: Option<Vec<u8>>,
    pub provider_ref: Option<String>,
    pub provider_key: String,
    /// Why the operation is in its state, when someone said.
    pub reason: Option<String>,
    /// Who put it in its state: `attempt`, `lease`, `reconciler`, `operator`, or `anomaly` (held
    /// for an operator).
    pub source: String,
    /// The fingerprint of its arguments, in hex.
    pub fingerprint: String,
    /// The reconciler that can look it up, and the hints it is given (JSON).
    pub provider: Option<String>,
    pub lookup_hints: Option<String>,
    /// While IN_FLIGHT: when the latest attempt's lease ends.
    pub lease_deadline: Option<SystemTime>,
    /// Once settled: when retention may delete it.
    pub expires_at: Option<SystemTime>,
    pub created_at: Option<SystemTime>,
    pub updated_at: Option<SystemTime>,
    /// In a listing: the kind and time of the latest event of its current life.
    pub last_event: Option<(String, SystemTime)>,
    /// The attempt log of the current life; empty in a listing.
    pub attempts: Vec<AttemptView>,
    /// The event history of the current life; empty in a listing.
    pub events: Vec<EventView>,
    /// Every call of the current life, oldest first, each after the first with where it came
    /// from; empty in a listing.
    pub calls: Vec<CallView>,
    /// The calls in a sentence ("1 execution, 2 duplicates prevented: 2 harness retries").
    pub forensics: Option<String>,
    /// A link to it in its provider's dashboard, when its reconciler has one; not in a listing.
    pub provider_dashboard: Option<String>,
    /// The events of its earlier lives (before, its id was settled, deleted by retention and
    /// begun again), oldest first (the latest 200); empty in a listing.
    pub earlier_events: Vec<EventView>,
}

/// One call of an operation: a granted attempt, or a Begin answered without a new execution
/// right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallView {
    pub at: Option<SystemTime>,
    /// The attempt it was granted, if it was.
    pub attempt: Option<u32>,
    /// `EXECUTE`, or the decision it was answered.
    pub decision: String,
    pub attempt_id: String,
    pub context: AttemptContext,
    pub actor: String,
    /// The operation id asked for, when the fresh-id guard answered for this operation.
    pub requested_operation_id: Option<String>,
    /// `transport_retry`, `harness_retry`, `model_reissue`, `reconnect`, `other_client` or
    /// `unattributed`; `None` for the first call.
    pub origin: Option<String>,
}

/// Where the repeated calls of many operations came from, over a window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForensicsView {
    /// The operations looked at: those with a duplicate in the window.
    pub operations: u32,
    pub executions: u32,
    pub prevented: u32,
    /// Repeated calls by origin.
    pub origins: Vec<(String, u32)>,
    /// In a sentence.
    pub summary: String,
}

/// One granted execution right, from the attempt log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptView {
    pub number: u32,
    pub fencing_token: u64,
    pub attempt_id: String,
    /// Where the attempt came from: tells a model retry from a client replay.
    pub context: AttemptContext,
    pub actor: String,
    pub started_at: Option<SystemTime>,
    pub lease_deadline: Option<SystemTime>,
}

/// One entry of the operation's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventView {
    /// Its place in the ledger's history of every operation: later events have larger ones.
    pub sequence: i64,
    pub at: Option<SystemTime>,
    /// `CLAIMED`, `CONFIRMED`, `LEASE_EXPIRED`, `RESOLVED`, `DOUBLE_EXECUTION`, …
    pub kind: String,
    pub from: Option<State>,
    pub to: Option<State>,
    pub attempt: u32,
    /// `executor:<name>`, `operator:<name>`, `reconciler:<name>` or `ledger`.
    pub actor: String,
    pub reason: Option<String>,
    /// A JSON object with whatever else the event records.
    pub details: Option<String>,
}

/// An event as a watcher receives it, with the operation it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedEvent {
    /// The operation's tenant (empty from a ledger older than this field).
    pub tenant: String,
    pub operation_id: String,
    /// The operation's tool when the event was recorded (empty for old events).
    pub tool: String,
    /// The state the operation was in once the event was recorded.
    pub state: Option<State>,
    pub event: EventView,
}

/// Durations summed up: how many, percentiles (nearest rank) and the longest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgesView {
    pub count: u64,
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub max: Duration,
}

/// A tenant's figures, now and over a window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsView {
    /// Operations in each state, by tool, now.
    pub operations: Vec<(State, String, u64)>,
    /// How long the UNKNOWN operations have been UNKNOWN, now.
    pub unknown: AgesView,
    /// For each door out of UNKNOWN (`late_report`, `reconciler`, `operator`), how long the
    /// operations that went through it in the window had been UNKNOWN.
    pub resolved: Vec<(String, AgesView)>,
    /// Anomalies and escalations recorded in the window, by kind.
    pub events: Vec<(String, u64)>,
    /// Each reconciler's lookups in the window, by name.
    pub reconcilers: Vec<ReconcilerView>,
}

/// One reconciler's lookups over the window: its health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcilerView {
    pub reconciler: String,
    /// Lookups that settled their operation.
    pub settled: u64,
    /// Lookups that found nothing that proves absence yet.
    pub missed: u64,
    /// Lookups that could not tell (the provider failed, timed out, or was unreadable).
    pub failed: u64,
    /// From claim to verdict: the mean and the longest, when lookups said.
    pub mean: Option<Duration>,
    pub max: Option<Duration>,
}

impl ReconcilerView {
    /// Every lookup counted.
    pub fn lookups(&self) -> u64 {
        self.settled + self.missed + self.failed
    }
}

/// A tenant's chain as it stands (`GetHistoryHead`): its newest link and its last
/// verification, without walking it.
#[derive(Debug, Clone)]
pub struct HistoryHead {
    pub tenant: String,
    /// The newest link's number (0: no link yet), hash, and the last sequence it covers.
    pub head_number: i64,
    pub head_hash: String,
    pub head_through: i64,
    pub linked_at: Option<SystemTime>,
    pub last_verification: Option<LastVerification>,
}

/// A verification of a tenant's chain, as the ledger recorded it.
#[derive(Debug, Clone)]
pub struct LastVerification {
    pub at: SystemTime,
    pub links: i64,
    pub events: i64,
    pub through: i64,
    /// What did not match, as said to people; `None` when everything did.
    pub problem: Option<String>,
}

/// The public keys a ledger says verify its receipts (`GetSigningKeys`).
#[derive(Debug, Clone)]
pub struct SigningKeys {
    /// The ledger's identity, which its receipts name.
    pub ledger: String,
    /// The id of the key signing now, when the ledger signs receipts.
    pub active: Option<String>,
    /// The active key and the retired ones.
    pub keys: Vec<crate::PublicKey>,
}

/// A verification of a tenant's chained history (`VerifyHistory`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryView {
    pub tenant: String,
    pub links: i64,
    pub events: i64,
    /// The last event sequence the chain covers.
    pub through: i64,
    /// The newest link: its number and hash (0 and empty before the first).
    pub head_number: i64,
    pub head_hash: String,
    pub verified_at: std::time::SystemTime,
    /// The first thing that does not match what the chain recorded.
    pub problem: Option<HistoryProblem>,
}

/// What does not match: `code` (LINK, EVENT_CHANGED, EVENT_MISSING, EVENT_ADDED,
/// RESULT_CHANGED, STATE_CHANGED), the event it is about and its operation, said for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryProblem {
    pub code: String,
    pub sequence: i64,
    pub operation_id: String,
    pub message: String,
}
