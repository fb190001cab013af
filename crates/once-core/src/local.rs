//! Effects in the executor's own database: the marker row written in the effect's transaction,
//! and the fence a lookup writes (see the `sql` reconciler kind, docs/reconcilers.md). The SQL is
//! the same on PostgreSQL and SQLite; `{table}` stands for the marker table.

/// The upsert with which an executor's transaction records its effect. Binds: provider key,
/// operation id, fencing token, result, provider reference, time (ms). `{table}` is the marker
/// table. One row written: the marker is this attempt's; none (a fence of this attempt or a
/// later one, or a marker already done): roll back.
pub const MARK_DONE: &str = "INSERT INTO {table} (provider_key, operation_id, fencing_token, state, result, provider_ref, at) \
     VALUES ($1, $2, $3, 'done', $4, $5, $6) \
     ON CONFLICT (provider_key) DO UPDATE SET operation_id = excluded.operation_id, \
     fencing_token = excluded.fencing_token, state = 'done', result = excluded.result, \
     provider_ref = excluded.provider_ref, at = excluded.at \
     WHERE {table}.state = 'absent' AND {table}.fencing_token < excluded.fencing_token \
     AND {table}.operation_id = excluded.operation_id";

/// The fence a lookup writes, or raises to its token. Binds: provider key, operation id,
/// fencing token, time (ms).
pub const FENCE: &str = "INSERT INTO {table} (provider_key, operation_id, fencing_token, state, result, at) \
     VALUES ($1, $2, $3, 'absent', NULL, $4) \
     ON CONFLICT (provider_key) DO UPDATE SET fencing_token = excluded.fencing_token, at = excluded.at \
     WHERE {table}.state = 'absent' AND {table}.fencing_token < excluded.fencing_token \
     AND {table}.operation_id = excluded.operation_id";

/// The marker table's DDL, on PostgreSQL (`postgres`) or on SQLite.
pub fn create_table(table: &str, postgres: bool) -> String {
    let bytes = if postgres { "BYTEA" } else { "BLOB" };
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         provider_key TEXT PRIMARY KEY, \
         operation_id TEXT NOT NULL, \
         fencing_token BIGINT NOT NULL, \
         state TEXT NOT NULL CHECK (state IN ('done', 'absent')), \
         result {bytes}, \
         provider_ref TEXT, \
         at BIGINT NOT NULL)"
    )
}

/// Whether `name` may name the marker table: a plain SQL identifier.
pub fn table_name(name: &str) -> Result<String, String> {
    let plain = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    match plain {
        true => Ok(name.to_owned()),
        false => Err("the marker table is 1 to 63 characters of a-z, 0-9 and _".to_owned()),
    }
}
