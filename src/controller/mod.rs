//! The Kubernetes side: the kube-runtime Controller over QueuePolicies, the finalizer, Secrets,
//! status patches and Events. Decisions come from [`crate::reconcile`], [`crate::status`] and
//! [`crate::events`]; this module only performs the I/O they call for.

pub mod gate_io;
pub mod pattern;
mod secrets;

use self::gate_io::{Gate, QueueWatch, SYNC_WAIT};
use crate::sync::lock;
use crate::workload::{Kind, rollout::Rollout};
use crate::{
    broker::BrokerPool,
    claims::{self, Claims},
    consumers::{QueueKey, TrackerPool},
    converge::{self, Cleanup},
    crd::{API_VERSION, DeletionPolicy, QueuePolicy, QueuePolicyStatus},
    events::{self, EventReason, EventSpec},
    findings,
    gate::index::{ObjectKey, Unbound},
    http::{Endpoints, Health},
    leader::{HoldEnd, LeaderElector},
    metrics::{Metrics, PolicyLabels},
    pass,
    pattern::crd::QueuePattern,
    plan::{self, Limits, QueuePlan},
    secret,
    status::{Check, Outcome, Reason, next_status},
};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, ReplicaSet, StatefulSet},
        core::v1::Pod,
        policy::v1::PodDisruptionBudget,
    },
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{
        Controller, Predicate, WatchStreamExt,
        controller::Action,
        events::{Event, EventType, Recorder, Reporter},
        finalizer::{self, Event as Finalizer},
        predicates,
        reflector::{self, ObjectRef},
        watcher::{self, watcher},
    },
};
use serde_json::json;
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::sync::mpsc;

pub use crate::names::{FIELD_MANAGER, FINALIZER};
const DELETION_RETRY: Duration = Duration::from_secs(30);
/// How often the consumer hygiene findings look at a queue: short enough for counters to show
/// trends, long enough that a thousand policies cost a few management API reads a second.
pub const FINDINGS_EVERY: Duration = Duration::from_secs(20);
/// Reconciles in flight at once, per resource kind: enough to keep one broker connection busy,
/// few enough that a cold start of thousands of policies does not flood the broker.
pub const CONCURRENCY: u16 = 16;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("deletion blocked: {0}")]
    DeletionBlocked(String),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    #[error("the QueuePolicy has no uid yet")]
    MissingUid,
    #[error("lost the leader lease")]
    LeadershipLost,
    #[error("gave up the leader lease: the pod-condition writer has had no answer from the API server for {0:?}")]
    WriterStalled(Duration),
    #[error(
        "the gate's watches (QueuePolicies, Deployments, StatefulSets, Rollouts, ReplicaSets, Pods, PodDisruptionBudgets) have not synced yet"
    )]
    NotSynced,
    #[error("--leader-election needs this replica's name: set POD_NAME or --pod-name")]
    MissingPodName,
    #[error("{flag} needs the operator's namespace: set POD_NAMESPACE or --pod-namespace")]
    MissingNamespace { flag: &'static str },
    #[error(
        "--webhook-addr needs a certificate: --webhook-cert-dir, or --webhook-secret with --webhook-service and --webhook-config"
    )]
    MissingWebhookCertificate,
    #[error("--http-addr {addr}: {source}")]
    HttpBind { addr: std::net::SocketAddr, source: std::io::Error },
}

impl Error {
    /// A short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(_) => "kube",
            Self::DeletionBlocked(_) => "deletion_blocked",
            Self::Finalizer(_) => "finalizer",
            Self::MissingUid => "missing_uid",
            Self::LeadershipLost | Self::WriterStalled(_) => "leadership_lost",
            Self::NotSynced => "not_synced",
            Self::MissingPodName
            | Self::MissingNamespace { .. }
            | Self::MissingWebhookCertificate
            | Self::HttpBind { .. } => "startup",
        }
    }
}

