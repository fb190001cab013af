//! The once-ledger domain core.
//!
//! This crate owns the rules that make an operation run at most once: how an operation is
//! identified ([`identity`], [`jcs`], [`once_id`]), and how its state moves when an attempt
//! begins, reports, or is resolved ([`machine`]). It does no IO: it knows nothing of gRPC, SQL or
//! where the current time comes from. Callers hand it the stored [`Operation`], a command and
//! `now`, and get back a decision plus the [`Plan`] of writes that must commit together.

pub mod access;
pub mod chain;
#[cfg(feature = "clap")]
pub mod cli;
pub mod continuity;
pub mod error;
pub mod forensics;
pub mod identity;
pub mod jcs;
pub mod limits;
pub mod local;
pub mod machine;
pub mod model;
pub mod once_id;
pub mod receipt;
pub mod reconcile;
pub mod stats;

#[cfg(test)]
mod fuzz_tests;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
#[cfg(test)]
mod simulation_tests;

pub use error::{Field, Invalid};
pub use limits::Limits;
pub use machine::{Plan, Rejection};
pub use model::*;
