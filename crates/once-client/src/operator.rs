//! What on-call tools and dashboards call: list, resolve, reconcile and watch operations, and
//! administer keys. Every call is retried through transport failures with the very same
//! message, as the executor's calls are; a resolution is named by its resolution id, so a
//! retried one is applied once.

use std::time::Duration;

use once_core::access::{Credential, Roles};
use once_core::State;

use crate::client::LedgerClient;
use crate::error::ClientError;
use crate::transport::{AdminGrpc, Failure, Grpc, Patience, Transport};
use crate::view::{ForensicsView, OperationView, StatsView, WatchedEvent};
use crate::wire::{self, EventStream};

/// Which operations a listing holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Any of these states; every state when empty.
    pub states: Vec<State>,
    pub tool: Option<String>,
    /// Only operations whose reconciler (provider) is this one.
    pub provider: Option<String>,
    /// Only operations created at least this long ago.
    pub older_than: Option<Duration>,
}

/// One page of a listing, oldest first, and where the next begins.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    /// Without their results or histories: [`LedgerClient::get`] has those.
    pub operations: Vec<OperationView>,
    /// For [`LedgerClient::list_page`]; `None` on the last page.
    pub next: Option<String>,
}

/// What an operator decided an UNKNOWN operation's truth is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Truth {
    /// The effect happened: its result to replay and the provider's reference.
    Confirmed {
        result: Vec<u8>,
        provider_ref: Option<String>,
    },
    /// The effect certainly did not happen.
    Absent,
}

/// An operator's resolution of an UNKNOWN operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    pub operation_id: String,
    pub truth: Truth,
    /// Why the operator believes it; mandatory.
    pub reason: String,
    /// Who resolves: recorded as `operator:<name>` (with the key's name beside it when it
    /// differs).
    pub operator: String,
    /// Chosen once per resolution, so a retry is applied once.
    pub resolution_id: String,
    /// The fencing token of the attempt the operator examined: the resolution applies only
    /// while it is the latest.
    pub fencing_token: u64,
    /// That attempt's number, checked too when given.
    pub attempt: Option<u32>,
}

/// What a Reconcile found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    pub reconciler: String,
    /// What the reconciler found: CONFIRMED, ABSENT, or UNKNOWN when it could not tell.
    pub verdict: Option<State>,
    /// The operation's state once the ledger applied the verdict.
    pub state: Option<State>,
    /// The evidence found, or why it could not tell.
    pub detail: String,
}

/// Which events a watch receives, and from where.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchRequest {
    /// Resume after this sequence; `None` to start with what is committed from now on.
    pub after: Option<i64>,
    /// Events that moved an operation into or out of these states, or were recorded while it
    /// was in one...
    pub states: Vec<State>,
    /// ...and events of these kinds (every event when both are empty)...
    pub kinds: Vec<String>,
    /// ...of this tool only, when given.
    pub tool: Option<String>,
}

/// What a watch yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watched {
    /// The next event, in sequence order.
    Event(WatchedEvent),
    /// Every wanted event up to this sequence has been received.
    CaughtUpTo(i64),
    /// The stream broke and is being opened again, after `after`: nothing is missed.
    Reconnecting { after: Option<i64>, error: String },
}

/// A watch of the ledger's events that survives broken streams: it reconnects (to any
/// endpoint) after the last sequence it yielded, so it yields every event once, in order.
#[derive(Debug)]
pub struct Watch {
    transport: Transport,
    request: WatchRequest,
    /// The tenant it names: empty for the key's own.
    tenant: String,
    /// It covers every tenant's events.
    all_tenants: bool,
    stream: Option<EventStream>,
    /// Failed tries to open the stream since it last yielded something.
    failures: u32,
    /// Whether a stream was ever open: from then on the watch outlasts any outage.
    opened: bool,
}

impl Watch {
    /// Where the watch would resume: after the last sequence it yielded.
    pub fn resume_point(&self) -> Option<i64> {
        self.request.after
    }

