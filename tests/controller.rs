//! The reconcile glue against a mocked Kubernetes API that checks each request (method, path,
//! query, body) in order, with the real broker behind it. A missing or extra API call fails the
//! test: the reconcile would wait forever for an answer, and the timeout catches that.

mod common;

use common::{api::*, gate::*, *};
use http::StatusCode;
use k8s_openapi::{
    ByteString,
    api::{
        apps::v1::Deployment,
        core::v1::{Pod, Secret},
        policy::v1::PodDisruptionBudget,
    },
};
use kube::runtime::controller::Action;
use queueguard::{
    controller::{self, Context, FINALIZER, gate_io::QueueWatch},
    crd::QueuePolicy,
    gate::index::ObjectKey,
    pattern::crd::QueuePattern,
};
use serde_json::{Value, json};
use std::{sync::Arc, time::Duration};

const POLICIES: &str = "/apis/queueguard.io/v1alpha1/namespaces/test/queuepolicies";

trait PolicyCalls {
    async fn expect_status_patch(&mut self, name: &str) -> (Value, Call);
    async fn expect_event(&mut self, reason: &str, kind: &str) -> Value;
}

impl PolicyCalls for ApiServer {
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
    let (client, api) = mock_client();
    (Arc::new(Context::new(client, &unique("controller"))), api)
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
    assert_eq!(run(p, ctx).await.unwrap(), Action::requeue(queueguard::pass::SECRET_RETRY));
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
    assert_eq!(
        action,
        Action::requeue(controller::FINDINGS_EVERY),
        "the findings look again before the lease needs renewing"
    );
    let (mut api, status) = server.await.unwrap();

    // Second pass with that status in place: nothing is read (the Secret read of the first pass
    // still serves), no patch, no Events.
    let mut p2 = p.clone();
    p2.status = Some(serde_json::from_value(status).unwrap());
    let server = tokio::spawn(async move {
        if let Ok(Some((req, _))) = tokio::time::timeout(Duration::from_secs(2), api.0.next_request()).await {
            let (parts, body) = req.into_parts();
            let body = body.collect_bytes().await.unwrap();
            panic!(
                "the second pass sends nothing, got {} {} {}",
                parts.method,
                parts.uri,
                String::from_utf8_lossy(&body)
            );
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
    assert_eq!(run(p, ctx.clone()).await.unwrap(), Action::await_change());
    server.await.unwrap();
    let metrics = ctx.shared.metrics.render();
    assert!(!metrics.contains(&name), "a deleted policy leaves no series behind:\n{metrics}");
}

/// A Delete policy sharing its dead-letter exchange and queue with another policy (as the
/// controllers' caches hold them) deletes its own queue and leaves both shared ones.
#[tokio::test]
async fn deleting_with_delete_leaves_what_another_policy_names() {
    let (dlx, dead) = (unique("ctrl-shared-dlx"), unique("ctrl-shared-dead"));
    let shared = format!("queue: {{deadLetter: {{exchange: {dlx}, queue: {dead}}}}}\n  deletionPolicy: Delete");
    let (name, other) = (unique("ctrl-share-a"), unique("ctrl-share-b"));
    let mut p = with_finalizer(policy_doc(&name, &shared));
    let b = policy_doc(&other, &shared);
    let pool = queueguard::broker::BrokerPool::new(unique("conn"));
    for plan in [plan_of(&p), plan_of(&b)] {
        assert!(
            queueguard::converge::converge(&plan, &broker(&pool, &plan), &[], queueguard::converge::Mode::Declare)
                .await
                .is_ready()
        );
    }
    p.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));

    let (ctx, mut api) = harness();
    let (policies, mut policy_writer) = kube::runtime::reflector::store();
    let (patterns, mut pattern_writer) = kube::runtime::reflector::store::<QueuePattern>();
    ctx.know_others(controller::Others { policies, patterns });
    use kube::runtime::watcher::Event;
    for event in [Event::Init, Event::InitApply(p.clone()), Event::InitApply(b.clone()), Event::InitDone] {
        policy_writer.apply_watcher_event(&event);
    }
    pattern_writer.apply_watcher_event(&Event::Init);
    pattern_writer.apply_watcher_event(&Event::InitDone);

    let n = name.clone();
    let (kept, by) = (format!("kept dead-letter queue '{dead}'"), format!("QueuePolicy test/{other}"));
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let event = api.expect_event("QueueDeleted", "Normal").await;
        let note = event["note"].as_str().unwrap();
        assert!(note.contains(&kept) && note.contains(&by), "{note}");
        api.expect("PATCH", &format!("{POLICIES}/{n}")).await.respond(StatusCode::OK, &echo.clone());
    });
    assert_eq!(run(p.clone(), ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
    assert!(!exists(&name).await, "its own queue is gone");
    assert!(exists(&dead).await, "the shared dead-letter queue stays");
    remove_all(&plan_of(&b)).await;
    remove_all(&plan_of(&p)).await;
}

/// A Delete policy whose spec turned invalid after its queue was declared keeps its finalizer
/// (the queue stays, and so does the policy) and says why; one never declared lets go.
#[tokio::test]
async fn deleting_with_delete_and_an_invalid_spec_keeps_a_declared_queue_and_the_finalizer() {
    let name = unique("ctrl-invalid-delete");
    let mut p = with_finalizer(policy_doc(&name, "queue: {expires: 1s}\n  deletionPolicy: Delete"));
    p.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
    p.status =
        Some(serde_json::from_value(json!({"queue": {"name": name, "vhost": "/", "messagesReady": 3}})).unwrap());
    let (ctx, mut api) = harness();
    let n = name.clone();
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        let (status, call) = api.expect_status_patch(&n).await;
        let ready = condition(&status, "Ready");
        assert_eq!(ready["reason"], "DeletionBlocked");
        let message = ready["message"].as_str().unwrap();
        assert!(message.contains("spec.queue.expires") && message.contains("deletionPolicy: Retain"), "{message}");
        call.respond(StatusCode::OK, &echo);
        api.expect_event("DeletionBlocked", "Warning").await;
        api
    });
    let err = run(p.clone(), ctx).await.unwrap_err();
    assert!(matches!(err, controller::Error::DeletionBlocked(_)), "{err:?}");
    let mut api = server.await.unwrap();
    expect_silence(&mut api, Duration::from_millis(300)).await;

    // Never declared: nothing on the broker is its, and the finalizer goes.
    p.status = None;
    let (ctx, mut api) = harness();
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        let call = api.expect("PATCH", &format!("{POLICIES}/{name}")).await;
        assert!(call.body.as_array().unwrap().iter().any(|op| op["op"] == "remove"), "{}", call.body);
        call.respond(StatusCode::OK, &echo);
    });
    assert_eq!(run(p, ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
}

#[tokio::test]
async fn deleting_with_delete_is_blocked_by_messages_then_completes_once_empty() {
    deletion_waits_for_an_empty_queue("classic").await;
}

/// Quorum queues refuse the delete flags the classic path relies on; the finalizer completes
/// all the same, and only once the queue is empty.
#[tokio::test]
async fn a_quorum_queue_is_deleted_by_the_finalizer_once_empty() {
    deletion_waits_for_an_empty_queue("quorum").await;
}

async fn deletion_waits_for_an_empty_queue(queue_type: &str) {
    let name = unique(&format!("ctrl-delete-{queue_type}"));
    let base = policy_doc(&name, &format!("queue: {{type: {queue_type}}}\n  deletionPolicy: Delete"));
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
        assert!(ready["message"].as_str().unwrap().contains("1 ready messages"), "{ready}");
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

/// Nothing reaches the API for `quiet`.
async fn expect_silence(api: &mut ApiServer, quiet: Duration) {
    if let Ok(Some((req, _))) = tokio::time::timeout(quiet, api.0.next_request()).await {
        let (parts, body) = req.into_parts();
        let body = body.collect_bytes().await.unwrap();
        panic!("expected no request, got {} {} {}", parts.method, parts.uri, String::from_utf8_lossy(&body));
    }
}

async fn named(connection: &str) -> (lapin::Connection, lapin::Channel) {
    let props = lapin::ConnectionProperties::default().with_connection_name(connection.into());
    let conn = lapin::Connection::connect(&broker_uri(), props).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

async fn live_tracker(ctx: &Context) -> Arc<queueguard::consumers::ConsumerTracker> {
    let uri = queueguard::broker::uri::BrokerUri::parse(&broker_uri(), Some(&management_base())).unwrap();
    let tracker = ctx.trackers.tracker(&uri, None).unwrap();
    assert!(tracker.wait_synced("/", Duration::from_secs(10)).await);
    assert!(
        eventually(Duration::from_secs(5), || async {
            tracker.tracking("/") == queueguard::consumers::Tracking::Events
        })
        .await
    );
    tracker
}

/// The gate's binding of a policy on `queue` (dead-lettering into `<queue>.dlq`).
fn watch(tracker: &Arc<queueguard::consumers::ConsumerTracker>, queue: &queueguard::consumers::QueueKey) -> QueueWatch {
    let dead_letter_queue = queueguard::consumers::QueueKey::new(&queue.vhost, format!("{}.dlq", queue.name));
    QueueWatch { tracker: tracker.clone(), queue: queue.clone(), dead_letter_queue }
}

async fn declared(p: &QueuePolicy) -> queueguard::plan::QueuePlan {
    let plan = plan_of(p);
    let pool = queueguard::broker::BrokerPool::new(unique("conn"));
    assert!(
        queueguard::converge::converge(&plan, &broker(&pool, &plan), &[], queueguard::converge::Mode::Declare)
            .await
            .is_ready()
    );
    plan
}

/// The gate's writes, exactly: once the watches have synced, the one writer tells the new pod
/// why it waits, applies the Deployment's safe strategy and its one PDB (server-side apply under
/// the operator's field manager); bound to its queue, it opens the pod's condition as soon as the
/// consumer is seen and tells the pod in an Event. The policy's reconcile reads everything from
/// the watches (no GET or LIST) and writes only status and Events.
#[tokio::test]
async fn the_gate_opens_a_pods_condition_when_its_consumer_attaches_and_closes_it_when_it_leaves() {
    let name = unique("ctrl-gate");
    let p = with_finalizer(policy_doc(&name, "queue: {}\n  consumers: {deployment: worker, minAttachedSeconds: 0}"));
    let (ctx, mut api) = harness();
    let tracker = live_tracker(&ctx).await;
    let plan = declared(&p).await;
    let key = queueguard::consumers::QueueKey::new("/", &name);
    let _interest = tracker.watch(key.clone());
    let (conn, ch) = app().await;
    ch.basic_qos(10, Default::default()).await.unwrap();
    let consumer = ch
        .basic_consume(name.as_str().into(), "worker-ctag".into(), Default::default(), Default::default())
        .await
        .unwrap();
    assert!(eventually(Duration::from_secs(3), || async { tracker.consumers_on(&key).len() == 1 }).await);
    watched(&ctx, &[&p], &[worker_deployment(json!({"type": "Recreate"}))], &[worker_pod(None)], &[]);

    // Synced, not bound yet: the pod says why it waits; the Deployment and its budget are made safe.
    let first = expect_first_condition(&mut api, "WaitingForQueues").await;
    assert!(first["message"].as_str().unwrap().contains("not reconciled yet"), "{first}");
    let strategy = api.expect("PATCH", "/apis/apps/v1/namespaces/test/deployments/worker").await;
    assert_eq!(strategy.content_type, "application/apply-patch+yaml");
    assert!(strategy.query.contains("fieldManager=queueguard") && strategy.query.contains("force=true"));
    assert_eq!(
        strategy.body,
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "worker", "namespace": "test"},
               "spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}}}),
        "the strategy's fields and nothing else"
    );
    strategy.respond(StatusCode::OK, &worker_deployment(json!({"type": "RollingUpdate"})));
    let writes = expect_unordered(
        &mut api,
        &[
            ("PATCH", "/apis/policy/v1/namespaces/test/poddisruptionbudgets/worker-queueguard"),
            ("POST", "/apis/events.k8s.io/v1/namespaces/test/events"),
        ],
    )
    .await;
    let (pdb_call, pdb) = writes.iter().find(|(c, _)| c.starts_with("PATCH")).unwrap();
    assert!(pdb_call.contains("fieldManager=queueguard") && pdb_call.contains("application/apply-patch+yaml"));
    // One replica: minAvailable 1 would block every drain of its node for good (pdb::drainable).
    assert_eq!(pdb["spec"], json!({"minAvailable": 0, "selector": {"matchLabels": {"app": "worker"}}}));
    assert_eq!(pdb["metadata"]["labels"]["queueguard.io/deployment"], "worker");
    let owner = &pdb["metadata"]["ownerReferences"][0];
    assert_eq!((owner["kind"].as_str(), owner["name"].as_str()), (Some("QueuePolicy"), Some(name.as_str())));
    let (_, event) = writes.iter().find(|(c, _)| c.starts_with("POST")).unwrap();
    assert_eq!(
        (event["reason"].as_str(), event["regarding"]["kind"].as_str()),
        (Some("StrategyPatched"), Some("QueuePolicy"))
    );
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("False"))).unwrap()));

    // Bound to its queue (what the reconcile does first), the pod's consumer is seen at once.
    ctx.gate.bind(&ObjectKey::of(&p), Ok(watch(&tracker, &key)));
    let written = expect_pod_condition(&mut api, "True", "ConsumerAttached").await;
    assert!(written["message"].as_str().unwrap().contains("worker-ctag"), "{written}");
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("True"))).unwrap()));

    let echo = serde_json::to_value(&p).unwrap();
    let n = name.clone();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let (status, call) = api.expect_status_patch(&n).await;
        assert_eq!(status["consumers"]["attached"], 1);
        assert_eq!(status["consumers"]["expected"], 1);
        assert_eq!(status["consumers"]["tracking"], "Events");
        assert_eq!(status["consumers"]["pods"][0]["gate"], "Open");
        assert_eq!(status["rollout"]["phase"], "Idle");
        assert_eq!(
            status["disruptionBudgets"],
            json!([{"kind": "Deployment", "workload": "worker", "name": "worker-queueguard", "owner": "Managed", "minAvailable": 0}])
        );
        assert_eq!(condition(&status, "ConsumersAttached")["reason"], "Attached");
        assert_eq!(condition(&status, "RolloutSafe")["reason"], "RolloutGuarded");
        assert_eq!(condition(&status, "Ready")["status"], "True");
        call.respond(StatusCode::OK, &echo);
        for (reason, kind) in [
            ("Declared", "Normal"),
            ("Declared", "Normal"),
            ("PolicyApplied", "Normal"),
            ("Attached", "Normal"),
            ("RolloutGuarded", "Normal"),
        ] {
            api.expect_event(reason, kind).await;
        }
        (api, status)
    });
    run(p.clone(), ctx.clone()).await.unwrap();
    let (mut api, status) = server.await.unwrap();
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<PodDisruptionBudget>(pdb.clone()).unwrap()));
    ctx.gate.on(&kube::runtime::watcher::Event::Apply(
        serde_json::from_value::<Deployment>(worker_deployment(
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}),
        ))
        .unwrap(),
    ));

    // The consumer leaves: the writer closes the gate at once, no reconcile needed.
    drop(consumer);
    ch.basic_cancel("worker-ctag".into(), Default::default()).await.unwrap();
    expect_pod_condition(&mut api, "False", "WaitingForConsumer").await;
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("False"))).unwrap()));

    // The next pass reports it, without re-declaring the queue or touching the PDB again.
    let mut p2 = p.clone();
    p2.status = Some(serde_json::from_value(status).unwrap());
    let echo = serde_json::to_value(&p2).unwrap();
    let n = name.clone();
    let server = tokio::spawn(async move {
        // The first pass's Secret read still serves (controller::secrets).
        let (status, call) = api.expect_status_patch(&n).await;
        assert_eq!(status["consumers"]["attached"], 0);
        assert_eq!(condition(&status, "ConsumersAttached")["reason"], "TooFewAttached");
        assert_eq!(condition(&status, "RolloutSafe")["reason"], "RolloutGuarded");
        assert_eq!(status["rollout"]["phase"], "WaitingForAttach");
        assert_eq!(status["rollout"]["waitingPods"][0]["waitingFor"], json!([n]));
        call.respond(StatusCode::OK, &echo);
        api.expect_event("TooFewAttached", "Warning").await;
        api
    });
    run(p2, ctx).await.unwrap();
    let mut api = server.await.unwrap();
    expect_silence(&mut api, Duration::from_millis(500)).await;
    let _ = conn.close(200, "bye".into()).await;
    remove_all(&plan).await;
}

