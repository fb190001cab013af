//! Continuity in the replica (see `once_core::continuity`): every execution granted goes out
//! with its sealed position; the position a Begin shows is judged against the ledger; a tenant
//! found behind is held (in the database, for every replica) until an operator accepts the
//! loss; and the positions a client reports bring back what the ledger lost.
//!
//! What a replica keeps in memory is a cache of the database, read again every
//! [`Continuity::FRESH`]: each tenant's epoch and hold, the highest token issued, and the
//! positions whose claims it found (or granted itself). A hold found here is written before the
//! Begin that showed it is answered, so it holds on every replica within that time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use once_core::continuity::{self, Behind, Check, Held, Opened, Position, Seal, Standing};
use once_core::{Actor, BeginCommand, FencingToken, Grant, Holder, Millis, OperationId};
use once_store::{Backend, Ledger, StoreError};
use tonic::Status;

use crate::status;

/// The positions this replica found good (or sealed), kept at most this many.
const MAX_FOUND: usize = 100_000;

/// The other ledgers a replica says it was shown positions of, at most this many.
const MAX_ELSEWHERE: usize = 64;

/// What a Begin may be answered, as [`Continuity::judge`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judged {
    /// Anything.
    Free,
    /// The tenant's executions are held: anything but an execution.
    Held(Held),
    /// The Begin showed a position the ledger cannot account for: nothing, whatever it asks,
    /// so that its client reports what it kept (the tenant is held, as `Held` says).
    Behind(Held),
    /// The Begin showed a grant of an epoch whose loss was accepted, which the ledger has no
    /// record of: nothing, so that its client reports it; the tenant is not held.
    Lost(Behind),
}

/// A position whose claim was found: its tenant, operation and token.
type Found = (String, String, u64);

fn found_key(tenant: &str, id: &OperationId, token: FencingToken) -> Found {
    (tenant.to_owned(), id.to_string(), token.get())
}

/// A replica's view of continuity. Cheap to clone.
#[derive(Clone)]
pub struct Continuity<B: Backend> {
    inner: Arc<Inner<B>>,
}

impl<B: Backend> std::fmt::Debug for Continuity<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Continuity")
            .field("ledger", &self.inner.seal.ledger())
            .finish_non_exhaustive()
    }
}

struct Inner<B: Backend> {
    seal: Seal,
    ledger: Ledger<B>,
    /// How long retention keeps events: a claim older than that may be gone with them.
    events_kept_ms: i64,
    known: Mutex<Known>,
}

/// What the replica read of the database, and when.
#[derive(Default)]
struct Known {
    standings: HashMap<String, Standing>,
    standings_read: Option<Instant>,
    issued_through: FencingToken,
    issued_read: Option<Instant>,
    /// Positions whose claim is in the history, and when that was seen: by tenant, operation
    /// and token, as a ledger that moved on over what it lost grants the same token to another
    /// operation.
    found: HashMap<Found, Instant>,
    /// The other ledgers clients showed positions of (each said once).
    elsewhere: std::collections::HashSet<String>,
}

impl<B: Backend> Continuity<B> {
    /// How long what the replica read of the database stands for it: a hold written by
    /// another replica, or an acceptance, is seen within this.
    pub const FRESH: Duration = Duration::from_secs(1);

    /// Reads (or makes, on a new database) the ledger's identity.
    pub async fn open(ledger: Ledger<B>, events_kept: Duration) -> Result<Self, StoreError> {
        let mut made = [0u8; 40];
        getrandom::getrandom(&mut made).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let id: String = made[..8].iter().map(|b| format!("{b:02x}")).collect();
        let key: [u8; 32] = made[8..].try_into().expect("32 bytes");
        let (id, key) = ledger.backend().identity((&id, key)).await?;
        let this = Self {
            inner: Arc::new(Inner {
                seal: Seal::new(id, key),
                ledger,
                events_kept_ms: once_core::duration_ms(events_kept),
                known: Mutex::new(Known::default()),
            }),
        };
        this.standings().await?;
        Ok(this)
    }

