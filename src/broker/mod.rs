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

/// Endpoints shared by all policies: one AMQP connection per distinct broker address, and one
/// consumer tracker (one event subscription) per broker server.
pub struct BrokerPool {
    connection_name: String,
    endpoints: Mutex<HashMap<EndpointKey, Arc<Broker>>>,
    trackers: Mutex<HashMap<EndpointKey, Arc<ConsumerTracker>>>,
}

impl BrokerPool {
    /// `connection_name` is what the broker's connection list shows for the operator.
    pub fn new(connection_name: impl Into<String>) -> Self {
        Self { connection_name: connection_name.into(), endpoints: Mutex::default(), trackers: Mutex::default() }
    }

    pub fn get(&self, uri: BrokerUri, ca_cert: Option<String>) -> Result<Arc<Broker>, ManagementError> {
        let key = (uri.endpoint_key(), ca_cert.clone());
        let mut endpoints = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(broker) = endpoints.get(&key) {
            return Ok(broker.clone());
        }
        let management = ManagementClient::new(uri.management().clone(), ca_cert.as_deref())?;
        let amqp = AmqpEndpoint::new(uri.clone(), ca_cert.clone(), self.connection_name.clone());
        let broker = Arc::new(Broker { uri, ca_cert, amqp, management });
        endpoints.insert(key, broker.clone());
        Ok(broker)
    }

    /// The consumer tracker of the server behind `uri`, started on first use. It subscribes in
    /// the vhost the event exchange lives in ([`EVENT_VHOST`]) and sees every vhost.
    pub fn tracker(&self, uri: &BrokerUri, ca_cert: Option<String>) -> Result<Arc<ConsumerTracker>, ManagementError> {
        let events_uri = uri.clone().with_vhost(EVENT_VHOST);
        let key = (events_uri.endpoint_key(), ca_cert.clone());
        if let Some(t) = self.trackers.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(t.clone());
        }
        let broker = self.get(events_uri, ca_cert)?;
        let mut trackers = self.trackers.lock().unwrap_or_else(|p| p.into_inner());
        Ok(trackers.entry(key).or_insert_with(|| ConsumerTracker::start(broker)).clone())
    }

    /// Each endpoint (credentials left out) and whether its AMQP connection is open now.
    pub fn connection_states(&self) -> Vec<(String, bool)> {
        let endpoints = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        endpoints.values().map(|b| (b.amqp.display(), b.amqp.is_connected())).collect()
    }

    /// Management API requests sent across all endpoints.
    pub fn management_requests(&self) -> u64 {
        let endpoints = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        endpoints.values().map(|b| b.management.requests()).sum()
    }

    /// AMQP connections opened across all endpoints.
    pub fn connections_opened(&self) -> u64 {
        let endpoints = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        endpoints.values().map(|b| b.amqp.connections_opened()).sum()
    }
}
