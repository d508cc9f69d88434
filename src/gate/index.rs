//! The gate's index: every pod of a Deployment, the Deployments and QueuePolicies around it, the
//! disruption budgets, and which broker queue each policy is bound to. It is keyed so that the
//! Deployments a policy guards and the policies guarding a pod are one lookup each.
//!
//! Fed by the Pod, Deployment, PodDisruptionBudget and QueuePolicy watches and by the consumer
//! trackers. Pure and synchronous: a mutation marks the pods and policies it touches, and
//! [`GateIndex::flush`] evaluates them and returns the pod condition patches (for the one
//! writer) and the policies whose status view may have changed. A pod's condition is patched
//! only when its combined verdict flips; a condition written but not yet seen back through the
//! watch counts as written, so nothing is sent twice.

use super::{
    GatePlan, PodPatch,
    guards::Selects,
    pods::{Ownership, PodFacts, ownership},
    verdict::{self, Ballot, PolicyVote, Verdict, Vote},
};
use crate::{
    consumers::{Consumer, QueueKey, Tracking},
    crd::{GateMode, QueuePolicy},
    plan::{self, Limits},
};
use k8s_openapi::{
    api::{apps::v1::Deployment, policy::v1::PodDisruptionBudget},
    apimachinery::pkg::apis::meta::v1::LabelSelector,
};
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

/// A failed pod condition write is tried again after this long.
pub const RETRY_MS: i64 = 1_000;
/// Label naming the Deployment of a budget the operator keeps.
pub const BUDGET_DEPLOYMENT: &str = "queueguard.io/deployment";

/// A namespaced object's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }

    pub fn of<K: kube::Resource>(object: &K) -> Self {
        Self::new(object.meta().namespace.clone().unwrap_or_default(), object.meta().name.clone().unwrap_or_default())
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the gate needs of a QueuePolicy with spec.consumers.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyFacts {
    pub key: ObjectKey,
    pub uid: String,
    pub selects: Selects,
    /// The gate settings, or why there are none.
    pub plan: Result<GatePlan, NoGate>,
    pub deleting: bool,
}

impl PolicyFacts {
    /// Every policy has facts: one without spec.consumers guards nothing, but its queue's
    /// changes (a deletion behind the operator's back) still wake it.
    pub fn from_policy(policy: &QueuePolicy, limits: Limits) -> Self {
        let plan = match plan::plan(policy, limits) {
            Ok(p) => p.gate.ok_or(NoGate::NoConsumers),
            Err(errors) => Err(NoGate::Invalid(plan::describe(&errors))),
        };
        Self {
            key: ObjectKey::of(policy),
            uid: policy.uid().unwrap_or_default(),
            selects: Selects::of(policy),
            plan,
            deleting: policy.metadata.deletion_timestamp.is_some(),
        }
    }

    /// The plan of a policy that acts on pods: valid, in Enforce mode, not being deleted.
    fn enforcing(&self) -> Option<&GatePlan> {
        self.plan.as_ref().ok().filter(|p| p.mode == GateMode::Enforce && !self.deleting)
    }
}

/// Why a policy has no gate settings.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NoGate {
    /// It guards nothing (it still has facts, so its queue's changes wake it).
    #[error("no spec.consumers")]
    NoConsumers,
    /// Its spec is invalid: the plan's field errors.
    #[error("{0}")]
    Invalid(String),
}

/// Why a policy cannot count consumers on its queue.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unbound {
    #[error("not reconciled yet")]
    NotReconciledYet,
    #[error("consumer tracking could not start")]
    TrackingNotStarted,
    /// The broker side of its reconcile is not Ready: what its Ready condition says.
    #[error("{0}")]
    NotReady(String),
}

/// The broker queue whose consumers a policy counts, on the tracker `source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub source: u64,
    pub queue: QueueKey,
    /// Its dead-letter queue, whose deletion also wakes the policy (it is declared again).
    pub dead_letter_queue: Option<QueueKey>,
}

/// The live consumers, as the trackers see them.
pub trait Consumers {
    fn consumers_on(&self, source: u64, queue: &QueueKey) -> Vec<Consumer>;
    fn tracking(&self, source: u64, vhost: &str) -> Tracking;
}

/// What the gate needs of a Deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentFacts {
    pub key: ObjectKey,
    pub labels: BTreeMap<String, String>,
    /// Its pod template's labels (what a disruption budget would select).
    pub template_labels: BTreeMap<String, String>,
    /// The object without its bookkeeping (managed fields, resource version), for strategy and
    /// rollout judgements.
    pub object: Arc<Deployment>,
}

