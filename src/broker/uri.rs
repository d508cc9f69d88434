//! Broker addresses from a Secret: parsing, the cluster's nodes, the management endpoint, and
//! redaction.
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

use super::management::addressable;

/// A parsed broker address: AMQP plus the management API, with credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUri {
    amqp: AMQPUri,
    /// The nodes to connect to, in the order to try them: the Secret's `addresses`, else the
    /// URI's own host and port (which may be a load balancer in front of a cluster).
    nodes: Vec<Node>,
    management: ManagementEndpoint,
}

/// One `host:port` of a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Node {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", bracket_ipv6(&self.host), self.port)
    }
}

/// The management API: base URLs without credentials (one per node, tried in order), plus the
/// credentials, and rabbitmq_prometheus's per-object endpoint on each node.
#[derive(Clone, PartialEq, Eq)]
pub struct ManagementEndpoint {
    pub base_urls: Vec<Url>,
    pub username: String,
    pub password: String,
    /// `/metrics/detailed` of every node: the Secret's `prometheusUri`, else each management
    /// host on the plugin's port.
    pub metrics_urls: Vec<Url>,
}

impl ManagementEndpoint {
    /// The first base URL, the one tried first.
    pub fn base_url(&self) -> &Url {
        &self.base_urls[0]
    }
}

impl fmt::Debug for ManagementEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<&str> = self.base_urls.iter().map(Url::as_str).collect();
        write!(f, "ManagementEndpoint({})", urls.join(","))
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
        Self::parse_cluster(uri, management_uri, None)
    }

    /// Everything a Secret (or a RabbitmqCluster's default user) gives: `uri`, `managementUri`,
    /// `addresses` and `prometheusUri`.
    pub fn from_credentials(creds: &super::BrokerCredentials) -> Result<Self, UriError> {
        Self::parse_cluster(&creds.uri, creds.management_uri.as_deref(), creds.addresses.as_deref())?
            .with_prometheus(creds.prometheus_uri.as_deref())
    }

    /// rabbitmq_prometheus's endpoints from `prometheusUri` (http[s]://host:port, one per node,
    /// comma separated) instead of the management hosts on the plugin's default port: for a
    /// plugin that listens elsewhere or behind another address.
    pub fn with_prometheus(mut self, list: Option<&str>) -> Result<Self, UriError> {
        if let Some(list) = list.map(str::trim).filter(|l| !l.is_empty()) {
            self.management.metrics_urls =
                super::prometheus::parse_endpoints(list).map_err(|why| UriError { field: "prometheusUri", why })?;
        }
        Ok(self)
    }

    /// As [`Self::parse`], with the Secret's optional `addresses`: `host:port` of each node, comma
    /// separated, in the order to try (as Spring's `spring.rabbitmq.addresses`). The URI then
    /// gives only the scheme, credentials, vhost and options. `managementUri` may list one URL
    /// per node the same way; without it each node's own management port is used.
    pub fn parse_cluster(uri: &str, management_uri: Option<&str>, addresses: Option<&str>) -> Result<Self, UriError> {
        let err = |field, why: &str| UriError { field, why: why.to_owned() };
        let url = Url::parse(uri.trim()).map_err(|e| err("uri", &format!("not a URI ({e})")))?;
        // The parser reads `/.`, `/%2E` and `/..` as dot segments, that is as `/`: a vhost the
        // URI names that way would silently become the default vhost.
        if let Some(dot) = raw_path(uri.trim()).and_then(|p| decode(p).ok()).filter(|v| !addressable(v)) {
            return Err(err("uri", &format!("vhost {dot:?} cannot be used: URL paths read it as a dot segment")));
        }
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
        let nodes = match addresses.map(str::trim).filter(|a| !a.is_empty()) {
            Some(list) => parse_addresses(list, amqp.scheme.default_port())?,
            None => vec![Node { host: host.clone(), port }],
        };
        let management = match management_uri.map(str::trim).filter(|m| !m.is_empty()) {
            Some(list) => {
                let parsed = list
                    .split(',')
                    .map(|m| parse_management(m.trim(), &username, &password))
                    .collect::<Result<Vec<_>, _>>()?;
                let first = parsed[0].clone();
                ManagementEndpoint {
                    base_urls: parsed.into_iter().flat_map(|m| m.base_urls).collect(),
                    username: first.username,
                    password: first.password,
                    metrics_urls: Vec::new(),
                }
            }
            None => {
                let (scheme, port) = match scheme {
                    AMQPScheme::AMQP => ("http", 15672),
                    AMQPScheme::AMQPS => ("https", 15671),
                };
                let base_urls = nodes
                    .iter()
                    .map(|n| Url::parse(&format!("{scheme}://{}:{port}/", bracket_ipv6(&n.host))))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| err("uri", &format!("cannot derive the management URI ({e})")))?;
                ManagementEndpoint { base_urls, username, password, metrics_urls: Vec::new() }
            }
        };
        let management =
            ManagementEndpoint { metrics_urls: super::prometheus::endpoints(&management.base_urls), ..management };
        let mut amqp = amqp;
        amqp.authority.host = nodes[0].host.clone();
        amqp.authority.port = nodes[0].port;
        Ok(Self { amqp, nodes, management })
    }

    /// The nodes, in the order to try them.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The AMQP URI of one node.
    pub fn amqp_at(&self, node: &Node) -> AMQPUri {
        let mut amqp = self.amqp.clone();
        amqp.authority.host = node.host.clone();
        amqp.authority.port = node.port;
        amqp
    }

    /// The same broker, another vhost (spec.broker.vhost overrides the URI's; the plan refuses
    /// one that cannot be addressed).
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

    /// `amqp://host:5672/vhost` (`amqp://a:5672,b:5672/vhost` for several nodes): what logs,
    /// status and Events may show.
    pub fn display(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(Node::to_string).collect();
        format!(
            "{}://{}/{}",
            self.amqp.scheme,
            nodes.join(","),
            percent_encoding::utf8_percent_encode(&self.amqp.vhost, percent_encoding::NON_ALPHANUMERIC)
        )
    }

    /// A key that tells endpoints apart (credentials included) without holding them readable.
    pub fn endpoint_key(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.amqp.to_string().hash(&mut h);
        self.nodes.hash(&mut h);
        for url in self.management.base_urls.iter().chain(&self.management.metrics_urls) {
            url.as_str().hash(&mut h);
        }
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
    Ok(ManagementEndpoint { base_urls: vec![url], username: user, password: pass, metrics_urls: Vec::new() })
}

