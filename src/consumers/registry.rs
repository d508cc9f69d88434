//! Who consumes which queue, kept up to date from broker events and corrected by periodic
//! snapshots of the management API, one vhost at a time. Pure: events and snapshots go in,
//! changes come out.
//!
//! Only what some policy needs is kept: consumers of the queues of interest, and connections and
//! channels of their vhosts (events come for the whole broker). Connections and channels whose
//! close was missed (the subscription was down) go when a snapshot of their vhost no longer
//! lists their connection.
//!
//! Consumers are keyed by channel name and consumer tag, the one identity both sources share:
//! events name channels by pid (mapped through `channel.created`), the management API by name.
//! The management API lags by its statistics interval for new items (it drops removed ones at
//! once), so a snapshot neither removes a consumer an event announced moments ago nor revives
//! one an event just removed.
//!
//! Channels opened before the subscription have no known pid. A `consumer.deleted` on such a
//! channel removes the one known consumer with that queue and tag on a channel without a known
//! pid (and learns the pid); where two match, the vhost is snapshotted instead of guessing. A
//! `consumer.created` on one waits, unplaced, until a snapshot lists it (the tracker asks for
//! snapshots until then), and counts from its event's attach time. Events may come twice and in
//! any order (`consumer.deleted` after `channel.closed` or `connection.closed`, or twice when a
//! cluster node stops): every one is idempotent.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Snapshot lag tolerated before a snapshot may contradict an event.
pub const EVENT_GRACE_MS: i64 = 15_000;
/// How long a consumer created on an unknown channel waits for a snapshot to place it.
pub const PLACE_WITHIN_MS: i64 = 20_000;

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

impl std::fmt::Display for QueueKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.vhost == "/" { write!(f, "{}", self.name) } else { write!(f, "{}/{}", self.vhost, self.name) }
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
    /// When its connection was opened, where known (broker clock): a consumer on a connection
    /// older than a pod's IP cannot be that pod's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connected_ms: Option<i64>,
    /// The broker node its channel lives on (`rabbit@host`), where known: when that node goes
    /// down no event says so, and the consumer is gone with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// A change worth telling the gate about.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Change {
    Attached {
        consumer: Consumer,
    },
    Detached {
        consumer: Consumer,
    },
    QueueDeleted {
        queue: QueueKey,
    },
    /// How consumers are seen changed, for one vhost or (None) for all of them.
    Tracking {
        vhost: Option<String>,
    },
}

impl Change {
    /// The queue the change is about; None for tracking changes.
    pub fn queue(&self) -> Option<&QueueKey> {
        match self {
            Self::Attached { consumer } | Self::Detached { consumer } => Some(&consumer.queue),
            Self::QueueDeleted { queue } => Some(queue),
            Self::Tracking { .. } => None,
        }
    }
}

/// What the event exchange says, already parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerEvent {
    ConnectionCreated {
        pid: String,
        name: String,
        vhost: String,
        user_provided_name: Option<String>,
        connected_ms: Option<i64>,
    },
    ConnectionClosed {
        pid: String,
        name: Option<String>,
    },
    ChannelCreated {
        pid: String,
        name: String,
        vhost: String,
    },
    ChannelClosed {
        pid: String,
    },
    ConsumerCreated {
        channel_pid: String,
        queue: QueueKey,
        tag: String,
        prefetch: u32,
        ack_required: bool,
        at_ms: i64,
    },
    ConsumerDeleted {
        channel_pid: String,
        queue: QueueKey,
        tag: String,
    },
    QueueDeleted {
        queue: QueueKey,
    },
}

/// What a snapshot knows of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnectionFacts {
    pub user_provided_name: Option<String>,
    pub connected_ms: Option<i64>,
}

/// One vhost's consumers and connections as the management API listed them.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub vhost: String,
    pub consumers: Vec<Consumer>,
    /// By connection name (`peer:port -> host:port`); None when they could not be listed.
    pub connections: Option<HashMap<String, ConnectionFacts>>,
}

/// A connection or channel known by its pid (from its `*.created` event, or placed by a
/// snapshot), with its vhost and when it was learned.
#[derive(Debug, Clone)]
struct Pid {
    name: String,
    vhost: String,
    since_ms: i64,
}

/// How much the registry holds, for `/metrics` and the tests that show it does not grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    pub connections: usize,
    pub channels: usize,
    pub consumers: usize,
    /// Everything else: connection facts, recent removals, unplaced consumers, vhosts to resync.
    pub bookkeeping: usize,
}

type Key = (String, String);

/// A `consumer.created` on a channel whose pid is not known yet.
#[derive(Debug, Clone)]
struct Unplaced {
    channel_pid: String,
    queue: QueueKey,
    tag: String,
    at_ms: i64,
    until_ms: i64,
}

#[derive(Debug, Default)]
pub struct Registry {
    /// The queues some policy needs, and their vhosts.
    interest: BTreeSet<QueueKey>,
    vhosts: BTreeSet<String>,
    /// Connections by pid; facts by connection name.
    connections: HashMap<String, Pid>,
    connection_facts: HashMap<String, ConnectionFacts>,
    /// Channels by pid, and the pid by channel name.
    channels: HashMap<String, Pid>,
    channel_pids: HashMap<String, String>,
    consumers: BTreeMap<Key, Consumer>,
    by_queue: HashMap<QueueKey, BTreeSet<Key>>,
    /// Consumers an event removed, when, and in which vhost: a lagging snapshot must not bring
    /// them back.
    removed: HashMap<Key, (i64, String)>,
    /// Queue and tag of consumers removed while unplaced or on a channel without a known pid.
    removed_unplaced: HashMap<(QueueKey, String), i64>,
    /// When each consumer was first seen through an event (snapshots may not yet list it).
    event_seen: HashMap<Key, i64>,
    unplaced: Vec<Unplaced>,
    /// Vhosts only a snapshot can settle (an unplaced consumer, an ambiguous deletion, a consumer
    /// whose connection's age is unknown).
    resync_wanted: BTreeSet<String>,
}

