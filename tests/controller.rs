//! The reconcile glue against a mocked Kubernetes API that checks each request (method, path,
//! query, body) in order, with the real broker behind it. A missing or extra API call fails the
//! test: the reconcile would wait forever for an answer, and the timeout catches that.

mod common;

use common::*;
use http::{Request, Response, StatusCode};
use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::{Client, client::Body, runtime::controller::Action};
use queueguard::{
    controller::{self, Context, FINALIZER},
    crd::QueuePolicy,
};
use serde_json::{Value, json};
use std::{sync::Arc, time::Duration};
use tower_test::mock::{Handle, SendResponse};

const POLICIES: &str = "/apis/queueguard.io/v1alpha1/namespaces/test/queuepolicies";

struct ApiServer(Handle<Request<Body>, Response<Body>>);

struct Call {
    method: String,
    path: String,
    query: String,
    content_type: String,
    body: Value,
    reply: SendResponse<Response<Body>>,
}

impl Call {
    fn respond(self, status: StatusCode, body: &Value) {
        self.reply.send_response(
            Response::builder().status(status).body(Body::from(serde_json::to_vec(body).unwrap())).unwrap(),
        );
    }
}

impl ApiServer {
    async fn expect(&mut self, method: &str, path: &str) -> Call {
        let (req, reply) = tokio::time::timeout(Duration::from_secs(10), self.0.next_request())
            .await
            .unwrap_or_else(|_| panic!("expected {method} {path}, but no request came"))
            .expect("client still connected");
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        let call = Call {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or_default().to_owned(),
            content_type: parts.headers.get("content-type").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default(),
            body: if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() },
            reply,
        };
        assert_eq!((call.method.as_str(), call.path.as_str()), (method, path), "unexpected request");
        call
    }

    /// The status patch: server-side apply by the one field manager, forced.
    async fn expect_status_patch(&mut self, name: &str) -> (Value, Call) {
        let call = self.expect("PATCH", &format!("{POLICIES}/{name}/status")).await;
        assert_eq!(call.content_type, "application/apply-patch+yaml");
        assert!(call.query.contains("fieldManager=queueguard") && call.query.contains("force=true"), "{}", call.query);
        assert_eq!(call.body["apiVersion"], "queueguard.io/v1alpha1");
        assert_eq!(call.body["kind"], "QueuePolicy");
        (call.body["status"].clone(), call)
    }

    async fn expect_event(&mut self, reason: &str, kind: &str) -> Value {
        let call = self.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
        let event = call.body.clone();
        assert_eq!((event["reason"].as_str(), event["type"].as_str()), (Some(reason), Some(kind)), "{event}");
        assert_eq!(event["regarding"]["kind"], "QueuePolicy");
        call.respond(StatusCode::CREATED, &event);
        event
    }
}

fn harness() -> (Arc<Context>, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    (Arc::new(Context::new(client, &unique("controller"))), ApiServer(handle))
}

fn with_finalizer(mut p: QueuePolicy) -> QueuePolicy {
    p.metadata.finalizers = Some(vec![FINALIZER.into()]);
    p.metadata.uid = Some("8a3c3a52-0000-4000-8000-000000000001".into());
    p
}

fn secret(data: &[(&str, String)]) -> Value {
    let mut s = Secret::default();
    s.metadata.name = Some("rabbitmq".into());
    s.metadata.namespace = Some("test".into());
    s.data = Some(data.iter().map(|(k, v)| (k.to_string(), ByteString(v.clone().into_bytes()))).collect());
    serde_json::to_value(s).unwrap()
}

fn broker_secret() -> Value {
    secret(&[("uri", broker_uri()), ("managementUri", management_base())])
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

async fn run(policy: QueuePolicy, ctx: Arc<Context>) -> Result<Action, controller::Error> {
    tokio::time::timeout(Duration::from_secs(30), controller::reconcile(Arc::new(policy), ctx))
        .await
        .expect("reconcile finished")
}

fn condition<'a>(status: &'a Value, kind: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("{kind} in {status}"))
}

#[tokio::test]
async fn a_new_policy_gets_the_finalizer_before_anything_else() {
    let (ctx, mut api) = harness();
    let p = policy("fresh", "{}");
    let server = tokio::spawn(async move {
        let call = api.expect("PATCH", &format!("{POLICIES}/fresh")).await;
        assert_eq!(call.content_type, "application/json-patch+json");
        let ops = call.body.as_array().unwrap().clone();
        assert!(ops.iter().any(|op| op["op"] == "add" && op["value"] == json!([FINALIZER])), "{ops:?}");
        let mut updated = serde_json::to_value(with_finalizer(policy("fresh", "{}"))).unwrap();
        updated["metadata"]["resourceVersion"] = json!("2");
        call.respond(StatusCode::OK, &updated);
    });
    assert_eq!(run(p, ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
}

#[tokio::test]
async fn an_invalid_spec_is_reported_without_reading_the_secret_and_waits_for_a_change() {
    let (ctx, mut api) = harness();
    let p = with_finalizer(policy("invalid", "{expires: soon}"));
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        let (status, call) = api.expect_status_patch("invalid").await;
        let ready = condition(&status, "Ready");
        assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("False"), Some("InvalidSpec")));
        assert!(ready["message"].as_str().unwrap().starts_with("spec.queue.expires: invalid duration \"soon\""));
        assert_eq!(ready["observedGeneration"], 1);
        assert_eq!(status["observedGeneration"], 1);
        call.respond(StatusCode::OK, &echo.clone());
        api.expect_event("InvalidSpec", "Warning").await;
    });
    assert_eq!(run(p, ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
}

#[tokio::test]
async fn a_missing_secret_is_a_condition_and_a_retry() {
    let (ctx, mut api) = harness();
    let p = with_finalizer(policy("nosecret", "{}"));
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq")
            .await
            .respond(StatusCode::NOT_FOUND, &not_found());
        let (status, call) = api.expect_status_patch("nosecret").await;
        let ready = condition(&status, "QueueDeclared");
        assert_eq!(ready["reason"], "SecretNotFound");
        assert_eq!(ready["message"], "Secret 'test/rabbitmq' not found");
        call.respond(StatusCode::OK, &echo.clone());
        api.expect_event("SecretNotFound", "Warning").await;
    });
    assert_eq!(run(p, ctx).await.unwrap(), Action::requeue(queueguard::reconcile::SECRET_RETRY));
    server.await.unwrap();
}