impl DeploymentFacts {
    pub fn from_deployment(d: &Deployment) -> Self {
        let mut object = d.clone();
        object.metadata.managed_fields = None;
        object.metadata.resource_version = None;
        Self {
            key: ObjectKey::of(d),
            labels: d.labels().clone(),
            template_labels: d
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.labels.clone())
                .unwrap_or_default(),
            object: Arc::new(object),
        }
    }
}

/// What the gate needs of a PodDisruptionBudget.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetFacts {
    pub key: ObjectKey,
    pub selector: Option<LabelSelector>,
    /// Kept by queueguard (its managed-by label).
    pub ours: bool,
    /// For the operator's budgets: the Deployment it covers.
    pub deployment: Option<String>,
    pub owners: Vec<String>,
    pub object: Arc<PodDisruptionBudget>,
}

impl BudgetFacts {
    pub fn from_budget(b: &PodDisruptionBudget) -> Self {
        let labels = b.labels();
        let mut object = b.clone();
        object.metadata.managed_fields = None;
        object.metadata.resource_version = None;
        object.status = None;
        Self {
            key: ObjectKey::of(b),
            selector: b.spec.as_ref().and_then(|s| s.selector.clone()),
            ours: labels.get(super::pdb::MANAGED_BY.0).map(String::as_str) == Some(super::pdb::MANAGED_BY.1),
            deployment: labels.get(BUDGET_DEPLOYMENT).cloned(),
            owners: b.owner_references().iter().map(|o| o.uid.clone()).collect(),
            object: Arc::new(object),
        }
    }

    fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        // An empty selector selects every pod of the namespace (policy/v1).
        self.selector.clone().and_then(|s| Selector::try_from(s).ok()).is_some_and(|s| s.matches(labels))
    }
}

/// Which watches have delivered their first complete list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Synced {
    pub policies: bool,
    pub deployments: bool,
    pub pods: bool,
    pub budgets: bool,
}

impl Synced {
    pub fn all(self) -> bool {
        self.policies && self.deployments && self.pods && self.budgets
    }
}

/// What a flush asks for.
#[derive(Debug, Default, PartialEq)]
pub struct Effects {
    /// Pod conditions to write, in order.
    pub patches: Vec<PodPatch>,
    /// Policies whose status view may have changed.
    pub wake: BTreeSet<ObjectKey>,
}

struct PolicyEntry {
    facts: PolicyFacts,
    binding: Result<Binding, Unbound>,
}

struct PodEntry {
    facts: PodFacts,
    /// The condition status written and not yet seen back through the watch.
    sent: Option<bool>,
    due: Option<i64>,
    /// After a failed write: no new write before this.
    retry_at: i64,
    /// The last verdict (what the pod waits for), for status.
    verdict: Option<Verdict>,
}

impl PodEntry {
    fn open(&self) -> bool {
        self.sent.unwrap_or_else(|| self.facts.is_open())
    }

    /// When the pod started waiting: its containers became ready, or its gate last closed.
    fn waiting_since(&self) -> Option<i64> {
        let ready = self.facts.containers_ready_since_ms?;
        Some(match &self.facts.condition {
            Some(c) if !c.status => ready.max(c.since_ms),
            _ => ready,
        })
    }
}

#[derive(Default)]
struct Namespace {
    policies: BTreeSet<ObjectKey>,
    deployments: BTreeSet<ObjectKey>,
}

#[derive(Default)]
pub struct GateIndex {
    policies: HashMap<ObjectKey, PolicyEntry>,
    deployments: HashMap<ObjectKey, DeploymentFacts>,
    pods: HashMap<String, PodEntry>,
    namespaces: HashMap<String, Namespace>,
    /// Policy → the Deployments it guards; Deployment → the policies guarding it. Name matches
    /// are kept even before the Deployment is seen.
    guards: HashMap<ObjectKey, BTreeSet<ObjectKey>>,
    guarded_by: HashMap<ObjectKey, BTreeSet<ObjectKey>>,
    /// Deployment → its pods (by UID).
    pods_of: HashMap<ObjectKey, BTreeSet<String>>,
    /// Broker queue → the policies counting its consumers.
    bound: HashMap<(u64, QueueKey), BTreeSet<ObjectKey>>,
    /// Dead-letter queue → the policies dead-lettering into it.
    dead_letters: HashMap<(u64, QueueKey), BTreeSet<ObjectKey>>,
    /// Address → the pods holding it (terminal pods hold none).
    addresses: HashMap<String, BTreeSet<String>>,
    budgets: HashMap<ObjectKey, BudgetFacts>,
    timers: BTreeSet<(i64, String)>,
    dirty_pods: BTreeSet<String>,
    dirty_policies: BTreeSet<ObjectKey>,
    synced: Synced,
}

