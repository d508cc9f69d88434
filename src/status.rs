//! Conditions and status: the vocabulary (condition types, reasons) and the pure function from a
//! reconcile [`Outcome`] and the previous status to the next one.

use crate::crd::{
    Binding, ConsumersObservation, DeadLetterObservation, DisruptionBudgetObservation, Finding, MigrationPhase,
    MigrationStatus, PrefetchObservation, QueueObservation, QueuePolicyStatus, RolloutObservation,
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};

/// Condition types of a QueuePolicy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
pub enum ConditionType {
    /// Everything below is True: the queue is safe as specified.
    Ready,
    /// The queue exists, durable, with the declared arguments and bindings.
    QueueDeclared,
    /// The dead-letter exchange and queue exist and are bound.
    DeadLetterReady,
    /// Expiry, dead-lettering and limits are in effect (by policy or by arguments).
    SettingsApplied,
    /// At least minAttached consumer pods have a consumer attached.
    ConsumersAttached,
    /// Rollouts of the consumer Deployment are gated: safe strategy, readiness gates in place.
    RolloutSafe,
    /// A live migration of the queue to a new shape is under way (onChange: Migrate).
    Migrating,
}

impl ConditionType {
    pub const ALL: [ConditionType; 4] =
        [Self::Ready, Self::QueueDeclared, Self::DeadLetterReady, Self::SettingsApplied];

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Machine-readable reasons, shared by conditions and Events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::EnumString)]
pub enum Reason {
    Reconciled,
    Declared,
    PolicyApplied,
    ArgumentsApplied,
    ArgumentsConflict,
    ExchangeNotFound,
    QueueNotFound,
    QueueNotDeclared,
    AccessRefused,
    BrokerRefused,
    BrokerUnreachable,
    PolicyShadowed,
    PolicyRejected,
    SecretNotFound,
    SecretKeyMissing,
    InvalidBrokerUri,
    RabbitmqClusterNotFound,
    RabbitmqClusterNotReady,
    ClusterReferenceNotAllowed,
    ManagedElsewhere,
    Adopted,
    InvalidSpec,
    DeletionBlocked,
    QueueDeleted,
    QueueRetained,
    QueueRecreated,
    Attached,
    TooFewAttached,
    ScaledToZero,
    RolloutGuarded,
    UnsafeRolloutStrategy,
    GateNotInstalled,
    WorkloadNotFound,
    Migrating,
    MigrationCompleted,
    MigrationRefused,
    MigrationFailed,
    MigrationRolledBack,
    MigrationConsumersMissing,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// A condition's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::EnumString)]
pub enum Truth {
    True,
    False,
    Unknown,
}

impl Truth {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// A condition's status as read; anything unrecognised is Unknown.
    pub fn of(status: &str) -> Self {
        status.parse().unwrap_or(Self::Unknown)
    }
}

impl From<bool> for Truth {
    fn from(holds: bool) -> Self {
        if holds { Self::True } else { Self::False }
    }
}

/// One step's verdict: becomes one condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub status: Truth,
    pub reason: Reason,
    pub message: String,
}

impl Check {
    pub fn ok(reason: Reason, message: impl Into<String>) -> Self {
        Self { status: Truth::True, reason, message: message.into() }
    }

    pub fn failed(reason: Reason, message: impl Into<String>) -> Self {
        Self { status: Truth::False, reason, message: message.into() }
    }

    pub fn unknown(reason: Reason, message: impl Into<String>) -> Self {
        Self { status: Truth::Unknown, reason, message: message.into() }
    }

    pub fn is_ok(&self) -> bool {
        self.status == Truth::True
    }
}

/// What one reconcile found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub queue: Check,
    pub dead_letter: Check,
    pub settings: Check,
    /// Fresh observations; None keeps the previous status's (the broker could not be asked).
    pub queue_observation: Option<QueueObservation>,
    pub dead_letter_observation: Option<DeadLetterObservation>,
    pub broker_policy: Option<String>,
    /// None keeps the previous list (nothing was bound or unbound).
    pub applied_bindings: Option<Vec<Binding>>,
    /// The rollout gate's verdicts, for policies with spec.consumers.
    pub gate: Option<GateReport>,
    /// Consumer hygiene; None keeps the previous findings (not looked at this pass).
    pub findings: Option<crate::findings::Report>,
    /// A live migration's state; None keeps the previous one.
    pub migration: Option<MigrationStatus>,
}

/// What the rollout gate reports into status.
#[derive(Debug, Clone, PartialEq)]
pub struct GateReport {
    pub consumers_attached: Check,
    pub rollout_safe: Check,
    pub consumers: ConsumersObservation,
    pub rollout: RolloutObservation,
    pub budgets: Vec<DisruptionBudgetObservation>,
}

