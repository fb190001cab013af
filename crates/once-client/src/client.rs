//! The handle an executor holds: ask the ledger, run an effect at most once, look an operation
//! up.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt as _;

use crate::attempt::Attempt;
use crate::config::ClientConfig;
use crate::continuity::Positions;
use crate::decision::{Decision, EffectContext, Outcome};
use crate::effect::{Effect, EffectError, Report};
use crate::error::ClientError;
use crate::spec::OperationSpec;
use crate::transport::{Grpc, Patience, Transport};
use crate::view::{OperationView, ServerInfo};
use crate::wire;

/// The reason a ledger refuses to execute while it is behind what a client saw.
pub const LEDGER_BEHIND: &str = "LEDGER_BEHIND";

/// How many positions one RecoverOperations call reports: at most 16 KiB each, within the
/// ledger's request size (1 MiB at least).
const RECOVER_CHUNK: usize = 50;

/// A handle on the ledger. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LedgerClient {
    transport: Transport,
    /// The tenant its reads name, if not the key's own (see [`LedgerClient::reading`]).
    tenant: Option<String>,
    /// Its listings, watches and figures cover every tenant (see
    /// [`LedgerClient::reading_all_tenants`]).
    all_tenants: bool,
    /// What it saw of the ledger, for continuity (see [`LedgerClient::remembering`]).
    positions: Positions,
}

impl LedgerClient {
    /// Prepares the connection; nothing is dialled until the first call.
    pub fn connect(config: ClientConfig) -> Result<Self, ClientError> {
        Ok(Self {
            transport: Transport::new(config)?,
            tenant: None,
            all_tenants: false,
            positions: Positions::in_memory(),
        })
    }

    /// A client over `channel`, a channel to a ledger the caller opened (one served in the same
    /// process, say); `config` gives everything but the endpoints, which name it in errors.
    pub fn over_channel(
        channel: tonic::transport::Channel,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        Ok(Self {
            transport: Transport::over(channel, config)?,
            tenant: None,
            all_tenants: false,
            positions: Positions::in_memory(),
        })
    }

    /// The same client, remembering what it sees of the ledger in `positions` (kept in a file,
    /// they outlive the process; see [`Positions`]): with every Begin it shows the ledger the
    /// highest position it saw, so that a ledger restored to an earlier state refuses to execute
    /// again what it forgot. Every client remembers in memory unless told this.
    pub fn remembering(self, positions: Positions) -> Self {
        Self { positions, ..self }
    }

    /// What this client remembers of the ledger.
    pub fn positions(&self) -> &Positions {
        &self.positions
    }

    /// The same client, its reads (`get`, listings, watches, figures) naming `tenant`: another
    /// tenant's operations, for a key with the admin role.
    pub fn reading(&self, tenant: impl Into<String>) -> Self {
        Self {
            transport: self.transport.clone(),
            tenant: Some(tenant.into()),
            all_tenants: false,
            positions: self.positions.clone(),
        }
    }

    /// The same client, its listings, watches and figures covering every tenant, for a key
    /// with the admin role; each operation and event names its tenant. Its other reads are of
    /// the key's own tenant.
    pub fn reading_all_tenants(&self) -> Self {
        Self {
            transport: self.transport.clone(),
            tenant: None,
            all_tenants: true,
            positions: self.positions.clone(),
        }
    }

    /// The tenant reads name: empty for the key's own.
    pub(crate) fn read_tenant(&self) -> String {
        self.tenant.clone().unwrap_or_default()
    }

    /// Whether listings, watches and figures cover every tenant.
    pub(crate) fn reads_all_tenants(&self) -> bool {
        self.all_tenants
    }

