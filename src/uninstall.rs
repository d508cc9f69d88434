//! `queueguard uninstall`: removing the operator without leaving anything that waits for it.
//!
//! QueuePolicies and QueuePatterns carry the operator's finalizer; with the operator gone, a
//! deleted one (and so its namespace, and the CRD) would wait for ever. This stops the operator
//! first (scales its Deployment to zero and waits until no pod is left, or it would add the
//! finalizers back), then removes the finalizers. It never talks to the broker: every queue
//! stays, including those of `deletionPolicy: Delete`, which it names. It also names the
//! workloads (Deployments, StatefulSets, Argo Rollouts) whose pod template carries the readiness
//! gate, whose new pods would never become Ready without the operator. The chart runs it as a
//! pre-delete hook.

use crate::{
    crd::{DeletionPolicy, QueuePolicy},
    kube_api::scoped,
    names::{FINALIZER, GATE_CONDITION},
    pattern::crd::QueuePattern,
    workload::{Workload, rollout::Rollout},
};
use k8s_openapi::api::{
    apps::v1::{Deployment, StatefulSet},
    core::v1::Pod,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
};
use serde_json::json;
use std::time::{Duration, Instant};

/// An object whose finalizer goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    /// Where the finalizer sits in metadata.finalizers, for a patch that tests it first.
    pub index: usize,
}

/// What uninstalling does and what it leaves, decided from the objects in scope.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub release: Vec<Release>,
    /// What the user should know: queues kept, deletions that complete, gates nobody opens.
    pub notes: Vec<String>,
}

fn release<K: Resource>(kind: &'static str, object: &K) -> Option<Release> {
    let index = object.meta().finalizers.as_ref()?.iter().position(|f| f == FINALIZER)?;
    Some(Release {
        kind,
        namespace: object.meta().namespace.clone().unwrap_or_default(),
        name: object.meta().name.clone().unwrap_or_default(),
        index,
    })
}

pub fn plan(policies: &[QueuePolicy], patterns: &[QueuePattern], workloads: &[Workload]) -> Plan {
    let mut plan = Plan::default();
    for p in policies {
        let Some(r) = release("QueuePolicy", p) else { continue };
        let queue = p.spec.queue.name.clone().unwrap_or_else(|| p.name_any());
        let id = format!("QueuePolicy {}/{}", r.namespace, r.name);
        match (p.meta().deletion_timestamp.is_some(), p.spec.deletion_policy) {
            (true, DeletionPolicy::Delete) => plan.notes.push(format!(
                "{id} is being deleted with deletionPolicy Delete: it goes now, and its queue '{queue}' stays on the broker (delete it there once it is empty, if you meant to)"
            )),
            (true, DeletionPolicy::Retain) => {
                plan.notes.push(format!("{id} is being deleted: it goes now, and its queue '{queue}' stays"))
            }
            (false, DeletionPolicy::Delete) => plan.notes.push(format!(
                "{id} has deletionPolicy Delete: without the operator, deleting it will keep its queue '{queue}'"
            )),
            (false, DeletionPolicy::Retain) => {}
        }
        plan.release.push(r);
    }
    for p in patterns {
        let Some(r) = release("QueuePattern", p) else { continue };
        plan.notes.push(format!(
            "QueuePattern {}/{}: its broker policy stays on the broker until you delete it",
            r.namespace, r.name
        ));
        plan.release.push(r);
    }
    for w in workloads {
        let Some(at) = w.gate_position() else { continue };
        let (kind, ns, name) = (w.key.kind.as_str(), &w.key.namespace, &w.key.name);
        let resource = kind.to_ascii_lowercase();
        plan.notes.push(format!(
            "{kind} {ns}/{name}: its pod template has the readiness gate {GATE_CONDITION}, which only the operator opens, so its new pods would never become Ready; remove it: kubectl -n {ns} patch {resource} {name} --type=json -p '[{{\"op\":\"remove\",\"path\":\"/spec/template/spec/readinessGates/{at}\"}}]'"
        ));
    }
    plan
}

/// The JSON patch that removes the finalizer, only if it is still where it was seen.
pub fn finalizer_patch(r: &Release) -> serde_json::Value {
    let path = format!("/metadata/finalizers/{}", r.index);
    json!([{"op": "test", "path": path, "value": FINALIZER}, {"op": "remove", "path": path}])
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(
        "Deployment {namespace}/{name} still has {pods} pod(s) after {waited:?}; no finalizer removed, or the operator would add them back (it stays scaled to zero: find why its pods do not stop, then run this again, or scale it back up)"
    )]
    OperatorStillRunning { namespace: String, name: String, pods: usize, waited: Duration },
    #[error("Deployment {namespace}/{name} has no matchLabels selector to find its pods by")]
    NoSelector { namespace: String, name: String },
    #[error("{failed} finalizer(s) could not be removed; run it again")]
    Incomplete { failed: usize },
}

/// What `uninstall` is asked to do.
pub struct Options {
    /// The namespace the operator watches; None for every namespace.
    pub namespace: Option<String>,
    /// The operator's Deployment (namespace, name), stopped first.
    pub operator: Option<(String, String)>,
    /// How long to wait for the operator's pods to go.
    pub wait: Duration,
    /// Only say what would be done.
    pub dry_run: bool,
}

const POLL: Duration = Duration::from_millis(500);

