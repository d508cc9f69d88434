//! One consumer tracker per broker server, shared by every policy that counts consumers there.
//! Each subscribes on a connection of its own: a connection-level error of a declaration must
//! not silence the events, nor a burst of events hold up declarations.

use super::ConsumerTracker;
use crate::broker::{Broker, EVENT_VHOST, Pool, latest_states, management::ManagementError, uri::BrokerUri};
use std::{sync::Arc, time::Instant};

pub struct TrackerPool {
    connection_name: String,
    trackers: Pool<ConsumerTracker>,
}

impl TrackerPool {
    /// The trackers' connections show as `<connection_name> (events)` on the broker.
    pub fn new(connection_name: &str) -> Self {
        Self { connection_name: format!("{connection_name} (events)"), trackers: Pool::default() }
    }

    /// The consumer tracker of the server behind `uri`, started on first use. It subscribes in
    /// the vhost the event exchange lives in ([`EVENT_VHOST`]) and sees every vhost.
    pub fn tracker(&self, uri: &BrokerUri, ca_cert: Option<String>) -> Result<Arc<ConsumerTracker>, ManagementError> {
        let events_uri = uri.clone().with_vhost(EVENT_VHOST);
        let key = (events_uri.endpoint_key(), ca_cert.clone());
        self.trackers.get_or_make(key, || {
            Ok(ConsumerTracker::start(Arc::new(Broker::open_for_events(
                events_uri,
                ca_cert,
                self.connection_name.clone(),
            )?)))
        })
    }

    /// Lets go of the trackers nobody asked for since `unused_since`; returns how many. Their
    /// connections close once the gate lets go of them too.
    pub fn sweep(&self, unused_since: Instant) -> usize {
        let swept = self.trackers.sweep(unused_since);
        if swept > 0 {
            tracing::info!(swept, "let go of consumer trackers no policy uses any more");
        }
        swept
    }

    /// Each events connection and whether it is open now (see [`latest_states`]).
    pub fn connection_states(&self) -> Vec<(String, bool)> {
        let mut all = Vec::new();
        self.trackers.each(|t, used| all.push((t.broker().amqp.display(), used, t.broker().amqp.is_connected())));
        latest_states(all)
    }

    /// What each tracker holds, by broker address (see [`ConsumerTracker::footprint`]).
    pub fn footprints(&self) -> Vec<(String, Vec<(&'static str, usize)>)> {
        let mut all = Vec::new();
        self.trackers.each(|t, _| {
            let (held, vhosts, queues) = t.footprint();
            let counts = vec![
                ("connections", held.connections),
                ("channels", held.channels),
                ("consumers", held.consumers),
                ("bookkeeping", held.bookkeeping),
                ("vhosts", vhosts),
                ("queues", queues),
            ];
            all.push((t.broker().amqp.display(), counts));
        });
        all
    }

    /// Management API requests sent across all trackers.
    pub fn management_requests(&self) -> u64 {
        let mut n = 0;
        self.trackers.each(|t, _| n += t.broker().management.requests());
        n
    }

    /// AMQP connections opened across all trackers.
    pub fn connections_opened(&self) -> u64 {
        let mut n = 0;
        self.trackers.each(|t, _| n += t.broker().amqp.connections_opened());
        n
    }
}