impl GateIndex {
    // ---- QueuePolicies ----

    pub fn upsert_policy(&mut self, facts: PolicyFacts) {
        let key = facts.key.clone();
        let binding = match self.policies.remove(&key) {
            Some(old) if old.facts == facts => {
                self.policies.insert(key, old);
                return;
            }
            Some(old) => old.binding,
            None => Err(Unbound::NotReconciledYet),
        };
        self.namespaces.entry(key.namespace.clone()).or_default().policies.insert(key.clone());
        self.policies.insert(key.clone(), PolicyEntry { facts, binding });
        self.regard(&key);
        self.dirty_policies.insert(key);
    }

    pub fn remove_policy(&mut self, key: &ObjectKey) {
        let Some(entry) = self.policies.remove(key) else { return };
        if let Ok(b) = &entry.binding {
            self.unbind_queue(b, key);
        }
        if let Some(ns) = self.namespaces.get_mut(&key.namespace) {
            ns.policies.remove(key);
        }
        for d in self.guards.remove(key).unwrap_or_default() {
            self.dirty_deployment(&d);
            if let Some(set) = self.guarded_by.get_mut(&d) {
                set.remove(key);
            }
        }
    }

    /// Records which queue (on which tracker) a policy counts consumers on, or why it cannot.
    pub fn bind(&mut self, key: &ObjectKey, binding: Result<Binding, Unbound>) {
        let Some(entry) = self.policies.get_mut(key) else { return };
        if entry.binding == binding {
            return;
        }
        let old = std::mem::replace(&mut entry.binding, binding.clone());
        if let Ok(b) = &old {
            self.unbind_queue(b, key);
        }
        if let Ok(b) = binding {
            if let Some(dlq) = b.dead_letter_queue {
                self.dead_letters.entry((b.source, dlq)).or_default().insert(key.clone());
            }
            self.bound.entry((b.source, b.queue)).or_default().insert(key.clone());
        }
        for d in self.guards.get(key).cloned().unwrap_or_default() {
            self.dirty_deployment(&d);
        }
    }

    fn unbind_queue(&mut self, b: &Binding, key: &ObjectKey) {
        let slots = [(&mut self.bound, Some(&b.queue)), (&mut self.dead_letters, b.dead_letter_queue.as_ref())];
        for (map, queue) in slots {
            let Some(slot) = queue.map(|q| (b.source, q.clone())) else { continue };
            if let Some(set) = map.get_mut(&slot) {
                set.remove(key);
                if set.is_empty() {
                    map.remove(&slot);
                }
            }
        }
    }

    /// Recomputes the Deployments a policy guards.
    fn regard(&mut self, key: &ObjectKey) {
        let Some(entry) = self.policies.get(key) else { return };
        let wanted: BTreeSet<ObjectKey> = match &entry.facts.selects {
            Selects::Name(name) => BTreeSet::from([ObjectKey::new(key.namespace.clone(), name.clone())]),
            selects @ Selects::Labels(_) => self
                .namespaces
                .get(&key.namespace)
                .into_iter()
                .flat_map(|ns| &ns.deployments)
                .filter(|d| self.deployments.get(*d).is_some_and(|f| selects.matches(&d.name, &f.labels)))
                .cloned()
                .collect(),
            Selects::Nothing => BTreeSet::new(),
        };
        let old = self.guards.insert(key.clone(), wanted.clone()).unwrap_or_default();
        for d in old.difference(&wanted) {
            if let Some(set) = self.guarded_by.get_mut(d) {
                set.remove(key);
            }
        }
        for d in &wanted {
            self.guarded_by.entry(d.clone()).or_default().insert(key.clone());
        }
        for d in old.union(&wanted) {
            self.dirty_deployment(d);
        }
    }

    // ---- Deployments ----

    pub fn upsert_deployment(&mut self, facts: DeploymentFacts) {
        let key = facts.key.clone();
        if self.deployments.get(&key) == Some(&facts) {
            return;
        }
        self.namespaces.entry(key.namespace.clone()).or_default().deployments.insert(key.clone());
        self.deployments.insert(key.clone(), facts);
        self.reselect(&key);
        self.dirty_deployment(&key);
    }

