//! One rustls crypto provider (ring) for the whole process: kube, lapin and the management
//! client all use rustls, and the HTTP client needs a process default.

/// Installs ring as the process-wide provider; a second call (or another installer) is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
