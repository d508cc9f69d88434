//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go does it: one replica
//! holds the Lease and renews it; the others retry until it has not been renewed for its
//! duration, then take it over. Writes carry the resourceVersion they read, so two candidates
//! can never both win. A clean shutdown releases the Lease so a standby takes over at its next
//! retry instead of waiting out the duration.

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub name: String,
    pub namespace: String,
    /// This replica (the pod name).
    pub identity: String,
    /// How long a Lease holds without renewal.
    pub duration: Duration,
    /// The leader gives up when it could not renew for this long (less than `duration`, so it
    /// stops before anybody else may start).
    pub renew_deadline: Duration,
    /// How often candidates retry and the leader renews.
    pub retry_period: Duration,
}

impl LeaseConfig {
    pub fn new(name: String, namespace: String, identity: String) -> Self {
        Self {
            name,
            namespace,
            identity,
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// What a candidate does with the Lease as it reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No Lease yet: create it, holding it.
    Create,
    /// Ours: renew it.
    Renew,
    /// Released or expired: take it over.
    Acquire,
    /// Someone else holds it and renewed it in time.
    Wait { holder: String },
}

pub fn decide(lease: Option<&Lease>, identity: &str, now: Timestamp) -> Step {
    let Some(spec) = lease.and_then(|l| l.spec.as_ref()) else {
        return if lease.is_none() { Step::Create } else { Step::Acquire };
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder == identity {
        return Step::Renew;
    }
    if holder.is_empty() {
        return Step::Acquire;
    }
    let renewed = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()).map(|t| t.0);
    let duration = SignedDuration::from_secs(spec.lease_duration_seconds.unwrap_or(0).into());
    match renewed {
        Some(at) if at + duration > now => Step::Wait { holder: holder.to_owned() },
        _ => Step::Acquire,
    }
}

/// The Lease spec after `step` by `identity` at `now`.
pub fn next_spec(current: Option<&LeaseSpec>, step: &Step, cfg: &LeaseConfig, now: Timestamp) -> Option<LeaseSpec> {
    let now_t = MicroTime(now);
    let seconds = i32::try_from(cfg.duration.as_secs()).unwrap_or(i32::MAX);
    match step {
        Step::Wait { .. } => None,
        Step::Renew => {
            Some(LeaseSpec { renew_time: Some(now_t), lease_duration_seconds: Some(seconds), ..current?.clone() })
        }
        Step::Create | Step::Acquire => Some(LeaseSpec {
            holder_identity: Some(cfg.identity.clone()),
            acquire_time: Some(now_t.clone()),
            renew_time: Some(now_t),
            lease_duration_seconds: Some(seconds),
            lease_transitions: Some(match (step, current) {
                (Step::Acquire, Some(c)) => c.lease_transitions.unwrap_or(0) + 1,
                _ => 0,
            }),
            ..Default::default()
        }),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(transparent)]
    Api(kube::Error),
    #[error("the API server did not answer within {0:?}")]
    Unanswered(Duration),
}

/// Why [`LeaderElector::hold`] stopped holding the Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldEnd {
    /// Not renewed in time, or taken by another replica: it is not ours to release.
    Lost,
    /// Still ours, but this replica cannot do its work: release it so a standby takes over.
    Unfit,
}

pub struct LeaderElector {
    api: Api<Lease>,
    cfg: LeaseConfig,
}

impl LeaderElector {
    pub fn new(client: Client, cfg: LeaseConfig) -> Self {
        Self { api: Api::namespaced(client, &cfg.namespace), cfg }
    }

