//! Tenants, credentials and roles: who may call what, and that no tenant can see, change or
//! detect another's operations.

use std::time::Duration;

use once_api::admin_pb::admin_client::AdminClient;
use once_api::admin_pb::{self as apb};
use once_api::pb;
use once_core::access::LEDGER_TENANT;
use prost::Message;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::support::*;

/// A credential a call is made with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Who {
    Nobody,
    /// A key no ledger ever issued.
    Stranger,
    /// A key of tenant `acme` that was revoked.
    Revoked,
    /// A key of tenant `globex` with one role (`admin`: a key of the ledger's tenant).
    Other(&'static str),
}

const ROLES: [&str; 4] = ["executor", "reader", "operator", "admin"];

/// Every RPC, and the roles that may make it.
const RPCS: &[(&str, &[&str])] = &[
    ("Begin", &["executor"]),
    ("Confirm", &["executor"]),
    ("ReportAbsent", &["executor"]),
    ("ReportUnknown", &["executor"]),
    ("Heartbeat", &["executor"]),
    ("GetOperation", &["executor", "reader", "operator"]),
    ("ListOperations", &["reader", "operator"]),
    ("WatchOperations", &["reader", "operator"]),
    ("GetForensics", &["reader", "operator"]),
    ("GetStats", &["reader", "operator"]),
    ("GetReceipt", &["executor", "reader", "operator"]),
    ("GetHistoryHead", &["reader", "operator"]),
    ("VerifyHistory", &["reader", "operator"]),
    (
        "GetSigningKeys",
        &["executor", "reader", "operator", "admin"],
    ),
    ("Reconcile", &["operator"]),
    ("Resolve", &["operator"]),
    ("PutTenant", &["admin"]),
    ("ListTenants", &["admin"]),
    ("CreateKey", &["admin"]),
    ("ListKeys", &["admin"]),
    ("RevokeKey", &["admin"]),
];

/// The RPCs that name an operation: a foreign one must answer as a missing one does.
const NAMES_AN_OPERATION: &[&str] = &[
    "Confirm",
    "ReportAbsent",
    "ReportUnknown",
    "Heartbeat",
    "GetOperation",
    "GetReceipt",
    "Reconcile",
    "Resolve",
];

/// The RPCs of the admin service.
const ADMINISTRATION: &[&str] = &[
    "PutTenant",
    "ListTenants",
    "CreateKey",
    "ListKeys",
    "RevokeKey",
];

