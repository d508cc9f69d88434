//! The `QueuePattern` resource: a broker policy for queues the operator does not declare itself
//! (RPC reply queues, per-instance queues), and a watch on the set of queues it matches.

use crate::{
    crd::{BrokerSpec, StatsSource},
    duration::DurationText,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Applies expiry (and optionally a length limit and dead-lettering) to every queue whose name
/// matches a regular expression, and watches that set for leaks and orphaned replies.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "queueguard.io",
    version = "v1alpha1",
    kind = "QueuePattern",
    namespaced,
    shortname = "qpat",
    category = "queueguard",
    status = "QueuePatternStatus",
    derive = "PartialEq",
    doc = "QueuePattern applies a RabbitMQ policy to every queue matching a pattern and watches the matching queues.",
    printcolumn(name = "Pattern", type_ = "string", json_path = ".spec.pattern", description = "queue name regex"),
    printcolumn(
        name = "Queues",
        type_ = "integer",
        json_path = ".status.queues.matching",
        description = "queues matching the pattern"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "whether the broker policy is in effect"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct QueuePatternSpec {
    /// Where the broker is and how to log in. Immutable: the policy would be left behind on the
    /// old broker.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.broker is immutable: create a new QueuePattern for another broker"))]
    pub broker: BrokerSpec,
    /// Regular expression (RabbitMQ policy syntax) of the queue names, e.g. `^rpc\.reply\.` or
    /// `^amq\.gen-`. Anchor it: an unanchored pattern matches anywhere in a name.
    #[schemars(length(min = 1, max = 255))]
    pub pattern: String,
    /// Inactivity expiry (x-expires) for every matching queue: a queue nobody uses for this long is
    /// deleted, so abandoned reply queues cannot pile up. At least 1m.
    #[serde(default = "default_expires")]
    pub expires: DurationText,
    /// Maximum ready messages per matching queue (max-length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_length: Option<i64>,
    /// Dead-letter exchange (must exist) for messages the matching queues drop or reject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub dead_letter_exchange: Option<String>,
    /// Routing key for those dead letters; default: the message's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub dead_letter_routing_key: Option<String>,
    /// Priority of the broker policy. RabbitMQ applies one policy per queue, the highest; it stays
    /// below the QueuePolicies' (100) so a QueuePolicy always wins for its own queue.
    #[serde(default)]
    #[schemars(range(min = 0, max = 99))]
    pub priority: i32,
    /// Findings not to report: QueueLeak, OrphanedReplies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 2))]
    pub ignore: Vec<PatternFinding>,
}

/// `crds/queuepattern.yaml`.
pub fn crd_yaml() -> String {
    crate::crd::generated_yaml(&QueuePattern::crd())
}

fn default_expires() -> DurationText {
    "10m".into()
}

/// What the watch on the matching queues can find.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema, strum::IntoStaticStr)]
pub enum PatternFinding {
    /// The number of matching queues keeps rising: queues are created faster than they go.
    QueueLeak,
    /// Matching queues hold ready messages and have no consumer: replies nobody will read.
    OrphanedReplies,
}

impl PatternFinding {
    pub const ALL: [PatternFinding; 2] = [Self::QueueLeak, Self::OrphanedReplies];

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueuePatternStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready (the broker policy is in effect), QueueLeak and OrphanedReplies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Name of the operator-owned RabbitMQ policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_policy: Option<String>,
    /// The matching queues as last seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<MatchingQueues>,
    /// Where the matching queues' depths and consumer counts come from: Management (the
    /// management API's statistics) or Prometheus (rabbitmq_prometheus's /metrics/detailed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats_source: Option<StatsSource>,
}

/// The set of queues the pattern matches.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MatchingQueues {
    /// Queues matching now.
    pub matching: i64,
    /// Queues that appeared since the previous look.
    pub created: i64,
    /// Queues that went away since the previous look.
    pub deleted: i64,
    /// Ready messages across the matching queues.
    pub messages_ready: i64,
    /// Matching queues with ready messages and no consumer.
    pub orphaned: i64,
}
