//! Acting on many UNKNOWN operations at once, as on-call tools do after a provider outage:
//! select them by a filter and look at the list first (a dry run), then reconcile each, or
//! resolve each with one reason. Every resolution is bound to the attempt its operation had
//! when it was listed, so one that moved since is refused, alone, and nothing is applied to it.

use std::time::Duration;

use futures::{Stream, StreamExt as _};
use once_core::State;

use crate::client::LedgerClient;
use crate::error::ClientError;
use crate::operator::{ListFilter, Reconciled, Resolution, Truth};
use crate::view::OperationView;

/// The most operations one bulk action takes: a filter that selects more is narrowed first.
pub const BULK_LIMIT: usize = 1000;

/// How many operations a bulk action works on at once.
const IN_PARALLEL: usize = 4;

/// How long one operation of a bulk action keeps waiting for its key's request rate before
/// the ledger's refusal stands.
const RATE_PATIENCE: Duration = Duration::from_secs(30);

/// The longest pause between two tries of a call the request rate refused.
const MAX_RATE_PAUSE: Duration = Duration::from_secs(2);

/// Makes `call` again, pausing longer each time, while the ledger refuses it for the key's
/// request rate (`RATE_LIMITED`: nothing was done, and the same call is safe to send later), for
/// up to [`RATE_PATIENCE`]: a bulk action keeps to the rate and ends as it would unthrottled,
/// only later, rather than reporting refusals that meant "not yet".
async fn paced<T, Fut>(call: impl Fn() -> Fut) -> Result<T, ClientError>
where
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match call().await {
            Err(ClientError::Refused { reason, .. })
                if reason == "RATE_LIMITED" && started.elapsed() + pause <= RATE_PATIENCE =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_RATE_PAUSE);
            }
            answered => return answered,
        }
    }
}

/// One operation as it was selected: what a bulk action on it is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub operation_id: String,
    /// The fencing token and number of its latest attempt when it was listed.
    pub fencing_token: u64,
    pub attempt: u32,
}

impl From<&OperationView> for Target {
    fn from(op: &OperationView) -> Self {
        Target {
            operation_id: op.operation_id.clone(),
            fencing_token: op.fencing_token,
            attempt: op.attempt,
        }
    }
}

/// The UNKNOWN operations a filter selects, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub operations: Vec<OperationView>,
    /// More matched than the selection holds (it holds the oldest), or the search stopped
    /// before it saw every one.
    pub more: bool,
}

/// A search of UNKNOWN operations the ledger does not do itself: which to keep, through how many.
struct Search<'a> {
    searched: usize,
    keep: &'a (dyn Fn(&OperationView) -> bool + Sync),
}

/// What became of one operation of a bulk action.
#[derive(Debug)]
pub enum Done<T> {
    /// The ledger did it: a reconcile's verdict, or a resolution's state.
    Applied(T),
    /// The ledger refused it (it moved since it was listed, it has no reconciler, the key may
    /// not): nothing was applied to it.
    Refused(ClientError),
    /// No ledger answered: it may or may not have been applied, and may be done again.
    Failed(ClientError),
}

impl<T> Done<T> {
    /// Whether the ledger refused the key rather than the operation (its role, or the
    /// credential itself): every other operation would be refused alike.
    pub fn refuses_the_key(&self) -> bool {
        matches!(self, Done::Refused(ClientError::Refused { reason, .. })
            if reason == "ROLE_NOT_ALLOWED" || reason.starts_with("CREDENTIALS_"))
    }
}

impl<T> From<Result<T, ClientError>> for Done<T> {
    fn from(result: Result<T, ClientError>) -> Self {
        match result {
            Ok(done) => Done::Applied(done),
            Err(error @ ClientError::Unreachable(_)) => Done::Failed(error),
            Err(error) => Done::Refused(error),
        }
    }
}

/// Where a bulk action stands in sending its operations.
#[derive(Default)]
struct Turn {
    /// The first operation's answer came.
    first_answered: tokio::sync::Notify,
    /// The ledger refused the key: no further operation is sent.
    stopped: std::sync::atomic::AtomicBool,
}

/// Does `act` to each target and yields each outcome as it comes, in the targets' order: the
/// first alone, so that a key the ledger refuses is refused once for the whole selection, then
/// a few at a time. Once an outcome refuses the key (`refuses_the_key`), as soon as it comes
/// back and whatever is still in flight before it, no further target is taken; those already
/// sent are seen through. A target is taken from `targets` only when it is sent, so a stream
/// that ends early (a shutdown) leaves the rest untouched.
fn in_turn<'a, Fut, O>(
    targets: impl Stream<Item = Target> + Send + 'a,
    mut act: impl FnMut(Target) -> Fut + Send + 'a,
    refuses_the_key: impl Fn(&O) -> bool + Send + Sync + 'a,
) -> impl Stream<Item = O> + Send + 'a
where
    Fut: std::future::Future<Output = O> + Send + 'a,
    O: Send + 'a,
{
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    let turn = Arc::new(Turn::default());
    let refuses_the_key = Arc::new(refuses_the_key);
    let taken = futures::stream::unfold(
        (Box::pin(targets), 0_usize, turn.clone()),
        |(mut targets, n, turn)| async move {
            if n == 1 {
                turn.first_answered.notified().await;
            }
            if turn.stopped.load(Ordering::SeqCst) {
                return None;
            }
            let target = targets.next().await?;
            Some((target, (targets, n + 1, turn)))
        },
    );
    taken
        .map(move |target| {
            let (answer, turn, refuses_the_key) =
                (act(target), turn.clone(), refuses_the_key.clone());
            async move {
                let outcome = answer.await;
                if refuses_the_key(&outcome) {
                    turn.stopped.store(true, Ordering::SeqCst);
                }
                turn.first_answered.notify_one();
                outcome
            }
        })
        .buffered(IN_PARALLEL)
}

