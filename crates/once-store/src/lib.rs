//! Durable storage for once-ledger.
//!
//! [`Backend`] is the one storage trait: a handful of transactional primitives (lock an
//! operation and read the clock, apply a [`once_core::Plan`], commit) plus the queries of the
//! read API and the sweepers. [`Ledger`] runs the domain state machine over any backend, so
//! SQLite and PostgreSQL share every rule and differ only in SQL dialect and locking.
//!
//! Invariants kept here:
//! - a transition and its event commit in one transaction, or neither does;
//! - no decision is returned before the writes that make it true have committed;
//! - the lease clock is the database's own in PostgreSQL, so replicas with skewed clocks agree.

mod backend;
mod error;
mod ledger;
pub mod postgres;
mod shared;
pub mod sqlite;

pub use backend::Backend;
pub use error::StoreError;
pub use ledger::Ledger;
pub use postgres::PgBackend;
pub use sqlite::SqliteBackend;
