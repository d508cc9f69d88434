//! The Kubernetes side, by role: the process (`process`: endpoints, webhook, leader election,
//! the controllers and the gate's watches), the QueuePolicy controller's steps (`policy`) and
//! the QueuePattern controller's (`pattern`), the one status writer both use (`status_writer`),
//! the gate's I/O (`gate_io`), and the Secret cache (`secrets`). Here: what every reconcile
//! shares, its errors and its context.

pub mod gate_io;
mod migration;
pub mod pattern;
mod policy;
mod process;
mod reads;
mod status_writer;

pub use policy::{error_policy, reconcile};
pub use process::{RunConfig, RunError, run};

use self::gate_io::{Gate, SYNC_WAIT};
use crate::sync::lock;
use crate::{
    broker::BrokerPool,
    broker_source::BrokerSource,
    claims::{self, Claims},
    consumers::TrackerPool,
    crd::{QueuePolicy, QueuePolicyStatus},
    events::{self, EventSpec},
    findings,
    metrics::{Metrics, PolicyLabels},
    pass,
    pattern::crd::QueuePattern,
    plan::{Limits, QueuePlan},
    secret,
    status::{Check, Outcome, Reason},
};
use kube::{
    Api, Client, Resource, ResourceExt,
    runtime::{
        controller::Action,
        events::{Event, EventType, Recorder, Reporter},
        finalizer::{self, Event as Finalizer},
        reflector::{self, ObjectRef},
    },
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::sync::mpsc;

pub use crate::names::{FIELD_MANAGER, FINALIZER};
/// How often the consumer hygiene findings look at a queue: short enough for counters to show
/// trends, long enough that a thousand policies cost a few management API reads a second.
pub const FINDINGS_EVERY: Duration = Duration::from_secs(20);
/// Reconciles in flight at once, per resource kind: enough to keep one broker connection busy,
/// few enough that a cold start of thousands of policies does not flood the broker.
pub const CONCURRENCY: u16 = 16;

/// Why a reconcile failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("deletion blocked: {0}")]
    DeletionBlocked(String),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    #[error(
        "the gate's watches (QueuePolicies, Deployments, StatefulSets, Rollouts, ReplicaSets, Pods, PodDisruptionBudgets) have not synced yet"
    )]
    NotSynced,
}

impl Error {
    /// A short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(_) => "kube",
            Self::DeletionBlocked(_) => "deletion_blocked",
            Self::Finalizer(_) => "finalizer",
            Self::NotSynced => "not_synced",
        }
    }
}

/// What both controllers reach for: the API client, the broker endpoints and the Secrets naming
/// them, metrics and Events.
pub struct Shared {
    pub client: Client,
    pub brokers: Arc<BrokerPool>,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub limits: Limits,
    secrets: reads::Secrets,
    clusters: reads::Clusters,
}

/// What a QueuePolicy reconcile reaches for.
pub struct Context {
    pub shared: Arc<Shared>,
    /// One consumer tracker per broker server.
    pub trackers: Arc<TrackerPool>,
    /// The rollout gate: its index, the one writer, and what wakes policies.
    pub gate: Arc<Gate>,
    wake_rx: Mutex<Option<mpsc::UnboundedReceiver<ObjectRef<QueuePolicy>>>>,
    /// What the operator keeps about each policy between reconciles; removed with the policy.
    memos: Mutex<HashMap<ObjectRef<QueuePolicy>, Memo>>,
    /// Every QueuePolicy and QueuePattern as the controllers' watches hold them, for what a
    /// deleted policy must leave to the others (`claims`).
    others: std::sync::OnceLock<Others>,
    /// The Messaging Topology Operator's Queues, when the operator watches them.
    topology: std::sync::OnceLock<reflector::Store<crate::topology::Queue>>,
}

/// What a QueuePattern reconcile reaches for.
pub struct PatternContext {
    pub shared: Arc<Shared>,
    /// What the QueuePattern watch remembers between looks.
    watched: pattern::Watched,
}

