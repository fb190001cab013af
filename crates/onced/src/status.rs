//! The one place domain and storage errors become gRPC statuses.
//!
//! Every status carries a `google.rpc.ErrorInfo` with a stable reason code clients branch on.
//! Database text never leaves the process: it is logged here, where the error is handled.

use once_core::{Invalid, Rejection};
use once_store::StoreError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The `ErrorInfo.domain` of every error this service returns.
pub const ERROR_DOMAIN: &str = "once.ledger.v1";

fn status(code: Code, reason: &str, message: String, metadata: Vec<(String, String)>) -> Status {
    let details = ErrorDetails::with_error_info(
        reason,
        ERROR_DOMAIN,
        metadata
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
    );
    Status::with_error_details(code, message, details)
}

pub fn invalid(error: Invalid) -> Status {
    let mut details = ErrorDetails::with_error_info(
        error.code,
        ERROR_DOMAIN,
        [("field".to_owned(), error.field.clone())]
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
    );
    details.add_bad_request_violation(error.field.clone(), error.message.clone());
    Status::with_error_details(Code::InvalidArgument, error.to_string(), details)
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
                "the ledger's database is unavailable; nothing was changed and the call is safe to retry".into(),
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
            status(Code::Internal, "INTERNAL", "internal error".into(), vec![])
        }
        StoreError::Corrupt(what) => {
            tracing::error!(%what, "unreadable stored data");
            status(Code::Internal, "INTERNAL", "internal error".into(), vec![])
        }
    }
}

/// The operation names no reconciler this ledger has.
pub fn no_reconciler(provider: &str) -> Status {
    let message = if provider.is_empty() {
        "the operation names no provider to reconcile with".to_owned()
    } else {
        format!("no reconciler named {provider:?} is configured")
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
        Rejection::ExecutionRightLost { token, latest } => status(
            Code::FailedPrecondition,
            "EXECUTION_RIGHT_LOST",
            message,
            vec![
                ("fencing_token".into(), token.to_string()),
                ("latest_attempt".into(), latest.to_string()),
            ],
        ),
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