    /// One round: read the Lease and act on it. Ok(true) while this replica holds it.
    pub async fn try_once(&self) -> Result<bool, kube::Error> {
        let current = self.api.get_opt(&self.cfg.name).await?;
        let step = decide(current.as_ref(), &self.cfg.identity, Timestamp::now());
        let Some(spec) = next_spec(current.as_ref().and_then(|l| l.spec.as_ref()), &step, &self.cfg, Timestamp::now())
        else {
            return Ok(false);
        };
        let written = match current {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta { name: Some(self.cfg.name.clone()), ..Default::default() },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            // Replace with the resourceVersion just read: a concurrent writer makes this fail.
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.api.replace(&self.cfg.name, &PostParams::default(), &lease).await
            }
        };
        match written {
            Ok(_) => {
                if step != Step::Renew {
                    tracing::info!(lease = %self.cfg.name, identity = %self.cfg.identity, "became leader");
                }
                Ok(true)
            }
            // Someone else created or updated it first.
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits until this replica leads. Returns when the winning attempt started: the Lease's
    /// renew time is no earlier, so holding may count from there.
    pub async fn acquire(&self) -> Instant {
        loop {
            let started = Instant::now();
            // A hung API call must not keep a candidate from retrying.
            match tokio::time::timeout(self.cfg.renew_deadline, self.try_once()).await {
                Ok(Ok(true)) => return started,
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!(lease = %self.cfg.name, error = %e, "leader election"),
                Err(_) => tracing::warn!(lease = %self.cfg.name, "leader election: the API server did not answer"),
            }
            tokio::time::sleep(self.cfg.retry_period).await;
        }
    }

    /// Renews the Lease (held since `renewed`, as [`Self::acquire`] returns) until a renewal has
    /// not succeeded for `renew_deadline`, someone else holds it, or `unfit` says this replica
    /// can no longer do a leader's work; then returns why, and the caller must stop acting as
    /// leader. Each renewal is cut off at that deadline: an API server that stopped answering
    /// must not keep this replica acting after its Lease expired and another took it.
    pub async fn hold(&self, mut renewed: Instant, unfit: impl Fn() -> bool) -> HoldEnd {
        loop {
            tokio::time::sleep(self.cfg.retry_period).await;
            // The Lease renews on requests of its own: it says nothing of the leader's other
            // writes (a pod condition stuck on a dead connection, say), so it is not kept for
            // a replica that cannot do its work.
            if unfit() {
                tracing::error!(lease = %self.cfg.name, "giving up the lease: this replica cannot do a leader's work");
                return HoldEnd::Unfit;
            }
            let deadline = renewed + self.cfg.renew_deadline;
            let started = Instant::now();
            match tokio::time::timeout_at(deadline, self.try_once()).await {
                Ok(Ok(true)) => renewed = started,
                Ok(Ok(false)) => {
                    tracing::error!(lease = %self.cfg.name, "another replica holds the lease");
                    return HoldEnd::Lost;
                }
                Ok(Err(e)) => tracing::warn!(lease = %self.cfg.name, error = %e, "could not renew the lease"),
                Err(_) => {}
            }
            if Instant::now() >= renewed + self.cfg.renew_deadline {
                tracing::error!(lease = %self.cfg.name, "lease not renewed within the renew deadline");
                return HoldEnd::Lost;
            }
        }
    }

    /// Gives the Lease up if this replica still holds it, so a standby need not wait it out.
    /// Bounded by the renew deadline: shutting down must not wait on a hung API server.
    pub async fn release(&self) -> Result<(), ReleaseError> {
        tokio::time::timeout(self.cfg.renew_deadline, self.release_now())
            .await
            .map_err(|_| ReleaseError::Unanswered(self.cfg.renew_deadline))?
            .map_err(ReleaseError::Api)
    }

    async fn release_now(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await? else { return Ok(()) };
        let Some(spec) = lease.spec.as_mut() else { return Ok(()) };
        if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        self.api.replace(&self.cfg.name, &PostParams::default(), &lease).await?;
        tracing::info!(lease = %self.cfg.name, "released the lease");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(by: &str, renewed_secs_ago: i64, duration: i32) -> Lease {
        let now = Timestamp::now();
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(by.into()),
                renew_time: Some(MicroTime(now - SignedDuration::from_secs(renewed_secs_ago))),
                lease_duration_seconds: Some(duration),
                lease_transitions: Some(3),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_missing_lease_is_created() {
        assert_eq!(decide(None, "a", Timestamp::now()), Step::Create);
    }

    #[test]
    fn a_fresh_lease_of_another_replica_is_left_alone() {
        assert_eq!(decide(Some(&held("b", 5, 15)), "a", Timestamp::now()), Step::Wait { holder: "b".into() });
    }

    #[test]
    fn an_expired_or_released_lease_is_taken_over() {
        assert_eq!(decide(Some(&held("b", 16, 15)), "a", Timestamp::now()), Step::Acquire);
        assert_eq!(decide(Some(&held("", 0, 1)), "a", Timestamp::now()), Step::Acquire);
    }

    #[test]
    fn our_own_lease_is_renewed() {
        assert_eq!(decide(Some(&held("a", 14, 15)), "a", Timestamp::now()), Step::Renew);
    }

    #[test]
    fn taking_over_counts_a_transition_and_renewing_keeps_the_acquire_time() {
        let cfg = LeaseConfig::new("l".into(), "ns".into(), "a".into());
        let now = Timestamp::now();
        let old = held("b", 20, 15).spec.unwrap();
        let taken = next_spec(Some(&old), &Step::Acquire, &cfg, now).unwrap();
        assert_eq!(taken.holder_identity.as_deref(), Some("a"));
        assert_eq!(taken.lease_transitions, Some(4));
        assert_eq!(taken.lease_duration_seconds, Some(15));
        let later = now + SignedDuration::from_secs(2);
        let renewed = next_spec(Some(&taken), &Step::Renew, &cfg, later).unwrap();
        assert_eq!(renewed.acquire_time, taken.acquire_time);
        assert_eq!(renewed.renew_time, Some(MicroTime(later)));
        assert_eq!(renewed.lease_transitions, Some(4));
        assert!(next_spec(Some(&old), &Step::Wait { holder: "b".into() }, &cfg, now).is_none());
    }
}