/// The watch caches of the two kinds that name broker entities.
#[derive(Clone)]
pub struct Others {
    pub policies: reflector::Store<QueuePolicy>,
    pub patterns: reflector::Store<QueuePattern>,
}

/// What the operator keeps about one policy between reconciles.
#[derive(Default)]
struct Memo {
    /// The last broker-side outcome, reused by passes that only the gate needs (a consumer
    /// attached): re-declaring on every consumer event would load the broker for nothing and
    /// slow the gate down.
    converged: Option<Converged>,
    /// What the findings remember between looks, and when the last look was.
    looked: Option<(findings::Memory, Instant)>,
    /// The status last written, with the policy's uid, until the watch cache holds it too. The
    /// cache can still hold an older one when the next pass starts; built on that, the pass
    /// would undo the last one's work (the findings' conditions it keeps between looks) and
    /// write status again.
    written: Option<(String, QueuePolicyStatus)>,
}

struct Converged {
    generation: Option<i64>,
    at: Instant,
    outcome: Outcome,
}

impl Context {
    pub fn new(client: Client, connection_name: &str) -> Self {
        Self::with_limits(client, connection_name, Limits::default())
    }

    pub fn with_limits(client: Client, connection_name: &str, limits: Limits) -> Self {
        let reporter = Reporter { controller: "queueguard".into(), instance: std::env::var("POD_NAME").ok() };
        let recorder = Recorder::new(client.clone(), reporter);
        let metrics: Arc<Metrics> = Arc::default();
        let (gate, wake_rx) = Gate::start(client.clone(), recorder.clone(), metrics.clone(), limits);
        let brokers = Arc::new(BrokerPool::new(connection_name));
        let trackers = Arc::new(TrackerPool::new(connection_name));
        tokio::spawn(sweep_brokers(Arc::downgrade(&brokers), Arc::downgrade(&trackers)));
        Self {
            shared: Arc::new(Shared {
                recorder,
                brokers,
                metrics,
                client,
                limits,
                secrets: reads::Secrets::default(),
                clusters: reads::Clusters::default(),
            }),
            trackers,
            gate,
            wake_rx: Mutex::new(Some(wake_rx)),
            memos: Mutex::default(),
            others: std::sync::OnceLock::new(),
            topology: std::sync::OnceLock::new(),
        }
    }

    /// The QueuePattern controller's context, sharing this one's client, brokers and Secrets.
    pub fn patterns(&self) -> PatternContext {
        PatternContext { shared: self.shared.clone(), watched: Mutex::default() }
    }
}

impl Context {
    /// The controllers' caches of every QueuePolicy and QueuePattern (set once, when they start).
    pub fn know_others(&self, others: Others) {
        let _ = self.others.set(others);
    }

    /// The watch cache of the Messaging Topology Operator's Queues (set once, when it starts).
    pub fn know_topology_queues(&self, queues: reflector::Store<crate::topology::Queue>) {
        let _ = self.topology.set(queues);
    }

    /// The Topology Operator Queue that declares the plan's queue on `broker`, if one does.
    /// Waits for the watch's first listing: before it, a Queue that exists would not be seen.
    async fn managed_elsewhere(
        &self,
        policy: &QueuePolicy,
        plan: &QueuePlan,
        broker: &crate::broker::Broker,
    ) -> Result<Option<String>, Error> {
        let Some(store) = self.topology.get() else { return Ok(None) };
        if tokio::time::timeout(SYNC_WAIT, store.wait_until_ready()).await.ok().and_then(Result::ok).is_none() {
            return Err(Error::NotSynced);
        }
        let queues = store.state();
        let namespace = policy.namespace().unwrap_or_default();
        let place = crate::topology::Place {
            namespace: &namespace,
            source: &plan.broker,
            hosts: broker.uri.nodes().iter().map(|n| n.host.as_str()).collect(),
            vhost: broker.vhost(),
        };
        Ok(crate::topology::managed_elsewhere(&plan.queue, &place, queues.iter().map(AsRef::as_ref)))
    }

