//! The rollout gate, pure: which pods a policy guards, each pod's one verdict over every policy
//! guarding it, the writes the gate wants, and each policy's report for its status. The
//! controller feeds the index and performs what it decides.
//!
//! A pod carrying the readiness gate `queueguard.io/consumer-attached` stays not-Ready until the
//! operator sets that condition True, which it does only once the pod's own consumer has been
//! attached for `minAttachedSeconds` on the queue of every `Enforce` policy guarding it. The
//! Deployment, StatefulSet and Argo Rollouts controllers count only Ready pods as available, so
//! with a safe strategy the last old consumer cannot go before a new one attached.
//!
//! ```text
//! watches (QueuePolicy, Deployment, StatefulSet, ─┐
//!   Rollout, ReplicaSet, Pod, PDB)                │
//! consumer trackers (attach, detach, health) ─────┼─▶ index::GateIndex ─flush─▶ Write ─▶ the one writer
//! reconcile (binds a policy to its queue) ────────┘     (pod verdicts,          (pod conditions,
//!                                                        strategy, budgets)      strategies, budgets)
//!                                                          └─▶ policies to wake ─▶ reconcile ─▶ index.policy_view ─▶ report ─▶ status
//! ```

pub mod guards;
pub mod index;
pub mod pdb;
pub mod pods;
pub mod verdict;

use crate::{
    consumers::Tracking,
    consumers::output::rfc3339,
    crd::{
        BudgetOwner, ConsumersObservation, DisruptionBudgetObservation, GateMode, MatchBy, PodAttachment, PodGate,
        QueuePolicy, RolloutObservation, RolloutPhase, WaitingPod,
    },
    events::{EventReason, EventSpec},
    names::GATE_CONDITION,
    plan::{GatePlan, Limits},
    status::{Check, Reason, Truth},
    workload::Judgement,
};
use index::{Budget, NoGate, ObjectKey, PolicyFacts, PolicyView};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::ResourceExt;
use serde_json::{Value, json};
use std::time::Duration;
pub use verdict::GateReason;

/// What the index needs of a QueuePolicy. Every policy has facts: one without spec.consumers
/// guards nothing, but its queue's changes (a deletion behind the operator's back) still wake it.
pub fn policy_facts(policy: &QueuePolicy, limits: Limits) -> PolicyFacts {
    let plan = match (crate::plan::plan(policy, limits), stands_back(policy)) {
        (Ok(_), Some(why)) => Err(NoGate::StandsBack(why)),
        (Ok(p), None) => p.gate.ok_or(NoGate::NoConsumers),
        (Err(errors), _) => Err(NoGate::Invalid(crate::plan::describe(&errors))),
    };
    PolicyFacts {
        key: ObjectKey::of(policy),
        uid: policy.uid().unwrap_or_default(),
        selects: guards::Selects::of(policy),
        plan,
        deleting: policy.metadata.deletion_timestamp.is_some(),
    }
}

/// Why the policy stands back, if its reconcile of this generation said so (ManagedElsewhere):
/// the webhook (which reads the same object) and the index then leave its pods alone.
fn stands_back(policy: &QueuePolicy) -> Option<String> {
    let conditions = &policy.status.as_ref()?.conditions;
    let ready = conditions.iter().find(|c| c.type_ == crate::status::ConditionType::Ready.as_str())?;
    let current = ready.observed_generation.is_some() && ready.observed_generation == policy.metadata.generation;
    (current && ready.reason == Reason::ManagedElsewhere.as_str() && !policy.spec.adopt).then(|| ready.message.clone())
}

/// One pod condition to write: a flip of the pod's combined verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPatch {
    pub namespace: String,
    pub pod: String,
    pub uid: String,
    pub attached: bool,
    /// The pod's first condition (it had none): it says why the pod waits, with no Event.
    pub first: bool,
    pub reason: GateReason,
    pub message: String,
    /// lastTransitionTime: when the verdict flipped.
    pub transition_ms: i64,
    /// For a gate opening: how long the pod waited.
    pub waited_ms: Option<i64>,
    /// The Enforce policies whose votes made the verdict.
    pub policies: Vec<ObjectKey>,
}

impl PodPatch {
    /// The strategic merge patch for pods/status: only this condition, and the pod's UID as a
    /// precondition, so a pod re-created under the same name is never patched by mistake.
    pub fn body(&self) -> Value {
        json!({
            "metadata": {"uid": self.uid},
            "status": {"conditions": [{
                "type": GATE_CONDITION,
                "status": Truth::from(self.attached).as_str(),
                "reason": self.reason.as_str(),
                "message": crate::events::truncate(&self.message),
                "lastTransitionTime": rfc3339(self.transition_ms),
            }]},
        })
    }

