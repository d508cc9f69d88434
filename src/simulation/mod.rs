//! The rollout simulation behind `queueguard demo` and the rollout tests: a model of the
//! workload's controller ([`model`]: a Deployment, a StatefulSet, or an Argo canary Rollout)
//! drives real AMQP consumer tasks against the real broker
//! while a publisher sends numbered messages, and, in the guarded scenario, the operator's own
//! tracker and gate index decide each pod's readiness condition.
//!
//! With several queues, every pod is one worker consuming all of them, each queue guarded by its
//! own QueuePolicy: a pod is Ready only once it reads every one.
//!
//! Guarded: the queue is declared by queueguard (durable, expiry by policy), pods are Ready only
//! once the gate opens, and the gate also makes the strategy safe. Naive, as in the source
//! article: the application declares an auto-delete queue and reports Ready as soon as its
//! process is up, before its consumer has attached.

pub mod faults;
pub mod model;
mod pod;
mod report;
pub mod soak;

pub use report::{Migration, Report, table};

use crate::{
    broker::{BrokerPool, uri::BrokerUri},
    consumers::{Change, Consumer, ConsumerTracker, QueueKey, Tracking, tracker::now_ms},
    converge::{self, Mode},
    crd::{ConsumersSpec, FailurePolicy, GateMode, MatchBy},
    gate::{
        guards::Selects,
        index::{BoundQueue, Consumers, GateIndex, ObjectKey, PolicyFacts, ReplicaSetFacts, Write},
    },
    local::Told,
    migrate::run::{PolicyMigration, migrate_policy},
    plan::{self, GatePlan, Limits},
    workload::{
        Judgement, Kind, Workload, WorkloadKey,
        owner::PodOwner,
        rollout::{Canary, Rollout, RolloutSpec, RolloutStatus, RolloutStrategy},
        strategy::{self, Fenceposts},
    },
};
use k8s_openapi::{
    api::apps::v1::{
        Deployment, DeploymentSpec, DeploymentStatus, DeploymentStrategy, StatefulSet, StatefulSetSpec,
        StatefulSetStatus,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use lapin::{
    BasicProperties, Connection,
    options::{BasicPublishOptions, ConfirmSelectOptions},
};
use pod::{PodHandle, Tally};
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

/// One run's parameters.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub guarded: bool,
    pub replicas: usize,
    pub restarts: u32,
    /// Queues each pod consumes, each guarded by its own policy.
    pub queues: usize,
    pub seed: u64,
    /// Container start until the process is up (a naive pod reports Ready here), in ms.
    pub boot_ms: (u64, u64),
    /// Process up until its consumer has attached (connect, declare, consume), in ms.
    pub attach_ms: (u64, u64),
    /// The gate's minAttachedSeconds.
    pub min_attached: Duration,
    pub publish_every: Duration,
    /// Quorum queues (guarded runs), for messages that must survive a broker node.
    pub quorum: bool,
    /// Keep rolling out (after `restarts`) until this is set: rollouts during something else,
    /// a broker's rolling restart, say.
    pub until: Option<Arc<AtomicBool>>,
    /// The kind of workload the consumers run in.
    pub workload: Kind,
    /// Guarded runs: after the first rollout, change the queues' type live (classic to quorum,
    /// or back with `quorum`) as `onChange: Migrate` does, then restart the workload as the
    /// operator does after the swap, before the restarts. Publishes go through `amq.direct`,
    /// bound to each queue.
    pub migrate: bool,
}

impl Scenario {
    pub fn new(guarded: bool, replicas: usize, restarts: u32) -> Self {
        Self {
            guarded,
            replicas,
            restarts,
            queues: 1,
            seed: 0x9e37_79b9_7f4a_7c15 ^ u64::from(restarts),
            boot_ms: (100, 300),
            attach_ms: (200, 600),
            min_attached: Duration::from_millis(300),
            publish_every: Duration::from_millis(10),
            quorum: false,
            until: None,
            workload: Kind::Deployment,
            migrate: false,
        }
    }

    pub fn label(&self) -> String {
        let label = match (self.guarded, self.migrate) {
            (true, true) => "guarded, queue type changed live",
            (true, false) => "guarded (queueguard gate)",
            (false, _) => "auto-delete queue, no gate",
        };
        match self.workload {
            Kind::Deployment => label.to_owned(),
            kind => format!("{label}, {}", kind.as_str()),
        }
    }
}

const TICK: Duration = Duration::from_millis(10);
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(60);

const NAMESPACE: &str = "queueguard-demo";
/// The consumer workload's name.
const WORKLOAD: &str = "demo-consumer";
/// The ReplicaSet its pods belong to (which leads the gate to the Deployment or Rollout).
const REPLICA_SET: &str = "demo-consumer-5d8f7c";

/// Runs one scenario against the broker at `uri`.
pub async fn run(s: &Scenario, uri: &BrokerUri) -> Result<Report, String> {
    let pool = BrokerPool::new("queueguard-demo");
    let base = format!(
        "queueguard-demo.{}.{}.{:x}",
        if s.guarded { "guarded" } else { "naive" },
        std::process::id(),
        now_ms()
    );
    let queues: Vec<String> =
        if s.queues == 1 { vec![base] } else { (0..s.queues).map(|i| format!("{base}.q{i}")).collect() };
    let keys: Vec<QueueKey> = queues.iter().map(|q| QueueKey::new(uri.vhost(), q)).collect();
    let trackers = crate::consumers::TrackerPool::new("queueguard-demo");
    let tracker = trackers.tracker(uri, None).map_err(|e| e.to_string())?;
    if !tracker.wait_synced(uri.vhost(), Duration::from_secs(15)).await || !tracker.tracking(uri.vhost()).is_live() {
        return Err(format!("cannot see the broker's consumers: {}", tracker.tracking(uri.vhost())));
    }
    // Held for the whole run: the tracker keeps these queues' consumers while they live.
    let _interests: Vec<_> = keys.iter().map(|key| tracker.watch(key.clone())).collect();
    let mut changes = tracker.subscribe();

    let mut declared = Vec::new();
    let guard = if s.guarded {
        let broker = pool.get(uri.clone(), None).map_err(|e| e.to_string())?;
        for queue in &queues {
            let plan = demo_plan(queue, s.quorum, s.migrate)?;
            let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
            if !outcome.is_ready() {
                return Err(format!("queueguard could not declare the queue: {}", outcome.ready().message));
            }
            declared.push(plan);
        }
        Some(Guard::new(s, &keys, tracker.clone()))
    } else {
        None
    };

    let mut sim = Sim {
        s: s.clone(),
        uri: uri.clone(),
        queues: queues.clone(),
        keys: keys.clone(),
        rng: Rng(s.seed),
        pods: Vec::new(),
        next_id: 0,
        revision: 1,
        strategy: None,
        canary: Canary::default(),
        tally: Arc::new(Tally::default()),
        declare: pod::Declare::of(s),
        gate_waits: Vec::new(),
        gate_overheads: Vec::new(),
        premature: 0,
        fewest: None,
        guard,
        tracker: tracker.clone(),
        pace: Arc::default(),
        restart_guard_at: None,
    };

    // First rollout, then publishing for the rest of the run.
    sim.roll().await?;
    sim.fewest = Some(vec![usize::MAX; keys.len()]);
    let published = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Through an exchange bound to each queue where the queues move: such a publish always has
    // a route, to the old queue, the holding queue or the new one.
    let exchange = if s.migrate && s.guarded { "amq.direct" } else { "" };
    let publisher =
        tokio::spawn(publish(uri.clone(), exchange, queues.clone(), s.publish_every, published.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut deletions = 0;
    let mut restarts = 0;
    let mut migration = None;
    if s.migrate && s.guarded {
        // A second of traffic first. The consumers keep up, so the queues hold little when they
        // move; what is published during the swap goes through the holding queue.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let broker = pool.get(uri.clone(), None).map_err(|e| e.to_string())?;
        let mut moved = migrate(&broker, &mut declared, s.quorum).await?;
        // The operator's restart after the swap: a new revision, each old pod held until a new
        // one reads the new queue.
        sim.declare = if s.quorum { pod::Declare::Durable } else { pod::Declare::Quorum };
        restarts += 1;
        sim.revision += 1;
        sim.roll().await?;
        moved.queue_deletions = count_deletions(&mut changes, &keys);
        migration = Some(moved);
    }
    while restarts < s.restarts || s.until.as_ref().is_some_and(|until| !until.load(Ordering::SeqCst)) {
        restarts += 1;
        sim.revision += 1;
        sim.roll().await?;
        deletions += count_deletions(&mut changes, &keys);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    publisher.await.map_err(|e| e.to_string())??;
    let published = published.load(Ordering::SeqCst);
    sim.drain(published).await;
    deletions += count_deletions(&mut changes, &keys);

    let (unique, deliveries) = sim.tally.counts();
    for pod in sim.pods.drain(..) {
        pod.stop_and_wait().await;
    }
    if let Some(broker) = declared.first().and_then(|_| pool.get(uri.clone(), None).ok()) {
        // The demo's own queues: nothing left in them to lose.
        for plan in &declared {
            let _ = converge::delete(plan, &broker, &Default::default()).await;
        }
    }
    Ok(Report {
        scenario: s.label(),
        restarts,
        reconnects: sim.tally.reconnects(),
        published,
        consumed: unique,
        lost: published.saturating_sub(unique),
        duplicates: deliveries.saturating_sub(unique),
        queue_deletions: deletions,
        unsafe_strategy: match sim.workload().judge(1) {
            Judgement::Unsafe { why, remedy } if s.guarded => Some(format!("{why}; {remedy}")),
            _ => None,
        },
        fewest_consumers: sim
            .fewest
            .unwrap_or_default()
            .into_iter()
            .map(|n| if n == usize::MAX { 0 } else { n })
            .collect(),
        longest_gate_wait: sim.gate_waits.iter().max().copied(),
        gate_overheads: sim.gate_overheads.clone(),
        premature_opens: sim.premature,
        migration,
    })
}

/// Moves each guarded queue to the other type through [`migrate_policy`] (dead-letter queue,
/// then queue), telling each step on stderr; `declared` becomes the new plans.
async fn migrate(
    broker: &crate::broker::Broker,
    declared: &mut [plan::QueuePlan],
    quorum: bool,
) -> Result<Migration, String> {
    let mut figures = Migration::default();
    for plan in declared.iter_mut() {
        let target = demo_plan(&plan.queue, !quorum, true)?;
        let state =
            match migrate_policy(broker, &target, None, &mut Told, &Default::default(), &Default::default()).await {
                Ok(PolicyMigration::Moved(state)) => state,
                Ok(PolicyMigration::NotNeeded) => return Err(format!("queue '{}' did not need to move", plan.queue)),
                Ok(PolicyMigration::Stopped(check, _)) => return Err(check.message),
                Err(e) => return Err(e.to_string()),
            };
        figures.from = state.from.clone();
        figures.to = state.to.clone();
        figures.moved_out += state.moved_out;
        figures.moved_back += state.moved_back;
        figures.swap_window_ms = figures.swap_window_ms.max(state.swap_window_millis.unwrap_or_default());
        figures.fenced_ms = figures.fenced_ms.max(state.fenced_millis.unwrap_or_default());
        *plan = target;
    }
    Ok(figures)
}

/// The operator's gate for the simulated Deployment: its index with one policy per queue.
struct Guard {
    index: GateIndex,
}

impl Guard {
    fn new(s: &Scenario, keys: &[QueueKey], tracker: Arc<ConsumerTracker>) -> Self {
        let plan = GatePlan {
            mode: GateMode::Enforce,
            failure_policy: FailurePolicy::Closed,
            attach_timeout: Duration::from_secs(60),
            manage_strategy: true,
            pod_disruption_budget: false,
            min_attached: 1,
            min_attached_for: s.min_attached,
            // Every simulated pod connects from 127.0.0.1: tell them apart by connection name.
            match_by: MatchBy::ConnectionName,
            consumers: ConsumersSpec {
                deployment: None,
                workload: Some(crate::crd::WorkloadRef { kind: s.workload, name: WORKLOAD.into() }),
                selector: None,
                kinds: None,
                min_attached: 1,
                min_attached_seconds: 0,
                match_by: MatchBy::ConnectionName,
            },
        };
        let mut index = GateIndex::default();
        let policies: Vec<PolicyFacts> = (0..keys.len())
            .map(|i| PolicyFacts {
                key: ObjectKey::new(NAMESPACE, format!("demo-{i}")),
                uid: format!("demo-{i}"),
                selects: Selects::Named(s.workload, WORKLOAD.into()),
                plan: Ok(plan.clone()),
                deleting: false,
            })
            .collect();
        let names: Vec<ObjectKey> = policies.iter().map(|p| p.key.clone()).collect();
        index.replace_policies(policies);
        for (name, queue) in names.iter().zip(keys) {
            index.bind(name, Ok(BoundQueue { source: tracker.id(), queue: queue.clone(), dead_letter_queue: None }));
        }
        index.replace_budgets(vec![]);
        for kind in [Kind::Deployment, Kind::StatefulSet, Kind::Rollout] {
            index.replace_workloads(kind, vec![]);
        }
        index.replace_replica_sets(vec![ReplicaSetFacts {
            key: ObjectKey::new(NAMESPACE, REPLICA_SET),
            owner: Some(WorkloadKey::new(s.workload, NAMESPACE, WORKLOAD)),
        }]);
        index.replace_pods(vec![], now_ms());
        Self { index }
    }
}

/// The one tracker of the simulation, as the index reads consumers.
struct OneTracker<'a>(&'a ConsumerTracker);

impl Consumers for OneTracker<'_> {
    fn consumers_on(&self, _: u64, queue: &QueueKey) -> Vec<Consumer> {
        self.0.consumers_on(queue)
    }

    fn tracking(&self, _: u64, queue: &QueueKey) -> Tracking {
        self.0.tracking_of(queue)
    }
}

fn count_deletions(changes: &mut tokio::sync::broadcast::Receiver<Change>, keys: &[QueueKey]) -> u64 {
    let mut n = 0;
    while let Ok(change) = changes.try_recv() {
        if matches!(&change, Change::QueueDeleted { queue } if keys.contains(queue)) {
            n += 1;
        }
    }
    n
}

/// The demo's QueuePolicy for `queue`; one that migrates is bound to `amq.direct` (routing key:
/// the queue's name) and moves on a change of type.
fn demo_plan(queue: &str, quorum: bool, migrates: bool) -> Result<plan::QueuePlan, String> {
    let kind = if quorum { "quorum" } else { "classic" };
    let moves = if migrates {
        format!(", onChange: Migrate, bindings: [{{exchange: amq.direct, routingKey: {queue:?}}}]")
    } else {
        String::new()
    };
    // Named after its queue: the broker policy `queueguard.<namespace>.<name>` of two runs at once
    // (a demo beside a soak) would otherwise be one, and the later would take the earlier's
    // dead-lettering away.
    let name = format!(
        "demo-{:x}",
        queue.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    );
    let doc = format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name}, namespace: queueguard-demo}}\nspec:\n  broker: {{secretRef: {{name: demo}}}}\n  queue: {{name: {queue:?}, type: {kind}{moves}}}\n"
    );
    let policy = serde_yaml_ng::from_str(&doc).expect("the demo policy parses");
    plan::plan(&policy, Limits::default()).map_err(|e| plan::describe(&e))
}

