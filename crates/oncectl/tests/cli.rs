//! `oncectl` end to end: the built binary against a real `onced` (in this process, on a real
//! socket) over SQLite and PostgreSQL, its JSON parsed and checked, its exit codes, and its
//! human output on a pipe and on a terminal.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use once_api::pb;
use once_core::receipt::Receipt;
use once_testkit::*;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

on_both_backends!(
    list_show_and_resolve_an_unknown_operation,
    resolve_refuses_without_a_reason_a_stale_attempt_or_a_missing_operation,
    a_resolve_whose_answer_is_lost_is_sent_again_and_applied_once,
    reconcile_looks_up_now_and_shows_the_verdict,
    a_filter_is_listed_first_then_reconciled_and_resolved_one_by_one,
    watch_prints_every_change_once_as_json_lines,
    a_watch_outlasts_a_ledger_restart_and_misses_nothing,
    a_watch_narrowed_by_provider_and_age_prints_only_their_operations,
    a_confirmed_resolution_keeps_the_provider_ref_and_the_result_file,
    keys_are_created_listed_and_revoked_by_an_admin,
    operations_are_named_by_a_unique_start_of_their_id,
    an_admin_lists_counts_and_watches_every_tenant_at_once,
    a_key_that_may_not_settle_is_refused_once_for_a_whole_filter,
    a_bulk_command_keeps_to_its_keys_request_rate,
    a_receipt_is_got_and_verified_with_the_public_key_alone,
);

/// Runs `oncectl --addr http://ADDR ARGS…` with a home of its own (so no profile of the
/// machine's is read) and nothing from the environment that names a ledger.
async fn oncectl(addr: SocketAddr, args: &[&str]) -> Output {
    oncectl_with(addr, args, &[]).await
}

async fn oncectl_with(addr: SocketAddr, args: &[&str], env: &[(&str, &str)]) -> Output {
    let home = tempfile::tempdir().unwrap();
    let addr = format!("http://{addr}");
    let args: Vec<&str> = ["--addr", addr.as_str()]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    oncectl_at_home(home.path(), &args, env).await
}

/// Runs `oncectl ARGS…` with `home` as its home, and nothing from the environment that names
/// a ledger but `env`.
async fn oncectl_at_home(home: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncectl"));
    command
        .args(args)
        .env("HOME", home)
        .env_remove("XDG_CONFIG_HOME")
        .env("USER", "alice")
        .stdin(std::process::Stdio::null());
    for variable in [
        "ONCE_ADDR",
        "ONCE_KEY",
        "ONCE_CA",
        "ONCE_PROFILE",
        "ONCECTL_CONFIG",
    ] {
        command.env_remove(variable);
    }
    command.envs(env.iter().copied());
    within(Duration::from_secs(60), "oncectl", command.output())
        .await
        .expect("run oncectl")
}

