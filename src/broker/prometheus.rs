//! Queue counters from the `rabbitmq_prometheus` plugin's per-object endpoint
//! (`/metrics/detailed`), where the broker has it: RabbitMQ's recommended source since 4.0
//! deprecated the management plugin's statistics. With it, a vhost's listing is the management
//! API's queues without statistics (`disable_stats`: names, arguments, policy) plus, from every
//! node, each queue's depths, consumer count, acks and redeliveries. Not the management API's
//! `enable_queue_totals` for the depths: it asks every queue process, which wakes it and resets
//! its `idle_since` (measured on 3.10: a listing a second keeps every queue from ever looking
//! idle), while these counters are read from the nodes' metrics tables.
//!
//! The plugin answers on each node's own port 15692 (15691 with TLS), next to its management
//! API, unless the Secret's `prometheusUri` names other addresses, and reports only what lives on
//! that node: every node is read. It is used only after it
//! has answered for the same cluster the management API names (its `rabbitmq_identity_info`),
//! so a port 15692 that belongs to another broker on the same host is never read as this one.

use reqwest::Url;
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// The families read: depths and consumers per queue, acks and redeliveries per channel and
/// queue.
const FAMILIES: &str = "family=queue_coarse_metrics&family=queue_consumer_count&family=channel_queue_metrics";
/// How long after the endpoint did not answer it is asked again.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);
const TIMEOUT: Duration = Duration::from_secs(10);

pub use crate::crd::StatsSource;

/// One queue's counters, summed over the nodes and channels that report them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    pub ready: i64,
    pub unacked: i64,
    pub consumers: i64,
    /// Acks of deliveries (basic.consume and basic.get with acks): cumulative per channel, so
    /// the sum drops when a channel closes.
    pub acks: u64,
    pub redeliveries: u64,
}

/// What is known of the endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum Detection {
    Unknown,
    /// It answered for the management API's cluster (`cluster`) at these URLs (one per node).
    Available {
        urls: Vec<Url>,
        cluster: String,
    },
    /// It did not, at that time.
    Unavailable(Instant),
    /// Not to be asked (the management API's statistics only).
    Off,
}

/// The per-node metrics URLs for the management API's base URLs: the same host, the plugin's
/// port.
pub fn endpoints(management: &[Url]) -> Vec<Url> {
    management
        .iter()
        .filter_map(|m| {
            let tls = m.scheme() == "https";
            let mut url = m.clone();
            url.set_port(Some(if tls { 15691 } else { 15692 })).ok()?;
            url.set_path("/metrics/detailed");
            url.set_query(None);
            Some(url)
        })
        .collect()
}

/// The Secret's `prometheusUri`: http[s]://host:port[/prefix], one per node, comma separated.
/// Refuses credentials (the plugin's endpoint takes none, and its URLs reach the logs). Never
/// quotes the input back.
pub fn parse_endpoints(list: &str) -> Result<Vec<Url>, String> {
    list.split(',')
        .map(|one| {
            let mut url = Url::parse(one.trim()).map_err(|e| format!("not a URI ({e})"))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(format!("scheme must be http or https, not {:?}", url.scheme()));
            }
            if url.host_str().is_none_or(str::is_empty) {
                return Err("has no host".into());
            }
            if !url.username().is_empty() || url.password().is_some() {
                return Err("must not carry credentials (rabbitmq_prometheus takes none)".into());
            }
            let path = format!("{}/metrics/detailed", url.path().trim_end_matches('/'));
            url.set_path(&path);
            url.set_query(None);
            url.set_fragment(None);
            Ok(url)
        })
        .collect()
}

/// Reads one node's counters of `vhost`, checking that it belongs to `cluster`.
pub async fn scrape(
    http: &reqwest::Client,
    node: &Url,
    vhost: &str,
    cluster: &str,
) -> Result<HashMap<String, Counters>, String> {
    let mut url = node.clone();
    let vhost_param: String = url::form_urlencoded::byte_serialize(vhost.as_bytes()).collect();
    url.set_query(Some(&format!("vhost={vhost_param}&{FAMILIES}&family=identity_info")));
    let answer = http.get(url.clone()).timeout(TIMEOUT).send().await.map_err(|e| format!("{node}: {e}"))?;
    if !answer.status().is_success() {
        return Err(format!("{node}: HTTP {}", answer.status()));
    }
    let body = super::body::read(answer, super::body::CAP).await.map_err(|e| format!("{node}: {e}"))?;
    let text = String::from_utf8_lossy(&body);
    let samples = parse(&text);
    let theirs = samples
        .iter()
        .find(|s| s.name == "rabbitmq_identity_info")
        .and_then(|s| s.label("rabbitmq_cluster"))
        .unwrap_or_default();
    if theirs != cluster {
        return Err(format!("{node} answers for cluster '{theirs}', not '{cluster}'"));
    }
    Ok(counters(&samples, vhost))
}

/// Adds one node's counters to the others'.
pub fn merge(into: &mut HashMap<String, Counters>, node: HashMap<String, Counters>) {
    for (queue, c) in node {
        let total = into.entry(queue).or_default();
        total.ready += c.ready;
        total.unacked += c.unacked;
        total.consumers += c.consumers;
        total.acks += c.acks;
        total.redeliveries += c.redeliveries;
    }
}

