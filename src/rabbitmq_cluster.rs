//! Brokers made by the RabbitMQ Cluster Operator: a `RabbitmqCluster` (rabbitmq.com/v1beta1)
//! names, in its status, the Secret of its default user (keys `username`, `password`, `host`,
//! `port`; no `uri`) and the Service in front of it. From those, the credentials the rest of
//! the operator reads from a `uri` Secret.
//!
//! Only the fields read here are modelled; the rest of the object is ignored (the schema is the
//! Cluster Operator's; a trimmed copy of it in tests/fixtures checks these paths).

use crate::{
    broker::BrokerCredentials,
    status::{Check, Reason},
};
use k8s_openapi::api::core::v1::Secret;
use kube::CustomResource;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The annotation with which a RabbitmqCluster lets other namespaces' objects use it: namespaces,
/// comma separated, or `*` (the Messaging Topology Operator's).
pub const ALLOWED_NAMESPACES: &str = "rabbitmq.com/topology-allowed-namespaces";
/// The CA certificate's key in a TLS or CA Secret.
pub const CA_KEY: &str = "ca.crt";
/// The keys of a default-user Secret the operator reads.
pub const DEFAULT_USER_KEYS: [&str; 4] = ["username", "password", "host", "port"];

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "rabbitmq.com",
    version = "v1beta1",
    kind = "RabbitmqCluster",
    namespaced,
    status = "RabbitmqClusterStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct RabbitmqClusterSpec {
    /// The StatefulSet's pods (the Cluster Operator's default: 1).
    #[serde(default)]
    pub replicas: Option<i32>,
    #[serde(default)]
    pub tls: Option<TlsSpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TlsSpec {
    /// The server's certificate (kubernetes.io/tls); set, the cluster listens with TLS.
    #[serde(default)]
    pub secret_name: Option<String>,
    /// The CA that signed it, key `ca.crt`.
    #[serde(default)]
    pub ca_secret_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RabbitmqClusterStatus {
    #[serde(default)]
    pub binding: Option<LocalRef>,
    #[serde(default)]
    pub default_user: Option<DefaultUser>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct LocalRef {
    pub name: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DefaultUser {
    #[serde(default)]
    pub secret_reference: Option<SecretReference>,
    #[serde(default)]
    pub service_reference: Option<ServiceReference>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SecretReference {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    /// Which key holds `username`, `password`, `host` and `port`.
    #[serde(default)]
    pub keys: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ServiceReference {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
}

impl RabbitmqCluster {
    fn who(&self) -> String {
        format!(
            "RabbitmqCluster '{}/{}'",
            self.metadata.namespace.as_deref().unwrap_or_default(),
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }

    /// Whether an object in `namespace` may use it: its own namespace's always, another only
    /// where the annotation lists it or `*`.
    pub fn allows(&self, namespace: &str) -> bool {
        self.metadata.namespace.as_deref() == Some(namespace)
            || self
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ALLOWED_NAMESPACES))
                .is_some_and(|list| list.split(',').map(str::trim).any(|n| n == namespace || n == "*"))
    }

    /// The default user's Secret, once the Cluster Operator has made it.
    pub fn default_user_secret(&self) -> Result<&str, Check> {
        let status = self.status.as_ref();
        status
            .and_then(|s| s.default_user.as_ref())
            .and_then(|d| d.secret_reference.as_ref())
            .map(|r| r.name.as_str())
            .or_else(|| status.and_then(|s| s.binding.as_ref()).map(|b| b.name.as_str()))
            .ok_or_else(|| {
                Check::failed(
                    Reason::RabbitmqClusterNotReady,
                    format!("{} has no default user yet (status.defaultUser is empty): the RabbitMQ Cluster Operator has not finished creating it", self.who()),
                )
            })
    }

    /// The Secret holding the CA its TLS certificate is signed by, when it listens with TLS: the
    /// CA Secret, else the TLS Secret itself (cert-manager writes `ca.crt` there).
    pub fn ca_secret(&self) -> Option<&str> {
        let tls = self.spec.tls.as_ref()?;
        tls.ca_secret_name.as_deref().or(tls.secret_name.as_deref()).filter(|n| !n.is_empty())
    }

    fn tls(&self) -> bool {
        self.spec.tls.as_ref().and_then(|t| t.secret_name.as_deref()).is_some_and(|n| !n.is_empty())
    }

    /// The keys of its default-user Secret that hold `username`, `password`, `host` and `port`.
    pub fn default_user_keys(&self) -> [&str; 4] {
        DEFAULT_USER_KEYS.map(|k| self.key(k))
    }

    /// The key of the default-user Secret that holds `what`.
    fn key<'a>(&'a self, what: &'a str) -> &'a str {
        self.status
            .as_ref()
            .and_then(|s| s.default_user.as_ref())
            .and_then(|d| d.secret_reference.as_ref())
            .and_then(|r| r.keys.get(what))
            .map_or(what, String::as_str)
    }

    /// The credentials, from its default user's Secret (and the CA's, when it listens with TLS).
    /// The Secret's `host` is the Service's DNS name; with more than one replica every pod of
    /// the StatefulSet, named by the headless Service `<name>-nodes`, is a node to try in turn,
    /// as the Secret's `addresses` lists them.
    pub fn credentials(&self, user: &Secret, ca: Option<&Secret>) -> Result<BrokerCredentials, Check> {
        let secret_name = user.metadata.name.as_deref().unwrap_or_default();
        let read = |key: &str| -> Result<String, Check> {
            let text = user
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|b| String::from_utf8(b.0.clone()))
                .transpose()
                .map_err(|_| {
                    Check::failed(
                        Reason::InvalidBrokerUri,
                        format!("Secret '{secret_name}' key '{key}' is not UTF-8 text"),
                    )
                })?
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty());
            text.ok_or_else(|| {
                Check::failed(
                    Reason::SecretKeyMissing,
                    format!("Secret '{secret_name}' of {} has no key '{key}'", self.who()),
                )
            })
        };
        let [username, password, host, port] = self.default_user_keys().map(read);
        let (username, password, host, port) = (username?, password?, host?, port?);
        let port: u16 = port.parse().map_err(|_| {
            Check::failed(Reason::InvalidBrokerUri, format!("Secret '{secret_name}' key 'port' is not a port number"))
        })?;
        let scheme = if self.tls() { "amqps" } else { "amqp" };
        let encode = |s: &str| utf8_percent_encode(s, NON_ALPHANUMERIC).to_string();
        let uri = format!("{scheme}://{}:{}@{}:{port}/", encode(&username), encode(&password), bracket(&host));
        let addresses =
            self.pods().map(|pods| pods.iter().map(|p| format!("{p}:{port}")).collect::<Vec<_>>().join(","));
        let ca_cert = ca
            .and_then(|s| s.data.as_ref())
            .and_then(|d| d.get(CA_KEY))
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|pem| !pem.trim().is_empty());
        Ok(BrokerCredentials { uri, management_uri: None, ca_cert, addresses, prometheus_uri: None })
    }

    /// The DNS names of its pods, when there is more than one: `<name>-server-<i>.<name>-nodes.<ns>.svc`.
    fn pods(&self) -> Option<Vec<String>> {
        let replicas = self.spec.replicas.unwrap_or(1);
        if replicas < 2 {
            return None;
        }
        let name = self.metadata.name.as_deref()?;
        let ns = self.metadata.namespace.as_deref()?;
        Some((0..replicas).map(|i| format!("{name}-server-{i}.{name}-nodes.{ns}.svc")).collect())
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::uri::BrokerUri;
    use k8s_openapi::ByteString;

    fn cluster(yaml: &str) -> RabbitmqCluster {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    const MADE: &str = "apiVersion: rabbitmq.com/v1beta1\nkind: RabbitmqCluster\nmetadata: {name: rabbit, namespace: messaging}\nspec: {replicas: 1, image: rabbitmq:4.0-management, resources: {}}\nstatus:\n  binding: {name: rabbit-default-user}\n  defaultUser:\n    secretReference: {name: rabbit-default-user, namespace: messaging, keys: {username: username, password: password, host: host, port: port}}\n    serviceReference: {name: rabbit, namespace: messaging}\n  conditions: []\n";

    fn user(pairs: &[(&str, &str)]) -> Secret {
        let mut s = Secret::default();
        s.metadata.name = Some("rabbit-default-user".into());
        s.data = Some(pairs.iter().map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec()))).collect());
        s
    }

    const WRITTEN: [(&str, &str); 6] = [
        ("username", "default_user_x/Y+z"),
        ("password", "p@ss:w/rd"),
        ("host", "rabbit.messaging.svc"),
        ("port", "5672"),
        ("provider", "rabbitmq"),
        ("type", "rabbitmq"),
    ];

    #[test]
    fn the_default_users_secret_becomes_a_uri_the_broker_code_reads_back_exactly() {
        let creds = cluster(MADE).credentials(&user(&WRITTEN), None).unwrap();
        assert_eq!(creds.addresses, None, "one replica: the Service");
        let uri = BrokerUri::parse_cluster(&creds.uri, None, None).unwrap();
        assert_eq!(uri.amqp().authority.userinfo.username, "default_user_x/Y+z");
        assert_eq!(uri.amqp().authority.userinfo.password, "p@ss:w/rd");
        assert_eq!((uri.amqp().authority.host.as_str(), uri.amqp().authority.port), ("rabbit.messaging.svc", 5672));
        assert_eq!(uri.vhost(), "/");
        assert_eq!(uri.management().base_url().as_str(), "http://rabbit.messaging.svc:15672/");
        assert!(!format!("{creds:?}").contains("p@ss"), "credentials never in Debug");
    }

    #[test]
    fn three_replicas_are_three_nodes_and_tls_is_amqps_with_the_clusters_ca() {
        let yaml = MADE.replace(
            "spec: {replicas: 1,",
            "spec: {replicas: 3, tls: {secretName: rabbit-tls, caSecretName: rabbit-ca},",
        );
        let c = cluster(&yaml);
        assert_eq!(c.ca_secret(), Some("rabbit-ca"));
        let mut written = WRITTEN;
        written[3] = ("port", "5671");
        let ca = Secret {
            data: Some([(CA_KEY.to_owned(), ByteString(b"-----BEGIN CERTIFICATE-----\n".to_vec()))].into()),
            ..Default::default()
        };
        let creds = c.credentials(&user(&written), Some(&ca)).unwrap();
        assert!(creds.ca_cert.as_deref().unwrap().starts_with("-----BEGIN CERTIFICATE"));
        let uri = BrokerUri::parse_cluster(&creds.uri, None, creds.addresses.as_deref()).unwrap();
        assert!(uri.is_tls());
        let nodes: Vec<String> = uri.nodes().iter().map(ToString::to_string).collect();
        assert_eq!(
            nodes,
            [0, 1, 2].map(|i| format!("rabbit-server-{i}.rabbit-nodes.messaging.svc:5671")),
            "every pod, in order"
        );
        assert_eq!(uri.management().base_urls.len(), 3);
        assert_eq!(uri.management().base_url().as_str(), "https://rabbit-server-0.rabbit-nodes.messaging.svc:15671/");
        // Without a CA Secret, the TLS Secret's own ca.crt (as cert-manager writes it).
        let own = cluster(&MADE.replace("spec: {replicas: 1,", "spec: {tls: {secretName: rabbit-tls},"));
        assert_eq!(own.ca_secret(), Some("rabbit-tls"));
        assert_eq!(cluster(MADE).ca_secret(), None);
    }

    #[test]
    fn renamed_keys_are_followed_and_a_missing_one_is_named_without_any_value() {
        let yaml = MADE.replace("username: username", "username: user");
        let mut written = WRITTEN;
        written[0] = ("user", "renamed");
        let creds = cluster(&yaml).credentials(&user(&written), None).unwrap();
        assert!(creds.uri.starts_with("amqp://renamed:"));
        let err = cluster(MADE).credentials(&user(&WRITTEN[1..]), None).unwrap_err();
        assert_eq!(err.reason, Reason::SecretKeyMissing);
        assert_eq!(
            err.message,
            "Secret 'rabbit-default-user' of RabbitmqCluster 'messaging/rabbit' has no key 'username'"
        );
        let mut bad_port = WRITTEN;
        bad_port[3] = ("port", "amqp");
        let err = cluster(MADE).credentials(&user(&bad_port), None).unwrap_err();
        assert_eq!(err.reason, Reason::InvalidBrokerUri);
        assert!(!err.message.contains("p@ss"));
    }

    #[test]
    fn a_cluster_being_made_has_no_default_user_yet() {
        let making = cluster("metadata: {name: rabbit, namespace: messaging}\nspec: {}\nstatus: {conditions: []}\n");
        let err = making.default_user_secret().unwrap_err();
        assert_eq!(err.reason, Reason::RabbitmqClusterNotReady);
        assert!(
            err.message.starts_with("RabbitmqCluster 'messaging/rabbit' has no default user yet"),
            "{}",
            err.message
        );
        assert_eq!(cluster(MADE).default_user_secret().unwrap(), "rabbit-default-user");
    }

    #[test]
    fn other_namespaces_only_by_the_annotation() {
        let c = cluster(MADE);
        assert!(c.allows("messaging"));
        assert!(!c.allows("shop"));
        let listed = cluster(&MADE.replace(
            "namespace: messaging}\nspec",
            "namespace: messaging, annotations: {rabbitmq.com/topology-allowed-namespaces: 'billing, shop'}}\nspec",
        ));
        assert!(listed.allows("shop") && listed.allows("billing") && !listed.allows("shopping"));
        let all = cluster(&MADE.replace(
            "namespace: messaging}\nspec",
            "namespace: messaging, annotations: {rabbitmq.com/topology-allowed-namespaces: '*'}}\nspec",
        ));
        assert!(all.allows("anything"));
    }
}
