//! One simulated consumer pod: boots, attaches a real consumer, acknowledges messages, and on
//! termination cancels its consumer, finishes what it holds, and closes.

use super::Scenario;
use crate::{
    broker::uri::BrokerUri,
    consumers::tracker::now_ms,
    gate::pods::{GateCondition, PodFacts},
};
use crate::{sync::lock, workload::owner::PodOwner};
use futures::StreamExt;
use futures::stream::SelectAll;
use lapin::{
    Connection, ConnectionProperties,
    options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};
use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::sync::oneshot;

/// Every message consumed (acknowledged on a live channel), by sequence number, and the
/// consumers' reconnects.
#[derive(Default)]
pub struct Tally {
    seen: Mutex<HashMap<u64, u32>>,
    reconnects: AtomicU64,
}

impl Tally {
    fn record(&self, seq: u64) {
        *lock(&self.seen).entry(seq).or_default() += 1;
    }

    /// The sequence numbers consumed so far.
    pub fn consumed(&self) -> std::collections::HashSet<u64> {
        lock(&self.seen).keys().copied().collect()
    }

    /// (distinct messages, deliveries).
    pub fn counts(&self) -> (u64, u64) {
        let map = lock(&self.seen);
        (map.len() as u64, map.values().map(|&n| u64::from(n)).sum())
    }

    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::SeqCst)
    }
}

/// How the application declares its queue at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declare {
    /// Auto-delete, as in the source article's naive setup.
    AutoDelete,
    /// Plain durable, under queueguard.
    Durable,
    /// Durable quorum queue, under queueguard.
    Quorum,
}

impl Declare {
    pub fn of(s: &Scenario) -> Self {
        match (s.guarded, s.quorum) {
            (false, _) => Self::AutoDelete,
            (true, false) => Self::Durable,
            (true, true) => Self::Quorum,
        }
    }
}