impl Registry {
    /// Keeps consumers of `queues` only, and connections and channels of their vhosts; lets go
    /// of everything else at once.
    pub fn set_interest(&mut self, queues: BTreeSet<QueueKey>) {
        self.vhosts = queues.iter().map(|q| q.vhost.clone()).collect();
        self.interest = queues;
        let dropped: Vec<Key> =
            self.consumers.iter().filter(|(_, c)| !self.interest.contains(&c.queue)).map(|(k, _)| k.clone()).collect();
        for key in dropped {
            self.forget_consumer(&key);
        }
        let interest = &self.interest;
        let vhosts = &self.vhosts;
        self.by_queue.retain(|q, _| interest.contains(q));
        self.unplaced.retain(|u| interest.contains(&u.queue));
        self.removed_unplaced.retain(|(q, _), _| interest.contains(q));
        self.removed.retain(|_, (_, vhost)| vhosts.contains(vhost));
        self.resync_wanted.retain(|v| vhosts.contains(v));
        self.connections.retain(|_, c| vhosts.contains(&c.vhost));
        self.channels.retain(|_, c| vhosts.contains(&c.vhost));
        let channels = &self.channels;
        self.channel_pids.retain(|_, pid| channels.contains_key(pid));
        self.prune_facts();
    }

    fn wanted(&self, queue: &QueueKey) -> bool {
        self.interest.contains(queue)
    }

    pub fn apply(&mut self, event: BrokerEvent, now_ms: i64) -> Vec<Change> {
        match event {
            BrokerEvent::ConnectionCreated { pid, name, vhost, user_provided_name, connected_ms } => {
                if self.vhosts.contains(&vhost) {
                    self.connection_facts.insert(name.clone(), ConnectionFacts { user_provided_name, connected_ms });
                    self.connections.insert(pid, Pid { name, vhost, since_ms: now_ms });
                }
                vec![]
            }
            BrokerEvent::ConnectionClosed { pid, name } => {
                let Some(name) = self.connections.remove(&pid).map(|c| c.name).or(name) else { return vec![] };
                self.drop_connection(&name, now_ms)
            }
            BrokerEvent::ChannelCreated { pid, name, vhost } => {
                if self.vhosts.contains(&vhost) {
                    self.channel_pids.insert(name.clone(), pid.clone());
                    self.channels.insert(pid, Pid { name, vhost, since_ms: now_ms });
                }
                vec![]
            }
            BrokerEvent::ChannelClosed { pid } => {
                self.unplaced.retain(|u| u.channel_pid != pid);
                let Some(channel) = self.channels.remove(&pid).map(|c| c.name) else { return vec![] };
                self.channel_pids.remove(&channel);
                let keys: Vec<_> = self.consumers.keys().filter(|(c, _)| *c == channel).cloned().collect();
                keys.into_iter().filter_map(|k| self.remove(k, now_ms)).collect()
            }
            BrokerEvent::ConsumerCreated { queue, .. } | BrokerEvent::ConsumerDeleted { queue, .. }
                if !self.wanted(&queue) =>
            {
                vec![]
            }
            BrokerEvent::ConsumerCreated { channel_pid, queue, tag, prefetch, ack_required, at_ms } => {
                // The event's time is the broker's clock; minAttachedSeconds runs on ours. A
                // broker clock behind ours must not shorten it: never earlier than its arrival.
                let at_ms = at_ms.max(now_ms);
                let Some(channel) = self.channels.get(&channel_pid).map(|c| c.name.clone()) else {
                    let known = |u: &Unplaced| u.channel_pid == channel_pid && u.queue == queue && u.tag == tag;
                    if !self.unplaced.iter().any(known) {
                        self.resync_wanted.insert(queue.vhost.clone());
                        self.unplaced.push(Unplaced {
                            channel_pid,
                            queue,
                            tag,
                            at_ms,
                            until_ms: now_ms + PLACE_WITHIN_MS,
                        });
                    }
                    return vec![];
                };
                let facts = self.connection_facts.get(connection_of(&channel)).cloned().unwrap_or_default();
                let consumer = Consumer {
                    node: node_of_pid(&channel_pid),
                    peer_host: peer_of(&channel),
                    connection_name: facts.user_provided_name,
                    connected_ms: facts.connected_ms,
                    queue,
                    tag,
                    channel,
                    prefetch,
                    ack_required,
                    since_ms: at_ms,
                };
                if consumer.connected_ms.is_none() {
                    // Until a snapshot says when its connection opened, it counts for no pod.
                    self.resync_wanted.insert(consumer.queue.vhost.clone());
                }
                let key = (consumer.channel.clone(), consumer.tag.clone());
                self.removed.remove(&key);
                self.event_seen.insert(key.clone(), now_ms);
                let known = self.consumers.get(&key).is_some_and(|c| c.queue == consumer.queue);
                self.insert(key, consumer.clone());
                // The same event twice changes nothing.
                if known { vec![] } else { vec![Change::Attached { consumer }] }
            }
            BrokerEvent::ConsumerDeleted { channel_pid, queue, tag } => {
                if let Some(channel) = self.channels.get(&channel_pid).map(|c| c.name.clone()) {
                    return self.remove_in((channel, tag), Some(&queue.vhost), now_ms).into_iter().collect();
                }
                let before = self.unplaced.len();
                self.unplaced.retain(|u| !(u.channel_pid == channel_pid && u.queue == queue && u.tag == tag));
                let was_unplaced = self.unplaced.len() != before;
                let candidates = self.unbound_with(&queue, &tag);
                match candidates.as_slice() {
                    [key] => {
                        let key = key.clone();
                        // The pid is now known: later events on this channel take the fast path.
                        self.bind_pid(channel_pid, &key.0, &queue.vhost, now_ms);
                        self.removed_unplaced.insert((queue, tag), now_ms);
                        self.remove(key, now_ms).into_iter().collect()
                    }
                    [] => {
                        if was_unplaced {
                            self.removed_unplaced.insert((queue, tag), now_ms);
                        }
                        vec![]
                    }
                    _ => {
                        self.resync_wanted.insert(queue.vhost.clone());
                        vec![]
                    }
                }
            }
            BrokerEvent::QueueDeleted { queue } if !self.wanted(&queue) => vec![],
            BrokerEvent::QueueDeleted { queue } => {
                self.unplaced.retain(|u| u.queue != queue);
                let keys: Vec<_> = self.by_queue.get(&queue).into_iter().flatten().cloned().collect();
                let mut changes: Vec<Change> = keys.into_iter().filter_map(|k| self.remove(k, now_ms)).collect();
                changes.push(Change::QueueDeleted { queue });
                changes
            }
        }
    }

