//! The pure translation from a [`QueuePlan`] to what the broker is sent: queue arguments, the
//! operator's policy, and the policy decision (is ours shadowed, whose settings does it displace).
//!
//! RabbitMQ applies exactly one policy to a queue: the matching one with the highest priority.
//! The operator's policy therefore carries forward the keys of the user policy it displaces
//! (say `ha-mode` or `queue-mode`), so taking over a queue does not silently drop them.

use crate::{
    broker::{management::PolicyInfo, refusal::Inequivalence},
    crd::SettingsMode,
    plan::QueuePlan,
};
use regex::Regex;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// Priority of operator policies: above the usual catch-all policies (0 to 10).
pub const POLICY_PRIORITY: i64 = 100;

/// An AMQP argument value as queueguard sends it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum ArgValue {
    Long(i64),
    Str(String),
}

/// The `x-` arguments of the queue's declare. Policy mode sends only the type; a plain re-declare
/// by an application (no arguments) then stays equivalent for classic queues.
pub fn queue_arguments(plan: &QueuePlan) -> BTreeMap<&'static str, ArgValue> {
    let mut args = BTreeMap::from([("x-queue-type", ArgValue::Str(plan.queue_type.as_str().into()))]);
    if plan.mode == SettingsMode::Arguments {
        for (key, value) in setting_pairs(plan) {
            args.insert(key.argument, value);
        }
    }
    args
}

/// The dead-letter queue's arguments: same type as the queue, and no expiry, ever.
pub fn dead_letter_queue_arguments(plan: &QueuePlan) -> BTreeMap<&'static str, ArgValue> {
    BTreeMap::from([("x-queue-type", ArgValue::Str(plan.queue_type.as_str().into()))])
}

struct Key {
    argument: &'static str,
    policy: &'static str,
}

const EXPIRES: Key = Key { argument: "x-expires", policy: "expires" };
const DLX: Key = Key { argument: "x-dead-letter-exchange", policy: "dead-letter-exchange" };
const DLRK: Key = Key { argument: "x-dead-letter-routing-key", policy: "dead-letter-routing-key" };
const TTL: Key = Key { argument: "x-message-ttl", policy: "message-ttl" };
const MAX_LEN: Key = Key { argument: "x-max-length", policy: "max-length" };
const OVERFLOW: Key = Key { argument: "x-overflow", policy: "overflow" };
const DELIVERY_LIMIT: Key = Key { argument: "x-delivery-limit", policy: "delivery-limit" };

/// Every key the operator manages, as policy keys (so displaced policies cannot override them).
/// `delivery-limit` is not among them: a displaced policy's limit is carried forward unless the
/// QueuePolicy sets its own (dropping it would fall back to the broker's default of 20).
const MANAGED_POLICY_KEYS: [&str; 6] =
    [EXPIRES.policy, DLX.policy, DLRK.policy, TTL.policy, MAX_LEN.policy, OVERFLOW.policy];

fn setting_pairs(plan: &QueuePlan) -> Vec<(Key, ArgValue)> {
    let s = &plan.settings;
    let ms = |d: std::time::Duration| ArgValue::Long(d.as_millis() as i64);
    let mut pairs = vec![
        (EXPIRES, ms(s.expires)),
        (DLX, ArgValue::Str(s.dead_letter_exchange.clone())),
        (DLRK, ArgValue::Str(s.dead_letter_routing_key.clone())),
    ];
    if let Some(ttl) = s.message_ttl {
        pairs.push((TTL, ms(ttl)));
    }
    if let Some(n) = s.max_length {
        pairs.push((MAX_LEN, ArgValue::Long(n)));
    }
    if let Some(o) = s.overflow {
        pairs.push((OVERFLOW, ArgValue::Str(o.as_str().into())));
    }
    if let Some(n) = s.delivery_limit {
        pairs.push((DELIVERY_LIMIT, ArgValue::Long(n)));
    }
    pairs
}

/// What the operator decides about its broker policy, given the vhost's policies.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyDecision {
    /// The policy the operator wants on the broker.
    pub desired: PolicyInfo,
    /// The broker already has exactly this policy: nothing to send.
    pub up_to_date: bool,
    /// Another policy matching the queue at equal or higher priority: ours does not apply.
    pub shadowed_by: Option<PolicyInfo>,
    /// The lower-priority policy ours displaces, whose other keys ours carries forward.
    pub displaced: Option<String>,
    /// Policies whose pattern could not be evaluated (not a regex this operator reads).
    pub unreadable: Vec<String>,
}

