//! One live view of a broker's consumers: a subscription to `amq.rabbitmq.event` for attach and
//! detach within milliseconds, and periodic management API snapshots for truth (events are lost
//! across reconnects), one vhost at a time. Without the event exchange plugin it polls, and says
//! so.
//!
//! Snapshots are per vhost, each with its own health: a vhost the broker user cannot read, or
//! one slow read, leaves the other vhosts' tracking live.
//!
//! In a cluster one subscription sees every node's events, but a node that crashes sends none
//! for what it held: the tracker reads the nodes every [`NODE_CHECK`] and drops the consumers
//! of a node seen down at once. A node without the event plugin publishes no events, so its
//! consumers are polled for. After the subscription is lost (its node, say), it subscribes
//! again through the next node, resyncs at once and once more after the statistics lag.

use super::{
    events,
    registry::{BrokerEvent, Change, ConnectionFacts, Consumer, QueueKey, Registry, Snapshot},
};
use crate::broker::{
    Broker,
    amqp::AmqpError,
    management::{ConsumerInfo, NodeInfo},
    refusal::{ACCESS_REFUSED, NOT_FOUND},
};
use crate::sync::lock;
use futures::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::sync::{Notify, broadcast, watch};

/// The exchange the event plugin publishes to (in the default vhost).
pub const EVENT_EXCHANGE: &str = "amq.rabbitmq.event";
/// Snapshot interval while events flow, and while polling without them.
pub const RESYNC_WITH_EVENTS: Duration = Duration::from_secs(30);
pub const RESYNC_POLLING: Duration = Duration::from_secs(2);
/// While an event waits for a snapshot to place it, the vhost is read again this often: the
/// management API lists a new consumer after its statistics interval (5 s by default).
pub const RESYNC_PENDING: Duration = Duration::from_secs(1);
/// Wait before subscribing again after the plugin was found missing.
/// How long a deletion the operator announced ([`ConsumerTracker::expect_deletion`]) is
/// waited for: its event comes within milliseconds; without events, a snapshot sees it only if
/// it falls into the swap's few milliseconds, so most such marks simply lapse.
const EXPECTED_DELETION: Duration = Duration::from_secs(60);
const PLUGIN_RETRY: Duration = Duration::from_secs(60);
/// A subscription that lasted this long was healthy: when it ends, subscribe again at once.
const STABLE_SUBSCRIPTION: Duration = Duration::from_secs(10);
/// How often a cluster's nodes are read: a crashed node's consumers must not count as attached
/// for longer than this plus the management API's view of the crash (well under a second on
/// loopback, `scripts/rabbitmq-cluster.sh`).
pub const NODE_CHECK: Duration = Duration::from_millis(500);
/// A single node's crash ends the operator's own connection; its nodes are read only to notice
/// it became a cluster (once a minute: a management API read the fleet's budget counts).
const NODE_CHECK_SINGLE: Duration = Duration::from_secs(60);
/// The management API lists a new consumer after its statistics interval (measured on a
/// cluster: p50 2.6 s, max 3.7 s; a queue's consumer count max 6.7 s): consumers that attached
/// while the subscription was down show in a snapshot this long after it is back.
pub const STATS_LAG: Duration = Duration::from_secs(7);
const EVENT_PLUGIN: &str = "rabbitmq_event_exchange";

/// The running nodes known to lack the event exchange plugin. A node the API has no statistics
/// for is not counted: unknown is not missing.
fn without_event_plugin(nodes: &[NodeInfo]) -> Vec<String> {
    nodes
        .iter()
        .filter(|n| n.running && n.enabled_plugins.as_ref().is_some_and(|p| !p.iter().any(|p| p == EVENT_PLUGIN)))
        .map(|n| n.name.clone())
        .collect()
}

/// How the tracker currently learns about consumers of a vhost; shown in status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracking {
    /// Events flow, and snapshots succeed.
    Events,
    /// No events (the reason says why); snapshots every couple of seconds.
    Polling(String),
    /// Neither events nor snapshots: the vhost's consumers cannot be seen (the reason says which
    /// read failed).
    Unavailable(String),
    /// Not yet synchronised once.
    Starting,
}

