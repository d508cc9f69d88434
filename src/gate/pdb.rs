//! The PodDisruptionBudget that keeps node drains (which are not rollouts) from taking the
//! consumers below minAttached.

use k8s_openapi::{
    api::{apps::v1::Deployment, policy::v1::PodDisruptionBudget},
    apimachinery::pkg::{
        apis::meta::v1::{ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use std::collections::BTreeMap;

/// Label on every PDB the operator owns; its owner reference names the QueuePolicy.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "queueguard");

/// The PDB name for a policy and one of its Deployments (a DNS subdomain, at most 253 chars).
pub fn name(policy: &str, deployment: &str) -> String {
    let mut name = format!("{policy}-{deployment}");
    name.truncate(253);
    name.trim_end_matches(['-', '.']).to_owned()
}

/// `minAvailable: minAttached` over the Deployment's pods, owned by the QueuePolicy.
pub fn desired(
    policy: &str,
    owner: OwnerReference,
    deployment: &Deployment,
    min_attached: i32,
) -> Option<PodDisruptionBudget> {
    let selector = deployment.spec.as_ref()?.selector.clone();
    let deployment_name = deployment.metadata.name.as_deref()?;
    Some(PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some(name(policy, deployment_name)),
            namespace: deployment.metadata.namespace.clone(),
            labels: Some(BTreeMap::from([(MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned())])),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::policy::v1::PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(min_attached)),
            selector: Some(selector),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::{api::apps::v1::DeploymentSpec, apimachinery::pkg::apis::meta::v1::LabelSelector};

    #[test]
    fn pdb_selects_the_deployments_pods_and_is_owned_by_the_policy() {
        let selector = LabelSelector {
            match_labels: Some(BTreeMap::from([("app".into(), "worker".into())])),
            ..Default::default()
        };
        let d = Deployment {
            metadata: ObjectMeta { name: Some("worker".into()), namespace: Some("shop".into()), ..Default::default() },
            spec: Some(DeploymentSpec { selector: selector.clone(), ..Default::default() }),
            ..Default::default()
        };
        let owner = OwnerReference {
            name: "orders".into(),
            kind: "QueuePolicy".into(),
            controller: Some(true),
            ..Default::default()
        };
        let pdb = desired("orders", owner, &d, 2).unwrap();
        assert_eq!(pdb.metadata.name.as_deref(), Some("orders-worker"));
        assert_eq!(pdb.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(pdb.metadata.labels.as_ref().unwrap()[MANAGED_BY.0], MANAGED_BY.1);
        let spec = pdb.spec.unwrap();
        assert_eq!(spec.min_available, Some(IntOrString::Int(2)));
        assert_eq!(spec.selector, Some(selector));
        assert_eq!(pdb.metadata.owner_references.unwrap()[0].kind, "QueuePolicy");
    }

    #[test]
    fn names_fit_a_dns_subdomain() {
        let long = name(&"p".repeat(200), &"d".repeat(100));
        assert_eq!(long.len(), 253);
        assert_eq!(name("a", "b"), "a-b");
    }
}
