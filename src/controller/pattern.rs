//! The QueuePattern controller: put the pattern's policy on the broker, look at the matching
//! queues every [`FINDINGS_EVERY`], report status, Events and metrics; on deletion remove the
//! policy (the queues stay).

use super::{
    Error, FINDINGS_EVERY, PatternContext, broker_from_source, finalized, publish_for, status_writer::write_status,
};
use crate::{
    broker::management::LISTING_MAX_AGE,
    events::{EventReason, EventSpec},
    metrics::PolicyLabels,
    pattern::{
        self, WatchMemory,
        broker::{Matching, apply_policy, matching, remove_policy},
        crd::QueuePattern,
        status::{next_status, transitions},
    },
    plan,
    status::{Check, Reason},
    sync::lock,
};
use k8s_openapi::jiff::Timestamp;
use kube::{
    ResourceExt,
    runtime::{controller::Action, finalizer::Event as Finalizer, reflector::ObjectRef},
};
use std::sync::Arc;

#[tracing::instrument(skip_all, fields(pattern = %format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())))]
pub async fn reconcile(p: Arc<QueuePattern>, ctx: Arc<PatternContext>) -> Result<Action, Error> {
    finalized(p, &ctx.shared, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await
}

pub fn error_policy(_: Arc<QueuePattern>, error: &Error, _: Arc<PatternContext>) -> Action {
    tracing::warn!(error = %error, kind = error.metric_label(), "QueuePattern reconcile error");
    Action::requeue(std::time::Duration::from_secs(15))
}

async fn apply(p: &QueuePattern, ctx: &PatternContext) -> Result<Action, Error> {
    let ns = p.namespace().unwrap_or_else(|| "default".into());
    let me = ObjectRef::from_obj(p);
    let (ready, looked, policy) = match pattern::plan(p, ctx.shared.limits) {
        Err(errors) => (Check::failed(Reason::InvalidSpec, plan::describe(&errors)), None, None),
        Ok(plan) => match broker_from_source(&ctx.shared, &ns, &plan.broker, plan.vhost.as_deref()).await? {
            Err(check) => (check, None, None),
            Ok(broker) => {
                let mut applied = apply_policy(&plan, &broker).await;
                let looked = if applied.is_ok() {
                    match matching(&plan, &broker, LISTING_MAX_AGE).await {
                        Ok(Matching { seen, elsewhere, source }) => {
                            if elsewhere > 0 {
                                applied.message.push_str(&format!(
                                    "; {elsewhere} matching queue(s) follow another policy with a higher priority instead"
                                ));
                            }
                            let memory = lock(&ctx.watched).remove(&me).unwrap_or_default();
                            let (memory, report) = pattern::evaluate(&memory, &seen, &plan.ignore);
                            lock(&ctx.watched).insert(me.clone(), memory);
                            Some((report, source))
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "could not list the matching queues");
                            None
                        }
                    }
                } else {
                    None
                };
                (applied, looked, Some(plan.policy_name))
            }
        },
    };
    let labels = PolicyLabels { namespace: ns.clone(), policy: p.name_any() };
    if let Some((r, _)) = &looked {
        ctx.shared.metrics.record_pattern(&labels, r);
    }
    let previous = p.status.as_ref();
    let looked = looked.as_ref().map(|(r, source)| (r, *source));
    let status = next_status(previous, &ready, looked, policy, p.metadata.generation, Timestamp::now());
    if previous != Some(&status) {
        let old = previous.map(|s| s.conditions.as_slice()).unwrap_or_default();
        let events = transitions(old, &status.conditions);
        write_status(p, &ctx.shared, &status, events).await?;
    }
    Ok(Action::requeue(FINDINGS_EVERY))
}

async fn cleanup(p: &QueuePattern, ctx: &PatternContext) -> Result<Action, Error> {
    let me = ObjectRef::from_obj(p);
    lock(&ctx.watched).remove(&me);
    ctx.shared
        .metrics
        .forget_pattern(&PolicyLabels { namespace: p.namespace().unwrap_or_default(), policy: p.name_any() });
    let Ok(plan) = pattern::plan(p, ctx.shared.limits) else { return Ok(Action::await_change()) };
    let ns = p.namespace().unwrap_or_else(|| "default".into());
    let note = match broker_from_source(&ctx.shared, &ns, &plan.broker, plan.vhost.as_deref()).await? {
        Ok(broker) => {
            // Its regex leaves the vhost's listing filter (a pattern with the same regex adds it
            // back at its next read).
            broker.management.forget_pattern(broker.vhost(), &plan.pattern);
            match remove_policy(&plan, &broker).await {
                Ok(()) => {
                    format!("policy '{}' removed; the matching queues stay, without its expiry", plan.policy_name)
                }
                Err(e) => {
                    return Err(Error::DeletionBlocked(format!("removing policy '{}': {e}", plan.policy_name)));
                }
            }
        }
        Err(check) => format!("policy '{}' left on the broker: {}", plan.policy_name, check.message),
    };
    publish_for(
        p,
        &ctx.shared,
        &EventSpec { warning: false, reason: EventReason::PolicyRemoved, action: "Cleanup", note },
    )
    .await;
    Ok(Action::await_change())
}

/// What the pattern controller keeps between passes.
pub type Watched = std::sync::Mutex<std::collections::HashMap<ObjectRef<QueuePattern>, WatchMemory>>;
