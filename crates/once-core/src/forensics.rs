//! Why an operation was called more than once: every call of it — the attempts granted and the
//! duplicates answered without a new execution right — in time order, each after the first
//! classified by what it shares with the calls before it (`../shared/SPEC.md` §1):
//!
//! | origin | fingerprint |
//! |---|---|
//! | transport retry | the same attempt id (the client library sent its Begin again), or the same MCP session and JSON-RPC request id (a proxy or transport below the client) |
//! | harness retry | the same session, a new request id |
//! | model re-issue | a new operation id for the same intent, caught by the fresh-id guard |
//! | reconnect | the same client, a new session (a resumed stream, queued work replayed) |
//! | another client | a client name and credential no call before had |
//! | unattributed | the same client with no session to tell by |

use std::fmt;

use crate::model::{
    Actor, Attempt, AttemptContext, BeginCommand, BeginDecision, Millis, OperationId,
};

/// A Begin answered without a new execution right (REPLAY, IN_PROGRESS, UNKNOWN, CONFLICT, or
/// the same grant again), recorded for forensics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    pub tenant: String,
    /// The operation it was about: for a Begin the fresh-id guard stopped, the operation that
    /// stopped it.
    pub operation_id: OperationId,
    pub tool: String,
    /// When it was decided, by the store's clock.
    pub at: Millis,
    /// `REPLAY`, `IN_PROGRESS`, `UNKNOWN`, `CONFLICT`, or `EXECUTE` for the same grant again.
    pub decision: String,
    pub attempt_id: String,
    pub context: AttemptContext,
    pub actor: Actor,
    /// The operation id the caller asked for, when the fresh-id guard answered for another.
    pub requested: Option<OperationId>,
}

impl Duplicate {
    /// The duplicate `decision` makes of `cmd`, answered at `at`: `None` when the Begin was
    /// granted a new execution right.
    pub fn of(cmd: &BeginCommand, decision: &BeginDecision, at: Millis) -> Option<Self> {
        let (operation_id, requested) = match decision {
            BeginDecision::Execute(grant) if !grant.regranted => return None,
            BeginDecision::InProgress {
                blocking: Some(other),
                ..
            }
            | BeginDecision::Unknown {
                blocking: Some(other),
                ..
            } => (other.clone(), Some(cmd.operation_id.clone())),
            _ => (cmd.operation_id.clone(), None),
        };
        Some(Duplicate {
            tenant: cmd.tenant.clone(),
            operation_id,
            tool: cmd.tool.clone(),
            at,
            decision: decision.name().to_owned(),
            attempt_id: cmd.attempt_id.clone(),
            context: cmd.context.clone(),
            actor: cmd.actor.clone(),
            requested,
        })
    }
}

/// Where a repeated call came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Origin {
    TransportRetry,
    HarnessRetry,
    ModelReissue,
    Reconnect,
    OtherClient,
    Unattributed,
}

impl Origin {
    pub const ALL: [Origin; 6] = [
        Origin::TransportRetry,
        Origin::HarnessRetry,
        Origin::ModelReissue,
        Origin::Reconnect,
        Origin::OtherClient,
        Origin::Unattributed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Origin::TransportRetry => "transport_retry",
            Origin::HarnessRetry => "harness_retry",
            Origin::ModelReissue => "model_reissue",
            Origin::Reconnect => "reconnect",
            Origin::OtherClient => "other_client",
            Origin::Unattributed => "unattributed",
        }
    }

    pub fn parse(s: &str) -> Option<Origin> {
        Self::ALL.into_iter().find(|origin| origin.as_str() == s)
    }

    /// As people say it, for one and for several.
    fn said(self, count: usize) -> String {
        let (one, many) = match self {
            Origin::TransportRetry => ("transport retry", "transport retries"),
            Origin::HarnessRetry => ("harness retry", "harness retries"),
            Origin::ModelReissue => ("model re-issue", "model re-issues"),
            Origin::Reconnect => ("reconnect", "reconnects"),
            Origin::OtherClient => ("call from another client", "calls from other clients"),
            Origin::Unattributed => ("unattributed call", "unattributed calls"),
        };
        format!("{count} {}", if count == 1 { one } else { many })
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One call of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub at: Millis,
    /// The attempt it was granted, for a call that got a new execution right.
    pub attempt: Option<u32>,
    /// `EXECUTE` for a granted attempt, else what the duplicate was answered.
    pub decision: String,
    pub attempt_id: String,
    pub context: AttemptContext,
    pub actor: Actor,
    pub requested: Option<OperationId>,
    /// Where it came from; `None` for the first call.
    pub origin: Option<Origin>,
}