impl PolicyDecision {
    /// Nothing to write and nothing in the way: the state a fleet at rest is in.
    pub fn settled(&self) -> bool {
        self.up_to_date && self.shadowed_by.is_none()
    }
}

/// The policies among `policies` that match queue `queue` of type `queue_type` (`classic`,
/// `quorum`), highest priority first (the first is the one RabbitMQ applies; among equals by
/// name, so the choice is stable), and the names of those whose pattern could not be read.
pub fn matching_policies<'a>(
    queue: &str,
    queue_type: &str,
    policies: &'a [PolicyInfo],
) -> (Vec<&'a PolicyInfo>, Vec<String>) {
    let mut unreadable = Vec::new();
    let mut matching: Vec<&PolicyInfo> = policies
        .iter()
        .filter(|p| match p.apply_to.as_str() {
            "queues" | "all" => true,
            "classic_queues" => queue_type == "classic",
            "quorum_queues" => queue_type == "quorum",
            _ => false,
        })
        .filter(|p| match exact_name(&p.pattern) {
            Some(name) => name == queue,
            None => match Regex::new(&p.pattern) {
                Ok(re) => re.is_match(queue),
                Err(_) => {
                    unreadable.push(p.name.clone());
                    false
                }
            },
        })
        .collect();
    matching.sort_by(|a, b| b.priority.cmp(&a.priority).then_with(|| a.name.cmp(&b.name)));
    (matching, unreadable)
}

/// Decides the operator policy for `plan` among the vhost's `existing` policies.
pub fn policy_decision(plan: &QueuePlan, existing: &[PolicyInfo]) -> PolicyDecision {
    let (mut matching, unreadable) = matching_policies(&plan.queue, plan.queue_type.as_str(), existing);
    matching.retain(|p| p.name != plan.policy_name);
    let shadowed_by = matching.iter().find(|p| p.priority >= POLICY_PRIORITY).map(|p| (*p).clone());
    let displaced = matching.iter().find(|p| p.priority < POLICY_PRIORITY).copied();

    let mut definition = Map::new();
    if let Some(d) = displaced {
        for (k, v) in &d.definition {
            if !MANAGED_POLICY_KEYS.contains(&k.as_str()) {
                definition.insert(k.clone(), v.clone());
            }
        }
    }
    for (key, value) in setting_pairs(plan) {
        definition.insert(key.policy.into(), to_json(&value));
    }
    let desired = PolicyInfo {
        name: plan.policy_name.clone(),
        pattern: format!("^{}$", regex::escape(&plan.queue)),
        apply_to: "queues".into(),
        priority: POLICY_PRIORITY,
        definition,
    };
    let up_to_date = existing.contains(&desired);
    PolicyDecision { desired, up_to_date, shadowed_by, displaced: displaced.map(|p| p.name.clone()), unreadable }
}

/// The one name a pattern of the form `^literal$` matches, or None for any other pattern.
/// Operator policies all have this form, so a vhost of a thousand of them is checked without
/// compiling a thousand regular expressions per reconcile.
fn exact_name(pattern: &str) -> Option<String> {
    let mut chars = pattern.strip_prefix('^')?.chars();
    let mut name = String::new();
    while let Some(c) = chars.next() {
        match c {
            // `\.` is a literal dot, `\d` a class: only escaped punctuation is literal.
            '\\' => name.push(chars.next().filter(char::is_ascii_punctuation)?),
            '$' => return chars.next().is_none().then_some(name),
            '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' => return None,
            c => name.push(c),
        }
    }
    None
}

