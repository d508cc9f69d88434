//! Pods and their consumers: what the gate needs to know of a pod, and which consumer is whose.

use crate::{
    consumers::Consumer,
    crd::MatchBy,
    names::GATE_CONDITION,
    status::Truth,
    workload::owner::{PodOwner, pod_owner},
};
use k8s_openapi::{api::core::v1::Pod, apimachinery::pkg::apis::meta::v1::Time};

/// Broker and Kubernetes clocks differ; a consumer whose connection opened up to this long
/// before its pod got its address still counts as the pod's. A stale connection left by an
/// earlier holder of a reused address is older by that pod's whole life.
pub const CLOCK_SKEW_MS: i64 = 1_000;

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
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// Its controller (a ReplicaSet or a StatefulSet), which leads to its workload.
    pub owner: Option<PodOwner>,
    pub ips: Vec<String>,
    /// When the pod got its address: its startTime, else when the operator first saw an IP on it
    /// (set by the index). A consumer connected earlier belongs to a former holder of the IP.
    pub ip_since_ms: Option<i64>,
    pub has_gate: bool,
    pub condition: Option<GateCondition>,
    /// When its containers last became ready; None while they are not.
    pub containers_ready_since_ms: Option<i64>,
    pub deleting: bool,
    /// Failed or Succeeded: it holds no address any more.
    pub terminal: bool,
}

impl PodFacts {
    pub fn from_pod(pod: &Pod) -> Self {
        let status = pod.status.as_ref();
        let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
        let ms = |t: &Option<Time>| t.as_ref().map_or(0, |t| t.0.as_millisecond());
        let condition = conditions.iter().find(|c| c.type_ == GATE_CONDITION).map(|c| GateCondition {
            status: Truth::of(&c.status) == Truth::True,
            reason: c.reason.clone().unwrap_or_default(),
            since_ms: ms(&c.last_transition_time),
        });
        let containers_ready_since_ms = conditions
            .iter()
            .find(|c| c.type_ == "ContainersReady" && Truth::of(&c.status) == Truth::True)
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
        let phase = status.and_then(|s| s.phase.as_deref());
        Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            owner: pod_owner(&pod.metadata),
            ip_since_ms: status.and_then(|s| s.start_time.as_ref()).map(|t| t.0.as_millisecond()),
            ips,
            has_gate: pod
                .spec
                .as_ref()
                .and_then(|s| s.readiness_gates.as_ref())
                .is_some_and(|g| g.iter().any(|g| g.condition_type == GATE_CONDITION)),
            condition,
            containers_ready_since_ms,
            deleting: pod.metadata.deletion_timestamp.is_some(),
            terminal: matches!(phase, Some("Failed" | "Succeeded")),
        }
    }

    /// Whether the gate condition is True on the pod now.
    pub fn is_open(&self) -> bool {
        self.condition.as_ref().is_some_and(|c| c.status)
    }
}

/// Whose a consumer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// The pod's own.
    Owned,
    /// From the pod's address or name, but connected before the pod had that address: a stale
    /// connection of an earlier holder. It never counts.
    Stale,
    /// From the pod's address or name, on a connection whose age the broker user cannot read
    /// (RabbitMQ lists other users' connections only to `monitoring` users): it may be an
    /// earlier holder's, so it opens nothing, and it may be the pod's, so it closes nothing.
    Undated,
    /// Not this pod's.
    Foreign,
}

