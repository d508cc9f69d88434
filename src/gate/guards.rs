//! Which Deployments a QueuePolicy guards, and which Deployment a pod belongs to: the rules the
//! gate, the webhook and `queueguard check` share.

use crate::crd::QueuePolicy;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};
use std::collections::BTreeMap;

/// How a policy picks its Deployments (spec.consumers).
#[derive(Debug, Clone, PartialEq)]
pub enum Selects {
    /// spec.consumers.deployment
    Name(String),
    /// spec.consumers.selector; never empty (an empty selector would be every Deployment of the
    /// namespace: it guards none)
    Labels(Selector),
    Nothing,
}

impl Selects {
    pub fn of(policy: &QueuePolicy) -> Self {
        let Some(c) = &policy.spec.consumers else { return Self::Nothing };
        if let Some(name) = &c.deployment {
            return Self::Name(name.clone());
        }
        match c.selector.clone().map(Selector::try_from) {
            Some(Ok(s)) if !s.selects_all() => Self::Labels(s),
            _ => Self::Nothing,
        }
    }

    /// Whether it picks the Deployment named `deployment` with `labels` (same namespace).
    pub fn matches(&self, deployment: &str, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Self::Name(name) => name == deployment,
            Self::Labels(selector) => selector.matches(labels),
            Self::Nothing => false,
        }
    }
}

/// Whether `policy` guards the Deployment named `deployment` with `labels`: it names it in
/// spec.consumers.deployment, or its spec.consumers.selector matches the labels (an empty
/// selector matches nothing). The caller checks that both are in the same namespace.
pub fn guards(policy: &QueuePolicy, deployment: &str, labels: &BTreeMap<String, String>) -> bool {
    Selects::of(policy).matches(deployment, labels)
}

/// A Deployment's pods belong to a ReplicaSet named `<deployment>-<pod-template-hash>`.
pub fn deployment_of(pod: &Pod) -> Option<String> {
    let hash = pod.labels().get("pod-template-hash")?;
    let owner = pod.owner_references().iter().find(|o| o.kind == "ReplicaSet")?;
    owner.name.strip_suffix(&format!("-{hash}")).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    #[test]
    fn pods_lead_to_their_deployment_through_the_replicaset_name() {
        let pod = Pod {
            metadata: ObjectMeta {
                labels: Some(BTreeMap::from([("pod-template-hash".into(), "7d9c5b".into())])),
                owner_references: Some(vec![OwnerReference {
                    kind: "ReplicaSet".into(),
                    name: "order-worker-7d9c5b".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(deployment_of(&pod).as_deref(), Some("order-worker"));
        assert_eq!(deployment_of(&Pod::default()), None, "a bare pod belongs to no Deployment");
    }

    fn policy(consumers: &str) -> QueuePolicy {
        let doc = format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: p, namespace: shop}}\nspec:\n  broker: {{secretRef: {{name: r}}}}\n  queue: {{}}\n  consumers: {consumers}\n"
        );
        serde_yaml_ng::from_str(&doc).unwrap()
    }

    #[test]
    fn by_name_by_labels_and_never_by_an_empty_selector() {
        let labels = BTreeMap::from([("tier".to_owned(), "consumers".to_owned())]);
        assert!(guards(&policy("{deployment: worker}"), "worker", &BTreeMap::new()));
        assert!(!guards(&policy("{deployment: worker}"), "web", &labels));
        assert!(guards(&policy("{selector: {matchLabels: {tier: consumers}}}"), "any", &labels));
        assert!(!guards(&policy("{selector: {matchLabels: {tier: web}}}"), "any", &labels));
        assert!(!guards(&policy("{selector: {}}"), "any", &labels), "an empty selector guards nothing");
    }
}
