//! Local mode (`queueguard apply -f FILE`): reconcile the broker side of QueuePolicies read from
//! manifests, with no cluster, and print each resulting status.

use crate::{
    broker::{Broker, BrokerCredentials, BrokerPool},
    broker_source::BrokerSource,
    claims::{self, Claims},
    converge::{self, Mode},
    crd::{MigrationPhase, MigrationStatus, OnChange, QueuePolicy, QueuePolicyStatus},
    migrate::{
        Bounds,
        run::{Journal, PolicyMigration, completed, midway, migrate_policy, settle_recorded},
    },
    pass,
    pattern::crd::QueuePattern,
    plan::{self, Limits, QueuePlan},
    secret,
    status::{Check, Outcome, Reason, next_status},
};
use k8s_openapi::{api::core::v1::Secret, jiff::Timestamp};
use serde::Deserialize;
use std::{fmt, io::Read};

/// A manifest that cannot be read; names the document (1-based) and, where known, the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    pub source: String,
    pub document: usize,
    pub message: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: document {}: {}", self.source, self.document, self.message)
    }
}

/// The objects of a manifest that local mode uses.
#[derive(Debug, Default)]
pub struct Manifest {
    pub policies: Vec<QueuePolicy>,
    pub secrets: Vec<Secret>,
}

/// Reads multi-document YAML. QueuePolicies are read strictly (an unknown field is an error, as
/// kubectl's strict field validation makes it); Secrets feed credentials; other kinds are skipped.
pub fn read_manifest(source: &str, text: &str) -> Result<Manifest, InputError> {
    let mut manifest = Manifest::default();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let err = |message: String| InputError { source: source.to_owned(), document, message };
        let value = serde_yaml_ng::Value::deserialize(doc).map_err(|e| err(e.to_string()))?;
        if value.is_null() {
            continue;
        }
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_owned();
        match kind.as_str() {
            "QueuePolicy" => {
                let api_version = value.get("apiVersion").and_then(|v| v.as_str()).unwrap_or_default();
                if api_version != crate::crd::API_VERSION {
                    return Err(err(format!(
                        "apiVersion: expected {}, found {api_version:?}",
                        crate::crd::API_VERSION
                    )));
                }
                manifest.policies.push(strict(value).map_err(err)?);
            }
            "Secret" => manifest.secrets.push(strict(value).map_err(err)?),
            "" => return Err(err("kind: missing".into())),
            _ => {}
        }
    }
    Ok(manifest)
}

/// Deserialises, naming the field path of a type error and rejecting unknown fields.
fn strict<T: serde::de::DeserializeOwned>(value: serde_yaml_ng::Value) -> Result<T, String> {
    let mut unknown = Vec::new();
    let mut record = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
    let de = serde_ignored::Deserializer::new(value, &mut record);
    let typed: T = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." { inner } else { format!("{path}: {inner}") }
    })?;
    // Type metadata is read by kube's own (de)serialisers, which serde_ignored cannot see into.
    unknown.retain(|p| p != "apiVersion" && p != "kind");
    match unknown.first() {
        Some(path) => Err(format!("{path}: unknown field")),
        None => Ok(typed),
    }
}

/// Reads a file, or stdin for `-`.
pub fn read_source(path: &str) -> Result<String, InputError> {
    let err = |e: std::io::Error| InputError { source: path.to_owned(), document: 0, message: e.to_string() };
    if path == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map_err(err)?;
        Ok(text)
    } else {
        std::fs::read_to_string(path).map_err(err)
    }
}

/// One policy's local result.
pub struct Applied {
    pub namespace: String,
    pub name: String,
    pub status: QueuePolicyStatus,
    pub ready: bool,
}

