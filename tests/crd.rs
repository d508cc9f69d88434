//! The generated CRD: committed copy, field docs, printer columns, and its CEL rules evaluated the
//! way the API server evaluates them (kube's client-side CEL validator, schema defaults applied).

use kube::{CustomResourceExt, core::cel::Validator};
use queueguard::crd::{Overflow, QueuePolicy, crd_yaml};
use serde_json::{Value, json};

fn schema() -> Value {
    let crd = QueuePolicy::crd();
    serde_json::to_value(crd.spec.versions[0].schema.as_ref().unwrap().open_api_v3_schema.as_ref().unwrap()).unwrap()
}

fn policy(spec: Value) -> Value {
    json!({
        "apiVersion": "queueguard.io/v1alpha1",
        "kind": "QueuePolicy",
        "metadata": {"name": "orders", "namespace": "shop"},
        "spec": spec,
    })
}

fn base_spec() -> Value {
    json!({"broker": {"secretRef": {"name": "rabbitmq"}}, "queue": {"name": "orders"}})
}

fn with(path: &[&str], value: Value) -> Value {
    let mut spec = base_spec();
    let mut cursor = &mut spec;
    for key in &path[..path.len() - 1] {
        cursor = cursor.as_object_mut().unwrap().entry(key.to_string()).or_insert(json!({}));
    }
    cursor[path[path.len() - 1]] = value;
    policy(spec)
}

/// The messages of failed rules, or an empty list when the object is accepted.
fn rejections(object: &Value, old: Option<&Value>) -> Vec<String> {
    match Validator::new().validate(&schema(), object, old) {
        Ok(()) => vec![],
        Err(errors) => errors.into_vec().into_iter().map(|e| e.message).collect(),
    }
}

#[test]
fn committed_crd_matches_the_generator() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/queuepolicy.yaml")).unwrap();
    assert!(
        committed == crd_yaml(),
        "crds/queuepolicy.yaml is stale: run `cargo run -- crd --kind queue-policy > crds/queuepolicy.yaml`"
    );
}

#[test]
fn committed_pattern_crd_matches_the_generator() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/queuepattern.yaml")).unwrap();
    assert!(
        committed == queueguard::pattern::crd::crd_yaml(),
        "crds/queuepattern.yaml is stale: run `cargo run -- crd --kind queue-pattern > crds/queuepattern.yaml`"
    );
}

#[test]
fn every_spec_field_is_described_for_kubectl_explain() {
    fn walk(path: &str, schema: &Value, missing: &mut Vec<String>) {
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (name, prop) in props {
                let here = format!("{path}.{name}");
                if prop.get("description").is_none() {
                    missing.push(here.clone());
                }
                walk(&here, prop, missing);
                if let Some(items) = prop.get("items") {
                    walk(&format!("{here}[]"), items, missing);
                }
            }
        }
    }
    let mut missing = vec![];
    let s = schema();
    walk("spec", &s["properties"]["spec"], &mut missing);
    walk("status", &s["properties"]["status"], &mut missing);
    assert!(missing.is_empty(), "fields without a description: {missing:?}");
}

#[test]
fn printer_columns_and_names() {
    let crd = QueuePolicy::crd();
    assert_eq!(crd.spec.names.short_names, Some(vec!["qp".to_string()]));
    let version = &crd.spec.versions[0];
    let columns: Vec<&str> =
        version.additional_printer_columns.as_ref().unwrap().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(columns, ["Queue", "Type", "Consumers", "Ready", "Age"]);
    assert!(version.subresources.as_ref().unwrap().status.is_some());
    assert_eq!(crd.spec.scope, "Namespaced");
}

#[test]
fn a_plain_policy_is_accepted_with_defaults() {
    assert_eq!(rejections(&policy(base_spec()), None), Vec::<String>::new());
    let full = policy(json!({
        "broker": {"secretRef": {"name": "rabbitmq"}, "vhost": "shop"},
        "queue": {"name": "orders", "type": "quorum", "settings": "Arguments", "expires": "2h", "maxLength": 10, "overflow": "reject-publish",
                  "deadLetter": {"exchange": "dlx", "queue": "dlq", "routingKey": "dead"}, "bindings": [{"exchange": "orders", "routingKey": "order.*"}]},
        "consumers": {"deployment": "worker", "minAttached": 2},
        "gate": {"mode": "Observe", "failurePolicy": "Open"},
        "deletionPolicy": "Delete",
    }));
    assert_eq!(rejections(&full, None), Vec::<String>::new());
}

#[test]
fn quorum_queues_refuse_reject_publish_dlx() {
    let spec = json!({"name": "orders", "type": "quorum", "maxLength": 5, "overflow": "reject-publish-dlx"});
    let errs = rejections(&with(&["queue"], spec), None);
    assert_eq!(errs, ["quorum queues do not support overflow reject-publish-dlx; use reject-publish or drop-head"]);
    let classic = json!({"name": "orders", "type": "classic", "maxLength": 5, "overflow": "reject-publish-dlx"});
    assert!(rejections(&with(&["queue"], classic), None).is_empty());
}

#[test]
fn overflow_needs_max_length() {
    let errs = rejections(&with(&["queue", "overflow"], json!("drop-head")), None);
    assert_eq!(errs, ["overflow only applies together with maxLength"]);
}