impl LedgerClient {
    /// The UNKNOWN operations `filter` selects (whatever states it names), oldest first, at
    /// most `limit`: for a bulk action ([`BULK_LIMIT`]), the list it shows before it acts (its
    /// dry run).
    pub async fn select_unknown(
        &self,
        filter: &ListFilter,
        limit: usize,
    ) -> Result<Selection, ClientError> {
        self.paged_unknown(filter, limit, None).await
    }

    /// As [`LedgerClient::select_unknown`], with at most `limit` of those `keep` keeps (a
    /// search the ledger does not do itself), looked for through at most `searched` of the
    /// operations the filter selects, oldest first. `more` also says the search stopped there.
    pub async fn search_unknown(
        &self,
        filter: &ListFilter,
        limit: usize,
        searched: usize,
        keep: impl Fn(&OperationView) -> bool + Sync,
    ) -> Result<Selection, ClientError> {
        let search = Search {
            searched,
            keep: &keep,
        };
        self.paged_unknown(filter, limit, Some(search)).await
    }

    async fn paged_unknown(
        &self,
        filter: &ListFilter,
        limit: usize,
        search: Option<Search<'_>>,
    ) -> Result<Selection, ClientError> {
        const PAGE: usize = 1000;
        let filter = ListFilter {
            states: vec![State::Unknown],
            ..filter.clone()
        };
        let (mut operations, mut page, mut scanned) = (Vec::new(), None, 0);
        loop {
            // Unsearched, no more than is needed to tell whether there are more.
            let wanted = match &search {
                Some(_) => PAGE,
                None => (limit + 1 - operations.len()).min(PAGE),
            };
            let size = u32::try_from(wanted).unwrap_or(u32::MAX);
            let got = paced(|| self.list_page(&filter, size, page.as_deref())).await?;
            scanned += got.operations.len();
            match &search {
                Some(search) => {
                    operations.extend(got.operations.into_iter().filter(|op| (search.keep)(op)))
                }
                None => operations.extend(got.operations),
            }
            page = got.next;
            let searched_enough = search.as_ref().is_some_and(|s| scanned >= s.searched);
            if page.is_none() || operations.len() > limit || searched_enough {
                break;
            }
        }
        let more = page.is_some() || operations.len() > limit;
        operations.truncate(limit);
        Ok(Selection { operations, more })
    }

