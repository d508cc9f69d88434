//! What other QueuePolicies and QueuePatterns name on the broker, so that deleting one policy
//! (deletionPolicy Delete) never removes a dead-letter queue or exchange another still uses:
//! two policies sharing `deadLetter: {exchange: dlx, queue: dead}` must keep both when one goes.
//!
//! Names are compared within a vhost where the vhost is known; a policy on another Secret whose
//! vhost comes from that Secret might be on the same broker and vhost, so it counts (keeping a
//! queue too many is safe, deleting one too many loses messages).

use crate::{
    broker_source::BrokerSource,
    crd::{DeletionPolicy, QueuePolicy},
    migrate::Target,
    pattern::crd::QueuePattern,
    plan::{self, Limits, QueuePlan},
};
use kube::ResourceExt;
use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
};

/// Queue and exchange names others use, each with who uses it (`QueuePolicy ns/name`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Claims {
    pub queues: BTreeMap<String, BTreeSet<String>>,
    pub exchanges: BTreeMap<String, BTreeSet<String>>,
    /// The shape each other policy declares a queue with (`quorum {x-max-length: 5}`), by
    /// queue and then by who.
    pub shapes: BTreeMap<String, BTreeMap<String, String>>,
}

impl Claims {
    /// Who else uses queue `name`, if anyone.
    pub fn queue(&self, name: &str) -> Option<&BTreeSet<String>> {
        self.queues.get(name)
    }

    pub fn exchange(&self, name: &str) -> Option<&BTreeSet<String>> {
        self.exchanges.get(name)
    }
}

/// Where a plan's entities live, as far as can be told without reading its Secret.
struct Place<'a> {
    /// The Secret or RabbitmqCluster its credentials come from: (namespace, kind, name).
    source: (Option<&'a str>, &'static str, &'a str),
    vhost: Option<&'a str>,
}

/// Whether `a` and `b` may be the same vhost of the same broker.
fn may_share(a: &Place, b: &Place) -> bool {
    match (a.vhost, b.vhost) {
        (Some(x), Some(y)) => x == y,
        // Both from their Secret: the same Secret is the same vhost; another may be too.
        (None, None) => true,
        // One explicit, one from a Secret: unknown unless it is the same Secret.
        _ => a.source != b.source,
    }
}