/// A worker reading two queues, each guarded by its own policy: its unsafe strategy and its
/// budget are written once for both; its first condition says why it waits; attached to one
/// queue, its condition is not written again (not one flip while both policies and the
/// consumers change); attached to both, it is written True once.
#[tokio::test]
async fn two_policies_on_one_worker_make_one_verdict_written_once() {
    let (ctx, mut api) = harness();
    let tracker = live_tracker(&ctx).await;
    let (orders, events) = (unique("ctrl-two-a"), unique("ctrl-two-b"));
    // Every client here connects from 127.0.0.1: the pod is told by its connection name.
    let consumers = "consumers: {deployment: worker, minAttachedSeconds: 0, matchBy: ConnectionName}";
    let pa = with_finalizer(policy_doc(&orders, &format!("queue: {{}}\n  {consumers}")));
    let mut pb = with_finalizer(policy_doc(&events, &format!("queue: {{}}\n  {consumers}")));
    pb.metadata.uid = Some("8a3c3a52-0000-4000-8000-000000000002".into());
    let (plan_a, plan_b) = (declared(&pa).await, declared(&pb).await);
    watched(
        &ctx,
        &[&pa, &pb],
        &[worker_deployment(json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}))],
        &[worker_pod(None)],
        &[],
    );
    let first = expect_first_condition(&mut api, "WaitingForQueues").await;
    let message = first["message"].as_str().unwrap();
    assert!(message.contains(&orders) && message.contains(&events), "both policies named: {message}");
    // One strategy write and one budget for two policies, and an Event on each policy.
    let writes = expect_unordered(
        &mut api,
        &[
            ("PATCH", "/apis/apps/v1/namespaces/test/deployments/worker"),
            ("PATCH", "/apis/policy/v1/namespaces/test/poddisruptionbudgets/worker-queueguard"),
            ("POST", "/apis/events.k8s.io/v1/namespaces/test/events"),
            ("POST", "/apis/events.k8s.io/v1/namespaces/test/events"),
        ],
    )
    .await;
    let (_, pdb) = writes.iter().find(|(c, _)| c.contains("poddisruptionbudgets")).unwrap();
    assert_eq!(pdb["metadata"]["ownerReferences"].as_array().unwrap().len(), 2, "owned by both policies");
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("False"))).unwrap()));
    let (ka, kb) =
        (queueguard::consumers::QueueKey::new("/", &orders), queueguard::consumers::QueueKey::new("/", &events));
    ctx.gate.bind(&ObjectKey::of(&pa), Ok(watch(&tracker, &ka)));
    ctx.gate.bind(&ObjectKey::of(&pb), Ok(watch(&tracker, &kb)));

    let (conn, ch) = named("test/worker-abc-1").await;
    let _a =
        ch.basic_consume(orders.as_str().into(), "w-a".into(), Default::default(), Default::default()).await.unwrap();
    assert!(eventually(Duration::from_secs(3), || async { tracker.consumers_on(&ka).len() == 1 }).await);
    // Churn on the other queue and pod updates: each wakes both policies' votes.
    for i in 0..5 {
        let tag = format!("other-{i}");
        let (_c2, ch2) = named("someone-else").await; // another client: not the pod's
        let c = ch2
            .basic_consume(events.as_str().into(), tag.as_str().into(), Default::default(), Default::default())
            .await
            .unwrap();
        drop(c);
        ch2.basic_cancel(tag.as_str().into(), Default::default()).await.unwrap();
        ctx.gate.on(&kube::runtime::watcher::Event::Apply(
            serde_json::from_value::<Pod>(worker_pod(Some("False"))).unwrap(),
        ));
    }
    expect_silence(&mut api, Duration::from_millis(1500)).await;
    let view = ctx.gate.view(&ObjectKey::of(&pa)).unwrap();
    assert_eq!(view.pods[0].waiting_for, std::slice::from_ref(&events));

    let _b =
        ch.basic_consume(events.as_str().into(), "w-b".into(), Default::default(), Default::default()).await.unwrap();
    let written = expect_pod_condition(&mut api, "True", "ConsumerAttached").await;
    let message = written["message"].as_str().unwrap();
    assert!(message.contains(&orders) && message.contains(&events), "{message}");
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("True"))).unwrap()));
    expect_silence(&mut api, Duration::from_millis(500)).await;
    let _ = conn.close(200, "bye".into()).await;
    remove_all(&plan_a).await;
    remove_all(&plan_b).await;
}