    fn bind_pid(&mut self, pid: String, channel: &str, vhost: &str, now_ms: i64) {
        self.channel_pids.insert(channel.to_owned(), pid.clone());
        self.channels.insert(pid, Pid { name: channel.to_owned(), vhost: vhost.to_owned(), since_ms: now_ms });
    }

    /// A connection gone: its channels, facts and consumers with it.
    fn drop_connection(&mut self, name: &str, now_ms: i64) -> Vec<Change> {
        self.connection_facts.remove(name);
        let channels: Vec<String> = self.channel_pids.keys().filter(|c| connection_of(c) == name).cloned().collect();
        for channel in &channels {
            if let Some(pid) = self.channel_pids.remove(channel) {
                self.channels.remove(&pid);
            }
        }
        let keys: Vec<Key> =
            self.consumers.keys().filter(|(channel, _)| connection_of(channel) == name).cloned().collect();
        keys.into_iter().filter_map(|k| self.remove(k, now_ms)).collect()
    }

    /// Facts are kept for connections known by pid or carrying a consumer, no others.
    fn prune_facts(&mut self) {
        let mut needed: std::collections::HashSet<&str> = self.connections.values().map(|c| c.name.as_str()).collect();
        needed.extend(self.consumers.keys().map(|(channel, _)| connection_of(channel)));
        self.connection_facts.retain(|name, _| needed.contains(name.as_str()));
    }

    pub fn footprint(&self) -> Footprint {
        Footprint {
            connections: self.connections.len(),
            channels: self.channels.len(),
            consumers: self.consumers.len(),
            bookkeeping: self.connection_facts.len()
                + self.channel_pids.len()
                + self.by_queue.len()
                + self.removed.len()
                + self.removed_unplaced.len()
                + self.event_seen.len()
                + self.unplaced.len()
                + self.resync_wanted.len(),
        }
    }

    /// Known consumers with this queue and tag on channels whose pid is not known.
    fn unbound_with(&self, queue: &QueueKey, tag: &str) -> Vec<Key> {
        self.by_queue
            .get(queue)
            .into_iter()
            .flatten()
            .filter(|(channel, t)| t == tag && !self.channel_pids.contains_key(channel))
            .cloned()
            .collect()
    }

    fn insert(&mut self, key: Key, consumer: Consumer) {
        if let Some(old) = self.consumers.get(&key)
            && old.queue != consumer.queue
            && let Some(keys) = self.by_queue.get_mut(&old.queue)
        {
            keys.remove(&key);
        }
        self.by_queue.entry(consumer.queue.clone()).or_default().insert(key.clone());
        self.consumers.insert(key, consumer);
    }

    fn remove(&mut self, key: Key, now_ms: i64) -> Option<Change> {
        self.remove_in(key, None, now_ms)
    }

    /// Removes a consumer an event says is gone, remembering the removal in its vhost (or
    /// `vhost`, for one not known yet).
    fn remove_in(&mut self, key: Key, vhost: Option<&str>, now_ms: i64) -> Option<Change> {
        let consumer = self.forget_consumer(&key);
        if let Some(vhost) = consumer.as_ref().map(|c| c.queue.vhost.as_str()).or(vhost) {
            self.removed.insert(key, (now_ms, vhost.to_owned()));
        }
        consumer.map(|consumer| Change::Detached { consumer })
    }

