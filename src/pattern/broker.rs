//! A QueuePattern on the broker: its policy, and the queues it matches.

use super::{PatternPlan, QueueSeen};
use crate::{
    broker::{
        Broker,
        listing::Want,
        management::{ManagementError, PolicyInfo},
    },
    crd::StatsSource,
    status::{Check, Reason},
};
use regex::Regex;
use std::time::Duration;

/// Puts the pattern's policy on the broker unless it is there already.
pub async fn apply_policy(plan: &PatternPlan, broker: &Broker) -> Check {
    let vhost = broker.vhost().to_owned();
    let desired = PolicyInfo {
        name: plan.policy_name.clone(),
        pattern: plan.pattern.clone(),
        apply_to: "queues".into(),
        priority: plan.priority,
        definition: plan.definition.clone(),
    };
    let up_to_date =
        match broker.management.decide_on_policies(&vhost, |existing| existing.contains(&desired), |up| *up).await {
            Ok(up) => up,
            Err(e) => return failed(e),
        };
    if !up_to_date && let Err(e) = broker.management.put_policy(&vhost, &desired).await {
        return failed(e);
    }
    let keys: Vec<&str> = plan.definition.keys().map(String::as_str).collect();
    Check::ok(
        Reason::PolicyApplied,
        format!("policy '{}' applies {} to queues matching {:?}", plan.policy_name, keys.join(", "), plan.pattern),
    )
}

/// What a look at the vhost found for a pattern.
pub struct Matching {
    pub seen: Vec<QueueSeen>,
    /// How many of them another policy governs instead (one with a higher priority, such as a
    /// QueuePolicy's own).
    pub elsewhere: usize,
    /// Where their depths and consumer counts came from.
    pub source: StatsSource,
}

/// The queues the pattern matches, in a listing of the vhost read at most `fresh_within`
/// before (shared with every policy and pattern of the vhost).
pub async fn matching(
    plan: &PatternPlan,
    broker: &Broker,
    fresh_within: Duration,
) -> Result<Matching, ManagementError> {
    let re = Regex::new(&plan.pattern).expect("validated by plan()");
    let listing = broker.management.queues_in(broker.vhost(), Want::Pattern(&plan.pattern), fresh_within).await?;
    let mut matching: Vec<_> = listing.queues.values().filter(|q| re.is_match(&q.name)).collect();
    matching.sort_by(|a, b| a.name.cmp(&b.name));
    let elsewhere = matching.iter().filter(|q| q.policy.as_deref().is_some_and(|p| p != plan.policy_name)).count();
    let seen = matching
        .into_iter()
        .map(|q| QueueSeen {
            name: q.name.clone(),
            ready: q.messages_ready.unwrap_or_default(),
            consumers: q.consumers.unwrap_or_default(),
        })
        .collect();
    Ok(Matching { seen, elsewhere, source: listing.source })
}

/// Removes the pattern's policy; the queues stay, without its expiry.
pub async fn remove_policy(plan: &PatternPlan, broker: &Broker) -> Result<(), ManagementError> {
    broker.management.delete_policy(broker.vhost(), &plan.policy_name).await
}

fn failed(e: ManagementError) -> Check {
    crate::converge::policy_failure(e)
}
