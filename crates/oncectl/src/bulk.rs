//! `oncectl reconcile --filter …` and `oncectl resolve --filter … --absent`: every UNKNOWN
//! operation a filter selects, listed first (and only listed with `--dry-run`), then acted on
//! a few at a time (the first alone), each resolution bound to the attempt its operation had
//! when it was listed.
//! Progress goes to standard error as each operation is done; the outcome of each, to
//! standard output at the end.

use std::fmt::Write as _;
use std::str::FromStr;
use std::time::Duration;

use futures::StreamExt as _;
use once_client::{
    ClientError, Done, LedgerClient, ListFilter, Selection, State, Target, BULK_LIMIT,
};
use serde_json::{json, Value};

use crate::{confirm, json, render, Failure, Out};

/// Which UNKNOWN operations a bulk command takes, as written on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub list: ListFilter,
    /// As given, for what is printed.
    pub given: String,
}

impl FromStr for Filter {
    type Err = String;

    fn from_str(given: &str) -> Result<Self, Self::Err> {
        const KEYS: &str = "tool=NAME, provider=NAME, older-than=DURATION";
        let mut list = ListFilter::default();
        let given = given.trim();
        if given != "all" {
            for part in given.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let Some((key, value)) = part.split_once('=') else {
                    return Err(format!("{part:?} is not KEY=VALUE: write {KEYS}"));
                };
                let value = value.trim();
                if value.is_empty() {
                    return Err(format!("{part:?} has no value"));
                }
                let twice = || format!("{} is given twice", key.trim());
                match key.trim().replace('_', "-").as_str() {
                    "tool" if list.tool.is_none() => list.tool = Some(value.to_owned()),
                    "provider" if list.provider.is_none() => {
                        list.provider = Some(value.to_owned())
                    }
                    "older-than" if list.older_than.is_none() => {
                        list.older_than = Some(humantime::parse_duration(value).map_err(|_| {
                            format!("older-than={value}: write a number and a unit, as 90s, 15m, 2h or 1d")
                        })?)
                    }
                    "tool" | "provider" | "older-than" => return Err(twice()),
                    other => return Err(format!("no filter {other:?}: write {KEYS}")),
                }
            }
            if list == ListFilter::default() {
                return Err(format!(
                    "name at least one of {KEYS}, or `all` for every UNKNOWN operation"
                ));
            }
        }
        Ok(Filter {
            list,
            given: given.to_owned(),
        })
    }
}

/// What a bulk command does to each operation.
pub enum Action {
    Reconcile { operator: String, wait: Duration },
    Absent { reason: String, operator: String },
}

impl Action {
    fn verb(&self) -> &'static str {
        match self {
            Action::Reconcile { .. } => "Reconcile",
            Action::Absent { .. } => "Resolve ABSENT",
        }
    }
}

/// One operation's outcome, as printed.
struct Row {
    target: Target,
    outcome: &'static str,
    state: Option<State>,
    detail: String,
    resolution_id: Option<String>,
}

impl Row {
    fn new<T>(
        target: Target,
        done: Done<T>,
        applied: impl FnOnce(T) -> (Option<State>, String),
    ) -> Row {
        let (outcome, (state, detail)) = match done {
            Done::Applied(done) => ("done", applied(done)),
            Done::Refused(error) => ("refused", (None, said(&error))),
            Done::Failed(error) => ("failed", (None, said(&error))),
        };
        Row {
            target,
            outcome,
            state,
            detail,
            resolution_id: None,
        }
    }

    fn json(&self) -> Value {
        let mut row = json!({
            "operation_id": self.target.operation_id,
            "attempt": self.target.attempt,
            "fencing_token": self.target.fencing_token,
            "outcome": self.outcome,
            "state": self.state.map(State::as_str),
            "detail": self.detail,
        });
        if let Some(id) = &self.resolution_id {
            row["resolution_id"] = id.as_str().into();
        }
        row
    }
}

