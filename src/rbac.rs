//! Every Kubernetes API permission the operator's code uses, and nothing more. The Helm chart's
//! RBAC is checked against this list in both directions (tests/chart.rs), and the mocked API
//! server in the tests fails any request this list does not grant, so the chart cannot drift
//! from the code.

/// Where a rule is granted: across the watched namespaces, or only in the operator's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The namespaces the operator watches (ClusterRole, or a Role in the watched namespace).
    Watched,
    /// The operator's own namespace (leader Lease, the webhook's certificate Secret).
    Own,
    /// A cluster-scoped object (the webhook configuration).
    Cluster,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
    pub scope: Scope,
    /// Which optional feature needs it; None for the controller itself.
    pub feature: Option<Feature>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    LeaderElection,
    /// The webhook with a certificate the operator issues itself (not cert-manager).
    WebhookSelfSigned,
    /// QueuePolicies naming a RabbitMQ Cluster Operator's RabbitmqCluster.
    RabbitmqClusters,
    /// The Messaging Topology Operator's Queues, watched (`--topology-queues`).
    TopologyQueues,
    /// The chart's pre-delete hook (`queueguard uninstall`), which stops the operator's own
    /// Deployment before removing the finalizers.
    UninstallHook,
}

pub const RULES: &[Rule] = &[
    // Watch and reconcile policies; the finalizer is a patch of the object.
    rule("queueguard.io", "queuepolicies", &["get", "list", "watch", "patch"]),
    rule("queueguard.io", "queuepolicies/status", &["patch"]),
    // QueuePatterns: the same, without owned objects.
    rule("queueguard.io", "queuepatterns", &["get", "list", "watch", "patch"]),
    rule("queueguard.io", "queuepatterns/status", &["patch"]),
    // The consumer workloads: watched; Deployments and Argo Rollouts patched to a safe strategy
    // (StatefulSets never are), any of them restarted after its queue was migrated (a pod
    // template annotation); the webhook reads one's labels when a policy picks workloads by
    // label.
    rule("apps", "deployments", &["get", "list", "watch", "patch"]),
    rule("apps", "statefulsets", &["get", "list", "watch", "patch"]),
    rule("argoproj.io", "rollouts", &["get", "list", "watch", "patch"]),
    // ReplicaSets: their owner only (metadata), which leads a pod to its Deployment or Rollout;
    // the webhook reads a new pod's.
    rule("apps", "replicasets", &["get", "list", "watch"]),
    // Consumer pods: watched; their gate condition written through pods/status.
    rule("", "pods", &["list", "watch"]),
    rule("", "pods/status", &["patch"]),
    // PodDisruptionBudgets: watched (the operator's own, and others' over the same pods);
    // server-side apply creates the operator's, stale ones are deleted.
    rule("policy", "poddisruptionbudgets", &["list", "watch", "create", "patch", "delete"]),
    rule("events.k8s.io", "events", &["create", "patch"]),
    // Broker credentials.
    rule("", "secrets", &["get"]),
    Rule {
        group: "rabbitmq.com",
        resource: "rabbitmqclusters",
        verbs: &["get"],
        scope: Scope::Watched,
        feature: Some(Feature::RabbitmqClusters),
    },
    Rule {
        group: "rabbitmq.com",
        resource: "queues",
        verbs: &["list", "watch"],
        scope: Scope::Watched,
        feature: Some(Feature::TopologyQueues),
    },
    Rule {
        group: "coordination.k8s.io",
        resource: "leases",
        verbs: &["get", "create", "update"],
        scope: Scope::Own,
        feature: Some(Feature::LeaderElection),
    },
    Rule {
        group: "",
        resource: "secrets",
        verbs: &["get", "create", "update"],
        scope: Scope::Own,
        feature: Some(Feature::WebhookSelfSigned),
    },
    Rule {
        group: "apps",
        resource: "deployments",
        verbs: &["get"],
        scope: Scope::Own,
        feature: Some(Feature::UninstallHook),
    },
    Rule { group: "", resource: "pods", verbs: &["list"], scope: Scope::Own, feature: Some(Feature::UninstallHook) },
    Rule {
        group: "apps",
        resource: "deployments/scale",
        verbs: &["patch"],
        scope: Scope::Own,
        feature: Some(Feature::UninstallHook),
    },
    Rule {
        group: "admissionregistration.k8s.io",
        resource: "mutatingwebhookconfigurations",
        verbs: &["get", "patch"],
        scope: Scope::Cluster,
        feature: Some(Feature::WebhookSelfSigned),
    },
];

const fn rule(group: &'static str, resource: &'static str, verbs: &'static [&'static str]) -> Rule {
    Rule { group, resource, verbs, scope: Scope::Watched, feature: None }
}

/// Whether some rule grants `verb` on `group`/`resource`.
pub fn allows(group: &str, resource: &str, verb: &str) -> bool {
    RULES.iter().any(|r| r.group == group && r.resource == resource && r.verbs.contains(&verb))
}