/// Each queue's counters in `vhost`, from one node's samples.
fn counters(samples: &[Sample], vhost: &str) -> HashMap<String, Counters> {
    let mut out: HashMap<String, Counters> = HashMap::new();
    for s in samples.iter().filter(|s| s.label("vhost") == Some(vhost)) {
        let Some(queue) = s.label("queue") else { continue };
        let c = out.entry(queue.to_owned()).or_default();
        match s.name.as_str() {
            "rabbitmq_detailed_queue_messages_ready" => c.ready += s.value as i64,
            "rabbitmq_detailed_queue_messages_unacked" => c.unacked += s.value as i64,
            "rabbitmq_detailed_queue_consumers" => c.consumers += s.value as i64,
            "rabbitmq_detailed_channel_messages_acked_total" => c.acks += s.value as u64,
            "rabbitmq_detailed_channel_messages_redelivered_total" => c.redeliveries += s.value as u64,
            _ => {}
        }
    }
    out
}

/// One line of the text exposition format.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// The samples of a text exposition (comments and malformed lines skipped). Label values are
/// unescaped (`\\`, `\"`, `\n`): queue names may hold any character.
fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let (name, rest) = match line.find('{') {
        Some(open) => (&line[..open], &line[open + 1..]),
        None => {
            let (name, value) = line.split_once(' ')?;
            return Some(Sample { name: name.to_owned(), labels: vec![], value: value.trim().parse().ok()? });
        }
    };
    let mut labels = Vec::new();
    let mut chars = rest.char_indices().peekable();
    let end = loop {
        while chars.peek().is_some_and(|(_, c)| *c == ',' || *c == ' ') {
            chars.next();
        }
        let (start, c) = chars.next()?;
        if c == '}' {
            break start;
        }
        let eq = rest[start..].find('=')? + start;
        let key = rest[start..eq].to_owned();
        while chars.peek().is_some_and(|(i, _)| *i <= eq) {
            chars.next();
        }
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()?.1 {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break,
                other => value.push(other),
            }
        }
        labels.push((key, value));
    };
    let value = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some(Sample { name: name.to_owned(), labels, value })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: &str = r#"rabbitmq_detailed_queue_messages_ready{vhost="/",queue="orders"} 40
rabbitmq_detailed_queue_messages_unacked{vhost="/",queue="orders"} 3
# TYPE rabbitmq_detailed_queue_consumers gauge
rabbitmq_detailed_queue_consumers{vhost="/",queue="orders"} 2
rabbitmq_detailed_queue_consumers{vhost="/",queue="we\"ird,q\\ue{ue}"} 1
rabbitmq_detailed_queue_consumers{vhost="other",queue="orders"} 7
# TYPE rabbitmq_detailed_channel_messages_acked_total counter
rabbitmq_detailed_channel_messages_acked_total{channel="<0.1.0>",vhost="/",queue="orders"} 5
rabbitmq_detailed_channel_messages_acked_total{channel="<0.2.0>",vhost="/",queue="orders"} 7
rabbitmq_detailed_channel_messages_redelivered_total{channel="<0.1.0>",vhost="/",queue="orders"} 2
rabbitmq_detailed_channel_get_total{channel="<0.1.0>",vhost="/",queue="orders"} 9
rabbitmq_identity_info{rabbitmq_node="rabbit@a",rabbitmq_cluster="rabbit@a",rabbitmq_cluster_permanent_id="x"} 1
"#;

    #[test]
    fn a_nodes_samples_sum_per_queue_of_the_vhost() {
        let samples = parse(NODE);
        let c = counters(&samples, "/");
        assert_eq!(
            c["orders"],
            Counters { ready: 40, unacked: 3, consumers: 2, acks: 12, redeliveries: 2 },
            "acks over both channels"
        );
        assert_eq!(c["we\"ird,q\\ue{ue}"].consumers, 1, "escaped label values read back");
        assert_eq!(counters(&samples, "other")["orders"].consumers, 7);
        let identity = samples.iter().find(|s| s.name == "rabbitmq_identity_info").unwrap();
        assert_eq!(identity.label("rabbitmq_cluster"), Some("rabbit@a"));
    }

    #[test]
    fn nodes_add_up_and_endpoints_sit_beside_each_management_api() {
        let mut total = counters(&parse(NODE), "/");
        let other = Counters { ready: 0, unacked: 1, consumers: 1, acks: 3, redeliveries: 0 };
        merge(&mut total, HashMap::from([("orders".into(), other)]));
        assert_eq!(total["orders"], Counters { ready: 40, unacked: 4, consumers: 3, acks: 15, redeliveries: 2 });
        let urls = endpoints(&["http://a:15672/".parse().unwrap(), "https://b:15671/prefix/".parse().unwrap()]);
        let urls: Vec<&str> = urls.iter().map(Url::as_str).collect();
        assert_eq!(urls, ["http://a:15692/metrics/detailed", "https://b:15691/metrics/detailed"]);
        assert!(parse("garbage{\nx 1\n").iter().all(|s| s.name == "x"), "malformed lines are skipped");
    }

    #[test]
    fn a_secret_may_name_the_plugins_addresses() {
        let urls = parse_endpoints("http://a:15693, https://b:9419/rabbit/").unwrap();
        let urls: Vec<&str> = urls.iter().map(Url::as_str).collect();
        assert_eq!(urls, ["http://a:15693/metrics/detailed", "https://b:9419/rabbit/metrics/detailed"]);
        for (bad, why) in [
            ("amqp://a:5672", "scheme must be http or https"),
            ("http://a:1,", "not a URI"),
            ("http://u:s3cret@a:15692", "must not carry credentials"),
        ] {
            let e = parse_endpoints(bad).unwrap_err();
            assert!(e.contains(why) && !e.contains("s3cret"), "{bad}: {e}");
        }
    }
}
