//! The one place domain and storage errors become gRPC statuses.
//!
//! Every status carries a `google.rpc.ErrorInfo` with a stable reason code clients branch on.
//! Database text never leaves the process: it is logged here, where the error is handled.
//!
//! It includes tonic's own refusal of an oversized request ([`too_large_layer`]:
//! RESOURCE_EXHAUSTED) and the refusals of access: UNAUTHENTICATED, PERMISSION_DENIED, and
//! RESOURCE_EXHAUSTED with a `RetryInfo`, `retry_after_ms` and a `retry-after` header.

use once_api::refusal::Refusal;
use once_core::{Invalid, Rejection};
use once_store::StoreError;
use tonic::{Code, Status};

use crate::reconciliation::Refused;

pub use once_api::ERROR_DOMAIN;

fn status(code: Code, reason: &str, message: String, metadata: Vec<(String, String)>) -> Status {
    metadata
        .into_iter()
        .fold(
            Refusal::new(code, reason, message),
            |refusal, (key, value)| refusal.with(key, value),
        )
        .into_status()
}

pub fn invalid(error: Invalid) -> Status {
    Refusal::new(Code::InvalidArgument, error.code, error.to_string())
        .with("field", error.field.clone())
        .bad_field(error.field.clone(), error.message.clone())
        .into_status()
}

pub fn store(error: StoreError) -> Status {
    match error {
        StoreError::NotFound => status(
            Code::NotFound,
            "OPERATION_NOT_FOUND",
            "no such operation".into(),
            vec![],
        ),
        StoreError::Rejected(rejection) => rejected(rejection),
        StoreError::Unavailable(source) => {
            tracing::warn!(error = %source, "database unavailable");
            status(
                Code::Unavailable,
                "STORE_UNAVAILABLE",
                "the ledger's database is unavailable; the call is safe to retry as it was sent (the same attempt id, fencing token or resolution id)".into(),
                vec![],
            )
        }
        StoreError::ReadOnly => {
            tracing::warn!("database is read-only");
            status(
                Code::Unavailable,
                "STORE_UNAVAILABLE",
                "the ledger's database does not accept writes (a standby or a demoted primary); nothing was changed and the call is safe to retry as it was sent".into(),
                vec![],
            )
        }
        StoreError::Duplicate => status(
            Code::Unavailable,
            "CONTENDED",
            "the operation is contended; retry the call".into(),
            vec![],
        ),
        StoreError::Internal(source) => {
            tracing::error!(error = %source, "database error");
            internal()
        }
        StoreError::Corrupt(what) => {
            tracing::error!(%what, "unreadable stored data");
            internal()
        }
    }
}

/// A fault of the ledger's own, already logged where it was handled; the caller learns nothing
/// of it.
pub fn internal() -> Status {
    status(Code::Internal, "INTERNAL", "internal error".into(), vec![])
}

/// Why an operator's Reconcile did not run.
pub fn refused(refused: Refused) -> Status {
    match refused {
        Refused::Store(error) => store(error),
        Refused::HeldForOperator => held_for_operator(),
        Refused::LookupInProgress => lookup_in_progress(),
        Refused::NoReconciler { provider, tenant } => no_reconciler(&provider, &tenant),
    }
}

/// The operation is held for an operator after a double execution: no lookup settles it.
fn held_for_operator() -> Status {
    status(
        Code::FailedPrecondition,
        "HELD_FOR_OPERATOR",
        "the operation may have been performed twice and is held for an operator: resolve it"
            .into(),
        vec![],
    )
}

/// Another lookup holds the operation right now.
fn lookup_in_progress() -> Status {
    status(
        Code::FailedPrecondition,
        "LOOKUP_IN_PROGRESS",
        "a lookup of this operation is running; its verdict will be in the operation's history"
            .into(),
        vec![],
    )
}

/// The replica already streams to as many watchers as it may.
/// A watch beyond the limit `flag` sets.
/// `whose` says whose streams are at the limit `flag` sets.
pub fn too_many_watchers(whose: &str, flag: &str) -> Status {
    status(
        Code::ResourceExhausted,
        "TOO_MANY_WATCHERS",
        format!("this replica streams {whose} to as many watchers as it may ({flag}); close one, or try another replica or later"),
        vec![],
    )
}

/// Retention deleted events after the sequence a watch resumes after.
pub fn events_expired(after: i64, through: i64) -> Status {
    status(
        Code::FailedPrecondition,
        "EVENTS_EXPIRED",
        format!(
            "retention has deleted events after sequence {after} (up to {through}): watch again \
             from 0 for every event kept, or from now"
        ),
        vec![("deleted_through".into(), through.to_string())],
    )
}

/// The replica could not read the newest events to start a watch from.
pub fn events_unreadable() -> Status {
    status(
        Code::Unavailable,
        "STORE_UNAVAILABLE",
        "the replica could not read the newest events; watch again".into(),
        vec![],
    )
}

