//! Fixtures for unit tests.

use crate::{
    crd::{ConsumersSpec, FailurePolicy, GateMode, MatchBy, QueuePolicy},
    gate::{
        index::{GateIndex, ObjectKey, ReplicaSetFacts},
        pods::PodFacts,
    },
    plan::GatePlan,
    workload::{Kind, WorkloadKey, owner::PodOwner},
};
use std::time::Duration;

/// A QueuePolicy `shop/orders` using Secret `rabbitmq`, with `queue` as its spec.queue (YAML).
pub fn policy_yaml(queue: &str) -> QueuePolicy {
    let doc = format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: orders, namespace: shop, generation: 1}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  queue: {queue}\n"
    );
    serde_yaml_ng::from_str(&doc).expect("fixture parses")
}

/// A gate plan: Enforce, failurePolicy Closed, attachTimeout 10m, minAttachedSeconds 5, by pod IP,
/// guarding Deployment `worker`.
pub fn gate_plan(min_attached: i32) -> GatePlan {
    GatePlan {
        mode: GateMode::Enforce,
        failure_policy: FailurePolicy::Closed,
        attach_timeout: Duration::from_secs(600),
        manage_strategy: true,
        pod_disruption_budget: true,
        min_attached,
        min_attached_for: Duration::from_secs(5),
        match_by: MatchBy::PodIp,
        consumers: ConsumersSpec {
            deployment: Some("worker".into()),
            workload: None,
            selector: None,
            kinds: None,
            min_attached,
            min_attached_seconds: 5,
            match_by: MatchBy::PodIp,
        },
    }
}

/// The ReplicaSet of Deployment `shop/worker` whose pods [`pod_facts`] makes.
pub const WORKER_REPLICA_SET: &str = "worker-7d9c5b";

/// Syncs the workload feeds of `index` with Deployment `worker`'s ReplicaSet and no
/// StatefulSets or Rollouts (the Deployments are the test's own).
pub fn sync_workload_feeds(index: &mut GateIndex) {
    index.replace_workloads(Kind::StatefulSet, vec![]);
    index.kind_unavailable(Kind::Rollout);
    index.replace_replica_sets(vec![ReplicaSetFacts {
        key: ObjectKey::new("shop", WORKER_REPLICA_SET),
        owner: Some(WorkloadKey::new(Kind::Deployment, "shop", "worker")),
    }]);
}

/// A running pod `shop/<name>` of Deployment `worker` (through its ReplicaSet) with the
/// readiness gate and no condition yet, on `ip` since `since_ms`, its containers ready since
/// then.
pub fn pod_facts(name: &str, ip: &str, since_ms: i64) -> PodFacts {
    PodFacts {
        namespace: "shop".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        owner: Some(PodOwner::ReplicaSet(WORKER_REPLICA_SET.into())),
        ips: vec![ip.into()],
        ip_since_ms: Some(since_ms),
        has_gate: true,
        condition: None,
        containers_ready_since_ms: Some(since_ms),
        deleting: false,
        terminal: false,
    }
}