/// Every kind through the one writer: a StatefulSet gets its budget and never a strategy patch
/// (no strategy closes its gap); a canary Rollout that may take every pod down at once gets its
/// canary made safe by a server-side apply of those two fields, and its budget; each new pod
/// says why it waits.
#[tokio::test]
async fn a_statefulset_gets_its_budget_and_no_strategy_patch_and_a_rollout_its_canary_made_safe() {
    use k8s_openapi::api::apps::v1::{ReplicaSet, StatefulSet};
    use kube::{api::PartialObjectMeta, runtime::watcher::Event};
    use queueguard::workload::rollout::Rollout;
    let (ctx, mut api) = harness();
    let shards =
        with_finalizer(policy_doc("shards", "queue: {}\n  consumers: {workload: {kind: StatefulSet, name: shard}}"));
    let mut canaries =
        with_finalizer(policy_doc("canaries", "queue: {}\n  consumers: {workload: {kind: Rollout, name: canary}}"));
    canaries.metadata.uid = Some("8a3c3a52-0000-4000-8000-000000000002".into());
    let template = |app: &str| {
        json!({"metadata": {"labels": {"app": app}}, "spec": {"containers": [{"name": "w", "image": "w"}],
               "readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}]}})
    };
    let shard: StatefulSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "shard", "namespace": "test"},
        "spec": {"replicas": 2, "serviceName": "shard", "selector": {"matchLabels": {"app": "shard"}}, "template": template("shard")},
    }))
    .unwrap();
    let canary: Rollout = serde_json::from_value(json!({
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "canary", "namespace": "test"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "canary"}}, "template": template("canary"),
                 "strategy": {"canary": {"maxUnavailable": "100%", "maxSurge": 1}}},
    }))
    .unwrap();
    let replica_set: PartialObjectMeta<ReplicaSet> = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "canary-6f7", "namespace": "test",
                     "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "canary", "uid": "r", "controller": true}]},
    }))
    .unwrap();
    let pod = |name: &str, owner: Value| -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "test", "uid": format!("uid-{name}"), "ownerReferences": [owner]},
            "spec": {"containers": [{"name": "w", "image": "w"}], "readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}]},
            "status": {"podIP": "10.1.1.1", "phase": "Running"},
        }))
        .unwrap()
    };
    let gate = &ctx.gate;
    gate.on(&Event::<QueuePolicy>::Init);
    gate.on(&Event::InitApply(shards));
    gate.on(&Event::InitApply(canaries));
    gate.on(&Event::<QueuePolicy>::InitDone);
    gate.on(&Event::<Deployment>::Init);
    gate.on(&Event::<Deployment>::InitDone);
    gate.on(&Event::<StatefulSet>::Init);
    gate.on(&Event::InitApply(shard));
    gate.on(&Event::<StatefulSet>::InitDone);
    gate.on(&Event::<Rollout>::Init);
    gate.on(&Event::InitApply(canary));
    gate.on(&Event::<Rollout>::InitDone);
    gate.on(&Event::<PartialObjectMeta<ReplicaSet>>::Init);
    gate.on(&Event::InitApply(replica_set));
    gate.on(&Event::<PartialObjectMeta<ReplicaSet>>::InitDone);
    gate.on(&Event::<PodDisruptionBudget>::Init);
    gate.on(&Event::<PodDisruptionBudget>::InitDone);
    gate.on(&Event::<Pod>::Init);
    gate.on(&Event::InitApply(pod(
        "shard-0",
        json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "shard", "uid": "s", "controller": true}),
    )));
    gate.on(&Event::InitApply(pod(
        "canary-6f7-x",
        json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "canary-6f7", "uid": "rs", "controller": true}),
    )));
    gate.on(&Event::<Pod>::InitDone);

    let writes = expect_unordered(
        &mut api,
        &[
            ("PATCH", "/api/v1/namespaces/test/pods/shard-0/status"),
            ("PATCH", "/api/v1/namespaces/test/pods/canary-6f7-x/status"),
            ("PATCH", "/apis/policy/v1/namespaces/test/poddisruptionbudgets/shard-statefulset-queueguard"),
            ("PATCH", "/apis/argoproj.io/v1alpha1/namespaces/test/rollouts/canary"),
            ("PATCH", "/apis/policy/v1/namespaces/test/poddisruptionbudgets/canary-rollout-queueguard"),
            ("POST", "/apis/events.k8s.io/v1/namespaces/test/events"),
        ],
    )
    .await;
    let body = |path: &str| writes.iter().find(|(c, _)| c.contains(path)).map(|(c, b)| (c.clone(), b.clone())).unwrap();
    for pod in ["shard-0", "canary-6f7-x"] {
        let (_, patch) = body(&format!("pods/{pod}/status"));
        let condition = &patch["status"]["conditions"][0];
        assert_eq!(
            (condition["status"].as_str(), condition["reason"].as_str()),
            (Some("False"), Some("WaitingForQueues"))
        );
    }
    let (call, fix) = body("rollouts/canary");
    assert!(call.contains("fieldManager=queueguard") && call.contains("application/apply-patch+yaml"), "{call}");
    assert_eq!(
        fix,
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "canary", "namespace": "test"},
               "spec": {"strategy": {"canary": {"maxUnavailable": 0, "maxSurge": 1}}}})
    );
    let (_, shard_budget) = body("shard-statefulset-queueguard");
    assert_eq!(shard_budget["metadata"]["labels"]["queueguard.io/statefulset"], "shard");
    assert_eq!(shard_budget["spec"], json!({"minAvailable": 1, "selector": {"matchLabels": {"app": "shard"}}}));
    let (_, canary_budget) = body("canary-rollout-queueguard");
    assert_eq!(canary_budget["metadata"]["labels"]["queueguard.io/rollout"], "canary");
    assert_eq!(canary_budget["spec"]["minAvailable"], 1);
    let (_, event) = body("events");
    assert_eq!(event["reason"], "StrategyPatched");
    assert!(event["note"].as_str().unwrap().starts_with("Rollout 'canary': canary:"), "{event}");
    assert_eq!(ctx.gate.read(|i| i.guarding("uid-canary-6f7-x")), [ObjectKey::new("test", "canaries")]);
    expect_silence(&mut api, Duration::from_millis(500)).await;
}

/// A PodDisruptionBudget of someone else's already selects the worker's pods: the operator
/// creates none (the eviction API would refuse every pod covered by two) and says so.
#[tokio::test]
async fn no_budget_is_created_beside_anothers_and_status_says_whose_it_is() {
    let name = unique("ctrl-pdb");
    let p = with_finalizer(policy_doc(&name, "queue: {}\n  consumers: {deployment: worker}"));
    let (ctx, mut api) = harness();
    let tracker = live_tracker(&ctx).await;
    let plan = declared(&p).await;
    let theirs = json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "team-budget", "namespace": "test", "uid": "pdb-uid"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "worker"}}},
    });
    let safe =
        worker_deployment(json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}));
    watched(&ctx, &[&p], &[safe], &[worker_pod(Some("False"))], &[theirs]);
    ctx.gate.bind(&ObjectKey::of(&p), Ok(watch(&tracker, &queueguard::consumers::QueueKey::new("/", &name))));
    let echo = serde_json::to_value(&p).unwrap();
    let n = name.clone();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let (status, call) = api.expect_status_patch(&n).await;
        assert_eq!(
            status["disruptionBudgets"],
            json!([{"kind": "Deployment", "workload": "worker", "name": "team-budget", "owner": "Foreign"}])
        );
        call.respond(StatusCode::OK, &echo);
        for (reason, kind) in [
            ("Declared", "Normal"),
            ("Declared", "Normal"),
            ("PolicyApplied", "Normal"),
            ("TooFewAttached", "Warning"),
            ("RolloutGuarded", "Normal"),
        ] {
            api.expect_event(reason, kind).await;
        }
        let event = api.expect_event("DisruptionBudgetSkipped", "Normal").await;
        assert!(event["note"].as_str().unwrap().contains("team-budget"), "{event}");
    });
    run(p, ctx).await.unwrap();
    server.await.unwrap();
    remove_all(&plan).await;
}

