//! Everything that talks to RabbitMQ: AMQP (declarations) and the management API (policies,
//! queue details). Adapters only; decisions live in [`crate::settings`] and [`crate::converge`].

pub mod amqp;
pub mod body;
pub mod listing;
pub mod management;
pub mod prometheus;
pub mod refusal;
pub mod uri;

use crate::sync::lock;
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
    /// `prometheusUri`: http[s]://host:port of rabbitmq_prometheus, one per node (default: each
    /// management host on port 15692, 15691 with TLS)
    pub prometheus_uri: Option<String>,
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
    /// An endpoint of its own, its connection named `connection_name`.
    pub fn open(uri: BrokerUri, ca_cert: Option<String>, connection_name: String) -> Result<Self, ManagementError> {
        Self::open_with(uri, ca_cert, connection_name, amqp::FRAME_MAX)
    }

    /// As [`Self::open`], for an event subscription: its connection takes the broker's largest
    /// frame ([`amqp::BROKER_FRAME_MAX`]).
    pub fn open_for_events(
        uri: BrokerUri,
        ca_cert: Option<String>,
        connection_name: String,
    ) -> Result<Self, ManagementError> {
        Self::open_with(uri, ca_cert, connection_name, amqp::BROKER_FRAME_MAX)
    }

    fn open_with(
        uri: BrokerUri,
        ca_cert: Option<String>,
        connection_name: String,
        frame_max: u32,
    ) -> Result<Self, ManagementError> {
        let management = ManagementClient::new(uri.management().clone(), ca_cert.as_deref())?;
        let amqp = AmqpEndpoint::new(uri.clone(), ca_cert.clone(), connection_name, frame_max);
        Ok(Self { uri, ca_cert, amqp, management })
    }

    pub fn vhost(&self) -> &str {
        self.uri.vhost()
    }
}

/// An endpoint's address and credentials (hashed) and its trusted CA.
pub type EndpointKey = (u64, Option<String>);

/// How long an endpoint nobody has asked for is kept: every policy reconciles at least every
/// minute (a Ready one every 20 s, one waiting on a conflict every 60 s: `pass`), so an
/// endpoint idle this long has been left (its Secret rotated, its policies gone).
pub const IDLE_ENDPOINT: Duration = Duration::from_secs(150);

/// Shared values by endpoint, each with when it was last asked for, so that those nobody asked
/// for in [`IDLE_ENDPOINT`] can be let go ([`Self::sweep`]).
pub struct Pool<T> {
    items: Mutex<HashMap<EndpointKey, (Arc<T>, Instant)>>,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Self { items: Mutex::default() }
    }
}

impl<T> Pool<T> {
    /// The value for `key`, made by `make` the first time.
    pub fn get_or_make<E>(&self, key: EndpointKey, make: impl FnOnce() -> Result<Arc<T>, E>) -> Result<Arc<T>, E> {
        let mut items = lock(&self.items);
        if let Some((value, used)) = items.get_mut(&key) {
            *used = Instant::now();
            return Ok(value.clone());
        }
        let value = make()?;
        items.insert(key, (value.clone(), Instant::now()));
        Ok(value)
    }

    /// Lets go of the values nobody asked for since `unused_since` and nobody else holds (a
    /// tracker the gate still counts consumers through stays: made again, it would forget
    /// every attach time); returns how many.
    pub fn sweep(&self, unused_since: Instant) -> usize {
        let mut items = lock(&self.items);
        let before = items.len();
        items.retain(|_, (value, used)| *used >= unused_since || Arc::strong_count(value) > 1);
        before - items.len()
    }

    /// Each value with when it was last asked for.
    pub fn each(&self, mut f: impl FnMut(&T, Instant)) {
        for (value, used) in lock(&self.items).values() {
            f(value, *used);
        }
    }
}

/// Each connection's address (credentials left out) and whether it is open now, from
/// `(address, last asked for, open)` of every pooled endpoint: where two share an address
/// (credentials just rotated), the one last asked for speaks for it.
pub fn latest_states(all: impl IntoIterator<Item = (String, Instant, bool)>) -> Vec<(String, bool)> {
    let mut latest: HashMap<String, (Instant, bool)> = HashMap::new();
    for (display, used, up) in all {
        let slot = latest.entry(display).or_insert((used, up));
        if used >= slot.0 {
            *slot = (used, up);
        }
    }
    latest.into_iter().map(|(display, (_, up))| (display, up)).collect()
}

/// Endpoints shared by all policies: one AMQP connection per distinct broker address and
/// credentials. Endpoints nobody asked for in [`IDLE_ENDPOINT`] are let go by
/// [`BrokerPool::sweep`], which closes their connections once their last user is done.
pub struct BrokerPool {
    connection_name: String,
    endpoints: Pool<Broker>,
}

impl BrokerPool {
    /// `connection_name` is what the broker's connection list shows for the operator.
    pub fn new(connection_name: impl Into<String>) -> Self {
        Self { connection_name: connection_name.into(), endpoints: Pool::default() }
    }

    pub fn connection_name(&self) -> &str {
        &self.connection_name
    }

    pub fn get(&self, uri: BrokerUri, ca_cert: Option<String>) -> Result<Arc<Broker>, ManagementError> {
        let key = (uri.endpoint_key(), ca_cert.clone());
        self.endpoints.get_or_make(key, || Ok(Arc::new(Broker::open(uri, ca_cert, self.connection_name.clone())?)))
    }

    /// Lets go of the endpoints nobody asked for since `unused_since`; returns how many. Their
    /// connections close when the last operation holding them is done.
    pub fn sweep(&self, unused_since: Instant) -> usize {
        let swept = self.endpoints.sweep(unused_since);
        if swept > 0 {
            tracing::info!(swept, "let go of broker endpoints no policy uses any more");
        }
        swept
    }

    /// Each declarations connection and whether it is open now (see [`latest_states`]).
    pub fn connection_states(&self) -> Vec<(String, bool)> {
        let mut all = Vec::new();
        self.endpoints.each(|b, used| all.push((b.amqp.display(), used, b.amqp.is_connected())));
        latest_states(all)
    }

    /// Management API requests sent across all endpoints.
    pub fn management_requests(&self) -> u64 {
        let mut n = 0;
        self.endpoints.each(|b, _| n += b.management.requests());
        n
    }

    /// AMQP connections opened across all endpoints.
    pub fn connections_opened(&self) -> u64 {
        let mut n = 0;
        self.endpoints.each(|b, _| n += b.amqp.connections_opened());
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_lets_go_of_what_nobody_asked_for_unless_someone_still_holds_it() {
        let pool: Pool<String> = Pool::default();
        let key = |n: u64| (n, None);
        let left = pool.get_or_make::<()>(key(1), || Ok(Arc::new("left".into()))).unwrap();
        let held = pool.get_or_make::<()>(key(2), || Ok(Arc::new("held".into()))).unwrap();
        drop(left);
        // Nobody asked for either since: the one still held (a tracker the gate counts
        // consumers through) stays, so the next ask gets it back, not a new one.
        assert_eq!(pool.sweep(Instant::now() + Duration::from_secs(1)), 1);
        let again = pool.get_or_make::<()>(key(2), || Ok(Arc::new("new".into()))).unwrap();
        assert!(Arc::ptr_eq(&held, &again));
        let remade = pool.get_or_make::<()>(key(1), || Ok(Arc::new("new".into()))).unwrap();
        assert_eq!(remade.as_str(), "new");
    }
}
