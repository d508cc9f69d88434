//! One AMQP connection per broker endpoint, shared by every policy that uses it.
//!
//! The connection is opened lazily and re-opened after the broker goes away, with an exponential
//! backoff between attempts so a down broker is not hammered by every reconcile. Channels are
//! pooled: a channel the broker closed (a refused declare closes it) is simply not returned.

use super::{
    refusal::Refusal,
    uri::{BrokerUri, Node},
};
use crate::sync::lock;
use lapin::{Channel, Connection, ConnectionProperties, ErrorKind, tcp::OwnedTLSConfig};
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

/// The largest frame a declarations connection accepts. It only sends declarations and reads
/// small replies, and lapin keeps 32 frames of read and of write buffer per connection: at the
/// broker's default of 128 KiB that is 8 MiB resident for nothing (measured by
/// `cargo bench --bench converge`).
pub const FRAME_MAX: u32 = 32 * 1024;
/// Take the broker's own largest frame (lapin reads 0 as "the server's"). An events connection
/// needs it: any broker user's `basic.consume` arguments come back inside a `consumer.created`
/// event's header frame, which cannot be split, and lapin closes a connection that receives a
/// frame larger than it negotiated.
pub const BROKER_FRAME_MAX: u32 = 0;
/// How long a connection attempt may take before the broker counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one operation may take before the broker counts as hung: a broker that accepts
/// the connection and then stops answering must not hold the reconciles every broker shares.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle channels kept open per endpoint.
const IDLE_CHANNELS: usize = 8;

#[derive(Debug, Clone, thiserror::Error)]
pub enum AmqpError {
    /// No connection: the broker is down, unreachable, or refused the login.
    #[error("cannot connect to {endpoint}: {detail}")]
    Unreachable { endpoint: String, detail: String, retry_in: Duration },
    /// The connection went away during an operation (closed by the broker, maybe for another
    /// policy's operation, or no answer in time): a fresh connection may well succeed.
    #[error("connection to {endpoint} lost: {detail}")]
    Lost { endpoint: String, detail: String },
    /// The broker refused one operation (a soft error); the connection is fine.
    #[error("{0}")]
    Refused(Refusal),
}

/// Reconnect delays: 0.5 s doubling up to 30 s, for as long as it takes.
pub fn reconnect_delays() -> backon::ExponentialBackoff {
    const MAX: Duration = Duration::from_secs(30);
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(MAX)
        .without_max_times()
        .build()
}

/// When a broker that could not be reached may be tried again.
#[derive(Debug)]
pub struct Backoff {
    delays: backon::ExponentialBackoff,
    retry_at: Option<Instant>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { delays: reconnect_delays(), retry_at: None }
    }
}

impl Backoff {
    fn failed(&mut self, now: Instant) -> Duration {
        let delay = self.delays.next().unwrap_or(Duration::from_secs(30));
        self.retry_at = Some(now + delay);
        delay
    }

    fn wait(&self, now: Instant) -> Option<Duration> {
        self.retry_at.and_then(|at| at.checked_duration_since(now)).filter(|d| !d.is_zero())
    }
}

struct ConnState {
    /// The open connection and its generation (which connection of this endpoint it is).
    conn: Option<(Arc<Connection>, u64)>,
    backoff: Backoff,
    last_error: String,
}

pub struct AmqpEndpoint {
    uri: BrokerUri,
    ca_cert: Option<String>,
    connection_name: String,
    frame_max: u32,
    state: tokio::sync::Mutex<ConnState>,
    /// Idle channels, each with the generation of the connection it lives on.
    idle: Mutex<Vec<(u64, Channel)>>,
    opened: AtomicU64,
}

impl AmqpEndpoint {
    /// An endpoint whose connections accept frames up to `frame_max` ([`FRAME_MAX`] or
    /// [`BROKER_FRAME_MAX`]).
    pub fn new(uri: BrokerUri, ca_cert: Option<String>, connection_name: String, frame_max: u32) -> Self {
        Self {
            uri,
            ca_cert,
            connection_name,
            frame_max,
            state: tokio::sync::Mutex::new(ConnState {
                conn: None,
                backoff: Backoff::default(),
                last_error: String::new(),
            }),
            idle: Mutex::new(Vec::new()),
            opened: AtomicU64::new(0),
        }
    }

