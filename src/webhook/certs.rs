//! The webhook's TLS when cert-manager is not used: the operator keeps a CA and a serving
//! certificate in a Secret of its own namespace and writes the CA into the
//! MutatingWebhookConfiguration's `caBundle`. Every replica reads the same Secret; the first to
//! find it missing or near expiry issues a new certificate, and a concurrent writer loses on the
//! resourceVersion and reads the winner's.

use base64::Engine;
use k8s_openapi::{
    ByteString,
    api::{admissionregistration::v1::MutatingWebhookConfiguration, core::v1::Secret},
    jiff::{SignedDuration, Timestamp, tz::TimeZone},
};
use kube::{
    Api, Client,
    api::{ObjectMeta, Patch, PatchParams, PostParams},
};
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use serde_json::{Value, json};
use std::collections::BTreeMap;

const NOT_AFTER: &str = "queueguard.io/not-after";
const DNS_NAMES: &str = "queueguard.io/dns-names";
const CA_NAME: &str = "queueguard webhook CA";
/// A serving certificate lives a year and is replaced with 30 days to go.
const SERVING_DAYS: i64 = 365;
const RENEW_BEFORE_DAYS: i64 = 30;
const CA_DAYS: i64 = 3650;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookTls {
    pub ca_pem: String,
    ca_key_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: Timestamp,
    pub dns_names: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("issuing the webhook certificate: {0}")]
    Issue(#[from] rcgen::Error),
}

/// The names the API server uses to reach the webhook Service.
pub fn dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![format!("{service}.{namespace}.svc"), format!("{service}.{namespace}.svc.cluster.local")]
}

fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

fn date(t: Timestamp) -> time::OffsetDateTime {
    let d = t.to_zoned(TimeZone::UTC).date();
    rcgen::date_time_ymd(d.year().into(), d.month().unsigned_abs(), d.day().unsigned_abs())
}

/// A serving certificate for `dns_names`, signed by the CA in `existing` when there is one (so
/// the caBundle the API server trusts stays the same), else by a new CA.
pub fn issue(existing: Option<&WebhookTls>, dns_names: &[String], now: Timestamp) -> Result<WebhookTls, CertError> {
    let (ca_pem, ca_key) = match existing.and_then(|e| KeyPair::from_pem(&e.ca_key_pem).ok().map(|k| (e, k))) {
        Some((e, key)) => (e.ca_pem.clone(), key),
        None => {
            let key = KeyPair::generate()?;
            let mut params = ca_params()?;
            params.not_before = date(now - SignedDuration::from_hours(24));
            params.not_after = date(now + SignedDuration::from_hours(24 * CA_DAYS));
            (params.self_signed(&key)?.pem(), key)
        }
    };
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca_params()?, ca_key);
    let not_after = now + SignedDuration::from_hours(24 * SERVING_DAYS);
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, dns_names.first().cloned().unwrap_or_default());
    params.not_before = date(now - SignedDuration::from_hours(24));
    params.not_after = date(not_after);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(WebhookTls {
        ca_pem,
        ca_key_pem,
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after,
        dns_names: dns_names.to_vec(),
    })
}

/// Whether the certificate serves these names for long enough yet.
pub fn usable(tls: &WebhookTls, dns_names: &[String], now: Timestamp) -> bool {
    tls.dns_names == dns_names && tls.not_after - SignedDuration::from_hours(24 * RENEW_BEFORE_DAYS) > now
}

pub fn from_secret(secret: &Secret) -> Option<WebhookTls> {
    let data = secret.data.as_ref()?;
    let text = |k: &str| data.get(k).and_then(|b| String::from_utf8(b.0.clone()).ok());
    let annotations = secret.metadata.annotations.as_ref()?;
    Some(WebhookTls {
        ca_pem: text("ca.crt")?,
        ca_key_pem: text("ca.key")?,
        cert_pem: text("tls.crt")?,
        key_pem: text("tls.key")?,
        not_after: annotations.get(NOT_AFTER)?.parse().ok()?,
        dns_names: annotations.get(DNS_NAMES)?.split(',').map(str::to_owned).collect(),
    })
}

pub fn to_secret(name: &str, tls: &WebhookTls) -> Secret {
    let bytes = |s: &String| ByteString(s.clone().into_bytes());
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            annotations: Some(BTreeMap::from([
                (NOT_AFTER.to_owned(), tls.not_after.to_string()),
                (DNS_NAMES.to_owned(), tls.dns_names.join(",")),
            ])),
            labels: Some(BTreeMap::from([("app.kubernetes.io/managed-by".to_owned(), "queueguard".to_owned())])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            ("ca.crt".to_owned(), bytes(&tls.ca_pem)),
            ("ca.key".to_owned(), bytes(&tls.ca_key_pem)),
            ("tls.crt".to_owned(), bytes(&tls.cert_pem)),
            ("tls.key".to_owned(), bytes(&tls.key_pem)),
        ])),
        ..Default::default()
    }
}

