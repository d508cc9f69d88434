//! The `QueuePolicy` resource (`queueguard.io/v1alpha1`), generated into `crds/queuepolicy.yaml`.
//!
//! Serde defaults here mirror the schema defaults the API server applies, so a policy read from a
//! file in local mode means the same as one read from the cluster.

use crate::duration::DurationText;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "queueguard.io";
pub const API_VERSION: &str = "queueguard.io/v1alpha1";

/// Declares one RabbitMQ queue safely (durable, never auto-delete, with an expiry safety net and a
/// dead-letter exchange and queue) and guards the rollouts of the Deployment that consumes it.
// clippy reads the repeated `type_` of printer columns as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "queueguard.io",
    version = "v1alpha1",
    kind = "QueuePolicy",
    namespaced,
    shortname = "qp",
    category = "queueguard",
    status = "QueuePolicyStatus",
    derive = "PartialEq",
    doc = "QueuePolicy declares one RabbitMQ queue safely and guards the rollouts of its consumers.",
    printcolumn(
        name = "Queue",
        type_ = "string",
        json_path = ".status.queue.name",
        description = "queue name on the broker"
    ),
    printcolumn(name = "Type", type_ = "string", json_path = ".spec.queue.type", description = "classic or quorum"),
    printcolumn(
        name = "Consumers",
        type_ = "integer",
        json_path = ".status.queue.consumers",
        description = "consumers attached to the queue"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "whether the queue is declared as specified"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.adopt) && self.adopt && has(self.deletionPolicy) && self.deletionPolicy == 'Delete')").message("adopt: true leaves the queue to its owner, so deletionPolicy must be Retain"))]
pub struct QueuePolicySpec {
    /// Where the broker is and how to log in. Immutable: pointing a policy at another broker
    /// would orphan the queue and its messages on the old one.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.broker is immutable: create a new QueuePolicy for another broker"))]
    pub broker: BrokerSpec,
    /// The queue to declare and how.
    pub queue: QueueSpec,
    /// The Deployment whose pods consume the queue; its rollouts are gated on consumers attaching.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<ConsumersSpec>,
    /// How rollouts of the consumer Deployment are gated.
    #[serde(default)]
    pub gate: GateSpec,
    /// What happens to the queue when this QueuePolicy is deleted. Retain (default) leaves it and
    /// its broker policy in place; Delete removes it only if it is empty and has no consumers.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// The queue belongs to another tool (a Messaging Topology Operator `Queue` that declares
    /// it): report on it and guard its consumers' rollouts, but never declare it or its
    /// dead-letter queue, set a broker policy on it, or delete it. Without it, a Topology
    /// Operator Queue for the same queue and vhost makes the policy stand back (ManagedElsewhere).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt: bool,
    /// Consumer hygiene findings reported on the queue, judged from live broker data.
    #[serde(default)]
    pub findings: FindingsSpec,
}

/// Broker connection: a Secret in the QueuePolicy's namespace, or a RabbitMQ Cluster Operator's
/// RabbitmqCluster (exactly one of the two).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.secretRef) != has(self.rabbitmqClusterReference)").message("spec.broker needs exactly one of secretRef and rabbitmqClusterReference"))]
pub struct BrokerSpec {
    /// Secret holding `uri` (amqp:// or amqps://user:pass@host:port/vhost) and optionally
    /// `managementUri` (http[s]://host:15672, comma-separated for a cluster; default: each AMQP
    /// host on port 15672 with the same credentials), `caCert` (PEM), `addresses` (a cluster's
    /// nodes, host:port,host:port,... in the order to try) and `prometheusUri` (rabbitmq_prometheus,
    /// http[s]://host:port per node; default: each management host on port 15692).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
    /// A RabbitmqCluster (rabbitmq.com/v1beta1) made by the RabbitMQ Cluster Operator: its
    /// default user's Secret and Service give the credentials and addresses, followed as they
    /// rotate. Another namespace's cluster only where its annotation
    /// `rabbitmq.com/topology-allowed-namespaces` lists this one (or `*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rabbitmq_cluster_reference: Option<RabbitmqClusterReference>,
    /// Virtual host of the queue. Default: the vhost in the Secret's `uri`, else `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub vhost: Option<String>,
}