impl Outcome {
    /// Nothing reached the broker: every condition carries the same verdict.
    pub fn blocked(check: Check) -> Self {
        Self {
            queue: check.clone(),
            dead_letter: check.clone(),
            settings: check,
            queue_observation: None,
            dead_letter_observation: None,
            broker_policy: None,
            applied_bindings: None,
            gate: None,
            findings: None,
            migration: None,
        }
    }

    /// The checks Ready depends on: the queue side, and a safe rollout when consumers are gated
    /// (not ConsumersAttached: a rollout or a scale-down is no reason to call the policy broken).
    fn essentials(&self) -> Vec<&Check> {
        let mut list = vec![&self.queue, &self.dead_letter, &self.settings];
        list.extend(self.gate.as_ref().map(|g| &g.rollout_safe));
        list
    }

    /// Ready is True when every essential step is; otherwise it carries the first failing one.
    pub fn ready(&self) -> Check {
        match self.essentials().into_iter().find(|c| !c.is_ok()) {
            None => Check::ok(Reason::Reconciled, self.summary()),
            Some(first) => Check::failed(first.reason, first.message.clone()),
        }
    }

    pub fn is_ready(&self) -> bool {
        self.essentials().iter().all(|c| c.is_ok())
    }

    fn summary(&self) -> String {
        let mut parts =
            vec![self.queue.message.clone(), self.dead_letter.message.clone(), self.settings.message.clone()];
        parts.retain(|p| !p.is_empty());
        parts.join("; ")
    }

    /// The checks by condition type, Ready first.
    pub fn checks(&self) -> Vec<(ConditionType, Check)> {
        let mut checks = vec![
            (ConditionType::Ready, self.ready()),
            (ConditionType::QueueDeclared, self.queue.clone()),
            (ConditionType::DeadLetterReady, self.dead_letter.clone()),
            (ConditionType::SettingsApplied, self.settings.clone()),
        ];
        if let Some(g) = &self.gate {
            checks.push((ConditionType::ConsumersAttached, g.consumers_attached.clone()));
            checks.push((ConditionType::RolloutSafe, g.rollout_safe.clone()));
        }
        checks
    }
}

/// The next status. Condition timestamps move only when a condition's status flips.
pub fn next_status(
    previous: Option<&QueuePolicyStatus>,
    outcome: &Outcome,
    generation: Option<i64>,
    now: Timestamp,
) -> QueuePolicyStatus {
    let old = previous.cloned().unwrap_or_default();
    let mut conditions: Vec<Condition> = outcome
        .checks()
        .into_iter()
        .map(|(kind, check)| condition(&old.conditions, kind, &check, generation, now))
        .collect();
    conditions.extend(finding_conditions(&old.conditions, outcome.findings.as_ref(), generation, now));
    let migration = match (&outcome.migration, old.migration) {
        (Some(m), _) => Some(m.clone()),
        // A refusal is stated again by every pass it still applies to: a pass that declared
        // the queue without one (the spec went back, say) leaves no stale refusal behind.
        (None, Some(m)) if m.phase == MigrationPhase::Refused && outcome.queue.is_ok() => None,
        (None, old) => old,
    };
    if let Some(m) = &migration {
        conditions.push(condition(&old.conditions, ConditionType::Migrating, &migrating(m), generation, now));
    }
    QueuePolicyStatus {
        observed_generation: generation,
        conditions,
        queue: outcome.queue_observation.clone().or(old.queue),
        dead_letter: outcome.dead_letter_observation.clone().or(old.dead_letter),
        broker_policy: outcome.broker_policy.clone().or(old.broker_policy),
        applied_bindings: outcome.applied_bindings.clone().unwrap_or(old.applied_bindings),
        consumers: outcome.gate.as_ref().map(|g| g.consumers.clone()),
        rollout: outcome.gate.as_ref().map(|g| g.rollout.clone()),
        disruption_budgets: outcome.gate.as_ref().map(|g| g.budgets.clone()).unwrap_or_default(),
        prefetch: match &outcome.findings {
            Some(report) => report
                .prefetch
                .as_ref()
                .map(|p| PrefetchObservation {
                    suggested: i32::try_from(p.suggested).unwrap_or(i32::MAX),
                    processing_millis: p.processing_ms.round() as i64,
                    round_trip_millis: p.round_trip_ms.round() as i64,
                })
                .or(old.prefetch),
            None => old.prefetch,
        },
        migration,
        stats_source: outcome.findings.as_ref().map(|r| r.source).or(old.stats_source),
    }
}

