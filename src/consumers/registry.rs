//! Who consumes which queue, kept up to date from broker events and corrected by periodic
//! snapshots of the management API. Pure: events and snapshots go in, changes come out.
//!
//! Consumers are keyed by channel name and consumer tag, the one identity both sources share:
//! events name channels by pid (mapped through `channel.created`), the management API by name.
//! The management API lags by its statistics interval, so a snapshot neither removes a consumer
//! an event announced moments ago nor revives one an event just removed.

use std::collections::{BTreeMap, HashMap};

/// Snapshot lag tolerated before a snapshot may contradict an event.
pub const EVENT_GRACE_MS: i64 = 15_000;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct QueueKey {
    pub vhost: String,
    pub name: String,
}

impl QueueKey {
    pub fn new(vhost: impl Into<String>, name: impl Into<String>) -> Self {
        Self { vhost: vhost.into(), name: name.into() }
    }
}

/// One consumer on one queue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Consumer {
    pub queue: QueueKey,
    pub tag: String,
    /// Channel name, `peer:port -> host:port (n)`.
    pub channel: String,
    /// Address the broker sees the client connect from (a pod IP, unless NAT is in the way).
    pub peer_host: Option<String>,
    /// The client-provided connection name, if any.
    pub connection_name: Option<String>,
    pub prefetch: u32,
    pub ack_required: bool,
    /// Unix milliseconds when the consumer attached (or was first seen, for snapshots).
    pub since_ms: i64,
}

/// A change worth telling the gate about.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Change {
    Attached { consumer: Consumer },
    Detached { consumer: Consumer },
    QueueDeleted { queue: QueueKey },
}

impl Change {
    pub fn queue(&self) -> &QueueKey {
        match self {
            Self::Attached { consumer } | Self::Detached { consumer } => &consumer.queue,
            Self::QueueDeleted { queue } => queue,
        }
    }
}

/// What the event exchange says, already parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerEvent {
    ConnectionCreated { pid: String, name: String, user_provided_name: Option<String> },
    ConnectionClosed { pid: String },
    ChannelCreated { pid: String, name: String },
    ChannelClosed { pid: String },
    ConsumerCreated { channel_pid: String, queue: QueueKey, tag: String, prefetch: u32, ack_required: bool, at_ms: i64 },
    ConsumerDeleted { channel_pid: String, queue: QueueKey, tag: String },
    QueueDeleted { queue: QueueKey },
}

#[derive(Debug, Default)]
pub struct Registry {
    /// Connection name (`peer:port -> host:port`) by pid, and user-provided names by connection name.
    connections: HashMap<String, String>,
    user_names: HashMap<String, String>,
    channels: HashMap<String, String>,
    consumers: BTreeMap<(String, String), Consumer>,
    /// An event named a channel opened before the subscription: only a snapshot can place it.
    stale: bool,
    /// Consumers an event removed, and when: a lagging snapshot must not bring them back.
    removed: HashMap<(String, String), i64>,
    /// When each consumer was first seen through an event (snapshots may not yet list it).
    event_seen: HashMap<(String, String), i64>,
}

impl Registry {
    pub fn apply(&mut self, event: BrokerEvent, now_ms: i64) -> Vec<Change> {
        match event {
            BrokerEvent::ConnectionCreated { pid, name, user_provided_name } => {
                if let Some(user) = user_provided_name {
                    self.user_names.insert(name.clone(), user);
                }
                self.connections.insert(pid, name);
                vec![]
            }
            BrokerEvent::ConnectionClosed { pid } => {
                if let Some(name) = self.connections.remove(&pid) {
                    self.user_names.remove(&name);
                }
                vec![]
            }
            BrokerEvent::ChannelCreated { pid, name } => {
                self.channels.insert(pid, name);
                vec![]
            }
            BrokerEvent::ChannelClosed { pid } => {
                let Some(channel) = self.channels.remove(&pid) else { return vec![] };
                let keys: Vec<_> = self.consumers.keys().filter(|(c, _)| *c == channel).cloned().collect();
                keys.into_iter().filter_map(|k| self.remove(k, now_ms)).collect()
            }
            BrokerEvent::ConsumerCreated { channel_pid, queue, tag, prefetch, ack_required, at_ms } => {
                let Some(channel) = self.channels.get(&channel_pid).cloned() else {
                    self.stale = true;
                    return vec![];
                };
                let consumer = Consumer {
                    peer_host: peer_of(&channel),
                    connection_name: self.user_names.get(connection_of(&channel)).cloned(),
                    queue,
                    tag,
                    channel,
                    prefetch,
                    ack_required,
                    since_ms: at_ms,
                };
                let key = (consumer.channel.clone(), consumer.tag.clone());
                self.removed.remove(&key);
                self.event_seen.insert(key.clone(), now_ms);
                self.consumers.insert(key, consumer.clone());
                vec![Change::Attached { consumer }]
            }
            BrokerEvent::ConsumerDeleted { channel_pid, tag, .. } => {
                let Some(channel) = self.channels.get(&channel_pid).cloned() else {
                    self.stale = true;
                    return vec![];
                };
                self.remove((channel, tag), now_ms).into_iter().collect()
            }
            BrokerEvent::QueueDeleted { queue } => {
                let keys: Vec<_> =
                    self.consumers.iter().filter(|(_, c)| c.queue == queue).map(|(k, _)| k.clone()).collect();
                let mut changes: Vec<Change> = keys.into_iter().filter_map(|k| self.remove(k, now_ms)).collect();
                changes.push(Change::QueueDeleted { queue });
                changes
            }
        }
    }

