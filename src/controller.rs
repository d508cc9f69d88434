//! The Kubernetes side: the kube-runtime Controller over QueuePolicies, the finalizer, Secrets,
//! status patches and Events. Decisions come from [`crate::reconcile`], [`crate::status`] and
//! [`crate::events`]; this module only performs the I/O they call for.

use crate::{
    broker::BrokerPool,
    cli::RunArgs,
    converge::{self, Cleanup},
    crd::{API_VERSION, DeletionPolicy, QueuePolicy, QueuePolicyStatus},
    events::{self, EventSpec},
    plan::{self, Limits, QueuePlan},
    reconcile, secret,
    status::{Check, Outcome, Reason, next_status},
};
use futures::StreamExt;
use k8s_openapi::{api::core::v1::Secret, jiff::Timestamp};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{
        Controller, Predicate, WatchStreamExt,
        controller::Action,
        events::{Event, EventType, Recorder, Reporter},
        finalizer::{self, Event as Finalizer},
        predicates, reflector,
        watcher::{self, watcher},
    },
};
use serde_json::json;
use std::{sync::Arc, time::Duration};

pub const FINALIZER: &str = "queueguard.io/cleanup";
/// The one field manager that owns `.status`.
pub const FIELD_MANAGER: &str = "queueguard";
const DELETION_RETRY: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("deletion blocked: {0}")]
    DeletionBlocked(String),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
}

impl Error {
    /// A short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(_) => "kube",
            Self::DeletionBlocked(_) => "deletion_blocked",
            Self::Finalizer(_) => "finalizer",
        }
    }
}

/// Everything a reconcile reaches for.
pub struct Context {
    pub client: Client,
    pub brokers: BrokerPool,
    pub recorder: Recorder,
    pub limits: Limits,
}

impl Context {
    pub fn new(client: Client, connection_name: &str) -> Self {
        let reporter = Reporter { controller: "queueguard".into(), instance: std::env::var("POD_NAME").ok() };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            brokers: BrokerPool::new(connection_name),
            client,
            limits: Limits::default(),
        }
    }
}

/// Runs the controller until SIGTERM or Ctrl-C.
pub async fn run(args: RunArgs) -> Result<(), Error> {
    let client = Client::try_default().await?;
    let policies: Api<QueuePolicy> = match &args.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let ctx = Arc::new(Context::new(client, &args.connection_name));
    tracing::info!(namespace = args.namespace.as_deref().unwrap_or("*"), "starting controller");
    // Status-only updates must not trigger a reconcile: counts change on every pass over a busy
    // queue, so each status patch would otherwise start the next pass at once. Spec changes bump
    // the generation (deletion too); finalizer edits do not, so they are watched as well.
    let (reader, writer) = reflector::store();
    let trigger = watcher(policies, watcher::Config::default().any_semantic())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation.combine(predicates::finalizers), Default::default());
    Controller::for_stream(trigger, reader)
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((obj, _)) => tracing::debug!(policy = %obj, "reconciled"),
                Err(e) => tracing::warn!(error = %e, "reconcile failed"),
            }
        })
        .await;
    Ok(())
}