    /// What the policies and patterns other than `policy` name, once the caches hold them all.
    async fn claims_of_others(&self, policy: &QueuePolicy, plan: &QueuePlan) -> Result<Claims, Error> {
        let Some(others) = self.others.get() else { return Ok(Claims::default()) };
        let ready = async {
            others.policies.wait_until_ready().await.ok()?;
            others.patterns.wait_until_ready().await.ok()
        };
        if tokio::time::timeout(SYNC_WAIT, ready).await.ok().flatten().is_none() {
            return Err(Error::NotSynced);
        }
        Ok(claims::others(policy, plan, &others.policies.state(), &others.patterns.state(), self.shared.limits))
    }

    /// The stream of policies the gate wakes up (their pods, Deployments, budgets or queue's
    /// consumers changed, or their queue was deleted); there is one receiver, for the controller.
    pub fn take_wake_receiver(&self) -> Option<mpsc::UnboundedReceiver<ObjectRef<QueuePolicy>>> {
        lock(&self.wake_rx).take()
    }
}

/// Lets go of broker endpoints and trackers no policy has asked for in a while (its Secret
/// rotated, its policies gone): their connections close.
async fn sweep_brokers(brokers: std::sync::Weak<BrokerPool>, trackers: std::sync::Weak<TrackerPool>) {
    const EVERY: Duration = Duration::from_secs(10);
    loop {
        tokio::time::sleep(EVERY).await;
        let (Some(brokers), Some(trackers)) = (brokers.upgrade(), trackers.upgrade()) else { return };
        if let Some(since) = Instant::now().checked_sub(crate::broker::IDLE_ENDPOINT) {
            brokers.sweep(since);
            trackers.sweep(since);
        }
    }
}

/// Runs one reconcile of a namespaced resource behind the operator's finalizer, counting it in
/// the metrics. The handler's own errors come back as they are, not wrapped.
pub(crate) async fn finalized<K, F, Fut>(object: Arc<K>, ctx: &Shared, handle: F) -> Result<Action, Error>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
    F: FnOnce(Finalizer<K>) -> Fut,
    Fut: std::future::Future<Output = Result<Action, Error>>,
{
    let ns = object.namespace().unwrap_or_else(|| "default".into());
    let labels = PolicyLabels { namespace: ns.clone(), policy: object.name_any() };
    let deleting = object.meta().deletion_timestamp.is_some();
    let started = Instant::now();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    let result = finalizer::finalizer(&api, FINALIZER, object, handle).await.map_err(|e| match e {
        finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(Box::new(other)),
    });
    // A cleanup that succeeded let go of the object and of its series: counting it would make
    // them again, for an object that is gone.
    if !(deleting && result.is_ok()) {
        ctx.metrics.reconciled(&labels, started.elapsed(), result.as_ref().err().map(Error::metric_label));
    }
    result
}

/// The broker endpoint whose credentials `source` gives a policy in `ns`, or the condition
/// saying why not.
pub(crate) async fn broker_from_source(
    ctx: &Shared,
    ns: &str,
    source: &BrokerSource,
    vhost: Option<&str>,
) -> Result<Result<Arc<crate::broker::Broker>, Check>, Error> {
    let creds = match source {
        BrokerSource::Secret { name } => match ctx.secrets.get(&ctx.client, ns, name).await? {
            None => Err(Check::failed(Reason::SecretNotFound, format!("Secret '{ns}/{name}' not found"))),
            Some(found) => secret::credentials(&found),
        },
        BrokerSource::RabbitmqCluster { name, namespace } => {
            cluster_credentials(ctx, ns, namespace.as_deref().unwrap_or(ns), name).await?
        }
    };
    Ok(creds.and_then(|creds| pass::broker_for(&ctx.brokers, source, vhost, &creds)))
}

