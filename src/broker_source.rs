//! Where a policy's broker credentials come from: a Secret, or a RabbitMQ Cluster Operator's
//! RabbitmqCluster.

use crate::crd::BrokerSpec;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BrokerSource {
    /// A Secret in the policy's namespace.
    Secret { name: String },
    /// A RabbitmqCluster; `namespace` None is the policy's.
    RabbitmqCluster { name: String, namespace: Option<String> },
}

impl BrokerSource {
    /// The spec's one source; None when it names neither or both (the plan says which).
    pub fn of(spec: &BrokerSpec) -> Option<Self> {
        match (&spec.secret_ref, &spec.rabbitmq_cluster_reference) {
            (Some(secret), None) => Some(Self::Secret { name: secret.name.clone() }),
            (None, Some(cluster)) => {
                Some(Self::RabbitmqCluster { name: cluster.name.clone(), namespace: cluster.namespace.clone() })
            }
            _ => None,
        }
    }

    /// The object it names, as (namespace, kind, name), for a policy in `policy_ns` (None where
    /// a manifest leaves it unsaid): two policies whose sources are the same object use the same
    /// broker.
    pub fn object<'a>(&'a self, policy_ns: Option<&'a str>) -> (Option<&'a str>, &'static str, &'a str) {
        match self {
            Self::Secret { name } => (policy_ns, "Secret", name),
            Self::RabbitmqCluster { name, namespace } => (namespace.as_deref().or(policy_ns), "RabbitmqCluster", name),
        }
    }
}

impl fmt::Display for BrokerSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Secret { name } => write!(f, "Secret '{name}'"),
            Self::RabbitmqCluster { name, namespace: Some(ns) } => write!(f, "RabbitmqCluster '{ns}/{name}'"),
            Self::RabbitmqCluster { name, namespace: None } => write!(f, "RabbitmqCluster '{name}'"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{RabbitmqClusterReference, SecretRef};

    fn spec(secret: Option<&str>, cluster: Option<(&str, Option<&str>)>) -> BrokerSpec {
        BrokerSpec {
            secret_ref: secret.map(|name| SecretRef { name: name.into() }),
            rabbitmq_cluster_reference: cluster
                .map(|(name, ns)| RabbitmqClusterReference { name: name.into(), namespace: ns.map(Into::into) }),
            vhost: None,
        }
    }

    #[test]
    fn exactly_one_source() {
        assert_eq!(
            BrokerSource::of(&spec(Some("rabbitmq"), None)),
            Some(BrokerSource::Secret { name: "rabbitmq".into() })
        );
        assert_eq!(BrokerSource::of(&spec(None, None)), None);
        assert_eq!(BrokerSource::of(&spec(Some("rabbitmq"), Some(("rabbit", None)))), None);
    }

    #[test]
    fn a_cluster_in_the_policys_namespace_is_the_same_object_however_it_is_written() {
        let implicit = BrokerSource::of(&spec(None, Some(("rabbit", None)))).unwrap();
        let explicit = BrokerSource::of(&spec(None, Some(("rabbit", Some("shop"))))).unwrap();
        assert_eq!(implicit.object(Some("shop")), explicit.object(Some("shop")));
        assert_ne!(implicit.object(Some("billing")), explicit.object(Some("billing")));
        assert_ne!(BrokerSource::Secret { name: "rabbit".into() }.object(Some("shop")), implicit.object(Some("shop")));
        assert_eq!(explicit.to_string(), "RabbitmqCluster 'shop/rabbit'");
    }
}
