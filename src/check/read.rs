//! Reading manifests: multi-document YAML as `helm template` prints it (comment-only documents
//! included), and `kind: List` (or `DeploymentList` and the like) as `kubectl get -o yaml` prints
//! it, flattened. Kinds the rules do not use are skipped. QueuePolicies and QueuePatterns are
//! read typed, with the fields their schema does not know.
//!
//! Two passes over the same text: the first reads each document as a plain YAML value to learn
//! the kind of every object; the second deserialises each object of a known kind straight from
//! the YAML parser into its type, so a type error carries its line and column too.

use super::{
    Manifests, ObjectId, PatternDoc, PatternState, PolicyDoc, PolicyState, TopologyQueueDoc, WebhookDoc, WorkloadDoc,
};
use crate::workload::{Kind, Workload, rollout::Rollout};
use crate::{
    crd::{API_VERSION, QueuePolicy},
    pattern::crd::QueuePattern,
};
use k8s_openapi::{
    api::apps::v1::{Deployment, StatefulSet},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor},
};
use serde_yaml_ng::Value;
use std::{collections::BTreeMap, fmt};

/// Input that cannot be read: the file, and where the parser knows it, the line and column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadError {
    pub file: String,
    /// 1-based, within the file.
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// 1-based document of the file; 0 when the file as a whole is the problem.
    pub document: usize,
    pub message: String,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.line, self.column, self.document) {
            (Some(line), Some(column), _) => write!(f, "{}: line {line}, column {column}: {}", self.file, self.message),
            (_, _, 0) => write!(f, "{}: {}", self.file, self.message),
            (_, _, document) => write!(f, "{}: document {document}: {}", self.file, self.message),
        }
    }
}

impl ReadError {
    fn yaml(file: &str, document: usize, e: &serde_yaml_ng::Error) -> Self {
        let location = e.location();
        let mut message = e.to_string();
        // The location is given separately: drop the parser's own " at line L column C" for it.
        if let Some(l) = &location {
            message = message.replacen(&format!(" at line {} column {}", l.line(), l.column()), "", 1);
        }
        Self {
            file: file.to_owned(),
            line: location.as_ref().map(|l| l.line()),
            column: location.as_ref().map(|l| l.column()),
            document,
            message,
        }
    }
}

/// The operator's own resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Custom {
    Policy,
    Pattern,
}

impl Custom {
    fn of(kind: &str) -> Option<Self> {
        match kind {
            "QueuePolicy" => Some(Self::Policy),
            "QueuePattern" => Some(Self::Pattern),
            _ => None,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Policy => "QueuePolicy",
            Self::Pattern => "QueuePattern",
        }
    }
}