/// A Secret in the QueuePolicy's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct SecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// A RabbitmqCluster, as the Messaging Topology Operator names one.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct RabbitmqClusterReference {
    /// Name of the RabbitmqCluster.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Its namespace. Default: the QueuePolicy's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
}

/// The queue and the settings that keep its messages safe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("(has(self.name) ? self.name : '') == (has(oldSelf.name) ? oldSelf.name : '')").message("spec.queue.name is immutable: renaming would orphan the old queue and its messages"),
    validation = Rule::new("!(self.type == 'quorum' && has(self.overflow) && self.overflow == 'reject-publish-dlx')").message("quorum queues do not support overflow reject-publish-dlx; use reject-publish or drop-head"),
    validation = Rule::new("!has(self.overflow) || has(self.maxLength)").message("overflow only applies together with maxLength"),
    validation = Rule::new("self.type == oldSelf.type || (has(self.onChange) && self.onChange == 'Migrate')").message("spec.queue.type can only change with onChange: Migrate: the broker cannot convert an existing queue, so queueguard moves it live")
)]
pub struct QueueSpec {
    /// Queue name on the broker. Default: the QueuePolicy's name. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    #[x_kube(validation = Rule::new("!self.startsWith('amq.')").message("queue names starting with 'amq.' are reserved by the broker"))]
    pub name: Option<String>,
    /// Queue type. The broker cannot convert a queue, so a change needs onChange: Migrate.
    #[serde(default, rename = "type")]
    pub queue_type: QueueType,
    /// What a change the broker fixes at declaration (the type, or a setting in Arguments mode)
    /// does. Refuse (default): nothing; the type cannot be changed and a changed argument is
    /// reported as a conflict. Migrate: the queue is moved live to its new shape (same name,
    /// bindings and messages) through a holding queue, and the consumers are restarted through
    /// their workload's rollout, gated as usual.
    #[serde(default)]
    pub on_change: OnChange,
    /// How expiry, dead-lettering, TTL and length limits reach the queue. Policy (default): an
    /// operator-owned RabbitMQ policy, so applications may keep declaring the queue plainly.
    /// Arguments: x- arguments at declaration, which every later declare must repeat exactly.
    #[serde(default)]
    pub settings: SettingsMode,
    /// Inactivity expiry (x-expires), the safety net instead of auto-delete: the broker deletes the
    /// queue once it has had no consumers and no declares for this long. At least 1m. Messages of
    /// an expired queue are dropped, not dead-lettered.
    #[serde(default = "default_expires")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1m')").message("expires must be at least 1m"))]
    pub expires: DurationText,
    /// Whether the operator's periodic re-declares renew the expiry lease, so the queue lives as
    /// long as this QueuePolicy. When false the operator observes through the management API only
    /// and an unused queue expires on schedule.
    #[serde(default = "default_true")]
    pub keep_alive: bool,
    /// Per-queue message TTL (x-message-ttl); expired messages are dead-lettered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_ttl: Option<DurationText>,
    /// Maximum number of ready messages (x-max-length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_length: Option<i64>,
    /// Quorum queues only: deliveries of one message before it is dead-lettered
    /// (x-delivery-limit). RabbitMQ 4.0 and later apply 20 when unset; -1 lifts the limit
    /// (4.0+), and a poison message is then redelivered for ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -1))]
    pub delivery_limit: Option<i64>,
    /// What happens when maxLength is reached (x-overflow). Default: the broker's drop-head, which
    /// dead-letters the oldest messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional_overflow")]
    pub overflow: Option<Overflow>,
    /// Dead-letter exchange and queue, declared and bound by the operator.
    #[serde(default)]
    pub dead_letter: DeadLetterSpec,
    /// Bindings from existing exchanges to the queue.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub bindings: Vec<Binding>,
}

fn default_expires() -> DurationText {
    "30m".into()
}

fn default_true() -> bool {
    true
}

/// Broker queue type, sent as x-queue-type.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema, strum::IntoStaticStr)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum QueueType {
    #[default]
    Classic,
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What a change to a queue's fixed shape (type or declared arguments) does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum OnChange {
    #[default]
    Refuse,
    Migrate,
}

/// How queue settings reach the broker.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema, strum::IntoStaticStr)]
pub enum SettingsMode {
    #[default]
    Policy,
    Arguments,
}

