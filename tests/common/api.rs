//! A mocked Kubernetes API server that hands each request to the test, in order, to check and
//! answer. A missing request times out; an unexpected one fails the assertion.

use http::{Request, Response, StatusCode};
use kube::{Client, client::Body};
use serde_json::Value;
use std::time::Duration;
use tower_test::mock::{Handle, SendResponse};

/// A client talking to the mock, and the mock's end.
pub fn mock_client() -> (Client, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), ApiServer(handle))
}

/// [`mock_client`] with every request but a watch bounded, as the operator's own client is
/// (`queueguard::kube_api`), here by `timeout`.
pub fn bounded_mock_client(timeout: Duration) -> (Client, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let service = tower::Layer::layer(&queueguard::kube_api::Bounded::new(timeout), service);
    (Client::new(service, "default"), ApiServer(handle))
}

pub struct ApiServer(pub Handle<Request<Body>, Response<Body>>);

pub struct Call {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Value,
    pub reply: SendResponse<Response<Body>>,
}

impl Call {
    pub fn respond(self, status: StatusCode, body: &Value) {
        self.reply.send_response(
            Response::builder().status(status).body(Body::from(serde_json::to_vec(body).unwrap())).unwrap(),
        );
    }
}

impl ApiServer {
    /// The next request, whatever it is, if one comes within `within` (None also once the client
    /// is gone).
    pub async fn next(&mut self, within: Duration) -> Option<Call> {
        let (req, reply) = tokio::time::timeout(within, self.0.next_request()).await.ok()??;
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        Some(Call {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or_default().to_owned(),
            content_type: parts.headers.get("content-type").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default(),
            body: if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() },
            reply,
        })
    }

    pub async fn expect(&mut self, method: &str, path: &str) -> Call {
        let call = self
            .next(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("expected {method} {path}, but no request came"));
        assert_eq!((call.method.as_str(), call.path.as_str()), (method, path), "unexpected request");
        let (group, resource, verb) = rbac_terms(&call.method, &call.path, &call.query);
        assert!(
            queueguard::rbac::allows(&group, &resource, &verb),
            "{method} {path} needs '{verb}' on {group}/{resource}, which queueguard::rbac::RULES does not grant"
        );
        call
    }
}

/// The RBAC (group, resource, verb) a request needs, read the way the API server reads it.
pub fn rbac_terms(method: &str, path: &str, query: &str) -> (String, String, String) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => (group.to_string(), rest),
        _ => panic!("not an API path: {path}"),
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        rest => rest,
    };
    let (resource, named) = match rest {
        [resource] => (resource.to_string(), false),
        [resource, _name] => (resource.to_string(), true),
        [resource, _name, sub] => (format!("{resource}/{sub}"), true),
        _ => panic!("unexpected API path: {path}"),
    };
    let verb = match (method, named) {
        ("GET", false) if query.contains("watch=true") => "watch",
        ("GET", false) => "list",
        ("GET", true) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => panic!("unexpected method {method} {path}"),
    };
    (group, resource, verb.to_owned())
}
