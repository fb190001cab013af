//! Rows as the database holds them, and their conversion into the domain's types.
//!
//! Each table's columns are listed once: the row structs below decode them by name, and the
//! statements that write them are built from the same lists.

use std::sync::LazyLock;

use once_core::access::{Credential, CredentialKind, SecretHash, Tenant};
use once_core::forensics::Duplicate;
use once_core::{
    Actor, Attempt, AttemptContext, Blocking, Event, EventKind, FencingToken, Fingerprint, Listed,
    Millis, Operation, OperationEvent, OperationId, Source, State,
};

use sqlx::{Database, Encode, Type};

use crate::StoreError;

/// The columns of `operations` a plan writes, in the order [`crate::Store`] binds them. The
/// key comes first. `version` is not among them: every update bumps it in SQL.
pub(crate) const WRITTEN_OPERATION_COLUMNS: [&str; 35] = [
    "tenant",
    "operation_id",
    "tool",
    "fingerprint",
    "state",
    "source",
    "attempt",
    "fencing_token",
    "life",
    "attempt_id",
    "client_name",
    "session_id",
    "request_id",
    "executor",
    "holder",
    "holder_token",
    "lease_started_at",
    "lease_deadline",
    "result",
    "provider_ref",
    "provider_key",
    "provider",
    "lookup_hints",
    "retention_ms",
    "created_at",
    "updated_at",
    "expires_at",
    "reason",
    "unknown_since",
    "last_report_at",
    "declared_absent_token",
    "confirmed_by",
    "reconcile_lookups",
    "reconcile_next_at",
    "lookup_claimed_until",
];

/// Every column of `operations`, as [`OperationRow`] reads them.
pub(crate) static OPERATION_COLUMNS: LazyLock<String> =
    LazyLock::new(|| format!("{}, version", WRITTEN_OPERATION_COLUMNS.join(", ")));

/// The same columns for a page of a list: everything but the result, which GetOperation has,
/// and the kind and time of the latest event of the operation's current life.
pub(crate) static LISTED_OPERATION_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    let columns: Vec<&str> = WRITTEN_OPERATION_COLUMNS
        .iter()
        .map(|&column| match column {
            "result" => "NULL AS result",
            other => other,
        })
        .collect();
    let latest = |column: &str| {
        format!(
            "(SELECT e.{column} FROM events e WHERE e.tenant = operations.tenant \
             AND e.operation_id = operations.operation_id AND e.life = operations.life \
             ORDER BY e.sequence DESC LIMIT 1) AS last_event{}",
            if column == "kind" { "" } else { "_at" }
        )
    };
    format!(
        "{}, version, {}, {}",
        columns.join(", "),
        latest("kind"),
        latest("at")
    )
});

/// `$1, $2, …`: a placeholder for each of [`WRITTEN_OPERATION_COLUMNS`], in order.
pub(crate) static OPERATION_PLACEHOLDERS: LazyLock<String> = LazyLock::new(|| {
    let placeholders: Vec<String> = (1..=WRITTEN_OPERATION_COLUMNS.len())
        .map(|n| format!("${n}"))
        .collect();
    placeholders.join(", ")
});

/// `tool = $3, fingerprint = $4, …`: every written column but the key, set from its
/// placeholder, and the version bumped.
pub(crate) static OPERATION_ASSIGNMENTS: LazyLock<String> = LazyLock::new(|| {
    let assignments: Vec<String> = WRITTEN_OPERATION_COLUMNS
        .iter()
        .enumerate()
        .skip(2)
        .map(|(i, column)| format!("{column} = ${}", i + 1))
        .collect();
    format!("{}, version = version + 1", assignments.join(", "))
});

pub(crate) static INSERT_OPERATION: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO operations ({}) VALUES ({})",
        WRITTEN_OPERATION_COLUMNS.join(", "),
        OPERATION_PLACEHOLDERS.as_str()
    )
});

pub(crate) static UPDATE_OPERATION: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE operations SET {} WHERE tenant = $1 AND operation_id = $2",
        OPERATION_ASSIGNMENTS.as_str()
    )
});