impl SettingsMode {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// An optional enum as the API server wants it: nullable, without `null` among the values.
fn optional_overflow(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["drop-head", "reject-publish", "reject-publish-dlx"],
        "nullable": true,
    })
}

/// Behaviour of a full queue (x-overflow).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, strum::IntoStaticStr)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum Overflow {
    DropHead,
    RejectPublish,
    RejectPublishDlx,
}

impl Overflow {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Dead-lettering: rejected, expired and overflowing messages go to this exchange, routed to
/// this queue. The dead-letter queue never expires.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSpec {
    /// Dead-letter exchange (direct, durable). Default: `<queue>.dlx`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub exchange: Option<String>,
    /// Routing key dead letters are published with (x-dead-letter-routing-key). Default: the
    /// queue name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub routing_key: Option<String>,
    /// Dead-letter queue, bound to the exchange with the routing key. Default: `<queue>.dlq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub queue: Option<String>,
}

/// A binding from an existing exchange to the queue.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Binding {
    /// Source exchange; it must already exist.
    #[schemars(length(min = 1, max = 255))]
    pub exchange: String,
    /// Routing key (pattern for topic exchanges).
    #[serde(default)]
    #[schemars(length(max = 255))]
    pub routing_key: String,
}

/// The consumers of the queue.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.deployment), has(self.workload), has(self.selector)].filter(x, x).size() == 1").message("set exactly one of consumers.deployment, consumers.workload and consumers.selector"))]
#[x_kube(validation = Rule::new("!has(self.kinds) || has(self.selector)").message("consumers.kinds goes with consumers.selector"))]
pub struct ConsumersSpec {
    /// Name of the consumer Deployment in this namespace (shorthand for workload: {kind:
    /// Deployment, name: ...}).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub deployment: Option<String>,
    /// The consumer workload in this namespace: a Deployment, a StatefulSet or an Argo Rollout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<WorkloadRef>,
    /// Label selector of the consumer workloads, instead of a name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// The kinds the selector picks from (default: all three).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kinds: Option<Vec<WorkloadKind>>,
    /// Consumers that must stay attached during a rollout.
    #[serde(default = "default_min_attached")]
    #[schemars(range(min = 1))]
    pub min_attached: i32,
    /// Seconds a consumer must stay attached before its pod counts as attached (like
    /// minReadySeconds).
    #[serde(default = "default_min_attached_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub min_attached_seconds: i32,
    /// How a broker consumer is matched to its pod: PodIP (the connection's peer address, the
    /// default) or ConnectionName (the client's connection name contains `<namespace>/<pod name>`
    /// or the pod's UID as a whole token; use it where the broker sees NAT addresses).
    #[serde(default)]
    pub match_by: MatchBy,
}

/// A workload by kind and name, in the policy's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    /// Deployment, StatefulSet or Rollout.
    pub kind: WorkloadKind,
    /// The workload's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// The kinds of workload whose rollouts the gate holds.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    JsonSchema,
    strum::IntoStaticStr,
    strum::Display,
    strum::VariantArray,
)]
pub enum WorkloadKind {
    /// apps/v1 Deployment
    Deployment,
    /// apps/v1 StatefulSet
    StatefulSet,
    /// argoproj.io/v1alpha1 Rollout (Argo Rollouts)
    Rollout,
}

fn default_min_attached() -> i32 {
    1
}

fn default_min_attached_seconds() -> i32 {
    5
}

/// How consumers are matched to pods.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum MatchBy {
    #[default]
    #[serde(rename = "PodIP")]
    PodIp,
    ConnectionName,
}

/// Rollout gating.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GateSpec {
    /// Enforce patches pod readiness conditions; Observe computes and reports only.
    #[serde(default)]
    pub mode: GateMode,
    /// Closed: while the broker is unreachable no pod is marked attached, so rollouts wait.
    /// Open: after attachTimeout the pod is marked attached anyway, with a Warning Event.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// How long a new pod may wait for its consumer before the rollout counts as stalled.
    #[serde(default = "default_attach_timeout")]
    pub attach_timeout: DurationText,
    /// Patch an unsafe Deployment strategy to a safe RollingUpdate (maxUnavailable 0, maxSurge
    /// at least 1); when false, only report it.
    #[serde(default = "default_true")]
    pub manage_strategy: bool,
    /// Maintain a PodDisruptionBudget (minAvailable: minAttached) over the consumer pods.
    #[serde(default = "default_true")]
    pub pod_disruption_budget: bool,
}

