//! A QueuePolicy's live queue change (`onChange: Migrate`): each step recorded in
//! status.migration before it is taken, an Event per step, and the restart of the guarded
//! workloads once the queue has its new shape, through their own rollout (the gate holds each
//! old pod until a new one consumes from the new queue).

use super::{Context, Error, publish_for, status_writer::write_policy_status};
use crate::{
    broker::Broker,
    consumers::{ConsumerTracker, QueueKey},
    crd::{MigrationPhase, MigrationStatus, OnChange, QueuePolicy, QueuePolicyStatus},
    duration::Human,
    events::{EventReason, EventSpec},
    gate::index::ObjectKey,
    metrics::PolicyLabels,
    migrate::{
        Bounds,
        run::{
            Journal, PolicyMigration, completed, midway, migrate_policy, next_attempt, plain_declare_note,
            settle_recorded,
        },
    },
    names::RESTARTED_AT,
    plan::QueuePlan,
    status::{Check, Reason, migrating, with_migration},
    workload::{Kind, WorkloadKey, rollout::Rollout},
};
use k8s_openapi::{
    api::apps::v1::{Deployment, StatefulSet},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
};
use serde_json::json;
use std::sync::Arc;

/// What a pass's migration left for the rest of the pass.
pub(super) enum Migrated {
    /// Nothing under way: converge as usual (the migration, if any, as status says).
    Idle,
    /// Its moves are done (or one left midway, onChange no longer Migrate, was settled): the pass
    /// goes on with this state to show (Completed, RolledBack, or RestartingConsumers while the
    /// restarted consumers are not back).
    Completed(MigrationStatus),
    /// It cannot go on now: the queue is left to the next pass (or to a changed spec).
    Stopped(Check, MigrationStatus),
}

/// Records each step in status.migration (and an Event) before it is taken.
struct StatusJournal<'a> {
    policy: &'a QueuePolicy,
    stored: Option<QueuePolicyStatus>,
    ctx: &'a Context,
    /// Told of each swap before it is taken, so the next pass does not take the deletion of the
    /// old queue for one behind the operator's back.
    tracker: Option<&'a Arc<ConsumerTracker>>,
    vhost: &'a str,
}

impl StatusJournal<'_> {
    async fn write(&mut self, m: &MigrationStatus) -> Result<(), Error> {
        if m.phase == MigrationPhase::Swapping
            && let Some(tracker) = &self.tracker
        {
            tracker.expect_deletion(&QueueKey::new(self.vhost, &m.queue));
        }
        let status = with_migration(self.stored.as_ref(), m, self.policy.metadata.generation, Timestamp::now());
        let labels =
            PolicyLabels { namespace: self.policy.namespace().unwrap_or_default(), policy: self.policy.name_any() };
        let before = self.stored.as_ref().and_then(|s| s.migration.as_ref());
        self.ctx.shared.metrics.record_migration(&labels, before, m);
        write_policy_status(self.policy, self.stored.as_ref(), status.clone(), self.ctx).await?;
        self.stored = Some(status);
        publish_for(self.policy, &self.ctx.shared, &event(m)).await;
        Ok(())
    }
}

impl Journal for StatusJournal<'_> {
    async fn record(&mut self, state: &MigrationStatus) -> Result<(), String> {
        self.write(state).await.map_err(|e| e.to_string())
    }
}

/// The step's Event: its reason is the Migrating condition's; a refusal is a Warning.
fn event(m: &MigrationStatus) -> EventSpec {
    EventSpec {
        warning: matches!(m.phase, MigrationPhase::Refused | MigrationPhase::RolledBack),
        reason: EventReason::Condition(migrating(m).reason),
        action: "MigrateQueue",
        note: format!("{} ({}): {}", m.queue, m.phase.as_str(), m.message),
    }
}

