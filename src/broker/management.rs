//! The RabbitMQ management HTTP API: policies, queue details, connections.
//!
//! URLs never carry credentials (they go in the Authorization header), so an HTTP error that
//! quotes its URL cannot leak them.

use super::{
    listing::{self, Seen, Want, Wanted},
    prometheus,
    uri::ManagementEndpoint,
};
use crate::sync::lock;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::{Map, Value};
use std::{collections::HashMap, sync::Arc, time::Duration};

const TIMEOUT: Duration = Duration::from_secs(10);
/// A write (policy set or cleared, connection closed) may take longer: RabbitMQ re-matches every
/// queue of the vhost against every policy on each policy change, holding its queue tables
/// meanwhile, so on a vhost with thousands of queues one change takes seconds (measured by
/// `cargo bench --bench converge`, Policy mode).
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, thiserror::Error)]
pub enum ManagementError {
    #[error("management API at {endpoint} unreachable: {detail}")]
    Unreachable { endpoint: String, detail: String },
    #[error("management API refused {what}: HTTP {status}: {reason}")]
    Rejected { what: String, status: u16, reason: String },
    /// The Secret's `caCert` is not a PEM certificate.
    #[error("the CA certificate (caCert) cannot be used: {0}")]
    InvalidCa(String),
    /// A request answered 200 with a body that is not what the API documents.
    #[error("management API answered {what} with an unexpected body: {detail}")]
    UnexpectedBody { what: String, detail: String },
    /// An answer larger than the operator reads ([`super::body::CAP`]).
    #[error("management API at {endpoint} answered {what}: {detail}")]
    TooLarge { endpoint: String, what: String, detail: String },
    /// `.` or `..` as a vhost or name: URL paths read them as dot segments, so the request
    /// would land on another path.
    #[error("{0:?} cannot be addressed through the management API: URL paths read it as a dot segment")]
    Unaddressable(String),
}

/// Whether a vhost or an entity name can be a segment of a management API path: `.` and `..`
/// (percent-encoded or not) are dot segments to every URL parser on the way.
pub fn addressable(name: &str) -> bool {
    !matches!(name, "." | "..")
}

/// A queue as the management API reports it. Counters are absent until the broker has emitted
/// the queue's first statistics (every 5 s by default).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct QueueInfo {
    pub name: String,
    pub vhost: String,
    /// classic, quorum or stream.
    #[serde(default, rename = "type")]
    pub queue_type: Option<String>,
    #[serde(default)]
    pub durable: bool,
    #[serde(default)]
    pub auto_delete: bool,
    #[serde(default)]
    pub exclusive: bool,
    #[serde(default)]
    pub arguments: Map<String, Value>,
    #[serde(default)]
    pub messages_ready: Option<i64>,
    #[serde(default)]
    pub messages_unacknowledged: Option<i64>,
    #[serde(default)]
    pub consumers: Option<i64>,
    #[serde(default)]
    pub policy: Option<String>,
    /// The policy's definition merged with the operator policy's, as the queue's last
    /// statistics carried it (`{}` or absent without one).
    #[serde(default)]
    pub effective_policy_definition: Option<Map<String, Value>>,
    /// Its consumers (a queue's own page only; not in listings).
    #[serde(default)]
    pub consumer_details: Vec<QueueConsumer>,
    #[serde(default)]
    pub message_stats: MessageStats,
    /// When the queue last saw activity, while it is idle (`2026-12-03 7:41:20`, broker time).
    #[serde(default)]
    pub idle_since: Option<String>,
}

/// A consumer as a queue's page lists it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct QueueConsumer {
    #[serde(default)]
    pub consumer_tag: String,
    #[serde(default)]
    pub exclusive: bool,
}

/// Cumulative message counters of a queue; absent until the first of each happens.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct MessageStats {
    #[serde(default)]
    pub ack: u64,
    #[serde(default)]
    pub redeliver: u64,
}

/// A RabbitMQ policy.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct PolicyInfo {
    pub name: String,
    pub pattern: String,
    #[serde(rename = "apply-to")]
    pub apply_to: String,
    pub priority: i64,
    pub definition: Map<String, Value>,
}

/// A binding as the management API lists it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct BindingInfo {
    /// The exchange; empty for the default exchange's implicit binding.
    pub source: String,
    #[serde(default)]
    pub destination: String,
    #[serde(default)]
    pub routing_key: String,
    #[serde(default)]
    pub arguments: Map<String, Value>,
    /// The broker's own name for the binding (routing key and arguments), by which it is deleted.
    #[serde(default)]
    pub properties_key: String,
}

/// A feature flag and whether it is enabled (`enabled`, `disabled`, `unavailable`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct FeatureFlag {
    pub name: String,
    pub state: String,
}

/// A client connection as the management API reports it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ConnectionInfo {
    pub name: String,
    #[serde(default)]
    pub client_properties: Map<String, Value>,
}

