//! The history's chain in the replica (see `once_core::chain`): a worker links each tenant's
//! committed events, once no event below them can still commit, and retention's cuts leave an
//! anchor; `verify` walks a tenant's chain for VerifyHistory.

use std::collections::BTreeMap;
use std::time::Duration;

use once_core::chain::{self, Entry, Link, Problem, Verified};
use once_store::{Backend, Ledger, StoreError, Verification, Watermark};
use tokio_util::sync::CancellationToken;

/// How often the worker links what was committed since.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// The most events one round links (a full round is followed by the next at once).
const BATCH: u32 = 2_000;

/// How many rounds between two cuts of the links retention has left without events.
const CUT_EVERY: u32 = 60;

/// Rounds in a row that may fail before it is said at warning level (a database restart
/// passes in fewer).
const FAILING_ROUNDS: u32 = 60;

/// Links what was committed, every [`INTERVAL`], until `stop`; says in `metrics` how many
/// committed events are not linked yet.
pub async fn follow<B: Backend>(
    ledger: Ledger<B>,
    metrics: std::sync::Arc<crate::telemetry::Metrics>,
    stop: CancellationToken,
) {
    let backend = ledger.backend();
    let mut watermark = Watermark::default();
    let mut round: u32 = 0;
    let mut failing: u32 = 0;
    loop {
        match link(backend, &mut watermark).await {
            Ok(linked) => {
                if failing >= FAILING_ROUNDS {
                    tracing::info!("the history is linked again");
                }
                failing = 0;
                metrics.unlinked(linked.unlinked);
                // More to link at once: no pause.
                if linked.full {
                    continue;
                }
            }
            Err(error) => {
                // What is not linked goes on being said while the chain cannot write.
                if let (Ok(frontier), Ok(progress)) = (
                    backend.event_frontier().await,
                    backend.chained_through().await,
                ) {
                    metrics.unlinked((frontier.newest - progress).max(0));
                }
                failing = failing.saturating_add(1);
                if failing == FAILING_ROUNDS {
                    tracing::warn!(
                        %error,
                        "the history has not been linked for a minute; retention keeps every event until it is"
                    );
                } else {
                    tracing::debug!(%error, "history not linked this round");
                }
            }
        }
        round = round.wrapping_add(1);
        if round.is_multiple_of(CUT_EVERY) {
            if let Err(error) = cut(backend).await {
                tracing::debug!(%error, "links not cut this round");
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(INTERVAL) => {}
        }
    }
}

/// What a round of linking did.
#[derive(Debug, Clone, Copy)]
pub struct Linked {
    /// A full batch was linked: more may wait.
    pub full: bool,
    /// Committed events (by sequence) not linked after it, by this replica or another.
    pub unlinked: i64,
}

/// Links the events committed after the chain's progress, up to the watermark: one link for
/// each tenant that has events among them.
pub async fn link<B: Backend>(
    backend: &B,
    watermark: &mut Watermark,
) -> Result<Linked, StoreError> {
    let reached = watermark.observe(backend.event_frontier().await?);
    let progress = backend.chained_through().await?;
    if reached <= progress {
        return Ok(Linked {
            full: false,
            unlinked: 0,
        });
    }
    let events = backend.chainable((progress, reached), BATCH).await?;
    let full = events.len() == BATCH as usize;
    let through = match events.last() {
        Some((last, _)) if full => last.sequence,
        _ => reached,
    };
    let mut tenants: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
    for (event, result) in &events {
        let result = result
            .as_ref()
            .map(|(bytes, provider_ref)| (bytes.as_slice(), provider_ref.as_deref()));
        tenants
            .entry(event.tenant.clone())
            .or_default()
            .push(chain::entry(event, result));
    }
    let now = backend.clock().await?;
    let mut links = Vec::with_capacity(tenants.len());
    for (tenant, entries) in &tenants {
        let before = backend.last_link(tenant).await?;
        links.push(chain::next_link(
            tenant,
            before.as_ref(),
            entries,
            through,
            now,
        ));
    }
    // Another replica may have linked the range first: then nothing is written.
    backend.append_links((progress, through), &links).await?;
    Ok(Linked {
        full,
        unlinked: reached - through,
    })
}

/// Deletes the links whose every event retention deleted, each tenant's newest such kept.
async fn cut<B: Backend>(backend: &B) -> Result<(), StoreError> {
    let deleted_through = backend.deleted_through().await?;
    if deleted_through > 0 {
        let cut = backend.delete_links_through(deleted_through).await?;
        if cut > 0 {
            tracing::debug!(cut, deleted_through, "links of deleted events cut");
        }
    }
    Ok(())
}

/// The most links, and operations, read at once while verifying.
const PAGE: u32 = 500;

/// Walks `tenant`'s chain from the link covering events after `from`, and the states of its
/// operations whose latest event is linked; records the verification.
pub async fn verify<B: Backend>(
    backend: &B,
    tenant: &str,
    from: i64,
) -> Result<Verified, StoreError> {
    let deleted_through = backend.deleted_through().await?;
    let mut verified = Verified {
        tenant: tenant.to_owned(),
        links: 0,
        events: 0,
        through: 0,
        head: None,
        at: backend.clock().await?,
        problem: None,
    };
    let mut before: Option<Link> = None;
    let mut after = from;
    'links: loop {
        let page = backend.links(tenant, after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.through;
        for link in page {
            if before.is_none() && link.number > 1 {
                // The oldest link checked follows the one before it, when that is kept (the
                // oldest kept is the anchor, taken on trust).
                before = backend.link_before(tenant, link.number).await?;
            }
            let events = backend
                .tenant_events(tenant, (link.after, link.through), u32::MAX >> 1)
                .await?;
            match chain::check_link(&link, before.as_ref(), &events, deleted_through) {
                Ok(count) => verified.events += i64::try_from(count).unwrap_or(i64::MAX),
                Err(problem) => {
                    verified.problem = Some(problem);
                    verified.links += 1;
                    break 'links;
                }
            }
            verified.links += 1;
            verified.through = link.through;
            verified.head = Some((link.number, link.hash.clone()));
            before = Some(link);
        }
    }
    if verified.problem.is_none() && verified.through > 0 {
        verified.problem = check_states(backend, tenant, verified.through).await?;
    }
    backend
        .record_verification(&Verification {
            tenant: tenant.to_owned(),
            at: verified.at,
            through: verified.through,
            links: verified.links,
            events: verified.events,
            problem: verified.problem.as_ref().map(ToString::to_string),
        })
        .await?;
    Ok(verified)
}

/// The first operation whose stored state is not the one its latest (linked) event recorded.
async fn check_states<B: Backend>(
    backend: &B,
    tenant: &str,
    through: i64,
) -> Result<Option<Problem>, StoreError> {
    let mut after = String::new();
    loop {
        let page = backend.states(tenant, through, (&after, PAGE)).await?;
        let Some(last) = page.last() else {
            return Ok(None);
        };
        after = last.operation_id.clone();
        for checked in page {
            if checked.recorded.as_deref() != Some(checked.stored.as_str()) {
                return Ok(Some(Problem::State {
                    sequence: checked.sequence,
                    operation_id: checked.operation_id,
                    stored: checked.stored,
                    recorded: checked.recorded.unwrap_or_else(|| "nothing".into()),
                }));
            }
        }
    }
}