#[tracing::instrument(skip_all, fields(policy = %format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any())))]
pub async fn reconcile(policy: Arc<QueuePolicy>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = policy.namespace().unwrap_or_else(|| "default".into());
    let api: Api<QueuePolicy> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer::finalizer(&api, FINALIZER, policy, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

pub fn error_policy(policy: Arc<QueuePolicy>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(policy = %policy.name_any(), error = %error, kind = error.metric_label(), "reconcile error");
    match error {
        Error::DeletionBlocked(_) => Action::requeue(DELETION_RETRY),
        _ => Action::requeue(Duration::from_secs(15)),
    }
}

async fn apply(policy: &QueuePolicy, ctx: &Context) -> Result<Action, Error> {
    let previous = policy.status.as_ref();
    let planned = plan::plan(policy, ctx.limits);
    let outcome = match &planned {
        Err(errors) => Outcome::blocked(Check::failed(Reason::InvalidSpec, plan::describe(errors))),
        Ok(plan) => match connect(policy, plan, ctx).await? {
            Err(check) => Outcome::blocked(check),
            Ok(broker) => {
                let mode = reconcile::mode_for(plan, previous, policy.metadata.generation);
                let bindings = previous.map(|s| s.applied_bindings.clone()).unwrap_or_default();
                converge::converge(plan, &broker, &bindings, mode).await
            }
        },
    };
    let status = next_status(previous, &outcome, policy.metadata.generation, Timestamp::now());
    write_status(policy, previous, status, ctx).await?;
    Ok(match reconcile::requeue_after(planned.as_ref().ok(), &outcome) {
        Some(after) => Action::requeue(after),
        None => Action::await_change(),
    })
}

/// Deleting a QueuePolicy: Retain leaves everything; Delete removes an empty, unused queue.
async fn cleanup(policy: &QueuePolicy, ctx: &Context) -> Result<Action, Error> {
    let Ok(plan) = plan::plan(policy, ctx.limits) else {
        // Never declared anything from an invalid spec: nothing to clean.
        return Ok(Action::await_change());
    };
    if plan.deletion == DeletionPolicy::Retain {
        let note = format!(
            "queue '{}' and its settings stay on the broker (deletionPolicy Retain); x-expires removes it once unused",
            plan.queue
        );
        publish(
            policy,
            ctx,
            &EventSpec { warning: false, reason: Reason::QueueRetained.as_str().into(), action: "Cleanup", note },
        )
        .await;
        return Ok(Action::await_change());
    }
    let broker = match connect(policy, &plan, ctx).await? {
        Ok(broker) => broker,
        Err(check) => {
            // Without credentials nothing can be checked, so nothing is deleted.
            let note = format!("queue '{}' left in place: {}", plan.queue, check.message);
            publish(
                policy,
                ctx,
                &EventSpec { warning: true, reason: Reason::QueueRetained.as_str().into(), action: "Cleanup", note },
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    match converge::delete(&plan, &broker).await {
        Cleanup::Deleted(note) => {
            publish(
                policy,
                ctx,
                &EventSpec { warning: false, reason: Reason::QueueDeleted.as_str().into(), action: "Cleanup", note },
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

/// The shared broker endpoint, or the condition explaining why not. A missing Secret is a
/// condition; other API errors are retried.
async fn connect(
    policy: &QueuePolicy,
    plan: &QueuePlan,
    ctx: &Context,
) -> Result<Result<Arc<crate::broker::Broker>, Check>, Error> {
    let ns = policy.namespace().unwrap_or_else(|| "default".into());
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(found) = secrets.get_opt(&plan.secret_name).await? else {
        return Ok(Err(Check::failed(Reason::SecretNotFound, format!("Secret '{ns}/{}' not found", plan.secret_name))));
    };
    Ok(secret::credentials(&found).and_then(|creds| reconcile::connect(&ctx.brokers, plan, &creds)))
}

/// Patches `.status` (server-side apply, one field manager) only when it changed, then publishes
/// an Event per condition transition.
async fn write_status(
    policy: &QueuePolicy,
    previous: Option<&QueuePolicyStatus>,
    status: QueuePolicyStatus,
    ctx: &Context,
) -> Result<(), Error> {
    if previous == Some(&status) {
        return Ok(());
    }
    let ns = policy.namespace().unwrap_or_else(|| "default".into());
    let api: Api<QueuePolicy> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = json!({ "apiVersion": API_VERSION, "kind": "QueuePolicy", "status": status });
    api.patch_status(&policy.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    let old = previous.map(|s| s.conditions.as_slice()).unwrap_or_default();
    for event in events::transitions(old, &status.conditions) {
        publish(policy, ctx, &event).await;
    }
    Ok(())
}

/// Publishes an Event; a failure is logged, never fatal to the reconcile.
async fn publish(policy: &QueuePolicy, ctx: &Context, spec: &EventSpec) {
    let event = Event {
        type_: if spec.warning { EventType::Warning } else { EventType::Normal },
        reason: spec.reason.clone(),
        note: Some(spec.note.clone()),
        action: spec.action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &policy.object_ref(&())).await {
        tracing::warn!(error = %e, reason = %spec.reason, "could not publish event");
    }
}
