//! WatchOperations: every event once, in sequence order, across reconnects, replicas, slow
//! watchers and shutdowns.

use std::time::Duration;

use once_api::pb;
use once_client::{ClientConfig, LedgerClient, WatchRequest, Watched, WatchedEvent};
use once_core::{EventKind, OperationEvent, State, WatchFilter};

use crate::support::*;

on_both_backends!(
    a_watch_gets_every_event_once_in_order_and_a_resumed_one_the_rest,
    states_and_kinds_widen_a_watch_and_the_tool_narrows_it,
    a_watch_from_now_gets_only_what_is_committed_after_it_began,
    a_slow_watcher_holds_up_no_one_and_still_gets_everything,
    shutdown_ends_open_watches_with_where_to_resume,
    shutdown_is_not_held_up_by_a_watcher_that_reads_nothing,
    a_watch_resuming_after_what_retention_deleted_is_told_so,
);

/// A once-client for the ledger at `addr`.
fn ledger_client(addrs: &[std::net::SocketAddr]) -> LedgerClient {
    let mut config = ClientConfig::new(format!("http://{}", addrs[0]));
    config.endpoints = addrs.iter().map(|a| format!("http://{a}")).collect();
    config.tries = 20;
    LedgerClient::connect(config).expect("client")
}

/// Every event sequence the database holds, in order.
async fn sequences(db: &TestDb) -> Vec<i64> {
    db.integers("SELECT sequence FROM events ORDER BY sequence")
        .await
}

/// Reads `watch` until it has caught up to `newest`; returns the events on the way.
async fn read_to(watch: &mut once_client::Watch, newest: i64) -> Vec<WatchedEvent> {
    let mut events = Vec::new();
    within(Duration::from_secs(30), "the watch to catch up", async {
        loop {
            match watch.next().await.expect("watch") {
                Watched::Event(event) => {
                    let sequence = event.event.sequence;
                    events.push(event);
                    if sequence >= newest {
                        return;
                    }
                }
                Watched::CaughtUpTo(sequence) if sequence >= newest => return,
                Watched::CaughtUpTo(_) | Watched::Reconnecting { .. } => {}
            }
        }
    })
    .await;
    events
}

fn sequence_of(events: &[WatchedEvent]) -> Vec<i64> {
    events.iter().map(|e| e.event.sequence).collect()
}

/// Some history: a confirmed refund, a replay, one that went UNKNOWN and was resolved ABSENT,
/// and one of another tool that is still in flight.
async fn some_history(client: &mut Grpc) {
    let grant = claim(client, begin("w-1", ARGS)).await;
    confirm(client, "w-1", grant.fencing_token, b"{\"refund\":\"re_1\"}")
        .await
        .unwrap();
    let replay = client.begin(begin("w-1", ARGS)).await.unwrap().into_inner();
    expect_replay(&replay);
    let grant = claim(client, begin("w-2", ARGS)).await;
    report_unknown(client, "w-2", grant.fencing_token)
        .await
        .unwrap();
    resolve(client, "w-2", pb::OperationState::Absent, "res-w-2")
        .await
        .unwrap();
    let mut other = begin("w-3", ARGS);
    other.tool = "send_email".into();
    claim(client, other).await;
}

async fn a_watch_gets_every_event_once_in_order_and_a_resumed_one_the_rest(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let watcher = ledger_client(&[ledger.addr]);
    let mut watch = watcher.watch(WatchRequest {
        after: Some(0),
        ..Default::default()
    });
    let mut client = ledger.client().await;
    some_history(&mut client).await;

    let stored = sequences(&db).await;
    let events = read_to(&mut watch, *stored.last().unwrap()).await;
    assert_eq!(sequence_of(&events), stored, "every event once, in order");
    let kinds: Vec<&str> = events.iter().map(|e| e.event.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "CLAIMED",
            "CONFIRMED",
            "CLAIMED",
            "REPORTED_UNKNOWN",
            "RESOLVED",
            "CLAIMED"
        ]
    );
    let unknown = &events[3];
    assert_eq!(
        (unknown.operation_id.as_str(), unknown.tool.as_str()),
        ("w-2", "issue_refund")
    );
    assert_eq!(unknown.state, Some(State::Unknown));
    assert_eq!(events[4].state, Some(State::Absent));
    assert_eq!(events[4].event.from, Some(State::Unknown));
    assert_eq!(events[5].tool, "send_email");

    // Resumed after the third event: the rest, and nothing before.
    let mut resumed = watcher.watch(WatchRequest {
        after: Some(stored[2]),
        ..Default::default()
    });
    let rest = read_to(&mut resumed, *stored.last().unwrap()).await;
    assert_eq!(sequence_of(&rest), stored[3..]);
    ledger.stop().await;
}

