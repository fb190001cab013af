//! WatchOperations: each replica follows the store's watermark and streams every watcher the
//! events it wants, in sequence order, from where it resumes.
//!
//! One task per replica, the [`Feed`], reads the store's frontier and follows it to the
//! watermark (`once_store::watch`): the sequence up to which every event that will ever be
//! committed is visible. It reads again when this replica commits events, when another replica
//! announces that it did (PostgreSQL's LISTEN/NOTIFY), and every [`Announcements::POLL`] in
//! case an announcement was lost or nothing can announce (another process on a SQLite file).
//! It announces this replica's commits to the others.
//!
//! Watchers hold slots: the replica's (`--max-watchers`), and within them their tenant's and
//! their credential's (`--max-watchers-per-tenant`, `--max-watchers-per-key`), so no tenant or
//! key can take every stream a replica serves. A stream checks again, every half
//! `--credential-ttl`, that its credential still admits it, and ends UNAUTHENTICATED once it
//! does not (revoked, or a ledger that closed under a caller admitted while it was open).
//!
//! Each watcher has a task of its own that reads its tenant's events from the store, a page at
//! a time, up to the watermark, and sends them into a small bounded channel: a slow watcher
//! holds at most one page and the channel, and the store is not read for it until it takes
//! what it was sent. Resuming after the last sequence received therefore misses nothing (the
//! watermark never passes an event still to be committed) and repeats nothing (sequences only
//! grow).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use once_api::convert::{self, WatchStart};
use once_api::pb;
use once_core::{Scope, WatchFilter};
use once_store::{Announcements, Backend, Ledger, Watermark};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::access::{Access, Principal};
use crate::status;

/// Events read from the store per page for one watcher.
const PAGE: u32 = 256;
/// Messages a watcher's stream holds before its task waits for the watcher to take them.
const STREAM_BUFFER: usize = 16;
/// How often a quiet stream says how far it has caught up, so the watcher knows it is alive.
const KEEPALIVE: Duration = Duration::from_secs(5);
/// How soon the frontier is read again while a newer sequence waits for writers to end.
const WAITING_POLL: Duration = Duration::from_millis(20);
/// The shortest pause between two announcements of this replica's commits.
const ANNOUNCE_EVERY: Duration = Duration::from_millis(10);
/// The shortest pause between two readings of the frontier, however many announcements come.
const READ_EVERY: Duration = Duration::from_millis(5);
/// The shortest pause between two reads of the store for one watcher.
const WATCHER_READ_EVERY: Duration = Duration::from_millis(50);
/// How long a replica waits before listening again after it could not.
const LISTEN_AGAIN: Duration = Duration::from_secs(5);

/// The watermark as the feed last read it.
#[derive(Debug, Clone, Copy, Default)]
struct Mark {
    reached: i64,
    /// The newest sequence visible at that reading: where a watch from now starts.
    newest: i64,
    /// Counts readings, so a watcher can wait for a fresh one.
    readings: u64,
}

/// The replica's feed of the watermark, and the watchers it admits. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Feed {
    marks: Arc<watch::Sender<Mark>>,
    /// Asks the feed to read the frontier now: a watcher starting from now wants a fresh mark.
    wake: Arc<Notify>,
    watchers: Arc<Semaphore>,
    limits: WatcherLimits,
    /// Streams held by each tenant and each credential.
    held: Arc<Mutex<HashMap<Holder, usize>>>,
    /// Ends every stream when the server shuts down, so draining does not wait for watchers.
    stop: CancellationToken,
}

/// How many streams a replica serves at once: in all, to one tenant, to one credential.
#[derive(Debug, Clone, Copy)]
pub struct WatcherLimits {
    pub replica: usize,
    pub tenant: usize,
    pub key: usize,
}

/// Who holds a stream's slots beside the replica.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    Tenant(String),
    Key(String),
}

