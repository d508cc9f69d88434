//! The rules of `queueguard check`: pure functions from the objects read to findings. Each judges
//! the way the operator would at run time, through the crate's own code: [`plan::plan`] for a
//! policy, [`pattern::plan`] for a pattern, [`Workload::judge`] for a strategy,
//! [`guards::guards`] for which workloads a policy guards.

use super::{Finding, Manifests, ObjectId, PatternDoc, PatternState, PolicyDoc, PolicyState, Severity, WorkloadDoc};
use crate::{
    broker_source::BrokerSource,
    crd::{API_VERSION, GateMode, OnChange, QueuePolicy, QueueType},
    duration::Human,
    gate::guards,
    names::GATE_CONDITION,
    pattern::{self, PatternPlan},
    plan::{self, FieldError, GatePlan, Limits, QueuePlan},
    settings::POLICY_PRIORITY,
    workload::{Judgement, Object, Workload, strategy},
};
use k8s_openapi::api::core::v1::PodSpec;
use kube::core::SelectorExt;
use std::{collections::BTreeMap, time::Duration};

/// The name of the operator's own mutating webhook, which adds the readiness gate to the pods of
/// Deployments guarded in Enforce mode.
pub const OPERATOR_WEBHOOK: &str = "pods.queueguard.io";

/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_TERMINATION_GRACE_SECONDS: i64 = 30;
/// Kubernetes' probe defaults.
const DEFAULT_PROBE_PERIOD_SECONDS: i64 = 10;
const DEFAULT_PROBE_FAILURE_THRESHOLD: i64 = 3;

/// Every rule, with a stable id and a kebab-case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, strum::IntoStaticStr)]
#[strum(serialize_all = "kebab-case")]
pub enum Rule {
    InvalidPolicy,
    UnsafeRolloutStrategy,
    MissingReadinessGate,
    GateNeverOpens,
    ExpiresShorterThanRollout,
    ExpiringDeadLetterQueue,
    DeadLetterLoop,
    MinAttachedExceedsReplicas,
    ScaledToZeroQueueExpires,
    DisruptionBudgetBlocksDrains,
    DuplicateQueue,
    UnanchoredPattern,
    ClassicQueueOnCluster,
    RefusedByNewerRabbitmq,
    ManagedElsewhere,
    PlainDeclareRefusedAfterMigration,
}

impl Rule {
    pub const ALL: [Rule; 16] = [
        Rule::InvalidPolicy,
        Rule::UnsafeRolloutStrategy,
        Rule::MissingReadinessGate,
        Rule::GateNeverOpens,
        Rule::ExpiresShorterThanRollout,
        Rule::ExpiringDeadLetterQueue,
        Rule::DeadLetterLoop,
        Rule::MinAttachedExceedsReplicas,
        Rule::ScaledToZeroQueueExpires,
        Rule::DisruptionBudgetBlocksDrains,
        Rule::DuplicateQueue,
        Rule::UnanchoredPattern,
        Rule::ClassicQueueOnCluster,
        Rule::RefusedByNewerRabbitmq,
        Rule::ManagedElsewhere,
        Rule::PlainDeclareRefusedAfterMigration,
    ];

    pub fn id(self) -> &'static str {
        match self {
            Self::InvalidPolicy => "QG001",
            Self::UnsafeRolloutStrategy => "QG002",
            Self::MissingReadinessGate => "QG003",
            Self::GateNeverOpens => "QG004",
            Self::ExpiresShorterThanRollout => "QG005",
            Self::ExpiringDeadLetterQueue => "QG006",
            Self::DeadLetterLoop => "QG007",
            Self::MinAttachedExceedsReplicas => "QG008",
            Self::ScaledToZeroQueueExpires => "QG009",
            Self::DisruptionBudgetBlocksDrains => "QG010",
            Self::DuplicateQueue => "QG011",
            Self::UnanchoredPattern => "QG012",
            Self::ClassicQueueOnCluster => "QG013",
            Self::RefusedByNewerRabbitmq => "QG014",
            Self::ManagedElsewhere => "QG015",
            Self::PlainDeclareRefusedAfterMigration => "QG016",
        }
    }

    pub fn name(self) -> &'static str {
        self.into()
    }

    /// One line on what the rule finds.
    pub fn summary(self) -> &'static str {
        match self {
            Self::InvalidPolicy => {
                "a QueuePolicy or QueuePattern the operator refuses (its field errors), with fields its schema does not know, or of an unserved apiVersion"
            }
            Self::UnsafeRolloutStrategy => {
                "a guarded Deployment whose strategy (Recreate, or maxUnavailable as Kubernetes resolves it) can take its consumers below minAttached"
            }
            Self::MissingReadinessGate => {
                "a Deployment guarded in gate mode Enforce whose pod template lacks the readiness gate, with no queueguard webhook called for its namespace to add it"
            }
            Self::GateNeverOpens => {
                "a pod template carrying the readiness gate while the only policies guarding it are in gate mode Observe: the gate guards nothing, and pods wait on the operator"
            }
            Self::ExpiresShorterThanRollout => {
                "a queue's expires is shorter than an estimate of how long a rollout of its consumer Deployment can take"
            }
            Self::ExpiringDeadLetterQueue => {
                "a dead-letter queue that another QueuePolicy declares as its own queue, or a QueuePattern's pattern matches, and so gives an expiry"
            }
            Self::DeadLetterLoop => {
                "a dead-letter exchange the queue is also bound from: dead letters route back into it"
            }
            Self::MinAttachedExceedsReplicas => {
                "minAttached above the guarded Deployment's replicas: the gate and the PodDisruptionBudget can never be satisfied"
            }
            Self::ScaledToZeroQueueExpires => {
                "keepAlive false and every consumer Deployment scaled to 0: the idle queue expires with its messages"
            }
            Self::DisruptionBudgetBlocksDrains => {
                "minAttached equal to the guarded Deployment's replicas: its PodDisruptionBudget is lowered to replicas - 1 so drains can evict, and a drain takes the consumers below minAttached"
            }
            Self::DuplicateQueue => "two QueuePolicies declare the same queue on the same broker",
            Self::UnanchoredPattern => {
                "a QueuePattern whose pattern does not start with ^: it matches anywhere in a queue name and may catch unrelated queues"
            }
            Self::ClassicQueueOnCluster => {
                "a classic queue on a broker whose Secret names several nodes: the queue lives on one node and is gone while that node is down"
            }
            Self::RefusedByNewerRabbitmq => {
                "a Messaging Topology Operator Queue that RabbitMQ 4.3 refuses to declare: transient (durable false) and not exclusive, or with x-queue-mode, or x-queue-version 1"
            }
            Self::ManagedElsewhere => {
                "a QueuePolicy, without adopt: true, for a queue a Messaging Topology Operator Queue declares on the same RabbitmqCluster and vhost: the operator will touch nothing"
            }
            Self::PlainDeclareRefusedAfterMigration => {
                "a QueuePolicy with onChange: Migrate to a quorum queue: workers that declare the queue without x-queue-type are refused once it is quorum (RabbitMQ 3.x always, 4.x unless the vhost's default queue type is quorum)"
            }
        }
    }

    fn judge(self, f: &Facts) -> Vec<Finding> {
        match self {
            Self::InvalidPolicy => invalid_policy(f),
            Self::UnsafeRolloutStrategy => unsafe_rollout_strategy(f),
            Self::MissingReadinessGate => missing_readiness_gate(f),
            Self::GateNeverOpens => gate_never_opens(f),
            Self::ExpiresShorterThanRollout => expires_shorter_than_rollout(f),
            Self::ExpiringDeadLetterQueue => expiring_dead_letter_queue(f),
            Self::DeadLetterLoop => dead_letter_loop(f),
            Self::MinAttachedExceedsReplicas => min_attached_exceeds_replicas(f),
            Self::ScaledToZeroQueueExpires => scaled_to_zero_queue_expires(f),
            Self::DisruptionBudgetBlocksDrains => disruption_budget_blocks_drains(f),
            Self::DuplicateQueue => duplicate_queue(f),
            Self::UnanchoredPattern => unanchored_pattern(f),
            Self::ClassicQueueOnCluster => classic_queue_on_cluster(f),
            Self::RefusedByNewerRabbitmq => refused_by_rabbitmq_4_3(f),
            Self::ManagedElsewhere => managed_elsewhere(f),
            Self::PlainDeclareRefusedAfterMigration => plain_declare_refused_after_migration(f),
        }
    }
}

/// Runs every rule; findings in input order of their objects, then by rule.
pub fn check(manifests: &Manifests) -> Vec<Finding> {
    let facts = Facts::new(manifests);
    let mut findings: Vec<Finding> = Rule::ALL.iter().flat_map(|r| r.judge(&facts)).collect();
    findings.sort_by_key(|f| (f.object.position, f.rule));
    findings
}

/// A QueuePolicy that passed validation, and its plan.
pub struct Planned<'a> {
    pub doc: &'a PolicyDoc,
    pub policy: &'a QueuePolicy,
    pub plan: QueuePlan,
}

impl Planned<'_> {
    fn name(&self) -> &str {
        &self.doc.id.name
    }

    fn gate(&self) -> Option<&GatePlan> {
        self.plan.gate.as_ref()
    }

    fn enforces(&self) -> bool {
        self.gate().is_some_and(|g| g.mode == GateMode::Enforce)
    }
}

/// A QueuePattern that passed validation, and its plan.
pub struct PlannedPattern<'a> {
    pub doc: &'a PatternDoc,
    pub plan: PatternPlan,
}

impl PlannedPattern<'_> {
    fn name(&self) -> &str {
        &self.doc.id.name
    }
}

/// What the rules share: the objects, the valid policies' and patterns' plans, the operator's
/// webhook if it is among the objects.
pub struct Facts<'a> {
    pub manifests: &'a Manifests,
    pub planned: Vec<Planned<'a>>,
    pub patterns: Vec<PlannedPattern<'a>>,
    pub webhook: Option<&'a super::WebhookDoc>,
}

/// Whether the operator's webhook is called for pods of a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coverage {
    Covered,
    NotCovered,
    /// Its namespaceSelector needs labels of a Namespace that is not among the objects.
    Unknown,
}

