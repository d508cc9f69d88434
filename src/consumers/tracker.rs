//! One live view of a broker's consumers: a subscription to `amq.rabbitmq.event` for attach and
//! detach within milliseconds, and a periodic management API snapshot for truth (events are lost
//! across reconnects). Without the event exchange plugin it polls, and says so.

use super::{
    events,
    registry::{Change, Consumer, QueueKey, Registry},
};
use crate::broker::{
    Broker,
    amqp::AmqpError,
    management::ConsumerInfo,
    refusal::{ACCESS_REFUSED, NOT_FOUND},
};
use futures::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, Weak},
    time::Duration,
};
use tokio::sync::{Notify, broadcast, watch};

/// The exchange the event plugin publishes to (in the default vhost).
pub const EVENT_EXCHANGE: &str = "amq.rabbitmq.event";
/// Snapshot interval while events flow, and while polling without them.
pub const RESYNC_WITH_EVENTS: Duration = Duration::from_secs(30);
pub const RESYNC_POLLING: Duration = Duration::from_secs(2);
/// Wait before subscribing again after the plugin was found missing.
const PLUGIN_RETRY: Duration = Duration::from_secs(60);

/// How the tracker currently learns about consumers; shown in status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracking {
    /// Events flow, and snapshots succeed.
    Events,
    /// No events (the reason says why); snapshots every couple of seconds.
    Polling(String),
    /// Neither events nor snapshots: the broker cannot be seen.
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

#[derive(Debug, Clone, Default)]
struct Health {
    events: Option<Result<(), String>>,
    snapshot: Option<Result<(), String>>,
}

pub struct ConsumerTracker {
    broker: Arc<Broker>,
    registry: Mutex<Registry>,
    changes: broadcast::Sender<Change>,
    health: Mutex<Health>,
    synced: watch::Sender<bool>,
    resync: Notify,
    /// Queues whose deletion matters, and whether the last snapshot saw them.
    watched: Mutex<HashMap<QueueKey, bool>>,
    deleted: Mutex<HashSet<QueueKey>>,
}

impl ConsumerTracker {
    /// Starts tracking through `broker` (an endpoint on the vhost the event exchange lives in).
    pub fn start(broker: Arc<Broker>) -> Arc<Self> {
        let (changes, _) = broadcast::channel(4096);
        let tracker = Arc::new(Self {
            broker,
            registry: Mutex::default(),
            changes,
            health: Mutex::default(),
            synced: watch::channel(false).0,
            resync: Notify::new(),
            watched: Mutex::default(),
            deleted: Mutex::default(),
        });
        tokio::spawn(events_loop(Arc::downgrade(&tracker)));
        tokio::spawn(resync_loop(Arc::downgrade(&tracker)));
        tracker
    }

    /// Attach, detach and deletion changes, as they happen.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    pub fn consumers_on(&self, queue: &QueueKey) -> Vec<Consumer> {
        lock(&self.registry).consumers_on(queue)
    }

    pub fn tracking(&self) -> Tracking {
        let h = lock(&self.health).clone();
        match (h.events, h.snapshot) {
            (_, None) => Tracking::Starting,
            (Some(Ok(())), Some(Ok(()))) => Tracking::Events,
            (events, Some(Ok(()))) => Tracking::Polling(match events {
                Some(Err(why)) => why,
                _ => "event subscription starting".into(),
            }),
            (_, Some(Err(why))) => Tracking::Unavailable(why),
        }
    }

    /// Waits until the first snapshot is in (or `timeout` passes).
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut rx = self.synced.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s)).await.is_ok_and(|r| r.is_ok())
    }

    /// Asks for a snapshot now (after reconnecting, or when an event named an unknown channel).
    pub fn request_resync(&self) {
        self.resync.notify_one();
    }

    /// Registers a queue whose deletion should be noticed even without events.
    pub fn watch_queue(&self, queue: QueueKey) {
        lock(&self.watched).entry(queue).or_insert(false);
    }

    /// True once per deletion of `queue` seen since the last call.
    pub fn take_deleted(&self, queue: &QueueKey) -> bool {
        lock(&self.deleted).remove(queue)
    }

    fn publish(&self, changes: Vec<Change>) {
        for change in changes {
            if let Change::QueueDeleted { queue } = &change
                && lock(&self.watched).contains_key(queue)
            {
                lock(&self.deleted).insert(queue.clone());
            }
            let _ = self.changes.send(change);
        }
    }

    fn set_events(&self, state: Result<(), String>) {
        lock(&self.health).events = Some(state);
    }

    async fn snapshot(&self) -> Result<(), String> {
        let m = &self.broker.management;
        let (consumers, names) = tokio::try_join!(m.consumers(), m.connection_names()).map_err(|e| e.to_string())?;
        let watched: Vec<QueueKey> = lock(&self.watched).keys().cloned().collect();
        let mut present = HashSet::new();
        for vhost in watched.iter().map(|q| q.vhost.clone()).collect::<HashSet<_>>() {
            for name in m.queue_names(&vhost).await.map_err(|e| e.to_string())? {
                present.insert(QueueKey::new(vhost.clone(), name));
            }
        }
        let now = now_ms();
        let snapshot = consumers.into_iter().map(|c| from_info(c, now)).collect();
        let mut changes = lock(&self.registry).resync(snapshot, names, now);
        // Without events, a watched queue that was there and is gone was deleted.
        for (queue, seen) in lock(&self.watched).iter_mut() {
            let now_present = present.contains(queue);
            if *seen && !now_present {
                changes.push(Change::QueueDeleted { queue: queue.clone() });
            }
            *seen = now_present;
        }
        self.publish(changes);
        Ok(())
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
    }
}

