//! PostgreSQL's one-statement writes: plans decided from lock-free reads, written and
//! committed by one statement that checks each decision still holds (see
//! `migrations/postgres/0006_one_statement_writes.sql`). One statement writes the items of one
//! [`Shape`], one or many ([`super::batches`] gathers concurrent callers' items). Many items
//! are bound as an array per column, an element per item, so a shape has one statement
//! whatever their number; a lone item's columns are bound as they are (PostgreSQL takes an
//! array apart at a cost that only many items repay), in the same statement otherwise.
//!
//! The statement's parts are data-modifying CTEs, each reading the one before it: the items,
//! the write gate (as a locked write's first statement takes it), the fresh-id guard of each
//! item when they claim (intent locks taken in the items' order, which is the intents' order),
//! the operation rows (an INSERT that meets no row, or an UPDATE of the version each decision
//! read, in the life it read: a version alone comes again in the next life of the id), the
//! attempts and the events. An item whose row is written has the rest written with it; one
//! whose row is not has nothing. A decision whose clock reading is more than
//! [`MAX_DECISION_AGE_MS`] old is not written. The statement commits as a whole or not at all.

use std::sync::LazyLock;

use once_core::machine::{Plan, Write};
use once_core::{Blocking, FencingToken, Millis, NewEvent, Operation};
use sqlx::{PgConnection, Postgres, Row};

use crate::rows::{
    self, BlockingRow, Bound, Column, Many, One, Rows, ATTEMPT_COLUMNS, BLOCKING_COLUMNS,
    WRITTEN_OPERATION_COLUMNS,
};
use crate::Decision;
use crate::{StoreError, Unlocked, Written};

/// How old the clock reading a plan was decided at may be when its statement runs; an older
/// decision is made again under a lock. It dates the row, the lease and the events written.
const MAX_DECISION_AGE_MS: i64 = 1_000;

/// The statement's shape: what its items write besides their events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The items claim: each one's fresh-id guard must find the way clear.
    guarded: bool,
    /// The rows are inserted (they were not stored); otherwise updated from the versions read.
    insert: bool,
    /// The items grant attempts, for the attempt log.
    attempt: bool,
}

impl Shape {
    /// How many shapes there are: [`Shape::index`] is below it.
    pub(crate) const COUNT: usize = 8;

    pub(crate) fn index(self) -> usize {
        usize::from(self.guarded) << 2 | usize::from(self.insert) << 1 | usize::from(self.attempt)
    }

    fn of_index(index: usize) -> Shape {
        Shape {
            guarded: index & 4 != 0,
            insert: index & 2 != 0,
            attempt: index & 1 != 0,
        }
    }
}

/// One decision written so, owned by the batch it waits in.
#[derive(Debug, Clone)]
pub(crate) struct Item {
    /// The life and version the read found (an update).
    from: Option<(FencingToken, i64)>,
    /// A claim's intent lock key: it is written only if no other operation blocks it.
    pub(crate) intent: Option<i64>,
    plan: Plan,
    now: Millis,
}

impl Item {
    /// The decision as an item, or `None` when it is not written so: a plan that writes no
    /// operation row, starts a new life of one, or forgets its attempts is decided again under
    /// the write lock, where the attempt log is kept or cleared and the fresh-id guard runs.
    pub(crate) fn of(decision: Decision<'_>) -> Option<Item> {
        let Decision {
            from,
            guard,
            plan,
            now,
        } = decision;
        let keeps_its_life = match (&plan.operation, from) {
            (Some(Write::Insert(_)), None) => true,
            (Some(Write::Update(op)), Some((life, _))) => op.life == life,
            _ => false,
        };
        (keeps_its_life && !plan.forgets_attempts).then(|| Item {
            from,
            intent: guard.map(super::intent_key),
            plan: plan.clone(),
            now,
        })
    }

    /// Makes it an item PostgreSQL refuses to write: a NUL in text.
    #[cfg(test)]
    pub(crate) fn poison(&mut self) {
        if let Some(Write::Insert(op) | Write::Update(op)) = &mut self.plan.operation {
            op.reason = Some("a \0 in text".into());
        }
    }

    fn operation(&self) -> &Operation {
        match &self.plan.operation {
            Some(Write::Insert(op) | Write::Update(op)) => op,
            None => unreachable!("an item writes its operation row (Item::of)"),
        }
    }

    /// The operation it writes: one item of each in a statement.
    pub(crate) fn key(&self) -> (&str, &str) {
        let op = self.operation();
        (&op.tenant, op.operation_id.as_str())
    }

