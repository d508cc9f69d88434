//! What the operator reads and does not watch (broker Secrets, RabbitmqClusters), through a
//! short-lived cache.
//!
//! The operator may only `get` Secrets: list or watch would let it read, and hold in memory,
//! every Secret in its scope. Without a cache every reconcile reads its Secret again: 1,000
//! policies on one Secret, each looked at every 20 s, are 50 reads a second of the same object.
//! A read serves every reconcile for [`SECRET_TTL`], so a rotated Secret is in use within that
//! time (and, as the Secret is not watched, from the next reconcile after it). The time is longer
//! than the 20 s between the findings' looks, so a fleet at rest costs one read per Secret a
//! minute, however many policies use it (`cargo bench --bench fleet`). A RabbitmqCluster is read
//! the same way: its default user's Secret can be replaced, and a cluster can change its TLS.

use crate::{rabbitmq_cluster::RabbitmqCluster, sync::lock};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, Resource, core::NamespaceResourceScope};
use serde::de::DeserializeOwned;
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::time::Instant;

/// How long one read of an object serves.
pub const SECRET_TTL: Duration = Duration::from_secs(60);

type Slot<K> = Arc<tokio::sync::Mutex<Option<(Instant, K)>>>;

/// Objects of kind `K` by namespace and name, each read at most once per [`SECRET_TTL`].
pub struct Reads<K> {
    slots: Mutex<HashMap<(String, String), Slot<K>>>,
}

pub type Secrets = Reads<Secret>;
pub type Clusters = Reads<RabbitmqCluster>;

impl<K> Default for Reads<K> {
    fn default() -> Self {
        Self { slots: Mutex::default() }
    }
}

/// What of an object is kept: only what the operator reads from it, and the `extra` keys its
/// caller names (a RabbitmqCluster's renamed default-user keys).
pub trait Kept {
    fn kept(self, extra: &[&str]) -> Self;
}

impl<K> Reads<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Kept + Clone + DeserializeOwned + std::fmt::Debug,
{
    /// The object `ns/name`, read from the API unless a read at most [`SECRET_TTL`] old is at
    /// hand. Concurrent callers for one object share a single read. Absence is never kept: an
    /// object created after its policy is found by the next reconcile.
    pub async fn get(&self, client: &Client, ns: &str, name: &str) -> Result<Option<K>, kube::Error> {
        self.get_keeping(client, ns, name, &[]).await
    }

    /// As [`Self::get`], keeping `extra` keys too when it reads (every caller of one object
    /// names the same ones: the default user's Secret is read for its cluster only).
    pub async fn get_keeping(
        &self,
        client: &Client,
        ns: &str,
        name: &str,
        extra: &[&str],
    ) -> Result<Option<K>, kube::Error> {
        let slot = {
            let mut slots = lock(&self.slots);
            evict_stale(&mut slots, Instant::now());
            slots.entry((ns.to_owned(), name.to_owned())).or_default().clone()
        };
        let mut kept = slot.lock().await;
        let now = Instant::now();
        if let Some((_, object)) = kept.as_ref().filter(|(read_at, _)| fresh(*read_at, now)) {
            return Ok(Some(object.clone()));
        }
        let found = Api::<K>::namespaced(client.clone(), ns).get_opt(name).await?.map(|o| o.kept(extra));
        *kept = found.clone().map(|s| (now, s));
        Ok(found)
    }
}

impl<K> Reads<K> {
    /// Drops the read of `ns/name`, so the next `get` reads it again: for an object read in a
    /// state that will change soon (a RabbitmqCluster still being made).
    pub fn forget(&self, ns: &str, name: &str) {
        lock(&self.slots).remove(&(ns.to_owned(), name.to_owned()));
    }
}

/// Lets go of reads past their time and of absences: an object no policy reads any more (or
/// deleted) is not kept. A slot in use (its read under way) stays.
fn evict_stale<K>(slots: &mut HashMap<(String, String), Slot<K>>, now: Instant) {
    slots.retain(|_, slot| match slot.try_lock() {
        Ok(kept) => kept.as_ref().is_some_and(|(read_at, _)| fresh(*read_at, now)),
        Err(_) => true,
    });
}

fn fresh(read_at: Instant, now: Instant) -> bool {
    now.saturating_duration_since(read_at) < SECRET_TTL
}

/// A Secret: the name and the keys the operator reads (a Secret shared with an application may
/// hold much else, none of it the operator's to keep).
impl Kept for Secret {
    fn kept(self, extra: &[&str]) -> Self {
        let data = self.data.map(|mut d| {
            d.retain(|k, _| crate::secret::KEYS.contains(&k.as_str()) || extra.contains(&k.as_str()));
            d
        });
        let mut kept = Secret { data, ..Default::default() };
        kept.metadata.name = self.metadata.name;
        kept
    }
}