impl<'a> Facts<'a> {
    pub fn new(manifests: &'a Manifests) -> Self {
        let planned = manifests
            .policies
            .iter()
            .filter_map(|doc| match &doc.state {
                PolicyState::Read { policy, .. } => {
                    plan::plan(policy, Limits::default()).ok().map(|plan| Planned { doc, policy, plan })
                }
                PolicyState::Unserved { .. } => None,
            })
            .collect();
        let patterns = manifests
            .patterns
            .iter()
            .filter_map(|doc| match &doc.state {
                PatternState::Read { pattern: p, .. } => {
                    pattern::plan(p, Limits::default()).ok().map(|plan| PlannedPattern { doc, plan })
                }
                PatternState::Unserved { .. } => None,
            })
            .collect();
        let webhook = manifests.webhooks.iter().find(|w| w.name == OPERATOR_WEBHOOK);
        Self { manifests, planned, patterns, webhook }
    }

    /// Whether the operator's webhook acts in `namespace`, as the API server would decide from
    /// its namespaceSelector (every namespace carries `kubernetes.io/metadata.name`).
    fn coverage(&self, namespace: Option<&str>) -> Coverage {
        let Some(hook) = self.webhook else { return Coverage::NotCovered };
        let Some(selector) = hook.namespace_selector.clone() else { return Coverage::Covered };
        let Ok(selector) = kube::core::Selector::try_from(selector) else { return Coverage::NotCovered };
        let Some(ns) = namespace else {
            return if selector.selects_all() { Coverage::Covered } else { Coverage::Unknown };
        };
        let name_only = BTreeMap::from([("kubernetes.io/metadata.name".to_owned(), ns.to_owned())]);
        match self.manifests.namespaces.get(ns) {
            Some(labels) => {
                let mut labels = labels.clone();
                labels.extend(name_only);
                if selector.matches(&labels) { Coverage::Covered } else { Coverage::NotCovered }
            }
            None if selector.matches(&name_only) => Coverage::Covered,
            None => Coverage::Unknown,
        }
    }

    /// The workloads among the objects that `p` guards, exactly as the operator picks them.
    pub fn guarded(&self, p: &Planned) -> Vec<&'a WorkloadDoc> {
        self.manifests.workloads.iter().filter(|d| d.id.namespace == p.doc.id.namespace && guards(p, d)).collect()
    }

    /// The valid policies among the objects that guard `d`.
    pub fn guarding(&self, d: &WorkloadDoc) -> Vec<&Planned<'a>> {
        self.planned.iter().filter(|p| d.id.namespace == p.doc.id.namespace && guards(p, d)).collect()
    }
}

fn guards(p: &Planned, d: &WorkloadDoc) -> bool {
    let w = &d.workload;
    p.gate().is_some() && guards::guards(p.policy, w.key.kind, &d.id.name, &w.labels)
}

fn finding(rule: Rule, severity: Severity, object: &ObjectId, message: String) -> Finding {
    Finding { rule, severity, object: object.clone(), message }
}

fn has_gate(d: &WorkloadDoc) -> bool {
    d.workload.gate_position().is_some()
}

fn quoted_names<'p>(policies: impl IntoIterator<Item = &'p str>) -> String {
    policies.into_iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

/// What QG001 looks at in a QueuePolicy or a QueuePattern.
enum Judged<'d> {
    /// Of a `queueguard.io` version the operator does not serve.
    Unserved(&'d str),
    Read {
        /// The plan's field errors, if it refuses the object.
        errors: Option<Vec<FieldError>>,
        /// What the operator then does not do.
        refusal: &'static str,
        unknown_fields: &'d [String],
    },
}

/// QG001: what `plan::plan` or `pattern::plan` refuses, fields the schema does not know,
/// unserved versions.
fn invalid_policy(f: &Facts) -> Vec<Finding> {
    let policies = f.manifests.policies.iter().map(|doc| {
        let judged = match &doc.state {
            PolicyState::Unserved { api_version } => Judged::Unserved(api_version),
            PolicyState::Read { policy, unknown_fields } => Judged::Read {
                errors: plan::plan(policy, Limits::default()).err(),
                refusal: "declares no queue",
                unknown_fields,
            },
        };
        (&doc.id, judged)
    });
    let patterns = f.manifests.patterns.iter().map(|doc| {
        let judged = match &doc.state {
            PatternState::Unserved { api_version } => Judged::Unserved(api_version),
            PatternState::Read { pattern: p, unknown_fields } => Judged::Read {
                errors: pattern::plan(p, Limits::default()).err(),
                refusal: "puts no policy on the broker",
                unknown_fields,
            },
        };
        (&doc.id, judged)
    });
    let mut out = Vec::new();
    for (id, judged) in policies.chain(patterns) {
        let kind = id.kind;
        let message = match judged {
            Judged::Unserved(api_version) => format!(
                "apiVersion {api_version} is not served: queueguard's {kind} is {API_VERSION}, so the API server refuses the object and no operator reads it. Use apiVersion: {API_VERSION}."
            ),
            Judged::Read { errors, refusal, unknown_fields } => {
                let mut problems = Vec::new();
                if let Some(errors) = errors {
                    problems.push(format!(
                        "the operator refuses it (condition InvalidSpec) and {refusal}: {}",
                        plan::describe(&errors)
                    ));
                }
                if !unknown_fields.is_empty() {
                    problems.push(format!(
                        "unknown field{} {}: kubectl's strict field validation refuses the object, and without it the API server drops the field and its default applies",
                        if unknown_fields.len() > 1 { "s" } else { "" },
                        unknown_fields.join(", ")
                    ));
                }
                if problems.is_empty() {
                    continue;
                }
                format!("{}. Fix the fields named.", problems.join("; "))
            }
        };
        out.push(finding(Rule::InvalidPolicy, Severity::Error, id, message));
    }
    out
}

/// QG002: the strategy as the operator judges it, against the strictest policy guarding it.
fn unsafe_rollout_strategy(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for d in &f.manifests.workloads {
        let guarding = f.guarding(d);
        let Some((p, gate)) = guarding.iter().filter_map(|p| Some((p, p.gate()?))).max_by_key(|(_, g)| g.min_attached)
        else {
            continue;
        };
        let kind = d.workload.key.kind.as_str();
        let (severity, message) = match d.workload.judge(gate.min_attached) {
            Judgement::Safe { .. } => continue,
            Judgement::Invalid(e) => (
                Severity::Error,
                format!(
                    "its rollout strategy cannot be read ({e}), so nobody can tell how many consumers a rollout keeps (the operator reports UnsafeRolloutStrategy). Use an integer or a percentage such as 25%."
                ),
            ),
            Judgement::Unsafe { why, remedy } => (
                Severity::Error,
                format!(
                    "{why} (QueuePolicy '{}' guards it with minAttached {}): {remedy}. queueguard never changes a {kind}'s strategy.",
                    p.name(),
                    gate.min_attached
                ),
            ),
            Judgement::Fixable { why, fix, .. } => {
                let left = match &*d.workload.object {
                    Object::Deployment(dep) => match strategy::fenceposts(dep) {
                        Ok(Some(fp)) => (strategy::replicas(dep) - fp.max_unavailable).max(0),
                        _ => 0,
                    },
                    _ => 0,
                };
                let worst = match left {
                    0 => "no consumer stays attached".to_owned(),
                    1 => "only 1 consumer stays attached".to_owned(),
                    n => format!("only {n} consumers stay attached"),
                };
                let fixer = guarding.iter().find(|p| p.enforces() && p.gate().is_some_and(|g| g.manage_strategy));
                let (severity, note) = match fixer {
                    Some(fixer) => (
                        Severity::Warning,
                        format!(
                            " QueuePolicy '{}' has gate.manageStrategy on and patches the live {kind}, but every sync of this manifest (helm upgrade, GitOps) puts the unsafe strategy back until the operator patches it again: fix it here.",
                            fixer.name()
                        ),
                    ),
                    None if gate.mode == GateMode::Enforce => (
                        Severity::Error,
                        format!(
                            " Or set gate.manageStrategy: true in QueuePolicy '{}' to let the operator patch it.",
                            p.name()
                        ),
                    ),
                    None => (
                        Severity::Error,
                        " The policy's gate.mode is Observe, so the operator does not patch it.".to_owned(),
                    ),
                };
                let message = format!(
                    "{why} (QueuePolicy '{}' guards it with minAttached {}); at worst {worst} while the rollout runs. Set {}, so old pods go only as new ones have attached.{note}",
                    p.name(),
                    gate.min_attached,
                    fix_text(&fix["spec"]["strategy"]),
                );
                (severity, message)
            }
        };
        out.push(finding(Rule::UnsafeRolloutStrategy, severity, &d.id, message));
    }
    out
}

/// What a strategy fix sets, as a reader would write it.
fn fix_text(strategy: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if let Some(canary) = strategy.get("canary") {
        format!("spec.strategy.canary maxUnavailable: 0 and maxSurge: {}", text(&canary["maxSurge"]))
    } else if let Some(blue_green) = strategy.get("blueGreen") {
        format!("spec.strategy.blueGreen.maxUnavailable: {}", text(&blue_green["maxUnavailable"]))
    } else {
        format!(
            "spec.strategy to type RollingUpdate with maxUnavailable: 0 and maxSurge: {}",
            text(&strategy["rollingUpdate"]["maxSurge"])
        )
    }
}

/// QG003: Enforce mode without the readiness gate, and no webhook to add it (none among the
/// objects, or one whose namespaceSelector leaves the namespace out).
fn missing_readiness_gate(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for d in f.manifests.workloads.iter().filter(|d| !has_gate(d)) {
        let Some(p) = f.guarding(d).into_iter().find(|p| p.enforces()) else { continue };
        let intro = format!(
            "QueuePolicy '{}' guards it in gate.mode Enforce, but its pod template has no readiness gate {GATE_CONDITION}",
            p.name()
        );
        let ns = d.id.namespace.as_deref();
        let label = crate::webhook::NAMESPACE_LABEL_TEXT;
        let (severity, message) = match (f.webhook, f.coverage(ns)) {
            (_, Coverage::Covered) => continue,
            (None, _) => (
                Severity::Error,
                format!(
                    "{intro}: its pods turn Ready before their consumer attaches, so rollouts are not gated (the operator reports GateNotInstalled). Add readinessGates: [{{conditionType: {GATE_CONDITION}}}] to spec.template.spec, or install the operator's webhook (Helm value webhook.enabled: true, webhook {OPERATOR_WEBHOOK}) and label the namespace {label}, so it adds the gate to new pods."
                ),
            ),
            (Some(_), Coverage::NotCovered) => (
                Severity::Error,
                format!(
                    "{intro}, and the webhook {OPERATOR_WEBHOOK} is not called for namespace '{}': its namespaceSelector does not select it. Label the namespace ({label}, the chart's opt-in) or add the readiness gate to the pod template.",
                    ns.unwrap_or_default()
                ),
            ),
            (Some(_), _) => (
                Severity::Warning,
                format!(
                    "{intro}; the webhook {OPERATOR_WEBHOOK} adds it only in namespaces its namespaceSelector selects, and namespace '{}' is not among the inputs, so whether it carries the label ({label}, the chart's opt-in) cannot be checked.",
                    ns.unwrap_or("(none given)")
                ),
            ),
        };
        out.push(finding(Rule::MissingReadinessGate, severity, &d.id, message));
    }
    out
}

/// QG004: the readiness gate with nobody to set it.
fn gate_never_opens(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for d in f.manifests.workloads.iter().filter(|d| has_gate(d)) {
        let guarding = f.guarding(d);
        if guarding.is_empty() || guarding.iter().any(|p| p.enforces()) {
            continue;
        }
        let names = quoted_names(guarding.iter().map(|p| p.name()));
        let policies = if guarding.len() == 1 {
            format!("QueuePolicy {names} guarding it is")
        } else {
            format!("QueuePolicies {names} guarding it are")
        };
        out.push(finding(
            Rule::GateNeverOpens,
            Severity::Warning,
            &d.id,
            format!(
                "its pod template carries the readiness gate {GATE_CONDITION}, but {policies} in gate.mode Observe: the operator sets that condition True without looking at any consumer (reason NotGuarded), so the gate guards nothing, and while the operator is down new pods never become Ready. Set gate.mode: Enforce, or remove the readiness gate from the pod template."
            ),
        ));
    }
    out
}

/// How long a rollout of a workload can take, as QG005 estimates it: each step replaces up to
/// maxSurge pods (at least one; a StatefulSet maxUnavailable, without surge; Recreate and a
/// blue-green Rollout replace all at once) and takes the old pod's termination grace period, the
/// new pod's start-up and minAttachedSeconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutEstimate {
    pub replicas: i32,
    /// Pods replaced per step; None when all are replaced at once.
    pub per_step: Option<i32>,
    pub steps: u32,
    pub termination: Duration,
    pub start_up: Duration,
    /// Where the start-up figure comes from.
    pub start_up_from: String,
    pub min_attached: Duration,
}