async fn states_and_kinds_widen_a_watch_and_the_tool_narrows_it(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    some_history(&mut client).await;
    let newest = *sequences(&db).await.last().unwrap();
    let watcher = ledger_client(&[ledger.addr]);
    let all = read_to(
        &mut watcher.watch(WatchRequest {
            after: Some(0),
            ..Default::default()
        }),
        newest,
    )
    .await;

    let filters = [
        (vec![State::Unknown], vec![], None),
        (vec![], vec![EventKind::Claimed], None),
        (vec![State::Unknown], vec![EventKind::Confirmed], None),
        (vec![], vec![EventKind::Claimed], Some("send_email")),
        (vec![State::InFlight], vec![], Some("issue_refund")),
    ];
    for (states, kinds, tool) in filters {
        let filter = WatchFilter {
            states: states.clone(),
            kinds: kinds.clone(),
            tool: tool.map(str::to_owned),
        };
        let expected: Vec<i64> = all
            .iter()
            .filter(|e| filter.matches(&as_domain(e)))
            .map(|e| e.event.sequence)
            .collect();
        assert!(!expected.is_empty(), "{filter:?} wants something");
        let mut watch = watcher.watch(WatchRequest {
            after: Some(0),
            states,
            kinds: kinds.iter().map(|k| k.as_str().to_owned()).collect(),
            tool: tool.map(str::to_owned),
        });
        let got = read_to(&mut watch, newest).await;
        assert_eq!(sequence_of(&got), expected, "{filter:?}");
    }
    // States widen to events recorded while the operation was in one, and to moves out of it.
    let unknown: Vec<&str> = all
        .iter()
        .filter(|e| {
            WatchFilter {
                states: vec![State::Unknown],
                ..Default::default()
            }
            .matches(&as_domain(e))
        })
        .map(|e| e.event.kind.as_str())
        .collect();
    assert_eq!(unknown, ["REPORTED_UNKNOWN", "RESOLVED"]);

    let refused = client
        .watch_operations(pb::WatchOperationsRequest {
            kinds: vec!["EXPLODED".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        (refused.code(), field(&refused)),
        (tonic::Code::InvalidArgument, "kinds[0]".to_owned())
    );
    ledger.stop().await;
}

/// The event as the domain's filter reads it.
fn as_domain(e: &WatchedEvent) -> OperationEvent {
    OperationEvent {
        tenant: e.tenant.clone(),
        operation_id: once_core::OperationId::parse("id", &e.operation_id).unwrap(),
        tool: Some(e.tool.clone()).filter(|t| !t.is_empty()),
        state: e.state,
        event: once_core::Event {
            sequence: e.event.sequence,
            at: 0,
            kind: EventKind::parse(&e.event.kind).unwrap(),
            from: e.event.from,
            to: e.event.to,
            attempt: Some(e.event.attempt),
            actor: e.event.actor.parse().unwrap(),
            reason: None,
            details: None,
        },
    }
}

async fn a_watch_from_now_gets_only_what_is_committed_after_it_began(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    some_history(&mut client).await;
    let before = *sequences(&db).await.last().unwrap();

    let watcher = ledger_client(&[ledger.addr]);
    let mut watch = watcher.watch(WatchRequest::default());
    // The first thing a watch says is where it starts.
    let start = within(Duration::from_secs(10), "the watch to start", watch.next())
        .await
        .expect("watch");
    assert_eq!(start, Watched::CaughtUpTo(before));

    let grant = claim(&mut client, begin("w-later", ARGS)).await;
    confirm(&mut client, "w-later", grant.fencing_token, b"{}")
        .await
        .unwrap();
    let stored = sequences(&db).await;
    let events = read_to(&mut watch, *stored.last().unwrap()).await;
    let after: Vec<i64> = stored.into_iter().filter(|s| *s > before).collect();
    assert_eq!(sequence_of(&events), after);
    assert!(events.iter().all(|e| e.operation_id == "w-later"));
    ledger.stop().await;
}

async fn a_slow_watcher_holds_up_no_one_and_still_gets_everything(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    // A watcher that opens its stream and then reads nothing.
    let mut slow = client
        .watch_operations(pb::WatchOperationsRequest::default())
        .await
        .expect("watch")
        .into_inner();

    // Far more than the server buffers for one watcher.
    for n in 0..400 {
        let id = format!("slow-{n}");
        let grant = claim(&mut client, begin(&id, ARGS)).await;
        confirm(&mut client, &id, grant.fencing_token, b"{}")
            .await
            .unwrap();
    }
    let stored = sequences(&db).await;
    let newest = *stored.last().unwrap();
    // Another watcher is not held up by it.
    let watcher = ledger_client(&[ledger.addr]);
    let quick = read_to(
        &mut watcher.watch(WatchRequest {
            after: Some(0),
            ..Default::default()
        }),
        newest,
    )
    .await;
    assert_eq!(sequence_of(&quick), stored);

    let mut got = Vec::new();
    within(Duration::from_secs(30), "the slow watcher to read", async {
        while got.last() != Some(&newest) {
            let message = slow.message().await.expect("stream").expect("open");
            if let Some(pb::watch_operations_response::Item::Event(e)) = message.item {
                got.push(e.event.unwrap().sequence);
            }
        }
    })
    .await;
    assert_eq!(got, stored);
    ledger.stop().await;
}

async fn shutdown_ends_open_watches_with_where_to_resume(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    some_history(&mut client).await;
    let newest = *sequences(&db).await.last().unwrap();
    let mut stream = client
        .watch_operations(pb::WatchOperationsRequest::default())
        .await
        .expect("watch")
        .into_inner();
    within(Duration::from_secs(10), "the watch to catch up", async {
        loop {
            let item = stream.message().await.unwrap().unwrap().item;
            if item == Some(pb::watch_operations_response::Item::CaughtUpTo(newest)) {
                return;
            }
        }
    })
    .await;
    // The server drains even though the stream would never end by itself.
    ledger.stop().await;
    let ended = stream.message().await;
    let status = ended.expect_err("the stream ends with a status");
    assert_eq!(
        (status.code(), reason(&status)),
        (tonic::Code::Unavailable, "SHUTTING_DOWN".to_owned())
    );
}

/// Two replicas on one PostgreSQL database, each taking writes from concurrent callers; a
/// watcher on the second, which is killed midway, reconnects to the first and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_replicas_with_a_reconnect_every_event_arrives_once_in_order() {
    let db = TestDb::new(Engine::Postgres).await;
    let first = TestLedger::spawn(&db).await;
    let second = OncedProcess::spawn(&db.url, db.scratch_dir().join("second.log"), &[]).await;
    let watcher = ledger_client(&[second.addr, first.addr]);
    let mut watch = watcher.watch(WatchRequest {
        after: Some(0),
        ..Default::default()
    });

    // Writers on both replicas at once, so transactions commit out of sequence order.
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let addr = if w % 2 == 0 { first.addr } else { second.addr };
            tokio::spawn(async move {
                let Ok(channel) = tonic::transport::Channel::from_shared(format!("http://{addr}"))
                    .unwrap()
                    .connect()
                    .await
                else {
                    return;
                };
                let mut client = Grpc::new(channel);
                for n in 0..60 {
                    let id = format!("x-{w}-{n}");
                    // The second replica dies midway: its writers stop there.
                    let Ok(response) = client.begin(begin(&id, ARGS)).await else {
                        return;
                    };
                    let token = expect_execute(&response.into_inner()).fencing_token;
                    let reported = if n % 3 == 0 {
                        report_unknown(&mut client, &id, token).await
                    } else {
                        confirm(&mut client, &id, token, b"{}").await
                    };
                    if reported.is_err() {
                        return;
                    }
                }
            })
        })
        .collect();

    // Midway, the replica the watcher is on dies.
    let mut seen = Vec::new();
    within(Duration::from_secs(30), "the first hundred events", async {
        while seen.len() < 100 {
            if let Watched::Event(e) = watch.next().await.expect("watch") {
                seen.push(e);
            }
        }
    })
    .await;
    second.kill().await;
    for writer in writers {
        writer.await.unwrap();
    }
    // Leases of the killed replica's attempts run out into UNKNOWN too, through the first.
    let stored = sequences(&db).await;
    seen.extend(read_to(&mut watch, *stored.last().unwrap()).await);
    let received = sequence_of(&seen);
    assert_eq!(received.len(), stored.len(), "no event missed or repeated");
    assert_eq!(received, stored, "in order");
    first.stop().await;
}