    /// Connections opened so far (one, unless the broker went away).
    pub fn connections_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    pub fn display(&self) -> String {
        self.uri.display()
    }

    /// Whether the connection is open; false while (re)connecting.
    pub fn is_connected(&self) -> bool {
        self.state.try_lock().is_ok_and(|s| s.conn.as_ref().is_some_and(|(c, _)| c.status().connected()))
    }

    /// A live channel, connecting first when needed.
    pub async fn channel(&self) -> Result<PooledChannel<'_>, AmqpError> {
        let (conn, generation) = self.connection().await?;
        let channel = match self.take_idle(generation) {
            Some(channel) => channel,
            None => self.run_on(generation, conn.create_channel()).await?,
        };
        Ok(PooledChannel { endpoint: self, generation, channel: Some(channel) })
    }

    /// A channel of its own, outside the pool, for a long-lived subscription, with the
    /// generation of its connection (for [`Self::run_on`]).
    pub async fn dedicated_channel(&self) -> Result<(Channel, u64), AmqpError> {
        let (conn, generation) = self.connection().await?;
        Ok((self.run_on(generation, conn.create_channel()).await?, generation))
    }

    /// An idle channel of the current connection. A lost connection marks itself failed before
    /// its channels (lapin rejects the pending operations in between), so a channel's own status
    /// can still read open just after its connection died: the generation tells.
    fn take_idle(&self, generation: u64) -> Option<Channel> {
        let mut idle = lock(&self.idle);
        // Channels of an earlier connection (returned after it was let go) leave the pool.
        idle.retain(|(g, channel)| *g == generation && channel.status().connected());
        idle.pop().map(|(_, channel)| channel)
    }

    async fn connection(&self) -> Result<(Arc<Connection>, u64), AmqpError> {
        let mut state = self.state.lock().await;
        if let Some((conn, generation)) = &state.conn {
            if conn.status().connected() {
                return Ok((conn.clone(), *generation));
            }
            state.conn = None;
        }
        let now = Instant::now();
        if let Some(retry_in) = state.backoff.wait(now) {
            return Err(self.unreachable(state.last_error.clone(), retry_in));
        }
        match self.connect_any().await {
            Ok(conn) => {
                let conn = Arc::new(conn);
                let generation = self.opened.fetch_add(1, Ordering::Relaxed) + 1;
                state.backoff = Backoff::default();
                state.conn = Some((conn.clone(), generation));
                Ok((conn, generation))
            }
            Err(detail) => {
                let retry_in = state.backoff.failed(now);
                state.last_error = detail.clone();
                tracing::warn!(broker = %self.display(), %detail, ?retry_in, "connection failed");
                Err(self.unreachable(detail, retry_in))
            }
        }
    }

    /// Connects to the first node that answers, in the order given (a cluster's `addresses`);
    /// fails with what each node said.
    async fn connect_any(&self) -> Result<Connection, String> {
        let mut failures = Vec::new();
        for node in self.uri.nodes() {
            let detail = match tokio::time::timeout(CONNECT_TIMEOUT, self.connect(node)).await {
                Ok(Ok(conn)) => {
                    tracing::info!(broker = %self.display(), %node, "connected");
                    return Ok(conn);
                }
                Ok(Err(e)) => self.uri.redact(&describe(&e)),
                Err(_) => format!("no answer within {}s", CONNECT_TIMEOUT.as_secs()),
            };
            failures.push(if self.uri.nodes().len() > 1 { format!("{node}: {detail}") } else { detail });
        }
        Err(failures.join("; "))
    }

    async fn connect(&self, node: &Node) -> lapin::Result<Connection> {
        let props = ConnectionProperties::default().with_connection_name(self.connection_name.clone().into());
        let tls = OwnedTLSConfig { identity: None, cert_chain: self.ca_cert.clone() };
        let runtime = lapin::runtime::default_runtime()?;
        let mut uri = self.uri.amqp_at(node);
        uri.query.frame_max = Some(self.frame_max);
        Connection::connect_uri_with_config(uri, props, tls, runtime).await
    }

    /// Runs `op` on connection `generation` (see [`PooledChannel::run`]).
    pub async fn run_on<T>(
        &self,
        generation: u64,
        op: impl std::future::Future<Output = lapin::Result<T>>,
    ) -> Result<T, AmqpError> {
        match tokio::time::timeout(OPERATION_TIMEOUT, op).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                if connection_failed(&e) {
                    self.forget(generation).await;
                }
                Err(self.classify(e))
            }
            Err(_) => {
                self.forget(generation).await;
                Err(AmqpError::Lost {
                    endpoint: self.display(),
                    detail: format!("no answer within {}s", OPERATION_TIMEOUT.as_secs()),
                })
            }
        }
    }

    /// Lets go of connection `generation` (if it is still the current one) and its idle
    /// channels, closing it in the background so a half-open one does not linger.
    async fn forget(&self, generation: u64) {
        let mut state = self.state.lock().await;
        if let Some((conn, g)) = &state.conn
            && *g == generation
        {
            let conn = conn.clone();
            state.conn = None;
            tracing::info!(broker = %self.display(), "connection lost; the next operation connects afresh");
            tokio::spawn(async move {
                let _ = conn.close(200, "lost".into()).await;
            });
        }
        lock(&self.idle).retain(|(g, _)| *g != generation);
    }

    fn unreachable(&self, detail: String, retry_in: Duration) -> AmqpError {
        AmqpError::Unreachable { endpoint: self.display(), detail, retry_in }
    }

    /// Sorts a lapin error into a refusal (channel closed, connection fine) or a lost connection.
    pub fn classify(&self, e: lapin::Error) -> AmqpError {
        match e.kind() {
            ErrorKind::ProtocolError(amqp) if e.is_amqp_soft_error() => {
                AmqpError::Refused(Refusal { code: amqp.get_id(), text: amqp.get_message().to_string() })
            }
            _ => AmqpError::Lost { endpoint: self.display(), detail: self.uri.redact(&describe(&e)) },
        }
    }
}