impl Tracking {
    /// Whether consumers can be believed right now.
    pub fn is_live(&self) -> bool {
        matches!(self, Self::Events | Self::Polling(_))
    }
}

impl Tracking {
    /// The word status shows, and the reason beside it.
    pub fn mode(&self) -> (crate::crd::TrackingMode, Option<&str>) {
        use crate::crd::TrackingMode;
        match self {
            Self::Events => (TrackingMode::Events, None),
            Self::Polling(why) => (TrackingMode::Polling, Some(why)),
            Self::Unavailable(why) => (TrackingMode::Unavailable, Some(why)),
            Self::Starting => (TrackingMode::Starting, None),
        }
    }
}

impl std::fmt::Display for Tracking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Events => f.write_str("Events"),
            Self::Polling(why) => write!(f, "Polling ({why})"),
            Self::Unavailable(why) => write!(f, "Unavailable ({why})"),
            Self::Starting => f.write_str("Starting"),
        }
    }
}

/// One vhost's snapshots.
#[derive(Debug, Clone, Default)]
struct Vhost {
    snapshot: Option<Result<(), String>>,
    /// When it was last read (ms; 0: never).
    read_ms: i64,
    requested: bool,
}

pub struct ConsumerTracker {
    id: u64,
    broker: Arc<Broker>,
    registry: Mutex<Registry>,
    changes: broadcast::Sender<Change>,
    events: Mutex<Option<Result<(), String>>>,
    vhosts: Mutex<BTreeMap<String, Vhost>>,
    /// Bumped after every snapshot, for [`Self::wait_synced`].
    snapshots: watch::Sender<u64>,
    /// Shared with the resync loop, which must not hold the tracker while it waits.
    resync: Arc<Notify>,
    /// The queues some holder of an [`Interest`] needs: their consumers are kept, their
    /// deletion noticed (whether the last snapshot saw them).
    watched: Mutex<HashMap<QueueKey, Watched>>,
    deleted: Mutex<HashSet<QueueKey>>,
    /// Queues the operator itself is about to delete (a migration's swap), until when (ms):
    /// their next deletion is not one behind its back.
    expected: Mutex<HashMap<QueueKey, i64>>,
    nodes: Mutex<Nodes>,
    /// Wakes the node check early (the subscription was lost).
    node_check: Arc<Notify>,
}

/// One queue of interest.
#[derive(Debug, Default)]
struct Watched {
    holders: usize,
    seen: bool,
    /// A snapshot taken after the watch began has been applied: until then its consumers (all
    /// attached before the watch, when the registry kept none of them) are unknown.
    synced: bool,
}

/// A queue's consumers and deletion kept track of for as long as this lives (a policy's
/// binding, a `consumers --watch`); the last one dropped lets go of what was kept for it.
pub struct Interest {
    tracker: Weak<ConsumerTracker>,
    queue: QueueKey,
}

impl Drop for Interest {
    fn drop(&mut self) {
        if let Some(t) = self.tracker.upgrade() {
            t.unwatch(&self.queue);
        }
    }
}

impl std::fmt::Debug for Interest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Interest({})", self.queue)
    }
}

/// The cluster as last read.
#[derive(Debug, Default)]
struct Nodes {
    down: BTreeSet<String>,
    /// Running nodes without the event plugin, whose consumers only polling sees.
    without_plugin: Vec<String>,
}

impl ConsumerTracker {
    /// Starts tracking through `broker` (an endpoint on the vhost the event exchange lives in).
    pub fn start(broker: Arc<Broker>) -> Arc<Self> {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let (changes, _) = broadcast::channel(4096);
        let tracker = Arc::new(Self {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            broker,
            registry: Mutex::default(),
            changes,
            events: Mutex::default(),
            vhosts: Mutex::default(),
            snapshots: watch::channel(0).0,
            resync: Arc::default(),
            watched: Mutex::default(),
            deleted: Mutex::default(),
            expected: Mutex::default(),
            nodes: Mutex::default(),
            node_check: Arc::default(),
        });
        tokio::spawn(events_loop(Arc::downgrade(&tracker)));
        tokio::spawn(resync_loop(Arc::downgrade(&tracker)));
        tokio::spawn(nodes_loop(Arc::downgrade(&tracker)));
        tracker
    }

