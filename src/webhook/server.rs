//! Serves `POST /mutate-pods` over TLS. Every replica serves it, leader or not: the API server
//! picks any endpoint of the webhook Service. The certificate comes from a directory
//! (cert-manager's Secret, mounted) or from [`SelfSigned`], and is read again every few seconds
//! (a directory) or hourly (self-signed) so a renewed certificate is served without a restart.

use super::{
    certs::{SelfSigned, WebhookTls},
    enforcing_in, guarding, mutate, needs_workload_labels, review_json,
};
use crate::{
    crd::QueuePolicy,
    workload::{
        Kind, WorkloadKey,
        owner::{PodOwner, pod_owner, replica_set_owner},
        rollout::Rollout,
    },
};
use axum::response::IntoResponse;
use axum::{Json, Router, extract::State, routing::post};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use k8s_openapi::api::{
    apps::v1::{Deployment, ReplicaSet, StatefulSet},
    core::v1::Pod,
};
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
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, RwLock},
    time::Duration,
};
use tower::ServiceExt;

/// Where the serving certificate comes from.
pub enum CertSource {
    /// `tls.crt` and `tls.key` in a directory (cert-manager's Secret mounted as a volume).
    Dir(PathBuf),
    /// Issued and kept by the operator.
    SelfSigned(SelfSigned),
}

/// Why the webhook cannot serve, or cannot renew its certificate.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("{path}: {source}")]
    ReadCertificate { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    SelfSigned(#[from] super::certs::CertError),
    #[error("the {what} is not usable PEM: {detail}")]
    InvalidPem { what: &'static str, detail: String },
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// How often a certificate directory is read for a renewal. cert-manager's default self-signed
/// issuer renews with a new CA (`rotationPolicy: Always`), and cainjector moves `caBundle` to it
/// at once: until this replica serves the new certificate, the API server refuses the
/// handshake. The kubelet itself refreshes a mounted Secret within about a minute.
pub const DIR_CHECK_EVERY: Duration = Duration::from_secs(5);
/// The self-signed certificate is the operator's own, renewed by it well before it expires.
const SELF_SIGNED_CHECK_EVERY: Duration = Duration::from_secs(3600);
/// Reading a pod's ReplicaSet, or its workload's labels, must not hold pod creation up for long.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

impl CertSource {
    async fn load(&self, client: &Client) -> Result<(String, String), WebhookError> {
        match self {
            Self::Dir(dir) => {
                let read = |f: &str| {
                    let path = dir.join(f);
                    std::fs::read_to_string(&path).map_err(|source| WebhookError::ReadCertificate { path, source })
                };
                Ok((read("tls.crt")?, read("tls.key")?))
            }
            Self::SelfSigned(s) => {
                let WebhookTls { cert_pem, key_pem, .. } = s.ensure(client).await?;
                Ok((cert_pem, key_pem))
            }
        }
    }
}

pub fn certified_key(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey, WebhookError> {
    let invalid =
        |what| move |e: rustls::pki_types::pem::Error| WebhookError::InvalidPem { what, detail: e.to_string() };
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(invalid("certificate"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(invalid("private key"))?;
    Ok(CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider())?)
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
    /// The namespaces the operator acts in (`--namespaces`); None: all it watches.
    acting_in: Option<Arc<BTreeSet<String>>>,
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
    // Where the operator does not act, nobody would ever write the gate's condition.
    if state.acting_in.as_ref().is_some_and(|only| !only.contains(ns)) {
        return vec![];
    }
    let Some(owner) = pod_owner(&pod.metadata) else { return vec![] };
    // The replica is out of the webhook Service until its list is in; a request that still
    // comes first waits for it rather than be told "no policy".
    if tokio::time::timeout(LOOKUP_TIMEOUT, state.policies.wait_until_ready()).await.is_err() {
        tracing::warn!(namespace = %ns, "the webhook's QueuePolicy list has not synced: no readiness gate added (reported as GateNotInstalled)");
        return vec![];
    }
    let policies = state.policies.state();
    let enforcing = enforcing_in(&policies, ns);
    // Only a namespace with an enforcing policy costs a lookup.
    if enforcing.is_empty() {
        return vec![];
    }
    let Some(workload) = workload_of(&state.client, ns, &owner).await else { return vec![] };
    let labels = if needs_workload_labels(&enforcing) { labels_of(&state.client, &workload).await } else { None };
    let names: Vec<String> =
        guarding(&enforcing, &workload, labels.as_ref()).into_iter().map(|p| p.name_any()).collect();
    policies.into_iter().filter(|p| p.namespace().as_deref() == Some(ns) && names.contains(&p.name_any())).collect()
}

/// The workload a new pod belongs to: its StatefulSet, or its ReplicaSet's controller.
async fn workload_of(client: &Client, ns: &str, owner: &PodOwner) -> Option<WorkloadKey> {
    match owner {
        PodOwner::StatefulSet(name) => Some(WorkloadKey::new(Kind::StatefulSet, ns, name.clone())),
        PodOwner::ReplicaSet(name) => {
            let api: Api<ReplicaSet> = Api::namespaced(client.clone(), ns);
            match tokio::time::timeout(LOOKUP_TIMEOUT, api.get_metadata_opt(name)).await {
                Ok(Ok(rs)) => rs.and_then(|rs| replica_set_owner(&rs.metadata)),
                outcome => {
                    tracing::warn!(replica_set = %name, ?outcome, "could not read the pod's ReplicaSet; no readiness gate added");
                    None
                }
            }
        }
    }
}

/// A workload's labels, for policies that select by label; None (name matches only) when it
/// cannot be read in time.
async fn labels_of(client: &Client, w: &WorkloadKey) -> Option<std::collections::BTreeMap<String, String>> {
    let (ns, name) = (w.namespace.as_str(), w.name.as_str());
    let read = async {
        match w.kind {
            Kind::Deployment => metadata_labels(Api::<Deployment>::namespaced(client.clone(), ns), name).await,
            Kind::StatefulSet => metadata_labels(Api::<StatefulSet>::namespaced(client.clone(), ns), name).await,
            Kind::Rollout => metadata_labels(Api::<Rollout>::namespaced(client.clone(), ns), name).await,
        }
    };
    match tokio::time::timeout(LOOKUP_TIMEOUT, read).await {
        Ok(Ok(found)) => found,
        outcome => {
            tracing::warn!(workload = %w, ?outcome, "could not read the workload's labels; matching by name only");
            None
        }
    }
}

/// One object's labels, through a metadata-only read; None when it does not exist.
async fn metadata_labels<K>(
    api: Api<K>,
    name: &str,
) -> Result<Option<std::collections::BTreeMap<String, String>>, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api.get_metadata_opt(name).await?.map(|m| m.metadata.labels.unwrap_or_default()))
}

/// The webhook's address and certificate.
pub struct Webhook {
    pub addr: SocketAddr,
    pub certs: CertSource,
    pub timeouts: Timeouts,
}

/// How long one client may take. The API server gives up on a webhook call after its
/// `timeoutSeconds` (10 s at most in the chart), so nothing it sends legitimately takes longer;
/// a client that stalls must not hold a connection and a task for ever.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From accepting the TCP connection to the end of the TLS handshake.
    pub handshake: Duration,
    /// From the first byte of a request to its answer (headers, body and the decision).
    pub request: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self { handshake: Duration::from_secs(10), request: Duration::from_secs(10) }
    }
}

impl Webhook {
    /// Serves until the process ends. Fails only when the first certificate cannot be had or
    /// the address cannot be bound.
    pub async fn serve(
        self,
        client: Client,
        policies: Store<QueuePolicy>,
        acting_in: Option<Arc<BTreeSet<String>>>,
    ) -> Result<(), WebhookError> {
        let admission = Arc::new(Admission { client: client.clone(), policies, acting_in });
        serve(self.addr, self.certs, self.timeouts, client, admission).await
    }
}

async fn serve(
    addr: SocketAddr,
    source: CertSource,
    timeouts: Timeouts,
    client: Client,
    admission: Arc<Admission>,
) -> Result<(), WebhookError> {
    let serving = source.load(&client).await?;
    let current = Arc::new(Current(RwLock::new(Arc::new(certified_key(&serving.0, &serving.1)?))));
    tokio::spawn(reload_on_change(source, serving, current.clone(), client.clone()));
    let config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(current);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| WebhookError::Bind { addr, source })?;
    tracing::info!(%addr, "serving the admission webhook");
    let app = Router::new().route("/mutate-pods", post(admit)).with_state(admission);
    match crate::http::accept_loop(
        || async { listener.accept().await.map(|(tcp, _)| tcp) },
        |tcp| {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(timeouts.handshake, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => return tracing::debug!(error = %e, "webhook TLS handshake failed"),
                    Err(_) => return tracing::debug!("webhook TLS handshake timed out"),
                };
                let service = TowerToHyperService::new(within(timeouts.request, app));
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(TokioTimer::new()).header_read_timeout(timeouts.request);
                if let Err(e) = http.serve_connection(TokioIo::new(tls), service).await {
                    tracing::debug!(error = %e, "webhook connection ended");
                }
            });
        },
    )
    .await {}
}

