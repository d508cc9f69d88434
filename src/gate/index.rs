//! The gate's index: every pod of a guarded workload, the workloads (Deployments, StatefulSets,
//! Argo Rollouts) and QueuePolicies around them, the ReplicaSets that lead a pod to its
//! workload, the disruption budgets, and which broker queue each policy is bound to. It is keyed
//! so that the workloads a policy guards and the policies guarding a pod are one lookup each.
//!
//! Fed by the watches and by the consumer trackers. Pure and synchronous: a mutation marks the
//! pods, workloads and policies it touches, and [`GateIndex::flush`] evaluates them and returns
//! every write the gate wants (pod conditions, strategy fixes, disruption budgets) for the one
//! writer, and the policies whose status view may have changed. It is the only source of desired
//! state: reconciles read its views and write nothing of the gate's. A pod's condition is
//! written once when the pod first carries the gate, then only when its verdict flips; a write
//! not yet seen back through the watch counts as done, so nothing is sent twice.

use super::{
    PodPatch,
    guards::Selects,
    pods::{Ownership, PodFacts, ownership},
    verdict::{self, Ballot, GateReason, PodVerdict, PolicyVote, Vote},
};
use crate::{
    consumers::{Consumer, QueueKey, Tracking},
    crd::GateMode,
    names::MANAGED_BY,
    plan::GatePlan,
    workload::{Judgement, Kind, Workload, WorkloadKey, owner::PodOwner},
};
use k8s_openapi::{api::policy::v1::PodDisruptionBudget, apimachinery::pkg::apis::meta::v1::LabelSelector};
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

/// A failed write is tried again after this long, doubled at each failure in a row up to
/// [`RETRY_MAX_MS`]: a refusal that lasts (an admission policy's 403, a 422) costs the API
/// server one request every few minutes, not one a second.
pub const RETRY_MS: i64 = 1_000;
pub const RETRY_MAX_MS: i64 = 300_000;

/// The wait before the next try after `failures` failures in a row (at least one).
fn retry_after(failures: u32) -> i64 {
    (RETRY_MS << failures.saturating_sub(1).min(16)).min(RETRY_MAX_MS)
}

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
    /// The plan of a policy that acts on pods: valid, in Enforce mode, not being deleted.
    pub fn enforcing(&self) -> Option<&GatePlan> {
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
    /// It stands back for a queue another operator manages (ManagedElsewhere, `adopt: false`):
    /// it binds no queue, so it neither adds the gate nor votes.
    #[error("{0}")]
    StandsBack(String),
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
pub struct BoundQueue {
    pub source: u64,
    pub queue: QueueKey,
    /// Its dead-letter queue, whose deletion also wakes the policy (it is declared again).
    pub dead_letter_queue: Option<QueueKey>,
}

/// The live consumers, as the trackers see them.
pub trait Consumers {
    fn consumers_on(&self, source: u64, queue: &QueueKey) -> Vec<Consumer>;
    /// How the queue's consumers are seen: Starting until they are known.
    fn tracking(&self, source: u64, queue: &QueueKey) -> Tracking;
}

/// What the gate needs of a ReplicaSet: the workload controlling it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSetFacts {
    pub key: ObjectKey,
    pub owner: Option<WorkloadKey>,
}

/// What the gate needs of a PodDisruptionBudget.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetFacts {
    pub key: ObjectKey,
    pub selector: Option<LabelSelector>,
    /// Kept by queueguard (its managed-by label).
    pub ours: bool,
    /// For the operator's budgets: the workload it covers.
    pub workload: Option<WorkloadKey>,
    pub object: Arc<PodDisruptionBudget>,
}

impl BudgetFacts {
    pub fn from_budget(b: &PodDisruptionBudget) -> Self {
        use strum::VariantArray;
        let labels = b.labels();
        let mut object = b.clone();
        object.metadata.managed_fields = None;
        object.metadata.resource_version = None;
        object.status = None;
        let key = ObjectKey::of(b);
        let workload = Kind::VARIANTS
            .iter()
            .find_map(|k| labels.get(k.budget_label()).map(|name| WorkloadKey::new(*k, key.namespace.clone(), name)));
        Self {
            ours: labels.get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1),
            key,
            selector: b.spec.as_ref().and_then(|s| s.selector.clone()),
            workload,
            object: Arc::new(object),
        }
    }

    fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        // An empty selector selects every pod of the namespace (policy/v1).
        self.selector.clone().and_then(|s| Selector::try_from(s).ok()).is_some_and(|s| s.matches(labels))
    }
}

/// The watches the index is fed by; each has delivered its first complete list (or, for a
/// kind whose API is not installed, been given up on) when its flag is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, strum::VariantArray)]
pub enum Feed {
    Policies,
    Deployments,
    StatefulSets,
    Rollouts,
    ReplicaSets,
    Pods,
    Budgets,
}

/// Which feeds have synced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Synced(BTreeSet<Feed>);

impl Synced {
    pub fn all(&self) -> bool {
        use strum::VariantArray;
        self.0.len() == Feed::VARIANTS.len()
    }