/// The columns of `attempts` after its key, as [`AttemptRow`] reads them and
/// [`crate::Store`] writes them.
pub(crate) const ATTEMPT_COLUMNS: &str = "number, fencing_token, attempt_id, started_at, \
     lease_deadline, actor, holder, client_name, session_id, request_id";

/// The columns [`AttemptRow`] reads from `attempts a`: [`ATTEMPT_COLUMNS`], and the attempt's
/// life, the token of the latest attempt 1 of its operation at or below its own (every life
/// begins with attempt 1, and tokens only grow).
pub(crate) static ATTEMPT_SELECTED: LazyLock<String> = LazyLock::new(|| {
    let columns: Vec<String> = ATTEMPT_COLUMNS
        .split(", ")
        .map(|column| format!("a.{column}"))
        .collect();
    format!(
        "{}, (SELECT max(b.fencing_token) FROM attempts b WHERE b.tenant = a.tenant \
         AND b.operation_id = a.operation_id AND b.number = 1 \
         AND b.fencing_token <= a.fencing_token) AS life",
        columns.join(", ")
    )
});

pub(crate) static INSERT_ATTEMPT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO attempts (tenant, operation_id, {ATTEMPT_COLUMNS}) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
    )
});

/// Appends one event; the tool and state come from the operation row in the same transaction.
pub(crate) static INSERT_EVENT: LazyLock<String> = LazyLock::new(|| {
    let of_operation = |column: &str| {
        format!("(SELECT {column} FROM operations WHERE tenant = $1 AND operation_id = $2)")
    };
    format!(
        "INSERT INTO events (tenant, operation_id, life, at, kind, from_state, to_state, \
         attempt, actor, reason, details, dedupe_key, tool, state) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, {}, {}) ON CONFLICT DO NOTHING",
        of_operation("tool"),
        of_operation("state"),
    )
});

/// The columns of `events` a reader sees, as [`EventRow`] reads them.
pub(crate) const EVENT_COLUMNS: &str =
    "sequence, at, kind, from_state, to_state, attempt, actor, reason, details";

/// The columns the fresh-id guard reads, as [`BlockingRow`] reads them.
pub(crate) const BLOCKING_COLUMNS: &str =
    "operation_id, state, attempt, lease_deadline, updated_at";

#[derive(sqlx::FromRow)]
pub(crate) struct OperationRow {
    tenant: String,
    operation_id: String,
    tool: String,
    fingerprint: Vec<u8>,
    state: String,
    source: String,
    attempt: i64,
    fencing_token: i64,
    life: i64,
    attempt_id: String,
    client_name: Option<String>,
    session_id: Option<String>,
    request_id: Option<String>,
    executor: String,
    holder: Option<String>,
    holder_token: Option<i64>,
    lease_started_at: i64,
    lease_deadline: i64,
    result: Option<Vec<u8>>,
    provider_ref: Option<String>,
    provider_key: String,
    provider: Option<String>,
    lookup_hints: Option<String>,
    retention_ms: i64,
    created_at: i64,
    updated_at: i64,
    expires_at: Option<i64>,
    reason: Option<String>,
    unknown_since: Option<i64>,
    last_report_at: Option<i64>,
    declared_absent_token: Option<i64>,
    confirmed_by: Option<i64>,
    reconcile_lookups: i64,
    reconcile_next_at: Option<i64>,
    lookup_claimed_until: Option<i64>,
    version: i64,
}

impl TryFrom<OperationRow> for Operation {
    type Error = StoreError;

