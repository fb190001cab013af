//! What the background sweepers cost when there is nothing to do: over tables full of rows
//! that are not due (settled operations not expired, leases not ended, lookups not due, recent
//! events and duplicates), each sweep statement reads an index range that is empty — it never
//! reads, or filters, the rows themselves. Checked on the plans the databases choose for the
//! very statements the store sends.

use once_store::SweepBinds;
use serde_json::Value;
use sqlx::{Postgres, Sqlite};

use crate::support::*;

on_both_backends!(an_idle_sweep_reads_an_empty_index_range_not_the_table);

/// Rows of every swept table, none of them due for a sweep.
const ROWS: i64 = 20_000;

async fn fill_with_rows_not_due(db: &TestDb) {
    let far = 9_000_000_000_000_i64; // the year 2255
    let now = db.clock().await;
    let numbers =
        format!("WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {ROWS})");
    let fingerprint = match db.store {
        Store::Postgres => "'\\x00'::bytea",
        Store::Sqlite => "X'00'",
    };
    let operation = |state: &str, extra_columns: &str, extra_values: &str| {
        format!(
            "{numbers} INSERT INTO operations (tenant, operation_id, tool, fingerprint, state, source, \
             attempt, attempt_id, lease_started_at, lease_deadline, provider_key, retention_ms, \
             created_at, updated_at{extra_columns}) \
             SELECT 'default', '{state}-' || n, 'issue_refund', {fingerprint}, '{state}', 'attempt', 1, 'a', \
             {now}, {far}, 'k', 0, {now}, {now}{extra_values} FROM g"
        )
    };
    for sql in [
        operation("CONFIRMED", ", expires_at", &format!(", {far}")),
        operation("IN_FLIGHT", "", ""),
        operation(
            "UNKNOWN",
            ", provider, reconcile_next_at, unknown_since",
            &format!(", 'stripe', {far}, {now}"),
        ),
        format!(
            "{numbers} INSERT INTO events (tenant, operation_id, at, kind, actor) \
             SELECT 'default', 'CONFIRMED-' || n, {now}, 'CLAIMED', 'executor:default' FROM g"
        ),
        format!(
            "{numbers} INSERT INTO duplicates (tenant, operation_id, tool, at, decision, attempt_id, actor) \
             SELECT 'default', 'CONFIRMED-' || n, 'issue_refund', {now}, 'REPLAY', 'a', 'executor:default' FROM g"
        ),
    ] {
        assert_eq!(db.execute(&sql).await, ROWS as u64, "{sql}");
    }
    db.execute("ANALYZE").await;
}

/// A day: nothing recorded in this test is that old.
const AGE_MS: i64 = 86_400_000;
const LIMIT: i64 = 1_000;

async fn an_idle_sweep_reads_an_empty_index_range_not_the_table(store: Store) {
    let db = TestDb::new(store).await;
    // The schema, as a replica makes it.
    TestLedger::spawn(&db).await.stop().await;
    fill_with_rows_not_due(&db).await;
    match store {
        Store::Postgres => postgres_plans(&db).await,
        Store::Sqlite => sqlite_plans(&db).await,
    }
}

/// Runs each statement under EXPLAIN ANALYZE (in a transaction rolled back): no row may be
/// read and then filtered out, and no table scanned whole.
async fn postgres_plans(db: &TestDb) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    for (name, sql, binds) in once_store::sweep_statements::<Postgres>() {
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}");
        let query = sqlx::query_scalar::<_, Value>(&explain);
        let query = match binds {
            SweepBinds::Limit => query.bind(LIMIT),
            SweepBinds::AgeThenLimit => query.bind(AGE_MS).bind(LIMIT),
            SweepBinds::TenantReconcilerLimit => query.bind("default").bind("stripe").bind(LIMIT),
        };
        let plan = query.fetch_one(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        let mut nodes = Vec::new();
        walk(&plan[0]["Plan"], &mut nodes);
        let filtered: i64 = nodes
            .iter()
            .map(|n| n["Rows Removed by Filter"].as_i64().unwrap_or(0))
            .sum();
        let read: i64 = nodes
            .iter()
            .filter(|n| n["Node Type"].as_str().is_some_and(|t| t.contains("Scan")))
            .map(|n| n["Actual Rows"].as_i64().unwrap_or(0))
            .sum();
        let whole = nodes.iter().any(|n| n["Node Type"] == "Seq Scan");
        assert!(
            filtered == 0 && read == 0 && !whole,
            "the idle {name} sweep read {read} rows and filtered {filtered} (a full scan: {whole}): {plan:#}"
        );
    }
}

fn walk<'a>(node: &'a Value, into: &mut Vec<&'a Value>) {
    into.push(node);
    for child in node["Plans"].as_array().into_iter().flatten() {
        walk(child, into);
    }
}

/// SQLite's plan for each statement must search the tables it sweeps by an index, never scan
/// them.
async fn sqlite_plans(db: &TestDb) {
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    for (name, sql, binds) in once_store::sweep_statements::<Sqlite>() {
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let query = sqlx::query_as::<_, (i64, i64, i64, String)>(&explain);
        let query = match binds {
            SweepBinds::Limit => query.bind(LIMIT),
            SweepBinds::AgeThenLimit => query.bind(AGE_MS).bind(LIMIT),
            SweepBinds::TenantReconcilerLimit => query.bind("default").bind("stripe").bind(LIMIT),
        };
        let plan: Vec<String> = query
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|(_, _, _, detail)| detail)
            .collect();
        let scans: Vec<&String> = plan
            .iter()
            .filter(|step| step.starts_with("SCAN") && *step != "SCAN CONSTANT ROW")
            .collect();
        assert!(
            scans.is_empty(),
            "the idle {name} sweep scans a table: {plan:#?}"
        );
    }
}