struct Sim {
    s: Scenario,
    uri: BrokerUri,
    queues: Vec<String>,
    keys: Vec<QueueKey>,
    rng: Rng,
    pods: Vec<PodHandle>,
    /// Pod ids are never reused (pods of earlier rollouts are dropped from `pods`).
    next_id: usize,
    revision: u32,
    /// The Deployment's strategy; None is the API server's default (25% / 25%).
    strategy: Option<DeploymentStrategy>,
    /// The canary Rollout's strategy (Argo's defaults, 25% / 25%).
    canary: Canary,
    tally: Arc<Tally>,
    /// How new pods declare their queues (the target type once the queues moved).
    declare: pod::Declare,
    gate_waits: Vec<Duration>,
    /// Per opened gate: from its consumer attaching to the gate opening.
    gate_overheads: Vec<Duration>,
    premature: u64,
    /// Per queue, the fewest consumers seen attached while the restarts ran.
    fewest: Option<Vec<usize>>,
    guard: Option<Guard>,
    tracker: Arc<ConsumerTracker>,
    /// How long every pod works on each delivery before acknowledging it, in ms (0 unless a
    /// soak makes the consumers slow).
    pace: Arc<AtomicU64>,
    /// When the operator's gate is killed and started afresh, in the next rollout.
    restart_guard_at: Option<Instant>,
}