/// Every call of one life of an operation, oldest first, each after the first classified.
/// `attempts` are the life's attempt log; `duplicates` its recorded duplicates.
pub fn classify(attempts: &[Attempt], duplicates: &[Duplicate]) -> Vec<Call> {
    let mut calls: Vec<Call> = attempts
        .iter()
        .map(|a| Call {
            at: a.started_at,
            attempt: Some(a.number),
            decision: "EXECUTE".into(),
            attempt_id: a.attempt_id.clone(),
            context: a.context.clone(),
            actor: a.actor.clone(),
            requested: None,
            origin: None,
        })
        .chain(duplicates.iter().map(|d| Call {
            at: d.at,
            attempt: None,
            decision: d.decision.clone(),
            attempt_id: d.attempt_id.clone(),
            context: d.context.clone(),
            actor: d.actor.clone(),
            requested: d.requested.clone(),
            origin: None,
        }))
        .collect();
    // Oldest first; a granted attempt before a duplicate at the same moment (it came first).
    calls.sort_by_key(|c| (c.at, c.attempt.is_none()));
    for i in 1..calls.len() {
        let origin = origin(&calls[..i], &calls[i]);
        calls[i].origin = Some(origin);
    }
    calls
}

/// Where `call` came from, given the calls before it: told by what it shares with any of them,
/// so calls of two clients interleaved are each told apart from the other's.
fn origin(earlier: &[Call], call: &Call) -> Origin {
    let same_request = |c: &Call| {
        c.context.session_id.is_some()
            && c.context.session_id == call.context.session_id
            && c.context.request_id.is_some()
            && c.context.request_id == call.context.request_id
    };
    if earlier
        .iter()
        .any(|c| c.attempt_id == call.attempt_id || same_request(c))
    {
        return Origin::TransportRetry;
    }
    if call.requested.is_some() {
        return Origin::ModelReissue;
    }
    let same_client: Vec<&Call> = earlier
        .iter()
        .filter(|c| c.actor == call.actor && c.context.client_name == call.context.client_name)
        .collect();
    if same_client.is_empty() {
        return Origin::OtherClient;
    }
    match &call.context.session_id {
        Some(session)
            if same_client
                .iter()
                .any(|c| c.context.session_id.as_ref() == Some(session)) =>
        {
            Origin::HarnessRetry
        }
        Some(_) if same_client.iter().any(|c| c.context.session_id.is_some()) => Origin::Reconnect,
        _ => Origin::Unattributed,
    }
}

/// How often an operation (or many) was called, and where the repeats came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Calls that were granted an execution right.
    pub executions: usize,
    /// Calls answered without one: the duplicates the ledger prevented.
    pub prevented: usize,
    /// Every repeated call (granted or not) by origin, in [`Origin::ALL`] order.
    pub origins: Vec<(Origin, usize)>,
}

impl Summary {
    pub fn of(calls: &[Call]) -> Self {
        let mut summary = Summary::default();
        summary.add(calls);
        summary
    }

    /// Counts `calls` too.
    pub fn add(&mut self, calls: &[Call]) {
        for call in calls {
            if call.attempt.is_some() {
                self.executions += 1;
            } else {
                self.prevented += 1;
            }
            if let Some(origin) = call.origin {
                match self.origins.iter_mut().find(|(s, _)| *s == origin) {
                    Some((_, count)) => *count += 1,
                    None => self.origins.push((origin, 1)),
                }
            }
        }
        self.origins.sort();
    }
}

