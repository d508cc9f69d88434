//! Prometheus metrics: what `/metrics` serves. Reconciles, queue depths, gate state and gate
//! waits per policy; broker connection state per endpoint; leadership.

use crate::sync::lock;
use crate::{crd::RolloutPhase, status::Outcome};
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{MetricType, TypedMetric, counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Metric, Registry},
};
use std::{
    collections::{HashMap, HashSet},
    sync::Mutex,
    time::Duration,
};
use strum::VariantArray;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub namespace: String,
    pub policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    namespace: String,
    policy: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    namespace: String,
    policy: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    namespace: String,
    policy: String,
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FindingLabels {
    namespace: String,
    policy: String,
    finding: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PatternLabels {
    namespace: String,
    pattern: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PatternFindingLabels {
    namespace: String,
    pattern: String,
    finding: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    namespace: String,
    policy: String,
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BrokerLabels {
    broker: String,
    /// `declarations` (what the reconciles use) or `events` (the consumer tracker's).
    connection: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrackerLabels {
    broker: String,
    /// What is counted: `connections`, `channels`, `consumers`, `bookkeeping`, `vhosts`, `queues`.
    kind: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every metric the operator exports, in one registry.
pub struct Metrics {
    registry: Registry,
    /// The sample names of every family, as Prometheus stores them.
    names: Vec<String>,
    reconciles: Family<ResultLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: HistogramFamily<PolicyLabels>,
    messages_ready: Family<QueueLabels, Gauge>,
    messages_unacked: Family<QueueLabels, Gauge>,
    consumers: Family<QueueLabels, Gauge>,
    dead_letter_ready: Family<QueueLabels, Gauge>,
    attached: Family<PolicyLabels, Gauge>,
    expected: Family<PolicyLabels, Gauge>,
    waiting: Family<PolicyLabels, Gauge>,
    rollout_phase: Family<PhaseLabels, Gauge>,
    gate_wait: HistogramFamily<PolicyLabels>,
    findings: Family<FindingLabels, Gauge>,
    migration_moved: Family<PolicyLabels, Counter>,
    migration_started: Family<PolicyLabels, Gauge>,
    pattern_queues: Family<PatternLabels, Gauge>,
    pattern_orphaned: Family<PatternLabels, Gauge>,
    pattern_created: Family<PatternLabels, Counter>,
    pattern_deleted: Family<PatternLabels, Counter>,
    pattern_findings: Family<PatternFindingLabels, Gauge>,
    broker_up: Family<BrokerLabels, Gauge>,
    tracker_entries: Family<TrackerLabels, Gauge>,
    leader: Gauge,
    /// The queue series of each policy, removed with it.
    queues: Mutex<HashMap<PolicyLabels, HashSet<QueueLabels>>>,
    /// The error kinds counted for each policy or pattern, removed with it.
    error_kinds: Mutex<HashMap<PolicyLabels, HashSet<&'static str>>>,
}

fn reconcile_buckets() -> Histogram {
    Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
}

fn gate_wait_buckets() -> Histogram {
    Histogram::new([0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0])
}

fn phase_labels(policy: &PolicyLabels, phase: RolloutPhase) -> PhaseLabels {
    PhaseLabels { namespace: policy.namespace.clone(), policy: policy.policy.clone(), phase: phase.into() }
}

/// The registry being filled, and the sample names of what is in it.
struct Families {
    registry: Registry,
    names: Vec<String>,
}

impl Families {
    fn add<M: Metric + TypedMetric + Clone>(&mut self, name: &str, help: &str, metric: &M) {
        self.registry.register(name, help, metric.clone());
        let name = format!("queueguard_{name}");
        match M::TYPE {
            MetricType::Counter => self.names.push(format!("{name}_total")),
            MetricType::Histogram => self.names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}"))),
            _ => self.names.push(name),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut families = Families { registry: Registry::with_prefix("queueguard"), names: Vec::new() };
        let reconciles = Family::default();
        families.add("reconcile", "Reconciles of a QueuePolicy, by result (ok, error)", &reconciles);
        let errors = Family::default();
        families.add("reconcile_errors", "Failed reconciles, by kind of error", &errors);
        let duration: HistogramFamily<PolicyLabels> = Family::new_with_constructor(reconcile_buckets);
        families.add("reconcile_duration_seconds", "Time one reconcile took", &duration);
        let messages_ready = Family::default();
        families.add("queue_messages_ready", "Messages ready on the policy's queue", &messages_ready);
        let messages_unacked = Family::default();
        families.add(
            "queue_messages_unacknowledged",
            "Messages delivered and not yet acknowledged on the policy's queue",
            &messages_unacked,
        );
        let consumers = Family::default();
        families.add("queue_consumers", "Consumers on the policy's queue", &consumers);
        let dead_letter_ready = Family::default();
        families.add(
            "dead_letter_messages_ready",
            "Messages waiting in the policy's dead-letter queue",
            &dead_letter_ready,
        );
        let attached = Family::default();
        families.add("gate_consumers_attached", "Consumer pods whose consumer is attached", &attached);
        let expected = Family::default();
        families.add("gate_consumers_expected", "Consumer pods the gate expects", &expected);
        let waiting = Family::default();
        families.add("gate_pods_waiting", "Pods held back by the gate right now", &waiting);
        let rollout_phase = Family::default();
        families.add("rollout_phase", "1 for the phase the policy's rollout is in (Idle, Progressing, WaitingForAttach, Stalled), 0 for the others", &rollout_phase);
        let gate_wait: HistogramFamily<PolicyLabels> = Family::new_with_constructor(gate_wait_buckets);
        families.add(
            "gate_wait_seconds",
            "Time from a pod's gate closing (containers ready, or its consumer left) to it opening",
            &gate_wait,
        );
        let findings = Family::default();
        families.add(
            "finding",
            "1 while a consumer hygiene finding (label finding) is seen on the policy's queue",
            &findings,
        );
        let migration_moved = Family::default();
        families.add(
            "migration_messages_moved",
            "Messages a live queue migration moved (out to the holding queue and back), each with a publisher confirm",
            &migration_moved,
        );
        let migration_started = Family::default();
        families.add(
            "migration_started_timestamp_seconds",
            "When the policy's queue migration under way started (Unix seconds); no series when none is",
            &migration_started,
        );
        let pattern_queues = Family::default();
        families.add("pattern_queues", "Queues matching a QueuePattern", &pattern_queues);
        let pattern_orphaned = Family::default();
        families.add(
            "pattern_orphaned_queues",
            "Queues matching a QueuePattern that hold ready messages and have no consumer",
            &pattern_orphaned,
        );
        let pattern_created = Family::default();
        families.add("pattern_queues_created", "Matching queues seen appearing (churn)", &pattern_created);
        let pattern_deleted = Family::default();
        families.add("pattern_queues_deleted", "Matching queues seen going away (churn)", &pattern_deleted);
        let pattern_findings = Family::default();
        families.add("pattern_finding", "1 while a QueuePattern finding (label finding) is seen", &pattern_findings);
        let broker_up = Family::default();
        families.add("broker_connection_up", "1 while the AMQP connection to the broker is open", &broker_up);
        let tracker_entries = Family::default();
        families.add(
            "tracker_entries",
            "What a consumer tracker holds (label kind): it follows the queues policies name, not the broker's size",
            &tracker_entries,
        );
        let leader = Gauge::default();
        families.add("leader", "1 while this replica holds the leader lease", &leader);
        Self {
            registry: families.registry,
            names: families.names,
            reconciles,
            errors,
            duration,
            messages_ready,
            messages_unacked,
            consumers,
            dead_letter_ready,
            attached,
            expected,
            waiting,
            rollout_phase,
            gate_wait,
            findings,
            migration_moved,
            migration_started,
            pattern_queues,
            pattern_orphaned,
            pattern_created,
            pattern_deleted,
            pattern_findings,
            broker_up,
            tracker_entries,
            leader,
            queues: Mutex::default(),
            error_kinds: Mutex::default(),
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, policy: &PolicyLabels, took: Duration, error: Option<&'static str>) {
        let PolicyLabels { namespace, policy: name } = policy.clone();
        let result = if error.is_some() { "error" } else { "ok" };
        self.reconciles
            .get_or_create(&ResultLabels { namespace: namespace.clone(), policy: name.clone(), result })
            .inc();
        if let Some(kind) = error {
            self.errors.get_or_create(&ErrorLabels { namespace, policy: name, kind }).inc();
            lock(&self.error_kinds).entry(policy.clone()).or_default().insert(kind);
        }
        self.duration.get_or_create(policy).observe(took.as_secs_f64());
    }

    /// The reconcile counts and durations of a policy or pattern that is gone.
    fn forget_reconciles(&self, policy: &PolicyLabels) {
        let PolicyLabels { namespace, policy: name } = policy.clone();
        for result in ["ok", "error"] {
            self.reconciles.remove(&ResultLabels { namespace: namespace.clone(), policy: name.clone(), result });
        }
        let kinds = lock(&self.error_kinds).remove(policy).unwrap_or_default();
        for kind in kinds {
            self.errors.remove(&ErrorLabels { namespace: namespace.clone(), policy: name.clone(), kind });
        }
        self.duration.remove(policy);
    }

    /// The queue counts and gate state one reconcile saw; what it could not see is left as it was.
    pub fn record_outcome(&self, policy: &PolicyLabels, outcome: &Outcome) {
        if let Some(q) = &outcome.queue_observation {
            let labels = self.queue_labels(policy, &q.name);
            set_opt(&self.messages_ready, &labels, q.messages_ready);
            set_opt(&self.messages_unacked, &labels, q.messages_unacknowledged);
            set_opt(&self.consumers, &labels, q.consumers);
        }
        if let Some(dl) = &outcome.dead_letter_observation {
            set_opt(&self.dead_letter_ready, &self.queue_labels(policy, &dl.queue), dl.messages_ready);
        }
        if let Some(report) = &outcome.findings {
            for f in crate::crd::Finding::ALL {
                let labels = FindingLabels {
                    namespace: policy.namespace.clone(),
                    policy: policy.policy.clone(),
                    finding: f.as_str(),
                };
                match report.verdicts.iter().find(|v| v.finding == f) {
                    Some(v) => drop(self.findings.get_or_create(&labels).set(v.seen.is_some().into())),
                    // Silenced: no series.
                    None => drop(self.findings.remove(&labels)),
                }
            }
        }
        match &outcome.gate {
            Some(gate) => {
                self.attached.get_or_create(policy).set(gate.consumers.attached.into());
                self.expected.get_or_create(policy).set(gate.consumers.expected.into());
                self.waiting.get_or_create(policy).set(gate.rollout.waiting_pods.len() as i64);
                for &phase in RolloutPhase::VARIANTS {
                    self.rollout_phase
                        .get_or_create(&phase_labels(policy, phase))
                        .set((gate.rollout.phase == phase).into());
                }
            }
            // No gate any more (spec.consumers removed, or the spec invalid): its last values
            // must not keep an alert firing.
            None => self.forget_gate(policy),
        }
    }

    pub fn gate_opened(&self, policy: &PolicyLabels, waited: Duration) {
        self.gate_wait.get_or_create(policy).observe(waited.as_secs_f64());
    }

    fn forget_gate(&self, policy: &PolicyLabels) {
        for family in [&self.attached, &self.expected, &self.waiting] {
            family.remove(policy);
        }
        for &phase in RolloutPhase::VARIANTS {
            self.rollout_phase.remove(&phase_labels(policy, phase));
        }
    }

    /// A deleted policy's series go with it.
    /// A migration's recorded state: the messages moved since the state before (`before`), and
    /// its start while it is under way.
    pub fn record_migration(
        &self,
        policy: &PolicyLabels,
        before: Option<&crate::crd::MigrationStatus>,
        now: &crate::crd::MigrationStatus,
    ) {
        let moved = |m: &crate::crd::MigrationStatus| m.moved_out + m.moved_back;
        let earlier = before.filter(|b| b.queue == now.queue && b.started_at == now.started_at).map_or(0, moved);
        if let Ok(more) = u64::try_from(moved(now) - earlier)
            && more > 0
        {
            self.migration_moved.get_or_create(policy).inc_by(more);
        }
        match now.started_at.as_ref().filter(|_| now.phase < crate::crd::MigrationPhase::Completed) {
            Some(at) => drop(self.migration_started.get_or_create(policy).set(at.0.as_second())),
            None => drop(self.migration_started.remove(policy)),
        }
    }

    pub fn forget(&self, policy: &PolicyLabels) {
        self.migration_started.remove(policy);
        self.migration_moved.remove(policy);
        self.forget_gate(policy);
        self.forget_reconciles(policy);
        self.gate_wait.remove(policy);
        for f in crate::crd::Finding::ALL {
            let labels = FindingLabels {
                namespace: policy.namespace.clone(),
                policy: policy.policy.clone(),
                finding: f.as_str(),
            };
            self.findings.remove(&labels);
        }
        let queues = lock(&self.queues).remove(policy).unwrap_or_default();
        for labels in &queues {
            for family in [&self.messages_ready, &self.messages_unacked, &self.consumers, &self.dead_letter_ready] {
                family.remove(labels);
            }
        }
    }

    pub fn record_pattern(&self, pattern: &PolicyLabels, report: &crate::pattern::WatchReport) {
        let labels = PatternLabels { namespace: pattern.namespace.clone(), pattern: pattern.policy.clone() };
        self.pattern_queues.get_or_create(&labels).set(report.queues.matching);
        self.pattern_orphaned.get_or_create(&labels).set(report.queues.orphaned);
        self.pattern_created.get_or_create(&labels).inc_by(report.queues.created.unsigned_abs());
        self.pattern_deleted.get_or_create(&labels).inc_by(report.queues.deleted.unsigned_abs());
        for f in crate::pattern::crd::PatternFinding::ALL {
            let l = PatternFindingLabels {
                namespace: labels.namespace.clone(),
                pattern: labels.pattern.clone(),
                finding: f.as_str(),
            };
            match report.verdicts.iter().find(|(v, _)| *v == f) {
                Some((_, seen)) => drop(self.pattern_findings.get_or_create(&l).set(seen.is_some().into())),
                None => drop(self.pattern_findings.remove(&l)),
            }
        }
    }

    pub fn forget_pattern(&self, pattern: &PolicyLabels) {
        self.forget_reconciles(pattern);
        let labels = PatternLabels { namespace: pattern.namespace.clone(), pattern: pattern.policy.clone() };
        for family in [&self.pattern_queues, &self.pattern_orphaned] {
            family.remove(&labels);
        }
        self.pattern_created.remove(&labels);
        self.pattern_deleted.remove(&labels);
        for f in crate::pattern::crd::PatternFinding::ALL {
            let l = PatternFindingLabels {
                namespace: labels.namespace.clone(),
                pattern: labels.pattern.clone(),
                finding: f.as_str(),
            };
            self.pattern_findings.remove(&l);
        }
    }

    /// The connections as they are now: one series per broker address and purpose
    /// (`declarations`, `events`); connections let go of lose theirs.
    pub fn broker_connections(&self, declarations: &[(String, bool)], events: &[(String, bool)]) {
        self.broker_up.clear();
        for (connection, states) in [("declarations", declarations), ("events", events)] {
            for (broker, up) in states {
                let labels = BrokerLabels { broker: broker.clone(), connection };
                self.broker_up.get_or_create(&labels).set((*up).into());
            }
        }
    }

    /// What each broker's consumer tracker holds now.
    pub fn tracker_entries(&self, trackers: &[(String, Vec<(&'static str, usize)>)]) {
        self.tracker_entries.clear();
        for (broker, counts) in trackers {
            for (kind, n) in counts {
                let labels = TrackerLabels { broker: broker.clone(), kind };
                self.tracker_entries.get_or_create(&labels).set(*n as i64);
            }
        }
    }

    pub fn leading(&self, leader: bool) {
        self.leader.set(leader.into());
    }

    /// Every sample name the operator exports, as Prometheus stores it (`_total` on counters,
    /// `_bucket`, `_sum` and `_count` of histograms), whether or not it has series yet: a family
    /// without series has no line in the exposition at all.
    pub fn sample_names(&self) -> &[String] {
        &self.names
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    fn queue_labels(&self, policy: &PolicyLabels, queue: &str) -> QueueLabels {
        let labels =
            QueueLabels { namespace: policy.namespace.clone(), policy: policy.policy.clone(), queue: queue.to_owned() };
        lock(&self.queues).entry(policy.clone()).or_default().insert(labels.clone());
        labels
    }
}

fn set_opt(family: &Family<QueueLabels, Gauge>, labels: &QueueLabels, value: Option<i64>) {
    if let Some(v) = value {
        family.get_or_create(labels).set(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        crd::{ConsumersObservation, DeadLetterObservation, QueueObservation, RolloutObservation},
        status::{Check, GateReport, Reason},
    };

    fn labels() -> PolicyLabels {
        PolicyLabels { namespace: "shop".into(), policy: "orders".into() }
    }

    fn line<'a>(text: &'a str, prefix: &str) -> &'a str {
        text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no line {prefix} in\n{text}"))
    }

    #[test]
    fn reconciles_and_errors_are_counted_per_policy() {
        let m = Metrics::default();
        m.reconciled(&labels(), Duration::from_millis(20), None);
        m.reconciled(&labels(), Duration::from_millis(30), None);
        m.reconciled(&labels(), Duration::from_millis(5), Some("kube"));
        let text = m.render();
        assert_eq!(
            line(&text, r#"queueguard_reconcile_total{namespace="shop",policy="orders",result="ok"}"#)
                .rsplit(' ')
                .next(),
            Some("2")
        );
        assert!(text.contains(r#"queueguard_reconcile_errors_total{namespace="shop",policy="orders",kind="kube"} 1"#));
        assert!(text.contains(r#"queueguard_reconcile_duration_seconds_count{namespace="shop",policy="orders"} 3"#));
        assert!(text.trim_end().ends_with("# EOF"), "OpenMetrics text ends with # EOF");
    }

    #[test]
    fn queue_depths_follow_the_latest_observation_and_go_with_the_policy() {
        let m = Metrics::default();
        m.reconciled(&labels(), Duration::from_millis(20), None);
        m.reconciled(&labels(), Duration::from_millis(20), Some("kube"));
        let mut outcome = Outcome::blocked(Check::failed(Reason::BrokerUnreachable, "down"));
        outcome.queue_observation = Some(QueueObservation {
            name: "orders".into(),
            vhost: "/".into(),
            messages_ready: Some(12),
            messages_unacknowledged: Some(3),
            consumers: Some(2),
        });
        outcome.dead_letter_observation = Some(DeadLetterObservation {
            exchange: "orders.dlx".into(),
            queue: "orders.dlq".into(),
            messages_ready: Some(7),
        });
        m.record_outcome(&labels(), &outcome);
        m.gate_opened(&labels(), Duration::from_millis(800));
        m.broker_connections(&[("amqp://old:5672/%2F".into(), false)], &[]);
        m.broker_connections(
            &[("amqp://rabbitmq:5672/%2F".into(), true)],
            &[("amqp://rabbitmq:5672/%2F".into(), true)],
        );
        m.leading(true);
        let text = m.render();
        for expected in [
            r#"queueguard_queue_messages_ready{namespace="shop",policy="orders",queue="orders"} 12"#,
            r#"queueguard_queue_messages_unacknowledged{namespace="shop",policy="orders",queue="orders"} 3"#,
            r#"queueguard_queue_consumers{namespace="shop",policy="orders",queue="orders"} 2"#,
            r#"queueguard_dead_letter_messages_ready{namespace="shop",policy="orders",queue="orders.dlq"} 7"#,
            r#"queueguard_gate_wait_seconds_bucket{le="1.0",namespace="shop",policy="orders"} 1"#,
            r#"queueguard_broker_connection_up{broker="amqp://rabbitmq:5672/%2F",connection="declarations"} 1"#,
            r#"queueguard_broker_connection_up{broker="amqp://rabbitmq:5672/%2F",connection="events"} 1"#,
            "queueguard_leader 1",
        ] {
            assert!(text.contains(expected), "missing {expected} in\n{text}");
        }
        m.forget(&labels());
        let text = m.render();
        assert!(!text.contains(r#"policy="orders""#), "a deleted policy's series are gone:\n{text}");
        assert!(!text.contains("amqp://old"), "a connection let go of has no series:\n{text}");
    }

    #[test]
    fn every_sample_rendered_has_its_name_among_the_sample_names() {
        let m = Metrics::default();
        m.reconciled(&labels(), Duration::from_millis(20), Some("kube"));
        m.gate_opened(&labels(), Duration::from_millis(800));
        m.broker_connections(&[("amqp://rabbitmq:5672/%2F".into(), true)], &[]);
        let text = m.render();
        let rendered: HashSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split(['{', ' ']).next().unwrap())
            .collect();
        assert!(rendered.len() >= 7, "{rendered:?}");
        for name in rendered {
            assert!(m.sample_names().iter().any(|n| n == name), "{name} is not in {:?}", m.sample_names());
        }
        assert!(m.sample_names().iter().any(|n| n == "queueguard_pattern_queues_deleted_total"), "with no series yet");
    }

    #[test]
    fn the_rollout_phase_is_one_series_at_one_among_zeros_and_goes_with_the_policy() {
        let m = Metrics::default();
        let mut outcome = Outcome::blocked(Check::ok(Reason::Declared, "ok"));
        outcome.gate = Some(GateReport {
            consumers_attached: Check::ok(Reason::Declared, "ok"),
            rollout_safe: Check::ok(Reason::Declared, "ok"),
            consumers: ConsumersObservation { attached: 1, expected: 2, ..Default::default() },
            rollout: RolloutObservation { phase: RolloutPhase::Stalled, waiting_pods: vec![Default::default()] },
            budgets: vec![],
        });
        m.record_outcome(&labels(), &outcome);
        let text = m.render();
        let phase = |p: &str| {
            line(&text, &format!(r#"queueguard_rollout_phase{{namespace="shop",policy="orders",phase="{p}"}}"#))
                .to_owned()
        };
        assert!(phase("Stalled").ends_with(" 1"));
        for other in ["Idle", "Progressing", "WaitingForAttach"] {
            assert!(phase(other).ends_with(" 0"), "{}", phase(other));
        }
        assert!(text.contains(r#"queueguard_gate_pods_waiting{namespace="shop",policy="orders"} 1"#));
        // spec.consumers removed: the next pass has no gate, and the Stalled series goes.
        m.record_outcome(&labels(), &Outcome::blocked(Check::ok(Reason::Declared, "ok")));
        let text = m.render();
        assert!(!text.contains("queueguard_rollout_phase{") && !text.contains("queueguard_gate_pods"), "{text}");
        m.record_outcome(&labels(), &outcome);
        m.forget(&labels());
        assert!(!m.render().contains("queueguard_rollout_phase{"), "a deleted policy's phases are gone");
    }
}