#[tokio::test]
async fn a_good_policy_is_declared_reported_ready_and_left_alone_when_nothing_changed() {
    let (ctx, mut api) = harness();
    let name = unique("ctrl-ready");
    let p = with_finalizer(policy(&name, "{expires: 30m}"));
    // Declared once and its statistics published, so both passes below observe the same counts.
    let plan = plan_of(&p);
    let pool = queueguard::broker::BrokerPool::new(unique("conn"));
    assert!(
        queueguard::converge::converge(&plan, &broker(&pool, &plan), &[], queueguard::converge::Mode::Declare)
            .await
            .is_ready()
    );
    let stats = eventually(Duration::from_secs(15), || async {
        mgmt_get(&format!("queues/%2F/{}", enc(&name)))
            .await
            .is_some_and(|q| q.get("messages_unacknowledged").is_some())
    });
    assert!(stats.await);
    let (n, c) = (name.clone(), ctx.clone());
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let (status, call) = api.expect_status_patch(&n).await;
        let ready = condition(&status, "Ready");
        assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("True"), Some("Reconciled")));
        assert_eq!(status["queue"]["name"], json!(n));
        assert_eq!(status["brokerPolicy"], json!(format!("queueguard.test.{n}")));
        let text = status.to_string();
        assert!(!text.contains("guest:guest"), "no credentials in status");
        call.respond(StatusCode::OK, &echo.clone());
        let declared = api.expect_event("Declared", "Normal").await;
        assert_eq!(declared["action"], "DeclareQueue");
        let dead_letter = api.expect_event("Declared", "Normal").await;
        assert_eq!(dead_letter["action"], "DeclareDeadLetter");
        api.expect_event("PolicyApplied", "Normal").await;
        (api, status)
    });
    let action = run(p.clone(), c).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(300)));
    let (mut api, status) = server.await.unwrap();

    // Second pass with that status in place: only the Secret is read; no patch, no Events.
    let mut p2 = p.clone();
    p2.status = Some(serde_json::from_value(status).unwrap());
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        if let Ok(Some((req, _))) = tokio::time::timeout(Duration::from_secs(2), api.0.next_request()).await {
            let body = req.into_body().collect_bytes().await.unwrap();
            panic!("an unchanged status is not patched, got {}", String::from_utf8_lossy(&body));
        }
    });
    run(p2, ctx).await.unwrap();
    server.await.unwrap();
    remove_all(&plan_of(&p)).await;
}

#[tokio::test]
async fn deleting_with_retain_leaves_the_queue_and_releases_the_finalizer() {
    let (ctx, mut api) = harness();
    let name = unique("ctrl-retain");
    let mut p = with_finalizer(policy(&name, "{}"));
    p.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
    let n = name.clone();
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        let event = api.expect_event("QueueRetained", "Normal").await;
        assert!(event["note"].as_str().unwrap().contains(&n));
        let call = api.expect("PATCH", &format!("{POLICIES}/{n}")).await;
        assert!(call.body.as_array().unwrap().iter().any(|op| op["op"] == "remove"), "{}", call.body);
        call.respond(StatusCode::OK, &echo.clone());
    });
    assert_eq!(run(p, ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
}

#[tokio::test]
async fn deleting_with_delete_is_blocked_by_messages_then_completes_once_empty() {
    let name = unique("ctrl-delete");
    let base = policy_doc(&name, "queue: {}\n  deletionPolicy: Delete");
    let plan = plan_of(&base);
    let pool = queueguard::broker::BrokerPool::new(unique("conn"));
    assert!(
        queueguard::converge::converge(&plan, &broker(&pool, &plan), &[], queueguard::converge::Mode::Declare)
            .await
            .is_ready()
    );
    publish(&name, ["still here".to_string()]).await;
    let mut p = with_finalizer(base);
    p.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));

    let (ctx, mut api) = harness();
    let n = name.clone();
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let (status, call) = api.expect_status_patch(&n).await;
        let ready = condition(&status, "Ready");
        assert_eq!(ready["reason"], "DeletionBlocked");
        assert!(ready["message"].as_str().unwrap().contains("1 ready messages, 0 consumers"), "{ready}");
        call.respond(StatusCode::OK, &echo.clone());
        api.expect_event("DeletionBlocked", "Warning").await;
    });
    let err = run(p.clone(), ctx.clone()).await.unwrap_err();
    assert!(err.to_string().contains("deletion blocked") || format!("{err:?}").contains("DeletionBlocked"), "{err:?}");
    server.await.unwrap();
    assert_eq!(counts(&name).await, Some((1, 0)), "the message is still there");

    let (_c, ch) = app().await;
    ch.basic_get(name.as_str().into(), lapin::options::BasicGetOptions { no_ack: true }).await.unwrap().unwrap();
    let (ctx, mut api) = harness();
    let n = name.clone();
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        api.expect_event("QueueDeleted", "Normal").await;
        api.expect("PATCH", &format!("{POLICIES}/{n}")).await.respond(StatusCode::OK, &echo.clone());
    });
    assert_eq!(run(p, ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
    assert!(!exists(&name).await);
}