fn said(error: &ClientError) -> String {
    match error {
        ClientError::Refused { reason, message } => format!("{message} ({reason})"),
        ClientError::NotFound => "no longer in the ledger".to_owned(),
        other => other.to_string(),
    }
}

/// Lists what `filter` selects; unless only that was asked, asks (or is told `yes`), then
/// does `action` to each and prints every outcome.
pub async fn run(
    ledger: &LedgerClient,
    out: &Out,
    filter: &Filter,
    dry_run: bool,
    yes: bool,
    action: Action,
) -> Result<(), Failure> {
    let Selection { operations, more } = ledger.select_unknown(&filter.list, BULK_LIMIT).await?;
    let count = operations.len();
    if dry_run || count == 0 {
        if out.json {
            let listed: Vec<_> = operations.iter().map(json::operation).collect();
            out.json(&json!({ "filter": filter.given, "operations": listed, "more": more, "dry_run": dry_run }));
        } else if count == 0 {
            out.print(&format!("No UNKNOWN operation matches {}.\n", filter.given));
        } else {
            let mut text = render::operations(&out.look, &operations, more, false);
            let _ = writeln!(
                text,
                "\nDry run: {count}{} UNKNOWN operations match {}; nothing was done.",
                if more { "+" } else { "" },
                filter.given
            );
            out.print(&text);
        }
        return Ok(());
    }
    if more {
        return Err(Failure::Usage(format!(
            "more than {BULK_LIMIT} UNKNOWN operations match {}: narrow the filter (see them with --dry-run)",
            filter.given
        )));
    }
    eprint!(
        "{}",
        render::operations(&out.look, &operations, false, false)
    );
    let question = format!("{} these {count}?", action.verb());
    if !yes {
        confirm(&question)?;
    }
    let targets: Vec<Target> = operations.iter().map(Target::from).collect();
    let Acted { rows, key_refused } = act(ledger, targets, action).await;
    let refused = rows.iter().filter(|r| r.outcome == "refused").count();
    let failed = rows.iter().filter(|r| r.outcome == "failed").count();
    let not_tried = count - rows.len();
    if out.json {
        let outcomes: Vec<_> = rows.iter().map(Row::json).collect();
        out.json(&json!({ "filter": filter.given, "outcomes": outcomes, "not_tried": not_tried }));
    } else {
        out.print(&table(out, &rows));
    }
    ending(
        Tally {
            count,
            failed,
            refused,
            not_tried,
        },
        key_refused.as_deref(),
    )
}

/// How a bulk command's operations came out, counted.
#[derive(Debug, Clone, Copy)]
struct Tally {
    count: usize,
    /// Got no answer: each may or may not have been applied.
    failed: usize,
    refused: usize,
    /// Never sent, after the ledger refused the key.
    not_tried: usize,
}

/// What the command says and how it exits. An operation without an answer comes first, whatever
/// else happened: it may have been applied, and only running the command again tells (exit 1).
/// Then a key refused, which stopped the rest; then refusals of single operations (exit 4).
fn ending(tally: Tally, key_refused: Option<&str>) -> Result<(), Failure> {
    let Tally {
        count,
        failed,
        refused,
        not_tried,
    } = tally;
    let untried = match not_tried {
        0 => String::new(),
        n => format!(", {n} not tried"),
    };
    match (failed, key_refused, refused) {
        (0, _, 0) => Ok(()),
        (0, Some(why), _) if not_tried > 0 => Err(Failure::Refused(format!(
            "the ledger refused this key: {why}; the other {not_tried} were not tried"
        ))),
        (0, _, refused) => Err(Failure::Refused(format!(
            "{refused} of {count} were refused, and nothing was applied to them: the table says why"
        ))),
        (failed, ..) => Err(Failure::Error(anyhow::anyhow!(
            "{failed} of {count} got no answer ({refused} refused{untried}): run the command again for what is still UNKNOWN"
        ))),
    }
}