/// `host:port,host:port` (port optional, `[v6]:port` for IPv6). Never quotes the input back:
/// a Secret's value is no place to echo from.
fn parse_addresses(list: &str, default_port: u16) -> Result<Vec<Node>, UriError> {
    let err = |why: String| UriError { field: "addresses", why };
    list.split(',')
        .enumerate()
        .map(|(i, item)| {
            let item = item.trim();
            let url = Url::parse(&format!("amqp://{item}"))
                .ok()
                .filter(|u| u.username().is_empty() && u.path().is_empty() && u.query().is_none());
            let host = url.as_ref().and_then(|u| u.host_str()).filter(|h| !h.is_empty() && !item.is_empty());
            match host {
                Some(host) => Ok(Node {
                    host: host.trim_matches(['[', ']']).to_owned(),
                    port: url.as_ref().and_then(Url::port).unwrap_or(default_port),
                }),
                None => Err(err(format!("entry {} is not host:port (expected host:port,host:port,...)", i + 1))),
            }
        })
        .collect()
}

/// The path of a URI as written, before any normalisation: after the authority, up to the query
/// or fragment, without its leading `/`.
fn raw_path(uri: &str) -> Option<&str> {
    let rest = &uri[uri.find("://")? + 3..];
    let path = &rest[rest.find('/')? + 1..];
    Some(path.split(['?', '#']).next().unwrap_or_default())
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
        assert_eq!(uri.management().base_url().as_str(), "http://rabbit.shop.svc:15672/");
        assert_eq!(uri.management().username, "app");
        assert_eq!(uri.management().password, "s3cret");
    }

    #[test]
    fn a_dot_segment_vhost_is_refused_not_read_as_the_default() {
        for input in ["amqp://u:p@h/.", "amqp://u:p@h/%2E", "amqp://u:p@h/%2e%2E", "amqp://u:p@h/..?heartbeat=5"] {
            let e = BrokerUri::parse(input, None).expect_err(input);
            assert!(e.to_string().contains("dot segment"), "{input}: {e}");
        }
        assert_eq!(BrokerUri::parse("amqp://u:p@h/.orders", None).unwrap().vhost(), ".orders");
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
        assert_eq!(uri.management().base_url().as_str(), "https://mq.example.com:15671/");
    }

    #[test]
    fn management_uri_credentials_are_taken_out_of_the_url() {
        let uri = BrokerUri::parse("amqp://u:p@h/", Some("https://admin:pw%21@mgmt.example.com:443/rabbit")).unwrap();
        let m = uri.management();
        assert_eq!(m.base_url().as_str(), "https://mgmt.example.com/rabbit/");
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

    #[test]
    fn addresses_list_the_nodes_to_try_in_order() {
        let uri =
            BrokerUri::parse_cluster("amqp://u:p@lb.example.com/orders", None, Some("a:5701, b ,[::1]:5703")).unwrap();
        let nodes: Vec<String> = uri.nodes().iter().map(Node::to_string).collect();
        assert_eq!(nodes, ["a:5701", "b:5672", "[::1]:5703"]);
        assert_eq!(uri.display(), "amqp://a:5701,b:5672,[::1]:5703/orders");
        assert_eq!(uri.amqp_at(&uri.nodes()[1]).authority.host, "b");
        let urls: Vec<&str> = uri.management().base_urls.iter().map(Url::as_str).collect();
        assert_eq!(
            urls,
            ["http://a:15672/", "http://b:15672/", "http://[::1]:15672/"],
            "each node's own management port"
        );
        let listed =
            BrokerUri::parse_cluster("amqp://u:p@h/", Some("http://a:15701, http://b:15702"), Some("a:5701,b:5702"))
                .unwrap();
        let urls: Vec<&str> = listed.management().base_urls.iter().map(Url::as_str).collect();
        assert_eq!(urls, ["http://a:15701/", "http://b:15702/"]);
        assert_ne!(
            uri.endpoint_key(),
            BrokerUri::parse("amqp://u:p@lb.example.com/orders", None).unwrap().endpoint_key()
        );
    }

    #[test]
    fn rabbitmq_prometheus_sits_beside_each_management_api_unless_the_secret_says_where() {
        let creds = |prometheus: Option<&str>| super::super::BrokerCredentials {
            uri: "amqps://u:p@h/".into(),
            management_uri: None,
            ca_cert: None,
            addresses: Some("a:5671,b:5671".into()),
            prometheus_uri: prometheus.map(Into::into),
        };
        let metrics =
            |uri: &BrokerUri| -> Vec<String> { uri.management().metrics_urls.iter().map(Url::to_string).collect() };
        let derived = BrokerUri::from_credentials(&creds(None)).unwrap();
        assert_eq!(metrics(&derived), ["https://a:15691/metrics/detailed", "https://b:15691/metrics/detailed"]);
        let named = BrokerUri::from_credentials(&creds(Some("http://a:15693,http://b:15693"))).unwrap();
        assert_eq!(metrics(&named), ["http://a:15693/metrics/detailed", "http://b:15693/metrics/detailed"]);
        assert_ne!(derived.endpoint_key(), named.endpoint_key(), "a changed prometheusUri is another endpoint");
        let e = BrokerUri::from_credentials(&creds(Some("http://u:topsecret@a:15693"))).unwrap_err();
        assert_eq!(e.field, "prometheusUri");
        assert!(!e.to_string().contains("topsecret"), "{e}");
    }

    #[test]
    fn a_uri_without_addresses_is_one_node_and_bad_addresses_are_named_not_quoted() {
        let one = BrokerUri::parse_cluster("amqp://u:p@lb:5672/", None, Some("  ")).unwrap();
        assert_eq!(one.nodes(), [Node { host: "lb".into(), port: 5672 }]);
        assert_eq!(one.display(), "amqp://lb:5672/%2F");
        for bad in ["a:5701,,b:5702", "u:topsecret@a:1", "a:notaport", "a/x"] {
            let e = BrokerUri::parse_cluster("amqp://u:p@h/", None, Some(bad)).unwrap_err();
            assert_eq!(e.field, "addresses", "{bad}");
            assert!(!e.to_string().contains("topsecret"), "{e}");
        }
    }
}