impl Default for GateSpec {
    fn default() -> Self {
        Self {
            mode: GateMode::default(),
            failure_policy: FailurePolicy::default(),
            attach_timeout: default_attach_timeout(),
            manage_strategy: true,
            pod_disruption_budget: true,
        }
    }
}

fn default_attach_timeout() -> DurationText {
    "10m".into()
}

/// Whether the gate acts or only reports.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum GateMode {
    #[default]
    Enforce,
    Observe,
}

/// What the gate does when it cannot see the broker.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum FailurePolicy {
    #[default]
    Closed,
    Open,
}

/// Which consumer hygiene findings are reported, and when a stall counts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FindingsSpec {
    /// Findings not to report for this queue (silenced): no condition, Event or metric.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 6))]
    pub ignore: Vec<Finding>,
    /// How long unacknowledged messages may sit at the consumers' prefetch limit with no ack
    /// before StalledConsumers is reported.
    #[serde(default = "default_stall_after")]
    pub stall_after: DurationText,
}

impl Default for FindingsSpec {
    fn default() -> Self {
        Self { ignore: Vec::new(), stall_after: default_stall_after() }
    }
}

fn default_stall_after() -> DurationText {
    "3m".into()
}

/// A consumer habit that loses messages or piles them up.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema, strum::IntoStaticStr)]
pub enum Finding {
    /// Unacknowledged messages sit at the consumers' prefetch limit with no acks: a hung worker.
    StalledConsumers,
    /// A consumer with prefetch 0 (unlimited).
    UnboundedPrefetch,
    /// A consumer without acknowledgements (auto-ack).
    AutoAckConsumer,
    /// Redeliveries far outpace acks: a poison message requeued forever.
    RequeueLoop,
    /// Messages wait, nobody consumes, and less than half the x-expires window is left.
    ExpiryRisk,
    /// The dead-letter queue keeps growing.
    DeadLetterGrowing,
}

