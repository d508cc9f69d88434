//! The gate's Kubernetes and broker I/O around the pure [`GateIndex`]: the watches and the
//! consumer trackers feed it, one task makes every write it decides (pod conditions, strategy
//! fixes, disruption budgets), a timer wakes it when time alone changes a verdict, and each
//! policy's reconcile reads its view from it (no LISTs, no writes of the gate's).

use super::{Context, Error};
use crate::{
    consumers::{
        Change, Consumer, ConsumerTracker, QueueKey, Tracking,
        tracker::{Interest, now_ms},
    },
    crd::{API_VERSION, BudgetOwner, DisruptionBudgetObservation, QueuePolicy},
    events::{EventReason, EventSpec},
    gate::{
        self, PodPatch,
        index::{
            BoundQueue, BudgetFacts, Consumers, Effects, GateIndex, ObjectKey, PolicyFacts, ReplicaSetFacts,
            StrategyFix, Unbound, Write,
        },
        pods::PodFacts,
    },
    metrics::{Metrics, PolicyLabels},
    names::FIELD_MANAGER,
    plan::{GatePlan, Limits},
    status::GateReport,
    sync::lock,
    workload::{Kind, Workload, WorkloadKey, owner::replica_set_owner, rollout::Rollout},
};
use futures::{Stream, StreamExt};
use k8s_openapi::api::{
    apps::v1::{Deployment, ReplicaSet, StatefulSet},
    core::v1::{ObjectReference, Pod},
    policy::v1::PodDisruptionBudget,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, PartialObjectMeta, Patch, PatchParams},
    runtime::{
        events::{Event, EventType, Recorder},
        reflector::ObjectRef,
        watcher,
    },
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};
use tokio::sync::{Notify, broadcast::error::RecvError, mpsc, watch};

/// How long the writer may go without an answer from the API server before the leader gives
/// its Lease up: two requests cut off at their deadline in a row.
pub const WRITER_STALL: Duration = Duration::from_secs(2 * crate::kube_api::REQUEST_TIMEOUT.as_secs());

/// How long a reconcile waits for the gate's watches to sync before it retries.
pub(crate) const SYNC_WAIT: Duration = Duration::from_secs(30);

/// The index, what feeds it and what performs its decisions.
pub struct Gate {
    index: Mutex<GateIndex>,
    trackers: Mutex<HashMap<u64, Arc<ConsumerTracker>>>,
    limits: Limits,
    writes: mpsc::UnboundedSender<Write>,
    wake: mpsc::UnboundedSender<ObjectRef<QueuePolicy>>,
    timer: Arc<Notify>,
    synced: watch::Sender<bool>,
    relists: Mutex<Relists>,
    /// Since when the writer has had a write out and no answer from the API server (None: idle,
    /// or answered since).
    unanswered_since: Mutex<Option<tokio::time::Instant>>,
    /// What each bound policy asked its tracker to keep (its queue and dead-letter queue).
    interests: Mutex<HashMap<ObjectKey, [Interest; 2]>>,
}

/// Where a policy's consumers are counted and its queues watched for deletion.
pub struct QueueWatch {
    pub tracker: Arc<ConsumerTracker>,
    pub queue: QueueKey,
    pub dead_letter_queue: QueueKey,
}

/// Objects of a watch's re-list, until its end says which others are gone.
#[derive(Default)]
pub struct Relists {
    policies: Option<Vec<PolicyFacts>>,
    deployments: Option<Vec<Workload>>,
    stateful_sets: Option<Vec<Workload>>,
    rollouts: Option<Vec<Workload>>,
    replica_sets: Option<Vec<ReplicaSetFacts>>,
    pods: Option<Vec<PodFacts>>,
    budgets: Option<Vec<BudgetFacts>>,
}

/// The trackers, as the index reads consumers.
struct Live(HashMap<u64, Arc<ConsumerTracker>>);

impl Consumers for Live {
    fn consumers_on(&self, source: u64, queue: &QueueKey) -> Vec<Consumer> {
        self.0.get(&source).map(|t| t.consumers_on(queue)).unwrap_or_default()
    }

