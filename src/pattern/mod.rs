//! QueuePattern: from the resource to the broker policy it wants (pure), and the judgement of
//! the matching set of queues over time (pure). `broker` does the management API I/O.

pub mod broker;
pub mod crd;
pub mod status;

use crate::{
    broker_source::BrokerSource,
    duration,
    plan::{Errors, FieldError, Limits, MAX_EXPIRY_MS},
};
use crd::{MatchingQueues, PatternFinding, QueuePattern};
use serde_json::{Map, Value, json};
use std::{collections::BTreeSet, time::Duration};

/// A QueuePattern resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct PatternPlan {
    /// `namespace/name`, for messages.
    pub owner: String,
    pub policy_name: String,
    pub pattern: String,
    pub vhost: Option<String>,
    /// Where the broker's credentials come from.
    pub broker: BrokerSource,
    pub priority: i64,
    pub definition: Map<String, Value>,
    pub ignore: Vec<PatternFinding>,
}

pub fn plan(p: &QueuePattern, limits: Limits) -> Result<PatternPlan, Vec<FieldError>> {
    let mut errors = Errors::default();
    let namespace = p.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let name = p.metadata.name.clone().unwrap_or_default();
    let spec = &p.spec;
    if let Err(e) = regex::Regex::new(&spec.pattern) {
        errors.add("spec.pattern", format!("not a regular expression: {e}"));
    } else if spec.pattern.is_empty() {
        errors.add("spec.pattern", "must not be empty");
    }
    let expires = errors.duration("spec.expires", &spec.expires);
    if let Some(e) = expires {
        if e < limits.min_expires {
            errors.add("spec.expires", format!("must be at least {}", duration::Human(limits.min_expires)));
        } else if e.as_millis() > u128::from(MAX_EXPIRY_MS) {
            errors.add("spec.expires", "is longer than the broker accepts (about 49 days)");
        }
    }
    if spec.max_length.is_some_and(|m| m < 0) {
        errors.add("spec.maxLength", "must not be negative");
    }
    if spec.dead_letter_routing_key.is_some() && spec.dead_letter_exchange.is_none() {
        errors.add("spec.deadLetterRoutingKey", "needs spec.deadLetterExchange");
    }
    if !(0..100).contains(&spec.priority) {
        errors.add("spec.priority", "must be between 0 and 99, below the QueuePolicies' 100");
    }
    let broker = crate::plan::broker_source(&mut errors, &spec.broker);
    if spec.broker.vhost.as_deref().is_some_and(|v| !crate::broker::management::addressable(v)) {
        errors.add("spec.broker.vhost", "must not be '.' or '..': management API paths read them as dot segments");
    }
    errors.finish()?;
    let mut definition = Map::new();
    definition.insert("expires".into(), json!(expires.unwrap_or_default().as_millis() as u64));
    if let Some(m) = spec.max_length {
        definition.insert("max-length".into(), json!(m));
    }
    if let Some(dlx) = &spec.dead_letter_exchange {
        definition.insert("dead-letter-exchange".into(), json!(dlx));
    }
    if let Some(key) = &spec.dead_letter_routing_key {
        definition.insert("dead-letter-routing-key".into(), json!(key));
    }
    Ok(PatternPlan {
        owner: format!("{namespace}/{name}"),
        policy_name: format!("queueguard.pattern.{namespace}.{name}"),
        pattern: spec.pattern.clone(),
        vhost: spec.broker.vhost.clone(),
        broker: broker.unwrap_or(BrokerSource::Secret { name: String::new() }),
        priority: spec.priority.into(),
        definition,
        ignore: spec.ignore.clone(),
    })
}

/// One matching queue as the management API lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSeen {
    pub name: String,
    pub ready: i64,
    pub consumers: i64,
}

/// Remembered between looks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WatchMemory {
    names: Option<BTreeSet<String>>,
    /// Looks in a row in which more queues appeared than went away.
    rising: u32,
    /// The count when the rise began.
    rise_from: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct WatchReport {
    pub queues: MatchingQueues,
    /// Each finding not ignored, with Some(why and what to do) when seen.
    pub verdicts: Vec<(PatternFinding, Option<String>)>,
}

/// Looks in a row the set must grow before it counts as a leak: one burst of new clients is not.
const RISING_LOOKS: u32 = 3;
/// Queues named in a message, at most.
const NAMED: usize = 5;

pub fn evaluate(memory: &WatchMemory, seen: &[QueueSeen], ignore: &[PatternFinding]) -> (WatchMemory, WatchReport) {
    let names: BTreeSet<String> = seen.iter().map(|q| q.name.clone()).collect();
    let (created, deleted) = match &memory.names {
        Some(before) => (names.difference(before).count(), before.difference(&names).count()),
        None => (0, 0),
    };
    let rising = if memory.names.is_some() && created > deleted { memory.rising + 1 } else { 0 };
    let rise_from = if rising == 1 { memory.names.as_ref().map_or(0, BTreeSet::len) } else { memory.rise_from };
    let orphaned: Vec<&QueueSeen> = seen.iter().filter(|q| q.ready > 0 && q.consumers == 0).collect();

    let mut verdicts = Vec::new();
    if !ignore.contains(&PatternFinding::QueueLeak) {
        let leak = (rising >= RISING_LOOKS).then(|| {
            format!(
                "{} queues match, up from {rise_from} over the last {rising} looks ({created} created, {deleted} deleted since the previous one): something creates queues and does not remove them, e.g. an RPC client declaring a reply queue per call; reuse one reply queue per client or use direct reply-to (amq.rabbitmq.reply-to)",
                names.len()
            )
        });
        verdicts.push((PatternFinding::QueueLeak, leak));
    }
    if !ignore.contains(&PatternFinding::OrphanedReplies) {
        let found = (!orphaned.is_empty()).then(|| {
            let listed: Vec<&str> = orphaned.iter().take(NAMED).map(|q| q.name.as_str()).collect();
            let more = orphaned.len().saturating_sub(NAMED);
            format!(
                "{} queue(s) hold ready messages with no consumer ({}{}): replies whose requester is gone; they are dropped without dead-lettering when the queue expires, so make requesters consume their replies or time out and delete their queue",
                orphaned.len(),
                listed.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            )
        });
        verdicts.push((PatternFinding::OrphanedReplies, found));
    }
    let queues = MatchingQueues {
        matching: names.len() as i64,
        created: created as i64,
        deleted: deleted as i64,
        messages_ready: seen.iter().map(|q| q.ready).sum(),
        orphaned: orphaned.len() as i64,
    };
    (WatchMemory { names: Some(names), rising, rise_from }, WatchReport { queues, verdicts })
}