/// The strategic merge patch that puts `ca_pem` into every webhook of the configuration, or
/// None when each already carries it.
pub fn ca_bundle_patch(config: &MutatingWebhookConfiguration, ca_pem: &str) -> Option<Value> {
    let bundle = ByteString(ca_pem.as_bytes().to_vec());
    let webhooks = config.webhooks.as_deref().unwrap_or_default();
    let stale: Vec<Value> = webhooks
        .iter()
        .filter(|w| w.client_config.ca_bundle.as_ref() != Some(&bundle))
        .map(|w| {
            let encoded = base64::engine::general_purpose::STANDARD.encode(ca_pem);
            json!({ "name": w.name, "clientConfig": { "caBundle": encoded } })
        })
        .collect();
    (!stale.is_empty()).then(|| json!({ "webhooks": stale }))
}

/// Where the operator keeps its webhook certificate.
pub struct SelfSigned {
    pub namespace: String,
    pub secret: String,
    pub service: String,
    pub webhook_config: String,
}

impl SelfSigned {
    /// Reads the certificate from the Secret, issuing (or renewing) it when needed, and makes
    /// sure the webhook configuration trusts its CA.
    pub async fn ensure(&self, client: &Client) -> Result<WebhookTls, CertError> {
        let tls = self.ensure_secret(client).await?;
        let configs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        match configs.get_opt(&self.webhook_config).await? {
            Some(config) => {
                if let Some(patch) = ca_bundle_patch(&config, &tls.ca_pem) {
                    configs.patch(&self.webhook_config, &PatchParams::default(), &Patch::Strategic(patch)).await?;
                    tracing::info!(config = %self.webhook_config, "wrote the webhook CA into caBundle");
                }
            }
            None => tracing::warn!(config = %self.webhook_config, "MutatingWebhookConfiguration not found"),
        }
        Ok(tls)
    }

    async fn ensure_secret(&self, client: &Client) -> Result<WebhookTls, CertError> {
        let api: Api<Secret> = Api::namespaced(client.clone(), &self.namespace);
        let names = dns_names(&self.service, &self.namespace);
        loop {
            let found = api.get_opt(&self.secret).await?;
            let current = found.as_ref().and_then(from_secret);
            if let Some(tls) = current.as_ref().filter(|t| usable(t, &names, Timestamp::now())) {
                return Ok(tls.clone());
            }
            let tls = issue(current.as_ref(), &names, Timestamp::now())?;
            let mut secret = to_secret(&self.secret, &tls);
            let written = match found {
                None => api.create(&PostParams::default(), &secret).await,
                Some(old) => {
                    secret.metadata.resource_version = old.metadata.resource_version;
                    api.replace(&self.secret, &PostParams::default(), &secret).await
                }
            };
            match written {
                Ok(_) => {
                    tracing::info!(secret = %self.secret, not_after = %tls.not_after, "issued the webhook certificate");
                    return Ok(tls);
                }
                // Another replica wrote first: use its certificate.
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::admissionregistration::v1::{MutatingWebhook, WebhookClientConfig};

    #[test]
    fn a_renewal_keeps_the_ca_so_the_ca_bundle_stays_valid() {
        let names = dns_names("qg-webhook", "ops");
        let now = Timestamp::now();
        let first = issue(None, &names, now).unwrap();
        assert!(usable(&first, &names, now));
        let near_expiry = first.not_after - SignedDuration::from_hours(24 * 10);
        assert!(!usable(&first, &names, near_expiry), "renewed 30 days before expiry");
        assert!(!usable(&first, &dns_names("other", "ops"), now), "a renamed Service needs a new certificate");
        let second = issue(Some(&first), &names, near_expiry).unwrap();
        assert_eq!(second.ca_pem, first.ca_pem);
        assert_ne!(second.cert_pem, first.cert_pem);
    }

    #[test]
    fn the_secret_round_trips() {
        let names = dns_names("qg-webhook", "ops");
        let tls = issue(None, &names, Timestamp::now()).unwrap();
        let secret = to_secret("qg-webhook-tls", &tls);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        let back = from_secret(&secret).unwrap();
        assert_eq!(back.not_after.as_second(), tls.not_after.as_second());
        assert_eq!(WebhookTls { not_after: tls.not_after, ..back }, tls);
        assert_eq!(from_secret(&Secret::default()), None);
    }

    #[test]
    fn ca_bundle_is_patched_only_where_it_differs() {
        let webhook = |name: &str, bundle: Option<&str>| MutatingWebhook {
            name: name.into(),
            client_config: WebhookClientConfig {
                ca_bundle: bundle.map(|b| ByteString(b.as_bytes().to_vec())),
                ..Default::default()
            },
            ..Default::default()
        };
        let config = MutatingWebhookConfiguration {
            webhooks: Some(vec![webhook("a.queueguard.io", Some("CA")), webhook("b.queueguard.io", None)]),
            ..Default::default()
        };
        let patch = ca_bundle_patch(&config, "CA").unwrap();
        assert_eq!(patch, json!({"webhooks": [{"name": "b.queueguard.io", "clientConfig": {"caBundle": "Q0E="}}]}));
        let done = MutatingWebhookConfiguration {
            webhooks: Some(vec![webhook("a.queueguard.io", Some("CA"))]),
            ..Default::default()
        };
        assert_eq!(ca_bundle_patch(&done, "CA"), None);
    }
}