/// Everything a reconcile reaches for.
pub struct Context {
    pub client: Client,
    pub brokers: Arc<BrokerPool>,
    /// One consumer tracker per broker server.
    pub trackers: Arc<TrackerPool>,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub limits: Limits,
    /// The rollout gate: its index, the pod condition writer, and what wakes policies.
    pub gate: Arc<Gate>,
    wake_rx: Mutex<Option<mpsc::UnboundedReceiver<ObjectRef<QueuePolicy>>>>,
    /// What the operator keeps about each policy between reconciles; removed with the policy.
    memos: Mutex<HashMap<ObjectRef<QueuePolicy>, Memo>>,
    /// What the QueuePattern watch remembers between looks.
    watched: pattern::Watched,
    secrets: secrets::Secrets,
    /// Every QueuePolicy and QueuePattern as the controllers' watches hold them, for what a
    /// deleted policy must leave to the others (`claims`).
    others: std::sync::OnceLock<Others>,
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
            recorder,
            brokers,
            trackers,
            metrics,
            client,
            limits,
            gate,
            wake_rx: Mutex::new(Some(wake_rx)),
            memos: Mutex::default(),
            watched: Mutex::default(),
            secrets: secrets::Secrets::default(),
            others: std::sync::OnceLock::new(),
        }
    }
}