    /// Distinguishes trackers (one per broker) for as long as the process runs.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The tracker's own endpoint (its events connection and management client).
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// Attach, detach, deletion and tracking changes, as they happen.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    pub fn consumers_on(&self, queue: &QueueKey) -> Vec<Consumer> {
        lock(&self.registry).consumers_on(queue)
    }

    /// Starts snapshotting a vhost (at once, the first time).
    pub fn track_vhost(&self, vhost: &str) {
        let mut vhosts = lock(&self.vhosts);
        if !vhosts.contains_key(vhost) {
            vhosts.insert(vhost.to_owned(), Vhost { requested: true, ..Default::default() });
            drop(vhosts);
            self.resync.notify_one();
        }
    }

    /// How the consumers of `vhost` are seen now (asking starts tracking it).
    pub fn tracking(&self, vhost: &str) -> Tracking {
        self.track_vhost(vhost);
        let snapshot = lock(&self.vhosts).get(vhost).and_then(|v| v.snapshot.clone());
        combine(self.events(), snapshot)
    }

    /// How the consumers of a watched `queue` are seen now: Starting until a snapshot taken
    /// after its watch began, even where its vhost is live through other queues.
    pub fn tracking_of(&self, queue: &QueueKey) -> Tracking {
        let vhost = self.tracking(&queue.vhost);
        let unsynced = lock(&self.watched).get(queue).is_some_and(|w| !w.synced);
        if unsynced && vhost.is_live() { Tracking::Starting } else { vhost }
    }

    /// Whether events tell about every node: the subscription's state, unless a running node
    /// lacks the plugin.
    fn events(&self) -> Option<Result<(), String>> {
        let events = lock(&self.events).clone();
        let nodes = lock(&self.nodes);
        match (&events, nodes.without_plugin.as_slice()) {
            (Some(Ok(())), [_, ..]) => Some(Err(format!(
                "node {} has no {EVENT_PLUGIN} plugin: enable it on every node of the cluster",
                nodes.without_plugin.join(", ")
            ))),
            _ => events,
        }
    }

    fn events_flow(&self) -> bool {
        matches!(self.events(), Some(Ok(())))
    }

    /// Reads the cluster's nodes; drops the consumers of nodes newly seen down, and resyncs
    /// when one comes back. Returns when to read them next.
    async fn check_nodes(&self) -> Duration {
        let nodes = match self.broker.management.nodes().await {
            Ok(nodes) => nodes,
            Err(e) => {
                tracing::debug!(broker = %self.broker.uri.display(), error = %e, "could not read the nodes");
                return NODE_CHECK;
            }
        };
        let down: BTreeSet<String> = nodes.iter().filter(|n| !n.running).map(|n| n.name.clone()).collect();
        let without_plugin = without_event_plugin(&nodes);
        let (newly_down, back, plugins_changed) = {
            let mut known = lock(&self.nodes);
            let newly_down: BTreeSet<String> = down.difference(&known.down).cloned().collect();
            let back = known.down.difference(&down).count();
            let plugins_changed = known.without_plugin != without_plugin;
            *known = Nodes { down, without_plugin };
            (newly_down, back, plugins_changed)
        };
        if !newly_down.is_empty() {
            tracing::warn!(broker = %self.broker.uri.display(), nodes = ?newly_down, "broker nodes down; their consumers are gone");
            let changes = lock(&self.registry).nodes_down(&newly_down, now_ms());
            self.publish(changes);
        }
        if back > 0 {
            self.request_resync();
        }
        if plugins_changed {
            let _ = self.changes.send(Change::Tracking { vhost: None });
        }
        if nodes.len() > 1 { NODE_CHECK } else { NODE_CHECK_SINGLE }
    }

    /// Waits until `vhost` has been snapshotted, after every queue of it watched now (or
    /// `timeout` passes); starts tracking it.
    pub async fn wait_synced(&self, vhost: &str, timeout: Duration) -> bool {
        self.track_vhost(vhost);
        let mut rx = self.snapshots.subscribe();
        let synced = || {
            lock(&self.vhosts).get(vhost).is_some_and(|v| v.snapshot.is_some())
                && lock(&self.watched).iter().all(|(q, w)| q.vhost != vhost || w.synced)
        };
        tokio::time::timeout(timeout, rx.wait_for(|_| synced())).await.is_ok_and(|r| r.is_ok())
    }

    /// Asks for a snapshot of every tracked vhost now (after reconnecting).
    pub fn request_resync(&self) {
        for v in lock(&self.vhosts).values_mut() {
            v.requested = true;
        }
        self.resync.notify_one();
    }

    /// Keeps track of `queue` (its consumers, its deletion even without events, its vhost) until
    /// the returned [`Interest`], and every other one in it, is dropped.
    pub fn watch(self: &Arc<Self>, queue: QueueKey) -> Interest {
        let new = {
            let mut watched = lock(&self.watched);
            let entry = watched.entry(queue.clone()).or_default();
            entry.holders += 1;
            entry.holders == 1
        };
        if new {
            self.interest_changed();
            // Consumers that were there before it mattered come from a snapshot.
            self.request_resync_of(&queue.vhost);
        }
        self.track_vhost(&queue.vhost);
        Interest { tracker: Arc::downgrade(self), queue }
    }

    fn unwatch(&self, queue: &QueueKey) {
        let gone = {
            let mut watched = lock(&self.watched);
            let Some(entry) = watched.get_mut(queue) else { return };
            entry.holders -= 1;
            let gone = entry.holders == 0;
            if gone {
                watched.remove(queue);
            }
            gone
        };
        if !gone {
            return;
        }
        lock(&self.deleted).remove(queue);
        let vhost_needed = lock(&self.watched).keys().any(|q| q.vhost == queue.vhost);
        if !vhost_needed {
            lock(&self.vhosts).remove(&queue.vhost);
        }
        self.interest_changed();
    }

    fn interest_changed(&self) {
        let queues = lock(&self.watched).keys().cloned().collect();
        lock(&self.registry).set_interest(queues);
    }

    fn request_resync_of(&self, vhost: &str) {
        if let Some(v) = lock(&self.vhosts).get_mut(vhost) {
            v.requested = true;
        }
        self.resync.notify_one();
    }

    /// How much the tracker holds: the registry's entries, and the vhosts and queues tracked.
    pub fn footprint(&self) -> (crate::consumers::registry::Footprint, usize, usize) {
        (lock(&self.registry).footprint(), lock(&self.vhosts).len(), lock(&self.watched).len())
    }

    /// True once per deletion of `queue` seen since the last call.
    pub fn take_deleted(&self, queue: &QueueKey) -> bool {
        lock(&self.deleted).remove(queue)
    }

    /// The operator is about to delete `queue` itself (a migration swaps it for its new shape):
    /// its next deletion seen within [`EXPECTED_DELETION`] is not reported by
    /// [`Self::take_deleted`]. Subscribers still see it.
    pub fn expect_deletion(&self, queue: &QueueKey) {
        let now = now_ms();
        let mut expected = lock(&self.expected);
        expected.retain(|_, until| *until >= now);
        expected.insert(queue.clone(), now + EXPECTED_DELETION.as_millis() as i64);
    }

    /// Feeds one broker event through the registry and tells subscribers what changed.
    fn apply(&self, event: BrokerEvent) {
        let (changes, wanted) = {
            let mut registry = lock(&self.registry);
            let changes = registry.apply(event, now_ms());
            (changes, !registry.resync_wanted().is_empty())
        };
        self.publish(changes);
        if wanted {
            self.resync.notify_one();
        }
    }

    fn publish(&self, changes: Vec<Change>) {
        for change in changes {
            if let Change::QueueDeleted { queue } = &change
                && lock(&self.watched).contains_key(queue)
            {
                let expected = lock(&self.expected).remove(queue).is_some_and(|until| until >= now_ms());
                if !expected {
                    lock(&self.deleted).insert(queue.clone());
                }
            }
            let _ = self.changes.send(change);
        }
    }

    fn set_events(&self, state: Result<(), String>) {
        let changed = lock(&self.events).replace(state.clone()).is_none_or(|old| old.is_ok() != state.is_ok());
        if changed {
            let _ = self.changes.send(Change::Tracking { vhost: None });
        }
    }

    /// The vhosts due for a snapshot now, marked as read.
    fn due(&self, now: i64) -> Vec<String> {
        let interval = if self.events_flow() { RESYNC_WITH_EVENTS } else { RESYNC_POLLING };
        let wanted = lock(&self.registry).resync_wanted().clone();
        let mut vhosts = lock(&self.vhosts);
        let mut due = Vec::new();
        for (name, v) in vhosts.iter_mut() {
            let age = now - v.read_ms;
            let pending = wanted.contains(name) && age >= RESYNC_PENDING.as_millis() as i64;
            if v.requested || pending || age >= interval.as_millis() as i64 {
                v.requested = false;
                v.read_ms = now;
                due.push(name.clone());
            }
        }
        due
    }

    /// How long the resync loop may sleep before a vhost is due.
    fn idle(&self, now: i64) -> Duration {
        let interval = if self.events_flow() { RESYNC_WITH_EVENTS } else { RESYNC_POLLING };
        let wanted = lock(&self.registry).resync_wanted().clone();
        let vhosts = lock(&self.vhosts);
        let next = vhosts
            .iter()
            .map(|(name, v)| {
                let every = if wanted.contains(name) { RESYNC_PENDING } else { interval };
                v.read_ms + every.as_millis() as i64
            })
            .min();
        next.map_or(interval, |at| Duration::from_millis((at - now).max(0) as u64))
    }

    async fn snapshot(&self, vhost: &str) {
        let before = self.tracking(vhost);
        let result = self.read(vhost).await;
        if let Err(e) = &result {
            tracing::warn!(broker = %self.broker.uri.display(), %vhost, error = %e, "consumer snapshot failed");
        }
        let newly_synced = result.as_ref().is_ok_and(|n| *n > 0);
        if let Some(v) = lock(&self.vhosts).get_mut(vhost) {
            v.snapshot = Some(result.map(|_| ()));
        }
        if newly_synced || self.tracking(vhost) != before {
            let _ = self.changes.send(Change::Tracking { vhost: Some(vhost.to_owned()) });
        }
        self.snapshots.send_modify(|n| *n += 1);
    }

    /// Reads `vhost` into the registry; how many of its watched queues this first synced.
    async fn read(&self, vhost: &str) -> Result<usize, String> {
        let m = &self.broker.management;
        // Watched before the read is sent: what it lists covers them.
        let watched: Vec<QueueKey> = lock(&self.watched).keys().filter(|q| q.vhost == vhost).cloned().collect();
        if watched.is_empty() && !lock(&self.vhosts).contains_key(vhost) {
            return Ok(0); // let go of while it was due
        }
        // The queue list also proves the vhost readable: the management API lists the consumers
        // of a vhost the user may not access as none at all.
        let (consumers, connections, queues) =
            tokio::join!(m.consumers_in(vhost), m.connections_in(vhost), m.queue_names(vhost));
        let consumers = consumers.map_err(|e| format!("reading the consumers of vhost '{vhost}': {e}"))?;
        let present: HashSet<String> =
            queues.map_err(|e| format!("reading the queues of vhost '{vhost}': {e}"))?.into_iter().collect();
        // Without connection facts, names and connection times are unknown until the next read.
        let connections = connections
            .inspect_err(|e| tracing::debug!(%vhost, error = %e, "could not read the vhost's connections"))
            .ok();
        let now = now_ms();
        tracing::debug!(
            %vhost,
            consumers = consumers.len(),
            connections = connections.as_ref().map(Vec::len),
            watched = watched.len(),
            "consumer snapshot"
        );
        let snapshot = Snapshot {
            vhost: vhost.to_owned(),
            consumers: consumers.into_iter().map(|c| from_info(c, now)).collect(),
            connections: connections.map(|list| {
                list.into_iter()
                    .map(|c| {
                        let facts =
                            ConnectionFacts { user_provided_name: c.user_provided_name, connected_ms: c.connected_at };
                        (c.name, facts)
                    })
                    .collect()
            }),
        };
        let mut changes = lock(&self.registry).resync(snapshot, now);
        let mut newly_synced = 0;
        // Without events, a watched queue that was there and is gone was deleted.
        for queue in watched {
            if let Some(w) = lock(&self.watched).get_mut(&queue) {
                let now_present = present.contains(&queue.name);
                if w.seen && !now_present {
                    changes.push(Change::QueueDeleted { queue: queue.clone() });
                }
                w.seen = now_present;
                newly_synced += usize::from(!w.synced);
                w.synced = true;
            }
        }
        self.publish(changes);
        Ok(newly_synced)
    }
}

