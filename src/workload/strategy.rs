//! Is a workload's rollout strategy safe for its consumers? Resolves `maxSurge` and
//! `maxUnavailable` exactly as the Deployment, StatefulSet and Argo Rollouts controllers do, and
//! says what fixes it: a server-side apply of the strategy where queueguard may change it
//! (Deployments, canary and blue-green Rollouts), the owner's own change where it may not
//! (StatefulSets).

use super::{
    Object,
    rollout::{Canary, Rollout},
};
use k8s_openapi::{
    api::apps::v1::{Deployment, StatefulSet},
    apimachinery::pkg::util::intstr::IntOrString,
};
use serde_json::{Value, json};

/// maxSurge and maxUnavailable as the controller resolves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fenceposts {
    pub max_surge: i32,
    pub max_unavailable: i32,
}

/// A strategy judged for minAttached consumers.
#[derive(Debug, Clone, PartialEq)]
pub enum Judgement {
    /// Availability cannot drop below minAttached during a rollout; `note` tells of a setting
    /// that is reported, not changed (a StatefulSet's partition).
    Safe { note: Option<String> },
    /// Unsafe; `fix` is the server-side apply body (the strategy's fields only) that makes it
    /// safe, and `done` says what it sets.
    Fixable { why: String, fix: Value, done: &'static str },
    /// Unsafe, and only the workload's owner can make it safe (`remedy` says how).
    Unsafe { why: String, remedy: String },
    /// The strategy cannot be read (a malformed percentage, no strategy).
    Invalid(String),
}

/// Resolves an int-or-percent against `total`, as `intstr.GetScaledValueFromIntOrPercent`:
/// percentages round up for maxSurge and down for maxUnavailable.
pub fn scaled(value: &IntOrString, total: i32, round_up: bool) -> Result<i32, String> {
    match value {
        IntOrString::Int(n) => Ok(*n),
        IntOrString::String(s) => {
            let pct: i64 = s
                .strip_suffix('%')
                .and_then(|p| p.parse().ok())
                .filter(|p| *p >= 0)
                .ok_or_else(|| format!("invalid value {s:?}: must be an integer or a percentage"))?;
            let scaled = pct * i64::from(total);
            let v = if round_up { (scaled + 99) / 100 } else { scaled / 100 };
            i32::try_from(v).map_err(|_| format!("{s:?} of {total} is out of range"))
        }
    }
}

/// maxSurge and maxUnavailable (each defaulting to 25%) against `replicas`; never both zero, as
/// neither the Deployment nor the Rollout controller would make progress.
fn resolve(
    surge: Option<&IntOrString>,
    unavailable: Option<&IntOrString>,
    replicas: i32,
) -> Result<Fenceposts, String> {
    let default = IntOrString::String("25%".into());
    let max_surge = scaled(surge.unwrap_or(&default), replicas, true).map_err(|e| format!("maxSurge: {e}"))?;
    let mut max_unavailable =
        scaled(unavailable.unwrap_or(&default), replicas, false).map_err(|e| format!("maxUnavailable: {e}"))?;
    if max_surge == 0 && max_unavailable == 0 {
        max_unavailable = 1;
    }
    Ok(Fenceposts { max_surge, max_unavailable })
}

/// The fenceposts of a RollingUpdate Deployment; None for Recreate.
pub fn fenceposts(deployment: &Deployment) -> Result<Option<Fenceposts>, String> {
    let strategy = deployment.spec.as_ref().and_then(|s| s.strategy.as_ref());
    if strategy.and_then(|s| s.type_.as_deref()) == Some("Recreate") {
        return Ok(None);
    }
    let rolling = strategy.and_then(|s| s.rolling_update.as_ref());
    resolve(
        rolling.and_then(|r| r.max_surge.as_ref()),
        rolling.and_then(|r| r.max_unavailable.as_ref()),
        replicas(deployment),
    )
    .map(Some)
}

/// spec.replicas, defaulting to 1 as the API server does.
pub fn replicas(deployment: &Deployment) -> i32 {
    deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1)
}

