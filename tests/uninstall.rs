//! `queueguard uninstall` against the mocked API, with the real broker beside it: the operator is
//! stopped before any finalizer goes, every finalizer goes (so no namespace or CRD deletion can
//! hang on it), and no queue is touched, whatever its policy's deletionPolicy.

mod common;

use common::{api::*, *};
use http::StatusCode;
use queueguard::{
    controller::FINALIZER,
    converge::{self, Mode},
    uninstall::{Options, run},
};
use serde_json::{Value, json};
use std::time::Duration;

const OPERATOR: &str = "/apis/apps/v1/namespaces/qg/deployments/qg-queueguard";
const POLICIES: &str = "/apis/queueguard.io/v1alpha1/queuepolicies";
const PATTERNS: &str = "/apis/queueguard.io/v1alpha1/queuepatterns";

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items})
}

fn with_finalizer(mut v: Value, deleting: bool) -> Value {
    v["metadata"]["finalizers"] = json!([FINALIZER]);
    v["metadata"]["uid"] = json!(format!("uid-{}", v["metadata"]["name"].as_str().unwrap()));
    if deleting {
        v["metadata"]["deletionTimestamp"] = json!("2026-12-05T10:00:00Z");
    }
    v
}

fn operator() -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "qg-queueguard", "namespace": "qg"},
           "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "queueguard", "app.kubernetes.io/instance": "qg"}},
                    "template": {"spec": {"containers": []}}},
           "status": {"replicas": 0}})
}

const PODS: &str = "/api/v1/namespaces/qg/pods";

/// The operator's pods, `n` of them (terminating ones count: they still reconcile).
fn pods(n: usize) -> Value {
    let items = (0..n)
        .map(|i| {
            json!({"metadata": {"name": format!("qg-queueguard-{i}"), "namespace": "qg",
        "deletionTimestamp": "2026-12-05T10:00:00Z"}})
        })
        .collect();
    list("PodList", items)
}