fn combine(events: Option<Result<(), String>>, snapshot: Option<Result<(), String>>) -> Tracking {
    match (events, snapshot) {
        (_, None) => Tracking::Starting,
        (Some(Ok(())), Some(Ok(()))) => Tracking::Events,
        (events, Some(Ok(()))) => Tracking::Polling(match events {
            Some(Err(why)) => why,
            _ => "event subscription starting".into(),
        }),
        (_, Some(Err(why))) => Tracking::Unavailable(why),
    }
}

fn from_info(c: ConsumerInfo, now_ms: i64) -> Consumer {
    Consumer {
        queue: QueueKey::new(c.queue.vhost, c.queue.name),
        tag: c.consumer_tag,
        peer_host: c.channel_details.peer_host.or_else(|| super::registry::peer_of(&c.channel_details.name)),
        channel: c.channel_details.name,
        connection_name: None,
        prefetch: c.prefetch_count,
        ack_required: c.ack_required,
        since_ms: now_ms,
        connected_ms: None,
        node: c.channel_details.node,
    }
}

async fn resync_loop(tracker: Weak<ConsumerTracker>) {
    loop {
        let Some(t) = tracker.upgrade() else { return };
        let due = t.due(now_ms());
        futures::future::join_all(due.iter().map(|vhost| t.snapshot(vhost))).await;
        let wait = t.idle(now_ms());
        let resync = t.resync.clone();
        // Dropped while waiting, so a tracker let go closes its connection now, not at its
        // next snapshot.
        drop(t);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = resync.notified() => {}
        }
    }
}