    pub fn remove_deployment(&mut self, key: &ObjectKey) {
        if self.deployments.remove(key).is_none() {
            return;
        }
        if let Some(ns) = self.namespaces.get_mut(&key.namespace) {
            ns.deployments.remove(key);
        }
        self.dirty_deployment(key);
        self.reselect(key);
    }

    /// Re-evaluates which label-selecting policies of its namespace pick this Deployment.
    fn reselect(&mut self, d: &ObjectKey) {
        let labels = self.deployments.get(d).map(|f| f.labels.clone());
        let policies: Vec<ObjectKey> =
            self.namespaces.get(&d.namespace).map(|ns| ns.policies.iter().cloned().collect()).unwrap_or_default();
        for p in policies {
            let Some(entry) = self.policies.get(&p) else { continue };
            if !matches!(entry.facts.selects, Selects::Labels(_)) {
                continue;
            }
            let picks = labels.as_ref().is_some_and(|l| entry.facts.selects.matches(&d.name, l));
            let guards = self.guards.entry(p.clone()).or_default();
            let changed = if picks { guards.insert(d.clone()) } else { guards.remove(d) };
            if changed {
                let set = self.guarded_by.entry(d.clone()).or_default();
                if picks {
                    set.insert(p.clone());
                } else {
                    set.remove(&p);
                }
                self.dirty_policies.insert(p);
            }
        }
    }

    // ---- Pods ----

    pub fn upsert_pod(&mut self, mut facts: PodFacts, now: i64) {
        let uid = facts.uid.clone();
        let old = self.pods.get(&uid);
        if facts.ip_since_ms.is_none() && !facts.ips.is_empty() {
            // No startTime: the address dates from when it was first seen here.
            facts.ip_since_ms = Some(old.and_then(|o| o.facts.ip_since_ms).unwrap_or(now));
        }
        if old.is_some_and(|o| o.facts == facts) {
            return;
        }
        let (sent, retry_at, verdict) = match self.pods.remove(&uid) {
            Some(old) => {
                self.forget_pod(&old);
                // Seen back: what was written is now on the pod.
                let confirmed = old.sent == facts.condition.as_ref().map(|c| c.status);
                (old.sent.filter(|_| !confirmed), old.retry_at, old.verdict)
            }
            None => (None, 0, None),
        };
        if let Some(d) = self.deployment_key(&facts) {
            self.pods_of.entry(d.clone()).or_default().insert(uid.clone());
            self.wake_guards(&d);
        }
        if !facts.terminal {
            for ip in &facts.ips {
                let holders = self.addresses.entry(ip.clone()).or_default();
                holders.insert(uid.clone());
                // A second holder makes the address ambiguous for the first.
                self.dirty_pods.extend(holders.iter().cloned());
            }
        }
        self.dirty_pods.insert(uid.clone());
        self.pods.insert(uid, PodEntry { facts, sent, due: None, retry_at, verdict });
    }

    pub fn remove_pod(&mut self, uid: &str) {
        if let Some(old) = self.pods.remove(uid) {
            self.forget_pod(&old);
        }
    }

    /// Removes a pod from every lookup (not from `pods`).
    fn forget_pod(&mut self, old: &PodEntry) {
        let uid = &old.facts.uid;
        if let Some(due) = old.due {
            self.timers.remove(&(due, uid.clone()));
        }
        if let Some(d) = self.deployment_key(&old.facts) {
            if let Some(set) = self.pods_of.get_mut(&d) {
                set.remove(uid);
                if set.is_empty() {
                    self.pods_of.remove(&d);
                }
            }
            self.wake_guards(&d);
        }
        for ip in &old.facts.ips {
            if let Some(holders) = self.addresses.get_mut(ip) {
                holders.remove(uid);
                self.dirty_pods.extend(holders.iter().cloned());
                if holders.is_empty() {
                    self.addresses.remove(ip);
                }
            }
        }
        self.dirty_pods.remove(uid);
    }

    fn deployment_key(&self, pod: &PodFacts) -> Option<ObjectKey> {
        pod.deployment.as_ref().map(|d| ObjectKey::new(pod.namespace.clone(), d.clone()))
    }

    // ---- PodDisruptionBudgets ----

    pub fn upsert_budget(&mut self, facts: BudgetFacts) {
        if self.budgets.get(&facts.key) == Some(&facts) {
            return;
        }
        self.wake_namespace(&facts.key.namespace);
        self.budgets.insert(facts.key.clone(), facts);
    }