    /// Looks each target up with its reconciler now, as `operator` asked, and applies the
    /// verdict, in turn ([`in_turn`]: the first alone, then a few at a time, none after a
    /// refusal of the key), keeping to the key's request rate ([`paced`]); yields each outcome
    /// as it comes, in the targets' order. `wait` bounds each lookup. A target is started only
    /// once the stream yields it: one that ends early (a shutdown) leaves the rest untouched,
    /// and what started is seen through.
    pub fn reconcile_each<'a>(
        &'a self,
        targets: impl Stream<Item = Target> + Send + 'a,
        operator: &'a str,
        wait: Duration,
    ) -> impl Stream<Item = (Target, Done<Reconciled>)> + Send + 'a {
        in_turn(
            targets,
            move |target| async move {
                let done = paced(|| self.reconcile(&target.operation_id, operator, wait))
                    .await
                    .into();
                (target, done)
            },
            |(_, done): &(Target, Done<Reconciled>)| done.refuses_the_key(),
        )
    }

    /// Resolves each target ABSENT with one reason, each bound to the attempt it was listed
    /// with, under a resolution id of its own (yielded with it, to retry one whose answer was
    /// lost), in turn and keeping to the key's request rate as [`LedgerClient::reconcile_each`]
    /// does; yields each outcome as it comes, in the targets' order.
    pub fn resolve_each_absent<'a>(
        &'a self,
        targets: impl Stream<Item = Target> + Send + 'a,
        reason: String,
        operator: String,
    ) -> impl Stream<Item = (Target, String, Done<State>)> + Send + 'a {
        in_turn(
            targets,
            move |target| {
                let resolution = Resolution {
                    operation_id: target.operation_id.clone(),
                    truth: Truth::Absent,
                    reason: reason.clone(),
                    operator: operator.clone(),
                    resolution_id: uuid::Uuid::new_v4().to_string(),
                    fencing_token: target.fencing_token,
                    attempt: Some(target.attempt),
                };
                async move {
                    // The same resolution id each time: a refusal for the rate did nothing.
                    let done = paced(|| self.resolve(&resolution)).await.into();
                    (target, resolution.resolution_id, done)
                }
            },
            |(_, _, done): &(Target, String, Done<State>)| done.refuses_the_key(),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Acts in turn on `count` targets, `op-0` on, where the key is refused for the operations
    /// `refused` says and those `slow` says take longer to answer; returns the outcomes (each
    /// operation and whether it refused the key) and the operations sent, in the order sent.
    async fn in_turn_over(
        count: usize,
        refused: fn(usize) -> bool,
        slow: fn(usize) -> bool,
    ) -> (Vec<(String, bool)>, Vec<String>) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = sent.clone();
        let act = move |target: Target| {
            log.lock().unwrap().push(target.operation_id.clone());
            async move {
                let n: usize = target.operation_id[3..].parse().unwrap();
                let yields = if slow(n) { 50 } else { 1 };
                for _ in 0..yields {
                    tokio::task::yield_now().await;
                }
                let done: Done<()> = match refused(n) {
                    true => Done::Refused(ClientError::Refused {
                        reason: "CREDENTIALS_REVOKED".into(),
                        message: "the key was revoked".into(),
                    }),
                    false => Done::Applied(()),
                };
                (target.operation_id, done.refuses_the_key())
            }
        };
        let outcomes: Vec<(String, bool)> = in_turn(
            futures::stream::iter(targets(count)),
            act,
            |(_, refused): &(String, bool)| *refused,
        )
        .collect()
        .await;
        let sent = sent.lock().unwrap().clone();
        (outcomes, sent)
    }

    /// `count` targets, `op-0` on.
    fn targets(count: usize) -> Vec<Target> {
        (0..count)
            .map(|n| Target {
                operation_id: format!("op-{n}"),
                fencing_token: 1,
                attempt: 1,
            })
            .collect()
    }

    fn never(_: usize) -> bool {
        false
    }

    #[tokio::test]
    async fn a_key_refused_at_once_is_refused_once_for_the_whole_selection() {
        let (outcomes, sent) = in_turn_over(10, |_| true, never).await;
        assert_eq!(sent, ["op-0"]);
        assert_eq!(outcomes, [("op-0".to_owned(), true)]);
    }

    /// A key revoked while the operations are sent: none is sent after its refusal came back,
    /// and every one already sent is seen through (it may have been applied before).
    #[tokio::test]
    async fn after_the_key_is_refused_nothing_more_is_sent_and_what_was_sent_is_seen_through() {
        let (outcomes, sent) = in_turn_over(20, |n| n >= 3, never).await;
        let answered: Vec<&str> = outcomes.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(answered, sent, "every operation sent is answered, in order");
        assert!(sent.len() < 20, "sending stopped: {sent:?}");
        // The refusal of op-3 came back with at most a few operations in flight behind it.
        assert!(sent.len() <= 4 + IN_PARALLEL, "{sent:?}");
        assert!(outcomes[..3].iter().all(|(_, refused)| !refused));
    }

    #[tokio::test]
    async fn with_the_key_accepted_every_operation_is_sent_a_few_at_a_time() {
        let (outcomes, sent) = in_turn_over(20, |_| false, never).await;
        assert_eq!(sent.len(), 20);
        assert_eq!(outcomes.len(), 20);
    }

    /// A refusal of the key that comes back while an earlier operation is still being looked
    /// up stops the sending at once, not when the earlier one's answer is yielded.
    #[tokio::test]
    async fn a_refusal_that_comes_back_first_stops_the_sending_at_once() {
        let (outcomes, sent) = in_turn_over(20, |n| n == 2, |n| n == 1).await;
        assert_eq!(sent, ["op-0", "op-1", "op-2", "op-3", "op-4"]);
        assert_eq!(outcomes.len(), sent.len());
    }

    /// Targets are taken only when they are sent: a stream of them that ends while the first
    /// is being answered (the console shutting down) sends no other.
    #[tokio::test]
    async fn targets_that_end_while_the_first_is_answered_send_no_other() {
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        let stop = Mutex::new(Some(stop));
        let sent = Mutex::new(Vec::new());
        let targets = futures::stream::iter(targets(5)).take_until(stopped);
        let outcomes: Vec<String> = in_turn(
            targets,
            |target: Target| {
                sent.lock().unwrap().push(target.operation_id.clone());
                let stop = &stop;
                async move {
                    // The shutdown comes while the first is being answered.
                    tokio::task::yield_now().await;
                    let shutdown = stop.lock().unwrap().take();
                    if let Some(shutdown) = shutdown {
                        let _ = shutdown.send(());
                    }
                    tokio::task::yield_now().await;
                    target.operation_id
                }
            },
            |_: &String| false,
        )
        .collect()
        .await;
        assert_eq!(outcomes, ["op-0"]);
        assert_eq!(*sent.lock().unwrap(), ["op-0"]);
    }
}
