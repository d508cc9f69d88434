//! Is a Deployment's rollout strategy safe for its consumers? Resolves `maxSurge` and
//! `maxUnavailable` exactly as the Deployment controller does, and says what to patch.

use k8s_openapi::{api::apps::v1::Deployment, apimachinery::pkg::util::intstr::IntOrString};
use serde_json::{Value, json};

/// maxSurge and maxUnavailable as the Deployment controller resolves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fenceposts {
    pub max_surge: i32,
    pub max_unavailable: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Availability cannot drop below minAttached during a rollout.
    Safe { replicas: i32, fenceposts: Option<Fenceposts> },
    /// Unsafe; `patch` is the strategic merge patch that makes it safe.
    Unsafe { why: String, patch: Value },
    /// The strategy cannot be read (a malformed percentage).
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

/// The fenceposts of a RollingUpdate Deployment (defaults 25%/25%); None for Recreate.
pub fn fenceposts(deployment: &Deployment) -> Result<Option<Fenceposts>, String> {
    let spec = deployment.spec.as_ref();
    let replicas = replicas(deployment);
    let strategy = spec.and_then(|s| s.strategy.as_ref());
    if strategy.and_then(|s| s.type_.as_deref()) == Some("Recreate") {
        return Ok(None);
    }
    let rolling = strategy.and_then(|s| s.rolling_update.as_ref());
    let default = IntOrString::String("25%".into());
    let surge = rolling.and_then(|r| r.max_surge.as_ref()).unwrap_or(&default);
    let unavailable = rolling.and_then(|r| r.max_unavailable.as_ref()).unwrap_or(&default);
    let max_surge = scaled(surge, replicas, true).map_err(|e| format!("maxSurge: {e}"))?;
    let mut max_unavailable = scaled(unavailable, replicas, false).map_err(|e| format!("maxUnavailable: {e}"))?;
    // The Deployment controller never lets both be zero: it would make no progress.
    if max_surge == 0 && max_unavailable == 0 {
        max_unavailable = 1;
    }
    Ok(Some(Fenceposts { max_surge, max_unavailable }))
}

/// spec.replicas, defaulting to 1 as the API server does.
pub fn replicas(deployment: &Deployment) -> i32 {
    deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1)
}

/// Judges a Deployment for `min_attached` consumers. A rollout may take `maxUnavailable` pods
/// below `replicas`, so it is safe only when `replicas - maxUnavailable >= minAttached` (or,
/// with fewer replicas than minAttached, when nothing may become unavailable at all).
pub fn judge(deployment: &Deployment, min_attached: i32) -> Verdict {
    let replicas = replicas(deployment);
    let fp = match fenceposts(deployment) {
        Ok(fp) => fp,
        Err(e) => return Verdict::Invalid(e),
    };
    if replicas == 0 {
        return Verdict::Safe { replicas, fenceposts: fp };
    }
    let allowed = (replicas - min_attached).max(0);
    let why = match fp {
        None => "strategy Recreate stops every old pod before any new one starts".to_owned(),
        Some(f) if f.max_unavailable > allowed => format!(
            "RollingUpdate may take {} of {replicas} pods unavailable (maxUnavailable resolves to {}), leaving fewer than minAttached {min_attached} consumers",
            f.max_unavailable, f.max_unavailable
        ),
        Some(_) => return Verdict::Safe { replicas, fenceposts: fp },
    };
    Verdict::Unsafe { why, patch: safe_patch(deployment, fp) }
}

/// maxUnavailable 0, and maxSurge as it was when it already allows at least one extra pod.
fn safe_patch(deployment: &Deployment, fp: Option<Fenceposts>) -> Value {
    let current = deployment
        .spec
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
        .and_then(|s| s.rolling_update.as_ref())
        .and_then(|r| r.max_surge.clone());
    let surge = match (current, fp) {
        (Some(IntOrString::Int(n)), Some(f)) if f.max_surge >= 1 => json!(n),
        (Some(IntOrString::String(s)), Some(f)) if f.max_surge >= 1 => json!(s),
        _ => json!(1),
    };
    json!({"spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": surge}}}})
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
            let verdict = judge(&d, min);
            assert_eq!(
                matches!(verdict, Verdict::Safe { .. }),
                safe,
                "replicas {replicas} min {min} {strategy:?}: {verdict:?}"
            );
        }
    }

    #[test]
    fn scaled_to_zero_is_safe() {
        assert!(matches!(judge(&deployment(Some(0), recreate()), 1), Verdict::Safe { replicas: 0, .. }));
    }

    #[test]
    fn patches_make_unavailable_zero_and_surge_at_least_one() {
        let Verdict::Unsafe { why, patch } = judge(&deployment(Some(3), recreate()), 1) else { panic!() };
        assert!(why.contains("Recreate"));
        assert_eq!(
            patch,
            json!({"spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}}})
        );
        let Verdict::Unsafe { patch, .. } = judge(&deployment(Some(3), rolling(Some("50%"), Some("100%"))), 1) else {
            panic!()
        };
        assert_eq!(
            patch["spec"]["strategy"]["rollingUpdate"]["maxSurge"],
            json!("50%"),
            "a surge that allows progress is kept"
        );
        let Verdict::Unsafe { patch, .. } = judge(&deployment(Some(3), rolling(Some("0"), Some("1"))), 3) else {
            panic!()
        };
        assert_eq!(patch["spec"]["strategy"]["rollingUpdate"]["maxSurge"], json!(1));
        // The patched strategy is itself judged safe.
        let patched = deployment(Some(3), rolling(Some("1"), Some("0")));
        assert!(matches!(judge(&patched, 3), Verdict::Safe { .. }));
    }

    #[test]
    fn malformed_percentages_are_reported() {
        let d = deployment(Some(3), rolling(Some("lots"), None));
        assert!(matches!(judge(&d, 1), Verdict::Invalid(e) if e.starts_with("maxSurge")));
    }
}