    fn tracking(&self, source: u64, queue: &QueueKey) -> Tracking {
        self.0.get(&source).map_or(Tracking::Unavailable("no consumer tracker".into()), |t| t.tracking_of(queue))
    }
}

impl Gate {
    /// Starts the writer and the timer. Policies the index wakes come out of the
    /// returned receiver.
    pub fn start(
        client: Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        limits: Limits,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<ObjectRef<QueuePolicy>>) {
        let (writes, write_rx) = mpsc::unbounded_channel();
        let (wake, wake_rx) = mpsc::unbounded_channel();
        let gate = Arc::new(Self {
            index: Mutex::default(),
            trackers: Mutex::default(),
            limits,
            writes,
            wake,
            timer: Arc::default(),
            synced: watch::channel(false).0,
            relists: Mutex::default(),
            unanswered_since: Mutex::default(),
            interests: Mutex::default(),
        });
        tokio::spawn(write_all(Arc::downgrade(&gate), client, recorder, metrics, write_rx));
        tokio::spawn(run_timers(Arc::downgrade(&gate), gate.timer.clone()));
        (gate, wake_rx)
    }

    /// Changes the index, evaluates what changed, and sends the writes and wake-ups.
    pub fn update<R>(&self, change: impl FnOnce(&mut GateIndex) -> R) -> R {
        let trackers = Live(lock(&self.trackers).clone());
        let (result, synced) = {
            let mut index = lock(&self.index);
            let was_synced = index.synced().all();
            let result = change(&mut index);
            let synced = index.synced().all();
            if synced && !was_synced {
                index.mark_all();
            }
            // Queued before the lock goes: two updates' writes reach the writer in the order
            // they were decided (a True after the False it preceded would stick).
            self.dispatch(index.flush(&trackers, now_ms()));
            (result, synced)
        };
        if synced {
            self.synced.send_if_modified(|s| !std::mem::replace(s, true));
        }
        result
    }

    /// Queues the writes and wake-ups (unbounded channels: never waits).
    fn dispatch(&self, effects: Effects) {
        for write in effects.writes {
            let _ = self.writes.send(write);
        }
        for key in effects.wake {
            let _ = self.wake.send(ObjectRef::new(&key.name).within(&key.namespace));
        }
        self.timer.notify_one();
    }

    /// How long the writer has had work and no answer from the API server: a leader whose
    /// writer cannot write must let another replica lead (see `controller::run`).
    pub fn writer_unanswered(&self) -> Option<Duration> {
        lock(&self.unanswered_since).map(|since| since.elapsed())
    }