    pub(crate) fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Asks the ledger whether to perform the operation's effect.
    pub async fn begin(&self, spec: &OperationSpec) -> Result<Decision, ClientError> {
        let (operation_id, fingerprint) = spec
            .resolve()
            .map_err(|e| ClientError::Invalid(e.to_string()))?;
        let mut context = spec.context.clone();
        if context.client_name.as_deref().is_none_or(str::is_empty) {
            context.client_name = Some(self.transport.config().client_name.clone());
        }
        // One attempt id for every transport retry of this Begin.
        let attempt_id = uuid::Uuid::new_v4().to_string();
        // The highest position seen, and the latest of this operation.
        let mut shown = (
            self.positions.highest(),
            self.positions.of_operation(&operation_id),
        );
        let mut answered = self
            .begin_showing(
                spec,
                (&operation_id, &fingerprint),
                &attempt_id,
                &context,
                shown.clone(),
            )
            .await;
        // A position the ledger cannot read (a damaged line of the file) would have every Begin
        // refused: it is forgotten, and the Begin sent again without it.
        if let Err(ClientError::Invalid(message)) = &answered {
            let unreadable = [
                (wire::SEEN_POSITION, shown.0.take()),
                (wire::OPERATION_POSITION, shown.1.take()),
            ]
            .into_iter()
            .filter(|(field, _)| message.contains(field))
            .filter_map(|(_, position)| position)
            .collect::<Vec<_>>();
            if !unreadable.is_empty() {
                for position in &unreadable {
                    tracing::warn!(
                        "the ledger cannot read a position this client kept: it is forgotten"
                    );
                    if let Err(error) = self.positions.forget(position) {
                        tracing::warn!(%error, "the positions file could not be rewritten");
                    }
                }
                shown = (
                    self.positions.highest(),
                    self.positions.of_operation(&operation_id),
                );
                answered = self
                    .begin_showing(
                        spec,
                        (&operation_id, &fingerprint),
                        &attempt_id,
                        &context,
                        shown,
                    )
                    .await;
            }
        }
        let response = match answered {
            Err(ClientError::Refused { reason, message }) if reason == LEDGER_BEHIND => {
                self.report_kept().await;
                return Err(ClientError::Refused { reason, message });
            }
            answered => answered?,
        };
        if let Some(position) = wire::granted_position(&response) {
            // Kept before the effect runs. A position that cannot be written weakens only the
            // check of a restore, not this call: the execution goes on, said loudly.
            if let Err(error) = self.positions.record(position).await {
                tracing::error!(%error, "the ledger's position could not be kept: a restore of the ledger to before this call would go unnoticed by this client");
            }
        }
        Ok(wire::decision(response, |operation_id, grant| {
            Attempt::start(self.transport.clone(), operation_id, grant, spec.lease_ttl)
        }))
    }

    /// Runs `effect` at most once for the operation: asks the ledger, performs the effect only
    /// on EXECUTE, and reports what happened. A panic in the effect counts as ambiguous; so does
    /// dropping the returned future while the effect runs. An error means the effect did not
    /// run (the ledger could not be asked, or refused the request).
    pub async fn run<F, Fut>(&self, spec: &OperationSpec, effect: F) -> Result<Outcome, ClientError>
    where
        F: FnOnce(EffectContext) -> Fut,
        Fut: Future<Output = Result<Effect, EffectError>>,
    {
        let attempt = match self.begin(spec).await? {
            Decision::Execute(attempt) => attempt,
            Decision::Replay(replay) => return Ok(Outcome::Replayed(replay)),
            Decision::InProgress(in_progress) => return Ok(Outcome::InProgress(in_progress)),
            Decision::Unknown(unknown) => return Ok(Outcome::Unknown(unknown)),
            Decision::Conflict(conflict) => return Ok(Outcome::Conflict(conflict)),
        };
        let context = EffectContext {
            operation_id: attempt.operation_id().to_owned(),
            provider_key: attempt.provider_key().to_owned(),
            attempt: attempt.number(),
        };
        let operation_id = context.operation_id.clone();
        let (number, fencing_token) = (attempt.number(), attempt.fencing_token());
        // Once the effect has run, its outcome is the truth the caller gets, whether or not the
        // report reaches the ledger: an unreported attempt becomes UNKNOWN when its lease runs
        // out, never ABSENT, so a failed report is logged and not turned into "not performed".
        let performed = AssertUnwindSafe(effect(context))
            .catch_unwind()
            .await
            .unwrap_or_else(|_panic| Err(EffectError::Ambiguous("the effect panicked".into())));
        let reported = attempt.report(Report::from(&performed)).await;
        if let Err(error) = reported {
            // Never the result: it is the tool's, and may hold what a log must not.
            let (report, provider_ref) = match &performed {
                Ok(effect) => ("CONFIRMED", effect.provider_ref.as_deref()),
                Err(EffectError::NotPerformed(_)) => ("ABSENT", None),
                Err(EffectError::Ambiguous(_)) => ("UNKNOWN", None),
            };
            tracing::warn!(
                %operation_id,
                attempt = number,
                fencing_token,
                report,
                provider_ref = provider_ref.unwrap_or("none"),
                %error,
                "the effect ran but its report did not reach the ledger; its lease will expire into UNKNOWN, for its reconciler or an operator to settle"
            );
        }
        Ok(Outcome::performed(operation_id, performed))
    }

