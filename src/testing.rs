//! Fixtures for unit tests.

use crate::crd::QueuePolicy;

/// A QueuePolicy `shop/orders` using Secret `rabbitmq`, with `queue` as its spec.queue (YAML).
pub fn policy_yaml(queue: &str) -> QueuePolicy {
    let doc = format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: orders, namespace: shop, generation: 1}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  queue: {queue}\n"
    );
    serde_yaml_ng::from_str(&doc).expect("fixture parses")
}