    fn remove(&mut self, key: (String, String), now_ms: i64) -> Option<Change> {
        self.event_seen.remove(&key);
        self.removed.insert(key.clone(), now_ms);
        self.consumers.remove(&key).map(|consumer| Change::Detached { consumer })
    }

    /// Replaces the picture with a management API snapshot (every consumer of the broker, and
    /// user-provided connection names by connection name), within the event grace rules.
    pub fn resync(&mut self, snapshot: Vec<Consumer>, user_names: HashMap<String, String>, now_ms: i64) -> Vec<Change> {
        self.user_names.extend(user_names);
        self.removed.retain(|_, at| now_ms - *at < EVENT_GRACE_MS);
        self.event_seen.retain(|_, at| now_ms - *at < EVENT_GRACE_MS);
        self.stale = false;
        let mut changes = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for mut consumer in snapshot {
            let key = (consumer.channel.clone(), consumer.tag.clone());
            seen.insert(key.clone());
            if self.removed.contains_key(&key) {
                continue;
            }
            if consumer.connection_name.is_none() {
                consumer.connection_name = self.user_names.get(connection_of(&consumer.channel)).cloned();
            }
            match self.consumers.get_mut(&key) {
                Some(known) => {
                    // Keep the attach time we know; take the rest fresh.
                    consumer.since_ms = known.since_ms;
                    *known = consumer;
                }
                None => {
                    self.consumers.insert(key, consumer.clone());
                    changes.push(Change::Attached { consumer });
                }
            }
        }
        let gone: Vec<_> = self
            .consumers
            .keys()
            .filter(|k| !seen.contains(*k) && !self.event_seen.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(consumer) = self.consumers.remove(&key) {
                changes.push(Change::Detached { consumer });
            }
        }
        changes
    }

    /// True when events arrived that only a snapshot can place; cleared by the next snapshot.
    pub fn is_stale(&self) -> bool {
        self.stale
    }

    /// Consumers of one queue, oldest first.
    pub fn consumers_on(&self, queue: &QueueKey) -> Vec<Consumer> {
        let mut list: Vec<Consumer> = self.consumers.values().filter(|c| &c.queue == queue).cloned().collect();
        list.sort_by(|a, b| a.since_ms.cmp(&b.since_ms).then_with(|| a.tag.cmp(&b.tag)));
        list
    }
}

/// `10.0.0.5:43210 -> 10.0.0.9:5672 (1)` → `10.0.0.5`, IPv6 included (`::1:43210 -> ...`).
pub fn peer_of(channel_or_connection: &str) -> Option<String> {
    let client = channel_or_connection.split(" -> ").next()?;
    let (host, port) = client.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    Some(host.trim_matches(['[', ']']).to_owned()).filter(|h| !h.is_empty())
}

