//! The one status writer of both controllers: `.status` by server-side apply under the
//! operator's field manager, then an Event per condition transition. For QueuePolicies it writes
//! only what differs from the stored status, and keeps what it wrote until the watch cache has it.

use super::{Context, Error, Shared, publish_for};
use crate::{
    crd::{QueuePolicy, QueuePolicyStatus},
    events::{self, EventSpec},
    names::FIELD_MANAGER,
    sync::lock,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::reflector::ObjectRef,
};
use serde_json::json;

/// Writes `status` of `object` and publishes `events` on it (the transitions the caller found).
pub(super) async fn write_status<K>(
    object: &K,
    ctx: &Shared,
    status: &impl serde::Serialize,
    events: Vec<EventSpec>,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    let ns = object.namespace().unwrap_or_else(|| "default".into());
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = json!({ "apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": status });
    api.patch_status(&object.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    for event in &events {
        publish_for(object, ctx, event).await;
    }
    Ok(())
}

/// The status this operator last wrote for this very policy (same uid), while the watch cache
/// has not caught up with it; once it has, the cache's copy serves and this one is let go.
pub(super) fn last_written(ctx: &Context, policy: &QueuePolicy) -> Option<QueuePolicyStatus> {
    let mut memos = lock(&ctx.memos);
    let memo = memos.get_mut(&ObjectRef::from_obj(policy))?;
    let (uid, status) = memo.written.as_ref()?;
    let seen = same_as_stored(policy.status.as_ref(), status);
    if Some(uid.as_str()) != policy.uid().as_deref() || seen {
        memo.written = None;
        return None;
    }
    Some(status.clone())
}

/// Whether `status` is what `stored` says, compared as the API stores it: times there have
/// whole seconds, so an in-memory time with milliseconds would otherwise always differ.
fn same_as_stored(stored: Option<&QueuePolicyStatus>, status: &QueuePolicyStatus) -> bool {
    stored.map(serde_json::to_value).and_then(Result::ok) == serde_json::to_value(status).ok()
}

/// A policy's status, only when it changed, remembered until the watch cache has it.
pub(super) async fn write_policy_status(
    policy: &QueuePolicy,
    previous: Option<&QueuePolicyStatus>,
    status: QueuePolicyStatus,
    ctx: &Context,
) -> Result<(), Error> {
    if same_as_stored(previous, &status) {
        return Ok(());
    }
    let old = previous.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let transitions = events::transitions(old, &status.conditions);
    write_status(policy, &ctx.shared, &status, vec![]).await?;
    lock(&ctx.memos).entry(ObjectRef::from_obj(policy)).or_default().written =
        Some((policy.uid().unwrap_or_default(), status.clone()));
    for event in &transitions {
        publish_for(policy, &ctx.shared, event).await;
    }
    Ok(())
}