impl RolloutEstimate {
    /// Saturating: a manifest may say anything (`terminationGracePeriodSeconds` up to 2^63-1).
    pub fn step(&self) -> Duration {
        self.termination.saturating_add(self.start_up).saturating_add(self.min_attached)
    }

    pub fn total(&self) -> Duration {
        self.step().saturating_mul(self.steps)
    }
}

/// The estimate for `w` with the policy's minAttachedSeconds; None when nothing would roll
/// (scaled to zero) or the strategy cannot be read.
pub fn rollout_estimate(w: &Workload, min_attached: Duration) -> Option<RolloutEstimate> {
    let replicas = w.replicas();
    if replicas <= 0 {
        return None;
    }
    let per_step = strategy::per_step(&w.object).ok()?;
    let steps = match per_step {
        Some(surge) => replicas.unsigned_abs().div_ceil(surge.max(1).unsigned_abs()),
        None => 1,
    };
    let spec = w.pod_spec();
    let grace = spec.and_then(|s| s.termination_grace_period_seconds).unwrap_or(DEFAULT_TERMINATION_GRACE_SECONDS);
    let (start_up, start_up_from) = start_up(spec);
    Some(RolloutEstimate {
        replicas,
        per_step,
        steps,
        termination: secs(grace),
        start_up: secs(start_up),
        start_up_from,
        min_attached,
    })
}

fn secs(s: i64) -> Duration {
    Duration::from_secs(u64::try_from(s).unwrap_or(0))
}

/// The slowest container's start-up: startupProbe initialDelaySeconds + periodSeconds ×
/// failureThreshold, else readinessProbe initialDelaySeconds + periodSeconds, Kubernetes'
/// defaults for unset fields.
fn start_up(spec: Option<&PodSpec>) -> (i64, String) {
    let mut slowest = (0, "no startup or readiness probe".to_owned());
    for c in spec.map(|s| s.containers.as_slice()).unwrap_or_default() {
        let field = |v: Option<i32>, default: i64| v.map_or(default, i64::from).max(0);
        let (seconds, from) = if let Some(p) = &c.startup_probe {
            let (delay, period) =
                (field(p.initial_delay_seconds, 0), field(p.period_seconds, DEFAULT_PROBE_PERIOD_SECONDS));
            let failures = field(p.failure_threshold, DEFAULT_PROBE_FAILURE_THRESHOLD);
            (
                delay + period * failures,
                format!("startupProbe of container '{}': {delay}s + {failures} × {period}s", c.name),
            )
        } else if let Some(p) = &c.readiness_probe {
            let (delay, period) =
                (field(p.initial_delay_seconds, 0), field(p.period_seconds, DEFAULT_PROBE_PERIOD_SECONDS));
            (delay + period, format!("readinessProbe of container '{}': {delay}s + {period}s", c.name))
        } else {
            continue;
        };
        if seconds > slowest.0 || slowest.1.starts_with("no ") {
            slowest = (seconds, from);
        }
    }
    slowest
}

/// QG005: expires against the rollout estimate of each guarded Deployment.
fn expires_shorter_than_rollout(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in &f.planned {
        let Some(gate) = p.gate() else { continue };
        let expires = p.plan.settings.expires;
        for d in f.guarded(p) {
            let Some(est) = rollout_estimate(&d.workload, gate.min_attached_for) else { continue };
            let total = est.total();
            if expires >= total {
                continue;
            }
            let shape = match est.per_step {
                Some(surge) => format!(
                    "{} step{} (replicas {}, {surge} at a time)",
                    est.steps,
                    if est.steps == 1 { "" } else { "s" },
                    est.replicas
                ),
                None => format!("1 step (all {} replaced at once)", est.replicas),
            };
            let (severity, lease) = lease(p.plan.keep_alive);
            let advice = Duration::from_secs(total.as_secs().div_ceil(60).max(1).saturating_mul(60));
            out.push(finding(
                Rule::ExpiresShorterThanRollout,
                severity,
                &p.doc.id,
                format!(
                    "queue '{}' expires after {} without consumers, but a rollout of {} '{}' may take about {}: {shape} of {} each ({} terminationGracePeriodSeconds + {} start-up ({}) + {} minAttachedSeconds). Should every consumer be gone that long (a stalled or unsafe rollout) {lease}, the broker deletes the queue and drops its messages without dead-lettering them. Set spec.queue.expires to at least {}.",
                    p.plan.queue,
                    Human(expires),
                    d.workload.key.kind.as_str(),
                    d.id.name,
                    Human(total),
                    Human(est.step()),
                    Human(est.termination),
                    Human(est.start_up),
                    est.start_up_from,
                    Human(est.min_attached),
                    Human(advice),
                ),
            ));
        }
    }
    out
}

/// How bad an expiry is, and the clause saying when it strikes: with keepAlive the operator's
/// declares renew the lease while it runs, so only an operator outage lets the queue expire.
fn lease(keep_alive: bool) -> (Severity, &'static str) {
    if keep_alive {
        (Severity::Warning, "while the operator is down (keepAlive renews the lease only while it runs)")
    } else {
        (Severity::Error, "with keepAlive false, so that nothing renews the lease")
    }
}

/// The broker a queue lives on, as far as manifests tell: the same Secret or RabbitmqCluster
/// (namespace, kind, name) and the same vhost.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Broker<'a> {
    source: (Option<&'a str>, &'static str, &'a str),
    vhost: Option<&'a str>,
}

fn broker_of<'a>(p: &'a Planned) -> Broker<'a> {
    Broker { source: p.plan.broker.object(p.doc.id.namespace.as_deref()), vhost: p.plan.vhost.as_deref() }
}

fn pattern_broker_of<'a>(p: &'a PlannedPattern) -> Broker<'a> {
    Broker { source: p.plan.broker.object(p.doc.id.namespace.as_deref()), vhost: p.plan.vhost.as_deref() }
}

/// Something among the objects that gives the queues it matches an expiry: a QueuePolicy its own
/// queue (through its broker policy at priority 100, `^name$`), a QueuePattern every queue its
/// pattern matches (through its broker policy at its priority, 0 to 99).
enum ExpirySource<'f, 'a> {
    Policy(&'f Planned<'a>),
    Pattern(&'f PlannedPattern<'a>),
}

impl ExpirySource<'_, '_> {
    fn all<'f, 'a>(f: &'f Facts<'a>) -> Vec<ExpirySource<'f, 'a>> {
        f.planned.iter().map(ExpirySource::Policy).chain(f.patterns.iter().map(ExpirySource::Pattern)).collect()
    }

    fn matches(&self, broker: &Broker, queue: &str) -> bool {
        match self {
            Self::Policy(p) => broker_of(p) == *broker && p.plan.queue == queue,
            Self::Pattern(p) => pattern_broker_of(p) == *broker && pattern::matches(&p.plan.pattern, queue),
        }
    }

    /// The priority of its broker policy: RabbitMQ applies only the highest-priority policy
    /// matching a queue.
    fn priority(&self) -> i64 {
        match self {
            Self::Policy(_) => POLICY_PRIORITY,
            Self::Pattern(p) => p.plan.priority,
        }
    }

    fn expires(&self) -> Duration {
        match self {
            Self::Policy(p) => p.plan.settings.expires,
            Self::Pattern(p) => pattern::expires(&p.plan),
        }
    }

    fn object(&self) -> &ObjectId {
        match self {
            Self::Policy(p) => &p.doc.id,
            Self::Pattern(p) => &p.doc.id,
        }
    }

    /// Whether something renews the queue's lease while the operator runs: the operator declares
    /// no queue for a QueuePattern.
    fn kept_alive(&self) -> bool {
        match self {
            Self::Policy(p) => p.plan.keep_alive,
            Self::Pattern(_) => false,
        }
    }

    /// How bad the expiry is, and the clause saying when it strikes.
    fn lease(&self) -> (Severity, &'static str) {
        match self {
            Self::Policy(_) => lease(self.kept_alive()),
            Self::Pattern(_) => (Severity::Error, "(the operator renews no lease for a QueuePattern)"),
        }
    }