impl Holder {
    fn limit(&self, limits: &WatcherLimits) -> usize {
        match self {
            Holder::Tenant(_) => limits.tenant,
            Holder::Key(_) => limits.key,
        }
    }

    fn at_limit(&self) -> Status {
        match self {
            Holder::Tenant(_) => {
                status::too_many_watchers("to this tenant", "--max-watchers-per-tenant")
            }
            Holder::Key(_) => {
                status::too_many_watchers("to this credential", "--max-watchers-per-key")
            }
        }
    }
}

/// A stream's slots, given back when it ends.
struct Slots {
    _replica: OwnedSemaphorePermit,
    holders: Vec<Holder>,
    held: Arc<Mutex<HashMap<Holder, usize>>>,
}

impl Drop for Slots {
    fn drop(&mut self) {
        let mut held = self.held.lock().expect("not poisoned");
        for holder in &self.holders {
            if let Some(count) = held.get_mut(holder) {
                *count -= 1;
                if *count == 0 {
                    held.remove(holder);
                }
            }
        }
    }
}

impl Feed {
    pub fn new(limits: WatcherLimits, stop: CancellationToken) -> Self {
        Self {
            marks: Arc::new(watch::Sender::new(Mark::default())),
            wake: Arc::default(),
            watchers: Arc::new(Semaphore::new(limits.replica)),
            limits,
            held: Arc::default(),
            stop,
        }
    }

    /// Takes the slots a stream for `principal` holds, or says which limit it is at.
    fn slots(&self, principal: &Principal) -> Result<Slots, Status> {
        let mut holders = vec![Holder::Tenant(principal.tenant.clone())];
        if let Some(credential) = &principal.credential {
            holders.push(Holder::Key(credential.key_id.clone()));
        }
        let mut held = self.held.lock().expect("not poisoned");
        for holder in &holders {
            if held.get(holder).copied().unwrap_or(0) >= holder.limit(&self.limits) {
                return Err(holder.at_limit());
            }
        }
        let replica = self
            .watchers
            .clone()
            .try_acquire_owned()
            .map_err(|_| status::too_many_watchers("in all", "--max-watchers"))?;
        for holder in &holders {
            *held.entry(holder.clone()).or_default() += 1;
        }
        Ok(Slots {
            _replica: replica,
            holders,
            held: self.held.clone(),
        })
    }

