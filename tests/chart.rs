//! The Helm chart, rendered and linted by the real helm binary (scripts/helm.sh fetches it;
//! QUEUEGUARD_HELM names it). Each manifest must parse into its k8s-openapi type without losing
//! a field, the RBAC must grant exactly what src/rbac.rs lists, the operator's arguments must
//! parse with the real command line, and values.schema.json must refuse bad values.

use clap::Parser;
use k8s_openapi::{
    api::{
        admissionregistration::v1::{
            MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        },
        apps::v1::Deployment,
        core::v1::{Service, ServiceAccount},
        policy::v1::PodDisruptionBudget,
        rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use queueguard::{
    cli::{Cli, Command},
    rbac::{Feature, RULES, Scope},
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command as Process,
    sync::OnceLock,
};

const CHART: &str = "charts/queueguard";
const RELEASE_NS: &str = "qg";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The helm binary: QUEUEGUARD_HELM, or whatever scripts/helm.sh provides.
fn helm() -> &'static PathBuf {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| {
        if let Ok(path) = std::env::var("QUEUEGUARD_HELM") {
            return PathBuf::from(path);
        }
        let out = Process::new(root().join("scripts/helm.sh")).output().expect("scripts/helm.sh runs");
        assert!(out.status.success(), "scripts/helm.sh failed: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
}

fn run_helm(args: &[&str]) -> (bool, String, String) {
    let out = Process::new(helm()).args(args).current_dir(root()).output().expect("helm runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// `helm template` with a values file (or none) and extra flags; the documents, nulls skipped.
fn render(values: Option<&str>, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["template", "qg", CHART, "--namespace", RELEASE_NS];
    if let Some(v) = values {
        args.extend(["-f", v]);
    }
    args.extend(extra);
    let (ok, stdout, stderr) = run_helm(&args);
    assert!(ok, "helm {args:?} failed:\n{stderr}");
    serde_yaml_ng::Deserializer::from_str(&stdout)
        .map(|d| serde_yaml_ng::from_value::<Value>(serde_yaml_ng::Value::deserialize(d).unwrap()).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

use serde::Deserialize;

const VALUE_FILES: [Option<&str>; 5] = [
    None,
    Some("charts/queueguard/ci/all-enabled-values.yaml"),
    Some("charts/queueguard/ci/cert-manager-values.yaml"),
    Some("charts/queueguard/ci/namespace-scope-values.yaml"),
    Some("charts/queueguard/ci/namespaces-rbac-values.yaml"),
];

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// Parses into the typed object and back; a field the type does not know is lost on the way.
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> T {
    let typed: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{} {} does not parse: {e}", doc["kind"], doc["metadata"]["name"]));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        &back, doc,
        "{} {} lost or changed a field on the way through its type",
        doc["kind"], doc["metadata"]["name"]
    );
    typed
}

#[test]
fn chart_crds_are_the_generated_ones() {
    let names = |dir: &str| {
        let mut files: Vec<String> = std::fs::read_dir(root().join(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        files.sort();
        files
    };
    assert_eq!(names("crds"), ["queuepattern.yaml", "queuepolicy.yaml"]);
    assert_eq!(names("charts/queueguard/crds"), names("crds"), "the chart ships every CRD, and only those");
    for file in names("crds") {
        let top = std::fs::read(root().join("crds").join(&file)).unwrap();
        let chart = std::fs::read(root().join("charts/queueguard/crds").join(&file)).unwrap();
        assert!(top == chart, "charts/queueguard/crds/{file} differs from crds/{file}; copy it");
    }
}

#[test]
fn helm_lint_passes_with_defaults_and_every_optional_part() {
    for values in VALUE_FILES {
        let mut args = vec!["lint", "--strict", CHART];
        if let Some(v) = values {
            args.extend(["-f", v]);
        }
        let (ok, stdout, stderr) = run_helm(&args);
        assert!(ok, "helm {args:?}:\n{stdout}\n{stderr}");
    }
}

#[test]
fn every_manifest_is_a_well_formed_kubernetes_object() {
    for values in VALUE_FILES {
        let docs = render(values, &["--include-crds"]);
        for doc in &docs {
            match doc["kind"].as_str().unwrap_or_default() {
                "Deployment" => drop(round_trip::<Deployment>(doc)),
                "Job" => drop(round_trip::<k8s_openapi::api::batch::v1::Job>(doc)),
                "ServiceAccount" => drop(round_trip::<ServiceAccount>(doc)),
                "Service" => drop(round_trip::<Service>(doc)),
                "ClusterRole" => drop(round_trip::<ClusterRole>(doc)),
                "ClusterRoleBinding" => drop(round_trip::<ClusterRoleBinding>(doc)),
                "Role" => drop(round_trip::<Role>(doc)),
                "RoleBinding" => drop(round_trip::<RoleBinding>(doc)),
                "PodDisruptionBudget" => drop(round_trip::<PodDisruptionBudget>(doc)),
                "MutatingWebhookConfiguration" => drop(round_trip::<MutatingWebhookConfiguration>(doc)),
                "ValidatingAdmissionPolicy" => drop(round_trip::<ValidatingAdmissionPolicy>(doc)),
                "ValidatingAdmissionPolicyBinding" => drop(round_trip::<ValidatingAdmissionPolicyBinding>(doc)),
                "CustomResourceDefinition" => drop(round_trip::<CustomResourceDefinition>(doc)),
                // Third-party kinds without k8s-openapi types: their shape is checked below.
                "ConfigMap" => drop(round_trip::<k8s_openapi::api::core::v1::ConfigMap>(doc)),
                "ServiceMonitor" | "Certificate" | "Issuer" | "PrometheusRule" => {
                    assert!(doc["spec"].is_object(), "{doc}");
                }
                other => panic!("unexpected kind {other} in {values:?}"),
            }
            assert!(doc["metadata"]["name"].as_str().is_some_and(|n| !n.is_empty()), "{doc}");
        }
    }
}

fn deployment(docs: &[Value]) -> Deployment {
    let found = of_kind(docs, "Deployment");
    assert_eq!(found.len(), 1);
    serde_json::from_value(found[0].clone()).unwrap()
}

/// The container's arguments, parsed by the operator's own command line.
fn run_args(d: &Deployment) -> queueguard::cli::RunArgs {
    let container = &d.spec.as_ref().unwrap().template.spec.as_ref().unwrap().containers[0];
    let mut argv = vec!["queueguard".to_owned()];
    argv.extend(container.args.clone().unwrap_or_default());
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("the chart's arguments {argv:?} do not parse: {e}"));
    match cli.command {
        Command::Run(args) => args,
        other => panic!("the chart runs {other:?}"),
    }
}

#[test]
fn the_operator_runs_hardened_with_probes_on_its_health_endpoints() {
    let d = deployment(&render(None, &[]));
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2), "two replicas with leader election by default");
    let pod = spec.template.spec.as_ref().unwrap();
    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(psc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.capabilities.as_ref().unwrap().drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let resources = c.resources.as_ref().unwrap();
    assert!(resources.requests.is_some() && resources.limits.is_some());
    let path =
        |p: &Option<k8s_openapi::api::core::v1::Probe>| p.as_ref().unwrap().http_get.as_ref().unwrap().path.clone();
    assert_eq!(path(&c.liveness_probe).as_deref(), Some("/healthz"));
    assert_eq!(path(&c.readiness_probe).as_deref(), Some("/readyz"));
    assert!(pod.termination_grace_period_seconds.is_some());
    let args = run_args(&d);
    assert!(args.leader_election);
    assert_eq!(args.http_addr.port(), 8080);
    assert!(args.webhook_addr.is_none(), "the webhook is off by default");
    let env: Vec<_> = c.env.as_ref().unwrap().iter().map(|e| e.name.as_str()).collect();
    assert!(env.contains(&"POD_NAME") && env.contains(&"POD_NAMESPACE"), "{env:?}");
}

#[test]
fn webhook_arguments_and_configuration_agree() {
    for (values, self_signed) in [
        ("charts/queueguard/ci/all-enabled-values.yaml", true),
        ("charts/queueguard/ci/cert-manager-values.yaml", false),
    ] {
        let docs = render(Some(values), &[]);
        let args = run_args(&deployment(&docs));
        assert!(args.webhook_addr.is_some());
        assert_eq!(args.webhook_secret.is_some(), self_signed, "{values}");
        assert_eq!(args.webhook_cert_dir.is_some(), !self_signed, "{values}");
        let config: MutatingWebhookConfiguration =
            serde_json::from_value(of_kind(&docs, "MutatingWebhookConfiguration")[0].clone()).unwrap();
        assert_eq!(Some(config.metadata.name.clone().unwrap()), args.webhook_config, "{values}");
        let hook = &config.webhooks.as_ref().unwrap()[0];
        assert_eq!(hook.failure_policy.as_deref(), Some("Ignore"), "a down operator must never block pods");
        assert_eq!(hook.side_effects, "None");
        let service = hook.client_config.service.as_ref().unwrap();
        assert_eq!(service.path.as_deref(), Some("/mutate-pods"));
        assert_eq!(Some(service.name.clone()), args.webhook_service, "{values}");
        assert!(of_kind(&docs, "Service").iter().any(|s| s["metadata"]["name"] == service.name.as_str()));
        let rules = hook.rules.as_ref().unwrap();
        assert!(
            rules
                .iter()
                .any(|r| r.operations.as_ref().unwrap() == &["CREATE"] && r.resources.as_ref().unwrap() == &["pods"])
        );
        // Opt-in by namespace label: pods elsewhere (kube-system, namespaces without policies)
        // are never sent to the operator.
        let selector = hook.namespace_selector.as_ref().expect("a namespaceSelector");
        let (key, value) = queueguard::webhook::NAMESPACE_LABEL;
        assert_eq!(
            selector.match_labels.as_ref().and_then(|l| l.get(key)).map(String::as_str),
            Some(value),
            "{values}"
        );
    }
}

/// `queueguard check` understands the rendered webhook: a guarded Deployment without the gate
/// passes in a namespace that opted in, and is an error in one that did not.
#[test]
fn check_reads_the_charts_webhook_namespace_selector() {
    let docs = render(Some("charts/queueguard/ci/all-enabled-values.yaml"), &[]);
    let config = serde_yaml_ng::to_string(&of_kind(&docs, "MutatingWebhookConfiguration")[0]).unwrap();
    let workload = "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: orders, namespace: shop}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {name: orders}\n  consumers: {deployment: worker}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: worker, namespace: shop}\nspec:\n  replicas: 2\n  strategy: {rollingUpdate: {maxUnavailable: 0, maxSurge: 1}}\n  selector: {matchLabels: {app: worker}}\n  template:\n    metadata: {labels: {app: worker}}\n    spec: {containers: [{name: w, image: w}]}\n";
    let namespace =
        |labels: &str| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: shop, labels: {{{labels}}}}}\n");
    let findings = |ns: String| {
        let text = format!("{config}---\n{workload}---\n{ns}");
        let m = queueguard::check::read::read_str("all.yaml", &text).unwrap();
        queueguard::check::rules::check(&m).into_iter().map(|f| f.rule.id()).collect::<Vec<_>>()
    };
    assert_eq!(findings(namespace("queueguard.io/readiness-gate-inject: enabled")), Vec::<&str>::new());
    assert_eq!(findings(namespace("team: shop")), ["QG003"]);
}

/// (group, resource, verb, scope) granted by the rendered Roles and ClusterRoles.
fn granted(docs: &[Value]) -> BTreeSet<(String, String, String, &'static str)> {
    let mut out = BTreeSet::new();
    let mut add = |rules: &[PolicyRule], scope: &dyn Fn(&str) -> &'static str| {
        for r in rules {
            for g in r.api_groups.as_deref().unwrap_or_default() {
                for res in r.resources.as_deref().unwrap_or_default() {
                    for v in &r.verbs {
                        out.insert((g.clone(), res.clone(), v.clone(), scope(res)));
                    }
                }
            }
        }
    };
    for doc in of_kind(docs, "ClusterRole") {
        let role: ClusterRole = serde_json::from_value(doc.clone()).unwrap();
        add(role.rules.as_deref().unwrap_or_default(), &|res| {
            if res == "mutatingwebhookconfigurations" { "Cluster" } else { "Watched" }
        });
    }
    for doc in of_kind(docs, "Role") {
        let role: Role = serde_json::from_value(doc.clone()).unwrap();
        let own = role.metadata.namespace.as_deref() == Some(RELEASE_NS);
        add(role.rules.as_deref().unwrap_or_default(), &|_| if own { "Own" } else { "Watched" });
    }
    out
}

fn expected(features: &[Feature]) -> BTreeSet<(String, String, String, &'static str)> {
    let scope = |s: Scope| match s {
        Scope::Watched => "Watched",
        Scope::Own => "Own",
        Scope::Cluster => "Cluster",
    };
    RULES
        .iter()
        .filter(|r| r.feature.is_none_or(|f| features.contains(&f)))
        .flat_map(|r| {
            r.verbs.iter().map(move |v| (r.group.to_owned(), r.resource.to_owned(), v.to_string(), scope(r.scope)))
        })
        .collect()
}

#[test]
fn rbac_grants_exactly_what_the_code_uses() {
    let cases: [(Option<&str>, &[Feature]); 4] = [
        (None, &[Feature::LeaderElection, Feature::UninstallHook]),
        (
            Some("charts/queueguard/ci/all-enabled-values.yaml"),
            &[
                Feature::LeaderElection,
                Feature::WebhookSelfSigned,
                Feature::UninstallHook,
                Feature::RabbitmqClusters,
                Feature::TopologyQueues,
            ],
        ),
        (Some("charts/queueguard/ci/cert-manager-values.yaml"), &[Feature::LeaderElection, Feature::UninstallHook]),
        (Some("charts/queueguard/ci/namespace-scope-values.yaml"), &[Feature::LeaderElection, Feature::UninstallHook]),
    ];
    for (values, features) in cases {
        let docs = render(values, &[]);
        assert_eq!(granted(&docs), expected(features), "RBAC of {values:?} differs from src/rbac.rs");
        // Every Role and ClusterRole is bound to the operator's ServiceAccount.
        let sa = of_kind(&docs, "ServiceAccount")[0]["metadata"]["name"].clone();
        for (binding, role) in [("RoleBinding", "Role"), ("ClusterRoleBinding", "ClusterRole")] {
            let bound: BTreeSet<_> = of_kind(&docs, binding)
                .iter()
                .filter(|b| b["subjects"].as_array().unwrap().iter().any(|s| s["name"] == sa))
                .map(|b| b["roleRef"]["name"].as_str().unwrap().to_owned())
                .collect();
            for r in of_kind(&docs, role) {
                assert!(
                    bound.contains(r["metadata"]["name"].as_str().unwrap()),
                    "{role} {} is not bound",
                    r["metadata"]["name"]
                );
            }
        }
    }
    // Writes only in the listed namespaces: the ClusterRole reads, a Role in each writes.
    let docs = render(Some("charts/queueguard/ci/namespaces-rbac-values.yaml"), &[]);
    assert_eq!(granted(&docs), expected(&[Feature::LeaderElection, Feature::UninstallHook]));
    for doc in of_kind(&docs, "ClusterRole") {
        let role: ClusterRole = serde_json::from_value(doc.clone()).unwrap();
        for rule in role.rules.unwrap_or_default() {
            assert!(rule.verbs.iter().all(|v| ["get", "list", "watch"].contains(&v.as_str())), "{rule:?}");
        }
    }
    let writers: BTreeSet<&str> = of_kind(&docs, "Role")
        .iter()
        .filter(|r| r["rules"].as_array().unwrap().iter().any(|rule| rule["resources"][0] == "pods/status"))
        .map(|r| r["metadata"]["namespace"].as_str().unwrap())
        .collect();
    assert_eq!(writers, BTreeSet::from(["shop", "billing"]));
    assert_eq!(run_args(&deployment(&docs)).namespaces, ["shop", "billing"], "and the operator acts only there");
    // Nor does the webhook add gates elsewhere: nobody would ever open them.
    let hooked = render(Some("charts/queueguard/ci/namespaces-rbac-values.yaml"), &["--set", "webhook.enabled=true"]);
    let config = &of_kind(&hooked, "MutatingWebhookConfiguration")[0];
    let expressions = config["webhooks"][0]["namespaceSelector"]["matchExpressions"].as_array().unwrap();
    assert!(
        expressions.iter().any(|e| e["key"] == "kubernetes.io/metadata.name"
            && e["operator"] == "In"
            && e["values"] == serde_json::json!(["shop", "billing"])),
        "{expressions:?}"
    );
    let namespaced = render(Some("charts/queueguard/ci/namespace-scope-values.yaml"), &[]);
    assert!(of_kind(&namespaced, "ClusterRole").is_empty(), "Namespace scope needs no cluster-wide rights");
    assert_eq!(run_args(&deployment(&namespaced)).namespace.as_deref(), Some("apps"));
}

#[test]
fn values_schema_refuses_wrong_types_and_unknown_keys() {
    for (set, mentions) in [
        ("replicaCount=abc", "replicaCount"),
        ("logFormat=xml", "logFormat"),
        ("unknownKey=1", "unknownKey"),
        ("image.repo=x", "repo"),
        ("watch.scope=Everywhere", "scope"),
        ("metrics.service.port=70000", "port"),
    ] {
        let (ok, _, stderr) = run_helm(&["template", "qg", CHART, "--namespace", RELEASE_NS, "--set", set]);
        assert!(!ok, "--set {set} was accepted");
        assert!(stderr.contains(mentions), "--set {set}: the error does not name '{mentions}':\n{stderr}");
    }
    let (ok, _, stderr) = run_helm(&["template", "qg", CHART, "--namespace", RELEASE_NS, "--set", "replicaCount=3"]);
    assert!(ok, "a valid value is accepted: {stderr}");
}

#[test]
fn the_prometheus_rule_and_the_dashboard_are_the_shipped_files_and_off_by_default() {
    let defaults = render(None, &[]);
    assert!(of_kind(&defaults, "PrometheusRule").is_empty() && of_kind(&defaults, "ConfigMap").is_empty());

    let docs = render(Some("charts/queueguard/ci/all-enabled-values.yaml"), &[]);
    let rule = of_kind(&docs, "PrometheusRule");
    assert_eq!(rule.len(), 1);
    assert_eq!(rule[0]["metadata"]["labels"]["release"], "kube-prometheus-stack", "the ruleSelector's label");
    let file: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root().join("charts/queueguard/files/alerts.yaml")).unwrap())
            .unwrap();
    assert_eq!(rule[0]["spec"]["groups"], file["groups"], "the PrometheusRule carries files/alerts.yaml as it is");
    let description = rule[0]["spec"]["groups"][0]["rules"][0]["annotations"]["summary"].as_str().unwrap();
    assert!(description.contains("{{ $labels.namespace }}"), "Prometheus's templates pass through helm: {description}");

    // The alerts group by the series' own namespace label, the policy's: the scrape keeps it.
    let monitor = of_kind(&docs, "ServiceMonitor");
    assert_eq!(monitor[0]["spec"]["endpoints"][0]["honorLabels"], true);

    let maps = of_kind(&docs, "ConfigMap");
    assert_eq!(maps.len(), 1);
    let map = maps[0];
    assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1", "the sidecar's label");
    assert_eq!(map["metadata"]["namespace"], "monitoring");
    assert_eq!(map["metadata"]["annotations"]["grafana_folder"], "Operators");
    let shipped: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("charts/queueguard/files/dashboard.json")).unwrap())
            .unwrap();
    let rendered: Value = serde_json::from_str(map["data"]["queueguard.json"].as_str().unwrap()).unwrap();
    assert_eq!(rendered, shipped, "the ConfigMap carries files/dashboard.json as it is");
}

