//! Which workloads a QueuePolicy guards: the rule the gate, the webhook, `check` and the
//! uninstaller share.

use crate::{
    crd::QueuePolicy,
    workload::{Kind, WorkloadKey},
};
use kube::core::{Selector, SelectorExt};
use std::collections::BTreeMap;

/// How a policy picks its workloads (spec.consumers).
#[derive(Debug, Clone, PartialEq)]
pub enum Selects {
    /// spec.consumers.workload, or its shorthand spec.consumers.deployment.
    Named(Kind, String),
    /// spec.consumers.selector over `kinds` (default: every kind); never empty (an empty
    /// selector would be every workload of the namespace: it guards none).
    Labels {
        selector: Selector,
        kinds: Vec<Kind>,
    },
    Nothing,
}

impl Selects {
    pub fn of(policy: &QueuePolicy) -> Self {
        let Some(c) = &policy.spec.consumers else { return Self::Nothing };
        if let Some(name) = &c.deployment {
            return Self::Named(Kind::Deployment, name.clone());
        }
        if let Some(w) = &c.workload {
            return Self::Named(w.kind, w.name.clone());
        }
        let kinds = c.kinds.clone().filter(|k| !k.is_empty()).unwrap_or_else(|| {
            use strum::VariantArray;
            Kind::VARIANTS.to_vec()
        });
        match c.selector.clone().map(Selector::try_from) {
            Some(Ok(selector)) if !selector.selects_all() => Self::Labels { selector, kinds },
            _ => Self::Nothing,
        }
    }

    /// Whether it picks the workload `key` with `labels` (the caller checks the namespace).
    pub fn matches(&self, kind: Kind, name: &str, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Self::Named(k, n) => *k == kind && n == name,
            Self::Labels { selector, kinds } => kinds.contains(&kind) && selector.matches(labels),
            Self::Nothing => false,
        }
    }

    /// The one workload it names, in `namespace`.
    pub fn named(&self, namespace: &str) -> Option<WorkloadKey> {
        match self {
            Self::Named(kind, name) => Some(WorkloadKey::new(*kind, namespace, name.clone())),
            _ => None,
        }
    }

    /// What it looks for, for a message saying it found nothing.
    pub fn describe_missing(&self) -> String {
        match self {
            Self::Named(kind, name) => format!("{} '{name}' not found", kind.as_str()),
            Self::Labels { kinds, .. } => format!(
                "no {} matches consumers.selector",
                kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ")
            ),
            Self::Nothing => "spec.consumers names no workload".into(),
        }
    }
}

/// Whether `policy` guards the workload `kind`/`name` with `labels` (same namespace).
pub fn guards(policy: &QueuePolicy, kind: Kind, name: &str, labels: &BTreeMap<String, String>) -> bool {
    Selects::of(policy).matches(kind, name, labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(consumers: &str) -> QueuePolicy {
        let doc = format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: p, namespace: shop}}\nspec:\n  broker: {{secretRef: {{name: r}}}}\n  queue: {{}}\n  consumers: {consumers}\n"
        );
        serde_yaml_ng::from_str(&doc).unwrap()
    }

    #[test]
    fn by_name_by_kind_by_labels_and_never_by_an_empty_selector() {
        let labels = BTreeMap::from([("tier".to_owned(), "consumers".to_owned())]);
        let none = BTreeMap::new();
        let (d, s, r) = (Kind::Deployment, Kind::StatefulSet, Kind::Rollout);
        assert!(guards(&policy("{deployment: worker}"), d, "worker", &none));
        assert!(!guards(&policy("{deployment: worker}"), s, "worker", &none), "the shorthand names a Deployment");
        assert!(!guards(&policy("{deployment: worker}"), d, "web", &labels));
        assert!(guards(&policy("{workload: {kind: StatefulSet, name: shard}}"), s, "shard", &none));
        assert!(!guards(&policy("{workload: {kind: StatefulSet, name: shard}}"), d, "shard", &none));
        let any = policy("{selector: {matchLabels: {tier: consumers}}}");
        assert!([d, s, r].iter().all(|k| guards(&any, *k, "any", &labels)), "kinds default to all three");
        let only = policy("{selector: {matchLabels: {tier: consumers}}, kinds: [Rollout]}");
        assert!(guards(&only, r, "any", &labels) && !guards(&only, d, "any", &labels));
        assert!(!guards(&policy("{selector: {matchLabels: {tier: web}}}"), d, "any", &labels));
        assert!(!guards(&policy("{selector: {}}"), d, "any", &labels), "an empty selector guards nothing");
    }
}
