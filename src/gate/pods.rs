//! Pods and their consumers: which consumer belongs to which pod, and what the pod's
//! `queueguard.io/consumer-attached` condition should say.

use crate::{consumers::Consumer, crd::MatchBy};
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, HashMap};

/// The readiness gate (and pod condition type) the operator owns.
pub const GATE_CONDITION: &str = "queueguard.io/consumer-attached";

/// The gate condition as it stands on a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateCondition {
    pub status: bool,
    pub reason: String,
    pub since_ms: i64,
}

/// What the gate needs to know about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    pub name: String,
    pub uid: String,
    pub ips: Vec<String>,
    pub has_gate: bool,
    pub condition: Option<GateCondition>,
    /// When its containers last became ready; None while they are not.
    pub containers_ready_since_ms: Option<i64>,
    pub deleting: bool,
}

impl PodFacts {
    pub fn from_pod(pod: &Pod) -> Self {
        let status = pod.status.as_ref();
        let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
        let ms = |t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
            t.as_ref().map_or(0, |t| t.0.as_millisecond())
        };
        let condition = conditions.iter().find(|c| c.type_ == GATE_CONDITION).map(|c| GateCondition {
            status: c.status == "True",
            reason: c.reason.clone().unwrap_or_default(),
            since_ms: ms(&c.last_transition_time),
        });
        let containers_ready_since_ms = conditions
            .iter()
            .find(|c| c.type_ == "ContainersReady" && c.status == "True")
            .map(|c| ms(&c.last_transition_time));
        let mut ips: Vec<String> = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().map(|ip| ip.ip.clone()).collect())
            .unwrap_or_default();
        if let Some(ip) = status.and_then(|s| s.pod_ip.clone())
            && !ips.contains(&ip)
        {
            ips.insert(0, ip);
        }
        Self {
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            ips,
            has_gate: pod
                .spec
                .as_ref()
                .and_then(|s| s.readiness_gates.as_ref())
                .is_some_and(|g| g.iter().any(|g| g.condition_type == GATE_CONDITION)),
            condition,
            containers_ready_since_ms,
            deleting: pod.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// Consumers sorted out by pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Matching {
    pub by_pod: BTreeMap<String, Vec<Consumer>>,
    /// Consumers that belong to no pod (another client, or a NAT address).
    pub unmatched: Vec<Consumer>,
    /// IPs shared by several pods (hostNetwork): consumers from them cannot be attributed.
    pub ambiguous_ips: Vec<String>,
}

/// Attributes consumers to pods by peer IP or by the pod name inside the connection name.
pub fn match_consumers(pods: &[PodFacts], consumers: &[Consumer], by: MatchBy) -> Matching {
    let mut m = Matching::default();
    let mut owners: HashMap<&str, Vec<&str>> = HashMap::new();
    for pod in pods {
        for ip in &pod.ips {
            owners.entry(ip.as_str()).or_default().push(pod.name.as_str());
        }
    }
    let mut ambiguous: Vec<String> = owners.iter().filter(|(_, p)| p.len() > 1).map(|(ip, _)| ip.to_string()).collect();
    ambiguous.sort();
    for consumer in consumers {
        let owner = match by {
            MatchBy::PodIp => consumer
                .peer_host
                .as_deref()
                .and_then(|ip| owners.get(ip))
                .filter(|p| p.len() == 1)
                .map(|p| p[0].to_owned()),
            MatchBy::ConnectionName => consumer
                .connection_name
                .as_deref()
                .and_then(|name| pods.iter().find(|p| contains_token(name, &p.name)))
                .map(|p| p.name.clone()),
        };
        match owner {
            Some(pod) => m.by_pod.entry(pod).or_default().push(consumer.clone()),
            None => m.unmatched.push(consumer.clone()),
        }
    }
    if by == MatchBy::PodIp {
        m.ambiguous_ips = ambiguous;
    }
    m
}

