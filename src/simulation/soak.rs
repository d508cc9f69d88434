//! `queueguard soak`: many guarded rolling restarts and live migrations of one queue against the
//! real broker, with faults injected at seeded points ([`faults`]), and every message the broker
//! confirmed accounted for at the end: consumed, dead-lettered, or still in a queue. What is none
//! of those is lost.
//!
//! Publishers: one through `amq.direct` (the queue's binding) without pause, and one through the
//! default exchange in bursts (2 s on, 2.5 s off: a swap waits for a pause in those), both with
//! publisher confirms and `mandatory`; every fifth message expires after 200 ms (dead-lettered
//! when it does) and every seventh has a priority.

use super::{
    Guard, Rng as PodRng, Sim, demo_plan,
    faults::{self, Fault, Round},
    pod::{self, Declare, Tally},
};
use crate::{
    broker::{Broker, BrokerPool, uri::BrokerUri},
    claims::Claims,
    consumers::{QueueKey, TrackerPool, tracker::now_ms},
    converge::{self, Mode},
    crd::MigrationStatus,
    migrate::{
        Bounds,
        run::{Journal, PolicyMigration, migrate_policy},
    },
    plan::QueuePlan,
};
use lapin::{
    BasicProperties, Confirmation, Connection,
    options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions},
};
use std::{
    collections::{BTreeMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// What a soak runs.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub seed: u64,
    pub restarts: u32,
    pub migrations: u32,
    pub replicas: usize,
    /// How to kill and start a broker node (a cluster only).
    pub nodes: Option<NodeControl>,
}

/// A command that takes `kill-node X` and `start-node X` (`scripts/rabbitmq-cluster.sh`), and
/// the nodes it knows.
#[derive(Debug, Clone)]
pub struct NodeControl {
    pub command: String,
    pub nodes: Vec<String>,
}

/// What a soak did and found.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    pub seed: u64,
    pub broker: String,
    pub restarts: u32,
    pub migrations: u32,
    /// Migration attempts that unwound (consumers holding deliveries, publishers without a
    /// pause) and were tried again.
    pub unwound: u32,
    pub faults: BTreeMap<Fault, u32>,
    /// Publishes the broker confirmed.
    pub published: u64,
    pub consumed: u64,
    pub dead_lettered: u64,
    /// Confirmed messages still in the queue at the end (nothing consumed them in time).
    pub left: u64,
    pub lost: u64,
    pub duplicates: u64,
    /// Gates opened before their pod's consumer had attached.
    pub premature_opens: u64,
    pub took: Duration,
}

impl SoakReport {
    pub fn table(&self) -> String {
        let mut rows = vec![
            ("broker", self.broker.clone()),
            ("seed", self.seed.to_string()),
            ("restarts", self.restarts.to_string()),
            ("migrations", self.migrations.to_string()),
            ("migration attempts unwound", self.unwound.to_string()),
        ];
        for fault in faults::ALL {
            rows.push((fault.as_str(), self.faults.get(&fault).copied().unwrap_or_default().to_string()));
        }
        rows.extend([
            ("published (confirmed)", self.published.to_string()),
            ("consumed", self.consumed.to_string()),
            ("dead-lettered", self.dead_lettered.to_string()),
            ("left in the queue", self.left.to_string()),
            ("lost", self.lost.to_string()),
            ("duplicates", self.duplicates.to_string()),
            ("gates opened before their consumer", self.premature_opens.to_string()),
            ("took", format!("{:.0} s", self.took.as_secs_f64())),
        ]);
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        rows.iter().map(|(k, v)| format!("{k:<width$}  {v}\n")).collect()
    }

    /// One line of `key=value`, for scripts.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "summary seed={} restarts={} migrations={} unwound={}",
            self.seed, self.restarts, self.migrations, self.unwound
        );
        for fault in faults::ALL {
            line.push_str(&format!(" {}={}", fault.as_str(), self.faults.get(&fault).copied().unwrap_or_default()));
        }
        line.push_str(&format!(
            " published={} consumed={} dead_lettered={} left={} lost={} duplicates={} premature_opens={}",
            self.published,
            self.consumed,
            self.dead_lettered,
            self.left,
            self.lost,
            self.duplicates,
            self.premature_opens
        ));
        line
    }
}