    pub fn has(&self, feed: Feed) -> bool {
        self.0.contains(&feed)
    }
}

/// One write the gate wants, for the one writer.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// A pod's gate condition.
    Condition(PodPatch),
    /// A workload's strategy made safe: a server-side apply of its strategy fields.
    Strategy(StrategyFix),
    /// A workload's disruption budget, by server-side apply.
    ApplyBudget { workload: WorkloadKey, budget: Box<PodDisruptionBudget> },
    /// A budget of the operator's that no guarding policy wants any more.
    DeleteBudget { workload: WorkloadKey, budget: ObjectKey },
}

/// A strategy fix and what it answers.
#[derive(Debug, Clone, PartialEq)]
pub struct StrategyFix {
    pub workload: WorkloadKey,
    pub body: serde_json::Value,
    /// What was unsafe, and what the fix set.
    pub why: String,
    pub done: &'static str,
    /// The policies managing the strategy (gate.manageStrategy, Enforce).
    pub policies: Vec<ObjectKey>,
}

/// What a flush asks for.
#[derive(Debug, Default, PartialEq)]
pub struct Effects {
    /// What to write, in order.
    pub writes: Vec<Write>,
    /// Policies whose status view may have changed.
    pub wake: BTreeSet<ObjectKey>,
}

struct PolicyEntry {
    facts: PolicyFacts,
    binding: Result<BoundQueue, Unbound>,
}

struct PodEntry {
    facts: PodFacts,
    /// The condition status written and not yet seen back through the watch.
    sent: Option<bool>,
    due: Option<i64>,
    /// After a failed write: no new write before this.
    retry_at: i64,
    /// Writes failed in a row since the last one seen back.
    failures: u32,
    /// The last verdict (what the pod waits for), for status.
    verdict: Option<PodVerdict>,
}

impl PodEntry {
    /// The condition as it is on the pod, or as written and not yet seen back; None: never
    /// written.
    fn written(&self) -> Option<bool> {
        self.sent.or_else(|| self.facts.condition.as_ref().map(|c| c.status))
    }

    fn open(&self) -> bool {
        self.written().unwrap_or(false)
    }

    /// Open by failurePolicy Open, as written or as the pod shows: no consumer was seen.
    fn failed_open(&self) -> bool {
        match self.sent {
            Some(open) => open && self.verdict.as_ref().is_some_and(|v| v.reason.failed_open()),
            None => self
                .facts
                .condition
                .as_ref()
                .is_some_and(|c| c.status && c.reason.parse::<verdict::GateReason>().is_ok_and(|r| r.failed_open())),
        }
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

/// What the writer was last sent for a workload and has not been seen back yet.
#[derive(Default)]
struct WorkloadWrites {
    strategy: Option<serde_json::Value>,
    budget: Option<Sent>,
    retry_at: i64,
    /// Writes failed in a row (the entry goes once nothing is outstanding).
    failures: u32,
}

#[derive(Debug, Clone, PartialEq)]
enum Sent {
    Applied(Box<PodDisruptionBudget>),
    Deleted(ObjectKey),
}

#[derive(Default)]
struct Namespace {
    policies: BTreeSet<ObjectKey>,
    workloads: BTreeSet<WorkloadKey>,
}

#[derive(Default)]
pub struct GateIndex {
    policies: HashMap<ObjectKey, PolicyEntry>,
    workloads: HashMap<WorkloadKey, Workload>,
    /// Kinds the cluster does not serve (their pods are not waited for).
    unwatched_kinds: BTreeSet<Kind>,
    /// ReplicaSet → the workload controlling it (None: none of the kinds the gate knows).
    replica_sets: HashMap<ObjectKey, Option<WorkloadKey>>,
    pods: HashMap<String, PodEntry>,
    namespaces: HashMap<String, Namespace>,
    /// Policy → the workloads it guards; workload → the policies guarding it. Name matches are
    /// kept even before the workload is seen.
    guards: HashMap<ObjectKey, BTreeSet<WorkloadKey>>,
    guarded_by: HashMap<WorkloadKey, BTreeSet<ObjectKey>>,
    /// Workload → its pods (by UID), and ReplicaSet → its pods, so a ReplicaSet seen after its
    /// pods leads them to their workload.
    pods_of: HashMap<WorkloadKey, BTreeSet<String>>,
    pods_of_replica_set: HashMap<ObjectKey, BTreeSet<String>>,
    /// Broker queue → the policies counting its consumers.
    bound: HashMap<(u64, QueueKey), BTreeSet<ObjectKey>>,
    /// Dead-letter queue → the policies dead-lettering into it.
    dead_letters: HashMap<(u64, QueueKey), BTreeSet<ObjectKey>>,
    /// Address → the pods holding it (terminal pods hold none).
    addresses: HashMap<String, BTreeSet<String>>,
    budgets: HashMap<ObjectKey, BudgetFacts>,
    writes: HashMap<WorkloadKey, WorkloadWrites>,
    timers: BTreeSet<(i64, Timed)>,
    dirty_pods: BTreeSet<String>,
    dirty_workloads: BTreeSet<WorkloadKey>,
    dirty_policies: BTreeSet<ObjectKey>,
    synced: Synced,
}

/// What a timer wakes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timed {
    Pod(String),
    Workload(WorkloadKey),
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
        for w in self.guards.remove(key).unwrap_or_default() {
            if let Some(set) = self.guarded_by.get_mut(&w) {
                set.remove(key);
            }
            self.touch_workload(&w);
        }
    }