#[test]
fn helm_uninstall_first_stops_the_operator_and_removes_its_finalizers() {
    for values in VALUE_FILES {
        let docs = render(values, &[]);
        let jobs = of_kind(&docs, "Job");
        assert_eq!(jobs.len(), 1, "{values:?}");
        let job = jobs[0];
        assert_eq!(job["metadata"]["annotations"]["helm.sh/hook"], "pre-delete");
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            container["image"],
            deployment(&docs).spec.unwrap().template.spec.unwrap().containers[0].image.clone().unwrap()
        );
        // The arguments, parsed by the operator's own command line.
        let args: Vec<String> = serde_json::from_value(container["args"].clone()).unwrap();
        let cli = queueguard::cli::Cli::try_parse_from(std::iter::once("queueguard".to_owned()).chain(args)).unwrap();
        let queueguard::cli::Command::Uninstall(u) = cli.command else { panic!("not uninstall: {container}") };
        let operator = deployment(&docs);
        assert_eq!(
            u.operator_deployment,
            Some((RELEASE_NS.to_owned(), operator.metadata.name.clone().unwrap())),
            "it stops this release's operator"
        );
        assert_eq!(u.namespace, run_args(&operator).namespace, "the same scope as the operator");
        assert!(!u.dry_run);
        // Its Role reaches only the operator's own Deployment, and the hook's RBAC comes first.
        let role =
            of_kind(&docs, "Role").into_iter().find(|r| r["metadata"]["name"] == job["metadata"]["name"]).unwrap();
        for rule in role["rules"].as_array().unwrap() {
            if rule["resources"] == serde_json::json!(["pods"]) {
                // list cannot name objects: it reads pods, the operator's by label.
                assert_eq!(rule["verbs"], serde_json::json!(["list"]));
                continue;
            }
            assert_eq!(rule["resourceNames"], serde_json::json!([operator.metadata.name.clone().unwrap()]));
        }
        let labels = &job["spec"]["template"]["metadata"]["labels"];
        let selector = operator.spec.as_ref().unwrap().selector.match_labels.clone().unwrap();
        assert!(
            selector.iter().any(|(k, v)| labels[k.as_str()] != v.as_str()),
            "the hook's pod must not carry the operator's selector labels: {labels}"
        );
        assert_eq!(role["metadata"]["annotations"]["helm.sh/hook-weight"], "-10");
    }
    let off = render(None, &["--set", "uninstall.removeFinalizers=false"]);
    assert!(of_kind(&off, "Job").is_empty());
}

