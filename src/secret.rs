//! Broker credentials from a Kubernetes Secret: key `uri`, optional `managementUri`, `caCert`,
//! `addresses` and `prometheusUri`.

use crate::{
    broker::BrokerCredentials,
    rabbitmq_cluster,
    status::{Check, Reason},
};
use k8s_openapi::api::core::v1::Secret;

pub const URI_KEY: &str = "uri";
pub const MANAGEMENT_URI_KEY: &str = "managementUri";
pub const CA_CERT_KEY: &str = "caCert";
pub const ADDRESSES_KEY: &str = "addresses";
pub const PROMETHEUS_URI_KEY: &str = "prometheusUri";
/// Every key the operator reads, from its own Secrets and from a RabbitmqCluster's default-user
/// and CA Secrets; a Secret's other keys are never kept.
pub const KEYS: [&str; 10] = [
    URI_KEY,
    MANAGEMENT_URI_KEY,
    CA_CERT_KEY,
    ADDRESSES_KEY,
    PROMETHEUS_URI_KEY,
    rabbitmq_cluster::DEFAULT_USER_KEYS[0],
    rabbitmq_cluster::DEFAULT_USER_KEYS[1],
    rabbitmq_cluster::DEFAULT_USER_KEYS[2],
    rabbitmq_cluster::DEFAULT_USER_KEYS[3],
    rabbitmq_cluster::CA_KEY,
];

/// Reads the credentials, or says which key is missing or unreadable (never its value).
pub fn credentials(secret: &Secret) -> Result<BrokerCredentials, Check> {
    let name = secret.metadata.name.as_deref().unwrap_or_default();
    let read = |key: &str| -> Result<Option<String>, Check> {
        let from_data = secret.data.as_ref().and_then(|d| d.get(key)).map(|b| b.0.clone());
        // stringData is write-only on a cluster, but manifests read in local mode carry it.
        let from_string_data = || secret.string_data.as_ref().and_then(|d| d.get(key)).map(|s| s.clone().into_bytes());
        match from_data.or_else(from_string_data) {
            None => Ok(None),
            Some(bytes) => {
                String::from_utf8(bytes).map(|s| Some(s.trim().to_owned()).filter(|s| !s.is_empty())).map_err(|_| {
                    Check::failed(Reason::InvalidBrokerUri, format!("Secret '{name}' key '{key}' is not UTF-8 text"))
                })
            }
        }
    };
    let uri = read(URI_KEY)?.ok_or_else(|| {
        Check::failed(
            Reason::SecretKeyMissing,
            format!("Secret '{name}' has no key '{URI_KEY}' (expected amqp[s]://user:password@host:port/vhost)"),
        )
    })?;
    Ok(BrokerCredentials {
        uri,
        management_uri: read(MANAGEMENT_URI_KEY)?,
        ca_cert: read(CA_CERT_KEY)?,
        addresses: read(ADDRESSES_KEY)?,
        prometheus_uri: read(PROMETHEUS_URI_KEY)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn secret(data: &[(&str, &str)]) -> Secret {
        let mut s = Secret::default();
        s.metadata.name = Some("rabbitmq".into());
        s.data =
            Some(data.iter().map(|(k, v)| (k.to_string(), k8s_openapi::ByteString(v.as_bytes().to_vec()))).collect());
        s
    }

    #[test]
    fn reads_uri_and_optional_keys() {
        let c = credentials(&secret(&[
            ("uri", "amqp://u:p@h/\n"),
            ("managementUri", "http://h:15672"),
            ("prometheusUri", "http://h:15693"),
        ]))
        .unwrap();
        assert_eq!(c.uri, "amqp://u:p@h/");
        assert_eq!(c.management_uri.as_deref(), Some("http://h:15672"));
        assert_eq!(c.prometheus_uri.as_deref(), Some("http://h:15693"));
        assert_eq!(c.ca_cert, None);
    }

    #[test]
    fn missing_uri_names_the_key_and_never_a_value() {
        let err = credentials(&secret(&[("url", "amqp://u:topsecret@h/")])).unwrap_err();
        assert_eq!(err.reason, Reason::SecretKeyMissing);
        assert!(err.message.contains("no key 'uri'"), "{}", err.message);
        assert!(!err.message.contains("topsecret"));
        let empty = credentials(&secret(&[("uri", "  ")])).unwrap_err();
        assert_eq!(empty.reason, Reason::SecretKeyMissing);
    }

    #[test]
    fn string_data_counts_in_manifests() {
        let s = Secret {
            string_data: Some(BTreeMap::from([("uri".to_string(), "amqp://u:p@h/".to_string())])),
            ..Default::default()
        };
        assert_eq!(credentials(&s).unwrap().uri, "amqp://u:p@h/");
    }
}