    fn try_from(row: OperationRow) -> Result<Self, StoreError> {
        Ok(Operation {
            tenant: row.tenant,
            operation_id: operation_id(row.operation_id)?,
            tool: row.tool,
            fingerprint: fingerprint(row.fingerprint)?,
            state: state(&row.state)?,
            source: Source::parse(&row.source)
                .ok_or_else(|| corrupt(format!("unknown source {:?}", row.source)))?,
            attempt: count(row.attempt)?,
            fencing_token: token(row.fencing_token)?,
            life: token(row.life)?,
            attempt_id: row.attempt_id,
            attempt_context: context(row.client_name, row.session_id, row.request_id),
            executor: actor(&row.executor)?,
            // A holder is the latest attempt's only when written with its token: a writer that
            // does not know the column leaves the previous attempt's behind.
            holder: row
                .holder
                .filter(|_| row.holder_token == Some(row.fencing_token)),
            lease_started_at: row.lease_started_at,
            lease_deadline: row.lease_deadline,
            result: row.result,
            provider_ref: row.provider_ref,
            provider_key: row.provider_key,
            provider: row.provider,
            lookup_hints: row.lookup_hints,
            retention_ms: row.retention_ms,
            created_at: row.created_at,
            updated_at: row.updated_at,
            expires_at: row.expires_at,
            reason: row.reason,
            version: row.version,
            unknown_since: row.unknown_since,
            last_report_at: row.last_report_at,
            declared_absent_token: row.declared_absent_token.map(token).transpose()?,
            confirmed_by: row.confirmed_by.map(token).transpose()?,
            reconcile_lookups: count(row.reconcile_lookups)?,
            reconcile_next_at: row.reconcile_next_at,
            lookup_claimed_until: row.lookup_claimed_until,
        })
    }
}

/// The columns of `duplicates` after its id, as [`DuplicateRow`] reads them and
/// [`crate::Store`] writes them.
pub(crate) const DUPLICATE_COLUMNS: &str = "tenant, operation_id, tool, at, decision, attempt_id, \
     client_name, session_id, request_id, actor, requested_id";

#[derive(sqlx::FromRow)]
pub(crate) struct DuplicateRow {
    tenant: String,
    operation_id: String,
    tool: String,
    at: i64,
    decision: String,
    attempt_id: String,
    client_name: Option<String>,
    session_id: Option<String>,
    request_id: Option<String>,
    actor: String,
    requested_id: Option<String>,
}

impl TryFrom<DuplicateRow> for Duplicate {
    type Error = StoreError;

    fn try_from(row: DuplicateRow) -> Result<Self, StoreError> {
        Ok(Duplicate {
            tenant: row.tenant,
            operation_id: operation_id(row.operation_id)?,
            tool: row.tool,
            at: row.at,
            decision: row.decision,
            attempt_id: row.attempt_id,
            context: context(row.client_name, row.session_id, row.request_id),
            actor: actor(&row.actor)?,
            requested: row.requested_id.map(operation_id).transpose()?,
        })
    }
}

/// An operation in a listing, with the latest event of its current life.
#[derive(sqlx::FromRow)]
pub(crate) struct ListedRow {
    #[sqlx(flatten)]
    operation: OperationRow,
    last_event: Option<String>,
    last_event_at: Option<i64>,
}

impl TryFrom<ListedRow> for Listed {
    type Error = StoreError;

