//! Broker addresses from a Secret: parsing, the management endpoint, and redaction.
//!
//! Credentials live only inside [`BrokerUri`]; everything that can reach a log, a status or an
//! Event goes through [`BrokerUri::display`] or [`BrokerUri::redact`].

use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use percent_encoding::percent_decode_str;
use std::{
    collections::hash_map::DefaultHasher,
    fmt,
    hash::{Hash, Hasher},
};
use url::Url;

/// A parsed broker address: AMQP plus the management API, with credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUri {
    amqp: AMQPUri,
    management: ManagementEndpoint,
}

/// The management API: a base URL without credentials, plus the credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct ManagementEndpoint {
    pub base_url: Url,
    pub username: String,
    pub password: String,
}

impl fmt::Debug for ManagementEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManagementEndpoint({})", self.base_url)
    }
}

impl fmt::Debug for BrokerUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BrokerUri({})", self.display())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct UriError {
    pub field: &'static str,
    pub why: String,
}

impl BrokerUri {
    /// Parses the Secret's `uri` and optional `managementUri`. Error messages never quote the
    /// input, since it carries a password.
    pub fn parse(uri: &str, management_uri: Option<&str>) -> Result<Self, UriError> {
        let err = |field, why: &str| UriError { field, why: why.to_owned() };
        let url = Url::parse(uri.trim()).map_err(|e| err("uri", &format!("not a URI ({e})")))?;
        let scheme = match url.scheme() {
            "amqp" => AMQPScheme::AMQP,
            "amqps" => AMQPScheme::AMQPS,
            other => {
                return Err(err("uri", &format!("scheme must be amqp or amqps, not {other:?}")));
            }
        };
        let host = url.host_str().filter(|h| !h.is_empty()).ok_or_else(|| err("uri", "has no host"))?.to_owned();
        let port = url.port().unwrap_or_else(|| scheme.default_port());
        let username = decode(url.username()).map_err(|_| err("uri", "user name is not UTF-8"))?;
        let password = decode(url.password().unwrap_or("")).map_err(|_| err("uri", "password is not UTF-8"))?;
        if username.is_empty() {
            return Err(err("uri", "has no user name (amqp://user:password@host:port/vhost)"));
        }
        // `amqp://host` and `amqp://host/` both mean the default vhost, as most clients read them.
        let vhost = match url.path() {
            "" | "/" => "/".to_owned(),
            path => decode(&path[1..]).map_err(|_| err("uri", "vhost is not UTF-8"))?,
        };
        let heartbeat = url
            .query_pairs()
            .find(|(k, _)| k == "heartbeat")
            .map(|(_, v)| v.parse::<u16>())
            .transpose()
            .map_err(|_| err("uri", "heartbeat must be a number of seconds"))?;
        let amqp = AMQPUri {
            scheme: scheme.clone(),
            authority: AMQPAuthority {
                userinfo: AMQPUserInfo { username: username.clone(), password: password.clone() },
                host: host.clone(),
                port,
            },
            vhost,
            query: AMQPQueryString { heartbeat, ..Default::default() },
        };
        let management = match management_uri.map(str::trim).filter(|m| !m.is_empty()) {
            Some(m) => parse_management(m, &username, &password)?,
            None => {
                let (scheme, port) = match scheme {
                    AMQPScheme::AMQP => ("http", 15672),
                    AMQPScheme::AMQPS => ("https", 15671),
                };
                let base_url = Url::parse(&format!("{scheme}://{}:{port}/", bracket_ipv6(&host)))
                    .map_err(|e| err("uri", &format!("cannot derive the management URI ({e})")))?;
                ManagementEndpoint { base_url, username, password }
            }
        };
        Ok(Self { amqp, management })
    }

    /// The same broker, another vhost (spec.broker.vhost overrides the URI's).
    pub fn with_vhost(mut self, vhost: &str) -> Self {
        self.amqp.vhost = vhost.to_owned();
        self
    }

    pub fn vhost(&self) -> &str {
        &self.amqp.vhost
    }

    pub fn amqp(&self) -> &AMQPUri {
        &self.amqp
    }

    pub fn management(&self) -> &ManagementEndpoint {
        &self.management
    }

    pub fn is_tls(&self) -> bool {
        self.amqp.scheme == AMQPScheme::AMQPS
    }

    /// `amqp://host:5672/vhost`: what logs, status and Events may show.
    pub fn display(&self) -> String {
        format!(
            "{}://{}:{}/{}",
            self.amqp.scheme,
            self.amqp.authority.host,
            self.amqp.authority.port,
            percent_encoding::utf8_percent_encode(&self.amqp.vhost, percent_encoding::NON_ALPHANUMERIC)
        )
    }

    /// A key that tells endpoints apart (credentials included) without holding them readable.
    pub fn endpoint_key(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.amqp.to_string().hash(&mut h);
        self.management.base_url.as_str().hash(&mut h);
        self.management.username.hash(&mut h);
        self.management.password.hash(&mut h);
        h.finish()
    }

