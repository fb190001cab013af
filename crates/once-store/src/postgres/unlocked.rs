//! PostgreSQL's one-statement writes: a plan decided from a lock-free read, written and
//! committed by one statement that checks the decision still holds (see
//! `migrations/postgres/0006_one_statement_writes.sql`).
//!
//! The statement's parts are data-modifying CTEs, each reading the one before it: the write
//! gate (as a locked write's first statement takes it), the fresh-id guard when the plan
//! claims, the operation row (an INSERT that meets no row, or an UPDATE of the version the
//! decision read, in the life it read: a version alone comes again in the next life of the
//! id), the attempt and the events. When the row is written nothing else is checked, so the
//! rest follows it; when it is not, nothing is. The gate also refuses a decision whose clock
//! reading is more than [`MAX_DECISION_AGE_MS`] old.

use std::sync::LazyLock;

use once_core::machine::Write;
use once_core::{Blocking, NewEvent};
use sqlx::{PgConnection, Row};

use crate::rows::{
    self, BlockingRow, ATTEMPT_COLUMNS, BLOCKING_COLUMNS, OPERATION_ASSIGNMENTS,
    OPERATION_PLACEHOLDERS, WRITTEN_OPERATION_COLUMNS,
};
use crate::Decision;
use crate::{StoreError, Unlocked, Written};

/// How old the clock reading a plan was decided at may be when its statement runs; an older
/// decision is made again under a lock. It dates the row, the lease and the events written.
const MAX_DECISION_AGE_MS: i64 = 1_000;

/// The statement's shape: what the plan writes besides its events.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// The plan claims: the fresh-id guard must find the way clear.
    guarded: bool,
    /// The row is inserted (it was not stored); otherwise updated from the version read.
    insert: bool,
    /// The plan grants an attempt, for the attempt log.
    attempt: bool,
}