impl Context {
    /// The controllers' caches of every QueuePolicy and QueuePattern (set once, when they start).
    pub fn know_others(&self, others: Others) {
        let _ = self.others.set(others);
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
        Ok(claims::others(policy, plan, &others.policies.state(), &others.patterns.state(), self.limits))
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

/// What `queueguard run` starts, as the command line gives it.
pub struct RunConfig {
    /// Watch only this namespace (default: all namespaces).
    pub namespace: Option<String>,
    /// Of what is watched, act only on objects in these namespaces (None: all).
    pub only_namespaces: Option<std::collections::BTreeSet<String>>,
    /// Connection name the broker shows for the operator's AMQP connections.
    pub connection_name: String,
    /// The probes and `/metrics`.
    pub http_addr: std::net::SocketAddr,
    /// The leader Lease; None runs the controller without leader election.
    pub lease: Option<crate::leader::LeaseConfig>,
    pub webhook: Option<crate::webhook::server::Webhook>,
}

/// Runs the operator until SIGTERM or Ctrl-C: the HTTP endpoints and the webhook on every
/// replica, the controller on the leader only.
pub async fn run(config: RunConfig) -> Result<(), Error> {
    let RunConfig { namespace, only_namespaces, connection_name, http_addr, lease, webhook } = config;
    let client = crate::kube_api::client().await?;
    let ctx = Arc::new(Context::new(client.clone(), &connection_name));
    let health = Arc::new(Health::new(lease.is_some()));
    let endpoints = Arc::new(Endpoints {
        metrics: ctx.metrics.clone(),
        health: health.clone(),
        brokers: ctx.brokers.clone(),
        trackers: ctx.trackers.clone(),
    });
    let http =
        tokio::net::TcpListener::bind(http_addr).await.map_err(|source| Error::HttpBind { addr: http_addr, source })?;
    tokio::spawn(crate::http::serve(http, endpoints, Default::default()));
    if let Some(webhook) = webhook {
        start_webhook(webhook, &client, namespace.as_deref());
    }
    let elector = match lease {
        Some(cfg) => {
            let elector = LeaderElector::new(client.clone(), cfg);
            tokio::select! {
                since = elector.acquire() => Some((elector, since)),
                () = shutdown_signal() => return Ok(()),
            }
        }
        None => None,
    };
    health.set_leading(true);
    ctx.metrics.leading(true);
    let writer = ctx.gate.clone();
    let scope = Scope { namespace: namespace.clone(), only: only_namespaces.map(Arc::new) };
    let controller = run_controller(scope, ctx, health);
    let stalled = || writer.writer_unanswered().filter(|d| *d >= gate_io::WRITER_STALL);
    let outcome = match &elector {
        Some((e, since)) => tokio::select! {
            () = controller => Ok(()),
            end = e.hold(*since, || stalled().is_some()) => Err(match end {
                HoldEnd::Lost => Error::LeadershipLost,
                HoldEnd::Unfit => Error::WriterStalled(stalled().unwrap_or(gate_io::WRITER_STALL)),
            }),
        },
        None => {
            controller.await;
            Ok(())
        }
    };
    // A lost Lease is not ours to release; a stalled writer's is, so a standby need not wait it out.
    if let Some((e, _)) = &elector
        && matches!(outcome, Ok(()) | Err(Error::WriterStalled(_)))
        && let Err(err) = e.release().await
    {
        tracing::warn!(error = %err, "could not release the leader lease");
    }
    outcome
}

fn start_webhook(server: crate::webhook::server::Webhook, client: &Client, namespace: Option<&str>) {
    let api: Api<QueuePolicy> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let (store, writer) = reflector::store();
    let policies = reflector::reflector(writer, watcher(api, watcher::Config::default().any_semantic()))
        .default_backoff()
        .applied_objects();
    tokio::spawn(policies.for_each(|_| async {}));
    let client = client.clone();
    tokio::spawn(async move {
        if let Err(e) = server.serve(client, store).await {
            tracing::error!(error = %e, "admission webhook stopped");
        }
    });
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// What the controller watches (one namespace, or all) and acts on (listed namespaces, or all).
struct Scope {
    namespace: Option<String>,
    only: Option<Arc<std::collections::BTreeSet<String>>>,
}

impl Scope {
    /// Keeps a watch event unless it is about an object outside the namespaces acted on.
    fn keeps<K: Resource>(&self, event: &watcher::Event<K>) -> bool {
        let Some(only) = &self.only else { return true };
        match event {
            watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o) => {
                o.meta().namespace.as_ref().is_some_and(|ns| only.contains(ns))
            }
            watcher::Event::Init | watcher::Event::InitDone => true,
        }
    }

    /// The watcher of kind `K` in this scope, objects outside it left out.
    fn watch<K>(
        self: &Arc<Self>,
        client: &Client,
    ) -> impl futures::Stream<Item = watcher::Result<watcher::Event<K>>> + use<K>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned
            + Send
            + 'static,
        <K as Resource>::DynamicType: Default,
    {
        let scope = self.clone();
        watcher(scoped::<K>(client, self.namespace.as_deref()), watcher::Config::default().any_semantic())
            .default_backoff()
            .try_filter(move |e| std::future::ready(scope.keeps(e)))
    }
}

/// Whether the API server serves Argo Rollouts' `rollouts` (its CRD is installed). Asked once
/// at start: a watch of a kind that is not served would fail and retry for ever.
async fn serves_rollouts(client: &Client) -> bool {
    match client.list_api_group_resources("argoproj.io/v1alpha1").await {
        Ok(list) => list.resources.iter().any(|r| r.name == "rollouts"),
        Err(kube::Error::Api(e)) if e.code == 404 => false,
        Err(e) => {
            tracing::warn!(error = %e, "could not ask whether the cluster serves Argo Rollouts; not watching Rollouts");
            false
        }
    }
}

async fn run_controller(scope: Scope, ctx: Arc<Context>, health: Arc<Health>) {
    let client = ctx.client.clone();
    let scope = Arc::new(scope);
    let ns = scope.namespace.as_deref();
    let wakes = ctx.take_wake_receiver().expect("taken once");
    tracing::info!(namespace = ns.unwrap_or("*"), "starting controller");
    // The gate's index is fed by the watches themselves: no LISTs per reconcile.
    let gate = ctx.gate.clone();
    tokio::spawn(async move {
        gate.synced().await;
        health.set_synced();
    });
    let g = ctx.gate.clone();
    tokio::spawn(gate_io::feed(scope.watch::<Deployment>(&client), move |e| g.on(e)));
    let g = ctx.gate.clone();
    tokio::spawn(gate_io::feed(scope.watch::<StatefulSet>(&client), move |e| g.on(e)));
    if serves_rollouts(&client).await {
        let g = ctx.gate.clone();
        tokio::spawn(gate_io::feed(scope.watch::<Rollout>(&client), move |e| g.on(e)));
    } else {
        tracing::info!(
            "the cluster serves no Argo Rollouts API (argoproj.io/v1alpha1 rollouts): Rollouts are not watched; restart the operator after installing Argo Rollouts"
        );
        ctx.gate.kind_unavailable(Kind::Rollout);
    }
    // Only the owner of each ReplicaSet is read: it leads a pod to its Deployment or Rollout.
    let g = ctx.gate.clone();
    tokio::spawn(gate_io::feed(scope.watch::<kube::api::PartialObjectMeta<ReplicaSet>>(&client), move |e| g.on(e)));
    let g = ctx.gate.clone();
    tokio::spawn(gate_io::feed(scope.watch::<Pod>(&client), move |e| g.on(e)));
    let g = ctx.gate.clone();
    tokio::spawn(gate_io::feed(scope.watch::<PodDisruptionBudget>(&client), move |e| g.on(e)));
    // Status-only updates must not trigger a reconcile: counts change on every pass over a busy
    // queue, so each status patch would otherwise start the next pass at once. Spec changes bump
    // the generation (deletion too); finalizer edits do not, so they are watched as well. The
    // gate sees every event of the same watch.
    let (policy_store, policy_writer) = reflector::store();
    let (pattern_store, pattern_writer) = reflector::store();
    ctx.know_others(Others { policies: policy_store.clone(), patterns: pattern_store.clone() });
    let g = ctx.gate.clone();
    let trigger = scope
        .watch::<QueuePolicy>(&client)
        .inspect(move |e| {
            if let Ok(e) = e {
                g.on(e);
            }
        })
        .reflect(policy_writer)
        .applied_objects()
        .predicate_filter(predicates::generation.combine(predicates::finalizers), Default::default());
    let wakes = futures::stream::unfold(wakes, |mut rx| async { rx.recv().await.map(|r| (r, rx)) });
    let policies = Controller::for_stream(trigger, policy_store)
        .reconcile_on(wakes)
        .with_config(kube::runtime::controller::Config::default().concurrency(CONCURRENCY))
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|result| async move {
            match result {
                Ok((obj, _)) => tracing::debug!(policy = %obj, "reconciled"),
                Err(e) => tracing::warn!(error = %e, "reconcile failed"),
            }
        });
    // Status-only updates of patterns must not wake them either.
    let pattern_trigger = scope
        .watch::<QueuePattern>(&client)
        .reflect(pattern_writer)
        .applied_objects()
        .predicate_filter(predicates::generation.combine(predicates::finalizers), Default::default());
    let patterns = Controller::for_stream(pattern_trigger, pattern_store)
        .with_config(kube::runtime::controller::Config::default().concurrency(CONCURRENCY))
        .shutdown_on_signal()
        .run(pattern::reconcile, pattern::error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::warn!(error = %e, "QueuePattern reconcile failed");
            }
        });
    futures::join!(policies, patterns);
}