    pub(crate) fn shape(&self) -> Shape {
        Shape {
            guarded: self.intent.is_some(),
            insert: self.from.is_none(),
            attempt: self.plan.attempt.is_some(),
        }
    }

    /// Where it goes in its statement: by intent, then by operation, so two statements lock
    /// intents and rows in one order.
    pub(crate) fn order(&self) -> (Option<i64>, (&str, &str)) {
        (self.intent, self.key())
    }

    /// What the statement did, from its row for this item.
    fn outcome(&self, row: &sqlx::postgres::PgRow) -> Result<Unlocked, StoreError> {
        if row.try_get::<bool, _>("wrote")? {
            let inserted: Vec<String> = row.try_get("inserted_keys")?;
            let events = self
                .plan
                .events
                .iter()
                .map(|e| match &e.dedupe_key {
                    Some(key) => inserted.contains(key),
                    None => true,
                })
                .collect();
            return Ok(Unlocked::Applied {
                written: Written { events },
            });
        }
        let blocking: Option<String> = row.try_get("operation_id")?;
        Ok(match blocking {
            Some(_) => {
                use sqlx::FromRow as _;
                Unlocked::Blocked(Blocking::try_from(BlockingRow::from_row(row)?)?)
            }
            None => Unlocked::Changed,
        })
    }
}

/// The columns of `events` the statement writes from its arrays, in their order.
const EVENT_ARRAYS: [(&str, &str); 9] = [
    ("life", "BIGINT"),
    ("kind", "TEXT"),
    ("from_state", "TEXT"),
    ("to_state", "TEXT"),
    ("attempt", "BIGINT"),
    ("actor", "TEXT"),
    ("reason", "TEXT"),
    ("details", "TEXT"),
    ("dedupe_key", "TEXT"),
];

