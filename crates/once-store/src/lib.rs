//! Durable storage for once-ledger.
//!
//! [`Backend`] is what the [`Ledger`] needs of storage: a handful of transactional primitives
//! (lock an operation and read the clock, apply a [`once_core::Plan`], commit) plus the queries
//! of the read API and the sweepers. [`Store`] implements it once, in SQL that SQLite and
//! PostgreSQL share; a [`Dialect`] is what differs between them (the clock expression, row
//! locking, the token counter, how a write transaction starts, connection set-up). So both
//! databases share every rule and every query.
//!
//! Invariants kept here:
//! - a transition and its event commit in one transaction, or neither does;
//! - no decision is returned before the writes that make it true have committed (alone, or in
//!   a batch sharing one commit: [`writer`]);
//! - the lease clock is the database's own in PostgreSQL, so replicas with skewed clocks agree.

mod backend;
mod dialect;
mod error;
mod ledger;
pub mod postgres;
mod rows;
pub mod sqlite;
mod store;
pub mod watch;
pub mod writer;

pub use backend::{
    Backend, Chain, Checked, Continuity, CredentialChanges, Credentials, Decision, Events,
    Forensics, PoolUse, Probe, Sweeps, Unlocked, Verification, Written,
};
pub use dialect::Dialect;
pub use error::StoreError;
pub use ledger::{Ledger, Observer, EXPLAINED_DUPLICATES};
pub use postgres::PgBackend;
pub use sqlite::SqliteBackend;
pub use store::Store;
pub use watch::{Announcements, Frontier, Watermark};

#[cfg(test)]
mod tests;
