//! Response bodies read with a cap: an endpoint a Secret names (a management API, a
//! rabbitmq_prometheus listener) could answer with anything, and a body read whole before it is
//! judged can take the process's memory (measured: a 400 MB answer drove it to 834 MiB RSS).
//! Chunks are counted as they arrive, and a body past its cap is refused at once.

/// The most the operator reads of one answer: a vhost's queue listing of 1,000 queues (more are
/// read through a name filter), its consumers, or a node's detailed metrics take a few MiB.
pub const CAP: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("its answer passed {} MiB and was not read further (the operator reads at most that of one answer)", cap / (1024 * 1024))]
    TooLarge { cap: usize },
    #[error(transparent)]
    Read(#[from] reqwest::Error),
}

/// The body of `response`, at most `cap` bytes.
pub async fn read(mut response: reqwest::Response, cap: usize) -> Result<Vec<u8>, BodyError> {
    if response.content_length().is_some_and(|n| n > cap as u64) {
        return Err(BodyError::TooLarge { cap });
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > cap {
            return Err(BodyError::TooLarge { cap });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
