//! The rollout simulation behind `queueguard demo` and the rollout tests: a model of the
//! Deployment controller ([`model`]) drives real AMQP consumer tasks against the real broker
//! while a publisher sends numbered messages, and, in the guarded scenario, the operator's own
//! tracker and gate decide each pod's readiness condition.
//!
//! Guarded: the queue is declared by queueguard (durable, expiry by policy), pods are Ready only
//! once the gate opens, and the gate also makes the strategy safe. Naive, as in the source
//! article: the application declares an auto-delete queue and reports Ready as soon as its
//! process is up, before its consumer has attached.

pub mod model;
mod pod;
mod report;

pub use report::{Report, table};

use crate::{
    broker::{BrokerPool, uri::BrokerUri},
    consumers::{Change, QueueKey, tracker::now_ms},
    converge::{self, Mode},
    crd::{ConsumersSpec, FailurePolicy, GateMode, MatchBy},
    gate::{self, GatePlan, Observed, pods::PodFacts, strategy},
    plan::{self, Limits},
};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStatus, DeploymentStrategy};
use lapin::{
    BasicProperties, Connection, ConnectionProperties,
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
    pub seed: u64,
    /// Container start until the process is up (a naive pod reports Ready here), in ms.
    pub boot_ms: (u64, u64),
    /// Process up until its consumer has attached (connect, declare, consume), in ms.
    pub attach_ms: (u64, u64),
    /// The gate's minAttachedSeconds.
    pub min_attached: Duration,
    pub publish_every: Duration,
}

impl Scenario {
    pub fn new(guarded: bool, replicas: usize, restarts: u32) -> Self {
        Self {
            guarded,
            replicas,
            restarts,
            seed: 0x9e37_79b9_7f4a_7c15 ^ u64::from(restarts),
            boot_ms: (100, 300),
            attach_ms: (200, 600),
            min_attached: Duration::from_millis(300),
            publish_every: Duration::from_millis(10),
        }
    }

    pub fn label(&self) -> &'static str {
        if self.guarded { "guarded (queueguard gate)" } else { "auto-delete queue, no gate" }
    }
}

const TICK: Duration = Duration::from_millis(10);
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs one scenario against the broker at `uri`.
pub async fn run(s: &Scenario, uri: &BrokerUri) -> Result<Report, String> {
    let pool = BrokerPool::new("queueguard-demo");
    let queue = format!(
        "queueguard-demo.{}.{}.{:x}",
        if s.guarded { "guarded" } else { "naive" },
        std::process::id(),
        now_ms()
    );
    let key = QueueKey::new(uri.vhost(), &queue);
    let tracker = pool.tracker(uri, None).map_err(|e| e.to_string())?;
    if !tracker.wait_synced(Duration::from_secs(15)).await || !tracker.tracking().is_live() {
        return Err(format!("cannot see the broker's consumers: {:?}", tracker.tracking()));
    }
    tracker.watch_queue(key.clone());
    let mut changes = tracker.subscribe();

    let guarded_plan = if s.guarded {
        let policy = demo_policy(&queue);
        let plan = plan::plan(&policy, Limits::default()).map_err(|e| plan::describe(&e))?;
        let broker = pool.get(uri.clone(), None).map_err(|e| e.to_string())?;
        let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
        if !outcome.is_ready() {
            return Err(format!("queueguard could not declare the queue: {}", outcome.ready().message));
        }
        Some((plan, broker))
    } else {
        None
    };
    let gate_plan = GatePlan {
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
            deployment: Some("demo-consumer".into()),
            selector: None,
            min_attached: 1,
            min_attached_seconds: 0,
            match_by: MatchBy::ConnectionName,
        },
    };

    let mut sim = Sim {
        s: s.clone(),
        uri: uri.clone(),
        queue: queue.clone(),
        key: key.clone(),
        rng: Rng(s.seed),
        pods: Vec::new(),
        revision: 1,
        strategy: None,
        tally: Arc::new(Tally::default()),
        gate_waits: Vec::new(),
        gate_overheads: Vec::new(),
        premature: 0,
    };

    // First rollout, then publishing for the rest of the run.
    sim.roll(if s.guarded { Some((&gate_plan, &*tracker)) } else { None }).await?;
    let published = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = tokio::spawn(publish(uri.clone(), queue.clone(), s.publish_every, published.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut deletions = 0;
    for _ in 0..s.restarts {
        sim.revision += 1;
        sim.roll(if s.guarded { Some((&gate_plan, &*tracker)) } else { None }).await?;
        deletions += count_deletions(&mut changes, &key);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    publisher.await.map_err(|e| e.to_string())??;
    let published = published.load(Ordering::SeqCst);
    sim.drain(published).await;
    deletions += count_deletions(&mut changes, &key);

    let (unique, deliveries) = sim.tally.counts();
    for pod in sim.pods.drain(..) {
        pod.stop_and_wait().await;
    }
    if let Some((plan, broker)) = &guarded_plan {
        // The demo's own queue: nothing left in it to lose.
        let _ = converge::delete(plan, broker).await;
    }
    Ok(Report {
        scenario: s.label().into(),
        restarts: s.restarts,
        published,
        consumed: unique,
        lost: published.saturating_sub(unique),
        duplicates: deliveries.saturating_sub(unique),
        queue_deletions: deletions,
        longest_gate_wait: sim.gate_waits.iter().max().copied(),
        gate_overheads: sim.gate_overheads.clone(),
        premature_opens: sim.premature,
    })
}

fn count_deletions(changes: &mut tokio::sync::broadcast::Receiver<Change>, key: &QueueKey) -> u64 {
    let mut n = 0;
    while let Ok(change) = changes.try_recv() {
        if matches!(&change, Change::QueueDeleted { queue } if queue == key) {
            n += 1;
        }
    }
    n
}

fn demo_policy(queue: &str) -> crate::crd::QueuePolicy {
    let doc = format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: demo, namespace: queueguard-demo}}\nspec:\n  broker: {{secretRef: {{name: demo}}}}\n  queue: {{name: {queue:?}}}\n"
    );
    serde_yaml_ng::from_str(&doc).expect("the demo policy parses")
}