    /// The ledger's identity.
    pub fn ledger_id(&self) -> &str {
        self.inner.seal.ledger()
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.inner.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every tenant with an epoch or a hold, read again when older than [`Self::FRESH`].
    pub async fn standings(&self) -> Result<Vec<Standing>, StoreError> {
        let fresh = self
            .known()
            .standings_read
            .is_some_and(|at| at.elapsed() < Self::FRESH);
        if !fresh {
            let read = self.inner.ledger.backend().standings().await?;
            let mut known = self.known();
            known.standings = read.into_iter().map(|s| (s.tenant.clone(), s)).collect();
            known.standings_read = Some(Instant::now());
        }
        Ok(self.known().standings.values().cloned().collect())
    }

    async fn standing(&self, tenant: &str) -> Result<(u64, Option<Held>), StoreError> {
        self.standings().await?;
        Ok(self
            .known()
            .standings
            .get(tenant)
            .map_or((0, None), |s| (s.epoch, s.held.clone())))
    }

    /// What a Begin of `tenant` showing `shown` (each position it sent, with its field) may be
    /// answered. A position that is not this ledger's well-sealed one is refused.
    pub async fn judge(&self, tenant: &str, shown: &[(&str, &str)]) -> Result<Judged, Status> {
        let (epoch, held) = self.standing(tenant).await.map_err(status::store)?;
        let mut found = None;
        for (field, text) in shown {
            let position = match self
                .inner
                .seal
                .open_field(field, text)
                .map_err(status::invalid)?
            {
                Opened::Ours(position) if position.tenant == tenant => *position,
                // Another tenant's proves nothing about this one.
                Opened::Ours(_) => continue,
                Opened::Elsewhere { ledger } => {
                    self.elsewhere(&ledger);
                    continue;
                }
            };
            let behind = self.behind(&position, epoch).await.map_err(status::store)?;
            // One of this epoch outweighs one of an epoch whose loss was accepted.
            if let Some(behind) = behind {
                if found
                    .as_ref()
                    .is_none_or(|b: &Behind| b.client_epoch < epoch)
                {
                    found = Some(behind);
                }
            }
        }
        let Some(behind) = found else {
            return Ok(held.map_or(Judged::Free, Judged::Held));
        };
        if behind.client_epoch < epoch {
            // A client that did not report before the loss was accepted: this Begin is refused,
            // so that it does; the tenant is not held again.
            tracing::warn!(
                tenant,
                operation_id = %behind.operation_id,
                client_token = %behind.client_token,
                "a client showed a grant of an earlier epoch the ledger has no record of: refused until it reports"
            );
            return Ok(Judged::Lost(behind));
        }
        if let Some(held) = held {
            return Ok(Judged::Behind(held));
        }
        let standing = self
            .inner
            .ledger
            .backend()
            .hold(tenant, &behind)
            .await
            .map_err(status::store)?;
        tracing::error!(
            tenant,
            why = behind.why.as_str(),
            client_token = %behind.client_token,
            ledger_token = %behind.ledger_token,
            operation_id = %behind.operation_id,
            "the ledger is behind what a client saw: it was restored to an earlier state. \
             No execution is granted to the tenant until an operator runs `onced continuity accept`"
        );
        let held = standing.held.clone();
        self.known().standings.insert(tenant.to_owned(), standing);
        // Held in another epoch meanwhile (an acceptance): the position is of the one before.
        Ok(held.map_or(Judged::Lost(behind), Judged::Behind))
    }

    /// Says, once per ledger, that a client showed another ledger's position: this database
    /// is not the one that client talked to (a new one, or one made before positions were).
    fn elsewhere(&self, ledger: &str) {
        let mut known = self.known();
        if known.elsewhere.len() < MAX_ELSEWHERE && known.elsewhere.insert(ledger.to_owned()) {
            tracing::warn!(
                other = ledger,
                this = self.inner.seal.ledger(),
                "a client showed the position of another ledger: it proves nothing here. If this \
                 database replaced the one that client used, what ran there is unknown to this one"
            );
        }
    }

    /// What `position` shows, in the tenant's `epoch`: behind, or not.
    async fn behind(&self, position: &Position, epoch: u64) -> Result<Option<Behind>, StoreError> {
        let mut issued = self.issued_through(false).await?;
        let mut check = continuity::check(position, epoch, issued);
        if matches!(check, Check::Behind(_)) && position.epoch == epoch {
            // Maybe only this replica's reading is old: read the counter itself.
            issued = self.issued_through(true).await?;
            check = continuity::check(position, epoch, issued);
        }
        match check {
            Check::Fine => Ok(None),
            Check::Behind(behind) => Ok(Some(behind)),
            Check::LookUp => {
                let key = found_key(&position.tenant, &position.operation_id, position.token);
                let seen_lately = self
                    .known()
                    .found
                    .get(&key)
                    .is_some_and(|at| at.elapsed() < Self::FRESH);
                if seen_lately {
                    return Ok(None);
                }
                let found = self
                    .inner
                    .ledger
                    .backend()
                    .claim_recorded(
                        &position.tenant,
                        &position.operation_id,
                        (position.life, position.attempt),
                    )
                    .await?;
                let now = self.inner.ledger.backend().clock().await?;
                let behind = continuity::after_lookup(
                    position,
                    found,
                    (epoch, issued),
                    now,
                    self.inner.events_kept_ms,
                );
                if behind.is_none() {
                    self.found(key);
                }
                Ok(behind)
            }
        }
    }

    /// The highest token issued, as last read (again when older than [`Self::FRESH`], or
    /// `now`).
    async fn issued_through(&self, now: bool) -> Result<FencingToken, StoreError> {
        let fresh = !now
            && self
                .known()
                .issued_read
                .is_some_and(|at| at.elapsed() < Self::FRESH);
        if fresh {
            return Ok(self.known().issued_through);
        }
        let issued = self.inner.ledger.backend().issued_through().await?;
        let mut known = self.known();
        known.issued_through = issued;
        known.issued_read = Some(Instant::now());
        Ok(issued)
    }

    fn found(&self, key: Found) {
        let mut known = self.known();
        if known.found.len() >= MAX_FOUND {
            known.found.retain(|_, at| at.elapsed() < Self::FRESH);
            if known.found.len() >= MAX_FOUND {
                known.found.clear();
            }
        }
        known.found.insert(key, Instant::now());
    }

    /// The sealed position of `grant`, granted for `cmd` at `at`, in the tenant's epoch as
    /// this replica last read it.
    pub fn position(&self, cmd: &BeginCommand, grant: &Grant, at: Millis) -> String {
        let epoch = self
            .known()
            .standings
            .get(&cmd.tenant)
            .map_or(0, |s| s.epoch);
        let position = Position {
            ledger: self.inner.seal.ledger().to_owned(),
            epoch,
            tenant: cmd.tenant.clone(),
            operation_id: cmd.operation_id.clone(),
            tool: cmd.tool.clone(),
            fingerprint: cmd.fingerprint,
            life: grant.life,
            attempt: grant.attempt,
            token: grant.fencing_token,
            provider: cmd.provider.clone(),
            provider_key: grant.provider_key.clone(),
            lookup_hints: cmd.lookup_hints.clone(),
            retention_ms: cmd.retention_ms,
            at,
        };
        self.found(found_key(
            &cmd.tenant,
            &cmd.operation_id,
            grant.fencing_token,
        ));
        self.inner.seal.seal(&position)
    }

    /// Brings back, for `tenant`, each operation a reported position names that the ledger
    /// lost: for each position, the operation it names (empty when it names none this ledger
    /// can read) and whether it is UNKNOWN again.
    pub async fn recover(
        &self,
        tenant: &str,
        reporter: (Actor, Holder),
        positions: Vec<String>,
    ) -> Result<Vec<(String, bool)>, Status> {
        // Each position is judged alone: one that is not this ledger's well-sealed one for this
        // tenant (another key's file, a damaged line) brings nothing back, and says so.
        let mut opened = Vec::with_capacity(positions.len());
        for text in &positions {
            match self.inner.seal.open_field("positions", text) {
                Ok(Opened::Ours(position)) if position.tenant == tenant => {
                    opened.push(Ok(*position));
                }
                Ok(Opened::Ours(position)) => opened.push(Err(position.operation_id.to_string())),
                Ok(Opened::Elsewhere { ledger }) => {
                    self.elsewhere(&ledger);
                    opened.push(Err(String::new()));
                }
                Err(refused) => {
                    tracing::warn!(tenant, %refused, "a reported position is not one this ledger sealed");
                    opened.push(Err(String::new()));
                }
            }
        }
        let backend = self.inner.ledger.backend();
        let now = backend.clock().await.map_err(status::store)?;
        let mut recovered = Vec::with_capacity(opened.len());
        for position in opened {
            let position = match position {
                Ok(position) => position,
                Err(named) => {
                    recovered.push((named, false));
                    continue;
                }
            };
            let claim = (position.life, position.attempt);
            let recorded = backend
                .claim_recorded(tenant, &position.operation_id, claim)
                .await
                .map_err(status::store)?;
            // What the ledger's history holds is its truth, even where retention has since
            // deleted the operation; only what it never recorded was lost.
            let lost = continuity::lost(&position, recorded, now, self.inner.events_kept_ms);
            let brought = lost
                && self
                    .inner
                    .ledger
                    .recover(&position, reporter.clone())
                    .await
                    .map_err(status::store)?;
            if brought {
                tracing::warn!(
                    tenant,
                    operation_id = %position.operation_id,
                    fencing_token = %position.token,
                    "an operation the ledger had lost is UNKNOWN again, from a client's position"
                );
            }
            recovered.push((position.operation_id.to_string(), brought));
        }
        Ok(recovered)
    }
}

/// The health check name that answers NOT_SERVING while any tenant's executions are held.
pub const HEALTH_NAME: &str = "once.continuity";

/// Reads every tenant's standing every [`Continuity::FRESH`]: the health check
/// [`HEALTH_NAME`], the `once_continuity_held` gauge, and a log line each time a tenant is held
/// or its hold ends.
pub async fn follow<B: Backend>(
    continuity: Continuity<B>,
    reporter: tonic_health::server::HealthReporter,
    metrics: Arc<crate::telemetry::Metrics>,
    stop: tokio_util::sync::CancellationToken,
) {
    use tonic_health::ServingStatus;
    let mut held_before: Option<Vec<String>> = None;
    loop {
        match continuity.standings().await {
            Ok(standings) => {
                let mut held: Vec<String> = standings
                    .iter()
                    .filter(|s| s.held.is_some())
                    .map(|s| s.tenant.clone())
                    .collect();
                held.sort();
                metrics.continuity(&standings);
                if held_before.as_ref() != Some(&held) {
                    let status = if held.is_empty() {
                        if held_before.is_some() {
                            tracing::info!("no tenant is held any more: executions go on");
                        }
                        ServingStatus::Serving
                    } else {
                        tracing::error!(
                            tenants = ?held,
                            "executions held: the ledger is behind what clients of these tenants saw (restored to an earlier state); \
                             see `onced continuity status`"
                        );
                        ServingStatus::NotServing
                    };
                    reporter.set_service_status(HEALTH_NAME, status).await;
                    held_before = Some(held);
                }
            }
            Err(error) => tracing::debug!(%error, "continuity not read"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Continuity::<B>::FRESH) => {}
        }
    }
}