    /// Whether every watch has delivered its first list.
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.synced()).await.is_ok()
    }

    /// Resolves once every watch has delivered its first list.
    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Records that a policy counts consumers on `queue` (and dead-letters into
    /// `dead_letter_queue`) through `tracker`, or why it cannot, and makes sure that tracker's
    /// changes reach the index.
    pub fn bind(self: &Arc<Self>, policy: &ObjectKey, binding: Result<QueueWatch, Unbound>) {
        // The tracker keeps the consumers and deletion of these queues while the binding lasts.
        let interests = binding
            .as_ref()
            .ok()
            .map(|w| [w.tracker.watch(w.queue.clone()), w.tracker.watch(w.dead_letter_queue.clone())]);
        let replaced = match interests {
            Some(i) => lock(&self.interests).insert(policy.clone(), i),
            None => lock(&self.interests).remove(policy),
        };
        drop(replaced);
        let binding = binding.map(|QueueWatch { tracker, queue, dead_letter_queue }| {
            let source = tracker.id();
            let new = lock(&self.trackers).insert(source, tracker.clone()).is_none();
            if new {
                tokio::spawn(forward_changes(Arc::downgrade(self), source, tracker.subscribe()));
            }
            BoundQueue { source, queue, dead_letter_queue: Some(dead_letter_queue) }
        });
        let sources = self.update(|i| {
            i.bind(policy, binding);
            i.sources()
        });
        self.keep_trackers(&sources);
    }

    /// Lets go of the trackers no policy counts through any more (credentials rotated, policies
    /// gone), so their connections can close.
    fn keep_trackers(&self, sources: &std::collections::BTreeSet<u64>) {
        lock(&self.trackers).retain(|id, _| sources.contains(id));
    }

    pub fn forget_policy(&self, policy: &ObjectKey) {
        self.update(|i| i.remove_policy(policy));
        self.keep_what_is_bound();
    }

    /// Lets go of the trackers and queue interests of policies no longer bound (deleted, or
    /// gone from a re-list).
    fn keep_what_is_bound(&self) {
        let (bound, sources) = {
            let index = lock(&self.index);
            (index.bound_policies(), index.sources())
        };
        let released: Vec<[Interest; 2]> = {
            let mut interests = lock(&self.interests);
            let gone: Vec<ObjectKey> = interests.keys().filter(|k| !bound.contains(*k)).cloned().collect();
            gone.iter().filter_map(|k| interests.remove(k)).collect()
        };
        drop(released);
        self.keep_trackers(&sources);
    }

    pub fn view(&self, policy: &ObjectKey) -> Option<gate::index::PolicyView> {
        let trackers = Live(lock(&self.trackers).clone());
        lock(&self.index).policy_view(policy, &trackers, now_ms())
    }

    /// Reads the index without changing it.
    pub fn read<R>(&self, f: impl FnOnce(&GateIndex) -> R) -> R {
        f(&lock(&self.index))
    }

    // ---- Watches ----

    /// One watch event of a kind the index keeps. A re-list (`Init` … `InitDone`) is gathered
    /// and then replaces what the index holds of that kind: objects deleted while the watch was
    /// down are gone.
    pub fn on<K: Indexed>(&self, event: &watcher::Event<K>) {
        let now = now_ms();
        match event {
            watcher::Event::Apply(o) => {
                let facts = o.facts(self.limits);
                self.update(|i| K::upsert(i, facts, now));
            }
            watcher::Event::Delete(o) => {
                self.update(|i| K::remove(i, o));
                self.keep_what_is_bound();
            }
            watcher::Event::Init => *K::relist(&mut lock(&self.relists)) = Some(vec![]),
            watcher::Event::InitApply(o) => {
                let facts = o.facts(self.limits);
                K::relist(&mut lock(&self.relists)).get_or_insert_default().push(facts);
            }
            watcher::Event::InitDone => {
                let all = K::relist(&mut lock(&self.relists)).take().unwrap_or_default();
                self.update(|i| K::replace(i, all, now));
                self.keep_what_is_bound();
            }
        }
    }

    /// A kind whose API the cluster does not serve (no Argo Rollouts CRD): none of it exists,
    /// and its watch is not started.
    pub fn kind_unavailable(&self, kind: Kind) {
        self.update(|i| i.kind_unavailable(kind));
    }
}

/// A watched kind, as the index takes it.
pub trait Indexed: Sized {
    type Facts;
    fn facts(&self, limits: Limits) -> Self::Facts;
    fn upsert(index: &mut GateIndex, facts: Self::Facts, now: i64);
    fn remove(index: &mut GateIndex, object: &Self);
    /// A complete list: objects of this kind not in it are gone.
    fn replace(index: &mut GateIndex, all: Vec<Self::Facts>, now: i64);
    fn relist(relists: &mut Relists) -> &mut Option<Vec<Self::Facts>>;
}

impl Indexed for QueuePolicy {
    type Facts = PolicyFacts;
    fn facts(&self, limits: Limits) -> PolicyFacts {
        gate::policy_facts(self, limits)
    }
    fn upsert(index: &mut GateIndex, facts: PolicyFacts, _: i64) {
        index.upsert_policy(facts);
    }
    fn remove(index: &mut GateIndex, object: &Self) {
        index.remove_policy(&ObjectKey::of(object));
    }
    fn replace(index: &mut GateIndex, all: Vec<PolicyFacts>, _: i64) {
        index.replace_policies(all);
    }
    fn relist(relists: &mut Relists) -> &mut Option<Vec<PolicyFacts>> {
        &mut relists.policies
    }
}

