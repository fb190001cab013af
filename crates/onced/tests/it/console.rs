//! The web console as an HTTP client meets it, where the browser suite (`tests/mcp`) cannot
//! reach: a queue longer than one page.

use std::time::Duration;

use crate::support::*;

on_both_backends!(
    a_text_search_finds_an_operation_beyond_the_oldest_page,
    the_overview_shows_the_chains_head_and_what_its_last_verification_found,
);

/// An `onced` serving its console, and the console's address. Both on port 0, the ports learnt
/// from the log: a port picked in advance could be taken meanwhile.
async fn with_console(db: &TestDb) -> (OncedProcess, std::net::SocketAddr) {
    let log = db.scratch_dir().join("onced.log");
    let ledger = OncedProcess::spawn(&db.url, log, &["--console-listen", "127.0.0.1:0"]).await;
    let listen = eventually(
        patient(Duration::from_secs(10)),
        "the console's address",
        || std::future::ready(announced_address(&ledger.log(), "console serving")),
    )
    .await;
    (ledger, listen)
}

/// The queue lists the oldest 500 UNKNOWN operations; a text search looks through all of them
/// (up to its bound), so the youngest of 520 is found by its id.
async fn a_text_search_finds_an_operation_beyond_the_oldest_page(store: Engine) {
    let db = TestDb::new(store).await;
    let (ledger, listen) = with_console(&db).await;
    let mut client = ledger.client().await;
    for i in 0..520 {
        let id = format!("search-{i:03}");
        let grant = claim(&mut client, begin(&id, ARGS)).await;
        report_unknown(&mut client, &id, grant.fencing_token)
            .await
            .unwrap();
    }
    let http = reqwest::Client::new();
    let queue = |query: &str| {
        let (http, url) = (http.clone(), format!("http://{listen}/queue?{query}"));
        async move {
            let answer = http.get(url).send().await.ok()?;
            (answer.status() == 200).then_some(())?;
            answer.text().await.ok()
        }
    };
    let everything = eventually(patient(Duration::from_secs(10)), "the console", || {
        queue("")
    })
    .await;
    assert!(everything.contains("search-000") && !everything.contains("search-519"));
    let found = queue("q=search-519").await.unwrap();
    assert!(found.contains(r#"data-operation="search-519""#), "{found}");
    assert!(found.contains(r#"data-count="1""#), "{found}");
}

/// The overview shows the history's chain: its newest link, and whether the last verification
/// found everything matching, a rewrite, or has not run.
async fn the_overview_shows_the_chains_head_and_what_its_last_verification_found(store: Engine) {
    let db = TestDb::new(store).await;
    let (ledger, listen) = with_console(&db).await;
    let mut client = ledger.client().await;
    let grant = claim(&mut client, begin("chained-1", ARGS)).await;
    confirm(&mut client, "chained-1", grant.fencing_token, b"{}")
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let overview = || {
        let (http, url) = (http.clone(), format!("http://{listen}/overview"));
        async move {
            let answer = http.get(url).send().await.ok()?;
            (answer.status() == 200).then_some(())?;
            answer.text().await.ok()
        }
    };
    let newest = db.scalar("SELECT max(sequence) FROM events").await;
    let linked = format!(r#"data-through="{newest}""#);
    let page = eventually(
        patient(Duration::from_secs(20)),
        "the chain's head",
        || async { overview().await.filter(|page| page.contains(&linked)) },
    )
    .await;
    assert!(page.contains(r#"data-link="1""#), "{page}");
    assert!(page.contains(r#"data-verified="never""#), "{page}");

    let verify = |mut client: Grpc| async move {
        client
            .verify_history(once_api::pb::VerifyHistoryRequest::default())
            .await
            .unwrap()
            .into_inner()
    };
    assert!(verify(client.clone()).await.problem.is_none());
    let page = overview().await.unwrap();
    assert!(page.contains(r#"data-verified="clean""#), "{page}");
    assert!(page.contains("everything matched"), "{page}");

    db.execute("UPDATE events SET actor = 'executor:someone-else' WHERE kind = 'CLAIMED'")
        .await;
    assert!(verify(client.clone()).await.problem.is_some());
    let page = overview().await.unwrap();
    assert!(page.contains(r#"data-verified="problem""#), "{page}");
    assert!(page.contains("does not match"), "{page}");
}
