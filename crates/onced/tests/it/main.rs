//! The once-ledger integration suite: real `onced` servers on real sockets, over real SQLite
//! files and real PostgreSQL databases (the harness is `once-testkit`; waits scale with
//! `ONCE_TEST_PATIENCE`).
//!
//! Every scenario about what the ledger decides or stores runs on both backends
//! (`on_both_backends!`). These run once, on purpose:
//! - `outage`: PostgreSQL stopping, refusing connections, turning read-only, failing over;
//! - `service::health_and_reflection_are_served` (SQLite): nothing is stored;
//! - `reconcile::credentials_never_reach_logs_or_events` (SQLite): about what a reconciler
//!   sends and logs, not about the store;
//! - `reconcile::stripe_lookups_that_cannot_tell_are_unknown_never_absent` and `fakepay`: a
//!   reconciler and the fake provider alone, without a ledger;
//! - `tls::a_certificate_rotated_by_sighup_reaches_new_connections_while_old_ones_finish` and
//!   `tls::an_exposed_listener_needs_tls_and_credentials_or_insecure` (SQLite): about the
//!   listener, not the store;
//! - `telemetry::the_shipped_alerts_pass_promtool`: about the rules files, not the store.
//! - `local::a_connection_lost_during_commit_is_unknown_then_the_marker_tells` (PostgreSQL): a
//!   connection cut at its COMMIT, which SQLite, in process, has not;
//! - `receipts::where_the_signing_key_comes_from`: a SQLite ledger's default key file and a
//!   PostgreSQL ledger without one; both backends, each with what differs between them.
//!
//! The client's tests are `once-client`'s own (`cargo test -p once-client`), and the store's
//! conformance and plan suites `once-store`'s (`cargo test -p once-store`).

mod support;

mod access;
mod chain;
mod concurrency;
mod console;
mod continuity;
mod decisions;
mod durability;
mod fakepay;
mod forensics;
mod integrity;
mod invariants;
mod leases;
mod local;
mod outage;
mod receipts;
mod reconcile;
mod retention;
mod service;
mod startup;
mod stats;
mod telemetry;
mod tls;
mod validation;
mod watch;