    pub fn remove_budget(&mut self, key: &ObjectKey) {
        if self.budgets.remove(key).is_some() {
            self.wake_namespace(&key.namespace);
        }
    }

    fn wake_namespace(&mut self, namespace: &str) {
        if let Some(ns) = self.namespaces.get(namespace) {
            self.dirty_policies.extend(ns.policies.iter().cloned());
        }
    }

    // ---- Re-lists, consumers, time, writes ----

    /// A watch delivered its complete list: objects of that kind not in it are gone.
    pub fn replace_pods(&mut self, pods: Vec<PodFacts>, now: i64) {
        for uid in unlisted(self.pods.keys(), pods.iter().map(|p| &p.uid)) {
            self.remove_pod(&uid);
        }
        for pod in pods {
            self.upsert_pod(pod, now);
        }
        self.synced.pods = true;
    }

    pub fn replace_deployments(&mut self, deployments: Vec<DeploymentFacts>) {
        for key in unlisted(self.deployments.keys(), deployments.iter().map(|d| &d.key)) {
            self.remove_deployment(&key);
        }
        for d in deployments {
            self.upsert_deployment(d);
        }
        self.synced.deployments = true;
    }

    pub fn replace_policies(&mut self, policies: Vec<PolicyFacts>) {
        for key in unlisted(self.policies.keys(), policies.iter().map(|p| &p.key)) {
            self.remove_policy(&key);
        }
        for p in policies {
            self.upsert_policy(p);
        }
        self.synced.policies = true;
    }

    pub fn replace_budgets(&mut self, budgets: Vec<BudgetFacts>) {
        for key in unlisted(self.budgets.keys(), budgets.iter().map(|b| &b.key)) {
            self.remove_budget(&key);
        }
        for b in budgets {
            self.upsert_budget(b);
        }
        self.synced.budgets = true;
    }

    pub fn synced(&self) -> Synced {
        self.synced
    }

    /// A broker change: the pods of the policies counting that queue (or, for a tracking
    /// change, every queue of that tracker and vhost) are looked at again.
    pub fn consumers_changed(&mut self, source: u64, change: &crate::consumers::Change) {
        if let crate::consumers::Change::QueueDeleted { queue } = change {
            let dead_lettering = self.dead_letters.get(&(source, queue.clone())).into_iter().flatten();
            self.dirty_policies.extend(dead_lettering.cloned());
        }
        let policies: Vec<ObjectKey> = match change.queue() {
            Some(queue) => self.bound.get(&(source, queue.clone())).into_iter().flatten().cloned().collect(),
            None => {
                let vhost = match change {
                    crate::consumers::Change::Tracking { vhost } => vhost.clone(),
                    _ => None,
                };
                self.bound
                    .iter()
                    .filter(|((s, q), _)| *s == source && vhost.as_ref().is_none_or(|v| *v == q.vhost))
                    .flat_map(|(_, set)| set.iter().cloned())
                    .collect()
            }
        };
        for p in policies {
            for d in self.guards.get(&p).cloned().unwrap_or_default() {
                self.dirty_deployment(&d);
            }
            self.dirty_policies.insert(p);
        }
    }

    /// Every broker change may have been missed (a lagging subscriber): look at everything bound.
    pub fn all_consumers_changed(&mut self) {
        let policies: Vec<ObjectKey> = self.bound.values().flatten().cloned().collect();
        for p in policies {
            for d in self.guards.get(&p).cloned().unwrap_or_default() {
                self.dirty_deployment(&d);
            }
            self.dirty_policies.insert(p);
        }
    }

    /// The earliest time a verdict changes by time alone.
    pub fn next_due(&self) -> Option<i64> {
        self.timers.first().map(|(at, _)| *at)
    }

    /// Marks the pods whose time has come.
    pub fn tick(&mut self, now: i64) {
        while let Some((at, uid)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            if let Some(p) = self.pods.get_mut(&uid) {
                p.due = None;
                self.dirty_pods.insert(uid.clone());
            }
        }
    }

    /// The writer's answer for a patch: a failed write is tried again after [`RETRY_MS`].
    pub fn write_failed(&mut self, uid: &str, now: i64) {
        if let Some(p) = self.pods.get_mut(uid) {
            p.sent = None;
            p.retry_at = now + RETRY_MS;
            self.dirty_pods.insert(uid.to_owned());
        }
    }

    fn dirty_deployment(&mut self, d: &ObjectKey) {
        if let Some(pods) = self.pods_of.get(d) {
            self.dirty_pods.extend(pods.iter().cloned());
        }
        self.wake_guards(d);
    }

