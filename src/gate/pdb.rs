//! The PodDisruptionBudget that keeps node drains (which are not rollouts) from taking the
//! consumers below minAttached: one per workload, however many policies guard it.

use crate::{
    crd::API_VERSION,
    names::MANAGED_BY,
    workload::{Kind, Workload},
};
use k8s_openapi::{
    api::policy::v1::PodDisruptionBudget,
    apimachinery::pkg::{
        apis::meta::v1::{ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use std::collections::BTreeMap;

/// The PDB name for a workload (a DNS subdomain, at most 253 chars): `<name>-queueguard` for a
/// Deployment (as before there were other kinds), `<name>-<kind>-queueguard` for the others, so
/// a Deployment and a StatefulSet of one name do not share one.
pub fn name(kind: Kind, workload: &str) -> String {
    let suffix = match kind {
        Kind::Deployment => "-queueguard".to_owned(),
        other => format!("-{}-queueguard", other.as_str().to_ascii_lowercase()),
    };
    let keep = workload.len().min(253 - suffix.len());
    format!("{}{suffix}", &workload[..keep])
}

/// `minAvailable: min_attached` over the workload's pods, owned by every policy guarding it
/// (`owners`: name and uid), so the garbage collector removes it only once all of them are gone.
pub fn desired(workload: &Workload, owners: &[(String, String)], min_attached: i32) -> Option<PodDisruptionBudget> {
    let selector = workload.selector()?;
    let min_available = drainable(min_attached, workload.replicas());
    let kind = workload.key.kind;
    let workload_name = workload.key.name.as_str();
    let mut owners: Vec<OwnerReference> = owners
        .iter()
        .map(|(name, uid)| OwnerReference {
            api_version: API_VERSION.into(),
            kind: "QueuePolicy".into(),
            name: name.clone(),
            uid: uid.clone(),
            ..Default::default()
        })
        .collect();
    owners.sort_by(|a, b| a.name.cmp(&b.name));
    Some(PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some(name(kind, workload_name)),
            namespace: Some(workload.key.namespace.clone()),
            labels: Some(BTreeMap::from([
                (MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned()),
                (kind.budget_label().to_owned(), workload_name.to_owned()),
            ])),
            owner_references: Some(owners),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::policy::v1::PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(min_available)),
            selector: Some(selector),
            ..Default::default()
        }),
        status: None,
    })
}

/// What a budget can ask of `replicas` pods and still let a node drain evict one: minAttached
/// has no upper bound in the spec, and a budget no eviction can satisfy blocks every drain of
/// every node the pods run on, for good. A drain then takes the pods one at a time, each
/// replaced before the next goes.
pub fn drainable(min_attached: i32, replicas: i32) -> i32 {
    min_attached.min(replicas.saturating_sub(1)).max(0)
}

/// Whether `existing` already says what `want` says (so no write is needed).
pub fn same(existing: &PodDisruptionBudget, want: &PodDisruptionBudget) -> bool {
    let labels_kept = want
        .metadata
        .labels
        .iter()
        .flatten()
        .all(|(k, v)| existing.metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v));
    let uids = |b: &PodDisruptionBudget| {
        let mut u: Vec<String> = b.metadata.owner_references.iter().flatten().map(|o| o.uid.clone()).collect();
        u.sort();
        u
    };
    let spec = |b: &PodDisruptionBudget| b.spec.as_ref().map(|s| (s.min_available.clone(), s.selector.clone()));
    labels_kept && uids(existing) == uids(want) && spec(existing) == spec(want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::{
        api::apps::v1::{Deployment, DeploymentSpec},
        apimachinery::pkg::apis::meta::v1::LabelSelector,
    };

    fn worker() -> Deployment {
        let selector = LabelSelector {
            match_labels: Some(BTreeMap::from([("app".into(), "worker".into())])),
            ..Default::default()
        };
        Deployment {
            metadata: ObjectMeta { name: Some("worker".into()), namespace: Some("shop".into()), ..Default::default() },
            spec: Some(DeploymentSpec { selector, ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn one_budget_per_deployment_owned_by_every_guarding_policy() {
        let owners = [("orders".to_owned(), "u1".to_owned()), ("events".to_owned(), "u2".to_owned())];
        let mut worker = worker();
        worker.spec.as_mut().unwrap().replicas = Some(3);
        let pdb = desired(&Workload::new(worker.clone()), &owners, 2).unwrap();
        assert_eq!(pdb.metadata.name.as_deref(), Some("worker-queueguard"));
        assert_eq!(pdb.metadata.namespace.as_deref(), Some("shop"));
        let labels = pdb.metadata.labels.as_ref().unwrap();
        assert_eq!(
            (labels[MANAGED_BY.0].as_str(), labels["queueguard.io/deployment"].as_str()),
            (MANAGED_BY.1, "worker")
        );
        let spec = pdb.spec.as_ref().unwrap();
        assert_eq!(spec.min_available, Some(IntOrString::Int(2)));
        assert_eq!(spec.selector, worker.spec.as_ref().map(|s| s.selector.clone()));
        let refs = pdb.metadata.owner_references.as_ref().unwrap();
        assert_eq!(refs.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["events", "orders"]);
        assert!(refs.iter().all(|o| o.kind == "QueuePolicy" && o.controller.is_none()), "no single controller");
        assert!(same(&pdb, &pdb));
        let fewer = desired(&Workload::new(worker.clone()), &owners[..1], 2).unwrap();
        assert!(!same(&pdb, &fewer));
        assert!(!same(&pdb, &desired(&Workload::new(worker), &owners, 1).unwrap()));
    }

    #[test]
    fn a_budget_always_leaves_a_drain_one_pod_to_evict() {
        assert_eq!(drainable(2, 5), 2);
        assert_eq!(drainable(5, 5), 4, "minAttached of every replica would block every drain");
        assert_eq!(drainable(1_000_000, 3), 2);
        assert_eq!((drainable(1, 1), drainable(1, 0)), (0, 0));
        let mut one = worker();
        one.spec.as_mut().unwrap().replicas = Some(1);
        let pdb = desired(&Workload::new(one), &[("orders".into(), "u1".into())], 1).unwrap();
        assert_eq!(pdb.spec.unwrap().min_available, Some(IntOrString::Int(0)));
    }

    #[test]
    fn names_fit_a_dns_subdomain() {
        assert_eq!(name(Kind::Deployment, &"d".repeat(253)).len(), 253);
        assert_eq!(name(Kind::StatefulSet, &"d".repeat(253)).len(), 253);
        assert_eq!(name(Kind::Deployment, "a"), "a-queueguard");
        assert_eq!(name(Kind::StatefulSet, "a"), "a-statefulset-queueguard");
        assert_eq!(name(Kind::Rollout, "a"), "a-rollout-queueguard");
    }
}