/// Where an existing queue's arguments (as the management API lists them) differ from the ones
/// this plan declares: the conflicts a declare would meet, found without declaring.
pub fn argument_differences(
    desired: &BTreeMap<&'static str, ArgValue>,
    actual: &Map<String, Value>,
) -> Vec<Inequivalence> {
    let shown = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut keys: Vec<&str> = desired.keys().copied().chain(actual.keys().map(String::as_str)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter_map(|key| {
            let want = desired.get(key).map(to_json);
            let have = actual.get(key).cloned();
            // A classic queue declared without x-queue-type is the same as one declared with it.
            let classic = Some(json!("classic"));
            if want == have || (key == "x-queue-type" && have.is_none() && want == classic) {
                return None;
            }
            Some(Inequivalence {
                argument: key.to_owned(),
                received: want.as_ref().map(shown),
                current: have.as_ref().map(shown),
            })
        })
        .collect()
}

fn to_json(v: &ArgValue) -> Value {
    match v {
        ArgValue::Long(n) => json!(n),
        ArgValue::Str(s) => json!(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{plan::Limits, testing::policy_yaml};

    #[test]
    fn exact_name_reads_only_anchored_literals() {
        for name in ["orders", "orders.v1+eu", "a$b", "x^y", "tab\tin", "(a|b)", "", "\\", "ünï"] {
            let pattern = format!("^{}$", regex::escape(name));
            assert_eq!(exact_name(&pattern).as_deref(), Some(name), "{pattern}");
        }
        for pattern in ["orders", "^orders", "orders$", "^ord.rs$", "^\\d+$", "^a|b$", "^a$b", "^a\\$", "^(a)$", "^a*$"]
        {
            assert_eq!(exact_name(pattern), None, "{pattern}");
        }
    }

    #[test]
    fn exact_name_agrees_with_the_regex() {
        let names = ["orders", "orders.v1+eu", "ordersX", "xorders", "orders\n", "a$b", "a", ""];
        for pattern in ["^orders$", "^orders\\.v1\\+eu$", "^a\\$b$", "^$", "^a$"] {
            let re = Regex::new(pattern).unwrap();
            for name in names {
                let fast = exact_name(pattern).map(|n| n == name);
                assert_eq!(fast, Some(re.is_match(name)), "{pattern} on {name:?}");
            }
        }
    }

    fn plan_of(queue_yaml: &str) -> QueuePlan {
        crate::plan::plan(&policy_yaml(queue_yaml), Limits::default()).unwrap()
    }

    fn policy(name: &str, pattern: &str, priority: i64, definition: Value) -> PolicyInfo {
        PolicyInfo {
            name: name.into(),
            pattern: pattern.into(),
            apply_to: "all".into(),
            priority,
            definition: definition.as_object().unwrap().clone(),
        }
    }

    #[test]
    fn policy_mode_declares_only_the_type() {
        let args = queue_arguments(&plan_of("{}"));
        assert_eq!(args, BTreeMap::from([("x-queue-type", ArgValue::Str("classic".into()))]));
    }

    #[test]
    fn arguments_mode_declares_every_setting() {
        let args = queue_arguments(&plan_of(
            "{type: quorum, settings: Arguments, expires: 10m, messageTtl: 1m, maxLength: 7, overflow: reject-publish}",
        ));
        let expected: BTreeMap<&str, ArgValue> = [
            ("x-queue-type", ArgValue::Str("quorum".into())),
            ("x-expires", ArgValue::Long(600_000)),
            ("x-dead-letter-exchange", ArgValue::Str("orders.dlx".into())),
            ("x-dead-letter-routing-key", ArgValue::Str("orders".into())),
            ("x-message-ttl", ArgValue::Long(60_000)),
            ("x-max-length", ArgValue::Long(7)),
            ("x-overflow", ArgValue::Str("reject-publish".into())),
        ]
        .into();
        assert_eq!(args, expected);
    }

    #[test]
    fn dead_letter_queue_never_expires() {
        let args = dead_letter_queue_arguments(&plan_of("{settings: Arguments, type: quorum}"));
        assert_eq!(args, BTreeMap::from([("x-queue-type", ArgValue::Str("quorum".into()))]));
    }

    #[test]
    fn operator_policy_matches_exactly_the_queue() {
        let d = policy_decision(&plan_of("{name: orders.v1+eu}"), &[]);
        assert_eq!(d.desired.pattern, r"^orders\.v1\+eu$");
        assert_eq!(d.desired.apply_to, "queues");
        assert_eq!(d.desired.priority, POLICY_PRIORITY);
        assert_eq!(
            Value::Object(d.desired.definition.clone()),
            json!({"expires": 1_800_000, "dead-letter-exchange": "orders.v1+eu.dlx", "dead-letter-routing-key": "orders.v1+eu"})
        );
        assert!(!d.up_to_date && d.shadowed_by.is_none() && d.displaced.is_none());
    }

    #[test]
    fn an_identical_existing_policy_is_up_to_date() {
        let plan = plan_of("{}");
        let first = policy_decision(&plan, &[]);
        let again = policy_decision(&plan, std::slice::from_ref(&first.desired));
        assert!(again.up_to_date);
        let changed = policy_decision(&plan_of("{expires: 1h}"), &[first.desired]);
        assert!(!changed.up_to_date, "a changed setting updates the policy in place");
    }

    #[test]
    fn equal_or_higher_priority_shadows() {
        let plan = plan_of("{}");
        for priority in [POLICY_PRIORITY, POLICY_PRIORITY + 1] {
            let d = policy_decision(&plan, &[policy("team", "^ord", priority, json!({"max-length": 5}))]);
            assert_eq!(d.shadowed_by.map(|p| p.name), Some("team".into()), "priority {priority}");
        }
        let other_queue = policy_decision(&plan, &[policy("team", "^billing$", 500, json!({}))]);
        assert!(other_queue.shadowed_by.is_none());
        let exchanges_only = PolicyInfo { apply_to: "exchanges".into(), ..policy("x", ".*", 500, json!({})) };
        assert!(policy_decision(&plan, &[exchanges_only]).shadowed_by.is_none());
        let quorum_only = PolicyInfo { apply_to: "quorum_queues".into(), ..policy("q", ".*", 500, json!({})) };
        assert!(policy_decision(&plan, &[quorum_only]).shadowed_by.is_none());
    }

    #[test]
    fn displaced_lower_priority_keys_are_carried_forward_but_never_override_ours() {
        let plan = plan_of("{}");
        let d = policy_decision(
            &plan,
            &[
                policy("ha-all", ".*", 0, json!({"ha-mode": "all", "expires": 5})),
                policy("lazy", "^orders$", 1, json!({"queue-mode": "lazy", "dead-letter-exchange": "elsewhere"})),
            ],
        );
        assert_eq!(
            d.displaced.as_deref(),
            Some("lazy"),
            "the highest lower-priority policy is the one that would apply"
        );
        assert_eq!(d.desired.definition.get("queue-mode"), Some(&json!("lazy")));
        assert_eq!(d.desired.definition.get("dead-letter-exchange"), Some(&json!("orders.dlx")));
        assert!(!d.desired.definition.contains_key("ha-mode"));
    }

    #[test]
    fn a_delivery_limit_goes_where_the_settings_go_and_a_displaced_one_is_kept_unless_set() {
        let args = queue_arguments(&plan_of("{type: quorum, settings: Arguments, deliveryLimit: 5}"));
        assert_eq!(args.get("x-delivery-limit"), Some(&ArgValue::Long(5)));
        let theirs = [policy("retries", "^orders$", 1, json!({"delivery-limit": 50}))];
        let unset = policy_decision(&plan_of("{type: quorum}"), &theirs);
        assert_eq!(unset.desired.definition.get("delivery-limit"), Some(&json!(50)), "carried forward");
        let set = policy_decision(&plan_of("{type: quorum, deliveryLimit: 3}"), &theirs);
        assert_eq!(set.desired.definition.get("delivery-limit"), Some(&json!(3)), "the QueuePolicy's own");
    }

    #[test]
    fn argument_differences_read_like_the_brokers_own() {
        let plan = plan_of("{settings: Arguments, expires: 10m}");
        let desired = queue_arguments(&plan);
        let same = json!({"x-queue-type": "classic", "x-expires": 600000, "x-dead-letter-exchange": "orders.dlx", "x-dead-letter-routing-key": "orders"});
        assert!(argument_differences(&desired, same.as_object().unwrap()).is_empty());
        let plain = json!({});
        let diffs = argument_differences(&queue_arguments(&plan_of("{}")), plain.as_object().unwrap());
        assert!(diffs.is_empty(), "a plainly declared classic queue matches Policy mode: {diffs:?}");
        let other = json!({"x-expires": 300000, "x-max-length": 5});
        let diffs = argument_differences(&desired, other.as_object().unwrap());
        let names: Vec<&str> = diffs.iter().map(|d| d.argument.as_str()).collect();
        assert_eq!(names, ["x-dead-letter-exchange", "x-dead-letter-routing-key", "x-expires", "x-max-length"]);
        assert_eq!(diffs[2].current.as_deref(), Some("300000"));
        assert_eq!(diffs[3].received, None);
    }

    #[test]
    fn unreadable_patterns_are_listed_not_guessed() {
        let d = policy_decision(&plan_of("{}"), &[policy("odd", "^(?<=x)o", 500, json!({}))]);
        assert_eq!(d.unreadable, ["odd"]);
        assert!(d.shadowed_by.is_none());
    }
}