    fn forget_consumer(&mut self, key: &Key) -> Option<Consumer> {
        self.event_seen.remove(key);
        let consumer = self.consumers.remove(key)?;
        if let Some(keys) = self.by_queue.get_mut(&consumer.queue) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_queue.remove(&consumer.queue);
            }
        }
        Some(consumer)
    }

    /// Replaces one vhost's picture with a management API snapshot, within the event grace
    /// rules, and places what waited for it.
    pub fn resync(&mut self, snapshot: Snapshot, now_ms: i64) -> Vec<Change> {
        let Snapshot { vhost, consumers, connections } = snapshot;
        if let Some(listed) = connections {
            self.drop_unlisted(&vhost, &listed, now_ms);
            self.connection_facts.extend(listed);
        }
        self.removed.retain(|_, (at, _)| now_ms - *at < EVENT_GRACE_MS);
        self.removed_unplaced.retain(|_, at| now_ms - *at < EVENT_GRACE_MS);
        self.event_seen.retain(|_, at| now_ms - *at < EVENT_GRACE_MS);
        let placed = self.place_unplaced(&vhost, &consumers, now_ms);
        self.unplaced.retain(|u| u.until_ms > now_ms);
        let mut changes = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let consumers: Vec<Consumer> =
            consumers.into_iter().filter(|c| c.queue.vhost == vhost && self.interest.contains(&c.queue)).collect();
        for mut consumer in consumers {
            let key = (consumer.channel.clone(), consumer.tag.clone());
            seen.insert(key.clone());
            if self.removed.contains_key(&key) {
                continue;
            }
            let unbound = !self.channel_pids.contains_key(&consumer.channel);
            let facts = self.connection_facts.get(connection_of(&consumer.channel)).cloned().unwrap_or_default();
            if consumer.connection_name.is_none() {
                consumer.connection_name = facts.user_provided_name;
            }
            consumer.connected_ms = consumer.connected_ms.or(facts.connected_ms);
            match self.consumers.get_mut(&key) {
                Some(known) => {
                    // Keep the attach time we know; take the rest fresh.
                    consumer.since_ms = known.since_ms;
                    *known = consumer;
                }
                None => {
                    // Removed by an event while its channel was unknown: this snapshot may
                    // predate the removal.
                    if unbound && self.removed_unplaced.contains_key(&(consumer.queue.clone(), consumer.tag.clone())) {
                        continue;
                    }
                    if let Some(at) = placed.get(&key) {
                        consumer.since_ms = *at;
                    }
                    self.insert(key, consumer.clone());
                    changes.push(Change::Attached { consumer });
                }
            }
        }
        let gone: Vec<_> = self
            .consumers
            .iter()
            .filter(|(k, c)| c.queue.vhost == vhost && !seen.contains(*k) && !self.event_seen.contains_key(*k))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(consumer) = self.consumers.get(&key).cloned() {
                self.remove(key, now_ms);
                // A vanished consumer is not an event's removal: a later snapshot may list it.
                self.removed.remove(&(consumer.channel.clone(), consumer.tag.clone()));
                changes.push(Change::Detached { consumer });
            }
        }
        // Read again soon while something waits for a snapshot: a consumer to place, or one
        // whose connection's age is unknown (not listed yet, or the listing failed).
        let unsettled = self.unplaced.iter().any(|u| u.queue.vhost == vhost)
            || self.consumers.values().any(|c| c.queue.vhost == vhost && c.connected_ms.is_none());
        if unsettled {
            self.resync_wanted.insert(vhost);
        } else {
            self.resync_wanted.remove(&vhost);
        }
        self.prune_facts();
        changes
    }

    /// Connections and channels of `vhost`, learned before this snapshot's grace period, whose
    /// connection the snapshot does not list: their close events were missed.
    fn drop_unlisted(&mut self, vhost: &str, listed: &HashMap<String, ConnectionFacts>, now_ms: i64) {
        let stale = |p: &Pid, connection: &str| {
            p.vhost == vhost && now_ms - p.since_ms >= EVENT_GRACE_MS && !listed.contains_key(connection)
        };
        self.connections.retain(|_, c| !stale(c, &c.name));
        let gone: Vec<String> = self
            .channels
            .iter()
            .filter(|(_, c)| stale(c, connection_of(&c.name)))
            .map(|(pid, _)| pid.clone())
            .collect();
        for pid in gone {
            if let Some(c) = self.channels.remove(&pid) {
                self.channel_pids.remove(&c.name);
            }
        }
    }

    /// Binds the pid of each unplaced consumer that this snapshot lists unambiguously (exactly
    /// one new consumer with its queue and tag on a channel without a known pid); returns their
    /// attach times from the events.
    fn place_unplaced(&mut self, vhost: &str, consumers: &[Consumer], now_ms: i64) -> HashMap<Key, i64> {
        let mut placed = Vec::new();
        for (i, u) in self.unplaced.iter().enumerate().filter(|(_, u)| u.queue.vhost == vhost) {
            let candidates: Vec<&Consumer> = consumers
                .iter()
                .filter(|c| c.queue == u.queue && c.tag == u.tag)
                .filter(|c| !self.channel_pids.contains_key(&c.channel))
                .filter(|c| !self.consumers.contains_key(&(c.channel.clone(), c.tag.clone())))
                .collect();
            match candidates.as_slice() {
                [one] => placed.push((i, one.channel.clone())),
                [] => {}
                // Several new consumers with this tag: each stays unbound, counted from the snapshot.
                _ => placed.push((i, String::new())),
            }
        }
        let mut attached = HashMap::new();
        for (i, channel) in placed.into_iter().rev() {
            let u = self.unplaced.remove(i);
            if !channel.is_empty() {
                self.bind_pid(u.channel_pid, &channel, vhost, now_ms);
                attached.insert((channel, u.tag), u.at_ms);
            }
        }
        attached
    }

    /// Forgets every consumer whose channel lived on a node that is down (a crashed node sends
    /// no events for what it held), and what waited to be placed there.
    pub fn nodes_down(&mut self, down: &BTreeSet<String>, now_ms: i64) -> Vec<Change> {
        let on_down = |pid: &str| node_of_pid(pid).is_some_and(|n| down.contains(&n));
        self.unplaced.retain(|u| !on_down(&u.channel_pid));
        let dead_pids: Vec<String> = self.channels.keys().filter(|pid| on_down(pid)).cloned().collect();
        let mut dead_channels = BTreeSet::new();
        for pid in dead_pids {
            if let Some(channel) = self.channels.remove(&pid) {
                self.channel_pids.remove(&channel.name);
                dead_channels.insert(channel.name);
            }
        }
        self.connections.retain(|pid, _| !on_down(pid));
        let keys: Vec<Key> = self
            .consumers
            .iter()
            .filter(|(k, c)| c.node.as_ref().is_some_and(|n| down.contains(n)) || dead_channels.contains(&k.0))
            .map(|(k, _)| k.clone())
            .collect();
        let changes = keys.into_iter().filter_map(|k| self.remove(k, now_ms)).collect();
        self.prune_facts();
        changes
    }

    /// Consumers of one queue, oldest first.
    pub fn consumers_on(&self, queue: &QueueKey) -> Vec<Consumer> {
        let mut list: Vec<Consumer> =
            self.by_queue.get(queue).into_iter().flatten().filter_map(|k| self.consumers.get(k)).cloned().collect();
        list.sort_by(|a, b| a.since_ms.cmp(&b.since_ms).then_with(|| a.tag.cmp(&b.tag)));
        list
    }

    /// Vhosts waiting for a snapshot (unplaced consumers, ambiguous deletions).
    pub fn resync_wanted(&self) -> &BTreeSet<String> {
        &self.resync_wanted
    }
}