/// What an object (a document, or an item of a List) turned out to be in the first pass.
#[derive(Debug, Clone, PartialEq)]
enum Shape {
    /// An empty or comment-only document.
    Empty,
    /// A Kubernetes object of a kind the rules do not use.
    Other,
    Policy,
    Pattern,
    /// A queueguard resource of a `queueguard.io` version the operator does not serve.
    Unserved {
        kind: Custom,
        api_version: String,
        name: String,
        namespace: Option<String>,
    },
    Workload(Kind),
    Webhook,
    Namespace,
    Secret,
    /// The RabbitMQ Messaging Topology Operator's `Queue`.
    TopologyQueue,
    List(Vec<Shape>),
    /// Not a Kubernetes object; the message says why.
    NotAnObject(&'static str),
}

fn shape_of(value: &Value) -> Shape {
    if value.is_null() {
        return Shape::Empty;
    }
    if !value.is_mapping() {
        return Shape::NotAnObject("not a Kubernetes object: expected a mapping with apiVersion and kind");
    }
    let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
    let Some(kind) = text(value, "kind") else {
        return Shape::NotAnObject("not a Kubernetes object: kind is missing");
    };
    let api_version = text(value, "apiVersion").unwrap_or_default();
    if let Some(custom) = Custom::of(&kind) {
        if api_version == API_VERSION {
            return match custom {
                Custom::Policy => Shape::Policy,
                Custom::Pattern => Shape::Pattern,
            };
        }
        if api_version.starts_with("queueguard.io/") {
            let metadata = value.get("metadata");
            return Shape::Unserved {
                kind: custom,
                api_version,
                name: metadata.and_then(|m| text(m, "name")).unwrap_or_default(),
                namespace: metadata.and_then(|m| text(m, "namespace")),
            };
        }
    }
    match kind.as_str() {
        "Deployment" if api_version == "apps/v1" => Shape::Workload(Kind::Deployment),
        "StatefulSet" if api_version == "apps/v1" => Shape::Workload(Kind::StatefulSet),
        "Rollout" if api_version.starts_with("argoproj.io/") => Shape::Workload(Kind::Rollout),
        "MutatingWebhookConfiguration" if api_version.starts_with("admissionregistration.k8s.io/") => Shape::Webhook,
        "Namespace" if api_version == "v1" => Shape::Namespace,
        "Secret" if api_version == "v1" => Shape::Secret,
        "Queue" if api_version.starts_with("rabbitmq.com/") => Shape::TopologyQueue,
        k if k == "List" || k.ends_with("List") => match value.get("items") {
            Some(Value::Sequence(items)) => Shape::List(items.iter().map(shape_of).collect()),
            Some(Value::Null) | None => Shape::List(vec![]),
            Some(_) => Shape::NotAnObject("items of a List must be a sequence"),
        },
        _ => Shape::Other,
    }
}

/// An object of a kind the rules use, before it is given its place among all inputs.
enum Object {
    Policy { policy: Box<QueuePolicy>, unknown_fields: Vec<String> },
    Pattern { pattern: Box<QueuePattern>, unknown_fields: Vec<String> },
    Unserved { kind: Custom, api_version: String, name: String, namespace: Option<String> },
    Workload(Box<Workload>),
    Webhook(Vec<WebhookDoc>),
    Namespace { name: String, labels: BTreeMap<String, String> },
    BrokerNodes { namespace: Option<String>, name: String, nodes: Vec<String> },
    TopologyQueue(Box<TopologyQueue>),
    Other,
}

/// What QG014 reads of a Messaging Topology Operator `Queue` (its spec's `durable` and
/// `exclusive` default to false there).
#[derive(Deserialize)]
struct TopologyQueue {
    #[serde(default)]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: TopologyQueueSpec,
}

#[derive(Deserialize, Default)]
struct TopologyQueueSpec {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    durable: bool,
    #[serde(default)]
    exclusive: bool,
    #[serde(default)]
    arguments: BTreeMap<String, Value>,
    #[serde(default)]
    vhost: Option<String>,
    #[serde(default, rename = "rabbitmqClusterReference")]
    cluster: crate::topology::ClusterReference,
}

/// Reads one file's text into `into`, after what earlier files gave. `file` names it in
/// findings and errors.
pub fn read(file: &str, text: &str, into: &mut Manifests) -> Result<(), ReadError> {
    let mut shapes = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc).map_err(|e| ReadError::yaml(file, i + 1, &e))?;
        shapes.push(shape_of(&value));
    }
    let mut objects = Vec::new();
    for (i, (doc, shape)) in serde_yaml_ng::Deserializer::from_str(text).zip(&shapes).enumerate() {
        Seed { shape, out: &mut objects }.deserialize(doc).map_err(|e| ReadError::yaml(file, i + 1, &e))?;
    }
    for object in objects {
        let position = into.objects;
        into.objects += 1;
        let id = |kind: &'static str, meta: &ObjectMeta| ObjectId {
            kind,
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
            file: file.to_owned(),
            position,
        };
        match object {
            Object::Policy { policy, unknown_fields } => into.policies.push(PolicyDoc {
                id: id("QueuePolicy", &policy.metadata),
                state: PolicyState::Read { policy, unknown_fields },
            }),
            Object::Pattern { pattern, unknown_fields } => into.patterns.push(PatternDoc {
                id: id("QueuePattern", &pattern.metadata),
                state: PatternState::Read { pattern, unknown_fields },
            }),
            Object::Unserved { kind, api_version, name, namespace } => {
                let id = ObjectId { kind: kind.kind(), namespace, name, file: file.to_owned(), position };
                match kind {
                    Custom::Policy => {
                        into.policies.push(PolicyDoc { id, state: PolicyState::Unserved { api_version } })
                    }
                    Custom::Pattern => {
                        into.patterns.push(PatternDoc { id, state: PatternState::Unserved { api_version } })
                    }
                }
            }
            Object::Workload(w) => {
                let id = id(w.key.kind.as_str(), w.object.meta());
                into.workloads.push(WorkloadDoc { id, workload: *w })
            }
            Object::Webhook(hooks) => into.webhooks.extend(hooks),
            Object::Namespace { name, labels } => {
                into.namespaces.insert(name, labels);
            }
            Object::BrokerNodes { namespace, name, nodes } => {
                into.broker_nodes.insert((namespace, name), nodes);
            }
            Object::TopologyQueue(q) => {
                let id = id("Queue", &q.metadata);
                let name = q.spec.name.clone().unwrap_or_else(|| id.name.clone());
                let mut queue = crate::topology::Queue::new(
                    &id.name,
                    crate::topology::QueueSpec {
                        name: name.clone(),
                        vhost: q.spec.vhost,
                        rabbitmq_cluster_reference: q.spec.cluster,
                    },
                );
                queue.metadata.namespace = id.namespace.clone();
                into.topology_queues.push(TopologyQueueDoc {
                    id,
                    name,
                    durable: q.spec.durable,
                    exclusive: q.spec.exclusive,
                    arguments: q.spec.arguments,
                    queue,
                });
            }
            Object::Other => {}
        }
    }
    Ok(())
}