async fn shutdown_is_not_held_up_by_a_watcher_that_reads_nothing(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let _stalled = client
        .watch_operations(pb::WatchOperationsRequest::default())
        .await
        .expect("watch")
        .into_inner();
    // More than its stream and the connection's flow-control window hold: its task waits for
    // it to read.
    for n in 0..300 {
        let id = format!("stalled-{n}");
        let grant = claim(&mut client, begin(&id, ARGS)).await;
        confirm(&mut client, &id, grant.fencing_token, b"{}")
            .await
            .unwrap();
    }
    // Stops within the harness's limit, though the watcher never read anything.
    ledger.stop().await;
}

/// A watch from now starts after the newest event, even while a writer holds the write gate
/// (so the watermark has not reached it yet): it never replays what came before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_now_replays_nothing_while_a_writer_holds_the_gate() {
    use once_store::Dialect as _;
    use sqlx::{Connection as _, Postgres};
    let db = TestDb::new(Engine::Postgres).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    some_history(&mut client).await;
    let before = *sequences(&db).await.last().unwrap();
    // A writer's transaction, holding the gate every write takes before its events.
    let mut connection = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut writing = connection.begin().await.unwrap();
    sqlx::query(Postgres::write_gate())
        .execute(&mut *writing)
        .await
        .unwrap();

    let watching = client
        .watch_operations(pb::WatchOperationsRequest {
            from_now: true,
            ..Default::default()
        })
        .await
        .expect("watch");
    let starts_after: i64 = watching
        .metadata()
        .get(once_api::WATCH_START_HEADER)
        .expect("the start is said")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        starts_after, before,
        "after the newest event, not the watermark"
    );
    let mut stream = watching.into_inner();
    claim(&mut client, begin("w-after", ARGS)).await;
    writing.rollback().await.unwrap();
    let first = within(Duration::from_secs(10), "the next event", async {
        loop {
            let item = stream.message().await.unwrap().unwrap().item;
            if let Some(pb::watch_operations_response::Item::Event(e)) = item {
                return e;
            }
        }
    })
    .await;
    assert_eq!(first.operation_id, "w-after");
    assert!(first.event.unwrap().sequence > before);
    ledger.stop().await;
}

