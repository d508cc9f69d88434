//! The Helm chart, rendered and linted by the real helm binary (scripts/helm.sh fetches it;
//! QUEUEGUARD_HELM names it). Each manifest must parse into its k8s-openapi type without losing
//! a field, the RBAC must grant exactly what src/rbac.rs lists, the operator's arguments must
//! parse with the real command line, and values.schema.json must refuse bad values.

use clap::Parser;
use k8s_openapi::{
    api::{
        admissionregistration::v1::MutatingWebhookConfiguration,
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

const VALUE_FILES: [Option<&str>; 4] = [
    None,
    Some("charts/queueguard/ci/all-enabled-values.yaml"),
    Some("charts/queueguard/ci/cert-manager-values.yaml"),
    Some("charts/queueguard/ci/namespace-scope-values.yaml"),
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
            &[Feature::LeaderElection, Feature::WebhookSelfSigned, Feature::UninstallHook],
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