/// A surge-capable rollout (a Deployment, a canary Rollout) may take `maxUnavailable` pods below
/// `replicas`, so it is safe only when `replicas - maxUnavailable >= minAttached` (or, with fewer
/// replicas than minAttached, when nothing may become unavailable at all). On failure: why, and
/// the maxSurge to keep beside maxUnavailable 0.
fn surge_check(
    replicas: i32,
    fenceposts: Option<Fenceposts>,
    current_surge: Option<&IntOrString>,
    min_attached: i32,
) -> Result<(), (String, Value)> {
    if replicas == 0 {
        return Ok(());
    }
    let allowed = (replicas - min_attached).max(0);
    let why = match fenceposts {
        None => "strategy Recreate stops every old pod before any new one starts".to_owned(),
        Some(f) if f.max_unavailable > allowed => format!(
            "a rollout may take {} of {replicas} pods unavailable (maxUnavailable resolves to {}), leaving fewer than minAttached {min_attached} consumers",
            f.max_unavailable, f.max_unavailable
        ),
        Some(_) => return Ok(()),
    };
    // maxSurge as it was when it already allows at least one extra pod, else 1.
    let surge = match (current_surge, fenceposts) {
        (Some(IntOrString::Int(n)), Some(f)) if f.max_surge >= 1 => json!(n),
        (Some(IntOrString::String(s)), Some(f)) if f.max_surge >= 1 => json!(s),
        _ => json!(1),
    };
    Err((why, surge))
}

/// The metadata of a strategy fix: the object's identity, for a server-side apply.
fn identity(api_version: &str, kind: &str, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": meta.name, "namespace": meta.namespace}})
}