/// The statement of one shape, for `many` items or one. Binds, one array each with an element
/// per item (`many`) or each item's value: the operation's written columns (`$1` tenant, `$2`
/// id, `$3` tool, `$4` fingerprint, `$5` state, …), then the life and version read (an update),
/// the clock of the decision, the intent's lock key (a claim) and the attempt's columns (a
/// grant); then, with an element per event, the item each event is of and one array per column
/// of [`EVENT_ARRAYS`].
fn statement(shape: Shape, many: bool) -> String {
    let mut bound = 0;
    let mut next = || {
        bound += 1;
        format!("${bound}")
    };
    // The items, numbered from 1 as bound.
    let mut arrays: Vec<String> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for column in WRITTEN_OPERATION_COLUMNS {
        arrays.push(next());
        names.push(column.to_owned());
    }
    if !shape.insert {
        for name in ["read_life", "read_version"] {
            arrays.push(next());
            names.push(name.to_owned());
        }
    }
    arrays.push(next());
    names.push("decided_at".to_owned());
    if shape.guarded {
        arrays.push(next());
        names.push("intent".to_owned());
    }
    let attempt: Vec<String> = ATTEMPT_COLUMNS
        .split(", ")
        .map(|column| format!("a_{column}"))
        .collect();
    if shape.attempt {
        for name in &attempt {
            arrays.push(next());
            names.push(name.clone());
        }
    }
    let of_event = format!("{}::BIGINT[]", next());
    let event_arrays: Vec<String> = EVENT_ARRAYS
        .iter()
        .map(|(_, ty)| format!("{}::{ty}[]", next()))
        .collect();

    let now = <sqlx::Postgres as crate::Dialect>::NOW;
    let items = if many {
        format!(
            "SELECT * FROM unnest({}) WITH ORDINALITY AS i({}, n)",
            arrays.join(", "),
            names.join(", ")
        )
    } else {
        let values: Vec<String> = arrays
            .iter()
            .zip(&names)
            .map(|(value, name)| format!("{value} AS {name}"))
            .collect();
        format!("SELECT {}, 1::BIGINT AS n", values.join(", "))
    };
    let mut parts = vec![
        format!("items AS MATERIALIZED ({items})"),
        format!(
            "gate AS (SELECT 1 FROM ({}) AS held)",
            <sqlx::Postgres as crate::Dialect>::write_gate()
        ),
    ];
    // The decision's clock reading may be only so old by now: it dates what is written.
    let mut writable =
        format!("{now} - i.decided_at <= {MAX_DECISION_AGE_MS} AND EXISTS (SELECT 1 FROM gate)");
    if shape.guarded {
        let blocking: Vec<String> = BLOCKING_COLUMNS
            .split(", ")
            .map(|column| format!("b.{column}"))
            .collect();
        parts.push(format!(
            "blocking AS (SELECT i.n, {} FROM items i CROSS JOIN LATERAL \
             once_blocking(i.intent, i.tenant, i.tool, i.fingerprint, i.operation_id) AS b)",
            blocking.join(", ")
        ));
        // The clock is read again once every item's intent lock is held, which may have been
        // waited for: a decision is written only while recent then.
        parts.push(format!(
            "settled AS (SELECT {now} AS at FROM (SELECT count(*) FROM blocking) AS locked)"
        ));
        writable = format!(
            "s.at - i.decided_at <= {MAX_DECISION_AGE_MS} AND EXISTS (SELECT 1 FROM gate) \
             AND NOT EXISTS (SELECT 1 FROM blocking b WHERE b.n = i.n)"
        );
    } else {
        parts.push(
            "blocking AS (SELECT NULL::BIGINT AS n, NULL::TEXT AS operation_id, \
             NULL::TEXT AS state, NULL::BIGINT AS attempt, NULL::BIGINT AS lease_deadline, \
             NULL::BIGINT AS updated_at WHERE FALSE)"
                .to_owned(),
        );
    }
    let sources = match shape.guarded {
        true => "items i CROSS JOIN settled s",
        false => "items i",
    };
    parts.push(if shape.insert {
        // The claim's token was taken by the read. A life of this id that began since (its
        // tokens larger) and ended with retention has left its events: then the claim would
        // start a life below an earlier one, whose reports a life's token range must never
        // take for its own.
        let values: Vec<String> = WRITTEN_OPERATION_COLUMNS
            .iter()
            .map(|column| format!("i.{column}"))
            .collect();
        format!(
            "op AS (INSERT INTO operations ({}) SELECT {} FROM {sources} WHERE {writable} \
             AND NOT EXISTS (SELECT 1 FROM events e WHERE e.tenant = i.tenant \
             AND e.operation_id = i.operation_id AND e.life > i.life) \
             ORDER BY i.n ON CONFLICT DO NOTHING RETURNING tenant, operation_id)",
            WRITTEN_OPERATION_COLUMNS.join(", "),
            values.join(", "),
        )
    } else {
        let assignments: Vec<String> = WRITTEN_OPERATION_COLUMNS
            .iter()
            .skip(2)
            .map(|column| format!("{column} = i.{column}"))
            .collect();
        format!(
            "op AS (UPDATE operations o SET {}, version = o.version + 1 FROM {sources} \
             WHERE o.tenant = i.tenant AND o.operation_id = i.operation_id \
             AND o.life = i.read_life AND o.version = i.read_version AND {writable} \
             RETURNING o.tenant, o.operation_id)",
            assignments.join(", ")
        )
    });
    parts.push(
        "wrote AS (SELECT i.* FROM items i JOIN op \
         ON op.tenant = i.tenant AND op.operation_id = i.operation_id)"
            .to_owned(),
    );
    if shape.attempt {
        let values: Vec<String> = attempt.iter().map(|name| format!("w.{name}")).collect();
        parts.push(format!(
            "attempt AS (INSERT INTO attempts (tenant, operation_id, {ATTEMPT_COLUMNS}) \
             SELECT w.tenant, w.operation_id, {} FROM wrote w ORDER BY w.n)",
            values.join(", ")
        ));
    }
    let columns: Vec<&str> = EVENT_ARRAYS.iter().map(|(column, _)| *column).collect();
    let from_arrays: Vec<String> = columns.iter().map(|c| format!("e.{c}")).collect();
    // The tool and state of every event are the operation's as its plan leaves it.
    parts.push(format!(
        "logged AS (INSERT INTO events (tenant, operation_id, at, {}, tool, state) \
         SELECT w.tenant, w.operation_id, w.decided_at, {}, w.tool, w.state FROM wrote w \
         JOIN unnest({of_event}, {}) WITH ORDINALITY AS e(item, {}, ord) ON e.item = w.n \
         ORDER BY e.item, e.ord ON CONFLICT DO NOTHING \
         RETURNING tenant, operation_id, dedupe_key)",
        columns.join(", "),
        from_arrays.join(", "),
        event_arrays.join(", "),
        columns.join(", "),
    ));
    let blocking: Vec<String> = BLOCKING_COLUMNS
        .split(", ")
        .map(|column| format!("b.{column}"))
        .collect();
    format!(
        "WITH {} SELECT i.n, EXISTS (SELECT 1 FROM wrote w WHERE w.n = i.n) AS wrote, \
         ARRAY(SELECT l.dedupe_key FROM logged l WHERE l.tenant = i.tenant \
         AND l.operation_id = i.operation_id AND l.dedupe_key IS NOT NULL) AS inserted_keys, \
         {} FROM items i LEFT JOIN blocking b ON b.n = i.n ORDER BY i.n",
        parts.join(", "),
        blocking.join(", ")
    )
}