async fn expect_pods(api: &mut ApiServer, n: usize) {
    let call = api.expect("GET", PODS).await;
    assert!(
        call.query.contains("labelSelector=app.kubernetes.io%2Finstance%3Dqg%2Capp.kubernetes.io%2Fname%3Dqueueguard"),
        "its pods, by the Deployment's selector: {}",
        call.query
    );
    call.respond(StatusCode::OK, &pods(n));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_stops_first_then_every_finalizer_goes_and_every_queue_stays() {
    // Two queues with messages: one Retain, one Delete whose policy is being deleted right now.
    let kept = policy(&unique("uninstall-retain"), "{expires: 30m}");
    let deleting = policy_doc(&unique("uninstall-delete"), "queue: {expires: 30m}\n  deletionPolicy: Delete");
    let pool = queueguard::broker::BrokerPool::new(unique("uninstall"));
    for p in [&kept, &deleting] {
        let plan = plan_of(p);
        assert!(converge::converge(&plan, &broker(&pool, &plan), &[], Mode::Declare).await.is_ready());
        publish(&plan.queue, (0..5).map(|i| format!("m{i}"))).await;
    }
    let (client, mut api) = mock_client();
    let kept_json = with_finalizer(serde_json::to_value(&kept).unwrap(), false);
    let deleting_json = with_finalizer(serde_json::to_value(&deleting).unwrap(), true);
    let pattern = with_finalizer(
        json!({"apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePattern",
               "metadata": {"name": "replies", "namespace": "test"},
               "spec": {"broker": {"secretRef": {"name": "rabbitmq"}}, "pattern": "^amq\\.gen-"}}),
        false,
    );
    let gated = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "order-worker", "namespace": "test"},
        "spec": {"selector": {}, "template": {"spec": {"containers": [],
            "readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}]}}}});
    let (kept_name, deleting_name) = (kept.metadata.name.clone().unwrap(), deleting.metadata.name.clone().unwrap());
    let deleting_queue = deleting_name.clone();
    let server = tokio::spawn(async move {
        let scale = api.expect("PATCH", &format!("{OPERATOR}/scale")).await;
        assert_eq!(scale.body, json!({"spec": {"replicas": 0}}));
        scale.respond(
            StatusCode::OK,
            &json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": "qg-queueguard", "namespace": "qg"}, "spec": {"replicas": 0}}),
        );
        // Its pods take a moment to go, terminating in their grace period (the Deployment
        // already counts none): nothing else happens until they have.
        api.expect("GET", OPERATOR).await.respond(StatusCode::OK, &operator());
        expect_pods(&mut api, 2).await;
        expect_pods(&mut api, 0).await;
        api.expect("GET", POLICIES)
            .await
            .respond(StatusCode::OK, &list("QueuePolicyList", vec![kept_json.clone(), deleting_json.clone()]));
        api.expect("GET", PATTERNS).await.respond(StatusCode::OK, &list("QueuePatternList", vec![pattern.clone()]));
        api.expect("GET", "/apis/apps/v1/deployments")
            .await
            .respond(StatusCode::OK, &list("DeploymentList", vec![gated]));
        api.expect("GET", "/apis/apps/v1/statefulsets")
            .await
            .respond(StatusCode::OK, &list("StatefulSetList", vec![gated_shard()]));
        // No Argo Rollouts in this cluster: its API is not served.
        api.expect("GET", "/apis/argoproj.io/v1alpha1/rollouts").await.respond(
            StatusCode::NOT_FOUND,
            &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "the server could not find the requested resource"}),
        );
        let mut patched = Vec::new();
        for (path, object) in [
            (format!("/apis/queueguard.io/v1alpha1/namespaces/test/queuepolicies/{kept_name}"), &kept_json),
            (format!("/apis/queueguard.io/v1alpha1/namespaces/test/queuepolicies/{deleting_name}"), &deleting_json),
            ("/apis/queueguard.io/v1alpha1/namespaces/test/queuepatterns/replies".to_owned(), &pattern),
        ] {
            let call = api.expect("PATCH", &path).await;
            assert_eq!(call.content_type, "application/json-patch+json");
            assert_eq!(
                call.body,
                json!([{"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER},
                       {"op": "remove", "path": "/metadata/finalizers/0"}])
            );
            patched.push(path);
            let mut released = object.clone();
            released["metadata"]["finalizers"] = json!([]);
            call.respond(StatusCode::OK, &released);
        }
        patched
    });
    let options = Options {
        namespace: None,
        operator: Some(("qg".into(), "qg-queueguard".into())),
        wait: Duration::from_secs(30),
        dry_run: false,
    };
    let mut said = Vec::new();
    let plan = tokio::time::timeout(Duration::from_secs(30), run(client, &options, |l| said.push(l.to_owned())))
        .await
        .expect("uninstall finished")
        .expect("uninstall succeeded");
    assert_eq!(server.await.unwrap().len(), 3, "every finalizer of the operator's is removed");
    assert_eq!(plan.release.len(), 3);
    let said = said.join("\n");
    assert!(said.starts_with("stopped the operator: Deployment qg/qg-queueguard has no pods"), "{said}");
    assert!(
        said.contains(&format!(
            "is being deleted with deletionPolicy Delete: it goes now, and its queue '{deleting_queue}' stays"
        )),
        "{said}"
    );
    assert!(said.contains("Deployment test/order-worker: its pod template has the readiness gate"), "{said}");
    assert!(
        said.contains("StatefulSet test/shard: its pod template has the readiness gate")
            && said.contains("kubectl -n test patch statefulset shard"),
        "{said}"
    );

    // The broker was never asked for anything: both queues are there with their messages.
    for p in [&kept, &deleting] {
        let plan = plan_of(p);
        assert!(
            eventually(Duration::from_secs(10), || async { counts(&plan.queue).await == Some((5, 0)) }).await,
            "queue {} kept with its messages: {:?}",
            plan.queue,
            counts(&plan.queue).await
        );
        remove_all(&plan).await;
    }
}

#[tokio::test]
async fn an_operator_that_does_not_stop_keeps_its_finalizers_and_a_dry_run_changes_nothing() {
    let (client, mut api) = mock_client();
    let server = tokio::spawn(async move {
        api.expect("PATCH", &format!("{OPERATOR}/scale")).await.respond(StatusCode::OK, &json!({"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": "qg-queueguard"}, "spec": {}}));
        api.expect("GET", OPERATOR).await.respond(StatusCode::OK, &operator());
        loop {
            // Still running, for as long as it is asked: no list, no patch follows.
            expect_pods(&mut api, 1).await;
        }
    });
    let stuck = Options {
        namespace: Some("test".into()),
        operator: Some(("qg".into(), "qg-queueguard".into())),
        wait: Duration::from_secs(1),
        dry_run: false,
    };
    let err = run(client, &stuck, |_| {}).await.unwrap_err();
    assert!(
        err.to_string().contains("still has 1 pod(s)") && err.to_string().contains("no finalizer removed"),
        "{err}"
    );
    server.abort();

    let (client, mut api) = mock_client();
    let server = tokio::spawn(async move {
        let policy = with_finalizer(serde_json::to_value(policy("orders", "{}")).unwrap(), false);
        let ns = "/apis/queueguard.io/v1alpha1/namespaces/test";
        api.expect("GET", &format!("{ns}/queuepolicies"))
            .await
            .respond(StatusCode::OK, &list("QueuePolicyList", vec![policy]));
        api.expect("GET", &format!("{ns}/queuepatterns"))
            .await
            .respond(StatusCode::OK, &list("QueuePatternList", vec![]));
        api.expect("GET", "/apis/apps/v1/namespaces/test/deployments")
            .await
            .respond(StatusCode::OK, &list("DeploymentList", vec![]));
        api.expect("GET", "/apis/apps/v1/namespaces/test/statefulsets")
            .await
            .respond(StatusCode::OK, &list("StatefulSetList", vec![]));
        api.expect("GET", "/apis/argoproj.io/v1alpha1/namespaces/test/rollouts")
            .await
            .respond(StatusCode::OK, &list("RolloutList", vec![]));
    });
    let dry = Options { dry_run: true, ..stuck };
    let mut said = Vec::new();
    run(client, &dry, |l| said.push(l.to_owned())).await.unwrap();
    server.await.unwrap();
    assert_eq!(said, ["would remove the finalizer of QueuePolicy test/orders"], "no scale, no patch");
}

/// A StatefulSet whose pod template carries the readiness gate.
fn gated_shard() -> serde_json::Value {
    json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
           "metadata": {"name": "shard", "namespace": "test"},
           "spec": {"serviceName": "shard", "selector": {}, "template": {"spec": {"containers": [],
                    "readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}]}}}})
}