/// Migrates the dead-letter queue, then the queue, when their shapes differ from the plan's
/// and the policy says Migrate; resumes one that stopped. `tracker` is the broker's, which the
/// pass already has.
pub(super) async fn run(
    policy: &QueuePolicy,
    plan: &QueuePlan,
    previous: Option<&QueuePolicyStatus>,
    broker: &Broker,
    tracker: Option<&Arc<ConsumerTracker>>,
    ctx: &Context,
) -> Result<Migrated, Error> {
    let recorded = previous.and_then(|s| s.migration.as_ref());
    let restart_pending = recorded.filter(|m| m.phase == MigrationPhase::RestartingConsumers);
    let mut journal = StatusJournal { policy, stored: previous.cloned(), ctx, tracker, vhost: broker.vhost() };
    let mut moved = restart_pending.cloned();
    if plan.on_change != OnChange::Migrate && restart_pending.is_none() {
        let Some(m) = recorded.filter(|m| midway(m)) else { return Ok(Migrated::Idle) };
        match settle(m, plan, broker, &mut journal).await? {
            Migrated::Completed(swapped) if swapped.phase == MigrationPhase::RestartingConsumers => {
                moved = Some(swapped);
            }
            other => return Ok(other),
        }
    } else if plan.on_change == OnChange::Migrate {
        // A migration that unwound waits before it moves routes and messages again: consumers
        // that never acknowledge would otherwise have the workers starved for the wait's bound
        // at every pass.
        if let Some(m) = recorded
            && let Some(at) = next_attempt(m, Timestamp::now())
        {
            let why = format!("{}; the next attempt is at {at}", m.message);
            return Ok(Migrated::Stopped(Check::failed(Reason::MigrationRolledBack, why), m.clone()));
        }
        let claims = ctx.claims_of_others(policy, plan).await?;
        match migrate_policy(broker, plan, recorded, &mut journal, &Bounds::default(), &claims).await {
            Ok(PolicyMigration::NotNeeded) => {}
            Ok(PolicyMigration::Moved(state)) => moved = Some(state),
            Ok(PolicyMigration::Stopped(check, state)) => return Ok(Migrated::Stopped(check, state)),
            Err(e) => {
                let state = journal.stored.as_ref().and_then(|s| s.migration.clone()).unwrap_or_default();
                return Ok(Migrated::Stopped(Check::failed(Reason::MigrationFailed, e.to_string()), state));
            }
        }
    }
    let Some(mut state) = moved else { return Ok(Migrated::Idle) };

    let guarded = ctx.gate.read(|index| index.guarded(&ObjectKey::of(policy)));
    let (Some(gate), false) = (&plan.gate, guarded.is_empty()) else {
        let state = completed(state, None);
        journal.write(&state).await?;
        return Ok(Migrated::Completed(state));
    };
    let workloads = describe(&guarded);
    let restarted_at = match state.restarted_at.clone() {
        Some(at) => at,
        None => {
            let at = Time(Timestamp::now());
            state.phase = MigrationPhase::RestartingConsumers;
            state.restarted_at = Some(at.clone());
            state.message = format!(
                "restarting {workloads} so its consumers attach to the new queue; the gate holds each old pod until a new one has"
            );
            journal.write(&state).await?;
            at
        }
    };
    // The same value again on a later pass changes nothing.
    let stamp = restart_stamp(&state);
    for workload in &guarded {
        restart(ctx, workload, &stamp).await?;
    }
    // Completed only once consumers are back on the new queue: a restarted worker that cannot
    // declare it consumes nothing.
    let attached = attached_to(broker, tracker, &state.queue).await;
    let wanted = gate.min_attached.max(1) as usize;
    if attached >= wanted {
        let state = completed(state, Some(&workloads));
        journal.write(&state).await?;
        return Ok(Migrated::Completed(state));
    }
    let waited = Timestamp::now().duration_since(restarted_at.0).unsigned_abs();
    let timed_out = waited >= gate.attach_timeout;
    let message = if timed_out {
        let cause = plain_declare_note(broker, plan.queue_type)
            .await
            .unwrap_or_else(|| "the restarted workers fail to declare or consume it (their logs say why)".into());
        format!(
            "restarted {workloads}, and {} after it {attached} of {wanted} consumers have attached to queue '{}' ({}). Likely cause: {cause}. The way back: set spec.queue.type back to what it was; with onChange: Migrate the queue moves back to the shape the workers declare",
            Human(gate.attach_timeout),
            state.queue,
            state.to
        )
    } else {
        format!(
            "restarted {workloads}; waiting for its consumers to attach to queue '{}' ({attached} of {wanted} so far, at most {})",
            state.queue,
            Human(gate.attach_timeout)
        )
    };
    if message != state.message {
        let newly_late = timed_out && !state.message.contains("Likely cause");
        state.message = message;
        journal.write(&state).await?;
        if newly_late {
            let warning = EventSpec {
                warning: true,
                reason: EventReason::Condition(Reason::MigrationConsumersMissing),
                action: "MigrateQueue",
                note: state.message.clone(),
            };
            publish_for(policy, &ctx.shared, &warning).await;
        }
    }
    Ok(Migrated::Completed(state))
}

