//! The operator's own HTTP endpoints: `/metrics` (Prometheus text), `/healthz` (the process
//! answers) and `/readyz` (a standby waiting for the lease, or a leader whose watches have
//! synced).

use crate::{broker::BrokerPool, consumers::TrackerPool, metrics::Metrics};
use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

/// What the probes report.
#[derive(Debug, Default)]
pub struct Health {
    leader_election: bool,
    leading: AtomicBool,
    synced: AtomicBool,
}

impl Health {
    pub fn new(leader_election: bool) -> Self {
        Self { leader_election, ..Default::default() }
    }

    pub fn set_leading(&self, leading: bool) {
        self.leading.store(leading, Ordering::Relaxed);
    }

    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::Relaxed);
    }

    /// Ready, and why (or why not).
    pub fn readiness(&self) -> (bool, &'static str) {
        let leading = self.leading.load(Ordering::Relaxed);
        let synced = self.synced.load(Ordering::Relaxed);
        match (self.leader_election, leading, synced) {
            (true, false, _) => (true, "standby: another replica holds the leader lease"),
            (_, _, true) => (true, "watches synced; broker connections are up or retrying"),
            (_, _, false) => (false, "watches not synced yet"),
        }
    }
}

/// What the endpoints read.
pub struct Endpoints {
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    pub brokers: Arc<BrokerPool>,
    pub trackers: Arc<TrackerPool>,
}

pub fn router(state: Arc<Endpoints>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Serves the endpoints until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<Endpoints>) -> std::io::Result<()> {
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    axum::serve(listener, router(state)).await
}

async fn metrics(State(state): State<Arc<Endpoints>>) -> impl IntoResponse {
    state.metrics.broker_connections(&state.brokers.connection_states(), &state.trackers.connection_states());
    state.metrics.tracker_entries(&state.trackers.footprints());
    ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.render())
}

async fn readyz(State(state): State<Arc<Endpoints>>) -> impl IntoResponse {
    let (ready, why) = state.health.readiness();
    let code = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, format!("{why}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_is_ready_and_a_leader_only_once_synced() {
        let h = Health::new(true);
        assert!(h.readiness().0, "a standby serves probes and waits");
        h.set_leading(true);
        assert_eq!(h.readiness(), (false, "watches not synced yet"));
        h.set_synced();
        assert!(h.readiness().0);
        let single = Health::new(false);
        assert!(!single.readiness().0, "without leader election the one replica must sync first");
    }
}