    /// The operation as the ledger holds it, with the history of its current life, for status
    /// tools. [`ClientError::NotFound`] when the ledger holds no such operation.
    pub async fn get(&self, operation_id: &str) -> Result<OperationView, ClientError> {
        let request = wire::get_operation(operation_id, self.read_tenant());
        let found = self
            .transport
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_operation(request).await },
                request,
            )
            .await?;
        Ok(wire::operation(found))
    }

    /// Sends one Begin, showing `shown` (the highest position seen, and this operation's).
    async fn begin_showing(
        &self,
        spec: &OperationSpec,
        (operation_id, fingerprint): (&str, &str),
        attempt_id: &str,
        context: &once_core::AttemptContext,
        shown: (Option<String>, Option<String>),
    ) -> Result<wire::BeginAnswer, ClientError> {
        let request = wire::begin(
            spec,
            operation_id.to_owned(),
            fingerprint.to_owned(),
            attempt_id.to_owned(),
            context,
            shown,
        );
        // A bounded wait happens on the server: give the call that much longer.
        let extra = spec.wait.unwrap_or_default();
        self.transport
            .call(
                Patience {
                    extra,
                    ..Patience::default()
                },
                |mut grpc: Grpc, request| async move { grpc.begin(request).await },
                request,
            )
            .await
    }

    /// Reports the positions kept of the ledger the client talks to (at most once a minute),
    /// after it refused to execute as behind them: each operation it lost comes back UNKNOWN.
    async fn report_kept(&self) {
        let Some(ledger) = self.positions.ledger() else {
            return;
        };
        if !self.positions.due_report(&ledger) {
            return;
        }
        let kept = self.positions.latest(&ledger);
        let mut recovered = 0;
        for chunk in kept.chunks(RECOVER_CHUNK) {
            let request = wire::recover_operations(chunk.to_vec());
            let answered = self
                .transport
                .call(
                    Patience::default(),
                    |mut grpc: Grpc, request| async move { grpc.recover_operations(request).await },
                    request,
                )
                .await;
            match answered {
                Ok(response) => recovered += wire::recovered(&response),
                Err(error) => {
                    tracing::warn!(%error, "the positions kept could not be reported to the ledger");
                    return;
                }
            }
        }
        tracing::warn!(
            ledger,
            reported = kept.len(),
            recovered,
            "the ledger is behind what this client saw: the positions kept were reported, and what it had lost is UNKNOWN again"
        );
    }

    /// What the ledger is (its version and database) and who this client is to it (tenant,
    /// key, roles): a check of the address and the key that changes nothing.
    pub async fn server_info(&self) -> Result<ServerInfo, ClientError> {
        let found = self
            .transport
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_server_info(request).await },
                wire::server_info_request(),
            )
            .await?;
        Ok(wire::server_info(found))
    }
}
