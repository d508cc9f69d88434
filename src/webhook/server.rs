//! Serves `POST /mutate-pods` over TLS. Every replica serves it, leader or not: the API server
//! picks any endpoint of the webhook Service. The certificate comes from a directory
//! (cert-manager's Secret, mounted) or from [`SelfSigned`], and is re-read hourly so a renewed
//! certificate is picked up without a restart.

use super::{
    certs::{SelfSigned, WebhookTls},
    enforcing, mutate, needs_deployment_labels, review_json,
};
use crate::{crd::QueuePolicy, gate::guards::deployment_of};
use axum::{Json, Router, extract::State, routing::post};
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use k8s_openapi::api::{apps::v1::Deployment, core::v1::Pod};
use kube::{
    Api, Client, ResourceExt,
    core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview},
    runtime::reflector::Store,
};
use rustls::{
    ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, RwLock},
    time::Duration,
};

/// Where the serving certificate comes from.
pub enum CertSource {
    /// `tls.crt` and `tls.key` in a directory (cert-manager's Secret mounted as a volume).
    Dir(PathBuf),
    /// Issued and kept by the operator.
    SelfSigned(SelfSigned),
}

const RELOAD_EVERY: Duration = Duration::from_secs(3600);
/// Reading a Deployment's labels must not hold pod creation up for long.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

impl CertSource {
    async fn load(&self, client: &Client) -> Result<(String, String), String> {
        match self {
            Self::Dir(dir) => {
                let read = |f: &str| {
                    std::fs::read_to_string(dir.join(f)).map_err(|e| format!("{}: {e}", dir.join(f).display()))
                };
                Ok((read("tls.crt")?, read("tls.key")?))
            }
            Self::SelfSigned(s) => {
                let WebhookTls { cert_pem, key_pem, .. } = s.ensure(client).await.map_err(|e| e.to_string())?;
                Ok((cert_pem, key_pem))
            }
        }
    }
}

pub fn certified_key(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| format!("private key: {e}"))?;
    CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider()).map_err(|e| e.to_string())
}

/// Hands out the current certificate; swapped in place on renewal.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

struct Admission {
    client: Client,
    policies: Store<QueuePolicy>,
}

pub fn router(client: Client, policies: Store<QueuePolicy>) -> Router {
    Router::new().route("/mutate-pods", post(admit)).with_state(Arc::new(Admission { client, policies }))
}

async fn admit(
    State(state): State<Arc<Admission>>,
    Json(review): Json<AdmissionReview<Pod>>,
) -> Json<serde_json::Value> {
    let request: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(e) => return Json(review_json(AdmissionResponse::invalid(e.to_string()))),
    };
    let guarding = guarding_policies(&state, &request).await;
    let response = mutate(&request, &guarding.iter().map(|p| &**p).collect::<Vec<_>>());
    if response.patch.is_some() {
        let policy = guarding.first().map(|p| p.name_any()).unwrap_or_default();
        tracing::info!(namespace = request.namespace.as_deref().unwrap_or(""), %policy, "added the readiness gate to a new pod");
    }
    Json(review_json(response))
}

async fn guarding_policies(state: &Admission, request: &AdmissionRequest<Pod>) -> Vec<Arc<QueuePolicy>> {
    let (Some(pod), Some(ns)) = (request.object.as_ref(), request.namespace.as_deref()) else { return vec![] };
    let Some(deployment) = deployment_of(pod) else { return vec![] };
    let policies = state.policies.state();
    let labels = if needs_deployment_labels(&policies, ns) {
        let api: Api<Deployment> = Api::namespaced(state.client.clone(), ns);
        match tokio::time::timeout(LOOKUP_TIMEOUT, api.get_opt(&deployment)).await {
            Ok(Ok(d)) => d.map(|d| d.labels().clone()),
            outcome => {
                tracing::warn!(%deployment, ?outcome, "could not read the Deployment; matching by name only");
                None
            }
        }
    } else {
        None
    };
    let names: Vec<String> =
        enforcing(&policies, ns, &deployment, labels.as_ref()).into_iter().map(|p| p.name_any()).collect();
    policies.into_iter().filter(|p| p.namespace().as_deref() == Some(ns) && names.contains(&p.name_any())).collect()
}

/// The webhook's address and certificate.
pub struct Webhook {
    pub addr: SocketAddr,
    pub certs: CertSource,
}

impl Webhook {
    /// Serves until the process ends. Fails only when the first certificate cannot be had or
    /// the address cannot be bound.
    pub async fn serve(self, client: Client, policies: Store<QueuePolicy>) -> Result<(), String> {
        serve(self.addr, self.certs, client, policies).await
    }
}

async fn serve(
    addr: SocketAddr,
    source: CertSource,
    client: Client,
    policies: Store<QueuePolicy>,
) -> Result<(), String> {
    let (cert, key) = source.load(&client).await?;
    let current = Arc::new(Current(RwLock::new(Arc::new(certified_key(&cert, &key)?))));
    let reload = current.clone();
    let reload_client = client.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(RELOAD_EVERY).await;
            match source.load(&reload_client).await.and_then(|(c, k)| certified_key(&c, &k)) {
                Ok(key) => *reload.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(key),
                Err(e) => {
                    tracing::warn!(error = %e, "could not reload the webhook certificate; keeping the current one")
                }
            }
        }
    });
    let config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(current);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("{addr}: {e}"))?;
    tracing::info!(%addr, "serving the admission webhook");
    let app = router(client, policies);
    loop {
        let Ok((tcp, _)) = listener.accept().await else { continue };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else { return };
            let service = TowerToHyperService::new(app);
            if let Err(e) =
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service).await
            {
                tracing::debug!(error = %e, "webhook connection ended");
            }
        });
    }
}