/// The replica is shutting down in the middle of a watch: resume elsewhere after `cursor`.
pub fn shutting_down(cursor: i64) -> Status {
    status(
        Code::Unavailable,
        "SHUTTING_DOWN",
        format!("the replica is shutting down; watch again after sequence {cursor}"),
        vec![("after_sequence".into(), cursor.to_string())],
    )
}

/// A request over the size limit, as tonic reports it before any handler runs.
pub fn too_large(message: &str) -> Status {
    status(
        Code::ResourceExhausted,
        "REQUEST_TOO_LARGE",
        format!("{message}; store large results elsewhere and send a reference"),
        vec![],
    )
}

/// The operation names no reconciler that serves its tenant. The words are the same whether
/// or not a reconciler of that name serves other tenants: what others have configured is
/// theirs to know, not the caller's.
fn no_reconciler(provider: &str, tenant: &str) -> Status {
    let message = if provider.is_empty() {
        "the operation names no provider to reconcile with".to_owned()
    } else {
        format!(
            "no reconciler named {provider:?} serves tenant {tenant:?}: add {tenant} to it in onced's --config (a credential in api_key_env, or its tenants list)"
        )
    };
    status(
        Code::FailedPrecondition,
        "NO_RECONCILER",
        message,
        vec![("provider".into(), provider.to_owned())],
    )
}

fn rejected(rejection: Rejection) -> Status {
    let message = rejection.to_string();
    match rejection {
        Rejection::ExecutionRightLost {
            token,
            latest_attempt,
            latest_token,
        } => status(
            Code::FailedPrecondition,
            "EXECUTION_RIGHT_LOST",
            message,
            vec![
                ("fencing_token".into(), token.to_string()),
                ("latest_attempt".into(), latest_attempt.to_string()),
                ("latest_fencing_token".into(), latest_token.to_string()),
            ],
        ),
        Rejection::AttemptMismatch {
            examined,
            current,
            current_token,
        } => status(
            Code::FailedPrecondition,
            "ATTEMPT_MISMATCH",
            message,
            vec![
                ("examined_fencing_token".into(), examined.to_string()),
                ("current_attempt".into(), current.to_string()),
                ("current_fencing_token".into(), current_token.to_string()),
            ],
        ),
        Rejection::ResolutionIdReused { state, .. } => status(
            Code::FailedPrecondition,
            "RESOLUTION_ID_REUSED",
            message,
            vec![("state".into(), state.as_str().into())],
        ),
        Rejection::EffectProven => {
            status(Code::FailedPrecondition, "EFFECT_PROVEN", message, vec![])
        }
        Rejection::LeaseExpired { token } => status(
            Code::FailedPrecondition,
            "LEASE_EXPIRED",
            message,
            vec![("fencing_token".into(), token.to_string())],
        ),
        Rejection::AlreadySettled { state } => status(
            Code::FailedPrecondition,
            "ALREADY_SETTLED",
            message,
            vec![("state".into(), state.as_str().into())],
        ),
        Rejection::NotUnknown { state } => status(
            Code::FailedPrecondition,
            "NOT_UNKNOWN",
            message,
            vec![("state".into(), state.as_str().into())],
        ),
    }
}

/// Rewrites tonic's refusal of a request over the size limit — `OUT_OF_RANGE`, sent before any
/// handler runs — into `RESOURCE_EXHAUSTED` with an `ErrorInfo`, like every other refusal.
pub fn too_large_layer<B>(
) -> tower::util::MapResponseLayer<fn(http::Response<B>) -> http::Response<B>> {
    tower::util::MapResponseLayer::new(too_large_rewritten::<B>)
}