/// A connection in a vhost's listing.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ConnectionSummary {
    /// `peer:port -> host:port`
    pub name: String,
    #[serde(default)]
    pub user_provided_name: Option<String>,
    /// Unix milliseconds, broker clock.
    #[serde(default)]
    pub connected_at: Option<i64>,
}

/// A cluster node as the management API reports it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    #[serde(default)]
    pub running: bool,
    /// None when the API has no statistics for the node: measured on a 3.10 cluster, a node
    /// restarted in place can stay listed with only its name and `running` for minutes, its
    /// plugins active all along.
    #[serde(default)]
    pub enabled_plugins: Option<Vec<String>>,
}

/// A consumer as the management API reports it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ConsumerInfo {
    pub consumer_tag: String,
    #[serde(default)]
    pub prefetch_count: u32,
    #[serde(default = "yes")]
    pub ack_required: bool,
    pub queue: QueueRef,
    pub channel_details: ChannelDetails,
}

/// The consumers whose channel is still open. While a channel closes, the management API lists
/// its consumers with empty `channel_details` (`[]` in 3.10, `{}` since): they are detaching, and
/// one of them must not make the whole list unreadable.
fn live_consumers(rows: Vec<Value>) -> Result<Vec<ConsumerInfo>, serde_json::Error> {
    rows.into_iter().filter(|r| r.pointer("/channel_details/name").is_some()).map(serde_json::from_value).collect()
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct QueueRef {
    pub name: String,
    pub vhost: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ChannelDetails {
    pub name: String,
    #[serde(default)]
    pub peer_host: Option<String>,
    /// The node the channel lives on.
    #[serde(default)]
    pub node: Option<String>,
}

impl ConnectionInfo {
    /// The name the client gave its connection, if any.
    pub fn connection_name(&self) -> Option<&str> {
        self.client_properties.get("connection_name").and_then(Value::as_str)
    }
}

/// Requests to one management API in flight at once: its HTTP server does not get faster with
/// more, and a flood makes requests time out.
const IN_FLIGHT: usize = 4;
/// Writes in flight at once, within [`IN_FLIGHT`]: the broker applies policy changes one at a
/// time, so concurrent writes only wait inside it, each on the clock of its own timeout.
const WRITES_IN_FLIGHT: usize = 1;
/// Per vhost: when the last policy read went out, and what it returned, shared rather than
/// copied (a vhost can hold a thousand policies).
type PolicyCache = HashMap<String, (std::time::Instant, Arc<Vec<PolicyInfo>>)>;
/// How old a vhost's shared queue listing may be when it serves the operator's periodic reads
/// (findings, status, QueuePatterns): one listing per vhost per this interval, whatever the
/// number of policies. Longer than the findings' 20 s between looks, so the looks of a vhost
/// cost two listings a minute; a look that finds the listing its last look saw skips a turn.
pub const LISTING_MAX_AGE: Duration = Duration::from_secs(30);
/// Per vhost: the last listing of its queues ([`ManagementClient::queues_in`]).
type ListingCache = HashMap<String, Arc<QueueListing>>;

/// The columns of a queue listing: what the findings, status and QueuePatterns read. Without
/// them the broker sends every queue's full statistics (rates, backing queue status, ...).
const LISTING_COLUMNS: &str = "name,vhost,type,durable,auto_delete,exclusive,arguments,messages_ready,messages_unacknowledged,consumers,policy,idle_since,message_stats.ack,message_stats.redeliver";

/// The columns of a listing without statistics (`disable_stats`), beside rabbitmq_prometheus's
/// counters (see there why not `enable_queue_totals`).
const BARE_COLUMNS: &str = "name,vhost,type,durable,auto_delete,exclusive,arguments,policy";

/// The queues of a vhost, as one listing read at `read_at`: every queue, or those its readers
/// want ([`listing`]).
#[derive(Debug)]
pub struct QueueListing {
    pub read_at: std::time::Instant,
    /// When it was read, in ms since the epoch (the time its counters are from).
    pub read_at_ms: i64,
    pub queues: HashMap<String, QueueInfo>,
    /// Where its consumer counts, acks and redeliveries come from. Under Prometheus there is no
    /// `idle_since` (it is a management statistic).
    pub source: prometheus::StatsSource,
    /// What the API was asked for, when not every queue.
    pub filter: Option<Wanted>,
    /// Queues in the vhost, and of them wanted ones, when it was read.
    pub seen: Seen,
}

impl QueueListing {
    /// Whether it holds what `want` needs (a queue missing from it is not in the vhost).
    pub fn covers(&self, want: Want) -> bool {
        self.filter.as_ref().is_none_or(|f| f.covers(want))
    }
}

/// A page of a filtered listing of queues.
#[derive(Deserialize, Default)]
struct QueuePage {
    #[serde(default)]
    items: Vec<QueueInfo>,
    #[serde(default)]
    total_count: usize,
    #[serde(default)]
    filtered_count: usize,
    #[serde(default)]
    page_count: usize,
}

#[derive(Clone)]
pub struct ManagementClient {
    endpoint: ManagementEndpoint,
    http: reqwest::Client,
    /// Requests sent, for the benchmarks' round-trip counts.
    requests: Arc<std::sync::atomic::AtomicU64>,
    in_flight: Arc<tokio::sync::Semaphore>,
    writes: Arc<tokio::sync::Semaphore>,
    policies: Arc<tokio::sync::Mutex<PolicyCache>>,
    listings: Arc<tokio::sync::Mutex<ListingCache>>,
    /// Per vhost, every queue its listing's readers asked for.
    wanted: Arc<std::sync::Mutex<HashMap<String, Wanted>>>,
    /// Per vhost, the last name filter the API refused: not sent again.
    refused_filters: Arc<std::sync::Mutex<HashMap<String, String>>>,
    /// Whether rabbitmq_prometheus answers beside each node's management API.
    prometheus: Arc<std::sync::Mutex<prometheus::Detection>>,
    /// Requests sent to rabbitmq_prometheus, for the benchmarks.
    prometheus_requests: Arc<std::sync::atomic::AtomicU64>,
    /// The base URL requests go to now: the next one after a node stopped answering.
    current: Arc<std::sync::atomic::AtomicUsize>,
}

impl ManagementClient {
    pub fn new(endpoint: ManagementEndpoint, ca_cert: Option<&str>) -> Result<Self, ManagementError> {
        crate::tls::install_crypto_provider();
        let mut builder = reqwest::Client::builder().connect_timeout(TIMEOUT);
        if let Some(pem) = ca_cert {
            let cert = reqwest::Certificate::from_pem(pem.as_bytes())
                .map_err(|e| ManagementError::InvalidCa(e.to_string()))?;
            builder = builder.tls_certs_merge([cert]);
        }
        let http = builder.build().map_err(|e| ManagementError::Unreachable {
            endpoint: endpoint.base_url().to_string(),
            detail: e.to_string(),
        })?;
        Ok(Self {
            endpoint,
            http,
            requests: Default::default(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
            writes: Arc::new(tokio::sync::Semaphore::new(WRITES_IN_FLIGHT)),
            policies: Default::default(),
            listings: Default::default(),
            wanted: Default::default(),
            refused_filters: Default::default(),
            prometheus: Arc::new(std::sync::Mutex::new(prometheus::Detection::Unknown)),
            prometheus_requests: Default::default(),
            current: Default::default(),
        })
    }

    /// The base URL in use now.
    pub fn display(&self) -> String {
        self.base_url().to_string()
    }

    fn base_url(&self) -> &reqwest::Url {
        let urls = &self.endpoint.base_urls;
        &urls[self.current.load(std::sync::atomic::Ordering::Relaxed) % urls.len()]
    }

    /// Requests sent so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub async fn queue(&self, vhost: &str, name: &str) -> Result<Option<QueueInfo>, ManagementError> {
        self.get_opt(&["queues", vhost, name]).await
    }

    /// The vhost's policies, from a read no earlier than `fresh_within` before the call, plus
    /// our own writes since (every write goes through this client). With `Duration::ZERO`
    /// concurrent callers share one read: a caller that waited while another read went out after
    /// it asked takes that answer, which is as fresh as its own would have been. A window lets
    /// every pass of a vhost's policies at rest share one read; what it can hide is only a change
    /// someone else made within it, which the next pass sees.
    pub async fn policies(&self, vhost: &str, fresh_within: Duration) -> Result<Arc<Vec<PolicyInfo>>, ManagementError> {
        let asked = std::time::Instant::now();
        let oldest = asked.checked_sub(fresh_within).unwrap_or(asked);
        let mut cache = self.policies.lock().await;
        if let Some((read_at, list)) = cache.get(vhost)
            && *read_at >= oldest
        {
            return Ok(Arc::clone(list));
        }
        let read_at = std::time::Instant::now();
        let list = Arc::new(self.get_opt(&["policies", vhost]).await?.unwrap_or_default());
        cache.insert(vhost.to_owned(), (read_at, Arc::clone(&list)));
        Ok(list)
    }

    /// A decision on the vhost's policies: taken on a list up to [`LISTING_MAX_AGE`] old while it
    /// finds nothing to do (`settled`), so the passes at rest share one read per vhost; else
    /// taken again on a fresh read, so what is acted on or reported is the broker's current list.
    /// The list is let go before the caller writes, so recording that write need not copy it.
    pub async fn decide_on_policies<T>(
        &self,
        vhost: &str,
        decide: impl Fn(&[PolicyInfo]) -> T,
        settled: impl Fn(&T) -> bool,
    ) -> Result<T, ManagementError> {
        let at_rest = decide(&self.policies(vhost, LISTING_MAX_AGE).await?);
        if settled(&at_rest) {
            return Ok(at_rest);
        }
        Ok(decide(&self.policies(vhost, Duration::ZERO).await?))
    }

    /// As [`Self::queues_in`], for a look at `queue`: a shared listing that lacks it, and may be
    /// older than it (declared since, as at a cold start), is read again once.
    pub async fn queues_holding(
        &self,
        vhost: &str,
        queue: &str,
        want: Want<'_>,
        fresh_within: Duration,
    ) -> Result<Arc<QueueListing>, ManagementError> {
        let listing = self.queues_in(vhost, want, fresh_within).await?;
        if listing.queues.contains_key(queue) || fresh_within.is_zero() {
            return Ok(listing);
        }
        self.queues_in(vhost, want, Duration::ZERO).await
    }

    /// Every queue of a vhost with the columns the findings, status and QueuePatterns read, one
    /// listing shared by every caller: one read no earlier than `fresh_within` before the call
    /// is served again (with `Duration::ZERO`, only one that went out after the call, which
    /// concurrent callers share). What each policy's look would otherwise cost per queue is one
    /// request per vhost per interval, and the broker gathers each queue's statistics once.
    pub async fn queues_in(
        &self,
        vhost: &str,
        want: Want<'_>,
        fresh_within: Duration,
    ) -> Result<Arc<QueueListing>, ManagementError> {
        let asked = std::time::Instant::now();
        let oldest = asked.checked_sub(fresh_within).unwrap_or(asked);
        {
            let mut all = lock(&self.wanted);
            match all.get_mut(vhost) {
                Some(wanted) => wanted.add(want),
                None => {
                    let mut wanted = Wanted::default();
                    wanted.add(want);
                    all.insert(vhost.to_owned(), wanted);
                }
            }
        }
        let mut cache = self.listings.lock().await;
        if let Some(listing) = cache.get(vhost)
            && listing.read_at >= oldest
            && listing.covers(want)
        {
            return Ok(Arc::clone(listing));
        }
        // Copied only for a read (a vhost's set can hold thousands of names).
        let wanted = lock(&self.wanted).get(vhost).cloned().unwrap_or_default();
        let read_at = std::time::Instant::now();
        let read_at_ms = crate::consumers::tracker::now_ms();
        let refused = lock(&self.refused_filters).get(vhost).cloned();
        let filter = listing::filter(&wanted, cache.get(vhost).map(|l| l.seen), refused.as_deref());
        let counters = self.prometheus_counters(vhost).await;
        let columns = match counters {
            Some(_) => format!("disable_stats=true&columns={BARE_COLUMNS}"),
            None => format!("columns={LISTING_COLUMNS}"),
        };
        let (rows, seen, filter) = self.queue_rows(vhost, &columns, filter.as_deref(), &wanted).await?;
        let (rows, source) = match counters {
            Some(counters) => {
                let with_counters = rows
                    .into_iter()
                    .map(|mut q| {
                        let c = counters.get(&q.name).cloned().unwrap_or_default();
                        q.messages_ready = Some(c.ready);
                        q.messages_unacknowledged = Some(c.unacked);
                        q.consumers = Some(c.consumers);
                        q.message_stats = MessageStats { ack: c.acks, redeliver: c.redeliveries };
                        q
                    })
                    .collect();
                (with_counters, prometheus::StatsSource::Prometheus)
            }
            None => (rows, prometheus::StatsSource::Management),
        };
        let queues = rows.into_iter().map(|q| (q.name.clone(), q)).collect();
        let filter = filter.then_some(wanted);
        let listing = Arc::new(QueueListing { read_at, read_at_ms, queues, source, filter, seen });
        cache.insert(vhost.to_owned(), Arc::clone(&listing));
        Ok(listing)
    }

    /// The vhost's queues with `columns`: one page through the name `filter` when given and
    /// the wanted queues fit it, else every queue. Says whether the filter was used.
    async fn queue_rows(
        &self,
        vhost: &str,
        columns: &str,
        filter: Option<&str>,
        wanted: &Wanted,
    ) -> Result<(Vec<QueueInfo>, Seen, bool), ManagementError> {
        if let Some(filter) = filter {
            let re: String = url::form_urlencoded::byte_serialize(filter.as_bytes()).collect();
            let query = format!("page=1&page_size={}&use_regex=true&name={re}&{columns}", listing::PAGE_SIZE);
            match self.get_query::<QueuePage>(&["queues", vhost], &query).await {
                Ok(page) => {
                    let page = page.unwrap_or_default();
                    if page.page_count <= 1 {
                        let seen = Seen { total: page.total_count, wanted: page.filtered_count };
                        return Ok((page.items, seen, true));
                    }
                    // Grown past a page: the whole vhost, this time and (by what it shows) next.
                }
                // A filter the API refuses would fail every reader of the vhost: list it whole,
                // and say so once.
                Err(ManagementError::Rejected { status, reason, .. }) => {
                    tracing::warn!(
                        %vhost, status, %reason, filter,
                        "the management API refused the queue listing's name filter; listing the vhost whole"
                    );
                    lock(&self.refused_filters).insert(vhost.to_owned(), filter.to_owned());
                }
                Err(e) => return Err(e),
            }
        }
        let rows: Vec<QueueInfo> = self.get_query(&["queues", vhost], columns).await?.unwrap_or_default();
        let seen = Seen { total: rows.len(), wanted: wanted.count_in(rows.iter().map(|q| q.name.as_str())) };
        Ok((rows, seen, false))
    }

    /// Forgets a QueuePattern's regex for the vhost's listing (its QueuePattern is gone).
    pub fn forget_pattern(&self, vhost: &str, pattern: &str) {
        if let Some(wanted) = lock(&self.wanted).get_mut(vhost) {
            wanted.remove_pattern(pattern);
        }
    }

    /// When queue `name` last had activity, if it is idle: from the statistics of a one-queue page
    /// of the vhost's listing. A GET of the queue itself would not do: it asks the queue process,
    /// which wakes it and restarts its idle time.
    pub async fn idle_since(&self, vhost: &str, name: &str) -> Result<Option<String>, ManagementError> {
        #[derive(Deserialize)]
        struct Page {
            #[serde(default)]
            items: Vec<QueueInfoIdle>,
        }
        #[derive(Deserialize)]
        struct QueueInfoIdle {
            name: String,
            #[serde(default)]
            idle_since: Option<String>,
        }
        let exact: String =
            url::form_urlencoded::byte_serialize(format!("^{}$", listing::regex_escape(name)).as_bytes()).collect();
        let query = format!("page=1&page_size=1&use_regex=true&name={exact}&columns=name,idle_since");
        let page: Option<Page> = self.get_query(&["queues", vhost], &query).await?;
        Ok(page.into_iter().flat_map(|p| p.items).find(|q| q.name == name).and_then(|q| q.idle_since))
    }

    /// This client, reading the management API's statistics only, never rabbitmq_prometheus
    /// (`cargo bench --bench reads` compares the two).
    pub fn without_prometheus(self) -> Self {
        Self { prometheus: Arc::new(std::sync::Mutex::new(prometheus::Detection::Off)), ..self }
    }

    /// Requests sent to rabbitmq_prometheus so far.
    pub fn prometheus_requests(&self) -> u64 {
        self.prometheus_requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every node's rabbitmq_prometheus counters of `vhost`, when the plugin answers for this
    /// broker; None reads the management API's statistics instead. Asked first when the cluster's
    /// name is known, again [`prometheus::RETRY_AFTER`] after it did not answer.
    async fn prometheus_counters(&self, vhost: &str) -> Option<HashMap<String, prometheus::Counters>> {
        use prometheus::Detection;
        let known = lock(&self.prometheus).clone();
        let (urls, cluster) = match known {
            Detection::Available { urls, cluster } => (urls, cluster),
            Detection::Unavailable(at) if at.elapsed() < prometheus::RETRY_AFTER => return None,
            Detection::Off => return None,
            _ => {
                let overview: Option<Value> =
                    self.get_query(&["overview"], "columns=cluster_name").await.ok().flatten();
                let cluster = overview?.get("cluster_name")?.as_str()?.to_owned();
                (self.endpoint.metrics_urls.clone(), cluster)
            }
        };
        let mut total = HashMap::new();
        for url in &urls {
            self.prometheus_requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match prometheus::scrape(&self.http, url, vhost, &cluster).await {
                Ok(node) => prometheus::merge(&mut total, node),
                Err(why) => {
                    let mut state = lock(&self.prometheus);
                    if !matches!(*state, Detection::Unavailable(_)) {
                        tracing::info!(%why, "rabbitmq_prometheus not used; queue counters come from the management API");
                    }
                    *state = Detection::Unavailable(std::time::Instant::now());
                    return None;
                }
            }
        }
        *lock(&self.prometheus) = Detection::Available { urls, cluster };
        Some(total)
    }

    /// Keeps the cached list in step with a write of our own. Copies it only while a caller
    /// still holds the previous version.
    async fn remember(&self, vhost: &str, name: &str, written: Option<&PolicyInfo>) {
        if let Some((_, list)) = self.policies.lock().await.get_mut(vhost) {
            let list = Arc::make_mut(list);
            list.retain(|p| p.name != name);
            list.extend(written.cloned());
        }
    }

    pub async fn put_policy(&self, vhost: &str, policy: &PolicyInfo) -> Result<(), ManagementError> {
        let body = serde_json::json!({
            "pattern": policy.pattern,
            "apply-to": policy.apply_to,
            "priority": policy.priority,
            "definition": policy.definition,
        });
        self.send(Method::PUT, &["policies", vhost, &policy.name], Some(body)).await?;
        self.remember(vhost, &policy.name, Some(policy)).await;
        Ok(())
    }

    /// Deletes a policy; a missing one counts as deleted.
    pub async fn delete_policy(&self, vhost: &str, name: &str) -> Result<(), ManagementError> {
        self.send(Method::DELETE, &["policies", vhost, name], None).await?;
        self.remember(vhost, name, None).await;
        Ok(())
    }

    /// The broker's version (`3.10.8`), None where the API does not say.
    pub async fn version(&self) -> Result<Option<String>, ManagementError> {
        let overview: Option<Value> = self.get_query(&["overview"], "columns=rabbitmq_version").await?;
        Ok(overview.and_then(|o| o.get("rabbitmq_version")?.as_str().map(str::to_owned)))
    }

    /// The vhost's default queue type (`classic`, `quorum`), None where it has none (3.10 says
    /// `undefined`).
    pub async fn default_queue_type(&self, vhost: &str) -> Result<Option<String>, ManagementError> {
        let v: Option<Value> = self.get_query(&["vhosts", vhost], "columns=default_queue_type").await?;
        let named = v.and_then(|v| v.get("default_queue_type")?.as_str().map(str::to_owned));
        Ok(named.filter(|t| t != "undefined"))
    }

    /// The vhost's operator policies (merged with a queue's policy, never outranked by one).
    pub async fn operator_policies(&self, vhost: &str) -> Result<Vec<PolicyInfo>, ManagementError> {
        Ok(self.get_opt(&["operator-policies", vhost]).await?.unwrap_or_default())
    }

    pub async fn connections(&self) -> Result<Vec<ConnectionInfo>, ManagementError> {
        Ok(self.get_opt(&["connections"]).await?.unwrap_or_default())
    }

    /// The consumers of one vhost.
    pub async fn consumers_in(&self, vhost: &str) -> Result<Vec<ConsumerInfo>, ManagementError> {
        let rows: Vec<Value> = self.get_opt(&["consumers", vhost]).await?.unwrap_or_default();
        live_consumers(rows).map_err(|e| unexpected_answer(&["consumers", vhost], &e))
    }

    /// The client connections of one vhost: name, the client's own name and when it connected.
    pub async fn connections_in(&self, vhost: &str) -> Result<Vec<ConnectionSummary>, ManagementError> {
        Ok(self
            .get_query(&["vhosts", vhost, "connections"], "columns=name,user_provided_name,connected_at")
            .await?
            .unwrap_or_default())
    }

    /// Names of the queues of a vhost.
    pub async fn queue_names(&self, vhost: &str) -> Result<Vec<String>, ManagementError> {
        let rows: Vec<Value> = self.get_query(&["queues", vhost], "columns=name").await?.unwrap_or_default();
        Ok(rows.iter().filter_map(|r| r.get("name")?.as_str().map(str::to_owned)).collect())
    }

    /// The bindings whose destination is this queue, the default exchange's among them.
    pub async fn queue_bindings(&self, vhost: &str, queue: &str) -> Result<Vec<BindingInfo>, ManagementError> {
        Ok(self.get_opt(&["queues", vhost, queue, "bindings"]).await?.unwrap_or_default())
    }

    /// Deletes the binding of `queue` to `exchange` whose properties key is `key`; a missing one
    /// counts as deleted.
    pub async fn delete_queue_binding(
        &self,
        vhost: &str,
        exchange: &str,
        queue: &str,
        key: &str,
    ) -> Result<(), ManagementError> {
        self.send(Method::DELETE, &["bindings", vhost, "e", exchange, "q", queue, key], None).await.map(drop)
    }

    /// The cluster's feature flags; None where the API has no such listing.
    pub async fn feature_flags(&self) -> Result<Option<Vec<FeatureFlag>>, ManagementError> {
        self.get_opt(&["feature-flags"]).await
    }

    /// The cluster's nodes: whether each runs, and its plugins.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, ManagementError> {
        Ok(self.get_query(&["nodes"], "columns=name,running,enabled_plugins").await?.unwrap_or_default())
    }

    /// Force-closes a client connection, as an administrator would.
    pub async fn close_connection(&self, name: &str) -> Result<(), ManagementError> {
        self.send(Method::DELETE, &["connections", name], None).await.map(drop)
    }

    async fn get_opt<T: DeserializeOwned>(&self, path: &[&str]) -> Result<Option<T>, ManagementError> {
        self.get_query(path, "").await
    }

    async fn get_query<T: DeserializeOwned>(&self, path: &[&str], query: &str) -> Result<Option<T>, ManagementError> {
        match self.send_query(Method::GET, path, query, None).await? {
            None => Ok(None),
            Some(body) => serde_json::from_slice(&body).map(Some).map_err(|e| unexpected_answer(path, &e)),
        }
    }

    /// Sends one request. 404 is `Ok(None)`; other errors name the call, never the credentials.
    async fn send(
        &self,
        method: Method,
        path: &[&str],
        body: Option<Value>,
    ) -> Result<Option<Vec<u8>>, ManagementError> {
        self.send_query(method, path, "", body).await
    }

    /// Sends one request to the node in use, and on to the next nodes in turn while they are
    /// unreachable (every request here is a read or an idempotent write). The node that answers
    /// is used from then on.
    async fn send_query(
        &self,
        method: Method,
        path: &[&str],
        query: &str,
        body: Option<Value>,
    ) -> Result<Option<Vec<u8>>, ManagementError> {
        let write = method != Method::GET;
        let _write_permit =
            if write { Some(self.writes.acquire().await.expect("the semaphore is never closed")) } else { None };
        let _permit = self.in_flight.acquire().await.expect("the semaphore is never closed");
        let mut outcome = self.attempt(method.clone(), path, query, body.clone()).await;
        for _ in 1..self.endpoint.base_urls.len() {
            let Err(ManagementError::Unreachable { detail, .. }) = &outcome else { break };
            let from = self.display();
            self.current.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(%from, to = %self.display(), %detail, "management API unreachable; trying the next node");
            outcome = self.attempt(method.clone(), path, query, body.clone()).await;
        }
        outcome
    }

    async fn attempt(
        &self,
        method: Method,
        path: &[&str],
        query: &str,
        body: Option<Value>,
    ) -> Result<Option<Vec<u8>>, ManagementError> {
        let write = method != Method::GET;
        let creates = matches!(method, Method::PUT | Method::POST);
        self.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut url = self.url(path)?;
        if !query.is_empty() {
            url.set_query(Some(query));
        }
        let what = format!("{method} {}", describe(path));
        let timeout = if write { WRITE_TIMEOUT } else { TIMEOUT };
        let mut request = self
            .http
            .request(method, url)
            .timeout(timeout)
            .basic_auth(&self.endpoint.username, Some(&self.endpoint.password));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let unreachable = |detail: String| ManagementError::Unreachable { endpoint: self.display(), detail };
        let failed = |e: reqwest::Error| {
            if e.is_timeout() {
                unreachable(format!("no answer to {what} within {}s", timeout.as_secs()))
            } else {
                unreachable(error_chain(&e))
            }
        };
        let response = request.send().await.map_err(failed)?;
        let status = response.status();
        let bytes = match super::body::read(response, super::body::CAP).await {
            Ok(bytes) => bytes,
            Err(super::body::BodyError::Read(e)) => return Err(failed(e)),
            Err(e) => return Err(ManagementError::TooLarge { endpoint: self.display(), what, detail: e.to_string() }),
        };
        match status {
            s if s.is_success() => Ok(Some(bytes)),
            // Absent, for a read or a delete. A write that finds no path (a vhost that does
            // not exist) did not happen.
            StatusCode::NOT_FOUND if !creates => Ok(None),
            s if s.is_server_error() => Err(unreachable(format!("HTTP {s} on {what}"))),
            s => Err(ManagementError::Rejected { what, status: s.as_u16(), reason: reason_of(&bytes) }),
        }
    }

    fn url(&self, path: &[&str]) -> Result<reqwest::Url, ManagementError> {
        if let Some(dot) = path.iter().find(|p| !addressable(p)) {
            return Err(ManagementError::Unaddressable((*dot).to_owned()));
        }
        let encoded: Vec<String> = path.iter().map(|p| utf8_percent_encode(p, NON_ALPHANUMERIC).to_string()).collect();
        let mut url = self.base_url().clone();
        url.set_path(&format!("{}api/{}", url.path(), encoded.join("/")));
        Ok(url)
    }
}

/// A GET answered 200 with a body that is not what the API documents.
fn unexpected_answer(path: &[&str], e: &serde_json::Error) -> ManagementError {
    ManagementError::UnexpectedBody { what: format!("GET {}", describe(path)), detail: e.to_string() }
}

fn describe(path: &[&str]) -> String {
    format!("/api/{}", path.join("/"))
}

/// The `reason` of a management API error body, with its HTML escaping undone.
fn reason_of(body: &[u8]) -> String {
    let reason = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("reason").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(200).collect());
    reason.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").trim().to_owned()
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumers_of_a_closing_channel_are_left_out_and_the_rest_still_read() {
        let consumer = |tag: &str, details: Value| {
            serde_json::json!({
                "consumer_tag": tag, "prefetch_count": 3, "ack_required": false,
                "queue": {"name": "orders", "vhost": "/"}, "channel_details": details,
            })
        };
        let open = serde_json::json!({"name": "10.0.0.7:5555 -> 10.0.0.2:5672 (1)", "peer_host": "10.0.0.7"});
        let rows = vec![
            consumer("a", open),
            consumer("closing-3.10", serde_json::json!([])),
            consumer("closing", serde_json::json!({})),
        ];
        let live = live_consumers(rows).unwrap();
        assert_eq!(live.iter().map(|c| c.consumer_tag.as_str()).collect::<Vec<_>>(), ["a"]);
        assert_eq!((live[0].prefetch_count, live[0].ack_required), (3, false));
        assert_eq!(live[0].channel_details.peer_host.as_deref(), Some("10.0.0.7"));
        // Anything else unreadable is still an error, not a silently shorter list.
        let mut broken = consumer("b", serde_json::json!({"name": "x"}));
        broken["queue"] = Value::Null;
        assert!(live_consumers(vec![broken]).is_err());
    }

    #[test]
    fn urls_encode_every_segment() {
        let endpoint = ManagementEndpoint {
            base_urls: vec!["http://h:15672/prefix/".parse().unwrap()],
            username: "u".into(),
            password: "p".into(),
            metrics_urls: Vec::new(),
        };
        let client = ManagementClient::new(endpoint, None).unwrap();
        assert_eq!(
            client.url(&["queues", "/", "a.b c"]).unwrap().as_str(),
            "http://h:15672/prefix/api/queues/%2F/a%2Eb%20c"
        );
        // Percent-encoded or not, `.` and `..` are dot segments: `policies/../p` is `/api/p`.
        for dot in [".", ".."] {
            assert!(matches!(client.url(&["policies", dot, "p"]), Err(ManagementError::Unaddressable(d)) if d == dot));
        }
    }

    /// An HTTP server that answers every request after `delay` (never, for None) and reports
    /// the most requests it held at once, by method.
    async fn slow_server(delay: Option<Duration>) -> (ManagementClient, Arc<std::sync::Mutex<[usize; 4]>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}/", listener.local_addr().unwrap()).parse().unwrap();
        // [GETs now, GETs at most, writes now, writes at most]
        let seen = Arc::new(std::sync::Mutex::new([0usize; 4]));
        let counts = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let counts = counts.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && socket.read(&mut byte).await.unwrap_or(0) == 1 {
                        head.push(byte[0]);
                    }
                    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                    let length = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |n| n.trim().parse().unwrap());
                    let mut body = vec![0u8; length];
                    socket.read_exact(&mut body).await.unwrap();
                    let slot = if head.starts_with(b"GET") { 0 } else { 2 };
                    {
                        let mut c = counts.lock().unwrap();
                        c[slot] += 1;
                        c[slot + 1] = c[slot + 1].max(c[slot]);
                    }
                    let Some(delay) = delay else { return std::future::pending().await };
                    tokio::time::sleep(delay).await;
                    counts.lock().unwrap()[slot] -= 1;
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n[]";
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        let endpoint = ManagementEndpoint {
            base_urls: vec![base_url],
            username: "u".into(),
            password: "p".into(),
            metrics_urls: Vec::new(),
        };
        (ManagementClient::new(endpoint, None).unwrap(), seen)
    }

    #[tokio::test]
    async fn a_silent_management_api_is_reported_as_such_after_the_timeout() {
        let (client, _) = slow_server(None).await;
        let err = client.queue_names("/").await.unwrap_err().to_string();
        assert!(err.contains("unreachable: no answer to GET /api/queues/") && err.ends_with("within 10s"), "{err}");
    }

    #[tokio::test]
    async fn writes_go_one_at_a_time_while_reads_share_the_bound() {
        let (client, seen) = slow_server(Some(Duration::from_millis(200))).await;
        let policy = PolicyInfo {
            name: "p".into(),
            pattern: "^q$".into(),
            apply_to: "queues".into(),
            priority: 1,
            definition: Map::new(),
        };
        let writes = (0..3).map(|_| client.put_policy("/", &policy));
        let reads = (0..6).map(|_| client.queue_names("/"));
        let (w, r) = tokio::join!(futures::future::join_all(writes), futures::future::join_all(reads));
        assert!(w.iter().all(Result::is_ok) && r.iter().all(Result::is_ok));
        let [_, reads_at_once, _, writes_at_once] = *seen.lock().unwrap();
        assert_eq!(writes_at_once, WRITES_IN_FLIGHT);
        assert!(reads_at_once > 1 && reads_at_once <= IN_FLIGHT, "{reads_at_once}");
    }

    #[test]
    fn error_reasons_are_unescaped() {
        let body = br#"{"error":"bad_request","reason":"Validation failed\n\n&lt;&lt;\"bogus\"&gt;&gt; is not a valid overflow value\n"}"#;
        assert_eq!(reason_of(body), "Validation failed\n\n<<\"bogus\">> is not a valid overflow value");
        assert_eq!(reason_of(b"plain text"), "plain text");
    }
}
