//! The gate's side of the mocked API, shared by the controller and cluster tests: the consumer
//! Deployment and its pod as the watches deliver them, and the pod writer's patches.

use super::api::ApiServer;
use http::StatusCode;
use k8s_openapi::api::{
    apps::v1::{Deployment, ReplicaSet, StatefulSet},
    core::v1::Pod,
    policy::v1::PodDisruptionBudget,
};
use queueguard::{controller::Context, crd::QueuePolicy};
use serde_json::{Value, json};

pub fn worker_deployment(strategy: Value) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "worker", "namespace": "test", "generation": 1, "uid": "d-uid"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "worker"}}, "strategy": strategy,
                 "template": {"metadata": {"labels": {"app": "worker"}}, "spec": {"containers": [{"name": "w", "image": "w"}]}}},
        "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1},
    })
}

/// The worker's pod, started a minute ago, its containers ready for 50 s, and its gate condition
/// as given (set 40 s ago).
pub fn worker_pod(gate: Option<&str>) -> Value {
    let ago =
        |s: i64| (k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(s)).to_string();
    let mut conditions = vec![json!({"type": "ContainersReady", "status": "True", "lastTransitionTime": ago(50)})];
    if let Some(status) = gate {
        conditions.push(json!({"type": "queueguard.io/consumer-attached", "status": status, "reason": "ConsumerAttached", "lastTransitionTime": ago(40)}));
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "worker-abc-1", "namespace": "test", "uid": "pod-uid-1",
                     "labels": {"app": "worker", "pod-template-hash": "abc"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "worker-abc", "uid": "rs-uid", "controller": true}]},
        "spec": {"containers": [{"name": "w", "image": "w"}], "readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}]},
        "status": {"podIP": "127.0.0.1", "startTime": ago(60), "phase": "Running", "conditions": conditions},
    })
}

/// The worker's ReplicaSet, as the metadata watch delivers it: owned by Deployment `worker`.
pub fn worker_replica_set() -> kube::api::PartialObjectMeta<ReplicaSet> {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "worker-abc", "namespace": "test", "uid": "rs-uid",
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker", "uid": "d-uid", "controller": true}]},
    }))
    .unwrap()
}

/// What the watches would deliver: each kind listed once (no StatefulSets, the worker's
/// ReplicaSet, and no Argo Rollouts API), so the gate has synced.
pub fn watched(ctx: &Context, policies: &[&QueuePolicy], deployments: &[Value], pods: &[Value], budgets: &[Value]) {
    use kube::runtime::watcher::Event;
    let gate = &ctx.gate;
    gate.on(&Event::<QueuePolicy>::Init);
    for p in policies {
        gate.on(&Event::InitApply((*p).clone()));
    }
    gate.on(&Event::<QueuePolicy>::InitDone);
    gate.on(&Event::<Deployment>::Init);
    for d in deployments {
        gate.on(&Event::InitApply(serde_json::from_value::<Deployment>(d.clone()).unwrap()));
    }
    gate.on(&Event::<Deployment>::InitDone);
    gate.on(&Event::<StatefulSet>::Init);
    gate.on(&Event::<StatefulSet>::InitDone);
    gate.on(&Event::Init::<kube::api::PartialObjectMeta<ReplicaSet>>);
    gate.on(&Event::InitApply(worker_replica_set()));
    gate.on(&Event::InitDone::<kube::api::PartialObjectMeta<ReplicaSet>>);
    gate.kind_unavailable(queueguard::workload::Kind::Rollout);
    gate.on(&Event::<PodDisruptionBudget>::Init);
    for b in budgets {
        gate.on(&Event::InitApply(serde_json::from_value::<PodDisruptionBudget>(b.clone()).unwrap()));
    }
    gate.on(&Event::<PodDisruptionBudget>::InitDone);
    gate.on(&Event::<Pod>::Init);
    for p in pods {
        gate.on(&Event::InitApply(serde_json::from_value::<Pod>(p.clone()).unwrap()));
    }
    gate.on(&Event::<Pod>::InitDone);
}

/// The one pod writer's patch of the gate condition: a strategic merge on pods/status with the
/// pod's UID as precondition, then its Event on the pod.
pub async fn expect_pod_condition(api: &mut ApiServer, status: &str, reason: &str) -> Value {
    let call = api.expect("PATCH", "/api/v1/namespaces/test/pods/worker-abc-1/status").await;
    assert_eq!(call.content_type, "application/strategic-merge-patch+json");
    assert_eq!(call.body["metadata"], json!({"uid": "pod-uid-1"}));
    let conditions = call.body["status"]["conditions"].as_array().unwrap().clone();
    assert_eq!(conditions.len(), 1, "only the gate condition is written");
    assert_eq!(
        (conditions[0]["type"].as_str(), conditions[0]["status"].as_str(), conditions[0]["reason"].as_str()),
        (Some("queueguard.io/consumer-attached"), Some(status), Some(reason))
    );
    call.respond(StatusCode::OK, &worker_pod(Some(status)));
    let call = api.expect("POST", "/apis/events.k8s.io/v1/namespaces/test/events").await;
    let event = call.body.clone();
    assert_eq!(
        (event["regarding"]["kind"].as_str(), event["regarding"]["name"].as_str()),
        (Some("Pod"), Some("worker-abc-1"))
    );
    assert_eq!(event["regarding"]["uid"], "pod-uid-1");
    call.respond(StatusCode::CREATED, &event);
    conditions[0].clone()
}

/// A new gated pod's first condition: False with `reason`, written at once, with no Event.
pub async fn expect_first_condition(api: &mut ApiServer, reason: &str) -> Value {
    let call = api.expect("PATCH", "/api/v1/namespaces/test/pods/worker-abc-1/status").await;
    assert_eq!(call.content_type, "application/strategic-merge-patch+json");
    assert_eq!(call.body["metadata"], json!({"uid": "pod-uid-1"}));
    let condition = call.body["status"]["conditions"][0].clone();
    assert_eq!((condition["status"].as_str(), condition["reason"].as_str()), (Some("False"), Some(reason)));
    call.respond(StatusCode::OK, &worker_pod(Some("False")));
    condition
}

/// The writer's requests that may come in any order (an Event is published beside the next
/// write), each checked against one of `expected` (method, path), answered with its own body.
pub async fn expect_unordered(api: &mut ApiServer, expected: &[(&str, &str)]) -> Vec<(String, Value)> {
    let mut left: Vec<(&str, &str)> = expected.to_vec();
    let mut seen = Vec::new();
    while !left.is_empty() {
        let call = api
            .next(std::time::Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("expected {left:?}, but no request came"));
        let at = left
            .iter()
            .position(|(m, p)| *m == call.method && *p == call.path)
            .unwrap_or_else(|| panic!("unexpected {} {} (expected one of {left:?})", call.method, call.path));
        left.remove(at);
        let (group, resource, verb) = super::api::rbac_terms(&call.method, &call.path, &call.query);
        assert!(queueguard::rbac::allows(&group, &resource, &verb), "{verb} on {group}/{resource} is not granted");
        let status = if call.method == "POST" { StatusCode::CREATED } else { StatusCode::OK };
        let body = call.body.clone();
        seen.push((format!("{} {}?{} {}", call.method, call.path, call.query, call.content_type), body.clone()));
        call.respond(status, &body);
    }
    seen
}
