//! `queueguard check`: a linter for manifests. It reads what `helm template` or
//! `kubectl get -o yaml` print, finds the QueuePolicies, QueuePatterns, consumer Deployments and
//! the operator's webhook among them, and reports the mistakes that would lose messages or stall
//! rollouts before anything reaches a cluster.
//!
//! ```text
//! files ──read::read──▶ Manifests ──rules::check──▶ Vec<Finding> ──output::{text, json}──▶ stdout
//!                        (typed objects)   (pure, reuses plan, gate::strategy, gate::guards)
//! ```
//!
//! The rules judge exactly as the operator would: policies through [`crate::plan::plan`], patterns
//! through [`crate::pattern::plan`], strategies through [`crate::gate::strategy::judge`], which
//! Deployments a policy guards through [`crate::gate::guards::guards`].

pub mod output;
pub mod read;
pub mod rules;

use crate::workload::Workload;
use crate::{crd::QueuePolicy, pattern::crd::QueuePattern};
use std::fmt;

pub use read::{ReadError, read};
pub use rules::{Rule, check};

/// Which object a finding is about, and where it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectId {
    pub kind: &'static str,
    /// None when the manifest gives none; such objects count as one (unnamed) namespace.
    pub namespace: Option<String>,
    pub name: String,
    /// The file it came from (`<stdin>` for `-`).
    pub file: String,
    /// Its place in the input, across files: findings are listed in input order.
    pub position: usize,
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// A QueuePolicy as read.
#[derive(Debug, Clone)]
pub struct PolicyDoc {
    pub id: ObjectId,
    pub state: PolicyState,
}

#[derive(Debug, Clone)]
pub enum PolicyState {
    /// A `queueguard.io/v1alpha1` QueuePolicy, with the paths of fields its schema does not know.
    Read { policy: Box<QueuePolicy>, unknown_fields: Vec<String> },
    /// A QueuePolicy of another `queueguard.io` version, which the operator does not serve.
    Unserved { api_version: String },
}

/// A QueuePattern as read.
#[derive(Debug, Clone)]
pub struct PatternDoc {
    pub id: ObjectId,
    pub state: PatternState,
}

#[derive(Debug, Clone)]
pub enum PatternState {
    /// A `queueguard.io/v1alpha1` QueuePattern, with the paths of fields its schema does not know.
    Read { pattern: Box<QueuePattern>, unknown_fields: Vec<String> },
    /// A QueuePattern of another `queueguard.io` version, which the operator does not serve.
    Unserved { api_version: String },
}

/// A workload as read: an `apps/v1` Deployment or StatefulSet, or an Argo Rollout.
#[derive(Debug, Clone)]
pub struct WorkloadDoc {
    pub id: ObjectId,
    pub workload: Workload,
}

/// A webhook of a MutatingWebhookConfiguration: its name, and which namespaces it is called for.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookDoc {
    pub name: String,
    pub namespace_selector: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
}

/// What the rules look at: every object of the kinds they know, from every input file.
#[derive(Debug, Clone, Default)]
pub struct Manifests {
    pub policies: Vec<PolicyDoc>,
    pub patterns: Vec<PatternDoc>,
    pub workloads: Vec<WorkloadDoc>,
    /// The webhooks of every MutatingWebhookConfiguration (`pods.queueguard.io` is the
    /// operator's own, which adds the readiness gate to guarded pods).
    pub webhooks: Vec<WebhookDoc>,
    /// Namespaces among the objects, with their labels (what a webhook's namespaceSelector reads).
    pub namespaces: std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
    /// The broker nodes each Secret among the objects names in its `addresses` key, by
    /// (namespace, name). Nothing else of a Secret is read.
    pub broker_nodes: std::collections::BTreeMap<(Option<String>, String), Vec<String>>,
    /// Queues declared by the RabbitMQ Messaging Topology Operator (`rabbitmq.com` `Queue`).
    pub topology_queues: Vec<TopologyQueueDoc>,
    /// Kubernetes objects seen, of any kind (List items counted one by one).
    pub objects: usize,
}

/// What QG014 and QG015 read of a Messaging Topology Operator `Queue`: how and where it is
/// declared.
#[derive(Debug, Clone, PartialEq)]
pub struct TopologyQueueDoc {
    pub id: ObjectId,
    /// The queue's name on the broker (spec.name).
    pub name: String,
    pub durable: bool,
    pub exclusive: bool,
    /// The x- arguments it declares, as given.
    pub arguments: std::collections::BTreeMap<String, serde_yaml_ng::Value>,
    /// Where it declares the queue: its name, vhost and cluster.
    pub queue: crate::topology::Queue,
}

/// How bad a finding is. Both make `queueguard check` exit 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub enum Severity {
    /// Messages can be lost, or rollouts or drains stall.
    Error,
    /// Safe while the operator runs and acts, or a cost rather than a loss.
    Warning,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// One problem with one object: the rule, the object, and a sentence saying why it is a problem
/// and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub rule: Rule,
    pub severity: Severity,
    pub object: ObjectId,
    pub message: String,
}

/// The name findings and errors give stdin (`-`).
pub const STDIN: &str = "<stdin>";

/// Reads every input (`-` for stdin) and checks them together: a policy in one file guards a
/// Deployment in another. Input with no Kubernetes object at all is an error, so that an empty
/// pipe (a failed `helm template`) is not taken for clean manifests.
pub fn run(inputs: &[String]) -> Result<(Manifests, Vec<Finding>), ReadError> {
    let name = |input: &str| if input == "-" { STDIN.to_owned() } else { input.to_owned() };
    let mut manifests = Manifests::default();
    for input in inputs {
        let file = name(input);
        let file = file.as_str();
        let text = crate::local::read_source(input).map_err(|e| ReadError {
            file: file.to_owned(),
            line: None,
            column: None,
            document: 0,
            message: e.message,
        })?;
        read(file, &text, &mut manifests)?;
    }
    if manifests.objects == 0 {
        return Err(ReadError {
            file: inputs.iter().map(|i| name(i)).collect::<Vec<_>>().join(", "),
            line: None,
            column: None,
            document: 0,
            message: "no Kubernetes objects found (empty input: did the command that produced it fail?)".into(),
        });
    }
    let findings = check(&manifests);
    Ok((manifests, findings))
}
