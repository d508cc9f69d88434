//! The alerts and the dashboard against a real Prometheus (Debian's 2.42 with promtool, which
//! scripts/prometheus.sh installs): promtool checks the rules and runs their unit tests, then a
//! Prometheus server scrapes an operator reconciling real policies on the real broker (the
//! Kubernetes API mocked), fires an alert from what it scraped, and answers every dashboard query.

mod common;

use common::{api::ApiServer, *};
use http::StatusCode;
use k8s_openapi::{ByteString, api::core::v1::Secret};
use queueguard::{
    controller::{self, Context, FINALIZER},
    http::{Endpoints, Health},
};
use serde_json::{Value, json};
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::Arc,
    time::Duration,
};

const ALERTS: &str = "charts/queueguard/files/alerts.yaml";
const ALERT_TESTS: &str = "tests/prometheus/alerts_test.yaml";
const DASHBOARD: &str = "charts/queueguard/files/dashboard.json";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tool(name: &str) -> PathBuf {
    let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file());
    found.unwrap_or_else(|| panic!("{name} is not installed: scripts/prometheus.sh installs Debian's prometheus"))
}

fn yaml(path: &str) -> Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(root().join(path)).unwrap()).unwrap()
}

/// Every alert of the rule file, by name.
fn alert_names() -> BTreeSet<String> {
    yaml(ALERTS)["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .map(|r| r["alert"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn promtool_checks_the_rules_and_every_alert_has_a_firing_and_a_quiet_unit_test() {
    let promtool = tool("promtool");
    let check = Command::new(&promtool).args(["check", "rules", ALERTS]).current_dir(root()).output().unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "promtool check rules:\n{out}{}", String::from_utf8_lossy(&check.stderr));
    assert!(out.contains(&format!("SUCCESS: {} rules found", alert_names().len())), "{out}");

    let test = Command::new(&promtool).args(["test", "rules", ALERT_TESTS]).current_dir(root()).output().unwrap();
    assert!(
        test.status.success(),
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );

    // Each alert is tested both ways: at some time it fires, at another it does not.
    let (mut firing, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for group in yaml(ALERT_TESTS)["tests"].as_array().unwrap() {
        for case in group["alert_rule_test"].as_array().unwrap() {
            let name = case["alertname"].as_str().unwrap().to_owned();
            match case["exp_alerts"].as_array() {
                Some(alerts) if !alerts.is_empty() => firing.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    assert_eq!(firing, alert_names(), "alerts with a firing case");
    assert_eq!(quiet, alert_names(), "alerts with a quiet case");
}

/// A Prometheus server on loopback, stopped on drop.
struct Prometheus {
    child: Child,
    base: String,
    _dir: TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Prometheus {
    /// Scrapes `target` every second and evaluates `rules` every second.
    async fn start(target: &str, rules: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("prometheus"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("alerts.yaml"), rules).unwrap();
        std::fs::write(
            dir.join("prometheus.yml"),
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [alerts.yaml]\nscrape_configs:\n  - job_name: queueguard\n    honor_labels: true\n    static_configs: [{{targets: ['{target}']}}]\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = Command::new(tool("prometheus"))
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .stderr(std::fs::File::create(dir.join("prometheus.err")).unwrap())
            .spawn()
            .unwrap();
        let p = Prometheus { child, base: format!("http://127.0.0.1:{port}"), _dir: TempDir(dir.clone()) };
        let ready = eventually(Duration::from_secs(30), || async {
            reqwest::get(format!("{}/-/ready", p.base)).await.is_ok_and(|r| r.status().is_success())
        })
        .await;
        assert!(ready, "prometheus did not start: {}", std::fs::read_to_string(dir.join("prometheus.err")).unwrap());
        p
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let mut url = url::Url::parse(&format!("{}/api/v1/{path}", self.base)).unwrap();
        url.query_pairs_mut().extend_pairs(query);
        let r = reqwest::get(url).await.unwrap();
        serde_json::from_str(&r.text().await.unwrap()).unwrap()
    }

    async fn firing(&self, alert: &str) -> Vec<Value> {
        let answer = self.api("alerts", &[]).await;
        answer["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["labels"]["alertname"] == alert && a["state"] == "firing")
            .cloned()
            .collect()
    }
}

/// Answers the reconciles' Kubernetes requests as the API server would: the Secrets, status
/// patches (echoing the policy) and Events.
async fn api_server(
    mut api: ApiServer,
    secrets: BTreeMap<String, Vec<(&'static str, String)>>,
    policies: BTreeMap<String, Value>,
) {
    while let Some((request, reply)) = api.0.next_request().await {
        let path = request.uri().path().to_owned();
        let method = request.method().to_string();
        let respond = |status: StatusCode, body: &Value| {
            reply.send_response(
                http::Response::builder()
                    .status(status)
                    .body(kube::client::Body::from(serde_json::to_vec(body).unwrap()))
                    .unwrap(),
            )
        };
        let last = path.rsplit('/').next().unwrap_or_default().to_owned();
        let name = path.trim_end_matches("/status").rsplit('/').next().unwrap_or_default().to_owned();
        match (method.as_str(), path.as_str()) {
            ("GET", p) if p.starts_with("/api/v1/namespaces/test/secrets/") && secrets.contains_key(&last) => {
                let mut s = Secret::default();
                s.metadata.name = Some(last.clone());
                s.metadata.namespace = Some("test".into());
                s.data = Some(
                    secrets[&last].iter().map(|(k, v)| (k.to_string(), ByteString(v.clone().into_bytes()))).collect(),
                );
                respond(StatusCode::OK, &serde_json::to_value(s).unwrap());
            }
            ("PATCH", p) if p.ends_with("/status") && policies.contains_key(&name) => {
                respond(StatusCode::OK, &policies[&name]);
            }
            ("POST", "/apis/events.k8s.io/v1/namespaces/test/events") => {
                let body = request.into_body().collect_bytes().await.unwrap();
                respond(StatusCode::CREATED, &serde_json::from_slice(&body).unwrap());
            }
            _ => respond(StatusCode::NOT_FOUND, &json!({"kind": "Status", "code": 404, "reason": "NotFound"})),
        }
    }
}

/// The sample names in an exposition.
fn scraped_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

fn metric_names(expr: &str) -> BTreeSet<String> {
    regex::Regex::new(r"queueguard_[a-z_]+").unwrap().find_iter(expr).map(|m| m.as_str().to_owned()).collect()
}

/// Every query of the dashboard: the panels' targets and the template variables' metrics.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(root().join(DASHBOARD)).unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push((panel["title"].as_str().unwrap().to_owned(), target["expr"].as_str().unwrap().to_owned()));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = variable["definition"].as_str() {
            // label_values(METRIC{...}, label) is Grafana's: Prometheus answers its series query.
            let series = q.trim_start_matches("label_values(").rsplit_once(',').unwrap().0;
            queries.push((format!("variable {}", variable["name"]), series.to_owned()));
        }
    }
    queries
}

/// Grafana's variables, as "All" selects them.
fn as_grafana_sends(expr: &str) -> String {
    expr.replace("$namespace", ".*").replace("$policy", ".*").replace("$__rate_interval", "1m")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_operator_fires_an_alert_and_answers_every_dashboard_query() {
    queueguard::tls::install_crypto_provider();
    let (client, api) = common::api::mock_client();
    let ctx = Arc::new(Context::new(client, &unique("prometheus")));

    // Two policies: one on the real broker, one whose broker does not answer.
    let down = format!("amqp://guest:guest@127.0.0.1:{}/%2F", free_port());
    let orders = unique("prom-orders");
    let ready = policy(&orders, "{expires: 30m}");
    let mut offline = policy_doc(&unique("prom-offline"), "queue: {expires: 30m}");
    offline.spec.broker.secret_ref = Some(queueguard::crd::SecretRef { name: "offline".into() });
    let mut policies = BTreeMap::new();
    for p in [&ready, &offline] {
        let mut p = p.clone();
        p.metadata.finalizers = Some(vec![FINALIZER.into()]);
        p.metadata.uid = Some(format!("uid-{}", p.metadata.name.as_ref().unwrap()));
        policies.insert(p.metadata.name.clone().unwrap(), p);
    }
    let secrets = BTreeMap::from([
        ("rabbitmq".to_owned(), vec![("uri", broker_uri()), ("managementUri", management_base())]),
        ("offline".to_owned(), vec![("uri", down.clone())]),
    ]);
    let echoes = policies.iter().map(|(n, p)| (n.clone(), serde_json::to_value(p).unwrap())).collect();
    tokio::spawn(api_server(api, secrets, echoes));
    for p in policies.values() {
        let _ = tokio::time::timeout(Duration::from_secs(30), controller::reconcile(Arc::new(p.clone()), ctx.clone()))
            .await
            .expect("reconcile finished");
    }
    publish(&orders, (0..3).map(|i| format!("m{i}"))).await;

    // The operator's /metrics, as `run` serves it on a replica acting without leader election.
    let health = Arc::new(Health::new(false));
    health.set_leading(true);
    ctx.shared.metrics.leading(true);
    let endpoints = Arc::new(Endpoints {
        metrics: ctx.shared.metrics.clone(),
        health,
        brokers: ctx.shared.brokers.clone(),
        trackers: ctx.trackers.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap().to_string();
    tokio::spawn(queueguard::http::serve(listener, endpoints, Default::default()));
    let exposition = reqwest::get(format!("http://{target}/metrics")).await.unwrap().text().await.unwrap();
    // What the operator exports: every family it registers (one without series yet has no
    // line in the exposition), and every name it does expose.
    let mut exported: BTreeSet<String> = ctx.shared.metrics.sample_names().iter().cloned().collect();
    let scraped = scraped_names(&exposition);
    assert!(scraped.is_subset(&exported), "{:?} exposed but not declared", scraped.difference(&exported));
    exported.extend(scraped);

    // The shipped rules, their `for` waits cut to nothing so the test takes seconds: promtool's
    // unit tests above hold the waits; this shows the expressions match what is really scraped.
    let rules = std::fs::read_to_string(root().join(ALERTS)).unwrap();
    let rules = regex::Regex::new(r"(?m)^(\s+)for: \S+$").unwrap().replace_all(&rules, "${1}for: 0s");
    let prometheus = Prometheus::start(&target, &rules).await;

    let started = std::time::Instant::now();
    let fired = eventually(Duration::from_secs(60), || async {
        !prometheus.firing("QueueGuardBrokerConnectionDown").await.is_empty()
    })
    .await;
    assert!(fired, "QueueGuardBrokerConnectionDown never fired; /metrics:\n{exposition}");
    eprintln!("QueueGuardBrokerConnectionDown firing {:?} after Prometheus started", started.elapsed());
    let alerts = prometheus.firing("QueueGuardBrokerConnectionDown").await;
    let brokers: BTreeSet<&str> = alerts.iter().map(|a| a["labels"]["broker"].as_str().unwrap()).collect();
    let down_shown = down.replace("guest:guest@", "");
    assert_eq!(brokers, BTreeSet::from([down_shown.as_str()]), "only the broker that does not answer: {alerts:?}");
    assert!(!serde_json::to_string(&alerts).unwrap().contains("guest"), "no credentials in alerts: {alerts:?}");
    assert!(prometheus.firing("QueueGuardNoLeader").await.is_empty(), "the acting replica was scraped");

    // Every alert and every dashboard query names only metrics the operator exports.
    for (what, expr) in yaml(ALERTS)["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .map(|r| (r["alert"].as_str().unwrap().to_owned(), r["expr"].as_str().unwrap().to_owned()))
        .chain(dashboard_queries())
    {
        let unknown: Vec<String> = metric_names(&expr).difference(&exported).cloned().collect();
        assert!(unknown.is_empty(), "{what}: {unknown:?} are not exported (exported: {exported:?})");
        assert!(!metric_names(&expr).is_empty(), "{what} reads no queueguard metric: {expr}");
    }

    // Every dashboard query parses and answers; the ones about the scraped policies have data.
    for (panel, expr) in dashboard_queries() {
        let answer = prometheus.api("query", &[("query", &as_grafana_sends(&expr))]).await;
        assert_eq!(answer["status"], "success", "{panel}: {expr}\n{answer}");
    }
    let depth = eventually(Duration::from_secs(30), || async {
        let expr = dashboard_queries().into_iter().find(|(p, _)| p == "Messages ready").unwrap().1;
        let answer = prometheus.api("query", &[("query", &as_grafana_sends(&expr))]).await;
        answer["data"]["result"].as_array().is_some_and(|r| r.iter().any(|s| s["metric"]["queue"] == orders.as_str()))
    })
    .await;
    assert!(depth, "the Messages ready panel shows the reconciled policy's queue");
    let variable = prometheus.api("series", &[("match[]", "queueguard_reconcile_total")]).await;
    assert!(
        variable["data"].as_array().is_some_and(|s| s.iter().any(|m| m["policy"] == orders.as_str())),
        "the dashboard's policy variable finds the policies: {variable}"
    );
    remove_all(&plan_of(&ready)).await;
}
