//! The verdict on one pod: each guarding policy votes from its own queue's consumers, and the
//! votes combine into the one condition the pod carries. Pure.
//!
//! A pod's condition is True only when every `Enforce` policy guarding it votes Open: its own
//! consumer on that policy's queue has been attached for that policy's `minAttachedSeconds` (or
//! `failurePolicy: Open` let it through after `attachTimeout`). One Closed vote closes it. A
//! policy that cannot see its consumers (failurePolicy Closed) holds: what cannot be seen is not
//! changed.

use super::GatePlan;
use crate::{
    consumers::output::rfc3339,
    consumers::{Consumer, Tracking},
    crd::FailurePolicy,
};

/// Why a pod's gate condition says what it says (the condition's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::Display, strum::EnumString)]
pub enum GateReason {
    /// Every guarding policy's consumer from this pod has been attached long enough.
    ConsumerAttached,
    /// No consumer from this pod on a guarded queue yet.
    WaitingForConsumer,
    /// Attached, but not yet for minAttachedSeconds.
    AttachedTooRecently,
    /// failurePolicy Open: no consumer within attachTimeout, let through.
    AttachTimeoutExpired,
    /// failurePolicy Open: consumers could not be seen for attachTimeout, let through.
    BrokerUnreachable,
    /// No QueuePolicy in Enforce mode guards the pod's workload: nothing holds it back.
    NotGuarded,
    /// A guarding policy has not bound its queue yet (not reconciled, or its broker side not
    /// Ready): written only as a pod's first condition; an open gate is held as it is.
    WaitingForQueues,
    /// A guarding policy cannot see its consumers (failurePolicy Closed): first condition only,
    /// as above.
    TrackingUnavailable,
    /// A guarding policy's spec is invalid: first condition only, as above.
    PolicyInvalid,
    /// The pod's consumer is on a connection of unknown age (the broker user lacks the
    /// `monitoring` tag): an open gate is held as it is.
    ConnectionAgeUnknown,
}

impl GateReason {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Opened without a consumer having been seen.
    pub fn failed_open(self) -> bool {
        matches!(self, Self::AttachTimeoutExpired | Self::BrokerUnreachable)
    }
}

/// One policy's say on one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Vote {
    Open {
        reason: GateReason,
        message: String,
    },
    Closed {
        reason: GateReason,
        message: String,
    },
    /// Its consumers cannot be seen, or it is not bound to its queue: keep the condition as it
    /// is (a pod without one is told why it waits).
    Hold {
        reason: GateReason,
        message: String,
    },
}

/// A vote and what it was made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyVote {
    pub vote: Vote,
    /// When time alone changes the vote (minAttachedSeconds elapsing, attachTimeout running out).
    pub due_ms: Option<i64>,
    /// The oldest of the pod's own consumers on the queue.
    pub attached_since: Option<i64>,
    /// Attached long enough to count towards minAttached.
    pub counts: bool,
}

/// What a vote is made from.
pub struct Ballot<'a> {
    pub plan: &'a GatePlan,
    pub tracking: &'a Tracking,
    /// The pod's own consumers on the policy's queue.
    pub mine: &'a [&'a Consumer],
    /// Whether the pod's condition is True now (or about to be: written, not yet seen back).
    pub open: bool,
    /// It is True because failurePolicy Open let it through, not because a consumer was seen.
    pub failed_open: bool,
    /// Consumers from the pod's address or name whose connection age is unknown.
    pub undated: usize,
    /// When the pod started waiting: its containers became ready, or its gate last closed.
    pub waiting_since: Option<i64>,
    pub now: i64,
}

