//! The optional mutating admission webhook: it adds the `queueguard.io/consumer-attached`
//! readiness gate to new pods of workloads that a QueuePolicy guards in Enforce mode, so
//! users need not edit their pod templates. It runs with `failurePolicy: Ignore`: a pod created
//! while the operator is down simply lacks the gate and is reported as `GateNotInstalled`.

pub mod certs;
pub mod server;

pub use crate::names::{NAMESPACE_LABEL, NAMESPACE_LABEL_TEXT};
use crate::{crd::QueuePolicy, gate::guards::Selects, names::GATE_CONDITION, plan::Limits, workload::WorkloadKey};
use base64::Engine;
use json_patch::{AddOperation, Patch, PatchOperation, jsonptr::PointerBuf};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    ResourceExt,
    core::admission::{AdmissionRequest, AdmissionResponse, Operation},
};
use serde_json::json;

/// The policies of `namespace` that gate pods: valid, in Enforce mode, not being deleted (the
/// index's own rule). An invalid policy or Observe mode must not add the gate: nobody would
/// ever set its condition.
pub fn enforcing_in<'a>(policies: &'a [std::sync::Arc<QueuePolicy>], namespace: &str) -> Vec<&'a QueuePolicy> {
    policies
        .iter()
        .map(|p| &**p)
        .filter(|p| p.namespace().as_deref() == Some(namespace))
        .filter(|p| crate::gate::policy_facts(p, Limits::default()).enforcing().is_some())
        .collect()
}

/// Of `enforcing`, the policies that guard `workload` (named, or selected by its `labels`).
pub fn guarding<'a>(
    enforcing: &[&'a QueuePolicy],
    workload: &WorkloadKey,
    labels: Option<&std::collections::BTreeMap<String, String>>,
) -> Vec<&'a QueuePolicy> {
    let no_labels = std::collections::BTreeMap::new();
    enforcing
        .iter()
        .copied()
        .filter(|p| Selects::of(p).matches(workload.kind, &workload.name, labels.unwrap_or(&no_labels)))
        .collect()
}

/// Whether any of them picks workloads by label (then the workload's labels must be read).
pub fn needs_workload_labels(enforcing: &[&QueuePolicy]) -> bool {
    enforcing.iter().any(|p| matches!(Selects::of(p), Selects::Labels { .. }))
}

/// The answer to one admission request. `guarding` names the policies that guard the pod's
/// Deployment (empty: allow unchanged). The pod is always allowed: the webhook only adds.
pub fn mutate(request: &AdmissionRequest<Pod>, guarding: &[&QueuePolicy]) -> AdmissionResponse {
    let allow = AdmissionResponse::from(request);
    let pod = request.object.as_ref().filter(|_| request.operation == Operation::Create);
    let (Some(pod), Some(policy)) = (pod, guarding.first()) else { return allow };
    let Some(patch) = gate_patch(pod) else { return allow };
    match allow.clone().with_patch(patch) {
        Ok(mut patched) => {
            // The audit log names the policy that caused the mutation.
            patched.audit_annotations.insert("guarded-by".into(), policy.name_any());
            patched
        }
        Err(e) => {
            tracing::error!(error = %e, "could not encode the readiness gate patch");
            allow
        }
    }
}

/// The AdmissionReview answer as the API server reads it. kube-rs serialises the patch bytes as
/// a JSON array of numbers; the API's canonical form for `[]byte` is a base64 string, so that
/// is what is sent.
pub fn review_json(response: AdmissionResponse) -> serde_json::Value {
    let mut review = serde_json::to_value(response.into_review()).unwrap_or_default();
    let patch = review["response"]["patch"].as_array().map(|bytes| {
        let bytes: Vec<u8> = bytes.iter().filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok())).collect();
        base64::engine::general_purpose::STANDARD.encode(bytes)
    });
    if let Some(encoded) = patch {
        review["response"]["patch"] = encoded.into();
    }
    review
}

