//! Fixtures for unit tests.

use crate::{
    crd::{ConsumersSpec, FailurePolicy, GateMode, MatchBy, QueuePolicy},
    gate::{GatePlan, pods::PodFacts},
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
            selector: None,
            min_attached,
            min_attached_seconds: 5,
            match_by: MatchBy::PodIp,
        },
    }
}

/// A running pod `shop/<name>` of Deployment `worker` with the readiness gate and no condition
/// yet, on `ip` since `since_ms`, its containers ready since then.
pub fn pod_facts(name: &str, ip: &str, since_ms: i64) -> PodFacts {
    PodFacts {
        namespace: "shop".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        deployment: Some("worker".into()),
        ips: vec![ip.into()],
        ip_since_ms: Some(since_ms),
        has_gate: true,
        condition: None,
        containers_ready_since_ms: Some(since_ms),
        deleting: false,
        terminal: false,
    }
}