    fn try_from(row: ListedRow) -> Result<Self, StoreError> {
        let last_event = match (row.last_event, row.last_event_at) {
            (Some(kind), Some(at)) => Some((
                EventKind::parse(&kind)
                    .ok_or_else(|| corrupt(format!("unknown event kind {kind:?}")))?,
                at,
            )),
            _ => None,
        };
        Ok(Listed {
            operation: Operation::try_from(row.operation)?,
            last_event,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct AttemptRow {
    number: i64,
    fencing_token: i64,
    attempt_id: String,
    started_at: i64,
    lease_deadline: i64,
    actor: String,
    holder: Option<String>,
    client_name: Option<String>,
    session_id: Option<String>,
    request_id: Option<String>,
    /// None only for an attempt log without its first attempt (one written by hand).
    life: Option<i64>,
}

impl TryFrom<AttemptRow> for Attempt {
    type Error = StoreError;

    fn try_from(row: AttemptRow) -> Result<Self, StoreError> {
        Ok(Attempt {
            number: count(row.number)?,
            fencing_token: token(row.fencing_token)?,
            life: token(row.life.unwrap_or(row.fencing_token))?,
            attempt_id: row.attempt_id,
            started_at: row.started_at,
            lease_deadline: row.lease_deadline,
            actor: actor(&row.actor)?,
            holder: row.holder,
            context: context(row.client_name, row.session_id, row.request_id),
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct EventRow {
    sequence: i64,
    at: i64,
    kind: String,
    from_state: Option<String>,
    to_state: Option<String>,
    attempt: Option<i64>,
    actor: String,
    reason: Option<String>,
    details: Option<String>,
}

impl TryFrom<EventRow> for Event {
    type Error = StoreError;

    fn try_from(row: EventRow) -> Result<Self, StoreError> {
        Ok(Event {
            sequence: row.sequence,
            at: row.at,
            kind: EventKind::parse(&row.kind)
                .ok_or_else(|| corrupt(format!("unknown event kind {:?}", row.kind)))?,
            from: row.from_state.as_deref().map(state).transpose()?,
            to: row.to_state.as_deref().map(state).transpose()?,
            attempt: row.attempt.map(count).transpose()?,
            actor: actor(&row.actor)?,
            reason: row.reason,
            details: row.details,
        })
    }
}

/// The columns of `events` a watcher sees, as [`WatchedEventRow`] reads them.
pub(crate) static WATCHED_EVENT_COLUMNS: LazyLock<String> =
    LazyLock::new(|| format!("tenant, operation_id, tool, state, {EVENT_COLUMNS}"));

#[derive(sqlx::FromRow)]
pub(crate) struct WatchedEventRow {
    tenant: String,
    operation_id: String,
    tool: Option<String>,
    state: Option<String>,
    #[sqlx(flatten)]
    event: EventRow,
}

impl TryFrom<WatchedEventRow> for OperationEvent {
    type Error = StoreError;

    fn try_from(row: WatchedEventRow) -> Result<Self, StoreError> {
        Ok(OperationEvent {
            tenant: row.tenant,
            operation_id: operation_id(row.operation_id)?,
            tool: row.tool,
            state: row.state.as_deref().map(state).transpose()?,
            event: Event::try_from(row.event)?,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct BlockingRow {
    operation_id: String,
    state: String,
    attempt: i64,
    lease_deadline: i64,
    updated_at: i64,
}

impl TryFrom<BlockingRow> for Blocking {
    type Error = StoreError;

    fn try_from(row: BlockingRow) -> Result<Self, StoreError> {
        Ok(Blocking {
            operation_id: operation_id(row.operation_id)?,
            state: state(&row.state)?,
            attempt: count(row.attempt)?,
            lease_deadline: row.lease_deadline,
            updated_at: row.updated_at,
        })
    }
}

/// An operation's key as a row of a sweeper's or a scheduler's list.
#[derive(sqlx::FromRow)]
pub(crate) struct KeyRow {
    tenant: String,
    operation_id: String,
}

impl TryFrom<KeyRow> for (String, OperationId) {
    type Error = StoreError;

    fn try_from(row: KeyRow) -> Result<Self, StoreError> {
        Ok((row.tenant, operation_id(row.operation_id)?))
    }
}

/// The columns of `tenants`, as [`TenantRow`] reads them.
pub(crate) const TENANT_COLUMNS: &str = "name, created_at, max_in_flight, requests_per_second";

#[derive(sqlx::FromRow)]
pub(crate) struct TenantRow {
    name: String,
    created_at: i64,
    max_in_flight: Option<i64>,
    requests_per_second: Option<i64>,
}

impl TryFrom<TenantRow> for Tenant {
    type Error = StoreError;

    fn try_from(row: TenantRow) -> Result<Self, StoreError> {
        Ok(Tenant {
            name: row.name,
            created_at: row.created_at,
            max_in_flight: row.max_in_flight,
            requests_per_second: row.requests_per_second,
        })
    }
}

/// The columns of `credentials` but the secret's hash, as [`CredentialRow`] reads them.
pub(crate) const CREDENTIAL_COLUMNS: &str =
    "key_id, tenant, name, roles, kind, created_at, revoked_at";

#[derive(sqlx::FromRow)]
pub(crate) struct CredentialRow {
    key_id: String,
    tenant: String,
    name: String,
    roles: String,
    kind: String,
    created_at: i64,
    revoked_at: Option<i64>,
}

impl TryFrom<CredentialRow> for Credential {
    type Error = StoreError;

    fn try_from(row: CredentialRow) -> Result<Self, StoreError> {
        Ok(Credential {
            roles: row.roles.parse().map_err(corrupt)?,
            kind: CredentialKind::parse(&row.kind)
                .ok_or_else(|| corrupt(format!("unknown credential kind {:?}", row.kind)))?,
            key_id: row.key_id,
            tenant: row.tenant,
            name: row.name,
            created_at: row.created_at,
            revoked_at: row.revoked_at,
        })
    }
}

/// A credential with the hash of its secret and its tenant's columns.
#[derive(sqlx::FromRow)]
pub(crate) struct KnownCredentialRow {
    #[sqlx(flatten)]
    credential: CredentialRow,
    secret_hash: Vec<u8>,
    tenant_created_at: i64,
    max_in_flight: Option<i64>,
    requests_per_second: Option<i64>,
    changed: i64,
    tenant_changed: i64,
}

impl KnownCredentialRow {
    /// The version of the latest change the row shows, of the credential or of its tenant.
    pub(crate) fn version(&self) -> i64 {
        self.changed.max(self.tenant_changed)
    }
}

impl TryFrom<KnownCredentialRow> for (SecretHash, Credential, Tenant) {
    type Error = StoreError;

    fn try_from(row: KnownCredentialRow) -> Result<Self, StoreError> {
        let hash: [u8; 32] = row
            .secret_hash
            .try_into()
            .map_err(|_| corrupt("a credential's hash is not 32 bytes".to_owned()))?;
        let credential = Credential::try_from(row.credential)?;
        let tenant = Tenant {
            name: credential.tenant.clone(),
            created_at: row.tenant_created_at,
            max_in_flight: row.max_in_flight,
            requests_per_second: row.requests_per_second,
        };
        Ok((SecretHash(hash), credential, tenant))
    }
}

/// Converts every row of a query's answer.
pub(crate) fn convert<R, T>(rows: Vec<R>) -> Result<Vec<T>, StoreError>
where
    T: TryFrom<R, Error = StoreError>,
{
    rows.into_iter().map(T::try_from).collect()
}

/// The store's clock beside the operation it read, if there was one.
pub(crate) type Clocked = (Option<Operation>, Millis);

/// A fencing token as the database stores it (BIGINT). Tokens come from the store's own
/// counter, so one that does not fit was never issued.
pub(crate) fn token_column(value: FencingToken) -> i64 {
    i64::try_from(value.get()).unwrap_or(i64::MAX)
}

pub(crate) fn token(value: i64) -> Result<FencingToken, StoreError> {
    u64::try_from(value)
        .map(FencingToken)
        .map_err(|_| corrupt(format!("fencing token {value} out of range")))
}

/// The transport context of an attempt, from its three columns.
fn context(
    client_name: Option<String>,
    session_id: Option<String>,
    request_id: Option<String>,
) -> AttemptContext {
    AttemptContext {
        client_name,
        session_id,
        request_id,
    }
}

fn actor(value: &str) -> Result<Actor, StoreError> {
    value.parse().map_err(corrupt)
}

pub(crate) fn state(value: &str) -> Result<State, StoreError> {
    State::parse(value).ok_or_else(|| corrupt(format!("unknown state {value:?}")))
}

fn count(value: i64) -> Result<u32, StoreError> {
    u32::try_from(value).map_err(|_| corrupt(format!("count {value} out of range")))
}

fn operation_id(value: String) -> Result<OperationId, StoreError> {
    OperationId::parse("operation_id", &value).map_err(|e| corrupt(e.to_string()))
}

fn fingerprint(bytes: Vec<u8>) -> Result<Fingerprint, StoreError> {
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes".to_owned()))?;
    Ok(Fingerprint(bytes))
}

fn corrupt(message: String) -> StoreError {
    StoreError::Corrupt(message)
}

/// A statement being bound, of database `D`.
pub(crate) type Bound<'q, D> = sqlx::query::Query<'q, D, <D as Database>::Arguments<'q>>;

/// Where a row's columns are bound, one after another: one row's values ([`One`]), or on
/// PostgreSQL one array per column over many rows ([`Many`]). [`operation_columns`] and
/// [`attempt_columns`] name each table's values once for both.
pub(crate) trait Rows<'q> {
    /// What a row is read from.
    type Row: 'q;
}

/// [`Rows`] that take a column of values of type `T`.
pub(crate) trait Column<'q, T>: Rows<'q> + Sized {
    /// Binds the value `of` each row gives.
    fn column(self, of: impl Fn(&'q Self::Row) -> T) -> Self;
}

/// One row's values, bound to a statement of database `D`.
pub(crate) struct One<'q, D: Database, R> {
    pub query: Bound<'q, D>,
    pub row: &'q R,
}

impl<'q, D: Database, R: 'q> Rows<'q> for One<'q, D, R> {
    type Row = R;
}

impl<'q, D, R, T> Column<'q, T> for One<'q, D, R>
where
    D: Database,
    R: 'q,
    T: Encode<'q, D> + Type<D> + Send + 'q,
{
    fn column(self, of: impl Fn(&'q R) -> T) -> Self {
        One {
            query: self.query.bind(of(self.row)),
            row: self.row,
        }
    }
}

/// Many rows' values, each column bound as one PostgreSQL array (for `unnest`).
pub(crate) struct Many<'q, R> {
    pub query: Bound<'q, sqlx::Postgres>,
    pub rows: Vec<&'q R>,
}

impl<'q, R: 'q> Rows<'q> for Many<'q, R> {
    type Row = R;
}

impl<'q, R, T> Column<'q, T> for Many<'q, R>
where
    R: 'q,
    T: Send + 'q,
    Vec<T>: Encode<'q, sqlx::Postgres> + Type<sqlx::Postgres>,
{
    fn column(self, of: impl Fn(&'q R) -> T) -> Self {
        let values: Vec<T> = self.rows.iter().map(|row| of(row)).collect();
        Many {
            query: self.query.bind(values),
            rows: self.rows,
        }
    }
}

/// Binds an operation's written columns, in the order of [`WRITTEN_OPERATION_COLUMNS`].
pub(crate) fn operation_columns<'q, S>(columns: S) -> S
where
    S: Rows<'q, Row = Operation>
        + Column<'q, &'q str>
        + Column<'q, Option<&'q str>>
        + Column<'q, &'q [u8]>
        + Column<'q, Option<&'q [u8]>>
        + Column<'q, i64>
        + Column<'q, Option<i64>>
        + Column<'q, String>,
{
    columns
        .column(|op| op.tenant.as_str())
        .column(|op| op.operation_id.as_str())
        .column(|op| op.tool.as_str())
        .column(|op| &op.fingerprint.0[..])
        .column(|op| op.state.as_str())
        .column(|op| op.source.as_str())
        .column(|op| i64::from(op.attempt))
        .column(|op| token_column(op.fencing_token))
        .column(|op| token_column(op.life))
        .column(|op| op.attempt_id.as_str())
        .column(|op| op.attempt_context.client_name.as_deref())
        .column(|op| op.attempt_context.session_id.as_deref())
        .column(|op| op.attempt_context.request_id.as_deref())
        .column(|op| op.executor.to_string())
        .column(|op| op.holder.as_deref())
        .column(|op| op.holder.as_ref().map(|_| token_column(op.fencing_token)))
        .column(|op| op.lease_started_at)
        .column(|op| op.lease_deadline)
        .column(|op| op.result.as_deref())
        .column(|op| op.provider_ref.as_deref())
        .column(|op| op.provider_key.as_str())
        .column(|op| op.provider.as_deref())
        .column(|op| op.lookup_hints.as_deref())
        .column(|op| op.retention_ms)
        .column(|op| op.created_at)
        .column(|op| op.updated_at)
        .column(|op| op.expires_at)
        .column(|op| op.reason.as_deref())
        .column(|op| op.unknown_since)
        .column(|op| op.last_report_at)
        .column(|op| op.declared_absent_token.map(token_column))
        .column(|op| op.confirmed_by.map(token_column))
        .column(|op| i64::from(op.reconcile_lookups))
        .column(|op| op.reconcile_next_at)
        .column(|op| op.lookup_claimed_until)
}

/// Binds the intent a fresh-id guard looks for to `query`: the tenant, tool and fingerprint of
/// `cmd`, then the operation id asking (which does not block itself).
pub(crate) fn bind_intent<'q, D, O>(
    query: sqlx::query::QueryAs<'q, D, O, <D as Database>::Arguments<'q>>,
    cmd: &'q once_core::BeginCommand,
) -> sqlx::query::QueryAs<'q, D, O, <D as Database>::Arguments<'q>>
where
    D: Database,
    &'q str: Encode<'q, D> + Type<D>,
    &'q [u8]: Encode<'q, D> + Type<D>,
{
    query
        .bind(cmd.tenant.as_str())
        .bind(cmd.tool.as_str())
        .bind(&cmd.fingerprint.0[..])
        .bind(cmd.operation_id.as_str())
}

/// Binds an event's own values to an [`INSERT_EVENT`] whose tenant and operation id are bound:
/// its life, the time, and the rest of the event.
pub(crate) fn event_values<'q, D>(
    query: Bound<'q, D>,
    event: &'q once_core::NewEvent,
    now: Millis,
) -> Bound<'q, D>
where
    D: Database,
    for<'a> &'a str: Encode<'a, D> + Type<D>,
    for<'a> Option<&'a str>: Encode<'a, D> + Type<D>,
    for<'a> i64: Encode<'a, D> + Type<D>,
    for<'a> Option<i64>: Encode<'a, D> + Type<D>,
    for<'a> String: Encode<'a, D> + Type<D>,
{
    query
        .bind(token_column(event.life))
        .bind(now)
        .bind(event.kind.as_str())
        .bind(event.from.map(|s| s.as_str()))
        .bind(event.to.map(|s| s.as_str()))
        .bind(event.attempt.map(i64::from))
        .bind(event.actor.to_string())
        .bind(event.reason.as_deref())
        .bind(event.details.as_deref())
        .bind(event.dedupe_key.as_deref())
}

/// Binds an attempt's columns, in the order of [`ATTEMPT_COLUMNS`].
pub(crate) fn attempt_columns<'q, S>(columns: S) -> S
where
    S: Rows<'q, Row = Attempt>
        + Column<'q, &'q str>
        + Column<'q, Option<&'q str>>
        + Column<'q, i64>
        + Column<'q, String>,
{
    columns
        .column(|a| i64::from(a.number))
        .column(|a| token_column(a.fencing_token))
        .column(|a| a.attempt_id.as_str())
        .column(|a| a.started_at)
        .column(|a| a.lease_deadline)
        .column(|a| a.actor.to_string())
        .column(|a| a.holder.as_deref())
        .column(|a| a.context.client_name.as_deref())
        .column(|a| a.context.session_id.as_deref())
        .column(|a| a.context.request_id.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_every_written_column_once() {
        let insert = INSERT_OPERATION.as_str();
        let update = UPDATE_OPERATION.as_str();
        assert!(insert.ends_with("$35)"), "{insert}");
        assert!(update.contains("lookup_claimed_until = $35,"), "{update}");
        assert!(
            update.starts_with("UPDATE operations SET tool = $3,"),
            "{update}"
        );
        assert!(LISTED_OPERATION_COLUMNS.contains("NULL AS result,"));
        assert!(!LISTED_OPERATION_COLUMNS.contains(", result,"));
        assert_eq!(
            OPERATION_COLUMNS.split(", ").count(),
            WRITTEN_OPERATION_COLUMNS.len() + 1
        );
    }
}