/// The credentials of RabbitmqCluster `cluster_ns/name` for a policy in `ns`: the cluster's
/// status names its default user's Secret, in the cluster's namespace.
async fn cluster_credentials(
    ctx: &Shared,
    ns: &str,
    cluster_ns: &str,
    name: &str,
) -> Result<Result<crate::broker::BrokerCredentials, Check>, Error> {
    let who = format!("RabbitmqCluster '{cluster_ns}/{name}'");
    let cluster = match ctx.clusters.get(&ctx.client, cluster_ns, name).await {
        Ok(Some(cluster)) => cluster,
        Ok(None) => {
            return Ok(Err(Check::failed(
                Reason::RabbitmqClusterNotFound,
                format!("{who} not found (is the RabbitMQ Cluster Operator's CRD installed, and the name right?)"),
            )));
        }
        Err(kube::Error::Api(e)) if e.code == 403 => {
            return Ok(Err(Check::failed(
                Reason::ClusterReferenceNotAllowed,
                format!(
                    "the operator may not read {who}: install the chart with rabbitmqClusterOperator.enabled=true, which grants get on rabbitmqclusters"
                ),
            )));
        }
        Err(e) => return Err(e.into()),
    };
    if !cluster.allows(ns) {
        return Ok(Err(Check::failed(
            Reason::ClusterReferenceNotAllowed,
            format!(
                "{who} does not let namespace '{ns}' use it: its annotation {} must list '{ns}' (or '*'), as the Messaging Topology Operator requires",
                crate::rabbitmq_cluster::ALLOWED_NAMESPACES
            ),
        )));
    }
    let user = match cluster.default_user_secret() {
        Ok(user) => user,
        Err(check) => {
            // Being made: read it again next time rather than wait out the cache.
            ctx.clusters.forget(cluster_ns, name);
            return Ok(Err(check));
        }
    };
    let Some(user) = ctx.secrets.get_keeping(&ctx.client, cluster_ns, user, &cluster.default_user_keys()).await? else {
        return Ok(Err(Check::failed(
            Reason::SecretNotFound,
            format!("Secret '{cluster_ns}/{user}' (the default user of {who}) not found"),
        )));
    };
    let ca = match cluster.ca_secret() {
        Some(ca) => ctx.secrets.get(&ctx.client, cluster_ns, ca).await?,
        None => None,
    };
    Ok(cluster.credentials(&user, ca.as_ref()))
}

/// Publishes an Event; a failure is logged, never fatal to the reconcile.
pub(crate) async fn publish_for<K: Resource<DynamicType = ()>>(object: &K, ctx: &Shared, spec: &EventSpec) {
    let event = Event {
        type_: if spec.warning { EventType::Warning } else { EventType::Normal },
        reason: spec.reason.as_str().into(),
        note: Some(events::truncate(&spec.note)),
        action: spec.action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &object.object_ref(&())).await {
        tracing::warn!(error = %e, reason = spec.reason.as_str(), "could not publish event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventReason;
    use http::{Request, Response};
    use kube::client::Body;

    /// A note the API server would refuse (over 1 KiB, a RolloutStalled naming many pods and
    /// policies, say) goes out cut, not lost with its Event.
    #[tokio::test]
    async fn a_long_event_note_is_cut_to_what_the_api_server_takes() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let ctx = Context::new(Client::new(service, "default"), "test");
        let policy = crate::testing::policy_yaml("{}");
        let spec = EventSpec {
            warning: true,
            reason: EventReason::RolloutStalled,
            action: "GatePod",
            note: "pod worker-abc waits for its consumer on queue orders; ".repeat(40),
        };
        let server = tokio::spawn(async move {
            let (req, reply) = handle.next_request().await.expect("the Event");
            let body: serde_json::Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
            reply.send_response(
                Response::builder().status(201).body(Body::from(serde_json::to_vec(&body).unwrap())).unwrap(),
            );
            body["note"].as_str().unwrap().to_owned()
        });
        publish_for(&policy, &ctx.shared, &spec).await;
        let note = server.await.unwrap();
        assert!(spec.note.len() > 2_000 && note.len() <= 1024, "{} bytes", note.len());
        assert!(note.starts_with("pod worker-abc waits") && note.ends_with("..."));
    }
}