/// The workload kinds, each through the seam.
macro_rules! indexed_workload {
    ($kind:ty, $slot:ident, $k:expr) => {
        impl Indexed for $kind {
            type Facts = Workload;
            fn facts(&self, _: Limits) -> Workload {
                Workload::new(self.clone())
            }
            fn upsert(index: &mut GateIndex, facts: Workload, _: i64) {
                index.upsert_workload(facts);
            }
            fn remove(index: &mut GateIndex, object: &Self) {
                index.remove_workload(&WorkloadKey::new($k, object.namespace().unwrap_or_default(), object.name_any()));
            }
            fn replace(index: &mut GateIndex, all: Vec<Workload>, _: i64) {
                index.replace_workloads($k, all);
            }
            fn relist(relists: &mut Relists) -> &mut Option<Vec<Workload>> {
                &mut relists.$slot
            }
        }
    };
}

indexed_workload!(Deployment, deployments, Kind::Deployment);
indexed_workload!(StatefulSet, stateful_sets, Kind::StatefulSet);
indexed_workload!(Rollout, rollouts, Kind::Rollout);

impl Indexed for PartialObjectMeta<ReplicaSet> {
    type Facts = ReplicaSetFacts;
    fn facts(&self, _: Limits) -> ReplicaSetFacts {
        ReplicaSetFacts { key: ObjectKey::of(self), owner: replica_set_owner(&self.metadata) }
    }
    fn upsert(index: &mut GateIndex, facts: ReplicaSetFacts, _: i64) {
        index.upsert_replica_set(facts);
    }
    fn remove(index: &mut GateIndex, object: &Self) {
        index.remove_replica_set(&ObjectKey::of(object));
    }
    fn replace(index: &mut GateIndex, all: Vec<ReplicaSetFacts>, _: i64) {
        index.replace_replica_sets(all);
    }
    fn relist(relists: &mut Relists) -> &mut Option<Vec<ReplicaSetFacts>> {
        &mut relists.replica_sets
    }
}

impl Indexed for Pod {
    type Facts = PodFacts;
    fn facts(&self, _: Limits) -> PodFacts {
        PodFacts::from_pod(self)
    }
    fn upsert(index: &mut GateIndex, facts: PodFacts, now: i64) {
        index.upsert_pod(facts, now);
    }
    fn remove(index: &mut GateIndex, object: &Self) {
        index.remove_pod(&object.uid().unwrap_or_default());
    }
    fn replace(index: &mut GateIndex, all: Vec<PodFacts>, now: i64) {
        index.replace_pods(all, now);
    }
    fn relist(relists: &mut Relists) -> &mut Option<Vec<PodFacts>> {
        &mut relists.pods
    }
}

impl Indexed for PodDisruptionBudget {
    type Facts = BudgetFacts;
    fn facts(&self, _: Limits) -> BudgetFacts {
        BudgetFacts::from_budget(self)
    }
    fn upsert(index: &mut GateIndex, facts: BudgetFacts, _: i64) {
        index.upsert_budget(facts);
    }
    fn remove(index: &mut GateIndex, object: &Self) {
        index.remove_budget(&ObjectKey::of(object));
    }
    fn replace(index: &mut GateIndex, all: Vec<BudgetFacts>, _: i64) {
        index.replace_budgets(all);
    }
    fn relist(relists: &mut Relists) -> &mut Option<Vec<BudgetFacts>> {
        &mut relists.budgets
    }
}

/// Feeds a watch into the gate until it ends.
pub async fn feed<K, S>(stream: S, apply: impl Fn(&watcher::Event<K>))
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => apply(&event),
            Err(e) => tracing::warn!(error = %e, "gate watch error; retrying"),
        }
    }
}

/// A tracker's changes into the index, in batches (a burst of attaches is one evaluation).
async fn forward_changes(gate: Weak<Gate>, source: u64, mut changes: tokio::sync::broadcast::Receiver<Change>) {
    loop {
        let first = changes.recv().await;
        let Some(gate) = gate.upgrade() else { return };
        let mut batch = Vec::new();
        let mut lagged = false;
        match first {
            Ok(c) => batch.push(c),
            Err(RecvError::Lagged(_)) => lagged = true,
            Err(RecvError::Closed) => return,
        }
        loop {
            match changes.try_recv() {
                Ok(c) => batch.push(c),
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => lagged = true,
                Err(_) => break,
            }
        }
        gate.update(|i| {
            if lagged {
                i.all_consumers_changed();
            }
            for change in &batch {
                i.consumers_changed(source, change);
            }
        });
    }
}