/// Reconciles every policy of the manifest against the broker. `broker` (the --broker flag)
/// overrides the Secrets of the manifest.
pub async fn apply(
    manifest: &Manifest,
    broker: Option<&BrokerCredentials>,
    pool: &BrokerPool,
    limits: Limits,
) -> Vec<Applied> {
    let mut results = Vec::new();
    for policy in &manifest.policies {
        let namespace = policy.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let name = policy.metadata.name.clone().unwrap_or_default();
        let outcome = match plan::plan(policy, limits) {
            Err(errors) => Outcome::blocked(Check::failed(Reason::InvalidSpec, plan::describe(&errors))),
            Ok(plan) => {
                let creds = match broker {
                    Some(c) => Ok(c.clone()),
                    None => credentials_in(manifest, &namespace, &plan.broker),
                };
                match creds.and_then(|c| pass::broker_for_plan(pool, &plan, &c)) {
                    Err(check) => Outcome::blocked(check),
                    Ok(broker) => {
                        let migration = match plan.on_change {
                            OnChange::Migrate => {
                                let no_patterns: [QueuePattern; 0] = [];
                                let claims = claims::others(policy, &plan, &manifest.policies, &no_patterns, limits);
                                migrated(&plan, &broker, policy.status.as_ref(), &claims).await
                            }
                            OnChange::Refuse => settled(&plan, &broker, policy.status.as_ref()).await,
                        };
                        match migration {
                            Err((check, state)) => {
                                let mut outcome = Outcome::blocked(check);
                                outcome.migration = Some(state);
                                outcome
                            }
                            Ok(migration) => {
                                let previous =
                                    policy.status.as_ref().map(|s| s.applied_bindings.clone()).unwrap_or_default();
                                let mut outcome = converge::converge(&plan, &broker, &previous, Mode::Declare).await;
                                outcome.migration = migration;
                                outcome
                            }
                        }
                    }
                }
            }
        };
        let ready = outcome.is_ready();
        let status = next_status(policy.status.as_ref(), &outcome, policy.metadata.generation, Timestamp::now());
        results.push(Applied { namespace, name, status, ready });
    }
    results
}

/// `onChange: Migrate` in local mode: the same migration as the operator's, each step told on
/// stderr; nobody restarts the consumers, so the completed state says they must be.
async fn migrated(
    plan: &QueuePlan,
    broker: &Broker,
    status: Option<&QueuePolicyStatus>,
    claims: &Claims,
) -> Result<Option<MigrationStatus>, (Check, MigrationStatus)> {
    let previous = status.and_then(|s| s.migration.as_ref());
    match migrate_policy(broker, plan, previous, &mut Told, &Bounds::default(), claims).await {
        Ok(PolicyMigration::NotNeeded) => Ok(None),
        Ok(PolicyMigration::Moved(state)) => Ok(Some(completed(state, None))),
        Ok(PolicyMigration::Stopped(check, state)) => Err((check, state)),
        Err(e) => Err((Check::failed(Reason::MigrationFailed, e.to_string()), previous.cloned().unwrap_or_default())),
    }
}

/// onChange no longer says Migrate while the input's status records a migration midway: it is
/// settled ([`settle_recorded`]); nobody restarts the consumers a swap cancelled.
async fn settled(
    plan: &QueuePlan,
    broker: &Broker,
    status: Option<&QueuePolicyStatus>,
) -> Result<Option<MigrationStatus>, (Check, MigrationStatus)> {
    let Some(m) = status.and_then(|s| s.migration.as_ref()).filter(|m| midway(m)) else { return Ok(None) };
    match settle_recorded(broker, plan, m, "onChange no longer says Migrate").await {
        Ok(state) if state.phase == MigrationPhase::RestartingConsumers => Ok(Some(completed(state, None))),
        Ok(state) => Ok(Some(state)),
        Err(e) => Err((Check::failed(Reason::MigrationFailed, e.to_string()), m.clone())),
    }
}

/// Tells each step on stderr before it is taken.
pub struct Told;

impl Journal for Told {
    async fn record(&mut self, state: &MigrationStatus) -> Result<(), String> {
        eprintln!("queue '{}': {}: {}", state.queue, state.phase.as_str(), state.message);
        Ok(())
    }
}