impl Finding {
    pub const ALL: [Finding; 6] = [
        Self::StalledConsumers,
        Self::UnboundedPrefetch,
        Self::AutoAckConsumer,
        Self::RequeueLoop,
        Self::ExpiryRisk,
        Self::DeadLetterGrowing,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What deleting the QueuePolicy does to the queue.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum DeletionPolicy {
    #[default]
    Retain,
    Delete,
}

/// Observed state, per Kubernetes API conventions.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueuePolicyStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, QueueDeclared, DeadLetterReady, SettingsApplied and, with spec.consumers,
    /// ConsumersAttached and RolloutSafe, each with a machine-readable reason and a human message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The queue as last seen on the broker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueObservation>,
    /// The dead-letter queue as last seen on the broker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterObservation>,
    /// Name of the operator-owned RabbitMQ policy (Policy mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_policy: Option<String>,
    /// Bindings the operator has applied, so bindings removed from the spec are unbound.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_bindings: Vec<Binding>,
    /// The consumer pods and their attachment (with spec.consumers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<ConsumersObservation>,
    /// Where the consumer Deployment's rollout stands (with spec.consumers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutObservation>,
    /// The disruption budgets over the consumer pods (gate.podDisruptionBudget in Enforce mode).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disruption_budgets: Vec<DisruptionBudgetObservation>,
    /// A prefetch suggestion from the consumers' observed processing time and the round trip to
    /// the broker: (processing + round trip) / processing per consumer thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<PrefetchObservation>,
    /// The last live migration of the queue to a new shape (onChange: Migrate), recorded before
    /// each of its steps so a restarted operator resumes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationStatus>,
    /// Where the findings' counters (consumers, acks, redeliveries) come from: Management (the
    /// management API's statistics) or Prometheus (rabbitmq_prometheus's /metrics/detailed, where
    /// the broker has it, beside the management API's queues without statistics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats_source: Option<StatsSource>,
}

/// Where a queue's counters are read.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema, strum::IntoStaticStr)]
pub enum StatsSource {
    /// The management API's statistics.
    #[default]
    Management,
    /// rabbitmq_prometheus's per-object endpoint.
    Prometheus,
}

/// A live migration of a queue to a new type or declared arguments.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationStatus {
    /// The step under way (recorded before it is taken), or how it ended: Completed, Refused or
    /// RolledBack.
    pub phase: MigrationPhase,
    /// The queue being migrated (the queue, or its dead-letter queue).
    pub queue: String,
    /// Type and arguments the queue had, as `type {x-arg: value, ...}`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub from: String,
    /// Type and arguments it gets.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub to: String,
    /// The queue that holds its messages and routes meanwhile.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub holding_queue: String,
    /// Messages moved from the queue to the holding queue (with publisher confirms).
    #[serde(default)]
    pub moved_out: i64,
    /// Messages moved from the holding queue into the new queue.
    #[serde(default)]
    pub moved_back: i64,
    /// Milliseconds the queue's name had no queue (delete to declare-ok): the only time a
    /// publish to the default exchange could be unroutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_window_millis: Option<i64>,
    /// Milliseconds the queue refused publishes around the swap (its fence: a publisher with
    /// confirms got nacks and retried; one without lost what it sent then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced_millis: Option<i64>,
    /// Messages the broker reported deleted with the old queue (0 unless a publish to the
    /// default exchange raced the swap of a quorum queue, which cannot be deleted if-empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_at_swap: Option<i64>,
    /// When the operator restarted the guarded workloads, after the moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarted_at: Option<Time>,
    /// Whether the consumers were restarted through their workload's rollout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers_restarted: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// What happened, or why it cannot proceed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Steps of a migration, in order.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Default,
    JsonSchema,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
pub enum MigrationPhase {
    /// Declaring the holding queue and moving the queue's exchange bindings to it.
    #[default]
    Preparing,
    /// Moving the queue's messages into the holding queue.
    Draining,
    /// Deleting the empty queue and declaring it again with its new shape.
    Swapping,
    /// Binding the new queue as the old one was, and unbinding the holding queue.
    Restoring,
    /// Moving the held messages into the new queue, then deleting the holding queue.
    Refilling,
    /// Restarting the consumers through their workload's rollout.
    RestartingConsumers,
    Completed,
    /// It cannot proceed; nothing was touched.
    Refused,
    /// Others kept it from finishing before the swap (consumers holding deliveries, a queue
    /// that delivered nothing to the mover): routes and messages went back to the queue, which
    /// keeps its shape; the message says why. The next pass starts again.
    RolledBack,
}

impl MigrationPhase {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The prefetch suggestion and what it was computed from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrefetchObservation {
    /// Suggested prefetch_count per consumer (per worker thread of a consumer).
    pub suggested: i32,
    /// Observed time a consumer spends per message, in milliseconds.
    pub processing_millis: i64,
    /// Round trip between the operator and the broker, in milliseconds.
    pub round_trip_millis: i64,
}

/// Consumers of the queue, by pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsumersObservation {
    /// Pods whose consumer has been attached for at least minAttachedSeconds.
    pub attached: i32,
    /// Replicas of the consumer Deployment(s).
    pub expected: i32,
    /// How consumers are seen: Events (rabbitmq_event_exchange, and snapshots), Polling
    /// (management API snapshots only), Unavailable, or Starting (the first look is not done).
    pub tracking: TrackingMode,
    /// Why consumers are polled for, or cannot be seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracking_reason: Option<String>,
    /// Consumers of the queue that belong to no consumer pod (other clients, or NAT addresses:
    /// see consumers.matchBy).
    #[serde(default)]
    pub unmatched: i32,
    /// Each consumer pod's attachment and gate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodAttachment>,
}

/// One consumer pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodAttachment {
    /// Pod name.
    pub name: String,
    /// Whether a consumer from this pod is attached to the queue.
    pub attached: bool,
    /// Since when (the oldest of its consumers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// The readiness gate: Open (condition True), Closed, or NotInstalled (no readinessGate).
    pub gate: PodGate,
}

/// How the operator sees a queue's consumers.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum TrackingMode {
    /// Not yet known: the first look at the vhost has not finished.
    #[default]
    Starting,
    /// Broker events (rabbitmq_event_exchange) within milliseconds, and snapshots.
    Events,
    /// Management API snapshots only, every couple of seconds (trackingReason says why).
    Polling,
    /// Neither: the consumers cannot be seen (trackingReason says why).
    Unavailable,
}

