//! The QueuePolicy controller's steps: reach the broker, converge the queue, bind the gate, look
//! at the consumers, report; on deletion, what deletionPolicy says. Decisions come from
//! [`crate::pass`], [`crate::converge`], [`crate::status`] and [`crate::gate`]; this performs
//! the I/O they call for.

use super::{
    Context, Converged, Error, FINDINGS_EVERY, broker_from_source, finalized,
    gate_io::{self, QueueWatch},
    migration::{self, Migrated},
    publish_for,
    status_writer::{last_written, write_policy_status},
};
use crate::{
    broker::management::LISTING_MAX_AGE,
    consumers::QueueKey,
    converge::{self, Cleanup},
    crd::{DeletionPolicy, QueuePolicy, QueuePolicyStatus},
    events::{EventReason, EventSpec},
    findings,
    gate::index::{ObjectKey, Unbound},
    metrics::PolicyLabels,
    migrate::{
        Bounds, Target,
        run::{midway, settle_policy},
    },
    pass,
    plan::{self, QueuePlan},
    status::{Check, Outcome, Reason, next_status},
    sync::lock,
};
use k8s_openapi::jiff::Timestamp;
use kube::{
    ResourceExt,
    runtime::{controller::Action, finalizer::Event as Finalizer, reflector::ObjectRef},
};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

const DELETION_RETRY: Duration = Duration::from_secs(30);

