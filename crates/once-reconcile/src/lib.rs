//! Reconcilers: code that looks up provider truth so an UNKNOWN operation can be settled
//! without waiting for a human.
//!
//! A reconciler implements [`Reconciler`]: it declares its provider's [`Capabilities`] and,
//! given an operation ([`LookupRequest`]), returns a [`Verdict`] — confirmed (with the provider's
//! reference, the result to replay and sanitised evidence), absent (with evidence), or unknown
//! (with why). It never decides what the verdict allows: the ledger does, from the declared
//! capabilities (see `once_core::reconcile`). Timeouts, permission errors, rate limits, partial
//! pages and ambiguous matches are `Unknown`, never `Absent`.
//!
//! Built in: [`stripe::StripeReconciler`] (a Stripe-like refunds API) and
//! [`http::HttpReconciler`] (a generic lookup configured in TOML). Reconcilers are configured
//! in the TOML file given to `onced --config` ([`config`]).

pub mod config;
pub mod dashboard;
pub mod grpc;
pub mod http;
pub mod sql;
pub mod stripe;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

pub use once_core::reconcile::{Backoff, Capabilities, Escalation, LookupPolicy, Verdict};
use serde_json::Value;

/// The operation a reconciler is asked about.
#[derive(Debug, Clone, PartialEq)]
pub struct LookupRequest {
    /// The tenant the operation belongs to; a reconciler only ever gets its own tenants'.
    pub tenant: String,
    pub operation_id: String,
    pub tool: String,
    /// The key the executor passed to the provider's idempotency mechanism. It names this life
    /// of the operation: match the effect by it, never by the operation id, which every life of
    /// the operation (and other tenants) may share.
    pub provider_key: String,
    /// What the executor said would help find the effect (e.g. `{"payment_intent": "pi_1"}`).
    pub lookup_hints: Value,
    /// The latest attempt and when its lease began (milliseconds since the Unix epoch).
    pub attempt: u32,
    pub fencing_token: u64,
    pub attempt_started_at_ms: i64,
}

/// A provider lookup. Implementations must be cheap to call concurrently.
#[async_trait::async_trait]
pub trait Reconciler: Send + Sync + Debug {
    /// What the provider promises; the ledger decides what a verdict allows from this.
    fn capabilities(&self) -> Capabilities;

    /// Looks the operation up at the provider.
    async fn lookup(&self, request: &LookupRequest) -> Verdict;
}

/// A configured reconciler: the plugin, how its lookups are spaced and escalated, and its
/// lookup deadline.
#[derive(Debug, Clone)]
pub struct Registered {
    pub name: String,
    pub reconciler: Arc<dyn Reconciler>,
    pub backoff: Backoff,
    pub escalation: Escalation,
    pub timeout: Duration,
    /// The link template to an operation in the provider's dashboard, if configured.
    pub dashboard: Option<dashboard::Dashboard>,
}

impl Registered {
    /// The ledger's policy for this reconciler's verdicts, from the capabilities it declares now;
    /// a result it finds is held to `max_result_bytes`, as a Confirm's is.
    pub fn policy(&self, max_result_bytes: usize) -> LookupPolicy {
        LookupPolicy {
            name: self.name.clone(),
            capabilities: self.reconciler.capabilities(),
            backoff: self.backoff,
            escalation: self.escalation,
            max_result_bytes,
        }
    }

    /// Runs one lookup within the deadline; running out of time is `Unknown`.
    pub async fn lookup(&self, request: &LookupRequest) -> Verdict {
        use tracing::Instrument as _;
        let span = tracing::info_span!(
            "lookup",
            otel.name = format!("reconcile {}", self.name),
            once.reconciler = %self.name,
            once.operation_id = %request.operation_id,
            once.verdict = tracing::field::Empty,
        );
        let looked_up = tokio::time::timeout(self.timeout, self.reconciler.lookup(request))
            .instrument(span.clone())
            .await;
        let verdict = match looked_up {
            Ok(verdict) => verdict,
            Err(_) => Verdict::Unknown {
                why: format!("the lookup took longer than {:?}", self.timeout),
            },
        };
        span.record("once.verdict", verdict.name());
        verdict
    }
}

/// The reconcilers of one ledger, by the tenant they serve and their name (the `provider` an
/// operation names). Each tenant's reconciler holds that tenant's credential only.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    reconcilers: HashMap<(String, String), Registered>,
}

impl Registry {
    /// Registers a reconciler for one tenant.
    pub fn insert(&mut self, tenant: &str, registered: Registered) {
        self.reconcilers
            .insert((tenant.to_owned(), registered.name.clone()), registered);
    }

    /// The reconciler named `name` that serves `tenant`.
    pub fn get(&self, tenant: &str, name: &str) -> Option<&Registered> {
        self.reconcilers.get(&(tenant.to_owned(), name.to_owned()))
    }

    pub fn is_empty(&self) -> bool {
        self.reconcilers.is_empty()
    }

    /// The tenants the reconciler `name` serves, in order.
    pub fn tenants_of(&self, name: &str) -> Vec<&str> {
        let mut tenants: Vec<&str> = self
            .names()
            .filter(|(_, n)| *n == name)
            .map(|(tenant, _)| tenant)
            .collect();
        tenants.sort_unstable();
        tenants
    }

    /// Every (tenant, reconciler name) served.
    pub fn names(&self) -> impl Iterator<Item = (&str, &str)> {
        self.reconcilers
            .keys()
            .map(|(tenant, name)| (tenant.as_str(), name.as_str()))
    }
}