/// Every shape's statement, for one item and for many, built once.
static STATEMENTS: LazyLock<Vec<[String; 2]>> = LazyLock::new(|| {
    (0..Shape::COUNT)
        .map(|i| [false, true].map(|many| statement(Shape::of_index(i), many)))
        .collect()
});

/// Binds the columns `one` or `all` name: of the lone row's values, or as arrays over `rows`.
fn bound<'q, R: 'q>(
    query: Bound<'q, Postgres>,
    rows: Vec<&'q R>,
    one: impl FnOnce(One<'q, Postgres, R>) -> One<'q, Postgres, R>,
    all: impl FnOnce(Many<'q, R>) -> Many<'q, R>,
) -> Bound<'q, Postgres> {
    match rows.as_slice() {
        [row] => one(One { query, row }).query,
        _ => all(Many { query, rows }).query,
    }
}

/// Binds an item's own columns: the life and version read (an update), the clock of the
/// decision, the intent (a claim).
fn item_columns<'q, S>(columns: S, shape: Shape) -> S
where
    S: Rows<'q, Row = Item> + Column<'q, Option<i64>> + Column<'q, i64>,
{
    let read = match shape.insert {
        true => columns,
        false => columns
            .column(|item| item.from.map(|(life, _)| rows::token_column(life)))
            .column(|item| item.from.map(|(_, version)| version)),
    };
    let dated = read.column(|item| item.now);
    match shape.guarded {
        true => dated.column(|item| item.intent),
        false => dated,
    }
}

/// One column of the items' events, as an array to bind.
fn column<'e, T>(items: &[&'e Item], of: impl Fn(&'e NewEvent) -> T) -> Vec<T> {
    items
        .iter()
        .flat_map(|item| item.plan.events.iter())
        .map(of)
        .collect()
}

/// Writes one item alone in one statement; what it did, once committed.
pub(crate) async fn write_one(
    conn: &mut PgConnection,
    item: &Item,
) -> Result<Unlocked, StoreError> {
    let mut outcomes = write(conn, &[item]).await?;
    outcomes.pop().unwrap_or_else(|| {
        Err(StoreError::Corrupt(
            "a statement answered no row for its item".into(),
        ))
    })
}