async fn a_watch_resuming_after_what_retention_deleted_is_told_so(store: Engine) {
    let db = TestDb::new(store).await;
    let flags = [
        "--event-retention",
        "1ms",
        "--retention-sweep-interval",
        "50ms",
    ];
    let ledger = TestLedger::spawn_with(&db, &flags).await;
    let mut client = ledger.client().await;
    some_history(&mut client).await;
    eventually(
        Duration::from_secs(10),
        "retention to delete every event",
        || async { (db.scalar("SELECT count(*) FROM events").await == 0).then_some(()) },
    )
    .await;
    let refused = client
        .watch_operations(pb::WatchOperationsRequest {
            after_sequence: 2,
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner()
        .message()
        .await
        .expect_err("refused");
    assert_eq!(
        (refused.code(), reason(&refused)),
        (tonic::Code::FailedPrecondition, "EVENTS_EXPIRED".to_owned())
    );
    // From the start, or from now, it goes on.
    let mut from_start = client
        .watch_operations(pb::WatchOperationsRequest::default())
        .await
        .expect("watch")
        .into_inner();
    let first = from_start.message().await.expect("stream").expect("open");
    assert!(matches!(
        first.item,
        Some(pb::watch_operations_response::Item::CaughtUpTo(_))
    ));
    ledger.stop().await;
}
