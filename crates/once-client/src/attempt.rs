//! The execution right granted by an EXECUTE decision.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;

use crate::effect::{Effect, Report};
use crate::error::ClientError;
use crate::transport::{Grpc, Patience, Retries, Transport};
use crate::wire;

/// The lease assumed when a ledger too old to say what it granted does not.
const FALLBACK_LEASE: Duration = Duration::from_secs(30);

/// What an EXECUTE granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grant {
    pub attempt: u32,
    pub fencing_token: u64,
    pub provider_key: String,
    pub lease_deadline: Option<SystemTime>,
    /// The lease the ledger granted, when it says.
    pub lease_ttl: Option<Duration>,
}

/// The right to perform one operation's effect once.
///
/// While it lives, a background task heartbeats the lease, so an effect may run longer than one
/// lease. Report exactly once with [`report`](Self::report) (or [`confirm`](Self::confirm),
/// [`absent`](Self::absent), [`unknown`](Self::unknown)). Dropped without a report (an early
/// return, a cancelled future, a panic), it reports UNKNOWN on its own: an attempt that did not
/// say what happened never becomes ABSENT.
#[derive(Debug)]
pub struct Attempt {
    transport: Transport,
    operation_id: String,
    grant: Grant,
    /// Stops the heartbeat task when the attempt reports or is dropped.
    stop_heartbeat: Arc<Notify>,
    reported: bool,
}

impl Attempt {
    /// Starts heartbeating the lease of `grant`: the lease the ledger granted (its default when
    /// the spec asked for none), not an assumed one.
    pub(crate) fn start(
        transport: Transport,
        operation_id: String,
        grant: Grant,
        requested_ttl: Option<Duration>,
    ) -> Self {
        let lease_ttl = grant
            .lease_ttl
            .filter(|ttl| !ttl.is_zero())
            .or(requested_ttl)
            .unwrap_or(FALLBACK_LEASE);
        let stop_heartbeat = Arc::new(Notify::new());
        tokio::spawn(heartbeat(
            transport.clone(),
            operation_id.clone(),
            grant.fencing_token,
            lease_ttl,
            stop_heartbeat.clone(),
        ));
        Self {
            transport,
            operation_id,
            grant,
            stop_heartbeat,
            reported: false,
        }
    }

    pub fn operation_id(&self) -> &str {
        &self.operation_id
    }

    /// The key to pass to the provider's idempotency mechanism.
    pub fn provider_key(&self) -> &str {
        &self.grant.provider_key
    }

    pub fn number(&self) -> u32 {
        self.grant.attempt
    }

    pub fn fencing_token(&self) -> u64 {
        self.grant.fencing_token
    }

    pub fn lease_deadline(&self) -> Option<SystemTime> {
        self.grant.lease_deadline
    }

    /// Tells the ledger what happened, once; a retry of the report is the same report.
    pub async fn report(mut self, report: Report) -> Result<(), ClientError> {
        self.reported = true;
        self.stop_heartbeat.notify_one();
        send_report(
            &self.transport,
            &self.operation_id,
            self.grant.fencing_token,
            report,
        )
        .await
    }

    /// The effect happened: the ledger stores `result` and replays it to every later caller.
    pub async fn confirm(
        self,
        result: Vec<u8>,
        provider_ref: Option<String>,
    ) -> Result<(), ClientError> {
        let effect = Effect {
            result,
            provider_ref,
        };
        self.report(Report::Confirmed(effect)).await
    }

    /// The effect certainly did not happen; a later attempt may run.
    pub async fn absent(self, reason: &str) -> Result<(), ClientError> {
        let reason = reason.to_owned();
        self.report(Report::Absent { reason }).await
    }

    /// Nobody can tell whether the effect happened.
    pub async fn unknown(self, reason: &str) -> Result<(), ClientError> {
        let reason = reason.to_owned();
        self.report(Report::Unknown { reason }).await
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.stop_heartbeat.notify_one();
        if self.reported {
            return;
        }
        let (transport, id, token) = (
            self.transport.clone(),
            self.operation_id.clone(),
            self.grant.fencing_token,
        );
        let report = Report::Unknown {
            reason: "the attempt ended without a report".into(),
        };
        // Best effort: if this report is lost too, the lease runs out and the ledger makes the
        // operation UNKNOWN by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = send_report(&transport, &id, token, report).await {
                    tracing::warn!(operation_id = %id, %error, "could not report an abandoned attempt; its lease will expire");
                }
            });
        }
    }
}

/// The one path a report takes to the ledger, whichever its kind.
async fn send_report(
    transport: &Transport,
    operation_id: &str,
    fencing_token: u64,
    report: Report,
) -> Result<(), ClientError> {
    let operation_id = operation_id.to_owned();
    match report {
        Report::Confirmed(effect) => {
            let request = wire::confirm(operation_id, fencing_token, effect);
            let send = |mut grpc: Grpc, r| async move { grpc.confirm(r).await };
            transport.call(Patience::default(), send, request).await?;
        }
        Report::Absent { reason } => {
            let request = wire::report_absent(operation_id, fencing_token, reason);
            let send = |mut grpc: Grpc, r| async move { grpc.report_absent(r).await };
            transport.call(Patience::default(), send, request).await?;
        }
        Report::Unknown { reason } => {
            let request = wire::report_unknown(operation_id, fencing_token, reason);
            let send = |mut grpc: Grpc, r| async move { grpc.report_unknown(r).await };
            transport.call(Patience::default(), send, request).await?;
        }
    }
    Ok(())
}

/// Extends the lease every third of its length until stopped or refused. A heartbeat that
/// cannot reach the ledger is tried again until the lease would have ended, so an outage
/// shorter than the lease (a database failover) costs the attempt nothing.
async fn heartbeat(
    transport: Transport,
    operation_id: String,
    token: u64,
    ttl: Duration,
    stop: Arc<Notify>,
) {
    let period = (ttl / 3).max(Duration::from_millis(20));
    let started = tokio::time::Instant::now();
    let mut lease_ends = started + ttl;
    // Each heartbeat is due a period after the last one was sent, not after it was answered:
    // a slow answer does not push the next one later and eat into the lease.
    let mut due = started + period;
    loop {
        tokio::select! {
            _ = stop.notified() => return,
            _ = tokio::time::sleep_until(due) => {}
        }
        let request = wire::heartbeat(&operation_id, token, ttl);
        let sent = tokio::time::Instant::now();
        let extended = transport.call(
            Patience {
                retries: Retries::Until(lease_ends),
                ..Patience::default()
            },
            |mut grpc: Grpc, r| async move { grpc.heartbeat(r).await },
            request,
        );
        tokio::select! {
            _ = stop.notified() => return,
            extended = extended => match extended {
                // The ledger extended the lease from some moment after `sent`.
                Ok(_) => {
                    lease_ends = sent + ttl;
                    due = sent + period;
                }
                Err(error) => {
                    tracing::warn!(%operation_id, %error, "lease heartbeat failed; the attempt lost its lease");
                    return;
                }
            }
        }
    }
}