fn too_large_rewritten<B>(mut response: http::Response<B>) -> http::Response<B> {
    let refused = Status::from_header_map(response.headers()).filter(|s| {
        s.code() == Code::OutOfRange && s.message().contains("message length too large")
    });
    if let Some(refused) = refused {
        let (parts, _) = too_large(refused.message()).into_http::<()>().into_parts();
        for (name, value) in &parts.headers {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    response
}

/// The call carries no credential, or one the ledger does not accept.
pub fn unauthenticated(reason: &str, message: &str) -> Status {
    status(Code::Unauthenticated, reason, message.to_owned(), vec![])
}

/// A credential the ledger does not know: one answer whatever the reason, so a caller learns
/// nothing about which credentials exist.
pub fn unknown_credential() -> Status {
    unauthenticated(
        "CREDENTIALS_INVALID",
        "the credential is not one this ledger knows",
    )
}

/// The caller's credential holds none of the roles the call needs.
pub fn permission_denied(needed: &str, held: &str) -> Status {
    status(
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
        format!("this call needs a credential with the role {needed}; this one holds {held}"),
        vec![
            ("needed".into(), needed.to_owned()),
            ("held".into(), held.to_owned()),
        ],
    )
}

/// A tenant or credential limit is reached; the call changed nothing and may be sent again
/// after `retry_after`.
pub fn exhausted(reason: &str, message: String, retry_after: std::time::Duration) -> Status {
    let mut status = Refusal::new(Code::ResourceExhausted, reason, message)
        .with("retry_after_ms", retry_after.as_millis().to_string())
        .retry_after(retry_after)
        .into_status();
    if let Ok(value) = retry_after.as_secs().max(1).to_string().parse() {
        status.metadata_mut().insert("retry-after", value);
    }
    status
}

/// The tenant's executions are held: the ledger was found behind what a client saw (it was
/// restored to an earlier state), and no execution is granted until an operator accepts the loss.
pub fn ledger_behind(held: &once_core::continuity::Held) -> Status {
    let behind = &held.behind;
    status(
        Code::FailedPrecondition,
        "LEDGER_BEHIND",
        format!(
            "the ledger is behind what a client saw, so it was restored to an earlier state: {behind}. \
             Nothing was performed. It grants no execution to this tenant until an operator runs \
             `onced continuity accept --reason …`; replays, reads and reports go on. Report the \
             positions you kept (RecoverOperations) so that what it lost comes back UNKNOWN"
        ),
        vec![
            ("why".into(), behind.why.as_str().into()),
            ("client_epoch".into(), behind.client_epoch.to_string()),
            ("client_token".into(), behind.client_token.to_string()),
            ("operation_id".into(), behind.operation_id.to_string()),
            ("ledger_epoch".into(), behind.ledger_epoch.to_string()),
            ("ledger_token".into(), behind.ledger_token.to_string()),
            ("held_since_ms".into(), held.since.to_string()),
        ],
    )
}

/// A client showed a grant of an epoch whose loss an operator accepted, which the ledger has
/// no record of: refused until it reports what it kept; the tenant is not held.
pub fn grant_lost(behind: &once_core::continuity::Behind) -> Status {
    status(
        Code::FailedPrecondition,
        "LEDGER_BEHIND",
        format!(
            "the ledger has no record of operation {} granted fencing token {} before it was \
             restored (epoch {}, now {}). Nothing was performed. Report the positions you kept \
             (RecoverOperations) so that it comes back UNKNOWN; then call again",
            behind.operation_id, behind.client_token, behind.client_epoch, behind.ledger_epoch
        ),
        vec![
            ("why".into(), behind.why.as_str().into()),
            ("client_epoch".into(), behind.client_epoch.to_string()),
            ("client_token".into(), behind.client_token.to_string()),
            ("operation_id".into(), behind.operation_id.to_string()),
            ("ledger_epoch".into(), behind.ledger_epoch.to_string()),
        ],
    )
}

/// Why a receipt is not signed now.
pub fn unsigned(why: crate::signing::Unsigned) -> Status {
    use crate::signing::Unsigned;
    match why {
        Unsigned::NotSettled(state) => status(
            Code::FailedPrecondition,
            "NOT_SETTLED",
            format!(
                "the operation is {state}: a receipt is signed only for a CONFIRMED or ABSENT one"
            ),
            vec![("state".into(), state.as_str().into())],
        ),
        Unsigned::NotLinkedYet => status(
            Code::FailedPrecondition,
            "NOT_LINKED_YET",
            "the event that settled the operation is not in the history's chain yet; it is within about a second: ask again"
                .to_owned(),
            vec![],
        ),
        Unsigned::EventGone => status(
            Code::FailedPrecondition,
            "SETTLING_EVENT_GONE",
            "retention deleted the event that settled the operation: no receipt can be signed for it any more"
                .to_owned(),
            vec![],
        ),
        Unsigned::DoesNotMatch(problem) => status(
            Code::FailedPrecondition,
            "HISTORY_MISMATCH",
            format!(
                "what is stored does not match what the history's chain recorded ({problem}): no receipt is signed; run oncectl verify"
            ),
            vec![],
        ),
    }
}

/// A receipt asked of a ledger that has no signing key.
pub fn no_signing_key() -> Status {
    status(
        Code::FailedPrecondition,
        "NO_SIGNING_KEY",
        "this ledger signs no receipts: start it with --signing-key-file (see docs/evidence.md)"
            .to_owned(),
        vec![],
    )
}

/// Something an administrative call names does not exist.
pub fn not_found(reason: &str, message: &str) -> Status {
    status(Code::NotFound, reason, message.to_owned(), vec![])
}

/// What an administrative call would create exists already.
pub fn already_exists(reason: &str, message: &str) -> Status {
    status(Code::AlreadyExists, reason, message.to_owned(), vec![])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_refusal_is_the_same_bytes_every_time() {
        let first = permission_denied("operator", "reader");
        for _ in 0..64 {
            let again = permission_denied("operator", "reader");
            assert_eq!(
                again.details(),
                first.details(),
                "the details differ in their bytes"
            );
        }
    }
}
