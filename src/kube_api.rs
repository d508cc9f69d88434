//! The Kubernetes client every command uses: kube's own stack, with each request bounded.
//!
//! kube-client leaves `read_timeout` unset (a socket-level timeout would also cut watches that
//! sit idle between events). A request stuck on a dead keep-alive connection (an API server
//! failover without a reset) would then never end, and whoever awaits it (the one pod-condition
//! writer, a Secret read under its cache lock) with it. [`Bounded`] gives every request but a
//! watch a deadline for its answer, head and body; kube-runtime's watcher bounds watches itself
//! (an idle timeout just over the server's own `timeoutSeconds`). HTTP/1 only (kube's
//! connector), so dropping a late request drops its connection, and the next one gets a fresh
//! connection.

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};
use tokio::time::{Instant, Sleep};
use tower::{BoxError, Layer, Service};

/// How long any request other than a watch may take, answer and body. Kubernetes' own clients
/// wait 60 s by default for mutations; the operator's requests are small (one pod's status, one
/// Secret, a page of 500 objects), and a writer that waits a minute on one pod would let the
/// Deployment controller move on without it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// The client of the kubeconfig or the in-cluster service account, every request bounded by
/// [`REQUEST_TIMEOUT`].
pub async fn client() -> Result<kube::Client, kube::Error> {
    let config = kube::Config::infer().await.map_err(kube::Error::InferConfig)?;
    Ok(kube::client::ClientBuilder::try_from(config)?.with_layer(&Bounded::new(REQUEST_TIMEOUT)).build())
}

/// A request the API server did not answer in time.
#[derive(Debug, thiserror::Error)]
#[error("the Kubernetes API server did not answer within {0:?}")]
pub struct Unanswered(pub Duration);

/// A [`Layer`] that bounds every request but a watch.
#[derive(Debug, Clone, Copy)]
pub struct Bounded {
    timeout: Duration,
}

impl Bounded {
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }
}

impl<S> Layer<S> for Bounded {
    type Service = BoundedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BoundedService { inner, timeout: self.timeout }
    }
}

#[derive(Debug, Clone)]
pub struct BoundedService<S> {
    inner: S,
    timeout: Duration,
}

/// A watch streams for minutes by design; everything else is one answer.
fn is_watch<B>(req: &Request<B>) -> bool {
    req.uri().query().is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

impl<S, ReqBody, B> Service<Request<ReqBody>> for BoundedService<S>
where
    S: Service<Request<ReqBody>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Response = Response<BoundedBody<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let deadline = (!is_watch(&req)).then(|| Instant::now() + self.timeout);
        let timeout = self.timeout;
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = match deadline {
                Some(at) => tokio::time::timeout_at(at, answer).await.map_err(|_| Unanswered(timeout))?,
                None => answer.await,
            }
            .map_err(Into::into)?;
            let deadline = deadline.map(|at| Box::pin(tokio::time::sleep_until(at)));
            Ok(response.map(|inner| BoundedBody { inner, deadline, timeout }))
        })
    }
}

/// A response body that fails once the request's deadline has passed.
pub struct BoundedBody<B> {
    inner: B,
    deadline: Option<Pin<Box<Sleep>>>,
    timeout: Duration,
}

impl<B> Body for BoundedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match this.deadline.as_mut().map(|d| d.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(Some(Err(Unanswered(this.timeout).into()))),
            _ => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The API of a namespaced kind, in one namespace or in all.
pub fn scoped<K>(client: &kube::Client, namespace: Option<&str>) -> kube::Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    <K as kube::Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => kube::Api::namespaced(client.clone(), ns),
        None => kube::Api::all(client.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody, combinators::UnsyncBoxBody};
    use k8s_openapi::api::core::v1::{Pod, Secret};
    use kube::{Api, api::ListParams, client::Body as KubeBody};

    type Streamed = UnsyncBoxBody<Bytes, BoxError>;

    fn stalled_client(
        timeout: Duration,
    ) -> (kube::Client, tower_test::mock::Handle<Request<KubeBody>, Response<Streamed>>) {
        let (service, handle) = tower_test::mock::pair::<Request<KubeBody>, Response<Streamed>>();
        (kube::Client::new(Bounded::new(timeout).layer(service), "default"), handle)
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_without_an_answer_fails_at_its_deadline() {
        let (client, mut handle) = stalled_client(Duration::from_secs(15));
        // The server takes the request and never answers.
        let server = tokio::spawn(async move {
            let (req, reply) = handle.next_request().await.expect("the GET");
            assert_eq!(req.uri().path(), "/api/v1/namespaces/ns/secrets/s");
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(reply);
        });
        let started = Instant::now();
        let err = Api::<Secret>::namespaced(client, "ns").get("s").await.expect_err("no answer");
        assert_eq!(started.elapsed(), Duration::from_secs(15));
        assert!(err.to_string().contains("did not answer within 15s"), "{err}");
        server.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_midway_fails_at_the_deadline() {
        let (client, mut handle) = stalled_client(Duration::from_secs(15));
        let server = tokio::spawn(async move {
            let (_, reply) = handle.next_request().await.expect("the LIST");
            // Headers at once, then a body that never ends.
            let (mut tx, body) = futures::channel::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            tx.try_send(Ok(Frame::data(Bytes::from_static(b"{\"kind\":")))).unwrap();
            reply.send_response(Response::new(StreamBody::new(body).boxed_unsync()));
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(tx);
        });
        let started = Instant::now();
        let err = Api::<Pod>::namespaced(client, "ns").list(&ListParams::default()).await.expect_err("cut off");
        assert_eq!(started.elapsed(), Duration::from_secs(15));
        assert!(err.to_string().contains("did not answer within 15s"), "{err}");
        server.abort();
    }

    #[test]
    fn only_watches_go_unbounded() {
        let req = |uri: &str| Request::get(uri).body(()).unwrap();
        assert!(is_watch(&req("/api/v1/pods?watch=true&resourceVersion=5&timeoutSeconds=290")));
        assert!(is_watch(&req("/api/v1/pods?allowWatchBookmarks=true&watch=1")));
        assert!(!is_watch(&req("/api/v1/pods?limit=500")));
        assert!(!is_watch(&req("/api/v1/pods?fieldSelector=watch%3Dtrue")));
        assert!(!is_watch(&req("/api/v1/namespaces/ns/pods/p/status")));
    }
}