async fn resync_loop(tracker: Weak<ConsumerTracker>) {
    loop {
        let Some(t) = tracker.upgrade() else { return };
        let result = t.snapshot().await;
        if let Err(e) = &result {
            tracing::warn!(broker = %t.broker.uri.display(), error = %e, "consumer snapshot failed");
        }
        lock(&t.health).snapshot = Some(result);
        t.synced.send_replace(true);
        let interval = if t.tracking() == Tracking::Events { RESYNC_WITH_EVENTS } else { RESYNC_POLLING };
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = t.resync.notified() => {}
        }
    }
}

async fn events_loop(tracker: Weak<ConsumerTracker>) {
    let mut failures = 0u32;
    loop {
        let outcome = subscribe(&tracker).await;
        if tracker.strong_count() == 0 {
            return;
        }
        let wait = match outcome {
            // The consumer stream ended: the connection went away.
            Ok(()) => Duration::from_millis(500),
            Err(SubscribeError::PluginMissing(why)) => {
                if let Some(t) = tracker.upgrade() {
                    tracing::warn!(broker = %t.broker.uri.display(), %why, "no broker events; polling the management API");
                    t.set_events(Err(why));
                }
                PLUGIN_RETRY
            }
            Err(SubscribeError::Connection(why)) => {
                failures += 1;
                if let Some(t) = tracker.upgrade() {
                    t.set_events(Err(why));
                }
                crate::broker::amqp::Backoff::delay_after(failures)
            }
        };
        tokio::time::sleep(wait).await;
    }
}

enum SubscribeError {
    PluginMissing(String),
    Connection(String),
}

/// Subscribes and feeds the registry until the stream ends (or the tracker is dropped).
async fn subscribe(tracker: &Weak<ConsumerTracker>) -> Result<(), SubscribeError> {
    let Some(t) = tracker.upgrade() else { return Ok(()) };
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
    let ch = amqp.dedicated_channel().await.map_err(err)?;
    let private = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
    let q = ch.queue_declare("".into(), private, FieldTable::default()).await.map_err(|e| err(amqp.classify(e)))?;
    for key in events::BINDINGS {
        ch.queue_bind(
            q.name().clone(),
            EVENT_EXCHANGE.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| err(amqp.classify(e)))?;
    }
    let no_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut deliveries = ch
        .basic_consume(q.name().clone(), "queueguard-events".into(), no_ack, FieldTable::default())
        .await
        .map_err(|e| err(amqp.classify(e)))?;
    t.set_events(Ok(()));
    // Whatever happened before the subscription only a snapshot can tell.
    t.request_resync();
    drop(t);
    while let Some(delivery) = deliveries.next().await {
        let Some(t) = tracker.upgrade() else { return Ok(()) };
        let Ok(delivery) = delivery else { break };
        let Some(headers) = delivery.properties.headers() else { continue };
        let Some(event) = events::parse(delivery.routing_key.as_str(), headers) else { continue };
        let (changes, stale) = {
            let mut registry = lock(&t.registry);
            let changes = registry.apply(event, now_ms());
            (changes, registry.is_stale())
        };
        t.publish(changes);
        if stale {
            t.request_resync();
        }
    }
    if let Some(t) = tracker.upgrade() {
        t.set_events(Err("event subscription lost; reconnecting".into()));
    }
    Ok(())
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