pub fn vote(b: &Ballot) -> PolicyVote {
    let now = b.now;
    let timeout_ms = b.plan.attach_timeout.as_millis() as i64;
    let min_ms = b.plan.min_attached_for.as_millis() as i64;
    let fail_open_at =
        b.waiting_since.filter(|_| b.plan.failure_policy == FailurePolicy::Open && !b.open).map(|w| w + timeout_ms);
    let timed_out = fail_open_at.is_some_and(|at| now >= at);
    let attached_since = b.mine.iter().map(|c| c.since_ms).min();
    let counts = attached_since.is_some_and(|since| b.open || now - since >= min_ms);
    let mut due = fail_open_at.filter(|at| *at > now);
    let vote = if !b.tracking.is_live() {
        if timed_out {
            Vote::Open {
                reason: GateReason::BrokerUnreachable,
                message: format!(
                    "consumers cannot be seen ({}); opened after attachTimeout by failurePolicy Open",
                    b.tracking
                ),
            }
        } else {
            Vote::Hold {
                reason: GateReason::TrackingUnavailable,
                message: format!("consumers cannot be seen ({})", b.tracking),
            }
        }
    } else if let Some(since) = attached_since {
        let first = b.mine.iter().min_by_key(|c| c.since_ms).expect("attached_since came from one");
        let who = format!("consumer '{}' from {}", first.tag, first.peer_host.as_deref().unwrap_or("?"));
        if counts {
            due = None;
            Vote::Open {
                reason: GateReason::ConsumerAttached,
                message: format!("{who} attached since {}", rfc3339(since)),
            }
        } else {
            due = Some(due.map_or(since + min_ms, |d| d.min(since + min_ms)));
            Vote::Closed {
                reason: GateReason::AttachedTooRecently,
                message: format!("{who} attached at {}; counts after {}s", rfc3339(since), min_ms / 1000),
            }
        }
    } else if b.undated > 0 && b.open {
        Vote::Hold { reason: GateReason::ConnectionAgeUnknown, message: undated_message(b.undated) }
    } else if b.failed_open {
        // Let through once, it stays through: closing it would only reopen it an attachTimeout
        // later.
        Vote::Open {
            reason: GateReason::AttachTimeoutExpired,
            message: "no consumer attached; let through by failurePolicy Open after attachTimeout".into(),
        }
    } else if timed_out {
        Vote::Open {
            reason: GateReason::AttachTimeoutExpired,
            message: format!(
                "no consumer attached within attachTimeout {}s; opened by failurePolicy Open",
                timeout_ms / 1000
            ),
        }
    } else if b.undated > 0 {
        Vote::Closed { reason: GateReason::WaitingForConsumer, message: undated_message(b.undated) }
    } else {
        Vote::Closed { reason: GateReason::WaitingForConsumer, message: "no consumer from this pod yet".into() }
    };
    PolicyVote { vote, due_ms: due, attached_since, counts }
}

fn undated_message(n: usize) -> String {
    format!(
        "{n} consumer(s) from this pod on a connection the broker user cannot see (its age is unknown: give the user the monitoring tag)"
    )
}

/// The pod's one condition, from every Enforce policy's vote (with its queue's name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodVerdict {
    /// None: hold (leave the condition as it is).
    pub open: Option<bool>,
    pub reason: GateReason,
    pub message: String,
    /// Queues still missing this pod's consumer (or policies not bound to theirs yet).
    pub waiting_for: Vec<String>,
}

pub fn combine(votes: &[(String, &Vote)]) -> PodVerdict {
    if votes.is_empty() {
        return PodVerdict {
            open: Some(true),
            reason: GateReason::NotGuarded,
            message: "no QueuePolicy in Enforce mode guards this pod's workload".into(),
            waiting_for: vec![],
        };
    }
    let mut closed: Vec<(&str, GateReason, &str)> = votes
        .iter()
        .filter_map(|(q, v)| match v {
            Vote::Closed { reason, message } => Some((q.as_str(), *reason, message.as_str())),
            _ => None,
        })
        .collect();
    // Two policies on one queue wait for the same consumer.
    let mut named = std::collections::HashSet::new();
    closed.retain(|(q, ..)| named.insert(*q));
    if let Some((_, reason, _)) = closed.first() {
        let waiting_for: Vec<String> = closed.iter().map(|(q, ..)| q.to_string()).collect();
        let detail: Vec<String> = closed.iter().map(|(q, _, m)| format!("{q}: {m}")).collect();
        return PodVerdict {
            open: Some(false),
            reason: *reason,
            message: format!("waiting for {}", detail.join("; ")),
            waiting_for,
        };
    }
    let held: Vec<(&str, GateReason, &str)> = votes
        .iter()
        .filter_map(|(q, v)| match v {
            Vote::Hold { reason, message } => Some((q.as_str(), *reason, message.as_str())),
            _ => None,
        })
        .collect();
    if let Some((_, reason, _)) = held.first() {
        return PodVerdict {
            open: None,
            reason: *reason,
            message: format!(
                "waiting for {}",
                held.iter().map(|(q, _, m)| format!("{q}: {m}")).collect::<Vec<_>>().join("; ")
            ),
            waiting_for: held.iter().map(|(q, ..)| q.to_string()).collect(),
        };
    }
    let opened: Vec<(&str, GateReason, &str)> = votes
        .iter()
        .filter_map(|(q, v)| match v {
            Vote::Open { reason, message } => Some((q.as_str(), *reason, message.as_str())),
            _ => None,
        })
        .collect();
    // A pod let through by failurePolicy says so; otherwise it is attached everywhere.
    let reason = opened.iter().map(|(_, r, _)| *r).find(|r| r.failed_open()).unwrap_or(GateReason::ConsumerAttached);
    let message = match opened.as_slice() {
        [(_, _, m)] => m.to_string(),
        many => many.iter().map(|(q, _, m)| format!("{q}: {m}")).collect::<Vec<_>>().join("; "),
    };
    PodVerdict { open: Some(true), reason, message, waiting_for: vec![] }
}