    /// Records which queue (on which tracker) a policy counts consumers on, or why it cannot.
    pub fn bind(&mut self, key: &ObjectKey, binding: Result<BoundQueue, Unbound>) {
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
        self.touch_guarded(key);
    }

    fn unbind_queue(&mut self, b: &BoundQueue, key: &ObjectKey) {
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

    /// Recomputes the workloads a policy guards.
    fn regard(&mut self, key: &ObjectKey) {
        let Some(entry) = self.policies.get(key) else { return };
        let selects = &entry.facts.selects;
        let wanted: BTreeSet<WorkloadKey> = match selects.named(&key.namespace) {
            Some(named) => BTreeSet::from([named]),
            None => self
                .namespaces
                .get(&key.namespace)
                .into_iter()
                .flat_map(|ns| &ns.workloads)
                .filter(|w| self.workloads.get(*w).is_some_and(|f| selects.matches(w.kind, &w.name, &f.labels)))
                .cloned()
                .collect(),
        };
        let old = self.guards.insert(key.clone(), wanted.clone()).unwrap_or_default();
        for w in old.difference(&wanted) {
            if let Some(set) = self.guarded_by.get_mut(w) {
                set.remove(key);
            }
        }
        for w in &wanted {
            self.guarded_by.entry(w.clone()).or_default().insert(key.clone());
        }
        for w in old.union(&wanted) {
            self.touch_workload(w);
        }
    }

    // ---- Workloads and ReplicaSets ----

    pub fn upsert_workload(&mut self, facts: Workload) {
        let key = facts.key.clone();
        if self.workloads.get(&key) == Some(&facts) {
            return;
        }
        self.namespaces.entry(key.namespace.clone()).or_default().workloads.insert(key.clone());
        self.workloads.insert(key.clone(), facts);
        self.reselect(&key);
        self.touch_workload(&key);
    }

    pub fn remove_workload(&mut self, key: &WorkloadKey) {
        if self.workloads.remove(key).is_none() {
            return;
        }
        if let Some(ns) = self.namespaces.get_mut(&key.namespace) {
            ns.workloads.remove(key);
        }
        self.touch_workload(key);
        self.reselect(key);
    }

    /// Re-evaluates which label-selecting policies of its namespace pick this workload.
    fn reselect(&mut self, w: &WorkloadKey) {
        let labels = self.workloads.get(w).map(|f| f.labels.clone());
        let policies: Vec<ObjectKey> =
            self.namespaces.get(&w.namespace).map(|ns| ns.policies.iter().cloned().collect()).unwrap_or_default();
        for p in policies {
            let Some(entry) = self.policies.get(&p) else { continue };
            if !matches!(entry.facts.selects, Selects::Labels { .. }) {
                continue;
            }
            let picks = labels.as_ref().is_some_and(|l| entry.facts.selects.matches(w.kind, &w.name, l));
            let guards = self.guards.entry(p.clone()).or_default();
            let changed = if picks { guards.insert(w.clone()) } else { guards.remove(w) };
            if changed {
                let set = self.guarded_by.entry(w.clone()).or_default();
                if picks {
                    set.insert(p.clone());
                } else {
                    set.remove(&p);
                }
                self.touch_workload(w);
            }
        }
    }

    pub fn upsert_replica_set(&mut self, facts: ReplicaSetFacts) {
        let old = self.replica_sets.insert(facts.key.clone(), facts.owner.clone());
        if old.as_ref() != Some(&facts.owner) {
            self.relink(&facts.key, old.flatten().as_ref(), facts.owner.as_ref());
        }
    }

    pub fn remove_replica_set(&mut self, key: &ObjectKey) {
        if let Some(old) = self.replica_sets.remove(key) {
            self.relink(key, old.as_ref(), None);
        }
    }

    /// Moves a ReplicaSet's pods from the workload it led to before to the one it leads to now.
    fn relink(&mut self, replica_set: &ObjectKey, old: Option<&WorkloadKey>, new: Option<&WorkloadKey>) {
        let pods = self.pods_of_replica_set.get(replica_set).cloned().unwrap_or_default();
        if pods.is_empty() {
            return;
        }
        if let Some(old) = old {
            if let Some(set) = self.pods_of.get_mut(old) {
                set.retain(|uid| !pods.contains(uid));
            }
            self.touch_workload(old);
        }
        if let Some(new) = new {
            self.pods_of.entry(new.clone()).or_default().extend(pods.iter().cloned());
            self.touch_workload(new);
        }
        self.dirty_pods.extend(pods);
    }

    /// A pod whose ReplicaSet the watch has not delivered yet: whose it is cannot be told, so
    /// it is not judged (judged unguarded, its gate would open before its consumer attached).
    fn owner_unknown(&self, pod: &PodFacts) -> bool {
        let replica_set_unknown = matches!(&pod.owner, Some(PodOwner::ReplicaSet(rs))
            if !self.replica_sets.contains_key(&ObjectKey::new(pod.namespace.clone(), rs.clone())));
        // Its workload not delivered yet (the watches are separate streams): by its labels it
        // may be guarded, so it is not judged unguarded meanwhile.
        replica_set_unknown
            || self
                .workload_of(pod)
                .is_some_and(|w| !self.workloads.contains_key(&w) && !self.unwatched_kinds.contains(&w.kind))
    }

    /// The workload a pod belongs to, through its controller.
    fn workload_of(&self, pod: &PodFacts) -> Option<WorkloadKey> {
        match pod.owner.as_ref()? {
            PodOwner::StatefulSet(name) => {
                Some(WorkloadKey::new(Kind::StatefulSet, pod.namespace.clone(), name.clone()))
            }
            PodOwner::ReplicaSet(name) => {
                self.replica_sets.get(&ObjectKey::new(pod.namespace.clone(), name.clone())).cloned().flatten()
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
        let (sent, retry_at, failures, verdict) = match self.pods.remove(&uid) {
            Some(old) => {
                self.forget_pod(&old);
                // Seen back: what was written is now on the pod.
                let confirmed = old.sent == facts.condition.as_ref().map(|c| c.status);
                let failures = if confirmed && old.sent.is_some() { 0 } else { old.failures };
                (old.sent.filter(|_| !confirmed), old.retry_at, failures, old.verdict)
            }
            None => (None, 0, 0, None),
        };
        if let Some(PodOwner::ReplicaSet(rs)) = &facts.owner {
            let rs = ObjectKey::new(facts.namespace.clone(), rs.clone());
            self.pods_of_replica_set.entry(rs).or_default().insert(uid.clone());
        }
        if let Some(w) = self.workload_of(&facts) {
            self.pods_of.entry(w.clone()).or_default().insert(uid.clone());
            self.wake_guards(&w);
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
        self.pods.insert(uid, PodEntry { facts, sent, due: None, retry_at, failures, verdict });
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
            self.timers.remove(&(due, Timed::Pod(uid.clone())));
        }
        if let Some(PodOwner::ReplicaSet(rs)) = &old.facts.owner {
            let rs = ObjectKey::new(old.facts.namespace.clone(), rs.clone());
            remove_from(&mut self.pods_of_replica_set, &rs, uid);
        }
        if let Some(w) = self.workload_of(&old.facts) {
            remove_from(&mut self.pods_of, &w, uid);
            self.wake_guards(&w);
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

    // ---- PodDisruptionBudgets ----

    pub fn upsert_budget(&mut self, facts: BudgetFacts) {
        if self.budgets.get(&facts.key) == Some(&facts) {
            return;
        }
        let namespace = facts.key.namespace.clone();
        self.budgets.insert(facts.key.clone(), facts);
        self.budget_changed(&namespace);
    }

    pub fn remove_budget(&mut self, key: &ObjectKey) {
        if self.budgets.remove(key).is_some() {
            self.budget_changed(&key.namespace);
        }
    }

    /// A budget can be any guarded workload's of its namespace (its own, or someone else's over
    /// the same pods).
    fn budget_changed(&mut self, namespace: &str) {
        let guarded: Vec<WorkloadKey> = self
            .guarded_by
            .iter()
            .filter(|(w, by)| w.namespace == namespace && !by.is_empty())
            .map(|(w, _)| w.clone())
            .collect();
        let ours: Vec<WorkloadKey> = self
            .budgets
            .values()
            .filter(|b| b.key.namespace == namespace && b.ours)
            .filter_map(|b| b.workload.clone())
            .collect();
        self.dirty_workloads.extend(guarded.iter().chain(&ours).cloned());
        for w in guarded {
            self.wake_guards(&w);
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
        self.synced.0.insert(Feed::Pods);
    }

    /// The complete list of one kind of workload.
    pub fn replace_workloads(&mut self, kind: Kind, workloads: Vec<Workload>) {
        let held: Vec<&WorkloadKey> = self.workloads.keys().filter(|k| k.kind == kind).collect();
        for key in unlisted(held.into_iter(), workloads.iter().map(|w| &w.key)) {
            self.remove_workload(&key);
        }
        for w in workloads {
            self.upsert_workload(w);
        }
        self.synced.0.insert(Feed::of(kind));
    }

    /// A kind whose API the cluster does not serve (no Argo Rollouts CRD): none of it exists.
    /// A kind whose API the cluster does not serve (Argo Rollouts not installed): its
    /// workloads never arrive, and their pods are not waited for.
    pub fn kind_unavailable(&mut self, kind: Kind) {
        self.unwatched_kinds.insert(kind);
        self.replace_workloads(kind, vec![]);
    }

    pub fn replace_replica_sets(&mut self, replica_sets: Vec<ReplicaSetFacts>) {
        for key in unlisted(self.replica_sets.keys(), replica_sets.iter().map(|r| &r.key)) {
            self.remove_replica_set(&key);
        }
        for r in replica_sets {
            self.upsert_replica_set(r);
        }
        self.synced.0.insert(Feed::ReplicaSets);
    }

    pub fn replace_policies(&mut self, policies: Vec<PolicyFacts>) {
        for key in unlisted(self.policies.keys(), policies.iter().map(|p| &p.key)) {
            self.remove_policy(&key);
        }
        for p in policies {
            self.upsert_policy(p);
        }
        self.synced.0.insert(Feed::Policies);
    }

    pub fn replace_budgets(&mut self, budgets: Vec<BudgetFacts>) {
        for key in unlisted(self.budgets.keys(), budgets.iter().map(|b| &b.key)) {
            self.remove_budget(&key);
        }
        for b in budgets {
            self.upsert_budget(b);
        }
        self.synced.0.insert(Feed::Budgets);
    }

    pub fn synced(&self) -> &Synced {
        &self.synced
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
            self.touch_guarded(&p);
            self.dirty_policies.insert(p);
        }
    }

    /// Every broker change may have been missed (a lagging subscriber): look at everything bound.
    pub fn all_consumers_changed(&mut self) {
        let policies: Vec<ObjectKey> = self.bound.values().flatten().cloned().collect();
        for p in policies {
            self.touch_guarded(&p);
            self.dirty_policies.insert(p);
        }
    }

    /// The earliest time a verdict or a write changes by time alone.
    pub fn next_due(&self) -> Option<i64> {
        self.timers.first().map(|(at, _)| *at)
    }

    /// Marks the pods and workloads whose time has come.
    pub fn tick(&mut self, now: i64) {
        while let Some((at, timed)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            match timed {
                Timed::Pod(uid) => {
                    if let Some(p) = self.pods.get_mut(&uid) {
                        p.due = None;
                        self.dirty_pods.insert(uid);
                    }
                }
                Timed::Workload(w) => {
                    self.dirty_workloads.insert(w);
                }
            }
        }
    }

    /// The writer's answer for a write that failed: it is tried again after [`RETRY_MS`].
    pub fn write_failed(&mut self, write: &Write, now: i64) {
        match write {
            Write::Condition(patch) => {
                if let Some(p) = self.pods.get_mut(&patch.uid) {
                    p.sent = None;
                    p.failures += 1;
                    p.retry_at = now + retry_after(p.failures);
                    self.dirty_pods.insert(patch.uid.clone());
                }
            }
            Write::Strategy(StrategyFix { workload, .. })
            | Write::ApplyBudget { workload, .. }
            | Write::DeleteBudget { workload, .. } => {
                let w = self.writes.entry(workload.clone()).or_default();
                match write {
                    Write::Strategy(_) => w.strategy = None,
                    _ => w.budget = None,
                }
                w.failures += 1;
                w.retry_at = now + retry_after(w.failures);
                self.timers.insert((w.retry_at, Timed::Workload(workload.clone())));
            }
        }
    }

    /// A workload changed for the gate: its pods, its policies' views and its own writes are
    /// looked at again.
    fn touch_workload(&mut self, w: &WorkloadKey) {
        if let Some(pods) = self.pods_of.get(w) {
            self.dirty_pods.extend(pods.iter().cloned());
        }
        self.dirty_workloads.insert(w.clone());
        self.wake_guards(w);
    }

    fn touch_guarded(&mut self, policy: &ObjectKey) {
        for w in self.guards.get(policy).cloned().unwrap_or_default() {
            self.touch_workload(&w);
        }
    }

    fn wake_guards(&mut self, w: &WorkloadKey) {
        if let Some(ps) = self.guarded_by.get(w) {
            self.dirty_policies.extend(ps.iter().cloned());
        }
    }

    // ---- Evaluation ----

    /// Evaluates what changed. Until every watch has synced once, nothing is looked at (a pod
    /// seen before its policy would look unguarded, a budget before its workload unwanted);
    /// policies are woken all the same.
    pub fn flush(&mut self, consumers: &dyn Consumers, now: i64) -> Effects {
        if !self.synced.all() {
            return Effects { writes: vec![], wake: std::mem::take(&mut self.dirty_policies) };
        }
        let mut cache = ConsumerCache::new(consumers);
        let mut writes = Vec::new();
        for uid in std::mem::take(&mut self.dirty_pods) {
            if let Some(patch) = self.evaluate(&uid, &mut cache, now) {
                writes.push(Write::Condition(patch));
            }
        }
        for w in std::mem::take(&mut self.dirty_workloads) {
            writes.extend(self.evaluate_workload(&w, now));
        }
        Effects { writes, wake: std::mem::take(&mut self.dirty_policies) }
    }

    /// Looks at every pod, workload and policy again (after the first sync).
    pub fn mark_all(&mut self) {
        self.dirty_pods.extend(self.pods.keys().cloned());
        self.dirty_workloads.extend(self.guarded_by.keys().cloned());
        self.dirty_workloads.extend(self.budgets.values().filter(|b| b.ours).filter_map(|b| b.workload.clone()));
        self.dirty_policies.extend(self.policies.keys().cloned());
    }

    fn evaluate(&mut self, uid: &str, cache: &mut ConsumerCache, now: i64) -> Option<PodPatch> {
        let entry = self.pods.get(uid)?;
        if let Some(due) = entry.due {
            self.timers.remove(&(due, Timed::Pod(uid.to_owned())));
        }
        if !entry.facts.has_gate || entry.facts.deleting || entry.facts.terminal || self.owner_unknown(&entry.facts) {
            let p = self.pods.get_mut(uid)?;
            p.due = None;
            p.verdict = None;
            return None;
        }
        let written = entry.written();
        let open = written.unwrap_or(false);
        let failed_open = entry.failed_open();
        let waiting_since = entry.waiting_since();
        let mut votes: Vec<(String, PolicyVote)> = Vec::new();
        let mut voters = Vec::new();
        for key in self.workload_of(&entry.facts).and_then(|w| self.guarded_by.get(&w)).into_iter().flatten() {
            let Some(policy) = self.policies.get(key) else { continue };
            if policy.facts.deleting {
                continue;
            }
            let hold = |reason, message| PolicyVote {
                vote: Vote::Hold { reason, message },
                due_ms: None,
                attached_since: None,
                counts: false,
            };
            let vote = match (&policy.facts.plan, &policy.binding) {
                (Err(NoGate::StandsBack(_)), _) => continue,
                (Err(why), _) => {
                    hold(GateReason::PolicyInvalid, format!("QueuePolicy '{}' is invalid: {why}", key.name))
                }
                (Ok(plan), _) if plan.mode == GateMode::Observe => continue,
                // Through the vote as consumers that cannot be seen, so failurePolicy and
                // attachTimeout apply; what it holds it holds as waiting for its queue.
                (Ok(plan), Err(why)) => {
                    let tracking = Tracking::Unavailable(format!("its queue is not bound yet: {why}"));
                    let ballot = Ballot {
                        plan,
                        tracking: &tracking,
                        mine: &[],
                        open,
                        failed_open,
                        undated: 0,
                        waiting_since,
                        now,
                    };
                    match verdict::vote(&ballot) {
                        PolicyVote { vote: Vote::Hold { .. }, due_ms, .. } => PolicyVote {
                            due_ms,
                            ..hold(GateReason::WaitingForQueues, format!("its queue is not bound yet: {why}"))
                        },
                        voted => voted,
                    }
                }
                (Ok(plan), Ok(b)) => {
                    let (tracking, consumers) = (cache.tracking(b), cache.consumers(b));
                    let owned: Vec<(Ownership, &Consumer)> =
                        consumers.iter().map(|c| (self.owns(&entry.facts, c, plan), c)).collect();
                    let mine: Vec<&Consumer> =
                        owned.iter().filter(|(o, _)| *o == Ownership::Owned).map(|(_, c)| *c).collect();
                    let undated = owned.iter().filter(|(o, _)| *o == Ownership::Undated).count();
                    verdict::vote(&Ballot {
                        plan,
                        tracking: &tracking,
                        mine: &mine,
                        open,
                        failed_open,
                        undated,
                        waiting_since,
                        now,
                    })
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
        // A flip is written; so is a pod's first word, which says why it waits even where the
        // verdict holds the condition as it is.
        let desired = match (verdict.open, written) {
            // Let through without a consumer, and now it has one: said once, so that losing it
            // closes the gate as for any pod.
            (Some(true), Some(true)) if failed_open && !verdict.reason.failed_open() => Some(true),
            (Some(want), Some(have)) if want == have => None,
            (Some(want), _) => Some(want),
            (None, None) => Some(false),
            (None, Some(_)) => None,
        };
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
                first: written.is_none(),
                reason: verdict.reason,
                message: verdict.message.clone(),
                transition_ms: now,
                waited_ms: if attached && !open { waiting_since.map(|w| (now - w).max(0)) } else { None },
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
            self.timers.insert((at, Timed::Pod(uid.to_owned())));
        }
        patch
    }

    /// The strategy fix and budget writes a workload needs now, leaving out what was sent and
    /// not yet seen back through the watches.
    fn evaluate_workload(&mut self, key: &WorkloadKey, now: i64) -> Vec<Write> {
        let retry_at = self.writes.get(key).map_or(0, |w| w.retry_at);
        if now < retry_at {
            self.timers.insert((retry_at, Timed::Workload(key.clone())));
            return vec![];
        }
        let fix = self.strategy_fix(key);
        let budget = self.budget_write(key);
        let sent = self.writes.entry(key.clone()).or_default();
        let mut out = Vec::new();
        if let Some(fix) = unsent(&mut sent.strategy, fix.as_ref().map(|f| f.body.clone())).and(fix) {
            out.push(Write::Strategy(fix));
        }
        out.extend(unsent(&mut sent.budget, budget).map(|write| match write {
            Sent::Applied(budget) => Write::ApplyBudget { workload: key.clone(), budget },
            Sent::Deleted(budget) => Write::DeleteBudget { workload: key.clone(), budget },
        }));
        if sent.strategy.is_none() && sent.budget.is_none() {
            self.writes.remove(key);
        }
        out
    }

    /// The strategy fix the policies managing a workload's strategy call for: judged for the
    /// strictest minAttached among them, for the kinds queueguard may change.
    fn strategy_fix(&self, key: &WorkloadKey) -> Option<StrategyFix> {
        let workload = self.workloads.get(key).filter(|_| key.kind.strategy_managed())?;
        let managing: Vec<(&ObjectKey, &GatePlan)> = self
            .guarded_by
            .get(key)?
            .iter()
            .filter_map(|k| self.policies.get(k)?.facts.enforcing().filter(|p| p.manage_strategy).map(|p| (k, p)))
            .collect();
        let min_attached = managing.iter().map(|(_, p)| p.min_attached).max()?;
        match workload.judge(min_attached) {
            Judgement::Fixable { why, fix, done } => Some(StrategyFix {
                workload: key.clone(),
                body: fix,
                why,
                done,
                policies: managing.iter().map(|(k, _)| (*k).clone()).collect(),
            }),
            _ => None,
        }
    }

    /// The one budget write a workload needs: its budget applied where it differs from what
    /// the watch shows, or the operator's budget deleted where none is wanted.
    fn budget_write(&self, key: &WorkloadKey) -> Option<Sent> {
        let ours = self.budgets.values().find(|b| b.ours && b.workload.as_ref() == Some(key));
        match self.budget_for(key) {
            Budget::Want(want) => {
                let same = ours.is_some_and(|b| b.key.name == want.name_any() && super::pdb::same(&b.object, &want));
                (!same).then_some(Sent::Applied(want))
            }
            Budget::Foreign(_) | Budget::None => ours.map(|b| Sent::Deleted(b.key.clone())),
        }
    }

    fn owns(&self, pod: &PodFacts, consumer: &Consumer, plan: &GatePlan) -> Ownership {
        ownership(pod, consumer, plan.match_by, |ip| self.addresses.get(ip).is_some_and(|h| h.len() > 1))
    }

    // ---- Views ----

    /// What one policy sees of its workloads and pods, for its status. None for an unknown or
    /// invalid policy.
    pub fn policy_view(&self, key: &ObjectKey, consumers: &dyn Consumers, now: i64) -> Option<PolicyView> {
        let entry = self.policies.get(key)?;
        let plan = entry.facts.plan.as_ref().ok()?;
        let (tracking, on_queue) = match &entry.binding {
            Ok(b) => (consumers.tracking(b.source, &b.queue), consumers.consumers_on(b.source, &b.queue)),
            Err(why) => (Tracking::Unavailable(why.to_string()), vec![]),
        };
        let guarded = self.guards.get(key).cloned().unwrap_or_default();
        let workloads: Vec<Workload> = guarded.iter().filter_map(|w| self.workloads.get(w)).cloned().collect();
        let budgets = workloads.iter().map(|w| (w.key.clone(), self.budget_for(&w.key))).collect();
        let mut pods = Vec::new();
        let mut owned = vec![Ownership::Foreign; on_queue.len()];
        let mut ambiguous = BTreeSet::new();
        for uid in guarded.iter().filter_map(|w| self.pods_of.get(w)).flatten() {
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
                    o @ (Ownership::Stale | Ownership::Undated) if owned[i] == Ownership::Foreign => owned[i] = o,
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
            selects: entry.facts.selects.clone(),
            workloads,
            budgets,
            pods,
            tracking,
            unmatched: owned.iter().filter(|o| **o == Ownership::Foreign).count(),
            stale: owned.iter().filter(|o| **o == Ownership::Stale).count(),
            undated: owned.iter().filter(|o| **o == Ownership::Undated).count(),
            ambiguous_ips: ambiguous.into_iter().collect(),
            synced: self.synced.all(),
        })
    }

    /// What a workload's disruption budget should be: one per workload, however many policies
    /// guard it, with the strictest minAttached; none where a budget of someone else's already
    /// selects its pods (the eviction API refuses pods covered by two).
    pub fn budget_for(&self, workload: &WorkloadKey) -> Budget {
        let guards: Vec<(&PolicyFacts, &GatePlan)> = self
            .guarded_by
            .get(workload)
            .into_iter()
            .flatten()
            .filter_map(|k| self.policies.get(k))
            .filter_map(|e| e.facts.enforcing().filter(|p| p.pod_disruption_budget).map(|p| (&e.facts, p)))
            .collect();
        let Some(w) = self.workloads.get(workload).filter(|_| !guards.is_empty()) else { return Budget::None };
        let template_labels = w.template_labels();
        let foreign: Vec<String> = self
            .budgets
            .values()
            .filter(|b| b.key.namespace == workload.namespace && !b.ours && b.selects(&template_labels))
            .map(|b| b.key.name.clone())
            .collect();
        if !foreign.is_empty() {
            return Budget::Foreign(foreign);
        }
        let owners: Vec<(String, String)> = guards.iter().map(|(f, _)| (f.key.name.clone(), f.uid.clone())).collect();
        let min_attached = guards.iter().map(|(_, p)| p.min_attached).max().unwrap_or(1);
        match super::pdb::desired(w, &owners, min_attached) {
            Some(want) => Budget::Want(Box::new(want)),
            None => Budget::None,
        }
    }

    /// The workloads a policy guards (known or not).
    pub fn guarded(&self, policy: &ObjectKey) -> Vec<WorkloadKey> {
        self.guards.get(policy).map(|s| s.iter().cloned().collect()).unwrap_or_default()
    }

    /// The policies guarding a pod's workload.
    pub fn guarding(&self, pod_uid: &str) -> Vec<ObjectKey> {
        let Some(p) = self.pods.get(pod_uid) else { return vec![] };
        self.workload_of(&p.facts)
            .and_then(|w| self.guarded_by.get(&w))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The policies bound to a tracker.
    pub fn bound_policies(&self) -> BTreeSet<ObjectKey> {
        self.policies.iter().filter(|(_, e)| e.binding.is_ok()).map(|(k, _)| k.clone()).collect()
    }

    /// The trackers some policy counts consumers through.
    pub fn sources(&self) -> BTreeSet<u64> {
        self.bound.keys().map(|(source, _)| *source).collect()
    }

    /// Pods tracked, for metrics and benchmarks.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }
}

impl Feed {
    pub fn of(kind: Kind) -> Self {
        match kind {
            Kind::Deployment => Self::Deployments,
            Kind::StatefulSet => Self::StatefulSets,
            Kind::Rollout => Self::Rollouts,
        }
    }
}

/// What of `want` is not sent yet: it is recorded as sent and returned. A None want clears the
/// record (the watch shows what was sent, or nothing is wanted any more).
fn unsent<T: PartialEq + Clone>(slot: &mut Option<T>, want: Option<T>) -> Option<T> {
    match want {
        Some(w) if slot.as_ref() != Some(&w) => {
            *slot = Some(w.clone());
            Some(w)
        }
        Some(_) => None,
        None => {
            *slot = None;
            None
        }
    }
}

fn remove_from<K: std::hash::Hash + Eq>(map: &mut HashMap<K, BTreeSet<String>>, key: &K, uid: &str) {
    if let Some(set) = map.get_mut(key) {
        set.remove(uid);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

/// The keys held that a complete list leaves out.
fn unlisted<'a, K: Ord + Clone + 'a>(held: impl Iterator<Item = &'a K>, listed: impl Iterator<Item = &'a K>) -> Vec<K> {
    let listed: BTreeSet<&K> = listed.collect();
    held.filter(|k| !listed.contains(k)).cloned().collect()
}

/// A workload's disruption budget, decided.
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

/// One policy's workloads, pods and consumers.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyView {
    /// How it picks its workloads.
    pub selects: Selects,
    pub workloads: Vec<Workload>,
    /// Each workload's disruption budget, as the index decides it.
    pub budgets: Vec<(WorkloadKey, Budget)>,
    pub pods: Vec<PodView>,
    pub tracking: Tracking,
    /// Consumers of the queue that belong to no pod of the policy.
    pub unmatched: usize,
    /// Consumers from a pod's address that connected before the pod had it.
    pub stale: usize,
    /// Consumers of guarded pods whose connection age is unknown (not listed to the broker user).
    pub undated: usize,
    pub ambiguous_ips: Vec<String>,
    /// Every watch has synced once.
    pub synced: bool,
}

/// Consumers and tracking read once per queue per flush.
struct ConsumerCache<'a> {
    source: &'a dyn Consumers,
    consumers: HashMap<(u64, QueueKey), Arc<Vec<Consumer>>>,
    tracking: HashMap<(u64, QueueKey), Tracking>,
}

impl<'a> ConsumerCache<'a> {
    fn new(source: &'a dyn Consumers) -> Self {
        Self { source, consumers: HashMap::new(), tracking: HashMap::new() }
    }

    fn consumers(&mut self, b: &BoundQueue) -> Arc<Vec<Consumer>> {
        self.consumers
            .entry((b.source, b.queue.clone()))
            .or_insert_with(|| Arc::new(self.source.consumers_on(b.source, &b.queue)))
            .clone()
    }

    fn tracking(&mut self, b: &BoundQueue) -> Tracking {
        self.tracking
            .entry((b.source, b.queue.clone()))
            .or_insert_with(|| self.source.tracking(b.source, &b.queue))
            .clone()
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