struct Sim {
    s: Scenario,
    uri: BrokerUri,
    queue: String,
    key: QueueKey,
    rng: Rng,
    pods: Vec<PodHandle>,
    revision: u32,
    /// The Deployment's strategy; None is the API server's default (25% / 25%).
    strategy: Option<DeploymentStrategy>,
    tally: Arc<Tally>,
    gate_waits: Vec<Duration>,
    /// Per opened gate: from its consumer attaching to the gate opening.
    gate_overheads: Vec<Duration>,
    premature: u64,
}

impl Sim {
    fn deployment(&self) -> Deployment {
        let live = self.pods.iter().filter(|p| !p.terminating).count() as i32;
        let updated = self.pods.iter().filter(|p| !p.terminating && p.revision == self.revision).count() as i32;
        Deployment {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("demo-consumer".into()),
                ..Default::default()
            },
            spec: Some(DeploymentSpec {
                replicas: Some(self.s.replicas as i32),
                strategy: self.strategy.clone(),
                ..Default::default()
            }),
            status: Some(DeploymentStatus {
                replicas: Some(live),
                updated_replicas: Some(updated),
                ..Default::default()
            }),
        }
    }

    /// Runs the Deployment controller until the current revision is fully rolled out.
    async fn roll(&mut self, gate: Option<(&GatePlan, &crate::consumers::ConsumerTracker)>) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if let Some((plan, tracker)) = gate {
                self.gate_pass(plan, tracker);
            }
            let states: Vec<model::PodState> = self
                .pods
                .iter()
                .map(|p| model::PodState {
                    id: p.id,
                    revision: p.revision,
                    ready: p.ready(self.s.guarded),
                    terminating: p.terminating,
                })
                .collect();
            let alive_old = self.pods.iter().any(|p| p.terminating && !p.finished());
            if model::complete(&states, self.s.replicas, self.revision) && !alive_old {
                self.pods.retain(|p| !p.terminating);
                return Ok(());
            }
            let fp = strategy::fenceposts(&self.deployment())?.ok_or("the simulation runs RollingUpdate only")?;
            for step in model::next(&states, self.s.replicas, self.revision, fp) {
                match step {
                    model::Step::Create { count } => {
                        for _ in 0..count {
                            let id = self.pods.len();
                            let boot = self.rng.between(self.s.boot_ms);
                            let attach = self.rng.between(self.s.attach_ms);
                            let pod = PodHandle::start(
                                id,
                                self.revision,
                                &self.uri,
                                &self.queue,
                                self.s.guarded,
                                Duration::from_millis(boot),
                                Duration::from_millis(attach),
                                self.tally.clone(),
                            );
                            self.pods.push(pod);
                        }
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

    /// The operator's gate decision for every pod, applied as the kubelet would see it.
    fn gate_pass(&mut self, plan: &GatePlan, tracker: &crate::consumers::ConsumerTracker) {
        let facts: Vec<PodFacts> = self.pods.iter().map(PodHandle::facts).collect();
        let consumers = tracker.consumers_on(&self.key);
        let tracking = tracker.tracking();
        let deployment = self.deployment();
        let now = now_ms();
        let seen = Observed {
            queue: &self.key,
            deployments: std::slice::from_ref(&deployment),
            pods: &facts,
            consumers: &consumers,
            tracking: &tracking,
            now_ms: now,
        };
        let decision = gate::decide(plan, &seen);
        for (_, patch) in decision.strategy_patches {
            let strategy = patch["spec"]["strategy"].clone();
            self.strategy = serde_json::from_value(strategy).ok();
        }
        for patch in decision.pod_patches {
            let Some(pod) = self.pods.iter_mut().find(|p| p.name == patch.pod) else { continue };
            let opened = pod.set_gate(patch.attached, patch.reason, now);
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
/// confirmed ones.
async fn publish(
    uri: BrokerUri,
    queue: String,
    every: Duration,
    published: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Result<(), String> {
    let props = ConnectionProperties::default().with_connection_name("queueguard-demo-publisher".into());
    let conn = Connection::connect_uri(uri.amqp().clone(), props).await.map_err(|e| e.to_string())?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| e.to_string())?;
    let mut seq: u64 = 0;
    while !stop.load(Ordering::SeqCst) {
        let body = seq.to_string();
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        // Unroutable messages (the queue is gone) are confirmed too: published, and lost.
        if confirm.is_ack() {
            published.fetch_add(1, Ordering::SeqCst);
        }
        seq += 1;
        tokio::time::sleep(every).await;
    }
    let _ = conn.close(200, "done".into()).await;
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