/// Reads the certificate again and again, and serves a changed one from the next handshake on.
async fn reload_on_change(source: CertSource, mut serving: (String, String), current: Arc<Current>, client: Client) {
    let every = match &source {
        CertSource::Dir(_) => DIR_CHECK_EVERY,
        CertSource::SelfSigned(_) => SELF_SIGNED_CHECK_EVERY,
    };
    let mut failing: Option<String> = None;
    loop {
        tokio::time::sleep(every).await;
        let read = source.load(&client).await;
        let changed = match read {
            Ok(pems) if pems == serving => Ok(None),
            Ok(pems) => certified_key(&pems.0, &pems.1).map(|key| Some((pems, key))),
            Err(e) => Err(e),
        };
        match changed {
            Ok(None) => failing = None,
            Ok(Some((pems, key))) => {
                *current.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(key);
                serving = pems;
                failing = None;
                tracing::info!("webhook certificate renewed: serving the new one");
            }
            // Mid-rotation the pair can be read half old, half new: the next read settles it.
            // Said once per distinct failure, not every few seconds.
            Err(e) => {
                let text = e.to_string();
                if failing.as_ref() != Some(&text) {
                    tracing::warn!(error = %text, "could not reload the webhook certificate; keeping the current one");
                    failing = Some(text);
                }
            }
        }
    }
}

/// `app`, answering 408 to a request whose body and answer take longer than `limit` (hyper's
/// header read timeout covers the headers).
fn within(
    limit: Duration,
    app: Router,
) -> impl tower::Service<
    axum::http::Request<hyper::body::Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    tower::service_fn(move |request: axum::http::Request<hyper::body::Incoming>| {
        let app = app.clone();
        async move {
            match tokio::time::timeout(limit, app.oneshot(request)).await {
                Ok(answer) => answer,
                Err(_) => {
                    tracing::warn!(?limit, "webhook request timed out");
                    Ok((axum::http::StatusCode::REQUEST_TIMEOUT, "request timed out").into_response())
                }
            }
        }
    })
}
