//! The once-ledger client: what a service links to ask the ledger before a side effect and to
//! report after it.
//!
//! ```no_run
//! # async fn refund() -> Result<(), once_client::ClientError> {
//! use once_client::{EffectError, LedgerClient, OperationSpec, Outcome};
//!
//! let ledger = LedgerClient::connect(once_client::ClientConfig::new("http://127.0.0.1:50051"))?;
//! let args = serde_json::json!({"order_id": "order_4821", "amount_cents": 500});
//! let spec = OperationSpec::new("issue_refund", args).intent(["refund", "order_4821"]);
//! let outcome = ledger
//!     .run(&spec, |attempt| async move {
//!         // Call the provider with attempt.provider_key as its idempotency key.
//!         let _ = attempt.provider_key;
//!         Ok::<_, EffectError>(once_client::Effect::new(br#"{"refund":"re_1"}"#.to_vec()))
//!     })
//!     .await?;
//! match outcome {
//!     Outcome::Executed { .. } | Outcome::Replayed { .. } => {}
//!     _ => { /* in progress, unknown or conflict: do not retry */ }
//! }
//! # Ok(()) }
//! ```
//!
//! The crate speaks in its own types (decisions, outcomes, [`OperationView`]); the ledger's
//! protobuf messages stay inside it.
//!
//! Guarantees: a retried ledger RPC never creates a second attempt (Begin is retried with the
//! same attempt id, reports with the same fencing token); when the ledger cannot be reached the
//! effect is not performed ([`ClientError::Unreachable`]); an attempt that ends without a report
//! — dropped, cancelled, panicked — is reported UNKNOWN, never ABSENT.

mod attempt;
mod bulk;
#[cfg(feature = "cli")]
mod cli;
mod client;
mod config;
pub mod continuity;
mod decision;
mod effect;
mod error;
mod operator;
mod reach;
mod spec;
mod transport;
mod view;
mod wire;

#[cfg(feature = "local")]
pub mod local;
#[cfg(feature = "rmcp")]
pub mod mcp;

pub use attempt::Attempt;
pub use bulk::{Done, Selection, Target, BULK_LIMIT};
#[cfg(feature = "cli")]
pub use cli::{LedgerArgs, UnreadableFile};
pub use client::{LedgerClient, LEDGER_BEHIND};
pub use config::ClientConfig;
pub use continuity::Positions;
pub use decision::{Conflict, Decision, EffectContext, InProgress, Outcome, Replay, Unknown};
pub use effect::{Effect, EffectError, Report};
pub use error::ClientError;
pub use once_core::receipt::{PublicKey, Receipt, Refused as ReceiptRefused};
pub use once_core::{AttemptContext, State};
pub use operator::{ListFilter, Page, Reconciled, Resolution, Truth, Watch, WatchRequest, Watched};
pub use reach::{Cause, Unreachable};
pub use spec::{Identity, OperationSpec, META_IDEMPOTENCY_KEY};
pub use view::{
    AgesView, AttemptView, CallView, EventView, ForensicsView, HistoryHead, HistoryProblem,
    HistoryView, KeyInfo, LastVerification, OperationView, ReconcilerView, ServerInfo, SigningKeys,
    StatsView, WatchedEvent,
};