    /// The next item. Errors only for what retrying cannot mend (a refusal, a malformed
    /// request) or when the ledger stays unreachable through every try before the stream
    /// first opens; once it has opened, it reconnects for as long as it takes.
    pub async fn next(&mut self) -> Result<Watched, ClientError> {
        loop {
            let Some(stream) = self.stream.as_mut() else {
                match self.open().await {
                    Ok((stream, start)) => {
                        // A watch from now resumes where it started, even if it breaks before
                        // its first message.
                        if self.request.after.is_none() {
                            self.request.after = start;
                        }
                        self.stream = Some(stream);
                        continue;
                    }
                    Err(status) => return self.broken(&status).await,
                }
            };
            let watched = match stream.message().await {
                Ok(Some(message)) => wire::watched(message),
                Ok(None) => {
                    let ended = tonic::Status::unavailable("the stream ended");
                    return self.broken(&ended).await;
                }
                Err(status) => return self.broken(&status).await,
            };
            self.failures = 0;
            self.opened = true;
            match watched {
                Some(Watched::Event(event)) => {
                    self.request.after = Some(event.event.sequence);
                    return Ok(Watched::Event(event));
                }
                Some(Watched::CaughtUpTo(sequence)) => {
                    self.request.after = Some(sequence);
                    return Ok(Watched::CaughtUpTo(sequence));
                }
                Some(Watched::Reconnecting { .. }) | None => continue,
            }
        }
    }

    /// Drops the stream and says so; the next call opens it again after a pause. A failure
    /// no retry mends ends the watch.
    async fn broken(&mut self, status: &tonic::Status) -> Result<Watched, ClientError> {
        let error = match self.transport.failure(status).await {
            Failure::Final(error) => return Err(error),
            Failure::Passing(unreachable) => unreachable,
        };
        self.stream = None;
        self.failures += 1;
        let config = self.transport.config();
        // A watch that never opened gives up like any call; one that did is there to outlast
        // restarts and deploys, and keeps trying.
        if !self.opened && self.failures > config.tries.max(1) {
            return Err(ClientError::Unreachable(error));
        }
        let pause = (config.backoff * 2u32.saturating_pow((self.failures - 1).min(16)))
            .min(Duration::from_secs(2));
        tokio::time::sleep(pause).await;
        Ok(Watched::Reconnecting {
            after: self.request.after,
            error: error.to_string(),
        })
    }

    /// Opens the stream; returns it and the sequence it starts after, as the ledger says.
    async fn open(&self) -> Result<(EventStream, Option<i64>), tonic::Status> {
        let request = wire::watch(&self.request, self.tenant.clone(), self.all_tenants);
        // No deadline: the stream lasts as long as the watcher wants it.
        let request = self.transport.authorized(request);
        let response = self.transport.grpc().watch_operations(request).await?;
        let start = response
            .metadata()
            .get(once_api::WATCH_START_HEADER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse().ok());
        Ok((response.into_inner(), start))
    }
}

