//! From a QueuePolicy to a [`QueuePlan`]: every default resolved, every rule checked, with no I/O.
//!
//! The CRD's schema and CEL rules reject most bad input at the API server; this repeats them (and
//! the rules a schema cannot express, like byte lengths) so local mode and older clusters get the
//! same answers, and so the reconciler never sends the broker something it will refuse.

use crate::{
    broker::management::addressable,
    broker_source::BrokerSource,
    crd::{
        Binding, ConsumersSpec, DeletionPolicy, FailurePolicy, GateMode, MatchBy, OnChange, Overflow, QueuePolicy,
        QueueType, SettingsMode,
    },
    duration::{self, DurationText},
};
use std::{fmt, time::Duration};

/// The broker's largest accepted x-expires and x-message-ttl, in milliseconds (2^32 - 1).
pub const MAX_EXPIRY_MS: u64 = u32::MAX as u64;
/// AMQP short strings, which carry queue and exchange names, hold at most 255 bytes.
const MAX_NAME_BYTES: usize = 255;

/// Bounds that the CRD fixes for users and tests may relax (a 2 s expiry to watch a queue expire).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub min_expires: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self { min_expires: Duration::from_secs(60) }
    }
}

/// The settings that reach the queue as arguments or through a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSettings {
    pub expires: Duration,
    pub message_ttl: Option<Duration>,
    pub max_length: Option<i64>,
    pub overflow: Option<Overflow>,
    /// Quorum queues: x-delivery-limit (None: the broker's default, 20 on RabbitMQ 4.0+).
    pub delivery_limit: Option<i64>,
    pub dead_letter_exchange: String,
    pub dead_letter_routing_key: String,
}

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

/// Everything the reconciler needs, resolved and valid.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePlan {
    /// `namespace/name` of the QueuePolicy, for messages.
    pub owner: String,
    pub queue: String,
    /// spec.broker.vhost; None means the vhost of the Secret's URI.
    pub vhost: Option<String>,
    pub queue_type: QueueType,
    /// What a change of the queue's fixed shape does: refused, or carried out as a migration.
    pub on_change: OnChange,
    pub mode: SettingsMode,
    pub settings: QueueSettings,
    pub dead_letter_queue: String,
    pub keep_alive: bool,
    pub bindings: Vec<Binding>,
    /// Name of the operator-owned broker policy (Policy mode).
    pub policy_name: String,
    pub deletion: DeletionPolicy,
    /// Only report and guard: the queue is declared by its owner (spec.adopt).
    pub adopt: bool,
    /// Where the broker's credentials come from.
    pub broker: BrokerSource,
    /// The rollout gate, when spec.consumers names the consumers.
    pub gate: Option<GatePlan>,
    /// Which hygiene findings are judged and how.
    pub findings: crate::findings::Settings,
}

