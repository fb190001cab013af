//! TLS in `onced`: a private CA, plaintext refused, client certificates standing in for keys,
//! and certificates rotated without dropping connections.

use std::time::Duration;

use clap::Parser as _;
use once_api::admin_pb::admin_client::AdminClient;
use once_api::admin_pb::CreateKeyRequest;
use once_api::pb::ledger_client::LedgerClient;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::Channel;
use tonic::Code;

use crate::support::*;

/// A private certificate authority.
struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Authority {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        Authority {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `name` and its private key, in PEM.
    fn issue(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

async fn begin_over(channel: Channel, id: &str) -> Result<(), tonic::Status> {
    LedgerClient::new(channel)
        .begin(begin(id, ARGS))
        .await
        .map(|_| ())
}

on_both_backends!(tls_with_a_private_ca_refuses_plaintext);

/// A ledger serving a private CA's certificate answers clients that trust the CA, and a
/// plaintext client gets nothing.
async fn tls_with_a_private_ca_refuses_plaintext(store: Engine) {
    let db = TestDb::new(store).await;
    let ca = Authority::new("once test CA");
    let (cert, key) = ca.issue("localhost");
    let ledger = TestLedger::spawn_tls(&db, &cert, &key, &ca.pem(), &[]).await;
    let port = ledger.addr.port();

    let channel = https(port, &ca.pem(), None).connect().await.unwrap();
    begin_over(channel, "tls-1").await.unwrap();

    let plaintext = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    let refused = begin_over(plaintext, "tls-2").await.unwrap_err();
    // The connection is closed on it: the client says so as it sees it (unavailable, or a
    // request cancelled by the closed connection), and nothing carries the ledger's ErrorInfo.
    assert!(
        matches!(
            refused.code(),
            Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
        ),
        "plaintext got an answer from the ledger: {refused:?}"
    );
    assert_eq!(
        reason(&refused),
        "",
        "plaintext got the ledger's ErrorInfo: {refused:?}"
    );
    // …and nothing was begun.
    let trusting = https(port, &ca.pem(), None).connect().await.unwrap();
    let missing = LedgerClient::new(trusting)
        .get_operation(once_api::pb::GetOperationRequest {
            operation_id: "tls-2".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let stranger = Authority::new("someone else's CA");
    let untrusted = https(port, &stranger.pem(), None).connect().await;
    assert!(
        untrusted.is_err(),
        "a client that does not trust the CA connected"
    );
    ledger.stop().await;
}

on_both_backends!(client_certificates_stand_in_for_keys);

/// With `--tls-client-ca`, a client without a certificate is refused in the handshake; a
/// certificate registered as a credential is that credential, tenant and roles included.
async fn client_certificates_stand_in_for_keys(store: Engine) {
    let db = TestDb::new(store).await;
    let dir = db.scratch_dir();
    let server_ca = Authority::new("server CA");
    let client_ca = Authority::new("client CA");
    let (cert, key) = server_ca.issue("localhost");
    let admin_key = strong_key("tls-admin");
    let flags = [
        "--tls-cert".to_owned(),
        write_file(&dir, "cert.pem", &cert).display().to_string(),
        "--tls-key".to_owned(),
        write_file(&dir, "key.pem", &key).display().to_string(),
        "--tls-client-ca".to_owned(),
        write_file(&dir, "client-ca.pem", &client_ca.pem())
            .display()
            .to_string(),
        "--admin-key-file".to_owned(),
        write_file(&dir, "admin.key", &admin_key)
            .display()
            .to_string(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let ledger = TestLedger::start(&db.url, &flags).await;
    let port = ledger.addr.port();
    let registered = client_ca.issue("refund-mcp-a");
    let unregistered = client_ca.issue("refund-mcp-b");
    wait_serving_on(https(port, &server_ca.pem(), Some(&registered))).await;

    // No client certificate: the handshake fails, nothing is answered.
    let anonymous = https(port, &server_ca.pem(), None);
    let refused = match anonymous.connect().await {
        Err(_) => true,
        Ok(channel) => begin_over(channel, "mtls-0").await.is_err(),
    };
    assert!(refused, "a client without a certificate was served");

    // Registered for tenant acme as an executor, by an admin key over the same mTLS.
    let admin_channel = https(port, &server_ca.pem(), Some(&unregistered))
        .connect()
        .await
        .unwrap();
    let mut admin = AdminClient::new(admin_channel.clone());
    admin
        .put_tenant(with_key(
            once_api::admin_pb::PutTenantRequest {
                name: "acme".into(),
                ..Default::default()
            },
            Some(&admin_key),
        ))
        .await
        .unwrap();
    let created = admin
        .create_key(with_key(
            CreateKeyRequest {
                tenant: "acme".into(),
                name: "refund-mcp-a".into(),
                roles: vec!["executor".into()],
                certificate_pem: registered.0.clone(),
            },
            Some(&admin_key),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(
        created.secret.is_empty(),
        "a certificate has no secret to show"
    );
    assert_eq!(created.key.unwrap().kind, "certificate");

    let channel = https(port, &server_ca.pem(), Some(&registered))
        .connect()
        .await
        .unwrap();
    begin_over(channel.clone(), "mtls-1").await.unwrap();
    let history = LedgerClient::new(channel)
        .get_operation(once_api::pb::GetOperationRequest {
            operation_id: "mtls-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(history.attempts[0].actor, "executor:refund-mcp-a");

    // A certificate the CA signed but nobody registered is no credential.
    let stranger = begin_over(admin_channel, "mtls-2").await.unwrap_err();
    assert_eq!(stranger.code(), Code::Unauthenticated);
    assert_eq!(reason(&stranger), "CREDENTIALS_INVALID");
    ledger.stop().await;
}

/// A certificate rotated by SIGHUP is served to new connections; a connection opened before
/// keeps working on the certificate it began with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_rotated_by_sighup_reaches_new_connections_while_old_ones_finish() {
    let db = TestDb::new(Engine::Sqlite).await;
    let dir = db.scratch_dir();
    let (old_ca, new_ca) = (Authority::new("old CA"), Authority::new("new CA"));
    let (cert, key) = old_ca.issue("localhost");
    let cert_file = write_file(&dir, "cert.pem", &cert);
    let key_file = write_file(&dir, "key.pem", &key);
    let old_pem = old_ca.pem();
    // Checked for changes only rarely: the reload this test sees is the SIGHUP's.
    let onced = OncedProcess::launch(
        &db.url,
        dir.join("onced.log"),
        &[
            "--tls-cert",
            cert_file.to_str().unwrap(),
            "--tls-key",
            key_file.to_str().unwrap(),
            "--tls-reload-interval",
            "1h",
        ],
        &[],
        |addr| https(addr.port(), &old_pem, None),
    )
    .await;
    let port = onced.addr.port();
    let before = https(port, &old_ca.pem(), None).connect().await.unwrap();
    begin_over(before.clone(), "rotate-1").await.unwrap();

    let (cert, key) = new_ca.issue("localhost");
    write_file(&dir, "key.pem", &key);
    write_file(&dir, "cert.pem", &cert);
    onced.hang_up();
    eventually(
        Duration::from_secs(20),
        "the new certificate served",
        || async {
            let channel = https(port, &new_ca.pem(), None).connect().await.ok()?;
            begin_over(channel, "rotate-2").await.ok()
        },
    )
    .await;
    // New connections no longer get the old certificate…
    assert!(https(port, &old_ca.pem(), None).connect().await.is_err());
    // …while the connection opened before still works.
    begin_over(before, "rotate-3").await.unwrap();
    let log = std::fs::read_to_string(dir.join("onced.log")).unwrap();
    assert!(log.contains("TLS certificate reloaded"), "{log}");
    let status = onced.terminate().await;
    assert!(status.success(), "{status:?}");
}

/// Connections that open and say nothing, or start a hello and stall, cannot hold the handshake
/// slots: with 256 of them open from eight addresses (every slot, and each address's share), a
/// real client's connection takes the place of the oldest silent one and its call is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_cannot_keep_a_real_call_out_of_the_handshake_slots() {
    use tokio::io::AsyncWriteExt as _;
    let db = TestDb::new(Engine::Sqlite).await;
    let ca = Authority::new("once test CA");
    let (cert, key) = ca.issue("localhost");
    let ledger = TestLedger::spawn_tls(&db, &cert, &key, &ca.pem(), &[]).await;
    let port = ledger.addr.port();
    let open = |hello: bool| async move {
        let mut held = Vec::new();
        for n in 0..256u32 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket
                .bind(format!("127.0.0.{}:0", 2 + n % 8).parse().unwrap())
                .unwrap();
            let mut tcp = socket
                .connect(format!("127.0.0.1:{port}").parse().unwrap())
                .await
                .unwrap();
            if hello {
                // The first byte of a TLS record of a handshake, and nothing after it.
                tcp.write_all(&[0x16]).await.unwrap();
            }
            held.push(tcp);
        }
        held
    };
    for (hello, what) in [(false, "silent"), (true, "stalled in their hello")] {
        let held = open(hello).await;
        let started = std::time::Instant::now();
        // Well before any of them could time out by itself (2 s for a first byte, 10 s for a
        // hello begun): the call gets in because one of them made room, not because they went
        // away.
        let call = async {
            let channel = https(port, &ca.pem(), None).connect().await?;
            begin_over(channel, &format!("beside-{hello}"))
                .await
                .map_err(anyhow::Error::from)
        };
        tokio::time::timeout(Duration::from_millis(1500), call)
            .await
            .unwrap_or_else(|_| panic!("beside 256 connections {what}: no answer in 1.5 s"))
            .unwrap_or_else(|e| panic!("beside 256 connections {what}: {e:?}"));
        eprintln!(
            "connect + Begin beside 256 connections {what}: {:?}",
            started.elapsed()
        );
        drop(held);
    }
    ledger.stop().await;
}

/// Listening beyond loopback without TLS or without credentials is refused unless --insecure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_listener_needs_tls_and_credentials_or_insecure() {
    let db = TestDb::new(Engine::Sqlite).await;
    for (extra, refused) in [(vec![], Some("without TLS")), (vec!["--insecure"], None)] {
        let mut args = vec!["onced", "--database-url", &db.url, "--listen", "0.0.0.0:0"];
        args.extend(extra);
        let config = onced::Config::try_parse_from(args).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let _ = stop.send(());
        let ran = onced::run(config.resolve().unwrap(), listener, async {
            let _ = stopped.await;
        })
        .await;
        match refused {
            Some(why) => {
                let error = format!("{:#}", ran.unwrap_err());
                assert!(
                    error.contains(why) && error.contains("--insecure"),
                    "{error}"
                );
            }
            None => ran.unwrap(),
        }
    }
    // TLS without credentials is refused too.
    let dir = db.scratch_dir();
    let ca = Authority::new("ca");
    let (cert, key) = ca.issue("localhost");
    let cert_file = write_file(&dir, "c.pem", &cert);
    let key_file = write_file(&dir, "k.pem", &key);
    let config = onced::Config::try_parse_from([
        "onced",
        "--database-url",
        &db.url,
        "--listen",
        "0.0.0.0:0",
        "--tls-cert",
        cert_file.to_str().unwrap(),
        "--tls-key",
        key_file.to_str().unwrap(),
    ])
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let error = onced::run(config.resolve().unwrap(), listener, async {})
        .await
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("without credentials"),
        "{error:#}"
    );
}