/// What acting on the targets came to.
struct Acted {
    /// One for each operation sent, in the order the answers came.
    rows: Vec<Row>,
    /// Why the ledger refused the key itself, if it did: no operation was sent after that.
    key_refused: Option<String>,
}

/// Does `action` to each target, saying on standard error how far it got. The ledger client
/// sends the first alone and no more after a refusal of the key; those already sent are seen
/// through.
async fn act(ledger: &LedgerClient, targets: Vec<Target>, action: Action) -> Acted {
    let count = targets.len();
    let targets = futures::stream::iter(targets);
    match action {
        Action::Reconcile { operator, wait } => {
            let answers = ledger
                .reconcile_each(targets, &operator, wait)
                .map(|(target, done)| {
                    let key = done.refuses_the_key();
                    let row = Row::new(target, done, |r| {
                        (r.state, format!("{}: {}", r.reconciler, r.detail))
                    });
                    (row, key)
                });
            gather(answers, count).await
        }
        Action::Absent { reason, operator } => {
            let answers = ledger.resolve_each_absent(targets, reason, operator).map(
                |(target, resolution_id, done)| {
                    let key = done.refuses_the_key();
                    let mut row = Row::new(target, done, |state| (Some(state), String::new()));
                    row.resolution_id = Some(resolution_id);
                    (row, key)
                },
            );
            gather(answers, count).await
        }
    }
}

/// Each answer's row (and whether it refused the key), printed as progress as it comes.
async fn gather(answers: impl futures::Stream<Item = (Row, bool)>, count: usize) -> Acted {
    let mut acted = Acted {
        rows: Vec::with_capacity(count),
        key_refused: None,
    };
    let mut answers = std::pin::pin!(answers);
    while let Some((row, refuses_the_key)) = answers.next().await {
        if refuses_the_key && acted.key_refused.is_none() {
            acted.key_refused = Some(row.detail.clone());
        }
        eprintln!(
            "[{}/{count}] {} {}{}",
            acted.rows.len() + 1,
            row.target.operation_id,
            row.outcome,
            row.state.map(|s| format!(": {s}")).unwrap_or_default()
        );
        acted.rows.push(row);
    }
    acted
}

/// The outcomes, one line each.
fn table(out: &Out, rows: &[Row]) -> String {
    let rows: Vec<_> = rows
        .iter()
        .map(|row| render::Outcome {
            operation_id: &row.target.operation_id,
            attempt: row.target.attempt,
            outcome: row.outcome,
            state: row.state,
            detail: &row.detail,
        })
        .collect();
    render::outcomes(&out.look, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_without_an_answer_outranks_a_refused_key() {
        let tally = Tally {
            count: 10,
            failed: 1,
            refused: 2,
            not_tried: 5,
        };
        let why = Some("the key was revoked (CREDENTIALS_REVOKED)");
        let Err(Failure::Error(error)) = ending(tally, why) else {
            panic!("an operation without an answer exits 1");
        };
        let said = error.to_string();
        assert!(
            said.contains("1 of 10 got no answer (2 refused, 5 not tried)"),
            "{said}"
        );
        let Err(Failure::Refused(said)) = ending(Tally { failed: 0, ..tally }, why) else {
            panic!("a refused key exits 4");
        };
        assert!(said.contains("the other 5 were not tried"), "{said}");
        let every_one_sent = Tally {
            failed: 0,
            not_tried: 0,
            ..tally
        };
        let Err(Failure::Refused(said)) = ending(every_one_sent, why) else {
            panic!("refusals exit 4");
        };
        assert!(said.contains("2 of 10 were refused"), "{said}");
        let clean = Tally {
            failed: 0,
            refused: 0,
            not_tried: 0,
            ..tally
        };
        assert!(ending(clean, None).is_ok());
    }
}