/// One rule a spec breaks, with the field it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// All the rules a spec breaks, joined for a condition message.
pub fn describe(errors: &[FieldError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// The longest `spec.gate.attachTimeout`.
pub const MAX_ATTACH_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// Resolves and checks a QueuePolicy. Returns every problem at once, not just the first.
pub fn plan(policy: &QueuePolicy, limits: Limits) -> Result<QueuePlan, Vec<FieldError>> {
    let mut errors = Errors::default();
    let spec = &policy.spec;
    let namespace = policy.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let name = policy.metadata.name.clone().unwrap_or_default();
    if name.is_empty() {
        errors.add("metadata.name", "must be set");
    }
    let q = &spec.queue;

    let queue = q.name.clone().unwrap_or_else(|| name.clone());
    check_name(&mut errors, "spec.queue.name", &queue, "queue");

    let expires = errors.duration("spec.queue.expires", &q.expires);
    if expires.is_some_and(|e| e < limits.min_expires) {
        errors.add("spec.queue.expires", format!("must be at least {}", duration::Human(limits.min_expires)));
    }
    if expires.is_some_and(|e| e.as_millis() > u128::from(MAX_EXPIRY_MS)) {
        errors.add("spec.queue.expires", "must be at most 1193h (the broker's limit of 2^32-1 ms)");
    }
    let message_ttl = q.message_ttl.as_ref().and_then(|t| errors.duration("spec.queue.messageTtl", t));
    if message_ttl.is_some_and(|t| t.as_millis() > u128::from(MAX_EXPIRY_MS)) {
        errors.add("spec.queue.messageTtl", "must be at most 1193h (the broker's limit of 2^32-1 ms)");
    }
    if q.max_length.is_some_and(|n| n < 0) {
        errors.add("spec.queue.maxLength", "must not be negative");
    }
    if let Some(limit) = q.delivery_limit {
        if q.queue_type != QueueType::Quorum {
            errors.add(
                "spec.queue.deliveryLimit",
                "applies to quorum queues only (classic queues have no delivery limit)",
            );
        } else if limit == 0 || limit < -1 {
            errors.add("spec.queue.deliveryLimit", "must be at least 1, or -1 for no limit");
        }
    }
    if q.overflow.is_some() && q.max_length.is_none() {
        errors.add("spec.queue.overflow", "only applies together with maxLength");
    }
    if q.queue_type == QueueType::Quorum && q.overflow == Some(Overflow::RejectPublishDlx) {
        errors.add(
            "spec.queue.overflow",
            "quorum queues do not support reject-publish-dlx; use reject-publish or drop-head",
        );
    }

    let dl = &q.dead_letter;
    let dead_letter_exchange = dl.exchange.clone().unwrap_or_else(|| format!("{queue}.dlx"));
    let dead_letter_queue = dl.queue.clone().unwrap_or_else(|| format!("{queue}.dlq"));
    let dead_letter_routing_key = dl.routing_key.clone().unwrap_or_else(|| queue.clone());
    check_name(&mut errors, "spec.queue.deadLetter.exchange", &dead_letter_exchange, "exchange");
    check_name(&mut errors, "spec.queue.deadLetter.queue", &dead_letter_queue, "queue");
    if dead_letter_routing_key.len() > MAX_NAME_BYTES {
        errors.add("spec.queue.deadLetter.routingKey", "must be at most 255 bytes");
    }
    if dead_letter_queue == queue {
        errors.add("spec.queue.deadLetter.queue", "must differ from the queue itself");
    }

    let mut bindings = q.bindings.clone();
    bindings.sort();
    bindings.dedup();
    for (i, b) in bindings.iter().enumerate() {
        if b.exchange.is_empty() {
            errors.add(
                format!("spec.queue.bindings[{i}].exchange"),
                "must be set (the default exchange cannot be bound)",
            );
        } else if b.exchange.len() > MAX_NAME_BYTES || b.routing_key.len() > MAX_NAME_BYTES {
            errors.add(format!("spec.queue.bindings[{i}]"), "names must be at most 255 bytes");
        }
    }

    if let Some(consumers) = &spec.consumers {
        check_consumers(&mut errors, consumers);
    }
    let attach_timeout = errors.duration("spec.gate.attachTimeout", &spec.gate.attach_timeout).unwrap_or_default();
    // Counted in i64 milliseconds beside timestamps: a bound keeps the sums far from overflow.
    if attach_timeout > MAX_ATTACH_TIMEOUT {
        errors.add("spec.gate.attachTimeout", "must be at most 168h (a week)");
    }
    let stall_after = errors.duration("spec.findings.stallAfter", &spec.findings.stall_after).unwrap_or_default();

    let broker = broker_source(&mut errors, &spec.broker);
    if spec.adopt && spec.deletion_policy == DeletionPolicy::Delete {
        errors.add("spec.deletionPolicy", "must be Retain with adopt: true (the queue is its owner's to delete)");
    }
    if spec.adopt && q.on_change == OnChange::Migrate {
        errors.add("spec.queue.onChange", "must be Refuse with adopt: true (a migration declares the queue anew)");
    }
    if spec.broker.vhost.as_deref() == Some("") {
        errors.add("spec.broker.vhost", "must not be empty (omit it to use the URI's vhost)");
    } else if spec.broker.vhost.as_deref().is_some_and(|v| !addressable(v)) {
        errors.add("spec.broker.vhost", "must not be '.' or '..': management API paths read them as dot segments");
    }

    errors.finish()?;
    Ok(QueuePlan {
        owner: format!("{namespace}/{name}"),
        policy_name: format!("queueguard.{namespace}.{name}"),
        queue,
        vhost: spec.broker.vhost.clone(),
        queue_type: q.queue_type,
        on_change: q.on_change,
        mode: q.settings,
        settings: QueueSettings {
            expires: expires.unwrap_or_default(),
            message_ttl,
            max_length: q.max_length,
            delivery_limit: q.delivery_limit,
            overflow: q.overflow,
            dead_letter_exchange,
            dead_letter_routing_key,
        },
        dead_letter_queue,
        keep_alive: q.keep_alive,
        findings: crate::findings::Settings {
            ignore: spec.findings.ignore.clone(),
            stall_after,
            expires: expires.unwrap_or_default(),
            keep_alive: q.keep_alive,
        },
        bindings,
        deletion: spec.deletion_policy,
        adopt: spec.adopt,
        broker: broker.unwrap_or(BrokerSource::Secret { name: String::new() }),
        gate: spec.consumers.clone().map(|consumers| GatePlan {
            mode: spec.gate.mode,
            failure_policy: spec.gate.failure_policy,
            attach_timeout,
            manage_strategy: spec.gate.manage_strategy,
            pod_disruption_budget: spec.gate.pod_disruption_budget,
            min_attached: consumers.min_attached,
            min_attached_for: Duration::from_secs(consumers.min_attached_seconds.max(0) as u64),
            match_by: consumers.match_by,
            consumers,
        }),
    })
}

/// The spec's one broker source, or what is wrong with it. Shared with QueuePatterns.
pub(crate) fn broker_source(errors: &mut Errors, spec: &crate::crd::BrokerSpec) -> Option<BrokerSource> {
    let source = BrokerSource::of(spec);
    match &source {
        None => errors.add("spec.broker", "needs exactly one of secretRef and rabbitmqClusterReference"),
        Some(BrokerSource::Secret { name }) if name.is_empty() => {
            errors.add("spec.broker.secretRef.name", "must be set")
        }
        Some(BrokerSource::RabbitmqCluster { name, .. }) if name.is_empty() => {
            errors.add("spec.broker.rabbitmqClusterReference.name", "must be set")
        }
        Some(BrokerSource::RabbitmqCluster { namespace: Some(ns), .. }) if ns.is_empty() => errors
            .add("spec.broker.rabbitmqClusterReference.namespace", "must not be empty (omit it for the policy's own)"),
        Some(_) => {}
    }
    source
}

fn check_name(errors: &mut Errors, field: &str, value: &str, what: &str) {
    if value.is_empty() {
        errors.add(field, "must not be empty");
    } else if value.len() > MAX_NAME_BYTES {
        errors.add(field, format!("{what} name {value:?} is {} bytes; the broker allows 255", value.len()));
    } else if value.starts_with("amq.") {
        errors.add(field, format!("{what} name {value:?} starts with 'amq.', which the broker reserves"));
    } else if !addressable(value) {
        errors
            .add(field, format!("{what} name {value:?} cannot be used: management API paths read it as a dot segment"));
    }
}

fn check_consumers(errors: &mut Errors, c: &ConsumersSpec) {
    if [c.deployment.is_some(), c.workload.is_some(), c.selector.is_some()].iter().filter(|set| **set).count() != 1 {
        errors.add("spec.consumers", "set exactly one of deployment, workload and selector");
    }
    if c.kinds.is_some() && c.selector.is_none() {
        errors.add("spec.consumers.kinds", "goes with consumers.selector");
    }
    if let Some(selector) = &c.selector {
        use kube::core::Selector;
        match Selector::try_from(selector.clone()) {
            Err(e) => errors.add("spec.consumers.selector", format!("not a valid label selector: {e}")),
            // An empty selector selects everything; guarding every workload of the namespace is
            // never what was meant, and guarding none would pass silently.
            Ok(s) if s.selects_all() => errors.add(
                "spec.consumers.selector",
                "is empty: it would select every workload of the namespace; give the consumer workload's labels",
            ),
            Ok(_) => {}
        }
    }
    if c.min_attached < 1 {
        errors.add("spec.consumers.minAttached", "must be at least 1");
    }
    if !(0..=3600).contains(&c.min_attached_seconds) {
        errors.add("spec.consumers.minAttachedSeconds", "must be between 0 and 3600");
    }
}

#[derive(Default)]
pub(crate) struct Errors(Vec<FieldError>);

impl Errors {
    pub(crate) fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError { field: field.into(), message: message.into() });
    }

    pub(crate) fn duration(&mut self, field: &str, value: &DurationText) -> Option<Duration> {
        duration::parse(value.as_str()).map_err(|e| self.add(field, e.to_string())).ok()
    }

    pub(crate) fn finish(self) -> Result<(), Vec<FieldError>> {
        if self.0.is_empty() { Ok(()) } else { Err(self.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::policy_yaml;

    fn errors_of(yaml: &str) -> Vec<String> {
        plan(&policy_yaml(yaml), Limits::default()).unwrap_err().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn defaults_resolve_from_the_policy_name() {
        let p = plan(&policy_yaml("{}"), Limits::default()).unwrap();
        assert_eq!(p.queue, "orders");
        assert_eq!(p.owner, "shop/orders");
        assert_eq!(p.policy_name, "queueguard.shop.orders");
        assert_eq!(p.settings.expires, Duration::from_secs(1800));
        assert_eq!(p.settings.dead_letter_exchange, "orders.dlx");
        assert_eq!(p.settings.dead_letter_routing_key, "orders");
        assert_eq!(p.dead_letter_queue, "orders.dlq");
        assert_eq!((p.queue_type, p.mode, p.keep_alive), (QueueType::Classic, SettingsMode::Policy, true));
        assert_eq!(p.deletion, DeletionPolicy::Retain);
        assert_eq!(p.vhost, None);
    }

    #[test]
    fn explicit_settings_are_kept() {
        let p = plan(
            &policy_yaml(
                "{name: billing, type: quorum, settings: Arguments, expires: 2h, messageTtl: 90s, maxLength: 1000, overflow: reject-publish,
                  deadLetter: {exchange: dlx, routingKey: dead, queue: parking},
                  bindings: [{exchange: b, routingKey: k}, {exchange: a}, {exchange: b, routingKey: k}]}",
            ),
            Limits::default(),
        )
        .unwrap();
        assert_eq!(p.queue, "billing");
        assert_eq!(p.settings.expires, Duration::from_secs(7200));
        assert_eq!(p.settings.message_ttl, Some(Duration::from_secs(90)));
        assert_eq!((p.settings.max_length, p.settings.overflow), (Some(1000), Some(Overflow::RejectPublish)));
        assert_eq!(p.dead_letter_queue, "parking");
        assert_eq!(p.bindings.len(), 2, "duplicates removed: {:?}", p.bindings);
        assert_eq!(p.bindings[0].exchange, "a");
    }

    #[test]
    fn an_adopted_queue_is_neither_deleted_nor_migrated_and_the_broker_has_one_source() {
        let mut p = policy_yaml("{type: quorum, onChange: Migrate}");
        p.spec.adopt = true;
        p.spec.deletion_policy = DeletionPolicy::Delete;
        let errs: Vec<String> = plan(&p, Limits::default()).unwrap_err().iter().map(ToString::to_string).collect();
        assert_eq!(
            errs,
            [
                "spec.deletionPolicy: must be Retain with adopt: true (the queue is its owner's to delete)",
                "spec.queue.onChange: must be Refuse with adopt: true (a migration declares the queue anew)"
            ]
        );
        let mut both = policy_yaml("{}");
        both.spec.broker.rabbitmq_cluster_reference =
            Some(crate::crd::RabbitmqClusterReference { name: "rabbit".into(), namespace: None });
        let errs: Vec<String> = plan(&both, Limits::default()).unwrap_err().iter().map(ToString::to_string).collect();
        assert_eq!(errs, ["spec.broker: needs exactly one of secretRef and rabbitmqClusterReference"]);
    }

    #[test]
    fn bad_durations_name_the_field() {
        let errs = errors_of("{expires: 30 minutes, messageTtl: 1d}");
        assert!(errs[0].starts_with("spec.queue.expires: invalid duration \"30 minutes\""), "{errs:?}");
        assert!(errs.iter().any(|e| e.starts_with("spec.queue.messageTtl: invalid duration \"1d\"")), "{errs:?}");
    }

    #[test]
    fn expiry_bounds() {
        assert_eq!(errors_of("{expires: 59s}"), ["spec.queue.expires: must be at least 1m"]);
        assert!(errors_of("{expires: 1194h}")[0].contains("at most 1193h"));
        let short = Limits { min_expires: Duration::from_secs(1) };
        assert!(plan(&policy_yaml("{expires: 2s}"), short).is_ok());
    }

    #[test]
    fn names_are_checked_in_bytes_and_for_reserved_prefixes() {
        let long = "é".repeat(128);
        let errs = errors_of(&format!("{{name: {long}}}"));
        assert!(errs[0].contains("256 bytes; the broker allows 255"), "{errs:?}");
        assert!(errors_of("{name: amq.orders}")[0].contains("which the broker reserves"));
        assert_eq!(errors_of("{name: ''}")[0], "spec.queue.name: must not be empty");
        let errs = errors_of(&format!("{{name: {}}}", "q".repeat(253)));
        assert!(errs.iter().any(|e| e.starts_with("spec.queue.deadLetter.exchange")), "{errs:?}");
        assert!(errs.iter().any(|e| e.starts_with("spec.queue.deadLetter.queue")), "{errs:?}");
        assert!(errors_of("{deadLetter: {queue: orders}}")[0].contains("must differ"));
        assert!(errors_of("{name: '..'}")[0].contains("dot segment"));
        assert!(errors_of("{deadLetter: {queue: '.'}}")[0].starts_with("spec.queue.deadLetter.queue"));
        let mut dotted = policy_yaml("{}");
        dotted.spec.broker.vhost = Some(".".into());
        let errs = plan(&dotted, Limits::default()).unwrap_err();
        assert!(errs[0].field == "spec.broker.vhost" && errs[0].message.contains("dot segments"), "{errs:?}");
    }

    #[test]
    fn a_selector_that_selects_nothing_or_everything_is_invalid() {
        let with_selector = |selector: &str| {
            let mut p = policy_yaml("{}");
            p.spec.consumers = Some(serde_yaml_ng::from_str(&format!("{{selector: {selector}}}")).unwrap());
            plan(&p, Limits::default()).err().unwrap_or_default()
        };
        let empty = with_selector("{}");
        assert!(
            empty[0].field == "spec.consumers.selector" && empty[0].message.contains("every workload"),
            "{empty:?}"
        );
        let bad = with_selector("{matchExpressions: [{key: app, operator: Sideways, values: [w]}]}");
        assert!(bad[0].message.starts_with("not a valid label selector"), "{bad:?}");
        assert!(with_selector("{matchLabels: {app: worker}}").is_empty());
    }

    #[test]
    fn attach_timeout_is_bounded() {
        let mut p = policy_yaml("{}");
        p.spec.consumers = Some(serde_yaml_ng::from_str("{deployment: worker}").unwrap());
        for too_long in ["169h", "99999999999999h"] {
            p.spec.gate.attach_timeout = too_long.into();
            let errs = plan(&p, Limits::default()).unwrap_err();
            assert!(errs.iter().any(|e| e.field == "spec.gate.attachTimeout"), "{too_long}: {errs:?}");
        }
        p.spec.gate.attach_timeout = "169h".into();
        assert!(plan(&p, Limits::default()).unwrap_err()[0].message.contains("at most 168h"));
        p.spec.gate.attach_timeout = "168h".into();
        assert!(plan(&p, Limits::default()).is_ok());
    }

    #[test]
    fn delivery_limit_is_for_quorum_queues() {
        let p = plan(&policy_yaml("{type: quorum, deliveryLimit: 5}"), Limits::default()).unwrap();
        assert_eq!(p.settings.delivery_limit, Some(5));
        assert!(errors_of("{deliveryLimit: 5}")[0].contains("quorum queues only"));
        assert!(errors_of("{type: quorum, deliveryLimit: 0}")[0].contains("at least 1, or -1"));
        assert!(plan(&policy_yaml("{type: quorum, deliveryLimit: -1}"), Limits::default()).is_ok());
    }

    #[test]
    fn cross_field_rules() {
        assert_eq!(errors_of("{overflow: drop-head}"), ["spec.queue.overflow: only applies together with maxLength"]);
        assert!(errors_of("{type: quorum, maxLength: 5, overflow: reject-publish-dlx}")[0].contains("quorum"));
        assert!(
            plan(&policy_yaml("{type: classic, maxLength: 5, overflow: reject-publish-dlx}"), Limits::default())
                .is_ok()
        );
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let errs = errors_of("{name: amq.x, expires: soon, maxLength: -1}");
        let fields: Vec<&str> = errs.iter().map(|e| e.split(':').next().unwrap()).collect();
        assert_eq!(
            fields,
            [
                "spec.queue.name",
                "spec.queue.expires",
                "spec.queue.maxLength",
                "spec.queue.deadLetter.exchange",
                "spec.queue.deadLetter.queue"
            ]
        );
    }
}