    /// Why the queue expires, as a clause.
    fn describe(&self) -> String {
        match self {
            Self::Policy(p) => format!("QueuePolicy '{}' declares it as its own queue", p.name()),
            Self::Pattern(p) => format!(
                "QueuePattern '{}' matches it (pattern '{}', priority {}; a QueuePolicy's own broker policy, priority 100, matches only its queue, not its dead-letter queue), so the pattern's broker policy applies there",
                p.name(),
                p.plan.pattern,
                p.plan.priority
            ),
        }
    }

    /// What to do, as a sentence.
    fn remedy(&self, dlq: &str) -> String {
        match self {
            Self::Policy(p) => format!(
                "Give this policy a deadLetter.queue of its own, or have QueuePolicy '{}' declare another queue.",
                p.name()
            ),
            Self::Pattern(p) => format!(
                "Narrow QueuePattern '{}' so that it no longer matches '{dlq}': anchor its pattern (^ at the start, $ at the end) and spell out only the names it is for, leaving out the '.dlq' names; or give this policy a deadLetter.queue the pattern does not match.",
                p.name()
            ),
        }
    }
}

/// QG006: a dead-letter queue must keep its dead letters. Of the sources matching it, those of
/// the highest priority are the ones RabbitMQ applies.
fn expiring_dead_letter_queue(f: &Facts) -> Vec<Finding> {
    let sources = ExpirySource::all(f);
    let mut out = Vec::new();
    for p in &f.planned {
        let dlq = &p.plan.dead_letter_queue;
        let broker = broker_of(p);
        let matching: Vec<&ExpirySource> =
            sources.iter().filter(|s| s.object() != &p.doc.id && s.matches(&broker, dlq)).collect();
        let Some(top) = matching.iter().map(|s| s.priority()).max() else { continue };
        for s in matching.into_iter().filter(|s| s.priority() == top) {
            let expires = Human(s.expires());
            let (severity, lease) = s.lease();
            out.push(finding(
                Rule::ExpiringDeadLetterQueue,
                severity,
                &p.doc.id,
                format!(
                    "its dead-letter queue '{dlq}' expires: {}, which gives it expires {expires}. Should nobody consume it for {expires} {lease}, the broker deletes the dead-letter queue, and with it every dead letter kept there for someone to look at. {}",
                    s.describe(),
                    s.remedy(dlq)
                ),
            ));
        }
    }
    out
}

/// QG007: the dead-letter exchange is one the queue is bound from.
fn dead_letter_loop(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in &f.planned {
        let s = &p.plan.settings;
        for b in p.plan.bindings.iter().filter(|b| b.exchange == s.dead_letter_exchange) {
            out.push(finding(
                Rule::DeadLetterLoop,
                Severity::Error,
                &p.doc.id,
                format!(
                    "its dead-letter exchange '{}' is also an exchange the queue is bound from (routing key '{}'): dead letters, republished there with routing key '{}', route straight back into '{}' wherever that binding matches them, so a rejected or expired message returns to the queue instead of resting in '{}'. Give the queue a dead-letter exchange of its own (the default is '{}.dlx').",
                    s.dead_letter_exchange, b.routing_key, s.dead_letter_routing_key, p.plan.queue, p.plan.dead_letter_queue, p.plan.queue
                ),
            ));
        }
    }
    out
}

/// The PodDisruptionBudget clause, when the operator keeps one (Enforce mode, podDisruptionBudget).
fn keeps_pdb(p: &Planned) -> bool {
    p.enforces() && p.gate().is_some_and(|g| g.pod_disruption_budget)
}

/// QG008: more consumers required than there are pods.
fn min_attached_exceeds_replicas(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in &f.planned {
        let Some(gate) = p.gate() else { continue };
        let n = gate.min_attached;
        let guarded = f.guarded(p);
        let total: i32 = guarded.iter().map(|d| d.workload.replicas()).sum();
        for d in guarded {
            let r = d.workload.replicas();
            if r <= 0 || r >= n {
                continue;
            }
            let mut consequences = Vec::new();
            if total < n {
                consequences.push(format!(
                    "the gate can never count {n} consumers attached (ConsumersAttached stays TooFewAttached)"
                ));
            }
            if keeps_pdb(p) {
                consequences.push(format!(
                    "the PodDisruptionBudget the operator keeps for it can ask only minAvailable {} (one fewer than its replicas, so a node drain can evict), so a drain takes it below minAttached",
                    (r - 1).max(0)
                ));
            }
            if consequences.is_empty() {
                continue;
            }
            out.push(finding(
                Rule::MinAttachedExceedsReplicas,
                Severity::Error,
                &p.doc.id,
                format!(
                    "minAttached {n} is more than the {r} replica{} of Deployment '{}': {}. Lower spec.consumers.minAttached to at most {r}, or run at least {n} replicas.",
                    if r == 1 { "" } else { "s" },
                    d.id.name,
                    consequences.join(", and ")
                ),
            ));
        }
    }
    out
}

/// QG009: keepAlive false and nobody consuming: the queue expires with its messages.
fn scaled_to_zero_queue_expires(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in f.planned.iter().filter(|p| !p.plan.keep_alive) {
        let guarded = f.guarded(p);
        if guarded.is_empty() || guarded.iter().any(|d| d.workload.replicas() > 0) {
            continue;
        }
        let names = quoted_names(guarded.iter().map(|d| d.id.name.as_str()));
        out.push(finding(
            Rule::ScaledToZeroQueueExpires,
            Severity::Error,
            &p.doc.id,
            format!(
                "its consumer Deployment {names} is scaled to 0 replicas and keepAlive is false: with no consumer and no declares the broker deletes queue '{}' {} after it goes idle, and drops its messages without dead-lettering them (publishing does not keep a queue alive). Scale the Deployment up, or set spec.queue.keepAlive: true so the operator's declares keep the queue as long as the QueuePolicy exists.",
                p.plan.queue,
                Human(p.plan.settings.expires)
            ),
        ));
    }
    out
}

/// QG010: a PodDisruptionBudget lowered below minAttached so that drains can evict.
fn disruption_budget_blocks_drains(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in f.planned.iter().filter(|p| keeps_pdb(p)) {
        let Some(gate) = p.gate() else { continue };
        let n = gate.min_attached;
        for d in f.guarded(p).into_iter().filter(|d| d.workload.replicas() == n) {
            out.push(finding(
                Rule::DisruptionBudgetBlocksDrains,
                Severity::Warning,
                &p.doc.id,
                format!(
                    "minAttached {n} equals Deployment '{}''s {n} replica{}: a budget of minAvailable {n} would allow no eviction and hang every node drain, so the operator keeps it at minAvailable {}, and a drain (kubectl drain, node upgrades, cluster-autoscaler scale-down) takes the consumers below minAttached while an evicted pod is replaced. Run at least {} replicas.",
                    d.id.name,
                    if n == 1 { "" } else { "s" },
                    n - 1,
                    n + 1
                ),
            ));
        }
    }
    out
}

/// QG011: one queue, two owners.
fn duplicate_queue(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for (i, p) in f.planned.iter().enumerate() {
        let broker = broker_of(p);
        let Some(first) = f.planned[..i].iter().find(|q| q.plan.queue == p.plan.queue && broker_of(q) == broker) else {
            continue;
        };
        let vhost = p.plan.vhost.as_deref().map(|v| format!(", vhost '{v}'")).unwrap_or_default();
        out.push(finding(
            Rule::DuplicateQueue,
            Severity::Error,
            &p.doc.id,
            format!(
                "it declares queue '{}' on the same broker as QueuePolicy '{}' ({}{vhost}): RabbitMQ applies only one of their two operator policies to the queue (the other reports PolicyShadowed), and their settings, gates and deletion policies fight over one queue. Keep one QueuePolicy per queue.",
                p.plan.queue,
                first.name(),
                p.plan.broker
            ),
        ));
    }
    out
}

/// QG012: a pattern that matches anywhere in a name.
fn unanchored_pattern(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in f.patterns.iter().filter(|p| !p.plan.pattern.starts_with('^')) {
        let expires = Human(pattern::expires(&p.plan));
        let others: Vec<&str> = p.plan.definition.keys().map(String::as_str).filter(|k| *k != "expires").collect();
        let others = if others.is_empty() { String::new() } else { format!(" (and its {})", others.join(", ")) };
        out.push(finding(
            Rule::UnanchoredPattern,
            Severity::Warning,
            &p.doc.id,
            format!(
                "its pattern '{pat}' does not start with ^, so it matches anywhere in a queue name: its broker policy gives expires {expires}{others} to every queue on the broker whose name merely contains a match, other applications' queues included, and the broker deletes any of them left unused for {expires}, with their messages (a QueuePolicy's own queue is safe: its policy, priority 100, wins). Anchor the pattern: start it with ^ (for example '^{pat}'), and end it with $ where the names end.",
                pat = p.plan.pattern,
            ),
        ));
    }
    out
}

/// QG013: a classic queue on a cluster.
fn classic_queue_on_cluster(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in f.planned.iter().filter(|p| p.plan.queue_type == QueueType::Classic) {
        let BrokerSource::Secret { name } = &p.plan.broker else { continue };
        let secret = (p.doc.id.namespace.clone(), name.clone());
        let Some(nodes) = f.manifests.broker_nodes.get(&secret).filter(|n| n.len() > 1) else { continue };
        let change = match p.plan.on_change {
            OnChange::Refuse => {
                "set queue.type: quorum and queue.onChange: Migrate in one change: the operator then moves the queue live, with its bindings and messages (`queueguard migrate QUEUE --to quorum` does it for a queue no policy manages yet)"
            }
            OnChange::Migrate => {
                "set queue.type: quorum: onChange: Migrate moves the queue live, with its bindings and messages"
            }
        };
        out.push(finding(
            Rule::ClassicQueueOnCluster,
            Severity::Warning,
            &p.doc.id,
            format!(
                "queue '{}' is a classic queue, and Secret '{}' names {} broker nodes ({}): a classic queue lives on one node, and while that node is down the queue is gone (404) with its messages, publishes to it are dropped, and its consumers on other nodes are cancelled. For messages that must survive a node, {change}. A cluster also needs the rabbitmq_event_exchange plugin on every node, or the operator polls for that node's consumers.",
                p.plan.queue,
                name,
                nodes.len(),
                nodes.join(", ")
            ),
        ));
    }
    out
}