    /// Follows the store's watermark and announces this replica's commits until `stop`.
    pub async fn follow<B: Backend>(self, ledger: Ledger<B>) {
        let backend = ledger.backend();
        let mut watermark = Watermark::default();
        let mut announcements: Option<Announcements> = None;
        let mut announce = false;
        let mut last_error: Option<tokio::time::Instant> = None;
        let mut listen_after = tokio::time::Instant::now();
        loop {
            if announce {
                announce = false;
                if let Err(error) = backend.announce_events().await {
                    tracing::debug!(%error, "could not announce committed events");
                }
            }
            let watched = self.marks.receiver_count() > 0;
            if watched {
                if announcements.is_none() && tokio::time::Instant::now() >= listen_after {
                    announcements = match backend.listen_for_events().await {
                        Ok(listening) => listening,
                        Err(error) => {
                            tracing::debug!(%error, "could not listen for other replicas' events");
                            listen_after = tokio::time::Instant::now() + LISTEN_AGAIN;
                            None
                        }
                    };
                }
                match backend.event_frontier().await {
                    Ok(frontier) => {
                        let newest = frontier.newest;
                        let reached = watermark.observe(frontier);
                        self.marks.send_modify(|mark| {
                            mark.reached = reached;
                            mark.newest = newest;
                            mark.readings += 1;
                        });
                    }
                    Err(error) => {
                        if last_error.is_none_or(|at| at.elapsed() > Duration::from_secs(30)) {
                            tracing::warn!(%error, "could not read the newest events for watchers; will retry");
                            last_error = Some(tokio::time::Instant::now());
                        }
                    }
                }
            } else {
                // Nobody here listens: hold no connection for it.
                announcements = None;
            }
            let pause = if watched && watermark.waiting() {
                WAITING_POLL
            } else {
                Announcements::POLL
            };
            let heard = async {
                match announcements.as_mut() {
                    Some(listening) => listening.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = ledger.events_committed() => {
                    announce = true;
                    // Let commits that follow at once share one announcement.
                    tokio::time::sleep(ANNOUNCE_EVERY).await;
                }
                heard = heard => {
                    if let Err(error) = heard {
                        tracing::debug!(%error, "lost the connection listening for events");
                        announcements = None;
                    }
                }
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(pause) => {}
            }
            // One reading answers every announcement that came meanwhile.
            tokio::time::sleep(READ_EVERY).await;
            if let Some(listening) = announcements.as_mut() {
                while listening.pending() {}
            }
        }
    }

    /// Starts the stream of `watcher`, admitted by `access`: the events of `scope` that
    /// `filter` wants, from `start`. Returns the stream and the sequence it starts after.
    pub async fn watch<B: Backend>(
        &self,
        (backend, access): (B, Access<B>),
        (watcher, scope): (Principal, Scope),
        start: WatchStart,
        filter: WatchFilter,
    ) -> Result<(Receiver, i64), Status> {
        let slots = self.slots(&watcher)?;
        let mut marks = self.marks.subscribe();
        // A fresh reading, so that "from now" is now and a resumed stream starts at once.
        self.wake.notify_one();
        let fresh = tokio::time::timeout(Duration::from_secs(5), marks.changed()).await;
        if !matches!(fresh, Ok(Ok(()))) {
            return Err(status::events_unreadable());
        }
        // From now: after the newest event visible at a reading taken since the request came
        // (the watermark may still be below it, or be an old one: the stream waits for it).
        let cursor = match start {
            WatchStart::After(sequence) => sequence,
            WatchStart::Now => marks.borrow_and_update().newest,
        };
        let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
        let recheck = tokio::time::Instant::now() + access.recheck_every();
        let stream = Stream {
            backend,
            scope,
            filter,
            cursor,
            marks,
            sender,
            stop: self.stop.clone(),
            access,
            watcher,
            recheck,
            _slots: slots,
        };
        tokio::spawn(stream.run());
        Ok((receiver, cursor))
    }
}

/// What a watcher's stream is read from.
pub type Receiver = mpsc::Receiver<Result<pb::WatchOperationsResponse, Status>>;

/// One watcher's stream.
struct Stream<B> {
    backend: B,
    scope: Scope,
    filter: WatchFilter,
    /// Every wanted event up to here has been sent.
    cursor: i64,
    marks: watch::Receiver<Mark>,
    sender: mpsc::Sender<Result<pb::WatchOperationsResponse, Status>>,
    stop: CancellationToken,
    access: Access<B>,
    watcher: Principal,
    /// When to check again that the watcher's credential still admits it.
    recheck: tokio::time::Instant,
    /// Counts the watcher against the limits while the stream lasts.
    _slots: Slots,
}

/// The watcher has gone: nothing more to send.
struct Gone;

impl<B: Backend> Stream<B> {
    async fn run(mut self) {
        if let Err(Gone) = self.serve().await {
            tracing::debug!(scope = ?self.scope, cursor = self.cursor, "watcher gone");
        }
    }