/// A managed queue deleted behind the operator's back wakes its policy at once (the
/// queue.deleted event), and the reconcile declares it again with a Warning Event.
#[tokio::test]
async fn a_queue_deleted_behind_the_operators_back_is_declared_again_with_a_warning() {
    deleted_behind_the_operators_back(|plan| plan.queue.clone()).await;
}

/// The same for its dead-letter queue: without it the policy's dead letters would be dropped
/// until the next declaration.
#[tokio::test]
async fn a_dead_letter_queue_deleted_behind_the_operators_back_is_declared_again_with_a_warning() {
    deleted_behind_the_operators_back(|plan| plan.dead_letter_queue.clone()).await;
}

async fn deleted_behind_the_operators_back(which: fn(&queueguard::plan::QueuePlan) -> String) {
    let name = unique("ctrl-recreate");
    let p = with_finalizer(policy(&name, "{}"));
    let gone = which(&plan_of(&p));
    let (ctx, mut api) = harness();
    let mut wakeups = ctx.take_wake_receiver().unwrap();
    // The controller's watch hands every policy to the gate before the reconcile sees it.
    ctx.gate.on(&kube::runtime::watcher::Event::Apply(p.clone()));
    let echo = serde_json::to_value(&p).unwrap();
    let n = name.clone();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let (status, call) = api.expect_status_patch(&n).await;
        call.respond(StatusCode::OK, &echo);
        for reason in ["Declared", "Declared", "PolicyApplied"] {
            api.expect_event(reason, "Normal").await;
        }
        (api, status)
    });
    run(p.clone(), ctx.clone()).await.unwrap();
    let (mut api, status) = server.await.unwrap();
    let uri = queueguard::broker::uri::BrokerUri::parse(&broker_uri(), Some(&management_base())).unwrap();
    let tracker = ctx.trackers.tracker(&uri, None).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            tracker.tracking("/") == queueguard::consumers::Tracking::Events
        })
        .await
    );

    while wakeups.try_recv().is_ok() {} // the first pass's own
    delete_queues(&[&gone]).await;
    let woken =
        tokio::time::timeout(Duration::from_secs(5), wakeups.recv()).await.expect("woken by the deletion").unwrap();
    assert_eq!(woken.name, name);

    let mut p2 = p.clone();
    p2.status = Some(serde_json::from_value(status).unwrap());
    let expected = format!("'{gone}'");
    let first = p2.status.clone();
    let echo = serde_json::to_value(&p2).unwrap();
    let n = name.clone();
    let server = tokio::spawn(async move {
        // The first pass's Secret read still serves (controller::secrets). Status is written
        // again only if the queue's unacknowledged count arrived meanwhile: the management API
        // has it for a queue once its statistics came (every 5 s), and a brand-new queue's not yet.
        let call = api.next(Duration::from_secs(10)).await.expect("a request");
        let event = if call.method == "PATCH" {
            assert_eq!(call.path, format!("{POLICIES}/{n}/status"));
            let mut status = call.body["status"].clone();
            let unacked = status["queue"].as_object_mut().unwrap().remove("messagesUnacknowledged");
            assert_eq!(unacked, Some(json!(0)), "{status}");
            assert_eq!(status, serde_json::to_value(&first).unwrap(), "nothing else changed");
            call.respond(StatusCode::OK, &echo);
            api.expect_event("QueueRecreated", "Warning").await
        } else {
            assert_eq!(
                (call.method.as_str(), call.path.as_str()),
                ("POST", "/apis/events.k8s.io/v1/namespaces/test/events")
            );
            let event = call.body.clone();
            assert_eq!((event["reason"].as_str(), event["type"].as_str()), (Some("QueueRecreated"), Some("Warning")));
            call.respond(StatusCode::CREATED, &event);
            event
        };
        let note = event["note"].as_str().unwrap();
        assert!(note.contains(&expected) && note.contains("declared again"), "{note}");
    });
    run(p2, ctx).await.unwrap();
    server.await.unwrap();
    assert!(exists(&gone).await, "declared again");
    remove_all(&plan_of(&p)).await;
}

#[tokio::test]
async fn a_type_change_with_migrate_is_carried_out_step_by_step_in_status_and_events() {
    let (ctx, mut api) = harness();
    let name = unique("ctrl-migrate");
    let before = with_finalizer(policy(&name, "{type: classic}"));
    let after = with_finalizer(policy(&name, "{type: quorum, onChange: Migrate}"));
    let pool = queueguard::broker::BrokerPool::new(unique("conn"));
    let plan = plan_of(&before);
    assert!(
        queueguard::converge::converge(&plan, &broker(&pool, &plan), &[], queueguard::converge::Mode::Declare)
            .await
            .is_ready()
    );
    let ids: Vec<String> = (0..300).map(|i| format!("M-{i}")).collect();
    {
        let (_conn, ch) = app().await;
        ch.confirm_select(Default::default()).await.unwrap();
        for id in &ids {
            let props = lapin::BasicProperties::default().with_message_id(id.as_str().into()).with_delivery_mode(2);
            ch.basic_publish("".into(), name.as_str().into(), Default::default(), id.as_bytes(), props)
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    let echo = serde_json::to_value(&after).unwrap();
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let (mut steps, mut events) = (Vec::new(), Vec::new());
        let mut names = std::collections::HashMap::new();
        loop {
            let call = api.next(Duration::from_secs(20)).await.expect("the pass goes on");
            // An Event, or a repeat of one (the recorder patches its series), by its name.
            if call.path.starts_with("/apis/events.k8s.io/") {
                let event = if call.method == "POST" {
                    assert_eq!(call.body["regarding"]["kind"], "QueuePolicy");
                    let reason = call.body["reason"].as_str().unwrap().to_owned();
                    names.insert(call.body["metadata"]["name"].as_str().unwrap_or_default().to_owned(), reason.clone());
                    reason
                } else {
                    names[call.path.rsplit('/').next().unwrap()].clone()
                };
                events.push(event);
                let body = call.body.clone();
                let code = if call.method == "POST" { StatusCode::CREATED } else { StatusCode::OK };
                call.respond(code, &body);
                continue;
            }
            assert_eq!(
                (call.method.as_str(), call.path.as_str()),
                ("PATCH", format!("{POLICIES}/{}/status", after_name(&echo)).as_str())
            );
            let status = call.body["status"].clone();
            call.respond(StatusCode::OK, &echo);
            if status.get("queue").is_some() {
                return (steps, events, status);
            }
            let m = &status["migration"];
            steps.push(format!("{} {}", m["queue"].as_str().unwrap(), m["phase"].as_str().unwrap()));
            assert!(!status.to_string().contains("guest:guest"), "no credentials in status");
        }
    });
    run(after.clone(), ctx).await.unwrap();
    let (steps, events, status) = server.await.unwrap();

    let dlq = format!("{name}.dlq");
    let mut expected: Vec<String> = Vec::new();
    for queue in [&dlq, &name] {
        for phase in ["Preparing", "Draining", "Swapping", "Restoring", "Refilling", "RestartingConsumers"] {
            expected.push(format!("{queue} {phase}"));
        }
    }
    expected.push(format!("{name} Completed"));
    assert_eq!(steps, expected, "each step recorded before it was taken");
    assert_eq!(events.iter().filter(|e| *e == "Migrating").count(), 12, "{events:?}");
    assert!(events.contains(&"MigrationCompleted".to_owned()), "{events:?}");

    let m = &status["migration"];
    assert_eq!(
        (m["phase"].as_str(), m["movedOut"].as_i64(), m["movedBack"].as_i64()),
        (Some("Completed"), Some(300), Some(300))
    );
    assert_eq!(m["consumersRestarted"], json!(false));
    assert!(m["message"].as_str().unwrap().contains("must be restarted"), "{m}");
    assert!(m["finishedAt"].is_string() && m["swapWindowMillis"].is_number(), "{m}");
    let migrating = condition(&status, "Migrating");
    assert_eq!(
        (migrating["status"].as_str(), migrating["reason"].as_str()),
        (Some("False"), Some("MigrationCompleted"))
    );
    assert_eq!(condition(&status, "Ready")["status"], "True");
    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    assert_eq!(q["type"], "quorum");
    assert_eq!(counts(&format!("{name}.queueguard-migrating")).await, None, "the holding queue is gone");
    let consumed = drain_ids(&name).await;
    assert!(ids.iter().all(|id| consumed.contains(id)), "every message is in the new queue");
    remove_all(&plan_of(&after)).await;
}

