//! What one pass over a policy decides around its broker work, shared by the controller and
//! local mode: which broker endpoint, whether to declare the queue or only inspect it, and when
//! to look again.

use crate::{
    broker::{Broker, BrokerCredentials, BrokerPool, uri::BrokerUri},
    broker_source::BrokerSource,
    converge::Mode,
    crd::{MigrationPhase, QueuePolicyStatus},
    plan::QueuePlan,
    status::{self, Check, ConditionType, Outcome, Reason},
};
use std::{sync::Arc, time::Duration};

/// How often a Ready policy is looked at again, at most.
pub const RESYNC: Duration = Duration::from_secs(300);
/// Retry delay while the broker is unreachable.
pub const UNREACHABLE_RETRY: Duration = Duration::from_secs(10);
/// Retry delay while a Secret is missing or wrong (Secrets are not watched).
pub const SECRET_RETRY: Duration = Duration::from_secs(30);
/// Retry delay for conflicts and refusals that need a human.
pub const CONFLICT_RETRY: Duration = Duration::from_secs(60);
/// How soon a migrated queue is looked at again while its restarted consumers are not back.
pub const RESTART_LOOK: Duration = Duration::from_secs(10);

/// The shared endpoint for a plan's broker, or the condition that explains why there is none.
pub fn broker_for_plan(pool: &BrokerPool, plan: &QueuePlan, creds: &BrokerCredentials) -> Result<Arc<Broker>, Check> {
    broker_for(pool, &plan.broker, plan.vhost.as_deref(), creds)
}

/// The shared endpoint for credentials from `source`, in `vhost` when given (else the URI's).
pub fn broker_for(
    pool: &BrokerPool,
    source: &BrokerSource,
    vhost: Option<&str>,
    creds: &BrokerCredentials,
) -> Result<Arc<Broker>, Check> {
    let uri = BrokerUri::from_credentials(creds).map_err(|e| match source {
        BrokerSource::Secret { .. } => Check::failed(Reason::InvalidBrokerUri, format!("{source} key {e}")),
        BrokerSource::RabbitmqCluster { .. } => {
            Check::failed(Reason::InvalidBrokerUri, format!("{source}'s default user Secret gives no usable {e}"))
        }
    })?;
    let uri = match vhost {
        Some(vhost) => uri.with_vhost(vhost),
        None => uri,
    };
    pool.get(uri, creds.ca_cert.clone()).map_err(|e| Check::failed(Reason::InvalidBrokerUri, e.to_string()))
}

/// Declare, unless keepAlive is off and this generation's queue was already declared: then only
/// inspect it, so the operator's own declares do not keep renewing the expiry lease.
pub fn mode_for(plan: &QueuePlan, previous: Option<&QueuePolicyStatus>, generation: Option<i64>) -> Mode {
    let declared_this_generation = previous.is_some_and(|s| {
        s.observed_generation == generation
            && status::find(&s.conditions, ConditionType::QueueDeclared)
                .is_some_and(|c| status::Truth::of(&c.status) == status::Truth::True)
    });
    if !plan.keep_alive && declared_this_generation { Mode::Inspect } else { Mode::Declare }
}

/// When to reconcile again; None waits for the next change of the object.
pub fn requeue_after(plan: Option<&QueuePlan>, outcome: &Outcome) -> Option<Duration> {
    let plan = plan?;
    // Until the restarted consumers are back on a migrated queue (the gate's wake-ups come
    // sooner; this is for the attach timeout).
    let restarting = outcome.migration.as_ref().is_some_and(|m| m.phase == MigrationPhase::RestartingConsumers);
    if restarting {
        return Some(RESTART_LOOK);
    }
    if outcome.is_ready() {
        // A renewal well inside the expiry window, so keepAlive really keeps the queue alive.
        let renew = if plan.keep_alive { plan.settings.expires / 3 } else { RESYNC };
        return Some(renew.clamp(Duration::from_secs(1), RESYNC));
    }
    let reason = outcome.ready().reason;
    Some(match reason {
        Reason::InvalidSpec => return None,
        Reason::BrokerUnreachable => UNREACHABLE_RETRY,
        Reason::SecretNotFound
        | Reason::SecretKeyMissing
        | Reason::InvalidBrokerUri
        | Reason::RabbitmqClusterNotFound
        | Reason::RabbitmqClusterNotReady
        | Reason::ClusterReferenceNotAllowed => SECRET_RETRY,
        _ => CONFLICT_RETRY,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{plan::Limits, status::next_status, testing::policy_yaml};
    use k8s_openapi::jiff::Timestamp;

    fn plan_of(queue: &str) -> QueuePlan {
        crate::plan::plan(&policy_yaml(queue), Limits::default()).unwrap()
    }

    fn ready() -> Outcome {
        Outcome::blocked(Check::ok(Reason::Declared, "ok"))
    }

    #[test]
    fn keep_alive_renews_within_a_third_of_the_expiry() {
        assert_eq!(requeue_after(Some(&plan_of("{expires: 3m}")), &ready()), Some(Duration::from_secs(60)));
        assert_eq!(requeue_after(Some(&plan_of("{expires: 24h}")), &ready()), Some(RESYNC));
        assert_eq!(requeue_after(Some(&plan_of("{expires: 3m, keepAlive: false}")), &ready()), Some(RESYNC));
    }

    #[test]
    fn failures_retry_by_kind_and_invalid_specs_wait_for_a_change() {
        let p = plan_of("{}");
        let blocked = |reason| Outcome::blocked(Check::failed(reason, "x"));
        assert_eq!(requeue_after(Some(&p), &blocked(Reason::BrokerUnreachable)), Some(UNREACHABLE_RETRY));
        assert_eq!(requeue_after(Some(&p), &blocked(Reason::SecretNotFound)), Some(SECRET_RETRY));
        assert_eq!(requeue_after(Some(&p), &blocked(Reason::ArgumentsConflict)), Some(CONFLICT_RETRY));
        assert_eq!(requeue_after(None, &blocked(Reason::InvalidSpec)), None);
    }

    #[test]
    fn inspect_only_once_declared_without_keep_alive() {
        let p = plan_of("{keepAlive: false}");
        assert_eq!(mode_for(&p, None, Some(1)), Mode::Declare);
        let declared = next_status(None, &ready(), Some(1), Timestamp::UNIX_EPOCH);
        assert_eq!(mode_for(&p, Some(&declared), Some(1)), Mode::Inspect);
        assert_eq!(mode_for(&p, Some(&declared), Some(2)), Mode::Declare, "a changed spec is declared again");
        assert_eq!(mode_for(&plan_of("{}"), Some(&declared), Some(1)), Mode::Declare);
    }
}
