//! The rollout gate: from the consumer Deployment, its pods and the queue's live consumers to
//! pod condition patches, strategy patches, status and Events. Pure; the controller applies it.
//!
//! A pod carrying the readiness gate `queueguard.io/consumer-attached` stays not-Ready until the
//! operator sets that condition True, which it does only once the pod's own consumer has been
//! attached for `minAttachedSeconds`. The Deployment controller counts only Ready pods as
//! available, so with a safe strategy the last old consumer cannot go before a new one attached.

pub mod pdb;
pub mod pods;
pub mod strategy;

use crate::{
    consumers::{Consumer, QueueKey, Tracking},
    crd::{
        ConsumersObservation, ConsumersSpec, FailurePolicy, GateMode, MatchBy, PodAttachment, RolloutObservation,
        WaitingPod,
    },
    events::EventSpec,
    status::{Check, Reason},
};
use k8s_openapi::{api::apps::v1::Deployment, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use pods::{GATE_CONDITION, PodFacts};
use serde_json::{Value, json};
use std::time::Duration;

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

/// What the gate looks at.
pub struct Observed<'a> {
    pub queue: &'a QueueKey,
    pub deployments: &'a [Deployment],
    pub pods: &'a [PodFacts],
    pub consumers: &'a [Consumer],
    pub tracking: &'a Tracking,
    pub now_ms: i64,
}

/// Reasons a pod's gate condition carries.
pub mod reason {
    pub const ATTACHED: &str = "ConsumerAttached";
    pub const NO_CONSUMER: &str = "NoConsumer";
    pub const TOO_RECENT: &str = "AttachedTooRecently";
    pub const TIMEOUT_OPEN: &str = "AttachTimeoutExpired";
    pub const UNREACHABLE_OPEN: &str = "BrokerUnreachable";
}

/// One pod condition to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPatch {
    pub pod: String,
    pub uid: String,
    pub attached: bool,
    pub reason: &'static str,
    pub message: String,
    /// lastTransitionTime: now when the status flips, else the time it last flipped.
    pub transition_ms: i64,
}

impl PodPatch {
    /// The strategic merge patch for pods/status: only this condition, and the pod's UID as a
    /// precondition, so a pod re-created under the same name is never patched by mistake.
    pub fn body(&self) -> Value {
        json!({
            "metadata": {"uid": self.uid},
            "status": {"conditions": [{
                "type": GATE_CONDITION,
                "status": if self.attached { "True" } else { "False" },
                "reason": self.reason,
                "message": self.message,
                "lastTransitionTime": rfc3339(self.transition_ms),
            }]},
        })
    }
}

/// Everything the gate decided in one pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub pod_patches: Vec<PodPatch>,
    /// Strategic merge patches for Deployments, by name.
    pub strategy_patches: Vec<(String, Value)>,
    pub consumers_attached: Check,
    pub rollout_safe: Check,
    pub consumers: ConsumersObservation,
    pub rollout: RolloutObservation,
    pub events: Vec<EventSpec>,
    /// When a pass is due because time alone changes a verdict (minAttachedSeconds elapsing,
    /// attachTimeout running out).
    pub recheck_after: Option<Duration>,
    /// How long each gate this pass opens was closed (for the gate wait metric).
    pub opened_after: Vec<Duration>,
}