    async fn serve(&mut self) -> Result<(), Gone> {
        let mut caught_up = false;
        // A watch resuming after a sequence checks that retention took nothing after it: at
        // once, and again after its first page (the horizon moves in the deletion's
        // transaction, so a read after the page sees any deletion the page missed events to).
        let resumed_after = self.cursor;
        let mut horizon_checked = resumed_after == 0;
        if !horizon_checked {
            if let Some(expired) = self.expired(resumed_after).await {
                return self.end(expired).await;
            }
        }
        let mut keepalive = tokio::time::Instant::now() + KEEPALIVE;
        loop {
            if let Err(refused) = self.still_admitted().await {
                return self.end(refused).await;
            }
            let reached = self.marks.borrow_and_update().reached;
            while self.cursor < reached {
                if let Err(refused) = self.still_admitted().await {
                    return self.end(refused).await;
                }
                let page = self
                    .backend
                    .watch_events(&self.scope, (self.cursor, reached), &self.filter, PAGE)
                    .await;
                let page = match page {
                    Ok(page) => page,
                    Err(error) => return self.end(status::store(error)).await,
                };
                if !horizon_checked {
                    if let Some(expired) = self.expired(resumed_after).await {
                        return self.end(expired).await;
                    }
                    horizon_checked = true;
                }
                let full = page.len() == PAGE as usize;
                for event in page {
                    let sequence = event.event.sequence;
                    self.send(convert::watched(event)).await?;
                    self.cursor = sequence;
                    keepalive = tokio::time::Instant::now() + KEEPALIVE;
                }
                if !full {
                    // Nothing else wanted up to the watermark.
                    self.cursor = reached;
                }
            }
            // Say how far the stream has caught up the first time it has, and while it is quiet.
            if !caught_up || tokio::time::Instant::now() >= keepalive {
                self.send(convert::caught_up_to(self.cursor)).await?;
                caught_up = true;
                keepalive = tokio::time::Instant::now() + KEEPALIVE;
            }
            tokio::select! {
                changed = self.marks.changed() => {
                    if changed.is_err() {
                        return self.end(status::shutting_down(self.cursor)).await;
                    }
                    // Under steady writes the watermark moves every few milliseconds; a
                    // watcher reads the store at most every WATCHER_READ_EVERY, taking
                    // everything committed meanwhile in one query.
                    tokio::select! {
                        _ = tokio::time::sleep(WATCHER_READ_EVERY) => {}
                        _ = self.stop.cancelled() => {
                            return self.end(status::shutting_down(self.cursor)).await
                        }
                    }
                }
                _ = tokio::time::sleep_until(keepalive) => {}
                _ = tokio::time::sleep_until(self.recheck) => {}
                _ = self.sender.closed() => return Err(Gone),
                _ = self.stop.cancelled() => {
                    return self.end(status::shutting_down(self.cursor)).await
                }
            }
        }
    }

    /// Checks, once `recheck` has come, that the watcher's credential still admits it.
    async fn still_admitted(&mut self) -> Result<(), Status> {
        let now = tokio::time::Instant::now();
        if now < self.recheck {
            return Ok(());
        }
        self.recheck = now + self.access.recheck_every();
        self.access.still_admits(&self.watcher).await
    }

    /// Why a watch resuming after `after` cannot go on, if retention deleted events after it.
    async fn expired(&self, after: i64) -> Option<Status> {
        match self.backend.deleted_through().await {
            Ok(through) if through > after => Some(status::events_expired(after, through)),
            Ok(_) => None,
            Err(error) => Some(status::store(error)),
        }
    }

    async fn send(&self, message: pb::WatchOperationsResponse) -> Result<(), Gone> {
        tokio::select! {
            sent = self.sender.send(Ok(message)) => sent.map_err(|_| Gone),
            _ = self.stop.cancelled() => Err(Gone),
        }
    }

    /// Ends the stream with `status`. A watcher behind on its stream still learns why it ended
    /// (a revocation, say) once it takes what it was sent, unless it takes nothing for a
    /// keepalive period or the server stops: a stalled watcher must not hold a shutting-down
    /// server open.
    async fn end(&self, status: Status) -> Result<(), Gone> {
        if let Err(mpsc::error::TrySendError::Full(status)) = self.sender.try_send(Err(status)) {
            tokio::select! {
                _ = self.sender.send(status) => {}
                _ = tokio::time::sleep(KEEPALIVE) => {}
                _ = self.stop.cancelled() => {}
            }
        }
        Ok(())
    }
}