impl Shape {
    fn index(self) -> usize {
        usize::from(self.guarded) << 2 | usize::from(self.insert) << 1 | usize::from(self.attempt)
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

/// The statement of one shape. Binds: the operation's written columns (`$1` tenant, `$2` id,
/// `$3` tool, `$4` fingerprint, `$5` state, …), then the life and version read (an update), the clock
/// of the decision, the intent's lock key (a claim), the attempt's columns (a grant) and one
/// array per column of [`EVENT_ARRAYS`].
fn statement(shape: Shape) -> String {
    let mut bound = WRITTEN_OPERATION_COLUMNS.len();
    let mut next = || {
        bound += 1;
        format!("${bound}")
    };
    let version = (!shape.insert).then(|| (next(), next()));
    let now = next();
    let intent = shape.guarded.then(&mut next);
    let attempt: Option<Vec<String>> = shape
        .attempt
        .then(|| ATTEMPT_COLUMNS.split(", ").map(|_| next()).collect());
    let arrays: Vec<String> = EVENT_ARRAYS
        .iter()
        .map(|(_, ty)| format!("{}::{ty}[]", next()))
        .collect();

    // The decision's clock reading may be only so old by now: it dates what is written.
    let mut parts = vec![format!(
        "gate AS (SELECT 1 FROM ({}) AS held WHERE {} - {now} <= {MAX_DECISION_AGE_MS})",
        <sqlx::Postgres as crate::Dialect>::write_gate(),
        <sqlx::Postgres as crate::Dialect>::NOW
    )];
    let clear = match intent {
        Some(intent) => {
            parts.push(format!(
                "blocking AS (SELECT {BLOCKING_COLUMNS} FROM once_blocking({intent}, $1, $3, $4, $2))"
            ));
            " AND NOT EXISTS (SELECT 1 FROM blocking)"
        }
        None => "",
    };
    parts.push(match version {
        // The claim's token was taken by the read. A life of this id that began since (its
        // tokens larger) and ended with retention has left its events: then the claim would
        // start a life below an earlier one, whose reports a life's token range must never
        // take for its own.
        None => format!(
            "op AS (INSERT INTO operations ({}) SELECT {} WHERE EXISTS (SELECT 1 FROM gate){clear} \
             AND NOT EXISTS (SELECT 1 FROM events WHERE tenant = $1 AND operation_id = $2 \
             AND life > {}) ON CONFLICT DO NOTHING RETURNING 1)",
            WRITTEN_OPERATION_COLUMNS.join(", "),
            OPERATION_PLACEHOLDERS.as_str(),
            placeholder_of("life"),
        ),
        Some((life, version)) => format!(
            "op AS (UPDATE operations SET {} \
             WHERE tenant = $1 AND operation_id = $2 AND life = {life} AND version = {version} \
             AND EXISTS (SELECT 1 FROM gate){clear} RETURNING 1)",
            OPERATION_ASSIGNMENTS.as_str()
        ),
    });
    if let Some(attempt) = attempt {
        parts.push(format!(
            "attempt AS (INSERT INTO attempts (tenant, operation_id, {ATTEMPT_COLUMNS}) \
             SELECT $1, $2, {} FROM op)",
            attempt.join(", ")
        ));
    }
    let columns: Vec<&str> = EVENT_ARRAYS.iter().map(|(column, _)| *column).collect();
    let from_arrays: Vec<String> = columns.iter().map(|c| format!("e.{c}")).collect();
    // The tool and state of every event are the operation's as the plan leaves it.
    parts.push(format!(
        "logged AS (INSERT INTO events (tenant, operation_id, at, {}, tool, state) \
         SELECT $1, $2, {now}, {}, $3, $5 FROM op, unnest({}) WITH ORDINALITY AS e({}, n) \
         ORDER BY e.n ON CONFLICT DO NOTHING RETURNING dedupe_key)",
        columns.join(", "),
        from_arrays.join(", "),
        arrays.join(", "),
        columns.join(", "),
    ));
    let blocking = if shape.guarded {
        " LEFT JOIN blocking b ON TRUE"
    } else {
        " LEFT JOIN (SELECT NULL::TEXT AS operation_id, NULL::TEXT AS state, NULL::BIGINT AS attempt, \
         NULL::BIGINT AS lease_deadline, NULL::BIGINT AS updated_at) b ON TRUE"
    };
    format!(
        "WITH {} SELECT (SELECT count(*) FROM op) AS wrote, \
         ARRAY(SELECT dedupe_key FROM logged WHERE dedupe_key IS NOT NULL) AS inserted_keys, \
         b.* FROM (SELECT 1) AS one{blocking}",
        parts.join(", ")
    )
}

/// The placeholder the operation's `column` is bound to.
fn placeholder_of(column: &str) -> String {
    let at = WRITTEN_OPERATION_COLUMNS
        .iter()
        .position(|c| *c == column)
        .expect("a written column");
    format!("${}", at + 1)
}

/// Every shape's statement, built once.
static STATEMENTS: LazyLock<Vec<String>> = LazyLock::new(|| {
    (0..8)
        .map(|index| {
            statement(Shape {
                guarded: index & 4 != 0,
                insert: index & 2 != 0,
                attempt: index & 1 != 0,
            })
        })
        .collect()
});

/// One column of `events`, as an array to bind.
fn column<'e, T>(events: &'e [NewEvent], of: impl Fn(&'e NewEvent) -> T) -> Vec<T> {
    events.iter().map(of).collect()
}

/// Writes a decision's plan in one statement if it was decided from what is still stored; see
/// [`crate::Backend::apply_unlocked`]. A plan that writes no operation row, or starts a new
/// life of one, is not written so: `None`.
pub(crate) async fn apply(
    conn: &mut PgConnection,
    decision: Decision<'_>,
) -> Result<Option<Unlocked>, StoreError> {
    let Decision {
        from: decided_from,
        guard,
        plan,
        now,
    } = decision;
    // An update keeps the life it was decided from: a new life of a stored row is claimed
    // under the write lock, where its attempt log is kept or cleared and the fresh-id guard
    // runs.
    let (op, insert) = match (&plan.operation, decided_from) {
        (Some(Write::Insert(op)), None) => (op, true),
        (Some(Write::Update(op)), Some((life, _))) if op.life == life => (op, false),
        _ => return Ok(None),
    };
    if plan.forgets_attempts {
        return Ok(None);
    }
    let shape = Shape {
        guarded: guard.is_some(),
        insert,
        attempt: plan.attempt.is_some(),
    };
    let mut query = rows::bind_operation(sqlx::query(&STATEMENTS[shape.index()]), op);
    if let Some((life, version)) = decided_from {
        query = query.bind(rows::token_column(life)).bind(version);
    }
    query = query.bind(now);
    if let Some(cmd) = guard {
        query = query.bind(crate::postgres::intent_key(cmd));
    }
    if let Some(attempt) = &plan.attempt {
        query = rows::bind_attempt(query, attempt);
    }
    let events = &plan.events;
    let query = query
        .bind(column(events, |e| rows::token_column(e.life)))
        .bind(column(events, |e| e.kind.as_str()))
        .bind(column(events, |e| e.from.map(|s| s.as_str())))
        .bind(column(events, |e| e.to.map(|s| s.as_str())))
        .bind(column(events, |e| e.attempt.map(i64::from)))
        .bind(column(events, |e| e.actor.to_string()))
        .bind(column(events, |e| e.reason.as_deref()))
        .bind(column(events, |e| e.details.as_deref()))
        .bind(column(events, |e| e.dedupe_key.as_deref()));

    let row = query.fetch_one(conn).await?;
    let wrote: i64 = row.try_get("wrote")?;
    if wrote == 1 {
        let inserted: Vec<String> = row.try_get("inserted_keys")?;
        let written = Written {
            events: events
                .iter()
                .map(|e| match &e.dedupe_key {
                    Some(key) => inserted.contains(key),
                    None => true,
                })
                .collect(),
        };
        return Ok(Some(Unlocked::Applied { written }));
    }
    let blocking: Option<String> = row.try_get("operation_id")?;
    Ok(Some(match blocking {
        Some(_) => {
            use sqlx::FromRow as _;
            Unlocked::Blocked(Blocking::try_from(BlockingRow::from_row(&row)?)?)
        }
        None => Unlocked::Changed,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape's statement names each of its binds, from `$1` on with none skipped: what
    /// `apply` binds, in order.
    #[test]
    fn every_statement_names_each_of_its_binds() {
        for (index, sql) in STATEMENTS.iter().enumerate() {
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
