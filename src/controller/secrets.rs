//! Broker Secrets, read through a short-lived cache.
//!
//! The operator may only `get` Secrets: list or watch would let it read, and hold in memory,
//! every Secret in its scope. Without a cache every reconcile reads its Secret again: 1,000
//! policies on one Secret, each looked at every 20 s, are 50 reads a second of the same object.
//! A read serves every reconcile for [`SECRET_TTL`], so a rotated Secret is in use within that
//! time (and, as the Secret is not watched, from the next reconcile after it). The time is longer
//! than the 20 s between the findings' looks, so a fleet at rest costs one read per Secret a
//! minute, however many policies use it (`cargo bench --bench fleet`).

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// How long one read of a Secret serves.
pub const SECRET_TTL: Duration = Duration::from_secs(60);

type Slot = Arc<tokio::sync::Mutex<Option<(Instant, Secret)>>>;

#[derive(Default)]
pub struct Secrets {
    slots: Mutex<HashMap<(String, String), Slot>>,
}

impl Secrets {
    /// The Secret `ns/name`, read from the API unless a read at most [`SECRET_TTL`] old is at
    /// hand. Concurrent callers for one Secret share a single read. Absence is never kept: a
    /// Secret created after its policy is found by the next reconcile.
    pub async fn get(&self, client: &Client, ns: &str, name: &str) -> Result<Option<Secret>, kube::Error> {
        let slot = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((ns.to_owned(), name.to_owned()))
            .or_default()
            .clone();
        let mut kept = slot.lock().await;
        let now = Instant::now();
        if let Some((_, secret)) = kept.as_ref().filter(|(read_at, _)| fresh(*read_at, now)) {
            return Ok(Some(secret.clone()));
        }
        let found = Api::<Secret>::namespaced(client.clone(), ns).get_opt(name).await?.map(trimmed);
        *kept = found.clone().map(|s| (now, s));
        Ok(found)
    }
}

fn fresh(read_at: Instant, now: Instant) -> bool {
    now.saturating_duration_since(read_at) < SECRET_TTL
}

/// Only what the credentials are read from: the name and the data.
fn trimmed(secret: Secret) -> Secret {
    let mut kept = Secret { data: secret.data, string_data: secret.string_data, ..Default::default() };
    kept.metadata.name = secret.metadata.name;
    kept
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
                        "data": {"uri": "YW1xcDovL3U6cEBoLw=="}}),
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
            assert_eq!(secret.data.unwrap()["uri"].0, b"amqp://u:p@h/");
        }
        assert_eq!(server.await.unwrap(), vec!["/api/v1/namespaces/ns/secrets/rabbitmq"; 2]);
    }
}
