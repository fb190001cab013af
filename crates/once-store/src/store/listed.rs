//! A plan's writes sent as one list of statements, in one round trip, where the dialect takes
//! several statements in one query ([`crate::Dialect::STATEMENT_LISTS`]): on SQLite each
//! statement is one more hand-over to the connection's thread and back, which costs more than
//! the statement. `Transactions::apply` binds and sends the list; this builds it and reads what
//! it wrote.
//! The statements share one list of values: `$1` the tenant and `$2` the operation id (the
//! operation's first two columns when it writes the row), then each statement's own values.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};

use once_core::machine::Write;
use once_core::{Operation, OperationId, Plan};

use crate::rows::{
    INSERT_ATTEMPT, INSERT_EVENT, INSERT_OPERATION, UPDATE_OPERATION, WRITTEN_OPERATION_COLUMNS,
};
use crate::StoreError;

/// Clears an operation's attempt log: `$1` the tenant, `$2` the operation id.
pub(crate) const FORGET_ATTEMPTS: &str =
    "DELETE FROM attempts WHERE tenant = $1 AND operation_id = $2";

/// The most events a plan written as one list has; a plan with more (none the state
/// machine makes today) is written statement by statement.
const MOST_EVENTS: usize = 8;

/// What a plan writes: the key of its list of statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Writes {
    /// The operation row: inserted (`true`) or updated.
    operation: Option<bool>,
    forgets_attempts: bool,
    attempt: bool,
    events: usize,
}

/// The list of statements writing `plan`, built once for each kind of plan (a few dozen at
/// most); `None` for a plan with more events than a list holds.
pub(crate) fn statements(plan: &Plan) -> Option<&'static str> {
    let writes = Writes {
        operation: plan
            .operation
            .as_ref()
            .map(|write| matches!(write, Write::Insert(_))),
        forgets_attempts: plan.forgets_attempts,
        attempt: plan.attempt.is_some(),
        events: plan.events.len(),
    };
    if writes.events > MOST_EVENTS {
        return None;
    }
    static LISTS: LazyLock<Mutex<HashMap<Writes, &'static str>>> = LazyLock::new(Mutex::default);
    let mut lists = LISTS.lock().unwrap_or_else(PoisonError::into_inner);
    Some(
        lists
            .entry(writes)
            .or_insert_with(|| Box::leak(list(writes).into_boxed_str())),
    )
}

fn list(writes: Writes) -> String {
    let mut statements = Vec::new();
    // After the shared tenant and operation id, or the operation's columns.
    let mut next = 3;
    if let Some(insert) = writes.operation {
        statements.push(match insert {
            true => INSERT_OPERATION.clone(),
            false => UPDATE_OPERATION.clone(),
        });
        next = WRITTEN_OPERATION_COLUMNS.len() + 1;
    }
    if writes.forgets_attempts {
        statements.push(FORGET_ATTEMPTS.to_owned());
    }
    if writes.attempt {
        statements.push(renumbered(&INSERT_ATTEMPT, &mut next));
    }
    for _ in 0..writes.events {
        statements.push(renumbered(&INSERT_EVENT, &mut next));
    }
    statements.join("; ")
}

/// `sql`, bound from `$1` on, with each placeholder from `$3` on moved to `next` and after
/// (`$1` and `$2`, the tenant and the operation id, stay); `next` is moved past them.
fn renumbered(sql: &str, next: &mut usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut highest = 2;
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        // A `$` that is not a placeholder (a JSON path) stays as it is.
        let Ok(n) = rest[..digits].parse::<usize>() else {
            continue;
        };
        out.push_str(&match n {
            0..=2 => n.to_string(),
            n => (*next + n - 3).to_string(),
        });
        highest = highest.max(n);
        rest = &rest[digits..];
    }
    out.push_str(rest);
    *next += highest - 2;
    out
}