/// Stops the operator, then removes the finalizers; prints what it does and leaves on `say`.
pub async fn run(client: Client, options: &Options, mut say: impl FnMut(&str)) -> Result<Plan, UninstallError> {
    if let (Some((ns, name)), false) = (&options.operator, options.dry_run) {
        stop_operator(&client, ns, name, options.wait).await?;
        say(&format!("stopped the operator: Deployment {ns}/{name} has no pods"));
    }
    let ns = options.namespace.as_deref();
    let policies = list_all(&scoped::<QueuePolicy>(&client, ns)).await?;
    let patterns = list_all(&scoped::<QueuePattern>(&client, ns)).await?;
    let mut workloads: Vec<Workload> =
        list_all(&scoped::<Deployment>(&client, ns)).await?.into_iter().map(Workload::new).collect();
    workloads.extend(list_all(&scoped::<StatefulSet>(&client, ns)).await?.into_iter().map(Workload::new));
    // A cluster without Argo Rollouts serves no rollouts: none to list.
    match list_all(&scoped::<Rollout>(&client, ns)).await {
        Ok(rollouts) => workloads.extend(rollouts.into_iter().map(Workload::new)),
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    let plan = plan(&policies, &patterns, &workloads);
    for note in &plan.notes {
        say(&format!("note: {note}"));
    }
    let mut failed = 0;
    for r in &plan.release {
        let what = format!("{} {}/{}", r.kind, r.namespace, r.name);
        if options.dry_run {
            say(&format!("would remove the finalizer of {what}"));
            continue;
        }
        let patch = Patch::Json::<()>(serde_json::from_value(finalizer_patch(r)).expect("a JSON patch"));
        let outcome = match r.kind {
            "QueuePolicy" => Api::<QueuePolicy>::namespaced(client.clone(), &r.namespace)
                .patch(&r.name, &PatchParams::default(), &patch)
                .await
                .map(drop),
            _ => Api::<QueuePattern>::namespaced(client.clone(), &r.namespace)
                .patch(&r.name, &PatchParams::default(), &patch)
                .await
                .map(drop),
        };
        match outcome {
            Ok(()) => say(&format!("removed the finalizer of {what}")),
            // Gone already: nothing holds it.
            Err(kube::Error::Api(e)) if e.code == 404 => say(&format!("{what} is gone already")),
            Err(e) => {
                failed += 1;
                say(&format!("error: {what}: {e}"));
            }
        }
    }
    if failed > 0 {
        return Err(UninstallError::Incomplete { failed });
    }
    Ok(plan)
}

/// Every object, a page at a time (a cluster's Deployments can be many).
async fn list_all<K>(api: &Api<K>) -> Result<Vec<K>, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut items = Vec::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}

/// Scales the operator to zero and waits until none of its pods is left, terminating ones
/// included: a pod in its grace period still reconciles, and would add a finalizer back.
async fn stop_operator(client: &Client, ns: &str, name: &str, wait: Duration) -> Result<(), UninstallError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.patch_scale(name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 0}}))).await?;
    let labels = api.get(name).await?.spec.and_then(|s| s.selector.match_labels).unwrap_or_default();
    if labels.is_empty() {
        return Err(UninstallError::NoSelector { namespace: ns.to_owned(), name: name.to_owned() });
    }
    let selector: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let params = ListParams::default().labels(&selector.join(","));
    let started = Instant::now();
    loop {
        let left = pods.list(&params).await?.items.len();
        if left == 0 {
            return Ok(());
        }
        if started.elapsed() >= wait {
            return Err(UninstallError::OperatorStillRunning {
                namespace: ns.to_owned(),
                name: name.to_owned(),
                pods: left,
                waited: wait,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, extra: &str, deleting: bool) -> QueuePolicy {
        let mut p: QueuePolicy = serde_yaml_ng::from_str(&format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name}, namespace: shop, finalizers: [example.com/other, {FINALIZER}]}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  queue: {{}}\n{extra}"
        ))
        .unwrap();
        if deleting {
            p.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2026-12-05T10:00:00Z".parse().unwrap()));
        }
        p
    }

    #[test]
    fn every_finalizer_goes_and_each_queue_kept_by_it_is_named() {
        let mut foreign = policy("foreign", "", false);
        foreign.metadata.finalizers = None;
        let policies = [
            policy("orders", "", false),
            policy("billing", "  deletionPolicy: Delete\n", false),
            policy("audit", "  deletionPolicy: Delete\n", true),
            foreign,
        ];
        let gated: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "order-worker", "namespace": "shop"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [],
                "readinessGates": [{"conditionType": "example.com/other"}, {"conditionType": GATE_CONDITION}]}}}
        }))
        .unwrap();
        let plain: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"selector": {}, "template": {"spec": {"containers": []}}}
        }))
        .unwrap();
        let plan = plan(&policies, &[], &[Workload::new(gated), Workload::new(plain)]);
        let names: Vec<(&str, usize)> = plan.release.iter().map(|r| (r.name.as_str(), r.index)).collect();
        assert_eq!(names, [("orders", 1), ("billing", 1), ("audit", 1)], "ours only, where it sits");
        assert_eq!(plan.notes.len(), 3, "{:#?}", plan.notes);
        assert!(
            plan.notes[0].contains("QueuePolicy shop/billing has deletionPolicy Delete")
                && plan.notes[0].contains("'billing'")
        );
        assert!(plan.notes[1].starts_with("QueuePolicy shop/audit is being deleted with deletionPolicy Delete"));
        assert!(plan.notes[2].contains("Deployment shop/order-worker") && plan.notes[2].contains("readinessGates/1"));
        assert_eq!(
            finalizer_patch(&plan.release[0]),
            json!([{"op": "test", "path": "/metadata/finalizers/1", "value": FINALIZER},
                   {"op": "remove", "path": "/metadata/finalizers/1"}])
        );
    }
}