#[tracing::instrument(skip_all, fields(policy = %format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any())))]
pub async fn reconcile(policy: Arc<QueuePolicy>, ctx: Arc<Context>) -> Result<Action, Error> {
    finalized(policy, &ctx.shared, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await
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
    let planned = plan::plan(policy, ctx.shared.limits);
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
    let owner = ctx.managed_elsewhere(policy, plan, &broker).await?;
    if let Some(owner) = owner.as_deref().filter(|_| !plan.adopt) {
        let message = format!(
            "queue '{}' in vhost '{}' is managed by Queue '{owner}' of the Messaging Topology Operator: queueguard touches nothing. Set spec.adopt: true to report on it and guard its consumers beside that Queue, or delete the Queue to have queueguard declare it",
            plan.queue,
            broker.vhost()
        );
        return Ok((Outcome::blocked(Check::failed(Reason::ManagedElsewhere, message)), None, vec![]));
    }
    let me = ObjectRef::from_obj(policy);
    let generation = policy.metadata.generation;
    let queue = QueueKey::new(broker.vhost(), &plan.queue);
    let dead_letter_queue = QueueKey::new(broker.vhost(), &plan.dead_letter_queue);
    // Every managed queue and dead-letter queue is watched (the gate's binding, made by every
    // pass, gated or not), so a deletion behind the operator's back is repaired at once. Both
    // are taken: each deletion is told once.
    let tracker = ctx.trackers.tracker(&broker.uri, broker.ca_cert.clone()).ok();
    if plan.adopt {
        let outcome = converge::adopted(plan, &broker, owner.as_deref()).await;
        return Ok((outcome, Some((broker, tracker)), vec![]));
    }
    let deleted: Vec<&str> = [&queue, &dead_letter_queue]
        .into_iter()
        .filter(|q| tracker.as_ref().is_some_and(|t| t.take_deleted(q)))
        .map(|q| q.name.as_str())
        .collect();
    let mut events = Vec::new();
    // A migration whose restarted consumers are not back yet is looked at every pass.
    let restarting = previous
        .and_then(|s| s.migration.as_ref())
        .is_some_and(|m| m.phase == crate::crd::MigrationPhase::RestartingConsumers);
    let outcome = match recent_outcome(ctx, &me, generation, plan).filter(|_| deleted.is_empty() && !restarting) {
        Some(outcome) => outcome,
        None => {
            let migrated = migration::run(policy, plan, previous, &broker, tracker.as_ref(), ctx).await?;
            if let Migrated::Stopped(check, state) = migrated {
                let mut outcome = Outcome::blocked(check);
                outcome.migration = Some(state);
                return Ok((outcome, Some((broker, tracker)), events));
            }
            let mode = pass::mode_for(plan, previous, generation);
            let bindings = previous.map(|s| s.applied_bindings.clone()).unwrap_or_default();
            let mut outcome = converge::converge(plan, &broker, &bindings, mode).await;
            if let Migrated::Completed(state) = migrated {
                outcome.migration = Some(state);
            }
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
    ctx.shared.metrics.record_outcome(&labels, outcome);
    let status = next_status(previous, outcome, policy.metadata.generation, Timestamp::now());
    // Also after a restart of the operator, while a migration it recorded is under way.
    if let Some(m) = &status.migration {
        ctx.shared.metrics.record_migration(&labels, Some(m), m);
    }
    write_policy_status(policy, previous, status, ctx).await?;
    for event in events {
        publish_for(policy, &ctx.shared, event).await;
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
    let seen = match findings::sample::sample(queues, broker, tracker, LISTING_MAX_AGE).await {
        Ok(seen) => seen,
        Err(why) => {
            tracing::debug!(%why, "could not look at the queue's consumers");
            return None;
        }
    };
    if memory.has_seen(&seen) {
        return None;
    }
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
    ctx.shared
        .metrics
        .forget(&PolicyLabels { namespace: me.namespace.clone().unwrap_or_default(), policy: me.name.clone() });
    lock(&ctx.memos).remove(&me);
    let plan = match plan::plan(policy, ctx.shared.limits) {
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
            write_policy_status(policy, policy.status.as_ref(), status, ctx).await?;
            return Err(Error::DeletionBlocked(check.message));
        }
        // Never declared anything from an invalid spec: nothing to clean.
        Err(_) => return Ok(Action::await_change()),
    };
    if let Some(m) = policy.status.as_ref().and_then(|s| s.migration.as_ref()).filter(|m| midway(m)) {
        settle_midway(policy, &plan, m, ctx).await?;
    }
    if plan.deletion == DeletionPolicy::Retain {
        let note = format!(
            "queue '{}' and its settings stay on the broker (deletionPolicy Retain); x-expires removes it once unused",
            plan.queue
        );
        publish_for(
            policy,
            &ctx.shared,
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
                &ctx.shared,
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
                &ctx.shared,
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
            write_policy_status(policy, policy.status.as_ref(), status, ctx).await?;
            Err(Error::DeletionBlocked(check.message))
        }
    }
}

/// A migration left midway by the policy's deletion is settled before the finalizer goes: routes
/// and messages back in the queue, whatever shape it has, and no fence left. Until it can be,
/// the deletion waits and says why.
async fn settle_midway(
    policy: &QueuePolicy,
    plan: &QueuePlan,
    m: &crate::crd::MigrationStatus,
    ctx: &Context,
) -> Result<(), Error> {
    let midway = format!(
        "the migration of queue '{}' is midway ({}): its routes and messages are moved back into it before the policy goes",
        m.queue,
        m.phase.as_str()
    );
    let settled = match broker_of_policy(policy, plan, ctx).await? {
        Ok(broker) => {
            let queues = [Target::of_dead_letter_queue(plan), Target::of_queue(plan)];
            settle_policy(&broker, &queues, &Bounds::default()).await.map_err(|e| format!("{midway}, and: {e}"))
        }
        Err(check) => Err(format!("{midway}, and: {}", check.message)),
    };
    match settled {
        Ok(true) => {
            let note =
                format!("{midway}: done; it keeps the shape it has (the deletion stopped the migration to {})", m.to);
            let event = EventSpec {
                warning: true,
                reason: EventReason::Condition(Reason::MigrationRolledBack),
                action: "Cleanup",
                note,
            };
            publish_for(policy, &ctx.shared, &event).await;
            Ok(())
        }
        Ok(false) => Ok(()),
        Err(why) => {
            let check = Check::failed(Reason::DeletionBlocked, why);
            let outcome = Outcome::blocked(check.clone());
            let status = next_status(policy.status.as_ref(), &outcome, policy.metadata.generation, Timestamp::now());
            write_policy_status(policy, policy.status.as_ref(), status, ctx).await?;
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
    broker_from_source(&ctx.shared, &ns, &plan.broker, plan.vhost.as_deref()).await
}