/// A migration step whose record fails stops the operator there.
struct SoakJournal {
    stop_at: Option<crate::crd::MigrationPhase>,
    last: Option<MigrationStatus>,
}

impl Journal for SoakJournal {
    async fn record(&mut self, state: &MigrationStatus) -> Result<(), String> {
        if self.stop_at == Some(state.phase) {
            self.stop_at = None;
            return Err("the operator was killed".into());
        }
        self.last = Some(state.clone());
        Ok(())
    }
}

/// Runs a soak against the broker at `uri`.
pub async fn soak(o: &SoakOptions, uri: &BrokerUri) -> Result<SoakReport, String> {
    let started = Instant::now();
    let queue = format!("queueguard-soak.{}.{:x}", std::process::id(), now_ms());
    let key = QueueKey::new(uri.vhost(), &queue);
    let trackers = TrackerPool::new("queueguard-soak");
    let tracker = trackers.tracker(uri, None).map_err(|e| e.to_string())?;
    if !tracker.wait_synced(uri.vhost(), Duration::from_secs(15)).await || !tracker.tracking(uri.vhost()).is_live() {
        return Err(format!("cannot see the broker's consumers: {}", tracker.tracking(uri.vhost())));
    }
    let _interest = tracker.watch(key.clone());
    let mut operator = Operator::new(uri, 0)?;
    // On a cluster the queue starts quorum, and nodes are killed only while it is: a classic
    // queue lives on one node, and is gone with what is routed to it while that node is down
    // (RabbitMQ's behaviour, which `check` warns of, QG013).
    let mut quorum = o.nodes.is_some();
    let mut plan = demo_plan(&queue, quorum, true)?;
    let outcome = converge::converge(&plan, &operator.broker, &[], Mode::Declare).await;
    if !outcome.is_ready() {
        return Err(format!("queueguard could not declare the queue: {}", outcome.ready().message));
    }
    let mut s = super::Scenario::new(true, o.replicas, o.restarts);
    s.seed = o.seed;
    s.migrate = true;
    let mut sim = Sim {
        s: s.clone(),
        uri: uri.clone(),
        queues: vec![queue.clone()],
        keys: vec![key.clone()],
        rng: PodRng(o.seed | 1),
        pods: Vec::new(),
        next_id: 0,
        revision: 1,
        strategy: None,
        canary: Default::default(),
        tally: Arc::new(Tally::default()),
        declare: if quorum { Declare::Quorum } else { Declare::Durable },
        gate_waits: Vec::new(),
        gate_overheads: Vec::new(),
        premature: 0,
        fewest: None,
        guard: Some(Guard::new(&s, std::slice::from_ref(&key), tracker.clone())),
        tracker: tracker.clone(),
        pace: Arc::default(),
        restart_guard_at: None,
    };
    sim.roll().await?;
    let traffic = Traffic::start(uri, &queue);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut report = SoakReport { seed: o.seed, broker: uri.display(), ..Default::default() };
    let rounds = faults::schedule(o.seed, o.restarts, o.migrations, o.nodes.is_some());
    for (i, round) in rounds.iter().enumerate() {
        let mut rng = faults::Rng::for_round(o.seed, i);
        let faults: Vec<Fault> = match round {
            Round::Restart(f) | Round::Migration(f) => {
                f.iter().copied().filter(|f| *f != Fault::NodeKilled || quorum).collect()
            }
        };
        for fault in &faults {
            *report.faults.entry(*fault).or_default() += 1;
        }
        tracing::info!(round = i, ?round, "soak round");
        // Faults beside the round: a consumer killed, a node killed, a moment into it.
        let beside = tokio::spawn(faults_beside(
            faults.clone(),
            operator.broker.clone(),
            o.nodes.clone(),
            sim.live_pod_connections(),
            rng.between(200, 3000),
        ));
        if faults.contains(&Fault::SlowConsumers) {
            sim.pace.store(rng.between(100, 400), Ordering::Relaxed);
        }
        if faults.contains(&Fault::OperatorRestarted) {
            sim.restart_guard_at = Some(Instant::now() + Duration::from_millis(rng.between(100, 2000)));
        }
        if let Round::Migration(_) = round {
            let target = demo_plan(&queue, !quorum, true)?;
            let unwound = migrate_through_faults(&mut operator, uri, &plan, &target, &faults, &mut rng).await?;
            report.unwound += unwound;
            report.migrations += 1;
            plan = target;
            quorum = !quorum;
            // The operator's restart after the swap: new pods declare the queue as it now is.
            sim.declare = if quorum { Declare::Quorum } else { Declare::Durable };
        } else {
            report.restarts += 1;
        }
        sim.revision += 1;
        sim.roll().await.map_err(|e| format!("round {i} ({round:?}): {e}"))?;
        beside.await.map_err(|e| e.to_string())??;
        sim.pace.store(0, Ordering::Relaxed);
        sim.restart_guard_at = None;
    }

    let confirmed = traffic.stop().await?;
    report.published = confirmed.len() as u64;
    // Everything confirmed reaches a consumer, or expires into the dead-letter queue: wait until
    // every one is consumed, or consumption has stopped for a few seconds.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last_change = (sim.tally.counts().0, Instant::now());
    while Instant::now() < deadline {
        let consumed = sim.tally.consumed();
        if confirmed.iter().all(|id| consumed.contains(id)) {
            break;
        }
        let n = consumed.len() as u64;
        if n != last_change.0 {
            last_change = (n, Instant::now());
        } else if last_change.1.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for pod in sim.pods.drain(..) {
        pod.stop_and_wait().await;
    }
    let consumed = sim.tally.consumed();
    let left = take_ids(&operator.broker, &queue).await?;
    let dead_lettered = take_ids(&operator.broker, &plan.dead_letter_queue).await?;
    let (_, deliveries) = sim.tally.counts();
    report.consumed = confirmed.iter().filter(|id| consumed.contains(id)).count() as u64;
    report.dead_lettered =
        confirmed.iter().filter(|id| !consumed.contains(id) && dead_lettered.contains(id)).count() as u64;
    report.left = confirmed
        .iter()
        .filter(|id| !consumed.contains(id) && !dead_lettered.contains(id) && left.contains(id))
        .count() as u64;
    report.lost = report.published - report.consumed - report.dead_lettered - report.left;
    report.duplicates = deliveries.saturating_sub(consumed.len() as u64);
    report.premature_opens = sim.premature;
    let missing: Vec<u64> = confirmed
        .iter()
        .filter(|id| !consumed.contains(id) && !dead_lettered.contains(id) && !left.contains(id))
        .take(10)
        .copied()
        .collect();
    if !missing.is_empty() {
        tracing::error!(?missing, "confirmed messages neither consumed, dead-lettered nor in the queue");
    }
    let _ = converge::delete(&plan, &operator.broker, &Default::default()).await;
    report.took = started.elapsed();
    Ok(report)
}

/// The operator's broker side, as one process has it: killed, it leaves with its connection
/// (the broker requeues what it held), and the next one connects afresh.
struct Operator {
    broker: Arc<Broker>,
    pool: BrokerPool,
    name: String,
    generation: u32,
}

impl Operator {
    fn new(uri: &BrokerUri, generation: u32) -> Result<Self, String> {
        let name = format!("queueguard-soak-operator-{}-{generation}", std::process::id());
        let pool = BrokerPool::new(&name);
        let broker = pool.get(uri.clone(), None).map_err(|e| e.to_string())?;
        Ok(Self { broker, pool, name, generation })
    }

    /// The process dies: the broker closes its connections; a new one takes over.
    async fn kill(&mut self, uri: &BrokerUri) -> Result<(), String> {
        close_connections_named(&self.broker, &self.name).await;
        let _ = &self.pool;
        *self = Self::new(uri, self.generation + 1)?;
        Ok(())
    }
}

/// Closes, through the management API, every connection whose client-given name is `name`.
async fn close_connections_named(broker: &Broker, name: &str) -> usize {
    let Ok(connections) = broker.management.connections_in(broker.vhost()).await else { return 0 };
    let mut closed = 0;
    for c in connections.iter().filter(|c| c.user_provided_name.as_deref() == Some(name)) {
        if broker.management.close_connection(&c.name).await.is_ok() {
            closed += 1;
        }
    }
    closed
}

/// Migrates the queue from `from`'s shape to `to`'s with the round's operator faults: killed
/// between two steps, or in the middle of one, and resumed from the last record by a new
/// operator. Returns how many attempts unwound (and were tried again).
async fn migrate_through_faults(
    operator: &mut Operator,
    uri: &BrokerUri,
    from: &QueuePlan,
    to: &QueuePlan,
    faults: &[Fault],
    rng: &mut faults::Rng,
) -> Result<u32, String> {
    use crate::crd::MigrationPhase::*;
    let phases = [Preparing, Draining, Swapping, Restoring, Refilling, RestartingConsumers];
    let mut stop_at =
        faults.contains(&Fault::MigrationStopped).then(|| phases[rng.below(phases.len() as u64) as usize]);
    let mut cut_after = faults.contains(&Fault::MigrationCut).then(|| Duration::from_millis(rng.between(50, 8000)));
    let bounds = Bounds { unacknowledged: Duration::from_secs(20), ..Bounds::default() };
    let claims = Claims::default();
    let mut last: Option<MigrationStatus> = None;
    let mut unwound = 0;
    let started = Instant::now();
    debug_assert_ne!(from.queue_type, to.queue_type);
    loop {
        if started.elapsed() > Duration::from_secs(300) {
            return Err(format!("the migration of '{}' did not finish within 5 minutes", to.queue));
        }
        let mut journal = SoakJournal { stop_at: stop_at.take(), last: last.clone() };
        let migrating = migrate_policy(&operator.broker, to, last.as_ref(), &mut journal, &bounds, &claims);
        // None: killed mid-step.
        let result = match cut_after.take() {
            Some(after) => tokio::time::timeout(after, migrating).await.ok(),
            None => Some(migrating.await),
        };
        last = journal.last.clone();
        match result {
            Some(Ok(PolicyMigration::Moved(_) | PolicyMigration::NotNeeded)) => return Ok(unwound),
            Some(Ok(PolicyMigration::Stopped(check, _))) => {
                tracing::info!(why = %check.message, "soak: migration attempt stopped; again");
                unwound += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Some(Err(crate::migrate::Error::NotRecorded { .. })) | None => operator.kill(uri).await?,
            Some(Err(e)) => {
                tracing::info!(error = %e, "soak: migration attempt failed; again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// The faults that run beside a round, `after_ms` into it.
async fn faults_beside(
    faults: Vec<Fault>,
    broker: Arc<Broker>,
    nodes: Option<NodeControl>,
    pods: Vec<String>,
    after_ms: u64,
) -> Result<(), String> {
    tokio::time::sleep(Duration::from_millis(after_ms)).await;
    if faults.contains(&Fault::ConsumerKilled)
        && let Some(pod) = pods.get(after_ms as usize % pods.len().max(1))
    {
        close_connections_named(&broker, pod).await;
    }
    if faults.contains(&Fault::NodeKilled)
        && let Some(control) = &nodes
    {
        let node = &control.nodes[after_ms as usize % control.nodes.len()];
        run_node_control(&control.command, "kill-node", node)?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        run_node_control(&control.command, "start-node", node)?;
    }
    Ok(())
}

fn run_node_control(command: &str, verb: &str, node: &str) -> Result<(), String> {
    let mut words = command.split_whitespace();
    let program = words.next().ok_or("an empty node control command")?;
    let out = std::process::Command::new(program)
        .args(words)
        .args([verb, node])
        .output()
        .map_err(|e| format!("{command} {verb} {node}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{command} {verb} {node}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

/// The ids in a queue, taken off it.
/// Takes every message of `queue`, by id. A read that fails is tried again (the operator's
/// connection may just have been cut by a fault) for up to 30 s, then reported: a queue not
/// read must not count its messages as lost.
async fn take_ids(broker: &Broker, queue: &str) -> Result<HashSet<u64>, String> {
    let mut ids = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let failure = match broker.amqp.dedicated_channel().await {
            Ok((ch, _)) => {
                let get = || ch.basic_get(queue.into(), BasicGetOptions { no_ack: true });
                let failure = loop {
                    match tokio::time::timeout(Duration::from_secs(5), get()).await {
                        Ok(Ok(Some(m))) => {
                            if let Some(id) = std::str::from_utf8(&m.delivery.data).ok().and_then(|s| s.parse().ok()) {
                                ids.insert(id);
                            }
                        }
                        Ok(Ok(None)) => break None,
                        Ok(Err(e)) => break Some(e.to_string()),
                        Err(_) => break Some("no answer within 5 s".to_owned()),
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "read".into())).await;
                match failure {
                    None => return Ok(ids),
                    Some(e) => e,
                }
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(format!("could not read queue '{queue}' to count what is left in it: {failure}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The soak's publishers and what the broker confirmed of them.
struct Traffic {
    stop: Arc<AtomicBool>,
    confirmed: Arc<Mutex<Vec<u64>>>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), String>>>,
}

/// Publisher ids: the publisher's number in the top bits.
const PUBLISHER_SHIFT: u32 = 40;

impl Traffic {
    fn start(uri: &BrokerUri, queue: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let confirmed = Arc::new(Mutex::new(Vec::new()));
        let routes = [("amq.direct", None), ("", Some((Duration::from_secs(2), Duration::from_millis(2500))))];
        let tasks = routes
            .into_iter()
            .enumerate()
            .map(|(n, (exchange, bursts))| {
                let publisher = Publisher {
                    uri: uri.clone(),
                    exchange,
                    queue: queue.to_owned(),
                    first: (n as u64 + 1) << PUBLISHER_SHIFT,
                    bursts,
                    stop: stop.clone(),
                    confirmed: confirmed.clone(),
                };
                tokio::spawn(publisher.run())
            })
            .collect();
        Self { stop, confirmed, tasks }
    }

    async fn stop(self) -> Result<Vec<u64>, String> {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await.map_err(|e| e.to_string())??;
        }
        let confirmed = crate::sync::lock(&self.confirmed).clone();
        Ok(confirmed)
    }
}

struct Publisher {
    uri: BrokerUri,
    exchange: &'static str,
    queue: String,
    first: u64,
    /// Publishing for the first, then pausing for the second, over and over.
    bursts: Option<(Duration, Duration)>,
    stop: Arc<AtomicBool>,
    confirmed: Arc<Mutex<Vec<u64>>>,
}

impl Publisher {
    /// Publishes until told to stop; a message the broker did not confirm (returned as
    /// unroutable, refused, or its connection lost) is sent again with the same id.
    async fn run(self) -> Result<(), String> {
        let mut id = self.first;
        let mut node = 0;
        let mut failing_since: Option<Instant> = None;
        let started = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            let conn = match pod::connect(&self.uri, node, "queueguard-soak-publisher").await {
                Ok(conn) => conn,
                Err(e) => {
                    if failing_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(120) {
                        return Err(format!("a soak publisher could not reconnect: {e}"));
                    }
                    node += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            failing_since = None;
            if let Err(e) = self.publish_on(&conn, &mut id, started).await {
                tracing::info!(error = %e, "soak publisher reconnecting");
                node += 1;
            }
            let _ = pod::bounded(conn.close(200, "done".into())).await;
        }
        Ok(())
    }

    async fn publish_on(&self, conn: &Connection, id: &mut u64, started: Instant) -> lapin::Result<()> {
        let ch = pod::bounded(conn.create_channel()).await?;
        pod::bounded(ch.confirm_select(ConfirmSelectOptions::default())).await?;
        while !self.stop.load(Ordering::SeqCst) {
            if let Some((on, off)) = self.bursts {
                let cycle = on + off;
                let into = Duration::from_nanos((started.elapsed().as_nanos() % cycle.as_nanos()) as u64);
                if into >= on {
                    tokio::time::sleep(cycle - into).await;
                    continue;
                }
            }
            let n = *id - self.first;
            let mut props = BasicProperties::default().with_delivery_mode(2);
            if n.is_multiple_of(5) {
                props = props.with_expiration("200".into());
            }
            if n.is_multiple_of(7) {
                props = props.with_priority(5);
            }
            let body = id.to_string();
            let sent = pod::bounded(async {
                ch.basic_publish(
                    self.exchange.into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions { mandatory: true, ..Default::default() },
                    body.as_bytes(),
                    props,
                )
                .await?
                .await
            })
            .await?;
            if matches!(sent, Confirmation::Ack(None)) {
                crate::sync::lock(&self.confirmed).push(*id);
                *id += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = pod::bounded(ch.close(200, "done".into())).await;
        Ok(())
    }
}