/// The stored status with a migration's step recorded: its state and the Migrating condition,
/// everything else as it was (written before the step is taken).
pub fn with_migration(
    previous: Option<&QueuePolicyStatus>,
    m: &MigrationStatus,
    generation: Option<i64>,
    now: Timestamp,
) -> QueuePolicyStatus {
    let mut status = previous.cloned().unwrap_or_default();
    let migrating = condition(&status.conditions, ConditionType::Migrating, &migrating(m), generation, now);
    status.conditions.retain(|c| c.type_ != migrating.type_);
    status.conditions.push(migrating);
    status.migration = Some(m.clone());
    status
}

/// The Migrating condition: True while a migration is under way, False once it ended.
pub fn migrating(m: &MigrationStatus) -> Check {
    match m.phase {
        MigrationPhase::Completed => Check::failed(Reason::MigrationCompleted, m.message.clone()),
        MigrationPhase::Refused => Check::failed(Reason::MigrationRefused, m.message.clone()),
        MigrationPhase::RolledBack => Check::failed(Reason::MigrationRolledBack, m.message.clone()),
        phase => Check::ok(Reason::Migrating, format!("{}: {}", phase.as_str(), m.message)),
    }
}

/// One condition per finding judged, True while the habit is seen; without a fresh report the
/// previous ones stay. Silenced findings have none.
fn finding_conditions(
    old: &[Condition],
    report: Option<&crate::findings::Report>,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let Some(report) = report else {
        return old.iter().filter(|c| Finding::ALL.iter().any(|f| f.as_str() == c.type_)).cloned().collect();
    };
    report
        .verdicts
        .iter()
        .map(|v| finding_condition(old, v.finding.as_str(), v.seen.as_deref(), generation, now))
        .collect()
}

/// A finding's condition: True (reason: the finding) with why while seen, else NotSeen.
pub fn finding_condition(
    old: &[Condition],
    kind: &str,
    seen: Option<&str>,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    match seen {
        Some(why) => condition_of(old, kind, Truth::True, kind, why, generation, now),
        None => condition_of(old, kind, Truth::False, "NotSeen", "not seen at the last look", generation, now),
    }
}

fn condition(
    old: &[Condition],
    kind: ConditionType,
    check: &Check,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    condition_of(old, kind.as_str(), check.status, check.reason.as_str(), &check.message, generation, now)
}