/// `oncectl --addr http://ADDR -o json watch ARGS…`, running, and what it says on stderr, line
/// by line (its stdout is left for the test to read).
fn watch(addr: SocketAddr, args: &[&str]) -> (tokio::process::Child, Said) {
    let mut watching = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncectl"))
        .args(["--addr", &format!("http://{addr}")])
        .args(["-o", "json", "watch"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let said = tokio::io::BufReader::new(watching.stderr.take().unwrap()).lines();
    (watching, said)
}

type Said = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>;

/// Waits (boundedly) until the watch says a line containing `needle`.
async fn until_said(said: &mut Said, needle: &str, what: &str) {
    within(Duration::from_secs(20), what, async {
        while let Some(line) = said.next_line().await.unwrap() {
            if line.contains(needle) {
                return;
            }
        }
        panic!("oncectl watch ended before it said {needle:?}");
    })
    .await;
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exited")
}

fn json(output: &Output) -> Value {
    assert_eq!(
        code(output),
        0,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A new key of `tenant` holding `role`, made with the admin key.
async fn key_with_role(addr: SocketAddr, admin_key: &str, tenant: &str, role: &str) -> String {
    use once_api::admin_pb::{self as apb, admin_client::AdminClient};
    let mut admin = AdminClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let request = apb::CreateKeyRequest {
        tenant: tenant.into(),
        name: format!("{tenant}-{role}"),
        roles: vec![role.into()],
        certificate_pem: String::new(),
    };
    let made = admin.create_key(with_key(request, Some(admin_key))).await;
    made.unwrap().into_inner().secret
}

/// `id` begun with `key` (its tenant's), and reported UNKNOWN by its attempt.
async fn unknown_with_key(client: &mut Grpc, id: &str, key: &str) {
    let begun = client
        .begin(with_key(begin(id, ARGS), Some(key)))
        .await
        .unwrap()
        .into_inner();
    let grant = expect_execute(&begun);
    let unknown = pb::ReportUnknownRequest {
        operation_id: id.into(),
        fencing_token: grant.fencing_token,
        reason: "timeout after sending".into(),
    };
    client
        .report_unknown(with_key(unknown, Some(key)))
        .await
        .unwrap();
}

/// An operation whose report said it cannot tell, and one confirmed.
async fn unknown_and_confirmed(client: &mut Grpc) -> pb::Execute {
    let grant = claim(client, begin("refund:o-1", ARGS)).await;
    report_unknown(client, "refund:o-1", grant.fencing_token)
        .await
        .unwrap();
    let done = claim(client, begin("refund:o-2", ARGS)).await;
    confirm(
        client,
        "refund:o-2",
        done.fencing_token,
        b"{\"refund\":\"re_2\"}",
    )
    .await
    .unwrap();
    grant
}

/// `refund:o-3`, which a `stripe` reconciler can look up, claimed and reported UNKNOWN.
async fn stripe_unknown(client: &mut Grpc) {
    let mut looked_up = begin("refund:o-3", ARGS);
    looked_up.provider = "stripe".into();
    let grant = claim(client, looked_up).await;
    report_unknown(client, "refund:o-3", grant.fencing_token)
        .await
        .unwrap();
}

async fn list_show_and_resolve_an_unknown_operation(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let grant = unknown_and_confirmed(&mut client).await;

    // UNKNOWN by default; every state with --all.
    let listed = json(&oncectl(ledger.addr, &["-o", "json", "list"]).await);
    let ids: Vec<&str> = listed["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| op["operation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["refund:o-1"]);
    assert_eq!(listed["operations"][0]["last_event"], "REPORTED_UNKNOWN");
    assert_eq!(listed["more"], false);
    let all = json(&oncectl(ledger.addr, &["list", "--all", "--json"]).await);
    assert_eq!(all["operations"].as_array().unwrap().len(), 2);
    let confirmed = json(&oncectl(ledger.addr, &["list", "--state", "CONFIRMED", "--json"]).await);
    assert_eq!(confirmed["operations"][0]["operation_id"], "refund:o-2");
    // Paging is done for the user: one a page here, both in the answer.
    let paged = json(&oncectl(ledger.addr, &["list", "--all", "--limit", "1", "--json"]).await);
    assert_eq!(
        (
            paged["operations"].as_array().unwrap().len(),
            &paged["more"]
        ),
        (1, &Value::Bool(true))
    );

    let shown = json(&oncectl(ledger.addr, &["show", "refund:o-1", "-o", "json"]).await);
    assert_eq!(shown["state"], "UNKNOWN");
    assert_eq!(shown["attempts"][0]["session_id"], "session-1");
    assert_eq!(shown["attempts"][0]["request_id"], "1");
    assert_eq!(shown["attempts"][0]["fencing_token"], grant.fencing_token);
    let kinds: Vec<&str> = shown["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["CLAIMED", "REPORTED_UNKNOWN"]);

    let resolved = oncectl(
        ledger.addr,
        &[
            "resolve",
            "refund:o-1",
            "--absent",
            "--reason",
            "no refund in the provider's dashboard",
            "--yes",
            "--json",
        ],
    )
    .await;
    let answer = json(&resolved);
    assert_eq!(answer["state"], "ABSENT");
    assert_eq!(answer["attempt"], 1);
    // What it was about to do was said first, naming the attempt it is bound to.
    assert!(
        stderr(&resolved).contains("bound to attempt 1"),
        "{}",
        stderr(&resolved)
    );
    let shown = json(&oncectl(ledger.addr, &["show", "refund:o-1", "--json"]).await);
    let last = shown["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["kind"], "RESOLVED");
    assert_eq!(last["actor"], "operator:alice");
    assert_eq!(last["reason"], "no refund in the provider's dashboard");

    // The figures: the resolution went through the operator's door.
    let stats = json(&oncectl(ledger.addr, &["stats", "--window", "1h", "--json"]).await);
    assert_eq!(stats["resolved"]["operator"]["count"], 1);
    assert_eq!(stats["resolved"]["reconciler"]["count"], 0);
    assert_eq!(stats["unknown"]["count"], 0);
    let states: Vec<(&str, i64)> = stats["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["state"].as_str().unwrap(), c["count"].as_i64().unwrap()))
        .collect();
    assert_eq!(states, [("ABSENT", 1), ("CONFIRMED", 1)]);
    let text = String::from_utf8(oncectl(ledger.addr, &["stats"]).await.stdout).unwrap();
    assert!(
        text.contains("operator") && text.contains("ESCALATED"),
        "{text}"
    );

    // A duplicate of the confirmed one (the harness retrying in the same session): recorded,
    // and told apart.
    let mut again = begin("refund:o-2", ARGS);
    again.context.as_mut().unwrap().request_id = "2".into();
    let replay = client.begin(again).await.unwrap().into_inner();
    expect_replay(&replay);
    let explained = eventually(
        Duration::from_secs(10),
        "the duplicate to be recorded",
        || async {
            let shown = json(&oncectl(ledger.addr, &["show", "refund:o-2", "--json"]).await);
            (shown["calls"].as_array().unwrap().len() == 2).then_some(shown)
        },
    )
    .await;
    assert_eq!(explained["calls"][1]["decision"], "REPLAY");
    assert_eq!(explained["calls"][1]["origin"], "harness_retry");
    assert_eq!(
        explained["forensics"],
        "1 execution, 1 duplicate prevented: 1 harness retry"
    );
    let window = json(&oncectl(ledger.addr, &["forensics", "--since", "1h", "--json"]).await);
    assert_eq!(
        (&window["prevented"], &window["origins"]["harness_retry"]),
        (&1.into(), &1.into())
    );
    let text = String::from_utf8(oncectl(ledger.addr, &["forensics"]).await.stdout).unwrap();
    assert!(text.contains("1 harness retry"), "{text}");

    // The human output, on a pipe: 80 columns, no colour.
    let table = oncectl(ledger.addr, &["list", "--all"]).await;
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(
        text.contains("refund:o-2") && text.contains("CONFIRMED"),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "no colour on a pipe: {text:?}");
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
    let shown = oncectl(ledger.addr, &["show", "refund:o-1"]).await;
    let text = String::from_utf8(shown.stdout).unwrap();
    assert!(
        text.contains("RESOLVED") && !text.contains('\u{1b}'),
        "{text}"
    );
    ledger.stop().await;
}

async fn resolve_refuses_without_a_reason_a_stale_attempt_or_a_missing_operation(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let mut request = begin("refund:o-3", ARGS);
    request.lease_ttl = Some(ms(100));
    claim(&mut client, request).await;
    wait_for_state(&client, "refund:o-3", pb::OperationState::Unknown).await;
    resolve(
        &mut client,
        "refund:o-3",
        pb::OperationState::Absent,
        "first",
    )
    .await
    .unwrap();
    // A second attempt ran and went UNKNOWN: attempt 1 is stale.
    let grant = claim(&mut client, begin("refund:o-3", ARGS)).await;
    report_unknown(&mut client, "refund:o-3", grant.fencing_token)
        .await
        .unwrap();
    let before = db.snapshot().await;

    let no_reason = oncectl(ledger.addr, &["resolve", "refund:o-3", "--absent", "--yes"]).await;
    assert_eq!(code(&no_reason), 2, "{}", stderr(&no_reason));
    let blank = oncectl(
        ledger.addr,
        &[
            "resolve",
            "refund:o-3",
            "--absent",
            "--reason",
            " ",
            "--yes",
        ],
    )
    .await;
    assert_eq!(code(&blank), 2, "{}", stderr(&blank));
    let stale = oncectl(
        ledger.addr,
        &[
            "resolve",
            "refund:o-3",
            "--absent",
            "--attempt",
            "1",
            "--reason",
            "looked at the first attempt",
            "--yes",
        ],
    )
    .await;
    assert_eq!(code(&stale), 4, "{}", stderr(&stale));
    assert!(
        stderr(&stale).contains("has run since"),
        "{}",
        stderr(&stale)
    );
    // Without a terminal to ask on, nothing is sent unless --yes.
    let unasked = oncectl(
        ledger.addr,
        &["resolve", "refund:o-3", "--absent", "--reason", "sure"],
    )
    .await;
    assert_eq!(code(&unasked), 2, "{}", stderr(&unasked));
    let missing = oncectl(ledger.addr, &["show", "refund:nope"]).await;
    assert_eq!(code(&missing), 3, "{}", stderr(&missing));
    let missing = oncectl(
        ledger.addr,
        &[
            "resolve",
            "refund:nope",
            "--absent",
            "--reason",
            "x",
            "--yes",
        ],
    )
    .await;
    assert_eq!(code(&missing), 3, "{}", stderr(&missing));
    assert_eq!(db.snapshot().await, before, "nothing changed");
    assert_eq!(
        state_of(&mut client, "refund:o-3").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

async fn a_resolve_whose_answer_is_lost_is_sent_again_and_applied_once(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    let proxy = LosingProxy::start(ledger.addr, b"lost-answer-7f3a".to_vec()).await;
    // Every other answer passes.
    let through = oncectl(proxy.addr, &["show", "refund:o-1", "--json"]).await;
    assert_eq!(json(&through)["state"], "UNKNOWN");
    let resolving = tokio::spawn(oncectl(
        proxy.addr,
        &[
            "resolve",
            "refund:o-1",
            "--confirmed",
            "--provider-ref",
            "re_9",
            "--result",
            "{\"refund\":\"re_9\"}",
            "--reason",
            "found in the provider's dashboard",
            "--resolution-id",
            "lost-answer-7f3a",
            "--yes",
            "--json",
        ],
    ));
    // The ledger applied it; its answer is lost on the way back.
    let resolved = "SELECT count(*) FROM events WHERE kind = 'RESOLVED'";
    let mut resolving = Some(resolving);
    eventually(
        Duration::from_secs(20),
        "the resolution to be applied",
        || {
            let finished = resolving.as_ref().is_some_and(|r| r.is_finished());
            let ended = finished.then(|| resolving.take().unwrap());
            async {
                if let Some(ended) = ended {
                    let output = ended.await.unwrap();
                    panic!(
                        "oncectl ended before the resolution was applied: {}",
                        stderr(&output)
                    );
                }
                (db.scalar(resolved).await == 1).then_some(())
            }
        },
    )
    .await;
    let resolving = resolving.unwrap();
    proxy.cut();
    let output = resolving.await.unwrap();
    assert_eq!(json(&output)["state"], "CONFIRMED");
    assert_eq!(db.scalar(resolved).await, 1, "applied once");
    let replay = client
        .begin(begin("refund:o-1", ARGS))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_replay(&replay).result, b"{\"refund\":\"re_9\"}");
    ledger.stop().await;
}

async fn reconcile_looks_up_now_and_shows_the_verdict(store: Engine) {
    let db = TestDb::new(store).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    // The workers wait an hour: only oncectl looks anything up.
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"1h\"\n\n[[reconciler]]\nname = \"stripe\"\n\
             kind = \"stripe\"\nendpoint = \"{provider}\"\nsettle_time = \"0s\"\ntimeout = \"2s\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut client = ledger.client().await;
    let mut request = begin("refund:o-4", ARGS);
    request.provider = "stripe".into();
    request.lookup_hints_json = r#"{"payment_intent":"pi_o-4"}"#.into();
    let grant = claim(&mut client, request).await;
    // The refund happened at the provider; the answer never reached the executor.
    refund_at_provider(&provider, "pi_o-4", &grant.provider_key).await;
    report_unknown(&mut client, "refund:o-4", grant.fencing_token)
        .await
        .unwrap();

    let found = json(&oncectl(ledger.addr, &["reconcile", "refund:o-4", "--json"]).await);
    assert_eq!(found["reconciler"], "stripe");
    assert_eq!(
        (&found["verdict"], &found["state"]),
        (&"CONFIRMED".into(), &"CONFIRMED".into())
    );
    assert!(found["detail"].as_str().unwrap().contains("re_"), "{found}");
    // Only UNKNOWN operations are looked up.
    let again = oncectl(ledger.addr, &["reconcile", "refund:o-4"]).await;
    assert_eq!(code(&again), 4, "{}", stderr(&again));
    assert!(
        stderr(&again).contains("refund:o-4 is CONFIRMED already"),
        "{}",
        stderr(&again)
    );
    ledger.stop().await;
}

/// UNKNOWN, looked up by the `stripe` reconciler with these hints.
async fn stripe_unknown_refund(client: &mut Grpc, id: &str) -> pb::Execute {
    let mut request = begin(id, ARGS);
    request.provider = "stripe".into();
    request.lookup_hints_json = format!(r#"{{"payment_intent":"pi_{id}"}}"#);
    let grant = claim(client, request).await;
    report_unknown(client, id, grant.fencing_token)
        .await
        .unwrap();
    grant
}

/// The ids of a bulk command's listing or outcomes, and each outcome's state.
fn outcomes(found: &Value) -> Vec<(String, String, String)> {
    found["outcomes"]
        .as_array()
        .unwrap_or_else(|| panic!("no outcomes: {found}"))
        .iter()
        .map(|row| {
            let text = |key: &str| row[key].as_str().unwrap_or_default().to_owned();
            (text("operation_id"), text("outcome"), text("state"))
        })
        .collect()
}

async fn a_filter_is_listed_first_then_reconciled_and_resolved_one_by_one(store: Engine) {
    let db = TestDb::new(store).await;
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    // The workers wait an hour: only oncectl looks anything up. A miss proves nothing for an
    // hour: it leaves the operation UNKNOWN.
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"1h\"\n\n[[reconciler]]\nname = \"stripe\"\n\
             kind = \"stripe\"\nendpoint = \"{provider}\"\nsettle_time = \"1h\"\ntimeout = \"2s\"\n\
             dashboard = \"https://dash.example/refunds/{{provider_ref}}\"\n\n\
             [[reconciler]]\nname = \"down\"\nkind = \"stripe\"\nendpoint = \"http://127.0.0.1:9\"\n\
             settle_time = \"1h\"\ntimeout = \"2s\"\n"
        ),
    );
    let ledger = TestLedger::spawn_with(&db, &["--config", config.as_str()]).await;
    let mut client = ledger.client().await;
    // One refund happened at the provider, one did not; a third has no reconciler.
    let happened = stripe_unknown_refund(&mut client, "refund:b-1").await;
    refund_at_provider(&provider, "pi_refund:b-1", &happened.provider_key).await;
    stripe_unknown_refund(&mut client, "refund:b-2").await;
    let grant = claim(&mut client, begin("refund:b-3", ARGS)).await;
    report_unknown(&mut client, "refund:b-3", grant.fencing_token)
        .await
        .unwrap();

    // A dry run lists what the filter selects and does nothing.
    let filter = ["--filter", "provider=stripe"];
    let listed = json(
        &oncectl(
            ledger.addr,
            &[&["reconcile", "--dry-run", "--json"][..], &filter].concat(),
        )
        .await,
    );
    let ids: Vec<_> = listed["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| op["operation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["refund:b-1", "refund:b-2"], "{listed}");
    assert_eq!(listed["dry_run"], true);
    let human = oncectl(
        ledger.addr,
        &[&["reconcile", "--dry-run"][..], &filter].concat(),
    )
    .await;
    assert_eq!(code(&human), 0, "{}", stderr(&human));
    let said = String::from_utf8_lossy(&human.stdout);
    assert!(
        said.contains("Dry run: 2 UNKNOWN operations match provider=stripe; nothing was done."),
        "{said}"
    );
    let unknown = json(&oncectl(ledger.addr, &["list", "--json"]).await);
    assert_eq!(
        unknown["operations"].as_array().unwrap().len(),
        3,
        "{unknown}"
    );

    // Without a terminal it does not ask, and does nothing, unless told --yes.
    let unasked = oncectl(ledger.addr, &[&["reconcile"][..], &filter].concat()).await;
    says(&unasked, 2, &["not asking without a terminal: pass --yes"]);

    // Each is looked up; each outcome is printed.
    let done = json(
        &oncectl(
            ledger.addr,
            &[
                &["--operator", "alice", "reconcile", "--yes", "--json"][..],
                &filter,
            ]
            .concat(),
        )
        .await,
    );
    assert_eq!(
        outcomes(&done),
        [
            ("refund:b-1".into(), "done".into(), "CONFIRMED".into()),
            // One miss is not proof that it did not happen: it stays UNKNOWN.
            ("refund:b-2".into(), "done".into(), "UNKNOWN".into()),
        ],
        "{done}"
    );

    // What a reconciler found links to the provider's dashboard; what it did not has no link.
    let found = json(&oncectl(ledger.addr, &["show", "refund:b-1", "--json"]).await);
    let reference = found["provider_ref"].as_str().unwrap().to_owned();
    assert_eq!(
        found["provider_dashboard"],
        format!("https://dash.example/refunds/{reference}"),
        "{found}"
    );
    let missed = json(&oncectl(ledger.addr, &["show", "refund:b-2", "--json"]).await);
    assert!(missed["provider_dashboard"].is_null(), "{missed}");

    // Each lookup's event names who asked for it.
    let shown = json(&oncectl(ledger.addr, &["show", "refund:b-2", "--json"]).await);
    let looked_up = shown["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "LOOKUP_INCONCLUSIVE")
        .unwrap_or_else(|| panic!("no lookup: {shown}"));
    assert!(
        looked_up["details"]["asked_by"] == "operator:alice",
        "{looked_up}"
    );

    // The rest resolved ABSENT with one reason, each bound to the attempt it was listed with.
    let resolve = [
        "resolve",
        "--filter",
        "tool=issue_refund",
        "--absent",
        "--reason",
        "provider outage: never sent",
    ];
    let listed = json(
        &oncectl(
            ledger.addr,
            &[&resolve[..], &["--dry-run", "--json"]].concat(),
        )
        .await,
    );
    assert_eq!(
        listed["operations"].as_array().unwrap().len(),
        2,
        "{listed}"
    );
    let resolved =
        json(&oncectl(ledger.addr, &[&resolve[..], &["--yes", "--json"]].concat()).await);
    assert_eq!(
        outcomes(&resolved),
        [
            ("refund:b-2".into(), "done".into(), "ABSENT".into()),
            ("refund:b-3".into(), "done".into(), "ABSENT".into()),
        ],
        "{resolved}"
    );
    assert!(resolved["outcomes"][1]["resolution_id"]
        .as_str()
        .is_some_and(|id| !id.is_empty()));
    let shown = json(&oncectl(ledger.addr, &["show", "refund:b-3", "--json"]).await);
    let last = shown["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["reason"], "provider outage: never sent", "{shown}");
    assert!(
        last["actor"].as_str().unwrap().starts_with("operator:"),
        "{shown}"
    );

    // Nothing left: said, and done, with nothing.
    let none = oncectl(ledger.addr, &[&resolve[..], &["--yes"]].concat()).await;
    says(&none, 0, &[]);
    assert!(String::from_utf8_lossy(&none.stdout)
        .contains("No UNKNOWN operation matches tool=issue_refund."));

    // Each reconciler's lookups, in the figures: one whose provider cannot be reached fails.
    let mut down = begin("refund:b-4", ARGS);
    down.provider = "down".into();
    let grant = claim(&mut client, down).await;
    report_unknown(&mut client, "refund:b-4", grant.fencing_token)
        .await
        .unwrap();
    let failed = json(&oncectl(ledger.addr, &["reconcile", "refund:b-4", "--json"]).await);
    assert_eq!(failed["verdict"], "UNKNOWN", "{failed}");
    let stats = json(&oncectl(ledger.addr, &["stats", "--json"]).await);
    let figures: Vec<_> = stats["reconcilers"]
        .as_array()
        .unwrap_or_else(|| panic!("no reconcilers: {stats}"))
        .iter()
        .map(|r| {
            let n = |key: &str| r[key].as_u64().unwrap();
            (
                r["reconciler"].as_str().unwrap().to_owned(),
                n("settled"),
                n("missed"),
                n("failed"),
            )
        })
        .collect();
    assert_eq!(
        figures,
        [("down".to_owned(), 0, 0, 1), ("stripe".to_owned(), 1, 1, 0)],
        "{stats}"
    );
    assert!(
        stats["reconcilers"][1]["max_ms"].as_u64().is_some(),
        "{stats}"
    );
    let human = oncectl(ledger.addr, &["stats"]).await;
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("Reconciler lookups over the last 1h"),
        "{}",
        String::from_utf8_lossy(&human.stdout)
    );

    // A filter that cannot be read, a CONFIRMED by filter, and one operation with a filter are
    // usage mistakes.
    for (args, needle) in [
        (
            &["reconcile", "--filter", "colour=red"][..],
            "no filter \"colour\"",
        ),
        (&["reconcile", "--filter", ""][..], "name at least one of"),
        (
            &["reconcile", "--filter", "older-than=soon"][..],
            "older-than=soon",
        ),
        (
            &[
                "resolve",
                "--filter",
                "all",
                "--confirmed",
                "--provider-ref",
                "re_1",
                "--reason",
                "r",
            ][..],
            "cannot be used with",
        ),
        (
            &["reconcile", "refund:b-1", "--filter", "all"][..],
            "cannot be used with",
        ),
    ] {
        let refused = oncectl(ledger.addr, args).await;
        assert_eq!(code(&refused), 2, "{args:?}: {}", stderr(&refused));
        assert!(
            stderr(&refused).contains(needle),
            "{args:?}: {}",
            stderr(&refused)
        );
    }
    ledger.stop().await;
}

async fn watch_prints_every_change_once_as_json_lines(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    // Four events so far; one more comes while it watches.
    let watching = tokio::spawn(oncectl(
        ledger.addr,
        &[
            "-o", "json", "watch", "--all", "--after", "0", "--count", "5",
        ],
    ));
    let grant = claim(&mut client, begin("refund:o-5", ARGS)).await;
    let output = watching.await.unwrap();
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let lines: Vec<Value> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    let sequences: Vec<i64> = lines
        .iter()
        .map(|l| l["sequence"].as_i64().unwrap())
        .collect();
    let stored = db
        .integers("SELECT sequence FROM events ORDER BY sequence")
        .await;
    assert_eq!(sequences, stored, "every change once, in order");
    assert_eq!(lines[4]["operation_id"], "refund:o-5");
    assert_eq!(lines[4]["kind"], "CLAIMED");
    assert_eq!(lines[4]["state"], "IN_FLIGHT");
    assert_eq!(lines[4]["attempt"], grant.attempt);
    assert_eq!(lines[1]["tool"], "issue_refund");

    // By default: what touches UNKNOWN (and the anomalies), from now on.
    let (watching, mut said) = watch(ledger.addr, &["--count", "1"]);
    until_said(&mut said, "caught up", "the watch to start").await;
    confirm(&mut client, "refund:o-5", grant.fencing_token, b"{}")
        .await
        .unwrap();
    let grant = claim(&mut client, begin("refund:o-6", ARGS)).await;
    report_unknown(&mut client, "refund:o-6", grant.fencing_token)
        .await
        .unwrap();
    let output = within(
        Duration::from_secs(20),
        "the watch to see it",
        watching.wait_with_output(),
    )
    .await
    .unwrap();
    let line: Value = serde_json::from_slice(&output.stdout).expect("one JSON line");
    assert_eq!(
        (&line["operation_id"], &line["kind"]),
        (&"refund:o-6".into(), &"REPORTED_UNKNOWN".into())
    );
    let bad = oncectl(ledger.addr, &["watch", "--kind", "EXPLODED"]).await;
    assert_eq!(code(&bad), 2, "{}", stderr(&bad));
    ledger.stop().await;
}

async fn a_watch_outlasts_a_ledger_restart_and_misses_nothing(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let addr = ledger.addr;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    let (mut watching, mut said) = watch(addr, &["--all", "--after", "0", "--count", "6"]);
    let mut printed = tokio::io::BufReader::new(watching.stdout.take().unwrap()).lines();
    let mut lines = Vec::new();
    within(Duration::from_secs(20), "the four events so far", async {
        while lines.len() < 4 {
            lines.push(printed.next_line().await.unwrap().expect("a line"));
        }
    })
    .await;

    // Down for more reconnection tries than a plain call makes: a stand-in at the ledger's
    // address accepts each try and closes it. The watch says once that it broke.
    ledger.stop().await;
    until_said(
        &mut said,
        "reconnecting after #4",
        "the watch to say it broke",
    )
    .await;
    let stand_in = tokio::net::TcpListener::bind(addr).await.unwrap();
    within(Duration::from_secs(30), "the watch to keep trying", async {
        for _ in 0..6 {
            let (tried, _) = stand_in.accept().await.unwrap();
            drop(tried);
        }
    })
    .await;
    drop(stand_in);
    let ledger = TestLedger::spawn_at(&db.url, addr, &[]).await;
    let mut client = ledger.client().await;
    let grant = claim(&mut client, begin("refund:o-5", ARGS)).await;
    confirm(&mut client, "refund:o-5", grant.fencing_token, b"{}")
        .await
        .unwrap();
    within(
        Duration::from_secs(20),
        "the events after the restart",
        async {
            while let Some(line) = printed.next_line().await.unwrap() {
                lines.push(line);
            }
        },
    )
    .await;
    let status = within(Duration::from_secs(10), "oncectl to end", watching.wait())
        .await
        .unwrap();
    assert!(status.success(), "{status}");
    // Once that it broke (said above), once that it is back, however many tries between.
    let mut rest = Vec::new();
    while let Some(line) = said.next_line().await.unwrap() {
        rest.push(line);
    }
    assert_eq!(
        rest.iter()
            .filter(|l| l.contains("reconnected; watching after #4"))
            .count(),
        1,
        "{rest:?}"
    );
    assert!(
        !rest.iter().any(|l| l.contains("stream broken")),
        "{rest:?}"
    );
    let sequences: Vec<i64> = lines
        .iter()
        .map(|line| serde_json::from_str::<Value>(line).expect("a JSON line"))
        .map(|event| event["sequence"].as_i64().unwrap())
        .collect();
    let stored = db
        .integers("SELECT sequence FROM events ORDER BY sequence")
        .await;
    assert_eq!(
        sequences, stored,
        "every change once, in order, across the restart"
    );
    ledger.stop().await;
}

async fn a_watch_narrowed_by_provider_and_age_prints_only_their_operations(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    stripe_unknown(&mut client).await;

    // The first two events of a stripe operation, though four of others come before them.
    let output = oncectl(
        ledger.addr,
        &[
            "-o",
            "json",
            "watch",
            "--all",
            "--after",
            "0",
            "--provider",
            "stripe",
            "--count",
            "2",
        ],
    )
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let lines: Vec<(String, String)> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).expect("a JSON line"))
        .map(|l| (l["operation_id"].to_string(), l["kind"].to_string()))
        .collect();
    assert_eq!(
        lines,
        [
            ("\"refund:o-3\"".into(), "\"CLAIMED\"".into()),
            ("\"refund:o-3\"".into(), "\"REPORTED_UNKNOWN\"".into())
        ]
    );

    // Nothing here is an hour old: every event is passed over before it says it caught up.
    let (mut watching, mut said) = watch(
        ledger.addr,
        &["--all", "--after", "0", "--older-than", "1h"],
    );
    until_said(&mut said, "caught up to #6", "the watch to catch up").await;
    watching.start_kill().unwrap();
    let output = watching.wait_with_output().await.unwrap();
    assert_eq!(String::from_utf8_lossy(&output.stdout), "");
    ledger.stop().await;
}

async fn a_confirmed_resolution_keeps_the_provider_ref_and_the_result_file(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    stripe_unknown(&mut client).await;

    // The provider filter: only the operation a reconciler can look up.
    let listed = json(&oncectl(ledger.addr, &["list", "--provider", "stripe", "--json"]).await);
    let ids: Vec<&str> = listed["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| op["operation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["refund:o-3"]);

    let dir = tempfile::tempdir().unwrap();
    let result = b"{\"refund\":\"re_9\",\"amount_cents\":1250}\n";
    std::fs::write(dir.path().join("result.json"), result).unwrap();
    let result_arg = format!("@{}", dir.path().join("result.json").display());
    let resolved = oncectl(
        ledger.addr,
        &[
            "resolve",
            "refund:o-3",
            "--confirmed",
            "--provider-ref",
            "re_9",
            "--result",
            &result_arg,
            "--reason",
            "refund re_9 is in the provider's dashboard",
            "--yes",
            "--json",
        ],
    )
    .await;
    assert_eq!(json(&resolved)["state"], "CONFIRMED");
    // Later callers are replayed the file's bytes, with the provider's reference.
    let replay = client
        .begin(begin("refund:o-3", ARGS))
        .await
        .unwrap()
        .into_inner();
    let replay = expect_replay(&replay);
    // The file's bytes without the line end it closes with.
    assert_eq!(
        (replay.result.as_slice(), replay.provider_ref.as_str()),
        (&result[..result.len() - 1], "re_9")
    );
    let missing = oncectl(
        ledger.addr,
        &[
            "resolve",
            "refund:o-1",
            "--confirmed",
            "--provider-ref",
            "re_1",
            "--result",
            "@/nonexistent/result.json",
            "--reason",
            "seen",
            "--yes",
        ],
    )
    .await;
    assert_ne!(code(&missing), 0, "{}", stderr(&missing));
    assert!(
        stderr(&missing).contains("result.json"),
        "{}",
        stderr(&missing)
    );
    assert_eq!(
        state_of(&mut client, "refund:o-1").await,
        pb::OperationState::Unknown
    );
    ledger.stop().await;
}

/// An operation is named by its id or by the start of exactly one operation's id; several are
/// named back (exit 2), none is not found (exit 3). `reconcile` on a settled operation says so
/// and looks nothing up (exit 4); the lookup hints are JSON in JSON.
async fn operations_are_named_by_a_unique_start_of_their_id(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    let mut hinted = begin("refund:885d2c01", ARGS);
    hinted.provider = "stripe".into();
    hinted.lookup_hints_json = r#"{"payment_intent":"pi_885d"}"#.into();
    let done = claim(&mut client, hinted).await;
    confirm(&mut client, "refund:885d2c01", done.fencing_token, b"{}")
        .await
        .unwrap();
    let open = claim(&mut client, begin("refund:8899aa", ARGS)).await;
    report_unknown(&mut client, "refund:8899aa", open.fencing_token)
        .await
        .unwrap();

    let shown = json(&oncectl(ledger.addr, &["show", "refund:885d", "--json"]).await);
    assert_eq!(shown["operation_id"], "refund:885d2c01");
    assert_eq!(
        shown["lookup_hints"],
        serde_json::json!({"payment_intent": "pi_885d"})
    );
    let several = oncectl(ledger.addr, &["show", "refund:88"]).await;
    assert_eq!(code(&several), 2, "{}", stderr(&several));
    for id in ["refund:885d2c01", "refund:8899aa", "give more of it"] {
        assert!(stderr(&several).contains(id), "{}", stderr(&several));
    }
    let none = oncectl(ledger.addr, &["show", "refund:77"]).await;
    assert_eq!(code(&none), 3, "{}", stderr(&none));

    let settled = oncectl(ledger.addr, &["reconcile", "refund:885d"]).await;
    assert_eq!(code(&settled), 4, "{}", stderr(&settled));
    assert!(
        stderr(&settled).contains(
            "refund:885d2c01 is CONFIRMED already: only an UNKNOWN operation is reconciled; nothing was looked up"
        ),
        "{}",
        stderr(&settled)
    );
    ledger.stop().await;
}

/// Where the ledger is and which key to use come from flags, the environment or a profile file,
/// in that order; a CA file makes a private authority's ledger trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_come_from_flags_the_environment_and_a_profile_file() {
    let db = TestDb::new(Engine::Sqlite).await;
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    let dir = db.scratch_dir();
    let admin_key = strong_key("oncectl-admin");
    let key_file = write_file(&dir, "admin.key", &format!("{admin_key}\n"));
    let ca_file = write_file(&dir, "ca.pem", &cert);
    // Self-signed: the certificate is its own authority.
    let ledger = TestLedger::spawn_tls(
        &db,
        &cert,
        &key,
        &cert,
        &["--admin-key-file", key_file.to_str().unwrap()],
    )
    .await;
    let addr = format!("https://localhost:{}", ledger.addr.port());
    // The admin key is the one key there is.
    let keys = |output: &Output| json(output).as_array().map(Vec::len);

    // The environment alone.
    let home = tempfile::tempdir().unwrap();
    let ca = ca_file.to_str().unwrap();
    let from_env = [
        ("ONCE_ADDR", addr.as_str()),
        ("ONCE_KEY", admin_key.as_str()),
        ("ONCE_CA", ca),
    ];
    let listed = oncectl_at_home(home.path(), &["keys", "list", "--json"], &from_env).await;
    assert_eq!(keys(&listed), Some(1));
    // Without the CA the ledger's certificate is not trusted.
    let untrusted = oncectl_at_home(home.path(), &["keys", "list"], &from_env[..2]).await;
    assert_eq!(code(&untrusted), 1, "{}", stderr(&untrusted));

    // A profile file at the default place, its default profile naming a key file and the CA.
    let config = home.path().join(".config/once");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("oncectl.toml"),
        format!(
            "default = \"prod\"\n\n[profiles.prod]\naddr = \"{addr}\"\nkey_file = \"{}\"\nca = \"{ca}\"\n\n\
             [profiles.env]\naddr = \"{addr}\"\nkey_env = \"ONCE_TEST_ADMIN\"\nca = \"{ca}\"\n",
            key_file.display()
        ),
    )
    .unwrap();
    let listed = oncectl_at_home(home.path(), &["keys", "list", "--json"], &[]).await;
    assert_eq!(keys(&listed), Some(1));
    let named = oncectl_at_home(
        home.path(),
        &["--profile", "env", "keys", "list", "--json"],
        &[("ONCE_TEST_ADMIN", admin_key.as_str())],
    )
    .await;
    assert_eq!(keys(&named), Some(1));
    let unset = oncectl_at_home(home.path(), &["--profile", "env", "keys", "list"], &[]).await;
    assert_ne!(code(&unset), 0);
    assert!(
        stderr(&unset).contains("ONCE_TEST_ADMIN"),
        "{}",
        stderr(&unset)
    );
    let unknown =
        oncectl_at_home(home.path(), &["--profile", "staging", "keys", "list"], &[]).await;
    assert_ne!(code(&unknown), 0);
    assert!(
        stderr(&unknown).contains("env, prod"),
        "{}",
        stderr(&unknown)
    );

    // A flag wins over the environment, which wins over the profile.
    let elsewhere = [("ONCE_ADDR", "https://localhost:9")];
    let refused = oncectl_at_home(home.path(), &["keys", "list"], &elsewhere).await;
    assert_eq!(code(&refused), 1, "{}", stderr(&refused));
    let flagged = oncectl_at_home(
        home.path(),
        &["--addr", &addr, "keys", "list", "--json"],
        &elsewhere,
    )
    .await;
    assert_eq!(keys(&flagged), Some(1));
    let wrong_key = oncectl_at_home(home.path(), &["keys", "list"], &[("ONCE_KEY", "nope")]).await;
    assert_eq!(code(&wrong_key), 4, "{}", stderr(&wrong_key));
    ledger.stop().await;
}

async fn keys_are_created_listed_and_revoked_by_an_admin(store: Engine) {
    let db = TestDb::new(store).await;
    let admin_key = strong_key("oncectl-admin");
    let file = write_file(&db.scratch_dir(), "admin.key", &admin_key);
    let ledger = TestLedger::spawn_with(&db, &["--admin-key-file", file.to_str().unwrap()]).await;
    let admin = [("ONCE_KEY", admin_key.as_str())];

    let created = json(
        &oncectl_with(
            ledger.addr,
            &[
                "keys",
                "create",
                "--tenant",
                "default",
                "--name",
                "oncall",
                "--role",
                "operator,reader",
                "--json",
            ],
            &admin,
        )
        .await,
    );
    let secret = created["secret"].as_str().unwrap().to_owned();
    assert_eq!(created["roles"], serde_json::json!(["reader", "operator"]));
    let key_id = created["key_id"].as_str().unwrap().to_owned();

    // The new key can list operations; without a key, nothing is answered.
    let operator = [("ONCE_KEY", secret.as_str())];
    let status = oncectl_with(ledger.addr, &["status"], &operator).await;
    assert_eq!(code(&status), 0, "{}", stderr(&status));
    let said = String::from_utf8_lossy(&status.stdout).into_owned();
    for line in [
        format!("Ledger    http://{}", ledger.addr),
        "TLS       none (plaintext)".to_owned(),
        format!("Version   {}", env!("CARGO_PKG_VERSION")),
        match store {
            Engine::Sqlite => "Database  sqlite".to_owned(),
            Engine::Postgres => "Database  postgres".to_owned(),
        },
        "Tenant    default".to_owned(),
        format!("Key       {key_id} (oncall)"),
        "Roles     reader, operator".to_owned(),
    ] {
        assert!(said.contains(&line), "{line:?} not in:\n{said}");
    }
    let status = json(&oncectl_with(ledger.addr, &["status", "--json"], &admin).await);
    assert_eq!(status["tenant"], "default", "{status}");
    assert_eq!(status["key_name"], "bootstrap-admin", "{status}");
    assert_eq!(status["roles"], serde_json::json!(["admin"]), "{status}");
    assert_eq!(status["open"], false, "{status}");
    let listed = oncectl_with(ledger.addr, &["list", "--json"], &operator).await;
    assert_eq!(json(&listed)["operations"], serde_json::json!([]));
    let nobody = oncectl(ledger.addr, &["list"]).await;
    assert_eq!(code(&nobody), 4, "{}", stderr(&nobody));
    assert!(
        stderr(&nobody).contains("CREDENTIALS_MISSING"),
        "{}",
        stderr(&nobody)
    );
    // Only an admin reads another tenant's operations.
    let other = oncectl_with(
        ledger.addr,
        &["list", "--tenant", "globex", "--json"],
        &admin,
    )
    .await;
    assert_eq!(json(&other)["operations"], serde_json::json!([]));
    let refused = oncectl_with(ledger.addr, &["list", "--tenant", "globex"], &operator).await;
    assert_eq!(code(&refused), 4, "{}", stderr(&refused));
    // An operator key administers nothing.
    let refused = oncectl_with(ledger.addr, &["keys", "list"], &operator).await;
    assert_eq!(code(&refused), 4, "{}", stderr(&refused));

    let keys = json(&oncectl_with(ledger.addr, &["keys", "list", "--json"], &admin).await);
    assert!(keys
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k["key_id"] == key_id.as_str()));
    assert!(!keys.to_string().contains(&secret), "never a secret");
    let revoked =
        json(&oncectl_with(ledger.addr, &["keys", "revoke", &key_id, "--json"], &admin).await);
    assert!(revoked["revoked_at_ms"].is_i64(), "{revoked}");
    let unknown = oncectl_with(ledger.addr, &["keys", "revoke", "0123456789ab"], &admin).await;
    assert_eq!(code(&unknown), 3, "{}", stderr(&unknown));
    assert!(
        stderr(&unknown).contains("no key with id 0123456789ab"),
        "{}",
        stderr(&unknown)
    );
    let refused = oncectl_with(ledger.addr, &["list"], &operator).await;
    assert_eq!(code(&refused), 4, "{}", stderr(&refused));
    let refused = oncectl_with(ledger.addr, &["status"], &operator).await;
    assert_eq!(code(&refused), 4, "a revoked key: {}", stderr(&refused));
    ledger.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_generate_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncectl"))
            .args(["completions", shell])
            .output()
            .await
            .unwrap();
        assert_eq!(code(&output), 0, "{shell}: {}", stderr(&output));
        let script = String::from_utf8(output.stdout).unwrap();
        assert!(
            script.contains("resolve") && script.contains("watch"),
            "{shell}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_mistake_exits_2() {
    let usage = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncectl"))
        .args(["resolve", "op", "--absent", "--confirmed", "--reason", "x"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&usage), 2);
}

/// `oncectl --addr ADDR ARGS…`, as [`oncectl_at_home`] runs it.
async fn oncectl_to(addr: &str, args: &[&str]) -> Output {
    let home = tempfile::tempdir().unwrap();
    let args: Vec<&str> = ["--addr", addr]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    oncectl_at_home(home.path(), &args, &[]).await
}

/// Asserts `output` exited `wanted` and its stderr says each of `needles`.
#[track_caller]
fn says(output: &Output, wanted: i32, needles: &[&str]) {
    let said = stderr(output);
    assert_eq!(code(output), wanted, "{said}");
    for needle in needles {
        assert!(said.contains(needle), "{needle:?} not in: {said}");
    }
    assert!(!said.contains("h2 protocol error"), "{said}");
}

/// Every way of missing the ledger exits 1 with the address and what was found there, and
/// what to change: nothing listening, a name that does not resolve, TLS on one side only, an
/// authority not trusted, something that is not a ledger, a ledger whose database is down. An
/// address without a scheme is a usage mistake (2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_cannot_be_reached_is_named_with_what_was_found_there() {
    // Nothing listens on a port just freed.
    let freed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let nothing = format!("http://{freed}");
    says(
        &oncectl_to(&nothing, &["list"]).await,
        1,
        &[&format!(
            "nothing listens at {nothing} (connection refused)"
        )],
    );
    says(
        &oncectl_to(&freed.to_string(), &["list"]).await,
        2,
        &["has no scheme", &format!("write http://{freed}")],
    );
    says(
        &oncectl_to("http://no-such-host.invalid:50051", &["list"]).await,
        1,
        &["http://no-such-host.invalid:50051 does not resolve"],
    );

    let db = TestDb::new(Engine::Sqlite).await;
    let plaintext = TestLedger::spawn(&db).await;
    let port = plaintext.addr.port();
    says(
        &oncectl_to(&format!("https://localhost:{port}"), &["list"]).await,
        1,
        &[&format!(
            "https://localhost:{port} speaks plaintext, not TLS: use http://localhost:{port}"
        )],
    );

    let tls_db = TestDb::new(Engine::Sqlite).await;
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    let ca_file = write_file(&tls_db.scratch_dir(), "ca.pem", &cert);
    let tls = TestLedger::spawn_tls(&tls_db, &cert, &key, &cert, &[]).await;
    let port = tls.addr.port();
    says(
        &oncectl_to(&format!("http://localhost:{port}"), &["list"]).await,
        1,
        &[&format!(
            "http://localhost:{port} speaks TLS: use https://localhost:{port}"
        )],
    );
    let https = format!("https://localhost:{port}");
    says(
        &oncectl_to(&https, &["list"]).await,
        1,
        &[
            &format!(
                "the certificate of {https} is signed by an authority this client does not trust"
            ),
            "--ca",
        ],
    );
    let trusted = oncectl_to(&https, &["--ca", ca_file.to_str().unwrap(), "list"]).await;
    assert_eq!(code(&trusted), 0, "{}", stderr(&trusted));
    // An open ledger says so, and that every caller has every role.
    let status = oncectl_to(&https, &["--ca", ca_file.to_str().unwrap(), "status"]).await;
    let said = String::from_utf8_lossy(&status.stdout).into_owned();
    for line in [
        "TLS       verified with --ca and the public roots",
        "Key       none: the ledger is open (no key exists yet)",
        "Roles     every role",
    ] {
        assert!(said.contains(line), "{line:?} not in:\n{said}");
    }
    says(
        &oncectl_to(&nothing, &["status"]).await,
        1,
        &["nothing listens at"],
    );

    // A real HTTP server, but not a ledger.
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    says(
        &oncectl_to(&provider, &["list"]).await,
        1,
        &[&format!(
            "something answers at {provider}, but not as once-ledger"
        )],
    );

    // A ledger whose PostgreSQL refuses it.
    let pg = TestDb::new(Engine::Postgres).await;
    let ledger = TestLedger::spawn(&pg).await;
    let addr = format!("http://{}", ledger.addr);
    pg.as_server_admin("ALTER DATABASE {db} ALLOW_CONNECTIONS false")
        .await;
    pg.end_sessions().await;
    says(
        &oncectl_to(&addr, &["list"]).await,
        1,
        &[&format!(
            "the ledger at {addr} answers, but its database does not"
        )],
    );
    pg.as_server_admin("ALTER DATABASE {db} ALLOW_CONNECTIONS true")
        .await;
}

/// A private authority for client certificates, and one certificate it signed, in PEM.
fn client_authority() -> (String, (String, String)) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["alice".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    (issuer.pem(), (cert.pem(), key.serialize_pem()))
}

/// A ledger that asks for client certificates (mTLS) is reached with `--cert` and
/// `--cert-key`, or a profile's `cert` and `cert_key`; without one oncectl says that the ledger
/// asks for one. A registered certificate is a credential of its own: no key needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_reach_a_ledger_that_asks_for_them() {
    let db = TestDb::new(Engine::Sqlite).await;
    let dir = db.scratch_dir();
    let server = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let server_cert = server.cert.pem();
    let (client_ca, (cert, cert_key)) = client_authority();
    let admin_key = strong_key("oncectl-admin");
    let ca = write_file(&dir, "ca.pem", &server_cert);
    let cert_file = write_file(&dir, "alice.pem", &cert);
    let key_file = write_file(&dir, "alice.key", &cert_key);
    let flags = [
        "--tls-cert".to_owned(),
        write_file(&dir, "cert.pem", &server_cert)
            .display()
            .to_string(),
        "--tls-key".to_owned(),
        write_file(&dir, "key.pem", &server.signing_key.serialize_pem())
            .display()
            .to_string(),
        "--tls-client-ca".to_owned(),
        write_file(&dir, "client-ca.pem", &client_ca)
            .display()
            .to_string(),
        "--admin-key-file".to_owned(),
        write_file(&dir, "admin.key", &admin_key)
            .display()
            .to_string(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let ledger = TestLedger::start(&db.url, &flags).await;
    let identity = (cert.clone(), cert_key.clone());
    wait_serving_on(https(ledger.addr.port(), &server_cert, Some(&identity))).await;
    let addr = format!("https://localhost:{}", ledger.addr.port());
    let (ca, cert_file, key_file) = (
        ca.to_str().unwrap(),
        cert_file.to_str().unwrap(),
        key_file.to_str().unwrap(),
    );

    let anonymous = oncectl_to(&addr, &["--ca", ca, "--key", &admin_key, "keys", "list"]).await;
    says(
        &anonymous,
        1,
        &[&format!("{addr} asks for a client certificate"), "--cert"],
    );

    let with_cert = [
        "--ca",
        ca,
        "--cert",
        cert_file,
        "--cert-key",
        key_file,
        "--key",
        &admin_key,
    ];
    let registered = oncectl_to(
        &addr,
        &[
            &with_cert[..],
            &["keys", "create", "--tenant", "default", "--name", "alice"],
            &["--role", "operator", "--certificate", cert_file],
        ]
        .concat(),
    )
    .await;
    assert_eq!(code(&registered), 0, "{}", stderr(&registered));

    // The certificate alone is alice's credential, from a profile.
    let home = tempfile::tempdir().unwrap();
    let config = home.path().join(".config/once");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("oncectl.toml"),
        format!(
            "default = \"mtls\"\n[profiles.mtls]\naddr = \"{addr}\"\nca = \"{ca}\"\n\
             cert = \"{cert_file}\"\ncert_key = \"{key_file}\"\n"
        ),
    )
    .unwrap();
    let listed = oncectl_at_home(home.path(), &["list", "--json"], &[]).await;
    assert_eq!(json(&listed)["operations"], serde_json::json!([]));
    let status = json(&oncectl_at_home(home.path(), &["status", "--json"], &[]).await);
    assert_eq!(status["tls"], true, "{status}");
    assert_eq!(status["private_ca"], true, "{status}");
    assert_eq!(status["client_certificate"], true, "{status}");
    assert_eq!(status["key_name"], "alice", "{status}");
    assert_eq!(status["roles"], serde_json::json!(["operator"]), "{status}");

    let half = oncectl_to(&addr, &["--ca", ca, "--cert", cert_file, "list"]).await;
    assert_eq!(code(&half), 2, "{}", stderr(&half));
}

/// On a terminal (a pseudo-terminal `script` opens) the output is coloured; with NO_COLOR, or
/// on a pipe, it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colour_on_a_terminal_only() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    let command = format!(
        "{} --addr http://{} list --all",
        env!("CARGO_BIN_EXE_oncectl"),
        ledger.addr
    );
    let on_terminal = |no_color: bool| {
        let command = command.clone();
        async move {
            let mut script = tokio::process::Command::new("script");
            script.args(["-qec", &command, "/dev/null"]);
            if no_color {
                script.env("NO_COLOR", "1");
            } else {
                script.env_remove("NO_COLOR");
            }
            let output = script.output().await.expect("script(1) runs");
            assert_eq!(code(&output), 0, "{}", stderr(&output));
            String::from_utf8_lossy(&output.stdout).into_owned()
        }
    };
    let coloured = on_terminal(false).await;
    assert!(coloured.contains('\u{1b}'), "{coloured:?}");
    assert!(coloured.contains("refund:o-1"), "{coloured:?}");
    let plain = on_terminal(true).await;
    assert!(!plain.contains("\u{1b}["), "{plain:?}");
    ledger.stop().await;
}

/// `resolve` asks on a terminal (a pseudo-terminal `script` opens, fed the answer): "n" sends
/// nothing and exits 4; "y" resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_asks_on_a_terminal_and_does_what_it_is_told() {
    use tokio::io::AsyncWriteExt as _;
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;
    unknown_and_confirmed(&mut client).await;
    let command = format!(
        "{} --addr http://{} resolve refund:o-1 --absent --reason 'no such refund at the provider'",
        env!("CARGO_BIN_EXE_oncectl"),
        ledger.addr
    );
    let answer = |reply: &'static str| {
        let command = command.clone();
        async move {
            let mut script = tokio::process::Command::new("script")
                .args(["-qec", &command, "/dev/null"])
                .env("USER", "alice")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("script(1) runs");
            let mut stdin = script.stdin.take().unwrap();
            stdin.write_all(reply.as_bytes()).await.unwrap();
            let output = within(
                Duration::from_secs(30),
                "oncectl to answer",
                script.wait_with_output(),
            )
            .await
            .unwrap();
            drop(stdin);
            (
                code(&output),
                String::from_utf8_lossy(&output.stdout).into_owned(),
            )
        }
    };
    let (declined, said) = answer("n\n").await;
    assert!(said.contains("Resolve? [y/N]"), "{said}");
    assert!(said.contains("bound to attempt 1"), "{said}");
    assert_eq!(declined, 4, "{said}");
    assert_eq!(
        state_of(&mut client, "refund:o-1").await,
        pb::OperationState::Unknown,
        "declined: nothing was sent"
    );
    let (accepted, said) = answer("y\n").await;
    assert_eq!(accepted, 0, "{said}");
    assert!(said.contains("refund:o-1 is now ABSENT"), "{said}");
    ledger.stop().await;
}