    /// Removes every credential of this broker from `text`, as a last line of defence for
    /// messages that quote errors from libraries.
    pub fn redact(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for secret in [&self.amqp.authority.userinfo.password, &self.management.password] {
            if secret.len() >= 3 {
                out = out.replace(secret.as_str(), "***");
            }
        }
        out
    }
}

fn parse_management(uri: &str, username: &str, password: &str) -> Result<ManagementEndpoint, UriError> {
    let err = |why: String| UriError { field: "managementUri", why };
    let mut url = Url::parse(uri).map_err(|e| err(format!("not a URI ({e})")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(err(format!("scheme must be http or https, not {:?}", url.scheme())));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(err("has no host".into()));
    }
    let (user, pass) = if url.username().is_empty() {
        (username.to_owned(), password.to_owned())
    } else {
        let user = decode(url.username()).map_err(|_| err("user name is not UTF-8".into()))?;
        let pass = decode(url.password().unwrap_or("")).map_err(|_| err("password is not UTF-8".into()))?;
        (user, pass)
    };
    let _ = url.set_username("");
    let _ = url.set_password(None);
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    url.set_query(None);
    Ok(ManagementEndpoint { base_url: url, username: user, password: pass })
}

fn decode(s: &str) -> Result<String, std::str::Utf8Error> {
    percent_decode_str(s).decode_utf8().map(|c| c.into_owned())
}

fn bracket_ipv6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_amqp_with_defaults() {
        let uri = BrokerUri::parse("amqp://app:s3cret@rabbit.shop.svc:5672/orders", None).unwrap();
        assert_eq!(uri.vhost(), "orders");
        assert_eq!(uri.amqp().authority.host, "rabbit.shop.svc");
        assert_eq!(uri.display(), "amqp://rabbit.shop.svc:5672/orders");
        assert_eq!(uri.management().base_url.as_str(), "http://rabbit.shop.svc:15672/");
        assert_eq!(uri.management().username, "app");
        assert_eq!(uri.management().password, "s3cret");
    }

    #[test]
    fn ip_hosts_and_default_vhost_forms() {
        for input in ["amqp://u:p@10.0.0.7", "amqp://u:p@10.0.0.7/", "amqp://u:p@10.0.0.7/%2F"] {
            let uri = BrokerUri::parse(input, None).unwrap();
            assert_eq!(uri.amqp().authority.host, "10.0.0.7", "{input}");
            assert_eq!(uri.amqp().authority.port, 5672);
            assert_eq!(uri.vhost(), "/", "{input}");
        }
    }

    #[test]
    fn amqps_defaults_to_tls_ports() {
        let uri = BrokerUri::parse("amqps://u:p@mq.example.com/v", None).unwrap();
        assert!(uri.is_tls());
        assert_eq!(uri.amqp().authority.port, 5671);
        assert_eq!(uri.management().base_url.as_str(), "https://mq.example.com:15671/");
    }

    #[test]
    fn management_uri_credentials_are_taken_out_of_the_url() {
        let uri = BrokerUri::parse("amqp://u:p@h/", Some("https://admin:pw%21@mgmt.example.com:443/rabbit")).unwrap();
        let m = uri.management();
        assert_eq!(m.base_url.as_str(), "https://mgmt.example.com/rabbit/");
        assert_eq!((m.username.as_str(), m.password.as_str()), ("admin", "pw!"));
        let inherited = BrokerUri::parse("amqp://u:p@h/", Some("http://mgmt:15672")).unwrap();
        assert_eq!(inherited.management().username, "u");
    }

    #[test]
    fn errors_never_quote_the_secret() {
        for (input, needle) in [
            ("http://u:topsecret@h/", "scheme"),
            ("amqp://:topsecret@h/", "user name"),
            ("not a uri topsecret", "not a URI"),
            ("amqp://u:topsecret@h/?heartbeat=x", "heartbeat"),
        ] {
            let err = BrokerUri::parse(input, None).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
            assert!(!err.contains("topsecret"), "{err}");
        }
        let err = BrokerUri::parse("amqp://u:p@h/", Some("ftp://x:topsecret@h")).unwrap_err();
        assert_eq!(err.field, "managementUri");
        assert!(!err.to_string().contains("topsecret"));
    }

    #[test]
    fn debug_display_and_redact_hide_credentials() {
        let uri = BrokerUri::parse("amqp://app:hunter22@h:5672/v", Some("http://admin:mgmtpass@h:15672")).unwrap();
        for shown in [format!("{uri:?}"), uri.display()] {
            assert!(!shown.contains("hunter22") && !shown.contains("mgmtpass"), "{shown}");
        }
        assert_eq!(uri.redact("auth failed for hunter22 and mgmtpass"), "auth failed for *** and ***");
    }

    #[test]
    fn vhost_override_changes_the_endpoint() {
        let a = BrokerUri::parse("amqp://u:p@h/", None).unwrap();
        let b = a.clone().with_vhost("other");
        assert_eq!(b.vhost(), "other");
        assert_ne!(a.endpoint_key(), b.endpoint_key());
        let c = BrokerUri::parse("amqp://u:other@h/", None).unwrap();
        assert_ne!(a.endpoint_key(), c.endpoint_key());
    }
}
