//! QueuePattern on the real broker: its policy reaches plainly declared queues (they expire),
//! a reply-queue leak and orphaned replies are seen and clear; and the controller glue against
//! the mocked API (finalizer, status, Events).

mod common;

use common::{api::*, *};
use http::StatusCode;
use k8s_openapi::{ByteString, api::core::v1::Secret};
use lapin::{
    options::{BasicGetOptions, QueueDeclareOptions},
    types::FieldTable,
};
use queueguard::{
    broker::{Broker, BrokerPool},
    controller::{Context, FINALIZER, FINDINGS_EVERY, pattern as pattern_controller},
    crd::StatsSource,
    pass,
    pattern::{self, PatternPlan, WatchMemory, WatchReport, broker as pattern_broker, crd::QueuePattern},
    plan::Limits,
};
use serde_json::{Value, json};
use std::{sync::Arc, time::Duration};

fn pattern_doc(name: &str, spec: &str) -> QueuePattern {
    serde_yaml_ng::from_str(&format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePattern\nmetadata: {{name: {name:?}, namespace: test, generation: 1}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  {spec}\n"
    ))
    .unwrap()
}

struct Watch {
    plan: PatternPlan,
    broker: Arc<Broker>,
    memory: WatchMemory,
    prefix: String,
    _pool: BrokerPool,
}

impl Watch {
    async fn new(expires: &str) -> Self {
        let prefix = unique("replies");
        let p = pattern_doc(&prefix, &format!("pattern: '^{}\\.'\n  expires: {expires}", regex_escape(&prefix)));
        let plan = pattern::plan(&p, Limits { min_expires: Duration::from_millis(100) }).unwrap();
        let pool = BrokerPool::new(unique("patterns-op"));
        let broker = pass::broker_for(
            &pool,
            &queueguard::broker_source::BrokerSource::Secret { name: "rabbitmq".into() },
            None,
            &credentials(),
        )
        .unwrap();
        let applied = pattern_broker::apply_policy(&plan, &broker).await;
        assert!(applied.is_ok(), "{applied:?}");
        Self { plan, broker, memory: WatchMemory::default(), prefix, _pool: pool }
    }

    async fn look(&mut self) -> WatchReport {
        let looked = pattern_broker::matching(&self.plan, &self.broker, Duration::ZERO).await.unwrap();
        if prometheus_base().is_some() {
            assert_eq!(looked.source, StatsSource::Prometheus, "QUEUEGUARD_TEST_PROMETHEUS names this broker's plugin");
        }
        let (memory, report) = pattern::evaluate(&self.memory, &looked.seen, &self.plan.ignore);
        self.memory = memory;
        report
    }

    fn queue(&self, i: usize) -> String {
        format!("{}.{i}", self.prefix)
    }

    async fn cleanup(self) {
        pattern_broker::remove_policy(&self.plan, &self.broker).await.unwrap();
    }
}

fn regex_escape(s: &str) -> String {
    s.replace('.', "\\.")
}

fn seen(report: &WatchReport, finding: &str) -> Option<String> {
    report.verdicts.iter().find(|(f, _)| f.as_str() == finding).and_then(|(_, s)| s.clone())
}

/// A client's plain declare of a reply queue: no arguments at all.
async fn declare_plain(name: &str) {
    let (_conn, ch) = app().await;
    ch.queue_declare(name.into(), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
}

#[tokio::test]
async fn the_pattern_policy_expires_plainly_declared_queues() {
    let watch = Watch::new("8s").await;
    let policies = mgmt_get("policies/%2F").await.unwrap();
    let ours = policies.as_array().unwrap().iter().find(|p| p["name"] == watch.plan.policy_name.as_str()).unwrap();
    assert_eq!(ours["definition"], json!({"expires": 8000}));
    assert_eq!(ours["apply-to"], "queues");

    let reply = watch.queue(1);
    declare_plain(&reply).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            mgmt_get(&format!("queues/%2F/{}", enc(&reply)))
                .await
                .is_some_and(|q| q["policy"] == watch.plan.policy_name.as_str())
        })
        .await,
        "the queue follows the pattern's policy"
    );
    assert!(eventually(Duration::from_secs(25), || async { !exists(&reply).await }).await, "and expires unused");
    let unrelated = unique("unrelated");
    declare_plain(&unrelated).await;
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(exists(&unrelated).await, "a queue the pattern does not match keeps living");
    delete_queues(&[&unrelated]).await;
    watch.cleanup().await;
}

