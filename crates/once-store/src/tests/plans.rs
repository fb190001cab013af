//! What the background sweepers cost when there is nothing to do: over tables full of rows
//! that are not due (settled operations not expired, leases not ended, lookups not due, recent
//! events and duplicates), each sweep statement reads an index range that is empty — it never
//! reads, or filters, the rows themselves. And what a call costs however many operations are
//! stored: each statement of the Begin and report path that looks a row up finds it by an
//! index, reading the one operation's rows. Checked on the plans the databases choose for the
//! very statements the store sends.

use crate::store::{CallBinds, SweepBinds};
use serde_json::Value;
use sqlx::{Postgres, Sqlite};

use once_testdb::*;

on_both_backends!(
    an_idle_sweep_reads_an_empty_index_range_not_the_table,
    a_call_reads_its_own_operation_by_an_index_whatever_is_stored,
    a_call_planned_over_empty_tables_reads_by_its_own_operation,
);

/// A value a statement is bound with.
#[derive(Debug, Clone, Copy)]
enum Bound {
    Text(&'static str),
    Int(i64),
    Bytes(&'static [u8]),
}

fn sweep_binds(binds: SweepBinds) -> Vec<Bound> {
    use Bound::*;
    match binds {
        SweepBinds::Limit => vec![Int(LIMIT)],
        SweepBinds::LimitThenAge => vec![Int(LIMIT), Int(AGE_MS)],
        SweepBinds::AgeThenLimit => vec![Int(AGE_MS), Int(LIMIT)],
        SweepBinds::TenantReconcilerLimit => vec![Text("default"), Text("stripe"), Int(LIMIT)],
    }
}

/// An operation among the stored ones, of an intent nothing else runs.
fn call_binds(binds: CallBinds) -> Vec<Bound> {
    use Bound::*;
    let (tenant, id) = (Text("default"), Text("CONFIRMED-12345"));
    match binds {
        CallBinds::Operation => vec![tenant, id],
        CallBinds::Intent => vec![tenant, Text("issue_refund"), Bytes(&[1]), id],
        CallBinds::Token => vec![tenant, id, Int(1_048_576)],
        CallBinds::DedupeKey => vec![tenant, id, Text("resolution:r-1")],
    }
}

/// Rows of every swept table, none of them due for a sweep (ABSENT ones past their retention,
/// but kept as tombstones).
const ROWS: i64 = 20_000;

async fn fill_with_rows_not_due(db: &TestDb) {
    let far = 9_000_000_000_000_i64; // the year 2255
    let now = db.clock().await;
    let numbers =
        format!("WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {ROWS})");
    let fingerprint = match db.store {
        Engine::Postgres => "'\\x00'::bytea",
        Engine::Sqlite => "X'00'",
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
        operation("ABSENT", ", expires_at", &format!(", {}", now - 1)),
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
            "{numbers} INSERT INTO attempts (tenant, operation_id, number, fencing_token, attempt_id, \
             started_at, lease_deadline, actor) \
             SELECT 'default', 'CONFIRMED-' || n, 1, n, 'a', {now}, {far}, 'executor:default' FROM g"
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

async fn an_idle_sweep_reads_an_empty_index_range_not_the_table(store: Engine) {
    let db = filled(store).await;
    let postgres = bound(crate::store::sweep_statements::<Postgres>(), sweep_binds);
    let sqlite = bound(crate::store::sweep_statements::<Sqlite>(), sweep_binds);
    check(&db, postgres, sqlite, 0).await;
}

async fn a_call_reads_its_own_operation_by_an_index_whatever_is_stored(store: Engine) {
    let db = filled(store).await;
    let postgres = bound(crate::store::call_statements::<Postgres>(), call_binds);
    let sqlite = bound(crate::store::call_statements::<Sqlite>(), call_binds);
    // The operation's row and its one event, at most.
    check(&db, postgres, sqlite, 2).await;
    if db.store == Engine::Postgres {
        guard_function_reads_an_index(&db).await;
    }
}

/// A database plans a statement from what it knows of the tables, and PostgreSQL may keep
/// the plan a connection made first for as long as the connection lives: a replica that starts
/// on a new database plans over empty tables. There every index with the tenant first looks as
/// cheap as the one keyed by the operation, and a plan that took the tenant's would read all of
/// the tenant's rows on every call once the tables fill. So over empty tables each call's
/// statement must still look its operation up by the operation's own keys; and no index a call
/// could take for a lookup by tenant and operation id may lead with the tenant alone.
async fn a_call_planned_over_empty_tables_reads_by_its_own_operation(store: Engine) {
    let db = TestDb::new(store).await;
    super::schema(&db).await;
    match db.store {
        Engine::Postgres => {
            let statements = bound(crate::store::call_statements::<Postgres>(), call_binds);
            postgres_lookups_by_operation(&db, statements).await;
            postgres_indexes_leading_with_the_tenant(&db).await;
        }
        Engine::Sqlite => {
            let statements = bound(crate::store::call_statements::<Sqlite>(), call_binds);
            sqlite_lookups_by_operation(&db, statements).await;
        }
    }
}

/// The indexes a lookup of one operation's rows may read in PostgreSQL: keyed by the operation.
const BY_OPERATION: [&str; 6] = [
    "operations_pkey",
    "operations_open_by_fingerprint",
    "operations_unknown_by_fingerprint",
    "attempts_pkey",
    "events_by_operation",
    "events_once",
];

async fn postgres_lookups_by_operation(db: &TestDb, statements: Vec<Statement>) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    for (name, sql, binds) in statements {
        let plan = postgres_generic_plan(&mut conn, &sql, &binds).await;
        let nodes = super::plan_nodes(&plan);
        // Each of these statements reads a table, so it reads some index (a seq scan fails).
        assert!(
            nodes.iter().any(|node| node["Index Name"].is_string()),
            "{name} reads no index: {plan:#}"
        );
        for node in nodes {
            if let Some(index) = node["Index Name"].as_str() {
                assert!(
                    BY_OPERATION.contains(&index),
                    "{name}, planned over empty tables, reads {index}: {plan:#}"
                );
            }
            assert_ne!(node["Node Type"], "Seq Scan", "{name}: {plan:#}");
        }
    }
}

/// Every index of a table keyed by operation whose first column is the tenant either has the
/// operation id next, or is partial: a lookup by tenant and operation id cannot take it.
async fn postgres_indexes_leading_with_the_tenant(db: &TestDb) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let open: Vec<(String, String)> = sqlx::query_as(
        "SELECT i.relname::TEXT, pg_get_indexdef(x.indexrelid) FROM pg_index x \
         JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid \
         WHERE t.relname IN ('operations', 'events', 'attempts', 'duplicates') \
         AND x.indpred IS NULL \
         AND (SELECT attname FROM pg_attribute WHERE attrelid = t.oid AND attnum = x.indkey[0]) = 'tenant' \
         AND (x.indnatts < 2 OR (SELECT attname FROM pg_attribute WHERE attrelid = t.oid \
              AND attnum = x.indkey[1]) <> 'operation_id')",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        open.is_empty(),
        "a lookup of one operation could read these: {open:#?}"
    );
}

/// SQLite: each table a statement searches, it searches by the operation id too (or the
/// intent, for the guard; the token counter, one row, by its key).
async fn sqlite_lookups_by_operation(db: &TestDb, statements: Vec<Statement>) {
    for (name, plan) in sqlite_explained(db, statements).await {
        let searches: Vec<&String> = plan.iter().filter(|s| s.starts_with("SEARCH")).collect();
        assert!(!searches.is_empty(), "{name} searches no table: {plan:#?}");
        for step in searches {
            assert!(
                step.contains("operation_id=?")
                    || step.contains("fingerprint=?")
                    || step == "SEARCH fencing_tokens USING INTEGER PRIMARY KEY (rowid=?)",
                "{name}, planned over empty tables: {plan:#?}"
            );
        }
    }
}

/// PostgreSQL's one-statement claim runs the fresh-id guard in `once_blocking`, whose query
/// has a plan of its own, not shown under the call's: it must read a few index pages, not the
/// table's (thousands of blocks here).
async fn guard_function_reads_an_index(db: &TestDb) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let table_blocks: i64 = sqlx::query_scalar(
        "SELECT pg_relation_size('operations') / current_setting('block_size')::BIGINT",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    // The first call in a session also compiles the function and reads the catalogs to plan
    // its query. Then run several times: PL/pgSQL plans its query for the values given at
    // first, then may keep a generic plan; both must read by an index.
    let warm: Value = sqlx::query_scalar(
        "SELECT to_json(once_blocking(42, 'default', 'issue_refund', '\\x01'::bytea, 'none'))",
    )
    .fetch_optional(&mut conn)
    .await
    .unwrap()
    .unwrap_or(Value::Null);
    assert_eq!(warm, Value::Null, "nothing blocks that intent");
    for run in 0..8 {
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        let plan: Value = sqlx::query_scalar(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) \
             SELECT * FROM once_blocking(42, $1, $2, $3, $4)",
        )
        .bind("default")
        .bind("issue_refund")
        .bind(&[1u8][..])
        .bind("CONFIRMED-12345")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        let top = &plan[0]["Plan"];
        let blocks = top["Shared Hit Blocks"].as_i64().unwrap_or(0)
            + top["Shared Read Blocks"].as_i64().unwrap_or(0);
        assert!(
            blocks <= 32 && table_blocks > 200,
            "run {run}: the guard read {blocks} blocks of a {table_blocks}-block table: {plan:#}"
        );
    }
}

/// A database with the schema, as a replica makes it, and rows of every table, none due.
async fn filled(store: Engine) -> TestDb {
    let db = TestDb::new(store).await;
    super::schema(&db).await;
    fill_with_rows_not_due(&db).await;
    db
}

type Statement = (&'static str, String, Vec<Bound>);

fn bound<B>(
    statements: Vec<(&'static str, String, B)>,
    binds: fn(B) -> Vec<Bound>,
) -> Vec<Statement> {
    statements
        .into_iter()
        .map(|(name, sql, how)| (name, sql, binds(how)))
        .collect()
}

/// Checks the plans of the statements of `db`'s database: at most `rows` rows read in
/// PostgreSQL, no table scanned in either.
async fn check(db: &TestDb, postgres: Vec<Statement>, sqlite: Vec<Statement>, rows: i64) {
    match db.store {
        Engine::Postgres => postgres_plans(db, postgres, rows).await,
        Engine::Sqlite => sqlite_plans(db, sqlite).await,
    }
}

/// Runs each statement under EXPLAIN ANALYZE (in a transaction rolled back): at most `rows`
/// rows may be read or read and filtered out, and no table is scanned whole.
/// Tables that hold one row, by their `CHECK (id = 1)`.
const ONE_ROW: [&str; 3] = ["chain_progress", "event_horizon", "credential_clock"];

async fn postgres_plans(db: &TestDb, statements: Vec<Statement>, rows: i64) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    for (name, sql, binds) in statements {
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}");
        let mut query = sqlx::query_scalar::<_, Value>(&explain);
        for bind in binds {
            query = match bind {
                Bound::Text(text) => query.bind(text),
                Bound::Int(n) => query.bind(n),
                Bound::Bytes(bytes) => query.bind(bytes),
            };
        }
        let plan = query.fetch_one(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        let nodes = super::plan_nodes(&plan);
        let filtered: i64 = nodes
            .iter()
            .map(|n| n["Rows Removed by Filter"].as_i64().unwrap_or(0))
            .sum();
        let read: i64 = nodes
            .iter()
            .filter(|n| n["Node Type"].as_str().is_some_and(|t| t.contains("Scan")))
            .map(|n| n["Actual Rows"].as_i64().unwrap_or(0))
            .sum();
        // A table of one row (the chain's progress) is read whole whatever the plan.
        let whole = nodes.iter().any(|n| {
            n["Node Type"] == "Seq Scan"
                && !ONE_ROW.contains(&n["Relation Name"].as_str().unwrap_or(""))
        });
        assert!(
            filtered + read <= rows && !whole,
            "{name} read {read} rows and filtered {filtered} (a full scan: {whole}): {plan:#}"
        );
    }
}

/// The generic plan of `sql`, run with `binds`: the plan made for any values, which a
/// connection may keep for a statement it prepared and runs again and again.
async fn postgres_generic_plan(conn: &mut sqlx::PgConnection, sql: &str, binds: &[Bound]) -> Value {
    let values: Vec<String> = binds
        .iter()
        .map(|bind| match bind {
            Bound::Text(text) => format!("'{}'", text.replace('\'', "''")),
            Bound::Int(n) => n.to_string(),
            Bound::Bytes(bytes) => {
                let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                format!("'\\x{hex}'::bytea")
            }
        })
        .collect();
    let arguments = if values.is_empty() {
        String::new()
    } else {
        format!("({})", values.join(", "))
    };
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .unwrap();
    super::prepared_plan(conn, "", sql, &arguments).await
}

async fn sqlite_plans(db: &TestDb, statements: Vec<Statement>) {
    for (name, plan) in sqlite_explained(db, statements).await {
        let scans: Vec<&String> = plan
            .iter()
            // The one-row subquery a read joins the clock from is no table.
            .filter(|step| {
                step.starts_with("SCAN")
                    && !["SCAN CONSTANT ROW", "SCAN one"].contains(&step.as_str())
            })
            .collect();
        assert!(scans.is_empty(), "{name} scans a table: {plan:#?}");
    }
}

/// SQLite's plan of each statement, a step a line.
async fn sqlite_explained(
    db: &TestDb,
    statements: Vec<Statement>,
) -> Vec<(&'static str, Vec<String>)> {
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let mut explained = Vec::new();
    for (name, sql, binds) in statements {
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let mut query = sqlx::query_as::<_, (i64, i64, i64, String)>(&explain);
        for bind in binds {
            query = match bind {
                Bound::Text(text) => query.bind(text),
                Bound::Int(n) => query.bind(n),
                Bound::Bytes(bytes) => query.bind(bytes),
            };
        }
        let plan: Vec<String> = query
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|(_, _, _, detail)| detail)
            .collect();
        explained.push((name, plan));
    }
    explained
}