/// Reads a single text (tests, and callers with one input).
pub fn read_str(file: &str, text: &str) -> Result<Manifests, ReadError> {
    let mut manifests = Manifests::default();
    read(file, text, &mut manifests)?;
    Ok(manifests)
}

/// Deserialises one object of a known shape, appending what it holds to `out`.
struct Seed<'s> {
    shape: &'s Shape,
    out: &'s mut Vec<Object>,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        let object = match self.shape {
            Shape::Empty => {
                IgnoredAny::deserialize(d)?;
                return Ok(());
            }
            Shape::Other => {
                IgnoredAny::deserialize(d)?;
                Object::Other
            }
            Shape::NotAnObject(why) => return d.deserialize_any(Reject(why)),
            Shape::Policy => {
                let (policy, unknown_fields) = with_unknown_fields::<QueuePolicy, _>(d)?;
                Object::Policy { policy: Box::new(policy), unknown_fields }
            }
            Shape::Pattern => {
                let (pattern, unknown_fields) = with_unknown_fields::<QueuePattern, _>(d)?;
                Object::Pattern { pattern: Box::new(pattern), unknown_fields }
            }
            Shape::Unserved { kind, api_version, name, namespace } => {
                IgnoredAny::deserialize(d)?;
                Object::Unserved {
                    kind: *kind,
                    api_version: api_version.clone(),
                    name: name.clone(),
                    namespace: namespace.clone(),
                }
            }
            Shape::Workload(Kind::Deployment) => Object::Workload(Box::new(Workload::new(Deployment::deserialize(d)?))),
            Shape::Workload(Kind::StatefulSet) => {
                Object::Workload(Box::new(Workload::new(StatefulSet::deserialize(d)?)))
            }
            Shape::Workload(Kind::Rollout) => Object::Workload(Box::new(Workload::new(Rollout::deserialize(d)?))),
            Shape::Webhook => {
                let config = WebhookConfiguration::deserialize(d)?;
                Object::Webhook(
                    config
                        .webhooks
                        .unwrap_or_default()
                        .into_iter()
                        .map(|w| WebhookDoc { name: w.name, namespace_selector: w.namespace_selector })
                        .collect(),
                )
            }
            Shape::Namespace => {
                let ns = k8s_openapi::api::core::v1::Namespace::deserialize(d)?;
                Object::Namespace {
                    name: ns.metadata.name.unwrap_or_default(),
                    labels: ns.metadata.labels.unwrap_or_default(),
                }
            }
            Shape::Secret => {
                let secret = NodesOfSecret::deserialize(d)?;
                let nodes = secret.nodes();
                if nodes.is_empty() {
                    Object::Other
                } else {
                    Object::BrokerNodes {
                        namespace: secret.metadata.namespace,
                        name: secret.metadata.name.unwrap_or_default(),
                        nodes,
                    }
                }
            }
            Shape::TopologyQueue => Object::TopologyQueue(Box::new(TopologyQueue::deserialize(d)?)),
            Shape::List(items) => return d.deserialize_map(ListVisitor { items, out: self.out }),
        };
        self.out.push(object);
        Ok(())
    }
}