/// A consumer pod's readiness gate.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum PodGate {
    /// The gate condition is True.
    Open,
    /// The gate condition is False or not yet written.
    #[default]
    Closed,
    /// The pod has no readinessGate for the operator's condition.
    NotInstalled,
}

/// The consumer Deployment's rollout as the gate sees it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutObservation {
    /// Idle, Progressing, WaitingForAttach (a ready pod waits for its consumer), or Stalled (one
    /// has waited longer than gate.attachTimeout).
    pub phase: RolloutPhase,
    /// Pods whose containers are ready but whose readiness gate is still closed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_pods: Vec<WaitingPod>,
}

/// Where a rollout stands.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    JsonSchema,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
pub enum RolloutPhase {
    /// Nothing to roll out, nobody waiting.
    #[default]
    Idle,
    /// The Deployment is replacing pods; none waits for its consumer.
    Progressing,
    /// A ready pod waits for its consumer.
    WaitingForAttach,
    /// A pod has waited longer than gate.attachTimeout.
    Stalled,
}

/// A pod held back by the gate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaitingPod {
    /// Pod name.
    pub name: String,
    /// Since when it waits (its containers became ready, or its consumer left).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// The queues still missing this pod's consumer, over every QueuePolicy in Enforce mode that
    /// guards it (this policy's queue, another's, or both).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_for: Vec<String>,
}

/// A PodDisruptionBudget over a guarded workload's pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DisruptionBudgetObservation {
    /// The kind of the workload whose pods it covers.
    pub kind: WorkloadKind,
    /// The workload's name.
    pub workload: String,
    /// The budget's name.
    pub name: String,
    /// Managed: the operator's (one per workload, minAvailable the strictest minAttached of
    /// the policies guarding it). Foreign: someone else's budget already selects these pods, so
    /// the operator created none (the eviction API refuses pods covered by two budgets).
    pub owner: BudgetOwner,
    /// minAvailable of the operator's budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_available: Option<i32>,
}

/// Whose a disruption budget is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum BudgetOwner {
    #[default]
    Managed,
    Foreign,
}

/// Queue facts from the broker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueueObservation {
    /// Queue name.
    pub name: String,
    /// Virtual host.
    pub vhost: String,
    /// Messages ready for delivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages_ready: Option<i64>,
    /// Messages delivered and not yet acknowledged (management API; absent until the broker has
    /// published its first statistics for the queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages_unacknowledged: Option<i64>,
    /// Consumers attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<i64>,
}

/// Dead-letter facts from the broker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterObservation {
    /// Dead-letter exchange.
    pub exchange: String,
    /// Dead-letter queue.
    pub queue: String,
    /// Messages waiting in the dead-letter queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages_ready: Option<i64>,
}

/// The CRD as YAML, exactly as committed in `crds/queuepolicy.yaml`.
pub fn crd_yaml() -> String {
    generated_yaml(&QueuePolicy::crd())
}

/// The committed form of a generated CRD.
pub fn generated_yaml(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> String {
    let body = serde_yaml_ng::to_string(crd).expect("a CRD always serialises");
    format!("# Generated by `queueguard crd`; do not edit.\n---\n{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words sent to the broker and shown in status are the ones the schema accepts.
    #[test]
    fn each_enums_text_is_its_serde_name() {
        let same = |text: &str, value: serde_json::Value| assert_eq!(serde_json::json!(text), value);
        for t in [QueueType::Classic, QueueType::Quorum] {
            same(t.as_str(), serde_json::to_value(t).unwrap());
        }
        for m in [SettingsMode::Policy, SettingsMode::Arguments] {
            same(m.as_str(), serde_json::to_value(m).unwrap());
        }
        for o in [Overflow::DropHead, Overflow::RejectPublish, Overflow::RejectPublishDlx] {
            same(o.as_str(), serde_json::to_value(o).unwrap());
        }
        for f in Finding::ALL {
            same(f.as_str(), serde_json::to_value(f).unwrap());
        }
        for f in crate::pattern::crd::PatternFinding::ALL {
            same(f.as_str(), serde_json::to_value(f).unwrap());
        }
    }
}
