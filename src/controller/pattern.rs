//! The QueuePattern controller: put the pattern's policy on the broker, look at the matching
//! queues every [`FINDINGS_EVERY`], report status, Events and metrics; on deletion remove the
//! policy (the queues stay).

use super::{Context, Error, FIELD_MANAGER, FINDINGS_EVERY, endpoint, finalized, publish_for};
use crate::{
    events::{EventSpec, finding_transitions, truncate},
    metrics::PolicyLabels,
    pattern::{
        self, WatchMemory, WatchReport,
        broker::{apply_policy, matching, remove_policy},
        crd::{PatternFinding, QueuePattern, QueuePatternStatus},
    },
    plan,
    status::{Check, ConditionType, Reason, Truth, condition_of, finding_condition},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Condition, jiff::Timestamp};
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{controller::Action, finalizer::Event as Finalizer, reflector::ObjectRef},
};
use serde_json::json;
use std::sync::Arc;

#[tracing::instrument(skip_all, fields(pattern = %format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())))]
pub async fn reconcile(p: Arc<QueuePattern>, ctx: Arc<Context>) -> Result<Action, Error> {
    finalized(p, &ctx, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await
}

pub fn error_policy(_: Arc<QueuePattern>, error: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(error = %error, kind = error.metric_label(), "QueuePattern reconcile error");
    Action::requeue(std::time::Duration::from_secs(15))
}

async fn apply(p: &QueuePattern, ctx: &Context) -> Result<Action, Error> {
    let ns = p.namespace().unwrap_or_else(|| "default".into());
    let me = ObjectRef::from_obj(p);
    let (ready, report, policy) = match pattern::plan(p, ctx.limits) {
        Err(errors) => (Check::failed(Reason::InvalidSpec, plan::describe(&errors)), None, None),
        Ok(plan) => match endpoint(ctx, &ns, &plan.secret_name, plan.vhost.as_deref()).await? {
            Err(check) => (check, None, None),
            Ok(broker) => {
                let mut applied = apply_policy(&plan, &broker).await;
                let report = if applied.is_ok() {
                    match matching(&plan, &broker).await {
                        Ok((seen, elsewhere)) => {
                            if elsewhere > 0 {
                                applied.message.push_str(&format!(
                                    "; {elsewhere} matching queue(s) follow another policy with a higher priority instead"
                                ));
                            }
                            let memory =
                                ctx.watched.lock().unwrap_or_else(|e| e.into_inner()).remove(&me).unwrap_or_default();
                            let (memory, report) = pattern::evaluate(&memory, &seen, &plan.ignore);
                            ctx.watched.lock().unwrap_or_else(|e| e.into_inner()).insert(me.clone(), memory);
                            Some(report)
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "could not list the matching queues");
                            None
                        }
                    }
                } else {
                    None
                };
                (applied, report, Some(plan.policy_name))
            }
        },
    };
    let labels = PolicyLabels { namespace: ns.clone(), policy: p.name_any() };
    if let Some(r) = &report {
        ctx.metrics.pattern_observed(&labels, r);
    }
    let previous = p.status.as_ref();
    let status = next_status(previous, &ready, report.as_ref(), policy, p.metadata.generation, Timestamp::now());
    if previous != Some(&status) {
        let api: Api<QueuePattern> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = json!({ "apiVersion": crate::crd::API_VERSION, "kind": "QueuePattern", "status": status });
        api.patch_status(&p.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
        let old = previous.map(|s| s.conditions.as_slice()).unwrap_or_default();
        for event in transitions(old, &status.conditions) {
            publish_for(p, ctx, &event).await;
        }
    }
    Ok(Action::requeue(FINDINGS_EVERY))
}

async fn cleanup(p: &QueuePattern, ctx: &Context) -> Result<Action, Error> {
    let me = ObjectRef::from_obj(p);
    ctx.watched.lock().unwrap_or_else(|e| e.into_inner()).remove(&me);
    ctx.metrics.forget_pattern(&PolicyLabels { namespace: p.namespace().unwrap_or_default(), policy: p.name_any() });
    let Ok(plan) = pattern::plan(p, ctx.limits) else { return Ok(Action::await_change()) };
    let ns = p.namespace().unwrap_or_else(|| "default".into());
    let note = match endpoint(ctx, &ns, &plan.secret_name, plan.vhost.as_deref()).await? {
        Ok(broker) => match remove_policy(&plan, &broker).await {
            Ok(()) => format!("policy '{}' removed; the matching queues stay, without its expiry", plan.policy_name),
            Err(e) => return Err(Error::DeletionBlocked(format!("removing policy '{}': {e}", plan.policy_name))),
        },
        Err(check) => format!("policy '{}' left on the broker: {}", plan.policy_name, check.message),
    };
    publish_for(p, ctx, &EventSpec { warning: false, reason: "PolicyRemoved".into(), action: "Cleanup", note }).await;
    Ok(Action::await_change())
}

/// The next status: Ready from the policy step, one condition per finding judged (kept from
/// the previous status when the queues could not be looked at).
pub fn next_status(
    previous: Option<&QueuePatternStatus>,
    ready: &Check,
    report: Option<&WatchReport>,
    policy: Option<String>,
    generation: Option<i64>,
    now: Timestamp,
) -> QueuePatternStatus {
    let old = previous.cloned().unwrap_or_default();
    let mut conditions = vec![condition_of(
        &old.conditions,
        ConditionType::Ready.as_str(),
        ready.status,
        ready.reason.as_str(),
        &ready.message,
        generation,
        now,
    )];
    match report {
        Some(r) => conditions.extend(
            r.verdicts
                .iter()
                .map(|(f, seen)| finding_condition(&old.conditions, f.as_str(), seen.as_deref(), generation, now)),
        ),
        None => conditions.extend(
            old.conditions.iter().filter(|c| PatternFinding::ALL.iter().any(|f| f.as_str() == c.type_)).cloned(),
        ),
    }
    QueuePatternStatus {
        observed_generation: generation,
        conditions,
        broker_policy: policy.or(old.broker_policy),
        queues: report.map(|r| r.queues.clone()).or(old.queues),
    }
}

/// Ready changing, and findings coming up (Warning) or clearing (Normal).
fn transitions(old: &[Condition], new: &[Condition]) -> Vec<EventSpec> {
    let mut events = Vec::new();
    let is_ready = |c: &&Condition| c.type_ == ConditionType::Ready.as_str();
    if let Some(ready) = new.iter().find(is_ready)
        && !old.iter().filter(is_ready).any(|w| w.status == ready.status && w.reason == ready.reason)
    {
        events.push(EventSpec {
            warning: Truth::of(&ready.status) != Truth::True,
            reason: ready.reason.clone(),
            action: "ApplyPolicy",
            note: truncate(&ready.message),
        });
    }
    let findings: Vec<&str> = PatternFinding::ALL.iter().map(|f| f.as_str()).collect();
    events.extend(finding_transitions(old, new, &findings, "WatchQueues"));
    events
}

/// What the pattern controller keeps between passes.
pub type Watched = std::sync::Mutex<std::collections::HashMap<ObjectRef<QueuePattern>, WatchMemory>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn findings_come_and_go_as_events_and_conditions() {
        let ready = Check::ok(Reason::PolicyApplied, "policy applied");
        let report = |seen: Option<&str>| WatchReport {
            queues: Default::default(),
            verdicts: vec![
                (PatternFinding::QueueLeak, seen.map(str::to_owned)),
                (PatternFinding::OrphanedReplies, None),
            ],
        };
        let t = Timestamp::from_second(100).unwrap();
        let first =
            next_status(None, &ready, Some(&report(None)), Some("queueguard.pattern.shop.r".into()), Some(1), t);
        let events = transitions(&[], &first.conditions);
        assert_eq!(
            events.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["PolicyApplied"],
            "NotSeen findings are no news"
        );
        let leaking = next_status(Some(&first), &ready, Some(&report(Some("40 queues match"))), None, Some(1), t);
        let events = transitions(&first.conditions, &leaking.conditions);
        assert_eq!((events.len(), events[0].reason.as_str(), events[0].warning), (1, "QueueLeak", true));
        let unseen = next_status(Some(&leaking), &ready, None, None, Some(1), t);
        assert_eq!(unseen.conditions, leaking.conditions, "without a look the findings stay");
        assert_eq!(unseen.broker_policy.as_deref(), Some("queueguard.pattern.shop.r"));
        let cleared = next_status(Some(&leaking), &ready, Some(&report(None)), None, Some(1), t);
        let events = transitions(&leaking.conditions, &cleared.conditions);
        assert_eq!((events[0].reason.as_str(), events[0].warning), ("FindingCleared", false));
    }
}