/// Checks that the row a plan writes is the operation's whose key the statements after it
/// name as `$1` and `$2`.
pub(crate) fn same_key(
    op: &Operation,
    (tenant, id): (&str, &OperationId),
) -> Result<(), StoreError> {
    match (op.tenant.as_str(), &op.operation_id) == (tenant, id) {
        true => Ok(()),
        false => Err(StoreError::Corrupt(
            "a plan writing another operation's row".into(),
        )),
    }
}

/// What a list's statements wrote for `plan`: `wrote` holds each statement's rows affected, in
/// their order, up to `failed`, the error that stopped the list (see
/// [`crate::backend::sealed::Transactions::apply`]).
pub(crate) fn written(
    plan: &Plan,
    wrote: &[u64],
    failed: Option<sqlx::Error>,
) -> Result<crate::backend::Written, StoreError> {
    let updates = matches!(plan.operation, Some(Write::Update(_)));
    match failed {
        // An update that met no row fails the statements after it (an attempt of no
        // operation): the write fails as it would have alone, for want of its row.
        Some(_) if updates && wrote.first() == Some(&0) => return Err(StoreError::NotFound),
        Some(error) => return Err(error.into()),
        None => {}
    }
    let listed = usize::from(plan.operation.is_some())
        + usize::from(plan.forgets_attempts)
        + usize::from(plan.attempt.is_some())
        + plan.events.len();
    if wrote.len() != listed {
        return Err(StoreError::Corrupt(format!(
            "{} statements answered a list of {listed}",
            wrote.len()
        )));
    }
    if updates && wrote[0] != 1 {
        return Err(StoreError::NotFound);
    }
    Ok(crate::backend::Written {
        events: wrote[listed - plan.events.len()..]
            .iter()
            .map(|&rows| rows == 1)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::{list, Writes, MOST_EVENTS};
    use crate::rows::{ATTEMPT_COLUMNS, WRITTEN_OPERATION_COLUMNS};
    use crate::tests::placeholders;

    /// Every list of statements holds one statement for each thing its plan writes, and names
    /// each value it is bound with (the row's columns or its key, the attempt's, each event's
    /// own), from `$1` on with none skipped; a statement shares only the tenant (`$1`) and the
    /// operation id (`$2`) with the others.
    #[test]
    fn every_list_of_statements_names_each_of_its_values_once() {
        for operation in [None, Some(true), Some(false)] {
            for forgets_attempts in [false, true] {
                for attempt in [false, true] {
                    for events in 0..=MOST_EVENTS {
                        let writes = Writes {
                            operation,
                            forgets_attempts,
                            attempt,
                            events,
                        };
                        check(writes, &list(writes));
                    }
                }
            }
        }
    }

    fn check(writes: Writes, sql: &str) {
        let statements: Vec<&str> = sql.split("; ").filter(|s| !s.is_empty()).collect();
        let expected = usize::from(writes.operation.is_some())
            + usize::from(writes.forgets_attempts)
            + usize::from(writes.attempt)
            + writes.events;
        assert_eq!(statements.len(), expected, "{writes:?}: {sql}");
        if expected == 0 {
            return;
        }
        let row = match writes.operation {
            Some(_) => WRITTEN_OPERATION_COLUMNS.len(),
            None => 2,
        };
        let attempt = ATTEMPT_COLUMNS.split(", ").count() * usize::from(writes.attempt);
        let event_values = 10;
        let bound = row + attempt + event_values * writes.events;
        assert_eq!(placeholders(sql), (1..=bound).collect::<Vec<_>>(), "{sql}");
        for (i, one) in statements.iter().enumerate() {
            for other in &statements[i + 1..] {
                let theirs = placeholders(other);
                let shared: Vec<usize> = placeholders(one)
                    .into_iter()
                    .filter(|n| theirs.contains(n))
                    .collect();
                assert!(shared.iter().all(|n| *n <= 2), "{one} / {other}");
            }
        }
    }
}