/// `<rabbit@host.example.1796318000.1773.0>` → `rabbit@host.example`: an Erlang pid's text ends in
/// three numbers after the node's name.
pub fn node_of_pid(pid: &str) -> Option<String> {
    let inner = pid.strip_prefix('<')?.strip_suffix('>')?;
    let mut parts = inner.rsplitn(4, '.');
    let numbers: Vec<&str> = parts.by_ref().take(3).collect();
    let node = parts.next()?;
    (numbers.len() == 3 && numbers.iter().all(|n| n.parse::<u64>().is_ok()) && node.contains('@'))
        .then(|| node.to_owned())
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

    const CONN: &str = "10.1.2.3:40000 -> 10.9.9.9:5672";
    const CH: &str = "10.1.2.3:40000 -> 10.9.9.9:5672 (1)";
    const OLD_CH: &str = "10.1.2.7:41000 -> 10.9.9.9:5672 (1)";

    fn q() -> QueueKey {
        QueueKey::new("/", "orders")
    }

    fn created_on(pid: &str, tag: &str, at: i64) -> BrokerEvent {
        BrokerEvent::ConsumerCreated {
            channel_pid: pid.into(),
            queue: q(),
            tag: tag.into(),
            prefetch: 10,
            ack_required: true,
            at_ms: at,
        }
    }

    fn created(tag: &str, at: i64) -> BrokerEvent {
        created_on("<c1>", tag, at)
    }

    fn deleted_on(pid: &str, tag: &str) -> BrokerEvent {
        BrokerEvent::ConsumerDeleted { channel_pid: pid.into(), queue: q(), tag: tag.into() }
    }

    /// A registry that keeps `orders` in `/` and in `other-vhost`.
    fn registry() -> Registry {
        let mut r = Registry::default();
        r.set_interest(BTreeSet::from([q(), QueueKey::new("other-vhost", "orders")]));
        r
    }

    fn with_channel() -> Registry {
        let mut r = registry();
        r.apply(
            BrokerEvent::ConnectionCreated {
                pid: "<k1>".into(),
                name: CONN.into(),
                vhost: "/".into(),
                user_provided_name: Some("worker-abc".into()),
                connected_ms: Some(900),
            },
            0,
        );
        r.apply(BrokerEvent::ChannelCreated { pid: "<c1>".into(), name: CH.into(), vhost: "/".into() }, 0);
        r
    }

    fn listed(channel: &str, tag: &str, since: i64) -> Consumer {
        Consumer {
            queue: q(),
            tag: tag.into(),
            channel: channel.into(),
            peer_host: peer_of(channel),
            connection_name: None,
            prefetch: 10,
            ack_required: true,
            since_ms: since,
            connected_ms: Some(0),
            node: None,
        }
    }

    /// A consumer as the management API lists it: its connection's age comes from the
    /// connections listing.
    fn undated(channel: &str, tag: &str, since: i64) -> Consumer {
        Consumer { connected_ms: None, ..listed(channel, tag, since) }
    }

    fn snapshot(consumers: Vec<Consumer>) -> Snapshot {
        Snapshot { vhost: "/".into(), consumers, connections: None }
    }

    fn tags(r: &Registry) -> Vec<String> {
        r.consumers_on(&q()).into_iter().map(|c| c.tag).collect()
    }

    #[test]
    fn events_map_consumers_to_peer_connection_name_and_connection_time() {
        let mut r = with_channel();
        let changes = r.apply(created("t1", 1_000), 1_000);
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.peer_host.as_deref(), Some("10.1.2.3"));
        assert_eq!(consumer.connection_name.as_deref(), Some("worker-abc"));
        assert_eq!((consumer.since_ms, consumer.connected_ms), (1_000, Some(900)));
        assert!(r.consumers_on(&QueueKey::new("/", "other")).is_empty());
        assert!(matches!(r.apply(deleted_on("<c1>", "t1"), 2_000).as_slice(), [Change::Detached { .. }]));
        assert!(tags(&r).is_empty());
    }

    /// The event's timestamp is the broker's clock: one 30 s behind the operator's would have
    /// counted a consumer attached just now as attached for 30 s already.
    #[test]
    fn an_attach_time_is_never_earlier_than_the_event_arrived() {
        let mut r = with_channel();
        let changes = r.apply(created("behind", 10_000), 40_000);
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.since_ms, 40_000, "when it arrived, not the broker's earlier clock");
        let changes = r.apply(created("ahead", 50_000), 45_000);
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.since_ms, 50_000, "a clock ahead only lengthens the wait");
    }

    #[test]
    fn a_consumer_whose_connection_is_not_listed_keeps_its_vhost_due_until_a_snapshot_dates_it() {
        let mut r = registry();
        // The connections listing failed: the consumer is known, its connection's age is not.
        r.resync(snapshot(vec![undated(CH, "t1", 1_000)]), 1_000);
        assert_eq!(r.consumers_on(&q())[0].connected_ms, None);
        assert!(r.resync_wanted().contains("/"), "read again soon, not in 30 s");
        let mut dated = snapshot(vec![undated(CH, "t1", 2_000)]);
        dated.connections =
            Some(HashMap::from([(CONN.into(), ConnectionFacts { user_provided_name: None, connected_ms: Some(900) })]));
        r.resync(dated, 2_000);
        assert_eq!(r.consumers_on(&q())[0].connected_ms, Some(900));
        assert!(r.resync_wanted().is_empty(), "settled");
        // The same through an event on a channel whose connection was never seen.
        let mut r = registry();
        r.apply(BrokerEvent::ChannelCreated { pid: "<c1>".into(), name: CH.into(), vhost: "/".into() }, 0);
        r.apply(created("t1", 1_000), 1_000);
        assert_eq!(r.consumers_on(&q())[0].connected_ms, None);
        assert!(r.resync_wanted().contains("/"));
    }

    #[test]
    fn only_the_queues_of_interest_and_their_vhosts_are_kept_and_let_go_with_the_interest() {
        let mut r = with_channel();
        let elsewhere = |pid: &str, vhost: &str| BrokerEvent::ChannelCreated {
            pid: pid.into(),
            name: format!("10.9.0.1:1 -> 10.9.9.9:5672 ({pid})"),
            vhost: vhost.into(),
        };
        r.apply(elsewhere("<x1>", "billing"), 0);
        let unwatched = BrokerEvent::ConsumerCreated {
            channel_pid: "<c1>".into(),
            queue: QueueKey::new("/", "not-ours"),
            tag: "t".into(),
            prefetch: 1,
            ack_required: true,
            at_ms: 1,
        };
        assert!(r.apply(unwatched, 1).is_empty(), "a queue no policy names");
        assert!(r.apply(BrokerEvent::QueueDeleted { queue: QueueKey::new("/", "not-ours") }, 1).is_empty());
        r.apply(created("t1", 1), 1);
        assert_eq!(r.footprint().connections, 1);
        assert_eq!((r.footprint().channels, r.footprint().consumers), (1, 1), "billing's channel is not kept");
        r.set_interest(BTreeSet::new());
        assert_eq!(r.footprint(), Footprint::default(), "nothing left: {r:?}");
    }

    #[test]
    fn connections_whose_close_was_missed_go_when_a_snapshot_no_longer_lists_them() {
        let mut r = with_channel();
        r.apply(created("t1", 1), 1);
        let listing =
            |names: &[&str]| Some(names.iter().map(|n| (n.to_string(), ConnectionFacts::default())).collect());
        // Listed: kept. Not listed but learned moments ago: kept (the listing lags).
        r.resync(
            Snapshot { vhost: "/".into(), consumers: vec![listed(CH, "t1", 1)], connections: listing(&[CONN]) },
            5_000,
        );
        r.resync(
            Snapshot { vhost: "/".into(), consumers: vec![listed(CH, "t1", 1)], connections: listing(&[]) },
            6_000,
        );
        assert_eq!((r.footprint().connections, r.footprint().channels), (1, 1));
        // No longer listed after the grace period: its close event was missed.
        r.resync(Snapshot { vhost: "/".into(), consumers: vec![], connections: listing(&[]) }, 20_000);
        let f = r.footprint();
        assert_eq!((f.connections, f.channels, f.consumers), (0, 0, 0), "{r:?}");
        // A listing that failed proves nothing.
        let mut r = with_channel();
        r.resync(Snapshot { vhost: "/".into(), consumers: vec![], connections: None }, 20_000);
        assert_eq!((r.footprint().connections, r.footprint().channels), (1, 1));
    }

    #[test]
    fn the_same_event_twice_changes_nothing_the_second_time() {
        let mut r = with_channel();
        assert_eq!(r.apply(created("t1", 1), 1).len(), 1);
        assert!(r.apply(created("t1", 1), 2).is_empty(), "a duplicate consumer.created");
        assert_eq!(r.apply(deleted_on("<c1>", "t1"), 3).len(), 1);
        assert!(r.apply(deleted_on("<c1>", "t1"), 4).is_empty(), "a duplicate consumer.deleted");
        assert!(r.resync_wanted().is_empty());
    }

    #[test]
    fn a_closed_channel_or_connection_detaches_its_consumers_before_their_deleted_events() {
        let mut r = with_channel();
        r.apply(created("t1", 1), 1);
        r.apply(created("t2", 1), 1);
        assert_eq!(r.apply(BrokerEvent::ChannelClosed { pid: "<c1>".into() }, 5).len(), 2);
        assert!(tags(&r).is_empty());
        // The consumer.deleted events arrive after channel.closed: nothing left to do, no guess.
        assert!(r.apply(deleted_on("<c1>", "t1"), 6).is_empty());
        assert!(r.resync_wanted().is_empty());

        let mut r = with_channel();
        r.apply(created("t1", 1), 1);
        let closed = BrokerEvent::ConnectionClosed { pid: "<k1>".into(), name: Some(CONN.into()) };
        assert_eq!(r.apply(closed.clone(), 5).len(), 1, "connection.closed before channel.closed");
        assert!(r.apply(BrokerEvent::ChannelClosed { pid: "<c1>".into() }, 6).is_empty());
        assert!(r.apply(deleted_on("<c1>", "t1"), 7).is_empty());
        assert!(r.apply(closed, 8).is_empty());
        assert!(tags(&r).is_empty() && r.resync_wanted().is_empty());
    }

    /// In a cluster, a consumer's events come from its queue's node and its channel's from the
    /// channel's node: they can arrive in any order.
    #[test]
    fn a_consumer_created_event_arriving_after_its_channel_closed_attaches_nothing() {
        let mut r = with_channel();
        assert!(r.apply(BrokerEvent::ChannelClosed { pid: "<c1>".into() }, 5).is_empty());
        assert!(r.apply(created("late", 1), 6).is_empty(), "no attach for a closed channel");
        assert!(r.apply(deleted_on("<c1>", "late"), 7).is_empty());
        assert!(tags(&r).is_empty());
        // A snapshot that no longer lists it settles the rest.
        assert!(r.resync(snapshot(vec![]), 2_000).is_empty());
        assert!(tags(&r).is_empty() && r.resync_wanted().is_empty());
    }

    #[test]
    fn a_deleted_queue_detaches_everything_on_it_and_says_so() {
        let mut r = with_channel();
        r.apply(created("t1", 1), 1);
        let changes = r.apply(BrokerEvent::QueueDeleted { queue: q() }, 5);
        assert!(matches!(changes.as_slice(), [Change::Detached { .. }, Change::QueueDeleted { .. }]));
    }

    #[test]
    fn snapshots_add_missed_consumers_and_remove_vanished_ones_of_their_vhost_only() {
        let mut r = registry();
        let mut first = snapshot(vec![undated(CH, "t1", 100)]);
        first.connections = Some(HashMap::from([(
            CONN.into(),
            ConnectionFacts { user_provided_name: Some("worker-abc".into()), connected_ms: Some(40) },
        )]));
        let other = QueueKey::new("other-vhost", "orders");
        let mut elsewhere = listed(OLD_CH, "t9", 100);
        elsewhere.queue = other.clone();
        r.resync(Snapshot { vhost: "other-vhost".into(), consumers: vec![elsewhere], ..Default::default() }, 100);
        let changes = r.resync(first, 100);
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.connection_name.as_deref(), Some("worker-abc"), "named through the connection list");
        assert_eq!(consumer.connected_ms, Some(40));
        let changes = r.resync(snapshot(vec![]), 200);
        assert!(matches!(changes.as_slice(), [Change::Detached { .. }]));
        assert_eq!(r.consumers_on(&other).len(), 1, "another vhost's snapshot is not this one's");
    }

    #[test]
    fn a_lagging_snapshot_neither_drops_a_fresh_consumer_nor_revives_a_removed_one() {
        let mut r = with_channel();
        r.apply(created("fresh", 10_000), 10_000);
        assert!(r.resync(snapshot(vec![]), 11_000).is_empty(), "seen by event 1 s ago, not yet in the snapshot");
        assert_eq!(tags(&r), ["fresh"]);
        r.apply(deleted_on("<c1>", "fresh"), 12_000);
        assert!(r.resync(snapshot(vec![listed(CH, "fresh", 10_000)]), 13_000).is_empty(), "removed by event 1 s ago");
        assert!(tags(&r).is_empty());
        // Past the grace period the snapshot is the truth again.
        assert_eq!(r.resync(snapshot(vec![listed(CH, "fresh", 10_000)]), 12_000 + EVENT_GRACE_MS).len(), 1);
        assert_eq!(r.resync(snapshot(vec![]), 12_000 + 3 * EVENT_GRACE_MS).len(), 1);
    }

    #[test]
    fn snapshots_keep_the_known_attach_time() {
        let mut r = with_channel();
        r.apply(created("t1", 5_000), 5_000);
        r.resync(snapshot(vec![listed(CH, "t1", 9_999)]), 30_000);
        assert_eq!(r.consumers_on(&q())[0].since_ms, 5_000);
    }

    /// A channel opened before the subscription: its consumer is placed by the next snapshot
    /// that lists it, counted from the event, and its pid is learned for the events after.
    #[test]
    fn a_consumer_created_on_an_unknown_channel_waits_for_a_snapshot_then_takes_the_fast_path() {
        let mut r = registry();
        assert!(r.apply(created_on("<old>", "t1", 1_000), 1_000).is_empty(), "not attached until placed");
        assert!(r.apply(created_on("<old>", "t1", 1_000), 1_001).is_empty(), "twice: still one wait");
        assert_eq!(r.resync_wanted().iter().collect::<Vec<_>>(), ["/"]);
        assert!(r.resync(snapshot(vec![]), 2_000).is_empty(), "the statistics lag: not listed yet");
        assert!(!r.resync_wanted().is_empty(), "keeps asking");
        let changes = r.resync(snapshot(vec![listed(OLD_CH, "t1", 4_000)]), 4_000);
        let [Change::Attached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.since_ms, 1_000, "attached when the event said, not when listed");
        assert!(r.resync_wanted().is_empty());
        assert!(matches!(r.apply(deleted_on("<old>", "t1"), 5_000).as_slice(), [Change::Detached { .. }]));
        r.apply(created_on("<old>", "t2", 6_000), 6_000);
        assert_eq!(tags(&r), ["t2"], "the pid is known now: millisecond path");
        assert_eq!(r.apply(BrokerEvent::ChannelClosed { pid: "<old>".into() }, 7_000).len(), 1);
    }

    #[test]
    fn an_unplaced_consumer_is_given_up_after_its_deadline() {
        let mut r = registry();
        r.apply(created_on("<old>", "t1", 0), 0);
        r.resync(snapshot(vec![]), PLACE_WITHIN_MS + 1);
        assert!(r.resync_wanted().is_empty());
        // Listed later, it comes in as any snapshot consumer does.
        assert_eq!(r.resync(snapshot(vec![listed(OLD_CH, "t1", 0)]), PLACE_WITHIN_MS + 2).len(), 1);
        assert_eq!(r.consumers_on(&q())[0].since_ms, 0);
    }

    #[test]
    fn a_consumer_leaving_an_unknown_channel_is_removed_at_once_by_queue_and_tag() {
        let mut r = with_channel();
        r.resync(snapshot(vec![listed(OLD_CH, "t1", 100), listed(OLD_CH, "t2", 100)]), 100);
        r.apply(created("t1", 200), 200); // same tag, on a channel whose pid is known
        let changes = r.apply(deleted_on("<old>", "t1"), 300);
        let [Change::Detached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.channel, OLD_CH, "the one on a channel without a known pid");
        assert!(r.apply(deleted_on("<old>", "t1"), 301).is_empty(), "twice");
        assert_eq!(r.apply(BrokerEvent::ChannelClosed { pid: "<old>".into() }, 400).len(), 1, "pid learned: t2 goes");
        assert_eq!(tags(&r), ["t1"]);
        assert!(r.resync_wanted().is_empty());
        assert!(
            r.resync(snapshot(vec![listed(CH, "t1", 200), listed(OLD_CH, "t1", 100)]), 500).is_empty(),
            "not revived"
        );
    }

    #[test]
    fn two_matching_consumers_on_unknown_channels_are_settled_by_a_snapshot_not_a_guess() {
        let mut r = registry();
        let other = "10.1.2.8:42000 -> 10.9.9.9:5672 (1)";
        r.resync(snapshot(vec![listed(OLD_CH, "worker", 100), listed(other, "worker", 100)]), 100);
        assert!(r.apply(deleted_on("<old>", "worker"), 200).is_empty());
        assert_eq!(r.resync_wanted().iter().collect::<Vec<_>>(), ["/"]);
        let changes = r.resync(snapshot(vec![listed(other, "worker", 100)]), 300);
        let [Change::Detached { consumer }] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!(consumer.channel, OLD_CH);
        assert!(r.resync_wanted().is_empty());
    }

    #[test]
    fn a_consumer_gone_before_it_was_placed_is_not_revived_by_a_snapshot_that_predates_its_removal() {
        let mut r = registry();
        r.apply(created_on("<old>", "t1", 1_000), 1_000);
        assert!(r.apply(deleted_on("<old>", "t1"), 1_500).is_empty());
        assert!(r.resync(snapshot(vec![listed(OLD_CH, "t1", 2_000)]), 2_000).is_empty());
        assert!(tags(&r).is_empty());
    }

    #[test]
    fn peers_and_connections_from_names() {
        assert_eq!(peer_of(CH).as_deref(), Some("10.1.2.3"));
        assert_eq!(peer_of("::1:43210 -> ::1:5672 (2)").as_deref(), Some("::1"));
        assert_eq!(peer_of("[fd00::5]:43210 -> [fd00::1]:5672").as_deref(), Some("fd00::5"));
        assert_eq!(peer_of("garbage"), None);
        assert_eq!(connection_of(CH), CONN);
        assert_eq!(connection_of("no channel number"), "no channel number");
        assert_eq!(QueueKey::new("/", "orders").to_string(), "orders");
        assert_eq!(QueueKey::new("shop", "orders").to_string(), "shop/orders");
    }

    #[test]
    fn node_names_come_from_pid_text() {
        assert_eq!(node_of_pid("<qb@localhost.1796318000.1773.0>").as_deref(), Some("qb@localhost"));
        assert_eq!(
            node_of_pid("<rabbit@mq-0.mq.shop.svc.1796318000.1773.0>").as_deref(),
            Some("rabbit@mq-0.mq.shop.svc")
        );
        for not_a_pid in ["<c1>", "qb@localhost.1.2.3", "<qb@localhost.1.x.3>", "<localhost.1.2.3>"] {
            assert_eq!(node_of_pid(not_a_pid), None, "{not_a_pid}");
        }
    }

    /// A crashed node sends no `consumer.deleted`: its consumers go when the node is seen down,
    /// from events and snapshots alike, and nothing on the other nodes moves.
    #[test]
    fn a_node_seen_down_takes_its_consumers_with_it_and_only_those() {
        let mut r = registry();
        let on = |node: &str, n: u32| format!("<{node}@localhost.1796318000.{n}.0>");
        for (node, n, name) in
            [("qa", 1, "10.0.0.1:1 -> 10.0.0.9:5701 (1)"), ("qb", 2, "10.0.0.2:1 -> 10.0.0.9:5702 (1)")]
        {
            r.apply(BrokerEvent::ChannelCreated { pid: on(node, n), name: name.into(), vhost: "/".into() }, 0);
            r.apply(created_on(&on(node, n), &format!("events-{node}"), 10), 10);
        }
        let mut from_snapshot = listed("10.0.0.3:1 -> 10.0.0.9:5702 (1)", "snapshot-qb", 5);
        from_snapshot.node = Some("qb@localhost".into());
        let mut elsewhere = listed("10.0.0.4:1 -> 10.0.0.9:5703 (1)", "snapshot-qc", 5);
        elsewhere.node = Some("qc@localhost".into());
        r.resync(snapshot(vec![from_snapshot, elsewhere]), 20);
        r.apply(created_on(&on("qb", 3), "unplaced-qb", 30), 30);
        assert_eq!(tags(&r), ["snapshot-qb", "snapshot-qc", "events-qa", "events-qb"]);

        let down = BTreeSet::from(["qb@localhost".to_string()]);
        let gone: Vec<String> = r
            .nodes_down(&down, 1_000)
            .into_iter()
            .map(|c| match c {
                Change::Detached { consumer } => consumer.tag,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(gone, ["events-qb", "snapshot-qb"]);
        assert_eq!(tags(&r), ["snapshot-qc", "events-qa"]);
        assert!(r.nodes_down(&down, 1_100).is_empty(), "seen down twice changes nothing");
        // A snapshot read before the crash, answered after it, does not bring them back...
        let mut stale = listed("10.0.0.2:1 -> 10.0.0.9:5702 (1)", "events-qb", 5);
        stale.node = Some("qb@localhost".into());
        assert!(r.resync(snapshot(vec![stale, r.consumers_on(&q())[0].clone()]), 1_200).is_empty());
        // ... and a late duplicate consumer.deleted from the dead node finds nothing.
        assert!(r.apply(deleted_on(&on("qb", 2), "events-qb"), 1_300).is_empty());
    }
}