/// `name` appears in `haystack` as a whole token: `worker-7d9c-x2` is in `app/worker-7d9c-x2:1`
/// but not in `worker-7d9c-x2b`.
fn contains_token(haystack: &str, name: &str) -> bool {
    let is_name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
    haystack.match_indices(name).any(|(i, _)| {
        let before = haystack[..i].chars().next_back();
        let after = haystack[i + name.len()..].chars().next();
        !before.is_some_and(is_name_char) && !after.is_some_and(is_name_char)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumers::QueueKey;
    use k8s_openapi::api::core::v1::{PodCondition, PodIP, PodReadinessGate, PodSpec, PodStatus};

    pub fn pod(name: &str, ip: Option<&str>) -> PodFacts {
        PodFacts {
            name: name.into(),
            uid: format!("uid-{name}"),
            ips: ip.map(|i| vec![i.to_owned()]).unwrap_or_default(),
            has_gate: true,
            condition: None,
            containers_ready_since_ms: Some(0),
            deleting: false,
        }
    }

    pub fn consumer(peer: Option<&str>, connection: Option<&str>) -> Consumer {
        Consumer {
            queue: QueueKey::new("/", "orders"),
            tag: format!("tag-{}", peer.or(connection).unwrap_or("x")),
            channel: "c".into(),
            peer_host: peer.map(Into::into),
            connection_name: connection.map(Into::into),
            prefetch: 10,
            ack_required: true,
            since_ms: 0,
        }
    }

    #[test]
    fn matches_by_pod_ip() {
        let pods = [pod("a", Some("10.0.0.1")), pod("b", Some("10.0.0.2")), pod("pending", None)];
        let consumers = [consumer(Some("10.0.0.2"), None), consumer(Some("192.168.1.1"), None), consumer(None, None)];
        let m = match_consumers(&pods, &consumers, MatchBy::PodIp);
        assert_eq!(m.by_pod.keys().collect::<Vec<_>>(), ["b"]);
        assert_eq!(m.unmatched.len(), 2, "a NAT'd peer and a consumer without a peer match no pod");
        assert!(m.ambiguous_ips.is_empty());
    }

    #[test]
    fn shared_ips_are_ambiguous_not_guessed() {
        let pods = [pod("a", Some("10.0.0.9")), pod("b", Some("10.0.0.9"))];
        let m = match_consumers(&pods, &[consumer(Some("10.0.0.9"), None)], MatchBy::PodIp);
        assert!(m.by_pod.is_empty());
        assert_eq!(m.ambiguous_ips, ["10.0.0.9"]);
    }

    #[test]
    fn matches_by_connection_name_token() {
        let pods = [pod("worker-7d9c-x2", Some("10.0.0.1")), pod("worker-7d9c-x2b", Some("10.0.0.2"))];
        let consumers = [
            consumer(Some("172.16.0.1"), Some("orders/worker-7d9c-x2b")),
            consumer(Some("172.16.0.1"), Some("worker-7d9c-x2:consumer")),
            consumer(Some("172.16.0.1"), Some("someone-else")),
        ];
        let m = match_consumers(&pods, &consumers, MatchBy::ConnectionName);
        assert_eq!(m.by_pod["worker-7d9c-x2"].len(), 1);
        assert_eq!(m.by_pod["worker-7d9c-x2b"].len(), 1);
        assert_eq!(m.unmatched.len(), 1);
    }

    #[test]
    fn facts_from_a_pod() {
        let p = Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("w-1".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                readiness_gates: Some(vec![PodReadinessGate { condition_type: GATE_CONDITION.into() }]),
                ..Default::default()
            }),
            status: Some(PodStatus {
                pod_ip: Some("10.1.1.1".into()),
                pod_ips: Some(vec![PodIP { ip: "10.1.1.1".into() }, PodIP { ip: "fd00::1".into() }]),
                conditions: Some(vec![
                    PodCondition {
                        type_: "ContainersReady".into(),
                        status: "True".into(),
                        last_transition_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                            k8s_openapi::jiff::Timestamp::from_millisecond(5_000).unwrap(),
                        )),
                        ..Default::default()
                    },
                    PodCondition {
                        type_: GATE_CONDITION.into(),
                        status: "False".into(),
                        reason: Some("NoConsumer".into()),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
        };
        let f = PodFacts::from_pod(&p);
        assert_eq!(f.ips, ["10.1.1.1", "fd00::1"]);
        assert!(f.has_gate && !f.deleting);
        assert_eq!(f.containers_ready_since_ms, Some(5_000));
        assert_eq!(f.condition.as_ref().map(|c| (c.status, c.reason.as_str())), Some((false, "NoConsumer")));
        let bare = PodFacts::from_pod(&Pod::default());
        assert!(!bare.has_gate && bare.ips.is_empty() && bare.containers_ready_since_ms.is_none());
    }
}