    fn wake_guards(&mut self, d: &ObjectKey) {
        if let Some(ps) = self.guarded_by.get(d) {
            self.dirty_policies.extend(ps.iter().cloned());
        }
    }

    // ---- Evaluation ----

    /// Evaluates what changed. Until every watch has synced once, no pod is looked at (a pod
    /// seen before its policy would look unguarded); policies are woken all the same.
    pub fn flush(&mut self, consumers: &dyn Consumers, now: i64) -> Effects {
        if !self.synced.all() {
            return Effects { patches: vec![], wake: std::mem::take(&mut self.dirty_policies) };
        }
        let mut cache = ConsumerCache::new(consumers);
        let mut patches = Vec::new();
        for uid in std::mem::take(&mut self.dirty_pods) {
            if let Some(patch) = self.evaluate(&uid, &mut cache, now) {
                patches.push(patch);
            }
        }
        Effects { patches, wake: std::mem::take(&mut self.dirty_policies) }
    }

    /// Looks at every pod and policy again (after the first sync).
    pub fn mark_all(&mut self) {
        self.dirty_pods.extend(self.pods.keys().cloned());
        self.dirty_policies.extend(self.policies.keys().cloned());
    }

    fn evaluate(&mut self, uid: &str, cache: &mut ConsumerCache, now: i64) -> Option<PodPatch> {
        let entry = self.pods.get(uid)?;
        if let Some(due) = entry.due {
            self.timers.remove(&(due, uid.to_owned()));
        }
        if !entry.facts.has_gate || entry.facts.deleting || entry.facts.terminal {
            let p = self.pods.get_mut(uid)?;
            p.due = None;
            p.verdict = None;
            return None;
        }
        let open = entry.open();
        let waiting_since = entry.waiting_since();
        let mut votes: Vec<(String, PolicyVote)> = Vec::new();
        let mut voters = Vec::new();
        for key in self.deployment_key(&entry.facts).and_then(|d| self.guarded_by.get(&d)).into_iter().flatten() {
            let Some(policy) = self.policies.get(key) else { continue };
            if policy.facts.deleting {
                continue;
            }
            let vote = match &policy.facts.plan {
                Err(why) => PolicyVote {
                    vote: Vote::Hold { message: format!("QueuePolicy '{}' is invalid: {why}", key.name) },
                    due_ms: None,
                    attached_since: None,
                    counts: false,
                },
                Ok(plan) if plan.mode == GateMode::Observe => continue,
                Ok(plan) => {
                    let (tracking, consumers) = match &policy.binding {
                        Ok(b) => (cache.tracking(b), cache.consumers(b)),
                        Err(why) => (Tracking::Unavailable(why.to_string()), Arc::default()),
                    };
                    let mine: Vec<&Consumer> =
                        consumers.iter().filter(|c| self.owns(&entry.facts, c, plan) == Ownership::Owned).collect();
                    verdict::vote(&Ballot { plan, tracking: &tracking, mine: &mine, open, waiting_since, now })
                }
            };
            let label = match &policy.binding {
                Ok(b) => b.queue.to_string(),
                Err(_) => format!("QueuePolicy '{}'", key.name),
            };
            voters.push(key.clone());
            votes.push((label, vote));
        }
        let ballots: Vec<(String, &Vote)> = votes.iter().map(|(q, v)| (q.clone(), &v.vote)).collect();
        let verdict = verdict::combine(&ballots);
        let retry_at = entry.retry_at;
        let mut due = votes.iter().filter_map(|(_, v)| v.due_ms).min();
        let desired = verdict.open.filter(|want| *want != open);
        let patch = match desired {
            Some(_) if now < retry_at => {
                due = Some(due.map_or(retry_at, |d| d.min(retry_at)));
                None
            }
            Some(attached) => Some(PodPatch {
                namespace: entry.facts.namespace.clone(),
                pod: entry.facts.name.clone(),
                uid: uid.to_owned(),
                attached,
                reason: verdict.reason,
                message: verdict.message.clone(),
                transition_ms: now,
                waited_ms: if attached { waiting_since.map(|w| (now - w).max(0)) } else { None },
                policies: voters,
            }),
            None => None,
        };
        let p = self.pods.get_mut(uid)?;
        if let Some(patch) = &patch {
            p.sent = Some(patch.attached);
        }
        p.due = due;
        p.verdict = Some(verdict);
        if let Some(at) = due {
            self.timers.insert((at, uid.to_owned()));
        }
        patch
    }

