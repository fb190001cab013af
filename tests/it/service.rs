//! What any gRPC tool sees: health, reflection, listing, and a clean shutdown.

use once_api::pb;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::ServerReflectionRequest;

use crate::support::*;

on_both_backends!(list_operations_filters_and_pages);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() {
    let db = TestDb::new(Store::Sqlite).await;
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

async fn list_operations_filters_and_pages(store: Store) {
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