pub fn decide(plan: &GatePlan, seen: &Observed) -> Decision {
    let now = seen.now_ms;
    let enforce = plan.mode == GateMode::Enforce;
    let observe_note = if enforce { "" } else { " (mode Observe: not applied)" };
    let on_queue: Vec<Consumer> = seen.consumers.iter().filter(|c| &c.queue == seen.queue).cloned().collect();
    let matching = pods::match_consumers(seen.pods, &on_queue, plan.match_by);
    let live = seen.tracking.is_live();
    let timeout_ms = plan.attach_timeout.as_millis() as i64;
    let min_ms = plan.min_attached_for.as_millis() as i64;

    let mut pod_patches = Vec::new();
    let mut opened_after = Vec::new();
    let mut events = Vec::new();
    let mut recheck: Option<i64> = None;
    let mut soon = |at_ms: i64| {
        if at_ms > now {
            recheck = Some(recheck.map_or(at_ms, |r| r.min(at_ms)));
        }
    };
    let mut attachments = Vec::new();
    let mut waiting = Vec::new();
    let mut attached_pods = 0;
    let mut without_gate = Vec::new();

    for pod in seen.pods.iter().filter(|p| !p.deleting) {
        let mine = matching.by_pod.get(&pod.name).map(Vec::as_slice).unwrap_or_default();
        let attached_since = mine.iter().map(|c| c.since_ms).min();
        let current = pod.condition.as_ref();
        let currently_open = current.is_some_and(|c| c.status);
        // A pod waits for its consumer from when its containers became ready, or from when its
        // gate last closed (a consumer that left), whichever is later.
        let wait_start = pod.containers_ready_since_ms.map(|ready| match current {
            Some(c) if c.status => now,
            Some(c) => ready.max(c.since_ms),
            None => ready,
        });
        let timed_out = plan.failure_policy == FailurePolicy::Open && wait_start.is_some_and(|w| now - w >= timeout_ms);
        if plan.failure_policy == FailurePolicy::Open
            && let Some(start) = wait_start
        {
            soon(start + timeout_ms);
        }

        let desired: Option<(bool, &'static str, String)> = if !live {
            // failurePolicy Closed, or not yet timed out: what cannot be seen is not changed.
            (timed_out && !currently_open).then(|| {
                let why = tracking_label(seen.tracking);
                (
                    true,
                    reason::UNREACHABLE_OPEN,
                    format!("consumers cannot be seen ({why}); opened after attachTimeout by failurePolicy Open"),
                )
            })
        } else if let Some(since) = attached_since {
            let first = &mine[0];
            let who = format!("consumer '{}' from {}", first.tag, first.peer_host.as_deref().unwrap_or("?"));
            if currently_open || now - since >= min_ms {
                Some((true, reason::ATTACHED, format!("{who} attached since {}", rfc3339(since))))
            } else {
                soon(since + min_ms);
                Some((
                    false,
                    reason::TOO_RECENT,
                    format!("{who} attached at {}; counts after {}s", rfc3339(since), min_ms / 1000),
                ))
            }
        } else if timed_out {
            Some((
                true,
                reason::TIMEOUT_OPEN,
                format!(
                    "no consumer attached within attachTimeout {}s; opened by failurePolicy Open",
                    timeout_ms / 1000
                ),
            ))
        } else {
            Some((false, reason::NO_CONSUMER, "waiting for a consumer from this pod on the queue".into()))
        };

        let open_after = desired.as_ref().map_or(currently_open, |d| d.0);
        if pod.has_gate {
            if let Some((status, why, message)) = desired {
                let changed = current.is_none_or(|c| c.status != status || c.reason != why);
                if changed {
                    let transition_ms = match current {
                        Some(c) if c.status == status => c.since_ms,
                        _ => now,
                    };
                    let patch = PodPatch {
                        pod: pod.name.clone(),
                        uid: pod.uid.clone(),
                        attached: status,
                        reason: why,
                        message,
                        transition_ms,
                    };
                    events.push(pod_event(&patch, observe_note));
                    pod_patches.push(patch);
                    if status && !currently_open {
                        let waited = wait_start.map_or(0, |start| (now - start).max(0));
                        opened_after.push(Duration::from_millis(waited as u64));
                    }
                }
            }
            if let Some(start) = wait_start.filter(|_| !open_after) {
                waiting.push(WaitingPod { name: pod.name.clone(), since: Some(time(start)) });
                soon(start + timeout_ms);
            }
        } else {
            without_gate.push(pod.name.clone());
        }
        let counts = attached_since.is_some_and(|since| currently_open || now - since >= min_ms);
        if counts {
            attached_pods += 1;
        }
        attachments.push(PodAttachment {
            name: pod.name.clone(),
            attached: attached_since.is_some(),
            since: attached_since.map(time),
            gate: if !pod.has_gate {
                "NotInstalled"
            } else if open_after {
                "Open"
            } else {
                "Closed"
            }
            .into(),
        });
    }

    let expected: i32 = seen.deployments.iter().map(strategy::replicas).sum();
    let consumers_attached = consumers_check(plan, seen, attached_pods, expected, &matching);

    let mut strategy_patches = Vec::new();
    let mut unsafe_reasons = Vec::new();
    for d in seen.deployments {
        let name = d.metadata.name.clone().unwrap_or_default();
        match strategy::judge(d, plan.min_attached) {
            strategy::Verdict::Safe { .. } => {}
            strategy::Verdict::Unsafe { why, patch } if plan.manage_strategy && enforce => {
                events.push(EventSpec {
                    warning: false,
                    reason: "StrategyPatched".into(),
                    action: "GuardRollout",
                    note: format!("Deployment '{name}': {why}; patched to RollingUpdate with maxUnavailable 0"),
                });
                strategy_patches.push((name, patch));
            }
            strategy::Verdict::Unsafe { why, .. } => unsafe_reasons.push(format!("Deployment '{name}': {why}")),
            strategy::Verdict::Invalid(e) => unsafe_reasons.push(format!("Deployment '{name}': {e}")),
        }
    }
    let rollout_safe = if seen.deployments.is_empty() {
        Check::failed(Reason::DeploymentNotFound, describe_missing(&plan.consumers))
    } else if !unsafe_reasons.is_empty() {
        let fix = if plan.manage_strategy { "" } else { " (set gate.manageStrategy: true to let queueguard fix it)" };
        Check::failed(Reason::UnsafeRolloutStrategy, format!("{}{fix}", unsafe_reasons.join("; ")))
    } else if !without_gate.is_empty() {
        Check::failed(
            Reason::GateNotInstalled,
            format!(
                "pods {} have no readinessGates entry {GATE_CONDITION}; add it to the Deployment's pod template (or enable the webhook), else rollouts are not gated",
                without_gate.join(", ")
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

    let progressing = seen.deployments.iter().any(rolling_out);
    let phase = if waiting.iter().any(|w| w.since.as_ref().is_some_and(|s| now - s.0.as_millisecond() >= timeout_ms)) {
        "Stalled"
    } else if !waiting.is_empty() {
        "WaitingForAttach"
    } else if progressing {
        "Progressing"
    } else {
        "Idle"
    };
    if phase == "Stalled" {
        events.push(EventSpec {
            warning: true,
            reason: "RolloutStalled".into(),
            action: "GuardRollout",
            note: format!(
                "pods {} have waited longer than attachTimeout {}s for their consumer",
                waiting.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", "),
                timeout_ms / 1000
            ),
        });
    }

    Decision {
        pod_patches,
        strategy_patches,
        consumers_attached,
        rollout_safe,
        consumers: ConsumersObservation {
            attached: attached_pods,
            expected,
            tracking: tracking_label(seen.tracking),
            unmatched: matching.unmatched.len() as i32,
            pods: attachments,
        },
        rollout: RolloutObservation { phase: phase.into(), waiting_pods: waiting },
        events,
        recheck_after: recheck.map(|at| Duration::from_millis((at - now) as u64)),
        opened_after,
    }
}

fn consumers_check(plan: &GatePlan, seen: &Observed, attached: i32, expected: i32, m: &pods::Matching) -> Check {
    if !seen.tracking.is_live() {
        return Check::unknown(
            Reason::BrokerUnreachable,
            format!("consumers cannot be seen: {}", tracking_label(seen.tracking)),
        );
    }
    let mut msg = format!("{attached} of {expected} consumer pods attached (minAttached {})", plan.min_attached);
    if !m.unmatched.is_empty() {
        let hint = match plan.match_by {
            MatchBy::PodIp => "; if the broker sees NAT addresses, set consumers.matchBy: ConnectionName",
            MatchBy::ConnectionName => "; their connection names contain no consumer pod's name",
        };
        msg.push_str(&format!("; {} consumers match no pod{hint}", m.unmatched.len()));
    }
    if !m.ambiguous_ips.is_empty() {
        msg.push_str(&format!(
            "; pods share IPs {} (hostNetwork?): use consumers.matchBy: ConnectionName",
            m.ambiguous_ips.join(", ")
        ));
    }
    if let Tracking::Polling(why) = seen.tracking {
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

fn pod_event(p: &PodPatch, observe_note: &str) -> EventSpec {
    let (warning, reason) = match p.reason {
        reason::ATTACHED => (false, "GateOpened"),
        reason::TIMEOUT_OPEN | reason::UNREACHABLE_OPEN => (true, "GateFailedOpen"),
        _ => (false, "GateClosed"),
    };
    EventSpec {
        warning,
        reason: reason.into(),
        action: "GatePod",
        note: format!("pod {}: {}{observe_note}", p.pod, p.message),
    }
}

pub fn tracking_label(t: &Tracking) -> String {
    match t {
        Tracking::Events => "Events".into(),
        Tracking::Polling(why) => format!("Polling ({why})"),
        Tracking::Unavailable(why) => format!("Unavailable ({why})"),
        Tracking::Starting => "Starting".into(),
    }
}

fn time(ms: i64) -> Time {
    Time(Timestamp::from_millisecond(ms).unwrap_or(Timestamp::UNIX_EPOCH))
}

fn rfc3339(ms: i64) -> String {
    crate::consumers::output::rfc3339(ms)
}

#[cfg(test)]
mod tests;