async fn nodes_loop(tracker: Weak<ConsumerTracker>) {
    loop {
        let Some(t) = tracker.upgrade() else { return };
        let wait = t.check_nodes().await;
        let early = t.node_check.clone();
        drop(t);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = early.notified() => {}
        }
    }
}

async fn events_loop(tracker: Weak<ConsumerTracker>) {
    let mut delays = crate::broker::amqp::reconnect_delays();
    loop {
        let outcome = subscribe(&tracker).await;
        if tracker.strong_count() == 0 {
            return;
        }
        let wait = match outcome {
            // The consumer stream ended: the connection went away after a subscription. One
            // that held a while is subscribed again at once; one that ends soon after each
            // start (a frame the connection refused, sent again and again) backs off, so its
            // resyncs of every tracked vhost do not come every half second.
            Ok(lasted) if lasted >= STABLE_SUBSCRIPTION => {
                delays = crate::broker::amqp::reconnect_delays();
                Duration::from_millis(500)
            }
            Ok(_) => delays.next().unwrap_or(Duration::from_secs(30)),
            Err(SubscribeError::PluginMissing(why)) => {
                if let Some(t) = tracker.upgrade() {
                    tracing::warn!(broker = %t.broker.uri.display(), %why, "no broker events; polling the management API");
                    t.set_events(Err(why));
                }
                PLUGIN_RETRY
            }
            Err(SubscribeError::Connection(why)) => {
                if let Some(t) = tracker.upgrade() {
                    t.set_events(Err(why));
                }
                delays.next().unwrap_or(Duration::from_secs(30))
            }
        };
        tokio::time::sleep(wait).await;
    }
}

