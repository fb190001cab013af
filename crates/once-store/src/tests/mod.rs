//! The store's own suites, on SQLite and on PostgreSQL (the server `ONCE_TEST_POSTGRES_URL`
//! names; unreachable fails): `conformance`, what every [`crate::Backend`] must do, and
//! `plans`, that the statements the store sends read by an index what they read.

mod conformance;
mod plans;

use once_testdb::{Engine, TestDb};
use serde_json::Value;

/// Makes the ledger's schema in `db`, as a replica does when it first opens it.
async fn schema(db: &TestDb) {
    match db.store {
        Engine::Sqlite => {
            let backend = crate::SqliteBackend::connect(&db.url).await.unwrap();
            crate::Backend::close(&backend).await;
        }
        Engine::Postgres => {
            let settings = crate::postgres::PgSettings::default();
            let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
            crate::Backend::close(&backend).await;
        }
    }
}

/// The placeholders `$n` that `sql` names, each once, in order.
pub(crate) fn placeholders(sql: &str) -> Vec<usize> {
    let mut named: Vec<usize> = sql
        .split('$')
        .skip(1)
        .filter_map(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect();
    named.sort_unstable();
    named.dedup();
    named
}

/// The plan `conn` makes of `sql` prepared with the parameter types `types` (`""` lets
/// PostgreSQL infer them) and executed with `arguments` (`""` for none, else `"(…)"`): the plan
/// a connection keeps for a statement it prepared, when it keeps a generic one.
pub(crate) async fn prepared_plan(
    conn: &mut sqlx::PgConnection,
    types: &str,
    sql: &str,
    arguments: &str,
) -> Value {
    sqlx::raw_sql(&format!("PREPARE checked {types} AS {sql}"))
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan = sqlx::query_scalar(&format!(
        "EXPLAIN (FORMAT JSON) EXECUTE checked {arguments}"
    ))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql("DEALLOCATE checked")
        .execute(&mut *conn)
        .await
        .unwrap();
    plan
}

/// Every node of an EXPLAIN (FORMAT JSON) answer, its subplans' too.
pub(crate) fn plan_nodes(explained: &Value) -> Vec<&Value> {
    fn walk<'a>(node: &'a Value, into: &mut Vec<&'a Value>) {
        into.push(node);
        for child in node["Plans"].as_array().into_iter().flatten() {
            walk(child, into);
        }
    }
    let mut nodes = Vec::new();
    walk(&explained[0]["Plan"], &mut nodes);
    nodes
}