/// The API of a namespaced kind, in one namespace or in all.
fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope>,
    <K as Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

#[tracing::instrument(skip_all, fields(policy = %format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any())))]
pub async fn reconcile(policy: Arc<QueuePolicy>, ctx: Arc<Context>) -> Result<Action, Error> {
    finalized(policy, &ctx, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await
}

/// Runs one reconcile of a namespaced resource behind the operator's finalizer, counting it in
/// the metrics. The handler's own errors come back as they are, not wrapped.
pub(crate) async fn finalized<K, F, Fut>(object: Arc<K>, ctx: &Context, handle: F) -> Result<Action, Error>
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

pub fn error_policy(policy: Arc<QueuePolicy>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(policy = %policy.name_any(), error = %error, kind = error.metric_label(), "reconcile error");
    match error {
        Error::DeletionBlocked(_) => Action::requeue(DELETION_RETRY),
        _ => Action::requeue(Duration::from_secs(15)),
    }
}

async fn apply(policy: &QueuePolicy, ctx: &Context) -> Result<Action, Error> {
    let me = ObjectRef::from_obj(policy);
    let previous = last_written(ctx, policy).or_else(|| policy.status.clone());
    let previous = previous.as_ref();
    let planned = plan::plan(policy, ctx.limits);
    ctx.gate.upsert_policy(policy);
    let (mut outcome, reached, mut events) = match &planned {
        Err(errors) => (Outcome::blocked(Check::failed(Reason::InvalidSpec, plan::describe(errors))), None, vec![]),
        Ok(plan) => broker_side(policy, plan, previous, ctx).await?,
    };
    bind_gate(policy, &planned, reached.as_ref(), &outcome, ctx);

    let mut recheck = None;
    if let (Ok(plan), Some((broker, tracker))) = (&planned, &reached)
        && outcome.queue.is_ok()
    {
        outcome.findings = look(ctx, &me, plan, broker, tracker.as_deref()).await;
        recheck = Some(FINDINGS_EVERY);
    }
    if let Ok(QueuePlan { gate: Some(gate_plan), .. }) = &planned {
        let pass = gate_io::run(policy, gate_plan, ctx).await?;
        outcome.gate = Some(pass.report);
        events.extend(pass.events);
        recheck = [recheck, pass.recheck_after].into_iter().flatten().min();
    }

    report(policy, previous, &outcome, &events, ctx).await?;
    let after = [pass::requeue_after(planned.as_ref().ok(), &outcome), recheck].into_iter().flatten().min();
    Ok(after.map_or_else(Action::await_change, Action::requeue))
}

/// A broker endpoint reached, and its consumer tracker when that could start.
type Reached = (Arc<crate::broker::Broker>, Option<Arc<crate::consumers::ConsumerTracker>>);

/// The broker side of a pass: reach the broker, watch the queue, and converge, unless this
/// generation's outcome is fresh and the queue was not deleted meanwhile (then it is declared
/// again, with a Warning Event).
async fn broker_side(
    policy: &QueuePolicy,
    plan: &QueuePlan,
    previous: Option<&QueuePolicyStatus>,
    ctx: &Context,
) -> Result<(Outcome, Option<Reached>, Vec<EventSpec>), Error> {
    let broker = match broker_of_policy(policy, plan, ctx).await? {
        Err(check) => return Ok((Outcome::blocked(check), None, vec![])),
        Ok(broker) => broker,
    };
    let me = ObjectRef::from_obj(policy);
    let generation = policy.metadata.generation;
    let queue = QueueKey::new(broker.vhost(), &plan.queue);
    let dead_letter_queue = QueueKey::new(broker.vhost(), &plan.dead_letter_queue);
    // Every managed queue and dead-letter queue is watched (the gate's binding, made by every
    // pass, gated or not), so a deletion behind the operator's back is repaired at once. Both
    // are taken: each deletion is told once.
    let tracker = ctx.trackers.tracker(&broker.uri, broker.ca_cert.clone()).ok();
    let deleted: Vec<&str> = [&queue, &dead_letter_queue]
        .into_iter()
        .filter(|q| tracker.as_ref().is_some_and(|t| t.take_deleted(q)))
        .map(|q| q.name.as_str())
        .collect();
    let mut events = Vec::new();
    let outcome = match recent_outcome(ctx, &me, generation, plan).filter(|_| deleted.is_empty()) {
        Some(outcome) => outcome,
        None => {
            let mode = pass::mode_for(plan, previous, generation);
            let bindings = previous.map(|s| s.applied_bindings.clone()).unwrap_or_default();
            let outcome = converge::converge(plan, &broker, &bindings, mode).await;
            remember(ctx, &me, generation, &outcome);
            if !deleted.is_empty() && mode == converge::Mode::Declare && outcome.queue.is_ok() {
                events.push(EventSpec {
                    warning: true,
                    reason: EventReason::Condition(Reason::QueueRecreated),
                    action: "DeclareQueue",
                    note: format!(
                        "queue '{}' was deleted behind the operator's back and has been declared again",
                        deleted.join("' and '")
                    ),
                });
            }
            outcome
        }
    };
    Ok((outcome, Some((broker, tracker)), events))
}

/// Tells the gate where this policy counts its consumers, or why it cannot.
fn bind_gate(
    policy: &QueuePolicy,
    planned: &Result<QueuePlan, Vec<plan::FieldError>>,
    reached: Option<&Reached>,
    outcome: &Outcome,
    ctx: &Context,
) {
    let binding = match (planned, reached) {
        (Ok(plan), Some((b, Some(t)))) => Ok(QueueWatch {
            tracker: t.clone(),
            queue: QueueKey::new(b.vhost(), &plan.queue),
            dead_letter_queue: QueueKey::new(b.vhost(), &plan.dead_letter_queue),
        }),
        (Ok(_), Some((_, None))) => Err(Unbound::TrackingNotStarted),
        _ => Err(Unbound::NotReady(outcome.ready().message)),
    };
    ctx.gate.bind(&ObjectKey::of(policy), binding);
}

/// Metrics, status and Events for what this pass found.
async fn report(
    policy: &QueuePolicy,
    previous: Option<&QueuePolicyStatus>,
    outcome: &Outcome,
    events: &[EventSpec],
    ctx: &Context,
) -> Result<(), Error> {
    let labels = PolicyLabels { namespace: policy.namespace().unwrap_or_default(), policy: policy.name_any() };
    ctx.metrics.record_outcome(&labels, outcome);
    let status = next_status(previous, outcome, policy.metadata.generation, Timestamp::now());
    write_status(policy, previous, status, ctx).await?;
    for event in events {
        publish_for(policy, ctx, event).await;
    }
    Ok(())
}

/// Consumer hygiene, at most every [`FINDINGS_EVERY`]; None keeps the previous findings.
async fn look(
    ctx: &Context,
    me: &ObjectRef<QueuePolicy>,
    plan: &QueuePlan,
    broker: &crate::broker::Broker,
    tracker: Option<&crate::consumers::ConsumerTracker>,
) -> Option<findings::Report> {
    let memory = {
        let memos = lock(&ctx.memos);
        match memos.get(me).and_then(|m| m.looked.as_ref()) {
            Some((_, at)) if at.elapsed() < FINDINGS_EVERY => return None,
            Some((memory, _)) => memory.clone(),
            None => findings::Memory::default(),
        }
    };
    let queues = findings::sample::Queues { queue: &plan.queue, dead_letter_queue: &plan.dead_letter_queue };
    let seen = match findings::sample::sample(queues, broker, tracker).await {
        Ok(seen) => seen,
        Err(why) => {
            tracing::debug!(%why, "could not look at the queue's consumers");
            return None;
        }
    };
    let (memory, report) = findings::evaluate(&memory, &seen, &plan.findings);
    lock(&ctx.memos).entry(me.clone()).or_default().looked = Some((memory, Instant::now()));
    Some(report)
}

/// The broker-side outcome of this generation, if it is fresh enough to skip re-declaring.
fn recent_outcome(
    ctx: &Context,
    me: &ObjectRef<QueuePolicy>,
    generation: Option<i64>,
    plan: &QueuePlan,
) -> Option<Outcome> {
    let memos = lock(&ctx.memos);
    let c = memos.get(me)?.converged.as_ref()?;
    let fresh = c.generation == generation
        && c.outcome.is_ready()
        && pass::requeue_after(Some(plan), &c.outcome).is_some_and(|renew| c.at.elapsed() < renew);
    fresh.then(|| c.outcome.clone())
}

fn remember(ctx: &Context, me: &ObjectRef<QueuePolicy>, generation: Option<i64>, outcome: &Outcome) {
    let mut memos = lock(&ctx.memos);
    memos.entry(me.clone()).or_default().converged =
        Some(Converged { generation, at: Instant::now(), outcome: outcome.clone() });
}

/// Deleting a QueuePolicy: Retain leaves everything; Delete removes an empty, unused queue.
async fn cleanup(policy: &QueuePolicy, ctx: &Context) -> Result<Action, Error> {
    let me = ObjectRef::from_obj(policy);
    // No longer voting nor owning budgets: the index has the writer bring the budgets of its
    // workloads in line with the other guarding policies, or delete them.
    ctx.gate.forget_policy(&ObjectKey::of(policy));
    ctx.metrics.forget(&PolicyLabels { namespace: me.namespace.clone().unwrap_or_default(), policy: me.name.clone() });
    lock(&ctx.memos).remove(&me);
    let plan = match plan::plan(policy, ctx.limits) {
        Ok(plan) => plan,
        // A queue declared under an earlier, valid spec stays until the spec says again which it
        // is: the finalizer is not given up on a queue deletionPolicy Delete would remove.
        Err(errors) if policy.spec.deletion_policy == DeletionPolicy::Delete && was_declared(policy) => {
            let check = Check::failed(
                Reason::DeletionBlocked,
                format!(
                    "the queue cannot be checked and deleted while the spec is invalid ({}); fix the spec, or set deletionPolicy: Retain to leave the queue",
                    plan::describe(&errors)
                ),
            );
            let status = next_status(
                policy.status.as_ref(),
                &Outcome::blocked(check.clone()),
                policy.metadata.generation,
                Timestamp::now(),
            );
            write_status(policy, policy.status.as_ref(), status, ctx).await?;
            return Err(Error::DeletionBlocked(check.message));
        }
        // Never declared anything from an invalid spec: nothing to clean.
        Err(_) => return Ok(Action::await_change()),
    };
    if plan.deletion == DeletionPolicy::Retain {
        let note = format!(
            "queue '{}' and its settings stay on the broker (deletionPolicy Retain); x-expires removes it once unused",
            plan.queue
        );
        publish_for(
            policy,
            ctx,
            &EventSpec {
                warning: false,
                reason: EventReason::Condition(Reason::QueueRetained),
                action: "Cleanup",
                note,
            },
        )
        .await;
        return Ok(Action::await_change());
    }
    let broker = match broker_of_policy(policy, &plan, ctx).await? {
        Ok(broker) => broker,
        Err(check) => {
            // Without credentials nothing can be checked, so nothing is deleted.
            let note = format!("queue '{}' left in place: {}", plan.queue, check.message);
            publish_for(
                policy,
                ctx,
                &EventSpec {
                    warning: true,
                    reason: EventReason::Condition(Reason::QueueRetained),
                    action: "Cleanup",
                    note,
                },
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    let claims = ctx.claims_of_others(policy, &plan).await?;
    match converge::delete(&plan, &broker, &claims).await {
        Cleanup::Deleted(note) => {
            publish_for(
                policy,
                ctx,
                &EventSpec {
                    warning: false,
                    reason: EventReason::Condition(Reason::QueueDeleted),
                    action: "Cleanup",
                    note,
                },
            )
            .await;
            Ok(Action::await_change())
        }
        Cleanup::Blocked(check) => {
            let reason = if check.reason == Reason::BrokerUnreachable { check.reason } else { Reason::DeletionBlocked };
            let blocked = Check { reason, ..check.clone() };
            let status = next_status(
                policy.status.as_ref(),
                &Outcome::blocked(blocked),
                policy.metadata.generation,
                Timestamp::now(),
            );
            write_status(policy, policy.status.as_ref(), status, ctx).await?;
            Err(Error::DeletionBlocked(check.message))
        }
    }
}

/// Whether the operator ever saw the policy's queue on the broker (status keeps the last look).
fn was_declared(policy: &QueuePolicy) -> bool {
    policy.status.as_ref().is_some_and(|s| s.queue.is_some())
}

/// The shared broker endpoint, or the condition explaining why not. A missing Secret is a
/// condition; other API errors are retried.
async fn broker_of_policy(
    policy: &QueuePolicy,
    plan: &QueuePlan,
    ctx: &Context,
) -> Result<Result<Arc<crate::broker::Broker>, Check>, Error> {
    let ns = policy.namespace().unwrap_or_else(|| "default".into());
    broker_from_secret(ctx, &ns, &plan.secret_name, plan.vhost.as_deref()).await
}

/// The broker endpoint whose credentials Secret `secret_name` holds, or the condition saying
/// why not.
pub(crate) async fn broker_from_secret(
    ctx: &Context,
    ns: &str,
    secret_name: &str,
    vhost: Option<&str>,
) -> Result<Result<Arc<crate::broker::Broker>, Check>, Error> {
    let Some(found) = ctx.secrets.get(&ctx.client, ns, secret_name).await? else {
        return Ok(Err(Check::failed(Reason::SecretNotFound, format!("Secret '{ns}/{secret_name}' not found"))));
    };
    Ok(secret::credentials(&found).and_then(|creds| pass::broker_for(&ctx.brokers, secret_name, vhost, &creds)))
}

/// The status this operator last wrote for this very policy (same uid), while the watch cache
/// has not caught up with it; once it has, the cache's copy serves and this one is let go.
fn last_written(ctx: &Context, policy: &QueuePolicy) -> Option<QueuePolicyStatus> {
    let mut memos = lock(&ctx.memos);
    let memo = memos.get_mut(&ObjectRef::from_obj(policy))?;
    let (uid, status) = memo.written.as_ref()?;
    let seen = same_as_stored(policy.status.as_ref(), status);
    if Some(uid.as_str()) != policy.uid().as_deref() || seen {
        memo.written = None;
        return None;
    }
    Some(status.clone())
}

/// Whether `status` is what `stored` says, compared as the API stores it: times there have
/// whole seconds, so an in-memory time with milliseconds would otherwise always differ.
fn same_as_stored(stored: Option<&QueuePolicyStatus>, status: &QueuePolicyStatus) -> bool {
    stored.map(serde_json::to_value).and_then(Result::ok) == serde_json::to_value(status).ok()
}

/// Patches `.status` (server-side apply, one field manager) only when it changed, then publishes
/// an Event per condition transition.
async fn write_status(
    policy: &QueuePolicy,
    previous: Option<&QueuePolicyStatus>,
    status: QueuePolicyStatus,
    ctx: &Context,
) -> Result<(), Error> {
    if same_as_stored(previous, &status) {
        return Ok(());
    }
    let ns = policy.namespace().unwrap_or_else(|| "default".into());
    let api: Api<QueuePolicy> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = json!({ "apiVersion": API_VERSION, "kind": "QueuePolicy", "status": status });
    api.patch_status(&policy.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    lock(&ctx.memos).entry(ObjectRef::from_obj(policy)).or_default().written =
        Some((policy.uid().unwrap_or_default(), status.clone()));
    let old = previous.map(|s| s.conditions.as_slice()).unwrap_or_default();
    for event in events::transitions(old, &status.conditions) {
        publish_for(policy, ctx, &event).await;
    }
    Ok(())
}

/// Publishes an Event; a failure is logged, never fatal to the reconcile.
pub(crate) async fn publish_for<K: Resource<DynamicType = ()>>(object: &K, ctx: &Context, spec: &EventSpec) {
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
        publish_for(&policy, &ctx, &spec).await;
        let note = server.await.unwrap();
        assert!(spec.note.len() > 2_000 && note.len() <= 1024, "{} bytes", note.len());
        assert!(note.starts_with("pod worker-abc waits") && note.ends_with("..."));
    }
}
