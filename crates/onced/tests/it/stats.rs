//! GetStats: operations by state and tool, how long UNKNOWN ones have waited, how long UNKNOWN
//! took to resolve by each door, and the anomalies, for the caller's tenant.

use once_api::pb;

use crate::support::*;

on_both_backends!(stats_count_states_unknown_ages_doors_and_anomalies);

async fn stats_count_states_unknown_ages_doors_and_anomalies(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let grant = claim(&mut client, begin("s-confirmed", ARGS)).await;
    confirm(&mut client, "s-confirmed", grant.fencing_token, b"{}")
        .await
        .unwrap();
    for id in ["s-unknown-1", "s-unknown-2", "s-resolved"] {
        let grant = claim(&mut client, begin(id, ARGS)).await;
        report_unknown(&mut client, id, grant.fencing_token)
            .await
            .unwrap();
    }
    resolve(&mut client, "s-resolved", pb::OperationState::Absent, "r-1")
        .await
        .unwrap();
    // A lease runs out; the attempt's late report settles it.
    let mut request = begin("s-late", ARGS);
    request.lease_ttl = Some(ms(100));
    let late = claim(&mut client, request).await;
    wait_for_state(&client, "s-late", pb::OperationState::Unknown).await;
    confirm(&mut client, "s-late", late.fencing_token, b"{}")
        .await
        .unwrap();
    let mut email = begin("s-email", ARGS);
    email.tool = "send_email".into();
    claim(&mut client, email).await;

    let stats = client
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let counts: Vec<(i32, &str, u64)> = stats
        .operations
        .iter()
        .map(|c| (c.state, c.tool.as_str(), c.count))
        .collect();
    use pb::OperationState::*;
    assert_eq!(
        counts,
        [
            (Absent as i32, "issue_refund", 1),
            (Confirmed as i32, "issue_refund", 2),
            (InFlight as i32, "send_email", 1),
            (Unknown as i32, "issue_refund", 2),
        ]
    );
    let unknown = stats.unknown.unwrap();
    assert_eq!(unknown.count, 2);
    let (max, p50) = (unknown.max.unwrap(), unknown.p50.unwrap());
    assert!((max.seconds, max.nanos) >= (p50.seconds, p50.nanos));
    let doors: Vec<(&str, u64)> = stats
        .resolved
        .iter()
        .map(|d| (d.door.as_str(), d.ages.unwrap().count))
        .collect();
    assert_eq!(
        doors,
        [("late_report", 1), ("reconciler", 0), ("operator", 1)]
    );
    let events: Vec<(&str, u64)> = stats
        .events
        .iter()
        .map(|e| (e.kind.as_str(), e.count))
        .collect();
    assert_eq!(
        events,
        [
            ("DOUBLE_EXECUTION", 0),
            ("RESOLUTION_CONTRADICTED", 0),
            ("ESCALATED", 0)
        ]
    );
    ledger.stop().await;
}