/// A queueguard resource, with the paths of the fields its schema does not know.
fn with_unknown_fields<'de, T: Deserialize<'de>, D: Deserializer<'de>>(d: D) -> Result<(T, Vec<String>), D::Error> {
    let mut unknown_fields = Vec::new();
    let object: T = serde_ignored::deserialize(d, |path| unknown_fields.push(path.to_string()))?;
    // Type metadata is no field of the struct, and status belongs to the operator.
    unknown_fields.retain(|p| p != "apiVersion" && p != "kind" && !p.starts_with("status"));
    Ok((object, unknown_fields))
}

/// Only the node list of a Secret (its `addresses` key, [`crate::secret::ADDRESSES_KEY`]):
/// nothing else of a Secret is read, so no credential is ever held.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodesOfSecret {
    #[serde(default)]
    metadata: ObjectMeta,
    #[serde(default)]
    string_data: Option<AddressesKey>,
    #[serde(default)]
    data: Option<AddressesKey>,
}

#[derive(Deserialize)]
struct AddressesKey {
    #[serde(default)]
    addresses: Option<String>,
}

impl NodesOfSecret {
    /// `host:port` of each node named, from stringData or (base64) data.
    fn nodes(&self) -> Vec<String> {
        use base64::Engine;
        let plain = self.string_data.as_ref().and_then(|d| d.addresses.clone());
        let decoded = || {
            let text = self.data.as_ref()?.addresses.as_ref()?;
            let bytes = base64::engine::general_purpose::STANDARD.decode(text.trim()).ok()?;
            String::from_utf8(bytes).ok()
        };
        plain
            .or_else(decoded)
            .map(|list| list.split(',').map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned).collect())
            .unwrap_or_default()
    }
}

/// Only what the rules need of a MutatingWebhookConfiguration: its webhooks' names and
/// namespace selectors.
#[derive(Deserialize)]
struct WebhookConfiguration {
    #[serde(default)]
    webhooks: Option<Vec<NamedWebhook>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NamedWebhook {
    name: String,
    #[serde(default)]
    namespace_selector: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
}

/// Fails on a document that is no Kubernetes object, at the document's position.
struct Reject(&'static str);

impl<'de> Visitor<'de> for Reject {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object (a mapping with apiVersion and kind)")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(self.0))
    }
}

/// A List: its `items`, each with the shape the first pass found.
struct ListVisitor<'s> {
    items: &'s [Shape],
    out: &'s mut Vec<Object>,
}