/// With spec.consumers, the migration ends by restarting the guarded Deployment through its
/// own rollout: after RestartingConsumers is recorded, one merge patch of the pod template's
/// `queueguard.io/restartedAt` annotation (the migration's start, so a resumed pass sends the
/// same value and changes nothing), then Completed, saying what was restarted. The next pass
/// does not take the swap's deletion for one behind the operator's back, and an operator
/// killed between the patch and Completed patches the same value again.
#[tokio::test]
async fn a_migration_restarts_the_guarded_deployment_then_completes() {
    let name = unique("ctrl-migrate-restart");
    let consumers = "consumers: {deployment: worker, minAttachedSeconds: 0}";
    let before = with_finalizer(policy_doc(&name, &format!("queue: {{type: classic}}\n  {consumers}")));
    let after =
        with_finalizer(policy_doc(&name, &format!("queue: {{type: quorum, onChange: Migrate}}\n  {consumers}")));
    declared(&before).await;
    let (ctx, api) = guarded_harness(&after, &name).await;

    let echo = serde_json::to_value(&after).unwrap();
    let (done, finished) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(serve_migration_pass(api, echo, name.clone(), true, finished));
    run(after.clone(), ctx.clone()).await.unwrap();
    done.send(()).unwrap();
    let pass = server.await.unwrap();

    let phases: Vec<String> = pass.statuses.iter().map(|s| phase_of(&s["migration"])).collect();
    let mut expected: Vec<String> = Vec::new();
    for queue in [format!("{name}.dlq"), name.clone()] {
        for phase in ["Preparing", "Draining", "Swapping", "Restoring", "Refilling", "RestartingConsumers"] {
            expected.push(format!("{queue} {phase}"));
        }
    }
    expected.extend(["RestartingConsumers"; 3].map(|p| format!("{name} {p}")));
    assert_eq!(phases, expected, "each step recorded before it was taken, then the pass's status");
    // The queue's own start (its dead-letter queue moved first, with a start of its own).
    let restarting = pass
        .statuses
        .iter()
        .find(|s| s["migration"]["restartedAt"].is_string() && s["migration"]["queue"] == name.as_str())
        .unwrap();
    let stamp = restarting["migration"]["startedAt"].as_str().expect("the start is recorded").to_owned();
    let restart = json!({"spec": {"template": {"metadata": {"annotations": {"queueguard.io/restartedAt": stamp}}}}});
    assert_eq!(
        pass.restarts,
        vec![(format!("{name} RestartingConsumers"), restart.clone())],
        "one restart of the Deployment, after the step was recorded"
    );
    // Issue 31, 12: not Completed while no consumer is back on the new queue.
    let status = pass.statuses.last().unwrap();
    let m = &status["migration"];
    assert_eq!(m["phase"], "RestartingConsumers", "{m}");
    assert!(m["message"].as_str().unwrap().contains("waiting for its consumers to attach"), "{m}");
    assert_eq!(condition(status, "Migrating")["reason"], "Migrating");
    assert!(!pass.events.contains(&"QueueRecreated".to_owned()), "{:?}", pass.events);
    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    assert_eq!(q["type"], "quorum");

    // A restarted worker attaches: the next pass completes, patching the same value again.
    let (worker, ch) = app().await;
    let _consumer =
        ch.basic_consume(name.as_str().into(), "".into(), Default::default(), Default::default()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut next = after.clone();
    next.status = Some(serde_json::from_value(status.clone()).unwrap());
    let (done, finished) = tokio::sync::oneshot::channel();
    let next_pass = serve_migration_pass(pass.api, serde_json::to_value(&next).unwrap(), name.clone(), false, finished);
    let server = tokio::spawn(next_pass);
    run(next, ctx.clone()).await.unwrap();
    done.send(()).unwrap();
    let completed = server.await.unwrap();
    assert_eq!(completed.restarts.iter().map(|(_, body)| body).collect::<Vec<_>>(), vec![&restart]);
    let status = completed.statuses.last().unwrap();
    let m = &status["migration"];
    assert_eq!((m["phase"].as_str(), m["consumersRestarted"].as_bool()), (Some("Completed"), Some(true)), "{m}");
    assert!(m["message"].as_str().unwrap().contains("restarted Deployment 'worker'"), "{m}");
    assert_eq!(condition(status, "Migrating")["reason"], "MigrationCompleted");

    // The next pass: the swap's deletion of the old queue (seen by the tracker meanwhile) is
    // the operator's own, not one behind its back: nothing is declared again, nothing told.
    let mut next = after.clone();
    next.status = Some(serde_json::from_value(status.clone()).unwrap());
    let (done, finished) = tokio::sync::oneshot::channel();
    let next_pass =
        serve_migration_pass(completed.api, serde_json::to_value(&next).unwrap(), name.clone(), false, finished);
    let server = tokio::spawn(next_pass);
    run(next, ctx).await.unwrap();
    done.send(()).unwrap();
    let quiet = server.await.unwrap();
    assert!(!quiet.events.contains(&"QueueRecreated".to_owned()), "{:?}", quiet.events);
    assert!(quiet.restarts.is_empty());

    // An operator killed after the patch, before Completed was written: its successor resumes at
    // the recorded RestartingConsumers and sends the same value (the rollout sees no change).
    let mut resumed = after.clone();
    resumed.status = Some(serde_json::from_value(restarting.clone()).unwrap());
    let (ctx, api) = guarded_harness(&after, &name).await;
    let (done, finished) = tokio::sync::oneshot::channel();
    let resumed_pass = serve_migration_pass(api, serde_json::to_value(&resumed).unwrap(), name.clone(), true, finished);
    let server = tokio::spawn(resumed_pass);
    let tracker = live_tracker(&ctx).await;
    let queue = queueguard::consumers::QueueKey::new("/", &name);
    assert!(eventually(Duration::from_secs(10), || async { tracker.consumers_on(&queue).len() == 1 }).await);
    run(resumed, ctx).await.unwrap();
    done.send(()).unwrap();
    let again = server.await.unwrap();
    assert_eq!(again.restarts.iter().map(|(_, body)| body).collect::<Vec<_>>(), vec![&restart]);
    assert_eq!(again.statuses.last().unwrap()["migration"]["phase"], "Completed");
    worker.close(200, "done".into()).await.unwrap();
    remove_all(&plan_of(&after)).await;
}

/// Issue 31, 12: restarted workers that never attach to the new queue (a plain declare of a
/// quorum queue is refused) leave the migration RestartingConsumers, never Completed; past the
/// attach timeout it says the likely cause and the way back, with a Warning Event.
#[tokio::test]
async fn a_migration_whose_restarted_consumers_do_not_return_says_why_and_the_way_back() {
    let name = unique("ctrl-migrate-missing");
    let consumers = "consumers: {deployment: worker, minAttachedSeconds: 0}\n  gate: {attachTimeout: 1s}";
    let before = with_finalizer(policy_doc(&name, &format!("queue: {{type: classic}}\n  {consumers}")));
    let after =
        with_finalizer(policy_doc(&name, &format!("queue: {{type: quorum, onChange: Migrate}}\n  {consumers}")));
    declared(&before).await;
    let (ctx, api) = guarded_harness(&after, &name).await;
    let (done, finished) = tokio::sync::oneshot::channel();
    let server =
        tokio::spawn(serve_migration_pass(api, serde_json::to_value(&after).unwrap(), name.clone(), true, finished));
    run(after.clone(), ctx.clone()).await.unwrap();
    done.send(()).unwrap();
    let pass = server.await.unwrap();
    let status = pass.statuses.last().unwrap().clone();
    assert_eq!(status["migration"]["phase"], "RestartingConsumers");

    // The worker's own plain declare, as it restarts, is refused.
    let (_conn, ch) = app().await;
    let plain = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    assert!(ch.queue_declare(name.as_str().into(), plain, Default::default()).await.is_err());

    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut next = after.clone();
    next.status = Some(serde_json::from_value(status).unwrap());
    let (done, finished) = tokio::sync::oneshot::channel();
    let next_pass = serve_migration_pass(pass.api, serde_json::to_value(&next).unwrap(), name.clone(), false, finished);
    let server = tokio::spawn(next_pass);
    run(next, ctx).await.unwrap();
    done.send(()).unwrap();
    let late = server.await.unwrap();
    let m = &late.statuses.last().unwrap()["migration"];
    assert_eq!(m["phase"], "RestartingConsumers", "never Completed while nobody consumes: {m}");
    let message = m["message"].as_str().unwrap();
    assert!(message.contains("0 of 1 consumers have attached"), "{message}");
    assert!(
        message.contains("Likely cause: once it is quorum")
            && message.contains("refuses an application's plain declare"),
        "{message}"
    );
    assert!(message.contains("The way back: set spec.queue.type back"), "{message}");
    assert!(late.events.contains(&"MigrationConsumersMissing".to_owned()), "{:?}", late.events);
    remove_all(&plan_of(&after)).await;
}

/// A fresh operator whose watches hold the policy, the worker Deployment (safe strategy) and its
/// pod, bound to the policy's queue.
async fn guarded_harness(p: &QueuePolicy, queue: &str) -> (Arc<Context>, ApiServer) {
    let (ctx, api) = harness();
    let tracker = live_tracker(&ctx).await;
    let safe =
        worker_deployment(json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}));
    watched(&ctx, &[p], &[safe], &[worker_pod(Some("True"))], &[]);
    ctx.gate.bind(&ObjectKey::of(p), Ok(watch(&tracker, &queueguard::consumers::QueueKey::new("/", queue))));
    (ctx, api)
}

/// What one pass of a migrating policy sent to the API.
struct MigrationPass {
    api: ApiServer,
    /// Status writes, in order.
    statuses: Vec<Value>,
    /// Each patch of the Deployment, with the migration step recorded before it.
    restarts: Vec<(String, Value)>,
    /// Reasons of the policy's Events (a repeat patches its series).
    events: Vec<String>,
}

fn phase_of(m: &Value) -> String {
    format!("{} {}", m["queue"].as_str().unwrap_or_default(), m["phase"].as_str().unwrap_or_default())
}