/// The JSON patch adding the readiness gate, or None when the pod already has it.
pub fn gate_patch(pod: &Pod) -> Option<Patch> {
    let gates = pod.spec.as_ref().and_then(|s| s.readiness_gates.as_ref());
    if gates.is_some_and(|g| g.iter().any(|g| g.condition_type == GATE_CONDITION)) {
        return None;
    }
    let gate = json!({ "conditionType": GATE_CONDITION });
    let (path, value) = match gates {
        Some(_) => ("/spec/readinessGates/-", gate),
        None => ("/spec/readinessGates", json!([gate])),
    };
    let path = PointerBuf::parse(path).expect("a valid pointer");
    Some(Patch(vec![PatchOperation::Add(AddOperation { path, value })]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::admission::AdmissionReview;
    use serde_json::Value;
    use std::sync::Arc;

    /// What the API server sends when the ReplicaSet controller creates a pod.
    const REVIEW: &str = include_str!("../../tests/fixtures/admission/replicaset-creates-pod.json");

    fn request(edit: impl FnOnce(&mut Value)) -> AdmissionRequest<Pod> {
        let mut review: Value = serde_json::from_str(REVIEW).unwrap();
        edit(&mut review);
        let review: AdmissionReview<Pod> = serde_json::from_value(review).unwrap();
        review.try_into().unwrap()
    }

    fn policy(consumers: &str, mode: &str) -> Arc<QueuePolicy> {
        let doc = format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: orders, namespace: shop}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  queue: {{name: orders}}\n  consumers: {consumers}\n  gate: {{mode: {mode}}}\n"
        );
        Arc::new(serde_yaml_ng::from_str(&doc).unwrap())
    }

    /// The Enforce policies of `namespace` guarding the Deployment `deployment`.
    fn enforcing<'a>(
        policies: &'a [Arc<QueuePolicy>],
        namespace: &str,
        deployment: &str,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Vec<&'a QueuePolicy> {
        let workload = WorkloadKey::new(crate::workload::Kind::Deployment, namespace, deployment);
        guarding(&enforcing_in(policies, namespace), &workload, labels)
    }

    fn patch_of(response: &AdmissionResponse) -> Value {
        serde_json::from_slice(response.patch.as_ref().expect("a patch")).unwrap()
    }

    #[test]
    fn a_guarded_deployments_new_pod_gets_the_readiness_gate() {
        let req = request(|_| {});
        let policies = [policy("{deployment: order-worker}", "Enforce")];
        let pod = req.object.as_ref().unwrap();
        let owner = crate::workload::owner::pod_owner(&pod.metadata);
        assert_eq!(owner, Some(crate::workload::owner::PodOwner::ReplicaSet("order-worker-7d9c5b6f4".into())));
        let guarding = enforcing(&policies, "shop", "order-worker", None);
        let response = mutate(&req, &guarding);
        assert!(response.allowed);
        assert_eq!(response.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(
            patch_of(&response),
            serde_json::json!([{"op": "add", "path": "/spec/readinessGates", "value": [{"conditionType": GATE_CONDITION}]}])
        );
        let patch = patch_of(&response);
        let review = review_json(response);
        assert_eq!(review["response"]["patchType"], "JSONPatch");
        let encoded = review["response"]["patch"].as_str().expect("the patch travels base64-encoded");
        let decoded: Value =
            serde_json::from_slice(&base64::engine::general_purpose::STANDARD.decode(encoded).unwrap()).unwrap();
        assert_eq!(decoded, patch);
        assert_eq!(review["response"]["auditAnnotations"]["guarded-by"], "orders");
    }

    /// A policy that stands back for a Topology Operator Queue (ManagedElsewhere, adopt false)
    /// binds no queue, so nobody would ever open a gate it added.
    #[test]
    fn a_policy_standing_back_adds_no_gate() {
        let req = request(|_| {});
        let standing_back = |generation: i64, observed: i64| {
            let mut p = (*policy("{deployment: order-worker}", "Enforce")).clone();
            p.metadata.generation = Some(generation);
            p.status = Some(
                serde_json::from_value(serde_json::json!({"conditions": [{
                "type": "Ready", "status": "False", "reason": "ManagedElsewhere", "observedGeneration": observed,
                "message": "managed by Queue 'orders'", "lastTransitionTime": "2026-12-07T10:00:00Z"}]}))
                .unwrap(),
            );
            Arc::new(p)
        };
        let policies = [standing_back(2, 2)];
        assert!(enforcing(&policies, "shop", "order-worker", None).is_empty());
        let response = mutate(&req, &enforcing(&policies, "shop", "order-worker", None));
        assert!(response.allowed && response.patch.is_none());
        let changed_since = [standing_back(3, 2)];
        assert_eq!(enforcing(&changed_since, "shop", "order-worker", None).len(), 1, "its new spec is not judged yet");
    }

    #[test]
    fn existing_gates_are_kept_and_ours_is_not_added_twice() {
        let other = request(|r| {
            r["request"]["object"]["spec"]["readinessGates"] =
                serde_json::json!([{"conditionType": "example.com/ready"}])
        });
        let policies = [policy("{deployment: order-worker}", "Enforce")];
        let guarding = enforcing(&policies, "shop", "order-worker", None);
        assert_eq!(
            patch_of(&mutate(&other, &guarding)),
            serde_json::json!([{"op": "add", "path": "/spec/readinessGates/-", "value": {"conditionType": GATE_CONDITION}}])
        );
        let ours = request(|r| {
            r["request"]["object"]["spec"]["readinessGates"] = serde_json::json!([{"conditionType": GATE_CONDITION}])
        });
        let response = mutate(&ours, &guarding);
        assert!(response.allowed && response.patch.is_none());
    }

    #[test]
    fn unguarded_observed_and_foreign_pods_pass_unchanged() {
        let req = request(|_| {});
        let cases = [
            (policy("{deployment: payment-worker}", "Enforce"), "shop"),
            (policy("{deployment: order-worker}", "Observe"), "shop"),
            (policy("{deployment: order-worker}", "Enforce"), "other-namespace"),
        ];
        for (p, ns) in cases {
            let policies = [p];
            let guarding = enforcing(&policies, ns, "order-worker", None);
            let response = mutate(&req, &guarding);
            assert!(response.allowed && response.patch.is_none(), "{guarding:?}");
        }
        let update = request(|r| r["request"]["operation"] = "UPDATE".into());
        let policies = [policy("{deployment: order-worker}", "Enforce")];
        let response = mutate(&update, &enforcing(&policies, "shop", "order-worker", None));
        assert!(response.patch.is_none(), "only new pods are mutated");
    }

    #[test]
    fn only_valid_enforcing_policies_add_the_gate() {
        let req = request(|_| {});
        let invalid = {
            let mut p = (*policy("{deployment: order-worker}", "Enforce")).clone();
            p.spec.queue.expires = "soon".into();
            Arc::new(p)
        };
        let policies = [invalid];
        let guarding = enforcing(&policies, "shop", "order-worker", None);
        assert!(guarding.is_empty(), "an invalid policy's gate would never be acted on");
        assert!(mutate(&req, &guarding).patch.is_none());
        let mut deleting = (*policy("{deployment: order-worker}", "Enforce")).clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
        assert!(enforcing(&[Arc::new(deleting)], "shop", "order-worker", None).is_empty());
        // In a namespace no policy touches, nothing is added (the chart's namespaceSelector keeps
        // such pods from reaching the webhook at all).
        let policies = [policy("{deployment: order-worker}", "Enforce")];
        assert!(mutate(&req, &enforcing(&policies, "billing", "order-worker", None)).patch.is_none());
    }

    #[test]
    fn label_selected_workloads_need_their_labels() {
        let policies = [policy("{selector: {matchLabels: {tier: consumers}}}", "Enforce")];
        assert!(needs_workload_labels(&enforcing_in(&policies, "shop")));
        assert!(!needs_workload_labels(&enforcing_in(&policies, "elsewhere")));
        let labels = std::collections::BTreeMap::from([("tier".to_owned(), "consumers".to_owned())]);
        assert_eq!(enforcing(&policies, "shop", "order-worker", Some(&labels)).len(), 1);
        assert!(enforcing(&policies, "shop", "order-worker", None).is_empty());
        let web = std::collections::BTreeMap::from([("tier".to_owned(), "web".to_owned())]);
        assert!(enforcing(&policies, "shop", "order-worker", Some(&web)).is_empty());
    }

    #[test]
    fn the_pods_of_every_guarded_kind_get_the_gate() {
        use crate::workload::Kind;
        let policies = [
            policy("{workload: {kind: StatefulSet, name: shard}}", "Enforce"),
            policy("{selector: {matchLabels: {tier: consumers}}, kinds: [Rollout]}", "Enforce"),
        ];
        let enforcing = enforcing_in(&policies, "shop");
        let labels = std::collections::BTreeMap::from([("tier".to_owned(), "consumers".to_owned())]);
        let shard = WorkloadKey::new(Kind::StatefulSet, "shop", "shard");
        assert_eq!(guarding(&enforcing, &shard, None).len(), 1);
        let canary = WorkloadKey::new(Kind::Rollout, "shop", "canary");
        assert_eq!(guarding(&enforcing, &canary, Some(&labels)).len(), 1);
        let deployment = WorkloadKey::new(Kind::Deployment, "shop", "canary");
        assert!(guarding(&enforcing, &deployment, Some(&labels)).is_empty(), "kinds: [Rollout] only");
        let req = request(|_| {});
        assert!(mutate(&req, &guarding(&enforcing, &shard, None)).patch.is_some());
    }
}
