//! The operator's own HTTP endpoints: `/metrics` (Prometheus text), `/healthz` (the process
//! answers) and `/readyz` (a standby waiting for the lease, or a leader whose watches have
//! synced).

use crate::{broker::BrokerPool, consumers::TrackerPool, metrics::Metrics};
use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

/// What the probes report.
#[derive(Debug, Default)]
pub struct Health {
    leader_election: bool,
    leading: AtomicBool,
    synced: AtomicBool,
    /// The webhook serves here and its QueuePolicy list has not synced yet.
    webhook_pending: AtomicBool,
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

    /// The webhook serves from this replica: not Ready until [`Self::set_webhook_synced`].
    pub fn expect_webhook(&self) {
        self.webhook_pending.store(true, Ordering::Relaxed);
    }

    pub fn set_webhook_synced(&self) {
        self.webhook_pending.store(false, Ordering::Relaxed);
    }

    /// Ready, and why (or why not).
    pub fn readiness(&self) -> (bool, &'static str) {
        let leading = self.leading.load(Ordering::Relaxed);
        let synced = self.synced.load(Ordering::Relaxed);
        // Ready puts the replica in the webhook Service: one without the policies would let
        // guarded pods through without their gate.
        if self.webhook_pending.load(Ordering::Relaxed) {
            return (false, "the webhook's QueuePolicy list has not synced yet");
        }
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

/// What one client of the endpoints may hold: a scraper or a probe sends a few hundred bytes
/// of headers, so slow or silent ones are let go, and a flood of connections cannot take every
/// file descriptor or task.
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    /// For the headers of each request, the first and each on a kept-alive connection.
    pub headers: Duration,
    /// Connections served at once; those beyond are closed at once.
    pub connections: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self { headers: Duration::from_secs(10), connections: 64 }
    }
}

/// Serves the endpoints until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<Endpoints>, limits: ClientLimits) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    let app = router(state);
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections));
    let _: std::convert::Infallible = accept_loop(
        || async { listener.accept().await.map(|(tcp, _)| tcp) },
        |tcp| {
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::debug!("metrics endpoint at its connection limit; closing a new connection");
                return;
            };
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            tokio::spawn(async move {
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(limits.headers);
                if let Err(e) = http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service).await {
                    tracing::debug!(error = %e, "metrics connection ended");
                }
                drop(slot);
            });
        },
    )
    .await;
}

/// After a failed accept (out of file descriptors, say), wait this long before the next, doubling
/// up to [`ACCEPT_BACKOFF_MAX`]: retrying at once would spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Hands every accepted connection to `handle`, for ever. A failed accept (out of file
/// descriptors, say) fails again at once if retried at once: wait, doubling up to the maximum.
/// Shared by these endpoints and the admission webhook.
pub(crate) async fn accept_loop<S, Fut>(
    mut accept: impl FnMut() -> Fut,
    mut handle: impl FnMut(S),
) -> std::convert::Infallible
where
    Fut: std::future::Future<Output = std::io::Result<S>>,
{
    let mut backoff = ACCEPT_BACKOFF;
    loop {
        match accept().await {
            Ok(connection) => {
                backoff = ACCEPT_BACKOFF;
                handle(connection);
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "could not accept a connection");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
            }
        }
    }
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
    use std::sync::atomic::AtomicUsize;

    #[tokio::test(start_paused = true)]
    async fn failing_accepts_back_off_instead_of_spinning_and_a_success_resets_the_wait() {
        let calls = AtomicUsize::new(0);
        let handled = AtomicUsize::new(0);
        // Four failures, one connection, then failures for ever.
        let accept = || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move { if n == 4 { Ok(n) } else { Err(std::io::Error::other("too many open files")) } }
        };
        let run = accept_loop(accept, |_| {
            handled.fetch_add(1, Ordering::SeqCst);
        });
        // Waits 10 + 20 + 40 + 80 ms, accepts, then 10, 20, 40, ... up to 1 s each.
        let _ = tokio::time::timeout(Duration::from_secs(5), run).await;
        let calls = calls.load(Ordering::SeqCst);
        assert_eq!(handled.load(Ordering::SeqCst), 1);
        // 150 ms to the success; then 10..640 ms (1,270 ms) and 1 s waits fill the rest: 5 + 8 + 3.
        assert_eq!(calls, 16, "accept attempts in 5 s");
    }

    /// A client that sends no headers is let go at the header limit, and connections beyond the
    /// cap are closed at once while /metrics still answers within it.
    #[tokio::test]
    async fn slow_clients_are_let_go_and_connections_are_capped() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let endpoints = Arc::new(Endpoints {
            metrics: Arc::default(),
            health: Arc::new(Health::new(false)),
            brokers: Arc::new(BrokerPool::new("t")),
            trackers: Arc::new(TrackerPool::new("t")),
        });
        let limits = ClientLimits { headers: Duration::from_millis(300), connections: 3 };
        tokio::spawn(serve(listener, endpoints, limits));
        let closed_within = |mut tcp: tokio::net::TcpStream, within: Duration| async move {
            let mut buf = Vec::new();
            tokio::time::timeout(within, tcp.read_to_end(&mut buf)).await.is_ok()
        };
        let silent: Vec<_> = futures::future::join_all((0..3).map(|_| tokio::net::TcpStream::connect(addr))).await;
        let silent: Vec<_> = silent.into_iter().map(Result::unwrap).collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let beyond = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(beyond, Duration::from_millis(200)).await, "a fourth connection is closed at once");
        let started = std::time::Instant::now();
        for tcp in silent {
            assert!(closed_within(tcp, Duration::from_secs(2)).await, "a silent client is let go");
        }
        assert!(started.elapsed() >= Duration::from_millis(200), "not before the header limit");
        let mut scrape = tokio::net::TcpStream::connect(addr).await.unwrap();
        scrape.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        scrape.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("# EOF"), "{answer}");
    }

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

    /// Every replica serves the webhook: a standby whose QueuePolicy list is not in yet would
    /// answer "no policy" and a guarded pod would go Ready without its gate.
    #[test]
    fn a_replica_serving_the_webhook_is_ready_only_once_its_policies_synced() {
        let h = Health::new(true);
        h.expect_webhook();
        assert_eq!(h.readiness(), (false, "the webhook's QueuePolicy list has not synced yet"));
        h.set_webhook_synced();
        assert!(h.readiness().0, "a synced standby");
    }
}