enum SubscribeError {
    PluginMissing(String),
    Connection(String),
}

/// Subscribes and feeds the registry until the stream ends (or the tracker is dropped);
/// returns how long the subscription lasted.
async fn subscribe(tracker: &Weak<ConsumerTracker>) -> Result<Duration, SubscribeError> {
    let Some(t) = tracker.upgrade() else { return Ok(Duration::ZERO) };
    let amqp = &t.broker.amqp;
    let err = |e: AmqpError| match e {
        AmqpError::Refused(r) if r.code == NOT_FOUND => {
            SubscribeError::PluginMissing(format!("the rabbitmq_event_exchange plugin is not enabled ({r})"))
        }
        AmqpError::Refused(r) if r.code == ACCESS_REFUSED => {
            SubscribeError::PluginMissing(format!("the broker user may not read {EVENT_EXCHANGE} ({r})"))
        }
        other => SubscribeError::Connection(other.to_string()),
    };
    let (ch, generation) = amqp.dedicated_channel().await.map_err(err)?;
    let private = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
    let q = amqp.run_on(generation, ch.queue_declare("".into(), private, FieldTable::default())).await.map_err(err)?;
    for key in events::BINDINGS {
        amqp.run_on(
            generation,
            ch.queue_bind(
                q.name().clone(),
                EVENT_EXCHANGE.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await
        .map_err(err)?;
    }
    let no_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut deliveries = amqp
        .run_on(
            generation,
            ch.basic_consume(q.name().clone(), "queueguard-events".into(), no_ack, FieldTable::default()),
        )
        .await
        .map_err(err)?;
    t.set_events(Ok(()));
    let subscribed = std::time::Instant::now();
    // Whatever happened before the subscription only a snapshot can tell: one now, for what
    // went away, and one once consumers that came meanwhile are listed.
    t.request_resync();
    let later = tracker.clone();
    tokio::spawn(async move {
        tokio::time::sleep(STATS_LAG).await;
        if let Some(t) = later.upgrade() {
            t.request_resync();
        }
    });
    // Ends with the tracker: a tracker let go while no event comes would otherwise keep its
    // connection open until the next one (on a quiet broker, for good).
    let mut alive = t.snapshots.subscribe();
    drop(t);
    let mut ended = "the broker ended it".to_owned();
    loop {
        let delivery = tokio::select! {
            delivery = deliveries.next() => delivery,
            alive = alive.changed() => match alive {
                Ok(()) => continue,
                Err(_) => return Ok(subscribed.elapsed()),
            },
        };
        let Some(delivery) = delivery else { break };
        let Some(t) = tracker.upgrade() else { return Ok(subscribed.elapsed()) };
        let delivery = match delivery {
            Ok(delivery) => delivery,
            Err(e) => {
                ended = e.to_string();
                break;
            }
        };
        let Some(headers) = delivery.properties.headers() else { continue };
        let Some(event) = events::parse(delivery.routing_key.as_str(), headers) else { continue };
        tracing::trace!(?event, "broker event");
        t.apply(event);
    }
    if let Some(t) = tracker.upgrade() {
        tracing::warn!(broker = %t.broker.uri.display(), reason = %ended, lasted = ?subscribed.elapsed(), "event subscription lost; subscribing again");
        t.set_events(Err("event subscription lost; reconnecting".into()));
        // Its node may be the one that went down.
        t.node_check.notify_one();
    }
    Ok(subscribed.elapsed())
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_without_statistics_is_not_counted_as_missing_the_plugin() {
        let node = |name: &str, running: bool, plugins: Option<&[&str]>| NodeInfo {
            name: name.into(),
            running,
            enabled_plugins: plugins.map(|p| p.iter().map(|s| s.to_string()).collect()),
        };
        let nodes = [
            node("qa@h", true, None),
            node("qb@h", true, Some(&["rabbitmq_management", EVENT_PLUGIN])),
            node("qc@h", true, Some(&["rabbitmq_management"])),
            node("qd@h", false, Some(&[])),
        ];
        assert_eq!(without_event_plugin(&nodes), ["qc@h"]);
    }
}