/// Whether `consumer` is `pod`'s: by peer IP (unless `ambiguous` says the IP is shared) or by
/// the connection name ([`named_after`]), and never from before the pod's address, nor of
/// unknown age.
pub fn ownership(pod: &PodFacts, consumer: &Consumer, by: MatchBy, ambiguous: impl Fn(&str) -> bool) -> Ownership {
    // Its connection not listed (yet, or to this user): neither its name nor its age is known,
    // so it may be this pod's.
    if by == MatchBy::ConnectionName && consumer.connection_name.is_none() && consumer.connected_ms.is_none() {
        return Ownership::Undated;
    }
    let matches = match by {
        MatchBy::PodIp => {
            consumer.peer_host.as_deref().is_some_and(|ip| pod.ips.iter().any(|p| p == ip) && !ambiguous(ip))
        }
        MatchBy::ConnectionName => consumer.connection_name.as_deref().is_some_and(|n| named_after(n, pod)),
    };
    if !matches {
        return Ownership::Foreign;
    }
    let Some(since) = pod.ip_since_ms else { return Ownership::Owned };
    // Only a known connection time proves the consumer is not an earlier holder's: one of
    // unknown age (its connection not listed yet, or the listing failed) may be a half-open
    // connection left behind by the pod that had the address before.
    match consumer.connected_ms {
        Some(connected) if connected.min(consumer.since_ms) + CLOCK_SKEW_MS >= since => Ownership::Owned,
        Some(_) => Ownership::Stale,
        None => Ownership::Undated,
    }
}

/// Whether a connection name carries the pod's `<namespace>/<name>` or its UID as a whole
/// token: its name alone repeats across namespaces (a StatefulSet's ordinals) and clusters.
pub fn named_after(connection_name: &str, pod: &PodFacts) -> bool {
    contains_token(connection_name, &format!("{}/{}", pod.namespace, pod.name))
        || (!pod.uid.is_empty() && contains_token(connection_name, &pod.uid))
}