impl LedgerClient {
    /// One page of operations, oldest first: from the start, or from `page` (a previous page's
    /// `next`). At most `page_size` (1 to 1000).
    pub async fn list_page(
        &self,
        filter: &ListFilter,
        page_size: u32,
        page: Option<&str>,
    ) -> Result<Page, ClientError> {
        let request = wire::list(
            filter,
            page_size,
            page,
            self.read_tenant(),
            self.reads_all_tenants(),
        );
        let listed = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.list_operations(request).await },
                request,
            )
            .await?;
        Ok(wire::page(listed))
    }

    /// Settles an UNKNOWN operation as an operator; returns its state afterwards. Retried
    /// through transport failures with the same resolution id, so it is applied once.
    pub async fn resolve(&self, resolution: &Resolution) -> Result<State, ClientError> {
        let request = wire::resolve(resolution);
        let resolved = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.resolve(request).await },
                request,
            )
            .await?;
        Ok(wire::state(resolved.state).unwrap_or(State::Unknown))
    }

    /// Looks an UNKNOWN operation up with its reconciler now and applies the verdict; the
    /// lookup's events name `operator` as who asked (the key's name when empty). The lookup
    /// may take up to the reconciler's timeout: `wait` bounds the call.
    pub async fn reconcile(
        &self,
        operation_id: &str,
        operator: &str,
        wait: Duration,
    ) -> Result<Reconciled, ClientError> {
        let request = wire::reconcile(operation_id, operator);
        let reconciled = self
            .transport()
            .call(
                Patience {
                    extra: wait,
                    ..Patience::default()
                },
                |mut grpc: Grpc, request| async move { grpc.reconcile(request).await },
                request,
            )
            .await?;
        Ok(wire::reconciled(reconciled))
    }

    /// The tenant's figures: now, and over the last `window`.
    pub async fn stats(&self, window: Duration) -> Result<StatsView, ClientError> {
        let request = wire::get_stats(window, self.read_tenant(), self.reads_all_tenants());
        let found = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_stats(request).await },
                request,
            )
            .await?;
        Ok(wire::stats(found))
    }

    /// Where the repeated calls of the tenant's operations (of one tool, when given) came from
    /// over the last `since`.
    pub async fn forensics(
        &self,
        tool: Option<&str>,
        since: Duration,
    ) -> Result<ForensicsView, ClientError> {
        let request = wire::get_forensics(tool, since, self.read_tenant());
        let found = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_forensics(request).await },
                request,
            )
            .await?;
        Ok(wire::forensics(found))
    }

    /// Walks the tenant's chained history from the link covering events after `from` (0: the
    /// whole chain kept) and says what does not match what the chain recorded.
    pub async fn verify_history(&self, from: i64) -> Result<crate::HistoryView, ClientError> {
        let request = wire::verify_history(from, self.read_tenant());
        let found = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.verify_history(request).await },
                request,
            )
            .await?;
        Ok(wire::history(found))
    }

    /// The tenant's chain as it stands: its newest link and the last verification recorded.
    pub async fn history_head(&self) -> Result<crate::HistoryHead, ClientError> {
        let request = wire::get_history_head(self.read_tenant());
        let found = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_history_head(request).await },
                request,
            )
            .await?;
        Ok(wire::history_head(found))
    }

    /// The signed receipt of a CONFIRMED or ABSENT operation of the tenant, as text to keep
    /// and verify ([`crate::Receipt::verify`]). Refused `NOT_SETTLED` while it is neither, and
    /// `NO_SIGNING_KEY` by a ledger without a signing key.
    pub async fn receipt(&self, operation_id: &str) -> Result<String, ClientError> {
        let request = wire::get_receipt(operation_id, self.read_tenant());
        let found = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_receipt(request).await },
                request,
            )
            .await?;
        Ok(found.receipt)
    }

    /// The public keys the ledger says verify its receipts. A verifier that must not take the
    /// ledger's word pins the keys `onced signing-keys` prints instead.
    pub async fn signing_keys(&self) -> Result<crate::SigningKeys, ClientError> {
        let found = self
            .transport()
            .call(
                Patience::default(),
                |mut grpc: Grpc, request| async move { grpc.get_signing_keys(request).await },
                wire::get_signing_keys(),
            )
            .await?;
        Ok(wire::signing_keys(found))
    }

    /// Watches the ledger's events: see [`Watch`]. Nothing is sent until the first
    /// [`Watch::next`].
    pub fn watch(&self, request: WatchRequest) -> Watch {
        Watch {
            transport: self.transport().clone(),
            request,
            tenant: self.read_tenant(),
            all_tenants: self.reads_all_tenants(),
            stream: None,
            failures: 0,
            opened: false,
        }
    }

    /// Creates an API key for `tenant` with `roles` (admin), or registers a PEM client
    /// certificate instead; returns the credential and, for a key, its secret, shown this once.
    pub async fn create_key(
        &self,
        tenant: &str,
        name: &str,
        roles: &Roles,
        certificate_pem: Option<&str>,
    ) -> Result<(Credential, Option<String>), ClientError> {
        let request = wire::create_key(tenant, name, roles, certificate_pem);
        let created = self
            .transport()
            .call(
                Patience::default(),
                |mut admin: AdminGrpc, request| async move { admin.create_key(request).await },
                request,
            )
            .await?;
        wire::created_key(created)
    }

    /// The credentials of `tenant`, or of every tenant (admin). Never a secret.
    pub async fn list_keys(&self, tenant: Option<&str>) -> Result<Vec<Credential>, ClientError> {
        let request = wire::list_keys(tenant);
        let listed = self
            .transport()
            .call(
                Patience::default(),
                |mut admin: AdminGrpc, request| async move { admin.list_keys(request).await },
                request,
            )
            .await?;
        listed.keys.into_iter().map(wire::credential).collect()
    }

    /// Revokes a credential (admin); returns it as revoked.
    pub async fn revoke_key(&self, key_id: &str) -> Result<Credential, ClientError> {
        let request = wire::revoke_key(key_id);
        let revoked = self
            .transport()
            .call(
                Patience::default(),
                |mut admin: AdminGrpc, request| async move { admin.revoke_key(request).await },
                request,
            )
            .await?;
        wire::credential(revoked)
    }
}