    /// The Event that tells of this flip, on the pod; none for a new pod's first False, which
    /// the condition itself tells.
    pub fn event(&self) -> Option<EventSpec> {
        let (warning, reason) = match self.reason {
            _ if !self.attached && self.first => return None,
            _ if !self.attached => (false, EventReason::GateClosed),
            r if r.failed_open() => (true, EventReason::GateFailedOpen),
            _ => (false, EventReason::GateOpened),
        };
        Some(EventSpec { warning, reason, action: "GatePod", note: self.message.clone() })
    }
}

/// What the gate reports for one policy. The writes it calls for (strategy fixes, budgets) are
/// the index's, made by the one writer.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub consumers_attached: Check,
    pub rollout_safe: Check,
    pub consumers: ConsumersObservation,
    pub rollout: RolloutObservation,
    pub budgets: Vec<DisruptionBudgetObservation>,
    pub events: Vec<EventSpec>,
    /// When a look is due because time alone changes what status says.
    pub recheck_after: Option<Duration>,
}

/// One policy's report from its view. `previous` is the rollout phase its status shows now.
pub fn report(plan: &GatePlan, view: &PolicyView, previous: Option<RolloutPhase>, now: i64) -> Report {
    let enforce = plan.mode == GateMode::Enforce;
    let timeout_ms = plan.attach_timeout.as_millis() as i64;
    let mut events = Vec::new();
    let mut due: Option<i64> = None;
    let mut soon = |at: i64| {
        if at > now {
            due = Some(due.map_or(at, |d| d.min(at)));
        }
    };
    let mut attachments = Vec::new();
    let mut waiting = Vec::new();
    let mut without_gate = Vec::new();
    for pod in &view.pods {
        if let Some(at) = pod.due_ms {
            soon(at);
        }
        if !pod.has_gate {
            without_gate.push(pod.name.clone());
        }
        if let Some(since) = pod.waiting_since {
            soon(since + timeout_ms);
            waiting.push(WaitingPod {
                name: pod.name.clone(),
                since: Some(time(since)),
                waiting_for: pod.waiting_for.clone(),
            });
        }
        attachments.push(PodAttachment {
            name: pod.name.clone(),
            attached: pod.attached_since.is_some(),
            since: pod.attached_since.map(time),
            gate: if !pod.has_gate {
                PodGate::NotInstalled
            } else if pod.open {
                PodGate::Open
            } else {
                PodGate::Closed
            },
        });
    }
    let attached = view.pods.iter().filter(|p| p.counts).count() as i32;
    let expected: i32 = view.workloads.iter().map(|w| w.replicas()).sum();
    let consumers_attached = consumers_check(plan, view, attached, expected);

    let mut fixing = Vec::new();
    let mut unsafe_reasons = Vec::new();
    let mut notes = Vec::new();
    for w in &view.workloads {
        let who = format!("{} '{}'", w.key.kind.as_str(), w.key.name);
        match w.judge(plan.min_attached) {
            Judgement::Safe { note } => notes.extend(note.map(|n| format!("{who}: {n}"))),
            Judgement::Fixable { why, done, .. } if plan.manage_strategy && enforce => {
                fixing.push(format!("{who}: {why}; {done}"))
            }
            Judgement::Fixable { why, .. } => {
                unsafe_reasons.push(format!("{who}: {why} (set gate.manageStrategy: true to let queueguard fix it)"))
            }
            Judgement::Unsafe { why, remedy } => unsafe_reasons.push(format!("{who}: {why}; {remedy}")),
            Judgement::Invalid(e) => unsafe_reasons.push(format!("{who}: {e}")),
        }
    }
    let notes = if notes.is_empty() { String::new() } else { format!("; {}", notes.join("; ")) };
    let rollout_safe = if view.workloads.is_empty() {
        Check::failed(Reason::WorkloadNotFound, view.selects.describe_missing())
    } else if !unsafe_reasons.is_empty() {
        Check::failed(Reason::UnsafeRolloutStrategy, unsafe_reasons.join("; "))
    } else if !without_gate.is_empty() {
        Check::failed(
            Reason::GateNotInstalled,
            format!(
                "pods {} have no readinessGates entry {GATE_CONDITION}; add it to the workload's pod template (or enable the webhook and label the namespace {}), else rollouts are not gated",
                without_gate.join(", "),
                crate::names::NAMESPACE_LABEL_TEXT,
            ),
        )
    } else if !fixing.is_empty() {
        Check::ok(
            Reason::RolloutGuarded,
            format!("{}; every consumer pod carries the readiness gate{notes}", fixing.join("; ")),
        )
    } else {
        Check::ok(
            Reason::RolloutGuarded,
            format!(
                "the rollout strategy keeps minAttached consumers and every consumer pod carries the readiness gate{notes}"
            ),
        )
    };

    let stalled = waiting.iter().any(|w| w.since.as_ref().is_some_and(|s| now - s.0.as_millisecond() >= timeout_ms));
    let phase = if stalled {
        RolloutPhase::Stalled
    } else if !waiting.is_empty() {
        RolloutPhase::WaitingForAttach
    } else if view.workloads.iter().any(|w| w.rolling_out()) {
        RolloutPhase::Progressing
    } else {
        RolloutPhase::Idle
    };
    if phase == RolloutPhase::Stalled && previous != Some(RolloutPhase::Stalled) {
        events.push(EventSpec {
            warning: true,
            reason: EventReason::RolloutStalled,
            action: "GuardRollout",
            note: format!(
                "pods {} have waited longer than attachTimeout {}s for their consumer",
                waiting.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", "),
                timeout_ms / 1000
            ),
        });
    }

    Report {
        consumers_attached,
        rollout_safe,
        consumers: ConsumersObservation {
            attached,
            expected,
            tracking: view.tracking.mode().0,
            tracking_reason: view.tracking.mode().1.map(str::to_owned),
            unmatched: view.unmatched as i32,
            pods: attachments,
        },
        rollout: RolloutObservation { phase, waiting_pods: waiting },
        budgets: budget_observations(view),
        events,
        recheck_after: due.map(|at| Duration::from_millis((at - now) as u64)),
    }
}

