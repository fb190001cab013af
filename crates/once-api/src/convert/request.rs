//! Inbound: each request message to the domain command it asks for, or an [`Invalid`] naming
//! the field at fault. Nothing here touches storage.

use once_core::identity::{check_name, check_text, CanonicalArguments, MAX_TOOL_BYTES};
use once_core::once_id::{self, IntentPart};
use once_core::*;
use prost_types::Duration;

use super::*;
use crate::pb;

/// Who is calling, as established by authentication (never read from the request body).
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: String,
    /// The actor recorded for an executor's calls.
    pub actor: Actor,
    /// The credential presented: an attempt is granted to it, and only it reports for it.
    pub holder: Holder,
}

/// A validated Begin and the wait bound that goes with it.
#[derive(Debug, Clone)]
pub struct BeginInput {
    pub command: BeginCommand,
    pub wait_ms: i64,
    /// The sealed positions the caller shows, as sent: the highest it saw, and the latest of
    /// this operation (only the ledger that sealed them can open them: see
    /// `once_core::continuity`).
    pub seen_position: Option<String>,
    pub operation_position: Option<String>,
    /// Attach a signed receipt to a REPLAY answer.
    pub want_receipt: bool,
}

pub fn begin(
    req: pb::BeginRequest,
    caller: &Caller,
    limits: &Limits,
) -> Result<BeginInput, Invalid> {
    check_name("tool", &req.tool, MAX_TOOL_BYTES)?;
    let (arguments, fingerprint) = effect(req.effect, &req.volatile_fields)?;
    let operation_id = identity(req.identity, &req.tool, arguments.as_ref())?;
    check_attempt_id(&req.attempt_id)?;
    let context = attempt_context(req.context.unwrap_or_default())?;
    let lease_ttl_ms = lease_ttl("lease_ttl", req.lease_ttl, limits)?;
    let wait_ms = match req.wait {
        None => 0,
        Some(d) => bounded("wait", d, 0, limits.max_wait_ms)?,
    };
    let retention_ms = retention(req.retention, &operation_id, limits)?;
    let provider = optional_name("provider", req.provider, MAX_NAME_BYTES)?;
    let lookup_hints = json_object(
        "lookup_hints_json",
        req.lookup_hints_json,
        limits.max_hints_bytes,
    )?;
    for (field, position) in [
        (continuity::FIELD, &req.seen_position),
        (continuity::OPERATION_FIELD, &req.operation_position),
    ] {
        if position.len() > continuity::MAX_SEALED {
            return Err(Invalid::new(
                field,
                format!("is longer than {} bytes", continuity::MAX_SEALED),
            ));
        }
    }
    Ok(BeginInput {
        command: BeginCommand {
            tenant: caller.tenant.clone(),
            operation_id,
            tool: req.tool,
            fingerprint,
            attempt_id: req.attempt_id,
            context,
            lease_ttl_ms,
            retention_ms,
            new_intent: req.new_intent,
            provider,
            lookup_hints,
            actor: caller.actor.clone(),
            holder: caller.holder.clone(),
            held: false,
        },
        wait_ms,
        seen_position: (!req.seen_position.is_empty()).then_some(req.seen_position),
        operation_position: (!req.operation_position.is_empty()).then_some(req.operation_position),
        want_receipt: req.want_receipt,
    })
}

/// What a Begin's effect is: its canonical arguments when it sends them (the fields named
/// volatile left out), and its fingerprint, sent or computed from them.
fn effect(
    effect: Option<pb::begin_request::Effect>,
    volatile: &[String],
) -> Result<(Option<CanonicalArguments>, Fingerprint), Invalid> {
    for (i, name) in volatile.iter().enumerate() {
        check_name(&format!("volatile_fields[{i}]"), name, MAX_NAME_BYTES)?;
    }
    match effect {
        Some(pb::begin_request::Effect::ArgumentsJson(json)) => {
            let arguments = CanonicalArguments::parse("arguments_json", &json, volatile)?;
            let fingerprint = arguments.fingerprint();
            Ok((Some(arguments), fingerprint))
        }
        Some(pb::begin_request::Effect::Fingerprint(hex)) => {
            Ok((None, Fingerprint::parse_hex("fingerprint", &hex)?))
        }
        None => Err(Invalid::new(
            "effect",
            "one of arguments_json or fingerprint is required",
        )),
    }
}