/// What every policy and pattern other than `me` names, for `me`'s cleanup. Policies being
/// deleted with deletionPolicy Delete are leaving too and claim nothing; one being deleted with
/// Retain keeps its queue, which still dead-letters into what it names.
pub fn others(
    me: &QueuePolicy,
    mine: &QueuePlan,
    policies: &[impl Borrow<QueuePolicy>],
    patterns: &[impl Borrow<QueuePattern>],
    limits: Limits,
) -> Claims {
    let my_ns = me.namespace().unwrap_or_default();
    let here = Place { source: mine.broker.object(Some(&my_ns)), vhost: mine.vhost.as_deref() };
    let mut claims = Claims::default();
    for p in policies.iter().map(Borrow::borrow) {
        let same = p.uid().is_some() && p.uid() == me.uid()
            || p.namespace() == me.namespace() && p.name_any() == me.name_any();
        let leaving = p.metadata.deletion_timestamp.is_some() && p.spec.deletion_policy == DeletionPolicy::Delete;
        if same || leaving {
            continue;
        }
        // An invalid spec never declared anything.
        let Ok(theirs) = plan::plan(p, limits) else { continue };
        let ns = p.namespace().unwrap_or_default();
        let there = Place { source: theirs.broker.object(Some(&ns)), vhost: theirs.vhost.as_deref() };
        if !may_share(&here, &there) {
            continue;
        }
        let who = format!("QueuePolicy {ns}/{}", p.name_any());
        for target in [Target::of_queue(&theirs), Target::of_dead_letter_queue(&theirs)] {
            claims.queues.entry(target.queue.clone()).or_default().insert(who.clone());
            claims.shapes.entry(target.queue.clone()).or_default().insert(who.clone(), target.shape().describe());
        }
        claims.exchanges.entry(theirs.settings.dead_letter_exchange.clone()).or_default().insert(who);
    }
    for p in patterns.iter().map(Borrow::borrow) {
        let Some(exchange) = &p.spec.dead_letter_exchange else { continue };
        let ns = p.namespace().unwrap_or_default();
        let Some(source) = BrokerSource::of(&p.spec.broker) else { continue };
        let there = Place { source: source.object(Some(&ns)), vhost: p.spec.broker.vhost.as_deref() };
        if may_share(&here, &there) {
            claims.exchanges.entry(exchange.clone()).or_default().insert(format!("QueuePattern {ns}/{}", p.name_any()));
        }
    }
    claims
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(ns: &str, name: &str, rest: &str) -> QueuePolicy {
        let doc = format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name}, namespace: {ns}, uid: {name}-uid}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  {rest}\n"
        );
        serde_yaml_ng::from_str(&doc).unwrap()
    }

    fn pattern(ns: &str, exchange: &str, broker: &str) -> QueuePattern {
        let doc = format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePattern\nmetadata: {{name: replies, namespace: {ns}}}\nspec:\n  broker: {broker}\n  pattern: '^amq\\.gen'\n  deadLetterExchange: {exchange}\n"
        );
        serde_yaml_ng::from_str(&doc).unwrap()
    }

    fn claims_of(me: &QueuePolicy, policies: &[QueuePolicy], patterns: &[QueuePattern]) -> Claims {
        let plan = plan::plan(me, Limits::default()).unwrap();
        others(me, &plan, policies, patterns, Limits::default())
    }

    const SHARED: &str = "queue: {deadLetter: {exchange: dlx, queue: dead}}";

    #[test]
    fn a_shared_dead_letter_queue_and_exchange_are_claimed_by_the_other_policy() {
        let a = policy("shop", "a", SHARED);
        let b = policy("shop", "b", SHARED);
        let c = claims_of(&a, &[a.clone(), b.clone()], &[]);
        let by_b = BTreeSet::from(["QueuePolicy shop/b".to_owned()]);
        assert_eq!(c.queue("dead"), Some(&by_b));
        assert_eq!(c.exchange("dlx"), Some(&by_b));
        assert_eq!(c.queue("b"), Some(&by_b), "b's own queue");
        assert_eq!(c.queue("a"), None, "its own names are not claims");
        assert_eq!(c.shapes["dead"], BTreeMap::from([("QueuePolicy shop/b".to_owned(), "classic".to_owned())]));
    }

    #[test]
    fn another_vhost_claims_nothing_and_an_unknown_one_claims_all() {
        let mut a = policy("shop", "a", SHARED);
        a.spec.broker.vhost = Some("orders".into());
        let mut elsewhere = policy("shop", "b", SHARED);
        elsewhere.spec.broker.vhost = Some("billing".into());
        assert_eq!(claims_of(&a, &[elsewhere], &[]), Claims::default());
        // Another Secret's vhost is unknown here: it may be the same.
        let mut other_secret = policy("shop", "b", SHARED);
        other_secret.spec.broker.secret_ref = Some(crate::crd::SecretRef { name: "other".into() });
        assert!(claims_of(&a, &[other_secret], &[]).queue("dead").is_some());
        // The same Secret without an explicit vhost is the Secret's vhost, which `a` overrides.
        let same_secret = policy("shop", "b", SHARED);
        assert_eq!(claims_of(&a, &[same_secret], &[]), Claims::default());
    }

    #[test]
    fn a_policy_leaving_with_delete_claims_nothing_and_one_leaving_with_retain_still_does() {
        let a = policy("shop", "a", SHARED);
        let mut leaving = policy("shop", "b", &format!("{SHARED}\n  deletionPolicy: Delete"));
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
        assert_eq!(claims_of(&a, &[leaving.clone()], &[]), Claims::default());
        leaving.spec.deletion_policy = DeletionPolicy::Retain;
        assert!(claims_of(&a, &[leaving], &[]).queue("dead").is_some());
    }

    #[test]
    fn a_pattern_claims_its_dead_letter_exchange() {
        let a = policy("shop", "a", SHARED);
        let c = claims_of(&a, &[], &[pattern("shop", "dlx", "{secretRef: {name: rabbitmq}}")]);
        assert_eq!(c.exchange("dlx"), Some(&BTreeSet::from(["QueuePattern shop/replies".to_owned()])));
        assert!(c.queues.is_empty());
        let other_vhost = pattern("shop", "dlx", "{secretRef: {name: rabbitmq}, vhost: elsewhere}");
        let mut a = a;
        a.spec.broker.vhost = Some("orders".into());
        assert_eq!(claims_of(&a, &[], &[other_vhost]), Claims::default());
    }
}