/// Wakes the index when a verdict changes by time alone (minAttachedSeconds, attachTimeout,
/// a write to try again).
async fn run_timers(gate: Weak<Gate>, timer: Arc<Notify>) {
    loop {
        let notified = timer.notified();
        let Some(g) = gate.upgrade() else { return };
        let next = lock(&g.index).next_due();
        drop(g);
        let sleep = match next {
            Some(at) => Duration::from_millis((at - now_ms()).max(0) as u64),
            None => Duration::from_secs(3600),
        };
        tokio::select! {
            () = tokio::time::sleep(sleep) => {
                let Some(g) = gate.upgrade() else { return };
                g.update(|i| i.tick(now_ms()));
            }
            () = notified => {}
        }
    }
}

/// The one writer of everything the gate decides: each write in order (pod conditions by
/// strategic merge patch on pods/status with the pod's UID as precondition, strategy fixes and
/// budgets by server-side apply under the operator's field manager), with its Event beside.
/// Every request is bounded (`kube_api`), so a write the API server never answers fails, is tried
/// again later, and holds the next one back only that long. It runs on the leader only: the
/// index is fed once the Lease is held.
async fn write_all(
    gate: Weak<Gate>,
    client: Client,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    mut writes: mpsc::UnboundedReceiver<Write>,
) {
    while let Some(write) = writes.recv().await {
        if let Some(g) = gate.upgrade() {
            lock(&g.unanswered_since).get_or_insert_with(tokio::time::Instant::now);
        }
        let written = perform(&client, &write).await;
        tracing::debug!(write = %describe(&write), ok = written.is_ok(), "gate write");
        if matches!(written, Ok(()) | Err(kube::Error::Api(_)))
            && let Some(g) = gate.upgrade()
        {
            *lock(&g.unanswered_since) = None;
        }
        match written {
            Ok(()) => match &write {
                Write::Condition(patch) => {
                    // The next pod's condition does not wait for this one's Event.
                    if let Some(spec) = patch.event() {
                        tokio::spawn(publish(recorder.clone(), pod_reference(patch), spec));
                    }
                    if let Some(waited) = patch.waited_ms {
                        for p in &patch.policies {
                            let labels = PolicyLabels { namespace: p.namespace.clone(), policy: p.name.clone() };
                            metrics.gate_opened(&labels, Duration::from_millis(waited as u64));
                        }
                    }
                }
                Write::Strategy(fix) => {
                    for policy in &fix.policies {
                        tokio::spawn(publish(recorder.clone(), policy_reference(policy), strategy_event(fix)));
                    }
                }
                Write::ApplyBudget { .. } | Write::DeleteBudget { .. } => {}
            },
            Err(e) => {
                match &e {
                    // Gone, or replaced under the same name (the UID precondition failed): the
                    // watch brings the news.
                    kube::Error::Api(s) if matches!(s.code, 404 | 409 | 422) => {
                        tracing::debug!(write = %describe(&write), reason = %s.message, "the object changed before the gate's write")
                    }
                    e => tracing::warn!(write = %describe(&write), error = %e, "the gate's write failed; retrying"),
                }
                if let Some(g) = gate.upgrade() {
                    g.update(|i| i.write_failed(&write, now_ms()));
                }
            }
        }
    }
}

/// One write's request.
async fn perform(client: &Client, write: &Write) -> Result<(), kube::Error> {
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    match write {
        Write::Condition(patch) => {
            let api: Api<Pod> = Api::namespaced(client.clone(), &patch.namespace);
            api.patch_status(&patch.pod, &PatchParams::default(), &Patch::Strategic(patch.body())).await.map(drop)
        }
        Write::Strategy(fix) => {
            let (ns, name) = (&fix.workload.namespace, &fix.workload.name);
            match fix.workload.kind {
                Kind::Deployment => Api::<Deployment>::namespaced(client.clone(), ns)
                    .patch(name, &apply, &Patch::Apply(&fix.body))
                    .await
                    .map(drop),
                Kind::Rollout => Api::<Rollout>::namespaced(client.clone(), ns)
                    .patch(name, &apply, &Patch::Apply(&fix.body))
                    .await
                    .map(drop),
                // Never patched (the index makes no fix for it).
                Kind::StatefulSet => Ok(()),
            }
        }
        Write::ApplyBudget { budget, .. } => {
            let api: Api<PodDisruptionBudget> =
                Api::namespaced(client.clone(), budget.metadata.namespace.as_deref().unwrap_or_default());
            api.patch(&budget.name_any(), &apply, &Patch::Apply(budget.as_ref())).await.map(drop)
        }
        Write::DeleteBudget { budget, .. } => {
            let api: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &budget.namespace);
            match api.delete(&budget.name, &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                other => other.map(drop),
            }
        }
    }
}