/// The operation id a Begin names: given, encoded from intent parts (once-id-v1), or derived
/// from the tool and its canonical arguments.
fn identity(
    identity: Option<pb::begin_request::Identity>,
    tool: &str,
    arguments: Option<&CanonicalArguments>,
) -> Result<OperationId, Invalid> {
    match identity {
        Some(pb::begin_request::Identity::OperationId(id)) => {
            OperationId::parse("operation_id", &id)
        }
        Some(pb::begin_request::Identity::Intent(intent)) => {
            let parts = intent
                .parts
                .into_iter()
                .enumerate()
                .map(|(i, part)| match part.kind {
                    Some(pb::intent_part::Kind::Text(s)) => Ok(IntentPart::Text(s)),
                    Some(pb::intent_part::Kind::Integer(n)) => Ok(IntentPart::Integer(n)),
                    Some(pb::intent_part::Kind::Number(x)) => Ok(IntentPart::Number(x)),
                    None => Err(Invalid::new(
                        format!("intent.parts[{i}]"),
                        "one of text, integer or number is required",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let id = once_id::operation_id(&parts).map_err(|e| e.within("intent"))?;
            OperationId::parse("intent", &id)
        }
        Some(pb::begin_request::Identity::Derived(_)) => match arguments {
            Some(arguments) => arguments
                .derived_id(tool)
                .map_err(|e| Invalid::new("derived", e.message)),
            None => Err(Invalid::new(
                "arguments_json",
                "is required to derive the operation id",
            )),
        },
        None => Err(Invalid::new(
            "identity",
            "one of operation_id, intent or derived is required",
        )),
    }
}

fn check_attempt_id(attempt_id: &str) -> Result<(), Invalid> {
    check_name("attempt_id", attempt_id, MAX_NAME_BYTES)?;
    if attempt_id.len() < MIN_ATTEMPT_ID_BYTES {
        return Err(Invalid::new(
            "attempt_id",
            format!(
                "must be at least {MIN_ATTEMPT_ID_BYTES} bytes, chosen at random once per attempt (a UUID); \
                 a JSON-RPC request id is unique only within its session"
            ),
        ));
    }
    Ok(())
}

fn attempt_context(context: pb::AttemptContext) -> Result<AttemptContext, Invalid> {
    Ok(AttemptContext {
        client_name: optional_name(
            "context.client_name",
            context.client_name,
            MAX_CONTEXT_BYTES,
        )?,
        session_id: optional_name("context.session_id", context.session_id, MAX_CONTEXT_BYTES)?,
        request_id: optional_name("context.request_id", context.request_id, MAX_CONTEXT_BYTES)?,
    })
}

/// How long a settled operation is kept: the default of its kind of id, or more if asked.
fn retention(
    asked: Option<Duration>,
    operation_id: &OperationId,
    limits: &Limits,
) -> Result<i64, Invalid> {
    let default = if operation_id.is_derived_hash() {
        limits.retention_derived_ms
    } else {
        limits.retention_explicit_ms
    };
    Ok(match asked {
        None => default,
        Some(d) => bounded("retention", d, 0, limits.max_retention_ms)?.max(default),
    })
}

/// A report as the wire carries it. Confirm, ReportAbsent and ReportUnknown are three
/// messages of one report, and take one path: [`report`].
pub trait ReportRequest {
    /// The operation id and fencing token it names, and what it says, not yet checked.
    fn into_parts(self) -> (String, u64, Report);
}

impl ReportRequest for pb::ConfirmRequest {
    fn into_parts(self) -> (String, u64, Report) {
        let report = Report::Confirm {
            result: self.result,
            provider_ref: Some(self.provider_ref),
        };
        (self.operation_id, self.fencing_token, report)
    }
}

impl ReportRequest for pb::ReportAbsentRequest {
    fn into_parts(self) -> (String, u64, Report) {
        let report = Report::Absent {
            reason: self.reason,
        };
        (self.operation_id, self.fencing_token, report)
    }
}

impl ReportRequest for pb::ReportUnknownRequest {
    fn into_parts(self) -> (String, u64, Report) {
        let report = Report::Unknown {
            reason: self.reason,
        };
        (self.operation_id, self.fencing_token, report)
    }
}

/// A validated report: the operation it is about and what the attempt says.
pub fn report(
    req: impl ReportRequest,
    holder: Holder,
    limits: &Limits,
) -> Result<(OperationId, ReportCommand), Invalid> {
    let (operation_id, token, report) = req.into_parts();
    let id = OperationId::parse("operation_id", &operation_id)?;
    let fencing_token = fencing_token(token)?;
    let report = match report {
        Report::Confirm {
            result,
            provider_ref,
        } => {
            check_result("result", &result, limits)?;
            let provider_ref = optional_name(
                "provider_ref",
                provider_ref.unwrap_or_default(),
                MAX_PROVIDER_REF_BYTES,
            )?;
            Report::Confirm {
                result,
                provider_ref,
            }
        }
        said => {
            if let Report::Absent { reason } | Report::Unknown { reason } = &said {
                check_text("reason", reason, limits.max_reason_bytes)?;
            }
            said
        }
    };
    Ok((
        id,
        ReportCommand {
            fencing_token,
            holder,
            report,
        },
    ))
}

/// A validated heartbeat: the operation, and the attempt's lease to extend.
pub fn heartbeat(
    req: pb::HeartbeatRequest,
    holder: Holder,
    limits: &Limits,
) -> Result<(OperationId, HeartbeatCommand), Invalid> {
    let id = OperationId::parse("operation_id", &req.operation_id)?;
    let fencing_token = fencing_token(req.fencing_token)?;
    let ttl_ms = lease_ttl("lease_ttl", req.lease_ttl, limits)?;
    Ok((
        id,
        HeartbeatCommand {
            fencing_token,
            holder,
            ttl_ms,
        },
    ))
}

pub fn get_operation(req: pb::GetOperationRequest) -> Result<OperationId, Invalid> {
    OperationId::parse("operation_id", &req.operation_id)
}

/// The operation to look up now, and the name of the operator who asks (empty: not given).
pub fn reconcile(req: pb::ReconcileRequest) -> Result<(OperationId, String), Invalid> {
    let id = OperationId::parse("operation_id", &req.operation_id)?;
    if !req.operator.is_empty() {
        check_name("operator", &req.operator, MAX_NAME_BYTES)?;
    }
    Ok((id, req.operator))
}

pub fn list_operations(req: pb::ListOperationsRequest) -> Result<ListQuery, Invalid> {
    let states = states_from_pb(&req.states)?;
    let tool = optional_name("tool", req.tool, MAX_TOOL_BYTES)?;
    let provider = optional_name("provider", req.provider, MAX_NAME_BYTES)?;
    let older_than_ms = req
        .older_than
        .map(|d| bounded("older_than", d, 0, i64::MAX / 2))
        .transpose()?;
    if req.page_size > MAX_PAGE_SIZE {
        return Err(Invalid::new(
            "page_size",
            format!("must be at most {MAX_PAGE_SIZE}"),
        ));
    }
    let page_size = if req.page_size == 0 {
        DEFAULT_PAGE_SIZE
    } else {
        req.page_size
    };
    let after = if req.page_token.is_empty() {
        None
    } else {
        Some(
            decode_page_token(&req.page_token)
                .ok_or_else(|| Invalid::new("page_token", "is not a token this server issued"))?,
        )
    };
    Ok(ListQuery {
        states,
        tool,
        provider,
        older_than_ms,
        page_size,
        after,
    })
}

/// A read that may name the tenant whose operations it reads: empty for the caller's own.
pub trait TenantRead {
    fn tenant(&self) -> &str;

    /// Whether it reads every tenant's operations instead.
    fn all_tenants(&self) -> bool {
        false
    }
}

macro_rules! tenant_read {
    ($($message:ty),*) => {
        $(impl TenantRead for $message {
            fn tenant(&self) -> &str {
                &self.tenant
            }
        })*
    };
}

tenant_read!(
    pb::GetOperationRequest,
    pb::GetForensicsRequest,
    pb::VerifyHistoryRequest,
    pb::GetReceiptRequest,
    pb::GetHistoryHeadRequest
);

/// A read that may name the tenant whose operations it reads, or cover every tenant.
macro_rules! scoped_read {
    ($($message:ty),*) => {
        $(impl TenantRead for $message {
            fn tenant(&self) -> &str {
                &self.tenant
            }

            fn all_tenants(&self) -> bool {
                self.all_tenants
            }
        })*
    };
}

scoped_read!(
    pb::ListOperationsRequest,
    pb::WatchOperationsRequest,
    pb::GetStatsRequest
);

/// Where a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchStart {
    /// After this event sequence.
    After(i64),
    /// With the events committed from now on.
    Now,
}

/// A validated WatchOperations request: where it starts and which events it wants.
pub fn watch_operations(
    req: pb::WatchOperationsRequest,
) -> Result<(WatchStart, WatchFilter), Invalid> {
    if req.after_sequence < 0 {
        return Err(Invalid::new("after_sequence", "must not be negative"));
    }
    let start = if req.from_now {
        if req.after_sequence != 0 {
            return Err(Invalid::new(
                "from_now",
                "give after_sequence or from_now, not both",
            ));
        }
        WatchStart::Now
    } else {
        WatchStart::After(req.after_sequence)
    };
    let states = states_from_pb(&req.states)?;
    if req.kinds.len() > EventKind::ALL.len() {
        return Err(Invalid::new(
            "kinds",
            format!(
                "names {} kinds; there are {}",
                req.kinds.len(),
                EventKind::ALL.len()
            ),
        ));
    }
    let mut kinds = Vec::with_capacity(req.kinds.len());
    for (i, name) in req.kinds.iter().enumerate() {
        let field = format!("kinds[{i}]");
        let kind = EventKind::parse(name).ok_or_else(|| {
            let known: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
            Invalid::new(
                &field,
                format!("{name:?} is not an event kind; one of {}", known.join(", ")),
            )
        })?;
        if kinds.contains(&kind) {
            return Err(Invalid::new(field, format!("{name} is named twice")));
        }
        kinds.push(kind);
    }
    let tool = optional_name("tool", req.tool, MAX_TOOL_BYTES)?;
    Ok((
        start,
        WatchFilter {
            states,
            kinds,
            tool,
        },
    ))
}

/// A list of states, each named once.
pub(crate) fn states_from_pb(raw: &[i32]) -> Result<Vec<State>, Invalid> {
    if raw.len() > MAX_LISTED_STATES {
        return Err(Invalid::new(
            "states",
            format!(
                "names {} states; there are {MAX_LISTED_STATES}, each named at most once",
                raw.len()
            ),
        ));
    }
    let mut states = Vec::with_capacity(raw.len());
    for (i, raw) in raw.iter().enumerate() {
        let field = format!("states[{i}]");
        let state = state_from_pb(&field, *raw)?;
        if states.contains(&state) {
            return Err(Invalid::new(field, format!("{state} is named twice")));
        }
        states.push(state);
    }
    Ok(states)
}

/// A validated GetForensics: the tool, and how far back in milliseconds (at most `max_ms`).
pub fn get_forensics(
    req: pb::GetForensicsRequest,
    max_ms: i64,
) -> Result<(Option<String>, i64), Invalid> {
    let tool = optional_name("tool", req.tool, MAX_TOOL_BYTES)?;
    let since = match req.since {
        None => 3_600_000,
        Some(d) => bounded("since", d, 1, max_ms)?,
    };
    Ok((tool, since))
}

/// A validated GetStats: its window in milliseconds (at most `max_ms`).
pub fn get_stats(req: pb::GetStatsRequest, max_ms: i64) -> Result<i64, Invalid> {
    match req.window {
        None => Ok(3_600_000),
        Some(d) => bounded("window", d, 1, max_ms),
    }
}

/// A validated operator resolution, with the operator's name for the recorded actor.
pub fn resolve(
    req: pb::ResolveRequest,
    limits: &Limits,
) -> Result<(OperationId, ResolveCommand), Invalid> {
    let id = OperationId::parse("operation_id", &req.operation_id)?;
    let provider_ref = optional_name("provider_ref", req.provider_ref, MAX_PROVIDER_REF_BYTES)?;
    let resolution = match state_from_pb("outcome", req.outcome)? {
        State::Confirmed => {
            check_result("result", &req.result, limits)?;
            Resolution::Confirmed {
                result: req.result,
                provider_ref,
            }
        }
        State::Absent => {
            if !req.result.is_empty() || provider_ref.is_some() {
                return Err(Invalid::new(
                    "result",
                    "a result or provider_ref only goes with a CONFIRMED outcome",
                ));
            }
            Resolution::Absent
        }
        other => {
            return Err(Invalid::new(
                "outcome",
                format!("must be CONFIRMED or ABSENT, not {other}"),
            ))
        }
    };
    if req.reason.trim().is_empty() {
        return Err(Invalid::new(
            "reason",
            "is mandatory: say why you believe this outcome",
        ));
    }
    check_text("reason", &req.reason, limits.max_reason_bytes)?;
    check_name("operator", &req.operator, MAX_NAME_BYTES)?;
    check_name("resolution_id", &req.resolution_id, MAX_NAME_BYTES)?;
    if req.fencing_token == 0 {
        return Err(Invalid::new(
            "fencing_token",
            "is mandatory: the fencing token of the attempt you examined (GetOperation shows the \
             latest); it names the attempt and the life of the operation",
        ));
    }
    Ok((
        id,
        ResolveCommand {
            resolution,
            reason: req.reason,
            actor: Actor::Operator(req.operator.clone()),
            resolution_id: req.resolution_id,
            fencing_token: FencingToken(req.fencing_token),
            attempt: (req.attempt != 0).then_some(req.attempt),
        },
    ))
}

pub(crate) fn fencing_token(token: u64) -> Result<FencingToken, Invalid> {
    if token == 0 {
        return Err(Invalid::new(
            "fencing_token",
            "must be the token of a granted attempt",
        ));
    }
    Ok(FencingToken(token))
}

pub(crate) fn check_result(field: &str, result: &[u8], limits: &Limits) -> Result<(), Invalid> {
    if result.len() > limits.max_result_bytes {
        return Err(Invalid::new(
            field,
            format!(
                "is {} bytes, over the {}-byte limit: store the result elsewhere and confirm with a reference to it",
                result.len(),
                limits.max_result_bytes
            ),
        )
        .with_code("RESULT_TOO_LARGE"));
    }
    Ok(())
}

/// `None` for an empty field (proto3's "not set"), else the value once `check` passed it.
fn unless_empty(
    value: String,
    check: impl FnOnce(&str) -> Result<(), Invalid>,
) -> Result<Option<String>, Invalid> {
    if value.is_empty() {
        return Ok(None);
    }
    check(&value)?;
    Ok(Some(value))
}

pub(crate) fn optional_name(
    field: &str,
    value: String,
    max: usize,
) -> Result<Option<String>, Invalid> {
    unless_empty(value, |value| check_name(field, value, max))
}

pub(crate) fn json_object(
    field: &str,
    value: String,
    max: usize,
) -> Result<Option<String>, Invalid> {
    unless_empty(value, |value| {
        if value.len() > max {
            return Err(Invalid::new(
                field,
                format!("must be at most {max} bytes, got {}", value.len()),
            ));
        }
        let parsed: serde_json::Value = serde_json::from_str(value)
            .map_err(|e| Invalid::new(field, format!("invalid JSON: {e}")))?;
        match parsed.is_object() {
            true => Ok(()),
            false => Err(Invalid::new(field, "must be a JSON object")),
        }
    })
}

pub(crate) fn lease_ttl(
    field: &str,
    value: Option<Duration>,
    limits: &Limits,
) -> Result<i64, Invalid> {
    match value {
        None => Ok(limits.default_lease_ms),
        Some(d) => bounded(field, d, limits.min_lease_ms, limits.max_lease_ms),
    }
}

/// Converts a duration to milliseconds, refusing malformed ones and those outside `[min, max]`.
pub(crate) fn bounded(field: &str, d: Duration, min_ms: i64, max_ms: i64) -> Result<i64, Invalid> {
    let well_formed = (0..1_000_000_000).contains(&d.nanos) && d.seconds >= 0;
    if !well_formed {
        return Err(Invalid::new(field, "must be a non-negative duration"));
    }
    let ms = d
        .seconds
        .checked_mul(1000)
        .and_then(|ms| ms.checked_add(i64::from(d.nanos / 1_000_000)))
        .ok_or_else(|| Invalid::new(field, "is too long"))?;
    if ms < min_ms || ms > max_ms {
        return Err(Invalid::new(
            field,
            format!("must be between {min_ms} ms and {max_ms} ms, got {ms} ms"),
        ));
    }
    Ok(ms)
}

pub(crate) fn state_from_pb(field: &str, raw: i32) -> Result<State, Invalid> {
    match pb::OperationState::try_from(raw) {
        Ok(pb::OperationState::Absent) => Ok(State::Absent),
        Ok(pb::OperationState::InFlight) => Ok(State::InFlight),
        Ok(pb::OperationState::Confirmed) => Ok(State::Confirmed),
        Ok(pb::OperationState::Unknown) => Ok(State::Unknown),
        Ok(pb::OperationState::Unspecified) => Err(Invalid::new(field, "must name a state")),
        Err(_) => Err(Invalid::new(
            field,
            format!("{raw} is not an OperationState"),
        )),
    }
}

pub(crate) fn decode_page_token(token: &str) -> Option<PageEnd> {
    let raw = hex::decode(token).ok().filter(|raw| raw.len() > 8)?;
    let created_at = i64::from_be_bytes(raw[..8].try_into().ok()?);
    let rest = String::from_utf8(raw[8..].to_vec()).ok()?;
    let (tenant, id) = rest.split_once('\0').unwrap_or(("", &rest));
    if !tenant.is_empty() {
        once_core::access::check_tenant_name(tenant).ok()?;
    }
    OperationId::parse("page_token", id).ok()?;
    Some(PageEnd {
        created_at,
        tenant: tenant.to_owned(),
        operation_id: id.to_owned(),
    })
}

/// The most positions one RecoverOperations call reports.
pub const MAX_RECOVERED: usize = 1_000;

/// The sealed positions a RecoverOperations call reports, as sent (the ledger opens them).
pub fn recover_positions(req: pb::RecoverOperationsRequest) -> Result<Vec<String>, Invalid> {
    if req.positions.len() > MAX_RECOVERED {
        return Err(Invalid::new(
            "positions",
            format!("holds more than {MAX_RECOVERED}: report them in several calls"),
        ));
    }
    for (i, position) in req.positions.iter().enumerate() {
        if position.is_empty() || position.len() > continuity::MAX_SEALED {
            return Err(Invalid::new(
                format!("positions[{i}]"),
                format!("is empty or longer than {} bytes", continuity::MAX_SEALED),
            ));
        }
    }
    Ok(req.positions)
}