/// `name` appears in `haystack` as a whole token: `worker-7d9c-x2` is in `app/worker-7d9c-x2:1`
/// but not in `worker-7d9c-x2b`.
pub fn contains_token(haystack: &str, name: &str) -> bool {
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
    use k8s_openapi::{
        api::core::v1::{PodCondition, PodIP, PodReadinessGate, PodSpec, PodStatus},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
        jiff::Timestamp,
    };

    fn pod(name: &str, ip: &str, since: i64) -> PodFacts {
        crate::testing::pod_facts(name, ip, since)
    }

    fn consumer(peer: &str, connection: Option<&str>, connected: i64) -> Consumer {
        Consumer {
            queue: QueueKey::new("/", "orders"),
            tag: "t".into(),
            channel: format!("{peer}:4000 -> 10.9.9.9:5672 (1)"),
            peer_host: Some(peer.into()),
            connection_name: connection.map(Into::into),
            prefetch: 10,
            ack_required: true,
            since_ms: connected + 50,
            connected_ms: Some(connected),
            node: None,
        }
    }

    #[test]
    fn owned_by_ip_unless_shared_or_older_than_the_pods_address() {
        let p = pod("w-1", "10.0.0.1", 10_000);
        let none = |_: &str| false;
        assert_eq!(ownership(&p, &consumer("10.0.0.1", None, 10_500), MatchBy::PodIp, none), Ownership::Owned);
        assert_eq!(ownership(&p, &consumer("10.0.0.2", None, 10_500), MatchBy::PodIp, none), Ownership::Foreign);
        assert_eq!(ownership(&p, &consumer("10.0.0.1", None, 10_500), MatchBy::PodIp, |_| true), Ownership::Foreign);
        assert_eq!(
            ownership(&p, &consumer("10.0.0.1", None, 2_000), MatchBy::PodIp, none),
            Ownership::Stale,
            "a connection from before the pod had the address: a reused IP"
        );
        assert_eq!(
            ownership(&p, &consumer("10.0.0.1", None, 10_000 - CLOCK_SKEW_MS), MatchBy::PodIp, none),
            Ownership::Owned,
            "within the clock skew allowance"
        );
        let mut unknown_age = consumer("10.0.0.1", None, 10_500);
        unknown_age.connected_ms = None;
        assert_eq!(
            ownership(&p, &unknown_age, MatchBy::PodIp, none),
            Ownership::Undated,
            "a connection of unknown age may be an earlier holder's: it does not count, but it is told apart"
        );
        let mut unknown_start = p.clone();
        unknown_start.ip_since_ms = None;
        assert_eq!(
            ownership(&unknown_start, &consumer("10.0.0.1", None, 2_000), MatchBy::PodIp, none),
            Ownership::Owned
        );
    }

    /// A pod's name repeats across namespaces (a StatefulSet's `worker-1`) and across clusters
    /// sharing a broker: a connection is the pod's by its namespace and name, or its UID.
    #[test]
    fn a_consumer_whose_connection_is_not_listed_may_be_the_pods() {
        let p = pod("worker-1", "10.0.0.1", 0);
        let mut unlisted = consumer("172.16.0.1", None, 100);
        unlisted.connected_ms = None;
        assert_eq!(ownership(&p, &unlisted, MatchBy::ConnectionName, |_| false), Ownership::Undated);
        let nameless = consumer("172.16.0.1", None, 100);
        assert_eq!(
            ownership(&p, &nameless, MatchBy::ConnectionName, |_| false),
            Ownership::Foreign,
            "listed, and named nothing: another client's"
        );
    }

    #[test]
    fn owned_by_connection_name_token() {
        let p = pod("worker-1", "10.0.0.1", 0);
        let by_name = |n: &str| ownership(&p, &consumer("172.16.0.1", Some(n), 100), MatchBy::ConnectionName, |_| true);
        assert_eq!(by_name("shop/worker-1"), Ownership::Owned);
        assert_eq!(by_name("billing shop/worker-1:consumer"), Ownership::Owned);
        assert_eq!(by_name("uid-worker-1"), Ownership::Owned, "the pod's UID");
        assert_eq!(by_name("worker-1"), Ownership::Foreign, "another namespace's worker-1 is named so too");
        assert_eq!(by_name("staging/worker-1"), Ownership::Foreign);
        assert_eq!(by_name("shop/worker-1b"), Ownership::Foreign);
        assert_eq!(by_name("myshop/worker-1"), Ownership::Foreign);
        assert_eq!(by_name("someone-else"), Ownership::Foreign);
    }

    #[test]
    fn facts_from_a_pod() {
        let at = |ms| Some(Time(Timestamp::from_millisecond(ms).unwrap()));
        let p = Pod {
            metadata: ObjectMeta {
                name: Some("w-1".into()),
                namespace: Some("shop".into()),
                uid: Some("u1".into()),
                labels: Some([("pod-template-hash".to_owned(), "abc".to_owned())].into()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "apps/v1".into(),
                    kind: "ReplicaSet".into(),
                    name: "worker-abc".into(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                readiness_gates: Some(vec![PodReadinessGate { condition_type: GATE_CONDITION.into() }]),
                ..Default::default()
            }),
            status: Some(PodStatus {
                pod_ip: Some("10.1.1.1".into()),
                pod_ips: Some(vec![PodIP { ip: "10.1.1.1".into() }, PodIP { ip: "fd00::1".into() }]),
                start_time: at(4_000),
                phase: Some("Running".into()),
                conditions: Some(vec![
                    PodCondition {
                        type_: "ContainersReady".into(),
                        status: "True".into(),
                        last_transition_time: at(5_000),
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
        assert_eq!((f.namespace.as_str(), f.owner.clone()), ("shop", Some(PodOwner::ReplicaSet("worker-abc".into()))));
        assert_eq!(f.ips, ["10.1.1.1", "fd00::1"]);
        assert_eq!(f.ip_since_ms, Some(4_000));
        assert!(f.has_gate && !f.deleting && !f.terminal && !f.is_open());
        assert_eq!(f.containers_ready_since_ms, Some(5_000));
        assert_eq!(f.condition.as_ref().map(|c| (c.status, c.reason.as_str())), Some((false, "NoConsumer")));
        let mut failed = p.clone();
        failed.status.as_mut().unwrap().phase = Some("Failed".into());
        assert!(PodFacts::from_pod(&failed).terminal);
        let bare = PodFacts::from_pod(&Pod::default());
        assert!(!bare.has_gate && bare.ips.is_empty() && bare.containers_ready_since_ms.is_none());
        assert_eq!(bare.owner, None);
    }
}