fn consumers_check(plan: &GatePlan, view: &PolicyView, attached: i32, expected: i32) -> Check {
    if !view.tracking.is_live() {
        return Check::unknown(Reason::BrokerUnreachable, format!("consumers cannot be seen: {}", view.tracking));
    }
    let mut msg = format!("{attached} of {expected} consumer pods attached (minAttached {})", plan.min_attached);
    if view.unmatched > 0 {
        let hint = match plan.match_by {
            MatchBy::PodIp => "; if the broker sees NAT addresses, set consumers.matchBy: ConnectionName",
            MatchBy::ConnectionName => "; their connection names contain no consumer pod's <namespace>/<name> or UID",
        };
        msg.push_str(&format!("; {} consumers match no pod{hint}", view.unmatched));
    }
    if view.stale > 0 {
        msg.push_str(&format!(
            "; {} consumers connected before their pod had its address (a stale connection of a reused IP) do not count",
            view.stale
        ));
    }
    if view.undated > 0 {
        msg.push_str(&format!(
            "; {} consumers' connections are not listed to the broker user, so their age is unknown and they open no gate (open gates are held): give the user the monitoring tag (RabbitMQ lists other users' connections only to it)",
            view.undated
        ));
    }
    if !view.ambiguous_ips.is_empty() {
        msg.push_str(&format!(
            "; pods share IPs {} (hostNetwork?): use consumers.matchBy: ConnectionName",
            view.ambiguous_ips.join(", ")
        ));
    }
    if let Tracking::Polling(why) = &view.tracking {
        msg.push_str(&format!("; polling the management API ({why})"));
    }
    if expected == 0 {
        Check::failed(Reason::ScaledToZero, msg)
    } else if attached >= plan.min_attached {
        Check::ok(Reason::Attached, msg)
    } else {
        Check::failed(Reason::TooFewAttached, msg)
    }
}

/// What status says of each guarded workload's disruption budget.
fn budget_observations(view: &PolicyView) -> Vec<DisruptionBudgetObservation> {
    let mut seen = Vec::new();
    for (workload, budget) in &view.budgets {
        let observe = |name: String, owner, min_available| DisruptionBudgetObservation {
            kind: workload.kind,
            workload: workload.name.clone(),
            name,
            owner,
            min_available,
        };
        match budget {
            Budget::Want(want) => {
                let min = want.spec.as_ref().and_then(|s| s.min_available.as_ref()).and_then(|m| match m {
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => Some(*n),
                    _ => None,
                });
                seen.push(observe(want.metadata.name.clone().unwrap_or_default(), BudgetOwner::Managed, min));
            }
            Budget::Foreign(names) => seen.extend(names.iter().map(|n| observe(n.clone(), BudgetOwner::Foreign, None))),
            Budget::None => {}
        }
    }
    seen
}

/// A status time, in whole seconds as the API stores it.
fn time(ms: i64) -> Time {
    Time(Timestamp::from_second(ms.div_euclid(1000)).unwrap_or(Timestamp::UNIX_EPOCH))
}

#[cfg(test)]
mod tests;
