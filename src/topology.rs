//! Queues declared by the RabbitMQ Messaging Topology Operator (`rabbitmq.com/v1beta1` `Queue`).
//! One that names the same queue on the same broker and vhost as a QueuePolicy is managed
//! elsewhere: the policy touches nothing, unless it says `adopt: true` (then it only reports and
//! guards). Deciding which Queue that is, is this module's (pure); watching them is the
//! controller's.

use crate::broker_source::BrokerSource;
use kube::{CustomResource, ResourceExt};
use serde::{Deserialize, Serialize};

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "rabbitmq.com",
    version = "v1beta1",
    kind = "Queue",
    namespaced,
    schema = "disabled",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct QueueSpec {
    /// The queue's name on the broker.
    #[serde(default)]
    pub name: String,
    /// Default `/`.
    #[serde(default)]
    pub vhost: Option<String>,
    #[serde(default)]
    pub rabbitmq_cluster_reference: ClusterReference,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterReference {
    /// A RabbitmqCluster; default namespace: the Queue's.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
    /// Or a Secret with the broker's address (`uri`) and credentials.
    #[serde(default)]
    pub connection_secret: Option<SecretName>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SecretName {
    pub name: String,
}

/// The broker a QueuePolicy reached, as far as a Topology Operator Queue can be compared with it.
pub struct Place<'a> {
    /// The policy's namespace.
    pub namespace: &'a str,
    pub source: &'a BrokerSource,
    /// The hosts its nodes are reached at.
    pub hosts: Vec<&'a str>,
    pub vhost: &'a str,
}

/// The Topology Operator Queue (`namespace/name`) that declares `queue` where `place` is, if any.
/// A Queue is on the same broker when it names the same RabbitmqCluster, or, for a policy on a
/// Secret, when one of the Secret's hosts is that cluster's Service (`<name>.<ns>.svc`, with or
/// without the cluster domain, as the Cluster Operator's default user Secret writes it). A Queue
/// on a connection Secret of its own names no cluster to compare: it is not matched.
pub fn managed_elsewhere<'q>(
    queue: &str,
    place: &Place,
    queues: impl IntoIterator<Item = &'q Queue>,
) -> Option<String> {
    queues
        .into_iter()
        .filter(|q| q.metadata.deletion_timestamp.is_none())
        .filter(|q| q.spec.name == queue && q.spec.vhost.as_deref().unwrap_or("/") == place.vhost)
        .find(|q| {
            let reference = &q.spec.rabbitmq_cluster_reference;
            let Some(cluster) = reference.name.as_deref().filter(|_| reference.connection_secret.is_none()) else {
                return false;
            };
            let queue_ns = q.namespace().unwrap_or_default();
            let cluster_ns = reference.namespace.as_deref().unwrap_or(&queue_ns);
            match place.source {
                BrokerSource::RabbitmqCluster { name, namespace } => {
                    name == cluster && namespace.as_deref().unwrap_or(place.namespace) == cluster_ns
                }
                BrokerSource::Secret { .. } => place.hosts.iter().any(|h| is_service_of(h, cluster, cluster_ns)),
            }
        })
        .map(|q| format!("{}/{}", q.namespace().unwrap_or_default(), q.name_any()))
}

/// Whether `host` names RabbitmqCluster `ns/name`: its Service, or one of its pods through the
/// headless Service (`<name>-server-<i>.<name>-nodes.<ns>`).
fn is_service_of(host: &str, name: &str, ns: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if names_service(&host, &format!("{name}.{ns}")) {
        return true;
    }
    let Some((pod, rest)) = host.split_once('.') else { return false };
    pod.strip_prefix(&format!("{name}-server-")).is_some_and(|i| i.parse::<u32>().is_ok())
        && names_service(rest, &format!("{name}-nodes.{ns}"))
}

/// Whether `host` is the Service `short` (`name.namespace`), with or without `.svc` and the
/// cluster domain.
fn names_service(host: &str, short: &str) -> bool {
    host == short || host.strip_prefix(short).is_some_and(|rest| rest == ".svc" || rest.starts_with(".svc."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(ns: &str, yaml_spec: &str) -> Queue {
        serde_yaml_ng::from_str(&format!(
            "apiVersion: rabbitmq.com/v1beta1\nkind: Queue\nmetadata: {{name: orders-queue, namespace: {ns}}}\nspec: {yaml_spec}\n"
        ))
        .unwrap()
    }

    fn place<'a>(source: &'a BrokerSource, hosts: Vec<&'a str>, vhost: &'a str) -> Place<'a> {
        Place { namespace: "shop", source, hosts, vhost }
    }

    #[test]
    fn the_same_queue_on_the_same_cluster_and_vhost_is_managed_elsewhere() {
        let cluster = BrokerSource::RabbitmqCluster { name: "rabbit".into(), namespace: None };
        let here = place(&cluster, vec!["rabbit.shop.svc"], "/");
        let same = queue("shop", "{name: orders, rabbitmqClusterReference: {name: rabbit}}");
        assert_eq!(managed_elsewhere("orders", &here, [&same]), Some("shop/orders-queue".into()));
        assert_eq!(managed_elsewhere("payments", &here, [&same]), None, "another queue");
        let other_vhost = queue("shop", "{name: orders, vhost: billing, rabbitmqClusterReference: {name: rabbit}}");
        assert_eq!(managed_elsewhere("orders", &here, [&other_vhost]), None);
        let other_cluster = queue("shop", "{name: orders, rabbitmqClusterReference: {name: rabbit2}}");
        assert_eq!(managed_elsewhere("orders", &here, [&other_cluster]), None);
        // A Queue in another namespace on this cluster, named with its namespace.
        let from_afar = queue("billing", "{name: orders, rabbitmqClusterReference: {name: rabbit, namespace: shop}}");
        assert_eq!(managed_elsewhere("orders", &here, [&from_afar]), Some("billing/orders-queue".into()));
        let its_own = queue("billing", "{name: orders, rabbitmqClusterReference: {name: rabbit}}");
        assert_eq!(managed_elsewhere("orders", &here, [&its_own]), None, "billing's own cluster rabbit");
        let mut leaving = same.clone();
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(managed_elsewhere("orders", &here, [&leaving]), None, "one being deleted lets go");
    }

    #[test]
    fn a_policy_on_a_secret_matches_by_the_clusters_service_name() {
        let secret = BrokerSource::Secret { name: "rabbitmq".into() };
        let same = queue("shop", "{name: orders, rabbitmqClusterReference: {name: rabbit}}");
        let hosts = [
            "rabbit.shop.svc",
            "rabbit.shop",
            "rabbit.shop.svc.cluster.local",
            "RABBIT.shop.svc.",
            "rabbit-server-2.rabbit-nodes.shop.svc",
        ];
        for host in hosts {
            assert!(
                managed_elsewhere("orders", &place(&secret, vec!["10.0.0.1", host], "/"), [&same]).is_some(),
                "{host}"
            );
        }
        for host in ["rabbit", "rabbit.shopping.svc", "rabbit-server-x.rabbit-nodes.shop.svc", "broker.example.com"] {
            assert!(managed_elsewhere("orders", &place(&secret, vec![host], "/"), [&same]).is_none(), "{host}");
        }
        let by_secret = queue("shop", "{name: orders, rabbitmqClusterReference: {connectionSecret: {name: rabbitmq}}}");
        assert!(managed_elsewhere("orders", &place(&secret, vec!["rabbit.shop.svc"], "/"), [&by_secret]).is_none());
    }
}
