//! How findings are printed: one line each as text, or a JSON array.

use super::{Finding, Manifests, Severity};
use serde_json::{Value, json};

/// One line per finding: `file: severity ID rule-name: Kind namespace/name: message`.
pub fn text(findings: &[Finding]) -> String {
    findings
        .iter()
        .map(|f| {
            format!(
                "{}: {} {} {}: {}: {}\n",
                f.object.file,
                f.severity.as_str(),
                f.rule.id(),
                f.rule.name(),
                f.object,
                f.message
            )
        })
        .collect()
}

/// `[{rule, ruleName, severity, kind, namespace, name, message, file}]`; namespace is null when
/// the manifest gives none.
pub fn json(findings: &[Finding]) -> Value {
    Value::Array(
        findings
            .iter()
            .map(|f| {
                json!({
                    "rule": f.rule.id(),
                    "ruleName": f.rule.name(),
                    "severity": f.severity.as_str(),
                    "kind": f.object.kind,
                    "namespace": f.object.namespace,
                    "name": f.object.name,
                    "message": f.message,
                    "file": f.object.file,
                })
            })
            .collect(),
    )
}

/// A closing line for people: what was checked and how much was found.
pub fn summary(manifests: &Manifests, findings: &[Finding]) -> String {
    let count = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    // QueuePatterns are counted only where there are any, so that the line reads as before.
    let patterns = match manifests.patterns.len() {
        0 => String::new(),
        n => format!("{}, ", count(n, "QueuePattern")),
    };
    let checked = format!(
        "{} ({} QueuePolic{}, {patterns}{})",
        count(manifests.objects, "object"),
        manifests.policies.len(),
        if manifests.policies.len() == 1 { "y" } else { "ies" },
        count(manifests.workloads.len(), "workload")
    );
    if findings.is_empty() {
        return format!("no findings in {checked}");
    }
    let errors = findings.iter().filter(|f| f.severity == Severity::Error).count();
    format!(
        "{} ({}, {}) in {checked}",
        count(findings.len(), "finding"),
        count(errors, "error"),
        count(findings.len() - errors, "warning")
    )
}

/// The rules and exit codes, for `queueguard check --help`.
pub fn rules_help() -> String {
    let mut help = String::from("Rules:\n");
    for r in super::Rule::ALL {
        help.push_str(&format!("  {} {:<32} {}\n", r.id(), r.name(), r.summary()));
    }
    help.push_str("\nExit status: 0 no findings, 1 findings (errors or warnings), 2 input that cannot be read.");
    help
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::{ObjectId, Rule};

    fn sample() -> Vec<Finding> {
        let object = |namespace: Option<&str>| ObjectId {
            kind: "Deployment",
            namespace: namespace.map(str::to_owned),
            name: "worker".into(),
            file: "deploy.yaml".into(),
            position: 0,
        };
        vec![
            Finding {
                rule: Rule::MissingReadinessGate,
                severity: Severity::Error,
                object: object(Some("shop")),
                message: "why. What to do.".into(),
            },
            Finding {
                rule: Rule::UnsafeRolloutStrategy,
                severity: Severity::Warning,
                object: object(None),
                message: "m".into(),
            },
        ]
    }

    #[test]
    fn text_is_one_line_per_finding() {
        assert_eq!(
            text(&sample()),
            "deploy.yaml: error QG003 missing-readiness-gate: Deployment shop/worker: why. What to do.\n\
             deploy.yaml: warning QG002 unsafe-rollout-strategy: Deployment worker: m\n"
        );
    }

    #[test]
    fn json_names_rule_object_and_file() {
        let v = json(&sample());
        assert_eq!(
            v[0],
            json!({"rule": "QG003", "ruleName": "missing-readiness-gate", "severity": "error", "kind": "Deployment",
                   "namespace": "shop", "name": "worker", "message": "why. What to do.", "file": "deploy.yaml"})
        );
        assert_eq!(v[1]["namespace"], Value::Null);
    }

    #[test]
    fn summary_counts() {
        let m = Manifests { objects: 3, ..Default::default() };
        assert_eq!(summary(&m, &[]), "no findings in 3 objects (0 QueuePolicies, 0 workloads)");
        assert_eq!(
            summary(&m, &sample()),
            "2 findings (1 error, 1 warning) in 3 objects (0 QueuePolicies, 0 workloads)"
        );
    }

    #[test]
    fn summary_counts_queue_patterns_only_when_there_are_some() {
        let pattern = crate::check::PatternDoc {
            id: sample()[0].object.clone(),
            state: crate::check::PatternState::Unserved { api_version: "queueguard.io/v1".into() },
        };
        let m = Manifests { objects: 2, patterns: vec![pattern.clone(), pattern], ..Default::default() };
        assert_eq!(summary(&m, &[]), "no findings in 2 objects (0 QueuePolicies, 2 QueuePatterns, 0 workloads)");
    }
}
