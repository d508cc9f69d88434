//! Which Kubernetes Events a status change deserves: one per condition transition, never one per
//! reconcile.

use crate::{
    crd::Finding,
    pattern::crd::PatternFinding,
    status::{ConditionType, Reason, Truth},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Events carry at most 1 KiB of note.
const MAX_NOTE: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSpec {
    pub warning: bool,
    pub reason: EventReason,
    pub action: &'static str,
    pub note: String,
}

/// Every reason an Event of the operator's can give.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
pub enum EventReason {
    /// A condition changed to this reason (QueuePolicy and QueuePattern conditions).
    Condition(Reason),
    /// A consumer hygiene finding came up.
    Finding(Finding),
    /// A QueuePattern finding came up.
    PatternFinding(PatternFinding),
    /// A finding that was seen is no longer.
    FindingCleared,
    /// A guarded Deployment's unsafe strategy was patched.
    StrategyPatched,
    /// A pod has waited longer than attachTimeout for its consumer.
    RolloutStalled,
    /// Another PodDisruptionBudget selects the pods, so the operator creates none.
    DisruptionBudgetSkipped,
    /// A QueuePattern's broker policy was removed with it.
    PolicyRemoved,
    /// On a pod: its gate opened, closed, or opened without a consumer (failurePolicy Open).
    GateOpened,
    GateClosed,
    GateFailedOpen,
}

impl EventReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Condition(r) => r.as_str(),
            Self::Finding(f) => f.as_str(),
            Self::PatternFinding(f) => f.as_str(),
            other => other.into(),
        }
    }
}

/// Events for conditions whose status or reason changed. Several conditions failing for the same
/// reason and message (an unreachable broker) make one Event.
pub fn transitions(old: &[Condition], new: &[Condition]) -> Vec<EventSpec> {
    let mut events: Vec<EventSpec> = Vec::new();
    for (kind, action) in [
        (ConditionType::QueueDeclared, "DeclareQueue"),
        (ConditionType::DeadLetterReady, "DeclareDeadLetter"),
        (ConditionType::SettingsApplied, "ApplySettings"),
        (ConditionType::ConsumersAttached, "TrackConsumers"),
        (ConditionType::RolloutSafe, "GuardRollout"),
    ] {
        let Some(now) = crate::status::find(new, kind) else {
            continue;
        };
        let before = crate::status::find(old, kind);
        if before.is_some_and(|b| b.status == now.status && b.reason == now.reason) {
            continue;
        }
        // The new conditions are this pass's own, so their reasons are always the operator's.
        let Ok(reason) = now.reason.parse::<Reason>() else { continue };
        let event = EventSpec {
            warning: Truth::of(&now.status) != Truth::True,
            reason: EventReason::Condition(reason),
            action,
            note: now.message.clone(),
        };
        if !events.iter().any(|e| e.reason == event.reason && e.note == event.note) {
            events.push(event);
        }
    }
    let findings = Finding::ALL.map(|f| (f.as_str(), EventReason::Finding(f)));
    events.extend(finding_transitions(old, new, &findings, "CheckConsumers"));
    events
}

/// For the finding conditions named in `kinds`: one coming up is a Warning; one going away after
/// being seen is a Normal Event. Only transitions count, so a habit that persists is announced
/// once, not every pass.
pub fn finding_transitions(
    old: &[Condition],
    new: &[Condition],
    kinds: &[(&str, EventReason)],
    action: &'static str,
) -> Vec<EventSpec> {
    let holds = |c: &Condition| Truth::of(&c.status) == Truth::True;
    let was_seen = |kind: &str| old.iter().any(|c| c.type_ == kind && holds(c));
    kinds
        .iter()
        .filter_map(|&(kind, reason)| {
            let now = new.iter().find(|c| c.type_ == kind)?;
            match (was_seen(kind), holds(now)) {
                (false, true) => Some(EventSpec { warning: true, reason, action, note: now.message.clone() }),
                (true, false) => Some(EventSpec {
                    warning: false,
                    reason: EventReason::FindingCleared,
                    action,
                    note: format!("{kind} no longer seen"),
                }),
                _ => None,
            }
        })
        .collect()
}

/// An Event's note as the API server takes it: cut to [`MAX_NOTE`] bytes (a longer one is
/// refused, and the Event lost). Applied where Events are published, so every note is.
pub fn truncate(text: &str) -> String {
    if text.len() <= MAX_NOTE {
        return text.to_owned();
    }
    let mut end = MAX_NOTE - 3;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{Check, Outcome, Reason, next_status};
    use k8s_openapi::jiff::Timestamp;

    fn conditions(outcome: &Outcome) -> Vec<Condition> {
        next_status(None, outcome, Some(1), Timestamp::UNIX_EPOCH).conditions
    }

    fn ready() -> Outcome {
        let mut o = Outcome::blocked(Check::ok(Reason::Declared, "fine"));
        o.settings = Check::ok(Reason::PolicyApplied, "policy applied");
        o
    }

    #[test]
    fn first_reconcile_announces_each_step() {
        let events = transitions(&[], &conditions(&ready()));
        let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(reasons, ["Declared", "PolicyApplied"], "two steps with the same reason and note make one Event");
        assert!(events.iter().all(|e| !e.warning));
    }

    #[test]
    fn nothing_changed_means_no_events() {
        let c = conditions(&ready());
        assert!(transitions(&c, &c).is_empty());
    }

    #[test]
    fn an_unreachable_broker_is_one_warning() {
        let down = Outcome::blocked(Check::unknown(Reason::BrokerUnreachable, "cannot connect to amqp://h:5672/%2F"));
        let events = transitions(&conditions(&ready()), &conditions(&down));
        assert_eq!(events.len(), 1);
        assert!(events[0].warning);
        assert_eq!(events[0].reason.as_str(), "BrokerUnreachable");
    }

    #[test]
    fn notes_are_cut_to_the_api_limit_on_a_char_boundary() {
        let long = "é".repeat(1000);
        let cut = truncate(&long);
        assert!(cut.len() <= MAX_NOTE && cut.ends_with("..."));
    }

    #[test]
    fn event_reasons_read_as_the_words_kubectl_shows() {
        let words: Vec<&str> = [
            EventReason::Condition(Reason::QueueDeleted),
            EventReason::Finding(Finding::AutoAckConsumer),
            EventReason::PatternFinding(PatternFinding::QueueLeak),
            EventReason::FindingCleared,
            EventReason::DisruptionBudgetSkipped,
            EventReason::GateFailedOpen,
        ]
        .map(EventReason::as_str)
        .into();
        assert_eq!(
            words,
            [
                "QueueDeleted",
                "AutoAckConsumer",
                "QueueLeak",
                "FindingCleared",
                "DisruptionBudgetSkipped",
                "GateFailedOpen"
            ]
        );
    }
}
