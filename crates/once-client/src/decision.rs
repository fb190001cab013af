//! What the ledger decides, what an effect produces, and what running one did.

use std::time::{Duration, SystemTime};

use crate::attempt::Attempt;

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
}

/// What a side effect produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    /// Stored by the ledger and replayed verbatim to every later caller.
    pub result: Vec<u8>,
    /// The provider's id for the effect (a refund id).
    pub provider_ref: Option<String>,
}

impl Effect {
    pub fn new(result: Vec<u8>) -> Self {
        Self {
            result,
            provider_ref: None,
        }
    }

    pub fn with_provider_ref(mut self, provider_ref: impl Into<String>) -> Self {
        self.provider_ref = Some(provider_ref.into());
        self
    }
}

/// How a side effect failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EffectError {
    /// The effect certainly did not happen (refused before anything changed): safe to retry.
    #[error("not performed: {0}")]
    NotPerformed(String),
    /// The effect may have happened: a timeout, a reset connection, a 5xx after sending.
    #[error("outcome unknown: {0}")]
    Ambiguous(String),
}

/// What an attempt tells the ledger about its effect: the one report, in three kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The effect happened; the ledger stores its result and replays it.
    Confirmed(Effect),
    /// The effect certainly did not happen; a later attempt may run.
    Absent { reason: String },
    /// Nobody can tell whether the effect happened.
    Unknown { reason: String },
}

impl From<&Result<Effect, EffectError>> for Report {
    fn from(performed: &Result<Effect, EffectError>) -> Self {
        match performed {
            Ok(effect) => Report::Confirmed(effect.clone()),
            Err(EffectError::NotPerformed(reason)) => Report::Absent {
                reason: reason.clone(),
            },
            Err(EffectError::Ambiguous(reason)) => Report::Unknown {
                reason: reason.clone(),
            },
        }
    }
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
