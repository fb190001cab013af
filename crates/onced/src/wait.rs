//! A Begin that may wait: how long, for what, and what wakes it.
//!
//! While the decision is IN_PROGRESS for the same operation and the caller asked to wait, the
//! Begin looks again, woken at once by [`Settled`] when this replica records a report, resolution
//! or verdict, until the bound runs out. An UNKNOWN one due for a lookup gets one lookup, under the
//! workers' claim, so a storm of retried Begins is one lookup.

use std::time::Duration;

use once_core::{BeginCommand, BeginDecision, Millis};
use once_store::{Backend, Ledger, StoreError};
use tokio::time::Instant;

use crate::reconciliation::{Reconciliation, Settled};

/// Upper bound on the pause between two looks at an IN_PROGRESS operation during a wait.
const MAX_WAIT_POLL: Duration = Duration::from_millis(250);

/// Decides a Begin, waiting up to `wait` for a better answer: while this very operation is
/// IN_PROGRESS, for its outcome; while it is UNKNOWN, for one synchronous lookup (if one is
/// due), and the decision its verdict allows. Returns the decision and when it was made, by the
/// store's clock.
pub async fn begin<B: Backend>(
    ledger: &Ledger<B>,
    reconciliation: &Reconciliation<B>,
    settled: &Settled,
    cmd: &BeginCommand,
    wait: Duration,
) -> Result<(BeginDecision, Millis), StoreError> {
    let deadline = Instant::now() + wait;
    let mut looked_up = false;
    loop {
        let woken = settled.notified();
        let (decision, at) = ledger.begin(cmd).await?;
        if let BeginDecision::Unknown { blocking: None, .. } = &decision {
            if !looked_up && !wait.is_zero() {
                looked_up = true;
                if reconciliation
                    .settle_before(&cmd.tenant, &cmd.operation_id, deadline)
                    .await
                {
                    continue;
                }
            }
        }
        let Some(retry_after) = worth_waiting_for(&decision) else {
            return Ok((decision, at));
        };
        let now = Instant::now();
        if now >= deadline {
            return Ok((decision, at));
        }
        let pause = retry_after.min(MAX_WAIT_POLL).min(deadline - now);
        tokio::select! {
            _ = woken => {}
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// How long to pause before looking again, when a waiting Begin should wait for `decision` to
/// change: only while this very operation is IN_PROGRESS. When the same intent runs under
/// another id, its outcome must not turn this Begin into a second execution.
fn worth_waiting_for(decision: &BeginDecision) -> Option<Duration> {
    match decision {
        BeginDecision::InProgress {
            retry_after_ms,
            blocking: None,
            ..
        } => Some(Duration::from_millis(
            u64::try_from(*retry_after_ms).unwrap_or(0),
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use once_core::{BeginDecision, OperationId};

    use super::worth_waiting_for;

    #[test]
    fn a_begin_waits_only_for_its_own_operation() {
        let in_progress = |blocking: Option<&str>| BeginDecision::InProgress {
            attempt: 1,
            lease_deadline: 0,
            retry_after_ms: 40,
            blocking: blocking.map(|id| OperationId::parse("id", id).unwrap()),
        };
        assert_eq!(
            worth_waiting_for(&in_progress(None)),
            Some(std::time::Duration::from_millis(40))
        );
        assert_eq!(worth_waiting_for(&in_progress(Some("refund:other"))), None);
        let unknown = BeginDecision::Unknown {
            since: 0,
            reason: None,
            blocking: None,
        };
        assert_eq!(worth_waiting_for(&unknown), None);
    }
}