struct Keys {
    own: Vec<(&'static str, String)>,
    other: Vec<(&'static str, String)>,
    revoked: String,
}

impl Keys {
    fn of(&self, who: &Who) -> Option<String> {
        match who {
            Who::Nobody => None,
            Who::Stranger => Some(format!("once_000000000000_{}", "0".repeat(64))),
            Who::Revoked => Some(self.revoked.clone()),
            Who::Other(role) => Some(find(&self.other, role)),
        }
    }
}

fn find(keys: &[(&'static str, String)], role: &str) -> String {
    keys.iter()
        .find(|(r, _)| *r == role)
        .expect("a key")
        .1
        .clone()
}

/// A ledger that requires credentials, bootstrapped with an admin key from a file.
async fn guarded_ledger(db: &TestDb, extra: &[&str]) -> (TestLedger, String) {
    let admin_key = strong_key("test-admin");
    let file = write_file(&db.scratch_dir(), "admin.key", &admin_key);
    let mut flags = vec!["--admin-key-file", file.to_str().unwrap()];
    flags.extend_from_slice(extra);
    (TestLedger::spawn_with(db, &flags).await, admin_key)
}

async fn admin_client(ledger: &TestLedger) -> AdminClient<Channel> {
    admin_client_at(ledger.addr).await
}

async fn admin_client_at(addr: std::net::SocketAddr) -> AdminClient<Channel> {
    AdminClient::new(
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    )
}

async fn create_key(
    admin: &mut AdminClient<Channel>,
    admin_key: &str,
    tenant: &str,
    roles: &[&str],
) -> apb::CreateKeyResponse {
    admin
        .create_key(with_key(
            apb::CreateKeyRequest {
                tenant: tenant.into(),
                name: format!("{tenant}-{}", roles.join("-")),
                roles: roles.iter().map(|r| r.to_string()).collect(),
                certificate_pem: String::new(),
            },
            Some(admin_key),
        ))
        .await
        .expect("create key")
        .into_inner()
}

async fn put_tenant(admin: &mut AdminClient<Channel>, admin_key: &str, name: &str) {
    put_limited_tenant(admin, admin_key, name, 0, 0).await;
}

/// A tenant with its in-flight cap and per-key rate (0 for none).
async fn put_limited_tenant(
    admin: &mut AdminClient<Channel>,
    admin_key: &str,
    name: &str,
    max_in_flight: i64,
    requests_per_second: i64,
) {
    admin
        .put_tenant(with_key(
            apb::PutTenantRequest {
                name: name.into(),
                max_in_flight,
                requests_per_second,
            },
            Some(admin_key),
        ))
        .await
        .expect("put tenant");
}

/// A guarded ledger, a client of it, and the keys of [`keys_for_matrix`].
async fn with_matrix_keys(db: &TestDb) -> (TestLedger, Grpc, Keys) {
    let (server, admin_key) = guarded_ledger(db, &[]).await;
    let ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    let keys = keys_for_matrix(&mut admin, &admin_key).await;
    (server, ledger, keys)
}

async fn keys_for_matrix(admin: &mut AdminClient<Channel>, admin_key: &str) -> Keys {
    for tenant in ["acme", "globex"] {
        put_tenant(admin, admin_key, tenant).await;
    }
    let mut own = Vec::new();
    let mut other = Vec::new();
    for role in ROLES {
        // The admin role is held only by keys of the ledger's own tenant.
        let (acme, globex) = match role {
            "admin" => (LEDGER_TENANT, LEDGER_TENANT),
            _ => ("acme", "globex"),
        };
        own.push((
            role,
            create_key(admin, admin_key, acme, &[role]).await.secret,
        ));
        other.push((
            role,
            create_key(admin, admin_key, globex, &[role]).await.secret,
        ));
    }
    let revoked = create_key(admin, admin_key, "acme", &ROLES[..3]).await;
    admin
        .revoke_key(with_key(
            apb::RevokeKeyRequest {
                key_id: revoked.key.unwrap().key_id,
            },
            Some(admin_key),
        ))
        .await
        .expect("revoke");
    Keys {
        own,
        other,
        revoked: revoked.secret,
    }
}

/// What a call answered, as bytes: the encoded response, or the status's code, message and
/// details.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Ok(Vec<u8>),
    Refused(Code, String, Vec<u8>),
}

impl Answer {
    fn of<T: Message>(result: Result<tonic::Response<T>, Status>) -> Self {
        match result {
            Ok(response) => Answer::Ok(response.into_inner().encode_to_vec()),
            Err(status) => Answer::Refused(
                status.code(),
                status.message().to_owned(),
                status.details().to_vec(),
            ),
        }
    }

    fn code(&self) -> Code {
        match self {
            Answer::Ok(_) => Code::Ok,
            Answer::Refused(code, ..) => *code,
        }
    }
}

/// Makes `rpc` as `key` about operation `id` (attempt `token`).
async fn call(
    ledger: &mut Grpc,
    admin: &mut AdminClient<Channel>,
    rpc: &str,
    key: Option<&str>,
    id: &str,
    token: u64,
) -> Answer {
    match rpc {
        "Begin" => Answer::of(ledger.begin(with_key(begin(id, ARGS), key)).await),
        "Confirm" => Answer::of(
            ledger
                .confirm(with_key(
                    pb::ConfirmRequest {
                        operation_id: id.into(),
                        fencing_token: token,
                        result: b"{}".to_vec(),
                        provider_ref: "re_x".into(),
                    },
                    key,
                ))
                .await,
        ),
        "ReportAbsent" => Answer::of(
            ledger
                .report_absent(with_key(
                    pb::ReportAbsentRequest {
                        operation_id: id.into(),
                        fencing_token: token,
                        reason: "declined".into(),
                    },
                    key,
                ))
                .await,
        ),
        "ReportUnknown" => Answer::of(
            ledger
                .report_unknown(with_key(
                    pb::ReportUnknownRequest {
                        operation_id: id.into(),
                        fencing_token: token,
                        reason: "timeout".into(),
                    },
                    key,
                ))
                .await,
        ),
        "Heartbeat" => Answer::of(
            ledger
                .heartbeat(with_key(
                    pb::HeartbeatRequest {
                        operation_id: id.into(),
                        fencing_token: token,
                        lease_ttl: Some(ms(30_000)),
                    },
                    key,
                ))
                .await,
        ),
        "GetOperation" => Answer::of(
            ledger
                .get_operation(with_key(
                    pb::GetOperationRequest {
                        operation_id: id.into(),
                        ..Default::default()
                    },
                    key,
                ))
                .await,
        ),
        "ListOperations" => Answer::of(
            ledger
                .list_operations(with_key(pb::ListOperationsRequest::default(), key))
                .await,
        ),
        "GetStats" => Answer::of(
            ledger
                .get_stats(with_key(pb::GetStatsRequest::default(), key))
                .await,
        ),
        "GetForensics" => Answer::of(
            ledger
                .get_forensics(with_key(pb::GetForensicsRequest::default(), key))
                .await,
        ),
        "WatchOperations" => {
            let request = with_key(pb::WatchOperationsRequest::default(), key);
            match ledger.watch_operations(request).await {
                Err(status) => Answer::of::<pb::WatchOperationsResponse>(Err(status)),
                // Everything the stream sends until it has caught up, one message after another.
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    let mut sent = Vec::new();
                    loop {
                        let message = stream.message().await.expect("stream").expect("open");
                        let caught_up = matches!(
                            message.item,
                            Some(pb::watch_operations_response::Item::CaughtUpTo(_))
                        );
                        sent.extend(message.encode_length_delimited_to_vec());
                        if caught_up {
                            break Answer::Ok(sent);
                        }
                    }
                }
            }
        }
        "GetReceipt" => Answer::of(
            ledger
                .get_receipt(with_key(
                    pb::GetReceiptRequest {
                        operation_id: id.into(),
                        ..Default::default()
                    },
                    key,
                ))
                .await,
        ),
        "GetHistoryHead" => Answer::of(
            ledger
                .get_history_head(with_key(pb::GetHistoryHeadRequest::default(), key))
                .await,
        ),
        "VerifyHistory" => Answer::of(
            ledger
                .verify_history(with_key(pb::VerifyHistoryRequest::default(), key))
                .await,
        ),
        "GetSigningKeys" => Answer::of(
            ledger
                .get_signing_keys(with_key(pb::GetSigningKeysRequest {}, key))
                .await,
        ),
        "Reconcile" => Answer::of(
            ledger
                .reconcile(with_key(
                    pb::ReconcileRequest {
                        operation_id: id.into(),
                        ..Default::default()
                    },
                    key,
                ))
                .await,
        ),
        "Resolve" => Answer::of(
            ledger
                .resolve(with_key(
                    pb::ResolveRequest {
                        operation_id: id.into(),
                        outcome: pb::OperationState::Absent as i32,
                        reason: "checked the dashboard".into(),
                        operator: "alice".into(),
                        resolution_id: format!("res-{id}"),
                        fencing_token: token,
                        ..Default::default()
                    },
                    key,
                ))
                .await,
        ),
        "PutTenant" => Answer::of(
            admin
                .put_tenant(with_key(
                    apb::PutTenantRequest {
                        name: "initech".into(),
                        ..Default::default()
                    },
                    key,
                ))
                .await,
        ),
        "ListTenants" => Answer::of(
            admin
                .list_tenants(with_key(apb::ListTenantsRequest {}, key))
                .await,
        ),
        "CreateKey" => Answer::of(
            admin
                .create_key(with_key(
                    apb::CreateKeyRequest {
                        tenant: "acme".into(),
                        name: "made-in-the-matrix".into(),
                        roles: vec!["reader".into()],
                        certificate_pem: String::new(),
                    },
                    key,
                ))
                .await,
        ),
        "ListKeys" => Answer::of(
            admin
                .list_keys(with_key(apb::ListKeysRequest::default(), key))
                .await,
        ),
        "RevokeKey" => Answer::of(
            admin
                .revoke_key(with_key(
                    apb::RevokeKeyRequest {
                        key_id: "no-such-key".into(),
                    },
                    key,
                ))
                .await,
        ),
        other => panic!("no RPC {other}"),
    }
}

/// What acme's operation looks like to acme, every field.
async fn snapshot(ledger: &mut Grpc, keys: &Keys, id: &str) -> Vec<u8> {
    ledger
        .get_operation(with_key(
            pb::GetOperationRequest {
                operation_id: id.into(),
                ..Default::default()
            },
            Some(&find(&keys.own, "reader")),
        ))
        .await
        .expect("acme reads its operation")
        .into_inner()
        .encode_to_vec()
}

fn reason_of(answer: &Answer) -> String {
    match answer {
        Answer::Refused(code, message, details) => {
            let status = Status::with_details(*code, message.clone(), details.clone().into());
            reason(&status)
        }
        Answer::Ok(_) => String::new(),
    }
}

on_both_backends!(isolation_matrix_leaks_nothing_across_tenants);

/// Every RPC × {own tenant with each role, other tenant with each role, no key, an unknown key,
/// a revoked key}, generated from [`RPCS`]. Nothing of tenant acme is visible to or changed by
/// anyone else, and a foreign operation answers byte for byte as a missing one.
async fn isolation_matrix_leaks_nothing_across_tenants(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, mut ledger, keys) = with_matrix_keys(&db).await;
    let mut admin = admin_client(&server).await;

    // acme's operation, IN_FLIGHT.
    let acme = Some(find(&keys.own, "executor"));
    let grant = expect_execute(
        &ledger
            .begin(with_key(begin("order-1", ARGS), acme.as_deref()))
            .await
            .unwrap()
            .into_inner(),
    );
    let token = grant.fencing_token;
    // And a duplicate of it, recorded for acme's forensics (and for no one else's).
    let duplicate = ledger
        .begin(with_key(begin("order-1", ARGS), acme.as_deref()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&duplicate), "IN_PROGRESS");
    eventually(
        Duration::from_secs(10),
        "acme's duplicate to be recorded",
        || {
            let mut ledger = ledger.clone();
            let acme = acme.clone();
            async move {
                let found = ledger
                    .get_operation(with_key(
                        pb::GetOperationRequest {
                            operation_id: "order-1".into(),
                            ..Default::default()
                        },
                        acme.as_deref(),
                    ))
                    .await
                    .unwrap()
                    .into_inner();
                (found.calls.len() == 2).then_some(())
            }
        },
    )
    .await;
    let before = snapshot(&mut ledger, &keys, "order-1").await;

    let mut outsiders = vec![Who::Nobody, Who::Stranger, Who::Revoked];
    outsiders.extend(ROLES.map(Who::Other));
    // Begin comes last, for everyone: another tenant's Begin of the same id creates that
    // tenant's own operation, after which the id is no longer missing for it.
    let mut cells: Vec<(&Who, &str, &[&str])> = Vec::new();
    for last in [false, true] {
        for who in &outsiders {
            for (rpc, allowed) in RPCS {
                if (*rpc == "Begin") == last {
                    cells.push((who, rpc, allowed));
                }
            }
        }
    }
    let mut checked = 0;
    for (who, rpc, allowed) in cells {
        let rpc = &rpc;
        let key = keys.of(who);
        {
            let answer = call(
                &mut ledger,
                &mut admin,
                rpc,
                key.as_deref(),
                "order-1",
                token,
            )
            .await;
            let expected = match who {
                Who::Nobody => Some((Code::Unauthenticated, "CREDENTIALS_MISSING")),
                Who::Stranger => Some((Code::Unauthenticated, "CREDENTIALS_INVALID")),
                Who::Revoked => Some((Code::Unauthenticated, "CREDENTIALS_REVOKED")),
                Who::Other(role) if !allowed.contains(role) => {
                    Some((Code::PermissionDenied, "ROLE_NOT_ALLOWED"))
                }
                _ => None,
            };
            match expected {
                Some((code, why)) => {
                    assert_eq!(
                        (answer.code(), reason_of(&answer).as_str()),
                        (code, why),
                        "{rpc} as {who:?}: {answer:?}"
                    );
                }
                None if NAMES_AN_OPERATION.contains(rpc) => {
                    let missing = call(
                        &mut ledger,
                        &mut admin,
                        rpc,
                        key.as_deref(),
                        "never-begun",
                        token,
                    )
                    .await;
                    assert_eq!(answer, missing, "{rpc} as {who:?}: foreign ≠ missing");
                    assert_eq!(answer.code(), Code::NotFound, "{rpc} as {who:?}");
                }
                None if *rpc == "GetStats" => {
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let found = pb::GetStatsResponse::decode(&bytes[..]).unwrap();
                    assert!(
                        found.operations.is_empty(),
                        "{who:?} counted acme's operations"
                    );
                }
                None if *rpc == "GetHistoryHead" => {
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let head = pb::GetHistoryHeadResponse::decode(&bytes[..]).unwrap();
                    assert_ne!(head.tenant, "acme", "{who:?} read acme's chain");
                }
                None if *rpc == "VerifyHistory" => {
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let verified = pb::VerifyHistoryResponse::decode(&bytes[..]).unwrap();
                    assert_ne!(verified.tenant, "acme", "{who:?} walked acme's chain");
                }
                None if *rpc == "GetSigningKeys" => {
                    // Public keys, the same for every caller: nothing of a tenant's.
                    assert!(
                        matches!(answer, Answer::Ok(_)),
                        "{rpc} as {who:?}: {answer:?}"
                    );
                }
                None if *rpc == "GetForensics" => {
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let found = pb::GetForensicsResponse::decode(&bytes[..]).unwrap();
                    assert_eq!(
                        (found.operations, found.prevented),
                        (0, 0),
                        "{who:?} saw acme's calls"
                    );
                }
                None if *rpc == "WatchOperations" => {
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let mut bytes = &bytes[..];
                    while !bytes.is_empty() {
                        let message =
                            pb::WatchOperationsResponse::decode_length_delimited(&mut bytes)
                                .unwrap();
                        assert!(
                            !matches!(
                                message.item,
                                Some(pb::watch_operations_response::Item::Event(_))
                            ),
                            "{who:?} watched another tenant's events: {message:?}"
                        );
                    }
                }
                None if *rpc == "ListOperations" => {
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let listed = pb::ListOperationsResponse::decode(&bytes[..]).unwrap();
                    assert!(
                        listed
                            .operations
                            .iter()
                            .all(|o| o.operation_id != "order-1" || o.fencing_token != token),
                        "{who:?} listed acme's operation"
                    );
                }
                None if *rpc == "Begin" => {
                    // The same id in another tenant is another operation.
                    let Answer::Ok(bytes) = &answer else {
                        panic!("{rpc} as {who:?}: {answer:?}")
                    };
                    let response = pb::BeginResponse::decode(&bytes[..]).unwrap();
                    let ours = expect_execute(&response);
                    assert_ne!(ours.provider_key, grant.provider_key);
                }
                None if ADMINISTRATION.contains(rpc) => {
                    // The admin role is the ledger's, not a tenant's: whoever runs the ledger
                    // holds it, whichever tenant the key is recorded under.
                    assert!(
                        !matches!(
                            answer.code(),
                            Code::Unauthenticated | Code::PermissionDenied
                        ),
                        "{rpc} as {who:?}: {answer:?}"
                    );
                }
                None => panic!("{rpc} as {who:?}: no expectation"),
            }
            checked += 1;
        }
    }
    assert_eq!(
        snapshot(&mut ledger, &keys, "order-1").await,
        before,
        "acme's operation changed"
    );

    // acme's own keys: a role that may not make the call is refused; one that may is not.
    for role in ROLES {
        let key = Some(find(&keys.own, role));
        for (rpc, allowed) in RPCS {
            if *rpc == "Begin" || NAMES_AN_OPERATION.contains(rpc) && allowed.contains(&role) {
                // Covered below on an operation of its own, so this loop changes nothing.
                continue;
            }
            let answer = call(
                &mut ledger,
                &mut admin,
                rpc,
                key.as_deref(),
                "order-1",
                token,
            )
            .await;
            if allowed.contains(&role) {
                assert!(
                    !matches!(
                        answer.code(),
                        Code::Unauthenticated | Code::PermissionDenied
                    ),
                    "{rpc} as acme {role}: {answer:?}"
                );
            } else {
                assert_eq!(
                    (answer.code(), reason_of(&answer).as_str()),
                    (Code::PermissionDenied, "ROLE_NOT_ALLOWED"),
                    "{rpc} as acme {role}: {answer:?}"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(snapshot(&mut ledger, &keys, "order-1").await, before);
    // …and acme's executor and operator settle their own operation.
    let executor = find(&keys.own, "executor");
    let beat = call(
        &mut ledger,
        &mut admin,
        "Heartbeat",
        Some(&executor),
        "order-1",
        token,
    )
    .await;
    assert_eq!(beat.code(), Code::Ok, "{beat:?}");
    let unknown = call(
        &mut ledger,
        &mut admin,
        "ReportUnknown",
        Some(&executor),
        "order-1",
        token,
    )
    .await;
    assert_eq!(unknown.code(), Code::Ok, "{unknown:?}");
    let operator = find(&keys.own, "operator");
    let resolved = call(
        &mut ledger,
        &mut admin,
        "Resolve",
        Some(&operator),
        "order-1",
        token,
    )
    .await;
    assert_eq!(resolved.code(), Code::Ok, "{resolved:?}");
    let history =
        pb::GetOperationResponse::decode(&snapshot(&mut ledger, &keys, "order-1").await[..])
            .unwrap();
    assert!(
        history
            .events
            .iter()
            .any(|e| e.actor == "operator:alice@acme-operator"),
        "the resolution names the operator and the key it came with: {:?}",
        history.events
    );
    assert!(
        history
            .attempts
            .iter()
            .all(|a| a.actor == "executor:acme-executor"),
        "attempts are recorded under the key's name: {:?}",
        history.attempts
    );
    assert!(checked > 100, "{checked} cells");
    server.stop().await;
}

on_both_backends!(only_an_admin_reads_another_tenant);

/// A read may name a tenant: its own, or — with the admin role, which is ledger-wide — any.
/// Naming another without it is refused alike for every name, so the refusal reveals nothing.
async fn only_an_admin_reads_another_tenant(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, mut ledger, keys) = with_matrix_keys(&db).await;
    let acme = find(&keys.own, "executor");
    let begun = ledger
        .begin(with_key(begin("order-9", ARGS), Some(&acme)))
        .await
        .unwrap()
        .into_inner();
    expect_execute(&begun);

    let list = |tenant: &str| pb::ListOperationsRequest {
        tenant: tenant.into(),
        ..Default::default()
    };
    let ids = |response: pb::ListOperationsResponse| -> Vec<String> {
        response
            .operations
            .into_iter()
            .map(|o| o.operation_id)
            .collect()
    };
    // The ledger's admin reads acme's operations, by name.
    let ledger_admin = find(&keys.other, "admin");
    let listed = ledger
        .list_operations(with_key(list("acme"), Some(&ledger_admin)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(listed), ["order-9"]);
    let found = ledger
        .get_operation(with_key(
            pb::GetOperationRequest {
                operation_id: "order-9".into(),
                tenant: "acme".into(),
            },
            Some(&ledger_admin),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.operation.unwrap().operation_id, "order-9");
    let stats = ledger
        .get_stats(with_key(
            pb::GetStatsRequest {
                tenant: "acme".into(),
                ..Default::default()
            },
            Some(&ledger_admin),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.operations.len(), 1);
    let mut watched = ledger
        .watch_operations(with_key(
            pb::WatchOperationsRequest {
                tenant: "acme".into(),
                ..Default::default()
            },
            Some(&ledger_admin),
        ))
        .await
        .unwrap()
        .into_inner();
    let first = watched.message().await.unwrap().unwrap();
    assert!(
        matches!(first.item, Some(pb::watch_operations_response::Item::Event(e)) if e.operation_id == "order-9")
    );
    let invalid = ledger
        .list_operations(with_key(list("Not A Tenant"), Some(&ledger_admin)))
        .await
        .unwrap_err();
    assert_eq!(
        (invalid.code(), field(&invalid)),
        (Code::InvalidArgument, "tenant".to_owned())
    );

    // acme's reader may name its own tenant; globex's reader and operator may not name acme,
    // and are told so exactly as for a tenant that does not exist.
    let acme_reader = find(&keys.own, "reader");
    let listed = ledger
        .list_operations(with_key(list("acme"), Some(&acme_reader)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(listed), ["order-9"]);
    for role in ["reader", "operator"] {
        let key = find(&keys.other, role);
        let named = ledger
            .list_operations(with_key(list("acme"), Some(&key)))
            .await
            .unwrap_err();
        let missing = ledger
            .list_operations(with_key(list("no-such-tenant"), Some(&key)))
            .await
            .unwrap_err();
        assert_eq!(
            (named.code(), reason(&named)),
            (Code::PermissionDenied, "ROLE_NOT_ALLOWED".to_owned())
        );
        let info = |status: &Status| {
            use tonic_types::StatusExt as _;
            let info = status.get_error_details().error_info().cloned().unwrap();
            let metadata: std::collections::BTreeMap<_, _> = info.metadata.into_iter().collect();
            (info.reason, info.domain, metadata)
        };
        assert_eq!(
            (named.message(), info(&named)),
            (missing.message(), info(&missing)),
            "{role}"
        );
    }
    server.stop().await;
}

on_both_backends!(only_an_admin_reads_every_tenant_at_once);

/// With the admin role a listing, a watch and the figures may cover every tenant at once, each
/// operation and event naming its tenant; every other key is refused as it is for naming
/// another tenant, and a read that names a tenant and every tenant at once is malformed.
async fn only_an_admin_reads_every_tenant_at_once(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, mut ledger, keys) = with_matrix_keys(&db).await;
    for (keys, id) in [(&keys.own, "order-9"), (&keys.other, "order-7")] {
        let executor = find(keys, "executor");
        let begun = ledger
            .begin(with_key(begin(id, ARGS), Some(&executor)))
            .await
            .unwrap()
            .into_inner();
        expect_execute(&begun);
    }
    let every = |page_token: String| pb::ListOperationsRequest {
        all_tenants: true,
        page_size: 1,
        page_token,
        ..Default::default()
    };
    let ledger_admin = find(&keys.other, "admin");
    // Page by page, in the order they were created: nothing skipped, nothing repeated.
    let mut listed = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = ledger
            .list_operations(with_key(every(page_token), Some(&ledger_admin)))
            .await
            .unwrap()
            .into_inner();
        listed.extend(
            page.operations
                .into_iter()
                .map(|o| format!("{}/{}", o.tenant, o.operation_id)),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(listed, ["acme/order-9", "globex/order-7"]);
    let mut watched = ledger
        .watch_operations(with_key(
            pb::WatchOperationsRequest {
                all_tenants: true,
                ..Default::default()
            },
            Some(&ledger_admin),
        ))
        .await
        .unwrap()
        .into_inner();
    let events = within(Duration::from_secs(10), "both tenants' claims", async {
        let mut events = Vec::new();
        while events.len() < 2 {
            if let Some(pb::watch_operations_response::Item::Event(e)) =
                watched.message().await.unwrap().unwrap().item
            {
                events.push(format!("{}/{}", e.tenant, e.operation_id));
            }
        }
        events
    })
    .await;
    assert_eq!(events, ["acme/order-9", "globex/order-7"]);
    let stats = ledger
        .get_stats(with_key(
            pb::GetStatsRequest {
                all_tenants: true,
                ..Default::default()
            },
            Some(&ledger_admin),
        ))
        .await
        .unwrap()
        .into_inner();
    let counted: u64 = stats.operations.iter().map(|c| c.count).sum();
    assert_eq!(counted, 2, "{:?}", stats.operations);

    let both = ledger
        .list_operations(with_key(
            pb::ListOperationsRequest {
                all_tenants: true,
                tenant: "acme".into(),
                ..Default::default()
            },
            Some(&ledger_admin),
        ))
        .await
        .unwrap_err();
    assert_eq!(
        (both.code(), field(&both)),
        (Code::InvalidArgument, "tenant".to_owned())
    );
    for key in keys
        .own
        .iter()
        .chain(&keys.other)
        .filter(|(role, _)| *role != "admin")
    {
        let key = Some(key.1.as_str());
        let refusals = [
            ledger
                .list_operations(with_key(every(String::new()), key))
                .await
                .map(drop),
            ledger
                .get_stats(with_key(
                    pb::GetStatsRequest {
                        all_tenants: true,
                        ..Default::default()
                    },
                    key,
                ))
                .await
                .map(drop),
            ledger
                .watch_operations(with_key(
                    pb::WatchOperationsRequest {
                        all_tenants: true,
                        ..Default::default()
                    },
                    key,
                ))
                .await
                .map(drop),
        ];
        for refused in refusals {
            let refused = refused.unwrap_err();
            assert_eq!(
                (refused.code(), reason(&refused)),
                (Code::PermissionDenied, "ROLE_NOT_ALLOWED".to_owned())
            );
        }
    }
    server.stop().await;
}

on_both_backends!(an_open_ledger_closes_when_its_first_key_is_created);

/// Without credentials the ledger is open (tenant `default`); once one exists, it is required:
/// at once on the replica that stored it, within the TTL on another.
async fn an_open_ledger_closes_when_its_first_key_is_created(store: Engine) {
    let db = TestDb::new(store).await;
    let server = TestLedger::spawn_with(&db, &["--credential-ttl", "100ms"]).await;
    let other = TestLedger::spawn_with(&db, &["--credential-ttl", "100ms"]).await;
    let mut ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    claim(&mut ledger, begin("open-1", ARGS)).await;
    let on_other = other.client().await;
    claim(&mut on_other.clone(), begin("open-other", ARGS)).await;
    // Open: the admin API answers too, so the first tenant and key can be made over gRPC.
    put_tenant(&mut admin, "", "acme").await;
    let key = create_key(&mut admin, "", "acme", &["executor", "reader"]).await;
    // The replica that stored it is closed at once; others within their TTL.
    let refused = ledger.begin(begin("open-2", ARGS)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert_eq!(reason(&refused), "CREDENTIALS_MISSING");
    let elsewhere = eventually(Duration::from_secs(5), "the other replica closes", || {
        let mut on_other = on_other.clone();
        async move { on_other.begin(begin("open-3", ARGS)).await.err() }
    })
    .await;
    assert_eq!(reason(&elsewhere), "CREDENTIALS_MISSING");
    // The key works, in its own tenant: `default`'s operation is not acme's.
    let missing = ledger
        .get_operation(with_key(
            pb::GetOperationRequest {
                operation_id: "open-1".into(),
                ..Default::default()
            },
            Some(&key.secret),
        ))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    server.stop().await;
    other.stop().await;
}

on_both_backends!(an_operation_past_its_retention_begun_again_counts_against_the_cap);

/// An operation settled past its retention (not yet swept) that is begun again starts a new
/// life: a new execution, which the tenant's in-flight cap refuses while the tenant holds its
/// cap, as it refuses a first claim.
async fn an_operation_past_its_retention_begun_again_counts_against_the_cap(store: Engine) {
    let db = TestDb::new(store).await;
    let flags = [
        "--retention-explicit",
        "1ms",
        "--retention-sweep-interval",
        "1h",
    ];
    let (server, admin_key) = guarded_ledger(&db, &flags).await;
    let mut ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    put_limited_tenant(&mut admin, &admin_key, "capped", 1, 0).await;
    let capped = create_key(&mut admin, &admin_key, "capped", &["executor"])
        .await
        .secret;
    let request = with_key(begin("done", ARGS), Some(&capped));
    let grant = expect_execute(&ledger.begin(request).await.unwrap().into_inner());
    ledger
        .confirm(with_key(
            pb::ConfirmRequest {
                operation_id: "done".into(),
                ..confirm_of(grant.fencing_token, "re_done")
            },
            Some(&capped),
        ))
        .await
        .unwrap();
    // The tenant takes its one slot (once the count it was read with shows the slot free).
    eventually(Duration::from_secs(5), "a slot for held", || {
        let mut ledger = ledger.clone();
        let request = with_key(begin("held", ARGS), Some(&capped));
        async move { ledger.begin(request).await.ok() }
    })
    .await;
    let again = ledger
        .begin(with_key(begin("done", ARGS), Some(&capped)))
        .await
        .unwrap_err();
    assert_eq!(
        (again.code(), reason(&again)),
        (Code::ResourceExhausted, "TOO_MANY_IN_FLIGHT".to_owned())
    );
    server.stop().await;
}

on_both_backends!(tenant_limits_refuse_with_retry_after);

/// A tenant over its in-flight cap or its request rate is told RESOURCE_EXHAUSTED with when to
/// come back; other tenants are not.
async fn tenant_limits_refuse_with_retry_after(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, admin_key) = guarded_ledger(&db, &["--credential-ttl", "100ms"]).await;
    let mut ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    for (name, max_in_flight, rate) in [("capped", 2, 0), ("slow", 0, 1), ("free", 0, 0)] {
        put_limited_tenant(&mut admin, &admin_key, name, max_in_flight, rate).await;
    }
    let capped = create_key(&mut admin, &admin_key, "capped", &["executor"])
        .await
        .secret;
    let slow = create_key(&mut admin, &admin_key, "slow", &["executor"])
        .await
        .secret;
    let free = create_key(&mut admin, &admin_key, "free", &["executor"])
        .await
        .secret;

    for i in 0..2 {
        let request = with_key(begin(&format!("cap-{i}"), ARGS), Some(&capped));
        expect_execute(&ledger.begin(request).await.unwrap().into_inner());
    }
    let over = ledger
        .begin(with_key(begin("cap-2", ARGS), Some(&capped)))
        .await
        .unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    assert_eq!(reason(&over), "TOO_MANY_IN_FLIGHT");
    assert!(over.metadata().get("retry-after").is_some());
    // A Begin of an operation it holds is not a new execution: it goes on (IN_PROGRESS).
    let again = ledger
        .begin(with_key(begin("cap-0", ARGS), Some(&capped)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&again), "IN_PROGRESS");

    // One request a second: the second at once is refused.
    let first = ledger
        .begin(with_key(begin("slow-0", ARGS), Some(&slow)))
        .await;
    assert!(first.is_ok(), "{first:?}");
    let second = ledger
        .begin(with_key(begin("slow-1", ARGS), Some(&slow)))
        .await
        .unwrap_err();
    assert_eq!(second.code(), Code::ResourceExhausted);
    assert_eq!(reason(&second), "RATE_LIMITED");
    // A report is never refused for the rate: a known outcome must not be lost to UNKNOWN.
    let grant = expect_execute(&first.unwrap().into_inner());
    ledger
        .confirm(with_key(
            pb::ConfirmRequest {
                operation_id: "slow-0".into(),
                fencing_token: grant.fencing_token,
                result: b"{}".to_vec(),
                provider_ref: "re_slow".into(),
            },
            Some(&slow),
        ))
        .await
        .expect("a rate-limited key's Confirm is taken");
    // Other tenants are untouched.
    for i in 0..5 {
        let request = with_key(begin(&format!("free-{i}"), ARGS), Some(&free));
        expect_execute(&ledger.begin(request).await.unwrap().into_inner());
    }
    server.stop().await;
}

/// Creates tenants `acme` and `globex` and an executor key for each through `onced keys` and
/// `onced tenants`, the binary's own commands on the database; returns the keys.
fn keys_by_command(url: &str) -> Vec<(String, String)> {
    let onced = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
            .args(["--database-url", url])
            .args(args)
            .output()
            .expect("run onced");
        assert!(out.status.success(), "{args:?}: {out:?}");
        out
    };
    let mut keys = Vec::new();
    for tenant in ["acme", "globex"] {
        onced(&["tenants", "put", tenant]);
        let out = onced(&[
            "keys",
            "create",
            "--tenant",
            tenant,
            "--name",
            &format!("{tenant}-mcp"),
            "--role",
            "executor,operator",
            "--json",
        ]);
        let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let secret = created["secret"].as_str().unwrap().to_owned();
        assert!(
            secret.starts_with("once_") && secret.len() >= 64,
            "{created}"
        );
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains(&secret),
            "the key reached the log"
        );
        keys.push((tenant.to_owned(), secret));
    }
    let listed = onced(&["keys", "list", "--json"]);
    let listed = String::from_utf8(listed.stdout).unwrap();
    for (_, secret) in &keys {
        assert!(
            !listed.contains(secret.as_str()),
            "a listing showed a secret"
        );
    }
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&listed)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    keys
}

on_both_backends!(revocation_reaches_every_replica_within_the_credential_ttl);

/// A key revoked through one replica is refused by another that has just admitted it, within
/// the credential TTL (2 s by default).
async fn revocation_reaches_every_replica_within_the_credential_ttl(store: Engine) {
    let db = TestDb::new(store).await;
    let keys = keys_by_command(&db.url);
    let (_, acme) = &keys[0];
    let dir = db.scratch_dir();
    let first = OncedProcess::spawn(&db.url, dir.join("first.log"), &[]).await;
    let second = OncedProcess::spawn(&db.url, dir.join("second.log"), &[]).await;
    let mut on_second = second.client().await;
    on_second
        .begin(with_key(begin("rev-1", ARGS), Some(acme)))
        .await
        .expect("the key works on the second replica");

    let key_id = acme[5..17].to_owned();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
        .args(["--database-url", &db.url, "keys", "revoke", &key_id])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let revoked_at = tokio::time::Instant::now();
    let refused = eventually(
        Duration::from_secs(2) + Duration::from_millis(1500),
        "the second replica refuses the revoked key",
        || {
            let mut on_second = on_second.clone();
            async move {
                on_second
                    .begin(with_key(begin("rev-2", ARGS), Some(acme)))
                    .await
                    .err()
            }
        },
    )
    .await;
    assert_eq!(reason(&refused), "CREDENTIALS_REVOKED");
    let mut on_first = first.client().await;
    let refused = on_first
        .get_operation(with_key(
            pb::GetOperationRequest {
                operation_id: "rev-1".into(),
                ..Default::default()
            },
            Some(acme),
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    println!("revocation seen after {:?}", revoked_at.elapsed());
    for onced in [first, second] {
        assert!(onced.terminate().await.success());
    }
}

on_both_backends!(each_tenant_is_looked_up_with_its_own_credentials);

/// One reconciler configured for two tenants looks each tenant's operations up with that
/// tenant's credential only.
async fn each_tenant_is_looked_up_with_its_own_credentials(store: Engine) {
    use std::sync::{Arc, Mutex};

    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let recorder = seen.clone();
    let tickets = axum::Router::new().route(
        "/tickets/{key}",
        axum::routing::get(
            move |axum::extract::Path(key): axum::extract::Path<String>,
                  headers: axum::http::HeaderMap| {
                let recorder = recorder.clone();
                async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    recorder.lock().unwrap().push((key.clone(), auth));
                    axum::Json(serde_json::json!({ "id": format!("T-{key}") }))
                }
            },
        ),
    );
    let endpoint = serve(tickets).await;
    let db = TestDb::new(store).await;
    let keys = keys_by_command(&db.url);
    let config = config_file(
        &db,
        format!(
            "[reconciliation]\ninterval = \"50ms\"\n\n[[reconciler]]\nname = \"tickets\"\nkind = \"http\"\n\
             endpoint = \"{endpoint}\"\nurl = \"{{endpoint}}/tickets/{{provider_key}}\"\n\
             api_key_env = {{ acme = \"ONCE_IT_ACME_TICKETS\", globex = \"ONCE_IT_GLOBEX_TICKETS\" }}\n\
             miss_is_authoritative = true\ndedupes_by_provider_key = true\nsettle_time = \"0s\"\n"
        ),
    );
    let onced = OncedProcess::spawn_with_env(
        &db.url,
        db.scratch_dir().join("tenants-reconcile.log"),
        &["--config", config.as_str()],
        &[
            ("ONCE_IT_ACME_TICKETS", "acme-ticket-secret"),
            ("ONCE_IT_GLOBEX_TICKETS", "globex-ticket-secret"),
        ],
    )
    .await;
    let mut grpc = onced.client().await;
    let mut provider_keys = Vec::new();
    for (tenant, key) in &keys {
        let mut request = begin("ticket-1", ARGS);
        request.lease_ttl = Some(ms(200));
        request.provider = "tickets".into();
        let grant = expect_execute(
            &grpc
                .begin(with_key(request, Some(key)))
                .await
                .unwrap()
                .into_inner(),
        );
        grpc.report_unknown(with_key(
            pb::ReportUnknownRequest {
                operation_id: "ticket-1".into(),
                fencing_token: grant.fencing_token,
                reason: "timeout".into(),
            },
            Some(key),
        ))
        .await
        .unwrap();
        provider_keys.push((tenant.clone(), grant.provider_key));
    }
    for (_, key) in &keys {
        eventually(Duration::from_secs(20), "reconciled", || {
            let mut grpc = grpc.clone();
            async move {
                let op = grpc
                    .get_operation(with_key(
                        pb::GetOperationRequest {
                            operation_id: "ticket-1".into(),
                            ..Default::default()
                        },
                        Some(key),
                    ))
                    .await
                    .ok()?
                    .into_inner()
                    .operation?;
                (op.state == pb::OperationState::Confirmed as i32).then_some(())
            }
        })
        .await;
    }
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty());
    for (provider_key, auth) in &seen {
        let tenant = &provider_keys
            .iter()
            .find(|(_, k)| k == provider_key)
            .expect("a lookup of a known operation")
            .0;
        assert_eq!(auth, &format!("Bearer {tenant}-ticket-secret"), "{seen:?}");
    }
    assert!(onced.terminate().await.success());
}

on_both_backends!(a_tenant_no_reconciler_serves_is_named_at_start_and_in_the_refusal);

/// A reconciler configured for acme only: onced warns at start that no reconciler serves
/// globex, naming what each reconciler serves; globex's Reconcile of an operation naming it is
/// refused with NO_RECONCILER saying that it serves not globex, in the words it would use for a
/// name no reconciler has, and naming no other tenant.
async fn a_tenant_no_reconciler_serves_is_named_at_start_and_in_the_refusal(store: Engine) {
    let provider = serve(fakepay::router(fakepay::Provider::default())).await;
    let db = TestDb::new(store).await;
    let keys = keys_by_command(&db.url);
    let config = config_file(
        &db,
        format!(
            "[[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\nendpoint = \"{provider}\"\n\
             api_key_env = {{ acme = \"ONCE_IT_ACME_STRIPE\" }}\n"
        ),
    );
    let log = db.scratch_dir().join("unserved.log");
    let onced = OncedProcess::spawn_with_env(
        &db.url,
        log.clone(),
        &["--config", config.as_str()],
        &[("ONCE_IT_ACME_STRIPE", "sk_acme")],
    )
    .await;
    let said = onced.log();
    let warned: Vec<&str> = said
        .lines()
        .filter(|l| l.contains("no reconciler serves tenant"))
        .collect();
    assert_eq!(warned.len(), 1, "{said}");
    assert!(
        warned[0].contains("WARN")
            && warned[0].contains("\"globex\"")
            && warned[0].contains("stripe serves acme"),
        "{said}"
    );
    let globex = &keys.iter().find(|(t, _)| t == "globex").unwrap().1;
    let grpc = onced.client().await;
    // globex's UNKNOWN operation naming `provider`, and its Reconcile's refusal.
    let refusal = |id: &'static str, provider: &'static str| {
        let mut grpc = grpc.clone();
        async move {
            let mut request = begin(id, ARGS);
            request.provider = provider.into();
            let grant = expect_execute(
                &grpc
                    .begin(with_key(request, Some(globex)))
                    .await
                    .unwrap()
                    .into_inner(),
            );
            let unknown = pb::ReportUnknownRequest {
                operation_id: id.into(),
                fencing_token: grant.fencing_token,
                reason: "timeout".into(),
            };
            grpc.report_unknown(with_key(unknown, Some(globex)))
                .await
                .unwrap();
            let reconcile = pb::ReconcileRequest {
                operation_id: id.into(),
                ..Default::default()
            };
            grpc.reconcile(with_key(reconcile, Some(globex)))
                .await
                .unwrap_err()
        }
    };
    let refused = refusal("unserved-1", "stripe").await;
    assert_eq!(reason(&refused), "NO_RECONCILER");
    assert!(
        refused
            .message()
            .contains("no reconciler named \"stripe\" serves tenant \"globex\""),
        "{refused:?}"
    );
    // The same words as for a name no reconciler has: nothing of what another tenant has
    // configured shows.
    let nowhere = refusal("unserved-2", "nowhere").await;
    assert_eq!(
        nowhere.message().replace("nowhere", "stripe"),
        refused.message()
    );
    assert!(!refused.message().contains("acme"), "{refused:?}");
    assert!(onced.terminate().await.success());
}

/// An operation as `key` reads it.
async fn read_as(ledger: &mut Grpc, key: &str, id: &str) -> pb::GetOperationResponse {
    ledger
        .get_operation(with_key(
            pb::GetOperationRequest {
                operation_id: id.into(),
                ..Default::default()
            },
            Some(key),
        ))
        .await
        .unwrap()
        .into_inner()
}

fn confirm_of(token: u64, provider_ref: &str) -> pb::ConfirmRequest {
    pb::ConfirmRequest {
        operation_id: "refund-1".into(),
        fencing_token: token,
        result: b"{}".to_vec(),
        provider_ref: provider_ref.into(),
    }
}

/// A keyless caller's request for an admin key of the ledger's tenant.
fn first_key(name: &str) -> apb::CreateKeyRequest {
    apb::CreateKeyRequest {
        tenant: LEDGER_TENANT.into(),
        name: name.into(),
        roles: vec!["admin".into()],
        certificate_pem: String::new(),
    }
}

on_both_backends!(a_report_comes_from_the_credential_that_holds_the_attempt);

/// A fencing token is readable by every reader of the operation: another executor key of the
/// same tenant that read it reports, heartbeats and re-begins in vain, answered as for a token
/// never issued, and the attempt is still the holder's to settle.
async fn a_report_comes_from_the_credential_that_holds_the_attempt(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, admin_key) = guarded_ledger(&db, &[]).await;
    let mut admin = admin_client(&server).await;
    put_tenant(&mut admin, &admin_key, "acme").await;
    let holder = create_key(&mut admin, &admin_key, "acme", &["executor"])
        .await
        .secret;
    let other = create_key(&mut admin, &admin_key, "acme", &["executor", "reader"])
        .await
        .secret;
    let mut ledger = server.client().await;
    let first = begin("refund-1", ARGS);
    let grant = expect_execute(
        &ledger
            .begin(with_key(first.clone(), Some(&holder)))
            .await
            .unwrap()
            .into_inner(),
    );
    // The other key reads the attempt: its token, its attempt id and context.
    let read = read_as(&mut ledger, &other, "refund-1").await;
    let token = read.operation.as_ref().unwrap().fencing_token;
    assert_eq!(token, grant.fencing_token);

    // What a token never issued is answered, for comparison.
    let channel = ledger.clone();
    let never_issued = |request: tonic::Request<pb::ReportAbsentRequest>| {
        let mut ledger = channel.clone();
        async move { ledger.report_absent(request).await.unwrap_err() }
    };
    let absent = |token: u64| pb::ReportAbsentRequest {
        operation_id: "refund-1".into(),
        fencing_token: token,
        reason: "declined".into(),
    };
    let unissued = never_issued(with_key(absent(token + 1_000), Some(&holder))).await;
    let refused = |status: &Status| (status.code(), reason(status));

    let forged_absent = ledger
        .report_absent(with_key(absent(token), Some(&other)))
        .await
        .unwrap_err();
    assert_eq!(refused(&forged_absent), refused(&unissued));
    let forged_confirm = ledger
        .confirm(with_key(confirm_of(token, "re_forged"), Some(&other)))
        .await
        .unwrap_err();
    assert_eq!(refused(&forged_confirm), refused(&unissued));
    let forged_unknown = ledger
        .report_unknown(with_key(
            pb::ReportUnknownRequest {
                operation_id: "refund-1".into(),
                fencing_token: token,
                reason: "?".into(),
            },
            Some(&other),
        ))
        .await
        .unwrap_err();
    assert_eq!(refused(&forged_unknown), refused(&unissued));
    let heartbeat = |key: String, token: u64| {
        let mut ledger = channel.clone();
        async move {
            ledger
                .heartbeat(with_key(
                    pb::HeartbeatRequest {
                        operation_id: "refund-1".into(),
                        fencing_token: token,
                        lease_ttl: Some(ms(60_000)),
                    },
                    Some(&key),
                ))
                .await
        }
    };
    let forged_beat = heartbeat(other.clone(), token).await.unwrap_err();
    let unissued_beat = heartbeat(holder.clone(), token + 1_000).await.unwrap_err();
    assert_eq!(refused(&forged_beat), refused(&unissued_beat));
    // The very Begin again, from the other key: not the grant, and no new execution right.
    let again = ledger
        .begin(with_key(first.clone(), Some(&other)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&again), "IN_PROGRESS");
    let fresh = ledger
        .begin(with_key(begin("refund-1", ARGS), Some(&other)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision_name(&fresh), "IN_PROGRESS");

    // Nothing changed: still IN_FLIGHT, one event, and the holder's own calls work.
    let after = read_as(&mut ledger, &other, "refund-1").await;
    let op = after.operation.unwrap();
    assert_eq!(op.state, pb::OperationState::InFlight as i32);
    assert_eq!(after.events.len(), 1, "{:?}", after.events);
    heartbeat(holder.clone(), token)
        .await
        .expect("the holder's heartbeat");
    let regrant = ledger
        .begin(with_key(first, Some(&holder)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expect_execute(&regrant).fencing_token, token);
    ledger
        .confirm(with_key(confirm_of(token, "re_1"), Some(&holder)))
        .await
        .expect("the holder's confirm");
    server.stop().await;
}

/// `--help` shows which variable sets each flag, never the value it has: a database URL carries
/// a password.
#[test]
fn help_never_prints_a_secret_from_the_environment() {
    for args in [&["--help"][..], &["keys", "--help"], &["tenants", "--help"]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
            .args(args)
            .env(
                "ONCE_DATABASE_URL",
                "postgres://once:hunter2@db.internal/once",
            )
            .env("ONCE_ADMIN_KEY_FILE", "/run/secrets/hunter2")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {text}");
        assert!(text.contains("ONCE_DATABASE_URL"), "{args:?}: {text}");
        assert!(!text.contains("hunter2"), "{args:?}: {text}");
    }
}

on_both_backends!(the_admin_role_lives_in_one_place);

/// The admin role is the ledger's: a key of tenant `acme` with it is refused, over gRPC and by
/// `onced keys create`, with a message saying where it lives; one stored with it anyway (by
/// hand, or before the rule) is admitted without it; the ledger's own tenant may hold it.
async fn the_admin_role_lives_in_one_place(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, admin_key) = guarded_ledger(&db, &[]).await;
    let mut admin = admin_client(&server).await;
    put_tenant(&mut admin, &admin_key, "acme").await;
    let refused = admin
        .create_key(with_key(
            apb::CreateKeyRequest {
                tenant: "acme".into(),
                name: "acme-admin".into(),
                roles: vec!["reader".into(), "admin".into()],
                certificate_pem: String::new(),
            },
            Some(&admin_key),
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("only keys of tenant \"default\""),
        "{refused:?}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
        .args([
            "--database-url",
            &db.url,
            "keys",
            "create",
            "--tenant",
            "acme",
        ])
        .args(["--name", "acme-admin", "--role", "admin"])
        .output()
        .expect("run onced");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("only keys of tenant \"default\""),
        "{stderr}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM credentials WHERE roles LIKE '%admin%'")
            .await,
        1,
        "only the bootstrap admin key holds the role"
    );

    // Stored with it by hand: a replica started since warns of it and admits the key for what
    // its other roles allow, not as an admin.
    let smuggled = create_key(&mut admin, &admin_key, "acme", &["reader"])
        .await
        .secret;
    db.execute("UPDATE credentials SET roles = 'reader,admin' WHERE tenant = 'acme'")
        .await;
    let replica = OncedProcess::spawn(&db.url, db.scratch_dir().join("replica.log"), &[]).await;
    assert!(
        replica
            .log()
            .contains("stored with the admin role outside tenant"),
        "{}",
        replica.log()
    );
    let mut on_replica = admin_client_at(replica.addr).await;
    let denied = on_replica
        .list_tenants(with_key(
            apb::ListTenantsRequest::default(),
            Some(&smuggled),
        ))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert_eq!(reason(&denied), "ROLE_NOT_ALLOWED");
    let mut ledger = replica.client().await;
    let other_tenant = ledger
        .list_operations(with_key(
            pb::ListOperationsRequest {
                tenant: LEDGER_TENANT.into(),
                ..Default::default()
            },
            Some(&smuggled),
        ))
        .await
        .unwrap_err();
    assert_eq!(
        other_tenant.code(),
        Code::PermissionDenied,
        "{other_tenant:?}"
    );
    ledger
        .list_operations(with_key(
            pb::ListOperationsRequest::default(),
            Some(&smuggled),
        ))
        .await
        .expect("its own tenant's reads, as a reader");

    // The ledger's tenant holds it.
    let second = create_key(&mut admin, &admin_key, LEDGER_TENANT, &["admin"])
        .await
        .secret;
    admin
        .list_tenants(with_key(apb::ListTenantsRequest::default(), Some(&second)))
        .await
        .expect("an admin key of the ledger's tenant administers");
    server.stop().await;
}

on_both_backends!(the_first_credential_is_a_conditional_write);

/// Eight keyless callers ask two replicas of an open ledger for a first key at once: exactly one
/// gets it, the others are told the ledger is closed, and a replica whose credentials were read
/// long ago (a minute's TTL) mints nothing for a keyless caller once it is, nor admits one to
/// any other admin call: an open ledger's admin calls are never admitted from the cache.
async fn the_first_credential_is_a_conditional_write(store: Engine) {
    let db = TestDb::new(store).await;
    let one = TestLedger::spawn_with(&db, &["--credential-ttl", "60s"]).await;
    let two = TestLedger::spawn_with(&db, &["--credential-ttl", "60s"]).await;
    // Read its credentials at start, when none existed, and is asked nothing until the end.
    let stale = TestLedger::spawn_with(&db, &["--credential-ttl", "60s"]).await;
    let admins = [admin_client(&one).await, admin_client(&two).await];
    put_tenant(&mut admins[0].clone(), "", LEDGER_TENANT).await;
    let mut racers = Vec::new();
    for n in 0..8 {
        let mut admin = admins[n % 2].clone();
        racers.push(tokio::spawn(async move {
            admin.create_key(first_key(&format!("first-{n}"))).await
        }));
    }
    let mut won = 0;
    for racer in racers {
        match racer.await.unwrap() {
            Ok(_) => won += 1,
            Err(status) => {
                assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
                assert_eq!(reason(&status), "CREDENTIALS_MISSING");
            }
        }
    }
    assert_eq!(won, 1, "exactly one first credential");
    assert_eq!(db.scalar("SELECT count(*) FROM credentials").await, 1);
    for admin in &admins {
        let late = admin
            .clone()
            .create_key(first_key("late"))
            .await
            .unwrap_err();
        assert_eq!(late.code(), Code::Unauthenticated, "{late:?}");
    }
    assert_eq!(db.scalar("SELECT count(*) FROM credentials").await, 1);
    let mut keyless = admin_client(&stale).await;
    for refused in [
        keyless.create_key(first_key("stale")).await.unwrap_err(),
        keyless
            .put_tenant(apb::PutTenantRequest {
                name: "mallory".into(),
                ..Default::default()
            })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
        assert_eq!(reason(&refused), "CREDENTIALS_MISSING");
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM tenants WHERE name = 'mallory'")
            .await,
        0
    );
    one.stop().await;
    two.stop().await;
    stale.stop().await;
}

/// Opens a WatchOperations stream of the caller's tenant with `key`, from now.
async fn watch_with(
    ledger: &Grpc,
    key: &str,
) -> Result<tonic::Streaming<pb::WatchOperationsResponse>, Status> {
    ledger
        .clone()
        .watch_operations(with_key(pb::WatchOperationsRequest::default(), Some(key)))
        .await
        .map(tonic::Response::into_inner)
}

on_both_backends!(revocation_ends_open_streams);

/// A WatchOperations stream checks again, at least every `--credential-ttl`, that its key still
/// admits it: revoked by another process, the key's stream ends UNAUTHENTICATED, while another
/// key's stream goes on.
async fn revocation_ends_open_streams(store: Engine) {
    use pb::watch_operations_response::Item;
    let db = TestDb::new(store).await;
    let (server, admin_key) = guarded_ledger(&db, &["--credential-ttl", "200ms"]).await;
    let ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    put_tenant(&mut admin, &admin_key, "acme").await;
    let doomed = create_key(&mut admin, &admin_key, "acme", &["reader"]).await;
    let kept = create_key(&mut admin, &admin_key, "acme", &["reader"]).await;
    let executor = create_key(&mut admin, &admin_key, "acme", &["executor"])
        .await
        .secret;
    let mut doomed_stream = watch_with(&ledger, &doomed.secret).await.unwrap();
    let mut kept_stream = watch_with(&ledger, &kept.secret).await.unwrap();
    for stream in [&mut doomed_stream, &mut kept_stream] {
        let first = stream.message().await.unwrap().unwrap().item;
        assert!(matches!(first, Some(Item::CaughtUpTo(_))), "{first:?}");
    }

    let key_id = doomed.key.unwrap().key_id;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
        .args(["--database-url", &db.url, "keys", "revoke", &key_id])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let ended = within(
        Duration::from_secs(10),
        "the revoked key's stream to end",
        async {
            loop {
                match doomed_stream.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("the stream ended without a status"),
                    Err(status) => return status,
                }
            }
        },
    )
    .await;
    assert_eq!(
        (ended.code(), reason(&ended)),
        (Code::Unauthenticated, "CREDENTIALS_REVOKED".to_owned())
    );

    ledger
        .clone()
        .begin(with_key(begin("after-revocation", ARGS), Some(&executor)))
        .await
        .unwrap();
    within(
        Duration::from_secs(10),
        "the other key's stream to carry the next event",
        async {
            loop {
                if let Some(Item::Event(event)) = kept_stream.message().await.unwrap().unwrap().item
                {
                    if event.operation_id == "after-revocation" {
                        return;
                    }
                }
            }
        },
    )
    .await;
    server.stop().await;
}

on_both_backends!(watch_slots_are_held_per_tenant_and_per_key);

/// A replica's watch slots are shared out: one key holds at most `--max-watchers-per-key`,
/// one tenant at most `--max-watchers-per-tenant`, so a tenant that opens all it may leaves
/// slots of `--max-watchers` to another; a closed stream gives its slots back.
async fn watch_slots_are_held_per_tenant_and_per_key(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, admin_key) = guarded_ledger(
        &db,
        &[
            "--max-watchers",
            "3",
            "--max-watchers-per-tenant",
            "2",
            "--max-watchers-per-key",
            "1",
        ],
    )
    .await;
    let ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    let mut keys = Vec::new();
    for tenant in ["acme", "globex"] {
        put_tenant(&mut admin, &admin_key, tenant).await;
        for _ in 0..3 {
            keys.push(
                create_key(&mut admin, &admin_key, tenant, &["reader"])
                    .await
                    .secret,
            );
        }
    }
    let (acme, globex) = keys.split_at(3);
    let refused_for = |refused: Result<_, Status>, flag: &str| {
        let Err(status) = refused else {
            panic!("{flag}: a stream beyond it was opened");
        };
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert_eq!(reason(&status), "TOO_MANY_WATCHERS");
        assert!(
            status.message().contains(&format!("({flag})")),
            "{flag}: {}",
            status.message()
        );
    };

    let _first = watch_with(&ledger, &acme[0]).await.unwrap();
    refused_for(
        watch_with(&ledger, &acme[0]).await,
        "--max-watchers-per-key",
    );
    let second = watch_with(&ledger, &acme[1]).await.unwrap();
    refused_for(
        watch_with(&ledger, &acme[2]).await,
        "--max-watchers-per-tenant",
    );
    let _globex = watch_with(&ledger, &globex[0]).await.unwrap();
    refused_for(watch_with(&ledger, &globex[1]).await, "--max-watchers");

    drop(second);
    eventually(
        Duration::from_secs(10),
        "a closed stream's slots to come back",
        || async { watch_with(&ledger, &globex[1]).await.ok() },
    )
    .await;
    server.stop().await;
}

on_both_backends!(a_report_that_settles_nothing_is_charged_to_the_rate);

/// Reports and heartbeats are free of the rate only when they settle something: ones naming an
/// operation that does not exist, or another key's attempt, are charged to the key's rate and
/// refused once it is spent, while the key's own report still settles its attempt.
async fn a_report_that_settles_nothing_is_charged_to_the_rate(store: Engine) {
    let db = TestDb::new(store).await;
    let (server, admin_key) = guarded_ledger(&db, &[]).await;
    let mut ledger = server.client().await;
    let mut admin = admin_client(&server).await;
    put_limited_tenant(&mut admin, &admin_key, "slow", 0, 3).await;
    let prober = create_key(&mut admin, &admin_key, "slow", &["executor"])
        .await
        .secret;
    let holder = create_key(&mut admin, &admin_key, "slow", &["executor"])
        .await
        .secret;
    let grant = expect_execute(
        &ledger
            .begin(with_key(begin("slow-held", ARGS), Some(&holder)))
            .await
            .unwrap()
            .into_inner(),
    );
    let own = expect_execute(
        &ledger
            .begin(with_key(begin("slow-own", ARGS), Some(&prober)))
            .await
            .unwrap()
            .into_inner(),
    );
    // An attempt the prober gave up (ABSENT) and began again: its late confirm will be
    // recorded, so it settles something.
    let superseded = expect_execute(
        &ledger
            .begin(with_key(begin("slow-twice", ARGS), Some(&prober)))
            .await
            .unwrap()
            .into_inner(),
    );
    ledger
        .report_absent(with_key(
            pb::ReportAbsentRequest {
                operation_id: "slow-twice".into(),
                fencing_token: superseded.fencing_token,
                reason: "declined".into(),
            },
            Some(&prober),
        ))
        .await
        .unwrap();
    expect_execute(
        &ledger
            .begin(with_key(begin("slow-twice", ARGS), Some(&prober)))
            .await
            .unwrap()
            .into_inner(),
    );

    // Back to back, the key's one request a second is spent within a few of them.
    let confirm_as = |operation_id: &str, token: u64| pb::ConfirmRequest {
        operation_id: operation_id.into(),
        ..confirm_of(token, "re_probe")
    };
    let mut answers = Vec::new();
    for n in 0..10 {
        let refused = match n % 3 {
            0 => ledger
                .confirm(with_key(
                    confirm_as("slow-held", grant.fencing_token),
                    Some(&prober),
                ))
                .await
                .map(drop),
            1 => ledger
                .confirm(with_key(
                    confirm_as(&format!("slow-missing-{n}"), 7),
                    Some(&prober),
                ))
                .await
                .map(drop),
            _ => ledger
                .heartbeat(with_key(
                    pb::HeartbeatRequest {
                        operation_id: "slow-held".into(),
                        fencing_token: grant.fencing_token,
                        ..Default::default()
                    },
                    Some(&prober),
                ))
                .await
                .map(drop),
        };
        answers.push(reason(&refused.expect_err("settles nothing")));
    }
    assert!(answers.iter().any(|r| r == "RATE_LIMITED"), "{answers:?}");
    assert!(
        answers.iter().all(|r| [
            "RATE_LIMITED",
            "EXECUTION_RIGHT_LOST",
            "OPERATION_NOT_FOUND"
        ]
        .contains(&r.as_str())),
        "{answers:?}"
    );
    // A superseded attempt's late confirm is recorded: it is free, and answered as it is.
    let late = ledger
        .confirm(with_key(
            confirm_as("slow-twice", superseded.fencing_token),
            Some(&prober),
        ))
        .await
        .expect_err("the attempt's right is lost");
    assert_eq!(reason(&late), "EXECUTION_RIGHT_LOST");
    // Its own report settles its attempt, rate spent or not; the other key's attempt is as it
    // was, and its holder settles it.
    let settled = ledger
        .confirm(with_key(
            confirm_as("slow-own", own.fencing_token),
            Some(&prober),
        ))
        .await
        .expect("a report that settles is never refused for the rate");
    assert_eq!(
        settled.into_inner().state,
        pb::OperationState::Confirmed as i32
    );
    ledger
        .confirm(with_key(
            confirm_as("slow-held", grant.fencing_token),
            Some(&holder),
        ))
        .await
        .expect("the holder settles its attempt");
    server.stop().await;
}

on_both_backends!(a_bootstrap_key_is_strong_and_its_id_shows_nothing_of_it);

/// A bootstrap admin key that could be guessed is refused at start, with the rule it failed and
/// never the key; a strong one is stored under a random key id, neither part of the key nor of
/// its hash, and starting again with it changes nothing.
async fn a_bootstrap_key_is_strong_and_its_id_shows_nothing_of_it(store: Engine) {
    let db = TestDb::new(store).await;
    let onced = |env: &[(&str, &str)], args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_onced"))
            .args(["--database-url", &db.url])
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap()
    };
    for weak in [
        "hunter2hunter2hunter2hunter2hunter2hunter2".to_owned(),
        format!("test-admin-{}", "9f".repeat(20)),
        "0123456789abcdef".repeat(4),
    ] {
        let out = onced(&[("ONCE_ADMIN_KEY", &weak)], &["--listen", "127.0.0.1:0"]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{weak}: {said}");
        assert!(
            said.contains("words or a pattern") || said.contains("bits"),
            "{weak}: {said}"
        );
        assert!(!said.contains(&weak), "the refusal shows the key: {said}");
    }

    let key = strong_key("prod-admin");
    let file = write_file(&db.scratch_dir(), "admin.key", &key);
    for start in ["first", "again"] {
        let ledger = OncedProcess::spawn(
            &db.url,
            db.scratch_dir().join(format!("{start}.log")),
            &["--admin-key-file", file.to_str().unwrap()],
        )
        .await;
        assert!(ledger.terminate().await.success());
    }
    let out = onced(&[], &["keys", "list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|k| k["key_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 1, "stored once: {listed}");
    let hash = once_core::access::SecretHash::of(key.as_bytes()).short_hex();
    assert!(
        ids[0].len() == 12 && !key.contains(ids[0]) && !hash.contains(ids[0]),
        "{} of {key} (hash {hash})",
        ids[0]
    );
}