/// Whether the pattern matches a queue name (for the linter and tests); false when it is not
/// a regular expression.
pub fn matches(pattern: &str, queue: &str) -> bool {
    regex::Regex::new(pattern).is_ok_and(|re| re.is_match(queue))
}

/// The expiry a plan's policy sets, for reports.
pub fn expires(plan: &PatternPlan) -> Duration {
    Duration::from_millis(plan.definition.get("expires").and_then(Value::as_u64).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(spec: &str) -> QueuePattern {
        let doc = format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePattern\nmetadata: {{name: replies, namespace: shop}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  {spec}\n"
        );
        serde_yaml_ng::from_str(&doc).unwrap()
    }

    fn queues(names: &[(&str, i64, i64)]) -> Vec<QueueSeen> {
        names
            .iter()
            .map(|(n, ready, consumers)| QueueSeen { name: (*n).into(), ready: *ready, consumers: *consumers })
            .collect()
    }

    #[test]
    fn the_policy_carries_expiry_limit_and_dead_lettering() {
        let p = plan(
            &pattern("pattern: '^rpc\\.reply\\.'\n  expires: 5m\n  maxLength: 100\n  deadLetterExchange: replies.dlx"),
            Limits::default(),
        )
        .unwrap();
        assert_eq!(p.policy_name, "queueguard.pattern.shop.replies");
        assert_eq!(
            Value::Object(p.definition.clone()),
            json!({"expires": 300_000, "max-length": 100, "dead-letter-exchange": "replies.dlx"})
        );
        assert_eq!(expires(&p), Duration::from_secs(300));
        assert_eq!(p.priority, 0);
    }

    #[test]
    fn bad_specs_name_their_fields() {
        let errors = plan(
            &pattern("pattern: '(unclosed'\n  expires: 10s\n  priority: 100\n  deadLetterRoutingKey: k"),
            Limits::default(),
        )
        .unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.pattern", "spec.expires", "spec.deadLetterRoutingKey", "spec.priority"]);
    }

    #[test]
    fn a_set_that_grows_three_looks_in_a_row_is_a_leak_and_a_pause_clears_it() {
        let mut memory = WatchMemory::default();
        let mut last = None;
        for n in 1..=4 {
            let names: Vec<String> = (0..n * 10).map(|i| format!("rpc.reply.{i}")).collect();
            let seen: Vec<QueueSeen> =
                names.iter().map(|n| QueueSeen { name: n.clone(), ready: 0, consumers: 1 }).collect();
            let (m, r) = evaluate(&memory, &seen, &[]);
            memory = m;
            last = Some(r);
        }
        let report = last.unwrap();
        let leak = report.verdicts[0].1.as_deref().unwrap();
        assert!(leak.starts_with("40 queues match, up from 10 over the last 3 looks (10 created, 0 deleted"), "{leak}");
        assert_eq!((report.queues.matching, report.queues.created), (40, 10));

        let same: Vec<QueueSeen> =
            (0..40).map(|i| QueueSeen { name: format!("rpc.reply.{i}"), ready: 0, consumers: 1 }).collect();
        let (_, steady) = evaluate(&memory, &same, &[]);
        assert_eq!(steady.verdicts[0].1, None, "no growth, no leak");
    }

    #[test]
    fn churn_that_balances_out_is_no_leak() {
        let mut memory = WatchMemory::default();
        for look in 0..5 {
            let seen = queues(&[(&format!("r.{look}"), 0, 1), (&format!("r.{}", look + 1), 0, 1)]);
            let (m, r) = evaluate(&memory, &seen, &[]);
            memory = m;
            assert_eq!(r.verdicts[0].1, None);
        }
    }

    #[test]
    fn replies_nobody_reads_are_orphans() {
        let (_, r) = evaluate(&WatchMemory::default(), &queues(&[("r.1", 3, 0), ("r.2", 0, 0), ("r.3", 5, 1)]), &[]);
        let orphans = r.verdicts[1].1.as_deref().unwrap();
        assert!(orphans.starts_with("1 queue(s) hold ready messages with no consumer (r.1)"), "{orphans}");
        assert_eq!((r.queues.orphaned, r.queues.messages_ready), (1, 8));
        let (_, quiet) =
            evaluate(&WatchMemory::default(), &queues(&[("r.1", 3, 0)]), &[PatternFinding::OrphanedReplies]);
        assert_eq!(quiet.verdicts.len(), 1, "ignored findings are not judged");
    }
}