#[tokio::test]
async fn a_reply_queue_per_call_is_a_leak_until_it_stops() {
    let mut watch = Watch::new("10m").await;
    let mut created = 0;
    let mut leak = None;
    for _ in 0..4 {
        for _ in 0..5 {
            declare_plain(&watch.queue(created)).await;
            created += 1;
        }
        leak = seen(&watch.look().await, "QueueLeak");
    }
    let leak = leak.expect("four looks in a row with more queues");
    assert!(leak.starts_with("20 queues match, up from 5 over the last 3 looks"), "{leak}");

    let report = watch.look().await;
    assert_eq!(seen(&report, "QueueLeak"), None, "no new queues: no leak");
    let names: Vec<String> = (0..created).map(|i| watch.queue(i)).collect();
    delete_queues(&names.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let report = watch.look().await;
    assert_eq!((report.queues.matching, report.queues.deleted), (0, 20));
    watch.cleanup().await;
}

#[tokio::test]
async fn replies_nobody_reads_are_orphans_until_read() {
    let mut watch = Watch::new("10m").await;
    let reply = watch.queue(7);
    declare_plain(&reply).await;
    publish(&reply, ["the answer".to_owned()]).await;
    let mut orphans = None;
    for _ in 0..20 {
        orphans = seen(&watch.look().await, "OrphanedReplies");
        if orphans.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let orphans = orphans.expect("the management API reports the ready message within its 5 s interval");
    assert!(orphans.contains(&reply), "{orphans}");

    let (_conn, ch) = app().await;
    let got = ch.basic_get(reply.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap();
    assert!(got.is_some(), "the requester finally reads its reply");
    assert!(
        eventually(Duration::from_secs(20), || async {
            let r = watch_look(&watch).await;
            seen(&r, "OrphanedReplies").is_none()
        })
        .await
    );
    delete_queues(&[&reply]).await;
    watch.cleanup().await;
}

/// A look that does not disturb the leak memory (orphans need no history).
async fn watch_look(watch: &Watch) -> WatchReport {
    let looked = pattern_broker::matching(&watch.plan, &watch.broker, Duration::ZERO).await.unwrap();
    pattern::evaluate(&WatchMemory::default(), &looked.seen, &[]).1
}

fn secret() -> Value {
    let mut s = Secret::default();
    s.metadata.name = Some("rabbitmq".into());
    s.metadata.namespace = Some("test".into());
    s.data = Some(
        [("uri", Some(broker_uri())), ("managementUri", Some(management_base())), ("prometheusUri", prometheus_base())]
            .into_iter()
            .filter_map(|(k, v)| Some((k.to_owned(), ByteString(v?.into_bytes()))))
            .collect(),
    );
    serde_json::to_value(s).unwrap()
}

#[tokio::test]
async fn the_controller_applies_the_policy_and_reports_status_and_events() {
    const PATTERNS: &str = "/apis/queueguard.io/v1alpha1/namespaces/test/queuepatterns";
    let (client, mut api) = mock_client();
    let ctx = Arc::new(Context::new(client, &unique("pattern-ctrl")).patterns());
    let name = unique("ctrl-pattern");
    let mut p = pattern_doc(&name, &format!("pattern: '^{}\\.'", regex_escape(&name)));
    p.metadata.finalizers = Some(vec![FINALIZER.into()]);
    p.metadata.uid = Some("0b7c5b1e-0000-4000-8000-000000000002".into());
    let echo = serde_json::to_value(&p).unwrap();
    let status_path = format!("{PATTERNS}/{name}/status");
    let server = tokio::spawn(async move {
        api.expect("GET", "/api/v1/namespaces/test/secrets/rabbitmq").await.respond(StatusCode::OK, &secret());
        let call = api.expect("PATCH", &status_path).await;
        assert_eq!(call.content_type, "application/apply-patch+yaml");
        let status = call.body["status"].clone();
        assert_eq!(call.body["kind"], "QueuePattern");
        let ready = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap().clone();
        assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("True"), Some("PolicyApplied")));
        assert_eq!(status["queues"]["matching"], 0);
        let source = status["statsSource"].as_str();
        assert!(matches!(source, Some("Management" | "Prometheus")), "the look says where its counts come from");
        if prometheus_base().is_some() {
            assert_eq!(source, Some("Prometheus"), "through the Secret's prometheusUri");
        }
        assert!(!status.to_string().contains("guest:guest"), "no credentials in status");
        call.respond(StatusCode::OK, &echo);
        let event = api.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
        assert_eq!(
            (event.body["reason"].as_str(), event.body["regarding"]["kind"].as_str()),
            (Some("PolicyApplied"), Some("QueuePattern"))
        );
        let body = event.body.clone();
        event.respond(StatusCode::CREATED, &body);
        status
    });
    let action =
        tokio::time::timeout(Duration::from_secs(30), pattern_controller::reconcile(Arc::new(p.clone()), ctx.clone()))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(action, kube::runtime::controller::Action::requeue(FINDINGS_EVERY));
    server.await.unwrap();
    let policy = format!("queueguard.pattern.test.{name}");
    assert!(mgmt_get(&format!("policies/%2F/{}", enc(&policy))).await.is_some(), "the policy is on the broker");
    mgmt_delete(&format!("policies/%2F/{}", enc(&policy))).await;
}