/// The admission policies, evaluated by kube-cel (the CEL of the API server's
/// ValidatingAdmissionPolicy) against the writes the operator makes and the ones it must not.
mod admission_policy {
    use super::*;
    use kube::core::cel::{AdmissionRequest, VapEvaluator, VapExpression};
    use serde_json::json;

    const OPERATOR: &str = "system:serviceaccount:qg:qg-queueguard";

    /// Each policy's (matchConditions, validations), by its name's suffix.
    fn policies() -> Vec<(String, Vec<String>, Vec<String>)> {
        let docs = render(None, &[]);
        let found = of_kind(&docs, "ValidatingAdmissionPolicy");
        assert_eq!(found.len(), 5, "on by default");
        let bindings = of_kind(&docs, "ValidatingAdmissionPolicyBinding");
        found
            .iter()
            .map(|p| {
                let name = p["metadata"]["name"].as_str().unwrap().to_owned();
                assert!(
                    bindings.iter().any(|b| b["spec"]["policyName"] == name.as_str()
                        && b["spec"]["validationActions"] == json!(["Deny"])),
                    "{name} is bound to deny"
                );
                assert_eq!(p["spec"]["failurePolicy"], "Fail");
                let exprs = |key: &str| -> Vec<String> {
                    p["spec"][key]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|e| e["expression"].as_str().unwrap().to_owned())
                        .collect()
                };
                (name, exprs("matchConditions"), exprs("validations"))
            })
            .collect()
    }

    fn policy(suffix: &str) -> (Vec<String>, Vec<String>) {
        let (_, matches, validations) =
            policies().into_iter().find(|(n, _, _)| n.ends_with(suffix)).unwrap_or_else(|| panic!("no {suffix}"));
        (matches, validations)
    }

    /// Whether the policy lets `user` make this write: false when a validation fails or cannot
    /// be evaluated (failurePolicy Fail).
    fn admits(suffix: &str, user: &str, operation: &str, object: Value, old: Option<Value>) -> bool {
        let (matches, validations) = policy(suffix);
        let mut builder = VapEvaluator::builder().object(object).request(AdmissionRequest {
            operation: operation.into(),
            username: user.into(),
            ..Default::default()
        });
        if let Some(old) = old {
            builder = builder.old_object(old);
        }
        let evaluator = builder.build();
        let run = |exprs: &[String]| {
            evaluator.evaluate(
                &exprs
                    .iter()
                    .map(|e| VapExpression { expression: e.clone(), message: None, message_expression: None })
                    .collect::<Vec<_>>(),
            )
        };
        if !run(&matches).iter().all(|r| r.passed) {
            return true; // not the operator: the policy does not apply
        }
        run(&validations.iter().map(|e| as_kube_cel_reads(e)).collect::<Vec<_>>()).iter().all(|r| r.passed)
    }

    /// kube-cel, schema-less, escapes every object key as the API server escapes schema
    /// property names (`.` as `__dot__`, ...); the API server leaves map keys such as labels as
    /// they are. The label keys the expressions name are escaped here the same way, so they are
    /// looked up as kube-cel stored them.
    fn as_kube_cel_reads(expression: &str) -> String {
        let escape = |key: &str| {
            key.replace('_', "__").replace('.', "__dot__").replace('-', "__dash__").replace('/', "__slash__")
        };
        [
            "app.kubernetes.io/managed-by",
            "queueguard.io/deployment",
            "queueguard.io/statefulset",
            "queueguard.io/rollout",
            "queueguard.io/restartedAt",
        ]
        .iter()
        .fold(expression.to_owned(), |e, key| e.replace(&format!("'{key}'"), &format!("'{}'", escape(key))))
    }

    fn worker() -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "worker", "namespace": "shop", "labels": {"app": "worker"},
                         "annotations": {"deployment.kubernetes.io/revision": "3"}, "resourceVersion": "41"},
            "spec": {"replicas": 2, "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600,
                     "selector": {"matchLabels": {"app": "worker"}},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
                     "template": {"metadata": {"labels": {"app": "worker"}},
                                  "spec": {"containers": [{"name": "w", "image": "worker:1"}]}}},
        })
    }

    #[test]
    fn the_operator_may_change_a_deployments_strategy_and_nothing_else() {
        let old = worker();
        let mut safe = old.clone();
        safe["spec"]["strategy"] =
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}});
        safe["metadata"]["resourceVersion"] = json!("42");
        assert!(admits("strategy-only", OPERATOR, "UPDATE", safe.clone(), Some(old.clone())));
        let mut image = safe.clone();
        image["spec"]["template"]["spec"]["containers"][0]["image"] = json!("evil:1");
        assert!(!admits("strategy-only", OPERATOR, "UPDATE", image.clone(), Some(old.clone())), "an image change");
        let mut replicas = safe.clone();
        replicas["spec"]["replicas"] = json!(0);
        assert!(!admits("strategy-only", OPERATOR, "UPDATE", replicas, Some(old.clone())));
        let mut paused = safe.clone();
        paused["spec"]["paused"] = json!(true);
        assert!(!admits("strategy-only", OPERATOR, "UPDATE", paused, Some(old.clone())), "a field set that was not");
        let mut labels = safe.clone();
        labels["metadata"]["labels"]["app"] = json!("other");
        assert!(!admits("strategy-only", OPERATOR, "UPDATE", labels, Some(old.clone())));
        // Anyone else is not this policy's business.
        assert!(admits("strategy-only", "kubernetes-admin", "UPDATE", image, Some(old)));
        // A Deployment without the optional fields.
        let bare = json!({"metadata": {"name": "w"}, "spec": {"replicas": 1, "selector": {}, "template": {}}});
        let mut bare_safe = bare.clone();
        bare_safe["spec"]["strategy"] = json!({"type": "RollingUpdate"});
        assert!(admits("strategy-only", OPERATOR, "UPDATE", bare_safe, Some(bare)));
    }

    /// The restart after a queue migration: the one template annotation, on any guarded kind.
    fn restarted(workload: &Value, stamp: &str) -> Value {
        let mut w = workload.clone();
        w["spec"]["template"]["metadata"]["annotations"]["queueguard.io/restartedAt"] = json!(stamp);
        w
    }

    #[test]
    fn the_operator_may_restart_a_workload_through_its_template_annotation_and_change_nothing_else_there() {
        let stateful = json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "worker", "namespace": "shop", "labels": {"app": "worker"}},
            "spec": {"replicas": 3, "serviceName": "worker", "selector": {"matchLabels": {"app": "worker"}},
                     "updateStrategy": {"type": "RollingUpdate"},
                     "template": {"metadata": {"labels": {"app": "worker"}, "annotations": {"team": "shop"}},
                                  "spec": {"containers": [{"name": "w", "image": "worker:1"}]}}},
        });
        let rollout = json!({
            "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": "worker", "namespace": "shop"},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "worker"}}, "strategy": {"canary": {}},
                     "template": {"metadata": {"labels": {"app": "worker"}}, "spec": {"containers": [{"name": "w"}]}}},
        });
        for (policy, old) in
            [("strategy-only", worker()), ("rollout-strategy", rollout), ("statefulset-restart-only", stateful)]
        {
            let first = restarted(&old, "2026-12-06T19:00:00Z");
            assert!(
                admits(policy, OPERATOR, "UPDATE", first.clone(), Some(old.clone())),
                "{policy}: the first restart"
            );
            let again = restarted(&first, "2026-12-07T08:00:00Z");
            assert!(admits(policy, OPERATOR, "UPDATE", again, Some(first.clone())), "{policy}: a later one");
            let mut other = first.clone();
            other["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] = json!("false");
            assert!(!admits(policy, OPERATOR, "UPDATE", other, Some(old.clone())), "{policy}: another annotation");
            let mut label = first.clone();
            label["spec"]["template"]["metadata"]["labels"]["app"] = json!("evil");
            assert!(!admits(policy, OPERATOR, "UPDATE", label, Some(old.clone())), "{policy}: a template label");
            let mut image = first.clone();
            image["spec"]["template"]["spec"]["containers"][0]["image"] = json!("evil:1");
            assert!(!admits(policy, OPERATOR, "UPDATE", image.clone(), Some(old.clone())), "{policy}: an image");
            let mut scaled = first.clone();
            scaled["spec"]["replicas"] = json!(0);
            assert!(!admits(policy, OPERATOR, "UPDATE", scaled, Some(old.clone())), "{policy}: replicas");
            assert!(admits(policy, "kubernetes-admin", "UPDATE", image, Some(old)), "{policy}: not the operator's");
        }
    }

    #[test]
    fn the_operator_may_change_a_rollouts_strategy_and_nothing_else() {
        let old = json!({
            "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": "worker", "namespace": "shop", "labels": {"app": "worker"}},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "worker"}},
                     "strategy": {"canary": {"maxSurge": "25%", "maxUnavailable": "100%"}},
                     "template": {"metadata": {"labels": {"app": "worker"}},
                                  "spec": {"containers": [{"name": "w", "image": "worker:1"}]}}},
        });
        let mut safe = old.clone();
        safe["spec"]["strategy"]["canary"]["maxUnavailable"] = json!(0);
        assert!(admits("rollout-strategy", OPERATOR, "UPDATE", safe.clone(), Some(old.clone())));
        let mut image = safe.clone();
        image["spec"]["template"]["spec"]["containers"][0]["image"] = json!("evil:1");
        assert!(!admits("rollout-strategy", OPERATOR, "UPDATE", image.clone(), Some(old.clone())));
        let mut restart = safe.clone();
        restart["spec"]["restartAt"] = json!("2026-12-06T00:00:00Z");
        assert!(!admits("rollout-strategy", OPERATOR, "UPDATE", restart, Some(old.clone())), "a restart");
        assert!(admits("rollout-strategy", "kubernetes-admin", "UPDATE", image, Some(old)));
    }

    #[test]
    fn the_operator_may_touch_only_the_budgets_it_labels() {
        let ours = json!({"metadata": {"name": "worker-queueguard", "labels": {
            "app.kubernetes.io/managed-by": "queueguard", "queueguard.io/deployment": "worker"}},
            "spec": {"minAvailable": 1}});
        let theirs = json!({"metadata": {"name": "team-pdb", "labels": {"team": "shop"}}, "spec": {"minAvailable": 1}});
        let bare = json!({"metadata": {"name": "bare"}, "spec": {}});
        assert!(admits("own-budgets-only", OPERATOR, "CREATE", ours.clone(), None));
        assert!(!admits("own-budgets-only", OPERATOR, "CREATE", theirs.clone(), None));
        assert!(admits("own-budgets-only", OPERATOR, "UPDATE", ours.clone(), Some(ours.clone())));
        assert!(!admits("own-budgets-only", OPERATOR, "UPDATE", ours.clone(), Some(theirs.clone())), "taking one over");
        assert!(!admits("own-budgets-only", OPERATOR, "UPDATE", theirs.clone(), Some(ours.clone())), "unlabelling one");
        assert!(admits("own-budgets-only", OPERATOR, "DELETE", Value::Null, Some(ours)));
        assert!(!admits("own-budgets-only", OPERATOR, "DELETE", Value::Null, Some(theirs.clone())));
        assert!(!admits("own-budgets-only", OPERATOR, "DELETE", Value::Null, Some(bare)));
        assert!(admits("own-budgets-only", "kubernetes-admin", "DELETE", Value::Null, Some(theirs)));
        let stateful = json!({"metadata": {"name": "shard-statefulset-queueguard", "labels": {
            "app.kubernetes.io/managed-by": "queueguard", "queueguard.io/statefulset": "shard"}},
            "spec": {"minAvailable": 1}});
        assert!(admits("own-budgets-only", OPERATOR, "CREATE", stateful, None), "a StatefulSet's budget");
    }

    fn pod(gate: Option<&str>) -> Value {
        let mut conditions = vec![json!({"type": "Ready", "status": "False"})];
        if let Some(status) = gate {
            conditions
                .push(json!({"type": "queueguard.io/consumer-attached", "status": status, "reason": "NoConsumer"}));
        }
        json!({"metadata": {"name": "worker-abc-1", "labels": {"app": "worker"}},
               "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}],
                          "startTime": "2026-12-06T00:00:00Z", "conditions": conditions}})
    }

    #[test]
    fn the_operator_may_write_only_its_own_pod_condition() {
        let mut open = pod(Some("True"));
        open["status"]["conditions"][1]["reason"] = json!("ConsumerAttached");
        assert!(admits("gate-condition-only", OPERATOR, "UPDATE", open.clone(), Some(pod(Some("False")))));
        assert!(admits("gate-condition-only", OPERATOR, "UPDATE", pod(Some("False")), Some(pod(None))), "first write");
        let mut moved = open.clone();
        moved["status"]["podIP"] = json!("10.9.9.9");
        assert!(!admits("gate-condition-only", OPERATOR, "UPDATE", moved, Some(pod(Some("False")))), "the pod's IP");
        let mut ready = open.clone();
        ready["status"]["conditions"][0]["status"] = json!("True");
        assert!(
            !admits("gate-condition-only", OPERATOR, "UPDATE", ready.clone(), Some(pod(Some("False")))),
            "Ready itself"
        );
        assert!(admits("gate-condition-only", "system:node:n1", "UPDATE", ready, Some(pod(Some("False")))));
    }

    #[test]
    fn it_can_be_turned_off() {
        let docs = render(None, &["--set", "admissionPolicy.enabled=false"]);
        assert!(of_kind(&docs, "ValidatingAdmissionPolicy").is_empty());
    }
}