/// Answers one pass's calls until none comes for a second (after the Secret read, when
/// `fresh`): status writes echo `echo`, a Deployment patch answers the Deployment, the gate's own
/// writes (the budget, the pod's condition, which closes while the queue is swapped) and Events
/// echo their bodies.
/// Serves a pass's requests; once `done` (the reconcile returned), until a second passes
/// without one. Before, the pass can go quiet for seconds (a swap waits for the queue's
/// statistics).
async fn serve_migration_pass(
    mut api: ApiServer,
    echo: Value,
    name: String,
    fresh: bool,
    mut done: tokio::sync::oneshot::Receiver<()>,
) -> MigrationPass {
    let mut secret_reads = 0;
    let (mut statuses, mut restarts, mut events) = (Vec::new(), Vec::new(), Vec::new());
    let mut names = std::collections::HashMap::new();
    let mut finished = false;
    loop {
        let call = if finished {
            api.next(Duration::from_secs(1)).await
        } else {
            tokio::select! {
                call = api.next(Duration::from_secs(60)) => call,
                _ = &mut done => {
                    finished = true;
                    continue;
                }
            }
        };
        let Some(call) = call else { break };
        let (method, path, body) = (call.method.clone(), call.path.clone(), call.body.clone());
        if (method.as_str(), path.as_str()) == ("GET", "/api/v1/namespaces/test/secrets/rabbitmq") {
            secret_reads += 1;
            call.respond(StatusCode::OK, &broker_secret());
        } else if path == format!("{POLICIES}/{name}/status") {
            statuses.push(body["status"].clone());
            assert!(!body.to_string().contains("guest:guest"), "no credentials in status");
            call.respond(StatusCode::OK, &echo);
        } else if path == "/apis/apps/v1/namespaces/test/deployments/worker" {
            assert_eq!((method.as_str(), call.content_type.as_str()), ("PATCH", "application/merge-patch+json"));
            let step = statuses.last().map(|s: &Value| phase_of(&s["migration"])).unwrap_or_default();
            restarts.push((step, body));
            call.respond(StatusCode::OK, &worker_deployment(json!({"type": "RollingUpdate"})));
        } else {
            let gate_writes = ["/apis/events.k8s.io/", "/api/v1/namespaces/test/pods/", "/apis/policy/v1/"];
            assert!(gate_writes.iter().any(|w| path.starts_with(w)), "{method} {path}");
            if path.starts_with("/apis/events.k8s.io/") && body["regarding"]["kind"] != "Pod" {
                let reason = if method == "POST" {
                    let reason = body["reason"].as_str().unwrap_or_default().to_owned();
                    names.insert(body["metadata"]["name"].as_str().unwrap_or_default().to_owned(), reason.clone());
                    reason
                } else {
                    names.get(path.rsplit('/').next().unwrap()).cloned().unwrap_or_default()
                };
                events.push(reason);
            }
            let code = if method == "POST" { StatusCode::CREATED } else { StatusCode::OK };
            call.respond(code, &body);
        }
    }
    assert_eq!(secret_reads, usize::from(fresh), "the Secret is read once, by a fresh operator only");
    MigrationPass { api, statuses, restarts, events }
}

fn after_name(policy: &Value) -> String {
    policy["metadata"]["name"].as_str().unwrap().to_owned()
}

/// The message ids in a queue, taken out of it.
async fn drain_ids(queue: &str) -> std::collections::HashSet<String> {
    let (_conn, ch) = app().await;
    let mut ids = std::collections::HashSet::new();
    while let Some(m) = ch.basic_get(queue.into(), lapin::options::BasicGetOptions { no_ack: true }).await.unwrap() {
        ids.insert(m.delivery.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default());
    }
    ids
}

// --- Brokers made by the RabbitMQ Cluster Operator -------------------------------------------

const CLUSTERS: &str = "/apis/rabbitmq.com/v1beta1/namespaces";

/// A QueuePolicy `test/<name>` on RabbitmqCluster `cluster` (in `namespace`, else its own).
fn cluster_policy(name: &str, cluster: &str, namespace: Option<&str>) -> QueuePolicy {
    let ns = namespace.map(|n| format!(", namespace: {n}")).unwrap_or_default();
    let doc = format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name:?}, namespace: test, generation: 1}}\nspec:\n  broker: {{rabbitmqClusterReference: {{name: {cluster}{ns}}}}}\n  queue: {{expires: 30m}}\n"
    );
    with_finalizer(serde_yaml_ng::from_str(&doc).unwrap())
}

/// A RabbitmqCluster as the Cluster Operator leaves it once made, checked against the CRD's
/// schema (a trimmed copy in tests/fixtures) so that it has the real object's shape.
fn rabbitmq_cluster(ns: &str, annotations: Value, made: bool) -> Value {
    let mut cluster = json!({
        "apiVersion": "rabbitmq.com/v1beta1", "kind": "RabbitmqCluster",
        "metadata": {"name": "rabbit", "namespace": ns, "generation": 1, "annotations": annotations},
        "spec": {"replicas": 1, "image": "rabbitmq:4.0-management", "resources": {"limits": {"memory": "2Gi"}}},
        "status": {"conditions": [{"type": "AllReplicasReady", "status": "True"}]},
    });
    if made {
        cluster["status"]["binding"] = json!({"name": "rabbit-default-user"});
        cluster["status"]["defaultUser"] = json!({
            "secretReference": {"name": "rabbit-default-user", "namespace": ns,
                "keys": {"username": "username", "password": "password", "host": "host", "port": "port"}},
            "serviceReference": {"name": "rabbit", "namespace": ns},
        });
    }
    let schema = schema::crd_schema("tests/fixtures/rabbitmq/rabbitmqcluster-crd.yaml", "v1beta1");
    assert_eq!(schema::violations(&cluster, &schema), Vec::<String>::new(), "a RabbitmqCluster the CRD accepts");
    cluster
}

/// The default user's Secret, as the Cluster Operator writes it (no `uri`), for a broker at
/// `host:port`.
fn default_user(ns: &str, user: &str, password: &str, host: &str, port: u16) -> Value {
    let mut s = Secret::default();
    s.metadata.name = Some("rabbit-default-user".into());
    s.metadata.namespace = Some(ns.into());
    let conf = format!("default_user = {user}\ndefault_pass = {password}");
    let pairs = [
        ("username", user.to_owned()),
        ("password", password.to_owned()),
        ("host", host.to_owned()),
        ("port", port.to_string()),
        ("provider", "rabbitmq".into()),
        ("type", "rabbitmq".into()),
        ("default_user.conf", conf),
    ];
    s.data = Some(pairs.into_iter().map(|(k, v)| (k.to_string(), ByteString(v.into_bytes()))).collect());
    serde_json::to_value(s).unwrap()
}

/// The test broker's AMQP host and port, where its management API is on the usual port (the
/// Cluster Operator's Service has it on 15672 beside AMQP).
fn test_broker_address() -> Option<(String, u16)> {
    let url = url::Url::parse(&broker_uri()).unwrap();
    management_base().ends_with(":15672").then(|| (url.host_str().unwrap().to_owned(), url.port().unwrap_or(5672)))
}

#[tokio::test]
async fn a_policy_on_a_rabbitmq_cluster_logs_in_as_its_default_user_and_is_declared_on_its_broker() {
    let Some((host, port)) = test_broker_address() else {
        eprintln!("SKIPPED: the test broker's management API is not on port 15672 beside AMQP");
        return;
    };
    // A user of its own, as the Cluster Operator makes one (default_user_...), so that only
    // the default user's Secret can have given the operator its credentials.
    let user = unique("default_user");
    let password = "p@ss/w:rd+";
    for args in [
        vec!["add_user", user.as_str(), password],
        vec!["set_user_tags", user.as_str(), "administrator"],
        vec!["set_permissions", "-p", "/", user.as_str(), ".*", ".*", ".*"],
    ] {
        let out = rabbitmqctl(&args);
        assert!(out.status.success(), "rabbitmqctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let (client, mut api) = mock_client();
    let connection_name = unique("cluster-ref");
    let ctx = Arc::new(Context::new(client, &connection_name));
    let name = unique("on-cluster");
    let p = cluster_policy(&name, "rabbit", None);
    let echo = serde_json::to_value(&p).unwrap();
    let (n, secret) = (name.clone(), default_user("test", &user, password, &host, port));
    let server = tokio::spawn(async move {
        api.expect("GET", &format!("{CLUSTERS}/test/rabbitmqclusters/rabbit"))
            .await
            .respond(StatusCode::OK, &rabbitmq_cluster("test", json!({}), true));
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbit-default-user").await.respond(StatusCode::OK, &secret);
        let (status, call) = api.expect_status_patch(&n).await;
        let ready = condition(&status, "Ready");
        assert_eq!(
            (ready["status"].as_str(), ready["reason"].as_str()),
            (Some("True"), Some("Reconciled")),
            "{status}"
        );
        assert!(!status.to_string().contains("p@ss"), "no credentials in status");
        call.respond(StatusCode::OK, &echo);
        for _ in 0..3 {
            let call = api.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
            assert!(!call.body.to_string().contains("p@ss"), "no credentials in Events");
            let body = call.body.clone();
            call.respond(StatusCode::CREATED, &body);
        }
    });
    assert_eq!(run(p.clone(), ctx.clone()).await.unwrap(), Action::requeue(controller::FINDINGS_EVERY));
    server.await.unwrap();
    assert!(exists(&name).await, "declared on the cluster's broker");
    // The operator's connections (the management API lists them once their statistics are in).
    let users = || async {
        let connections = mgmt_get("connections").await.unwrap_or_default();
        connections
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| {
                c["client_properties"]["connection_name"].as_str().is_some_and(|n| n.contains(&connection_name))
            })
            .filter_map(|c| c["user"].as_str().map(str::to_owned))
            .collect::<Vec<String>>()
    };
    assert!(
        eventually(Duration::from_secs(15), || async { !users().await.is_empty() }).await,
        "the operator's connections are listed"
    );
    let seen = users().await;
    assert!(seen.iter().all(|u| *u == user), "the operator logged in as {user}: {seen:?}");
    remove_all(&plan_of(&p)).await;
    rabbitmqctl(&["delete_user", &user]);
}

#[tokio::test]
async fn a_tls_rabbitmq_cluster_is_reached_over_amqps_and_https_trusting_the_ca_of_its_tls_secret() {
    // The Cluster Operator's TLS Service: AMQP on the Secret's port, management on 15671, both
    // TLS with the certificate of spec.tls.secretName. Terminators with a new CA stand in front
    // of the real broker's plain listeners.
    let Some(_) = test_broker_address() else {
        eprintln!("SKIPPED: the test broker's management API is not on port 15672 beside AMQP");
        return;
    };
    let Ok(management_tls) = tokio::net::TcpListener::bind("127.0.0.1:15671").await else {
        eprintln!("SKIPPED: port 15671 (a TLS cluster's management port) is taken on this machine");
        return;
    };
    let (acceptor, ca) = tls::acceptor();
    let amqp_tls = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let amqps_port = amqp_tls.local_addr().unwrap().port();
    tls::forward(amqp_tls, acceptor.clone(), broker_addr());
    let management = url::Url::parse(&management_base()).unwrap();
    tls::forward(management_tls, acceptor, format!("{}:15672", management.host_str().unwrap()));

    let (ctx, mut api) = harness();
    let name = unique("on-tls-cluster");
    let p = cluster_policy(&name, "rabbit", None);
    let echo = serde_json::to_value(&p).unwrap();
    let mut cluster = rabbitmq_cluster("test", json!({}), true);
    cluster["spec"]["tls"] = json!({"secretName": "rabbit-tls"});
    let schema = schema::crd_schema("tests/fixtures/rabbitmq/rabbitmqcluster-crd.yaml", "v1beta1");
    assert_eq!(schema::violations(&cluster, &schema), Vec::<String>::new());
    let user = default_user("test", "guest", "guest", "127.0.0.1", amqps_port);
    let mut tls_secret = Secret::default();
    tls_secret.metadata.name = Some("rabbit-tls".into());
    tls_secret.metadata.namespace = Some("test".into());
    tls_secret.data = Some(
        [("tls.crt", "(the server's)"), ("tls.key", "(never read)"), ("ca.crt", ca.as_str())]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
            .collect(),
    );
    let n = name.clone();
    let server = tokio::spawn(async move {
        api.expect("GET", &format!("{CLUSTERS}/test/rabbitmqclusters/rabbit")).await.respond(StatusCode::OK, &cluster);
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbit-default-user").await.respond(StatusCode::OK, &user);
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbit-tls")
            .await
            .respond(StatusCode::OK, &serde_json::to_value(&tls_secret).unwrap());
        let (status, call) = api.expect_status_patch(&n).await;
        call.respond(StatusCode::OK, &echo);
        for _ in 0..3 {
            let call = api.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
            let body = call.body.clone();
            call.respond(StatusCode::CREATED, &body);
        }
        status
    });
    assert_eq!(run(p.clone(), ctx.clone()).await.unwrap(), Action::requeue(controller::FINDINGS_EVERY));
    let status = server.await.unwrap();
    let [ready, settings] = ["Ready", "SettingsApplied"].map(|c| condition(&status, c));
    assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("True"), Some("Reconciled")), "{status}");
    assert_eq!(settings["reason"].as_str(), Some("PolicyApplied"), "the broker policy went over https: {status}");
    assert!(exists(&name).await, "declared over amqps");
    assert!(
        mgmt_get(&format!("policies/%2F/{}", enc(&plan_of(&p).policy_name))).await.is_some(),
        "the broker policy is there"
    );
    remove_all(&plan_of(&p)).await;
}

