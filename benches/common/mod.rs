//! What the benchmarks share: the Kubernetes API in memory behind a real client, and the
//! process's memory.
#![allow(dead_code)] // each benchmark uses a different subset

use http::{Request, Response, StatusCode};
use kube::{Client, client::Body};
use serde_json::Value;
use std::convert::Infallible;

/// A kube Client whose every request `answer` handles (method, path, body) in memory.
pub fn client<F>(answer: F) -> Client
where
    F: Fn(&str, &str, &[u8]) -> (StatusCode, Value) + Clone + Send + Sync + 'static,
{
    let service = tower::service_fn(move |req: Request<Body>| {
        let answer = answer.clone();
        async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let (status, value) = answer(parts.method.as_str(), parts.uri.path(), &bytes);
            Ok::<_, Infallible>(
                Response::builder().status(status).body(Body::from(serde_json::to_vec(&value).unwrap())).unwrap(),
            )
        }
    });
    Client::new(service, "default")
}

/// VmHWM (peak) or VmRSS (now) of this process, in MiB.
pub fn rss_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

pub fn base64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}