/// `--all-tenants`: an admin's list has a TENANT column, its watch names each event's tenant,
/// its figures add every tenant's up; any other key is refused as for naming another tenant.
async fn an_admin_lists_counts_and_watches_every_tenant_at_once(store: Engine) {
    use once_api::admin_pb::{self as apb, admin_client::AdminClient};
    let db = TestDb::new(store).await;
    let admin_key = strong_key("oncectl-admin");
    let file = write_file(&db.scratch_dir(), "admin.key", &admin_key);
    let ledger = TestLedger::spawn_with(&db, &["--admin-key-file", file.to_str().unwrap()]).await;
    let mut admin = AdminClient::connect(format!("http://{}", ledger.addr))
        .await
        .unwrap();
    admin
        .put_tenant(with_key(
            apb::PutTenantRequest {
                name: "acme".into(),
                ..Default::default()
            },
            Some(&admin_key),
        ))
        .await
        .unwrap();
    let key_of = |tenant, role| key_with_role(ledger.addr, &admin_key, tenant, role);
    let mut client = ledger.client().await;
    for (tenant, id) in [("default", "refund:d-1"), ("acme", "refund:a-1")] {
        let executor = key_of(tenant, "executor").await;
        unknown_with_key(&mut client, id, &executor).await;
    }
    let acme_reader = key_of("acme", "reader").await;
    let as_admin = [("ONCE_KEY", admin_key.as_str())];

    let listed = oncectl_with(ledger.addr, &["list", "--all-tenants"], &as_admin).await;
    assert_eq!(code(&listed), 0, "{}", stderr(&listed));
    let table = String::from_utf8_lossy(&listed.stdout).into_owned();
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|line| line.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0][..3], ["TENANT", "OPERATION", "TOOL"], "{table}");
    assert_eq!(lines[1][..2], ["default", "refund:d-1"], "{table}");
    assert_eq!(lines[2][..2], ["acme", "refund:a-1"], "{table}");
    let own = oncectl_with(ledger.addr, &["list", "--tenant", "default"], &as_admin).await;
    let own = format!("{}{}", String::from_utf8_lossy(&own.stdout), stderr(&own));
    assert!(
        own.starts_with("OPERATION") && own.contains("refund:d-1") && !own.contains("refund:a-1"),
        "one tenant's, without the column:\n{own}"
    );
    let listed =
        json(&oncectl_with(ledger.addr, &["list", "--all-tenants", "--json"], &as_admin).await);
    let tenants: Vec<&str> = listed["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| op["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(tenants, ["default", "acme"], "{listed}");

    let counted = json(
        &oncectl_with(
            ledger.addr,
            &["stats", "--all-tenants", "--json"],
            &as_admin,
        )
        .await,
    );
    let unknown: i64 = counted["operations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] == "UNKNOWN")
        .map(|c| c["count"].as_i64().unwrap())
        .sum();
    assert_eq!(unknown, 2, "{counted}");

    let watched = oncectl_with(
        ledger.addr,
        &["watch", "--all-tenants", "--after", "0", "--count", "2"],
        &as_admin,
    )
    .await;
    assert_eq!(code(&watched), 0, "{}", stderr(&watched));
    let said = String::from_utf8_lossy(&watched.stdout).into_owned();
    assert!(
        said.contains("[default] refund:d-1") && said.contains("[acme] refund:a-1"),
        "{said}"
    );

    for args in [
        &["list", "--all-tenants"][..],
        &["stats", "--all-tenants"],
        &["watch", "--all-tenants", "--count", "1"],
    ] {
        let refused = oncectl_with(ledger.addr, args, &[("ONCE_KEY", acme_reader.as_str())]).await;
        assert_eq!(code(&refused), 4, "{args:?}: {}", stderr(&refused));
        assert!(
            stderr(&refused).contains("the role admin"),
            "{args:?}: {}",
            stderr(&refused)
        );
    }
    let both = oncectl_with(
        ledger.addr,
        &["list", "--all-tenants", "--tenant", "acme"],
        &as_admin,
    )
    .await;
    assert_eq!(code(&both), 2, "{}", stderr(&both));
    ledger.stop().await;
}

/// A bulk command whose key the ledger refuses (a reader's role, for one) stops at the first
/// refusal: every other operation would be refused alike, so none is tried, and it says so.
async fn a_key_that_may_not_settle_is_refused_once_for_a_whole_filter(store: Engine) {
    let db = TestDb::new(store).await;
    let admin_key = strong_key("oncectl-admin");
    let file = write_file(&db.scratch_dir(), "admin.key", &admin_key);
    let ledger = TestLedger::spawn_with(&db, &["--admin-key-file", file.to_str().unwrap()]).await;
    let executor = key_with_role(ledger.addr, &admin_key, "default", "executor").await;
    let reader = key_with_role(ledger.addr, &admin_key, "default", "reader").await;
    let mut client = ledger.client().await;
    for id in ["refund:r-1", "refund:r-2", "refund:r-3"] {
        unknown_with_key(&mut client, id, &executor).await;
    }
    let as_reader = [("ONCE_KEY", reader.as_str())];
    for action in [
        &["reconcile", "--filter", "all", "--yes", "--json"][..],
        &[
            "resolve", "--filter", "all", "--absent", "--reason", "checked", "--yes", "--json",
        ],
    ] {
        let refused = oncectl_with(ledger.addr, action, &as_reader).await;
        assert_eq!(code(&refused), 4, "{action:?}: {}", stderr(&refused));
        assert!(
            stderr(&refused).contains("the other 2 were not tried"),
            "{action:?}: {}",
            stderr(&refused)
        );
        let said: Value = serde_json::from_slice(&refused.stdout).unwrap();
        assert_eq!(said["not_tried"], 2, "{said}");
        let outcomes = said["outcomes"].as_array().unwrap();
        assert_eq!(outcomes.len(), 1, "{said}");
        assert_eq!(outcomes[0]["outcome"], "refused", "{said}");
        assert!(
            outcomes[0]["detail"]
                .as_str()
                .unwrap()
                .contains("ROLE_NOT_ALLOWED"),
            "{said}"
        );
    }
    // Nothing was settled.
    let unknown = json(&oncectl_with(ledger.addr, &["list", "--json"], &as_reader).await);
    assert_eq!(
        unknown["operations"].as_array().unwrap().len(),
        3,
        "{unknown}"
    );
    ledger.stop().await;
}

/// A tenant whose keys may send one request a second: a bulk resolve of its operations, four at
/// a time, is refused for the rate on the way (RATE_LIMITED: nothing done) and keeps to it, so
/// every operation is resolved, later, and none is reported refused.
async fn a_bulk_command_keeps_to_its_keys_request_rate(store: Engine) {
    use once_api::admin_pb::{self as apb, admin_client::AdminClient};
    let db = TestDb::new(store).await;
    let admin_key = strong_key("oncectl-admin");
    let file = write_file(&db.scratch_dir(), "admin.key", &admin_key);
    let flags = ["--admin-key-file", file.to_str().unwrap()];
    let ledger = TestLedger::spawn_with(&db, &flags).await;
    let executor = key_with_role(ledger.addr, &admin_key, "default", "executor").await;
    let operator = key_with_role(ledger.addr, &admin_key, "default", "operator").await;
    let mut client = ledger.client().await;
    let ids = [
        "refund:p-1",
        "refund:p-2",
        "refund:p-3",
        "refund:p-4",
        "refund:p-5",
    ];
    for id in ids {
        unknown_with_key(&mut client, id, &executor).await;
    }
    let mut admin = AdminClient::connect(format!("http://{}", ledger.addr))
        .await
        .unwrap();
    let limited = apb::PutTenantRequest {
        name: "default".into(),
        max_in_flight: 0,
        requests_per_second: 1,
    };
    admin
        .put_tenant(with_key(limited, Some(&admin_key)))
        .await
        .unwrap();
    ledger.stop().await;
    // A replica started now holds the tenant's rate from its first call.
    let ledger = TestLedger::spawn_with(&db, &flags).await;
    let resolved = oncectl_with(
        ledger.addr,
        &[
            "resolve", "--filter", "all", "--absent", "--reason", "checked", "--yes", "--json",
        ],
        &[("ONCE_KEY", operator.as_str())],
    )
    .await;
    assert_eq!(code(&resolved), 0, "{}", stderr(&resolved));
    let said: Value = serde_json::from_slice(&resolved.stdout).unwrap();
    let outcomes = said["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), ids.len(), "{said}");
    assert!(
        outcomes
            .iter()
            .all(|o| o["outcome"] == "done" && o["state"] == "ABSENT"),
        "{said}"
    );
    ledger.stop().await;
}

/// `oncectl receipt get` writes the receipt; `oncectl receipt verify --public-key` checks it
/// with no ledger to reach, and exits 5 for a receipt with one byte changed or a result that is
/// not the one signed for.
async fn a_receipt_is_got_and_verified_with_the_public_key_alone(store: Engine) {
    let db = TestDb::new(store).await;
    let key_file = db.scratch_dir().join("signing.key");
    let ring = onced::signing::KeyRing::load_or_create(&key_file).unwrap();
    let public = ring.active().public().to_string();
    let ledger =
        TestLedger::spawn_with(&db, &["--signing-key-file", key_file.to_str().unwrap()]).await;
    let mut client = ledger.client().await;
    let grant = claim(&mut client, begin("rc-1", r#"{"order_id":"o1"}"#)).await;
    confirm(
        &mut client,
        "rc-1",
        grant.fencing_token,
        b"{\"refund\":\"re_1\"}",
    )
    .await
    .unwrap();
    claim(&mut client, begin("rc-2", r#"{"order_id":"o2"}"#)).await;
    // A receipt is signed once the chain has linked the event that settled it.
    eventually(patient(Duration::from_secs(20)), "the receipt", || {
        let mut client = client.clone();
        async move {
            let request = pb::GetReceiptRequest {
                operation_id: "rc-1".into(),
                tenant: String::new(),
            };
            client.get_receipt(request).await.ok()
        }
    })
    .await;

    let dir = db.scratch_dir();
    let file = dir.join("rc-1.receipt");
    let got = oncectl(
        ledger.addr,
        &["receipt", "get", "rc-1", "--out", file.to_str().unwrap()],
    )
    .await;
    assert_eq!(code(&got), 0, "{}", stderr(&got));
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.starts_with("r1."), "{text}");
    let refused = oncectl(ledger.addr, &["receipt", "get", "rc-2"]).await;
    says(&refused, 4, &["NOT_SETTLED"]);
    // Without a key given, the ledger's are asked for, and the answer says whose they were.
    let online = oncectl(ledger.addr, &["receipt", "verify", file.to_str().unwrap()]).await;
    assert_eq!(code(&online), 0, "{}", stderr(&online));
    let said = String::from_utf8_lossy(&online.stdout).into_owned();
    assert!(said.contains("with the keys ledger"), "{said}");
    ledger.stop().await;

    // With the ledger stopped, and an address where nothing listens: the public key is all
    // the verification needs.
    let file = file.to_str().unwrap();
    let verify = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        oncectl_to("http://127.0.0.1:1", &args).await
    };
    let args = |extra: &[&str]| -> Vec<String> {
        ["receipt", "verify"]
            .iter()
            .chain(extra)
            .map(|arg| (*arg).to_owned())
            .collect()
    };
    let verified = verify(args(&[file, "--public-key", &public])).await;
    assert_eq!(code(&verified), 0, "{}", stderr(&verified));
    let said = String::from_utf8_lossy(&verified.stdout).into_owned();
    assert!(
        said.contains("The receipt verifies") && said.contains("CONFIRMED"),
        "{said}"
    );
    let shown = verify(args(&["-o", "json", file, "--public-key", &public])).await;
    let shown = json(&shown);
    assert_eq!(
        (
            shown["verified"].as_bool(),
            shown["state"].as_str(),
            shown["operation_id"].as_str()
        ),
        (Some(true), Some("CONFIRMED"), Some("rc-1"))
    );

    let result = dir.join("result.json");
    std::fs::write(&result, b"{\"refund\":\"re_1\"}").unwrap();
    let result = result.to_str().unwrap();
    let matches = verify(args(&[file, "--public-key", &public, "--result", result])).await;
    assert_eq!(code(&matches), 0, "{}", stderr(&matches));
    // A genuine receipt of another operation proves nothing about this one.
    let this_one = verify(args(&[
        file,
        "--public-key",
        &public,
        "--operation",
        "rc-1",
    ]))
    .await;
    assert_eq!(code(&this_one), 0, "{}", stderr(&this_one));
    let another = verify(args(&[
        file,
        "--public-key",
        &public,
        "--operation",
        "rc-2",
    ]))
    .await;
    says(&another, 5, &["is of operation rc-1, not rc-2"]);
    let other = dir.join("other.json");
    std::fs::write(&other, b"{\"refund\":\"re_2\"}").unwrap();
    let other = other.to_str().unwrap();
    let mismatch = verify(args(&[file, "--public-key", &public, "--result", other])).await;
    says(&mismatch, 5, &["not the one the receipt was signed for"]);

    // One byte changed, in the content or in the signature.
    for at in [10, text.trim().len() - 3] {
        let mut changed = text.trim().to_owned().into_bytes();
        changed[at] = if changed[at] == b'A' { b'B' } else { b'A' };
        let tampered = dir.join("tampered.receipt");
        std::fs::write(&tampered, &changed).unwrap();
        let tampered = tampered.to_str().unwrap();
        let refused = verify(args(&[tampered, "--public-key", &public])).await;
        says(&refused, 5, &["does not verify"]);
    }
    // A public key is base64url, and may begin with `-`: it is taken as a key, not a flag.
    let hyphened = (0u8..=255)
        .map(|seed| once_core::receipt::SigningKey::from_secret([seed; 32]))
        .find(|key| key.public().to_string().starts_with('-'))
        .expect("a key whose text begins with -");
    let signed = Receipt::unverified(&text).unwrap().sign(&hyphened);
    let other_file = dir.join("hyphened.receipt");
    std::fs::write(&other_file, signed).unwrap();
    let public = hyphened.public().to_string();
    let verified = verify(args(&[
        other_file.to_str().unwrap(),
        "--public-key",
        &public,
    ]))
    .await;
    assert_eq!(code(&verified), 0, "{}", stderr(&verified));
    // Another key's: named as such.
    let other_key = onced::signing::KeyRing::load_or_create(&dir.join("other.key"))
        .unwrap()
        .active()
        .public()
        .to_string();
    let refused = verify(args(&[file, "--public-key", &other_key])).await;
    says(&refused, 5, &["not among the public keys given"]);
}
