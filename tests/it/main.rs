//! The once-ledger integration suite: real `onced` servers on real sockets, over real SQLite
//! files and real PostgreSQL databases. Every scenario runs on both backends.

mod support;

mod client;
mod concurrency;
mod conformance;
mod decisions;
mod durability;
mod fakepay;
mod integrity;
mod invariants;
mod leases;
mod outage;
mod reconcile;
mod retention;
mod service;
mod validation;