fn describe(e: &lapin::Error) -> String {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => amqp.get_message().to_string(),
        _ => e.to_string(),
    }
}

/// A channel borrowed from the endpoint's pool; returned on drop if still open.
pub struct PooledChannel<'a> {
    endpoint: &'a AmqpEndpoint,
    generation: u64,
    channel: Option<Channel>,
}

impl std::ops::Deref for PooledChannel<'_> {
    type Target = Channel;
    fn deref(&self) -> &Channel {
        self.channel.as_ref().expect("present until drop")
    }
}

impl PooledChannel<'_> {
    /// True while the broker has not closed the channel.
    pub fn is_open(&self) -> bool {
        self.status().connected()
    }

    /// Runs one operation on this channel within [`OPERATION_TIMEOUT`]. When its failure shows
    /// the connection itself is gone (an IO error, a hard error, no answer), the connection is
    /// let go at once: lapin can still report a reset connection open for a moment (measured
    /// on the cluster: the retry after a node's `kill -9` reused it and failed again), and the
    /// retry must connect afresh, through the next node of a cluster.
    pub async fn run<T>(&self, op: impl std::future::Future<Output = lapin::Result<T>>) -> Result<T, AmqpError> {
        self.endpoint.run_on(self.generation, op).await
    }
}

/// Whether an error means the connection is gone, not just the channel.
fn connection_failed(e: &lapin::Error) -> bool {
    match e.kind() {
        ErrorKind::ProtocolError(_) => !e.is_amqp_soft_error(),
        ErrorKind::IOError(_)
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::ParsingError(_)
        | ErrorKind::SerialisationError(_) => true,
        _ => false,
    }
}

impl Drop for PooledChannel<'_> {
    fn drop(&mut self) {
        let Some(channel) = self.channel.take() else {
            return;
        };
        if !channel.status().connected() {
            return;
        }
        let mut idle = lock(&self.endpoint.idle);
        if idle.len() < IDLE_CHANNELS {
            idle.push((self.generation, channel));
        } else {
            tokio::spawn(async move {
                let _ = channel.close(200, "OK".into()).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_thirty_seconds() {
        let delays: Vec<u64> = reconnect_delays().take(9).map(|d| d.as_millis() as u64).collect();
        assert_eq!(delays, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]);
    }

    #[test]
    fn backoff_blocks_until_its_time() {
        let mut b = Backoff::default();
        let t0 = Instant::now();
        assert_eq!(b.wait(t0), None);
        let d = b.failed(t0);
        assert_eq!(d, Duration::from_millis(500));
        assert!(b.wait(t0).is_some());
        assert_eq!(b.wait(t0 + Duration::from_millis(500)), None);
    }
}