/// Connects to the broker's nodes in turn, starting at `first` (modulo their number), as a
/// client with an address list does; each within [`BROKER_TIMEOUT`] (a node shutting down or
/// booting can accept the TCP connection and never finish the handshake).
pub async fn connect(uri: &BrokerUri, first: usize, name: &str) -> lapin::Result<Connection> {
    let nodes = uri.nodes();
    let mut last = None;
    for i in 0..nodes.len() {
        let node = &nodes[(first + i) % nodes.len()];
        let props = ConnectionProperties::default().with_connection_name(name.into());
        match bounded(Connection::connect_uri(uri.amqp_at(node), props)).await {
            Ok(conn) => return Ok(conn),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("a broker URI names at least one node"))
}

/// How long a simulated client waits for the broker before it gives the connection up.
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// `op`, failing as timed out after [`BROKER_TIMEOUT`].
pub async fn bounded<T>(op: impl std::future::Future<Output = lapin::Result<T>>) -> lapin::Result<T> {
    tokio::time::timeout(BROKER_TIMEOUT, op)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the broker did not answer").into()))
}

/// How a consumer's session ended.
enum Ended {
    /// Told to stop, and finished what it held.
    Stopped,
    /// The deliveries stopped: the connection went away under it.
    Lost,
}

#[derive(Default)]
struct Shared {
    booted_ms: AtomicI64,
    attached_ms: AtomicI64,
    finished: AtomicBool,
}

pub struct PodHandle {
    pub id: usize,
    /// Unique per pod, whatever its name (a StatefulSet pod is created again under its name).
    pub uid: String,
    /// A StatefulSet pod's ordinal (its id otherwise).
    pub ordinal: usize,
    pub name: String,
    pub revision: u32,
    pub terminating: bool,
    gate: Option<GateCondition>,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodHandle {
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        id: usize,
        name: String,
        revision: u32,
        uri: &BrokerUri,
        queues: &[String],
        declare: Declare,
        boot: Duration,
        attach: Duration,
        pace: Arc<AtomicU64>,
        tally: Arc<Tally>,
    ) -> Self {
        let shared = Arc::new(Shared::default());
        let (stop, stopped) = oneshot::channel();
        let uid = format!("{name}.{id}");
        let task = tokio::spawn(consume(
            id,
            name.clone(),
            uid.clone(),
            uri.clone(),
            queues.to_vec(),
            declare,
            [boot, attach],
            pace,
            tally,
            shared.clone(),
            stopped,
        ));
        Self { id, uid, ordinal: id, name, revision, terminating: false, gate: None, shared, stop: Some(stop), task }
    }

    pub fn booted_ms(&self) -> Option<i64> {
        Some(self.shared.booted_ms.load(Ordering::SeqCst)).filter(|&t| t > 0)
    }

    pub fn attached_ms(&self) -> Option<i64> {
        Some(self.shared.attached_ms.load(Ordering::SeqCst)).filter(|&t| t > 0)
    }

    pub fn finished(&self) -> bool {
        self.shared.finished.load(Ordering::SeqCst)
    }

    /// Ready as the Deployment controller counts it: booted, and with a gate, the gate open.
    pub fn ready(&self, gated: bool) -> bool {
        !self.terminating && self.booted_ms().is_some() && (!gated || self.gate.as_ref().is_some_and(|g| g.status))
    }

    /// The pod as the gate sees it.
    pub fn facts(&self, namespace: &str, owner: PodOwner) -> PodFacts {
        PodFacts {
            namespace: namespace.into(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            owner: Some(owner),
            ips: vec![],
            ip_since_ms: None,
            has_gate: true,
            condition: self.gate.clone(),
            containers_ready_since_ms: self.booted_ms(),
            deleting: self.terminating,
            terminal: false,
        }
    }

    /// Writes the gate condition; true when this opened it.
    pub fn set_gate(&mut self, open: bool, reason: &str, now_ms: i64) -> bool {
        let was_open = self.gate.as_ref().is_some_and(|g| g.status);
        let since_ms = match &self.gate {
            Some(g) if g.status == open => g.since_ms,
            _ => now_ms,
        };
        self.gate = Some(GateCondition { status: open, reason: reason.into(), since_ms });
        open && !was_open
    }

    /// SIGTERM: the pod stops consuming and shuts down within its grace period.
    pub fn terminate(&mut self) {
        self.terminating = true;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub async fn stop_and_wait(mut self) {
        self.terminate();
        let _ = self.task.await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn consume(
    id: usize,
    name: String,
    uid: String,
    uri: BrokerUri,
    queues: Vec<String>,
    declare: Declare,
    [boot, attach]: [Duration; 2],
    pace: Arc<AtomicU64>,
    tally: Arc<Tally>,
    shared: Arc<Shared>,
    mut stopped: oneshot::Receiver<()>,
) {
    let finish = |shared: &Shared| shared.finished.store(true, Ordering::SeqCst);
    tokio::select! {
        _ = tokio::time::sleep(boot) => {}
        _ = &mut stopped => return finish(&shared),
    }
    shared.booted_ms.store(now_ms(), Ordering::SeqCst);
    tokio::select! {
        _ = tokio::time::sleep(attach) => {}
        _ = &mut stopped => return finish(&shared),
    }
    // A real worker reconnects, through the next node of a cluster, until it is told to stop.
    // Pod n starts at node n, which spreads pods over a cluster's nodes.
    let mut node = id;
    loop {
        match attach_and_work(&name, &uid, &uri, node, &queues, declare, &pace, &tally, &shared, &mut stopped).await {
            Ok(Ended::Stopped) => break,
            lost => {
                let error = lost.err().map(|e| e.to_string()).unwrap_or_else(|| "deliveries ended".into());
                tracing::info!(pod = %name, %error, "simulated consumer reconnecting");
                tally.reconnects.fetch_add(1, Ordering::SeqCst);
                node += 1;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = &mut stopped => break,
                }
            }
        }
    }
    finish(&shared);
}

/// One connection, one channel, one consumer per queue (tag `<pod>.<i>`), as a worker that
/// reads several queues would have; each delivery takes it `pace` ms (as it is at the time)
/// before it acknowledges it.
#[allow(clippy::too_many_arguments)]
async fn attach_and_work(
    name: &str,
    uid: &str,
    uri: &BrokerUri,
    node: usize,
    queues: &[String],
    declare: Declare,
    pace: &AtomicU64,
    tally: &Tally,
    shared: &Shared,
    stopped: &mut oneshot::Receiver<()>,
) -> lapin::Result<Ended> {
    // Named by the pod's UID, as a worker given it through the downward API: unique where
    // names repeat (a StatefulSet's pod created again under its name).
    let conn = connect(uri, node, uid).await?;
    let ch = bounded(conn.create_channel()).await?;
    let (options, arguments) = match declare {
        Declare::AutoDelete => (QueueDeclareOptions { auto_delete: true, ..Default::default() }, FieldTable::default()),
        Declare::Durable => (QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()),
        Declare::Quorum => {
            let mut arguments = FieldTable::default();
            arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
            (QueueDeclareOptions { durable: true, ..Default::default() }, arguments)
        }
    };
    bounded(ch.basic_qos(10, BasicQosOptions::default())).await?;
    let mut deliveries = SelectAll::new();
    for (i, queue) in queues.iter().enumerate() {
        bounded(ch.queue_declare(queue.as_str().into(), options, arguments.clone())).await?;
        let tag = format!("{name}.{i}");
        let options = BasicConsumeOptions::default();
        deliveries
            .push(bounded(ch.basic_consume(queue.as_str().into(), tag.into(), options, FieldTable::default())).await?);
    }
    shared.attached_ms.store(now_ms(), Ordering::SeqCst);
    loop {
        tokio::select! {
            delivery = deliveries.next() => match delivery {
                Some(Ok(d)) => {
                    tokio::time::sleep(Duration::from_millis(pace.load(Ordering::Relaxed))).await;
                    bounded(d.ack(BasicAckOptions::default())).await?;
                    if let Some(seq) = std::str::from_utf8(&d.data).ok().and_then(|s| s.parse().ok()) {
                        tally.record(seq);
                    }
                }
                Some(Err(e)) => return Err(e),
                None => return Ok(Ended::Lost),
            },
            _ = &mut *stopped => break,
        }
    }
    // Graceful shutdown: stop receiving, finish what was already delivered, then leave. The pod
    // was told to stop, so a broker that goes away meanwhile ends it all the same (its stop
    // signal is spent: waiting on it again would panic); what it held unacked is redelivered.
    for i in 0..queues.len() {
        if bounded(ch.basic_cancel(format!("{name}.{i}").into(), BasicCancelOptions::default())).await.is_err() {
            return Ok(Ended::Stopped);
        }
    }
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_millis(100), deliveries.next()).await {
        tokio::time::sleep(Duration::from_millis(pace.load(Ordering::Relaxed))).await;
        if bounded(d.ack(BasicAckOptions::default())).await.is_err() {
            return Ok(Ended::Stopped);
        }
        if let Some(seq) = std::str::from_utf8(&d.data).ok().and_then(|s| s.parse().ok()) {
            tally.record(seq);
        }
    }
    let _ = bounded(ch.close(200, "bye".into())).await;
    let _ = bounded(conn.close(200, "bye".into())).await;
    Ok(Ended::Stopped)
}
