//! What a side effect produced, how it failed, and the report an attempt makes of it.

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