/// Writes `items`, all of one shape, each about another operation and (claims) another
/// intent, in one statement that commits them; what it did for each, in their order. An error
/// of the statement's own is of a statement that committed nothing (or whose commit's answer
/// was lost); an item's own error is of an answer read after the commit.
pub(crate) async fn write(
    conn: &mut PgConnection,
    items: &[&Item],
) -> Result<Vec<Result<Unlocked, StoreError>>, StoreError> {
    let Some(first) = items.first() else {
        return Ok(Vec::new());
    };
    let shape = first.shape();
    debug_assert!(items.iter().all(|item| item.shape() == shape));
    let statement = &STATEMENTS[shape.index()][usize::from(items.len() > 1)];
    let ops = items.iter().map(|item| item.operation()).collect();
    let query = sqlx::query(statement);
    let query = bound(query, ops, rows::operation_columns, rows::operation_columns);
    let mut query = bound(
        query,
        items.to_vec(),
        |one| item_columns(one, shape),
        |all| item_columns(all, shape),
    );
    if shape.attempt {
        let attempts = items
            .iter()
            .filter_map(|item| item.plan.attempt.as_ref())
            .collect();
        query = bound(
            query,
            attempts,
            rows::attempt_columns,
            rows::attempt_columns,
        );
    }
    let of_item: Vec<i64> = items
        .iter()
        .zip(1..)
        .flat_map(|(item, n)| item.plan.events.iter().map(move |_| n))
        .collect();
    let query = query
        .bind(of_item)
        .bind(column(items, |e| rows::token_column(e.life)))
        .bind(column(items, |e| e.kind.as_str()))
        .bind(column(items, |e| e.from.map(|s| s.as_str())))
        .bind(column(items, |e| e.to.map(|s| s.as_str())))
        .bind(column(items, |e| e.attempt.map(i64::from)))
        .bind(column(items, |e| e.actor.to_string()))
        .bind(column(items, |e| e.reason.as_deref()))
        .bind(column(items, |e| e.details.as_deref()))
        .bind(column(items, |e| e.dedupe_key.as_deref()));

    let rows = query.fetch_all(conn).await?;
    if rows.len() != items.len() {
        let miscounted = || {
            StoreError::Corrupt(format!(
                "{} rows answered {} items written in one statement",
                rows.len(),
                items.len()
            ))
        };
        return Ok(items.iter().map(|_| Err(miscounted())).collect());
    }
    Ok(items
        .iter()
        .zip(&rows)
        .map(|(item, row)| item.outcome(row))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use once_testdb::{Engine, TestDb};

    /// Planned once, generically, over empty tables, as a lane's new connection plans it, every
    /// statement finds each item's rows by their keys: no table is read whole, however many
    /// rows it holds later, while the plan is kept. So does a lone item's statement on a pooled
    /// connection, where its caller writes it, as that connection may keep a generic plan too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_statement_planned_over_empty_tables_finds_rows_by_their_keys() {
        let db = TestDb::new(Engine::Postgres).await;
        let settings = crate::postgres::PgSettings::default();
        let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
        let mut lane = super::super::batches::connection(&backend, None)
            .await
            .unwrap();
        let mut pooled = backend.pool.acquire().await.unwrap().detach();
        sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
            .execute(&mut pooled)
            .await
            .unwrap();
        let columns: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT table_name::TEXT, column_name::TEXT, data_type::TEXT \
             FROM information_schema.columns WHERE table_name IN ('operations', 'attempts')",
        )
        .fetch_all(&mut lane)
        .await
        .unwrap();
        let type_of = |table: &str, column: &str| -> String {
            columns
                .iter()
                .find(|(t, c, _)| t == table && c == column)
                .map(|(_, _, ty)| ty.clone())
                .unwrap_or_else(|| panic!("{table}.{column}"))
        };
        for (index, both) in STATEMENTS.iter().enumerate() {
            let shape = Shape::of_index(index);
            for (many, sql) in [false, true].into_iter().zip(both) {
                let mut types: Vec<String> = WRITTEN_OPERATION_COLUMNS
                    .iter()
                    .map(|column| type_of("operations", column))
                    .collect();
                let item = 2 * usize::from(!shape.insert) + 1 + usize::from(shape.guarded);
                types.extend((0..item).map(|_| "bigint".to_owned()));
                if shape.attempt {
                    types.extend(
                        ATTEMPT_COLUMNS
                            .split(", ")
                            .map(|column| type_of("attempts", column)),
                    );
                }
                let mut types: Vec<String> = types
                    .into_iter()
                    .map(|ty| if many { format!("{ty}[]") } else { ty })
                    .collect();
                types.push("bigint[]".to_owned());
                types.extend(EVENT_ARRAYS.iter().map(|(_, ty)| format!("{ty}[]")));
                let conns = match many {
                    true => vec![&mut lane],
                    false => vec![&mut lane, &mut pooled],
                };
                for conn in conns {
                    let nulls = vec!["NULL"; types.len()].join(", ");
                    let types = format!("({})", types.join(", "));
                    let plan =
                        crate::tests::prepared_plan(conn, &types, sql, &format!("({nulls})")).await;
                    for node in crate::tests::plan_nodes(&plan) {
                        assert!(
                            node["Node Type"] != "Seq Scan" || node["Relation Name"].is_null(),
                            "shape {index}, many {many}: {plan:#}"
                        );
                    }
                }
            }
        }
    }

    /// Every shape's statement names each of its binds, from `$1` on with none skipped: what
    /// `write` binds, in order.
    #[test]
    fn every_statement_names_each_of_its_binds() {
        for (index, sql) in STATEMENTS
            .iter()
            .enumerate()
            .flat_map(|(index, both)| both.iter().map(move |sql| (index, sql)))
        {
            let named = crate::tests::placeholders(sql);
            let shape = (index & 4 != 0, index & 2 != 0, index & 1 != 0);
            let expected = WRITTEN_OPERATION_COLUMNS.len()
                + 2 * usize::from(!shape.1)
                + 1
                + usize::from(shape.0)
                + if shape.2 {
                    ATTEMPT_COLUMNS.split(", ").count()
                } else {
                    0
                }
                + 1
                + EVENT_ARRAYS.len();
            assert_eq!(
                named,
                (1..=expected).collect::<Vec<_>>(),
                "shape {shape:?}: {sql}"
            );
            if std::env::var_os("ONCE_PRINT_STATEMENTS").is_some() {
                println!("{index}: {sql}");
            }
        }
    }
}