/// Consumers attached to `queue` now: as the tracker follows them, else as the management API
/// last counted them.
async fn attached_to(broker: &Broker, tracker: Option<&Arc<ConsumerTracker>>, queue: &str) -> usize {
    match tracker {
        Some(t) => t.consumers_on(&QueueKey::new(broker.vhost(), queue)).len(),
        None => {
            let info = broker.management.queue(broker.vhost(), queue).await.ok().flatten();
            info.and_then(|q| q.consumers).unwrap_or_default().max(0) as usize
        }
    }
}

/// onChange no longer says Migrate while a migration is midway: it is settled
/// ([`settle_recorded`]) and the state recorded.
async fn settle(
    m: &MigrationStatus,
    plan: &QueuePlan,
    broker: &Broker,
    journal: &mut StatusJournal<'_>,
) -> Result<Migrated, Error> {
    match settle_recorded(broker, plan, m, "onChange no longer says Migrate").await {
        Ok(state) => {
            journal.write(&state).await?;
            Ok(Migrated::Completed(state))
        }
        Err(e) => {
            let why =
                format!("onChange no longer says Migrate, and the migration left midway could not be settled yet: {e}");
            Ok(Migrated::Stopped(Check::failed(Reason::MigrationFailed, why), m.clone()))
        }
    }
}

/// The migration's start as status holds it (whole seconds): a resumed pass reads it back from
/// status, and must patch the very same value so that the workload is not restarted twice.
fn restart_stamp(state: &MigrationStatus) -> String {
    let started = state.started_at.clone().unwrap_or_else(|| Time(Timestamp::now()));
    serde_json::to_value(&started).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

fn describe(workloads: &[WorkloadKey]) -> String {
    workloads.iter().map(|w| format!("{} '{}'", w.kind.as_str(), w.name)).collect::<Vec<_>>().join(", ")
}

/// `kubectl rollout restart`, with the operator's own annotation: the same value again (a
/// resumed pass) changes nothing.
async fn restart(ctx: &Context, workload: &WorkloadKey, stamp: &str) -> Result<(), Error> {
    let patch = json!({"spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: stamp}}}}});
    let params = PatchParams::default();
    let client = ctx.shared.client.clone();
    let (ns, name) = (workload.namespace.as_str(), workload.name.as_str());
    let result = match workload.kind {
        Kind::Deployment => {
            Api::<Deployment>::namespaced(client, ns).patch(name, &params, &Patch::Merge(&patch)).await.map(drop)
        }
        Kind::StatefulSet => {
            Api::<StatefulSet>::namespaced(client, ns).patch(name, &params, &Patch::Merge(&patch)).await.map(drop)
        }
        Kind::Rollout => {
            Api::<Rollout>::namespaced(client, ns).patch(name, &params, &Patch::Merge(&patch)).await.map(drop)
        }
    };
    match result {
        // Gone since: nothing of it to restart.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        other => Ok(other?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_pass_restarts_with_the_same_stamp_as_the_first() {
        let started: Timestamp = "2026-12-06T22:09:23.780323182Z".parse().unwrap();
        let first = MigrationStatus { started_at: Some(Time(started)), ..Default::default() };
        let resumed: MigrationStatus = serde_json::from_value(serde_json::to_value(&first).unwrap()).unwrap();
        assert_eq!(restart_stamp(&first), "2026-12-06T22:09:23Z");
        assert_eq!(restart_stamp(&resumed), restart_stamp(&first));
    }
}