fn describe(write: &Write) -> String {
    match write {
        Write::Condition(p) => format!("pod {}/{} condition", p.namespace, p.pod),
        Write::Strategy(f) => format!("{} strategy", f.workload),
        Write::ApplyBudget { workload, .. } => format!("{workload} disruption budget"),
        Write::DeleteBudget { budget, .. } => format!("disruption budget {budget} deletion"),
    }
}

fn strategy_event(fix: &StrategyFix) -> EventSpec {
    EventSpec {
        warning: false,
        reason: EventReason::StrategyPatched,
        action: "GuardRollout",
        note: format!("{} '{}': {}; {}", fix.workload.kind.as_str(), fix.workload.name, fix.why, fix.done),
    }
}

fn pod_reference(patch: &PodPatch) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(patch.pod.clone()),
        namespace: Some(patch.namespace.clone()),
        uid: Some(patch.uid.clone()),
        ..Default::default()
    }
}

fn policy_reference(policy: &ObjectKey) -> ObjectReference {
    ObjectReference {
        api_version: Some(API_VERSION.into()),
        kind: Some("QueuePolicy".into()),
        name: Some(policy.name.clone()),
        namespace: Some(policy.namespace.clone()),
        ..Default::default()
    }
}

async fn publish(recorder: Recorder, reference: ObjectReference, spec: EventSpec) {
    let event = Event {
        type_: if spec.warning { EventType::Warning } else { EventType::Normal },
        reason: spec.reason.as_str().into(),
        note: Some(crate::events::truncate(&spec.note)),
        action: spec.action.into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &reference).await {
        tracing::warn!(error = %e, reason = spec.reason.as_str(), "could not publish event");
    }
}

// ---- One policy's reconcile ----

/// What one gate pass produced for the reconcile to report.
pub struct GatePass {
    pub report: GateReport,
    pub events: Vec<EventSpec>,
    pub recheck_after: Option<Duration>,
}

/// The gate's part of a policy's reconcile: its view from the index and its report. It writes
/// nothing: strategy fixes and budgets are the index's, made by the one writer.
pub async fn run(policy: &QueuePolicy, plan: &GatePlan, ctx: &Context) -> Result<GatePass, Error> {
    if !ctx.gate.wait_synced(SYNC_WAIT).await {
        return Err(Error::NotSynced);
    }
    let key = ObjectKey::of(policy);
    let view = ctx.gate.view(&key).ok_or(Error::NotSynced)?;
    let previous = policy.status.as_ref().and_then(|s| s.rollout.as_ref()).map(|r| r.phase);
    let report = gate::report(plan, &view, previous, now_ms());
    let mut events = report.events;
    let old: Vec<&DisruptionBudgetObservation> =
        policy.status.as_ref().map(|s| s.disruption_budgets.iter().collect()).unwrap_or_default();
    for b in report.budgets.iter().filter(|b| b.owner == BudgetOwner::Foreign && !old.contains(b)) {
        events.push(EventSpec {
            warning: false,
            reason: EventReason::DisruptionBudgetSkipped,
            action: "GuardDrains",
            note: format!(
                "PodDisruptionBudget '{}' already selects the pods of {} '{}': queueguard creates none (the eviction API refuses pods covered by two budgets)",
                b.name,
                b.kind.as_str(),
                b.workload
            ),
        });
    }
    Ok(GatePass {
        report: GateReport {
            consumers_attached: report.consumers_attached,
            rollout_safe: report.rollout_safe,
            consumers: report.consumers,
            rollout: report.rollout,
            budgets: report.budgets,
        },
        events,
        recheck_after: report.recheck_after,
    })
}