impl Sim {
    /// The consumer workload as its controller reports it.
    fn workload(&self) -> Workload {
        let live = self.pods.iter().filter(|p| !p.terminating).count() as i32;
        let updated = self.pods.iter().filter(|p| !p.terminating && p.revision == self.revision).count() as i32;
        let replicas = Some(self.s.replicas as i32);
        let metadata =
            ObjectMeta { name: Some(WORKLOAD.into()), namespace: Some(NAMESPACE.into()), ..Default::default() };
        match self.s.workload {
            Kind::Deployment => Workload::new(Deployment {
                metadata,
                spec: Some(DeploymentSpec { replicas, strategy: self.strategy.clone(), ..Default::default() }),
                status: Some(DeploymentStatus {
                    replicas: Some(live),
                    updated_replicas: Some(updated),
                    ..Default::default()
                }),
            }),
            Kind::StatefulSet => Workload::new(StatefulSet {
                metadata,
                spec: Some(StatefulSetSpec { replicas, ..Default::default() }),
                status: Some(StatefulSetStatus {
                    replicas: live,
                    updated_replicas: Some(updated),
                    ..Default::default()
                }),
            }),
            Kind::Rollout => {
                let strategy = RolloutStrategy { canary: Some(self.canary.clone()), blue_green: None };
                let mut rollout = Rollout::new(WORKLOAD, RolloutSpec { replicas, strategy, ..Default::default() });
                rollout.metadata.namespace = Some(NAMESPACE.into());
                rollout.status =
                    Some(RolloutStatus { replicas: Some(live), updated_replicas: Some(updated), phase: None });
                Workload::new(rollout)
            }
        }
    }