/// A RabbitmqCluster: the modelled fields, and of its annotations the one that lets other
/// namespaces use it.
impl Kept for RabbitmqCluster {
    fn kept(mut self, _: &[&str]) -> Self {
        let allowed = self
            .metadata
            .annotations
            .take()
            .and_then(|mut a| a.remove_entry(crate::rabbitmq_cluster::ALLOWED_NAMESPACES));
        let mut kept = RabbitmqCluster::new(self.metadata.name.as_deref().unwrap_or_default(), self.spec);
        kept.metadata.namespace = self.metadata.namespace;
        kept.metadata.annotations = allowed.map(|entry| [entry].into());
        kept.status = self.status;
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;

    #[test]
    fn a_read_serves_for_the_ttl_only() {
        let t = Instant::now();
        assert!(fresh(t, t));
        assert!(fresh(t, t + SECRET_TTL - Duration::from_millis(1)));
        assert!(!fresh(t, t + SECRET_TTL));
    }

    #[test]
    fn a_secret_keeps_the_operators_keys_and_the_ones_its_caller_names() {
        let secret = Secret {
            data: Some(
                ["uri", "user", "app-token"].map(|k| (k.to_owned(), k8s_openapi::ByteString(b"x".to_vec()))).into(),
            ),
            ..Default::default()
        };
        let keys = |s: Secret| s.data.unwrap().into_keys().collect::<Vec<_>>();
        assert_eq!(keys(secret.clone().kept(&[])), ["uri"]);
        assert_eq!(keys(secret.kept(&["user"])), ["uri", "user"], "a cluster's renamed username key");
    }

    #[tokio::test(start_paused = true)]
    async fn reads_past_their_time_are_let_go_of() {
        let secrets = Secrets::default();
        let read = |name: &str| {
            let slot: Slot<Secret> = Arc::default();
            *slot.try_lock().unwrap() = Some((Instant::now(), Secret::default()));
            ((String::from("ns"), name.to_owned()), slot)
        };
        secrets.slots.lock().unwrap().extend([read("a"), read("b")]);
        secrets.slots.lock().unwrap().insert(("ns".into(), "absent".into()), Slot::<Secret>::default());
        tokio::time::advance(SECRET_TTL / 2).await;
        secrets.slots.lock().unwrap().extend([read("c")]);
        evict_stale(&mut secrets.slots.lock().unwrap(), Instant::now());
        let mut kept: Vec<String> = secrets.slots.lock().unwrap().keys().map(|(_, n)| n.clone()).collect();
        kept.sort();
        assert_eq!(kept, ["a", "b", "c"], "fresh reads stay, an absence does not");
        tokio::time::advance(SECRET_TTL / 2).await;
        evict_stale(&mut secrets.slots.lock().unwrap(), Instant::now());
        let kept: Vec<String> = secrets.slots.lock().unwrap().keys().map(|(_, n)| n.clone()).collect();
        assert_eq!(kept, ["c"], "a and b are a minute old");
    }

    #[tokio::test]
    async fn concurrent_reconciles_share_one_read_and_absence_is_not_kept() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let secrets = Secrets::default();
        let answer = |status: u16, body: serde_json::Value| {
            Response::builder().status(status).body(Body::from(serde_json::to_vec(&body).unwrap())).unwrap()
        };
        let server = tokio::spawn(async move {
            let mut paths = Vec::new();
            for found in [false, true] {
                let (req, reply) = handle.next_request().await.expect("a read");
                paths.push(req.uri().path().to_owned());
                reply.send_response(if found {
                    answer(
                        200,
                        serde_json::json!({"apiVersion": "v1", "kind": "Secret",
                        "metadata": {"name": "rabbitmq", "namespace": "ns", "managedFields": [{"manager": "kubectl"}]},
                        "data": {"uri": "YW1xcDovL3U6cEBoLw==", "app-token": "c2VjcmV0"}}),
                    )
                } else {
                    answer(
                        404,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "code": 404, "reason": "NotFound", "message": "secrets \"rabbitmq\" not found"}),
                    )
                });
            }
            // A third read would hang the test's gets below: none may come.
            let more = tokio::time::timeout(Duration::from_millis(300), handle.next_request()).await;
            assert!(more.is_err(), "the kept read is used");
            paths
        });
        assert!(secrets.get(&client, "ns", "rabbitmq").await.unwrap().is_none());
        let all = futures::future::join_all((0..16).map(|_| secrets.get(&client, "ns", "rabbitmq"))).await;
        for secret in all {
            let secret = secret.unwrap().expect("found");
            assert_eq!(secret.metadata.name.as_deref(), Some("rabbitmq"));
            assert!(secret.metadata.managed_fields.is_none(), "only the name and data are kept");
            let data = secret.data.unwrap();
            assert_eq!(data["uri"].0, b"amqp://u:p@h/");
            assert!(!data.contains_key("app-token"), "keys the operator does not read are not kept");
        }
        assert_eq!(server.await.unwrap(), vec!["/api/v1/namespaces/ns/secrets/rabbitmq"; 2]);
    }
}
