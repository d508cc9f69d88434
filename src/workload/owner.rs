//! Which workload a pod belongs to, through `ownerReferences` only: a StatefulSet owns its pods
//! directly; a ReplicaSet owns a Deployment's or a Rollout's pods, and its own controller
//! reference says which. Names are never parsed.

use super::{Kind, WorkloadKey};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// A pod's controller, as its ownerReferences name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PodOwner {
    /// A ReplicaSet's name: a Deployment's or a Rollout's, as the ReplicaSet says.
    ReplicaSet(String),
    StatefulSet(String),
}

/// The controller reference of an object: the one marked `controller`, else the only one.
fn controller(meta: &ObjectMeta) -> Option<&OwnerReference> {
    let refs = meta.owner_references.as_deref().unwrap_or_default();
    refs.iter().find(|o| o.controller == Some(true)).or(match refs {
        [only] => Some(only),
        _ => None,
    })
}

/// The pod's controller, when it is a ReplicaSet or a StatefulSet (apps/v1).
pub fn pod_owner(pod: &ObjectMeta) -> Option<PodOwner> {
    let owner = controller(pod).filter(|o| o.api_version == "apps/v1")?;
    match owner.kind.as_str() {
        "ReplicaSet" => Some(PodOwner::ReplicaSet(owner.name.clone())),
        "StatefulSet" => Some(PodOwner::StatefulSet(owner.name.clone())),
        _ => None,
    }
}

/// The workload controlling a ReplicaSet: a Deployment (apps/v1) or a Rollout (argoproj.io).
pub fn replica_set_owner(replica_set: &ObjectMeta) -> Option<WorkloadKey> {
    let owner = controller(replica_set)?;
    let group = owner.api_version.split_once('/').map_or("", |(g, _)| g);
    let kind = match (group, owner.kind.as_str()) {
        ("apps", "Deployment") => Kind::Deployment,
        ("argoproj.io", "Rollout") => Kind::Rollout,
        _ => return None,
    };
    Some(WorkloadKey::new(kind, replica_set.namespace.clone().unwrap_or_default(), owner.name.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(namespace: &str, owners: &[(&str, &str, &str, Option<bool>)]) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(namespace.into()),
            owner_references: Some(
                owners
                    .iter()
                    .map(|(api_version, kind, name, controller)| OwnerReference {
                        api_version: (*api_version).into(),
                        kind: (*kind).into(),
                        name: (*name).into(),
                        controller: *controller,
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn pods_name_their_replicaset_or_statefulset() {
        let rs = meta("shop", &[("apps/v1", "ReplicaSet", "worker-7d9c5b", Some(true))]);
        assert_eq!(pod_owner(&rs), Some(PodOwner::ReplicaSet("worker-7d9c5b".into())));
        let sts = meta("shop", &[("apps/v1", "StatefulSet", "shard", Some(true))]);
        assert_eq!(pod_owner(&sts), Some(PodOwner::StatefulSet("shard".into())));
        let job = meta("shop", &[("batch/v1", "Job", "migrate", Some(true))]);
        assert_eq!(pod_owner(&job), None);
        assert_eq!(pod_owner(&ObjectMeta::default()), None, "a bare pod belongs to no workload");
        let two = meta("shop", &[("v1", "ConfigMap", "x", None), ("apps/v1", "StatefulSet", "shard", Some(true))]);
        assert_eq!(pod_owner(&two), Some(PodOwner::StatefulSet("shard".into())), "the controller reference wins");
    }

    #[test]
    fn replicasets_name_their_deployment_or_rollout() {
        let d = meta("shop", &[("apps/v1", "Deployment", "worker", Some(true))]);
        assert_eq!(replica_set_owner(&d), Some(WorkloadKey::new(Kind::Deployment, "shop", "worker")));
        let r = meta("shop", &[("argoproj.io/v1alpha1", "Rollout", "worker", Some(true))]);
        assert_eq!(replica_set_owner(&r), Some(WorkloadKey::new(Kind::Rollout, "shop", "worker")));
        let bare = meta("shop", &[]);
        assert_eq!(replica_set_owner(&bare), None, "a ReplicaSet of its own guards nothing");
    }
}
