//! The configurable bounds a request must fit in, and the defaults it inherits.

/// Defaults and limits applied to every request. Built once from configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Lease granted when a Begin names none.
    pub default_lease_ms: i64,
    /// Shortest lease a caller may ask for.
    pub min_lease_ms: i64,
    /// Longest lease a caller may ask for; longer effects heartbeat.
    pub max_lease_ms: i64,
    /// How long a settled operation with a derived (`:h:`) id is kept.
    pub retention_derived_ms: i64,
    /// How long a settled operation with an explicit or intent id is kept.
    pub retention_explicit_ms: i64,
    /// The most a caller may ask retention to be.
    pub max_retention_ms: i64,
    /// The longest a Begin may wait for an IN_PROGRESS operation to settle.
    pub max_wait_ms: i64,
    /// Largest stored result, in bytes.
    pub max_result_bytes: usize,
    /// Largest lookup hints document, in bytes.
    pub max_hints_bytes: usize,
    /// Largest reason text, in bytes.
    pub max_reason_bytes: usize,
}

pub const MINUTE_MS: i64 = 60_000;
pub const HOUR_MS: i64 = 60 * MINUTE_MS;
pub const DAY_MS: i64 = 24 * HOUR_MS;

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_lease_ms: 30_000,
            min_lease_ms: 100,
            max_lease_ms: HOUR_MS,
            retention_derived_ms: 10 * MINUTE_MS,
            retention_explicit_ms: DAY_MS,
            max_retention_ms: 30 * DAY_MS,
            max_wait_ms: 60_000,
            max_result_bytes: 64 * 1024,
            max_hints_bytes: 4 * 1024,
            max_reason_bytes: 1024,
        }
    }
}