#[tokio::test]
async fn a_cluster_reference_waits_for_the_cluster_and_its_default_user_and_says_why() {
    let (ctx, mut api) = harness();
    let p = cluster_policy("waiting", "rabbit", None);
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(async move {
        let mut reasons = Vec::new();
        // Not there yet; then there, being made (no default user); then made, its Secret not yet.
        for cluster in
            [None, Some(rabbitmq_cluster("test", json!({}), false)), Some(rabbitmq_cluster("test", json!({}), true))]
        {
            let call = api.expect("GET", &format!("{CLUSTERS}/test/rabbitmqclusters/rabbit")).await;
            let made = cluster.as_ref().is_some_and(|c| c["status"].get("defaultUser").is_some());
            match cluster {
                None => call.respond(StatusCode::NOT_FOUND, &not_found()),
                Some(c) => call.respond(StatusCode::OK, &c),
            }
            if made {
                api.expect("GET", "/api/v1/namespaces/test/secrets/rabbit-default-user")
                    .await
                    .respond(StatusCode::NOT_FOUND, &not_found());
            }
            let (status, call) = api.expect_status_patch("waiting").await;
            let declared = condition(&status, "QueueDeclared");
            reasons.push((
                declared["reason"].as_str().unwrap().to_owned(),
                declared["message"].as_str().unwrap().to_owned(),
            ));
            call.respond(StatusCode::OK, &echo);
            let event = api.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
            let body = event.body.clone();
            event.respond(StatusCode::CREATED, &body);
        }
        reasons
    });
    for _ in 0..3 {
        assert_eq!(run(p.clone(), ctx.clone()).await.unwrap(), Action::requeue(queueguard::pass::SECRET_RETRY));
    }
    let reasons = server.await.unwrap();
    assert_eq!(reasons[0].0, "RabbitmqClusterNotFound");
    assert!(reasons[0].1.starts_with("RabbitmqCluster 'test/rabbit' not found"), "{}", reasons[0].1);
    assert_eq!(reasons[1].0, "RabbitmqClusterNotReady");
    assert!(reasons[1].1.contains("has no default user yet"), "{}", reasons[1].1);
    assert_eq!(reasons[2].0, "SecretNotFound", "a cluster being made is read again, not kept");
    assert_eq!(
        reasons[2].1,
        "Secret 'test/rabbit-default-user' (the default user of RabbitmqCluster 'test/rabbit') not found"
    );
}