impl fmt::Display for Summary {
    /// "2 executions, 3 duplicates prevented: 2 harness retries, 1 reconnect, 1 model
    /// re-issue".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        write!(
            f,
            "{}, {}",
            plural(self.executions, "execution", "executions"),
            plural(
                self.prevented,
                "duplicate prevented",
                "duplicates prevented"
            )
        )?;
        if !self.origins.is_empty() {
            let origins: Vec<String> = self.origins.iter().map(|(s, n)| s.said(*n)).collect();
            write!(f, ": {}", origins.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FencingToken;

    fn context(client: &str, session: Option<&str>, request: Option<&str>) -> AttemptContext {
        AttemptContext {
            client_name: Some(client.into()),
            session_id: session.map(str::to_owned),
            request_id: request.map(str::to_owned),
        }
    }

    fn attempt(number: u32, at: Millis, id: &str, context: AttemptContext) -> Attempt {
        Attempt {
            number,
            fencing_token: FencingToken(1000 + u64::from(number)),
            life: FencingToken(1001),
            attempt_id: id.into(),
            started_at: at,
            lease_deadline: at + 30_000,
            actor: Actor::Executor("refund-mcp".into()),
            holder: None,
            context,
        }
    }

    fn duplicate(at: Millis, id: &str, context: AttemptContext) -> Duplicate {
        Duplicate {
            tenant: "default".into(),
            operation_id: OperationId::parse("id", "refund:o-1").unwrap(),
            tool: "issue_refund".into(),
            at,
            decision: "REPLAY".into(),
            attempt_id: id.into(),
            context,
            actor: Actor::Executor("refund-mcp".into()),
            requested: None,
        }
    }

    /// One check per origin: the first call and the one after it.
    fn check(second: Duplicate, expected: Origin) {
        let first = attempt(1, 10_000, "a-1", context("claude", Some("s-1"), Some("7")));
        let calls = classify(&[first], std::slice::from_ref(&second));
        assert_eq!(calls[0].origin, None);
        assert_eq!(calls[1].origin, Some(expected), "{second:?}");
    }

    #[test]
    fn each_source_is_told_by_its_fingerprint() {
        let ctx = context;
        check(
            duplicate(10_005, "a-1", ctx("claude", Some("s-1"), Some("7"))),
            Origin::TransportRetry,
        );
        check(
            duplicate(10_005, "a-2", ctx("claude", Some("s-1"), Some("7"))),
            Origin::TransportRetry,
        );
        check(
            duplicate(10_300, "a-2", ctx("claude", Some("s-1"), Some("8"))),
            Origin::HarnessRetry,
        );
        // However long the harness waited before asking again.
        check(
            duplicate(55_000, "a-2", ctx("claude", Some("s-1"), Some("9"))),
            Origin::HarnessRetry,
        );
        check(
            duplicate(12_000, "a-2", ctx("claude", Some("s-2"), Some("1"))),
            Origin::Reconnect,
        );
        check(
            duplicate(12_000, "a-2", ctx("cursor", Some("s-9"), Some("1"))),
            Origin::OtherClient,
        );
        check(
            duplicate(12_000, "a-2", ctx("claude", None, None)),
            Origin::Unattributed,
        );
        let mut reissued = duplicate(40_000, "a-2", ctx("claude", Some("s-1"), Some("12")));
        reissued.requested = Some(OperationId::parse("id", "refund:x:key-2").unwrap());
        check(reissued, Origin::ModelReissue);
        let mut another_key = duplicate(12_000, "a-2", ctx("claude", Some("s-2"), Some("1")));
        another_key.actor = Actor::Executor("other-server".into());
        check(another_key, Origin::OtherClient);
    }

    #[test]
    fn a_call_is_told_by_every_call_before_it_not_only_the_last() {
        let ctx = context;
        let attempts = [attempt(
            1,
            1_000,
            "a-1",
            ctx("claude", Some("s-1"), Some("3")),
        )];
        let duplicates = [
            duplicate(1_100, "a-2", ctx("cursor", Some("s-9"), Some("1"))),
            duplicate(1_200, "a-3", ctx("claude", Some("s-1"), Some("4"))),
            duplicate(1_300, "a-4", ctx("cursor", Some("s-10"), Some("1"))),
            duplicate(1_400, "a-5", ctx("claude", Some("s-1"), Some("3"))),
        ];
        let origins: Vec<_> = classify(&attempts, &duplicates)
            .into_iter()
            .map(|c| c.origin)
            .collect();
        assert_eq!(
            origins,
            [
                None,
                Some(Origin::OtherClient),
                Some(Origin::HarnessRetry),
                Some(Origin::Reconnect),
                Some(Origin::TransportRetry),
            ]
        );
    }

    #[test]
    fn calls_are_ordered_in_time_across_attempts_and_duplicates() {
        let ctx = context;
        let attempts = [
            attempt(1, 1_000, "a-1", ctx("claude", Some("s-1"), Some("3"))),
            attempt(2, 90_000, "a-9", ctx("claude", Some("s-2"), Some("1"))),
        ];
        let duplicates = [
            duplicate(1_200, "a-2", ctx("claude", Some("s-1"), Some("4"))),
            duplicate(1_400, "a-3", ctx("claude", Some("s-1"), Some("5"))),
            duplicate(90_100, "a-9", ctx("claude", Some("s-2"), Some("1"))),
        ];
        let calls = classify(&attempts, &duplicates);
        let origins: Vec<Option<Origin>> = calls.iter().map(|c| c.origin).collect();
        assert_eq!(
            origins,
            [
                None,
                Some(Origin::HarnessRetry),
                Some(Origin::HarnessRetry),
                Some(Origin::Reconnect),
                Some(Origin::TransportRetry),
            ]
        );
        let summary = Summary::of(&calls);
        assert_eq!(
            summary.to_string(),
            "2 executions, 3 duplicates prevented: 1 transport retry, 2 harness retries, 1 reconnect"
        );
        assert_eq!(
            Summary::of(&calls[..1]).to_string(),
            "1 execution, 0 duplicates prevented"
        );
    }
}