#[test]
fn expires_is_at_least_a_minute() {
    for (value, accepted) in [("30m", true), ("1m", true), ("2h", true), ("59s", false), ("500ms", false)] {
        let errs = rejections(&with(&["queue", "expires"], json!(value)), None);
        assert_eq!(errs.is_empty(), accepted, "{value}: {errs:?}");
        if !accepted {
            assert_eq!(errs, ["expires must be at least 1m"]);
        }
    }
}

#[test]
fn reserved_queue_names_are_refused() {
    let errs = rejections(&with(&["queue", "name"], json!("amq.orders")), None);
    assert_eq!(errs, ["queue names starting with 'amq.' are reserved by the broker"]);
}

#[test]
fn queue_name_vhost_and_broker_are_immutable_and_the_type_changes_only_by_migration() {
    let old = policy(base_spec());
    let renamed = with(&["queue", "name"], json!("orders-v2"));
    assert_eq!(
        rejections(&renamed, Some(&old)),
        ["spec.queue.name is immutable: renaming would orphan the old queue and its messages"]
    );
    let unnamed = policy(json!({"broker": {"secretRef": {"name": "rabbitmq"}}, "queue": {}}));
    assert_eq!(rejections(&unnamed, Some(&old)).len(), 1, "dropping the name renames the queue to metadata.name");
    let vhost = with(&["broker", "vhost"], json!("other"));
    assert_eq!(
        rejections(&vhost, Some(&old)),
        ["spec.broker is immutable: create a new QueuePolicy for another broker"]
    );
    let secret = with(&["broker", "secretRef", "name"], json!("other"));
    assert_eq!(rejections(&secret, Some(&old)).len(), 1);
    let quorum = with(&["queue", "type"], json!("quorum"));
    assert_eq!(
        rejections(&quorum, Some(&old)),
        [
            "spec.queue.type can only change with onChange: Migrate: the broker cannot convert an existing queue, so queueguard moves it live"
        ]
    );
    let migrated = with(&["queue"], json!({"name": "orders", "type": "quorum", "onChange": "Migrate"}));
    assert!(rejections(&migrated, Some(&old)).is_empty(), "a type change with onChange: Migrate is admitted");
    let ttl = with(&["queue", "expires"], json!("2h"));
    assert!(rejections(&ttl, Some(&old)).is_empty(), "settings stay changeable");
}

#[test]
fn the_broker_is_a_secret_or_a_rabbitmq_cluster_never_both_and_stays_what_it_was() {
    let exactly = ["spec.broker needs exactly one of secretRef and rabbitmqClusterReference"];
    let cluster = json!({"rabbitmqClusterReference": {"name": "rabbit", "namespace": "messaging"}});
    let on_cluster = with(&["broker"], cluster.clone());
    assert!(rejections(&on_cluster, None).is_empty(), "{:?}", rejections(&on_cluster, None));
    let both = with(&["broker", "rabbitmqClusterReference"], json!({"name": "rabbit"}));
    assert_eq!(rejections(&both, None), exactly);
    assert_eq!(rejections(&with(&["broker"], json!({"vhost": "orders"})), None), exactly);
    assert_eq!(
        rejections(&on_cluster, Some(&policy(base_spec()))),
        ["spec.broker is immutable: create a new QueuePolicy for another broker"],
        "a Secret's policy cannot move to a cluster"
    );
    let moved = with(&["broker"], json!({"rabbitmqClusterReference": {"name": "rabbit", "namespace": "other"}}));
    assert_eq!(rejections(&moved, Some(&on_cluster)).len(), 1, "nor to another cluster");
}

#[test]
fn an_adopted_queue_is_never_deleted_by_its_policy() {
    let adopted = with(&["adopt"], json!(true));
    assert!(rejections(&adopted, None).is_empty());
    let mut deleting = adopted.clone();
    deleting["spec"]["deletionPolicy"] = json!("Delete");
    assert_eq!(
        rejections(&deleting, None),
        ["adopt: true leaves the queue to its owner, so deletionPolicy must be Retain"]
    );
}

#[test]
fn consumers_take_a_name_or_a_selector() {
    let both = with(&["consumers"], json!({"deployment": "w", "selector": {"matchLabels": {"app": "w"}}}));
    assert_eq!(
        rejections(&both, None),
        ["set exactly one of consumers.deployment, consumers.workload and consumers.selector"]
    );
    let neither = with(&["consumers"], json!({"minAttached": 1}));
    assert_eq!(rejections(&neither, None).len(), 1);
    let selector = with(&["consumers"], json!({"selector": {"matchLabels": {"app": "w"}}}));
    assert!(rejections(&selector, None).is_empty());
}

#[test]
fn schema_constraints_that_are_not_cel() {
    let s = schema();
    let queue = &s["properties"]["spec"]["properties"]["queue"]["properties"];
    assert_eq!(queue["expires"]["pattern"], json!(queueguard::duration::PATTERN));
    assert_eq!(queue["expires"]["default"], json!("30m"));
    assert_eq!(queue["name"]["maxLength"], json!(255));
    assert_eq!(queue["type"]["enum"], json!(["classic", "quorum"]));
    assert_eq!(queue["settings"]["enum"], json!(["Policy", "Arguments"]));
    assert_eq!(queue["keepAlive"]["default"], json!(true));
    let overflow = &queue["overflow"];
    assert_eq!(overflow["nullable"], json!(true));
    let values: Vec<Value> = [Overflow::DropHead, Overflow::RejectPublish, Overflow::RejectPublishDlx]
        .iter()
        .map(|o| serde_json::to_value(o).unwrap())
        .collect();
    assert_eq!(overflow["enum"], json!(values), "the hand-written schema lists exactly the enum's values, no null");
}
