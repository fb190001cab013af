//! fakepay behaves like the provider it stands in for: Stripe's idempotency rules, list shape,
//! and the faults the other tests rely on.

use reqwest::StatusCode;
use serde_json::Value;

use crate::support::fakepay_stats;

async fn start() -> String {
    crate::support::serve(fakepay::router(fakepay::Provider::default())).await
}

async fn post(
    base: &str,
    key: Option<&str>,
    amount: &str,
    fault: Option<&str>,
) -> reqwest::Result<reqwest::Response> {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/v1/refunds"))
        .form(&[
            ("payment_intent", "pi_1"),
            ("amount", amount),
            ("currency", "eur"),
            ("metadata[once_operation_id]", "op-1"),
        ]);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    if let Some(fault) = fault {
        request = request.header("X-Fakepay-Fault", fault);
    }
    request.send().await
}

async fn json(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    (status, response.json().await.unwrap())
}

async fn faults(base: &str, faults: Value) {
    let response = reqwest::Client::new()
        .post(format!("{base}/_fakepay/faults"))
        .json(&faults)
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success());
}

#[tokio::test]
async fn idempotency_keys_replay_refuse_other_parameters_and_block_concurrent_use() {
    let base = start().await;
    let (status, first) = json(post(&base, Some("k1"), "500", None).await.unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (
            first["object"].as_str(),
            first["metadata"]["once_operation_id"].as_str()
        ),
        (Some("refund"), Some("op-1"))
    );
    let replayed = post(&base, Some("k1"), "500", None).await.unwrap();
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(json(replayed).await.1, first);
    let (status, error) = json(post(&base, Some("k1"), "900", None).await.unwrap()).await;
    assert_eq!(
        (status, error["error"]["type"].as_str()),
        (StatusCode::BAD_REQUEST, Some("idempotency_error"))
    );

    // Two requests with one key at once: the second arrives while the first is executing.
    faults(&base, serde_json::json!({ "delay_ms": 500 })).await;
    let (one, two) = tokio::join!(
        post(&base, Some("k2"), "500", None),
        post(&base, Some("k2"), "500", None)
    );
    let mut statuses = [one.unwrap().status(), two.unwrap().status()];
    statuses.sort();
    assert_eq!(statuses, [StatusCode::OK, StatusCode::CONFLICT]);
    assert_eq!(fakepay_stats(&base).await["refunds"], 2);
}

#[tokio::test]
async fn write_faults_commit_or_not_as_named() {
    let base = start().await;
    // Failing before the commit stores nothing, not even the key: a retry executes.
    let (status, _) = json(
        post(&base, Some("a"), "100", Some("fail_before_commit"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fakepay_stats(&base).await["refunds"], 0);
    assert_eq!(
        post(&base, Some("a"), "100", None).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(fakepay_stats(&base).await["refunds"], 1);

    // Committing then answering 500: the key replays the refund.
    let (status, _) = json(
        post(&base, Some("b"), "100", Some("commit_then_500"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        post(&base, Some("b"), "100", None).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(fakepay_stats(&base).await["refunds"], 2);

    // Committing then dropping the connection: no response at all.
    let dropped = post(&base, Some("c"), "100", Some("commit_then_drop")).await;
    assert!(dropped.is_err(), "{dropped:?}");
    assert_eq!(fakepay_stats(&base).await["refunds"], 3);

    // A run-wide fault for a number of writes.
    faults(
        &base,
        serde_json::json!({ "write": "fail_before_commit", "write_times": 1 }),
    )
    .await;
    assert_eq!(
        post(&base, None, "100", None).await.unwrap().status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        post(&base, None, "100", None).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(fakepay_stats(&base).await["refunds"], 4);
}

#[tokio::test]
async fn lists_page_filter_lag_and_can_be_unavailable() {
    let base = start().await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        let (_, refund) = json(post(&base, None, "100", None).await.unwrap()).await;
        ids.push(refund["id"].as_str().unwrap().to_owned());
    }
    let list = |query: String| {
        let base = base.clone();
        async move {
            json(
                reqwest::get(format!("{base}/v1/refunds?{query}"))
                    .await
                    .unwrap(),
            )
            .await
        }
    };
    let (_, page) = list("payment_intent=pi_1&limit=2".into()).await;
    assert_eq!(
        (page["object"].as_str(), page["has_more"].as_bool()),
        (Some("list"), Some(true))
    );
    let newest_first: Vec<&str> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(newest_first, [ids[4].as_str(), ids[3].as_str()]);
    let (_, rest) = list(format!(
        "payment_intent=pi_1&limit=10&starting_after={}",
        ids[3]
    ))
    .await;
    assert_eq!(
        (
            rest["data"].as_array().unwrap().len(),
            rest["has_more"].as_bool()
        ),
        (3, Some(false))
    );
    let (_, other) = list("payment_intent=pi_other".into()).await;
    assert!(other["data"].as_array().unwrap().is_empty());
    let (status, found) = json(
        reqwest::get(format!("{base}/v1/refunds/{}", ids[0]))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, found["id"].as_str()),
        (StatusCode::OK, Some(ids[0].as_str()))
    );

    faults(&base, serde_json::json!({ "list_lag_ms": 60_000 })).await;
    let (_, lagging) = list("payment_intent=pi_1".into()).await;
    assert!(
        lagging["data"].as_array().unwrap().is_empty(),
        "writes are not visible yet"
    );
    faults(&base, serde_json::json!({ "lookups_unavailable": true })).await;
    let (status, _) = list("payment_intent=pi_1".into()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}
