//! The Argo Rollouts `Rollout` (argoproj.io/v1alpha1), as far as queueguard reads it: replicas,
//! selector, pod template and strategy. Unknown fields are ignored on reading, and the operator
//! never writes the whole object (its strategy fix is a server-side apply of two fields).

use k8s_openapi::{
    api::core::v1::PodTemplateSpec,
    apimachinery::pkg::{apis::meta::v1::LabelSelector, util::intstr::IntOrString},
};
use kube::CustomResource;
use serde::{Deserialize, Serialize};

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(group = "argoproj.io", version = "v1alpha1", kind = "Rollout", namespaced, schema = "disabled")]
#[kube(status = "RolloutStatus", derive = "PartialEq")]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplateSpec>,
    /// A Deployment that provides the pod template instead of `template`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_ref: Option<serde_json::Value>,
    #[serde(default)]
    pub strategy: RolloutStrategy,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStrategy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blue_green: Option<BlueGreen>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Canary {
    /// Defaults to 25%.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<IntOrString>,
    /// Defaults to 25%.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_routing: Option<serde_json::Value>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BlueGreen {
    /// Pods a restart (`kubectl argo rollouts restart`) may take down at once; defaults to 25%.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview_replica_count: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_delay_seconds: Option<i32>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_replicas: Option<i32>,
    /// Healthy, Progressing, Paused or Degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}