/// QG014: what RabbitMQ 4.3 refuses at declaration (the 4.0 to 4.2 brokers only deprecate it):
/// transient non-exclusive queues, `x-queue-mode`, `x-queue-version: 1`. Seen in the Messaging
/// Topology Operator's `Queue` manifests, whose `durable` defaults to false.
fn refused_by_rabbitmq_4_3(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for q in &f.manifests.topology_queues {
        let mut why = Vec::new();
        if !q.durable && !q.exclusive {
            why.push("it is transient and not exclusive (spec.durable is false, the Topology Operator's default): set durable: true, or make it exclusive".to_owned());
        }
        if q.arguments.contains_key("x-queue-mode") {
            why.push("it declares x-queue-mode, which RabbitMQ 3.12 stopped using (classic queues keep messages on disk as lazy ones did): remove the argument".to_owned());
        }
        let version_one =
            q.arguments.get("x-queue-version").is_some_and(|v| v.as_i64() == Some(1) || v.as_str() == Some("1"));
        if version_one {
            why.push("it declares x-queue-version: 1, the classic queue storage RabbitMQ 4.0 replaced: remove the argument (version 2 is the only one)".to_owned());
        }
        if why.is_empty() {
            continue;
        }
        out.push(finding(
            Rule::RefusedByNewerRabbitmq,
            Severity::Warning,
            &q.id,
            format!(
                "queue '{}': RabbitMQ 4.3 refuses to declare it, and the Topology Operator then cannot create it again after a broker upgrade or on a new cluster: {}.",
                q.name,
                why.join("; ")
            ),
        ));
    }
    out
}

/// QG015: a policy for a queue the Messaging Topology Operator declares. Only policies on a
/// RabbitmqCluster can be compared: a Secret's broker address is not read here.
fn managed_elsewhere(f: &Facts) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in f.planned.iter().filter(|p| !p.plan.adopt && matches!(p.plan.broker, BrokerSource::RabbitmqCluster { .. }))
    {
        let place = crate::topology::Place {
            namespace: p.doc.id.namespace.as_deref().unwrap_or("default"),
            source: &p.plan.broker,
            hosts: vec![],
            vhost: p.plan.vhost.as_deref().unwrap_or("/"),
        };
        let queues = f.manifests.topology_queues.iter().map(|q| &q.queue);
        let Some(owner) = crate::topology::managed_elsewhere(&p.plan.queue, &place, queues) else { continue };
        out.push(finding(
            Rule::ManagedElsewhere,
            Severity::Error,
            &p.doc.id,
            format!(
                "queue '{}' in vhost '{}' is declared by Queue '{owner}' of the Messaging Topology Operator on the same {}: the operator will touch nothing and report ManagedElsewhere. Set spec.adopt: true to have it report on the queue and guard its consumers beside that Queue (during a move from one to the other), or remove one of the two.",
                p.plan.queue, place.vhost, p.plan.broker
            ),
        ));
    }
    out
}

