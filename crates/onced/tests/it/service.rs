//! What any gRPC tool sees: health, reflection, listing, and a clean shutdown.

use once_api::pb;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::ServerReflectionRequest;

use crate::support::*;

on_both_backends!(
    list_operations_filters_and_pages,
    list_pages_carry_no_results,
    undecodable_and_oversized_requests_are_the_callers_errors,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() {
    let db = TestDb::new(Engine::Sqlite).await;
    let ledger = TestLedger::spawn(&db).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", ledger.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "once.ledger.v1.Ledger".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("expected a service list, got {reply:?}");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for expected in ["once.ledger.v1.Ledger", "grpc.health.v1.Health"] {
        assert!(names.contains(&expected), "{names:?}");
    }
    ledger.stop().await;
}

async fn list_operations_filters_and_pages(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    for i in 0..7 {
        let id = format!("list-{i}");
        let mut request = begin(&id, ARGS);
        if i >= 5 {
            request.tool = "send_email".into();
        }
        let grant = claim(&mut client, request).await;
        if i % 2 == 0 {
            report_unknown(&mut client, &id, grant.fencing_token)
                .await
                .unwrap();
        }
    }
    let unknown = pb::OperationState::Unknown as i32;
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_operations(pb::ListOperationsRequest {
                states: vec![unknown],
                tool: "issue_refund".into(),
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.operations.len() <= 2);
        seen.extend(page.operations.into_iter().map(|op| {
            assert_eq!((op.state, op.tool.as_str()), (unknown, "issue_refund"));
            op.operation_id
        }));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen, ["list-0", "list-2", "list-4"]);

    let everything = client
        .list_operations(pb::ListOperationsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(everything.operations.len(), 7);
    let old = client
        .list_operations(pb::ListOperationsRequest {
            older_than: Some(ms(3_600_000)),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(old.operations.is_empty(), "nothing is an hour old yet");
    ledger.stop().await;
}

async fn list_pages_carry_no_results(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let result = vec![b'r'; 64 * 1024];
    let grant = claim(&mut client, begin("listed-result", ARGS)).await;
    confirm(&mut client, "listed-result", grant.fencing_token, &result)
        .await
        .unwrap();
    let page = client
        .list_operations(pb::ListOperationsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let listed = &page.operations[0];
    assert_eq!(
        (listed.state, listed.provider_ref.as_str()),
        (pb::OperationState::Confirmed as i32, "re_1")
    );
    assert!(listed.result.is_empty(), "a page carries no results");
    let got = get(&mut client, "listed-result").await.operation.unwrap();
    assert_eq!(got.result, result, "GetOperation does");
    ledger.stop().await;
}

/// A Begin as raw fields, to send what no generated client can: a `tool` that is not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawBegin {
    #[prost(bytes = "vec", tag = "1")]
    tool: Vec<u8>,
    #[prost(string, tag = "2")]
    operation_id: String,
}

async fn raw_begin(ledger: &TestLedger, message: RawBegin) -> tonic::Status {
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", ledger.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/once.ledger.v1.Ledger/Begin");
    let codec = tonic_prost::ProstCodec::<RawBegin, pb::BeginResponse>::default();
    grpc.unary(tonic::Request::new(message), path, codec)
        .await
        .expect_err("refused")
}

async fn undecodable_and_oversized_requests_are_the_callers_errors(store: Engine) {
    let db = TestDb::new(store).await;
    let ledger = TestLedger::spawn(&db).await;
    let mut client = ledger.client().await;

    let undecodable = raw_begin(
        &ledger,
        RawBegin {
            tool: vec![b'r', 0xff, 0xfe, b'f'],
            operation_id: "raw-1".into(),
        },
    )
    .await;
    assert_eq!(
        undecodable.code(),
        tonic::Code::InvalidArgument,
        "{undecodable:?}"
    );
    assert_eq!(reason(&undecodable), "MALFORMED_REQUEST");
    assert!(undecodable.message().contains("tool"), "{undecodable:?}");

    let mut huge = begin("huge-1", ARGS);
    huge.effect = Some(pb::begin_request::Effect::ArgumentsJson(format!(
        r#"{{"blob":"{}"}}"#,
        "x".repeat(2 * 1024 * 1024)
    )));
    let refused = client.begin(huge).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert_eq!(reason(&refused), "REQUEST_TOO_LARGE");

    // A list of four million states (4 MB) is refused before it is decoded; one that fits in
    // a request is refused naming the field.
    let refused = client
        .list_operations(pb::ListOperationsRequest {
            states: vec![4; 4_000_000],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    let refused = client
        .list_operations(pb::ListOperationsRequest {
            states: vec![4; 500_000],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        (refused.code(), field(&refused).as_str()),
        (tonic::Code::InvalidArgument, "states")
    );

    assert_eq!(db.snapshot().await, [0, 0, 0], "nothing was written");
    wait_serving(ledger.addr).await;
    ledger.stop().await;
}