    fn owns(&self, pod: &PodFacts, consumer: &Consumer, plan: &GatePlan) -> Ownership {
        ownership(pod, consumer, plan.match_by, |ip| self.addresses.get(ip).is_some_and(|h| h.len() > 1))
    }

    // ---- Views ----

    /// What one policy sees of its pods, for its status. None for an unknown or invalid policy.
    pub fn policy_view(&self, key: &ObjectKey, consumers: &dyn Consumers, now: i64) -> Option<PolicyView> {
        let entry = self.policies.get(key)?;
        let plan = entry.facts.plan.as_ref().ok()?;
        let (tracking, on_queue) = match &entry.binding {
            Ok(b) => (consumers.tracking(b.source, &b.queue.vhost), consumers.consumers_on(b.source, &b.queue)),
            Err(why) => (Tracking::Unavailable(why.to_string()), vec![]),
        };
        let guarded = self.guards.get(key).cloned().unwrap_or_default();
        let deployments: Vec<Arc<Deployment>> =
            guarded.iter().filter_map(|d| self.deployments.get(d)).map(|f| f.object.clone()).collect();
        let mut pods = Vec::new();
        let mut owned = vec![Ownership::Foreign; on_queue.len()];
        let mut ambiguous = BTreeSet::new();
        for uid in guarded.iter().filter_map(|d| self.pods_of.get(d)).flatten() {
            let Some(p) = self.pods.get(uid) else { continue };
            if p.facts.deleting || p.facts.terminal {
                continue;
            }
            let mut since = None;
            for (i, c) in on_queue.iter().enumerate() {
                match self.owns(&p.facts, c, plan) {
                    Ownership::Owned => {
                        owned[i] = Ownership::Owned;
                        since = Some(since.map_or(c.since_ms, |s: i64| s.min(c.since_ms)));
                    }
                    Ownership::Stale if owned[i] == Ownership::Foreign => owned[i] = Ownership::Stale,
                    _ => {}
                }
            }
            ambiguous
                .extend(p.facts.ips.iter().filter(|ip| self.addresses.get(*ip).is_some_and(|h| h.len() > 1)).cloned());
            let open = p.open();
            let min_ms = plan.min_attached_for.as_millis() as i64;
            let waiting = p.facts.has_gate && !open && p.facts.containers_ready_since_ms.is_some();
            pods.push(PodView {
                name: p.facts.name.clone(),
                has_gate: p.facts.has_gate,
                attached_since: since,
                counts: since.is_some_and(|s| open || now - s >= min_ms),
                open,
                waiting_since: if waiting { p.waiting_since() } else { None },
                waiting_for: p.verdict.as_ref().map(|v| v.waiting_for.clone()).unwrap_or_default(),
                due_ms: p.due,
            });
        }
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        pods.dedup_by(|a, b| a.name == b.name);
        Some(PolicyView {
            deployments,
            pods,
            tracking,
            unmatched: owned.iter().filter(|o| **o == Ownership::Foreign).count(),
            stale: owned.iter().filter(|o| **o == Ownership::Stale).count(),
            ambiguous_ips: ambiguous.into_iter().collect(),
            synced: self.synced.all(),
        })
    }

    /// What a Deployment's disruption budget should be: one per Deployment, however many
    /// policies guard it, with the strictest minAttached; none where a budget of someone else's
    /// already selects its pods (the eviction API refuses pods covered by two).
    pub fn budget_for(&self, deployment: &ObjectKey) -> Budget {
        let guards: Vec<(&PolicyFacts, &GatePlan)> = self
            .guarded_by
            .get(deployment)
            .into_iter()
            .flatten()
            .filter_map(|k| self.policies.get(k))
            .filter_map(|e| e.facts.enforcing().filter(|p| p.pod_disruption_budget).map(|p| (&e.facts, p)))
            .collect();
        let Some(d) = self.deployments.get(deployment).filter(|_| !guards.is_empty()) else { return Budget::None };
        let foreign: Vec<String> = self
            .budgets
            .values()
            .filter(|b| b.key.namespace == deployment.namespace && !b.ours && b.selects(&d.template_labels))
            .map(|b| b.key.name.clone())
            .collect();
        if !foreign.is_empty() {
            return Budget::Foreign(foreign);
        }
        let owners: Vec<(String, String)> = guards.iter().map(|(f, _)| (f.key.name.clone(), f.uid.clone())).collect();
        let min_attached = guards.iter().map(|(_, p)| p.min_attached).max().unwrap_or(1);
        match super::pdb::desired(&d.object, &owners, min_attached) {
            Some(want) => Budget::Want(Box::new(want)),
            None => Budget::None,
        }
    }