fn credentials_in(manifest: &Manifest, namespace: &str, source: &BrokerSource) -> Result<BrokerCredentials, Check> {
    let secret_name = match source {
        BrokerSource::Secret { name } => name,
        BrokerSource::RabbitmqCluster { .. } => {
            return Err(Check::failed(
                Reason::RabbitmqClusterNotFound,
                format!(
                    "{source} is read from a cluster, not from the input; pass --broker URI (or QUEUEGUARD_BROKER_URI)"
                ),
            ));
        }
    };
    let found = manifest.secrets.iter().find(|s| {
        s.metadata.name.as_deref() == Some(secret_name.as_str())
            && s.metadata.namespace.as_deref().unwrap_or("default") == namespace
    });
    match found {
        Some(s) => secret::credentials(s),
        None => Err(Check::failed(
            Reason::SecretNotFound,
            format!(
                "Secret '{namespace}/{secret_name}' is not in the input; pass --broker URI (or QUEUEGUARD_BROKER_URI) or include the Secret"
            ),
        )),
    }
}

/// The YAML printed for one result: a comment naming the policy, then its status.
pub fn render(applied: &Applied) -> String {
    let body = serde_yaml_ng::to_string(&applied.status).expect("status serialises");
    format!("---\n# QueuePolicy {}/{}\n{body}", applied.namespace, applied.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: orders, namespace: shop}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {expires: 1h}\n";

    #[test]
    fn reads_policies_and_secrets_and_skips_other_kinds() {
        let text = format!(
            "{POLICY}---\napiVersion: v1\nkind: Secret\nmetadata: {{name: rabbitmq, namespace: shop}}\nstringData: {{uri: 'amqp://u:p@h/'}}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: x}}\n---\n"
        );
        let m = read_manifest("f.yaml", &text).unwrap();
        assert_eq!(m.policies.len(), 1);
        assert_eq!(m.secrets.len(), 1);
        let secret = BrokerSource::Secret { name: "rabbitmq".into() };
        assert_eq!(credentials_in(&m, "shop", &secret).unwrap().uri, "amqp://u:p@h/");
        assert_eq!(credentials_in(&m, "other", &secret).unwrap_err().reason, Reason::SecretNotFound);
        let cluster = BrokerSource::RabbitmqCluster { name: "rabbit".into(), namespace: None };
        let err = credentials_in(&m, "shop", &cluster).unwrap_err();
        assert!(err.message.contains("pass --broker"), "{}", err.message);
    }

    #[test]
    fn type_errors_name_document_and_field() {
        let text = format!("{POLICY}---\n{}", POLICY.replace("{expires: 1h}", "{expires: 1h, maxLength: lots}"));
        let err = read_manifest("f.yaml", &text).unwrap_err();
        assert_eq!(err.document, 2);
        assert!(err.message.starts_with("spec.queue.maxLength: invalid type"), "{err}");
        assert!(err.to_string().starts_with("f.yaml: document 2: "), "{err}");
    }

    #[test]
    fn unknown_fields_are_errors_like_kubectl_strict_validation() {
        let err = read_manifest("f.yaml", &POLICY.replace("expires: 1h", "expire: 1h")).unwrap_err();
        assert_eq!(err.message, "spec.queue.expire: unknown field");
    }

    #[test]
    fn broken_yaml_and_missing_kind_are_errors() {
        let err = read_manifest("f.yaml", "kind: [unclosed").unwrap_err();
        assert_eq!(err.document, 1);
        assert!(err.message.contains("line 1"), "{err}");
        assert_eq!(read_manifest("f.yaml", "metadata: {}").unwrap_err().message, "kind: missing");
        let wrong = POLICY.replace("v1alpha1", "v9");
        assert!(read_manifest("f.yaml", &wrong).unwrap_err().message.starts_with("apiVersion"));
    }
}
