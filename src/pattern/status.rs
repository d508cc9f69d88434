//! A QueuePattern's status and Events, as plain functions of what the controller found: Ready
//! from putting the policy on the broker, one condition per finding of the last look.

use super::{
    WatchReport,
    crd::{PatternFinding, QueuePatternStatus},
};
use crate::{
    crd::StatsSource,
    events::{EventReason, EventSpec, finding_transitions},
    status::{Check, ConditionType, Reason, Truth, condition_of, finding_condition},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Condition, jiff::Timestamp};

/// The next status: Ready from the policy step, one condition per finding judged (kept from
/// the previous status when the queues could not be looked at), with where the look's counters
/// came from.
pub fn next_status(
    previous: Option<&QueuePatternStatus>,
    ready: &Check,
    looked: Option<(&WatchReport, StatsSource)>,
    policy: Option<String>,
    generation: Option<i64>,
    now: Timestamp,
) -> QueuePatternStatus {
    let old = previous.cloned().unwrap_or_default();
    let report = looked.map(|(r, _)| r);
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
        stats_source: looked.map(|(_, source)| source).or(old.stats_source),
    }
}

/// Ready changing, and findings coming up (Warning) or clearing (Normal).
pub fn transitions(old: &[Condition], new: &[Condition]) -> Vec<EventSpec> {
    let mut events = Vec::new();
    let is_ready = |c: &&Condition| c.type_ == ConditionType::Ready.as_str();
    // The new Ready is this pass's own, so its reason is always the operator's.
    if let Some(ready) = new.iter().find(is_ready)
        && !old.iter().filter(is_ready).any(|w| w.status == ready.status && w.reason == ready.reason)
        && let Ok(reason) = ready.reason.parse::<Reason>()
    {
        events.push(EventSpec {
            warning: Truth::of(&ready.status) != Truth::True,
            reason: EventReason::Condition(reason),
            action: "ApplyPolicy",
            note: ready.message.clone(),
        });
    }
    let findings = PatternFinding::ALL.map(|f| (f.as_str(), EventReason::PatternFinding(f)));
    events.extend(finding_transitions(old, new, &findings, "WatchQueues"));
    events
}

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
        let first = next_status(
            None,
            &ready,
            Some((&report(None), StatsSource::Prometheus)),
            Some("queueguard.pattern.shop.r".into()),
            Some(1),
            t,
        );
        let events = transitions(&[], &first.conditions);
        assert_eq!(
            events.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["PolicyApplied"],
            "NotSeen findings are no news"
        );
        let leaking = next_status(
            Some(&first),
            &ready,
            Some((&report(Some("40 queues match")), StatsSource::Prometheus)),
            None,
            Some(1),
            t,
        );
        let events = transitions(&first.conditions, &leaking.conditions);
        assert_eq!((events.len(), events[0].reason.as_str(), events[0].warning), (1, "QueueLeak", true));
        let unseen = next_status(Some(&leaking), &ready, None, None, Some(1), t);
        assert_eq!(unseen.conditions, leaking.conditions, "without a look the findings stay");
        assert_eq!(unseen.broker_policy.as_deref(), Some("queueguard.pattern.shop.r"));
        assert_eq!(unseen.stats_source, Some(StatsSource::Prometheus), "the last look's source stays");
        let cleared =
            next_status(Some(&leaking), &ready, Some((&report(None), StatsSource::Management)), None, Some(1), t);
        let events = transitions(&leaking.conditions, &cleared.conditions);
        assert_eq!((events[0].reason.as_str(), events[0].warning), ("FindingCleared", false));
        assert_eq!(cleared.stats_source, Some(StatsSource::Management), "the new look's source");
    }
}