impl<'de> Visitor<'de> for ListVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a List with items")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let ListVisitor { items, out } = self;
        while let Some(key) = map.next_key::<Value>()? {
            if key.as_str() == Some("items") {
                map.next_value_seed(Items { items, out: &mut *out })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct Items<'s> {
    items: &'s [Shape],
    out: &'s mut Vec<Object>,
}

impl<'de> DeserializeSeed<'de> for Items<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Items<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence of Kubernetes objects")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Items { items, out } = self;
        let mut shapes = items.iter();
        loop {
            let shape = shapes.next().unwrap_or(&Shape::Other);
            if seq.next_element_seed(Seed { shape, out: &mut *out })?.is_none() {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: orders, namespace: shop}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {name: orders}\n  consumers: {deployment: worker}\n";
    const DEPLOYMENT: &str = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: worker, namespace: shop}\nspec:\n  replicas: 2\n  selector: {matchLabels: {app: worker}}\n  template:\n    metadata: {labels: {app: worker}}\n    spec: {containers: [{name: worker, image: worker}]}\n";

    #[test]
    fn helm_template_output_with_comment_only_documents() {
        let text = format!(
            "---\n# Source: shop/templates/policy.yaml\n{POLICY}---\n# Source: shop/templates/empty.yaml\n---\n# Source: shop/templates/deploy.yaml\n{DEPLOYMENT}---\napiVersion: v1\nkind: Service\nmetadata: {{name: worker}}\n"
        );
        let m = read_str("chart.yaml", &text).unwrap();
        assert_eq!(m.policies.len(), 1);
        assert_eq!(m.workloads.len(), 1);
        assert_eq!(m.objects, 3, "the Service counts as an object, the comment-only document does not");
        let policy = &m.policies[0];
        assert_eq!(policy.id.to_string(), "QueuePolicy shop/orders");
        assert_eq!((policy.id.file.as_str(), policy.id.position), ("chart.yaml", 0));
        assert_eq!(m.workloads[0].id.position, 1);
        assert_eq!(m.workloads[0].workload.replicas(), 2);
    }

    #[test]
    fn lists_are_flattened_and_later_files_continue_the_positions() {
        let indent = |doc: &str| doc.replace('\n', "\n    ");
        let text = format!(
            "apiVersion: v1\nkind: List\nmetadata: {{resourceVersion: ''}}\nitems:\n  - {}\n  - {}\n  - {{apiVersion: v1, kind: ConfigMap, metadata: {{name: c}}}}\n",
            indent(DEPLOYMENT),
            indent(POLICY)
        );
        let mut m = Manifests::default();
        read("get.yaml", &text, &mut m).unwrap();
        read("more.yaml", DEPLOYMENT, &mut m).unwrap();
        assert_eq!(m.objects, 4);
        assert_eq!(m.workloads.len(), 2);
        assert_eq!(m.policies[0].id.position, 1);
        assert_eq!((m.workloads[1].id.file.as_str(), m.workloads[1].id.position), ("more.yaml", 3));
        let empty = read_str("e.yaml", "apiVersion: v1\nkind: List\nitems: []\n").unwrap();
        assert_eq!((empty.objects, empty.workloads.len()), (0, 0));
    }

    #[test]
    fn policy_unknown_fields_are_recorded_and_other_versions_are_unserved() {
        let m = read_str("p.yaml", &POLICY.replace("consumers:", "consumer:")).unwrap();
        let PolicyState::Read { unknown_fields, .. } = &m.policies[0].state else { panic!() };
        assert_eq!(unknown_fields, &["spec.consumer"]);
        let m = read_str("p.yaml", &POLICY.replace("v1alpha1", "v1beta1")).unwrap();
        let PolicyState::Unserved { api_version } = &m.policies[0].state else { panic!() };
        assert_eq!(api_version, "queueguard.io/v1beta1");
        assert_eq!(m.policies[0].id.to_string(), "QueuePolicy shop/orders");
        let foreign = read_str("p.yaml", &POLICY.replace("queueguard.io/v1alpha1", "example.com/v1")).unwrap();
        assert_eq!((foreign.policies.len(), foreign.objects), (0, 1), "another group's QueuePolicy is not ours");
    }

    const PATTERN: &str = "apiVersion: queueguard.io/v1alpha1\nkind: QueuePattern\nmetadata: {name: replies, namespace: shop}\nspec:\n  broker: {secretRef: {name: rabbitmq}, vhost: shop}\n  pattern: '^rpc\\.reply\\.'\n  expires: 5m\n";

    #[test]
    fn patterns_are_read_typed_with_their_unknown_fields() {
        let m = read_str("p.yaml", &format!("{POLICY}---\n{PATTERN}status: {{brokerPolicy: p, extra: 1}}\n")).unwrap();
        assert_eq!((m.policies.len(), m.patterns.len(), m.objects), (1, 1, 2));
        let pattern = &m.patterns[0];
        assert_eq!(pattern.id.to_string(), "QueuePattern shop/replies");
        assert_eq!((pattern.id.file.as_str(), pattern.id.position), ("p.yaml", 1));
        let PatternState::Read { pattern, unknown_fields } = &pattern.state else { panic!() };
        assert_eq!((pattern.spec.pattern.as_str(), pattern.spec.expires.as_str()), (r"^rpc\.reply\.", "5m"));
        assert_eq!(pattern.spec.broker.vhost.as_deref(), Some("shop"));
        assert_eq!(unknown_fields, &Vec::<String>::new(), "status belongs to the operator");

        let m = read_str("p.yaml", &PATTERN.replace("expires:", "expiry:").replace("vhost:", "vHost:")).unwrap();
        let PatternState::Read { unknown_fields, .. } = &m.patterns[0].state else { panic!() };
        assert_eq!(unknown_fields, &["spec.broker.vHost", "spec.expiry"]);

        // In a List, as kubectl prints it.
        let list = format!("apiVersion: v1\nkind: List\nitems:\n  - {}\n", PATTERN.replace('\n', "\n    "));
        assert_eq!(read_str("get.yaml", &list).unwrap().patterns[0].id.to_string(), "QueuePattern shop/replies");
    }

    #[test]
    fn patterns_of_other_versions_are_unserved_and_other_groups_skipped() {
        let m = read_str("p.yaml", &PATTERN.replace("v1alpha1", "v1")).unwrap();
        let PatternState::Unserved { api_version } = &m.patterns[0].state else { panic!() };
        assert_eq!(api_version, "queueguard.io/v1");
        assert_eq!(m.patterns[0].id.to_string(), "QueuePattern shop/replies");
        assert_eq!(m.policies.len(), 0, "an unserved QueuePattern is no QueuePolicy");
        let foreign = read_str("p.yaml", &PATTERN.replace("queueguard.io/v1alpha1", "example.com/v1")).unwrap();
        assert_eq!((foreign.patterns.len(), foreign.objects), (0, 1), "another group's QueuePattern is not ours");
    }

    #[test]
    fn pattern_type_errors_name_the_line_and_the_field() {
        let err = read_str("p.yaml", &format!("{POLICY}---\n{}", PATTERN.replace("expires: 5m", "priority: high")))
            .unwrap_err();
        assert_eq!((err.document, err.line, err.column), (2, Some(15), Some(13)), "{err}");
        assert!(err.message.starts_with("spec.priority: invalid type: string \"high\""), "{err}");
        let err = read_str("p.yaml", &PATTERN.replace("  pattern: '^rpc\\.reply\\.'\n", "")).unwrap_err();
        assert!(err.message.contains("missing field `pattern`"), "{err}");
    }

    #[test]
    fn webhook_names_are_collected() {
        let text = "apiVersion: admissionregistration.k8s.io/v1\nkind: MutatingWebhookConfiguration\nmetadata: {name: queueguard}\nwebhooks: [{name: pods.queueguard.io, admissionReviewVersions: [v1], sideEffects: None}]\n";
        let hooks = read_str("w.yaml", text).unwrap().webhooks;
        assert_eq!(hooks.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(), ["pods.queueguard.io"]);
        assert_eq!(hooks[0].namespace_selector, None);
        let text = "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {queueguard.io/readiness-gate-inject: enabled}}\n";
        assert_eq!(
            read_str("ns.yaml", text).unwrap().namespaces["shop"]["queueguard.io/readiness-gate-inject"],
            "enabled"
        );
    }

    #[test]
    fn syntax_errors_name_the_line_in_the_file() {
        // POLICY is lines 1-7, DEPLOYMENT 9-17; the third document starts on line 19.
        let text = format!(
            "{POLICY}---\n{DEPLOYMENT}---\napiVersion: v1\nkind: Service\nmetadata:\n  name: a\n   labels: x\n"
        );
        let err = read_str("bad.yaml", &text).unwrap_err();
        assert_eq!((err.document, err.line, err.column), (3, Some(23), Some(10)), "{err}");
        assert_eq!(err.to_string(), "bad.yaml: line 23, column 10: mapping values are not allowed in this context");
        let err = read_str("bad.yaml", &format!("{POLICY}---\nkind: [unclosed\n")).unwrap_err();
        assert_eq!(err.line, Some(10), "the end of the input, where the parser gave up: {err}");
        assert_eq!(err.message, "did not find expected ',' or ']', while parsing a flow sequence at line 9 column 7");
    }

    #[test]
    fn type_errors_name_the_line_and_the_field() {
        let text = format!("{POLICY}---\n{}", DEPLOYMENT.replace("replicas: 2", "replicas: two"));
        let err = read_str("bad.yaml", &text).unwrap_err();
        assert_eq!((err.document, err.line, err.column), (2, Some(13), Some(13)), "{err}");
        assert!(err.message.starts_with("spec.replicas: invalid type: string \"two\""), "{err}");
        assert!(!err.message.contains("at line"), "the location is not repeated: {err}");
        let policy = POLICY.replace("{deployment: worker}", "{deployment: worker, minAttached: lots}");
        let err = read_str("p.yaml", &policy).unwrap_err();
        assert_eq!(err.line, Some(7), "{err}");
        assert!(err.message.starts_with("spec.consumers.minAttached: invalid type"), "{err}");
    }

    #[test]
    fn documents_that_are_no_objects_are_errors_at_their_line() {
        let err = read_str("values.yaml", &format!("{POLICY}---\nreplicaCount: 2\n")).unwrap_err();
        assert_eq!(err.line, Some(9), "{err}");
        assert_eq!(err.message, "not a Kubernetes object: kind is missing");
        let err = read_str("list.yaml", "kind: List\nitems:\n  - {apiVersion: v1, kind: Service}\n  - just text\n")
            .unwrap_err();
        assert_eq!(err.line, Some(4), "{err}");
        assert!(err.message.contains("expected a Kubernetes object"), "{err}");
    }
}