    /// The operator's budgets in `namespace` that name `policy_uid` among their owners, or cover
    /// one of `deployments`.
    pub fn budgets_touching(&self, namespace: &str, policy_uid: &str, deployments: &[ObjectKey]) -> Vec<BudgetFacts> {
        self.budgets
            .values()
            .filter(|b| b.key.namespace == namespace && b.ours)
            .filter(|b| {
                b.owners.iter().any(|o| o == policy_uid)
                    || b.deployment.as_ref().is_some_and(|d| deployments.iter().any(|k| &k.name == d))
            })
            .cloned()
            .collect()
    }

    /// The Deployments a policy guards (known or not).
    pub fn guarded(&self, policy: &ObjectKey) -> Vec<ObjectKey> {
        self.guards.get(policy).map(|s| s.iter().cloned().collect()).unwrap_or_default()
    }

    /// The policies guarding a pod's Deployment.
    pub fn guarding(&self, pod_uid: &str) -> Vec<ObjectKey> {
        let Some(p) = self.pods.get(pod_uid) else { return vec![] };
        self.deployment_key(&p.facts)
            .and_then(|d| self.guarded_by.get(&d))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The trackers some policy counts consumers through.
    /// The policies bound to a tracker.
    pub fn bound_policies(&self) -> BTreeSet<ObjectKey> {
        self.policies.iter().filter(|(_, e)| e.binding.is_ok()).map(|(k, _)| k.clone()).collect()
    }

    pub fn sources(&self) -> BTreeSet<u64> {
        self.bound.keys().map(|(source, _)| *source).collect()
    }

    /// Pods tracked, for metrics and benchmarks.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }
}

/// The keys held that a complete list leaves out.
fn unlisted<'a, K: Ord + Clone + 'a>(held: impl Iterator<Item = &'a K>, listed: impl Iterator<Item = &'a K>) -> Vec<K> {
    let listed: BTreeSet<&K> = listed.collect();
    held.filter(|k| !listed.contains(k)).cloned().collect()
}

/// A Deployment's disruption budget, decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Budget {
    Want(Box<PodDisruptionBudget>),
    /// Someone else's budgets already select its pods.
    Foreign(Vec<String>),
    None,
}

/// One pod as one policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    pub has_gate: bool,
    /// The oldest of its consumers on this policy's queue.
    pub attached_since: Option<i64>,
    /// Attached long enough to count towards minAttached.
    pub counts: bool,
    /// Its condition is True (or written True and not yet seen back).
    pub open: bool,
    /// Held back by the gate since (containers ready, condition not True).
    pub waiting_since: Option<i64>,
    /// Queues still missing its consumer, over every Enforce policy guarding it.
    pub waiting_for: Vec<String>,
    pub due_ms: Option<i64>,
}

/// One policy's pods and consumers.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyView {
    pub deployments: Vec<Arc<Deployment>>,
    pub pods: Vec<PodView>,
    pub tracking: Tracking,
    /// Consumers of the queue that belong to no pod of the policy.
    pub unmatched: usize,
    /// Consumers from a pod's address that connected before the pod had it.
    pub stale: usize,
    pub ambiguous_ips: Vec<String>,
    /// Every watch has synced once.
    pub synced: bool,
}

/// Consumers and tracking read once per queue per flush.
struct ConsumerCache<'a> {
    source: &'a dyn Consumers,
    consumers: HashMap<(u64, QueueKey), Arc<Vec<Consumer>>>,
    tracking: HashMap<(u64, String), Tracking>,
}

impl<'a> ConsumerCache<'a> {
    fn new(source: &'a dyn Consumers) -> Self {
        Self { source, consumers: HashMap::new(), tracking: HashMap::new() }
    }

    fn consumers(&mut self, b: &Binding) -> Arc<Vec<Consumer>> {
        self.consumers
            .entry((b.source, b.queue.clone()))
            .or_insert_with(|| Arc::new(self.source.consumers_on(b.source, &b.queue)))
            .clone()
    }

    fn tracking(&mut self, b: &Binding) -> Tracking {
        self.tracking
            .entry((b.source, b.queue.vhost.clone()))
            .or_insert_with(|| self.source.tracking(b.source, &b.queue.vhost))
            .clone()
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
