//! The rollout gate, pure: which pods a policy guards, each pod's one verdict over every policy
//! guarding it, and each policy's report for its status. The controller feeds the index and
//! performs what it decides.
//!
//! A pod carrying the readiness gate `queueguard.io/consumer-attached` stays not-Ready until the
//! operator sets that condition True, which it does only once the pod's own consumer has been
//! attached for `minAttachedSeconds` on the queue of every `Enforce` policy guarding it. The
//! Deployment controller counts only Ready pods as available, so with a safe strategy the last
//! old consumer cannot go before a new one attached.
//!
//! ```text
//! watches (QueuePolicy, Deployment, Pod, PDB) ─┐
//! consumer trackers (attach, detach, health) ──┼─▶ index::GateIndex ─flush─▶ PodPatch ─▶ the one pod writer
//!                                              │     (verdict per pod)    └▶ policies to wake ─▶ reconcile
//! reconcile (binds a policy to its queue) ─────┘                                ├─ index.policy_view ─▶ report ─▶ status
//!                                                                               └─ index.budget_for ─▶ PDB
//! ```

pub mod guards;
pub mod index;
pub mod pdb;
pub mod pods;
pub mod strategy;
pub mod verdict;

use crate::{
    consumers::Tracking,
    crd::{
        ConsumersObservation, ConsumersSpec, FailurePolicy, GateMode, MatchBy, PodAttachment, PodGate,
        RolloutObservation, RolloutPhase, WaitingPod,
    },
    events::{EventReason, EventSpec},
    status::{Check, Reason, Truth},
};
use index::{ObjectKey, PolicyView};
use k8s_openapi::{api::apps::v1::Deployment, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use serde_json::{Value, json};
use std::time::Duration;
pub use verdict::GateReason;

/// The readiness gate (and pod condition type) the operator owns.
pub const GATE_CONDITION: &str = "queueguard.io/consumer-attached";

/// The gate settings of one policy, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct GatePlan {
    pub mode: GateMode,
    pub failure_policy: FailurePolicy,
    pub attach_timeout: Duration,
    pub manage_strategy: bool,
    pub pod_disruption_budget: bool,
    pub min_attached: i32,
    pub min_attached_for: Duration,
    pub match_by: MatchBy,
    pub consumers: ConsumersSpec,
}

/// One pod condition to write: a flip of the pod's combined verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPatch {
    pub namespace: String,
    pub pod: String,
    pub uid: String,
    pub attached: bool,
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

    /// The Event that tells of this flip, on the pod.
    pub fn event(&self) -> EventSpec {
        let (warning, reason) = match self.reason {
            _ if !self.attached => (false, EventReason::GateClosed),
            r if r.failed_open() => (true, EventReason::GateFailedOpen),
            _ => (false, EventReason::GateOpened),
        };
        EventSpec { warning, reason, action: "GatePod", note: self.message.clone() }
    }
}

/// What the gate reports for one policy, and what it asks of the policy's Deployments.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub consumers_attached: Check,
    pub rollout_safe: Check,
    pub consumers: ConsumersObservation,
    pub rollout: RolloutObservation,
    /// Strategic merge patches for Deployments, by name.
    pub strategy_patches: Vec<(String, Value)>,
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
    let expected: i32 = view.deployments.iter().map(|d| strategy::replicas(d)).sum();
    let consumers_attached = consumers_check(plan, view, attached, expected);

    let mut strategy_patches = Vec::new();
    let mut unsafe_reasons = Vec::new();
    for d in &view.deployments {
        let name = d.metadata.name.clone().unwrap_or_default();
        match strategy::judge(d, plan.min_attached) {
            strategy::Verdict::Safe { .. } => {}
            strategy::Verdict::Unsafe { why, patch } if plan.manage_strategy && enforce => {
                events.push(EventSpec {
                    warning: false,
                    reason: EventReason::StrategyPatched,
                    action: "GuardRollout",
                    note: format!("Deployment '{name}': {why}; patched to RollingUpdate with maxUnavailable 0"),
                });
                strategy_patches.push((name, patch));
            }
            strategy::Verdict::Unsafe { why, .. } => unsafe_reasons.push(format!("Deployment '{name}': {why}")),
            strategy::Verdict::Invalid(e) => unsafe_reasons.push(format!("Deployment '{name}': {e}")),
        }
    }
    let rollout_safe = if view.deployments.is_empty() {
        Check::failed(Reason::DeploymentNotFound, describe_missing(&plan.consumers))
    } else if !unsafe_reasons.is_empty() {
        let fix = if plan.manage_strategy { "" } else { " (set gate.manageStrategy: true to let queueguard fix it)" };
        Check::failed(Reason::UnsafeRolloutStrategy, format!("{}{fix}", unsafe_reasons.join("; ")))
    } else if !without_gate.is_empty() {
        Check::failed(
            Reason::GateNotInstalled,
            format!(
                "pods {} have no readinessGates entry {GATE_CONDITION}; add it to the Deployment's pod template (or enable the webhook and label the namespace {}), else rollouts are not gated",
                without_gate.join(", "),
                crate::webhook::NAMESPACE_LABEL_TEXT,
            ),
        )
    } else if !strategy_patches.is_empty() {
        Check::ok(
            Reason::RolloutGuarded,
            "rollout strategy patched to maxUnavailable 0; every consumer pod carries the readiness gate",
        )
    } else {
        Check::ok(
            Reason::RolloutGuarded,
            "the rollout strategy keeps minAttached consumers and every consumer pod carries the readiness gate",
        )
    };

    let stalled = waiting.iter().any(|w| w.since.as_ref().is_some_and(|s| now - s.0.as_millisecond() >= timeout_ms));
    let phase = if stalled {
        RolloutPhase::Stalled
    } else if !waiting.is_empty() {
        RolloutPhase::WaitingForAttach
    } else if view.deployments.iter().any(|d| rolling_out(d)) {
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
        strategy_patches,
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
            MatchBy::ConnectionName => "; their connection names contain no consumer pod's name",
        };
        msg.push_str(&format!("; {} consumers match no pod{hint}", view.unmatched));
    }
    if view.stale > 0 {
        msg.push_str(&format!(
            "; {} consumers connected before their pod had its address (a stale connection of a reused IP) do not count",
            view.stale
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

fn describe_missing(c: &ConsumersSpec) -> String {
    match (&c.deployment, &c.selector) {
        (Some(name), _) => format!("Deployment '{name}' not found"),
        _ => "no Deployment matches consumers.selector".into(),
    }
}

/// A Deployment whose newest pods have not all replaced the old ones yet.
fn rolling_out(d: &Deployment) -> bool {
    let want = strategy::replicas(d);
    let status = d.status.as_ref();
    let generation_seen =
        d.metadata.generation.is_none_or(|g| status.and_then(|s| s.observed_generation).is_some_and(|o| o >= g));
    let updated = status.and_then(|s| s.updated_replicas).unwrap_or(0);
    let total = status.and_then(|s| s.replicas).unwrap_or(0);
    !generation_seen || updated < want || total > want
}

/// A status time, in whole seconds as the API stores it.
fn time(ms: i64) -> Time {
    Time(Timestamp::from_second(ms.div_euclid(1000)).unwrap_or(Timestamp::UNIX_EPOCH))
}

fn rfc3339(ms: i64) -> String {
    crate::consumers::output::rfc3339(ms)
}

#[cfg(test)]
mod tests;
