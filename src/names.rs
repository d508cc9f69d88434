//! The names queueguard writes into the cluster, shared by the gate, the webhook, `check`, the
//! uninstaller and the chart's tests. A leaf: it depends on nothing.

/// The readiness gate, and the pod condition type the operator owns.
pub const GATE_CONDITION: &str = "queueguard.io/consumer-attached";
/// The pod template annotation that restarts a workload's pods after its queue was migrated (as
/// `kubectl rollout restart` does with its own); its value is the migration's start.
pub const RESTARTED_AT: &str = "queueguard.io/restartedAt";
/// The finalizer on QueuePolicies and QueuePatterns.
pub const FINALIZER: &str = "queueguard.io/cleanup";
/// The one field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "queueguard";
/// Label on every PodDisruptionBudget the operator keeps.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "queueguard");
/// The opt-in label: the webhook is called only for pods of namespaces that carry it.
pub const NAMESPACE_LABEL: (&str, &str) = ("queueguard.io/readiness-gate-inject", "enabled");
/// The same, as `kubectl label` takes it.
pub const NAMESPACE_LABEL_TEXT: &str = "queueguard.io/readiness-gate-inject=enabled";
