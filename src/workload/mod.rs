//! The workload seam: a Deployment, a StatefulSet or an Argo Rollout, seen the one way the gate,
//! the webhook, `check`, status and the uninstaller need. Everything that differs per kind
//! lives here: desired replicas, selector, pod template, whether the template carries the gate,
//! whether a rollout is under way, the strategy's judgement and its fix, and which pods a
//! disruption budget selects.

pub mod owner;
pub mod rollout;
pub mod strategy;

pub use crate::crd::WorkloadKind as Kind;
use crate::names::GATE_CONDITION;
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, StatefulSet},
        core::v1::{PodSpec, PodTemplateSpec},
    },
    apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta},
};
use rollout::Rollout;
use std::{collections::BTreeMap, sync::Arc};
pub use strategy::Judgement;

impl Kind {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Self::Deployment | Self::StatefulSet => "apps/v1",
            Self::Rollout => "argoproj.io/v1alpha1",
        }
    }

    /// The label naming the workload on the disruption budget the operator keeps for it.
    pub fn budget_label(self) -> &'static str {
        match self {
            Self::Deployment => "queueguard.io/deployment",
            Self::StatefulSet => "queueguard.io/statefulset",
            Self::Rollout => "queueguard.io/rollout",
        }
    }

    /// Whether queueguard may change this kind's rollout strategy.
    pub fn strategy_managed(self) -> bool {
        !matches!(self, Self::StatefulSet)
    }
}

/// A workload's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadKey {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

impl WorkloadKey {
    pub fn new(kind: Kind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { kind, namespace: namespace.into(), name: name.into() }
    }
}

impl std::fmt::Display for WorkloadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}/{}", self.kind.as_str(), self.namespace, self.name)
    }
}

/// The object behind a workload, of its own kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Object {
    Deployment(Deployment),
    StatefulSet(StatefulSet),
    Rollout(Rollout),
}

impl From<Deployment> for Object {
    fn from(d: Deployment) -> Self {
        Self::Deployment(d)
    }
}

impl From<StatefulSet> for Object {
    fn from(s: StatefulSet) -> Self {
        Self::StatefulSet(s)
    }
}

impl From<Rollout> for Object {
    fn from(r: Rollout) -> Self {
        Self::Rollout(r)
    }
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Self::Deployment(_) => Kind::Deployment,
            Self::StatefulSet(_) => Kind::StatefulSet,
            Self::Rollout(_) => Kind::Rollout,
        }
    }

    pub fn meta(&self) -> &ObjectMeta {
        match self {
            Self::Deployment(d) => &d.metadata,
            Self::StatefulSet(s) => &s.metadata,
            Self::Rollout(r) => &r.metadata,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Self::Deployment(d) => &mut d.metadata,
            Self::StatefulSet(s) => &mut s.metadata,
            Self::Rollout(r) => &mut r.metadata,
        }
    }
}

/// What the gate needs of a workload: its identity, labels, and the object without its
/// bookkeeping (managed fields, resource version), so an update that changes nothing the gate
/// reads compares equal.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub key: WorkloadKey,
    pub labels: BTreeMap<String, String>,
    pub object: Arc<Object>,
}

impl Workload {
    pub fn new(object: impl Into<Object>) -> Self {
        let mut object = object.into();
        let kind = object.kind();
        let meta = object.meta_mut();
        meta.managed_fields = None;
        meta.resource_version = None;
        let key =
            WorkloadKey::new(kind, meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default());
        Self { key, labels: meta.labels.clone().unwrap_or_default(), object: Arc::new(object) }
    }

    /// spec.replicas, defaulting to 1 as the API server (and the Rollout controller) does.
    pub fn replicas(&self) -> i32 {
        match &*self.object {
            Object::Deployment(d) => strategy::replicas(d),
            Object::StatefulSet(s) => s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
            Object::Rollout(r) => r.spec.replicas.unwrap_or(1),
        }
    }

    /// The selector of its pods (what its disruption budget selects).
    pub fn selector(&self) -> Option<LabelSelector> {
        match &*self.object {
            Object::Deployment(d) => d.spec.as_ref().map(|s| s.selector.clone()),
            Object::StatefulSet(s) => s.spec.as_ref().map(|s| s.selector.clone()),
            Object::Rollout(r) => r.spec.selector.clone(),
        }
    }

    /// Its pod template; None for a Rollout whose template comes from a `workloadRef`.
    pub fn template(&self) -> Option<&PodTemplateSpec> {
        match &*self.object {
            Object::Deployment(d) => d.spec.as_ref().map(|s| &s.template),
            Object::StatefulSet(s) => s.spec.as_ref().map(|s| &s.template),
            Object::Rollout(r) => r.spec.template.as_ref(),
        }
    }

    pub fn pod_spec(&self) -> Option<&PodSpec> {
        self.template().and_then(|t| t.spec.as_ref())
    }

    pub fn template_labels(&self) -> BTreeMap<String, String> {
        self.template().and_then(|t| t.metadata.as_ref()).and_then(|m| m.labels.clone()).unwrap_or_default()
    }

    /// Where in the template's readinessGates the operator's gate is.
    pub fn gate_position(&self) -> Option<usize> {
        self.pod_spec()?.readiness_gates.as_ref()?.iter().position(|g| g.condition_type == GATE_CONDITION)
    }

    /// Whether its newest pods have not all replaced the old ones yet.
    pub fn rolling_out(&self) -> bool {
        let want = self.replicas();
        let generation_seen = |generation: Option<i64>, observed: Option<i64>| {
            generation.is_none_or(|g| observed.is_some_and(|o| o >= g))
        };
        match &*self.object {
            Object::Deployment(d) => {
                let status = d.status.as_ref();
                let updated = status.and_then(|s| s.updated_replicas).unwrap_or(0);
                let total = status.and_then(|s| s.replicas).unwrap_or(0);
                !generation_seen(d.metadata.generation, status.and_then(|s| s.observed_generation))
                    || updated < want
                    || total > want
            }
            Object::StatefulSet(s) => {
                let status = s.status.as_ref();
                let updated = status.and_then(|s| s.updated_replicas).unwrap_or(0);
                let revisions_differ = status.is_some_and(|s| {
                    s.update_revision.is_some()
                        && s.current_revision.is_some()
                        && s.update_revision != s.current_revision
                });
                !generation_seen(s.metadata.generation, status.and_then(|s| s.observed_generation))
                    || revisions_differ
                    || updated < want
            }
            Object::Rollout(r) => {
                let status = r.status.as_ref();
                let updated = status.and_then(|s| s.updated_replicas).unwrap_or(0);
                let total = status.and_then(|s| s.replicas).unwrap_or(0);
                status.and_then(|s| s.phase.as_deref()) == Some("Progressing") || updated < want || total > want
            }
        }
    }

    /// Its rollout strategy, judged for `min_attached` consumers.
    pub fn judge(&self, min_attached: i32) -> Judgement {
        match &*self.object {
            Object::Deployment(d) => strategy::judge_deployment(d, min_attached),
            Object::StatefulSet(s) => strategy::judge_stateful_set(s, min_attached),
            Object::Rollout(r) => strategy::judge_rollout(r, min_attached),
        }
    }
}