pub fn judge_deployment(deployment: &Deployment, min_attached: i32) -> Judgement {
    let fp = match fenceposts(deployment) {
        Ok(fp) => fp,
        Err(e) => return Judgement::Invalid(e),
    };
    let current = deployment
        .spec
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
        .and_then(|s| s.rolling_update.as_ref())
        .and_then(|r| r.max_surge.as_ref());
    match surge_check(replicas(deployment), fp, current, min_attached) {
        Ok(()) => Judgement::Safe { note: None },
        Err((why, surge)) => {
            let mut fix = identity("apps/v1", "Deployment", &deployment.metadata);
            fix["spec"] = json!({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": surge}}});
            Judgement::Fixable { why, fix, done: "patched to RollingUpdate with maxUnavailable 0" }
        }
    }
}

/// A StatefulSet replaces its pods without surge: RollingUpdate deletes up to maxUnavailable
/// (default 1, at least 1) and waits for each replacement to be Ready (so the gate holds the
/// next step until the recreated pod's consumer attached); under OrderedReady it also waits for
/// every other pod to be Ready, under Parallel it does not. With `replicas - maxUnavailable` below
/// minAttached the queue loses consumers while a pod restarts, and no strategy queueguard could
/// set would help: only more replicas (or a lower maxUnavailable) do. Never patched.
pub fn judge_stateful_set(set: &StatefulSet, min_attached: i32) -> Judgement {
    let spec = set.spec.as_ref();
    let replicas = spec.and_then(|s| s.replicas).unwrap_or(1);
    let strategy = spec.and_then(|s| s.update_strategy.as_ref());
    if strategy.and_then(|s| s.type_.as_deref()) == Some("OnDelete") {
        return Judgement::Unsafe {
            why: "updateStrategy OnDelete replaces a pod only when someone deletes it, and nothing waits for the new pod's consumer before the next deletion".into(),
            remedy: "use updateStrategy RollingUpdate, which waits for each recreated pod to be Ready (its consumer attached) before the next".into(),
        };
    }
    if replicas == 0 {
        return Judgement::Safe { note: None };
    }
    let rolling = strategy.and_then(|s| s.rolling_update.as_ref());
    let unavailable = match stateful_set_unavailable(set) {
        Ok(n) => n,
        Err(e) => return Judgement::Invalid(format!("maxUnavailable: {e}")),
    };
    if spec.and_then(|s| s.pod_management_policy.as_deref()) == Some("Parallel") {
        // Counted as one pod more down than maxUnavailable: the pod of a rollout begun while
        // another's replacement still waits for its consumer (kube-controller-manager 1.36,
        // without the MaxUnavailableStatefulSet feature gate, off by default).
        let down = unavailable + 1;
        if replicas - down < min_attached {
            return Judgement::Unsafe {
                why: format!(
                    "podManagementPolicy Parallel: RollingUpdate replaces a pod while pods of lower ordinal are not Ready (it waits only for the pods it replaced), so {down} of {replicas} pods can be down at once, leaving fewer than minAttached {min_attached} consumers"
                ),
                remedy: format!(
                    "recreate the StatefulSet with podManagementPolicy OrderedReady (the field cannot change in place: kubectl delete statefulset --cascade=orphan, then apply it), or run at least {} replicas",
                    min_attached + down
                ),
            };
        }
    }
    if replicas - unavailable < min_attached {
        let remedy = if replicas > min_attached {
            format!("lower updateStrategy.rollingUpdate.maxUnavailable to {}", replicas - min_attached)
        } else {
            format!("run at least {} replicas", min_attached + 1)
        };
        return Judgement::Unsafe {
            why: format!(
                "a StatefulSet replaces pods without surge: RollingUpdate takes {unavailable} of {replicas} pods down at a time, leaving fewer than minAttached {min_attached} consumers while they restart"
            ),
            remedy,
        };
    }
    let note = rolling.and_then(|r| r.partition).filter(|p| *p > 0).map(|p| {
        format!("partition {p}: pods with an ordinal below {p} keep the old revision until the partition is lowered")
    });
    Judgement::Safe { note }
}

/// How many pods a StatefulSet's RollingUpdate takes down at once: maxUnavailable (default 1,
/// percentages rounded up, at least 1).
fn stateful_set_unavailable(set: &StatefulSet) -> Result<i32, String> {
    let spec = set.spec.as_ref();
    let replicas = spec.and_then(|s| s.replicas).unwrap_or(1);
    let rolling = spec.and_then(|s| s.update_strategy.as_ref()).and_then(|u| u.rolling_update.as_ref());
    match rolling.and_then(|r| r.max_unavailable.as_ref()) {
        None => Ok(1),
        Some(v) => Ok(scaled(v, replicas, true)?.max(1)),
    }
}

/// Pods a rollout replaces per step: a Deployment's or a canary's maxSurge, a StatefulSet's
/// maxUnavailable; None where all are replaced in one step (Recreate, blue-green).
pub fn per_step(object: &Object) -> Result<Option<i32>, String> {
    match object {
        Object::Deployment(d) => Ok(fenceposts(d)?.map(|fp| fp.max_surge)),
        Object::StatefulSet(s) => stateful_set_unavailable(s).map(Some),
        Object::Rollout(r) => match &r.spec.strategy.canary {
            Some(c) => Ok(Some(canary_fenceposts(c, r.spec.replicas.unwrap_or(1))?.max_surge)),
            None => Ok(None),
        },
    }
}

/// The fenceposts of a canary Rollout of `replicas` (Argo's defaults, 25% and 25%).
pub fn canary_fenceposts(canary: &Canary, replicas: i32) -> Result<Fenceposts, String> {
    resolve(canary.max_surge.as_ref(), canary.max_unavailable.as_ref(), replicas)
}

/// A canary Rollout without traffic routing scales its ReplicaSets with maxSurge and
/// maxUnavailable as a Deployment does (and with traffic routing keeps the stable ReplicaSet
/// scaled up, which the same judgement only errs on the safe side of). A blue-green Rollout
/// scales the old ReplicaSet down only after the new one is fully available, and a pod counts
/// as available only once its gate condition is True: previewReplicaCount and
/// scaleDownDelaySeconds never drop consumers. What can, in both, is a restart (`kubectl argo
/// rollouts restart`), which deletes up to maxUnavailable pods at once without surge.
pub fn judge_rollout(rollout: &Rollout, min_attached: i32) -> Judgement {
    let replicas = rollout.spec.replicas.unwrap_or(1);
    let strategy = &rollout.spec.strategy;
    if let Some(canary) = &strategy.canary {
        let fp = match canary_fenceposts(canary, replicas) {
            Ok(fp) => fp,
            Err(e) => return Judgement::Invalid(e),
        };
        return match surge_check(replicas, Some(fp), canary.max_surge.as_ref(), min_attached) {
            Ok(()) => Judgement::Safe { note: None },
            Err((why, surge)) => {
                let mut fix = identity("argoproj.io/v1alpha1", "Rollout", &rollout.metadata);
                fix["spec"] = json!({"strategy": {"canary": {"maxUnavailable": 0, "maxSurge": surge}}});
                Judgement::Fixable {
                    why: format!("canary: {why}"),
                    fix,
                    done: "patched the canary to maxUnavailable 0",
                }
            }
        };
    }
    let Some(blue_green) = &strategy.blue_green else {
        return Judgement::Invalid("no canary or blueGreen strategy".into());
    };
    if replicas == 0 {
        return Judgement::Safe { note: None };
    }
    let default = IntOrString::String("25%".into());
    let unavailable = match scaled(blue_green.max_unavailable.as_ref().unwrap_or(&default), replicas, false) {
        Ok(n) => n.max(1),
        Err(e) => return Judgement::Invalid(format!("blueGreen.maxUnavailable: {e}")),
    };
    if replicas - unavailable >= min_attached {
        return Judgement::Safe { note: None };
    }
    let why = format!(
        "blueGreen: a restart takes {unavailable} of {replicas} pods down at a time without surge, leaving fewer than minAttached {min_attached} consumers"
    );
    if replicas > min_attached {
        let mut fix = identity("argoproj.io/v1alpha1", "Rollout", &rollout.metadata);
        fix["spec"] = json!({"strategy": {"blueGreen": {"maxUnavailable": 1}}});
        Judgement::Fixable { why, fix, done: "patched blueGreen.maxUnavailable to 1" }
    } else {
        Judgement::Unsafe { why, remedy: format!("run at least {} replicas", min_attached + 1) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};

    fn deployment(replicas: Option<i32>, strategy: Option<DeploymentStrategy>) -> Deployment {
        Deployment { spec: Some(DeploymentSpec { replicas, strategy, ..Default::default() }), ..Default::default() }
    }

    fn v(s: &str) -> IntOrString {
        match s.parse::<i32>() {
            Ok(n) => IntOrString::Int(n),
            Err(_) => IntOrString::String(s.into()),
        }
    }

    fn rolling(surge: Option<&str>, unavailable: Option<&str>) -> Option<DeploymentStrategy> {
        Some(DeploymentStrategy {
            type_: Some("RollingUpdate".into()),
            rolling_update: Some(RollingUpdateDeployment {
                max_surge: surge.map(v),
                max_unavailable: unavailable.map(v),
            }),
        })
    }

    fn recreate() -> Option<DeploymentStrategy> {
        Some(DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None })
    }

    #[test]
    fn percentages_round_like_the_deployment_controller() {
        let cases = [
            // (value, total, round_up, expected)
            ("25%", 1, true, 1),
            ("25%", 1, false, 0),
            ("25%", 4, false, 1),
            ("25%", 5, false, 1),
            ("25%", 5, true, 2),
            ("50%", 3, false, 1),
            ("50%", 3, true, 2),
            ("100%", 3, false, 3),
            ("0%", 5, true, 0),
            ("2", 5, false, 2),
        ];
        for (value, total, up, expected) in cases {
            assert_eq!(scaled(&v(value), total, up), Ok(expected), "{value} of {total}, round_up {up}");
        }
        assert!(scaled(&v("x%"), 3, true).is_err());
        assert!(scaled(&v("10"), 3, true).is_ok());
        assert!(scaled(&IntOrString::String("ten".into()), 3, true).is_err());
    }

    #[test]
    fn fenceposts_use_defaults_and_never_both_zero() {
        assert_eq!(
            fenceposts(&deployment(Some(4), None)).unwrap(),
            Some(Fenceposts { max_surge: 1, max_unavailable: 1 })
        );
        assert_eq!(
            fenceposts(&deployment(None, rolling(None, None))).unwrap(),
            Some(Fenceposts { max_surge: 1, max_unavailable: 0 })
        );
        assert_eq!(
            fenceposts(&deployment(Some(3), rolling(Some("0"), Some("0%")))).unwrap(),
            Some(Fenceposts { max_surge: 0, max_unavailable: 1 })
        );
        assert_eq!(fenceposts(&deployment(Some(3), recreate())).unwrap(), None);
    }

    /// replicas 1..5 against the default strategy and common mixes, for minAttached 1 and 2.
    #[test]
    fn safety_table() {
        // (replicas, strategy, minAttached, safe)
        let cases: Vec<(i32, Option<DeploymentStrategy>, i32, bool)> = vec![
            (1, None, 1, true),  // 25%: surge 1, unavailable 0
            (2, None, 1, true),  // surge 1, unavailable 0
            (3, None, 1, true),  // surge 1, unavailable 0
            (4, None, 1, true),  // unavailable 1 <= 3
            (4, None, 4, false), // unavailable 1 > 0
            (5, None, 5, false),
            (5, None, 4, true),
            (1, rolling(Some("0"), Some("1")), 1, false), // the last consumer goes first
            (2, rolling(Some("0"), Some("1")), 1, true),
            (2, rolling(Some("0"), Some("1")), 2, false),
            (2, rolling(Some("1"), Some("0")), 2, true),
            (3, rolling(Some("0"), Some("100%")), 1, false), // all at once
            (3, rolling(Some("50%"), Some("50%")), 1, true), // unavailable 1 <= 2
            (3, rolling(Some("50%"), Some("50%")), 3, false),
            (5, rolling(Some("0%"), Some("0%")), 5, false), // fencepost makes unavailable 1
            (1, rolling(Some("0%"), Some("0%")), 1, false),
            (1, recreate(), 1, false),
            (5, recreate(), 1, false),
            (1, None, 2, true), // fewer replicas than minAttached, but nothing unavailable
            (1, rolling(Some("1"), Some("1")), 2, false),
        ];
        for (replicas, strategy, min, safe) in cases {
            let d = deployment(Some(replicas), strategy.clone());
            let verdict = judge_deployment(&d, min);
            assert_eq!(
                matches!(verdict, Judgement::Safe { .. }),
                safe,
                "replicas {replicas} min {min} {strategy:?}: {verdict:?}"
            );
        }
    }

    #[test]
    fn scaled_to_zero_is_safe() {
        assert!(matches!(judge_deployment(&deployment(Some(0), recreate()), 1), Judgement::Safe { .. }));
    }

    #[test]
    fn patches_make_unavailable_zero_and_surge_at_least_one() {
        let mut named = deployment(Some(3), recreate());
        named.metadata.name = Some("worker".into());
        named.metadata.namespace = Some("shop".into());
        let Judgement::Fixable { why, fix: patch, .. } = judge_deployment(&named, 1) else { panic!() };
        assert!(why.contains("Recreate"));
        assert_eq!(
            patch,
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "worker", "namespace": "shop"},
                   "spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}}}),
            "a server-side apply of the strategy alone"
        );
        let Judgement::Fixable { fix: patch, .. } =
            judge_deployment(&deployment(Some(3), rolling(Some("50%"), Some("100%"))), 1)
        else {
            panic!()
        };
        assert_eq!(
            patch["spec"]["strategy"]["rollingUpdate"]["maxSurge"],
            json!("50%"),
            "a surge that allows progress is kept"
        );
        let Judgement::Fixable { fix: patch, .. } =
            judge_deployment(&deployment(Some(3), rolling(Some("0"), Some("1"))), 3)
        else {
            panic!()
        };
        assert_eq!(patch["spec"]["strategy"]["rollingUpdate"]["maxSurge"], json!(1));
        // The patched strategy is itself judged safe.
        let patched = deployment(Some(3), rolling(Some("1"), Some("0")));
        assert!(matches!(judge_deployment(&patched, 3), Judgement::Safe { .. }));
    }

    #[test]
    fn malformed_percentages_are_reported() {
        let d = deployment(Some(3), rolling(Some("lots"), None));
        assert!(matches!(judge_deployment(&d, 1), Judgement::Invalid(e) if e.starts_with("maxSurge")));
    }

    fn stateful_set(yaml: &str) -> StatefulSet {
        serde_yaml_ng::from_str(&format!("metadata: {{name: shard, namespace: shop}}\nspec: {yaml}")).unwrap()
    }

    #[test]
    fn a_statefulset_is_judged_without_surge_and_never_fixed() {
        let one = judge_stateful_set(&stateful_set("{replicas: 1, selector: {}, template: {}, serviceName: s}"), 1);
        let Judgement::Unsafe { why, remedy } = one else { panic!("{one:?}") };
        assert!(why.contains("without surge") && why.contains("1 of 1"), "{why}");
        assert_eq!(remedy, "run at least 2 replicas");
        let two = stateful_set("{replicas: 2, selector: {}, template: {}, serviceName: s}");
        assert_eq!(judge_stateful_set(&two, 1), Judgement::Safe { note: None }, "one pod at a time leaves one");
        assert!(matches!(judge_stateful_set(&two, 2), Judgement::Unsafe { .. }));
        let wide = stateful_set(
            "{replicas: 4, selector: {}, template: {}, serviceName: s, updateStrategy: {rollingUpdate: {maxUnavailable: 50%}}}",
        );
        let Judgement::Unsafe { remedy, .. } = judge_stateful_set(&wide, 3) else { panic!() };
        assert_eq!(remedy, "lower updateStrategy.rollingUpdate.maxUnavailable to 1");
        let on_delete =
            stateful_set("{replicas: 3, selector: {}, template: {}, serviceName: s, updateStrategy: {type: OnDelete}}");
        assert!(matches!(judge_stateful_set(&on_delete, 1), Judgement::Unsafe { why, .. } if why.contains("OnDelete")));
        let partition = stateful_set(
            "{replicas: 3, selector: {}, template: {}, serviceName: s, updateStrategy: {rollingUpdate: {partition: 2}}}",
        );
        let Judgement::Safe { note: Some(note) } = judge_stateful_set(&partition, 1) else { panic!() };
        assert!(note.starts_with("partition 2"), "reported, not changed: {note}");
        let zero = stateful_set("{replicas: 0, selector: {}, template: {}, serviceName: s}");
        assert_eq!(judge_stateful_set(&zero, 1), Judgement::Safe { note: None });
    }

    /// Under Parallel the StatefulSet controller replaces the highest-ordinal pod of the old
    /// revision while pods of lower ordinal are not Ready (it waits only for the pods it
    /// replaced itself), so a pod still waiting for its consumer does not hold the next step.
    #[test]
    fn a_parallel_statefulset_is_unsafe_unless_one_pod_more_can_be_down() {
        let parallel = |replicas: i32, extra: &str| {
            stateful_set(&format!(
                "{{replicas: {replicas}, selector: {{}}, template: {{}}, serviceName: s, podManagementPolicy: Parallel{extra}}}"
            ))
        };
        let Judgement::Unsafe { why, remedy } = judge_stateful_set(&parallel(2, ""), 1) else { panic!() };
        assert!(why.contains("podManagementPolicy Parallel") && why.contains("lower ordinal"), "{why}");
        assert!(remedy.contains("OrderedReady") && remedy.contains("run at least 3 replicas"), "{remedy}");
        assert_eq!(judge_stateful_set(&parallel(3, ""), 1), Judgement::Safe { note: None }, "3 - 1 - 1 >= 1");
        assert!(matches!(judge_stateful_set(&parallel(3, ""), 2), Judgement::Unsafe { .. }));
        let wide = parallel(4, ", updateStrategy: {rollingUpdate: {maxUnavailable: 2}}");
        assert!(matches!(judge_stateful_set(&wide, 2), Judgement::Unsafe { .. }), "4 - 2 - 1 < 2");
        let ordered = stateful_set(
            "{replicas: 2, selector: {}, template: {}, serviceName: s, podManagementPolicy: OrderedReady}",
        );
        assert_eq!(judge_stateful_set(&ordered, 1), Judgement::Safe { note: None });
        let on_delete = parallel(3, ", updateStrategy: {type: OnDelete}");
        assert!(matches!(judge_stateful_set(&on_delete, 1), Judgement::Unsafe { why, .. } if why.contains("OnDelete")));
    }

    fn rollout(yaml: &str) -> Rollout {
        serde_yaml_ng::from_str(&format!(
            "apiVersion: argoproj.io/v1alpha1\nkind: Rollout\nmetadata: {{name: worker, namespace: shop}}\nspec: {yaml}"
        ))
        .unwrap()
    }

    #[test]
    fn a_canary_rollout_is_judged_and_fixed_like_a_deployment() {
        let all_at_once = rollout("{replicas: 3, strategy: {canary: {maxUnavailable: 100%, maxSurge: 1}}}");
        let Judgement::Fixable { why, fix, .. } = judge_rollout(&all_at_once, 1) else { panic!() };
        assert!(why.starts_with("canary:") && why.contains("3 of 3"), "{why}");
        assert_eq!(
            fix,
            json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "worker", "namespace": "shop"},
                   "spec": {"strategy": {"canary": {"maxUnavailable": 0, "maxSurge": 1}}}})
        );
        // Argo's defaults are 25%/25%: of 4 replicas one may go, which leaves 3.
        assert!(matches!(judge_rollout(&rollout("{replicas: 4, strategy: {canary: {}}}"), 3), Judgement::Safe { .. }));
        assert!(matches!(
            judge_rollout(&rollout("{replicas: 4, strategy: {canary: {}}}"), 4),
            Judgement::Fixable { .. }
        ));
        let safe = rollout("{replicas: 1, strategy: {canary: {maxUnavailable: 0, maxSurge: 1}}}");
        assert_eq!(judge_rollout(&safe, 1), Judgement::Safe { note: None });
        assert!(matches!(judge_rollout(&rollout("{replicas: 1, strategy: {}}"), 1), Judgement::Invalid(_)));
    }

    #[test]
    fn a_blue_green_rollout_keeps_its_consumers_except_in_a_restart_of_too_few_replicas() {
        let preview = rollout(
            "{replicas: 3, strategy: {blueGreen: {activeService: w, previewReplicaCount: 1, scaleDownDelaySeconds: 0}}}",
        );
        assert_eq!(judge_rollout(&preview, 2), Judgement::Safe { note: None }, "the old ReplicaSet waits for the new");
        let wide = rollout("{replicas: 3, strategy: {blueGreen: {activeService: w, maxUnavailable: 2}}}");
        let Judgement::Fixable { fix, .. } = judge_rollout(&wide, 2) else { panic!() };
        assert_eq!(fix["spec"], json!({"strategy": {"blueGreen": {"maxUnavailable": 1}}}));
        let single = rollout("{replicas: 1, strategy: {blueGreen: {activeService: w}}}");
        assert!(
            matches!(judge_rollout(&single, 1), Judgement::Unsafe { remedy, .. } if remedy == "run at least 2 replicas")
        );
    }
}
