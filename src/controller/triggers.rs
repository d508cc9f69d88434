//! What, besides a QueuePolicy changing, makes a policy reconcile: its consumer Deployment or one
//! of that Deployment's pods changing, and a consumer attaching to or detaching from its queue.

use crate::{
    consumers::{ConsumerTracker, QueueKey},
    crd::QueuePolicy,
};
use k8s_openapi::api::{apps::v1::Deployment, core::v1::Pod};
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
    runtime::reflector::{ObjectRef, Store},
};
use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
};
use tokio::sync::{broadcast::error::RecvError, mpsc};

/// Routes broker consumer changes to the policies guarding the queue.
pub struct Triggers {
    index: Arc<Mutex<HashMap<QueueKey, HashSet<ObjectRef<QueuePolicy>>>>>,
    forwarding: Mutex<HashSet<usize>>,
    tx: mpsc::UnboundedSender<ObjectRef<QueuePolicy>>,
}

impl Triggers {
    pub fn new() -> (Self, mpsc::UnboundedReceiver<ObjectRef<QueuePolicy>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { index: Arc::default(), forwarding: Mutex::default(), tx }, rx)
    }

    /// Records that `policy` guards `queue`, and makes sure `tracker`'s changes reach it.
    pub fn register(&self, queue: QueueKey, policy: ObjectRef<QueuePolicy>, tracker: &Arc<ConsumerTracker>) {
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        for refs in index.values_mut() {
            refs.remove(&policy);
        }
        index.retain(|_, refs| !refs.is_empty());
        index.entry(queue).or_default().insert(policy);
        drop(index);
        let id = Arc::as_ptr(tracker) as usize;
        if self.forwarding.lock().unwrap_or_else(|p| p.into_inner()).insert(id) {
            tokio::spawn(forward(tracker.subscribe(), self.index.clone(), self.tx.clone()));
        }
    }

    /// Forgets a deleted policy.
    pub fn forget(&self, policy: &ObjectRef<QueuePolicy>) {
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        for refs in index.values_mut() {
            refs.remove(policy);
        }
        index.retain(|_, refs| !refs.is_empty());
    }
}

async fn forward(
    mut changes: tokio::sync::broadcast::Receiver<crate::consumers::Change>,
    index: Arc<Mutex<HashMap<QueueKey, HashSet<ObjectRef<QueuePolicy>>>>>,
    tx: mpsc::UnboundedSender<ObjectRef<QueuePolicy>>,
) {
    loop {
        let targets: Vec<ObjectRef<QueuePolicy>> = match changes.recv().await {
            Ok(change) => {
                let index = index.lock().unwrap_or_else(|p| p.into_inner());
                index.get(change.queue()).into_iter().flatten().cloned().collect()
            }
            // Missed changes: every guarded policy takes a fresh look.
            Err(RecvError::Lagged(_)) => {
                let index = index.lock().unwrap_or_else(|p| p.into_inner());
                index.values().flatten().cloned().collect()
            }
            Err(RecvError::Closed) => return,
        };
        for target in targets {
            if tx.send(target).is_err() {
                return;
            }
        }
    }
}

/// Policies in the Deployment's namespace that name it or select it.
pub fn policies_for_deployment(policies: &Store<QueuePolicy>, d: &Deployment) -> Vec<ObjectRef<QueuePolicy>> {
    let ns = d.namespace();
    let name = d.name_any();
    policies
        .state()
        .iter()
        .filter(|p| p.namespace() == ns && guards(p, &name, d.labels()))
        .map(|p| ObjectRef::from_obj(&**p))
        .collect()
}

/// Policies guarding the Deployment a pod belongs to (through its ReplicaSet).
pub fn policies_for_pod(
    policies: &Store<QueuePolicy>,
    deployments: &Store<Deployment>,
    pod: &Pod,
) -> Vec<ObjectRef<QueuePolicy>> {
    let Some(deployment) = deployment_of(pod) else { return vec![] };
    let ns = pod.namespace().unwrap_or_default();
    match deployments.get(&ObjectRef::new(&deployment).within(&ns)) {
        Some(d) => policies_for_deployment(policies, &d),
        // Not in the cache yet: name matches are still possible.
        None => policies
            .state()
            .iter()
            .filter(|p| p.namespace().as_deref() == Some(&ns) && guards(p, &deployment, &Default::default()))
            .map(|p| ObjectRef::from_obj(&**p))
            .collect(),
    }
}

/// Whether `policy` guards the Deployment named `deployment` with `labels`: it names it in
/// spec.consumers.deployment, or its spec.consumers.selector matches the labels (an empty
/// selector matches nothing). The caller checks that both are in the same namespace.
pub fn guards(policy: &QueuePolicy, deployment: &str, labels: &std::collections::BTreeMap<String, String>) -> bool {
    let Some(c) = &policy.spec.consumers else { return false };
    if c.deployment.as_deref() == Some(deployment) {
        return true;
    }
    c.selector.clone().and_then(|s| Selector::try_from(s).ok()).is_some_and(|s| !s.selects_all() && s.matches(labels))
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
    use std::collections::BTreeMap;

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
}