/// QG016: a migration to a quorum queue, whose workers may declare it plainly (no
/// x-queue-type, as the source articles' workers do) and be refused afterwards. The broker's
/// version and the vhost's default queue type decide (`queueguard migrate --dry-run` reads
/// them); this says what to check.
fn plain_declare_refused_after_migration(f: &Facts) -> Vec<Finding> {
    let migrating = |p: &&Planned| p.plan.on_change == OnChange::Migrate && p.plan.queue_type == QueueType::Quorum;
    f.planned
        .iter()
        .filter(migrating)
        .map(|p| {
            finding(
                Rule::PlainDeclareRefusedAfterMigration,
                Severity::Warning,
                &p.doc.id,
                format!(
                    "queue '{}' becomes quorum by migration: a worker that declares it without x-queue-type (a plain queue_declare(durable=True), as most do at start-up) is then refused (PRECONDITION_FAILED inequivalent arg 'x-queue-type') on RabbitMQ 3.x, and on 4.x unless the vhost's default queue type is quorum, so its consumers would not come back. Have the workers declare x-queue-type: quorum (or passively), or on 4.x set the vhost's default queue type to quorum; `queueguard migrate {} --to quorum --dry-run` says what this broker will do.",
                    p.plan.queue, p.plan.queue
                ),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::read::read_str;

    const GATE: &str = "      readinessGates: [{conditionType: queueguard.io/consumer-attached}]\n";

    /// A QueuePolicy `shop/<name>` reading Secret `rabbitmq`; `rest` is more of its spec.
    fn policy(name: &str, queue: &str, rest: &str) -> String {
        format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  queue: {queue}\n{rest}---\n"
        )
    }

    /// A QueuePattern `shop/<name>` reading Secret `rabbitmq`; `rest` is more of its spec.
    fn queue_pattern(name: &str, pattern: &str, rest: &str) -> String {
        format!(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePattern\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  pattern: '{pattern}'\n{rest}---\n"
        )
    }

    /// A policy guarding Deployment `worker`.
    fn guarding(rest: &str) -> String {
        policy("orders", "{name: orders}", &format!("  consumers: {{deployment: worker}}\n{rest}"))
    }

    /// A Deployment `shop/<name>` labelled tier: consumers; `spec` and `pod` are more of its spec
    /// and its pod spec.
    fn deployment(name: &str, spec: &str, pod: &str) -> String {
        format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: shop, labels: {{tier: consumers}}}}\nspec:\n  selector: {{matchLabels: {{app: {name}}}}}\n{spec}  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers: [{{name: worker, image: worker}}]\n{pod}---\n"
        )
    }

    /// A safe worker: 2 replicas, the default strategy (maxSurge 1, maxUnavailable 0), gated.
    fn worker() -> String {
        deployment("worker", "  replicas: 2\n", GATE)
    }

    fn findings(yaml: &str) -> Vec<Finding> {
        check(&read_str("test.yaml", yaml).unwrap())
    }

    /// (rule id, object) of every finding.
    fn found(yaml: &str) -> Vec<(&'static str, String)> {
        findings(yaml).into_iter().map(|f| (f.rule.id(), f.object.to_string())).collect()
    }

    fn only(yaml: &str, rule: Rule) -> Finding {
        let all = findings(yaml);
        assert_eq!(all.len(), 1, "{all:#?}");
        assert_eq!(all[0].rule, rule, "{all:#?}");
        all.into_iter().next().unwrap()
    }

    #[test]
    fn rules_have_unique_ids_and_kebab_case_names() {
        let ids: std::collections::HashSet<_> = Rule::ALL.iter().map(|r| r.id()).collect();
        assert_eq!(ids.len(), Rule::ALL.len());
        for r in Rule::ALL {
            assert!(r.id().starts_with("QG") && r.id().len() == 5, "{}", r.id());
            assert!(r.name().chars().all(|c| c.is_ascii_lowercase() || c == '-'), "{}", r.name());
        }
    }

    #[test]
    fn a_guarded_safe_gated_worker_has_no_findings() {
        assert_eq!(found(&(guarding("") + &worker())), vec![]);
    }

    #[test]
    fn qg001_invalid_policies_carry_the_plans_field_errors() {
        let f = only(&policy("orders", "{name: amq.orders, expires: 30s}", ""), Rule::InvalidPolicy);
        assert_eq!(f.object.to_string(), "QueuePolicy shop/orders");
        assert!(
            f.message.contains("spec.queue.name: queue name \"amq.orders\" starts with 'amq.'")
                && f.message.contains("spec.queue.expires: must be at least 1m"),
            "{}",
            f.message
        );
        let f = only(&policy("orders", "{name: orders, expire: 1h}", ""), Rule::InvalidPolicy);
        assert!(f.message.starts_with("unknown field spec.queue.expire: kubectl's strict"), "{}", f.message);
        let unserved = policy("orders", "{}", "").replace("v1alpha1", "v1");
        assert!(only(&unserved, Rule::InvalidPolicy).message.starts_with("apiVersion queueguard.io/v1 is not served"));
        assert_eq!(found(&policy("orders", "{name: orders, expires: 1h}", "")), vec![]);
    }

    #[test]
    fn qg001_invalid_patterns_are_named_as_queue_patterns() {
        let f = only(&queue_pattern("replies", "(unclosed", "  expires: 10s\n"), Rule::InvalidPolicy);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Error, "QueuePattern shop/replies".into()));
        assert!(
            f.message.starts_with("the operator refuses it (condition InvalidSpec) and puts no policy on the broker: spec.pattern: not a regular expression")
                && f.message.contains("spec.expires: must be at least 1m"),
            "{}",
            f.message
        );
        let f = only(&queue_pattern("replies", "^rpc", "  expiry: 1h\n"), Rule::InvalidPolicy);
        assert!(f.message.starts_with("unknown field spec.expiry: kubectl's strict"), "{}", f.message);
        let unserved = queue_pattern("replies", "^rpc", "").replace("v1alpha1", "v1beta1");
        let f = only(&unserved, Rule::InvalidPolicy);
        assert_eq!(f.object.to_string(), "QueuePattern shop/replies");
        assert!(
            f.message.starts_with(
                "apiVersion queueguard.io/v1beta1 is not served: queueguard's QueuePattern is queueguard.io/v1alpha1"
            ),
            "{}",
            f.message
        );
        // Passing: a valid, anchored pattern.
        assert_eq!(found(&queue_pattern("replies", "^rpc\\.reply\\.", "  expires: 5m\n  maxLength: 100\n")), vec![]);
    }

    #[test]
    fn qg002_recreate_and_rolling_updates_that_drop_below_min_attached() {
        let recreate = deployment("worker", "  replicas: 2\n  strategy: {type: Recreate}\n", GATE);
        let f = only(&(guarding("  gate: {manageStrategy: false}\n") + &recreate), Rule::UnsafeRolloutStrategy);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Error, "Deployment shop/worker".into()));
        assert!(f.message.starts_with("strategy Recreate stops every old pod"), "{}", f.message);
        assert!(f.message.contains("at worst no consumer stays attached"), "{}", f.message);
        assert!(f.message.contains("maxUnavailable: 0 and maxSurge: 1"), "{}", f.message);
        assert!(f.message.contains("set gate.manageStrategy: true in QueuePolicy 'orders'"), "{}", f.message);

        // 4 replicas, maxUnavailable 50% resolves to 2: below minAttached 3. The operator would
        // patch it, so it is a warning; maxSurge 25% is kept.
        let half = deployment(
            "worker",
            "  replicas: 4\n  strategy: {rollingUpdate: {maxSurge: 25%, maxUnavailable: 50%}}\n",
            GATE,
        );
        let text = policy("orders", "{name: orders}", "  consumers: {deployment: worker, minAttached: 3}\n") + &half;
        let f = only(&text, Rule::UnsafeRolloutStrategy);
        assert_eq!(f.severity, Severity::Warning);
        assert!(f.message.contains("maxUnavailable resolves to 2"), "{}", f.message);
        assert!(f.message.contains("at worst only 2 consumers stay attached while the rollout runs"), "{}", f.message);
        assert!(f.message.contains("maxSurge: 25%"), "{}", f.message);
        assert!(f.message.contains("QueuePolicy 'orders' has gate.manageStrategy on"), "{}", f.message);

        // Observe mode never patches.
        let f =
            only(&(guarding("  gate: {mode: Observe}\n") + &recreate.replace(GATE, "")), Rule::UnsafeRolloutStrategy);
        assert!(f.message.contains("gate.mode is Observe"), "{}", f.message);

        // Passing: maxUnavailable 0, or an unguarded Recreate Deployment.
        let safe = deployment(
            "worker",
            "  replicas: 2\n  strategy: {rollingUpdate: {maxUnavailable: 0, maxSurge: 1}}\n",
            GATE,
        );
        assert_eq!(found(&(guarding("") + &safe)), vec![]);
        assert_eq!(found(&(guarding("") + &worker() + &recreate.replace("name: worker", "name: web"))), vec![]);
    }

    /// A workload of another kind `kind` named `name`, its spec's `spec` before the template.
    fn workload(api_version: &str, kind: &str, name: &str, spec: &str) -> String {
        format!(
            "apiVersion: {api_version}\nkind: {kind}\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n{spec}  selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers: [{{name: worker, image: worker}}]\n{GATE}---\n"
        )
    }

    fn of_rule(yaml: &str, rule: Rule) -> Finding {
        let all: Vec<Finding> = findings(yaml).into_iter().filter(|f| f.rule == rule).collect();
        assert_eq!(all.len(), 1, "{all:#?}");
        all.into_iter().next().unwrap()
    }

    #[test]
    fn qg002_a_single_replica_statefulset_and_an_all_at_once_canary() {
        let guards = |kind: &str, name: &str| {
            policy("orders", "{name: orders}", &format!("  consumers: {{workload: {{kind: {kind}, name: {name}}}}}\n"))
        };
        let shard = workload("apps/v1", "StatefulSet", "shard", "  replicas: 1\n  serviceName: shard\n");
        let f = of_rule(&(guards("StatefulSet", "shard") + &shard), Rule::UnsafeRolloutStrategy);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Error, "StatefulSet shop/shard".into()));
        assert!(f.message.contains("without surge") && f.message.contains("run at least 2 replicas"), "{}", f.message);
        assert!(f.message.contains("never changes a StatefulSet's strategy"), "{}", f.message);
        let two = workload("apps/v1", "StatefulSet", "shard", "  replicas: 2\n  serviceName: shard\n");
        assert!(
            findings(&(guards("StatefulSet", "shard") + &two)).iter().all(|f| f.rule != Rule::UnsafeRolloutStrategy)
        );

        let canary = workload(
            "argoproj.io/v1alpha1",
            "Rollout",
            "canary",
            "  replicas: 3\n  strategy: {canary: {maxUnavailable: 100%, maxSurge: 1}}\n",
        );
        let f = of_rule(&(guards("Rollout", "canary") + &canary), Rule::UnsafeRolloutStrategy);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Warning, "Rollout shop/canary".into()));
        assert!(f.message.starts_with("canary: a rollout may take 3 of 3 pods unavailable"), "{}", f.message);
        assert!(f.message.contains("Set spec.strategy.canary maxUnavailable: 0 and maxSurge: 1"), "{}", f.message);
        assert!(f.message.contains("patches the live Rollout"), "{}", f.message);
    }

    #[test]
    fn qg002_an_unreadable_percentage_is_reported() {
        let bad = deployment("worker", "  replicas: 2\n  strategy: {rollingUpdate: {maxSurge: lots}}\n", GATE);
        let f = only(&(guarding("") + &bad), Rule::UnsafeRolloutStrategy);
        assert!(f.message.starts_with("its rollout strategy cannot be read (maxSurge: invalid value"), "{}", f.message);
    }

    #[test]
    fn qg003_enforce_mode_needs_the_readiness_gate_or_the_webhook() {
        let bare = deployment("worker", "  replicas: 2\n", "");
        let f = only(&(guarding("") + &bare), Rule::MissingReadinessGate);
        assert_eq!(f.object.to_string(), "Deployment shop/worker");
        assert!(f.message.contains("QueuePolicy 'orders' guards it in gate.mode Enforce"), "{}", f.message);
        // Selected by label, not by name: the same.
        let selecting = policy("orders", "{}", "  consumers: {selector: {matchLabels: {tier: consumers}}}\n");
        assert_eq!(found(&(selecting + &bare)), vec![("QG003", "Deployment shop/worker".into())]);
        // Passing: the operator's webhook is installed, or the policy only observes.
        let webhook = "apiVersion: admissionregistration.k8s.io/v1\nkind: MutatingWebhookConfiguration\nmetadata: {name: queueguard}\nwebhooks: [{name: pods.queueguard.io}]\n";
        assert_eq!(found(&(guarding("") + &bare + webhook)), vec![]);
        let other_webhook = webhook.replace("pods.queueguard.io", "pods.example.com");
        assert_eq!(found(&(guarding("") + &bare + &other_webhook)), vec![("QG003", "Deployment shop/worker".into())]);
        assert_eq!(found(&(guarding("  gate: {mode: Observe}\n") + &bare)), vec![]);
    }

    #[test]
    fn qg003_the_webhook_acts_only_in_namespaces_its_selector_picks() {
        let bare = deployment("worker", "  replicas: 2\n", "");
        let webhook = "apiVersion: admissionregistration.k8s.io/v1\nkind: MutatingWebhookConfiguration\nmetadata: {name: queueguard}\nwebhooks:\n- name: pods.queueguard.io\n  namespaceSelector:\n    matchLabels: {queueguard.io/readiness-gate-inject: enabled}\n    matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [queueguard]}]\n";
        let labelled = "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {queueguard.io/readiness-gate-inject: enabled}}\n";
        let unlabelled = "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n";
        let base = guarding("") + &bare + webhook;
        assert_eq!(found(&(base.clone() + "---\n" + labelled)), vec![], "opted in");
        let f = only(&(base.clone() + "---\n" + unlabelled), Rule::MissingReadinessGate);
        assert_eq!(f.severity, Severity::Error);
        assert!(
            f.message.contains("not called for namespace 'shop'")
                && f.message.contains(crate::webhook::NAMESPACE_LABEL_TEXT),
            "{}",
            f.message
        );
        let f = only(&base, Rule::MissingReadinessGate);
        assert_eq!(f.severity, Severity::Warning, "the namespace is not among the inputs: cannot tell");
        assert!(f.message.contains("cannot be checked"), "{}", f.message);
        // A selector that needs no label but the name the API server sets on every namespace.
        let by_name = webhook.replace("    matchLabels: {queueguard.io/readiness-gate-inject: enabled}\n", "");
        assert_eq!(found(&(guarding("") + &bare + &by_name)), vec![]);
        let excluded = by_name.replace("values: [queueguard]", "values: [shop]");
        assert_eq!(found(&(guarding("") + &bare + &excluded)), vec![("QG003", "Deployment shop/worker".into())]);
    }

    #[test]
    fn qg003_namespaces_must_match_and_absent_namespaces_match_each_other() {
        let bare = deployment("worker", "  replicas: 2\n", "");
        let elsewhere = bare.replace("namespace: shop", "namespace: web");
        assert_eq!(found(&(guarding("") + &elsewhere)), vec![], "a policy guards its own namespace only");
        let unnamespaced = (guarding("") + &bare).replace(", namespace: shop", "");
        assert_eq!(found(&unnamespaced), vec![("QG003", "Deployment worker".into())]);
        let half = guarding("") + &bare.replace(", namespace: shop", "");
        assert_eq!(found(&half), vec![], "no namespace is not the policy's namespace");
    }

    #[test]
    fn qg004_a_readiness_gate_under_observe_mode_never_opens() {
        let f = only(&(guarding("  gate: {mode: Observe}\n") + &worker()), Rule::GateNeverOpens);
        assert_eq!(f.object.to_string(), "Deployment shop/worker");
        assert!(f.message.contains("QueuePolicy 'orders' guarding it is in gate.mode Observe"), "{}", f.message);
        // Passing: another policy enforces, or no policy in the manifests guards it.
        let second = policy("billing", "{name: billing}", "  consumers: {deployment: worker}\n");
        assert_eq!(found(&(guarding("  gate: {mode: Observe}\n") + &second + &worker())), vec![]);
        assert_eq!(found(&worker()), vec![]);
        let two = guarding("  gate: {mode: Observe}\n")
            + &second
                .replace("consumers: {deployment: worker}", "consumers: {deployment: worker}\n  gate: {mode: Observe}")
            + &worker();
        let f = only(&two, Rule::GateNeverOpens);
        assert!(
            f.message.contains("QueuePolicies 'orders', 'billing' guarding it are in gate.mode Observe"),
            "{}",
            f.message
        );
    }

    #[test]
    fn qg014_topology_queues_rabbitmq_4_3_refuses() {
        let queue = |name: &str, spec: &str| {
            format!(
                "apiVersion: rabbitmq.com/v1beta1\nkind: Queue\nmetadata: {{name: {name}, namespace: shop}}\nspec: {spec}\n---\n"
            )
        };
        let text = queue("transient", "{name: replies, rabbitmqClusterReference: {name: rmq}}")
            + &queue("lazy", "{name: lazy, durable: true, arguments: {x-queue-mode: lazy}}")
            + &queue("v1", "{name: v1, durable: true, arguments: {x-queue-version: 1}}")
            + &queue("fine", "{name: fine, durable: true, arguments: {x-queue-version: 2, x-max-length: 5}}")
            + &queue("exclusive", "{name: mine, exclusive: true}");
        let f = found(&text);
        assert_eq!(
            f,
            vec![
                ("QG014", "Queue shop/transient".into()),
                ("QG014", "Queue shop/lazy".into()),
                ("QG014", "Queue shop/v1".into())
            ]
        );
        let transient = only(&queue("t", "{name: replies}"), Rule::RefusedByNewerRabbitmq);
        assert!(
            transient.message.starts_with("queue 'replies': RabbitMQ 4.3 refuses")
                && transient.message.contains("durable is false")
        );
        assert_eq!(transient.severity, Severity::Warning);
    }

    #[test]
    fn qg016_a_migration_to_quorum_warns_of_plain_declares() {
        let text = policy("orders", "{type: quorum, onChange: Migrate}", "")
            + &policy("billing", "{type: quorum}", "")
            + &policy("events", "{type: classic, onChange: Migrate}", "");
        let f: Vec<_> = found(&text).into_iter().filter(|(id, _)| *id == "QG016").collect();
        assert_eq!(f, vec![("QG016", "QueuePolicy shop/orders".into())]);
        let w =
            only(&policy("orders", "{type: quorum, onChange: Migrate}", ""), Rule::PlainDeclareRefusedAfterMigration);
        assert!(w.message.contains("without x-queue-type") && w.message.contains("--dry-run"), "{}", w.message);
        assert_eq!(w.severity, Severity::Warning);
    }

    #[test]
    fn qg015_a_policy_for_a_queue_the_topology_operator_declares() {
        let on_cluster = |name: &str, rest: &str| {
            format!(
                "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  broker: {{rabbitmqClusterReference: {{name: rmq}}}}\n  queue: {{name: orders}}\n{rest}---\n"
            )
        };
        let theirs = "apiVersion: rabbitmq.com/v1beta1\nkind: Queue\nmetadata: {name: orders, namespace: shop}\nspec: {name: orders, durable: true, rabbitmqClusterReference: {name: rmq}}\n---\n";
        let f = only(&(on_cluster("orders", "") + theirs), Rule::ManagedElsewhere);
        assert_eq!(f.object.to_string(), "QueuePolicy shop/orders");
        assert_eq!(f.severity, Severity::Error);
        assert!(f.message.starts_with("queue 'orders' in vhost '/' is declared by Queue 'shop/orders' of the Messaging Topology Operator on the same RabbitmqCluster 'rmq'"), "{}", f.message);
        assert!(found(&(on_cluster("orders", "  adopt: true\n") + theirs)).is_empty(), "adopted");
        let elsewhere = theirs.replace("{name: rmq}", "{name: rmq2}");
        assert!(found(&(on_cluster("orders", "") + &elsewhere)).is_empty(), "another cluster");
        let other_vhost = theirs.replace("name: orders, durable", "name: orders, vhost: billing, durable");
        assert!(found(&(on_cluster("orders", "") + &other_vhost)).is_empty(), "another vhost");
        assert!(
            found(&(policy("orders", "{name: orders}", "") + theirs)).is_empty(),
            "a Secret's address is not known here"
        );
    }

    #[test]
    fn qg005_expires_shorter_than_the_rollout_estimate() {
        // 4 replicas, maxSurge 25% → 1: 4 steps of 60s grace + (10s + 6 × 5s startupProbe) + 20s.
        let slow = deployment(
            "worker",
            "  replicas: 4\n",
            "      terminationGracePeriodSeconds: 60\n      readinessGates: [{conditionType: queueguard.io/consumer-attached}]\n",
        )
        .replace(
            "containers: [{name: worker, image: worker}]",
            "containers: [{name: worker, image: worker, startupProbe: {initialDelaySeconds: 10, periodSeconds: 5, failureThreshold: 6, tcpSocket: {port: 80}}}]",
        );
        let text = policy(
            "orders",
            "{name: orders, expires: 5m, keepAlive: false}",
            "  consumers: {deployment: worker, minAttachedSeconds: 20}\n",
        ) + &slow;
        let f = only(&text, Rule::ExpiresShorterThanRollout);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Error, "QueuePolicy shop/orders".into()));
        assert!(f.message.starts_with("queue 'orders' expires after 5m without consumers, but a rollout of Deployment 'worker' may take about 8m: 4 steps (replicas 4, 1 at a time) of 2m each (1m terminationGracePeriodSeconds + 40s start-up (startupProbe of container 'worker': 10s + 6 × 5s) + 20s minAttachedSeconds). Should every consumer be gone that long (a stalled or unsafe rollout) with keepAlive false, so that nothing renews the lease, the broker deletes the queue"), "{}", f.message);
        assert!(f.message.ends_with("Set spec.queue.expires to at least 8m."), "{}", f.message);
        // With keepAlive the operator renews the lease while it runs: a warning.
        let kept = text.replace(", keepAlive: false", "");
        assert_eq!(only(&kept, Rule::ExpiresShorterThanRollout).severity, Severity::Warning);
        // Passing: expires above the estimate.
        assert_eq!(found(&text.replace("expires: 5m", "expires: 9m")), vec![]);
        // Whatever a manifest says, the estimate saturates instead of overflowing.
        let endless =
            text.replace("terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds: 9223372036854775807");
        assert!(only(&endless, Rule::ExpiresShorterThanRollout).message.contains("may take about"));
    }

    #[test]
    fn rollout_estimates_use_kubernetes_defaults_and_the_readiness_probe() {
        let yaml = deployment("w", "  replicas: 3\n  strategy: {rollingUpdate: {maxSurge: 2}}\n", "").replace(
            "containers: [{name: worker, image: worker}]",
            "containers: [{name: a, image: a, readinessProbe: {initialDelaySeconds: 15, httpGet: {port: 80}}}, {name: b, image: b}]",
        );
        let m = read_str("t.yaml", &yaml).unwrap();
        let est = rollout_estimate(&m.workloads[0].workload, Duration::from_secs(5)).unwrap();
        assert_eq!((est.steps, est.termination, est.start_up), (2, Duration::from_secs(30), Duration::from_secs(25)));
        assert_eq!(est.start_up_from, "readinessProbe of container 'a': 15s + 10s");
        assert_eq!(est.total(), Duration::from_secs(120));
        let recreate =
            read_str("t.yaml", &deployment("w", "  replicas: 5\n  strategy: {type: Recreate}\n", "")).unwrap();
        let est = rollout_estimate(&recreate.workloads[0].workload, Duration::ZERO).unwrap();
        assert_eq!((est.steps, est.per_step, est.total()), (1, None, Duration::from_secs(30)));
        assert_eq!(est.start_up_from, "no startup or readiness probe");
        let zero = read_str("t.yaml", &deployment("w", "  replicas: 0\n", "")).unwrap();
        assert_eq!(rollout_estimate(&zero.workloads[0].workload, Duration::ZERO), None);
    }

    #[test]
    fn qg006_a_dead_letter_queue_another_policy_declares_expires() {
        let orders = policy("orders", "{name: orders, deadLetter: {queue: parking}}", "");
        let parking = policy("parking", "{name: parking, expires: 2h}", "");
        let f = only(&(orders.clone() + &parking), Rule::ExpiringDeadLetterQueue);
        assert_eq!(f.object.to_string(), "QueuePolicy shop/orders");
        assert!(
            f.message.starts_with("its dead-letter queue 'parking' expires: QueuePolicy 'parking' declares it as its own queue, which gives it expires 2h. Should nobody consume it for 2h while the operator is down"),
            "{}",
            f.message
        );
        assert!(f.message.ends_with("or have QueuePolicy 'parking' declare another queue."), "{}", f.message);
        assert_eq!(f.severity, Severity::Warning, "parking's keepAlive renews the lease while the operator runs");
        let unkept = parking.replace("expires: 2h", "expires: 2h, keepAlive: false");
        let f = only(&(orders.clone() + &unkept), Rule::ExpiringDeadLetterQueue);
        assert_eq!(f.severity, Severity::Error);
        assert!(f.message.contains("for 2h with keepAlive false, so that nothing renews the lease"), "{}", f.message);
        // Passing: another broker (Secret), or another vhost.
        let other_broker = parking.replace("name: rabbitmq", "name: other");
        assert_eq!(found(&(orders.clone() + &other_broker)), vec![]);
        let other_vhost = parking.replace("secretRef: {name: rabbitmq}", "secretRef: {name: rabbitmq}, vhost: v2");
        assert_eq!(found(&(orders + &other_vhost)), vec![]);
        // The default dead-letter queue is '<queue>.dlq'.
        let default_dlq = policy("orders", "{name: orders}", "") + &policy("dlq", "{name: orders.dlq}", "");
        assert_eq!(found(&default_dlq), vec![("QG006", "QueuePolicy shop/orders".into())]);
    }

    #[test]
    fn qg006_a_pattern_matching_a_dead_letter_queue_gives_it_its_expiry() {
        // The QueuePolicy's own broker policy (priority 100) matches '^orders$' only: the
        // pattern's applies to 'orders.dlq'.
        let orders = policy("orders", "{name: orders}", "");
        let all_orders = queue_pattern("all-orders", "^orders", "");
        let f = only(&(orders.clone() + &all_orders), Rule::ExpiringDeadLetterQueue);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Error, "QueuePolicy shop/orders".into()));
        assert!(
            f.message.starts_with("its dead-letter queue 'orders.dlq' expires: QueuePattern 'all-orders' matches it (pattern '^orders', priority 0; a QueuePolicy's own broker policy, priority 100, matches only its queue, not its dead-letter queue), so the pattern's broker policy applies there, which gives it expires 10m. Should nobody consume it for 10m (the operator renews no lease for a QueuePattern), the broker deletes the dead-letter queue"),
            "{}",
            f.message
        );
        assert!(
            f.message.ends_with("Narrow QueuePattern 'all-orders' so that it no longer matches 'orders.dlq': anchor its pattern (^ at the start, $ at the end) and spell out only the names it is for, leaving out the '.dlq' names; or give this policy a deadLetter.queue the pattern does not match."),
            "{}",
            f.message
        );
        // A named dead-letter queue and the pattern's own expires.
        let parking = policy("orders", "{name: orders, deadLetter: {queue: parking.orders}}", "");
        let f = only(
            &(parking + &queue_pattern("parked", "^parking\\.", "  expires: 2h\n")),
            Rule::ExpiringDeadLetterQueue,
        );
        assert!(f.message.contains("which gives it expires 2h"), "{}", f.message);

        // Passing: the pattern matches the policy's own queue only, where the QueuePolicy wins.
        assert_eq!(found(&(orders.clone() + &queue_pattern("exact", "^orders$", ""))), vec![]);
        // Passing: another broker (Secret), vhost or namespace.
        let other_secret = all_orders.replace("name: rabbitmq", "name: other");
        assert_eq!(found(&(orders.clone() + &other_secret)), vec![]);
        let other_vhost = all_orders.replace("secretRef: {name: rabbitmq}", "secretRef: {name: rabbitmq}, vhost: v2");
        assert_eq!(found(&(orders.clone() + &other_vhost)), vec![]);
        let other_namespace = all_orders.replace("namespace: shop", "namespace: web");
        assert_eq!(found(&(orders.clone() + &other_namespace)), vec![]);
        // An invalid pattern puts no policy on the broker: only QG001.
        let invalid = queue_pattern("all-orders", "^orders", "  priority: 100\n");
        assert_eq!(found(&(orders + &invalid)), vec![("QG001", "QueuePattern shop/all-orders".into())]);
    }

    #[test]
    fn qg006_only_the_highest_priority_policy_matching_a_dead_letter_queue_applies() {
        // Another QueuePolicy declares the dead-letter queue: its policy (priority 100) wins over
        // the pattern there, so only it is named.
        let orders = policy("orders", "{name: orders}", "");
        let dlq = policy("dlq", "{name: orders.dlq, expires: 2h}", "");
        let pattern = queue_pattern("all-orders", "^orders(\\.dlq)?$", "  priority: 99\n");
        let f = only(&(orders.clone() + &dlq + &pattern), Rule::ExpiringDeadLetterQueue);
        assert!(f.message.contains("QueuePolicy 'dlq' declares it as its own queue"), "{}", f.message);
        // Of two patterns, the one of higher priority applies; of equal priority, either may.
        let low = queue_pattern("low", "^orders\\.dlq$", "");
        let high = queue_pattern("high", "^orders\\.", "  priority: 5\n");
        let f = only(&(orders.clone() + &low + &high), Rule::ExpiringDeadLetterQueue);
        assert!(f.message.contains("QueuePattern 'high' matches it"), "{}", f.message);
        let equal = findings(&(orders + &low + &high.replace("priority: 5", "priority: 0")));
        let named: Vec<bool> =
            ["'low'", "'high'"].iter().map(|n| equal.iter().any(|f| f.message.contains(n))).collect();
        assert_eq!((equal.len(), named), (2, vec![true, true]), "{equal:#?}");
    }

    #[test]
    fn qg007_a_dead_letter_exchange_the_queue_is_bound_from_loops() {
        let looping = policy(
            "orders",
            "{name: orders, deadLetter: {exchange: orders}, bindings: [{exchange: orders, routingKey: orders}]}",
            "",
        );
        let f = only(&looping, Rule::DeadLetterLoop);
        assert!(
            f.message.starts_with("its dead-letter exchange 'orders' is also an exchange the queue is bound from (routing key 'orders'): dead letters, republished there with routing key 'orders', route straight back into 'orders'"),
            "{}",
            f.message
        );
        let separate = policy("orders", "{name: orders, bindings: [{exchange: orders, routingKey: orders}]}", "");
        assert_eq!(found(&separate), vec![]);
    }

    #[test]
    fn qg008_min_attached_above_replicas_can_never_be_met() {
        let text = guarding("").replace("{deployment: worker}", "{deployment: worker, minAttached: 3}") + &worker();
        let f = only(&text, Rule::MinAttachedExceedsReplicas);
        assert_eq!(f.object.to_string(), "QueuePolicy shop/orders");
        assert!(f.message.starts_with("minAttached 3 is more than the 2 replicas of Deployment 'worker': the gate can never count 3 consumers attached (ConsumersAttached stays TooFewAttached), and the PodDisruptionBudget the operator keeps for it can ask only minAvailable 1 (one fewer than its replicas, so a node drain can evict), so a drain takes it below minAttached"), "{}", f.message);
        // Without the PDB, the gate clause alone.
        let f = only(
            &text.replace("  consumers:", "  gate: {podDisruptionBudget: false}\n  consumers:"),
            Rule::MinAttachedExceedsReplicas,
        );
        assert!(!f.message.contains("PodDisruptionBudget"), "{}", f.message);
        // Passing: minAttached 1 of 2 replicas.
        assert_eq!(found(&(guarding("") + &worker())), vec![]);
    }

    #[test]
    fn qg009_a_scaled_to_zero_consumer_lets_a_queue_without_keep_alive_expire() {
        let zero = deployment("worker", "  replicas: 0\n", GATE);
        let text = policy("orders", "{name: orders, keepAlive: false}", "  consumers: {deployment: worker}\n") + &zero;
        let f = only(&text, Rule::ScaledToZeroQueueExpires);
        assert!(f.message.starts_with("its consumer Deployment 'worker' is scaled to 0 replicas and keepAlive is false: with no consumer and no declares the broker deletes queue 'orders' 30m after it goes idle"), "{}", f.message);
        // Passing: keepAlive renews the lease, or the Deployment runs.
        assert_eq!(found(&text.replace(", keepAlive: false", "")), vec![]);
        assert_eq!(found(&text.replace("replicas: 0", "replicas: 2")), vec![]);
    }

    #[test]
    fn qg010_a_budget_lowered_to_let_drains_evict_leaves_fewer_than_min_attached() {
        let single = deployment("worker", "  replicas: 1\n", GATE);
        let f = only(&(guarding("") + &single), Rule::DisruptionBudgetBlocksDrains);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Warning, "QueuePolicy shop/orders".into()));
        assert!(
            f.message.contains("the operator keeps it at minAvailable 0, and a drain")
                && !f.message.contains("allows no eviction at all"),
            "the budget never blocks a drain: {}",
            f.message
        );
        // Passing: no PDB, Observe mode (no PDB either; the gate is then removed), or 2 replicas.
        assert_eq!(found(&(guarding("  gate: {podDisruptionBudget: false}\n") + &single)), vec![]);
        assert_eq!(found(&(guarding("  gate: {mode: Observe}\n") + &single.replace(GATE, ""))), vec![]);
        assert_eq!(found(&(guarding("") + &worker())), vec![]);
    }

    #[test]
    fn qg011_two_policies_for_one_queue_on_one_broker() {
        let text = policy("orders", "{name: orders}", "") + &policy("orders-again", "{name: orders}", "");
        let f = only(&text, Rule::DuplicateQueue);
        assert_eq!(f.object.to_string(), "QueuePolicy shop/orders-again");
        assert!(
            f.message.starts_with(
                "it declares queue 'orders' on the same broker as QueuePolicy 'orders' (Secret 'rabbitmq')"
            ),
            "{}",
            f.message
        );
        let elsewhere = policy("orders", "{name: orders}", "")
            + &policy("orders-again", "{name: orders}", "").replace("namespace: shop", "namespace: web");
        assert_eq!(found(&elsewhere), vec![]);
    }

    #[test]
    fn qg012_a_pattern_without_a_leading_caret_matches_anywhere_in_a_name() {
        let f = only(&queue_pattern("replies", "rpc\\.reply\\.", "  expires: 5m\n"), Rule::UnanchoredPattern);
        assert_eq!((f.severity, f.object.to_string()), (Severity::Warning, "QueuePattern shop/replies".into()));
        assert!(
            f.message.starts_with("its pattern 'rpc\\.reply\\.' does not start with ^, so it matches anywhere in a queue name: its broker policy gives expires 5m to every queue on the broker whose name merely contains a match"),
            "{}",
            f.message
        );
        assert!(f.message.contains("for example '^rpc\\.reply\\.'"), "{}", f.message);
        let limited = queue_pattern("replies", "reply", "  maxLength: 10\n  deadLetterExchange: replies.dlx\n");
        let f = only(&limited, Rule::UnanchoredPattern);
        assert!(
            f.message.contains("gives expires 10m (and its dead-letter-exchange, max-length) to every queue"),
            "{}",
            f.message
        );
        // Passing: anchored, even though it also matches a QueuePolicy's own queue: that
        // QueuePolicy's policy (priority 100) wins there.
        let anchored = queue_pattern("replies", "^rpc\\.reply\\.", "");
        assert_eq!(found(&anchored), vec![]);
        let own_queue = policy("reply", "{name: rpc.reply.main, deadLetter: {queue: parking}}", "");
        assert_eq!(found(&(own_queue + &anchored)), vec![]);
    }

    #[test]
    fn findings_come_in_input_order_then_by_rule() {
        let bare = deployment("worker", "  replicas: 1\n  strategy: {type: Recreate}\n", "");
        let text = bare + &guarding("  gate: {manageStrategy: false}\n");
        assert_eq!(
            found(&text),
            vec![
                ("QG002", "Deployment shop/worker".into()),
                ("QG003", "Deployment shop/worker".into()),
                ("QG010", "QueuePolicy shop/orders".into())
            ]
        );
    }

    #[test]
    fn a_classic_queue_on_a_secret_naming_several_nodes_is_warned_about_and_a_quorum_queue_is_not() {
        let secret = |data: &str| {
            format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: rabbitmq, namespace: shop}}\n{data}\n---\n")
        };
        let three =
            secret("stringData: {uri: 'amqp://u:hunter2@rabbitmq/', addresses: 'rmq-0:5672, rmq-1:5672,rmq-2:5672'}");
        let classic = policy("orders", "{name: orders}", "");
        let f = only(&(three.clone() + &classic), Rule::ClassicQueueOnCluster);
        assert_eq!(f.object.to_string(), "QueuePolicy shop/orders");
        assert!(f.message.contains("names 3 broker nodes (rmq-0:5672, rmq-1:5672, rmq-2:5672)"), "{}", f.message);
        assert!(
            f.message.contains("queue.type: quorum and queue.onChange: Migrate")
                && f.message.contains("rabbitmq_event_exchange")
        );
        let migrating = policy("orders", "{name: orders, onChange: Migrate}", "");
        let f = only(&(three.clone() + &migrating), Rule::ClassicQueueOnCluster);
        assert!(f.message.contains("set queue.type: quorum: onChange: Migrate moves the queue live"), "{}", f.message);
        assert!(!f.message.contains("hunter2"), "nothing of the URI is read");
        // The same from base64 data.
        let encoded = secret("data: {addresses: cm1xLTA6NTY3MixybXEtMTo1Njcy}");
        assert_eq!(found(&(encoded + &classic)), vec![("QG013", "QueuePolicy shop/orders".into())]);

        let quorum = policy("orders", "{name: orders, type: quorum}", "");
        assert!(found(&(three.clone() + &quorum)).is_empty());
        let one = secret("stringData: {uri: 'amqp://u:p@rabbitmq/', addresses: 'rmq-lb:5672'}");
        assert!(found(&(one + &classic)).is_empty(), "one address: a single node or a load balancer");
        let elsewhere = three.replace("namespace: shop", "namespace: other");
        assert!(found(&(elsewhere + &classic)).is_empty(), "another namespace's Secret");
    }
}
