//! What the ledger decides, what an effect produces, and what running one did.

use std::time::{Duration, SystemTime};

use crate::attempt::Attempt;
use crate::effect::{Effect, EffectError};

/// What the ledger decided.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one decision per call; boxing buys nothing"
)]
pub enum Decision {
    /// Perform the effect now, once, and report through the attempt.
    Execute(Attempt),
    Replay(Replay),
    InProgress(InProgress),
    Unknown(Unknown),
    Conflict(Conflict),
}

/// Another attempt holds the lease; do not perform the effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InProgress {
    pub operation_id: String,
    pub retry_after: Duration,
    /// Set when the same tool and arguments run under another id: that operation.
    pub blocking_operation_id: Option<String>,
}

/// The effect may have happened; do not perform it, and do not mint a new id for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unknown {
    pub operation_id: String,
    pub reason: String,
    /// Set when another operation with the same tool and arguments, UNKNOWN (or past its
    /// lease), blocks this one.
    pub blocking_operation_id: Option<String>,
}

/// The operation was already requested with different arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub operation_id: String,
    pub stored_fingerprint: String,
    pub requested_fingerprint: String,
}

/// A confirmed operation's original result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    pub operation_id: String,
    pub result: Vec<u8>,
    pub provider_ref: Option<String>,
    pub confirmed_at: SystemTime,
    /// The ledger's signed receipt, when the spec asked for one
    /// ([`crate::OperationSpec::with_receipt`]) and the ledger signs receipts: verify it with
    /// [`crate::Receipt::verify`].
    pub receipt: Option<String>,
}

/// What the side effect needs from the ledger.
#[derive(Debug, Clone)]
pub struct EffectContext {
    pub operation_id: String,
    /// Pass to the provider's idempotency mechanism (e.g. the `Idempotency-Key` header).
    pub provider_key: String,
    pub attempt: u32,
}

/// What [`crate::LedgerClient::run`] did.
#[derive(Debug)]
pub enum Outcome {
    /// The effect ran now and its result is confirmed.
    Executed {
        operation_id: String,
        effect: Effect,
    },
    /// The effect had already run; here is its original result.
    Replayed(Replay),
    /// The effect ran now and failed without effect; the ledger knows it is ABSENT.
    NotPerformed {
        operation_id: String,
        reason: String,
    },
    /// The effect ran now and nobody can tell whether it happened; the ledger knows it is
    /// UNKNOWN.
    Ambiguous {
        operation_id: String,
        reason: String,
    },
    InProgress(InProgress),
    Unknown(Unknown),
    Conflict(Conflict),
}

impl Outcome {
    /// What running the effect of `operation_id` did, once it ran.
    pub(crate) fn performed(operation_id: String, performed: Result<Effect, EffectError>) -> Self {
        match performed {
            Ok(effect) => Outcome::Executed {
                operation_id,
                effect,
            },
            Err(EffectError::NotPerformed(reason)) => Outcome::NotPerformed {
                operation_id,
                reason,
            },
            Err(EffectError::Ambiguous(reason)) => Outcome::Ambiguous {
                operation_id,
                reason,
            },
        }
    }
}