#[tokio::test]
async fn another_namespaces_cluster_needs_its_leave_and_the_operator_its_rbac() {
    let forbidden = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": "rabbitmqclusters.rabbitmq.com \"rabbit\" is forbidden"});
    let not_listed =
        rabbitmq_cluster("messaging", json!({"rabbitmq.com/topology-allowed-namespaces": "billing, shopping"}), true);
    let mut messages = Vec::new();
    for (code, answer) in [(StatusCode::OK, not_listed), (StatusCode::FORBIDDEN, forbidden)] {
        let (ctx, mut api) = harness();
        let p = cluster_policy("elsewhere", "rabbit", Some("messaging"));
        let echo = serde_json::to_value(&p).unwrap();
        let server = tokio::spawn(async move {
            api.expect("GET", &format!("{CLUSTERS}/messaging/rabbitmqclusters/rabbit")).await.respond(code, &answer);
            // No Secret is read: nothing follows but the status and its Event.
            let (status, call) = api.expect_status_patch("elsewhere").await;
            let declared = condition(&status, "QueueDeclared").clone();
            call.respond(StatusCode::OK, &echo);
            let event = api.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
            let body = event.body.clone();
            event.respond(StatusCode::CREATED, &body);
            declared
        });
        assert_eq!(run(p, ctx).await.unwrap(), Action::requeue(queueguard::pass::SECRET_RETRY));
        let declared = server.await.unwrap();
        assert_eq!(declared["reason"], "ClusterReferenceNotAllowed", "{declared}");
        messages.push(declared["message"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        messages[0],
        "RabbitmqCluster 'messaging/rabbit' does not let namespace 'test' use it: its annotation rabbitmq.com/topology-allowed-namespaces must list 'test' (or '*'), as the Messaging Topology Operator requires"
    );
    assert!(messages[1].contains("rabbitmqClusterOperator.enabled=true"), "{}", messages[1]);
}

// --- Queues of the Messaging Topology Operator -----------------------------------------------

/// A context whose watch of the Topology Operator's Queues holds `queues`.
fn with_topology_queues(queues: &[Value]) -> (Arc<Context>, ApiServer) {
    use kube::runtime::{reflector, watcher::Event};
    let (ctx, api) = harness();
    let (store, mut writer) = reflector::store::<queueguard::topology::Queue>();
    writer.apply_watcher_event(&Event::Init);
    for q in queues {
        writer.apply_watcher_event(&Event::InitApply(serde_json::from_value(q.clone()).unwrap()));
    }
    writer.apply_watcher_event(&Event::InitDone);
    ctx.know_topology_queues(store);
    (ctx, api)
}

/// The cluster, its default user (the test broker's guest) and the status patch of a pass,
/// then whatever Events follow; the status.
async fn serve_cluster_pass(api: &mut ApiServer, name: &str, echo: &Value, read: bool) -> Value {
    if read {
        api.expect("GET", &format!("{CLUSTERS}/test/rabbitmqclusters/rabbit"))
            .await
            .respond(StatusCode::OK, &rabbitmq_cluster("test", json!({}), true));
        let (host, port) = test_broker_address().unwrap();
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbit-default-user")
            .await
            .respond(StatusCode::OK, &default_user("test", "guest", "guest", &host, port));
    }
    let (status, call) = api.expect_status_patch(name).await;
    call.respond(StatusCode::OK, echo);
    while let Some(call) = api.next(Duration::from_millis(500)).await {
        assert_eq!(
            (call.method.as_str(), call.path.as_str()),
            ("POST", "/apis/events.k8s.io/v1/namespaces/test/events")
        );
        let body = call.body.clone();
        call.respond(StatusCode::CREATED, &body);
    }
    status
}

#[tokio::test]
async fn a_queue_a_topology_operator_queue_declares_is_left_alone_and_with_adopt_only_reported() {
    if test_broker_address().is_none() {
        eprintln!("SKIPPED: the test broker's management API is not on port 15672 beside AMQP");
        return;
    }
    let name = unique("topology");
    let theirs = json!({"apiVersion": "rabbitmq.com/v1beta1", "kind": "Queue",
        "metadata": {"name": "orders-queue", "namespace": "test"},
        "spec": {"name": name, "type": "quorum", "durable": true, "rabbitmqClusterReference": {"name": "rabbit"}}});
    let (ctx, mut api) = with_topology_queues(&[theirs]);
    let p = cluster_policy(&name, "rabbit", None);
    let echo = serde_json::to_value(&p).unwrap();
    let server = {
        let name = name.clone();
        tokio::spawn(async move { (serve_cluster_pass(&mut api, &name, &echo, true).await, api) })
    };
    assert_eq!(run(p.clone(), ctx.clone()).await.unwrap(), Action::requeue(queueguard::pass::CONFLICT_RETRY));
    let (status, mut api) = server.await.unwrap();
    let declared = condition(&status, "QueueDeclared");
    assert_eq!((declared["status"].as_str(), declared["reason"].as_str()), (Some("False"), Some("ManagedElsewhere")));
    assert_eq!(
        declared["message"],
        format!(
            "queue '{name}' in vhost '/' is managed by Queue 'test/orders-queue' of the Messaging Topology Operator: queueguard touches nothing. Set spec.adopt: true to report on it and guard its consumers beside that Queue, or delete the Queue to have queueguard declare it"
        )
    );
    let plan = plan_of(&p);
    assert!(!exists(&name).await && !exists(&plan.dead_letter_queue).await, "nothing declared");

    // The Topology Operator declares it (a quorum queue, arguments of its own) and it fills.
    let (_conn, ch) = app().await;
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-queue-type".into(), lapin::types::AMQPValue::LongString("quorum".into()));
    args.insert("x-max-length".into(), lapin::types::AMQPValue::LongLongInt(1000));
    let durable = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(name.as_str().into(), durable, args).await.unwrap();
    publish(&name, (0..3).map(|i| format!("m{i}"))).await;
    let mut adopting = p.clone();
    adopting.spec.adopt = true;
    adopting.metadata.generation = Some(2);
    let echo = serde_json::to_value(&adopting).unwrap();
    let server = {
        let name = name.clone();
        tokio::spawn(async move { serve_cluster_pass(&mut api, &name, &echo, false).await })
    };
    assert_eq!(run(adopting, ctx).await.unwrap(), Action::requeue(controller::FINDINGS_EVERY));
    let status = server.await.unwrap();
    let declared = condition(&status, "QueueDeclared");
    assert_eq!((declared["status"].as_str(), declared["reason"].as_str()), (Some("True"), Some("Adopted")), "{status}");
    assert!(
        declared["message"]
            .as_str()
            .unwrap()
            .contains("declared by Queue 'test/orders-queue' of the Messaging Topology Operator")
    );
    assert_eq!(condition(&status, "Ready")["status"], "True");
    let messages_ready = eventually(Duration::from_secs(10), || async {
        mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.is_some_and(|q| q["messages_ready"] == 3)
    });
    assert!(messages_ready.await);
    assert!(status["brokerPolicy"].is_null(), "no broker policy: {status}");
    assert!(mgmt_get(&format!("policies/%2F/queueguard.test.{}", enc(&name))).await.is_none(), "none on the broker");
    assert!(!exists(&plan.dead_letter_queue).await, "no dead-letter queue of queueguard's");
    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    assert_eq!(q["arguments"], json!({"x-queue-type": "quorum", "x-max-length": 1000}), "their arguments, untouched");
    common::delete_queues(&[&name]).await;
}

// --- Migrations left midway (issue 31, 7) ----------------------------------------------------

/// Stops a migration at the record of `stop_at`, as an operator killed right then.
struct StopAt(queueguard::crd::MigrationPhase, Option<queueguard::crd::MigrationStatus>);

impl queueguard::migrate::run::Journal for StopAt {
    async fn record(&mut self, state: &queueguard::crd::MigrationStatus) -> Result<(), String> {
        if state.phase == self.0 {
            return Err("the operator went away".into());
        }
        self.1 = Some(state.clone());
        Ok(())
    }
}

/// A classic queue of policy `name` with 100 messages and an exchange route, left midway into
/// a migration to quorum (routes and messages in the holding queue); its last recorded state.
async fn left_midway(name: &str) -> (String, Value) {
    let before = policy_doc(name, "queue: {type: classic}");
    let after = policy_doc(name, "queue: {type: quorum, onChange: Migrate}");
    declared(&before).await;
    let exchange = unique("ctrl-midway-x");
    let (_conn, ch) = app().await;
    ch.exchange_declare(exchange.as_str().into(), lapin::ExchangeKind::Direct, Default::default(), Default::default())
        .await
        .unwrap();
    ch.queue_bind(name.into(), exchange.as_str().into(), "k".into(), Default::default(), Default::default())
        .await
        .unwrap();
    publish(name, (0..100).map(|i| format!("m-{i}"))).await;
    let pool = queueguard::broker::BrokerPool::new(unique("conn"));
    let b = broker(&pool, &plan_of(&after));
    let target = queueguard::migrate::Target::of_queue(&plan_of(&after));
    let mut journal = StopAt(queueguard::crd::MigrationPhase::Swapping, None);
    let stopped = queueguard::migrate::run::migrate(&b, &target, None, &mut journal, &Default::default()).await;
    assert!(stopped.is_err(), "stopped midway");
    assert_eq!(counts(&format!("{name}.queueguard-migrating")).await, Some((100, 0)), "held midway");
    (exchange, json!({"migration": journal.1.unwrap()}))
}

async fn settled_on_broker(name: &str, exchange: &str) {
    assert_eq!(counts(&format!("{name}.queueguard-migrating")).await, None, "the holding queue is gone");
    assert_eq!(counts(name).await, Some((100, 0)), "the messages are back");
    let bindings = mgmt_get(&format!("queues/%2F/{}/bindings", enc(name))).await.unwrap();
    assert!(bindings.as_array().unwrap().iter().any(|b| b["source"] == exchange), "the route is back: {bindings}");
    let q = mgmt_get(&format!("queues/%2F/{}", enc(name))).await.unwrap();
    assert_eq!(q["type"], "classic", "it keeps its shape");
}

#[tokio::test]
async fn a_migration_left_midway_when_on_change_goes_back_to_refuse_is_rolled_back() {
    let name = unique("ctrl-midway-refuse");
    let (exchange, status) = left_midway(&name).await;
    let mut p = with_finalizer(policy_doc(&name, "queue: {type: quorum}"));
    p.status = Some(serde_json::from_value(status).unwrap());
    let (ctx, api) = harness();
    let (done, finished) = tokio::sync::oneshot::channel();
    let echo = serde_json::to_value(&p).unwrap();
    let server = tokio::spawn(serve_migration_pass(api, echo, name.clone(), true, finished));
    run(p.clone(), ctx).await.unwrap();
    done.send(()).unwrap();
    let pass = server.await.unwrap();
    let status = pass.statuses.last().unwrap();
    let m = &status["migration"];
    assert_eq!(m["phase"], "RolledBack", "{m}");
    assert!(m["message"].as_str().unwrap().contains("onChange no longer says Migrate"), "{m}");
    assert_eq!(condition(status, "Migrating")["reason"], "MigrationRolledBack");
    assert!(pass.events.contains(&"MigrationRolledBack".to_owned()), "{:?}", pass.events);
    settled_on_broker(&name, &exchange).await;
    remove_all(&plan_of(&p)).await;
}

#[tokio::test]
async fn deleting_a_policy_midway_through_a_migration_settles_it_before_the_finalizer_goes() {
    let name = unique("ctrl-midway-delete");
    let (exchange, status) = left_midway(&name).await;
    let mut p = with_finalizer(policy_doc(&name, "queue: {type: quorum, onChange: Migrate}"));
    p.status = Some(serde_json::from_value(status).unwrap());
    p.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
    let (ctx, mut api) = harness();
    let (n, echo) = (name.clone(), serde_json::to_value(&p).unwrap());
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &broker_secret());
        let event = api.expect_event("MigrationRolledBack", "Warning").await;
        assert!(event["note"].as_str().unwrap().contains("moved back into it before the policy goes: done"), "{event}");
        api.expect_event("QueueRetained", "Normal").await;
        let call = api.expect("PATCH", &format!("{POLICIES}/{n}")).await;
        assert!(call.body.as_array().unwrap().iter().any(|op| op["op"] == "remove"), "{}", call.body);
        call.respond(StatusCode::OK, &echo.clone());
    });
    assert_eq!(run(p.clone(), ctx).await.unwrap(), Action::await_change());
    server.await.unwrap();
    settled_on_broker(&name, &exchange).await;
    remove_all(&plan_of(&p)).await;
}

/// A migration that unwound (consumers that never acknowledge, say) is not tried again at the
/// next pass: each attempt starves the workers for the wait's bound. Five minutes later it is.
#[tokio::test]
async fn a_migration_that_unwound_waits_before_it_is_tried_again() {
    let name = unique("ctrl-migrate-backoff");
    let before = policy_doc(&name, "queue: {type: classic}");
    declared(&before).await;
    let mut p = with_finalizer(policy_doc(&name, "queue: {type: quorum, onChange: Migrate}"));
    let unwound = json!({"migration": {
        "phase": "RolledBack", "queue": name, "to": "quorum",
        "message": "5 deliveries of queue were still unacknowledged",
        "finishedAt": k8s_openapi::jiff::Timestamp::now().to_string(),
    }});
    p.status = Some(serde_json::from_value(unwound).unwrap());
    let (ctx, api) = harness();
    let (done, finished) = tokio::sync::oneshot::channel();
    let server =
        tokio::spawn(serve_migration_pass(api, serde_json::to_value(&p).unwrap(), name.clone(), true, finished));
    run(p.clone(), ctx).await.unwrap();
    done.send(()).unwrap();
    let pass = server.await.unwrap();
    let status = pass.statuses.last().unwrap();
    assert_eq!(status["migration"]["phase"], "RolledBack");
    let ready = condition(status, "Ready");
    assert_eq!(ready["reason"], "MigrationRolledBack", "{status}");
    assert!(ready["message"].as_str().unwrap().contains("the next attempt is at"), "{ready}");
    assert_eq!(counts(&format!("{name}.queueguard-migrating")).await, None, "nothing moved");
    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    assert_eq!(q["type"], "classic");
    remove_all(&plan_of(&p)).await;
}
