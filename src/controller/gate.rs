//! The gate's Kubernetes I/O: read the consumer Deployments and their pods, then write what
//! [`crate::gate::decide`] decided: pod conditions (pods/status), strategy patches, the PDB.

use super::{Context, Error, FIELD_MANAGER};
use crate::{
    consumers::{ConsumerTracker, QueueKey, Tracking, tracker::now_ms},
    crd::{GateMode, QueuePolicy},
    events::EventSpec,
    gate::{self, Decision, GatePlan, Observed, pdb, pods::PodFacts},
    metrics::PolicyLabels,
    status::GateReport,
};
use k8s_openapi::api::{apps::v1::Deployment, core::v1::Pod, policy::v1::PodDisruptionBudget};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
    core::Selector,
};
use std::{collections::HashSet, time::Duration};

/// What one gate pass produced for the reconcile to report.
pub struct GatePass {
    pub report: GateReport,
    pub events: Vec<EventSpec>,
    pub recheck_after: Option<Duration>,
}

/// Runs the gate for one policy. `tracker` is None when the broker cannot be reached at all.
pub async fn run(
    policy: &QueuePolicy,
    plan: &GatePlan,
    queue: &QueueKey,
    tracker: Result<&ConsumerTracker, String>,
    ctx: &Context,
) -> Result<GatePass, Error> {
    let ns = policy.namespace().unwrap_or_else(|| "default".into());
    let deployments = consumer_deployments(&ctx.client, &ns, plan).await?;
    let mut pods = Vec::new();
    for d in &deployments {
        pods.extend(pods_of(&ctx.client, &ns, d).await?);
    }
    let (consumers, tracking) = match tracker {
        Ok(t) => (t.consumers_on(queue), t.tracking()),
        Err(why) => (vec![], Tracking::Unavailable(why)),
    };
    let seen = Observed {
        queue,
        deployments: &deployments,
        pods: &pods,
        consumers: &consumers,
        tracking: &tracking,
        now_ms: now_ms(),
    };
    let decision = gate::decide(plan, &seen);
    if plan.mode == GateMode::Enforce {
        apply(policy, plan, &ns, &deployments, &decision, ctx).await?;
    }
    let Decision { consumers_attached, rollout_safe, consumers, rollout, events, recheck_after, opened_after, .. } =
        decision;
    if plan.mode == GateMode::Enforce {
        let labels = PolicyLabels { namespace: ns.clone(), policy: policy.name_any() };
        for waited in opened_after {
            ctx.metrics.gate_opened(&labels, waited);
        }
    }
    Ok(GatePass { report: GateReport { consumers_attached, rollout_safe, consumers, rollout }, events, recheck_after })
}

/// The Deployments named by spec.consumers (by name, or by label selector).
pub async fn consumer_deployments(client: &kube::Client, ns: &str, plan: &GatePlan) -> Result<Vec<Deployment>, Error> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    if let Some(name) = &plan.consumers.deployment {
        return Ok(api.get_opt(name).await?.into_iter().collect());
    }
    let Some(selector) = plan.consumers.selector.clone() else { return Ok(vec![]) };
    let selector = Selector::try_from(selector).map_err(|e| Error::InvalidSelector(e.to_string()))?;
    if selector.selects_all() {
        // An empty selector would be every Deployment of the namespace: it guards none, as in
        // triggers::guards and the webhook.
        return Ok(vec![]);
    }
    Ok(api.list(&ListParams::default().labels_from(&selector)).await?.items)
}

async fn pods_of(client: &kube::Client, ns: &str, deployment: &Deployment) -> Result<Vec<PodFacts>, Error> {
    let Some(selector) = deployment.spec.as_ref().map(|s| s.selector.clone()) else { return Ok(vec![]) };
    let selector = Selector::try_from(selector).map_err(|e| Error::InvalidSelector(e.to_string()))?;
    if selector.selects_all() {
        // A Deployment always has a selector; an empty one would be every pod of the namespace.
        return Ok(vec![]);
    }
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = api.list(&ListParams::default().labels_from(&selector)).await?;
    Ok(pods.items.iter().map(PodFacts::from_pod).collect())
}

async fn apply(
    policy: &QueuePolicy,
    plan: &GatePlan,
    ns: &str,
    deployments: &[Deployment],
    decision: &Decision,
    ctx: &Context,
) -> Result<(), Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    for patch in &decision.pod_patches {
        match pods.patch_status(&patch.pod, &PatchParams::default(), &Patch::Strategic(patch.body())).await {
            Ok(_) => {}
            // Gone, or replaced under the same name (the UID precondition failed): the next
            // pass sees the new pod.
            Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409 | 422) => {
                tracing::debug!(pod = %patch.pod, reason = %e.message, "pod changed before its condition was written");
            }
            Err(e) => return Err(e.into()),
        }
    }
    let deploys: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    for (name, patch) in &decision.strategy_patches {
        deploys.patch(name, &PatchParams::default(), &Patch::Strategic(patch)).await?;
    }
    sync_pdbs(policy, plan, ns, deployments, ctx).await
}

/// Applies the PDB of each consumer Deployment and deletes the policy's PDBs no longer wanted.
async fn sync_pdbs(
    policy: &QueuePolicy,
    plan: &GatePlan,
    ns: &str,
    deployments: &[Deployment],
    ctx: &Context,
) -> Result<(), Error> {
    let api: Api<PodDisruptionBudget> = Api::namespaced(ctx.client.clone(), ns);
    let owner = policy.controller_owner_ref(&()).ok_or(Error::MissingUid)?;
    let policy_name = policy.name_any();
    let mut wanted = HashSet::new();
    if plan.pod_disruption_budget {
        for d in deployments {
            let Some(desired) = pdb::desired(&policy_name, owner.clone(), d, plan.min_attached) else { continue };
            let name = desired.name_any();
            api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&desired)).await?;
            wanted.insert(name);
        }
    }
    let managed = ListParams::default().labels(&format!("{}={}", pdb::MANAGED_BY.0, pdb::MANAGED_BY.1));
    for existing in api.list(&managed).await?.items {
        let ours = existing.owner_references().iter().any(|o| o.uid == owner.uid);
        let name = existing.name_any();
        if ours && !wanted.contains(&name) {
            api.delete(&name, &DeleteParams::default()).await?;
        }
    }
    Ok(())
}
