//! Everything that talks to RabbitMQ: AMQP (declarations) and the management API (policies,
//! queue details). Adapters only; decisions live in [`crate::settings`] and [`crate::converge`].

pub mod amqp;
pub mod management;
pub mod refusal;
pub mod uri;

use crate::consumers::ConsumerTracker;
use amqp::AmqpEndpoint;
use management::{ManagementClient, ManagementError};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use uri::BrokerUri;

/// The vhost of `amq.rabbitmq.event` (the plugin's default `event_exchange.vhost`).
pub const EVENT_VHOST: &str = "/";

/// What a broker Secret holds.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerCredentials {
    /// `uri`: amqp[s]://user:pass@host:port/vhost
    pub uri: String,
    /// `managementUri`: http[s]://[user:pass@]host:port
    pub management_uri: Option<String>,
    /// `caCert`: PEM bundle trusted for amqps:// and https:// (default: the system's roots)
    pub ca_cert: Option<String>,
    /// `addresses`: `host:port,host:port` of a cluster's nodes, tried in order
    pub addresses: Option<String>,
}

impl std::fmt::Debug for BrokerCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BrokerCredentials(..)")
    }
}

/// One broker endpoint: its AMQP connection and its management API.
pub struct Broker {
    pub uri: BrokerUri,
    /// The CA trusted for this broker (Secret key caCert).
    pub ca_cert: Option<String>,
    pub amqp: AmqpEndpoint,
    pub management: ManagementClient,
}

impl Broker {
    pub fn vhost(&self) -> &str {
        self.uri.vhost()
    }
}

/// An endpoint's address and credentials (hashed) and its trusted CA.
type EndpointKey = (u64, Option<String>);

/// How long an endpoint nobody has asked for is kept: every policy reconciles at least every
/// 20 s, so an endpoint idle this long has been left (its Secret rotated, its policies gone).
pub const IDLE_ENDPOINT: Duration = Duration::from_secs(40);

/// A pooled endpoint or tracker and when it was last asked for.
struct Pooled<T> {
    value: Arc<T>,
    used: Instant,
}

/// Endpoints shared by all policies: one AMQP connection per distinct broker address and
/// credentials, and one consumer tracker (one event subscription, on a connection of its own)
/// per broker server. Endpoints and trackers nobody asked for in [`IDLE_ENDPOINT`] are let go
/// by [`BrokerPool::sweep`], which closes their connections once their last user is done.
pub struct BrokerPool {
    connection_name: String,
    endpoints: Mutex<HashMap<EndpointKey, Pooled<Broker>>>,
    trackers: Mutex<HashMap<EndpointKey, Pooled<ConsumerTracker>>>,
}

impl BrokerPool {
    /// `connection_name` is what the broker's connection list shows for the operator.
    pub fn new(connection_name: impl Into<String>) -> Self {
        Self { connection_name: connection_name.into(), endpoints: Mutex::default(), trackers: Mutex::default() }
    }

    pub fn get(&self, uri: BrokerUri, ca_cert: Option<String>) -> Result<Arc<Broker>, ManagementError> {
        let key = (uri.endpoint_key(), ca_cert.clone());
        let mut endpoints = lock(&self.endpoints);
        if let Some(pooled) = endpoints.get_mut(&key) {
            pooled.used = Instant::now();
            return Ok(pooled.value.clone());
        }
        let broker = Arc::new(self.open(uri, ca_cert, self.connection_name.clone())?);
        endpoints.insert(key, Pooled { value: broker.clone(), used: Instant::now() });
        Ok(broker)
    }

    fn open(&self, uri: BrokerUri, ca_cert: Option<String>, name: String) -> Result<Broker, ManagementError> {
        let management = ManagementClient::new(uri.management().clone(), ca_cert.as_deref())?;
        let amqp = AmqpEndpoint::new(uri.clone(), ca_cert.clone(), name);
        Ok(Broker { uri, ca_cert, amqp, management })
    }

    /// The consumer tracker of the server behind `uri`, started on first use. It subscribes in
    /// the vhost the event exchange lives in ([`EVENT_VHOST`]), on a connection of its own (a
    /// connection-level error of a declaration must not silence the events, nor a burst of
    /// events hold up declarations), and sees every vhost.
    pub fn tracker(&self, uri: &BrokerUri, ca_cert: Option<String>) -> Result<Arc<ConsumerTracker>, ManagementError> {
        let events_uri = uri.clone().with_vhost(EVENT_VHOST);
        let key = (events_uri.endpoint_key(), ca_cert.clone());
        let mut trackers = lock(&self.trackers);
        if let Some(pooled) = trackers.get_mut(&key) {
            pooled.used = Instant::now();
            return Ok(pooled.value.clone());
        }
        let broker = Arc::new(self.open(events_uri, ca_cert, format!("{} (events)", self.connection_name))?);
        let tracker = ConsumerTracker::start(broker);
        trackers.insert(key, Pooled { value: tracker.clone(), used: Instant::now() });
        Ok(tracker)
    }

    /// Lets go of the endpoints and trackers nobody asked for since `unused_since`; returns how
    /// many. Their connections close when the last operation holding them is done.
    pub fn sweep(&self, unused_since: Instant) -> usize {
        let mut endpoints = lock(&self.endpoints);
        let before = endpoints.len();
        endpoints.retain(|_, p| p.used >= unused_since);
        let mut trackers = lock(&self.trackers);
        let before_trackers = trackers.len();
        trackers.retain(|_, p| p.used >= unused_since);
        let swept = before - endpoints.len() + before_trackers - trackers.len();
        if swept > 0 {
            tracing::info!(swept, "let go of broker endpoints no policy uses any more");
        }
        swept
    }

    /// Each connection (credentials left out; `events` for a tracker's) and whether it is open
    /// now. Where two endpoints share an address (credentials just rotated), the one last asked
    /// for speaks for it.
    pub fn connection_states(&self) -> Vec<(String, &'static str, bool)> {
        let mut latest: HashMap<(String, &'static str), (Instant, bool)> = HashMap::new();
        let mut note = |display: String, purpose: &'static str, used: Instant, up: bool| {
            let slot = latest.entry((display, purpose)).or_insert((used, up));
            if used >= slot.0 {
                *slot = (used, up);
            }
        };
        for p in lock(&self.endpoints).values() {
            note(p.value.amqp.display(), "declarations", p.used, p.value.amqp.is_connected());
        }
        for p in lock(&self.trackers).values() {
            let amqp = &p.value.broker().amqp;
            note(amqp.display(), "events", p.used, amqp.is_connected());
        }
        latest.into_iter().map(|((display, purpose), (_, up))| (display, purpose, up)).collect()
    }

    /// Management API requests sent across all endpoints and trackers.
    pub fn management_requests(&self) -> u64 {
        let endpoints: u64 = lock(&self.endpoints).values().map(|p| p.value.management.requests()).sum();
        let trackers: u64 = lock(&self.trackers).values().map(|p| p.value.broker().management.requests()).sum();
        endpoints + trackers
    }

    /// AMQP connections opened across all endpoints and trackers.
    pub fn connections_opened(&self) -> u64 {
        let endpoints: u64 = lock(&self.endpoints).values().map(|p| p.value.amqp.connections_opened()).sum();
        let trackers: u64 = lock(&self.trackers).values().map(|p| p.value.broker().amqp.connections_opened()).sum();
        endpoints + trackers
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
