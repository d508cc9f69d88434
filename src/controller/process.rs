//! The process: `queueguard run` wires the HTTP endpoints, the webhook, leader election and the
//! two controllers (QueuePolicies and QueuePatterns) with the gate's watches, and ends on a
//! signal, a lost Lease, or a writer that cannot write.

use super::{CONCURRENCY, Context, Others, gate_io, pattern, policy};
use crate::{
    crd::QueuePolicy,
    http::{Endpoints, Health},
    leader::{HoldEnd, LeaderElector},
    pattern::crd::QueuePattern,
    workload::{Kind, rollout::Rollout},
};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::{
    apps::v1::{Deployment, ReplicaSet, StatefulSet},
    core::v1::Pod,
    policy::v1::PodDisruptionBudget,
};
use kube::{
    Api, Client, Resource,
    runtime::{
        Controller, Predicate, WatchStreamExt, predicates,
        reflector::{self},
        watcher::{self, watcher},
    },
};
use std::{sync::Arc, time::Duration};

/// Why the operator stopped, other than being told to.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("--http-addr {addr}: {source}")]
    HttpBind { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("lost the leader lease")]
    LeadershipLost,
    #[error("gave up the leader lease: the gate's writer has had no answer from the API server for {0:?}")]
    WriterStalled(Duration),
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
    /// Watch the Messaging Topology Operator's Queues.
    pub topology_queues: bool,
    /// The leader Lease; None runs the controller without leader election.
    pub lease: Option<crate::leader::LeaseConfig>,
    pub webhook: Option<crate::webhook::server::Webhook>,
}

/// Runs the operator until SIGTERM or Ctrl-C: the HTTP endpoints and the webhook on every
/// replica, the controller on the leader only.
pub async fn run(config: RunConfig) -> Result<(), RunError> {
    let RunConfig { namespace, only_namespaces, connection_name, http_addr, topology_queues, lease, webhook } = config;
    let client = crate::kube_api::client().await?;
    let ctx = Arc::new(Context::new(client.clone(), &connection_name));
    let health = Arc::new(Health::new(lease.is_some()));
    let endpoints = Arc::new(Endpoints {
        metrics: ctx.shared.metrics.clone(),
        health: health.clone(),
        brokers: ctx.shared.brokers.clone(),
        trackers: ctx.trackers.clone(),
    });
    let http = tokio::net::TcpListener::bind(http_addr)
        .await
        .map_err(|source| RunError::HttpBind { addr: http_addr, source })?;
    tokio::spawn(crate::http::serve(http, endpoints, Default::default()));
    if let Some(webhook) = webhook {
        health.expect_webhook();
        start_webhook(webhook, &client, namespace.as_deref(), only_namespaces.clone().map(Arc::new), health.clone());
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
    ctx.shared.metrics.leading(true);
    let writer = ctx.gate.clone();
    let scope = Scope { namespace: namespace.clone(), only: only_namespaces.map(Arc::new) };
    if topology_queues {
        watch_topology_queues(&client, namespace.as_deref(), &ctx).await;
    }
    let controller = run_controller(scope, ctx, health);
    let stalled = || writer.writer_unanswered().filter(|d| *d >= gate_io::WRITER_STALL);
    let outcome = match &elector {
        Some((e, since)) => tokio::select! {
            () = controller => Ok(()),
            end = e.hold(*since, || stalled().is_some()) => Err(match end {
                HoldEnd::Lost => RunError::LeadershipLost,
                HoldEnd::Unfit => RunError::WriterStalled(stalled().unwrap_or(gate_io::WRITER_STALL)),
            }),
        },
        None => {
            controller.await;
            Ok(())
        }
    };
    // A lost Lease is not ours to release; a stalled writer's is, so a standby need not wait it out.
    if let Some((e, _)) = &elector
        && matches!(outcome, Ok(()) | Err(RunError::WriterStalled(_)))
        && let Err(err) = e.release().await
    {
        tracing::warn!(error = %err, "could not release the leader lease");
    }
    outcome
}

/// Serves the webhook from its own QueuePolicy list; the replica is Ready once that list is in.
fn start_webhook(
    server: crate::webhook::server::Webhook,
    client: &Client,
    namespace: Option<&str>,
    acting_in: Option<Arc<std::collections::BTreeSet<String>>>,
    health: Arc<Health>,
) {
    let api: Api<QueuePolicy> = crate::kube_api::scoped(client, namespace);
    let (store, writer) = reflector::store();
    let policies = reflector::reflector(writer, watcher(api, watcher::Config::default().any_semantic()))
        .default_backoff()
        .applied_objects();
    tokio::spawn(policies.for_each(|_| async {}));
    let synced = store.clone();
    tokio::spawn(async move {
        if synced.wait_until_ready().await.is_ok() {
            health.set_webhook_synced();
        }
    });
    let client = client.clone();
    tokio::spawn(async move {
        if let Err(e) = server.serve(client, store, acting_in).await {
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
        watcher(
            crate::kube_api::scoped::<K>(client, self.namespace.as_deref()),
            watcher::Config::default().any_semantic(),
        )
        .default_backoff()
        .try_filter(move |e| std::future::ready(scope.keeps(e)))
    }
}

/// Whether the API server serves `resource` of `group_version` (its CRD is installed). Asked
/// once at start: a watch of a kind that is not served would fail and retry for ever.
async fn serves(client: &Client, group_version: &str, resource: &str) -> bool {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource),
        Err(kube::Error::Api(e)) if e.code == 404 => false,
        Err(e) => {
            tracing::warn!(error = %e, "could not ask whether the cluster serves {group_version} {resource}; not watching them");
            false
        }
    }
}

/// Keeps the Messaging Topology Operator's Queues in a watch cache the reconciles read, when
/// the API server serves them (a watch of a kind that is not served would fail for ever). Every
/// Queue in the watched scope: one in a namespace the operator does not act on may still declare
/// a queue a policy names.
async fn watch_topology_queues(client: &Client, namespace: Option<&str>, ctx: &Context) {
    if !serves(client, "rabbitmq.com/v1beta1", "queues").await {
        tracing::warn!(
            "--topology-queues: the cluster serves no rabbitmq.com/v1beta1 queues (the Messaging Topology Operator's CRDs are not installed); not watching them, restart the operator after installing it"
        );
        return;
    }
    let (store, writer) = reflector::store();
    let api = crate::kube_api::scoped::<crate::topology::Queue>(client, namespace);
    let queues = reflector::reflector(writer, watcher(api, watcher::Config::default().any_semantic()))
        .default_backoff()
        .applied_objects();
    tokio::spawn(queues.for_each(|_| async {}));
    ctx.know_topology_queues(store);
}

async fn run_controller(scope: Scope, ctx: Arc<Context>, health: Arc<Health>) {
    let client = ctx.shared.client.clone();
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
    if serves(&client, "argoproj.io/v1alpha1", "rollouts").await {
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
        .run(policy::reconcile, policy::error_policy, ctx.clone())
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
        .run(pattern::reconcile, pattern::error_policy, Arc::new(ctx.patterns()))
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::warn!(error = %e, "QueuePattern reconcile failed");
            }
        });
    futures::join!(policies, patterns);
}