    /// The fenceposts of a Deployment or canary rollout.
    fn fenceposts(&self) -> Result<Fenceposts, String> {
        let replicas = self.s.replicas as i32;
        match self.s.workload {
            Kind::Rollout => strategy::canary_fenceposts(&self.canary, replicas),
            _ => {
                let Workload { object, .. } = self.workload();
                let crate::workload::Object::Deployment(d) = &*object else {
                    return Err("a StatefulSet has no surge".into());
                };
                strategy::fenceposts(d)?.ok_or_else(|| "the simulation runs RollingUpdate only".into())
            }
        }
    }

    /// Which controller a pod names.
    fn owner(&self) -> PodOwner {
        match self.s.workload {
            Kind::StatefulSet => PodOwner::StatefulSet(WORKLOAD.into()),
            _ => PodOwner::ReplicaSet(REPLICA_SET.into()),
        }
    }

    /// Runs the workload's controller until the current revision is fully rolled out.
    async fn roll(&mut self) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if self.restart_guard_at.is_some_and(|at| Instant::now() >= at) {
                self.restart_guard_at = None;
                self.guard = self.guard.is_some().then(|| Guard::new(&self.s, &self.keys, self.tracker.clone()));
            }
            self.gate_pass();
            self.count_consumers();
            let states: Vec<model::PodState> = self
                .pods
                .iter()
                .map(|p| model::PodState {
                    id: p.id,
                    ordinal: p.ordinal,
                    revision: p.revision,
                    ready: p.ready(self.s.guarded),
                    terminating: p.terminating,
                    gone: p.finished(),
                })
                .collect();
            let alive_old = self.pods.iter().any(|p| p.terminating && !p.finished());
            if model::complete(&states, self.s.replicas, self.revision) && !alive_old {
                self.pods.retain(|p| !p.terminating);
                return Ok(());
            }
            let steps = match self.s.workload {
                Kind::StatefulSet => model::next_ordered(&states, self.s.replicas, self.revision),
                _ => model::next(&states, self.s.replicas, self.revision, self.fenceposts()?),
            };
            for step in steps {
                match step {
                    model::Step::Create { count } => {
                        for _ in 0..count {
                            let id = self.next_id;
                            self.start_pod(format!("{WORKLOAD}-{}-{id}", self.revision), id);
                        }
                    }
                    model::Step::CreateOrdinal { ordinal } => {
                        self.start_pod(format!("{WORKLOAD}-{ordinal}"), ordinal);
                    }
                    model::Step::Terminate { ids } => {
                        for id in ids {
                            if let Some(p) = self.pods.iter_mut().find(|p| p.id == id) {
                                p.terminate();
                            }
                        }
                    }
                }
            }
            if started.elapsed() > ROLLOUT_TIMEOUT {
                return Err(format!("rollout of revision {} did not finish within {ROLLOUT_TIMEOUT:?}", self.revision));
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// Starts a pod of the current revision.
    fn start_pod(&mut self, name: String, ordinal: usize) {
        let id = self.next_id;
        self.next_id += 1;
        let boot = self.rng.between(self.s.boot_ms);
        let attach = self.rng.between(self.s.attach_ms);
        let mut pod = PodHandle::start(
            id,
            name,
            self.revision,
            &self.uri,
            &self.queues,
            self.declare,
            Duration::from_millis(boot),
            Duration::from_millis(attach),
            self.pace.clone(),
            self.tally.clone(),
        );
        pod.ordinal = ordinal;
        self.pods.push(pod);
    }

    /// The operator's gate index over every pod, its patches applied as the kubelet would see
    /// them.
    fn gate_pass(&mut self) {
        let workload = self.workload();
        let owner = self.owner();
        let facts = self.pods.iter().map(|p| p.facts(NAMESPACE, owner.clone())).collect();
        let Some(guard) = &mut self.guard else { return };
        let now = now_ms();
        let consumers = OneTracker(&self.tracker);
        guard.index.upsert_workload(workload);
        guard.index.replace_pods(facts, now);
        guard.index.all_consumers_changed();
        guard.index.tick(now);
        let effects = guard.index.flush(&consumers, now);
        let mut patches = Vec::new();
        for write in effects.writes {
            match write {
                Write::Strategy(fix) => {
                    self.strategy = serde_json::from_value(fix.body["spec"]["strategy"].clone()).ok()
                }
                Write::Condition(patch) => patches.push(patch),
                Write::ApplyBudget { .. } | Write::DeleteBudget { .. } => {}
            }
        }
        for patch in patches {
            let Some(pod) = self.pods.iter_mut().find(|p| p.uid == patch.uid) else { continue };
            let opened = pod.set_gate(patch.attached, patch.reason.as_str(), now);
            if opened {
                match (pod.attached_ms(), pod.booted_ms()) {
                    (Some(attached), Some(booted)) if attached <= now => {
                        self.gate_waits.push(Duration::from_millis((now - booted).max(0) as u64));
                        self.gate_overheads.push(Duration::from_millis((now - attached).max(0) as u64));
                    }
                    _ => self.premature += 1,
                }
            }
        }
    }

    /// The connection names (UIDs) of the pods running (not terminating).
    fn live_pod_connections(&self) -> Vec<String> {
        self.pods.iter().filter(|p| !p.terminating).map(|p| p.uid.clone()).collect()
    }

    /// Notes the fewest consumers each queue has had since the first rollout.
    fn count_consumers(&mut self) {
        let Some(fewest) = &mut self.fewest else { return };
        for (n, key) in fewest.iter_mut().zip(&self.keys) {
            *n = (*n).min(self.tracker.consumers_on(key).len());
        }
    }

    /// Waits until every published message was consumed, or nothing more arrives.
    async fn drain(&self, published: u64) {
        let mut last = (self.tally.counts().0, Instant::now());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let (unique, _) = self.tally.counts();
            if unique >= published {
                return;
            }
            if unique != last.0 {
                last = (unique, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(2) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Publishes numbered, persistent messages with confirms until told to stop; counts the
/// confirmed ones. A message the broker did not confirm (its connection lost, or nacked) is sent
/// again, through the next node of a cluster, as a careful publisher does.
async fn publish(
    uri: BrokerUri,
    exchange: &'static str,
    queues: Vec<String>,
    every: Duration,
    published: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Result<(), String> {
    let mut seq: u64 = 0;
    let mut failing_since: Option<Instant> = None;
    let mut node = 0;
    while !stop.load(Ordering::SeqCst) {
        let conn = match pod::connect(&uri, node, "queueguard-demo-publisher").await {
            Ok(conn) => {
                failing_since = None;
                conn
            }
            Err(e) => {
                if failing_since.get_or_insert_with(Instant::now).elapsed() > ROLLOUT_TIMEOUT {
                    return Err(format!("the publisher could not reconnect: {e}"));
                }
                node += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let sent = publish_on(&conn, exchange, &queues, every, &mut seq, &published, &stop).await;
        // Bounded like every broker wait here: a close-ok that never comes must not hold the run.
        let _ = pod::bounded(conn.close(200, "done".into())).await;
        if let Err(e) = sent {
            tracing::info!(error = %e, "demo publisher reconnecting");
            failing_since.get_or_insert_with(Instant::now);
            node += 1;
        }
    }
    Ok(())
}

async fn publish_on(
    conn: &Connection,
    exchange: &str,
    queues: &[String],
    every: Duration,
    seq: &mut u64,
    published: &AtomicU64,
    stop: &AtomicBool,
) -> lapin::Result<()> {
    let ch = pod::bounded(conn.create_channel()).await?;
    pod::bounded(ch.confirm_select(ConfirmSelectOptions::default())).await?;
    while !stop.load(Ordering::SeqCst) {
        let body = seq.to_string();
        let queue = &queues[*seq as usize % queues.len()];
        // A confirm that never comes (its node went down mid-flight) is a failure to retry.
        let confirm = pod::bounded(async {
            ch.basic_publish(
                exchange.into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?
            .await
        })
        .await?;
        // Unroutable messages (the queue is gone) are confirmed too: published, and lost.
        if confirm.is_ack() {
            published.fetch_add(1, Ordering::SeqCst);
            *seq += 1;
        }
        tokio::time::sleep(every).await;
    }
    // Closed and answered before the connection closes: a channel merely dropped is closed by
    // lapin in the background, and that close meeting the connection's own close is logged as
    // a connection error.
    let _ = pod::bounded(ch.close(200, "done".into())).await;
    Ok(())
}

/// A small deterministic generator (xorshift64*) for boot and attach delays.
struct Rng(u64);

impl Rng {
    fn between(&mut self, (lo, hi): (u64, u64)) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        lo + x % (hi - lo + 1)
    }
}