/// A condition of any type; its lastTransitionTime moves only when its status flips.
pub fn condition_of(
    old: &[Condition],
    type_: &str,
    status: Truth,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let since = old
        .iter()
        .find(|c| c.type_ == type_ && Truth::of(&c.status) == status)
        .map_or(Time(now), |c| c.last_transition_time.clone());
    Condition {
        type_: type_.into(),
        status: status.as_str().into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// Finds a condition by type.
pub fn find(conditions: &[Condition], kind: ConditionType) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == kind.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_outcome() -> Outcome {
        Outcome {
            queue: Check::ok(Reason::Declared, "queue orders declared"),
            dead_letter: Check::ok(Reason::Declared, "dead letters go to orders.dlq"),
            settings: Check::ok(Reason::PolicyApplied, "policy applied"),
            queue_observation: Some(QueueObservation {
                name: "orders".into(),
                vhost: "/".into(),
                ..Default::default()
            }),
            dead_letter_observation: None,
            broker_policy: Some("queueguard.shop.orders".into()),
            applied_bindings: Some(vec![]),
            gate: None,
            findings: None,
            migration: None,
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn ready_summarises_when_every_step_is_true() {
        let s = next_status(None, &ok_outcome(), Some(3), at(100));
        let ready = find(&s.conditions, ConditionType::Ready).unwrap();
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("True", "Reconciled"));
        assert_eq!(ready.message, "queue orders declared; dead letters go to orders.dlq; policy applied");
        assert_eq!(ready.observed_generation, Some(3));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!(s.conditions.len(), 4);
    }

    #[test]
    fn ready_carries_the_first_failure() {
        let mut o = ok_outcome();
        o.settings = Check::failed(Reason::PolicyShadowed, "policy 'team' wins");
        o.queue = Check::failed(Reason::ArgumentsConflict, "x-expires differs");
        let s = next_status(None, &o, Some(1), at(100));
        let ready = find(&s.conditions, ConditionType::Ready).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), ready.message.as_str()),
            ("False", "ArgumentsConflict", "x-expires differs")
        );
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let first = next_status(None, &ok_outcome(), Some(1), at(100));
        let same = next_status(Some(&first), &ok_outcome(), Some(2), at(200));
        assert!(same.conditions.iter().all(|c| c.last_transition_time == Time(at(100))));
        assert!(same.conditions.iter().all(|c| c.observed_generation == Some(2)));
        let mut broken = ok_outcome();
        broken.queue = Check::failed(Reason::ArgumentsConflict, "x");
        let flipped = next_status(Some(&same), &broken, Some(2), at(300));
        let queue = find(&flipped.conditions, ConditionType::QueueDeclared).unwrap();
        assert_eq!(queue.last_transition_time, Time(at(300)));
        let dl = find(&flipped.conditions, ConditionType::DeadLetterReady).unwrap();
        assert_eq!(dl.last_transition_time, Time(at(100)));
    }

    #[test]
    fn a_refusal_goes_once_a_pass_declares_the_queue_without_it_and_a_step_under_way_stays() {
        let refused = MigrationStatus {
            phase: MigrationPhase::Refused,
            queue: "orders".into(),
            message: "quorum queues refuse reject-publish-dlx".into(),
            ..Default::default()
        };
        let mut stopped = Outcome::blocked(Check::failed(Reason::MigrationRefused, refused.message.clone()));
        stopped.migration = Some(refused.clone());
        let first = next_status(None, &stopped, Some(2), at(100));
        assert_eq!(first.migration.as_ref(), Some(&refused));
        let unreachable = Outcome::blocked(Check::unknown(Reason::BrokerUnreachable, "cannot connect"));
        let kept = next_status(Some(&first), &unreachable, Some(2), at(150));
        assert_eq!(kept.migration.as_ref(), Some(&refused), "nothing known: kept");
        let reverted = next_status(Some(&first), &ok_outcome(), Some(3), at(200));
        assert_eq!(reverted.migration, None);
        assert!(find(&reverted.conditions, ConditionType::Migrating).is_none());

        let draining = MigrationStatus { phase: MigrationPhase::Draining, ..refused };
        let under_way = QueuePolicyStatus { migration: Some(draining.clone()), ..first };
        let resumed = next_status(Some(&under_way), &ok_outcome(), Some(3), at(300));
        assert_eq!(resumed.migration, Some(draining), "a step under way is what the next pass resumes");
    }

    #[test]
    fn blocked_outcomes_keep_the_last_observations() {
        let first = next_status(None, &ok_outcome(), Some(1), at(100));
        let blocked = Outcome::blocked(Check::unknown(Reason::BrokerUnreachable, "cannot connect"));
        let s = next_status(Some(&first), &blocked, Some(1), at(200));
        assert_eq!(s.queue, first.queue);
        assert_eq!(s.broker_policy, first.broker_policy);
        let q = find(&s.conditions, ConditionType::QueueDeclared).unwrap();
        assert_eq!((q.status.as_str(), q.reason.as_str()), ("Unknown", "BrokerUnreachable"));
        let ready = find(&s.conditions, ConditionType::Ready).unwrap();
        assert_eq!(ready.status, "False");
    }

    #[test]
    fn findings_become_conditions_kept_between_looks_and_silenced_ones_vanish() {
        use crate::findings::{Report, Verdict};
        let mut outcome = ok_outcome();
        outcome.findings = Some(Report {
            verdicts: vec![
                Verdict { finding: Finding::AutoAckConsumer, seen: Some("consumer 'x' uses auto-ack".into()) },
                Verdict { finding: Finding::RequeueLoop, seen: None },
            ],
            prefetch: None,
            source: crate::crd::StatsSource::Prometheus,
        });
        let first = next_status(None, &outcome, Some(1), at(10));
        assert_eq!(
            first.stats_source,
            Some(crate::crd::StatsSource::Prometheus),
            "status says where counters came from"
        );
        let auto = first.conditions.iter().find(|c| c.type_ == "AutoAckConsumer").unwrap();
        assert_eq!((auto.status.as_str(), auto.reason.as_str()), ("True", "AutoAckConsumer"));
        let requeue = first.conditions.iter().find(|c| c.type_ == "RequeueLoop").unwrap();
        assert_eq!((requeue.status.as_str(), requeue.reason.as_str()), ("False", "NotSeen"));
        assert!(first.conditions.iter().all(|c| c.type_ != "StalledConsumers"), "not judged, no condition");
        assert_eq!(
            find(&first.conditions, ConditionType::Ready).unwrap().status,
            "True",
            "findings do not make it unready"
        );

        let between = next_status(Some(&first), &ok_outcome(), Some(1), at(20));
        let kept: Vec<_> =
            between.conditions.iter().filter(|c| c.type_ == "AutoAckConsumer" || c.type_ == "RequeueLoop").collect();
        assert_eq!(kept.len(), 2, "a pass without a look keeps the findings");
        assert_eq!(kept[0].last_transition_time, Time(at(10)));
    }
}