/// The connection part of a channel name: `a:1 -> b:2 (3)` → `a:1 -> b:2`.
pub fn connection_of(channel: &str) -> &str {
    match channel.rfind(" (") {
        Some(i) if channel.ends_with(')') => &channel[..i],
        _ => channel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CH: &str = "10.1.2.3:40000 -> 10.9.9.9:5672 (1)";

    fn q() -> QueueKey {
        QueueKey::new("/", "orders")
    }

    fn created(tag: &str, at: i64) -> BrokerEvent {
        BrokerEvent::ConsumerCreated {
            channel_pid: "<c1>".into(),
            queue: q(),
            tag: tag.into(),
            prefetch: 10,
            ack_required: true,
            at_ms: at,
        }
    }

    fn with_channel() -> Registry {
        let mut r = Registry::default();
        r.apply(
            BrokerEvent::ConnectionCreated {
                pid: "<k1>".into(),
                name: "10.1.2.3:40000 -> 10.9.9.9:5672".into(),
                user_provided_name: Some("worker-abc".into()),
            },
            0,
        );
        r.apply(BrokerEvent::ChannelCreated { pid: "<c1>".into(), name: CH.into() }, 0);
        r
    }

    fn snapshot_consumer(tag: &str, since: i64) -> Consumer {
        Consumer {
            queue: q(),
            tag: tag.into(),
            channel: CH.into(),
            peer_host: Some("10.1.2.3".into()),
            connection_name: None,
            prefetch: 10,
            ack_required: true,
            since_ms: since,
        }
    }

    #[test]
    fn events_map_consumers_to_peer_and_connection_name() {
        let mut r = with_channel();
        let changes = r.apply(created("t1", 1_000), 1_000);
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.peer_host.as_deref(), Some("10.1.2.3"));
        assert_eq!(consumer.connection_name.as_deref(), Some("worker-abc"));
        assert_eq!(consumer.since_ms, 1_000);
        assert_eq!(r.consumers_on(&q()).len(), 1);
        assert!(r.consumers_on(&QueueKey::new("/", "other")).is_empty());
        let changes =
            r.apply(BrokerEvent::ConsumerDeleted { channel_pid: "<c1>".into(), queue: q(), tag: "t1".into() }, 2_000);
        assert!(matches!(changes.as_slice(), [Change::Detached { .. }]));
        assert!(r.consumers_on(&q()).is_empty());
    }

    #[test]
    fn a_closed_channel_detaches_its_consumers() {
        let mut r = with_channel();
        r.apply(created("t1", 1), 1);
        r.apply(created("t2", 1), 1);
        let changes = r.apply(BrokerEvent::ChannelClosed { pid: "<c1>".into() }, 5);
        assert_eq!(changes.len(), 2);
        assert!(r.consumers_on(&q()).is_empty());
    }

    #[test]
    fn a_deleted_queue_detaches_everything_on_it_and_says_so() {
        let mut r = with_channel();
        r.apply(created("t1", 1), 1);
        let changes = r.apply(BrokerEvent::QueueDeleted { queue: q() }, 5);
        assert!(matches!(changes.as_slice(), [Change::Detached { .. }, Change::QueueDeleted { .. }]));
    }

    #[test]
    fn snapshots_add_missed_consumers_and_remove_vanished_ones() {
        let mut r = Registry::default();
        let changes = r.resync(
            vec![snapshot_consumer("t1", 100)],
            HashMap::from([("10.1.2.3:40000 -> 10.9.9.9:5672".into(), "worker-abc".into())]),
            100,
        );
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!() };
        assert_eq!(consumer.connection_name.as_deref(), Some("worker-abc"), "named through the connection list");
        let changes = r.resync(vec![], HashMap::new(), 200);
        assert!(matches!(changes.as_slice(), [Change::Detached { .. }]));
    }

    #[test]
    fn a_lagging_snapshot_neither_drops_a_fresh_consumer_nor_revives_a_removed_one() {
        let mut r = with_channel();
        r.apply(created("fresh", 10_000), 10_000);
        assert!(r.resync(vec![], HashMap::new(), 11_000).is_empty(), "seen by event 1 s ago, not yet in the snapshot");
        assert_eq!(r.consumers_on(&q()).len(), 1);
        r.apply(BrokerEvent::ConsumerDeleted { channel_pid: "<c1>".into(), queue: q(), tag: "fresh".into() }, 12_000);
        assert!(
            r.resync(vec![snapshot_consumer("fresh", 10_000)], HashMap::new(), 13_000).is_empty(),
            "removed by event 1 s ago"
        );
        assert!(r.consumers_on(&q()).is_empty());
        // Past the grace period the snapshot is the truth again.
        assert_eq!(
            r.resync(vec![snapshot_consumer("fresh", 10_000)], HashMap::new(), 12_000 + EVENT_GRACE_MS).len(),
            1
        );
        let later = 12_000 + 3 * EVENT_GRACE_MS;
        assert_eq!(r.resync(vec![], HashMap::new(), later).len(), 1);
    }

    #[test]
    fn snapshots_keep_the_known_attach_time() {
        let mut r = with_channel();
        r.apply(created("t1", 5_000), 5_000);
        r.resync(vec![snapshot_consumer("t1", 9_999)], HashMap::new(), 30_000);
        assert_eq!(r.consumers_on(&q())[0].since_ms, 5_000);
    }

    #[test]
    fn events_on_channels_opened_before_the_subscription_wait_for_the_snapshot() {
        let mut r = Registry::default();
        assert!(r.apply(created("t1", 1), 1).is_empty());
        assert!(r.consumers_on(&q()).is_empty());
        assert!(r.is_stale());
        assert_eq!(r.resync(vec![snapshot_consumer("t1", 50)], HashMap::new(), 50).len(), 1);
        assert!(!r.is_stale());
    }

    #[test]
    fn peers_and_connections_from_names() {
        assert_eq!(peer_of(CH).as_deref(), Some("10.1.2.3"));
        assert_eq!(peer_of("::1:43210 -> ::1:5672 (2)").as_deref(), Some("::1"));
        assert_eq!(peer_of("[fd00::5]:43210 -> [fd00::1]:5672").as_deref(), Some("fd00::5"));
        assert_eq!(peer_of("garbage"), None);
        assert_eq!(connection_of(CH), "10.1.2.3:40000 -> 10.9.9.9:5672");
        assert_eq!(connection_of("no channel number"), "no channel number");
    }
}
